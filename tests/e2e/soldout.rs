//! The sold-out shortcut across instances: two servers share Redis; once a sale sells out,
//! each answers `sold_out` from its own flag without calling the gate (seen in /metrics);
//! a cancellation through one instance reopens the sale on the other within a second.

mod common;

use std::time::Duration;

use common::{metric, metrics, Server, Sql};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sold_out_is_answered_locally_and_reopens_everywhere() {
    let db = common::fresh_database(Sql::Postgres).await;
    let env = vec![
        ("SECKILL_DATABASE_URL".to_string(), db),
        ("SECKILL_REDIS_URL".to_string(), common::redis_url()),
        (
            "SECKILL_REDIS_PREFIX".to_string(),
            common::unique("soldout"),
        ),
        ("SECKILL_DEV".to_string(), "1".to_string()),
    ];
    let a = Server::start(env.clone(), vec!["serve".into()]).await;
    let b = Server::start(env, vec!["serve".into(), "--no-writer".into()]).await;
    let c = common::client();
    let sale = common::open_sale(&c, &a, 3, 1).await;
    let tokens = common::login_users(&c, &a.base, 40).await;
    // Instance B must know the sale (its cache refreshes every second).
    let (b_base, sale2) = (b.base.clone(), sale.clone());
    let c2 = c.clone();
    common::eventually(5, "instance B knows the sale", || {
        let (c, base, sale) = (c2.clone(), b_base.clone(), sale2.clone());
        async move {
            c.get(format!("{base}/api/sales/{sale}"))
                .send()
                .await
                .unwrap()
                .status()
                == 200
        }
    })
    .await;

    let mut winners = Vec::new();
    for t in &tokens[..3] {
        let (status, body) = common::buy(&c, &a.base, &sale, t).await;
        assert_eq!(status, 200, "{body}");
        winners.push((t.clone(), body["order_id"].as_str().unwrap().to_string()));
    }
    // B learns "sold out" from the gate once, then answers from its flag.
    for t in &tokens[3..20] {
        let (status, body) = common::buy(&c, &b.base, &sale, t).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (409, Some("sold_out")),
            "{body}"
        );
    }
    let m = metrics(&c, &b).await;
    assert_eq!(metric(&m, "seckill_sold_out_shortcuts_total"), 16, "{m}");
    assert_eq!(
        metric(&m, "seckill_gate_seconds_count"),
        1,
        "only the first sold_out came from the gate: {m}"
    );

    // A buyer cancels through A (once the writer has the order): B reopens at once.
    let (t, order) = &winners[0];
    let (c3, a_base, t3, order3) = (c.clone(), a.base.clone(), t.clone(), order.clone());
    common::eventually(20, "the order is written", || {
        let (c, base, t, order) = (c3.clone(), a_base.clone(), t3.clone(), order3.clone());
        async move {
            let r = c
                .post(format!("{base}/api/orders/{order}/cancel"))
                .bearer_auth(&t)
                .send()
                .await
                .unwrap();
            r.status() == 200
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let (status, body) = common::buy(&c, &b.base, &sale, &tokens[20]).await;
    assert_eq!(status, 200, "B sells the returned unit: {body}");
    let (status, body) = common::buy(&c, &b.base, &sale, &tokens[21]).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("sold_out")),
        "{body}"
    );
}
