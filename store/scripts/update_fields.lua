#!lua
-- Replace attributes of an existing record (setting a value is idempotent by nature).
-- KEYS[1] the record hash   KEYS[2] the request's lease hash   KEYS[3] its history stream
-- ARGV[1] schema version
-- ARGV[2] what the write belongs to: a partition name (fenced by its lease), '*' (the
--         request: every partition's lease fences it) or '-' (no lease fences it)
-- ARGV[3] the fencing token of the caller's lease ('' for none: then refused while any
--         replica holds a live lease on what the write belongs to)
-- ARGV[4] the number q of attributes replaced whole
-- ARGV[5..4+q] their names: fields "<name>" and "<name>[...]" are removed first
-- ARGV[5+q] history cap   ARGV[6+q] what the history calls the write
-- ARGV[7+q..] field/value pairs to set
-- Returns {'OK'}, {'FENCED', token, partition} or NOKEY/SCHEMA.
local bad = check_records({KEYS[1]}, ARGV[1])
if bad then return bad end
if ARGV[2] ~= '-' then
  local fenced = check_fence(KEYS[2], ARGV[2], ARGV[3], now())
  if fenced then
    history(KEYS[3], ARGV[5 + tonumber(ARGV[4])], KEYS[1], {'op', ARGV[6 + tonumber(ARGV[4])],
      'partition', fenced[3] or '', 'outcome', 'fenced', 'token', ARGV[3],
      'detail', 'current token ' .. fenced[2]})
    return fenced
  end
end
local q = tonumber(ARGV[4])
local names, per_pass = {}, false
for i = 1, q do
  names[i] = ARGV[4 + i]
  if names[i] == 'current_worker_graph_ids' or names[i] == 'completed_worker_graph_ids'
      or names[i] == 'wg_rank_completions' then
    per_pass = true
  end
end
clear_attributes(KEYS[1], names)
if #ARGV >= 7 + q then hset_pairs(KEYS[1], 7 + q, #ARGV) end
if per_pass then recount(KEYS[1]) end
history(KEYS[3], ARGV[5 + q], KEYS[1], {'op', ARGV[6 + q],
  'partition', (ARGV[2] ~= '*' and ARGV[2] ~= '-') and ARGV[2] or '',
  'outcome', 'applied', 'token', ARGV[3]})
return {'OK'}
