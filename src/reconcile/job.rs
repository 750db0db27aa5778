//! The full reconcile of a sale as a background job (`POST /api/admin/sales/{id}/recount`):
//! every row of the sale counted again at the background pace, its buyers compared one by
//! one with the gate's, the kept counters and tallies checked (and corrected if they were
//! wrong). The request that starts it answers at once; the instance that got it runs it and
//! keeps its progress and outcome in SQL (`recount_jobs`), so that any instance tells how
//! far it got. One job per sale at a time.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::{account_with, Account, Depth, ReconcileError};
use crate::gate::Gate;
use crate::orderlog::Backlog;
use crate::store::{Pace, Store};

/// A job that has not reported for this long is taken to have died with its process: a
/// new one may start. (A running job reports at least every `REPORT_EVERY`.)
const STALE_MS: i64 = 30_000;
const REPORT_EVERY: Duration = Duration::from_secs(1);

/// What a finished job found, kept as JSON with the job.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// The gate against the recounted SQL and what is in flight.
    pub account: Account,
    pub exact: bool,
    /// Whether the kept counters and tallies disagreed with the rows (and were corrected).
    pub counters_corrected: bool,
    /// The tallies that differed: (tally, kept, counted).
    pub tallies_corrected: Vec<(String, i64, i64)>,
    pub orders_read: i64,
}

/// Starts a recount job of the sale in the background; false when one is running already.
pub async fn start(
    store: Store,
    gate: Arc<dyn Gate>,
    backlog: Arc<dyn Backlog>,
    sale_id: i64,
) -> Result<bool, ReconcileError> {
    let total = store.tallies(sale_id).await?.orders_written();
    if !store.start_recount_job(sale_id, total, STALE_MS).await? {
        return Ok(false);
    }
    tokio::spawn(run(store, gate, backlog, sale_id));
    Ok(true)
}

async fn run(store: Store, gate: Arc<dyn Gate>, backlog: Arc<dyn Backlog>, sale_id: i64) {
    let read = Arc::new(AtomicI64::new(0));
    let counted = {
        let read = read.clone();
        move |orders: i64| read.store(orders, Ordering::Relaxed)
    };
    let depth = Depth::Recount(Pace::BACKGROUND);
    let work = account_with(
        &store,
        gate.as_ref(),
        backlog.as_ref(),
        sale_id,
        depth,
        &counted,
    );
    tokio::pin!(work);
    let result = loop {
        tokio::select! {
            result = &mut work => break result,
            _ = tokio::time::sleep(REPORT_EVERY) => {
                let so_far = read.load(Ordering::Relaxed);
                if let Err(e) = store.recount_job_progress(sale_id, so_far).await {
                    tracing::debug!(sale = sale_id, error = %e, "could not note the recount's progress");
                }
            }
        }
    };
    let orders_read = read.load(Ordering::Relaxed);
    let finished = match result {
        Ok((account, recount)) => {
            let (counters_corrected, tallies_corrected) = match &recount {
                Some(r) => (r.corrected, r.kept_tallies.differences(&r.counted_tallies)),
                None => (false, Vec::new()),
            };
            let outcome = Outcome {
                exact: account.exact(),
                account,
                counters_corrected,
                tallies_corrected,
                orders_read,
            };
            tracing::info!(
                sale = sale_id,
                exact = outcome.exact,
                orders_read,
                "recount done"
            );
            let json = serde_json::to_string(&outcome).unwrap_or_default();
            store
                .finish_recount_job(sale_id, orders_read, Ok(&json))
                .await
        }
        Err(e) => {
            tracing::warn!(sale = sale_id, error = %e, "recount failed");
            store
                .finish_recount_job(sale_id, orders_read, Err(&e.to_string()))
                .await
        }
    };
    if let Err(e) = finished {
        tracing::warn!(sale = sale_id, error = %e, "could not record the recount's end");
    }
}
