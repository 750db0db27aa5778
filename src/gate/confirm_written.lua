-- Orders of one sale the writer has just committed to SQL. One the gate already counts
-- (it accepted it, or its load counted it) changes nothing; one it does not (the gate
-- was rebuilt from SQL while the writer held it) takes its units now. While a load holds
-- the lock, the orders are recorded for load_sale.lua, which reads SQL before their commit.
-- KEYS[1] sale hash  KEYS[2] buyers hash  KEYS[3] accepted hash  KEYS[4] counted (counted.lua)
-- KEYS[5] released set  KEYS[6] load lock  KEYS[7] confirms made while loading
-- KEYS[8] counted, as earlier builds kept it (a set)
-- ARGV: order_id, user_id, quantity per order
-- Returns how many orders took units now.
local applied = 0
if redis.call('EXISTS', KEYS[1]) == 1 then
  -- Nearly every order was accepted by this gate: one HMGET answers for all of them, where
  -- a call per order cost Redis several times the lookup itself.
  local ids = {}
  for i = 1, #ARGV, 3 do
    ids[#ids + 1] = ARGV[i]
  end
  local accepted = #ids > 0 and redis.call('HMGET', KEYS[3], unpack(ids)) or {}
  for i = 1, #ARGV, 3 do
    local id = ARGV[i]
    if not accepted[(i + 2) / 3]
      and not counted_has(KEYS[4], KEYS[8], id)
      and redis.call('SISMEMBER', KEYS[5], id) == 0 then
      local qty = tonumber(ARGV[i + 2])
      counted_add(KEYS[4], id)
      redis.call('HINCRBY', KEYS[1], 'stock', -qty)
      redis.call('HINCRBY', KEYS[2], ARGV[i + 1], qty)
      applied = applied + 1
    end
  end
elseif redis.call('EXISTS', KEYS[6]) == 1 then
  for i = 1, #ARGV, 3 do
    redis.call('HSET', KEYS[7], ARGV[i], ARGV[i + 1] .. ':' .. ARGV[i + 2])
  end
  redis.call('PEXPIRE', KEYS[7], 600000)
end
return applied
