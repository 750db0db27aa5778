//! Reconciliation end to end: the stock journal, the continuous audit of each gate
//! against SQL plus what is in flight, and the repair.
//!
//! - Redis + PostgreSQL (two instances, two workers): a storm, cancels, payments and
//!   expiries end with gate = SQL + in flight and journal sum = stock; then three faults
//!   injected by hand in Redis (a buyer removed from the gate, stock changed, an order
//!   deleted from the stream before it was written) are reported by the audit in
//!   `/metrics` within seconds and by `seckill reconcile`; `reconcile --repair` restores
//!   exactness, journaled; the removed buyer still cannot buy past the limit and the rest
//!   of the stock sells exactly.
//! - Embedded (memory gate, SQLite): the same storm ends exact; repair is refused with the
//!   reason (the gate is the server's memory, rebuilt from SQL at every start).

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::common::storm::{storm_on, tokens, Arrival, Told};
use crate::common::{Api, Server, Sql};
use seckill::redis_client::keys::SaleKeys;
use seckill::store::Store;
use serde_json::{json, Value};

const REDIS: &str = "redis://127.0.0.1:6379/";

fn ok_orders(told: &HashMap<i64, Told>) -> Vec<(i64, i64)> {
    told.iter()
        .flat_map(|(u, t)| t.ok.iter().map(move |o| (*u, *o)))
        .collect()
}

/// Cancels as the buyer, retrying while the order is still being written.
async fn cancel(api: &Api, token: &str, order: i64) {
    for _ in 0..100 {
        let r = api.cancel(token, order).await;
        let (status, body) = (r.status, r.json());
        if status == 200 {
            return;
        }
        assert!(
            body["code"] == "order_queued" || status == 503,
            "cancel {order}: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("order {order} could not be cancelled");
}

/// Pays as the buyer through the simulated provider.
async fn pay(api: &Api, token: &str, order: i64) {
    let mut intent = Value::Null;
    for _ in 0..100 {
        let r = api.pay(token, order).await;
        if r.status == 200 {
            intent = r.json();
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let id = intent["intent_id"].as_str().expect("a payment intent");
    assert_eq!(api.simulate(id, "pay").await.status, 202);
}

fn count_cause(journal: &Value, cause: &str) -> usize {
    journal["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["cause"] == cause)
        .count()
}

/// A storm with cancels, payments and expiries; returns (orders answered ok, paid, cancelled).
async fn storm_with_lifecycle(
    bases: Vec<String>,
    admin: &Api,
    sale: i64,
    buyers: Vec<(i64, String)>,
) -> (usize, Vec<(i64, i64)>, usize) {
    let on_first = admin.at(&bases[0]);
    let token_of: HashMap<i64, String> = buyers.iter().cloned().collect();
    let told = storm_on(
        bases.clone(),
        sale.to_string(),
        buyers,
        Arrival::Crowd(64),
        Arc::default(),
    )
    .await;
    let ok = ok_orders(&told);
    // 30 pay, 40 cancel; the rest expire unpaid.
    let paid: Vec<(i64, i64)> = ok[..30].to_vec();
    for (user, order) in &paid {
        pay(admin, &token_of[user], *order).await;
    }
    for (user, order) in &ok[30..70] {
        cancel(&on_first, &token_of[user], *order).await;
    }
    (ok.len(), paid, 40)
}

/// Waits until the sale's account is exact, nothing is in flight and `live_units` units
/// are live in SQL (the unpaid orders have expired).
async fn settled(api: &Api, sale: i64, live_units: i64, secs: u64) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let r = api.reconciliation(sale).await;
        let quiet = r["unwritten_orders"] == 0 && r["returns_owed_orders"] == 0;
        if r["exact"] == true && quiet && r["sql_live_units"] == live_units {
            return r;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never exact and quiet: {r}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drift_injected_in_redis_is_reported_and_repaired_with_a_trail() {
    const STOCK: i64 = 300;
    let db = common::fresh_database(Sql::Postgres).await;
    let secret = common::unique("secret");
    let prefix = common::unique("rec");
    let env = vec![
        ("SECKILL_DATABASE_URL".to_string(), db.clone()),
        ("SECKILL_REDIS_URL".to_string(), REDIS.to_string()),
        ("SECKILL_REDIS_PREFIX".to_string(), prefix.clone()),
        ("SECKILL_TOKEN_SECRET".to_string(), secret.clone()),
        ("SECKILL_AUDIT_EVERY_SECS".to_string(), "1".to_string()),
        // Buyers pay through the simulated provider's signed callbacks (dev mode is off).
        (
            "SECKILL_PAYMENT_PROVIDER".to_string(),
            "simulated".to_string(),
        ),
    ];
    let (instances, workers) = common::storm::instances_and_workers(env.clone()).await;
    let store = Store::connect(&db, 4).await.unwrap();
    let apis: Vec<Api> = instances.iter().map(Server::api).collect();
    let bases: Vec<String> = instances.iter().map(|s| s.base.clone()).collect();
    let sale: i64 = apis[0]
        .open_sale_with(STOCK, 1, &json!({"payment_window_secs": 4}))
        .await
        .parse()
        .unwrap();

    // 1,000 buyers take the 300; 30 pay, 40 cancel, 230 expire; 400 more take what came back.
    let (first_ok, paid, cancelled) =
        storm_with_lifecycle(bases.clone(), &apis[0], sale, tokens(&secret, 1..1001)).await;
    assert_eq!(first_ok as i64, STOCK);
    common::eventually(30, "expired units back in the gate", || async {
        apis[1].reconciliation(sale).await["gate_stock"] == STOCK - 30
    })
    .await;
    let second = storm_on(
        bases.clone(),
        sale.to_string(),
        tokens(&secret, 1001..1401),
        Arrival::Crowd(64),
        Arc::default(),
    )
    .await;
    assert_eq!(ok_orders(&second).len() as i64, STOCK - 30);

    // Everything settled: gate = SQL + in flight, journal = stock, on both instances.
    let account = settled(&apis[0], sale, 30, 60).await;
    assert_eq!(account["sql_live_buyers"], 30, "{account}");
    assert_eq!(account["gate_buyers"], 30, "{account}");
    assert_eq!(account["journal_sum"], account["sql_stock"], "{account}");
    settled(&apis[1], sale, 30, 10).await;
    let j = apis[0].journal(sale).await;
    assert_eq!(j["sum"], j["stock"], "{j}");
    let sold = (STOCK + STOCK - 30) as usize;
    assert_eq!(
        common::api::written_orders(&j),
        sold,
        "every order written, once"
    );
    assert_eq!(count_cause(&j, "cancelled"), cancelled);
    assert_eq!(count_cause(&j, "expired"), sold - 30 - cancelled, "{j}");
    assert_eq!(
        count_cause(&j, "returned_to_gate"),
        sold - 30,
        "every unit handed back to the gate"
    );
    assert!(count_cause(&j, "loaded") >= 1);
    let (code, out) = common::reconcile_cli(&env, &["--sale", &sale.to_string()]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("exact"), "{out}");
    // One instance audits; the other holds no lease.
    let mut auditing = 0;
    for api in &apis {
        let m = api.metrics().await;
        auditing += common::metric(&m, "seckill_reconcile_auditing");
        assert!(
            common::drift_in(&m, sale).is_empty(),
            "drift reported while exact: {m}"
        );
    }
    assert_eq!(auditing, 1, "exactly one instance audits");

    // Three faults, by hand, in Redis. The writers stop first, so that an order can be
    // deleted from the stream before any writer reads it.
    drop(workers);
    let keys = SaleKeys::new(&prefix, sale);
    let (_, mut redis) = seckill::app::redis_manager(REDIS).await.unwrap();
    let (removed_buyer, _) = paid[0];
    let _: i64 = redis::cmd("HDEL")
        .arg(&keys.buyers)
        .arg(removed_buyer)
        .query_async(&mut redis)
        .await
        .unwrap();
    let _: i64 = redis::cmd("HINCRBY")
        .arg(&keys.sale)
        .arg("stock")
        .arg(5)
        .query_async(&mut redis)
        .await
        .unwrap();
    let lost_buyer = tokens(&secret, 5000..5001).remove(0);
    apis[0].buy(&lost_buyer.1, sale).await.expect(200);
    let entries: Vec<(String, HashMap<String, String>)> = redis::cmd("XRANGE")
        .arg(&keys.stream)
        .arg("-")
        .arg("+")
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(entries.len(), 1, "only the new order waits: {entries:?}");
    let _: i64 = redis::cmd("XDEL")
        .arg(&keys.stream)
        .arg(&entries[0].0)
        .query_async(&mut redis)
        .await
        .unwrap();

    // The audit reports each within seconds: +5 - 1 units, one buyer missing, one unknown.
    let expected: HashMap<String, i64> = [
        ("stock", 4),
        ("buyers_missing", 1),
        ("buyers_unknown", 1),
        ("journal", 0),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let started = std::time::Instant::now();
    let mut seen = HashMap::new();
    while started.elapsed() < Duration::from_secs(15) && seen != expected {
        seen.clear();
        for api in &apis {
            seen.extend(common::drift_in(&api.metrics().await, sale));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(seen, expected, "drift in /metrics");
    eprintln!("drift reported in /metrics after {:?}", started.elapsed());
    let (code, out) = common::reconcile_cli(&env, &["--sale", &sale.to_string()]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("DRIFT: stock +4, buyers missing 1, buyers unknown 1, journal +0"),
        "{out}"
    );

    // The repair: exact again, journaled with who and why.
    let (code, out) = common::reconcile_cli(
        &env,
        &[
            "--sale",
            &sale.to_string(),
            "--repair",
            "--reason",
            "test: injected faults",
        ],
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("repaired"), "{out}");
    let after = apis[1].reconciliation(sale).await;
    assert_eq!(after["exact"], true, "{after}");
    assert_eq!(after["gate_stock"], STOCK - 30, "{after}");
    assert_eq!(after["gate_buyers"], 30, "{after}");
    let j = apis[0].journal(sale).await;
    let repaired: Vec<&Value> = j["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["cause"] == "repaired")
        .collect();
    assert_eq!(repaired.len(), 1, "{j}");
    assert_eq!(repaired[0]["actor"], "seckill reconcile");
    assert!(
        repaired[0]["detail"]
            .as_str()
            .unwrap()
            .starts_with("test: injected faults"),
        "{j}"
    );
    common::eventually(15, "the drift cleared from /metrics", || async {
        let mut any = false;
        for api in &apis {
            any |= !common::drift_in(&api.metrics().await, sale).is_empty();
        }
        !any
    })
    .await;

    // The removed buyer is known again: no second unit. The rest of the stock sells to new
    // buyers exactly, with writers back.
    let removed_token = tokens(&secret, removed_buyer..removed_buyer + 1)
        .remove(0)
        .1;
    let answer = apis[1].buy(&removed_token, sale).await;
    assert_eq!(answer["code"], "already_purchased", "{answer}");
    let _workers = common::storm::start_workers(&env);
    let last = storm_on(
        bases.clone(),
        sale.to_string(),
        tokens(&secret, 6000..6400),
        Arrival::Crowd(64),
        Arc::default(),
    )
    .await;
    assert_eq!(
        ok_orders(&last).len() as i64,
        STOCK - 30,
        "the rest sold exactly"
    );
    settled(&apis[0], sale, 30, 60).await;
    // Every order ever written, by buyer: one each (each buyer here bought once, and the
    // removed one could not buy again); the lost order never reached SQL.
    let orders = common::storm::live_orders(&store, sale).await;
    assert!(
        orders.values().all(|ids| ids.len() == 1),
        "a buyer over the limit"
    );
    let written: usize = orders.values().map(|ids| ids.len()).sum();
    assert_eq!(written as i64, STOCK + 2 * (STOCK - 30));
    let (sum, stock) = store.journal_balance(sale).await.unwrap();
    assert_eq!(Some(sum), stock);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_embedded_gate_ends_a_storm_exact_and_explains_why_it_is_not_repaired_live() {
    const STOCK: i64 = 200;
    let server = Server::embedded(&[("SECKILL_AUDIT_EVERY_SECS", "1")]).await;
    let api = server.api();
    let sale: i64 = api
        .open_sale_with(STOCK, 1, &json!({"payment_window_secs": 3}))
        .await
        .parse()
        .unwrap();
    let users = api.login_users(600).await;
    let buyers: Vec<(i64, String)> = users
        .iter()
        .map(|t| (common::user_of(t), t.clone()))
        .collect();
    let (ok, _, cancelled) =
        storm_with_lifecycle(vec![server.base.clone()], &api, sale, buyers).await;
    assert_eq!(ok as i64, STOCK);
    common::eventually(30, "expired units back in the gate", || async {
        api.reconciliation(sale).await["gate_stock"] == STOCK - 30
    })
    .await;
    let account = settled(&api, sale, 30, 30).await;
    assert_eq!(account["sql_live_buyers"], 30, "{account}");
    let j = api.journal(sale).await;
    assert_eq!(j["sum"], j["stock"]);
    assert_eq!(j["stock"], STOCK - 30);
    assert_eq!(common::api::written_orders(&j), STOCK as usize);
    assert_eq!(count_cause(&j, "cancelled"), cancelled);
    assert_eq!(count_cause(&j, "expired"), STOCK as usize - 30 - cancelled);
    let m = api.metrics().await;
    assert_eq!(common::metric(&m, "seckill_reconcile_auditing"), 1);
    assert!(common::metric(&m, "seckill_reconcile_audits_total") >= 1);
    let body = api.repair(sale).await.expect(409);
    assert!(
        body["message"].as_str().unwrap().contains("restart"),
        "{body}"
    );
    let (code, out) = common::reconcile_cli(&server.env, &[]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("/api/admin/sales/{id}/reconcile"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sql_gate_has_only_its_journal_to_reconcile_and_never_reports_drift() {
    let server = Server::embedded(&[
        ("SECKILL_GATE", "sql-conditional"),
        ("SECKILL_AUDIT_EVERY_SECS", "1"),
    ])
    .await;
    let api = server.api();
    let sale: i64 = api.open_sale(20, 1).await.parse().unwrap();
    let tokens = api.login_users(30).await;
    let mut orders = Vec::new();
    for t in &tokens {
        let answer = api.buy(t, sale).await;
        if answer.status == 200 {
            orders.push((
                t.clone(),
                answer.order_id().unwrap().parse::<i64>().unwrap(),
            ));
        }
    }
    assert_eq!(orders.len(), 20);
    for (t, o) in &orders[..3] {
        cancel(&api, t, *o).await;
    }
    // Three audits and more: a SQL gate, whose orders are cancelled and counted in SQL
    // itself, is never taken for drift.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let r = api.reconciliation(sale).await;
    assert_eq!(r["exact"], true, "{r}");
    assert_eq!(r["gate_loaded"], false, "{r}");
    let m = api.metrics().await;
    assert!(common::drift_in(&m, sale).is_empty(), "{m}");
    let j = api.journal(sale).await;
    assert_eq!(j["sum"], j["stock"], "{j}");
    assert_eq!(j["stock"], 3, "{j}");
    assert_eq!(count_cause(&j, "accepted"), 20, "{j}");
    assert_eq!(count_cause(&j, "cancelled"), 3, "{j}");
}

/// With `--audit-repair` (the default outside these tests), confirmed drift is repaired by
/// the audit itself: a `repaired` row by `audit`, the gate exact again within seconds, the
/// buyers it forgot known again. Drift that comes back after three repairs pauses the sale
/// with an alert in `/metrics` instead of a fourth repair.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn confirmed_drift_is_repaired_by_the_audit_and_a_sale_that_keeps_drifting_is_paused() {
    const STOCK: i64 = 100;
    let db = common::fresh_database(Sql::Postgres).await;
    let secret = common::unique("secret");
    let prefix = common::unique("heal");
    let env = vec![
        ("SECKILL_DATABASE_URL".to_string(), db.clone()),
        ("SECKILL_REDIS_URL".to_string(), REDIS.to_string()),
        ("SECKILL_REDIS_PREFIX".to_string(), prefix.clone()),
        ("SECKILL_TOKEN_SECRET".to_string(), secret.clone()),
        ("SECKILL_AUDIT_EVERY_SECS".to_string(), "1".to_string()),
        ("SECKILL_AUDIT_REPAIR".to_string(), "1".to_string()),
    ];
    let (instances, _workers) = common::storm::instances_and_workers(env.clone()).await;
    let apis: Vec<Api> = instances.iter().map(Server::api).collect();
    let sale: i64 = apis[0].open_sale(STOCK, 1).await.parse().unwrap();
    let bases: Vec<String> = instances.iter().map(|s| s.base.clone()).collect();
    let told = storm_on(
        bases.clone(),
        sale.to_string(),
        tokens(&secret, 1..41),
        Arrival::Crowd(40),
        Arc::default(),
    )
    .await;
    assert_eq!(ok_orders(&told).len(), 40);
    apis[0].check_reconciled(sale).await;
    let keys = SaleKeys::new(&prefix, sale);
    let (_, mut redis) = seckill::app::redis_manager(REDIS).await.unwrap();
    let repaired_rows = |j: &Value| {
        j["rows"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["cause"] == "repaired" && r["actor"] == "audit")
            .count()
    };
    let forgotten = 1_i64;
    for round in 1..=3 {
        // The gate forgets a buyer and gains units nobody returned.
        let _: i64 = redis::cmd("HDEL")
            .arg(&keys.buyers)
            .arg(forgotten)
            .query_async(&mut redis)
            .await
            .unwrap();
        let _: i64 = redis::cmd("HINCRBY")
            .arg(&keys.sale)
            .arg("stock")
            .arg(7)
            .query_async(&mut redis)
            .await
            .unwrap();
        common::eventually(30, "the audit repairs the drift by itself", || async {
            repaired_rows(&apis[0].journal(sale).await) == round
        })
        .await;
        apis[0].check_reconciled(sale).await;
        let again = tokens(&secret, forgotten..forgotten + 1).remove(0).1;
        let answer = apis[1].buy(&again, sale).await;
        assert_eq!(
            answer["code"], "already_purchased",
            "round {round}: {answer}"
        );
    }
    let mut repairs = 0;
    for api in &apis {
        repairs += common::metric(&api.metrics().await, "seckill_reconcile_repairs_total");
    }
    assert_eq!(repairs, 3);
    // A fourth time within ten minutes: paused, not repaired.
    let _: i64 = redis::cmd("HINCRBY")
        .arg(&keys.sale)
        .arg("stock")
        .arg(7)
        .query_async(&mut redis)
        .await
        .unwrap();
    common::eventually(30, "the audit pauses the drifting sale", || async {
        let mut paused = false;
        for api in &apis {
            paused |= api
                .metrics()
                .await
                .contains(&format!("seckill_reconcile_paused{{sale=\"{sale}\"}} 1"));
        }
        paused
    })
    .await;
    let newcomer = tokens(&secret, 900..901).remove(0).1;
    common::eventually(10, "purchases answer paused", || async {
        apis[0].buy(&newcomer, sale).await["code"] == "paused"
    })
    .await;
    assert_eq!(repaired_rows(&apis[0].journal(sale).await), 3);
}
