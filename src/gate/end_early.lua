-- Ends a sale that is in the gate at ARGV[1] (Unix ms) if it would end later: ending a
-- sale early, judged by every instance's next purchase at once. Never extends a sale and
-- never creates a partial sale hash.
-- KEYS[1] sale hash  ARGV[1] the new end
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
if tonumber(redis.call('HGET', KEYS[1], 'ends')) > tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'ends', ARGV[1])
end
return 1
