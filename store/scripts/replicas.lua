#!lua flags=allow-oom
-- Replica heartbeats by the server's clock (sorted set: replica id -> last beat, seconds).
-- KEYS[1] the registry   ARGV[1] 'beat' (ARGV[2] the replica), 'live' (ARGV[2] seconds:
-- who beat within that long) or 'prune' (ARGV[2] seconds: forget who was silent that long)
-- Returns nothing for 'beat', the live ids for 'live', how many were forgotten for 'prune'.
local t = now()
if ARGV[1] == 'beat' then
  redis.call('ZADD', KEYS[1], t, ARGV[2])
  return 'OK'
elseif ARGV[1] == 'live' then
  return redis.call('ZRANGEBYSCORE', KEYS[1], t - tonumber(ARGV[2]), '+inf')
end
return redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (t - tonumber(ARGV[2])))
