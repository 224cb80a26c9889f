-- Read several hashes of one request as one consistent snapshot.
-- KEYS[1..n] the hashes
-- Returns one flat HGETALL reply per key, in KEYS order (empty for a missing key).
local out = {}
for i, key in ipairs(KEYS) do out[i] = redis.call('HGETALL', key) end
return out
