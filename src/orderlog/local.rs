//! The embedded order log: an append-only file of accepted orders in a folder of its own
//! (beside a SQLite database, or `--order-log-dir` for PostgreSQL and MySQL), bound to
//! that database. A purchase is answered `ok` once its order is in the file and the
//! file is synced (group commit: every order waiting at that moment shares one write and
//! one fsync); the writer then drains the log into SQLite in batches, off the buyers'
//! path. At start-up, orders still in the file are written to SQL before the gate is
//! rebuilt from it (`OrderLog::recovering`, `Writer::drain_recovered`).
//!
//! The file is a sequence of segments; a segment whose every order is settled (in SQL, or
//! a dead letter) is deleted. Each record is an order's six integers and a CRC-32C, so a
//! record torn by a crash is recognised and dropped: it was never answered `ok`. After a
//! failed write or sync the log refuses every further order until restart, since the fate
//! of the failed records on disk is unknown. Without a folder (tools, tests of the parts
//! around it, the SQL gates) orders are kept in memory only; a server that takes orders never runs without a folder.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot};

use super::{Batch, Delivery, LogError, OrderLog, Receipt};
use crate::model::NewOrder;

/// A segment takes no more records once it is this large (about 80,000 orders). Settled
/// segments are deleted; a restart replays at most the unsettled orders and the settled
/// rest of the segment being written (skipped by the writer as already in SQL).
const SEGMENT_BYTES: u64 = 4 << 20;
/// Most orders held in memory on their way to SQL; past it, new orders wait for the writer
/// (backpressure), so that a storm of winners faster than SQLite cannot grow memory
/// without bound (about 200 bytes each, measured). 50,000 left a 200,000-winner storm at
/// its speed and kept the 1,000,000-buyer sale at 148 MB (200,000: 185 MB).
const MAX_BACKLOG: usize = 50_000;
/// How long the writer lets a batch fill before it writes it to SQL.
const LINGER: std::time::Duration = std::time::Duration::from_millis(50);
/// Most orders written and synced together.
const MAX_GROUP: usize = 4096;
const PAYLOAD: usize = 48;
const RECORD: usize = PAYLOAD + 4;
const CRC: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);

type Append = (NewOrder, oneshot::Sender<Result<(), String>>);

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
    shared: Arc<Shared>,
}

/// What both halves keep track of.
struct Shared {
    dir: Option<PathBuf>,
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
    _lock: Option<File>,
}

/// An in-memory log: nothing survives the process.
pub fn channel() -> (LocalLog, LocalLogReader) {
    start(None, None, Vec::new(), 0, MAX_BACKLOG)
        .unwrap_or_else(|_| unreachable!("no file is opened"))
}

/// Opens (creating it if needed) the log in `dir` for the database whose id is `owner`, and
/// starts its appender. Orders left in it by an earlier run are delivered to the reader
/// before anything new. A folder holding orders of another database is refused: replaying
/// them here would sell units this database never had.
pub fn open(dir: &Path, owner: &str) -> Result<(LocalLog, LocalLogReader), LogError> {
    open_with_limit(dir, owner, MAX_BACKLOG)
}

fn open_with_limit(
    dir: &Path,
    owner: &str,
    max_backlog: usize,
) -> Result<(LocalLog, LocalLogReader), LogError> {
    let io =
        |what: &str, e: std::io::Error| LogError::File(format!("{what} {}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(|e| io("cannot create", e))?;
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("lock"))
        .map_err(|e| io("cannot open the lock of", e))?;
    lock.try_lock().map_err(|_| {
        LogError::File(format!(
            "{} is in use by another seckill server on the same database",
            dir.display()
        ))
    })?;
    let mut recovered = Vec::new();
    let mut last = 0;
    for (number, path) in segment_files(dir).map_err(|e| io("cannot list", e))? {
        let orders = read_segment(&path).map_err(|e| io("cannot read", e))?;
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
    claim(dir, owner, !recovered.is_empty())?;
    start(
        Some(dir.to_path_buf()),
        Some(lock),
        recovered,
        last + 1,
        max_backlog,
    )
}

/// Binds the folder to the database `owner`, or refuses it when it holds orders of
/// another database. A folder of an older version (no owner file) is adopted as it is.
fn claim(dir: &Path, owner: &str, holds_orders: bool) -> Result<(), LogError> {
    let path = dir.join("database");
    match std::fs::read_to_string(&path) {
        Ok(found) if found.trim() == owner => return Ok(()),
        Ok(found) if holds_orders => {
            return Err(LogError::File(format!(
                "{} holds accepted orders of another database (id {}; this one is {owner}): \
                 start the server on that database to write them, or give this database its \
                 own --order-log-dir",
                dir.display(),
                found.trim()
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
    let write = || -> std::io::Result<()> {
        let mut f = File::create(&path)?;
        f.write_all(owner.as_bytes())?;
        f.sync_all()?;
        File::open(dir)?.sync_all()
    };
    write().map_err(|e| LogError::File(format!("cannot write {}: {e}", path.display())))
}

fn start(
    dir: Option<PathBuf>,
    lock: Option<File>,
    recovered: Vec<(NewOrder, u64)>,
    first_segment: u64,
    max_backlog: usize,
) -> Result<(LocalLog, LocalLogReader), LogError> {
    let mut segments = BTreeMap::new();
    let mut queued = HashMap::new();
    for (order, segment) in &recovered {
        segments.entry(*segment).or_insert((0, 0)).0 += 1;
        queued.insert(order.id, (order.sale_id, order.user_id, order.quantity));
    }
    let shared = Arc::new(Shared {
        dir,
        queued: Mutex::new(queued),
        max_backlog,
        room: Condvar::new(),
        segments: Mutex::new(segments),
        active: AtomicU64::new(first_segment),
        _lock: lock,
    });
    let segment = match &shared.dir {
        Some(dir) => Some(Segment::create(dir, first_segment).map_err(|e| {
            LogError::File(format!("cannot create a segment in {}: {e}", dir.display()))
        })?),
        None => None,
    };
    let (tx, appends) = mpsc::unbounded_channel();
    let (to_reader, rx) = mpsc::unbounded_channel();
    let has_recovered = !recovered.is_empty();
    for entry in recovered {
        let _ = to_reader.send(entry);
    }
    let appender = Appender {
        segment,
        shared: shared.clone(),
        to_reader,
        broken: false,
    };
    std::thread::Builder::new()
        .name("seckill-order-log".into())
        .spawn(move || appender.run(appends))
        .map_err(|e| LogError::File(format!("cannot start the order log's thread: {e}")))?;
    Ok((
        LocalLog {
            tx,
            shared: shared.clone(),
        },
        LocalLogReader {
            rx: tokio::sync::Mutex::new(rx),
            again: Mutex::new(VecDeque::new()),
            recovered: AtomicBool::new(has_recovered),
            shared,
        },
    ))
}

impl LocalLog {
    /// Appends an order and waits until it is durable.
    pub async fn append(&self, order: NewOrder) -> Result<(), LogError> {
        let (done_tx, done_rx) = oneshot::channel();
        self.tx
            .send((order, done_tx))
            .map_err(|_| LogError::Closed)?;
        match done_rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(reason)) => Err(LogError::WriteFailed(reason)),
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
                if let Err(e) = std::fs::remove_file(segment_path(dir, number)) {
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
            let first =
                tokio::time::timeout(std::time::Duration::from_millis(500), rx.recv()).await;
            match first {
                Ok(Some(entry)) => entries.push(entry),
                Ok(None) | Err(_) => return Ok(Batch::default()),
            }
        }
        take_ready(&mut rx, &mut entries, max);
        if entries.len() < max {
            // Nobody waits for SQL any more, and SQLite pays per index page a commit
            // touches, not per order: let a storm's orders gather into fewer commits.
            drop(rx);
            tokio::time::sleep(LINGER).await;
            take_ready(&mut *self.rx.lock().await, &mut entries, max);
        }
        Ok(Batch {
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
            let written = OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join("dead-letters.jsonl"))
                .and_then(|mut f| writeln!(f, "{line}").and_then(|()| f.sync_data()));
            if let Err(e) = written {
                // Kept in the log, to be tried again, rather than lost.
                tracing::error!(error = %e, order = order.id, "cannot record a dead letter");
                return Err(LogError::File(e.to_string()));
            }
        }
        self.settle(std::slice::from_ref(&receipt));
        Ok(())
    }

    fn finished(&self) -> bool {
        false
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

/// The appender thread: blocking writes and syncs, never on the runtime's threads.
struct Appender {
    segment: Option<Segment>,
    shared: Arc<Shared>,
    to_reader: mpsc::UnboundedSender<(NewOrder, u64)>,
    broken: bool,
}

impl Appender {
    fn run(mut self, mut appends: mpsc::UnboundedReceiver<Append>) {
        let mut group = Vec::with_capacity(MAX_GROUP);
        let mut buf = Vec::with_capacity(MAX_GROUP * RECORD);
        while let Some(first) = appends.blocking_recv() {
            group.push(first);
            while group.len() < MAX_GROUP {
                match appends.try_recv() {
                    Ok(next) => group.push(next),
                    Err(_) => break,
                }
            }
            self.wait_for_room(group.len());
            match self.write(&group, &mut buf) {
                Ok(segment) => self.accept(group.drain(..), segment),
                Err(reason) => {
                    for (_, done) in group.drain(..) {
                        let _ = done.send(Err(reason.clone()));
                    }
                }
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

    /// Writes and syncs the group; the segment its records are in.
    fn write(&mut self, group: &[Append], buf: &mut Vec<u8>) -> Result<u64, String> {
        if self.broken {
            return Err("the order log failed earlier; restart to recover it".into());
        }
        let Some(segment) = &mut self.segment else {
            return Ok(0);
        };
        buf.clear();
        for (order, _) in group {
            encode(order, buf);
        }
        let written = segment.append(buf, self.shared.dir.as_deref());
        match written {
            Ok(number) => {
                self.shared.active.store(segment.number, Ordering::Release);
                Ok(number)
            }
            Err(e) => {
                tracing::error!(error = %e, "the order log cannot be written; refusing orders");
                self.broken = true;
                Err(format!("the order log cannot be written: {e}"))
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

/// The segment being appended to.
struct Segment {
    number: u64,
    file: File,
    len: u64,
}

impl Segment {
    fn create(dir: &Path, number: u64) -> std::io::Result<Segment> {
        let file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(segment_path(dir, number))?;
        // The new name must survive a crash too.
        File::open(dir)?.sync_all()?;
        Ok(Segment {
            number,
            file,
            len: 0,
        })
    }

    /// Appends `records` durably, in a new segment if this one is full; its number.
    fn append(&mut self, records: &[u8], dir: Option<&Path>) -> std::io::Result<u64> {
        if self.len >= SEGMENT_BYTES {
            if let Some(dir) = dir {
                *self = Segment::create(dir, self.number + 1)?;
            }
        }
        self.file.write_all(records)?;
        self.file.sync_data()?;
        self.len += records.len() as u64;
        Ok(self.number)
    }
}

fn segment_path(dir: &Path, number: u64) -> PathBuf {
    dir.join(format!("{number:016}.log"))
}

/// The segments in `dir`, oldest first.
fn segment_files(dir: &Path) -> std::io::Result<Vec<(u64, PathBuf)>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
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
fn read_segment(path: &Path) -> std::io::Result<Vec<NewOrder>> {
    let mut bytes = Vec::new();
    File::open(path)?.read_to_end(&mut bytes)?;
    let mut orders = Vec::with_capacity(bytes.len() / RECORD);
    for record in bytes.chunks(RECORD) {
        match decode(record) {
            Some(order) => orders.push(order),
            None => {
                tracing::warn!(
                    segment = %path.display(),
                    kept = orders.len(),
                    dropped_bytes = bytes.len() - orders.len() * RECORD,
                    "order log segment ends in a torn or damaged record; the rest was never acknowledged"
                );
                break;
            }
        }
    }
    Ok(orders)
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
    let start = out.len();
    for f in fields(o) {
        out.extend_from_slice(&f.to_le_bytes());
    }
    let crc = CRC.checksum(&out[start..]);
    out.extend_from_slice(&crc.to_le_bytes());
}

fn decode(record: &[u8]) -> Option<NewOrder> {
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
    Some(NewOrder {
        id: next(),
        sale_id: next(),
        user_id: next(),
        quantity: next(),
        price_cents: next(),
        accepted_at: next(),
    })
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
        let left: Vec<_> = segment_files(&dir).unwrap();
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
        let (_, path) = segment_files(&dir).unwrap().pop().unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        // A crash in the middle of writing a fourth record, and a bit flipped in the third.
        let mut torn = Vec::new();
        encode(&order(4), &mut torn);
        bytes.extend_from_slice(&torn[..20]);
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(
            read_segment(&path)
                .unwrap()
                .iter()
                .map(|o| o.id)
                .collect::<Vec<_>>(),
            [1, 2, 3]
        );
        bytes[2 * RECORD + 5] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(
            read_segment(&path).unwrap(),
            [order(1), order(2)],
            "a damaged record ends what is read"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn past_the_backlog_limit_new_orders_wait_for_the_writer() {
        let dir = temp_dir();
        let (log, reader) = open_with_limit(&dir, "test-db", 2).unwrap();
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
        };
        encode(&o, &mut buf);
        assert_eq!(buf.len(), RECORD);
        assert_eq!(decode(&buf), Some(o));
        assert_eq!(decode(&buf[..RECORD - 1]), None);
    }
}
