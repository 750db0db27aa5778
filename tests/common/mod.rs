//! Helpers shared by the integration tests: a fresh database or key prefix per test, on
//! the real local servers (PostgreSQL, MariaDB, Redis), and a running `seckill` binary.
#![allow(dead_code)]

use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub mod api;
pub mod cluster;
pub mod mariadb;
pub mod patroni;
pub mod postgres;
pub mod proxy;
pub mod storm;

pub use api::Api;

use seckill::model::{NewOrder, Sale};
use seckill::store::Store;

pub fn pg_admin_url() -> String {
    std::env::var("SECKILL_TEST_PG")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

pub fn mysql_admin_url() -> String {
    std::env::var("SECKILL_TEST_MYSQL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// A test's setting from the environment (`SECKILL_TEST_*` and the like), parsed, else
/// `default`: how many runs, a seed to replay.
pub fn setting<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Runs a program the test needs to completion, and fails the test unless it succeeded.
pub fn run_to_success(command: &mut Command, what: &str) {
    let done = command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(done.success(), "{what} failed");
}

/// Starts a server the test needs, its output in `log`.
pub fn spawn_logged(command: &mut Command, log: std::fs::File, what: &str) -> Child {
    command
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}

pub fn redis_url() -> String {
    std::env::var("SECKILL_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into())
}

pub fn unique(tag: &str) -> String {
    format!(
        "sk_{tag}_{:x}_{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )
}

/// The backends of the SQL store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sql {
    Sqlite,
    Postgres,
    Mariadb,
}

pub const ALL_SQL: [Sql; 3] = [Sql::Sqlite, Sql::Postgres, Sql::Mariadb];

fn replace_db(url: &str, db: &str) -> String {
    let (base, _) = url.rsplit_once('/').expect("database URL has a path");
    format!("{base}/{db}")
}

/// The pid inside a name made by [`unique`], if that process has ended.
fn dead_owner(name: &str) -> bool {
    let pid = name
        .split(['_', ':'])
        .nth(2)
        .and_then(|p| u32::from_str_radix(p, 16).ok());
    pid.is_some_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())
}

/// Drops the databases and Redis keys left by test processes that have ended, once per
/// test process, so that the shared servers do not fill up run after run.
async fn sweep_leftovers() {
    static SWEPT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    SWEPT
        .get_or_init(|| async {
            sqlx::any::install_default_drivers();
            for (admin, list) in [
                (pg_admin_url(), "SELECT CAST(datname AS TEXT) FROM pg_database WHERE datname LIKE 'sk\\_%'"),
                (mysql_admin_url(), "SELECT schema_name FROM information_schema.schemata WHERE schema_name LIKE 'sk\\_%'"),
            ] {
                let Ok(pool) = sqlx::any::AnyPoolOptions::new().max_connections(1).connect(&admin).await else {
                    continue;
                };
                let names: Vec<String> = sqlx::query(list)
                    .fetch_all(&pool)
                    .await
                    .map(|rows| rows.iter().filter_map(|r| sqlx::Row::try_get::<String, _>(r, 0).ok()).collect())
                    .unwrap_or_default();
                for name in names.iter().filter(|n| dead_owner(n)) {
                    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name}")).execute(&pool).await;
                }
                pool.close().await;
            }
            if let Ok(client) = redis::Client::open(redis_url()) {
                if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
                    let keys: Vec<String> = redis::cmd("KEYS").arg("sk_*").query_async(&mut conn).await.unwrap_or_default();
                    for key in keys.iter().filter(|k| dead_owner(k)) {
                        let _: Result<i64, _> = redis::cmd("DEL").arg(key).query_async(&mut conn).await;
                    }
                }
            }
        })
        .await;
}

/// Creates an empty database of its own for one test and returns its URL.
pub async fn fresh_database(kind: Sql) -> String {
    sweep_leftovers().await;
    let name = unique("t");
    match kind {
        Sql::Sqlite => {
            let dir = std::env::temp_dir().join(&name);
            std::fs::create_dir_all(&dir).unwrap();
            format!("sqlite://{}/seckill.db", dir.display())
        }
        Sql::Postgres | Sql::Mariadb => {
            let admin = if kind == Sql::Postgres {
                pg_admin_url()
            } else {
                mysql_admin_url()
            };
            sqlx::any::install_default_drivers();
            let pool = sqlx::any::AnyPoolOptions::new()
                .max_connections(1)
                .connect(&admin)
                .await
                .unwrap_or_else(|e| {
                    panic!("cannot reach {admin}: {e} (run scripts/test, which starts it)")
                });
            sqlx::query(&format!("CREATE DATABASE {name}"))
                .execute(&pool)
                .await
                .unwrap();
            pool.close().await;
            replace_db(&admin, &name)
        }
    }
}

/// A store on a database of its own. Conformance tests run many storms at once against the
/// one shared server of each kind, which then answers slower than a server in production
/// would: they wait up to a minute for a connection rather than the product's 5 s.
pub async fn fresh_store(kind: Sql) -> (Store, String) {
    let url = fresh_database(kind).await;
    let store = Store::connect_waiting(&url, 16, Some(Duration::from_secs(60)))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    (store, url)
}

pub fn sale(id: i64, stock: i64, limit: i64) -> Sale {
    let now = seckill::clock::wall_ms();
    Sale {
        id,
        title: format!("test sale {id}"),
        price_cents: 999,
        initial_stock: stock,
        stock,
        per_user_limit: limit,
        begins_at: now - 60_000,
        ends_at: now + 3_600_000,
        payment_window_secs: 900,
        approved: true,
        paused: false,
        updated_at: now,
        anti_bot: seckill::model::AntiBot::Off,
        segments: 1,
        waiting_room: None,
        external_ref: None,
    }
}

pub fn next_id() -> i64 {
    static IDS: std::sync::OnceLock<seckill::ids::IdGenerator> = std::sync::OnceLock::new();
    IDS.get_or_init(|| seckill::ids::IdGenerator::fixed(1000 + (std::process::id() % 20) as u16))
        .next()
        .unwrap()
}

/// Tests that run a deployment of several processes and judge its timings (a failover's,
/// purchases again within seconds of Redis answering) take turns: each holds this while it
/// runs, so that on two cores none shares the machine with another such test. A lock on a
/// file, not in memory: `cargo nextest` runs each test in a process of its own.
pub async fn one_at_a_time() -> Turn {
    let path = std::env::temp_dir().join("seckill-tests-one-at-a-time.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    // Each open file takes the lock on its own, so threads of one process wait too.
    tokio::task::spawn_blocking(move || {
        file.lock().expect("a lock on the turn file");
        Turn { _file: file }
    })
    .await
    .expect("waiting for the turn")
}

/// Held while a test has its turn; dropping it closes the file, which ends the lock.
pub struct Turn {
    _file: std::fs::File,
}

// ---- a running server ----------------------------------------------------------------------

pub struct Server {
    pub child: Child,
    /// Where its log goes (see [`spawn`]).
    pub log: std::path::PathBuf,
    pub base: String,
    pub admin: String,
    pub env: Vec<(String, String)>,
    pub args: Vec<String>,
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Server {
    /// `seckill serve` alone on a SQLite database of its own (the laptop start), with
    /// these settings besides.
    pub async fn embedded(extra: &[(&str, &str)]) -> Server {
        let mut env = vec![(
            "SECKILL_DATABASE_URL".to_string(),
            fresh_database(Sql::Sqlite).await,
        )];
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        Server::start(env, vec!["serve".into()]).await
    }

    /// Starts `seckill <args>` with these settings and waits until it answers /healthz.
    pub async fn start(env: Vec<(String, String)>, args: Vec<String>) -> Server {
        let mut server = Server::spawn(env, args);
        server.wait_ready().await;
        server
    }

    /// Starts `seckill <args>` without waiting for it.
    pub fn spawn(env: Vec<(String, String)>, args: Vec<String>) -> Server {
        let port = free_port();
        let admin = "test-admin-token".to_string();
        let mut all_env = env.clone();
        all_env.push(("SECKILL_LISTEN".into(), format!("127.0.0.1:{port}")));
        all_env.push(("SECKILL_ADMIN_TOKEN".into(), admin.clone()));
        // SECKILL_TEST_SERVER_LOG (e.g. debug) to see more or less of what the servers do.
        let log = std::env::var("SECKILL_TEST_SERVER_LOG").unwrap_or_else(|_| "info".into());
        all_env.push(("SECKILL_LOG".into(), log));
        let (child, log) = spawn(&all_env, &args);
        Server {
            child,
            log,
            base: format!("http://127.0.0.1:{port}"),
            admin,
            env: all_env,
            args,
        }
    }

    /// A client of its API, calling admin operations with its admin token.
    pub fn api(&self) -> Api {
        Api::new(&self.base).admin(&self.admin)
    }

    /// The value of one of its settings (as given to it, e.g. `SECKILL_DATABASE_URL`).
    pub fn env_value(&self, key: &str) -> String {
        self.env
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("{key} is not set"))
    }

    /// Waits up to 30 s until it serves: /healthz answers `ok` (while the process starts it
    /// answers `starting`).
    pub async fn wait_ready(&mut self) {
        let api = Api::with_client(reqwest::Client::new(), &self.base);
        for _ in 0..300 {
            let health = Api::try_send(api.request(reqwest::Method::GET, "/healthz")).await;
            if health.is_ok_and(|r| r.status == 200 && r.text == "ok") {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("seckill exited early: {status}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("seckill did not become ready at {}", self.base);
    }

    /// SIGKILL: no shutdown, no flush.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the same command again, on the same port, after a kill.
    pub async fn restart(&mut self) {
        (self.child, self.log) = spawn(&self.env, &self.args);
        self.wait_ready().await;
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        settle_log(
            &self.log,
            &format!("seckill {} at {}", self.args.join(" "), self.base),
        );
    }
}

/// A process's log once it is gone: its last lines printed when the test is failing (the
/// story of a failure that will not happen again on demand), then removed unless kept
/// (SECKILL_TEST_LOGS).
fn settle_log(log: &std::path::Path, what: &str) {
    if std::thread::panicking() {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = &lines[lines.len().saturating_sub(80)..];
        eprintln!("---- the last {} lines of {what}'s log ----", tail.len());
        for line in tail {
            eprintln!("{line}");
        }
    }
    if std::env::var("SECKILL_TEST_LOGS").is_err() {
        let _ = std::fs::remove_file(log);
    }
}

/// Starts `seckill <args>`; the child and the file its log (stdout) goes to: in
/// SECKILL_TEST_LOGS when set (kept), else in the temp folder (removed when it ends, its
/// tail printed first if the test is failing).
pub fn spawn(env: &[(String, String)], args: &[String]) -> (Child, std::path::PathBuf) {
    // SECKILL_TEST_BIN runs the tests against another build (an older commit's, to show
    // that a test fails without its fix).
    let bin = std::env::var("SECKILL_TEST_BIN").unwrap_or(env!("CARGO_BIN_EXE_seckill").into());
    let mut cmd = Command::new(bin);
    let dir = std::env::var("SECKILL_TEST_LOGS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| std::env::temp_dir().join("seckill-test-logs"));
    let _ = std::fs::create_dir_all(&dir);
    let log = dir.join(format!("{}.log", unique("seckill")));
    let stdout = std::fs::File::create(&log)
        .map(Stdio::from)
        .unwrap_or(Stdio::null());
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::inherit());
    for key in [
        "SECKILL_REDIS_URL",
        "SECKILL_DATABASE_URL",
        "SECKILL_DEV",
        "SECKILL_CONFIG",
    ] {
        cmd.env_remove(key);
    }
    // The audit reports drift and repairs nothing unless a test asks for repairs: a test
    // that ends with the gate reconciled exact must not have a repair hide the fault.
    cmd.env("SECKILL_AUDIT_REPAIR", "0");
    // Servers run as a new deployment would (docs/operating/deploying.md); the gate
    // conformance tests cover the default form, and every form in one stream.
    cmd.env("SECKILL_ORDER_LOG_ENTRY", "batch");
    for (k, v) in env {
        cmd.env(k, v);
    }
    (cmd.spawn().expect("spawn seckill"), log)
}

/// A `seckill worker` process, SIGKILLed when dropped.
pub struct Worker(pub Child, pub std::path::PathBuf);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        settle_log(&self.1, "seckill worker");
    }
}

impl Worker {
    /// Where this worker stands, for a failing test's report: "running", "exited (status)",
    /// or "starting" with its last log line.
    pub fn state(&mut self) -> String {
        if let Ok(Some(status)) = self.0.try_wait() {
            return format!("exited ({status})");
        }
        let text = std::fs::read_to_string(&self.1).unwrap_or_default();
        if text.contains("seckill worker running") {
            return "running".into();
        }
        let last = text.lines().last().unwrap_or("");
        format!("starting; last log line: {last}")
    }
}

/// Starts `seckill worker` with a deployment's settings.
pub fn worker(env: &[(String, String)]) -> Worker {
    let mut worker_env = env.to_vec();
    worker_env.push(("SECKILL_LOG".into(), "info".into()));
    let (child, log) = spawn(&worker_env, &["worker".to_string()]);
    Worker(child, log)
}

/// Settings as the processes take them, from (name, value) pairs.
pub fn settings(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A time as RFC 3339 (what the API reads and writes).
pub fn rfc3339(t: time::OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap()
}

/// Now plus `secs` seconds (minus, if negative), as RFC 3339.
pub fn rfc3339_in(secs: i64) -> String {
    rfc3339(time::OffsetDateTime::now_utc() + time::Duration::seconds(secs))
}

/// An HTTP client for storms: many connections, no proxy.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(512)
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// The first of a random block of 100,000 valid phone numbers (see [`test_phone`]).
pub fn common_phone_block() -> u64 {
    (rand::random::<u64>() % 9_999) * 100_000
}

/// The `n`th test phone number: a valid Chinese mobile number in E.164 (`+86139` and eight
/// digits), as the server normalises phones and refuses numbers that are not valid.
pub fn test_phone(n: u64) -> String {
    format!("+86139{:08}", n % 100_000_000)
}

/// The user id inside a token (`{user}.{exp}.{sig}`).
pub fn user_of(token: &str) -> i64 {
    token.split('.').next().unwrap().parse().unwrap()
}

/// Waits until `check` holds, or panics with `what` after `secs`.
pub async fn eventually<F, Fut>(secs: u64, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    while std::time::Instant::now() < deadline {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("timed out waiting for: {what}");
}

// ---- a private Redis -----------------------------------------------------------------------

/// A Redis of the test's own (AOF, fsync always, its own port and folder): to be killed,
/// or to count the commands one server sent.
pub struct PrivateRedis {
    child: Child,
    pub port: u16,
    dir: std::path::PathBuf,
}

impl PrivateRedis {
    pub fn start(port: u16, dir: &std::path::Path) -> PrivateRedis {
        PrivateRedis::start_with(port, dir, &["--appendfsync", "always"])
    }

    /// With these settings besides (e.g. `--replicaof 127.0.0.1 PORT`).
    pub fn start_with(port: u16, dir: &std::path::Path, extra: &[&str]) -> PrivateRedis {
        std::fs::create_dir_all(dir).unwrap();
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes",
            ])
            .args(extra)
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server (scripts/test installs it)");
        std::thread::sleep(Duration::from_millis(300));
        PrivateRedis {
            child,
            port,
            dir: dir.to_path_buf(),
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn restart(&mut self) {
        self.restart_with(&["--appendfsync", "always"]);
    }

    /// Starts it again on its port and folder, with these settings.
    pub fn restart_with(&mut self, extra: &[&str]) {
        self.kill();
        let fresh = PrivateRedis::start_with(self.port, &self.dir.clone(), extra);
        // The old one's process is gone and its folder is the new one's: dropping it would
        // delete that folder under the running Redis.
        std::mem::forget(std::mem::replace(self, fresh));
    }

    /// Its data folder (AOF files).
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl PrivateRedis {
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// HMGET of these fields of a hash.
    pub async fn hmget(&self, key: &str, fields: &[i64]) -> Vec<Option<String>> {
        let client = redis::Client::open(self.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        redis::cmd("HMGET")
            .arg(key)
            .arg(fields)
            .query_async(&mut conn)
            .await
            .unwrap()
    }
}

// ---- metrics ---------------------------------------------------------------------------------

/// The value of one series in Prometheus text (0 when absent).
pub fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(name)
                .and_then(|rest| rest.trim().parse().ok())
        })
        .unwrap_or(0)
}

// ---- reconciliation --------------------------------------------------------------------------

/// The confirmed drift of a sale in an instance's /metrics, by kind.
pub fn drift_in(metrics: &str, sale: i64) -> std::collections::HashMap<String, i64> {
    let prefix = format!("seckill_reconcile_drift{{sale=\"{sale}\",kind=\"");
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|rest| {
            let (kind, value) = rest.split_once("\"} ")?;
            Some((kind.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

/// Runs `seckill reconcile ARGS` with this deployment's settings: (exit code, output).
pub fn reconcile_cli(env: &[(String, String)], args: &[&str]) -> (i32, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_seckill"));
    cmd.arg("reconcile").args(args).stdin(Stdio::null());
    for key in [
        "SECKILL_REDIS_URL",
        "SECKILL_DATABASE_URL",
        "SECKILL_CONFIG",
    ] {
        cmd.env_remove(key);
    }
    cmd.envs(env.iter().cloned()).env("SECKILL_LOG", "warn");
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// A new order of one unit at 100 cents by `user_id`, accepted now.
pub fn order(sale_id: i64, user_id: i64) -> NewOrder {
    NewOrder {
        id: next_id(),
        sale_id,
        user_id,
        quantity: 1,
        price_cents: 100,
        accepted_at: seckill::clock::wall_ms(),
        retry_key: None,
    }
}
