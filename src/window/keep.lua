-- Keeps one change committed to SQL in the failover window, unless the window has been
-- settled against another database since (a failover: the change may be on the old
-- primary only, and the process that committed it must hear so and try again).
-- KEYS[1] the settled identity  KEYS[2] the window stream
-- ARGV[1] the identity the change committed under  ARGV[2] the change
-- Returns {1} kept, {0, settled identity} refused.
local settled = redis.call('GET', KEYS[1])
if not settled then
  -- A new window (or a Redis that lost its data): it starts at this database.
  redis.call('SET', KEYS[1], ARGV[1])
elseif settled ~= ARGV[1] then
  return {0, settled}
end
redis.call('XADD', KEYS[2], '*', 'c', ARGV[2])
return {1}
