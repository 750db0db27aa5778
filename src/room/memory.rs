//! The embedded deployment's rooms: one line per sale in this process's memory. Lost with
//! the process (as the embedded gate's own state is rebuilt from SQL, a room is not: its
//! buyers join again and keep nothing they had; see docs/guides/selling.md).

use std::collections::HashMap;
use std::sync::Mutex;

use async_trait::async_trait;

use super::{lottery_draw, Closed, Room, RoomError, RoomSale, RoomStats, Ticket};

#[derive(Default)]
pub struct MemoryRoom {
    lines: Mutex<HashMap<i64, Line>>,
}

impl MemoryRoom {
    pub fn new() -> Self {
        Self::default()
    }

    fn with_line<T>(&self, sale: &RoomSale, now: i64, f: impl FnOnce(&mut Line) -> T) -> T {
        let mut lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        let line = lines.entry(sale.id).or_default();
        line.draw_if_due(sale.begins_at, now);
        f(line)
    }
}

#[derive(Default)]
struct Line {
    tickets: HashMap<i64, Entry>,
    /// (draw, buyer) of those who joined before the opening, until the draw.
    lottery: Vec<(u64, i64)>,
    drawn: bool,
    /// Buyers by place, once drawn.
    order: Vec<i64>,
    cursor: f64,
    last_ms: Option<i64>,
    closed: Option<Closed>,
}

struct Entry {
    rank: Option<u64>,
    joined_at: i64,
    admitted_at: Option<i64>,
}

impl Line {
    /// At the opening, the lottery's order becomes the head of the line.
    fn draw_if_due(&mut self, begins_at: i64, now: i64) {
        if self.drawn || now < begins_at {
            return;
        }
        self.lottery.sort_unstable();
        for (_, user) in std::mem::take(&mut self.lottery) {
            self.place(user);
        }
        self.drawn = true;
    }

    fn place(&mut self, user: i64) {
        let rank = self.order.len() as u64;
        self.order.push(user);
        if let Some(e) = self.tickets.get_mut(&user) {
            e.rank = Some(rank);
        }
    }

    fn admitted(&self) -> u64 {
        self.cursor as u64
    }

    fn view(&mut self, user: i64, now: i64) -> Option<Ticket> {
        let admitted = self.admitted();
        let tickets = self.tickets.len() as u64;
        let closed = self.closed;
        let e = self.tickets.get_mut(&user)?;
        if e.admitted_at.is_none() && e.rank.is_some_and(|r| r < admitted) {
            e.admitted_at = Some(now);
        }
        Some(Ticket {
            rank: e.rank,
            joined_at: e.joined_at,
            admitted_at: e.admitted_at,
            admitted,
            tickets,
            closed,
        })
    }

    fn stats(&self) -> RoomStats {
        let admitted = self.admitted();
        let head = self.order.get(admitted as usize);
        RoomStats {
            tickets: self.tickets.len() as u64,
            admitted,
            head_joined_at: head.and_then(|u| self.tickets.get(u)).map(|e| e.joined_at),
            closed: self.closed,
        }
    }
}

#[async_trait]
impl Room for MemoryRoom {
    async fn join(&self, sale: &RoomSale, user: i64, now: i64) -> Result<Ticket, RoomError> {
        self.with_line(sale, now, |line| {
            if let std::collections::hash_map::Entry::Vacant(slot) = line.tickets.entry(user) {
                slot.insert(Entry {
                    rank: None,
                    joined_at: now,
                    admitted_at: None,
                });
                if line.drawn {
                    line.place(user);
                } else {
                    line.lottery.push((lottery_draw(), user));
                }
            }
            line.view(user, now)
                .ok_or_else(|| RoomError::BadReply("a ticket just placed is missing".into()))
        })
    }

    async fn ticket(
        &self,
        sale: &RoomSale,
        user: i64,
        now: i64,
    ) -> Result<Option<Ticket>, RoomError> {
        Ok(self.with_line(sale, now, |line| line.view(user, now)))
    }

    async fn advance(
        &self,
        sale: &RoomSale,
        now: i64,
        closed: Option<Closed>,
    ) -> Result<RoomStats, RoomError> {
        Ok(self.with_line(sale, now, |line| {
            let from = line.last_ms.unwrap_or(sale.begins_at).max(sale.begins_at);
            if now > from {
                if closed.is_none() {
                    let moved = sale.admit_per_sec as f64 * (now - from) as f64 / 1000.0;
                    line.cursor = (line.cursor + moved).min(line.order.len() as f64);
                }
                line.last_ms = Some(now);
            }
            line.closed = closed;
            line.stats()
        }))
    }

    async fn forget(&self, sale_id: i64) -> Result<(), RoomError> {
        self.lines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&sale_id);
        Ok(())
    }
}
