//! Admin API keys at rest: a name, scopes, the SHA-256 of the secret, when the key was made,
//! rotated, last used and revoked. Creating, rotating and revoking are kept in the failover
//! window, so that a revocation cannot be undone by the database failing over.
//!
//! What it must never do: hold or return a key's secret (only its hash), or judge a scope
//! (the edge does).

use sqlx::Row;

use super::change::Change;
use super::{Store, StoreError};

pub use crate::model::ApiKeyRow;

const COLUMNS: &str =
    "id, name, scopes, secret_sha256, created_at, rotated_at, last_used_at, revoked_at";

fn row_of(r: &sqlx::any::AnyRow) -> Result<ApiKeyRow, StoreError> {
    Ok(ApiKeyRow {
        id: r.try_get(0)?,
        name: r.try_get(1)?,
        scopes: r.try_get(2)?,
        secret_sha256: r.try_get(3)?,
        created_at: r.try_get(4)?,
        rotated_at: r.try_get(5)?,
        last_used_at: r.try_get(6)?,
        revoked_at: r.try_get(7)?,
    })
}

impl Store {
    pub async fn create_api_key(&self, key: &ApiKeyRow) -> Result<(), StoreError> {
        let kept = self
            .keeps_changes()
            .then(|| Change::ApiKeyCreated { key: key.clone() });
        self.in_kept_tx(kept.as_ref(), |mut conn| async move {
            let q = format!(
                "{} VALUES (?, ?, ?, ?, ?, ?, ?, ?){}",
                self.insert_ignore(&format!("api_keys ({COLUMNS})")),
                self.on_conflict_nothing()
            );
            let done = sqlx::query(&self.sql(&q))
                .bind(key.id)
                .bind(key.name.as_str())
                .bind(key.scopes.as_str())
                .bind(key.secret_sha256.as_str())
                .bind(key.created_at)
                .bind(key.rotated_at)
                .bind(key.last_used_at)
                .bind(key.revoked_at)
                .execute(&mut *conn)
                .await
                .map(|_| ())
                .map_err(StoreError::from);
            (conn, done)
        })
        .await
    }

    /// Every key, revoked ones included, oldest first.
    pub async fn api_keys(&self) -> Result<Vec<ApiKeyRow>, StoreError> {
        let rows = sqlx::query(&self.sql(&format!("SELECT {COLUMNS} FROM api_keys ORDER BY id")))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(row_of).collect()
    }

    /// The keys not revoked: what every instance reloads every few seconds (a handful of
    /// rows, whatever was revoked before).
    pub async fn live_api_keys(&self) -> Result<Vec<ApiKeyRow>, StoreError> {
        let rows = sqlx::query(&self.sql(&format!(
            "SELECT {COLUMNS} FROM api_keys WHERE revoked_at IS NULL ORDER BY id"
        )))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(row_of).collect()
    }

    pub async fn api_key(&self, id: i64) -> Result<Option<ApiKeyRow>, StoreError> {
        let row = sqlx::query(&self.sql(&format!("SELECT {COLUMNS} FROM api_keys WHERE id = ?")))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(row_of).transpose()
    }

    /// Gives a live key a new secret; false when there is no such live key.
    pub async fn rotate_api_key(
        &self,
        id: i64,
        secret_sha256: &str,
        now: i64,
    ) -> Result<bool, StoreError> {
        let kept = self.keeps_changes().then(|| Change::ApiKeyRotated {
            id,
            secret_sha256: secret_sha256.to_string(),
            now,
        });
        self.in_kept_tx(kept.as_ref(), |mut conn| async move {
            let done = sqlx::query(&self.sql(
                "UPDATE api_keys SET secret_sha256 = ?, rotated_at = ? \
                 WHERE id = ? AND revoked_at IS NULL",
            ))
            .bind(secret_sha256)
            .bind(now)
            .bind(id)
            .execute(&mut *conn)
            .await
            .map(|r| r.rows_affected() == 1)
            .map_err(StoreError::from);
            (conn, done)
        })
        .await
    }

    /// Revokes a key; false when there is no such live key.
    pub async fn revoke_api_key(&self, id: i64, now: i64) -> Result<bool, StoreError> {
        let kept = self
            .keeps_changes()
            .then_some(Change::ApiKeyRevoked { id, now });
        self.in_kept_tx(kept.as_ref(), |mut conn| async move {
            let done = sqlx::query(
                &self.sql("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL"),
            )
            .bind(now)
            .bind(id)
            .execute(&mut *conn)
            .await
            .map(|r| r.rows_affected() == 1)
            .map_err(StoreError::from);
            (conn, done)
        })
        .await
    }

    /// Notes when keys were last used, (id, time); an earlier time never overwrites a later.
    pub async fn touch_api_keys(&self, used: &[(i64, i64)]) -> Result<(), StoreError> {
        for (id, at) in used {
            sqlx::query(&self.sql(
                "UPDATE api_keys SET last_used_at = ? \
                 WHERE id = ? AND (last_used_at IS NULL OR last_used_at < ?)",
            ))
            .bind(*at)
            .bind(*id)
            .bind(*at)
            .execute(&self.pool)
            .await?;
        }
        Ok(())
    }
}
