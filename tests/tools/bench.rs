//! `seckill bench` as a user runs it: it starts its own server, storms it, and reports
//! checks read from the database; `--compare` does so for every gate; `--target` drives a
//! running server whose buyers log in through the API.

use crate::common;

use crate::common::{Server, Sql};

fn bench(args: &[&str], env: &[(&str, &str)]) -> (bool, serde_json::Value, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_seckill"));
    for key in [
        "SECKILL_REDIS_URL",
        "SECKILL_DATABASE_URL",
        "SECKILL_CONFIG",
        "SECKILL_ADMIN_TOKEN",
    ] {
        cmd.env_remove(key);
    }
    cmd.envs(env.iter().copied());
    let out = cmd.args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let json = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}\n{stderr}"));
    (out.status.success(), json, stderr)
}

fn assert_report(r: &serde_json::Value, buyers: u64, stock: i64) {
    let checks = &r["checks"];
    assert_eq!(checks["passed"], true, "{r}");
    assert_eq!(checks["orders"], stock, "{r}");
    assert_eq!(checks["oversold"], 0, "{r}");
    assert_eq!(checks["ok_answers"], checks["ok_orders_in_sql"], "{r}");
    assert_eq!(r["answers"]["ok"], stock, "{r}");
    let answered: u64 = r["answers"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(
        answered + r["errors"].as_u64().unwrap(),
        r["requests"].as_u64().unwrap(),
        "{r}"
    );
    assert!(
        r["requests"].as_u64().unwrap() > buyers,
        "repeat buyers add requests: {r}"
    );
    assert!(r["latency"]["p99_ms"].as_f64().unwrap() >= r["latency"]["p50_ms"].as_f64().unwrap());
    assert!(r["throughput"].as_f64().unwrap() > 0.0);
}

#[test]
fn bench_starts_its_own_embedded_server_and_checks_the_database() {
    let (ok, r, stderr) = bench(
        &[
            "bench",
            "--buyers",
            "3000",
            "--stock",
            "40",
            "--connections",
            "64",
            "--json",
        ],
        &[],
    );
    assert!(ok, "{stderr}");
    assert_report(&r, 3000, 40);
    assert_eq!(r["gate"], "embedded");
    if r["seconds"].as_f64().unwrap() < 1.0 {
        assert!(stderr.contains("too short for a stable figure"), "{stderr}");
    }
}

#[test]
fn server_settings_given_to_bench_reach_the_server_it_starts() {
    // Every buyer presses twice, under a limit of two each (a buyer who holds the limit is
    // not throttled); a rate of one purchase per 100 s, burst 1, turns the second press
    // away as rate_limited, which the server's default (5/s, burst 10) never would: it
    // would let some buyers take two units of the 300 and leave others none.
    let (ok, r, stderr) = bench(
        &[
            "bench",
            "--buyers",
            "300",
            "--stock",
            "300",
            "--per-user-limit",
            "2",
            "--repeat",
            "1",
            "--rate-user-per-sec",
            "0.01",
            "--rate-user-burst",
            "1",
            "--json",
        ],
        &[],
    );
    assert!(ok, "{stderr}");
    assert_eq!(r["checks"]["passed"], true, "{r}");
    assert!(
        r["answers"]["rate_limited"].as_u64().unwrap_or(0) > 0,
        "the server ran with bench's rate limit: {r}"
    );
    assert!(r["answers"].get("already_purchased").is_none(), "{r}");
}

#[test]
fn bench_with_anti_bot_fetches_a_token_before_each_purchase() {
    let (ok, r, stderr) = bench(
        &[
            "bench",
            "--anti-bot",
            "--buyers",
            "2000",
            "--stock",
            "25",
            "--connections",
            "32",
            "--json",
        ],
        &[],
    );
    assert!(ok, "{stderr}");
    assert_report(&r, 2000, 25);
    for code in r["answers"].as_object().unwrap().keys() {
        assert!(
            ["ok", "sold_out", "already_purchased"].contains(&code.as_str()),
            "every purchase carried a valid, fresh token: {r}"
        );
    }
}

#[test]
fn bench_open_model_reports_latency_from_intended_send_times() {
    let (ok, r, stderr) = bench(
        &[
            "bench",
            "--buyers",
            "1000",
            "--stock",
            "10",
            "--rate",
            "2000",
            "--connections",
            "32",
            "--json",
        ],
        &[],
    );
    assert!(ok, "{stderr}");
    assert_report(&r, 1000, 10);
    assert!(r["model"].as_str().unwrap().starts_with("open"), "{r}");
    // 1200 requests at 2000/s cannot finish in much less than 0.6 s.
    assert!(r["seconds"].as_f64().unwrap() >= 0.55, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_compare_runs_every_gate_on_redis_and_postgres() {
    let db = common::fresh_database(Sql::Postgres).await;
    let given = db.clone();
    let redis = common::redis_url();
    let (ok, r, stderr) = tokio::task::spawn_blocking(move || {
        bench(
            &[
                "--redis",
                &redis,
                "--database",
                &db,
                "bench",
                "--compare",
                "--buyers",
                "1500",
                "--stock",
                "30",
                "--connections",
                "64",
                "--json",
            ],
            &[],
        )
    })
    .await
    .unwrap();
    assert!(ok, "{stderr}");
    let gates: Vec<&str> = r
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["gate"].as_str().unwrap())
        .collect();
    assert_eq!(gates, ["sql-lock", "sql-conditional", "redis"]);
    for g in r.as_array().unwrap() {
        assert_report(g, 1500, 30);
    }
    // Each run had a scratch database of its own: the one given holds nothing.
    sqlx::any::install_default_drivers();
    let pool = sqlx::any::AnyPoolOptions::new()
        .max_connections(1)
        .connect(&given)
        .await
        .unwrap();
    let tables: i64 = sqlx::Row::get(
        &sqlx::query(
            "SELECT CAST(COUNT(*) AS BIGINT) FROM information_schema.tables WHERE table_schema = 'public'",
        )
        .fetch_one(&pool)
        .await
        .unwrap(),
        0,
    );
    assert_eq!(tables, 0, "bench wrote into the database it was given");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_drives_a_running_target_through_the_api() {
    let server = Server::embedded(&[]).await;
    let (base, admin) = (server.base.clone(), server.admin.clone());
    let (ok, r, stderr) = tokio::task::spawn_blocking(move || {
        bench(
            &[
                "bench",
                "--target",
                &base,
                "--buyers",
                "500",
                "--stock",
                "20",
                "--connections",
                "32",
                "--json",
            ],
            &[("SECKILL_ADMIN_TOKEN", admin.as_str())],
        )
    })
    .await
    .unwrap();
    assert!(ok, "{stderr}");
    assert_report(&r, 500, 20);
    assert_eq!(
        r["gate"], "embedded",
        "the target's own gate, read from its /metrics"
    );
}
