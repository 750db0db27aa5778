-- The purchase gate: purchase attempts on one sale, decided one after another in one
-- atomic step. Concurrent requests share a call (a batch of one is the plain case), so
-- Redis pays its per-command cost once per batch rather than once per buyer.
-- KEYS[1] sale hash    {stock, limit, begins, ends, paused, price}
-- KEYS[2] buyers hash  user_id -> units held
-- KEYS[3] order stream (the order log)
-- KEYS[4] accepted hash order_id -> 'user_id:quantity' (answers "queued" before SQL has it)
-- KEYS[5] rate hash    user_id -> theoretical arrival time (GCRA), per sale, of buyers
--                      below the limit (one who holds it is not throttled)
-- KEYS[5+i] attempt i's purchase-token marker (any key of the sale when it has no token)
-- KEYS[5+n+i] (n attempts) attempt i's Idempotency-Key record, in a call of attempts that
--             all carry one; a call without these keys reads and writes no record
-- ARGV[1] sale_id  ARGV[2] emission interval ms (0: no rate limit)  ARGV[3] burst tolerance ms
-- ARGV[4] 1 when the client may resend a call Redis already ran (a cluster client), else 0
-- ARGV[5] how accepted orders are written into the stream: batch (one entry per call, one
-- field 'b', 'sale_id:price_cents:accepted_at' then ';order_id:user_id:quantity' per order,
-- docs/adr/0003), packed (an entry per order, one field 'o',
-- 'order_id:sale_id:user_id:quantity:price_cents:accepted_at') or fields (an entry per
-- order, one field per value, the form every writer reads)
-- then five values per attempt i, from ARGV[5*i+1]: user_id, quantity, order_id, how long
-- to remember its spent purchase token in ms (0: no token; -1: the attempt is tried again
-- after a move of stock into its segment, its token and rate were spent by the first try),
-- and its deadline (Unix ms).
-- An Idempotency-Key record is 'order_id:quantity', kept a day from the purchase that
-- wrote it: an attempt whose record exists is answered from it before anything else is
-- checked, and takes nothing. Only a purchase writes one; a refusal changed nothing, so
-- its retry is decided again.
-- Returns {code, number, code, number, ...}, one pair per attempt: code is ok | not_loaded |
-- expired | rate_limited (ms to wait) | not_started | ended | paused | token_used |
-- already_purchased | over_limit | sold_out | again (the number: the order the record
-- names) | key_reused (the record names another quantity).
local attempts = (#ARGV - 5) / 5
-- A caller with another argument layout would have every attempt read the wrong values.
if ARGV[5] ~= 'batch' and ARGV[5] ~= 'packed' and ARGV[5] ~= 'fields' then
  return redis.error_reply('ERR purchase.lua: ARGV[5] must be batch, packed or fields')
end
local out = {}
-- The Idempotency-Key records, in a call that names them: those this call wrote (key ->
-- value, read before Redis' own, and in order) and `replay`. Nothing of them is made for
-- other calls: each local a function here captures costs every call (measured with
-- scripts/purchase-script-instructions), so they hang off the one.
local rec
if #KEYS > 5 + attempts then
  rec = { kept = {}, changed = {} }
  -- The answer of attempt i's record, or nil when it has none.
  rec.replay = function(i)
    local key = KEYS[5 + attempts + i]
    local kept = rec.kept[key] or redis.call('GET', key)
    if not kept then
      return nil
    end
    local order, quantity = string.match(kept, '^(%d+):(%d+)$')
    if quantity ~= ARGV[5 * i + 2] then
      return 'key_reused', 0
    end
    return 'again', order
  end
end

local sale = redis.call('HMGET', KEYS[1], 'stock', 'limit', 'begins', 'ends', 'paused', 'price')
if not sale[1] then
  -- A purchase's record outlives its sale's keys in Redis.
  for i = 1, attempts do
    local code, n
    if rec then
      code, n = rec.replay(i)
    end
    out[#out + 1] = code or 'not_loaded'
    out[#out + 1] = n or 0
  end
  return out
end
local stock = tonumber(sale[1])
local limit = tonumber(sale[2])
-- The window is judged by Redis' own clock, inside the atomic step, so that every
-- instance agrees on the instant a sale opens and closes.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Numbers reach Redis as text. Lua writes a number as a float ('%.14g' in '..'; Redis
-- before 7.2 '%.17g' in redis.call), which costs more than a whole HSET; every number this script writes is
-- an integer, written once with '%d' or passed on as the text it arrived in.
local now_text = string.format('%d', now)
-- And text becomes a number by arithmetic ('s + 0', one strtod) where it arrives once per
-- attempt: Lua 5.1's tonumber() parses its argument twice.
local interval = tonumber(ARGV[2])
local tolerance = tonumber(ARGV[3])
local resends = ARGV[4] == '1'
local packed = ARGV[5] == 'packed'
local batch = ARGV[5] == 'batch'
-- What this call's attempts changed, written once each when they are all decided: every
-- redis.call from Lua costs Redis more than the command's own work (its arguments copied,
-- the command looked up and checked, its reply turned back into Lua values), so a winner
-- makes one call (its XADD) instead of five, and a batch reads its buyers and their rates
-- in one HMGET each. Nothing else runs while the script does, so no one sees the values
-- before they are written.
local taken = 0
local users = {}
for i = 1, attempts do
  users[i] = ARGV[5 * i + 1]
end
-- user -> units held (or theoretical arrival time), as read or as this call changed it
local held = {}
local tats = {}
-- users whose count (or kept time) this call changed, each once, in order
local held_changed = {}
local tats_changed = {}
-- the rate times to write: an attempt's, once it is decided and its buyer is still below
-- the limit (a buyer who holds it is not throttled, below)
local tats_kept = {}
-- whether the attempt being decided took a place in the rate
local rated = false
local accepted = {}
-- The batch form's orders, 'order_id:user_id:quantity' each, appended in one XADD once the
-- call's attempts are decided: a redis.call per winner was a quarter of the script's cost.
local batched = {}
-- order ids accepted by this call, for the resend check (their HSET comes at the end)
local accepted_now = {}

local function read_all(key, into)
  local values = redis.call('HMGET', key, unpack(users))
  for i = 1, attempts do
    if into[users[i]] == nil then
      into[users[i]] = (values[i] or 0) + 0
    end
  end
end

-- Writes the values of the users in `changed` into the hash `key` in one HSET; returns
-- what pcall returns, so that a failed write leaves the others to be made.
local function write_all(key, changed, values)
  if #changed == 0 then
    return true
  end
  local fields = {}
  for _, user in ipairs(changed) do
    fields[#fields + 1] = user
    fields[#fields + 1] = string.format('%d', values[user])
  end
  return pcall(redis.call, 'HSET', key, unpack(fields))
end

local function note(changed, values, user, value)
  if not changed[user] then
    changed[user] = true
    changed[#changed + 1] = user
  end
  values[user] = value
end

local begins = tonumber(sale[3])
local ends = tonumber(sale[4])
local open = now >= begins and now < ends and sale[5] ~= '1'
if attempts > 0 and interval > 0 then
  read_all(KEYS[5], tats)
end
if attempts > 0 and open then
  read_all(KEYS[2], held)
end

local function decide(i)
  local base = 5 * i + 1
  local user = ARGV[base]
  if rec then
    local code, n = rec.replay(i)
    if code then
      return code, n
    end
  end
  -- The same attempt again: a cluster client resends a command whose connection broke
  -- after Redis ran it. Its order stands; it must not take a second unit. (Checked only
  -- where resends happen: it is a tenth of the script's cost per attempt.)
  if resends and (accepted_now[ARGV[base + 2]]
      or redis.call('HEXISTS', KEYS[4], ARGV[base + 2]) == 1) then
    return 'ok', stock
  end
  -- Its caller has stopped waiting (Redis was stalled, or the call was stuck): the buyer
  -- may have been told it failed, so it must never take effect now.
  if now > ARGV[base + 4] + 0 then
    return 'expired', 0
  end
  local keep = ARGV[base + 3] + 0
  -- Per user and sale, across every instance: a script firing hundreds of requests a
  -- second is throttled here, before it can touch the stock. A buyer who holds the limit
  -- (the sale open) can take nothing more and is told so (already_purchased, below)
  -- without spending a place in the rate, and the purchase that takes a buyer to the limit
  -- keeps none (a release takes one when it frees the slot: release.lua): in a storm most
  -- winners reach the limit with their first purchase, and without those writes this script
  -- costs 13-23% less (measured with scripts/purchase-script-cost).
  if interval > 0 and keep >= 0 and not (open and held[user] >= limit) then
    local tat = math.max(tats[user], now)
    local wait = tat - now - tolerance
    if wait > 0 then
      return 'rate_limited', wait
    end
    tats[user] = tat + interval
    rated = true
  end
  if now < begins then
    return 'not_started', stock
  end
  if now >= ends then
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
  local qty_text = ARGV[base + 1]
  local qty = qty_text + 0
  local had = held[user]
  if had + qty <= limit then
    if stock < qty then
      return 'sold_out', stock
    end
    if batch then
      batched[#batched + 1] = ARGV[base + 2] .. ':' .. user .. ':' .. qty_text
    elseif packed then
      -- Redis stores, and every writer reads back, two strings an order instead of twelve.
      redis.call('XADD', KEYS[3], '*', 'o',
        ARGV[base + 2] .. ':' .. ARGV[1] .. ':' .. user .. ':' .. qty_text .. ':' .. sale[6] .. ':' .. now_text)
    else
      redis.call('XADD', KEYS[3], '*',
        'order_id', ARGV[base + 2], 'sale_id', ARGV[1], 'user_id', user,
        'quantity', qty_text, 'price_cents', sale[6], 'accepted_at', now_text)
    end
    -- Counted once its entry is in the stream: an XADD refused takes nothing (the batch
    -- form's one XADD comes after every decision, and nothing is written if it fails).
    stock = stock - qty
    taken = taken + qty
    note(held_changed, held, user, had + qty)
    accepted[#accepted + 1] = ARGV[base + 2]
    accepted[#accepted + 1] = user .. ':' .. qty_text
    if resends then
      accepted_now[ARGV[base + 2]] = true
    end
    if rec then
      local key = KEYS[5 + attempts + i]
      rec.kept[key] = ARGV[base + 2] .. ':' .. qty_text
      rec.changed[#rec.changed + 1] = key
    end
    return 'ok', stock
  end
  if had >= limit then
    return 'already_purchased', had
  end
  return 'over_limit', had
end

-- A script that fails midway keeps what it wrote before the error (Redis does not roll
-- back): the stream already holds the orders decided so far, so the stock, the buyers and
-- the accepted orders they took are written whatever happens, each write whatever became
-- of the others, before the first error is raised again.
local first_err
local function keep_first(ok, e)
  if not ok and not first_err then
    first_err = e
  end
end
local function decide_all()
  for i = 1, attempts do
    rated = false
    local code, n = decide(i)
    out[#out + 1] = code
    out[#out + 1] = n
    local user = users[i]
    if rated and not (open and held[user] >= limit) then
      note(tats_changed, tats_kept, user, tats[user])
    end
  end
end
keep_first(pcall(decide_all))
if #batched > 0 then
  local logged, e = pcall(redis.call, 'XADD', KEYS[3], '*', 'b',
    ARGV[1] .. ':' .. sale[6] .. ':' .. now_text .. ';' .. table.concat(batched, ';'))
  if not logged then
    -- No order of this call is in the stream, so none may count: nothing is written.
    error(e, 0)
  end
end
keep_first(write_all(KEYS[2], held_changed, held))
if #accepted > 0 then
  keep_first(pcall(redis.call, 'HSET', KEYS[4], unpack(accepted)))
end
if taken > 0 then
  keep_first(pcall(redis.call, 'HINCRBY', KEYS[1], 'stock', string.format('%d', -taken)))
end
keep_first(write_all(KEYS[5], tats_changed, tats_kept))
if rec then
  for _, key in ipairs(rec.changed) do
    -- Kept a day (in ms).
    keep_first(pcall(redis.call, 'SET', key, rec.kept[key], 'PX', 86400000))
  end
end
if first_err then
  error(first_err, 0)
end
return out
