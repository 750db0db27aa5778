-- Sets aside an entry no writer can ever write: copied to the sale's dead-letter stream
-- with the reason, then deleted and acknowledged, in one step. As a pipeline, an XADD
-- refused (Redis out of memory) still let the XDEL and XACK run, and the order vanished
-- from both streams; and a cut after the XADD left it pending, to be copied again. An entry
-- already gone was written or set aside by another writer: it is only acknowledged.
-- KEYS[1] the stream  KEYS[2] the dead-letter stream  ARGV[1] the group  ARGV[2] the entry id
-- ARGV[3] the reason
-- ARGV[4..] only when some orders of a batch entry are set aside and its others are in SQL:
-- each one's order (packed: order_id:sale_id:user_id:quantity:price_cents:accepted_at) and
-- reason, in pairs; each becomes a dead letter of its own, and the entry is removed.
-- Returns 1 when the entry was set aside, 0 when it was gone.
local entry = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])[1]
if not entry then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
  return 0
end
if #ARGV > 3 then
  for i = 4, #ARGV - 1, 2 do
    redis.call('XADD', KEYS[2], '*', 'source_id', ARGV[2], 'reason', ARGV[i + 1], 'o', ARGV[i])
  end
else
  local add = {'XADD', KEYS[2], '*', 'source_id', ARGV[2], 'reason', ARGV[3]}
  for _, v in ipairs(entry[2]) do
    add[#add + 1] = v
  end
  redis.call(unpack(add))
end
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return 1
