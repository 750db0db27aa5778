//! One seed's run: the buyers, payments, cancels, time passing, writer batches, a database
//! locked from outside and crashes, in an order and with faults drawn from the seed, with
//! the invariants checked after every step (`check`), then a final drain and check.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use rand::rngs::StdRng;
use rand::Rng;
use seckill::clock::{Clock, SimClock};
use seckill::gate::{GateError, Purchase, Verdict};
use seckill::ids::IdGenerator;
use seckill::model::{AntiBot, Sale};
use seckill::store::{Payment, Store};
use tokio::task::JoinHandle;

use crate::check;
use crate::disk::{Crash, DiskFaults, SimDisk};
use crate::world::{rng_for, Blocker, CommitFaults, Machine, World};

/// What a buyer was told about one purchase attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Told {
    /// `ok`: the order must reach SQL.
    Ok,
    /// `pending` (it may have been taken): either way.
    Pending,
    /// Any "no" (sold out, limit, 503): it must never become an order.
    No,
    /// The process died before answering: either way.
    Unanswered,
}

#[derive(Debug, Clone, Copy)]
pub struct Attempt {
    pub sale: i64,
    pub user: i64,
    pub quantity: i64,
    pub told: Told,
}

/// A sale as the simulation made it.
#[derive(Debug, Clone, Copy)]
pub struct SaleSpec {
    pub id: i64,
    pub stock: i64,
    pub limit: i64,
    pub begins_at: i64,
    pub ends_at: i64,
    pub window_secs: i64,
}

/// What a run did, for the summary and the replay check.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tally {
    pub steps: usize,
    pub ok: usize,
    pub refused: usize,
    pub pending_or_unanswered: usize,
    pub crashes: usize,
    pub failed_boots: usize,
    pub written: usize,
    pub paid: usize,
    pub cancelled: usize,
    pub expired: usize,
    pub busy_periods: usize,
}

pub struct Report {
    pub tally: Tally,
    pub trace: Vec<String>,
}

#[derive(Debug)]
pub struct Failure {
    pub step: usize,
    pub what: String,
    pub trace: Vec<String>,
}

/// The parameters a seed draws, so that seeds explore different regimes (few or many
/// buyers, a disk that never or often fails, ...), not one average.
struct Knobs {
    users: i64,
    disk: DiskFaults,
    commit_crash: f64,
    action_crash: f64,
    busy: f64,
}

pub struct Sim {
    pub seed: u64,
    rng: StdRng,
    pub machine: Machine,
    /// Reads SQL for the checks: a connection of its own, never struck by a fault.
    pub observer: Store,
    pub world: Option<World>,
    ids: IdGenerator,
    blocker: Option<Blocker>,
    pub sales: Vec<SaleSpec>,
    knobs: Knobs,
    pub attempts: BTreeMap<i64, Attempt>,
    /// Purchases decided by the gate or waiting for the log's commit.
    inflight: Vec<(i64, JoinHandle<Result<Verdict, GateError>>)>,
    /// The status each order had in SQL at the last check.
    pub statuses: BTreeMap<i64, String>,
    /// SQL as the last check read it, while no step since can have changed it.
    pub sql: Option<check::SqlSnapshot>,
    pub tally: Tally,
    pub trace: Vec<String>,
    step: usize,
    dir: std::path::PathBuf,
}

const START_MS: i64 = 1_900_000_000_000;

impl Sim {
    pub async fn new(seed: u64) -> Sim {
        let mut knobs_rng = rng_for(seed, "knobs");
        let pick = |rng: &mut StdRng, options: &[f64]| options[rng.random_range(0..options.len())];
        let knobs = Knobs {
            users: knobs_rng.random_range(2..=24),
            disk: DiskFaults {
                fail: pick(&mut knobs_rng, &[0.0, 0.0, 0.01, 0.05]),
                crash: pick(&mut knobs_rng, &[0.0, 0.005, 0.02]),
            },
            commit_crash: pick(&mut knobs_rng, &[0.0, 0.005, 0.02]),
            action_crash: pick(&mut knobs_rng, &[0.0, 0.01, 0.03]),
            busy: pick(&mut knobs_rng, &[0.0, 0.02, 0.05]),
        };
        let clock = SimClock::new(START_MS + knobs_rng.random_range(0..86_400_000));
        let crash = Arc::new(Crash::default());
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            std::path::PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("seckill-sim-{}-{seed:016x}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a folder for the simulated database");
        std::fs::copy(migrated_template(&base).await, dir.join("sim.db"))
            .expect("a copy of the migrated database");
        let db_url = format!("sqlite://{}/sim.db", dir.display());
        let observer = Store::connect(&db_url, 2)
            .await
            .expect("the observer opens the database");
        let faults = Arc::new(CommitFaults {
            rng: Mutex::new(rng_for(seed, "commits")),
            before: knobs.commit_crash,
            after: knobs.commit_crash,
            crash: crash.clone(),
        });
        let machine = Machine {
            clock: clock.clone(),
            disk: SimDisk::new(rng_for(seed, "disk").random(), knobs.disk, crash.clone()),
            crash,
            faults,
            db_url,
            log_dir: std::path::PathBuf::from("/sim/orders"),
            max_backlog: knobs_rng.random_range(2..=64),
            batch_max: knobs_rng.random_range(1..=16),
        };
        let sales = make_sales(&observer, &mut knobs_rng, clock.now_ms()).await;
        Sim {
            seed,
            rng: rng_for(seed, "actions"),
            ids: IdGenerator::fixed(0).with_clock(clock),
            machine,
            observer,
            world: None,
            blocker: None,
            sales,
            knobs,
            attempts: BTreeMap::new(),
            inflight: Vec::new(),
            statuses: BTreeMap::new(),
            sql: None,
            tally: Tally::default(),
            trace: Vec::new(),
            step: 0,
            dir,
        }
    }

    fn note(&mut self, line: String) {
        self.trace.push(format!("{:>4} {line}", self.step));
    }

    fn fail(&self, what: String) -> Failure {
        Failure {
            step: self.step,
            what,
            trace: self.trace.clone(),
        }
    }

    /// Runs `steps` steps and the final drain; the report, or the first broken invariant.
    pub async fn run(mut self, steps: usize) -> Result<Report, Failure> {
        let _ = self.boot().await;
        for _ in 0..steps {
            self.step += 1;
            self.act().await;
            if self.world.is_some() {
                if let Err(what) = check::after_step(&mut self).await {
                    return Err(self.fail(what));
                }
            }
        }
        self.step += 1;
        self.quiesce().await.map_err(|what| self.fail(what))?;
        if let Err(what) = check::at_rest(&mut self).await {
            return Err(self.fail(what));
        }
        if let Err(what) = self.a_new_buyer_can_buy().await {
            return Err(self.fail(what));
        }
        if let Err(what) = check::at_rest(&mut self).await {
            return Err(self.fail(what));
        }
        self.tally.steps = steps;
        self.machine.crash.strike();
        self.world = None;
        self.machine.crash.bury().await;
        self.observer.close().await;
        let _ = std::fs::remove_dir_all(&self.dir);
        Ok(Report {
            tally: self.tally.clone(),
            trace: std::mem::take(&mut self.trace),
        })
    }

    async fn act(&mut self) {
        // Purchases and the log's commits never touch SQL (nor does another process's lock):
        // the checks may reuse what they read of it.
        let roll = self.rng.random_range(0..100);
        if self.world.is_none() || !matches!(roll, 0..=41 | 87..=92) {
            self.sql = None;
        }
        if self.world.is_none() {
            // The other process holding the database lets go now and then.
            if self.blocker.is_some() && self.rng.random_bool(0.3) {
                self.toggle_busy().await;
            } else {
                let _ = self.boot().await;
            }
            return;
        }
        match roll {
            0..=29 => self.buy().await,
            30..=41 => self.commit().await,
            42..=59 => self.write().await,
            60..=66 => self.pay().await,
            67..=73 => self.cancel().await,
            74..=81 => self.pass_time().await,
            82..=86 => self.tick().await,
            87..=92 => self.toggle_busy().await,
            _ => {
                if self
                    .rng
                    .random_bool(self.knobs.action_crash.max(0.001) * 10.0)
                {
                    self.note("crash (between steps)".into());
                    self.machine.crash.strike();
                } else {
                    self.tick().await;
                }
            }
        }
        if self.machine.crash.is_down() {
            self.tear_down().await;
        }
    }

    /// A new process: after a crash, the disk keeps what it keeps; time moves on (a start
    /// takes time, and ids must not repeat).
    async fn boot(&mut self) -> Result<(), String> {
        self.machine.disk.lose_unsynced();
        self.machine
            .clock
            .advance(self.rng.random_range(200..3_000));
        match World::boot(&self.machine).await {
            Ok(world) => {
                self.note(format!("boot (log bytes {})", self.machine.disk.bytes()));
                self.ids = IdGenerator::fixed(0).with_clock(self.machine.clock.clone());
                self.world = Some(world);
                Ok(())
            }
            Err(why) => {
                self.tally.failed_boots += 1;
                self.note(format!("boot failed: {}", coarse(&why)));
                self.machine.crash.strike();
                self.machine.crash.bury().await;
                Err(why)
            }
        }
    }

    /// The process died: its buyers still waiting hear nothing.
    async fn tear_down(&mut self) {
        self.tally.crashes += 1;
        for (id, handle) in std::mem::take(&mut self.inflight) {
            handle.abort();
            let _ = handle.await;
            if let Some(a) = self.attempts.get_mut(&id) {
                a.told = Told::Unanswered;
            }
            self.tally.pending_or_unanswered += 1;
        }
        self.world = None;
        self.machine.crash.bury().await;
        self.note("down".into());
    }

    fn world(&self) -> &World {
        self.world.as_ref().expect("a running process")
    }

    async fn buy(&mut self) {
        let burst = self.rng.random_range(1..=6);
        for _ in 0..burst {
            let spec = self.sales[self.rng.random_range(0..self.sales.len())];
            let user = 1000 + self.rng.random_range(0..self.knobs.users);
            let quantity = if self.rng.random_bool(0.85) {
                1
            } else {
                self.rng.random_range(1..=spec.limit + 1)
            };
            let Ok(order_id) = self.ids.next() else {
                continue;
            };
            let gate = self.world().gate.clone();
            let p = Purchase {
                sale_id: spec.id,
                user_id: user,
                quantity,
                order_id,
                token: None,
                segments: 1,
                after_move: false,
                retry_key: None,
            };
            self.attempts.insert(
                order_id,
                Attempt {
                    sale: spec.id,
                    user,
                    quantity,
                    told: Told::Unanswered,
                },
            );
            self.note(format!(
                "buy o={order_id} s={} u={user} q={quantity}",
                spec.id
            ));
            self.inflight.push((
                order_id,
                tokio::spawn(async move { gate.purchase(p).await }),
            ));
        }
        self.settle_decisions().await;
        if self.rng.random_bool(0.7) {
            self.commit().await;
        }
    }

    /// Lets every purchase in flight run until it is answered or waits for the log.
    async fn settle_decisions(&mut self) {
        for _ in 0..1000 {
            let done = self
                .inflight
                .iter()
                .filter(|(_, h)| h.is_finished())
                .count();
            let waiting = self.world.as_ref().map_or(0, |w| w.pump.waiting());
            if done + waiting >= self.inflight.len() {
                break;
            }
            tokio::task::yield_now().await;
        }
        self.collect_answers().await;
    }

    async fn collect_answers(&mut self) {
        let mut still = Vec::new();
        for (id, handle) in std::mem::take(&mut self.inflight) {
            if !handle.is_finished() {
                still.push((id, handle));
                continue;
            }
            let result = handle.await.expect("a purchase task does not panic");
            let told = match &result {
                Ok(Verdict::Accepted { .. }) => Told::Ok,
                Ok(Verdict::Rejected(_)) => Told::No,
                Ok(Verdict::Again { .. }) => {
                    unreachable!("the simulation sends no Idempotency-Key")
                }
                Err(e) if e.may_have_taken_effect() => Told::Pending,
                Err(_) => Told::No,
            };
            match told {
                Told::Ok => self.tally.ok += 1,
                Told::No => self.tally.refused += 1,
                _ => self.tally.pending_or_unanswered += 1,
            }
            let shown = match &result {
                Ok(v) => format!("{v:?}"),
                Err(e) => coarse(&e.to_string()),
            };
            self.note(format!("  o={id} -> {told:?} ({shown})"));
            if let Some(a) = self.attempts.get_mut(&id) {
                a.told = told;
            }
        }
        self.inflight = still;
    }

    async fn commit(&mut self) {
        let committed = match self.world.as_mut() {
            Some(w) => w.pump.commit(),
            None => return,
        };
        if committed == 0 {
            return;
        }
        self.note(format!("commit {committed}"));
        if self.machine.crash.is_down() {
            self.note("  crashed during the commit".into());
            return;
        }
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        self.collect_answers().await;
    }

    async fn write(&mut self) {
        let max = self.rng.random_range(1..=self.machine.batch_max);
        let world = self.world();
        let batch = match seckill::orderlog::OrderLog::next_batch(world.reader.as_ref(), max).await
        {
            Ok(batch) => batch,
            Err(e) => {
                self.note(format!("write: read failed {}", coarse(&e.to_string())));
                return;
            }
        };
        let orders = batch.deliveries.len();
        let before = world
            .writer
            .stats
            .written
            .load(std::sync::atomic::Ordering::Relaxed);
        world.writer.process(batch).await;
        let written = world
            .writer
            .stats
            .written
            .load(std::sync::atomic::Ordering::Relaxed)
            - before;
        self.tally.written += written as usize;
        self.note(format!("write {orders} read, {written} written"));
    }

    /// An order to act on: mostly one SQL holds, sometimes one only answered (queued).
    fn pick_order(&mut self) -> Option<(i64, Attempt)> {
        if self.attempts.is_empty() {
            return None;
        }
        let in_sql = self.rng.random_bool(0.8);
        let known: Vec<(i64, Attempt)> = self
            .attempts
            .iter()
            .filter(|(id, a)| {
                if in_sql {
                    self.statuses.contains_key(id)
                } else {
                    a.told != Told::No
                }
            })
            .map(|(id, a)| (*id, *a))
            .collect();
        if known.is_empty() {
            return None;
        }
        Some(known[self.rng.random_range(0..known.len())])
    }

    async fn pay(&mut self) {
        let Some((id, _)) = self.pick_order() else {
            return;
        };
        let world = self.world();
        let store = world.store.clone();
        let order = match store.order(id).await {
            Ok(Some(order)) => order,
            Ok(None) => {
                self.note(format!("pay o={id}: not in SQL"));
                return;
            }
            Err(e) => {
                self.note(format!("pay o={id}: {}", coarse(&e.to_string())));
                return;
            }
        };
        let Ok(intent_id) = self.ids.next() else {
            return;
        };
        let now = store.now_ms();
        let opened = store
            .open_payment(&Payment {
                intent_id,
                order_id: id,
                user_id: order.user_id,
                amount_cents: order.price_cents * order.quantity,
                status: "created".into(),
                created_at: now,
            })
            .await;
        let intent = match opened {
            Ok(p) => p.intent_id,
            Err(e) => {
                self.note(format!("pay o={id}: open {}", coarse(&e.to_string())));
                return;
            }
        };
        // Mostly paid; now and then the provider says it failed (the buyer may try again).
        if self.rng.random_bool(0.15) {
            let failed = store.fail_payment(intent, "declined", now).await;
            self.note(format!(
                "pay o={id} -> failed {}",
                match &failed {
                    Ok(changed) => changed.to_string(),
                    Err(e) => coarse(&e.to_string()),
                }
            ));
            return;
        }
        let settled = store.settle_payment(intent, "sim", now).await;
        self.note(format!(
            "pay o={id} -> {}",
            match &settled {
                Ok(s) => format!("{s:?}"),
                Err(e) => coarse(&e.to_string()),
            }
        ));
        if let Ok(seckill::store::PaymentSettlement::Paid) = settled {
            self.tally.paid += 1;
            if !self.machine.crash.is_down() {
                check::status_is(&self.observer, id, "paid", "a settled payment").await;
            }
        }
    }

    async fn cancel(&mut self) {
        let Some((id, attempt)) = self.pick_order() else {
            return;
        };
        let user = if self.rng.random_bool(0.9) {
            attempt.user
        } else {
            1000 + self.rng.random_range(0..self.knobs.users)
        };
        let world = self.world();
        let result = seckill::lifecycle::cancel(&world.store, world.gate.as_ref(), id, user).await;
        self.note(format!(
            "cancel o={id} by u={user} -> {}",
            match &result {
                Ok(()) => "ok".into(),
                Err(e) => coarse(&e.to_string()),
            }
        ));
        if result.is_ok() {
            self.tally.cancelled += 1;
            if !self.machine.crash.is_down() {
                check::status_is(&self.observer, id, "cancelled", "an answered cancel").await;
            }
        }
    }

    async fn pass_time(&mut self) {
        let longest = self.sales.iter().map(|s| s.window_secs).max().unwrap_or(60);
        // Mostly moments; sometimes past payment deadlines; now and then past a sale's end.
        let ms = match self.rng.random_range(0..100) {
            0..=69 => self.rng.random_range(0..=5_000),
            70..=95 => self.rng.random_range(0..=longest * 1_500),
            _ => self.rng.random_range(0..=4 * 3_600_000),
        };
        self.machine.clock.advance(ms);
        self.note(format!("time +{ms} ms"));
        self.tick().await;
    }

    async fn tick(&mut self) {
        let result = self
            .world()
            .scheduler
            // No wall-clock budget: a seed must replay the same steps.
            .tick(std::time::Duration::MAX)
            .await;
        self.note(format!(
            "tick {}",
            match &result {
                Ok(()) => "ok".into(),
                Err(e) => coarse(&e.to_string()),
            }
        ));
    }

    async fn toggle_busy(&mut self) {
        match self.blocker.take() {
            Some(blocker) => {
                blocker.release().await;
                self.note("database free".into());
            }
            None if self.rng.random_bool((self.knobs.busy * 10.0).min(1.0)) => {
                self.blocker = Some(Blocker::take(&self.machine.db_url).await);
                self.tally.busy_periods += 1;
                self.note("database locked by another process".into());
            }
            None => {}
        }
    }

    /// Faults off, every process up, every order in the log written, every return handed
    /// back: what is true of the sale now is what must be true forever.
    async fn quiesce(&mut self) -> Result<(), String> {
        self.note("quiesce".into());
        if let Some(blocker) = self.blocker.take() {
            blocker.release().await;
        }
        self.machine.disk.set_faults(DiskFaults {
            fail: 0.0,
            crash: 0.0,
        });
        let quiet = Arc::new(CommitFaults {
            rng: Mutex::new(rng_for(self.seed, "quiet")),
            before: 0.0,
            after: 0.0,
            crash: self.machine.crash.clone(),
        });
        self.machine.faults = quiet;
        // A broken log refuses orders until restart, as an operator would restart it.
        self.machine.crash.strike();
        if self.world.is_some() {
            self.tear_down().await;
        }
        if let Err(why) = self.boot().await {
            return Err(format!(
                "the process does not start once the faults stop: {why}"
            ));
        }
        self.write_all().await;
        self.tick().await;
        Ok(())
    }

    /// Liveness: a sale that is open and has stock in the gate sells to a new buyer (stock
    /// given back by cancels and expiries is sold again, the sold-out shortcut reopened).
    pub async fn a_new_buyer_can_buy(&mut self) -> Result<(), String> {
        let now = self.machine.clock.now_ms();
        for spec in self.sales.clone() {
            let remaining = match self.world().gate.stock(spec.id).await {
                Ok(Some(stock)) => stock.remaining,
                Ok(None) => continue,
                Err(e) => return Err(format!("the gate's stock: {e}")),
            };
            if !(spec.begins_at <= now && now < spec.ends_at) || remaining <= 0 {
                continue;
            }
            let order_id = self.ids.next().map_err(|e| e.to_string())?;
            let gate = self.world().gate.clone();
            let p = Purchase {
                sale_id: spec.id,
                user_id: 999_000 + spec.id,
                quantity: 1,
                order_id,
                token: None,
                segments: 1,
                after_move: false,
                retry_key: None,
            };
            self.attempts.insert(
                order_id,
                Attempt {
                    sale: spec.id,
                    user: p.user_id,
                    quantity: 1,
                    told: Told::Unanswered,
                },
            );
            self.note(format!("final buy o={order_id} s={}", spec.id));
            self.inflight.push((
                order_id,
                tokio::spawn(async move { gate.purchase(p).await }),
            ));
            self.settle_decisions().await;
            self.commit().await;
            let told = self.attempts[&order_id].told;
            if told != Told::Ok {
                return Err(format!(
                    "sale {} is open with {remaining} in the gate, and a new buyer was told {told:?}",
                    spec.id
                ));
            }
            self.write_all().await;
        }
        Ok(())
    }

    /// Writes until the log holds nothing.
    async fn write_all(&mut self) {
        for _ in 0..10_000 {
            let backlog: i64 = self
                .sales
                .iter()
                .map(|s| self.world().log.backlog(s.id))
                .sum();
            if backlog == 0 {
                return;
            }
            self.write().await;
        }
    }
}

/// A database with every migration applied, made once per test process: each seed starts
/// from a copy (the migrations cost more than a seed's first steps).
async fn migrated_template(base: &std::path::Path) -> std::path::PathBuf {
    static TEMPLATE: tokio::sync::OnceCell<std::path::PathBuf> = tokio::sync::OnceCell::const_new();
    TEMPLATE
        .get_or_init(|| async {
            sweep_dead_runs(base);
            let dir = base.join(format!("seckill-sim-{}-template", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("a folder for the template");
            let url = format!("sqlite://{}/sim.db", dir.display());
            let store = Store::connect(&url, 1).await.expect("the template opens");
            store.migrate().await.expect("migrations");
            // One file, no write-ahead log beside it: a plain copy is the whole database.
            sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
                .execute(store.pool())
                .await
                .expect("checkpoint");
            store.close().await;
            dir.join("sim.db")
        })
        .await
        .clone()
}

/// Removes the folders left by simulations whose process has ended (a failed seed keeps
/// its folder for a look; the template outlives every seed).
fn sweep_dead_runs(base: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let pid = name
            .strip_prefix("seckill-sim-")
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok());
        if let Some(pid) = pid {
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}

/// The first words of an error, without paths or numbers that differ between runs.
pub fn coarse(e: &str) -> String {
    e.split([':', '(', '/'])
        .next()
        .unwrap_or_default()
        .trim()
        .chars()
        .take(60)
        .collect()
}

async fn make_sales(store: &Store, rng: &mut StdRng, now: i64) -> Vec<SaleSpec> {
    let count = rng.random_range(1..=3);
    let mut specs = Vec::new();
    for id in 1..=count {
        let begins_at = if rng.random_bool(0.7) {
            now - rng.random_range(0..60_000)
        } else {
            now + rng.random_range(1_000..300_000)
        };
        let spec = SaleSpec {
            id,
            stock: rng.random_range(1..=12),
            limit: rng.random_range(1..=3),
            begins_at,
            ends_at: begins_at + rng.random_range(600_000..4 * 3_600_000),
            window_secs: rng.random_range(30..=900),
        };
        let sale = Sale {
            id,
            title: format!("sale {id}"),
            price_cents: 100 * id,
            initial_stock: spec.stock,
            stock: spec.stock,
            per_user_limit: spec.limit,
            begins_at: spec.begins_at,
            ends_at: spec.ends_at,
            payment_window_secs: spec.window_secs,
            approved: false,
            paused: false,
            updated_at: now,
            anti_bot: AntiBot::default(),
            segments: 1,
            waiting_room: None,
            external_ref: None,
        };
        store.create_sale(&sale).await.expect("a sale is created");
        store.approve_sale(id).await.expect("and approved");
        specs.push(spec);
    }
    specs
}
