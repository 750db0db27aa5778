//! 64-bit time-ordered ids (Snowflake layout): 41 bits of milliseconds since 2024-01-01,
//! 10 bits of worker id, 12 bits of sequence. Unique across instances as long as no two
//! live instances hold the same worker id: embedded mode uses fixed ids, distributed
//! instances lease theirs in Redis (`lease.lua`). Must never hand out an id while its lease
//! is unsure.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::clock::SharedClock;

/// 2024-01-01T00:00:00Z in Unix milliseconds.
pub const EPOCH_MS: i64 = 1_704_067_200_000;
pub const MAX_WORKER: u16 = 1023;
/// The worker id of the embedded server; command-line tools take [`TOOL_WORKER`].
pub const EMBEDDED_WORKER: u16 = 0;
pub const TOOL_WORKER: u16 = 1023;

#[derive(Debug, thiserror::Error)]
pub enum IdError {
    #[error("the worker id lease has lapsed; refusing to issue ids until it is renewed")]
    LeaseLapsed,
    #[error("no free worker id in Redis (all {0} are leased)")]
    NoFreeWorker(u16),
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("database: {0}")]
    Store(#[from] crate::store::StoreError),
}

pub struct IdGenerator {
    /// (ms since EPOCH << 12) | sequence of the last id issued.
    last: AtomicU64,
    /// The worker id and the instant (ms since EPOCH) until which ids may be issued from
    /// it, packed as `valid_until << 10 | worker`: one load reads both, so no id is ever
    /// issued from a worker id with another lease's validity.
    lease: AtomicU64,
    /// Ids carry the time they were minted, by the process's clock.
    clock: SharedClock,
}

const WORKER_BITS: u32 = 10;
const WORKER_MASK: u64 = (1 << WORKER_BITS) - 1;

fn pack(worker: u16, valid_until_unix_ms: i64) -> u64 {
    let until = (valid_until_unix_ms - EPOCH_MS).max(0) as u64;
    (until.min(u64::MAX >> WORKER_BITS) << WORKER_BITS) | (worker as u64 & WORKER_MASK)
}

impl IdGenerator {
    pub fn fixed(worker: u16) -> Self {
        Self {
            last: AtomicU64::new(0),
            lease: AtomicU64::new(pack(worker.min(MAX_WORKER), i64::MAX)),
            clock: crate::clock::wall(),
        }
    }

    /// The same generator minting by `clock`'s time.
    pub fn with_clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    pub fn worker(&self) -> u16 {
        (self.lease.load(Ordering::Acquire) & WORKER_MASK) as u16
    }

    /// Whether ids can be issued now (the lease is held and fresh).
    pub fn can_issue(&self) -> bool {
        let lease = self.lease.load(Ordering::Acquire);
        self.clock.now_ms() - EPOCH_MS < (lease >> WORKER_BITS) as i64
    }

    fn set_lease(&self, worker: u16, valid_until: i64) {
        self.lease
            .store(pack(worker, valid_until), Ordering::Release);
    }

    pub fn next(&self) -> Result<i64, IdError> {
        let now = self.clock.now_ms();
        let lease = self.lease.load(Ordering::Acquire);
        if now - EPOCH_MS >= (lease >> WORKER_BITS) as i64 {
            return Err(IdError::LeaseLapsed);
        }
        let worker = lease & WORKER_MASK;
        let floor = ((now - EPOCH_MS).max(0) as u64) << 12;
        // Monotonic even if the wall clock steps back: a sequence overflow borrows the next
        // millisecond rather than repeating an id.
        let mut prev = self.last.load(Ordering::Relaxed);
        let next = loop {
            let candidate = floor.max(prev + 1);
            match self.last.compare_exchange_weak(
                prev,
                candidate,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => break candidate,
                Err(seen) => prev = seen,
            }
        };
        let ms = next >> 12;
        let seq = next & 0xfff;
        Ok(((ms << 22) | (worker << 12) | seq) as i64)
    }

    /// The creation time encoded in an id, in Unix milliseconds.
    pub fn time_of(id: i64) -> i64 {
        ((id as u64) >> 22) as i64 + EPOCH_MS
    }
}

/// How long a worker id key lives in Redis without renewal.
const LEASE_MS: i64 = 10_000;
/// Ids are issued at most this long after a renewal was asked for: half the lease, so
/// that an instance has stopped long before its key could lapse and pass to another.
const VALID_MS: i64 = LEASE_MS / 2;
const RENEW_EVERY: Duration = Duration::from_secs(1);

/// Leases a worker id in Redis and keeps it: renewed every second, re-leased after Redis
/// lost it (a restart without data, a failover), never issuing an id while unsure.
///
/// Why ids stay unique across a data loss: an instance keeps issuing from its worker id
/// for up to `VALID_MS` after its last renewal, even if Redis has forgotten the lease
/// meanwhile. So a worker id leased soon after Redis started afresh (a young epoch) is
/// used only once `VALID_MS` has passed since that start, unless it is the leaser's own
/// id from before, or this database has never seen a lease on this prefix (a new
/// deployment: there was nobody before).
pub async fn lease_worker_id(
    conn: crate::redis_client::RedisConn,
    prefix: &str,
    store: crate::store::Store,
) -> Result<Arc<IdGenerator>, IdError> {
    // In a cluster the lease script's two keys must share a slot: one hash tag for both.
    let keys = crate::redis_client::keys::worker_ids(prefix, conn.is_cluster());
    let lessor = Lessor {
        conn,
        keys,
        prefix: prefix.to_string(),
        owner: format!("{}-{}", std::process::id(), rand::random::<u64>()),
        store,
        lease: redis::Script::new(include_str!("lease.lua")),
        renew: redis::Script::new(crate::redis_client::lease::RENEW_LUA),
    };
    let ids = Arc::new(IdGenerator {
        last: AtomicU64::new(0),
        lease: AtomicU64::new(0),
        clock: lessor.store.clock().clone(),
    });
    let worker = lessor.acquire(None, &ids).await?;
    tracing::info!(worker, "leased worker id");
    tokio::spawn(lessor.keep(worker, ids.clone()));
    Ok(ids)
}

struct Lessor {
    conn: crate::redis_client::RedisConn,
    /// The start of the lease keys' names.
    keys: String,
    /// The deployment's key prefix, which names its epoch in SQL.
    prefix: String,
    owner: String,
    store: crate::store::Store,
    lease: redis::Script,
    renew: redis::Script,
}

impl Lessor {
    fn key(&self, worker: u16) -> String {
        format!("{}:worker:{worker}", self.keys)
    }

    /// Leases a worker id (`own` first, if given) and makes `ids` issue from it once that
    /// is safe.
    async fn acquire(&self, own: Option<u16>, ids: &IdGenerator) -> Result<u16, IdError> {
        let start = rand::random::<u16>() % (MAX_WORKER + 1);
        let candidates = own
            .into_iter()
            .chain((0..=MAX_WORKER).map(|i| (start + i) % (MAX_WORKER + 1)));
        let mut conn = self.conn.clone();
        for worker in candidates {
            let (got, redis_now, epoch): (i64, i64, String) = self
                .lease
                .key(self.key(worker))
                .key(format!("{}:epoch", self.keys))
                .arg(&self.owner)
                .arg(LEASE_MS)
                .arg(rand::random::<u64>())
                .invoke_async(&mut conn)
                .await?;
            if got != 1 {
                continue;
            }
            if own != Some(worker) {
                let wait = self.wait_for_earlier_holders(redis_now, &epoch).await?;
                if wait > 0 {
                    tracing::warn!(
                        worker,
                        wait_ms = wait,
                        "Redis started afresh moments ago; waiting until no earlier holder of this worker id can still issue ids"
                    );
                    tokio::time::sleep(Duration::from_millis(wait as u64)).await;
                }
            }
            if !self.renew_now(worker, ids).await? {
                continue;
            }
            return Ok(worker);
        }
        Err(IdError::NoFreeWorker(MAX_WORKER + 1))
    }

    /// Milliseconds until an instance that held a worker id before this epoch began has
    /// surely stopped issuing from it; 0 when there can be none.
    async fn wait_for_earlier_holders(&self, redis_now: i64, epoch: &str) -> Result<i64, IdError> {
        let created: i64 = epoch
            .split(':')
            .next()
            .and_then(|t| t.parse().ok())
            .unwrap_or(0);
        let left = created + VALID_MS - redis_now;
        if left <= 0 {
            return Ok(0);
        }
        let key = format!("redis_epoch:{:016x}", fnv1a(self.prefix.as_bytes()));
        let first = self.store.meta_get_or_init(&key, epoch).await?;
        Ok(if first == epoch { 0 } else { left })
    }

    /// Renews the lease of `worker`; on success `ids` may issue from it for `VALID_MS`.
    async fn renew_now(&self, worker: u16, ids: &IdGenerator) -> Result<bool, IdError> {
        let mut conn = self.conn.clone();
        let asked_at = ids.clock.now_ms();
        let renewed: i64 = self
            .renew
            .key(self.key(worker))
            .arg(&self.owner)
            .arg(LEASE_MS)
            .invoke_async(&mut conn)
            .await?;
        if renewed == 1 {
            ids.set_lease(worker, asked_at + VALID_MS);
        }
        Ok(renewed == 1)
    }

    /// Renews forever; after a loss, leases again (its own id first). One log line per
    /// change of state.
    async fn keep(self, mut worker: u16, ids: Arc<IdGenerator>) {
        let mut failing = false;
        let mut lost = false;
        // Set when the lease was found lost: lease again at once, since no id is issued
        // until then (after Redis lost its data, purchases waited a whole renewal interval).
        let mut at_once = false;
        loop {
            if !std::mem::take(&mut at_once) {
                tokio::time::sleep(RENEW_EVERY).await;
            }
            let renewed = if lost {
                self.acquire(Some(worker), &ids).await.map(|w| {
                    worker = w;
                    true
                })
            } else {
                self.renew_now(worker, &ids).await
            };
            match renewed {
                Ok(true) => {
                    if lost || failing {
                        tracing::info!(worker, "worker id lease held again; issuing ids");
                    }
                    lost = false;
                    failing = false;
                }
                Ok(false) => {
                    // Redis forgot the lease (data lost, a failover) or another holds it.
                    // The packed lease keeps its worker id but is no longer valid.
                    ids.set_lease(worker, 0);
                    tracing::error!(worker, "worker id lease lost; leasing again");
                    at_once = !lost;
                    lost = true;
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e, "could not renew the worker id lease; ids stop if this lasts");
                    }
                    failing = true;
                }
            }
        }
    }
}

/// FNV-1a: a stable short name for a prefix of any length (meta keys are 64 characters).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn ids_are_unique_and_increasing_across_threads() {
        let ids = Arc::new(IdGenerator::fixed(7));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let ids = ids.clone();
                std::thread::spawn(move || {
                    (0..20_000).map(|_| ids.next().unwrap()).collect::<Vec<_>>()
                })
            })
            .collect();
        let mut all = HashSet::new();
        for h in handles {
            let v = h.join().unwrap();
            assert!(
                v.windows(2).all(|w| w[0] < w[1]),
                "ids go up within a thread"
            );
            for id in v {
                assert!(all.insert(id), "duplicate id {id}");
                assert_eq!((id >> 12) & 0x3ff, 7, "worker bits");
            }
        }
        assert_eq!(all.len(), 80_000);
    }

    #[test]
    fn id_carries_its_time() {
        let ids = IdGenerator::fixed(1);
        let before = crate::clock::wall_ms();
        let id = ids.next().unwrap();
        let t = IdGenerator::time_of(id);
        assert!(
            t >= before && t <= crate::clock::wall_ms() + 5_000,
            "{t} vs {before}"
        );
    }

    #[test]
    fn lapsed_lease_refuses() {
        let ids = IdGenerator::fixed(1);
        ids.set_lease(1, 0);
        assert!(matches!(ids.next(), Err(IdError::LeaseLapsed)));
    }
}
