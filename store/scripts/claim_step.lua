#!lua
-- Take over partition p's next step when no live lease covers it and its check time has
-- come (its driver died, or handed it over). A claim resent by the replica that holds the
-- lease (its reply was lost) gets that lease back.
-- KEYS[1] the request's lease hash   KEYS[2] the partition hash   KEYS[3] history stream
-- KEYS[4] the request's meta hash (a finished request's steps are never claimed)
-- KEYS[5] the recovery index (the lease hash on a cluster: see index_check in _lib.lua),
-- put right whatever the answer: the partition's entry at its check time, or none
-- ARGV[1] schema version   ARGV[2] partition name   ARGV[3] claiming replica
-- ARGV[4] lease time to live (seconds)   ARGV[5] history cap
-- Returns {'OK', token, current_pass, is_done, expires, sends, sent} (granted; 'MINE' with
-- the same fields: the claimer's own live lease, given back), {'HELD', holder,
-- expires, now} while another replica's lease is live, {'NOTDUE', check_time, now} before
-- the check time, {'DONE'} (the request is finished: nothing to recover), or NOKEY/SCHEMA.
local bad = check_records({KEYS[2]}, ARGV[1])
if bad then return bad end
local lease, p = KEYS[1], ARGV[2]
if redis.call('HGET', KEYS[4], '_finished') then
  -- A check time written after the finish (a late report or step) goes with its entry.
  redis.call('HDEL', lease, 'check[' .. p .. ']')
  index_check(KEYS[5], lease, p, nil)
  return {'DONE'}
end
local t = now()
local function bookkeeping()
  return redis.call('HGET', lease, 'sends[' .. p .. ']') or '0',
         redis.call('HGET', lease, 'sent[' .. p .. ']') or '0'
end
local holder, token, expires = live_lease(lease, p, t)
if holder then
  index_check(KEYS[5], lease, p, redis.call('HGET', lease, 'check[' .. p .. ']') or expires)
  if holder ~= ARGV[3] then return {'HELD', holder, exact(expires), exact(t)} end
  local sends, sent = bookkeeping()
  return {'MINE', tonumber(token), redis.call('HGET', lease, 'pass[' .. p .. ']'),
          redis.call('HGET', KEYS[2], 'is_done'), exact(expires), sends, sent}
end
local check = redis.call('HGET', lease, 'check[' .. p .. ']')
if check and tonumber(check) > t then
  index_check(KEYS[5], lease, p, check)
  return {'NOTDUE', check, exact(t)}
end
local current = redis.call('HGET', KEYS[2], 'fwd_pass_number')
local granted
token, granted = grant_lease(lease, p, ARGV[3], t, ARGV[4], current, KEYS[5])
history(KEYS[3], ARGV[5], KEYS[2], {'op', 'claim', 'partition', p, 'pass', current,
  'replica', ARGV[3], 'outcome', 'applied', 'token', token})
local sends, sent = bookkeeping()
return {'OK', token, current, redis.call('HGET', KEYS[2], 'is_done'), granted, sends, sent}
