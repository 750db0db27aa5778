//! The two load models. Closed: C connections, each sending its next request as soon as
//! the previous answer arrives. Open: requests scheduled at a fixed rate, each latency
//! measured from its intended send time, so a server that stalls cannot hide the stall
//! by slowing the load down (no coordinated omission).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use axum::http::Method;

use super::client::Connection;

#[derive(Debug, Clone, Copy)]
pub enum Model {
    Closed { connections: usize },
    Open { rate: f64, connections: usize },
}

/// Everything one storm observed.
pub struct Observed {
    /// Latencies in microseconds.
    pub latency: Histogram<u64>,
    pub by_code: HashMap<String, u64>,
    pub errors: u64,
    /// (user token index, order id) of every `ok`.
    pub ok_orders: Vec<(usize, String)>,
    pub elapsed: Duration,
    pub sent: usize,
}

struct Shared {
    latency: Histogram<u64>,
    by_code: HashMap<String, u64>,
    errors: u64,
    ok_orders: Vec<(usize, String)>,
}

/// Workers record into one of this many shards, so that they rarely wait on each other's
/// lock (one histogram per worker would cost 256 KiB each).
const SHARDS: usize = 16;

impl Shared {
    fn new() -> Shared {
        Shared {
            latency: Histogram::new_with_bounds(1, 60_000_000, 3)
                .unwrap_or_else(|_| unreachable!("constant bounds")),
            by_code: HashMap::new(),
            errors: 0,
            ok_orders: Vec::new(),
        }
    }

    fn count(&mut self, code: &str) {
        let code = if code.is_empty() { "<no code>" } else { code };
        match self.by_code.get_mut(code) {
            Some(n) => *n += 1,
            None => {
                self.by_code.insert(code.to_string(), 1);
            }
        }
    }

    fn merge(&mut self, other: Shared) {
        let _ = self.latency.add(&other.latency);
        for (code, n) in other.by_code {
            *self.by_code.entry(code).or_default() += n;
        }
        self.errors += other.errors;
        self.ok_orders.extend(other.ok_orders);
    }
}

/// What one answer was, reduced to what the storm keeps.
enum Outcome {
    Answered,
    Failed,
}

/// What each request of a storm is.
#[derive(Clone)]
pub enum Shot {
    /// A purchase of the sale by the buyer whose token is `tokens[i]`.
    Purchase {
        sale: Arc<str>,
        tokens: Arc<Vec<String>>,
        /// Fetch a purchase token before each purchase.
        anti_bot: bool,
        /// Each buyer's waiting room pass, when the sale has a room.
        passes: Option<Arc<Vec<String>>>,
    },
    /// A plain GET, for the baseline of a server answering a fixed page.
    Get { path: Arc<str> },
}

/// `requests` are indices into the shot's tokens (ignored for `Get`).
pub async fn run(
    addr: SocketAddr,
    shot: Shot,
    requests: Arc<Vec<usize>>,
    model: Model,
    progress: Arc<AtomicUsize>,
) -> Observed {
    let shards: Arc<Vec<Mutex<Shared>>> =
        Arc::new((0..SHARDS).map(|_| Mutex::new(Shared::new())).collect());
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let (connections, interval) = match model {
        Model::Closed { connections } => (connections, None),
        Model::Open { rate, connections } => (
            connections,
            Some(Duration::from_secs_f64(1.0 / rate.max(1.0))),
        ),
    };
    let workers: Vec<_> = (0..connections.max(1))
        .map(|w| {
            let (shot, requests, shards, next, progress) = (
                shot.clone(),
                requests.clone(),
                shards.clone(),
                next.clone(),
                progress.clone(),
            );
            tokio::spawn(async move {
                let mut conn: Option<Connection> = None;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&buyer) = requests.get(i) else { break };
                    // Open model: this request's moment is fixed in advance; a late worker
                    // counts the wait it caused as latency.
                    let intended = match interval {
                        Some(step) => {
                            let at = started + step * i as u32;
                            tokio::time::sleep_until(at.into()).await;
                            at
                        }
                        None => Instant::now(),
                    };
                    let shard = &shards[w % SHARDS];
                    send(&mut conn, addr, &shot, buyer, intended, shard).await;
                    progress.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.await;
    }
    let elapsed = started.elapsed();
    let mut shared = Shared::new();
    for shard in shards.iter() {
        let shard = std::mem::replace(
            &mut *shard.lock().unwrap_or_else(|p| p.into_inner()),
            Shared::new(),
        );
        shared.merge(shard);
    }
    Observed {
        latency: shared.latency,
        by_code: shared.by_code,
        errors: shared.errors,
        ok_orders: shared.ok_orders,
        elapsed,
        sent: requests.len(),
    }
}

/// One request on the worker's connection, recorded in `shard` with its latency from
/// `intended`. A failed request is counted as an error, not retried (a retry could buy
/// twice); the next request opens a new connection.
async fn send(
    conn: &mut Option<Connection>,
    addr: SocketAddr,
    shot: &Shot,
    buyer: usize,
    intended: Instant,
    shard: &Mutex<Shared>,
) {
    let record = |code: &str, order_id: Option<&str>| {
        let micros = intended.elapsed().as_micros() as u64;
        let mut s = shard.lock().unwrap_or_else(|p| p.into_inner());
        let _ = s.latency.record(micros.max(1));
        if code == "ok" {
            if let Some(id) = order_id {
                s.ok_orders.push((buyer, id.to_string()));
            }
        }
        s.count(code);
        Outcome::Answered
    };
    let outcome = match open(conn, addr).await {
        None => Outcome::Failed,
        Some(c) => match shot {
            Shot::Purchase {
                sale,
                tokens,
                anti_bot,
                passes,
            } => c
                .purchase(
                    sale,
                    &tokens[buyer],
                    *anti_bot,
                    passes.as_ref().map(|p| p[buyer].as_str()),
                    |_, a| record(a.code, a.order_id),
                )
                .await
                .unwrap_or(Outcome::Failed),
            Shot::Get { path } => match c
                .send(Method::GET, path, None, axum::body::Bytes::new())
                .await
            {
                Ok((status, _)) => record(&status.to_string(), None),
                Err(_) => Outcome::Failed,
            },
        },
    };
    if let Outcome::Failed = outcome {
        *conn = None;
        let micros = intended.elapsed().as_micros() as u64;
        let mut s = shard.lock().unwrap_or_else(|p| p.into_inner());
        let _ = s.latency.record(micros.max(1));
        s.errors += 1;
    }
}

async fn open(conn: &mut Option<Connection>, addr: SocketAddr) -> Option<&mut Connection> {
    if conn.is_none() {
        *conn = Some(Connection::open(addr).await.ok()?);
    }
    conn.as_mut()
}
