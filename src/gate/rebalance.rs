//! Moves stock into a buyer's empty segment from the others, so that no unit of a
//! segmented sale is stranded. A decorator at the gate seam, below the sold-out shortcut:
//! it only acts on a `sold_out` from one segment, and answers `sold_out` itself only when
//! every segment is empty and no move is under way. The purchase of a buyer whose segment
//! has stock passes straight through (one gate call, no SQL).
//!
//! A move: planned in SQL (`segment_moves`), taken from the donor (`take_move.lua`, once per
//! move id), marked taken in SQL only if still planned (a rebuild of the donor refuses
//! planned moves), given to the receiver (`give_move.lua`, once per move id), marked done.
//! Each step may be repeated; [`finish_stalled_moves`] repeats them for a mover that died.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use super::layer::Layer;

use crate::gate::{Gate, GateError, MoveLeg, MoveStep, Purchase, Rejection, Verdict};
use crate::store::moves::SegmentMove;
use crate::store::{Store, StoreError};

/// Rounds of moving and trying again before a buyer is told to retry.
const MAX_ROUNDS: usize = 8;
/// How long a buyer waits for moves of other instances before being told to retry.
const WAIT_FOR_MOVES_MS: u64 = 400;
/// A move unchanged this long has lost its mover: the scheduler finishes it.
pub const STALLED_AFTER_MS: i64 = 5_000;

/// Held by the one task of this process moving units into a segment.
type Mover = Arc<tokio::sync::Mutex<()>>;

pub struct Rebalancer {
    inner: Arc<dyn Gate>,
    store: Store,
    /// One mover per receiving segment in this process; the others wait for its move.
    movers: Mutex<HashMap<(i64, i64), Mover>>,
}

/// What a refill of a segment found.
enum Refill {
    /// The segment has the units now (moved here, or by someone else).
    Ready,
    /// Every segment together holds fewer units than asked, and nothing is moving.
    SoldOut { remaining: i64 },
}

fn store_error(e: StoreError) -> GateError {
    GateError::Sql(e.to_string())
}

impl Rebalancer {
    pub fn new(inner: Arc<dyn Gate>, store: Store) -> Self {
        Rebalancer {
            inner,
            store,
            movers: Mutex::new(HashMap::new()),
        }
    }

    fn mover(&self, sale_id: i64, segment: i64) -> Mover {
        self.movers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((sale_id, segment))
            .or_default()
            .clone()
    }

    /// Brings at least `need` units into `segment`, from the segments that hold the most.
    async fn refill(
        &self,
        sale_id: i64,
        segments: i64,
        segment: i64,
        need: i64,
    ) -> Result<Refill, GateError> {
        let mover = self.mover(sale_id, segment);
        let _one_mover = mover.lock().await;
        let waited = std::time::Instant::now();
        loop {
            let stocks = self.inner.segment_stocks(sale_id, segments).await?;
            if stocks.iter().any(Option::is_none) {
                // A segment is being rebuilt: its units are unknown until it is back.
                return Err(GateError::Unavailable(
                    "a segment of this sale is being rebuilt; retry".into(),
                ));
            }
            let stocks: Vec<i64> = stocks.into_iter().map(Option::unwrap_or_default).collect();
            let mine = stocks[segment as usize];
            if mine >= need {
                return Ok(Refill::Ready);
            }
            let donor = (0..segments)
                .filter(|s| *s != segment)
                .max_by_key(|s| stocks[*s as usize]);
            if let Some(donor) = donor.filter(|d| stocks[*d as usize] > 0) {
                let richest = stocks[donor as usize];
                // Half of the richest: the receiver's buyers are as many as the donor's,
                // and a unit moved twice costs two moves.
                let quantity = (need - mine).max((richest + 1) / 2).min(richest);
                move_units(
                    &self.store,
                    self.inner.as_ref(),
                    sale_id,
                    segments,
                    donor,
                    segment,
                    quantity,
                )
                .await?;
                continue;
            }
            let total: i64 = stocks.iter().sum();
            let moving = self
                .store
                .units_moving(sale_id)
                .await
                .map_err(store_error)?;
            if moving == 0 {
                return Ok(Refill::SoldOut { remaining: total });
            }
            if waited.elapsed().as_millis() as u64 > WAIT_FOR_MOVES_MS {
                return Err(GateError::Unavailable(
                    "stock is moving between this sale's segments; retry".into(),
                ));
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
}

/// One move of `quantity` units from `donor` to `receiver`; true when they arrived.
pub async fn move_units(
    store: &Store,
    gate: &dyn Gate,
    sale_id: i64,
    segments: i64,
    donor: i64,
    receiver: i64,
    quantity: i64,
) -> Result<bool, GateError> {
    let m = SegmentMove {
        id: rand::random::<i64>() & i64::MAX,
        sale_id,
        from_segment: donor,
        to_segment: receiver,
        quantity,
        state: "planned".into(),
        updated_at: 0,
    };
    store.plan_move(&m).await.map_err(store_error)?;
    finish_move(store, gate, &m, segments).await
}

/// The side of move `m` that touches `segment`.
fn leg(m: &SegmentMove, segments: i64, segment: i64) -> MoveLeg {
    MoveLeg {
        sale_id: m.sale_id,
        segments,
        segment,
        move_id: m.id,
        quantity: m.quantity,
    }
}

/// Carries a move on from the state it is in; every step is safe to repeat.
async fn finish_move(
    store: &Store,
    gate: &dyn Gate,
    m: &SegmentMove,
    segments: i64,
) -> Result<bool, GateError> {
    if m.state == "planned" {
        let taken = gate.take_for_move(leg(m, segments, m.from_segment)).await?;
        if taken != MoveStep::Done {
            // Refused, or the donor is not in the gate (its next load reads this refusal).
            store
                .advance_move(m.id, "planned", "refused")
                .await
                .map_err(store_error)?;
            return Ok(false);
        }
        // False when a rebuild of the donor refused the move meanwhile: the units were
        // taken from a gate since replaced, and the rebuilt donor still counts them.
        let still_ours = store
            .advance_move(m.id, "planned", "taken")
            .await
            .map_err(store_error)?;
        if !still_ours
            && store
                .segment_move(m.id)
                .await
                .map_err(store_error)?
                .is_none_or(|now| now.state != "taken")
        {
            return Ok(false);
        }
    }
    let given = gate.give_for_move(leg(m, segments, m.to_segment)).await?;
    if given == MoveStep::Done {
        store
            .advance_move(m.id, "taken", "done")
            .await
            .map_err(store_error)?;
        Ok(true)
    } else {
        // The receiver is not in the gate: its load counts the move, and the next pass of
        // the scheduler marks it done.
        Ok(false)
    }
}

/// Finishes moves whose mover stopped (a crash, a Redis or SQL error) part-way; run by
/// the scheduler. Returns how many it finished.
pub async fn finish_stalled_moves(store: &Store, gate: &dyn Gate) -> Result<usize, GateError> {
    let stalled = store
        .stalled_moves(store.now_ms() - STALLED_AFTER_MS, 100)
        .await
        .map_err(store_error)?;
    let mut finished = 0;
    let mut first_error = None;
    for m in stalled {
        let segments = match store.sale(m.sale_id).await.map_err(store_error)? {
            Some(sale) => sale.segments,
            None => continue,
        };
        match finish_move(store, gate, &m, segments).await {
            Ok(_) => finished += 1,
            Err(e) => {
                tracing::debug!(sale = m.sale_id, move_id = m.id, error = %e, "could not finish a move between segments yet");
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(finished),
    }
}

#[async_trait]
impl Layer for Rebalancer {
    fn inner(&self) -> &dyn Gate {
        self.inner.as_ref()
    }

    async fn purchase(&self, p: Purchase) -> Result<Verdict, GateError> {
        let verdict = self.inner.purchase(p).await?;
        if p.segments <= 1 || !matches!(verdict, Verdict::Rejected(Rejection::SoldOut { .. })) {
            return Ok(verdict);
        }
        // The buyer's segment lacks the units: bring them from the others, then try again.
        let again = Purchase {
            after_move: true,
            token: None,
            ..p
        };
        for _ in 0..MAX_ROUNDS {
            match self
                .refill(p.sale_id, p.segments, p.segment(), p.quantity)
                .await?
            {
                Refill::SoldOut { remaining } => {
                    return Ok(Verdict::Rejected(Rejection::SoldOut { remaining }))
                }
                Refill::Ready => {}
            }
            let verdict = self.inner.purchase(again).await?;
            if !matches!(verdict, Verdict::Rejected(Rejection::SoldOut { .. })) {
                return Ok(verdict);
            }
        }
        // Other buyers of this segment took every unit moved in, round after round.
        Err(GateError::Unavailable(
            "stock is moving between this sale's segments; retry".into(),
        ))
    }
}
