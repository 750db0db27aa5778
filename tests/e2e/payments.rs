//! Payment callbacks and queued orders over HTTP against the real binary: a callback is
//! refused when unsigned, forged, stale, malformed or for an unknown intent, and none of
//! those changes anything; the same callback twice settles once. An order still being
//! written (`queued`) can be neither cancelled nor paid until the writer has it.

mod common;

use common::{Server, Sql};
use seckill::lifecycle::payment::{SimulatedProvider, SIGNATURE_HEADER, TIMESTAMP_HEADER};

const SECRET: &str = "test-payment-secret";

async fn notify(
    c: &reqwest::Client,
    base: &str,
    ts: Option<i64>,
    sig: Option<String>,
    body: &str,
) -> (u16, serde_json::Value) {
    let mut r = c
        .post(format!("{base}/api/payments/notify"))
        .body(body.to_string());
    if let Some(ts) = ts {
        r = r.header(TIMESTAMP_HEADER, ts.to_string());
    }
    if let Some(sig) = sig {
        r = r.header(SIGNATURE_HEADER, sig);
    }
    let r = r.send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or_default())
}

async fn order_status(
    c: &reqwest::Client,
    base: &str,
    token: &str,
    order: &str,
) -> serde_json::Value {
    c.get(format!("{base}/api/orders/{order}"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callbacks_are_verified_and_settle_once() {
    let db = common::fresh_database(Sql::Sqlite).await;
    let env = vec![
        ("SECKILL_DATABASE_URL".into(), db),
        ("SECKILL_PAYMENT_SECRET".into(), SECRET.into()),
    ];
    let server = Server::start(env, vec!["serve".into()]).await;
    let c = common::client();
    let base = server.base.clone();
    let sale = common::open_sale(&c, &server, 3, 1).await;
    let token = common::login_users(&c, &base, 1).await.remove(0);
    let (_, bought) = common::buy(&c, &base, &sale, &token).await;
    let order = bought["order_id"].as_str().unwrap().to_string();
    // `ok` means durable in the order log; the writer puts it in SQL moments later.
    let (c2, base2, token2, order2) = (c.clone(), base.clone(), token.clone(), order.clone());
    common::eventually(20, "the order is written", || {
        let (c, base, token, order) = (c2.clone(), base2.clone(), token2.clone(), order2.clone());
        async move { order_status(&c, &base, &token, &order).await["status"] == "pending_payment" }
    })
    .await;
    let intent: serde_json::Value = c
        .post(format!("{base}/api/orders/{order}/pay"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let intent_id = intent["intent_id"].as_str().unwrap().to_string();
    let again: serde_json::Value = c
        .post(format!("{base}/api/orders/{order}/pay"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        again["intent_id"], intent["intent_id"],
        "the open intent is reused"
    );

    let provider = SimulatedProvider::new(SECRET);
    let forger = SimulatedProvider::new("not-the-secret");
    let now = seckill::now_ms() / 1000;
    let body = format!(r#"{{"intent_id":"{intent_id}","status":"paid","provider_ref":"p1"}}"#);
    let unknown = r#"{"intent_id":"12345","status":"paid"}"#;
    let malformed = r#"{"intent_id":"1","status":"maybe"}"#;
    let refused = [
        (None, None, body.clone(), 401),
        (Some(now), Some("00".repeat(32)), body.clone(), 401),
        (
            Some(now),
            Some(forger.sign(now, body.as_bytes())),
            body.clone(),
            401,
        ),
        (
            Some(now - 3600),
            Some(provider.sign(now - 3600, body.as_bytes())),
            body.clone(),
            401,
        ),
        (
            Some(now),
            Some(provider.sign(now + 1, body.as_bytes())),
            body.clone(),
            401,
        ),
        (
            Some(now),
            Some(provider.sign(now, unknown.as_bytes())),
            unknown.to_string(),
            404,
        ),
        (
            Some(now),
            Some(provider.sign(now, malformed.as_bytes())),
            malformed.to_string(),
            400,
        ),
    ];
    for (ts, sig, b, want) in refused {
        let (status, answer) = notify(&c, &base, ts, sig, &b).await;
        assert_eq!(status, want, "{answer}");
        assert!(
            answer["code"].is_string() && answer["message"].is_string(),
            "{answer}"
        );
        assert_eq!(
            order_status(&c, &base, &token, &order).await["status"],
            "pending_payment",
            "nothing changed"
        );
    }

    let (status, answer) = notify(
        &c,
        &base,
        Some(now),
        Some(provider.sign(now, body.as_bytes())),
        &body,
    )
    .await;
    assert_eq!(
        (status, answer["result"].as_str()),
        (200, Some("paid")),
        "{answer}"
    );
    let (status, answer) = notify(
        &c,
        &base,
        Some(now),
        Some(provider.sign(now, body.as_bytes())),
        &body,
    )
    .await;
    assert_eq!(
        (status, answer["result"].as_str()),
        (200, Some("duplicate")),
        "{answer}"
    );
    let view = order_status(&c, &base, &token, &order).await;
    assert_eq!(view["status"], "paid");
    let steps: Vec<&str> = view["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["status"].as_str().unwrap())
        .collect();
    assert_eq!(steps, ["queued", "pending_payment", "paid"]);
    // Paid orders can be neither cancelled nor paid again.
    for action in ["cancel", "pay"] {
        let r = c
            .post(format!("{base}/api/orders/{order}/{action}"))
            .bearer_auth(&token)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 409);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_order_waits_for_the_writer_before_cancel_or_pay() {
    let db = common::fresh_database(Sql::Postgres).await;
    let env = vec![
        ("SECKILL_DATABASE_URL".to_string(), db),
        ("SECKILL_REDIS_URL".to_string(), common::redis_url()),
        ("SECKILL_REDIS_PREFIX".to_string(), common::unique("queued")),
        ("SECKILL_DEV".to_string(), "1".to_string()),
    ];
    // No writer anywhere yet: accepted orders stay in the order log.
    let server = Server::start(env.clone(), vec!["serve".into(), "--no-writer".into()]).await;
    let c = common::client();
    let base = server.base.clone();
    let sale = common::open_sale(&c, &server, 2, 1).await;
    let token = common::login_users(&c, &base, 1).await.remove(0);
    let (_, bought) = common::buy(&c, &base, &sale, &token).await;
    let order = bought["order_id"].as_str().unwrap().to_string();
    let view = order_status(&c, &base, &token, &order).await;
    assert_eq!(
        (view["status"].as_str(), view["quantity"].as_i64()),
        (Some("queued"), Some(1)),
        "{view}"
    );
    for action in ["cancel", "pay"] {
        let r = c
            .post(format!("{base}/api/orders/{order}/{action}"))
            .bearer_auth(&token)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 409);
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["code"], "order_queued", "{body}");
    }

    let mut worker_env = env;
    worker_env.push(("SECKILL_LOG".into(), "warn".into()));
    let mut worker = common::spawn(&worker_env, &["worker".to_string()]);
    let (c2, base2, token2, order2) = (c.clone(), base.clone(), token.clone(), order.clone());
    common::eventually(20, "the worker writes the order", || {
        let (c, base, token, order) = (c2.clone(), base2.clone(), token2.clone(), order2.clone());
        async move { order_status(&c, &base, &token, &order).await["status"] == "pending_payment" }
    })
    .await;
    let r = c
        .post(format!("{base}/api/orders/{order}/cancel"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let stock: serde_json::Value =
        common::get_json(&c, format!("{base}/api/sales/{sale}/stock"), None).await;
    assert_eq!(stock["remaining"], 2, "the cancelled unit is back at once");
    let _ = worker.kill();
    let _ = worker.wait();
}
