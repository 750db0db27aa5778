-- Takes a move's units out of a segment of a segmented sale (the donor), exactly once per
-- move: the moves hash remembers what this segment did with each move, and a repeat
-- answers the same. Units are only taken if the segment has them all.
-- KEYS[1] segment's sale hash  KEYS[2] segment's moves hash
-- ARGV[1] move id  ARGV[2] quantity
-- Returns 1 taken, 0 refused, -1 segment not in the gate.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return -1
end
local before = redis.call('HGET', KEYS[2], ARGV[1])
if before then
  return before == 'taken' and 1 or 0
end
local qty = tonumber(ARGV[2])
if tonumber(redis.call('HGET', KEYS[1], 'stock')) < qty then
  redis.call('HSET', KEYS[2], ARGV[1], 'refused')
  return 0
end
redis.call('HINCRBY', KEYS[1], 'stock', -qty)
redis.call('HSET', KEYS[2], ARGV[1], 'taken')
return 1
