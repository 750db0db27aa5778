//! HTTP plumbing every call goes through: the front door, connection limits and timeouts,
//! CORS, rate limits, reading input, and the one mapping of errors to the contract.

pub mod connections;
pub mod cors;
pub mod error;
pub mod front;
pub mod input;
pub mod limits;
pub mod starting;
