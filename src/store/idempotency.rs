//! The answers of creating calls sent with an `Idempotency-Key`, kept in SQL so that every
//! instance and a restarted one answer a retry the same. A record is claimed before the
//! call runs (no answer yet) and completed with the answer, or released when the call
//! failed in a way worth trying again.
//!
//! What it must never do: judge a request or an answer (the edge does), or remove a record
//! younger than its caller was promised.

use sqlx::Row;

use super::{Store, StoreError};
use crate::model::{KeptPurchase, NewOrder, RetryKey};

/// What a key holds when claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// Claimed now: the caller runs the call, then completes or releases it.
    Mine,
    /// Another call holds the key: its fingerprint, and its answer once it has one.
    Taken {
        fingerprint: String,
        answer: Option<(u16, String)>,
    },
}

/// A claim without an answer older than this was left by a call that never finished (its
/// process died, its future was dropped): the next call with the key takes it over. Longer
/// than any call may run.
pub const CLAIM_LEASE_MS: i64 = 30_000;

/// The (caller, key) of a purchase's record: claimed by the SQL gates, and written by the
/// writer with an order bought with an `Idempotency-Key`, so that the memory gate finds
/// its records again at start-up. Its fingerprint is the quantity, its answer the order id.
pub fn purchase_record(sale_id: i64, user_id: i64, key: RetryKey) -> (String, String) {
    (
        format!("buyer:{user_id}"),
        format!("purchase:{sale_id}:{}", key.hex()),
    )
}

/// A purchase's record read back: `None` for one that is not a purchase's.
fn kept_purchase(
    caller: &str,
    key: &str,
    fingerprint: &str,
    body: &str,
    at: i64,
) -> Option<KeptPurchase> {
    let user_id = caller.strip_prefix("buyer:")?.parse().ok()?;
    let (sale_id, hex) = key.strip_prefix("purchase:")?.split_once(':')?;
    Some(KeptPurchase {
        sale_id: sale_id.parse().ok()?,
        user_id,
        key: RetryKey::from_hex(hex)?,
        order_id: body.parse().ok()?,
        quantity: fingerprint.parse().ok()?,
        at,
    })
}

/// Most records a statement writes: five values each, well under every database's limit.
const RECORDS_PER_STATEMENT: usize = 500;

/// A text column read as text, also where MariaDB flags TEXT binary (sqlx will not read
/// such a column as a string).
fn text_at(row: &sqlx::any::AnyRow, index: usize) -> Result<Option<String>, StoreError> {
    Ok(match row.try_get(index) {
        Ok(text) => text,
        Err(_) => row
            .try_get::<Option<Vec<u8>>, _>(index)?
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned()),
    })
}

impl Store {
    /// Keeps the records of the orders bought with an `Idempotency-Key`, in the caller's
    /// transaction (the one that writes the orders). A record younger than a day stays (a
    /// retry's answer); an older one, which no longer answers, is replaced.
    pub(super) async fn keep_purchase_records_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        orders: &[&NewOrder],
    ) -> Result<(), StoreError> {
        let keyed: Vec<(&NewOrder, RetryKey)> = orders
            .iter()
            .filter_map(|o| o.retry_key.map(|k| (*o, k)))
            .collect();
        for chunk in self.statement_chunks(&keyed, RECORDS_PER_STATEMENT) {
            let rows = vec!["(?, ?, ?, 200, ?, ?)"; chunk.len()].join(", ");
            let q = format!(
                "INSERT INTO idempotency_keys (caller, idem_key, fingerprint, status, body, created_at) \
                 VALUES {rows} {}",
                self.replace_stale_record()
            );
            let q = self.sql(&q);
            let keep = self.keeps_shape(chunk.len(), RECORDS_PER_STATEMENT);
            let mut statement = sqlx::query(&q).persistent(keep);
            for (o, key) in chunk {
                let (caller, idem_key) = purchase_record(o.sale_id, o.user_id, *key);
                statement = statement
                    .bind(caller)
                    .bind(idem_key)
                    .bind(o.quantity.to_string())
                    .bind(o.id.to_string())
                    .bind(o.accepted_at);
            }
            statement.execute(&mut *conn).await?;
        }
        Ok(())
    }

    /// The upsert's tail: a record a day old or older takes the new values, any other stays.
    fn replace_stale_record(&self) -> String {
        let day = crate::model::RETRY_KEY_MS;
        match self.dialect {
            // Assigned left to right, each seeing the ones before: `created_at` last.
            super::Dialect::MySql => {
                let stale = format!("created_at <= VALUES(created_at) - {day}");
                let set = |col: &str| format!("{col} = IF({stale}, VALUES({col}), {col})");
                format!(
                    "ON DUPLICATE KEY UPDATE {}, {}, {}, {}",
                    set("fingerprint"),
                    set("status"),
                    set("body"),
                    set("created_at")
                )
            }
            _ => format!(
                "ON CONFLICT (caller, idem_key) DO UPDATE SET fingerprint = excluded.fingerprint, \
                 status = excluded.status, body = excluded.body, created_at = excluded.created_at \
                 WHERE idempotency_keys.created_at <= excluded.created_at - {day}"
            ),
        }
    }

    /// The purchases made with an `Idempotency-Key` since `since` whose records hold
    /// their order.
    pub async fn kept_purchases(&self, since: i64) -> Result<Vec<KeptPurchase>, StoreError> {
        let rows = sqlx::query(&self.sql(
            "SELECT caller, idem_key, fingerprint, body, created_at FROM idempotency_keys \
             WHERE created_at >= ? AND status IS NOT NULL AND idem_key LIKE 'purchase:%'",
        ))
        .bind(since)
        .fetch_all(&self.pool)
        .await?;
        let mut kept = Vec::with_capacity(rows.len());
        for row in rows {
            let (caller, key, fingerprint): (String, String, String) =
                (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
            let body = text_at(&row, 3)?.unwrap_or_default();
            kept.extend(kept_purchase(
                &caller,
                &key,
                &fingerprint,
                &body,
                row.try_get(4)?,
            ));
        }
        Ok(kept)
    }

    /// Claims (caller, key) for a request of `fingerprint`, or says who holds it.
    pub async fn claim_idempotency_key(
        &self,
        caller: &str,
        key: &str,
        fingerprint: &str,
        now: i64,
    ) -> Result<Claim, StoreError> {
        let q = format!(
            "{} VALUES (?, ?, ?, NULL, NULL, ?){}",
            self.insert_ignore(
                "idempotency_keys (caller, idem_key, fingerprint, status, body, created_at)"
            ),
            self.on_conflict_nothing()
        );
        // A record released or swept between the insert and the read is claimed again by
        // inserting again: a missing row is never taken for a claim.
        for _ in 0..3 {
            let inserted = sqlx::query(&self.sql(&q))
                .bind(caller)
                .bind(key)
                .bind(fingerprint)
                .bind(now)
                .execute(&self.pool)
                .await?
                .rows_affected();
            if inserted == 1 {
                return Ok(Claim::Mine);
            }
            if let Some(record) = self.idempotency_record(caller, key).await? {
                return match record {
                    (Claim::Taken { answer: None, .. }, at) if at < now - CLAIM_LEASE_MS => {
                        self.take_over_claim(caller, key, fingerprint, at, now)
                            .await
                    }
                    (claim, _) => Ok(claim),
                };
            }
        }
        Err(StoreError::NotFound)
    }

    /// A claim left unfinished, taken over if no one else took it first.
    async fn take_over_claim(
        &self,
        caller: &str,
        key: &str,
        fingerprint: &str,
        claimed_at: i64,
        now: i64,
    ) -> Result<Claim, StoreError> {
        let taken = sqlx::query(&self.sql(
            "UPDATE idempotency_keys SET fingerprint = ?, created_at = ? \
             WHERE caller = ? AND idem_key = ? AND status IS NULL AND created_at = ?",
        ))
        .bind(fingerprint)
        .bind(now)
        .bind(caller)
        .bind(key)
        .bind(claimed_at)
        .execute(&self.pool)
        .await?
        .rows_affected();
        if taken == 1 {
            return Ok(Claim::Mine);
        }
        Ok(self.idempotency_record(caller, key).await?.map_or(
            Claim::Taken {
                fingerprint: fingerprint.to_string(),
                answer: None,
            },
            |r| r.0,
        ))
    }

    /// The record of (caller, key) as it stands, and when it was claimed.
    async fn idempotency_record(
        &self,
        caller: &str,
        key: &str,
    ) -> Result<Option<(Claim, i64)>, StoreError> {
        let row = sqlx::query(&self.sql(
            "SELECT fingerprint, status, body, created_at FROM idempotency_keys \
             WHERE caller = ? AND idem_key = ?",
        ))
        .bind(caller)
        .bind(key)
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let status: Option<i64> = row.try_get(1)?;
        let body = text_at(&row, 2)?;
        let claim = Claim::Taken {
            fingerprint: row.try_get(0)?,
            answer: status.zip(body).map(|(s, b)| (s as u16, b)),
        };
        Ok(Some((claim, row.try_get(3)?)))
    }

    /// Keeps the answer of a claimed call.
    pub async fn complete_idempotency_key(
        &self,
        caller: &str,
        key: &str,
        status: u16,
        body: &str,
    ) -> Result<(), StoreError> {
        sqlx::query(&self.sql(
            "UPDATE idempotency_keys SET status = ?, body = ? WHERE caller = ? AND idem_key = ?",
        ))
        .bind(status as i64)
        .bind(body)
        .bind(caller)
        .bind(key)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Lets a call that claimed its key at `claimed_at` and changed nothing be tried
    /// again; a claim another call took over since, or completed, stays.
    pub async fn release_idempotency_key(
        &self,
        caller: &str,
        key: &str,
        claimed_at: i64,
    ) -> Result<(), StoreError> {
        sqlx::query(&self.sql(
            "DELETE FROM idempotency_keys \
             WHERE caller = ? AND idem_key = ? AND status IS NULL AND created_at = ?",
        ))
        .bind(caller)
        .bind(key)
        .bind(claimed_at)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Removes up to `limit` records created before `before`; how many went.
    pub async fn forget_idempotency_keys(
        &self,
        before: i64,
        limit: i64,
    ) -> Result<u64, StoreError> {
        let q = match self.dialect {
            super::Dialect::MySql => {
                "DELETE FROM idempotency_keys WHERE created_at < ? ORDER BY created_at LIMIT ?"
                    .to_string()
            }
            _ => "DELETE FROM idempotency_keys WHERE (caller, idem_key) IN \
                  (SELECT caller, idem_key FROM idempotency_keys WHERE created_at < ? \
                  ORDER BY created_at LIMIT ?)"
                .to_string(),
        };
        Ok(sqlx::query(&self.sql(&q))
            .bind(before)
            .bind(limit)
            .execute(&self.pool)
            .await?
            .rows_affected())
    }
}
