//! The distributed deployment behind seeded fault proxies (`common::proxy`), Jepsen's
//! nemesis the model: two instances and two workers reach their Redis and their PostgreSQL
//! database only through proxies that delay, stall, reset and refuse connections, and now
//! and then cut one off for a while, on a schedule drawn from a seed, while 3,000 buyers
//! storm a sale over 15 s. Then the faults stop and the invariants of docs/ARCHITECTURE.md
//! are checked: every `ok` is in SQL, no order was made of an attempt answered anything but
//! `ok` or `pending` (a 503 is never executed later), nobody holds two, SQL's stock adds
//! up, the gate equals SQL, and the deployment sells again. The seed is printed;
//! `SECKILL_TEST_NEMESIS_SEED` replays a schedule, `SECKILL_TEST_NEMESIS_RUNS` runs that
//! many seeds in a row.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::common::proxy::{FaultProxy, Faults};
use crate::common::storm::{check_sql, storm_on, Arrival, Told};
use crate::common::{PrivateRedis, Sql};
use seckill::store::Store;

fn runs() -> u64 {
    common::setting("SECKILL_TEST_NEMESIS_RUNS", 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_nemesis_between_the_processes_and_their_servers_breaks_no_invariant() {
    let _turn = common::one_at_a_time().await;
    let first: u64 = common::setting("SECKILL_TEST_NEMESIS_SEED", rand::random());
    for run in 0..runs() {
        let seed = first.wrapping_add(run);
        println!("SECKILL_TEST_NEMESIS_SEED={seed}");
        one_run(seed).await;
    }
}

/// One fault at a time, drawn from the seed.
#[derive(Debug, Clone, Copy)]
enum Strike {
    /// Faults per chunk and connection on this proxy for a while.
    Noisy {
        redis: bool,
        faults: Faults,
    },
    /// This proxy cut off, then healed.
    Partition {
        redis: bool,
        ms: u64,
    },
    /// Every connection through this proxy reset.
    ResetAll {
        redis: bool,
    },
    Quiet,
}

fn draw(rng: &mut StdRng) -> Strike {
    let redis = rng.random_bool(0.6);
    match rng.random_range(0..10) {
        0..=3 => Strike::Noisy {
            redis,
            faults: Faults {
                delay: rng.random_range(0.0..0.3),
                delay_ms: (1, 400),
                stall: rng.random_range(0.0..0.02),
                stall_ms: (500, 4_000),
                reset: rng.random_range(0.0..0.02),
                refuse: rng.random_range(0.0..0.3),
            },
        },
        4..=5 => Strike::Partition {
            redis,
            ms: rng.random_range(300..3_000),
        },
        6..=7 => Strike::ResetAll { redis },
        _ => Strike::Quiet,
    }
}

/// Strikes one fault after another until `stop`, on the proxies; all healed after.
async fn nemesis(
    seed: u64,
    redis: Arc<FaultProxy>,
    db: Arc<FaultProxy>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Vec<String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut log = Vec::new();
    while !*stop.borrow() {
        let strike = draw(&mut rng);
        let hold = Duration::from_millis(rng.random_range(200..1_500));
        let proxy = |on_redis: bool| if on_redis { &redis } else { &db };
        log.push(format!("{strike:?} for {hold:?}"));
        match strike {
            Strike::Noisy { redis: r, faults } => {
                proxy(r).set(faults);
                tokio::time::sleep(hold).await;
                proxy(r).set(Faults::NONE);
            }
            Strike::Partition { redis: r, ms } => {
                proxy(r).partition();
                tokio::time::sleep(Duration::from_millis(ms)).await;
                proxy(r).heal();
            }
            Strike::ResetAll { redis: r } => proxy(r).reset_all(),
            Strike::Quiet => tokio::time::sleep(hold).await,
        }
    }
    for p in [&redis, &db] {
        p.set(Faults::NONE);
        p.heal();
    }
    log
}

async fn one_run(seed: u64) {
    let redis_dir = std::env::temp_dir().join(common::unique("nemesis"));
    let redis = PrivateRedis::start(common::free_port(), &redis_dir);
    let redis_proxy = Arc::new(FaultProxy::start(redis.port, seed).await);
    let db = common::fresh_database(Sql::Postgres).await;
    let pg_port: u16 = db
        .split("127.0.0.1:")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .and_then(|p| p.parse().ok())
        .expect("a PostgreSQL URL on 127.0.0.1");
    let db_proxy = Arc::new(FaultProxy::start(pg_port, seed ^ 0xdb).await);
    let db_through_proxy = db.replace(
        &format!("127.0.0.1:{pg_port}"),
        &format!("127.0.0.1:{}", db_proxy.port),
    );
    let secret = common::unique("secret");
    let env = common::settings(&[
        ("SECKILL_DATABASE_URL", &db_through_proxy),
        (
            "SECKILL_REDIS_URL",
            &format!("redis://127.0.0.1:{}/", redis_proxy.port),
        ),
        ("SECKILL_TOKEN_SECRET", &secret),
        ("SECKILL_DEV", "1"),
    ]);
    let (instances, mut workers) = common::storm::instances_and_workers(env).await;
    let api = instances[0].api();
    const BUYERS: i64 = 3_000;
    const STOCK: i64 = 4_000;
    let sale = api.open_sale(STOCK, 1).await;
    let sale_id: i64 = sale.parse().unwrap();
    let bases: Vec<String> = instances.iter().map(|s| s.base.clone()).collect();

    let began = std::time::Instant::now();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let strikes = tokio::spawn(nemesis(
        seed,
        redis_proxy.clone(),
        db_proxy.clone(),
        stop_rx,
    ));
    let told: HashMap<i64, Told> = storm_on(
        bases.clone(),
        sale.clone(),
        common::storm::tokens(&secret, 1..BUYERS + 1),
        // Over about 15 s, so that the storm meets many strikes.
        Arrival::Every(Duration::from_millis(5)),
        Arc::new(AtomicUsize::new(0)),
    )
    .await;
    stop_tx.send(true).unwrap();
    let strikes = strikes.await.unwrap();
    let report = format!(
        "SECKILL_TEST_NEMESIS_SEED={seed}: storm {:?}; redis proxy {}; database proxy {}; strikes: {strikes:?}",
        began.elapsed(),
        redis_proxy.struck(),
        db_proxy.struck()
    );
    println!("{report}");

    // Faults over: once the writers have caught up (nothing unwritten, the gate equal to
    // SQL), every answer must hold.
    let audited = tokio::spawn({
        let api = api.clone();
        async move { api.check_reconciled(sale_id).await }
    })
    .await;
    let states: Vec<String> = workers.iter_mut().map(|w| w.state()).collect();
    assert!(
        audited.is_ok(),
        "the gate never matched SQL: {report}; workers: {states:?}"
    );
    println!("reconciled {:?} after the storm began", began.elapsed());
    let store = Store::connect(&db, 4).await.unwrap();
    let checked = tokio::spawn({
        let (store, told) = (store.clone(), told.clone());
        async move { check_sql(&store, sale_id, STOCK, &told).await }
    })
    .await;
    assert!(checked.is_ok(), "{report}");
    let ok = told.values().filter(|t| !t.ok.is_empty()).count() as i64;
    let finals = told
        .values()
        .filter(|t| t.last == "ok" || t.last == "already_purchased")
        .count() as i64;
    assert_eq!(finals, BUYERS, "every buyer ends with one order: {report}");
    assert!(ok > BUYERS / 2, "most buyers heard ok ({ok}): {report}");
    // And the deployment sells again, through both instances.
    for (i, base) in bases.iter().enumerate() {
        let user = BUYERS + 1 + i as i64;
        let token = common::storm::tokens(&secret, user..user + 1).remove(0).1;
        let r = api.at(base).buy(&token, &sale).await;
        assert_eq!(r.code(), "ok", "a new buyer after the faults: {report}");
    }
}
