#!lua
-- Take a partition's merging claim in turn: optimistic merges that kept losing queue for it
-- and get it first come, first served, so none of them starves behind luckier ones.
-- KEYS[1] the partition's merging claim (string: the holder's token, short-lived)
-- KEYS[2] the queue (hash: waiting token -> "<ticket> <last asked, server ms>"; field '#'
--         the last ticket handed out)
-- ARGV[1] this merge's token   ARGV[2] how long the claim is held (ms)
-- ARGV[3] after how long without asking a waiter has left the queue (ms)
-- ARGV[4] 'TAKE', or 'LEAVE': done or given up, out of the queue, the claim freed if held
-- TAKE returns 1 when this merge holds the claim (now or already), 0 when it waits: another
-- merge holds it or queued first. A waiter asks again at every retry; one that stopped
-- asking (cancelled, crashed) is dropped after ARGV[3], so it never blocks the queue.
local claim, queue, token = KEYS[1], KEYS[2], ARGV[1]
local holder = redis.call('GET', claim)
if ARGV[4] == 'LEAVE' then
  redis.call('HDEL', queue, token)
  if holder == token then redis.call('DEL', claim) end
  return 0
end
if holder == token then return 1 end
local t = math.floor(now() * 1000)
local lapse = tonumber(ARGV[3])
local ticket = nil
local head, head_ticket = nil, nil
local waiting = redis.call('HGETALL', queue)
for i = 1, #waiting, 2 do
  local who = waiting[i]
  if who ~= '#' then
    local first, last = string.match(waiting[i + 1], '^(%d+) (%d+)$')
    first, last = tonumber(first), tonumber(last)
    if first ~= nil and who == token then ticket = first end
    if first == nil or (who ~= token and last < t - lapse) then
      redis.call('HDEL', queue, who)
    elseif head == nil or first < head_ticket then
      head, head_ticket = who, first
    end
  end
end
if not holder and (head == nil or head == token) then
  redis.call('SET', claim, token, 'PX', ARGV[2])
  redis.call('HDEL', queue, token)
  return 1
end
ticket = ticket or redis.call('HINCRBY', queue, '#', 1)
redis.call('HSET', queue, token, ticket .. ' ' .. t)
redis.call('PEXPIRE', queue, 4 * lapse)
return 0
