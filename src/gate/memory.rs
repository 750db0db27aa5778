//! The embedded gate: sale state in process memory, one mutex per sale. An accepted
//! order is appended to the local order log and answered only once it is durable; if the
//! log fails, the units and the user's slot are given back before the error is returned.
//! Lost on restart by design: the scheduler rebuilds it from SQL before serving.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use async_trait::async_trait;

use super::{
    Gate, GateError, GateStock, Purchase, RateLimit, Rejection, Release, Released, SaleLoad,
    Verdict,
};
use crate::model::NewOrder;
use crate::orderlog::local::LocalLog;

struct SaleState {
    remaining: i64,
    limit: i64,
    begins_at: i64,
    ends_at: i64,
    paused: bool,
    price_cents: i64,
    held: HashMap<i64, i64>,
    accepted: i64,
    released: std::collections::HashSet<i64>,
    /// Per user: GCRA theoretical arrival time (only when a rate limit is set).
    rate_tat: HashMap<i64, i64>,
}

pub struct MemoryGate {
    sales: RwLock<HashMap<i64, Arc<Mutex<SaleState>>>>,
    log: LocalLog,
    clock: fn() -> i64,
    rate: RateLimit,
}

impl MemoryGate {
    pub fn new(log: LocalLog) -> Self {
        Self::with_clock(log, crate::now_ms)
    }

    pub fn with_clock(log: LocalLog, clock: fn() -> i64) -> Self {
        Self {
            sales: RwLock::new(HashMap::new()),
            log,
            clock,
            rate: RateLimit {
                per_sec: 0.0,
                burst: 1,
            },
        }
    }

    /// Throttles each user's purchases of a sale (GCRA, as the Redis gate does).
    pub fn with_rate_limit(mut self, rate: RateLimit) -> Self {
        self.rate = rate;
        self
    }

    fn sale(&self, id: i64) -> Option<Arc<Mutex<SaleState>>> {
        self.sales
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
    }

    /// The atomic decision; returns the order to append when accepted.
    fn decide(&self, state: &Mutex<SaleState>, p: &Purchase) -> Result<(i64, NewOrder), Rejection> {
        let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
        let now = (self.clock)();
        if self.rate.interval_ms() > 0 {
            let tat = s.rate_tat.get(&p.user_id).copied().unwrap_or(0);
            let next = self
                .rate
                .check(tat, now)
                .map_err(|wait| Rejection::RateLimited {
                    retry_after_ms: wait,
                })?;
            s.rate_tat.insert(p.user_id, next);
        }
        if now < s.begins_at {
            return Err(Rejection::NotStarted);
        }
        if now >= s.ends_at {
            return Err(Rejection::Ended);
        }
        if s.paused {
            return Err(Rejection::Paused);
        }
        let held = s.held.get(&p.user_id).copied().unwrap_or(0);
        if held + p.quantity > s.limit {
            return Err(if held >= s.limit {
                Rejection::AlreadyPurchased
            } else {
                Rejection::OverLimit { held }
            });
        }
        if s.remaining < p.quantity {
            return Err(Rejection::SoldOut {
                remaining: s.remaining,
            });
        }
        s.remaining -= p.quantity;
        s.accepted += 1;
        s.held.insert(p.user_id, held + p.quantity);
        let order = NewOrder {
            id: p.order_id,
            sale_id: p.sale_id,
            user_id: p.user_id,
            quantity: p.quantity,
            price_cents: s.price_cents,
            accepted_at: now,
        };
        Ok((s.remaining, order))
    }

    fn give_back(state: &Mutex<SaleState>, p: &Purchase) {
        let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
        s.remaining += p.quantity;
        s.accepted -= 1;
        let held = s.held.get(&p.user_id).copied().unwrap_or(0) - p.quantity;
        if held > 0 {
            s.held.insert(p.user_id, held);
        } else {
            s.held.remove(&p.user_id);
        }
    }
}

#[async_trait]
impl Gate for MemoryGate {
    async fn purchase(&self, p: Purchase) -> Result<Verdict, GateError> {
        let Some(state) = self.sale(p.sale_id) else {
            return Ok(Verdict::Rejected(Rejection::NotLoaded));
        };
        let (remaining, order) = match self.decide(&state, &p) {
            Ok(accepted) => accepted,
            Err(rejection) => return Ok(Verdict::Rejected(rejection)),
        };
        if let Err(e) = self.log.append(order).await {
            Self::give_back(&state, &p);
            return Err(e.into());
        }
        Ok(Verdict::Accepted { remaining })
    }

    async fn load(&self, load: &SaleLoad) -> Result<bool, GateError> {
        let mut sales = self.sales.write().unwrap_or_else(|p| p.into_inner());
        if sales.contains_key(&load.sale.id) {
            return Ok(false);
        }
        let state = SaleState {
            remaining: load.remaining,
            limit: load.sale.per_user_limit,
            begins_at: load.sale.begins_at,
            ends_at: load.sale.ends_at,
            paused: load.sale.paused,
            price_cents: load.sale.price_cents,
            held: load
                .buyers
                .iter()
                .copied()
                .filter(|(_, n)| *n > 0)
                .collect(),
            released: load.released.iter().copied().collect(),
            accepted: 0,
            rate_tat: HashMap::new(),
        };
        sales.insert(load.sale.id, Arc::new(Mutex::new(state)));
        Ok(true)
    }

    async fn release(&self, r: Release) -> Result<Released, GateError> {
        let Some(state) = self.sale(r.sale_id) else {
            return Ok(Released::NotLoaded);
        };
        let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
        if !s.released.insert(r.order_id) {
            return Ok(Released::Before);
        }
        s.remaining += r.quantity;
        let held = s.held.get(&r.user_id).copied().unwrap_or(0) - r.quantity;
        if held > 0 {
            s.held.insert(r.user_id, held);
        } else {
            s.held.remove(&r.user_id);
        }
        Ok(Released::Now)
    }

    async fn is_loaded(&self, sale_id: i64) -> Result<bool, GateError> {
        Ok(self.sale(sale_id).is_some())
    }

    async fn stock(&self, sale_id: i64) -> Result<Option<GateStock>, GateError> {
        Ok(self.sale(sale_id).map(|state| {
            let s = state.lock().unwrap_or_else(|e| e.into_inner());
            GateStock {
                remaining: s.remaining,
                paused: s.paused,
                buyers: s.held.len() as i64,
                accepted: s.accepted,
            }
        }))
    }

    async fn set_paused(&self, sale_id: i64, paused: bool) -> Result<(), GateError> {
        if let Some(state) = self.sale(sale_id) {
            state.lock().unwrap_or_else(|e| e.into_inner()).paused = paused;
        }
        Ok(())
    }

    async fn queued_order(
        &self,
        _sale_id: i64,
        _order_id: i64,
    ) -> Result<Option<(i64, i64)>, GateError> {
        // Embedded orders are answered only once written: none is ever queued.
        Ok(None)
    }
}
