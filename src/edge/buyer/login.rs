//! Logging in by phone: a one-time code (returned in the answer in dev mode, else sent
//! through the configured SMS hook), then a signed token. Phones are normalised to E.164
//! first, so one number is one user; guesses at a phone's codes are capped per day.

use crate::edge::http::error::ErrorResponse;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use serde::{Deserialize, Serialize};

use super::super::auth::{constant_time_eq, AuthUser};
use super::super::http::error::ApiError;
use super::super::http::input::parse_json;
use super::super::AppState;

const CODE_TTL_MS: i64 = 5 * 60_000;

const CODE_RESEND_MS: i64 = 30_000;

const CODE_MAX_ATTEMPTS: i64 = 5;

/// Wrong login codes one phone may send in a day, whatever number of codes it asked for:
/// a new code does not give the guesser new tries. Ten guesses at a six-digit code find
/// it once in 100,000 days; a person who mistypes ten times a day waits until tomorrow.
pub const LOGIN_FAILURES_PER_DAY: i64 = 10;

/// The day of `LOGIN_FAILURES_PER_DAY`, opened by the phone's first guess in it.
pub const LOGIN_FAILURE_WINDOW_MS: i64 = 86_400_000;

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CodeRequest {
    /// A phone number as a person writes it (+86 138 0000 0001, 0086..., or a national
    /// number in the server's phone region); normalised to E.164. A number that is not
    /// valid in its country is refused with 400 invalid_phone.
    #[schema(pattern = "^[0-9 +()\\-.]{1,32}$", max_length = 32)]
    phone: String,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct CodeSent {
    sent: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    dev_code: Option<String>,
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LoginRequest {
    /// A phone number as a person writes it (+86 138 0000 0001, 0086..., or a national
    /// number in the server's phone region); normalised to E.164. A number that is not
    /// valid in its country is refused with 400 invalid_phone.
    #[schema(pattern = "^[0-9 +()\\-.]{1,32}$", max_length = 32)]
    phone: String,
    /// The code sent to the phone.
    #[schema(max_length = 16)]
    code: String,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct LoginAnswer {
    token: String,
    user_id: String,
}

/// The phone in E.164, the one spelling that names a user, or 400 `invalid_phone`.
fn canonical_phone(st: &AppState, raw: &str) -> Result<String, ApiError> {
    crate::text::normalize_phone(raw, st.config.phone_region())
        .map_err(|e| ApiError::InvalidPhone(e.to_string()))
}

/// 429 while `phone` has used up its wrong codes for the day: no code is sent to it (each
/// costs an SMS) and none is compared.
async fn refuse_if_locked(st: &AppState, phone: &str, now: i64) -> Result<(), ApiError> {
    match st
        .store
        .login_locked_until(phone, now, LOGIN_FAILURES_PER_DAY, LOGIN_FAILURE_WINDOW_MS)
        .await?
    {
        Some(until) => Err(locked(until, now)),
        None => Ok(()),
    }
}

fn locked(until: i64, now: i64) -> ApiError {
    ApiError::RateLimited {
        retry_after_secs: (until.saturating_sub(now).max(1) as u64).div_ceil(1000),
        message: format!(
            "{LOGIN_FAILURES_PER_DAY} wrong codes were sent for this phone today; try again later"
        )
        .into(),
    }
}

#[utoipa::path(
    post,
    path = "/api/auth/code",
    tag = "buyer",
    summary = "Send a login code (returned as dev_code in dev mode)",
    description = "The phone is normalised to E.164 (any spelling of one number is one user); a number that does not parse, is not valid in its country, or has an extension gets 400 invalid_phone. 429 rate_limited when asked again within 30 s, or after 10 wrong codes for the phone in a day.",
    request_body = CodeRequest,
    responses((status = 200, description = "The code was sent (or, in dev mode, is in `dev_code`)", body = CodeSent), (status = 400, response = ErrorResponse), (status = 429, response = ErrorResponse), (status = 503, response = ErrorResponse))
)]
pub async fn request_code(
    State(st): State<Arc<AppState>>,
    body: axum::body::Bytes,
) -> Result<Json<CodeSent>, ApiError> {
    let req: CodeRequest = parse_json(&body)?;
    let phone = &canonical_phone(&st, &req.phone)?;
    let now = st.now_ms();
    refuse_if_locked(&st, phone, now).await?;
    if let Some(issued) = st.store.login_code_issued_at(phone, now).await? {
        let wait = issued + CODE_RESEND_MS - now;
        if wait > 0 {
            return Err(ApiError::RateLimited {
                retry_after_secs: (wait as u64).div_ceil(1000),
                message: "a code was sent moments ago; wait before asking again".into(),
            });
        }
    }
    if !st.config.dev && st.config.sms_hook.is_none() {
        return Err(ApiError::Unavailable(
            "no SMS hook is configured to deliver login codes".into(),
        ));
    }
    let code = format!("{:06}", rand::random::<u32>() % 1_000_000);
    st.store
        .put_login_code(phone, &code, now, now + CODE_TTL_MS)
        .await?;
    if st.config.dev {
        return Ok(Json(CodeSent {
            sent: true,
            dev_code: Some(code),
        }));
    }
    if let Some(hook) = &st.config.sms_hook {
        send_sms(hook, phone, &code).await?;
    }
    Ok(Json(CodeSent {
        sent: true,
        dev_code: None,
    }))
}

async fn send_sms(hook: &str, phone: &str, code: &str) -> Result<(), ApiError> {
    let status = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(hook)
        .env("SECKILL_PHONE", phone)
        .env("SECKILL_CODE", code)
        .status()
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "SMS hook could not run");
            ApiError::Unavailable("the login code could not be sent".into())
        })?;
    if !status.success() {
        tracing::error!(%status, "SMS hook failed");
        return Err(ApiError::Unavailable(
            "the login code could not be sent".into(),
        ));
    }
    Ok(())
}

#[utoipa::path(
    post,
    path = "/api/auth/login",
    tag = "buyer",
    summary = "Exchange phone and code for a bearer token",
    description = "401 invalid_code for a wrong, expired or used-up code; 429 rate_limited once the phone sent 10 wrong codes in 24 h (a new code does not reset the count).",
    request_body = LoginRequest,
    responses((status = 200, description = "A bearer token for the user calls", body = LoginAnswer), (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse), (status = 429, response = ErrorResponse), (status = 503, response = ErrorResponse))
)]
pub async fn login(
    State(st): State<Arc<AppState>>,
    body: axum::body::Bytes,
) -> Result<Json<LoginAnswer>, ApiError> {
    let req: LoginRequest = parse_json(&body)?;
    let phone = &canonical_phone(&st, &req.phone)?;
    if req.code.len() > 16 {
        return Err(ApiError::InvalidCode);
    }
    let now = st.now_ms();
    if let Some(until) = st
        .store
        .take_login_guess(phone, now, LOGIN_FAILURES_PER_DAY, LOGIN_FAILURE_WINDOW_MS)
        .await?
    {
        return Err(locked(until, now));
    }
    let expected = st
        .store
        .spend_login_attempt(phone, now, CODE_MAX_ATTEMPTS)
        .await?;
    let right = expected.is_some_and(|e| constant_time_eq(e.as_bytes(), req.code.as_bytes()));
    if !right {
        st.metrics.login_failures.fetch_add(1, Ordering::Relaxed);
        return Err(ApiError::InvalidCode);
    }
    st.store.refund_login_guess(phone).await?;
    st.store.delete_login_code(phone).await?;
    let user_id = st.store.user_for_phone(phone, st.ids.next()?).await?;
    let expires = now / 1000 + st.config.token_ttl_secs as i64;
    Ok(Json(LoginAnswer {
        token: st.tokens.sign(user_id, expires),
        user_id: user_id.to_string(),
    }))
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct Me {
    /// The buyer's id: for a shop token, the same for every token of its (issuer, subject).
    user_id: String,
}

#[utoipa::path(
    get,
    path = "/api/auth/me",
    tag = "buyer",
    summary = "The buyer a bearer token names",
    description = "Accepts seckill's own tokens and, with shop sign-in on, the shop's (a JWT \
                   from its issuer). A shop's page calls it once at sign-in: the token is then \
                   verified, and every later call with it finds it already verified. 401 \
                   unauthorized names the check a token failed.",
    responses((status = 200, description = "The caller", body = Me), (status = 401, response = ErrorResponse), (status = 503, response = ErrorResponse)),
    security(("user" = []))
)]
pub async fn me(AuthUser(user_id): AuthUser) -> Json<Me> {
    Json(Me {
        user_id: user_id.to_string(),
    })
}

#[utoipa::path(
    post,
    path = "/api/auth/exchange",
    tag = "buyer",
    summary = "Exchange a shop token for seckill's own token",
    description = "With shop sign-in on: the bearer is a JWT from the shop's issuer, checked as \
                   every call checks it; the answer is seckill's own token for the same buyer, \
                   valid until the shop token expires (at most --token-ttl-secs). seckill's \
                   own token is the cheapest to verify: a page that exchanges at sign-in \
                   makes each purchase cost what it costs a phone buyer. 404 when shop \
                   sign-in is off; 401 unauthorized names the check a token failed.",
    responses((status = 200, description = "seckill's token for the same buyer", body = LoginAnswer), (status = 401, response = ErrorResponse), (status = 404, response = ErrorResponse), (status = 503, response = ErrorResponse)),
    security(("user" = []))
)]
pub async fn exchange(
    State(st): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
) -> Result<Json<LoginAnswer>, ApiError> {
    let now = st.now_ms();
    let token = crate::edge::auth::bearer_token(&headers)
        .ok_or_else(|| ApiError::Unauthorized("missing bearer token".into()))?;
    if st.shop.is_none() {
        return Err(ApiError::NotFound(
            "shop sign-in is off (--auth-issuer): there is no shop token to exchange".into(),
        ));
    }
    if !crate::edge::auth::shop::looks_like_jwt(token) {
        return Err(ApiError::Unauthorized(
            "the bearer must be a shop token (a JWT)".into(),
        ));
    }
    let user_id = crate::edge::auth::user_of(&st, &headers, now).await?;
    let ttl_end = now / 1000 + st.config.token_ttl_secs as i64;
    let expires = crate::edge::auth::shop::expiry_of(token).map_or(ttl_end, |exp| exp.min(ttl_end));
    // Accepted within the clock leeway, yet already past: nothing worth issuing.
    if expires <= now / 1000 {
        return Err(ApiError::Unauthorized(
            "shop token: expired: exp is past".into(),
        ));
    }
    st.metrics.tokens_issued.fetch_add(1, Ordering::Relaxed);
    Ok(Json(LoginAnswer {
        token: st.tokens.sign(user_id, expires),
        user_id: user_id.to_string(),
    }))
}
