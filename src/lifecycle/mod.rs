//! The order lifecycle after the purchase: payment, cancellation, expiry, and the stock
//! that comes back. Transitions are decided in SQL (see `store::transitions`), where a
//! guard lets exactly one of pay, cancel and expire win; returned units then go back to
//! the gate through an outbox, exactly once. Never touches the purchase path.

pub mod payment;

use std::time::{Duration, Instant};

use crate::gate::{Gate, GateError, Release, Released};
use crate::store::{Outcome, StockReturn, TransitionError};
use crate::store::{Store, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum LifecycleError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Gate(#[from] GateError),
    #[error(transparent)]
    Transition(#[from] TransitionError),
}

/// Hands one return to the gate and clears it from the outbox. Safe to repeat: the gate
/// takes each order's units back once. A return met by a load of its sale under way
/// (`Deferred`) stays in the outbox, and is handed over again once the sale is in.
pub async fn return_to_gate(
    store: &Store,
    gate: &dyn Gate,
    r: &StockReturn,
) -> Result<Released, LifecycleError> {
    let released = release(gate, r).await?;
    if released != Released::Deferred {
        store.mark_returned(r.order_id, store.now_ms()).await?;
    }
    Ok(released)
}

async fn release(gate: &dyn Gate, r: &StockReturn) -> Result<Released, GateError> {
    gate.release(Release {
        sale_id: r.sale_id,
        order_id: r.order_id,
        user_id: r.user_id,
        quantity: r.quantity,
    })
    .await
}

/// How many returns one pass reads, hands over and clears in one transaction.
const RETURNS_BATCH: i64 = 500;

/// Empties the outbox of returned stock, batch by batch until `budget` is spent (the rest
/// waits for the next pass: a mass expiry must not hold up the scheduler's other duties);
/// returns how many were handed over. A sale whose gate fails (its Redis master away) is
/// skipped for this pass and the others go on; the first such error is returned after them.
pub async fn pump_returns(
    store: &Store,
    gate: &dyn Gate,
    budget: Duration,
) -> Result<usize, LifecycleError> {
    let started = Instant::now();
    let mut handed = 0;
    let mut skipped: Vec<i64> = Vec::new();
    let mut first_error = None;
    loop {
        let batch = store
            .pending_returns_except(&skipped, RETURNS_BATCH)
            .await?;
        if batch.is_empty() {
            break;
        }
        let mut taken = Vec::with_capacity(batch.len());
        for r in &batch {
            if skipped.contains(&r.sale_id) {
                continue;
            }
            match release(gate, r).await {
                // Being loaded: the rest of this sale's returns wait for the load too.
                Ok(Released::Deferred) => skipped.push(r.sale_id),
                Ok(_) => taken.push(r.order_id),
                Err(e) => {
                    skipped.push(r.sale_id);
                    first_error.get_or_insert(e.into());
                }
            }
        }
        // Handed over but not cleared (a crash here) is handed over again: the gate takes
        // each order's units back once.
        if !taken.is_empty() {
            store.mark_all_returned(&taken, store.now_ms()).await?;
        }
        handed += taken.len();
        if started.elapsed() >= budget {
            break;
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(handed),
    }
}

/// Hands the returns of one sale to the gate: right after its load, for those a release
/// met while it was being loaded (`Released::Deferred`), so that their buyers may buy
/// again at once rather than at the scheduler's next pass.
pub async fn pump_returns_of(
    store: &Store,
    gate: &dyn Gate,
    sale_id: i64,
) -> Result<usize, LifecycleError> {
    let mut handed = 0;
    loop {
        let batch = store.pending_returns(Some(sale_id), 500).await?;
        for r in &batch {
            if return_to_gate(store, gate, r).await? == Released::Deferred {
                // Being loaded again: that load's end hands them over.
                return Ok(handed);
            }
            handed += 1;
        }
        if batch.len() < 500 {
            return Ok(handed);
        }
    }
}

/// How many overdue orders one transaction expires: one commit for them all. A batch
/// takes its sales' rows only at its end (three or four statements each, the journal's
/// lines, then the commit), so a writer of a sale waits on it about as long as on another
/// writer's batch (longer when the batch spans many sales: the first sale's row is held
/// while the others are done).
const EXPIRY_BATCH: i64 = 500;

/// Expires orders past their payment deadline, a transaction per batch, until none is
/// due or `budget` is spent (a million overdue orders after a restart are expired over
/// many passes, while the server serves); returns how many expired.
pub async fn expire_due(store: &Store, budget: Duration) -> Result<usize, LifecycleError> {
    let started = Instant::now();
    let mut expired = 0;
    loop {
        let now = store.now_ms();
        let due = store.due_for_expiry(now, EXPIRY_BATCH).await?;
        if due.is_empty() {
            return Ok(expired);
        }
        let ids: Vec<i64> = due.iter().map(|(_, id)| *id).collect();
        expired += store.expire_orders(&ids, now).await?;
        if (due.len() as i64) < EXPIRY_BATCH || started.elapsed() >= budget {
            return Ok(expired);
        }
    }
}

/// Cancels a buyer's order and gives its units back at once (the outbox is the fallback).
pub async fn cancel(
    store: &Store,
    gate: &dyn Gate,
    order_id: i64,
    user_id: i64,
) -> Result<(), LifecycleError> {
    let order = store
        .transition(
            order_id,
            Some(user_id),
            Outcome::Cancelled,
            store.now_ms(),
            "cancelled by the buyer",
        )
        .await?;
    let r = StockReturn {
        order_id,
        sale_id: order.sale_id,
        user_id: order.user_id,
        quantity: order.quantity,
    };
    if let Err(e) = return_to_gate(store, gate, &r).await {
        // Committed in SQL and in the outbox: the scheduler hands it over later.
        tracing::warn!(error = %e, order_id, "stock return deferred to the scheduler");
    }
    Ok(())
}
