//! A circuit breaker around a gate that lives in another process (Redis): after repeated
//! connection failures it opens and answers `unavailable` at once, instead of letting every
//! request wait out a dead Redis; while open it lets one trial call through now and then,
//! after the cooldown every call, and it closes on the first success. Never decides a
//! purchase itself, so it cannot oversell.

use crate::metrics::render_counter;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;

use super::layer::Layer;

use super::{
    Gate, GateError, GateStock, Purchase, Release, Released, SaleLoad, SegmentCheck, Verdict,
};

pub struct Breaker {
    inner: Arc<dyn Gate>,
    threshold: u32,
    cooldown_ms: i64,
    /// How often an open circuit lets a trial call through.
    trial_every_ms: i64,
    /// How long one call for many items may take (`BATCH_TIMEOUT`).
    batch_timeout: Duration,
    circuits: Circuits,
    /// Times a circuit opened, for `/metrics`.
    pub opened: AtomicU64,
    /// Calls refused while open.
    pub refused: AtomicU64,
}

/// One circuit for a standalone Redis; one per sale in a cluster, where a sale lives on one
/// master and a dead master must not turn away the buyers of sales on the others.
enum Circuits {
    One(Circuit),
    PerSale(RwLock<HashMap<i64, Arc<Circuit>>>),
}

#[derive(Default)]
struct Circuit {
    failures: AtomicU32,
    open_until: AtomicI64,
    /// While open, when the last trial call was let through.
    tried_at: AtomicI64,
    /// A trial call is under way: one at a time, so that a Redis that swallows calls
    /// holds one caller, not one per interval.
    trying: AtomicBool,
    /// Whether the last state logged is "open": one line per change, not per reopening.
    logged_open: AtomicBool,
}

impl Circuit {
    fn is_open(&self) -> bool {
        crate::clock::wall_ms() < self.open_until.load(Ordering::Acquire)
    }

    /// Whether the caller may make the open circuit's next trial call: one every
    /// `every_ms`, none while one is under way (the caller ends it with `end_trial`). A
    /// Redis that blocked for a second (a FLUSHALL of a million keys, a fork) then serves
    /// again within that, not a whole cooldown after it answers.
    fn take_trial(&self, now: i64, every_ms: i64) -> bool {
        let last = self.tried_at.load(Ordering::Acquire);
        if now - last < every_ms
            || self
                .trying
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
        {
            return false;
        }
        if self
            .tried_at
            .compare_exchange(last, now, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            self.trying.store(false, Ordering::Release);
            return false;
        }
        true
    }

    fn end_trial(&self) {
        self.trying.store(false, Ordering::Release);
    }
}

/// How often an open circuit lets a trial call through. A trial that finds Redis dead
/// costs a refused connection, or one call waiting out its time limit.
const TRIAL_EVERY_MS: i64 = 100;

impl Breaker {
    /// Its series in Prometheus text.
    pub fn render(&self, out: &mut String) {
        render_counter(
            "seckill_gate_circuit_opened_total",
            "Times the Redis gate's circuit opened.",
            self.opened.load(Ordering::Relaxed),
            out,
        );
        render_counter(
            "seckill_gate_circuit_refused_total",
            "Gate calls refused while the circuit was open.",
            self.refused.load(Ordering::Relaxed),
            out,
        );
    }

    pub fn new(inner: Arc<dyn Gate>, threshold: u32, cooldown_ms: i64) -> Self {
        Breaker {
            inner,
            threshold: threshold.max(1),
            cooldown_ms,
            trial_every_ms: TRIAL_EVERY_MS,
            batch_timeout: BATCH_TIMEOUT,
            circuits: Circuits::One(Circuit::default()),
            opened: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    /// A circuit per sale (for a Redis Cluster).
    pub fn per_sale(mut self) -> Self {
        self.circuits = Circuits::PerSale(RwLock::new(HashMap::new()));
        self
    }

    /// Whether a circuit is open (in a cluster: any sale's).
    pub fn is_open(&self) -> bool {
        match &self.circuits {
            Circuits::One(c) => c.is_open(),
            Circuits::PerSale(map) => map
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .any(|c| c.is_open()),
        }
    }

    /// Runs `f` on the circuit of `sale_id`.
    fn with_circuit<R>(&self, sale_id: i64, f: impl FnOnce(&Circuit) -> R) -> R {
        match &self.circuits {
            Circuits::One(c) => f(c),
            Circuits::PerSale(map) => {
                let found = map
                    .read()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&sale_id)
                    .cloned();
                let circuit = match found {
                    Some(c) => c,
                    None => map
                        .write()
                        .unwrap_or_else(|p| p.into_inner())
                        .entry(sale_id)
                        .or_default()
                        .clone(),
                };
                f(&circuit)
            }
        }
    }

    /// Refuses a call while the circuit is open, unless it is the circuit's next trial:
    /// `Ok(true)` for a trial, `Ok(false)` for a call of a closed circuit.
    fn guard(&self, circuit: &Circuit) -> Result<bool, GateError> {
        if circuit.is_open() {
            if circuit.take_trial(crate::clock::wall_ms(), self.trial_every_ms) {
                return Ok(true);
            }
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(GateError::Unavailable(
                "the gate's Redis is failing; the circuit is open".into(),
            ));
        }
        Ok(false)
    }

    fn record<T>(
        &self,
        circuit: &Circuit,
        sale_id: i64,
        result: Result<T, GateError>,
    ) -> Result<T, GateError> {
        match &result {
            Ok(_) => {
                circuit.failures.store(0, Ordering::Release);
                // Redis answers: closed at once (a trial's success, or a call's that began
                // before the circuit opened).
                if circuit.open_until.load(Ordering::Acquire) != 0 {
                    circuit.open_until.store(0, Ordering::Release);
                }
                if circuit.logged_open.load(Ordering::Relaxed)
                    && circuit.logged_open.swap(false, Ordering::AcqRel)
                {
                    tracing::info!(
                        sale = self.sale_label(sale_id),
                        "gate circuit closed: the gate's Redis answers again"
                    );
                }
            }
            Err(GateError::Redis(e)) if is_outage(e) => self.failed(circuit, sale_id),
            Err(GateError::Timeout) => self.failed(circuit, sale_id),
            Err(_) => {}
        }
        result
    }

    /// The sale a circuit belongs to, for logs: `None` when one circuit serves all.
    fn sale_label(&self, sale_id: i64) -> Option<i64> {
        matches!(self.circuits, Circuits::PerSale(_)).then_some(sale_id)
    }

    fn failed(&self, circuit: &Circuit, sale_id: i64) {
        let failures = circuit.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if failures >= self.threshold {
            circuit.failures.store(0, Ordering::Release);
            let now = crate::clock::wall_ms();
            circuit.tried_at.store(now, Ordering::Release);
            circuit
                .open_until
                .store(now + self.cooldown_ms, Ordering::Release);
            self.opened.fetch_add(1, Ordering::Relaxed);
            if !circuit.logged_open.swap(true, Ordering::AcqRel) {
                tracing::error!(
                    sale = self.sale_label(sale_id),
                    failures,
                    cooldown_ms = self.cooldown_ms,
                    "gate circuit opened: the gate's Redis is failing; purchases answer 503 until it answers"
                );
            }
        }
    }

    /// One gate call for a sale, refused at once while its circuit is open, and bounded in
    /// time: a connection that is reconnecting holds calls back rather than failing them,
    /// so a dead Redis would otherwise hang every purchase instead of opening the circuit.
    async fn call<T>(
        &self,
        sale_id: i64,
        call: impl std::future::Future<Output = Result<T, GateError>>,
        limit: Duration,
    ) -> Result<T, GateError> {
        let trial = self.with_circuit(sale_id, |c| self.guard(c))?;
        let result = match tokio::time::timeout(limit, call).await {
            Ok(result) => result,
            Err(_) => Err(GateError::Timeout),
        };
        self.with_circuit(sale_id, |c| {
            if trial {
                c.end_trial();
            }
            self.record(c, sale_id, result)
        })
    }
}

impl Breaker {
    /// One call that answers many items at once (the scheduler's and the audit's reads of
    /// every sale), bounded by `BATCH_TIMEOUT`. With one circuit: a call of the first
    /// item's sale, refused while the circuit is open, and a failure for the circuit when
    /// every item failed. With a circuit per sale (a cluster): the items whose circuit lets
    /// a call through go in the one call, and each answer counts for its own sale's
    /// circuit, so that a dead master opens the circuits of its own sales only.
    async fn call_many<I, T, F, Fut>(
        &self,
        items: &[I],
        sale_of: fn(&I) -> i64,
        call: F,
    ) -> Vec<Result<T, GateError>>
    where
        I: Clone,
        F: Fn(Vec<I>) -> Fut,
        Fut: std::future::Future<Output = Vec<Result<T, GateError>>>,
    {
        let Some(first) = items.first() else {
            return Vec::new();
        };
        if let Circuits::PerSale(_) = &self.circuits {
            // A master away fails its own sales' items with errors that count for them.
            let guards = self.guard_each(items, sale_of);
            let let_through: Vec<I> = items
                .iter()
                .zip(&guards)
                .filter(|(_, guard)| guard.is_ok())
                .map(|(item, _)| item.clone())
                .collect();
            let answers = match let_through.is_empty() {
                true => Some(Vec::new()),
                false => tokio::time::timeout(self.batch_timeout, call(let_through))
                    .await
                    .ok(),
            };
            return self.record_each(items, sale_of, guards, answers);
        }
        let all = async {
            let answers = call(items.to_vec()).await;
            match answers.iter().find_map(|a| a.as_ref().err()) {
                Some(e) if answers.iter().all(|a| a.is_err()) => Err(e.for_another_waiter()),
                _ => Ok(answers),
            }
        };
        match self.call(sale_of(first), all, self.batch_timeout).await {
            Ok(answers) => answers,
            Err(e) => items.iter().map(|_| Err(e.for_another_waiter())).collect(),
        }
    }

    /// Each item's circuit asked whether a call may go (`Ok(true)`: as its trial).
    fn guard_each<I>(&self, items: &[I], sale_of: fn(&I) -> i64) -> Vec<Result<bool, GateError>> {
        items
            .iter()
            .map(|item| self.with_circuit(sale_of(item), |c| self.guard(c)))
            .collect()
    }

    /// The answers of the items `guards` let through (`None`: the call ran out of time as a
    /// whole, which says nothing of any one sale: its items fail, but no circuit counts
    /// it), each counted for its own sale's circuit; the others refused.
    fn record_each<I, T>(
        &self,
        items: &[I],
        sale_of: fn(&I) -> i64,
        guards: Vec<Result<bool, GateError>>,
        answers: Option<Vec<Result<T, GateError>>>,
    ) -> Vec<Result<T, GateError>> {
        let mut answers = answers.map(Vec::into_iter);
        items
            .iter()
            .zip(guards)
            .map(|(item, guard)| {
                let trial = guard?;
                let sale_id = sale_of(item);
                self.with_circuit(sale_id, |c| {
                    if trial {
                        c.end_trial();
                    }
                    match answers.as_mut() {
                        Some(answers) => {
                            let answer = answers.next().unwrap_or_else(|| {
                                Err(GateError::BadReply("no answer for the item".into()))
                            });
                            self.record(c, sale_id, answer)
                        }
                        None => Err(GateError::Timeout),
                    }
                })
            })
            .collect()
    }
}

/// A purchase script answers in well under a millisecond; a second means Redis is away.
const CALL_TIMEOUT: Duration = Duration::from_secs(1);
/// One call for thousands of sales takes a few milliseconds of Redis.
const BATCH_TIMEOUT: Duration = Duration::from_secs(5);
/// Loading a sale may move many buyers in chunks.
const LOAD_TIMEOUT: Duration = Duration::from_secs(30);

/// Errors that say Redis cannot be reached (rather than that it answered with an error):
/// refused or dropped connections, timeouts, a connection manager still reconnecting.
fn is_outage(e: &redis::RedisError) -> bool {
    !matches!(
        e.kind(),
        redis::ErrorKind::Server(_)
            | redis::ErrorKind::Parse
            | redis::ErrorKind::UnexpectedReturnType
    )
}

#[async_trait]
impl Layer for Breaker {
    fn inner(&self) -> &dyn Gate {
        self.inner.as_ref()
    }

    async fn purchase(&self, p: Purchase) -> Result<Verdict, GateError> {
        self.call(p.sale_id, self.inner.purchase(p), CALL_TIMEOUT)
            .await
    }

    async fn load(&self, load: &SaleLoad) -> Result<bool, GateError> {
        self.call(load.sale.id, self.inner.load(load), LOAD_TIMEOUT)
            .await
    }

    async fn is_loaded(&self, sale_id: i64) -> Result<bool, GateError> {
        self.call(sale_id, self.inner.is_loaded(sale_id), CALL_TIMEOUT)
            .await
    }

    async fn are_loaded(&self, sale_ids: &[i64]) -> Vec<Result<bool, GateError>> {
        self.call_many(
            sale_ids,
            |sale_id| *sale_id,
            |ids| async move { self.inner.are_loaded(&ids).await },
        )
        .await
    }

    async fn begin_load(&self, sale_id: i64) -> Result<super::LoadStart, GateError> {
        self.call(sale_id, self.inner.begin_load(sale_id), CALL_TIMEOUT)
            .await
    }

    async fn stage_buyers(
        &self,
        ticket: &super::LoadTicket,
        segments: i64,
        buyers: &[(i64, i64)],
    ) -> Result<bool, GateError> {
        let stage = self.inner.stage_buyers(ticket, segments, buyers);
        self.call(ticket.sale_id, stage, LOAD_TIMEOUT).await
    }

    async fn finish_load(
        &self,
        ticket: super::LoadTicket,
        load: &SaleLoad,
    ) -> Result<bool, GateError> {
        self.call(
            load.sale.id,
            self.inner.finish_load(ticket, load),
            LOAD_TIMEOUT,
        )
        .await
    }

    async fn forget_if_stale(&self, sale_id: i64) -> Result<bool, GateError> {
        self.call(sale_id, self.inner.forget_if_stale(sale_id), CALL_TIMEOUT)
            .await
    }

    async fn begin_segment_load(
        &self,
        sale_id: i64,
        segment: i64,
    ) -> Result<super::LoadStart, GateError> {
        self.call(
            sale_id,
            self.inner.begin_segment_load(sale_id, segment),
            CALL_TIMEOUT,
        )
        .await
    }

    async fn holders(
        &self,
        sale_id: i64,
        cap: usize,
    ) -> Result<Option<Vec<(i64, i64)>>, GateError> {
        self.call(sale_id, self.inner.holders(sale_id, cap), CALL_TIMEOUT)
            .await
    }

    async fn forget_segment_for_repair(&self, sale_id: i64, segment: i64) -> Result<(), GateError> {
        self.call(
            sale_id,
            self.inner.forget_segment_for_repair(sale_id, segment),
            CALL_TIMEOUT,
        )
        .await
    }

    async fn forget_segment_if_stale(&self, sale_id: i64, segment: i64) -> Result<bool, GateError> {
        self.call(
            sale_id,
            self.inner.forget_segment_if_stale(sale_id, segment),
            CALL_TIMEOUT,
        )
        .await
    }

    async fn check_segments(&self, parts: &[(i64, i64)]) -> Vec<Result<SegmentCheck, GateError>> {
        self.call_many(
            parts,
            |(sale_id, _)| *sale_id,
            |parts| async move { self.inner.check_segments(&parts).await },
        )
        .await
    }

    async fn segment_stocks(
        &self,
        sale_id: i64,
        segments: i64,
    ) -> Result<Vec<Option<i64>>, GateError> {
        self.call(
            sale_id,
            self.inner.segment_stocks(sale_id, segments),
            CALL_TIMEOUT,
        )
        .await
    }

    async fn take_for_move(&self, leg: super::MoveLeg) -> Result<super::MoveStep, GateError> {
        let take = self.inner.take_for_move(leg);
        self.call(leg.sale_id, take, CALL_TIMEOUT).await
    }

    async fn give_for_move(&self, leg: super::MoveLeg) -> Result<super::MoveStep, GateError> {
        let give = self.inner.give_for_move(leg);
        self.call(leg.sale_id, give, CALL_TIMEOUT).await
    }

    async fn abandon_load(&self, ticket: super::LoadTicket) {
        let _ = tokio::time::timeout(CALL_TIMEOUT, self.inner.abandon_load(ticket)).await;
    }

    async fn confirm_written(&self, orders: &[crate::model::NewOrder]) -> Result<(), GateError> {
        // Not through the circuit: the writer retries this itself, and its failures must
        // not turn purchases away.
        match tokio::time::timeout(CALL_TIMEOUT, self.inner.confirm_written(orders)).await {
            Ok(result) => result,
            Err(_) => Err(GateError::Timeout),
        }
    }

    async fn stock(&self, sale_id: i64) -> Result<Option<GateStock>, GateError> {
        self.call(sale_id, self.inner.stock(sale_id), CALL_TIMEOUT)
            .await
    }

    async fn stocks(&self, sale_ids: &[i64]) -> Vec<Result<Option<GateStock>, GateError>> {
        self.call_many(
            sale_ids,
            |sale_id| *sale_id,
            |ids| async move { self.inner.stocks(&ids).await },
        )
        .await
    }

    async fn release(&self, r: Release) -> Result<Released, GateError> {
        self.call(r.sale_id, self.inner.release(r), CALL_TIMEOUT)
            .await
    }

    async fn end_early(&self, sale_id: i64, at: i64) -> Result<(), GateError> {
        self.call(sale_id, self.inner.end_early(sale_id, at), CALL_TIMEOUT)
            .await
    }

    async fn set_paused(&self, sale_id: i64, paused: bool) -> Result<(), GateError> {
        self.call(
            sale_id,
            self.inner.set_paused(sale_id, paused),
            CALL_TIMEOUT,
        )
        .await
    }

    async fn spend(&self, sale_id: i64, spend: super::Spend) -> Result<bool, GateError> {
        self.call(sale_id, self.inner.spend(sale_id, spend), CALL_TIMEOUT)
            .await
    }

    async fn queued_order(
        &self,
        sale_id: i64,
        order_id: i64,
    ) -> Result<Option<(i64, i64)>, GateError> {
        self.call(
            sale_id,
            self.inner.queued_order(sale_id, order_id),
            CALL_TIMEOUT,
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Trials a second apart: the refusals right after opening are over long before the
    /// first trial is due, even on a busy machine.
    const EVERY: Duration = Duration::from_millis(1000);

    /// Opens after two failures, for a minute: only trials get through meanwhile.
    fn breaker() -> Breaker {
        let (log, _reader) = crate::orderlog::local::channel();
        let inner = Arc::new(crate::gate::memory::MemoryGate::new(log));
        let mut breaker = Breaker::new(inner, 2, 60_000);
        breaker.trial_every_ms = EVERY.as_millis() as i64;
        breaker
    }

    /// One call through the breaker, answered `ok` or not; counts the calls that reached Redis.
    async fn call(b: &Breaker, redis_up: bool, reached: &AtomicUsize) -> Result<(), GateError> {
        let redis = async {
            reached.fetch_add(1, Ordering::Relaxed);
            if redis_up {
                Ok(())
            } else {
                Err(GateError::Timeout)
            }
        };
        b.call(1, redis, CALL_TIMEOUT).await
    }

    #[tokio::test]
    async fn an_open_circuit_lets_a_trial_through_now_and_then_and_closes_on_its_success() {
        let (b, reached) = (breaker(), AtomicUsize::new(0));
        for _ in 0..2 {
            assert!(call(&b, false, &reached).await.is_err());
        }
        assert!(b.is_open());
        // Right after opening: refused without a call to Redis, up or not.
        for _ in 0..50 {
            let refused = call(&b, true, &reached).await;
            assert!(
                matches!(refused, Err(GateError::Unavailable(_))),
                "{refused:?}"
            );
        }
        assert_eq!(reached.load(Ordering::Relaxed), 2);

        // A trial that finds Redis still away leaves the circuit open.
        tokio::time::sleep(EVERY + Duration::from_millis(50)).await;
        assert!(matches!(
            call(&b, false, &reached).await,
            Err(GateError::Timeout)
        ));
        assert!(matches!(
            call(&b, true, &reached).await,
            Err(GateError::Unavailable(_))
        ));
        assert_eq!(reached.load(Ordering::Relaxed), 3, "one trial per interval");
        assert!(b.is_open());

        // The next trial finds it back: closed at once, long before the cooldown's end.
        tokio::time::sleep(EVERY + Duration::from_millis(50)).await;
        assert!(call(&b, true, &reached).await.is_ok());
        assert!(!b.is_open());
        assert!(call(&b, true, &reached).await.is_ok());
        assert_eq!(reached.load(Ordering::Relaxed), 5);
    }

    #[tokio::test]
    async fn an_open_circuit_has_one_trial_under_way_at_most() {
        let mut b = breaker();
        b.trial_every_ms = 20;
        let (b, reached) = (Arc::new(b), Arc::new(AtomicUsize::new(0)));
        for _ in 0..2 {
            assert!(call(&b, false, &reached).await.is_err());
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
        // A trial that Redis does not answer yet.
        let answer = Arc::new(tokio::sync::Notify::new());
        let trial = tokio::spawn({
            let (b, reached, answer) = (b.clone(), reached.clone(), answer.clone());
            async move {
                let redis = async {
                    reached.fetch_add(1, Ordering::Relaxed);
                    answer.notified().await;
                    Ok(())
                };
                b.call(1, redis, CALL_TIMEOUT).await
            }
        });
        while reached.load(Ordering::Relaxed) < 3 {
            tokio::task::yield_now().await;
        }
        // Intervals pass; the trial is still under way: no second one.
        tokio::time::sleep(Duration::from_millis(100)).await;
        for _ in 0..5 {
            assert!(matches!(
                call(&b, true, &reached).await,
                Err(GateError::Unavailable(_))
            ));
        }
        assert_eq!(reached.load(Ordering::Relaxed), 3);
        answer.notify_one();
        assert!(trial.await.unwrap().is_ok());
        assert!(!b.is_open(), "the trial's answer closed the circuit");
        assert!(call(&b, true, &reached).await.is_ok());
    }

    /// A circuit per sale, items asked in one call: a sale whose items fail (its master is
    /// away) opens its own circuit only; while open, its items are refused and the others
    /// still asked; a call that runs out of time as a whole opens no circuit.
    #[tokio::test]
    async fn one_call_for_many_sales_counts_each_answer_for_its_own_sale() {
        let mut b = breaker().per_sale();
        b.batch_timeout = Duration::from_millis(50);
        let asked = std::sync::Mutex::new(Vec::new());
        let answer = |failing: i64| {
            let asked = &asked;
            move |sales: Vec<i64>| async move {
                asked.lock().unwrap().push(sales.clone());
                sales
                    .iter()
                    .map(|s| match *s == failing {
                        true => Err(GateError::Timeout),
                        false => Ok(*s),
                    })
                    .collect::<Vec<_>>()
            }
        };
        for _ in 0..2 {
            let answers = b.call_many(&[1, 2, 3], |s| *s, answer(2)).await;
            assert!(answers[0].is_ok() && answers[1].is_err() && answers[2].is_ok());
        }
        let refused = b.call_many(&[1, 2, 3], |s| *s, answer(0)).await;
        assert!(
            matches!(refused[1], Err(GateError::Unavailable(_))),
            "{refused:?}"
        );
        assert_eq!(refused[0].as_ref().ok(), Some(&1));
        assert_eq!(refused[2].as_ref().ok(), Some(&3));
        assert_eq!(asked.lock().unwrap().last(), Some(&vec![1, 3]));

        let slow = |sales: Vec<i64>| async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            sales.into_iter().map(Ok).collect::<Vec<_>>()
        };
        for _ in 0..3 {
            let answers = b.call_many(&[1, 3], |s| *s, slow).await;
            assert!(answers.iter().all(|a| matches!(a, Err(GateError::Timeout))));
        }
        let answers = b.call_many(&[1, 3], |s| *s, answer(0)).await;
        assert!(
            answers.iter().all(|a| a.is_ok()),
            "no circuit opened: {answers:?}"
        );
    }
}
