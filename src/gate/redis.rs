//! The Redis gate: sale state in Redis hashes, decided by `purchase.lua` (check window,
//! limit and stock, decrement, record the buyer, XADD the order) in one EVALSHA. Every key
//! of a sale shares the hash tag `{sale_id}`, so a sale lives in one Redis Cluster slot.
//! Concurrent purchases are batched into one script call per sale (see `batch`).

use async_trait::async_trait;
use redis::aio::ConnectionManager;
use redis::{Script, Value};

use super::{
    Gate, GateError, GateStock, Purchase, RateLimit, Rejection, Release, Released, SaleLoad, Spend,
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

    /// The marker of a spent single-use nonce (purchase token or captcha) of this sale.
    pub fn spent(&self, nonce: u64) -> String {
        // Same hash tag as the sale: the purchase script may touch it in Redis Cluster.
        format!("{}:spent:{nonce}", self.sale)
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
    /// Purchases go through one batcher, started with the first purchase (after the rate
    /// limit is set).
    batches: std::sync::OnceLock<super::batch::Batches>,
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
            batches: std::sync::OnceLock::new(),
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

fn reply_int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(n) => Some(*n),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

fn reply_bytes(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

/// One `(code, number)` pair of purchase.lua's reply as a verdict.
fn verdict(code: &[u8], n: i64) -> Option<Verdict> {
    Some(match code {
        b"ok" => Verdict::Accepted { remaining: n },
        b"not_loaded" => Verdict::Rejected(Rejection::NotLoaded),
        b"not_started" => Verdict::Rejected(Rejection::NotStarted),
        b"ended" => Verdict::Rejected(Rejection::Ended),
        b"paused" => Verdict::Rejected(Rejection::Paused),
        b"already_purchased" => Verdict::Rejected(Rejection::AlreadyPurchased),
        b"over_limit" => Verdict::Rejected(Rejection::OverLimit { held: n }),
        b"sold_out" => Verdict::Rejected(Rejection::SoldOut { remaining: n }),
        b"rate_limited" => Verdict::Rejected(Rejection::RateLimited { retry_after_ms: n }),
        b"token_used" => Verdict::Rejected(Rejection::TokenUsed),
        _ => return None,
    })
}

/// The reply of purchase.lua for `attempts` attempts: one verdict each, in order.
pub(super) fn verdicts_from_reply(v: &Value, attempts: usize) -> Result<Vec<Verdict>, GateError> {
    let bad = || GateError::BadReply(format!("{v:?}"));
    let Value::Array(items) = v else {
        return Err(bad());
    };
    if items.len() != 2 * attempts {
        return Err(bad());
    }
    items
        .chunks(2)
        .map(|pair| {
            let code = reply_bytes(&pair[0]).ok_or_else(bad)?;
            let n = reply_int(&pair[1]).ok_or_else(bad)?;
            verdict(code, n).ok_or_else(bad)
        })
        .collect()
}

#[async_trait]
impl Gate for RedisGate {
    async fn purchase(&self, p: Purchase) -> Result<Verdict, GateError> {
        let batches = self.batches.get_or_init(|| {
            super::batch::start(
                self.conn.clone(),
                self.purchase.clone(),
                self.prefix.clone(),
                self.rate,
            )
        });
        batches.decide(p).await
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

    async fn spend(&self, sale_id: i64, spend: Spend) -> Result<bool, GateError> {
        let mut conn = self.conn.clone();
        let set: Option<String> = redis::cmd("SET")
            .arg(self.keys(sale_id).spent(spend.nonce))
            .arg("1")
            .arg("NX")
            .arg("PX")
            .arg(spend.keep_ms(crate::now_ms()))
            .query_async(&mut conn)
            .await?;
        Ok(set.is_some())
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
    fn replies_map_to_verdicts_one_per_attempt() {
        let pair =
            |code: &str, n: i64| [Value::BulkString(code.as_bytes().to_vec()), Value::Int(n)];
        let reply = Value::Array([pair("ok", 3), pair("sold_out", 0)].concat());
        assert_eq!(
            verdicts_from_reply(&reply, 2).unwrap(),
            vec![
                Verdict::Accepted { remaining: 3 },
                Verdict::Rejected(Rejection::SoldOut { remaining: 0 })
            ]
        );
        assert!(
            verdicts_from_reply(&reply, 1).is_err(),
            "a pair per attempt"
        );
        assert!(verdicts_from_reply(&Value::Array(pair("nonsense", 0).to_vec()), 1).is_err());
        assert!(verdicts_from_reply(&Value::Nil, 1).is_err());
    }
}
