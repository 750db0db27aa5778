//! The value types of settings that name a choice (where purchases are decided, who takes
//! payments, what an `ok` waits for in Redis, how orders are written to the Redis log) and
//! the request rate a limit allows. Plain types that other layers read: this file never
//! reads a flag, a variable or a file.

use serde::{Deserialize, Serialize};

/// Where purchases are decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum GateKind {
    /// In process memory (the embedded deployment).
    Embedded,
    /// A Lua script in Redis (the distributed deployment).
    Redis,
    /// `SELECT ... FOR UPDATE` in SQL.
    SqlLock,
    /// A guarded `UPDATE ... WHERE stock >= qty` in SQL.
    SqlConditional,
}

impl GateKind {
    pub fn name(self) -> &'static str {
        match self {
            GateKind::Embedded => "embedded",
            GateKind::Redis => "redis",
            GateKind::SqlLock => "sql-lock",
            GateKind::SqlConditional => "sql-conditional",
        }
    }
}

/// A per-user, per-sale request rate (GCRA): `per_sec` on average, `burst` at once.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RateLimit {
    pub per_sec: f64,
    pub burst: u32,
}

impl RateLimit {
    /// Milliseconds between requests at the steady rate; 0 when off.
    pub fn interval_ms(&self) -> i64 {
        if self.per_sec <= 0.0 {
            0
        } else {
            ((1000.0 / self.per_sec).round() as i64).max(1)
        }
    }

    /// How far ahead of the steady rate a burst may run, in milliseconds.
    pub fn tolerance_ms(&self) -> i64 {
        self.interval_ms() * (self.burst.max(1) as i64 - 1)
    }

    /// One GCRA step from the stored theoretical arrival time: the new one, or the wait in ms.
    pub fn check(&self, tat: i64, now: i64) -> Result<i64, i64> {
        let tat = tat.max(now);
        let wait = tat - now - self.tolerance_ms();
        if wait > 0 {
            Err(wait)
        } else {
            Ok(tat + self.interval_ms())
        }
    }
}

/// Who confirms payments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PaymentProviderKind {
    /// The built-in provider: a pay page on this server whose buttons have the server sign
    /// its own callback. For trials only: a buyer can mark their own order paid.
    Simulated,
    /// A real provider's hosted pay page (`--payment-redirect-url`); only its signed
    /// callbacks mark an order paid.
    Redirect,
}

impl PaymentProviderKind {
    pub fn name(self) -> &'static str {
        match self {
            PaymentProviderKind::Simulated => "simulated",
            PaymentProviderKind::Redirect => "redirect",
        }
    }
}

/// What an accepted purchase waits for in Redis before its buyer hears `ok`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Durability {
    /// Nothing more: in Redis' memory (and its AOF as its appendfsync policy says).
    #[default]
    None,
    /// Fsynced to the master's AOF (`WAITAOF 1 0`): survives a SIGKILL of Redis.
    Aof,
    /// Received by at least one replica (`WAIT 1`): survives the master's loss and a
    /// failover to that replica.
    Replica,
}

impl Durability {
    pub fn name(self) -> &'static str {
        match self {
            Durability::None => "none",
            Durability::Aof => "aof",
            Durability::Replica => "replica",
        }
    }
}

/// How an accepted order is written into the Redis order log. This build's writers read
/// every form; a build that reads only `Fields` dead-letters the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum EntryForm {
    /// One field per value (`order_id`, `sale_id`, ...): the form every build reads.
    #[default]
    Fields,
    /// One field `o`: `order_id:sale_id:user_id:quantity:price_cents:accepted_at`.
    Packed,
    /// One entry per script call, one field `b`: `sale_id:price_cents:accepted_at`, then
    /// `;order_id:user_id:quantity` per order it accepted.
    Batch,
}

impl EntryForm {
    pub fn name(self) -> &'static str {
        match self {
            EntryForm::Packed => "packed",
            EntryForm::Batch => "batch",
            EntryForm::Fields => "fields",
        }
    }
}
