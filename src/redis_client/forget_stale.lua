-- Forgets a sale's gate if it was loaded into another Redis server than this one: a
-- replica promoted by a failover (it may lack the last orders and buyers), or a restart
-- that reloaded older data. The sale then answers not_loaded until it is rebuilt from
-- SQL + its stream, like a sale Redis lost. Each server forgets a sale at most once: the
-- rebuild records this server's run id.
-- KEYS[1] sale hash
-- Returns 1 forgotten, 0 current (or not loaded).
local loaded_on = redis.call('HGET', KEYS[1], 'server')
if not loaded_on then
  return 0
end
local this = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
if loaded_on == this then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
