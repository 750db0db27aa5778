-- The scheduler's check of many sale segments in one call: whether each is loaded, after
-- forgetting each one loaded into another Redis server than this one (a replica promoted by
-- a failover, or a restart that reloaded older data), as forget_stale.lua does for one.
-- The server's run id is read once for the whole call, and only if a segment is loaded:
-- reading it costs more than the rest of a segment's check.
-- KEYS sale hashes (any number, one server's: standalone or Sentinel, or one key in a
-- cluster)
-- Returns per key: 1 loaded here, 0 not loaded, -1 forgotten now, -2 not a hash (that key
-- alone fails: the others are still checked).
local this
local answers = {}
for i, key in ipairs(KEYS) do
  local loaded_on = redis.pcall('HGET', key, 'server')
  if type(loaded_on) == 'table' and loaded_on.err then
    answers[i] = -2
  elseif not loaded_on then
    answers[i] = redis.call('EXISTS', key)
  else
    this = this or string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
    if loaded_on == this then
      answers[i] = 1
    else
      redis.call('DEL', key)
      answers[i] = -1
    end
  end
end
return answers
