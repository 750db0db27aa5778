//! Guarded transitions out of `pending_payment` (pay, cancel, expire: one transaction
//! each, whose guard `WHERE status = 'pending_payment'` lets exactly one win), and the
//! stock-return outbox they fill: units that go back to the gate, exactly once.

use sqlx::Row;

use super::journal::{Cause, Movement};
use super::retry::{retry_transient, Transient};
use super::{Store, StoreError};
pub use crate::model::Outcome;
use crate::model::{Order, OrderStatus};

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

impl Transient for TransitionError {
    fn is_transient(&self) -> bool {
        matches!(self, TransitionError::Store(e) if Transient::is_transient(e))
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

/// Outbox rows named in one statement when a pass clears them.
const OUTBOX_CHUNK: usize = 500;

/// Returns not yet handed to the gate (the start of a query).
const PENDING_RETURNS: &str =
    "SELECT order_id, sale_id, user_id, quantity FROM stock_returns WHERE gate_done_at IS NULL";

fn return_from_row(r: &sqlx::any::AnyRow) -> Result<StockReturn, sqlx::Error> {
    Ok(StockReturn {
        order_id: r.try_get(0)?,
        sale_id: r.try_get(1)?,
        user_id: r.try_get(2)?,
        quantity: r.try_get(3)?,
    })
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
        let kept = self
            .keeps_changes()
            .then(|| super::change::Change::Transition {
                order: order_id,
                owner,
                outcome,
                now,
                detail: detail.to_string(),
            });
        retry_transient(self.clock().as_ref(), || {
            self.in_kept_tx(kept.as_ref(), |mut conn| async move {
                let result = self
                    .transition_in_tx(&mut conn, order_id, owner, outcome, now, detail)
                    .await;
                (conn, result)
            })
        })
        .await
    }

    pub(super) async fn transition_in_tx(
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
        debug_assert!(changed <= 1, "one order, one row: {order_id}");
        debug_assert!(
            changed == 0 || order.status == outcome.status(),
            "order {order_id} moved to {} but reads {}",
            outcome.status().as_str(),
            order.status.as_str()
        );
        debug_assert!(
            changed == 0 || OrderStatus::PendingPayment.may_become(outcome.status()),
            "invariant 5: an order's state moves only forward"
        );
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
        let mut tallies = super::tallies::Tallies::default();
        tallies.order_moved(
            order.sale_id,
            Some(OrderStatus::PendingPayment),
            outcome.status(),
        );
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
            self.return_stock_in(conn, &order, outcome, now, &mut tallies)
                .await?;
        }
        self.tally_in(conn, &tallies).await?;
        Ok(order)
    }

    /// Puts a cancelled or expired order's units back: the outbox row, then the sale's row
    /// and the journal's line. Every transaction of a sale queues on that row (a storm of
    /// cancels, the writer's batches, a rebuild's read), so it is taken last, by one
    /// statement that moves the stock and every counter, and held only for the read of
    /// the buyer's other orders (which must see every transaction that went before, see
    /// `store::counters`), the journal's line, the buyer count and the tallies: five round
    /// trips where it was eight.
    async fn return_stock_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        order: &Order,
        outcome: Outcome,
        now: i64,
        tallies: &mut super::tallies::Tallies,
    ) -> Result<(), StoreError> {
        sqlx::query(&self.sql(
            "INSERT INTO stock_returns (order_id, sale_id, user_id, quantity, reason, created_at, gate_done_at) \
             VALUES (?, ?, ?, ?, ?, ?, NULL)",
        ))
        .bind(order.id)
        .bind(order.sale_id)
        .bind(order.user_id)
        .bind(order.quantity)
        .bind(outcome.status().as_str())
        .bind(now)
        .execute(&mut *conn)
        .await?;
        let returned = super::counters::Bump {
            live_units: -order.quantity,
            live_buyers: 0,
            returns_owed_orders: 1,
            returns_owed_units: order.quantity,
            units_in_transit: 0,
        };
        let q = self.sql(&format!(
            "UPDATE sales SET stock = stock + ?, journal_sum = journal_sum + ?, {}, \
             updated_at = ? WHERE id = ?",
            super::counters::Bump::SET
        ));
        returned
            .bind(sqlx::query(&q).bind(order.quantity).bind(order.quantity))
            .bind(now)
            .bind(order.sale_id)
            .execute(&mut *conn)
            .await?;
        // Under the sale's row: a sale's journal ids count up in commit order, which a
        // reader paging by `after` relies on.
        let cause = if outcome == Outcome::Cancelled {
            Cause::Cancelled
        } else {
            Cause::Expired
        };
        let back = Movement::new(order.sale_id, order.quantity, cause).order(order.id);
        self.journal_rows_in(conn, &[back], now).await?;
        let still_held = self
            .live_units_of_buyer(conn, order.sale_id, order.user_id)
            .await?;
        if still_held == 0 {
            let gone = super::counters::Bump {
                live_buyers: -1,
                ..Default::default()
            };
            self.bump_in(conn, order.sale_id, gone).await?;
        }
        tallies.holding_moved(order.sale_id, still_held + order.quantity, still_held);
        Ok(())
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
        Ok(row.map(|r| Self::order_from_row(&r)).transpose()?)
    }

    /// The recorded transitions of an order after it was written: (status, at), in order.
    pub async fn order_events(&self, order_id: i64) -> Result<Vec<(String, i64)>, StoreError> {
        self.all_rows(
            "SELECT status, at FROM order_events WHERE order_id = ? ORDER BY at",
            &[order_id],
            super::text_and_int,
        )
        .await
    }

    /// (sale, order) of the oldest `limit` orders past their payment deadline, in sale order.
    pub async fn due_for_expiry(
        &self,
        now: i64,
        limit: i64,
    ) -> Result<Vec<(i64, i64)>, StoreError> {
        let mut due = self
            .all_rows(
                "SELECT sale_id, id FROM orders WHERE status = 'pending_payment' \
                 AND pay_deadline <= ? ORDER BY pay_deadline LIMIT ?",
                &[now, limit],
                super::int_pair,
            )
            .await?;
        // `expire_orders` orders its locks itself: the orders' rows by id, then the sales'.
        due.sort_unstable();
        Ok(due)
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
        let q = format!("{PENDING_RETURNS} AND sale_id = ? ORDER BY order_id LIMIT ?");
        self.all_rows(&q, &[id, limit], return_from_row).await
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
        let q = format!("{PENDING_RETURNS}{except} ORDER BY order_id LIMIT ?");
        self.all_rows(&q, &[limit], return_from_row).await
    }

    pub async fn mark_returned(&self, order_id: i64, now: i64) -> Result<(), StoreError> {
        self.mark_all_returned(&[order_id], now).await
    }

    /// Clears the returns of `order_ids` from the outbox in one transaction (one commit for
    /// a pass's worth, not one each). Returns already cleared are passed over.
    pub async fn mark_all_returned(&self, order_ids: &[i64], now: i64) -> Result<(), StoreError> {
        let mut order_ids = order_ids.to_vec();
        order_ids.sort_unstable();
        order_ids.dedup();
        self.in_write_tx(|mut conn| async move {
            let done = self.mark_all_returned_in(&mut conn, &order_ids, now).await;
            (conn, done)
        })
        .await
    }

    /// Every outbox row first, in order id order, then each sale's row once, in sale order.
    /// A pass that took a sale's row after its first return and then queued for the next
    /// return's row deadlocked with a buyer's cancel clearing that return (its row held,
    /// waiting for the sale's): under a storm of cancels every pass and many cancels lost
    /// a second to the deadlock detector, while the sale's row, held, stalled the rest.
    /// Rows are locked and cleared a chunk to a statement, not one each.
    async fn mark_all_returned_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        order_ids: &[i64],
        now: i64,
    ) -> Result<(), StoreError> {
        let mut owed = Vec::new();
        for chunk in order_ids.chunks(OUTBOX_CHUNK) {
            let q = self.sql(&format!(
                "SELECT order_id, sale_id, quantity FROM stock_returns \
                 WHERE order_id IN ({}) AND gate_done_at IS NULL ORDER BY order_id{}",
                Self::placeholders(chunk.len()),
                self.for_update()
            ));
            // One statement shape per chunk size: not worth a prepared statement each.
            let mut query = sqlx::query(&q).persistent(false);
            for id in chunk {
                query = query.bind(*id);
            }
            for row in query.fetch_all(&mut *conn).await? {
                let (order_id, sale_id, quantity): (i64, i64, i64) =
                    (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
                owed.push((order_id, sale_id, quantity));
            }
        }
        for chunk in owed.chunks(OUTBOX_CHUNK) {
            let q = self.sql(&format!(
                "UPDATE stock_returns SET gate_done_at = ? WHERE gate_done_at IS NULL AND order_id IN ({})",
                Self::placeholders(chunk.len())
            ));
            let mut clear = sqlx::query(&q).persistent(false).bind(now);
            for (order_id, _, _) in chunk {
                clear = clear.bind(*order_id);
            }
            if clear.execute(&mut *conn).await?.rows_affected() != chunk.len() as u64 {
                // The rows are locked: nothing may have cleared them since they were read.
                return Err(StoreError::ConcurrentWrite);
            }
        }
        let mut handed = Vec::with_capacity(owed.len());
        let mut per_sale: std::collections::BTreeMap<i64, super::counters::Bump> =
            Default::default();
        for (order_id, sale_id, quantity) in owed {
            handed.push((sale_id, order_id));
            let paid_back = per_sale.entry(sale_id).or_default();
            paid_back.returns_owed_orders -= 1;
            paid_back.returns_owed_units -= quantity;
        }
        let rows: Vec<Movement> = handed
            .iter()
            .map(|(sale_id, order_id)| {
                Movement::new(*sale_id, 0, Cause::ReturnedToGate).order(*order_id)
            })
            .collect();
        for (sale_id, paid_back) in per_sale {
            self.bump_in(conn, sale_id, paid_back).await?;
        }
        // Under the sales' rows: a sale's journal ids count up in commit order.
        self.journal_rows_in(conn, &rows, now).await
    }
}
