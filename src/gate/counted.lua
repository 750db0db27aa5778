-- The order ids a gate counts without having accepted them (its load read them from SQL,
-- or a writer confirmed them after the load), packed: a hash whose field is an id's last
-- four digits and whose value is ",id,id,...,". A million ids are 10,000 fields, not a
-- million set members: a load stages them in a hundred commands, and Redis keeps a third
-- less memory. Prefixed to the scripts that read or add ids (confirm_written, load_sale,
-- release).
-- Builds before the packing kept a set under another key: it is read too (a gate loaded
-- by such a build, then served by this one) and never written, and a load deletes it. A
-- build of either kind that misses the other's ids only undersells (a confirm counts an
-- order again, a release gives nothing back), never oversells.
local function counted_bucket(id)
  return string.sub(id, -4)
end

local function counted_has(key, earlier_set, id)
  local packed = redis.call('HGET', key, counted_bucket(id))
  if packed and string.find(packed, ',' .. id .. ',', 1, true) then
    return true
  end
  return redis.call('SISMEMBER', earlier_set, id) == 1
end

local function counted_add(key, id)
  local bucket = counted_bucket(id)
  local packed = redis.call('HGET', key, bucket)
  redis.call('HSET', key, bucket, (packed or ',') .. id .. ',')
end

