//! The order database fails over under a storm: a PostgreSQL cluster of the test's own
//! (three nodes under Patroni, etcd, HAProxy's one read-write address: `common::patroni`),
//! a Redis of its own, two instances with their writers and a separate `worker`. The
//! leader's machine is SIGKILLed mid-storm at a moment drawn from a printed seed; with
//! asynchronous replication its WAL senders are stalled first, so that the writers commit
//! batches the promoted replica never receives (what a failover loses in most
//! installations).
//!
//! - Every `ok` is in SQL afterwards, each buyer holds at most one order, stock adds up,
//!   the gate's remaining stock equals SQL's, no dead letter, no repair of the gate.
//! - With asynchronous replication, the orders the promoted replica lacked were written
//!   again from the failover window (the test fails without it: run it with
//!   `SECKILL_DB_FAILOVER_WINDOW_SECS=0` passed to the processes to see).
//! - SQL takes orders again within 10 s of the new primary taking writes.
//! - Payments, cancellations and expiries settled while the replication was stalled keep,
//!   after the failover, the state each buyer was told; a callback repeated by the provider
//!   settles once; returned units are sold again exactly once.
//!
//! `SECKILL_TEST_DB_FAILOVER_RUNS` runs each storm test that many times in a row (1 by
//! default; 10 for the long check); `SECKILL_TEST_DB_FAILOVER_SEED` replays one run.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::common::mariadb::MariaDbPair;
use crate::common::patroni::{PatroniCluster, Replication};
use crate::common::storm::{check_sql, storm_on, Arrival, Told};
use crate::common::{Api, PrivateRedis, Server, Worker};

use seckill::lifecycle::payment::SimulatedProvider;
use seckill::store::Store;

const PAYMENT_SECRET: &str = "test-payment-secret";

fn runs() -> usize {
    common::setting("SECKILL_TEST_DB_FAILOVER_RUNS", 1)
}

/// The seed of a run: `SECKILL_TEST_DB_FAILOVER_SEED` when given, else a fresh one.
fn seed() -> u64 {
    common::setting("SECKILL_TEST_DB_FAILOVER_SEED", rand::random())
}

/// The database a deployment fails over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// PostgreSQL under Patroni, with this replication.
    Postgres(Replication),
    /// A MariaDB primary and replica, semi-synchronous or not.
    MariaDb { semi_sync: bool },
}

impl Kind {
    /// Whether a commit may return before a replica has it (then the test stalls the
    /// replication before the primary dies, and expects the window to write orders again).
    fn loses_commits(self) -> bool {
        matches!(
            self,
            Kind::Postgres(Replication::Asynchronous) | Kind::MariaDb { .. }
        )
    }

    /// How long the replication is stalled before the primary dies. A semi-synchronous
    /// primary holds its commits for up to a second before it falls back to asynchronous
    /// replication (`rpl_semi_sync_master_timeout`), so its stall lasts over a second
    /// longer: only commits made after the fallback can be lost.
    fn stall(self, rng: &mut impl rand::Rng) -> Duration {
        match self {
            Kind::MariaDb { semi_sync: true } => {
                Duration::from_millis(rng.random_range(2200..3500))
            }
            kind if kind.loses_commits() => Duration::from_millis(rng.random_range(1000..2500)),
            _ => Duration::ZERO,
        }
    }
}

enum Database {
    Patroni(PatroniCluster),
    MariaDb(MariaDbPair),
}

impl Database {
    async fn start(kind: Kind) -> (Database, String) {
        match kind {
            Kind::Postgres(replication) => {
                let cluster = PatroniCluster::start(replication).await;
                let db = cluster.create_database().await;
                (Database::Patroni(cluster), db)
            }
            Kind::MariaDb { semi_sync } => {
                let pair = MariaDbPair::start(semi_sync).await;
                let db = pair.create_database().await;
                (Database::MariaDb(pair), db)
            }
        }
    }

    /// The primary stops sending its changes to the replicas: what it commits from now on
    /// is on its disk only.
    async fn stall_replication(&mut self) {
        match self {
            Database::Patroni(cluster) => {
                // A standby may be reconnecting at that moment: its sender is stalled once
                // it is back.
                let began = Instant::now();
                let leader = cluster.leader().await;
                let mut streams = cluster.stall_replication(leader);
                while streams == 0 && began.elapsed() < Duration::from_secs(10) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    streams = cluster.stall_replication(leader);
                }
                assert!(
                    streams > 0,
                    "the leader streams to its replicas: {}",
                    cluster.members().await
                );
            }
            Database::MariaDb(pair) => pair.stall_replication().await,
        }
    }

    /// The primary's machine killed and a replica promoted; returns when the new primary
    /// takes writes through the clients' address.
    async fn fail_over(&mut self) -> Instant {
        match self {
            Database::Patroni(cluster) => {
                let leader = cluster.leader().await;
                cluster.kill_machine(leader);
                let (new_leader, at) = cluster.wait_new_leader(leader).await;
                eprintln!("node {leader} killed; node {new_leader} leads");
                at
            }
            Database::MariaDb(pair) => {
                pair.fail_over().await;
                Instant::now()
            }
        }
    }

    /// [`Database::stall_replication`] for `stall` (none when zero), then
    /// [`Database::fail_over`].
    async fn stall_and_fail_over(&mut self, stall: Duration) -> Instant {
        if !stall.is_zero() {
            self.stall_replication().await;
            tokio::time::sleep(stall).await;
        }
        self.fail_over().await
    }
}

/// A deployment on a database that fails over: distributed (Redis of its own, two `serve`
/// instances with their writers inside, and a `worker`), or one embedded server.
struct Deployment {
    database: Database,
    redis: Option<PrivateRedis>,
    instances: Vec<Server>,
    workers: Vec<Worker>,
    db: String,
    secret: String,
    prefix: String,
}

/// How the processes are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    Distributed,
    /// One server deciding purchases in memory, its order log (and failover window) in a
    /// folder of its own.
    Embedded,
}

impl Deployment {
    async fn start(kind: Kind, extra: &[(&str, &str)]) -> Deployment {
        Deployment::start_as(kind, Layout::Distributed, extra).await
    }

    async fn start_as(kind: Kind, layout: Layout, extra: &[(&str, &str)]) -> Deployment {
        let (database, db) = Database::start(kind).await;
        let secret = common::unique("secret");
        let prefix = common::unique("dbf");
        let mut env: Vec<(String, String)> = vec![
            ("SECKILL_DATABASE_URL".into(), db.clone()),
            ("SECKILL_REDIS_PREFIX".into(), prefix.clone()),
            ("SECKILL_TOKEN_SECRET".into(), secret.clone()),
            // The audit on, repairs on (the product's default): it must not rebuild a gate
            // that holds orders the failover took from SQL.
            ("SECKILL_AUDIT_EVERY_SECS".into(), "1".into()),
            ("SECKILL_AUDIT_REPAIR".into(), "true".into()),
        ];
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let mut redis = None;
        let (servers, workers) = match layout {
            Layout::Distributed => {
                let redis_port = common::free_port();
                redis = Some(PrivateRedis::start(
                    redis_port,
                    &std::env::temp_dir().join(common::unique("redis")),
                ));
                env.push((
                    "SECKILL_REDIS_URL".into(),
                    format!("redis://127.0.0.1:{redis_port}/"),
                ));
                (2, 1)
            }
            Layout::Embedded => {
                let dir = std::env::temp_dir().join(common::unique("orders"));
                env.push(("SECKILL_ORDER_LOG_DIR".into(), dir.display().to_string()));
                (1, 0)
            }
        };
        let mut instances = Vec::new();
        for _ in 0..servers {
            instances.push(Server::start(env.clone(), vec!["serve".into()]).await);
        }
        let workers = (0..workers).map(|_| common::worker(&env)).collect();
        Deployment {
            database,
            redis,
            instances,
            workers,
            db,
            secret,
            prefix,
        }
    }

    /// Buyers 1..=`buyers` of the deployment storm `sale`, one arriving every `every`, each
    /// until a final answer; what each was told.
    fn storm(
        &self,
        sale: i64,
        buyers: i64,
        every: Duration,
    ) -> tokio::task::JoinHandle<HashMap<i64, Told>> {
        tokio::spawn(storm_on(
            self.bases(),
            sale.to_string(),
            self.tokens(1..=buyers),
            Arrival::Every(every),
            Arc::default(),
        ))
    }

    fn bases(&self) -> Vec<String> {
        self.instances.iter().map(|s| s.base.clone()).collect()
    }

    fn api(&self, i: usize) -> Api {
        self.instances[i].api()
    }

    fn tokens(&self, users: std::ops::RangeInclusive<i64>) -> Vec<(i64, String)> {
        common::storm::tokens(&self.secret, *users.start()..*users.end() + 1)
    }

    async fn store(&self) -> Store {
        Store::connect(&self.db, 4).await.unwrap()
    }

    /// The processes' logs, read now.
    fn logs(&self) -> String {
        let mut text = String::new();
        for path in self
            .instances
            .iter()
            .map(|s| &s.log)
            .chain(self.workers.iter().map(|w| &w.1))
        {
            text.push_str(&std::fs::read_to_string(path).unwrap_or_default());
        }
        text
    }

    /// Orders the processes wrote again from the failover window because SQL lacked them,
    /// as their logs say.
    fn orders_written_again(&self) -> u64 {
        self.logs()
            .lines()
            .filter_map(|l| l.split("orders_sql_lacked=").nth(1))
            .filter_map(|rest| rest.split(' ').next()?.parse::<u64>().ok())
            .sum()
    }

    /// Orders set aside as unwritable, by every instance's metrics and the sale's
    /// dead-letter stream in Redis.
    async fn dead_letters(&self, sale: i64) -> u64 {
        let mut dead = 0;
        for i in 0..self.instances.len() {
            let metrics = self.api(i).metrics().await;
            dead += common::metric(&metrics, "seckill_writer_dead_letters_total");
            dead += common::metric(&metrics, "seckill_writer_refused_over_limit_total");
        }
        let Some(redis) = &self.redis else {
            return dead;
        };
        let keys = seckill::redis_client::keys::SaleKeys::new(&self.prefix, sale);
        let url = format!("redis://127.0.0.1:{}/", redis.port);
        let (_, mut redis) = seckill::app::redis_manager(&url).await.unwrap();
        let stream: u64 = redis::cmd("XLEN")
            .arg(&keys.dead)
            .query_async(&mut redis)
            .await
            .unwrap();
        dead + stream
    }

    async fn repairs(&self, sale: i64) -> usize {
        let journal = self.api(0).journal(sale).await;
        journal["rows"].as_array().map_or(0, |rows| {
            rows.iter().filter(|r| r["cause"] == "repaired").count()
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_asynchronous_failover_mid_storm_loses_no_acknowledged_order() {
    let _turn = common::one_at_a_time().await;
    for run in 1..=runs() {
        failover_mid_storm(Kind::Postgres(Replication::Asynchronous), run).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_synchronous_failover_mid_storm_loses_no_acknowledged_order() {
    let _turn = common::one_at_a_time().await;
    for run in 1..=runs() {
        failover_mid_storm(Kind::Postgres(Replication::Synchronous), run).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_mariadb_failover_mid_storm_loses_no_acknowledged_order() {
    let _turn = common::one_at_a_time().await;
    for run in 1..=runs() {
        failover_mid_storm(Kind::MariaDb { semi_sync: false }, run).await;
        failover_mid_storm(Kind::MariaDb { semi_sync: true }, run).await;
    }
}

async fn failover_mid_storm(kind: Kind, run: usize) {
    failover_mid_storm_as(kind, Layout::Distributed, run).await
}

async fn failover_mid_storm_as(kind: Kind, layout: Layout, run: usize) {
    const STOCK: i64 = 3000;
    const BUYERS: i64 = 4000;
    let seed = seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let kill_after = Duration::from_millis(rng.random_range(2000..5000));
    let stall = kind.stall(&mut rng);
    eprintln!(
        "{kind:?} failover ({layout:?}), run {run}: seed {seed} (SECKILL_TEST_DB_FAILOVER_SEED), \
         primary killed {kill_after:?} into the storm, replication stalled {stall:?} before"
    );
    let mut d = Deployment::start_as(kind, layout, &[]).await;
    let sale: i64 = d.api(0).open_sale(STOCK, 1).await.parse().unwrap();

    // Buyers keep arriving for 8 s; the purchases are decided by the gate throughout.
    let storm = d.storm(sale, BUYERS, Duration::from_millis(2));
    let began = Instant::now();
    tokio::time::sleep(kill_after.saturating_sub(stall)).await;
    let stalled = began.elapsed();
    let writable_at = d.database.stall_and_fail_over(stall).await;
    let writable_wall = seckill::clock::wall_ms();
    eprintln!(
        "replication stalled at {stalled:?}; the new primary took writes at {:?}",
        writable_at.duration_since(began)
    );
    let told: HashMap<i64, Told> = storm.await.unwrap();

    let store = d.store().await;
    check_sql(&store, sale, STOCK, &told).await;
    let oks = told.values().filter(|t| t.last == "ok").count() as i64;
    assert!(oks <= STOCK);
    let sql_stock = store.sale(sale).await.unwrap().unwrap().stock;
    common::eventually(30, "the gate's remaining stock equals SQL's", || async {
        d.api(d.instances.len() - 1).remaining(sale).await == sql_stock
    })
    .await;
    if told.values().any(|t| t.last == "sold_out") {
        assert_eq!(sql_stock, 0, "sold_out while units remained");
    }
    // SQL took orders again soon after the new primary took writes.
    let first_written_after = store
        .orders_of_sale(sale)
        .await
        .unwrap()
        .iter()
        .map(|o| o.written_at)
        .filter(|at| *at >= writable_wall - 5_000)
        .min();
    if let Some(at) = first_written_after {
        assert!(
            at - writable_wall < 10_000,
            "orders reached the new primary {} ms after it took writes",
            at - writable_wall
        );
    }
    assert_eq!(d.dead_letters(sale).await, 0, "no dead letter");
    assert_eq!(d.repairs(sale).await, 0, "the audit repaired nothing");
    let again = d.orders_written_again();
    eprintln!("orders written again from the failover window: {again}");
    if kind.loses_commits() {
        assert!(
            again > 0,
            "the stalled replication lost committed batches, which the window wrote again"
        );
    }
    // Sold out, and nobody sells a unit of an acknowledged order again: a late buyer is
    // told so, on both instances.
    let late = d.tokens(BUYERS + 1..=BUYERS + 1).remove(0).1;
    for i in 0..d.instances.len() {
        let answer = d.api(i).buy(&late, sale).await;
        if sql_stock == 0 {
            assert_eq!(answer["code"], "sold_out", "{answer}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_embedded_server_on_postgresql_loses_nothing_in_an_asynchronous_failover() {
    let _turn = common::one_at_a_time().await;
    for run in 1..=runs() {
        let kind = Kind::Postgres(Replication::Asynchronous);
        failover_mid_storm_as(kind, Layout::Embedded, run).await;
    }
}

/// What an operator and the machines do to a cluster in a row, mid-storm: a planned
/// switchover to a replica, then the new leader's machine killed after its replication
/// stalled, the dead node brought back (Patroni rewinds it into a replica), and a
/// switchover to it. Each is a new timeline: the window is written again each time, and
/// only the failover loses anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn switchovers_and_a_failover_in_a_row_lose_no_acknowledged_order() {
    let _turn = common::one_at_a_time().await;
    const STOCK: i64 = 5000;
    const BUYERS: i64 = 6000;
    let seed = seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let stall = Duration::from_millis(rng.random_range(1000..2500));
    eprintln!("seed {seed} (SECKILL_TEST_DB_FAILOVER_SEED), replication stalled {stall:?}");
    let mut d = Deployment::start(Kind::Postgres(Replication::Asynchronous), &[]).await;
    let sale: i64 = d.api(0).open_sale(STOCK, 1).await.parse().unwrap();
    // Buyers keep arriving for about 30 s.
    let storm = d.storm(sale, BUYERS, Duration::from_millis(5));
    let Database::Patroni(cluster) = &mut d.database else {
        unreachable!("a Patroni cluster")
    };
    tokio::time::sleep(Duration::from_millis(rng.random_range(1000..3000))).await;
    let first = cluster.leader().await;
    let second = (first + 1) % 3;
    cluster.switchover(first, second).await;
    eprintln!("switched over from node {first} to node {second}");
    tokio::time::sleep(Duration::from_millis(rng.random_range(1000..3000))).await;
    assert!(cluster.stall_replication(second) > 0);
    tokio::time::sleep(stall).await;
    cluster.kill_machine(second);
    let (third, _) = cluster.wait_new_leader(second).await;
    eprintln!("node {second} killed; node {third} leads");
    cluster.restart(second);
    cluster.wait_healthy().await;
    cluster.switchover(third, second).await;
    eprintln!("switched over from node {third} back to node {second}");
    let told: HashMap<i64, Told> = storm.await.unwrap();
    let store = d.store().await;
    check_sql(&store, sale, STOCK, &told).await;
    assert_eq!(d.dead_letters(sale).await, 0, "no dead letter");
    assert_eq!(d.repairs(sale).await, 0, "the audit repaired nothing");
    let sql_stock = store.sale(sale).await.unwrap().unwrap().stock;
    common::eventually(30, "the gate's remaining stock equals SQL's", || async {
        d.api(1).remaining(sale).await == sql_stock
    })
    .await;
    eprintln!(
        "orders written again from the failover window: {}",
        d.orders_written_again()
    );
}

/// What a buyer was told of their order just before the failover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    Paid,
    Cancelled,
    Expired,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn payments_cancellations_and_expiries_keep_the_state_their_buyers_were_told() {
    let _turn = common::one_at_a_time().await;
    const STOCK: i64 = 60;
    let seed = seed();
    eprintln!("seed {seed} (SECKILL_TEST_DB_FAILOVER_SEED)");
    let mut d = Deployment::start(
        Kind::Postgres(Replication::Asynchronous),
        &[
            ("SECKILL_PAYMENT_PROVIDER", "simulated"),
            ("SECKILL_PAYMENT_SECRET", PAYMENT_SECRET),
        ],
    )
    .await;
    let api = d.api(0);
    // Orders expire 12 s after they are written: the last third of the buyers let theirs
    // lapse while the replication is stalled.
    let sale: i64 = api
        .open_sale_with(STOCK, 1, &json!({ "payment_window_secs": 12 }))
        .await
        .parse()
        .unwrap();
    let buyers = d.tokens(1..=STOCK);
    let mut orders: Vec<(i64, String, String)> = Vec::new();
    for (user, token) in &buyers {
        let answer = api.buy(token, sale).await;
        let order = answer.order_id().unwrap_or_else(|| panic!("{answer}"));
        orders.push((*user, token.clone(), order));
    }
    for (_, token, order) in &orders {
        api.written(token, order).await;
    }
    let written_at = Instant::now();
    // Payment intents opened before the stall (they reach the replicas).
    let mut intents = HashMap::new();
    for (user, token, order) in orders.iter().take(20) {
        let intent = api.pay(token, order).await.expect(200);
        intents.insert(*user, intent["intent_id"].as_str().unwrap().to_string());
    }
    d.database.stall_replication().await;
    // Now, on the leader's disk only: 20 payments, 15 cancellations, and, 12 s after
    // their writing, 25 expiries.
    let provider = SimulatedProvider::new(PAYMENT_SECRET);
    let mut seen: HashMap<i64, Seen> = HashMap::new();
    let mut callbacks = Vec::new();
    for (user, _, _) in orders.iter().take(20) {
        let intent = &intents[user];
        let now = seckill::clock::wall_ms() / 1000;
        let body =
            format!(r#"{{"intent_id":"{intent}","status":"paid","provider_ref":"r{user}"}}"#);
        let signature = provider.sign(now, body.as_bytes());
        let answer = api.notify(Some(now), Some(&signature), &body).await;
        assert_eq!(answer.status, 200, "{answer}");
        callbacks.push((body, signature, now));
        seen.insert(*user, Seen::Paid);
    }
    for (user, token, order) in orders.iter().skip(20).take(15) {
        let answer = api.cancel(token, order).await;
        assert_eq!(answer.status, 200, "{answer}");
        seen.insert(*user, Seen::Cancelled);
    }
    let lapse = Duration::from_secs(13).saturating_sub(written_at.elapsed());
    tokio::time::sleep(lapse).await;
    for (user, token, order) in orders.iter().skip(35) {
        common::eventually(10, "the unpaid order expires", || async {
            api.order(token, order).await["status"] == "expired"
        })
        .await;
        seen.insert(*user, Seen::Expired);
    }
    // The returned units are in the gate again: 40 of them.
    common::eventually(10, "the returned units are back in the gate", || async {
        api.remaining(sale).await == 40
    })
    .await;
    d.database.fail_over().await;

    // Each order as its buyer was told.
    for (user, token, order) in &orders {
        let want = match seen[user] {
            Seen::Paid => "paid",
            Seen::Cancelled => "cancelled",
            Seen::Expired => "expired",
        };
        common::eventually(
            30,
            "the order keeps the state its buyer was told",
            || async { d.api(1).order(token, order).await["status"] == want },
        )
        .await;
    }
    // The provider repeats a callback: settled once, nothing moves. (A provider retries
    // what is answered 503, as during the failover.)
    for (body, signature, at) in callbacks.iter().take(5) {
        let mut answer = api.notify(Some(*at), Some(signature), body).await;
        for _ in 0..20 {
            if answer.status != 503 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            answer = api.notify(Some(*at), Some(signature), body).await;
        }
        assert_eq!(
            (answer.status, answer["result"].as_str()),
            (200, Some("duplicate")),
            "{answer}"
        );
    }
    // The 40 units that came back are sold again, exactly once.
    let store = d.store().await;
    let again = storm_on(
        d.bases(),
        sale.to_string(),
        d.tokens(101..=160),
        Arrival::Crowd(16),
        Arc::default(),
    )
    .await;
    let resold = again.values().filter(|t| t.last == "ok").count();
    assert_eq!(resold, 40, "each returned unit sold once");
    common::eventually(30, "the resold orders are written", || async {
        store.sale(sale).await.unwrap().unwrap().stock == 0
    })
    .await;
    let live = store
        .orders_of_sale(sale)
        .await
        .unwrap()
        .iter()
        .filter(|o| matches!(o.status.as_str(), "pending_payment" | "paid"))
        .count();
    assert_eq!(live as i64, STOCK, "paid + resold = the stock");
    assert_eq!(d.dead_letters(sale).await, 0, "no dead letter");
    assert_eq!(d.repairs(sale).await, 0, "the audit repaired nothing");
}
