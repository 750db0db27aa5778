//! One store suite, run against SQLite, PostgreSQL and MariaDB (each test in a database of
//! its own): idempotent batch writes, the stock guard, concurrent writers, migrations.

use crate::common;

use std::collections::HashSet;
use std::sync::Arc;

use crate::common::{Sql, ALL_SQL};
use seckill::model::{NewOrder, OrderStatus};
use seckill::store::{Store, StoreError};

fn order(sale_id: i64, user_id: i64, quantity: i64) -> NewOrder {
    NewOrder {
        id: common::next_id(),
        sale_id,
        user_id,
        quantity,
        price_cents: 999,
        accepted_at: seckill::clock::wall_ms(),
        retry_key: None,
    }
}

async fn stock(store: &Store, sale_id: i64) -> i64 {
    store.sale(sale_id).await.unwrap().unwrap().stock
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_written_once_however_often_it_is_delivered() {
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let sale = common::sale(common::next_id(), 100, 2);
        store.create_sale(&sale).await.unwrap();
        let batch: Vec<NewOrder> = (0..40).map(|u| order(sale.id, u, 1 + u % 2)).collect();
        let units: i64 = batch.iter().map(|o| o.quantity).sum();

        let first = store.write_orders(&batch).await.unwrap();
        assert_eq!((first.written, first.duplicates), (40, 0), "{kind:?}");
        assert_eq!(stock(&store, sale.id).await, 100 - units, "{kind:?}");

        let again = store.write_orders(&batch).await.unwrap();
        assert_eq!(
            (again.written, again.duplicates),
            (0, 40),
            "{kind:?}: redelivery writes nothing"
        );
        assert_eq!(
            stock(&store, sale.id).await,
            100 - units,
            "{kind:?}: stock taken once"
        );

        // A batch mixing old and new entries, with one entry twice in it.
        let mut mixed: Vec<NewOrder> = batch[..10].to_vec();
        let fresh = order(sale.id, 999, 1);
        mixed.push(fresh.clone());
        mixed.push(fresh.clone());
        let out = store.write_orders(&mixed).await.unwrap();
        assert_eq!((out.written, out.duplicates), (1, 11), "{kind:?}");
        assert_eq!(stock(&store, sale.id).await, 100 - units - 1, "{kind:?}");

        let orders = store.orders_of_sale(sale.id).await.unwrap();
        assert_eq!(orders.len(), 41, "{kind:?}");
        assert!(
            orders
                .iter()
                .all(|o| o.status == OrderStatus::PendingPayment),
            "{kind:?}"
        );
        let deadline = orders[0].pay_deadline - seckill::clock::wall_ms();
        assert!(
            deadline > 890_000 && deadline <= 900_000,
            "{kind:?}: deadline from the sale's window"
        );
        let counts = store.sale_counts(sale.id).await.unwrap();
        assert_eq!((counts.orders, counts.units), (41, units + 1), "{kind:?}");
    }
}

/// A redelivered batch that took the last units, or its buyers' whole limit, is skipped, not
/// refused by the guards its own earlier write trips: a writer that counted a batch's
/// units before looking its orders up (a shortcut once tried) would dead-letter it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_batch_that_took_the_last_units_is_skipped_not_refused() {
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let sale = common::sale(common::next_id(), 6, 2);
        store.create_sale(&sale).await.unwrap();
        let batch: Vec<NewOrder> = (0..3).map(|u| order(sale.id, u, 2)).collect();
        let first = store.write_orders(&batch).await.unwrap();
        assert_eq!((first.written, first.duplicates), (3, 0), "{kind:?}");
        assert_eq!(stock(&store, sale.id).await, 0, "{kind:?}");

        let again = store.write_orders(&batch).await.unwrap();
        assert_eq!((again.written, again.duplicates), (0, 3), "{kind:?}");
        let one_again = store.write_orders(&batch[1..2]).await.unwrap();
        assert_eq!(
            (one_again.written, one_again.duplicates),
            (0, 1),
            "{kind:?}"
        );
        assert_eq!(stock(&store, sale.id).await, 0, "{kind:?}");
        assert_eq!(
            store.orders_of_sale(sale.id).await.unwrap().len(),
            3,
            "{kind:?}"
        );

        // A new order past the stock is still refused, with its batch's redelivered ones.
        let mut over = batch.clone();
        over.push(order(sale.id, 7, 1));
        let err = store.write_orders(&over).await.unwrap_err();
        assert!(
            matches!(err, StoreError::StockGuard { sale_id } if sale_id == sale.id),
            "{kind:?}: {err}"
        );
        let counts = store.sale_counts(sale.id).await.unwrap();
        assert_eq!((counts.orders, counts.units), (3, 6), "{kind:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stock_guard_rolls_back_the_whole_batch() {
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let sale = common::sale(common::next_id(), 3, 5);
        store.create_sale(&sale).await.unwrap();
        let batch = vec![order(sale.id, 1, 2), order(sale.id, 2, 2)];
        let err = store.write_orders(&batch).await.unwrap_err();
        assert!(
            matches!(err, StoreError::StockGuard { sale_id } if sale_id == sale.id),
            "{kind:?}: {err}"
        );
        assert!(!err.is_transient(), "{kind:?}");
        assert_eq!(stock(&store, sale.id).await, 3, "{kind:?}: nothing taken");
        assert!(
            store.orders_of_sale(sale.id).await.unwrap().is_empty(),
            "{kind:?}: nothing written"
        );

        let err = store
            .write_orders(&[order(common::next_id(), 1, 1)])
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::UnknownSale(_)), "{kind:?}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_of_the_same_entries_write_each_once() {
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let sale = common::sale(common::next_id(), 1000, 1);
        store.create_sale(&sale).await.unwrap();
        let batch: Arc<Vec<NewOrder>> = Arc::new((0..300).map(|u| order(sale.id, u, 1)).collect());
        // Four writers race over overlapping slices of the same entries, as a writer and a
        // reclaiming writer would; transient conflicts are retried as the writer does.
        let tasks: Vec<_> = (0..4)
            .map(|w| {
                let (store, batch) = (store.clone(), batch.clone());
                tokio::spawn(async move {
                    for chunk in batch[w * 50..].chunks(60) {
                        loop {
                            match store.write_orders(chunk).await {
                                Ok(_) => break,
                                Err(e) if e.is_transient() => tokio::task::yield_now().await,
                                Err(e) => panic!("{e}"),
                            }
                        }
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let orders = store.orders_of_sale(sale.id).await.unwrap();
        let ids: HashSet<i64> = orders.iter().map(|o| o.id).collect();
        assert_eq!(orders.len(), 300, "{kind:?}");
        assert_eq!(ids.len(), 300, "{kind:?}");
        assert_eq!(
            stock(&store, sale.id).await,
            700,
            "{kind:?}: stock taken once per order"
        );
    }
}

/// SQL is the last line of defence: however the gate errs, no buyer ends up over the
/// sale's limit, even when writers race on the same buyers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sql_refuses_an_order_over_the_buyers_limit() {
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let sale = common::sale(common::next_id(), 10_000, 2);
        store.create_sale(&sale).await.unwrap();

        // Within one batch: 1 + 2 units for one buyer is over a limit of 2.
        let err = store
            .write_orders(&[order(sale.id, 7, 1), order(sale.id, 7, 2)])
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::UserLimit {
                    user_id: 7,
                    held: 0,
                    limit: 2,
                    ..
                }
            ),
            "{kind:?}: {err}"
        );
        assert!(!err.is_transient(), "{kind:?}");
        assert!(store.orders_of_sale(sale.id).await.unwrap().is_empty());

        // Across batches and racing writers: 200 buyers, each sent three one-unit orders by
        // three writers at once; each buyer ends with exactly two.
        let users: Vec<i64> = (1000..1200).collect();
        let tasks: Vec<_> = (0..3)
            .map(|_| {
                let (store, users) = (store.clone(), users.clone());
                let sale_id = sale.id;
                tokio::spawn(async move {
                    let (mut written, mut refused) = (0, 0);
                    for chunk in users.chunks(25) {
                        let batch: Vec<NewOrder> =
                            chunk.iter().map(|u| order(sale_id, *u, 1)).collect();
                        loop {
                            match store.write_orders(&batch).await {
                                Ok(o) => {
                                    written += o.written;
                                    break;
                                }
                                Err(e) if e.is_transient() => tokio::task::yield_now().await,
                                // As the writer does: one by one, the refused one set aside.
                                Err(StoreError::UserLimit { .. }) => {
                                    for o in &batch {
                                        loop {
                                            match store.write_orders(std::slice::from_ref(o)).await
                                            {
                                                Ok(out) => written += out.written,
                                                Err(e) if e.is_transient() => {
                                                    tokio::task::yield_now().await;
                                                    continue;
                                                }
                                                Err(StoreError::UserLimit { .. }) => refused += 1,
                                                Err(e) => panic!("{e}"),
                                            }
                                            break;
                                        }
                                    }
                                    break;
                                }
                                Err(e) => panic!("{e}"),
                            }
                        }
                    }
                    (written, refused)
                })
            })
            .collect();
        let (mut written, mut refused) = (0, 0);
        for t in tasks {
            let (w, r) = t.await.unwrap();
            written += w;
            refused += r;
        }
        assert_eq!((written, refused), (400, 200), "{kind:?}");
        let mut buyers = store.live_buyers(sale.id).await.unwrap();
        buyers.sort();
        assert_eq!(buyers.len(), 200, "{kind:?}");
        assert!(buyers.iter().all(|(_, units)| *units == 2), "{kind:?}");
        assert_eq!(stock(&store, sale.id).await, 10_000 - 400, "{kind:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_buyers_sum_units_per_user() {
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let sale = common::sale(common::next_id(), 100, 5);
        store.create_sale(&sale).await.unwrap();
        store
            .write_orders(&[
                order(sale.id, 1, 2),
                order(sale.id, 1, 1),
                order(sale.id, 2, 4),
            ])
            .await
            .unwrap();
        let mut buyers = store.live_buyers(sale.id).await.unwrap();
        buyers.sort();
        assert_eq!(buyers, vec![(1, 3), (2, 4)], "{kind:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrations_are_idempotent_and_safe_to_race() {
    for kind in ALL_SQL {
        let url = common::fresh_database(kind).await;
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move {
                    let store = Store::connect(&url, 2).await.unwrap();
                    store.migrate().await.unwrap()
                })
            })
            .collect();
        let mut applied = Vec::new();
        for t in tasks {
            applied.extend(t.await.unwrap());
        }
        applied.sort();
        assert_eq!(
            applied,
            (1..=18).collect::<Vec<i64>>(),
            "{kind:?}: each version applied by exactly one process"
        );
        let store = Store::connect(&url, 2).await.unwrap();
        assert!(store.migrate().await.unwrap().is_empty(), "{kind:?}");
    }
}

/// A new SQLite file opened by several processes at once: switching it to WAL takes a lock
/// SQLite does not wait for, so before `Store::connect` waited for it itself, a few rounds
/// in a hundred failed with "database is locked".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_sqlite_file_opened_by_many_at_once() {
    for round in 0..200 {
        let url = common::fresh_database(Sql::Sqlite).await;
        let tasks: Vec<_> = (0..6)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move {
                    let store = Store::connect(&url, 2).await?;
                    store.migrate().await
                })
            })
            .collect();
        for t in tasks {
            if let Err(e) = t.await.unwrap() {
                panic!("round {round}: {e}");
            }
        }
    }
}

/// A database from before phones were normalised: the migration rewrites each stored
/// number to E.164, keeps apart (and lists) a user whose number names another one once
/// normalised or is not valid, and never merges two users.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_phone_migration_normalises_and_reports_never_merges() {
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let ids: Vec<i64> = (0..6).map(|_| common::next_id()).collect();
        let stored = [
            "+8613800000001",  // already E.164
            "8613800000002",   // -> +8613800000002
            "008613800000002", // the same person: kept apart, reported
            "13800000003",     // a national number in the default region (CN)
            "12345",           // not a valid number: kept, reported
            "+86 138 0000 0004",
        ];
        for (id, phone) in ids.iter().zip(stored) {
            sqlx::query(&format!(
                "INSERT INTO users (id, phone, created_at) VALUES ({id}, '{phone}', 0)"
            ))
            .execute(store.pool())
            .await
            .unwrap();
        }
        // As if the database predated the migration.
        sqlx::query("DELETE FROM schema_migrations WHERE version = 8")
            .execute(store.pool())
            .await
            .unwrap();
        assert_eq!(store.migrate().await.unwrap(), vec![8], "{kind:?}");
        let phone_of = |id: i64| {
            let store = store.clone();
            async move {
                sqlx::query_scalar::<_, String>(&format!("SELECT phone FROM users WHERE id = {id}"))
                    .fetch_one(store.pool())
                    .await
                    .unwrap()
            }
        };
        assert_eq!(phone_of(ids[0]).await, "+8613800000001", "{kind:?}");
        assert_eq!(phone_of(ids[1]).await, "+8613800000002", "{kind:?}");
        assert_eq!(
            phone_of(ids[2]).await,
            "008613800000002",
            "{kind:?}: not merged"
        );
        assert_eq!(phone_of(ids[3]).await, "+8613800000003", "{kind:?}");
        assert_eq!(phone_of(ids[4]).await, "12345", "{kind:?}");
        assert_eq!(phone_of(ids[5]).await, "+8613800000004", "{kind:?}");
        let users: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM users")
            .fetch_one(store.pool())
            .await
            .unwrap();
        assert_eq!(users, 6, "{kind:?}: nobody deleted or merged");
        let conflicts = sqlx::query(
            "SELECT user_id, normalised, other_user_id FROM phone_conflicts ORDER BY user_id",
        )
        .fetch_all(store.pool())
        .await
        .unwrap();
        use sqlx::Row;
        let listed: Vec<(i64, String, Option<i64>)> = conflicts
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        assert_eq!(
            listed,
            vec![
                (ids[2], "+8613800000002".to_string(), Some(ids[1])),
                (ids[4], String::new(), None),
            ],
            "{kind:?}"
        );
        assert!(store.migrate().await.unwrap().is_empty(), "{kind:?}: once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_codes_and_meta() {
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let a = store
            .user_for_phone("+100200300", common::next_id())
            .await
            .unwrap();
        let b = store
            .user_for_phone("+100200300", common::next_id())
            .await
            .unwrap();
        assert_eq!(a, b, "{kind:?}: one user per phone");
        assert!(store.user_exists(a).await.unwrap());

        let now = seckill::clock::wall_ms();
        store
            .put_login_code("+1", "123456", now, now + 60_000)
            .await
            .unwrap();
        store
            .put_login_code("+1", "654321", now, now + 60_000)
            .await
            .unwrap();
        assert_eq!(
            store
                .spend_login_attempt("+1", now, 2)
                .await
                .unwrap()
                .as_deref(),
            Some("654321")
        );
        assert!(store
            .spend_login_attempt("+1", now, 2)
            .await
            .unwrap()
            .is_some());
        assert_eq!(
            store.spend_login_attempt("+1", now, 2).await.unwrap(),
            None,
            "{kind:?}: attempts used up"
        );
        assert_eq!(
            store
                .spend_login_attempt("+1", now + 61_000, 9)
                .await
                .unwrap(),
            None,
            "{kind:?}: expired"
        );

        let first = store.meta_get_or_init("k", "one").await.unwrap();
        let second = store.meta_get_or_init("k", "two").await.unwrap();
        assert_eq!(
            (first.as_str(), second.as_str()),
            ("one", "one"),
            "{kind:?}"
        );
    }
}

#[tokio::test]
async fn sqlite_is_created_on_first_use() {
    let url = common::fresh_database(Sql::Sqlite).await;
    let store = Store::connect(&url, 2).await.unwrap();
    assert_eq!(
        store.migrate().await.unwrap(),
        (1..=18).collect::<Vec<i64>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_segment_snapshot_counts_its_share_its_moves_and_its_buyers_only() {
    use seckill::gate::MoveMark;
    use seckill::model::segments::segment_of;
    use seckill::store::moves::SegmentMove;
    use seckill::store::Part;
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let mut sale = common::sale(common::next_id(), 100, 1);
        sale.segments = 3;
        store.create_sale(&sale).await.unwrap();
        // Two buyers in each segment.
        let users: Vec<i64> = (0..3)
            .flat_map(|s| (1..).filter(move |u| segment_of(*u, 3) == s).take(2))
            .collect();
        let batch: Vec<NewOrder> = users.iter().map(|u| order(sale.id, *u, 1)).collect();
        store.write_orders(&batch).await.unwrap();
        let mv = |id, from, to, quantity| SegmentMove {
            id,
            sale_id: sale.id,
            from_segment: from,
            to_segment: to,
            quantity,
            state: "planned".into(),
            updated_at: 0,
        };
        // Done: 5 from 1 to 0. Taken: 3 from 2 to 0. Planned: 4 from 0 to 1 (refused by
        // segment 0's snapshot) and 2 from 1 to 2 (untouched by segment 0's).
        for (m, state) in [
            (mv(1, 1, 0, 5), "done"),
            (mv(2, 2, 0, 3), "taken"),
            (mv(3, 0, 1, 4), ""),
            (mv(4, 1, 2, 2), ""),
        ] {
            store.plan_move(&m).await.unwrap();
            if state == "done" {
                assert!(store.advance_move(m.id, "planned", "taken").await.unwrap());
            }
            if !state.is_empty() {
                let from = if state == "done" { "taken" } else { "planned" };
                assert!(
                    store.advance_move(m.id, from, state).await.unwrap(),
                    "{kind:?}"
                );
            }
        }
        assert_eq!(
            store.units_moving(sale.id).await.unwrap(),
            3 + 4 + 2,
            "{kind:?}"
        );
        let snap = |segment| {
            let store = store.clone();
            async move {
                store
                    .load_part_snapshot(
                        sale.id,
                        Part {
                            segments: 3,
                            segment,
                        },
                        std::time::Duration::ZERO,
                        true,
                    )
                    .await
                    .unwrap()
            }
        };
        let s0 = snap(0).await;
        // 34 (share) + 5 + 3 (moves in that took effect) - 2 (its buyers' units).
        assert_eq!(s0.stock, 34 + 5 + 3 - 2, "{kind:?}");
        assert_eq!(s0.buyers.len(), 2, "{kind:?}: only its own buyers");
        assert!(s0.buyers.iter().all(|(u, _)| segment_of(*u, 3) == 0));
        assert_eq!(s0.counted.len(), 2, "{kind:?}");
        let mut marks = s0.moves.clone();
        marks.sort_by_key(|(id, _)| *id);
        assert_eq!(
            marks,
            vec![
                (1, MoveMark::Given),
                (2, MoveMark::Given),
                (3, MoveMark::Refused)
            ],
            "{kind:?}"
        );
        assert_eq!(
            store.segment_move(3).await.unwrap().unwrap().state,
            "refused",
            "{kind:?}: a planned move out of a rebuilt segment is refused"
        );
        assert_eq!(
            store.segment_move(4).await.unwrap().unwrap().state,
            "planned",
            "{kind:?}: moves between other segments are left alone"
        );
        // Segment 1: 33 - 5 (done out) - 2 buyers; move 4 (planned, out) refused now.
        let s1 = snap(1).await;
        assert_eq!(s1.stock, 33 - 5 - 2, "{kind:?}");
        // Segment 2: 33 - 3 (taken out) - 2 buyers.
        let s2 = snap(2).await;
        assert_eq!(s2.stock, 33 - 3 - 2, "{kind:?}");
        // The parts add up to SQL's stock of the whole sale (move 2 is taken, not given:
        // segment 0's snapshot counts it given, as the give will).
        assert_eq!(
            s0.stock + s1.stock + s2.stock,
            stock(&store, sale.id).await,
            "{kind:?}"
        );
        assert_eq!(store.units_moving(sale.id).await.unwrap(), 3, "{kind:?}");
    }
}

/// A writer batch over two sales journals one `written` row per sale; a redelivery with new
/// orders mixed in journals only those.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_batch_journals_a_row_per_sale_and_only_its_new_orders() {
    async fn written(store: &Store, sale: i64) -> Vec<(i64, Option<i64>, Option<String>)> {
        let rows = store.journal(sale, 0, 100).await.unwrap();
        rows.into_iter()
            .filter(|e| e.cause == "written")
            .map(|e| (e.delta, e.order_id, e.detail))
            .collect()
    }
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let a = common::sale(common::next_id(), 100, 5);
        let b = common::sale(common::next_id(), 100, 5);
        store.create_sale(&a).await.unwrap();
        store.create_sale(&b).await.unwrap();
        let mut batch: Vec<NewOrder> = (0..4).map(|u| order(a.id, u, 2)).collect();
        batch.extend((0..3).map(|u| order(b.id, u, 1)));
        store.write_orders(&batch).await.unwrap();
        batch.push(order(a.id, 10, 3));
        let out = store.write_orders(&batch).await.unwrap();
        assert_eq!((out.written, out.duplicates), (1, 7), "{kind:?}");
        let some = |s: &str| Some(s.to_string());
        assert_eq!(
            written(&store, a.id).await,
            [(-8, None, some("4 orders")), (-3, None, some("1 order"))],
            "{kind:?}"
        );
        assert_eq!(
            written(&store, b.id).await,
            [(-3, None, some("3 orders"))],
            "{kind:?}"
        );
        for sale in [a.id, b.id] {
            let (sum, stock) = store.journal_balance(sale).await.unwrap();
            assert_eq!(Some(sum), stock, "{kind:?}");
        }
    }
}

/// Every movement of a sale's stock leaves one journal row in its own transaction: the
/// rows sum to the stock after each step, whatever the step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_journal_sums_to_the_stock_after_every_movement() {
    use seckill::store::moves::SegmentMove;
    use seckill::store::{Outcome, SqlDecision};

    async fn balanced(store: &Store, sale: i64, kind: Sql, step: &str) -> i64 {
        let (sum, stock) = store.journal_balance(sale).await.unwrap();
        assert_eq!(
            Some(sum),
            stock,
            "{kind:?} after {step}: journal sum != stock"
        );
        sum
    }
    async fn causes(store: &Store, sale: i64) -> Vec<(String, i64)> {
        let rows = store.journal(sale, 0, 1000).await.unwrap();
        rows.into_iter().map(|e| (e.cause, e.delta)).collect()
    }

    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        // A draft, edited, then deleted: its stock comes and goes with it.
        let mut draft = common::sale(common::next_id(), 10, 1);
        draft.approved = false;
        store.create_sale(&draft).await.unwrap();
        balanced(&store, draft.id, kind, "a draft created").await;
        draft.initial_stock = 25;
        draft.stock = 25;
        assert!(store.update_draft(&draft).await.unwrap());
        assert_eq!(balanced(&store, draft.id, kind, "a draft edited").await, 25);
        assert!(store.delete_draft(draft.id).await.unwrap());
        assert_eq!(store.journal_balance(draft.id).await.unwrap(), (0, None));
        assert_eq!(
            causes(&store, draft.id).await,
            [
                ("created".into(), 10),
                ("edited".into(), 15),
                ("deleted".into(), -25)
            ]
        );

        // A sale sells through the writer and a SQL gate, then orders are cancelled,
        // expire, go back to the gate, and units move between segments.
        let mut sale = common::sale(common::next_id(), 100, 2);
        sale.segments = 2;
        store.create_sale(&sale).await.unwrap();
        let batch: Vec<NewOrder> = (0..30).map(|u| order(sale.id, u, 1 + u % 2)).collect();
        store.write_orders(&batch).await.unwrap();
        store.write_orders(&batch).await.unwrap();
        balanced(&store, sale.id, kind, "a batch written twice").await;
        let direct = order(sale.id, 500, 1);
        store
            .sql_purchase(&direct, SqlDecision::Conditional)
            .await
            .unwrap();
        balanced(&store, sale.id, kind, "a SQL gate's purchase").await;
        let now = seckill::clock::wall_ms();
        store
            .transition(
                batch[0].id,
                Some(batch[0].user_id),
                Outcome::Cancelled,
                now,
                "t",
            )
            .await
            .unwrap();
        store
            .transition(batch[1].id, None, Outcome::Paid, now, "t")
            .await
            .unwrap();
        balanced(&store, sale.id, kind, "a cancel and a payment").await;
        store.mark_returned(batch[0].id, now).await.unwrap();
        store.mark_returned(batch[0].id, now).await.unwrap();
        let m = SegmentMove {
            id: common::next_id(),
            sale_id: sale.id,
            from_segment: 1,
            to_segment: 0,
            quantity: 7,
            state: "planned".into(),
            updated_at: now,
        };
        store.plan_move(&m).await.unwrap();
        assert!(store.advance_move(m.id, "planned", "taken").await.unwrap());
        assert!(store.advance_move(m.id, "taken", "done").await.unwrap());
        let stock = balanced(&store, sale.id, kind, "a move").await;
        let sold: i64 = batch.iter().map(|o| o.quantity).sum::<i64>() + 1;
        assert_eq!(stock, 100 - sold + batch[0].quantity, "{kind:?}");

        let rows = causes(&store, sale.id).await;
        let count = |c: &str| rows.iter().filter(|(cause, _)| cause == c).count();
        assert_eq!(count("created"), 1, "{kind:?}");
        // One row for the batch: its second delivery wrote nothing.
        let written: Vec<_> = store
            .journal(sale.id, 0, 1000)
            .await
            .unwrap()
            .into_iter()
            .filter(|e| e.cause == "written")
            .map(|e| (e.delta, e.order_id, e.detail))
            .collect();
        let units: i64 = batch.iter().map(|o| o.quantity).sum();
        assert_eq!(
            written,
            [(-units, None, Some("30 orders".to_string()))],
            "{kind:?}"
        );
        assert_eq!(count("accepted"), 1, "{kind:?}");
        assert_eq!(count("cancelled"), 1, "{kind:?}");
        assert_eq!(count("returned_to_gate"), 1, "{kind:?}: handed back once");
        assert_eq!(count("moved_out") + count("moved_in"), 2, "{kind:?}");
        let sql = store.sql_account(sale.id).await.unwrap().unwrap();
        assert_eq!(sql.journal_sum, sql.stock, "{kind:?}");
        assert_eq!(sql.returns_owed_orders, 0, "{kind:?}");
        assert_eq!(sql.units_in_transit, 0, "{kind:?}");
        assert_eq!(
            sql.live_buyers, 30,
            "{kind:?}: 29 of the batch and the direct buyer"
        );
    }
}

/// A write transaction whose future is dropped (a request timeout, a client gone) must not
/// go back to the pool still open: it would keep its locks until that connection is reused.
/// Here a gate rebuild queues for the writer fence behind a writer and is cancelled; once
/// the writer lets go, another process (its own pool) takes the fence at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_transaction_leaves_no_lock_behind() {
    for kind in [Sql::Postgres, Sql::Mariadb] {
        let (store, url) = common::fresh_store(kind).await;
        let other = Store::connect(&url, 4).await.unwrap();
        let sale = common::sale(common::next_id(), 10, 1);
        store.create_sale(&sale).await.unwrap();
        let writer = other.hold_writer_fence().await.unwrap();
        assert!(writer.is_some(), "{kind:?} has a writer fence");
        let whole = seckill::store::Part {
            segments: 1,
            segment: 0,
        };
        let rebuild =
            store.load_part_snapshot(sale.id, whole, std::time::Duration::from_secs(20), true);
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(500), rebuild)
                .await
                .is_err(),
            "{kind:?}: the rebuild waits for the writer"
        );
        Store::release_writer_fence(writer).await.unwrap();
        let next =
            tokio::time::timeout(std::time::Duration::from_secs(5), other.hold_writer_fence())
                .await
                .unwrap_or_else(|_| panic!("{kind:?}: the cancelled rebuild still holds the fence"))
                .unwrap();
        Store::release_writer_fence(next).await.unwrap();
        // The pool that lost the transaction still works, outside any transaction.
        store
            .create_sale(&common::sale(common::next_id(), 5, 1))
            .await
            .unwrap();
    }
}

/// Every kept figure of the sale counted again from its rows, at full speed.
async fn recount(store: &Store, sale_id: i64) -> seckill::store::Recount {
    store
        .recount_paced(sale_id, seckill::store::Pace::FULL, 10_000, &|_| {})
        .await
        .unwrap()
        .unwrap()
}

/// On SQLite no index holds orders by buyer alone (every writer batch of a big sale paid
/// for its pages): a buyer's list seeks each run of the buyer index once per sale. On every
/// backend the list is newest first across sales and stops at its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buyers_list_is_newest_first_across_sales_and_sqlite_seeks_it_per_sale() {
    use sqlx::Row;
    let (store, _) = common::fresh_store(Sql::Sqlite).await;
    let by_buyer: Vec<String> =
        sqlx::query("SELECT name FROM pragma_index_list('orders') WHERE name = 'orders_by_user'")
            .fetch_all(store.pool())
            .await
            .unwrap()
            .iter()
            .map(|r| r.try_get::<String, _>(0).unwrap())
            .collect();
    assert!(by_buyer.is_empty(), "SQLite still indexes orders by buyer");
    let plan = sqlite_plan(&store, store.orders_of_user_query(), &[1, 10]).await;
    for run in ["buyer_orders", "buyer_orders_new"] {
        let seek = format!("SEARCH {run} USING PRIMARY KEY (sale_id=? AND user_id=?)");
        assert!(
            plan.iter().any(|step| step.contains(&seek)),
            "SQLite, not a seek of {run} per sale: {plan:?}"
        );
    }

    for kind in ALL_SQL {
        let store = if kind == Sql::Sqlite {
            store.clone()
        } else {
            common::fresh_store(kind).await.0
        };
        // Two sales, the buyer's orders written in three batches among other buyers', the
        // first sale's last: newest first is not the order of the sales.
        let buyer = common::next_id();
        let sales = [
            common::sale(common::next_id(), 20, 10),
            common::sale(common::next_id(), 20, 10),
        ];
        for sale in &sales {
            store.create_sale(sale).await.unwrap();
        }
        let mut ids = Vec::new();
        for sale in [&sales[0], &sales[1], &sales[0]] {
            let batch: Vec<_> = (0..3)
                .map(|_| common::order(sale.id, buyer))
                .chain((0..3).map(|_| common::order(sale.id, common::next_id())))
                .collect();
            ids.extend(batch[..3].iter().map(|o| o.id));
            store.write_orders(&batch).await.unwrap();
        }
        ids.sort_unstable_by(|a, b| b.cmp(a));
        let listed = |limit| {
            let store = store.clone();
            async move {
                store
                    .orders_of_user(buyer, limit)
                    .await
                    .unwrap()
                    .iter()
                    .map(|o| o.id)
                    .collect::<Vec<i64>>()
            }
        };
        assert_eq!(listed(20).await, ids, "{kind:?}");
        assert_eq!(listed(4).await, ids[..4].to_vec(), "{kind:?}");
    }
}

/// SQLite's writer inserts with `OR IGNORE` (no statement journal), which skips a row
/// that breaks any constraint, not only a duplicate id. The writer treats a short row count
/// as a concurrent write and retries, so a row skipped for another reason would be retried
/// forever instead of refused. The table must keep no constraint a fresh order could break:
/// a new one needs the insert changed first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_orders_hold_no_constraint_an_ignored_insert_could_hide() {
    use sqlx::Row;
    let (store, _) = common::fresh_store(Sql::Sqlite).await;
    let strings = |sql: &'static str| {
        let pool = store.pool().clone();
        async move {
            sqlx::query(sql)
                .fetch_all(&pool)
                .await
                .unwrap()
                .iter()
                .map(|r| r.try_get::<String, _>(0).unwrap())
                .collect::<Vec<String>>()
        }
    };
    let table = strings("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'orders'")
        .await
        .concat()
        .to_uppercase();
    // Whole words: a column named `checked_at` is no CHECK.
    let words: Vec<&str> = table
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .collect();
    for word in ["CHECK", "UNIQUE", "REFERENCES"] {
        assert!(!words.contains(&word), "orders has a {word}: {table}");
    }
    // The primary key is the one constraint the writer means to ignore: an id written already.
    let unique = strings(
        "SELECT name FROM pragma_index_list('orders') WHERE \"unique\" = 1 AND origin <> 'pk'",
    )
    .await;
    assert!(unique.is_empty(), "unique indexes on orders: {unique:?}");
    let triggers =
        strings("SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'orders'")
            .await;
    assert!(triggers.is_empty(), "triggers on orders: {triggers:?}");
}

/// SQLite keeps orders by (sale, buyer) in two runs (`store::buyers`): each written order's
/// entry goes to the small one, which is merged into the large one every so many entries.
/// Across merges every order has exactly one entry, and what reads orders by buyer (the
/// writer's per-user guard, a SQL gate's, a buyer's list, the recount) sees both runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_buyer_index_runs_hold_each_order_once_across_merges() {
    use seckill::store::sql_gate::{SqlDecision, SqlVerdict};
    let (store, _) = common::fresh_store(Sql::Sqlite).await;
    let store = store.with_buyers_merged_every(1_500, 700);
    // A buyer's units are a seek of each run, not a walk of either.
    let plan = sqlite_plan(&store, &store.live_units_of_buyer_query(), &[1, 2]).await;
    for run in ["buyer_orders", "buyer_orders_new"] {
        let seek = format!("SEARCH {run} USING PRIMARY KEY (sale_id=? AND user_id=?)");
        assert!(
            plan.iter().any(|step| step.contains(&seek)),
            "not a seek of {run}: {plan:?}"
        );
    }
    let sale = common::sale(common::next_id(), 10_000, 2);
    store.create_sale(&sale).await.unwrap();
    // Three batches of 1,000 orders, 200 buyers in the first and the last. The second
    // batch's commit brings the small run to 2,000 entries, past the merge's 1,500: a
    // merge begins, 700 entries a commit in key order. Those 200 buyers' ids are the
    // lowest, so their first orders move at once and their second ones, written behind
    // the merge, stay: they hold an order in each run.
    let twice = 7_000_000;
    let mut mine = Vec::new();
    for round in 0..3 {
        let batch: Vec<NewOrder> = (0..1_000)
            .map(|i| match i {
                0..200 if round != 1 => common::order(sale.id, twice + i),
                _ => common::order(sale.id, 8_000_000 + round * 1_000 + i),
            })
            .collect();
        mine.extend(batch.iter().filter(|o| o.user_id == twice).map(|o| o.id));
        store.write_orders(&batch).await.unwrap();
    }
    let merged = count_of(&store, "SELECT COUNT(*) FROM buyer_orders").await;
    let new = count_of(&store, "SELECT COUNT(*) FROM buyer_orders_new").await;
    assert_eq!((merged, new), (1_400, 1_600), "two steps of 700");
    let runs_of_twice = (
        count_of(
            &store,
            "SELECT COUNT(*) FROM buyer_orders WHERE user_id = 7000000",
        )
        .await,
        count_of(
            &store,
            "SELECT COUNT(*) FROM buyer_orders_new WHERE user_id = 7000000",
        )
        .await,
    );
    assert_eq!(runs_of_twice, (1, 1));

    // A SQL gate's purchase is indexed too; a buyer of two units, one in each run, is at
    // the limit for both guards.
    let direct = NewOrder {
        quantity: 1,
        ..common::order(sale.id, 9_000_000)
    };
    let verdict = store
        .sql_purchase(&direct, SqlDecision::Conditional)
        .await
        .unwrap();
    assert!(
        matches!(verdict, SqlVerdict::Accepted { .. }),
        "{verdict:?}"
    );
    let over = common::order(sale.id, twice);
    assert!(matches!(
        store.write_orders(std::slice::from_ref(&over)).await,
        Err(StoreError::UserLimit { held: 2, .. })
    ));
    assert_eq!(
        store
            .sql_purchase(&over, SqlDecision::Conditional)
            .await
            .unwrap(),
        SqlVerdict::AlreadyPurchased
    );
    // The SQL gate's commit takes the merge's third step, off the buyer's answer.
    let mut merged = 0;
    for _ in 0..400 {
        merged = count_of(&store, "SELECT COUNT(*) FROM buyer_orders").await;
        if merged == 2_100 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    assert_eq!(merged, 2_100, "the SQL gate's step");
    // A recount in chunks smaller than either run, each of which bounds some of them.
    let pace = seckill::store::Pace {
        chunk: 97,
        share: 1.0,
    };
    let recount = agreeing_recount(&store, sale.id, pace).await;
    assert_eq!(
        (recount.counted.live_units, recount.counted.live_buyers),
        (3_001, 2_801)
    );
    // The rest moves at once here.
    assert_eq!(store.merge_new_buyers().await.unwrap(), 901);
    assert_eq!(
        count_of(&store, "SELECT COUNT(*) FROM buyer_orders").await,
        3_001
    );
    // A buyer whose two orders are one in each run.
    let split = common::order(sale.id, 8_002_999);
    store
        .write_orders(std::slice::from_ref(&split))
        .await
        .unwrap();
    assert_eq!(
        count_of(&store, "SELECT COUNT(*) FROM buyer_orders_new").await,
        1
    );

    let orders = count_of(&store, "SELECT COUNT(*) FROM orders").await;
    assert_eq!(orders, 3_002);
    assert_eq!(
        count_of(&store, "SELECT COUNT(*) FROM buyer_orders_all").await,
        orders,
        "an entry per order"
    );
    assert_eq!(
        count_of(
            &store,
            "SELECT COUNT(*) FROM orders o WHERE NOT EXISTS (SELECT 1 FROM buyer_orders_all b \
             WHERE b.order_id = o.id AND b.sale_id = o.sale_id AND b.user_id = o.user_id)"
        )
        .await,
        0,
        "an order without its entry"
    );
    let listed: Vec<i64> = store
        .orders_of_user(8_002_999, 10)
        .await
        .unwrap()
        .iter()
        .map(|o| o.id)
        .collect();
    assert_eq!(
        listed.len(),
        2,
        "the buyer's orders in both runs: {listed:?}"
    );
    assert!(listed[0] > listed[1], "newest first: {listed:?}");
    mine.sort_unstable_by(|a, b| b.cmp(a));
    let theirs: Vec<i64> = store
        .orders_of_user(twice, 10)
        .await
        .unwrap()
        .iter()
        .map(|o| o.id)
        .collect();
    assert_eq!(theirs, mine);

    // Again with the small run all but empty.
    let recount = agreeing_recount(&store, sale.id, pace).await;
    assert_eq!(recount.counted.live_units, 3_002);
    assert_eq!(recount.counted.live_buyers, 2_801);
    assert_eq!(recount.orders, 3_002);
    assert_eq!(recount.buyers.map(|b| b.len()), Some(2_801));
}

/// A process counts the entries a previous one left in the small run towards its first
/// merge: restarts before each merge came due would otherwise let the small run grow
/// without end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_buyer_index_counts_what_a_previous_process_left_to_merge() {
    let (store, url) = common::fresh_store(Sql::Sqlite).await;
    let sale = common::sale(common::next_id(), 1_000, 1);
    store.create_sale(&sale).await.unwrap();
    let batch = |from: i64| -> Vec<NewOrder> {
        (from..from + 100)
            .map(|u| common::order(sale.id, u))
            .collect()
    };
    store.write_orders(&batch(1_000)).await.unwrap();
    store.write_orders(&batch(2_000)).await.unwrap();
    assert_eq!(
        count_of(&store, "SELECT COUNT(*) FROM buyer_orders_new").await,
        200
    );
    let next = Store::connect(&url, 2)
        .await
        .unwrap()
        .with_buyers_merged_every(250, 1_000);
    next.write_orders(&batch(3_000)).await.unwrap();
    assert_eq!(
        count_of(&next, "SELECT COUNT(*) FROM buyer_orders_new").await,
        0
    );
    assert_eq!(
        count_of(&next, "SELECT COUNT(*) FROM buyer_orders").await,
        300
    );
}

/// A SQLite file from before the buyer index's runs (migration 15) has its orders' entries
/// moved into the large run, and loses the index on `orders` they replace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_migration_moves_the_orders_there_into_the_buyer_index() {
    let (store, _) = common::fresh_store(Sql::Sqlite).await;
    let sale = common::sale(common::next_id(), 1_000, 1);
    store.create_sale(&sale).await.unwrap();
    let batch: Vec<NewOrder> = (0..300)
        .map(|u| common::order(sale.id, 5_000 + u))
        .collect();
    store.write_orders(&batch).await.unwrap();
    // Back to the schema of migration 14: an index on `orders`, no runs.
    for sql in [
        "DROP VIEW buyer_orders_all",
        "DROP TABLE buyer_orders",
        "DROP TABLE buyer_orders_new",
        "CREATE INDEX orders_by_sale_user ON orders (sale_id, user_id)",
        "DELETE FROM schema_migrations WHERE version = 15",
    ] {
        sqlx::query(sql).execute(store.pool()).await.unwrap();
    }
    assert_eq!(store.migrate().await.unwrap(), vec![15]);
    assert_eq!(
        count_of(&store, "SELECT COUNT(*) FROM buyer_orders").await,
        300
    );
    assert_eq!(
        count_of(&store, "SELECT COUNT(*) FROM buyer_orders_new").await,
        0
    );
    assert_eq!(
        count_of(
            &store,
            "SELECT COUNT(*) FROM pragma_index_list('orders') WHERE name = 'orders_by_sale_user'"
        )
        .await,
        0
    );
    // The per-user guard finds them there.
    let again = common::order(sale.id, 5_123);
    assert!(matches!(
        store.write_orders(std::slice::from_ref(&again)).await,
        Err(StoreError::UserLimit { held: 1, .. })
    ));
}

/// The one integer `sql` answers.
async fn count_of(store: &Store, sql: &str) -> i64 {
    use sqlx::Row;
    sqlx::query(sql)
        .fetch_one(store.pool())
        .await
        .unwrap()
        .try_get::<i64, _>(0)
        .unwrap()
}

/// The sale recounted at `pace`, which must agree with the kept figures.
async fn agreeing_recount(
    store: &Store,
    sale_id: i64,
    pace: seckill::store::Pace,
) -> seckill::store::Recount {
    let recount = store
        .recount_paced(sale_id, pace, 10_000, &|_| {})
        .await
        .unwrap()
        .unwrap();
    assert!(recount.agrees(), "{recount:?}");
    recount
}

/// SQLite's plan for `sql` bound to `args`: the detail of each step.
async fn sqlite_plan(store: &Store, sql: &str, args: &[i64]) -> Vec<String> {
    use sqlx::Row;
    let q = format!("EXPLAIN QUERY PLAN {sql}");
    let mut query = sqlx::query(&q);
    for arg in args {
        query = query.bind(*arg);
    }
    query
        .fetch_all(store.pool())
        .await
        .unwrap()
        .iter()
        .map(|r| r.try_get::<String, _>(3).unwrap())
        .collect()
}

/// Asserts that SQLite's plan for `sql` (bound to `args`) walks `index` and sorts nothing.
async fn sqlite_walks_index_unsorted(store: &Store, sql: &str, args: &[i64], index: &str) {
    let plan = sqlite_plan(store, sql, args).await;
    assert!(
        plan.iter().any(|step| step.contains(index)),
        "SQLite, not on {index}: {plan:?}"
    );
    assert!(
        !plan.iter().any(|step| step.contains("TEMP B-TREE")),
        "SQLite sorts: {plan:?}"
    );
}

/// A page of a sale's order ids is a walk of an index from its cursor: nothing sorts the
/// sale's orders, however many it holds (at a million, that sort took seconds a page).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_of_order_ids_walks_an_index_and_sorts_nothing() {
    use sqlx::Row;
    let (store, _) = common::fresh_store(Sql::Sqlite).await;
    sqlite_walks_index_unsorted(
        &store,
        seckill::store::LIVE_ORDER_IDS,
        &[1, 0, 100],
        "orders_by_sale_id",
    )
    .await;

    // PostgreSQL's planner may scan a small table whole; told to avoid sorts and scans
    // (as `Store::keyset_rows` tells it for this read), it still sorts unless an index
    // gives the order.
    let (store, _) = common::fresh_store(Sql::Postgres).await;
    let mut numbered = String::new();
    for (i, part) in seckill::store::LIVE_ORDER_IDS.split('?').enumerate() {
        if i > 0 {
            numbered.push_str(&format!("${i}"));
        }
        numbered.push_str(part);
    }
    let mut conn = store.pool().acquire().await.unwrap();
    for setting in ["SET enable_seqscan = off", "SET enable_sort = off"] {
        sqlx::query(setting).execute(&mut *conn).await.unwrap();
    }
    let plan: Vec<String> = sqlx::query(&format!("EXPLAIN {numbered}"))
        .bind(1i64)
        .bind(0i64)
        .bind(100i64)
        .fetch_all(&mut *conn)
        .await
        .unwrap()
        .iter()
        .map(|r| r.try_get::<String, _>(0).unwrap())
        .collect();
    assert!(
        plan.iter().any(|step| step.contains("orders_by_sale_id")),
        "PostgreSQL: {plan:?}"
    );
    assert!(
        !plan
            .iter()
            .any(|step| step.trim_start().starts_with("Sort") || step.contains("->  Sort")),
        "PostgreSQL sorts: {plan:?}"
    );
}

/// The figures the audit reads (live units and buyers, returns owed, units in transit, the
/// journal's sum) are kept on the sale's row by every transaction that changes them, and
/// equal their recount after writes, purchases in SQL, a buyer's two orders cancelled at
/// once, expiries, returns handed to the gate and a move; a counter edited by hand is found
/// by the recount and corrected.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kept_figures_equal_their_recount_and_a_wrong_one_is_corrected() {
    use seckill::store::{Outcome, SqlDecision};
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let sale = common::sale(common::next_id(), 1000, 2);
        store.create_sale(&sale).await.unwrap();
        // Sixty buyers, the first twenty with a second order in a later batch.
        let first: Vec<NewOrder> = (0..60).map(|u| order(sale.id, u, 1)).collect();
        let second: Vec<NewOrder> = (0..20).map(|u| order(sale.id, u, 1)).collect();
        store.write_orders(&first).await.unwrap();
        store.write_orders(&second).await.unwrap();
        // Buyers 0-9 cancel both orders at once; 10-19 cancel one; 20-29 let one expire.
        let mut cancels = Vec::new();
        for o in first[..20].iter().chain(&second[..10]) {
            let (store, id, user) = (store.clone(), o.id, o.user_id);
            cancels.push(tokio::spawn(async move {
                store
                    .transition(
                        id,
                        Some(user),
                        Outcome::Cancelled,
                        seckill::clock::wall_ms(),
                        "test",
                    )
                    .await
                    .unwrap();
            }));
        }
        for c in cancels {
            c.await.unwrap();
        }
        for o in &first[20..30] {
            let later = seckill::clock::wall_ms() + 86_400_000;
            store
                .transition(o.id, None, Outcome::Expired, later, "test")
                .await
                .unwrap();
        }
        // Half the returns reach the gate.
        for o in first[..15].iter() {
            store
                .mark_returned(o.id, seckill::clock::wall_ms())
                .await
                .unwrap();
        }
        // Purchases decided in SQL, by both SQL gates; one buyer at the limit is refused.
        for (u, how) in (100..110)
            .map(|u| (u, SqlDecision::Conditional))
            .chain((110..120).map(|u| (u, SqlDecision::Lock)))
        {
            store
                .sql_purchase(&order(sale.id, u, 2), how)
                .await
                .unwrap();
        }
        store
            .sql_purchase(&order(sale.id, 100, 1), SqlDecision::Lock)
            .await
            .unwrap();
        // A move between two segments, taken (in transit) and not yet given.
        let m = seckill::store::moves::SegmentMove {
            id: common::next_id(),
            sale_id: sale.id,
            from_segment: 0,
            to_segment: 1,
            quantity: 7,
            state: "planned".into(),
            updated_at: 0,
        };
        store.plan_move(&m).await.unwrap();
        assert!(store.advance_move(m.id, "planned", "taken").await.unwrap());

        // Payment intents: one paid, one failed, one left open.
        let now = seckill::clock::wall_ms();
        let mut intents = Vec::new();
        for o in &first[30..33] {
            let p = seckill::store::Payment {
                intent_id: common::next_id(),
                order_id: o.id,
                user_id: o.user_id,
                amount_cents: 999,
                status: "created".into(),
                created_at: now,
            };
            intents.push(store.open_payment(&p).await.unwrap().intent_id);
        }
        store.settle_payment(intents[0], "ok", now).await.unwrap();
        assert!(store.fail_payment(intents[1], "no", now).await.unwrap());

        let kept = store.sql_account(sale.id).await.unwrap().unwrap();
        let first_count = recount(&store, sale.id).await;
        assert_eq!(kept, first_count.counted, "{kind:?}");
        assert!(
            first_count.agrees() && !first_count.corrected,
            "{kind:?}: {first_count:?}"
        );
        let tallies = store.tallies(sale.id).await.unwrap();
        use seckill::store::{PaymentStatus, Tally};
        for (tally, n) in [
            (Tally::Orders(OrderStatus::PendingPayment), 40 + 20 - 1),
            (Tally::Orders(OrderStatus::Paid), 1),
            (Tally::Orders(OrderStatus::Cancelled), 30),
            (Tally::Orders(OrderStatus::Expired), 10),
            (Tally::Payments(PaymentStatus::Created), 1),
            (Tally::Payments(PaymentStatus::Paid), 1),
            (Tally::Payments(PaymentStatus::Failed), 1),
            (Tally::Holding(1), 10 + 30),
            (Tally::Holding(2), 20),
        ] {
            assert_eq!(tallies.get(tally), n, "{kind:?}: {tally:?}");
        }
        assert_eq!(tallies.most_held(), 2, "{kind:?}");
        // 60 + 20 orders written, 30 cancelled, 10 expired; 20 SQL purchases of 2 units.
        assert_eq!(kept.live_units, 80 - 30 - 10 + 40, "{kind:?}");
        assert_eq!(
            kept.live_buyers,
            60 - 10 - 10 + 20,
            "{kind:?}: 0-9 and 20-29 hold nothing"
        );
        assert_eq!(
            (kept.returns_owed_orders, kept.returns_owed_units),
            (40 - 15, 40 - 15),
            "{kind:?}"
        );
        assert_eq!(kept.units_in_transit, 7, "{kind:?}");
        assert_eq!(kept.journal_sum, kept.stock, "{kind:?}");

        assert!(store.advance_move(m.id, "taken", "done").await.unwrap());
        assert_eq!(
            store
                .sql_account(sale.id)
                .await
                .unwrap()
                .unwrap()
                .units_in_transit,
            0,
            "{kind:?}"
        );

        // A hand edit of a counter: found by the recount, and put right.
        sqlx::query(&format!(
            "UPDATE sales SET live_buyers = live_buyers + 3 WHERE id = {}",
            sale.id
        ))
        .execute(store.pool())
        .await
        .unwrap();
        sqlx::query(&format!(
            "UPDATE sale_tallies SET n = n + 5 WHERE sale_id = {} AND tally = 'holding:1'",
            sale.id
        ))
        .execute(store.pool())
        .await
        .unwrap();
        let found = recount(&store, sale.id).await;
        assert!(found.corrected && !found.agrees(), "{kind:?}");
        assert_eq!(
            store.sql_account(sale.id).await.unwrap().unwrap(),
            found.counted,
            "{kind:?}"
        );
        assert_eq!(
            store.tallies(sale.id).await.unwrap(),
            found.counted_tallies,
            "{kind:?}: the tallies are corrected too"
        );
        assert!(recount(&store, sale.id).await.agrees(), "{kind:?}");
        assert_eq!(found.counted.live_buyers, 60, "{kind:?}");
    }
}

/// A gate is loaded from the sale's orders read a chunk of thousands at a time as strings,
/// whether it keeps order ids (the Redis gate: every order's id, the cancelled or expired
/// ones apart) or not (the memory gate: live orders only): each buyer's units, of one order
/// or several, of one unit or more, across chunks, without cancelled or expired orders and
/// in each segment only its own buyers, exactly as every order read one by one finds them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_read_in_chunks_equals_every_order_read_one_by_one() {
    use seckill::store::{Outcome, Part};
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let sale = common::sale(common::next_id(), 100_000, 5);
        store.create_sale(&sale).await.unwrap();
        // 45,000 orders (past two chunks): 40,000 buyers of one unit with ids past 2^32, the
        // first 5,000 of them again with two units in a later order; 300 cancelled, 200
        // of them second orders.
        let user = |u: i64| 5_000_000_000 + u * 7;
        let ones: Vec<NewOrder> = (0..40_000).map(|u| order(sale.id, user(u), 1)).collect();
        let twos: Vec<NewOrder> = (0..5_000).map(|u| order(sale.id, user(u), 2)).collect();
        for batch in ones.chunks(5_000).chain(twos.chunks(5_000)) {
            store.write_orders(batch).await.unwrap();
        }
        let now = seckill::clock::wall_ms();
        for o in ones[..100].iter().chain(&twos[..200]) {
            store
                .transition(o.id, Some(o.user_id), Outcome::Cancelled, now, "test")
                .await
                .unwrap();
        }
        for part in [
            Part::WHOLE,
            Part {
                segments: 3,
                segment: 1,
            },
        ] {
            // The reference: every order of the sale, a row each.
            let (mut held, mut counted, mut released) =
                (std::collections::BTreeMap::new(), Vec::new(), Vec::new());
            for o in store.orders_of_sale(sale.id).await.unwrap() {
                if seckill::model::segments::segment_of(o.user_id, part.segments) != part.segment {
                    continue;
                }
                counted.push(o.id);
                if OrderStatus::LIVE.contains(&o.status.as_str()) {
                    *held.entry(o.user_id).or_insert(0) += o.quantity;
                } else {
                    released.push(o.id);
                }
            }
            let held: Vec<(i64, i64)> = held.into_iter().collect();
            counted.sort_unstable();
            released.sort_unstable();
            let read = |order_ids| {
                let store = store.clone();
                async move {
                    let mut snapshot = store
                        .load_part_snapshot(sale.id, part, std::time::Duration::ZERO, order_ids)
                        .await
                        .unwrap();
                    snapshot.buyers.sort_unstable();
                    snapshot.counted.sort_unstable();
                    snapshot.released.sort_unstable();
                    snapshot
                }
            };
            let (live, every) = (read(false).await, read(true).await);
            assert_eq!(live.buyers, held, "{kind:?} {part:?}: live orders only");
            assert_eq!(every.buyers, held, "{kind:?} {part:?}: every order");
            assert_eq!(every.counted, counted, "{kind:?} {part:?}");
            assert_eq!(every.released, released, "{kind:?} {part:?}");
            assert!(live.counted.is_empty(), "{kind:?} {part:?}");
            assert_eq!(live.stock, every.stock, "{kind:?} {part:?}");
            if part == Part::WHOLE {
                assert_eq!(counted.len(), 45_000, "{kind:?}");
                assert_eq!(released.len(), 300, "{kind:?}");
                let (stock, buyers) = (live.stock, live.buyers);
                assert_eq!(buyers.len(), 40_000 - 100, "{kind:?}");
                let units: i64 = buyers.iter().map(|(_, n)| n).sum();
                assert_eq!(units, 40_000 - 100 + 2 * (5_000 - 200), "{kind:?}");
                assert_eq!(stock, 100_000 - units, "{kind:?}");
                let held = |u| buyers.iter().find(|(b, _)| *b == user(u)).map(|(_, n)| *n);
                assert_eq!(held(0), None, "{kind:?}: both orders cancelled");
                assert_eq!(held(150), Some(1), "{kind:?}: its second order cancelled");
                assert_eq!(held(300), Some(3), "{kind:?}: two orders summed");
                assert_eq!(held(39_999), Some(1), "{kind:?}");
            }
        }
    }
}

/// On PostgreSQL the writer's lookups for a batch go by key however little the planner
/// knows: on a fresh table (no statistics yet) holding a sale's 20,000 orders, the
/// per-buyer guard reads `orders_by_sale_user` and the duplicate check the primary key.
/// (With `user_id IN (...)` and `id IN (...)` the planner walked the whole sale, or the
/// whole table, for every batch.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writers_lookups_on_postgres_go_by_key_on_a_table_without_statistics() {
    use sqlx::Row;
    let (store, _) = common::fresh_store(Sql::Postgres).await;
    let sale = common::sale(common::next_id(), 30_000, 1);
    store.create_sale(&sale).await.unwrap();
    for chunk in 0..20 {
        let batch: Vec<NewOrder> = (0..1000)
            .map(|i| NewOrder {
                id: common::next_id(),
                sale_id: sale.id,
                user_id: 1_000_000 + chunk * 1000 + i,
                quantity: 1,
                price_cents: 999,
                accepted_at: seckill::clock::wall_ms(),
                retry_key: None,
            })
            .collect();
        store.write_orders(&batch).await.unwrap();
    }
    let array = |from: i64| {
        let items: Vec<String> = (from..from + 500).map(|v| v.to_string()).collect();
        format!("{{{}}}", items.join(","))
    };
    let plan = |sql: &'static str, binds: Vec<(String, Option<i64>)>| {
        let store = store.clone();
        async move {
            let q = format!("EXPLAIN {sql}");
            let mut query = sqlx::query(&q);
            for (text, int) in &binds {
                query = match int {
                    Some(v) => query.bind(*v),
                    None => query.bind(text.clone()),
                };
            }
            let rows = query.fetch_all(store.pool()).await.unwrap();
            rows.iter()
                .map(|r| r.try_get::<String, _>(0).unwrap())
                .collect::<Vec<String>>()
                .join("\n")
        }
    };
    let held = plan(
        seckill::store::PG_HELD_BY_BUYERS,
        vec![(array(2_000_000), None), (String::new(), Some(sale.id))],
    )
    .await;
    assert!(held.contains("orders_by_sale_user"), "{held}");
    assert!(!held.contains("Seq Scan on orders"), "{held}");
    let written = plan(seckill::store::PG_WRITTEN_ALREADY, vec![(array(1), None)]).await;
    assert!(written.contains("orders_pkey"), "{written}");
    assert!(!written.contains("Seq Scan on orders"), "{written}");
}

/// The writer keeps the record of an order bought with an `Idempotency-Key` in the orders'
/// own transaction, once however often the batch comes, and never over a record a SQL
/// gate holds already; the memory gate reads them back at start-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_bought_with_a_key_keep_their_records_with_them() {
    use seckill::model::RetryKey;
    use seckill::store::idempotency::purchase_record;
    for kind in ALL_SQL {
        let (store, _) = common::fresh_store(kind).await;
        let sale = common::sale(common::next_id(), 2000, 3);
        store.create_sale(&sale).await.unwrap();
        let keyed = |user: i64, quantity: i64| NewOrder {
            retry_key: Some(RetryKey(u128::MAX - user as u128)),
            ..order(sale.id, user, quantity)
        };
        // More keyed orders than one statement writes, among orders without a key.
        let mut batch: Vec<NewOrder> = (0..1200).map(|u| keyed(u, 1 + u % 2)).collect();
        batch.extend((5000..5010).map(|u| order(sale.id, u, 1)));
        // One buyer's key answered already, a moment ago: its record stays. Another's
        // answered a day ago, which answers no more: replaced.
        let now = seckill::clock::wall_ms();
        let answered = |user: i64, order: &'static str, at: i64| {
            let (caller, key) = purchase_record(sale.id, user, RetryKey(u128::MAX - user as u128));
            let store = &store;
            async move {
                store
                    .claim_idempotency_key(&caller, &key, "3", at)
                    .await
                    .unwrap();
                store
                    .complete_idempotency_key(&caller, &key, 200, order)
                    .await
                    .unwrap();
            }
        };
        answered(7, "42", now).await;
        answered(8, "43", now - seckill::model::RETRY_KEY_MS - 1).await;
        store.write_orders(&batch).await.unwrap();
        store.write_orders(&batch[..100]).await.unwrap();

        let kept = store.kept_purchases(now - 60_000).await.unwrap();
        let ours: Vec<_> = kept.iter().filter(|k| k.sale_id == sale.id).collect();
        assert_eq!(ours.len(), 1200, "{kind:?}: one record a keyed order");
        for k in &ours {
            let o = &batch[k.user_id as usize];
            assert_eq!(k.key, o.retry_key.unwrap(), "{kind:?}");
            if k.user_id == 7 {
                assert_eq!(
                    (k.order_id, k.quantity),
                    (42, 3),
                    "{kind:?}: a record held stays"
                );
            } else {
                assert_eq!(k.quantity, o.quantity, "{kind:?}");
                assert_eq!((k.order_id, k.at), (o.id, o.accepted_at), "{kind:?}");
            }
        }
        assert!(
            store.kept_purchases(now + 60_000).await.unwrap().is_empty(),
            "{kind:?}: none since a later instant"
        );

        // A batch that fails (over the stock) keeps no record.
        let small = common::sale(common::next_id(), 1, 3);
        store.create_sale(&small).await.unwrap();
        let over: Vec<NewOrder> = (0..2)
            .map(|u| NewOrder {
                retry_key: Some(RetryKey(u as u128)),
                ..order(small.id, u, 1)
            })
            .collect();
        assert!(store.write_orders(&over).await.is_err(), "{kind:?}");
        let kept = store.kept_purchases(now - 60_000).await.unwrap();
        assert!(
            kept.iter().all(|k| k.sale_id != small.id),
            "{kind:?}: a failed batch's records are rolled back with it"
        );
    }
}

/// A SQL gate's purchase completes its key's claim in its own transaction: an attempt whose
/// claim another attempt took over (after the lease) makes nothing, and the one holding the
/// claim makes the order and its record at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sql_purchase_whose_key_claim_was_taken_over_makes_nothing() {
    use seckill::model::RetryKey;
    use seckill::store::idempotency::{purchase_record, Claim, CLAIM_LEASE_MS};
    use seckill::store::{ClaimedKey, SqlDecision, SqlVerdict};
    for kind in ALL_SQL {
        for how in [SqlDecision::Lock, SqlDecision::Conditional] {
            let (store, _) = common::fresh_store(kind).await;
            let sale = common::sale(common::next_id(), 10, 3);
            store.create_sale(&sale).await.unwrap();
            let (caller, key) = purchase_record(sale.id, 1, RetryKey(5));
            let first_at = seckill::clock::wall_ms() - CLAIM_LEASE_MS - 1;
            let (store, caller, key) = (&store, &caller, &key);
            let claim = |at| async move { store.claim_idempotency_key(caller, key, "1", at).await };
            assert_eq!(claim(first_at).await.unwrap(), Claim::Mine);
            let now = seckill::clock::wall_ms();
            assert_eq!(claim(now).await.unwrap(), Claim::Mine, "taken over");

            let late = order(sale.id, 1, 1);
            let verdict = store
                .sql_purchase_claimed(
                    &late,
                    how,
                    Some(ClaimedKey {
                        caller,
                        key,
                        claimed_at: first_at,
                    }),
                )
                .await
                .unwrap();
            assert_eq!(verdict, SqlVerdict::ClaimLost, "{kind:?} {how:?}");
            assert_eq!(stock(store, sale.id).await, 10, "{kind:?} {how:?}");
            assert!(store.order(late.id).await.unwrap().is_none());

            let holder = order(sale.id, 1, 1);
            let claimed = Some(ClaimedKey {
                caller,
                key,
                claimed_at: now,
            });
            let verdict = store
                .sql_purchase_claimed(&holder, how, claimed)
                .await
                .unwrap();
            assert!(
                matches!(verdict, SqlVerdict::Accepted { remaining: 9 }),
                "{kind:?} {how:?}: {verdict:?}"
            );
            assert_eq!(
                claim(now).await.unwrap(),
                Claim::Taken {
                    fingerprint: "1".into(),
                    answer: Some((200, holder.id.to_string())),
                },
                "{kind:?} {how:?}: the record came with the order"
            );
            // Another purchase under the completed claim: nothing more.
            let verdict = store
                .sql_purchase_claimed(&order(sale.id, 1, 1), how, claimed)
                .await
                .unwrap();
            assert_eq!(verdict, SqlVerdict::ClaimLost, "{kind:?} {how:?}");
            assert_eq!(stock(store, sale.id).await, 9, "{kind:?} {how:?}");
        }
    }
}
