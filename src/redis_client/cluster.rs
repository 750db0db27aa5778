//! A Redis Cluster connection shared by every clone of a [`RedisConn`](super::RedisConn):
//! which master serves each slot (for the keyed pipelines), and the connection itself,
//! opened again when it answers nothing but timeouts.
//! The cluster client runs all of a connection's requests, reconnections and slot refreshes
//! in one task. If that task wedges after a failover (a slot refresh waiting forever on a
//! lock one of its own requests holds), every command of every clone times out until the
//! process restarts: the gate, the loads, the worker-id lease, the scheduler. No single
//! master being away looks like that, since the others keep answering; so a connection
//! that has given nothing but timeouts (or dropped connections: its task gone) for
//! `WEDGED_AFTER` is replaced by a new one.
//! It never retries a command: the caller's own timeout and retry policy stand.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{RedisError, RedisResult, Value};

use super::COMMAND_TIMEOUT;

/// How long a connection may give only timeouts before it is opened again: longer than
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
    watch: Watch,
}

impl Cluster {
    pub async fn open(client: &ClusterClient) -> Result<Arc<Self>, RedisError> {
        let conn = client.get_async_connection().await?;
        Ok(Arc::new(Cluster {
            client: client.clone(),
            current: ArcSwap::from_pointee(conn),
            owners: SlotOwners::default(),
            born: Instant::now(),
            watch: Watch::default(),
        }))
    }

    /// The connection to send on now.
    pub fn conn(&self) -> ClusterConnection {
        (**self.current.load()).clone()
    }

    pub fn owners(&self) -> &SlotOwners {
        &self.owners
    }

    fn now_ms(&self) -> u64 {
        self.born.elapsed().as_millis() as u64
    }

    /// Notes what a call on [`Cluster::conn`] came back with (calls that their caller's
    /// own deadline cancels first are not seen; the background duties' calls, the lease's
    /// every second, are). A connection that has given nothing but timeouts and dropped
    /// connections for `WEDGED_AFTER` is opened again, in the background.
    pub fn observe<T>(self: &Arc<Self>, result: &RedisResult<T>) {
        let now = self.now_ms();
        match result {
            Err(e) if e.is_timeout() || e.is_connection_dropped() => {
                if self.watch.no_answer(now) {
                    tokio::spawn(self.clone().reopen());
                }
            }
            // Any other answer, an error reply included, came from a task that works.
            _ => self.watch.answered(now),
        }
    }

    async fn reopen(self: Arc<Self>) {
        let quiet_secs = self.now_ms().saturating_sub(self.watch.last_answer()) / 1000;
        let opened =
            tokio::time::timeout(2 * COMMAND_TIMEOUT, self.client.get_async_connection()).await;
        match opened {
            Ok(Ok(conn)) => {
                // The old connection's task ends once its last clone, held by calls still
                // waiting for their timeouts, is dropped.
                self.current.store(Arc::new(conn));
                self.owners.mark_stale();
                REOPENED.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    quiet_secs,
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
        // Opened or not, the next try waits for another `WEDGED_AFTER` of silence: a
        // cluster that is down altogether is not asked to connect on every timeout.
        self.watch.reopen_done(self.now_ms());
    }
}

/// When a connection last answered, and whether it has been silent long enough to be
/// opened again: milliseconds since the connection was opened, shared without a lock
/// because every command of the connection passes here.
#[derive(Default)]
struct Watch {
    last_answer_ms: AtomicU64,
    /// When the first timeout after the last answer came back, plus one (0: none since).
    first_silence_ms: AtomicU64,
    reopening: AtomicBool,
}

impl Watch {
    fn answered(&self, now: u64) {
        // Written only when it moves: most answers leave both as they are.
        if self.last_answer_ms.load(Ordering::Relaxed) + 100 <= now {
            self.last_answer_ms.store(now, Ordering::Relaxed);
        }
        if self.first_silence_ms.load(Ordering::Relaxed) != 0 {
            self.first_silence_ms.store(0, Ordering::Relaxed);
        }
    }

    /// A call came back without an answer; true when this caller is to open the
    /// connection again. Silent means both: no answer for `WEDGED_AFTER`, and calls
    /// failing for longer than one command's timeout (an idle process's first timeout
    /// is not yet a wedge).
    fn no_answer(&self, now: u64) -> bool {
        let first = match self.first_silence_ms.load(Ordering::Relaxed) {
            0 => {
                self.first_silence_ms.store(now + 1, Ordering::Relaxed);
                now
            }
            plus_one => plus_one - 1,
        };
        let quiet = now.saturating_sub(self.last_answer_ms.load(Ordering::Relaxed));
        let failing = now.saturating_sub(first);
        quiet >= WEDGED_AFTER.as_millis() as u64
            && failing >= (WEDGED_AFTER - COMMAND_TIMEOUT).as_millis() as u64
            && !self.reopening.swap(true, Ordering::AcqRel)
    }

    /// A new connection is in place, or could not be opened: silence counts from now.
    fn reopen_done(&self, now: u64) {
        self.last_answer_ms.store(now, Ordering::Relaxed);
        self.first_silence_ms.store(0, Ordering::Relaxed);
        self.reopening.store(false, Ordering::Release);
    }

    fn last_answer(&self) -> u64 {
        self.last_answer_ms.load(Ordering::Relaxed)
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

    const WEDGED: u64 = WEDGED_AFTER.as_millis() as u64;
    const TIMEOUT: u64 = COMMAND_TIMEOUT.as_millis() as u64;

    #[test]
    fn only_silence_longer_than_wedged_after_opens_the_connection_again() {
        let watch = Watch::default();
        watch.answered(1_000);
        // Timeouts while the connection answered recently, or only just began failing.
        assert!(!watch.no_answer(1_000 + TIMEOUT));
        assert!(!watch.no_answer(1_000 + WEDGED - 1));
        // An answer in between (another master still answers) starts the count again.
        watch.answered(1_000 + WEDGED);
        assert!(!watch.no_answer(1_000 + WEDGED + TIMEOUT));
        assert!(!watch.no_answer(1_000 + 2 * WEDGED - 1));
        // Nothing but timeouts for WEDGED_AFTER: one caller, and only one, reopens.
        assert!(watch.no_answer(1_000 + 2 * WEDGED));
        assert!(!watch.no_answer(1_000 + 2 * WEDGED + 1));
        assert!(!watch.no_answer(1_000 + 3 * WEDGED));
    }

    #[test]
    fn an_idle_connections_first_timeout_is_not_a_wedge() {
        let watch = Watch::default();
        watch.answered(1_000);
        // Minutes without a call, then one timeout: failing for no time yet.
        let later = 1_000 + 60 * WEDGED;
        assert!(!watch.no_answer(later));
        assert!(!watch.no_answer(later + WEDGED - TIMEOUT - 1));
        assert!(watch.no_answer(later + WEDGED - TIMEOUT));
    }

    #[test]
    fn after_a_reopen_or_a_failed_one_silence_counts_from_then() {
        let watch = Watch::default();
        assert!(!watch.no_answer(0));
        assert!(watch.no_answer(WEDGED));
        // The reopen failed (the whole cluster is down): no new try on the next timeout.
        watch.reopen_done(WEDGED + 10);
        assert!(!watch.no_answer(WEDGED + 20));
        assert!(!watch.no_answer(2 * WEDGED));
        assert!(watch.no_answer(2 * WEDGED + 10));
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
