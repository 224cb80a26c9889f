#!lua
-- Schedule recovery's look at partitions in the recovery index, by the server's clock.
-- KEYS[1] the recovery index (sorted set: "<rid> <partition>" -> when to look)
-- ARGV[1] mode: 'LT' (only ever earlier), 'XLT' (only ever earlier, and only entries that
-- exist), 'GT' (only ever later), 'SET', 'AT' (SET, with ARGV[2] a server time, not
-- seconds from now), or 'REM'
-- ARGV[2] seconds from now   ARGV[3..] members
-- The index is a hint that never comes later than the check time held in the request's
-- lease hash, which claim_step decides by: a look that comes too early only finds the step
-- not due yet. Returns the server's time.
local t = now()
if ARGV[1] == 'REM' then
  redis.call('ZREM', KEYS[1], unpack(ARGV, 3))
  return exact(t)
end
local at = ARGV[1] == 'AT' and tonumber(ARGV[2]) or t + tonumber(ARGV[2])
local args = {}
for i = 3, #ARGV do
  args[#args + 1] = at
  args[#args + 1] = ARGV[i]
end
if ARGV[1] == 'SET' or ARGV[1] == 'AT' then
  redis.call('ZADD', KEYS[1], unpack(args))
elseif ARGV[1] == 'XLT' then
  redis.call('ZADD', KEYS[1], 'XX', 'LT', unpack(args))
else
  redis.call('ZADD', KEYS[1], ARGV[1], unpack(args))
end
return exact(t)
