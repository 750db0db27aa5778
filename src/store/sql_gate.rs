//! Purchases decided in SQL itself (`--gate sql-lock | sql-conditional`): the whole
//! decision in one transaction, and the single-use nonces it spends. The one part of the
//! store that decides a purchase, by design: behind these gates the database is the gate.
//!
//! What it must never do: accept a purchase whose order is not written in the same
//! transaction, or sell past the sale's stock or the buyer's limit.

use sqlx::Row;

use super::journal::{Cause, Movement};
use super::retry::{retry_transient, retry_while};
use super::{Dialect, Store, StoreError};
use crate::model::NewOrder;

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
    Accepted {
        remaining: i64,
    },
    NotLoaded,
    NotStarted,
    Ended,
    Paused,
    AlreadyPurchased,
    OverLimit {
        held: i64,
    },
    SoldOut {
        remaining: i64,
    },
    /// The purchase's `Idempotency-Key` is no longer this attempt's (another took its claim
    /// over, or this attempt committed already and is being tried again): nothing was done.
    ClaimLost,
}

/// A purchase's `Idempotency-Key` record, claimed by this attempt at `claimed_at` (see
/// `Store::claim_idempotency_key`): completed with the order in the purchase's own
/// transaction, so that an order bought with a key always has its record.
#[derive(Debug, Clone, Copy)]
pub struct ClaimedKey<'a> {
    pub caller: &'a str,
    pub key: &'a str,
    pub claimed_at: i64,
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
        // Twenty spends of one nonce at once on a busy SQLite file meet "database is
        // locked". Tried again only when the database refused the statement: one whose
        // answer was lost may have committed, and its retry would call the buyer's first
        // spend a repeat.
        let refused = |e: &StoreError| e.is_transient() && e.refused_by_database();
        retry_while(self.clock().as_ref(), refused, || {
            self.spend_nonce_once(sale_id, nonce, keep_until)
        })
        .await
    }

    async fn spend_nonce_once(
        &self,
        sale_id: i64,
        nonce: u64,
        keep_until: i64,
    ) -> Result<bool, StoreError> {
        let now = self.now_ms();
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
            .bind(self.now_ms())
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
        self.sql_purchase_claimed(p, how, None).await
    }

    /// [`Store::sql_purchase`] with its `Idempotency-Key` claimed: the claim is completed
    /// in the purchase's transaction, or the purchase is not made (`ClaimLost`).
    pub async fn sql_purchase_claimed(
        &self,
        p: &crate::model::NewOrder,
        how: SqlDecision,
        claim: Option<ClaimedKey<'_>>,
    ) -> Result<SqlVerdict, StoreError> {
        let verdict = retry_transient(self.clock().as_ref(), || {
            self.sql_purchase_once(p, how, claim)
        })
        .await?;
        if matches!(verdict, SqlVerdict::Accepted { .. }) && self.dialect == Dialect::Sqlite {
            // Off the buyer's answer: a merge step, when one is due, moves 5,000 entries.
            let store = self.clone();
            tokio::spawn(async move { store.buyers_indexed(1).await });
        }
        Ok(verdict)
    }

    async fn sql_purchase_once(
        &self,
        p: &crate::model::NewOrder,
        how: SqlDecision,
        claim: Option<ClaimedKey<'_>>,
    ) -> Result<SqlVerdict, StoreError> {
        let mut conn = self.begin_write().await?;
        // The claim first, before the sale's row: an attempt whose claim is lost waits on
        // no one's lock. A purchase refused rolls its completion back.
        let result = match claim {
            Some(claim) if !self.complete_claim_in(&mut conn, claim, p.id).await? => {
                Ok(SqlVerdict::ClaimLost)
            }
            _ => self.sql_purchase_in_tx(&mut conn, p, how).await,
        };
        Self::finish(conn, matches!(result, Ok(SqlVerdict::Accepted { .. }))).await?;
        result
    }

    /// The decision and its writes, in the caller's transaction: the sale's window, then
    /// the user's limit, then the stock; then the order and what it moves.
    async fn sql_purchase_in_tx(
        &self,
        conn: &mut sqlx::AnyConnection,
        p: &NewOrder,
        how: SqlDecision,
    ) -> Result<SqlVerdict, StoreError> {
        let now = self.now_ms();
        let Some(sale) = self.sale_terms_in(conn, p.sale_id, how).await? else {
            return Ok(SqlVerdict::NotLoaded);
        };
        if let Some(refused) = sale.refusal_at(now) {
            return Ok(refused);
        }
        let held_query = self.live_units_of_buyer_query();
        if how == SqlDecision::Conditional {
            if let Some(refused) = self
                .take_stock_first(conn, p, &sale, &held_query, now)
                .await?
            {
                return Ok(refused);
            }
        }
        let remaining = sale.stock;
        let held = self.held_under_lock(conn, p, held_query).await?;
        if held + p.quantity > sale.limit {
            return Ok(if held >= sale.limit {
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
        self.write_purchase_in(conn, p, &sale, now).await?;
        self.count_purchase_in(conn, p, held).await?;
        Ok(SqlVerdict::Accepted {
            remaining: remaining - p.quantity,
        })
    }

    /// Completes this attempt's claim with its order; false when the claim is not its own
    /// any more.
    async fn complete_claim_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        claim: ClaimedKey<'_>,
        order_id: i64,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(&self.sql(
            "UPDATE idempotency_keys SET status = 200, body = ? \
             WHERE caller = ? AND idem_key = ? AND status IS NULL AND created_at = ?",
        ))
        .bind(order_id.to_string())
        .bind(claim.caller)
        .bind(claim.key)
        .bind(claim.claimed_at)
        .execute(&mut *conn)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// The sale's row as a purchase reads it, locked on `sql-lock` (on SQLite the write
    /// transaction has locked the whole file); `None` when the sale does not exist.
    async fn sale_terms_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
        how: SqlDecision,
    ) -> Result<Option<SaleTerms>, StoreError> {
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
            .bind(sale_id)
            .fetch_optional(&mut *conn)
            .await?
        else {
            return Ok(None);
        };
        Ok(Some(SaleTerms {
            stock: row.try_get(0)?,
            limit: row.try_get(1)?,
            begins: row.try_get(2)?,
            ends: row.try_get(3)?,
            paused: row.try_get::<i64, _>(4)? != 0,
            price: row.try_get(5)?,
            approved: row.try_get::<String, _>(6)? == "approved",
            window: row.try_get(7)?,
        }))
    }

    /// `sql-conditional`'s first step: the stock taken by a guarded `UPDATE`, which takes
    /// the sale's row lock. A refusal when the buyer is at the limit or the stock is short.
    async fn take_stock_first(
        &self,
        conn: &mut sqlx::AnyConnection,
        p: &NewOrder,
        sale: &SaleTerms,
        held_query: &str,
        now: i64,
    ) -> Result<Option<SqlVerdict>, StoreError> {
        // A cheap look first, so that a buyer at the limit hears so rather than
        // `sold_out`; the authoritative check follows under the row lock.
        let held: i64 = sqlx::query(&self.sql(held_query))
            .bind(p.sale_id)
            .bind(p.user_id)
            .fetch_one(&mut *conn)
            .await?
            .try_get(0)?;
        if held >= sale.limit {
            return Ok(Some(SqlVerdict::AlreadyPurchased));
        }
        let taken =
            sqlx::query(&self.sql(
                "UPDATE sales SET stock = stock - ?, updated_at = ? WHERE id = ? AND stock >= ?",
            ))
            .bind(p.quantity)
            .bind(now)
            .bind(p.sale_id)
            .bind(p.quantity)
            .execute(&mut *conn)
            .await?;
        if taken.rows_affected() != 1 {
            return Ok(Some(SqlVerdict::SoldOut {
                remaining: sale.stock.min(p.quantity - 1).max(0),
            }));
        }
        Ok(None)
    }

    /// The units the buyer holds in the sale's live orders: the authoritative look, under
    /// the sale's row lock.
    async fn held_under_lock(
        &self,
        conn: &mut sqlx::AnyConnection,
        p: &NewOrder,
        held_query: String,
    ) -> Result<i64, StoreError> {
        // InnoDB's plain reads come from the snapshot of the transaction's first read
        // (taken before the row lock when `take_stock_first`'s cheap look ran); a locking
        // read sees every committed order.
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
        Ok(held)
    }

    /// The accepted purchase's order, its entry in the buyer index and its journal row.
    async fn write_purchase_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        p: &NewOrder,
        sale: &SaleTerms,
        now: i64,
    ) -> Result<(), StoreError> {
        sqlx::query(&self.sql(
            "INSERT INTO orders (id, sale_id, user_id, quantity, price_cents, status, accepted_at, written_at, pay_deadline, updated_at) \
             VALUES (?, ?, ?, ?, ?, 'pending_payment', ?, ?, ?, ?)",
        ))
        .bind(p.id)
        .bind(p.sale_id)
        .bind(p.user_id)
        .bind(p.quantity)
        .bind(sale.price)
        .bind(now)
        .bind(now)
        .bind(now + sale.window * 1000)
        .bind(now)
        .execute(&mut *conn)
        .await?;
        self.index_buyers(conn, &[p]).await?;
        let taken = Movement::new(p.sale_id, -p.quantity, Cause::Accepted).order(p.id);
        self.journal_rows_in(conn, &[taken], now).await
    }

    /// The accepted purchase in the sale's counters and tallies; the buyer held `held`
    /// units before it.
    async fn count_purchase_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        p: &NewOrder,
        held: i64,
    ) -> Result<(), StoreError> {
        // The counters in one statement, under the row lock this purchase holds.
        let bump = super::counters::Bump {
            live_units: p.quantity,
            live_buyers: if held == 0 { 1 } else { 0 },
            ..Default::default()
        };
        let q = self.sql(&format!(
            "UPDATE sales SET journal_sum = journal_sum - ?, {} WHERE id = ?",
            super::counters::Bump::SET
        ));
        bump.bind(sqlx::query(&q).bind(p.quantity))
            .bind(p.sale_id)
            .execute(&mut *conn)
            .await?;
        let mut tallies = super::tallies::Tallies::default();
        tallies.order_moved(p.sale_id, None, crate::model::OrderStatus::PendingPayment);
        tallies.holding_moved(p.sale_id, held, held + p.quantity);
        self.tally_in(conn, &tallies).await
    }
}

/// What a purchase decided in SQL reads of its sale.
struct SaleTerms {
    stock: i64,
    limit: i64,
    begins: i64,
    ends: i64,
    paused: bool,
    price: i64,
    approved: bool,
    /// The payment window, seconds.
    window: i64,
}

impl SaleTerms {
    /// Why the sale takes no purchase at `now`, if it takes none: not approved, not begun,
    /// ended or paused.
    fn refusal_at(&self, now: i64) -> Option<SqlVerdict> {
        if !self.approved {
            return Some(SqlVerdict::NotLoaded);
        }
        if now < self.begins {
            return Some(SqlVerdict::NotStarted);
        }
        if now >= self.ends {
            return Some(SqlVerdict::Ended);
        }
        if self.paused {
            return Some(SqlVerdict::Paused);
        }
        None
    }
}
