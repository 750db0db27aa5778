//! One simulated embedded server, assembled from the product's own parts as `app.rs` does
//! (memory gate behind the sold-out shortcut, the order log on the simulated disk, the
//! writer, the scheduler, SQLite) and started as `App::start_background` starts one: the
//! orders the log kept are written to SQL first, then the first scheduler pass rebuilds
//! the gate from SQL. Faults strike its SQL transactions through `Store::with_faults`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use seckill::clock::SimClock;
use seckill::gate::memory::MemoryGate;
use seckill::gate::soldout::SoldOutShortcut;
use seckill::gate::Gate;
use seckill::loader::SaleCache;
use seckill::orderlog::local::{self, LocalLog, LocalLogReader, Pump};
use seckill::orderlog::OrderLog;
use seckill::scheduler::Scheduler;
use seckill::store::{Store, StoreError, TxFaults};
use seckill::writer::{Writer, WriterStats};

use crate::disk::{Crash, SimDisk};

/// Crashes struck at a write transaction's commit, on the seed's say.
pub struct CommitFaults {
    pub rng: Mutex<StdRng>,
    /// Per commit: the process dies just before it, or just after.
    pub before: f64,
    pub after: f64,
    pub crash: Arc<Crash>,
}

impl CommitFaults {
    fn strike(&self, p: f64) -> Result<(), StoreError> {
        if p > 0.0 && self.rng.lock().unwrap().random_bool(p) {
            self.crash.strike();
            return Err(StoreError::Db(sqlx::Error::PoolClosed));
        }
        Ok(())
    }
}

impl TxFaults for CommitFaults {
    fn before_commit(&self) -> Result<(), StoreError> {
        self.strike(self.before)
    }

    fn after_commit(&self) -> Result<(), StoreError> {
        self.strike(self.after)
    }
}

/// What outlives a process: the disk, the database file, the clock.
pub struct Machine {
    pub clock: Arc<SimClock>,
    pub disk: SimDisk,
    pub crash: Arc<Crash>,
    pub faults: Arc<CommitFaults>,
    pub db_url: String,
    pub log_dir: PathBuf,
    pub max_backlog: usize,
    pub batch_max: usize,
}

/// A running process.
pub struct World {
    pub store: Store,
    pub gate: Arc<dyn Gate>,
    pub log: LocalLog,
    pub reader: Arc<LocalLogReader>,
    pub pump: Pump,
    pub writer: Writer,
    pub scheduler: Scheduler,
}

/// Why a start did not end with a serving process.
pub type BootError = String;

impl World {
    /// Starts a process on `machine`: recovers the log into SQL, rebuilds the gate.
    pub async fn boot(machine: &Machine) -> Result<World, BootError> {
        let clock: seckill::clock::SharedClock = machine.clock.clone();
        let store = Store::connect_sqlite_busy(&machine.db_url, 4, Duration::ZERO)
            .await
            .map_err(|e| format!("connect: {e}"))?
            .with_clock(clock.clone())
            .with_faults(machine.faults.clone());
        machine.crash.boot(store.clone());
        store
            .migrate()
            .await
            .map_err(|e| format!("migrations: {e}"))?;
        let database_id = store
            .meta_get_or_init("database_id", "simulated")
            .await
            .map_err(|e| format!("database id: {e}"))?;
        let opened = local::open_with(
            &machine.log_dir,
            &database_id,
            local::Options {
                disk: Arc::new(machine.disk.clone()),
                clock: clock.clone(),
                max_backlog: machine.max_backlog,
                stepped: true,
            },
        )
        .map_err(|e| format!("open the order log: {e}"))?;
        let pump = opened.pump.ok_or("a stepped log has a pump")?;
        let memory = MemoryGate::with_clock(opened.log.clone(), clock.clone());
        let gate: Arc<dyn Gate> = Arc::new(SoldOutShortcut::new(Arc::new(memory)));
        let reader = Arc::new(opened.reader);
        let writer = Writer {
            log: reader.clone() as Arc<dyn OrderLog>,
            store: store.clone(),
            gate: gate.clone(),
            batch_max: machine.batch_max,
            stats: Arc::new(WriterStats::default()),
            fenced: false,
            turn: Default::default(),
            linger: std::time::Duration::ZERO,
        };
        let scheduler = Scheduler {
            store: store.clone(),
            gate: gate.clone(),
            cache: Arc::new(SaleCache::default()),
            backlog: Arc::new(opened.log.clone()),
            preload_ahead_ms: 60_000,
        };
        let world = World {
            store,
            gate,
            log: opened.log,
            reader,
            pump,
            writer,
            scheduler,
        };
        world
            .writer
            .drain_recovered(Duration::from_secs(120))
            .await
            .map_err(|e| format!("recovery: {e}"))?;
        if machine.crash.is_down() {
            return Err("died while recovering".into());
        }
        world
            .scheduler
            .tick(Duration::ZERO)
            .await
            .map_err(|e| format!("first scheduler pass: {e}"))?;
        if machine.crash.is_down() {
            return Err("died in the first scheduler pass".into());
        }
        Ok(world)
    }
}

/// A connection of another process holding SQLite's write lock (a backup, an operator's
/// sqlite3): the server's writes fail busy until it lets go.
pub struct Blocker {
    conn: sqlx::AnyConnection,
}

impl Blocker {
    pub async fn take(db_url: &str) -> Blocker {
        use sqlx::Connection;
        let mut conn = sqlx::AnyConnection::connect(db_url)
            .await
            .expect("the blocker connects");
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut conn)
            .await
            .expect("the blocker takes the write lock");
        Blocker { conn }
    }

    pub async fn release(mut self) {
        sqlx::query("COMMIT")
            .execute(&mut self.conn)
            .await
            .expect("the blocker lets go");
        use sqlx::Connection;
        let _ = self.conn.close().await;
    }
}

/// A seeded random source for one part of the simulation, derived from the seed and a
/// name, so that adding draws to one part does not shift the others.
pub fn rng_for(seed: u64, part: &str) -> StdRng {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
    for b in part.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    StdRng::seed_from_u64(h)
}
