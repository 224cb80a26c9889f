-- Record that the step a lease covered was sent: the lease ends, its token stays the
-- partition's current one (so a resent release succeeds) until the next grant.
-- KEYS[1] the request's lease hash
-- ARGV[1] partition name   ARGV[2] the lease's fencing token
-- Returns {'OK'} or {'FENCED', token} when a newer lease was granted meanwhile.
local fenced = check_fence(KEYS[1], ARGV[1], ARGV[2])
if fenced then return fenced end
local p = ARGV[1]
redis.call('HDEL', KEYS[1], 'holder[' .. p .. ']', 'expires[' .. p .. ']', 'pass[' .. p .. ']')
return {'OK'}
