//! The SQL store: the durable truth of sales, orders and users, on SQLite, PostgreSQL or
//! MySQL/MariaDB through one set of queries (sqlx's `Any` driver plus a [`Dialect`] for
//! the few statements that differ). Owns the schema and every SQL statement.
//!
//! Purchases are decided here only for the SQL gates (`--gate sql-lock | sql-conditional`,
//! in `sql_gate`), whose whole decision is one transaction by design. Behind the Redis and
//! in-memory gates the store decides no purchase: it writes the orders they accepted, off
//! the buyers' path, which reaches it only to read a sale not cached yet or to load a sale
//! the gate lost.
//!
//! Each concern is a file of its own, which says in its header what it owns and what it
//! must never do; this one holds the [`Store`] and what every part shares.

// What every part runs on: opening the database, errors, SQL text, transactions, schema.
mod connect;
mod error;
mod migrate;
mod retry;
mod schema;
mod sql;
mod tx;

// What the store keeps, and how it changes.
pub mod api_keys;
mod buyers;
pub mod counters;
mod expiry;
pub mod idempotency;
pub mod journal;
pub mod moves;
mod orders;
pub mod payments;
mod sales;
pub mod tallies;
pub mod transitions;
mod users;

// Purchases decided in SQL, gates rebuilt from SQL, recounts, and surviving a failover.
pub mod change;
pub mod failover;
pub mod rebuild;
pub mod recount;
pub mod sql_gate;

pub use change::Change;
pub use error::{StoreError, DB_ERRORS};
pub use failover::{Window, WindowError};
pub use orders::{
    WriteOutcome, LIVE_ORDER_IDS, ORDERS_OF_USER, PG_HELD_BY_BUYERS, PG_WRITTEN_ALREADY,
    SQLITE_ORDERS_OF_USER,
};
pub use payments::{Payment, PaymentSettlement};
pub use rebuild::{LoadSnapshot, Part};
pub use recount::{Pace, Recount};
pub use sales::{SaleCounts, SalesMark};
pub(crate) use sql::{int_pair, pg_array, text_and_int, PG_WALK_INDEXES};
pub use sql_gate::{ClaimedKey, SqlDecision, SqlVerdict};
pub use tallies::{PaymentStatus, SaleTallies, Tally};
pub use transitions::{Outcome, StockReturn, TransitionError};
pub use tx::{TxFaults, WriteTx};

use std::sync::Arc;

use sqlx::any::AnyConnectOptions;
use sqlx::{AnyPool, Row};

use crate::clock::SharedClock;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    Sqlite,
    Postgres,
    MySql,
}

/// This process's database errors, in Prometheus text.
pub fn render_metrics(out: &mut String) {
    crate::metrics::render_counter(
        "seckill_database_errors_total",
        "Database errors seen by this process.",
        DB_ERRORS.load(std::sync::atomic::Ordering::Relaxed),
        out,
    );
    counters::render(out);
}

#[derive(Clone)]
pub struct Store {
    pool: AnyPool,
    /// Where write transactions run (`Store::begin_write`): on SQLite, one connection of
    /// their own. SQLite lets one writer in at a time anyway, and on one connection the
    /// writer's batch statements are prepared once (see `fixed_chunks`) and held once,
    /// not once per pooled connection. Elsewhere, the pool itself.
    writes: AnyPool,
    dialect: Dialect,
    /// The process's clock: rows are stamped by it, and the parts that hold the store (the
    /// writer, lifecycle, loader, scheduler) read time from it (see `clock`).
    clock: SharedClock,
    /// Faults a simulation strikes write transactions with; none in a server.
    faults: Option<Arc<dyn TxFaults>>,
    /// Where a stored phone without a country code is taken to be, when the migration
    /// normalises stored phones (`--phone-region`).
    phone_region: phonenumber::country::Id,
    /// Where merging SQLite's buyer index stands (see `buyers`).
    buyer_merge: buyers::MergeState,
    /// The failover window and the identity writes may commit under (see `failover`).
    failover: Arc<failover::Failover>,
    /// Set on the store that writes the window again into a new primary: the identity its
    /// writes commit under, and nothing kept.
    replay_as: Option<Arc<str>>,
    /// How to open a connection of one's own, past the pool (see [`Store::ping`]).
    options: Arc<AnyConnectOptions>,
}

impl Store {
    /// The region the phone migration reads numbers without a country code in.
    pub fn with_phone_region(mut self, region: phonenumber::country::Id) -> Self {
        self.phone_region = region;
        self
    }

    /// The same store reading time from `clock` (a simulated one, in tests).
    pub fn with_clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// The same store with `faults` struck at every write transaction's commit.
    pub fn with_faults(mut self, faults: Arc<dyn TxFaults>) -> Self {
        self.faults = Some(faults);
        self
    }

    /// The process's clock.
    pub fn clock(&self) -> &SharedClock {
        &self.clock
    }

    /// Now, by the process's clock (Unix ms).
    pub fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }

    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Returns the stored value of `key`, storing `candidate` first if there is none, so
    /// that every process sharing the database agrees on it.
    pub async fn meta_get_or_init(&self, key: &str, candidate: &str) -> Result<String, StoreError> {
        let q = format!(
            "{} VALUES (?, ?){}",
            self.insert_ignore("meta (k, v)"),
            self.on_conflict_nothing()
        );
        sqlx::query(&self.sql(&q))
            .bind(key)
            .bind(candidate)
            .execute(&self.pool)
            .await?;
        let row = sqlx::query(&self.sql("SELECT v FROM meta WHERE k = ?"))
            .bind(key)
            .fetch_one(&self.pool)
            .await?;
        Ok(row.try_get::<String, _>(0)?)
    }
}
