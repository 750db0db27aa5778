//! Reading the replies of the Redis gate's scripts: purchase.lua answers a `(code,
//! number)` pair per attempt of a batch. Pure functions; no I/O.

use redis::Value;

use super::{GateError, Rejection, Verdict};

pub fn reply_int(v: &Value) -> Option<i64> {
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
        b"expired" => Verdict::Rejected(Rejection::Expired),
        b"again" => Verdict::Again { order_id: n },
        b"key_reused" => Verdict::Rejected(Rejection::RetryKeyReused),
        _ => return None,
    })
}

/// The reply of purchase.lua for `attempts` attempts: one verdict each, in order.
pub fn verdicts_from_reply(v: &Value, attempts: usize) -> Result<Vec<Verdict>, GateError> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
        // A record names its order as text: an order id is past a Lua number's 2^53.
        let again = Value::Array(vec![
            Value::BulkString(b"again".to_vec()),
            Value::BulkString(b"7318912397319823101".to_vec()),
        ]);
        assert_eq!(
            verdicts_from_reply(&again, 1).unwrap(),
            vec![Verdict::Again {
                order_id: 7318912397319823101
            }]
        );
        assert!(
            verdicts_from_reply(&reply, 1).is_err(),
            "a pair per attempt"
        );
        assert!(verdicts_from_reply(&Value::Array(pair("nonsense", 0).to_vec()), 1).is_err());
        assert!(verdicts_from_reply(&Value::Nil, 1).is_err());
    }
}
