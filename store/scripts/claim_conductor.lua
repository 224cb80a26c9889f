#!lua
-- Take (or renew) the request-level lease of a request held as the engine's Conductor keeps
-- it: every conductor_write fenced with it checks its token, and a claim by another holder
-- (after this one expired) raises the token, fencing this one out.
-- KEYS[1] the request's lease hash   ARGV[1] holder   ARGV[2] ttl (seconds)
-- Returns {'OK', token, expires} or {'HELD', holder, token} (another holder's live lease).
local t = now()
local holder, token = live_lease(KEYS[1], '*', t)
if holder and holder ~= ARGV[1] then return {'HELD', holder, token} end
local granted, expires = grant_lease(KEYS[1], '*', ARGV[1], t, ARGV[2], '0', KEYS[1])
return {'OK', tostring(granted), expires}
