//! A buyer pays (a payment intent at the configured provider) or cancels an order. Only
//! the provider's signed callback (`provider`) marks an order paid.

use crate::edge::http::error::ErrorResponse;
use crate::edge::http::input::Id;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::Json;
use serde::Serialize;

use super::super::auth::AuthUser;
use super::super::http::error::ApiError;
use super::super::http::input::{parse_id, rfc3339};
use super::super::provider::provider;
use super::super::AppState;
use crate::lifecycle::payment::IntentView;
use crate::lifecycle::LifecycleError;
use crate::model::OrderStatus;
use crate::store::{Payment, TransitionError};

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

#[utoipa::path(
    post,
    path = "/api/orders/{id}/pay",
    tag = "buyer",
    summary = "Create (or return the open) payment intent",
    description = "At most one open intent per order, however many calls race. 503 payment_unavailable when no payment provider is configured.",
    params(("id" = Id, Path, description = "Order id: a positive 64-bit integer, in decimal")),
    responses((status = 200, description = "Where to pay it", body = IntentView), (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse), (status = 404, response = ErrorResponse), (status = 409, response = ErrorResponse), (status = 429, response = ErrorResponse), (status = 503, response = ErrorResponse)),
    security(("user" = []))
)]
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

#[derive(Serialize, utoipa::ToSchema)]
pub struct Cancelled {
    id: String,
    status: OrderStatus,
}

#[utoipa::path(
    post,
    path = "/api/orders/{id}/cancel",
    tag = "buyer",
    summary = "Cancel a pending order; its units go back to the stock",
    params(("id" = Id, Path, description = "Order id: a positive 64-bit integer, in decimal")),
    responses((status = 200, description = "Cancelled", body = Cancelled), (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse), (status = 404, response = ErrorResponse), (status = 409, response = ErrorResponse), (status = 429, response = ErrorResponse), (status = 503, response = ErrorResponse)),
    security(("user" = []))
)]
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
