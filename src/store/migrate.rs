//! Bringing a database up to the schema: the migrations of `schema` not applied yet, in
//! version order, under a database-wide lock so that processes started together take
//! turns, then the phones' migration (written in Rust, in `users`); each recorded in
//! `schema_migrations` once applied.
//!
//! What it must never do: run a migration already recorded as applied, or leave the lock
//! behind (its connection is closed, never handed back to the pool).

use super::{schema, Dialect, Store, StoreError};

impl Store {
    /// Applies every migration not yet applied. Safe to run from several processes at
    /// once: they take turns under a database-wide lock.
    pub async fn migrate(&self) -> Result<Vec<i64>, StoreError> {
        let mut conn = self.pool.acquire().await?;
        let (lock, unlock) = match self.dialect {
            Dialect::Postgres => (
                "SELECT pg_advisory_lock(7362001)",
                "SELECT pg_advisory_unlock(7362001)",
            ),
            Dialect::MySql => (
                "SELECT GET_LOCK('seckill_migrate', 60)",
                "SELECT RELEASE_LOCK('seckill_migrate')",
            ),
            // SQLite's DDL is transactional: one immediate transaction is the lock.
            Dialect::Sqlite => ("BEGIN IMMEDIATE", "COMMIT"),
        };
        // Never back to the pool: a session lock (or SQLite's transaction) left behind by
        // an error or a cancelled start-up would hold every later migration off.
        conn.close_on_drop();
        sqlx::query(lock).execute(&mut *conn).await?;
        let result = self.migrate_locked(&mut conn).await;
        let unlock = if result.is_err() && self.dialect == Dialect::Sqlite {
            "ROLLBACK"
        } else {
            unlock
        };
        sqlx::query(unlock).execute(&mut *conn).await?;
        result
    }

    async fn migrate_locked(&self, conn: &mut sqlx::AnyConnection) -> Result<Vec<i64>, StoreError> {
        let int = if self.dialect == Dialect::Sqlite {
            "INTEGER"
        } else {
            "BIGINT"
        };
        sqlx::query(&format!(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version {int} PRIMARY KEY, applied_at {int} NOT NULL)"
        ))
        .execute(&mut *conn)
        .await?;
        let mut applied = Vec::new();
        for (version, statements) in schema::migrations(self.dialect) {
            let done =
                sqlx::query(&self.sql("SELECT version FROM schema_migrations WHERE version = ?"))
                    .bind(version)
                    .fetch_optional(&mut *conn)
                    .await?;
            if done.is_some() {
                continue;
            }
            for stmt in statements {
                if let Err(e) = sqlx::query(&stmt).execute(&mut *conn).await {
                    // A half-applied earlier run (MySQL DDL is not transactional) left it.
                    if !is_already_exists(&e) {
                        return Err(e.into());
                    }
                }
            }
            sqlx::query(
                &self.sql("INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)"),
            )
            .bind(version)
            .bind(self.now_ms())
            .execute(&mut *conn)
            .await?;
            applied.push(version);
        }
        let done =
            sqlx::query(&self.sql("SELECT version FROM schema_migrations WHERE version = ?"))
                .bind(schema::PHONES_NORMALISED)
                .fetch_optional(&mut *conn)
                .await?;
        if done.is_none() {
            self.normalise_phones(conn).await?;
            sqlx::query(
                &self.sql("INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)"),
            )
            .bind(schema::PHONES_NORMALISED)
            .bind(self.now_ms())
            .execute(&mut *conn)
            .await?;
            applied.push(schema::PHONES_NORMALISED);
        }
        // In version order (the phones' migration runs after every SQL one).
        applied.sort_unstable();
        Ok(applied)
    }
}

fn is_already_exists(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.to_string()).unwrap_or_default();
            // PG duplicate_table/duplicate_object, MySQL duplicate key name, SQLite "already exists".
            // Likewise for a column added twice (PG duplicate_column, MySQL, SQLite).
            matches!(code.as_str(), "42P07" | "42710" | "42701")
                || db.message().contains("already exists")
                || db.message().contains("Duplicate key name")
                || db.message().contains("Duplicate column name")
                || db.message().contains("duplicate column name")
        }
        _ => false,
    }
}
