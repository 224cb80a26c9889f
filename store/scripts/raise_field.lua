#!lua
-- Raise an integer field to a value, never lowering it (idempotent by nature).
-- KEYS[1] the record hash
-- ARGV[1] schema version  ARGV[2] the field  ARGV[3] the value it must reach at least
-- Returns {'OK', value_now}, {'CORRUPT', field} (the held value is no count) or NOKEY/SCHEMA.
local bad = check_records({KEYS[1]}, ARGV[1])
if bad then return bad end
local raw = redis.call('HGET', KEYS[1], ARGV[2]) or '0'
if not string.find(raw, '^%d+$') or #raw > 16 then return {'CORRUPT', ARGV[2]} end
local held = tonumber(raw)
local wanted = tonumber(ARGV[3])
if wanted > held then
  redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
  held = wanted
end
return {'OK', held}
