//! The one place where errors become HTTP answers. Every error body is `{code, message}`;
//! internal failures are logged with their cause and shown to the client only as
//! `unavailable` (503): never a 500, never a stack trace.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

use crate::gate::{GateError, Rejection};
use crate::ids::IdError;
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 400 `invalid_request`: the input is malformed or out of range.
    #[error("{0}")]
    InvalidRequest(String),
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
    Rejected { code: &'static str, message: String },
    /// 403 with its own code: the anti-bot checks (`token_required`, `token_invalid`,
    /// `token_used`, `captcha_required`, `captcha_failed`).
    #[error("{message}")]
    Forbidden { code: &'static str, message: String },
    /// 409 `conflict`: the request clashes with the current state (e.g. approving twice).
    #[error("{0}")]
    Conflict(String),
    /// 429 `rate_limited`, with Retry-After.
    #[error("{message}")]
    RateLimited {
        retry_after_secs: u64,
        message: String,
    },
    /// 503 `unavailable`: a dependency failed or the service is not ready; safe to retry.
    #[error("{0}")]
    Unavailable(String),
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    code: &'a str,
    message: String,
}

impl ApiError {
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::InvalidRequest(_) => "invalid_request",
            ApiError::Unauthorized(_) => "unauthorized",
            ApiError::InvalidCode => "invalid_code",
            ApiError::NotFound(_) => "not_found",
            ApiError::MethodNotAllowed => "method_not_allowed",
            ApiError::PayloadTooLarge => "payload_too_large",
            ApiError::Rejected { code, .. } | ApiError::Forbidden { code, .. } => code,
            ApiError::Conflict(_) => "conflict",
            ApiError::RateLimited { .. } => "rate_limited",
            ApiError::Unavailable(_) => "unavailable",
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) | ApiError::InvalidCode => StatusCode::UNAUTHORIZED,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Forbidden { .. } => StatusCode::FORBIDDEN,
            ApiError::Rejected { .. } | ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
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
            Rejection::NotStarted => ("not_started", "the sale has not started".to_string()),
            Rejection::Ended => ("ended", "the sale has ended".to_string()),
            Rejection::Paused => ("paused", "the sale is paused".to_string()),
            Rejection::AlreadyPurchased => (
                "already_purchased",
                format!("you already hold the limit of {limit} for this sale"),
            ),
            Rejection::OverLimit { held } => {
                if held > 0 {
                    (
                        "already_purchased",
                        format!(
                            "you hold {held} of at most {limit}; you may buy {} more",
                            limit - held
                        ),
                    )
                } else {
                    return ApiError::invalid(format!(
                        "quantity exceeds the per-user limit of {limit}"
                    ));
                }
            }
            Rejection::SoldOut { remaining } if remaining > 0 => (
                "sold_out",
                format!("only {remaining} left, fewer than the quantity asked"),
            ),
            Rejection::SoldOut { .. } => ("sold_out", "the sale is sold out".to_string()),
            Rejection::NotLoaded => {
                return ApiError::Unavailable(
                    "the sale is being prepared; retry in a second".into(),
                )
            }
        };
        ApiError::Rejected { code, message }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = ErrorBody {
            code: self.code(),
            message: self.to_string(),
        };
        let mut response = (status, Json(body)).into_response();
        let retry_after = match &self {
            ApiError::RateLimited {
                retry_after_secs, ..
            } => Some(*retry_after_secs),
            ApiError::Unavailable(_) => Some(1),
            _ => None,
        };
        if let Some(secs) = retry_after {
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        response
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::UnknownSale(id) => ApiError::NotFound(format!("sale {id} does not exist")),
            StoreError::NotFound => ApiError::NotFound("not found".into()),
            other => {
                tracing::error!(error = %other, "database error");
                ApiError::Unavailable("the database is unavailable; retry shortly".into())
            }
        }
    }
}

impl From<GateError> for ApiError {
    fn from(e: GateError) -> Self {
        match &e {
            // Already logged once when the circuit opened; one line per refusal would flood.
            GateError::Unavailable(_) | GateError::Timeout => {
                tracing::debug!(error = %e, "gate unavailable")
            }
            _ => tracing::error!(error = %e, "gate error"),
        }
        ApiError::Unavailable("purchases are unavailable right now; retry shortly".into())
    }
}

impl From<IdError> for ApiError {
    fn from(e: IdError) -> Self {
        tracing::error!(error = %e, "id generator error");
        ApiError::Unavailable("this instance cannot issue order ids right now".into())
    }
}

impl From<crate::scheduler::SchedulerError> for ApiError {
    fn from(e: crate::scheduler::SchedulerError) -> Self {
        tracing::error!(error = %e, "could not load a sale");
        ApiError::Unavailable("the sale could not be prepared; retry shortly".into())
    }
}
