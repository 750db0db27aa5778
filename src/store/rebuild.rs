//! What a gate is rebuilt from: a sale's (or one segment's) state in SQL, read in one
//! snapshot while its row is locked, after the order writers holding batches read from
//! Redis have written them (the writer fence they share-lock, and a rebuild locks alone).

use sqlx::Row;

use super::{Dialect, Store, StoreError, WriteTx};

/// Whether the database gave up waiting for a lock (PostgreSQL's lock_timeout, MySQL's
/// innodb_lock_wait_timeout).
fn is_lock_timeout(e: &StoreError) -> bool {
    match e {
        StoreError::Db(sqlx::Error::Database(db)) => {
            db.code().as_deref() == Some("55P03") || db.message().contains("Lock wait timeout")
        }
        _ => false,
    }
}

/// A sale's state in SQL, as the gate is rebuilt from it (see [`Store::load_snapshot`]).
#[derive(Debug, Clone, Default)]
pub struct LoadSnapshot {
    pub stock: i64,
    /// Cancelled or expired orders whose units `stock` counts back: every one, for a gate
    /// that keeps order ids; else those whose return the gate is still owed (the outbox).
    pub released: Vec<i64>,
    /// (user_id, units held in live orders).
    pub buyers: Vec<(i64, i64)>,
    /// Every order of the sale in SQL, for a gate that keeps order ids; else empty.
    pub counted: Vec<i64>,
    /// The buyers of more than one live order, with their totals: what a `HeldSink` handed
    /// out of them is not their units (with order ids only; else empty).
    pub repeat_buyers: Vec<(i64, i64)>,
    /// Moves between segments this snapshot's stock counts (segmented sales only).
    pub moves: Vec<(i64, super::moves::MoveMark)>,
}

/// Where a snapshot's read hands the live holdings of each chunk of orders as soon as it has
/// read them, so that a gate can take them in while the next chunk is read. A buyer with
/// several orders appears once per order, in one chunk or several: the snapshot's
/// `repeat_buyers` lists them with their totals.
pub type HeldSink<'a> = &'a mut (dyn FnMut(Vec<(i64, i64)>) + Send);

/// What one packed row of orders yields to its reader: an order's fields, then the end of
/// the row.
enum Packed<'a> {
    Order(usize, &'a [i64]),
    ChunkEnd,
}

/// Which part of a sale a snapshot is of: one segment of `segments` (0 of 1: all of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub segments: i64,
    pub segment: i64,
}

impl Part {
    pub const WHOLE: Part = Part {
        segments: 1,
        segment: 0,
    };

    fn holds(&self, user_id: i64) -> bool {
        crate::model::segments::segment_of(user_id, self.segments) == self.segment
    }
}

/// Live orders per chunk of [`Store::live_holdings`]: about 500 KB of text.
const LIVE_CHUNK: i64 = 20_000;

/// A text column that MySQL's drivers may call a BLOB (a long GROUP_CONCAT is sent as one).
fn text_at(row: &sqlx::any::AnyRow, i: usize) -> Result<Option<String>, StoreError> {
    match row.try_get::<Option<String>, _>(i) {
        Ok(text) => Ok(text),
        Err(_) => match row.try_get::<Option<Vec<u8>>, _>(i)? {
            Some(bytes) => String::from_utf8(bytes)
                .map(Some)
                .map_err(|e| StoreError::Db(sqlx::Error::Decode(e.into()))),
            None => Ok(None),
        },
    }
}

/// An order that holds its units (`OrderStatus::LIVE`).
const LIVE: &str = "status IN ('pending_payment', 'paid')";

/// What [`Store::every_order`] reads.
#[derive(Default)]
struct EveryOrder {
    held: Vec<(i64, i64)>,
    counted: Vec<i64>,
    released: Vec<i64>,
    repeat_buyers: Vec<(i64, i64)>,
}

/// The buyers of `part`, one pair each: a buyer of several orders has their units summed.
fn one_pair_per_buyer(held: Vec<(i64, i64)>, part: Part) -> Vec<(i64, i64)> {
    buyers_and_repeats(held, part).0
}

/// A buyer and the units they hold.
type Held = (i64, i64);

/// [`one_pair_per_buyer`], and the buyers of more than one pair with their totals.
fn buyers_and_repeats(mut held: Vec<Held>, part: Part) -> (Vec<Held>, Vec<Held>) {
    held.retain(|(user, _)| part.holds(*user));
    held.sort_unstable_by_key(|(user, _)| *user);
    let mut repeats = Vec::new();
    let mut pairs = 1;
    held.dedup_by(|next, kept| {
        let same = next.0 == kept.0;
        if same {
            kept.1 += next.1;
            pairs += 1;
        } else {
            if pairs > 1 {
                repeats.push(*kept);
            }
            pairs = 1;
        }
        same
    });
    if pairs > 1 {
        repeats.extend(held.last().copied());
    }
    (held, repeats)
}

impl Store {
    /// What the gate is rebuilt from, read in one snapshot while the sale's row is locked
    /// (no order write or return of the sale can fall between its parts): the SQL stock,
    /// every cancelled or expired order (the stock counts their units back, whether or not
    /// their return reached a gate: a release of one later is a repeat), the units each
    /// buyer holds in live orders, and every order of the sale (the stock counts them all).
    ///
    /// On PostgreSQL and MySQL it first waits (up to `wait_for_writers`) until no order
    /// writer holds a batch read from Redis (the writer fence): a batch read before Redis
    /// lost its data is then in SQL, and in the snapshot. A writer stalled longer than that
    /// is not waited for; its orders reach the gate through `Gate::confirm_written`.
    pub async fn load_snapshot(
        &self,
        sale_id: i64,
        wait_for_writers: std::time::Duration,
    ) -> Result<LoadSnapshot, StoreError> {
        self.load_part_snapshot(sale_id, Part::WHOLE, wait_for_writers, true)
            .await
    }

    /// [`Store::load_snapshot`] of one segment of a segmented sale: its allocation (even
    /// share plus the moves that took effect) less its buyers' live units, and only its
    /// buyers and orders. Moves out of it still only planned are refused here, in the
    /// snapshot's transaction: the rebuilt segment never gives those units.
    ///
    /// `order_ids`: whether the gate keeps order ids (`Gate::keeps_order_ids`); without
    /// them the snapshot reads the live orders, a chunk of them per row (`live_holdings`),
    /// and the outbox only; with them every order, packed the same way (`every_order`).
    /// Either way a million orders are read in fifty rows, never a row per order.
    pub async fn load_part_snapshot(
        &self,
        sale_id: i64,
        part: Part,
        wait_for_writers: std::time::Duration,
        order_ids: bool,
    ) -> Result<LoadSnapshot, StoreError> {
        self.load_part_snapshot_streamed(sale_id, part, wait_for_writers, order_ids, None)
            .await
    }

    /// [`Store::load_part_snapshot`], handing each chunk's live holdings to `sink` as it
    /// reads them: a snapshot with order ids behind the writer fence (the distributed
    /// rebuild). An embedded or unfenced read hands out nothing.
    pub async fn load_part_snapshot_streamed(
        &self,
        sale_id: i64,
        part: Part,
        wait_for_writers: std::time::Duration,
        order_ids: bool,
        mut sink: Option<HeldSink<'_>>,
    ) -> Result<LoadSnapshot, StoreError> {
        if self.dialect != Dialect::Sqlite && !wait_for_writers.is_zero() {
            let streams = order_ids && sink.is_some();
            let mut chunks = 0usize;
            let mut counting = |held: Vec<(i64, i64)>| {
                chunks += 1;
                if let Some(sink) = sink.as_mut() {
                    sink(held);
                }
            };
            let counted: Option<HeldSink<'_>> = if streams { Some(&mut counting) } else { None };
            let fenced = self
                .load_snapshot_fenced(sale_id, part, wait_for_writers, order_ids, counted)
                .await;
            match fenced {
                // The locks come before any chunk: nothing was handed out yet.
                Err(e) if is_lock_timeout(&e) && chunks == 0 => {
                    tracing::warn!(
                        sale = sale_id,
                        waited_ms = wait_for_writers.as_millis() as u64,
                        "an order writer has held a batch this long (stalled?): rebuilding without it; its orders join the gate when it writes them"
                    );
                }
                // Chunks handed out, then a lock timeout (a segment's planned moves): the
                // load fails rather than mixing chunks of two reads.
                other => return other,
            }
        }
        // Not handed out: a retried transaction would hand out its chunks twice.
        self.in_write_tx(|mut conn| async move {
            let read = self
                .load_snapshot_in_tx(&mut conn, sale_id, part, order_ids, None)
                .await;
            (conn, read)
        })
        .await
    }

    async fn load_snapshot_fenced(
        &self,
        sale_id: i64,
        part: Part,
        wait: std::time::Duration,
        order_ids: bool,
        sink: Option<HeldSink<'_>>,
    ) -> Result<LoadSnapshot, StoreError> {
        let mut conn = self.begin_write().await?;
        // Never a gate from a database the failover window is not settled against yet: it
        // may lack orders the window is about to write back.
        self.check_identity_in(&mut conn).await?;
        let read = async {
            let secs = wait.as_secs().max(1);
            let timeout = match self.dialect {
                Dialect::Postgres => format!("SET LOCAL lock_timeout = '{secs}s'"),
                _ => format!("SET SESSION innodb_lock_wait_timeout = {secs}"),
            };
            sqlx::query(&timeout).execute(&mut *conn).await?;
            // PostgreSQL queues table locks first come, first served: writers arriving
            // after this request wait behind it (row locks would let sharers starve it).
            let exclusive = match self.dialect {
                Dialect::Postgres => "LOCK TABLE writer_fence IN EXCLUSIVE MODE",
                _ => "SELECT id FROM writer_fence WHERE id = 1 FOR UPDATE",
            };
            sqlx::query(exclusive).execute(&mut *conn).await?;
            self.load_snapshot_in_tx(&mut conn, sale_id, part, order_ids, sink)
                .await
        }
        .await;
        match read {
            Ok(snapshot) => {
                Self::finish(conn, true).await?;
                Ok(snapshot)
            }
            Err(e) => {
                // The error that matters is the read's, not the rollback's.
                let _ = Self::finish(conn, false).await;
                Err(e)
            }
        }
    }

    /// Share-locks the writer fence for as long as the returned connection's transaction
    /// is open: an order writer holds it from before it reads a batch from Redis until
    /// the batch is in SQL. `None` on SQLite (no distributed deployment runs on it).
    pub async fn hold_writer_fence(&self) -> Result<Option<WriteTx>, StoreError> {
        let share = match self.dialect {
            Dialect::Sqlite => return Ok(None),
            Dialect::Postgres => "LOCK TABLE writer_fence IN ROW SHARE MODE",
            Dialect::MySql => "SELECT id FROM writer_fence WHERE id = 1 LOCK IN SHARE MODE",
        };
        let mut conn = self.begin_with("BEGIN").await?;
        if let Err(e) = sqlx::query(share).execute(&mut *conn).await {
            let _ = Self::finish(conn, false).await;
            return Err(e.into());
        }
        Ok(Some(conn))
    }

    /// Ends a hold of [`Store::hold_writer_fence`].
    pub async fn release_writer_fence(conn: Option<WriteTx>) -> Result<(), StoreError> {
        match conn {
            Some(conn) => Self::finish(conn, true).await,
            None => Ok(()),
        }
    }

    async fn load_snapshot_in_tx(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
        part: Part,
        order_ids: bool,
        sink: Option<HeldSink<'_>>,
    ) -> Result<LoadSnapshot, StoreError> {
        use futures_util::TryStreamExt;
        let lock = match self.dialect {
            // BEGIN IMMEDIATE already holds SQLite's one write lock.
            Dialect::Sqlite => "SELECT stock, initial_stock FROM sales WHERE id = ?",
            _ => "SELECT stock, initial_stock FROM sales WHERE id = ? FOR UPDATE",
        };
        let row = sqlx::query(&self.sql(lock))
            .bind(sale_id)
            .fetch_optional(&mut *conn)
            .await?;
        let (stock, initial): (i64, i64) = match row {
            Some(r) => (r.try_get(0)?, r.try_get(1)?),
            None => return Err(StoreError::UnknownSale(sale_id)),
        };
        let mut released = Vec::new();
        let mut repeats = Vec::new();
        let (buyers, counted) = if order_ids {
            let orders = self.every_order(conn, sale_id, part, sink).await?;
            released = orders.released;
            repeats = orders.repeat_buyers;
            (orders.held, orders.counted)
        } else {
            let held = self.live_holdings(conn, sale_id, part).await?;
            // Returns the gate is still owed: the only releases of earlier orders that can
            // reach a gate loaded now (one returned before it started is never sent again).
            let q = self.sql(
                "SELECT order_id, user_id FROM stock_returns WHERE sale_id = ? AND gate_done_at IS NULL",
            );
            let mut owed = sqlx::query(&q).bind(sale_id).fetch(&mut *conn);
            while let Some(r) = owed.try_next().await? {
                if part.holds(r.try_get(1)?) {
                    released.push(r.try_get(0)?);
                }
            }
            drop(owed);
            (held, Vec::new())
        };
        let (stock, moves) = if part.segments > 1 {
            let (allocated, moves) = self
                .segment_allocation(conn, sale_id, part, initial)
                .await?;
            (
                allocated - buyers.iter().map(|(_, units)| units).sum::<i64>(),
                moves,
            )
        } else {
            (stock, Vec::new())
        };
        Ok(LoadSnapshot {
            stock,
            released,
            buyers,
            counted,
            repeat_buyers: repeats,
            moves,
        })
    }

    /// The units each buyer of `part` holds in the sale's live orders, one pair per buyer:
    /// the orders read `LIVE_CHUNK` at a time by id, each chunk as one row of two strings,
    /// the buyers of one unit ("7,9,12": nearly every order of a flash sale) and the
    /// others ("5 2,8 3"). A row per order costs the driver microseconds; a million buyers
    /// are read in fifty rows, in proportion to their bytes (`scripts/rebuild-time`: a
    /// restart with a 1M-buyer sale serves again within seconds).
    async fn live_holdings(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
        part: Part,
    ) -> Result<Vec<(i64, i64)>, StoreError> {
        let columns = [
            (
                format!(
                    "CASE WHEN quantity = 1 THEN {} END",
                    self.joined(&["user_id"])
                ),
                1,
            ),
            (
                format!(
                    "CASE WHEN quantity <> 1 THEN {} END",
                    self.joined(&["user_id", "quantity"])
                ),
                2,
            ),
        ];
        let mut held = Vec::new();
        let filter = format!("AND {LIVE}");
        self.packed_chunks(conn, sale_id, &filter, &columns, |packed| {
            if let Packed::Order(column, fields) = packed {
                let units = if column == 0 { 1 } else { fields[1] };
                held.push((fields[0], units));
            }
        })
        .await?;
        Ok(one_pair_per_buyer(held, part))
    }

    /// Every order of the sale in `part`, for a gate that keeps order ids: the units each
    /// buyer holds in live orders, every order's id, and the cancelled or expired ones.
    /// Read packed like [`Store::live_holdings`] ("id user" per live order of one unit,
    /// "id user units" per other live order, "id user" per order gone), never a row per
    /// order (`scripts/rebuild-time`: a distributed gate rebuilt from a 1M-order sale within
    /// seconds).
    async fn every_order(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
        part: Part,
        mut sink: Option<HeldSink<'_>>,
    ) -> Result<EveryOrder, StoreError> {
        let columns = [
            (
                format!(
                    "CASE WHEN {LIVE} AND quantity = 1 THEN {} END",
                    self.joined(&["id", "user_id"])
                ),
                2,
            ),
            (
                format!(
                    "CASE WHEN {LIVE} AND quantity <> 1 THEN {} END",
                    self.joined(&["id", "user_id", "quantity"])
                ),
                3,
            ),
            (
                format!(
                    "CASE WHEN NOT ({LIVE}) THEN {} END",
                    self.joined(&["id", "user_id"])
                ),
                2,
            ),
        ];
        let mut out = EveryOrder::default();
        let mut held = Vec::new();
        let mut handed = 0;
        self.packed_chunks(conn, sale_id, "", &columns, |packed| {
            let (column, fields) = match packed {
                Packed::Order(column, fields) => (column, fields),
                Packed::ChunkEnd => {
                    if let Some(sink) = sink.as_mut().filter(|_| handed < held.len()) {
                        sink(held[handed..].to_vec());
                    }
                    handed = held.len();
                    return;
                }
            };
            let (id, user) = (fields[0], fields[1]);
            if !part.holds(user) {
                return;
            }
            out.counted.push(id);
            match column {
                0 => held.push((user, 1)),
                1 => held.push((user, fields[2])),
                // Cancelled or expired: the stock counts its units back already, whether
                // or not its return reached a gate; a release of it later is a repeat.
                _ => out.released.push(id),
            }
        })
        .await?;
        (out.held, out.repeat_buyers) = buyers_and_repeats(held, part);
        Ok(out)
    }

    /// `columns` joined into one text per order (`self.joined`), NULL where an order is
    /// not theirs.
    fn joined(&self, columns: &[&str]) -> String {
        match self.dialect {
            Dialect::MySql => format!("CONCAT({})", columns.join(", ' ', ")),
            Dialect::Postgres => columns
                .iter()
                .map(|c| format!("{c}::text"))
                .collect::<Vec<_>>()
                .join(" || ' ' || "),
            Dialect::Sqlite => columns.join(" || ' ' || "),
        }
    }

    /// Reads the sale's orders (`filter`: an extra condition, starting with AND) by id,
    /// `LIVE_CHUNK` to a row: each of `columns` (an expression of `n` integers joined by
    /// spaces, and `n`) aggregated into one comma-separated text per chunk. `each` gets a
    /// column's index and the `n` integers of one order.
    async fn packed_chunks(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
        filter: &str,
        columns: &[(String, usize)],
        mut each: impl FnMut(Packed<'_>),
    ) -> Result<(), StoreError> {
        let aggregated: Vec<String> = columns
            .iter()
            .map(|(c, _)| match self.dialect {
                Dialect::Postgres => format!("string_agg({c}, ',')"),
                Dialect::Sqlite => format!("group_concat({c})"),
                Dialect::MySql => format!("GROUP_CONCAT({c})"),
            })
            .collect();
        match self.dialect {
            // Its default (1,024 bytes) would cut a chunk short without an error.
            Dialect::MySql => {
                sqlx::query("SET SESSION group_concat_max_len = 67108864")
                    .execute(&mut *conn)
                    .await?;
            }
            // A sale that grew since the last ANALYZE looks tiny to the planner: it read the
            // whole sale and sorted it for each chunk (0.5 s a chunk at a million orders).
            Dialect::Postgres => {
                sqlx::query(super::PG_WALK_INDEXES)
                    .execute(&mut *conn)
                    .await?;
            }
            Dialect::Sqlite => {}
        }
        let q = self.sql(&format!(
            "SELECT MAX(id), {} FROM (SELECT id, user_id, quantity, status FROM orders \
             WHERE sale_id = ? AND id > ? {filter} ORDER BY id LIMIT {LIVE_CHUNK}) chunk",
            aggregated.join(", ")
        ));
        let bad = |what: &str| {
            StoreError::Db(sqlx::Error::Decode(
                format!("an order read as {what:?}, not integers").into(),
            ))
        };
        let mut fields = Vec::with_capacity(3);
        let mut after = i64::MIN;
        loop {
            let row = sqlx::query(&q)
                .bind(sale_id)
                .bind(after)
                .fetch_one(&mut *conn)
                .await?;
            let Some(last) = row.try_get::<Option<i64>, _>(0)? else {
                break;
            };
            for (column, (_, n)) in columns.iter().enumerate() {
                let Some(text) = text_at(&row, column + 1)? else {
                    continue;
                };
                for order in text.split(',') {
                    fields.clear();
                    for field in order.split(' ') {
                        fields.push(field.parse().map_err(|_| bad(order))?);
                    }
                    if fields.len() != *n {
                        return Err(bad(order));
                    }
                    each(Packed::Order(column, &fields));
                }
            }
            each(Packed::ChunkEnd);
            after = last;
        }
        Ok(())
    }

    /// A segment's allocation from SQL (its share of the initial stock, plus moves in, less
    /// moves out, that took effect) and how it took part in each move. Planned moves out
    /// of it are refused first, in the caller's transaction.
    async fn segment_allocation(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
        part: Part,
        initial: i64,
    ) -> Result<(i64, Vec<(i64, super::moves::MoveMark)>), StoreError> {
        use super::moves::MoveMark;
        sqlx::query(&self.sql(
            "UPDATE segment_moves SET state = 'refused', updated_at = ? \
             WHERE sale_id = ? AND from_segment = ? AND state = 'planned'",
        ))
        .bind(self.now_ms())
        .bind(sale_id)
        .bind(part.segment)
        .execute(&mut *conn)
        .await?;
        let rows = sqlx::query(&self.sql(
            "SELECT id, from_segment, to_segment, quantity, state FROM segment_moves \
             WHERE sale_id = ? AND (from_segment = ? OR to_segment = ?)",
        ))
        .bind(sale_id)
        .bind(part.segment)
        .bind(part.segment)
        .fetch_all(&mut *conn)
        .await?;
        let mut allocated =
            crate::model::segments::allocation(initial, part.segments, part.segment);
        let mut marks = Vec::new();
        for r in &rows {
            let (id, from, qty): (i64, i64, i64) = (r.try_get(0)?, r.try_get(1)?, r.try_get(3)?);
            let state: String = r.try_get(4)?;
            let took_effect = state == "taken" || state == "done";
            if from == part.segment {
                if took_effect {
                    allocated -= qty;
                    marks.push((id, MoveMark::Taken));
                } else if state == "refused" {
                    marks.push((id, MoveMark::Refused));
                }
            } else if took_effect {
                allocated += qty;
                marks.push((id, MoveMark::Given));
            }
        }
        Ok((allocated, marks))
    }

    // ---- payments -----------------------------------------------------------------------
}

#[cfg(test)]
mod tests {
    use super::{buyers_and_repeats, Part};

    #[test]
    fn buyers_are_summed_once_and_the_buyers_of_several_orders_named() {
        let held = vec![(7, 1), (3, 2), (7, 1), (5, 1), (9, 1), (9, 2), (9, 1)];
        let (buyers, repeats) = buyers_and_repeats(held, Part::WHOLE);
        assert_eq!(buyers, vec![(3, 2), (5, 1), (7, 2), (9, 4)]);
        assert_eq!(repeats, vec![(7, 2), (9, 4)]);
        let (buyers, repeats) = buyers_and_repeats(vec![(4, 1)], Part::WHOLE);
        assert_eq!((buyers, repeats), (vec![(4, 1)], vec![]));
    }
}
