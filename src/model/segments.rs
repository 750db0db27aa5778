//! Segmented stock for a single hot sale. One Redis core decides a bounded number of
//! purchases a second; a sale created with `"segments": N` keeps its stock in N parts, each
//! with its own hash tag placed on its own share of the cluster's slots, so that N masters
//! decide its purchases side by side.
//!
//! The rules that keep the invariants:
//! - a buyer is pinned to one segment by user id ([`segment_of`]), so their per-user limit
//!   is checked in one place, atomically, as on an unsegmented sale;
//! - no unit is stranded: when the buyer's segment is empty and another still holds units,
//!   units are moved over (`gate::rebalance`: a move planned in SQL, taken from the donor and
//!   given to the receiver, each step idempotent by move id, finished by the scheduler if
//!   its mover dies), and `sold_out` is answered only when every segment is empty and no
//!   move is under way;
//! - SQL holds each segment's allocation (its even share of the initial stock plus the
//!   moves that took effect), so one lost segment is rebuilt alone.
//!
//! This module owns the arithmetic of segments: who belongs where, and each segment's
//! share. Where a segment's keys live is the key layout's (`redis_client::keys::hash_tag`);
//! the moves between segments are the gate's (`gate::rebalance`). Pure functions.

/// Most segments a sale may have: more would only spread a sale thinner than any cluster
/// this is meant for, and each empty segment costs a move.
pub const MAX_SEGMENTS: i64 = 64;

/// The segment a buyer belongs to, for a sale of `segments` parts. User ids are minted by
/// the id generator (time, worker, sequence): mixed first, so every segment gets its share.
pub fn segment_of(user_id: i64, segments: i64) -> i64 {
    if segments <= 1 {
        return 0;
    }
    // splitmix64's finaliser: every input bit moves every output bit.
    let mut z = user_id as u64;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z % segments as u64) as i64
}

/// A segment's share of the initial stock: even, the first ones taking the remainder.
pub fn allocation(initial_stock: i64, segments: i64, segment: i64) -> i64 {
    let n = segments.max(1);
    initial_stock / n + i64::from(segment < initial_stock % n)
}

/// The number of segments chosen for `"segments": "auto"`: one per master of a cluster
/// (each master then decides its share), but never below 20 units per segment (a segment
/// that small empties at once and turns every purchase into a move), and one on a single
/// Redis or without Redis, where parts would share the one core anyway.
pub fn auto_segments(masters: usize, stock: i64) -> i64 {
    let by_stock = (stock / 20).max(1);
    (masters.max(1) as i64).min(by_stock).min(MAX_SEGMENTS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_add_up_to_the_stock() {
        for (stock, n) in [(500, 3), (1, 4), (10, 1), (7, 7), (1000, 64)] {
            let parts: Vec<i64> = (0..n).map(|s| allocation(stock, n, s)).collect();
            assert_eq!(parts.iter().sum::<i64>(), stock);
            assert!(parts.iter().max().unwrap() - parts.iter().min().unwrap() <= 1);
        }
    }

    #[test]
    fn buyers_spread_over_every_segment() {
        // Ids minted close together (the same millisecond and worker) must not all land
        // in one segment.
        let mut counts = [0_i64; 3];
        for i in 0..3000_i64 {
            counts[segment_of((1_700_000_000_000 << 22) + i, 3) as usize] += 1;
        }
        for c in counts {
            assert!((800..1200).contains(&c), "{counts:?}");
        }
        assert_eq!(segment_of(12345, 1), 0);
    }

    #[test]
    fn auto_takes_one_per_master_within_reason() {
        assert_eq!(auto_segments(3, 500), 3);
        assert_eq!(auto_segments(3, 40), 2);
        assert_eq!(auto_segments(1, 100_000), 1);
        assert_eq!(auto_segments(200, 1_000_000), MAX_SEGMENTS);
    }
}
