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

impl Shared {
    fn record(
        &mut self,
        micros: u64,
        answer: Result<(u16, super::client::Answer), ()>,
        buyer: usize,
    ) {
        let _ = self.latency.record(micros.max(1));
        match answer {
            Ok((_, a)) => {
                if a.code == "ok" {
                    if let Some(id) = a.order_id.clone() {
                        self.ok_orders.push((buyer, id));
                    }
                }
                let code = if a.code.is_empty() {
                    "<no code>".to_string()
                } else {
                    a.code
                };
                *self.by_code.entry(code).or_default() += 1;
            }
            Err(()) => self.errors += 1,
        }
    }
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
    let histogram = Histogram::new_with_bounds(1, 60_000_000, 3).unwrap_or_else(|_| unreachable!());
    let shared = Arc::new(Mutex::new(Shared {
        latency: histogram,
        by_code: HashMap::new(),
        errors: 0,
        ok_orders: Vec::new(),
    }));
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
        .map(|_| {
            let (shot, requests, shared, next, progress) = (
                shot.clone(),
                requests.clone(),
                shared.clone(),
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
                    let answer = send(&mut conn, addr, &shot, buyer).await;
                    let micros = intended.elapsed().as_micros() as u64;
                    shared
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .record(micros, answer, buyer);
                    progress.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.await;
    }
    let elapsed = started.elapsed();
    let shared = Arc::try_unwrap(shared)
        .ok()
        .map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner()))
        .unwrap_or_else(|| unreachable!("every worker has finished"));
    Observed {
        latency: shared.latency,
        by_code: shared.by_code,
        errors: shared.errors,
        ok_orders: shared.ok_orders,
        elapsed,
        sent: requests.len(),
    }
}

/// One purchase on the worker's connection. A failed request is counted as an error, not
/// retried (a retry could buy twice); the next request opens a new connection.
async fn send(
    conn: &mut Option<Connection>,
    addr: SocketAddr,
    shot: &Shot,
    buyer: usize,
) -> Result<(u16, super::client::Answer), ()> {
    if conn.is_none() {
        *conn = Some(Connection::open(addr).await.map_err(|_| ())?);
    }
    let Some(c) = conn.as_mut() else {
        return Err(());
    };
    let answer = match shot {
        Shot::Purchase {
            sale,
            tokens,
            anti_bot,
        } => c.purchase(sale, &tokens[buyer], *anti_bot).await,
        Shot::Get { path } => c
            .send(hyper::Method::GET, path, None, axum::body::Bytes::new())
            .await
            .map(|(status, _)| {
                let answer = super::client::Answer {
                    code: status.to_string(),
                    order_id: None,
                };
                (status, answer)
            }),
    };
    match answer {
        Ok(answer) => Ok(answer),
        Err(_) => {
            *conn = None;
            Err(())
        }
    }
}
