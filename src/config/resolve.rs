//! From the layered settings to the typed `Config`: flags and variables over the file over
//! the literal defaults, then the defaults worked out from other settings (the database,
//! the Redis URL, the rate), each in a named function whose rule the setting's help states
//! in words. Never judges a value (that is `validate`) and never restates a literal default
//! (that is `settings`).

use std::path::PathBuf;
use std::time::Duration;

use super::settings::{ConfigArgs, Settings};
use super::values::{Durability, GateKind, PaymentProviderKind, RateLimit};
use super::{redis_url, Config, ConfigError};

impl Config {
    pub fn load(args: &ConfigArgs) -> Result<Config, ConfigError> {
        let file = Settings::from_file(args.0.config.as_ref())?;
        Config::merge(args.0.clone(), file)
    }

    /// Flags and variables (`flags`) over the file over the defaults, resolved and checked.
    pub(super) fn merge(flags: Settings, file: Settings) -> Result<Config, ConfigError> {
        let defaults = Settings::defaults()?;
        let config = resolve(Settings::layered([&flags, &file, &defaults])?)?;
        config.validate()?;
        Ok(config)
    }
}

/// What several defaults follow: where purchases are decided and on which database.
struct Deployment {
    embedded: bool,
    cluster: bool,
    sqlite: bool,
    dev: bool,
}

impl Deployment {
    fn of(redis_url: Option<&str>, database_url: &str, dev: Option<bool>) -> Deployment {
        let embedded = redis_url.is_none();
        let sqlite = database_url.starts_with("sqlite:");
        Deployment {
            embedded,
            cluster: redis_url.is_some_and(redis_url::is_cluster_url),
            sqlite,
            // Dev mode hands out login codes: only the laptop start (no Redis, a SQLite
            // file) has it by default. A server database means real users may be near.
            dev: dev.unwrap_or(embedded && sqlite),
        }
    }
}

/// One line per field of `Config`: a setting with a literal default always has a value by
/// now (`given`), the others take their worked-out default here.
fn resolve(s: Settings) -> Result<Config, ConfigError> {
    let redis_url = s.redis_url.filter(|url| !url.is_empty());
    let database_url = given(s.database_url)?;
    let deployment = Deployment::of(redis_url.as_deref(), &database_url, s.dev);
    let payment_redirect_url = s.payment_redirect_url.filter(|url| !url.is_empty());
    let rate_address_per_sec = given(s.rate_address_per_sec)?;
    Ok(Config {
        listen: given(s.listen)?,
        order_log_dir: s
            .order_log_dir
            .or_else(|| default_order_log_dir(&database_url)),
        database_url,
        redis_url,
        redis_prefix: given(s.redis_prefix)?,
        redis_durability: s
            .redis_durability
            .unwrap_or(default_durability(&deployment)),
        order_log_entry: given(s.order_log_entry)?,
        admin_token: non_empty(s.admin_token),
        token_secret: non_empty(s.token_secret),
        auth_issuer: non_empty(s.auth_issuer),
        auth_audience: non_empty(s.auth_audience),
        auth_jwks_url: non_empty(s.auth_jwks_url),
        auth_jwks_file: s.auth_jwks_file,
        auth_hs256_secret: non_empty(s.auth_hs256_secret),
        auth_subject_claim: given(s.auth_subject_claim)?,
        auth_leeway_secs: given(s.auth_leeway_secs)?,
        payment_secret: non_empty(s.payment_secret),
        dev: deployment.dev,
        payment_provider: s.payment_provider.or(default_payment_provider(
            payment_redirect_url.is_some(),
            deployment.dev,
        )),
        payment_redirect_url,
        sms_hook: s.sms_hook,
        phone_region: given(s.phone_region)?.to_ascii_uppercase(),
        metrics_token: non_empty(s.metrics_token),
        metrics_public: given(s.metrics_public)?,
        wrong_token_limit: given(s.wrong_token_limit)?,
        run_writer: !given(s.no_writer)?,
        writer_batch: s.writer_batch.unwrap_or(default_writer_batch(&deployment)),
        writer_concurrency: given(s.writer_concurrency)?,
        rate_user: RateLimit {
            per_sec: given(s.rate_user_per_sec)?,
            burst: given(s.rate_user_burst)?,
        },
        rate_address: RateLimit {
            per_sec: rate_address_per_sec,
            burst: s
                .rate_address_burst
                .unwrap_or(default_burst(rate_address_per_sec)),
        },
        trusted_proxies: s.trusted_proxies.unwrap_or_default(),
        preload_ahead_secs: given(s.preload_ahead_secs)?,
        writer_lag_not_ready_secs: given(s.writer_lag_not_ready_secs)?,
        audit_every_secs: given(s.audit_every_secs)?,
        db_failover_window_secs: given(s.db_failover_window_secs)?,
        audit_repair: given(s.audit_repair)?,
        token_ttl_secs: given(s.token_ttl_secs)?,
        db_max_connections: given(s.db_max_connections)?,
        max_connections: given(s.max_connections)?.max(1),
        header_read_timeout: Duration::from_secs(given(s.header_read_timeout_secs)?),
        idle_timeout: Duration::from_secs(given(s.idle_timeout_secs)?),
        max_connections_per_address: given(s.max_connections_per_address)?,
        cors_origins: s.cors_origins.unwrap_or_default(),
        gate: s.gate.unwrap_or(default_gate(&deployment)),
        threads: s.threads.unwrap_or_else(default_threads),
        log: given(s.log)?,
    })
}

/// The value of a setting declared with a literal default, which the defaults layer
/// always gives.
fn given<T>(value: Option<T>) -> Result<T, ConfigError> {
    value.ok_or_else(|| ConfigError::Invalid {
        name: "config",
        message: format!(
            "a setting of type {} has no value: is its default_value declared?",
            std::any::type_name::<T>()
        ),
    })
}

/// A secret or URL given empty (an empty variable, say) is no secret or URL at all.
fn non_empty(value: Option<String>) -> Option<String> {
    value.filter(|s| !s.is_empty())
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

/// A cluster fails over by itself: only what a replica holds survives it.
fn default_durability(deployment: &Deployment) -> Durability {
    if deployment.cluster {
        Durability::Replica
    } else {
        Durability::None
    }
}

/// The simulated provider lets a buyer mark their own order paid: never by default outside
/// dev mode.
fn default_payment_provider(redirect_url: bool, dev: bool) -> Option<PaymentProviderKind> {
    if redirect_url {
        Some(PaymentProviderKind::Redirect)
    } else if dev {
        Some(PaymentProviderKind::Simulated)
    } else {
        None
    }
}

/// SQLite pays per page a commit touches, so fewer, larger commits drain the embedded log
/// faster (1,000 -> 5,000 cut a 200,000-order backlog's drain from 4.0 to 1.2 s), and per
/// index page: at a million orders, 20,000 to a commit cost 0.8x the CPU per order of 5,000
/// and kept the writer ahead of the gate (p99.9 14-28x the mean wait, not 66x;
/// `scripts/scale-curve`). A worker draining a backlog into PostgreSQL spent 7% less CPU per order
/// (worker, Redis and PostgreSQL) at 5,000 than at 1,000, in three pairs of
/// `scripts/writer-cost`. A batch only fills when the writer is behind; otherwise it holds
/// what arrived since the last.
fn default_writer_batch(deployment: &Deployment) -> usize {
    if deployment.embedded && deployment.sqlite {
        20_000
    } else {
        5000
    }
}

/// A burst of twice the rate: one second's requests may arrive in the same half second.
fn default_burst(per_sec: f64) -> u32 {
    (per_sec * 2.0).ceil() as u32
}

fn default_gate(deployment: &Deployment) -> GateKind {
    if deployment.embedded {
        GateKind::Embedded
    } else {
        GateKind::Redis
    }
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
