//! The library against real servers, without the binary: each gate, store, order log and
//! failover window held to the same cases on every backend (SQLite, PostgreSQL, MariaDB,
//! Redis, files).

#[path = "../common/mod.rs"]
mod common;

mod gate;
mod gate_rebuild;
mod ids_lease;
mod lifecycle;
mod orderlog_redis;
mod room;
mod store;
mod window;
mod writer;
