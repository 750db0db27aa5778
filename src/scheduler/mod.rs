//! Background duties on a one-second tick, on every instance and worker: refresh the sale
//! cache from SQL, preload approved sales into the gate before they open (`loader`),
//! expire orders past their payment deadline and hand returned stock back to the gate
//! (`lifecycle`), finish moves between segments a mover left half done, and point the
//! order writer at the streams of current sales. Each duty is idempotent; this module only
//! runs them in turn and never decides or loads anything itself.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::gate::{Gate, GateError};
use crate::loader::{LoadError, SaleCache};
use crate::store::{Store, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Gate(#[from] GateError),
    #[error(transparent)]
    Log(#[from] crate::orderlog::LogError),
    #[error(transparent)]
    Lifecycle(#[from] crate::lifecycle::LifecycleError),
    #[error(transparent)]
    Load(#[from] LoadError),
}

/// How long one pass may spend on each of expiry and returns before it leaves the rest to
/// the next pass (a second later).
pub const DUTY_BUDGET: Duration = Duration::from_millis(300);

pub struct Scheduler {
    pub store: Store,
    pub gate: Arc<dyn Gate>,
    pub cache: Arc<SaleCache>,
    pub backlog: Arc<dyn crate::orderlog::Backlog>,
    pub preload_ahead_ms: i64,
}

impl Scheduler {
    /// One pass of every duty; expiry and returns each stop starting new batches once
    /// `budget` is spent, and go on at the next pass.
    pub async fn tick(&self, budget: Duration) -> Result<(), SchedulerError> {
        self.cache.refresh(&self.store).await?;
        let segments: Vec<(i64, i64)> = self
            .cache
            .all()
            .iter()
            .map(|s| (s.id, s.segments))
            .collect();
        self.gate.know_segments(&segments);
        // An ended sale holds no memory: its buyers were this process's largest part.
        self.gate
            .forget_ended(self.store.now_ms() - crate::loader::KEEP_IN_GATE_AFTER_END_MS);
        // Every duty runs whatever the others did: a failing one (a sale's Redis master
        // away) must not stop expiries, returns or the writer's streams.
        let mut first_error: Option<SchedulerError> = None;
        let preloaded = crate::loader::preload(
            &self.store,
            self.gate.as_ref(),
            &self.cache,
            self.preload_ahead_ms,
        )
        .await;
        if let Err(e) = preloaded {
            first_error.get_or_insert(e.into());
        }
        let expired = match crate::lifecycle::expire_due(&self.store, budget).await {
            Ok(n) => n,
            Err(e) => {
                first_error.get_or_insert(e.into());
                0
            }
        };
        let returned =
            match crate::lifecycle::pump_returns(&self.store, self.gate.as_ref(), budget).await {
                Ok(n) => n,
                Err(e) => {
                    first_error.get_or_insert(e.into());
                    0
                }
            };
        match crate::gate::rebalance::finish_stalled_moves(&self.store, self.gate.as_ref()).await {
            Ok(0) => {}
            Ok(moves) => tracing::info!(moves, "moves between segments finished for their mover"),
            Err(e) => {
                first_error.get_or_insert(e.into());
            }
        }
        if expired + returned > 0 {
            tracing::info!(
                expired,
                returned,
                "unpaid orders expired; stock handed back to the gate"
            );
        }
        let sales: Vec<(i64, i64)> = self
            .cache
            .all()
            .iter()
            .map(|s| (s.id, s.segments))
            .collect();
        if let Err(e) = self.backlog.watch(&sales).await {
            first_error.get_or_insert(e.into());
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    pub async fn run(self, mut stop: watch::Receiver<bool>) {
        loop {
            if let Err(e) = self.tick(DUTY_BUDGET).await {
                tracing::warn!(error = %e, "scheduler tick failed");
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stop.changed() => {}
            }
            if crate::stop::requested(&mut stop) {
                break;
            }
        }
    }
}
