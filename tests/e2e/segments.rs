//! A hot sale over 3 segments on one Redis (the cluster case is in `faults/cluster.rs`): two
//! instances and two workers on PostgreSQL, buyers crowding one segment so that the
//! others' units must move to it.
//!
//! - Exactly the stock is sold, one unit per buyer, nothing stranded: every buyer of the
//!   segments with spare units buys, the crowded segment's buyers take every unit moved.
//! - One segment's Redis state lost is rebuilt alone from SQL: same stock, same buyers.
//! - Unpaid orders expire and each unit goes back to its buyer's segment; sold again.
//! - A move whose mover died after taking the units is finished by the scheduler.

use crate::common;

use std::sync::Arc;

use crate::common::storm::{
    check_segments, check_sql, storm_on, tokens_for, users_of_segment, Arrival,
};
use crate::common::{Server, Sql};
use seckill::gate::Gate;
use seckill::model::OrderStatus;
use seckill::store::Store;

const REDIS: &str = "redis://127.0.0.1:6379/";

struct Deployment {
    instances: Vec<Server>,
    _workers: Vec<common::Worker>,
    store: Store,
    secret: String,
    prefix: String,
}

impl Deployment {
    async fn start() -> Deployment {
        let db = common::fresh_database(Sql::Postgres).await;
        let secret = common::unique("secret");
        let prefix = common::unique("seg");
        let env = vec![
            ("SECKILL_DATABASE_URL".to_string(), db.clone()),
            ("SECKILL_REDIS_URL".to_string(), REDIS.to_string()),
            ("SECKILL_REDIS_PREFIX".to_string(), prefix.clone()),
            ("SECKILL_TOKEN_SECRET".to_string(), secret.clone()),
        ];
        let (instances, workers) = common::storm::instances_and_workers(env).await;
        Deployment {
            instances,
            _workers: workers,
            store: Store::connect(&db, 4).await.unwrap(),
            secret,
            prefix,
        }
    }

    fn bases(&self) -> Vec<String> {
        self.instances.iter().map(|s| s.base.clone()).collect()
    }

    async fn storm(
        &self,
        sale: i64,
        users: &[i64],
    ) -> std::collections::HashMap<i64, common::storm::Told> {
        storm_on(
            self.bases(),
            sale.to_string(),
            tokens_for(&self.secret, users),
            Arrival::Crowd(64),
            Arc::default(),
        )
        .await
    }

    async fn remaining(&self, sale_id: i64) -> i64 {
        self.instances[1].api().remaining(sale_id).await
    }

    /// A sale open now on the first instance, with these fields besides; its id.
    async fn open_sale(&self, stock: i64, extra: serde_json::Value) -> i64 {
        let api = self.instances[0].api();
        api.open_sale_with(stock, 1, &extra).await.parse().unwrap()
    }

    async fn gate(&self) -> seckill::gate::redis::RedisGate {
        let (_, conn) = seckill::app::redis_manager(REDIS).await.unwrap();
        let gate = seckill::gate::redis::RedisGate::new(conn, &self.prefix);
        gate.prepare().await.unwrap();
        gate
    }
}

fn ok_users(told: &std::collections::HashMap<i64, common::storm::Told>) -> Vec<i64> {
    told.iter()
        .filter(|(_, t)| t.last == "ok")
        .map(|(u, _)| *u)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hot_sale_over_three_segments_sells_exactly_its_stock_and_rebuilds_one_segment_alone() {
    const STOCK: i64 = 500;
    let d = Deployment::start().await;
    let sale = d
        .open_sale(
            STOCK,
            serde_json::json!({"segments": 3, "payment_window_secs": 20}),
        )
        .await;

    // 3,000 buyers: 2,800 pinned to segment 0 (167 units), 100 to each of the others
    // (167 and 166 units), the crowd first: units must move to segment 0, or they are
    // stranded while its buyers wait.
    let crowded = users_of_segment(3, 0, 1, 2800);
    let few_1 = users_of_segment(3, 1, 1, 100);
    let few_2 = users_of_segment(3, 2, 1, 100);
    let buyers: Vec<i64> = [crowded.clone(), few_1.clone(), few_2.clone()].concat();
    let told = d.storm(sale, &buyers).await;
    let winners = ok_users(&told);
    assert_eq!(winners.len(), STOCK as usize, "exactly the stock is sold");
    assert!(
        told.values()
            .all(|t| t.last == "ok" || t.last == "sold_out"),
        "every buyer ends with ok or sold_out"
    );
    check_sql(&d.store, sale, STOCK, &told).await;
    d.instances[1].api().check_reconciled(sale).await;
    let stocks = check_segments(&d.store, REDIS, &d.prefix, sale).await;
    assert_eq!(stocks, vec![0, 0, 0], "nothing stranded in any segment");
    let into_crowded: i64 = d
        .store
        .moves_of_sale(sale)
        .await
        .unwrap()
        .iter()
        .filter(|m| m.state == "done")
        .map(|m| {
            i64::from(m.to_segment == 0) * m.quantity - i64::from(m.from_segment == 0) * m.quantity
        })
        .sum();
    let crowded_winners = winners
        .iter()
        .filter(|u| seckill::model::segments::segment_of(**u, 3) == 0)
        .count() as i64;
    assert!(
        crowded_winners > 167,
        "the crowded segment sold more than its share"
    );
    assert_eq!(
        into_crowded,
        crowded_winners - 167,
        "every unit the crowded segment sold beyond its share was moved to it"
    );

    // The Redis state of the crowded segment, where most buyers are, is lost: rebuilt
    // alone, from SQL, with its buyers.
    let k = seckill::redis_client::keys::SaleKeys::for_segment(&d.prefix, sale, 3, 0);
    let (_, mut conn) = seckill::app::redis_manager(REDIS).await.unwrap();
    let _: i64 = redis::cmd("DEL")
        .arg(&k.sale)
        .arg(&k.buyers)
        .arg(&k.moves)
        .arg(&k.accepted)
        .arg(&k.counted)
        .query_async(&mut conn)
        .await
        .unwrap();
    let gate = d.gate().await;
    common::eventually(30, "segment 0 is rebuilt", || async {
        gate.segment_stocks(sale, 3).await.unwrap()[0].is_some()
    })
    .await;
    assert_eq!(
        check_segments(&d.store, REDIS, &d.prefix, sale).await,
        vec![0, 0, 0]
    );
    let rebuilt = gate.stock(sale).await.unwrap().unwrap();
    assert_eq!(
        (rebuilt.remaining, rebuilt.buyers),
        (0, STOCK),
        "the rebuilt segment knows its buyers again"
    );

    // Nobody pays: every order expires and each unit goes back to its buyer's segment.
    let store = d.store.clone();
    common::eventually(90, "every unpaid order expires", || {
        let store = store.clone();
        async move {
            store
                .orders_of_sale(sale)
                .await
                .unwrap()
                .iter()
                .all(|o| o.status == OrderStatus::Expired)
        }
    })
    .await;
    common::eventually(30, "the stock is back in the gate", || async {
        d.remaining(sale).await == STOCK
    })
    .await;
    let back = check_segments(&d.store, REDIS, &d.prefix, sale).await;
    assert_eq!(back.iter().sum::<i64>(), STOCK);

    // Sold again, all of it, to 600 new buyers of segment 1 alone.
    let second = users_of_segment(3, 1, 1_000_000, 600);
    let told = d.storm(sale, &second).await;
    assert_eq!(ok_users(&told).len(), STOCK as usize, "resold, every unit");
    let store = d.store.clone();
    common::eventually(60, "the second wave is written", || {
        let store = store.clone();
        async move { store.orders_of_sale(sale).await.unwrap().len() == 2 * STOCK as usize }
    })
    .await;
    assert_eq!(
        check_segments(&d.store, REDIS, &d.prefix, sale).await,
        vec![0, 0, 0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_move_whose_mover_died_after_taking_is_finished_by_the_scheduler() {
    let d = Deployment::start().await;
    let sale = d.open_sale(90, serde_json::json!({"segments": 3})).await;
    let gate = d.gate().await;
    // A mover plans a move of 10 units from segment 1 to segment 0, takes them, and dies.
    let m = seckill::store::moves::SegmentMove {
        id: 77,
        sale_id: sale,
        from_segment: 1,
        to_segment: 0,
        quantity: 10,
        state: "planned".into(),
        updated_at: 0,
    };
    d.store.plan_move(&m).await.unwrap();
    let leg = seckill::gate::MoveLeg {
        sale_id: sale,
        segments: 3,
        segment: 1,
        move_id: 77,
        quantity: 10,
    };
    assert_eq!(
        gate.take_for_move(leg).await.unwrap(),
        seckill::gate::MoveStep::Done
    );
    assert_eq!(
        gate.take_for_move(leg).await.unwrap(),
        seckill::gate::MoveStep::Done,
        "a repeated take takes nothing more"
    );
    assert_eq!(
        gate.segment_stocks(sale, 3).await.unwrap(),
        vec![Some(30), Some(20), Some(30)]
    );
    // The units are in neither segment until the scheduler finishes the move.
    let store = d.store.clone();
    common::eventually(30, "the stalled move is finished", || {
        let store = store.clone();
        async move { store.segment_move(77).await.unwrap().unwrap().state == "done" }
    })
    .await;
    assert_eq!(
        check_segments(&d.store, REDIS, &d.prefix, sale).await,
        vec![40, 20, 30]
    );
    // And a move planned but never taken, left behind by a dead mover, is refused or
    // carried out, never half done.
    let m = seckill::store::moves::SegmentMove {
        id: 78,
        to_segment: 2,
        from_segment: 0,
        quantity: 5,
        ..m
    };
    d.store.plan_move(&m).await.unwrap();
    common::eventually(30, "the planned move is settled", || {
        let store = store.clone();
        async move { store.segment_move(78).await.unwrap().unwrap().state == "done" }
    })
    .await;
    assert_eq!(
        check_segments(&d.store, REDIS, &d.prefix, sale).await,
        vec![35, 20, 35]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_sigkilled_while_moving_stock_lose_no_order_and_strand_no_unit() {
    const STOCK: i64 = 400;
    let mut d = Deployment::start().await;
    let sale = d.open_sale(STOCK, serde_json::json!({"segments": 3})).await;
    // Most buyers in segment 0, so units keep moving there while the instances die.
    let mut buyers = users_of_segment(3, 0, 1, 2400);
    buyers.extend(users_of_segment(3, 1, 1, 300));
    buyers.extend(users_of_segment(3, 2, 1, 300));
    let order: Vec<i64> = {
        // Interleaved, so every segment's buyers keep arriving.
        let mut v = buyers.clone();
        v.sort_by_key(|u| seckill::model::segments::segment_of(*u * 7919, 5));
        v
    };
    let storm = tokio::spawn(storm_on(
        d.bases(),
        sale.to_string(),
        tokens_for(&d.secret, &order),
        Arrival::Every(std::time::Duration::from_millis(3)),
        Arc::default(),
    ));
    for victim in [0, 1, 0] {
        tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        d.instances[victim].kill();
        d.instances[victim].restart().await;
    }
    let mut told = storm.await.unwrap();
    // Moves their movers left part-way are finished by the scheduler; buyers who come
    // after that buy whatever they brought back.
    let store = d.store.clone();
    common::eventually(30, "no move is left half done", || {
        let store = store.clone();
        async move { store.units_moving(sale).await.unwrap() == 0 }
    })
    .await;
    let late = users_of_segment(3, 0, 2_000_000, 200);
    let later = d.storm(sale, &late).await;
    common::storm::merge(&mut told, later.clone());
    for (u, t) in later {
        told.get_mut(&u).unwrap().last = t.last;
    }
    check_sql(&d.store, sale, STOCK, &told).await;
    let sold = d.store.orders_of_sale(sale).await.unwrap().len() as i64;
    assert_eq!(sold, STOCK, "every unit sold while buyers remained");
    assert_eq!(
        check_segments(&d.store, REDIS, &d.prefix, sale).await,
        vec![0, 0, 0]
    );
}
