-- Which commands the calling user may run (mstar-store doctor): a script needs no admin
-- right to ask, unlike ACL DRYRUN or ACL GETUSER. Redis >= 7 (redis.acl_check_cmd).
-- KEYS: none   ARGV: groups of <n> <word 1> .. <word n>: a command, its subcommand, and
-- a key where it takes one (the arity is not checked)
-- Returns {refused, unknown}: the 1-based numbers of the groups the user may not run,
-- and of those this server does not know; {'UNSUPPORTED'} before Redis 7.
if redis.acl_check_cmd == nil then return {'UNSUPPORTED'} end
local refused, unknown = {}, {}
local i, group = 1, 0
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  group = group + 1
  local ok, allowed = pcall(redis.acl_check_cmd, unpack(ARGV, i + 1, i + n))
  if not ok then
    unknown[#unknown + 1] = group
  elseif not allowed then
    refused[#refused + 1] = group
  end
  i = i + n + 1
end
return {refused, unknown}
