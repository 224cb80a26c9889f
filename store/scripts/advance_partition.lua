#!lua
-- Move a partition from the pass it is at to its next forward pass, once.
-- KEYS[1]       the partition hash
-- KEYS[2]       the request's ops sorted set (dedupe of resent operations)
-- KEYS[3]       the request's lease hash
-- KEYS[4]       the request's history stream
-- KEYS[5..]     the partition's outgoing connection hashes (producer_done when it finishes)
-- ARGV[1] schema version   ARGV[2] the pass being left (must be current)   ARGV[3] op id
-- ARGV[4] dedupe window (seconds)   ARGV[5] encoded metadata of the next pass
-- ARGV[6] "1" when the partition is done   ARGV[7] partition name
-- ARGV[8] fencing token of the caller's lease ('' for none: refused while any replica
-- holds a live lease on the partition)   ARGV[9] history cap
-- ARGV[10..]    worker graph ids of the next pass
-- Returns {'OK', new_pass}, {'DUP', current_pass}, {'STALE', current_pass},
-- {'FENCED', token} or NOKEY/SCHEMA.
local part, ops, p = KEYS[1], KEYS[2], ARGV[7]
local records = {part}
for i = 5, #KEYS do records[#records + 1] = KEYS[i] end
local bad = check_records(records, ARGV[1])
if bad then return bad end
local t = now()
local current = redis.call('HGET', part, 'fwd_pass_number')
local fenced = check_fence(KEYS[3], p, ARGV[8], t)
if fenced then
  history(KEYS[4], ARGV[9], part, {'op', 'advance', 'partition', p, 'pass', ARGV[2],
    'outcome', 'fenced', 'token', ARGV[8], 'detail', 'current token ' .. fenced[2]})
  return fenced
end
if op_seen(ops, ARGV[3]) then return {'DUP', current} end
if current ~= ARGV[2] then return {'STALE', current} end
local wgs = {}
for i = 10, #ARGV do wgs[#wgs + 1] = ARGV[i] end
local new_pass = advance(part, ARGV[2], ARGV[5], ARGV[6], wgs, 5, #KEYS)
record_op(ops, ARGV[3], t, ARGV[4], part)
history(KEYS[4], ARGV[9], part, {'op', 'advance', 'partition', p, 'pass', new_pass,
  'outcome', 'applied', 'token', ARGV[8]})
return {'OK', new_pass}
