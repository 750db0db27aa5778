//! The one typed configuration. Each setting comes from its flag, else its `SECKILL_*`
//! environment variable (both parsed by clap), else the TOML file named by `--config`,
//! else the default here. Printed at start-up with secrets masked; never logs a secret.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;
use serde::{Deserialize, Serialize};

mod describe;
pub mod redis_url;
mod validate;
mod values;

use describe::{masked_url, masked_url_opt, seconds, secret};
pub use values::{Durability, EntryForm, GateKind, PaymentProviderKind, RateLimit};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("invalid setting {name}: {message}")]
    Invalid { name: &'static str, message: String },
}

/// Settings shared by every subcommand. Every field is optional here so that a missing
/// flag can fall through to the file and then to the default.
#[derive(Debug, Clone, Default, Args, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
#[command(
    next_help_heading = "Settings of every subcommand (flags, SECKILL_* variables or --config)"
)]
pub struct ConfigArgs {
    /// TOML file with any of these settings (snake_case keys).
    #[arg(long, env = "SECKILL_CONFIG", global = true)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Address the HTTP server listens on [default: 127.0.0.1:8080].
    #[arg(long, env = "SECKILL_LISTEN", global = true)]
    pub listen: Option<SocketAddr>,
    /// SQL database: sqlite://FILE, postgres://..., mysql://... [default: sqlite://seckill.db].
    #[arg(long = "database", env = "SECKILL_DATABASE_URL", global = true)]
    pub database_url: Option<String>,
    /// Folder of the order log when purchases are decided in this process (no --redis):
    /// accepted orders are fsynced there before `ok` [default: beside a SQLite file
    /// (seckill.db -> seckill.db.orders), else ./seckill.orders].
    #[arg(long, env = "SECKILL_ORDER_LOG_DIR", global = true)]
    pub order_log_dir: Option<PathBuf>,
    /// Redis URL; when set, seckill runs distributed (gate and order log in Redis):
    /// redis://HOST:PORT/, redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME to
    /// follow a Sentinel-managed master through failovers, or
    /// redis+cluster://HOST:PORT[,HOST:PORT...] (seed nodes) for a Redis Cluster.
    #[arg(long = "redis", env = "SECKILL_REDIS_URL", global = true)]
    pub redis_url: Option<String>,
    /// Prefix of every Redis key [default: seckill].
    #[arg(long, env = "SECKILL_REDIS_PREFIX", global = true)]
    pub redis_prefix: Option<String>,
    /// What an `ok` waits for after the gate's script: none (Redis' memory; its own
    /// appendfsync decides), aof (WAITAOF: fsynced to the master's AOF) or replica (WAIT:
    /// received by a replica, so a failover keeps it) [default: replica on a cluster,
    /// else none]. When the wait fails the buyer is answered 202 pending, never ok.
    #[arg(long, env = "SECKILL_REDIS_DURABILITY", global = true)]
    pub redis_durability: Option<Durability>,
    /// How the gate writes accepted orders into the Redis order log: fields (an entry per
    /// order, one field per value, the only form builds before 2026-11-27 read), packed (an
    /// entry per order, one field, which writers read in a third less CPU) or batch (one
    /// entry per script call, holding its orders: a tenth to a quarter less of Redis' CPU
    /// per winner, and fewer entries for the writers to read and delete). Packed or batch
    /// only once no process of a build that cannot read it uses the same Redis (packed:
    /// before 2026-11-27; batch: before 2026-11-28): those would dead-letter such entries
    /// and leave them out of a gate rebuild [default: fields].
    #[arg(long, env = "SECKILL_ORDER_LOG_ENTRY", global = true)]
    pub order_log_entry: Option<EntryForm>,
    /// Bearer token of the admin API; the admin API is closed when unset.
    #[arg(
        long,
        env = "SECKILL_ADMIN_TOKEN",
        global = true,
        hide_env_values = true
    )]
    pub admin_token: Option<String>,
    /// Secret that signs user tokens; generated once and kept in the database when unset.
    #[arg(
        long,
        env = "SECKILL_TOKEN_SECRET",
        global = true,
        hide_env_values = true
    )]
    pub token_secret: Option<String>,
    /// Development mode: login codes are returned in the answer, so anyone can log in as
    /// any phone [default: on only for the zero-configuration start, SQLite without Redis].
    #[arg(long, env = "SECKILL_DEV", global = true, num_args = 0..=1, default_missing_value = "true",
          value_parser = clap::builder::BoolishValueParser::new())]
    pub dev: Option<bool>,
    /// Secret shared with the payment provider to sign its callbacks; generated once and
    /// kept in the database when unset (the built-in simulated provider uses it too).
    #[arg(
        long,
        env = "SECKILL_PAYMENT_SECRET",
        global = true,
        hide_env_values = true
    )]
    pub payment_secret: Option<String>,
    /// Who takes payments: simulated (the built-in provider's pay page and callbacks,
    /// for trials: anyone can mark their own order paid) or redirect (a real provider's
    /// hosted pay page, --payment-redirect-url, confirming through signed callbacks)
    /// [default: redirect when --payment-redirect-url is set, else simulated in dev mode,
    /// else none: /pay answers 503 payment_unavailable].
    #[arg(long, env = "SECKILL_PAYMENT_PROVIDER", global = true)]
    pub payment_provider: Option<PaymentProviderKind>,
    /// The real provider's pay page for an intent, with {intent_id}, {order_id},
    /// {amount_cents} and {expires_at} filled in, e.g.
    /// https://pay.example/checkout?ref={intent_id}&amount={amount_cents}. Its callbacks
    /// are signed with --payment-secret, which must then be set.
    #[arg(long, env = "SECKILL_PAYMENT_REDIRECT_URL", global = true)]
    pub payment_redirect_url: Option<String>,
    /// Command run to deliver a login code (env SECKILL_PHONE, SECKILL_CODE) outside dev mode.
    #[arg(long, env = "SECKILL_SMS_HOOK", global = true)]
    pub sms_hook: Option<String>,
    /// Region of phone numbers written without a country code (ISO 3166 code such as CN,
    /// US, DE): numbers are normalised to E.164 before they name a user [default: CN].
    #[arg(long, env = "SECKILL_PHONE_REGION", global = true)]
    pub phone_region: Option<String>,
    /// Bearer token that may read /metrics (the admin token may too) [default: unset].
    #[arg(
        long,
        env = "SECKILL_METRICS_TOKEN",
        global = true,
        hide_env_values = true
    )]
    pub metrics_token: Option<String>,
    /// Wrong admin or metrics tokens one client address may send before every admin call
    /// from it is answered 429 (then one more a minute); 0 turns the guard off [default: 5].
    #[arg(long, env = "SECKILL_WRONG_TOKEN_LIMIT", global = true)]
    pub wrong_token_limit: Option<u32>,
    /// Serve /metrics to anyone, without a token (dev mode does too) [default: false].
    #[arg(long, env = "SECKILL_METRICS_PUBLIC", global = true, num_args = 0..=1, default_missing_value = "true",
          value_parser = clap::builder::BoolishValueParser::new())]
    pub metrics_public: Option<bool>,
    /// Do not run the order writer inside `serve` (run `seckill worker` instead).
    #[arg(long, env = "SECKILL_NO_WRITER", global = true, num_args = 0..=1, default_missing_value = "true",
          value_parser = clap::builder::BoolishValueParser::new())]
    pub no_writer: Option<bool>,
    /// Most orders the writer puts in one SQL transaction [default: 20000 on SQLite, 5000
    /// on PostgreSQL or MySQL].
    #[arg(long, env = "SECKILL_WRITER_BATCH", global = true)]
    pub writer_batch: Option<usize>,
    /// Order-writer loops per process; several overlap their database round trips [default: 4].
    #[arg(long, env = "SECKILL_WRITER_CONCURRENCY", global = true)]
    pub writer_concurrency: Option<usize>,
    /// Purchases per second one user may make on one sale, across all instances (GCRA);
    /// 0 turns it off [default: 5].
    #[arg(long, env = "SECKILL_RATE_USER_PER_SEC", global = true)]
    pub rate_user_per_sec: Option<f64>,
    /// Purchases one user may make at once before the per-user rate applies [default: 10].
    #[arg(long, env = "SECKILL_RATE_USER_BURST", global = true)]
    pub rate_user_burst: Option<u32>,
    /// Requests per second one client address may make to the API (token bucket, per
    /// instance); 0 turns it off [default: 0, off: a whole crowd may share one address].
    #[arg(long, env = "SECKILL_RATE_ADDRESS_PER_SEC", global = true)]
    pub rate_address_per_sec: Option<f64>,
    /// Requests one client address may make at once [default: twice the rate].
    #[arg(long, env = "SECKILL_RATE_ADDRESS_BURST", global = true)]
    pub rate_address_burst: Option<u32>,
    /// Proxies whose X-Forwarded-For is believed, comma-separated IP addresses [default: none].
    #[arg(
        long,
        env = "SECKILL_TRUSTED_PROXIES",
        global = true,
        value_delimiter = ','
    )]
    pub trusted_proxies: Option<Vec<std::net::IpAddr>>,
    /// Load approved sales into the gate this long before they open [default: 3600].
    #[arg(long, env = "SECKILL_PRELOAD_AHEAD_SECS", global = true)]
    pub preload_ahead_secs: Option<u64>,
    /// An instance is not ready while an accepted order has waited this long to be
    /// written to SQL (no writer running, or writers falling behind) [default: 30].
    #[arg(long, env = "SECKILL_WRITER_LAG_NOT_READY_SECS", global = true)]
    pub writer_lag_not_ready_secs: Option<u64>,
    /// Compare each live sale's gate with SQL this often (one instance at a time); 0 turns
    /// the continuous audit off [default: 2].
    #[arg(long, env = "SECKILL_AUDIT_EVERY_SECS", global = true)]
    pub audit_every_secs: Option<u64>,
    /// How long every change committed to PostgreSQL or MySQL (orders written, payments,
    /// cancellations, expiries, sales, users) is kept in Redis after its commit, to be
    /// written again if the database fails over to a replica that lacks it (asynchronous
    /// replication). Longer than a failover takes plus the replicas' worst lag; 0 keeps
    /// nothing (with synchronous replication only) [default: 300].
    #[arg(long, env = "SECKILL_DB_FAILOVER_WINDOW_SECS", global = true)]
    pub db_failover_window_secs: Option<u64>,
    /// Repair a sale's gate by itself once the audit confirms it drifted from SQL (and
    /// pause a sale that keeps drifting); false only reports drift [default: true].
    #[arg(long, env = "SECKILL_AUDIT_REPAIR", global = true, num_args = 0..=1, default_missing_value = "true",
          value_parser = clap::builder::BoolishValueParser::new())]
    pub audit_repair: Option<bool>,
    /// Lifetime of a user token [default: 604800].
    #[arg(long, env = "SECKILL_TOKEN_TTL_SECS", global = true)]
    pub token_ttl_secs: Option<u64>,
    /// SQL connection pool size [default: 16].
    #[arg(long, env = "SECKILL_DB_MAX_CONNECTIONS", global = true)]
    pub db_max_connections: Option<u32>,
    /// Client connections served at once; beyond it, new ones wait in the accept queue
    /// [default: 10000].
    #[arg(long, env = "SECKILL_MAX_CONNECTIONS", global = true)]
    pub max_connections: Option<usize>,
    /// Seconds a client may take to send a request's head once it has started [default: 10].
    #[arg(long, env = "SECKILL_HEADER_READ_TIMEOUT_SECS", global = true)]
    pub header_read_timeout_secs: Option<u64>,
    /// Seconds a connection may stay open without a request (a new connection before its
    /// first byte, a keep-alive connection between requests) [default: 60].
    #[arg(long, env = "SECKILL_IDLE_TIMEOUT_SECS", global = true)]
    pub idle_timeout_secs: Option<u64>,
    /// Client connections one address may hold open at once; further ones are closed at
    /// once. Trusted proxies are exempt [default: 1000].
    #[arg(long, env = "SECKILL_MAX_CONNECTIONS_PER_ADDRESS", global = true)]
    pub max_connections_per_address: Option<usize>,
    /// Web origins whose pages may call the API (CORS), comma-separated, e.g.
    /// https://shop.example [default: none, same origin only].
    #[arg(
        long,
        env = "SECKILL_CORS_ORIGINS",
        global = true,
        value_delimiter = ','
    )]
    pub cors_origins: Option<Vec<String>>,
    /// How purchases are decided: redis (default with --redis), embedded (default without),
    /// sql-lock or sql-conditional (in the database; for comparison, or to run without Redis).
    #[arg(long, env = "SECKILL_GATE", global = true)]
    pub gate: Option<GateKind>,
    /// Threads that run the server's tasks (HTTP, gate calls, writer) [default: one per
    /// core]. On a box shared with other busy processes (a load generator, the database),
    /// fewer threads than cores spend less time being switched out.
    #[arg(long, env = "SECKILL_THREADS", global = true)]
    pub threads: Option<usize>,
    /// Log filter, tracing's EnvFilter syntax [default: info].
    #[arg(long, env = "SECKILL_LOG", global = true)]
    pub log: Option<String>,
}

/// The resolved configuration. Its serialized form is the start-up log's listing, so a
/// secret field says how it is masked where it is declared.
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    pub listen: SocketAddr,
    #[serde(serialize_with = "masked_url")]
    pub database_url: String,
    /// Where the embedded gate's order log lives; `None` only for an in-memory SQLite
    /// database, where nothing survives the process anyway.
    pub order_log_dir: Option<PathBuf>,
    #[serde(serialize_with = "masked_url_opt")]
    pub redis_url: Option<String>,
    pub redis_prefix: String,
    pub redis_durability: Durability,
    pub order_log_entry: EntryForm,
    #[serde(serialize_with = "secret")]
    pub admin_token: Option<String>,
    #[serde(serialize_with = "secret")]
    pub token_secret: Option<String>,
    #[serde(serialize_with = "secret")]
    pub payment_secret: Option<String>,
    pub dev: bool,
    /// `None`: no provider; paying answers 503 `payment_unavailable`.
    pub payment_provider: Option<PaymentProviderKind>,
    pub payment_redirect_url: Option<String>,
    /// The hook's command line may carry an API key of the SMS provider.
    #[serde(serialize_with = "secret")]
    pub sms_hook: Option<String>,
    pub phone_region: String,
    #[serde(serialize_with = "secret")]
    pub metrics_token: Option<String>,
    pub metrics_public: bool,
    pub wrong_token_limit: u32,
    pub run_writer: bool,
    pub writer_batch: usize,
    pub writer_concurrency: usize,
    pub rate_user: RateLimit,
    pub rate_address: RateLimit,
    pub trusted_proxies: Vec<std::net::IpAddr>,
    pub preload_ahead_secs: u64,
    pub writer_lag_not_ready_secs: u64,
    pub audit_every_secs: u64,
    pub db_failover_window_secs: u64,
    pub audit_repair: bool,
    pub token_ttl_secs: u64,
    pub db_max_connections: u32,
    pub max_connections: usize,
    #[serde(serialize_with = "seconds")]
    pub header_read_timeout: std::time::Duration,
    #[serde(serialize_with = "seconds")]
    pub idle_timeout: std::time::Duration,
    pub max_connections_per_address: usize,
    pub cors_origins: Vec<String>,
    pub gate: GateKind,
    pub threads: usize,
    pub log: String,
}

impl Config {
    pub fn embedded(&self) -> bool {
        self.redis_url.is_none()
    }

    /// The region of phone numbers written without a country code (validated at load).
    pub fn phone_region(&self) -> phonenumber::country::Id {
        crate::text::phone_region(&self.phone_region).unwrap_or(phonenumber::country::Id::CN)
    }

    pub fn load(args: &ConfigArgs) -> Result<Config, ConfigError> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => ConfigArgs::default(),
        };
        Self::merge(args.clone(), file)
    }

    fn merge(flags: ConfigArgs, file: ConfigArgs) -> Result<Config, ConfigError> {
        let c = layered(flags, file)?;
        let redis_url = c.redis_url.filter(|s| !s.is_empty());
        let embedded = redis_url.is_none();
        let cluster = redis_url.as_deref().is_some_and(redis_url::is_cluster_url);
        let database_url = c
            .database_url
            .unwrap_or_else(|| "sqlite://seckill.db".to_string());
        let sqlite = database_url.starts_with("sqlite:");
        // Dev mode hands out login codes: only the laptop start (no Redis, a SQLite
        // file) has it by default. A server database means real users may be near.
        let dev = c.dev.unwrap_or(embedded && sqlite);
        let payment_redirect_url = c.payment_redirect_url.filter(|s| !s.is_empty());
        let config = Config {
            listen: c
                .listen
                .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 8080))),
            order_log_dir: c
                .order_log_dir
                .or_else(|| default_order_log_dir(&database_url)),
            database_url,
            redis_url,
            redis_prefix: c.redis_prefix.unwrap_or_else(|| "seckill".to_string()),
            redis_durability: c.redis_durability.unwrap_or(
                // A cluster fails over by itself: only what a replica holds survives it.
                if cluster {
                    Durability::Replica
                } else {
                    Durability::None
                },
            ),
            order_log_entry: c.order_log_entry.unwrap_or_default(),
            admin_token: c.admin_token.filter(|s| !s.is_empty()),
            token_secret: c.token_secret.filter(|s| !s.is_empty()),
            payment_secret: c.payment_secret.filter(|s| !s.is_empty()),
            dev,
            // The simulated provider lets a buyer mark their own order paid: never by
            // default outside dev mode.
            payment_provider: c.payment_provider.or(if payment_redirect_url.is_some() {
                Some(PaymentProviderKind::Redirect)
            } else if dev {
                Some(PaymentProviderKind::Simulated)
            } else {
                None
            }),
            payment_redirect_url,
            sms_hook: c.sms_hook,
            phone_region: c
                .phone_region
                .unwrap_or_else(|| "CN".to_string())
                .to_ascii_uppercase(),
            metrics_token: c.metrics_token.filter(|s| !s.is_empty()),
            metrics_public: c.metrics_public.unwrap_or(false),
            wrong_token_limit: c.wrong_token_limit.unwrap_or(5),
            run_writer: !c.no_writer.unwrap_or(false),
            // SQLite pays per page a commit touches, so fewer, larger commits drain the
            // embedded log faster (1,000 -> 5,000 cut a 200,000-order backlog's drain from
            // 4.0 to 1.2 s). SQLite pays per index page a commit touches: at a million
            // orders, 20,000 to a commit cost 0.8x the CPU per order of 5,000 and kept the
            // writer ahead of the gate (p99.9 14-28x the mean wait, not 66x; BENCHMARKS,
            // session 18). A worker draining a backlog into PostgreSQL spent 7% less CPU
            // per order (worker, Redis and PostgreSQL) at 5,000 than at 1,000, in three
            // pairs of `scripts/writer-cost` (session 24). A batch only fills when the writer
            // is behind; otherwise it holds what arrived since the last.
            writer_batch: c
                .writer_batch
                .unwrap_or(if embedded && sqlite { 20_000 } else { 5000 }),
            writer_concurrency: c.writer_concurrency.unwrap_or(4),
            rate_user: RateLimit {
                per_sec: c.rate_user_per_sec.unwrap_or(5.0),
                burst: c.rate_user_burst.unwrap_or(10),
            },
            rate_address: {
                let per_sec = c.rate_address_per_sec.unwrap_or(0.0);
                RateLimit {
                    per_sec,
                    burst: c
                        .rate_address_burst
                        .unwrap_or((per_sec * 2.0).ceil() as u32),
                }
            },
            trusted_proxies: c.trusted_proxies.unwrap_or_default(),
            preload_ahead_secs: c.preload_ahead_secs.unwrap_or(3600),
            writer_lag_not_ready_secs: c.writer_lag_not_ready_secs.unwrap_or(30),
            audit_every_secs: c.audit_every_secs.unwrap_or(2),
            db_failover_window_secs: c.db_failover_window_secs.unwrap_or(300),
            audit_repair: c.audit_repair.unwrap_or(true),
            token_ttl_secs: c.token_ttl_secs.unwrap_or(7 * 86400),
            db_max_connections: c.db_max_connections.unwrap_or(16),
            max_connections: c.max_connections.unwrap_or(10_000).max(1),
            header_read_timeout: std::time::Duration::from_secs(
                c.header_read_timeout_secs.unwrap_or(10),
            ),
            idle_timeout: std::time::Duration::from_secs(c.idle_timeout_secs.unwrap_or(60)),
            max_connections_per_address: c.max_connections_per_address.unwrap_or(1000),
            cors_origins: c.cors_origins.unwrap_or_default(),
            gate: c.gate.unwrap_or(if embedded {
                GateKind::Embedded
            } else {
                GateKind::Redis
            }),
            threads: c
                .threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
            log: c.log.unwrap_or_else(|| "info".to_string()),
        };
        config.validate()?;
        Ok(config)
    }
}

/// The settings given as flags or environment, over those of the file: every setting at
/// once, by name, so that no setting is layered by hand.
fn layered(flags: ConfigArgs, file: ConfigArgs) -> Result<ConfigArgs, ConfigError> {
    let invalid = |e: serde_json::Error| ConfigError::Invalid {
        name: "config",
        message: e.to_string(),
    };
    let mut merged = serde_json::to_value(&file).map_err(invalid)?;
    let flags = serde_json::to_value(&flags).map_err(invalid)?;
    if let (Some(merged), Some(flags)) = (merged.as_object_mut(), flags.as_object()) {
        for (name, value) in flags {
            if !value.is_null() {
                merged.insert(name.clone(), value.clone());
            }
        }
    }
    serde_json::from_value(merged).map_err(invalid)
}

fn read_file(path: &PathBuf) -> Result<ConfigArgs, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.clone(),
        source,
    })?;
    toml::from_str(&text).map_err(|source| ConfigError::Parse {
        path: path.clone(),
        source,
    })
}

/// The embedded order log's folder: beside a SQLite file (`seckill.db` ->
/// `seckill.db.orders`), `./seckill.orders` for a server database; none for an in-memory
/// SQLite database.
pub fn default_order_log_dir(database_url: &str) -> Option<PathBuf> {
    let Some(path) = database_url
        .strip_prefix("sqlite://")
        .or_else(|| database_url.strip_prefix("sqlite:"))
    else {
        return Some(PathBuf::from("seckill.orders"));
    };
    let path = path.split('?').next().unwrap_or_default();
    if path.is_empty() || path.starts_with(":memory:") {
        return None;
    }
    Some(PathBuf::from(format!("{path}.orders")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_beat_file_beat_defaults() {
        let flags = ConfigArgs {
            writer_batch: Some(7),
            ..Default::default()
        };
        let file = ConfigArgs {
            writer_batch: Some(9),
            preload_ahead_secs: Some(60),
            ..Default::default()
        };
        let c = Config::merge(flags, file).unwrap();
        assert_eq!(c.writer_batch, 7);
        assert_eq!(c.preload_ahead_secs, 60);
        assert_eq!(c.token_ttl_secs, 7 * 86400);
        assert!(c.embedded() && c.dev, "embedded defaults to dev mode");
    }

    #[test]
    fn distributed_is_not_dev_and_needs_a_server_database() {
        let a = ConfigArgs {
            redis_url: Some("redis://127.0.0.1/".into()),
            ..Default::default()
        };
        assert!(Config::merge(a.clone(), ConfigArgs::default()).is_err());
        let a = ConfigArgs {
            database_url: Some("postgres://u:hunter2@h/db".into()),
            ..a
        };
        let c = Config::merge(a, ConfigArgs::default()).unwrap();
        assert!(!c.dev);
        assert!(!c.describe().contains("hunter2"));
    }

    #[test]
    fn toml_file_parses_and_rejects_unknown_keys() {
        let ok: ConfigArgs = toml::from_str("writer_batch = 5\nlisten = \"0.0.0.0:9000\"").unwrap();
        assert_eq!(ok.writer_batch, Some(5));
        assert!(toml::from_str::<ConfigArgs>("no_such_key = 1").is_err());
    }

    #[test]
    fn the_simulated_payment_provider_is_never_the_default_outside_dev_mode() {
        let with = |a: ConfigArgs| Config::merge(a, ConfigArgs::default());
        let pg = || ConfigArgs {
            database_url: Some("postgres://u@h/db".into()),
            ..Default::default()
        };
        assert_eq!(with(pg()).unwrap().payment_provider, None);
        assert_eq!(
            with(ConfigArgs::default()).unwrap().payment_provider,
            Some(PaymentProviderKind::Simulated),
            "dev mode"
        );
        let named = ConfigArgs {
            payment_provider: Some(PaymentProviderKind::Simulated),
            ..pg()
        };
        assert_eq!(
            with(named).unwrap().payment_provider,
            Some(PaymentProviderKind::Simulated)
        );
        let url = Some("https://pay.example/?ref={intent_id}".to_string());
        let no_secret = ConfigArgs {
            payment_redirect_url: url.clone(),
            ..pg()
        };
        assert!(with(no_secret).is_err(), "a real provider needs its secret");
        let real = ConfigArgs {
            payment_redirect_url: url,
            payment_secret: Some("s".into()),
            ..pg()
        };
        assert_eq!(
            with(real).unwrap().payment_provider,
            Some(PaymentProviderKind::Redirect)
        );
        let bad_region = ConfigArgs {
            phone_region: Some("ZZ".into()),
            ..Default::default()
        };
        assert!(with(bad_region).is_err());
        let forever = ConfigArgs {
            token_ttl_secs: Some(u64::MAX),
            ..Default::default()
        };
        assert!(with(forever).is_err());
    }

    #[test]
    fn cors_origins_are_exact_origins() {
        let with = |o: &str| {
            let a = ConfigArgs {
                cors_origins: Some(vec![o.into()]),
                ..Default::default()
            };
            Config::merge(a, ConfigArgs::default())
        };
        assert!(with("https://shop.example").is_ok());
        assert!(with("http://localhost:3000").is_ok());
        for bad in [
            "*",
            "shop.example",
            "https://shop.example/",
            "https://a.example/x",
        ] {
            assert!(with(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_flag_set_to_false_beats_a_file_set_to_true() {
        let flags = ConfigArgs {
            audit_repair: Some(false),
            ..Default::default()
        };
        let file = ConfigArgs {
            audit_repair: Some(true),
            metrics_public: Some(true),
            ..Default::default()
        };
        let c = Config::merge(flags, file).unwrap();
        assert!(!c.audit_repair);
        assert!(c.metrics_public);
    }

    #[test]
    fn every_secret_is_masked_and_every_setting_listed() {
        let secret = "pa55word-9f3";
        let a = ConfigArgs {
            database_url: Some(format!("postgres://u:{secret}@h/db")),
            redis_url: Some(format!("redis://:{secret}@127.0.0.1/")),
            admin_token: Some(secret.into()),
            token_secret: Some(secret.into()),
            payment_secret: Some(secret.into()),
            metrics_token: Some(secret.into()),
            sms_hook: Some(format!("curl -u api:{secret} https://sms.example")),
            ..Default::default()
        };
        let c = Config::merge(a, ConfigArgs::default()).unwrap();
        let listing = c.describe();
        assert!(!listing.contains(secret), "{listing}");
        for name in [
            "admin_token",
            "token_secret",
            "payment_secret",
            "metrics_token",
        ] {
            assert!(
                listing
                    .lines()
                    .any(|l| l.starts_with(name) && l.ends_with("= ***")),
                "{name}: {listing}"
            );
        }
        let fields = serde_json::to_value(&c).unwrap();
        let listed = listing.lines().count();
        assert_eq!(listed, fields.as_object().unwrap().len() + 1, "{listing}");
    }

    #[test]
    fn the_sms_hook_is_masked_in_the_start_up_log() {
        let a = ConfigArgs {
            sms_hook: Some("curl -u api:s3cret https://sms.example".into()),
            ..Default::default()
        };
        let c = Config::merge(a, ConfigArgs::default()).unwrap();
        assert!(!c.describe().contains("s3cret"), "{}", c.describe());
    }

    #[test]
    fn dev_mode_is_on_by_default_only_for_sqlite_without_redis() {
        let dev = |db: &str| {
            let a = ConfigArgs {
                database_url: Some(db.into()),
                ..Default::default()
            };
            Config::merge(a, ConfigArgs::default()).unwrap().dev
        };
        assert!(dev("sqlite://x.db"));
        assert!(
            !dev("postgres://u@h/db"),
            "a server database may face real users"
        );
        assert!(!dev("mysql://root@h/db"));
        let forced = ConfigArgs {
            database_url: Some("postgres://u@h/db".into()),
            dev: Some(true),
            ..Default::default()
        };
        assert!(Config::merge(forced, ConfigArgs::default()).unwrap().dev);
    }

    #[test]
    fn every_embedded_database_gets_an_order_log_folder() {
        let dir = |db: &str| default_order_log_dir(db).map(|p| p.display().to_string());
        assert_eq!(
            dir("sqlite://data/x.db").as_deref(),
            Some("data/x.db.orders")
        );
        assert_eq!(dir("sqlite:x.db?mode=rwc").as_deref(), Some("x.db.orders"));
        assert_eq!(dir("postgres://u@h/db").as_deref(), Some("seckill.orders"));
        assert_eq!(dir("mysql://u@h/db").as_deref(), Some("seckill.orders"));
        assert_eq!(dir("sqlite::memory:"), None);
    }
}
