//! Payment intents: at most one open per order (a unique index over open intents), and
//! the settlement of a provider's callback: one transaction that claims the intent and
//! moves the order, or records a refund due when the order expired or was cancelled first.

use sqlx::Row;

use super::retry::retry_transient;
use super::transitions::{Outcome, TransitionError};
use super::{Store, StoreError};

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

impl Store {
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
        retry_transient(self.clock().as_ref(), || {
            self.settle_payment_once(intent_id, provider_ref, now)
        })
        .await
    }

    async fn settle_payment_once(
        &self,
        intent_id: i64,
        provider_ref: &str,
        now: i64,
    ) -> Result<PaymentSettlement, TransitionError> {
        self.in_write_tx(|mut conn| async move {
            let result = self
                .settle_in_tx(&mut conn, intent_id, provider_ref, now)
                .await;
            (conn, result)
        })
        .await
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
        self.all_rows("SELECT p.status, COUNT(*) FROM payments p JOIN orders o ON o.id = p.order_id WHERE o.sale_id = ? GROUP BY p.status", &[sale_id], super::text_and_int).await
    }
}
