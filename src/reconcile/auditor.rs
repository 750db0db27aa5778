//! The continuous audit: every few seconds, one instance at a time (a lease in Redis when
//! there is one), each live sale's account; a difference that stays the same over
//! `CONFIRM_ROUNDS` audits is drift, logged once, kept on the board for `/metrics` and
//! the admin stats until it clears. Confirmed drift of the gate (stock or buyers) is
//! repaired at once by the same fenced rebuild an operator would ask for (`--audit-repair
//! false` only reports it); a sale that drifts again and again (`PAUSE_AFTER_REPAIRS` in
//! `REPAIR_WINDOW_MS`), or whose gate cannot be rebuilt while it runs, is paused instead,
//! with an alert: a fault that repairs do not cure needs a person. Journal drift is SQL's
//! own and only reported. It never changes SQL's orders or stock.
//!
//! A round reads SQL's figures from the counters on each sale's row (a few rows per sale,
//! whatever it holds). A difference the counters show the same rounds running is recounted
//! from every row, buyers compared one by one, in the round that would confirm it, if the
//! counters still show it then. Beside the rounds, a slow sweep recounts one live sale after
//! another at `SWEEP`'s pace: the check of the counters themselves (a recount corrects them)
//! and of buyers a count alone cannot tell apart; a sale it finds different is handed to the
//! rounds, which follow it with recounts.

use crate::metrics::render_counter;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::watch;

use super::{account_with, Account, Depth, ReconcileError};
use crate::gate::Gate;
use crate::loader::SaleCache;
use crate::model::Sale;
use crate::redis_client::RedisConn;
use crate::store::{Pace, Store};
use crate::writer::WriterStats;

/// A sale's id and its number of segments.
type SaleSegments = (i64, i64);

/// Audits in a row that must find the same difference before it is called drift.
pub const CONFIRM_ROUNDS: u32 = 3;

/// The slow sweep's pace: a hundredth of its time reading, about 1% of a core whatever the
/// sales hold (a 1M-order sale is swept in a quarter of an hour on the 2-core box). Its
/// snapshot is held that long only while nothing is written: a snapshot kept open under
/// writes holds SQLite's WAL, PostgreSQL's vacuum and InnoDB's purge back, so the first
/// order written abandons it.
const SWEEP: Pace = Pace {
    chunk: 5_000,
    share: 0.01,
};

/// Sales audited: open, or ended less than this long ago (late returns still settle).
const AFTER_END_MS: i64 = 60_000;
/// A sale whose SQL figures have not moved for this long, that did not open or end
/// within it, and in which no difference is followed, is quiet: audited one round in
/// `QUIET_EVERY`, in turn by id. A thousand quiet open sales cost a round a hundred
/// sales' reads, not a thousand; what changes in a quiet sale without moving SQL (its gate
/// lost, a hand on Redis) is seen within `QUIET_EVERY` rounds, and followed each round
/// from then on.
const QUIET_AFTER_MS: i64 = 60_000;
const QUIET_EVERY: u64 = 10;
/// Repairs of one sale within `REPAIR_WINDOW_MS` after which its next drift pauses it.
pub const PAUSE_AFTER_REPAIRS: usize = 3;
pub const REPAIR_WINDOW_MS: i64 = 600_000;

/// Drift found and not cleared, per sale; what `/metrics` and the stats show.
#[derive(Default)]
pub struct Board {
    drift: Mutex<BTreeMap<i64, Finding>>,
    pub audits: AtomicU64,
    /// Whether this instance holds the audit lease (the others' boards stay empty).
    pub auditing: AtomicBool,
    /// Repairs this instance's audit made by itself.
    pub repairs: AtomicU64,
    /// Sales this instance's audit paused because repairs did not hold, with why.
    paused: Mutex<BTreeMap<i64, String>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    pub account: Account,
    /// When the difference was first seen (Unix ms).
    pub since_ms: i64,
}

impl Board {
    /// Its series in Prometheus text: audits, repairs, paused sales, confirmed drift.
    pub fn render(&self, out: &mut String) {
        render_counter(
            "seckill_reconcile_audits_total",
            "Rounds of the continuous audit of gate against SQL run by this instance.",
            self.audits.load(Ordering::Relaxed),
            out,
        );
        out.push_str(&format!(
            "# HELP seckill_reconcile_auditing Whether this instance holds the audit lease.\n# TYPE seckill_reconcile_auditing gauge\nseckill_reconcile_auditing {}\n",
            self.auditing.load(Ordering::Relaxed) as u8
        ));
        render_counter(
            "seckill_reconcile_repairs_total",
            "Gates this instance's audit rebuilt from SQL by itself, after confirming drift.",
            self.repairs.load(Ordering::Relaxed),
            out,
        );
        let paused = self.paused();
        if !paused.is_empty() {
            out.push_str("# HELP seckill_reconcile_paused Sales this instance's audit paused because their gate kept drifting from SQL: alert on any.\n# TYPE seckill_reconcile_paused gauge\n");
            for sale in paused.keys() {
                out.push_str(&format!("seckill_reconcile_paused{{sale=\"{sale}\"}} 1\n"));
            }
        }
        let drift = self.drift();
        if !drift.is_empty() {
            out.push_str("# HELP seckill_reconcile_drift Confirmed differences between a sale's gate and SQL plus what is in flight, by kind (stock units; buyers missing from or unknown to SQL; journal minus stock).\n# TYPE seckill_reconcile_drift gauge\n");
            for (sale, f) in &drift {
                let a = &f.account;
                for (kind, v) in [
                    ("stock", a.stock_drift),
                    ("buyers_missing", a.buyers_missing),
                    ("buyers_unknown", a.buyers_unknown),
                    ("journal", a.journal_drift),
                ] {
                    out.push_str(&format!(
                        "seckill_reconcile_drift{{sale=\"{sale}\",kind=\"{kind}\"}} {v}\n"
                    ));
                }
            }
        }
    }

    pub fn drift(&self) -> BTreeMap<i64, Finding> {
        lock(&self.drift).clone()
    }

    pub fn finding(&self, sale: i64) -> Option<Finding> {
        lock(&self.drift).get(&sale).cloned()
    }

    /// Sales the audit paused, and why.
    pub fn paused(&self) -> BTreeMap<i64, String> {
        lock(&self.paused).clone()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The lease that makes one auditor at a time among the instances sharing a Redis.
pub struct Lease {
    pub conn: RedisConn,
    pub key: String,
    pub token: String,
}

impl Lease {
    /// Takes the lease, or keeps it; false while another instance holds it.
    async fn hold(&self, ttl: Duration) -> Result<bool, redis::RedisError> {
        let mut conn = self.conn.clone();
        let ms = ttl.as_millis() as u64;
        let taken: Option<String> = redis::cmd("SET")
            .arg(&self.key)
            .arg(&self.token)
            .arg("NX")
            .arg("PX")
            .arg(ms)
            .query_async(&mut conn)
            .await?;
        if taken.is_some() {
            return Ok(true);
        }
        let renewed: i64 = redis::Script::new(crate::redis_client::lease::RENEW_LUA)
            .key(&self.key)
            .arg(&self.token)
            .arg(ms)
            .invoke_async(&mut conn)
            .await?;
        Ok(renewed == 1)
    }
}

pub struct Auditor {
    pub store: Store,
    pub gate: Arc<dyn Gate>,
    pub backlog: std::sync::Arc<dyn crate::orderlog::Backlog>,
    pub cache: Arc<SaleCache>,
    pub board: Arc<Board>,
    /// This instance's writer: orders written mean the database is busy (see `SWEEP`).
    pub written: Arc<WriterStats>,
    pub every: Duration,
    pub lease: Option<Lease>,
    /// Repair confirmed drift of the gate by itself (else only report it).
    pub repair: bool,
    /// When each sale was last repaired by the audit (Unix ms), and whether a repair of it
    /// is under way.
    pub repairs: Arc<Mutex<HashMap<i64, RepairLog>>>,
    /// Whether the failover window is being written again for a gate found ahead of SQL.
    pub filling: Arc<AtomicBool>,
}

/// The audit's repairs of one sale.
#[derive(Default)]
pub struct RepairLog {
    at: Vec<i64>,
    running: bool,
}

/// A difference seen in consecutive audits.
struct Streak {
    differences: (i64, i64, i64, i64),
    rounds: u32,
    since_ms: i64,
    /// Seen by a recount (buyers compared one by one), not by the counters: followed by
    /// recounts, since the counters may not show it at all (a buyer swapped for another).
    recounted: bool,
}

impl Streak {
    /// Whether this round's counters call for the confirming recount: the round would
    /// confirm the difference, and the counters show it again, the same. Mid-storm the
    /// counters differ now and then by what moved between the reads of the gate, the log
    /// and SQL, and recounting a million rows each time would cost more than the storm. A
    /// storm's last rounds can even show the same passing difference twice (a writer's
    /// batch of a steady size): the round after them finds the sale quiet and its counters
    /// exact, and a recount then would not be abandoned but recount a sale of a million
    /// orders at a fifth of a core for a minute, to find nothing.
    fn confirmed_by(&self, counted: &Account) -> bool {
        self.rounds + 1 >= CONFIRM_ROUNDS
            && !counted.exact()
            && counted.differences() == self.differences
    }
}

impl Auditor {
    pub async fn run(self, mut stop: watch::Receiver<bool>) {
        let mut streaks: HashMap<i64, Streak> = HashMap::new();
        let suspects: Arc<Mutex<HashSet<i64>>> = Default::default();
        let sweep = tokio::spawn(
            Sweep {
                store: self.store.clone(),
                gate: self.gate.clone(),
                backlog: self.backlog.clone(),
                cache: self.cache.clone(),
                board: self.board.clone(),
                written: self.written.clone(),
                every: self.every,
                suspects: suspects.clone(),
            }
            .run(stop.clone()),
        );
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.every) => {}
                _ = stop.changed() => {}
            }
            if crate::stop::requested(&mut stop) {
                break;
            }
            let holding = match &self.lease {
                Some(lease) => match lease.hold(self.every * 3).await {
                    Ok(h) => h,
                    Err(e) => {
                        tracing::debug!(error = %e, "audit lease unavailable");
                        false
                    }
                },
                None => true,
            };
            self.board.auditing.store(holding, Ordering::Relaxed);
            // While the database's identity is not settled (a failover's window being
            // written into the new primary), SQL lacks what the window holds: no account
            // of it means anything yet.
            if !holding || !self.store.settled() {
                streaks.clear();
                lock(&self.board.drift).clear();
                continue;
            }
            let found = std::mem::take(&mut *lock(&suspects));
            self.round(&mut streaks, &found).await;
        }
        sweep.abort();
    }

    /// One audit of every live sale, quiet ones in turn; `suspects`: sales the sweep found
    /// different.
    async fn round(&self, streaks: &mut HashMap<i64, Streak>, suspects: &HashSet<i64>) {
        let now = self.store.now_ms();
        let live = live_sales(&self.cache, now);
        streaks.retain(|sale, _| live.iter().any(|(id, _)| id == sale));
        lock(&self.board.drift).retain(|sale, _| live.iter().any(|(id, _)| id == sale));
        let round = self.board.audits.load(Ordering::Relaxed);
        let live: Vec<SaleSegments> = {
            let drift = lock(&self.board.drift);
            live.into_iter()
                .filter(|(sale, _)| {
                    let followed = streaks.contains_key(sale)
                        || suspects.contains(sale)
                        || drift.contains_key(sale);
                    let cached = self.cache.get(*sale);
                    followed || cached.is_none_or(|s| audited_now(&s, now, round))
                })
                .collect()
        };
        // Sales a recount found different are recounted; the others are read from their
        // counters, all in one query, and recounted too when their counters show again the
        // difference this round would confirm.
        let (followed, counters): (Vec<SaleSegments>, Vec<SaleSegments>) =
            live.into_iter().partition(|(sale, _)| {
                streaks.get(sale).is_some_and(|s| s.recounted) || suspects.contains(sale)
            });
        let mut recount: Vec<i64> = followed.into_iter().map(|(sale, _)| sale).collect();
        let mut accounts = Vec::new();
        let (store, gate, backlog) = (&self.store, self.gate.as_ref(), self.backlog.as_ref());
        match super::accounts_of_counters(store, gate, backlog, &counters).await {
            Ok(read) => {
                for (sale, account) in read {
                    let confirming = match (&account, streaks.get(&sale)) {
                        (Ok(a), Some(streak)) => streak.confirmed_by(a),
                        _ => false,
                    };
                    if confirming {
                        recount.push(sale);
                    } else {
                        accounts.push((sale, false, account));
                    }
                }
            }
            Err(e) => tracing::debug!(error = %e, "the audit could not read the sales' counters"),
        }
        for sale in recount {
            let seen = streaks.get(&sale).map(|s| s.differences);
            tracing::info!(sale, differences = ?seen, "the audit recounts the sale to confirm a difference");
            let (store, backlog) = (&self.store, self.backlog.as_ref());
            let gate = (self.gate.as_ref(), self.written.as_ref());
            match quiet_recount(store, gate, backlog, sale, Pace::BACKGROUND).await {
                Some(account) => accounts.push((sale, true, account)),
                // Orders moved while it counted: the difference was likely theirs (a writer's
                // batch of a steady size is the same difference two rounds running). The
                // counters must show it again, quiet, before a recount is tried again:
                // otherwise the streak would recount a sale of a million orders once the
                // storm is over, at a fifth of a core for a minute, to find nothing.
                None => {
                    streaks.remove(&sale);
                }
            }
        }
        for (sale, recounted, account) in accounts {
            match account {
                Ok(a) => self.judge(streaks, a, recounted, now),
                // Nothing to conclude this round; a streak needs unbroken rounds.
                Err(ReconcileError::TooMuchInFlight(_)) => {
                    streaks.remove(&sale);
                }
                Err(e) => {
                    tracing::debug!(sale, error = %e, "audit of the sale failed this round");
                    streaks.remove(&sale);
                }
            }
        }
        self.board.audits.fetch_add(1, Ordering::Relaxed);
    }

    /// Takes in one round's account of a sale (`recounted`: from every row); drift is a
    /// difference seen the same `CONFIRM_ROUNDS` rounds running, the last one recounted.
    fn judge(&self, streaks: &mut HashMap<i64, Streak>, a: Account, recounted: bool, now: i64) {
        let sale: i64 = a.sale_id.parse().unwrap_or_default();
        let differences = a.differences();
        if a.exact() {
            streaks.remove(&sale);
            if lock(&self.board.drift).remove(&sale).is_some() {
                tracing::info!(sale, "drift cleared: the gate matches SQL again");
            }
            return;
        }
        let fresh = || Streak {
            differences,
            rounds: 0,
            since_ms: now,
            recounted,
        };
        let streak = streaks.entry(sale).or_insert_with(fresh);
        if streak.differences != differences {
            *streak = fresh();
        }
        streak.rounds += 1;
        streak.recounted |= recounted;
        // Counters alone never confirm: `confirmed_by` makes the confirming round a recount.
        if streak.rounds < CONFIRM_ROUNDS || !recounted {
            return;
        }
        let since_ms = streak.since_ms;
        // Behind: the gate may sell what SQL has sold, or let a buyer past the limit; a
        // rebuild from SQL mends that. Ahead: the gate holds orders SQL lacks, which is
        // what a database failover leaves; a rebuild from SQL would sell them again to
        // others while their buyers hold an `ok` (invariant 8). They are written back into
        // SQL from the failover window instead, and reported; never rebuilt away.
        let behind = a.stock_drift > 0 || a.buyers_missing > 0;
        let ahead = a.stock_drift < 0 || a.buyers_unknown > 0;
        let known = lock(&self.board.drift)
            .get(&sale)
            .map(|f| f.account.differences());
        if self.repair && behind {
            self.repair_or_pause(sale, &a, now);
            // Whatever drift is seen after the repair is new: confirmed afresh (the same
            // numbers again would otherwise continue this streak and never be acted on).
            streaks.remove(&sale);
        } else if ahead && known != Some(differences) {
            self.fill_from_window(sale);
        }
        let mut board = lock(&self.board.drift);
        if known != Some(differences) {
            tracing::warn!(
                sale,
                stock_drift = a.stock_drift,
                buyers_missing = a.buyers_missing,
                buyers_unknown = a.buyers_unknown,
                journal_drift = a.journal_drift,
                gate_stock = a.gate_stock,
                expected_gate_stock = a.expected_gate_stock,
                "DRIFT: the gate no longer matches SQL and what is in flight; see `seckill reconcile --sale {sale}`, repair with --repair"
            );
        }
        board.insert(
            sale,
            Finding {
                account: a,
                since_ms,
            },
        );
    }
}

/// Whether round number `round` audits `sale`, unless a difference in it is followed:
/// each round while it moves, one in `QUIET_EVERY` when it is quiet.
fn audited_now(sale: &Sale, now: i64, round: u64) -> bool {
    let moved_lately = [sale.updated_at, sale.begins_at, sale.ends_at]
        .iter()
        .any(|at| (now - at).abs() < QUIET_AFTER_MS);
    // Mixed first: sale ids are time, worker and sequence bits, and most of them fall on a
    // few remainders of 10 as they are.
    let turn = (sale.id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
    moved_lately || turn.wrapping_add(round).is_multiple_of(QUIET_EVERY)
}

/// Sales the audit looks at: open, about to open, or ended less than `AFTER_END_MS` ago.
fn live_sales(cache: &SaleCache, now: i64) -> Vec<SaleSegments> {
    cache
        .all()
        .iter()
        .filter(|s| s.begins_at <= now + 60_000 && now < s.ends_at + AFTER_END_MS)
        .map(|s| (s.id, s.segments))
        .collect()
}

/// What moves when orders are taken, given back or written: the sale's figures in the
/// gate, and the orders this instance's writer has written (of any sale).
type Moment = (Option<(i64, i64)>, u64);

async fn moment(
    (gate, written): (&dyn Gate, &WriterStats),
    sale: i64,
) -> Result<Moment, ReconcileError> {
    let figures = gate.stock(sale).await?.map(|g| (g.remaining, g.accepted));
    Ok((figures, written.written.load(Ordering::Relaxed)))
}

/// How often a recount looks whether its sale moved.
const MOVED_EVERY: Duration = Duration::from_millis(250);

/// A sale recounted from every row at `pace`; `None` (abandoned at once, its snapshot let
/// go) when the gate takes or gives back units meanwhile, or orders are written: the gate
/// is read at the start, SQL over the whole count, so their difference then says nothing
/// (drift shows when the sale is quiet), and a snapshot held under writes holds the
/// database's cleanup back.
async fn quiet_recount(
    store: &Store,
    gate: (&dyn Gate, &WriterStats),
    backlog: &dyn crate::orderlog::Backlog,
    sale: i64,
    pace: Pace,
) -> Option<Result<Account, ReconcileError>> {
    let before = match moment(gate, sale).await {
        Ok(m) => m,
        Err(e) => return Some(Err(e)),
    };
    let work = account_with(store, gate.0, backlog, sale, Depth::Recount(pace), &|_| {});
    tokio::pin!(work);
    let result = loop {
        tokio::select! {
            result = &mut work => break result,
            _ = tokio::time::sleep(MOVED_EVERY) => {
                // Dropped mid-read (a chunk, a pause, the journal's sum): its transaction's
                // connection is closed, never handed back to the pool (`WriteTx`).
                if moment(gate, sale).await.map_or(true, |now| now != before) {
                    return None;
                }
            }
        }
    };
    if moment(gate, sale).await.map_or(true, |now| now != before) {
        return None;
    }
    Some(result.map(|(account, _)| account))
}

/// The slow sweep: each live sale recounted in turn at `SWEEP`'s pace, while this instance
/// audits and nothing is written. Its own task, so that a sale of millions of orders swept
/// for minutes never holds up the rounds.
struct Sweep {
    store: Store,
    gate: Arc<dyn Gate>,
    written: Arc<WriterStats>,
    backlog: Arc<dyn crate::orderlog::Backlog>,
    cache: Arc<SaleCache>,
    board: Arc<Board>,
    every: Duration,
    /// Sales found different, for the next round to follow.
    suspects: Arc<Mutex<HashSet<i64>>>,
}

impl Sweep {
    async fn run(self, mut stop: watch::Receiver<bool>) {
        let mut next = 0usize;
        let gate = (self.gate.as_ref(), self.written.as_ref());
        loop {
            let live = live_sales(&self.cache, self.store.now_ms());
            let sale = live.get(next % live.len().max(1)).map(|(sale, _)| *sale);
            let before = match sale {
                Some(sale) => moment(gate, sale).await.ok(),
                None => None,
            };
            tokio::select! {
                _ = tokio::time::sleep(self.every) => {}
                _ = stop.changed() => {}
            }
            if crate::stop::requested(&mut stop) {
                break;
            }
            let Some(sale) = sale else { continue };
            if !self.board.auditing.load(Ordering::Relaxed) {
                continue;
            }
            // Orders under way are left to pass: a recount now would be abandoned. The turn
            // goes on either way, so that a sale with a steady trickle never stops the rest.
            next = next.wrapping_add(1);
            let now = moment(gate, sale).await.ok();
            if now.is_none() || now != before {
                continue;
            }
            match quiet_recount(&self.store, gate, self.backlog.as_ref(), sale, SWEEP).await {
                Some(Ok(a)) if !a.exact() => {
                    tracing::info!(sale, differences = ?a.differences(), "the audit's sweep found a difference: followed by recounts");
                    lock(&self.suspects).insert(sale);
                }
                Some(Ok(_)) | None => {}
                Some(Err(e)) => {
                    tracing::debug!(sale, error = %e, "the sweep could not recount the sale")
                }
            }
        }
    }
}

impl Auditor {
    /// A gate ahead of SQL: the failover window written again into SQL, as its own task,
    /// one at a time. What it cannot fill stays on the board, for an operator.
    fn fill_from_window(&self, sale: i64) {
        if self.filling.swap(true, Ordering::AcqRel) {
            return;
        }
        let (store, filling) = (self.store.clone(), self.filling.clone());
        tokio::spawn(async move {
            let token = format!("{:016x}", rand::random::<u64>());
            match store.write_window_again(&token).await {
                Ok(0) => tracing::error!(
                    sale,
                    "the gate holds orders SQL lacks, and the failover window has none of them \
                     (a failover longer ago than the window, or rows removed by hand): not \
                     repaired, since a rebuild from SQL would sell them again; see `seckill \
                     reconcile --sale {sale}`"
                ),
                Ok(orders) => tracing::warn!(
                    sale,
                    orders,
                    "the gate was ahead of SQL: the failover window wrote the orders SQL lacked"
                ),
                Err(e) => {
                    tracing::warn!(sale, error = %e, "the failover window could not be written again")
                }
            }
            filling.store(false, Ordering::Release);
        });
    }

    /// Repairs a sale's confirmed drift, as its own task (a rebuild outlasts an audit
    /// round); pauses the sale instead when repairs have not held. A paused sale is left
    /// alone: an operator is on it.
    fn repair_or_pause(&self, sale_id: i64, a: &Account, now: i64) {
        let Some(sale) = self.cache.get(sale_id).filter(|s| !s.paused) else {
            return;
        };
        let what = format!(
            "stock {:+}, buyers missing {}, buyers unknown {}",
            a.stock_drift, a.buyers_missing, a.buyers_unknown
        );
        let repair = {
            let mut repairs = lock(&self.repairs);
            let log = repairs.entry(sale_id).or_default();
            if log.running {
                return;
            }
            log.at.retain(|at| now - at < REPAIR_WINDOW_MS);
            if log.at.len() >= PAUSE_AFTER_REPAIRS {
                // After a resume, the sale gets its repairs afresh.
                log.at.clear();
                false
            } else {
                log.running = true;
                log.at.push(now);
                true
            }
        };
        let (store, gate, backlog, cache, board, repairs) = (
            self.store.clone(),
            self.gate.clone(),
            self.backlog.clone(),
            self.cache.clone(),
            self.board.clone(),
            self.repairs.clone(),
        );
        tokio::spawn(async move {
            if !repair {
                let why = format!(
                    "drift came back after {PAUSE_AFTER_REPAIRS} repairs in {} minutes ({what})",
                    REPAIR_WINDOW_MS / 60_000
                );
                pause(&store, gate.as_ref(), &board, sale_id, why).await;
                return;
            }
            let reason = format!("drift confirmed over {CONFIRM_ROUNDS} audits: {what}");
            let repaired = super::repair(
                &store,
                gate.as_ref(),
                backlog.as_ref(),
                &cache,
                &sale,
                "audit",
                &reason,
            )
            .await;
            if let Some(log) = lock(&repairs).get_mut(&sale_id) {
                log.running = false;
            }
            match repaired {
                Ok(r) => {
                    board.repairs.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        sale = sale_id,
                        exact = r.after.exact(),
                        "the audit repaired the sale's gate from SQL ({what})"
                    );
                }
                // A gate that cannot be rebuilt while it runs (the embedded one).
                Err(ReconcileError::Gate(crate::gate::GateError::Misconfigured(why))) => {
                    let why = format!("{what}; {why}");
                    pause(&store, gate.as_ref(), &board, sale_id, why).await;
                }
                Err(e) => tracing::warn!(
                    sale = sale_id,
                    error = %e,
                    "the audit's repair failed; it tries again once the drift is confirmed again"
                ),
            }
        });
    }
}

/// Pauses a sale whose gate the audit cannot keep right, and says so loudly: purchases
/// answer `paused` until an operator resumes it (after `seckill reconcile --repair`, or a
/// restart of an embedded server).
async fn pause(store: &Store, gate: &dyn Gate, board: &Board, sale_id: i64, why: String) {
    let paused = async {
        store.set_paused(sale_id, true).await?;
        gate.set_paused(sale_id, true).await?;
        Ok::<(), ReconcileError>(())
    }
    .await;
    match paused {
        Ok(()) => {
            tracing::error!(
                sale = sale_id,
                "SALE PAUSED BY THE AUDIT: its gate keeps drifting from SQL ({why}). Find the \
                 cause, repair it (`seckill reconcile --sale {sale_id} --repair`), then resume \
                 the sale"
            );
            lock(&board.paused).insert(sale_id, why);
        }
        Err(e) => {
            tracing::error!(sale = sale_id, error = %e, "the audit could not pause a drifting sale ({why})")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counted(stock_drift: i64, buyers_missing: i64) -> Account {
        Account {
            sale_id: "7".into(),
            gate_loaded: true,
            gate_stock: Some(100 + stock_drift),
            gate_buyers: Some(50),
            sql_stock: 100,
            sql_live_units: 50,
            sql_live_buyers: 50,
            unwritten_orders: 0,
            unwritten_units: 0,
            dead_letters: 0,
            returns_owed_orders: 0,
            returns_owed_units: 0,
            units_in_transit: 0,
            journal_sum: 100,
            expected_gate_stock: 100,
            stock_drift,
            buyers_missing,
            buyers_unknown: 0,
            buyers_compared_each: false,
            journal_drift: 0,
        }
    }

    /// A quiet sale is audited one round in `QUIET_EVERY`, quiet sales in turn; a sale that
    /// moved, opened or ended within `QUIET_AFTER_MS` every round.
    #[test]
    fn quiet_sales_are_audited_in_turn_and_moving_ones_every_round() {
        let now = 10_000_000;
        let sale = |id: i64, updated_at: i64| Sale {
            id,
            title: String::new(),
            price_cents: 1,
            initial_stock: 1,
            stock: 1,
            per_user_limit: 1,
            begins_at: now - 3_600_000,
            ends_at: now + 3_600_000,
            payment_window_secs: 60,
            approved: true,
            paused: false,
            updated_at,
            anti_bot: Default::default(),
            segments: 1,
            waiting_room: None,
            external_ref: None,
        };
        let rounds = 0..3 * QUIET_EVERY;
        let audits = |s: &Sale| rounds.clone().filter(|r| audited_now(s, now, *r)).count();
        for id in 0..100 {
            let quiet = sale(id, now - QUIET_AFTER_MS);
            assert_eq!(audits(&quiet), 3, "sale {id}: one round in {QUIET_EVERY}");
            assert_eq!(audits(&sale(id, now - 1_000)), 3 * QUIET_EVERY as usize);
        }
        // Sale ids as the id generator makes them: milliseconds, worker and sequence bits.
        let ids: Vec<i64> = (0..1000)
            .map(|i| (1_700_000_000_000 + i * 37) << 22 | 3 << 12)
            .collect();
        for round in 0..QUIET_EVERY {
            let audited = ids
                .iter()
                .filter(|id| audited_now(&sale(**id, 0), now, round))
                .count();
            assert!(
                (50..=150).contains(&audited),
                "round {round} audits {audited} of 1,000 quiet sales, not about a tenth"
            );
        }
        let opening = Sale {
            begins_at: now + 30_000,
            ..sale(1, 0)
        };
        let ended = Sale {
            ends_at: now - 30_000,
            ..sale(1, 0)
        };
        assert_eq!(audits(&opening), 3 * QUIET_EVERY as usize, "about to open");
        assert_eq!(audits(&ended), 3 * QUIET_EVERY as usize, "just ended");
    }

    fn streak(rounds: u32, stock_drift: i64) -> Streak {
        Streak {
            differences: counted(stock_drift, 0).differences(),
            rounds,
            since_ms: 0,
            recounted: false,
        }
    }

    #[test]
    fn the_confirming_round_recounts_only_a_difference_its_counters_still_show() {
        let seen_twice = streak(CONFIRM_ROUNDS - 1, 5_000);
        assert!(seen_twice.confirmed_by(&counted(5_000, 0)));
        // The storm's last batches are written: the sale is quiet and exact, or moved on.
        assert!(!seen_twice.confirmed_by(&counted(0, 0)));
        assert!(!seen_twice.confirmed_by(&counted(4_000, 0)));
        assert!(!seen_twice.confirmed_by(&counted(5_000, 1)));
        // Too early to confirm anything: the counters alone carry the streak on.
        assert!(!streak(CONFIRM_ROUNDS - 2, 5_000).confirmed_by(&counted(5_000, 0)));
    }
}
