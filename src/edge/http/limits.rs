//! Rate limits kept in this process: the per-address limit at the edge, and any other
//! per-key limit (captcha issuance per user and sale). Each key has a token bucket in a
//! sharded, bounded table, so that a flood of distinct keys (spoofed IPv6 addresses) costs
//! neither unbounded memory nor a scan of everything under one lock.
//!
//! The per-address limit is off until configured (a whole crowd may share one address
//! behind a carrier's NAT). The address is the peer's, or the one a trusted proxy put in
//! X-Forwarded-For; the header is ignored from anyone else, since a client can write
//! anything in it.

use crate::metrics::render_counter;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use axum::http::HeaderMap;

use super::error::ApiError;
use crate::gate::RateLimit;

/// Buckets kept at most, over all shards.
const MAX_BUCKETS: usize = 200_000;
const SHARDS: usize = 64;

/// A token bucket per key: `(tokens, last refill in ms)`.
pub struct RateTable<K> {
    rate: RateLimit,
    per_shard: usize,
    hasher: std::collections::hash_map::RandomState,
    shards: Vec<Mutex<HashMap<K, (f64, i64)>>>,
}

impl<K: Hash + Eq + Copy> RateTable<K> {
    pub fn new(rate: RateLimit, max_keys: usize) -> Self {
        RateTable {
            rate,
            per_shard: (max_keys / SHARDS).max(16),
            hasher: Default::default(),
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
        }
    }

    /// Takes a token for `key`; Err(ms to wait) when its bucket is empty.
    pub fn take(&self, key: K, now_ms: i64) -> Result<(), i64> {
        let capacity = self.rate.burst.max(1) as f64;
        let per_ms = self.rate.per_sec / 1000.0;
        let shard = self.hasher.hash_one(key) as usize % SHARDS;
        let mut buckets = self.shards[shard].lock().unwrap_or_else(|p| p.into_inner());
        if buckets.len() >= self.per_shard && !buckets.contains_key(&key) {
            // A full bucket is the same as no bucket: drop those first. If every key is
            // still busy, forget an eighth of them (each gets a fresh bucket if it comes
            // back), so that the next scan is an eighth of a shard's inserts away.
            buckets
                .retain(|_, (tokens, last)| *tokens + (now_ms - *last) as f64 * per_ms < capacity);
            if buckets.len() >= self.per_shard {
                let evict: Vec<K> = buckets
                    .keys()
                    .take(self.per_shard / 8 + 1)
                    .copied()
                    .collect();
                for k in evict {
                    buckets.remove(&k);
                }
            }
        }
        let (tokens, last) = buckets.entry(key).or_insert((capacity, now_ms));
        *tokens = (*tokens + now_ms.saturating_sub(*last).max(0) as f64 * per_ms).min(capacity);
        *last = now_ms;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            Ok(())
        } else {
            Err((((1.0 - *tokens) * 1000.0 / self.rate.per_sec).ceil() as i64).max(1))
        }
    }

    /// Err(ms to wait) when `key`'s bucket is empty; takes nothing.
    pub fn check(&self, key: K, now_ms: i64) -> Result<(), i64> {
        let capacity = self.rate.burst.max(1) as f64;
        let per_ms = self.rate.per_sec / 1000.0;
        let shard = self.hasher.hash_one(key) as usize % SHARDS;
        let buckets = self.shards[shard].lock().unwrap_or_else(|p| p.into_inner());
        let Some((tokens, last)) = buckets.get(&key) else {
            return Ok(());
        };
        let tokens = (tokens + now_ms.saturating_sub(*last).max(0) as f64 * per_ms).min(capacity);
        if tokens >= 1.0 {
            Ok(())
        } else {
            Err((((1.0 - tokens) * 1000.0 / self.rate.per_sec).ceil() as i64).max(1))
        }
    }

    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).len())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

pub struct AddressLimiter {
    rate: RateLimit,
    trusted: Vec<IpAddr>,
    buckets: RateTable<IpAddr>,
    pub limited: AtomicU64,
}

impl AddressLimiter {
    /// Its series in Prometheus text.
    pub fn render(&self, out: &mut String) {
        render_counter(
            "seckill_rate_limited_addresses_total",
            "Requests refused by the per-address limit.",
            self.limited.load(Ordering::Relaxed),
            out,
        );
    }

    pub fn new(rate: RateLimit, trusted: Vec<IpAddr>) -> Self {
        AddressLimiter {
            rate,
            trusted,
            buckets: RateTable::new(rate, MAX_BUCKETS),
            limited: AtomicU64::new(0),
        }
    }

    pub fn enabled(&self) -> bool {
        self.rate.per_sec > 0.0
    }

    /// The client's address: the peer, or the nearest untrusted hop a trusted proxy reported.
    pub fn client_of(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        if !self.trusted.contains(&peer) {
            return peer;
        }
        let hops: Vec<IpAddr> = headers
            .get_all("x-forwarded-for")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|h| h.trim().parse().ok())
            .collect();
        hops.into_iter()
            .rev()
            .find(|h| !self.trusted.contains(h))
            .unwrap_or(peer)
    }

    /// Takes a token for `addr`; Err(ms to wait) when its bucket is empty.
    pub fn take(&self, addr: IpAddr, now_ms: i64) -> Result<(), i64> {
        self.buckets.take(addr, now_ms)
    }

    /// Takes a token for the caller of a request from `peer`, or answers 429
    /// `rate_limited` (with Retry-After) when its address is over the rate.
    pub fn admit(&self, peer: IpAddr, headers: &HeaderMap) -> Result<(), ApiError> {
        let client = self.client_of(peer, headers);
        self.take(client, crate::clock::wall_ms())
            .map_err(|wait_ms| {
                self.limited.fetch_add(1, Ordering::Relaxed);
                ApiError::RateLimited {
                    retry_after_secs: (wait_ms as u64).div_ceil(1000),
                    message: "too many requests from this address".into(),
                }
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(trusted: &[&str]) -> AddressLimiter {
        AddressLimiter::new(
            RateLimit {
                per_sec: 2.0,
                burst: 2,
            },
            trusted.iter().map(|t| t.parse().unwrap()).collect(),
        )
    }

    #[test]
    fn buckets_refill_at_the_rate() {
        let l = limiter(&[]);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        assert!(l.take(a, 0).is_ok());
        assert!(l.take(a, 0).is_ok());
        assert_eq!(l.take(a, 0), Err(500));
        assert!(
            l.take("10.0.0.2".parse().unwrap(), 0).is_ok(),
            "other addresses have their own bucket"
        );
        assert!(l.take(a, 500).is_ok(), "one token back after 500 ms at 2/s");
    }

    #[test]
    fn a_flood_of_addresses_stays_bounded_and_keeps_limiting() {
        let table = RateTable::new(
            RateLimit {
                per_sec: 1.0,
                burst: 1,
            },
            6_400,
        );
        let busy: IpAddr = "10.0.0.1".parse().unwrap();
        assert!(table.take(busy, 0).is_ok());
        // A million spoofed IPv6 addresses, each taking its one token.
        for i in 0..1_000_000u128 {
            let a = IpAddr::V6(std::net::Ipv6Addr::from(0x2001_0db8_u128 << 96 | i));
            assert!(table.take(a, 10).is_ok());
        }
        assert!(table.len() <= 6_400, "bounded: {}", table.len());
        // Within the same second, a key still tracked is still limited.
        let fresh: IpAddr = "10.0.0.2".parse().unwrap();
        assert!(table.take(fresh, 20).is_ok());
        assert!(table.take(fresh, 21).is_err());
    }

    #[test]
    fn forwarded_for_counts_only_from_trusted_proxies() {
        let l = limiter(&["127.0.0.1"]);
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", "203.0.113.9, 127.0.0.1".parse().unwrap());
        assert_eq!(
            l.client_of("127.0.0.1".parse().unwrap(), &h),
            "203.0.113.9".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            l.client_of("198.51.100.7".parse().unwrap(), &h),
            "198.51.100.7".parse::<IpAddr>().unwrap(),
            "spoofed header ignored"
        );
        assert_eq!(
            l.client_of("127.0.0.1".parse().unwrap(), &HeaderMap::new()),
            "127.0.0.1".parse::<IpAddr>().unwrap()
        );
    }
}
