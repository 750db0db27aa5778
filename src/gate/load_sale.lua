-- Opens a sale in the gate from a SQL snapshot, as the holder of its load lock. Never
-- overwrites live stock. The rebuilt gate is SQL + the order stream, exactly: the snapshot,
-- plus stream entries SQL did not have, plus orders written to SQL after the snapshot
-- (recorded by confirm_written.lua while the lock was held). Each order counts once.
-- KEYS[1] sale hash  KEYS[2] buyers hash  KEYS[3] order stream  KEYS[4] accepted hash
-- KEYS[5] staged buyers (hash)  KEYS[6] released set  KEYS[7] rate hash  KEYS[8] load lock
-- KEYS[9] staged counted orders  KEYS[10] counted orders (both packed: counted.lua)
-- KEYS[11] confirms made while loading (hash order_id -> 'user_id:quantity')
-- KEYS[12] moves hash (move id -> taken | refused | given: moves between segments)
-- KEYS[13] staged released orders (set): every order SQL cancelled or expired
-- KEYS[14] counted, as earlier builds kept it (a set): deleted
-- ARGV: owner, stock, limit, begins, ends, paused, price, expire_at_ms, group, fence,
--       n_moves, then move id, mark pairs, then the number of buyers staged
-- Returns 1 loaded, 0 already loaded, -2 the lock was lost or the staged buyers are not
-- all there (nothing written).
if redis.call('GET', KEYS[8]) ~= ARGV[1] then
  return -2
end
local function give_up()
  redis.call('DEL', KEYS[5], KEYS[9], KEYS[13], KEYS[8])
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  give_up()
  return 0
end
-- Staging took many round trips, while SQL was read: a write Redis acknowledged and then
-- lost (a restart between fsyncs) would leave buyers out, and their limits unguarded.
if redis.call('HLEN', KEYS[5]) ~= tonumber(ARGV[12 + 2 * tonumber(ARGV[11])]) then
  give_up()
  return -2
end
redis.call('DEL', KEYS[2], KEYS[10], KEYS[6], KEYS[4], KEYS[14])
if redis.call('EXISTS', KEYS[5]) == 1 then
  redis.call('RENAME', KEYS[5], KEYS[2])
end
if redis.call('EXISTS', KEYS[9]) == 1 then
  redis.call('RENAME', KEYS[9], KEYS[10])
end
-- Returns SQL counted in the stock: a release of any of them later changes nothing.
if redis.call('EXISTS', KEYS[13]) == 1 then
  redis.call('RENAME', KEYS[13], KEYS[6])
end
-- Moves SQL counted in this segment's stock: their later steps here change nothing.
redis.call('DEL', KEYS[12])
for i = 12, 11 + 2 * tonumber(ARGV[11]), 2 do
  redis.call('HSET', KEYS[12], ARGV[i], ARGV[i + 1])
end
local stock = tonumber(ARGV[2])

-- An order SQL did not count: take its units and record its buyer, once.
local function count(order_id, user, qty)
  if counted_has(KEYS[10], KEYS[14], order_id)
    or redis.call('SISMEMBER', KEYS[6], order_id) == 1 then
    return
  end
  counted_add(KEYS[10], order_id)
  stock = stock - qty
  redis.call('HINCRBY', KEYS[2], user, qty)
end

-- Entries still in the stream were accepted and may not be in SQL yet.
for _, entry in ipairs(redis.call('XRANGE', KEYS[3], '-', '+')) do
  local f = {}
  local kv = entry[2]
  for j = 1, #kv, 2 do
    f[kv[j]] = kv[j + 1]
  end
  local orders = {}
  if f.b and #kv == 2 then
    -- purchase.lua's batch entry, sale_id:price_cents:accepted_at;order_id:user_id:quantity;...
    -- counted whole or not at all, as the writers read it (one they cannot read is set
    -- aside whole, none of its orders written). A value past 2^63 the writers refuse is
    -- not checked here: purchase.lua writes none.
    local head, whole = true, true
    for part in string.gmatch(f.b .. ';', '([^;]*);') do
      if head then
        whole = string.match(part, '^%d+:%d+:%d+$') ~= nil
        head = false
      else
        local order_id, user, qty = string.match(part, '^(%d+):(%d+):(%d+)$')
        whole = order_id ~= nil and tonumber(order_id) > 0 and tonumber(qty) > 0
        orders[#orders + 1] = {order_id, user, qty}
      end
      if not whole then
        orders = {}
        break
      end
    end
  elseif f.o then
    -- purchase.lua's packed entry: order_id:sale_id:user_id:quantity:price_cents:accepted_at
    orders[1] = {string.match(f.o, '^(%d+):%d+:(%d+):(%d+):%d+:%d+$')}
  else
    orders[1] = {f.order_id, f.user_id, f.quantity}
  end
  for _, o in ipairs(orders) do
    local order_id, user, qty = o[1], o[2], o[3]
    if order_id and user and tonumber(qty) then
      count(order_id, user, tonumber(qty))
      -- Still queued: lookups (GET /api/orders/{id}, pay, cancel) keep finding it.
      redis.call('HSET', KEYS[4], order_id, user .. ':' .. qty)
    end
  end
end
-- Orders written to SQL after the snapshot.
local confirms = redis.call('HGETALL', KEYS[11])
for j = 1, #confirms, 2 do
  local user, qty = string.match(confirms[j + 1], '^(%d+):(%d+)$')
  if user then
    count(confirms[j], user, tonumber(qty))
  end
end
redis.call('DEL', KEYS[11])

-- The server this gate lives on: forget_stale.lua compares it after a failover or restart.
local server = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
redis.call('HSET', KEYS[1], 'stock', stock, 'limit', ARGV[3], 'begins', ARGV[4],
  'ends', ARGV[5], 'paused', ARGV[6], 'price', ARGV[7], 'fence', ARGV[10], 'server', server)
-- The consumer group exists before the first order is appended, reading from the start.
local ok, err = pcall(redis.call, 'XGROUP', 'CREATE', KEYS[3], ARGV[9], '0', 'MKSTREAM')
if not ok and not string.find(tostring(err), 'BUSYGROUP') then
  return redis.error_reply(tostring(err))
end
redis.call('DEL', KEYS[7])
redis.call('HSET', KEYS[7], '_', '0')
for _, i in ipairs({1, 2, 4, 6, 7, 10, 12}) do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('PEXPIREAT', KEYS[i], ARGV[8])
  end
end
redis.call('DEL', KEYS[8])
return 1
