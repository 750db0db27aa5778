-- Gives a lock back only if its holder still owns it (compare-and-delete): a holder
-- whose lease ran out must not free the lock of the one that took it over.
-- KEYS[1] lock  ARGV[1] owner token
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
