//! Safe retries: a creating call sent with `Idempotency-Key` runs once per caller and key.
//! The same key with the same request answers the first answer again (with
//! `Idempotent-Replayed: true`) for at least `KEPT_FOR`, on every instance and after a
//! restart (the records are in SQL); the same key with another request answers 422
//! `idempotency_key_reused`; a retry while the first call still runs waits for it, up to
//! `WAIT_FOR_RUNNING`, then answers 409 `idempotency_in_progress`. Answers worth trying
//! again (5xx, 429) are not kept: the key is released and a retry runs the call.
//!
//! The caller is who the credentials name (a buyer, an API key, the admin token), so one
//! person's key never answers another's call.
//!
//! What it must never do: run a call twice for one (caller, key), or replay an answer to
//! another caller.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{FromRequestParts, Request, State};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use super::auth::Admin;
use super::http::error::ApiError;
use super::AppState;
use crate::store::idempotency::Claim;

pub const HEADER: &str = "idempotency-key";
const REPLAYED: &str = "idempotent-replayed";
/// How long a key's answer is kept at least (Stripe's 24 hours); removed some time after.
pub const KEPT_FOR: Duration = Duration::from_secs(24 * 3600);
/// Records older than this are removed.
const FORGET_AFTER: Duration = Duration::from_secs(25 * 3600);
/// How long a retry waits for the first call of its key to finish.
const WAIT_FOR_RUNNING: Duration = Duration::from_secs(5);
/// Longest key read (printable ASCII).
const MAX_KEY_BYTES: usize = 255;
/// Largest answer kept (under MySQL's TEXT); a larger one is not replayable and releases
/// its key.
const MAX_KEPT_ANSWER: usize = 60 * 1024;
/// Records removed per statement, and the pause between sweeps.
const FORGET_BATCH: i64 = 1000;
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// The middleware of the creating calls that honour `Idempotency-Key`.
pub async fn idempotent(State(st): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    if request.method() != Method::POST && request.method() != Method::DELETE {
        return next.run(request).await;
    }
    let Some(key) = request.headers().get(HEADER) else {
        return next.run(request).await;
    };
    let key = match key_text(key) {
        Ok(key) => key.to_string(),
        Err(e) => return e.into_response(),
    };
    match run_once(&st, key, request, next).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

pub fn key_text(value: &HeaderValue) -> Result<&str, ApiError> {
    value
        .to_str()
        .ok()
        .filter(|k| {
            !k.is_empty() && k.len() <= MAX_KEY_BYTES && k.bytes().all(|b| b.is_ascii_graphic())
        })
        .ok_or_else(|| {
            ApiError::invalid(format!(
                "Idempotency-Key must be 1 to {MAX_KEY_BYTES} printable ASCII characters"
            ))
        })
}

async fn run_once(
    st: &Arc<AppState>,
    key: String,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let (mut parts, body) = request.into_parts();
    let caller = caller_of(st, &mut parts).await?;
    let body = axum::body::to_bytes(body, super::MAX_BODY_BYTES)
        .await
        .map_err(|_| ApiError::PayloadTooLarge)?;
    let fingerprint = {
        let mut h = Sha256::new();
        h.update(parts.method.as_str().as_bytes());
        h.update(b" ");
        h.update(parts.uri.path().as_bytes());
        h.update(b"\n");
        h.update(&body);
        crate::text::hex(&h.finalize())
    };
    let deadline = tokio::time::Instant::now() + WAIT_FOR_RUNNING;
    let claimed_at = loop {
        let now = st.now_ms();
        let claim = st
            .store
            .claim_idempotency_key(&caller, &key, &fingerprint, now)
            .await?;
        match claim {
            Claim::Mine => break now,
            Claim::Taken { fingerprint: f, .. } if f != fingerprint => {
                return Err(ApiError::Unprocessable {
                    code: "idempotency_key_reused",
                    message: "this Idempotency-Key was sent with another request (method, \
                              path or body); use a new key for a new request"
                        .into(),
                });
            }
            Claim::Taken {
                answer: Some((status, body)),
                ..
            } => return Ok(replay(status, body)),
            Claim::Taken { answer: None, .. } => {
                if tokio::time::Instant::now() >= deadline {
                    return Err(ApiError::Rejected {
                        code: "idempotency_in_progress",
                        message: "a call with this Idempotency-Key is still running; ask again \
                                  shortly for its answer"
                            .into(),
                    });
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let response = next.run(Request::from_parts(parts, Body::from(body))).await;
    keep(st, &caller, &key, claimed_at, response).await
}

/// Keeps a claimed call's answer (or releases the key when the answer says nothing
/// happened that a retry should not do again), and answers it.
async fn keep(
    st: &AppState,
    caller: &str,
    key: &str,
    claimed_at: i64,
    response: Response,
) -> Result<Response, ApiError> {
    let status = response.status();
    let (parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, MAX_KEPT_ANSWER).await;
    let retryable = status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS;
    match (&bytes, retryable) {
        (Ok(bytes), false) => {
            let text = without_secrets(&String::from_utf8_lossy(bytes));
            // The call is done: its answer goes to the client even if it cannot be kept
            // (the claim then lapses after its lease, and a retry runs the call again).
            if let Err(e) = st
                .store
                .complete_idempotency_key(caller, key, status.as_u16(), &text)
                .await
            {
                tracing::warn!(error = %e, "cannot keep an Idempotency-Key's answer");
            }
        }
        _ => {
            if let Err(e) = st
                .store
                .release_idempotency_key(caller, key, claimed_at)
                .await
            {
                tracing::warn!(error = %e, "cannot release an Idempotency-Key");
            }
        }
    }
    let body = bytes.map(Body::from).unwrap_or_else(|_| Body::empty());
    Ok(Response::from_parts(parts, body))
}

/// What is kept of an answer: a secret shown once (a new API key's) is not kept at rest,
/// and a replay says where it was.
fn without_secrets(text: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(mut v) if v.get("secret").is_some_and(|s| s.is_string()) => {
            v["secret"] = "(shown once, in the first answer to this Idempotency-Key)".into();
            v.to_string()
        }
        _ => text.to_string(),
    }
}

fn replay(status: u16, body: String) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    let mut response = (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response();
    response.headers_mut().insert(
        HeaderName::from_static(REPLAYED),
        HeaderValue::from_static("true"),
    );
    response
}

/// Who the request's credentials name: `admin`, `key:{id}` or `user:{id}`; 401/403 as the
/// call itself would answer.
async fn caller_of(
    st: &Arc<AppState>,
    parts: &mut axum::http::request::Parts,
) -> Result<String, ApiError> {
    if parts.uri.path().starts_with("/api/admin/") {
        let admin = Admin::from_request_parts(parts, st).await?;
        return Ok(admin
            .key
            .map_or_else(|| "admin".to_string(), |k| format!("key:{}", k.id)));
    }
    let user = super::auth::user_of(st, &parts.headers, st.now_ms()).await?;
    Ok(format!("user:{user}"))
}

/// Removes records older than `FORGET_AFTER`, in batches, every `SWEEP_EVERY`, until `stop`.
pub async fn forget_old(st: Arc<AppState>, mut stop: watch::Receiver<bool>) {
    loop {
        let before = st.now_ms() - FORGET_AFTER.as_millis() as i64;
        loop {
            match st.store.forget_idempotency_keys(before, FORGET_BATCH).await {
                Ok(n) if n as i64 == FORGET_BATCH => tokio::task::yield_now().await,
                Ok(_) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "cannot remove old idempotency keys yet");
                    break;
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(SWEEP_EVERY) => {}
            _ = stop.changed() => {}
        }
        if crate::stop::requested(&mut stop) {
            break;
        }
    }
}
