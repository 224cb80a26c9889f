#!lua
-- Apply one worker-graph rank report to a partition, once, with its published infos; and
-- when it completes the pass, grant its replica the lease on the next step, and optionally
-- take that step at once.
-- KEYS[1] the partition hash          KEYS[2] the request's lease hash
-- KEYS[3] the partition's publish-info hash
-- KEYS[4] the partition's merging claim (while an optimistic merge holds it, a report that
--         carries infos steps aside: BUSY, nothing written)
-- KEYS[5] the request's history stream
-- KEYS[6] the recovery index (the lease hash on a cluster: see index_check in _lib.lua)
-- KEYS[7..6+n_out]        outgoing connection hashes (token_count += new tokens)
-- KEYS[7+n_out..6+n_out+n_in]  incoming connection hashes (consumed_count raised)
-- KEYS[7+n_out+n_in..]    the partitions p streams to (read after a step taken here)
-- ARGV[1] schema version  ARGV[2] forward pass of the report  ARGV[3] worker graph id
-- ARGV[4] rank            ARGV[5] ranks in the worker graph   ARGV[6] new output tokens
-- ARGV[7] n_out           ARGV[8] n_in        ARGV[9] partition name
-- ARGV[10] replica applying it ('' for none)  ARGV[11] lease time to live (seconds)
-- ARGV[12] history cap ('0': off)             ARGV[13] n_names (output names)
-- ARGV[14] n_labels (published infos merged with the report)
-- ARGV[15] '1' to take the next step in this script when the report completes the pass,
-- then ARGV[16] the next pass's encoded metadata, ARGV[17] '1' when it finishes the
-- partition, ARGV[18] seconds until recovery should look ('' for never), ARGV[19] n_wgs
-- ARGV[20..]: n_in consumed counts (KEYS order), n_names output names, n_wgs worker graph
-- ids of the next pass, then n_labels merges: label, header, m, and m (op, part, value)
-- triples (op "S" sets the part, "M" raises it, "K" keeps it; see check_merges in _lib.lua).
-- A report is identified by (partition, pass, worker graph, rank): a second delivery
-- changes nothing, and says what the first one did (whether it completed the pass, and the
-- lease if this replica still holds it live). Exactly one report per pass completes it.
-- Returns {'OK'|'DUP', rank_completions, wg_complete, pass_complete, lease_token,
-- lease_expiry, stepped_to_pass, sends, last_sent, partition fields, publish-info fields,
-- had_check, consumers} (the fields when a lease is returned and no step was taken; sends
-- and last_sent: how often and when the lease hash says the pass was sent; had_check, 0 or
-- 1, with a lease granted: whether p had a check time before; consumers, after a step taken
-- here, given their keys: the fields of each partition p streams to, as they stand after
-- it, so the caller decides whether to send their passes without reading them), or an
-- error status: NOKEY/SCHEMA, {'STALE', current_pass}, {'NOWG'}, {'BUSY', holder},
-- {'KIND', label}, {'RANGE', field}.
local part, lease, pub = KEYS[1], KEYS[2], KEYS[3]
local p, replica, cap = ARGV[9], ARGV[10], ARGV[12]
local n_out, n_in = tonumber(ARGV[7]), tonumber(ARGV[8])
local n_names, n_labels, n_wgs = tonumber(ARGV[13]), tonumber(ARGV[14]), tonumber(ARGV[19])
local first_name = 20 + n_in
local first_wg = first_name + n_names
local first_label = first_wg + n_wgs
local last_out = 6 + n_out
local last_conn = last_out + n_in

-- A step's reply, with the partitions p streams to as they stand now, when it was given
-- them (KEYS after the connections).
local function with_consumers(reply)
  if #KEYS > last_conn then
    local out = {}
    for i = last_conn + 1, #KEYS do out[#out + 1] = redis.call('HGETALL', KEYS[i]) end
    reply[#reply + 1] = out
  end
  return reply
end

local wg, rank = ARGV[3], ARGV[4]
local marks_field = '_reports[' .. wg .. ']'
local old_mark = '_reports[' .. rank .. ':' .. wg .. ']'  -- how stores before v5.1 marked it
local count_field = 'wg_rank_completions[' .. wg .. ']'
-- One read of every partition field the checks need: version, pass, the worker graph's
-- membership, the ranks that reported, and the counters the report moves.
local held = redis.call('HMGET', part, VERSION_FIELD, 'fwd_pass_number',
                        'current_worker_graph_ids[' .. wg .. ']', marks_field, count_field,
                        'num_output_tokens', 'curr_forward_outputs', '_pending', '_completer',
                        old_mark, '_wgs', 'random_seed')
if not held[1] then return {'NOKEY', part} end
if held[1] ~= ARGV[1] then return {'SCHEMA', part, held[1]} end
-- Each connection's version and the counter the report moves, in one read.
local conn_counts = {}
for i = 7, last_conn do
  local got = redis.call('HMGET', KEYS[i], VERSION_FIELD,
                         i <= last_out and 'token_count' or 'consumed_count')
  if not got[1] then return {'NOKEY', KEYS[i]} end
  if got[1] ~= ARGV[1] then return {'SCHEMA', KEYS[i], got[1]} end
  conn_counts[i] = tonumber(got[2] or '0')
end
if held[2] ~= ARGV[2] then
  local took = redis.call('HMGET', lease, 'stepped_by[' .. p .. ']', 'stepped[' .. p .. ']')
  local took_pass, took_token = string.match(took[2] or '', '^(%d+):(%d+)$')
  if replica ~= '' and took[1] == ARGV[2] .. ':' .. rank .. ':' .. wg .. ':' .. replica
      and took_pass == ARGV[2] and tonumber(held[2]) == tonumber(ARGV[2]) + 1 then
    -- The report that completed the pass and took the step in the same call, resent
    -- after its reply was lost, and no step since: say so, with the pass the step went
    -- to and the token of the lease it ended (it still fences the finish that follows).
    history(KEYS[5], cap, part, {'op', 'report', 'partition', p, 'pass', ARGV[2],
      'rank', rank, 'wg', wg, 'replica', replica, 'outcome', 'duplicate'})
    return {'DUP', 0, 1, 1, took_token, '0', held[2], 1, '0'}
  end
  history(KEYS[5], cap, part, {'op', 'report', 'partition', p, 'pass', ARGV[2], 'rank', rank,
    'wg', wg, 'replica', replica, 'outcome', 'stale', 'detail', 'partition at pass ' .. held[2]})
  return {'STALE', held[2]}
end
if not held[3] then return {'NOWG'} end

local count = tonumber(held[5] or '0')
local marks = held[4] or ','
if held[10] or string.find(marks, ',' .. rank .. ',', 1, true) then
  -- A resent report: say what the first delivery did.
  local completed = held[9] == rank .. ':' .. wg or held[10] == 'C'
  local token, expires = 0, 0
  if completed and replica ~= '' then
    local holder, held_token, held_expires = live_lease(lease, p, now())
    if holder == replica and redis.call('HGET', lease, 'pass[' .. p .. ']') == ARGV[2] then
      token, expires = tonumber(held_token), held_expires
    end
  end
  history(KEYS[5], cap, part, {'op', 'report', 'partition', p, 'pass', ARGV[2],
    'rank', ARGV[4], 'wg', wg, 'replica', replica, 'outcome', 'duplicate'})
  if token ~= 0 then
    local books = redis.call('HMGET', lease, 'sends[' .. p .. ']', 'sent[' .. p .. ']')
    return {'DUP', count, 1, 1, token, exact(expires), 0, books[1] or 0, books[2] or '0',
            redis.call('HGETALL', part), redis.call('HGETALL', pub)}
  end
  return {'DUP', count, completed and 1 or 0, completed and 1 or 0, 0, '0', 0, 0, '0'}
end

-- Everything is checked before the first write.
local tokens = tonumber(ARGV[6])
if tokens ~= 0 then
  if tonumber(held[6] or '0') + tokens >= LUA_EXACT then return {'RANGE', 'num_output_tokens'} end
  for i = 7, last_out do
    if conn_counts[i] + tokens >= LUA_EXACT then return {'RANGE', 'token_count'} end
  end
end
local merges = {}
if n_labels > 0 then
  local refused
  merges, refused = check_merges(pub, KEYS[4], first_label, n_labels)
  if refused then return refused end
end

apply_merges(pub, merges)
count = count + 1
local wg_complete = count == tonumber(ARGV[5]) and 1 or 0
local pass_complete = 0
local sets = {marks_field, marks .. rank .. ',', count_field, count}
if wg_complete == 1 then
  sets[#sets + 1] = 'completed_worker_graph_ids[' .. wg .. ']'
  sets[#sets + 1] = '1'
  local pending = held[8]
  if pending then
    pending = tonumber(pending) - 1
  else  -- a partition written before the store kept the count
    redis.call('HSET', part, 'completed_worker_graph_ids[' .. wg .. ']', '1')
    pending = count_pending(part)
  end
  sets[#sets + 1] = '_pending'
  sets[#sets + 1] = pending
  if pending <= 0 then
    pass_complete = 1
    sets[#sets + 1] = '_completer'
    sets[#sets + 1] = rank .. ':' .. wg
  end
end
if tokens ~= 0 then
  sets[#sets + 1] = 'num_output_tokens'
  sets[#sets + 1] = tonumber(held[6] or '0') + tokens
end
if n_names > 0 then
  local length = tonumber(held[7] or '0')
  for i = first_name, first_wg - 1 do
    sets[#sets + 1] = 'curr_forward_outputs[' .. length .. ']'
    sets[#sets + 1] = ARGV[i]
    length = length + 1
  end
  sets[#sets + 1] = 'curr_forward_outputs'
  sets[#sets + 1] = length
end
-- The report that completes the pass and takes the step at once (the common decode pass)
-- writes the partition once: the step clears every per-pass field the report would set.
-- A completing report named by a replica gets the lease on the next step, unless the
-- request is finished (its pass completes, but nobody is to drive the next step). One read
-- of the lease hash serves the grant: whether the request is finished, the fencing token
-- (the new one is written with the step's bookkeeping), whether p's last lease is still
-- held (its fields to end) and p's check time (on a cluster, see below).
local books
if pass_complete == 1 and replica ~= '' then
  books = redis.call('HMGET', lease, 'finished', 'token', 'holder[' .. p .. ']',
                     'check[' .. p .. ']')
end
local grants = books and not books[1]
local step_now = grants and ARGV[15] == '1' and held[11]
if not step_now then redis.call('HSET', part, unpack(sets)) end
if tokens ~= 0 then
  for i = 7, last_out do redis.call('HINCRBY', KEYS[i], 'token_count', ARGV[6]) end
end
for i = 1, n_in do
  local conn, consumed = KEYS[last_out + i], tonumber(ARGV[19 + i])
  if consumed > conn_counts[last_out + i] then
    redis.call('HSET', conn, 'consumed_count', consumed)
  end
end
history(KEYS[5], cap, part, {'op', 'report', 'partition', p, 'pass', ARGV[2], 'rank', ARGV[4],
  'wg', wg, 'replica', replica, 'outcome', 'applied',
  'detail', (n_labels > 0 and 'with published info' or '') ..
            (pass_complete == 1 and ' completed the pass' or '')})
if not grants then
  return {'OK', count, wg_complete, pass_complete, 0, '0', 0, 0, '0'}
end

-- On a cluster the store writes the index entry of the lease granted here; it needs to know
-- whether p had one (every check time has one) or must be given one now.
local had_check = (KEYS[6] ~= lease or books[4]) and 1 or 0
local t = now()
if step_now then
  -- The lease granted and ended in one go: the lease hash ends as grant_lease, the step's
  -- bookkeeping and end_lease would leave it, in one write (two while p's last lease is
  -- still held: its fields go) instead of six, and the index entry once.
  local token = plus_one(books[2] or '0')
  local counted = token ~= nil
  if not counted then  -- beyond what Lua counts exactly: HINCRBY says
    token = redis.call('HINCRBY', lease, 'token', 1)
  end
  local token_text, t_text = digits(token), exact(t)  -- each written more than once
  local expires = t + tonumber(ARGV[11])
  local wgs = {}
  for i = first_wg, first_label - 1 do wgs[#wgs + 1] = ARGV[i] end
  local extra = tokens ~= 0 and {'num_output_tokens', tonumber(held[6] or '0') + tokens} or {}
  local new_pass, pass_text = advance(part, ARGV[2], ARGV[16], ARGV[17], wgs, 7, last_out,
                                      {held[11], held[7], held[12], extra})
  end_lease(lease, p, t, ARGV[18], KEYS[6], {
    'token[' .. p .. ']', token_text, 'stepped[' .. p .. ']', ARGV[2] .. ':' .. token_text,
    'sends[' .. p .. ']', '1', 'sent[' .. p .. ']', t_text,
    'stepped_by[' .. p .. ']', ARGV[2] .. ':' .. rank .. ':' .. wg .. ':' .. replica,
    unpack(counted and {'token', token_text} or {})}, books[3] ~= false)
  history(KEYS[5], cap, part, {'op', 'step', 'partition', p, 'pass', pass_text,
    'replica', replica, 'outcome', 'applied', 'token', token_text})
  return with_consumers({'OK', count, wg_complete, 1, token, exact(expires), new_pass, 1,
                         t_text, {}, {}, had_check})
end
local token, expires = grant_lease(lease, p, replica, t, ARGV[11], ARGV[2], KEYS[6])
if ARGV[15] ~= '1' then
  local books = redis.call('HMGET', lease, 'sends[' .. p .. ']', 'sent[' .. p .. ']')
  return {'OK', count, wg_complete, 1, token, expires, 0, books[1] or 0,
          books[2] or '0', redis.call('HGETALL', part), redis.call('HGETALL', pub), had_check}
end
-- The step taken at once: the caller knew it before the pass completed.
local wgs = {}
for i = first_wg, first_label - 1 do wgs[#wgs + 1] = ARGV[i] end
local new_pass = advance(part, ARGV[2], ARGV[16], ARGV[17], wgs, 7, last_out)
redis.call('HSET', lease, 'stepped[' .. p .. ']', ARGV[2] .. ':' .. token, 'sends[' .. p .. ']', '1',
           'sent[' .. p .. ']', t,
           'stepped_by[' .. p .. ']', ARGV[2] .. ':' .. rank .. ':' .. wg .. ':' .. replica)
end_lease(lease, p, t, ARGV[18], KEYS[6])
history(KEYS[5], cap, part, {'op', 'step', 'partition', p, 'pass', new_pass,
  'replica', replica, 'outcome', 'applied', 'token', token})
return with_consumers({'OK', count, wg_complete, 1, token, expires, new_pass, 1, exact(t), {},
                       {}, had_check})
