//! Where the failover window of SQL's recent changes is kept (see `store::failover`): in
//! Redis for a distributed deployment, so that whichever process is alive after a failover
//! finds every process's changes; in files beside the order log for an embedded server on
//! PostgreSQL or MySQL. Owns the window's keys, scripts and files; never decides what a
//! change is or how it applies (the store does).

pub mod file;
pub mod redis;
