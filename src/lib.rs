//! seckill: a flash-sale service. A purchase flows through these modules, in order:
//!
//! ```text
//! client ─HTTP─> edge ─> gate ─> orderlog ─> writer ─> store (SQL)
//!                  ▲                                      ▲
//!              scheduler (preloads approved sales into the gate, from the store)
//! ```
//!
//! - [`edge`]: HTTP: auth tokens, input checks, the sale cache; maps every error to the contract.
//! - [`gate`]: the one atomic step that decides a purchase (in memory, or a Lua script in Redis).
//! - [`orderlog`]: accepted orders on their way to SQL (a local queue, or a Redis Stream).
//! - [`writer`]: drains the order log into SQL in batches, exactly once per order.
//! - [`store`]: the SQL database (SQLite, PostgreSQL, MySQL/MariaDB): schema and queries.
//! - [`lifecycle`]: after the purchase: payment (simulated provider), cancel, expiry, stock returns.
//! - [`scheduler`]: background duties: preload sales, expire unpaid orders, return stock to the gate.
//! - [`metrics`]: Prometheus counters and histograms on atomics.
//! - [`ids`]: 64-bit time-ordered ids, unique across instances.
//! - [`app`]: assembles the parts for one of the two deployments (embedded or distributed).
//! - [`bench`]: `seckill bench`, the load generator and its report (speaks HTTP only).
//! - [`cli`]: the `seckill` command: serve, worker, migrate, users mint.
//! - [`config`]: one typed configuration: flags, then `SECKILL_*` env, then a TOML file.

pub mod app;
pub mod backoff;
pub mod bench;
pub mod cli;
pub mod config;
pub mod edge;
pub mod gate;
pub mod ids;
pub mod lifecycle;
pub mod loader;
pub mod logline;
pub mod metrics;
pub mod model;
pub mod orderlog;
pub mod reconcile;
pub mod redis_client;
pub mod scheduler;
pub mod store;
pub mod text;
pub mod writer;

/// Milliseconds since the Unix epoch, the one clock unit used in storage and the gate.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Whether a request body is a JSON object (its first non-space byte is `{`). Every body of
/// the contract is an object; serde would also fill a struct from an array (`[1, "t"]`).
pub fn is_json_object(body: &[u8]) -> bool {
    body.iter().find(|b| !is_json_space(b)) == Some(&b'{')
}

/// JSON's four whitespace bytes (RFC 8259). Not `u8::is_ascii_whitespace`, which also
/// counts form feed: a body of one form feed is not JSON and must not pass for empty.
pub fn is_json_space(byte: &u8) -> bool {
    matches!(byte, b' ' | b'\t' | b'\n' | b'\r')
}
