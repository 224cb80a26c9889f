-- The partitions whose look is due by the server's clock, oldest first.
-- KEYS[1] the recovery index   ARGV[1] how many at most
-- Returns {server_time, member, score, member, score, ...}.
local t = now()
local out = {exact(t)}
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', t, 'WITHSCORES', 'LIMIT', 0, ARGV[1])
for _, v in ipairs(due) do out[#out + 1] = v end
return out
