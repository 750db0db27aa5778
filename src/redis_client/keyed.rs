//! Many keys' commands in as few round trips as the deployment allows: on a standalone
//! server (or Sentinel's master) one pipeline; in a cluster one pipeline per master, each
//! command sent to the master that serves its key's slot. The scheduler's check, the audit's
//! reads and the writer's reads ask every open sale each second: a call per sale made 1,000
//! idle sales cost a core's tenth on a cluster.
//! It retries only a command sent to a master that no longer serves its slot (MOVED, ASK):
//! on its own, routed by the cluster client. (That client itself sends a whole pipeline
//! again where one command's redirect points; an XREADGROUP of it may then have been
//! answered twice, and its first entries wait, pending, for the writers' reclaim.)

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, RedisError, RedisResult, Value};

/// Slots of a Redis Cluster.
const SLOTS: usize = 16384;
/// How long a read of which master serves which slot is used before it is read again;
/// a redirect or a failed pipeline makes it read again at once.
const OWNERS_MAX_AGE: Duration = Duration::from_secs(10);

/// Commands, each with the slot of the key it works on, answered in the order added.
#[derive(Default)]
pub struct KeyedPipe {
    cmds: Vec<(u16, Cmd)>,
    /// Sent first to each server the commands go to (a read of the server itself).
    first: Option<Cmd>,
}

/// What a [`KeyedPipe`] with a first command answered: that command's answer from each
/// server, and each command's answer with the index of its server's first answer (`None`
/// for a command that was answered elsewhere, after a redirect).
pub struct KeyedAnswers {
    pub firsts: Vec<RedisResult<Value>>,
    pub answers: Vec<(Option<usize>, RedisResult<Value>)>,
}

impl KeyedPipe {
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts a command whose first argument is `key`; the rest are added to what it returns.
    pub fn cmd(&mut self, name: &str, key: &str) -> &mut Cmd {
        let mut cmd = redis::cmd(name);
        cmd.arg(key);
        self.routed(key, cmd)
    }

    /// Adds `cmd`, whose keys are all in the slot of `key`.
    pub fn routed(&mut self, key: &str, cmd: Cmd) -> &mut Cmd {
        self.cmds.push((slot_of(key.as_bytes()), cmd));
        let last = self.cmds.len() - 1;
        &mut self.cmds[last].1
    }

    /// Sends `cmd` (keyless) first to every server the commands go to: see
    /// [`RedisConn::query_keyed_with_first`](super::RedisConn::query_keyed_with_first).
    pub fn first_on_each_server(&mut self, cmd: Cmd) {
        self.first = Some(cmd);
    }

    pub fn len(&self) -> usize {
        self.cmds.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cmds.is_empty()
    }

    /// Runs every command on one standalone server: one pipeline, each answer on its own.
    pub(super) async fn query_single(
        self,
        conn: &mut redis::aio::ConnectionManager,
    ) -> RedisResult<KeyedAnswers> {
        let mut pipe = redis::pipe();
        // A command that fails (a key of another type) fails its own answer only.
        pipe.ignore_errors();
        let first = self.first.is_some();
        if let Some(cmd) = self.first {
            pipe.add_command(cmd);
        }
        for (_, cmd) in self.cmds {
            pipe.add_command(cmd);
        }
        let mut replies: Vec<RedisResult<Value>> = pipe.query_async(conn).await?;
        let firsts = match first {
            true if !replies.is_empty() => vec![replies.remove(0)],
            _ => Vec::new(),
        };
        let server = (!firsts.is_empty()).then_some(0);
        Ok(KeyedAnswers {
            firsts,
            answers: replies.into_iter().map(|r| (server, r)).collect(),
        })
    }

    /// Runs every command on the master serving its slot, one pipeline per master, all at
    /// once. A master that cannot be reached fails its own commands only.
    pub(super) async fn query_cluster(
        self,
        conn: &ClusterConnection,
        owners: &SlotOwners,
    ) -> KeyedAnswers {
        let masters = owners.current(conn).await;
        let mut groups: HashMap<u32, Vec<usize>> = HashMap::new();
        for (i, (slot, _)) in self.cmds.iter().enumerate() {
            // Slots of no known master go in a pipeline of their own slot.
            let group = masters
                .as_ref()
                .and_then(|m| m.get(*slot as usize).copied())
                .filter(|m| *m != NO_MASTER)
                .map(u32::from)
                .unwrap_or(u32::from(NO_MASTER) + 1 + u32::from(*slot));
            groups.entry(group).or_default().push(i);
        }
        let cmds = &self.cmds;
        let first = self.first.as_ref();
        let calls = groups.into_values().map(|indices| {
            let mut pipe = redis::pipe();
            // Each error in its own answer: a MOVED, or a key of another type, fails its
            // own command, not the master's whole pipeline.
            pipe.ignore_errors();
            if let Some(cmd) = first {
                pipe.add_command(cmd.clone());
            }
            for &i in &indices {
                pipe.add_command(cmds[i].1.clone());
            }
            let route = master_of(cmds[indices[0]].0);
            let mut conn = conn.clone();
            async move {
                let count = pipe.len();
                let reply = conn
                    .route_pipeline(pipe, 0, count, SingleNodeRoutingInfo::SpecificNode(route))
                    .await;
                (indices, reply)
            }
        });
        let mut answers: Vec<Option<(Option<usize>, RedisResult<Value>)>> = vec![None; cmds.len()];
        let mut firsts = Vec::new();
        let mut moved = Vec::new();
        for (indices, reply) in futures_util::future::join_all(calls).await {
            match reply {
                Ok(values) => {
                    let mut values = values.into_iter();
                    let server = match first {
                        Some(_) => {
                            firsts.push(values.next().map(answer).unwrap_or_else(|| Err(short())));
                            Some(firsts.len() - 1)
                        }
                        None => None,
                    };
                    for (i, value) in indices.into_iter().zip(values) {
                        match value {
                            Value::ServerError(e) => {
                                let e = RedisError::from(e);
                                if e.redirect_node().is_some() {
                                    moved.push(i);
                                } else {
                                    answers[i] = Some((server, Err(e)));
                                }
                            }
                            value => answers[i] = Some((server, Ok(value))),
                        }
                    }
                }
                // The cluster client follows a redirect of any command by sending the whole
                // pipeline where that one command went; the others then fail there. Each
                // goes on its own instead.
                Err(e) if e.redirect_node().is_some() => {
                    owners.mark_stale();
                    moved.extend(indices);
                }
                Err(e) => {
                    owners.mark_stale();
                    for i in indices {
                        answers[i] = Some((None, Err(e.clone())));
                    }
                }
            }
        }
        if !moved.is_empty() {
            owners.mark_stale();
        }
        // Sent to a master that no longer serves the slot: on its own, through the cluster
        // client, which follows the redirect.
        let retries = moved.into_iter().map(|i| {
            let mut conn = conn.clone();
            let (slot, cmd) = (cmds[i].0, cmds[i].1.clone());
            async move {
                let routing =
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(master_of(slot)));
                // A server's error comes back as a value here: an error, as in a pipeline.
                (i, conn.route_command(cmd, routing).await.and_then(answer))
            }
        });
        for (i, answer) in futures_util::future::join_all(retries).await {
            answers[i] = Some((None, answer));
        }
        KeyedAnswers {
            firsts,
            answers: answers
                .into_iter()
                .map(|a| a.unwrap_or_else(|| (None, Err(short()))))
                .collect(),
        }
    }
}

/// A pipeline's reply to one command, an error reply as an error.
fn answer(value: Value) -> RedisResult<Value> {
    match value {
        Value::ServerError(e) => Err(e.into()),
        value => Ok(value),
    }
}

fn short() -> RedisError {
    RedisError::from((
        redis::ErrorKind::UnexpectedReturnType,
        "a pipeline got fewer replies than it sent commands",
    ))
}

fn master_of(slot: u16) -> Route {
    Route::new(slot, SlotAddr::Master)
}

/// A slot no master was seen serving.
const NO_MASTER: u16 = u16::MAX;

/// Which master serves each slot, as `CLUSTER SLOTS` last said: an index per master,
/// shared by every clone of a connection.
#[derive(Default)]
pub struct SlotOwners {
    read: Mutex<Option<(Instant, Arc<Vec<u16>>)>>,
}

impl SlotOwners {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn mark_stale(&self) {
        *self.read.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// The masters of all slots, read again when older than `OWNERS_MAX_AGE` or stale;
    /// `None` when the cluster could not be asked.
    async fn current(&self, conn: &ClusterConnection) -> Option<Arc<Vec<u16>>> {
        if let Some((at, masters)) = &*self.read.lock().unwrap_or_else(|p| p.into_inner()) {
            if at.elapsed() < OWNERS_MAX_AGE {
                return Some(masters.clone());
            }
        }
        let reply: Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut conn.clone())
            .await
            .ok()?;
        let masters = Arc::new(masters_of_slots(&reply));
        *self.read.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((Instant::now(), masters.clone()));
        Some(masters)
    }
}

/// Each slot's master, as an index into the masters named by a `CLUSTER SLOTS` reply
/// (`[start, end, [host, port, ...], replicas...]` per range).
fn masters_of_slots(reply: &Value) -> Vec<u16> {
    let mut by_slot = vec![NO_MASTER; SLOTS];
    let mut masters: Vec<(Vec<u8>, i64)> = Vec::new();
    let Value::Array(ranges) = reply else {
        return by_slot;
    };
    for range in ranges {
        let Value::Array(parts) = range else { continue };
        let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(node))) =
            (parts.first(), parts.get(1), parts.get(2))
        else {
            continue;
        };
        let host = match node.first() {
            Some(Value::BulkString(h)) => h.clone(),
            Some(Value::SimpleString(h)) => h.clone().into_bytes(),
            _ => continue,
        };
        let Some(Value::Int(port)) = node.get(1) else {
            continue;
        };
        let master = (host, *port);
        let index = match masters.iter().position(|m| *m == master) {
            Some(i) => i,
            None => {
                masters.push(master);
                masters.len() - 1
            }
        };
        let (start, end) = ((*start).max(0) as usize, (*end).max(0) as usize);
        for slot in by_slot.iter_mut().take(end + 1).skip(start) {
            *slot = index as u16;
        }
    }
    by_slot
}

/// The cluster slot of `key`: that of its hash tag, or of the whole key, as Redis computes
/// it.
pub fn slot_of(key: &[u8]) -> u16 {
    super::keys::slot_of(hash_tag(key).unwrap_or(key))
}

/// What is between the first `{` and the next `}`, when that is not empty.
fn hash_tag(key: &[u8]) -> Option<&[u8]> {
    let open = key.iter().position(|b| *b == b'{')?;
    let close = key[open + 1..].iter().position(|b| *b == b'}')?;
    (close > 0).then(|| &key[open + 1..open + 1 + close])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_those_redis_computes() {
        // Values from `CLUSTER KEYSLOT`.
        assert_eq!(slot_of(b"foo"), 12182);
        assert_eq!(slot_of(b"somekey"), 11058);
        for key in [
            "seckill:{42}:orders",
            "a{}b",
            "{}",
            "x{y",
            "{a}{b}",
            "plain",
        ] {
            assert_eq!(
                master_of(slot_of(key.as_bytes())),
                Route::with_key(key, SlotAddr::Master),
                "{key}"
            );
        }
    }

    #[test]
    fn each_slot_gets_the_master_of_its_range() {
        let node = |port| {
            Value::Array(vec![
                Value::BulkString(b"127.0.0.1".to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let range = |start, end, port| {
            Value::Array(vec![
                Value::Int(start),
                Value::Int(end),
                node(port),
                node(port + 100),
            ])
        };
        let reply = Value::Array(vec![
            range(0, 5460, 7001),
            range(5461, 10922, 7002),
            range(10923, 16383, 7001),
        ]);
        let masters = masters_of_slots(&reply);
        assert_eq!(masters.len(), SLOTS);
        assert_eq!((masters[0], masters[5460]), (0, 0));
        assert_eq!((masters[5461], masters[10922]), (1, 1));
        assert_eq!((masters[10923], masters[16383]), (0, 0));
        let unknown = masters_of_slots(&Value::Array(vec![range(0, 10, 7001)]));
        assert_eq!((unknown[10], unknown[11]), (0, NO_MASTER));
    }
}
