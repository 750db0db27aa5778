//! The stock journal: one row per movement of a sale's stock, with its cause and order
//! (a writer's batch: one row per sale, its orders counted in the detail),
//! written inside the transaction that moves `sales.stock`, so that a sale's rows always
//! sum to its stock (a movement without its row, or a row without its movement, cannot
//! commit). Rows with no delta keep the trail of what happened to the gate beside SQL:
//! loaded, units handed back, a repair by whom and why. Nothing here moves stock itself.

use sqlx::Row;

use super::{Dialect, Store, StoreError};

/// Why a sale's stock moved (or, with no delta, what happened to its gate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The stock a sale had when the journal began (databases older than the journal).
    OpeningBalance,
    /// A sale created with its initial stock.
    Created,
    /// A draft's stock changed.
    Edited,
    /// A draft deleted: its stock leaves with it.
    Deleted,
    /// A writer batch's orders of one sale, written to SQL: one row per sale and batch,
    /// delta minus their units, detail "N orders" ("1 order"), no order id.
    Written,
    /// An order accepted and written at once by a SQL gate.
    Accepted,
    /// An order cancelled by its buyer: its units are on sale again.
    Cancelled,
    /// An order not paid in time.
    Expired,
    /// A cancelled or expired order's units handed back to the gate (no delta: SQL counted
    /// them at the cancellation).
    ReturnedToGate,
    /// Units taken from one segment of a sale for another (the sale's total is unchanged).
    MovedOut,
    MovedIn,
    /// The gate loaded (or rebuilt) from SQL (no delta).
    Loaded,
    /// The gate brought back to SQL's account by an operator (no delta).
    Repaired,
}

impl Cause {
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::OpeningBalance => "opening_balance",
            Cause::Created => "created",
            Cause::Edited => "edited",
            Cause::Deleted => "deleted",
            Cause::Written => "written",
            Cause::Accepted => "accepted",
            Cause::Cancelled => "cancelled",
            Cause::Expired => "expired",
            Cause::ReturnedToGate => "returned_to_gate",
            Cause::MovedOut => "moved_out",
            Cause::MovedIn => "moved_in",
            Cause::Loaded => "loaded",
            Cause::Repaired => "repaired",
        }
    }
}

/// One row of the journal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub id: i64,
    pub sale_id: i64,
    pub segment: Option<i64>,
    pub delta: i64,
    pub cause: String,
    pub order_id: Option<i64>,
    pub actor: Option<String>,
    pub detail: Option<String>,
    pub at: i64,
}

/// A row to add: everything but its id.
#[derive(Debug, Clone)]
pub struct Movement<'a> {
    pub sale_id: i64,
    pub segment: Option<i64>,
    pub delta: i64,
    pub cause: Cause,
    pub order_id: Option<i64>,
    pub actor: Option<&'a str>,
    pub detail: Option<&'a str>,
}

impl<'a> Movement<'a> {
    pub fn new(sale_id: i64, delta: i64, cause: Cause) -> Self {
        Movement {
            sale_id,
            segment: None,
            delta,
            cause,
            order_id: None,
            actor: None,
            detail: None,
        }
    }

    pub fn order(mut self, order_id: i64) -> Self {
        self.order_id = Some(order_id);
        self
    }

    pub fn segment(mut self, segment: i64) -> Self {
        self.segment = Some(segment);
        self
    }

    pub fn by(mut self, actor: &'a str, detail: &'a str) -> Self {
        self.actor = Some(actor);
        self.detail = Some(detail);
        self
    }
}

const COLS: &str = "sale_id, segment, delta, cause, order_id, actor, detail, at";

/// The migration's table, per dialect (an id that counts up, in commit order per sale).
pub(super) fn table(d: Dialect, int: &str, tail: &str) -> String {
    let id = match d {
        Dialect::Sqlite => "id INTEGER PRIMARY KEY AUTOINCREMENT",
        Dialect::Postgres => "id BIGSERIAL PRIMARY KEY",
        Dialect::MySql => "id BIGINT AUTO_INCREMENT PRIMARY KEY",
    };
    format!(
        "CREATE TABLE IF NOT EXISTS stock_journal (
            {id},
            sale_id {int} NOT NULL,
            segment {int},
            delta {int} NOT NULL,
            cause VARCHAR(24) NOT NULL,
            order_id {int},
            actor VARCHAR(64),
            detail VARCHAR(300),
            at {int} NOT NULL
        ){tail}"
    )
}

impl Store {
    /// Adds rows inside the caller's transaction (the one that moves the stock), and their
    /// deltas to each sale's `journal_sum` counter.
    pub(crate) async fn journal_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        rows: &[Movement<'_>],
        at: i64,
    ) -> Result<(), StoreError> {
        self.journal_rows_in(conn, rows, at).await?;
        let mut sums: Vec<(i64, i64)> = Vec::new();
        for m in rows.iter().filter(|m| m.delta != 0) {
            match sums.iter_mut().find(|(sale, _)| *sale == m.sale_id) {
                Some((_, sum)) => *sum += m.delta,
                None => sums.push((m.sale_id, m.delta)),
            }
        }
        for (sale_id, sum) in sums.into_iter().filter(|(_, sum)| *sum != 0) {
            sqlx::query(&self.sql("UPDATE sales SET journal_sum = journal_sum + ? WHERE id = ?"))
                .bind(sum)
                .bind(sale_id)
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }

    /// Adds rows only: for a caller that moves `journal_sum` in its own update of the sale.
    pub(crate) async fn journal_rows_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        rows: &[Movement<'_>],
        at: i64,
    ) -> Result<(), StoreError> {
        let plain = rows.iter().all(|m| m.actor.is_none() && m.detail.is_none());
        if self.dialect == Dialect::Postgres && plain && !rows.is_empty() {
            return self.journal_rows_pg(conn, rows, at).await;
        }
        for chunk in self.statement_chunks(rows, 400) {
            let values = vec!["(?, ?, ?, ?, ?, ?, ?, ?)"; chunk.len()].join(",");
            let q = self.sql(&format!(
                "INSERT INTO stock_journal ({COLS}) VALUES {values}"
            ));
            let mut query = sqlx::query(&q).persistent(self.keeps_shape(chunk.len(), 400));
            for m in chunk {
                query = query
                    .bind(m.sale_id)
                    .bind(m.segment)
                    .bind(m.delta)
                    .bind(m.cause.as_str())
                    .bind(m.order_id)
                    .bind(m.actor.map(|a| a.chars().take(64).collect::<String>()))
                    .bind(m.detail.map(|d| d.chars().take(300).collect::<String>()))
                    .bind(at);
            }
            query.execute(&mut *conn).await?;
        }
        Ok(())
    }

    /// Rows without an actor or detail (expiries, returns handed back: a row per order) in one
    /// statement of one shape, columns as arrays (see `store::pg_array`).
    async fn journal_rows_pg(
        &self,
        conn: &mut sqlx::AnyConnection,
        rows: &[Movement<'_>],
        at: i64,
    ) -> Result<(), StoreError> {
        let ints = |f: &dyn Fn(&Movement) -> i64| super::pg_array(rows.iter().map(f));
        let nullable = |f: &dyn Fn(&Movement) -> Option<i64>| {
            super::pg_array(
                rows.iter()
                    .map(|m| f(m).map_or_else(|| "NULL".to_string(), |v| v.to_string())),
            )
        };
        let q = "INSERT INTO stock_journal (sale_id, segment, delta, cause, order_id, at) \
                 SELECT t.sale_id, t.segment, t.delta, t.cause, t.order_id, $1 FROM unnest(\
                 CAST(CAST($2 AS TEXT) AS BIGINT[]), CAST(CAST($3 AS TEXT) AS BIGINT[]), \
                 CAST(CAST($4 AS TEXT) AS BIGINT[]), CAST(CAST($5 AS TEXT) AS TEXT[]), \
                 CAST(CAST($6 AS TEXT) AS BIGINT[])) WITH ORDINALITY \
                 AS t(sale_id, segment, delta, cause, order_id, ord) ORDER BY t.ord";
        sqlx::query(q)
            .bind(at)
            .bind(ints(&|m| m.sale_id))
            .bind(nullable(&|m| m.segment))
            .bind(ints(&|m| m.delta))
            // Causes are lower-case words: safe in an array literal as they are.
            .bind(super::pg_array(rows.iter().map(|m| m.cause.as_str())))
            .bind(nullable(&|m| m.order_id))
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    /// Adds rows in a transaction of their own: only for rows with no delta (the gate's
    /// trail), which move no stock.
    pub async fn journal_note(&self, rows: &[Movement<'_>]) -> Result<(), StoreError> {
        debug_assert!(rows.iter().all(|m| m.delta == 0));
        self.in_write_tx(|mut conn| async move {
            let done = self.journal_in(&mut conn, rows, self.now_ms()).await;
            (conn, done)
        })
        .await
    }

    /// A sale's rows after `after_id`, oldest first, at most `limit`.
    pub async fn journal(
        &self,
        sale_id: i64,
        after_id: i64,
        limit: i64,
    ) -> Result<Vec<Entry>, StoreError> {
        let q = format!(
            "SELECT id, {COLS} FROM stock_journal WHERE sale_id = ? AND id > ? ORDER BY id LIMIT ?"
        );
        self.keyset_rows(&q, &[sale_id, after_id, limit], entry_from_row)
            .await
    }

    /// (sum of a sale's deltas, the sale's stock), read in one statement.
    pub async fn journal_balance(&self, sale_id: i64) -> Result<(i64, Option<i64>), StoreError> {
        let q = self.sql(&format!(
            "SELECT (SELECT {} FROM stock_journal WHERE sale_id = ?), \
             (SELECT stock FROM sales WHERE id = ?)",
            self.sum_int("delta")
        ));
        let row = sqlx::query(&q)
            .bind(sale_id)
            .bind(sale_id)
            .fetch_one(&self.pool)
            .await?;
        Ok((row.try_get(0)?, row.try_get(1)?))
    }
}

/// SQL's account of a sale, for reconciliation with its gate (read in one statement).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SqlAccount {
    pub stock: i64,
    pub segments: i64,
    /// Units and distinct buyers of live orders (pending payment or paid).
    pub live_units: i64,
    pub live_buyers: i64,
    /// Cancelled or expired orders whose units SQL counts back and the gate has not
    /// taken back yet.
    pub returns_owed_orders: i64,
    pub returns_owed_units: i64,
    /// Units taken out of one segment and not yet given to another.
    pub units_in_transit: i64,
    pub journal_sum: i64,
}

impl Store {
    /// Units per buyer of the sale's cancelled or expired orders the gate has not taken
    /// back yet (the gate still counts them for the buyer).
    pub async fn returns_owed_by_buyer(&self, sale_id: i64) -> Result<Vec<(i64, i64)>, StoreError> {
        self.units_by_buyer(
            "stock_returns WHERE sale_id = ? AND gate_done_at IS NULL",
            sale_id,
        )
        .await
    }

    /// SQL's account of the sale from the counters on its row (one row, whatever the sale
    /// holds; see `store::counters`), or None for an unknown sale.
    pub async fn sql_account(&self, sale_id: i64) -> Result<Option<SqlAccount>, StoreError> {
        let mut conn = self.pool.acquire().await?;
        self.counted_in(&mut conn, sale_id).await
    }

    /// [`Store::sql_account`] of many sales at once: one query per 500 of them.
    pub async fn sql_accounts(
        &self,
        sale_ids: &[i64],
    ) -> Result<std::collections::HashMap<i64, SqlAccount>, StoreError> {
        let mut accounts = std::collections::HashMap::new();
        let mut conn = self.pool.acquire().await?;
        for chunk in sale_ids.chunks(500) {
            for (id, account) in self.counted_many_in(&mut conn, chunk).await? {
                accounts.insert(id, account);
            }
        }
        Ok(accounts)
    }
}

fn entry_from_row(r: &sqlx::any::AnyRow) -> Result<Entry, sqlx::Error> {
    Ok(Entry {
        id: r.try_get(0)?,
        sale_id: r.try_get(1)?,
        segment: r.try_get(2)?,
        delta: r.try_get(3)?,
        cause: r.try_get(4)?,
        order_id: r.try_get(5)?,
        actor: r.try_get(6)?,
        detail: r.try_get(7)?,
        at: r.try_get(8)?,
    })
}
