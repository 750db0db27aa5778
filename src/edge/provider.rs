//! The payment provider's side: its signed callback, `POST /api/payments/notify`, the one
//! thing that marks an order paid. Refused unless signed with the shared secret and fresh;
//! the same callback twice settles once.

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use serde::Serialize;

use super::http::error::{ApiError, ReadErrors};
use super::http::input::parse_id;
use super::AppState;
use crate::lifecycle::payment::{
    NotifiedStatus, NotifyError, PaymentProvider, SIGNATURE_HEADER, TIMESTAMP_HEADER,
};
use crate::store::{PaymentSettlement, TransitionError};

/// The configured payment provider, or 503 `payment_unavailable`.
pub fn provider(st: &AppState) -> Result<&dyn PaymentProvider, ApiError> {
    st.payments.as_deref().ok_or_else(|| {
        ApiError::PaymentUnavailable(
            "this server takes no payments: no payment provider is configured".into(),
        )
    })
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct NotifyAnswer {
    result: &'static str,
}

#[utoipa::path(
    post,
    path = "/api/payments/notify",
    tag = "provider",
    summary = "Payment provider callback, HMAC-signed",
    params(("X-Seckill-Timestamp" = String, Header, description = "Unix seconds, within 300 s of the server's clock"), ("X-Seckill-Signature" = String, Header, description = "hex HMAC-SHA256 of \"{timestamp}.{raw body}\" with the shared payment secret")),
    request_body = crate::lifecycle::payment::Notification,
    responses((status = 200, description = "paid, failed, duplicate (nothing changed) or refund_due", body = NotifyAnswer), ReadErrors)
)]
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
            st.now_ms() / 1000,
        )
        .map_err(|e| match e {
            NotifyError::BadBody(m) => ApiError::invalid(format!("invalid notification: {m}")),
            other => ApiError::Unauthorized(other.to_string()),
        })?;
    let intent_id = parse_id(&n.intent_id, "intent_id")?;
    if n.provider_ref.chars().count() > 64 {
        return Err(ApiError::invalid(
            "provider_ref is longer than 64 characters",
        ));
    }
    let not_found = || ApiError::NotFound(format!("payment intent {intent_id} does not exist"));
    let now = st.now_ms();
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
