//! Expiry by the batch: the unpaid orders of a batch past their deadline become `expired`
//! together, a statement for each kind of row the batch touches rather than ten for each
//! order. Owns nothing but that; a single order's transitions are `transitions`'.
//! Must never take a sale's row before the batch's orders (see [`Store::expire_orders`]).

use std::collections::BTreeMap;

use sqlx::Row;

use super::counters::Bump;
use super::journal::{Cause, Movement};
use super::retry::retry_transient;
use super::tallies::Tallies;
use super::transitions::TransitionError;
use super::{Store, StoreError};
use crate::model::OrderStatus;

/// Rows per multi-row statement: a few thousand bound values, well under every
/// database's limit.
const ROWS_PER_STATEMENT: usize = 200;

/// An order of the batch that expires.
struct Due {
    id: i64,
    sale_id: i64,
    user_id: i64,
    quantity: i64,
}

/// What one sale's expired orders change on its row.
#[derive(Default)]
struct SaleShare {
    orders: i64,
    units: i64,
    /// Units each buyer of the sale loses, by buyer.
    by_buyer: BTreeMap<i64, i64>,
}

impl Store {
    /// Expires the orders of `ids` that are still unpaid past their deadline, all in one
    /// transaction (one commit for the lot); orders paid or cancelled meanwhile are passed
    /// over. Returns how many expired. The orders' rows are locked first, in id order, and
    /// each sale's row after them: a batch that took a sale's row at its first order and
    /// then an order's deadlocked with a buyer cancelling that order (its row held,
    /// waiting for the sale's).
    pub async fn expire_orders(&self, ids: &[i64], now: i64) -> Result<usize, TransitionError> {
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        let ids = &ids;
        let kept = self
            .keeps_changes()
            .then(|| super::change::Change::Expired {
                ids: ids.clone(),
                now,
            });
        retry_transient(self.clock().as_ref(), || {
            self.in_kept_tx(kept.as_ref(), |mut conn| async move {
                let expired = self.expire_in(&mut conn, ids, now).await;
                (conn, expired.map_err(TransitionError::from))
            })
        })
        .await
    }

    async fn expire_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        ids: &[i64],
        now: i64,
    ) -> Result<usize, StoreError> {
        let due = self.lock_due(conn, ids, now).await?;
        if due.is_empty() {
            return Ok(0);
        }
        for chunk in due.chunks(ROWS_PER_STATEMENT * 5) {
            let q = self.sql(&format!(
                "UPDATE orders SET status = 'expired', updated_at = ? \
                 WHERE status = 'pending_payment' AND id IN ({})",
                Self::placeholders(chunk.len())
            ));
            let mut update = sqlx::query(&q).persistent(false).bind(now);
            for d in chunk {
                update = update.bind(d.id);
            }
            if update.execute(&mut *conn).await?.rows_affected() != chunk.len() as u64 {
                // The rows are locked: nothing may have moved them since they were read.
                return Err(StoreError::ConcurrentWrite);
            }
        }
        self.note_expired(conn, &due, now).await?;
        let mut tallies = Tallies::default();
        let mut per_sale: BTreeMap<i64, SaleShare> = BTreeMap::new();
        for d in &due {
            tallies.order_moved(
                d.sale_id,
                Some(OrderStatus::PendingPayment),
                OrderStatus::Expired,
            );
            let share = per_sale.entry(d.sale_id).or_default();
            share.orders += 1;
            share.units += d.quantity;
            *share.by_buyer.entry(d.user_id).or_default() += d.quantity;
        }
        for (sale_id, share) in &per_sale {
            self.give_back_in(conn, *sale_id, share, now, &mut tallies)
                .await?;
        }
        let lines: Vec<Movement> = due
            .iter()
            .map(|d| Movement::new(d.sale_id, d.quantity, Cause::Expired).order(d.id))
            .collect();
        self.journal_rows_in(conn, &lines, now).await?;
        self.tally_in(conn, &tallies).await?;
        Ok(due.len())
    }

    /// Locks every order of `ids` (in id order) and returns those still unpaid past their
    /// deadline. SQLite's write transaction holds the whole file already.
    async fn lock_due(
        &self,
        conn: &mut sqlx::AnyConnection,
        ids: &[i64],
        now: i64,
    ) -> Result<Vec<Due>, StoreError> {
        let mut due = Vec::new();
        for chunk in ids.chunks(ROWS_PER_STATEMENT * 5) {
            let q = self.sql(&format!(
                "SELECT id, sale_id, user_id, quantity, status, pay_deadline FROM orders \
                 WHERE id IN ({}) ORDER BY id{}",
                Self::placeholders(chunk.len()),
                self.for_update()
            ));
            // One statement shape per batch size: not worth a prepared statement each.
            let mut query = sqlx::query(&q).persistent(false);
            for id in chunk {
                query = query.bind(*id);
            }
            for r in query.fetch_all(&mut *conn).await? {
                let status: String = r.try_get(4)?;
                let deadline: i64 = r.try_get(5)?;
                if status == OrderStatus::PendingPayment.as_str() && deadline <= now {
                    due.push(Due {
                        id: r.try_get(0)?,
                        sale_id: r.try_get(1)?,
                        user_id: r.try_get(2)?,
                        quantity: r.try_get(3)?,
                    });
                }
            }
        }
        Ok(due)
    }

    /// The rows an expiry adds before any sale's row is taken: the orders' events and their
    /// returns in the outbox. (The journal's lines wait for the sales' rows: a sale's journal
    /// ids count up in commit order, which a reader paging by `after` relies on.)
    async fn note_expired(
        &self,
        conn: &mut sqlx::AnyConnection,
        due: &[Due],
        now: i64,
    ) -> Result<(), StoreError> {
        for chunk in due.chunks(ROWS_PER_STATEMENT) {
            let q = self.sql(&format!(
                "INSERT INTO order_events (order_id, status, at, detail) VALUES {}",
                vec!["(?, 'expired', ?, 'payment deadline passed')"; chunk.len()].join(", ")
            ));
            let mut events = sqlx::query(&q).persistent(false);
            for d in chunk {
                events = events.bind(d.id).bind(now);
            }
            events.execute(&mut *conn).await?;
            let q = self.sql(&format!(
                "INSERT INTO stock_returns \
                 (order_id, sale_id, user_id, quantity, reason, created_at, gate_done_at) VALUES {}",
                vec!["(?, ?, ?, ?, 'expired', ?, NULL)"; chunk.len()].join(", ")
            ));
            let mut returns = sqlx::query(&q).persistent(false);
            for d in chunk {
                returns = returns
                    .bind(d.id)
                    .bind(d.sale_id)
                    .bind(d.user_id)
                    .bind(d.quantity)
                    .bind(now);
            }
            returns.execute(&mut *conn).await?;
        }
        Ok(())
    }

    /// One sale's share of the batch on its row: the stock and the counters in one
    /// statement (which takes the row), then the buyers' other orders, read under it (see
    /// `store::counters`), for the buyers who hold nothing now and the holding tallies.
    async fn give_back_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
        share: &SaleShare,
        now: i64,
        tallies: &mut Tallies,
    ) -> Result<(), StoreError> {
        let returned = Bump {
            live_units: -share.units,
            live_buyers: 0,
            returns_owed_orders: share.orders,
            returns_owed_units: share.units,
            units_in_transit: 0,
        };
        let q = self.sql(&format!(
            "UPDATE sales SET stock = stock + ?, journal_sum = journal_sum + ?, {}, \
             updated_at = ? WHERE id = ?",
            Bump::SET
        ));
        returned
            .bind(sqlx::query(&q).bind(share.units).bind(share.units))
            .bind(now)
            .bind(sale_id)
            .execute(&mut *conn)
            .await?;
        let buyers: Vec<i64> = share.by_buyer.keys().copied().collect();
        let mut still = std::collections::HashMap::new();
        for chunk in buyers.chunks(ROWS_PER_STATEMENT * 5) {
            // The writer's own lookup (a lookup per buyer on PostgreSQL, whose planner
            // walked a whole big sale for `user_id IN (...)`), locking on MySQL: a batch
            // over several sales reads the later ones long after its snapshot began.
            still.extend(self.held_by_buyers(conn, sale_id, chunk, true).await?);
        }
        let mut gone = 0;
        for (user, lost) in &share.by_buyer {
            let after = still.get(user).copied().unwrap_or(0);
            if after == 0 {
                gone += 1;
            }
            tallies.holding_moved(sale_id, after + lost, after);
        }
        let left = Bump {
            live_buyers: -gone,
            ..Default::default()
        };
        self.bump_in(conn, sale_id, left).await
    }
}
