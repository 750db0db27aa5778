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

use std::sync::atomic::Ordering;

use super::{Dialect, Store, StoreError};

/// New entries gathered before they are merged into the large run. Smaller merges more
/// often (each rewrites the large run's pages); larger makes the small run's pages many.
pub const MERGE_EVERY: i64 = 50_000;

/// The orders of one buyer in one sale (`?` the sale, then the buyer) that are live, with
/// the order's columns as `o.`: on SQLite through the buyer index's runs.
pub(super) const SQLITE_LIVE_OF_BUYER: &str = "buyer_orders_all b CROSS JOIN orders o \
     ON o.id = b.order_id WHERE b.sale_id = ? AND b.user_id = ? \
     AND o.status IN ('pending_payment', 'paid')";

/// [`SQLITE_LIVE_OF_BUYER`] on the other backends: `orders_by_sale_user`.
pub(super) const LIVE_OF_BUYER: &str = "orders o WHERE o.sale_id = ? AND o.user_id = ? \
     AND o.status IN ('pending_payment', 'paid')";

impl Store {
    /// The FROM and WHERE of one buyer's live orders in one sale (see
    /// [`SQLITE_LIVE_OF_BUYER`]).
    pub(super) fn live_of_buyer(&self) -> &'static str {
        if self.dialect == Dialect::Sqlite {
            SQLITE_LIVE_OF_BUYER
        } else {
            LIVE_OF_BUYER
        }
    }

    /// Adds the entries of orders just inserted in this transaction, as (sale, buyer,
    /// order): SQLite's buyer index; nothing elsewhere, whose index on `orders` does it.
    /// After the commit, [`Store::buyers_indexed`] counts them towards a merge.
    pub(super) async fn index_buyers(
        &self,
        conn: &mut sqlx::AnyConnection,
        entries: &[(i64, i64, i64)],
    ) -> Result<(), StoreError> {
        if self.dialect != Dialect::Sqlite {
            return Ok(());
        }
        for chunk in self.statement_chunks(entries, 300) {
            // `OR IGNORE` for the reason the orders' insert has it: no statement journal. An
            // entry can only clash with itself: the order's id is in it, and the order
            // was not in SQL before this transaction.
            let q = format!(
                "INSERT OR IGNORE INTO buyer_orders_new (sale_id, user_id, order_id) VALUES {}",
                vec!["(?, ?, ?)"; chunk.len()].join(",")
            );
            let mut query = sqlx::query(&q).persistent(self.keeps_shape(chunk.len(), 300));
            for (sale_id, user_id, order_id) in chunk {
                query = query.bind(*sale_id).bind(*user_id).bind(*order_id);
            }
            query.execute(&mut *conn).await?;
        }
        Ok(())
    }

    /// Counts `n` entries committed to the small run and merges it when `MERGE_EVERY` have
    /// gathered. A failed merge is told and left for the next: the entries stay readable
    /// in the small run. Counted since this process started: after a restart the small run
    /// may hold up to twice `MERGE_EVERY` before its merge.
    pub(super) async fn buyers_indexed(&self, n: usize) {
        if self.dialect != Dialect::Sqlite || n == 0 {
            return;
        }
        let gathered = self.new_buyers.fetch_add(n as i64, Ordering::Relaxed) + n as i64;
        if gathered < self.merge_buyers_every {
            return;
        }
        if let Err(e) = self.merge_new_buyers().await {
            tracing::warn!(error = %e, "merging new buyers' index entries failed; will retry");
        }
    }

    /// Moves the small run's entries into the large one, in key order, in one transaction;
    /// returns how many moved. Nothing on PostgreSQL and MySQL.
    pub async fn merge_new_buyers(&self) -> Result<u64, StoreError> {
        if self.dialect != Dialect::Sqlite {
            return Ok(0);
        }
        let moved = self
            .in_write_tx(|mut conn| async move {
                let result = async {
                    // `OR IGNORE`: no statement journal, which would copy each page of the
                    // large run this touches. An entry already there is this same entry.
                    let moved = sqlx::query(
                        "INSERT OR IGNORE INTO buyer_orders (sale_id, user_id, order_id) \
                         SELECT sale_id, user_id, order_id FROM buyer_orders_new \
                         ORDER BY sale_id, user_id, order_id",
                    )
                    .execute(&mut *conn)
                    .await?
                    .rows_affected();
                    sqlx::query("DELETE FROM buyer_orders_new")
                        .execute(&mut *conn)
                        .await?;
                    Ok::<u64, StoreError>(moved)
                }
                .await;
                (conn, result)
            })
            .await?;
        // Less what moved, not zero: entries committed while it ran count towards the next.
        let _ = self
            .new_buyers
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some((n - moved as i64).max(0))
            });
        Ok(moved)
    }

    /// Merges after every `n` new entries instead of [`MERGE_EVERY`] (tests).
    pub fn with_buyers_merged_every(mut self, n: i64) -> Self {
        self.merge_buyers_every = n.max(1);
        self
    }
}
