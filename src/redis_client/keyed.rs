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
use std::sync::Arc;

use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, RedisError, RedisResult, Value};

use super::cluster::{Cluster, SlotOwners, NO_MASTER};

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
    pub(super) async fn query_cluster(self, cluster: &Arc<Cluster>) -> KeyedAnswers {
        let masters = cluster.owners().current(cluster).await;
        let conn = cluster.conn();
        let calls = self
            .by_master(masters.as_ref().map(|m| m.as_slice()))
            .into_values()
            .map(|indices| self.send_to_master(&conn, indices));
        let mut collected = Collected::new(self.cmds.len());
        for (indices, reply) in futures_util::future::join_all(calls).await {
            cluster.observe(&reply);
            collected.take(indices, reply, self.first.is_some(), cluster.owners());
        }
        collected.retry_moved(&self.cmds, cluster).await;
        collected.finish()
    }

    /// The commands' indices grouped by the master that serves their slots; slots of no
    /// known master each in a group of their own slot.
    fn by_master(&self, masters: Option<&[u16]>) -> HashMap<u32, Vec<usize>> {
        let mut groups: HashMap<u32, Vec<usize>> = HashMap::new();
        for (i, (slot, _)) in self.cmds.iter().enumerate() {
            let group = masters
                .and_then(|m| m.get(*slot as usize).copied())
                .filter(|m| *m != NO_MASTER)
                .map(u32::from)
                .unwrap_or(u32::from(NO_MASTER) + 1 + u32::from(*slot));
            groups.entry(group).or_default().push(i);
        }
        groups
    }

    /// One pipeline of the commands at `indices` (after the first command, if any) to the
    /// master of the first one's slot.
    fn send_to_master(
        &self,
        conn: &ClusterConnection,
        indices: Vec<usize>,
    ) -> impl std::future::Future<Output = (Vec<usize>, RedisResult<Vec<Value>>)> {
        let mut pipe = redis::pipe();
        // Each error in its own answer: a MOVED, or a key of another type, fails its own
        // command, not the master's whole pipeline.
        pipe.ignore_errors();
        if let Some(cmd) = &self.first {
            pipe.add_command(cmd.clone());
        }
        for &i in &indices {
            pipe.add_command(self.cmds[i].1.clone());
        }
        let route = master_of(self.cmds[indices[0]].0);
        let mut conn = conn.clone();
        async move {
            let count = pipe.len();
            let reply = conn
                .route_pipeline(pipe, 0, count, SingleNodeRoutingInfo::SpecificNode(route))
                .await;
            (indices, reply)
        }
    }
}

/// The answers of a cluster's pipelines as they come back, and the commands to send again
/// on their own because their master no longer served their slot.
struct Collected {
    answers: Vec<Option<(Option<usize>, RedisResult<Value>)>>,
    firsts: Vec<RedisResult<Value>>,
    moved: Vec<usize>,
}

impl Collected {
    fn new(commands: usize) -> Self {
        Collected {
            answers: vec![None; commands],
            firsts: Vec::new(),
            moved: Vec::new(),
        }
    }

    /// One master's reply to the commands at `indices`.
    fn take(
        &mut self,
        indices: Vec<usize>,
        reply: RedisResult<Vec<Value>>,
        with_first: bool,
        owners: &SlotOwners,
    ) {
        match reply {
            Ok(values) => {
                let mut values = values.into_iter();
                let server = with_first.then(|| {
                    let first = values.next().map(answer).unwrap_or_else(|| Err(short()));
                    self.firsts.push(first);
                    self.firsts.len() - 1
                });
                for (i, value) in indices.into_iter().zip(values) {
                    match answer(value) {
                        Err(e) if e.redirect_node().is_some() => self.moved.push(i),
                        answer => self.answers[i] = Some((server, answer)),
                    }
                }
            }
            // The cluster client follows a redirect of any command by sending the whole
            // pipeline where that one command went; the others then fail there. Each goes
            // on its own instead.
            Err(e) if e.redirect_node().is_some() => {
                owners.mark_stale();
                self.moved.extend(indices);
            }
            Err(e) => {
                owners.mark_stale();
                for i in indices {
                    self.answers[i] = Some((None, Err(e.clone())));
                }
            }
        }
    }

    /// Sends each command that met a master no longer serving its slot again on its own,
    /// through the cluster client, which follows the redirect.
    async fn retry_moved(&mut self, cmds: &[(u16, Cmd)], cluster: &Arc<Cluster>) {
        if self.moved.is_empty() {
            return;
        }
        cluster.owners().mark_stale();
        let retries = std::mem::take(&mut self.moved).into_iter().map(|i| {
            let mut conn = cluster.conn();
            let (slot, cmd) = (cmds[i].0, cmds[i].1.clone());
            async move {
                let routing =
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(master_of(slot)));
                // A server's error comes back as a value here: an error, as in a pipeline.
                (i, conn.route_command(cmd, routing).await)
            }
        });
        for (i, reply) in futures_util::future::join_all(retries).await {
            cluster.observe(&reply);
            self.answers[i] = Some((None, reply.and_then(answer)));
        }
    }

    fn finish(self) -> KeyedAnswers {
        KeyedAnswers {
            firsts: self.firsts,
            answers: self
                .answers
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
}
