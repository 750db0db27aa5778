//! Users and their tokens. Login is a phone number and a one-time code (returned in the
//! answer in dev mode, else sent through the configured SMS hook). Tokens are HMAC-signed
//! and self-contained, so the purchase path verifies them without SQL or Redis. A shop
//! with its own identity provider signs its buyers in with its own tokens instead
//! (`shop`), accepted wherever seckill's are.

use crate::metrics::render_counter;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{header, HeaderMap};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::http::error::ApiError;
use super::http::input::decimal;
use super::limits::RateTable;
use super::AppState;
use crate::gate::RateLimit;

pub mod keys;
pub mod shop;
use shop::Verdict;

type HmacSha256 = Hmac<Sha256>;

/// Wrong secrets (admin token, metrics token) one client address may send once it has
/// sent its `--wrong-token-limit` (5): one a minute, counted on each instance. Guessing a
/// 32-character token at that rate takes longer than the universe has; a person who
/// mistyped it waits a minute.
pub const SECRET_GUESSES_PER_SEC: f64 = 1.0 / 60.0;
/// Addresses tracked at most by the secret guard.
const SECRET_GUARD_KEYS: usize = 100_000;
/// Bytes of the HMAC kept in a token: 128 bits.
const SIG_BYTES: usize = 16;

#[derive(Clone)]
pub struct TokenSigner {
    /// Keyed once: every purchase verifies a token, and keying HMAC hashes two blocks of
    /// its own, half the work of a verification.
    keyed: HmacSha256,
}

impl TokenSigner {
    pub fn new(secret: &str) -> Self {
        TokenSigner {
            // Keys of any length are accepted by HMAC; this cannot fail.
            keyed: <HmacSha256 as Mac>::new_from_slice(secret.as_bytes())
                .unwrap_or_else(|_| unreachable!()),
        }
    }

    /// The MAC of a login token's fields as written in it (`user:{user_id}:{expires_at}`).
    /// Only canonical decimal fields are ever signed, so other spellings never verify.
    fn mac(&self, user_id: &str, expires_at: &str) -> HmacSha256 {
        // One update of the whole message: each update pays for the hash's buffering.
        let mut message = [0u8; 64];
        let mut len = 0;
        for part in [b"user:", user_id.as_bytes(), b":", expires_at.as_bytes()] {
            let end = (len + part.len()).min(message.len());
            message[len..end].copy_from_slice(&part[..end - len]);
            len = end;
        }
        let mut mac = self.keyed.clone();
        mac.update(&message[..len]);
        mac
    }

    fn mac_of(&self, message: &str) -> HmacSha256 {
        let mut mac = self.keyed.clone();
        mac.update(message.as_bytes());
        mac
    }

    /// The hex signature of `message`, for the other self-contained tokens (purchase
    /// tokens, captchas). Callers prefix their messages with their kind, so that no token
    /// of one kind is ever valid as another.
    pub fn sign_message(&self, message: &str) -> String {
        hex(&self.mac_of(message).finalize().into_bytes()[..SIG_BYTES])
    }

    pub fn verify_message(&self, message: &str, sig_hex: &str) -> bool {
        unhex_signature(sig_hex)
            .is_some_and(|sig| self.mac_of(message).verify_truncated_left(&sig).is_ok())
    }

    /// Raw HMAC bytes of `message`, for values derived from the secret (captcha answers).
    pub fn derive(&self, message: &str) -> [u8; 32] {
        self.mac_of(message).finalize().into_bytes().into()
    }

    /// `{user_id}.{expires_at_secs}.{hex signature}`
    pub fn sign(&self, user_id: i64, expires_at_secs: i64) -> String {
        let (user_id, expires) = (user_id.to_string(), expires_at_secs.to_string());
        let sig = self.mac(&user_id, &expires).finalize().into_bytes();
        format!("{user_id}.{expires}.{}", hex(&sig[..SIG_BYTES]))
    }

    /// The user id of a valid, unexpired token. Every purchase verifies one, so the token
    /// is read in one pass, without allocating.
    pub fn verify(&self, token: &str, now_secs: i64) -> Option<i64> {
        let (user_text, rest) = split_at_dot(token)?;
        let (expires_text, sig) = split_at_dot(rest)?;
        let user_id = decimal(user_text)?;
        let expires = decimal(expires_text)?;
        let sig = unhex_signature(sig)?;
        if user_id <= 0 || expires <= now_secs {
            return None;
        }
        self.mac(user_text, expires_text)
            .verify_truncated_left(&sig)
            .ok()?;
        Some(user_id)
    }
}

fn split_at_dot(s: &str) -> Option<(&str, &str)> {
    let dot = s.bytes().position(|b| b == b'.')?;
    Some((&s[..dot], &s[dot + 1..]))
}

pub use crate::text::hex;

/// The value of each hex digit; 0xff for every other byte.
const HEX_VALUE: [u8; 256] = {
    let mut table = [0xff; 256];
    let mut i = 0;
    while i < 10 {
        table[b'0' as usize + i] = i as u8;
        i += 1;
    }
    let mut i = 0;
    while i < 6 {
        table[b'a' as usize + i] = 10 + i as u8;
        table[b'A' as usize + i] = 10 + i as u8;
        i += 1;
    }
    table
};

/// A signature as written in tokens: exactly `SIG_BYTES` bytes in hex.
fn unhex_signature(s: &str) -> Option<[u8; SIG_BYTES]> {
    let s = s.as_bytes();
    if s.len() != 2 * SIG_BYTES {
        return None;
    }
    let mut sig = [0u8; SIG_BYTES];
    let mut invalid = 0;
    for (byte, pair) in sig.iter_mut().zip(s.chunks_exact(2)) {
        let (high, low) = (HEX_VALUE[pair[0] as usize], HEX_VALUE[pair[1] as usize]);
        invalid |= high | low;
        *byte = high << 4 | low;
    }
    // Every invalid character has the high bit set in the table.
    (invalid & 0x80 == 0).then_some(sig)
}

pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The credentials of `Authorization: Bearer ...`; the scheme's name is case-insensitive
/// (RFC 9110, 11.1), so `bearer` and `BEARER` are the same scheme.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let scheme = value.get(..7)?;
    scheme
        .eq_ignore_ascii_case("bearer ")
        .then(|| value[7..].trim())
}

/// Who a request's bearer token names, as far as it can be told without waiting.
pub enum Caller {
    User(i64),
    /// A shop token naming a key not fetched yet: `user_of` fetches the keys and looks again.
    AfterKeyFetch(String),
}

/// The caller behind the request's bearer token at `now_ms`, or 401: one of seckill's own
/// tokens, or a shop token when shop sign-in is on. Never waits.
pub fn caller_of(st: &AppState, headers: &HeaderMap, now_ms: i64) -> Result<Caller, ApiError> {
    let token =
        bearer(headers).ok_or_else(|| ApiError::Unauthorized("missing bearer token".into()))?;
    match &st.shop {
        Some(shop) if shop::looks_like_jwt(token) => match shop.verify(token, now_ms / 1000) {
            Verdict::Buyer(user_id) => Ok(Caller::User(user_id)),
            Verdict::FetchKeys(kid) => Ok(Caller::AfterKeyFetch(kid)),
            Verdict::Refused(shop::Refused::NoKeysYet) => Err(ApiError::Unavailable(
                "the shop's signing keys have not been fetched yet; try again shortly".into(),
            )),
            Verdict::Refused(why) => Err(ApiError::Unauthorized(format!("shop token: {why}"))),
        },
        _ => st
            .tokens
            .verify(token, now_ms / 1000)
            .map(Caller::User)
            .ok_or_else(|| ApiError::Unauthorized("invalid or expired token".into())),
    }
}

/// The credentials of `Authorization: Bearer ...`, if any.
pub fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    bearer(headers)
}

/// The user id behind the request's bearer token at `now_ms`, or 401; fetches the shop's
/// keys first for a token naming one not seen yet.
pub async fn user_of(st: &AppState, headers: &HeaderMap, now_ms: i64) -> Result<i64, ApiError> {
    match caller_of(st, headers, now_ms)? {
        Caller::User(user_id) => Ok(user_id),
        Caller::AfterKeyFetch(kid) => {
            if let Some(shop) = &st.shop {
                shop.fetch_for_unknown_key(&kid).await;
            }
            match caller_of(st, headers, st.now_ms())? {
                Caller::User(user_id) => Ok(user_id),
                Caller::AfterKeyFetch(kid) => {
                    let refused = shop::Refused::UnknownKey(kid);
                    if let Some(shop) = &st.shop {
                        shop.refuse(refused.clone());
                    }
                    Err(ApiError::Unauthorized(format!("shop token: {refused}")))
                }
            }
        }
    }
}

/// The address a request came from (the TCP peer), put in the request's extensions by the
/// front door so that handlers behind the router can throttle by client.
#[derive(Debug, Clone, Copy)]
pub struct PeerAddr(pub IpAddr);

/// Throttles guesses of the server's bearer secrets (the admin token, the metrics token)
/// per client address: after `SECRET_GUESSES.burst` wrong ones, every attempt from that
/// address is answered 429 without being compared, until its bucket refills.
pub struct SecretGuard {
    /// `None`: the guard is off (`--wrong-token-limit 0`).
    wrong: Option<RateTable<IpAddr>>,
    /// Wrong secrets presented, for `/metrics`.
    pub failures: AtomicU64,
    /// Attempts refused with 429 because their address had guessed too often.
    pub throttled: AtomicU64,
}

impl SecretGuard {
    /// Its series in Prometheus text.
    pub fn render(&self, out: &mut String) {
        render_counter(
            "seckill_auth_failures_total",
            "Wrong admin or metrics tokens presented.",
            self.failures.load(Ordering::Relaxed),
            out,
        );
        render_counter(
            "seckill_auth_throttled_total",
            "Requests refused (429) because their address sent too many wrong tokens.",
            self.throttled.load(Ordering::Relaxed),
            out,
        );
    }

    /// A guard letting each address send `burst` wrong secrets, then one a minute; 0 is off.
    pub fn new(burst: u32) -> Self {
        let rate = RateLimit {
            per_sec: SECRET_GUESSES_PER_SEC,
            burst,
        };
        SecretGuard {
            wrong: (burst > 0).then(|| RateTable::new(rate, SECRET_GUARD_KEYS)),
            failures: AtomicU64::new(0),
            throttled: AtomicU64::new(0),
        }
    }

    /// Ok when `given` is one of `accepted`; 401 when it is missing or wrong; 429 (with
    /// Retry-After) when `client` has sent too many wrong ones lately, whatever it sends
    /// now. A missing secret is not a guess: always 401, and it costs nothing.
    pub fn check(
        &self,
        client: IpAddr,
        given: Option<&str>,
        accepted: &[&str],
        what: &str,
        now_ms: i64,
    ) -> Result<(), ApiError> {
        // Every accepted secret is compared, so the time taken says nothing of which one
        // came closest.
        self.check_with(client, given, what, now_ms, |given| {
            accepted.iter().fold(false, |m, secret| {
                m | constant_time_eq(given.as_bytes(), secret.as_bytes())
            })
        })
        .map(|_| ())
    }

    /// The same, with `matches` judging the secret given: its answer when it is Some.
    pub fn check_with<T>(
        &self,
        client: IpAddr,
        given: Option<&str>,
        what: &str,
        now_ms: i64,
        matches: impl FnOnce(&str) -> T,
    ) -> Result<T, ApiError>
    where
        T: Matched,
    {
        let Some(given) = given else {
            return Err(ApiError::Unauthorized(format!("missing or wrong {what}")));
        };
        if let Some(Err(wait_ms)) = self.wrong.as_ref().map(|w| w.check(client, now_ms)) {
            self.throttled.fetch_add(1, Ordering::Relaxed);
            return Err(ApiError::RateLimited {
                retry_after_secs: (wait_ms.max(1) as u64).div_ceil(1000),
                message: "too many wrong tokens from this address; wait before trying again".into(),
            });
        }
        let matched = matches(given);
        if matched.is_match() {
            return Ok(matched);
        }
        self.failures.fetch_add(1, Ordering::Relaxed);
        if let Some(wrong) = &self.wrong {
            let _ = wrong.take(client, now_ms);
        }
        Err(ApiError::Unauthorized(format!("missing or wrong {what}")))
    }
}

/// What a secret check found: whether it matched.
pub trait Matched {
    fn is_match(&self) -> bool;
}

impl Matched for bool {
    fn is_match(&self) -> bool {
        *self
    }
}

impl<T> Matched for Option<T> {
    fn is_match(&self) -> bool {
        self.is_some()
    }
}

/// The client address of a request, as the address limiter names it.
fn client_of(st: &AppState, parts: &Parts) -> IpAddr {
    let peer = parts
        .extensions
        .get::<PeerAddr>()
        .map_or(IpAddr::from([0, 0, 0, 0]), |p| p.0);
    st.address_limiter.client_of(peer, &parts.headers)
}

/// Checks the request's bearer token against `accepted`, throttled per client address.
pub fn check_secret(
    st: &AppState,
    parts: &Parts,
    accepted: &[&str],
    what: &str,
) -> Result<(), ApiError> {
    st.secret_guard.check(
        client_of(st, parts),
        bearer(&parts.headers),
        accepted,
        what,
        st.now_ms(),
    )
}

/// The authenticated caller of a user endpoint.
pub struct AuthUser(pub i64);

impl FromRequestParts<Arc<AppState>> for AuthUser {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<AppState>,
    ) -> Result<Self, ApiError> {
        user_of(state, &parts.headers, state.now_ms())
            .await
            .map(AuthUser)
    }
}

/// The caller of an admin endpoint: the holder of the admin token (every scope), or of an
/// API key with the scope the call needs (`keys::scope_for`).
pub struct Admin {
    /// The key used; `None` for the admin token.
    pub key: Option<keys::KeyHolder>,
}

impl Admin {
    /// The scopes the caller holds.
    pub fn scopes(&self) -> keys::Scopes {
        self.key
            .as_ref()
            .map_or_else(keys::Scopes::all, |k| k.scopes)
    }

    /// Who acted, for the log: the key's name and id, or the admin token.
    pub fn name(&self) -> String {
        self.key.as_ref().map_or_else(
            || "admin token".into(),
            |k| format!("key {} ({})", k.id, k.name),
        )
    }
}

/// The holder of an API key with `scope`, or 401 (an unknown, revoked or wrong key,
/// counted as a guess) or 403 `forbidden` naming the scope.
async fn key_holder(
    st: &AppState,
    parts: &Parts,
    scope: Option<keys::Scope>,
) -> Result<keys::KeyHolder, ApiError> {
    if let Some(text) = bearer(&parts.headers) {
        st.api_keys.learn(text, &st.store).await;
    }
    let now = st.now_ms();
    let holder = st
        .secret_guard
        .check_with(
            client_of(st, parts),
            bearer(&parts.headers),
            "API key",
            now,
            |k| st.api_keys.holder(k, now),
        )
        .inspect_err(|e| {
            if matches!(e, ApiError::Unauthorized(_)) {
                st.api_keys.refused.fetch_add(1, Ordering::Relaxed);
            }
        })?
        .ok_or_else(|| ApiError::Unauthorized("missing or wrong API key".into()))?;
    match scope {
        Some(scope) if holder.scopes.has(scope) => Ok(holder),
        _ => {
            st.api_keys.forbidden.fetch_add(1, Ordering::Relaxed);
            let needed = scope.map_or("one no key holds", keys::Scope::name);
            Err(ApiError::Forbidden {
                code: "forbidden",
                message: format!("this API key lacks the scope {needed}").into(),
            })
        }
    }
}

/// The scope the request's route needs.
fn scope_of(parts: &Parts) -> Option<keys::Scope> {
    let route = parts
        .extensions
        .get::<axum::extract::MatchedPath>()
        .map_or(parts.uri.path(), |m| m.as_str());
    keys::scope_for(&parts.method, route)
}

impl FromRequestParts<Arc<AppState>> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<AppState>,
    ) -> Result<Self, ApiError> {
        if bearer(&parts.headers).is_some_and(keys::looks_like_key) {
            let key = key_holder(state, parts, scope_of(parts)).await?;
            return Ok(Admin { key: Some(key) });
        }
        let Some(expected) = &state.config.admin_token else {
            return Err(ApiError::Unauthorized(
                "the admin API takes API keys (sk_...) here: set SECKILL_ADMIN_TOKEN to make \
                 the first one"
                    .into(),
            ));
        };
        check_secret(state, parts, &[expected], "admin token").map(|()| Admin { key: None })
    }
}

/// A caller allowed to read `/metrics`: anyone when `--metrics-public` (or dev mode) is
/// set, else the holder of the metrics token or the admin token.
pub struct MetricsReader;

impl FromRequestParts<Arc<AppState>> for MetricsReader {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<AppState>,
    ) -> Result<Self, ApiError> {
        let c = &state.config;
        if c.metrics_public || c.dev {
            return Ok(MetricsReader);
        }
        if bearer(&parts.headers).is_some_and(keys::looks_like_key) {
            return key_holder(state, parts, Some(keys::Scope::Metrics))
                .await
                .map(|_| MetricsReader);
        }
        let accepted: Vec<&str> = [&c.metrics_token, &c.admin_token]
            .into_iter()
            .flatten()
            .map(String::as_str)
            .collect();
        if accepted.is_empty() {
            return Err(ApiError::Unauthorized(
                "/metrics is closed: set --metrics-token (or the admin token) and scrape with \
                 it, or --metrics-public"
                    .into(),
            ));
        }
        check_secret(state, parts, &accepted, "metrics token").map(|()| MetricsReader)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, v.parse().unwrap());
            bearer(&h).map(str::to_string)
        };
        for v in ["Bearer abc", "bearer abc", "BEARER abc", "bEaReR  abc "] {
            assert_eq!(with(v).as_deref(), Some("abc"), "{v}");
        }
        for v in ["Basic abc", "Bearerabc", "abc", "Bearer"] {
            assert_eq!(with(v), None, "{v}");
        }
    }

    #[test]
    fn tokens_verify_and_resist_forgery() {
        let s = TokenSigner::new("secret");
        let t = s.sign(42, 2_000);
        assert_eq!(s.verify(&t, 1_000), Some(42));
        assert_eq!(s.verify(&t, 2_000), None, "expired");
        assert_eq!(
            TokenSigner::new("other").verify(&t, 1_000),
            None,
            "other key"
        );
        let forged = t.replacen("42.", "43.", 1);
        assert_eq!(s.verify(&forged, 1_000), None, "user id changed");
        let longer = t.replacen(".2000.", ".9999.", 1);
        assert_eq!(s.verify(&longer, 1_000), None, "expiry changed");
        for respelled in [
            t.replacen("42.", "042.", 1),
            t.replacen("42.", "+42.", 1),
            t.replacen("42.", " 42.", 1),
        ] {
            assert_eq!(
                s.verify(&respelled, 1_000),
                None,
                "{respelled}: same number, other text"
            );
        }
        let upper = format!("{}{}", &t[..8], t[8..].to_uppercase());
        assert_eq!(
            s.verify(&upper, 1_000),
            Some(42),
            "hex is hex in either case"
        );
        let sig = t.rsplit('.').next().unwrap();
        for junk in [
            "",
            "a.b.c",
            "42.2000",
            "42.2000.zz",
            "42.2000.00.00",
            "-1.2000.00",
            &format!("42.2000.{sig}.00"),
            &format!("42..{sig}"),
            &format!(".2000.{sig}"),
            &format!("99999999999999999999.2000.{sig}"),
            &format!("42.2000.{}g", &sig[..31]),
            &format!("42.2000.{}", &sig[..30]),
        ] {
            assert_eq!(s.verify(junk, 1_000), None, "{junk}");
        }
    }

    #[test]
    fn secret_guesses_are_throttled_per_address_and_never_compared_once_over() {
        let g = SecretGuard::new(5);
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let t = 1_000_000;
        assert!(g.check(a, Some("right"), &["right"], "token", t).is_ok());
        for _ in 0..5 {
            assert!(matches!(
                g.check(a, Some("wrong"), &["right"], "token", t),
                Err(ApiError::Unauthorized(_))
            ));
        }
        match g.check(a, Some("right"), &["right"], "token", t) {
            Err(ApiError::RateLimited {
                retry_after_secs, ..
            }) => assert!((1..=60).contains(&retry_after_secs)),
            other => panic!("the right token is not even compared once over: {other:?}"),
        }
        assert!(
            g.check(b, Some("right"), &["right"], "token", t).is_ok(),
            "another address is not affected"
        );
        assert!(
            matches!(
                g.check(b, None, &["right"], "token", t),
                Err(ApiError::Unauthorized(_))
            ),
            "no token at all"
        );
        assert!(
            g.check(a, Some("right"), &["x", "right"], "token", t + 61_000)
                .is_ok(),
            "refilled"
        );
        assert_eq!(g.failures.load(Ordering::Relaxed), 5);
        assert_eq!(g.throttled.load(Ordering::Relaxed), 1);
        assert!(
            matches!(
                g.check(a, None, &["right"], "token", t),
                Err(ApiError::Unauthorized(_))
            ),
            "no token is answered 401 even from a throttled address"
        );
        let off = SecretGuard::new(0);
        for _ in 0..100 {
            assert!(off.check(a, Some("wrong"), &["right"], "token", t).is_err());
        }
        assert!(
            off.check(a, Some("right"), &["right"], "token", t).is_ok(),
            "off"
        );
    }
}
