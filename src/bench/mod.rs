//! `seckill bench`: the load generator and its report. It makes buyers (tokens) and a sale,
//! waits for the window to open, storms the purchase endpoint (closed or open model), then
//! waits for the order log to drain and checks the database through the admin audit:
//! orders == min(stock, buyers), nobody over the limit, every `ok` in SQL, nothing oversold.
//! Without `--target` it starts the server itself; `--compare` runs the same storm on every
//! gate. Never used by the server; it only speaks HTTP to it.

mod client;
mod report;
mod room;
mod storm;

use std::collections::{BTreeMap, HashMap};
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::Method;
use rand::seq::SliceRandom;
use serde::Deserialize;

use crate::config::{Config, GateKind};
use crate::store::Store;
use client::Connection;
pub use report::Report;
use storm::Model;

/// See `BenchArgs::sign_in`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SignIn {
    Exchange,
    Verify,
    None,
}

#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Bench options")]
pub struct BenchArgs {
    /// A running server to storm (http://HOST:PORT); without it, bench starts its own.
    #[arg(long)]
    pub target: Option<String>,
    /// Distinct buyers.
    #[arg(long, default_value_t = 10_000)]
    pub buyers: usize,
    /// Stock of the sale.
    #[arg(long, default_value_t = 100)]
    pub stock: i64,
    /// Per-user limit of the sale.
    #[arg(long, default_value_t = 1)]
    pub per_user_limit: i64,
    /// Share of buyers (0 to 1) who press buy a second time.
    #[arg(long, default_value_t = 0.2)]
    pub repeat: f64,
    /// Concurrent connections.
    #[arg(long, default_value_t = 256)]
    pub connections: usize,
    /// Open model: requests per second, latency measured from each intended send time.
    /// Without it, the closed model: every connection sends as fast as answers come.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Bearer tokens, one per line (`seckill users mint`, or the shop's JWTs); otherwise
    /// bench makes users itself.
    #[arg(long)]
    pub tokens: Option<PathBuf>,
    /// What buyers holding shop tokens (JWTs) do at sign-in, before the storm, as a shop's
    /// page would: `exchange` them for seckill's own (`POST /api/auth/exchange`) and buy
    /// with those; `verify` them once (`GET /api/auth/me`) and buy with the shop tokens;
    /// `none`: buy with the shop tokens at once (the target has seen them, or the storm
    /// measures first sight).
    #[arg(long, value_enum, default_value = "exchange")]
    pub sign_in: SignIn,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Run the same storm on each gate (sql-lock, sql-conditional, redis or embedded) and
    /// print one comparison table.
    #[arg(long)]
    pub compare: bool,
    /// Instead of a sale, GET this URL (http://HOST:PORT/PATH) with the same connections and
    /// model, as many times as the storm would send purchases: the ceiling of a server
    /// answering a fixed page (say nginx), to compare the purchase path against.
    #[arg(long)]
    pub baseline: Option<String>,
    /// Longest wait for the order log to drain after the storm.
    #[arg(long, default_value_t = 120)]
    pub drain_timeout_secs: u64,
    /// Threads of the load generator [default: half the cores, at least one]. On a box
    /// it shares with the server it measures, each gets its share of the cores: with one
    /// thread the client runs a single event loop, its cheapest per request.
    #[arg(long)]
    pub client_threads: Option<usize>,
    /// Create the sale with anti-bot purchase tokens: each buyer then fetches a token
    /// (`GET /api/sales/{id}/token`) before every purchase, and latency covers both calls.
    #[arg(long)]
    pub anti_bot: bool,
    /// Put the sale behind a waiting room letting this many buyers through a second: every
    /// buyer joins before the opening, waits for its pass, then buys with it; the report
    /// adds the time from joining to admission.
    #[arg(long, value_name = "ADMIT_PER_SEC")]
    pub waiting_room: Option<i64>,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    Setup(String),
    #[error("http: {0}")]
    Client(#[from] client::ClientError),
    #[error("the checks failed")]
    ChecksFailed,
}

fn setup(msg: impl Into<String>) -> BenchError {
    BenchError::Setup(msg.into())
}

/// A server under test: started by bench, or given by `--target`.
struct Target {
    addr: SocketAddr,
    admin: String,
    child: Option<Child>,
    /// Environment of the started server, to mint users against the same database.
    env: Vec<(String, String)>,
    workdir: Option<PathBuf>,
    /// The scratch database a started server used: (the URL bench was given, its name).
    scratch_database: Option<(String, String)>,
    /// The Redis key prefix a started server used: (Redis URL, prefix).
    scratch_prefix: Option<(String, String)>,
}

impl Target {
    /// Stops a started server and removes what it left: its folder, its scratch database,
    /// its Redis keys. A run leaves nothing in the database or Redis it was given.
    async fn clean_up(mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some((url, name)) = self.scratch_database.take() {
            if let Err(e) = Store::drop_database(&url, &name).await {
                eprintln!("warning: could not drop the scratch database {name}: {e}");
            }
        }
        if let Some((url, prefix)) = self.scratch_prefix.take() {
            if let Err(e) = delete_prefix(&url, &prefix).await {
                eprintln!("warning: could not delete the Redis keys {prefix}:*: {e}");
            }
        }
    }
}

/// Deletes every key under `prefix:` (on every node of a cluster).
async fn delete_prefix(url: &str, prefix: &str) -> Result<(), redis::RedisError> {
    let client = crate::redis_client::RedisClient::open(url)?;
    let mut conn = client.connect().await?;
    for node in client.subscription_nodes(&mut conn).await {
        let Ok(mut node_conn) = node.get_multiplexed_async_connection().await else {
            continue;
        };
        let mut cursor: u64 = 0;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{prefix}:*"))
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut node_conn)
                .await?;
            for key in keys {
                // Through the client that routes by key (a replica refuses writes).
                let _: i64 = redis::cmd("UNLINK")
                    .arg(&key)
                    .query_async(&mut conn)
                    .await?;
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    Ok(())
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(dir) = &self.workdir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

pub async fn run(config: Config, args: BenchArgs) -> Result<(), BenchError> {
    if !(0.0..=1.0).contains(&args.repeat)
        || args.buyers == 0
        || args.stock <= 0
        || args.connections == 0
    {
        return Err(setup(
            "--repeat must be within 0..1; --buyers, --stock and --connections positive",
        ));
    }
    if let Some(url) = &args.baseline {
        return baseline(url, &args).await;
    }
    let reports = if args.compare {
        if args.target.is_some() {
            return Err(setup(
                "--compare starts a server per gate; it takes no --target",
            ));
        }
        let mut gates = vec![GateKind::SqlLock, GateKind::SqlConditional];
        gates.push(if config.redis_url.is_some() {
            GateKind::Redis
        } else {
            GateKind::Embedded
        });
        let mut reports = Vec::new();
        for gate in gates {
            let target = start_server(&config, gate).await?;
            let report = storm_once(&target, &args, gate.name()).await;
            target.clean_up().await;
            reports.push(report?);
        }
        reports
    } else {
        let target = match &args.target {
            Some(url) => remote(url, &config).await?,
            None => start_server(&config, config.gate).await?,
        };
        let gate = if args.target.is_some() {
            target_gate(&target).await
        } else {
            config.gate.name().to_string()
        };
        let report = storm_once(&target, &args, &gate).await;
        target.clean_up().await;
        vec![report?]
    };
    if args.json {
        let json = if args.compare {
            serde_json::to_string_pretty(&reports)
        } else {
            serde_json::to_string_pretty(&reports[0])
        };
        println!("{}", json.map_err(|e| setup(e.to_string()))?);
    } else if args.compare {
        for r in &reports {
            println!("{}", r.table());
        }
        println!("{}", report::comparison(&reports));
    } else {
        println!("{}", reports[0].table());
    }
    for r in &reports {
        if r.seconds < MIN_STABLE_SECONDS {
            eprintln!(
                "bench: the {} storm lasted {:.2} s, too short for a stable figure (connecting, \
                 the first batches and the last stragglers weigh in): give about {:.0}x the \
                 --buyers",
                r.gate,
                r.seconds,
                (MIN_STABLE_SECONDS * 2.0 / r.seconds.max(0.001)).ceil()
            );
        }
    }
    if reports.iter().all(|r| r.checks.passed) {
        Ok(())
    } else {
        Err(BenchError::ChecksFailed)
    }
}

/// Storms shorter than this give throughput figures that vary from run to run.
const MIN_STABLE_SECONDS: f64 = 1.0;

fn model_of(args: &BenchArgs) -> Model {
    match args.rate {
        Some(rate) => Model::Open {
            rate,
            connections: args.connections,
        },
        None => Model::Closed {
            connections: args.connections,
        },
    }
}

/// GETs a fixed URL as hard as a storm would purchase; prints throughput and latency.
async fn baseline(url: &str, args: &BenchArgs) -> Result<(), BenchError> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| setup("--baseline must be http://HOST:PORT/PATH"))?;
    let (hostport, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let addr = resolve(hostport).await?;
    let n = args.buyers + (args.buyers as f64 * args.repeat).round() as usize;
    let shot = storm::Shot::Get {
        path: Arc::from(path),
    };
    let progress = Arc::new(AtomicUsize::new(0));
    let observed = storm::run(addr, shot, Arc::new(vec![0; n]), model_of(args), progress).await;
    let h = &observed.latency;
    let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    let throughput = observed.sent as f64 / observed.elapsed.as_secs_f64().max(1e-9);
    let summary = serde_json::json!({
        "baseline": url,
        "connections": args.connections,
        "requests": observed.sent,
        "seconds": observed.elapsed.as_secs_f64(),
        "throughput": throughput,
        "latency": {
            "mean_ms": h.mean() / 1000.0,
            "p50_ms": ms(0.5),
            "p99_ms": ms(0.99),
            "max_ms": h.max() as f64 / 1000.0,
        },
        "answers": observed.by_code,
        "errors": observed.errors,
    });
    if args.json {
        println!("{summary:#}");
    } else {
        println!(
            "baseline {url}: {throughput:.0} req/s over {:.2} s, mean {:.2} ms, p50 {:.2} ms, p99 {:.2} ms, errors {}",
            observed.elapsed.as_secs_f64(),
            h.mean() / 1000.0,
            ms(0.5),
            ms(0.99),
            observed.errors
        );
    }
    Ok(())
}

async fn resolve(hostport: &str) -> Result<SocketAddr, BenchError> {
    tokio::net::lookup_host(hostport)
        .await
        .map_err(|e| setup(format!("cannot resolve {hostport}: {e}")))?
        .next()
        .ok_or_else(|| setup(format!("{hostport} has no address")))
}

async fn remote(url: &str, config: &Config) -> Result<Target, BenchError> {
    let hostport = url
        .strip_prefix("http://")
        .ok_or_else(|| setup("--target must be http://HOST:PORT"))?
        .trim_end_matches('/');
    let addr = resolve(hostport).await?;
    let admin = config.admin_token.clone().ok_or_else(|| {
        setup("a --target needs the server's admin token (--admin-token or SECKILL_ADMIN_TOKEN)")
    })?;
    Ok(Target {
        addr,
        admin,
        child: None,
        env: Vec::new(),
        workdir: None,
        scratch_database: None,
        scratch_prefix: None,
    })
}

/// The gate a running target says it uses (`seckill_info` in its /metrics), for the
/// report; "target" when it does not say.
async fn target_gate(target: &Target) -> String {
    let answer = match Connection::open(target.addr).await {
        Ok(mut c) => c
            // The admin token may read /metrics, which is closed without one outside dev mode.
            .send(Method::GET, "/metrics", Some(&target.admin), Bytes::new())
            .await
            .ok(),
        Err(_) => None,
    };
    answer
        .and_then(|(status, body)| (status == 200).then_some(body))
        .and_then(|body| gate_of_metrics(&String::from_utf8_lossy(&body)))
        .unwrap_or_else(|| "target".to_string())
}

fn gate_of_metrics(metrics: &str) -> Option<String> {
    let line = metrics.lines().find(|l| l.starts_with("seckill_info{"))?;
    let gate = line.split("gate=\"").nth(1)?.split('"').next()?;
    Some(gate.to_string())
}

async fn start_server(config: &Config, gate: GateKind) -> Result<Target, BenchError> {
    let workdir = std::env::temp_dir().join(format!("seckill-bench-{:08x}", rand::random::<u32>()));
    std::fs::create_dir_all(&workdir).map_err(|e| setup(format!("temp dir: {e}")))?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| setup(format!("no free port: {e}")))?
        .port();
    let admin = crate::text::hex(&rand::random::<[u8; 16]>());
    let (database, scratch_database) = scratch_database(config, &workdir).await?;
    let mut env = vec![
        ("SECKILL_DATABASE_URL".to_string(), database),
        (
            "SECKILL_ORDER_LOG_DIR".to_string(),
            workdir.join("orders").display().to_string(),
        ),
        ("SECKILL_GATE".to_string(), gate.name().to_string()),
        ("SECKILL_ADMIN_TOKEN".to_string(), admin.clone()),
        ("SECKILL_DEV".to_string(), "1".to_string()),
        ("SECKILL_LISTEN".to_string(), format!("127.0.0.1:{port}")),
        ("SECKILL_LOG".to_string(), "warn".to_string()),
        (
            "SECKILL_DB_MAX_CONNECTIONS".to_string(),
            config.db_max_connections.to_string(),
        ),
        ("SECKILL_THREADS".to_string(), config.threads.to_string()),
        // Every simulated buyer comes from this one address.
        (
            "SECKILL_MAX_CONNECTIONS_PER_ADDRESS".to_string(),
            config.max_connections.to_string(),
        ),
    ];
    env.extend(server_settings(config));
    let scratch_prefix = match gate {
        GateKind::Redis => Some(redis_settings(config, &mut env)?),
        _ => None,
    };
    let child = spawn_server(&workdir, &env)?;
    let target = Target {
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        admin,
        child: Some(child),
        env,
        workdir: Some(workdir),
        scratch_database,
        scratch_prefix,
    };
    until_ready(target).await
}

/// The database the server bench starts runs on: a file in its folder for SQLite, else a
/// database of its own beside the one bench was given (dropped afterwards: a run leaves no
/// users, sales or orders behind), with what to drop.
async fn scratch_database(
    config: &Config,
    workdir: &std::path::Path,
) -> Result<(String, Option<(String, String)>), BenchError> {
    if config.database_url.starts_with("sqlite:") {
        return Ok((format!("sqlite://{}/bench.db", workdir.display()), None));
    }
    let name = format!("seckill_bench_{:08x}", rand::random::<u32>());
    let url = Store::create_database(&config.database_url, &name)
        .await
        .map_err(|e| {
            setup(format!(
                "cannot create a scratch database beside the one given: {e}"
            ))
        })?;
    Ok((url, Some((config.database_url.clone(), name))))
}

/// The Redis gate's settings for the server, under a key prefix of its own; the (URL,
/// prefix) whose keys are removed afterwards.
fn redis_settings(
    config: &Config,
    env: &mut Vec<(String, String)>,
) -> Result<(String, String), BenchError> {
    let redis = config
        .redis_url
        .clone()
        .ok_or_else(|| setup("the redis gate needs --redis"))?;
    let prefix = format!("seckill-bench-{:08x}", rand::random::<u32>());
    env.extend([
        (
            "SECKILL_REDIS_DURABILITY".to_string(),
            config.redis_durability.name().to_string(),
        ),
        (
            "SECKILL_ORDER_LOG_ENTRY".to_string(),
            config.order_log_entry.name().to_string(),
        ),
        ("SECKILL_REDIS_URL".to_string(), redis.clone()),
        ("SECKILL_REDIS_PREFIX".to_string(), prefix.clone()),
    ]);
    Ok((redis, prefix))
}

/// `seckill serve` of this binary with exactly `env` of bench's settings, its log in the
/// bench's folder.
fn spawn_server(
    workdir: &std::path::Path,
    env: &[(String, String)],
) -> Result<std::process::Child, BenchError> {
    let exe = std::env::current_exe()
        .map_err(|e| setup(format!("cannot find the seckill binary: {e}")))?;
    let log =
        std::fs::File::create(workdir.join("server.log")).map_err(|e| setup(e.to_string()))?;
    let mut cmd = Command::new(exe);
    cmd.arg("serve")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    for key in [
        "SECKILL_REDIS_URL",
        "SECKILL_CONFIG",
        "SECKILL_GATE",
        "SECKILL_NO_WRITER",
    ] {
        cmd.env_remove(key);
    }
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    cmd.spawn()
        .map_err(|e| setup(format!("cannot start the server: {e}")))
}

/// Waits up to 30 s until the server answers `/readyz` 200; cleans up when it exits or
/// does not.
async fn until_ready(mut target: Target) -> Result<Target, BenchError> {
    for _ in 0..300 {
        if let Ok(mut c) = Connection::open(target.addr).await {
            if let Ok((200, _)) = c.send(Method::GET, "/readyz", None, Bytes::new()).await {
                return Ok(target);
            }
        }
        if let Some(Ok(Some(status))) = target.child.as_mut().map(|c| c.try_wait()) {
            // Its log is kept for the reader; the scratch database and keys are not.
            let log = target.workdir.take();
            target.clean_up().await;
            return Err(setup(format!(
                "the server exited ({status}); see its log in {log:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    target.clean_up().await;
    Err(setup("the server did not become ready"))
}

/// The server settings given to bench (flags, environment, file) that the server it
/// starts must run with; bench picks the server's address, database folder, gate and admin
/// token itself.
fn server_settings(config: &Config) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = [
        ("SECKILL_WRITER_BATCH", config.writer_batch.to_string()),
        (
            "SECKILL_WRITER_CONCURRENCY",
            config.writer_concurrency.to_string(),
        ),
        (
            "SECKILL_RATE_USER_PER_SEC",
            config.rate_user.per_sec.to_string(),
        ),
        (
            "SECKILL_RATE_USER_BURST",
            config.rate_user.burst.to_string(),
        ),
        (
            "SECKILL_RATE_ADDRESS_PER_SEC",
            config.rate_address.per_sec.to_string(),
        ),
        (
            "SECKILL_RATE_ADDRESS_BURST",
            config.rate_address.burst.to_string(),
        ),
        (
            "SECKILL_PRELOAD_AHEAD_SECS",
            config.preload_ahead_secs.to_string(),
        ),
        ("SECKILL_TOKEN_TTL_SECS", config.token_ttl_secs.to_string()),
        (
            "SECKILL_MAX_CONNECTIONS",
            config.max_connections.to_string(),
        ),
        (
            "SECKILL_HEADER_READ_TIMEOUT_SECS",
            config.header_read_timeout.as_secs().to_string(),
        ),
        (
            "SECKILL_IDLE_TIMEOUT_SECS",
            config.idle_timeout.as_secs().to_string(),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    for (key, value) in [
        ("SECKILL_TOKEN_SECRET", &config.token_secret),
        ("SECKILL_PAYMENT_SECRET", &config.payment_secret),
    ] {
        if let Some(v) = value {
            env.push((key.to_string(), v.clone()));
        }
    }
    env
}

async fn admin_call(
    target: &Target,
    method: Method,
    path: &str,
    body: serde_json::Value,
) -> Result<serde_json::Value, BenchError> {
    let mut c = Connection::open(target.addr).await?;
    let body = if body.is_null() {
        Bytes::new()
    } else {
        Bytes::from(body.to_string())
    };
    let (status, answer) = c.send(method, path, Some(&target.admin), body).await?;
    let json: serde_json::Value = serde_json::from_slice(&answer).unwrap_or_default();
    if status >= 300 {
        return Err(setup(format!("{path} answered {status}: {json}")));
    }
    Ok(json)
}

/// Tokens for `n` buyers: from `--tokens`, minted into the started server's database, or
/// logged in through the API (a target in dev mode).
async fn buyer_tokens(target: &Target, args: &BenchArgs) -> Result<Vec<String>, BenchError> {
    let n = args.buyers;
    if let Some(path) = &args.tokens {
        let text =
            std::fs::read_to_string(path).map_err(|e| setup(format!("{}: {e}", path.display())))?;
        let tokens: Vec<String> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .take(n)
            .map(String::from)
            .collect();
        if tokens.len() < n {
            return Err(setup(format!(
                "{} holds {} tokens; {n} buyers need as many",
                path.display(),
                tokens.len()
            )));
        }
        return Ok(tokens);
    }
    if let Some(dir) = &target.workdir {
        let out = dir.join("tokens.txt");
        let exe = std::env::current_exe().map_err(|e| setup(e.to_string()))?;
        let mut cmd = Command::new(exe);
        cmd.args(["users", "mint", "--count", &n.to_string(), "--out"])
            .arg(&out);
        cmd.envs(target.env.iter().map(|(k, v)| (k, v)));
        let status = cmd
            .stdout(Stdio::null())
            .status()
            .map_err(|e| setup(e.to_string()))?;
        if !status.success() {
            return Err(setup("minting users failed"));
        }
        let text = std::fs::read_to_string(&out).map_err(|e| setup(e.to_string()))?;
        return Ok(text.lines().map(String::from).collect());
    }
    login_through_api(target.addr, n).await
}

/// A POST of the login flow, tried again while the target answers 503 or 429 (a busy
/// server under a test suite's load); any other failure names the target's answer.
async fn call_retrying(c: &mut Connection, path: &str, body: Bytes) -> Result<Bytes, BenchError> {
    let mut tries = 0;
    loop {
        let (status, answer) = c.send(Method::POST, path, None, body.clone()).await?;
        match status {
            200..=299 => return Ok(answer),
            429 | 503 if tries < 20 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(100 * tries)).await;
            }
            _ => {
                return Err(setup(format!(
                    "{path} answered {status}: {}",
                    String::from_utf8_lossy(&answer)
                )))
            }
        }
    }
}

/// Each buyer's shop token presented once before the storm, as a shop's page does when
/// its buyer signs in: exchanged for seckill's own token (the tokens the storm then uses),
/// or verified (`GET /api/auth/me`), so that the storm measures purchases, not first sight.
async fn sign_in(
    addr: SocketAddr,
    tokens: Arc<Vec<String>>,
    how: SignIn,
) -> Result<Arc<Vec<String>>, BenchError> {
    #[derive(Deserialize)]
    struct Exchanged {
        token: String,
    }
    let (method, path) = match how {
        SignIn::Exchange => (Method::POST, "/api/auth/exchange"),
        _ => (Method::GET, "/api/auth/me"),
    };
    let next = Arc::new(AtomicUsize::new(0));
    let out = Arc::new(std::sync::Mutex::new(vec![String::new(); tokens.len()]));
    let workers: Vec<_> = (0..64)
        .map(|_| {
            let (next, tokens, out, method) =
                (next.clone(), tokens.clone(), out.clone(), method.clone());
            tokio::spawn(async move {
                let mut c = Connection::open(addr).await?;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(token) = tokens.get(i) else { break };
                    let (status, answer) = c
                        .send(method.clone(), path, Some(token), Bytes::new())
                        .await?;
                    if status != 200 {
                        return Err(setup(format!(
                            "a shop token was refused at sign-in ({status}): {}",
                            String::from_utf8_lossy(&answer)
                        )));
                    }
                    let token = match how {
                        SignIn::Exchange => {
                            serde_json::from_slice::<Exchanged>(&answer)
                                .map_err(|e| setup(e.to_string()))?
                                .token
                        }
                        _ => token.clone(),
                    };
                    out.lock().unwrap_or_else(|p| p.into_inner())[i] = token;
                }
                Ok::<(), BenchError>(())
            })
        })
        .collect();
    for w in workers {
        w.await.map_err(|e| setup(e.to_string()))??;
    }
    let out = std::mem::take(&mut *out.lock().unwrap_or_else(|p| p.into_inner()));
    Ok(Arc::new(out))
}

async fn login_through_api(addr: SocketAddr, n: usize) -> Result<Vec<String>, BenchError> {
    #[derive(Deserialize)]
    struct Code {
        dev_code: Option<String>,
    }
    #[derive(Deserialize)]
    struct Token {
        token: String,
    }
    // Valid Chinese mobile numbers (+8613x and eight digits), as the server refuses numbers
    // that are not valid: a billion of them, from a random start.
    let base = rand::random::<u64>() % 1_000_000_000;
    let next = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(std::sync::Mutex::new(vec![String::new(); n]));
    let workers: Vec<_> = (0..64)
        .map(|_| {
            let (next, tokens) = (next.clone(), tokens.clone());
            tokio::spawn(async move {
                let mut c = Connection::open(addr).await?;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        return Ok::<(), BenchError>(());
                    }
                    let phone = format!("+86{}", 13_000_000_000 + (base + i as u64) % 1_000_000_000);
                    let body = Bytes::from(serde_json::json!({ "phone": phone }).to_string());
                    let answer = call_retrying(&mut c, "/api/auth/code", body).await?;
                    let code: Code = serde_json::from_slice(&answer).map_err(|e| setup(e.to_string()))?;
                    let code = code.dev_code.ok_or_else(|| {
                        setup("the target does not return login codes (not in dev mode): pass --tokens from `seckill users mint`")
                    })?;
                    let body = Bytes::from(serde_json::json!({ "phone": phone, "code": code }).to_string());
                    let answer = call_retrying(&mut c, "/api/auth/login", body).await?;
                    let token: Token = serde_json::from_slice(&answer).map_err(|e| setup(e.to_string()))?;
                    tokens.lock().unwrap_or_else(|p| p.into_inner())[i] = token.token;
                }
            })
        })
        .collect();
    for w in workers {
        w.await.map_err(|e| setup(e.to_string()))??;
    }
    let tokens = std::mem::take(&mut *tokens.lock().unwrap_or_else(|p| p.into_inner()));
    Ok(tokens)
}

#[derive(Deserialize)]
struct Audit {
    live_orders: i64,
    live_units: i64,
    max_units_per_buyer: i64,
    oversold: i64,
}

#[derive(Deserialize)]
struct OrderIdsPage {
    order_ids: Vec<String>,
    next: Option<String>,
}

/// Every live order id of the sale, read a page at a time.
async fn all_order_ids(
    target: &Target,
    sale_id: &str,
) -> Result<std::collections::HashSet<String>, BenchError> {
    let mut ids = std::collections::HashSet::new();
    let mut after = "0".to_string();
    loop {
        let path = format!("/api/admin/sales/{sale_id}/order-ids?after={after}&limit=100000");
        let page: OrderIdsPage = serde_json::from_value(
            admin_call(target, Method::GET, &path, serde_json::Value::Null).await?,
        )
        .map_err(|e| setup(format!("order ids: {e}")))?;
        ids.extend(page.order_ids);
        match page.next {
            Some(next) => after = next,
            None => return Ok(ids),
        }
    }
}

fn rfc3339(ms: i64) -> String {
    crate::edge::http::input::rfc3339(ms)
}

async fn storm_once(target: &Target, args: &BenchArgs, gate: &str) -> Result<Report, BenchError> {
    let quiet = args.json || !std::io::stderr().is_terminal();
    if !quiet {
        eprintln!("preparing {} buyers ...", args.buyers);
    }
    let mut tokens = Arc::new(buyer_tokens(target, args).await?);
    if args.sign_in != SignIn::None && tokens.first().is_some_and(|t| t.starts_with("eyJ")) {
        let started = Instant::now();
        tokens = sign_in(target.addr, tokens, args.sign_in).await?;
        if !quiet {
            eprintln!(
                "signed in {} shop tokens ({:?}, {:.1} s)",
                tokens.len(),
                args.sign_in,
                started.elapsed().as_secs_f64()
            );
        }
    }
    let (sale_id, opens_at) = open_bench_sale(target, args).await?;
    let (passes, room_figures) = match args.waiting_room {
        Some(rate) => {
            let (passes, figures) = through_the_room(
                target,
                args,
                &sale_id,
                tokens.clone(),
                opens_at,
                rate,
                quiet,
            )
            .await;
            (Some(Arc::new(passes)), Some(figures))
        }
        None => (None, None),
    };
    let (requests, expected_orders) = requests_of(args);
    let wait = (opens_at + 50 - crate::clock::wall_ms()).max(0) as u64;
    tokio::time::sleep(Duration::from_millis(wait)).await;

    let model = model_of(args);
    let progress = Arc::new(AtomicUsize::new(0));
    let ticker = (!quiet).then(|| progress_bar(progress.clone(), requests.len()));
    let shot = storm::Shot::Purchase {
        sale: Arc::from(sale_id.as_str()),
        tokens: tokens.clone(),
        anti_bot: args.anti_bot,
        passes,
    };
    let observed = storm::run(target.addr, shot, Arc::new(requests), model, progress).await;
    if let Some(t) = ticker {
        t.abort();
        eprintln!();
    }
    let checks = drain_and_check(target, args, &sale_id, &observed, expected_orders).await?;
    let h = &observed.latency;
    let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    Ok(Report {
        gate: gate.to_string(),
        model: match model {
            Model::Closed { .. } => "closed".into(),
            Model::Open { rate, .. } => format!("open at {rate:.0} req/s"),
        },
        connections: args.connections,
        buyers: args.buyers,
        requests: observed.sent,
        stock: args.stock,
        seconds: observed.elapsed.as_secs_f64(),
        throughput: observed.sent as f64 / observed.elapsed.as_secs_f64().max(1e-9),
        latency: report::Latency {
            mean_ms: h.mean() / 1000.0,
            p50_ms: ms(0.5),
            p90_ms: ms(0.9),
            p99_ms: ms(0.99),
            p999_ms: ms(0.999),
            max_ms: h.max() as f64 / 1000.0,
        },
        answers: observed.by_code.into_iter().collect::<BTreeMap<_, _>>(),
        errors: observed.errors,
        checks,
        room: room_figures,
    })
}

/// A sale that opens shortly, created and approved: the preloader has it in the gate before
/// the first buyer (and, with a room, after every buyer joined it: a few thousand joins a
/// second). Its id and when it opens (Unix ms).
async fn open_bench_sale(target: &Target, args: &BenchArgs) -> Result<(String, i64), BenchError> {
    let joining_ms = if args.waiting_room.is_some() {
        args.buyers as i64 / 2
    } else {
        0
    };
    let opens_at = crate::clock::wall_ms() + 2000 + joining_ms;
    let mut fields = serde_json::json!({
        "title": "seckill bench",
        "price_cents": 100,
        "stock": args.stock,
        "per_user_limit": args.per_user_limit,
        "begins_at": rfc3339(opens_at),
        "ends_at": rfc3339(opens_at + 3_600_000),
        "anti_bot": if args.anti_bot { "token" } else { "off" },
    });
    // No room: the field is left out (null is refused).
    if let Some(n) = args.waiting_room {
        fields["waiting_room"] = serde_json::json!({"admit_per_sec": n});
    }
    let sale = admin_call(target, Method::POST, "/api/admin/sales", fields).await?;
    let sale_id = sale["id"]
        .as_str()
        .ok_or_else(|| setup("no sale id"))?
        .to_string();
    admin_call(
        target,
        Method::POST,
        &format!("/api/admin/sales/{sale_id}/approve"),
        serde_json::Value::Null,
    )
    .await?;
    Ok((sale_id, opens_at))
}

/// Every buyer joins the sale's waiting room before it opens; the tickets are followed until
/// each is let through. The passes, in the buyers' order (empty for a buyer never let
/// through), and the room's figures.
async fn through_the_room(
    target: &Target,
    args: &BenchArgs,
    sale_id: &str,
    tokens: Arc<Vec<String>>,
    opens_at: i64,
    rate: i64,
    quiet: bool,
) -> (Vec<String>, room::RoomFigures) {
    if !quiet {
        eprintln!("{} buyers join the waiting room ...", args.buyers);
    }
    let joined = room::join_all(target.addr, sale_id, tokens.clone(), args.connections).await;
    let wait = (opens_at - crate::clock::wall_ms()).max(0) as u64;
    tokio::time::sleep(Duration::from_millis(wait)).await;
    if !quiet {
        eprintln!("the sale opened: following the tickets ...");
    }
    let give_up = Duration::from_secs(args.buyers as u64 / rate.max(1) as u64 + 60);
    let (passes, figures) = room::follow(
        target.addr,
        sale_id,
        tokens,
        &joined,
        rate,
        args.connections,
        give_up,
    )
    .await;
    let passes = passes.into_iter().map(Option::unwrap_or_default).collect();
    (passes, figures)
}

/// The storm's requests, by buyer: every buyer once and a share of them twice, shuffled;
/// and the orders the database must end with.
fn requests_of(args: &BenchArgs) -> (Vec<usize>, i64) {
    let repeats = (args.buyers as f64 * args.repeat).round() as usize;
    let mut requests: Vec<usize> = (0..args.buyers).chain(0..repeats).collect();
    requests.shuffle(&mut rand::rng());
    let mut per_buyer: HashMap<usize, i64> = HashMap::new();
    for b in &requests {
        *per_buyer.entry(*b).or_default() += 1;
    }
    let possible: i64 = per_buyer
        .values()
        .map(|n| (*n).min(args.per_user_limit))
        .sum();
    (requests, possible.min(args.stock))
}

/// A progress bar on the terminal, redrawn every 200 ms until aborted.
fn progress_bar(progress: Arc<AtomicUsize>, total: usize) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let started = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let done = progress.load(Ordering::Relaxed);
            let filled = done * 30 / total.max(1);
            let rate = done as f64 / started.elapsed().as_secs_f64().max(0.001);
            eprint!(
                "\r[{}{}] {done}/{total} requests, {rate:.0} req/s   ",
                "#".repeat(filled),
                " ".repeat(30 - filled)
            );
        }
    })
}

/// Waits for the order log to drain (the cheap counts polled until SQL holds every `ok` and
/// the log is empty), then reads the full audit once and checks the database.
async fn drain_and_check(
    target: &Target,
    args: &BenchArgs,
    sale_id: &str,
    observed: &storm::Observed,
    expected_orders: i64,
) -> Result<report::Checks, BenchError> {
    let ok_ids: Vec<&String> = observed.ok_orders.iter().map(|(_, id)| id).collect();
    let drain_started = Instant::now();
    let stats_path = format!("/api/admin/sales/{sale_id}/stats");
    loop {
        let stats = admin_call(target, Method::GET, &stats_path, serde_json::Value::Null).await?;
        let written = stats["orders_written"].as_u64().unwrap_or(0) as usize;
        let backlog = stats["log_backlog"].as_i64().unwrap_or(0);
        if (written >= ok_ids.len() && backlog == 0)
            || drain_started.elapsed() > Duration::from_secs(args.drain_timeout_secs)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let drain_seconds = drain_started.elapsed().as_secs_f64();
    let audit_path = format!("/api/admin/sales/{sale_id}/audit");
    let audit: Audit = serde_json::from_value(
        admin_call(target, Method::GET, &audit_path, serde_json::Value::Null).await?,
    )
    .map_err(|e| setup(format!("audit: {e}")))?;
    let in_sql = all_order_ids(target, sale_id).await?;
    let found = ok_ids
        .iter()
        .filter(|id| in_sql.contains(id.as_str()))
        .count();
    Ok(report::Checks {
        orders: audit.live_orders,
        expected_orders,
        max_units_per_buyer: audit.max_units_per_buyer,
        per_user_limit: args.per_user_limit,
        ok_answers: ok_ids.len(),
        ok_orders_in_sql: found,
        oversold: audit.oversold,
        drain_seconds,
        passed: audit.live_units == expected_orders
            && audit.max_units_per_buyer <= args.per_user_limit
            && found == ok_ids.len()
            && audit.oversold == 0,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_gate_is_read_from_seckill_info() {
        let metrics = "# TYPE seckill_info gauge\nseckill_info{version=\"0.1.0\",gate=\"redis\",durability=\"none\"} 1\n";
        assert_eq!(super::gate_of_metrics(metrics).as_deref(), Some("redis"));
        assert_eq!(super::gate_of_metrics("nginx_up 1\n"), None);
    }
}
