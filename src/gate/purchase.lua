-- The purchase gate: one atomic step per purchase attempt.
-- KEYS[1] sale hash    {stock, limit, begins, ends, paused, price}
-- KEYS[2] buyers hash  user_id -> units held
-- KEYS[3] order stream (the order log)
-- KEYS[4] accepted hash order_id -> 'user_id:quantity' (answers "queued" before SQL has it)
-- ARGV[1] user_id  ARGV[2] quantity  ARGV[3] order_id  ARGV[4] sale_id
-- Returns {code, number}: code is ok | not_loaded | not_started | ended | paused |
-- already_purchased | over_limit | sold_out.
local sale = redis.call('HMGET', KEYS[1], 'stock', 'limit', 'begins', 'ends', 'paused', 'price')
if not sale[1] then
  return {'not_loaded', 0}
end
local stock = tonumber(sale[1])
-- The window is judged by Redis' own clock, inside the atomic step, so that every
-- instance agrees on the instant a sale opens and closes.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if now < tonumber(sale[3]) then
  return {'not_started', stock}
end
if now >= tonumber(sale[4]) then
  return {'ended', stock}
end
if sale[5] == '1' then
  return {'paused', stock}
end
local qty = tonumber(ARGV[2])
local limit = tonumber(sale[2])
local held = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if held + qty > limit then
  if held >= limit then
    return {'already_purchased', held}
  end
  return {'over_limit', held}
end
if stock < qty then
  return {'sold_out', stock}
end
redis.call('HINCRBY', KEYS[1], 'stock', -qty)
redis.call('HINCRBY', KEYS[2], ARGV[1], qty)
redis.call('XADD', KEYS[3], '*',
  'order_id', ARGV[3], 'sale_id', ARGV[4], 'user_id', ARGV[1],
  'quantity', qty, 'price_cents', sale[6], 'accepted_at', now)
redis.call('HSET', KEYS[4], ARGV[3], ARGV[1] .. ':' .. qty)
return {'ok', stock - qty}
