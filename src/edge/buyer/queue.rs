//! A sale's waiting room as a buyer sees it: joining the line, and the ticket (place,
//! people ahead, the estimated wait, and the pass once let through). The line itself is
//! `room`'s; this file only words it and signs the pass.

use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;
use serde::Serialize;

use super::super::antibot::issue_pass;
use super::super::auth::AuthUser;
use super::super::http::error::{ApiError, ChangeErrors};
use super::super::http::input::{no_store, rfc3339, PathId, SaleId};
use super::super::AppState;
use crate::gate::{Rejection, Verdict};
use crate::model::Sale;
use crate::room::{Closed, RoomSale, Ticket};

#[derive(Serialize, Debug, Clone, Copy, PartialEq, Eq, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TicketState {
    /// In the line: `position`, `ahead` and `eta_secs` say how long for.
    Waiting,
    /// Let through: `pass` goes in the purchase body until `pass_expires_at`.
    Admitted,
    /// Nobody is let through: `reason` says why.
    Closed,
}

/// Why a ticket is closed: the room's reasons, and a pass that ran out unused.
#[derive(Serialize, Debug, Clone, Copy, PartialEq, Eq, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ClosedReason {
    SoldOut,
    Ended,
    Paused,
    /// This buyer was let through and their pass expired (one admission per buyer).
    PassExpired,
}

impl From<Closed> for ClosedReason {
    fn from(c: Closed) -> Self {
        match c {
            Closed::SoldOut => ClosedReason::SoldOut,
            Closed::Ended => ClosedReason::Ended,
            Closed::Paused => ClosedReason::Paused,
        }
    }
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct TicketView {
    state: TicketState,
    /// Place in the line from 1; null before the opening (those who join before it are
    /// placed by a lottery drawn at the opening).
    position: Option<u64>,
    /// Tickets still to be let through before this one; null before the opening.
    ahead: Option<u64>,
    /// Seconds until this ticket is let through at the room's rate (0 once admitted).
    eta_secs: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pass: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pass_expires_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<ClosedReason>,
    /// Tickets in the room.
    tickets: u64,
    /// Buyers let through so far.
    admitted: u64,
    /// The room's admissions per second.
    admit_per_sec: i64,
    joined_at: String,
}

/// The sale and its room, or the answer that says there is none to join.
async fn room_of(st: &AppState, id: i64) -> Result<(Arc<Sale>, RoomSale), ApiError> {
    let sale = st.approved_sale(id).await?;
    match RoomSale::of(&sale) {
        Some(room) => Ok((sale, room)),
        None => Err(ApiError::Conflict(format!(
            "sale {id} has no waiting room: buy directly"
        ))),
    }
}

#[utoipa::path(
    post,
    path = "/api/sales/{id}/queue",
    tag = "buyer",
    summary = "Join the sale's waiting room (or get the caller's ticket again)",
    description = "One ticket per buyer and sale: calling again, from any device, answers the same ticket. Those who join before the opening are placed by a lottery drawn at it; later joiners queue behind them, first come first served. 409 queue_not_open earlier than prequeue_secs before the opening; 409 ended after the sale.",
    params(SaleId),
    responses((status = 200, description = "The caller's ticket", body = TicketView), ChangeErrors),
    security(("user" = []))
)]
pub async fn join(
    AuthUser(user_id): AuthUser,
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
) -> Result<Response, ApiError> {
    let (sale, room) = room_of(&st, id).await?;
    let now = st.now_ms();
    if let Some(wr) = sale.waiting_room {
        if now < wr.opens_at(sale.begins_at) {
            return Err(ApiError::Rejected {
                code: "queue_not_open",
                message: format!(
                    "the waiting room opens at {} ({} s before the sale)",
                    rfc3339(wr.opens_at(sale.begins_at)),
                    wr.prequeue_secs
                )
                .into(),
            });
        }
    }
    if now >= sale.ends_at {
        return Err(ApiError::from_rejection(
            Rejection::Ended,
            sale.per_user_limit,
        ));
    }
    let ticket = st.rooms.room.join(&room, user_id, now).await?;
    Ok(no_store(view(&st, &sale, user_id, &ticket, now)))
}

#[utoipa::path(
    get,
    path = "/api/sales/{id}/queue",
    tag = "buyer",
    summary = "The caller's ticket in the sale's waiting room",
    description = "404 when the caller never joined. Poll it every few seconds: `state` turns to admitted (with the pass for the purchase) or closed (sold out, ended, paused) by itself.",
    params(SaleId),
    responses((status = 200, description = "The caller's ticket", body = TicketView), ChangeErrors),
    security(("user" = []))
)]
pub async fn ticket(
    AuthUser(user_id): AuthUser,
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
) -> Result<Response, ApiError> {
    let (sale, room) = room_of(&st, id).await?;
    let now = st.now_ms();
    match st.rooms.room.ticket(&room, user_id, now).await? {
        Some(ticket) => Ok(no_store(view(&st, &sale, user_id, &ticket, now))),
        None => Err(ApiError::NotFound(format!(
            "no ticket for sale {id}: POST /api/sales/{id}/queue to join"
        ))),
    }
}

/// Why the room lets nobody through now: what this instance knows at once (the end, a
/// pause, its sold-out flag), else what the room's last advance saw.
fn closed_reason(st: &AppState, sale: &Sale, ticket: &Ticket, now: i64) -> Option<Closed> {
    if now >= sale.ends_at {
        Some(Closed::Ended)
    } else if sale.paused {
        Some(Closed::Paused)
    } else if matches!(st.sold_out.answer(sale.id), Some(Verdict::Rejected(_))) {
        Some(Closed::SoldOut)
    } else {
        ticket.closed
    }
}

fn view(st: &AppState, sale: &Sale, user_id: i64, ticket: &Ticket, now: i64) -> TicketView {
    let rate = sale.waiting_room.map_or(1, |r| r.admit_per_sec).max(1);
    let mut v = TicketView {
        state: TicketState::Waiting,
        position: ticket.rank.map(|r| r + 1),
        ahead: ticket.ahead(),
        eta_secs: None,
        pass: None,
        pass_expires_at: None,
        reason: None,
        tickets: ticket.tickets,
        admitted: ticket.admitted,
        admit_per_sec: rate,
        joined_at: rfc3339(ticket.joined_at),
    };
    if let Some(closed) = closed_reason(st, sale, ticket, now) {
        v.state = TicketState::Closed;
        v.reason = Some(closed.into());
        return v;
    }
    if let Some(admitted_at) = ticket.admitted_at {
        let expires_at = admitted_at + sale.payment_window_secs * 1000;
        if expires_at <= now {
            v.state = TicketState::Closed;
            v.reason = Some(ClosedReason::PassExpired);
            return v;
        }
        v.state = TicketState::Admitted;
        v.ahead = Some(0);
        v.eta_secs = Some(0);
        v.pass = Some(issue_pass(st, sale.id, user_id, expires_at));
        v.pass_expires_at = Some(rfc3339(expires_at));
        return v;
    }
    let until_opening = (sale.begins_at - now).max(0) as u64;
    v.eta_secs = Some(match ticket.ahead() {
        // Let through when the cursor passes it: `ahead + 1` admissions from now.
        Some(ahead) => until_opening.div_ceil(1000) + (ahead + 1).div_ceil(rate as u64),
        None => until_opening.div_ceil(1000),
    });
    v
}
