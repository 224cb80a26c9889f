#!lua flags=allow-oom
-- Remove a request and every key it holds, in one step.
-- KEYS[1] the request's meta hash   KEYS[2] its lease hash
-- KEYS[3..] every other key the request may hold, for the topology the caller knows
-- ARGV[1] the number k of partitions the caller knows, ARGV[2..1+k] their names, then the
-- number c of connections and their names   ARGV[...] then the partition of the caller's
-- lease ('' for none, '*' for a request-level fence) and its token
-- Returns {'OK'} (deleted), {'GONE'} (no meta: left-over keys of an interrupted create or
-- delete were removed), {'SHAPE'} (the request holds other partitions or connections than
-- the caller knows: nothing deleted, read its topology and try again) or {'FENCED', ...}.
local function list_matches(name, first, n)
  if tonumber(redis.call('HGET', KEYS[1], name) or '0') ~= n then return false end
  for i = 0, n - 1 do
    if redis.call('HGET', KEYS[1], name .. '[' .. i .. ']') ~= ARGV[first + i] then
      return false
    end
  end
  return true
end
local k = tonumber(ARGV[1])
local c = tonumber(ARGV[2 + k])
local fence_at = 3 + k + c
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('UNLINK', unpack(KEYS))
  return {'GONE'}
end
if not (list_matches('partitions', 2, k) and list_matches('connections', 3 + k, c)) then
  return {'SHAPE'}
end
if ARGV[fence_at] ~= '' then
  local fenced = check_fence(KEYS[2], ARGV[fence_at], ARGV[fence_at + 1], now())
  if fenced then return fenced end
end
redis.call('UNLINK', unpack(KEYS))
return {'OK'}
