//! Deployments of many processes meeting Redis faults: a Redis that dies, loses its data or
//! freezes, Sentinel and replica failovers, a Redis Cluster whose master is killed. Each
//! test judges timings, so they take turns (`common::one_at_a_time`): one at a time on the
//! machine, as when each file was a test binary of its own.

#[path = "../common/mod.rs"]
mod common;

mod cluster;
mod db_failover;
mod db_outage;
mod nemesis;
mod redis_faults;
mod redis_outage;
mod returns_rebuild;
