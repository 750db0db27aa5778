-- Gives a move's units to a segment of a segmented sale (the receiver), exactly once per
-- move, and tells every instance that the sale has stock again (their sold-out flags).
-- KEYS[1] segment's sale hash  KEYS[2] segment's moves hash
-- ARGV[1] move id  ARGV[2] quantity  ARGV[3] stock channel  ARGV[4] sale_id
-- Returns 1 given now, 0 given before, -1 segment not in the gate (its load counts the
-- move from SQL).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return -1
end
if redis.call('HSETNX', KEYS[2], ARGV[1], 'given') == 0 then
  return 0
end
redis.call('HINCRBY', KEYS[1], 'stock', tonumber(ARGV[2]))
redis.call('PUBLISH', ARGV[3], ARGV[4])
return 1
