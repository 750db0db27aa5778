//! Each waiting room (memory, Redis) held to the same cases, on a clock the test moves:
//! no place before the draw, the lottery at the head then arrivals in turn, the cursor at
//! the sale's rate and never past the last ticket, stopped while closed, a ticket let
//! through stays so, and rooms advanced by many instances at once count time once.

use crate::common;

use std::sync::Arc;

use seckill::room::memory::MemoryRoom;
use seckill::room::redis::RedisRoom;
use seckill::room::{Closed, Room, RoomSale};

async fn rooms() -> Vec<(&'static str, Arc<dyn Room>, Arc<dyn Room>)> {
    let (_, conn) = seckill::app::redis_manager(&common::redis_url())
        .await
        .unwrap();
    let prefix = common::unique("room");
    // Two handles on one line: two instances of a deployment (memory: the same room).
    let memory: Arc<dyn Room> = Arc::new(MemoryRoom::new());
    vec![
        ("memory", memory.clone(), memory),
        (
            "redis",
            Arc::new(RedisRoom::new(conn.clone(), &prefix)),
            Arc::new(RedisRoom::new(conn, &prefix)),
        ),
    ]
}

/// A sale opening in a minute (the Redis keys expire a day after its end: real times).
fn sale(id: i64, rate: i64) -> RoomSale {
    let begins_at = seckill::clock::wall_ms() + 60_000;
    RoomSale {
        id,
        begins_at,
        ends_at: begins_at + 3_600_000,
        admit_per_sec: rate,
    }
}

#[tokio::test]
async fn the_lottery_then_arrivals_at_the_rate() {
    for (kind, one, other) in rooms().await {
        let s = sale(common::next_id(), 10);
        let open = s.begins_at;
        for user in 1..=50 {
            let t = one.join(&s, user, open - 10_000 + user).await.unwrap();
            assert_eq!(t.rank, None, "{kind}: no place before the draw");
        }
        let again = other.join(&s, 7, open - 100).await.unwrap();
        assert_eq!(
            (again.tickets, again.joined_at),
            (50, open - 10_000 + 7),
            "{kind}"
        );
        for user in 51..=60 {
            one.join(&s, user, open + user).await.unwrap();
        }
        let mut early = Vec::new();
        for user in 1..=60 {
            let t = other.ticket(&s, user, open + 100).await.unwrap().unwrap();
            if user <= 50 {
                early.push(t.rank.unwrap());
            } else {
                assert_eq!(t.rank, Some(user as u64 - 1), "{kind}: arrivals in turn");
            }
        }
        let mut sorted = early.clone();
        sorted.sort();
        assert_eq!(
            sorted,
            (0..50).collect::<Vec<u64>>(),
            "{kind}: the lottery at the head"
        );
        assert_ne!(
            early, sorted,
            "{kind}: drawn, not in joining order (1 in 50! to fail)"
        );
        assert!(one.ticket(&s, 999, open).await.unwrap().is_none(), "{kind}");

        // The cursor: 10 a second from the opening, both handles advancing, counted once.
        let mut stats = one.advance(&s, open + 500, None).await.unwrap();
        assert_eq!(stats.admitted, 5, "{kind}");
        for ms in (600..=2_000).step_by(100) {
            one.advance(&s, open + ms, None).await.unwrap();
            stats = other.advance(&s, open + ms, None).await.unwrap();
        }
        assert_eq!((stats.admitted, stats.tickets), (20, 60), "{kind}");
        // Closed: the cursor stays.
        let closed = one
            .advance(&s, open + 3_000, Some(Closed::SoldOut))
            .await
            .unwrap();
        assert_eq!(
            (closed.admitted, closed.closed),
            (20, Some(Closed::SoldOut)),
            "{kind}"
        );
        let t = other.ticket(&s, 55, open + 3_000).await.unwrap().unwrap();
        assert_eq!(t.closed, Some(Closed::SoldOut), "{kind}");
        // Reopened: it moves on from there, never past the last ticket.
        let reopened = one.advance(&s, open + 4_000, None).await.unwrap();
        assert_eq!((reopened.admitted, reopened.closed), (30, None), "{kind}");
        let all = one.advance(&s, open + 60_000, None).await.unwrap();
        assert_eq!((all.admitted, all.head_joined_at), (60, None), "{kind}");
        let late = one.join(&s, 61, open + 60_000).await.unwrap();
        assert_eq!((late.rank, late.admitted_at), (Some(60), None), "{kind}");
        let next = one.advance(&s, open + 60_200, None).await.unwrap();
        assert_eq!(
            next.admitted, 61,
            "{kind}: one who comes to an empty line waits a tick"
        );
        let through = other.ticket(&s, 61, open + 60_300).await.unwrap().unwrap();
        assert_eq!(through.admitted_at, Some(open + 60_300), "{kind}");
        let still = one.ticket(&s, 61, open + 90_000).await.unwrap().unwrap();
        assert_eq!(
            still.admitted_at,
            Some(open + 60_300),
            "{kind}: let through once, kept"
        );
    }
}

#[tokio::test]
async fn the_head_of_the_line_and_who_waits() {
    for (kind, one, _) in rooms().await {
        let s = sale(common::next_id(), 1);
        let open = s.begins_at;
        for user in 1..=3 {
            one.join(&s, user, open + user * 1000).await.unwrap();
        }
        let stats = one.advance(&s, open + 3_500, None).await.unwrap();
        assert_eq!((stats.admitted, stats.waiting()), (3, 0), "{kind}");
        one.join(&s, 4, open + 4_000).await.unwrap();
        one.join(&s, 5, open + 4_100).await.unwrap();
        let stats = one.advance(&s, open + 4_500, None).await.unwrap();
        assert_eq!(
            (stats.admitted, stats.waiting(), stats.head_joined_at),
            (4, 1, Some(open + 4_100)),
            "{kind}: the second the line stood empty was not saved up for later arrivals"
        );
    }
}
