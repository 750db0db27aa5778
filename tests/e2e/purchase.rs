//! End to end, per deployment (embedded SQLite; PostgreSQL or MariaDB without Redis;
//! Redis + PostgreSQL; Redis + MariaDB): the
//! real binary, buyers who logged in through the API, a storm over HTTP with a share of
//! repeat buyers, then the database itself checked. Then a storm cut by SIGKILL of the
//! server, a restart, and the same checks.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::common::{Api, Server, Sql, Worker};
use seckill::store::Store;

struct Deployment {
    name: &'static str,
    server: Server,
    _worker: Option<Worker>,
    store: Store,
}

async fn embedded() -> Deployment {
    let db = common::fresh_database(Sql::Sqlite).await;
    let env = vec![("SECKILL_DATABASE_URL".to_string(), db.clone())];
    let server = Server::start(env, vec!["serve".into()]).await;
    Deployment {
        name: "embedded",
        server,
        _worker: None,
        store: Store::connect(&db, 4).await.unwrap(),
    }
}

/// No Redis but a server database: purchases decided in the server's memory, accepted orders
/// fsynced to the order log folder before `ok`, then written to PostgreSQL or MariaDB.
async fn embedded_on(kind: Sql) -> Deployment {
    let db = common::fresh_database(kind).await;
    let dir = std::env::temp_dir().join(common::unique("orders"));
    let env = vec![
        ("SECKILL_DATABASE_URL".to_string(), db.clone()),
        (
            "SECKILL_ORDER_LOG_DIR".to_string(),
            dir.display().to_string(),
        ),
        // A server database has dev mode off by default; these buyers log in with it.
        ("SECKILL_DEV".to_string(), "1".to_string()),
    ];
    let server = Server::start(env, vec!["serve".into()]).await;
    Deployment {
        name: if kind == Sql::Postgres {
            "embedded+postgres"
        } else {
            "embedded+mariadb"
        },
        server,
        _worker: None,
        store: Store::connect(&db, 4).await.unwrap(),
    }
}

/// Distributed: `serve --no-writer` plus a separate `seckill worker` process.
async fn distributed(kind: Sql) -> Deployment {
    let db = common::fresh_database(kind).await;
    let env = vec![
        ("SECKILL_DATABASE_URL".to_string(), db.clone()),
        ("SECKILL_REDIS_URL".to_string(), common::redis_url()),
        ("SECKILL_REDIS_PREFIX".to_string(), common::unique("e2e")),
        ("SECKILL_DEV".to_string(), "1".to_string()),
    ];
    let server = Server::start(env.clone(), vec!["serve".into(), "--no-writer".into()]).await;
    let worker = common::worker(&env);
    Deployment {
        name: if kind == Sql::Postgres {
            "redis+postgres"
        } else {
            "redis+mariadb"
        },
        server,
        _worker: Some(worker),
        store: Store::connect(&db, 4).await.unwrap(),
    }
}

/// What buyers were told.
#[derive(Default)]
struct Answers {
    /// user -> order ids answered `ok`.
    ok: HashMap<i64, Vec<i64>>,
    by_code: HashMap<String, usize>,
    /// Requests that got no answer (the server was killed under them).
    lost: usize,
}

/// Every token buys once; the first `repeat` tokens fire a second request at the same time.
/// `kill_after_ok`: SIGKILL the server as soon as that many `ok` answers have arrived.
async fn storm(
    d: &mut Deployment,
    sale: &str,
    tokens: &[String],
    repeat: usize,
    kill_after_ok: Option<usize>,
) -> Answers {
    let api = Api::new(&d.server.base);
    let sem = Arc::new(tokio::sync::Semaphore::new(256));
    let ok_count = Arc::new(AtomicUsize::new(0));
    let killed = Arc::new(tokio::sync::Notify::new());
    let mut tasks = Vec::new();
    let requests = tokens.iter().chain(tokens[..repeat].iter());
    for token in requests {
        let (api, sale, token, sem, ok_count, killed) = (
            api.clone(),
            sale.to_string(),
            token.clone(),
            sem.clone(),
            ok_count.clone(),
            killed.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let _permit = sem.acquire().await.unwrap();
            // No answer, or one cut short: the server was killed under it.
            let answer = match api.try_buy(&token, &sale).await {
                Ok(r) if r.is_json() => Some((r.status, r.body)),
                _ => None,
            };
            if let Some((200, _)) = &answer {
                if kill_after_ok == Some(ok_count.fetch_add(1, Ordering::SeqCst) + 1) {
                    killed.notify_one();
                }
            }
            (common::user_of(&token), answer)
        }));
    }
    if kill_after_ok.is_some() {
        killed.notified().await;
        d.server.kill();
    }
    let mut answers = Answers::default();
    for t in tasks {
        let (user, answer) = t.await.unwrap();
        match answer {
            Some((status, body)) => {
                let code = body["code"].as_str().unwrap_or("<no code>").to_string();
                assert!(
                    body["message"].is_string() || code == "ok",
                    "{}: body {body}",
                    d.name
                );
                if code == "ok" {
                    assert_eq!(status, 200);
                    let id: i64 = body["order_id"].as_str().unwrap().parse().unwrap();
                    answers.ok.entry(user).or_default().push(id);
                } else {
                    assert_eq!(status, 409, "{}: {body}", d.name);
                }
                *answers.by_code.entry(code).or_default() += 1;
            }
            None => answers.lost += 1,
        }
    }
    answers
}

/// The database after the order log has drained: exactly `expected` orders, one per user,
/// holding every order answered `ok`, and `sales.stock` equal to what is left.
async fn check_database(
    d: &Deployment,
    sale: &str,
    stock: i64,
    ok_ids: &HashSet<i64>,
    expected: usize,
) {
    let sale_id: i64 = sale.parse().unwrap();
    let store = d.store.clone();
    common::eventually(60, "the order log drains into SQL", || {
        let store = store.clone();
        async move { store.orders_of_sale(sale_id).await.unwrap().len() >= expected }
    })
    .await;
    // Give a straggler time to show up if there were one too many.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let orders = d.store.orders_of_sale(sale_id).await.unwrap();
    assert_eq!(orders.len(), expected, "{}: orders in SQL", d.name);
    let users: HashSet<i64> = orders.iter().map(|o| o.user_id).collect();
    assert_eq!(users.len(), orders.len(), "{}: one order per user", d.name);
    let db_ids: HashSet<i64> = orders.iter().map(|o| o.id).collect();
    assert!(
        ok_ids.is_subset(&db_ids),
        "{}: every ok answer has its order in SQL",
        d.name
    );
    let sale_row = d.store.sale(sale_id).await.unwrap().unwrap();
    let units: i64 = orders.iter().map(|o| o.quantity).sum();
    assert_eq!(
        sale_row.stock,
        stock - units,
        "{}: sales.stock is what is left",
        d.name
    );
    assert!(sale_row.stock >= 0);
}

async fn run_deployment(mut d: Deployment) {
    const BUYERS: usize = 1500;
    const STOCK: i64 = 100;
    let api = d.server.api();
    let tokens = api.login_users(BUYERS).await;

    // 1. A storm: 1500 buyers, a quarter of them twice at once, on a stock of 100.
    let sale = api.open_sale(STOCK, 1).await;
    let answers = storm(&mut d, &sale, &tokens, BUYERS / 4, None).await;
    let ok_ids: HashSet<i64> = answers.ok.values().flatten().copied().collect();
    assert_eq!(
        ok_ids.len(),
        STOCK as usize,
        "{}: exactly the stock gets ok: {:?}",
        d.name,
        answers.by_code
    );
    assert!(
        answers.ok.values().all(|v| v.len() == 1),
        "{}: nobody got two",
        d.name
    );
    assert_eq!(answers.lost, 0);
    assert_eq!(
        answers.by_code.get("sold_out").copied().unwrap_or(0)
            + answers
                .by_code
                .get("already_purchased")
                .copied()
                .unwrap_or(0),
        BUYERS + BUYERS / 4 - STOCK as usize,
        "{}: {:?}",
        d.name,
        answers.by_code
    );
    check_database(&d, &sale, STOCK, &ok_ids, STOCK as usize).await;
    api.check_reconciled(&sale).await;

    // 2. The same storm on a new sale, with the server SIGKILLed mid-storm, then restarted.
    let sale = api.open_sale(STOCK, 1).await;
    let first = storm(&mut d, &sale, &tokens, BUYERS / 4, Some(STOCK as usize / 2)).await;
    d.server.restart().await;
    let after_kill: HashSet<i64> = first.ok.values().flatten().copied().collect();
    assert!(after_kill.len() >= STOCK as usize / 2);
    // Everyone tries again: winners are refused, the rest compete for what is left.
    let second = storm(&mut d, &sale, &tokens, 0, None).await;
    for user in first.ok.keys() {
        assert!(
            !second.ok.contains_key(user),
            "{}: a winner bought again after restart",
            d.name
        );
    }
    let all_ok: HashSet<i64> = after_kill
        .iter()
        .chain(second.ok.values().flatten())
        .copied()
        .collect();
    let winners: HashSet<i64> = first.ok.keys().chain(second.ok.keys()).copied().collect();
    assert!(
        all_ok.len() <= STOCK as usize,
        "{}: no oversell across the restart",
        d.name
    );
    assert_eq!(
        second
            .by_code
            .get("already_purchased")
            .copied()
            .unwrap_or(0)
            + second.by_code.get("sold_out").copied().unwrap_or(0)
            + second.ok.len(),
        BUYERS,
        "{}: {:?}",
        d.name,
        second.by_code
    );
    // Requests cut by the kill may have been accepted without their answer arriving: the
    // database holds every ok order and sells exactly the stock in all.
    check_database(&d, &sale, STOCK, &all_ok, STOCK as usize).await;
    api.check_reconciled(&sale).await;
    let orders = d.store.orders_of_sale(sale.parse().unwrap()).await.unwrap();
    for o in &orders {
        assert!(
            winners.contains(&o.user_id) || first.lost > 0,
            "{}: order of a user never told ok",
            d.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn embedded_storm_and_sigkill() {
    run_deployment(embedded().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_without_redis_storm_and_sigkill() {
    run_deployment(embedded_on(Sql::Postgres).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_without_redis_storm_and_sigkill() {
    run_deployment(embedded_on(Sql::Mariadb).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_postgres_storm_and_sigkill() {
    run_deployment(distributed(Sql::Postgres).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_mariadb_storm_and_sigkill() {
    run_deployment(distributed(Sql::Mariadb).await).await;
}
