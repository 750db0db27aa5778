//! The Redis gate: sale state in Redis hashes, decided by `purchase.lua` (check window,
//! limit and stock, decrement, record the buyer, XADD the order) in one EVALSHA. Every key
//! of a sale shares the hash tag `{sale_id}`, so a sale lives in one Redis Cluster slot.
//! Concurrent purchases are batched into one script call per sale (see `batch`).

use async_trait::async_trait;
use redis::Script;

use crate::redis_client::keyed::KeyedPipe;
use crate::redis_client::keys::{SaleKeys, WRITER_GROUP};
use crate::redis_client::{RedisClient, RedisConn};

use super::{
    Gate, GateError, GateStock, LoadStart, LoadTicket, MoveLeg, MoveStep, Purchase, RateLimit,
    Release, Released, SaleLoad, SegmentCheck, Spend, Verdict,
};

/// How long a sale's gate keys outlive its end, for late order lookups and stats.
const KEEP_AFTER_END_MS: i64 = 7 * 86_400_000;
/// Buyers or order ids per staging call of a load.
const STAGE_CHUNK: usize = 1000;
/// Staging chunks per round trip of a load.
const STAGE_PIPELINE: usize = 16;
/// Packed buckets of counted order ids to a staging command: at a million orders a bucket
/// holds about a hundred ids (2 KB), a command 200 KB.
const STAGE_COUNTED_FIELDS: usize = 100;
/// How long a staged key outlives its last chunk (a loader that died leaves it behind).
const STAGED_TTL_MS: u64 = 600_000;
/// A load lock's lease; its holder renews it every third of it while it works.
const LOAD_LEASE_MS: u64 = 10_000;
/// Segments per call of the scheduler's check (`check_loaded.lua`), and sales per pipeline
/// of the audit's reads: a call of a thousand takes Redis about a millisecond.
const SALES_PER_CALL: usize = 1000;
pub struct RedisGate {
    conn: RedisConn,
    prefix: String,
    /// Begins the owner token of every load lock this gate takes: a lock of its own found
    /// again (its answer lost to a failover, or its load given up) is taken over at once
    /// rather than waited out, since this process loads a sale one load at a time.
    loader: String,
    purchase: Script,
    load: Script,
    pause: Script,
    end_early: Script,
    release: Script,
    lock_load: Script,
    renew_lock: Script,
    unlock: Script,
    confirm: Script,
    forget_stale: Script,
    check_loaded: Script,
    server_mark: Script,
    /// Segments the check found loaded, and the servers' mark they were found under.
    settled: std::sync::Mutex<Settled>,
    take_move: Script,
    give_move: Script,
    /// Segments per sale, as SQL has them (told by `know_segments`, or read from Redis).
    segments: std::sync::RwLock<std::collections::HashMap<i64, i64>>,
    /// Per-user request rate, checked inside the purchase script (off by default).
    rate: RateLimit,
    /// How the purchase script writes an accepted order into the stream.
    entry: crate::config::EntryForm,
    /// Key names per (sale, segments, segment), built once: formatting them on every
    /// purchase showed in profiles.
    keys: std::sync::RwLock<std::collections::HashMap<(i64, i64, i64), std::sync::Arc<SaleKeys>>>,
    /// What an accepted batch waits for before its buyers hear `ok`.
    durable: Option<std::sync::Arc<super::batch::Durable>>,
    /// Script calls a batcher keeps out at once (see `batch::CALLS_IN_FLIGHT`).
    calls_in_flight: usize,
    /// Purchases go through one batcher, started with the first purchase (after the rate
    /// limit is set).
    batches: std::sync::OnceLock<super::batch::Batches>,
    /// In a cluster, one batcher per sale segment instead: calls stuck on a dead master must
    /// not hold the call slots that the sales on the other masters need.
    sale_batches: std::sync::RwLock<
        std::collections::HashMap<(i64, i64), std::sync::Arc<super::batch::Batches>>,
    >,
}

impl RedisGate {
    /// check_loaded.lua on every segment of `keys` (one server's) in one call: its answer
    /// for each that has keys.
    async fn check_together(
        &self,
        keys: &[Result<std::sync::Arc<SaleKeys>, GateError>],
    ) -> Result<Vec<Result<i64, GateError>>, GateError> {
        if !keys.iter().any(|k| k.is_ok()) {
            return Ok(Vec::new());
        }
        let mut call = self.check_loaded.prepare_invoke();
        for k in keys.iter().flatten() {
            call.key(&k.sale);
        }
        let answers: Vec<i64> = call.invoke_async(&mut self.conn.clone()).await?;
        Ok(answers.into_iter().map(Ok).collect())
    }

    /// check_loaded.lua's answer for each segment of `keys` in a cluster, where a script's
    /// keys must share a slot and a call per segment cost Redis 30 µs each: each hash's
    /// loading server and existence read in one pipeline per master, after that master's
    /// run id. Only a segment loaded by another server (or answered after a redirect) runs
    /// the script, which forgets it atomically.
    async fn check_each(
        &self,
        keys: &[Result<std::sync::Arc<SaleKeys>, GateError>],
    ) -> Result<Vec<Result<i64, GateError>>, GateError> {
        let mut conn = self.conn.clone();
        let mut pipe = KeyedPipe::new();
        let mut info = redis::cmd("INFO");
        info.arg("server");
        pipe.first_on_each_server(info);
        for k in keys.iter().flatten() {
            pipe.cmd("HGET", &k.sale).arg("server");
            pipe.cmd("EXISTS", &k.sale);
        }
        let answered = conn.query_keyed_with_first(pipe).await?;
        let run_ids: Vec<Option<String>> = answered
            .firsts
            .iter()
            .map(|info| info.as_ref().ok().and_then(run_id_of))
            .collect();
        let mut replies = answered.answers.into_iter();
        let mut answers = Vec::with_capacity(keys.len());
        for k in keys.iter().flatten() {
            let (Some((server, loaded_on)), Some((_, exists))) = (replies.next(), replies.next())
            else {
                answers.push(Err(GateError::BadReply("a check's reply was short".into())));
                continue;
            };
            let this = server.and_then(|s| run_ids.get(s).cloned().flatten());
            answers.push(match (loaded_on, exists) {
                (Err(e), _) if e.code() == Some("WRONGTYPE") => Ok(-2),
                (Err(e), _) | (_, Err(e)) => Err(e.into()),
                (Ok(redis::Value::Nil), Ok(exists)) => redis::from_redis_value::<i64>(exists)
                    .map_err(|e| GateError::from(redis::RedisError::from(e))),
                (Ok(loaded_on), Ok(_)) => {
                    let loaded_on = redis::from_redis_value::<String>(loaded_on).ok();
                    if this.is_some() && loaded_on == this {
                        Ok(1)
                    } else {
                        self.check_one(&mut conn, &k.sale).await
                    }
                }
            });
        }
        Ok(answers)
    }

    /// check_loaded.lua on one segment's hash.
    async fn check_one(&self, conn: &mut RedisConn, sale: &str) -> Result<i64, GateError> {
        let mut call = self.check_loaded.prepare_invoke();
        call.key(sale);
        let answers: Vec<i64> = call.invoke_async(conn).await?;
        only_check(&answers)
    }
}

/// How long segments found loaded are taken as loaded while every server's mark stays the
/// same, before the check reads every hash again: what a mark cannot see (a hash deleted
/// while another key was made, within one second) is found within this.
const SETTLED_FOR: std::time::Duration = std::time::Duration::from_secs(10);

/// The longest the check waits for every master's mark before it reads the hashes instead.
const SERVER_MARK_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);

/// Segments the scheduler's check found loaded (their hashes' names), and every master's
/// run id and key count when it did (see server_mark.lua).
#[derive(Default)]
struct Settled {
    mark: Vec<(String, i64)>,
    since: Option<std::time::Instant>,
    loaded: std::collections::HashSet<String>,
}

impl RedisGate {
    /// Every master's run id and key count, in one script call each; `None` when one
    /// cannot tell (then every hash is read).
    async fn servers_mark(&self) -> Option<Vec<(String, i64)>> {
        let mut conn = self.conn.clone();
        let mut call = redis::cmd("EVALSHA");
        call.arg(self.server_mark.get_hash()).arg(0);
        let asked = async {
            match conn.on_every_master(call.clone()).await {
                Err(e) if e.code() == Some("NOSCRIPT") => {
                    let mut load = redis::cmd("SCRIPT");
                    load.arg("LOAD").arg(include_str!("server_mark.lua"));
                    conn.on_every_master(load).await?;
                    conn.on_every_master(call).await
                }
                answers => answers,
            }
        };
        // A master that does not answer must not hold up the check of the others' sales
        // (whose circuits are closed): without a mark, the hashes are read.
        let answers = tokio::time::timeout(SERVER_MARK_TIMEOUT, asked)
            .await
            .ok()?;
        let mut mark = answers
            .ok()?
            .into_iter()
            .map(|a| redis::from_redis_value::<(String, i64)>(a).ok())
            .collect::<Option<Vec<_>>>()?;
        mark.sort();
        Some(mark)
    }

    /// The segments known loaded under `mark`; `None` when every hash must be read (the
    /// mark changed or is unknown, or the last full read is `SETTLED_FOR` old).
    fn settled_under(
        &self,
        mark: Option<&Vec<(String, i64)>>,
    ) -> Option<std::collections::HashSet<String>> {
        let settled = self.settled.lock().unwrap_or_else(|p| p.into_inner());
        let current = settled.since.is_some_and(|t| t.elapsed() < SETTLED_FOR);
        (current && mark == Some(&settled.mark)).then(|| settled.loaded.clone())
    }

    /// Keeps what a check found: the segments answered loaded join those known (`full`:
    /// all of them read, the others forgotten); any other answer leaves its segment to be
    /// read again.
    fn settle(
        &self,
        mark: Option<Vec<(String, i64)>>,
        full: bool,
        asked: &[Result<std::sync::Arc<SaleKeys>, GateError>],
        answers: &[Result<SegmentCheck, GateError>],
    ) {
        let mut settled = self.settled.lock().unwrap_or_else(|p| p.into_inner());
        let Some(mark) = mark else {
            *settled = Settled::default();
            return;
        };
        // Answers read under another mark than the one kept say nothing of it.
        if !full && settled.mark != mark {
            return;
        }
        if full {
            *settled = Settled {
                mark,
                since: Some(std::time::Instant::now()),
                loaded: Default::default(),
            };
        }
        for (k, answer) in asked.iter().zip(answers) {
            let Ok(k) = k else { continue };
            match answer {
                Ok(SegmentCheck::Loaded) => settled.loaded.insert(k.sale.clone()),
                _ => settled.loaded.remove(&k.sale),
            };
        }
    }

    /// check_loaded.lua's verdict on each of `keys`' segments, in calls of
    /// `SALES_PER_CALL`.
    async fn check_hashes(
        &self,
        keys: &[Result<std::sync::Arc<SaleKeys>, GateError>],
    ) -> Vec<Result<SegmentCheck, GateError>> {
        let mut checks = Vec::with_capacity(keys.len());
        for group in keys.chunks(SALES_PER_CALL) {
            let answers = match self.conn.is_cluster() {
                true => self.check_each(group).await,
                false => self.check_together(group).await,
            };
            let mut answers = answers.map(Vec::into_iter);
            for k in group {
                checks.push(match (k, &mut answers) {
                    (Err(e), _) => Err(e.for_another_waiter()),
                    (Ok(_), Err(e)) => Err(e.for_another_waiter()),
                    (Ok(k), Ok(answers)) => match answers.next() {
                        Some(Ok(answer)) => loaded_answer(&k.sale, answer),
                        Some(Err(e)) => Err(e),
                        None => Err(GateError::BadReply(
                            "check_loaded.lua answered short".into(),
                        )),
                    },
                });
            }
        }
        checks
    }
}

/// The run id an `INFO server` reply names.
fn run_id_of(info: &redis::Value) -> Option<String> {
    let mut texts = Vec::new();
    info_texts(info, &mut texts);
    texts.iter().find_map(|t| {
        t.lines()
            .find_map(|l| l.trim().strip_prefix("run_id:"))
            .map(str::to_string)
    })
}

/// The answer of a check_loaded.lua call for one key.
fn only_check(answers: &[i64]) -> Result<i64, GateError> {
    match answers {
        [answer] => Ok(*answer),
        other => Err(GateError::BadReply(format!(
            "check_loaded.lua answered {other:?} for one key"
        ))),
    }
}

/// What check_loaded.lua's answer for `sale` (a segment's hash) says.
fn loaded_answer(sale: &str, answer: i64) -> Result<SegmentCheck, GateError> {
    match answer {
        1 => Ok(SegmentCheck::Loaded),
        0 => Ok(SegmentCheck::Unloaded),
        -1 => Ok(SegmentCheck::Forgotten),
        -2 => Err(GateError::BadReply(format!("{sale} is not a sale's hash"))),
        other => Err(GateError::BadReply(format!(
            "check_loaded.lua answered {other}"
        ))),
    }
}

impl RedisGate {
    pub fn new(conn: RedisConn, prefix: &str) -> Self {
        RedisGate {
            conn,
            prefix: prefix.to_string(),
            loader: format!("{}:", crate::text::hex(&rand::random::<[u8; 8]>())),
            purchase: Script::new(include_str!("purchase.lua")),
            load: Script::new(concat!(
                include_str!("counted.lua"),
                include_str!("load_sale.lua")
            )),
            pause: Script::new(include_str!("set_paused.lua")),
            end_early: Script::new(include_str!("end_early.lua")),
            release: Script::new(concat!(
                include_str!("counted.lua"),
                include_str!("release.lua")
            )),
            lock_load: Script::new(include_str!("lock_load.lua")),
            renew_lock: Script::new(crate::redis_client::lease::RENEW_LUA),
            unlock: Script::new(crate::redis_client::lease::UNLOCK_LUA),
            confirm: Script::new(concat!(
                include_str!("counted.lua"),
                include_str!("confirm_written.lua")
            )),
            forget_stale: Script::new(crate::redis_client::lease::FORGET_STALE_LUA),
            check_loaded: Script::new(include_str!("check_loaded.lua")),
            server_mark: Script::new(include_str!("server_mark.lua")),
            settled: Default::default(),
            take_move: Script::new(include_str!("take_move.lua")),
            give_move: Script::new(include_str!("give_move.lua")),
            segments: Default::default(),
            rate: RateLimit {
                per_sec: 0.0,
                burst: 1,
            },
            entry: Default::default(),
            keys: Default::default(),
            batches: std::sync::OnceLock::new(),
            sale_batches: Default::default(),
            durable: None,
            calls_in_flight: super::batch::CALLS_IN_FLIGHT,
        }
    }

    /// Makes every `ok` wait for `level` (see `Durability`), on connections of its own.
    /// Refuses a Redis that cannot give it: WAITAOF without an AOF. Warns when there is
    /// no replica yet (every purchase is answered `pending` until one is connected).
    pub async fn with_durability(
        mut self,
        client: &RedisClient,
        level: crate::config::Durability,
    ) -> Result<Self, GateError> {
        use crate::config::Durability;
        if level == Durability::None {
            return Ok(self);
        }
        // Every reply waits for a sync or a replica here, by WAIT or WAITAOF, or by Redis
        // itself (an older Redis with `appendfsync always`, below): more calls out at once
        // share each wait.
        self.calls_in_flight = super::batch::MAX_CALLS_IN_FLIGHT;
        let mut pool = Vec::new();
        // On a cluster every sale has its own batcher (and call slots): more connections,
        // so that a WAIT seldom falls back to the shared connection, where it would hold
        // up everyone's commands to that master while it waits.
        let connections = if client.is_cluster() {
            4 * super::batch::DURABLE_CONNECTIONS
        } else {
            super::batch::DURABLE_CONNECTIONS
        };
        for _ in 0..connections {
            pool.push(client.connect().await?);
        }
        let mut conn = pool[0].clone();
        match level {
            Durability::Aof => {
                let probe: Result<(i64, i64), redis::RedisError> = redis::cmd("WAITAOF")
                    .arg(1)
                    .arg(0)
                    .arg(100)
                    .query_async(&mut conn)
                    .await;
                match probe {
                    Ok(_) => {}
                    // Before Redis 7.2 there is no WAITAOF; `appendfsync always` gives the
                    // same (Redis fsyncs before it replies), so nothing is left to wait for.
                    Err(e) if e.to_string().to_lowercase().contains("unknown command") => {
                        if fsyncs_every_write(&mut conn).await? {
                            tracing::info!("--redis-durability aof: Redis has no WAITAOF (before 7.2) and fsyncs every write (appendfsync always); no wait needed");
                            return Ok(self);
                        }
                        return Err(GateError::Misconfigured(
                            "--redis-durability aof needs Redis 7.2 or later with appendonly yes, \
                             or an older Redis with appendonly yes and appendfsync always"
                                .into(),
                        ));
                    }
                    Err(e) => {
                        return Err(GateError::Misconfigured(format!(
                            "--redis-durability aof needs appendonly yes in Redis: {e}"
                        )))
                    }
                }
            }
            Durability::Replica => {
                // On a cluster WAIT goes to every master and the least count comes back;
                // replicas still attaching after a start or a failover get a few seconds.
                let mut replicas: i64 = 0;
                for _ in 0..10 {
                    replicas = redis::cmd("WAIT")
                        .arg(1)
                        .arg(100)
                        .query_async(&mut conn)
                        .await?;
                    if replicas >= 1 || !client.is_cluster() {
                        break;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                }
                if replicas < 1 {
                    tracing::error!(
                        "--redis-durability replica, but no replica acknowledges writes: every purchase is answered pending until one does"
                    );
                }
            }
            Durability::None => {}
        }
        self.durable = Some(std::sync::Arc::new(super::batch::Durable {
            level,
            pool: std::sync::Mutex::new(pool),
        }));
        Ok(self)
    }

    /// Throttles each user's purchases of a sale, across every instance.
    pub fn with_rate_limit(mut self, rate: RateLimit) -> Self {
        self.rate = rate;
        self
    }

    /// Writes accepted orders into the stream in this form (see `EntryForm`).
    pub fn with_entry_form(mut self, entry: crate::config::EntryForm) -> Self {
        self.entry = entry;
        self
    }

    /// Loads the scripts into Redis once at start-up; calls then go by EVALSHA, and a
    /// NOSCRIPT (after a Redis restart) reloads transparently.
    pub async fn prepare(&self) -> Result<(), GateError> {
        let mut conn = self.conn.clone();
        refuse_eviction(&mut conn).await?;
        for script in [
            &self.purchase,
            &self.load,
            &self.pause,
            &self.end_early,
            &self.release,
            &self.lock_load,
            &self.renew_lock,
            &self.unlock,
            &self.confirm,
            &self.forget_stale,
            &self.check_loaded,
            &self.server_mark,
            &self.take_move,
            &self.give_move,
        ] {
            script.prepare_invoke().load_async(&mut conn).await?;
        }
        Ok(())
    }

    fn start_batches(&self) -> super::batch::Batches {
        super::batch::start(
            self.conn.clone(),
            self.purchase.clone(),
            self.prefix.clone(),
            self.rate,
            self.entry,
            self.durable.clone(),
            self.calls_in_flight,
        )
    }

    fn sale_batches(&self, sale_id: i64, segment: i64) -> std::sync::Arc<super::batch::Batches> {
        if let Some(b) = self
            .sale_batches
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&(sale_id, segment))
        {
            return b.clone();
        }
        self.sale_batches
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .entry((sale_id, segment))
            .or_insert_with(|| std::sync::Arc::new(self.start_batches()))
            .clone()
    }

    /// The keys of one segment of a sale of `segments` parts.
    /// The keys and arguments take_move.lua and give_move.lua share: the segment's hash
    /// and its moves, the move and its units.
    fn move_leg_args<'a, 's>(
        &self,
        invocation: &'a mut redis::ScriptInvocation<'s>,
        leg: MoveLeg,
    ) -> &'a mut redis::ScriptInvocation<'s> {
        let k = self.segment_keys(leg.sale_id, leg.segments, leg.segment);
        invocation
            .key(&k.sale)
            .key(&k.moves)
            .arg(leg.move_id)
            .arg(leg.quantity)
    }

    fn segment_keys(&self, sale_id: i64, segments: i64, segment: i64) -> std::sync::Arc<SaleKeys> {
        let id = (sale_id, segments.max(1), segment);
        if let Some(k) = self.keys.read().unwrap_or_else(|p| p.into_inner()).get(&id) {
            return k.clone();
        }
        let k = std::sync::Arc::new(SaleKeys::for_segment(&self.prefix, id.0, id.1, id.2));
        self.keys
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, k.clone());
        k
    }

    /// The keys of every segment of a sale (one for an unsegmented sale).
    async fn all_keys(&self, sale_id: i64) -> Result<Vec<std::sync::Arc<SaleKeys>>, GateError> {
        let n = self.segments_of(sale_id).await?;
        Ok((0..n).map(|s| self.segment_keys(sale_id, n, s)).collect())
    }

    /// How many segments a sale has: told by the scheduler from SQL, else read from the
    /// key each load writes; 1 when neither knows (an unsegmented sale, or one not loaded).
    async fn segments_of(&self, sale_id: i64) -> Result<i64, GateError> {
        if let Some(n) = self
            .segments
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&sale_id)
        {
            return Ok(*n);
        }
        let mut conn = self.conn.clone();
        let stored: Option<i64> = redis::cmd("GET")
            .arg(&SaleKeys::new(&self.prefix, sale_id).segments)
            .query_async(&mut conn)
            .await?;
        match stored {
            Some(n) if n >= 1 => {
                self.remember_segments(sale_id, n);
                Ok(n)
            }
            _ => Ok(1),
        }
    }

    fn remember_segments(&self, sale_id: i64, segments: i64) {
        let known = self
            .segments
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&sale_id)
            == Some(&segments);
        if !known {
            self.segments
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .insert(sale_id, segments);
        }
    }

    /// The keys of the segment that holds this buyer.
    async fn buyer_keys(
        &self,
        sale_id: i64,
        user_id: i64,
    ) -> Result<std::sync::Arc<SaleKeys>, GateError> {
        let n = self.segments_of(sale_id).await?;
        Ok(self.segment_keys(sale_id, n, crate::model::segments::segment_of(user_id, n)))
    }
}

impl RedisGate {
    /// Stages the load in the loader's own keys, then makes it live in one script fenced
    /// by the ticket's lock.
    async fn install(&self, ticket: &LoadTicket, load: &SaleLoad) -> Result<bool, GateError> {
        let segments = load.sale.segments.max(1);
        let k = self.segment_keys(load.sale.id, segments, load.segment);
        let mut conn = self.conn.clone();
        if segments > 1 {
            // Before the segment opens: whoever names the sale without a buyer finds all
            // of its segments.
            let _: () = redis::cmd("SET")
                .arg(&k.segments)
                .arg(segments)
                .arg("PXAT")
                .arg(load.sale.ends_at.saturating_add(KEEP_AFTER_END_MS))
                .query_async(&mut conn)
                .await?;
        }
        let staged_buyers = k.staged(&ticket.owner, "buyers");
        let staged_counted = k.staged(&ticket.owner, "counted");
        let staged_released = k.staged(&ticket.owner, "released");
        // Staged while SQL was read (`stage_buyers`, the buyers of several orders set to
        // their totals last), or now.
        let buyers: &[(i64, i64)] = if ticket.buyers_staged() {
            &[]
        } else {
            &load.buyers
        };
        let mut chunks = Vec::new();
        for chunk in buyers.chunks(STAGE_CHUNK) {
            chunks.push((hset_pairs(&staged_buyers, chunk), &staged_buyers));
        }
        for fields in pack_counted(&load.counted).chunks(STAGE_COUNTED_FIELDS) {
            let mut cmd = redis::cmd("HSET");
            cmd.arg(&staged_counted);
            for (bucket, packed) in fields {
                cmd.arg(bucket).arg(packed);
            }
            chunks.push((cmd, &staged_counted));
        }
        for chunk in load.released.chunks(STAGE_CHUNK) {
            let mut cmd = redis::cmd("SADD");
            cmd.arg(&staged_released).arg(chunk);
            chunks.push((cmd, &staged_released));
        }
        // A lock that passed on is refused by the load script below.
        stage(&mut conn, &k.lock, &ticket.owner, chunks).await?;
        let s = &load.sale;
        let mut call = self.load.key(&k.sale);
        call.key(&k.buyers)
            .key(&k.stream)
            .key(&k.accepted)
            .key(&staged_buyers)
            .key(&k.released)
            .key(&k.rate)
            .key(&k.lock)
            .key(&staged_counted)
            .key(&k.counted)
            .key(&k.confirms)
            .key(&k.moves)
            .key(&staged_released)
            .key(&k.counted_set)
            .arg(&ticket.owner)
            .arg(load.remaining)
            .arg(s.per_user_limit)
            .arg(s.begins_at)
            .arg(s.ends_at)
            .arg(if s.paused { "1" } else { "0" })
            .arg(s.price_cents)
            .arg(s.ends_at.saturating_add(KEEP_AFTER_END_MS))
            .arg(WRITER_GROUP)
            .arg(ticket.fence)
            .arg(load.moves.len());
        for (id, mark) in &load.moves {
            call.arg(*id).arg(mark.as_str());
        }
        // The script checks that every buyer reached the staged hash.
        call.arg(distinct_buyers(&load.buyers));
        match call.invoke_async::<i64>(&mut conn).await? {
            1 => Ok(true),
            0 => Ok(false),
            _ => Err(GateError::Unavailable(format!(
                "the load lock of sale {} passed to another loader before this load finished",
                load.sale.id
            ))),
        }
    }
}

/// A segment's figures as the stock read answers them: (stock, paused) of its hash, its
/// buyers, its accepted orders.
type SegmentFigures = ((Option<i64>, Option<String>), i64, i64);

/// Adds the reads of a segment's figures to `pipe`: three replies.
fn segment_figures(pipe: &mut KeyedPipe, k: &SaleKeys) {
    pipe.cmd("HMGET", &k.sale).arg("stock").arg("paused");
    pipe.cmd("HLEN", &k.buyers);
    pipe.cmd("HLEN", &k.accepted);
}

/// The one sale's answer of a call for many (`stocks`, `are_loaded`).
fn only_answer<T>(mut answers: Vec<Result<T, GateError>>) -> Result<T, GateError> {
    answers
        .pop()
        .unwrap_or_else(|| Err(GateError::BadReply("no answer for the sale".into())))
}

/// Adds a segment's figures to its sale's; a segment not in the gate adds nothing.
fn add_segment(total: &mut Option<GateStock>, ((stock, paused), buyers, accepted): SegmentFigures) {
    let Some(remaining) = stock else { return };
    let t = total.get_or_insert(GateStock::default());
    t.remaining += remaining;
    t.paused |= paused.as_deref() == Some("1");
    t.buyers += buyers;
    t.accepted += accepted;
}

/// A sale's stock from the next `segments` segments' replies of a pipeline of
/// `segment_figures`. Every one of the sale's replies is taken,
/// whatever they hold, so that the next sale reads its own.
fn sum_segments(
    segments: usize,
    replies: &mut impl Iterator<Item = redis::RedisResult<redis::Value>>,
) -> Result<Option<GateStock>, GateError> {
    let taken: Vec<_> = replies.take(3 * segments).collect();
    if taken.len() < 3 * segments {
        return Err(GateError::BadReply("a stock read's reply was short".into()));
    }
    let mut total = None;
    let mut taken = taken.into_iter();
    while let (Some(fields), Some(buyers), Some(accepted)) =
        (taken.next(), taken.next(), taken.next())
    {
        let figures = (
            redis::from_redis_value(fields?).map_err(redis::RedisError::from)?,
            redis::from_redis_value(buyers?).map_err(redis::RedisError::from)?,
            redis::from_redis_value(accepted?).map_err(redis::RedisError::from)?,
        );
        add_segment(&mut total, figures);
    }
    Ok(total)
}

/// How many buyers `buyers` names (a snapshot's are sorted and distinct already).
fn distinct_buyers(buyers: &[(i64, i64)]) -> usize {
    if buyers.windows(2).all(|w| w[0].0 < w[1].0) {
        return buyers.len();
    }
    let users: std::collections::HashSet<i64> = buyers.iter().map(|(user, _)| *user).collect();
    users.len()
}

/// HSET of (user, units) pairs into `key`.
fn hset_pairs(key: &str, pairs: &[(i64, i64)]) -> redis::Cmd {
    let mut cmd = redis::cmd("HSET");
    cmd.arg(key);
    for (user, units) in pairs {
        cmd.arg(*user).arg(*units);
    }
    cmd
}

/// Order ids packed as counted.lua keeps them: (an id's last four digits, ",id,id,...,").
fn pack_counted(ids: &[i64]) -> Vec<(String, String)> {
    let mut buckets: std::collections::HashMap<String, String> = Default::default();
    for id in ids {
        let id = id.to_string();
        let bucket = &id[id.len().saturating_sub(4)..];
        let packed = buckets
            .entry(bucket.to_string())
            .or_insert_with(|| ",".to_string());
        packed.push_str(&id);
        packed.push(',');
    }
    buckets.into_iter().collect()
}

/// Sends a load's staging commands (each a chunk of one staged key), `STAGE_PIPELINE` to a
/// round trip: a million buyers and order ids are two thousand chunks, whose round trips
/// one at a time cost as much as Redis' own work. Plain commands, no script
/// (a script's arguments cost Redis a third more): a staged key is its loader's own, so a
/// loader that lost its lock writes where nobody reads. Each round trip reads the lock
/// too and stops once it has passed to another loader (load_sale.lua then refuses this
/// one); each chunk renews its key's expiry, so that nothing left behind lasts. False
/// when it stopped so.
async fn stage(
    conn: &mut RedisConn,
    lock: &str,
    owner: &str,
    chunks: Vec<(redis::Cmd, &String)>,
) -> Result<bool, GateError> {
    let mut chunks = chunks.into_iter().peekable();
    while chunks.peek().is_some() {
        let mut pipe = redis::pipe();
        for (cmd, key) in chunks.by_ref().take(STAGE_PIPELINE) {
            pipe.add_command(cmd).ignore();
            pipe.cmd("PEXPIRE").arg(key).arg(STAGED_TTL_MS).ignore();
        }
        pipe.cmd("GET").arg(lock);
        let (holder,): (Option<String>,) = pipe.query_async(conn).await?;
        if holder.as_deref() != Some(owner) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Refuses a Redis that may evict keys when it runs short of memory (any `maxmemory-policy`
/// but `noeviction`). A sale's stock, its buyers, its accepted orders and its load's
/// staging live in Redis alone while it is open: a buyers hash evicted mid-sale lets every
/// buyer in it buy again (an `ok` that SQL's per-user guard then refuses, an acknowledged
/// order lost), and even the `volatile-*` policies evict the keys that carry an expiry (spent
/// purchase tokens, the confirms recorded during a load). Under `noeviction` a full Redis
/// refuses writes instead, which the gate answers as `unavailable`. Checked at start-up on
/// the master (on a cluster, every master); a replica promoted later is not. A Redis that
/// answers INFO with an error (renamed or not permitted on some managed services) is let
/// through with a warning; one that cannot be reached fails the start-up step, which is
/// tried again.
async fn refuse_eviction(conn: &mut RedisConn) -> Result<(), GateError> {
    let info: redis::Value = match redis::cmd("INFO").arg("memory").query_async(conn).await {
        Ok(info) => info,
        Err(e) if matches!(e.kind(), redis::ErrorKind::Server(_)) => {
            tracing::warn!(error = %e, "cannot read Redis' maxmemory-policy (INFO memory); it must be noeviction");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    let mut texts = Vec::new();
    info_texts(&info, &mut texts);
    let policies: Vec<&str> = texts.iter().filter_map(|t| eviction_policy(t)).collect();
    if policies.is_empty() {
        tracing::warn!("Redis' INFO memory names no maxmemory-policy; it must be noeviction");
    }
    match policies.into_iter().find(|p| *p != "noeviction") {
        Some(policy) => Err(GateError::Misconfigured(format!(
            "Redis' maxmemory-policy is {policy}: under memory pressure it would evict a sale's \
             stock, buyers or accepted orders mid-sale and let buyers past their limit; \
             set it to noeviction (CONFIG SET maxmemory-policy noeviction, and in redis.conf)"
        ))),
        None => Ok(()),
    }
}

/// The text of an INFO reply: one string, or one per node (a cluster's).
fn info_texts(v: &redis::Value, out: &mut Vec<String>) {
    match v {
        redis::Value::BulkString(b) => out.push(String::from_utf8_lossy(b).into_owned()),
        redis::Value::SimpleString(s) => out.push(s.clone()),
        redis::Value::VerbatimString { text, .. } => out.push(text.clone()),
        redis::Value::Array(items) | redis::Value::Set(items) => {
            items.iter().for_each(|i| info_texts(i, out))
        }
        redis::Value::Map(pairs) => pairs.iter().for_each(|(_, i)| info_texts(i, out)),
        _ => {}
    }
}

/// `maxmemory_policy` of an INFO text.
fn eviction_policy(info: &str) -> Option<&str> {
    info.lines()
        .find_map(|l| l.trim().strip_prefix("maxmemory_policy:"))
}

/// Whether Redis fsyncs its AOF before replying to every write.
async fn fsyncs_every_write(conn: &mut RedisConn) -> Result<bool, GateError> {
    let get = |name: &'static str| {
        let mut conn = conn.clone();
        async move {
            let pair: Vec<String> = redis::cmd("CONFIG")
                .arg("GET")
                .arg(name)
                .query_async(&mut conn)
                .await?;
            Ok::<_, GateError>(pair.get(1).cloned().unwrap_or_default())
        }
    };
    Ok(get("appendonly").await? == "yes" && get("appendfsync").await? == "always")
}

/// Renews a load lock every third of its lease until the ticket is dropped (which aborts
/// this task) or the lock is lost.
async fn keep_lock(mut conn: RedisConn, renew: Script, lock: String, owner: String, sale_id: i64) {
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(LOAD_LEASE_MS / 3)).await;
        match renew
            .key(&lock)
            .arg(&owner)
            .arg(LOAD_LEASE_MS)
            .invoke_async::<i64>(&mut conn)
            .await
        {
            Ok(1) => {}
            Ok(_) => {
                tracing::warn!(sale = sale_id, "load lock lost while loading");
                return;
            }
            Err(e) => tracing::warn!(sale = sale_id, error = %e, "could not renew a load lock"),
        }
    }
}

#[async_trait]
impl Gate for RedisGate {
    async fn purchase(&self, p: Purchase) -> Result<Verdict, GateError> {
        if self.conn.is_cluster() {
            return self.sale_batches(p.sale_id, p.segment()).decide(p).await;
        }
        let batches = self.batches.get_or_init(|| self.start_batches());
        batches.decide(p).await
    }

    async fn load(&self, load: &SaleLoad) -> Result<bool, GateError> {
        self.remember_segments(load.sale.id, load.sale.segments.max(1));
        match self.begin_segment_load(load.sale.id, load.segment).await? {
            LoadStart::Ticket(ticket) => self.finish_load(ticket, load).await,
            LoadStart::Loaded | LoadStart::Busy => Ok(false),
        }
    }

    async fn begin_load(&self, sale_id: i64) -> Result<LoadStart, GateError> {
        self.begin_segment_load(sale_id, 0).await
    }

    async fn begin_segment_load(&self, sale_id: i64, segment: i64) -> Result<LoadStart, GateError> {
        let n = self.segments_of(sale_id).await?;
        let k = self.segment_keys(sale_id, n, segment);
        let mut conn = self.conn.clone();
        let owner = format!(
            "{}{}",
            self.loader,
            crate::text::hex(&rand::random::<[u8; 8]>())
        );
        let fence: i64 = self
            .lock_load
            .key(&k.sale)
            .key(&k.lock)
            .key(&k.fence)
            .key(&k.confirms)
            .arg(&owner)
            .arg(LOAD_LEASE_MS)
            .arg(&self.loader)
            .invoke_async(&mut conn)
            .await?;
        Ok(match fence {
            0 => LoadStart::Loaded,
            f if f < 0 => LoadStart::Busy,
            fence => {
                let renewal = tokio::spawn(keep_lock(
                    conn,
                    self.renew_lock.clone(),
                    k.lock.clone(),
                    owner.clone(),
                    sale_id,
                ));
                LoadStart::Ticket(
                    LoadTicket::locked(sale_id, segment, fence, owner)
                        .with_renewal(renewal.abort_handle()),
                )
            }
        })
    }

    async fn finish_load(&self, ticket: LoadTicket, load: &SaleLoad) -> Result<bool, GateError> {
        self.remember_segments(load.sale.id, load.sale.segments.max(1));
        let result = self.install(&ticket, load).await;
        if result.is_err() {
            self.abandon_load(ticket).await;
        }
        result
    }

    async fn stage_buyers(
        &self,
        ticket: &LoadTicket,
        segments: i64,
        buyers: &[(i64, i64)],
    ) -> Result<bool, GateError> {
        let k = self.segment_keys(ticket.sale_id, segments.max(1), ticket.segment);
        let staged = k.staged(&ticket.owner, "buyers");
        let chunks = buyers
            .chunks(STAGE_CHUNK)
            .map(|chunk| (hset_pairs(&staged, chunk), &staged))
            .collect();
        if !stage(&mut self.conn.clone(), &k.lock, &ticket.owner, chunks).await? {
            return Err(GateError::Unavailable(format!(
                "the load lock of sale {} passed to another loader while it staged buyers",
                ticket.sale_id
            )));
        }
        ticket.mark_buyers_staged();
        Ok(true)
    }

    async fn abandon_load(&self, ticket: LoadTicket) {
        ticket.renewal_stopped();
        let n = match self.segments_of(ticket.sale_id).await {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(sale = ticket.sale_id, error = %e, "could not free a load lock; it lapses by itself");
                return;
            }
        };
        let k = self.segment_keys(ticket.sale_id, n, ticket.segment);
        let mut conn = self.conn.clone();
        let freed: Result<i64, _> = self
            .unlock
            .key(&k.lock)
            .arg(&ticket.owner)
            .invoke_async(&mut conn)
            .await;
        if let Err(e) = freed {
            tracing::warn!(sale = ticket.sale_id, error = %e, "could not free a load lock; it lapses by itself");
        }
    }

    async fn forget_if_stale(&self, sale_id: i64) -> Result<bool, GateError> {
        self.forget_segment_if_stale(sale_id, 0).await
    }

    async fn holders(
        &self,
        sale_id: i64,
        cap: usize,
    ) -> Result<Option<Vec<(i64, i64)>>, GateError> {
        let n = self.segments_of(sale_id).await?;
        let mut conn = self.conn.clone();
        let mut all = Vec::new();
        for segment in 0..n {
            let k = self.segment_keys(sale_id, n, segment);
            let (loaded, count): (i64, usize) = redis::pipe()
                .cmd("EXISTS")
                .arg(&k.sale)
                .cmd("HLEN")
                .arg(&k.buyers)
                .query_async(&mut conn)
                .await?;
            if loaded == 0 || all.len() + count > cap {
                return Ok(None);
            }
            let held: Vec<(i64, i64)> = redis::cmd("HGETALL")
                .arg(&k.buyers)
                .query_async(&mut conn)
                .await?;
            all.extend(held);
        }
        Ok(Some(all))
    }

    async fn forget_segment_for_repair(&self, sale_id: i64, segment: i64) -> Result<(), GateError> {
        // The sale's hash alone, as when a failover leaves it stale: the load stages and
        // replaces the buyers and counts the stream's unwritten orders; the stream stays.
        let n = self.segments_of(sale_id).await?;
        let mut conn = self.conn.clone();
        let _: i64 = redis::cmd("DEL")
            .arg(&self.segment_keys(sale_id, n, segment).sale)
            .query_async(&mut conn)
            .await?;
        Ok(())
    }

    async fn forget_segment_if_stale(&self, sale_id: i64, segment: i64) -> Result<bool, GateError> {
        let n = self.segments_of(sale_id).await?;
        let mut conn = self.conn.clone();
        let forgotten: i64 = self
            .forget_stale
            .key(&self.segment_keys(sale_id, n, segment).sale)
            .invoke_async(&mut conn)
            .await?;
        Ok(forgotten == 1)
    }

    async fn check_segments(&self, parts: &[(i64, i64)]) -> Vec<Result<SegmentCheck, GateError>> {
        // Read before the hashes: a change after it shows in the next mark.
        let mark = self.servers_mark().await;
        let mut keys = Vec::with_capacity(parts.len());
        for (sale_id, segment) in parts {
            keys.push(
                self.segments_of(*sale_id)
                    .await
                    .map(|n| self.segment_keys(*sale_id, n, *segment)),
            );
        }
        let settled = self.settled_under(mark.as_ref());
        let known: Vec<bool> = keys
            .iter()
            .map(|k| match (k, &settled) {
                (Ok(k), Some(settled)) => settled.contains(&k.sale),
                _ => false,
            })
            .collect();
        let asked: Vec<_> = keys
            .into_iter()
            .zip(&known)
            .filter(|(_, known)| !**known)
            .map(|(k, _)| k)
            .collect();
        let answers = self.check_hashes(&asked).await;
        self.settle(mark, settled.is_none(), &asked, &answers);
        let mut answers = answers.into_iter();
        known
            .into_iter()
            .map(|known| match known {
                true => Ok(SegmentCheck::Loaded),
                false => answers.next().unwrap_or_else(|| {
                    Err(GateError::BadReply("a check's answer is missing".into()))
                }),
            })
            .collect()
    }

    fn know_segments(&self, sales: &[(i64, i64)]) {
        for (sale_id, segments) in sales {
            self.remember_segments(*sale_id, (*segments).max(1));
        }
    }

    async fn confirm_written(&self, orders: &[crate::model::NewOrder]) -> Result<(), GateError> {
        let mut by_segment: std::collections::BTreeMap<(i64, i64), Vec<&crate::model::NewOrder>> =
            Default::default();
        for o in orders {
            let n = self.segments_of(o.sale_id).await?;
            by_segment
                .entry((o.sale_id, crate::model::segments::segment_of(o.user_id, n)))
                .or_default()
                .push(o);
        }
        let mut conn = self.conn.clone();
        for ((sale_id, segment), orders) in by_segment {
            let n = self.segments_of(sale_id).await?;
            let k = self.segment_keys(sale_id, n, segment);
            for chunk in orders.chunks(STAGE_CHUNK) {
                let mut call = self.confirm.key(&k.sale);
                call.key(&k.buyers)
                    .key(&k.accepted)
                    .key(&k.counted)
                    .key(&k.released)
                    .key(&k.lock)
                    .key(&k.confirms)
                    .key(&k.counted_set);
                for o in chunk {
                    call.arg(o.id).arg(o.user_id).arg(o.quantity);
                }
                let applied: i64 = call.invoke_async(&mut conn).await?;
                if applied > 0 {
                    tracing::warn!(
                        sale = sale_id,
                        segment,
                        applied,
                        "orders written after the gate's rebuild read SQL were added to it"
                    );
                }
            }
        }
        Ok(())
    }

    async fn release(&self, r: Release) -> Result<Released, GateError> {
        let k = self.buyer_keys(r.sale_id, r.user_id).await?;
        let mut conn = self.conn.clone();
        let done: i64 = self
            .release
            .key(&k.sale)
            .key(&k.buyers)
            .key(&k.released)
            .key(&k.lock)
            .key(&k.accepted)
            .key(&k.counted)
            .key(&k.counted_set)
            .key(&k.rate)
            .arg(r.order_id)
            .arg(r.user_id)
            .arg(r.quantity)
            .arg(crate::redis_client::keys::stock_channel(&self.prefix))
            .arg(r.sale_id)
            .arg(self.rate.interval_ms())
            .invoke_async(&mut conn)
            .await?;
        Ok(match done {
            1 => Released::Now,
            // 2: an order the gate never counted; nothing to give back, as for one given
            // back before.
            0 | 2 => Released::Before,
            -3 => Released::Deferred,
            _ => Released::NotLoaded,
        })
    }

    async fn spend(&self, sale_id: i64, spend: Spend) -> Result<bool, GateError> {
        let mut conn = self.conn.clone();
        let set: Option<String> = redis::cmd("SET")
            .arg(SaleKeys::new(&self.prefix, sale_id).spent(spend.nonce))
            .arg("1")
            .arg("NX")
            .arg("PX")
            .arg(spend.keep_ms(crate::clock::wall_ms()))
            .query_async(&mut conn)
            .await?;
        Ok(set.is_some())
    }

    async fn is_loaded(&self, sale_id: i64) -> Result<bool, GateError> {
        only_answer(self.are_loaded(&[sale_id]).await)
    }

    async fn are_loaded(&self, sale_ids: &[i64]) -> Vec<Result<bool, GateError>> {
        let mut answers = Vec::with_capacity(sale_ids.len());
        let mut conn = self.conn.clone();
        for group in sale_ids.chunks(SALES_PER_CALL) {
            let mut keys = Vec::with_capacity(group.len());
            for sale_id in group {
                keys.push(self.all_keys(*sale_id).await);
            }
            let mut pipe = KeyedPipe::new();
            for k in keys.iter().flatten().flatten() {
                pipe.cmd("EXISTS", &k.sale);
            }
            // Each segment's answer on its own: a master away fails its own sales only.
            let mut replies = match conn.query_keyed(pipe).await {
                Ok(replies) => replies.into_iter(),
                Err(e) => {
                    answers.extend(group.iter().map(|_| Err(GateError::from(e.clone()))));
                    continue;
                }
            };
            for sale_keys in keys {
                answers.push(sale_keys.and_then(|segments| {
                    let mut loaded = Ok(true);
                    // Every segment's reply is taken, so that the next sale reads its own.
                    for _ in &segments {
                        let exists = replies
                            .next()
                            .ok_or_else(|| GateError::BadReply("a check's reply was short".into()))
                            .and_then(|r| {
                                redis::from_redis_value::<i64>(r?)
                                    .map_err(|e| GateError::from(redis::RedisError::from(e)))
                            });
                        loaded = loaded.and_then(|all| exists.map(|n| all && n > 0));
                    }
                    loaded
                }));
            }
        }
        answers
    }

    async fn stock(&self, sale_id: i64) -> Result<Option<GateStock>, GateError> {
        // A segmented sale's figures are the sum of its segments' (each on its own master).
        only_answer(self.stocks(&[sale_id]).await)
    }

    async fn stocks(&self, sale_ids: &[i64]) -> Vec<Result<Option<GateStock>, GateError>> {
        let mut stocks = Vec::with_capacity(sale_ids.len());
        let mut conn = self.conn.clone();
        for group in sale_ids.chunks(SALES_PER_CALL) {
            let mut keys = Vec::with_capacity(group.len());
            let mut pipe = KeyedPipe::new();
            for sale_id in group {
                let sale_keys = self.all_keys(*sale_id).await;
                for k in sale_keys.iter().flatten() {
                    segment_figures(&mut pipe, k);
                }
                keys.push(sale_keys);
            }
            let replies = conn.query_keyed(pipe).await.map_err(GateError::from);
            let mut replies = replies.map(Vec::into_iter);
            for sale_keys in &keys {
                stocks.push(match (sale_keys, &mut replies) {
                    (Err(e), _) => Err(e.for_another_waiter()),
                    (Ok(_), Err(e)) => Err(e.for_another_waiter()),
                    (Ok(segments), Ok(replies)) => sum_segments(segments.len(), replies),
                });
            }
        }
        stocks
    }

    async fn end_early(&self, sale_id: i64, at: i64) -> Result<(), GateError> {
        let mut conn = self.conn.clone();
        for k in self.all_keys(sale_id).await? {
            let _: i64 = self
                .end_early
                .key(&k.sale)
                .arg(at)
                .invoke_async(&mut conn)
                .await?;
        }
        Ok(())
    }

    async fn set_paused(&self, sale_id: i64, paused: bool) -> Result<(), GateError> {
        let mut conn = self.conn.clone();
        for k in self.all_keys(sale_id).await? {
            let _: i64 = self
                .pause
                .key(&k.sale)
                .arg(if paused { "1" } else { "0" })
                .invoke_async(&mut conn)
                .await?;
        }
        Ok(())
    }

    async fn queued_order(
        &self,
        sale_id: i64,
        order_id: i64,
    ) -> Result<Option<(i64, i64)>, GateError> {
        let mut conn = self.conn.clone();
        for k in self.all_keys(sale_id).await? {
            let entry: Option<String> = redis::cmd("HGET")
                .arg(&k.accepted)
                .arg(order_id)
                .query_async(&mut conn)
                .await?;
            let Some(entry) = entry else { continue };
            let parsed = entry
                .split_once(':')
                .and_then(|(u, q)| Some((u.parse().ok()?, q.parse().ok()?)));
            return parsed.map(Some).ok_or(GateError::BadReply(entry));
        }
        Ok(None)
    }

    async fn segment_stocks(
        &self,
        sale_id: i64,
        segments: i64,
    ) -> Result<Vec<Option<i64>>, GateError> {
        self.remember_segments(sale_id, segments.max(1));
        let reads = (0..segments.max(1)).map(|s| {
            let k = self.segment_keys(sale_id, segments, s);
            let mut conn = self.conn.clone();
            async move {
                redis::cmd("HGET")
                    .arg(&k.sale)
                    .arg("stock")
                    .query_async::<Option<i64>>(&mut conn)
                    .await
            }
        });
        // Side by side: on a cluster each segment is on its own master.
        futures_util::future::join_all(reads)
            .await
            .into_iter()
            .map(|r| r.map_err(GateError::from))
            .collect()
    }

    async fn take_for_move(&self, leg: MoveLeg) -> Result<MoveStep, GateError> {
        let mut invocation = self.take_move.prepare_invoke();
        self.move_leg_args(&mut invocation, leg);
        let taken: i64 = invocation.invoke_async(&mut self.conn.clone()).await?;
        Ok(match taken {
            1 => MoveStep::Done,
            0 => MoveStep::Refused,
            _ => MoveStep::NotLoaded,
        })
    }

    async fn give_for_move(&self, leg: MoveLeg) -> Result<MoveStep, GateError> {
        let mut invocation = self.give_move.prepare_invoke();
        self.move_leg_args(&mut invocation, leg)
            .arg(crate::redis_client::keys::stock_channel(&self.prefix))
            .arg(leg.sale_id);
        let given: i64 = invocation.invoke_async(&mut self.conn.clone()).await?;
        Ok(if given < 0 {
            MoveStep::NotLoaded
        } else {
            MoveStep::Done
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{eviction_policy, info_texts, pack_counted};

    #[test]
    fn the_eviction_policy_is_read_from_info_of_one_server_or_of_each_node() {
        let info = "# Memory\r\nused_memory:1015160\r\nmaxmemory:67108864\r\n\
                    maxmemory_policy:allkeys-lru\r\nallocator_frag_ratio:1.00\r\n";
        assert_eq!(eviction_policy(info), Some("allkeys-lru"));
        assert_eq!(eviction_policy("# Memory\r\nused_memory:1\r\n"), None);
        let cluster = redis::Value::Map(vec![
            (
                redis::Value::SimpleString("127.0.0.1:7000".into()),
                redis::Value::BulkString(b"maxmemory_policy:noeviction\r\n".to_vec()),
            ),
            (
                redis::Value::SimpleString("127.0.0.1:7001".into()),
                redis::Value::VerbatimString {
                    format: redis::VerbatimFormat::Text,
                    text: "maxmemory_policy:volatile-lru\r\n".into(),
                },
            ),
        ]);
        let mut texts = Vec::new();
        info_texts(&cluster, &mut texts);
        let policies: Vec<_> = texts.iter().filter_map(|t| eviction_policy(t)).collect();
        assert_eq!(policies, vec!["noeviction", "volatile-lru"]);
    }

    #[test]
    fn counted_ids_are_packed_by_their_last_four_digits() {
        let mut packed = pack_counted(&[1, 12345, 22345, -12345, 384284595967610880]);
        packed.sort();
        assert_eq!(
            packed,
            vec![
                ("0880".to_string(), ",384284595967610880,".to_string()),
                ("1".to_string(), ",1,".to_string()),
                ("2345".to_string(), ",12345,22345,-12345,".to_string()),
            ]
        );
    }
}
