#!lua
-- Create every hash of a new request at once, or nothing.
-- KEYS[1]      the request's meta hash
-- KEYS[2]      the request's lease hash       KEYS[3] the request's history stream
-- KEYS[4]      the recovery index (the lease hash on a cluster: see index_check in _lib.lua)
-- KEYS[5..]    the request's other hashes (partitions, publish info, connections)
-- ARGV[1]      the create's operation id, kept in meta field "_op" so a resent create
--              (connection lost after sending) is recognised as the same one
-- ARGV[2]      history cap ('0': off)
-- ARGV[3]      seconds until recovery should first look at each partition ('' : never)
-- ARGV[4]      the number k of partitions, ARGV[5..4+k] their names
-- ARGV[5+k..]  per hash, in KEYS order (meta, then KEYS[5..]): a field count n, then n
--              field/value pairs
-- Returns {'OK'}, {'DUP'} (this operation created it already) or {'EXISTS'}.
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], '_op') == ARGV[1] then return {'DUP'} end
  return {'EXISTS'}
end
-- Keys left behind by an interrupted delete must not leak into the new request.
redis.call('DEL', KEYS[2], KEYS[3])
local k = tonumber(ARGV[4])
local pos = 5 + k
for i, key in ipairs(KEYS) do
  if i == 1 or i > 4 then
    redis.call('DEL', key)
    local n = tonumber(ARGV[pos])
    if n > 0 then hset_pairs(key, pos + 1, pos + 2 * n) end
    pos = pos + 1 + 2 * n
  end
end
redis.call('HSET', KEYS[1], '_op', ARGV[1])
if ARGV[3] ~= '' then
  local at = now() + tonumber(ARGV[3])
  for i = 5, 4 + k do
    redis.call('HSET', KEYS[2], 'check[' .. ARGV[i] .. ']', at)
    index_check(KEYS[4], KEYS[2], ARGV[i], at)
  end
end
history(KEYS[3], ARGV[2], KEYS[1], {'op', 'create', 'outcome', 'applied'})
return {'OK'}
