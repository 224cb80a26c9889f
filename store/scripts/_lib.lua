-- Shared helpers, prepended to every script by store/scripts/__init__.py.
-- Every script checks all it needs before its first write: Redis runs a script atomically but
-- does not roll back one that fails half way, so a script either writes whole or not at all.
local unpack = unpack or table.unpack
local VERSION_FIELD = '_v'

-- nil when every key exists as a record of schema version `version`; else the status that
-- the script returns at once: {'NOKEY', key} or {'SCHEMA', key, found_version}.
local function check_records(keys, version)
  for _, key in ipairs(keys) do
    local found = redis.call('HGET', key, VERSION_FIELD)
    if not found then return {'NOKEY', key} end
    if found ~= version then return {'SCHEMA', key, found} end
  end
  return nil
end

-- Was the operation `op_id` applied already? (ops: sorted set of op id -> time applied)
local function op_seen(ops_key, op_id)
  return redis.call('ZSCORE', ops_key, op_id) ~= false
end

-- Remember `op_id`, and forget ids older than the dedupe window so the set stays bounded.
local function record_op(ops_key, op_id, now, window)
  redis.call('ZADD', ops_key, now, op_id)
  redis.call('ZREMRANGEBYSCORE', ops_key, '-inf', tonumber(now) - tonumber(window))
end

-- Delete the fields "<name>" and "<name>[...]" of each attribute in `names` from a hash.
local function clear_attributes(key, names)
  if #names == 0 then return end
  local doomed = {}
  for _, field in ipairs(redis.call('HKEYS', key)) do
    for _, name in ipairs(names) do
      if field == name or string.sub(field, 1, #name + 1) == name .. '[' then
        doomed[#doomed + 1] = field
        break
      end
    end
  end
  for i = 1, #doomed, 1000 do
    redis.call('HDEL', key, unpack(doomed, i, math.min(i + 999, #doomed)))
  end
end

-- HSET the field/value pairs ARGV[first..last].
local function hset_pairs(key, first, last)
  for i = first, last, 1000 do
    redis.call('HSET', key, unpack(ARGV, i, math.min(i + 999, last)))
  end
end

-- Leases (hash "<ns>:{rid}:lease"): "token" is the request's fencing token and only rises;
-- per partition p, "token[p]" is the token of p's latest lease, and while a replica holds
-- it "holder[p]", "expires[p]" (seconds) and "pass[p]" (the pass the step is about).

-- Grant partition p's lease to `holder`, raising the request's fencing token.
local function grant_lease(lease_key, p, holder, now, ttl, pass)
  local token = redis.call('HINCRBY', lease_key, 'token', 1)
  redis.call('HSET', lease_key, 'holder[' .. p .. ']', holder, 'token[' .. p .. ']', token,
             'expires[' .. p .. ']', tonumber(now) + tonumber(ttl), 'pass[' .. p .. ']', pass)
  return token
end

-- nil when `token` is empty (no fence asked for) or is partition p's current lease token;
-- else {'FENCED', current_token}: a newer lease was granted, the caller's is void.
local function check_fence(lease_key, p, token)
  if token == '' then return nil end
  local current = redis.call('HGET', lease_key, 'token[' .. p .. ']')
  if current ~= token then return {'FENCED', current or '0'} end
  return nil
end
