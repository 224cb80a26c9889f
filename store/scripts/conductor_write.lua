#!lua
-- Write one operation's changes to a request held as the engine's Conductor keeps it
-- (store/conductor/layout.py): the client applied the engine's rules to the version it read;
-- this commits them whole, once, and only onto that version.
-- KEYS[1] the request's conductor hash   KEYS[2] its lease hash   KEYS[3] its history stream
-- ARGV[1] record format   ARGV[2] partition of the caller's lease ('*': request-level)
-- ARGV[3] its fencing token ('' for none: refused while any replica holds a live lease)
-- ARGV[4] op id   ARGV[5] the version the change was made on ('0': no record)
-- ARGV[6] the op's result (returned to a retry of the same op id)
-- ARGV[7] how many of the latest op ids keep their results (field 'ops': one per line)
-- ARGV[8] expiry: '' keep, 'persist', or milliseconds
-- ARGV[9] what the op did, for the history   ARGV[10] history cap ('0': none)
-- ARGV[11] n, the number of fields to delete: ARGV[12 .. 11+n]; then field, value pairs.
-- Returns {'OK', version}, {'DONE', result} (applied before), {'STALE', version},
-- {'FORMAT', found}, {'CORRUPT', field} or {'FENCED', token[, partition]}.
local key = KEYS[1]
local done = redis.call('HGET', key, 'o:' .. ARGV[4])
if done then return {'DONE', done} end
local fenced = check_fence(KEYS[2], ARGV[2], ARGV[3], now())
if fenced then
  history(KEYS[3], ARGV[10], key, {'op', ARGV[9], 'outcome', 'fenced', 'token', ARGV[3],
    'detail', 'current token ' .. fenced[2]})
  return fenced
end
local fields = redis.call('HMGET', key, 'ver', '_f', 'ops', 'nops')
local version = fields[1] or '0'
if version ~= ARGV[5] then return {'STALE', version} end
if fields[2] and fields[2] ~= ARGV[1] then return {'FORMAT', fields[2]} end
-- The latest op ids, this one appended; the oldest forgotten beyond ARGV[7] (checked here,
-- before the first write: damage to them refuses the write whole).
local ops, kept = (fields[3] or '') .. ARGV[4] .. '\n', tonumber(fields[4] or '0')
if not kept then return {'CORRUPT', 'nops'} end
kept = kept + 1
local forget = nil
if kept > tonumber(ARGV[7]) then
  local eol = string.find(ops, '\n', 1, true)
  if not eol or eol == 1 then return {'CORRUPT', 'ops'} end
  forget = string.sub(ops, 1, eol - 1)
  ops, kept = string.sub(ops, eol + 1), kept - 1
end
local n = tonumber(ARGV[11])
if n > 0 then redis.call('HDEL', key, unpack(ARGV, 12, 11 + n)) end
local next_version = digits(tonumber(version) + 1)
redis.call('HSET', key, 'ver', next_version, '_f', ARGV[1], 'o:' .. ARGV[4], ARGV[6])
if #ARGV > 11 + n then hset_pairs(key, 12 + n, #ARGV) end
if forget then redis.call('HDEL', key, 'o:' .. forget) end
redis.call('HSET', key, 'ops', ops, 'nops', digits(kept))
if ARGV[8] == 'persist' then
  redis.call('PERSIST', key)
elseif ARGV[8] ~= '' then
  redis.call('PEXPIRE', key, ARGV[8])
end
history(KEYS[3], ARGV[10], key, {'op', ARGV[9], 'outcome', 'applied', 'token', ARGV[3],
  'detail', 'version ' .. next_version})
return {'OK', next_version}
