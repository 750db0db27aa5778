//! SQL side of the order lifecycle: guarded transitions out of `pending_payment`, the
//! stock-return outbox, and payment intents. A transition is one transaction whose guard
//! (`WHERE status = 'pending_payment'`) lets exactly one of pay, cancel and expire win.

use sqlx::Row;

use std::collections::HashMap;

use super::journal::{Cause, Movement};
use super::{Dialect, Store, StoreError, WriteTx};
use crate::model::{Order, OrderStatus};

/// Whether the database gave up waiting for a lock (PostgreSQL's lock_timeout, MySQL's
/// innodb_lock_wait_timeout).
fn is_lock_timeout(e: &StoreError) -> bool {
    match e {
        StoreError::Db(sqlx::Error::Database(db)) => {
            db.code().as_deref() == Some("55P03") || db.message().contains("Lock wait timeout")
        }
        _ => false,
    }
}

/// A sale's state in SQL, as the gate is rebuilt from it (see [`Store::load_snapshot`]).
#[derive(Debug, Clone, Default)]
pub struct LoadSnapshot {
    pub stock: i64,
    /// Every cancelled or expired order: `stock` counts their units back.
    pub released: Vec<i64>,
    /// (user_id, units held in live orders).
    pub buyers: Vec<(i64, i64)>,
    /// Every order of the sale in SQL.
    pub counted: Vec<i64>,
    /// Moves between segments this snapshot's stock counts (segmented sales only).
    pub moves: Vec<(i64, super::moves::MoveMark)>,
}

/// Which part of a sale a snapshot is of: one segment of `segments` (0 of 1: all of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub segments: i64,
    pub segment: i64,
}

impl Part {
    pub const WHOLE: Part = Part {
        segments: 1,
        segment: 0,
    };

    fn holds(&self, user_id: i64) -> bool {
        crate::model::segments::segment_of(user_id, self.segments) == self.segment
    }
}

/// Attempts of a lifecycle transaction that keeps losing deadlocks before giving up.
const RETRIES: u32 = 5;

/// Errors that may go away if the same transaction is simply tried again.
trait Transient {
    fn is_transient(&self) -> bool;
}

impl Transient for StoreError {
    fn is_transient(&self) -> bool {
        StoreError::is_transient(self)
    }
}

impl Transient for TransitionError {
    fn is_transient(&self) -> bool {
        matches!(self, TransitionError::Store(e) if e.is_transient())
    }
}

/// Runs a transaction again, after a short backoff, while it loses deadlocks or
/// serialization races (InnoDB gap locks, PostgreSQL 40001), up to RETRIES times.
async fn retry_transient<T, E: Transient, Fut: std::future::Future<Output = Result<T, E>>>(
    mut attempt: impl FnMut() -> Fut,
) -> Result<T, E> {
    let mut tries = 0;
    loop {
        match attempt().await {
            Err(e) if e.is_transient() && tries < RETRIES => tries += 1,
            other => return other,
        }
        tokio::time::sleep(std::time::Duration::from_millis(5 << tries)).await;
    }
}

/// Where an order may go from `pending_payment`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Paid,
    Cancelled,
    Expired,
}

impl Outcome {
    pub fn status(self) -> OrderStatus {
        match self {
            Outcome::Paid => OrderStatus::Paid,
            Outcome::Cancelled => OrderStatus::Cancelled,
            Outcome::Expired => OrderStatus::Expired,
        }
    }

    fn returns_stock(self) -> bool {
        self != Outcome::Paid
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TransitionError {
    #[error("order {0} does not exist")]
    NoSuchOrder(i64),
    /// The order is not in a state this transition may leave (or the deadline decides).
    #[error("order is {from}; it cannot become {to}")]
    Illegal {
        from: &'static str,
        to: &'static str,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<sqlx::Error> for TransitionError {
    fn from(e: sqlx::Error) -> Self {
        TransitionError::Store(StoreError::Db(e))
    }
}

/// A unit of stock owed back to the gate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StockReturn {
    pub order_id: i64,
    pub sale_id: i64,
    pub user_id: i64,
    pub quantity: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payment {
    pub intent_id: i64,
    pub order_id: i64,
    pub user_id: i64,
    pub amount_cents: i64,
    pub status: String,
    pub created_at: i64,
}

/// How a provider's "paid" notification was settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PaymentSettlement {
    /// The order is paid.
    Paid,
    /// The same notification was settled before: nothing changed.
    Duplicate,
    /// The order had expired or been cancelled first: the money is owed back.
    RefundDue,
}

/// Returns not yet handed to the gate (the start of a query).
const PENDING_RETURNS: &str =
    "SELECT order_id, sale_id, user_id, quantity FROM stock_returns WHERE gate_done_at IS NULL";

fn returns_from_rows(rows: &[sqlx::any::AnyRow]) -> Result<Vec<StockReturn>, StoreError> {
    rows.iter()
        .map(|r| {
            Ok(StockReturn {
                order_id: r.try_get(0)?,
                sale_id: r.try_get(1)?,
                user_id: r.try_get(2)?,
                quantity: r.try_get(3)?,
            })
        })
        .collect()
}

impl Store {
    /// Moves a `pending_payment` order to `outcome` in one transaction; cancellation and
    /// expiry put the units back on `sales.stock` and into the gate outbox. `owner`, when
    /// given, must own the order. Payment must arrive before the deadline; expiry after it.
    /// A transaction that loses a deadlock (InnoDB gap locks) is tried again.
    pub async fn transition(
        &self,
        order_id: i64,
        owner: Option<i64>,
        outcome: Outcome,
        now: i64,
        detail: &str,
    ) -> Result<Order, TransitionError> {
        retry_transient(|| self.transition_once(order_id, owner, outcome, now, detail)).await
    }

    async fn transition_once(
        &self,
        order_id: i64,
        owner: Option<i64>,
        outcome: Outcome,
        now: i64,
        detail: &str,
    ) -> Result<Order, TransitionError> {
        let mut conn = self.begin_write().await?;
        let result = self
            .transition_in_tx(&mut conn, order_id, owner, outcome, now, detail)
            .await;
        Self::finish(conn, result.is_ok()).await?;
        result
    }

    async fn transition_in_tx(
        &self,
        conn: &mut sqlx::AnyConnection,
        order_id: i64,
        owner: Option<i64>,
        outcome: Outcome,
        now: i64,
        detail: &str,
    ) -> Result<Order, TransitionError> {
        let deadline_guard = match outcome {
            Outcome::Paid => " AND pay_deadline > ?",
            Outcome::Expired => " AND pay_deadline <= ?",
            Outcome::Cancelled => " AND ? = ?",
        };
        let q = format!(
            "UPDATE orders SET status = ?, updated_at = ? WHERE id = ? AND status = 'pending_payment'{deadline_guard}{}",
            if owner.is_some() { " AND user_id = ?" } else { "" }
        );
        let q = self.sql(&q);
        let mut update = sqlx::query(&q)
            .bind(outcome.status().as_str())
            .bind(now)
            .bind(order_id)
            .bind(now);
        if outcome == Outcome::Cancelled {
            update = update.bind(now);
        }
        if let Some(user) = owner {
            update = update.bind(user);
        }
        let changed = update.execute(&mut *conn).await?.rows_affected();
        let order = self.order_in(conn, order_id).await?;
        let order = match order {
            Some(o) if owner.is_none_or(|u| u == o.user_id) => o,
            _ => return Err(TransitionError::NoSuchOrder(order_id)),
        };
        if changed != 1 {
            let from = if order.status == OrderStatus::PendingPayment {
                "past its payment deadline"
            } else {
                order.status.as_str()
            };
            return Err(TransitionError::Illegal {
                from,
                to: outcome.status().as_str(),
            });
        }
        sqlx::query(
            &self
                .sql("INSERT INTO order_events (order_id, status, at, detail) VALUES (?, ?, ?, ?)"),
        )
        .bind(order_id)
        .bind(outcome.status().as_str())
        .bind(now)
        .bind(detail.chars().take(200).collect::<String>())
        .execute(&mut *conn)
        .await?;
        if outcome.returns_stock() {
            sqlx::query(
                &self.sql("UPDATE sales SET stock = stock + ?, updated_at = ? WHERE id = ?"),
            )
            .bind(order.quantity)
            .bind(now)
            .bind(order.sale_id)
            .execute(&mut *conn)
            .await?;
            sqlx::query(&self.sql(
                "INSERT INTO stock_returns (order_id, sale_id, user_id, quantity, reason, created_at, gate_done_at) \
                 VALUES (?, ?, ?, ?, ?, ?, NULL)",
            ))
            .bind(order_id)
            .bind(order.sale_id)
            .bind(order.user_id)
            .bind(order.quantity)
            .bind(outcome.status().as_str())
            .bind(now)
            .execute(&mut *conn)
            .await?;
            let cause = if outcome == Outcome::Cancelled {
                Cause::Cancelled
            } else {
                Cause::Expired
            };
            let back = Movement::new(order.sale_id, order.quantity, cause).order(order_id);
            self.journal_in(conn, &[back], now).await?;
        }
        Ok(order)
    }

    async fn order_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        id: i64,
    ) -> Result<Option<Order>, StoreError> {
        let q = format!("SELECT {} FROM orders WHERE id = ?", Self::ORDER_COLS);
        let row = sqlx::query(&self.sql(&q))
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?;
        Ok(match row {
            Some(r) => Some(Self::order_from_row(&r)?),
            None => None,
        })
    }

    /// The recorded transitions of an order after it was written: (status, at), in order.
    pub async fn order_events(&self, order_id: i64) -> Result<Vec<(String, i64)>, StoreError> {
        let rows = sqlx::query(
            &self.sql("SELECT status, at FROM order_events WHERE order_id = ? ORDER BY at"),
        )
        .bind(order_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| Ok((r.try_get::<String, _>(0)?, r.try_get::<i64, _>(1)?)))
            .collect()
    }

    /// Orders whose payment deadline has passed, oldest first.
    pub async fn due_for_expiry(&self, now: i64, limit: i64) -> Result<Vec<i64>, StoreError> {
        let rows = sqlx::query(&self.sql(
            "SELECT id FROM orders WHERE status = 'pending_payment' AND pay_deadline <= ? ORDER BY pay_deadline LIMIT ?",
        ))
        .bind(now)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| r.try_get::<i64, _>(0).map_err(Into::into))
            .collect()
    }

    /// Returns not yet taken back by the gate; `sale_id` narrows them to one sale.
    pub async fn pending_returns(
        &self,
        sale_id: Option<i64>,
        limit: i64,
    ) -> Result<Vec<StockReturn>, StoreError> {
        let Some(id) = sale_id else {
            return self.pending_returns_except(&[], limit).await;
        };
        let q = self.sql(&format!(
            "{PENDING_RETURNS} AND sale_id = ? ORDER BY order_id LIMIT ?"
        ));
        let rows = sqlx::query(&q)
            .bind(id)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        returns_from_rows(&rows)
    }

    /// The oldest returns not yet handed to the gate, except those of `skipped` sales (whose
    /// gate failed this pass: their returns must not hold up the others').
    pub async fn pending_returns_except(
        &self,
        skipped: &[i64],
        limit: i64,
    ) -> Result<Vec<StockReturn>, StoreError> {
        // Integers only, so the list is written into the statement safely.
        let except = if skipped.is_empty() {
            String::new()
        } else {
            let list: Vec<String> = skipped.iter().map(i64::to_string).collect();
            format!(" AND sale_id NOT IN ({})", list.join(","))
        };
        let q = self.sql(&format!(
            "{PENDING_RETURNS}{except} ORDER BY order_id LIMIT ?"
        ));
        let rows = sqlx::query(&q).bind(limit).fetch_all(&self.pool).await?;
        returns_from_rows(&rows)
    }

    pub async fn mark_returned(&self, order_id: i64, now: i64) -> Result<(), StoreError> {
        let mut conn = self.begin_write().await?;
        let done = async {
            let marked = sqlx::query(&self.sql(
                "UPDATE stock_returns SET gate_done_at = ? WHERE order_id = ? AND gate_done_at IS NULL",
            ))
            .bind(now)
            .bind(order_id)
            .execute(&mut *conn)
            .await?;
            if marked.rows_affected() == 0 {
                return Ok(());
            }
            let row = sqlx::query(&self.sql("SELECT sale_id FROM stock_returns WHERE order_id = ?"))
                .bind(order_id)
                .fetch_one(&mut *conn)
                .await?;
            let sale_id: i64 = row.try_get(0)?;
            let handed = Movement::new(sale_id, 0, Cause::ReturnedToGate).order(order_id);
            self.journal_in(&mut conn, &[handed], now).await
        }
        .await;
        Self::finish(conn, done.is_ok()).await?;
        done
    }

    /// What the gate is rebuilt from, read in one snapshot while the sale's row is locked
    /// (no order write or return of the sale can fall between its parts): the SQL stock,
    /// every cancelled or expired order (the stock counts their units back, whether or not
    /// their return reached a gate: a release of one later is a repeat), the units each
    /// buyer holds in live orders, and every order of the sale (the stock counts them all).
    ///
    /// On PostgreSQL and MySQL it first waits (up to `wait_for_writers`) until no order
    /// writer holds a batch read from Redis (the writer fence): a batch read before Redis
    /// lost its data is then in SQL, and in the snapshot. A writer stalled longer than that
    /// is not waited for; its orders reach the gate through `Gate::confirm_written`.
    pub async fn load_snapshot(
        &self,
        sale_id: i64,
        wait_for_writers: std::time::Duration,
    ) -> Result<LoadSnapshot, StoreError> {
        self.load_part_snapshot(sale_id, Part::WHOLE, wait_for_writers)
            .await
    }

    /// [`Store::load_snapshot`] of one segment of a segmented sale: its allocation (even
    /// share plus the moves that took effect) less its buyers' live units, and only its
    /// buyers and orders. Moves out of it still only planned are refused here, in the
    /// snapshot's transaction: the rebuilt segment never gives those units.
    pub async fn load_part_snapshot(
        &self,
        sale_id: i64,
        part: Part,
        wait_for_writers: std::time::Duration,
    ) -> Result<LoadSnapshot, StoreError> {
        if self.dialect != Dialect::Sqlite && !wait_for_writers.is_zero() {
            match self
                .load_snapshot_fenced(sale_id, part, wait_for_writers)
                .await
            {
                Err(e) if is_lock_timeout(&e) => {
                    tracing::warn!(
                        sale = sale_id,
                        waited_ms = wait_for_writers.as_millis() as u64,
                        "an order writer has held a batch this long (stalled?): rebuilding without it; its orders join the gate when it writes them"
                    );
                }
                other => return other,
            }
        }
        let mut conn = self.begin_write().await?;
        let read = self.load_snapshot_in_tx(&mut conn, sale_id, part).await;
        Self::finish(conn, read.is_ok()).await?;
        read
    }

    async fn load_snapshot_fenced(
        &self,
        sale_id: i64,
        part: Part,
        wait: std::time::Duration,
    ) -> Result<LoadSnapshot, StoreError> {
        let mut conn = self.begin_write().await?;
        let read = async {
            let secs = wait.as_secs().max(1);
            let timeout = match self.dialect {
                Dialect::Postgres => format!("SET LOCAL lock_timeout = '{secs}s'"),
                _ => format!("SET SESSION innodb_lock_wait_timeout = {secs}"),
            };
            sqlx::query(&timeout).execute(&mut *conn).await?;
            // PostgreSQL queues table locks first come, first served: writers arriving
            // after this request wait behind it (row locks would let sharers starve it).
            let exclusive = match self.dialect {
                Dialect::Postgres => "LOCK TABLE writer_fence IN EXCLUSIVE MODE",
                _ => "SELECT id FROM writer_fence WHERE id = 1 FOR UPDATE",
            };
            sqlx::query(exclusive).execute(&mut *conn).await?;
            self.load_snapshot_in_tx(&mut conn, sale_id, part).await
        }
        .await;
        match read {
            Ok(snapshot) => {
                Self::finish(conn, true).await?;
                Ok(snapshot)
            }
            Err(e) => {
                // The error that matters is the read's, not the rollback's.
                let _ = Self::finish(conn, false).await;
                Err(e)
            }
        }
    }

    /// Share-locks the writer fence for as long as the returned connection's transaction
    /// is open: an order writer holds it from before it reads a batch from Redis until
    /// the batch is in SQL. `None` on SQLite (no distributed deployment runs on it).
    pub async fn hold_writer_fence(&self) -> Result<Option<WriteTx>, StoreError> {
        let share = match self.dialect {
            Dialect::Sqlite => return Ok(None),
            Dialect::Postgres => "LOCK TABLE writer_fence IN ROW SHARE MODE",
            Dialect::MySql => "SELECT id FROM writer_fence WHERE id = 1 LOCK IN SHARE MODE",
        };
        let mut conn = self.begin_with("BEGIN").await?;
        if let Err(e) = sqlx::query(share).execute(&mut *conn).await {
            let _ = Self::finish(conn, false).await;
            return Err(e.into());
        }
        Ok(Some(conn))
    }

    /// Ends a hold of [`Store::hold_writer_fence`].
    pub async fn release_writer_fence(conn: Option<WriteTx>) -> Result<(), StoreError> {
        match conn {
            Some(conn) => Self::finish(conn, true).await,
            None => Ok(()),
        }
    }

    async fn load_snapshot_in_tx(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
        part: Part,
    ) -> Result<LoadSnapshot, StoreError> {
        let lock = match self.dialect {
            // BEGIN IMMEDIATE already holds SQLite's one write lock.
            Dialect::Sqlite => "SELECT stock, initial_stock FROM sales WHERE id = ?",
            _ => "SELECT stock, initial_stock FROM sales WHERE id = ? FOR UPDATE",
        };
        let row = sqlx::query(&self.sql(lock))
            .bind(sale_id)
            .fetch_optional(&mut *conn)
            .await?;
        let (stock, initial): (i64, i64) = match row {
            Some(r) => (r.try_get(0)?, r.try_get(1)?),
            None => return Err(StoreError::UnknownSale(sale_id)),
        };
        let rows = sqlx::query(
            &self.sql("SELECT id, user_id, quantity, status FROM orders WHERE sale_id = ?"),
        )
        .bind(sale_id)
        .fetch_all(&mut *conn)
        .await?;
        let mut held: HashMap<i64, i64> = HashMap::new();
        let mut counted = Vec::with_capacity(rows.len());
        let mut released = Vec::new();
        for r in &rows {
            let user: i64 = r.try_get(1)?;
            if !part.holds(user) {
                continue;
            }
            let id: i64 = r.try_get(0)?;
            counted.push(id);
            let status: String = r.try_get(3)?;
            if OrderStatus::LIVE.contains(&status.as_str()) {
                *held.entry(user).or_default() += r.try_get::<i64, _>(2)?;
            } else {
                // Cancelled or expired: the stock counts its units back already, whether
                // or not its return reached a gate; a release of it later is a repeat.
                released.push(id);
            }
        }
        let (stock, moves) = if part.segments > 1 {
            let (allocated, moves) = self
                .segment_allocation(conn, sale_id, part, initial)
                .await?;
            (allocated - held.values().sum::<i64>(), moves)
        } else {
            (stock, Vec::new())
        };
        Ok(LoadSnapshot {
            stock,
            released,
            buyers: held.into_iter().collect(),
            counted,
            moves,
        })
    }

    /// A segment's allocation from SQL (its share of the initial stock, plus moves in, less
    /// moves out, that took effect) and how it took part in each move. Planned moves out
    /// of it are refused first, in the caller's transaction.
    async fn segment_allocation(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
        part: Part,
        initial: i64,
    ) -> Result<(i64, Vec<(i64, super::moves::MoveMark)>), StoreError> {
        use super::moves::MoveMark;
        sqlx::query(&self.sql(
            "UPDATE segment_moves SET state = 'refused', updated_at = ? \
             WHERE sale_id = ? AND from_segment = ? AND state = 'planned'",
        ))
        .bind(crate::now_ms())
        .bind(sale_id)
        .bind(part.segment)
        .execute(&mut *conn)
        .await?;
        let rows = sqlx::query(&self.sql(
            "SELECT id, from_segment, to_segment, quantity, state FROM segment_moves \
             WHERE sale_id = ? AND (from_segment = ? OR to_segment = ?)",
        ))
        .bind(sale_id)
        .bind(part.segment)
        .bind(part.segment)
        .fetch_all(&mut *conn)
        .await?;
        let mut allocated =
            crate::model::segments::allocation(initial, part.segments, part.segment);
        let mut marks = Vec::new();
        for r in &rows {
            let (id, from, qty): (i64, i64, i64) = (r.try_get(0)?, r.try_get(1)?, r.try_get(3)?);
            let state: String = r.try_get(4)?;
            let took_effect = state == "taken" || state == "done";
            if from == part.segment {
                if took_effect {
                    allocated -= qty;
                    marks.push((id, MoveMark::Taken));
                } else if state == "refused" {
                    marks.push((id, MoveMark::Refused));
                }
            } else if took_effect {
                allocated += qty;
                marks.push((id, MoveMark::Given));
            }
        }
        Ok((allocated, marks))
    }

    // ---- payments -----------------------------------------------------------------------

    /// The order's open payment intent: `p` as given, or the one already open. At most one
    /// intent per order is open at any time, by a unique index over open intents, so
    /// concurrent calls all answer the same intent and a buyer cannot be charged twice.
    pub async fn open_payment(&self, p: &Payment) -> Result<Payment, StoreError> {
        let q = format!(
            "{} VALUES (?, ?, ?, ?, 'created', '', ?, ?){}",
            self.insert_ignore(
                "payments (intent_id, order_id, user_id, amount_cents, status, provider_ref, created_at, updated_at)"
            ),
            self.on_conflict_nothing()
        );
        // Another call's intent may be settled between our insert and our read: then the
        // next round opens one again.
        for _ in 0..3 {
            sqlx::query(&self.sql(&q))
                .bind(p.intent_id)
                .bind(p.order_id)
                .bind(p.user_id)
                .bind(p.amount_cents)
                .bind(p.created_at)
                .bind(p.created_at)
                .execute(&self.pool)
                .await?;
            if let Some(open) = self.open_payment_of(p.order_id).await? {
                return Ok(open);
            }
        }
        Err(StoreError::ConcurrentWrite)
    }

    const PAYMENT_COLS: &'static str =
        "intent_id, order_id, user_id, amount_cents, status, created_at";

    fn payment_from_row(r: &sqlx::any::AnyRow) -> Result<Payment, sqlx::Error> {
        Ok(Payment {
            intent_id: r.try_get(0)?,
            order_id: r.try_get(1)?,
            user_id: r.try_get(2)?,
            amount_cents: r.try_get(3)?,
            status: r.try_get(4)?,
            created_at: r.try_get(5)?,
        })
    }

    pub async fn payment(&self, intent_id: i64) -> Result<Option<Payment>, StoreError> {
        let q = format!(
            "SELECT {} FROM payments WHERE intent_id = ?",
            Self::PAYMENT_COLS
        );
        self.one_by_key(&q, intent_id, Self::payment_from_row).await
    }

    /// The payment intent of an order still waiting for the provider (at most one).
    pub async fn open_payment_of(&self, order_id: i64) -> Result<Option<Payment>, StoreError> {
        let q = format!(
            "SELECT {} FROM payments WHERE order_id = ? AND status = 'created'",
            Self::PAYMENT_COLS
        );
        self.one_by_key(&q, order_id, Self::payment_from_row).await
    }

    /// A provider said the intent failed: it can no longer be paid (the buyer may start another).
    pub async fn fail_payment(
        &self,
        intent_id: i64,
        provider_ref: &str,
        now: i64,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(&self.sql(
            "UPDATE payments SET status = 'failed', provider_ref = ?, updated_at = ? WHERE intent_id = ? AND status IN ('created', 'superseded')",
        ))
        .bind(provider_ref)
        .bind(now)
        .bind(intent_id)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// A provider said the intent was paid. One transaction claims the payment and moves
    /// the order: the order becomes `paid`, or, if it expired or was cancelled first, the
    /// payment is recorded as a refund due. A repeated notification changes nothing.
    pub async fn settle_payment(
        &self,
        intent_id: i64,
        provider_ref: &str,
        now: i64,
    ) -> Result<PaymentSettlement, TransitionError> {
        retry_transient(|| self.settle_payment_once(intent_id, provider_ref, now)).await
    }

    async fn settle_payment_once(
        &self,
        intent_id: i64,
        provider_ref: &str,
        now: i64,
    ) -> Result<PaymentSettlement, TransitionError> {
        let mut conn = self.begin_write().await?;
        let result = self
            .settle_in_tx(&mut conn, intent_id, provider_ref, now)
            .await;
        Self::finish(conn, result.is_ok()).await?;
        result
    }

    async fn settle_in_tx(
        &self,
        conn: &mut sqlx::AnyConnection,
        intent_id: i64,
        provider_ref: &str,
        now: i64,
    ) -> Result<PaymentSettlement, TransitionError> {
        // Claim the intent first: a concurrent duplicate waits on this row, then finds it
        // settled. It is marked refund_due until the order is known to be paid. An intent
        // superseded by the migration to one open intent per order is still claimable:
        // money a provider took for it is recorded, as paid or as a refund due.
        let claimed = sqlx::query(&self.sql(
            "UPDATE payments SET status = 'refund_due', provider_ref = ?, updated_at = ? WHERE intent_id = ? AND status IN ('created', 'superseded')",
        ))
        .bind(provider_ref)
        .bind(now)
        .bind(intent_id)
        .execute(&mut *conn)
        .await?
        .rows_affected();
        let q = format!(
            "SELECT {} FROM payments WHERE intent_id = ?",
            Self::PAYMENT_COLS
        );
        let row = sqlx::query(&self.sql(&q))
            .bind(intent_id)
            .fetch_optional(&mut *conn)
            .await?;
        let payment = match row {
            Some(r) => Self::payment_from_row(&r)?,
            None => return Err(TransitionError::NoSuchOrder(intent_id)),
        };
        if claimed != 1 {
            return Ok(PaymentSettlement::Duplicate);
        }
        let detail = format!("payment {intent_id}");
        match self
            .transition_in_tx(conn, payment.order_id, None, Outcome::Paid, now, &detail)
            .await
        {
            Ok(_) => {
                sqlx::query(&self.sql("UPDATE payments SET status = 'paid' WHERE intent_id = ?"))
                    .bind(intent_id)
                    .execute(&mut *conn)
                    .await?;
                Ok(PaymentSettlement::Paid)
            }
            Err(TransitionError::Illegal { .. }) => Ok(PaymentSettlement::RefundDue),
            Err(e) => Err(e),
        }
    }

    /// Payments of a sale by status (for stats).
    pub async fn payment_counts(&self, sale_id: i64) -> Result<Vec<(String, i64)>, StoreError> {
        let rows = sqlx::query(&self.sql(
            "SELECT p.status, COUNT(*) FROM payments p JOIN orders o ON o.id = p.order_id WHERE o.sale_id = ? GROUP BY p.status",
        ))
        .bind(sale_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| Ok((r.try_get::<String, _>(0)?, r.try_get::<i64, _>(1)?)))
            .collect()
    }
}

/// How a purchase decided in SQL serializes buyers of the same sale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SqlDecision {
    /// `SELECT ... FOR UPDATE` on the sale row, then check and decrement.
    Lock,
    /// A guarded `UPDATE ... WHERE stock >= qty` first (it takes the row lock), then the
    /// user's limit, rolling back if it is exceeded.
    Conditional,
}

/// The outcome of a purchase decided in SQL, before mapping to the gate's verdicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SqlVerdict {
    Accepted { remaining: i64 },
    NotLoaded,
    NotStarted,
    Ended,
    Paused,
    AlreadyPurchased,
    OverLimit { held: i64 },
    SoldOut { remaining: i64 },
}

impl Store {
    /// Records a single-use nonce of a sale as spent until `keep_until`; false when it was
    /// spent before (the SQL gates' counterpart of the Redis gate's `SET NX`).
    pub async fn spend_nonce(
        &self,
        sale_id: i64,
        nonce: u64,
        keep_until: i64,
    ) -> Result<bool, StoreError> {
        let now = crate::now_ms();
        // Bit-for-bit: the column is signed, the nonce is not.
        let nonce = nonce as i64;
        let q = format!(
            "{} VALUES (?, ?, ?){}",
            self.insert_ignore("spent_nonces (sale_id, nonce, keep_until)"),
            self.on_conflict_nothing()
        );
        let fresh = sqlx::query(&self.sql(&q))
            .bind(sale_id)
            .bind(nonce)
            .bind(keep_until)
            .execute(&self.pool)
            .await?
            .rows_affected()
            == 1;
        if fresh {
            return Ok(true);
        }
        // Spent before; honour it again only if that spend has been forgotten by now.
        let revived = sqlx::query(&self.sql(
            "UPDATE spent_nonces SET keep_until = ? WHERE sale_id = ? AND nonce = ? AND keep_until <= ?",
        ))
        .bind(keep_until)
        .bind(sale_id)
        .bind(nonce)
        .bind(now)
        .execute(&self.pool)
        .await?;
        Ok(revived.rows_affected() == 1)
    }

    /// Forgets spent nonces that could no longer be honoured anyway.
    pub async fn forget_spent_nonces(&self) -> Result<u64, StoreError> {
        let done = sqlx::query(&self.sql("DELETE FROM spent_nonces WHERE keep_until <= ?"))
            .bind(crate::now_ms())
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    /// Decides and writes one purchase entirely in SQL (the comparison and fallback gates):
    /// window, then the user's limit, then the stock, and the order row, in one transaction.
    pub async fn sql_purchase(
        &self,
        p: &crate::model::NewOrder,
        how: SqlDecision,
    ) -> Result<SqlVerdict, StoreError> {
        retry_transient(|| self.sql_purchase_once(p, how)).await
    }

    async fn sql_purchase_once(
        &self,
        p: &crate::model::NewOrder,
        how: SqlDecision,
    ) -> Result<SqlVerdict, StoreError> {
        let mut conn = self.begin_write().await?;
        let result = self.sql_purchase_in_tx(&mut conn, p, how).await;
        Self::finish(conn, matches!(result, Ok(SqlVerdict::Accepted { .. }))).await?;
        result
    }

    async fn sql_purchase_in_tx(
        &self,
        conn: &mut sqlx::AnyConnection,
        p: &crate::model::NewOrder,
        how: SqlDecision,
    ) -> Result<SqlVerdict, StoreError> {
        let now = crate::now_ms();
        let lock = if how == SqlDecision::Lock && self.dialect != Dialect::Sqlite {
            " FOR UPDATE"
        } else {
            ""
        };
        let q = format!(
            "SELECT stock, per_user_limit, begins_at, ends_at, paused, price_cents, status, payment_window_secs \
             FROM sales WHERE id = ?{lock}"
        );
        let Some(row) = sqlx::query(&self.sql(&q))
            .bind(p.sale_id)
            .fetch_optional(&mut *conn)
            .await?
        else {
            return Ok(SqlVerdict::NotLoaded);
        };
        let stock: i64 = row.try_get(0)?;
        let limit: i64 = row.try_get(1)?;
        let (begins, ends): (i64, i64) = (row.try_get(2)?, row.try_get(3)?);
        let paused = row.try_get::<i64, _>(4)? != 0;
        let price: i64 = row.try_get(5)?;
        let approved = row.try_get::<String, _>(6)? == "approved";
        let window: i64 = row.try_get(7)?;
        if !approved {
            return Ok(SqlVerdict::NotLoaded);
        }
        if now < begins {
            return Ok(SqlVerdict::NotStarted);
        }
        if now >= ends {
            return Ok(SqlVerdict::Ended);
        }
        if paused {
            return Ok(SqlVerdict::Paused);
        }
        let held_query = format!(
            "SELECT {} FROM orders WHERE sale_id = ? AND user_id = ? AND status IN ('pending_payment', 'paid')",
            self.sum_int("quantity")
        );
        let remaining = match how {
            SqlDecision::Lock => stock,
            SqlDecision::Conditional => {
                // A cheap look first, so that a buyer at the limit hears so rather than
                // `sold_out`; the authoritative check follows under the row lock.
                let held: i64 = sqlx::query(&self.sql(&held_query))
                    .bind(p.sale_id)
                    .bind(p.user_id)
                    .fetch_one(&mut *conn)
                    .await?
                    .try_get(0)?;
                if held >= limit {
                    return Ok(SqlVerdict::AlreadyPurchased);
                }
                let taken = sqlx::query(&self.sql("UPDATE sales SET stock = stock - ?, updated_at = ? WHERE id = ? AND stock >= ?"))
                    .bind(p.quantity)
                    .bind(now)
                    .bind(p.sale_id)
                    .bind(p.quantity)
                    .execute(&mut *conn)
                    .await?;
                if taken.rows_affected() != 1 {
                    return Ok(SqlVerdict::SoldOut {
                        remaining: stock.min(p.quantity - 1).max(0),
                    });
                }
                stock
            }
        };
        // The authoritative look, under the sale's row lock. InnoDB's plain reads come from
        // the snapshot of the transaction's first read (taken before the lock above when
        // the cheap look ran); a locking read sees every committed order.
        let locked_held_query = if self.dialect == Dialect::MySql {
            format!("{held_query} FOR UPDATE")
        } else {
            held_query
        };
        let held: i64 = sqlx::query(&self.sql(&locked_held_query))
            .bind(p.sale_id)
            .bind(p.user_id)
            .fetch_one(&mut *conn)
            .await?
            .try_get(0)?;
        if held + p.quantity > limit {
            return Ok(if held >= limit {
                SqlVerdict::AlreadyPurchased
            } else {
                SqlVerdict::OverLimit { held }
            });
        }
        if how == SqlDecision::Lock {
            if remaining < p.quantity {
                return Ok(SqlVerdict::SoldOut { remaining });
            }
            sqlx::query(
                &self.sql("UPDATE sales SET stock = stock - ?, updated_at = ? WHERE id = ?"),
            )
            .bind(p.quantity)
            .bind(now)
            .bind(p.sale_id)
            .execute(&mut *conn)
            .await?;
        }
        sqlx::query(&self.sql(
            "INSERT INTO orders (id, sale_id, user_id, quantity, price_cents, status, accepted_at, written_at, pay_deadline, updated_at) \
             VALUES (?, ?, ?, ?, ?, 'pending_payment', ?, ?, ?, ?)",
        ))
        .bind(p.id)
        .bind(p.sale_id)
        .bind(p.user_id)
        .bind(p.quantity)
        .bind(price)
        .bind(now)
        .bind(now)
        .bind(now + window * 1000)
        .bind(now)
        .execute(&mut *conn)
        .await?;
        let taken = Movement::new(p.sale_id, -p.quantity, Cause::Accepted).order(p.id);
        self.journal_in(conn, &[taken], now).await?;
        Ok(SqlVerdict::Accepted {
            remaining: remaining - p.quantity,
        })
    }
}
