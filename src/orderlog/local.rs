//! The embedded order log: an append-only file of accepted orders in a folder of its own
//! (beside a SQLite database, or `--order-log-dir` for PostgreSQL and MySQL), bound to
//! that database. A purchase is answered `ok` once its order is in the file and the
//! file is synced (group commit: every order waiting at that moment, and in a storm those
//! arriving within a short wait after it, share one write and one fsync); the writer then
//! drains the log into SQLite in batches, off the buyers' path. At start-up, orders still
//! in the file are written to SQL before the gate is rebuilt from it
//! (`OrderLog::recovering`, `Writer::drain_recovered`).
//!
//! The file is a sequence of segments; a segment whose every order is settled (in SQL, or
//! a dead letter) is deleted. Each record is an order's six integers and a CRC-32C, so a
//! record torn by a crash is recognised and dropped: it was never answered `ok`. An order
//! bought with an `Idempotency-Key` has a record of the key just before its own.
//!
//! A failed write or sync may have left some of the group's records on disk, and a later
//! start would replay them: so the segment is cut back to its last synced length before the
//! buyers hear "no" (`LogError::WriteFailed`: nothing of theirs will ever be an order). If
//! even that fails, their orders' fate is unknown and they hear so (`LogError::Unconfirmed`,
//! answered `pending`). Either way the log refuses every further order until restart,
//! since the disk is not to be trusted. Without a folder (tools, tests of the parts around
//! it, the SQL gates) orders are kept in memory only; a server that takes orders never
//! runs without a folder. The folder is reached through [`Disk`] (the real file system, or
//! the simulation's).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot};

use super::disk::{Disk, DiskFile, RealDisk};
use super::{Batch, Delivery, LogError, OrderLog, Receipt};
use crate::clock::SharedClock;
use crate::metrics::Histogram;
use crate::model::{NewOrder, RetryKey};

/// A segment takes no more records once it is this large (about 80,000 orders). Settled
/// segments are deleted; a restart replays at most the unsettled orders and the settled
/// rest of the segment being written (skipped by the writer as already in SQL).
const SEGMENT_BYTES: u64 = 4 << 20;
/// Most orders held in memory on their way to SQL; past it, new orders wait for the writer
/// (backpressure), so that a storm of winners faster than SQLite cannot grow memory
/// without bound (about 200 bytes each, measured, and 32 more since an order has room for
/// its `Idempotency-Key`). 50,000 left a 200,000-winner storm at
/// its speed and kept the 1,000,000-buyer sale at 148 MB (200,000: 185 MB).
pub const MAX_BACKLOG: usize = 50_000;
/// How long the writer lets a batch fill before it writes it to SQL.
const LINGER: Duration = Duration::from_millis(50);
/// How long the writer waits for a first order before it reads again.
const IDLE_WAIT: Duration = Duration::from_millis(500);
/// Most orders written and synced together.
const MAX_GROUP: usize = 4096;
/// The longest a group waits for more appends before its write and sync (see
/// [`Appender::run`]).
const MAX_GATHER: Duration = Duration::from_micros(500);
/// Shorter waits are not taken: a thread's sleep overshoots by the kernel's timer slack
/// (50 µs by default), which would be most of such a wait, on a disk whose syncs are fast.
const MIN_GATHER: Duration = Duration::from_micros(50);
const PAYLOAD: usize = 48;
const RECORD: usize = PAYLOAD + 4;
const CRC: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);

/// Why a group was not made durable.
#[derive(Debug, Clone)]
enum Failure {
    /// None of the group's records is on disk, nor ever will be.
    NotWritten(String),
    /// Some of them may be: they may come back at the next start.
    Unknown(String),
}

type Append = (NewOrder, oneshot::Sender<Result<(), Failure>>);

/// The producer half, held by the memory gate.
#[derive(Clone)]
pub struct LocalLog {
    tx: mpsc::UnboundedSender<Append>,
    shared: Arc<Shared>,
}

/// The consumer half, driven by the writer.
pub struct LocalLogReader {
    rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<(NewOrder, u64)>>,
    /// Entries of failed batches, delivered again first and in their order.
    again: Mutex<VecDeque<(NewOrder, u64)>>,
    recovered: AtomicBool,
    /// Every appender is gone and the channel is drained: nothing new can come.
    closed: AtomicBool,
    shared: Arc<Shared>,
}

/// What both halves keep track of.
struct Shared {
    dir: Option<PathBuf>,
    disk: Arc<dyn Disk>,
    clock: SharedClock,
    /// Orders in the log and not yet settled: id -> (sale, user, quantity).
    queued: Mutex<HashMap<i64, (i64, i64, i64)>>,
    /// Most orders `queued` may hold before new ones wait (`MAX_BACKLOG`).
    max_backlog: usize,
    /// Signalled when orders are settled: the appender may be waiting for room.
    room: Condvar,
    /// Segment number -> (orders appended, orders settled).
    segments: Mutex<BTreeMap<u64, (u64, u64)>>,
    /// The segment being appended to; never deleted.
    active: AtomicU64,
    /// The folder's lock, held as long as the log is open.
    _lock: Option<Box<dyn Send + Sync>>,
}

/// How a log is opened.
pub struct Options {
    /// Where the folder is read and written.
    pub disk: Arc<dyn Disk>,
    /// What the reader's waits are measured in.
    pub clock: SharedClock,
    pub max_backlog: usize,
    /// Groups are committed only when [`Pump::commit`] is called, on the caller's thread,
    /// instead of by a thread of the log's own: the simulation decides when, so that a
    /// seed replays the same groups.
    pub stepped: bool,
}

impl Options {
    /// A server's log: the real file system, its own appender thread.
    pub fn new(clock: SharedClock) -> Options {
        Options {
            disk: Arc::new(RealDisk),
            clock,
            max_backlog: MAX_BACKLOG,
            stepped: false,
        }
    }
}

/// An opened log: its two halves, and the pump of a stepped one.
pub struct Opened {
    pub log: LocalLog,
    pub reader: LocalLogReader,
    pub pump: Option<Pump>,
}

/// An in-memory log: nothing survives the process.
pub fn channel() -> (LocalLog, LocalLogReader) {
    let opened = start(
        None,
        None,
        Vec::new(),
        0,
        Options::new(crate::clock::wall()),
    )
    .unwrap_or_else(|_| unreachable!("no file is opened"));
    (opened.log, opened.reader)
}

/// Opens (creating it if needed) the log in `dir` for the database whose id is `owner`, and
/// starts its appender. Orders left in it by an earlier run are delivered to the reader
/// before anything new. A folder holding orders of another database is refused: replaying
/// them here would sell units this database never had.
pub fn open(dir: &Path, owner: &str) -> Result<(LocalLog, LocalLogReader), LogError> {
    let opened = open_with(dir, owner, Options::new(crate::clock::wall()))?;
    Ok((opened.log, opened.reader))
}

/// [`open`] with the disk, clock, backlog and commit mode given.
pub fn open_with(dir: &Path, owner: &str, options: Options) -> Result<Opened, LogError> {
    let disk = options.disk.clone();
    let io =
        |what: &str, e: std::io::Error| LogError::File(format!("{what} {}: {e}", dir.display()));
    disk.create_dir_all(dir)
        .map_err(|e| io("cannot create", e))?;
    let lock = disk
        .lock(dir)
        .map_err(|e| io("cannot open the lock of", e))?
        .ok_or_else(|| {
            LogError::File(format!(
                "{} is in use by another seckill server on the same database",
                dir.display()
            ))
        })?;
    let mut recovered = Vec::new();
    let mut last = 0;
    for (number, path) in segment_files(disk.as_ref(), dir).map_err(|e| io("cannot list", e))? {
        let orders = read_segment(disk.as_ref(), &path).map_err(|e| io("cannot read", e))?;
        if !orders.is_empty() {
            tracing::info!(
                segment = %path.display(),
                orders = orders.len(),
                "orders accepted before this start are in the order log; any not yet in the database are written first"
            );
        }
        recovered.extend(orders.into_iter().map(|o| (o, number)));
        last = number;
    }
    claim(disk.as_ref(), dir, owner, !recovered.is_empty())?;
    start(
        Some(dir.to_path_buf()),
        Some(lock),
        recovered,
        last + 1,
        options,
    )
}

/// Binds the folder to the database `owner`, or refuses it when it holds orders of
/// another database. A folder of an older version (no owner file) is adopted as it is.
fn claim(disk: &dyn Disk, dir: &Path, owner: &str, holds_orders: bool) -> Result<(), LogError> {
    let path = dir.join("database");
    match disk.read(&path) {
        Ok(found) if String::from_utf8_lossy(&found).trim() == owner => return Ok(()),
        Ok(found) if holds_orders => {
            return Err(LogError::File(format!(
                "{} holds accepted orders of another database (id {}; this one is {owner}): \
                 start the server on that database to write them, or give this database its \
                 own --order-log-dir",
                dir.display(),
                String::from_utf8_lossy(&found).trim()
            )))
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(LogError::File(format!(
                "cannot read {}: {e}",
                path.display()
            )))
        }
    }
    disk.write_synced(&path, owner.as_bytes())
        .map_err(|e| LogError::File(format!("cannot write {}: {e}", path.display())))
}

fn start(
    dir: Option<PathBuf>,
    lock: Option<Box<dyn Send + Sync>>,
    recovered: Vec<(NewOrder, u64)>,
    first_segment: u64,
    options: Options,
) -> Result<Opened, LogError> {
    let mut segments = BTreeMap::new();
    let mut queued = HashMap::new();
    for (order, segment) in &recovered {
        segments.entry(*segment).or_insert((0, 0)).0 += 1;
        queued.insert(order.id, (order.sale_id, order.user_id, order.quantity));
    }
    let shared = Arc::new(Shared {
        dir,
        disk: options.disk,
        clock: options.clock,
        queued: Mutex::new(queued),
        max_backlog: options.max_backlog,
        room: Condvar::new(),
        segments: Mutex::new(segments),
        active: AtomicU64::new(first_segment),
        _lock: lock,
    });
    let segment = match &shared.dir {
        Some(dir) => Some(
            Segment::create(shared.disk.as_ref(), dir, first_segment).map_err(|e| {
                LogError::File(format!("cannot create a segment in {}: {e}", dir.display()))
            })?,
        ),
        None => None,
    };
    let (tx, appends) = mpsc::unbounded_channel();
    let (to_reader, rx) = mpsc::unbounded_channel();
    let has_recovered = !recovered.is_empty();
    for entry in recovered {
        let _ = to_reader.send(entry);
    }
    let appender = Appender {
        appends,
        segment,
        shared: shared.clone(),
        to_reader,
        broken: false,
    };
    let pump = if options.stepped {
        Some(Pump(appender))
    } else {
        std::thread::Builder::new()
            .name("seckill-order-log".into())
            .spawn(move || appender.run())
            .map_err(|e| LogError::File(format!("cannot start the order log's thread: {e}")))?;
        None
    };
    Ok(Opened {
        log: LocalLog {
            tx,
            shared: shared.clone(),
        },
        reader: LocalLogReader {
            rx: tokio::sync::Mutex::new(rx),
            again: Mutex::new(VecDeque::new()),
            recovered: AtomicBool::new(has_recovered),
            closed: AtomicBool::new(false),
            shared,
        },
        pump,
    })
}

impl LocalLog {
    /// Appends an order and waits until it is durable. `WriteFailed`: it never will be;
    /// `Unconfirmed`: it may be (a failed write could not be undone).
    pub async fn append(&self, order: NewOrder) -> Result<(), LogError> {
        let (done_tx, done_rx) = oneshot::channel();
        self.tx
            .send((order, done_tx))
            .map_err(|_| LogError::Closed)?;
        match done_rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(Failure::NotWritten(reason))) => Err(LogError::WriteFailed(reason)),
            Ok(Err(Failure::Unknown(reason))) => Err(LogError::Unconfirmed(reason)),
            Err(_) => Err(LogError::Closed),
        }
    }
    /// (user, quantity) of an order of `sale_id` in the log and not yet in SQL.
    pub fn queued(&self, sale_id: i64, order_id: i64) -> Option<(i64, i64)> {
        lock(&self.shared.queued)
            .get(&order_id)
            .filter(|(sale, _, _)| *sale == sale_id)
            .map(|(_, user, quantity)| (*user, *quantity))
    }

    /// (order, sale, quantity) of the orders of `user_id` in the log and not yet in SQL.
    pub fn queued_of_user(&self, user_id: i64) -> Vec<(i64, i64, i64)> {
        lock(&self.shared.queued)
            .iter()
            .filter(|(_, (_, user, _))| *user == user_id)
            .map(|(id, (sale, _, quantity))| (*id, *sale, *quantity))
            .collect()
    }

    /// (user, quantity) of every order of `sale_id` in the log and not yet in SQL.
    pub fn unwritten(&self, sale_id: i64) -> Vec<(i64, i64)> {
        lock(&self.shared.queued)
            .values()
            .filter(|(sale, _, _)| *sale == sale_id)
            .map(|(_, user, quantity)| (*user, *quantity))
            .collect()
    }

    /// Orders of `sale_id` in the log and not yet in SQL.
    pub fn backlog(&self, sale_id: i64) -> i64 {
        lock(&self.shared.queued)
            .values()
            .filter(|(sale, _, _)| *sale == sale_id)
            .count() as i64
    }
}

/// The embedded log keeps its unwritten orders in memory, by order id (at most
/// `MAX_BACKLOG`): every question is answered from there, without I/O.
#[async_trait]
impl super::Backlog for LocalLog {
    fn holds_orders(&self) -> bool {
        true
    }

    async fn counts(&self, sale: i64, _: i64) -> Result<super::Counts, LogError> {
        Ok(super::Counts {
            unwritten: self.backlog(sale),
            ..Default::default()
        })
    }

    async fn unwritten(
        &self,
        sale: i64,
        _: i64,
        _: usize,
    ) -> Result<Option<(Vec<(i64, i64)>, i64)>, LogError> {
        Ok(Some((LocalLog::unwritten(self, sale), 0)))
    }

    async fn queued_of_user(
        &self,
        user: i64,
        _: &[(i64, i64, i64)],
    ) -> Result<Vec<(i64, i64, i64)>, LogError> {
        Ok(LocalLog::queued_of_user(self, user))
    }

    async fn lag(&self, sale: i64, _: i64) -> Result<(i64, Option<i64>), LogError> {
        // This process's own writer drains it; its age is the writer's lag histogram's.
        Ok((self.backlog(sale), None))
    }

    async fn watch(&self, _: &[(i64, i64)]) -> Result<(), LogError> {
        Ok(())
    }
}

impl LocalLogReader {
    /// Marks entries settled (in SQL or dead), and deletes the segments left with none.
    fn settle(&self, receipts: &[Receipt]) {
        let mut done = Vec::new();
        {
            let mut queued = lock(&self.shared.queued);
            let mut segments = lock(&self.shared.segments);
            for r in receipts {
                if let Receipt::Local { order, segment } = r {
                    queued.remove(&order.id);
                    if let Some(counts) = segments.get_mut(segment) {
                        counts.1 += 1;
                        debug_assert!(
                            counts.1 <= counts.0,
                            "segment {segment}: more orders settled than were appended"
                        );
                    }
                }
            }
            let active = self.shared.active.load(Ordering::Acquire);
            segments.retain(|number, (appended, settled)| {
                let finished = *number < active && settled >= appended;
                if finished {
                    done.push(*number);
                }
                !finished
            });
            if queued.is_empty() {
                self.recovered.store(false, Ordering::Release);
            }
        }
        self.shared.room.notify_all();
        if let Some(dir) = &self.shared.dir {
            for number in done {
                if let Err(e) = self.shared.disk.remove(&segment_path(dir, number)) {
                    tracing::warn!(error = %e, segment = number, "cannot delete a settled order log segment");
                }
            }
        }
    }
}

#[async_trait]
impl OrderLog for LocalLogReader {
    async fn next_batch(&self, max: usize) -> Result<Batch, LogError> {
        let mut entries = Vec::new();
        {
            let mut again = lock(&self.again);
            while entries.len() < max {
                match again.pop_front() {
                    Some(entry) => entries.push(entry),
                    None => break,
                }
            }
        }
        let mut rx = self.rx.lock().await;
        if entries.is_empty() {
            let clock = &self.shared.clock;
            // An order that is there wins over the wait (biased): a simulated clock's wait
            // is over at once, and the same seed must read the same batches.
            tokio::select! {
                biased;
                first = rx.recv() => match first {
                    Some(entry) => entries.push(entry),
                    None => {
                        self.closed.store(true, Ordering::Release);
                        return Ok(Batch::default());
                    }
                },
                _ = clock.sleep(IDLE_WAIT) => return Ok(Batch::default()),
            }
        }
        take_ready(&mut rx, &mut entries, max);
        if entries.len() < max {
            // Nobody waits for SQL any more, and SQLite pays per index page a commit
            // touches, not per order: let a storm's orders gather into fewer commits.
            drop(rx);
            self.shared.clock.sleep(LINGER).await;
            take_ready(&mut *self.rx.lock().await, &mut entries, max);
        }
        Ok(Batch {
            capped: entries.len() >= max,
            deliveries: entries
                .into_iter()
                .map(|(order, segment)| Delivery {
                    order: order.clone(),
                    receipt: Receipt::Local { order, segment },
                })
                .collect(),
            malformed: Vec::new(),
        })
    }

    async fn reclaim(&self, _max: usize) -> Result<Batch, LogError> {
        // One reader, and failed batches are delivered again by next_batch.
        Ok(Batch::default())
    }

    async fn ack(&self, receipts: Vec<Receipt>) -> Result<(), LogError> {
        self.settle(&receipts);
        Ok(())
    }

    async fn retry_later(&self, receipts: Vec<Receipt>, _reason: &str) -> Result<(), LogError> {
        let mut again = lock(&self.again);
        for r in receipts.into_iter().rev() {
            if let Receipt::Local { order, segment } = r {
                again.push_front((order, segment));
            }
        }
        Ok(())
    }

    async fn dead_letter(&self, receipt: Receipt, reason: &str) -> Result<(), LogError> {
        if let (Some(dir), Receipt::Local { order, .. }) = (&self.shared.dir, &receipt) {
            let line = serde_json::json!({
                "order_id": order.id.to_string(),
                "sale_id": order.sale_id.to_string(),
                "user_id": order.user_id.to_string(),
                "quantity": order.quantity,
                "price_cents": order.price_cents,
                "accepted_at": order.accepted_at,
                "reason": reason,
            });
            let written = self.shared.disk.append_synced(
                &dir.join("dead-letters.jsonl"),
                format!("{line}\n").as_bytes(),
            );
            if let Err(e) = written {
                // Kept in the log, to be tried again, rather than lost.
                tracing::error!(error = %e, order = order.id, "cannot record a dead letter");
                return Err(LogError::File(e.to_string()));
            }
        }
        self.settle(std::slice::from_ref(&receipt));
        Ok(())
    }

    /// Closed and drained: no appender is left, and no failed batch waits to be tried again.
    /// (Until then a closed channel answers every read at once, empty: a writer that kept
    /// reading would spin.)
    fn finished(&self) -> bool {
        self.closed.load(Ordering::Acquire) && lock(&self.again).is_empty()
    }

    fn recovering(&self) -> bool {
        self.recovered.load(Ordering::Acquire)
    }
}

fn take_ready(
    rx: &mut mpsc::UnboundedReceiver<(NewOrder, u64)>,
    entries: &mut Vec<(NewOrder, u64)>,
    max: usize,
) {
    while entries.len() < max {
        match rx.try_recv() {
            Ok(entry) => entries.push(entry),
            Err(_) => break,
        }
    }
}

/// The appender: blocking writes and syncs, on a thread of its own (never on the runtime's
/// threads), or stepped by a [`Pump`].
struct Appender {
    appends: mpsc::UnboundedReceiver<Append>,
    segment: Option<Segment>,
    shared: Arc<Shared>,
    to_reader: mpsc::UnboundedSender<(NewOrder, u64)>,
    broken: bool,
}

impl Appender {
    fn run(mut self) {
        let mut group = Vec::with_capacity(MAX_GROUP);
        let mut last_commit = Duration::ZERO;
        while let Some(first) = self.appends.blocking_recv() {
            group.push(first);
            self.take_waiting(&mut group, MAX_GROUP);
            // Appends arriving together (a storm) wait a quarter of the last commit's
            // length (MIN_GATHER to MAX_GATHER) for more to join them: a sync costs the
            // process CPU whatever the group's size. In a winners storm on a virtual disk
            // (commits of about 0.35 ms) groups grew from 19 to 25-32 orders and a winner
            // cost about 5% less CPU. A lone append (a quiet
            // sale) is written at once, and a log without a file never waits.
            let gather = (last_commit / 4).min(MAX_GATHER);
            let durable = self.segment.is_some() && !self.broken;
            if durable && gather >= MIN_GATHER && group.len() > 1 && group.len() < MAX_GROUP {
                std::thread::sleep(gather);
                self.take_waiting(&mut group, MAX_GROUP);
            }
            self.wait_for_room(group.len());
            let started = std::time::Instant::now();
            self.commit(&mut group);
            last_commit = started.elapsed();
        }
    }

    /// Adds the appends waiting now to `group`, up to `limit` in all.
    fn take_waiting(&mut self, group: &mut Vec<Append>, limit: usize) {
        while group.len() < limit {
            match self.appends.try_recv() {
                Ok(next) => group.push(next),
                Err(_) => break,
            }
        }
    }

    /// Waits until the writer has settled enough orders to take `incoming` more.
    fn wait_for_room(&self, incoming: usize) {
        let mut queued = lock(&self.shared.queued);
        while !queued.is_empty() && queued.len() + incoming > self.shared.max_backlog {
            queued = self
                .shared
                .room
                .wait(queued)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// How many more orders the backlog takes now (at least one when it is empty).
    fn room(&self) -> usize {
        let queued = lock(&self.shared.queued).len();
        if queued == 0 {
            self.shared.max_backlog.max(1)
        } else {
            self.shared.max_backlog.saturating_sub(queued)
        }
    }

    /// Writes and syncs the group, then answers each of its buyers.
    fn commit(&mut self, group: &mut Vec<Append>) {
        let mut buf = Vec::with_capacity(group.len() * RECORD);
        match self.write(group, &mut buf) {
            Ok(segment) => self.accept(group.drain(..), segment),
            Err(failure) => {
                for (_, done) in group.drain(..) {
                    let _ = done.send(Err(failure.clone()));
                }
            }
        }
    }

    /// Writes and syncs the group; the segment its records are in.
    fn write(&mut self, group: &[Append], buf: &mut Vec<u8>) -> Result<u64, Failure> {
        if self.broken {
            return Err(Failure::NotWritten(
                "the order log failed earlier; restart to recover it".into(),
            ));
        }
        let Some(segment) = &mut self.segment else {
            return Ok(0);
        };
        for (order, _) in group {
            encode(order, buf);
        }
        let written = segment.append(buf, self.shared.disk.as_ref(), self.shared.dir.as_deref());
        match written {
            Ok(number) => {
                self.shared.active.store(segment.number, Ordering::Release);
                Ok(number)
            }
            Err(failure) => {
                tracing::error!(
                    ?failure,
                    "the order log cannot be written; refusing orders until restart"
                );
                self.broken = true;
                Err(failure)
            }
        }
    }

    /// The group is durable: make it visible as queued, hand it to the writer, answer.
    fn accept(&self, group: impl Iterator<Item = Append>, segment: u64) {
        let group: Vec<Append> = group.collect();
        {
            let mut queued = lock(&self.shared.queued);
            for (o, _) in &group {
                queued.insert(o.id, (o.sale_id, o.user_id, o.quantity));
            }
            lock(&self.shared.segments)
                .entry(segment)
                .or_insert((0, 0))
                .0 += group.len() as u64;
        }
        for (order, done) in group {
            let _ = self.to_reader.send((order, segment));
            let _ = done.send(Ok(()));
        }
    }
}

/// The appender of a stepped log (`Options::stepped`): nothing is written until
/// [`Pump::commit`] is called.
pub struct Pump(Appender);

impl Pump {
    /// Writes and syncs the appends waiting now as one group (as many as the backlog has
    /// room for) and answers their buyers, on this thread; how many were in it.
    pub fn commit(&mut self) -> usize {
        let room = self.0.room().min(MAX_GROUP);
        let mut group = Vec::new();
        self.0.take_waiting(&mut group, room);
        let taken = group.len();
        if taken > 0 {
            self.0.commit(&mut group);
        }
        taken
    }

    /// Appends waiting for a commit.
    pub fn waiting(&self) -> usize {
        self.0.appends.len()
    }
}

/// How long each group commit (write and sync) of this process's order logs took: every
/// purchase of the group waited that long, so a disk's stalls show here first.
static COMMIT_SECONDS: LazyLock<Histogram> =
    LazyLock::new(|| Histogram::new(crate::metrics::LATENCY_BUCKETS));

/// The order log's group commits, in Prometheus text.
pub fn render_metrics(out: &mut String) {
    COMMIT_SECONDS.render(
        "seckill_order_log_commit_seconds",
        "Embedded order log group commits (write and fsync), each answering every purchase in its group.",
        out,
    );
}

/// The segment being appended to.
struct Segment {
    number: u64,
    file: Box<dyn DiskFile>,
    len: u64,
}

impl Segment {
    fn create(disk: &dyn Disk, dir: &Path, number: u64) -> std::io::Result<Segment> {
        Ok(Segment {
            number,
            file: disk.create_new(&segment_path(dir, number))?,
            len: 0,
        })
    }

    /// Appends `records` durably, in a new segment if this one is full; its number. On a
    /// failure, cuts the segment back to its last durable length, so that none of the
    /// records can come back at the next start; `Unknown` when even that failed.
    fn append(
        &mut self,
        records: &[u8],
        disk: &dyn Disk,
        dir: Option<&Path>,
    ) -> Result<u64, Failure> {
        // A new segment's creation (a directory sync) is waited for by the group too.
        let started = std::time::Instant::now();
        if self.len >= SEGMENT_BYTES {
            if let Some(dir) = dir {
                *self = Segment::create(disk, dir, self.number + 1)
                    .map_err(|e| Failure::NotWritten(format!("cannot start a segment: {e}")))?;
            }
        }
        let written = self.file.append(records).and_then(|()| self.file.sync());
        COMMIT_SECONDS.observe(started.elapsed().as_secs_f64());
        match written {
            Ok(()) => {
                self.len += records.len() as u64;
                Ok(self.number)
            }
            Err(e) => match self.file.truncate_synced(self.len) {
                Ok(()) => Err(Failure::NotWritten(format!("the order log cannot be written: {e}"))),
                Err(cut) => Err(Failure::Unknown(format!(
                    "the order log cannot be written ({e}) nor cut back ({cut}): these orders may come back at the next start"
                ))),
            },
        }
    }
}

fn segment_path(dir: &Path, number: u64) -> PathBuf {
    dir.join(format!("{number:016}.log"))
}

/// The segments in `dir`, oldest first.
fn segment_files(disk: &dyn Disk, dir: &Path) -> std::io::Result<Vec<(u64, PathBuf)>> {
    let mut found = Vec::new();
    for path in disk.list(dir)? {
        let number = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".log"))
            .and_then(|n| n.parse::<u64>().ok());
        if let Some(number) = number {
            found.push((number, path));
        }
    }
    found.sort();
    Ok(found)
}

/// The whole records of a segment, up to the first torn or damaged one.
fn read_segment(disk: &dyn Disk, path: &Path) -> std::io::Result<Vec<NewOrder>> {
    let bytes = disk.read(path)?;
    let mut orders = Vec::with_capacity(bytes.len() / RECORD);
    let mut key = None;
    for (n, record) in bytes.chunks(RECORD).enumerate() {
        match decode(record) {
            Some(Record::Key { order_id, key: k }) => key = Some((order_id, k)),
            Some(Record::Order(mut order)) => {
                order.retry_key = key.take().filter(|(id, _)| *id == order.id).map(|(_, k)| k);
                orders.push(order);
            }
            None => {
                tracing::warn!(
                    segment = %path.display(),
                    kept = orders.len(),
                    dropped_bytes = bytes.len() - n * RECORD,
                    "order log segment ends in a torn or damaged record; the rest was never acknowledged"
                );
                break;
            }
        }
    }
    Ok(orders)
}

/// Marks a record that carries the `Idempotency-Key` of the order in the record after it
/// (an order's id is never negative). Written before its order, so that an order read
/// whole has its key whole: a crash tears a segment's end, never its middle. A segment of a
/// version without keys holds no such record and reads as it did.
const KEY_RECORD: i64 = i64::MIN;

/// A record of the log, as read back.
#[derive(Debug, PartialEq)]
enum Record {
    Order(NewOrder),
    Key { order_id: i64, key: RetryKey },
}

fn fields(o: &NewOrder) -> [i64; 6] {
    [
        o.id,
        o.sale_id,
        o.user_id,
        o.quantity,
        o.price_cents,
        o.accepted_at,
    ]
}

fn encode(o: &NewOrder, out: &mut Vec<u8>) {
    if let Some(key) = o.retry_key {
        // Bit-for-bit: the key's two halves in two signed fields.
        let (high, low) = ((key.0 >> 64) as u64 as i64, key.0 as u64 as i64);
        seal([KEY_RECORD, o.id, high, low, 0, 0], out);
    }
    seal(fields(o), out);
}

fn seal(fields: [i64; 6], out: &mut Vec<u8>) {
    let start = out.len();
    for f in fields {
        out.extend_from_slice(&f.to_le_bytes());
    }
    let crc = CRC.checksum(&out[start..]);
    out.extend_from_slice(&crc.to_le_bytes());
}

fn decode(record: &[u8]) -> Option<Record> {
    if record.len() != RECORD {
        return None;
    }
    let (payload, crc) = record.split_at(PAYLOAD);
    if CRC.checksum(payload).to_le_bytes() != crc {
        return None;
    }
    let mut f = payload
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])));
    let mut next = || f.next().unwrap_or_default();
    let first = next();
    if first == KEY_RECORD {
        let order_id = next();
        let (high, low) = (next() as u64 as u128, next() as u64 as u128);
        return Some(Record::Key {
            order_id,
            key: RetryKey(high << 64 | low),
        });
    }
    Some(Record::Order(NewOrder {
        id: first,
        sale_id: next(),
        user_id: next(),
        quantity: next(),
        price_cents: next(),
        accepted_at: next(),
        retry_key: None,
    }))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(id: i64) -> NewOrder {
        NewOrder {
            id,
            sale_id: 7,
            user_id: 1000 + id,
            quantity: 1,
            price_cents: 999,
            accepted_at: 1_700_000_000_000 + id,
            retry_key: None,
        }
    }

    fn temp_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("seckill-log-{:016x}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    async fn drain(reader: &LocalLogReader) -> Vec<Receipt> {
        let mut receipts = Vec::new();
        loop {
            let batch = reader.next_batch(1000).await.unwrap();
            if batch.is_empty() {
                return receipts;
            }
            receipts.extend(batch.deliveries.into_iter().map(|d| d.receipt));
        }
    }

    fn ids(receipts: &[Receipt]) -> Vec<i64> {
        receipts
            .iter()
            .map(|r| match r {
                Receipt::Local { order, .. } => order.id,
                other => panic!("{other:?}"),
            })
            .collect()
    }

    /// A log whose appenders are all gone is finished once drained, and not before: a
    /// writer reading it stops instead of being answered "empty" at once, for ever (the SQL
    /// gates' deployments had such a writer spinning on a core while idle).
    #[tokio::test]
    async fn a_closed_log_is_finished_once_drained_and_not_before() {
        let (log, reader) = channel();
        for id in 1..=3 {
            log.append(order(id)).await.unwrap();
        }
        drop(log);
        let first = reader.next_batch(2).await.unwrap();
        assert_eq!(first.deliveries.len(), 2);
        let receipts: Vec<Receipt> = first.deliveries.into_iter().map(|d| d.receipt).collect();
        reader.retry_later(receipts, "test").await.unwrap();
        let mut delivered = Vec::new();
        for _ in 0..20 {
            let batch = reader.next_batch(1000).await.unwrap();
            delivered.extend(batch.deliveries.into_iter().map(|d| d.receipt));
            if reader.finished() {
                break;
            }
        }
        assert_eq!(
            ids(&delivered),
            vec![1, 2, 3],
            "the retried first, then the rest"
        );
        assert!(reader.finished());
        // Closed, but a failed batch waits to be tried again: not finished until it is read.
        reader.retry_later(delivered, "test").await.unwrap();
        assert!(!reader.finished(), "a batch to try again");
        let again = reader.next_batch(1000).await.unwrap();
        assert_eq!(again.deliveries.len(), 3);
        assert!(reader.finished());
        let receipts: Vec<Receipt> = again.deliveries.into_iter().map(|d| d.receipt).collect();
        reader.ack(receipts).await.unwrap();
        assert!(reader.next_batch(1000).await.unwrap().is_empty());
        assert!(reader.finished());
    }

    #[tokio::test]
    async fn what_was_answered_survives_a_stop_and_is_gone_once_settled() {
        let dir = temp_dir();
        {
            let (log, reader) = open(&dir, "test-db").unwrap();
            for id in 1..=5 {
                log.append(order(id)).await.unwrap();
            }
            assert_eq!(log.queued(7, 3), Some((1003, 1)), "queued until settled");
            assert_eq!(log.queued_of_user(1003), [(3, 7, 1)]);
            assert_eq!(
                log.queued(8, 3),
                None,
                "another sale's order is not this one"
            );
            assert_eq!(log.backlog(7), 5);
            // Two are settled, three are not when the process "dies".
            let receipts = drain(&reader).await;
            assert_eq!(ids(&receipts), [1, 2, 3, 4, 5]);
            reader
                .ack(receipts.into_iter().take(2).collect())
                .await
                .unwrap();
            assert_eq!(log.backlog(7), 3);
            assert!(
                open(&dir, "test-db").is_err(),
                "a second server may not open a log in use"
            );
        }
        // Nothing is ever rewritten: the whole segment comes back, settled orders
        // included (the writer skips orders already in SQL). The lock goes with the
        // appender thread, which ends once it sees the last producer gone.
        let mut reopened = open(&dir, "test-db");
        for _ in 0..100 {
            if reopened.is_ok() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            reopened = open(&dir, "test-db");
        }
        let (log, reader) = reopened.unwrap();
        assert!(reader.recovering());
        let receipts = drain(&reader).await;
        assert_eq!(ids(&receipts), [1, 2, 3, 4, 5]);
        reader.ack(receipts).await.unwrap();
        assert!(!reader.recovering());
        assert_eq!(log.backlog(7), 0);
        let left: Vec<_> = segment_files(&RealDisk, &dir).unwrap();
        assert_eq!(
            left.len(),
            1,
            "the settled old segment is deleted: {left:?}"
        );
        log.append(order(6)).await.unwrap();
        drop((log, reader));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Opens `dir` for `owner`, waiting for the appender of an earlier open to let go.
    async fn reopen(dir: &Path, owner: &str) -> Result<(LocalLog, LocalLogReader), LogError> {
        for _ in 0..100 {
            match open(dir, owner) {
                Err(LogError::File(e)) if e.contains("in use") => {
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await
                }
                other => return other,
            }
        }
        open(dir, owner)
    }

    #[tokio::test]
    async fn orders_of_one_database_are_never_replayed_into_another() {
        let dir = temp_dir();
        {
            let (log, _reader) = open(&dir, "db-a").unwrap();
            log.append(order(1)).await.unwrap();
        }
        match reopen(&dir, "db-b").await {
            Err(LogError::File(e)) => assert!(e.contains("another database"), "{e}"),
            Ok(_) => panic!("a log holding db-a's orders was opened for db-b"),
            Err(e) => panic!("{e}"),
        }
        // Its own database still gets them back; once settled, the folder may change hands.
        {
            let (_log, reader) = reopen(&dir, "db-a").await.unwrap();
            let receipts = drain(&reader).await;
            assert_eq!(ids(&receipts), [1]);
            reader.ack(receipts).await.unwrap();
        }
        let (log, reader) = reopen(&dir, "db-b").await.unwrap();
        assert!(!reader.recovering());
        drop((log, reader));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_torn_last_record_is_dropped_and_the_rest_kept() {
        let dir = temp_dir();
        {
            let (log, _reader) = open(&dir, "test-db").unwrap();
            for id in 1..=3 {
                log.append(order(id)).await.unwrap();
            }
        }
        let (_, path) = segment_files(&RealDisk, &dir).unwrap().pop().unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        // A crash in the middle of writing a fourth record, and a bit flipped in the third.
        let mut torn = Vec::new();
        encode(&order(4), &mut torn);
        bytes.extend_from_slice(&torn[..20]);
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(
            read_segment(&RealDisk, &path)
                .unwrap()
                .iter()
                .map(|o| o.id)
                .collect::<Vec<_>>(),
            [1, 2, 3]
        );
        bytes[2 * RECORD + 5] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(
            read_segment(&RealDisk, &path).unwrap(),
            [order(1), order(2)],
            "a damaged record ends what is read"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn past_the_backlog_limit_new_orders_wait_for_the_writer() {
        let dir = temp_dir();
        let options = Options {
            max_backlog: 2,
            ..Options::new(crate::clock::wall())
        };
        let Opened { log, reader, .. } = open_with(&dir, "test-db", options).unwrap();
        log.append(order(1)).await.unwrap();
        log.append(order(2)).await.unwrap();
        let third = tokio::spawn({
            let log = log.clone();
            async move { log.append(order(3)).await }
        });
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert!(
            !third.is_finished(),
            "two orders wait for SQL: the third must wait"
        );
        let receipts = drain(&reader).await;
        assert_eq!(ids(&receipts), [1, 2]);
        reader.ack(receipts).await.unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(5), third)
            .await
            .expect("room was made")
            .unwrap()
            .unwrap();
        assert_eq!(log.backlog(7), 1);
        drop((log, reader));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The real file system, whose appends are written but whose syncs fail, and whose
    /// cut-backs fail too when `cut_fails`: a disk going bad under the log.
    struct FailingSync {
        cut_fails: bool,
    }

    struct FailingFile {
        inner: Box<dyn DiskFile>,
        cut_fails: bool,
    }

    impl DiskFile for FailingFile {
        fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
            self.inner.append(bytes)
        }
        fn sync(&mut self) -> std::io::Result<()> {
            Err(std::io::Error::other("EIO"))
        }
        fn truncate_synced(&mut self, len: u64) -> std::io::Result<()> {
            if self.cut_fails {
                return Err(std::io::Error::other("EIO again"));
            }
            self.inner.truncate_synced(len)
        }
    }

    impl Disk for FailingSync {
        fn create_dir_all(&self, dir: &Path) -> std::io::Result<()> {
            RealDisk.create_dir_all(dir)
        }
        fn lock(&self, dir: &Path) -> std::io::Result<Option<Box<dyn Send + Sync>>> {
            RealDisk.lock(dir)
        }
        fn list(&self, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
            RealDisk.list(dir)
        }
        fn read(&self, path: &Path) -> std::io::Result<Vec<u8>> {
            RealDisk.read(path)
        }
        fn create_new(&self, path: &Path) -> std::io::Result<Box<dyn DiskFile>> {
            Ok(Box::new(FailingFile {
                inner: RealDisk.create_new(path)?,
                cut_fails: self.cut_fails,
            }))
        }
        fn write_synced(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
            RealDisk.write_synced(path, bytes)
        }
        fn append_synced(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
            RealDisk.append_synced(path, bytes)
        }
        fn remove(&self, path: &Path) -> std::io::Result<()> {
            RealDisk.remove(path)
        }
    }

    /// A buyer told "no" after a failed sync must never get the order at the next start
    /// (the records had reached the file): the segment is cut back first. When it cannot
    /// be, the buyer hears that the order may exist, and it does come back.
    #[tokio::test]
    async fn a_failed_write_is_undone_before_no_is_said_or_else_says_maybe() {
        for cut_fails in [false, true] {
            let dir = temp_dir();
            let options = Options {
                disk: Arc::new(FailingSync { cut_fails }),
                stepped: true,
                ..Options::new(crate::clock::wall())
            };
            let Opened { log, reader, pump } = open_with(&dir, "test-db", options).unwrap();
            let mut pump = pump.unwrap();
            let first = tokio::spawn({
                let log = log.clone();
                async move { log.append(order(1)).await }
            });
            while pump.waiting() == 0 {
                tokio::task::yield_now().await;
            }
            assert_eq!(pump.commit(), 1);
            match (first.await.unwrap(), cut_fails) {
                (Err(LogError::WriteFailed(_)), false) | (Err(LogError::Unconfirmed(_)), true) => {}
                (other, _) => panic!("cut_fails {cut_fails}: {other:?}"),
            }
            let second = tokio::spawn({
                let log = log.clone();
                async move { log.append(order(2)).await }
            });
            while pump.waiting() == 0 {
                tokio::task::yield_now().await;
            }
            pump.commit();
            assert!(
                matches!(second.await.unwrap(), Err(LogError::WriteFailed(_))),
                "refused until restart"
            );
            drop((log, reader, pump));
            let (_log, reader) = open(&dir, "test-db").unwrap();
            let came_back = ids(&drain(&reader).await);
            let expected: &[i64] = if cut_fails { &[1] } else { &[] };
            assert_eq!(came_back, expected, "cut_fails {cut_fails}");
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    #[test]
    fn records_round_trip() {
        let mut buf = Vec::new();
        let o = NewOrder {
            id: i64::MAX,
            sale_id: 1,
            user_id: -1,
            quantity: 3,
            price_cents: 0,
            accepted_at: i64::MIN,
            retry_key: None,
        };
        encode(&o, &mut buf);
        assert_eq!(buf.len(), RECORD);
        assert_eq!(decode(&buf), Some(Record::Order(o.clone())));
        assert_eq!(decode(&buf[..RECORD - 1]), None);
        let key = RetryKey(u128::MAX - 1);
        let mut buf = Vec::new();
        encode(
            &NewOrder {
                retry_key: Some(key),
                ..o.clone()
            },
            &mut buf,
        );
        assert_eq!(
            decode(&buf[..RECORD]),
            Some(Record::Key {
                order_id: o.id,
                key
            })
        );
        assert_eq!(decode(&buf[RECORD..]), Some(Record::Order(o)));
    }

    #[tokio::test]
    async fn an_orders_idempotency_key_comes_back_with_it_and_a_torn_order_leaves_it() {
        let dir = temp_dir();
        let keyed = |id: i64, key: u128| NewOrder {
            retry_key: Some(RetryKey(key)),
            ..order(id)
        };
        let written = [
            keyed(1, u128::MAX),
            order(2),
            keyed(3, 1 << 127 | 5),
            keyed(4, 6),
            keyed(5, 7),
        ];
        {
            let (log, _reader) = open(&dir, "test-db").unwrap();
            // Appended at once: keyed orders side by side in one group.
            let appends = written.iter().map(|o| log.append(o.clone()));
            for appended in futures_util::future::join_all(appends).await {
                appended.unwrap();
            }
        }
        // What a restart hands the writer: each order with its key.
        let (log, reader) = reopen(&dir, "test-db").await.unwrap();
        let mut came_back: Vec<NewOrder> = drain(&reader)
            .await
            .into_iter()
            .map(|r| match r {
                Receipt::Local { order, .. } => order,
                other => panic!("{other:?}"),
            })
            .collect();
        came_back.sort_by_key(|o| o.id);
        assert_eq!(came_back, written);
        drop((log, reader));

        let (_, path) = segment_files(&RealDisk, &dir).unwrap().pop().unwrap();
        let read = read_segment(&RealDisk, &path).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        // A key record whose order is not the next record is no one's key.
        let mut stray = Vec::new();
        encode(&keyed(6, 8), &mut stray);
        encode(&order(7), &mut stray);
        bytes.extend_from_slice(&stray[..RECORD]);
        bytes.extend_from_slice(&stray[2 * RECORD..]);
        // Then a crash after an eighth order's key record, within its order record.
        let mut torn = Vec::new();
        encode(&keyed(8, 9), &mut torn);
        assert_eq!(torn.len(), 2 * RECORD);
        bytes.extend_from_slice(&torn[..RECORD + 30]);
        std::fs::write(&path, &bytes).unwrap();
        let mut expected = read.clone();
        expected.push(order(7));
        assert_eq!(read_segment(&RealDisk, &path).unwrap(), expected);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
