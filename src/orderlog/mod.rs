//! The order log: accepted orders on their way from the gate to SQL. Embedded, an
//! append-only local file ([`local::LocalLog`]); distributed, one Redis Stream per sale
//! read by a consumer group ([`redis_stream::StreamLog`]).
//! The log never drops an entry on its own: an entry leaves only by ack or dead letter.

pub mod disk;
pub mod local;
pub mod redis_stream;

use async_trait::async_trait;

use crate::model::NewOrder;

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("the order log is closed (shutting down)")]
    Closed,
    /// The order is not in the log and never will be.
    #[error("the order could not be written: {0}")]
    WriteFailed(String),
    /// The order may or may not be in the log: a failed write could not be undone.
    #[error("the order may not have been written: {0}")]
    Unconfirmed(String),
    #[error("order log file: {0}")]
    File(String),
}

/// Where an entry came from, so that it can be acknowledged there. The orders of one entry
/// (a batch entry of the Redis log holds a script call's orders) share its receipt: the
/// entry is acknowledged once, after every one of them is settled.
#[derive(Debug, Clone)]
pub enum Receipt {
    /// An order of the local log, and the segment of the file it is in.
    Local { order: NewOrder, segment: u64 },
    /// A stream entry: (stream key, entry id).
    Stream { stream: String, id: String },
}

impl Receipt {
    /// The entry it names, when entries can hold more than one order (`None`: this receipt
    /// is its entry's only one).
    pub fn shared_entry(&self) -> Option<(&str, &str)> {
        match self {
            Receipt::Local { .. } => None,
            Receipt::Stream { stream, id } => Some((stream, id)),
        }
    }
}

#[derive(Debug)]
pub struct Delivery {
    pub order: NewOrder,
    pub receipt: Receipt,
}

/// An entry that could not even be read as an order.
#[derive(Debug)]
pub struct Malformed {
    pub receipt: Receipt,
    pub reason: String,
}

/// One read from the log.
#[derive(Debug, Default)]
pub struct Batch {
    pub deliveries: Vec<Delivery>,
    pub malformed: Vec<Malformed>,
    /// The read stopped at the most it asked for (of the log, or of one of its streams):
    /// more entries are likely waiting, and the writer reads again at once.
    pub capped: bool,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.deliveries.is_empty() && self.malformed.is_empty()
    }
}

/// The consumer side of the order log, as the writer sees it.
#[async_trait]
pub trait OrderLog: Send + Sync {
    /// Waits (briefly) for entries and returns up to `max` of them. An empty batch is normal.
    async fn next_batch(&self, max: usize) -> Result<Batch, LogError>;

    /// Entries that other consumers took and left unacknowledged for too long.
    async fn reclaim(&self, max: usize) -> Result<Batch, LogError>;

    /// Waits while a read could only find nothing (a Redis Cluster's quiet streams are
    /// read less often): the writer waits here before it takes its fence, so an idle log
    /// costs no database round trips. Returns at once where every read may find entries.
    async fn until_worth_reading(&self) {}

    /// The entries are durable in SQL: remove them from the log.
    async fn ack(&self, receipts: Vec<Receipt>) -> Result<(), LogError>;

    /// A transient failure: keep the entries for a later attempt, or give up on them if
    /// this log cannot wait (a local request cannot be held forever).
    async fn retry_later(&self, receipts: Vec<Receipt>, reason: &str) -> Result<(), LogError>;

    /// The entry can never be written: move it aside with the reason, for an operator.
    async fn dead_letter(&self, receipt: Receipt, reason: &str) -> Result<(), LogError>;

    /// Some orders of an entry of many can never be written, and every other one of it is
    /// in SQL: move those aside, each with its reason, and remove the entry, in one step.
    /// (Only the Redis log's batch entries hold many orders; elsewhere an entry's refused
    /// orders are the entry.)
    async fn dead_letter_orders(
        &self,
        receipt: Receipt,
        refused: &[(NewOrder, String)],
    ) -> Result<(), LogError> {
        let reasons: Vec<&str> = refused.iter().map(|(_, r)| r.as_str()).collect();
        self.dead_letter(receipt, &reasons.join("; ")).await
    }

    /// True once the log is closed and drained: the writer may stop.
    fn finished(&self) -> bool;

    /// True while orders this log held from an earlier run are not all in SQL yet: the
    /// gate must not be rebuilt from SQL before (see `Writer::drain_recovered`).
    fn recovering(&self) -> bool {
        false
    }

    /// True when writers in many processes read this log (the Redis streams): a batch
    /// they hold must be fenced against a gate rebuild (`Store::hold_writer_fence`), and a
    /// process may run several writer loops. The local log has one reader by nature.
    fn shared(&self) -> bool {
        false
    }
}

/// Backlog counts of a sale's log: entries not yet written, of which pending with a
/// writer, and dead letters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub unwritten: i64,
    pub pending: i64,
    pub dead: i64,
}

/// A sale's orders not yet in SQL, as (user, quantity), and its dead letters.
pub type Unwritten = (Vec<(i64, i64)>, i64);

/// The producer's side of the order log, as the edge, the audit, readiness and the
/// scheduler see it: what waits in it and for whom. One per deployment, held as a trait
/// object: the local log, the Redis streams, or nothing at all (the SQL gates write SQL
/// before they answer). `(sale, segments)` names a sale's log (one stream per segment).
#[async_trait]
pub trait Backlog: Send + Sync {
    /// False when no order ever waits here (the SQL gates): there is nothing beside SQL to
    /// compare a gate with.
    fn holds_orders(&self) -> bool;

    /// What waits in a sale's log.
    async fn counts(&self, sale: i64, segments: i64) -> Result<Counts, LogError>;

    /// (user, quantity) of each order of the sale not yet in SQL, and its dead letters;
    /// `None` when more than `cap` entries wait (too many to count one by one).
    async fn unwritten(
        &self,
        sale: i64,
        segments: i64,
        cap: usize,
    ) -> Result<Option<(Vec<(i64, i64)>, i64)>, LogError>;

    /// [`Backlog::unwritten`] of many sales, `(sale, segments)`, one answer each, in order:
    /// what the audit reads of every live sale each round, in one call where the log can.
    async fn unwritten_of_sales(
        &self,
        sales: &[(i64, i64)],
        cap: usize,
    ) -> Vec<Result<Option<Unwritten>, LogError>> {
        let mut answers = Vec::with_capacity(sales.len());
        for (sale, segments) in sales {
            answers.push(self.unwritten(*sale, *segments, cap).await);
        }
        answers
    }

    /// The buyer's orders answered `ok` and not yet in SQL, as (order, sale, quantity).
    /// `sales` are the recent sales as (sale, units the buyer holds in SQL, segments): a
    /// log that cannot list a buyer's orders directly reads only where the gate holds more
    /// of theirs than SQL does.
    async fn queued_of_user(
        &self,
        user: i64,
        sales: &[(i64, i64, i64)],
    ) -> Result<Vec<(i64, i64, i64)>, LogError>;

    /// Entries of the sale not yet in SQL (orders, or the Redis log's batch entries of
    /// several) and the acceptance time (Unix ms) of the oldest, when this log knows it:
    /// what readiness and the lag metrics watch.
    async fn lag(&self, sale: i64, segments: i64) -> Result<(i64, Option<i64>), LogError>;

    /// [`Backlog::lag`] of many sales, `(sale, segments)`, in order: what a readiness probe
    /// and a metrics scrape read of every recent sale, in one call where the log can.
    async fn lags(&self, sales: &[(i64, i64)]) -> Result<Vec<(i64, Option<i64>)>, LogError> {
        let mut lags = Vec::with_capacity(sales.len());
        for (sale, segments) in sales {
            lags.push(self.lag(*sale, *segments).await?);
        }
        Ok(lags)
    }

    /// Starts reading these sales' logs (their writers' group made sure of).
    async fn watch(&self, sales: &[(i64, i64)]) -> Result<(), LogError>;
}

/// The log of a deployment whose gate writes SQL itself: nothing ever waits.
pub struct NoBacklog;

#[async_trait]
impl Backlog for NoBacklog {
    fn holds_orders(&self) -> bool {
        false
    }

    async fn counts(&self, _: i64, _: i64) -> Result<Counts, LogError> {
        Ok(Counts::default())
    }

    async fn unwritten(
        &self,
        _: i64,
        _: i64,
        _: usize,
    ) -> Result<Option<(Vec<(i64, i64)>, i64)>, LogError> {
        Ok(Some((Vec::new(), 0)))
    }

    async fn queued_of_user(
        &self,
        _: i64,
        _: &[(i64, i64, i64)],
    ) -> Result<Vec<(i64, i64, i64)>, LogError> {
        Ok(Vec::new())
    }

    async fn lag(&self, _: i64, _: i64) -> Result<(i64, Option<i64>), LogError> {
        Ok((0, None))
    }

    async fn watch(&self, _: &[(i64, i64)]) -> Result<(), LogError> {
        Ok(())
    }
}
