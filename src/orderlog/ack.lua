-- Acknowledges a writer's entries of one stream and deletes them, in one atomic step: an
-- entry acknowledged but left in the stream is never delivered again and counts as
-- unwritten for ever, so the two must never be cut apart.
-- When every id was pending and, once acknowledged, nothing up to the newest of them is
-- pending, one XTRIM drops every entry up to it, by whole stream nodes. That is safe because
-- the group's reads hand out entries in id order (an id was pending, so everything before it
-- was delivered), and a delivered entry leaves the pending list only by this script or a
-- dead letter, both of which remove it from the stream: everything up to the newest id is
-- written or set aside. It assumes what this repository does: one group per stream, entries
-- appended with XADD, never a XGROUP SETID, DELCONSUMER or NOACK read. XDEL seeks each id
-- through its node, five times the cost of this whole step (docs/adr/0002).
-- Otherwise (another writer still holds older entries, or some ids were not pending: taken
-- over by a reclaim, or from before the stream was made again) only these ids are deleted.
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
