//! Users and their logins: a user by phone (created at its first login), users in bulk,
//! the login codes and the guesses a phone may make at them, and the phones' migration,
//! which rewrites every stored number to E.164.
//!
//! What it must never do: merge two users silently (a user whose phone would name another
//! user once normalised keeps its old text and is listed in `phone_conflicts`), or compare
//! a code (its caller does, after taking a guess).

use sqlx::Row;

use super::{change, Dialect, Store, StoreError};

impl Store {
    /// The id of the user with this phone, creating the user with `new_id` if needed.
    pub async fn user_for_phone(&self, phone: &str, new_id: i64) -> Result<i64, StoreError> {
        let existing = sqlx::query(&self.sql("SELECT id FROM users WHERE phone = ?"))
            .bind(phone)
            .fetch_optional(&self.pool)
            .await?;
        if let Some(row) = existing {
            return Ok(row.try_get::<i64, _>(0)?);
        }
        self.insert_users_kept(&[(new_id, phone.to_string())])
            .await?;
        let row = sqlx::query(&self.sql("SELECT id FROM users WHERE phone = ?"))
            .bind(phone)
            .fetch_one(&self.pool)
            .await?;
        Ok(row.try_get::<i64, _>(0)?)
    }

    /// Inserts users in bulk (for load tests); `users` are (id, phone).
    pub async fn insert_users(&self, users: &[(i64, String)]) -> Result<(), StoreError> {
        for chunk in users.chunks(500) {
            self.insert_users_kept(chunk).await?;
        }
        Ok(())
    }

    /// Users of (id, phone), those not there yet, in one transaction kept in the failover
    /// window.
    async fn insert_users_kept(&self, users: &[(i64, String)]) -> Result<(), StoreError> {
        let kept = self.keeps_changes().then(|| change::Change::Users {
            users: users.to_vec(),
        });
        self.in_kept_tx(kept.as_ref(), |mut conn| async move {
            let done = self.insert_users_in(&mut conn, users).await;
            (conn, done)
        })
        .await
    }

    /// Users of the failover window written again: those already there are passed over.
    pub(super) async fn insert_users_again(
        &self,
        users: &[(i64, String)],
    ) -> Result<(), StoreError> {
        self.insert_users_kept(users).await
    }

    async fn insert_users_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        users: &[(i64, String)],
    ) -> Result<(), StoreError> {
        let now = self.now_ms();
        for chunk in users.chunks(500) {
            let values = vec!["(?, ?, ?)"; chunk.len()].join(",");
            let q = format!(
                "{} VALUES {values}{}",
                self.insert_ignore("users (id, phone, created_at)"),
                self.on_conflict_nothing()
            );
            let q = self.sql(&q);
            // One statement shape per batch size: caching each would hold thousands of
            // prepared statements per connection.
            let mut query = sqlx::query(&q).persistent(false);
            for (id, phone) in chunk {
                query = query.bind(*id).bind(phone.as_str()).bind(now);
            }
            query.execute(&mut *conn).await?;
        }
        Ok(())
    }

    /// Records buyers of the shop's tokens, (id, issuer, subject), those not there yet; an
    /// id already recorded keeps its pair. Answers the ids recorded under another pair
    /// (two pairs whose ids collide), which must not be merged silently.
    pub async fn register_shop_buyers(
        &self,
        buyers: &[(i64, String, String)],
    ) -> Result<Vec<i64>, StoreError> {
        let now = self.now_ms();
        let mut collided = Vec::new();
        for chunk in buyers.chunks(500) {
            let values = vec!["(?, ?, ?, ?)"; chunk.len()].join(",");
            let q = format!(
                "{} VALUES {values}{}",
                self.insert_ignore("shop_buyers (user_id, issuer, subject, created_at)"),
                self.on_conflict_nothing()
            );
            let q = self.sql(&q);
            let mut query = sqlx::query(&q).persistent(false);
            for (id, issuer, subject) in chunk {
                query = query
                    .bind(*id)
                    .bind(issuer.as_str())
                    .bind(subject.as_str())
                    .bind(now);
            }
            let inserted = query.execute(&self.pool).await?.rows_affected();
            if inserted == chunk.len() as u64 {
                continue;
            }
            for (id, issuer, subject) in chunk {
                let row = sqlx::query(
                    &self.sql("SELECT issuer, subject FROM shop_buyers WHERE user_id = ?"),
                )
                .bind(*id)
                .fetch_optional(&self.pool)
                .await?;
                if let Some(row) = row {
                    let (i, s): (String, String) = (row.try_get(0)?, row.try_get(1)?);
                    if (&i, &s) != (issuer, subject) {
                        collided.push(*id);
                    }
                }
            }
        }
        Ok(collided)
    }

    /// The (issuer, subject) a shop buyer was made from.
    pub async fn shop_buyer(&self, id: i64) -> Result<Option<(String, String)>, StoreError> {
        let row =
            sqlx::query(&self.sql("SELECT issuer, subject FROM shop_buyers WHERE user_id = ?"))
                .bind(id)
                .fetch_optional(&self.pool)
                .await?;
        Ok(match row {
            Some(r) => Some((r.try_get(0)?, r.try_get(1)?)),
            None => None,
        })
    }

    pub async fn user_exists(&self, id: i64) -> Result<bool, StoreError> {
        let row = sqlx::query(&self.sql("SELECT 1 FROM users WHERE id = ?"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.is_some())
    }

    /// When the current code for `phone` was issued, if one is live.
    pub async fn login_code_issued_at(
        &self,
        phone: &str,
        now: i64,
    ) -> Result<Option<i64>, StoreError> {
        let row = sqlx::query(
            &self.sql("SELECT created_at FROM login_codes WHERE phone = ? AND expires_at > ?"),
        )
        .bind(phone)
        .bind(now)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|r| r.try_get::<i64, _>(0)).transpose()?)
    }

    pub async fn put_login_code(
        &self,
        phone: &str,
        code: &str,
        now: i64,
        expires_at: i64,
    ) -> Result<(), StoreError> {
        let q = match self.dialect {
            Dialect::MySql => "INSERT INTO login_codes (phone, code, created_at, expires_at, attempts) VALUES (?, ?, ?, ?, 0) \
                 ON DUPLICATE KEY UPDATE code = VALUES(code), created_at = VALUES(created_at), \
                 expires_at = VALUES(expires_at), attempts = 0",
            _ => "INSERT INTO login_codes (phone, code, created_at, expires_at, attempts) VALUES (?, ?, ?, ?, 0) \
                 ON CONFLICT (phone) DO UPDATE SET code = excluded.code, created_at = excluded.created_at, \
                 expires_at = excluded.expires_at, attempts = 0",
        };
        sqlx::query(&self.sql(q))
            .bind(phone)
            .bind(code)
            .bind(now)
            .bind(expires_at)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Spends one attempt on the live code of `phone` and returns it, or None when there is
    /// no live code or its attempts are used up.
    pub async fn spend_login_attempt(
        &self,
        phone: &str,
        now: i64,
        max_attempts: i64,
    ) -> Result<Option<String>, StoreError> {
        let done = sqlx::query(&self.sql(
            "UPDATE login_codes SET attempts = attempts + 1 WHERE phone = ? AND expires_at > ? AND attempts < ?",
        ))
        .bind(phone)
        .bind(now)
        .bind(max_attempts)
        .execute(&self.pool)
        .await?;
        if done.rows_affected() == 0 {
            return Ok(None);
        }
        let row = sqlx::query(&self.sql("SELECT code FROM login_codes WHERE phone = ?"))
            .bind(phone)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|r| r.try_get::<String, _>(0)).transpose()?)
    }

    /// Takes one of `phone`'s guesses at a login code for the current window (`window_ms`
    /// long, opened by its first guess), or answers when the window ends if all `cap` are
    /// taken. Taken before the code is compared, so that concurrent guesses cannot pass
    /// the cap together; a right code gives its guess back (`refund_login_guess`).
    pub async fn take_login_guess(
        &self,
        phone: &str,
        now: i64,
        cap: i64,
        window_ms: i64,
    ) -> Result<Option<i64>, StoreError> {
        let q = format!(
            "{} VALUES (?, ?, 0){}",
            self.insert_ignore("login_guesses (phone, window_start, guesses)"),
            self.on_conflict_nothing()
        );
        sqlx::query(&self.sql(&q))
            .bind(phone)
            .bind(now)
            .execute(&self.pool)
            .await?;
        sqlx::query(&self.sql(
            "UPDATE login_guesses SET guesses = 0, window_start = ? WHERE phone = ? AND window_start <= ?",
        ))
        .bind(now)
        .bind(phone)
        .bind(now.saturating_sub(window_ms))
        .execute(&self.pool)
        .await?;
        let taken =
            sqlx::query(&self.sql(
                "UPDATE login_guesses SET guesses = guesses + 1 WHERE phone = ? AND guesses < ?",
            ))
            .bind(phone)
            .bind(cap)
            .execute(&self.pool)
            .await?;
        if taken.rows_affected() == 1 {
            return Ok(None);
        }
        self.login_locked_until(phone, now, cap, window_ms).await
    }

    /// Gives back the guess of a right code.
    pub async fn refund_login_guess(&self, phone: &str) -> Result<(), StoreError> {
        sqlx::query(
            &self.sql(
                "UPDATE login_guesses SET guesses = guesses - 1 WHERE phone = ? AND guesses > 0",
            ),
        )
        .bind(phone)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// When `phone` may guess again, if it has used up its `cap` guesses of the window.
    pub async fn login_locked_until(
        &self,
        phone: &str,
        now: i64,
        cap: i64,
        window_ms: i64,
    ) -> Result<Option<i64>, StoreError> {
        let row = sqlx::query(&self.sql(
            "SELECT window_start FROM login_guesses WHERE phone = ? AND guesses >= ? AND window_start > ?",
        ))
        .bind(phone)
        .bind(cap)
        .bind(now.saturating_sub(window_ms))
        .fetch_optional(&self.pool)
        .await?;
        Ok(match row {
            Some(r) => Some(r.try_get::<i64, _>(0)?.saturating_add(window_ms)),
            None => None,
        })
    }

    pub async fn delete_login_code(&self, phone: &str) -> Result<(), StoreError> {
        sqlx::query(&self.sql("DELETE FROM login_codes WHERE phone = ?"))
            .bind(phone)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Rewrites every stored phone to E.164 (`text::normalize_phone`, in the store's phone
    /// region), so that a user logs in by any spelling of their number. A user whose
    /// number names another user once normalised, or whose number is not valid, keeps its
    /// old text (which no login can produce any more) and is listed in `phone_conflicts`
    /// and the log: two accounts are never merged silently. Users are read a page at a
    /// time, so a large table is walked in bounded memory.
    pub(super) async fn normalise_phones(
        &self,
        conn: &mut sqlx::AnyConnection,
    ) -> Result<(), StoreError> {
        const PAGE: i64 = 1000;
        let region = self.phone_region;
        let (mut after, mut rewritten, mut kept) = (i64::MIN, 0u64, 0u64);
        loop {
            let rows = sqlx::query(
                &self.sql("SELECT id, phone FROM users WHERE id > ? ORDER BY id LIMIT ?"),
            )
            .bind(after)
            .bind(PAGE)
            .fetch_all(&mut *conn)
            .await?;
            let Some(last) = rows.last() else { break };
            after = last.try_get(0)?;
            for r in &rows {
                let (id, phone): (i64, String) = (r.try_get(0)?, r.try_get(1)?);
                let normal = match crate::text::normalize_phone(&phone, region) {
                    Ok(n) if n == phone => continue,
                    Ok(n) => n,
                    Err(e) => {
                        self.keep_phone(conn, id, &phone, "", None, &e.to_string())
                            .await?;
                        kept += 1;
                        continue;
                    }
                };
                let other = sqlx::query(&self.sql("SELECT id FROM users WHERE phone = ?"))
                    .bind(&normal)
                    .fetch_optional(&mut *conn)
                    .await?;
                if let Some(other) = other {
                    let other: i64 = other.try_get(0)?;
                    let why = "another user holds this number in E.164";
                    self.keep_phone(conn, id, &phone, &normal, Some(other), why)
                        .await?;
                    kept += 1;
                    continue;
                }
                sqlx::query(&self.sql("UPDATE users SET phone = ? WHERE id = ?"))
                    .bind(&normal)
                    .bind(id)
                    .execute(&mut *conn)
                    .await?;
                rewritten += 1;
            }
        }
        // Codes were keyed by the old spellings; a buyer asks for a new one.
        sqlx::query("DELETE FROM login_codes")
            .execute(&mut *conn)
            .await?;
        if rewritten + kept > 0 {
            tracing::info!(
                rewritten,
                kept,
                "stored phone numbers normalised to E.164; users kept apart are listed in \
                 the phone_conflicts table"
            );
        }
        Ok(())
    }

    /// Records a user whose phone the normalisation left as it was, and why.
    async fn keep_phone(
        &self,
        conn: &mut sqlx::AnyConnection,
        user_id: i64,
        phone: &str,
        normal: &str,
        other: Option<i64>,
        why: &str,
    ) -> Result<(), StoreError> {
        tracing::warn!(
            user_id,
            phone,
            normalised = normal,
            other_user_id = other,
            "phone number not normalised: {why}; the user cannot log in by phone until an \
             operator resolves it (table phone_conflicts)"
        );
        let q = format!(
            "{} VALUES (?, ?, ?, ?, ?, ?){}",
            self.insert_ignore(
                "phone_conflicts (user_id, phone, normalised, other_user_id, reason, found_at)"
            ),
            self.on_conflict_nothing()
        );
        sqlx::query(&self.sql(&q))
            .bind(user_id)
            .bind(phone)
            .bind(normal)
            .bind(other)
            .bind(why)
            .bind(self.now_ms())
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}
