//! Background duties on a one-second tick: refresh each instance's sale cache from SQL,
//! preload approved sales into the gate before they open (never overwriting live stock),
//! expire orders past their payment deadline, hand returned stock back to the gate, and
//! point the order writer at the streams of current sales. Reads SQL, writes only to
//! the gate's load step; never on the purchase path.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::watch;

use crate::gate::{Gate, GateError, SaleLoad};
use crate::model::Sale;
use crate::orderlog::redis_stream::StreamLog;
use crate::store::{Store, StoreError};

/// Sales ended longer ago than this drop out of caches and stream watching.
pub const KEEP_ENDED_MS: i64 = 7 * 86_400_000;

#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Gate(#[from] GateError),
    #[error(transparent)]
    Log(#[from] crate::orderlog::LogError),
    #[error(transparent)]
    Lifecycle(#[from] crate::lifecycle::LifecycleError),
}

/// Each instance's copy of the approved sales, so that the edge answers sale lookups and
/// window checks without SQL.
#[derive(Default)]
pub struct SaleCache {
    sales: RwLock<HashMap<i64, Arc<Sale>>>,
    /// Sales being loaded into the gate right now: one load at a time per sale, so that a
    /// crowd meeting an empty gate (Redis lost its data) triggers one rebuild, not thousands.
    loading: std::sync::Mutex<std::collections::HashSet<i64>>,
    /// When a miss last refreshed the cache (Unix ms), and the lock that makes one miss
    /// refresh for all: unknown ids cost at most a few queries a second, whatever the load.
    miss_refreshed_at: std::sync::atomic::AtomicI64,
    miss_refresh: tokio::sync::Mutex<()>,
}

/// Least time between two refreshes caused by cache misses.
const MISS_REFRESH_EVERY_MS: i64 = 250;

impl SaleCache {
    pub fn get(&self, id: i64) -> Option<Arc<Sale>> {
        self.sales
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
    }

    pub fn all(&self) -> Vec<Arc<Sale>> {
        let mut v: Vec<_> = self
            .sales
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        v.sort_by_key(|s| (s.begins_at, s.id));
        v
    }

    pub fn replace(&self, sales: Vec<Sale>) {
        let map = sales.into_iter().map(|s| (s.id, Arc::new(s))).collect();
        *self.sales.write().unwrap_or_else(|p| p.into_inner()) = map;
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
        let now = crate::now_ms();
        if now - self.miss_refreshed_at.load(Ordering::Acquire) >= MISS_REFRESH_EVERY_MS {
            self.miss_refreshed_at.store(now, Ordering::Release);
            self.refresh(store).await?;
        }
        Ok(self.get(id))
    }

    pub async fn refresh(&self, store: &Store) -> Result<(), StoreError> {
        let sales = store
            .approved_sales(crate::now_ms() - KEEP_ENDED_MS)
            .await?;
        self.replace(sales);
        Ok(())
    }
}

/// Loads one sale into the gate from SQL, unless the gate has it or another task of this
/// process is loading it already.
pub async fn load_sale(
    store: &Store,
    gate: &dyn Gate,
    cache: &SaleCache,
    sale: &Sale,
) -> Result<bool, SchedulerError> {
    let claimed = cache
        .loading
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(sale.id);
    if !claimed {
        return Ok(false);
    }
    let result = load_unclaimed(store, gate, sale).await;
    cache
        .loading
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&sale.id);
    result
}

async fn load_unclaimed(
    store: &Store,
    gate: &dyn Gate,
    sale: &Sale,
) -> Result<bool, SchedulerError> {
    if gate.is_loaded(sale.id).await? {
        return Ok(false);
    }
    let (remaining, released) = store.stock_for_load(sale.id).await?;
    let buyers = store.live_buyers(sale.id).await?;
    let load = SaleLoad {
        sale: sale.clone(),
        remaining,
        buyers,
        released,
    };
    let loaded = gate.load(&load).await?;
    if loaded {
        tracing::info!(
            sale = sale.id,
            remaining = sale.stock,
            buyers = load.buyers.len(),
            "sale loaded into the gate"
        );
    }
    Ok(loaded)
}

/// Loads every approved sale that opens within `ahead_ms` and has not ended.
pub async fn preload(
    store: &Store,
    gate: &dyn Gate,
    cache: &SaleCache,
    ahead_ms: i64,
) -> Result<usize, SchedulerError> {
    let now = crate::now_ms();
    let mut loaded = 0;
    for sale in cache.all() {
        if sale.ends_at > now
            && sale.begins_at <= now + ahead_ms
            && load_sale(store, gate, cache, &sale).await?
        {
            loaded += 1;
        }
    }
    Ok(loaded)
}

pub struct Scheduler {
    pub store: Store,
    pub gate: Arc<dyn Gate>,
    pub cache: Arc<SaleCache>,
    pub streams: Option<Arc<StreamLog>>,
    pub preload_ahead_ms: i64,
}

impl Scheduler {
    /// One pass of every duty.
    pub async fn tick(&self) -> Result<(), SchedulerError> {
        self.cache.refresh(&self.store).await?;
        preload(
            &self.store,
            self.gate.as_ref(),
            &self.cache,
            self.preload_ahead_ms,
        )
        .await?;
        let expired = crate::lifecycle::expire_due(&self.store).await?;
        let returned = crate::lifecycle::pump_returns(&self.store, self.gate.as_ref()).await?;
        if expired + returned > 0 {
            tracing::info!(
                expired,
                returned,
                "unpaid orders expired; stock handed back to the gate"
            );
        }
        if let Some(streams) = &self.streams {
            let ids: Vec<i64> = self.cache.all().iter().map(|s| s.id).collect();
            streams.watch(&ids).await?;
        }
        Ok(())
    }

    pub async fn run(self, mut stop: watch::Receiver<bool>) {
        loop {
            if let Err(e) = self.tick().await {
                tracing::warn!(error = %e, "scheduler tick failed");
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stop.changed() => {}
            }
            if *stop.borrow() {
                break;
            }
        }
    }
}
