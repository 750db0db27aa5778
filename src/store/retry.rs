//! Trying a transaction again when the database gave it up for a reason that is not the
//! data's (a deadlock, a serialization failure, a busy SQLite file).

use super::StoreError;

/// Attempts of a lifecycle transaction that keeps losing deadlocks before giving up.
const RETRIES: u32 = 5;

/// Errors that may go away if the same transaction is simply tried again.
pub(super) trait Transient {
    fn is_transient(&self) -> bool;
}

impl Transient for StoreError {
    /// Not a change that committed but could not be kept in the failover window: run
    /// again, it would find itself done and answer as if refused.
    fn is_transient(&self) -> bool {
        StoreError::is_transient(self) && !matches!(self, StoreError::Window(_))
    }
}

/// Runs a transaction again, after a short backoff, while it loses deadlocks or
/// serialization races (InnoDB gap locks, PostgreSQL 40001), up to RETRIES times.
pub(super) async fn retry_transient<
    T,
    E: Transient,
    Fut: std::future::Future<Output = Result<T, E>>,
>(
    clock: &dyn crate::clock::Clock,
    attempt: impl FnMut() -> Fut,
) -> Result<T, E> {
    retry_while(clock, E::is_transient, attempt).await
}

/// [`retry_transient`] for the errors `again` names.
pub(super) async fn retry_while<T, E, Fut: std::future::Future<Output = Result<T, E>>>(
    clock: &dyn crate::clock::Clock,
    again: impl Fn(&E) -> bool,
    mut attempt: impl FnMut() -> Fut,
) -> Result<T, E> {
    let mut tries = 0;
    loop {
        match attempt().await {
            Err(e) if again(&e) && tries < RETRIES => tries += 1,
            other => return other,
        }
        clock
            .sleep(std::time::Duration::from_millis(5 << tries))
            .await;
    }
}
