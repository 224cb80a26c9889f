-- Move a partition from the pass it is at to its next forward pass, once.
-- KEYS[1]       the partition hash
-- KEYS[2]       the request's ops sorted set (dedupe of resent operations)
-- KEYS[3]       the request's lease hash
-- KEYS[4..]     the partition's outgoing connection hashes (producer_done when it finishes)
-- ARGV[1] schema version   ARGV[2] the pass being left (must be current)   ARGV[3] op id
-- ARGV[4] now (seconds)    ARGV[5] dedupe window (seconds)
-- ARGV[6] encoded metadata of the next pass   ARGV[7] "1" when the partition is done
-- ARGV[8] partition name   ARGV[9] fencing token of the caller's lease ('' for none)
-- ARGV[10..]    worker graph ids of the next pass
-- Per-pass sets and counts reset, fwd_pass_number and random_seed go up by one.
-- Returns {'OK', new_pass}, {'DUP', current_pass}, {'STALE', current_pass},
-- {'FENCED', token} or NOKEY/SCHEMA.
local part, ops = KEYS[1], KEYS[2]
local records = {part}
for i = 4, #KEYS do records[#records + 1] = KEYS[i] end
local bad = check_records(records, ARGV[1])
if bad then return bad end
local fenced = check_fence(KEYS[3], ARGV[8], ARGV[9])
if fenced then return fenced end
local current = redis.call('HGET', part, 'fwd_pass_number')
if op_seen(ops, ARGV[3]) then return {'DUP', current} end
if current ~= ARGV[2] then return {'STALE', current} end

clear_attributes(part, {'completed_worker_graph_ids', 'current_worker_graph_ids',
                        'wg_rank_completions', 'curr_forward_outputs', '_reports'})
redis.call('HSET', part, 'metadata', ARGV[6])
if #ARGV >= 10 then
  local fields = {}
  for i = 10, #ARGV do
    fields[#fields + 1] = 'current_worker_graph_ids[' .. ARGV[i] .. ']'
    fields[#fields + 1] = '1'
  end
  redis.call('HSET', part, unpack(fields))
end
local new_pass = redis.call('HINCRBY', part, 'fwd_pass_number', 1)
redis.call('HINCRBY', part, 'random_seed', 1)
if ARGV[7] == '1' then
  redis.call('HSET', part, 'is_done', '1')
  for i = 4, #KEYS do redis.call('HSET', KEYS[i], 'producer_done', '1') end
end
record_op(ops, ARGV[3], ARGV[4], ARGV[5])
return {'OK', new_pass}
