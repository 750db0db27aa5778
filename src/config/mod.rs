//! The one typed configuration. Each setting comes from its flag, else its `SECKILL_*`
//! environment variable (both parsed by clap), else the TOML file named by `--config`,
//! else its default. Printed at start-up with secrets masked; never logs a secret.
//!
//! - `settings`: every setting declared once (name, flag, variable, help, default) and
//!   the layers of them;
//! - `resolve`: the layers to a `Config`, and the defaults worked out from other settings;
//! - `validate`: the checks a `Config` must pass, in order;
//! - `describe`: the start-up listing, secrets masked;
//! - `reference`: the configuration reference, generated from the declaration;
//! - `values`, `redis_url`: the value types settings name.
//!
//! Config sits low in the layers: it never imports the store, Redis client or HTTP edge.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Serialize;

mod describe;
pub mod redis_url;
mod reference;
mod resolve;
mod settings;
mod validate;
mod values;

use describe::{masked_url, masked_url_opt, seconds, secret};
pub use reference::reference_markdown;
pub use resolve::default_order_log_dir;
pub use settings::ConfigArgs;
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

/// The resolved configuration: the settings declared in `settings`, each with its value,
/// a few combined (the rates) or turned into the type their users want (durations). Its
/// serialized form is the start-up log's listing, so a secret field says how it is masked
/// where it is declared.
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
    pub auth_issuer: Option<String>,
    pub auth_audience: Option<String>,
    pub auth_jwks_url: Option<String>,
    pub auth_jwks_file: Option<PathBuf>,
    #[serde(serialize_with = "secret")]
    pub auth_hs256_secret: Option<String>,
    pub auth_subject_claim: String,
    pub auth_leeway_secs: u64,
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
}

#[cfg(test)]
mod tests {
    use super::settings::Settings;
    use super::*;

    #[test]
    fn flags_beat_file_beat_defaults() {
        let flags = Settings {
            writer_batch: Some(7),
            ..Default::default()
        };
        let file = Settings {
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
        let a = Settings {
            redis_url: Some("redis://127.0.0.1/".into()),
            ..Default::default()
        };
        assert!(Config::merge(a.clone(), Settings::default()).is_err());
        let a = Settings {
            database_url: Some("postgres://u:hunter2@h/db".into()),
            ..a
        };
        let c = Config::merge(a, Settings::default()).unwrap();
        assert!(!c.dev);
        assert!(!c.describe().contains("hunter2"));
    }

    #[test]
    fn a_default_clap_fills_in_never_hides_the_file() {
        use clap::{Args, FromArgMatches};
        let cli = ConfigArgs::augment_args(clap::Command::new("seckill"))
            .mut_args(|arg| arg.env(None::<&str>))
            .subcommand(clap::Command::new("serve"));
        let file = Settings {
            listen: Some("0.0.0.0:9000".parse().unwrap()),
            writer_batch: Some(9),
            audit_repair: Some(true),
            ..Default::default()
        };
        for argv in [
            &[
                "seckill",
                "serve",
                "--writer-batch",
                "7",
                "--audit-repair=false",
            ][..],
            &[
                "seckill",
                "--writer-batch",
                "7",
                "--audit-repair",
                "false",
                "serve",
            ],
        ] {
            let matches = cli.clone().try_get_matches_from(argv).unwrap();
            let flags = ConfigArgs::from_arg_matches(&matches).unwrap();
            assert_eq!(flags.0.listen, None, "{argv:?}: a default is no flag");
            let c = Config::merge(flags.0, file.clone()).unwrap();
            assert_eq!(c.listen.to_string(), "0.0.0.0:9000", "{argv:?}");
            assert_eq!(c.writer_batch, 7, "{argv:?}");
            assert!(!c.audit_repair, "{argv:?}");
            assert_eq!(c.redis_prefix, "seckill", "{argv:?}");
        }
    }

    #[test]
    fn toml_file_parses_and_rejects_unknown_keys() {
        let ok: Settings = toml::from_str("writer_batch = 5\nlisten = \"0.0.0.0:9000\"").unwrap();
        assert_eq!(ok.writer_batch, Some(5));
        assert!(toml::from_str::<Settings>("no_such_key = 1").is_err());
    }

    #[test]
    fn the_simulated_payment_provider_is_never_the_default_outside_dev_mode() {
        let with = |a: Settings| Config::merge(a, Settings::default());
        let pg = || Settings {
            database_url: Some("postgres://u@h/db".into()),
            ..Default::default()
        };
        assert_eq!(with(pg()).unwrap().payment_provider, None);
        assert_eq!(
            with(Settings::default()).unwrap().payment_provider,
            Some(PaymentProviderKind::Simulated),
            "dev mode"
        );
        let named = Settings {
            payment_provider: Some(PaymentProviderKind::Simulated),
            ..pg()
        };
        assert_eq!(
            with(named).unwrap().payment_provider,
            Some(PaymentProviderKind::Simulated)
        );
        let url = Some("https://pay.example/?ref={intent_id}".to_string());
        let no_secret = Settings {
            payment_redirect_url: url.clone(),
            ..pg()
        };
        assert!(with(no_secret).is_err(), "a real provider needs its secret");
        let real = Settings {
            payment_redirect_url: url,
            payment_secret: Some("s".into()),
            ..pg()
        };
        assert_eq!(
            with(real).unwrap().payment_provider,
            Some(PaymentProviderKind::Redirect)
        );
        let bad_region = Settings {
            phone_region: Some("ZZ".into()),
            ..Default::default()
        };
        assert!(with(bad_region).is_err());
        let forever = Settings {
            token_ttl_secs: Some(u64::MAX),
            ..Default::default()
        };
        assert!(with(forever).is_err());
    }

    #[test]
    fn cors_origins_are_exact_origins() {
        let with = |o: &str| {
            let a = Settings {
                cors_origins: Some(vec![o.into()]),
                ..Default::default()
            };
            Config::merge(a, Settings::default())
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
        let flags = Settings {
            audit_repair: Some(false),
            ..Default::default()
        };
        let file = Settings {
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
        let a = Settings {
            database_url: Some(format!("postgres://u:{secret}@h/db")),
            redis_url: Some(format!("redis://:{secret}@127.0.0.1/")),
            admin_token: Some(secret.into()),
            token_secret: Some(secret.into()),
            auth_issuer: Some("https://id.shop.example".into()),
            auth_audience: Some("seckill".into()),
            auth_hs256_secret: Some(format!("{secret}-and-32-bytes-at-least-000")),
            payment_secret: Some(secret.into()),
            metrics_token: Some(secret.into()),
            sms_hook: Some(format!("curl -u api:{secret} https://sms.example")),
            ..Default::default()
        };
        let c = Config::merge(a, Settings::default()).unwrap();
        let listing = c.describe();
        assert!(!listing.contains(secret), "{listing}");
        for name in [
            "admin_token",
            "token_secret",
            "auth_hs256_secret",
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
        let a = Settings {
            sms_hook: Some("curl -u api:s3cret https://sms.example".into()),
            ..Default::default()
        };
        let c = Config::merge(a, Settings::default()).unwrap();
        assert!(!c.describe().contains("s3cret"), "{}", c.describe());
    }

    #[test]
    fn dev_mode_is_on_by_default_only_for_sqlite_without_redis() {
        let dev = |db: &str| {
            let a = Settings {
                database_url: Some(db.into()),
                ..Default::default()
            };
            Config::merge(a, Settings::default()).unwrap().dev
        };
        assert!(dev("sqlite://x.db"));
        assert!(
            !dev("postgres://u@h/db"),
            "a server database may face real users"
        );
        assert!(!dev("mysql://root@h/db"));
        let forced = Settings {
            database_url: Some("postgres://u@h/db".into()),
            dev: Some(true),
            ..Default::default()
        };
        assert!(Config::merge(forced, Settings::default()).unwrap().dev);
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
