//! The embedded gate: sale state in process memory, one mutex per sale. An accepted
//! order is appended to the local order log and answered only once it is durable; if the
//! log fails, the units and the user's slot are given back before the error is returned.
//! Lost on restart by design: the orders still in the log are written to SQL, then the
//! scheduler rebuilds the gate from SQL, before serving.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};

use async_trait::async_trait;

use super::{
    Gate, GateError, GateStock, Purchase, RateLimit, Rejection, Release, Released, RetryKey,
    SaleLoad, Spend, Verdict,
};
use crate::clock::SharedClock;
use crate::model::NewOrder;
use crate::orderlog::local::LocalLog;

struct SaleState {
    remaining: i64,
    /// The sale's whole stock: `remaining` never exceeds it (units come back once each).
    initial_stock: i64,
    limit: i64,
    begins_at: i64,
    ends_at: i64,
    paused: bool,
    price_cents: i64,
    held: Holdings,
    accepted: i64,
    /// Orders decided and not yet in the order log, and their units (see `GateStock`).
    appending_orders: i64,
    appending_units: i64,
    released: HashSet<i64>,
    /// Per user below the limit: GCRA theoretical arrival time (only when a rate limit is
    /// set; a buyer who holds the limit is not throttled).
    rate_tat: HashMap<i64, i64>,
    /// Size of `rate_tat` at which times already past are swept out.
    rate_sweep_at: usize,
}

impl SaleState {
    /// The invariants (docs/ARCHITECTURE.md) as this sale's state shows them, checked where
    /// they change (debug builds): the stock is never negative nor more than the sale's (1,
    /// 5: stock comes back once), and no buyer holds more than the limit (2).
    fn assert_invariants(&self, sale_id: i64, user_id: i64) {
        debug_assert!(
            self.remaining >= 0,
            "invariant 1: sale {sale_id}'s stock in the gate is {}",
            self.remaining
        );
        debug_assert!(
            self.remaining <= self.initial_stock,
            "invariant 5: sale {sale_id} has {} units in the gate, more than its {} (stock back twice)",
            self.remaining,
            self.initial_stock
        );
        debug_assert!(
            self.held.get(user_id) <= self.limit,
            "invariant 2: user {user_id} holds more than {} of sale {sale_id}",
            self.limit
        );
    }
}

/// Who holds how many units of a sale. A buyer of one unit (nearly every buyer of a flash
/// sale) is an id in a set, 9 bytes a slot; the few holding more are in a map beside it,
/// 17 a slot: a million buyers take about 19 MB rather than 36.
/// Keyed by a fast seeded hash: ids come from signed tokens, and SipHash cost a 1M-buyer
/// restart 0.4 s.
#[derive(Default)]
struct Holdings {
    one: HashSet<i64, FastHash>,
    more: HashMap<i64, i64, FastHash>,
}

type FastHash = foldhash::fast::RandomState;

impl Holdings {
    fn from(buyers: &[(i64, i64)]) -> Self {
        let ones = buyers.iter().filter(|(_, n)| *n == 1).count();
        let mut h = Holdings {
            one: HashSet::with_capacity_and_hasher(ones, FastHash::default()),
            more: HashMap::default(),
        };
        for (user, units) in buyers {
            h.set(*user, *units);
        }
        h
    }

    fn get(&self, user: i64) -> i64 {
        if self.one.contains(&user) {
            1
        } else {
            self.more.get(&user).copied().unwrap_or(0)
        }
    }

    /// `units` 0 (or less) forgets the buyer.
    fn set(&mut self, user: i64, units: i64) {
        match units {
            ..=0 => {
                self.one.remove(&user);
                self.more.remove(&user);
            }
            1 => {
                self.more.remove(&user);
                self.one.insert(user);
            }
            _ => {
                self.one.remove(&user);
                self.more.insert(user, units);
            }
        }
    }

    fn len(&self) -> usize {
        self.one.len() + self.more.len()
    }

    fn iter(&self) -> impl Iterator<Item = (i64, i64)> + '_ {
        let more = self.more.iter().map(|(user, units)| (*user, *units));
        self.one.iter().map(|user| (*user, 1)).chain(more)
    }
}

pub struct MemoryGate {
    sales: RwLock<HashMap<i64, Arc<Mutex<SaleState>>>>,
    spent: Mutex<SpentNonces>,
    /// Purchases made with an `Idempotency-Key`, by sale, buyer and key: kept beside the
    /// sales so that a retry is answered after its sale left the gate.
    retries: Mutex<RetryRecords>,
    log: LocalLog,
    clock: SharedClock,
    rate: RateLimit,
}

impl MemoryGate {
    pub fn new(log: LocalLog) -> Self {
        Self::with_clock(log, crate::clock::wall())
    }

    /// A gate deciding sale windows by `clock` (the process's; a simulated one in tests).
    pub fn with_clock(log: LocalLog, clock: SharedClock) -> Self {
        Self {
            sales: RwLock::new(HashMap::new()),
            spent: Mutex::new(SpentNonces::default()),
            retries: Mutex::new(RetryRecords::default()),
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

    fn retries(&self) -> std::sync::MutexGuard<'_, RetryRecords> {
        self.retries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The atomic decision; returns the order to append when accepted.
    fn decide(&self, state: &Mutex<SaleState>, p: &Purchase) -> Result<Decision, Rejection> {
        let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.clock.now_ms();
        // Under the sale's lock: a retry sees its first attempt's record or its decision.
        if let Some(key) = p.retry_key {
            if let Some(record) = self.retries().find(p, key, now)? {
                return Ok(record);
            }
        }
        let open = now >= s.begins_at && now < s.ends_at && !s.paused;
        // A buyer who holds the limit can take nothing more and is told so without spending
        // a place in the rate, as purchase.lua does (see there).
        let at_limit = |s: &SaleState| open && s.held.get(p.user_id) >= s.limit;
        let mut next_tat = None;
        if self.rate.interval_ms() > 0 && !at_limit(&s) {
            next_tat = Some(self.take_rate_place(&mut s, p.user_id, now)?);
        }
        let decided = self.decide_in_window(&mut s, p, now);
        // Kept for a buyer still below the limit, whatever the answer.
        if let Some(next) = next_tat.filter(|_| !at_limit(&s)) {
            s.rate_tat.insert(p.user_id, next);
        }
        let (remaining, order) = decided?;
        if let Some(key) = p.retry_key {
            self.retries().keep(p, key, now);
        }
        Ok(Decision::Take(remaining, order))
    }

    /// The buyer's next theoretical arrival time (GCRA), or how long to wait.
    fn take_rate_place(&self, s: &mut SaleState, user_id: i64, now: i64) -> Result<i64, Rejection> {
        // A time already past limits nothing (GCRA starts from max(tat, now)), so those
        // entries can go: the map follows the users of the last moments, not every user
        // of the sale (a million buyers would otherwise cost tens of megabytes).
        if s.rate_tat.len() >= s.rate_sweep_at {
            s.rate_tat.retain(|_, tat| *tat > now);
            s.rate_sweep_at = (s.rate_tat.len() * 2).max(1024);
        }
        let tat = s.rate_tat.get(&user_id).copied().unwrap_or(0);
        self.rate
            .check(tat, now)
            .map_err(|wait| Rejection::RateLimited {
                retry_after_ms: wait,
            })
    }

    /// Everything after the rate: the window, the token, the limit and the stock.
    fn decide_in_window(
        &self,
        s: &mut SaleState,
        p: &Purchase,
        now: i64,
    ) -> Result<(i64, NewOrder), Rejection> {
        if now < s.begins_at {
            return Err(Rejection::NotStarted);
        }
        if now >= s.ends_at {
            return Err(Rejection::Ended);
        }
        if s.paused {
            return Err(Rejection::Paused);
        }
        if let Some(token) = p.token {
            if !self.spend_now(p.sale_id, token, now) {
                return Err(Rejection::TokenUsed);
            }
        }
        let held = s.held.get(p.user_id);
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
        s.appending_orders += 1;
        s.appending_units += p.quantity;
        s.held.set(p.user_id, held + p.quantity);
        s.assert_invariants(p.sale_id, p.user_id);
        let order = NewOrder {
            id: p.order_id,
            sale_id: p.sale_id,
            user_id: p.user_id,
            quantity: p.quantity,
            price_cents: s.price_cents,
            accepted_at: now,
            retry_key: p.retry_key,
        };
        Ok((s.remaining, order))
    }

    fn spend_now(&self, sale_id: i64, spend: Spend, now: i64) -> bool {
        self.spent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .spend(sale_id, spend, now)
    }

    fn give_back(&self, state: &Mutex<SaleState>, p: &Purchase) {
        let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(key) = p.retry_key {
            self.retries().forget(p, key);
        }
        s.remaining += p.quantity;
        s.accepted -= 1;
        let held = s.held.get(p.user_id) - p.quantity;
        debug_assert!(
            held >= 0,
            "a purchase given back twice (user {})",
            p.user_id
        );
        s.held.set(p.user_id, held);
        s.assert_invariants(p.sale_id, p.user_id);
    }
}

/// A purchase's `Idempotency-Key` record, settled when its append ends however it ends.
struct RecordSettled<'a> {
    gate: &'a MemoryGate,
    p: &'a Purchase,
}

impl Drop for RecordSettled<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.p.retry_key {
            self.gate.retries().durable(self.p, key);
        }
    }
}

/// An order decided and on its way into the log; its end, durable or not (or the purchase
/// dropped mid-append), takes it off the sale's `appending` figures.
struct Appending<'a> {
    state: &'a Mutex<SaleState>,
    units: i64,
}

impl Drop for Appending<'_> {
    fn drop(&mut self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.appending_orders -= 1;
        s.appending_units -= self.units;
    }
}

#[async_trait]
impl Gate for MemoryGate {
    async fn purchase(&self, p: Purchase) -> Result<Verdict, GateError> {
        let (state, remaining, order) = loop {
            let Some(state) = self.sale(p.sale_id) else {
                let now = self.clock.now_ms();
                let record = match p.retry_key {
                    Some(key) => self.retries().find(&p, key, now),
                    None => Ok(None),
                };
                return match record {
                    Ok(Some(Decision::Again { order_id, .. })) => Ok(Verdict::Again { order_id }),
                    Err(rejection) => Ok(Verdict::Rejected(rejection)),
                    _ => Ok(Verdict::Rejected(Rejection::NotLoaded)),
                };
            };
            match self.decide(&state, &p) {
                Ok(Decision::Take(remaining, order)) => break (state, remaining, order),
                Ok(Decision::Again {
                    order_id,
                    appending: false,
                }) => return Ok(Verdict::Again { order_id }),
                // The first attempt is on its way into the log: its answer is not known
                // until it is durable (or given back). A millisecond or so.
                Ok(Decision::Again { .. }) => {
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await
                }
                Err(rejection) => return Ok(Verdict::Rejected(rejection)),
            }
        };
        let appending = Appending {
            state: &state,
            units: p.quantity,
        };
        // However the append ends, even with this purchase dropped mid-way (its buyer gone),
        // retries stop waiting for it: a failed append forgets the record first (below).
        let _record = RecordSettled { gate: self, p: &p };
        let appended = self.log.append(order).await;
        drop(appending);
        if let Err(e) = appended {
            // The log refuses every order from now on, so these units cannot be sold
            // twice; a restart rebuilds the gate from SQL and what the log kept.
            self.give_back(&state, &p);
            return Err(match e {
                // It may come back at the next start: the buyer hears `pending`, not "no".
                crate::orderlog::LogError::Unconfirmed(_) => GateError::NotDurable,
                e => e.into(),
            });
        }
        Ok(Verdict::Accepted { remaining })
    }

    async fn restore_retries(&self, kept: &[crate::model::KeptPurchase]) -> usize {
        let now = self.clock.now_ms();
        let mut retries = self.retries();
        let before = retries.made.len();
        for k in kept.iter().filter(|k| k.at + super::RETRY_KEY_MS > now) {
            let record = RetryRecord {
                order_id: k.order_id,
                quantity: k.quantity,
                at: k.at,
                appending: false,
            };
            // A record made since start-up is the newer one.
            retries
                .made
                .entry((k.sale_id, k.user_id, k.key))
                .or_insert(record);
        }
        retries.made.len() - before
    }

    async fn load(&self, load: &SaleLoad) -> Result<bool, GateError> {
        let mut sales = self.sales.write().unwrap_or_else(|p| p.into_inner());
        if sales.contains_key(&load.sale.id) {
            return Ok(false);
        }
        debug_assert!(
            load.remaining >= 0 && load.remaining <= load.sale.initial_stock,
            "a load of sale {} with {} units of {}",
            load.sale.id,
            load.remaining,
            load.sale.initial_stock
        );
        debug_assert!(
            load.buyers
                .iter()
                .all(|(_, units)| *units <= load.sale.per_user_limit),
            "a load of sale {} with a buyer over its limit",
            load.sale.id
        );
        let state = SaleState {
            remaining: load.remaining,
            initial_stock: load.sale.initial_stock,
            limit: load.sale.per_user_limit,
            begins_at: load.sale.begins_at,
            ends_at: load.sale.ends_at,
            paused: load.sale.paused,
            price_cents: load.sale.price_cents,
            held: Holdings::from(&load.buyers),
            released: load.released.iter().copied().collect(),
            accepted: 0,
            appending_orders: 0,
            appending_units: 0,
            rate_tat: HashMap::new(),
            rate_sweep_at: 1024,
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
        let held = s.held.get(r.user_id) - r.quantity;
        debug_assert!(
            held >= 0,
            "invariant 5: order {} of sale {} gave back more than its buyer held",
            r.order_id,
            r.sale_id
        );
        s.held.set(r.user_id, held);
        // The freed slot takes a place in the rate, as release.lua's does (see there).
        if self.rate.interval_ms() > 0 {
            let now = self.clock.now_ms();
            let tat = s.rate_tat.get(&r.user_id).copied().unwrap_or(0);
            s.rate_tat
                .insert(r.user_id, tat.max(now) + self.rate.interval_ms());
        }
        s.assert_invariants(r.sale_id, r.user_id);
        Ok(Released::Now)
    }

    async fn is_loaded(&self, sale_id: i64) -> Result<bool, GateError> {
        Ok(self.sale(sale_id).is_some())
    }

    /// Rebuilt only when the process starts: a release reaching it is of an order it
    /// counted since, or of a return SQL still owes it (`SaleLoad::released`).
    fn keeps_order_ids(&self) -> bool {
        false
    }

    fn forget_ended(&self, before: i64) {
        let mut sales = self.sales.write().unwrap_or_else(|p| p.into_inner());
        sales.retain(|_, state| state.lock().unwrap_or_else(|e| e.into_inner()).ends_at >= before);
    }

    async fn stock(&self, sale_id: i64) -> Result<Option<GateStock>, GateError> {
        Ok(self.sale(sale_id).map(|state| {
            let s = state.lock().unwrap_or_else(|e| e.into_inner());
            GateStock {
                remaining: s.remaining,
                paused: s.paused,
                buyers: s.held.len() as i64,
                accepted: s.accepted,
                appending_orders: s.appending_orders,
                appending_units: s.appending_units,
            }
        }))
    }

    async fn holders(
        &self,
        sale_id: i64,
        cap: usize,
    ) -> Result<Option<Vec<(i64, i64)>>, GateError> {
        Ok(self.sale(sale_id).and_then(|state| {
            let s = state.lock().unwrap_or_else(|e| e.into_inner());
            (s.held.len() <= cap).then(|| s.held.iter().collect())
        }))
    }

    async fn set_paused(&self, sale_id: i64, paused: bool) -> Result<(), GateError> {
        if let Some(state) = self.sale(sale_id) {
            state.lock().unwrap_or_else(|e| e.into_inner()).paused = paused;
        }
        Ok(())
    }

    async fn end_early(&self, sale_id: i64, at: i64) -> Result<(), GateError> {
        if let Some(state) = self.sale(sale_id) {
            let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
            s.ends_at = s.ends_at.min(at);
        }
        Ok(())
    }

    async fn spend(&self, sale_id: i64, spend: Spend) -> Result<bool, GateError> {
        Ok(self.spend_now(sale_id, spend, self.clock.now_ms()))
    }

    async fn queued_order(
        &self,
        sale_id: i64,
        order_id: i64,
    ) -> Result<Option<(i64, i64)>, GateError> {
        Ok(self.log.queued(sale_id, order_id))
    }
}

/// What the atomic decision made of an attempt.
enum Decision {
    /// Accepted: the stock left and the order to append.
    Take(i64, NewOrder),
    /// Its `Idempotency-Key` bought this order before (`appending` while that order is
    /// not yet durable).
    Again { order_id: i64, appending: bool },
}

/// The purchases made with an `Idempotency-Key` in the last [`super::RETRY_KEY_MS`], swept
/// whenever the map doubles, as the spent nonces are.
#[derive(Default)]
struct RetryRecords {
    made: HashMap<(i64, i64, RetryKey), RetryRecord>,
    sweep_at: usize,
}

struct RetryRecord {
    order_id: i64,
    quantity: i64,
    at: i64,
    appending: bool,
}

impl RetryRecords {
    fn find(&self, p: &Purchase, key: RetryKey, now: i64) -> Result<Option<Decision>, Rejection> {
        match self.made.get(&(p.sale_id, p.user_id, key)) {
            Some(r) if r.at + super::RETRY_KEY_MS > now => {
                if r.quantity != p.quantity {
                    return Err(Rejection::RetryKeyReused);
                }
                Ok(Some(Decision::Again {
                    order_id: r.order_id,
                    appending: r.appending,
                }))
            }
            _ => Ok(None),
        }
    }

    fn keep(&mut self, p: &Purchase, key: RetryKey, now: i64) {
        if self.made.len() >= self.sweep_at {
            self.made.retain(|_, r| r.at + super::RETRY_KEY_MS > now);
            self.sweep_at = (self.made.len() * 2).max(1024);
        }
        let record = RetryRecord {
            order_id: p.order_id,
            quantity: p.quantity,
            at: now,
            appending: true,
        };
        self.made.insert((p.sale_id, p.user_id, key), record);
    }

    fn durable(&mut self, p: &Purchase, key: RetryKey) {
        if let Some(r) = self.made.get_mut(&(p.sale_id, p.user_id, key)) {
            if r.order_id == p.order_id {
                r.appending = false;
            }
        }
    }

    fn forget(&mut self, p: &Purchase, key: RetryKey) {
        let id = (p.sale_id, p.user_id, key);
        if self.made.get(&id).is_some_and(|r| r.order_id == p.order_id) {
            self.made.remove(&id);
        }
    }
}

/// Nonces spent, with the instant each may be forgotten. Expired ones are swept whenever
/// the set doubles, so memory follows the nonces alive, not all ever spent.
#[derive(Default)]
struct SpentNonces {
    until: HashMap<(i64, u64), i64>,
    sweep_at: usize,
}

impl SpentNonces {
    fn spend(&mut self, sale_id: i64, spend: Spend, now: i64) -> bool {
        if self.until.len() >= self.sweep_at {
            self.until.retain(|_, until| *until > now);
            self.sweep_at = (self.until.len() * 2).max(1024);
        }
        let key = (sale_id, spend.nonce);
        match self.until.get(&key) {
            Some(until) if *until > now => false,
            _ => {
                self.until.insert(key, now + spend.keep_ms(now));
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SimClock;

    #[test]
    fn rate_entries_in_the_past_are_swept_and_live_ones_kept() {
        let (log, _reader) = crate::orderlog::local::channel();
        let clock = SimClock::new(10_000);
        let gate = MemoryGate::with_clock(log, clock.clone()).with_rate_limit(RateLimit {
            per_sec: 1.0,
            burst: 1,
        });
        // A limit of two: each buyer's one purchase leaves them below it, still throttled.
        let state = Mutex::new(SaleState {
            remaining: 1_000_000,
            initial_stock: 1_000_000,
            limit: 2,
            begins_at: 0,
            ends_at: i64::MAX,
            paused: false,
            price_cents: 1,
            held: Holdings::default(),
            accepted: 0,
            appending_orders: 0,
            appending_units: 0,
            released: Default::default(),
            rate_tat: HashMap::new(),
            rate_sweep_at: 1024,
        });
        let attempt = |user| Purchase {
            sale_id: 1,
            user_id: user,
            quantity: 1,
            order_id: user,
            token: None,
            segments: 1,
            after_move: false,
            retry_key: None,
        };
        for user in 0..5000 {
            assert!(gate.decide(&state, &attempt(user)).is_ok());
        }
        assert!(state.lock().unwrap().rate_tat.len() >= 1024);
        assert!(matches!(
            gate.decide(&state, &attempt(7)),
            Err(Rejection::RateLimited { .. })
        ));
        // Ten seconds on, every stored time is past: the next growth sweeps them all.
        clock.advance(10_000);
        for user in 10_000..14_000 {
            assert!(gate.decide(&state, &attempt(user)).is_ok());
        }
        let s = state.lock().unwrap();
        assert!(s.rate_tat.len() <= 4_000, "{}", s.rate_tat.len());
        drop(s);
        // A user seen a moment ago is still throttled after the sweep.
        assert!(matches!(
            gate.decide(&state, &attempt(13_999)),
            Err(Rejection::RateLimited { .. })
        ));
    }

    #[test]
    fn holdings_keep_buyers_of_one_unit_apart_and_forget_those_at_zero() {
        let mut h = Holdings::from(&[(1, 1), (2, 3), (3, 0)]);
        assert_eq!((h.get(1), h.get(2), h.get(3), h.len()), (1, 3, 0, 2));
        h.set(1, 2);
        h.set(2, 1);
        assert_eq!(
            (h.get(1), h.get(2), h.one.len(), h.more.len()),
            (2, 1, 1, 1)
        );
        h.set(2, 0);
        h.set(1, -1);
        assert_eq!((h.get(1), h.get(2), h.len()), (0, 0, 0));
        h.set(7, 1);
        h.set(8, 4);
        let mut all: Vec<_> = h.iter().collect();
        all.sort_unstable();
        assert_eq!(all, vec![(7, 1), (8, 4)]);
    }

    #[test]
    fn a_nonce_is_spent_once_and_the_set_forgets_expired_ones() {
        let mut spent = SpentNonces::default();
        let token = |nonce| Spend {
            nonce,
            expires_at: 1_000,
        };
        assert!(spent.spend(1, token(7), 0));
        assert!(!spent.spend(1, token(7), 500));
        assert!(spent.spend(2, token(7), 500), "nonces are per sale");
        for n in 0..5000 {
            assert!(spent.spend(1, token(100 + n), 0));
        }
        let later = 1_000 + 60_000 + 1;
        assert!(spent.spend(1, token(1), later));
        for n in 0..4000 {
            spent.spend(1, token(10_000 + n), later);
        }
        assert!(spent.until.len() < 5000, "expired nonces were swept");
    }
}
