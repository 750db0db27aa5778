//! Payment intents: at most one open per order (a unique index over open intents), and
//! the settlement of a provider's callback: one transaction that claims the intent and
//! moves the order, or records a refund due when the order expired or was cancelled first.

use sqlx::Row;

use super::retry::retry_transient;
use super::tallies::{PaymentStatus, Tallies};
use super::transitions::{Outcome, TransitionError};
use super::{Store, StoreError};

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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
        let kept = self
            .keeps_changes()
            .then_some(super::change::Change::PaymentOpened {
                intent: p.intent_id,
                order: p.order_id,
                user: p.user_id,
                amount_cents: p.amount_cents,
                created_at: p.created_at,
            });
        for _ in 0..3 {
            let q = &q;
            self.in_kept_tx(kept.as_ref(), |mut conn| async move {
                let opened = async {
                    let inserted = sqlx::query(&self.sql(q))
                        .bind(p.intent_id)
                        .bind(p.order_id)
                        .bind(p.user_id)
                        .bind(p.amount_cents)
                        .bind(p.created_at)
                        .bind(p.created_at)
                        .execute(&mut *conn)
                        .await?
                        .rows_affected();
                    if inserted == 1 {
                        self.tally_payment_in(&mut conn, p.order_id, None, PaymentStatus::Created)
                            .await?;
                    }
                    Ok::<_, StoreError>(())
                }
                .await;
                (conn, opened)
            })
            .await?;
            if let Some(open) = self.open_payment_of(p.order_id).await? {
                return Ok(open);
            }
        }
        Err(StoreError::ConcurrentWrite)
    }

    /// Counts a payment intent of `order_id` moved from `from` to `to` in its sale's tallies.
    async fn tally_payment_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        order_id: i64,
        from: Option<PaymentStatus>,
        to: PaymentStatus,
    ) -> Result<(), StoreError> {
        let sale: Option<i64> = sqlx::query(&self.sql("SELECT sale_id FROM orders WHERE id = ?"))
            .bind(order_id)
            .fetch_optional(&mut *conn)
            .await?
            .map(|r| r.try_get(0))
            .transpose()?;
        let Some(sale) = sale else {
            return Ok(());
        };
        let mut tallies = Tallies::default();
        tallies.payment_moved(sale, from, to);
        self.tally_in(conn, &tallies).await
    }

    /// The intent, locked for the caller's transaction (SQLite's write lock is the lock).
    async fn payment_locked_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        intent_id: i64,
    ) -> Result<Option<Payment>, StoreError> {
        let lock = self.for_update();
        let q = format!(
            "SELECT {} FROM payments WHERE intent_id = ?{lock}",
            Self::PAYMENT_COLS
        );
        let row = sqlx::query(&self.sql(&q))
            .bind(intent_id)
            .fetch_optional(&mut *conn)
            .await?;
        Ok(row.map(|r| Self::payment_from_row(&r)).transpose()?)
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
        let kept = self
            .keeps_changes()
            .then(|| super::change::Change::PaymentFailed {
                intent: intent_id,
                provider_ref: provider_ref.to_string(),
                now,
            });
        self.in_kept_tx(kept.as_ref(), |mut conn| async move {
            let failed = async {
                let payment = self.payment_locked_in(&mut conn, intent_id).await?;
                let Some((payment, from)) = payment.and_then(|p| open_status(&p).map(|s| (p, s)))
                else {
                    return Ok(false);
                };
                sqlx::query(&self.sql(
                    "UPDATE payments SET status = 'failed', provider_ref = ?, updated_at = ? WHERE intent_id = ?",
                ))
                .bind(provider_ref)
                .bind(now)
                .bind(intent_id)
                .execute(&mut *conn)
                .await?;
                self.tally_payment_in(&mut conn, payment.order_id, Some(from), PaymentStatus::Failed)
                    .await?;
                Ok(true)
            }
            .await;
            (conn, failed)
        })
        .await
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
        let kept = self
            .keeps_changes()
            .then(|| super::change::Change::PaymentSettled {
                intent: intent_id,
                provider_ref: provider_ref.to_string(),
                now,
            });
        self.in_kept_tx(kept.as_ref(), |mut conn| async move {
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
        // settled. An intent superseded by the migration to one open intent per order is
        // still claimable: money a provider took for it is recorded, as paid or as a
        // refund due.
        let Some(payment) = self.payment_locked_in(conn, intent_id).await? else {
            return Err(TransitionError::NoSuchOrder(intent_id));
        };
        let Some(from) = open_status(&payment) else {
            return Ok(PaymentSettlement::Duplicate);
        };
        let detail = format!("payment {intent_id}");
        let (settlement, to) = match self
            .transition_in_tx(conn, payment.order_id, None, Outcome::Paid, now, &detail)
            .await
        {
            Ok(_) => (PaymentSettlement::Paid, PaymentStatus::Paid),
            Err(TransitionError::Illegal { .. }) => {
                (PaymentSettlement::RefundDue, PaymentStatus::RefundDue)
            }
            Err(e) => return Err(e),
        };
        sqlx::query(&self.sql(
            "UPDATE payments SET status = ?, provider_ref = ?, updated_at = ? WHERE intent_id = ?",
        ))
        .bind(to.as_str())
        .bind(provider_ref)
        .bind(now)
        .bind(intent_id)
        .execute(&mut *conn)
        .await?;
        self.tally_payment_in(conn, payment.order_id, Some(from), to)
            .await?;
        Ok(settlement)
    }

    /// Payments of a sale by status, counted from the rows (the full recount's).
    pub async fn payment_counts(&self, sale_id: i64) -> Result<Vec<(String, i64)>, StoreError> {
        self.all_rows("SELECT p.status, COUNT(*) FROM payments p JOIN orders o ON o.id = p.order_id WHERE o.sale_id = ? GROUP BY p.status", &[sale_id], super::text_and_int).await
    }
}

/// The status of an intent that may still be settled or failed: open, or superseded.
fn open_status(p: &Payment) -> Option<PaymentStatus> {
    match PaymentStatus::parse(&p.status)? {
        s @ (PaymentStatus::Created | PaymentStatus::Superseded) => Some(s),
        _ => None,
    }
}
