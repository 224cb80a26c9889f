-- Replace attributes of an existing record (setting a value is idempotent by nature).
-- KEYS[1] the record hash
-- ARGV[1] schema version
-- ARGV[2] the number p of attributes replaced whole
-- ARGV[3..2+p] their names: fields "<name>" and "<name>[...]" are removed first
-- ARGV[3+p..] field/value pairs to set
-- Returns {'OK'} or NOKEY/SCHEMA.
local bad = check_records({KEYS[1]}, ARGV[1])
if bad then return bad end
local p = tonumber(ARGV[2])
local names = {}
for i = 1, p do names[i] = ARGV[2 + i] end
clear_attributes(KEYS[1], names)
if #ARGV >= 3 + p then hset_pairs(KEYS[1], 3 + p, #ARGV) end
return {'OK'}
