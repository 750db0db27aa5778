//! Rebuilding a sale in the Redis gate from SQL, as after Redis lost its data: one loader
//! at a time across processes, a loader that lost its lock writes nothing, and the rebuilt
//! gate is SQL + the order stream + orders written during the rebuild, each counted once.
//! Each "process" here is a gate with its own Redis connection and its own sale cache.

use crate::common;
use crate::common::order;

use std::sync::Arc;

use seckill::gate::redis::RedisGate;
use seckill::gate::{
    Gate, LoadStart, Purchase, Rejection, Release, Released, SaleLoad, SegmentCheck, Verdict,
};
use seckill::loader::{self, SaleCache};
use seckill::model::{NewOrder, Sale};
use seckill::redis_client::keys::SaleKeys;
use seckill::store::Store;
use seckill::store::{Outcome, StockReturn};

async fn gate(prefix: &str) -> Arc<RedisGate> {
    let (_, conn) = seckill::app::redis_manager(&common::redis_url())
        .await
        .unwrap();
    let gate = RedisGate::new(conn, prefix);
    gate.prepare().await.unwrap();
    Arc::new(gate)
}

async fn redis() -> seckill::redis_client::RedisConn {
    seckill::app::redis_manager(&common::redis_url())
        .await
        .unwrap()
        .1
}

/// Makes a loaded sale's hash look as a promoted replica or an older restart holds it:
/// loaded into another server, with other numbers (`stock`).
async fn loaded_elsewhere(prefix: &str, sale_id: i64, stock: i64) {
    let _: () = redis::cmd("HSET")
        .arg(&SaleKeys::new(prefix, sale_id).sale)
        .arg("server")
        .arg("0123456789abcdef")
        .arg("stock")
        .arg(stock)
        .query_async(&mut redis().await)
        .await
        .unwrap();
}

/// A sale with `buyers` users holding one unit each in SQL.
async fn sale_with_buyers(store: &Store, stock: i64, buyers: i64) -> Sale {
    let sale = common::sale(common::next_id(), stock, 1);
    store.create_sale(&sale).await.unwrap();
    let orders: Vec<NewOrder> = (1..=buyers).map(|u| order(sale.id, u)).collect();
    for chunk in orders.chunks(1000) {
        store.write_orders(chunk).await.unwrap();
    }
    sale
}

fn buy(sale_id: i64, user_id: i64) -> Purchase {
    Purchase {
        sale_id,
        user_id,
        quantity: 1,
        order_id: common::next_id(),
        token: None,
        segments: 1,
        after_move: false,
        retry_key: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_processes_rebuild_a_sale_once_and_forget_no_buyer() {
    let (store, _) = common::fresh_store(common::Sql::Postgres).await;
    let prefix = common::unique("rebuild");
    let sale = sale_with_buyers(&store, 5000, 2500).await;
    for round in 0..3 {
        // Redis lost the sale: eight processes meet the empty gate at once.
        let _: () = redis::cmd("DEL")
            .arg(SaleKeys::new(&prefix, sale.id).sale)
            .query_async(&mut redis().await)
            .await
            .unwrap();
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let (store, sale, gate) = (store.clone(), sale.clone(), gate(&prefix).await);
            tasks.push(tokio::spawn(async move {
                let cache = SaleCache::default();
                let mut loaded = 0;
                // Each keeps asking until the sale is in the gate, as purchases and ticks do.
                while !gate.is_loaded(sale.id).await.unwrap() {
                    if loader::load_sale(&store, gate.as_ref(), &cache, &sale)
                        .await
                        .unwrap()
                    {
                        loaded += 1;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
                loaded
            }));
        }
        let mut loads = 0;
        for t in tasks {
            loads += t.await.unwrap();
        }
        assert_eq!(loads, 1, "round {round}: exactly one rebuild");
        let g = gate(&prefix).await;
        let stock = g.stock(sale.id).await.unwrap().unwrap();
        assert_eq!(
            (stock.remaining, stock.buyers),
            (2500, 2500),
            "round {round}"
        );
        for user in [1, 1250, 2500] {
            assert_eq!(
                g.purchase(buy(sale.id, user)).await.unwrap(),
                Verdict::Rejected(Rejection::AlreadyPurchased),
                "round {round}: buyer {user} is remembered"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loader_that_lost_its_lock_writes_nothing() {
    let (store, _) = common::fresh_store(common::Sql::Sqlite).await;
    let prefix = common::unique("fence");
    let sale = sale_with_buyers(&store, 100, 10).await;
    let keys = SaleKeys::new(&prefix, sale.id);
    let (a, b) = (gate(&prefix).await, gate(&prefix).await);
    let LoadStart::Ticket(stale) = a.begin_load(sale.id).await.unwrap() else {
        panic!("the first loader gets the lock");
    };
    assert!(matches!(
        b.begin_load(sale.id).await.unwrap(),
        LoadStart::Busy
    ));
    // A stalls past its lease: the lock lapses and B takes it.
    let _: () = redis::cmd("DEL")
        .arg(&keys.lock)
        .query_async(&mut redis().await)
        .await
        .unwrap();
    let LoadStart::Ticket(fresh) = b.begin_load(sale.id).await.unwrap() else {
        panic!("the lock was free");
    };
    assert!(fresh.fence > stale.fence, "fences only go up");
    let snapshot = store
        .load_snapshot(sale.id, std::time::Duration::ZERO)
        .await
        .unwrap();
    let load = |remaining: i64| SaleLoad {
        sale: sale.clone(),
        remaining,
        buyers: snapshot.buyers.clone(),
        released: vec![],
        counted: snapshot.counted.clone(),
        segment: 0,
        moves: Vec::new(),
    };
    // A wakes up with a wrong picture of the sale: it must not write any of it.
    assert!(a.finish_load(stale, &load(999)).await.is_err());
    assert!(!a.is_loaded(sale.id).await.unwrap());
    assert!(b.finish_load(fresh, &load(snapshot.stock)).await.unwrap());
    let stock = b.stock(sale.id).await.unwrap().unwrap();
    assert_eq!((stock.remaining, stock.buyers), (90, 10));
    let lock: Option<String> = redis::cmd("GET")
        .arg(&keys.lock)
        .query_async(&mut redis().await)
        .await
        .unwrap();
    assert_eq!(lock, None, "the lock is given back");
}

/// Orders a writer commits while the gate is rebuilt, and orders still in the stream, are
/// counted exactly once whatever side of the rebuild's SQL read they fall on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rebuilt_gate_is_sql_plus_the_stream_plus_late_writes() {
    let (store, _) = common::fresh_store(common::Sql::Postgres).await;
    let prefix = common::unique("late");
    let sale = sale_with_buyers(&store, 100, 10).await;
    let g = gate(&prefix).await;
    assert!(
        loader::load_sale(&store, g.as_ref(), &SaleCache::default(), &sale)
            .await
            .unwrap()
    );
    // Buyer 11's order is accepted and still in the stream; buyer 12's was read by a
    // writer (also still in the stream until acknowledged) that has not committed yet.
    let in_stream = buy(sale.id, 11);
    let in_writer = buy(sale.id, 12);
    for p in [in_stream, in_writer] {
        assert!(matches!(
            g.purchase(p).await.unwrap(),
            Verdict::Accepted { .. }
        ));
    }
    // An order committed before the rebuild's read whose writer confirms it only after.
    let early = order(sale.id, 13);
    store
        .write_orders(std::slice::from_ref(&early))
        .await
        .unwrap();

    // Redis loses the sale's hash (its other keys stay: the stream has two entries).
    let keys = SaleKeys::new(&prefix, sale.id);
    let _: () = redis::cmd("DEL")
        .arg(&keys.sale)
        .query_async(&mut redis().await)
        .await
        .unwrap();
    let LoadStart::Ticket(ticket) = g.begin_load(sale.id).await.unwrap() else {
        panic!("lock");
    };
    let snapshot = store
        .load_snapshot(sale.id, std::time::Duration::ZERO)
        .await
        .unwrap();
    // Now the writer commits buyer 12's order (after the snapshot) and confirms both.
    let late = NewOrder {
        id: in_writer.order_id,
        sale_id: sale.id,
        user_id: 12,
        quantity: 1,
        price_cents: 100,
        accepted_at: seckill::clock::wall_ms(),
        retry_key: None,
    };
    store
        .write_orders(std::slice::from_ref(&late))
        .await
        .unwrap();
    g.confirm_written(&[late.clone(), early.clone()])
        .await
        .unwrap();
    let load = SaleLoad {
        sale: sale.clone(),
        remaining: snapshot.stock,
        buyers: snapshot.buyers,
        released: snapshot.released,
        counted: snapshot.counted,
        segment: 0,
        moves: Vec::new(),
    };
    assert!(g.finish_load(ticket, &load).await.unwrap());

    // SQL: 100 - 10 - early - late = 88; the stream adds buyer 11: 87. Buyer 12 counts once
    // though both in the stream and confirmed late.
    let stock = g.stock(sale.id).await.unwrap().unwrap();
    assert_eq!((stock.remaining, stock.buyers), (87, 13));
    for user in [1, 11, 12, 13] {
        assert_eq!(
            g.purchase(buy(sale.id, user)).await.unwrap(),
            Verdict::Rejected(Rejection::AlreadyPurchased),
            "buyer {user}"
        );
    }
    // Confirmations after the rebuild, again and again, change nothing.
    g.confirm_written(&[late, early]).await.unwrap();
    assert_eq!(g.stock(sale.id).await.unwrap().unwrap().remaining, 87);

    // A written order the gate has never heard of (it was rebuilt without it) is added once.
    let stray = order(sale.id, 14);
    store
        .write_orders(std::slice::from_ref(&stray))
        .await
        .unwrap();
    for _ in 0..3 {
        g.confirm_written(std::slice::from_ref(&stray))
            .await
            .unwrap();
    }
    let stock = g.stock(sale.id).await.unwrap().unwrap();
    assert_eq!((stock.remaining, stock.buyers), (86, 14));
}

/// A gate loaded into another Redis server (a replica promoted since, or a restart with
/// older data) is forgotten once, then rebuilt from SQL; the rebuilt one is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_from_another_redis_server_is_rebuilt_once() {
    let (store, _) = common::fresh_store(common::Sql::Sqlite).await;
    let prefix = common::unique("stale");
    let sale = sale_with_buyers(&store, 100, 10).await;
    let g = gate(&prefix).await;
    let cache = SaleCache::default();
    assert!(loader::load_sale(&store, g.as_ref(), &cache, &sale)
        .await
        .unwrap());
    assert!(!g.forget_if_stale(sale.id).await.unwrap(), "loaded here");
    // As a promoted replica holds it: stale numbers, loaded on the old master.
    loaded_elsewhere(&prefix, sale.id, 95).await;
    assert!(g.forget_if_stale(sale.id).await.unwrap());
    assert!(
        !g.is_loaded(sale.id).await.unwrap(),
        "answers not_loaded until rebuilt"
    );
    assert!(loader::load_sale(&store, g.as_ref(), &cache, &sale)
        .await
        .unwrap());
    assert_eq!(
        g.stock(sale.id).await.unwrap().unwrap().remaining,
        90,
        "from SQL"
    );
    assert!(
        !g.forget_if_stale(sale.id).await.unwrap(),
        "kept from now on"
    );
}

/// The scheduler's check of every sale, in one call: a sale loaded here is left alone, one
/// loaded into another server is forgotten (and rebuilt by the preload), one missing is
/// loaded; the audit's read of every sale's stock answers each as a read of its own does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_check_of_many_sales_finds_each_loaded_stale_or_missing() {
    let (store, _) = common::fresh_store(common::Sql::Sqlite).await;
    let prefix = common::unique("checkmany");
    let current = sale_with_buyers(&store, 100, 10).await;
    let stale = sale_with_buyers(&store, 50, 5).await;
    let missing = sale_with_buyers(&store, 30, 3).await;
    let g = gate(&prefix).await;
    let cache = SaleCache::default();
    for sale in [&current, &stale] {
        assert!(loader::load_sale(&store, g.as_ref(), &cache, sale)
            .await
            .unwrap());
    }
    loaded_elsewhere(&prefix, stale.id, 49).await;
    let parts = [(current.id, 0), (stale.id, 0), (missing.id, 0)];
    let checks = check(g.as_ref(), &parts).await;
    use SegmentCheck::{Forgotten, Loaded, Unloaded};
    assert_eq!(checks, [Loaded, Forgotten, Unloaded]);
    assert!(!g.is_loaded(stale.id).await.unwrap(), "forgotten");
    let again = check(g.as_ref(), &parts).await;
    assert_eq!(again, [Loaded, Unloaded, Unloaded], "forgotten once");

    let stocks = remaining(g.as_ref(), &[current.id, stale.id, missing.id]).await;
    assert_eq!(stocks, [Some(90), None, None]);
    let one = g.stock(current.id).await.unwrap();
    assert_eq!(g.stocks(&[current.id]).await.remove(0).unwrap(), one);

    // The preload loads what the check found missing or forgot, from SQL.
    cache.replace(vec![current.clone(), stale.clone(), missing.clone()]);
    let loaded = loader::preload(&store, g.as_ref(), &cache, 60_000)
        .await
        .unwrap();
    assert_eq!(loaded, 2);
    let stocks = remaining(g.as_ref(), &[current.id, stale.id, missing.id]).await;
    assert_eq!(stocks, [Some(90), Some(45), Some(27)]);
}

/// `Gate::check_segments` of `parts`, each answer unwrapped.
async fn check(g: &RedisGate, parts: &[(i64, i64)]) -> Vec<SegmentCheck> {
    let checks = g.check_segments(parts).await;
    checks.into_iter().map(Result::unwrap).collect()
}

/// Each sale's remaining stock in the gate, read by `Gate::stocks`.
async fn remaining(g: &RedisGate, sales: &[i64]) -> Vec<Option<i64>> {
    let stocks = g.stocks(sales).await;
    stocks
        .into_iter()
        .map(|s| s.unwrap().map(|s| s.remaining))
        .collect()
}

/// A repair or an approval reads the gate right after loading it: when another process
/// holds the load lock, the waiting load returns only once that process's load is in
/// place, never while the sale is still missing from the gate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_load_returns_once_another_processs_load_is_in_place() {
    let (store, _) = common::fresh_store(common::Sql::Sqlite).await;
    let prefix = common::unique("waitload");
    let sale = sale_with_buyers(&store, 100, 10).await;
    let (other, here) = (gate(&prefix).await, gate(&prefix).await);
    let LoadStart::Ticket(ticket) = other.begin_load(sale.id).await.unwrap() else {
        panic!("the other process gets the lock");
    };
    let waiting = {
        let (store, sale, here) = (store.clone(), sale.clone(), here.clone());
        tokio::spawn(async move {
            loader::load_sale_and_wait(&store, here.as_ref(), &SaleCache::default(), &sale).await
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "returned while the sale was not loaded"
    );
    // The plain load does not wait: it returns with nothing loaded.
    assert!(
        !loader::load_sale(&store, here.as_ref(), &SaleCache::default(), &sale)
            .await
            .unwrap()
    );
    assert!(!here.is_loaded(sale.id).await.unwrap());

    let snapshot = store
        .load_snapshot(sale.id, std::time::Duration::ZERO)
        .await
        .unwrap();
    let load = SaleLoad {
        sale: sale.clone(),
        remaining: snapshot.stock,
        buyers: snapshot.buyers,
        released: vec![],
        counted: snapshot.counted,
        segment: 0,
        moves: Vec::new(),
    };
    assert!(other.finish_load(ticket, &load).await.unwrap());
    let installed_here = tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
        .await
        .expect("the waiting load ends once the other is in place")
        .unwrap()
        .unwrap();
    assert!(!installed_here, "the other process's load is kept");
    let stock = here.stock(sale.id).await.unwrap().unwrap();
    assert_eq!((stock.remaining, stock.buyers), (90, 10));
}

/// Cancels `user`'s order of the sale in SQL (which records its return) and answers it.
async fn cancel_in_sql(store: &Store, sale_id: i64, user: i64) -> StockReturn {
    let order = store
        .orders_of_sale(sale_id)
        .await
        .unwrap()
        .into_iter()
        .find(|o| o.user_id == user)
        .expect("the buyer's order");
    store
        .transition(
            order.id,
            Some(user),
            Outcome::Cancelled,
            seckill::clock::wall_ms(),
            "test",
        )
        .await
        .unwrap();
    StockReturn {
        order_id: order.id,
        sale_id,
        user_id: user,
        quantity: order.quantity,
    }
}

fn release_of(r: &StockReturn) -> Release {
    Release {
        sale_id: r.sale_id,
        order_id: r.order_id,
        user_id: r.user_id,
        quantity: r.quantity,
    }
}

/// A return that meets a rebuild between its SQL snapshot and its install (once a
/// loss): it is kept in the outbox, not marked done, and handed over once the sale is in,
/// exactly once; its buyer may buy again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_return_that_meets_a_rebuild_is_kept_for_it_and_counted_once() {
    let (store, _) = common::fresh_store(common::Sql::Postgres).await;
    let prefix = common::unique("retload");
    let sale = sale_with_buyers(&store, 100, 10).await;
    let g = gate(&prefix).await;
    assert!(
        loader::load_sale(&store, g.as_ref(), &SaleCache::default(), &sale)
            .await
            .unwrap()
    );
    let keys = SaleKeys::new(&prefix, sale.id);
    let _: () = redis::cmd("DEL")
        .arg(&keys.sale)
        .query_async(&mut redis().await)
        .await
        .unwrap();
    let LoadStart::Ticket(ticket) = g.begin_load(sale.id).await.unwrap() else {
        panic!("lock");
    };
    let snapshot = store
        .load_snapshot(sale.id, std::time::Duration::ZERO)
        .await
        .unwrap();
    // Buyer 3 cancels after the snapshot, before the install.
    let r = cancel_in_sql(&store, sale.id, 3).await;
    assert_eq!(
        seckill::lifecycle::return_to_gate(&store, g.as_ref(), &r)
            .await
            .unwrap(),
        Released::Deferred
    );
    assert_eq!(
        store
            .pending_returns(Some(sale.id), 10)
            .await
            .unwrap()
            .len(),
        1,
        "kept for after the load"
    );
    let load = SaleLoad {
        sale: sale.clone(),
        remaining: snapshot.stock,
        buyers: snapshot.buyers,
        released: snapshot.released,
        counted: snapshot.counted,
        segment: 0,
        moves: Vec::new(),
    };
    assert!(g.finish_load(ticket, &load).await.unwrap());
    let stock = g.stock(sale.id).await.unwrap().unwrap();
    assert_eq!(
        (stock.remaining, stock.buyers),
        (90, 10),
        "as of the snapshot"
    );
    assert_eq!(
        seckill::lifecycle::pump_returns_of(&store, g.as_ref(), sale.id)
            .await
            .unwrap(),
        1
    );
    let stock = g.stock(sale.id).await.unwrap().unwrap();
    assert_eq!((stock.remaining, stock.buyers), (91, 9), "the return, once");
    assert!(store
        .pending_returns(Some(sale.id), 10)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(g.release(release_of(&r)).await.unwrap(), Released::Before);
    assert!(matches!(
        g.purchase(buy(sale.id, 3)).await.unwrap(),
        Verdict::Accepted { .. }
    ));
    // And the loader hands over what met its load by itself.
    let _: () = redis::cmd("DEL")
        .arg(&keys.sale)
        .query_async(&mut redis().await)
        .await
        .unwrap();
    let LoadStart::Ticket(held) = g.begin_load(sale.id).await.unwrap() else {
        panic!("lock");
    };
    let r = cancel_in_sql(&store, sale.id, 4).await;
    assert_eq!(
        seckill::lifecycle::return_to_gate(&store, g.as_ref(), &r)
            .await
            .unwrap(),
        Released::Deferred
    );
    g.abandon_load(held).await;
    assert!(
        loader::load_sale(&store, g.as_ref(), &SaleCache::default(), &sale)
            .await
            .unwrap()
    );
    assert!(store
        .pending_returns(Some(sale.id), 10)
        .await
        .unwrap()
        .is_empty());
    // SQL: 100 - 10 written + 3 and 4 back = 92; buyer 3's new order is still in the
    // stream (no writer runs here): 91.
    let stock = g.stock(sale.id).await.unwrap().unwrap();
    assert_eq!((stock.remaining, stock.buyers), (91, 9));
}

/// A release that comes late to a rebuilt gate, of a return the rebuild counted already
/// (a double count found once: a stale outbox batch, the cancel handler and the scheduler
/// racing), changes nothing; so does the release of an order the gate never counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_release_of_what_the_rebuild_counted_changes_nothing() {
    let (store, _) = common::fresh_store(common::Sql::Postgres).await;
    let prefix = common::unique("retlate");
    let sale = sale_with_buyers(&store, 100, 10).await;
    let g = gate(&prefix).await;
    let cache = SaleCache::default();
    assert!(loader::load_sale(&store, g.as_ref(), &cache, &sale)
        .await
        .unwrap());
    let r = cancel_in_sql(&store, sale.id, 4).await;
    assert_eq!(g.release(release_of(&r)).await.unwrap(), Released::Now);
    // Redis loses everything of the sale; the return was marked done or not, either way.
    let keys = SaleKeys::new(&prefix, sale.id);
    let _: () = redis::cmd("DEL")
        .arg(&keys.sale)
        .arg(&keys.buyers)
        .arg(&keys.released)
        .arg(&keys.counted)
        .arg(&keys.accepted)
        .query_async(&mut redis().await)
        .await
        .unwrap();
    assert!(loader::load_sale(&store, g.as_ref(), &cache, &sale)
        .await
        .unwrap());
    assert_eq!((g.stock(sale.id).await.unwrap().unwrap().remaining), 91);
    for _ in 0..3 {
        assert_eq!(g.release(release_of(&r)).await.unwrap(), Released::Before);
    }
    let stock = g.stock(sale.id).await.unwrap().unwrap();
    assert_eq!((stock.remaining, stock.buyers), (91, 9));

    // An order written after the load (its writer has not confirmed it) and cancelled:
    // the gate never counted it, so it gives nothing back, and the late confirm skips it.
    let late = order(sale.id, 20);
    store
        .write_orders(std::slice::from_ref(&late))
        .await
        .unwrap();
    let r = cancel_in_sql(&store, sale.id, 20).await;
    assert_eq!(g.release(release_of(&r)).await.unwrap(), Released::Before);
    g.confirm_written(std::slice::from_ref(&late))
        .await
        .unwrap();
    let stock = g.stock(sale.id).await.unwrap().unwrap();
    assert_eq!((stock.remaining, stock.buyers), (91, 9));
    assert_eq!(
        store.sale(sale.id).await.unwrap().unwrap().stock,
        91,
        "SQL agrees"
    );
}

/// The ids a load counted are packed in a hash by their last four digits (counted.lua):
/// the scripts find the ones the loader staged from Rust; a gate loaded by an earlier build,
/// which kept them as a set under another key, is still read, and what is added after
/// goes to the packed hash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counted_orders_are_found_packed_and_in_the_earlier_set_layout() {
    let (store, _) = common::fresh_store(common::Sql::Postgres).await;
    let prefix = common::unique("packed");
    let sale = sale_with_buyers(&store, 100, 10).await;
    let g = gate(&prefix).await;
    let cache = SaleCache::default();
    assert!(loader::load_sale(&store, g.as_ref(), &cache, &sale)
        .await
        .unwrap());
    let keys = SaleKeys::new(&prefix, sale.id);
    let ids: Vec<i64> = store
        .orders_of_sale(sale.id)
        .await
        .unwrap()
        .iter()
        .map(|o| o.id)
        .collect();
    let mut conn = redis().await;
    let (packed_conn, packed_key) = (conn.clone(), keys.counted.clone());
    let packed_holds = |id: i64| {
        let (mut conn, key) = (packed_conn.clone(), packed_key.clone());
        async move {
            let id = id.to_string();
            let packed: Option<String> = redis::cmd("HGET")
                .arg(&key)
                .arg(&id[id.len().saturating_sub(4)..])
                .query_async(&mut conn)
                .await
                .unwrap();
            packed.is_some_and(|p| p.contains(&format!(",{id},")))
        }
    };
    for id in &ids {
        assert!(packed_holds(*id).await, "{id} staged packed");
    }
    // A release of an order the load counted gives its unit back, once.
    let r = cancel_in_sql(&store, sale.id, 3).await;
    assert_eq!(g.release(release_of(&r)).await.unwrap(), Released::Now);
    assert_eq!(g.release(release_of(&r)).await.unwrap(), Released::Before);

    // The earlier layout: the same ids as members of a set under the earlier key.
    let _: () = redis::cmd("DEL")
        .arg(&keys.counted)
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("SADD")
        .arg(&keys.counted_set)
        .arg(&ids)
        .query_async(&mut conn)
        .await
        .unwrap();
    let r = cancel_in_sql(&store, sale.id, 4).await;
    assert_eq!(g.release(release_of(&r)).await.unwrap(), Released::Now);
    // An order written after the load is added by its confirm, once, to the packed hash.
    let late = order(sale.id, 20);
    store
        .write_orders(std::slice::from_ref(&late))
        .await
        .unwrap();
    for _ in 0..2 {
        g.confirm_written(std::slice::from_ref(&late))
            .await
            .unwrap();
    }
    assert!(packed_holds(late.id).await, "the late order was packed");
    let stock = g.stock(sale.id).await.unwrap().unwrap();
    assert_eq!((stock.remaining, stock.buyers), (91, 9));
    assert_eq!(
        store.sale(sale.id).await.unwrap().unwrap().stock,
        91,
        "SQL agrees"
    );

    // The next load keeps one layout: the earlier set is gone.
    let _: () = redis::cmd("DEL")
        .arg(&keys.sale)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(loader::load_sale(&store, g.as_ref(), &cache, &sale)
        .await
        .unwrap());
    let earlier: bool = redis::cmd("EXISTS")
        .arg(&keys.counted_set)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!earlier, "the earlier set was deleted by the load");
    assert!(packed_holds(late.id).await);
    assert_eq!(g.stock(sale.id).await.unwrap().unwrap().remaining, 91);
}

/// A Redis gate that counts the chunks of buyers handed to it during a load.
struct CountingStages {
    inner: Arc<RedisGate>,
    stages: std::sync::atomic::AtomicUsize,
}

#[async_trait::async_trait]
impl seckill::gate::layer::Layer for CountingStages {
    fn inner(&self) -> &dyn Gate {
        self.inner.as_ref()
    }

    async fn stage_buyers(
        &self,
        ticket: &seckill::gate::LoadTicket,
        segments: i64,
        buyers: &[(i64, i64)],
    ) -> Result<bool, seckill::gate::GateError> {
        self.stages
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.stage_buyers(ticket, segments, buyers).await
    }
}

/// A rebuild hands the gate its buyers chunk by chunk while SQL is still read (20,000
/// orders to a chunk): a buyer whose orders fall in different chunks, or twice in one,
/// holds their sum once the sale is in, a buyer of one order of two units holds two, a
/// cancelled order counts for nothing, and every other buyer holds their one order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buyers_handed_over_while_sql_is_read_hold_their_totals() {
    let (store, _) = common::fresh_store(common::Sql::Postgres).await;
    let prefix = common::unique("streamed");
    let sale = common::sale(common::next_id(), 30_000, 3);
    store.create_sale(&sale).await.unwrap();
    // Buyer 1's first order comes first, its second after 25,000 others (another chunk);
    // buyer 2's two orders are side by side (one chunk); buyer 3 has one order of two
    // units; buyer 4's order is cancelled.
    let two_units = NewOrder {
        quantity: 2,
        ..order(sale.id, 3)
    };
    let mut orders = vec![
        order(sale.id, 1),
        order(sale.id, 2),
        order(sale.id, 2),
        two_units,
        order(sale.id, 4),
    ];
    orders.extend((100..25_100).map(|u| order(sale.id, u)));
    orders.push(order(sale.id, 1));
    for chunk in orders.chunks(2000) {
        store.write_orders(chunk).await.unwrap();
    }
    cancel_in_sql(&store, sale.id, 4).await;
    let g = CountingStages {
        inner: gate(&prefix).await,
        stages: Default::default(),
    };
    let cache = SaleCache::default();
    assert!(loader::load_sale(&store, &g, &cache, &sale).await.unwrap());
    let stages = g.stages.load(std::sync::atomic::Ordering::Relaxed);
    // Two chunks, then the totals of the buyers of several orders.
    assert_eq!(stages, 3, "buyers handed over while SQL was read");
    let holders: std::collections::HashMap<i64, i64> = g
        .holders(sale.id, 100_000)
        .await
        .unwrap()
        .expect("the gate's buyers")
        .into_iter()
        .collect();
    assert_eq!(holders.len(), 25_003);
    assert_eq!(holders[&1], 2, "across chunks");
    assert_eq!(holders[&2], 2, "within a chunk");
    assert_eq!(holders[&3], 2, "one order of two units");
    assert!(!holders.contains_key(&4), "a cancelled order holds nothing");
    assert!((100..25_100).all(|u| holders[&u] == 1));
    let stock = g.stock(sale.id).await.unwrap().unwrap();
    assert_eq!(stock.remaining, 30_000 - 25_006);
    // Buyer 1 may buy one more unit (limit 3), not two.
    assert!(matches!(
        g.purchase(buy(sale.id, 1)).await.unwrap(),
        Verdict::Accepted { .. }
    ));
    assert_eq!(
        g.purchase(buy(sale.id, 1)).await.unwrap(),
        Verdict::Rejected(Rejection::AlreadyPurchased)
    );
}

/// The scheduler's check reads each sale's hash only when a server's mark (run id, key
/// count) changed: with nothing changed it reads none; a hash deleted, or a restart (a new
/// run id, the hashes loaded under the old one), makes it read them all and find each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_check_reads_the_hashes_only_when_a_server_changed() {
    let dir = std::env::temp_dir().join(common::unique("settled"));
    let mut server = common::PrivateRedis::start(common::free_port(), &dir);
    let url = format!("redis://127.0.0.1:{}/", server.port);
    let (_, conn) = seckill::app::redis_manager(&url).await.unwrap();
    let g = RedisGate::new(conn.clone(), "settled");
    g.prepare().await.unwrap();
    let (store, _) = common::fresh_store(common::Sql::Sqlite).await;
    let (a, b) = (
        sale_with_buyers(&store, 10, 1).await,
        sale_with_buyers(&store, 10, 1).await,
    );
    let cache = SaleCache::default();
    for sale in [&a, &b] {
        assert!(loader::load_sale(&store, &g, &cache, sale).await.unwrap());
    }
    let parts = [(a.id, 0), (b.id, 0)];
    use SegmentCheck::{Forgotten, Loaded, Unloaded};
    assert_eq!(check(&g, &parts).await, [Loaded, Loaded]);

    // Nothing changed: no hash read (check_loaded.lua's HGETs).
    let hgets = || async {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("cmdstat_hget:calls="))
            .and_then(|l| l.split(',').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let before = hgets().await;
    assert_eq!(check(&g, &parts).await, [Loaded, Loaded]);
    assert_eq!(
        hgets().await,
        before,
        "a hash was read with nothing changed"
    );

    // A hash deleted: found at the next check.
    let _: () = redis::cmd("DEL")
        .arg(&SaleKeys::new("settled", a.id).sale)
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    assert_eq!(check(&g, &parts).await, [Unloaded, Loaded]);
    assert!(hgets().await > before, "the hashes were read");

    // A restart from its AOF: the same keys under a new run id.
    server.restart();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let first = loop {
        let answers = g.check_segments(&parts).await;
        if answers.iter().all(Result::is_ok) {
            break answers.into_iter().map(Result::unwrap).collect::<Vec<_>>();
        }
        assert!(std::time::Instant::now() < deadline, "{answers:?}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(first, [Unloaded, Forgotten], "loaded under the old run id");
    assert!(loader::load_sale(&store, &g, &cache, &b).await.unwrap());
    assert_eq!(check(&g, &parts).await, [Unloaded, Loaded]);
    assert_eq!(check(&g, &parts).await, [Unloaded, Loaded]);
}
