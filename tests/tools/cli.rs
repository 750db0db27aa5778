//! The command line as an operator uses it: `migrate`, `users mint`, and a server that
//! accepts the minted tokens; a bad configuration is refused with a clear message.

use crate::common;

use crate::common::{Server, Sql};

fn seckill(env: &[(&str, &str)], args: &[&str]) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_seckill"));
    cmd.args(args);
    for key in [
        "SECKILL_REDIS_URL",
        "SECKILL_DATABASE_URL",
        "SECKILL_CONFIG",
    ] {
        cmd.env_remove(key);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minted_tokens_buy_on_the_server() {
    let db = common::fresh_database(Sql::Sqlite).await;
    let out = seckill(&[("SECKILL_DATABASE_URL", &db)], &["migrate"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let file = std::env::temp_dir().join(common::unique("tokens"));
    let out = seckill(
        &[("SECKILL_DATABASE_URL", &db)],
        &[
            "users",
            "mint",
            "--count",
            "300",
            "--out",
            file.to_str().unwrap(),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tokens: Vec<String> = std::fs::read_to_string(&file)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    assert_eq!(tokens.len(), 300);

    let server = Server::start(
        vec![("SECKILL_DATABASE_URL".into(), db)],
        vec!["serve".into()],
    )
    .await;
    let api = server.api();
    let sale = api.open_sale(5, 1).await;
    let mut ok = 0;
    for t in &tokens[..20] {
        let answer = api.buy(t, &sale).await;
        match answer.status {
            200 => ok += 1,
            409 => assert_eq!(answer["code"], "sold_out"),
            _ => panic!("{answer}"),
        }
    }
    assert_eq!(ok, 5);
}

#[test]
fn bad_configuration_is_refused_clearly() {
    let out = seckill(&[("SECKILL_DATABASE_URL", "oracle://x")], &["migrate"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("database_url"));
    let out = seckill(
        &[("SECKILL_DATABASE_URL", "sqlite://x.db")],
        &["--redis", "redis://127.0.0.1/", "worker"],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("PostgreSQL or MySQL"));
    // A worker, or a server without its writer, with nothing distributed to serve: the
    // same configuration mistake, the same exit code.
    let out = seckill(&[], &["worker"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("distributed"));
    let out = seckill(&[], &["serve", "--no-writer"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--no-writer needs --redis"));
    // A database that cannot be opened is named, with what to check.
    let port = common::free_port();
    let url = format!("postgres://postgres:hush@127.0.0.1:{port}/nowhere");
    let out = seckill(&[("SECKILL_DATABASE_URL", &url)], &["migrate"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("127.0.0.1:{port}/nowhere")) && !err.contains("hush"),
        "{err}"
    );
    assert!(err.contains("listening at that host and port"), "{err}");
    // With its cause, not the pool's "timed out" after its 5 s wait.
    assert!(
        err.contains("refused") && !err.contains("timed out"),
        "{err}"
    );
    let missing = std::env::temp_dir().join(common::unique("no-such-folder"));
    let url = format!("sqlite://{}/s.db", missing.display());
    let out = seckill(&[("SECKILL_DATABASE_URL", &url)], &["migrate"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("does the folder {} exist", missing.display())),
        "{err}"
    );
    // A log filter that does not parse is refused, not silently replaced.
    let out = seckill(
        &[("SECKILL_DATABASE_URL", "sqlite://x.db")],
        &["--log", "info,seckill=loud", "migrate"],
    );
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("log") && err.contains("seckill=loud"), "{err}");
}

#[test]
fn a_server_that_could_not_keep_its_orders_is_refused() {
    // Memory decides purchases, and an in-memory database cannot outlive the process.
    let out = seckill(
        &[
            ("SECKILL_DATABASE_URL", "sqlite::memory:"),
            ("SECKILL_LISTEN", "127.0.0.1:0"),
        ],
        &["serve"],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("sqlite://FILE") && stderr.contains("--order-log-dir"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_database_has_dev_mode_off_and_dev_mode_warns() {
    let db = common::fresh_database(Sql::Postgres).await;
    let dir = std::env::temp_dir().join(common::unique("orders"));
    let env = vec![
        ("SECKILL_DATABASE_URL".to_string(), db.clone()),
        (
            "SECKILL_ORDER_LOG_DIR".to_string(),
            dir.display().to_string(),
        ),
    ];
    let server = Server::start(env.clone(), vec!["serve".into()]).await;
    let sent = server.api().request_code("+8613800000001").await;
    assert!(
        sent.is_json() && sent.body.get("dev_code").is_none(),
        "PostgreSQL without Redis must not hand out login codes: {sent}"
    );
    drop(server);

    // Dev mode asked for on the same database: it works, and says so loudly.
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_seckill"));
    cmd.arg("serve")
        .env("SECKILL_DATABASE_URL", &db)
        .env("SECKILL_ORDER_LOG_DIR", &dir)
        .env("SECKILL_DEV", "1")
        .env(
            "SECKILL_LISTEN",
            format!("127.0.0.1:{}", common::free_port()),
        )
        .env_remove("SECKILL_REDIS_URL")
        .env_remove("SECKILL_CONFIG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    let text = log_until_serving(cmd);
    assert_eq!(
        text.matches("DEV MODE IS ON").count(),
        1,
        "one loud line: {text}"
    );
    // Its second start on this database: no colour codes into a pipe, no PostgreSQL
    // notices about tables that already exist.
    assert!(
        !text.contains('\u{1b}'),
        "ANSI codes written to a pipe: {text:?}"
    );
    assert!(!text.contains("already exists"), "{text}");
    assert!(
        !text.contains("nobody can log in"),
        "dev mode logs in: {text}"
    );

    // Without dev mode and without an SMS hook nobody can log in: said once, at start-up.
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_seckill"));
    cmd.arg("serve")
        .env("SECKILL_DATABASE_URL", &db)
        .env("SECKILL_ORDER_LOG_DIR", &dir)
        .env(
            "SECKILL_LISTEN",
            format!("127.0.0.1:{}", common::free_port()),
        )
        .env_remove("SECKILL_REDIS_URL")
        .env_remove("SECKILL_CONFIG")
        .env_remove("SECKILL_DEV")
        .env_remove("SECKILL_SMS_HOOK")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    let text = log_until_serving(cmd);
    assert_eq!(text.matches("nobody can log in").count(), 1, "{text}");
    assert!(text.contains("seckill users mint"), "{text}");
}

/// Outside dev mode the start-up log names each open door once: the simulated payment
/// provider chosen by name, a short admin token, no payment provider at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_doors_are_named_at_start_up_outside_dev_mode() {
    let start = |extra: &[(&str, &str)]| {
        let dir = std::env::temp_dir().join(common::unique("warn"));
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_seckill"));
        cmd.arg("serve")
            .env(
                "SECKILL_DATABASE_URL",
                format!("sqlite://{}/s.db?mode=rwc", dir.display()),
            )
            .env("SECKILL_DEV", "0")
            .env(
                "SECKILL_LISTEN",
                format!("127.0.0.1:{}", common::free_port()),
            )
            .env_remove("SECKILL_REDIS_URL")
            .env_remove("SECKILL_CONFIG")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null());
        std::fs::create_dir_all(&dir).unwrap();
        for (k, v) in extra {
            cmd.env(k, v);
        }
        log_until_serving(cmd)
    };
    let text = start(&[
        ("SECKILL_PAYMENT_PROVIDER", "simulated"),
        ("SECKILL_ADMIN_TOKEN", "short"),
    ]);
    assert_eq!(
        text.matches("THE SIMULATED PAYMENT PROVIDER IS ON").count(),
        1,
        "{text}"
    );
    assert_eq!(
        text.matches("shorter than 32 characters").count(),
        1,
        "{text}"
    );
    let text = start(&[("SECKILL_ADMIN_TOKEN", &"x".repeat(40))]);
    assert_eq!(
        text.matches("no payment provider is configured").count(),
        1,
        "{text}"
    );
    assert!(!text.contains("shorter than 32"), "{text}");
    assert!(!text.contains("SIMULATED"), "{text}");
}

/// Starts the command (stdout piped) and returns its log up to "seckill is serving".
fn log_until_serving(mut cmd: std::process::Command) -> String {
    let mut child = cmd.spawn().unwrap();
    // The log goes to standard output; read it until the server says it is serving.
    let mut out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::Read;
        let mut text = String::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = out.read(&mut buf) {
            if n == 0 {
                break;
            }
            text.push_str(&String::from_utf8_lossy(&buf[..n]));
            if text.contains("seckill is serving") {
                break;
            }
        }
        let _ = tx.send(text);
    });
    let text = rx.recv_timeout(std::time::Duration::from_secs(60));
    let _ = child.kill();
    let _ = child.wait();
    text.expect("the server started within a minute")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_server_deciding_in_memory_on_the_same_database_is_refused() {
    for kind in [Sql::Postgres, Sql::Mariadb] {
        let db = common::fresh_database(kind).await;
        let dir = |tag: &str| {
            std::env::temp_dir()
                .join(common::unique(tag))
                .display()
                .to_string()
        };
        let first = Server::start(
            vec![
                ("SECKILL_DATABASE_URL".into(), db.clone()),
                ("SECKILL_ORDER_LOG_DIR".into(), dir("orders-a")),
            ],
            vec!["serve".into()],
        )
        .await;
        // Its own log folder, the same database: each would sell the whole stock.
        let port = common::free_port().to_string();
        let listen = format!("127.0.0.1:{port}");
        let orders_b = dir("orders-b");
        let out = seckill(
            &[
                ("SECKILL_DATABASE_URL", &db),
                ("SECKILL_ORDER_LOG_DIR", &orders_b),
                ("SECKILL_LISTEN", &listen),
            ],
            &["serve"],
        );
        assert!(!out.status.success(), "{kind:?}: a second server started");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("--redis"), "{kind:?}: {stderr}");
        // Once the first is gone, a server may take over the database.
        drop(first);
        let again = Server::start(
            vec![
                ("SECKILL_DATABASE_URL".into(), db.clone()),
                ("SECKILL_ORDER_LOG_DIR".into(), orders_b),
            ],
            vec!["serve".into()],
        )
        .await;
        drop(again);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_redis_is_named_at_once_not_after_the_clients_retries() {
    let db = common::fresh_database(Sql::Postgres).await;
    let port = common::free_port();
    let redis = format!("redis://127.0.0.1:{port}/");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_seckill"))
        .args([
            "serve",
            "--no-writer",
            "--listen",
            &format!("127.0.0.1:{}", common::free_port()),
        ])
        .env("SECKILL_DATABASE_URL", &db)
        .env("SECKILL_REDIS_URL", &redis)
        .env_remove("SECKILL_CONFIG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The log goes to standard output.
    let log = child.stdout.take().unwrap();
    let (lines, got) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(log).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                return;
            }
        }
    });
    // Migrations and the configuration print take a moment; the redis crate's own
    // retries took about 10 s before anything was said.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut seen = Vec::new();
    let found = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match got.recv_timeout(left) {
            Ok(line) if line.contains("not reachable yet") => break Some(line),
            Ok(line) => seen.push(line),
            Err(_) => break None,
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    let line = found.unwrap_or_else(|| panic!("no word of Redis within 5 s: {seen:#?}"));
    assert!(line.contains(&redis) && line.contains("refused"), "{line}");
}

#[test]
fn help_puts_each_subcommands_own_options_apart_from_the_shared_settings() {
    let out = seckill(&[], &["bench", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    let own = help
        .find("Bench options:")
        .expect("a heading of bench's own");
    let shared = help
        .find("Settings of every subcommand")
        .expect("a heading of the shared settings");
    let buyers = help.find("--buyers").unwrap();
    let writer_batch = help.find("--writer-batch").unwrap();
    assert!(
        own < buyers && buyers < shared && shared < writer_batch,
        "{help}"
    );
    let out = seckill(&[], &["users", "mint", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.find("--count").unwrap() < help.find("Settings of every subcommand").unwrap(),
        "{help}"
    );
}
