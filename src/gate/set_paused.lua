-- Sets the pause flag of a sale that is in the gate; never creates a partial sale hash
-- (which would look loaded and block the real load).
-- KEYS[1] sale hash  ARGV[1] '1' or '0'
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'paused', ARGV[1])
return 1
