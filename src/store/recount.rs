//! The full recount of a sale: every figure its transactions keep (the counters on its
//! row, its tallies) counted again from its rows, in one snapshot, a chunk of buyers at a
//! time, with a pause after each chunk so that a recount beside a live sale takes a bounded
//! share of the database. It is what the explicit reconcile, the recount job and the
//! audit's slow check read; never a request's, never every round. A figure that disagrees
//! is a bug or a hand edit of SQL: corrected under the sale's row lock, logged and counted.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use sqlx::Row;

use super::journal::SqlAccount;
use super::tallies::{PaymentStatus, SaleTallies, Tally};
use super::{Dialect, Store, StoreError};
use crate::model::OrderStatus;

/// How a recount walks the rows.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    /// Buyers (or journal rows) read per query (on SQLite, buyers within this many entries of
    /// each run of the buyer index: see `Store::recount_paced`).
    pub chunk: i64,
    /// The share of its time a recount spends reading (1: no pause between chunks).
    pub share: f64,
}

impl Pace {
    /// An operator waiting for the answer.
    pub const FULL: Pace = Pace {
        chunk: 20_000,
        share: 1.0,
    };
    /// Beside a live sale: a fifth of the time reading, the rest left to the sale.
    pub const BACKGROUND: Pace = Pace {
        chunk: 5_000,
        share: 0.2,
    };

    /// The pause after a chunk that took `took`.
    fn pause_after(&self, took: Duration) -> Duration {
        if self.share >= 1.0 {
            return Duration::ZERO;
        }
        took.mul_f64((1.0 - self.share) / self.share.max(0.01))
    }
}

/// What a recount found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recount {
    /// The figures as the transactions kept them, and as counted, in one snapshot.
    pub kept: SqlAccount,
    pub counted: SqlAccount,
    pub kept_tallies: SaleTallies,
    pub counted_tallies: SaleTallies,
    /// (user, live units) of every buyer holding any, when there are at most `cap` of them.
    pub buyers: Option<Vec<(i64, i64)>>,
    /// Orders read.
    pub orders: i64,
    /// Whether the kept figures disagreed and were set to the count.
    pub corrected: bool,
}

impl Recount {
    pub fn agrees(&self) -> bool {
        self.kept == self.counted
            && self
                .kept_tallies
                .differences(&self.counted_tallies)
                .is_empty()
    }
}

/// Figures gathered chunk by chunk.
#[derive(Default)]
struct Counting {
    live_units: i64,
    live_buyers: i64,
    tallies: BTreeMap<Tally, i64>,
    buyers: Option<Vec<(i64, i64)>>,
    orders: i64,
}

impl Store {
    /// Counts every figure of the sale again (see the module's doc), walking its buyers
    /// `pace.chunk` at a time and telling `progress` the orders read so far. `None` for an
    /// unknown sale.
    pub async fn recount_paced(
        &self,
        sale_id: i64,
        pace: Pace,
        cap: usize,
        progress: &(dyn Fn(i64) + Send + Sync),
    ) -> Result<Option<Recount>, StoreError> {
        let snapshot = match self.dialect {
            Dialect::Postgres => "BEGIN ISOLATION LEVEL REPEATABLE READ",
            Dialect::MySql => "START TRANSACTION WITH CONSISTENT SNAPSHOT",
            Dialect::Sqlite => "BEGIN",
        };
        let mut conn = self.begin_with(snapshot).await?;
        let read = self
            .recount_in_snapshot(&mut conn, sale_id, pace, cap, progress)
            .await;
        // Only read: whatever the outcome, nothing to keep.
        let _ = Self::finish(conn, false).await;
        let Some(mut recount) = read? else {
            return Ok(None);
        };
        if !recount.agrees() {
            tracing::error!(
                sale = sale_id,
                kept = ?recount.kept,
                counted = ?recount.counted,
                tallies = ?recount.kept_tallies.differences(&recount.counted_tallies),
                "a sale's kept figures disagreed with a recount: corrected (a bug, or SQL edited by hand)"
            );
            self.correct_counters(sale_id).await?;
            super::counters::count_correction();
            recount.corrected = true;
        }
        Ok(Some(recount))
    }

    async fn recount_in_snapshot(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
        pace: Pace,
        cap: usize,
        progress: &(dyn Fn(i64) + Send + Sync),
    ) -> Result<Option<Recount>, StoreError> {
        let Some(kept) = self.counted_in(conn, sale_id).await? else {
            return Ok(None);
        };
        let kept_tallies = self.tallies_in(conn, sale_id).await?;
        let mut counting = Counting {
            buyers: Some(Vec::new()),
            ..Counting::default()
        };
        let mut after_user = i64::MIN;
        loop {
            let started = Instant::now();
            let last = self
                .count_buyers_chunk(conn, sale_id, after_user, pace.chunk, cap, &mut counting)
                .await?;
            progress(counting.orders);
            let Some(last) = last else { break };
            self.count_payments_of_users(conn, sale_id, after_user, last, &mut counting)
                .await?;
            after_user = last;
            self.clock()
                .sleep(pace.pause_after(started.elapsed()))
                .await;
        }
        let journal_sum = self.journal_sum_paced(conn, sale_id, pace).await?;
        let (owed_orders, owed_units) = self.returns_owed_in(conn, sale_id).await?;
        let in_transit: i64 = sqlx::query(&self.sql(&format!(
            "SELECT {} FROM segment_moves WHERE sale_id = ? AND state = 'taken'",
            self.sum_int("quantity")
        )))
        .bind(sale_id)
        .fetch_one(&mut *conn)
        .await?
        .try_get(0)?;
        let counted = SqlAccount {
            stock: kept.stock,
            segments: kept.segments,
            live_units: counting.live_units,
            live_buyers: counting.live_buyers,
            returns_owed_orders: owed_orders,
            returns_owed_units: owed_units,
            units_in_transit: in_transit,
            journal_sum,
        };
        let counted_tallies = SaleTallies(
            counting
                .tallies
                .into_iter()
                .filter(|(_, n)| *n != 0)
                .collect(),
        );
        // Rows a tally once had and that went back to 0 are no difference.
        let kept_tallies = SaleTallies(
            kept_tallies
                .0
                .into_iter()
                .filter(|(_, n)| *n != 0)
                .collect(),
        );
        Ok(Some(Recount {
            kept,
            counted,
            kept_tallies,
            counted_tallies,
            buyers: counting.buyers,
            orders: counting.orders,
            corrected: false,
        }))
    }

    /// Counts the orders of the next `chunk` buyers (by user id, after `after_user`; on
    /// SQLite, of the buyers within the next `chunk` entries of each run of the buyer index,
    /// up to twice as many); the last buyer counted, `None` when there were none left.
    async fn count_buyers_chunk(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
        after_user: i64,
        chunk: i64,
        cap: usize,
        counting: &mut Counting,
    ) -> Result<Option<i64>, StoreError> {
        let live = "status IN ('pending_payment', 'paid')";
        let count = |status: OrderStatus| {
            self.sum_int(&format!(
                "CASE WHEN status = '{}' THEN 1 ELSE 0 END",
                status.as_str()
            ))
        };
        let counted = [
            self.sum_int(&format!("CASE WHEN {live} THEN quantity ELSE 0 END")),
            count(OrderStatus::PendingPayment),
            count(OrderStatus::Paid),
            count(OrderStatus::Cancelled),
            count(OrderStatus::Expired),
        ]
        .join(", ");
        let rows = if self.dialect == Dialect::Sqlite {
            // By the buyer index's runs (see `buyers`), which a GROUP BY cannot walk as one:
            // the buyers up to the first run's `chunk`-th entry, each with all its orders.
            let upto = self
                .sqlite_buyers_bound(conn, sale_id, after_user, chunk)
                .await?;
            let q = format!(
                "SELECT b.user_id, {counted} FROM buyer_orders_all b CROSS JOIN orders o \
                 ON o.id = b.order_id WHERE b.sale_id = ? AND b.user_id > ? AND b.user_id <= ? \
                 GROUP BY b.user_id ORDER BY b.user_id"
            );
            sqlx::query(&q)
                .bind(sale_id)
                .bind(after_user)
                .bind(upto)
                .fetch_all(&mut *conn)
                .await?
        } else {
            let q = format!(
                "SELECT user_id, {counted} FROM orders WHERE sale_id = ? AND user_id > ? \
                 GROUP BY user_id ORDER BY user_id LIMIT ?"
            );
            sqlx::query(&self.sql(&q))
                .bind(sale_id)
                .bind(after_user)
                .bind(chunk)
                .fetch_all(&mut *conn)
                .await?
        };
        let mut last = None;
        for r in &rows {
            let user: i64 = r.try_get(0)?;
            let held: i64 = r.try_get(1)?;
            last = Some(user);
            let statuses = [
                OrderStatus::PendingPayment,
                OrderStatus::Paid,
                OrderStatus::Cancelled,
                OrderStatus::Expired,
            ];
            for (i, status) in statuses.into_iter().enumerate() {
                let n: i64 = r.try_get(2 + i)?;
                counting.orders += n;
                *counting.tallies.entry(Tally::Orders(status)).or_default() += n;
            }
            if held > 0 {
                counting.live_units += held;
                counting.live_buyers += 1;
                *counting.tallies.entry(Tally::Holding(held)).or_default() += 1;
                if let Some(buyers) = &mut counting.buyers {
                    buyers.push((user, held));
                    if buyers.len() > cap {
                        counting.buyers = None;
                    }
                }
            }
        }
        Ok(last)
    }

    /// On SQLite, the highest buyer (after `after_user`) whose entries are all within the
    /// next `chunk` entries of each run of the buyer index: the lower of the runs' `chunk`-th
    /// entries, or every buyer left when neither run holds that many.
    async fn sqlite_buyers_bound(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
        after_user: i64,
        chunk: i64,
    ) -> Result<i64, StoreError> {
        let mut upto = i64::MAX;
        for run in ["buyer_orders", "buyer_orders_new"] {
            let q = format!(
                "SELECT MAX(user_id), COUNT(*) FROM (SELECT user_id FROM {run} \
                 WHERE sale_id = ? AND user_id > ? ORDER BY user_id LIMIT ?) entries"
            );
            let row = sqlx::query(&q)
                .bind(sale_id)
                .bind(after_user)
                .bind(chunk)
                .fetch_one(&mut *conn)
                .await?;
            let (last, entries): (Option<i64>, i64) = (row.try_get(0)?, row.try_get(1)?);
            if let Some(last) = last.filter(|_| entries >= chunk) {
                upto = upto.min(last);
            }
        }
        Ok(upto)
    }

    /// Counts the payment intents of the sale's buyers in (`after_user`, `last_user`].
    async fn count_payments_of_users(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
        after_user: i64,
        last_user: i64,
        counting: &mut Counting,
    ) -> Result<(), StoreError> {
        let q = if self.dialect == Dialect::Sqlite {
            "SELECT p.status, COUNT(*) FROM buyer_orders_all b CROSS JOIN payments p \
             ON p.order_id = b.order_id WHERE b.sale_id = ? AND b.user_id > ? AND b.user_id <= ? \
             GROUP BY p.status"
        } else {
            "SELECT p.status, COUNT(*) FROM payments p JOIN orders o ON o.id = p.order_id \
             WHERE o.sale_id = ? AND o.user_id > ? AND o.user_id <= ? GROUP BY p.status"
        };
        let rows = sqlx::query(&self.sql(q))
            .bind(sale_id)
            .bind(after_user)
            .bind(last_user)
            .fetch_all(&mut *conn)
            .await?;
        for r in &rows {
            let status: String = r.try_get(0)?;
            if let Some(status) = PaymentStatus::parse(&status) {
                *counting.tallies.entry(Tally::Payments(status)).or_default() +=
                    r.try_get::<i64, _>(1)?;
            }
        }
        Ok(())
    }

    /// The sum of the sale's journal, read `pace.chunk` rows at a time.
    async fn journal_sum_paced(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
        pace: Pace,
    ) -> Result<i64, StoreError> {
        let (mut sum, mut after) = (0i64, 0i64);
        loop {
            let started = Instant::now();
            let rows = sqlx::query(&self.sql(
                "SELECT id, delta FROM stock_journal WHERE sale_id = ? AND id > ? ORDER BY id LIMIT ?",
            ))
            .bind(sale_id)
            .bind(after)
            .bind(pace.chunk)
            .fetch_all(&mut *conn)
            .await?;
            for r in &rows {
                after = r.try_get(0)?;
                sum += r.try_get::<i64, _>(1)?;
            }
            if (rows.len() as i64) < pace.chunk {
                return Ok(sum);
            }
            self.clock()
                .sleep(pace.pause_after(started.elapsed()))
                .await;
        }
    }

    /// Returns SQL counted back and the gate has not taken yet: (orders, units).
    async fn returns_owed_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
    ) -> Result<(i64, i64), StoreError> {
        let row = sqlx::query(&self.sql(&format!(
            "SELECT COUNT(*), {} FROM stock_returns WHERE sale_id = ? AND gate_done_at IS NULL",
            self.sum_int("quantity")
        )))
        .bind(sale_id)
        .fetch_one(&mut *conn)
        .await?;
        Ok((row.try_get(0)?, row.try_get(1)?))
    }
}

/// A recount job of a sale, as kept in `recount_jobs` (see `reconcile::job`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecountJob {
    pub sale_id: i64,
    /// `running`, `done` or `failed`.
    pub state: String,
    pub started_at: i64,
    pub updated_at: i64,
    pub orders_read: i64,
    /// The orders the sale held when the job began (how far `orders_read` has to go).
    pub orders_total: i64,
    /// What it found (JSON), once done.
    pub outcome: Option<String>,
    pub error: Option<String>,
}

impl Store {
    /// Starts a recount job of the sale unless one is running (one that reported within
    /// `stale_ms` ago; a job whose process died stops reporting). True when started.
    pub async fn start_recount_job(
        &self,
        sale_id: i64,
        orders_total: i64,
        stale_ms: i64,
    ) -> Result<bool, StoreError> {
        let now = self.now_ms();
        let q = format!(
            "{} VALUES (?, 'running', ?, ?, 0, ?, NULL, NULL){}",
            self.insert_ignore(
                "recount_jobs (sale_id, state, started_at, updated_at, orders_read, orders_total, outcome, error)"
            ),
            self.on_conflict_nothing()
        );
        let inserted = sqlx::query(&self.sql(&q))
            .bind(sale_id)
            .bind(now)
            .bind(now)
            .bind(orders_total)
            .execute(&self.pool)
            .await?
            .rows_affected();
        if inserted == 1 {
            return Ok(true);
        }
        let restarted = sqlx::query(&self.sql(
            "UPDATE recount_jobs SET state = 'running', started_at = ?, updated_at = ?, \
             orders_read = 0, orders_total = ?, outcome = NULL, error = NULL \
             WHERE sale_id = ? AND (state <> 'running' OR updated_at < ?)",
        ))
        .bind(now)
        .bind(now)
        .bind(orders_total)
        .bind(sale_id)
        .bind(now - stale_ms)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(restarted == 1)
    }

    /// A running job read this many orders so far.
    pub async fn recount_job_progress(&self, sale_id: i64, read: i64) -> Result<(), StoreError> {
        sqlx::query(&self.sql(
            "UPDATE recount_jobs SET orders_read = ?, updated_at = ? WHERE sale_id = ? AND state = 'running'",
        ))
        .bind(read)
        .bind(self.now_ms())
        .bind(sale_id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// A job ended: `done` with its outcome, or `failed` with why.
    pub async fn finish_recount_job(
        &self,
        sale_id: i64,
        read: i64,
        outcome: Result<&str, &str>,
    ) -> Result<(), StoreError> {
        let (state, outcome, error) = match outcome {
            Ok(outcome) => ("done", Some(outcome), None),
            Err(error) => (
                "failed",
                None,
                Some(error.chars().take(500).collect::<String>()),
            ),
        };
        sqlx::query(&self.sql(
            "UPDATE recount_jobs SET state = ?, orders_read = ?, updated_at = ?, outcome = ?, error = ? \
             WHERE sale_id = ?",
        ))
        .bind(state)
        .bind(read)
        .bind(self.now_ms())
        .bind(outcome)
        .bind(error)
        .bind(sale_id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The sale's latest recount job, if it ever had one.
    pub async fn recount_job(&self, sale_id: i64) -> Result<Option<RecountJob>, StoreError> {
        let row = sqlx::query(&self.sql(
            "SELECT sale_id, state, started_at, updated_at, orders_read, orders_total, outcome, error \
             FROM recount_jobs WHERE sale_id = ?",
        ))
        .bind(sale_id)
        .fetch_optional(&self.pool)
        .await?;
        let Some(r) = row else { return Ok(None) };
        Ok(Some(RecountJob {
            sale_id: r.try_get(0)?,
            state: r.try_get(1)?,
            started_at: r.try_get(2)?,
            updated_at: r.try_get(3)?,
            orders_read: r.try_get(4)?,
            orders_total: r.try_get(5)?,
            outcome: r.try_get(6)?,
            error: r.try_get(7)?,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_background_pace_leaves_four_fifths_of_the_time() {
        let took = Duration::from_millis(10);
        assert_eq!(
            Pace::BACKGROUND.pause_after(took),
            Duration::from_millis(40)
        );
        assert_eq!(Pace::FULL.pause_after(took), Duration::ZERO);
    }
}
