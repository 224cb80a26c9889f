-- Add tokens to a streaming connection's token_count, once per operation id.
-- KEYS[1] the connection hash   KEYS[2] the request's ops sorted set
-- ARGV[1] schema version  ARGV[2] tokens to add  ARGV[3] op id  ARGV[4] now  ARGV[5] window
-- Returns {'OK', token_count}, {'DUP', token_count} or NOKEY/SCHEMA.
local bad = check_records({KEYS[1]}, ARGV[1])
if bad then return bad end
if op_seen(KEYS[2], ARGV[3]) then
  return {'DUP', tonumber(redis.call('HGET', KEYS[1], 'token_count') or '0')}
end
local count = redis.call('HINCRBY', KEYS[1], 'token_count', ARGV[2])
record_op(KEYS[2], ARGV[3], ARGV[4], ARGV[5])
return {'OK', count}
