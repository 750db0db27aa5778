//! The `seckill` command line: `serve`, `worker`, `migrate`, `users mint`. Parses flags,
//! resolves the configuration, and hands over to `app`; holds no business logic.

mod open_files;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::app::{self, AppError, Role};
use crate::config::{Config, ConfigArgs};

#[derive(Parser)]
#[command(
    name = "seckill",
    version,
    about = "A flash-sale service: fair, atomic, durable purchases"
)]
struct Cli {
    #[command(flatten)]
    config: ConfigArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP server (and, unless --no-writer, the order writer and scheduler).
    Serve,
    /// Run the order writer and scheduler without HTTP (distributed deployments).
    Worker,
    /// Apply the database schema and exit.
    Migrate,
    /// Storm a sale and report throughput, latency and the database's checks.
    Bench(crate::bench::BenchArgs),
    /// Compare sales' gates with SQL and what is in flight; with --repair, rebuild a
    /// drifted gate from SQL (journaled). Exit code 1 when drift remains.
    Reconcile {
        /// One sale; without it, every approved sale not ended more than an hour ago.
        #[arg(long)]
        sale: Option<i64>,
        /// Rebuild each drifted sale's gate from SQL and the order log.
        #[arg(long)]
        repair: bool,
        /// Why, for the journal row a repair leaves.
        #[arg(long, default_value = "repair asked with `seckill reconcile --repair`")]
        reason: String,
    },
    /// Manage users.
    Users {
        #[command(subcommand)]
        command: UsersCommand,
    },
}

#[derive(Subcommand)]
enum UsersCommand {
    /// Create N users and write one bearer token per line, for load tests.
    Mint {
        #[arg(long, default_value_t = 1000)]
        count: usize,
        #[arg(long, default_value = "tokens.txt")]
        out: PathBuf,
    },
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match Config::load(&cli.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("seckill: {e}");
            return ExitCode::from(2);
        }
    };
    // The same mistake as `serve --no-writer` without Redis, refused the same way (a
    // configuration error, exit code 2) before anything starts.
    if matches!(cli.command, Command::Worker) && config.embedded() {
        eprintln!(
            "seckill: `seckill worker` serves a distributed deployment: give --redis and a \
             PostgreSQL/MySQL --database"
        );
        return ExitCode::from(2);
    }
    init_tracing(&config.log);
    // The server's processes get the configured threads; the load generator its own share.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = match &cli.command {
        Command::Serve | Command::Worker => config.threads,
        Command::Bench(args) => args.client_threads.unwrap_or(cores / 2).clamp(1, 1024),
        _ => cores,
    };
    // One thread is one event loop, as an nginx worker is: no work stealing, no waking of
    // other workers (0.3 µs of CPU less per request than a one-worker thread pool).
    let mut builder = if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads);
        b
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("seckill: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(run(cli.command, config))
}

async fn run(command: Command, config: Config) -> ExitCode {
    // A server's or worker's log is often a file nobody watches stderr beside: the reason it
    // stopped belongs in the log too.
    let long_running = matches!(command, Command::Serve | Command::Worker);
    let result = match command {
        Command::Serve => serve(config).await,
        Command::Worker => worker(config).await,
        Command::Migrate => migrate(config).await,
        Command::Bench(args) => {
            // Its connections, and those of the server it starts in-process.
            open_files::raise_to_hard_limit();
            crate::bench::run(config, args)
                .await
                .map_err(|e| AppError::Other(e.to_string()))
        }
        Command::Users {
            command: UsersCommand::Mint { count, out },
        } => mint(config, count, out).await,
        Command::Reconcile {
            sale,
            repair,
            reason,
        } => {
            return match reconcile(config, sale, repair, &reason).await {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::FAILURE,
                Err(e) => {
                    eprintln!("seckill: {e}");
                    ExitCode::from(2)
                }
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if long_running {
                tracing::error!(error = %e, "seckill stops");
            }
            eprintln!("seckill: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Whether a filter has a directive for `target` or a module of it (`redis=debug`,
/// `redis::cluster_async=trace`), not merely a target whose name holds the word
/// (`seckill::redis_client=debug`).
fn names_target(filter: &str, target: &str) -> bool {
    filter.split(',').any(|directive| {
        let name = directive.split(['=', '[']).next().unwrap_or("").trim();
        name == target || name.starts_with(&format!("{target}::"))
    })
}

fn init_tracing(filter: &str) {
    // PostgreSQL's notices ("relation ... already exists, skipping" on every start) are
    // not news; a filter that names sqlx (or redis, below) decides for itself.
    let mut filter = filter.to_string();
    if !filter.contains("sqlx") {
        filter.push_str(",sqlx::postgres::notice=warn");
    }
    // The Redis client's own log (through the `log` crate) tells how its cluster connection
    // recovers from a failover: its warnings always, its steps on request (`redis=debug`).
    if !names_target(&filter, "redis") {
        filter.push_str(",redis=warn");
    }
    // Config::validate has refused a filter that does not parse.
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only for a person at a terminal (https://no-color.org): never into pipes,
    // files or journald.
    use std::io::IsTerminal;
    let colour = std::io::stdout().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(colour)
        .try_init();
}

async fn serve(config: Config) -> Result<(), AppError> {
    tracing::info!("configuration:\n{}", config.describe());
    // Client connections, the database pool, and a few for Redis, the log and the listener.
    let may_open = config.max_connections as u64 + config.db_max_connections as u64 + 64;
    open_files::raise_and_report(may_open);
    if config.dev {
        tracing::warn!(
            "DEV MODE IS ON: /api/auth/code returns the login code to whoever asks, so anyone \
             can log in as any phone number. Never expose this server to real users (turn it \
             off with --dev false or SECKILL_DEV=0)."
        );
    } else if config.sms_hook.is_none() {
        tracing::warn!(
            "nobody can log in by phone: no --sms-hook delivers login codes, so \
             /api/auth/code answers 503. Set --sms-hook (SECKILL_SMS_HOOK) to a command that \
             sends SECKILL_CODE to SECKILL_PHONE, or create users with `seckill users mint` \
             (--dev returns codes in the answer, for trials only)."
        );
    }
    warn_about_security(&config);
    let listen = config.listen;
    let run_writer = config.run_writer;
    let dev = config.dev;
    // Bound first: while the database or Redis do not answer yet, the process is alive and
    // says what it waits for (`/healthz` 200, `/readyz` 503).
    let listener =
        bind(listen).map_err(|e| AppError::Other(format!("cannot listen on {listen}: {e}")))?;
    tracing::info!(%listen, "listening; starting");
    let started = async {
        let app = app::assemble(config, Role::Server).await?;
        let background = app.start_background(run_writer).await?;
        Ok::<_, AppError>((app, background))
    };
    let (app, (stop, tasks)) = crate::edge::http::starting::serve_while(&listener, started).await?;
    tracing::info!(%listen, dev, "seckill is serving");
    use axum::serve::ListenerExt;
    let listener = app.state.connections.limit(listener).tap_io(|conn| {
        let _ = conn.get_mut().set_nodelay(true);
    });
    crate::edge::http::front::serve(listener, app.state.clone(), app::shutdown_signal()).await;
    tracing::info!("HTTP drained; stopping background tasks");
    let _ = stop.send(true);
    for t in tasks {
        let _ = t.await;
    }
    Ok(())
}

/// Start-up warnings about settings that leave a door open outside dev mode.
fn warn_about_security(config: &Config) {
    use crate::config::PaymentProviderKind;
    match config.payment_provider {
        Some(PaymentProviderKind::Simulated) if !config.dev => tracing::warn!(
            "THE SIMULATED PAYMENT PROVIDER IS ON: its pay page lets every buyer mark their \
             own order paid without paying. For trials only: configure a real provider \
             (--payment-redirect-url and --payment-secret) before selling to real users."
        ),
        None => tracing::warn!(
            "no payment provider is configured: buyers' /pay answers 503 \
             payment_unavailable. Set --payment-redirect-url and --payment-secret (see the \
             docs/guides/selling.md)."
        ),
        _ => {}
    }
    if config.dev {
        return;
    }
    if let Some(token) = &config.admin_token {
        if token.chars().count() < 32 {
            tracing::warn!(
                length = token.chars().count(),
                "the admin token is shorter than 32 characters: anyone who reaches the admin \
                 API may guess it. Use a random one, e.g. `openssl rand -hex 32`."
            );
        }
    }
    if !config.metrics_public && config.metrics_token.is_none() && config.admin_token.is_none() {
        tracing::warn!(
            "/metrics is closed to everyone: set --metrics-token for the scraper (or \
             --metrics-public behind a firewall)"
        );
    }
}

/// Connections arrive all at once in a flash sale: a short accept queue overflows and the
/// kernel drops SYNs, which clients only retry after a second. Ask for a long queue (the
/// kernel caps it at net.core.somaxconn).
const LISTEN_BACKLOG: u32 = 8192;

fn bind(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

async fn worker(mut config: Config) -> Result<(), AppError> {
    // The audit's findings are read through the instances' /metrics and admin API: the
    // instances run it, workers have no HTTP to show it.
    config.audit_every_secs = 0;
    tracing::info!("configuration:\n{}", config.describe());
    let app = app::assemble(config, Role::Worker).await?;
    let (stop, tasks) = app.start_background(true).await?;
    tracing::info!("seckill worker running");
    app::shutdown_signal().await;
    let _ = stop.send(true);
    for t in tasks {
        let _ = t.await;
    }
    Ok(())
}

async fn migrate(config: Config) -> Result<(), AppError> {
    let store = crate::store::Store::connect(&config.database_url, 2)
        .await?
        .with_phone_region(config.phone_region());
    let applied = store.migrate().await?;
    if applied.is_empty() {
        println!("schema is up to date");
    } else {
        println!("applied migrations {applied:?}");
    }
    Ok(())
}

/// Prints each sale's account; repairs drifted ones when asked. True when every sale
/// checked ends exact.
async fn reconcile(
    config: Config,
    only: Option<i64>,
    repair: bool,
    reason: &str,
) -> Result<bool, AppError> {
    if config.embedded() {
        return Err(AppError::Other(
            "the embedded gate lives in the server's memory: ask the server instead \
             (GET /api/admin/sales/{id}/reconcile, POST the same to repair)"
                .into(),
        ));
    }
    let app = app::assemble(config, Role::Tool).await?;
    let st = &app.state;
    st.sales
        .refresh(&st.store)
        .await
        .map_err(|e| AppError::Other(e.to_string()))?;
    let since = crate::clock::wall_ms() - 3_600_000;
    let sales: Vec<crate::model::Sale> = match only {
        Some(id) => vec![st
            .store
            .sale(id)
            .await?
            .ok_or_else(|| AppError::Other(format!("sale {id} does not exist")))?],
        None => st
            .store
            .all_sales(10_000)
            .await?
            .into_iter()
            .filter(|s| s.approved && s.ends_at > since)
            .collect(),
    };
    let backlog = st.backlog.clone();
    let mut all_exact = true;
    for sale in &sales {
        // Every row counted again: an operator asked, and waits for it.
        let full = crate::reconcile::Depth::Recount(crate::store::Pace::FULL);
        let account = crate::reconcile::account_to(
            &st.store,
            st.gate.as_ref(),
            backlog.as_ref(),
            sale.id,
            full,
        )
        .await
        .map_err(|e| AppError::Other(e.to_string()))?;
        print_account(&account);
        if account.exact() {
            continue;
        }
        if !repair {
            all_exact = false;
            continue;
        }
        let done = crate::reconcile::repair(
            &st.store,
            st.gate.as_ref(),
            backlog.as_ref(),
            &st.sales,
            sale,
            "seckill reconcile",
            reason,
        )
        .await
        .map_err(|e| AppError::Other(e.to_string()))?;
        println!("  repaired: the gate was rebuilt from SQL and the order log; now:");
        print_account(&done.after);
        all_exact &= done.after.exact();
    }
    if sales.is_empty() {
        println!("no sale to reconcile");
    }
    Ok(all_exact)
}

fn print_account(a: &crate::reconcile::Account) {
    let verdict = match (a.exact(), a.gate_loaded) {
        (true, true) => "exact".to_string(),
        (true, false) => "exact (no gate state apart from SQL: the journal alone compared)".into(),
        (false, _) => format!(
            "DRIFT: stock {:+}, buyers missing {}, buyers unknown {}, journal {:+}",
            a.stock_drift, a.buyers_missing, a.buyers_unknown, a.journal_drift
        ),
    };
    println!(
        "sale {}: {verdict}\n  gate stock {} (expected {} = SQL {} - unwritten {} - returns owed {} - in transit {}), \
         gate buyers {} (SQL live {}), journal sum {}, dead letters {}",
        a.sale_id,
        a.gate_stock.map_or("-".into(), |s| s.to_string()),
        a.expected_gate_stock,
        a.sql_stock,
        a.unwritten_units,
        a.returns_owed_units,
        a.units_in_transit,
        a.gate_buyers.map_or("-".into(), |b| b.to_string()),
        a.sql_live_buyers,
        a.journal_sum,
        a.dead_letters,
    );
}

async fn mint(config: Config, count: usize, out: PathBuf) -> Result<(), AppError> {
    if count == 0 || count > 10_000_000 {
        return Err(AppError::Other(
            "--count must be between 1 and 10000000".into(),
        ));
    }
    let ttl = config.token_ttl_secs as i64;
    let app = app::assemble(config, Role::Tool).await?;
    let st = &app.state;
    let batch = rand::random::<u32>();
    let mut users = Vec::with_capacity(count);
    for i in 0..count {
        users.push((st.ids.next()?, format!("mint-{batch:08x}-{i}")));
    }
    st.store.insert_users(&users).await?;
    let expires = crate::clock::wall_ms() / 1000 + ttl;
    let mut text = String::with_capacity(count * 64);
    for (id, _) in &users {
        text.push_str(&st.tokens.sign(*id, expires));
        text.push('\n');
    }
    std::fs::write(&out, text)
        .map_err(|e| AppError::Other(format!("cannot write {}: {e}", out.display())))?;
    println!("minted {count} users; tokens in {}", out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::names_target;

    #[test]
    fn a_filter_names_a_target_only_by_a_directive_of_its_own() {
        assert!(names_target("info,redis=debug", "redis"));
        assert!(names_target("redis::cluster_async=trace", "redis"));
        assert!(names_target("warn, redis", "redis"));
        assert!(!names_target("info,seckill::redis_client=debug", "redis"));
        assert!(!names_target("info,redisearch=debug", "redis"));
        assert!(!names_target("debug", "redis"));
    }
}
