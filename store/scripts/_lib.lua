-- Shared helpers, prepended to every script by store/scripts/__init__.py.
-- Every script checks all it needs before its first write: Redis runs a script atomically but
-- does not roll back one that fails half way, so a script either writes whole or not at all.
-- A full server is checked before the first line too: every script that writes starts with
-- the flag line "#!lua" (Redis 7), so that while used memory is over maxmemory Redis refuses
-- it whole before it runs. Without that line Redis looks only at the script's first write
-- that may grow memory, and a first DEL (create_request's) let every write after it through.
-- "#!lua flags=allow-oom" marks the two that must run on a full server: delete_request,
-- which frees memory, and replicas (a heartbeat is one score per replica; 'live' reads).
-- The read-only scripts have no flag line: Redis runs them on a full server as it is.
-- Times are the server's clock (TIME), in seconds: every replica sees the same one.
-- A value that is a string already goes to redis.call as that string: Redis formats every
-- number argument with %.17g, which costs about as much as a call's own argument.
local unpack = unpack or table.unpack
local VERSION_FIELD = '_v'
local LUA_EXACT = 9007199254740992  -- 2**53: Lua numbers are doubles, exact below this

-- The server's time in seconds (with microseconds).
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- A time as a reply carries it, every digit kept (tostring keeps 14: ~100 us at today's epoch).
-- Also how Redis writes a number given to redis.call: a time written and returned, or
-- written twice, is formatted once with it.
local function exact(x)
  return string.format('%.17g', x)
end

-- An integer the script computed, as text: cheaper than the %.17g Redis formats a number
-- argument with, and formatted once where the value is written more than once.
local function digits(n)
  return string.format('%d', n)
end

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

-- A key created by a late write (after finish_request kept the request with a TTL) expires
-- with the record it belongs to.
local function inherit_ttl(key, record)
  local ttl = redis.call('PTTL', record)
  if ttl > 0 and redis.call('PTTL', key) == -1 then redis.call('PEXPIRE', key, ttl) end
end

-- Was the operation `op_id` applied already? (ops: sorted set of op id -> time applied)
local function op_seen(ops_key, op_id)
  return redis.call('ZSCORE', ops_key, op_id) ~= false
end

-- Remember `op_id`; now and then forget ids older than the dedupe window (a trim on every
-- call costs more than the set it keeps small). `record` is the key the set lives with.
local function record_op(ops_key, op_id, t, window, record)
  redis.call('ZADD', ops_key, t, op_id)
  local held = redis.call('ZCARD', ops_key)
  if held == 1 then
    inherit_ttl(ops_key, record)
  elseif held % 64 == 0 then
    redis.call('ZREMRANGEBYSCORE', ops_key, '-inf', t - tonumber(window))
  end
end

-- Append one entry to the request's capped history stream (cap "0": history is off).
-- `fields` is a flat list of field, value pairs (an empty value: does not apply; no nil).
-- The stream is trimmed to about `cap` entries on about one append in a hundred (when the
-- entry's milliseconds end in 00), which costs far less than trimming on every append.
-- A stream that exists expires with its request already (finish_request sets the TTL of
-- every key it holds, and the write that makes a stream afterwards copies it), so only a
-- new one looks at its record's TTL: the common append is one call.
local function history(key, cap, record, fields)
  if cap == '0' then return end
  local id = redis.call('XADD', key, 'NOMKSTREAM', '*', unpack(fields))
  if not id then
    id = redis.call('XADD', key, '*', unpack(fields))
    inherit_ttl(key, record)
  end
  local dash = string.find(id, '-', 1, true)
  if string.byte(id, dash - 1) == 48 and string.byte(id, dash - 2) == 48 then
    redis.call('XTRIM', key, 'MAXLEN', '~', cap)
  end
end

-- Delete the fields "<name>" and "<name>[...]" of each attribute in `names` from a hash.
local function clear_attributes(key, names)
  if #names == 0 then return end
  local wanted = {}
  for _, name in ipairs(names) do wanted[name] = true end
  local doomed = {}
  for _, field in ipairs(redis.call('HKEYS', key)) do
    local bracket = string.find(field, '[', 1, true)
    if wanted[bracket and string.sub(field, 1, bracket - 1) or field] then
      doomed[#doomed + 1] = field
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

-- Worker graph ids (any text) kept in one field as "<length>:<id>" after one another.
local function split_ids(s)
  local out, i = {}, 1
  while i <= #s do
    local colon = string.find(s, ':', i, true)
    local n = tonumber(string.sub(s, i, colon - 1))
    out[#out + 1] = string.sub(s, colon + 1, colon + n)
    i = colon + n + 1
  end
  return out
end

local function join_ids(ids)
  local parts = {}
  for _, id in ipairs(ids) do parts[#parts + 1] = #id .. ':' .. id end
  return table.concat(parts)
end

-- A partition's per-pass bookkeeping, kept in its hash next to the attributes:
-- "_pending" (worker graphs of the pass not complete yet: the report that brings it to 0
-- completes the pass), "_wgs" (every worker graph with per-pass fields, so the advance
-- knows which fields to delete without reading them all), "_reports[<wg>]" (",0,1,": the
-- ranks that reported) and "_completer" ("<rank>:<wg>" of the report that completed it).
-- Recount them from the attribute fields (after a write that replaced those attributes,
-- or for a partition written before the store kept them).
local function count_pending(part)
  local current, completed = {}, {}
  local cur, done = 'current_worker_graph_ids[', 'completed_worker_graph_ids['
  for _, field in ipairs(redis.call('HKEYS', part)) do
    if string.sub(field, 1, #cur) == cur then
      current[string.sub(field, #cur + 1, -2)] = true
    elseif string.sub(field, 1, #done) == done then
      completed[string.sub(field, #done + 1, -2)] = true
    end
  end
  local n = 0
  for id in pairs(current) do
    if not completed[id] then n = n + 1 end
  end
  return n
end

local function recount(part)
  local ids, seen = {}, {}
  local prefixes = {'current_worker_graph_ids[', 'completed_worker_graph_ids[',
                    'wg_rank_completions['}
  for _, field in ipairs(redis.call('HKEYS', part)) do
    for _, prefix in ipairs(prefixes) do
      if string.sub(field, 1, #prefix) == prefix then
        local id = string.sub(field, #prefix + 1, -2)
        if not seen[id] then
          seen[id] = true
          ids[#ids + 1] = id
        end
        break
      end
    end
  end
  redis.call('HSET', part, '_pending', count_pending(part), '_wgs', join_ids(ids))
end

-- Leases (hash "<ns>:{rid}:lease"): "token" is the request's fencing token and only rises;
-- per partition p, "token[p]" is the token of p's latest lease, and while a replica holds
-- it "holder[p]", "expires[p]" (server seconds) and "pass[p]" (the pass the step is about).
-- "check[p]" is when recovery should look at p if nothing moves it on (server seconds);
-- "stepped[p]" the pass the latest lease's step advanced from (a resent step is
-- recognised); "sends[p]" how often p's current pass was sent, "sent[p]" when last;
-- "finished" once the request is finished (no lease is granted on it any more; a request
-- finished by a store without it is recognised by its meta hash's "_finished").

-- The recovery index ("<ns>:deadlines", see store/ops/leases.py) follows every check time:
-- on one server the script that moves "check[p]" moves p's index entry with it, in the
-- same atomic step. On a cluster the index lives in a slot of its own and the store
-- passes the lease key in its place (`index` == `lease_key`): the store writes it then.
local function index_check(index, lease_key, p, at)
  if index == lease_key then return end
  local member = string.match(lease_key, '{([^}]*)}:lease$') .. ' ' .. p
  if at then
    redis.call('ZADD', index, at, member)
  else
    redis.call('ZREM', index, member)
  end
end

-- Grant partition p's lease to `holder`, raising the request's fencing token.
-- Returns the token and the lease's expiry, as text (every digit, see exact).
local function grant_lease(lease_key, p, holder, t, ttl, pass, index)
  local token = redis.call('HINCRBY', lease_key, 'token', 1)
  local expires = exact(t + tonumber(ttl))  -- written three times
  redis.call('HSET', lease_key, 'holder[' .. p .. ']', holder, 'token[' .. p .. ']', token,
             'expires[' .. p .. ']', expires, 'pass[' .. p .. ']', pass,
             'check[' .. p .. ']', expires)
  index_check(index, lease_key, p, expires)
  return token, expires
end

-- The live lease on partition p: holder, token, expiry; nil when none is live at time t.
local function live_lease(lease_key, p, t)
  local fields = redis.call('HMGET', lease_key, 'holder[' .. p .. ']', 'token[' .. p .. ']',
                            'expires[' .. p .. ']')
  if fields[1] and fields[3] and tonumber(fields[3]) > t then
    return fields[1], fields[2], tonumber(fields[3])
  end
  return nil
end

-- nil when a write to partition p may go ahead; else {'FENCED', current_token}.
-- With a token (a fenced write): it must be p's current lease token. Without (an unfenced
-- write): no other replica may hold a live lease on p, since that replica drives p now.
-- p = '*' (a request-level write) checks every partition's lease.
local function check_fence(lease_key, p, token, t)
  if token ~= '' then
    local current = redis.call('HGET', lease_key, 'token[' .. p .. ']')
    if current ~= token then return {'FENCED', current or '0'} end
    return nil
  end
  if p == '*' then
    local flat = redis.call('HGETALL', lease_key)
    for i = 1, #flat, 2 do
      local name = flat[i]
      if string.sub(name, 1, 8) == 'expires[' and tonumber(flat[i + 1]) > t then
        local q = string.sub(name, 9, -2)
        return {'FENCED', redis.call('HGET', lease_key, 'token[' .. q .. ']') or '0', q}
      end
    end
    return nil
  end
  local holder, current = live_lease(lease_key, p, t)
  if holder then return {'FENCED', current, p} end
  return nil
end

-- End p's lease (its step was sent) and set when recovery looks at p next: `check_in`
-- seconds from t, or never ('' : p is done).
-- `books`: more field, value pairs to set in the lease hash with it (the step's
-- bookkeeping), in the same write. `held` false: p's lease fields are known to be gone
-- already (a lease granted and ended in one script), so there is nothing of them to delete.
local function end_lease(lease_key, p, t, check_in, index, books, held)
  local doomed = {}
  if held ~= false then
    doomed = {'holder[' .. p .. ']', 'expires[' .. p .. ']', 'pass[' .. p .. ']'}
  end
  local sets = books or {}
  local at = nil
  if check_in == '' then
    doomed[#doomed + 1] = 'check[' .. p .. ']'
  else
    at = exact(t + tonumber(check_in))  -- written twice: the lease hash and the index
    sets[#sets + 1] = 'check[' .. p .. ']'
    sets[#sets + 1] = at
  end
  if #doomed > 0 then redis.call('HDEL', lease_key, unpack(doomed)) end
  if #sets > 0 then redis.call('HSET', lease_key, unpack(sets)) end
  index_check(index, lease_key, p, at)
end

-- The integer `s` (a stored counter) plus one, as HINCRBY would write it; nil where Lua
-- cannot be sure to (not an integer, or too large for a double's %.14g).
local function plus_one(s)
  if not string.find(s, '^-?%d+$') or #s > 13 then return nil end
  return tonumber(s) + 1
end

-- Move partition `part` (name p) from pass `from_pass` to the next one: per-pass sets and
-- counts reset, `metadata` replaces the old, the pass number and the seed go up by one;
-- `done` also sets is_done and producer_done on every outgoing connection (KEYS first_out
-- onwards). `wgs` are the next pass's worker graphs. Returns the new pass number (and as
-- text, when Lua counted it). The caller has checked everything: this only writes.
local function advance(part, from_pass, metadata, done, wgs, first_out, last_out, known)
  -- known: what the caller read already ({_wgs, curr_forward_outputs, random_seed}), and
  -- fields it wants written with the new pass (known[4]).
  local held = known or redis.call('HMGET', part, '_wgs', 'curr_forward_outputs', 'random_seed')
  if held[1] then
    local doomed = {'_completer', 'curr_forward_outputs'}
    for _, id in ipairs(split_ids(held[1])) do
      doomed[#doomed + 1] = 'current_worker_graph_ids[' .. id .. ']'
      doomed[#doomed + 1] = 'completed_worker_graph_ids[' .. id .. ']'
      doomed[#doomed + 1] = 'wg_rank_completions[' .. id .. ']'
      doomed[#doomed + 1] = '_reports[' .. id .. ']'
    end
    for i = 0, tonumber(held[2] or '0') - 1 do
      doomed[#doomed + 1] = 'curr_forward_outputs[' .. i .. ']'
    end
    for i = 1, #doomed, 1000 do
      redis.call('HDEL', part, unpack(doomed, i, math.min(i + 999, #doomed)))
    end
  else  -- written before the store kept "_wgs": find the per-pass fields by name
    clear_attributes(part, {'completed_worker_graph_ids', 'current_worker_graph_ids',
                            'wg_rank_completions', 'curr_forward_outputs', '_reports',
                            '_completer'})
  end
  local fields = {'metadata', metadata, '_pending', digits(#wgs), '_wgs', join_ids(wgs)}
  for _, id in ipairs(wgs) do
    fields[#fields + 1] = 'current_worker_graph_ids[' .. id .. ']'
    fields[#fields + 1] = '1'
  end
  for _, extra in ipairs(held[4] or {}) do fields[#fields + 1] = extra end
  -- The two counters go up by one in the same HSET where Lua counts them exactly (HINCRBY
  -- otherwise, which also refuses a value that is not an integer, as it always did).
  local new_pass, seed = plus_one(from_pass), plus_one(held[3] or '0')
  local pass_text
  if new_pass then
    pass_text = digits(new_pass)
    fields[#fields + 1] = 'fwd_pass_number'
    fields[#fields + 1] = pass_text
  end
  if seed then
    fields[#fields + 1] = 'random_seed'
    fields[#fields + 1] = digits(seed)
  end
  redis.call('HSET', part, unpack(fields))
  if not new_pass then new_pass = redis.call('HINCRBY', part, 'fwd_pass_number', 1) end
  if not seed then redis.call('HINCRBY', part, 'random_seed', 1) end
  if done == '1' then
    redis.call('HSET', part, 'is_done', '1')
    for i = first_out, last_out do redis.call('HSET', KEYS[i], 'producer_done', '1') end
  end
  return new_pass, pass_text or new_pass
end

-- Merges the server applies itself (see store/codec/published.py): ARGV[first..] holds
-- `n_labels` entries of label, header, m, and m (op, part, value) triples, op "S" setting
-- the part (the newer value wins), "M" raising it to the value (a part not held counts as
-- 0) and "K" keeping what is held. A label not held yet takes every part as given, as the
-- engine's merge_publish_info takes a new label's info whole. Returns the list
-- of merges to apply, or the status to return at once: {'BUSY', holder} while an optimistic
-- merge holds the partition's claim (the holder tells a waiter whether the claim moved on),
-- {'KIND', label} when a label holds another kind.
-- One HMGET per label reads its header and every part an "M" op raises (a call from Lua
-- costs several times the command it runs).
local function check_merges(pub, claim, first, n_labels)
  local claimed_by = redis.call('GET', claim)
  if claimed_by then return nil, {'BUSY', claimed_by} end
  local merges, pos = {}, first
  for _ = 1, n_labels do
    local label, header, m = ARGV[pos], ARGV[pos + 1], tonumber(ARGV[pos + 2])
    local fields = {label}
    for j = pos + 3, pos + 3 * m, 3 do
      if ARGV[j] == 'M' then fields[#fields + 1] = label .. '[' .. ARGV[j + 1] .. ']' end
    end
    local held = redis.call('HMGET', pub, unpack(fields))
    if held[1] and held[1] ~= header then return nil, {'KIND', label} end
    merges[#merges + 1] = {label, header, pos + 3, m, held}
    pos = pos + 3 + 3 * m
  end
  return merges, nil
end

local function apply_merges(pub, merges)
  for _, entry in ipairs(merges) do
    local label, first, m, held = entry[1], entry[3], entry[4], entry[5]
    local sets = {label, entry[2]}
    local raised = 1  -- held[1] is the header: the raised parts' values follow, in order
    local new_label = not held[1]
    for j = first, first + 3 * (m - 1), 3 do
      local op, field, value = ARGV[j], label .. '[' .. ARGV[j + 1] .. ']', ARGV[j + 2]
      local take = new_label or op == 'S'
      if op == 'M' then
        raised = raised + 1
        take = take or tonumber(value) > tonumber(held[raised] or '0')
      end
      if take then
        sets[#sets + 1] = field
        sets[#sets + 1] = value
      end
    end
    for i = 1, #sets, 1000 do
      redis.call('HSET', pub, unpack(sets, i, math.min(i + 999, #sets)))
    end
  end
end
