//! seckill: a flash-sale service. A purchase flows through these modules, in order:
//!
//! ```text
//! client ─HTTP─> edge ─> gate ─> orderlog ─> writer ─> store (SQL)
//!                  ▲       ▲                              │
//!                  │     loader (rebuilds the gate from SQL + the order log)
//!              scheduler (preloads, expiries, returns: lifecycle)
//! ```
//!
//! The modules in layer order, bottom to top; each imports only those above it in this
//! list (`scripts/layers.py src` checks it; CI runs it):
//!
//! - [`model`]: the domain's types (sales, orders, states) and the segment arithmetic.
//! - [`text`]: hex, URLs with their secrets masked, phone numbers in E.164.
//! - [`clock`]: the one clock a process reads (wall, or simulated in tests).
//! - [`stop`]: the background loops' stop signal (a dropped sender stops them too).
//! - [`config`]: the one typed configuration (flags, `SECKILL_*`, a TOML file), Redis URL forms.
//! - [`metrics`]: Prometheus counters and histograms on atomics.
//! - [`logline`]: log lines that would repeat per request, at most once per interval.
//! - [`backoff`]: waits between retries, with jitter.
//! - [`redis_client`]: the Redis connection (server, Sentinel, Cluster), the key layout, leases.
//! - [`store`]: the SQL database (SQLite, PostgreSQL, MySQL/MariaDB): schema, every statement.
//! - [`window`]: the failover window of SQL's recent changes, kept in Redis (see
//!   `store::failover`), written again into a new primary after a database failover.
//! - [`health`]: the database and Redis, asked every half second whether they answer.
//! - [`ids`]: 64-bit time-ordered ids, unique across instances (worker ids leased in Redis).
//! - [`orderlog`]: accepted orders on their way to SQL (a local file, or Redis Streams).
//! - [`gate`]: the one atomic step that decides a purchase (memory, Lua in Redis, SQL), and
//!   its decorators (circuit breaker, sold-out shortcut, moves between segments).
//! - [`lifecycle`]: after the purchase: payment, cancel, expiry, stock back to the gate.
//! - [`loader`]: the catalogue cache and the fenced load of a sale into the gate from SQL.
//! - [`writer`]: drains the order log into SQL in batches, exactly once per order.
//! - [`reconcile`]: the gate compared with SQL and what is in flight; audit and repair.
//! - [`scheduler`]: the one-second tick that runs the background duties.
//! - [`room`]: the waiting room in front of a hot sale: tickets, the lottery at the opening,
//!   the admission rate shared by every instance (in memory, or in Redis).
//! - [`edge`]: HTTP: the front door, auth, limits, input checks, pages; maps every error.
//! - [`app`]: assembles the parts for one of the deployments (embedded or distributed).
//! - [`bench`]: `seckill bench`, the load generator and its report (speaks HTTP only).
//! - [`cli`]: the `seckill` command: serve, worker, migrate, bench, reconcile, users mint.

pub mod app;
pub mod backoff;
pub mod bench;
pub mod cli;
pub mod clock;
pub mod config;
pub mod edge;
pub mod gate;
pub mod health;
pub mod ids;
pub mod lifecycle;
pub mod loader;
pub mod logline;
pub mod metrics;
pub mod model;
pub mod orderlog;
pub mod reconcile;
pub mod redis_client;
pub mod room;
pub mod scheduler;
pub mod stop;
pub mod store;
pub mod text;
pub mod window;
pub mod writer;

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
