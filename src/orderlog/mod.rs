//! The order log: accepted orders on their way from the gate to SQL. Embedded, an
//! append-only local file ([`local::LocalLog`]); distributed, one Redis Stream per sale
//! read by a consumer group ([`redis_stream::StreamLog`]).
//! The log never drops an entry on its own: an entry leaves only by ack or dead letter.

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
    #[error("the order could not be written: {0}")]
    WriteFailed(String),
    #[error("order log file: {0}")]
    File(String),
}

/// Where an entry came from, so that it can be acknowledged there.
#[derive(Debug)]
pub enum Receipt {
    /// An order of the local log, and the segment of the file it is in.
    Local { order: NewOrder, segment: u64 },
    /// A stream entry: (stream key, entry id).
    Stream { stream: String, id: String },
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

    /// The entries are durable in SQL: remove them from the log.
    async fn ack(&self, receipts: Vec<Receipt>) -> Result<(), LogError>;

    /// A transient failure: keep the entries for a later attempt, or give up on them if
    /// this log cannot wait (a local request cannot be held forever).
    async fn retry_later(&self, receipts: Vec<Receipt>, reason: &str) -> Result<(), LogError>;

    /// The entry can never be written: move it aside with the reason, for an operator.
    async fn dead_letter(&self, receipt: Receipt, reason: &str) -> Result<(), LogError>;

    /// True once the log is closed and drained: the writer may stop.
    fn finished(&self) -> bool;

    /// True while orders this log held from an earlier run are not all in SQL yet: the
    /// gate must not be rebuilt from SQL before (see `Writer::drain_recovered`).
    fn recovering(&self) -> bool {
        false
    }
}
