//! Sales: created; approved, edited and deleted while drafts; ended early; paused; each a
//! write kept in the failover window, its stock's movement in the journal. And the reads
//! of them: one, the approved ones and the mark that tells whether they changed, the
//! admin's list, a sale's live buyers and its counts.
//!
//! What it must never do: edit or delete a sale that is no longer a draft (a gate may hold
//! it), or move a sale's end later.

use std::collections::HashMap;

use sqlx::any::AnyRow;
use sqlx::Row;

use super::journal::{Cause, Movement};
use super::sql::int_pair;
use super::{change, Store, StoreError};
use crate::model::Sale;

/// The approved sales' figures folded into a few numbers (see
/// [`Store::approved_sales_mark`]): equal marks, the same sales as far as a cache can tell.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SalesMark([i64; 6]);

/// Counts of a sale's orders in SQL, by status.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SaleCounts {
    pub orders: i64,
    pub units: i64,
    pub by_status: HashMap<String, i64>,
}

impl Store {
    const SALE_COLS: &'static str =
        "id, title, price_cents, initial_stock, stock, per_user_limit, begins_at, \
         ends_at, payment_window_secs, status, paused, updated_at, anti_bot, segments, \
         room_admit_per_sec, room_prequeue_secs, external_ref";

    fn sale_from_row(row: &AnyRow) -> Result<Sale, sqlx::Error> {
        Ok(Sale {
            id: row.try_get(0)?,
            title: row.try_get(1)?,
            price_cents: row.try_get(2)?,
            initial_stock: row.try_get(3)?,
            stock: row.try_get(4)?,
            per_user_limit: row.try_get(5)?,
            begins_at: row.try_get(6)?,
            ends_at: row.try_get(7)?,
            payment_window_secs: row.try_get(8)?,
            approved: row.try_get::<String, _>(9)? == "approved",
            paused: row.try_get::<i64, _>(10)? != 0,
            updated_at: row.try_get(11)?,
            anti_bot: crate::model::AntiBot::parse(&row.try_get::<String, _>(12)?)
                .unwrap_or_default(),
            segments: row.try_get(13)?,
            waiting_room: match (
                row.try_get::<Option<i64>, _>(14)?,
                row.try_get::<Option<i64>, _>(15)?,
            ) {
                (Some(admit_per_sec), Some(prequeue_secs)) => Some(crate::model::WaitingRoom {
                    admit_per_sec,
                    prequeue_secs,
                }),
                _ => None,
            },
            external_ref: row.try_get(16)?,
        })
    }

    pub async fn create_sale(&self, s: &Sale) -> Result<(), StoreError> {
        let now = self.now_ms();
        let kept = self
            .keeps_changes()
            .then(|| change::Change::SaleCreated { sale: s.clone() });
        self.in_kept_tx(kept.as_ref(), |mut conn| async move {
            let done = self.create_sale_in_tx(&mut conn, s, now).await;
            (conn, done)
        })
        .await
    }

    async fn create_sale_in_tx(
        &self,
        conn: &mut sqlx::AnyConnection,
        s: &Sale,
        now: i64,
    ) -> Result<(), StoreError> {
        let q = format!(
            "INSERT INTO sales ({}, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            Self::SALE_COLS
        );
        sqlx::query(&self.sql(&q))
            .bind(s.id)
            .bind(s.title.as_str())
            .bind(s.price_cents)
            .bind(s.initial_stock)
            .bind(s.stock)
            .bind(s.per_user_limit)
            .bind(s.begins_at)
            .bind(s.ends_at)
            .bind(s.payment_window_secs)
            .bind(if s.approved { "approved" } else { "draft" })
            .bind(s.paused as i64)
            .bind(now)
            .bind(s.anti_bot.as_str())
            .bind(s.segments)
            .bind(s.waiting_room.map(|r| r.admit_per_sec))
            .bind(s.waiting_room.map(|r| r.prequeue_secs))
            .bind(s.external_ref.as_deref())
            .bind(now)
            .execute(&mut *conn)
            .await?;
        let created = Movement::new(s.id, s.stock, Cause::Created);
        self.journal_in(conn, &[created], now).await
    }

    /// Marks a sale approved; returns false when it was approved already.
    pub async fn approve_sale(&self, id: i64) -> Result<bool, StoreError> {
        let kept = self
            .keeps_changes()
            .then_some(change::Change::SaleApproved { id });
        let now = self.now_ms();
        let approved = self
            .in_kept_tx(kept.as_ref(), |mut conn| async move {
                let done = sqlx::query(&self.sql(
                    "UPDATE sales SET status = 'approved', updated_at = ? WHERE id = ? AND status = 'draft'",
                ))
                .bind(now)
                .bind(id)
                .execute(&mut *conn)
                .await;
                (conn, done.map(|d| d.rows_affected() == 1).map_err(StoreError::from))
            })
            .await?;
        if !approved {
            return match self.sale(id).await? {
                Some(_) => Ok(false),
                None => Err(StoreError::UnknownSale(id)),
            };
        }
        Ok(true)
    }

    /// Replaces a draft's settings; false when the sale is not a draft (or does not exist).
    pub async fn update_draft(&self, s: &Sale) -> Result<bool, StoreError> {
        let kept = self
            .keeps_changes()
            .then(|| change::Change::DraftUpdated { sale: s.clone() });
        self.in_kept_tx(kept.as_ref(), |mut conn| async move {
            let done = self.update_draft_in_tx(&mut conn, s).await;
            (conn, done)
        })
        .await
    }

    /// A draft's stock, locked; None when the sale is not a draft.
    async fn draft_stock_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        id: i64,
    ) -> Result<Option<i64>, StoreError> {
        let lock = self.for_update();
        let row = sqlx::query(&self.sql(&format!(
            "SELECT stock FROM sales WHERE id = ? AND status = 'draft'{lock}"
        )))
        .bind(id)
        .fetch_optional(&mut *conn)
        .await?;
        Ok(row.map(|r| r.try_get(0)).transpose()?)
    }

    async fn update_draft_in_tx(
        &self,
        conn: &mut sqlx::AnyConnection,
        s: &Sale,
    ) -> Result<bool, StoreError> {
        let Some(old_stock) = self.draft_stock_in(conn, s.id).await? else {
            return Ok(false);
        };
        let now = self.now_ms();
        let done = sqlx::query(&self.sql(
            "UPDATE sales SET title = ?, price_cents = ?, initial_stock = ?, stock = ?, \
             per_user_limit = ?, begins_at = ?, ends_at = ?, payment_window_secs = ?, \
             anti_bot = ?, segments = ?, room_admit_per_sec = ?, room_prequeue_secs = ?, \
             updated_at = ? WHERE id = ? AND status = 'draft'",
        ))
        .bind(s.title.as_str())
        .bind(s.price_cents)
        .bind(s.initial_stock)
        .bind(s.initial_stock)
        .bind(s.per_user_limit)
        .bind(s.begins_at)
        .bind(s.ends_at)
        .bind(s.payment_window_secs)
        .bind(s.anti_bot.as_str())
        .bind(s.segments)
        .bind(s.waiting_room.map(|r| r.admit_per_sec))
        .bind(s.waiting_room.map(|r| r.prequeue_secs))
        .bind(now)
        .bind(s.id)
        .execute(&mut *conn)
        .await?;
        if done.rows_affected() != 1 {
            return Ok(false);
        }
        if s.initial_stock != old_stock {
            let edited = Movement::new(s.id, s.initial_stock - old_stock, Cause::Edited);
            self.journal_in(conn, &[edited], now).await?;
        }
        Ok(true)
    }

    /// Deletes a draft; false when the sale is not a draft (or does not exist). A draft was
    /// never in a gate and has no orders; its stock leaves the journal with it.
    pub async fn delete_draft(&self, id: i64) -> Result<bool, StoreError> {
        let kept = self
            .keeps_changes()
            .then_some(change::Change::DraftDeleted { id });
        self.in_kept_tx(kept.as_ref(), |mut conn| async move {
            let done = async {
                let Some(stock) = self.draft_stock_in(&mut conn, id).await? else {
                    return Ok(false);
                };
                sqlx::query(&self.sql("DELETE FROM sales WHERE id = ? AND status = 'draft'"))
                    .bind(id)
                    .execute(&mut *conn)
                    .await?;
                // What was kept of the draft goes with it (a recount's record, its tallies).
                for table in ["recount_jobs", "sale_tallies"] {
                    sqlx::query(&self.sql(&format!("DELETE FROM {table} WHERE sale_id = ?")))
                        .bind(id)
                        .execute(&mut *conn)
                        .await?;
                }
                let deleted = Movement::new(id, -stock, Cause::Deleted);
                self.journal_in(&mut conn, &[deleted], self.now_ms())
                    .await?;
                Ok(true)
            }
            .await;
            (conn, done)
        })
        .await
    }

    /// Moves an approved sale's end to `at` when that is earlier (never later); the sale
    /// as it is afterwards.
    pub async fn end_early(&self, id: i64, at: i64) -> Result<Option<Sale>, StoreError> {
        let kept = self
            .keeps_changes()
            .then_some(change::Change::SaleEnded { id, at });
        let now = self.now_ms();
        self.in_kept_tx(kept.as_ref(), |mut conn| async move {
            let done = sqlx::query(&self.sql(
                "UPDATE sales SET ends_at = ?, updated_at = ? \
                 WHERE id = ? AND status = 'approved' AND ends_at > ?",
            ))
            .bind(at)
            .bind(now)
            .bind(id)
            .bind(at)
            .execute(&mut *conn)
            .await;
            (conn, done.map(|_| ()).map_err(StoreError::from))
        })
        .await?;
        self.sale(id).await
    }

    pub async fn set_paused(&self, id: i64, paused: bool) -> Result<(), StoreError> {
        let kept = self
            .keeps_changes()
            .then_some(change::Change::SalePaused { id, paused });
        let now = self.now_ms();
        let changed = self
            .in_kept_tx(kept.as_ref(), |mut conn| async move {
                let done = sqlx::query(
                    &self.sql("UPDATE sales SET paused = ?, updated_at = ? WHERE id = ?"),
                )
                .bind(paused as i64)
                .bind(now)
                .bind(id)
                .execute(&mut *conn)
                .await;
                (
                    conn,
                    done.map(|d| d.rows_affected()).map_err(StoreError::from),
                )
            })
            .await?;
        if changed == 0 {
            return Err(StoreError::UnknownSale(id));
        }
        Ok(())
    }

    /// The sale the shop knows by `external_ref`.
    pub async fn sale_by_external_ref(
        &self,
        external_ref: &str,
    ) -> Result<Option<Sale>, StoreError> {
        let q = format!(
            "SELECT {} FROM sales WHERE external_ref = ?",
            Self::SALE_COLS
        );
        let row = sqlx::query(&self.sql(&q))
            .bind(external_ref)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.as_ref().map(Self::sale_from_row).transpose()?)
    }

    pub async fn sale(&self, id: i64) -> Result<Option<Sale>, StoreError> {
        let q = format!("SELECT {} FROM sales WHERE id = ?", Self::SALE_COLS);
        self.one_by_key(&q, id, Self::sale_from_row).await
    }

    /// Approved sales that end after `ends_after`, oldest start first.
    pub async fn approved_sales(&self, ends_after: i64) -> Result<Vec<Sale>, StoreError> {
        let q = format!(
            "SELECT {} FROM sales WHERE status = 'approved' AND ends_at > ? ORDER BY begins_at, id",
            Self::SALE_COLS
        );
        self.all_rows(&q, &[ends_after], Self::sale_from_row).await
    }

    /// What says whether [`Store::approved_sales`] of `ends_after` changed, in one row:
    /// their number and sums of the columns every change of a cached figure moves
    /// (`updated_at` by each of them). A cache reads the sales again only when it differs.
    pub async fn approved_sales_mark(&self, ends_after: i64) -> Result<SalesMark, StoreError> {
        let q = format!(
            "SELECT COUNT(*), {}, {}, {}, {}, {} FROM sales WHERE status = 'approved' AND ends_at > ?",
            self.sum_int("updated_at"),
            self.sum_int("stock"),
            self.sum_int("paused"),
            self.sum_int("begins_at"),
            self.sum_int("ends_at"),
        );
        let row = sqlx::query(&self.sql(&q))
            .bind(ends_after)
            .fetch_one(&self.pool)
            .await?;
        let mut mark = [0i64; 6];
        for (i, v) in mark.iter_mut().enumerate() {
            *v = row.try_get(i)?;
        }
        Ok(SalesMark(mark))
    }

    /// Every sale, newest first (admin listing).
    pub async fn all_sales(&self, limit: i64) -> Result<Vec<Sale>, StoreError> {
        let q = format!(
            "SELECT {} FROM sales ORDER BY id DESC LIMIT ?",
            Self::SALE_COLS
        );
        self.all_rows(&q, &[limit], Self::sale_from_row).await
    }

    /// Units each user holds in live orders of a sale: what the gate must remember.
    pub async fn live_buyers(&self, sale_id: i64) -> Result<Vec<(i64, i64)>, StoreError> {
        self.units_by_buyer(
            "orders WHERE sale_id = ? AND status IN ('pending_payment', 'paid')",
            sale_id,
        )
        .await
    }

    /// (user, summed quantity) over `from_where`, whose one placeholder is the sale.
    pub(crate) async fn units_by_buyer(
        &self,
        from_where: &str,
        sale_id: i64,
    ) -> Result<Vec<(i64, i64)>, StoreError> {
        let q = format!(
            "SELECT user_id, {} FROM {from_where} GROUP BY user_id",
            self.sum_int("quantity")
        );
        self.all_rows(&q, &[sale_id], int_pair).await
    }

    /// The sale's orders by status and the units of its live ones, from its tallies and
    /// counters: a few rows, however many orders it holds.
    pub async fn sale_counts(&self, sale_id: i64) -> Result<SaleCounts, StoreError> {
        let tallies = self.tallies(sale_id).await?;
        let units = self.sql_account(sale_id).await?.map_or(0, |a| a.live_units);
        Ok(SaleCounts {
            orders: tallies.orders_written(),
            units,
            by_status: tallies.orders().into_iter().collect(),
        })
    }
}
