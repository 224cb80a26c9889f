#!lua
-- Add tokens to a streaming connection's token_count, once per operation id.
-- KEYS[1] the connection hash   KEYS[2] the request's ops sorted set
-- ARGV[1] schema version  ARGV[2] tokens to add  ARGV[3] op id  ARGV[4] dedupe window (s)
-- Returns {'OK', token_count}, {'DUP', token_count}, {'RANGE', 'token_count'} (the count
-- would reach 2**53: nothing written) or NOKEY/SCHEMA.
local bad = check_records({KEYS[1]}, ARGV[1])
if bad then return bad end
local held = tonumber(redis.call('HGET', KEYS[1], 'token_count') or '0')
if op_seen(KEYS[2], ARGV[3]) then return {'DUP', held} end
if held + tonumber(ARGV[2]) >= LUA_EXACT then return {'RANGE', 'token_count'} end
local count = redis.call('HINCRBY', KEYS[1], 'token_count', ARGV[2])
record_op(KEYS[2], ARGV[3], now(), ARGV[4], KEYS[1])
return {'OK', count}
