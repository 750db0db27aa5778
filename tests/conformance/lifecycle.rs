//! Lifecycle races against every SQL backend, and the gate's release against every gate:
//! payment and expiry at the same instant, cancel twice at once, the same notification
//! delivered concurrently, and an expired order redelivered by the order log.

use crate::common;

use std::sync::Arc;

use crate::common::ALL_SQL;
use seckill::gate::{Gate, Purchase, Release, Released, SaleLoad, Verdict};
use seckill::model::{NewOrder, OrderStatus};
use seckill::store::Store;
use seckill::store::{Outcome, Payment, PaymentSettlement, TransitionError};

async fn written_orders(store: &Store, sale_id: i64, n: i64) -> Vec<NewOrder> {
    let orders: Vec<NewOrder> = (0..n)
        .map(|u| NewOrder {
            id: common::next_id(),
            sale_id,
            user_id: 100 + u,
            quantity: 1,
            price_cents: 999,
            accepted_at: seckill::clock::wall_ms(),
            retry_key: None,
        })
        .collect();
    store.write_orders(&orders).await.unwrap();
    orders
}

async fn live_units(store: &Store, sale_id: i64) -> i64 {
    store
        .orders_of_sale(sale_id)
        .await
        .unwrap()
        .iter()
        .filter(|o| matches!(o.status, OrderStatus::Paid | OrderStatus::PendingPayment))
        .map(|o| o.quantity)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn payment_and_expiry_at_the_same_instant_have_one_winner() {
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let sale = common::sale(common::next_id(), 40, 1);
        store.create_sale(&sale).await.unwrap();
        let orders = written_orders(&store, sale.id, 40).await;
        let mut tasks = Vec::new();
        for o in &orders {
            let deadline = store.order(o.id).await.unwrap().unwrap().pay_deadline;
            for outcome in [Outcome::Paid, Outcome::Expired] {
                let (store, id) = (store.clone(), o.id);
                // Both guards hold at these instants: only the status guard can decide.
                let now = if outcome == Outcome::Paid {
                    deadline - 1
                } else {
                    deadline
                };
                tasks.push(tokio::spawn(async move {
                    (id, store.transition(id, None, outcome, now, "race").await)
                }));
            }
        }
        let mut wins = std::collections::HashMap::new();
        for t in tasks {
            let (id, r) = t.await.unwrap();
            match r {
                Ok(_) => *wins.entry(id).or_insert(0) += 1,
                Err(TransitionError::Illegal { .. }) => {}
                Err(e) => panic!("{kind:?}: {e}"),
            }
        }
        assert_eq!(wins.len(), 40, "{kind:?}: every order settled");
        assert!(
            wins.values().all(|n| *n == 1),
            "{kind:?}: exactly one winner per order"
        );
        let expired = store
            .orders_of_sale(sale.id)
            .await
            .unwrap()
            .iter()
            .filter(|o| o.status == OrderStatus::Expired)
            .count() as i64;
        let returns = store.pending_returns(Some(sale.id), 1000).await.unwrap();
        assert_eq!(
            returns.len() as i64,
            expired,
            "{kind:?}: one return per expired order"
        );
        let stock = store.sale(sale.id).await.unwrap().unwrap().stock;
        assert_eq!(stock + live_units(&store, sale.id).await, 40, "{kind:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancel_twice_at_once_returns_stock_once() {
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let sale = common::sale(common::next_id(), 5, 1);
        store.create_sale(&sale).await.unwrap();
        let o = written_orders(&store, sale.id, 1).await.remove(0);
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move {
                    store
                        .transition(
                            o.id,
                            Some(o.user_id),
                            Outcome::Cancelled,
                            seckill::clock::wall_ms(),
                            "c",
                        )
                        .await
                })
            })
            .collect();
        let mut ok = 0;
        for t in tasks {
            match t.await.unwrap() {
                Ok(_) => ok += 1,
                Err(TransitionError::Illegal {
                    from: "cancelled", ..
                }) => {}
                Err(e) => panic!("{kind:?}: {e}"),
            }
        }
        assert_eq!(ok, 1, "{kind:?}");
        assert_eq!(
            store.sale(sale.id).await.unwrap().unwrap().stock,
            5,
            "{kind:?}: returned once"
        );
        assert_eq!(
            store
                .pending_returns(Some(sale.id), 10)
                .await
                .unwrap()
                .len(),
            1,
            "{kind:?}"
        );
        let other_user = store
            .transition(
                o.id,
                Some(o.user_id + 1),
                Outcome::Cancelled,
                seckill::clock::wall_ms(),
                "c",
            )
            .await;
        assert!(
            matches!(other_user, Err(TransitionError::NoSuchOrder(_))),
            "{kind:?}"
        );
    }
}

/// Twenty buyers' clients asking to pay one order at once open one intent between them: the
/// database holds at most one open intent per order, so the buyer can be charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_to_pay_one_order_open_one_intent() {
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let sale = common::sale(common::next_id(), 5, 1);
        store.create_sale(&sale).await.unwrap();
        let order = written_orders(&store, sale.id, 1).await.remove(0);
        let tasks: Vec<_> = (0..20)
            .map(|_| {
                let store = store.clone();
                let p = Payment {
                    intent_id: common::next_id(),
                    order_id: order.id,
                    user_id: order.user_id,
                    amount_cents: 999,
                    status: "created".into(),
                    created_at: seckill::clock::wall_ms(),
                };
                tokio::spawn(async move { store.open_payment(&p).await.unwrap().intent_id })
            })
            .collect();
        let mut answered = std::collections::HashSet::new();
        for t in tasks {
            answered.insert(t.await.unwrap());
        }
        assert_eq!(
            answered.len(),
            1,
            "{kind:?}: every call answers the same intent"
        );
        let open: i64 = sqlx::query_scalar(&format!(
            "SELECT COUNT(*) FROM payments WHERE order_id = {} AND status = 'created'",
            order.id
        ))
        .fetch_one(store.pool())
        .await
        .unwrap();
        assert_eq!(open, 1, "{kind:?}");
        // Once it failed, the buyer may open another (one again).
        let first = *answered.iter().next().unwrap();
        assert!(store
            .fail_payment(first, "declined", seckill::clock::wall_ms())
            .await
            .unwrap());
        let again = Payment {
            intent_id: common::next_id(),
            order_id: order.id,
            user_id: order.user_id,
            amount_cents: 999,
            status: "created".into(),
            created_at: seckill::clock::wall_ms(),
        };
        assert_eq!(
            store.open_payment(&again).await.unwrap().intent_id,
            again.intent_id
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_notification_delivered_many_times_pays_once_and_a_late_one_is_refunded() {
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let sale = common::sale(common::next_id(), 5, 1);
        store.create_sale(&sale).await.unwrap();
        let orders = written_orders(&store, sale.id, 2).await;
        let mut intents = Vec::new();
        for o in &orders {
            let p = Payment {
                intent_id: common::next_id(),
                order_id: o.id,
                user_id: o.user_id,
                amount_cents: 999,
                status: "created".into(),
                created_at: seckill::clock::wall_ms(),
            };
            assert_eq!(store.open_payment(&p).await.unwrap().intent_id, p.intent_id);
            intents.push(p.intent_id);
        }
        let tasks: Vec<_> = (0..6)
            .map(|_| {
                let (store, intent) = (store.clone(), intents[0]);
                tokio::spawn(async move {
                    store
                        .settle_payment(intent, "ref", seckill::clock::wall_ms())
                        .await
                        .unwrap()
                })
            })
            .collect();
        let mut outcomes = Vec::new();
        for t in tasks {
            outcomes.push(t.await.unwrap());
        }
        assert_eq!(
            outcomes
                .iter()
                .filter(|o| **o == PaymentSettlement::Paid)
                .count(),
            1,
            "{kind:?}: {outcomes:?}"
        );
        assert!(outcomes
            .iter()
            .all(|o| matches!(o, PaymentSettlement::Paid | PaymentSettlement::Duplicate)));
        assert_eq!(
            store.payment(intents[0]).await.unwrap().unwrap().status,
            "paid",
            "{kind:?}"
        );

        // The second order expires before its payment arrives: refund due, no oversell.
        let deadline = store
            .order(orders[1].id)
            .await
            .unwrap()
            .unwrap()
            .pay_deadline;
        store
            .transition(orders[1].id, None, Outcome::Expired, deadline, "deadline")
            .await
            .unwrap();
        let late = store
            .settle_payment(intents[1], "ref2", deadline + 1)
            .await
            .unwrap();
        assert_eq!(late, PaymentSettlement::RefundDue, "{kind:?}");
        assert_eq!(
            store.order(orders[1].id).await.unwrap().unwrap().status,
            OrderStatus::Expired
        );
        assert_eq!(
            store.payment(intents[1]).await.unwrap().unwrap().status,
            "refund_due",
            "{kind:?}"
        );
        assert_eq!(
            store.sale(sale.id).await.unwrap().unwrap().stock + live_units(&store, sale.id).await,
            5
        );

        // The order log redelivering an order that has since expired writes nothing.
        let again = store.write_orders(&orders).await.unwrap();
        assert_eq!((again.written, again.duplicates), (0, 2), "{kind:?}");
        assert_eq!(
            store.order(orders[1].id).await.unwrap().unwrap().status,
            OrderStatus::Expired,
            "{kind:?}"
        );
        assert_eq!(
            store.sale(sale.id).await.unwrap().unwrap().stock,
            4,
            "{kind:?}: stock not taken twice"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gates_take_each_order_back_once_and_skip_what_their_load_counted() {
    let (_, conn) = seckill::app::redis_manager(&common::redis_url())
        .await
        .unwrap();
    let redis = seckill::gate::redis::RedisGate::new(conn, &common::unique("rel"));
    redis.prepare().await.unwrap();
    let (log, reader) = seckill::orderlog::local::channel();
    let (store, _) = common::fresh_store(common::Sql::Sqlite).await;
    let writer = seckill::writer::Writer {
        log: Arc::new(reader),
        store: store.clone(),
        // The memory gate needs no confirmation of written orders.
        gate: Arc::new(seckill::gate::memory::MemoryGate::new(
            seckill::orderlog::local::channel().0,
        )),
        batch_max: 100,
        stats: Default::default(),
        fenced: false,
        turn: Default::default(),
        linger: std::time::Duration::ZERO,
    };
    let (_stop, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(writer.run(stop_rx));
    let gates: Vec<(&str, Arc<dyn Gate>)> = vec![
        (
            "memory",
            Arc::new(seckill::gate::memory::MemoryGate::new(log)),
        ),
        ("redis", Arc::new(redis)),
    ];
    for (name, gate) in gates {
        let mut sale = common::sale(common::next_id(), 1, 1);
        // SQL gets room for the second purchase: here only the gate sees the release.
        sale.stock = 2;
        store.create_sale(&sale).await.unwrap();
        let counted = common::next_id();
        let load = SaleLoad {
            sale: sale.clone(),
            remaining: 1,
            buyers: vec![],
            released: vec![counted],
            counted: vec![],
            segment: 0,
            moves: Vec::new(),
        };
        gate.load(&load).await.unwrap();
        let order_id = common::next_id();
        let buy = |user, order_id| Purchase {
            sale_id: sale.id,
            user_id: user,
            quantity: 1,
            order_id,
            token: None,
            segments: 1,
            after_move: false,
            retry_key: None,
        };
        assert!(
            matches!(
                gate.purchase(buy(1, order_id)).await.unwrap(),
                Verdict::Accepted { remaining: 0 }
            ),
            "{name}"
        );
        let release = Release {
            sale_id: sale.id,
            order_id,
            user_id: 1,
            quantity: 1,
        };
        let results = futures_join(gate.clone(), release, 5).await;
        assert_eq!(
            results.iter().filter(|r| **r == Released::Now).count(),
            1,
            "{name}: {results:?}"
        );
        let stock = gate.stock(sale.id).await.unwrap().unwrap();
        assert_eq!(
            (stock.remaining, stock.buyers),
            (1, 0),
            "{name}: unit and slot back once"
        );
        // The same user may buy again; a release the load already counted changes nothing.
        assert!(
            matches!(
                gate.purchase(buy(1, common::next_id())).await.unwrap(),
                Verdict::Accepted { .. }
            ),
            "{name}"
        );
        let counted_release = Release {
            order_id: counted,
            user_id: 9,
            ..release
        };
        assert_eq!(
            gate.release(counted_release).await.unwrap(),
            Released::Before,
            "{name}"
        );
        assert_eq!(
            gate.stock(sale.id).await.unwrap().unwrap().remaining,
            0,
            "{name}"
        );
        let absent = Release {
            sale_id: common::next_id(),
            ..release
        };
        assert_eq!(
            gate.release(absent).await.unwrap(),
            Released::NotLoaded,
            "{name}"
        );
    }
}

async fn futures_join(gate: Arc<dyn Gate>, r: Release, n: usize) -> Vec<Released> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let gate = gate.clone();
            tokio::spawn(async move { gate.release(r).await.unwrap() })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// A mass expiry goes a batch per transaction and stops at its budget: a pass with no
/// budget expires one batch, later passes the rest; paid orders stay paid, every expired
/// order owes one return, and the kept counters agree with a recount all along.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_mass_expiry_goes_in_batches_within_a_budget_and_keeps_the_counters() {
    use std::time::Duration;
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let clock = seckill::clock::SimClock::new(seckill::clock::wall_ms());
        let store = store.with_clock(clock.clone());
        let sale = common::sale(common::next_id(), 1100, 1);
        store.create_sale(&sale).await.unwrap();
        let orders = written_orders(&store, sale.id, 1100).await;
        for o in &orders[..30] {
            store
                .transition(o.id, None, Outcome::Paid, store.now_ms(), "paid")
                .await
                .unwrap();
        }
        clock.advance(901_000);
        // A paid order in a batch is passed over; the batch goes on.
        let mixed = store
            .expire_orders(&[orders[0].id, orders[30].id, orders[1].id], store.now_ms())
            .await
            .unwrap();
        assert_eq!(mixed, 1, "{kind:?}: only the unpaid order expires");
        let first = seckill::lifecycle::expire_due(&store, Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(
            first, 500,
            "{kind:?}: a pass without budget expires one batch"
        );
        let recount = |store: Store| async move {
            store
                .recount_paced(sale.id, seckill::store::Pace::FULL, 10, &|_| {})
                .await
                .unwrap()
                .unwrap()
        };
        assert!(recount(store.clone()).await.agrees(), "{kind:?}: mid-way");
        let rest = seckill::lifecycle::expire_due(&store, Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(rest, 569, "{kind:?}: the next pass expires the rest");
        let again = seckill::lifecycle::expire_due(&store, Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(again, 0, "{kind:?}: nothing left to expire");
        let stored = store.orders_of_sale(sale.id).await.unwrap();
        let count = |s: OrderStatus| stored.iter().filter(|o| o.status == s).count();
        assert_eq!(count(OrderStatus::Paid), 30, "{kind:?}");
        assert_eq!(count(OrderStatus::Expired), 1070, "{kind:?}");
        let returns = store.pending_returns(Some(sale.id), 2000).await.unwrap();
        assert_eq!(
            returns.len(),
            1070,
            "{kind:?}: one return per expired order"
        );
        let ids: Vec<i64> = returns.iter().map(|r| r.order_id).collect();
        store.mark_all_returned(&ids, store.now_ms()).await.unwrap();
        store.mark_all_returned(&ids, store.now_ms()).await.unwrap();
        assert!(store
            .pending_returns(Some(sale.id), 2000)
            .await
            .unwrap()
            .is_empty());
        let end = recount(store.clone()).await;
        assert!(end.agrees(), "{kind:?}: {end:?}");
        assert_eq!(end.kept.live_units, 30, "{kind:?}");
        assert_eq!(
            store.sale(sale.id).await.unwrap().unwrap().stock,
            1070,
            "{kind:?}"
        );
    }
}

/// A pass clearing a sale's returns from the outbox while buyers' cancels clear their own
/// (the same rows, met in the opposite order), and an expiry batch while buyers cancel
/// its orders, never deadlock: every clearing succeeds the first time, each order ends
/// cancelled or expired with one return, and the kept counters agree with a recount. A
/// pass that took the sale's row after its first return deadlocked with such cancels.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn outbox_passes_and_expiry_batches_beside_cancels_never_deadlock() {
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let clock = seckill::clock::SimClock::new(seckill::clock::wall_ms());
        let store = store.with_clock(clock.clone());
        let sale = common::sale(common::next_id(), 600, 1);
        store.create_sale(&sale).await.unwrap();
        let orders = written_orders(&store, sale.id, 600).await;
        let (cancelled, unpaid) = orders.split_at(400);

        for round in cancelled.chunks(100) {
            for o in round {
                store
                    .transition(o.id, None, Outcome::Cancelled, store.now_ms(), "cancel")
                    .await
                    .unwrap();
            }
            let ids: Vec<i64> = round.iter().map(|o| o.id).collect();
            let pass = {
                let store = store.clone();
                tokio::spawn(async move { store.mark_all_returned(&ids, store.now_ms()).await })
            };
            let singles: Vec<_> = round
                .iter()
                .rev()
                .map(|o| {
                    let (store, id) = (store.clone(), o.id);
                    tokio::spawn(async move { store.mark_returned(id, store.now_ms()).await })
                })
                .collect();
            pass.await
                .unwrap()
                .unwrap_or_else(|e| panic!("{kind:?}: the pass: {e}"));
            for s in singles {
                s.await
                    .unwrap()
                    .unwrap_or_else(|e| panic!("{kind:?}: a cancel's clearing: {e}"));
            }
        }
        assert!(
            store
                .pending_returns(Some(sale.id), 1000)
                .await
                .unwrap()
                .is_empty(),
            "{kind:?}"
        );

        clock.advance(901_000);
        let ids: Vec<i64> = unpaid.iter().map(|o| o.id).collect();
        let batch = {
            let store = store.clone();
            tokio::spawn(async move { store.expire_orders(&ids, store.now_ms()).await })
        };
        let cancels: Vec<_> = unpaid
            .iter()
            .rev()
            .map(|o| {
                let (store, id) = (store.clone(), o.id);
                tokio::spawn(async move {
                    store
                        .transition(id, None, Outcome::Cancelled, store.now_ms(), "cancel")
                        .await
                })
            })
            .collect();
        let expired = batch.await.unwrap().unwrap();
        let mut cancelled_late = 0;
        for c in cancels {
            match c.await.unwrap() {
                Ok(_) => cancelled_late += 1,
                Err(TransitionError::Illegal { .. }) => {}
                Err(e) => panic!("{kind:?}: a cancel beside the expiry: {e}"),
            }
        }
        assert_eq!(expired + cancelled_late, unpaid.len(), "{kind:?}");
        let returns = store.pending_returns(Some(sale.id), 1000).await.unwrap();
        assert_eq!(returns.len(), unpaid.len(), "{kind:?}: one return each");
        let end = store
            .recount_paced(sale.id, seckill::store::Pace::FULL, 10, &|_| {})
            .await
            .unwrap()
            .unwrap();
        assert!(end.agrees(), "{kind:?}: {end:?}");
        assert_eq!(end.kept.live_units, 0, "{kind:?}");
    }
}

/// One expiry batch over two sales, holding a buyer's two orders, an order of two units, a
/// paid order and an order not yet due among its ids (given in no order): every figure as
/// if each due order had expired alone (the recount, tallies included, agrees), and the
/// others untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expiry_batch_over_two_sales_keeps_every_figure() {
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let clock = seckill::clock::SimClock::new(seckill::clock::wall_ms());
        let store = store.with_clock(clock.clone());
        let (a, b) = (
            common::sale(common::next_id(), 100, 2),
            common::sale(common::next_id(), 100, 2),
        );
        store.create_sale(&a).await.unwrap();
        store.create_sale(&b).await.unwrap();
        let now = seckill::clock::wall_ms();
        let order = |sale_id, user_id, quantity, accepted_at| NewOrder {
            id: common::next_id(),
            sale_id,
            user_id,
            quantity,
            price_cents: 999,
            accepted_at,
            retry_key: None,
        };
        let orders = [
            order(a.id, 1, 1, now),
            order(a.id, 1, 1, now),
            order(a.id, 2, 2, now),
            order(a.id, 3, 1, now),
            order(a.id, 5, 1, now),
            order(b.id, 1, 1, now),
            order(b.id, 4, 1, now),
        ];
        let (late, early): (Vec<NewOrder>, Vec<NewOrder>) =
            orders.iter().cloned().partition(|o| o.user_id == 5);
        store.write_orders(&early).await.unwrap();
        store
            .transition(orders[3].id, None, Outcome::Paid, store.now_ms(), "paid")
            .await
            .unwrap();
        clock.advance(901_000);
        // Written now: its payment window has just begun.
        store.write_orders(&late).await.unwrap();
        let ids: Vec<i64> = orders.iter().rev().map(|o| o.id).collect();
        let expired = store.expire_orders(&ids, store.now_ms()).await.unwrap();
        assert_eq!(expired, 5, "{kind:?}");
        let status = |id: i64| {
            let store = store.clone();
            async move { store.order(id).await.unwrap().unwrap().status }
        };
        assert_eq!(status(orders[3].id).await, OrderStatus::Paid, "{kind:?}");
        assert_eq!(
            status(orders[4].id).await,
            OrderStatus::PendingPayment,
            "{kind:?}: not due yet"
        );
        // (sale, live units, live buyers, stock, returns owed)
        for (sale, units, buyers, stock, owed) in [(a.id, 2, 2, 98, 3), (b.id, 0, 0, 100, 2)] {
            let end = store
                .recount_paced(sale, seckill::store::Pace::FULL, 10, &|_| {})
                .await
                .unwrap()
                .unwrap();
            assert!(end.agrees(), "{kind:?}: {end:?}");
            assert_eq!(end.kept.live_units, units, "{kind:?}");
            assert_eq!(end.kept.live_buyers, buyers, "{kind:?}");
            assert_eq!(
                store.sale(sale).await.unwrap().unwrap().stock,
                stock,
                "{kind:?}"
            );
            let returns = store.pending_returns(Some(sale), 100).await.unwrap();
            assert_eq!(returns.len(), owed, "{kind:?}");
        }
    }
}
