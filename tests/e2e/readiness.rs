//! Readiness means "can sell, and its sales' orders get written": a distributed instance
//! (`serve --no-writer`) whose deployment runs no writer stops being ready once an accepted
//! order has waited `--writer-lag-not-ready-secs`, `/metrics` shows the backlog and its age
//! per sale, and a worker started later makes it ready again. Meanwhile the buyer's order
//! list shows the unwritten order as `queued`.

mod common;

use std::time::Duration;

use common::{Server, Sql};

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
    let c = common::client();
    let sale = common::open_sale(&c, &server, 10, 1).await;
    let readyz = || async {
        let r = c
            .get(format!("{}/readyz", server.base))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    };
    assert_eq!(readyz().await.0, 200, "ready before any order waits");

    let token =
        seckill::edge::auth::TokenSigner::new(&secret).sign(42, seckill::now_ms() / 1000 + 600);
    let r: serde_json::Value = c
        .post(format!("{}/api/sales/{sale}/purchase", server.base))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["code"], "ok", "{r}");
    let order_id = r["order_id"].as_str().unwrap().to_string();
    // Not written yet, and listed all the same (as `GET /api/orders/{id}` finds it).
    let listed = common::get_json(&c, format!("{}/api/orders", server.base), Some(&token)).await;
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed[0]["id"], order_id.as_str(), "{listed}");
    assert_eq!(listed[0]["status"], "queued", "{listed}");

    tokio::time::sleep(Duration::from_millis(2500)).await;
    let (status, body) = readyz().await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("seckill worker"), "{body}");
    let text = common::metrics(&c, &server).await;
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
    let mut worker_env = env;
    worker_env.push(("SECKILL_LOG".into(), "warn".into()));
    let mut worker = common::spawn(&worker_env, &["worker".to_string()]);
    common::eventually(60, "ready again once a worker writes the order", || async {
        readyz().await.0 == 200
    })
    .await;
    let text = common::metrics(&c, &server).await;
    assert!(
        text.contains(&format!("seckill_order_log_unwritten{{sale=\"{sale}\"}} 0")),
        "{text}"
    );
    let listed = common::get_json(&c, format!("{}/api/orders", server.base), Some(&token)).await;
    assert_eq!(
        listed.as_array().map(Vec::len),
        Some(1),
        "once, now written: {listed}"
    );
    assert_eq!(listed[0]["status"], "pending_payment", "{listed}");
    let _ = worker.kill();
    let _ = worker.wait();
}
