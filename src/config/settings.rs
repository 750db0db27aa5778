//! Every setting, declared once: its name (the field, which is also its TOML key), its
//! flag, its `SECKILL_*` variable, its help and its default. `--help`, the configuration
//! reference and the resolver all read this declaration; none of them restates a setting.
//! This file only declares and layers settings: it never works out a default from other
//! settings (that is `resolve`) and never judges a value (that is `validate`).
//!
//! A literal default is clap's `default_value`: `--help` shows it and `Settings::defaults`
//! parses it as a flag would be, so the value used is the text shown. A default worked out
//! from other settings is described instead, at the end of the help's first paragraph, as
//! `[default: ...]`. The first paragraph is the short help (`-h`); the paragraphs after it
//! explain the setting in full (`--help` and the reference).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{ArgMatches, Args, Command, FromArgMatches};
use serde::{Deserialize, Serialize};

use super::values::{Durability, EntryForm, GateKind, PaymentProviderKind};
use super::ConfigError;

/// One layer of settings: what the flags and variables give, what the file gives, or the
/// defaults. Every field is optional so that a setting one layer lacks falls through to
/// the next.
#[derive(Debug, Clone, Default, Args, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
#[command(
    next_help_heading = "Settings of every subcommand (flags, SECKILL_* variables or --config)"
)]
pub struct Settings {
    /// TOML file with any of these settings (snake_case keys) [default: none].
    ///
    /// A key the file does not know is refused. A flag or its variable beats the file; the
    /// file beats the default.
    #[arg(long, env = "SECKILL_CONFIG", global = true)]
    #[serde(skip)]
    pub config: Option<PathBuf>,

    /// Address the HTTP server listens on.
    #[arg(
        long,
        env = "SECKILL_LISTEN",
        global = true,
        default_value = "127.0.0.1:8080"
    )]
    pub listen: Option<SocketAddr>,

    /// SQL database: `sqlite://FILE`, `postgres://...`, `mysql://...`
    #[arg(
        long = "database",
        env = "SECKILL_DATABASE_URL",
        global = true,
        default_value = "sqlite://seckill.db"
    )]
    pub database_url: Option<String>,

    /// Folder of the order log when purchases are decided in this process (no --redis):
    /// accepted orders are fsynced there before `ok` [default: beside a SQLite file
    /// (`seckill.db` -> `seckill.db.orders`), else `./seckill.orders`].
    ///
    /// The folder is bound to its database and refuses another one's orders. An in-memory
    /// SQLite database has none: it is refused unless --order-log-dir is given or purchases
    /// are decided in SQL.
    #[arg(long, env = "SECKILL_ORDER_LOG_DIR", global = true)]
    pub order_log_dir: Option<PathBuf>,

    /// Redis URL; when set, seckill runs distributed (gate and order log in Redis):
    /// `redis://HOST:PORT/` (or `rediss://`),
    /// `redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME` to follow a Sentinel-managed
    /// master through failovers, or `redis+cluster://HOST:PORT[,HOST:PORT...]` (seed nodes)
    /// for a Redis Cluster [default: unset: the embedded deployment].
    #[arg(long = "redis", env = "SECKILL_REDIS_URL", global = true)]
    pub redis_url: Option<String>,

    /// Prefix of every Redis key.
    #[arg(
        long,
        env = "SECKILL_REDIS_PREFIX",
        global = true,
        default_value = "seckill"
    )]
    pub redis_prefix: Option<String>,

    /// What an `ok` waits for after the gate's script: `none` (Redis' memory; its own
    /// appendfsync decides), `aof` (WAITAOF: fsynced to the master's AOF) or `replica`
    /// (WAIT: received by a replica, so a failover keeps it) [default: `replica` on a
    /// cluster, else `none`].
    ///
    /// When the wait fails the buyer is answered 202 `pending`, never `ok`. Only with
    /// --redis: without Redis every `ok` is already fsynced to the order log (see
    /// docs/operating/redis-failover.md).
    #[arg(long, env = "SECKILL_REDIS_DURABILITY", global = true)]
    pub redis_durability: Option<Durability>,

    /// How the gate writes accepted orders into the Redis order log: `fields` (an entry per
    /// order, one field per value: the form every build reads), `packed` (an entry per
    /// order, one field, which writers read with a third less CPU, theirs and Redis') or
    /// `batch`
    /// (one entry per purchase-script call, holding its orders: 9-24% less of Redis' CPU
    /// per winner, a fifth less for the writers' drain, and fewer entries to read and
    /// delete).
    ///
    /// `packed` or `batch` only for a new deployment, or once no process of a build that
    /// cannot read the form uses the same Redis (see docs/operating/upgrading.md): such a
    /// build would dead-letter those entries and leave them out of a gate rebuild.
    #[arg(
        long,
        env = "SECKILL_ORDER_LOG_ENTRY",
        global = true,
        default_value = "fields"
    )]
    pub order_log_entry: Option<EntryForm>,

    /// Bearer token of the admin API [default: unset: the admin API is closed].
    #[arg(
        long,
        env = "SECKILL_ADMIN_TOKEN",
        global = true,
        hide_env_values = true
    )]
    pub admin_token: Option<String>,

    /// Secret that signs user tokens [default: generated once, kept in the database's
    /// `meta` table].
    #[arg(
        long,
        env = "SECKILL_TOKEN_SECRET",
        global = true,
        hide_env_values = true
    )]
    pub token_secret: Option<String>,

    /// Issuer of the shop's own buyer tokens (JWTs), e.g. `https://id.shop.example`;
    /// setting it turns shop sign-in on [default: unset: buyers sign in by phone only].
    ///
    /// A token's `iss` must equal it. Its signing keys come from --auth-jwks-url,
    /// --auth-jwks-file or --auth-hs256-secret, else from the issuer's
    /// `/.well-known/openid-configuration` (its `jwks_uri`). A buyer is the pair (issuer,
    /// subject), made once at its first token; phone sign-in keeps working beside it.
    #[arg(long, env = "SECKILL_AUTH_ISSUER", global = true)]
    pub auth_issuer: Option<String>,

    /// Audience a shop token must name in `aud` (the shop's client id or API name for
    /// seckill); required with --auth-issuer [default: unset].
    #[arg(long, env = "SECKILL_AUTH_AUDIENCE", global = true)]
    pub auth_audience: Option<String>,

    /// URL of the issuer's JSON Web Key Set [default: the issuer's discovery document's
    /// `jwks_uri`].
    ///
    /// Fetched off the purchase path and kept: again every five minutes, and when a token
    /// names a key id not in it (at most once every five seconds). While the URL does not
    /// answer, the keys last fetched keep working.
    #[arg(long, env = "SECKILL_AUTH_JWKS_URL", global = true)]
    pub auth_jwks_url: Option<String>,

    /// File holding the issuer's JSON Web Key Set, read again on the same schedule as a URL
    /// (so a key rotated into it needs no restart) [default: unset].
    #[arg(long, env = "SECKILL_AUTH_JWKS_FILE", global = true)]
    pub auth_jwks_file: Option<PathBuf>,

    /// Secret shared with the shop, for shop tokens signed with HS256 instead of a key set
    /// (at least 32 bytes) [default: unset].
    #[arg(
        long = "auth-hs256-secret",
        env = "SECKILL_AUTH_HS256_SECRET",
        global = true,
        hide_env_values = true
    )]
    pub auth_hs256_secret: Option<String>,

    /// Claim of a shop token that names the buyer.
    #[arg(
        long,
        env = "SECKILL_AUTH_SUBJECT_CLAIM",
        global = true,
        default_value = "sub"
    )]
    pub auth_subject_claim: Option<String>,

    /// Seconds a shop token's `exp` and `nbf` may be off, for clocks that differ.
    #[arg(
        long,
        env = "SECKILL_AUTH_LEEWAY_SECS",
        global = true,
        default_value = "30"
    )]
    pub auth_leeway_secs: Option<u64>,

    /// Development mode: login codes are returned in the answer, so anyone can log in as
    /// any phone [default: on only for the zero-configuration start, SQLite without
    /// Redis].
    ///
    /// Off by default with PostgreSQL or MySQL and with Redis. Every start with it on logs
    /// one `DEV MODE IS ON` warning.
    #[arg(long, env = "SECKILL_DEV", global = true, num_args = 0..=1, default_missing_value = "true",
          value_parser = clap::builder::BoolishValueParser::new())]
    pub dev: Option<bool>,

    /// Secret shared with the payment provider, which signs its callbacks with it; a real
    /// provider (`redirect`) needs it set [default: generated once and kept in the
    /// database's `meta` table, for the built-in simulated provider].
    #[arg(
        long,
        env = "SECKILL_PAYMENT_SECRET",
        global = true,
        hide_env_values = true
    )]
    pub payment_secret: Option<String>,

    /// Who takes payments: `simulated` (the built-in provider's pay page and callbacks, for
    /// trials: anyone can mark their own order paid) or `redirect` (a real provider's
    /// hosted pay page, --payment-redirect-url, confirming through signed callbacks)
    /// [default: `redirect` when --payment-redirect-url is set, else `simulated` in dev
    /// mode, else none: `/pay` answers 503 `payment_unavailable`].
    ///
    /// `simulated` outside dev mode only when named, with a warning at start.
    #[arg(long, env = "SECKILL_PAYMENT_PROVIDER", global = true)]
    pub payment_provider: Option<PaymentProviderKind>,

    /// The real provider's pay page for an intent, with `{intent_id}`, `{order_id}`,
    /// `{amount_cents}` and `{expires_at}` filled in, e.g.
    /// `https://pay.example/checkout?ref={intent_id}&amount={amount_cents}` [default:
    /// unset].
    ///
    /// Its callbacks are signed with --payment-secret, which must then be set.
    #[arg(long, env = "SECKILL_PAYMENT_REDIRECT_URL", global = true)]
    pub payment_redirect_url: Option<String>,

    /// Command run to deliver a login code (env `SECKILL_PHONE`, `SECKILL_CODE`) outside
    /// dev mode [default: unset].
    ///
    /// A shell command line; masked in the start-up log, as it may hold an API key.
    #[arg(long, env = "SECKILL_SMS_HOOK", global = true)]
    pub sms_hook: Option<String>,

    /// Region of phone numbers written without a country code (ISO 3166 code such as CN,
    /// US, DE): numbers are normalised to E.164 before they name a user.
    #[arg(
        long,
        env = "SECKILL_PHONE_REGION",
        global = true,
        default_value = "CN"
    )]
    pub phone_region: Option<String>,

    /// Bearer token that may read `/metrics` (the admin token may too) [default: unset].
    #[arg(
        long,
        env = "SECKILL_METRICS_TOKEN",
        global = true,
        hide_env_values = true
    )]
    pub metrics_token: Option<String>,

    /// Wrong admin or metrics tokens one client address may send before every admin call
    /// from it is answered 429 (then one more a minute); `0` turns the guard off.
    ///
    /// Counted per instance. Over it, every admin call from the address gets 429
    /// `rate_limited` with `Retry-After`; a call with no token at all still gets 401.
    #[arg(
        long,
        env = "SECKILL_WRONG_TOKEN_LIMIT",
        global = true,
        default_value = "5"
    )]
    pub wrong_token_limit: Option<u32>,

    /// Serve `/metrics` to anyone, without a token (dev mode does too).
    ///
    /// Off, `/metrics` needs a token outside dev mode; on serves it to anyone, for a server
    /// behind a firewall.
    #[arg(long, env = "SECKILL_METRICS_PUBLIC", global = true, num_args = 0..=1, default_missing_value = "true",
          value_parser = clap::builder::BoolishValueParser::new(), default_value = "false")]
    pub metrics_public: Option<bool>,

    /// Do not run the order writer inside `serve` (run `seckill worker` instead).
    ///
    /// Off, `serve` runs an order writer in-process. Only with --redis: the embedded
    /// deployment writes its orders in-process.
    #[arg(long, env = "SECKILL_NO_WRITER", global = true, num_args = 0..=1, default_missing_value = "true",
          value_parser = clap::builder::BoolishValueParser::new(), default_value = "false")]
    pub no_writer: Option<bool>,

    /// Most orders the writer puts in one SQL transaction, at most 50000 [default: `20000`
    /// on SQLite, `5000` on PostgreSQL or MySQL].
    ///
    /// SQLite pays per page a commit touches, hence its larger batches. A batch fills only
    /// while the writer is behind, or while it waits for more (after a read that found part
    /// of a batch: 50 ms from the embedded log's first order, 20 ms from the start of that
    /// read on a Redis log, so that a storm's orders reach SQL in a few larger batches).
    #[arg(long, env = "SECKILL_WRITER_BATCH", global = true)]
    pub writer_batch: Option<usize>,

    /// Order-writer loops per process; several overlap their database round trips.
    ///
    /// In a distributed deployment; the embedded one always runs one.
    #[arg(
        long,
        env = "SECKILL_WRITER_CONCURRENCY",
        global = true,
        default_value = "4"
    )]
    pub writer_concurrency: Option<usize>,

    /// Purchases per second one user may make on one sale, across all instances (GCRA,
    /// inside the gate's one call); `0` turns it off.
    ///
    /// While the sale is open, a buyer who holds its per-user limit is not throttled: every
    /// further attempt hears 409 `already_purchased`, which no wait would change, and spends
    /// no place in the rate; the purchase that takes a buyer to the limit keeps none either
    /// (a cancelled or expired order takes one when it frees the slot, so buying and
    /// cancelling again runs at the rate).
    #[arg(
        long,
        env = "SECKILL_RATE_USER_PER_SEC",
        global = true,
        default_value = "5"
    )]
    pub rate_user_per_sec: Option<f64>,

    /// Purchases one user may make at once before the per-user rate applies.
    #[arg(
        long,
        env = "SECKILL_RATE_USER_BURST",
        global = true,
        default_value = "10"
    )]
    pub rate_user_burst: Option<u32>,

    /// Requests per second one client address may make to the API (token bucket, per
    /// instance, on every API call); `0` turns it off.
    ///
    /// Off by default: a whole crowd may share one address.
    #[arg(
        long,
        env = "SECKILL_RATE_ADDRESS_PER_SEC",
        global = true,
        default_value = "0"
    )]
    pub rate_address_per_sec: Option<f64>,

    /// Requests one client address may make at once [default: twice the rate].
    #[arg(long, env = "SECKILL_RATE_ADDRESS_BURST", global = true)]
    pub rate_address_burst: Option<u32>,

    /// Proxies whose `X-Forwarded-For` is believed, comma-separated IP addresses [default:
    /// none].
    #[arg(
        long,
        env = "SECKILL_TRUSTED_PROXIES",
        global = true,
        value_delimiter = ','
    )]
    pub trusted_proxies: Option<Vec<IpAddr>>,

    /// Load approved sales into the gate this long before they open, in seconds.
    #[arg(
        long,
        env = "SECKILL_PRELOAD_AHEAD_SECS",
        global = true,
        default_value = "3600"
    )]
    pub preload_ahead_secs: Option<u64>,

    /// An instance is not ready (`/readyz`) while an accepted order has waited this many
    /// seconds to be written to SQL (no writer running, or writers falling behind).
    #[arg(
        long,
        env = "SECKILL_WRITER_LAG_NOT_READY_SECS",
        global = true,
        default_value = "30"
    )]
    pub writer_lag_not_ready_secs: Option<u64>,

    /// Compare each live sale's gate with SQL this often, in seconds (one instance at a
    /// time); `0` turns the continuous audit off.
    ///
    /// See docs/operating/reconciliation.md.
    #[arg(
        long,
        env = "SECKILL_AUDIT_EVERY_SECS",
        global = true,
        default_value = "2"
    )]
    pub audit_every_secs: Option<u64>,

    /// How many seconds every change committed to PostgreSQL or MySQL (orders written,
    /// payments, cancellations, expiries, sales, users) is kept after its commit, in Redis
    /// or beside an embedded server's order log, to be written again if the database fails
    /// over to a replica that lacks it (asynchronous replication).
    ///
    /// Longer than a failover takes plus the replicas' worst lag; `0` keeps nothing (with
    /// synchronous replication only). See `docs/operating/database-failover.md`.
    #[arg(
        long,
        env = "SECKILL_DB_FAILOVER_WINDOW_SECS",
        global = true,
        default_value = "300"
    )]
    pub db_failover_window_secs: Option<u64>,

    /// Repair a sale's gate by itself once the audit confirms it drifted from SQL (and
    /// pause a sale that keeps drifting); `false` only reports drift.
    ///
    /// The audit rebuilds a sale's gate from SQL once it confirms drift that could oversell
    /// (the gate behind SQL), and pauses a sale that keeps drifting (3 repairs in 10
    /// minutes). A gate ahead of SQL (orders SQL lacks, what a database failover leaves) is
    /// filled from the failover window, never rebuilt.
    #[arg(long, env = "SECKILL_AUDIT_REPAIR", global = true, num_args = 0..=1, default_missing_value = "true",
          value_parser = clap::builder::BoolishValueParser::new(), default_value = "true")]
    pub audit_repair: Option<bool>,

    /// Lifetime of a user token, in seconds.
    #[arg(
        long,
        env = "SECKILL_TOKEN_TTL_SECS",
        global = true,
        default_value = "604800"
    )]
    pub token_ttl_secs: Option<u64>,

    /// SQL connection pool size.
    #[arg(
        long,
        env = "SECKILL_DB_MAX_CONNECTIONS",
        global = true,
        default_value = "16"
    )]
    pub db_max_connections: Option<u32>,

    /// Client connections served at once.
    ///
    /// At the cap, the connections that have waited longest for a request (silent since
    /// they connected, or idle on keep-alive, for at least a second) are closed to make
    /// room, 1/64 of the cap at a time, as nginx reuses idle keep-alive connections; only
    /// when every connection is receiving or being served a request do further ones wait in
    /// the accept queue (`/metrics`: `seckill_connections_open`, `_saturated_total`,
    /// `_shed_total`). The open-file limit is raised to its hard limit at start (logged; a
    /// warning when it is below what the settings may open).
    #[arg(
        long,
        env = "SECKILL_MAX_CONNECTIONS",
        global = true,
        default_value = "10000"
    )]
    pub max_connections: Option<usize>,

    /// Seconds a client may take to send a request's head once it has started (against
    /// slowloris).
    #[arg(
        long,
        env = "SECKILL_HEADER_READ_TIMEOUT_SECS",
        global = true,
        default_value = "10"
    )]
    pub header_read_timeout_secs: Option<u64>,

    /// Seconds a connection may stay open without a request (a new connection before its
    /// first byte, a keep-alive connection between requests).
    ///
    /// Closed then, counted in `seckill_connections_timed_out_total`.
    #[arg(
        long,
        env = "SECKILL_IDLE_TIMEOUT_SECS",
        global = true,
        default_value = "60"
    )]
    pub idle_timeout_secs: Option<u64>,

    /// Client connections one address may hold open at once; further ones are closed at
    /// once. Trusted proxies are exempt.
    ///
    /// Counted in `seckill_connections_refused_per_address_total`. Raise it for a load test
    /// from one machine.
    #[arg(
        long,
        env = "SECKILL_MAX_CONNECTIONS_PER_ADDRESS",
        global = true,
        default_value = "1000"
    )]
    pub max_connections_per_address: Option<usize>,

    /// Web origins whose pages may call the API from a browser (CORS), comma-separated,
    /// e.g. `https://shop.example` [default: none, same origin only].
    ///
    /// Exact origins: no wildcard, no path; never with credentials.
    #[arg(
        long,
        env = "SECKILL_CORS_ORIGINS",
        global = true,
        value_delimiter = ','
    )]
    pub cors_origins: Option<Vec<String>>,

    /// How purchases are decided: `redis`, `embedded`, `sql-lock` or `sql-conditional` (in
    /// the database; for comparison, or to run without Redis) [default: `embedded` without
    /// --redis, `redis` with it].
    #[arg(long, env = "SECKILL_GATE", global = true)]
    pub gate: Option<GateKind>,

    /// Threads that run the server's tasks (HTTP, gate calls, writer) of `serve` and
    /// `worker` [default: one per core].
    ///
    /// `1` runs a single event loop, the cheapest per request. On a box shared with other
    /// busy processes (a load generator, the database), fewer threads than cores spend less
    /// time being switched out: on the 2-core test box, shared with the load generator,
    /// Redis and PostgreSQL, one thread spent 6-20% less CPU per accepted order than two for
    /// the same rate (`scripts/cpu-per-order`, with and without `INSTANCE_THREADS=2`).
    #[arg(long, env = "SECKILL_THREADS", global = true)]
    pub threads: Option<usize>,

    /// Log filter, tracing's `EnvFilter` syntax (a level such as `info`, or directives such
    /// as `info,seckill=debug`).
    #[arg(long, env = "SECKILL_LOG", global = true, default_value = "info")]
    pub log: Option<String>,
}

impl Settings {
    /// The declaration alone, as clap holds it: what `--help` and the reference read.
    pub fn declared() -> Command {
        Settings::augment_args(Command::new("seckill"))
    }

    /// Every literal default, parsed as clap parses a flag: the value used is the text
    /// `--help` shows. Variables are left out; a default worked out from other settings
    /// stays unset here.
    pub fn defaults() -> Result<Settings, ConfigError> {
        let no_variables = Settings::declared().mut_args(|arg| arg.env(None::<&str>));
        let defaults = no_variables
            .try_get_matches_from(["seckill"])
            .and_then(|matches| Settings::from_arg_matches(&matches));
        defaults.map_err(|e| ConfigError::Invalid {
            name: "config",
            message: format!("a default does not parse: {e}"),
        })
    }

    /// The file given by `--config`, or an empty layer.
    pub fn from_file(path: Option<&PathBuf>) -> Result<Settings, ConfigError> {
        let Some(path) = path else {
            return Ok(Settings::default());
        };
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.clone(),
            source,
        })?;
        toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.clone(),
            source,
        })
    }

    /// The layers over one another, the first that gives a setting winning: every setting
    /// at once, by name, so that no setting is layered by hand.
    pub fn layered(layers: [&Settings; 3]) -> Result<Settings, ConfigError> {
        let invalid = |e: serde_json::Error| ConfigError::Invalid {
            name: "config",
            message: e.to_string(),
        };
        let mut merged = serde_json::Map::new();
        for layer in layers.iter().rev() {
            let serde_json::Value::Object(given) = serde_json::to_value(layer).map_err(invalid)?
            else {
                continue;
            };
            merged.extend(given.into_iter().filter(|(_, value)| !value.is_null()));
        }
        serde_json::from_value(serde_json::Value::Object(merged)).map_err(invalid)
    }
}

/// The settings given as flags or `SECKILL_*` variables: what clap parsed, less the
/// defaults it filled in, so that a setting the command line leaves out can still come
/// from the file.
#[derive(Debug, Clone, Default)]
pub struct ConfigArgs(pub(super) Settings);

impl FromArgMatches for ConfigArgs {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut given = matches.clone();
        for id in matches.ids() {
            if matches.value_source(id.as_str()) == Some(ValueSource::DefaultValue) {
                given.try_clear_id(id.as_str()).map_err(|e| {
                    clap::Error::raw(clap::error::ErrorKind::InvalidValue, e.to_string())
                })?;
            }
        }
        Settings::from_arg_matches(&given).map(ConfigArgs)
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        *self = ConfigArgs::from_arg_matches(matches)?;
        Ok(())
    }
}

impl Args for ConfigArgs {
    fn group_id() -> Option<clap::Id> {
        Settings::group_id()
    }

    fn augment_args(cmd: Command) -> Command {
        Settings::augment_args(cmd)
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Settings::augment_args_for_update(cmd)
    }
}
