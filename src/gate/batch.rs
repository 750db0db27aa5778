//! Batches the Redis gate's concurrent purchase attempts into script calls: attempts that
//! arrive while earlier calls are out leave together, one `purchase.lua` call per sale,
//! decided one after another inside it exactly as they would be alone. Under light load
//! every attempt goes alone at once (no waiting to fill a batch); under a storm Redis pays
//! its per-command cost once per batch. Owns nothing but the queue: it never decides.

use crate::metrics::render_counter;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use redis::{Script, Value};
use tokio::sync::{mpsc, oneshot, Semaphore};

use super::reply::verdicts_from_reply;
use super::{GateError, Purchase, RateLimit, Verdict};
use crate::config::{Durability, EntryForm};
use crate::redis_client::keys::SaleKeys;
use crate::redis_client::RedisConn;

/// Most attempts decided by one script call (Redis runs nothing else meanwhile).
const MAX_BATCH: usize = 128;
/// Script calls out at once with a durability level: each waits after Redis has run it (on
/// its own connection for WAIT or WAITAOF, or for Redis' own fsync), so more of them share
/// each wait and keep Redis busy meanwhile.
pub const MAX_CALLS_IN_FLIGHT: usize = 8;
/// Script calls out at once without one; while all are out, new attempts queue and form
/// the next batch. Redis runs the calls one after another anyway, so more calls out at once
/// only cut the same attempts into smaller batches, and each call has a fixed cost in Redis
/// (the script's set-up, the sale's fields, the clock, the stock's write) and in this
/// process (a request written and a reply parsed). Measured on loopback (docs/adr/0006);
/// a Redis a long round trip away would want more.
pub const CALLS_IN_FLIGHT: usize = 2;

/// Script calls made and attempts they decided, process-wide, for /metrics: their ratio
/// is the mean batch size.
pub static CALLS: AtomicU64 = AtomicU64::new(0);
pub static ATTEMPTS: AtomicU64 = AtomicU64::new(0);
/// Durability waits made, and those that failed (their buyers were answered `pending`).
pub static DURABILITY_WAITS: AtomicU64 = AtomicU64::new(0);
pub static DURABILITY_MISSES: AtomicU64 = AtomicU64::new(0);

/// How long a batch waits for the AOF fsync or a replica before its buyers hear `pending`.
const DURABILITY_WAIT_MS: u64 = 500;

/// The durability wait of accepted batches: on connections of their own, since WAIT and
/// WAITAOF block the connection that sends them (and cover that connection's writes).
pub struct Durable {
    pub level: Durability,
    /// A connection per call in flight (a call that finds none left waits on the shared
    /// connection instead).
    pub pool: std::sync::Mutex<Vec<RedisConn>>,
}

/// A sale segment's keys, its (sale, segment), and its attempts of one batch.
/// A call's attempts: its segment's keys, (sale, segment, whether they carry an
/// Idempotency-Key), the attempts.
type SegmentGroup = (Arc<SaleKeys>, (i64, i64, bool), Vec<Attempt>);

struct Attempt {
    purchase: Purchase,
    answer: oneshot::Sender<Result<Verdict, GateError>>,
}

/// The handle purchases are sent through.
pub struct Batches {
    queue: mpsc::UnboundedSender<Attempt>,
}

impl Batches {
    pub async fn decide(&self, purchase: Purchase) -> Result<Verdict, GateError> {
        let (answer, verdict) = oneshot::channel();
        self.queue
            .send(Attempt { purchase, answer })
            .map_err(|_| GateError::Unavailable("the purchase batcher has stopped".into()))?;
        verdict
            .await
            .map_err(|_| GateError::Unavailable("the purchase batcher dropped an attempt".into()))?
    }
}

/// Starts the batcher task; it ends when the returned handle is dropped.
pub fn start(
    conn: RedisConn,
    script: Script,
    prefix: String,
    rate: RateLimit,
    entry: EntryForm,
    durable: Option<Arc<Durable>>,
    calls_in_flight: usize,
) -> Batches {
    let (queue, attempts) = mpsc::unbounded_channel();
    let caller = Arc::new(Caller {
        conn,
        script,
        rate,
        entry,
        durable,
    });
    tokio::spawn(run(caller, prefix, attempts, calls_in_flight));
    Batches { queue }
}

struct Caller {
    conn: RedisConn,
    script: Script,
    rate: RateLimit,
    /// How the script writes an accepted order into the stream.
    entry: EntryForm,
    durable: Option<Arc<Durable>>,
}

/// How many connections a durable gate needs: one per call in flight.
pub const DURABLE_CONNECTIONS: usize = MAX_CALLS_IN_FLIGHT;

async fn run(
    caller: Arc<Caller>,
    prefix: String,
    mut attempts: mpsc::UnboundedReceiver<Attempt>,
    calls_in_flight: usize,
) {
    let slots = Arc::new(Semaphore::new(calls_in_flight.max(1)));
    let mut keys: HashMap<(i64, i64, i64), Arc<SaleKeys>> = HashMap::new();
    loop {
        // Wait for a free slot before taking attempts off the queue, so that the queue
        // holds everything that arrived while all calls were out.
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let Some(first) = attempts.recv().await else {
            return;
        };
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match attempts.try_recv() {
                Ok(a) => batch.push(a),
                Err(_) => break,
            }
        }
        // An attempt whose caller has given up (the breaker's time limit, while Redis was
        // away) is never sent: nobody would hear its verdict, and a buyer told
        // `unavailable` must not find an order placed minutes later.
        batch.retain(|a| !a.answer.is_closed());
        if batch.is_empty() {
            continue;
        }
        // One call per sale segment: a segment's keys share one hash tag (one slot). The
        // attempts with an Idempotency-Key make calls of their own, so that the others
        // carry nothing for it.
        let mut by_sale: Vec<SegmentGroup> = Vec::new();
        for a in batch {
            let p = &a.purchase;
            let part = (p.sale_id, p.segment(), p.retry_key.is_some());
            match by_sale.iter_mut().find(|(_, id, _)| *id == part) {
                Some((_, _, group)) => group.push(a),
                None => {
                    let id = (part.0, a.purchase.segments.max(1), part.1);
                    let k = keys
                        .entry(id)
                        .or_insert_with(|| {
                            Arc::new(SaleKeys::for_segment(&prefix, id.0, id.1, id.2))
                        })
                        .clone();
                    by_sale.push((k, part, vec![a]));
                }
            }
        }
        let caller = caller.clone();
        tokio::spawn(async move {
            let _slot = slot;
            // With a durability level, this slot's own connection (there is one per slot).
            let own = caller
                .durable
                .as_ref()
                .and_then(|d| d.pool.lock().unwrap_or_else(|p| p.into_inner()).pop());
            let conn = own.clone().unwrap_or_else(|| caller.conn.clone());
            let calls = by_sale
                .into_iter()
                .map(|(k, (sale_id, ..), group)| caller.call(k, sale_id, group, conn.clone()));
            futures_util::future::join_all(calls).await;
            if let (Some(d), Some(own)) = (&caller.durable, own) {
                d.pool.lock().unwrap_or_else(|p| p.into_inner()).push(own);
            }
        });
    }
}

impl Caller {
    /// Waits until this connection's writes so far to the master of `key` hold at the
    /// chosen level; false when they do not within `DURABILITY_WAIT_MS` (or the wait failed).
    async fn wait_durable(&self, conn: &mut RedisConn, key: &str) -> bool {
        let Some(d) = &self.durable else {
            return true;
        };
        DURABILITY_WAITS.fetch_add(1, Ordering::Relaxed);
        let held = match d.level {
            Durability::None => return true,
            Durability::Aof => {
                let mut cmd = redis::cmd("WAITAOF");
                cmd.arg(1).arg(0).arg(DURABILITY_WAIT_MS);
                conn.query_at_master_of::<(i64, i64)>(key, cmd)
                    .await
                    .map(|(local, _)| local >= 1)
            }
            Durability::Replica => {
                let mut cmd = redis::cmd("WAIT");
                cmd.arg(1).arg(DURABILITY_WAIT_MS);
                conn.query_at_master_of::<i64>(key, cmd)
                    .await
                    .map(|replicas| replicas >= 1)
            }
        };
        let held = held.unwrap_or_else(|e| {
            tracing::debug!(error = %e, "durability wait failed");
            false
        });
        if !held {
            DURABILITY_MISSES.fetch_add(1, Ordering::Relaxed);
        }
        held
    }

    /// One script call for attempts on one sale; every attempt gets its verdict or the error.
    async fn call(&self, k: Arc<SaleKeys>, sale_id: i64, group: Vec<Attempt>, mut conn: RedisConn) {
        CALLS.fetch_add(1, Ordering::Relaxed);
        ATTEMPTS.fetch_add(group.len() as u64, Ordering::Relaxed);
        let now = crate::clock::wall_ms();
        let mut call = self.script.key(&k.sale);
        call.key(&k.buyers)
            .key(&k.stream)
            .key(&k.accepted)
            .key(&k.rate);
        for a in &group {
            match a.purchase.token {
                Some(t) => call.key(k.spent(t.nonce)),
                None => call.key(&k.sale),
            };
        }
        // A call of attempts with an Idempotency-Key names each one's record after them.
        for a in &group {
            if let Some(key) = a.purchase.retry_key {
                call.key(k.retry_record(a.purchase.user_id, key.0));
            }
        }
        call.arg(sale_id)
            .arg(self.rate.interval_ms())
            .arg(self.rate.tolerance_ms())
            .arg(if self.conn.is_cluster() { "1" } else { "0" })
            .arg(self.entry.name());
        for a in &group {
            let p = &a.purchase;
            call.arg(p.user_id)
                .arg(p.quantity)
                .arg(p.order_id)
                .arg(if p.after_move {
                    -1
                } else {
                    p.token.map_or(0, |t| t.keep_ms(now))
                })
                .arg(super::attempt_deadline(p.order_id));
        }
        let reply: Result<Value, _> = call.invoke_async(&mut conn).await;
        match reply
            .map_err(GateError::from)
            .and_then(|v| verdicts_from_reply(&v, group.len()))
        {
            Ok(verdicts) => {
                let durable = if verdicts
                    .iter()
                    .any(|v| matches!(v, Verdict::Accepted { .. } | Verdict::Again { .. }))
                {
                    self.wait_durable(&mut conn, &k.sale).await
                } else {
                    true
                };
                for (a, v) in group.into_iter().zip(verdicts) {
                    let answer = match v {
                        // A retry's record names an order whose first answer went out
                        // already; `pending` would name this attempt's unused id instead.
                        Verdict::Accepted { .. } if !durable => Err(GateError::NotDurable),
                        v => Ok(v),
                    };
                    // The caller may have given up (a timeout); its verdict stands regardless.
                    let _ = a.answer.send(answer);
                }
            }
            Err(e) => {
                for a in group {
                    let _ = a.answer.send(Err(e.for_another_waiter()));
                }
            }
        }
    }
}
/// The purchase script calls of this process, in Prometheus text.
pub fn render_metrics(out: &mut String) {
    let series: [(&str, &str, &AtomicU64); 4] = [
        (
            "seckill_gate_script_calls_total",
            "Purchase script calls to Redis (each decides a batch of attempts).",
            &CALLS,
        ),
        (
            "seckill_gate_script_attempts_total",
            "Purchase attempts decided by those calls.",
            &ATTEMPTS,
        ),
        (
            "seckill_gate_durability_waits_total",
            "Accepted batches that waited for --redis-durability (WAITAOF or WAIT).",
            &DURABILITY_WAITS,
        ),
        (
            "seckill_gate_durability_misses_total",
            "Durability waits not confirmed in time: their buyers were answered pending.",
            &DURABILITY_MISSES,
        ),
    ];
    for (name, help, counter) in series {
        render_counter(name, help, counter.load(Ordering::Relaxed), out);
    }
}
