-- Create every hash of a new request at once, or nothing.
-- KEYS[1]      the request's meta hash
-- KEYS[2..]    the request's other hashes (partitions, publish info, connections)
-- ARGV[1]      the create's operation id, kept in meta field "_op" so a resent create
--              (connection lost after sending) is recognised as the same one
-- ARGV[2..]    per key, in KEYS order: a field count n, then n field/value pairs
-- Returns {'OK'}, {'DUP'} (this operation created it already) or {'EXISTS'}.
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], '_op') == ARGV[1] then return {'DUP'} end
  return {'EXISTS'}
end
local pos = 2
for _, key in ipairs(KEYS) do
  -- A key left behind by an interrupted delete must not leak into the new request.
  redis.call('DEL', key)
  local n = tonumber(ARGV[pos])
  if n > 0 then hset_pairs(key, pos + 1, pos + 2 * n) end
  pos = pos + 1 + 2 * n
end
redis.call('HSET', KEYS[1], '_op', ARGV[1])
return {'OK'}
