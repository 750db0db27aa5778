//! The distributed deployment's rooms: one line per sale in Redis (four keys under the
//! sale's hash tag), read and written by one script call each, so that a ticket survives
//! any instance and every instance lets through one shared rate.

use async_trait::async_trait;
use redis::Script;

use super::{lottery_draw, Closed, Room, RoomError, RoomSale, RoomStats, Ticket};
use crate::redis_client::keys::RoomKeys;
use crate::redis_client::RedisConn;

pub struct RedisRoom {
    conn: RedisConn,
    prefix: String,
    ticket: Script,
    advance: Script,
}

/// Room keys outlive their sale by a day: the ended room answers `closed` meanwhile.
const KEYS_OUTLIVE_SALE_MS: i64 = 86_400_000;

impl RedisRoom {
    pub fn new(conn: RedisConn, prefix: &str) -> Self {
        RedisRoom {
            conn,
            prefix: prefix.to_string(),
            ticket: Script::new(include_str!("ticket.lua")),
            advance: Script::new(include_str!("advance.lua")),
        }
    }

    /// Loads the scripts once at start-up; calls then go by EVALSHA.
    pub async fn prepare(&self) -> Result<(), RoomError> {
        let mut conn = self.conn.clone();
        for script in [&self.ticket, &self.advance] {
            script.prepare_invoke().load_async(&mut conn).await?;
        }
        Ok(())
    }

    async fn call_ticket(
        &self,
        sale: &RoomSale,
        user: i64,
        now: i64,
        join: bool,
    ) -> Result<Option<Ticket>, RoomError> {
        let k = RoomKeys::new(&self.prefix, sale.id);
        let mut call = self.ticket.prepare_invoke();
        for key in k.all() {
            call.key(key);
        }
        call.arg(user)
            .arg(now)
            .arg(sale.begins_at)
            .arg(lottery_draw())
            .arg(if join { "1" } else { "0" });
        let reply: Option<(u64, i64, String, u64, u64, String)> =
            call.invoke_async(&mut self.conn.clone()).await?;
        Ok(reply.map(
            |(rank, joined_at, admitted_at, admitted, tickets, closed)| Ticket {
                rank: (now >= sale.begins_at).then_some(rank),
                joined_at,
                admitted_at: admitted_at.parse().ok(),
                admitted,
                tickets,
                closed: Closed::parse(&closed),
            },
        ))
    }
}

#[async_trait]
impl Room for RedisRoom {
    async fn join(&self, sale: &RoomSale, user: i64, now: i64) -> Result<Ticket, RoomError> {
        self.call_ticket(sale, user, now, true)
            .await?
            .ok_or_else(|| RoomError::BadReply("no ticket after joining".into()))
    }

    async fn ticket(
        &self,
        sale: &RoomSale,
        user: i64,
        now: i64,
    ) -> Result<Option<Ticket>, RoomError> {
        self.call_ticket(sale, user, now, false).await
    }

    async fn advance(
        &self,
        sale: &RoomSale,
        now: i64,
        closed: Option<Closed>,
    ) -> Result<RoomStats, RoomError> {
        let k = RoomKeys::new(&self.prefix, sale.id);
        let mut call = self.advance.prepare_invoke();
        for key in k.all() {
            call.key(key);
        }
        call.arg(now)
            .arg(sale.begins_at)
            .arg(sale.admit_per_sec)
            .arg(closed.map(Closed::as_str).unwrap_or(""))
            .arg(sale.ends_at.saturating_add(KEYS_OUTLIVE_SALE_MS));
        let (admitted, tickets, head_joined_at, closed): (u64, u64, String, String) =
            call.invoke_async(&mut self.conn.clone()).await?;
        Ok(RoomStats {
            tickets,
            admitted,
            head_joined_at: head_joined_at.parse().ok(),
            closed: Closed::parse(&closed),
        })
    }

    async fn forget(&self, _sale_id: i64) -> Result<(), RoomError> {
        // The keys expire by themselves a day after the sale (set by every advance).
        Ok(())
    }
}
