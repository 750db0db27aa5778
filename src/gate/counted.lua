-- The order ids a gate counts without having accepted them (its load read them from SQL,
-- or a writer confirmed them after the load), packed: a hash whose field is an id's last
-- four digits and whose value is ",id,id,...,". A million ids are 10,000 fields, not a
-- million set members: a load stages them in a few commands, and Redis keeps a third of
-- the memory. Prefixed to the scripts that read or add ids (confirm_written, load_sale,
-- release). A gate loaded by a build before this layout keeps them as a set: read as such.
local function counted_bucket(id)
  return string.sub(id, -4)
end

local function counted_has(key, id)
  local packed = redis.pcall('HGET', key, counted_bucket(id))
  if type(packed) == 'table' and packed.err then
    return redis.call('SISMEMBER', key, id) == 1
  end
  return packed ~= false and string.find(packed, ',' .. id .. ',', 1, true) ~= nil
end

local function counted_add(key, id)
  local bucket = counted_bucket(id)
  local packed = redis.pcall('HGET', key, bucket)
  if type(packed) == 'table' and packed.err then
    redis.call('SADD', key, id)
    return
  end
  redis.call('HSET', key, bucket, (packed or ',') .. id .. ',')
end

