-- Merge published infos the server can merge by itself (see store/published.py), once.
-- KEYS[1] the partition hash (must exist at this schema version)
-- KEYS[2] the partition's publish-info hash   KEYS[3] the request's ops sorted set
-- KEYS[4] the partition's merging claim: while an optimistic merge that kept losing to
--         these holds it, this script steps aside (returns BUSY) so that merge can commit
-- ARGV[1] schema version   ARGV[2] op id   ARGV[3] now (seconds)   ARGV[4] dedupe window
-- ARGV[5] the number of labels; then per label: the label, its header, the number m of
-- parts, and m triples (op, part, value): op "S" sets the part (the newer value wins),
-- "M" raises it to the value (max), never lowering it.
-- Returns {'OK'}, {'DUP'} (this op was applied already), {'BUSY'} (nothing written),
-- {'KIND', label} when a label holds another kind (nothing written), or NOKEY/SCHEMA. The
-- caller reads the merged state back in the same MULTI, which costs the server less than
-- reading it here.
local bad = check_records({KEYS[1]}, ARGV[1])
if bad then return bad end
local pub, ops = KEYS[2], KEYS[3]
if redis.call('EXISTS', KEYS[4]) == 1 then return {'BUSY'} end

local labels, pos = {}, 6
for i = 1, tonumber(ARGV[5]) do
  local label, header, m = ARGV[pos], ARGV[pos + 1], tonumber(ARGV[pos + 2])
  local held = redis.call('HGET', pub, label)
  if held and held ~= header then return {'KIND', label} end
  labels[#labels + 1] = {label, header, pos + 3, m}
  pos = pos + 3 + 3 * m
end

local status = 'DUP'
if not op_seen(ops, ARGV[2]) then
  status = 'OK'
  for _, entry in ipairs(labels) do
    local label, first, m = entry[1], entry[3], entry[4]
    redis.call('HSET', pub, label, entry[2])
    for j = first, first + 3 * (m - 1), 3 do
      local field = label .. '[' .. ARGV[j + 1] .. ']'
      local value = ARGV[j + 2]
      if ARGV[j] == 'S' then
        redis.call('HSET', pub, field, value)
      else
        local current = redis.call('HGET', pub, field)
        if not current or tonumber(value) > tonumber(current) then
          redis.call('HSET', pub, field, value)
        end
      end
    end
  end
  record_op(ops, ARGV[2], ARGV[3], ARGV[4])
end

return {status}
