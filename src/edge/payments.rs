//! Payment and cancellation endpoints: a buyer asks to pay (a payment intent) or cancels;
//! the provider calls back, signed. Only that callback marks an order paid. The simulated
//! provider's endpoints (its pay page's calls, the admin's) answer 404 unless it is the
//! configured provider (dev mode, or `--payment-provider simulated`).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde::{Deserialize, Serialize};

use super::auth::{Admin, AuthUser};
use super::error::ApiError;
use super::sales::rfc3339;
use super::{parse_id, parse_json, AppState};
use crate::lifecycle::payment::{
    IntentView, Notification, NotifiedStatus, NotifyError, PaymentProvider, SimulatedProvider,
    SIGNATURE_HEADER, TIMESTAMP_HEADER,
};
use crate::lifecycle::LifecycleError;
use crate::model::OrderStatus;
use crate::store::lifecycle::{Payment, PaymentSettlement, TransitionError};

impl From<TransitionError> for ApiError {
    fn from(e: TransitionError) -> Self {
        match e {
            TransitionError::NoSuchOrder(id) => {
                ApiError::NotFound(format!("order {id} does not exist"))
            }
            TransitionError::Illegal { from, to } => ApiError::Rejected {
                code: "invalid_transition",
                message: format!("the order is {from}; it cannot become {to}").into(),
            },
            TransitionError::Store(e) => e.into(),
        }
    }
}

impl From<LifecycleError> for ApiError {
    fn from(e: LifecycleError) -> Self {
        match e {
            LifecycleError::Transition(t) => t.into(),
            LifecycleError::Store(s) => s.into(),
            LifecycleError::Gate(g) => g.into(),
        }
    }
}

/// A buyer's order that SQL does not hold yet is still being written: say so, distinctly.
async fn not_in_sql(st: &AppState, order_id: i64, user_id: i64) -> ApiError {
    let accepted_at = crate::ids::IdGenerator::time_of(order_id);
    for sale in st.sales.all() {
        if accepted_at < sale.begins_at - 1000 || accepted_at > sale.ends_at + 1000 {
            continue;
        }
        match st.gate.queued_order(sale.id, order_id).await {
            Ok(Some((owner, _))) if owner == user_id => {
                return ApiError::Rejected {
                    code: "order_queued",
                    message: "the order is still being written; retry in a moment".into(),
                }
            }
            Ok(_) => {}
            // Redis is away: the order may well be there, waiting to be written. "No such
            // order" would be a lie; say it cannot be told now.
            Err(e) => return e.into(),
        }
    }
    ApiError::NotFound(format!("order {order_id} does not exist"))
}

/// The configured payment provider, or 503 `payment_unavailable`.
fn provider(st: &AppState) -> Result<&dyn PaymentProvider, ApiError> {
    st.payments.as_deref().ok_or_else(|| {
        ApiError::PaymentUnavailable(
            "this server takes no payments: no payment provider is configured".into(),
        )
    })
}

/// The simulated provider, or 404 when it is not the one configured.
fn simulator(st: &AppState) -> Result<&SimulatedProvider, ApiError> {
    st.simulator.as_ref().ok_or_else(|| {
        ApiError::NotFound(
            "the simulated payment provider is off (dev mode, or --payment-provider simulated)"
                .into(),
        )
    })
}

pub async fn pay(
    AuthUser(user_id): AuthUser,
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<IntentView>, ApiError> {
    let order_id = parse_id(&id, "order id")?;
    let provider = provider(&st)?;
    let order = match st.store.order(order_id).await? {
        Some(o) if o.user_id == user_id => o,
        _ => return Err(not_in_sql(&st, order_id, user_id).await),
    };
    let now = crate::now_ms();
    if order.status != OrderStatus::PendingPayment || order.pay_deadline <= now {
        let from = if order.status == OrderStatus::PendingPayment {
            "past its payment deadline"
        } else {
            order.status.as_str()
        };
        return Err(ApiError::Rejected {
            code: "invalid_transition",
            message: format!("the order is {from}; it cannot be paid").into(),
        });
    }
    let payment = match st.store.open_payment_of(order_id).await? {
        Some(p) => p,
        None => {
            let amount_cents = order
                .price_cents
                .checked_mul(order.quantity)
                .ok_or_else(|| ApiError::Conflict("the order's amount is out of range".into()))?;
            let p = Payment {
                intent_id: st.ids.next()?,
                order_id,
                user_id,
                amount_cents,
                status: "created".into(),
                created_at: now,
            };
            st.store.open_payment(&p).await?
        }
    };
    Ok(Json(provider.intent_view(
        payment.intent_id,
        order_id,
        payment.amount_cents,
        &rfc3339(order.pay_deadline),
    )))
}

#[derive(Serialize)]
pub struct Cancelled {
    id: String,
    status: OrderStatus,
}

pub async fn cancel(
    AuthUser(user_id): AuthUser,
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Cancelled>, ApiError> {
    let order_id = parse_id(&id, "order id")?;
    match crate::lifecycle::cancel(&st.store, st.gate.as_ref(), order_id, user_id).await {
        Ok(()) => Ok(Json(Cancelled {
            id: order_id.to_string(),
            status: OrderStatus::Cancelled,
        })),
        Err(LifecycleError::Transition(TransitionError::NoSuchOrder(_))) => {
            Err(not_in_sql(&st, order_id, user_id).await)
        }
        Err(e) => Err(e.into()),
    }
}

#[derive(Serialize)]
pub struct NotifyAnswer {
    result: &'static str,
}

pub async fn notify(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<NotifyAnswer>, ApiError> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let n = provider(&st)?
        .verify(
            header(TIMESTAMP_HEADER),
            header(SIGNATURE_HEADER),
            &body,
            crate::now_ms() / 1000,
        )
        .map_err(|e| match e {
            NotifyError::BadBody(m) => ApiError::invalid(format!("invalid notification: {m}")),
            other => ApiError::Unauthorized(other.to_string()),
        })?;
    let intent_id = parse_id(&n.intent_id, "intent_id")?;
    let not_found = || ApiError::NotFound(format!("payment intent {intent_id} does not exist"));
    let now = crate::now_ms();
    let result = match n.status {
        NotifiedStatus::Failed => {
            st.store.payment(intent_id).await?.ok_or_else(not_found)?;
            if st
                .store
                .fail_payment(intent_id, &n.provider_ref, now)
                .await?
            {
                "failed"
            } else {
                "duplicate"
            }
        }
        NotifiedStatus::Paid => match st
            .store
            .settle_payment(intent_id, &n.provider_ref, now)
            .await
        {
            Ok(PaymentSettlement::Paid) => "paid",
            Ok(PaymentSettlement::Duplicate) => "duplicate",
            Ok(PaymentSettlement::RefundDue) => {
                tracing::warn!(
                    intent_id,
                    "payment arrived after the order expired or was cancelled: refund due"
                );
                "refund_due"
            }
            Err(TransitionError::NoSuchOrder(_)) => return Err(not_found()),
            Err(e) => return Err(e.into()),
        },
    };
    Ok(Json(NotifyAnswer { result }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SimulateRequest {
    outcome: SimulatedOutcome,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum SimulatedOutcome {
    Pay,
    Fail,
    /// Pays one second after the order's payment deadline.
    PayLate,
}

#[derive(Serialize)]
pub struct Scheduled {
    intent_id: String,
    deliver_at: String,
}

/// Tells the simulated provider to call back for an intent: now, or after the deadline.
pub async fn simulate(
    _: Admin,
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<Scheduled>), ApiError> {
    simulator(&st)?;
    let intent_id = parse_id(&id, "intent id")?;
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

#[derive(Serialize)]
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
    Ok(super::sales::no_store(SimulatedIntent {
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
    let now = crate::now_ms();
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
    tokio::spawn(async move {
        let wait = (deliver_at - crate::now_ms()).max(0) as u64;
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
