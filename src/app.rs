//! Assembles the parts for a deployment. Embedded (no Redis): memory gate, local order log
//! (a folder bound to the database), SQLite, PostgreSQL or MySQL.
//! Distributed: Redis gate, Redis Stream order log, PostgreSQL or MySQL. Everything after
//! assembly (edge, writer, scheduler) is the same code for both.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::config::{Config, GateKind, PaymentProviderKind};
use crate::edge::auth::TokenSigner;
use crate::edge::{AppState, Metrics};
use crate::gate::breaker::Breaker;
use crate::gate::memory::MemoryGate;
use crate::gate::redis::RedisGate;
use crate::gate::soldout::{follow_stock_returns, SoldOutShortcut};
use crate::gate::sql::SqlGate;
use crate::gate::Gate;
use crate::ids::{self, IdGenerator};
use crate::lifecycle::payment::{PaymentProvider, RedirectProvider, SimulatedProvider};
use crate::loader::SaleCache;
use crate::orderlog::redis_stream::StreamLog;
use crate::orderlog::{local, Backlog, NoBacklog, OrderLog};
use crate::redis_client::{RedisClient, RedisConn};
use crate::scheduler::Scheduler;
use crate::store::SqlDecision;
use crate::store::Store;
use crate::writer::{Writer, WriterStats};

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("database: {0}")]
    Store(#[from] crate::store::StoreError),
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("gate: {0}")]
    Gate(#[from] crate::gate::GateError),
    #[error("order log: {0}")]
    Log(#[from] crate::orderlog::LogError),
    #[error("ids: {0}")]
    Ids(#[from] crate::ids::IdError),
    #[error("scheduler: {0}")]
    Scheduler(#[from] crate::scheduler::SchedulerError),
    #[error("{what} took longer than {limit:?}; trying again")]
    TimedOut { what: String, limit: Duration },
    #[error("{0}")]
    Other(String),
}

impl AppError {
    /// Whether trying again later may succeed: a server not up yet, a connection refused
    /// or dropped. A bad URL or a refused password is not.
    pub fn is_transient(&self) -> bool {
        use crate::gate::GateError;
        use crate::orderlog::LogError;
        use crate::scheduler::SchedulerError;
        let gate = |e: &GateError| match e {
            GateError::Redis(e) => redis_unreachable(e),
            GateError::Timeout | GateError::Unavailable(_) => true,
            _ => false,
        };
        let log = |e: &LogError| matches!(e, LogError::Redis(e) if redis_unreachable(e));
        let load = |e: &crate::loader::LoadError| match e {
            crate::loader::LoadError::Store(e) => e.is_transient(),
            crate::loader::LoadError::Gate(e) => gate(e),
            crate::loader::LoadError::Stuck(..) | crate::loader::LoadError::TooLong(..) => true,
        };
        match self {
            AppError::Store(e) => e.is_transient(),
            AppError::Redis(e) => redis_unreachable(e),
            AppError::Gate(e) => gate(e),
            AppError::Log(e) => log(e),
            AppError::Ids(crate::ids::IdError::Redis(e)) => redis_unreachable(e),
            // A lease soon after Redis started afresh asks the database too.
            AppError::Ids(crate::ids::IdError::Store(e)) => e.is_transient(),
            AppError::Scheduler(e) => match e {
                SchedulerError::Store(e) => e.is_transient(),
                SchedulerError::Gate(e) => gate(e),
                SchedulerError::Log(e) => log(e),
                SchedulerError::Load(e) => load(e),
                SchedulerError::Lifecycle(_) => true,
            },
            AppError::TimedOut { .. } => true,
            _ => false,
        }
    }
}

/// Redis cannot be reached, or is not ready to serve yet (loading its data, a failover).
pub fn redis_unreachable(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_timeout()
        || matches!(
            e.kind(),
            redis::ErrorKind::Server(
                redis::ServerErrorKind::BusyLoading
                    | redis::ServerErrorKind::TryAgain
                    | redis::ServerErrorKind::MasterDown
                    | redis::ServerErrorKind::ReadOnly
            )
        )
}

/// Tries `attempt` until it succeeds or fails in a way retrying cannot fix, waiting with
/// backoff and jitter between tries: a process started before its database or Redis (or
/// while they restart) comes up by itself once they do. An attempt that has not ended
/// after `limit` (if given) is abandoned and tried again: a start-up step waiting on a
/// connection that went quiet (a half-open socket) would otherwise wait forever, silently.
/// One log line when the wait starts, then one every 30 s, and one when it is over.
pub async fn until_up<T, F, Fut>(
    what: &str,
    limit: Option<Duration>,
    mut attempt: F,
) -> Result<T, AppError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, AppError>>,
{
    let mut backoff =
        crate::backoff::Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    let started = std::time::Instant::now();
    let mut logged_at: Option<std::time::Instant> = None;
    loop {
        let tried = match limit {
            Some(limit) => tokio::time::timeout(limit, attempt())
                .await
                .unwrap_or_else(|_| {
                    Err(AppError::TimedOut {
                        what: what.to_string(),
                        limit,
                    })
                }),
            None => attempt().await,
        };
        match tried {
            Ok(v) => {
                crate::health::wait_for(None);
                if logged_at.is_some() {
                    tracing::info!(
                        waited_ms = started.elapsed().as_millis() as u64,
                        "{what}: up"
                    );
                }
                return Ok(v);
            }
            Err(e) if e.is_transient() => {
                crate::health::wait_for(Some(format!("{what}: {e}")));
                if logged_at.is_none_or(|at| at.elapsed() >= Duration::from_secs(30)) {
                    tracing::warn!(error = %e, "{what}: not reachable yet; retrying");
                    logged_at = Some(std::time::Instant::now());
                }
                tokio::time::sleep(backoff.next_wait()).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// How long one try of a start-up step (connecting, reading a secret, leasing ids) may
/// take: each is a few round trips, so far longer means a connection that went quiet.
const START_STEP_LIMIT: Duration = Duration::from_secs(30);
/// The first scheduler pass may rebuild a large sale's gate from SQL (8 s for a million
/// buyers on a small box).
const FIRST_PASS_LIMIT: Duration = Duration::from_secs(120);

/// Which process is being assembled: ids are only minted where orders or users are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Server,
    Worker,
    Tool,
}

/// The deployment-specific parts; everything else is shared.
struct Parts {
    gate: Arc<dyn Gate>,
    /// The order log as its writers read it, and as everyone else sees what waits in it.
    log: Arc<dyn OrderLog>,
    backlog: Arc<dyn Backlog>,
    ids: Arc<IdGenerator>,
    redis: Option<RedisConn>,
    breaker: Option<Arc<Breaker>>,
    /// The embedded server's claim on a PostgreSQL or MySQL database.
    claim: DatabaseClaim,
}

/// Connection failures in a row that open the Redis gate's circuit, and how long it stays open.
const BREAKER_THRESHOLD: u32 = 5;
const BREAKER_COOLDOWN_MS: i64 = 1000;

fn sql_gate(config: &Config, store: &Store, how: SqlDecision) -> Arc<dyn Gate> {
    // Leave a few connections for the writer, the scheduler and the other endpoints.
    let in_flight = (config.db_max_connections as usize)
        .saturating_sub(4)
        .max(1);
    Arc::new(SqlGate::new(store.clone(), how, in_flight))
}

async fn embedded_parts(config: &Config, store: &Store, role: Role) -> Result<Parts, AppError> {
    let mut claim = None;
    let worker = if role == Role::Server {
        ids::EMBEDDED_WORKER
    } else {
        ids::TOOL_WORKER
    };
    let (gate, log): (Arc<dyn Gate>, _) = match config.gate {
        GateKind::SqlLock => (sql_gate(config, store, SqlDecision::Lock), None),
        GateKind::SqlConditional => (sql_gate(config, store, SqlDecision::Conditional), None),
        _ => {
            let (log, reader) = if role == Role::Server {
                let (log, reader, claimed) = open_order_log(config, store).await?;
                claim = claimed;
                (log, reader)
            } else {
                // A tool takes no orders, and must not touch the log of a server beside it.
                local::channel()
            };
            let gate = MemoryGate::with_clock(log.clone(), store.clock().clone())
                .with_rate_limit(config.rate_user);
            (Arc::new(gate) as Arc<dyn Gate>, Some((log, reader)))
        }
    };
    let (backlog, reader): (Arc<dyn Backlog>, _) = match log {
        Some((log, reader)) => (Arc::new(log), reader),
        // The SQL gates write SQL before they answer: nothing waits.
        None => (Arc::new(NoBacklog), local::channel().1),
    };
    Ok(Parts {
        gate,
        log: Arc::new(reader),
        backlog,
        ids: Arc::new(IdGenerator::fixed(worker).with_clock(store.clock().clone())),
        redis: None,
        breaker: None,
        claim,
    })
}

/// The order log of a server whose purchases are decided in memory: always a file, whatever
/// the database, since an `ok` must outlive a SIGKILL (guarantee 3). The folder is bound to
/// this database, so that its orders are never replayed into another one.
/// The claim on the database (see `Store::claim_single_server`), held while the server runs.
type DatabaseClaim = Option<sqlx::pool::PoolConnection<sqlx::Any>>;

async fn open_order_log(
    config: &Config,
    store: &Store,
) -> Result<(local::LocalLog, local::LocalLogReader, DatabaseClaim), AppError> {
    let Some(dir) = &config.order_log_dir else {
        // Config::validate refuses this combination; never fall back to memory.
        return Err(AppError::Other("no order log folder".into()));
    };
    let candidate = crate::text::hex(&rand::random::<[u8; 16]>());
    let database_id = store.meta_get_or_init("database_id", &candidate).await?;
    // A server SIGKILLed a moment ago holds the claim until its database session ends.
    let mut claimed = store.claim_single_server().await?;
    for _ in 0..50 {
        if claimed.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        claimed = store.claim_single_server().await?;
    }
    let Some(claim) = claimed else {
        return Err(AppError::Other(
            "another seckill server already decides purchases in memory on this database; \
             two would each sell the whole stock. Run several servers distributed (--redis), \
             or decide purchases in SQL (--gate sql-conditional)"
                .into(),
        ));
    };
    let opened = local::open_with(
        dir,
        &database_id,
        local::Options::new(store.clock().clone()),
    )?;
    let (log, reader) = (opened.log, opened.reader);
    Ok((log, reader, claim))
}

async fn distributed_parts(config: &Config, store: &Store, url: &str) -> Result<Parts, AppError> {
    let (client, conn) = redis_manager(url).await?;
    let streams = Arc::new(StreamLog::connect(&client, conn.clone(), &config.redis_prefix).await?);
    let (gate, breaker): (Arc<dyn Gate>, _) = match config.gate {
        GateKind::SqlLock => (sql_gate(config, store, SqlDecision::Lock), None),
        GateKind::SqlConditional => (sql_gate(config, store, SqlDecision::Conditional), None),
        _ => {
            let gate = RedisGate::new(conn.clone(), &config.redis_prefix)
                .with_rate_limit(config.rate_user)
                .with_entry_form(config.order_log_entry)
                .with_durability(&client, config.redis_durability)
                .await?;
            gate.prepare().await?;
            let breaker = Breaker::new(Arc::new(gate), BREAKER_THRESHOLD, BREAKER_COOLDOWN_MS);
            let breaker = Arc::new(if client.is_cluster() {
                breaker.per_sale()
            } else {
                breaker
            });
            // Moves stock between a segmented sale's segments when a buyer's is empty.
            let rebalancer = crate::gate::rebalance::Rebalancer::new(
                breaker.clone() as Arc<dyn Gate>,
                store.clone(),
            );
            (Arc::new(rebalancer) as Arc<dyn Gate>, Some(breaker))
        }
    };
    // Last: a lease is renewed by a task of its own from here on, so a failure after it
    // would leave that task holding a worker id while start-up tries again with another.
    let ids = ids::lease_worker_id(conn.clone(), &config.redis_prefix, store.clone()).await?;
    Ok(Parts {
        gate,
        log: streams.clone(),
        backlog: streams,
        ids,
        redis: Some(conn),
        breaker,
        claim: None,
    })
}

/// Where this process keeps the database's recent changes against a failover (see
/// `store::failover`): in Redis when there is one; beside the order log of a server that
/// decides purchases in memory on PostgreSQL or MySQL; nowhere on SQLite (no replica), for
/// the SQL gates without Redis (they decide in SQL: see the failover guide), or for a tool
/// beside an embedded server (its folder is the server's).
fn failover_window(
    config: &Config,
    store: &Store,
    redis: Option<&RedisConn>,
    role: Role,
) -> Result<Option<Arc<dyn crate::store::Window>>, AppError> {
    if store.dialect() == crate::store::Dialect::Sqlite {
        return Ok(None);
    }
    if let Some(conn) = redis {
        let window = crate::window::redis::RedisWindow::new(conn.clone(), &config.redis_prefix);
        return Ok(Some(Arc::new(window)));
    }
    let in_memory = !matches!(config.gate, GateKind::SqlLock | GateKind::SqlConditional);
    match (&config.order_log_dir, role) {
        (Some(dir), Role::Server) if in_memory => {
            let window = crate::window::file::FileWindow::open(
                &dir.join("failover-window"),
                store.clock().clone(),
            )
            .map_err(|e| AppError::Other(e.to_string()))?;
            Ok(Some(Arc::new(window)))
        }
        _ => Ok(None),
    }
}

/// Everything a running process holds.
pub struct App {
    pub state: Arc<AppState>,
    pub log: Arc<dyn OrderLog>,
    _claim: DatabaseClaim,
}

pub async fn connect_store(config: &Config) -> Result<Store, AppError> {
    Ok(
        Store::connect(&config.database_url, config.db_max_connections)
            .await?
            .with_phone_region(config.phone_region()),
    )
}

/// Applies the schema migrations not applied yet.
async fn migrate(store: &Store) -> Result<(), AppError> {
    let applied = store.migrate().await?;
    if !applied.is_empty() {
        tracing::info!(?applied, "schema migrations applied");
    }
    Ok(())
}

/// The token secret: configured, or generated once and shared through the database.
pub async fn token_signer(config: &Config, store: &Store) -> Result<TokenSigner, AppError> {
    let secret = match &config.token_secret {
        Some(s) => s.clone(),
        None => {
            let candidate = crate::text::hex(&rand::random::<[u8; 32]>());
            store.meta_get_or_init("token_secret", &candidate).await?
        }
    };
    Ok(TokenSigner::new(&secret))
}

/// The configured payment provider, if any, and the simulated one when it is that one.
pub struct Payments {
    pub provider: Option<Arc<dyn PaymentProvider>>,
    pub simulator: Option<SimulatedProvider>,
}

/// The payment provider `config` names. The simulated one signs with the configured secret,
/// or one generated once and shared through the database; a real one only with the secret
/// configured (and shared with the provider).
pub async fn payment_provider(config: &Config, store: &Store) -> Result<Payments, AppError> {
    match config.payment_provider {
        None => Ok(Payments {
            provider: None,
            simulator: None,
        }),
        Some(PaymentProviderKind::Simulated) => {
            let secret = match &config.payment_secret {
                Some(s) => s.clone(),
                None => {
                    let candidate = crate::text::hex(&rand::random::<[u8; 32]>());
                    store.meta_get_or_init("payment_secret", &candidate).await?
                }
            };
            let simulator = SimulatedProvider::new(&secret);
            Ok(Payments {
                provider: Some(Arc::new(simulator.clone())),
                simulator: Some(simulator),
            })
        }
        Some(PaymentProviderKind::Redirect) => {
            // Config::validate refuses a redirect provider without its URL and secret.
            let (Some(url), Some(secret)) = (&config.payment_redirect_url, &config.payment_secret)
            else {
                return Err(AppError::Other(
                    "the redirect payment provider needs its URL and secret".into(),
                ));
            };
            Ok(Payments {
                provider: Some(Arc::new(RedirectProvider::new(url, secret))),
                simulator: None,
            })
        }
    }
}

/// A client for `url` (a server, or a cluster's seed nodes) and its shared connection.
pub async fn redis_manager(url: &str) -> Result<(RedisClient, RedisConn), AppError> {
    let client = RedisClient::open(url)?;
    let conn = client.connect().await?;
    Ok((client, conn))
}

pub async fn assemble(config: Config, role: Role) -> Result<App, AppError> {
    let connections = connection_limits(&config);
    let config = Arc::new(config);
    let (store, tokens, payments) = open_database(&config).await?;
    let redis_url = follow_sentinel(&config).await?;
    let parts = match &redis_url {
        None => embedded_parts(&config, &store, role).await?,
        Some(url) => {
            let what = format!("redis at {}", crate::text::mask_url(url));
            let parts = until_up(&what, Some(START_STEP_LIMIT), || {
                distributed_parts(&config, &store, url)
            })
            .await?;
            tracing::info!("redis ready (gate, order log and ids)");
            parts
        }
    };
    settle_failover_window(&config, &store, parts.redis.as_ref(), role).await?;
    let Parts {
        gate,
        log,
        backlog,
        ids,
        redis,
        breaker,
        claim,
    } = parts;
    let shortcut = Arc::new(SoldOutShortcut::new(gate));
    if let (Some(url), Some(conn)) = (&redis_url, &redis) {
        tokio::spawn(follow_stock_returns(
            RedisClient::open(url)?,
            conn.clone(),
            config.redis_prefix.clone(),
            shortcut.clone(),
        ));
    }
    let rooms = Arc::new(crate::room::Rooms::new(
        waiting_room(&config, redis.as_ref()).await,
    ));
    let health = Arc::new(crate::health::Health::new(
        redis.is_some(),
        crate::clock::wall_ms(),
    ));
    let state = Arc::new(AppState {
        address_limiter: crate::edge::limits::AddressLimiter::new(
            config.rate_address,
            config.trusted_proxies.clone(),
        ),
        secret_guard: crate::edge::auth::SecretGuard::new(config.wrong_token_limit),
        shop: crate::edge::auth::shop::ShopTokens::from_config(&config).map(Arc::new),
        api_keys: Default::default(),
        config,
        store,
        gate: shortcut.clone(),
        sold_out: shortcut,
        captcha_limiter: crate::edge::limits::RateTable::new(
            crate::edge::antibot::CAPTCHA_RATE,
            crate::edge::antibot::CAPTCHA_LIMITER_KEYS,
        ),
        connections,
        breaker,
        ids,
        tokens,
        payments: payments.provider,
        simulator: payments.simulator,
        sales: Arc::new(SaleCache::default()),
        redis,
        backlog,
        writer_stats: Arc::new(WriterStats::default()),
        metrics: Metrics::default(),
        audit: Default::default(),
        rooms,
        health,
    });
    Ok(App {
        state,
        log,
        _claim: claim,
    })
}

/// The client connections' limits, from the settings.
fn connection_limits(config: &Config) -> Arc<crate::edge::connections::Connections> {
    crate::edge::connections::Connections::new(crate::edge::connections::ConnectionLimits {
        max: config.max_connections,
        per_address: config.max_connections_per_address,
        exempt: config.trusted_proxies.clone(),
        header_read_timeout: config.header_read_timeout,
        idle_timeout: config.idle_timeout,
    })
}

/// The database, its schema brought up to date, and what is kept in it (the token secret,
/// the payment provider's), each step waited for while the database is not up yet.
async fn open_database(config: &Config) -> Result<(Store, TokenSigner, Payments), AppError> {
    let store = until_up("database", Some(START_STEP_LIMIT), || connect_store(config)).await?;
    // No time limit: a migration may rewrite a large table once (SQLite's would start over
    // at each try), and another process's migration holds this one off under its lock.
    until_up("schema migrations", None, || migrate(&store)).await?;
    // One line per start-up step: a process that does not come up shows where it stands.
    tracing::info!("database ready (schema up to date)");
    let tokens = until_up("database", Some(START_STEP_LIMIT), || {
        token_signer(config, &store)
    })
    .await?;
    let payments = until_up("database", Some(START_STEP_LIMIT), || {
        payment_provider(config, &store)
    })
    .await?;
    Ok((store, tokens, payments))
}

/// The Redis URL every client of this process uses: with Sentinel, the local forwarder to
/// the master it names.
async fn follow_sentinel(config: &Config) -> Result<Option<String>, AppError> {
    match &config.redis_url {
        Some(url) if crate::redis_client::sentinel::is_sentinel_url(url) => {
            let sentinel = crate::redis_client::sentinel::parse(url).map_err(AppError::Other)?;
            let follow = || async {
                crate::redis_client::sentinel::follow(&sentinel, &config.redis_prefix)
                    .await
                    .map_err(AppError::from)
            };
            Ok(Some(
                until_up("redis sentinel", Some(START_STEP_LIMIT), follow).await?,
            ))
        }
        other => Ok(other.clone()),
    }
}

/// Where changes are kept against a database failover (see [`failover_window`]), settled
/// before anything writes: after a failover while no process ran, the window is written
/// into the new primary first.
async fn settle_failover_window(
    config: &Config,
    store: &Store,
    redis: Option<&RedisConn>,
    role: Role,
) -> Result<(), AppError> {
    let Some(window) = failover_window(config, store, redis, role)? else {
        return Ok(());
    };
    store.keep_changes_in(window, Duration::from_secs(config.db_failover_window_secs));
    let token = format!("{:016x}", rand::random::<u64>());
    until_up(
        "database failover window",
        Some(FIRST_PASS_LIMIT),
        || async {
            store.settle_once(&token).await.map_err(AppError::from)?;
            match store.settled() {
                true => Ok(()),
                false => Err(AppError::Store(crate::store::StoreError::Window(
                    "another process is writing the failover window into the database".into(),
                ))),
            }
        },
    )
    .await
}

/// The waiting rooms' line: in Redis when there is one, else in this process.
async fn waiting_room(config: &Config, redis: Option<&RedisConn>) -> Arc<dyn crate::room::Room> {
    let Some(conn) = redis else {
        return Arc::new(crate::room::memory::MemoryRoom::new());
    };
    let room = crate::room::redis::RedisRoom::new(conn.clone(), &config.redis_prefix);
    // A failure here costs one script load at the first call (EVALSHA falls back).
    if let Err(e) = room.prepare().await {
        tracing::warn!(error = %e, "the waiting room's scripts were not loaded yet");
    }
    Arc::new(room)
}

impl App {
    pub fn scheduler(&self) -> Scheduler {
        Scheduler {
            store: self.state.store.clone(),
            gate: self.state.gate.clone(),
            cache: self.state.sales.clone(),
            backlog: self.state.backlog.clone(),
            preload_ahead_ms: self.state.config.preload_ahead_secs as i64 * 1000,
        }
    }

    /// The continuous audit, unless turned off; one instance at a time holds its lease.
    pub fn auditor(&self) -> Option<crate::reconcile::auditor::Auditor> {
        let st = &self.state;
        let every = st.config.audit_every_secs;
        if every == 0 {
            return None;
        }
        let lease = st
            .redis
            .as_ref()
            .map(|conn| crate::reconcile::auditor::Lease {
                conn: conn.clone(),
                key: crate::redis_client::keys::audit_lease(&st.config.redis_prefix),
                token: format!("{:016x}", rand::random::<u64>()),
            });
        Some(crate::reconcile::auditor::Auditor {
            store: st.store.clone(),
            gate: st.gate.clone(),
            backlog: st.backlog.clone(),
            cache: st.sales.clone(),
            board: st.audit.clone(),
            written: st.writer_stats.clone(),
            every: Duration::from_secs(every),
            lease,
            repair: st.config.audit_repair,
            repairs: Default::default(),
            filling: Default::default(),
        })
    }

    pub fn writer(&self) -> Writer {
        Writer {
            log: self.log.clone(),
            store: self.state.store.clone(),
            gate: self.state.gate.clone(),
            batch_max: self.state.config.writer_batch,
            stats: self.state.writer_stats.clone(),
            fenced: self.log.shared(),
            turn: Default::default(),
            linger: if self.log.shared() {
                crate::writer::SHARED_LOG_LINGER
            } else {
                Duration::ZERO
            },
        }
    }

    /// The purchases' `Idempotency-Key` records SQL keeps, into a gate that keeps its own
    /// in memory (they are read only by such a gate's deployment: the embedded one).
    async fn restore_retries(&self) -> Result<(), AppError> {
        if !matches!(self.state.config.gate, GateKind::Embedded) {
            return Ok(());
        }
        let since = self.state.now_ms() - crate::gate::RETRY_KEY_MS;
        let kept = self.state.store.kept_purchases(since).await?;
        let restored = self.state.gate.restore_retries(&kept).await;
        if restored > 0 {
            tracing::info!(
                restored,
                "purchases' Idempotency-Key records restored from SQL"
            );
        }
        Ok(())
    }

    /// Starts the background tasks; returns the switch that stops them and their handles.
    pub async fn start_background(
        &self,
        run_writer: bool,
    ) -> Result<(watch::Sender<bool>, Vec<tokio::task::JoinHandle<()>>), AppError> {
        // Orders an embedded server answered `ok` before it stopped may still be only in
        // its order log: into SQL with them before the gate is rebuilt from SQL.
        self.writer()
            .drain_recovered(Duration::from_secs(120))
            .await?;
        self.restore_retries().await?;
        // The first pass runs before serving, so that a restarted embedded server has
        // rebuilt its gate from SQL before it answers a single purchase. Its expiry and
        // returns take one batch each: orders left unexpired are held in the gate, which
        // sells no more than SQL allows, and the next passes catch up while serving.
        let scheduler = self.scheduler();
        until_up("first scheduler pass", Some(FIRST_PASS_LIMIT), || async {
            scheduler.tick(Duration::ZERO).await.map_err(AppError::from)
        })
        .await?;
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut handles = vec![
            tokio::spawn(scheduler.run(stop_rx.clone())),
            tokio::spawn(
                self.state
                    .store
                    .clone()
                    .run_failover_settler(stop_rx.clone()),
            ),
            tokio::spawn(self.state.health.clone().run(
                self.state.store.clone(),
                self.state.redis.clone(),
                stop_rx.clone(),
            )),
        ];
        if let Some(auditor) = self.auditor() {
            handles.push(tokio::spawn(auditor.run(stop_rx.clone())));
        }
        let st = &self.state;
        handles.push(tokio::spawn(
            st.api_keys.clone().run(st.store.clone(), stop_rx.clone()),
        ));
        handles.push(tokio::spawn(crate::edge::idempotency::forget_old(
            self.state.clone(),
            stop_rx.clone(),
        )));
        if let Some(shop) = &st.shop {
            handles.push(tokio::spawn(
                shop.clone().run(st.store.clone(), stop_rx.clone()),
            ));
        }
        handles.push(tokio::spawn(st.rooms.clone().run(
            st.sales.clone(),
            st.gate.clone(),
            st.store.clock().clone(),
            stop_rx.clone(),
        )));
        // The SQL gates write each order in the purchase's own transaction: their log is
        // empty and closed, and a writer would only read that and stop.
        let sql_gate = matches!(
            self.state.config.gate,
            GateKind::SqlLock | GateKind::SqlConditional
        );
        if run_writer && !sql_gate {
            // The local log has one consumer by nature (and SQLite one writer at a time).
            let loops = if self.log.shared() {
                self.state.config.writer_concurrency
            } else {
                1
            };
            let turn: Arc<tokio::sync::Mutex<crate::writer::ReadPace>> = Default::default();
            for _ in 0..loops {
                let writer = Writer {
                    turn: turn.clone(),
                    ..self.writer()
                };
                handles.push(tokio::spawn(writer.run(stop_rx.clone())));
            }
        }
        Ok((stop_tx, handles))
    }
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
