-- Replace attributes of an existing record (setting a value is idempotent by nature).
-- KEYS[1] the record hash
-- KEYS[2] the request's lease hash (only read when a fencing token is given)
-- ARGV[1] schema version
-- ARGV[2] partition whose lease fences the write   ARGV[3] its fencing token ('' for none)
-- ARGV[4] the number p of attributes replaced whole
-- ARGV[5..4+p] their names: fields "<name>" and "<name>[...]" are removed first
-- ARGV[5+p..] field/value pairs to set
-- Returns {'OK'}, {'FENCED', token} or NOKEY/SCHEMA.
local bad = check_records({KEYS[1]}, ARGV[1])
if bad then return bad end
local fenced = check_fence(KEYS[2], ARGV[2], ARGV[3])
if fenced then return fenced end
local p = tonumber(ARGV[4])
local names = {}
for i = 1, p do names[i] = ARGV[4 + i] end
clear_attributes(KEYS[1], names)
if #ARGV >= 5 + p then hset_pairs(KEYS[1], 5 + p, #ARGV) end
return {'OK'}
