//! `seckill bench --waiting-room N`: before the opening every buyer joins the sale's
//! waiting room; from the opening the bench follows the tickets until each is let through
//! (polling those whose turn is near), and measures each buyer's time from joining to
//! admission; the storm then buys with the passes. Speaks HTTP only.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::Method;
use hdrhistogram::Histogram;
use serde::Serialize;

use super::client::Connection;

/// The room's figures, beside the storm's.
#[derive(Debug, Clone, Serialize)]
pub struct RoomFigures {
    pub admit_per_sec: i64,
    pub joined: usize,
    pub admitted: usize,
    pub closed: usize,
    /// From the opening to the last admission seen.
    pub seconds: f64,
    pub wait_p50_ms: f64,
    pub wait_p99_ms: f64,
    pub wait_max_ms: f64,
}

/// One answer: the buyer, its status and body, and when it came.
type Answered = (usize, u16, serde_json::Value, Instant);

/// `method path` for each buyer in `buyers`, `workers` connections at a time.
async fn calls(
    addr: SocketAddr,
    method: Method,
    path: Arc<str>,
    tokens: Arc<Vec<String>>,
    buyers: Arc<Vec<usize>>,
    workers: usize,
) -> Vec<Answered> {
    let next = Arc::new(AtomicUsize::new(0));
    let out = Arc::new(Mutex::new(Vec::with_capacity(buyers.len())));
    let tasks: Vec<_> = (0..workers.clamp(1, buyers.len().max(1)))
        .map(|_| {
            let (method, path, tokens, buyers, next, out) = (
                method.clone(),
                path.clone(),
                tokens.clone(),
                buyers.clone(),
                next.clone(),
                out.clone(),
            );
            tokio::spawn(async move {
                let mut conn: Option<Connection> = None;
                while let Some(&buyer) = buyers.get(next.fetch_add(1, Ordering::Relaxed)) {
                    if conn.is_none() {
                        conn = Connection::open(addr).await.ok();
                    }
                    let Some(c) = conn.as_mut() else { continue };
                    match c
                        .send(method.clone(), &path, Some(&tokens[buyer]), Bytes::new())
                        .await
                    {
                        Ok((status, body)) => {
                            let json = serde_json::from_slice(&body).unwrap_or_default();
                            let mut out = out.lock().unwrap_or_else(|p| p.into_inner());
                            out.push((buyer, status, json, Instant::now()));
                        }
                        Err(_) => conn = None,
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    let mut out = out.lock().unwrap_or_else(|p| p.into_inner());
    std::mem::take(&mut *out)
}

/// Every buyer joins; when each did (None: it could not).
pub async fn join_all(
    addr: SocketAddr,
    sale: &str,
    tokens: Arc<Vec<String>>,
    workers: usize,
) -> Vec<Option<Instant>> {
    let buyers = Arc::new((0..tokens.len()).collect::<Vec<_>>());
    let path: Arc<str> = Arc::from(format!("/api/sales/{sale}/queue"));
    let started = Instant::now();
    let mut joined = vec![None; tokens.len()];
    for (buyer, status, _, _) in calls(addr, Method::POST, path, tokens, buyers, workers).await {
        if status == 200 {
            // The moment the join was sent, within the joining's own length.
            joined[buyer] = Some(started);
        }
    }
    joined
}

/// Follows the tickets from the opening until every joined buyer is let through or
/// closed, or `give_up` passes; each buyer's pass (None: none came).
pub async fn follow(
    addr: SocketAddr,
    sale: &str,
    tokens: Arc<Vec<String>>,
    joined: &[Option<Instant>],
    admit_per_sec: i64,
    workers: usize,
    give_up: Duration,
) -> (Vec<Option<String>>, RoomFigures) {
    let path: Arc<str> = Arc::from(format!("/api/sales/{sale}/queue"));
    let started = Instant::now();
    let mut passes = vec![None; tokens.len()];
    let mut place: Vec<Option<u64>> = vec![None; tokens.len()];
    let mut pending: Vec<usize> = (0..tokens.len()).filter(|b| joined[*b].is_some()).collect();
    let joined_count = pending.len();
    let mut waits = Histogram::<u64>::new_with_bounds(1, 3_600_000, 3)
        .unwrap_or_else(|_| unreachable!("constant bounds"));
    let (mut admitted_seen, mut closed, mut last_admission) = (0u64, 0usize, started);
    // Those within half a second of their turn are asked each round.
    let near = (admit_per_sec as u64 / 2).max(1);
    while !pending.is_empty() && started.elapsed() < give_up {
        pending.sort_by_key(|b| place[*b].unwrap_or(0));
        let due: Vec<usize> = pending
            .iter()
            .copied()
            .enumerate()
            .filter(|(i, b)| *i == 0 || place[*b].is_none_or(|p| p <= admitted_seen + near))
            .map(|(_, b)| b)
            .collect();
        let answers = calls(
            addr,
            Method::GET,
            path.clone(),
            tokens.clone(),
            Arc::new(due),
            workers,
        )
        .await;
        let mut done = Vec::new();
        for (buyer, status, t, at) in answers {
            if status != 200 {
                continue;
            }
            admitted_seen = admitted_seen.max(t["admitted"].as_u64().unwrap_or(0));
            place[buyer] = t["position"].as_u64();
            match t["state"].as_str() {
                Some("admitted") => {
                    passes[buyer] = t["pass"].as_str().map(str::to_string);
                    if let Some(j) = joined[buyer] {
                        let _ = waits.record((at - j).as_millis().max(1) as u64);
                    }
                    last_admission = at;
                    done.push(buyer);
                }
                Some("closed") => {
                    closed += 1;
                    done.push(buyer);
                }
                _ => {}
            }
        }
        let done: std::collections::HashSet<usize> = done.into_iter().collect();
        pending.retain(|b| !done.contains(b));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ms = |q: f64| waits.value_at_quantile(q) as f64;
    let figures = RoomFigures {
        admit_per_sec,
        joined: joined_count,
        admitted: waits.len() as usize,
        closed,
        seconds: (last_admission - started).as_secs_f64(),
        wait_p50_ms: ms(0.5),
        wait_p99_ms: ms(0.99),
        wait_max_ms: waits.max() as f64,
    };
    (passes, figures)
}
