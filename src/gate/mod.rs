//! The gate: the one atomic step that decides a purchase. For each request it checks, in
//! this order, the sale window (and pause), the user's limit, then the stock; on success it
//! takes the stock, records the user and appends the order to the order log, all at once.
//! Implementations: [`memory::MemoryGate`] (embedded) and [`redis::RedisGate`] (Lua).
//! The gate must never touch SQL: it is loaded from SQL by the scheduler, ahead of time.

pub mod batch;
pub mod breaker;
pub mod layer;
pub mod memory;
pub mod rebalance;
pub mod redis;
pub mod reply;
pub mod soldout;
pub mod sql;

use async_trait::async_trait;

use crate::model::Sale;

/// One purchase attempt; the order id is minted by the edge before the gate decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Purchase {
    pub sale_id: i64,
    pub user_id: i64,
    pub quantity: i64,
    pub order_id: i64,
    /// The anti-bot purchase token to spend with this attempt, when the sale asks for one.
    pub token: Option<Spend>,
    /// The sale's segments (see `segments`): the attempt goes to its buyer's segment.
    pub segments: i64,
    /// The same attempt again, after stock was moved into its buyer's empty segment: its
    /// token and its place in the rate limit were spent by the first try.
    pub after_move: bool,
    /// The buyer's `Idempotency-Key` for this purchase, digested (see [`RetryKey`]).
    pub retry_key: Option<RetryKey>,
}

pub use crate::model::RetryKey;

pub use crate::model::RETRY_KEY_MS;

impl Purchase {
    /// The segment that decides this attempt.
    pub fn segment(&self) -> i64 {
        crate::model::segments::segment_of(self.user_id, self.segments)
    }
}

/// A single-use nonce (a purchase token's or a captcha's) and the instant it expires; the
/// gate remembers a spent nonce until then, so no nonce is ever honoured twice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spend {
    pub nonce: u64,
    pub expires_at: i64,
}

impl Spend {
    /// How long the gate must remember it: until expiry, plus a minute of clock skew
    /// between instances.
    pub fn keep_ms(&self, now: i64) -> i64 {
        self.expires_at
            .saturating_sub(now)
            .max(1)
            .saturating_add(60_000)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The order is in the order log; `remaining` is the gate's stock after it.
    Accepted {
        remaining: i64,
    },
    /// The purchase's `Idempotency-Key` already bought this order: nothing was taken now.
    Again {
        order_id: i64,
    },
    Rejected(Rejection),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// The sale is not in the gate (not approved yet, or not preloaded yet).
    NotLoaded,
    NotStarted,
    Ended,
    Paused,
    /// The user already holds their limit.
    AlreadyPurchased,
    /// This quantity would take the user over the limit, though they hold less than it.
    OverLimit {
        held: i64,
    },
    SoldOut {
        remaining: i64,
    },
    /// This user asked too often for this sale; try again after this many milliseconds.
    RateLimited {
        retry_after_ms: i64,
    },
    /// The purchase token was spent by an earlier attempt.
    TokenUsed,
    /// The attempt reached the gate after its deadline: nothing was done.
    Expired,
    /// The purchase's `Idempotency-Key` bought another quantity of this sale.
    RetryKeyReused,
}

/// How long after its order id was minted an attempt may still take effect in a gate in
/// another process. Its caller stops waiting at the same moment (the breaker's time limit)
/// and answers `pending`; the order's fate is settled once this has passed.
pub const ATTEMPT_MS: i64 = 1000;

/// The instant (Unix ms, by the gate's clock) after which an attempt is refused.
pub fn attempt_deadline(order_id: i64) -> i64 {
    crate::ids::IdGenerator::time_of(order_id) + ATTEMPT_MS
}

pub use crate::config::RateLimit;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gcra_lets_a_burst_through_then_the_steady_rate() {
        let rl = RateLimit {
            per_sec: 5.0,
            burst: 3,
        };
        let (mut tat, now) = (0, 10_000);
        for _ in 0..3 {
            tat = rl.check(tat, now).unwrap();
        }
        assert_eq!(
            rl.check(tat, now),
            Err(200),
            "the fourth at once waits one interval"
        );
        assert!(rl.check(tat, now + 200).is_ok(), "then one per 200 ms");
        let off = RateLimit {
            per_sec: 0.0,
            burst: 1,
        };
        assert_eq!(off.interval_ms(), 0);
    }
}

/// Live gate state of a sale, for the stock endpoint and stats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GateStock {
    pub remaining: i64,
    pub paused: bool,
    pub buyers: i64,
    /// Orders the gate has accepted for this sale since it was loaded.
    pub accepted: i64,
    /// Orders (and their units) `remaining` and `buyers` already count that are still on
    /// their way into the order log: decided, not yet durable. Only a gate that decides
    /// before it appends has any (the memory gate; Redis appends in the same script).
    /// Mid-storm they are a steady few dozen that neither the log nor SQL holds yet: an
    /// audit that did not count them would see the same small difference round after round.
    pub appending_orders: i64,
    pub appending_units: i64,
}

/// What the gate needs to open a sale: its terms, its stock and who already holds units.
#[derive(Debug, Clone)]
pub struct SaleLoad {
    pub sale: Sale,
    /// Stock left to sell (from SQL at load time).
    pub remaining: i64,
    /// (user_id, units held in live orders).
    pub buyers: Vec<(i64, i64)>,
    /// Cancelled or expired orders whose units `remaining` already counts: a later
    /// release of one of them must change nothing.
    pub released: Vec<i64>,
    /// The live orders `remaining` and `buyers` count (read with them, in one snapshot): an
    /// order written to SQL after that snapshot is added by [`Gate::confirm_written`].
    pub counted: Vec<i64>,
    /// The segment this load opens (0 for an unsegmented sale); `remaining`, `buyers`,
    /// `released` and `counted` are that segment's.
    pub segment: i64,
    /// Moves of stock between segments that `remaining` already counts, with what each was
    /// for this segment: a later step of the same move must change nothing.
    pub moves: Vec<(i64, MoveMark)>,
}

pub use crate::store::moves::MoveMark;

/// One side of a move between a sale's segments: the units `quantity` of move `move_id`,
/// taken from or given to `segment` of a sale kept in `segments` parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoveLeg {
    pub sale_id: i64,
    pub segments: i64,
    pub segment: i64,
    pub move_id: i64,
    pub quantity: i64,
}

/// The outcome of one step of a move, the same however often the step is repeated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoveStep {
    Done,
    /// The donor had fewer units than the move asked: nothing moved.
    Refused,
    /// The segment is not in the gate; the move waits for its load.
    NotLoaded,
}

/// What the scheduler's check found of one segment of a sale (see `Gate::check_segments`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentCheck {
    /// In the gate, loaded into the server that answers now.
    Loaded,
    /// It had been loaded into another Redis server (a failover, a restart with older
    /// data): forgotten now, to be rebuilt from SQL and its stream.
    Forgotten,
    /// Not in the gate, or not known to be: a load decides.
    Unloaded,
}

/// How a request to rebuild a sale in the gate began.
#[derive(Debug)]
pub enum LoadStart {
    /// The sale is in the gate: there is nothing to do.
    Loaded,
    /// Another loader (maybe in another process) holds the sale's load lock.
    Busy,
    /// This caller holds the lock: read SQL now, then [`Gate::finish_load`].
    Ticket(LoadTicket),
}

/// The right to load one sale, held from before the SQL read until the gate has the sale.
/// A Redis gate renews the lock while the ticket lives and makes the load live only while
/// it holds it: a loader that lost its lock (stalled past the lease) stages into keys of its
/// own that nobody reads, and its install is refused.
#[derive(Debug)]
pub struct LoadTicket {
    pub sale_id: i64,
    /// Increases with each lock taken (restarting when Redis loses its data): marks what
    /// a load installed.
    pub fence: i64,
    /// Unique per lock taken: the lock's value, and the name of the loader's staging keys.
    pub owner: String,
    /// The segment whose lock this is (0 for an unsegmented sale).
    pub segment: i64,
    renewal: Option<tokio::task::AbortHandle>,
    /// The load's buyers went to the gate chunk by chunk while SQL was read
    /// (`Gate::stage_buyers`).
    buyers_staged: std::sync::atomic::AtomicBool,
}

impl LoadTicket {
    /// A ticket of a gate that has no lock to hold (one process owns it).
    pub fn local(sale_id: i64) -> Self {
        LoadTicket {
            sale_id,
            fence: 0,
            owner: String::new(),
            segment: 0,
            renewal: None,
            buyers_staged: Default::default(),
        }
    }

    /// A ticket for a lock taken in another process's sight (Redis).
    pub fn locked(sale_id: i64, segment: i64, fence: i64, owner: String) -> Self {
        LoadTicket {
            sale_id,
            fence,
            owner,
            segment,
            renewal: None,
            buyers_staged: Default::default(),
        }
    }

    /// Stops renewing the lock (it is about to be given back).
    pub fn renewal_stopped(&self) {
        if let Some(r) = &self.renewal {
            r.abort();
        }
    }

    /// Records that the load's buyers were staged ahead of its install.
    pub fn mark_buyers_staged(&self) {
        self.buyers_staged
            .store(true, std::sync::atomic::Ordering::Release);
    }

    pub fn buyers_staged(&self) -> bool {
        self.buyers_staged
            .load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn with_renewal(mut self, renewal: tokio::task::AbortHandle) -> Self {
        self.renewal = Some(renewal);
        self
    }
}

impl Drop for LoadTicket {
    fn drop(&mut self) {
        if let Some(r) = &self.renewal {
            r.abort();
        }
    }
}

/// Units of a cancelled or expired order going back to the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Release {
    pub sale_id: i64,
    pub order_id: i64,
    pub user_id: i64,
    pub quantity: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    Now,
    /// This order was given back before: nothing changed.
    Before,
    /// The sale is not in the gate; its next load reads the returned stock from SQL.
    NotLoaded,
    /// A load of the sale is under way and its SQL snapshot may predate the return: the
    /// return is kept and released again once the sale is in the gate.
    Deferred,
}

#[derive(Debug, thiserror::Error)]
pub enum GateError {
    #[error("redis: {0}")]
    Redis(#[from] ::redis::RedisError),
    #[error("unexpected answer from the gate script: {0}")]
    BadReply(String),
    #[error("database: {0}")]
    Sql(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("the gate did not answer in time")]
    Timeout,
    #[error("the order log refused the order: {0}")]
    Log(#[from] crate::orderlog::LogError),
    /// The Redis cannot give what the configuration asks (a durability level), or may
    /// lose the gate's keys (an evicting memory policy).
    #[error("{0}")]
    Misconfigured(String),
    /// Accepted, but the chosen durability was not confirmed in time: it may be lost.
    #[error("accepted, but not confirmed durable in time")]
    NotDurable,
}

impl GateError {
    /// Whether the purchase may have taken effect though no verdict came back: the call
    /// was sent and its answer lost (a timeout, a connection dropped mid-call, a garbled
    /// reply). Such a buyer is told `pending`, never "no". Refusals before sending (the
    /// circuit is open) and errors Redis answered with did nothing.
    pub fn may_have_taken_effect(&self) -> bool {
        match self {
            GateError::Timeout | GateError::BadReply(_) | GateError::NotDurable => true,
            GateError::Redis(e) => {
                !e.is_connection_refusal()
                    && (e.is_io_error() || e.is_connection_dropped() || e.is_timeout())
            }
            _ => false,
        }
    }

    /// The same failure for each of several waiters on one call (a batch of purchases):
    /// Redis errors keep their kind, which the circuit breaker reads.
    pub fn for_another_waiter(&self) -> GateError {
        match self {
            GateError::Redis(e) => GateError::Redis(e.clone()),
            GateError::BadReply(s) => GateError::BadReply(s.clone()),
            GateError::Sql(s) => GateError::Sql(s.clone()),
            GateError::Unavailable(s) => GateError::Unavailable(s.clone()),
            GateError::Timeout => GateError::Timeout,
            GateError::Log(e) => GateError::Unavailable(e.to_string()),
            GateError::NotDurable => GateError::NotDurable,
            GateError::Misconfigured(s) => GateError::Misconfigured(s.clone()),
        }
    }
}

#[async_trait]
pub trait Gate: Send + Sync {
    /// Decides one purchase atomically. `Accepted` means the order is in the order log.
    async fn purchase(&self, p: Purchase) -> Result<Verdict, GateError>;

    /// Opens a sale in the gate unless it is there already: live stock is never overwritten.
    /// Returns whether this call loaded it. (`begin_load` and `finish_load` in one, for a
    /// load read before the lock: tests and single-process gates.)
    async fn load(&self, load: &SaleLoad) -> Result<bool, GateError>;

    /// Takes the sale's load lock, before its state is read from SQL.
    async fn begin_load(&self, sale_id: i64) -> Result<LoadStart, GateError> {
        Ok(if self.is_loaded(sale_id).await? {
            LoadStart::Loaded
        } else {
            LoadStart::Ticket(LoadTicket::local(sale_id))
        })
    }

    /// Takes the load lock of one segment of a segmented sale (see `segments`); gates
    /// without segments have one part, and load it whole.
    async fn begin_segment_load(&self, sale_id: i64, segment: i64) -> Result<LoadStart, GateError> {
        let _ = segment;
        self.begin_load(sale_id).await
    }

    /// Opens the sale from `load` (read after `begin_load`) and gives the lock back.
    async fn finish_load(&self, ticket: LoadTicket, load: &SaleLoad) -> Result<bool, GateError> {
        drop(ticket);
        self.load(load).await
    }

    /// Takes one chunk of a load's buyers (units held, from SQL) while the rest is still
    /// being read, so that the install does not wait for the whole read: at a million
    /// buyers the read and the gate's work on them each take a second or more. A buyer
    /// with several orders may come several times, with part of its units each time: the
    /// install sets every buyer holding more than one unit to its total. False when this
    /// gate takes its buyers whole at `finish_load` (then call no more).
    async fn stage_buyers(
        &self,
        ticket: &LoadTicket,
        segments: i64,
        buyers: &[(i64, i64)],
    ) -> Result<bool, GateError> {
        let _ = (ticket, segments, buyers);
        Ok(false)
    }

    /// Gives the lock back without loading (the SQL read failed).
    async fn abandon_load(&self, ticket: LoadTicket) {
        drop(ticket);
    }

    /// Forgets the sale if the gate's state may be stale: it was loaded into another Redis
    /// server than the one answering now (a failover, a restart with older data). It is
    /// then rebuilt like a sale Redis lost. True when forgotten.
    async fn forget_if_stale(&self, _sale_id: i64) -> Result<bool, GateError> {
        Ok(false)
    }

    /// Every buyer the gate holds units for, with the units, when it keeps them apart from
    /// SQL and they are at most `cap`; `None` otherwise (not loaded, too many to compare,
    /// or a gate that is SQL itself). For reconciliation, never on the purchase path.
    async fn holders(
        &self,
        sale_id: i64,
        cap: usize,
    ) -> Result<Option<Vec<(i64, i64)>>, GateError> {
        let _ = (sale_id, cap);
        Ok(None)
    }

    /// Forgets one segment of a sale so that the next load rebuilds it from SQL and the
    /// order log (a repair of a gate that drifted from SQL; see `reconcile`). Gates that
    /// keep no state apart from what they can rebuild at once answer `Misconfigured`.
    async fn forget_segment_for_repair(&self, sale_id: i64, segment: i64) -> Result<(), GateError> {
        let _ = (sale_id, segment);
        Err(GateError::Misconfigured(
            "this gate cannot be rebuilt while it runs: the embedded gate lives in the \
             server's memory and is rebuilt from SQL at every start (restart the server)"
                .into(),
        ))
    }

    /// [`Gate::forget_if_stale`] for one segment of a segmented sale.
    async fn forget_segment_if_stale(&self, sale_id: i64, segment: i64) -> Result<bool, GateError> {
        let _ = segment;
        self.forget_if_stale(sale_id).await
    }

    /// Checks many segments, `(sale, segment)`, once a second for the scheduler: forgets
    /// each one whose state is stale, as [`Gate::forget_segment_if_stale`], and says which
    /// are loaded. One answer per segment, in order. A gate on one Redis server checks them
    /// all in one call: a call per sale was most of what a thousand idle sales cost.
    async fn check_segments(&self, parts: &[(i64, i64)]) -> Vec<Result<SegmentCheck, GateError>> {
        let mut checks = Vec::with_capacity(parts.len());
        for (sale_id, segment) in parts {
            checks.push(
                match self.forget_segment_if_stale(*sale_id, *segment).await {
                    Ok(true) => Ok(SegmentCheck::Forgotten),
                    Ok(false) => Ok(SegmentCheck::Unloaded),
                    Err(e) => Err(e),
                },
            );
        }
        checks
    }

    /// Tells the gate how many segments each sale has (from SQL, where it is fixed at
    /// approval), for the calls that name a sale but no buyer (stock, pause, ...).
    fn know_segments(&self, _sales: &[(i64, i64)]) {}

    /// Whether the gate keeps every order it counted by id, and so is loaded with every
    /// order id of the sale and every order SQL took back (Redis: a rebuild meets stream
    /// entries, confirms and stale returns of orders SQL already holds). A gate rebuilt only
    /// when its process starts (memory) needs only the buyers and the returns still owed:
    /// no release of an order returned before it started can reach it.
    fn keeps_order_ids(&self) -> bool {
        true
    }

    /// Lets go of sales that ended before `before` (Unix ms): an ended sale sells nothing
    /// and its late returns are SQL's alone (`Released::NotLoaded`). Gates whose state
    /// expires by itself (Redis) keep nothing to let go of.
    fn forget_ended(&self, _before: i64) {}

    /// Each segment's stock, `None` for a segment not in the gate. Only gates that keep
    /// segments apart (Redis) have more than one.
    async fn segment_stocks(
        &self,
        sale_id: i64,
        _segments: i64,
    ) -> Result<Vec<Option<i64>>, GateError> {
        Ok(vec![self.stock(sale_id).await?.map(|s| s.remaining)])
    }

    /// Takes the leg's units out of its segment, once: a repeat answers what the first did.
    async fn take_for_move(&self, _leg: MoveLeg) -> Result<MoveStep, GateError> {
        Err(GateError::Unavailable("this gate keeps no segments".into()))
    }

    /// Gives the leg's units to its segment, once.
    async fn give_for_move(&self, _leg: MoveLeg) -> Result<MoveStep, GateError> {
        Err(GateError::Unavailable("this gate keeps no segments".into()))
    }

    /// These orders are in SQL now. A gate rebuilt from a SQL snapshot taken before their
    /// commit does not count them yet: it takes their units and records their buyers now,
    /// exactly once per order.
    async fn confirm_written(&self, _orders: &[crate::model::NewOrder]) -> Result<(), GateError> {
        Ok(())
    }

    /// Takes in the purchases made with an `Idempotency-Key` that SQL holds, for a gate
    /// whose own records end with its process (the memory gate): called at start-up, once
    /// the order log's orders are in SQL. How many it took.
    async fn restore_retries(&self, _kept: &[crate::model::KeptPurchase]) -> usize {
        0
    }

    async fn is_loaded(&self, sale_id: i64) -> Result<bool, GateError>;

    /// [`Gate::is_loaded`] of many sales, one answer each, in order: what a readiness
    /// probe asks of every open sale, in one call where the gate can.
    async fn are_loaded(&self, sale_ids: &[i64]) -> Vec<Result<bool, GateError>> {
        let mut loaded = Vec::with_capacity(sale_ids.len());
        for sale_id in sale_ids {
            loaded.push(self.is_loaded(*sale_id).await);
        }
        loaded
    }

    /// None when the sale is not in the gate.
    async fn stock(&self, sale_id: i64) -> Result<Option<GateStock>, GateError>;

    /// [`Gate::stock`] of many sales, one answer each, in order: what the audit reads of
    /// every live sale each round, in one call where the gate can.
    async fn stocks(&self, sale_ids: &[i64]) -> Vec<Result<Option<GateStock>, GateError>> {
        let mut stocks = Vec::with_capacity(sale_ids.len());
        for sale_id in sale_ids {
            stocks.push(self.stock(*sale_id).await);
        }
        stocks
    }

    /// Gives an order's units back and frees its buyer's slot, exactly once per order.
    async fn release(&self, r: Release) -> Result<Released, GateError>;

    /// Stops or restarts purchases of a loaded sale (kill switch).
    async fn set_paused(&self, sale_id: i64, paused: bool) -> Result<(), GateError>;

    /// Moves a loaded sale's end to `at` (Unix ms) when that is earlier: ending it early.
    /// Never extends a sale.
    async fn end_early(&self, sale_id: i64, at: i64) -> Result<(), GateError>;

    /// Spends a single-use nonce of a sale (a captcha's); false when it was spent before.
    async fn spend(&self, sale_id: i64, spend: Spend) -> Result<bool, GateError>;

    /// (user, quantity) of an order the gate accepted but SQL may not hold yet (`queued`).
    async fn queued_order(
        &self,
        sale_id: i64,
        order_id: i64,
    ) -> Result<Option<(i64, i64)>, GateError>;
}
