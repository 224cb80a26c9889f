#!lua
-- Extend a lease its holder still has, by `ttl` seconds from now (server clock).
-- KEYS[1] the request's lease hash
-- KEYS[2] the recovery index (the lease hash on a cluster: see index_check in _lib.lua)
-- ARGV[1] partition name   ARGV[2] the lease's fencing token   ARGV[3] time to live (s)
-- Returns {'OK', expires} or {'FENCED', token}.
local lease, p = KEYS[1], ARGV[1]
local t = now()
local fenced = check_fence(lease, p, ARGV[2], t)
if fenced then return fenced end
if not redis.call('HGET', lease, 'holder[' .. p .. ']') then return {'FENCED', ARGV[2]} end
local expires = t + tonumber(ARGV[3])
redis.call('HSET', lease, 'expires[' .. p .. ']', expires, 'check[' .. p .. ']', expires)
index_check(KEYS[2], lease, p, expires)
return {'OK', exact(expires)}
