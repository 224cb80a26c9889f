#!lua
-- Merge published infos the server can merge by itself (see store/codec/published.py), once.
-- KEYS[1] the partition hash (must exist at this schema version)
-- KEYS[2] the partition's publish-info hash   KEYS[3] the request's ops sorted set
-- KEYS[4] the partition's merging claim: while an optimistic merge that kept losing to
--         these holds it, this script steps aside (returns BUSY) so that merge can commit
-- KEYS[5] the request's history stream
-- ARGV[1] schema version   ARGV[2] op id   ARGV[3] dedupe window (seconds)
-- ARGV[4] history cap      ARGV[5] partition name
-- ARGV[6] the number of labels; then the merges (see check_merges in _lib.lua).
-- Returns {'OK'}, {'DUP'} (this op was applied already), {'BUSY', holder} (nothing written),
-- {'KIND', label} when a label holds another kind (nothing written), or NOKEY/SCHEMA. The
-- caller reads the merged state back in the same MULTI, which costs the server less than
-- reading it here.
local bad = check_records({KEYS[1]}, ARGV[1])
if bad then return bad end
local pub, ops = KEYS[2], KEYS[3]
local merges, refused = check_merges(pub, KEYS[4], 7, tonumber(ARGV[6]))
if refused then return refused end
if op_seen(ops, ARGV[2]) then return {'DUP'} end
apply_merges(pub, merges)
record_op(ops, ARGV[2], now(), ARGV[3], KEYS[1])
history(KEYS[5], ARGV[4], KEYS[1], {'op', 'merge', 'partition', ARGV[5], 'outcome', 'applied'})
return {'OK'}
