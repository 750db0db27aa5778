//! The purchase lifecycle end to end, per deployment, over HTTP against the real binary: a
//! sale sells out; some buyers pay (through the simulated provider's signed callback), some
//! cancel, the rest let the deadline pass (one pays too late and is owed a refund); new
//! buyers then take exactly the returned stock. The database is checked at every step:
//! paid + pending never exceed the stock, each unit comes back once, and at the end
//! SQL stock + units in live orders = the initial stock.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{Server, Sql};
use seckill::model::OrderStatus;
use seckill::store::Store;

const STOCK: i64 = 12;
const PAY: usize = 5;
const CANCEL: usize = 3;
const WINDOW_SECS: i64 = 4;

struct Deployment {
    server: Server,
    _worker: Option<std::process::Child>,
    store: Store,
    name: &'static str,
}

impl Drop for Deployment {
    fn drop(&mut self) {
        if let Some(w) = &mut self._worker {
            let _ = w.kill();
            let _ = w.wait();
        }
    }
}

async fn deploy(kind: Option<Sql>) -> Deployment {
    let db = common::fresh_database(kind.unwrap_or(Sql::Sqlite)).await;
    let mut env = vec![("SECKILL_DATABASE_URL".to_string(), db.clone())];
    let mut worker = None;
    if kind.is_some() {
        env.push(("SECKILL_REDIS_URL".into(), common::redis_url()));
        env.push(("SECKILL_REDIS_PREFIX".into(), common::unique("life")));
        env.push(("SECKILL_DEV".into(), "1".into()));
        let mut wenv = env.clone();
        wenv.push(("SECKILL_LOG".into(), "warn".into()));
        worker = Some(common::spawn(&wenv, &["worker".to_string()]));
    }
    let args = if kind.is_some() {
        vec!["serve".into(), "--no-writer".into()]
    } else {
        vec!["serve".into()]
    };
    let server = Server::start(env, args).await;
    Deployment {
        server,
        _worker: worker,
        store: Store::connect(&db, 4).await.unwrap(),
        name: match kind {
            None => "embedded",
            Some(Sql::Postgres) => "redis+postgres",
            _ => "redis+mariadb",
        },
    }
}

async fn open_sale(c: &reqwest::Client, s: &Server) -> String {
    let terms = serde_json::json!({"title": "lifecycle", "price_cents": 500, "payment_window_secs": WINDOW_SECS});
    common::open_sale_with(c, s, STOCK, 1, terms).await
}

async fn post(
    c: &reqwest::Client,
    url: String,
    bearer: &str,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    let mut r = c.post(url).bearer_auth(bearer);
    if let Some(b) = body {
        r = r.json(&b);
    }
    let r = r.send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or_default())
}

/// Paid + pending never exceed the stock; SQL stock + live units = the initial stock.
async fn check_invariants(d: &Deployment, sale_id: i64) -> HashMap<OrderStatus, usize> {
    let orders = d.store.orders_of_sale(sale_id).await.unwrap();
    let mut by_status = HashMap::new();
    let mut live_units = 0;
    for o in &orders {
        *by_status.entry(o.status).or_insert(0) += 1;
        if matches!(o.status, OrderStatus::Paid | OrderStatus::PendingPayment) {
            live_units += o.quantity;
        }
    }
    assert!(
        live_units <= STOCK,
        "{}: paid + pending {live_units} > stock",
        d.name
    );
    let sql_stock = d.store.sale(sale_id).await.unwrap().unwrap().stock;
    assert_eq!(
        sql_stock + live_units,
        STOCK,
        "{}: SQL stock + live units = initial stock",
        d.name
    );
    by_status
}

async fn run(d: Deployment) {
    let c = common::client();
    let base = d.server.base.clone();
    let sale = open_sale(&c, &d.server).await;
    let sale_id: i64 = sale.parse().unwrap();
    let tokens = common::login_users(&c, &base, 60).await;

    // Sell out: the first 12 winners hold orders.
    let mut winners = Vec::new();
    for t in &tokens[..30] {
        let (status, body) = common::buy(&c, &base, &sale, t).await;
        if status == 200 {
            winners.push((t.clone(), body["order_id"].as_str().unwrap().to_string()));
        }
    }
    assert_eq!(winners.len(), STOCK as usize, "{}", d.name);
    let store = d.store.clone();
    common::eventually(30, "orders written", || {
        let store = store.clone();
        async move { store.orders_of_sale(sale_id).await.unwrap().len() == STOCK as usize }
    })
    .await;
    check_invariants(&d, sale_id).await;

    // Some pay through the simulated provider; one of them is notified twice.
    let mut intents = Vec::new();
    for (t, order) in &winners[..PAY + 1] {
        let (status, intent) = post(&c, format!("{base}/api/orders/{order}/pay"), t, None).await;
        assert_eq!(status, 200, "{}: {intent}", d.name);
        assert!(intent["qr_payload"]
            .as_str()
            .unwrap()
            .contains(intent["intent_id"].as_str().unwrap()));
        intents.push(intent["intent_id"].as_str().unwrap().to_string());
    }
    for intent in &intents[..PAY] {
        let (status, body) = post(
            &c,
            format!("{base}/api/admin/payments/{intent}/simulate"),
            &d.server.admin,
            Some(serde_json::json!({"outcome": "pay"})),
        )
        .await;
        assert_eq!(status, 202, "{}: {body}", d.name);
    }
    post(
        &c,
        format!("{base}/api/admin/payments/{}/simulate", intents[0]),
        &d.server.admin,
        Some(serde_json::json!({"outcome": "pay"})),
    )
    .await;
    // The last intent pays after its deadline: the order expires first, the money is owed back.
    post(
        &c,
        format!("{base}/api/admin/payments/{}/simulate", intents[PAY]),
        &d.server.admin,
        Some(serde_json::json!({"outcome": "pay_late"})),
    )
    .await;

    // Some cancel; cancelling twice is refused and changes nothing.
    for (t, order) in &winners[PAY + 1..PAY + 1 + CANCEL] {
        let (status, body) = post(&c, format!("{base}/api/orders/{order}/cancel"), t, None).await;
        assert_eq!(status, 200, "{}: {body}", d.name);
        let (status, body) = post(&c, format!("{base}/api/orders/{order}/cancel"), t, None).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (409, Some("invalid_transition")),
            "{}: {body}",
            d.name
        );
    }
    // Someone else's order cannot be cancelled.
    let (status, _) = post(
        &c,
        format!("{base}/api/orders/{}/cancel", winners[0].1),
        &tokens[59],
        None,
    )
    .await;
    assert_eq!(status, 404);
    let by_status = check_invariants(&d, sale_id).await;
    assert_eq!(
        by_status.get(&OrderStatus::Cancelled),
        Some(&CANCEL),
        "{}",
        d.name
    );

    // The cancelled units are buyable again at once.
    let stock: serde_json::Value =
        common::get_json(&c, format!("{base}/api/sales/{sale}/stock"), None).await;
    assert_eq!(
        (stock["state"].as_str(), stock["remaining"].as_i64()),
        (Some("active"), Some(CANCEL as i64)),
        "{}",
        d.name
    );

    // The rest let the deadline pass and expire; their units come back too.
    let expiring = STOCK as usize - PAY - CANCEL;
    let store = d.store.clone();
    common::eventually(WINDOW_SECS as u64 + 20, "unpaid orders expire", || {
        let store = store.clone();
        async move {
            let orders = store.orders_of_sale(sale_id).await.unwrap();
            orders
                .iter()
                .filter(|o| o.status == OrderStatus::Expired)
                .count()
                == expiring
        }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await; // the late payment arrives
    let by_status = check_invariants(&d, sale_id).await;
    assert_eq!(by_status.get(&OrderStatus::Paid), Some(&PAY), "{}", d.name);
    let stock: serde_json::Value =
        common::get_json(&c, format!("{base}/api/sales/{sale}/stock"), None).await;
    let returned = (CANCEL + expiring) as i64;
    assert_eq!(
        stock["remaining"].as_i64(),
        Some(returned),
        "{}: every returned unit once",
        d.name
    );
    let mine: serde_json::Value =
        common::get_json(&c, format!("{base}/api/orders"), Some(&winners[0].0)).await;
    assert_eq!(mine[0]["status"], "paid", "{}", d.name);
    assert!(mine[0]["pay_deadline"].is_string());

    // New buyers take exactly the returned stock; winners who paid are still refused.
    let (status, body) = common::buy(&c, &base, &sale, &winners[0].0).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("already_purchased")),
        "{}",
        d.name
    );
    let mut second = 0;
    for t in &tokens[30..] {
        if common::buy(&c, &base, &sale, t).await.0 == 200 {
            second += 1;
        }
    }
    assert_eq!(second, returned, "{}", d.name);
    let store = d.store.clone();
    common::eventually(30, "second wave written", || {
        let store = store.clone();
        async move {
            store.orders_of_sale(sale_id).await.unwrap().len() == STOCK as usize + returned as usize
        }
    })
    .await;
    check_invariants(&d, sale_id).await;
    assert_eq!(
        d.store.sale(sale_id).await.unwrap().unwrap().stock,
        0,
        "{}",
        d.name
    );

    let stats: serde_json::Value = common::get_json(
        &c,
        format!("{base}/api/admin/sales/{sale}/stats"),
        Some(&d.server.admin),
    )
    .await;
    assert_eq!(
        stats["payments_by_status"]["paid"], PAY as i64,
        "{}: {stats}",
        d.name
    );
    assert_eq!(
        stats["payments_by_status"]["refund_due"], 1,
        "{}: {stats}",
        d.name
    );
    assert_eq!(stats["gate_stock"], 0, "{}: {stats}", d.name);
    assert!(
        d.store
            .pending_returns(Some(sale_id), 100)
            .await
            .unwrap()
            .is_empty(),
        "{}: outbox drained",
        d.name
    );
    // After payments, cancels, expiries and a resale: the gate matches SQL, the journal
    // sums to the stock, and it holds one row per step of every unit.
    common::check_reconciled(&c, &d.server, &sale).await;
    let journal = common::get_json(
        &c,
        format!("{base}/api/admin/sales/{sale}/journal?limit=10000"),
        Some(&d.server.admin),
    )
    .await;
    let rows = journal["rows"].as_array().unwrap();
    let count = |cause: &str| rows.iter().filter(|r| r["cause"] == cause).count();
    let by_status = check_invariants(&d, sale_id).await;
    let returned_orders = by_status.get(&OrderStatus::Cancelled).copied().unwrap_or(0)
        + by_status.get(&OrderStatus::Expired).copied().unwrap_or(0);
    assert_eq!(
        count("written"),
        STOCK as usize + returned as usize,
        "{}",
        d.name
    );
    assert_eq!(
        count("cancelled") + count("expired"),
        returned_orders,
        "{}",
        d.name
    );
    assert_eq!(count("returned_to_gate"), returned_orders, "{}", d.name);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn embedded_lifecycle() {
    run(deploy(None).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_postgres_lifecycle() {
    run(deploy(Some(Sql::Postgres)).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_mariadb_lifecycle() {
    run(deploy(Some(Sql::Mariadb)).await).await;
}
