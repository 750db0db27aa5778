-- The purchase gate: one atomic step per purchase attempt.
-- KEYS[1] sale hash    {stock, limit, begins, ends, paused, price}
-- KEYS[2] buyers hash  user_id -> units held
-- KEYS[3] order stream (the order log)
-- KEYS[4] accepted hash order_id -> 'user_id:quantity' (answers "queued" before SQL has it)
-- KEYS[5] rate hash    user_id -> theoretical arrival time (GCRA), per sale
-- ARGV[1] user_id  ARGV[2] quantity  ARGV[3] order_id  ARGV[4] sale_id
-- ARGV[5] emission interval ms (0: no rate limit)  ARGV[6] burst tolerance ms
-- Returns {code, number}: code is ok | not_loaded | rate_limited (ms to wait) |
-- not_started | ended | paused | already_purchased | over_limit | sold_out.
local sale = redis.call('HMGET', KEYS[1], 'stock', 'limit', 'begins', 'ends', 'paused', 'price')
if not sale[1] then
  return {'not_loaded', 0}
end
local stock = tonumber(sale[1])
-- The window is judged by Redis' own clock, inside the atomic step, so that every
-- instance agrees on the instant a sale opens and closes.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Per user and sale, across every instance: a script firing hundreds of requests a second
-- is throttled here, in the same round trip, before it can touch the stock.
local interval = tonumber(ARGV[5])
if interval > 0 then
  local tat = math.max(tonumber(redis.call('HGET', KEYS[5], ARGV[1]) or '0'), now)
  local wait = tat - now - tonumber(ARGV[6])
  if wait > 0 then
    return {'rate_limited', wait}
  end
  redis.call('HSET', KEYS[5], ARGV[1], tat + interval)
end
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
