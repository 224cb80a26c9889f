-- Apply one worker-graph rank report to a partition, once.
-- KEYS[1]                 the partition hash
-- KEYS[2]                 the request's lease hash
-- KEYS[3..2+n_out]        outgoing connection hashes (token_count += new tokens)
-- KEYS[3+n_out..]         incoming connection hashes (consumed_count raised)
-- ARGV[1] schema version  ARGV[2] forward pass of the report  ARGV[3] worker graph id
-- ARGV[4] rank            ARGV[5] ranks in the worker graph   ARGV[6] new output tokens
-- ARGV[7] n_out           ARGV[8] n_in
-- ARGV[9] partition name  ARGV[10] replica applying it ('' for none)
-- ARGV[11] now (seconds)  ARGV[12] lease time to live (seconds)
-- ARGV[13..12+n_in]       consumed count per incoming connection, in KEYS order
-- ARGV[13+n_in..]         output names to append to curr_forward_outputs
-- A report is identified by (partition, pass, worker graph, rank): a second delivery
-- changes nothing. The report that completes the last worker graph of the pass, and only
-- that one, returns pass_complete = 1; its replica (if named) is granted the partition's
-- lease on the next step in the same step.
-- Returns {'OK', rank_completions, wg_complete, pass_complete, lease_token} or
-- {'DUP', rank_completions, 0, 0, 0}, or an error status: NOKEY/SCHEMA (see _lib),
-- {'STALE', current_pass}, {'NOWG'}.
local part, lease = KEYS[1], KEYS[2]
local records = {part}
for i = 3, #KEYS do records[#records + 1] = KEYS[i] end
local bad = check_records(records, ARGV[1])
if bad then return bad end
local current = redis.call('HGET', part, 'fwd_pass_number')
if current ~= ARGV[2] then return {'STALE', current} end
local wg = ARGV[3]
if redis.call('HEXISTS', part, 'current_worker_graph_ids[' .. wg .. ']') == 0 then
  return {'NOWG'}
end
local count_field = 'wg_rank_completions[' .. wg .. ']'
if redis.call('HSETNX', part, '_reports[' .. ARGV[4] .. ':' .. wg .. ']', '1') == 0 then
  return {'DUP', tonumber(redis.call('HGET', part, count_field) or '0'), 0, 0, 0}
end
local count = redis.call('HINCRBY', part, count_field, 1)
local wg_complete = 0
if count == tonumber(ARGV[5]) then
  wg_complete = 1
  redis.call('HSET', part, 'completed_worker_graph_ids[' .. wg .. ']', '1')
end

local n_out, n_in = tonumber(ARGV[7]), tonumber(ARGV[8])
local tokens = tonumber(ARGV[6])
if tokens ~= 0 then
  redis.call('HINCRBY', part, 'num_output_tokens', tokens)
  for i = 3, 2 + n_out do redis.call('HINCRBY', KEYS[i], 'token_count', tokens) end
end
for i = 1, n_in do
  local conn, consumed = KEYS[2 + n_out + i], tonumber(ARGV[12 + i])
  if consumed > tonumber(redis.call('HGET', conn, 'consumed_count') or '0') then
    redis.call('HSET', conn, 'consumed_count', consumed)
  end
end
local first_name = 13 + n_in
if #ARGV >= first_name then
  local length = tonumber(redis.call('HGET', part, 'curr_forward_outputs') or '0')
  for i = first_name, #ARGV do
    redis.call('HSET', part, 'curr_forward_outputs[' .. length .. ']', ARGV[i])
    length = length + 1
  end
  redis.call('HSET', part, 'curr_forward_outputs', length)
end

local pass_complete = 0
if wg_complete == 1 then
  pass_complete = 1
  local prefix = 'current_worker_graph_ids['
  for _, field in ipairs(redis.call('HKEYS', part)) do
    if string.sub(field, 1, #prefix) == prefix then
      local id = string.sub(field, #prefix + 1, -2)
      if redis.call('HEXISTS', part, 'completed_worker_graph_ids[' .. id .. ']') == 0 then
        pass_complete = 0
        break
      end
    end
  end
end
local token = 0
if pass_complete == 1 and ARGV[10] ~= '' then
  token = grant_lease(lease, ARGV[9], ARGV[10], ARGV[11], ARGV[12], ARGV[2])
end
return {'OK', count, wg_complete, pass_complete, token}
