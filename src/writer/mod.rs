//! The order writer: drains the order log into SQL. Each batch is one transaction
//! (insert idempotently, take the stock under a guard), then acknowledged in the log. A
//! batch that fails for a reason in the data is retried in halves until the bad entries
//! stand alone, so that one cannot hold up the others; they go to the dead letters.
//! Never acks an entry before its transaction has committed.

use crate::metrics::render_counter;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::gate::Gate;
use crate::metrics::Histogram;
use crate::model::NewOrder;
use crate::orderlog::{Batch, LogError, OrderLog, Receipt};
use crate::store::Store;

const RECLAIM_EVERY: Duration = Duration::from_secs(5);
/// A shared log's [`Writer::linger`]: in a Redis + PostgreSQL winners storm, 20 ms took
/// batches from about 100 orders to about 460 and the CPU of an order, all processes, down
/// by 9-28% (five pairs); longer waits cost less still but put p99 past 3x the mean wait
/// (docs/adr/0001). The local log lingers itself, on its own side of the read.
pub const SHARED_LOG_LINGER: Duration = Duration::from_millis(20);
/// How long the writer keeps trying to tell the gate of orders it wrote.
const CONFIRM_FOR: Duration = Duration::from_secs(30);

/// Counters and histograms for stats and metrics.
pub struct WriterStats {
    pub written: AtomicU64,
    pub duplicates: AtomicU64,
    pub batches: AtomicU64,
    pub dead_letters: AtomicU64,
    /// Orders SQL refused because they would take a buyer over the sale's limit: each one
    /// is a gate fault and an acknowledged order that was not kept. Alert on any.
    pub over_limit: AtomicU64,
    pub failed_batches: AtomicU64,
    /// Orders per committed transaction.
    pub batch_orders: Histogram,
    /// Seconds from the gate's acceptance to the commit in SQL.
    pub lag_seconds: Histogram,
}

impl WriterStats {
    /// What one commit wrote, and what it found written already.
    fn count(&self, outcome: &crate::store::WriteOutcome) {
        self.written
            .fetch_add(outcome.written as u64, Ordering::Relaxed);
        self.duplicates
            .fetch_add(outcome.duplicates as u64, Ordering::Relaxed);
    }
}

impl Default for WriterStats {
    fn default() -> Self {
        WriterStats {
            written: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            dead_letters: AtomicU64::new(0),
            over_limit: AtomicU64::new(0),
            failed_batches: AtomicU64::new(0),
            batch_orders: Histogram::new(crate::metrics::BATCH_BUCKETS),
            lag_seconds: Histogram::new(crate::metrics::LAG_BUCKETS),
        }
    }
}

pub struct Writer {
    pub log: Arc<dyn OrderLog>,
    pub store: Store,
    /// Told of every order once it is in SQL (see `Gate::confirm_written`).
    pub gate: Arc<dyn Gate>,
    pub batch_max: usize,
    pub stats: Arc<WriterStats>,
    /// Hold the writer fence while a batch is in hand (the log is in Redis, which a
    /// rebuild must not outrun; see `Store::hold_writer_fence`).
    pub fenced: bool,
    /// Shared by the loops of a process, taken before the linger and the fence and let go
    /// once the read has returned: the loops read in turn (the log has one blocking
    /// reader), and a loop waiting for its turn, or lingering, holds no fence, so a rebuild
    /// waits for one read, not for a queue of them. It keeps when the last read began and
    /// what it found (see `linger`).
    pub turn: Arc<tokio::sync::Mutex<ReadPace>>,
    /// How long after a read that found orders, but stopped short of as many as it asked
    /// for, the next read waits (from that read's start): the entries arriving meanwhile
    /// make one batch instead of several. Nobody waits for SQL (a buyer heard `ok` once the
    /// order log had the order), and each batch costs the instance, Redis and the database
    /// a round of calls whatever its size.
    pub linger: Duration,
}

/// The last read of a shared log, as the loops taking turns saw it.
#[derive(Debug, Default)]
pub struct ReadPace {
    /// When it began (ms, the process's clock).
    began_ms: i64,
    /// Whether it found entries, but not as many as it asked for.
    partial: bool,
    /// When the last reclaim of the process's loops began (0: none yet): one loop
    /// reclaims for all, every `RECLAIM_EVERY`.
    reclaimed_ms: i64,
}

type Turn = tokio::sync::OwnedMutexGuard<ReadPace>;

impl Writer {
    /// Runs until `stop` turns true or its sender is dropped (after the log has nothing in
    /// hand), or the log is closed and drained.
    pub async fn run(self, mut stop: watch::Receiver<bool>) {
        loop {
            if crate::stop::requested(&mut stop) || self.log.finished() {
                break;
            }
            let mut turn = self.turn.clone().lock_owned().await;
            if turn.reclaimed_ms == 0 {
                turn.reclaimed_ms = self.now();
            }
            tokio::select! {
                // Before the fence: an idle log costs no database round trips.
                _ = async {
                    self.linger(&turn).await;
                    self.log.until_worth_reading().await;
                } => {}
                // Stopping cuts the wait short; the loop's next turn sees the stop.
                _ = stop.changed() => {}
            }
            // From before the read until the batch is in SQL (or given up).
            let fence = if self.fenced {
                match self.store.hold_writer_fence().await {
                    Ok(fence) => fence,
                    Err(e) => {
                        drop(turn);
                        tracing::warn!(error = %e, "the database is unavailable; the order writer waits");
                        tokio::select! {
                            _ = self.sleep(Duration::from_secs(1)) => {}
                            _ = stop.changed() => {}
                        }
                        continue;
                    }
                }
            } else {
                None
            };
            let read_failed = self.step(turn).await;
            if let Err(e) = Store::release_writer_fence(fence).await {
                tracing::debug!(error = %e, "releasing the writer fence failed; its connection is dropped");
            }
            // Outside the fence: a rebuild (Redis lost its data, which is also what fails
            // the read) must not wait out this pause.
            if read_failed {
                tokio::select! {
                    _ = self.sleep(Duration::from_secs(1)) => {}
                    _ = stop.changed() => {}
                }
            }
        }
        tracing::info!("order writer stopped");
    }

    /// Waits out `linger` after a read that found part of a batch, before the fence is
    /// taken: a storm's entries then come in batches several times larger. A read that
    /// found nothing (a quiet sale: the next one blocks until an order comes) or a full
    /// batch (a backlog) is followed at once.
    async fn linger(&self, last: &ReadPace) {
        if self.linger.is_zero() || !last.partial {
            return;
        }
        let linger = self.linger.as_millis() as i64;
        // At most the whole linger, should the clock have stepped back since.
        let left = (linger - (self.now() - last.began_ms)).min(linger);
        if left > 0 {
            self.sleep(Duration::from_millis(left as u64)).await;
        }
    }

    /// Now, by the process's clock (the store's).
    fn now(&self) -> i64 {
        self.store.now_ms()
    }

    /// A wait on the process's clock: a simulated one moves on at once.
    fn sleep(&self, d: Duration) -> crate::clock::Sleep {
        self.store.clock().sleep(d)
    }

    /// One read of the log (a reclaim every few seconds, a new batch otherwise), written
    /// and settled; the turn is let go once the read has returned. Whether the read failed
    /// (the caller waits a while before the next).
    async fn step(&self, mut turn: Turn) -> bool {
        if self.now() - turn.reclaimed_ms >= RECLAIM_EVERY.as_millis() as i64 {
            turn.reclaimed_ms = self.now();
            let reclaimed = self.log.reclaim(self.batch_max).await;
            drop(turn);
            match reclaimed {
                Ok(batch) if !batch.is_empty() => {
                    tracing::info!(
                        entries = batch.deliveries.len(),
                        "reclaimed pending order entries"
                    );
                    self.process(batch).await;
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "reclaim failed"),
            }
            return false;
        }
        let began_ms = self.now();
        let read = self.log.next_batch(self.batch_max).await;
        turn.began_ms = began_ms;
        turn.partial = read
            .as_ref()
            .is_ok_and(|b| !b.deliveries.is_empty() && !b.capped);
        drop(turn);
        match read {
            Ok(batch) if batch.is_empty() => false,
            Ok(batch) => {
                self.process(batch).await;
                false
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading the order log failed; retrying");
                true
            }
        }
    }

    /// Writes the orders the log kept from an earlier run, before anything else reads SQL
    /// as the truth (the gate is rebuilt from it). Gives up after `limit`.
    pub async fn drain_recovered(&self, limit: Duration) -> Result<(), LogError> {
        let deadline = self.now() + limit.as_millis() as i64;
        while self.log.recovering() {
            if self.now() > deadline {
                return Err(LogError::WriteFailed(format!(
                    "the orders recovered from the order log were not all written to SQL in {limit:?}"
                )));
            }
            let batch = self.log.next_batch(self.batch_max).await?;
            self.process(batch).await;
        }
        Ok(())
    }

    /// Writes one batch and settles every entry in it: acked, left for retry, or dead.
    pub async fn process(&self, batch: Batch) {
        for m in batch.malformed {
            self.dead_letter(m.receipt, &m.reason).await;
        }
        if batch.deliveries.is_empty() {
            return;
        }
        let (orders, receipts): (Vec<NewOrder>, Vec<Receipt>) = batch
            .deliveries
            .into_iter()
            .map(|d| (d.order, d.receipt))
            .unzip();
        let mut outcomes: Vec<Outcome> = vec![Outcome::Retry; orders.len()];
        // A read of batch entries may hold many times `batch_max` orders: one transaction
        // each at most `batch_max` (or one entry), cut between entries.
        let mut groups = by_entries(orders, &receipts, self.batch_max);
        groups.reverse();
        while let Some((orders, at)) = groups.pop() {
            match self.store.write_orders(&orders).await {
                Ok(outcome) => {
                    self.count_written(&orders, &outcome);
                    self.confirm(&orders).await;
                    for &i in &at {
                        outcomes[i] = Outcome::Written;
                    }
                }
                // The rest of the read waits too: the next transactions would most likely
                // fail the same way, each after its own timeout.
                Err(e) if e.is_transient() => {
                    self.stats.failed_batches.fetch_add(1, Ordering::Relaxed);
                    let waiting: Vec<usize> = at
                        .into_iter()
                        .chain(groups.drain(..).flat_map(|(_, at)| at))
                        .collect();
                    tracing::warn!(error = %e, orders = waiting.len(), "order batch failed; will retry");
                    let retried = waiting.iter().map(|&i| receipts[i].clone()).collect();
                    if let Err(e) = self.log.retry_later(retried, &e.to_string()).await {
                        tracing::warn!(error = %e, "could not mark the batch for retry");
                    }
                    self.sleep(Duration::from_millis(200)).await;
                }
                // A batch that fails for a reason in its data is halved until the orders at
                // fault stand alone: a few dozen commits for one bad order in 20,000.
                Err(e) if orders.len() > 1 => {
                    tracing::warn!(error = %e, orders = orders.len(), "order batch failed; writing it in halves");
                    self.stats.failed_batches.fetch_add(1, Ordering::Relaxed);
                    let (first, second) = halves((orders, at), &receipts);
                    groups.push(second);
                    groups.push(first);
                }
                Err(e) => {
                    self.stats.failed_batches.fetch_add(1, Ordering::Relaxed);
                    for (order, i) in orders.into_iter().zip(at) {
                        outcomes[i] = self.refused(order, &e);
                    }
                }
            }
        }
        self.settle(receipts, outcomes).await;
    }

    /// Counts what a committed batch wrote.
    fn count_written(&self, orders: &[NewOrder], outcome: &crate::store::WriteOutcome) {
        debug_assert_eq!(
            outcome.written + outcome.duplicates,
            orders.len(),
            "invariant 4: every order of a batch is written once or found written"
        );
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        self.stats.batch_orders.observe(orders.len() as f64);
        let now = self.store.now_ms();
        for o in orders {
            self.stats
                .lag_seconds
                .observe((now - o.accepted_at).max(0) as f64 / 1000.0);
        }
        self.stats.count(outcome);
    }

    /// Settles each entry once all its orders are decided (the orders of a batch entry
    /// share it): acknowledged when every one is in SQL, its refused orders set aside when
    /// the others are, and left pending when any waits for a retry (the written ones are
    /// found written when it comes back).
    async fn settle(&self, receipts: Vec<Receipt>, outcomes: Vec<Outcome>) {
        // Each entry once, in the order first seen, and the entry of each order.
        let mut entries: Vec<(Receipt, usize)> = Vec::new();
        let mut entry_of = Vec::with_capacity(receipts.len());
        let mut shared: HashMap<(String, String), usize> = HashMap::new();
        for receipt in receipts {
            let key = receipt
                .shared_entry()
                .map(|(stream, id)| (stream.to_string(), id.to_string()));
            if let Some(&at) = key.as_ref().and_then(|k| shared.get(k)) {
                entries[at].1 += 1;
                entry_of.push(at);
                continue;
            }
            if let Some(key) = key {
                shared.insert(key, entries.len());
            }
            entry_of.push(entries.len());
            entries.push((receipt, 1));
        }
        let mut waits = vec![false; entries.len()];
        let mut refused: HashMap<usize, Vec<(NewOrder, String, bool)>> = HashMap::new();
        for (outcome, &at) in outcomes.into_iter().zip(&entry_of) {
            match outcome {
                Outcome::Written => {}
                Outcome::Retry => waits[at] = true,
                Outcome::Refused(order, reason, over_limit) => refused
                    .entry(at)
                    .or_default()
                    .push((*order, reason, over_limit)),
            }
        }
        let mut acks = Vec::new();
        for (at, (receipt, orders)) in entries.into_iter().enumerate() {
            if waits[at] {
                continue;
            }
            let Some(set_aside) = refused.remove(&at) else {
                acks.push(receipt);
                continue;
            };
            // Counted when set aside, not when refused: an entry left for a retry is
            // refused again when it comes back.
            let over_limit = set_aside.iter().filter(|o| o.2).count() as u64;
            let set_aside: Vec<(NewOrder, String)> =
                set_aside.into_iter().map(|(o, r, _)| (o, r)).collect();
            match set_aside.as_slice() {
                // The entry's only order: the entry itself is set aside, as it stands.
                [(_, reason)] if orders == 1 => {
                    self.stats
                        .over_limit
                        .fetch_add(over_limit, Ordering::Relaxed);
                    self.dead_letter(receipt, reason).await;
                }
                _ => match self.log.dead_letter_orders(receipt, &set_aside).await {
                    Ok(()) => {
                        let n = set_aside.len() as u64;
                        self.stats.dead_letters.fetch_add(n, Ordering::Relaxed);
                        self.stats
                            .over_limit
                            .fetch_add(over_limit, Ordering::Relaxed);
                    }
                    Err(e) => {
                        tracing::error!(error = %e, orders = set_aside.len(), "could not dead-letter orders of an entry; it stays pending");
                    }
                },
            }
        }
        if !acks.is_empty() {
            self.ack(acks).await;
        }
    }

    /// An order SQL refuses for a reason in it, alone in its transaction: to be set aside.
    fn refused(&self, order: NewOrder, e: &crate::store::StoreError) -> Outcome {
        let over_limit = matches!(e, crate::store::StoreError::UserLimit { .. });
        let reason = format!("order {} of sale {}: {e}", order.id, order.sale_id);
        Outcome::Refused(Box::new(order), reason, over_limit)
    }

    /// Tells the gate these orders are in SQL (duplicates too: their first writer may have
    /// died before telling it). Retried for a while: a gate rebuilt while this writer held
    /// the orders would otherwise miss them. Before the entries are acknowledged, so that
    /// if this process dies here, their redelivery tells the gate again.
    async fn confirm(&self, orders: &[NewOrder]) {
        let mut backoff =
            crate::backoff::Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let give_up_at = self.now() + CONFIRM_FOR.as_millis() as i64;
        loop {
            match self.gate.confirm_written(orders).await {
                Ok(()) => return,
                Err(e) if self.now() < give_up_at => {
                    tracing::debug!(error = %e, "could not confirm written orders to the gate; retrying");
                }
                Err(e) => {
                    tracing::error!(error = %e, orders = orders.len(), "could not confirm written orders to the gate");
                    return;
                }
            }
            self.sleep(backoff.next_wait()).await;
        }
    }

    async fn ack(&self, receipts: Vec<Receipt>) {
        // An ack lost here is harmless: the entry is redelivered and found already written.
        if let Err(e) = self.log.ack(receipts).await {
            tracing::warn!(error = %e, "ack failed; entries will be redelivered and skipped");
        }
    }

    async fn dead_letter(&self, receipt: Receipt, reason: &str) {
        self.stats.dead_letters.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.log.dead_letter(receipt, reason).await {
            tracing::error!(error = %e, reason, "could not dead-letter an entry; it stays pending");
        }
    }
}
/// What became of one order of a batch.
#[derive(Debug, Clone)]
enum Outcome {
    Written,
    /// Left for a later attempt (or not tried: the batch gave up first).
    Retry,
    /// Refused by SQL for a reason in it, with the reason, and whether it would have
    /// taken its buyer over the limit.
    Refused(Box<NewOrder>, String, bool),
}

/// Orders with their places in the batch, in the same order.
type Group = (Vec<NewOrder>, Vec<usize>);

/// Whether two orders of a read came from one entry (a batch entry of the Redis log).
fn same_entry(a: &Receipt, b: &Receipt) -> bool {
    matches!((a.shared_entry(), b.shared_entry()), (Some(x), Some(y)) if x == y)
}

/// A read's orders (an entry's orders next to each other, as the log reads them) cut into
/// groups of whole entries, each of at most `max` orders or of one entry: a group that
/// fails for a passing reason (its orders wait for a retry) then leaves no entry with some
/// orders in SQL and others not, which the audit would count twice until the retry.
fn by_entries(orders: Vec<NewOrder>, receipts: &[Receipt], max: usize) -> Vec<Group> {
    // Where each entry begins.
    let starts: Vec<usize> = (0..receipts.len())
        .filter(|&i| i == 0 || !same_entry(&receipts[i - 1], &receipts[i]))
        .collect();
    let mut groups: Vec<Group> = Vec::new();
    let mut current: Group = (Vec::new(), Vec::new());
    let mut orders = orders.into_iter();
    for (n, &start) in starts.iter().enumerate() {
        let end = starts.get(n + 1).copied().unwrap_or(receipts.len());
        if !current.0.is_empty() && current.0.len() + (end - start) > max.max(1) {
            groups.push(std::mem::take(&mut current));
        }
        current.0.extend(orders.by_ref().take(end - start));
        current.1.extend(start..end);
    }
    if !current.0.is_empty() {
        groups.push(current);
    }
    groups
}

/// A failed batch cut in two, each half with its places, between two entries where it
/// holds more than one (at the cut nearest its middle), else in its middle.
fn halves((mut orders, mut at): Group, receipts: &[Receipt]) -> (Group, Group) {
    let middle = orders.len() / 2;
    let cuts = (1..orders.len()).filter(|&k| !same_entry(&receipts[at[k - 1]], &receipts[at[k]]));
    let cut = cuts.min_by_key(|&k| k.abs_diff(middle)).unwrap_or(middle);
    let later = (orders.split_off(cut), at.split_off(cut));
    ((orders, at), later)
}

impl WriterStats {
    /// Its series in Prometheus text.
    pub fn render(&self, out: &mut String) {
        for (name, help, v) in [
            (
                "seckill_writer_orders_written_total",
                "Orders inserted by this process's writer.",
                &self.written,
            ),
            (
                "seckill_writer_duplicates_total",
                "Redelivered orders found already written.",
                &self.duplicates,
            ),
            (
                "seckill_writer_batches_total",
                "Committed writer batches.",
                &self.batches,
            ),
            (
                "seckill_writer_failed_batches_total",
                "Writer batches that failed.",
                &self.failed_batches,
            ),
            (
                "seckill_writer_dead_letters_total",
                "Order log entries moved to dead letters.",
                &self.dead_letters,
            ),
            (
                "seckill_writer_refused_over_limit_total",
                "Orders SQL refused as over the buyer's limit: a gate fault; alert on any.",
                &self.over_limit,
            ),
        ] {
            render_counter(name, help, v.load(Ordering::Relaxed), out);
        }
        self.batch_orders.render(
            "seckill_writer_batch_orders",
            "Orders per committed writer transaction.",
            out,
        );
        self.lag_seconds.render(
            "seckill_order_log_lag_seconds",
            "From the gate's acceptance to the commit in SQL.",
            out,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(id: i64) -> NewOrder {
        NewOrder {
            id,
            sale_id: 1,
            user_id: id,
            quantity: 1,
            price_cents: 100,
            accepted_at: 0,
            retry_key: None,
        }
    }

    /// Orders 0.. of stream entries of these sizes, each order with its entry's receipt.
    fn read(sizes: &[usize]) -> (Vec<NewOrder>, Vec<Receipt>) {
        let receipts: Vec<Receipt> = sizes
            .iter()
            .enumerate()
            .flat_map(|(entry, &n)| {
                (0..n).map(move |_| Receipt::Stream {
                    stream: "s".into(),
                    id: format!("{entry}-0"),
                })
            })
            .collect();
        ((0..receipts.len() as i64).map(order).collect(), receipts)
    }

    fn sizes(groups: &[Group]) -> Vec<usize> {
        groups.iter().map(|g| g.0.len()).collect()
    }

    #[test]
    fn a_read_is_cut_between_entries_into_groups_of_at_most_max() {
        let (orders, receipts) = read(&[3, 1, 1, 3, 2]);
        let groups = by_entries(orders, &receipts, 3);
        assert_eq!(sizes(&groups), [3, 2, 3, 2]);
        let places: Vec<usize> = groups.iter().flat_map(|g| g.1.clone()).collect();
        assert_eq!(places, (0..10).collect::<Vec<_>>());
        assert!(groups
            .iter()
            .all(|(orders, at)| orders.iter().zip(at).all(|(o, &i)| o.id == i as i64)));
        // An entry larger than the most stands alone; orders of no shared entry are chunks.
        let (orders, receipts) = read(&[5, 1]);
        assert_eq!(sizes(&by_entries(orders, &receipts, 2)), [5, 1]);
        let local: Vec<Receipt> = (0..5)
            .map(|i| Receipt::Local {
                order: order(i),
                segment: 0,
            })
            .collect();
        let orders = (0..5).map(order).collect();
        assert_eq!(sizes(&by_entries(orders, &local, 2)), [2, 2, 1]);
    }

    #[test]
    fn a_failed_group_is_halved_between_entries_where_it_can_be() {
        let (orders, receipts) = read(&[1, 4, 3]);
        let group = (orders, (0..8).collect());
        let (first, second) = halves(group, &receipts);
        assert_eq!((first.0.len(), second.0.len()), (5, 3), "the cut nearest 4");
        // One entry alone is cut in its middle, to find its bad order.
        let (orders, receipts) = read(&[5]);
        let (first, second) = halves((orders, (0..5).collect()), &receipts);
        assert_eq!((first.0.len(), second.0.len()), (2, 3));
    }
}
