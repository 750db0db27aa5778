//! The checks a resolved configuration must pass before anything starts: each a named
//! step, run in a fixed order so that the first mistake is the one reported. A check only
//! reads the `Config`; it never changes a value and never connects to anything.

use super::values::{Durability, GateKind, PaymentProviderKind};
use super::{redis_url, Config, ConfigError};
use crate::text::mask_url;

/// Most orders in one writer transaction: the inserts go 500 to a statement whatever the
/// batch, and a batch holds about 100 bytes an order.
const MAX_WRITER_BATCH: usize = 50_000;

/// Seconds are turned into milliseconds and added to clocks: bounded, so that no setting
/// can overflow that arithmetic.
const TEN_YEARS_SECS: u64 = 10 * 365 * 86_400;

type Check = fn(&Config) -> Result<(), ConfigError>;

/// Every check, in the order they run.
const CHECKS: &[Check] = &[
    database_matches_the_deployment,
    orders_have_a_home,
    gate_matches_the_deployment,
    rates_are_in_range,
    connection_limits_are_in_range,
    cors_origins_are_exact,
    writer_and_threads_are_in_range,
    redis_url_is_readable,
    redis_durability_has_redis,
    log_filter_parses,
    durations_are_bounded,
    a_real_payment_provider_is_complete,
    phone_region_is_a_region,
    redis_prefix_is_a_plain_prefix,
    shop_sign_in_is_complete,
];

impl Config {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        CHECKS.iter().try_for_each(|check| check(self))
    }
}

fn invalid(name: &'static str, message: impl Into<String>) -> Result<(), ConfigError> {
    Err(ConfigError::Invalid {
        name,
        message: message.into(),
    })
}

fn database_matches_the_deployment(c: &Config) -> Result<(), ConfigError> {
    let db = &c.database_url;
    if !(db.starts_with("sqlite:") || db.starts_with("postgres") || db.starts_with("mysql:")) {
        return invalid(
            "database_url",
            format!("{} is not sqlite://, postgres:// or mysql://", mask_url(db)),
        );
    }
    if !c.embedded() && db.starts_with("sqlite:") {
        return invalid(
            "database_url",
            "a distributed deployment (--redis) needs PostgreSQL or MySQL",
        );
    }
    Ok(())
}

/// An order accepted in memory must be fsynced somewhere before `ok`, and written to SQL by
/// a writer of this process.
fn orders_have_a_home(c: &Config) -> Result<(), ConfigError> {
    if c.embedded() && c.gate == GateKind::Embedded && c.order_log_dir.is_none() {
        return invalid(
            "database_url",
            "an in-memory SQLite database cannot keep accepted orders across a restart: use \
             sqlite://FILE, or give --order-log-dir, or decide purchases in SQL (--gate \
             sql-conditional)",
        );
    }
    if c.embedded() && !c.run_writer {
        return invalid(
            "no_writer",
            "the embedded deployment writes orders in-process; --no-writer needs --redis",
        );
    }
    Ok(())
}

fn gate_matches_the_deployment(c: &Config) -> Result<(), ConfigError> {
    match (c.gate, c.embedded()) {
        (GateKind::Redis, true) => invalid("gate", "the redis gate needs --redis"),
        (GateKind::Embedded, false) => invalid(
            "gate",
            "the embedded gate lives in one process; it cannot be shared through --redis",
        ),
        _ => Ok(()),
    }
}

fn rates_are_in_range(c: &Config) -> Result<(), ConfigError> {
    for (name, rl) in [
        ("rate_user_per_sec", c.rate_user),
        ("rate_address_per_sec", c.rate_address),
    ] {
        if !(0.0..=1_000_000.0).contains(&rl.per_sec) || (rl.per_sec > 0.0 && rl.burst == 0) {
            return invalid(
                name,
                "must be between 0 (off) and 1000000, with a burst of at least 1",
            );
        }
    }
    Ok(())
}

fn connection_limits_are_in_range(c: &Config) -> Result<(), ConfigError> {
    if c.header_read_timeout.is_zero() || c.idle_timeout.is_zero() {
        return invalid(
            "header_read_timeout_secs",
            "header_read_timeout_secs and idle_timeout_secs must be at least 1",
        );
    }
    if c.max_connections_per_address == 0 {
        return invalid("max_connections_per_address", "must be at least 1");
    }
    Ok(())
}

/// A browser compares the `Origin` header byte for byte: a wildcard or a path never
/// matches, and a wildcard would hand the API to any page.
fn cors_origins_are_exact(c: &Config) -> Result<(), ConfigError> {
    for origin in &c.cors_origins {
        let host = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"));
        if host.is_none_or(|h| h.is_empty() || h.contains(['/', '*', ' '])) {
            return invalid(
                "cors_origins",
                format!(
                    "{origin:?} is not an origin such as https://shop.example (no wildcard, \
                     no path)"
                ),
            );
        }
    }
    Ok(())
}

fn writer_and_threads_are_in_range(c: &Config) -> Result<(), ConfigError> {
    if c.writer_concurrency == 0 || c.writer_concurrency > 64 {
        return invalid("writer_concurrency", "must be between 1 and 64");
    }
    if c.threads == 0 || c.threads > 1024 {
        return invalid("threads", "must be between 1 and 1024");
    }
    if c.writer_batch == 0 || c.writer_batch > MAX_WRITER_BATCH {
        return invalid(
            "writer_batch",
            format!("must be between 1 and {MAX_WRITER_BATCH}"),
        );
    }
    Ok(())
}

fn redis_url_is_readable(c: &Config) -> Result<(), ConfigError> {
    let Some(url) = &c.redis_url else {
        return Ok(());
    };
    let valid = if redis_url::is_sentinel_url(url) {
        redis_url::parse(url).map(|_| ())
    } else if redis_url::is_cluster_url(url) {
        redis_url::parse_cluster_url(url).map(|_| ())
    } else {
        redis::Client::open(url.as_str())
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    match valid {
        Ok(()) => Ok(()),
        Err(message) => invalid(
            "redis_url",
            format!(
                "{message} (redis://HOST:PORT/, rediss://..., \
                 redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME or \
                 redis+cluster://HOST:PORT[,HOST:PORT...])"
            ),
        ),
    }
}

fn redis_durability_has_redis(c: &Config) -> Result<(), ConfigError> {
    if c.redis_durability != Durability::None && c.redis_url.is_none() {
        return invalid(
            "redis_durability",
            "applies to the Redis gate: set --redis too (without Redis, every ok is already \
             fsynced to the order log)",
        );
    }
    Ok(())
}

fn log_filter_parses(c: &Config) -> Result<(), ConfigError> {
    match tracing_subscriber::EnvFilter::try_new(&c.log) {
        Ok(_) => Ok(()),
        Err(e) => invalid(
            "log",
            format!(
                "{:?} is not a log filter: {e} (a level such as info or debug, or directives \
                 such as info,seckill=debug)",
                c.log
            ),
        ),
    }
}

fn durations_are_bounded(c: &Config) -> Result<(), ConfigError> {
    for (name, secs) in [
        ("token_ttl_secs", c.token_ttl_secs),
        ("preload_ahead_secs", c.preload_ahead_secs),
        ("writer_lag_not_ready_secs", c.writer_lag_not_ready_secs),
        ("audit_every_secs", c.audit_every_secs),
        ("db_failover_window_secs", c.db_failover_window_secs),
        ("header_read_timeout_secs", c.header_read_timeout.as_secs()),
        ("idle_timeout_secs", c.idle_timeout.as_secs()),
    ] {
        if secs > TEN_YEARS_SECS {
            return invalid(
                name,
                format!("must be at most {TEN_YEARS_SECS} (ten years)"),
            );
        }
    }
    Ok(())
}

/// A real provider sends the buyer to its pay page and confirms through callbacks signed
/// with a secret shared with it: both must be given.
fn a_real_payment_provider_is_complete(c: &Config) -> Result<(), ConfigError> {
    if c.payment_provider != Some(PaymentProviderKind::Redirect) {
        return Ok(());
    }
    let Some(url) = &c.payment_redirect_url else {
        return invalid(
            "payment_provider",
            "redirect needs --payment-redirect-url, the provider's pay page",
        );
    };
    if !(url.starts_with("https://") || url.starts_with("http://")) {
        return invalid("payment_redirect_url", "must be an http:// or https:// URL");
    }
    if c.payment_secret.is_none() {
        return invalid(
            "payment_secret",
            "a real payment provider signs its callbacks with a secret you share with it: \
             set --payment-secret (SECKILL_PAYMENT_SECRET)",
        );
    }
    Ok(())
}

fn phone_region_is_a_region(c: &Config) -> Result<(), ConfigError> {
    if crate::text::phone_region(&c.phone_region).is_none() {
        return invalid(
            "phone_region",
            format!(
                "{:?} is not a region (an ISO 3166 code such as CN, US or DE)",
                c.phone_region
            ),
        );
    }
    Ok(())
}

/// Braces are Redis hash tags: in a prefix they would move every key to one slot.
fn redis_prefix_is_a_plain_prefix(c: &Config) -> Result<(), ConfigError> {
    if c.redis_prefix.is_empty() || c.redis_prefix.contains(['{', '}']) {
        return invalid(
            "redis_prefix",
            "must be non-empty and free of braces (they are Redis hash tags)",
        );
    }
    Ok(())
}

/// Shop tokens are accepted only for one issuer and one audience (a token the issuer made
/// for another of its services must not buy here), with keys from one source.
fn shop_sign_in_is_complete(c: &Config) -> Result<(), ConfigError> {
    let sources = [
        c.auth_jwks_url.is_some(),
        c.auth_jwks_file.is_some(),
        c.auth_hs256_secret.is_some(),
    ];
    let Some(issuer) = &c.auth_issuer else {
        if sources.contains(&true) || c.auth_audience.is_some() {
            return invalid(
                "auth_issuer",
                "shop tokens need --auth-issuer, the value their `iss` must hold",
            );
        }
        return Ok(());
    };
    if sources.iter().filter(|&&s| s).count() > 1 {
        return invalid(
            "auth_jwks_url",
            "give one source of the shop's keys: --auth-jwks-url, --auth-jwks-file or \
             --auth-hs256-secret",
        );
    }
    if c.auth_audience.is_none() {
        return invalid(
            "auth_audience",
            "shop tokens need --auth-audience, the value their `aud` must hold",
        );
    }
    let needs_url = !sources.contains(&true);
    for (name, url) in [
        ("auth_issuer", needs_url.then_some(issuer.as_str())),
        ("auth_jwks_url", c.auth_jwks_url.as_deref()),
    ] {
        if let Some(url) = url {
            if !(url.starts_with("https://") || url.starts_with("http://")) {
                return invalid(name, format!("{url} is not an http(s) URL"));
            }
        }
    }
    if c.auth_hs256_secret.as_ref().is_some_and(|s| s.len() < 32) {
        return invalid(
            "auth_hs256_secret",
            "must be at least 32 bytes (RFC 7518: a key as long as the hash)",
        );
    }
    if c.auth_subject_claim.is_empty() {
        return invalid("auth_subject_claim", "must name a claim");
    }
    if c.auth_leeway_secs > 600 {
        return invalid("auth_leeway_secs", "must be at most 600 (ten minutes)");
    }
    Ok(())
}
