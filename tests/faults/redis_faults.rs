//! The distributed deployment when Redis comes back different: two instances
//! (`serve --no-writer`) and two `worker`s on PostgreSQL, sharing a Redis of the test's own.
//!
//! - Redis restarted with its data lost while buyers hold orders, everyone retrying at once:
//!   nobody gets a second order, every `ok` is in SQL, and purchases work again within
//!   seconds without restarting anything.
//! - Redis frozen (SIGSTOP) for 10 s mid-storm: no buyer told 503 gets an order from that
//!   attempt, purchases work again within 2 s of Redis answering, and there is no second
//!   outage afterwards.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::storm::{check_sql, first_ok_after, merge, storm_on, Arrival, Told};
use crate::common::{PrivateRedis, Server, Sql, Worker};
use seckill::store::Store;

struct Deployment {
    redis: PrivateRedis,
    instances: Vec<Server>,
    workers: Vec<Worker>,
    store: Store,
    secret: String,
}

impl Deployment {
    async fn start(tag: &str) -> Deployment {
        let port = common::free_port();
        let dir = std::env::temp_dir().join(common::unique(tag));
        std::fs::create_dir_all(&dir).unwrap();
        let redis = PrivateRedis::start(port, &dir);
        let url = redis.url();
        Deployment::start_on(redis, &url, &[]).await
    }

    /// Two instances and two workers on `redis_url` (whose master is `redis`).
    async fn start_on(redis: PrivateRedis, redis_url: &str, extra: &[(&str, &str)]) -> Deployment {
        let db = common::fresh_database(Sql::Postgres).await;
        let secret = common::unique("secret");
        let mut env = vec![
            ("SECKILL_DATABASE_URL".to_string(), db.clone()),
            ("SECKILL_REDIS_URL".to_string(), redis_url.to_string()),
            ("SECKILL_TOKEN_SECRET".to_string(), secret.clone()),
            ("SECKILL_DEV".to_string(), "1".to_string()),
        ];
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let (instances, workers) = common::storm::instances_and_workers(env).await;
        Deployment {
            redis,
            instances,
            workers,
            store: Store::connect(&db, 4).await.unwrap(),
            secret,
        }
    }

    fn tokens(&self, users: std::ops::Range<i64>) -> Vec<(i64, String)> {
        common::storm::tokens(&self.secret, users)
    }

    fn bases(&self) -> Vec<String> {
        self.instances.iter().map(|s| s.base.clone()).collect()
    }

    /// Orders per user in SQL for a sale (live ones).
    /// Redis starts again with nothing: its AOF is gone.
    fn wipe_redis(&mut self) {
        self.redis.kill();
        for entry in std::fs::read_dir(self.redis.dir()).unwrap() {
            let path = entry.unwrap().path();
            let _ = std::fs::remove_dir_all(&path);
            let _ = std::fs::remove_file(&path);
        }
        self.redis.restart();
    }

    async fn live_orders(&self, sale_id: i64) -> HashMap<i64, Vec<i64>> {
        common::storm::live_orders(&self.store, sale_id).await
    }
}

/// `storm_on` this deployment, a crowd of `concurrency` at a time, waited for.
async fn storm(
    d: &Deployment,
    sale: &str,
    tokens: Vec<(i64, String)>,
    concurrency: usize,
) -> HashMap<i64, Told> {
    storm_on(
        d.bases(),
        sale.to_string(),
        tokens,
        Arrival::Crowd(concurrency),
        Arc::default(),
    )
    .await
}

/// Waits until a replica acknowledges the master's writes.
async fn wait_in_sync(master_url: String) {
    common::eventually(20, "the replica is in sync", move || {
        let url = master_url.clone();
        async move {
            let (_, mut conn) = seckill::app::redis_manager(&url).await.unwrap();
            let acked: i64 = redis::cmd("WAIT")
                .arg(1)
                .arg(100)
                .query_async(&mut conn)
                .await
                .unwrap();
            acked >= 1
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_losing_its_data_mid_sale_sells_nobody_twice() {
    let _turn = common::one_at_a_time().await;
    let mut d = Deployment::start("wipe").await;
    const STOCK: i64 = 4000;
    let sale = d.instances[0].api().open_sale(STOCK, 1).await;
    let sale_id: i64 = sale.parse().unwrap();
    let rounds: i64 = common::setting("SECKILL_TEST_WIPE_ROUNDS", 2);

    // 1,800 buyers hold orders, written to SQL.
    let holders = d.tokens(1..1801);
    let mut told = storm(&d, &sale, holders.clone(), 256).await;
    assert!(told.values().all(|t| t.last == "ok"), "everyone bought");
    check_sql(&d.store, sale_id, STOCK, &told).await;

    let mut newcomers = 10_000;
    let mut last_wipe = Instant::now();
    for round in 0..rounds {
        d.wipe_redis();
        let back = Instant::now();

        // Every holder retries at once, with 100 newcomers among them.
        let mut crowd = holders.clone();
        crowd.extend(d.tokens(newcomers..newcomers + 100));
        newcomers += 100;
        let again = storm(&d, &sale, crowd, 1900).await;
        for (user, t) in &again {
            if *user < 10_000 {
                assert_eq!(
                    t.last, "already_purchased",
                    "round {round}: holder {user} was answered {t:?}"
                );
            }
        }
        let first_ok = first_ok_after(&again, back).expect("newcomers bought");
        assert!(
            first_ok - back < Duration::from_secs(10),
            "round {round}: purchases again {:?} after Redis came back",
            first_ok - back
        );
        merge(&mut told, again);
        check_sql(&d.store, sale_id, STOCK, &told).await;
        last_wipe = back;
    }

    // Long after the last loss (past any lease renewal), purchases still work.
    tokio::time::sleep_until((last_wipe + Duration::from_secs(16)).into()).await;
    let late = storm(&d, &sale, d.tokens(90_000..90_050), 50).await;
    assert!(
        late.values().all(|t| t.last == "ok"),
        "purchases 16 s after Redis came back: {:?}",
        late.values().map(|t| &t.last).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_redis_never_turns_a_503_into_an_order() {
    let _turn = common::one_at_a_time().await;
    let d = Deployment::start("freeze").await;
    let api = d.instances[0].api();
    const BUYERS: i64 = 3000;
    let sale = api.open_sale(BUYERS, 1).await;
    let sale_id: i64 = sale.parse().unwrap();

    let started = Arc::new(AtomicUsize::new(0));
    let storm_task = tokio::spawn(storm_on(
        d.bases(),
        sale.clone(),
        d.tokens(1..BUYERS + 1),
        Arrival::Crowd(256),
        started.clone(),
    ));
    while started.load(Ordering::Relaxed) < 400 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let pid = d.redis.pid();
    signal("-STOP", pid);
    tokio::time::sleep(Duration::from_secs(10)).await;
    signal("-CONT", pid);
    let resumed = Instant::now();
    let told: HashMap<i64, Told> = storm_task.await.unwrap();

    let answers: Vec<(Instant, &str)> = told
        .values()
        .flat_map(|t| t.times.iter().map(|(at, code)| (*at, code.as_str())))
        .collect();
    assert!(
        answers
            .iter()
            .any(|(at, code)| *code == "unavailable" && *at < resumed),
        "the freeze was seen"
    );
    let first_ok = first_ok_after(&told, resumed).expect("purchases after the freeze");
    assert!(
        first_ok - resumed < Duration::from_secs(2),
        "purchases again {:?} after Redis answered",
        first_ok - resumed
    );
    let second_outage: Vec<_> = answers
        .iter()
        .filter(|(at, code)| {
            *at > first_ok + Duration::from_millis(500)
                && matches!(*code, "unavailable" | "not_loaded" | "pending")
        })
        .collect();
    assert!(
        second_outage.is_empty(),
        "{} answers unavailable after purchases had resumed",
        second_outage.len()
    );
    check_sql(&d.store, sale_id, BUYERS, &told).await;
    // Pending ids settle: each is an order of its buyer or `not_placed`. An order still
    // queued may wait for a writer to reclaim it (a read lost in the freeze: 10-15 s).
    for (user, t) in told.iter().filter(|(_, t)| !t.pending.is_empty()) {
        let token = d.tokens(*user..*user + 1).remove(0).1;
        for id in &t.pending {
            let give_up = Instant::now() + Duration::from_secs(40);
            loop {
                let r = api.order(&token, id).await;
                let (status, body) = (r.status, r.json());
                let in_sql = d
                    .live_orders(sale_id)
                    .await
                    .get(user)
                    .is_some_and(|ids| ids.contains(id));
                match (status, body["code"].as_str(), body["status"].as_str()) {
                    (200, _, Some("queued")) | (202, Some("pending"), _)
                        if Instant::now() < give_up => {}
                    (200, _, _) => {
                        assert!(in_sql, "{id}: {body}");
                        break;
                    }
                    (404, Some("not_placed"), _) => {
                        assert!(!in_sql, "{id}: {body}");
                        break;
                    }
                    _ => panic!("pending {id} did not settle: {status} {body}"),
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    // And with every pending one settled, the invariants again.
    check_sql(&d.store, sale_id, BUYERS, &told).await;
}

/// An instance and a worker started before their Redis wait for it, and serve once it is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_started_before_redis_come_up_by_themselves() {
    let _turn = common::one_at_a_time().await;
    let port = common::free_port();
    let env = vec![
        (
            "SECKILL_DATABASE_URL".to_string(),
            common::fresh_database(Sql::Postgres).await,
        ),
        (
            "SECKILL_REDIS_URL".to_string(),
            format!("redis://127.0.0.1:{port}/"),
        ),
        ("SECKILL_DEV".to_string(), "1".to_string()),
    ];
    let mut instance = Server::spawn(env.clone(), vec!["serve".into(), "--no-writer".into()]);
    let _worker = common::worker(&env);
    // Longer than the Redis client's own connection retries (about 6 s).
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(
        instance.child.try_wait().unwrap().is_none(),
        "the instance waits for Redis rather than exit"
    );
    let dir = std::env::temp_dir().join(common::unique("late"));
    std::fs::create_dir_all(&dir).unwrap();
    let _redis = PrivateRedis::start(port, &dir);
    instance.wait_ready().await;
    let api = instance.api();
    let sale = api.open_sale(5, 1).await;
    let token = api.login_users(1).await.remove(0);
    let answer = api.buy(&token, &sale).await;
    assert_eq!(answer.status, 200, "{answer}");
    let store = Store::connect(&instance.env[0].1, 2).await.unwrap();
    let sale_id: i64 = sale.parse().unwrap();
    common::eventually(20, "the worker writes the order", || {
        let store = store.clone();
        async move { store.orders_of_sale(sale_id).await.unwrap().len() == 1 }
    })
    .await;
}

/// A Redis that may evict keys when memory runs short (here `allkeys-lru`, with a limit)
/// could drop a sale's buyers mid-sale: the gate refuses it before any purchase, naming the
/// setting; the same Redis set to `noeviction` is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_may_evict_the_gates_keys_is_refused() {
    let port = common::free_port();
    let dir = std::env::temp_dir().join(common::unique("evict"));
    let redis = PrivateRedis::start_with(
        port,
        &dir,
        &["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"],
    );
    let (_, conn) = seckill::app::redis_manager(&redis.url()).await.unwrap();
    let gate = seckill::gate::redis::RedisGate::new(conn.clone(), &common::unique("evict"));
    let refused = gate.prepare().await.unwrap_err().to_string();
    assert!(
        refused.contains("allkeys-lru") && refused.contains("noeviction"),
        "{refused}"
    );
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("noeviction")
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    gate.prepare().await.unwrap();
}

/// With `--redis-durability replica`, `ok` is said only once a replica holds the order:
/// with the replica frozen, buyers hear 202 pending (and their orders settle once it is
/// back); an `aof` level the Redis cannot give refuses to start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_durability_says_ok_only_for_what_a_replica_holds() {
    let _turn = common::one_at_a_time().await;
    let (mport, rport) = (common::free_port(), common::free_port());
    let base_dir = std::env::temp_dir().join(common::unique("repl"));
    let master = PrivateRedis::start_with(mport, &base_dir.join("m"), &["--appendfsync", "no"]);
    let replica = PrivateRedis::start_with(
        rport,
        &base_dir.join("r"),
        &["--replicaof", "127.0.0.1", &mport.to_string()],
    );
    wait_in_sync(master.url()).await;
    let db = common::fresh_database(Sql::Postgres).await;
    let env = |durability: &str| {
        vec![
            ("SECKILL_DATABASE_URL".to_string(), db.clone()),
            ("SECKILL_REDIS_URL".to_string(), master.url()),
            (
                "SECKILL_REDIS_DURABILITY".to_string(),
                durability.to_string(),
            ),
            ("SECKILL_DEV".to_string(), "1".to_string()),
        ]
    };
    // `aof` on a Redis that fsyncs once a second: with WAITAOF (7.2+) each ok waits for
    // the fsync; before 7.2 nothing can wait, and the server refuses to start.
    let mut aof = Server::spawn(env("aof"), vec!["serve".into()]);
    let mut exited = None;
    for _ in 0..100 {
        exited = aof.child.try_wait().unwrap();
        if exited.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let version = std::process::Command::new("redis-server")
        .arg("--version")
        .output()
        .unwrap();
    let version = String::from_utf8_lossy(&version.stdout).to_string();
    if version.contains("v=7.0") || version.contains("v=6.") || version.contains("v=7.1") {
        assert!(
            exited.is_some_and(|s| !s.success()),
            "aof durability without WAITAOF or appendfsync always must refuse to start"
        );
    }
    drop(aof);

    let server = Server::start(env("replica"), vec!["serve".into()]).await;
    let api = server.api();
    let sale = api.open_sale(100, 1).await;
    let sale_id: i64 = sale.parse().unwrap();
    let tokens = api.login_users(40).await;
    for t in &tokens[..10] {
        let answer = api.buy(t, &sale).await;
        assert_eq!(answer.status_code(), (200, "ok".into()), "{answer}");
    }

    signal("-STOP", replica.pid());
    let mut pending = Vec::new();
    for t in &tokens[10..20] {
        let answer = api.buy(t, &sale).await;
        assert_eq!(
            answer.status_code(),
            (202, "pending".into()),
            "no replica holds it: never ok: {answer}"
        );
        pending.push((t.clone(), answer.order_id().unwrap()));
    }
    signal("-CONT", replica.pid());
    let metrics = api.metrics().await;
    assert!(common::metric(&metrics, "seckill_gate_durability_misses_total") >= 10);
    for t in &tokens[20..30] {
        let answer = api.buy(t, &sale).await;
        assert_eq!(answer.status_code(), (200, "ok".into()), "{answer}");
    }
    // The pending ones were accepted by the master: they settle into orders.
    for (token, id) in &pending {
        common::eventually(20, "a pending purchase settles into its order", || async {
            api.order(token, id).await.status == 200
        })
        .await;
    }
    let store = Store::connect(&db, 2).await.unwrap();
    let store2 = store.clone();
    common::eventually(20, "30 orders in SQL", move || {
        let store = store2.clone();
        async move { store.orders_of_sale(sale_id).await.unwrap().len() == 30 }
    })
    .await;
    drop(master);
}

/// A Sentinel of the test's own, watching `master` as `mymaster` (quorum 1).
struct PrivateSentinel {
    child: std::process::Child,
    port: u16,
}

impl PrivateSentinel {
    fn start(master_port: u16, dir: &std::path::Path) -> PrivateSentinel {
        PrivateSentinel::start_with(master_port, dir, 2500, 1)
    }

    /// A down-after of `down_after_ms`: at 1,000 Sentinel may judge a healthy new master
    /// down and fail over again (flapping), which an instance must live through.
    /// `quorum` of the Sentinels watching must agree that the master is down.
    fn start_with(
        master_port: u16,
        dir: &std::path::Path,
        down_after_ms: u64,
        quorum: u32,
    ) -> PrivateSentinel {
        let port = common::free_port();
        std::fs::create_dir_all(dir).unwrap();
        // Sentinel pings each server once a second: a down-after of 1 s left no slack, and
        // CI saw a new master judged down 1.02 s after its promotion (while healthy) and
        // failed over again, to the old master just restarted as its replica.
        let conf = dir.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\n\
                 sentinel monitor mymaster 127.0.0.1 {master_port} {quorum}\n\
                 sentinel down-after-milliseconds mymaster {down_after_ms}\n\
                 sentinel failover-timeout mymaster 4000\n\
                 sentinel parallel-syncs mymaster 1\n",
                dir.display()
            ),
        )
        .unwrap();
        let child = std::process::Command::new("redis-server")
            .arg(&conf)
            .arg("--sentinel")
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server --sentinel");
        std::thread::sleep(Duration::from_millis(500));
        PrivateSentinel { child, port }
    }
}

impl Drop for PrivateSentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn signal(sig: &str, pid: u32) {
    assert!(std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success());
}

/// Sentinel promotes a replica that lagged (frozen while buyers bought) after the master
/// is SIGKILLed mid-storm. With `replica` durability no order answered `ok` is lost, nobody
/// holds two orders, and purchases resume on the new master once it has a replica again
/// (the old master, restarted, which Sentinel turns into one), without restarting seckill.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sentinel_failover_to_a_lagging_replica_loses_no_ok() {
    let _turn = common::one_at_a_time().await;
    let (mport, rport) = (common::free_port(), common::free_port());
    let dir = std::env::temp_dir().join(common::unique("sentinel"));
    // Full resyncs start at once rather than after diskless sync's 5 s wait for more
    // replicas: the new master's first replica is what lets buyers hear `ok` again.
    let quick_sync = ["--repl-diskless-sync-delay", "0"];
    let master = PrivateRedis::start_with(
        mport,
        &dir.join("m"),
        &[&["--appendfsync", "no"][..], &quick_sync].concat(),
    );
    let replica = PrivateRedis::start_with(
        rport,
        &dir.join("r"),
        &[
            &["--replicaof", "127.0.0.1", &mport.to_string()][..],
            &quick_sync,
        ]
        .concat(),
    );
    wait_in_sync(master.url()).await;
    let sentinel = PrivateSentinel::start(mport, &dir.join("s"));
    let url = format!("redis+sentinel://127.0.0.1:{}/mymaster", sentinel.port);
    let master_pid = master.pid();
    let mut d =
        Deployment::start_on(master, &url, &[("SECKILL_REDIS_DURABILITY", "replica")]).await;
    const BUYERS: i64 = 3000;
    let sale = d.instances[0].api().open_sale(BUYERS, 1).await;
    let sale_id: i64 = sale.parse().unwrap();

    let started = Arc::new(AtomicUsize::new(0));
    // Buyers arrive at 125 a second, so that the storm outlasts the failover and the old
    // master's resync as a replica even on a loaded machine (at 200 a second, CI once saw
    // the last buyer arrive before any replica could confirm an order).
    let storm_task = tokio::spawn(storm_on(
        d.bases(),
        sale.clone(),
        d.tokens(1..BUYERS + 1),
        Arrival::Every(Duration::from_millis(8)),
        started.clone(),
    ));
    while started.load(Ordering::Relaxed) < 600 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The replica falls behind (buyers hear pending meanwhile), then the master dies.
    signal("-STOP", replica.pid());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    signal("-KILL", master_pid);
    signal("-CONT", replica.pid());
    let killed = Instant::now();
    // Sentinel promotes the replica. Until the new master has a replica of its own (the
    // old master, started again as one), nothing can confirm an order: buyers hear
    // pending, not ok.
    let sentinel_url = format!("redis://127.0.0.1:{}/", sentinel.port);
    common::eventually(30, "Sentinel promotes the replica", move || {
        let url = sentinel_url.clone();
        async move {
            let (_, mut conn) = seckill::app::redis_manager(&url).await.unwrap();
            let master: Option<(String, u16)> = redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg("mymaster")
                .query_async(&mut conn)
                .await
                .unwrap();
            master.is_some_and(|(_, port)| port == rport)
        }
    })
    .await;
    d.redis
        .restart_with(&["--replicaof", "127.0.0.1", &rport.to_string()]);
    let told: HashMap<i64, Told> = storm_task.await.unwrap();

    let mut finals: HashMap<&str, usize> = HashMap::new();
    for t in told.values() {
        *finals.entry(t.last.as_str()).or_default() += 1;
    }
    eprintln!("final answers: {finals:?}");
    for user in [700, 1500, 2900] {
        let t = &told[&user];
        eprintln!(
            "buyer {user}: {:?}",
            t.times
                .iter()
                .map(|(at, code)| (at.saturating_duration_since(killed).as_millis(), code))
                .collect::<Vec<_>>()
        );
    }
    let first_ok = first_ok_after(&told, killed).expect("purchases on the new master");
    eprintln!("first ok {:?} after the master died", first_ok - killed);
    assert!(
        first_ok - killed < Duration::from_secs(20),
        "purchases again {:?} after the master died",
        first_ok - killed
    );
    let pending: usize = told.values().map(|t| t.pending.len()).sum();
    assert!(
        pending > 0,
        "the lagging replica was seen (buyers heard pending)"
    );
    check_sql(&d.store, sale_id, BUYERS, &told).await;
    drop(replica);
}

/// How many failovers `sentinel_failovers_never_wedge_an_instance` drives, one after
/// another (`SECKILL_TEST_FAILOVER_RUNS`; 20 for the long check).
fn failover_runs() -> usize {
    common::setting("SECKILL_TEST_FAILOVER_RUNS", 1)
}

/// The master Sentinel names now, if it answers.
async fn sentinel_master(sentinel_port: u16) -> Option<u16> {
    let url = format!("redis://127.0.0.1:{sentinel_port}/");
    let (_, mut conn) = seckill::app::redis_manager(&url).await.ok()?;
    let master: Option<(String, u16)> = redis::cmd("SENTINEL")
        .arg("get-master-addr-by-name")
        .arg("mymaster")
        .query_async(&mut conn)
        .await
        .ok()?;
    master.map(|(_, port)| port)
}

/// One instance (its writer inside) on `replica` durability behind three Sentinels with a
/// 1 s down-after, as an operator runs it: 6,000 buyers on 6,000 units; the replica frozen
/// 1 s, the master SIGKILLed mid-storm, the replica thawed and promoted, the old master
/// back as its replica. Then the instance must sell again within 10 s, and every `ok` be
/// in SQL. Repeated `SECKILL_TEST_FAILOVER_RUNS` times; a wedged instance (a rebuild that
/// never ends) fails the run that wedged it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sentinel_failovers_never_wedge_an_instance() {
    let _turn = common::one_at_a_time().await;
    for run in 0..failover_runs() {
        eprintln!("failover run {run}");
        one_failover_run().await;
    }
}

async fn one_failover_run() {
    let (mport, rport) = (common::free_port(), common::free_port());
    let dir = std::env::temp_dir().join(common::unique("failover"));
    let quick_sync = ["--repl-diskless-sync-delay", "0"];
    let aof = ["--appendfsync", "everysec"];
    let mut master =
        PrivateRedis::start_with(mport, &dir.join("m"), &[&aof[..], &quick_sync].concat());
    let replica = PrivateRedis::start_with(
        rport,
        &dir.join("r"),
        &[
            &["--replicaof", "127.0.0.1", &mport.to_string()][..],
            &aof,
            &quick_sync,
        ]
        .concat(),
    );
    wait_in_sync(master.url()).await;
    // Three Sentinels, two of which must agree, as production runs them.
    let sentinels: Vec<PrivateSentinel> = (0..3)
        .map(|i| PrivateSentinel::start_with(mport, &dir.join(format!("s{i}")), 1000, 2))
        .collect();
    let sentinel_list: Vec<String> = sentinels
        .iter()
        .map(|s| format!("127.0.0.1:{}", s.port))
        .collect();
    let db = common::fresh_database(Sql::Postgres).await;
    let secret = common::unique("secret");
    let env = vec![
        ("SECKILL_DATABASE_URL".to_string(), db.clone()),
        (
            "SECKILL_REDIS_URL".to_string(),
            format!("redis+sentinel://{}/mymaster", sentinel_list.join(",")),
        ),
        ("SECKILL_TOKEN_SECRET".to_string(), secret.clone()),
        ("SECKILL_DEV".to_string(), "1".to_string()),
        (
            "SECKILL_REDIS_DURABILITY".to_string(),
            "replica".to_string(),
        ),
    ];
    let server = Server::start(env, vec!["serve".into()]).await;
    let store = Store::connect(&db, 4).await.unwrap();
    // 6,000 buyers in the storm; the rest of the stock for the buyers who come after.
    const BUYERS: i64 = 6000;
    const STOCK: i64 = BUYERS + 400;
    let sale = server.api().open_sale(STOCK, 1).await;
    let sale_id: i64 = sale.parse().unwrap();

    let started = Arc::new(AtomicUsize::new(0));
    let storm_task = tokio::spawn(storm_on(
        vec![server.base.clone()],
        sale.clone(),
        common::storm::tokens(&secret, 1..BUYERS + 1),
        Arrival::Every(Duration::from_millis(3)),
        started.clone(),
    ));
    while started.load(Ordering::Relaxed) < 1500 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    signal("-STOP", replica.pid());
    tokio::time::sleep(Duration::from_secs(1)).await;
    signal("-KILL", master.pid());
    signal("-CONT", replica.pid());
    let port = sentinels[0].port;
    common::eventually(30, "Sentinel promotes the replica", move || async move {
        sentinel_master(port).await == Some(rport)
    })
    .await;
    master.restart_with(
        &[
            &["--replicaof", "127.0.0.1", &rport.to_string()][..],
            &aof,
            &quick_sync,
        ]
        .concat(),
    );
    let mut told: HashMap<i64, Told> = storm_task.await.unwrap();
    let mut finals: HashMap<&str, usize> = HashMap::new();
    for t in told.values() {
        *finals.entry(t.last.as_str()).or_default() += 1;
    }
    eprintln!("the storm's final answers: {finals:?}");

    // Sentinel settled when the master it names has stayed the same for 3 s (a 1 s
    // down-after may have failed over again meanwhile).
    let mut named = sentinel_master(port).await;
    let mut since = Instant::now();
    while since.elapsed() < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = sentinel_master(port).await;
        if now != named {
            (named, since) = (now, Instant::now());
        }
    }
    let settled = Instant::now();
    // Selling again: a new buyer's purchase is `ok` (not 503, not pending) within 10 s.
    let late = common::storm::tokens(&secret, BUYERS + 1..STOCK + 1);
    let quick = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let api = common::Api::with_client(quick, &server.base);
    let mut sold_again = None;
    let mut answers: HashMap<String, usize> = HashMap::new();
    for (user, token) in &late {
        if settled.elapsed() > Duration::from_secs(10) {
            break;
        }
        // Each late buyer is told once; what it was told joins the storm's for the checks.
        let told_now = told.entry(*user).or_default();
        let answer = match api.try_buy(token, &sale).await {
            Ok(r) => {
                let id = r.order_id().and_then(|id| id.parse().ok());
                match (r.code(), id) {
                    ("ok", Some(id)) => told_now.ok.push(id),
                    ("pending", Some(id)) => told_now.pending.push(id),
                    _ => {}
                }
                format!("{} {}", r.status, r.code())
            }
            Err(e) => format!("no answer: {e}"),
        };
        if answer == "200 ok" {
            sold_again = Some(settled.elapsed());
            break;
        }
        *answers.entry(answer).or_default() += 1;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let Some(sold_again) = sold_again else {
        panic!("the instance does not sell 10 s after Sentinel settled (wedged?): {answers:?}");
    };
    eprintln!("selling again {sold_again:?} after Sentinel settled");
    check_sql(&store, sale_id, STOCK, &told).await;
    drop(replica);
    drop(master);
}

/// A stream entry as XRANGE answers it: (id, [(field, value)]).
type StreamEntry = (String, Vec<(String, String)>);

/// Workers hold orders they read before Redis lost its data (stuck on a slow database,
/// then frozen) and write them after the wipe: the rebuilt gate counts each of them once,
/// nobody buys twice, no `ok` is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_frozen_across_a_wipe_lose_nothing_and_sell_nobody_twice() {
    let _turn = common::one_at_a_time().await;
    let mut d = Deployment::start("frozen").await;
    const STOCK: i64 = 4000;
    let sale = d.instances[0].api().open_sale(STOCK, 1).await;
    let sale_id: i64 = sale.parse().unwrap();
    let mut told = storm(&d, &sale, d.tokens(1..1001), 256).await;
    check_sql(&d.store, sale_id, STOCK, &told).await;

    // 500 more buy while the workers are frozen (their orders wait in the stream); then
    // the database stalls (the sale's row is locked) and the workers, thawed, read all 500
    // in one batch and wait inside it; they are frozen again holding it.
    for w in &d.workers {
        signal("-STOP", w.0.id());
    }
    let held = storm(&d, &sale, d.tokens(2001..2501), 256).await;
    assert!(held.values().all(|t| t.last == "ok"));
    let mut lock = d.store.pool().acquire().await.unwrap();
    sqlx::query("BEGIN").execute(&mut *lock).await.unwrap();
    sqlx::query(&format!(
        "SELECT id FROM sales WHERE id = {sale_id} FOR UPDATE"
    ))
    .execute(&mut *lock)
    .await
    .unwrap();
    for w in &d.workers {
        signal("-CONT", w.0.id());
    }
    let stream = seckill::redis_client::keys::SaleKeys::new("seckill", sale_id).stream;
    let redis_url = d.redis.url();
    common::eventually(10, "the writers hold all 500 orders", move || {
        let (url, stream) = (redis_url.clone(), stream.clone());
        async move {
            let (_, mut conn) = seckill::app::redis_manager(&url).await.unwrap();
            let (pending, entries): (redis::Value, Vec<StreamEntry>) = redis::pipe()
                .cmd("XPENDING")
                .arg(&stream)
                .arg("writers")
                .cmd("XRANGE")
                .arg(&stream)
                .arg("-")
                .arg("+")
                .query_async(&mut conn)
                .await
                .unwrap();
            // Every entry is pending with a writer, and they hold the 500 orders (a batch
            // entry holds a script call's orders, ";order_id:user_id:quantity" each).
            let orders: usize = entries
                .iter()
                .map(|(_, f)| match &f[..] {
                    [(k, v)] if k == "b" => v.matches(';').count(),
                    _ => 1,
                })
                .sum();
            let held = redis::Value::Int(entries.len() as i64);
            orders == 500
                && matches!(pending, redis::Value::Array(ref p) if p.first() == Some(&held))
        }
    })
    .await;
    for w in &d.workers {
        signal("-STOP", w.0.id());
    }
    sqlx::query("ROLLBACK").execute(&mut *lock).await.unwrap();
    drop(lock);
    told.extend(held);

    d.wipe_redis();
    let back = Instant::now();
    let workers: Vec<u32> = d.workers.iter().map(|w| w.0.id()).collect();
    let thaw = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(3)).await;
        for pid in workers {
            signal("-CONT", pid);
        }
    });
    let mut crowd = d.tokens(1..1001);
    crowd.extend(d.tokens(2001..2501));
    crowd.extend(d.tokens(10_000..10_100));
    let again = storm(&d, &sale, crowd, 1600).await;
    thaw.await.unwrap();
    for (user, t) in &again {
        if *user < 10_000 {
            assert_eq!(t.last, "already_purchased", "holder {user}: {t:?}");
        }
    }
    let first_ok = first_ok_after(&again, back).expect("newcomers bought");
    assert!(
        first_ok - back < Duration::from_secs(10),
        "purchases again {:?} after Redis came back",
        first_ok - back
    );
    merge(&mut told, again);
    check_sql(&d.store, sale_id, STOCK, &told).await;
}

/// While Redis is away, paying or cancelling an order still waiting to be written answers
/// 503 (it cannot be told), never 404 (it exists).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unwritten_order_is_not_denied_while_redis_is_away() {
    let _turn = common::one_at_a_time().await;
    let port = common::free_port();
    let dir = std::env::temp_dir().join(common::unique("away"));
    let mut redis = PrivateRedis::start(port, &dir);
    let env = vec![
        (
            "SECKILL_DATABASE_URL".to_string(),
            common::fresh_database(Sql::Postgres).await,
        ),
        ("SECKILL_REDIS_URL".to_string(), redis.url()),
        ("SECKILL_DEV".to_string(), "1".to_string()),
    ];
    // No writer anywhere: the order stays in the stream.
    let server = Server::start(env, vec!["serve".into(), "--no-writer".into()]).await;
    let api = server.api();
    let sale = api.open_sale(5, 1).await;
    let token = api.login_users(1).await.remove(0);
    let answer = api.buy(&token, &sale).await;
    assert_eq!(answer.status, 200, "{answer}");
    let order = answer.order_id().unwrap();
    let call = |what: &'static str| {
        let (api, token, order) = (api.clone(), token.clone(), order.clone());
        async move {
            let r = match what {
                "cancel" => api.cancel(&token, &order).await,
                _ => api.pay(&token, &order).await,
            };
            let code = r.code().to_string();
            assert!(r.is_json(), "{r}");
            (r.status, code)
        }
    };
    redis.kill();
    for what in ["cancel", "pay"] {
        let (status, code) = call(what).await;
        assert_eq!((status, code.as_str()), (503, "unavailable"), "{what}");
    }
    redis.restart();
    common::eventually(20, "Redis answers again", || {
        let call = call("cancel");
        async move { call.await == (409, "order_queued".to_string()) }
    })
    .await;
}
