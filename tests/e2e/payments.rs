//! Payment callbacks and queued orders over HTTP against the real binary: a callback is
//! refused when unsigned, forged, stale, malformed or for an unknown intent, and none of
//! those changes anything; the same callback twice settles once. An order still being
//! written (`queued`) can be neither cancelled nor paid until the writer has it.

use crate::common;

use crate::common::{Server, Sql};
use seckill::lifecycle::payment::SimulatedProvider;

const SECRET: &str = "test-payment-secret";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callbacks_are_verified_and_settle_once() {
    let db = common::fresh_database(Sql::Sqlite).await;
    let env = vec![
        ("SECKILL_DATABASE_URL".into(), db),
        ("SECKILL_PAYMENT_SECRET".into(), SECRET.into()),
    ];
    let server = Server::start(env, vec!["serve".into()]).await;
    let api = server.api();
    let sale = api.open_sale(3, 1).await;
    let token = api.login_users(1).await.remove(0);
    let order = api.buy(&token, &sale).await.order_id().unwrap();
    // `ok` means durable in the order log; the writer puts it in SQL moments later.
    api.written(&token, &order).await;
    let intent = api.pay(&token, &order).await.json();
    let intent_id = intent["intent_id"].as_str().unwrap().to_string();
    let again = api.pay(&token, &order).await.json();
    assert_eq!(
        again["intent_id"], intent["intent_id"],
        "the open intent is reused"
    );

    let provider = SimulatedProvider::new(SECRET);
    let forger = SimulatedProvider::new("not-the-secret");
    let now = seckill::clock::wall_ms() / 1000;
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
        let answer = api.notify(ts, sig.as_deref(), &b).await;
        assert_eq!(answer.status, want, "{answer}");
        assert!(
            answer["code"].is_string() && answer["message"].is_string(),
            "{answer}"
        );
        assert_eq!(
            api.order(&token, &order).await.json()["status"],
            "pending_payment",
            "nothing changed"
        );
    }

    let signed = provider.sign(now, body.as_bytes());
    for result in ["paid", "duplicate"] {
        let answer = api.notify(Some(now), Some(&signed), &body).await;
        assert_eq!(
            (answer.status, answer["result"].as_str()),
            (200, Some(result)),
            "{answer}"
        );
    }
    let view = api.order(&token, &order).await.json();
    assert_eq!(view["status"], "paid");
    let steps: Vec<&str> = view["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["status"].as_str().unwrap())
        .collect();
    assert_eq!(steps, ["queued", "pending_payment", "paid"]);
    // Paid orders can be neither cancelled nor paid again.
    for answer in [
        api.cancel(&token, &order).await,
        api.pay(&token, &order).await,
    ] {
        assert_eq!(answer.status, 409, "{answer}");
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
    let api = server.api();
    let sale = api.open_sale(2, 1).await;
    let token = api.login_users(1).await.remove(0);
    let order = api.buy(&token, &sale).await.order_id().unwrap();
    let view = api.order(&token, &order).await.json();
    assert_eq!(
        (view["status"].as_str(), view["quantity"].as_i64()),
        (Some("queued"), Some(1)),
        "{view}"
    );
    for answer in [
        api.cancel(&token, &order).await,
        api.pay(&token, &order).await,
    ] {
        assert_eq!(answer.status, 409);
        let body = answer.json();
        assert_eq!(body["code"], "order_queued", "{body}");
    }

    // The worker writes the order.
    let _worker = common::worker(&env);
    api.written(&token, &order).await;
    api.cancel(&token, &order).await.expect(200);
    let stock = api.stock(&sale).await.json();
    assert_eq!(stock["remaining"], 2, "the cancelled unit is back at once");
}
