//! The library against real servers, without the binary: each gate, store and order log
//! held to the same cases on every backend (SQLite, PostgreSQL, MariaDB, Redis).

#[path = "../common/mod.rs"]
mod common;

mod gate;
mod gate_rebuild;
mod ids_lease;
mod lifecycle;
mod orderlog_redis;
mod room;
mod store;
mod writer;
