//! The Redis gate: sale state in Redis hashes, decided by `purchase.lua` (check window,
//! limit and stock, decrement, record the buyer, XADD the order) in one EVALSHA. Every key
//! of a sale shares the hash tag `{sale_id}`, so a sale lives in one Redis Cluster slot.
//! Concurrent purchases share one multiplexed connection, so their calls are pipelined.

use async_trait::async_trait;
use redis::aio::ConnectionManager;
use redis::{Script, Value};

use super::{
    Gate, GateError, GateStock, Purchase, RateLimit, Rejection, Release, Released, SaleLoad,
    Verdict,
};

/// How long a sale's gate keys outlive its end, for late order lookups and stats.
const KEEP_AFTER_END_MS: i64 = 7 * 86_400_000;
/// Buyers passed inline to the load script; more go through a staging hash.
const INLINE_BUYERS: usize = 1000;
/// The consumer group of the order writers on every sale stream.
pub const WRITER_GROUP: &str = "writers";

/// The Redis keys of one sale.
#[derive(Debug, Clone)]
pub struct SaleKeys {
    pub sale: String,
    pub buyers: String,
    pub stream: String,
    pub accepted: String,
    pub staging: String,
    pub dead: String,
    pub released: String,
    pub rate: String,
}

impl SaleKeys {
    pub fn new(prefix: &str, sale_id: i64) -> Self {
        let base = format!("{prefix}:{{{sale_id}}}");
        SaleKeys {
            sale: format!("{base}:sale"),
            buyers: format!("{base}:buyers"),
            stream: format!("{base}:orders"),
            accepted: format!("{base}:accepted"),
            staging: format!("{base}:buyers:loading"),
            dead: format!("{base}:dead"),
            released: format!("{base}:released"),
            rate: format!("{base}:rate"),
        }
    }
}

pub struct RedisGate {
    conn: ConnectionManager,
    prefix: String,
    purchase: Script,
    load: Script,
    pause: Script,
    release: Script,
    /// Per-user request rate, checked inside the purchase script (off by default).
    rate: RateLimit,
    /// Key names per sale, built once: formatting them on every purchase showed in profiles.
    keys: std::sync::RwLock<std::collections::HashMap<i64, std::sync::Arc<SaleKeys>>>,
}

impl RedisGate {
    pub fn new(conn: ConnectionManager, prefix: &str) -> Self {
        RedisGate {
            conn,
            prefix: prefix.to_string(),
            purchase: Script::new(include_str!("purchase.lua")),
            load: Script::new(include_str!("load_sale.lua")),
            pause: Script::new(include_str!("set_paused.lua")),
            release: Script::new(include_str!("release.lua")),
            rate: RateLimit {
                per_sec: 0.0,
                burst: 1,
            },
            keys: Default::default(),
        }
    }

    /// Throttles each user's purchases of a sale, across every instance.
    pub fn with_rate_limit(mut self, rate: RateLimit) -> Self {
        self.rate = rate;
        self
    }

    /// Loads the scripts into Redis once at start-up; calls then go by EVALSHA, and a
    /// NOSCRIPT (after a Redis restart) reloads transparently.
    pub async fn prepare(&self) -> Result<(), GateError> {
        let mut conn = self.conn.clone();
        for script in [&self.purchase, &self.load, &self.pause, &self.release] {
            script.prepare_invoke().load_async(&mut conn).await?;
        }
        Ok(())
    }

    fn keys(&self, sale_id: i64) -> std::sync::Arc<SaleKeys> {
        if let Some(k) = self
            .keys
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&sale_id)
        {
            return k.clone();
        }
        let k = std::sync::Arc::new(SaleKeys::new(&self.prefix, sale_id));
        self.keys
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(sale_id, k.clone());
        k
    }
}

fn reply_text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn reply_int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(n) => Some(*n),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

/// Turns the `{code, number}` reply of purchase.lua into a verdict.
fn verdict_from_reply(v: &Value) -> Result<Verdict, GateError> {
    let bad = || GateError::BadReply(format!("{v:?}"));
    let Value::Array(items) = v else {
        return Err(bad());
    };
    let code = items.first().and_then(reply_text).ok_or_else(bad)?;
    let n = items.get(1).and_then(reply_int).ok_or_else(bad)?;
    Ok(match code.as_str() {
        "ok" => Verdict::Accepted { remaining: n },
        "not_loaded" => Verdict::Rejected(Rejection::NotLoaded),
        "not_started" => Verdict::Rejected(Rejection::NotStarted),
        "ended" => Verdict::Rejected(Rejection::Ended),
        "paused" => Verdict::Rejected(Rejection::Paused),
        "already_purchased" => Verdict::Rejected(Rejection::AlreadyPurchased),
        "over_limit" => Verdict::Rejected(Rejection::OverLimit { held: n }),
        "sold_out" => Verdict::Rejected(Rejection::SoldOut { remaining: n }),
        "rate_limited" => Verdict::Rejected(Rejection::RateLimited { retry_after_ms: n }),
        _ => return Err(bad()),
    })
}

#[async_trait]
impl Gate for RedisGate {
    async fn purchase(&self, p: Purchase) -> Result<Verdict, GateError> {
        let k = self.keys(p.sale_id);
        let mut conn = self.conn.clone();
        let reply: Value = self
            .purchase
            .key(&k.sale)
            .key(&k.buyers)
            .key(&k.stream)
            .key(&k.accepted)
            .key(&k.rate)
            .arg(p.user_id)
            .arg(p.quantity)
            .arg(p.order_id)
            .arg(p.sale_id)
            .arg(self.rate.interval_ms())
            .arg(self.rate.tolerance_ms())
            .invoke_async(&mut conn)
            .await?;
        verdict_from_reply(&reply)
    }

    async fn load(&self, load: &SaleLoad) -> Result<bool, GateError> {
        let k = self.keys(load.sale.id);
        let mut conn = self.conn.clone();
        let staged = load.buyers.len() > INLINE_BUYERS;
        if staged {
            let _: () = redis::cmd("DEL")
                .arg(&k.staging)
                .query_async(&mut conn)
                .await?;
            for chunk in load.buyers.chunks(INLINE_BUYERS) {
                let mut cmd = redis::cmd("HSET");
                cmd.arg(&k.staging);
                for (user, units) in chunk {
                    cmd.arg(*user).arg(*units);
                }
                let _: i64 = cmd.query_async(&mut conn).await?;
            }
        }
        let s = &load.sale;
        let mut call = self.load.key(&k.sale);
        call.key(&k.buyers)
            .key(&k.stream)
            .key(&k.accepted)
            .key(&k.staging)
            .key(&k.released)
            .key(&k.rate)
            .arg(load.remaining)
            .arg(s.per_user_limit)
            .arg(s.begins_at)
            .arg(s.ends_at)
            .arg(if s.paused { "1" } else { "0" })
            .arg(s.price_cents)
            .arg(s.ends_at.saturating_add(KEEP_AFTER_END_MS))
            .arg(WRITER_GROUP)
            .arg(load.released.len());
        for order_id in &load.released {
            call.arg(*order_id);
        }
        if !staged {
            for (user, units) in &load.buyers {
                call.arg(*user).arg(*units);
            }
        }
        let loaded: i64 = call.invoke_async(&mut conn).await?;
        Ok(loaded == 1)
    }

    async fn release(&self, r: Release) -> Result<Released, GateError> {
        let k = self.keys(r.sale_id);
        let mut conn = self.conn.clone();
        let done: i64 = self
            .release
            .key(&k.sale)
            .key(&k.buyers)
            .key(&k.released)
            .arg(r.order_id)
            .arg(r.user_id)
            .arg(r.quantity)
            .arg(super::soldout::stock_channel(&self.prefix))
            .arg(r.sale_id)
            .invoke_async(&mut conn)
            .await?;
        Ok(match done {
            1 => Released::Now,
            0 => Released::Before,
            _ => Released::NotLoaded,
        })
    }

    async fn is_loaded(&self, sale_id: i64) -> Result<bool, GateError> {
        let mut conn = self.conn.clone();
        let n: i64 = redis::cmd("EXISTS")
            .arg(&self.keys(sale_id).sale)
            .query_async(&mut conn)
            .await?;
        Ok(n == 1)
    }

    async fn stock(&self, sale_id: i64) -> Result<Option<GateStock>, GateError> {
        let k = self.keys(sale_id);
        let mut conn = self.conn.clone();
        let (fields, buyers, accepted): ((Option<i64>, Option<String>), i64, i64) = redis::pipe()
            .cmd("HMGET")
            .arg(&k.sale)
            .arg("stock")
            .arg("paused")
            .cmd("HLEN")
            .arg(&k.buyers)
            .cmd("HLEN")
            .arg(&k.accepted)
            .query_async(&mut conn)
            .await?;
        Ok(fields.0.map(|remaining| GateStock {
            remaining,
            paused: fields.1.as_deref() == Some("1"),
            buyers,
            accepted,
        }))
    }

    async fn set_paused(&self, sale_id: i64, paused: bool) -> Result<(), GateError> {
        let mut conn = self.conn.clone();
        let _: i64 = self
            .pause
            .key(&self.keys(sale_id).sale)
            .arg(if paused { "1" } else { "0" })
            .invoke_async(&mut conn)
            .await?;
        Ok(())
    }

    async fn queued_order(
        &self,
        sale_id: i64,
        order_id: i64,
    ) -> Result<Option<(i64, i64)>, GateError> {
        let mut conn = self.conn.clone();
        let entry: Option<String> = redis::cmd("HGET")
            .arg(&self.keys(sale_id).accepted)
            .arg(order_id)
            .query_async(&mut conn)
            .await?;
        let Some(entry) = entry else { return Ok(None) };
        let parsed = entry
            .split_once(':')
            .and_then(|(u, q)| Some((u.parse().ok()?, q.parse().ok()?)));
        parsed.map(Some).ok_or(GateError::BadReply(entry))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_share_one_hash_tag() {
        let k = SaleKeys::new("p", 42);
        for key in [
            &k.sale,
            &k.buyers,
            &k.stream,
            &k.accepted,
            &k.staging,
            &k.dead,
        ] {
            assert!(key.starts_with("p:{42}:"), "{key}");
        }
    }

    #[test]
    fn replies_map_to_verdicts() {
        let r = |code: &str, n: i64| {
            Value::Array(vec![
                Value::BulkString(code.as_bytes().to_vec()),
                Value::Int(n),
            ])
        };
        assert_eq!(
            verdict_from_reply(&r("ok", 3)).unwrap(),
            Verdict::Accepted { remaining: 3 }
        );
        assert_eq!(
            verdict_from_reply(&r("sold_out", 0)).unwrap(),
            Verdict::Rejected(Rejection::SoldOut { remaining: 0 })
        );
        assert!(verdict_from_reply(&r("nonsense", 0)).is_err());
        assert!(verdict_from_reply(&Value::Nil).is_err());
    }
}
