//! The figures the audit compares (see `schema::COUNTERS`), kept on each sale's row by the
//! transaction that changes them, so that an audit round reads one row per sale however many
//! orders it holds. Every transaction that moves one of them locks the sale's row first, so
//! that their reads of the orders see each other's. A recount corrects them (the audit's
//! slow check and every explicit reconcile) and is counted: a counter that disagrees with
//! its recount is a bug, or a hand edit of SQL.

use std::sync::atomic::{AtomicU64, Ordering};

use sqlx::Row;

use super::journal::SqlAccount;
use super::{Dialect, Store, StoreError};

/// Counters found to disagree with their recount, and corrected.
static CORRECTED: AtomicU64 = AtomicU64::new(0);

/// One more sale whose kept figures a recount corrected.
pub(super) fn count_correction() {
    CORRECTED.fetch_add(1, Ordering::Relaxed);
}

pub fn render(out: &mut String) {
    crate::metrics::render_counter(
        "seckill_reconcile_counters_corrected_total",
        "Sales whose kept figures (live units and buyers, returns owed, units in transit, journal sum) disagreed with a recount and were corrected.",
        CORRECTED.load(Ordering::Relaxed),
        out,
    );
}

/// Changes to a sale's counters, applied in the caller's transaction.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bump {
    pub live_units: i64,
    pub live_buyers: i64,
    pub returns_owed_orders: i64,
    pub returns_owed_units: i64,
    pub units_in_transit: i64,
}

impl Bump {
    /// The SQL that applies it (`live_units = live_units + ?, ...`, five binds in order).
    pub(crate) const SET: &'static str = "live_units = live_units + ?, \
         live_buyers = live_buyers + ?, returns_owed_orders = returns_owed_orders + ?, \
         returns_owed_units = returns_owed_units + ?, units_in_transit = units_in_transit + ?";

    fn is_zero(&self) -> bool {
        *self == Bump::default()
    }

    /// Binds its five values, in the order of `SET`.
    pub(crate) fn bind<'q>(
        &self,
        query: sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>>,
    ) -> sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>> {
        query
            .bind(self.live_units)
            .bind(self.live_buyers)
            .bind(self.returns_owed_orders)
            .bind(self.returns_owed_units)
            .bind(self.units_in_transit)
    }
}

impl Store {
    /// Applies `bump` to the sale's counters in the caller's transaction.
    pub(crate) async fn bump_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
        bump: Bump,
    ) -> Result<(), StoreError> {
        if bump.is_zero() {
            return Ok(());
        }
        let q = self.sql(&format!("UPDATE sales SET {} WHERE id = ?", Bump::SET));
        bump.bind(sqlx::query(&q))
            .bind(sale_id)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    /// Units `user_id` holds in the sale's live orders, as the latest commits have them
    /// (a locking read on MySQL, whose plain reads come from an older snapshot).
    pub(crate) async fn live_units_of_buyer(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
        user_id: i64,
    ) -> Result<i64, StoreError> {
        let q = format!(
            "{}{}",
            self.live_units_of_buyer_query(),
            if self.dialect == Dialect::MySql {
                " FOR UPDATE"
            } else {
                ""
            }
        );
        Ok(sqlx::query(&self.sql(&q))
            .bind(sale_id)
            .bind(user_id)
            .fetch_one(&mut *conn)
            .await?
            .try_get(0)?)
    }

    /// Sets the sale's counters and tallies to their recount, under its row lock; the
    /// recount. Reads every row of the sale under the lock: only after a recount found
    /// them wrong.
    pub(super) async fn correct_counters(&self, sale_id: i64) -> Result<SqlAccount, StoreError> {
        self.in_write_tx(|mut conn| async move {
            let done = async {
                let lock = self.for_update();
                sqlx::query(&self.sql(&format!("SELECT id FROM sales WHERE id = ?{lock}")))
                    .bind(sale_id)
                    .fetch_one(&mut *conn)
                    .await?;
                let counted = self.recount_in(&mut conn, sale_id).await?;
                let set = super::schema::recounted_counters("?");
                let q = self.sql(&format!("UPDATE sales SET {set} WHERE id = ?"));
                // One bind per counter's recount, and the row's id.
                let mut query = sqlx::query(&q).persistent(false);
                for _ in 0..=super::schema::COUNTERS.len() {
                    query = query.bind(sale_id);
                }
                query.execute(&mut *conn).await?;
                self.recount_tallies_in(&mut conn, sale_id).await?;
                Ok(counted)
            }
            .await;
            (conn, done)
        })
        .await
    }

    /// The sale's account from its counters: one row (None for an unknown sale).
    pub(crate) async fn counted_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
    ) -> Result<Option<SqlAccount>, StoreError> {
        let row = sqlx::query(&self.sql(&format!(
            "SELECT stock, segments, {} FROM sales WHERE id = ?",
            super::schema::COUNTERS.join(", ")
        )))
        .bind(sale_id)
        .fetch_optional(&mut *conn)
        .await?;
        Ok(row.map(|row| account_from_row(&row)).transpose()?)
    }

    /// Replaces the sale's tallies with their count from its rows, in the caller's
    /// transaction (which holds the sale's row lock).
    async fn recount_tallies_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
    ) -> Result<(), StoreError> {
        sqlx::query(&self.sql("DELETE FROM sale_tallies WHERE sale_id = ?"))
            .bind(sale_id)
            .execute(&mut *conn)
            .await?;
        for fill in super::schema::tally_backfill(self.dialect, "?") {
            sqlx::query(&self.sql(&fill))
                .bind(sale_id)
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }

    /// The accounts of these sales from their counters, by sale.
    pub(crate) async fn counted_many_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_ids: &[i64],
    ) -> Result<Vec<(i64, SqlAccount)>, StoreError> {
        if sale_ids.is_empty() {
            return Ok(Vec::new());
        }
        let q = self.sql(&format!(
            "SELECT stock, segments, {}, id FROM sales WHERE id IN ({})",
            super::schema::COUNTERS.join(", "),
            Self::placeholders(sale_ids.len())
        ));
        // One statement shape per number of sales: not worth a prepared statement each.
        let mut query = sqlx::query(&q).persistent(false);
        for id in sale_ids {
            query = query.bind(*id);
        }
        let id_column = 2 + super::schema::COUNTERS.len();
        query
            .fetch_all(&mut *conn)
            .await?
            .iter()
            .map(|row| Ok((row.try_get(id_column)?, account_from_row(row)?)))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(StoreError::from)
    }

    /// The sale's account counted from its orders, returns, moves and journal.
    async fn recount_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
    ) -> Result<SqlAccount, StoreError> {
        let live = "sale_id = ? AND status IN ('pending_payment', 'paid')";
        let owed = "sale_id = ? AND gate_done_at IS NULL";
        let q = self.sql(&format!(
            "SELECT s.stock, s.segments, \
             (SELECT {units} FROM orders WHERE {live}), \
             (SELECT COUNT(DISTINCT user_id) FROM orders WHERE {live}), \
             (SELECT COUNT(*) FROM stock_returns WHERE {owed}), \
             (SELECT {units} FROM stock_returns WHERE {owed}), \
             (SELECT {units} FROM segment_moves WHERE sale_id = ? AND state = 'taken'), \
             (SELECT {delta} FROM stock_journal WHERE sale_id = ?) \
             FROM sales s WHERE s.id = ?",
            units = self.sum_int("quantity"),
            delta = self.sum_int("delta"),
        ));
        let mut query = sqlx::query(&q);
        for _ in 0..7 {
            query = query.bind(sale_id);
        }
        let row = query.fetch_one(&mut *conn).await?;
        Ok(account_from_row(&row)?)
    }
}

fn account_from_row(r: &sqlx::any::AnyRow) -> Result<SqlAccount, sqlx::Error> {
    Ok(SqlAccount {
        stock: r.try_get(0)?,
        segments: r.try_get(1)?,
        live_units: r.try_get(2)?,
        live_buyers: r.try_get(3)?,
        returns_owed_orders: r.try_get(4)?,
        returns_owed_units: r.try_get(5)?,
        units_in_transit: r.try_get(6)?,
        journal_sum: r.try_get(7)?,
    })
}
