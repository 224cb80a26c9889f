#!lua
-- Take a partition's step under its lease, in one call: advance to the next pass (unless
-- no metadata is given: the current pass is only sent again), record the send, end the
-- lease and set when recovery looks at the partition next.
-- KEYS[1] the partition hash   KEYS[2] the request's lease hash   KEYS[3] its history stream
-- KEYS[4] the recovery index (the lease hash on a cluster: see index_check in _lib.lua)
-- KEYS[5..] the partition's outgoing connection hashes (producer_done when it finishes)
-- ARGV[1] schema version   ARGV[2] the pass the step leaves (the lease's pass)
-- ARGV[3] partition name   ARGV[4] the lease's fencing token   ARGV[5] the replica
-- ARGV[6] encoded metadata of the next pass ('' : no advance, the pass is sent again)
-- ARGV[7] '1' when the partition is done   ARGV[8] seconds until recovery should look at
-- the partition if nothing moves it on ('' : never, the partition is done)
-- ARGV[9] history cap   ARGV[10] '1' when the pass is (being) sent, '0' when the lease
-- only ends (handed over, or the pass cannot run yet): the send counts stay as they are
-- ARGV[11..] worker graph ids of the next pass
-- A step resent after a lost reply is recognised ("stepped[p]" holds the pass and token
-- of the last step taken) and changes nothing, even after newer leases were granted.
-- Returns {'OK', pass_now, sends}, {'DUP', pass_now, sends}, {'STALE', current_pass} (an
-- advance from a pass that is not current: nothing written),
-- {'FENCED', token} or NOKEY/SCHEMA.
local part, lease, p = KEYS[1], KEYS[2], ARGV[3]
-- One read of each hash for everything the checks and the step need.
local held = redis.call('HMGET', part, VERSION_FIELD, 'fwd_pass_number', '_wgs',
                        'curr_forward_outputs', 'random_seed')
if not held[1] then return {'NOKEY', part} end
if held[1] ~= ARGV[1] then return {'SCHEMA', part, held[1]} end
if #KEYS > 4 then
  local conns = {}
  for i = 5, #KEYS do conns[#conns + 1] = KEYS[i] end
  local bad = check_records(conns, ARGV[1])
  if bad then return bad end
end
local t = now()
local current = held[2]
local advancing = ARGV[6] ~= ''
local stepped = ARGV[2] .. ':' .. ARGV[4]  -- this lease's step, once taken
local books = redis.call('HMGET', lease, 'stepped[' .. p .. ']', 'token[' .. p .. ']',
                         'sends[' .. p .. ']')
if advancing and books[1] == stepped then return {'DUP', current, books[3] or '0'} end
local fenced
if ARGV[4] == '' then
  fenced = check_fence(lease, p, '', t)
elseif books[2] ~= ARGV[4] then
  fenced = {'FENCED', books[2] or '0'}  -- as check_fence says it
end
if not fenced and advancing and current ~= ARGV[2] then fenced = {'STALE', current} end
if fenced then
  history(KEYS[3], ARGV[9], part, {'op', advancing and 'step' or 'resend', 'partition', p,
    'pass', ARGV[2], 'replica', ARGV[5], 'outcome', string.lower(fenced[1]), 'token', ARGV[4],
    'detail', fenced[1] == 'STALE' and ('partition at pass ' .. current)
              or ('current token ' .. fenced[2])})
  return fenced
end

local sends, written
local shown = current  -- the pass as text, for history
if advancing then
  local wgs = {}
  for i = 11, #ARGV do wgs[#wgs + 1] = ARGV[i] end
  current, shown = advance(part, ARGV[2], ARGV[6], ARGV[7], wgs, 5, #KEYS,
                           {held[3], held[4], held[5]})
  sends = 1
  written = {'stepped[' .. p .. ']', stepped, 'sends[' .. p .. ']', '1', 'sent[' .. p .. ']', t}
elseif ARGV[10] == '1' then
  sends = tonumber(books[3] or '0') + 1
  written = {'sends[' .. p .. ']', sends, 'sent[' .. p .. ']', t}
else  -- the lease only ends: no send to count
  sends = tonumber(books[3] or '0')
  written = {}
end
end_lease(lease, p, t, ARGV[8], KEYS[4], written)
history(KEYS[3], ARGV[9], part, {'op', advancing and 'step' or (ARGV[10] == '1' and 'resend'
  or 'release'), 'partition', p,
  'pass', shown, 'replica', ARGV[5], 'outcome', 'applied', 'token', ARGV[4],
  'detail', ARGV[7] == '1' and 'partition done' or ''})
return {'OK', current, sends}
