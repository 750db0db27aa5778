//! The real binary over HTTP, per deployment: purchases, payments, anti-bot, limits,
//! reconciliation, segments, the admin API, and bad input and attacks of every kind.

#[path = "../common/mod.rs"]
mod common;

mod antibot;
mod api_keys;
mod edge_fuzz;
mod edge_input;
mod idempotency;
mod lifecycle;
mod limits;
mod payments;
mod purchase;
mod readiness;
mod reconcile;
mod sale_admin;
mod security;
mod segments;
mod shop_auth;
mod soldout;
mod waiting_room;
