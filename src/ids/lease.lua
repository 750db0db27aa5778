-- Leases a worker id, and reads (or starts) the deployment's epoch: the marker that tells
-- every process whether this Redis has lost its data since they last looked.
-- KEYS[1] worker id key  KEYS[2] epoch key
-- ARGV[1] owner token  ARGV[2] lease ms  ARGV[3] a new epoch's random part
-- Returns {1 leased | 0 held by another, Redis' clock in ms, the epoch}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local epoch = redis.call('GET', KEYS[2])
if not epoch then
  -- '<created at ms>:<random>': its age decides whether an earlier holder may still issue.
  epoch = string.format('%d', now) .. ':' .. ARGV[3]
  redis.call('SET', KEYS[2], epoch)
end
local got = 0
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  got = 1
end
return {got, now, epoch}
