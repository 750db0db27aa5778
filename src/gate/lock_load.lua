-- Takes a sale's load lock, across every process: exactly one rebuild at a time.
-- KEYS[1] sale hash  KEYS[2] load lock  KEYS[3] fence counter
-- KEYS[4] confirms made while loading (orders written to SQL during the load)
-- ARGV[1] owner token  ARGV[2] lease ms  ARGV[3] the start of this process's owner tokens
-- Returns the fence (> 0) of the new lock, 0 if the sale is loaded, -1 if another holds it.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
local held = redis.call('GET', KEYS[2])
if held and string.sub(held, 1, #ARGV[3]) == ARGV[3] then
  -- This process's own lock, from a load whose answer was lost (a failover) or that was
  -- given up: the process loads a sale one load at a time, so that load is over. Taken
  -- over now rather than waited out; the new fence shuts out anything it left behind.
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
elseif not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return -1
end
-- Confirms recorded before this lock were written before this loader reads SQL: its
-- snapshot counts them.
redis.call('DEL', KEYS[4])
return redis.call('INCR', KEYS[3])
