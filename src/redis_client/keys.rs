//! The key layout: every Redis key and channel seckill uses, named in one place. A sale's
//! keys share one hash tag (`{sale_id}`, or a segment's own tag), so that every script call
//! about a sale stays in one Redis Cluster slot; the process-wide keys (worker ids, the
//! audit lease) have tags of their own. Pure functions; no I/O.

/// Redis Cluster's slot count.
const SLOTS: u32 = 16_384;

/// The consumer group of the order writers on every sale stream.
pub const WRITER_GROUP: &str = "writers";

/// The order stream and the dead-letter stream of a sale's segment.
#[derive(Debug, Clone)]
pub struct StreamKeys {
    pub stream: String,
    pub dead: String,
}

/// The Redis keys of one sale.
#[derive(Debug, Clone)]
pub struct SaleKeys {
    pub sale: String,
    pub buyers: String,
    pub stream: String,
    pub accepted: String,
    pub dead: String,
    pub released: String,
    pub rate: String,
    /// The load lock, its fence counter, the orders a load counted and the orders written
    /// to SQL while a load held the lock.
    pub lock: String,
    pub fence: String,
    /// The orders the gate counted without accepting them, packed (gate/counted.lua).
    pub counted: String,
    /// The same as a set, as builds before the packing kept it: read, never written.
    pub counted_set: String,
    pub confirms: String,
    /// Moves of stock between segments, as this segment took part in them.
    pub moves: String,
    /// How many segments the sale has (kept under the unsegmented tag, for the calls that
    /// name a sale but no buyer).
    pub segments: String,
}

impl SaleKeys {
    /// The keys of an unsegmented sale (and the sale-wide keys of a segmented one).
    pub fn new(prefix: &str, sale_id: i64) -> Self {
        Self::for_segment(prefix, sale_id, 1, 0)
    }

    /// The order stream of a sale's segment alone: what the writers watch every second,
    /// without the other keys' formatting.
    pub fn stream_of(prefix: &str, sale_id: i64, segments: i64, segment: i64) -> String {
        let tag = hash_tag(sale_id, segments, segment);
        format!("{prefix}:{{{tag}}}:orders")
    }

    /// A segment's order stream and dead-letter stream alone: what the audit and the
    /// lag metrics read of every sale.
    pub fn streams_of(prefix: &str, sale_id: i64, segments: i64, segment: i64) -> StreamKeys {
        let tag = hash_tag(sale_id, segments, segment);
        StreamKeys {
            stream: format!("{prefix}:{{{tag}}}:orders"),
            dead: format!("{prefix}:{{{tag}}}:dead"),
        }
    }

    /// The keys of one segment of a sale of `segments` parts: a hash tag of its own.
    pub fn for_segment(prefix: &str, sale_id: i64, segments: i64, segment: i64) -> Self {
        let tag = hash_tag(sale_id, segments, segment);
        let base = format!("{prefix}:{{{tag}}}");
        SaleKeys {
            sale: format!("{base}:sale"),
            buyers: format!("{base}:buyers"),
            stream: format!("{base}:orders"),
            accepted: format!("{base}:accepted"),
            dead: format!("{base}:dead"),
            released: format!("{base}:released"),
            rate: format!("{base}:rate"),
            lock: format!("{base}:load:lock"),
            fence: format!("{base}:load:fence"),
            counted: format!("{base}:counted_ids"),
            counted_set: format!("{base}:counted"),
            confirms: format!("{base}:load:confirms"),
            moves: format!("{base}:moves"),
            segments: format!("{prefix}:{{{sale_id}}}:segments"),
        }
    }

    /// A loader's own staging key, named by its owner token: no other loader writes or
    /// deletes it, not even one that took the same fence after Redis lost its data.
    pub fn staged(&self, owner: &str, what: &str) -> String {
        format!(
            "{}:load:{owner}:{what}",
            self.sale.trim_end_matches(":sale")
        )
    }

    /// The record of a buyer's purchase made with an `Idempotency-Key` (see
    /// `gate::RetryKey`), under the sale's hash tag like every key the purchase script
    /// touches.
    pub fn retry_record(&self, user_id: i64, key: u128) -> String {
        format!("{}:again:{user_id}:{key:032x}", self.sale)
    }

    /// The marker of a spent single-use nonce (purchase token or captcha) of this sale.
    pub fn spent(&self, nonce: u64) -> String {
        // Same hash tag as the sale: the purchase script may touch it in Redis Cluster.
        format!("{}:spent:{nonce}", self.sale)
    }
}

/// The keys of a sale's waiting room (see `room`), under the sale's own hash tag: one slot
/// for the room's scripts whatever the sale's segments.
#[derive(Debug, Clone)]
pub struct RoomKeys {
    /// Buyers by place (sorted set).
    pub line: String,
    /// When each buyer joined (hash).
    pub joined: String,
    /// When each buyer was let through (hash).
    pub admitted: String,
    /// The cursor, its last move, why the room is closed, the count of later joiners.
    pub state: String,
}

impl RoomKeys {
    pub fn new(prefix: &str, sale_id: i64) -> Self {
        let base = format!("{prefix}:{{{sale_id}}}:room");
        RoomKeys {
            line: format!("{base}:line"),
            joined: format!("{base}:joined"),
            admitted: format!("{base}:admitted"),
            state: format!("{base}:state"),
        }
    }

    pub fn all(&self) -> [&str; 4] {
        [&self.line, &self.joined, &self.admitted, &self.state]
    }
}

/// The keys a scan for every loaded sale of a deployment matches (`SCAN MATCH`).
pub fn every_sale_pattern(prefix: &str) -> String {
    format!("{prefix}:{{*}}:sale")
}

/// The channel on which every release of stock is announced to all instances.
pub fn stock_channel(prefix: &str) -> String {
    format!("{prefix}:stock-returned")
}

/// The failover window of SQL's recent changes (a stream), the database identity it is
/// settled against, and the lease of the process that writes it again after a failover:
/// one hash tag, so that a script may read and write them together in a cluster.
pub struct FailoverKeys {
    pub window: String,
    pub identity: String,
    pub replay: String,
}

impl FailoverKeys {
    pub fn new(prefix: &str) -> Self {
        let base = format!("{prefix}:{{failover}}");
        FailoverKeys {
            window: format!("{base}:window"),
            identity: format!("{base}:identity"),
            replay: format!("{base}:replay"),
        }
    }
}

/// The lease of the instance that runs the continuous audit.
pub fn audit_lease(prefix: &str) -> String {
    format!("{prefix}:{{audit}}:lease")
}

/// The start of the worker id leases' keys (`{start}:worker:{id}`, `{start}:epoch`). In a
/// cluster the lease script's two keys must share a slot: one hash tag for both.
pub fn worker_ids(prefix: &str, cluster: bool) -> String {
    if cluster {
        format!("{prefix}:{{ids}}")
    } else {
        prefix.to_string()
    }
}

/// The text inside the braces of a segment's keys. An unsegmented sale keeps `{sale_id}`.
/// Segment `s` of `n` gets `{sale_id.s.j}` with the first `j` whose slot falls in the middle
/// half of the s-th n-th of the slot range: on a cluster whose masters own even, contiguous
/// slot ranges (what `redis-cli --cluster create` and rebalancing make) and `n` a multiple
/// of the masters (or at most their number), the segments land on different masters.
pub fn hash_tag(sale_id: i64, segments: i64, segment: i64) -> String {
    if segments <= 1 {
        return sale_id.to_string();
    }
    let width = SLOTS / segments as u32;
    let low = segment as u32 * width + width / 4;
    let high = low + (width / 2).max(1);
    // Expected 2n tries; the bound only guards against an impossible search.
    for j in 0..100_000 {
        let tag = format!("{sale_id}.{segment}.{j}");
        let slot = slot_of(tag.as_bytes()) as u32;
        if (low..high).contains(&slot) {
            return tag;
        }
    }
    format!("{sale_id}.{segment}")
}

/// Redis Cluster's slot of a hash tag: CRC16 (XMODEM) modulo the slot count. (The redis
/// crate computes it too, but keeps the number private.)
pub fn slot_of(tag: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for byte in tag {
        crc ^= (*byte as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    (crc as u32 % SLOTS) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_alone_is_named_as_with_the_other_keys() {
        for (sale, segments, segment) in [(42, 1, 0), (7, 3, 2), (9, 4, 0)] {
            let all = SaleKeys::for_segment("p", sale, segments, segment);
            assert_eq!(
                SaleKeys::stream_of("p", sale, segments, segment),
                all.stream
            );
            let streams = SaleKeys::streams_of("p", sale, segments, segment);
            assert_eq!((streams.stream, streams.dead), (all.stream, all.dead));
        }
    }

    #[test]
    fn keys_share_one_hash_tag() {
        let k = SaleKeys::new("p", 42);
        // Every key a script of this sale touches, so that each script call stays in one
        // Redis Cluster slot (a CROSSSLOT error otherwise).
        for key in [
            &k.sale,
            &k.buyers,
            &k.stream,
            &k.accepted,
            &k.dead,
            &k.released,
            &k.rate,
            &k.lock,
            &k.fence,
            &k.counted,
            &k.counted_set,
            &k.confirms,
            &k.moves,
            &k.staged("0a1b:2c3d", "buyers"),
            &k.staged("0a1b:2c3d", "counted"),
            &k.spent(77),
        ] {
            assert!(key.starts_with("p:{42}:"), "{key}");
            assert_eq!(
                redis::cluster_routing::Slot::for_key(key),
                redis::cluster_routing::Slot::for_key("{42}"),
                "{key}"
            );
        }
    }

    #[test]
    fn slots_match_the_redis_crate() {
        for key in ["42", "7.1.3", "foo", "123456789"] {
            assert_eq!(
                Some(redis::cluster_routing::Slot::for_key(key)),
                redis::cluster_routing::Slot::new(slot_of(key.as_bytes())),
                "{key}"
            );
        }
        // Keys hash by their tag, which is what this is given.
        assert_eq!(
            Some(redis::cluster_routing::Slot::for_key("p:{7.1.3}:sale")),
            redis::cluster_routing::Slot::new(slot_of(b"7.1.3"))
        );
        // The example of the Redis Cluster specification.
        assert_eq!(slot_of(b"123456789"), 0x31C3);
    }

    #[test]
    fn segments_of_a_sale_sit_in_distinct_thirds_of_the_slots() {
        for sale in [1_i64, 42, 7_000_000_123] {
            let thirds: Vec<u32> = (0..3)
                .map(|s| slot_of(hash_tag(sale, 3, s).as_bytes()) as u32 / (SLOTS / 3))
                .collect();
            assert_eq!(thirds, vec![0, 1, 2], "sale {sale}");
        }
        assert_eq!(
            hash_tag(42, 1, 0),
            "42",
            "an unsegmented sale keeps its keys"
        );
    }
}
