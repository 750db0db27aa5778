-- Stages part of a sale's load (buyers, counted and released orders) in keys of the loader's own,
-- only while the loader holds the sale's load lock: a loader that lost its lock writes
-- nothing. The staged keys become live in load_sale.lua, in one step.
-- KEYS[1] load lock  KEYS[2] staging key (a hash for buyers, a set for order ids)
-- ARGV[1] owner token  ARGV[2] 'hash' | 'set'  ARGV[3..] field, value pairs or members
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('LOCKLOST the load lock of this sale has passed to another loader')
end
if ARGV[2] == 'hash' then
  redis.call('HSET', KEYS[2], unpack(ARGV, 3))
else
  redis.call('SADD', KEYS[2], unpack(ARGV, 3))
end
-- A loader that dies leaves nothing behind for long.
redis.call('PEXPIRE', KEYS[2], 600000)
return 1
