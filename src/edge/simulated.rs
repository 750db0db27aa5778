//! The simulated payment provider's endpoints: its pay page's calls (the buyer's own
//! intent; pay, fail or pay late) and the admin's call that has it call back. They answer
//! 404 unless it is the configured provider (dev mode, or `--payment-provider simulated`):
//! through them anyone may mark their own order paid.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};

use super::auth::{Admin, AuthUser};
use super::http::error::{ApiError, ChangeErrors, ReadErrors};
use super::http::input::{no_store, parse_id, parse_json, rfc3339, IntentId, PathId};
use super::AppState;
use crate::lifecycle::payment::{Notification, NotifiedStatus, SimulatedProvider};
use crate::model::OrderStatus;
use crate::store::Payment;

/// The simulated provider, or 404 when it is not the one configured.
fn simulator(st: &AppState) -> Result<&SimulatedProvider, ApiError> {
    st.simulator.as_ref().ok_or_else(|| {
        ApiError::NotFound(
            "the simulated payment provider is off (dev mode, or --payment-provider simulated)"
                .into(),
        )
    })
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SimulateRequest {
    outcome: SimulatedOutcome,
}

#[derive(Deserialize, Clone, Copy, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SimulatedOutcome {
    Pay,
    Fail,
    /// Pays one second after the order's payment deadline.
    PayLate,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct Scheduled {
    intent_id: String,
    deliver_at: String,
}

/// Tells the simulated provider to call back for an intent: now, or after the deadline.
#[utoipa::path(
    post,
    path = "/api/admin/payments/{id}/simulate",
    tag = "admin",
    summary = "Make the simulated provider call back",
    description = "Only when the simulated provider is configured (dev mode, or --payment-provider simulated); 404 otherwise.",
    params(IntentId),
    request_body = SimulateRequest,
    responses((status = 202, description = "The callback is scheduled", body = Scheduled), ReadErrors),
    security(("admin" = []))
)]
pub async fn simulate(
    _: Admin,
    State(st): State<Arc<AppState>>,
    PathId(intent_id, _): IntentId,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<Scheduled>), ApiError> {
    simulator(&st)?;
    let req: SimulateRequest = parse_json(&body)?;
    let payment = st
        .store
        .payment(intent_id)
        .await?
        .ok_or_else(|| no_such_intent(intent_id))?;
    schedule_callback(&st, &payment, req.outcome).await
}

fn no_such_intent(intent_id: i64) -> ApiError {
    ApiError::NotFound(format!("payment intent {intent_id} does not exist"))
}

/// The buyer's own intent; another buyer's is answered as missing, never shown.
async fn own_intent(st: &AppState, user_id: i64, id: &str) -> Result<Payment, ApiError> {
    let intent_id = parse_id(id, "intent id")?;
    match st.store.payment(intent_id).await? {
        Some(p) if p.user_id == user_id => Ok(p),
        _ => Err(no_such_intent(intent_id)),
    }
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct SimulatedIntent {
    intent_id: String,
    order_id: String,
    amount_cents: i64,
    /// `created` until the provider called back: then `paid`, `failed` or `refund_due`.
    status: String,
    order_status: OrderStatus,
    pay_deadline: String,
}

/// `GET /api/simulated-pay/{id}`: what the simulated provider's pay page shows the buyer.
#[utoipa::path(
    get,
    path = "/api/simulated-pay/{id}",
    tag = "buyer",
    summary = "The buyer's payment intent, as the simulated provider's pay page shows it",
    description = "Only when the simulated provider is configured (dev mode, or --payment-provider simulated); 404 otherwise.",
    params(IntentId),
    responses((status = 200, description = "The intent and its order", body = SimulatedIntent), ReadErrors),
    security(("user" = []))
)]
pub async fn simulated_intent(
    AuthUser(user_id): AuthUser,
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<axum::response::Response, ApiError> {
    simulator(&st)?;
    let payment = own_intent(&st, user_id, &id).await?;
    let order = st
        .store
        .order(payment.order_id)
        .await?
        .ok_or_else(|| no_such_intent(payment.intent_id))?;
    Ok(no_store(SimulatedIntent {
        intent_id: payment.intent_id.to_string(),
        order_id: payment.order_id.to_string(),
        amount_cents: payment.amount_cents,
        status: payment.status,
        order_status: order.status,
        pay_deadline: rfc3339(order.pay_deadline),
    }))
}

/// `POST /api/simulated-pay/{id}`: the buyer, on the simulated provider's pay page, pays
/// (or fails to, or pays too late); the provider then calls back as a real one would.
#[utoipa::path(
    post,
    path = "/api/simulated-pay/{id}",
    tag = "buyer",
    summary = "The buyer pays on the simulated provider's pay page (or fails to, or pays after the deadline)",
    description = "Only when the simulated provider is configured (dev mode, or --payment-provider simulated); 404 otherwise.",
    params(IntentId),
    request_body = SimulateRequest,
    responses((status = 202, description = "The callback is scheduled", body = Scheduled), ChangeErrors),
    security(("user" = []))
)]
pub async fn simulated_pay(
    AuthUser(user_id): AuthUser,
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<Scheduled>), ApiError> {
    simulator(&st)?;
    let req: SimulateRequest = parse_json(&body)?;
    let payment = own_intent(&st, user_id, &id).await?;
    if payment.status != "created" {
        return Err(ApiError::Conflict(format!(
            "this payment is {} already",
            payment.status
        )));
    }
    schedule_callback(&st, &payment, req.outcome).await
}

/// Has the simulated provider call back for `payment`: now, or one second after the
/// order's payment deadline.
async fn schedule_callback(
    st: &AppState,
    payment: &Payment,
    outcome: SimulatedOutcome,
) -> Result<(StatusCode, Json<Scheduled>), ApiError> {
    let intent_id = payment.intent_id;
    let order = st
        .store
        .order(payment.order_id)
        .await?
        .ok_or_else(|| ApiError::NotFound("order".into()))?;
    let now = st.now_ms();
    let deliver_at = match outcome {
        SimulatedOutcome::PayLate => order.pay_deadline.max(now) + 1000,
        _ => now,
    };
    let notification = Notification {
        intent_id: intent_id.to_string(),
        status: if matches!(outcome, SimulatedOutcome::Fail) {
            NotifiedStatus::Failed
        } else {
            NotifiedStatus::Paid
        },
        provider_ref: format!("sim-{}", rand::random::<u32>()),
    };
    let provider = simulator(st)?.clone();
    let mut target = st.config.listen;
    if target.ip().is_unspecified() {
        target.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    let wait = (deliver_at - now).max(0) as u64;
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(wait)).await;
        match provider.deliver(target, &notification).await {
            Ok(status) => tracing::info!(
                intent_id,
                status,
                "simulated provider delivered its notification"
            ),
            Err(e) => tracing::warn!(intent_id, error = %e, "simulated provider could not deliver"),
        }
    });
    Ok((
        StatusCode::ACCEPTED,
        Json(Scheduled {
            intent_id: intent_id.to_string(),
            deliver_at: rfc3339(deliver_at),
        }),
    ))
}
