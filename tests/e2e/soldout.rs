//! The sold-out shortcut across instances: two servers share Redis; once a sale sells out,
//! each answers `sold_out` from its own flag without calling the gate (seen in /metrics);
//! a cancellation through one instance reopens the sale on the other within a second.

use crate::common;

use std::time::Duration;

use crate::common::{metric, Server, Sql};

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
    let server_a = Server::start(env.clone(), vec!["serve".into()]).await;
    let server_b = Server::start(env, vec!["serve".into(), "--no-writer".into()]).await;
    let (a, b) = (server_a.api(), server_b.api());
    let sale = a.open_sale(3, 1).await;
    let tokens = a.login_users(40).await;
    // Instance B must know the sale (its cache refreshes every second).
    common::eventually(5, "instance B knows the sale", || async {
        b.sale(&sale).await.status == 200
    })
    .await;

    let mut winners = Vec::new();
    for t in &tokens[..3] {
        let answer = a.buy(t, &sale).await;
        assert_eq!(answer.status, 200, "{answer}");
        winners.push((t.clone(), answer.order_id().unwrap()));
    }
    // B learns "sold out" from the gate once, then answers from its flag.
    for t in &tokens[3..20] {
        let answer = b.buy(t, &sale).await;
        assert_eq!(answer.status_code(), (409, "sold_out".into()), "{answer}");
    }
    let m = b.metrics().await;
    assert_eq!(metric(&m, "seckill_sold_out_shortcuts_total"), 16, "{m}");
    assert_eq!(
        metric(&m, "seckill_gate_seconds_count"),
        1,
        "only the first sold_out came from the gate: {m}"
    );

    // A buyer cancels through A (once the writer has the order): B reopens at once.
    let (t, order) = &winners[0];
    common::eventually(20, "the order is written", || async {
        a.cancel(t, order).await.status == 200
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let answer = b.buy(&tokens[20], &sale).await;
    assert_eq!(answer.status, 200, "B sells the returned unit: {answer}");
    let answer = b.buy(&tokens[21], &sale).await;
    assert_eq!(answer.status_code(), (409, "sold_out".into()), "{answer}");
}
