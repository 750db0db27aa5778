//! The order database stopped for a while (not failed over), on a PostgreSQL of the test's
//! own, and a process started before its database and Redis:
//!
//! - Distributed: purchases keep being decided and answered by the gate while the backlog
//!   grows in the order log; `/readyz` answers 503 within a second naming the database,
//!   `/metrics` says it is away, an admin read and a buyer's order read answer 503 at once;
//!   once it is back the backlog drains and every `ok` is in SQL.
//! - Embedded on PostgreSQL: the same answers, never a 500, nothing lost.
//! - A process started before its database and Redis listens at once: `/healthz` 200,
//!   `/readyz` 503 naming what it waits for, and it serves as soon as both answer.
//!
//! `SECKILL_TEST_DB_OUTAGE_SECS` sets how long the database is away (20 s by default; 60
//! for the long check).

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::Method;

use crate::common::postgres::PrivatePostgres;
use crate::common::storm::{check_sql, storm_on, Arrival};
use crate::common::{Api, PrivateRedis, Server};
use seckill::store::Store;

fn outage() -> Duration {
    Duration::from_secs(common::setting("SECKILL_TEST_DB_OUTAGE_SECS", 20))
}

/// Asks `path` and times the answer.
async fn timed(api: &Api, path: &str, bearer: Option<&str>) -> (u16, String, Duration) {
    let began = Instant::now();
    let mut request = api.request(Method::GET, path);
    if let Some(token) = bearer {
        request = request.bearer_auth(token);
    }
    match Api::try_send(request).await {
        Ok(r) => (r.status, r.text, began.elapsed()),
        Err(e) => (0, e.to_string(), began.elapsed()),
    }
}

/// While the database is away: every instance's readiness, metrics, an admin read and a
/// buyer's order read answer at once, and say so.
async fn check_answers_while_away(instances: &[Server], buyer: &str, order: &str) {
    for server in instances {
        let api = server.api();
        let (status, text, took) = timed(&api, "/readyz", None).await;
        assert_eq!(status, 503, "{text}");
        assert!(
            text.contains("database"),
            "readiness names the database: {text}"
        );
        assert!(took < Duration::from_secs(1), "/readyz took {took:?}");
        let metrics = api.metrics().await;
        assert!(
            metrics.contains("seckill_database_up 0"),
            "/metrics says the database is away"
        );
        let (status, text, took) =
            timed(&api, "/api/admin/sales", Some(server.admin.as_str())).await;
        assert_eq!(status, 503, "{text}");
        assert!(took < Duration::from_secs(1), "an admin read took {took:?}");
        let (status, text, took) = timed(&api, &format!("/api/orders/{order}"), Some(buyer)).await;
        assert_eq!(status, 503, "{text}");
        assert!(text.contains("database"), "{text}");
        assert!(took < Duration::from_secs(1), "an order read took {took:?}");
    }
}

/// A storm that outlasts the outage; the database stopped 3 s into it and started again
/// after `outage()`; every `ok` is in SQL afterwards, and purchases were answered while it
/// was away.
async fn storm_through_an_outage(
    mut pg: PrivatePostgres,
    db: String,
    instances: Vec<Server>,
    secret: &str,
) {
    const STOCK: i64 = 2000;
    const BUYERS: i64 = 2500;
    let api = instances[0].api();
    let sale: i64 = api.open_sale(STOCK, 1).await.parse().unwrap();
    // One buyer bought and written before: their order is read during the outage.
    let (first, first_token) = common::storm::tokens(secret, BUYERS + 1..BUYERS + 2).remove(0);
    let order = api.buy(&first_token, sale).await.order_id().unwrap();
    api.written(&first_token, &order).await;
    let span = outage() + Duration::from_secs(10);
    let bases: Vec<String> = instances.iter().map(|s| s.base.clone()).collect();
    let began = Instant::now();
    let storm = tokio::spawn(storm_on(
        bases,
        sale.to_string(),
        common::storm::tokens(secret, 1..BUYERS + 1),
        Arrival::Every(span / BUYERS as u32),
        Arc::default(),
    ));
    tokio::time::sleep(Duration::from_secs(3)).await;
    pg.stop();
    let stopped = began.elapsed();
    // The health probe asks every half second: it knows within one.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    while began.elapsed() < stopped + outage() {
        check_answers_while_away(&instances, &first_token, &order).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    pg.start_again().await;
    let restarted = began.elapsed();
    eprintln!("the database was away from {stopped:?} to {restarted:?} into the storm");
    let mut told = storm.await.unwrap();
    let answered_while_away = told
        .values()
        .flat_map(|t| t.times.iter())
        .filter(|(at, code)| {
            let at = at.duration_since(began);
            code == "ok" && at > stopped + Duration::from_secs(1) && at < restarted
        })
        .count();
    assert!(
        answered_while_away > 0,
        "purchases were decided and answered while the database was away"
    );
    told.insert(
        first,
        common::storm::Told {
            ok: vec![order.parse().unwrap()],
            last: "ok".into(),
            ..Default::default()
        },
    );
    let store = Store::connect(&db, 4).await.unwrap();
    check_sql(&store, sale, STOCK, &told).await;
    for server in &instances {
        let api = server.api();
        common::eventually(30, "ready again", || async {
            api.readyz().await.status == 200
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_database_away_for_a_while_leaves_purchases_answered_and_loses_nothing() {
    let _turn = common::one_at_a_time().await;
    let pg = PrivatePostgres::start().await;
    let db = pg.create_database().await;
    let redis_port = common::free_port();
    let _redis = PrivateRedis::start(
        redis_port,
        &std::env::temp_dir().join(common::unique("redis")),
    );
    let secret = common::unique("secret");
    let env: Vec<(String, String)> = vec![
        ("SECKILL_DATABASE_URL".into(), db.clone()),
        (
            "SECKILL_REDIS_URL".into(),
            format!("redis://127.0.0.1:{redis_port}/"),
        ),
        ("SECKILL_TOKEN_SECRET".into(), secret.clone()),
        // Not ready for its backlog only after the outage is long over.
        ("SECKILL_WRITER_LAG_NOT_READY_SECS".into(), "300".into()),
    ];
    let mut instances = Vec::new();
    for _ in 0..2 {
        instances.push(Server::start(env.clone(), vec!["serve".into()]).await);
    }
    storm_through_an_outage(pg, db, instances, &secret).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_embedded_gate_on_postgresql_rides_out_its_database_away() {
    let _turn = common::one_at_a_time().await;
    let pg = PrivatePostgres::start().await;
    let db = pg.create_database().await;
    let secret = common::unique("secret");
    let env: Vec<(String, String)> = vec![
        ("SECKILL_DATABASE_URL".into(), db.clone()),
        ("SECKILL_TOKEN_SECRET".into(), secret.clone()),
        (
            "SECKILL_ORDER_LOG_DIR".into(),
            std::env::temp_dir()
                .join(common::unique("orders"))
                .display()
                .to_string(),
        ),
    ];
    let server = Server::start(env, vec!["serve".into()]).await;
    storm_through_an_outage(pg, db, vec![server], &secret).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_started_before_its_database_and_redis_says_what_it_waits_for() {
    let mut pg = PrivatePostgres::start().await;
    let db = pg.create_database().await;
    pg.stop();
    let redis_port = common::free_port();
    let env: Vec<(String, String)> = vec![
        ("SECKILL_DATABASE_URL".into(), db),
        (
            "SECKILL_REDIS_URL".into(),
            format!("redis://127.0.0.1:{redis_port}/"),
        ),
    ];
    let mut server = Server::spawn(env, vec!["serve".into()]);
    let api = server.api();
    let waits_for = |what: &'static str| {
        let api = api.clone();
        async move {
            let (Ok(health), Ok(ready)) = (
                Api::try_send(api.request(Method::GET, "/healthz")).await,
                Api::try_send(api.request(Method::GET, "/readyz")).await,
            ) else {
                return false;
            };
            health.status == 200
                && ready.status == 503
                && ready["code"] == "unavailable"
                && ready["message"].as_str().is_some_and(|m| m.contains(what))
        }
    };
    common::eventually(10, "it listens and says it waits for the database", || {
        waits_for("database")
    })
    .await;
    assert_eq!(api.get("/healthz", None).await.text, "starting");
    let purchase = api.post("/api/sales/1/purchase", Some("x"), None).await;
    assert_eq!(purchase.status, 503, "{purchase}");
    pg.start_again().await;
    common::eventually(20, "it says it waits for Redis", || waits_for("redis")).await;
    let _redis = PrivateRedis::start(
        redis_port,
        &std::env::temp_dir().join(common::unique("redis")),
    );
    server.wait_ready().await;
    common::eventually(20, "ready once both answer", || async {
        api.readyz().await.status == 200
    })
    .await;
}
