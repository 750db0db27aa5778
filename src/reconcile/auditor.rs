//! The continuous audit: every few seconds, one instance at a time (a lease in Redis when
//! there is one), each live sale's account; a difference that stays the same over
//! `CONFIRM_ROUNDS` audits is drift, logged once, kept on the board for `/metrics` and
//! the admin stats until it clears. It reads and reports; it never repairs.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::watch;

use super::{account, Account, ReconcileError};
use crate::gate::Gate;
use crate::loader::SaleCache;
use crate::redis_client::RedisConn;
use crate::store::Store;

/// Audits in a row that must find the same difference before it is called drift.
pub const CONFIRM_ROUNDS: u32 = 3;

/// Sales audited: open, or ended less than this long ago (late returns still settle).
const AFTER_END_MS: i64 = 60_000;

/// Drift found and not cleared, per sale; what `/metrics` and the stats show.
#[derive(Default)]
pub struct Board {
    drift: Mutex<BTreeMap<i64, Finding>>,
    pub audits: AtomicU64,
    /// Whether this instance holds the audit lease (the others' boards stay empty).
    pub auditing: AtomicBool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    pub account: Account,
    /// When the difference was first seen (Unix ms).
    pub since_ms: i64,
}

impl Board {
    pub fn drift(&self) -> BTreeMap<i64, Finding> {
        lock(&self.drift).clone()
    }

    pub fn finding(&self, sale: i64) -> Option<Finding> {
        lock(&self.drift).get(&sale).cloned()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The lease that makes one auditor at a time among the instances sharing a Redis.
pub struct Lease {
    pub conn: RedisConn,
    pub key: String,
    pub token: String,
}

impl Lease {
    /// Takes the lease, or keeps it; false while another instance holds it.
    async fn hold(&self, ttl: Duration) -> Result<bool, redis::RedisError> {
        let mut conn = self.conn.clone();
        let ms = ttl.as_millis() as u64;
        let taken: Option<String> = redis::cmd("SET")
            .arg(&self.key)
            .arg(&self.token)
            .arg("NX")
            .arg("PX")
            .arg(ms)
            .query_async(&mut conn)
            .await?;
        if taken.is_some() {
            return Ok(true);
        }
        let renewed: i64 = redis::Script::new(crate::redis_client::lease::RENEW_LUA)
            .key(&self.key)
            .arg(&self.token)
            .arg(ms)
            .invoke_async(&mut conn)
            .await?;
        Ok(renewed == 1)
    }
}

pub struct Auditor {
    pub store: Store,
    pub gate: Arc<dyn Gate>,
    pub backlog: std::sync::Arc<dyn crate::orderlog::Backlog>,
    pub cache: Arc<SaleCache>,
    pub board: Arc<Board>,
    pub every: Duration,
    pub lease: Option<Lease>,
}

/// A difference seen in consecutive audits.
struct Streak {
    differences: (i64, i64, i64, i64),
    rounds: u32,
    since_ms: i64,
}

impl Auditor {
    pub async fn run(self, mut stop: watch::Receiver<bool>) {
        let mut streaks: HashMap<i64, Streak> = HashMap::new();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.every) => {}
                _ = stop.changed() => {}
            }
            if *stop.borrow() {
                break;
            }
            let holding = match &self.lease {
                Some(lease) => match lease.hold(self.every * 3).await {
                    Ok(h) => h,
                    Err(e) => {
                        tracing::debug!(error = %e, "audit lease unavailable");
                        false
                    }
                },
                None => true,
            };
            self.board.auditing.store(holding, Ordering::Relaxed);
            if !holding {
                streaks.clear();
                lock(&self.board.drift).clear();
                continue;
            }
            self.round(&mut streaks).await;
        }
    }

    /// One audit of every live sale.
    async fn round(&self, streaks: &mut HashMap<i64, Streak>) {
        let now = crate::now_ms();
        let live: Vec<i64> = self
            .cache
            .all()
            .iter()
            .filter(|s| s.begins_at <= now + 60_000 && now < s.ends_at + AFTER_END_MS)
            .map(|s| s.id)
            .collect();
        streaks.retain(|sale, _| live.contains(sale));
        lock(&self.board.drift).retain(|sale, _| live.contains(sale));
        for sale in live {
            match account(&self.store, self.gate.as_ref(), self.backlog.as_ref(), sale).await {
                Ok(a) => self.judge(streaks, a, now),
                // Nothing to conclude this round; a streak needs unbroken rounds.
                Err(ReconcileError::TooMuchInFlight(_)) => {
                    streaks.remove(&sale);
                }
                Err(e) => {
                    tracing::debug!(sale, error = %e, "audit of the sale failed this round");
                    streaks.remove(&sale);
                }
            }
        }
        self.board.audits.fetch_add(1, Ordering::Relaxed);
    }

    fn judge(&self, streaks: &mut HashMap<i64, Streak>, a: Account, now: i64) {
        let sale: i64 = a.sale_id.parse().unwrap_or_default();
        let differences = a.differences();
        if a.exact() {
            streaks.remove(&sale);
            if lock(&self.board.drift).remove(&sale).is_some() {
                tracing::info!(sale, "drift cleared: the gate matches SQL again");
            }
            return;
        }
        let streak = streaks.entry(sale).or_insert(Streak {
            differences,
            rounds: 0,
            since_ms: now,
        });
        if streak.differences != differences {
            *streak = Streak {
                differences,
                rounds: 0,
                since_ms: now,
            };
        }
        streak.rounds += 1;
        if streak.rounds < CONFIRM_ROUNDS {
            return;
        }
        let mut board = lock(&self.board.drift);
        let known = board.get(&sale).map(|f| f.account.differences());
        if known != Some(differences) {
            tracing::warn!(
                sale,
                stock_drift = a.stock_drift,
                buyers_missing = a.buyers_missing,
                buyers_unknown = a.buyers_unknown,
                journal_drift = a.journal_drift,
                gate_stock = a.gate_stock,
                expected_gate_stock = a.expected_gate_stock,
                "DRIFT: the gate no longer matches SQL and what is in flight; see `seckill reconcile --sale {sale}`, repair with --repair"
            );
        }
        board.insert(
            sale,
            Finding {
                account: a,
                since_ms: streak.since_ms,
            },
        );
    }
}
