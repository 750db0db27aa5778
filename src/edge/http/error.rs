//! The one place where errors become HTTP answers. Every error body is `{code, message}`;
//! internal failures are logged with their cause and shown to the client only as
//! `unavailable` (503): never a 500, never a stack trace.

use std::borrow::Cow;
use std::collections::BTreeMap;

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use utoipa::openapi::RefOr;

use crate::gate::{GateError, Rejection};
use crate::ids::IdError;
use crate::lifecycle::LifecycleError;
use crate::store::StoreError;
use crate::store::TransitionError;

/// Every error's body, as the contract publishes it.
#[derive(serde::Serialize, utoipa::ToSchema, utoipa::ToResponse)]
#[response(
    description = "An error: `code` names it (the contract's codes), `message` says it to a person"
)]
pub struct ErrorResponse {
    pub code: String,
    pub message: String,
}

/// The errors of an operation that reads one thing by id, for the contract: 400 (a
/// malformed id), 401, 404, 429 (rate limits) and 503 (a backend down).
pub struct ReadErrors;

/// The errors of an operation that changes one thing by id: those of [`ReadErrors`] and
/// 409, a change the thing's state refuses.
pub struct ChangeErrors;

impl utoipa::IntoResponses for ReadErrors {
    fn responses() -> BTreeMap<String, RefOr<utoipa::openapi::Response>> {
        errors(&[400, 401, 404, 429, 503])
    }
}

impl utoipa::IntoResponses for ChangeErrors {
    fn responses() -> BTreeMap<String, RefOr<utoipa::openapi::Response>> {
        errors(&[400, 401, 404, 409, 429, 503])
    }
}

fn errors(statuses: &[u16]) -> BTreeMap<String, RefOr<utoipa::openapi::Response>> {
    statuses
        .iter()
        .map(|status| {
            let error = RefOr::Ref(utoipa::openapi::Ref::from_response_name("ErrorResponse"));
            (status.to_string(), error)
        })
        .collect()
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 400 `invalid_request`: the input is malformed or out of range.
    #[error("{0}")]
    InvalidRequest(String),
    /// 400 `invalid_phone`: the phone number does not parse, or is not a valid number.
    #[error("{0}")]
    InvalidPhone(String),
    /// 401 `unauthorized`: missing, malformed, forged or expired token.
    #[error("{0}")]
    Unauthorized(String),
    /// 401 `invalid_code`: the login code is wrong, expired or used up.
    #[error("the login code is wrong, expired or used up")]
    InvalidCode,
    /// 404 `not_found`.
    #[error("{0}")]
    NotFound(String),
    /// 405 `method_not_allowed`.
    #[error("this method is not allowed on this endpoint")]
    MethodNotAllowed,
    /// 413 `payload_too_large`.
    #[error("the request body is too large")]
    PayloadTooLarge,
    /// 409 with the rejection's own code (`sold_out`, `already_purchased`, ...).
    #[error("{message}")]
    Rejected {
        code: &'static str,
        message: Cow<'static, str>,
    },
    /// 403 with its own code: the anti-bot checks (`token_required`, `token_invalid`,
    /// `token_used`, `captcha_required`, `captcha_failed`).
    #[error("{message}")]
    Forbidden {
        code: &'static str,
        message: Cow<'static, str>,
    },
    /// 422 with its own code: a well-formed request that cannot be taken as it stands
    /// (`idempotency_key_reused`).
    #[error("{message}")]
    Unprocessable {
        code: &'static str,
        message: Cow<'static, str>,
    },
    /// 409 `conflict`: the request clashes with the current state (e.g. approving twice).
    #[error("{0}")]
    Conflict(String),
    /// 429 `rate_limited`, with Retry-After.
    #[error("{message}")]
    RateLimited {
        retry_after_secs: u64,
        message: Cow<'static, str>,
    },
    /// 503 `unavailable`: a dependency failed or the service is not ready; safe to retry.
    #[error("{0}")]
    Unavailable(String),
    /// 503 `payment_unavailable`: no payment provider is configured on this server.
    #[error("{0}")]
    PaymentUnavailable(String),
    /// 503 `not_loaded`: the sale is not in the gate yet (being loaded, or rebuilt after
    /// Redis lost it); nothing was bought; retry in a second.
    #[error("the sale is being prepared; nothing was bought; retry in a second")]
    NotLoaded,
    /// 202 `pending` (an order lookup): the purchase with this id was answered `pending`
    /// and may still become an order; ask again in a second.
    #[error("this purchase may still become an order; ask again in a second")]
    Pending,
    /// 404 `not_placed` (an order lookup): no order was placed with this id, and none can
    /// be any more.
    #[error("no order was placed with this id")]
    NotPlaced,
}

impl ApiError {
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::InvalidRequest(_) => "invalid_request",
            ApiError::InvalidPhone(_) => "invalid_phone",
            ApiError::Unauthorized(_) => "unauthorized",
            ApiError::InvalidCode => "invalid_code",
            ApiError::NotFound(_) => "not_found",
            ApiError::MethodNotAllowed => "method_not_allowed",
            ApiError::PayloadTooLarge => "payload_too_large",
            ApiError::Rejected { code, .. }
            | ApiError::Forbidden { code, .. }
            | ApiError::Unprocessable { code, .. } => code,
            ApiError::Conflict(_) => "conflict",
            ApiError::RateLimited { .. } => "rate_limited",
            ApiError::Unavailable(_) => "unavailable",
            ApiError::PaymentUnavailable(_) => "payment_unavailable",
            ApiError::NotLoaded => "not_loaded",
            ApiError::Pending => "pending",
            ApiError::NotPlaced => "not_placed",
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest(_) | ApiError::InvalidPhone(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) | ApiError::InvalidCode => StatusCode::UNAUTHORIZED,
            ApiError::NotFound(_) | ApiError::NotPlaced => StatusCode::NOT_FOUND,
            ApiError::Pending => StatusCode::ACCEPTED,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Forbidden { .. } => StatusCode::FORBIDDEN,
            ApiError::Unprocessable { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::Rejected { .. } | ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable(_) | ApiError::NotLoaded | ApiError::PaymentUnavailable(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }

    /// 503 for a call that ran out of `REQUEST_TIMEOUT`.
    pub fn too_slow() -> Self {
        ApiError::Unavailable("the server could not answer in time".into())
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError::InvalidRequest(message.into())
    }

    /// Maps a gate rejection to the contract's 409 codes.
    pub fn from_rejection(r: Rejection, limit: i64) -> Self {
        let (code, message) = match r {
            Rejection::RateLimited { retry_after_ms } => {
                return ApiError::RateLimited {
                    retry_after_secs: (retry_after_ms.max(1) as u64).div_ceil(1000),
                    message: "too many purchase attempts; slow down".into(),
                }
            }
            Rejection::TokenUsed => {
                return ApiError::Forbidden {
                    code: "token_used",
                    message: "this purchase token was used already; get a new one".into(),
                }
            }
            Rejection::NotStarted => ("not_started", "the sale has not started".into()),
            Rejection::Ended => ("ended", "the sale has ended".into()),
            Rejection::Paused => ("paused", "the sale is paused".into()),
            Rejection::AlreadyPurchased if limit == 1 => (
                "already_purchased",
                "you already hold the limit of 1 for this sale".into(),
            ),
            Rejection::AlreadyPurchased => (
                "already_purchased",
                format!("you already hold the limit of {limit} for this sale").into(),
            ),
            Rejection::OverLimit { held } => {
                if held > 0 {
                    (
                        "already_purchased",
                        format!(
                            "you hold {held} of at most {limit}; you may buy {} more",
                            limit - held
                        )
                        .into(),
                    )
                } else {
                    return ApiError::invalid(format!(
                        "quantity exceeds the per-user limit of {limit}"
                    ));
                }
            }
            Rejection::SoldOut { remaining } if remaining > 0 => (
                "sold_out",
                format!("only {remaining} left, fewer than the quantity asked").into(),
            ),
            Rejection::SoldOut { .. } => ("sold_out", "the sale is sold out".into()),
            Rejection::NotLoaded => return ApiError::NotLoaded,
            Rejection::RetryKeyReused => {
                return ApiError::Unprocessable {
                    code: "idempotency_key_reused",
                    message: "this Idempotency-Key bought another quantity of this sale; use a \
                              new key for a new purchase"
                        .into(),
                }
            }
            Rejection::Expired => {
                return ApiError::Unavailable(
                    "the purchase reached the gate too late and was not made; retry".into(),
                )
            }
        };
        ApiError::Rejected { code, message }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let message = self.message();
        let mut body = Vec::with_capacity(40 + message.len());
        body.extend_from_slice(b"{\"code\":\"");
        body.extend_from_slice(self.code().as_bytes());
        body.extend_from_slice(b"\",\"message\":");
        write_json_string(&mut body, &message);
        body.push(b'}');
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = self.status();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let retry_after = match &self {
            ApiError::RateLimited {
                retry_after_secs, ..
            } => Some(*retry_after_secs),
            ApiError::Unavailable(_) | ApiError::NotLoaded | ApiError::Pending => Some(1),
            _ => None,
        };
        if let Some(secs) = retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

impl ApiError {
    /// The human half of the answer, borrowed where the error holds it.
    fn message(&self) -> Cow<'_, str> {
        match self {
            ApiError::InvalidRequest(m)
            | ApiError::InvalidPhone(m)
            | ApiError::PaymentUnavailable(m)
            | ApiError::Unauthorized(m)
            | ApiError::NotFound(m)
            | ApiError::Conflict(m)
            | ApiError::Unavailable(m) => Cow::Borrowed(m),
            ApiError::Rejected { message, .. }
            | ApiError::Forbidden { message, .. }
            | ApiError::Unprocessable { message, .. }
            | ApiError::RateLimited { message, .. } => Cow::Borrowed(message),
            ApiError::InvalidCode
            | ApiError::MethodNotAllowed
            | ApiError::PayloadTooLarge
            | ApiError::NotLoaded
            | ApiError::Pending
            | ApiError::NotPlaced => Cow::Owned(self.to_string()),
        }
    }
}

/// `s` as a JSON string. Error messages rarely hold a character JSON must escape, and
/// every purchase refused is answered with one: copy those as they are.
fn write_json_string(out: &mut Vec<u8>, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        // Writing JSON into a Vec cannot fail.
        let _ = serde_json::to_writer(out, s);
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::UnknownSale(id) => ApiError::NotFound(format!("sale {id} does not exist")),
            StoreError::NotFound => ApiError::NotFound("not found".into()),
            other => {
                if let Some(left_out) = DB_ERRORS_LOGGED.ready() {
                    tracing::error!(error = %other, left_out, "database error");
                }
                ApiError::Unavailable("the database is unavailable; retry shortly".into())
            }
        }
    }
}

/// During an outage every request fails the same way: one line per 10 s each.
static DB_ERRORS_LOGGED: crate::logline::Every = crate::logline::Every::new(10_000);
static GATE_ERRORS_LOGGED: crate::logline::Every = crate::logline::Every::new(10_000);
static LOAD_ERRORS_LOGGED: crate::logline::Every = crate::logline::Every::new(10_000);

impl From<GateError> for ApiError {
    fn from(e: GateError) -> Self {
        match &e {
            // Already logged once when the circuit opened; one line per refusal would flood.
            GateError::Unavailable(_) | GateError::Timeout => {
                tracing::debug!(error = %e, "gate unavailable")
            }
            _ => {
                if let Some(left_out) = GATE_ERRORS_LOGGED.ready() {
                    tracing::error!(error = %e, left_out, "gate error");
                }
            }
        }
        ApiError::Unavailable("purchases are unavailable right now; retry shortly".into())
    }
}

impl From<crate::orderlog::LogError> for ApiError {
    fn from(e: crate::orderlog::LogError) -> Self {
        tracing::debug!(error = %e, "order log unavailable");
        ApiError::Unavailable(format!("order log: {e}"))
    }
}

impl From<crate::room::RoomError> for ApiError {
    fn from(e: crate::room::RoomError) -> Self {
        tracing::debug!(error = %e, "waiting room unavailable");
        ApiError::Unavailable("the waiting room cannot be reached right now; retry".into())
    }
}

impl From<IdError> for ApiError {
    fn from(e: IdError) -> Self {
        // The lease's loss and return are logged where they happen.
        tracing::debug!(error = %e, "id generator error");
        ApiError::Unavailable("this instance cannot issue order ids right now".into())
    }
}

impl From<crate::loader::LoadError> for ApiError {
    fn from(e: crate::loader::LoadError) -> Self {
        if let Some(left_out) = LOAD_ERRORS_LOGGED.ready() {
            tracing::error!(error = %e, left_out, "could not load a sale");
        }
        ApiError::Unavailable("the sale could not be prepared; retry shortly".into())
    }
}

impl From<crate::reconcile::ReconcileError> for ApiError {
    fn from(e: crate::reconcile::ReconcileError) -> Self {
        use crate::reconcile::ReconcileError as R;
        match e {
            R::Store(e) => e.into(),
            R::Gate(GateError::Misconfigured(why)) => ApiError::Conflict(why),
            R::Gate(e) => e.into(),
            R::Load(e) => e.into(),
            R::Log(e) => ApiError::Unavailable(format!("order log: {e}")),
            R::NoSuchSale(id) => ApiError::NotFound(format!("sale {id} does not exist")),
            R::TooMuchInFlight(_) => {
                ApiError::Unavailable(format!("{e}; retry when the writers have caught up"))
            }
        }
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    async fn answer(e: ApiError) -> (StatusCode, Option<String>, serde_json::Value) {
        let r = e.into_response();
        let retry = r
            .headers()
            .get(header::RETRY_AFTER)
            .map(|v| v.to_str().unwrap().to_string());
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/json");
        let status = r.status();
        let body = axum::body::to_bytes(r.into_body(), 4096).await.unwrap();
        (status, retry, serde_json::from_slice(&body).unwrap())
    }

    #[tokio::test]
    async fn every_error_is_code_and_message_in_valid_json() {
        let (s, retry, v) = answer(ApiError::from_rejection(
            Rejection::SoldOut { remaining: 0 },
            1,
        ))
        .await;
        assert_eq!(s, StatusCode::CONFLICT);
        assert_eq!(retry, None);
        assert_eq!(
            v,
            serde_json::json!({"code": "sold_out", "message": "the sale is sold out"})
        );
        let tricky = "a \"quoted\" \\ back\tslash\n and 中文 and \u{1}";
        let (s, _, v) = answer(ApiError::invalid(tricky)).await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        assert_eq!(
            v,
            serde_json::json!({"code": "invalid_request", "message": tricky})
        );
        let (s, retry, v) = answer(ApiError::RateLimited {
            retry_after_secs: 3,
            message: "slow down".into(),
        })
        .await;
        assert_eq!(
            (s, retry.as_deref()),
            (StatusCode::TOO_MANY_REQUESTS, Some("3"))
        );
        assert_eq!(v["code"], "rate_limited");
        let (s, retry, v) = answer(ApiError::too_slow()).await;
        assert_eq!(
            (s, retry.as_deref()),
            (StatusCode::SERVICE_UNAVAILABLE, Some("1"))
        );
        assert_eq!(v["code"], "unavailable");
        let (_, _, v) = answer(ApiError::PayloadTooLarge).await;
        assert_eq!(
            v,
            serde_json::json!({"code": "payload_too_large", "message": "the request body is too large"})
        );
    }
}
