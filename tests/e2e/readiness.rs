//! Readiness means "can sell, and its sales' orders get written": a distributed instance
//! (`serve --no-writer`) whose deployment runs no writer stops being ready once an accepted
//! order has waited `--writer-lag-not-ready-secs`, `/metrics` shows the backlog and its age
//! per sale, and a worker started later makes it ready again. Meanwhile the buyer's order
//! list shows the unwritten order as `queued`.

use crate::common;

use std::time::Duration;

use crate::common::{Server, Sql};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_without_writers_is_not_ready_once_orders_wait() {
    let db = common::fresh_database(Sql::Postgres).await;
    let secret = common::unique("secret");
    let env = vec![
        ("SECKILL_DATABASE_URL".to_string(), db),
        ("SECKILL_REDIS_URL".to_string(), common::redis_url()),
        ("SECKILL_REDIS_PREFIX".to_string(), common::unique("ready")),
        ("SECKILL_TOKEN_SECRET".to_string(), secret.clone()),
        (
            "SECKILL_WRITER_LAG_NOT_READY_SECS".to_string(),
            "2".to_string(),
        ),
    ];
    let server = Server::start(env.clone(), vec!["serve".into(), "--no-writer".into()]).await;
    let api = server.api();
    let sale = api.open_sale(10, 1).await;
    assert_eq!(
        api.readyz().await.status,
        200,
        "ready before any order waits"
    );

    let token = seckill::edge::auth::TokenSigner::new(&secret)
        .sign(42, seckill::clock::wall_ms() / 1000 + 600);
    let r = api.buy(&token, &sale).await.json();
    assert_eq!(r["code"], "ok", "{r}");
    let order_id = r["order_id"].as_str().unwrap().to_string();
    // Not written yet, and listed all the same (as `GET /api/orders/{id}` finds it).
    let listed = api.orders(&token).await.json();
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed[0]["id"], order_id.as_str(), "{listed}");
    assert_eq!(listed[0]["status"], "queued", "{listed}");

    tokio::time::sleep(Duration::from_millis(2500)).await;
    let ready = api.readyz().await;
    assert_eq!(ready.status, 503, "{ready}");
    assert!(ready.text.contains("seckill worker"), "{ready}");
    let text = api.metrics().await;
    assert_eq!(
        common::metric(
            &text,
            &format!("seckill_order_log_unwritten{{sale=\"{sale}\"}}")
        ),
        1,
        "{text}"
    );
    let age: f64 = text
        .lines()
        .find_map(|l| {
            l.strip_prefix(&format!(
                "seckill_order_log_oldest_unwritten_seconds{{sale=\"{sale}\"}}"
            ))
        })
        .and_then(|v| v.trim().parse().ok())
        .expect("the oldest unwritten order's age is exported");
    assert!(age >= 2.0, "{age}");

    // A worker writes the order: ready again, nothing left waiting.
    let _worker = common::worker(&env);
    common::eventually(60, "ready again once a worker writes the order", || async {
        api.readyz().await.status == 200
    })
    .await;
    let text = api.metrics().await;
    assert!(
        text.contains(&format!("seckill_order_log_unwritten{{sale=\"{sale}\"}} 0")),
        "{text}"
    );
    let listed = api.orders(&token).await.json();
    assert_eq!(
        listed.as_array().map(Vec::len),
        Some(1),
        "once, now written: {listed}"
    );
    assert_eq!(listed[0]["status"], "pending_payment", "{listed}");
}
