-- Gives a cancelled or expired order's units back to the gate and frees the buyer's
-- slot, exactly once per order: the released set remembers every order given back.
-- KEYS[1] sale hash  KEYS[2] buyers hash  KEYS[3] released set
-- ARGV[1] order_id  ARGV[2] user_id  ARGV[3] quantity  ARGV[4] stock channel  ARGV[5] sale_id
-- Returns 1 released now, 0 released before, -1 sale not in the gate (its next load
-- reads the returned stock from SQL).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return -1
end
if redis.call('SADD', KEYS[3], ARGV[1]) == 0 then
  return 0
end
local qty = tonumber(ARGV[3])
redis.call('HINCRBY', KEYS[1], 'stock', qty)
local held = redis.call('HINCRBY', KEYS[2], ARGV[2], -qty)
if held <= 0 then
  redis.call('HDEL', KEYS[2], ARGV[2])
end
-- Every instance that answers sold_out from its local flag reopens the sale.
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
