//! A Redis Cluster connection shared by every clone of a [`RedisConn`](super::RedisConn):
//! which master serves each slot (for the keyed pipelines), and the connection itself,
//! opened again when it answers nothing but timeouts.
//! The cluster client runs all of a connection's requests, reconnections and slot refreshes
//! in one task. If that task wedges after a failover (a slot refresh waiting forever on a
//! lock one of its own requests holds), every command of every clone times out until the
//! process restarts: the gate, the loads, the worker-id lease, the scheduler. No single
//! master being away looks like that, since the others keep answering; so a connection
//! whose every answer has been a timeout for `WEDGED_AFTER` is replaced by a new one.
//! It never retries a command: the caller's own timeout and retry policy stand.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{RedisError, RedisResult, Value};

use super::COMMAND_TIMEOUT;

/// How long a connection may answer only timeouts before it is opened again: longer than
/// one command's timeout and its client's retries, so a slow answer or a single master
/// being promoted (the others answering meanwhile) never replaces it.
const WEDGED_AFTER: Duration = Duration::from_secs(6);

/// Connections opened again in this process because they had stopped answering.
static REOPENED: AtomicU64 = AtomicU64::new(0);

/// Slots of a Redis Cluster.
const SLOTS: usize = 16384;
/// How long a read of which master serves which slot is used before it is read again;
/// a redirect or a failed pipeline makes it read again at once.
const OWNERS_MAX_AGE: Duration = Duration::from_secs(10);

/// One cluster connection and what every clone shares with it.
pub struct Cluster {
    client: ClusterClient,
    current: ArcSwap<ClusterConnection>,
    owners: SlotOwners,
    born: Instant,
    /// Milliseconds after `born` of the last answer that was not a timeout.
    last_answer_ms: AtomicU64,
    reopening: AtomicBool,
}

impl Cluster {
    pub async fn open(client: &ClusterClient) -> Result<Arc<Self>, RedisError> {
        let conn = client.get_async_connection().await?;
        Ok(Arc::new(Cluster {
            client: client.clone(),
            current: ArcSwap::from_pointee(conn),
            owners: SlotOwners::default(),
            born: Instant::now(),
            last_answer_ms: AtomicU64::new(0),
            reopening: AtomicBool::new(false),
        }))
    }

    /// The connection to send on now.
    pub fn conn(&self) -> ClusterConnection {
        (**self.current.load()).clone()
    }

    pub fn owners(&self) -> &SlotOwners {
        &self.owners
    }

    /// Notes what a call on [`Cluster::conn`] came back with; a timeout after
    /// `WEDGED_AFTER` of nothing else opens the connection again, in the background.
    pub fn observe<T>(self: &Arc<Self>, result: &RedisResult<T>) {
        let now = self.born.elapsed().as_millis() as u64;
        match result {
            Err(e) if e.is_timeout() => {
                let quiet = now.saturating_sub(self.last_answer_ms.load(Ordering::Relaxed));
                if quiet >= WEDGED_AFTER.as_millis() as u64
                    && !self.reopening.swap(true, Ordering::AcqRel)
                {
                    tokio::spawn(self.clone().reopen(quiet));
                }
            }
            // Any other answer, an error reply included, came from a task that works.
            _ => {
                // Written only when it moves: every command of the process passes here.
                if self.last_answer_ms.load(Ordering::Relaxed) + 100 <= now {
                    self.last_answer_ms.store(now, Ordering::Relaxed);
                }
            }
        }
    }

    async fn reopen(self: Arc<Self>, quiet_ms: u64) {
        let opened =
            tokio::time::timeout(2 * COMMAND_TIMEOUT, self.client.get_async_connection()).await;
        match opened {
            Ok(Ok(conn)) => {
                // The old connection's task ends once its last clone, held by calls still
                // waiting for their timeouts, is dropped.
                self.current.store(Arc::new(conn));
                self.owners.mark_stale();
                let now = self.born.elapsed().as_millis() as u64;
                self.last_answer_ms.store(now, Ordering::Relaxed);
                REOPENED.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    quiet_secs = quiet_ms / 1000,
                    "the Redis Cluster connection answered only timeouts; opened it again"
                );
            }
            Ok(Err(e)) => tracing::warn!(
                error = %e,
                "the Redis Cluster connection answers only timeouts and could not be opened again"
            ),
            Err(_) => tracing::warn!(
                "the Redis Cluster connection answers only timeouts and opening it again timed out"
            ),
        }
        self.reopening.store(false, Ordering::Release);
    }
}

/// Connections opened again in this process because they had stopped answering.
pub fn reopened() -> u64 {
    REOPENED.load(Ordering::Relaxed)
}

/// The process's cluster connection series in Prometheus text.
pub fn render_metrics(out: &mut String) {
    out.push_str(&format!(
        "# HELP seckill_redis_cluster_reopened_total Redis Cluster connections opened again because every answer had been a timeout for {} s.\n# TYPE seckill_redis_cluster_reopened_total counter\nseckill_redis_cluster_reopened_total {}\n",
        WEDGED_AFTER.as_secs(),
        reopened()
    ));
}

/// A slot no master was seen serving.
pub(super) const NO_MASTER: u16 = u16::MAX;

/// Which master serves each slot, as `CLUSTER SLOTS` last said: an index per master,
/// shared by every clone of a connection.
#[derive(Default)]
pub struct SlotOwners {
    read: Mutex<Option<(Instant, Arc<Vec<u16>>)>>,
}

impl SlotOwners {
    pub(super) fn mark_stale(&self) {
        *self.read.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// The masters of all slots, read again when older than `OWNERS_MAX_AGE` or stale;
    /// `None` when the cluster could not be asked.
    pub(super) async fn current(&self, cluster: &Arc<Cluster>) -> Option<Arc<Vec<u16>>> {
        if let Some((at, masters)) = &*self.read.lock().unwrap_or_else(|p| p.into_inner()) {
            if at.elapsed() < OWNERS_MAX_AGE {
                return Some(masters.clone());
            }
        }
        let reply = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async::<Value>(&mut cluster.conn())
            .await;
        cluster.observe(&reply);
        let reply = reply.ok()?;
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

#[cfg(test)]
mod tests {
    use super::*;

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
