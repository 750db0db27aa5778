-- Gives a cancelled or expired order's units back to the gate and frees the buyer's
-- slot, exactly once per order: the released set remembers every order given back, and
-- a load fills it with every order SQL has cancelled or expired (the stock it loads
-- counts them all), so a release that comes late to a rebuilt gate changes nothing.
-- KEYS[1] sale hash  KEYS[2] buyers hash  KEYS[3] released set  KEYS[4] load lock
-- KEYS[5] accepted hash  KEYS[6] counted (counted.lua)  KEYS[7] the earlier counted set
-- KEYS[8] rate hash (purchase.lua)
-- ARGV[1] order_id  ARGV[2] user_id  ARGV[3] quantity  ARGV[4] stock channel  ARGV[5] sale_id
-- ARGV[6] the per-user rate's emission interval in ms (0: no rate limit)
-- Returns 1 released now; 0 released before; 2 an order this gate never counted (written
-- after its load's snapshot and not confirmed yet: its confirm will skip it), nothing to
-- give back; -1 the sale is not in the gate and nobody is loading it (its next load reads
-- the return from SQL); -3 a load is under way, whose snapshot may predate the return:
-- keep it and release it again once the sale is in.
if redis.call('EXISTS', KEYS[1]) == 0 then
  if redis.call('EXISTS', KEYS[4]) == 1 then
    return -3
  end
  return -1
end
if redis.call('SADD', KEYS[3], ARGV[1]) == 0 then
  return 0
end
if redis.call('HEXISTS', KEYS[5], ARGV[1]) == 0
  and not counted_has(KEYS[6], KEYS[7], ARGV[1]) then
  return 2
end
local qty = tonumber(ARGV[3])
redis.call('HINCRBY', KEYS[1], 'stock', qty)
local held = redis.call('HINCRBY', KEYS[2], ARGV[2], -qty)
if held <= 0 then
  redis.call('HDEL', KEYS[2], ARGV[2])
end
-- The buyer is below the limit again and will be throttled again; the purchase that took
-- them to it kept no place in the rate (purchase.lua), so the freed slot takes one now:
-- buying, cancelling and buying again runs at the rate, not as fast as a cancel can follow.
local interval = tonumber(ARGV[6])
if interval > 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local tat = tonumber(redis.call('HGET', KEYS[8], ARGV[2]) or '0')
  redis.call('HSET', KEYS[8], ARGV[2], string.format('%d', math.max(tat, now) + interval))
end
-- Every instance that answers sold_out from its local flag reopens the sale.
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
