//! 64-bit time-ordered ids (Snowflake layout): 41 bits of milliseconds since 2024-01-01,
//! 10 bits of worker id, 12 bits of sequence. Unique across instances as long as no two
//! live instances hold the same worker id: embedded mode uses fixed ids, distributed
//! instances lease theirs in Redis. Must never hand out an id while its lease is unsure.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

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
}

pub struct IdGenerator {
    worker: u16,
    /// (ms since EPOCH << 12) | sequence of the last id issued.
    last: AtomicU64,
    /// Ids may be issued until this instant (Unix ms); `i64::MAX` for a fixed worker id.
    valid_until: AtomicI64,
}

impl IdGenerator {
    pub fn fixed(worker: u16) -> Self {
        Self {
            worker: worker.min(MAX_WORKER),
            last: AtomicU64::new(0),
            valid_until: AtomicI64::new(i64::MAX),
        }
    }

    pub fn worker(&self) -> u16 {
        self.worker
    }

    pub fn next(&self) -> Result<i64, IdError> {
        let now = crate::now_ms();
        if now >= self.valid_until.load(Ordering::Acquire) {
            return Err(IdError::LeaseLapsed);
        }
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
        Ok(((ms << 22) | ((self.worker as u64) << 12) | seq) as i64)
    }

    /// The creation time encoded in an id, in Unix milliseconds.
    pub fn time_of(id: i64) -> i64 {
        ((id as u64) >> 22) as i64 + EPOCH_MS
    }
}

const LEASE_MS: i64 = 60_000;
const RENEW_EVERY: Duration = Duration::from_secs(15);

/// Leases a worker id in Redis (`SET NX PX`) and keeps renewing it. Ids stop being issued
/// well before the lease could have passed to another instance.
pub async fn lease_worker_id(
    mut conn: redis::aio::ConnectionManager,
    prefix: &str,
) -> Result<Arc<IdGenerator>, IdError> {
    let owner = format!("{}-{}", std::process::id(), rand::random::<u64>());
    let start = rand::random::<u16>() % (MAX_WORKER + 1);
    for i in 0..=MAX_WORKER {
        let worker = (start + i) % (MAX_WORKER + 1);
        let key = format!("{prefix}:worker:{worker}");
        let got: Option<String> = redis::cmd("SET")
            .arg(&key)
            .arg(&owner)
            .arg("NX")
            .arg("PX")
            .arg(LEASE_MS)
            .query_async(&mut conn)
            .await?;
        if got.is_some() {
            let ids = Arc::new(IdGenerator {
                worker,
                last: AtomicU64::new(0),
                valid_until: AtomicI64::new(crate::now_ms() + LEASE_MS / 2),
            });
            tokio::spawn(renew_lease(conn, key, owner, ids.clone()));
            tracing::info!(worker, "leased worker id");
            return Ok(ids);
        }
    }
    Err(IdError::NoFreeWorker(MAX_WORKER + 1))
}

const RENEW_SCRIPT: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
    return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end";

async fn renew_lease(
    mut conn: redis::aio::ConnectionManager,
    key: String,
    owner: String,
    ids: Arc<IdGenerator>,
) {
    let script = redis::Script::new(RENEW_SCRIPT);
    loop {
        tokio::time::sleep(RENEW_EVERY).await;
        let asked_at = crate::now_ms();
        let renewed: Result<i64, _> = script
            .key(&key)
            .arg(&owner)
            .arg(LEASE_MS)
            .invoke_async(&mut conn)
            .await;
        match renewed {
            Ok(1) => ids
                .valid_until
                .store(asked_at + LEASE_MS / 2, Ordering::Release),
            Ok(_) => {
                // Someone else holds our worker id: never issue another id from it.
                tracing::error!(key, "worker id lease lost; this instance stops issuing ids");
                ids.valid_until.store(0, Ordering::Release);
                return;
            }
            Err(e) => tracing::warn!(error = %e, "could not renew the worker id lease"),
        }
    }
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
        let before = crate::now_ms();
        let id = ids.next().unwrap();
        let t = IdGenerator::time_of(id);
        assert!(
            t >= before && t <= crate::now_ms() + 5_000,
            "{t} vs {before}"
        );
    }

    #[test]
    fn lapsed_lease_refuses() {
        let ids = IdGenerator::fixed(1);
        ids.valid_until.store(0, Ordering::Release);
        assert!(matches!(ids.next(), Err(IdError::LeaseLapsed)));
    }
}
