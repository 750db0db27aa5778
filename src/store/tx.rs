//! Write transactions: a transaction opened by hand on a pooled connection ([`WriteTx`]),
//! rolled back when dropped unfinished; the two ways every write of the store runs
//! (`in_write_tx`, and `in_kept_tx`, whose change is kept in the failover window once
//! committed), each committed when its work succeeds and rolled back when it fails; and
//! the faults a simulation strikes commits with.
//!
//! What it must never do: hand a connection back to the pool while its transaction's
//! state is unknown, or run the work of `in_write_tx` or `in_kept_tx` on a server the
//! failover window is not settled against.

use sqlx::AnyPool;

use super::{change, failover, Dialect, Store, StoreError};

/// Where a simulation strikes a write transaction (`Store::with_faults`): the process
/// "dies" just before its COMMIT (it rolls back) or just after (it stands, and its caller
/// never hears). A fault answers an error, which the caller gets instead of its result; the
/// simulation then stops the store ([`Store::halt`]), as a crash would.
pub trait TxFaults: Send + Sync {
    fn before_commit(&self) -> Result<(), StoreError>;
    fn after_commit(&self) -> Result<(), StoreError>;
}

/// A transaction opened by hand on a pooled connection. A plain pooled connection dropped
/// mid-transaction (its future cancelled by a request timeout or a client that left) goes
/// back to the pool still inside it: its locks stay held until someone reuses it, and that
/// caller's COMMIT would then commit the half-done work too. Dropped before
/// [`Store::finish`] succeeded, this closes the connection instead, so the server rolls
/// the transaction back and frees its locks at once.
pub struct WriteTx {
    conn: sqlx::pool::PoolConnection<sqlx::Any>,
    finished: bool,
}

impl Drop for WriteTx {
    fn drop(&mut self) {
        if !self.finished {
            self.conn.close_on_drop();
        }
    }
}

impl std::ops::Deref for WriteTx {
    type Target = sqlx::AnyConnection;
    fn deref(&self) -> &Self::Target {
        &self.conn
    }
}

impl std::ops::DerefMut for WriteTx {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.conn
    }
}

impl Store {
    /// Whether this store's commits are kept in a failover window (see `failover`).
    pub(super) fn keeps_changes(&self) -> bool {
        self.replay_as.is_none() && self.failover.window_is_kept()
    }

    /// Runs `work` in a write transaction (see [`Store::begin_write`]): committed when it
    /// succeeds, rolled back when it fails. `work` is handed the transaction and gives it
    /// back with its result, so that no path can leave it open or commit a failure.
    pub(crate) async fn in_write_tx<T, E, F, Fut>(&self, work: F) -> Result<T, E>
    where
        E: From<StoreError>,
        F: FnOnce(WriteTx) -> Fut,
        Fut: std::future::Future<Output = (WriteTx, Result<T, E>)>,
    {
        self.in_kept_tx(None, work).await
    }

    /// [`Store::in_write_tx`], whose `change` is kept in the failover window once committed
    /// (see `failover`): what an answer or an acknowledgement depends on. Every write
    /// transaction first reads the identity of the server it runs on, and runs only under
    /// the one the window is settled against.
    pub(crate) async fn in_kept_tx<T, E, F, Fut>(
        &self,
        change: Option<&change::Change>,
        work: F,
    ) -> Result<T, E>
    where
        E: From<StoreError>,
        F: FnOnce(WriteTx) -> Fut,
        Fut: std::future::Future<Output = (WriteTx, Result<T, E>)>,
    {
        let (tx, identity) = self.begin_under_settled_identity().await?;
        let (tx, result) = work(tx).await;
        let faults = self.faults.as_deref().filter(|_| result.is_ok());
        if let Some(faults) = faults {
            // Dropped unfinished, the transaction rolls back.
            faults.before_commit()?;
        }
        Self::finish(tx, result.is_ok()).await?;
        if let Some(faults) = faults {
            faults.after_commit()?;
        }
        if let (Ok(_), Some(identity), Some(change)) = (&result, &identity, change) {
            self.keep(identity, change).await?;
        }
        result
    }

    /// A write transaction on a server whose identity the failover window is settled
    /// against, and that identity (`None` when no window is kept). A server not settled yet
    /// (a failover: the window being written into it) is waited for a moment, then refused.
    async fn begin_under_settled_identity(&self) -> Result<(WriteTx, Option<String>), StoreError> {
        let mut waited = false;
        loop {
            let mut tx = self.begin_write().await?;
            // Dropped unfinished on a refusal, the transaction rolls back.
            match self.check_identity_in(&mut tx).await {
                Ok(identity) => return Ok((tx, identity)),
                Err(StoreError::Settling { found, .. }) if !waited => {
                    drop(tx);
                    waited = true;
                    self.until_settled_on(&found, failover::WRITE_WAITS_FOR_SETTLE)
                        .await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// A pooled connection inside a write transaction. On SQLite it takes the write lock up
    /// front, so that a read in the transaction cannot be upgraded into a busy error.
    pub(crate) async fn begin_write(&self) -> Result<WriteTx, StoreError> {
        let begin = if self.dialect == Dialect::Sqlite {
            "BEGIN IMMEDIATE"
        } else {
            "BEGIN"
        };
        Self::begin_on(&self.writes, begin).await
    }

    /// A pooled connection inside a transaction opened by `begin`, guarded from the moment
    /// it leaves the pool (see [`WriteTx`]).
    pub(crate) async fn begin_with(&self, begin: &str) -> Result<WriteTx, StoreError> {
        Self::begin_on(&self.pool, begin).await
    }

    async fn begin_on(pool: &AnyPool, begin: &str) -> Result<WriteTx, StoreError> {
        let mut tx = WriteTx {
            conn: pool.acquire().await?,
            finished: false,
        };
        sqlx::query(begin).execute(&mut *tx).await?;
        Ok(tx)
    }

    /// Commits (or rolls back) the transaction of [`Store::begin_write`]. A connection whose
    /// transaction state is unknown is never handed back to the pool.
    pub(crate) async fn finish(mut tx: WriteTx, commit: bool) -> Result<(), StoreError> {
        let end = if commit { "COMMIT" } else { "ROLLBACK" };
        sqlx::query(end).execute(&mut *tx).await?;
        tx.finished = true;
        Ok(())
    }
}
