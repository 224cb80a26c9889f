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
local records = {part}
for i = 5, #KEYS do records[#records + 1] = KEYS[i] end
local bad = check_records(records, ARGV[1])
if bad then return bad end
local t = now()
local current = redis.call('HGET', part, 'fwd_pass_number')
local advancing = ARGV[6] ~= ''
local stepped = ARGV[2] .. ':' .. ARGV[4]  -- this lease's step, once taken
if advancing and redis.call('HGET', lease, 'stepped[' .. p .. ']') == stepped then
  return {'DUP', current, redis.call('HGET', lease, 'sends[' .. p .. ']') or '0'}
end
local fenced = check_fence(lease, p, ARGV[4], t)
if not fenced and advancing and current ~= ARGV[2] then fenced = {'STALE', current} end
if fenced then
  history(KEYS[3], ARGV[9], part, {'op', advancing and 'step' or 'resend', 'partition', p,
    'pass', ARGV[2], 'replica', ARGV[5], 'outcome', string.lower(fenced[1]), 'token', ARGV[4],
    'detail', fenced[1] == 'STALE' and ('partition at pass ' .. current)
              or ('current token ' .. fenced[2])})
  return fenced
end

local sends
if advancing then
  local wgs = {}
  for i = 11, #ARGV do wgs[#wgs + 1] = ARGV[i] end
  current = advance(part, ARGV[2], ARGV[6], ARGV[7], wgs, 5, #KEYS)
  sends = 1
  redis.call('HSET', lease, 'stepped[' .. p .. ']', stepped, 'sends[' .. p .. ']', 1,
             'sent[' .. p .. ']', t)
elseif ARGV[10] == '1' then
  sends = redis.call('HINCRBY', lease, 'sends[' .. p .. ']', 1)
  redis.call('HSET', lease, 'sent[' .. p .. ']', t)
else  -- the lease only ends: no send to count
  sends = tonumber(redis.call('HGET', lease, 'sends[' .. p .. ']') or '0')
end
end_lease(lease, p, t, ARGV[8], KEYS[4])
history(KEYS[3], ARGV[9], part, {'op', advancing and 'step' or (ARGV[10] == '1' and 'resend'
  or 'release'), 'partition', p,
  'pass', current, 'replica', ARGV[5], 'outcome', 'applied', 'token', ARGV[4],
  'detail', ARGV[7] == '1' and 'partition done' or ''})
return {'OK', current, sends}
