-- A buyer's ticket in a sale's waiting room, joining the line first when ARGV[5] is '1'.
-- KEYS[1] the line (sorted set: buyer -> place), KEYS[2] when each joined (hash),
-- KEYS[3] when each was let through (hash), KEYS[4] the room's state (hash: cursor, last,
-- closed, seq).
-- ARGV: buyer, now (ms), the opening (ms), a lottery draw in [0, 2^52), join ('1'/'0').
-- Before the opening a joiner's place is its draw (the lottery: the order is unknown to
-- anyone until the opening and unrelated to who came first); after it, 2^52 + the count
-- of later joiners (first come, first served, behind the whole lottery).
-- Returns false for no ticket, else {rank, joined_at, admitted_at or '', admitted so far,
-- tickets, closed or ''}.
local user, now, begins = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if not redis.call('ZSCORE', KEYS[1], user) then
  if ARGV[5] ~= '1' then
    return false
  end
  local place
  if now < begins then
    place = ARGV[4]
  else
    -- As text: Lua would print the number with 14 digits, losing the order.
    place = string.format('%.0f', 4503599627370496 + redis.call('HINCRBY', KEYS[4], 'seq', 1))
  end
  redis.call('ZADD', KEYS[1], place, user)
  redis.call('HSET', KEYS[2], user, ARGV[2])
end
local rank = redis.call('ZRANK', KEYS[1], user)
local state = redis.call('HMGET', KEYS[4], 'cursor', 'closed')
local admitted = math.floor(tonumber(state[1] or '0'))
local admitted_at = redis.call('HGET', KEYS[3], user)
if not admitted_at and rank < admitted then
  admitted_at = ARGV[2]
  redis.call('HSET', KEYS[3], user, admitted_at)
end
return {rank, redis.call('HGET', KEYS[2], user) or '0', admitted_at or '', admitted,
  redis.call('ZCARD', KEYS[1]), state[2] or ''}
