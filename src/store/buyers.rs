//! On SQLite, the index of orders by (sale, buyer), kept beside `orders` in two runs, as a
//! log-structured tree keeps its levels: `buyer_orders_new`, small, which every written
//! order adds its entry to, and `buyer_orders`, into which the new entries are merged in
//! key order once `MERGE_EVERY` have gathered. Readers ask the view `buyer_orders_all`, both
//! runs, which SQLite searches run by run on their keys.
//!
//! Why not an index on `orders`: buyers arrive in random order, so each writer batch wrote
//! back a page of that index per order or so once a sale outgrew a batch (the pages of a
//! million buyers' entries are thousands), and its CPU per order grew with the sale (issue
//! 27). A batch now dirties the few pages of the small run; a merge writes each page of the
//! large run once per `MERGE_EVERY` orders.
//!
//! Never holds an entry without its order or leaves an order without one: an order's entry
//! is written in the transaction that writes the order, and a merge moves entries from one
//! run to the other in one transaction. PostgreSQL and MySQL keep `orders_by_sale_user`:
//! their cost per order was flat at a million orders already.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use sqlx::Row;

use super::{Dialect, Store, StoreError};
use crate::model::NewOrder;

/// New entries gathered before they are merged into the large run. Smaller merges more
/// often (each rewrites the large run's pages); larger makes the small run's pages many.
pub const MERGE_EVERY: i64 = 50_000;

/// Entries moved per merge step, one step after each commit of the writer: a merge of the
/// whole small run in one commit rewrote nearly every page of the large run at once (some
/// 20 MB of WAL at a million buyers), on the disk the order log syncs its purchases to.
pub const MERGE_STEP: i64 = 5_000;

/// The orders of one buyer in one sale (`?` the sale, then the buyer) that are live, with
/// the order's columns as `o.`: on SQLite through the buyer index's runs.
pub(super) const SQLITE_LIVE_OF_BUYER: &str = "buyer_orders_all b CROSS JOIN orders o \
     ON o.id = b.order_id WHERE b.sale_id = ? AND b.user_id = ? \
     AND o.status IN ('pending_payment', 'paid')";

/// [`SQLITE_LIVE_OF_BUYER`] on the other backends: `orders_by_sale_user`.
pub(super) const LIVE_OF_BUYER: &str = "orders o WHERE o.sale_id = ? AND o.user_id = ? \
     AND o.status IN ('pending_payment', 'paid')";

impl Store {
    /// The units one buyer holds in one sale's live orders (`?` the sale, then the buyer):
    /// on SQLite through both runs (see [`SQLITE_LIVE_OF_BUYER`]).
    pub fn live_units_of_buyer_query(&self) -> String {
        let from = if self.dialect == Dialect::Sqlite {
            SQLITE_LIVE_OF_BUYER
        } else {
            LIVE_OF_BUYER
        };
        format!("SELECT {} FROM {from}", self.sum_int("o.quantity"))
    }

    /// Adds the entries of orders just inserted in this transaction to SQLite's buyer
    /// index; nothing elsewhere, whose index on `orders` does it.
    /// After the commit, [`Store::buyers_indexed`] counts them towards a merge.
    pub(super) async fn index_buyers(
        &self,
        conn: &mut sqlx::AnyConnection,
        orders: &[&NewOrder],
    ) -> Result<(), StoreError> {
        if self.dialect != Dialect::Sqlite {
            return Ok(());
        }
        for chunk in self.statement_chunks(orders, 300) {
            // `OR IGNORE` for the reason the orders' insert has it: no statement journal. An
            // entry can only clash with itself: the order's id is in it, and the order
            // was not in SQL before this transaction.
            let q = format!(
                "INSERT OR IGNORE INTO buyer_orders_new (sale_id, user_id, order_id) VALUES {}",
                vec!["(?, ?, ?)"; chunk.len()].join(",")
            );
            let mut query = sqlx::query(&q).persistent(self.keeps_shape(chunk.len(), 300));
            for o in chunk {
                query = query.bind(o.sale_id).bind(o.user_id).bind(o.id);
            }
            query.execute(&mut *conn).await?;
        }
        Ok(())
    }

    /// Counts `n` entries committed to the small run; once `MERGE_EVERY` have gathered, a
    /// merge begins, and each call until it is through moves its next step. A failed step
    /// is told and tried again at the next call: the entries stay readable in the small
    /// run. The first call in a process counts what the small run holds already (written
    /// before a restart), so that restarts cannot keep it from ever merging.
    pub(super) async fn buyers_indexed(&self, n: usize) {
        if self.dialect != Dialect::Sqlite || n == 0 {
            return;
        }
        let merge = &self.buyer_merge;
        let mut n = n as i64;
        if !merge.counted.swap(true, Ordering::Relaxed) {
            match self.count_new_buyers().await {
                // This call's own entries are in it already.
                Ok(held) => n = n.max(held),
                Err(e) => {
                    merge.counted.store(false, Ordering::Relaxed);
                    tracing::warn!(error = %e, "counting new buyers' index entries failed; will retry");
                }
            }
        }
        let gathered = merge.gathered.fetch_add(n, Ordering::Relaxed) + n;
        let from = {
            let mut after = lock(&merge.after);
            match *after {
                Some(key) => key,
                None if gathered < merge.every => return,
                None => {
                    // What is written from now on counts towards the next merge.
                    merge.gathered.store(0, Ordering::Relaxed);
                    *after = Some(FIRST);
                    FIRST
                }
            }
        };
        let next = match self.merge_step(from, merge.step).await {
            Ok((_, next)) => next,
            Err(e) => {
                tracing::warn!(error = %e, "a step of merging new buyers' index entries failed; will retry");
                Some(from)
            }
        };
        *lock(&merge.after) = next;
    }

    /// The entries in the small run.
    async fn count_new_buyers(&self) -> Result<i64, StoreError> {
        Ok(sqlx::query("SELECT COUNT(*) FROM buyer_orders_new")
            .fetch_one(&self.pool)
            .await?
            .try_get(0)?)
    }

    /// Moves every entry of the small run into the large one, step by step; returns how
    /// many moved. Nothing on PostgreSQL and MySQL.
    pub async fn merge_new_buyers(&self) -> Result<u64, StoreError> {
        if self.dialect != Dialect::Sqlite {
            return Ok(0);
        }
        let (mut from, mut moved) = (FIRST, 0);
        loop {
            let (n, next) = self.merge_step(from, self.buyer_merge.step).await?;
            moved += n;
            match next {
                Some(key) => from = key,
                None => break,
            }
        }
        *lock(&self.buyer_merge.after) = None;
        self.buyer_merge.gathered.store(0, Ordering::Relaxed);
        Ok(moved)
    }

    /// Moves the small run's next `step` entries after `from`, in key order, in one
    /// transaction: (entries moved, the last key moved, or `None` when none are left after
    /// it).
    async fn merge_step(&self, from: Key, step: i64) -> Result<(u64, Option<Key>), StoreError> {
        self.in_write_tx(|mut conn| async move {
            let result = async {
                let last = sqlx::query(&format!(
                    "SELECT sale_id, user_id, order_id FROM buyer_orders_new \
                     WHERE (sale_id, user_id, order_id) > (?, ?, ?) \
                     ORDER BY sale_id, user_id, order_id LIMIT 1 OFFSET {}",
                    step - 1
                ))
                .bind(from[0])
                .bind(from[1])
                .bind(from[2])
                .fetch_optional(&mut *conn)
                .await?
                .map(|r| Ok::<Key, sqlx::Error>([r.try_get(0)?, r.try_get(1)?, r.try_get(2)?]))
                .transpose()?;
                let range = match last {
                    Some(_) => {
                        "(sale_id, user_id, order_id) > (?, ?, ?) \
                                AND (sale_id, user_id, order_id) <= (?, ?, ?)"
                    }
                    None => "(sale_id, user_id, order_id) > (?, ?, ?)",
                };
                let bounds: Vec<i64> = from.iter().chain(last.iter().flatten()).copied().collect();
                // `OR IGNORE`: no statement journal, which would copy each page of the large
                // run this touches. An entry already there is this same entry.
                let insert = format!(
                    "INSERT OR IGNORE INTO buyer_orders (sale_id, user_id, order_id) \
                     SELECT sale_id, user_id, order_id FROM buyer_orders_new WHERE {range} \
                     ORDER BY sale_id, user_id, order_id"
                );
                let delete = format!("DELETE FROM buyer_orders_new WHERE {range}");
                let mut moved = 0;
                for (i, q) in [insert, delete].iter().enumerate() {
                    let mut query = sqlx::query(q);
                    for b in &bounds {
                        query = query.bind(*b);
                    }
                    let done = query.execute(&mut *conn).await?.rows_affected();
                    if i == 1 {
                        moved = done;
                    }
                }
                Ok::<_, StoreError>((moved, last))
            }
            .await;
            (conn, result)
        })
        .await
    }

    /// Merges after every `every` new entries, `step` at a time, instead of
    /// [`MERGE_EVERY`] and [`MERGE_STEP`] (tests).
    pub fn with_buyers_merged_every(mut self, every: i64, step: i64) -> Self {
        self.buyer_merge = MergeState {
            every: every.max(1),
            step: step.max(1),
            ..MergeState::default()
        };
        self
    }
}

/// A key of the buyer index: (sale, buyer, order).
type Key = [i64; 3];

/// Below every key: where a merge begins.
const FIRST: Key = [i64::MIN; 3];

/// Where merging the small run stands, shared by a store's clones.
#[derive(Clone)]
pub(super) struct MergeState {
    /// Entries committed to the small run since the last merge began.
    gathered: Arc<AtomicI64>,
    /// Whether `gathered` has counted what the small run held when this process began.
    counted: Arc<AtomicBool>,
    /// The last key the merge under way has moved (`FIRST` before its first step); `None`
    /// between merges.
    after: Arc<Mutex<Option<Key>>>,
    every: i64,
    step: i64,
}

impl Default for MergeState {
    fn default() -> Self {
        MergeState {
            gathered: Arc::default(),
            counted: Arc::default(),
            after: Arc::default(),
            every: MERGE_EVERY,
            step: MERGE_STEP,
        }
    }
}

/// The lock, also when a thread panicked holding it: what it guards is a position to resume
/// from, valid whatever happened.
fn lock(m: &Mutex<Option<Key>>) -> std::sync::MutexGuard<'_, Option<Key>> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
