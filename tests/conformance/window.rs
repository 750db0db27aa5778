//! The failover window (see `store::failover`), the same cases for each place it is kept:
//! in Redis (a distributed deployment) and in files (an embedded server on PostgreSQL or
//! MySQL). Changes read back in order, from where a reader stopped; a window settled against
//! a new identity only once every change was read, and then refusing a change committed
//! under the old one; nothing trimmed while the window is settled against another identity.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use seckill::store::failover::{Settled, Window, WindowError};
use seckill::window::file::FileWindow;
use seckill::window::redis::RedisWindow;

/// A fresh window of each kind: Redis under a prefix of its own, files in a folder of their own.
async fn windows() -> Vec<(&'static str, Arc<dyn Window>)> {
    let (_, conn) = seckill::app::redis_manager(&common::redis_url())
        .await
        .unwrap();
    let redis = RedisWindow::new(conn, &common::unique("window"));
    let dir = std::env::temp_dir().join(common::unique("window"));
    let file = FileWindow::open(&dir, seckill::clock::wall()).unwrap();
    vec![("redis", Arc::new(redis)), ("file", Arc::new(file))]
}

fn texts(records: &[(String, String)]) -> Vec<&str> {
    records.iter().map(|(_, r)| r.as_str()).collect()
}

#[tokio::test]
async fn changes_read_back_in_order_from_where_a_reader_stopped() {
    for (kind, w) in windows().await {
        assert_eq!(w.settled().await.unwrap(), None, "{kind}: new");
        for i in 0..5 {
            w.keep("db-a", &format!("change {i}")).await.unwrap();
        }
        assert_eq!(
            w.settled().await.unwrap().as_deref(),
            Some("db-a"),
            "{kind}: the first change settles a new window"
        );
        let first = w.read("0", 2).await.unwrap();
        assert_eq!(texts(&first), ["change 0", "change 1"], "{kind}");
        let rest = w.read(&first[1].0, 10).await.unwrap();
        assert_eq!(texts(&rest), ["change 2", "change 3", "change 4"], "{kind}");
        assert!(w.read(&rest[2].0, 10).await.unwrap().is_empty(), "{kind}");
    }
}

#[tokio::test]
async fn a_window_moves_to_a_new_identity_only_once_read_and_then_refuses_the_old() {
    for (kind, w) in windows().await {
        w.keep("db-a", "one").await.unwrap();
        w.keep("db-a", "two").await.unwrap();
        let all = w.read("0", 10).await.unwrap();
        assert_eq!(
            w.settle(Some("db-a"), "db-b", &all[0].0).await.unwrap(),
            Settled::More,
            "{kind}: a change after the last one read"
        );
        assert_eq!(
            w.settle(Some("db-x"), "db-b", &all[1].0).await.unwrap(),
            Settled::Moved("db-a".into()),
            "{kind}: settled against another identity than the caller read"
        );
        assert_eq!(
            w.settle(Some("db-a"), "db-b", &all[1].0).await.unwrap(),
            Settled::Done,
            "{kind}"
        );
        assert_eq!(w.settled().await.unwrap().as_deref(), Some("db-b"));
        // A writer still committing on the old primary hears of the failover.
        match w.keep("db-a", "late").await {
            Err(WindowError::Moved(now)) => assert_eq!(now, "db-b", "{kind}"),
            other => panic!("{kind}: a change under the old identity was taken: {other:?}"),
        }
        w.keep("db-b", "three").await.unwrap();
        let after = w.read(&all[1].0, 10).await.unwrap();
        assert_eq!(texts(&after), ["three"], "{kind}");
    }
}

#[tokio::test]
async fn nothing_ages_out_under_another_identity_nor_within_the_window() {
    for (kind, w) in windows().await {
        for i in 0..3 {
            w.keep("db-a", &format!("change {i}")).await.unwrap();
        }
        // The caller saw another database answer: a failover under way keeps everything.
        w.trim("db-b", Duration::ZERO).await.unwrap();
        assert_eq!(w.read("0", 10).await.unwrap().len(), 3, "{kind}");
        // Settled against it, but the changes are younger than the window.
        w.trim("db-a", Duration::from_secs(300)).await.unwrap();
        assert_eq!(w.read("0", 10).await.unwrap().len(), 3, "{kind}");
    }
}

#[tokio::test]
async fn one_replay_lease_at_a_time() {
    let (_, conn) = seckill::app::redis_manager(&common::redis_url())
        .await
        .unwrap();
    let w = RedisWindow::new(conn, &common::unique("window"));
    let ttl = Duration::from_secs(10);
    assert!(w.lock("a", ttl).await.unwrap());
    assert!(w.lock("a", ttl).await.unwrap(), "its holder keeps it");
    assert!(!w.lock("b", ttl).await.unwrap(), "another waits");
    w.unlock("b").await.unwrap();
    assert!(
        !w.lock("b", ttl).await.unwrap(),
        "only its holder gives it back"
    );
    w.unlock("a").await.unwrap();
    assert!(w.lock("b", ttl).await.unwrap());
}
