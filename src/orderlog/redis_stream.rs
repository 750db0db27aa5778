//! The distributed order log: one Redis Stream per sale (appended by the gate's Lua
//! script), read by the `writers` consumer group. Each process reads as its own uniquely
//! named consumer; entries a dead consumer left pending are taken over with XAUTOCLAIM.
//! Acknowledged entries are deleted (SQL holds them now); entries that can never be
//! written move to the sale's dead-letter stream with the reason.
//!
//! On a standalone Redis one blocking XREADGROUP reads every stream. In a cluster the
//! streams live on many masters: each slot's streams are read in a non-blocking XREADGROUP
//! of their own, all of a master's in one pipeline, so one unreachable master never stops
//! the others' orders; a quiet slot is read less and less often, up to once a second.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::MultiplexedConnection;
use redis::{Script, Value};

use super::{Batch, Delivery, LogError, Malformed, OrderLog, Receipt, Unwritten};
use crate::model::NewOrder;
use crate::redis_client::keyed::KeyedPipe;
use crate::redis_client::keys::{SaleKeys, StreamKeys, WRITER_GROUP};
use crate::redis_client::{RedisClient, RedisConn};

/// Entries idle this long in some consumer's pending list are taken over (default).
pub const RECLAIM_IDLE_MS: u64 = 10_000;
/// How long a writer's read waits for new entries. Short, because a writer holds its
/// fence while it waits, and a gate rebuild waits for every fence. (The loops of a process
/// share one reader and take turns before they take their fences, so a rebuild waits for
/// one read, not for one per loop: it waited 2 s with 500 ms and 4 loops queued inside
/// their fences.) It names only the streams due (see `due_slots`): an idle reader costs
/// Redis about two calls a second.
const BLOCK_MS: u64 = 100;
/// A blocking read's answer: its BLOCK, plus a Redis busy with a storm.
const READ_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// The step of a slot's wait after a read that found nothing (the first wait is twice
/// this), and the longest a writer sleeps before it looks again for a slot due to be read.
const IDLE_POLL_MS: u64 = 50;
/// The longest a slot whose reads keep finding nothing waits for its next read: the first
/// order of a quiet sale reaches SQL within this, a busy sale's streams are read every
/// round.
const IDLE_SLOT_MAX_MS: u64 = 1000;

/// A slot whose last reads found nothing: how many in a row, and when it is read next
/// (each empty read doubles the wait, up to `IDLE_SLOT_MAX_MS`).
struct IdleSlot {
    empty_reads: u32,
    next_read: std::time::Instant,
}

/// The streams a writer reads, and the same grouped by cluster slot: made when the sales
/// change, not on each read (a thousand sales' grouping, twenty times a second, was a
/// good part of an idle writer's work).
#[derive(Default)]
struct Watched {
    all: Vec<String>,
    by_slot: Vec<(redis::cluster_routing::Slot, Vec<String>)>,
}

impl Watched {
    fn of(all: Vec<String>) -> Self {
        let mut by_slot: HashMap<redis::cluster_routing::Slot, Vec<String>> = HashMap::new();
        for s in &all {
            by_slot
                .entry(redis::cluster_routing::Slot::for_key(s))
                .or_default()
                .push(s.clone());
        }
        Watched {
            all,
            by_slot: by_slot.into_iter().collect(),
        }
    }
}

pub struct StreamLog {
    /// Blocking reads get their own connection so that they never delay other commands
    /// (standalone Redis only; `None` in a cluster).
    reader: tokio::sync::Mutex<Option<MultiplexedConnection>>,
    /// To open a new reader when Redis restarts (the reader does not reconnect by itself).
    client: RedisClient,
    conn: RedisConn,
    prefix: String,
    consumer: String,
    streams: RwLock<Arc<Watched>>,
    /// The sales of the last `watch` whose streams all joined.
    watched_sales: std::sync::Mutex<Vec<(i64, i64)>>,
    reclaim_idle_ms: u64,
    /// Orders per entry in the last read that found any (1 until then; more with batch
    /// entries): a read asks for as many entries as make about the orders it was asked
    /// for, not for that many entries of up to a hundred orders each.
    orders_per_entry: AtomicUsize,
    /// Per-stream read failures in a cluster, logged at most every 30 s.
    read_failures: crate::logline::Every,
    /// In a cluster, when each slot whose last reads found nothing is next read: a
    /// thousand idle sales are a thousand slots, and reading each every 50 ms was most of
    /// what they cost the instance and Redis.
    idle_slots: std::sync::Mutex<HashMap<redis::cluster_routing::Slot, IdleSlot>>,
    /// ack.lua: acknowledges and deletes a writer's entries in one step.
    ack: Script,
    /// dead_letter.lua: sets an unwritable entry aside, deletes and acknowledges it.
    dead_letter: Script,
}

impl StreamLog {
    pub async fn connect(
        client: &RedisClient,
        conn: RedisConn,
        prefix: &str,
    ) -> Result<Self, LogError> {
        let reader = client.blocking(READ_RESPONSE_TIMEOUT).await?;
        Ok(StreamLog {
            reader: tokio::sync::Mutex::new(reader),
            client: client.clone(),
            conn,
            prefix: prefix.to_string(),
            consumer: consumer_name(),
            streams: RwLock::default(),
            reclaim_idle_ms: RECLAIM_IDLE_MS,
            orders_per_entry: AtomicUsize::new(1),
            read_failures: crate::logline::Every::new(30_000),
            idle_slots: Default::default(),
            watched_sales: Default::default(),
            ack: Script::new(include_str!("ack.lua")),
            dead_letter: Script::new(include_str!("dead_letter.lua")),
        })
    }

    /// How long an entry must sit unacknowledged before another consumer takes it over.
    pub fn with_reclaim_idle(mut self, idle: Duration) -> Self {
        self.reclaim_idle_ms = idle.as_millis() as u64;
        self
    }

    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// Reads the streams of these sales (`(sale id, segments)`: one stream per segment)
    /// from now on, and makes sure their group exists.
    pub async fn watch(&self, sales: &[(i64, i64)]) -> Result<(), LogError> {
        // The scheduler calls this every second; the sales rarely change, and naming a
        // thousand sales' streams to find that out showed in an idle instance's profile.
        if *self.watched_sales.lock().unwrap_or_else(|p| p.into_inner()) == sales {
            return Ok(());
        }
        let mut keys: Vec<String> = sales
            .iter()
            .flat_map(|(id, n)| {
                let n = (*n).max(1);
                (0..n).map(move |s| SaleKeys::stream_of(&self.prefix, *id, n, s))
            })
            .collect();
        let mut seen = std::collections::HashSet::new();
        keys.retain(|k| seen.insert(k.clone()));
        let current = self.watched();
        let added: Vec<&String> = {
            let known: std::collections::HashSet<&str> =
                current.all.iter().map(String::as_str).collect();
            keys.iter()
                .filter(|k| !known.contains(k.as_str()))
                .collect()
        };
        // Other sales, the same streams (a sale's segments fixed after a reload).
        if added.is_empty() && keys.len() == current.all.len() {
            *self.watched_sales.lock().unwrap_or_else(|p| p.into_inner()) = sales.to_vec();
            return Ok(());
        }
        // A stream whose master is away joins on a later call; the others join now.
        let mut first_error = None;
        let mut failed = std::collections::HashSet::new();
        for key in added {
            if let Err(e) = self.ensure_group(key).await {
                failed.insert(key.clone());
                first_error.get_or_insert(e);
            }
        }
        let keys = keys.into_iter().filter(|k| !failed.contains(k)).collect();
        *self.streams.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(Watched::of(keys));
        // Only sales whose streams all joined are passed over next time.
        *self.watched_sales.lock().unwrap_or_else(|p| p.into_inner()) = match first_error {
            Some(_) => Vec::new(),
            None => sales.to_vec(),
        };
        first_error.map_or(Ok(()), Err)
    }

    fn watched(&self) -> Arc<Watched> {
        self.streams
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How many entries make about `max` orders, by the last read's orders per entry.
    fn entries_for(&self, max: usize) -> usize {
        (max / self.orders_per_entry.load(Ordering::Relaxed).max(1)).max(1)
    }

    /// Keeps the orders per entry of a read that found any.
    fn note_entries(&self, batch: &Batch) {
        let orders = batch.deliveries.len();
        if orders == 0 {
            return;
        }
        let entries = 1 + batch
            .deliveries
            .windows(2)
            .filter(|w| w[0].receipt.shared_entry() != w[1].receipt.shared_entry())
            .count();
        self.orders_per_entry
            .store(orders.div_ceil(entries), Ordering::Relaxed);
    }

    /// XREADGROUP of this consumer up to COUNT `max`, before BLOCK and STREAMS.
    fn read_command(&self, max: usize) -> redis::Cmd {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(WRITER_GROUP)
            .arg(&self.consumer)
            .arg("COUNT")
            .arg(max);
        cmd
    }

    /// A cluster read: each slot's streams in one non-blocking XREADGROUP, in one pipeline
    /// per master, all masters at once. A slot whose master is away is skipped (and
    /// logged); the others are read. Fails only when every slot failed.
    async fn read_per_slot(&self, watched: &Watched, max: usize) -> Result<Batch, LogError> {
        let by_slot = self.due_slots(watched);
        if by_slot.is_empty() {
            tokio::time::sleep(Duration::from_millis(IDLE_POLL_MS)).await;
            return Ok(Batch::default());
        }
        let count = (max / by_slot.len()).max(1);
        let mut pipe = KeyedPipe::new();
        for (_, group) in &by_slot {
            let mut cmd = self.read_command(count);
            cmd.arg("STREAMS").arg(group);
            for _ in group {
                cmd.arg(">");
            }
            pipe.routed(&group[0], cmd);
        }
        let replies = self.conn.clone().query_keyed(pipe).await?;
        let mut batch = Batch::default();
        let mut first_error = None;
        let mut read_any = false;
        for ((slot, group), reply) in by_slot.into_iter().zip(replies) {
            let slot = *slot;
            match reply {
                Ok(v) => {
                    read_any = true;
                    let before = batch.deliveries.len() + batch.malformed.len();
                    collect_reply(v, count, &mut batch);
                    let found = batch.deliveries.len() + batch.malformed.len() > before;
                    self.note_slot_read(slot, found);
                }
                Err(e) if e.code() == Some("NOGROUP") => {
                    read_any = true;
                    // Read again soon, not at once: a group that cannot be made again
                    // (Redis out of memory) must not spin the writer.
                    self.note_slot_read(slot, false);
                    for s in group {
                        if let Err(e) = self.ensure_group(s).await {
                            tracing::debug!(stream = s, error = %e, "could not recreate a group");
                        }
                    }
                }
                Err(e) => {
                    if let Some(left_out) = self.read_failures.ready() {
                        tracing::warn!(streams = ?group, error = %e, left_out, "reading these order streams failed; the others are read");
                    }
                    // A master away is asked again later, as a quiet one.
                    self.note_slot_read(slot, false);
                    first_error.get_or_insert(e);
                }
            }
        }
        if let (false, Some(e)) = (read_any, first_error) {
            return Err(e.into());
        }
        // No pause after an empty read: its slots wait their turn (`note_slot_read`) in
        // `until_worth_reading`, outside the writer's fence.
        Ok(batch)
    }

    /// The slots to read this round: those whose streams found entries last time, and the
    /// quiet ones due soon. Read together: a round of reads (and the writer's fence) every
    /// half second for a thousand quiet sales, not one for each slot as its own wait runs
    /// out, nor one per blocking read's end (ten a second, each naming every stream).
    fn due_slots<'w>(
        &self,
        watched: &'w Watched,
    ) -> Vec<&'w (redis::cluster_routing::Slot, Vec<String>)> {
        let soon = std::time::Instant::now() + Duration::from_millis(IDLE_SLOT_MAX_MS / 2);
        let idle = self.idle_slots.lock().unwrap_or_else(|p| p.into_inner());
        watched
            .by_slot
            .iter()
            .filter(|(slot, _)| idle.get(slot).is_none_or(|i| i.next_read <= soon))
            .collect()
    }

    /// How long until the first slot is due to be read; `None` when one is now (or no
    /// stream is watched).
    fn until_a_slot_is_due(&self) -> Option<Duration> {
        let watched = self.watched();
        let idle = self.idle_slots.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        let mut earliest: Option<std::time::Instant> = None;
        for (slot, _) in &watched.by_slot {
            match idle.get(slot) {
                Some(i) if i.next_read > now => {
                    earliest = Some(earliest.map_or(i.next_read, |e| e.min(i.next_read)));
                }
                _ => return None,
            }
        }
        earliest.map(|e| e - now)
    }

    /// After a read of a slot's streams: read again next round if it found
    /// entries, else later, each empty read doubling the wait.
    fn note_slot_read(&self, slot: redis::cluster_routing::Slot, found: bool) {
        let mut idle = self.idle_slots.lock().unwrap_or_else(|p| p.into_inner());
        if found {
            idle.remove(&slot);
            return;
        }
        let entry = idle.entry(slot).or_insert(IdleSlot {
            empty_reads: 0,
            next_read: std::time::Instant::now(),
        });
        entry.empty_reads = entry.empty_reads.saturating_add(1);
        let wait = IDLE_POLL_MS.saturating_mul(1 << entry.empty_reads.min(10));
        entry.next_read =
            std::time::Instant::now() + Duration::from_millis(wait.min(IDLE_SLOT_MAX_MS));
    }

    /// dead_letter.lua: the entry `id` of `stream` set aside with `reason`, or only its
    /// `orders` each with its own (the rest of a batch entry is in SQL), and removed. False
    /// when it was gone already (set aside or written by another writer).
    async fn set_aside(
        &self,
        stream: &str,
        id: &str,
        reason: &str,
        orders: &[(NewOrder, String)],
    ) -> Result<bool, LogError> {
        let dead = stream.trim_end_matches(":orders").to_string() + ":dead";
        let mut call = self.dead_letter.prepare_invoke();
        call.key(stream)
            .key(&dead)
            .arg(WRITER_GROUP)
            .arg(id)
            .arg(reason);
        for (order, reason) in orders {
            call.arg(packed_text(order)).arg(reason);
        }
        let set_aside: i64 = call.invoke_async(&mut self.conn.clone()).await?;
        Ok(set_aside == 1)
    }

    /// Those of `streams` with entries pending in some consumer, asked of them all in one
    /// round trip per server: the reclaim's XAUTOCLAIM, stream by stream, was one call a
    /// second per idle sale. Streams whose group is missing get it back.
    async fn streams_with_pending(&self, streams: &[String]) -> Result<Vec<String>, LogError> {
        let mut conn = self.conn.clone();
        let mut pending = Vec::new();
        for group in streams.chunks(SALES_PER_PIPELINE) {
            let mut pipe = KeyedPipe::new();
            for stream in group {
                pipe.cmd("XPENDING", stream).arg(WRITER_GROUP);
            }
            let replies = conn.query_keyed(pipe).await?;
            for (stream, reply) in group.iter().zip(replies) {
                match reply {
                    // The summary form: [count, lowest id, highest id, consumers].
                    Ok(Value::Array(summary)) => {
                        if !matches!(summary.first(), Some(Value::Int(0)) | None) {
                            pending.push(stream.clone());
                        }
                    }
                    Ok(_) => {}
                    Err(e) if e.code() == Some("NOGROUP") => self.ensure_group(stream).await?,
                    // One stream that cannot be asked must not keep the others' entries
                    // pending.
                    Err(e) => {
                        if let Some(left_out) = self.read_failures.ready() {
                            tracing::warn!(stream, error = %e, left_out, "asking this stream for pending entries failed; the others go on");
                        }
                    }
                }
            }
        }
        Ok(pending)
    }

    async fn ensure_group(&self, stream: &str) -> Result<(), LogError> {
        let mut conn = self.conn.clone();
        let created: Result<(), redis::RedisError> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(stream)
            .arg(WRITER_GROUP)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut conn)
            .await;
        match created {
            Err(e) if e.code() != Some("BUSYGROUP") => Err(e.into()),
            _ => Ok(()),
        }
    }
}

fn consumer_name() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".to_string());
    format!(
        "{host}-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    }
}

/// An entry's fields, in the order of [`NewOrder`]'s.
const FIELDS: [&str; 6] = [
    "order_id",
    "sale_id",
    "user_id",
    "quantity",
    "price_cents",
    "accepted_at",
];

fn bytes(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

/// The one field of a packed entry (`--order-log-entry packed`): [`FIELDS`]' values
/// joined by ':'.
const PACKED: &[u8] = b"o";

/// An order from an entry's fields `[k, v, k, v, ...]`, read where they lie: a writer
/// reads a thousand entries a batch, and copying each into a map of strings was a tenth
/// of its allocations. Reads both forms: the packed field, and one field per value (the
/// default form, and the only one earlier builds wrote).
fn parse_order(kv: &[Value]) -> Result<NewOrder, String> {
    match kv {
        [k, v] if bytes(k) == Some(PACKED) => parse_packed(v),
        _ => parse_fields(kv),
    }
}

/// The one field of a batch entry (`--order-log-entry batch`): a script call's orders,
/// `sale_id:price_cents:accepted_at` then `;order_id:user_id:quantity` per order.
const BATCH: &[u8] = b"b";

/// The orders of a batch entry's field, all or none: an entry that does not read whole is
/// set aside whole, never delivered in part.
fn parse_batch(v: &Value) -> Result<Vec<NewOrder>, String> {
    let text = bytes(v)
        .and_then(|b| std::str::from_utf8(b).ok())
        .ok_or("field b is not text")?;
    let mut parts = text.split(';');
    let head = parts.next().unwrap_or_default();
    let [sale_id, price_cents, accepted_at] = integers(head)
        .ok_or_else(|| format!("field b: {head:?} is not sale_id:price_cents:accepted_at"))?;
    let orders = parts
        .map(|part| {
            let [id, user_id, quantity] = integers(part)
                .ok_or_else(|| format!("field b: {part:?} is not order_id:user_id:quantity"))?;
            checked(NewOrder {
                id,
                sale_id,
                user_id,
                quantity,
                price_cents,
                accepted_at,
                retry_key: None,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if orders.is_empty() {
        return Err("field b holds no order".into());
    }
    Ok(orders)
}

/// Exactly `N` integers of plain digits joined by ':' (as load_sale.lua reads them: no
/// sign).
fn integers<const N: usize>(text: &str) -> Option<[i64; N]> {
    let mut values = [0i64; N];
    let mut parts = text.split(':');
    for value in values.iter_mut() {
        let part = parts.next()?;
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        *value = part.parse().ok()?;
    }
    parts.next().is_none().then_some(values)
}

/// An order's fields as a packed entry holds them: how a batch entry's refused order is
/// set aside on its own.
fn packed_text(o: &NewOrder) -> String {
    format!(
        "{}:{}:{}:{}:{}:{}",
        o.id, o.sale_id, o.user_id, o.quantity, o.price_cents, o.accepted_at
    )
}

fn parse_packed(v: &Value) -> Result<NewOrder, String> {
    let text = bytes(v)
        .and_then(|b| std::str::from_utf8(b).ok())
        .ok_or("field o is not text")?;
    let mut values = [0i64; 6];
    let mut parts = text.split(':');
    for (slot, value) in values.iter_mut().enumerate() {
        *value = parts
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| format!("field o: {} is not an integer", FIELDS[slot]))?;
    }
    if parts.next().is_some() {
        return Err("field o has more than six values".into());
    }
    let [id, sale_id, user_id, quantity, price_cents, accepted_at] = values;
    checked(NewOrder {
        id,
        sale_id,
        user_id,
        quantity,
        price_cents,
        accepted_at,
        retry_key: None,
    })
}

fn checked(order: NewOrder) -> Result<NewOrder, String> {
    if order.quantity <= 0 || order.id <= 0 {
        return Err("quantity and order_id must be positive".into());
    }
    Ok(order)
}

fn parse_fields(kv: &[Value]) -> Result<NewOrder, String> {
    let mut values: [Option<i64>; 6] = [None; 6];
    for pair in kv.chunks(2) {
        let (Some(k), Some(v)) = (pair.first(), pair.get(1)) else {
            continue;
        };
        let Some(slot) = bytes(k).and_then(|k| FIELDS.iter().position(|f| f.as_bytes() == k))
        else {
            continue;
        };
        let parsed = match v {
            Value::Int(n) => Some(*n),
            other => bytes(other)
                .and_then(|b| std::str::from_utf8(b).ok())
                .and_then(|t| t.parse::<i64>().ok()),
        };
        values[slot] =
            Some(parsed.ok_or_else(|| format!("field {} is not an integer", FIELDS[slot]))?);
    }
    let get = |slot: usize| values[slot].ok_or_else(|| format!("missing field {}", FIELDS[slot]));
    checked(NewOrder {
        id: get(0)?,
        sale_id: get(1)?,
        user_id: get(2)?,
        quantity: get(3)?,
        price_cents: get(4)?,
        accepted_at: get(5)?,
        retry_key: None,
    })
}

/// Adds stream entries `[[id, [k, v, ...]], ...]` of `stream` to the batch.
fn collect_entries(stream: &str, entries: &Value, batch: &mut Batch) {
    let Value::Array(entries) = entries else {
        return;
    };
    for entry in entries {
        let Value::Array(parts) = entry else { continue };
        let Some(id) = parts.first().and_then(text) else {
            continue;
        };
        let receipt = Receipt::Stream {
            stream: stream.to_string(),
            id,
        };
        let fields = match parts.get(1) {
            Some(Value::Array(kv)) => &kv[..],
            // Deleted while pending (a dead letter cut short after its XDEL, or an ack of an
            // earlier build): written or set aside already, nothing left to do.
            Some(Value::Nil) => continue,
            _ => &[],
        };
        let orders = match fields {
            [k, v] if bytes(k) == Some(BATCH) => parse_batch(v),
            _ => parse_order(fields).map(|order| vec![order]),
        };
        match orders {
            Ok(orders) => batch
                .deliveries
                .extend(orders.into_iter().map(|order| Delivery {
                    order,
                    receipt: receipt.clone(),
                })),
            Err(reason) => batch.malformed.push(Malformed { receipt, reason }),
        }
    }
}

/// The streams a batch holds entries of.
fn streams_in(batch: &Batch) -> std::collections::HashSet<&str> {
    let receipts = batch.deliveries.iter().map(|d| &d.receipt);
    receipts
        .chain(batch.malformed.iter().map(|m| &m.receipt))
        .filter_map(|r| match r {
            Receipt::Stream { stream, .. } => Some(stream.as_str()),
            _ => None,
        })
        .collect()
}

/// Adds the entries of an XREADGROUP reply (RESP2 array or RESP3 map) to the batch;
/// `count` is the COUNT it asked of each stream (a stream that gave as many caps the batch).
fn collect_reply(reply: Value, count: usize, batch: &mut Batch) {
    let mut collect = |name: &str, entries: &Value| {
        if matches!(entries, Value::Array(e) if e.len() >= count) {
            batch.capped = true;
        }
        collect_entries(name, entries, batch);
    };
    match reply {
        Value::Array(per_stream) => {
            for s in per_stream {
                if let Value::Array(pair) = s {
                    if let (Some(name), Some(entries)) = (pair.first().and_then(text), pair.get(1))
                    {
                        collect(&name, entries);
                    }
                }
            }
        }
        Value::Map(per_stream) => {
            for (name, entries) in per_stream {
                if let Some(name) = text(&name) {
                    collect(&name, &entries);
                }
            }
        }
        _ => {}
    }
}

/// Most entries acknowledged by one call of ack.lua (its ids are unpacked onto Lua's stack).
const ACK_CHUNK: usize = 1000;

/// A stream entry id as (milliseconds, sequence); `None` for any other text.
fn entry_id(id: &str) -> Option<(u64, u64)> {
    let (ms, seq) = id.split_once('-')?;
    Some((ms.parse().ok()?, seq.parse().ok()?))
}

/// The newest of `ids` and the id right after it, for ack.lua's trim; empty when an id is
/// not a stream id (then the script deletes the ids one by one).
fn trim_bounds(ids: &[String]) -> (String, String) {
    let parsed: Option<Vec<(u64, u64)>> = ids.iter().map(|id| entry_id(id)).collect();
    let newest = parsed.and_then(|ids| ids.into_iter().max());
    let next = |(ms, seq): (u64, u64)| match seq.checked_add(1) {
        Some(seq) => Some((ms, seq)),
        None => ms.checked_add(1).map(|ms| (ms, 0)),
    };
    match newest.and_then(|id| Some((id, next(id)?))) {
        Some(((ms, seq), (next_ms, next_seq))) => {
            (format!("{ms}-{seq}"), format!("{next_ms}-{next_seq}"))
        }
        None => (String::new(), String::new()),
    }
}

fn by_stream(receipts: Vec<Receipt>) -> HashMap<String, Vec<String>> {
    let mut map: HashMap<String, Vec<String>> = HashMap::new();
    for r in receipts {
        if let Receipt::Stream { stream, id } = r {
            map.entry(stream).or_default().push(id);
        }
    }
    map
}

#[async_trait]
impl OrderLog for StreamLog {
    async fn next_batch(&self, max: usize) -> Result<Batch, LogError> {
        let watched = self.watched();
        let streams = &watched.all;
        if streams.is_empty() {
            tokio::time::sleep(Duration::from_millis(BLOCK_MS)).await;
            return Ok(Batch::default());
        }
        let max = self.entries_for(max);
        if self.conn.is_cluster() {
            let batch = self.read_per_slot(&watched, max).await?;
            self.note_entries(&batch);
            return Ok(batch);
        }
        // One Redis: the due slots' streams in one blocking read.
        let due = self.due_slots(&watched);
        if due.is_empty() {
            tokio::time::sleep(Duration::from_millis(IDLE_POLL_MS)).await;
            return Ok(Batch::default());
        }
        let streams: Vec<&String> = due.iter().flat_map(|(_, group)| group).collect();
        let mut cmd = self.read_command(max);
        cmd.arg("BLOCK").arg(BLOCK_MS);
        cmd.arg("STREAMS").arg(&streams);
        for _ in &streams {
            cmd.arg(">");
        }
        let reply: Result<Value, redis::RedisError> = {
            let mut reader = self.reader.lock().await;
            let reply = match reader.as_mut() {
                Some(reader) => cmd.query_async(reader).await,
                None => cmd.query_async(&mut self.conn.clone()).await,
            };
            if let Err(e) = &reply {
                if e.is_io_error()
                    || e.is_connection_dropped()
                    || e.is_connection_refusal()
                    || e.is_timeout()
                {
                    if let Ok(Some(fresh)) = self.client.blocking(READ_RESPONSE_TIMEOUT).await {
                        *reader = Some(fresh);
                    }
                }
            }
            reply
        };
        let reply = match reply {
            Ok(v) => v,
            Err(e) if e.code() == Some("NOGROUP") => {
                // The stream or group vanished (Redis restarted empty, or a key expired):
                // recreate and read again on the next call rather than crash.
                for s in streams {
                    self.ensure_group(s).await?;
                }
                return Ok(Batch::default());
            }
            Err(e) => return Err(e.into()),
        };
        let mut batch = Batch::default();
        collect_reply(reply, max, &mut batch);
        let found = streams_in(&batch);
        for (slot, group) in due {
            self.note_slot_read(*slot, group.iter().any(|s| found.contains(s.as_str())));
        }
        self.note_entries(&batch);
        Ok(batch)
    }

    async fn until_worth_reading(&self) {
        while let Some(wait) = self.until_a_slot_is_due() {
            // Bounded: a sale watched meanwhile is read soon.
            tokio::time::sleep(wait.min(Duration::from_millis(4 * IDLE_POLL_MS))).await;
        }
    }

    async fn reclaim(&self, max: usize) -> Result<Batch, LogError> {
        let count = self.entries_for(max);
        let mut batch = Batch::default();
        let mut conn = self.conn.clone();
        for stream in self.streams_with_pending(&self.watched().all).await? {
            let reply: Result<Value, redis::RedisError> = redis::cmd("XAUTOCLAIM")
                .arg(&stream)
                .arg(WRITER_GROUP)
                .arg(&self.consumer)
                .arg(self.reclaim_idle_ms)
                .arg("0-0")
                .arg("COUNT")
                .arg(count)
                .query_async(&mut conn)
                .await;
            match reply {
                Ok(Value::Array(parts)) => {
                    if let Some(entries) = parts.get(1) {
                        collect_entries(&stream, entries, &mut batch);
                    }
                }
                Ok(_) => {}
                Err(e) if e.code() == Some("NOGROUP") => self.ensure_group(&stream).await?,
                // One stream's master away must not keep the others' orders waiting.
                Err(e) if !batch.is_empty() || self.conn.is_cluster() => {
                    if let Some(left_out) = self.read_failures.ready() {
                        tracing::warn!(stream, error = %e, left_out, "reclaiming this stream's entries failed; the others go on");
                    }
                }
                Err(e) => return Err(e.into()),
            }
            if batch.deliveries.len() >= max {
                break;
            }
        }
        Ok(batch)
    }

    async fn ack(&self, receipts: Vec<Receipt>) -> Result<(), LogError> {
        let mut conn = self.conn.clone();
        for (stream, mut ids) in by_stream(receipts) {
            // Oldest first, so that each call after the first finds the older entries gone
            // and trims its own.
            ids.sort_by_key(|id| entry_id(id));
            ids.dedup();
            for chunk in ids.chunks(ACK_CHUNK) {
                let (newest, after) = trim_bounds(chunk);
                let mut call = self.ack.prepare_invoke();
                call.key(&stream)
                    .arg(WRITER_GROUP)
                    .arg(newest)
                    .arg(after)
                    .arg(chunk);
                let _: i64 = call.invoke_async(&mut conn).await?;
            }
        }
        Ok(())
    }

    async fn retry_later(&self, _receipts: Vec<Receipt>, reason: &str) -> Result<(), LogError> {
        // Left pending: after RECLAIM_IDLE_MS any writer (this one too) takes them again.
        tracing::warn!(
            reason,
            "order batch not written; entries stay pending for a retry"
        );
        Ok(())
    }

    async fn dead_letter(&self, receipt: Receipt, reason: &str) -> Result<(), LogError> {
        let Receipt::Stream { stream, id } = receipt else {
            return Ok(());
        };
        if self.set_aside(&stream, &id, reason, &[]).await? {
            tracing::error!(
                stream,
                id,
                reason,
                "order entry moved to the dead-letter stream"
            );
        }
        Ok(())
    }

    async fn dead_letter_orders(
        &self,
        receipt: Receipt,
        refused: &[(NewOrder, String)],
    ) -> Result<(), LogError> {
        let Receipt::Stream { stream, id } = receipt else {
            return Ok(());
        };
        if self.set_aside(&stream, &id, "", refused).await? {
            for (order, reason) in refused {
                tracing::error!(
                    stream,
                    id,
                    order = order.id,
                    reason,
                    "order of a batch entry moved to the dead-letter stream"
                );
            }
        }
        Ok(())
    }

    fn finished(&self) -> bool {
        false
    }

    fn shared(&self) -> bool {
        true
    }
}

#[async_trait]
impl super::Backlog for StreamLog {
    fn holds_orders(&self) -> bool {
        true
    }

    async fn counts(&self, sale: i64, segments: i64) -> Result<super::Counts, LogError> {
        let (unwritten, pending, dead) =
            backlog(&mut self.conn.clone(), &self.prefix, sale, segments).await?;
        Ok(super::Counts {
            unwritten,
            pending,
            dead,
        })
    }

    async fn unwritten(
        &self,
        sale: i64,
        segments: i64,
        cap: usize,
    ) -> Result<Option<Unwritten>, LogError> {
        unwritten_orders(&mut self.conn.clone(), &self.prefix, sale, segments, cap).await
    }

    async fn unwritten_of_sales(
        &self,
        sales: &[(i64, i64)],
        cap: usize,
    ) -> Vec<Result<Option<Unwritten>, LogError>> {
        unwritten_of_many(&mut self.conn.clone(), &self.prefix, sales, cap).await
    }

    async fn queued_of_user(
        &self,
        user: i64,
        sales: &[(i64, i64, i64)],
    ) -> Result<Vec<(i64, i64, i64)>, LogError> {
        queued_of_user(&mut self.conn.clone(), &self.prefix, sales, user).await
    }

    async fn lag(&self, sale: i64, segments: i64) -> Result<(i64, Option<i64>), LogError> {
        unwritten(&mut self.conn.clone(), &self.prefix, sale, segments).await
    }

    async fn lags(&self, sales: &[(i64, i64)]) -> Result<Vec<(i64, Option<i64>)>, LogError> {
        let mut lags = Vec::with_capacity(sales.len());
        let mut conn = self.conn.clone();
        for group in sales.chunks(SALES_PER_PIPELINE) {
            let mut pipe = KeyedPipe::new();
            for (sale, segments) in group {
                for k in streams_of(&self.prefix, *sale, *segments) {
                    oldest_reads(&mut pipe, &k);
                }
            }
            let mut replies = conn.query_keyed(pipe).await?.into_iter();
            for (_, segments) in group {
                lags.push(sum_oldest((*segments).max(1), &mut replies)?);
            }
        }
        Ok(lags)
    }

    async fn watch(&self, sales: &[(i64, i64)]) -> Result<(), LogError> {
        StreamLog::watch(self, sales).await
    }
}

/// A sale's entries not yet written (an order each, or a batch entry's several), and the
/// acceptance time (Unix ms) of the oldest: written entries are deleted from the stream, so
/// its first entry is the oldest.
pub async fn unwritten(
    conn: &mut RedisConn,
    prefix: &str,
    sale_id: i64,
    segments: i64,
) -> Result<(i64, Option<i64>), LogError> {
    let mut pipe = KeyedPipe::new();
    for k in streams_of(prefix, sale_id, segments) {
        oldest_reads(&mut pipe, &k);
    }
    let mut replies = conn.query_keyed(pipe).await?.into_iter();
    sum_oldest(segments.max(1), &mut replies)
}

/// Adds to `pipe` the reads of a stream's length and oldest entry: two replies.
fn oldest_reads(pipe: &mut KeyedPipe, k: &StreamKeys) {
    pipe.cmd("XLEN", &k.stream);
    pipe.cmd("XRANGE", &k.stream)
        .arg("-")
        .arg("+")
        .arg("COUNT")
        .arg(1);
}

/// A sale's entries and the time of its oldest from the next `segments` streams' replies
/// of `oldest_reads`.
fn sum_oldest(
    segments: i64,
    replies: &mut impl Iterator<Item = redis::RedisResult<Value>>,
) -> Result<(i64, Option<i64>), LogError> {
    let mut total = 0;
    let mut oldest: Option<i64> = None;
    for _ in 0..segments {
        let (Some(len), Some(first)) = (replies.next(), replies.next()) else {
            let short = (
                redis::ErrorKind::UnexpectedReturnType,
                "a read of the streams got fewer replies than it asked for",
            );
            return Err(redis::RedisError::from(short).into());
        };
        let len: i64 = redis::from_redis_value(len?).map_err(redis::RedisError::from)?;
        total += len;
        oldest = match (oldest, first_entry_ms(&first?)) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    Ok((total, oldest))
}

/// The acceptance time (Unix ms, from its id) of the one entry of an XRANGE reply.
fn first_entry_ms(first: &Value) -> Option<i64> {
    match first {
        Value::Array(entries) => entries.first().and_then(|e| match e {
            Value::Array(parts) => parts
                .first()
                .and_then(text)
                .and_then(|id| id.split('-').next()?.parse().ok()),
            _ => None,
        }),
        _ => None,
    }
}

/// Most stream entries read to find one buyer's unwritten orders of a sale.
const QUEUED_SCAN: usize = 5000;

/// A buyer's orders accepted and not yet written, as (order id, sale id, quantity): for
/// each sale in `sales` where the gate holds more of the buyer's units than SQL's live
/// orders do (`(sale id, units in SQL, segments)`), the stream of the buyer's segment is
/// read for the buyer's entries (the stream keeps only unwritten orders, normally a few).
pub async fn queued_of_user(
    conn: &mut RedisConn,
    prefix: &str,
    sales: &[(i64, i64, i64)],
    user_id: i64,
) -> Result<Vec<(i64, i64, i64)>, LogError> {
    let mut out = Vec::new();
    for (sale_id, in_sql, segments) in sales {
        let segment = crate::model::segments::segment_of(user_id, *segments);
        let k = SaleKeys::for_segment(prefix, *sale_id, *segments, segment);
        let held: Option<i64> = redis::cmd("HGET")
            .arg(&k.buyers)
            .arg(user_id)
            .query_async(conn)
            .await?;
        if held.unwrap_or(0) <= *in_sql {
            continue;
        }
        let entries: Value = redis::cmd("XRANGE")
            .arg(&k.stream)
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(QUEUED_SCAN)
            .query_async(conn)
            .await?;
        let mut batch = Batch::default();
        collect_entries(&k.stream, &entries, &mut batch);
        out.extend(
            batch
                .deliveries
                .into_iter()
                .filter(|d| d.order.user_id == user_id)
                .map(|d| (d.order.id, d.order.sale_id, d.order.quantity)),
        );
    }
    Ok(out)
}

/// What a sale's order log holds that SQL does not: (user, quantity) per unwritten order
/// and the dead letters, or `None` when a stream holds more than `cap` entries (too much
/// in flight to count).
pub async fn unwritten_orders(
    conn: &mut RedisConn,
    prefix: &str,
    sale_id: i64,
    segments: i64,
    cap: usize,
) -> Result<Option<Unwritten>, LogError> {
    unwritten_of_many(conn, prefix, &[(sale_id, segments)], cap)
        .await
        .pop()
        .unwrap_or(Ok(None))
}

/// [`unwritten_orders`] of many sales, `(sale, segments)`, in one round trip per server
/// (a pipeline per master in a cluster) per `SALES_PER_PIPELINE` sales.
async fn unwritten_of_many(
    conn: &mut RedisConn,
    prefix: &str,
    sales: &[(i64, i64)],
    cap: usize,
) -> Vec<Result<Option<Unwritten>, LogError>> {
    let mut answers = Vec::with_capacity(sales.len());
    for group in sales.chunks(SALES_PER_PIPELINE) {
        let streams: Vec<Vec<StreamKeys>> = group
            .iter()
            .map(|(sale, segments)| streams_of(prefix, *sale, *segments))
            .collect();
        let mut pipe = KeyedPipe::new();
        for k in streams.iter().flatten() {
            stream_reads(&mut pipe, k, cap);
        }
        // A command that fails (a key of another type) fails its own sale only.
        let replies: Vec<redis::RedisResult<Value>> = match conn.query_keyed(pipe).await {
            Ok(replies) => replies,
            Err(e) => {
                answers.extend(group.iter().map(|_| Err(LogError::Redis(e.clone()))));
                continue;
            }
        };
        let mut replies = replies.into_iter();
        for sale_streams in &streams {
            let mut found = (Vec::new(), 0);
            let mut counted = Ok(true);
            for k in sale_streams {
                // Every stream's replies are taken, so that the next sale reads its own.
                let added = add_stream(k, &mut replies, cap, &mut found);
                if counted.as_ref().is_ok_and(|c| *c) {
                    counted = added;
                }
            }
            answers.push(counted.map(|counted| counted.then_some(found)));
        }
    }
    answers
}

/// Sales per pipeline of the audit's reads.
const SALES_PER_PIPELINE: usize = 1000;

/// The keys of each of a sale's streams (one per segment).
fn streams_of(prefix: &str, sale_id: i64, segments: i64) -> Vec<StreamKeys> {
    (0..segments.max(1))
        .map(|s| SaleKeys::streams_of(prefix, sale_id, segments, s))
        .collect()
}

/// Adds to `pipe` the reads of a stream's unwritten entries (at most `cap + 1`) and of its
/// dead letters' count: two replies.
fn stream_reads(pipe: &mut KeyedPipe, k: &StreamKeys, cap: usize) {
    pipe.cmd("XRANGE", &k.stream)
        .arg("-")
        .arg("+")
        .arg("COUNT")
        .arg(cap + 1);
    pipe.cmd("XLEN", &k.dead);
}

/// Adds a stream's unwritten orders and dead letters to `found` from the next two replies
/// of `stream_reads`; false when it holds more than `cap` entries.
fn add_stream(
    k: &StreamKeys,
    replies: &mut impl Iterator<Item = redis::RedisResult<Value>>,
    cap: usize,
    found: &mut Unwritten,
) -> Result<bool, LogError> {
    let (Some(entries), Some(dead)) = (replies.next(), replies.next()) else {
        let short = (
            redis::ErrorKind::UnexpectedReturnType,
            "a read of the streams got fewer replies than it asked for",
        );
        return Err(redis::RedisError::from(short).into());
    };
    let (entries, dead) = (entries?, dead?);
    let dead: i64 = redis::from_redis_value(dead).map_err(redis::RedisError::from)?;
    let mut batch = Batch::default();
    collect_entries(&k.stream, &entries, &mut batch);
    let read = match &entries {
        Value::Array(e) => e.len(),
        _ => 0,
    };
    if read > cap {
        return Ok(false);
    }
    // An entry that does not parse is in the stream (and in the gate) but can never be
    // written: count it with the dead letters.
    let unreadable = batch.malformed.len() as i64;
    found.0.extend(
        batch
            .deliveries
            .iter()
            .map(|d| (d.order.user_id, d.order.quantity)),
    );
    found.1 += dead + unreadable;
    Ok(true)
}

/// Backlog of a sale's order log: (entries not yet written, of which pending in a
/// consumer, dead letters).
pub async fn backlog(
    conn: &mut RedisConn,
    prefix: &str,
    sale_id: i64,
    segments: i64,
) -> Result<(i64, i64, i64), LogError> {
    let mut total = (0, 0, 0);
    for s in 0..segments.max(1) {
        let k = SaleKeys::for_segment(prefix, sale_id, segments, s);
        let (len, pending, dead) = stream_backlog(conn, &k).await?;
        total = (total.0 + len, total.1 + pending, total.2 + dead);
    }
    Ok(total)
}

async fn stream_backlog(conn: &mut RedisConn, k: &SaleKeys) -> Result<(i64, i64, i64), LogError> {
    let (len, dead): (i64, i64) = redis::pipe()
        .cmd("XLEN")
        .arg(&k.stream)
        .cmd("XLEN")
        .arg(&k.dead)
        .query_async(conn)
        .await?;
    let pending: Value = match redis::cmd("XPENDING")
        .arg(&k.stream)
        .arg(WRITER_GROUP)
        .query_async(conn)
        .await
    {
        Ok(v) => v,
        Err(e) if e.code() == Some("NOGROUP") => Value::Nil,
        Err(e) => return Err(e.into()),
    };
    let pending = match pending {
        Value::Array(parts) => match parts.first() {
            Some(Value::Int(n)) => *n,
            _ => 0,
        },
        _ => 0,
    };
    Ok((len, pending, dead))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_acknowledgement_trims_up_to_its_newest_id_only_when_every_id_reads() {
        let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let bounds = |v: &[&str]| trim_bounds(&ids(v));
        assert_eq!(
            bounds(&["5-2", "17-0", "9-9"]),
            ("17-0".into(), "17-1".into())
        );
        assert_eq!(bounds(&["17-3", "17-12"]), ("17-12".into(), "17-13".into()));
        let last = format!("5-{}", u64::MAX);
        assert_eq!(bounds(&[&last]), (last.clone(), "6-0".into()));
        let top = format!("{}-{}", u64::MAX, u64::MAX);
        assert_eq!(bounds(&[&top]), (String::new(), String::new()));
        assert_eq!(bounds(&["5-2", "x"]), (String::new(), String::new()));
        assert_eq!(bounds(&["5"]), (String::new(), String::new()));
    }

    #[test]
    fn malformed_entries_are_set_aside_not_dropped() {
        let entry = |id: &str, kv: &[&str]| {
            Value::Array(vec![
                Value::BulkString(id.as_bytes().to_vec()),
                Value::Array(
                    kv.iter()
                        .map(|s| Value::BulkString(s.as_bytes().to_vec()))
                        .collect(),
                ),
            ])
        };
        let good = [
            "order_id",
            "5",
            "sale_id",
            "1",
            "user_id",
            "9",
            "quantity",
            "1",
            "price_cents",
            "100",
            "accepted_at",
            "7",
        ];
        let entries = Value::Array(vec![
            entry("1-0", &good),
            entry("2-0", &["order_id", "x"]),
            entry("3-0", &["o", "6:1:10:2:100:8"]),
            entry("4-0", &["o", "6:1:10:2:100"]),
            entry("5-0", &["o", "6:1:10:2:100:8:9"]),
            entry("6-0", &["o", "6:1:x:2:100:8"]),
            entry("7-0", &["o", "0:1:10:2:100:8"]),
        ]);
        let mut batch = Batch::default();
        collect_entries("s", &entries, &mut batch);
        let order = |id, user_id, quantity, accepted_at| NewOrder {
            id,
            sale_id: 1,
            user_id,
            quantity,
            price_cents: 100,
            accepted_at,
            retry_key: None,
        };
        let read: Vec<_> = batch.deliveries.iter().map(|d| d.order.clone()).collect();
        assert_eq!(read, [order(5, 9, 1, 7), order(6, 10, 2, 8)]);
        assert_eq!(batch.malformed.len(), 5, "{:?}", batch.malformed);
    }

    #[test]
    fn a_batch_entry_is_read_whole_or_set_aside_whole() {
        let entry = |id: &str, b: &str| {
            Value::Array(vec![
                Value::BulkString(id.as_bytes().to_vec()),
                Value::Array(vec![
                    Value::BulkString(b"b".to_vec()),
                    Value::BulkString(b.as_bytes().to_vec()),
                ]),
            ])
        };
        let entries = Value::Array(vec![
            entry("1-0", "3:250:77;11:5:1;12:6:2;13:7:1"),
            entry("2-0", "3:250:78;14:8:1"),
            // A bad order, an empty batch, a head short of a value, a zero quantity.
            entry("3-0", "3:250:79;15:9:1;16:x:1"),
            entry("4-0", "3:250:79"),
            entry("5-0", "3:250;17:9:1"),
            entry("6-0", "3:250:79;18:9:0"),
            // A sign, which load_sale.lua would not read either.
            entry("7-0", "+3:250:79;19:9:1"),
        ]);
        let mut batch = Batch::default();
        collect_entries("s", &entries, &mut batch);
        let read: Vec<_> = batch
            .deliveries
            .iter()
            .map(|d| {
                let Receipt::Stream { id, .. } = &d.receipt else {
                    panic!("{d:?}")
                };
                (id.as_str(), d.order.clone())
            })
            .collect();
        let order = |id, user_id, quantity, accepted_at| NewOrder {
            id,
            sale_id: 3,
            user_id,
            quantity,
            price_cents: 250,
            accepted_at,
            retry_key: None,
        };
        assert_eq!(
            read,
            [
                ("1-0", order(11, 5, 1, 77)),
                ("1-0", order(12, 6, 2, 77)),
                ("1-0", order(13, 7, 1, 77)),
                ("2-0", order(14, 8, 1, 78)),
            ]
        );
        assert_eq!(batch.malformed.len(), 5, "{:?}", batch.malformed);
        assert!(
            batch.malformed[0].reason.contains("\"16:x:1\""),
            "{:?}",
            batch.malformed[0]
        );
        let o = order(11, 5, 1, 77);
        assert_eq!(packed_text(&o), "11:3:5:1:250:77");
        assert_eq!(
            parse_packed(&Value::BulkString(packed_text(&o).into_bytes())),
            Ok(o)
        );
    }

    #[test]
    fn a_read_is_capped_when_a_stream_gave_as_many_entries_as_asked() {
        let entries = |n: usize| {
            Value::Array(
                (0..n)
                    .map(|i| {
                        Value::Array(vec![
                            Value::BulkString(format!("{i}-0").into_bytes()),
                            Value::Array(vec![
                                Value::BulkString(b"o".to_vec()),
                                Value::BulkString(format!("{}:1:9:1:100:7", i + 1).into_bytes()),
                            ]),
                        ])
                    })
                    .collect(),
            )
        };
        let reply = |sizes: &[usize]| {
            Value::Array(
                sizes
                    .iter()
                    .enumerate()
                    .map(|(i, n)| {
                        Value::Array(vec![
                            Value::BulkString(format!("s{i}").into_bytes()),
                            entries(*n),
                        ])
                    })
                    .collect(),
            )
        };
        let read = |sizes: &[usize], count| {
            let mut batch = Batch::default();
            collect_reply(reply(sizes), count, &mut batch);
            batch
        };
        assert!(!read(&[3, 4], 5).capped);
        assert_eq!(read(&[3, 4], 5).deliveries.len(), 7);
        assert!(
            read(&[3, 5], 5).capped,
            "one stream at its COUNT caps the read"
        );
        let resp3 = Value::Map(vec![(Value::BulkString(b"s".to_vec()), entries(2))]);
        let mut batch = Batch::default();
        collect_reply(resp3, 2, &mut batch);
        assert!(batch.capped);
    }
}
