//! The waiting room in front of a hot sale: buyers join a line before or after the opening
//! and are let through `admit_per_sec` a second; only a buyer let through gets the pass the
//! purchase asks for (signed by the edge). Those who joined before the opening are placed
//! by a lottery drawn at the opening, those after it first come first served.
//!
//! This module owns the line (tickets, places, who was let through, the admission cursor)
//! in memory (embedded) or in Redis under the sale's hash tag (distributed: every instance
//! shares one line and one rate). The cursor moves by elapsed time inside one atomic call,
//! so any number of instances advancing it let through exactly the rate. It never decides
//! a purchase, never signs a pass, and never reads SQL.

pub mod memory;
pub mod redis;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;
use tokio::sync::watch;

use crate::gate::Gate;
use crate::loader::SaleCache;
use crate::model::Sale;

/// How often each instance moves the cursor and looks whether the sale is still open: a
/// ticket hears `closed` at most this long after the sale sold out (plus its own poll).
pub const ADVANCE_EVERY: Duration = Duration::from_millis(250);
/// A room is kept this long after its sale ended (its buyers read `closed: ended`), then
/// dropped.
pub const KEEP_AFTER_END_MS: i64 = 3_600_000;
/// Places before the opening are drawn from `[0, 2^52)`; places after it come above.
pub const LOTTERY_SPAN: u64 = 1 << 52;

#[derive(Debug, thiserror::Error)]
pub enum RoomError {
    #[error("redis: {0}")]
    Redis(#[from] ::redis::RedisError),
    #[error("unexpected answer from the room script: {0}")]
    BadReply(String),
}

/// Why a room lets nobody through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Closed {
    SoldOut,
    Ended,
    Paused,
}

impl Closed {
    pub fn as_str(self) -> &'static str {
        match self {
            Closed::SoldOut => "sold_out",
            Closed::Ended => "ended",
            Closed::Paused => "paused",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "sold_out" => Closed::SoldOut,
            "ended" => Closed::Ended,
            "paused" => Closed::Paused,
            _ => return None,
        })
    }
}

/// What a room needs of its sale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoomSale {
    pub id: i64,
    pub begins_at: i64,
    pub ends_at: i64,
    pub admit_per_sec: i64,
}

impl RoomSale {
    pub fn of(sale: &Sale) -> Option<Self> {
        sale.waiting_room.map(|r| RoomSale {
            id: sale.id,
            begins_at: sale.begins_at,
            ends_at: sale.ends_at,
            admit_per_sec: r.admit_per_sec,
        })
    }
}

/// One buyer's ticket, and the room around it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    /// Place in the line, from 0; `None` before the opening (the lottery is not drawn).
    pub rank: Option<u64>,
    pub joined_at: i64,
    /// When the cursor passed this ticket (first seen let through); never taken back.
    pub admitted_at: Option<i64>,
    /// Buyers let through so far.
    pub admitted: u64,
    /// Tickets in the room.
    pub tickets: u64,
    /// Set by the last advance when the sale was not open.
    pub closed: Option<Closed>,
}

impl Ticket {
    /// Tickets still to be let through before this one.
    pub fn ahead(&self) -> Option<u64> {
        self.rank.map(|r| r.saturating_sub(self.admitted))
    }
}

/// A room as an advance leaves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RoomStats {
    pub tickets: u64,
    pub admitted: u64,
    /// When the ticket next in line joined (`None`: nobody waits).
    pub head_joined_at: Option<i64>,
    pub closed: Option<Closed>,
}

impl RoomStats {
    pub fn waiting(&self) -> u64 {
        self.tickets.saturating_sub(self.admitted)
    }
}

#[async_trait]
pub trait Room: Send + Sync {
    /// Joins the line, or answers the buyer's ticket again (one ticket per buyer and sale).
    async fn join(&self, sale: &RoomSale, user: i64, now: i64) -> Result<Ticket, RoomError>;

    /// The buyer's ticket, `None` when they never joined.
    async fn ticket(
        &self,
        sale: &RoomSale,
        user: i64,
        now: i64,
    ) -> Result<Option<Ticket>, RoomError>;

    /// Moves the cursor by the time since the last advance (from the opening) at the
    /// sale's rate, unless the room is `closed`, never past the last ticket; records
    /// `closed`. Safe to call from every instance at once.
    async fn advance(
        &self,
        sale: &RoomSale,
        now: i64,
        closed: Option<Closed>,
    ) -> Result<RoomStats, RoomError>;

    /// Drops a room whose sale is long over.
    async fn forget(&self, sale_id: i64) -> Result<(), RoomError>;
}

/// A draw for the lottery: uniform in `[0, LOTTERY_SPAN)`, unrelated to when one joins.
pub fn lottery_draw() -> u64 {
    rand::random::<u64>() % LOTTERY_SPAN
}

/// The rooms of this process's sales, and what their last advance saw (for the admin page
/// and `/metrics`).
pub struct Rooms {
    pub room: Arc<dyn Room>,
    seen: Mutex<HashMap<i64, Seen>>,
}

/// What the last advance of a room saw, and the sample its measured rate is taken from.
#[derive(Debug, Clone, Copy)]
struct Seen {
    stats: RoomStats,
    at: i64,
    admit_per_sec: i64,
    /// (when, admitted) at least `RATE_WINDOW_MS` before the last advance.
    sample: (i64, u64),
    admitted_per_sec: f64,
}

/// The measured admission rate is taken over at least this long.
const RATE_WINDOW_MS: i64 = 5_000;

/// One room as the admin page and `/metrics` show it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoomReport {
    pub sale_id: i64,
    pub stats: RoomStats,
    /// The sale's setting.
    pub admit_per_sec: i64,
    /// Measured over the last seconds.
    pub admitted_per_sec: f64,
    /// How long the ticket next in line has waited (0 when nobody waits).
    pub oldest_wait_ms: i64,
}

impl Rooms {
    pub fn new(room: Arc<dyn Room>) -> Self {
        Rooms {
            room,
            seen: Mutex::new(HashMap::new()),
        }
    }

    /// What the last advance of each room saw, by sale.
    pub fn reports(&self) -> Vec<RoomReport> {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let mut reports: Vec<RoomReport> = seen
            .iter()
            .map(|(sale_id, s)| RoomReport {
                sale_id: *sale_id,
                stats: s.stats,
                admit_per_sec: s.admit_per_sec,
                admitted_per_sec: s.admitted_per_sec,
                oldest_wait_ms: s
                    .stats
                    .head_joined_at
                    .filter(|_| s.stats.waiting() > 0)
                    .map_or(0, |joined| (s.at - joined).max(0)),
            })
            .collect();
        reports.sort_by_key(|r| r.sale_id);
        reports
    }

    /// The rooms' series in Prometheus text.
    pub fn render(&self, out: &mut String) {
        let reports = self.reports();
        if reports.is_empty() {
            return;
        }
        type Figure = fn(&RoomReport) -> String;
        let series: [(&str, &str, &str, Figure); 5] = [
            (
                "seckill_room_tickets",
                "gauge",
                "Tickets in the sale's waiting room.",
                |r| r.stats.tickets.to_string(),
            ),
            (
                "seckill_room_waiting",
                "gauge",
                "Tickets not yet let through.",
                |r| r.stats.waiting().to_string(),
            ),
            (
                "seckill_room_admitted_total",
                "counter",
                "Buyers let through the waiting room.",
                |r| r.stats.admitted.to_string(),
            ),
            (
                "seckill_room_admit_per_sec",
                "gauge",
                "The sale's admissions per second (its setting).",
                |r| r.admit_per_sec.to_string(),
            ),
            (
                "seckill_room_oldest_wait_seconds",
                "gauge",
                "How long the ticket next in line has waited.",
                |r| format!("{:.3}", r.oldest_wait_ms as f64 / 1000.0),
            ),
        ];
        for (name, kind, help, figure) in series {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
            for r in &reports {
                out.push_str(&format!("{name}{{sale=\"{}\"}} {}\n", r.sale_id, figure(r)));
            }
        }
    }

    /// One advance of every room whose sale takes buyers in now.
    pub async fn advance_all(&self, cache: &SaleCache, gate: &dyn Gate, now: i64) {
        let mut advanced = Vec::new();
        for sale in cache.all().iter() {
            let (Some(room), Some(wr)) = (RoomSale::of(sale), sale.waiting_room) else {
                continue;
            };
            if now < wr.opens_at(sale.begins_at) {
                continue;
            }
            if now >= sale.ends_at + KEEP_AFTER_END_MS {
                if let Err(e) = self.room.forget(sale.id).await {
                    tracing::debug!(sale = sale.id, error = %e, "a finished room was not dropped");
                }
                continue;
            }
            let closed = closed_now(sale, gate, now).await;
            match self.room.advance(&room, now, closed).await {
                Ok(stats) => advanced.push((sale.id, wr.admit_per_sec, stats)),
                Err(e) => tracing::debug!(sale = sale.id, error = %e, "a room did not advance"),
            }
        }
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let before = std::mem::take(&mut *seen);
        for (sale_id, admit_per_sec, stats) in advanced {
            let (mut sample, mut admitted_per_sec) = ((now, stats.admitted), 0.0);
            if let Some(b) = before.get(&sale_id) {
                (sample, admitted_per_sec) = (b.sample, b.admitted_per_sec);
                if now - sample.0 >= RATE_WINDOW_MS {
                    admitted_per_sec = stats.admitted.saturating_sub(sample.1) as f64 * 1000.0
                        / (now - sample.0) as f64;
                    sample = (now, stats.admitted);
                }
            }
            seen.insert(
                sale_id,
                Seen {
                    stats,
                    at: now,
                    admit_per_sec,
                    sample,
                    admitted_per_sec,
                },
            );
        }
    }

    /// Advances every room every [`ADVANCE_EVERY`] until `stop`.
    pub async fn run(
        self: Arc<Self>,
        cache: Arc<SaleCache>,
        gate: Arc<dyn Gate>,
        clock: crate::clock::SharedClock,
        mut stop: watch::Receiver<bool>,
    ) {
        loop {
            self.advance_all(&cache, gate.as_ref(), clock.now_ms())
                .await;
            tokio::select! {
                _ = tokio::time::sleep(ADVANCE_EVERY) => {}
                _ = stop.changed() => {}
            }
            if crate::stop::requested(&mut stop) {
                break;
            }
        }
    }
}

/// Whether the sale takes no buyers now, and why: the gate says whether it is paused or
/// sold out (stock that comes back reopens the room); a gate that cannot tell leaves the
/// room as it was (open).
async fn closed_now(sale: &Sale, gate: &dyn Gate, now: i64) -> Option<Closed> {
    if now >= sale.ends_at {
        return Some(Closed::Ended);
    }
    let (remaining, paused) = match gate.stock(sale.id).await {
        Ok(Some(g)) => (g.remaining, g.paused),
        _ => (sale.stock, sale.paused),
    };
    if paused {
        Some(Closed::Paused)
    } else if remaining <= 0 && now >= sale.begins_at {
        Some(Closed::SoldOut)
    } else {
        None
    }
}
