//! The SQL gates: purchases decided and written in the database itself, one transaction
//! each (`sql-lock`: `SELECT ... FOR UPDATE`; `sql-conditional`: guarded `UPDATE`). They
//! exist for comparison in `seckill bench --compare` and as a deployment without Redis
//! (never as a switch mid-sale: see docs/operating/deploying.md). A concurrency limit keeps a storm from burying the database: requests beyond it
//! wait their turn rather than piling onto the sale's row lock.

use async_trait::async_trait;
use tokio::sync::Semaphore;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::{
    Gate, GateError, GateStock, Purchase, Rejection, Release, Released, RetryKey, SaleLoad, Spend,
    Verdict,
};
use crate::model::NewOrder;
use crate::store::idempotency::{purchase_record, Claim};
use crate::store::{ClaimedKey, Dialect, Store};
use crate::store::{SqlDecision, SqlVerdict};

pub struct SqlGate {
    store: Store,
    how: SqlDecision,
    in_flight: Semaphore,
    spends: AtomicU64,
}

/// How long a retry waits for its first attempt, still running, before it is refused.
const RETRY_WAIT: Duration = Duration::from_secs(5);

/// Spent nonces are swept from SQL once every this many spends.
const SWEEP_EVERY: u64 = 4096;

impl SqlGate {
    pub fn new(store: Store, how: SqlDecision, max_in_flight: usize) -> Self {
        // SQLite writes one transaction at a time. More purchases in flight only wait in
        // SQLite's busy handler, which polls with sleeps of up to 100 ms, unfairly: under
        // load one of them waited past the busy timeout ("database is locked") while
        // others went first. Here they wait in line instead.
        let max_in_flight = match store.dialect() {
            Dialect::Sqlite => 1,
            _ => max_in_flight.max(1),
        };
        SqlGate {
            store,
            how,
            in_flight: Semaphore::new(max_in_flight),
            spends: AtomicU64::new(0),
        }
    }

    /// A purchase with an `Idempotency-Key`: kept in SQL's idempotency records (as the
    /// admin calls' are), claimed before the purchase and completed in its transaction, so
    /// that a process that dies at any point leaves either no order, or the order and its
    /// record. A claim left without an order is taken over after its lease.
    async fn purchase_once(&self, p: Purchase, key: RetryKey) -> Result<Verdict, GateError> {
        let sql = |e: crate::store::StoreError| GateError::Sql(e.to_string());
        let (caller, key) = purchase_record(p.sale_id, p.user_id, key);
        let fingerprint = p.quantity.to_string();
        let deadline = tokio::time::Instant::now() + RETRY_WAIT;
        // A token is spent by the first attempt that holds the claim; one that holds it
        // again (its first claim lost) has spent it already.
        let mut token = p.token;
        loop {
            let now = self.store.now_ms();
            match self
                .store
                .claim_idempotency_key(&caller, &key, &fingerprint, now)
                .await
                .map_err(sql)?
            {
                Claim::Mine => {
                    let claim = ClaimedKey {
                        caller: &caller,
                        key: &key,
                        claimed_at: now,
                    };
                    let attempt = Purchase { token, ..p };
                    token = None;
                    let verdict = match self.purchase_now(attempt, Some(claim)).await {
                        // The claim is another attempt's now: whose answer is asked for.
                        Ok(None) if tokio::time::Instant::now() < deadline => continue,
                        Ok(None) => Err(GateError::Unavailable(
                            "a purchase with this Idempotency-Key is still running".into(),
                        )),
                        Ok(Some(verdict)) => Ok(verdict),
                        Err(e) => Err(e),
                    };
                    // A purchase made completed its claim; any other leaves the key to a
                    // retry (a claim completed, or taken over by another attempt, stays).
                    if !matches!(verdict, Ok(Verdict::Accepted { .. })) {
                        let released = self.store.release_idempotency_key(&caller, &key, now).await;
                        if let Err(e) = released {
                            tracing::warn!(error = %e, "cannot release a purchase's Idempotency-Key");
                        }
                    }
                    return verdict;
                }
                Claim::Taken { fingerprint: f, .. } if f != fingerprint => {
                    return Ok(Verdict::Rejected(Rejection::RetryKeyReused))
                }
                Claim::Taken {
                    answer: Some((_, order)),
                    ..
                } => {
                    let order_id = order
                        .parse()
                        .map_err(|_| GateError::BadReply(format!("a kept purchase: {order}")))?;
                    return Ok(Verdict::Again { order_id });
                }
                Claim::Taken { answer: None, .. } if tokio::time::Instant::now() >= deadline => {
                    return Err(GateError::Unavailable(
                        "a purchase with this Idempotency-Key is still running".into(),
                    ))
                }
                Claim::Taken { answer: None, .. } => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
            }
        }
    }

    /// The purchase, in one transaction; `None` when its claim was not its own any more.
    async fn purchase_now(
        &self,
        p: Purchase,
        claim: Option<ClaimedKey<'_>>,
    ) -> Result<Option<Verdict>, GateError> {
        // Spent on its own, before the purchase transaction: that one rolls back on every
        // rejection, and a token must stay spent whatever the attempt's outcome.
        if let Some(token) = p.token {
            if !self.spend(p.sale_id, token).await? {
                return Ok(Some(Verdict::Rejected(Rejection::TokenUsed)));
            }
        }
        let order = NewOrder {
            id: p.order_id,
            sale_id: p.sale_id,
            user_id: p.user_id,
            quantity: p.quantity,
            price_cents: 0,
            accepted_at: self.store.now_ms(),
            retry_key: None,
        };
        let verdict = self
            .store
            .sql_purchase_claimed(&order, self.how, claim)
            .await
            .map_err(|e| GateError::Sql(e.to_string()))?;
        Ok(Some(match verdict {
            SqlVerdict::Accepted { remaining } => Verdict::Accepted { remaining },
            SqlVerdict::NotLoaded => Verdict::Rejected(Rejection::NotLoaded),
            SqlVerdict::NotStarted => Verdict::Rejected(Rejection::NotStarted),
            SqlVerdict::Ended => Verdict::Rejected(Rejection::Ended),
            SqlVerdict::Paused => Verdict::Rejected(Rejection::Paused),
            SqlVerdict::AlreadyPurchased => Verdict::Rejected(Rejection::AlreadyPurchased),
            SqlVerdict::OverLimit { held } => Verdict::Rejected(Rejection::OverLimit { held }),
            SqlVerdict::SoldOut { remaining } => {
                Verdict::Rejected(Rejection::SoldOut { remaining })
            }
            SqlVerdict::ClaimLost => return Ok(None),
        }))
    }
}

#[async_trait]
impl Gate for SqlGate {
    async fn purchase(&self, p: Purchase) -> Result<Verdict, GateError> {
        let _turn = self
            .in_flight
            .acquire()
            .await
            .map_err(|_| GateError::BadReply("gate closed".into()))?;
        match p.retry_key {
            Some(key) => self.purchase_once(p, key).await,
            None => match self.purchase_now(p, None).await? {
                Some(verdict) => Ok(verdict),
                None => Err(GateError::BadReply(
                    "a purchase without a claim lost one".into(),
                )),
            },
        }
    }

    async fn load(&self, _load: &SaleLoad) -> Result<bool, GateError> {
        // SQL is this gate's state: there is nothing to load.
        Ok(false)
    }

    async fn is_loaded(&self, _sale_id: i64) -> Result<bool, GateError> {
        Ok(true)
    }

    async fn stock(&self, sale_id: i64) -> Result<Option<GateStock>, GateError> {
        let sale = self
            .store
            .sale(sale_id)
            .await
            .map_err(|e| GateError::Sql(e.to_string()))?;
        let counts = self
            .store
            .sale_counts(sale_id)
            .await
            .map_err(|e| GateError::Sql(e.to_string()))?;
        Ok(sale.map(|s| GateStock {
            remaining: s.stock,
            paused: s.paused,
            buyers: counts.orders,
            accepted: counts.orders,
            ..GateStock::default()
        }))
    }

    async fn release(&self, _r: Release) -> Result<Released, GateError> {
        // The transition that cancelled or expired the order already put the units back
        // on `sales.stock`, which is this gate's stock.
        Ok(Released::NotLoaded)
    }

    async fn set_paused(&self, _sale_id: i64, _paused: bool) -> Result<(), GateError> {
        // The admin call set `sales.paused`, which this gate reads on every purchase.
        Ok(())
    }

    async fn end_early(&self, _sale_id: i64, _at: i64) -> Result<(), GateError> {
        // The admin call set `sales.ends_at`, which this gate reads on every purchase.
        Ok(())
    }

    async fn spend(&self, sale_id: i64, spend: Spend) -> Result<bool, GateError> {
        let sql = |e: crate::store::StoreError| GateError::Sql(e.to_string());
        if self.spends.fetch_add(1, Ordering::Relaxed) % SWEEP_EVERY == SWEEP_EVERY - 1 {
            self.store.forget_spent_nonces().await.map_err(sql)?;
        }
        let now = self.store.now_ms();
        self.store
            .spend_nonce(sale_id, spend.nonce, now + spend.keep_ms(now))
            .await
            .map_err(sql)
    }

    async fn queued_order(
        &self,
        _sale_id: i64,
        _order_id: i64,
    ) -> Result<Option<(i64, i64)>, GateError> {
        Ok(None)
    }
}
