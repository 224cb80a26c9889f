-- Take over partition p's next step when no live lease covers it (its driver died).
-- KEYS[1] the request's lease hash   KEYS[2] the partition hash
-- ARGV[1] schema version   ARGV[2] partition name   ARGV[3] claiming replica
-- ARGV[4] now (seconds)    ARGV[5] lease time to live (seconds)
-- Returns {'OK', token, current_pass, is_done}, {'HELD', holder, expires_at} while another
-- lease is live, or NOKEY/SCHEMA.
local bad = check_records({KEYS[2]}, ARGV[1])
if bad then return bad end
local p = ARGV[2]
local expires = redis.call('HGET', KEYS[1], 'expires[' .. p .. ']')
if expires and tonumber(expires) > tonumber(ARGV[4]) then
  return {'HELD', redis.call('HGET', KEYS[1], 'holder[' .. p .. ']'), expires}
end
local current = redis.call('HGET', KEYS[2], 'fwd_pass_number')
local token = grant_lease(KEYS[1], p, ARGV[3], ARGV[4], ARGV[5], current)
return {'OK', token, current, redis.call('HGET', KEYS[2], 'is_done')}
