-- Opens a sale in the gate, only if it is not open already: live stock is never
-- overwritten, so a late or repeated preload cannot resell units.
-- KEYS[1] sale hash  KEYS[2] buyers hash  KEYS[3] order stream  KEYS[4] accepted hash
-- KEYS[5] staging hash holding the buyers when there were too many to pass as ARGV
-- KEYS[6] released set: orders whose returned units the loaded stock already counts
-- KEYS[7] rate hash (per-user GCRA state; only its expiry is set here)
-- ARGV: stock, limit, begins, ends, paused, price, expire_at_ms, group, n_released,
--       then n_released order ids, then user_id, units pairs
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('DEL', KEYS[5])
  return 0
end
redis.call('DEL', KEYS[2])
if redis.call('EXISTS', KEYS[5]) == 1 then
  redis.call('RENAME', KEYS[5], KEYS[2])
end
local n_released = tonumber(ARGV[9])
redis.call('DEL', KEYS[6])
for i = 10, 9 + n_released do
  redis.call('SADD', KEYS[6], ARGV[i])
end
for i = 10 + n_released, #ARGV, 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
end
redis.call('HSET', KEYS[1], 'stock', ARGV[1], 'limit', ARGV[2], 'begins', ARGV[3],
  'ends', ARGV[4], 'paused', ARGV[5], 'price', ARGV[6])
-- The consumer group exists before the first order is appended, reading from the start.
local ok, err = pcall(redis.call, 'XGROUP', 'CREATE', KEYS[3], ARGV[8], '0', 'MKSTREAM')
if not ok and not string.find(tostring(err), 'BUSYGROUP') then
  return redis.error_reply(tostring(err))
end
redis.call('DEL', KEYS[7])
redis.call('HSET', KEYS[7], '_', '0')
for _, i in ipairs({1, 2, 6, 7}) do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('PEXPIREAT', KEYS[i], ARGV[7])
  end
end
return 1
