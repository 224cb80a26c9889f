#!lua
-- The request is done: keep it `keep_for` more seconds for inspection, then let every key
-- expire; its leases end and recovery no longer looks at it.
-- KEYS[1] the request's meta hash   KEYS[2] its lease hash   KEYS[3] its history stream
-- KEYS[4..] every other key the request may hold (they expire with it)
-- ARGV[1] schema version   ARGV[2] partition of the caller's lease ('*' for none)
-- ARGV[3] its fencing token ('' for none: then refused while any replica holds a live
-- lease on the request)   ARGV[4] keep_for (seconds)   ARGV[5] history cap
-- ARGV[6] the encoded finished_at field value
-- Returns {'OK'}, {'FENCED', token, partition} or NOKEY/SCHEMA.
local bad = check_records({KEYS[1]}, ARGV[1])
if bad then return bad end
local lease = KEYS[2]
local fenced = check_fence(lease, ARGV[2], ARGV[3], now())
if fenced then
  history(KEYS[3], ARGV[5], KEYS[1], {'op', 'finish', 'partition', fenced[3] or '',
    'outcome', 'fenced', 'token', ARGV[3], 'detail', 'current token ' .. fenced[2]})
  return fenced
end
redis.call('HSET', KEYS[1], 'finished_at', ARGV[6], '_finished', '1')
-- No partition is driven any more: drop holders and check times, keep the tokens (a late
-- write fenced with an old lease is still refused), and say so to the report script,
-- which cannot see the meta hash.
local flat = redis.call('HGETALL', lease)
local doomed = {}
for i = 1, #flat, 2 do
  local name = flat[i]
  if string.sub(name, 1, 7) == 'holder[' or string.sub(name, 1, 8) == 'expires['
      or string.sub(name, 1, 6) == 'check[' or string.sub(name, 1, 5) == 'pass[' then
    doomed[#doomed + 1] = name
  end
end
if #doomed > 0 then redis.call('HDEL', lease, unpack(doomed)) end
redis.call('HSET', lease, 'finished', '1')  -- a late completing report gets no lease
history(KEYS[3], ARGV[5], KEYS[1], {'op', 'finish', 'outcome', 'applied', 'token', ARGV[3],
  'detail', 'kept ' .. ARGV[4] .. ' s'})
local ms = math.max(1, math.floor(tonumber(ARGV[4]) * 1000))
for _, key in ipairs(KEYS) do redis.call('PEXPIRE', key, ms) end
return {'OK'}
