-- Settles the failover window against a new database identity, once its changes are all
-- written into it: only if it is still settled against the identity the caller read
-- (another process may have settled it meanwhile), and only if no change was kept after
-- the last one the caller wrote (a process still committing under the old identity).
-- KEYS[1] the settled identity  KEYS[2] the window stream
-- ARGV[1] the identity read ('' none)  ARGV[2] the new identity  ARGV[3] the last id written ('0' none)
-- Returns {0} settled, {1} more changes to write first, {2, identity} settled by another.
local settled = redis.call('GET', KEYS[1]) or ''
if settled ~= ARGV[1] then
  return {2, settled}
end
local from = '-'
if ARGV[3] ~= '0' then
  from = '(' .. ARGV[3]
end
if #redis.call('XRANGE', KEYS[2], from, '+', 'COUNT', 1) > 0 then
  return {1}
end
redis.call('SET', KEYS[1], ARGV[2])
return {0}
