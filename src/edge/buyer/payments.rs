//! A buyer pays (a payment intent at the configured provider) or cancels an order. Only
//! the provider's signed callback (`provider`) marks an order paid.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use serde::Serialize;

use super::super::auth::AuthUser;
use super::super::http::error::{ApiError, ChangeErrors};
use super::super::http::input::{rfc3339, OrderId, PathId};
use super::super::provider::provider;
use super::super::AppState;
use crate::lifecycle::payment::{Intent, IntentView};
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
    params(OrderId),
    responses((status = 200, description = "Where to pay it", body = IntentView), ChangeErrors),
    security(("user" = []))
)]
pub async fn pay(
    AuthUser(user_id): AuthUser,
    State(st): State<Arc<AppState>>,
    PathId(order_id, _): OrderId,
) -> Result<Json<IntentView>, ApiError> {
    let provider = provider(&st)?;
    let order = match st.store.order(order_id).await? {
        Some(o) if o.user_id == user_id => o,
        _ => return Err(not_in_sql(&st, order_id, user_id).await),
    };
    let now = st.now_ms();
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
    Ok(Json(provider.intent_view(&Intent {
        intent_id: payment.intent_id,
        order_id,
        amount_cents: payment.amount_cents,
        expires_at: &rfc3339(order.pay_deadline),
    })))
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
    params(OrderId),
    responses((status = 200, description = "Cancelled", body = Cancelled), ChangeErrors),
    security(("user" = []))
)]
pub async fn cancel(
    AuthUser(user_id): AuthUser,
    State(st): State<Arc<AppState>>,
    PathId(order_id, _): OrderId,
) -> Result<Json<Cancelled>, ApiError> {
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
