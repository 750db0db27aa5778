-- Moves a waiting room's cursor by the time since the last advance, at the sale's rate,
-- unless the room is closed; never past the last ticket. Every instance calls it: the
-- time is counted once, so the rate holds however many call.
-- KEYS[1] the line, KEYS[2] when each joined, KEYS[3] when each was let through,
-- KEYS[4] the room's state.
-- ARGV: now (ms), the opening (ms), admissions per second, closed ('' when open), when
-- the room's keys expire (ms).
-- Returns {admitted so far, tickets, when the ticket next in line joined or '', closed}.
local now, begins, rate = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[4], 'cursor', 'last')
local cursor = tonumber(state[1] or '0')
local from = math.max(tonumber(state[2] or '0'), begins)
local tickets = redis.call('ZCARD', KEYS[1])
if now > from then
  if ARGV[4] == '' then
    cursor = math.min(cursor + rate * (now - from) / 1000, tickets)
  end
  redis.call('HSET', KEYS[4], 'cursor', string.format('%.3f', cursor), 'last', ARGV[1])
end
redis.call('HSET', KEYS[4], 'closed', ARGV[4])
for i = 1, 4 do
  redis.call('PEXPIREAT', KEYS[i], ARGV[5])
end
local admitted = math.floor(cursor)
local head = redis.call('ZRANGE', KEYS[1], admitted, admitted)
local head_joined = ''
if head[1] then
  head_joined = redis.call('HGET', KEYS[2], head[1]) or ''
end
return {admitted, tickets, head_joined, ARGV[4]}
