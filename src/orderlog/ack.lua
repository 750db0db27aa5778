-- Acknowledges a writer's entries of one stream and deletes them, in one atomic step: an
-- entry acknowledged but left in the stream is never delivered again and counts as
-- unwritten for ever, so the two must never be cut apart.
-- When, once these are acknowledged, nothing up to the newest of them is pending, every
-- entry up to it has been delivered and acknowledged (written, or dead-lettered): one XTRIM
-- drops them by whole stream nodes. XDEL seeks each id through its node, five times the
-- cost of this whole step (BENCHMARKS.md, session 23). Otherwise (another writer still
-- holds older entries, or some of these were not pending) only these ids are deleted.
-- KEYS[1] the stream  ARGV[1] the group  ARGV[2] the newest id ('' when not every id reads
-- as ms-seq)  ARGV[3] the id right after it  ARGV[4..] the ids
-- Returns how many were pending.
local ids = #ARGV - 3
local acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 4))
if acked == ids and ARGV[2] ~= ''
  and #redis.call('XPENDING', KEYS[1], ARGV[1], '-', ARGV[2], 1) == 0 then
  redis.call('XTRIM', KEYS[1], 'MINID', ARGV[3])
else
  redis.call('XDEL', KEYS[1], unpack(ARGV, 4))
end
return acked
