//! The order writer against a real database: what it does with a batch SQL refuses.

use crate::common;
use crate::common::order;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use seckill::model::NewOrder;
use seckill::orderlog::{local, Batch, Delivery, Receipt};
use seckill::store::Store;
use seckill::writer::{Writer, WriterStats};

/// A writer of `store` reading `log`, alone (no fence, no linger).
fn writer_of(store: &Store, log: local::LocalLogReader, batch_max: usize) -> Writer {
    Writer {
        log: Arc::new(log),
        store: store.clone(),
        gate: Arc::new(seckill::gate::memory::MemoryGate::new(local::channel().0)),
        batch_max,
        stats: Arc::new(WriterStats::default()),
        fenced: false,
        turn: Default::default(),
        linger: std::time::Duration::ZERO,
    }
}

/// A batch of 4,000 orders with two SQL refuses (a sale it does not know, a buyer over the
/// limit): every other order is written, the two are dead-lettered, and the batch is found
/// out by halving, in a few dozen transactions rather than one per order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_order_is_found_by_halving_and_the_rest_written() {
    for kind in [common::Sql::Sqlite, common::Sql::Postgres] {
        let (store, _) = common::fresh_store(kind).await;
        let sale = common::sale(common::next_id(), 10_000, 1);
        store.create_sale(&sale).await.unwrap();
        // Buyer 7 holds their one unit already.
        store.write_orders(&[order(sale.id, 7)]).await.unwrap();
        let mut orders: Vec<NewOrder> = (100..4_098).map(|u| order(sale.id, u)).collect();
        orders.insert(1_234, order(common::next_id(), 5));
        orders.insert(3_000, order(sale.id, 7));
        let writer = writer_of(&store, local::channel().1, 5_000);
        let deliveries = orders
            .iter()
            .map(|o| Delivery {
                order: o.clone(),
                receipt: Receipt::Local {
                    order: o.clone(),
                    segment: 0,
                },
            })
            .collect();
        writer
            .process(Batch {
                deliveries,
                malformed: Vec::new(),
                capped: false,
            })
            .await;
        let stats = &writer.stats;
        assert_eq!(stats.dead_letters.load(Ordering::Relaxed), 2, "{kind:?}");
        assert_eq!(stats.over_limit.load(Ordering::Relaxed), 1, "{kind:?}");
        assert_eq!(
            stats.written.load(Ordering::Relaxed),
            3_998,
            "{kind:?}: every order but the two"
        );
        assert_eq!(store.orders_of_sale(sale.id).await.unwrap().len(), 3_999);
        let commits = stats.batches.load(Ordering::Relaxed);
        assert!(
            commits <= 2 * 13,
            "{kind:?}: {commits} commits for 4,000 orders with two refused"
        );
    }
}

/// A writer stops by itself when nothing can reach it any more: its order log closed (no
/// appender left, as the SQL gates' deployments once handed it) or its stop sender
/// dropped. Either used to leave it reading "nothing" back to back, for ever,
/// on a core of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_nobody_can_reach_stops() {
    let (store, _) = common::fresh_store(common::Sql::Sqlite).await;
    let writer = |log| writer_of(&store, log, 100);
    let limit = std::time::Duration::from_secs(10);

    let (_stop, stop_rx) = tokio::sync::watch::channel(false);
    let (_, closed) = local::channel();
    tokio::time::timeout(limit, writer(closed).run(stop_rx))
        .await
        .expect("a writer of a closed log stops");

    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let (_log, open) = local::channel();
    let running = tokio::spawn(writer(open).run(stop_rx));
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!running.is_finished(), "an open log keeps its writer");
    drop(stop);
    tokio::time::timeout(limit, running)
        .await
        .expect("a writer whose stop sender is gone stops")
        .unwrap();
}
