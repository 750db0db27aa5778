//! Worker id leases when Redis forgets them: an instance leases its own id again and goes
//! on issuing; an instance that leases an id just after Redis started afresh waits until
//! no earlier holder can still issue from it; a new deployment waits for nothing.

use crate::common;

use std::time::{Duration, Instant};

use seckill::ids::lease_worker_id;

async fn redis() -> seckill::redis_client::RedisConn {
    seckill::app::redis_manager(&common::redis_url())
        .await
        .unwrap()
        .1
}

/// Deletes every key of a prefix, as a Redis restarted without its data would have none.
async fn wipe(prefix: &str) {
    let mut conn = redis().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    if !keys.is_empty() {
        let _: () = redis::cmd("DEL")
            .arg(&keys)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_come_back_after_redis_forgets_them_without_reusing_an_id() {
    let (store, _) = common::fresh_store(common::Sql::Sqlite).await;
    let prefix = common::unique("lease");

    let started = Instant::now();
    let a = lease_worker_id(redis().await, &prefix, store.clone())
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "a new deployment waits for nobody"
    );
    let b = lease_worker_id(redis().await, &prefix, store.clone())
        .await
        .unwrap();
    assert_ne!(a.worker(), b.worker());
    let (wa, wb) = (a.worker(), b.worker());

    // Redis loses everything. Both instances lease their own ids again and go on, each
    // as soon as its renewal finds the lease gone: purchases need ids.
    wipe(&prefix).await;
    let mut issued = std::collections::HashSet::new();
    let until = Instant::now() + Duration::from_secs(4);
    let mut stopped_since: [Option<Instant>; 2] = [None, None];
    let mut longest_stop = Duration::ZERO;
    while Instant::now() < until {
        for (i, ids) in [&a, &b].into_iter().enumerate() {
            match ids.next() {
                Ok(id) => {
                    assert!(issued.insert(id), "id {id} issued twice");
                    if let Some(since) = stopped_since[i].take() {
                        longest_stop = longest_stop.max(since.elapsed());
                    }
                }
                Err(_) => {
                    stopped_since[i].get_or_insert_with(Instant::now);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(a.can_issue() && b.can_issue(), "both issue again");
    // It was a whole renewal interval (1 s) before the lease was taken at once.
    assert!(
        longest_stop < Duration::from_millis(500),
        "ids stopped for {longest_stop:?}"
    );
    assert_eq!(
        (a.worker(), b.worker()),
        (wa, wb),
        "each took its own id back"
    );

    // A newcomer right after another loss must not issue until the earlier holders of any
    // id it takes have surely stopped (5 s after Redis started afresh).
    wipe(&prefix).await;
    let started = Instant::now();
    let c = lease_worker_id(redis().await, &prefix, store.clone())
        .await
        .unwrap();
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(3500),
        "issued after {waited:?} into a fresh epoch"
    );
    assert!(c.next().is_ok());
    assert!(waited < Duration::from_secs(8), "{waited:?}");
}

/// Soon after Redis started afresh a lease asks the database whether this deployment had
/// holders before; the database away at that moment (a reset connection, a restart) is a
/// failure start-up retries, not a reason to stop: CI's nemesis once stopped both order
/// workers this way, and no order was written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_finds_the_database_away_fails_in_a_way_start_up_retries() {
    let (store, _) = common::fresh_store(common::Sql::Sqlite).await;
    // A prefix Redis has never seen: its epoch begins now, so the lease asks the database.
    let prefix = common::unique("lease");
    store.halt();
    let failed = lease_worker_id(redis().await, &prefix, store.clone()).await;
    let Err(e) = failed else {
        panic!("a lease into a young epoch must ask the database, which is away");
    };
    assert!(
        matches!(e, seckill::ids::IdError::Store(_)),
        "the database's failure: {e}"
    );
    let e = seckill::app::AppError::from(e);
    assert!(e.is_transient(), "start-up gives up on: {e}");
    wipe(&prefix).await;
}
