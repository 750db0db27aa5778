//! The failover window in Redis: one stream of changes (`XADD`, ids by Redis' clock), the
//! identity it is settled against, and the replay's lease, under one hash tag. Keeping a
//! change and refusing it after a failover is one script, so that no change committed on an
//! old primary slips in after the window was settled against the new one.

use std::time::Duration;

use async_trait::async_trait;
use redis::{Script, Value};

use crate::redis_client::keys::FailoverKeys;
use crate::redis_client::RedisConn;
use crate::store::failover::{Settled, Window, WindowError};

pub struct RedisWindow {
    conn: RedisConn,
    keys: FailoverKeys,
    keep: Script,
    settle: Script,
    trim: Script,
    renew: Script,
    unlock: Script,
}

impl RedisWindow {
    pub fn new(conn: RedisConn, prefix: &str) -> Self {
        RedisWindow {
            conn,
            keys: FailoverKeys::new(prefix),
            keep: Script::new(include_str!("keep.lua")),
            settle: Script::new(include_str!("settle.lua")),
            trim: Script::new(include_str!("trim.lua")),
            renew: Script::new(crate::redis_client::lease::RENEW_LUA),
            unlock: Script::new(crate::redis_client::lease::UNLOCK_LUA),
        }
    }
}

fn unavailable(e: redis::RedisError) -> WindowError {
    WindowError::Unavailable(e.to_string())
}

/// A script's `{code, text?}` answer.
fn code_and_text(v: Value) -> Result<(i64, String), WindowError> {
    let bad = || WindowError::Unavailable("the failover window's script answered nothing".into());
    let Value::Array(parts) = v else {
        return Err(bad());
    };
    let code = match parts.first() {
        Some(Value::Int(n)) => *n,
        _ => return Err(bad()),
    };
    let text = match parts.get(1) {
        Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(Value::SimpleString(s)) => s.clone(),
        _ => String::new(),
    };
    Ok((code, text))
}

#[async_trait]
impl Window for RedisWindow {
    async fn keep(&self, identity: &str, record: &str) -> Result<(), WindowError> {
        let answer: Value = self
            .keep
            .key(&self.keys.identity)
            .key(&self.keys.window)
            .arg(identity)
            .arg(record)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(unavailable)?;
        match code_and_text(answer)? {
            (1, _) => Ok(()),
            (_, settled) => Err(WindowError::Moved(settled)),
        }
    }

    async fn settled(&self) -> Result<Option<String>, WindowError> {
        redis::cmd("GET")
            .arg(&self.keys.identity)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(unavailable)
    }

    async fn read(&self, after: &str, count: usize) -> Result<Vec<(String, String)>, WindowError> {
        let from = if after == "0" {
            "-".to_string()
        } else {
            format!("({after}")
        };
        let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
            .arg(&self.keys.window)
            .arg(from)
            .arg("+")
            .arg("COUNT")
            .arg(count)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(unavailable)?;
        Ok(entries
            .into_iter()
            .map(|(id, fields)| {
                let record = fields
                    .into_iter()
                    .find(|(k, _)| k == "c")
                    .map(|(_, v)| v)
                    .unwrap_or_default();
                (id, record)
            })
            .collect())
    }

    async fn settle(
        &self,
        from: Option<&str>,
        to: &str,
        last: &str,
    ) -> Result<Settled, WindowError> {
        let answer: Value = self
            .settle
            .key(&self.keys.identity)
            .key(&self.keys.window)
            .arg(from.unwrap_or(""))
            .arg(to)
            .arg(last)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(unavailable)?;
        Ok(match code_and_text(answer)? {
            (0, _) => Settled::Done,
            (1, _) => Settled::More,
            (_, other) => Settled::Moved(other),
        })
    }

    async fn trim(&self, identity: &str, age: Duration) -> Result<(), WindowError> {
        let _: i64 = self
            .trim
            .key(&self.keys.identity)
            .key(&self.keys.window)
            .arg(identity)
            .arg(age.as_millis() as u64)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn lock(&self, token: &str, ttl: Duration) -> Result<bool, WindowError> {
        let mut conn = self.conn.clone();
        let ms = ttl.as_millis() as u64;
        let taken: Option<String> = redis::cmd("SET")
            .arg(&self.keys.replay)
            .arg(token)
            .arg("NX")
            .arg("PX")
            .arg(ms)
            .query_async(&mut conn)
            .await
            .map_err(unavailable)?;
        if taken.is_some() {
            return Ok(true);
        }
        let renewed: i64 = self
            .renew
            .key(&self.keys.replay)
            .arg(token)
            .arg(ms)
            .invoke_async(&mut conn)
            .await
            .map_err(unavailable)?;
        Ok(renewed == 1)
    }

    async fn unlock(&self, token: &str) -> Result<(), WindowError> {
        let _: i64 = self
            .unlock
            .key(&self.keys.replay)
            .arg(token)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(unavailable)?;
        Ok(())
    }
}
