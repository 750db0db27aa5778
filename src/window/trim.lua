-- Forgets the failover window's changes older than the window, by Redis' own clock (the
-- stream's ids are its milliseconds), only while the window is settled against the
-- identity the caller has just seen the database answer as: during a failover nothing ages
-- out.
-- KEYS[1] the settled identity  KEYS[2] the window stream
-- ARGV[1] the identity  ARGV[2] the window in ms
-- Returns how many were trimmed.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local now = redis.call('TIME')
local oldest = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) - tonumber(ARGV[2])
if oldest <= 0 then
  return 0
end
-- Approximate: whole stream nodes only, so it never trims more than asked, and cheaply.
return redis.call('XTRIM', KEYS[2], 'MINID', '~', oldest)
