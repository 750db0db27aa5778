-- What says whether a server's keys may have changed since it was last asked: its run id
-- (another after a restart or a failover) and how many keys it holds (a flush, a key
-- deleted, expired or evicted, a sale loaded). The scheduler's check asks every master for
-- it each second and reads each sale's hash only when it changed.
return {string.match(redis.call('INFO', 'server'), 'run_id:(%x+)'), redis.call('DBSIZE')}
