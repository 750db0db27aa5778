-- Renews a lease (a sale's load lock, a worker id) only if its holder still owns it.
-- KEYS[1] lock  ARGV[1] owner token  ARGV[2] lease ms
-- Returns 1 renewed, 0 lost.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
