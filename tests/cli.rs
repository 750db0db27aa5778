//! The command line as an operator uses it: `migrate`, `users mint`, and a server that
//! accepts the minted tokens; a bad configuration is refused with a clear message.

mod common;

use common::{Server, Sql};

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
    let c = common::client();
    let sale = common::open_sale(&c, &server, 5, 1).await;
    let mut ok = 0;
    for t in &tokens[..20] {
        let (status, body) = common::buy(&c, &server.base, &sale, t).await;
        match status {
            200 => ok += 1,
            409 => assert_eq!(body["code"], "sold_out"),
            _ => panic!("{status} {body}"),
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
    let out = seckill(&[], &["worker"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("distributed"));
}
