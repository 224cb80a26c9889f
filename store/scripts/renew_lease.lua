-- Extend a lease its holder still has.
-- KEYS[1] the request's lease hash
-- ARGV[1] partition name   ARGV[2] the lease's fencing token   ARGV[3] new expiry (seconds)
-- Returns {'OK'} or {'FENCED', token}.
local fenced = check_fence(KEYS[1], ARGV[1], ARGV[2])
if fenced then return fenced end
if not redis.call('HGET', KEYS[1], 'holder[' .. ARGV[1] .. ']') then return {'FENCED', ARGV[2]} end
redis.call('HSET', KEYS[1], 'expires[' .. ARGV[1] .. ']', ARGV[3])
return {'OK'}
