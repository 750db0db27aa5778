//! Orders: the writer's batch write (`write_orders`: in one transaction the sales' rows
//! locked, redeliveries skipped, each buyer's limit checked again, the new orders
//! inserted, the stock taken under a `stock >= qty` guard, the journal, counters and
//! tallies moved), and the reads of orders (one, a buyer's, a sale's, a page of a sale's
//! live ids).
//!
//! What it must never do: write an order twice (a redelivered one is skipped), take stock
//! a sale does not have, or let an order take its buyer over the sale's limit (the last
//! line of defence against a gate fault).

use std::collections::{BTreeMap, HashMap, HashSet};

use sqlx::any::AnyRow;
use sqlx::Row;

use super::journal::{Cause, Movement};
use super::sql::{execute_text, fetch_text, first_int, literal_list, pg_array};
use super::{change, counters, tallies, Dialect, Store, StoreError};
use crate::model::{NewOrder, Order, OrderStatus};

/// What one batch write did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct WriteOutcome {
    /// Orders inserted by this call.
    pub written: usize,
    /// Orders that were already in the database (a redelivery): skipped, not written again.
    pub duplicates: usize,
}

/// When an order written `now` must be paid by: its sale's payment window (`terms`: a sale's
/// window in seconds and per-user limit) from now.
fn pay_deadline(order: &NewOrder, terms: &HashMap<i64, (i64, i64)>, now: i64) -> i64 {
    now + terms[&order.sale_id].0 * 1000
}

/// The rows of [`Store::insert_orders_values`] as SQL literals: every value an integer
/// written by Rust (digits and a sign), so nothing in them needs quoting.
fn literal_order_rows(orders: &[&NewOrder], terms: &HashMap<i64, (i64, i64)>, now: i64) -> String {
    use std::fmt::Write;
    let mut rows = String::with_capacity(orders.len() * 120);
    for (i, o) in orders.iter().enumerate() {
        let deadline = pay_deadline(o, terms, now);
        let sep = if i == 0 { "" } else { "," };
        // Writing into a String cannot fail.
        let _ = write!(
            rows,
            "{sep}({},{},{},{},{},'pending_payment',{},{now},{deadline},{now})",
            o.id, o.sale_id, o.user_id, o.quantity, o.price_cents, o.accepted_at
        );
    }
    rows
}

/// A page of a sale's live order ids (see `Store::live_order_ids`).
pub const LIVE_ORDER_IDS: &str = "SELECT id FROM orders WHERE sale_id = ? AND id > ? \
     AND status IN ('pending_payment', 'paid') ORDER BY id LIMIT ?";

/// A buyer's orders, newest first (see `Store::orders_of_user`), on PostgreSQL and MySQL: a
/// walk of `orders_by_user` from the buyer's newest entry. Its columns are `Store::ORDER_COLS`.
pub const ORDERS_OF_USER: &str = "SELECT id, sale_id, user_id, quantity, price_cents, status, \
     accepted_at, pay_deadline, written_at FROM orders WHERE user_id = ? ORDER BY id DESC LIMIT ?";

/// The same list on SQLite, which keeps no index by buyer alone (migration 14): a seek of
/// each run of the buyer index (see `buyers`) per sale, then a sort of this buyer's orders
/// only. Its cost grows with the number of sales ever created (drafts and ended ones too;
/// none is pruned), by two seeks each, never with the orders of other buyers. An order is
/// listed only while its sale's row exists: only drafts, which hold no orders, are ever
/// deleted.
pub const SQLITE_ORDERS_OF_USER: &str = "SELECT id, sale_id, user_id, quantity, price_cents, \
     status, accepted_at, pay_deadline, written_at FROM orders WHERE id IN \
     (SELECT order_id FROM buyer_orders_all WHERE user_id = ? AND sale_id IN (SELECT id FROM sales)) \
     ORDER BY id DESC LIMIT ?";

/// The writer's guard on PostgreSQL: live units of each buyer of an array (`$1`, text) in
/// a sale (`$2`), a lookup of (sale, buyer) per buyer (see `Store::held_by_buyers`).
pub const PG_HELD_BY_BUYERS: &str = "SELECT u.id, h.units \
     FROM unnest(CAST(CAST($1 AS TEXT) AS BIGINT[])) AS u(id) \
     CROSS JOIN LATERAL (SELECT CAST(COALESCE(SUM(quantity),0) AS BIGINT) AS units FROM orders \
     WHERE sale_id = $2 AND user_id = u.id AND status IN ('pending_payment', 'paid')) h \
     WHERE h.units > 0";

/// The writer's duplicate check on PostgreSQL: which order ids of an array (`$1`, text)
/// are in SQL already, a lookup of the primary key per id (see `Store::written_already`).
pub const PG_WRITTEN_ALREADY: &str = "SELECT u.id \
     FROM unnest(CAST(CAST($1 AS TEXT) AS BIGINT[])) AS u(id) \
     CROSS JOIN LATERAL (SELECT COUNT(*) AS n FROM orders WHERE id = u.id) h WHERE h.n > 0";

/// Per sale, the units of `fresh` and how many orders.
fn units_per_sale(fresh: &[&NewOrder]) -> BTreeMap<i64, (i64, usize)> {
    let mut per_sale: BTreeMap<i64, (i64, usize)> = BTreeMap::new();
    for o in fresh {
        let (units, orders) = per_sale.entry(o.sale_id).or_default();
        *units += o.quantity;
        *orders += 1;
    }
    per_sale
}

impl Store {
    /// Writes a batch of accepted orders in one transaction: inserts those not yet written
    /// and takes their quantity off `sales.stock` under a `stock >= qty` guard. An order that
    /// is already in the database is skipped, so redelivery never writes twice.
    pub async fn write_orders(&self, batch: &[NewOrder]) -> Result<WriteOutcome, StoreError> {
        if batch.is_empty() {
            return Ok(WriteOutcome::default());
        }
        let kept = self.keeps_changes().then(|| change::Change::Orders {
            orders: batch.to_vec(),
        });
        let outcome = self
            .in_kept_tx(kept.as_ref(), |mut conn| async move {
                let result = self.write_orders_in_tx(&mut conn, batch).await;
                (conn, result)
            })
            .await?;
        self.buyers_indexed(outcome.written).await;
        Ok(outcome)
    }

    /// The batch's write, in the caller's transaction (see [`Store::write_orders`]).
    async fn write_orders_in_tx(
        &self,
        conn: &mut sqlx::AnyConnection,
        batch: &[NewOrder],
    ) -> Result<WriteOutcome, StoreError> {
        let now = self.now_ms();
        let terms = self.lock_sales_of(conn, batch).await?;
        let fresh = self.not_written_yet(conn, batch).await?;
        let mut tallies = tallies::Tallies::default();
        let new_buyers = self
            .check_user_limits(conn, &fresh, &terms, &mut tallies)
            .await?;
        for o in &fresh {
            tallies.order_moved(o.sale_id, None, OrderStatus::PendingPayment);
        }
        let inserted = if self.dialect == Dialect::Postgres {
            self.insert_orders_pg(conn, &fresh, &terms, now).await?
        } else {
            self.insert_orders_values(conn, &fresh, &terms, now).await?
        };
        if inserted != fresh.len() as u64 {
            // Another writer inserted some of them since they were looked up.
            return Err(StoreError::ConcurrentWrite);
        }
        self.index_buyers(conn, &fresh).await?;
        self.keep_purchase_records_in(conn, &fresh).await?;
        let per_sale = units_per_sale(&fresh);
        self.journal_written(conn, &per_sale, now).await?;
        self.take_stock(conn, &per_sale, &new_buyers, now).await?;
        self.tally_in(conn, &tallies).await?;
        Ok(WriteOutcome {
            written: fresh.len(),
            duplicates: batch.len() - fresh.len(),
        })
    }

    /// The terms of the batch's sales, by sale: (payment window in seconds, per-user
    /// limit). A sale that does not exist fails the batch.
    async fn lock_sales_of(
        &self,
        conn: &mut sqlx::AnyConnection,
        batch: &[NewOrder],
    ) -> Result<HashMap<i64, (i64, i64)>, StoreError> {
        let sale_ids: Vec<i64> = batch
            .iter()
            .map(|o| o.sale_id)
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        // The sales' rows are locked first (SQLite's BEGIN IMMEDIATE has locked the whole
        // file): every write of a sale's orders then runs one after another, and the
        // per-user check after it sees the orders of every writer that went before.
        let q = format!(
            "SELECT id, payment_window_secs, per_user_limit FROM sales WHERE id IN ({}) ORDER BY id{}",
            Self::placeholders(sale_ids.len()),
            self.for_update()
        );
        let q = self.sql(&q);
        let mut query = sqlx::query(&q).persistent(false);
        for id in &sale_ids {
            query = query.bind(*id);
        }
        let terms: HashMap<i64, (i64, i64)> = query
            .fetch_all(&mut *conn)
            .await?
            .iter()
            .map(|r| {
                Ok((
                    r.try_get::<i64, _>(0)?,
                    (r.try_get::<i64, _>(1)?, r.try_get::<i64, _>(2)?),
                ))
            })
            .collect::<Result<_, sqlx::Error>>()?;
        if let Some(missing) = sale_ids.iter().find(|id| !terms.contains_key(id)) {
            return Err(StoreError::UnknownSale(*missing));
        }
        Ok(terms)
    }

    /// The batch's orders that SQL does not hold yet, each once, in buyer order.
    async fn not_written_yet<'b>(
        &self,
        conn: &mut sqlx::AnyConnection,
        batch: &'b [NewOrder],
    ) -> Result<Vec<&'b NewOrder>, StoreError> {
        let mut existing = HashSet::new();
        for chunk in self.statement_chunks(batch, 1000) {
            existing.extend(self.written_already(conn, chunk).await?);
        }
        let mut seen = HashSet::new();
        let mut fresh: Vec<&NewOrder> = batch
            .iter()
            .filter(|o| !existing.contains(&o.id) && seen.insert(o.id))
            .collect();
        // In buyer order, the indexes keyed by buyer (on SQLite, the buyer index's small
        // run: see `buyers`) take the batch's entries page by page instead of at random: on
        // SQLite, whose page cache is a few MB, a random order read and wrote each of their
        // pages several times per batch once a sale outgrew the cache (measured: CPU per
        // order grew with the sale). Stable, so each buyer's orders keep their order.
        fresh.sort_by_key(|o| (o.sale_id, o.user_id));
        Ok(fresh)
    }

    /// One journal row per sale and batch, its units and how many orders: each order is
    /// its own record already (units, written_at). A row per order doubled the rows and
    /// index entries of a batch (measured: PostgreSQL's CPU per order written fell by
    /// about a quarter without them).
    async fn journal_written(
        &self,
        conn: &mut sqlx::AnyConnection,
        per_sale: &BTreeMap<i64, (i64, usize)>,
        now: i64,
    ) -> Result<(), StoreError> {
        let details: Vec<String> = per_sale
            .values()
            .map(|(_, orders)| match orders {
                1 => "1 order".to_string(),
                n => format!("{n} orders"),
            })
            .collect();
        let written: Vec<Movement> = per_sale
            .iter()
            .zip(&details)
            .map(|((sale_id, (units, _)), detail)| Movement {
                detail: Some(detail),
                ..Movement::new(*sale_id, -units, Cause::Written)
            })
            .collect();
        self.journal_rows_in(conn, &written, now).await
    }

    /// Takes each sale's units of the batch off its stock, under the `stock >= qty` guard:
    /// a sale short of stock fails the batch.
    async fn take_stock(
        &self,
        conn: &mut sqlx::AnyConnection,
        per_sale: &BTreeMap<i64, (i64, usize)>,
        new_buyers: &HashMap<i64, i64>,
        now: i64,
    ) -> Result<(), StoreError> {
        for (&sale_id, &(qty, _)) in per_sale {
            // The stock and the counters in one statement: the batch's units are live now.
            let bump = counters::Bump {
                live_units: qty,
                live_buyers: new_buyers.get(&sale_id).copied().unwrap_or(0),
                ..Default::default()
            };
            let q = format!(
                "UPDATE sales SET stock = stock - ?, journal_sum = journal_sum - ?, {}, \
                 updated_at = ? WHERE id = ? AND stock >= ?",
                counters::Bump::SET
            );
            let q = self.sql(&q);
            let done = bump
                .bind(sqlx::query(&q).bind(qty).bind(qty))
                .bind(now)
                .bind(sale_id)
                .bind(qty)
                .execute(&mut *conn)
                .await?;
            if done.rows_affected() != 1 {
                return Err(StoreError::StockGuard { sale_id });
            }
        }
        Ok(())
    }

    /// The last line of defence against a gate fault (a rebuilt or stale gate that forgot a
    /// buyer): refuses the batch if any of its orders would take its buyer over the sale's
    /// per-user limit, counting the live orders already in SQL and the batch's own. Returns
    /// the buyers per sale who held nothing live before this batch (new live buyers), and
    /// adds each buyer's change of holding to `tallies`.
    async fn check_user_limits(
        &self,
        conn: &mut sqlx::AnyConnection,
        fresh: &[&NewOrder],
        terms: &HashMap<i64, (i64, i64)>,
        tallies: &mut tallies::Tallies,
    ) -> Result<HashMap<i64, i64>, StoreError> {
        let mut new_buyers: HashMap<i64, i64> = HashMap::new();
        let mut asked: HashMap<i64, HashMap<i64, i64>> = HashMap::new();
        for o in fresh {
            *asked
                .entry(o.sale_id)
                .or_default()
                .entry(o.user_id)
                .or_default() += o.quantity;
        }
        for (sale_id, users) in asked {
            let limit = terms[&sale_id].1;
            // In order along the (sale, buyer) index, like the inserts after it.
            let mut ids: Vec<i64> = users.keys().copied().collect();
            ids.sort_unstable();
            for chunk in self.statement_chunks(&ids, 1000) {
                let held = self.held_by_buyers(conn, sale_id, chunk, false).await?;
                for user in chunk {
                    let held = held.get(user).copied().unwrap_or(0);
                    if held == 0 {
                        *new_buyers.entry(sale_id).or_default() += 1;
                    }
                    if held + users[user] > limit {
                        return Err(StoreError::UserLimit {
                            sale_id,
                            user_id: *user,
                            held,
                            limit,
                        });
                    }
                    tallies.holding_moved(sale_id, held, held + users[user]);
                }
            }
        }
        Ok(new_buyers)
    }

    /// Which of the batch's orders SQL holds already (a redelivery after a crash).
    async fn written_already(
        &self,
        conn: &mut sqlx::AnyConnection,
        chunk: &[NewOrder],
    ) -> Result<Vec<i64>, StoreError> {
        let rows = if self.dialect == Dialect::Postgres {
            // A lookup of the primary key per order, whatever the statistics say: with
            // `id IN (...)` the planner, sure of a small table, read all of it for every
            // batch (4-12 ms a batch at 150,000 orders, growing with them).
            sqlx::query(PG_WRITTEN_ALREADY)
                .bind(pg_array(chunk.iter().map(|o| o.id)))
                .fetch_all(&mut *conn)
                .await?
        } else if self.dialect == Dialect::MySql {
            // As text, like the batch's insert: a statement of a thousand parameters was
            // prepared, bound and released on the server for each batch.
            let ids = literal_list(chunk.iter().map(|o| o.id));
            let q = format!("SELECT id FROM orders WHERE id IN ({ids})");
            fetch_text(&mut *conn, &q).await?
        } else {
            let q = format!(
                "SELECT id FROM orders WHERE id IN ({})",
                Self::placeholders(chunk.len())
            );
            let keep = self.keeps_shape(chunk.len(), 1000);
            let mut query = sqlx::query(&q).persistent(keep);
            for o in chunk {
                query = query.bind(o.id);
            }
            query.fetch_all(&mut *conn).await?
        };
        rows.iter()
            .map(|r| r.try_get::<i64, _>(0))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(StoreError::from)
    }

    /// The batch's new orders as multi-row VALUES statements of 500 (SQLite, MySQL; on
    /// PostgreSQL `insert_orders_pg`).
    async fn insert_orders_values(
        &self,
        conn: &mut sqlx::AnyConnection,
        fresh: &[&NewOrder],
        terms: &HashMap<i64, (i64, i64)>,
        now: i64,
    ) -> Result<u64, StoreError> {
        let mut inserted = 0u64;
        let cols = "orders (id, sale_id, user_id, quantity, price_cents, status, \
                    accepted_at, written_at, pay_deadline, updated_at)";
        for chunk in self.statement_chunks(fresh, 500) {
            if self.dialect == Dialect::MySql {
                // MySQL prepares a statement with parameters on the server for each run (one
                // kept per shape and pooled connection would hold dozens each): 4,500
                // parameters prepared, bound and released per 500 orders. The same rows as
                // literals, sent as text, cost MariaDB and the instance about 12% less CPU
                // per order (measured).
                let q = format!(
                    "{} VALUES {}",
                    self.insert_ignore(cols),
                    literal_order_rows(chunk, terms, now)
                );
                inserted += execute_text(conn, &q).await?.rows_affected();
                continue;
            }
            let values =
                vec!["(?, ?, ?, ?, ?, 'pending_payment', ?, ?, ?, ?)"; chunk.len()].join(",");
            // `OR IGNORE` rather than `ON CONFLICT DO NOTHING`: SQLite gives a multi-row
            // statement that may abort half-way (a NOT NULL column, here never null) a
            // statement journal, a copy of every page it touches, spilled to a temporary
            // file. At a million orders that is a page per order in each buyer-keyed index;
            // `OR IGNORE` leaves nothing to undo, so there is no journal.
            let q = format!("INSERT OR IGNORE INTO {cols} VALUES {values}");
            let q = self.sql(&q);
            let mut query = sqlx::query(&q).persistent(self.keeps_shape(chunk.len(), 500));
            for o in chunk {
                let deadline = pay_deadline(o, terms, now);
                query = query
                    .bind(o.id)
                    .bind(o.sale_id)
                    .bind(o.user_id)
                    .bind(o.quantity)
                    .bind(o.price_cents)
                    .bind(o.accepted_at)
                    .bind(now)
                    .bind(deadline)
                    .bind(now);
            }
            inserted += query.execute(&mut *conn).await?.rows_affected();
        }
        Ok(inserted)
    }

    /// The batch's new orders in one statement of one shape (prepared once per
    /// connection): its columns as arrays, where a VALUES list of 4,500 parameters was
    /// parsed and planned anew for every batch. Returns the rows inserted.
    async fn insert_orders_pg(
        &self,
        conn: &mut sqlx::AnyConnection,
        fresh: &[&NewOrder],
        terms: &HashMap<i64, (i64, i64)>,
        now: i64,
    ) -> Result<u64, StoreError> {
        if fresh.is_empty() {
            return Ok(0);
        }
        let column = |f: &dyn Fn(&NewOrder) -> i64| pg_array(fresh.iter().map(|o| f(o)));
        let q = "INSERT INTO orders (id, sale_id, user_id, quantity, price_cents, status, \
                 accepted_at, written_at, pay_deadline, updated_at) \
                 SELECT t.id, t.sale_id, t.user_id, t.quantity, t.price_cents, 'pending_payment', \
                 t.accepted_at, $1, t.pay_deadline, $1 FROM unnest(\
                 CAST(CAST($2 AS TEXT) AS BIGINT[]), CAST(CAST($3 AS TEXT) AS BIGINT[]), \
                 CAST(CAST($4 AS TEXT) AS BIGINT[]), CAST(CAST($5 AS TEXT) AS BIGINT[]), \
                 CAST(CAST($6 AS TEXT) AS BIGINT[]), CAST(CAST($7 AS TEXT) AS BIGINT[]), \
                 CAST(CAST($8 AS TEXT) AS BIGINT[])) \
                 AS t(id, sale_id, user_id, quantity, price_cents, accepted_at, pay_deadline) \
                 ON CONFLICT DO NOTHING";
        let done = sqlx::query(q)
            .bind(now)
            .bind(column(&|o| o.id))
            .bind(column(&|o| o.sale_id))
            .bind(column(&|o| o.user_id))
            .bind(column(&|o| o.quantity))
            .bind(column(&|o| o.price_cents))
            .bind(column(&|o| o.accepted_at))
            .bind(column(&|o| pay_deadline(o, terms, now)))
            .execute(&mut *conn)
            .await?;
        Ok(done.rows_affected())
    }

    /// Live units each of `users` holds in the sale (absent: none). `locking` on MySQL reads
    /// past the transaction's snapshot (a locking read), for a caller whose snapshot may be
    /// older than its hold on the sale's row; PostgreSQL reads what is committed at each
    /// statement, SQLite's write transaction holds the whole file.
    pub(crate) async fn held_by_buyers(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
        users: &[i64],
        locking: bool,
    ) -> Result<HashMap<i64, i64>, StoreError> {
        if locking && self.dialect == Dialect::MySql {
            return self.held_by_buyers_locking(conn, sale_id, users).await;
        }
        let rows = if self.dialect == Dialect::Postgres {
            // One lookup of (sale, buyer) per buyer, whatever the planner believes of the
            // table. With `user_id IN (...)` it read a sale's new rows as few (a sale's id
            // is new to the statistics, and a fresh table has none) and walked the whole
            // sale for every batch: 40 ms a batch at 200,000 orders, most of PostgreSQL's
            // CPU in a storm. The subquery holds an aggregate, so it stays a lookup per
            // buyer; one statement shape for every batch, prepared once.
            let list = pg_array(users.iter().copied());
            sqlx::query(PG_HELD_BY_BUYERS)
                .bind(list)
                .bind(sale_id)
                .fetch_all(&mut *conn)
                .await?
        } else if self.dialect == Dialect::MySql {
            // As text (see `written_already`).
            let q = format!(
                "SELECT user_id, {} FROM orders WHERE sale_id = {sale_id} AND user_id IN ({}) \
                 AND status IN ('pending_payment', 'paid') GROUP BY user_id",
                self.sum_int("quantity"),
                literal_list(users.iter().copied())
            );
            fetch_text(&mut *conn, &q).await?
        } else {
            // Through the buyer index's two runs (see `buyers`).
            let q = format!(
                "SELECT b.user_id, {} FROM buyer_orders_all b CROSS JOIN orders o \
                 ON o.id = b.order_id WHERE b.sale_id = ? AND b.user_id IN ({}) \
                 AND o.status IN ('pending_payment', 'paid') GROUP BY b.user_id",
                self.sum_int("o.quantity"),
                Self::placeholders(users.len())
            );
            let keep = self.keeps_shape(users.len(), 1000);
            let mut query = sqlx::query(&q).persistent(keep).bind(sale_id);
            for user in users {
                query = query.bind(*user);
            }
            query.fetch_all(&mut *conn).await?
        };
        rows.iter()
            .map(|r| Ok((r.try_get::<i64, _>(0)?, r.try_get::<i64, _>(1)?)))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(StoreError::from)
    }

    /// [`Store::held_by_buyers`] as InnoDB's locking read (the rows, summed here: a
    /// locking read takes no aggregate).
    async fn held_by_buyers_locking(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
        users: &[i64],
    ) -> Result<HashMap<i64, i64>, StoreError> {
        let q = format!(
            "SELECT user_id, quantity FROM orders WHERE sale_id = ? AND user_id IN ({}) \
             AND status IN ('pending_payment', 'paid') FOR UPDATE",
            Self::placeholders(users.len())
        );
        let mut query = sqlx::query(&q).persistent(false).bind(sale_id);
        for user in users {
            query = query.bind(*user);
        }
        let mut held = HashMap::new();
        for r in query.fetch_all(&mut *conn).await? {
            *held.entry(r.try_get::<i64, _>(0)?).or_default() += r.try_get::<i64, _>(1)?;
        }
        Ok(held)
    }

    pub(super) const ORDER_COLS: &'static str =
        "id, sale_id, user_id, quantity, price_cents, status, accepted_at, pay_deadline, written_at";

    pub(super) fn order_from_row(row: &AnyRow) -> Result<Order, sqlx::Error> {
        let status: String = row.try_get(5)?;
        Ok(Order {
            id: row.try_get(0)?,
            sale_id: row.try_get(1)?,
            user_id: row.try_get(2)?,
            quantity: row.try_get(3)?,
            price_cents: row.try_get(4)?,
            status: OrderStatus::parse(&status)
                .ok_or_else(|| sqlx::Error::Decode(format!("bad status {status}").into()))?,
            accepted_at: row.try_get(6)?,
            pay_deadline: row.try_get(7)?,
            written_at: row.try_get(8)?,
        })
    }

    pub async fn order(&self, id: i64) -> Result<Option<Order>, StoreError> {
        let q = format!("SELECT {} FROM orders WHERE id = ?", Self::ORDER_COLS);
        self.one_by_key(&q, id, Self::order_from_row).await
    }

    /// A user's orders, newest first.
    pub async fn orders_of_user(&self, user_id: i64, limit: i64) -> Result<Vec<Order>, StoreError> {
        self.all_rows(
            self.orders_of_user_query(),
            &[user_id, limit],
            Self::order_from_row,
        )
        .await
    }

    /// The query `orders_of_user` runs on this store's database.
    pub fn orders_of_user_query(&self) -> &'static str {
        match self.dialect {
            Dialect::Sqlite => SQLITE_ORDERS_OF_USER,
            _ => ORDERS_OF_USER,
        }
    }

    /// Ids of a sale's live orders above `after`, ascending, at most `limit` of them: a
    /// walk of `orders_by_sale_id` from the cursor, whatever the sale holds.
    pub async fn live_order_ids(
        &self,
        sale_id: i64,
        after: i64,
        limit: i64,
    ) -> Result<Vec<i64>, StoreError> {
        self.keyset_rows(LIVE_ORDER_IDS, &[sale_id, after, limit], first_int)
            .await
    }

    /// Every order of a sale (for checks and reconciliation).
    pub async fn orders_of_sale(&self, sale_id: i64) -> Result<Vec<Order>, StoreError> {
        let q = format!(
            "SELECT {} FROM orders WHERE sale_id = ? ORDER BY id",
            Self::ORDER_COLS
        );
        self.all_rows(&q, &[sale_id], Self::order_from_row).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `order_from_row` reads columns by position: a buyer's list must select them as
    /// every other order read does.
    #[test]
    fn a_buyers_list_selects_the_columns_an_order_is_read_from() {
        let prefix = format!("SELECT {} FROM orders ", Store::ORDER_COLS);
        for q in [ORDERS_OF_USER, SQLITE_ORDERS_OF_USER] {
            assert!(q.starts_with(&prefix), "{q}");
        }
    }
}
