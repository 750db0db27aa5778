-- The purchase gate: purchase attempts on one sale, decided one after another in one
-- atomic step. Concurrent requests share a call (a batch of one is the plain case), so
-- Redis pays its per-command cost once per batch rather than once per buyer.
-- KEYS[1] sale hash    {stock, limit, begins, ends, paused, price}
-- KEYS[2] buyers hash  user_id -> units held
-- KEYS[3] order stream (the order log)
-- KEYS[4] accepted hash order_id -> 'user_id:quantity' (answers "queued" before SQL has it)
-- KEYS[5] rate hash    user_id -> theoretical arrival time (GCRA), per sale
-- KEYS[5+i] attempt i's purchase-token marker (any key of the sale when it has no token)
-- ARGV[1] sale_id  ARGV[2] emission interval ms (0: no rate limit)  ARGV[3] burst tolerance ms
-- ARGV[4] 1 when the client may resend a call Redis already ran (a cluster client), else 0
-- ARGV[5] how an accepted order is written into the stream: packed (one field 'o',
-- 'order_id:sale_id:user_id:quantity:price_cents:accepted_at') or fields (one field per
-- value, the only form writers of builds before 2026-11-27 read)
-- then five values per attempt i, from ARGV[5*i+1]: user_id, quantity, order_id, how long
-- to remember its spent purchase token in ms (0: no token; -1: the attempt is tried again
-- after a move of stock into its segment, its token and rate were spent by the first try),
-- and its deadline (Unix ms).
-- Returns {code, number, code, number, ...}, one pair per attempt: code is ok | not_loaded |
-- expired | rate_limited (ms to wait) | not_started | ended | paused | token_used |
-- already_purchased | over_limit | sold_out.
local attempts = (#ARGV - 5) / 5
-- A caller with another argument layout would have every attempt read the wrong values.
if ARGV[5] ~= 'packed' and ARGV[5] ~= 'fields' then
  return redis.error_reply('ERR purchase.lua: ARGV[5] must be packed or fields')
end
local out = {}
local sale = redis.call('HMGET', KEYS[1], 'stock', 'limit', 'begins', 'ends', 'paused', 'price')
if not sale[1] then
  for _ = 1, attempts do
    out[#out + 1] = 'not_loaded'
    out[#out + 1] = 0
  end
  return out
end
local stock = tonumber(sale[1])
local limit = tonumber(sale[2])
-- The window is judged by Redis' own clock, inside the atomic step, so that every
-- instance agrees on the instant a sale opens and closes.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local interval = tonumber(ARGV[2])
local tolerance = tonumber(ARGV[3])
local resends = ARGV[4] == '1'
local packed = ARGV[5] == 'packed'
-- Units taken by this call's attempts, not yet written to the sale hash.
local taken = 0

local function decide(i)
  local base = 5 * i + 1
  local user = ARGV[base]
  -- The same attempt again: a cluster client resends a command whose connection broke
  -- after Redis ran it. Its order stands; it must not take a second unit. (Checked only
  -- where resends happen: it is a tenth of the script's cost per attempt.)
  if resends and redis.call('HEXISTS', KEYS[4], ARGV[base + 2]) == 1 then
    return 'ok', stock
  end
  -- Its caller has stopped waiting (Redis was stalled, or the call was stuck): the buyer
  -- may have been told it failed, so it must never take effect now.
  if now > tonumber(ARGV[base + 4]) then
    return 'expired', 0
  end
  local keep = tonumber(ARGV[base + 3])
  -- Per user and sale, across every instance: a script firing hundreds of requests a
  -- second is throttled here, before it can touch the stock.
  if interval > 0 and keep >= 0 then
    local tat = math.max(tonumber(redis.call('HGET', KEYS[5], user) or '0'), now)
    local wait = tat - now - tolerance
    if wait > 0 then
      return 'rate_limited', wait
    end
    redis.call('HSET', KEYS[5], user, tat + interval)
  end
  if now < tonumber(sale[3]) then
    return 'not_started', stock
  end
  if now >= tonumber(sale[4]) then
    return 'ended', stock
  end
  if sale[5] == '1' then
    return 'paused', stock
  end
  -- A purchase token is single-use: spent by the first attempt that reaches this point,
  -- whatever that attempt's outcome.
  if keep > 0 and not redis.call('SET', KEYS[5 + i], '1', 'NX', 'PX', keep) then
    return 'token_used', 0
  end
  local qty = tonumber(ARGV[base + 1])
  local held
  if stock < qty then
    held = tonumber(redis.call('HGET', KEYS[2], user) or '0')
    if held + qty <= limit then
      return 'sold_out', stock
    end
  else
    -- Taken first and handed back when it breaks the limit: a winner, the common case
    -- while stock lasts, makes one call on the buyers hash instead of two. A buyer who
    -- held nothing leaves no field behind (HLEN counts the sale's buyers). A refusal for
    -- the limit now writes (and is replicated) where it only read; with no rate limit
    -- and no token it can be the call's first write, which a Redis refusing writes (out
    -- of memory, too few replicas) fails as it fails a winner.
    local now_held = redis.call('HINCRBY', KEYS[2], user, qty)
    held = now_held - qty
    if now_held <= limit then
      stock = stock - qty
      taken = taken + qty
      if packed then
        -- Redis stores, and every writer reads back, two strings an order instead of twelve.
        redis.call('XADD', KEYS[3], '*', 'o',
          ARGV[base + 2] .. ':' .. ARGV[1] .. ':' .. user .. ':' .. qty .. ':' .. sale[6] .. ':' .. now)
      else
        redis.call('XADD', KEYS[3], '*',
          'order_id', ARGV[base + 2], 'sale_id', ARGV[1], 'user_id', user,
          'quantity', qty, 'price_cents', sale[6], 'accepted_at', now)
      end
      redis.call('HSET', KEYS[4], ARGV[base + 2], user .. ':' .. qty)
      return 'ok', stock
    end
    if held == 0 then
      redis.call('HDEL', KEYS[2], user)
    else
      redis.call('HINCRBY', KEYS[2], user, -qty)
    end
  end
  if held >= limit then
    return 'already_purchased', held
  end
  return 'over_limit', held
end

-- The stock is written once per call, for every unit its attempts took. A script that
-- fails midway keeps what it wrote before the error (Redis does not roll back), so the
-- units taken so far are written whatever happens, before the error is raised again.
local decided, err = pcall(function()
  for i = 1, attempts do
    local code, n = decide(i)
    out[#out + 1] = code
    out[#out + 1] = n
  end
end)
if taken > 0 then
  redis.call('HINCRBY', KEYS[1], 'stock', -taken)
end
if not decided then
  error(err, 0)
end
return out
