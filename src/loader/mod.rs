//! The sale loader and the catalogue: each process's cache of the approved sales (read on
//! every purchase, without SQL), and the load of a sale into the gate from SQL, one at a
//! time per sale, fenced against other processes' loads. Called by the scheduler's
//! preload, the purchase path (a sale the gate lost), approvals and repairs. Reads SQL
//! and writes only the gate's load step; decides no purchase.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::gate::{Gate, GateError, LoadStart, LoadTicket, SaleLoad, SegmentCheck};
use crate::model::{BySale, Sale};
use crate::store::journal::{Cause, Movement};
use crate::store::{SalesMark, Store, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Gate(#[from] GateError),
    #[error(
        "sale {0} segment {1}: another process has been loading it into the gate for too long"
    )]
    Stuck(i64, i64),
    #[error("sale {0} segment {1}: the load did not end in time and was given up")]
    TooLong(i64, i64),
}

/// Sales ended longer ago than this drop out of caches and stream watching.
pub const KEEP_ENDED_MS: i64 = 7 * 86_400_000;
/// Sales ended longer ago than this drop out of the gate (a minute: returns of its last
/// moments settle, as the audit's last rounds do).
pub const KEEP_IN_GATE_AFTER_END_MS: i64 = 60_000;

/// Each instance's copy of the approved sales, so that the edge answers sale lookups and
/// window checks without SQL.
#[derive(Default)]
pub struct SaleCache {
    /// Every purchase reads this and it changes once a second at most: readers take no
    /// lock and write no shared cache line (an `RwLock` here was two contended atomic
    /// writes per purchase on two cores).
    sales: ArcSwap<BySale<Arc<Sale>>>,
    /// One load at a time per sale: a crowd meeting an empty gate (Redis lost its data)
    /// triggers one rebuild, not thousands, and an approval that meets the tick's load of
    /// the same sale waits for it instead of answering before the sale is in the gate.
    loading: std::sync::Mutex<HashMap<i64, Arc<tokio::sync::Mutex<()>>>>,
    /// When a miss last refreshed the cache (Unix ms), and the lock that makes one miss
    /// refresh for all: unknown ids cost at most a few queries a second, whatever the load.
    miss_refreshed_at: std::sync::atomic::AtomicI64,
    miss_refresh: tokio::sync::Mutex<()>,
    /// The mark of the sales last read: a refresh that finds the same reads nothing more
    /// (a thousand sales' rows, every second, were a sixth of an idle instance's work).
    mark: std::sync::Mutex<Option<SalesMark>>,
    /// One refresh at a time: two at once could leave the older read's sales under the
    /// newer read's mark, and nothing would read them again until the sales changed.
    refreshing: tokio::sync::Mutex<()>,
}

/// Least time between two refreshes caused by cache misses.
const MISS_REFRESH_EVERY_MS: i64 = 250;

impl SaleCache {
    pub fn get(&self, id: i64) -> Option<Arc<Sale>> {
        self.sales.load().get(id).cloned()
    }

    /// `f` of the sale, if cached, without taking a reference to it: the purchase path.
    pub fn with<R>(&self, id: i64, f: impl FnOnce(&Sale) -> R) -> Option<R> {
        self.sales.load().get(id).map(|sale| f(sale))
    }

    pub fn all(&self) -> Vec<Arc<Sale>> {
        let mut v: Vec<_> = self.sales.load().values().cloned().collect();
        v.sort_by_key(|s| (s.begins_at, s.id));
        v
    }

    pub fn load_lock(&self, id: i64) -> Arc<tokio::sync::Mutex<()>> {
        self.loading
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(id)
            .or_default()
            .clone()
    }

    pub fn replace(&self, sales: Vec<Sale>) {
        let map = sales.into_iter().map(|s| (s.id, Arc::new(s))).collect();
        self.sales.store(Arc::new(map));
        // Sales put here by hand are not SQL's: the next refresh reads SQL's.
        *self.mark.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// The sale, refreshing the cache first if it is missing: a sale approved on another
    /// instance moments ago is found without waiting for the next tick.
    pub async fn get_or_refresh(
        &self,
        id: i64,
        store: &Store,
    ) -> Result<Option<Arc<Sale>>, StoreError> {
        use std::sync::atomic::Ordering;
        if let Some(s) = self.get(id) {
            return Ok(Some(s));
        }
        let _one_at_a_time = self.miss_refresh.lock().await;
        if let Some(s) = self.get(id) {
            return Ok(Some(s));
        }
        let now = store.now_ms();
        if now - self.miss_refreshed_at.load(Ordering::Acquire) >= MISS_REFRESH_EVERY_MS {
            // Marked only once SQL answered: a refresh that failed says nothing of the
            // sale, and the next miss must ask again (503 meanwhile, never a 404 for a sale
            // another instance just created while this one could not reach SQL).
            self.refresh(store).await?;
            self.miss_refreshed_at.store(now, Ordering::Release);
        }
        Ok(self.get(id))
    }

    /// Reads the sales again if SQL's mark of them changed since the last read.
    pub async fn refresh(&self, store: &Store) -> Result<(), StoreError> {
        let _one_at_a_time = self.refreshing.lock().await;
        let ends_after = store.now_ms() - KEEP_ENDED_MS;
        // Marked before the read: a change between the two shows as a new mark next time.
        let mark = store.approved_sales_mark(ends_after).await?;
        if *self.mark.lock().unwrap_or_else(|p| p.into_inner()) == Some(mark) {
            return Ok(());
        }
        let sales = store.approved_sales(ends_after).await?;
        self.replace(sales);
        *self.mark.lock().unwrap_or_else(|p| p.into_inner()) = Some(mark);
        Ok(())
    }
}

/// Loads one sale into the gate from SQL unless the gate has it; if another task of this
/// process is loading it, waits for that load. A segment another process is loading is
/// left to that process: it is in the gate shortly, and purchases meanwhile answer
/// `not_loaded`.
pub async fn load_sale(
    store: &Store,
    gate: &dyn Gate,
    cache: &SaleCache,
    sale: &Sale,
) -> Result<bool, LoadError> {
    load_in_turn(store, gate, cache, sale, Elsewhere::LeaveIt).await
}

/// Like [`load_sale`], but when another process holds a segment's load lock, waits until
/// that load is installed (or its lease lapses and the load is done here): for callers that
/// read the gate right after, a repair or an approval, and must not see a half-built sale.
pub async fn load_sale_and_wait(
    store: &Store,
    gate: &dyn Gate,
    cache: &SaleCache,
    sale: &Sale,
) -> Result<bool, LoadError> {
    load_in_turn(store, gate, cache, sale, Elsewhere::WaitForIt).await
}

/// The load, after this process's other loads of the sale.
async fn load_in_turn(
    store: &Store,
    gate: &dyn Gate,
    cache: &SaleCache,
    sale: &Sale,
    elsewhere: Elsewhere,
) -> Result<bool, LoadError> {
    let lock = cache.load_lock(sale.id);
    let _one_at_a_time = lock.lock().await;
    load_under_lock(store, gate, sale, elsewhere).await
}

/// Like [`load_sale`], but returns at once if another task is loading the sale: for the
/// purchase path, whose caller is answered `not_loaded` and retries anyway.
pub async fn load_sale_unless_loading(
    store: &Store,
    gate: &dyn Gate,
    cache: &SaleCache,
    sale: &Sale,
) -> Result<bool, LoadError> {
    let lock = cache.load_lock(sale.id);
    let Ok(_one_at_a_time) = lock.try_lock() else {
        return Ok(false);
    };
    load_under_lock(store, gate, sale, Elsewhere::LeaveIt).await
}

/// What a load does about a segment another process is loading.
#[derive(Clone, Copy)]
enum Elsewhere {
    LeaveIt,
    WaitForIt,
}

/// A loader elsewhere renews its lease while it works and loses it when it dies, so the
/// wait ends by the lease at the latest; the bound only guards against a Redis that keeps
/// answering busy for another reason.
const WAIT_FOR_OTHER_LOADER: Duration = Duration::from_secs(40);

async fn load_under_lock(
    store: &Store,
    gate: &dyn Gate,
    sale: &Sale,
    elsewhere: Elsewhere,
) -> Result<bool, LoadError> {
    gate.know_segments(&[(sale.id, sale.segments)]);
    // Each segment of a segmented sale is loaded (and lost, and rebuilt) on its own.
    let mut loaded = false;
    let mut first_error = None;
    for segment in 0..sale.segments.max(1) {
        match load_segment(store, gate, sale, segment, elsewhere).await {
            Ok(l) => loaded |= l == PartLoad::Installed,
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(loaded),
    }
}

async fn load_segment(
    store: &Store,
    gate: &dyn Gate,
    sale: &Sale,
    segment: i64,
    elsewhere: Elsewhere,
) -> Result<PartLoad, LoadError> {
    let started = std::time::Instant::now();
    let mut interrupted = 0;
    loop {
        let part = load_part(store, gate, sale, segment).await?;
        match (part, elsewhere) {
            // Again, on the new master; a master that keeps changing is left to the next
            // attempt (the tick's, or a buyer's).
            (PartLoad::Interrupted, _) if interrupted < MAX_INTERRUPTED => interrupted += 1,
            (PartLoad::Interrupted, _) => return Err(LoadError::TooLong(sale.id, segment)),
            (PartLoad::LoadingElsewhere, Elsewhere::WaitForIt) => {
                if started.elapsed() >= WAIT_FOR_OTHER_LOADER {
                    return Err(LoadError::Stuck(sale.id, segment));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (part, _) => return Ok(part),
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum PartLoad {
    Installed,
    AlreadyLoaded,
    /// Another process holds the segment's load lock.
    LoadingElsewhere,
    /// The Redis master changed under the load: it was given up.
    Interrupted,
}

async fn load_part(
    store: &Store,
    gate: &dyn Gate,
    sale: &Sale,
    segment: i64,
) -> Result<PartLoad, LoadError> {
    let mut failover = crate::redis_client::sentinel::master_changes();
    // The lock comes before the SQL read: a load's snapshot is never older than its lock,
    // so orders written after it reach the gate through `Gate::confirm_written`.
    let ticket = match gate.begin_segment_load(sale.id, segment).await? {
        LoadStart::Ticket(ticket) => ticket,
        LoadStart::Loaded => return Ok(PartLoad::AlreadyLoaded),
        LoadStart::Busy => return Ok(PartLoad::LoadingElsewhere),
    };
    tracing::info!(
        sale = sale.id,
        segment,
        fence = ticket.fence,
        "loading the sale into the gate"
    );
    // To let the lock go if the load is given up (the ticket itself goes with the load).
    let lock = LoadTicket::locked(sale.id, segment, ticket.fence, ticket.owner.clone());
    let fence = ticket.fence;
    // A load that does not end (a stalled server), or whose master is replaced under it,
    // is given up and its lock let go (the ticket stops renewing it), so that the next
    // load starts on the master there is now.
    let install = tokio::time::timeout(
        LOAD_DEADLINE,
        snapshot_and_install(store, gate, sale, segment, ticket),
    );
    let (loaded, load, took) = tokio::select! {
        done = install => match done {
            Ok(done) => done?,
            Err(_) => {
                tracing::warn!(
                    sale = sale.id,
                    segment,
                    fence,
                    deadline_secs = LOAD_DEADLINE.as_secs(),
                    "a load of the sale did not end in time: given up, to be started again"
                );
                gate.abandon_load(lock).await;
                return Err(LoadError::TooLong(sale.id, segment));
            }
        },
        _ = failover.changed() => {
            tracing::warn!(
                sale = sale.id,
                segment,
                fence,
                "the Redis master changed under a load of the sale: given up, started again on the new master"
            );
            gate.abandon_load(lock).await;
            return Ok(PartLoad::Interrupted);
        }
    };
    if loaded {
        tracing::info!(
            sale = sale.id,
            segment,
            remaining = load.remaining,
            buyers = load.buyers.len(),
            orders = load.counted.len(),
            read_ms = took.read_ms,
            install_ms = took.install_ms,
            "sale loaded into the gate"
        );
        // The trail only (no stock moves): a failure to note it is logged, not fatal.
        let detail = format!("remaining {}, buyers {}", load.remaining, load.buyers.len());
        let note = Movement::new(sale.id, 0, Cause::Loaded)
            .segment(segment)
            .by("scheduler", &detail);
        if let Err(e) = store.journal_note(&[note]).await {
            tracing::warn!(sale = sale.id, error = %e, "could not journal the load");
        }
        // Returns that met this load under way were kept for it; the scheduler would hand
        // them over within a second, their buyers may buy again now.
        if let Err(e) = crate::lifecycle::pump_returns_of(store, gate, sale.id).await {
            tracing::debug!(sale = sale.id, error = %e, "returns left to the scheduler");
        }
        Ok(PartLoad::Installed)
    } else {
        // Fenced out: a newer load (or a forget) came after this one took its lock.
        Ok(PartLoad::LoadingElsewhere)
    }
}

/// Reads the segment's snapshot from SQL and installs it in the gate under `ticket`;
/// whether it was installed (not fenced out), what was loaded, and the install's time.
/// Dropped at any await, it lets the lock go: the ticket stops renewing it.
async fn snapshot_and_install(
    store: &Store,
    gate: &dyn Gate,
    sale: &Sale,
    segment: i64,
    ticket: LoadTicket,
) -> Result<(bool, SaleLoad, Took), LoadError> {
    let part = crate::store::Part {
        segments: sale.segments.max(1),
        segment,
    };
    let read = std::time::Instant::now();
    let snapshot = match read_while_staging(store, gate, part, sale.id, &ticket).await {
        Ok(snapshot) => snapshot,
        Err(e) => {
            gate.abandon_load(ticket).await;
            return Err(e);
        }
    };
    let load = SaleLoad {
        sale: sale.clone(),
        remaining: snapshot.stock,
        buyers: snapshot.buyers,
        released: snapshot.released,
        counted: snapshot.counted,
        segment,
        moves: snapshot.moves,
    };
    let read_ms = read.elapsed().as_millis() as u64;
    let started = std::time::Instant::now();
    let loaded = gate.finish_load(ticket, &load).await?;
    let took = Took {
        read_ms,
        install_ms: started.elapsed().as_millis() as u64,
    };
    Ok((loaded, load, took))
}

/// Reads the part's snapshot from SQL and hands the gate each chunk's buyers as it comes
/// (`Gate::stage_buyers`), so that the gate's work overlaps the read's. A snapshot not read
/// chunk by chunk (embedded, unfenced) leaves the ticket unmarked: the install takes every
/// buyer then.
async fn read_while_staging(
    store: &Store,
    gate: &dyn Gate,
    part: crate::store::Part,
    sale_id: i64,
    ticket: &LoadTicket,
) -> Result<crate::store::LoadSnapshot, LoadError> {
    let (chunks, arrive) = tokio::sync::mpsc::unbounded_channel::<Vec<(i64, i64)>>();
    let read = async move {
        let mut hand = |held: Vec<(i64, i64)>| {
            // Refused once the gate stopped taking chunks (it takes them whole, or failed).
            let _ = chunks.send(held);
        };
        store
            .load_part_snapshot_streamed(
                sale_id,
                part,
                WAIT_FOR_WRITERS,
                gate.keeps_order_ids(),
                Some(&mut hand),
            )
            .await
    };
    let stage = async move {
        // Owned here, so that the channel closes when staging stops.
        let mut arrive = arrive;
        while let Some(held) = arrive.recv().await {
            if !gate.stage_buyers(ticket, part.segments, &held).await? {
                break;
            }
        }
        Ok::<(), GateError>(())
    };
    // A read that was not handed out chunk by chunk (embedded, or unfenced after a stalled
    // writer) handed out nothing: the ticket stays unmarked and the install takes every buyer.
    let (read, staged) = tokio::join!(read, stage);
    let snapshot = read?;
    staged?;
    // The buyers of several orders were handed out once per order: now their totals.
    if ticket.buyers_staged() && !snapshot.repeat_buyers.is_empty() {
        gate.stage_buyers(ticket, part.segments, &snapshot.repeat_buyers)
            .await?;
    }
    Ok(snapshot)
}

/// How long a load's two steps took: the SQL snapshot (the wait for order writers
/// included) and the install in the gate.
struct Took {
    read_ms: u64,
    install_ms: u64,
}

/// Loads in a row given up for a change of master before the caller hears of it.
const MAX_INTERRUPTED: u32 = 3;

/// The most a load may take, from its lock to its install: the wait for order writers,
/// and time to read and install a sale of millions of orders.
const LOAD_DEADLINE: Duration = Duration::from_secs(60);

/// How long a rebuild waits for order writers holding batches read from Redis.
const WAIT_FOR_WRITERS: Duration = Duration::from_secs(15);

/// Loads every approved sale that opens within `ahead_ms` and has not ended, and rebuilds
/// every segment found loaded into another Redis server. Every segment of every such sale is
/// checked in one gate call (`Gate::check_segments`): a sale loaded and current costs no
/// call of its own.
pub async fn preload(
    store: &Store,
    gate: &dyn Gate,
    cache: &SaleCache,
    ahead_ms: i64,
) -> Result<usize, LoadError> {
    let now = store.now_ms();
    let sales: Vec<Arc<Sale>> = cache
        .all()
        .into_iter()
        .filter(|s| s.ends_at > now)
        .collect();
    let sizes: Vec<(i64, i64)> = sales.iter().map(|s| (s.id, s.segments)).collect();
    gate.know_segments(&sizes);
    let parts: Vec<(i64, i64)> = sales
        .iter()
        .flat_map(|s| (0..s.segments.max(1)).map(move |segment| (s.id, segment)))
        .collect();
    let mut checks = gate.check_segments(&parts).await.into_iter();
    let mut loaded = 0;
    let mut first_error = None;
    for sale in &sales {
        let sale_checks: Vec<_> = checks
            .by_ref()
            .take(sale.segments.max(1) as usize)
            .collect();
        // Each sale on its own: one whose Redis master is away must not keep the others
        // from being loaded or rebuilt.
        match preload_one(store, gate, cache, sale, sale_checks, now + ahead_ms).await {
            Ok(true) => loaded += 1,
            Ok(false) => {}
            Err(e) => {
                tracing::debug!(sale = sale.id, error = %e, "could not preload the sale");
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(loaded),
    }
}

/// Loads the sale if it opens before `opens_before` and a segment is not known to be
/// loaded, by `checks` (one per segment, in order).
async fn preload_one(
    store: &Store,
    gate: &dyn Gate,
    cache: &SaleCache,
    sale: &Sale,
    checks: Vec<Result<SegmentCheck, GateError>>,
    opens_before: i64,
) -> Result<bool, LoadError> {
    let mut whole = checks.len() == sale.segments.max(1) as usize;
    for (segment, check) in checks.into_iter().enumerate() {
        match check? {
            SegmentCheck::Loaded => {}
            SegmentCheck::Unloaded => whole = false,
            SegmentCheck::Forgotten => {
                whole = false;
                tracing::warn!(
                    sale = sale.id,
                    segment,
                    "the sale's gate was loaded into another Redis server (a failover, or a restart with older data): rebuilding it from SQL and its stream"
                );
            }
        }
    }
    Ok(sale.begins_at <= opens_before && !whole && load_sale(store, gate, cache, sale).await?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::memory::MemoryGate;

    async fn store_with_sale() -> (Store, Sale) {
        let dir = std::env::temp_dir().join(format!("seckill-sched-{}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        let store = Store::connect(&format!("sqlite://{}/s.db", dir.display()), 2)
            .await
            .unwrap();
        store.migrate().await.unwrap();
        let now = store.now_ms();
        let sale = Sale {
            id: 42,
            title: "t".into(),
            price_cents: 100,
            initial_stock: 5,
            stock: 5,
            per_user_limit: 1,
            begins_at: now - 1000,
            ends_at: now + 60_000,
            payment_window_secs: 60,
            approved: true,
            paused: false,
            updated_at: now,
            anti_bot: Default::default(),
            segments: 1,
            waiting_room: None,
            external_ref: None,
        };
        store.create_sale(&sale).await.unwrap();
        (store, sale)
    }

    /// The cache reads the sales again after each kind of change SQL makes to them, and
    /// only then: the same sales keep the same copies.
    #[tokio::test]
    async fn the_cache_reads_the_sales_again_when_and_only_when_they_changed() {
        let (store, sale) = store_with_sale().await;
        let cache = SaleCache::default();
        cache.refresh(&store).await.unwrap();
        let copy = || cache.get(sale.id).unwrap();
        let before = copy();
        cache.refresh(&store).await.unwrap();
        assert!(
            Arc::ptr_eq(&before, &copy()),
            "read again with nothing changed"
        );

        store.set_paused(sale.id, true).await.unwrap();
        cache.refresh(&store).await.unwrap();
        assert!(copy().paused, "a pause is seen");

        let order = crate::model::NewOrder {
            id: 7,
            sale_id: sale.id,
            user_id: 1,
            quantity: 1,
            price_cents: 100,
            accepted_at: store.now_ms(),
            retry_key: None,
        };
        store.write_orders(&[order]).await.unwrap();
        cache.refresh(&store).await.unwrap();
        assert_eq!(copy().stock, 4, "written orders' stock is seen");

        let other = Sale {
            id: 43,
            ..sale.clone()
        };
        store.create_sale(&other).await.unwrap();
        cache.refresh(&store).await.unwrap();
        assert!(cache.get(43).is_some(), "a new approved sale is seen");

        let ends = store.now_ms() + 1000;
        store.end_early(sale.id, ends).await.unwrap();
        cache.refresh(&store).await.unwrap();
        assert_eq!(copy().ends_at, ends, "an early end is seen");
        let after = copy();
        cache.refresh(&store).await.unwrap();
        assert!(
            Arc::ptr_eq(&after, &copy()),
            "read again with nothing changed"
        );
    }

    /// The race CI found: the tick held the sale's load when an approval asked for it, and
    /// the approval answered before the sale was in the gate.
    #[tokio::test]
    async fn a_load_that_meets_another_waits_for_it_and_returns_loaded() {
        let (store, sale) = store_with_sale().await;
        let (log, _reader) = crate::orderlog::local::channel();
        let gate = Arc::new(MemoryGate::new(log));
        let cache = Arc::new(SaleCache::default());
        let lock = cache.load_lock(sale.id);
        let held = lock.lock().await;
        let waiter = {
            let (store, gate, cache, sale) =
                (store.clone(), gate.clone(), cache.clone(), sale.clone());
            tokio::spawn(async move { load_sale(&store, gate.as_ref(), &cache, &sale).await })
        };
        // The purchase path does not wait: it answers `not_loaded` and its caller retries.
        assert!(
            !load_sale_unless_loading(&store, gate.as_ref(), &cache, &sale)
                .await
                .unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !waiter.is_finished(),
            "returned while another load held the sale"
        );
        assert!(!gate.is_loaded(sale.id).await.unwrap());
        drop(held);
        assert!(waiter.await.unwrap().unwrap());
        assert!(gate.is_loaded(sale.id).await.unwrap());
    }

    async fn remaining(gate: &MemoryGate) -> i64 {
        gate.stock(42).await.unwrap().unwrap().remaining
    }

    /// A memory gate is loaded from the live orders and the returns it is still owed, not
    /// from every order of the sale: a release of a return the snapshot counted back
    /// changes nothing, and an order live at the snapshot gives its unit back once.
    #[tokio::test]
    async fn a_memory_gate_loads_from_live_orders_and_returns_still_owed() {
        use crate::gate::{Release, Released};
        use crate::store::Outcome;
        let (store, sale) = store_with_sale().await;
        let now = crate::clock::wall_ms();
        let orders: Vec<crate::model::NewOrder> = (1..=3)
            .map(|user| crate::model::NewOrder {
                id: 1000 + user,
                sale_id: sale.id,
                user_id: user,
                quantity: 1,
                price_cents: 100,
                accepted_at: now,
                retry_key: None,
            })
            .collect();
        store.write_orders(&orders).await.unwrap();
        // Buyer 1 cancels (the return still owed); buyer 2 cancels and the gate took it.
        for o in &orders[..2] {
            store
                .transition(o.id, Some(o.user_id), Outcome::Cancelled, now, "test")
                .await
                .unwrap();
        }
        store.mark_returned(orders[1].id, now).await.unwrap();
        let snapshot = store
            .load_part_snapshot(sale.id, crate::store::Part::WHOLE, Duration::ZERO, false)
            .await
            .unwrap();
        assert_eq!(snapshot.buyers, [(3, 1)]);
        assert_eq!(snapshot.released, [orders[0].id], "only the owed return");
        assert!(
            snapshot.counted.is_empty(),
            "no order ids for a memory gate"
        );

        let (log, _reader) = crate::orderlog::local::channel();
        let gate = MemoryGate::new(log);
        assert!(load_sale(&store, &gate, &SaleCache::default(), &sale)
            .await
            .unwrap());
        assert_eq!(remaining(&gate).await, 4);
        let release = |o: &crate::model::NewOrder| Release {
            sale_id: sale.id,
            order_id: o.id,
            user_id: o.user_id,
            quantity: 1,
        };
        assert_eq!(
            gate.release(release(&orders[0])).await.unwrap(),
            Released::Before
        );
        assert_eq!(remaining(&gate).await, 4);
        store
            .transition(orders[2].id, Some(3), Outcome::Cancelled, now, "test")
            .await
            .unwrap();
        assert_eq!(
            gate.release(release(&orders[2])).await.unwrap(),
            Released::Now
        );
        assert_eq!(
            gate.release(release(&orders[2])).await.unwrap(),
            Released::Before
        );
        assert_eq!(remaining(&gate).await, 5);
    }
}
