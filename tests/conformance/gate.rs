//! One conformance suite for every gate: the embedded memory gate (with its local order
//! log drained into SQLite by the real writer), the Redis Lua gate (on the local Redis,
//! under a key prefix of its own), and the SQL gates (lock and conditional) on SQLite,
//! PostgreSQL and MariaDB. Cases about loading a gate run on the gates that are loaded.

use crate::common;

use std::collections::HashSet;
use std::sync::Arc;

use seckill::gate::memory::MemoryGate;
use seckill::gate::redis::RedisGate;
use seckill::gate::sql::SqlGate;
use seckill::gate::{Gate, Purchase, Rejection, Release, Released, RetryKey, SaleLoad, Verdict};
use seckill::model::Sale;
use seckill::orderlog::local;
use seckill::store::SqlDecision;
use seckill::store::Store;
use seckill::writer::{Writer, WriterStats};

struct Harness {
    name: String,
    gate: Arc<dyn Gate>,
    store: Store,
    /// False for the SQL gates: their state is SQL itself, nothing is loaded.
    loadable: bool,
    _stop: Option<tokio::sync::watch::Sender<bool>>,
}

impl Harness {
    async fn memory() -> Harness {
        let (store, _) = common::fresh_store(common::Sql::Sqlite).await;
        let (log, reader) = local::channel();
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let writer = Writer {
            log: Arc::new(reader),
            store: store.clone(),
            // The memory gate needs no confirmation of written orders.
            gate: Arc::new(seckill::gate::memory::MemoryGate::new(
                seckill::orderlog::local::channel().0,
            )),
            batch_max: 500,
            stats: Arc::new(WriterStats::default()),
            fenced: false,
            turn: Default::default(),
            linger: std::time::Duration::ZERO,
        };
        tokio::spawn(writer.run(stop_rx));
        Harness {
            name: "memory".into(),
            gate: Arc::new(MemoryGate::new(log)),
            store,
            loadable: true,
            _stop: Some(stop),
        }
    }

    async fn redis() -> Harness {
        let (store, _) = common::fresh_store(common::Sql::Sqlite).await;
        let (_, conn) = seckill::app::redis_manager(&common::redis_url())
            .await
            .unwrap();
        let gate = RedisGate::new(conn, &common::unique("gate"));
        gate.prepare().await.unwrap();
        Harness {
            name: "redis".into(),
            gate: Arc::new(gate),
            store,
            loadable: true,
            _stop: None,
        }
    }

    async fn sql(kind: common::Sql, how: SqlDecision) -> Harness {
        let (store, _) = common::fresh_store(kind).await;
        Harness {
            name: format!("{how:?} on {kind:?}"),
            gate: Arc::new(SqlGate::new(store.clone(), how, 12)),
            store,
            loadable: false,
            _stop: None,
        }
    }

    /// The gates that are loaded from SQL ahead of the sale.
    async fn loadable() -> Vec<Harness> {
        vec![Harness::memory().await, Harness::redis().await]
    }

    async fn all() -> Vec<Harness> {
        let mut all = Harness::loadable().await;
        for kind in common::ALL_SQL {
            for how in [SqlDecision::Lock, SqlDecision::Conditional] {
                all.push(Harness::sql(kind, how).await);
            }
        }
        all
    }

    async fn pause(&self, sale_id: i64, paused: bool) {
        self.store.set_paused(sale_id, paused).await.unwrap();
        self.gate.set_paused(sale_id, paused).await.unwrap();
    }

    /// The SQL gates on PostgreSQL and MariaDB take turns across this file's tests: eight
    /// storms of thousands of transactions at once on the one shared server of each kind
    /// left a pool waiting a full minute for a connection in one CI-like run of five.
    async fn turn(&self) -> Option<tokio::sync::MutexGuard<'static, ()>> {
        static SERVER_DATABASES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        let on_a_server = self.name.contains("Postgres") || self.name.contains("Mariadb");
        if on_a_server {
            Some(SERVER_DATABASES.lock().await)
        } else {
            None
        }
    }

    /// Puts a sale in SQL (the memory gate's writer needs it) and opens it in the gate.
    async fn open(&self, sale: &Sale, buyers: Vec<(i64, i64)>) {
        let started = std::time::Instant::now();
        self.store
            .create_sale(sale)
            .await
            .unwrap_or_else(|e| panic!("{}: {e} after {:?}", self.name, started.elapsed()));
        let load = SaleLoad {
            sale: sale.clone(),
            remaining: sale.stock,
            buyers,
            released: vec![],
            counted: vec![],
            segment: 0,
            moves: Vec::new(),
        };
        assert_eq!(
            self.gate.load(&load).await.unwrap(),
            self.loadable,
            "{}: first load loads",
            self.name
        );
    }

    async fn buy(&self, sale_id: i64, user_id: i64, quantity: i64) -> Verdict {
        self.gate
            .purchase(Purchase {
                sale_id,
                user_id,
                quantity,
                order_id: common::next_id(),
                token: None,
                segments: 1,
                after_move: false,
                retry_key: None,
            })
            .await
            .unwrap_or_else(|e| panic!("{}: gate error {e}", self.name))
    }
}

fn accepted(v: &Verdict) -> bool {
    matches!(v, Verdict::Accepted { .. })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousands_of_buyers_get_exactly_the_stock_one_each() {
    for h in Harness::all().await {
        let _turn = h.turn().await;
        let sale = common::sale(common::next_id(), 50, 1);
        h.open(&sale, vec![]).await;
        let gate = h.gate.clone();
        let tasks: Vec<_> = (0..3000)
            .map(|user| {
                let gate = gate.clone();
                tokio::spawn(async move {
                    let v = gate
                        .purchase(Purchase {
                            sale_id: sale.id,
                            user_id: 1_000_000 + user,
                            quantity: 1,
                            order_id: common::next_id(),
                            token: None,
                            segments: 1,
                            after_move: false,
                            retry_key: None,
                        })
                        .await
                        .unwrap();
                    (1_000_000 + user, v)
                })
            })
            .collect();
        let mut winners = HashSet::new();
        let mut sold_out = 0;
        for t in tasks {
            let (user, v) = t.await.unwrap();
            match v {
                Verdict::Accepted { .. } => assert!(winners.insert(user)),
                Verdict::Rejected(Rejection::SoldOut { remaining: 0 }) => sold_out += 1,
                other => panic!("{}: unexpected {other:?}", h.name),
            }
        }
        assert_eq!(winners.len(), 50, "{}: exactly the stock is sold", h.name);
        assert_eq!(sold_out, 2950, "{}", h.name);
        if h.name == "redis" {
            use std::sync::atomic::Ordering;
            let calls = seckill::gate::batch::CALLS.load(Ordering::Relaxed);
            let attempts = seckill::gate::batch::ATTEMPTS.load(Ordering::Relaxed);
            assert!(
                attempts > calls,
                "3,000 concurrent attempts share script calls: {attempts} in {calls}"
            );
        }
        let stock = h.gate.stock(sale.id).await.unwrap().unwrap();
        assert_eq!((stock.remaining, stock.buyers), (0, 50), "{}", h.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_user_from_many_tasks_gets_one() {
    for h in Harness::all().await {
        let _turn = h.turn().await;
        let sale = common::sale(common::next_id(), 100, 1);
        h.open(&sale, vec![]).await;
        let tasks: Vec<_> = (0..300)
            .map(|_| {
                let gate = h.gate.clone();
                tokio::spawn(async move {
                    gate.purchase(Purchase {
                        sale_id: sale.id,
                        user_id: 77,
                        quantity: 1,
                        order_id: common::next_id(),
                        token: None,
                        segments: 1,
                        after_move: false,
                        retry_key: None,
                    })
                    .await
                    .unwrap()
                })
            })
            .collect();
        let mut ok = 0;
        for t in tasks {
            match t.await.unwrap() {
                Verdict::Accepted { .. } => ok += 1,
                Verdict::Rejected(Rejection::AlreadyPurchased) => {}
                other => panic!("{}: unexpected {other:?}", h.name),
            }
        }
        assert_eq!(ok, 1, "{}", h.name);
        assert_eq!(
            h.gate.stock(sale.id).await.unwrap().unwrap().remaining,
            99,
            "{}",
            h.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn quantities_respect_the_per_user_limit_and_the_stock() {
    for h in Harness::all().await {
        let _turn = h.turn().await;
        let sale = common::sale(common::next_id(), 5, 3);
        h.open(&sale, vec![]).await;
        // A new buyer asking for more than the limit holds nothing afterwards and is not
        // counted as a buyer (Redis takes the units first and hands them back).
        assert_eq!(
            h.buy(sale.id, 9, 4).await,
            Verdict::Rejected(Rejection::OverLimit { held: 0 }),
            "{}: 0 + 4 > 3",
            h.name
        );
        let counts = h.gate.stock(sale.id).await.unwrap().unwrap();
        assert_eq!((counts.remaining, counts.buyers), (5, 0), "{}", h.name);
        assert!(accepted(&h.buy(sale.id, 1, 2).await), "{}", h.name);
        assert_eq!(
            h.buy(sale.id, 1, 2).await,
            Verdict::Rejected(Rejection::OverLimit { held: 2 }),
            "{}: 2 + 2 > 3",
            h.name
        );
        assert!(
            accepted(&h.buy(sale.id, 9, 1).await),
            "{}: nothing held after the refusal",
            h.name
        );
        assert!(
            accepted(&h.buy(sale.id, 1, 1).await),
            "{}: 2 + 1 = 3",
            h.name
        );
        assert_eq!(
            h.buy(sale.id, 1, 1).await,
            Verdict::Rejected(Rejection::AlreadyPurchased),
            "{}",
            h.name
        );
        assert_eq!(
            h.buy(sale.id, 2, 2).await,
            Verdict::Rejected(Rejection::SoldOut { remaining: 1 }),
            "{}: 2 asked, 1 left",
            h.name
        );
        assert_eq!(
            h.buy(sale.id, 2, 1).await,
            Verdict::Accepted { remaining: 0 },
            "{}",
            h.name
        );
        assert_eq!(
            h.buy(sale.id, 3, 1).await,
            Verdict::Rejected(Rejection::SoldOut { remaining: 0 }),
            "{}",
            h.name
        );
        // Once sold out, a buyer at the limit is still told so.
        assert_eq!(
            h.buy(sale.id, 1, 1).await,
            Verdict::Rejected(Rejection::AlreadyPurchased),
            "{}",
            h.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn window_pause_and_unknown_sales_are_refused_without_taking_stock() {
    for h in Harness::all().await {
        let _turn = h.turn().await;
        let now = seckill::clock::wall_ms();
        let mut upcoming = common::sale(common::next_id(), 5, 1);
        // An hour ahead: on a loaded box a minute ran out before the attempt (CI).
        upcoming.begins_at = now + 3_600_000;
        upcoming.ends_at = now + 7_200_000;
        h.open(&upcoming, vec![]).await;
        assert_eq!(
            h.buy(upcoming.id, 1, 1).await,
            Verdict::Rejected(Rejection::NotStarted),
            "{}",
            h.name
        );

        let mut ended = common::sale(common::next_id(), 5, 1);
        ended.begins_at = now - 120_000;
        ended.ends_at = now - 60_000;
        h.open(&ended, vec![]).await;
        assert_eq!(
            h.buy(ended.id, 1, 1).await,
            Verdict::Rejected(Rejection::Ended),
            "{}",
            h.name
        );

        let open = common::sale(common::next_id(), 5, 1);
        h.open(&open, vec![]).await;
        h.pause(open.id, true).await;
        assert_eq!(
            h.buy(open.id, 1, 1).await,
            Verdict::Rejected(Rejection::Paused),
            "{}",
            h.name
        );
        h.pause(open.id, false).await;
        assert!(accepted(&h.buy(open.id, 1, 1).await), "{}", h.name);

        assert_eq!(
            h.buy(common::next_id(), 1, 1).await,
            Verdict::Rejected(Rejection::NotLoaded),
            "{}",
            h.name
        );
        for s in [&upcoming, &ended] {
            assert_eq!(
                h.gate.stock(s.id).await.unwrap().unwrap().remaining,
                5,
                "{}",
                h.name
            );
        }
        // Pausing a sale the gate does not hold must not make it look loaded.
        if h.loadable {
            let absent = common::next_id();
            h.gate.set_paused(absent, true).await.unwrap();
            assert!(!h.gate.is_loaded(absent).await.unwrap(), "{}", h.name);
        }
    }
}

/// A readiness probe asks about every open sale in one call: each answer is its own sale's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_sales_are_asked_whether_loaded_in_one_call_each_answer_its_own() {
    for h in Harness::loadable().await {
        let (first, second) = (
            common::sale(common::next_id(), 5, 1),
            common::sale(common::next_id(), 5, 1),
        );
        h.open(&first, vec![]).await;
        h.open(&second, vec![]).await;
        let absent = common::next_id();
        let ids = [first.id, absent, second.id, absent];
        let loaded: Vec<bool> = h
            .gate
            .are_loaded(&ids)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(loaded, [true, false, true, false], "{}", h.name);
        for (id, loaded) in ids.iter().zip(loaded) {
            assert_eq!(h.gate.is_loaded(*id).await.unwrap(), loaded, "{}", h.name);
        }
        assert!(h.gate.are_loaded(&[]).await.is_empty(), "{}", h.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_load_never_overwrites_live_stock_and_buyers_are_remembered() {
    for h in Harness::loadable().await {
        let sale = common::sale(common::next_id(), 10, 1);
        h.open(&sale, vec![(500, 1)]).await;
        assert_eq!(
            h.buy(sale.id, 500, 1).await,
            Verdict::Rejected(Rejection::AlreadyPurchased),
            "{}",
            h.name
        );
        assert!(accepted(&h.buy(sale.id, 501, 1).await), "{}", h.name);
        let again = SaleLoad {
            sale: sale.clone(),
            remaining: 10,
            buyers: vec![],
            released: vec![],
            counted: vec![],
            segment: 0,
            moves: Vec::new(),
        };
        assert!(
            !h.gate.load(&again).await.unwrap(),
            "{}: already loaded",
            h.name
        );
        assert_eq!(
            h.gate.stock(sale.id).await.unwrap().unwrap().remaining,
            9,
            "{}",
            h.name
        );
        assert_eq!(
            h.buy(sale.id, 501, 1).await,
            Verdict::Rejected(Rejection::AlreadyPurchased),
            "{}",
            h.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_buyer_lists_load_through_staging() {
    for h in Harness::loadable().await {
        let sale = common::sale(common::next_id(), 10, 1);
        let buyers: Vec<(i64, i64)> = (1..=2500).map(|u| (u, 1)).collect();
        h.open(&sale, buyers).await;
        assert_eq!(
            h.gate.stock(sale.id).await.unwrap().unwrap().buyers,
            2500,
            "{}",
            h.name
        );
        assert_eq!(
            h.buy(sale.id, 2500, 1).await,
            Verdict::Rejected(Rejection::AlreadyPurchased),
            "{}",
            h.name
        );
        assert!(accepted(&h.buy(sale.id, 2501, 1).await), "{}", h.name);
    }
}

/// The memory gate and the Redis gate with the same per-user rate, and what they need: a
/// SQLite store for the sales and a writer draining the memory gate's log.
struct RatedGates {
    store: Store,
    gates: Vec<(&'static str, Arc<dyn Gate>)>,
    /// The Redis gate's key prefix and a connection to look at its keys.
    prefix: String,
    conn: seckill::redis_client::RedisConn,
    _stop: tokio::sync::watch::Sender<bool>,
}

impl RatedGates {
    async fn start(rate: seckill::gate::RateLimit) -> Self {
        let (store, _) = common::fresh_store(common::Sql::Sqlite).await;
        let (log, reader) = local::channel();
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let writer = Writer {
            log: Arc::new(reader),
            store: store.clone(),
            // The memory gate needs no confirmation of written orders.
            gate: Arc::new(MemoryGate::new(local::channel().0)),
            batch_max: 100,
            stats: Arc::new(WriterStats::default()),
            fenced: false,
            turn: Default::default(),
            linger: std::time::Duration::ZERO,
        };
        tokio::spawn(writer.run(stop_rx));
        let (_, conn) = seckill::app::redis_manager(&common::redis_url())
            .await
            .unwrap();
        let prefix = common::unique("rate");
        let redis = RedisGate::new(conn.clone(), &prefix).with_rate_limit(rate);
        redis.prepare().await.unwrap();
        let gates: Vec<(&str, Arc<dyn Gate>)> = vec![
            (
                "memory",
                Arc::new(MemoryGate::new(log).with_rate_limit(rate)),
            ),
            ("redis", Arc::new(redis)),
        ];
        RatedGates {
            store,
            gates,
            prefix,
            conn,
            _stop: stop,
        }
    }

    /// Creates the sale in SQL and loads it, its whole stock left, into `gate`.
    async fn load(&self, gate: &Arc<dyn Gate>, sale: &Sale) {
        self.store.create_sale(sale).await.unwrap();
        let load = SaleLoad {
            sale: sale.clone(),
            remaining: sale.initial_stock,
            buyers: vec![],
            released: vec![],
            counted: vec![],
            segment: 0,
            moves: Vec::new(),
        };
        gate.load(&load).await.unwrap();
    }
}

/// One unit for `user_id`, no purchase token, an unsegmented sale: the rate tests' attempt.
fn one_unit(sale_id: i64, user_id: i64, order_id: i64) -> Purchase {
    Purchase {
        sale_id,
        user_id,
        quantity: 1,
        order_id,
        token: None,
        segments: 1,
        after_move: false,
        retry_key: None,
    }
}

/// A purchase made with an `Idempotency-Key` is made once: its retries, dozens at once,
/// are answered with its order and take nothing, even once the sale has sold out; the key
/// with another quantity is refused; a refusal records nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_purchase_retried_with_its_idempotency_key_is_made_once() {
    for h in Harness::all().await {
        let _turn = h.turn().await;
        // A limit of 3: without the key, each retry could buy another unit.
        let sale = common::sale(common::next_id(), 10, 3);
        h.open(&sale, vec![]).await;
        let with_key = |key: &str, quantity| Purchase {
            quantity,
            retry_key: Some(RetryKey::of(key)),
            ..one_unit(sale.id, 42, common::next_id())
        };
        let tasks: Vec<_> = (0..50)
            .map(|_| {
                let (gate, attempt) = (h.gate.clone(), with_key("retry-1", 1));
                tokio::spawn(async move { (attempt.order_id, gate.purchase(attempt).await) })
            })
            .collect();
        let (mut bought, mut again) = (None, Vec::new());
        for t in tasks {
            match t.await.unwrap() {
                (id, Ok(Verdict::Accepted { .. })) => {
                    assert!(bought.replace(id).is_none(), "{}: bought twice", h.name)
                }
                (_, Ok(Verdict::Again { order_id })) => again.push(order_id),
                (_, other) => panic!("{}: unexpected {other:?}", h.name),
            }
        }
        let bought = bought.unwrap_or_else(|| panic!("{}: one attempt buys", h.name));
        assert_eq!(again.len(), 49, "{}", h.name);
        assert!(again.iter().all(|o| *o == bought), "{}: {again:?}", h.name);
        let remaining = |h: &Harness| {
            let gate = h.gate.clone();
            async move { gate.stock(sale.id).await.unwrap().unwrap().remaining }
        };
        assert_eq!(remaining(&h).await, 9, "{}: one unit taken", h.name);

        let reused = h.gate.purchase(with_key("retry-1", 2)).await.unwrap();
        assert_eq!(
            reused,
            Verdict::Rejected(Rejection::RetryKeyReused),
            "{}",
            h.name
        );
        // Another key is another purchase, within the limit; then the buyer holds it all.
        let second = h.gate.purchase(with_key("retry-2", 2)).await.unwrap();
        assert!(accepted(&second), "{}: {second:?}", h.name);
        let refused = h.gate.purchase(with_key("retry-3", 1)).await.unwrap();
        assert_eq!(
            refused,
            Verdict::Rejected(Rejection::AlreadyPurchased),
            "{}",
            h.name
        );
        // Not recorded: the same key with another quantity is decided, not called reused.
        let refused = h.gate.purchase(with_key("retry-3", 2)).await.unwrap();
        assert_eq!(
            refused,
            Verdict::Rejected(Rejection::AlreadyPurchased),
            "{}",
            h.name
        );

        for buyer in 100..107 {
            assert!(accepted(&h.buy(sale.id, buyer, 1).await), "{}", h.name);
        }
        assert_eq!(remaining(&h).await, 0, "{}", h.name);
        let late = h.gate.purchase(with_key("retry-1", 1)).await.unwrap();
        assert_eq!(late, Verdict::Again { order_id: bought }, "{}", h.name);
        assert_eq!(remaining(&h).await, 0, "{}", h.name);
    }
}

/// A SQL gate's claim on a purchase's key left by an attempt that died (its process
/// killed between claim and purchase) is taken over after its lease: the retry buys, with
/// its token, and its record answers the next retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sql_gates_claim_left_by_a_dead_attempt_is_taken_over() {
    use seckill::store::idempotency::{purchase_record, CLAIM_LEASE_MS};
    for kind in common::ALL_SQL {
        for how in [SqlDecision::Lock, SqlDecision::Conditional] {
            let h = Harness::sql(kind, how).await;
            let sale = common::sale(common::next_id(), 5, 3);
            h.open(&sale, vec![]).await;
            let key = RetryKey::of("press-1");
            let (caller, idem_key) = purchase_record(sale.id, 42, key);
            let dead_at = seckill::clock::wall_ms() - CLAIM_LEASE_MS - 1;
            h.store
                .claim_idempotency_key(&caller, &idem_key, "1", dead_at)
                .await
                .unwrap();
            let attempt = || Purchase {
                retry_key: Some(key),
                token: Some(seckill::gate::Spend {
                    nonce: 77,
                    expires_at: seckill::clock::wall_ms() + 60_000,
                }),
                ..one_unit(sale.id, 42, common::next_id())
            };
            let first = attempt();
            let verdict = h.gate.purchase(first).await.unwrap();
            assert!(accepted(&verdict), "{}: {verdict:?}", h.name);
            let again = h.gate.purchase(attempt()).await.unwrap();
            assert_eq!(
                again,
                Verdict::Again {
                    order_id: first.order_id
                },
                "{}",
                h.name
            );
            assert_eq!(h.store.orders_of_sale(sale.id).await.unwrap().len(), 1);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_firing_requests_is_throttled_before_touching_the_stock() {
    use seckill::gate::RateLimit;
    let rate = RateLimit {
        per_sec: 2.0,
        burst: 5,
    };
    let rated = RatedGates::start(rate).await;
    for (name, gate) in &rated.gates {
        let mut sale = common::sale(common::next_id(), 10, 1);
        sale.begins_at = seckill::clock::wall_ms() + 60_000; // not open yet: pre-open spam is throttled too
        rated.load(gate, &sale).await;
        let mut verdicts = Vec::new();
        for _ in 0..12 {
            verdicts.push(
                gate.purchase(one_unit(sale.id, 42, common::next_id()))
                    .await
                    .unwrap(),
            );
        }
        let limited = verdicts
            .iter()
            .filter(|v| matches!(v, Verdict::Rejected(Rejection::RateLimited { .. })))
            .count();
        assert_eq!(
            limited, 7,
            "{name}: a burst of 5, then throttled: {verdicts:?}"
        );
        assert!(
            verdicts[..5]
                .iter()
                .all(|v| *v == Verdict::Rejected(Rejection::NotStarted)),
            "{name}: {verdicts:?}"
        );
        if let Verdict::Rejected(Rejection::RateLimited { retry_after_ms }) = verdicts[11] {
            assert!(
                (1..=500).contains(&retry_after_ms),
                "{name}: {retry_after_ms}"
            );
        }
        // Another user is not affected, and the stock was never touched.
        let other = gate
            .purchase(one_unit(sale.id, 43, common::next_id()))
            .await
            .unwrap();
        assert_eq!(other, Verdict::Rejected(Rejection::NotStarted), "{name}");
        assert_eq!(
            gate.stock(sale.id).await.unwrap().unwrap().remaining,
            10,
            "{name}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buyer_at_the_limit_hears_so_and_keeps_no_place_in_the_rate() {
    use seckill::gate::RateLimit;
    // A burst of 3: without the exemption, the fourth quick attempt would wait. One
    // attempt in ten seconds, so that no pause of a busy machine refills the burst.
    let rate = RateLimit {
        per_sec: 0.1,
        burst: 3,
    };
    let rated = RatedGates::start(rate).await;
    let mut conn = rated.conn.clone();
    for (name, gate) in &rated.gates {
        // One unit a buyer: user 42 reaches the limit with the first purchase. Three a
        // buyer: user 43 stays below it and is throttled as before.
        let one = common::sale(common::next_id(), 10, 1);
        let three = common::sale(common::next_id(), 10, 3);
        let cycled = common::sale(common::next_id(), 10, 1);
        for sale in [&one, &three, &cycled] {
            rated.load(gate, sale).await;
        }
        let buy_as = |sale_id: i64, user_id: i64, order_id: i64| {
            let gate = gate.clone();
            async move {
                gate.purchase(one_unit(sale_id, user_id, order_id))
                    .await
                    .unwrap()
            }
        };
        let buy = |sale_id: i64, user_id: i64| buy_as(sale_id, user_id, common::next_id());
        let mut at_limit = Vec::new();
        for _ in 0..8 {
            at_limit.push(buy(one.id, 42).await);
        }
        assert_eq!(at_limit[0], Verdict::Accepted { remaining: 9 }, "{name}");
        assert!(
            at_limit[1..]
                .iter()
                .all(|v| *v == Verdict::Rejected(Rejection::AlreadyPurchased)),
            "{name}: {at_limit:?}"
        );
        let mut below = Vec::new();
        for _ in 0..4 {
            below.push(buy(three.id, 43).await);
        }
        assert_eq!(
            below[..3],
            [
                Verdict::Accepted { remaining: 9 },
                Verdict::Accepted { remaining: 8 },
                Verdict::Accepted { remaining: 7 },
            ],
            "{name}"
        );
        // User 43 holds three now, the limit: the burst spent, yet told so, not to wait.
        assert_eq!(
            below[3],
            Verdict::Rejected(Rejection::AlreadyPurchased),
            "{name}: {below:?}"
        );
        // Buying, cancelling and buying again: each freed slot takes a place in the rate,
        // so the fourth purchase within the burst of three waits.
        let mut cycle = Vec::new();
        for _ in 0..4 {
            let order_id = common::next_id();
            let verdict = buy_as(cycled.id, 44, order_id).await;
            if verdict == (Verdict::Accepted { remaining: 9 }) {
                let release = Release {
                    sale_id: cycled.id,
                    order_id,
                    user_id: 44,
                    quantity: 1,
                };
                assert_eq!(
                    gate.release(release).await.unwrap(),
                    Released::Now,
                    "{name}"
                );
            }
            cycle.push(verdict);
        }
        assert!(
            cycle[..3]
                .iter()
                .all(|v| *v == Verdict::Accepted { remaining: 9 }),
            "{name}: {cycle:?}"
        );
        assert!(
            matches!(cycle[3], Verdict::Rejected(Rejection::RateLimited { .. })),
            "{name}: {cycle:?}"
        );
        if *name == "redis" {
            let has_rate = |sale_id: i64, user: i64| {
                redis::cmd("HEXISTS")
                    .arg(seckill::redis_client::keys::SaleKeys::new(&rated.prefix, sale_id).rate)
                    .arg(user)
                    .to_owned()
            };
            let kept: i64 = has_rate(one.id, 42).query_async(&mut conn).await.unwrap();
            assert_eq!(kept, 0, "a winner at the limit keeps no rate time");
            let kept: i64 = has_rate(three.id, 43).query_async(&mut conn).await.unwrap();
            assert_eq!(kept, 1, "the time of its purchases below the limit stays");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_purchase_token_is_spent_once_whatever_the_outcome() {
    use seckill::gate::Spend;
    for h in Harness::all().await {
        let _turn = h.turn().await;
        let sale = common::sale(common::next_id(), 2, 1);
        h.open(&sale, vec![]).await;
        let token = Spend {
            nonce: rand::random(),
            expires_at: seckill::clock::wall_ms() + 60_000,
        };
        // The same token fired by 40 tasks at once (a replaying script): one attempt spends
        // it, every other is refused before the stock is looked at.
        let tasks: Vec<_> = (0..40)
            .map(|i| {
                let gate = h.gate.clone();
                tokio::spawn(async move {
                    gate.purchase(Purchase {
                        sale_id: sale.id,
                        user_id: 5_000 + i,
                        quantity: 1,
                        order_id: common::next_id(),
                        token: Some(token),
                        segments: 1,
                        after_move: false,
                        retry_key: None,
                    })
                    .await
                    .unwrap()
                })
            })
            .collect();
        let mut verdicts = Vec::new();
        for t in tasks {
            verdicts.push(t.await.unwrap());
        }
        assert_eq!(
            verdicts.iter().filter(|v| accepted(v)).count(),
            1,
            "{}: {verdicts:?}",
            h.name
        );
        assert_eq!(
            verdicts
                .iter()
                .filter(|v| **v == Verdict::Rejected(Rejection::TokenUsed))
                .count(),
            39,
            "{}",
            h.name
        );
        let stock = h.gate.stock(sale.id).await.unwrap().unwrap();
        assert_eq!(stock.remaining, 1, "{}: only one unit taken", h.name);

        // A token spent on a refused attempt stays spent. (Valid for ten minutes: on a
        // loaded box a minute's token plus the gates' minute of slack ran out between the
        // two attempts, and the SQL gates rightly honoured it again.)
        let once = Spend {
            nonce: rand::random(),
            expires_at: seckill::clock::wall_ms() + 600_000,
        };
        let buy = |user| Purchase {
            sale_id: sale.id,
            user_id: user,
            quantity: 5,
            order_id: common::next_id(),
            token: Some(once),
            segments: 1,
            after_move: false,
            retry_key: None,
        };
        let first = h.gate.purchase(buy(6_000)).await.unwrap();
        assert!(!accepted(&first), "{}: over the limit", h.name);
        let again = h
            .gate
            .purchase(Purchase {
                quantity: 1,
                ..buy(6_000)
            })
            .await
            .unwrap();
        assert_eq!(again, Verdict::Rejected(Rejection::TokenUsed), "{}", h.name);

        // Nonces spent on their own (captchas) are per sale and single-use too.
        let captcha = Spend {
            nonce: rand::random(),
            expires_at: seckill::clock::wall_ms() + 60_000,
        };
        let spends =
            futures_util::future::join_all((0..20).map(|_| h.gate.spend(sale.id, captcha))).await;
        assert_eq!(
            spends.iter().filter(|s| *s.as_ref().unwrap()).count(),
            1,
            "{}",
            h.name
        );
        assert!(
            h.gate.spend(sale.id + 1, captcha).await.unwrap(),
            "{}",
            h.name
        );
    }
}

/// purchase.lua decides a batch's attempts one after another but writes the buyers, the
/// rates, the accepted orders and the stock once, after the last: a buyer who comes back
/// within the same call must see what their earlier attempt took and spent.
#[tokio::test]
async fn attempts_of_one_script_call_see_each_others_units_and_rate() {
    let (_, mut conn) = seckill::app::redis_manager(&common::redis_url())
        .await
        .unwrap();
    let script = redis::Script::new(include_str!("../../src/gate/purchase.lua"));
    let prefix = common::unique("onecall");
    let keys = |sale: i64| -> Vec<String> {
        ["sale", "buyers", "orders", "accepted", "rate"]
            .iter()
            .map(|k| format!("{prefix}:{{{sale}}}:{k}"))
            .collect()
    };
    let deadline = seckill::clock::wall_ms() + 60_000;
    // (user, quantity) per attempt; no purchase tokens.
    let call_in =
        |form: &str, sale: i64, interval: i64, tolerance: i64, attempts: &[(i64, i64)]| {
            let k = keys(sale);
            let mut inv = script.prepare_invoke();
            for key in &k {
                inv.key(key);
            }
            for _ in attempts {
                inv.key(&k[0]);
            }
            inv.arg(sale).arg(interval).arg(tolerance).arg(0).arg(form);
            for (n, (user, qty)) in attempts.iter().enumerate() {
                inv.arg(*user)
                    .arg(*qty)
                    .arg(sale * 1000 + n as i64)
                    .arg(0)
                    .arg(deadline);
            }
            inv
        };
    let call = |sale: i64, interval: i64, tolerance: i64, attempts: &[(i64, i64)]| {
        call_in("packed", sale, interval, tolerance, attempts)
    };
    let open = |sale: i64, stock: i64, limit: i64| {
        let mut c = redis::cmd("HSET");
        c.arg(&keys(sale)[0])
            .arg("stock")
            .arg(stock)
            .arg("limit")
            .arg(limit)
            .arg("begins")
            .arg(0)
            .arg("ends")
            .arg(deadline * 10)
            .arg("paused")
            .arg(0)
            .arg("price")
            .arg(100);
        c
    };

    // Stock 3, at most 2 each, no rate limit.
    let _: () = open(1, 3, 2).query_async(&mut conn).await.unwrap();
    let reply: redis::Value = call(1, 0, 0, &[(7, 1), (7, 1), (7, 1), (8, 2), (9, 3), (9, 1)])
        .invoke_async(&mut conn)
        .await
        .unwrap();
    let verdicts = seckill::gate::reply::verdicts_from_reply(&reply, 6).unwrap();
    let verdicts_of_sale_1 = verdicts.clone();
    use seckill::gate::Rejection::*;
    assert_eq!(
        verdicts,
        vec![
            Verdict::Accepted { remaining: 2 },
            Verdict::Accepted { remaining: 1 },
            Verdict::Rejected(AlreadyPurchased),
            Verdict::Rejected(SoldOut { remaining: 1 }),
            Verdict::Rejected(OverLimit { held: 0 }),
            Verdict::Accepted { remaining: 0 },
        ]
    );
    let k = keys(1);
    let buyers: std::collections::HashMap<String, i64> = hgetall(&mut conn, &k[1]).await;
    assert_eq!(
        buyers,
        [("7".to_string(), 2), ("9".to_string(), 1)].into(),
        "a refused buyer leaves no field"
    );
    let stock: i64 = redis::cmd("HGET")
        .arg(&k[0])
        .arg("stock")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(stock, 0);
    let accepted: std::collections::HashMap<i64, String> = hgetall(&mut conn, &k[3]).await;
    assert_eq!(
        accepted,
        [
            (1000, "7:1".to_string()),
            (1001, "7:1".to_string()),
            (1005, "9:1".to_string())
        ]
        .into()
    );
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(&k[2])
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    let orders: Vec<Vec<String>> = entries
        .iter()
        .map(|(_, f)| f[0].1.split(':').map(str::to_string).collect())
        .collect();
    assert_eq!(orders.len(), 3);
    for (order, (id, user)) in orders
        .iter()
        .zip([("1000", "7"), ("1001", "7"), ("1005", "9")])
    {
        assert_eq!(order[..5], [id, "1", user, "1", "100"], "{order:?}");
        let at: i64 = order[5].parse().unwrap();
        assert!((deadline - 120_000..=deadline).contains(&at), "{order:?}");
    }

    // A rate of one a second with a burst of two: the third attempt in the call waits.
    let _: () = open(2, 10, 5).query_async(&mut conn).await.unwrap();
    let reply: redis::Value = call(2, 1000, 1000, &[(7, 1), (7, 1), (7, 1), (8, 1)])
        .invoke_async(&mut conn)
        .await
        .unwrap();
    let verdicts = seckill::gate::reply::verdicts_from_reply(&reply, 4).unwrap();
    assert_eq!(
        verdicts[..2],
        [
            Verdict::Accepted { remaining: 9 },
            Verdict::Accepted { remaining: 8 }
        ]
    );
    assert_eq!(
        verdicts[2],
        Verdict::Rejected(RateLimited {
            retry_after_ms: 1000
        })
    );
    assert_eq!(verdicts[3], Verdict::Accepted { remaining: 7 });
    let k = keys(2);
    let tats: std::collections::HashMap<String, i64> = hgetall(&mut conn, &k[4]).await;
    assert_eq!(tats["8"] + 1000, tats["7"], "{tats:?}");
    assert!(
        (deadline - 120_000..=deadline).contains(&(tats["8"] - 1000)),
        "{tats:?}"
    );

    // At most 2 each: user 7's first purchase keeps its place in the rate, the second,
    // which takes 7 to the limit, keeps none (as the memory gate decides attempt by
    // attempt), and the third is told the limit, not the rate.
    let _: () = open(5, 10, 2).query_async(&mut conn).await.unwrap();
    let reply: redis::Value = call(5, 1000, 1000, &[(7, 1), (7, 1), (7, 1), (8, 1)])
        .invoke_async(&mut conn)
        .await
        .unwrap();
    let verdicts = seckill::gate::reply::verdicts_from_reply(&reply, 4).unwrap();
    assert_eq!(
        verdicts,
        [
            Verdict::Accepted { remaining: 9 },
            Verdict::Accepted { remaining: 8 },
            Verdict::Rejected(AlreadyPurchased),
            Verdict::Accepted { remaining: 7 },
        ]
    );
    let tats: std::collections::HashMap<String, i64> = hgetall(&mut conn, &keys(5)[4]).await;
    assert_eq!(tats["7"], tats["8"], "{tats:?}");

    // The batch form: the same decisions, the call's three orders in one entry.
    let _: () = open(3, 3, 2).query_async(&mut conn).await.unwrap();
    let reply: redis::Value = call_in(
        "batch",
        3,
        0,
        0,
        &[(7, 1), (7, 1), (7, 1), (8, 2), (9, 3), (9, 1)],
    )
    .invoke_async(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        seckill::gate::reply::verdicts_from_reply(&reply, 6).unwrap(),
        verdicts_of_sale_1
    );
    let k = keys(3);
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(&k[2])
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(entries.len(), 1, "{entries:?}");
    let fields = &entries[0].1;
    assert_eq!(fields.len(), 1, "{fields:?}");
    assert_eq!(fields[0].0, "b");
    let (head, orders) = fields[0].1.split_once(';').unwrap();
    assert_eq!(orders, "3000:7:1;3001:7:1;3005:9:1");
    let head: Vec<i64> = head.split(':').map(|v| v.parse().unwrap()).collect();
    assert_eq!(head[..2], [3, 100]);
    assert!(
        (deadline - 120_000..=deadline).contains(&head[2]),
        "{head:?}"
    );
    let buyers: std::collections::HashMap<String, i64> = hgetall(&mut conn, &k[1]).await;
    assert_eq!(buyers, [("7".to_string(), 2), ("9".to_string(), 1)].into());
    let accepted: std::collections::HashMap<i64, String> = hgetall(&mut conn, &k[3]).await;
    assert_eq!(accepted.len(), 3);
    // A stream that refuses the entry (a key of another type) leaves the call's decisions
    // unwritten: no stock, buyer or accepted order counts an order that is not in the log.
    let _: () = open(4, 3, 2).query_async(&mut conn).await.unwrap();
    let _: () = redis::cmd("SET")
        .arg(&keys(4)[2])
        .arg("not a stream")
        .query_async(&mut conn)
        .await
        .unwrap();
    let failed: Result<redis::Value, _> = call_in("batch", 4, 0, 0, &[(7, 1), (8, 1)])
        .invoke_async(&mut conn)
        .await;
    assert!(failed.is_err(), "{failed:?}");
    let k = keys(4);
    let stock: i64 = redis::cmd("HGET")
        .arg(&k[0])
        .arg("stock")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(stock, 3);
    let buyers: std::collections::HashMap<String, i64> = hgetall(&mut conn, &k[1]).await;
    let accepted: std::collections::HashMap<i64, String> = hgetall(&mut conn, &k[3]).await;
    assert!(
        buyers.is_empty() && accepted.is_empty(),
        "{buyers:?} {accepted:?}"
    );

    let mut del = redis::cmd("DEL");
    for key in (1..=4).flat_map(keys) {
        del.arg(key);
    }
    let _: () = del.query_async(&mut conn).await.unwrap();
}

async fn hgetall<K, V>(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    key: &str,
) -> std::collections::HashMap<K, V>
where
    K: redis::FromRedisValue + Eq + std::hash::Hash,
    V: redis::FromRedisValue,
{
    redis::cmd("HGETALL")
        .arg(key)
        .query_async(conn)
        .await
        .unwrap()
}
