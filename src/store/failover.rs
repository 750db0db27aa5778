//! Surviving a failover of the database to a replica that lacks its last commits (the
//! default, asynchronous replication): every change an answer or an acknowledgement
//! depends on (the writer's orders, payments, cancellations, expiries, sales, users) is
//! kept, after its commit, in a **failover window** outside the database (Redis, or a file
//! beside the order log) for `--db-failover-window-secs`. The window is settled against
//! the database's identity (PostgreSQL: system id and timeline; MySQL: server id, host and
//! port). When the identity changes under the processes (a replica promoted, a different
//! primary behind the same address), one process writes the whole window again into the
//! new primary, oldest first, each change idempotently, and settles the window against
//! the new identity; until then no process commits a write there (each write transaction
//! reads the identity it runs under and refuses another), so nothing new lands on top of
//! a history that lost its end.
//!
//! What it must never do: forget a change that may not have reached a replica (a change
//! leaves the window only by age, and only while the identity it was settled against still
//! answers), or write into a primary whose identity it has not settled.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use sqlx::Row;

use super::change::Change;
use super::payments::Payment;
use super::transitions::TransitionError;
use super::{Dialect, Store, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum WindowError {
    /// The window cannot be reached (Redis away, the file not writable).
    #[error("the failover window is unavailable: {0}")]
    Unavailable(String),
    /// The window was settled against another database since this process last looked (a
    /// failover): a change committed under the old identity is not taken.
    #[error("the failover window is settled against another database ({0}): a failover")]
    Moved(String),
}

/// What settling the window against a new identity found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Settled: it now names the new identity.
    Done,
    /// Changes were kept after the last one the caller applied: apply those first.
    More,
    /// Someone settled it against another identity meanwhile.
    Moved(String),
}

/// Where the window is kept: one record per change, oldest first, each under an id that
/// orders them; and the identity the window is settled against.
#[async_trait]
pub trait Window: Send + Sync {
    /// Keeps a change committed under `identity`. Refused (`Moved`) when the window is
    /// settled against another identity; settles it against `identity` when it is settled
    /// against none (a new window, or one whose Redis lost its data).
    async fn keep(&self, identity: &str, record: &str) -> Result<(), WindowError>;
    /// The identity the window is settled against.
    async fn settled(&self) -> Result<Option<String>, WindowError>;
    /// Up to `count` records after the one named `after` ("0": from the start), oldest
    /// first, as (id, record).
    async fn read(&self, after: &str, count: usize) -> Result<Vec<(String, String)>, WindowError>;
    /// Settles the window against `to` if it is still settled against `from` (`None`:
    /// against nothing) and holds no record after `last`.
    async fn settle(
        &self,
        from: Option<&str>,
        to: &str,
        last: &str,
    ) -> Result<Settled, WindowError>;
    /// Forgets the records older than `age`, if the window is still settled against
    /// `identity` (the caller has just seen that identity answer).
    async fn trim(&self, identity: &str, age: Duration) -> Result<(), WindowError>;
    /// Takes (or keeps) the lease of the one process that writes the window again.
    async fn lock(&self, token: &str, ttl: Duration) -> Result<bool, WindowError>;
    async fn unlock(&self, token: &str) -> Result<(), WindowError>;
}

/// How often the settler asks the database who it is, and how long a write that met
/// another identity waits at most before it is told to try again.
const SETTLE_EVERY: Duration = Duration::from_millis(500);
/// How often the window's old records are trimmed.
const TRIM_EVERY_MS: i64 = 5_000;
/// Records read from the window at once while it is written again.
const REPLAY_CHUNK: usize = 200;
/// Tries of one change whose replay fails for a passing reason (about 5 s in all) before
/// the replay gives up and starts over.
const REPLAY_TRIES: u32 = 9;
/// How long a write that met an identity not settled yet waits for the settle.
pub(super) const WRITE_WAITS_FOR_SETTLE: Duration = Duration::from_secs(3);
/// The replay's lease: renewed after each chunk, so a replay that dies is taken over
/// within this.
const REPLAY_LEASE: Duration = Duration::from_secs(10);

/// The failover state a store and its clones share.
pub struct Failover {
    window: OnceLock<Arc<dyn Window>>,
    keep_for: Mutex<Duration>,
    /// The identity this process's writes may commit under: the one the window was last
    /// seen settled against, with the database answering as it. `None`: not known yet.
    expected: Mutex<Option<String>>,
    /// Whether the database answers as the identity the window is settled against (false
    /// while a failover's window is being written again, or before the first settle).
    settled: AtomicBool,
    /// Told when a write met another identity, so that the settler looks at once.
    wake: tokio::sync::Notify,
    last_trim_ms: AtomicU64,
    pub stats: FailoverStats,
}

/// What `/metrics` shows of failovers.
#[derive(Default)]
pub struct FailoverStats {
    pub failovers: AtomicU64,
    pub kept: AtomicU64,
    pub keep_failures: AtomicU64,
    pub replayed: AtomicU64,
    pub unapplied: AtomicU64,
    pub refused_writes: AtomicU64,
    /// Orders a replay wrote that the database lacked.
    pub orders_written_again: AtomicU64,
}

impl Default for Failover {
    fn default() -> Self {
        Failover {
            window: OnceLock::new(),
            keep_for: Mutex::new(Duration::from_secs(300)),
            expected: Mutex::new(None),
            settled: AtomicBool::new(false),
            wake: tokio::sync::Notify::new(),
            last_trim_ms: AtomicU64::new(0),
            stats: FailoverStats::default(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Failover {
    fn window(&self) -> Option<&Arc<dyn Window>> {
        self.window.get()
    }

    pub(super) fn window_is_kept(&self) -> bool {
        self.window.get().is_some()
    }

    fn expected(&self) -> Option<String> {
        lock(&self.expected).clone()
    }

    fn expect(&self, identity: &str) {
        *lock(&self.expected) = Some(identity.to_string());
        self.settled.store(true, Ordering::Relaxed);
    }

    /// Its series in Prometheus text.
    pub fn render(&self, out: &mut String) {
        if self.window().is_none() {
            return;
        }
        let s = &self.stats;
        for (name, help, v) in [
            (
                "seckill_database_failovers_total",
                "Changes of the database's identity (a failover) this process settled the failover window after.",
                &s.failovers,
            ),
            (
                "seckill_failover_window_kept_total",
                "Changes this process kept in the failover window after their commit.",
                &s.kept,
            ),
            (
                "seckill_failover_window_keep_failures_total",
                "Commits whose change could not be kept in the failover window (the caller was told to try again).",
                &s.keep_failures,
            ),
            (
                "seckill_failover_window_replayed_total",
                "Changes this process wrote again into a new primary after a failover.",
                &s.replayed,
            ),
            (
                "seckill_failover_window_unapplied_total",
                "Changes of the window a new primary refused even when written again: alert on any.",
                &s.unapplied,
            ),
            (
                "seckill_failover_window_orders_written_again_total",
                "Orders of the failover window a replay wrote because the database lacked them (lost in a failover).",
                &s.orders_written_again,
            ),
            (
                "seckill_failover_refused_writes_total",
                "Write transactions refused because the database's identity was not the settled one.",
                &s.refused_writes,
            ),
        ] {
            crate::metrics::render_counter(name, help, v.load(Ordering::Relaxed), out);
        }
        out.push_str(&format!(
            "# HELP seckill_database_settled Whether the database answers as the identity the failover window is settled against (0 while a failover's window is written again).\n# TYPE seckill_database_settled gauge\nseckill_database_settled {}\n",
            self.settled.load(Ordering::Relaxed) as u8
        ));
    }
}

impl Store {
    /// Keeps this store's changes in `window` for `keep_for` after their commit, and
    /// refuses writes under an identity the window is not settled against. Shared by every
    /// clone of the store; set once. SQLite has no replica to fail over to: no window.
    pub fn keep_changes_in(&self, window: Arc<dyn Window>, keep_for: Duration) {
        if self.dialect == Dialect::Sqlite || keep_for.is_zero() {
            return;
        }
        *lock(&self.failover.keep_for) = keep_for;
        let _ = self.failover.window.set(window);
    }

    /// The failover state (window, settled identity, counters).
    pub fn failover(&self) -> &Failover {
        &self.failover
    }

    /// Whether writes may commit now: no window is kept, or the database answers as the
    /// identity the window is settled against.
    pub fn settled(&self) -> bool {
        self.failover.window().is_none() || self.failover.settled.load(Ordering::Relaxed)
    }

    /// The identity of the database server this connection reaches; an error when it is a
    /// replica (a write would fail there anyway).
    async fn identity_on(&self, conn: &mut sqlx::AnyConnection) -> Result<String, StoreError> {
        let q = match self.dialect {
            Dialect::Sqlite => return Ok("sqlite".into()),
            // pg_current_wal_lsn() fails on a server in recovery; the WAL file name's
            // first eight digits are the timeline a promotion moves on.
            Dialect::Postgres => {
                "SELECT CAST(c.system_identifier AS TEXT) || '/' || \
                 substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) FROM pg_control_system() c"
            }
            Dialect::MySql => {
                "SELECT CONCAT(@@server_id, '/', @@hostname, ':', @@port, \
                 IF(@@read_only, '/read-only', ''))"
            }
        };
        let row = sqlx::query(q).fetch_one(&mut *conn).await.map_err(|e| {
            if matches!(&e, sqlx::Error::Database(_)) {
                StoreError::NotPrimary(e.to_string())
            } else {
                StoreError::from(e)
            }
        })?;
        let identity: String = row.try_get(0)?;
        if identity.ends_with("/read-only") {
            return Err(StoreError::NotPrimary(format!(
                "server {identity} is read-only (a replica)"
            )));
        }
        Ok(identity)
    }

    /// The identity of the database server the pool reaches now.
    pub async fn identity(&self) -> Result<String, StoreError> {
        let mut conn = self.pool.acquire().await?;
        self.identity_on(&mut conn).await
    }

    /// Inside a write transaction, before its work: the identity it runs under when a
    /// window is kept (`None` otherwise), refused unless it is the settled one.
    pub(super) async fn check_identity_in(
        &self,
        conn: &mut sqlx::AnyConnection,
    ) -> Result<Option<String>, StoreError> {
        if self.failover.window().is_none() {
            return Ok(None);
        }
        let found = self.identity_on(conn).await?;
        let expected = match &self.replay_as {
            Some(identity) => Some(identity.to_string()),
            None => self.failover.expected(),
        };
        if expected.as_deref() != Some(found.as_str()) {
            self.failover
                .stats
                .refused_writes
                .fetch_add(1, Ordering::Relaxed);
            self.failover.wake.notify_one();
            return Err(StoreError::Settling { found, expected });
        }
        Ok(Some(found))
    }

    /// After a commit under `identity`: the change kept in the window (not while the
    /// window itself is being written again: its changes are there already).
    pub(super) async fn keep(&self, identity: &str, change: &Change) -> Result<(), StoreError> {
        if self.replay_as.is_some() {
            return Ok(());
        }
        let Some(window) = self.failover.window() else {
            return Ok(());
        };
        let stats = &self.failover.stats;
        match window.keep(identity, &change.encode()).await {
            Ok(()) => {
                stats.kept.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                stats.keep_failures.fetch_add(1, Ordering::Relaxed);
                if matches!(e, WindowError::Moved(_)) {
                    self.failover.wake.notify_one();
                }
                Err(StoreError::Window(e.to_string()))
            }
        }
    }

    /// A store whose writes commit under `identity` and keep nothing: the one that writes
    /// the window again into a new primary.
    fn replaying_as(&self, identity: &str) -> Store {
        Store {
            replay_as: Some(Arc::from(identity)),
            ..self.clone()
        }
    }

    /// Runs until `stop`: settles the window against the database's identity every half
    /// second, at once when a write met another identity; trims it every few seconds.
    pub async fn run_failover_settler(self, mut stop: tokio::sync::watch::Receiver<bool>) {
        if self.failover.window().is_none() {
            return;
        }
        let token = format!("{:016x}", rand::random::<u64>());
        let failing = crate::logline::Every::new(30_000);
        loop {
            if let Err(e) = self.settle_once(&token).await {
                if let Some(left_out) = failing.ready() {
                    tracing::warn!(error = %e, left_out, "could not settle the failover window against the database; writes wait");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(SETTLE_EVERY) => {}
                _ = self.failover.wake.notified() => {}
                _ = stop.changed() => {}
            }
            if crate::stop::requested(&mut stop) {
                break;
            }
        }
    }

    /// One look: the database's identity against the window's. The same: writes go on
    /// (and old records are trimmed now and then). Another: the window is written again
    /// into this database, by one process at a time, then settled against it.
    pub async fn settle_once(&self, token: &str) -> Result<(), StoreError> {
        let Some(window) = self.failover.window() else {
            return Ok(());
        };
        let window_error = |e: WindowError| StoreError::Window(e.to_string());
        let current = self.identity().await?;
        let settled = window.settled().await.map_err(window_error)?;
        if settled.as_deref() == Some(current.as_str()) {
            self.failover.expect(&current);
            return self.trim_now_and_then(window.as_ref(), &current).await;
        }
        self.failover.settled.store(false, Ordering::Relaxed);
        // A window settled against nothing and holding nothing (new, or its Redis lost its
        // data) starts at this database; one holding changes is written into it first.
        if settled.is_none()
            && window
                .settle(None, &current, "0")
                .await
                .map_err(window_error)?
                == Settled::Done
        {
            tracing::info!(identity = %current, "failover window settled against the database");
            self.failover.expect(&current);
            return Ok(());
        }
        if !window
            .lock(token, REPLAY_LEASE)
            .await
            .map_err(window_error)?
        {
            // Another process writes the window again; this one waits for its settle.
            return Ok(());
        }
        let replayed = self
            .replay_window(window.as_ref(), settled.as_deref(), &current, token)
            .await
            .map(|_| ());
        let _ = window.unlock(token).await;
        if let Err(e) = replayed {
            tracing::warn!(error = %e, "writing the failover window into the new primary stopped; it starts over");
            return Err(e);
        }
        self.failover.expect(&current);
        Ok(())
    }

    /// Waits up to `limit` for this process to settle the window against `identity` (a
    /// write that met it waits here rather than fail at once: a replay takes a moment).
    pub(super) async fn until_settled_on(&self, identity: &str, limit: Duration) -> bool {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if self.failover.expected().as_deref() == Some(identity) {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            self.failover.wake.notify_one();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Writes the whole window again into the database as it is (idempotently), when the
    /// gate holds orders SQL lacks (the audit's finding): a failover the identity did not
    /// show, or one older than this process. Returns the orders it wrote that SQL lacked.
    pub async fn write_window_again(&self, token: &str) -> Result<u64, StoreError> {
        let Some(window) = self.failover.window() else {
            return Ok(0);
        };
        let window_error = |e: WindowError| StoreError::Window(e.to_string());
        let current = self.identity().await?;
        if window.settled().await.map_err(window_error)?.as_deref() != Some(current.as_str()) {
            // A failover under way: the settler writes the window again.
            self.failover.wake.notify_one();
            return Ok(0);
        }
        if !window
            .lock(token, REPLAY_LEASE)
            .await
            .map_err(window_error)?
        {
            return Ok(0);
        }
        let written = self
            .replay_window(window.as_ref(), Some(&current), &current, token)
            .await;
        let _ = window.unlock(token).await;
        written
    }

    async fn trim_now_and_then(
        &self,
        window: &dyn Window,
        identity: &str,
    ) -> Result<(), StoreError> {
        let now = self.now_ms();
        let last = self.failover.last_trim_ms.load(Ordering::Relaxed) as i64;
        if now - last < TRIM_EVERY_MS {
            return Ok(());
        }
        self.failover
            .last_trim_ms
            .store(now.max(0) as u64, Ordering::Relaxed);
        let keep_for = *lock(&self.failover.keep_for);
        window
            .trim(identity, keep_for)
            .await
            .map_err(|e| StoreError::Window(e.to_string()))
    }

    /// Writes every change of the window into the database now answering as `to`, oldest
    /// first, then settles the window against it (more records kept meanwhile are written
    /// too). Changes the database refuses in their place (a unit not back yet, an order
    /// not there yet) are tried again after the others, until none moves.
    async fn replay_window(
        &self,
        window: &dyn Window,
        from: Option<&str>,
        to: &str,
        token: &str,
    ) -> Result<u64, StoreError> {
        let window_error = |e: WindowError| StoreError::Window(e.to_string());
        let started = std::time::Instant::now();
        let failover = from != Some(to);
        if failover {
            tracing::warn!(
                from = from.unwrap_or("-"),
                to,
                "the database's identity changed (a failover, or another primary): writing the failover window again into it"
            );
        }
        let written_before = self
            .failover
            .stats
            .orders_written_again
            .load(Ordering::Relaxed);
        let writer = self.replaying_as(to);
        let mut after = "0".to_string();
        let mut applied = 0u64;
        let mut later: Vec<Change> = Vec::new();
        loop {
            let records = window
                .read(&after, REPLAY_CHUNK)
                .await
                .map_err(window_error)?;
            if records.is_empty() {
                writer.apply_until_settled(&mut later, &mut applied).await?;
                match window
                    .settle(from, to, &after)
                    .await
                    .map_err(window_error)?
                {
                    Settled::Done => break,
                    Settled::More => continue,
                    Settled::Moved(other) => {
                        return Err(StoreError::Window(format!(
                            "the failover window was settled against {other} meanwhile"
                        )))
                    }
                }
            }
            for (id, record) in records {
                after = id;
                match Change::decode(&record) {
                    Ok(change) => match writer.apply_patiently(&change).await? {
                        Applied::Done => applied += 1,
                        Applied::Later => later.push(change),
                    },
                    Err(e) => {
                        self.failover
                            .stats
                            .unapplied
                            .fetch_add(1, Ordering::Relaxed);
                        tracing::error!(record, error = %e, "a failover window record could not be read");
                    }
                }
            }
            if !window
                .lock(token, REPLAY_LEASE)
                .await
                .map_err(window_error)?
            {
                return Err(StoreError::Window(
                    "the failover window's replay lease was lost".into(),
                ));
            }
        }
        let stats = &self.failover.stats;
        if failover {
            stats.failovers.fetch_add(1, Ordering::Relaxed);
        }
        stats.replayed.fetch_add(applied, Ordering::Relaxed);
        let orders = stats.orders_written_again.load(Ordering::Relaxed) - written_before;
        tracing::warn!(
            to,
            changes = applied,
            orders_sql_lacked = orders,
            unapplied = later.len(),
            ms = started.elapsed().as_millis() as u64,
            "failover window written again into the database; writes go on"
        );
        Ok(orders)
    }

    /// The changes set aside, tried again while any of them applies; a batch of orders
    /// that still fails is tried order by order. What is left can never apply here: logged
    /// and counted (it stays in the window until it ages out).
    async fn apply_until_settled(
        &self,
        later: &mut Vec<Change>,
        applied: &mut u64,
    ) -> Result<(), StoreError> {
        let mut split = false;
        while !later.is_empty() {
            let before = later.len();
            let mut still = Vec::new();
            for change in later.drain(..) {
                match self.apply_patiently(&change).await? {
                    Applied::Done => *applied += 1,
                    Applied::Later => still.push(change),
                }
            }
            *later = still;
            if later.len() < before {
                continue;
            }
            if split {
                break;
            }
            // No progress as batches: one order at a time, so that one order that cannot
            // be written does not hold up the rest of its batch.
            split = true;
            *later = later
                .drain(..)
                .flat_map(|change| match change {
                    Change::Orders { orders } => orders
                        .into_iter()
                        .map(|o| Change::Orders { orders: vec![o] })
                        .collect(),
                    other => vec![other],
                })
                .collect();
        }
        for change in later.iter() {
            self.failover
                .stats
                .unapplied
                .fetch_add(1, Ordering::Relaxed);
            tracing::error!(change = ?change, "a change of the failover window could not be written into the new primary");
        }
        Ok(())
    }

    /// [`Store::apply`], tried again for a while when it fails for a passing reason: the
    /// first statements after a failover meet connections to the old primary, which the
    /// pool drops one by one.
    async fn apply_patiently(&self, change: &Change) -> Result<Applied, StoreError> {
        let mut tries = 0;
        loop {
            match self.apply(change).await {
                Err(e) if e.is_transient() && tries < REPLAY_TRIES => {
                    tries += 1;
                    tracing::debug!(error = %e, tries, "a failover window change failed for now; trying it again");
                    tokio::time::sleep(Duration::from_millis(100 * tries as u64)).await;
                }
                other => return other,
            }
        }
    }

    /// Applies one change of the window again. `Later`: refused by what the database holds
    /// now, which a change after it in the window may mend (a cancel before a resale's
    /// order, say). A passing failure is an error: the replay stops and starts over.
    async fn apply(&self, change: &Change) -> Result<Applied, StoreError> {
        let done = match change {
            Change::Orders { orders } => self.write_orders(orders).await.map(|outcome| {
                self.failover
                    .stats
                    .orders_written_again
                    .fetch_add(outcome.written as u64, Ordering::Relaxed);
            }),
            Change::Transition {
                order,
                owner,
                outcome,
                now,
                detail,
            } => transition_applied(
                self.transition(*order, *owner, *outcome, *now, detail)
                    .await
                    .map(|_| ()),
            ),
            Change::Expired { ids, now } => {
                transition_applied(self.expire_orders(ids, *now).await.map(|_| ()))
            }
            Change::PaymentOpened {
                intent,
                order,
                user,
                amount_cents,
                created_at,
            } => {
                let payment = Payment {
                    intent_id: *intent,
                    order_id: *order,
                    user_id: *user,
                    amount_cents: *amount_cents,
                    status: "created".into(),
                    created_at: *created_at,
                };
                self.open_payment(&payment).await.map(|_| ())
            }
            Change::PaymentSettled {
                intent,
                provider_ref,
                now,
            } => transition_applied(
                self.settle_payment(*intent, provider_ref, *now)
                    .await
                    .map(|_| ()),
            ),
            Change::PaymentFailed {
                intent,
                provider_ref,
                now,
            } => self
                .fail_payment(*intent, provider_ref, *now)
                .await
                .map(|_| ()),
            Change::SaleCreated { sale } => match self.sale(sale.id).await? {
                Some(_) => Ok(()),
                None => self.create_sale(sale).await,
            },
            Change::DraftUpdated { sale } => self.update_draft(sale).await.map(|_| ()),
            Change::DraftDeleted { id } => self.delete_draft(*id).await.map(|_| ()),
            Change::SaleApproved { id } => self.approve_sale(*id).await.map(|_| ()),
            Change::SalePaused { id, paused } => self.set_paused(*id, *paused).await,
            Change::SaleEnded { id, at } => self.end_early(*id, *at).await.map(|_| ()),
            Change::Users { users } => self.insert_users_again(users).await,
            Change::ApiKeyCreated { key } => self.create_api_key(key).await,
            // A later rotation or revocation found done, or superseded: nothing to do.
            Change::ApiKeyRotated {
                id,
                secret_sha256,
                now,
            } => self
                .rotate_api_key(*id, secret_sha256, *now)
                .await
                .map(|_| ()),
            Change::ApiKeyRevoked { id, now } => self.revoke_api_key(*id, *now).await.map(|_| ()),
        };
        match done {
            Ok(()) => Ok(Applied::Done),
            Err(e) if e.is_transient() => Err(e),
            Err(e) => {
                tracing::debug!(error = %e, "a failover window change was refused; tried again later");
                Ok(Applied::Later)
            }
        }
    }
}

/// What applying a change again came to.
enum Applied {
    Done,
    /// Not now: tried again after the changes that follow it.
    Later,
}

/// A transition applied again: refused as illegal, it happened already (or a later change
/// superseded it); its order missing, it waits for the order's batch.
fn transition_applied(done: Result<(), TransitionError>) -> Result<(), StoreError> {
    match done {
        Ok(()) | Err(TransitionError::Illegal { .. }) => Ok(()),
        Err(TransitionError::NoSuchOrder(_)) => Err(StoreError::NotFound),
        Err(TransitionError::Store(e)) => Err(e),
    }
}
