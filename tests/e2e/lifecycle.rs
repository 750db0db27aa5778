//! The purchase lifecycle end to end, per deployment, over HTTP against the real binary: a
//! sale sells out; some buyers pay (through the simulated provider's signed callback), some
//! cancel, the rest let the deadline pass (one pays too late and is owed a refund); new
//! buyers then take exactly the returned stock. The database is checked at every step:
//! paid + pending never exceed the stock, each unit comes back once, and at the end
//! SQL stock + units in live orders = the initial stock.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use crate::common::{Api, Server, Sql, Worker};
use seckill::model::OrderStatus;
use seckill::store::Store;

const STOCK: i64 = 12;
const PAY: usize = 5;
const CANCEL: usize = 3;
const WINDOW_SECS: i64 = 4;

struct Deployment {
    server: Server,
    _worker: Option<Worker>,
    store: Store,
    name: &'static str,
}

async fn deploy(kind: Option<Sql>) -> Deployment {
    let db = common::fresh_database(kind.unwrap_or(Sql::Sqlite)).await;
    let mut env = vec![("SECKILL_DATABASE_URL".to_string(), db.clone())];
    let mut worker = None;
    if kind.is_some() {
        env.push(("SECKILL_REDIS_URL".into(), common::redis_url()));
        env.push(("SECKILL_REDIS_PREFIX".into(), common::unique("life")));
        env.push(("SECKILL_DEV".into(), "1".into()));
        worker = Some(common::worker(&env));
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

async fn open_sale(api: &Api) -> String {
    let terms = serde_json::json!({"title": "lifecycle", "price_cents": 500, "payment_window_secs": WINDOW_SECS});
    api.open_sale_with(STOCK, 1, &terms).await
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
    let api = d.server.api();
    let sale = open_sale(&api).await;
    let sale_id: i64 = sale.parse().unwrap();
    let tokens = api.login_users(60).await;

    // Sell out: the first 12 winners hold orders.
    let mut winners = Vec::new();
    for t in &tokens[..30] {
        let answer = api.buy(t, &sale).await;
        if answer.status == 200 {
            winners.push((t.clone(), answer.order_id().unwrap()));
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
        let intent = api.pay(t, order).await;
        assert_eq!(intent.status, 200, "{}: {intent}", d.name);
        assert!(intent["qr_payload"]
            .as_str()
            .unwrap()
            .contains(intent["intent_id"].as_str().unwrap()));
        intents.push(intent["intent_id"].as_str().unwrap().to_string());
    }
    for intent in &intents[..PAY] {
        let answer = api.simulate(intent, "pay").await;
        assert_eq!(answer.status, 202, "{}: {answer}", d.name);
    }
    api.simulate(&intents[0], "pay").await;
    // The last intent pays after its deadline: the order expires first, the money is owed back.
    api.simulate(&intents[PAY], "pay_late").await;

    // Some cancel; cancelling twice is refused and changes nothing.
    for (t, order) in &winners[PAY + 1..PAY + 1 + CANCEL] {
        let answer = api.cancel(t, order).await;
        assert_eq!(answer.status, 200, "{}: {answer}", d.name);
        let answer = api.cancel(t, order).await;
        assert_eq!(
            answer.status_code(),
            (409, "invalid_transition".into()),
            "{}: {answer}",
            d.name
        );
    }
    // Someone else's order cannot be cancelled.
    assert_eq!(api.cancel(&tokens[59], &winners[0].1).await.status, 404);
    let by_status = check_invariants(&d, sale_id).await;
    assert_eq!(
        by_status.get(&OrderStatus::Cancelled),
        Some(&CANCEL),
        "{}",
        d.name
    );

    // The cancelled units are buyable again at once.
    let stock = api.stock(&sale).await.json();
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
    let stock = api.stock(&sale).await.json();
    let returned = (CANCEL + expiring) as i64;
    assert_eq!(
        stock["remaining"].as_i64(),
        Some(returned),
        "{}: every returned unit once",
        d.name
    );
    let mine = api.orders(&winners[0].0).await.json();
    assert_eq!(mine[0]["status"], "paid", "{}", d.name);
    assert!(mine[0]["pay_deadline"].is_string());

    // New buyers take exactly the returned stock; winners who paid are still refused.
    let answer = api.buy(&winners[0].0, &sale).await;
    assert_eq!(
        answer.status_code(),
        (409, "already_purchased".into()),
        "{}",
        d.name
    );
    let mut second = 0;
    for t in &tokens[30..] {
        if api.buy(t, &sale).await.status == 200 {
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

    let stats = api.books(&sale, "stats").await.json();
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
    // sums to the stock, its writer rows count every order once, and it holds one row per
    // cancel, expiry and return.
    api.check_reconciled(&sale).await;
    let journal = api.journal(&sale).await;
    let rows = journal["rows"].as_array().unwrap();
    let count = |cause: &str| rows.iter().filter(|r| r["cause"] == cause).count();
    let by_status = check_invariants(&d, sale_id).await;
    let returned_orders = by_status.get(&OrderStatus::Cancelled).copied().unwrap_or(0)
        + by_status.get(&OrderStatus::Expired).copied().unwrap_or(0);
    assert_eq!(
        common::api::written_orders(&journal),
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
