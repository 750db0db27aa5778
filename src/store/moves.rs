//! SQL side of the moves of stock between the segments of a sale (see `gate::rebalance`). A move
//! is planned here before any unit leaves its donor, and each later step is a guarded
//! state change, so a rebuild of either segment (which reads these rows) and the mover
//! never disagree on whether the units moved: planned -> taken -> done, or -> refused.

use sqlx::Row;

use super::journal::{Cause, Movement};
use super::{Store, StoreError};

/// What a move of stock between segments was, as one segment remembers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoveMark {
    /// Units left this segment (the donor).
    Taken,
    /// The donor refused (or never took) the units: the move never happens.
    Refused,
    /// Units came into this segment (the receiver).
    Given,
}

impl MoveMark {
    pub fn as_str(self) -> &'static str {
        match self {
            MoveMark::Taken => "taken",
            MoveMark::Refused => "refused",
            MoveMark::Given => "given",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentMove {
    pub id: i64,
    pub sale_id: i64,
    pub from_segment: i64,
    pub to_segment: i64,
    pub quantity: i64,
    /// planned | taken | done | refused
    pub state: String,
    pub updated_at: i64,
}

const MOVE_COLS: &str =
    "id, sale_id, from_segment, to_segment, quantity, state, updated_at FROM segment_moves";

fn move_from_row(r: &sqlx::any::AnyRow) -> Result<SegmentMove, sqlx::Error> {
    Ok(SegmentMove {
        id: r.try_get(0)?,
        sale_id: r.try_get(1)?,
        from_segment: r.try_get(2)?,
        to_segment: r.try_get(3)?,
        quantity: r.try_get(4)?,
        state: r.try_get(5)?,
        updated_at: r.try_get(6)?,
    })
}

impl Store {
    /// Records a move before its donor gives anything.
    pub async fn plan_move(&self, m: &SegmentMove) -> Result<(), StoreError> {
        let now = self.now_ms();
        sqlx::query(&self.sql(
            "INSERT INTO segment_moves (id, sale_id, from_segment, to_segment, quantity, state, created_at, updated_at) \
             VALUES (?, ?, ?, ?, ?, 'planned', ?, ?)",
        ))
        .bind(m.id)
        .bind(m.sale_id)
        .bind(m.from_segment)
        .bind(m.to_segment)
        .bind(m.quantity)
        .bind(now)
        .bind(now)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Moves a move from state `from` to `to`; false when it was not in `from` (a rebuild
    /// of its donor refused it meanwhile, or another mover advanced it).
    pub async fn advance_move(&self, id: i64, from: &str, to: &str) -> Result<bool, StoreError> {
        self.in_write_tx(|mut conn| async move {
            let done = self.advance_move_in_tx(&mut conn, id, from, to).await;
            (conn, done)
        })
        .await
    }

    /// A move takes effect in SQL's account when it is `taken`: its two journal rows (out
    /// of the donor, into the recipient) commit with that step, so the sale's total is
    /// never off by the units in transit.
    async fn advance_move_in_tx(
        &self,
        conn: &mut sqlx::AnyConnection,
        id: i64,
        from: &str,
        to: &str,
    ) -> Result<bool, StoreError> {
        let now = self.now_ms();
        let done =
            sqlx::query(&self.sql(
                "UPDATE segment_moves SET state = ?, updated_at = ? WHERE id = ? AND state = ?",
            ))
            .bind(to)
            .bind(now)
            .bind(id)
            .bind(from)
            .execute(&mut *conn)
            .await?;
        if done.rows_affected() != 1 {
            return Ok(false);
        }
        if to != "taken" && from != "taken" {
            return Ok(true);
        }
        let row = sqlx::query(&self.sql(
            "SELECT sale_id, from_segment, to_segment, quantity FROM segment_moves WHERE id = ?",
        ))
        .bind(id)
        .fetch_one(&mut *conn)
        .await?;
        let (sale, out_of, into, q): (i64, i64, i64, i64) = (
            row.try_get(0)?,
            row.try_get(1)?,
            row.try_get(2)?,
            row.try_get(3)?,
        );
        // Units are in transit from `taken` until the move leaves that state.
        let in_transit = super::counters::Bump {
            units_in_transit: if to == "taken" { q } else { -q },
            ..Default::default()
        };
        self.bump_in(conn, sale, in_transit).await?;
        if to == "taken" {
            let detail = format!("move {id}");
            let rows = [
                Movement::new(sale, -q, Cause::MovedOut)
                    .segment(out_of)
                    .by("rebalancer", &detail),
                Movement::new(sale, q, Cause::MovedIn)
                    .segment(into)
                    .by("rebalancer", &detail),
            ];
            self.journal_in(conn, &rows, now).await?;
        }
        Ok(true)
    }

    pub async fn segment_move(&self, id: i64) -> Result<Option<SegmentMove>, StoreError> {
        let q = format!("SELECT {MOVE_COLS} WHERE id = ?");
        self.one_by_key(&q, id, move_from_row).await
    }

    /// Units of a sale's moves not finished yet (planned or taken): in neither segment
    /// for now, or about to leave one.
    pub async fn units_moving(&self, sale_id: i64) -> Result<i64, StoreError> {
        let q = format!(
            "SELECT {} FROM segment_moves WHERE sale_id = ? AND state IN ('planned', 'taken')",
            self.sum_int("quantity")
        );
        let row = sqlx::query(&self.sql(&q))
            .bind(sale_id)
            .fetch_one(&self.pool)
            .await?;
        Ok(row.try_get(0)?)
    }

    /// Unfinished moves last changed before `before` (their mover has died or stalled).
    pub async fn stalled_moves(
        &self,
        before: i64,
        limit: i64,
    ) -> Result<Vec<SegmentMove>, StoreError> {
        let q = format!(
            "SELECT {MOVE_COLS} WHERE state IN ('planned', 'taken') AND updated_at < ? ORDER BY id LIMIT ?"
        );
        self.all_rows(&q, &[before, limit], move_from_row).await
    }

    /// Every move of a sale, oldest first (for checks and the audit).
    pub async fn moves_of_sale(&self, sale_id: i64) -> Result<Vec<SegmentMove>, StoreError> {
        let q = format!("SELECT {MOVE_COLS} WHERE sale_id = ? ORDER BY id");
        self.all_rows(&q, &[sale_id], move_from_row).await
    }
}
