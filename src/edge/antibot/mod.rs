//! Anti-bot, per sale: single-use purchase tokens bound to one user and one sale, and the
//! captcha that may stand before them. Tokens and captcha ids are self-contained
//! (`{expires_at_ms}.{nonce}.{hmac}`), so issuing and checking them needs no lookup; a
//! token is spent inside the purchase's own gate call, a captcha on its single guess.
//! Never put a captcha's answer in a response: it is derived from the secret and the
//! nonce, and exists only as pixels.

pub mod captcha;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::response::Response;
use base64::Engine;
use serde::{Deserialize, Serialize};

use super::auth::{AuthUser, TokenSigner};
use super::http::error::{ApiError, ChangeErrors, ErrorResponse};
use super::http::input::{no_store, rfc3339, PathId, SaleId};
use super::AppState;
use crate::gate::Spend;
use crate::model::{AntiBot, Sale};

/// A purchase token is meant for the click right after it is issued.
pub const PURCHASE_TOKEN_TTL_MS: i64 = 60_000;
/// Time for a person to read and type the digits.
pub const CAPTCHA_TTL_MS: i64 = 300_000;
const ANSWER_DIGITS: usize = 5;
/// Captchas one buyer may fetch for one sale: five at once, then one every five seconds.
/// A person retyping a hard picture needs a few; a script farming pictures for an OCR or a
/// solving service gets twelve a minute. Kept per instance.
pub const CAPTCHA_RATE: crate::gate::RateLimit = crate::gate::RateLimit {
    per_sec: 0.2,
    burst: 5,
};
/// Buyers tracked at most by the captcha limit (each costs a few dozen bytes).
pub const CAPTCHA_LIMITER_KEYS: usize = 1_000_000;

#[derive(Clone, Copy)]
enum Kind {
    Purchase,
    Captcha,
    /// A waiting room's pass (see `queue`): not single-use, the nonce is 0.
    Pass,
}

impl Kind {
    fn tag(self) -> &'static str {
        match self {
            Kind::Purchase => "purchase",
            Kind::Captcha => "captcha",
            Kind::Pass => "pass",
        }
    }
}

fn message(kind: Kind, sale_id: i64, user_id: i64, expires_at: i64, nonce: u64) -> String {
    format!("{}:{sale_id}:{user_id}:{expires_at}:{nonce}", kind.tag())
}

/// A fresh single-use nonce; `encode` turns it into the signed text handed out.
fn issue(now: i64, ttl_ms: i64) -> Spend {
    Spend {
        nonce: rand::random(),
        expires_at: now + ttl_ms,
    }
}

fn encode(signer: &TokenSigner, kind: Kind, sale_id: i64, user_id: i64, s: Spend) -> String {
    let sig = signer.sign_message(&message(kind, sale_id, user_id, s.expires_at, s.nonce));
    format!("{}.{}.{sig}", s.expires_at, s.nonce)
}

#[derive(Debug, PartialEq, Eq)]
enum Invalid {
    /// Not ours, forged, or issued for another user or sale.
    Forged,
    Expired,
}

fn decode(
    signer: &TokenSigner,
    kind: Kind,
    sale_id: i64,
    user_id: i64,
    text: &str,
    now: i64,
) -> Result<Spend, Invalid> {
    let mut parts = text.trim().split('.');
    let (Some(exp), Some(nonce), Some(sig), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Invalid::Forged);
    };
    let (Ok(expires_at), Ok(nonce)) = (exp.parse::<i64>(), nonce.parse::<u64>()) else {
        return Err(Invalid::Forged);
    };
    if !signer.verify_message(&message(kind, sale_id, user_id, expires_at, nonce), sig) {
        return Err(Invalid::Forged);
    }
    if expires_at <= now {
        return Err(Invalid::Expired);
    }
    Ok(Spend { nonce, expires_at })
}

/// The digits a captcha shows: derived from the secret, so only the server (and tools
/// holding the secret, like tests) can know them without reading the picture.
fn answer(signer: &TokenSigner, sale_id: i64, user_id: i64, nonce: u64) -> String {
    let d = signer.derive(&format!("captcha-answer:{sale_id}:{user_id}:{nonce}"));
    let n = u64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]]);
    format!(
        "{:0width$}",
        n % 10u64.pow(ANSWER_DIGITS as u32),
        width = ANSWER_DIGITS
    )
}

/// The seed of a captcha's picture (its pen, placement and noise), derived from the secret
/// like its answer. Seeded with the nonce alone (which the client holds, inside the
/// captcha id), the picture could be drawn again for each of the 100,000 answers until
/// one matched: solved offline in under two minutes, without reading a pixel.
fn picture_seed(signer: &TokenSigner, sale_id: i64, user_id: i64, nonce: u64) -> u64 {
    let d = signer.derive(&format!("captcha-picture:{sale_id}:{user_id}:{nonce}"));
    u64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}

/// The answer to a captcha id, for tools that hold the token secret (tests, the bench).
pub fn answer_for(secret: &str, sale_id: i64, user_id: i64, captcha_id: &str) -> Option<String> {
    let signer = TokenSigner::new(secret);
    let spend = decode(&signer, Kind::Captcha, sale_id, user_id, captcha_id, 0).ok()?;
    Some(answer(&signer, sale_id, user_id, spend.nonce))
}

/// What the purchase call spends, when the sale asks for a token; checked without I/O.
pub fn purchase_token(
    st: &AppState,
    sale: &Sale,
    user_id: i64,
    token: Option<&str>,
) -> Result<Option<Spend>, ApiError> {
    if sale.anti_bot == AntiBot::Off {
        return Ok(None);
    }
    let Some(text) = token else {
        return Err(ApiError::Forbidden {
            code: "token_required",
            message: "this sale needs a purchase token: GET /api/sales/{id}/token, then send it \
                      as \"token\""
                .into(),
        });
    };
    checked(st, Kind::Purchase, sale.id, user_id, text, "token_invalid").map(Some)
}

/// The pass of a buyer let through a sale's waiting room: bound to the buyer and the sale,
/// valid until `expires_at`; a MAC, no lookup.
pub fn issue_pass(st: &AppState, sale_id: i64, user_id: i64, expires_at: i64) -> String {
    let pass = Spend {
        nonce: 0,
        expires_at,
    };
    encode(&st.tokens, Kind::Pass, sale_id, user_id, pass)
}

/// A sale with a waiting room sells only to a buyer holding their own valid pass: 403
/// `queue_pass_required` when it is missing, forged, expired or another buyer's.
pub fn queue_pass(
    st: &AppState,
    sale: &Sale,
    user_id: i64,
    pass: Option<&str>,
) -> Result<(), ApiError> {
    if sale.waiting_room.is_none() {
        return Ok(());
    }
    let Some(text) = pass else {
        return Err(ApiError::Forbidden {
            code: "queue_pass_required",
            message: "this sale sells through its waiting room: POST /api/sales/{id}/queue, \
                      wait to be let through, then send the pass as \"pass\""
                .into(),
        });
    };
    checked(
        st,
        Kind::Pass,
        sale.id,
        user_id,
        text,
        "queue_pass_required",
    )
    .map(|_| ())
}

/// A purchase token or captcha id of this user and sale, or the 403 that says why not.
fn checked(
    st: &AppState,
    kind: Kind,
    sale_id: i64,
    user_id: i64,
    text: &str,
    code: &'static str,
) -> Result<Spend, ApiError> {
    let what = match kind {
        Kind::Purchase => "purchase token",
        Kind::Captcha => "captcha",
        Kind::Pass => "waiting room pass",
    };
    decode(&st.tokens, kind, sale_id, user_id, text, st.now_ms()).map_err(|e| ApiError::Forbidden {
        code,
        message: match e {
            Invalid::Expired => format!("the {what} has expired; get a new one").into(),
            Invalid::Forged => format!("the {what} is not valid for this user and sale").into(),
        },
    })
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct CaptchaView {
    captcha_id: String,
    /// `data:image/png;base64,...`, ready for an `<img src>`.
    image: String,
    expires_at: String,
}

/// `GET /api/sales/{id}/captcha`: a new picture; each captcha allows one guess.
#[utoipa::path(
    get,
    path = "/api/sales/{id}/captcha",
    tag = "buyer",
    summary = "A captcha picture (captcha sales); one guess each, valid 5 min",
    params(SaleId),
    responses((status = 200, description = "The picture, and the id to answer it with", body = CaptchaView), ChangeErrors),
    security(("user" = []))
)]
pub async fn captcha(
    AuthUser(user_id): AuthUser,
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
) -> Result<Response, ApiError> {
    let sale = st.approved_sale(id).await?;
    if sale.anti_bot != AntiBot::Captcha {
        return Err(ApiError::Conflict(
            "this sale does not ask for a captcha".into(),
        ));
    }
    if st.now_ms() >= sale.ends_at {
        return Err(ApiError::from_rejection(
            crate::gate::Rejection::Ended,
            sale.per_user_limit,
        ));
    }
    if let Err(wait_ms) = st.captcha_limiter.take((sale.id, user_id), st.now_ms()) {
        st.metrics.captchas_limited.fetch_add(1, Ordering::Relaxed);
        return Err(ApiError::RateLimited {
            retry_after_secs: (wait_ms as u64).div_ceil(1000),
            message: "too many captchas for this sale; wait before asking for another".into(),
        });
    }
    let spend = issue(st.now_ms(), CAPTCHA_TTL_MS);
    let digits = answer(&st.tokens, sale.id, user_id, spend.nonce);
    let png = captcha::render(
        &digits,
        picture_seed(&st.tokens, sale.id, user_id, spend.nonce),
    );
    st.metrics.captchas_issued.fetch_add(1, Ordering::Relaxed);
    Ok(no_store(CaptchaView {
        captcha_id: encode(&st.tokens, Kind::Captcha, sale.id, user_id, spend),
        image: format!(
            "data:image/png;base64,{}",
            base64::engine::general_purpose::STANDARD.encode(png)
        ),
        expires_at: rfc3339(spend.expires_at),
    }))
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenQuery {
    captcha_id: Option<String>,
    answer: Option<String>,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct TokenView {
    token: String,
    expires_at: String,
}

/// `GET /api/sales/{id}/token`: a single-use purchase token for the caller and this sale,
/// only while the sale is open, and only for a solved captcha when the sale asks for one.
#[utoipa::path(
    get,
    path = "/api/sales/{id}/token",
    tag = "buyer",
    summary = "A single-use purchase token for the caller and this sale (anti-bot)",
    params(SaleId, ("captcha_id" = Option<String>, Query, description = "The captcha answered, on a captcha sale"), ("answer" = Option<String>, Query, description = "Its five digits")),
    responses((status = 200, description = "Valid 60 s, for one purchase attempt", body = TokenView), (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse), (status = 403, response = ErrorResponse), (status = 404, response = ErrorResponse), (status = 409, response = ErrorResponse), (status = 429, response = ErrorResponse), (status = 503, response = ErrorResponse)),
    security(("user" = []))
)]
pub async fn token(
    AuthUser(user_id): AuthUser,
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
    query: Result<Query<TokenQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    let sale = st.approved_sale(id).await?;
    let now = st.now_ms();
    let limit = sale.per_user_limit;
    if now < sale.begins_at {
        return Err(ApiError::from_rejection(
            crate::gate::Rejection::NotStarted,
            limit,
        ));
    }
    if now >= sale.ends_at {
        return Err(ApiError::from_rejection(
            crate::gate::Rejection::Ended,
            limit,
        ));
    }
    if sale.anti_bot == AntiBot::Captcha {
        solve(&st, &sale, user_id, &query).await.inspect_err(|_| {
            st.metrics.captchas_failed.fetch_add(1, Ordering::Relaxed);
        })?;
    }
    let spend = issue(st.now_ms(), PURCHASE_TOKEN_TTL_MS);
    st.metrics.tokens_issued.fetch_add(1, Ordering::Relaxed);
    Ok(no_store(TokenView {
        token: encode(&st.tokens, Kind::Purchase, sale.id, user_id, spend),
        expires_at: rfc3339(spend.expires_at),
    }))
}

/// Checks a captcha answer. The captcha is spent before the answer is compared, so each
/// picture allows exactly one guess, on every instance.
async fn solve(st: &AppState, sale: &Sale, user_id: i64, q: &TokenQuery) -> Result<(), ApiError> {
    let failed = |message: &str| ApiError::Forbidden {
        code: "captcha_failed",
        message: message.to_string().into(),
    };
    let (Some(id), Some(given)) = (&q.captcha_id, &q.answer) else {
        return Err(ApiError::Forbidden {
            code: "captcha_required",
            message: "this sale needs a solved captcha: GET /api/sales/{id}/captcha, then \
                      pass captcha_id and answer"
                .into(),
        });
    };
    let spend = checked(st, Kind::Captcha, sale.id, user_id, id, "captcha_failed")?;
    if !st.gate.spend(sale.id, spend).await? {
        return Err(failed("this captcha was answered already; get a new one"));
    }
    let expected = answer(&st.tokens, sale.id, user_id, spend.nonce);
    if !super::auth::constant_time_eq(given.trim().as_bytes(), expected.as_bytes()) {
        return Err(failed("wrong answer; get a new captcha"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_bound_to_kind_user_and_sale_and_expire() {
        let signer = TokenSigner::new("secret");
        let now = crate::clock::wall_ms();
        let spend = issue(now, 60_000);
        let text = encode(&signer, Kind::Purchase, 7, 42, spend);
        assert_eq!(
            decode(&signer, Kind::Purchase, 7, 42, &text, now),
            Ok(spend)
        );
        for (kind, sale, user) in [
            (Kind::Purchase, 7, 43),
            (Kind::Purchase, 8, 42),
            (Kind::Captcha, 7, 42),
        ] {
            assert_eq!(
                decode(&signer, kind, sale, user, &text, now),
                Err(Invalid::Forged)
            );
        }
        assert_eq!(
            decode(&signer, Kind::Purchase, 7, 42, &text, now + 60_001),
            Err(Invalid::Expired)
        );
        let other = TokenSigner::new("another secret");
        assert_eq!(
            decode(&other, Kind::Purchase, 7, 42, &text, now),
            Err(Invalid::Forged)
        );
        for junk in ["", "1.2", "a.b.c", "1.2.3.4", &format!("{text}0")] {
            assert_eq!(
                decode(&signer, Kind::Purchase, 7, 42, junk, now),
                Err(Invalid::Forged),
                "{junk}"
            );
        }
    }

    #[test]
    fn answers_are_five_digits_and_only_the_secret_knows_them() {
        let signer = TokenSigner::new("secret");
        let spend = issue(crate::clock::wall_ms(), 60_000);
        let id = encode(&signer, Kind::Captcha, 7, 42, spend);
        let a = answer_for("secret", 7, 42, &id).unwrap();
        assert_eq!(a.len(), 5);
        assert!(a.bytes().all(|b| b.is_ascii_digit()));
        assert_eq!(answer_for("other", 7, 42, &id), None);
        assert_eq!(answer_for("secret", 7, 43, &id), None);
    }
}
