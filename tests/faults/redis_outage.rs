//! Redis dies mid-storm. The test runs a Redis of its own (AOF, fsync always, its own port
//! and folder), SIGKILLs it while buyers storm the server, and restarts it. While it is
//! down, the server answers 503 `unavailable` at once (the circuit opens); afterwards,
//! purchases resume. At the end, in the database: no oversell, nobody over the limit, and
//! every order answered `ok` is there. A buyer whose script ran just before the kill never
//! got its reply (503); retrying, they hear `already_purchased`, and their order is there too.

use crate::common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{PrivateRedis, Server, Sql};
use seckill::store::Store;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_storm_survives_redis_dying_without_oversell_or_loss() {
    let _turn = common::one_at_a_time().await;
    let port = common::free_port();
    let dir = std::env::temp_dir().join(common::unique("redis"));
    std::fs::create_dir_all(&dir).unwrap();
    let mut redis = PrivateRedis::start(port, &dir);
    let db = common::fresh_database(Sql::Postgres).await;
    let env = vec![
        ("SECKILL_DATABASE_URL".to_string(), db.clone()),
        (
            "SECKILL_REDIS_URL".to_string(),
            format!("redis://127.0.0.1:{port}/"),
        ),
        ("SECKILL_DEV".to_string(), "1".to_string()),
    ];
    let server = Server::start(env, vec!["serve".into()]).await;
    let api = server.api();
    const STOCK: i64 = 600;
    let sale = api.open_sale(STOCK, 1).await;
    let tokens = Arc::new(api.login_users(1200).await);

    // The storm: every buyer tries until answered ok, sold_out or already_purchased.
    let done = Arc::new(AtomicUsize::new(0));
    let unavailable = Arc::new(AtomicUsize::new(0));
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..32)
        .map(|_| {
            let (api, sale, tokens, done, unavailable, next) = (
                api.clone(),
                sale.clone(),
                tokens.clone(),
                done.clone(),
                unavailable.clone(),
                next.clone(),
            );
            tokio::spawn(async move {
                let mut oks = Vec::new();
                let mut ambiguous = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(token) = tokens.get(i) else {
                        return (oks, ambiguous);
                    };
                    // Told `pending` or never answered: the attempt may have bought.
                    // Told 503: it did not (and must not later).
                    let mut saw_ambiguous = false;
                    for _attempt in 0..200 {
                        let Ok(r) = api.try_buy(token, &sale).await else {
                            saw_ambiguous = true;
                            continue;
                        };
                        let (status, body) = (r.status, r.body);
                        assert!(status != 500, "never a 500: {body}");
                        match body["code"].as_str() {
                            Some("ok") => {
                                oks.push((
                                    common::user_of(token),
                                    body["order_id"].as_str().unwrap().parse::<i64>().unwrap(),
                                ));
                                break;
                            }
                            Some("sold_out") => break,
                            Some("already_purchased") => {
                                assert!(
                                    saw_ambiguous,
                                    "already_purchased without an earlier ok or pending (a 503 that bought?): {body}"
                                );
                                ambiguous.push(common::user_of(token));
                                break;
                            }
                            Some("unavailable") | Some("not_loaded") => {
                                unavailable.fetch_add(1, Ordering::Relaxed);
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                            Some("pending") => {
                                assert_eq!(status, 202, "{body}");
                                saw_ambiguous = true;
                                unavailable.fetch_add(1, Ordering::Relaxed);
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                            other => panic!("unexpected answer {status} {other:?}: {body}"),
                        }
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();

    // Kill Redis well before the sell-out, keep it down for 4 s (longer than the gate's 2 s
    // response timeout, so that failures pile up and the circuit opens), bring it back.
    while done.load(Ordering::Relaxed) < 150 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    redis.kill();
    tokio::time::sleep(Duration::from_secs(4)).await;
    redis.restart();

    let mut oks = Vec::new();
    let mut ambiguous: HashSet<i64> = HashSet::new();
    for w in workers {
        let (o, a) = w.await.unwrap();
        oks.extend(o);
        ambiguous.extend(a);
    }
    assert!(
        unavailable.load(Ordering::Relaxed) > 0,
        "the outage was seen"
    );
    let metrics = api.metrics().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("seckill_gate_circuit_opened_total ") && !l.ends_with(" 0")),
        "the circuit opened: {metrics}"
    );

    let store = Store::connect(&db, 2).await.unwrap();
    let sale_id: i64 = sale.parse().unwrap();
    let ok_ids: HashSet<i64> = oks.iter().map(|(_, id)| *id).collect();
    let ok_users: HashSet<i64> = oks.iter().map(|(user, _)| *user).collect();
    assert_eq!(
        ok_ids.len() + ambiguous.len(),
        STOCK as usize,
        "after the outage the stock still sells out exactly"
    );
    let store2 = store.clone();
    common::eventually(30, "the order log drains", || {
        let store = store2.clone();
        async move { store.orders_of_sale(sale_id).await.unwrap().len() as i64 >= STOCK }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let orders = store.orders_of_sale(sale_id).await.unwrap();
    let db_ids: HashSet<i64> = orders.iter().map(|o| o.id).collect();
    let users: HashSet<i64> = orders.iter().map(|o| o.user_id).collect();
    assert_eq!(orders.len() as i64, STOCK, "no oversell");
    assert_eq!(users.len(), orders.len(), "one order per user");
    assert!(ok_ids.is_subset(&db_ids), "every ok is in SQL");
    assert!(
        users
            .iter()
            .all(|u| ok_users.contains(u) || ambiguous.contains(u)),
        "no order for a buyer never told ok or already_purchased"
    );
    assert_eq!(store.sale(sale_id).await.unwrap().unwrap().stock, 0);
}
