//! The public catalogue: approved sales (cacheable, from the instance's sale cache), a
//! sale's live stock from the gate, and the server's clock for the pages' countdowns.

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde::Serialize;

use super::super::http::error::{ApiError, ErrorResponse};
use super::super::http::input::{cacheable, no_store, rfc3339, PathId, SaleId};
use super::super::AppState;
use crate::model::{Sale, SaleState};

#[derive(Serialize, utoipa::ToSchema)]
pub struct SaleView {
    id: String,
    title: String,
    price_cents: i64,
    stock: i64,
    per_user_limit: i64,
    begins_at: String,
    ends_at: String,
    payment_window_secs: i64,
    /// `off`, `token` or `captcha`: what a buyer must fetch before purchasing.
    anti_bot: crate::model::AntiBot,
    /// Parts the stock is kept in (each on its own Redis master in a cluster).
    segments: i64,
    /// The sale's waiting room, when it has one: buyers join `POST /api/sales/{id}/queue`
    /// and buy with the pass it gives them.
    #[serde(skip_serializing_if = "Option::is_none")]
    waiting_room: Option<crate::model::WaitingRoom>,
}

impl From<&Sale> for SaleView {
    fn from(s: &Sale) -> Self {
        SaleView {
            id: s.id.to_string(),
            title: s.title.clone(),
            price_cents: s.price_cents,
            stock: s.initial_stock,
            per_user_limit: s.per_user_limit,
            begins_at: rfc3339(s.begins_at),
            ends_at: rfc3339(s.ends_at),
            payment_window_secs: s.payment_window_secs,
            anti_bot: s.anti_bot,
            segments: s.segments,
            waiting_room: s.waiting_room,
        }
    }
}

#[utoipa::path(
    get,
    path = "/api/sales",
    tag = "buyer",
    summary = "Approved sales that have not ended (ETag, Cache-Control)",
    responses((status = 200, description = "The catalogue", body = Vec<SaleView>), (status = 304, description = "The client holds it (If-None-Match)"))
)]
pub async fn list_sales(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let now = st.now_ms();
    let views: Vec<SaleView> = st
        .sales
        .all()
        .iter()
        .filter(|s| s.ends_at > now)
        .map(|s| SaleView::from(s.as_ref()))
        .collect();
    cacheable(&headers, &views)
}

#[utoipa::path(
    get,
    path = "/api/sales/{id}",
    tag = "buyer",
    summary = "One approved sale (ETag, Cache-Control)",
    params(SaleId),
    responses((status = 200, description = "The sale", body = SaleView), (status = 304, description = "The client holds it (If-None-Match)"), (status = 400, response = ErrorResponse), (status = 404, response = ErrorResponse), (status = 429, response = ErrorResponse), (status = 503, response = ErrorResponse))
)]
pub async fn get_sale(
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let sale = st.approved_sale(id).await?;
    Ok(cacheable(&headers, &SaleView::from(sale.as_ref())))
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct StockView {
    state: SaleState,
    remaining: i64,
}

#[utoipa::path(
    get,
    path = "/api/sales/{id}/stock",
    tag = "buyer",
    summary = "Live state and remaining stock",
    params(SaleId),
    responses((status = 200, description = "From the gate, never cached", body = StockView), (status = 400, response = ErrorResponse), (status = 404, response = ErrorResponse), (status = 429, response = ErrorResponse), (status = 503, response = ErrorResponse))
)]
pub async fn get_stock(
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
) -> Result<Response, ApiError> {
    let sale = st.approved_sale(id).await?;
    let (remaining, paused) = match st.gate.stock(sale.id).await? {
        Some(g) => (g.remaining, g.paused),
        None => (sale.stock, sale.paused),
    };
    let mut paused_sale = (*sale).clone();
    paused_sale.paused = paused;
    let view = StockView {
        state: paused_sale.state_at(st.now_ms(), remaining),
        remaining,
    };
    Ok(no_store(view))
}

#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct ServerTime {
    now: String,
    now_ms: i64,
}

/// `GET /api/time`: the server's clock, so that pages count down to an opening by the
/// clock that decides it, not by the visitor's.
#[utoipa::path(
    get,
    path = "/api/time",
    tag = "buyer",
    summary = "The server's clock (pages count down to an opening by it)",
    responses((status = 200, description = "Never cached", body = ServerTime), (status = 429, response = ErrorResponse))
)]
pub async fn server_time(State(st): State<Arc<AppState>>) -> Response {
    let now = st.now_ms();
    no_store(ServerTime {
        now: rfc3339(now),
        now_ms: now,
    })
}
