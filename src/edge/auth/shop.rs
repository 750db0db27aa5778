//! The shop's own buyer tokens: JWTs from the shop's OIDC issuer (keys from its JWKS, a
//! JWKS file, or an HS256 secret shared with it), accepted wherever seckill's own token is.
//!
//! A buyer is the pair (issuer, subject). Its id is derived from the pair (`buyer_id`), so
//! that every instance names the same person the same way without asking SQL or Redis on
//! the purchase path; the pair is recorded in SQL once, in the background, at its first
//! token. A token is verified once per instance and then found in a cache keyed by its
//! SHA-256, until it expires or the issuer's keys change.
//!
//! The algorithm is the key's, never the token's: a token whose `alg` differs from its
//! key's is refused (no `none`, no HS256 token "signed" with an RSA public key).
//!
//! What it must never do: fetch keys on a purchase's path except once for a key id it has
//! not seen (at most once every `REFETCH_AT_MOST_EVERY`), hold a lock across a fetch that a
//! verification waits on, or accept a token on the word of its own header.

use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use base64::Engine;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, JwkSet, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use crate::config::Config;
use crate::metrics::render_counter;
use crate::store::Store;

/// Longest token read: a JWT from an identity provider is one or two kilobytes; anything
/// much larger is refused before it is decoded.
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;
/// Keys fetched again on a schedule, so that a retired key stops working without a token
/// asking for a new one.
const REFRESH_EVERY: Duration = Duration::from_secs(300);
/// An unknown key id fetches the keys again at most this often: a storm of tokens naming a
/// made-up key must not become a storm of fetches at the issuer.
pub const REFETCH_AT_MOST_EVERY: Duration = Duration::from_secs(5);
/// One fetch of the discovery document or the key set, connection included.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest key set or discovery document read.
const MAX_DOCUMENT_BYTES: usize = 1024 * 1024;
/// Verified tokens kept per shard of the cache (64 shards: two million tokens, about
/// 150 MB at most). A full shard first drops its expired tokens, then all of them.
const CACHE_SHARD_TOKENS: usize = 32 * 1024;
const CACHE_SHARDS: usize = 64;
/// Longest subject recorded (the column's width).
const MAX_SUBJECT_BYTES: usize = 255;
/// Buyers waiting to be recorded in SQL at most; more are recorded at their next token.
const MAX_PENDING_BUYERS: usize = 100_000;
/// Buyers known to be recorded, remembered at most (then forgotten all at once, and
/// recorded again, harmlessly, at their next token).
const MAX_REMEMBERED_BUYERS: usize = 4_000_000;
/// How often the buyers seen are recorded, and the schedule checked.
const TICK: Duration = Duration::from_millis(250);

/// Why a shop token was refused: each names the check it failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("the token is longer than {MAX_TOKEN_BYTES} bytes")]
    TooLarge,
    #[error("the token is not a JWT (header.payload.signature, base64url)")]
    Malformed,
    #[error("alg `none` is refused: shop tokens must be signed")]
    AlgNone,
    #[error("alg `{0}` is not supported (RS256, ES256, EdDSA, HS256 and their kin)")]
    UnsupportedAlg(String),
    #[error("the token's alg {token:?} is not its key's {key:?}")]
    AlgMismatch { token: Algorithm, key: Algorithm },
    #[error("unknown key id {0:?}: not in the issuer's key set")]
    UnknownKey(String),
    #[error("the token names no key id (kid) and the issuer has several keys")]
    NoKeyId,
    #[error("the signature does not verify: the token was changed or signed by another key")]
    BadSignature,
    #[error("wrong issuer: iss must be {0:?}")]
    WrongIssuer(String),
    #[error("wrong audience: aud must name {0:?}")]
    WrongAudience(String),
    #[error("expired: exp is past")]
    Expired,
    #[error("not yet valid: nbf is in the future")]
    NotYetValid,
    #[error("the token has no exp")]
    NoExpiry,
    #[error("the token has no subject claim {0:?} (a string of at most 255 bytes)")]
    NoSubject(String),
    #[error("the issuer's keys have not been fetched yet")]
    NoKeysYet,
}

/// A verification's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Buyer(i64),
    Refused(Refused),
    /// The token names a key id not in the set: the caller waits for
    /// `fetch_for_unknown_key` and verifies again.
    FetchKeys(String),
}

/// Where the shop's keys come from.
#[derive(Debug, Clone)]
enum KeySource {
    Secret,
    File(PathBuf),
    Url(String),
    /// The issuer's discovery document names the key set's URL.
    Discovery(String),
}

struct ShopKey {
    kid: Option<String>,
    alg: Algorithm,
    key: DecodingKey,
}

/// The keys in use, and the key set they came from (to tell whether a fetch changed them).
#[derive(Default)]
struct KeySet {
    keys: Vec<ShopKey>,
    source: Option<Vec<Jwk>>,
    fetched: bool,
}

impl KeySet {
    fn of_secret(secret: &str) -> Self {
        KeySet {
            keys: vec![ShopKey {
                kid: None,
                alg: Algorithm::HS256,
                key: DecodingKey::from_secret(secret.as_bytes()),
            }],
            source: None,
            fetched: true,
        }
    }

    /// The signing keys of a JWKS: keys for encryption, and of kinds no supported algorithm
    /// uses, are passed over.
    fn of_jwks(set: JwkSet) -> Self {
        let keys = set
            .keys
            .iter()
            .filter(|jwk| {
                !matches!(jwk.common.public_key_use, Some(PublicKeyUse::Encryption))
                    && !matches!(jwk.algorithm, AlgorithmParameters::OctetKey(_))
            })
            .filter_map(|jwk| {
                Some(ShopKey {
                    kid: jwk.common.key_id.clone(),
                    alg: algorithm_of(jwk)?,
                    key: DecodingKey::from_jwk(jwk).ok()?,
                })
            })
            .collect();
        KeySet {
            keys,
            source: Some(set.keys),
            fetched: true,
        }
    }

    fn find(&self, kid: Option<&str>) -> Result<&ShopKey, Refused> {
        match kid {
            // The key named; else a key that names none (an HS256 secret, a set of one).
            Some(kid) => self
                .keys
                .iter()
                .find(|k| k.kid.as_deref() == Some(kid))
                .or_else(|| self.keys.iter().find(|k| k.kid.is_none()))
                .ok_or_else(|| Refused::UnknownKey(kid.to_string())),
            None => match self.keys.as_slice() {
                [only] => Ok(only),
                [] => Err(Refused::UnknownKey(String::new())),
                _ => Err(Refused::NoKeyId),
            },
        }
    }
}

/// The algorithm a key is for: its `alg` when it names one, else the one its kind and curve
/// allow (RSA keys without `alg` are taken as RS256, the OIDC default).
fn algorithm_of(jwk: &Jwk) -> Option<Algorithm> {
    if let Some(alg) = jwk.common.key_algorithm {
        return format!("{alg:?}").parse().ok();
    }
    match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => Some(Algorithm::RS256),
        AlgorithmParameters::EllipticCurve(p) => match p.curve {
            EllipticCurve::P256 => Some(Algorithm::ES256),
            EllipticCurve::P384 => Some(Algorithm::ES384),
            _ => None,
        },
        AlgorithmParameters::OctetKeyPair(p) => {
            (p.curve == EllipticCurve::Ed25519).then_some(Algorithm::EdDSA)
        }
        AlgorithmParameters::OctetKey(_) => None,
    }
}

/// A verified token: whose, until when (its `exp` plus the leeway, seconds), and a
/// fingerprint of its header and payload.
#[derive(Clone, Copy)]
struct Verified {
    user_id: i64,
    good_until: i64,
    message: u64,
}

/// The first 32 characters of a token's signature: 192 bits or more of a value nobody can
/// produce without the signing key or the token itself.
type SignaturePrefix = [u8; 32];

type Shard = Mutex<HashMap<SignaturePrefix, Verified, foldhash::quality::RandomState>>;

/// Tokens already verified, found by their signature. A hit needs the first 32 characters
/// of a signature that verified, which only a holder of that very token has, and it gives
/// what that token gives; the header and payload must also be the ones verified (a seeded
/// 64-bit fingerprint), so that a token changed anywhere is verified from scratch and
/// refused. A lookup costs the sold-out path about 1 µs, mostly the table's cache misses
/// (ADR 0008); exchanging the token at sign-in avoids it.
struct VerifiedCache {
    shards: Vec<Shard>,
    fingerprint: foldhash::quality::RandomState,
}

impl VerifiedCache {
    fn new() -> Self {
        VerifiedCache {
            shards: (0..CACHE_SHARDS).map(|_| Mutex::default()).collect(),
            fingerprint: foldhash::quality::RandomState::default(),
        }
    }

    /// Where a token is kept: its signature's prefix and its message's fingerprint; `None`
    /// for a token too short to be kept (it is verified every time).
    fn place_of(&self, token: &str) -> Option<(SignaturePrefix, u64)> {
        let (message, signature) = token.rsplit_once('.')?;
        let prefix = signature.as_bytes().get(..32)?.try_into().ok()?;
        Some((prefix, self.fingerprint.hash_one(message)))
    }

    fn shard(&self, prefix: &SignaturePrefix) -> &Shard {
        &self.shards[prefix[0] as usize % CACHE_SHARDS]
    }

    fn get(&self, (prefix, message): &(SignaturePrefix, u64), now_secs: i64) -> Option<i64> {
        let shard = self.shard(prefix).lock().unwrap_or_else(|p| p.into_inner());
        shard
            .get(prefix)
            .filter(|v| v.message == *message && v.good_until > now_secs)
            .map(|v| v.user_id)
    }

    fn put(&self, prefix: SignaturePrefix, verified: Verified, now_secs: i64) {
        let mut shard = self
            .shard(&prefix)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if shard.len() >= CACHE_SHARD_TOKENS {
            shard.retain(|_, v| v.good_until > now_secs);
            if shard.len() >= CACHE_SHARD_TOKENS {
                shard.clear();
            }
        }
        shard.insert(prefix, verified);
    }

    fn clear(&self) {
        for shard in &self.shards {
            shard.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
    }
}

/// Buyers seen whose pair is not known to be recorded yet.
#[derive(Default)]
struct PendingBuyers {
    waiting: Vec<(i64, String, String)>,
    recorded: HashSet<i64, foldhash::fast::RandomState>,
}

/// What `/metrics` shows of shop tokens.
#[derive(Default)]
pub struct ShopMetrics {
    pub verified: AtomicU64,
    pub cache_hits: AtomicU64,
    pub refused: AtomicU64,
    pub key_fetches: AtomicU64,
    pub key_fetch_failures: AtomicU64,
    pub buyers_recorded: AtomicU64,
}

/// The verifier of the shop's tokens, one per process.
pub struct ShopTokens {
    issuer: String,
    audience: String,
    subject_claim: String,
    leeway_secs: i64,
    source: KeySource,
    keys: ArcSwap<KeySet>,
    /// Bumped when the keys change: a verification against keys since replaced is not
    /// cached (it would outlive the cache's clearing).
    key_generation: AtomicU64,
    /// When the last fetch started; held across a fetch, so that callers that find one
    /// running wait for it, then see its keys.
    fetching: tokio::sync::Mutex<Option<Instant>>,
    /// The key set's URL, once the discovery document named it.
    jwks_uri: Mutex<Option<String>>,
    cache: VerifiedCache,
    pending: Mutex<PendingBuyers>,
    http: reqwest::Client,
    pub metrics: ShopMetrics,
}

/// The id of the buyer (issuer, subject): 63 bits of the pair's SHA-256, never 0. Ids made
/// by seckill's own generator are another 63-bit space; a pair that ever collides with
/// another is reported when recorded (`Store::register_shop_buyers`).
pub fn buyer_id(issuer: &str, subject: &str) -> i64 {
    let mut h = Sha256::new();
    h.update(b"seckill shop buyer\n");
    // Length first, so that no two pairs give one text.
    h.update((issuer.len() as u64).to_be_bytes());
    h.update(issuer.as_bytes());
    h.update(subject.as_bytes());
    let digest = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    let id = (u64::from_be_bytes(first) >> 1) as i64;
    id.max(1)
}

/// Whether a bearer token is a JWT rather than one of seckill's own (`{id}.{exp}.{hex}`,
/// digits first): a JWT's header is a JSON object, base64url `eyJ`.
pub fn looks_like_jwt(token: &str) -> bool {
    token.starts_with("eyJ")
}

#[derive(Deserialize)]
struct Header {
    alg: String,
    kid: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Audience {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct Claims {
    iss: Option<String>,
    aud: Option<Audience>,
    exp: Option<f64>,
    nbf: Option<f64>,
    #[serde(flatten)]
    rest: HashMap<String, serde_json::Value>,
}

impl ShopTokens {
    /// The verifier the configuration asks for; `None` when shop sign-in is off.
    pub fn from_config(c: &Config) -> Option<Self> {
        let issuer = c.auth_issuer.clone()?;
        let (source, keys) = if let Some(secret) = &c.auth_hs256_secret {
            (KeySource::Secret, KeySet::of_secret(secret))
        } else if let Some(path) = &c.auth_jwks_file {
            (KeySource::File(path.clone()), KeySet::default())
        } else if let Some(url) = &c.auth_jwks_url {
            (KeySource::Url(url.clone()), KeySet::default())
        } else {
            (KeySource::Discovery(issuer.clone()), KeySet::default())
        };
        let http = reqwest::Client::builder()
            .timeout(FETCH_TIMEOUT)
            .redirect(reqwest::redirect::Policy::limited(3))
            .build()
            .ok()?;
        Some(ShopTokens {
            audience: c.auth_audience.clone().unwrap_or_default(),
            subject_claim: c.auth_subject_claim.clone(),
            leeway_secs: c.auth_leeway_secs as i64,
            issuer,
            source,
            keys: ArcSwap::from_pointee(keys),
            key_generation: AtomicU64::new(0),
            fetching: tokio::sync::Mutex::new(None),
            jwks_uri: Mutex::new(None),
            cache: VerifiedCache::new(),
            pending: Mutex::default(),
            http,
            metrics: ShopMetrics::default(),
        })
    }

    /// The buyer behind `token` at `now_secs`.
    pub fn verify(&self, token: &str, now_secs: i64) -> Verdict {
        if token.len() > MAX_TOKEN_BYTES {
            return self.refuse(Refused::TooLarge);
        }
        let place = self.cache.place_of(token);
        if let Some(user_id) = place.as_ref().and_then(|p| self.cache.get(p, now_secs)) {
            self.metrics.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Verdict::Buyer(user_id);
        }
        let generation = self.key_generation.load(Ordering::Acquire);
        match self.verify_afresh(token, now_secs) {
            Ok((verified, subject)) => {
                self.metrics.verified.fetch_add(1, Ordering::Relaxed);
                let same_keys = self.key_generation.load(Ordering::Acquire) == generation;
                if let (Some((prefix, message)), true) = (place, same_keys) {
                    let verified = Verified {
                        message,
                        ..verified
                    };
                    self.cache.put(prefix, verified, now_secs);
                }
                self.note_buyer(verified.user_id, subject);
                Verdict::Buyer(verified.user_id)
            }
            Err(Refused::UnknownKey(kid)) if !matches!(self.source, KeySource::Secret) => {
                Verdict::FetchKeys(kid)
            }
            Err(refused) => self.refuse(refused),
        }
    }

    /// Counts a refusal, and answers it.
    pub fn refuse(&self, refused: Refused) -> Verdict {
        self.metrics.refused.fetch_add(1, Ordering::Relaxed);
        Verdict::Refused(refused)
    }

    fn verify_afresh(&self, token: &str, now_secs: i64) -> Result<(Verified, String), Refused> {
        let header = header_of(token)?;
        let alg = match header.alg.as_str() {
            a if a.eq_ignore_ascii_case("none") => return Err(Refused::AlgNone),
            a => a
                .parse::<Algorithm>()
                .map_err(|_| Refused::UnsupportedAlg(a.chars().take(20).collect()))?,
        };
        let keys = self.keys.load();
        if !keys.fetched {
            return Err(Refused::NoKeysYet);
        }
        let key = keys.find(header.kid.as_deref())?;
        if key.alg != alg {
            return Err(Refused::AlgMismatch {
                token: alg,
                key: key.alg,
            });
        }
        let mut validation = Validation::new(key.alg);
        // Time, issuer and audience are checked below, against the server's clock, each
        // with its own answer.
        validation.validate_exp = false;
        validation.validate_aud = false;
        validation.required_spec_claims.clear();
        let claims = jsonwebtoken::decode::<Claims>(token, &key.key, &validation)
            .map_err(|e| match e.kind() {
                jsonwebtoken::errors::ErrorKind::InvalidSignature
                | jsonwebtoken::errors::ErrorKind::Crypto(_) => Refused::BadSignature,
                jsonwebtoken::errors::ErrorKind::InvalidAlgorithm => Refused::AlgMismatch {
                    token: alg,
                    key: key.alg,
                },
                _ => Refused::Malformed,
            })?
            .claims;
        self.check_claims(&claims, now_secs)?;
        let subject = match claims.rest.get(&self.subject_claim) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Number(n)) => n.to_string(),
            _ => String::new(),
        };
        if subject.is_empty() || subject.len() > MAX_SUBJECT_BYTES {
            return Err(Refused::NoSubject(self.subject_claim.clone()));
        }
        let exp = claims.exp.unwrap_or_default() as i64;
        Ok((
            Verified {
                user_id: buyer_id(&self.issuer, &subject),
                good_until: exp.saturating_add(self.leeway_secs),
                message: 0,
            },
            subject,
        ))
    }

    fn check_claims(&self, c: &Claims, now_secs: i64) -> Result<(), Refused> {
        if c.iss.as_deref() != Some(self.issuer.as_str()) {
            return Err(Refused::WrongIssuer(self.issuer.clone()));
        }
        let audience_named = match &c.aud {
            Some(Audience::One(a)) => a == &self.audience,
            Some(Audience::Many(all)) => all.iter().any(|a| a == &self.audience),
            None => false,
        };
        if !audience_named {
            return Err(Refused::WrongAudience(self.audience.clone()));
        }
        let exp = c.exp.ok_or(Refused::NoExpiry)?;
        if (exp as i64).saturating_add(self.leeway_secs) <= now_secs {
            return Err(Refused::Expired);
        }
        if c.nbf
            .is_some_and(|nbf| (nbf as i64).saturating_sub(self.leeway_secs) > now_secs)
        {
            return Err(Refused::NotYetValid);
        }
        Ok(())
    }

    /// Queues the buyer's pair to be recorded, unless it is known to be.
    fn note_buyer(&self, user_id: i64, subject: String) {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if p.recorded.contains(&user_id) || p.waiting.len() >= MAX_PENDING_BUYERS {
            return;
        }
        p.waiting.push((user_id, self.issuer.clone(), subject));
    }

    /// Fetches the keys again for a token naming a key id not in them, so that a key the
    /// issuer has just published is used at once: waits for the next fetch allowed (one
    /// every `REFETCH_AT_MOST_EVERY`), or for one another caller started meanwhile.
    pub async fn fetch_for_unknown_key(&self, kid: &str) {
        if matches!(self.source, KeySource::Secret) {
            return;
        }
        let asked = Instant::now();
        loop {
            let last = self.fetching.lock().await;
            let known = self.keys.load().find(Some(kid)).is_ok();
            if known || last.is_some_and(|at| at >= asked) {
                return;
            }
            let wait = last.map_or(Duration::ZERO, |at| {
                REFETCH_AT_MOST_EVERY.saturating_sub(at.elapsed())
            });
            if wait.is_zero() {
                return self.fetch_holding(last).await;
            }
            drop(last);
            tokio::time::sleep(wait).await;
        }
    }

    /// Fetches the key set now (the schedule's fetch).
    async fn fetch(&self) {
        if matches!(self.source, KeySource::Secret) {
            return;
        }
        let last = self.fetching.lock().await;
        self.fetch_holding(last).await;
    }

    /// Fetches the key set, holding the fetch lock. Keys that could not be fetched leave the
    /// ones in use as they are.
    async fn fetch_holding(&self, mut last: tokio::sync::MutexGuard<'_, Option<Instant>>) {
        *last = Some(Instant::now());
        self.metrics.key_fetches.fetch_add(1, Ordering::Relaxed);
        match self.fetch_set().await {
            Ok(set) => self.use_keys(set),
            Err(e) => {
                self.metrics
                    .key_fetch_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "cannot fetch the shop's signing keys; the keys fetched before stay in use");
            }
        }
    }

    fn use_keys(&self, set: JwkSet) {
        let current = self.keys.load();
        if current.source.as_ref() == Some(&set.keys) {
            return;
        }
        let keys = KeySet::of_jwks(set);
        let kids: Vec<String> = keys
            .keys
            .iter()
            .map(|k| format!("{}:{:?}", k.kid.as_deref().unwrap_or("-"), k.alg))
            .collect();
        tracing::info!(keys = ?kids, "the shop's signing keys changed");
        self.keys.store(Arc::new(keys));
        self.key_generation.fetch_add(1, Ordering::AcqRel);
        // A retired key's tokens must stop working: everything is verified again.
        self.cache.clear();
    }

    async fn fetch_set(&self) -> Result<JwkSet, String> {
        let text = match &self.source {
            KeySource::Secret => return Err("an HS256 secret has no key set".into()),
            KeySource::File(path) => tokio::fs::read(path)
                .await
                .map_err(|e| format!("{}: {e}", path.display()))?,
            KeySource::Url(url) => self.get(url).await?,
            KeySource::Discovery(issuer) => {
                let url = self.jwks_uri_of(issuer).await?;
                self.get(&url).await?
            }
        };
        serde_json::from_slice::<JwkSet>(&text).map_err(|e| format!("not a JWKS: {e}"))
    }

    async fn jwks_uri_of(&self, issuer: &str) -> Result<String, String> {
        if let Some(uri) = self
            .jwks_uri
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            return Ok(uri);
        }
        #[derive(Deserialize)]
        struct Discovery {
            issuer: String,
            jwks_uri: String,
        }
        let url = format!(
            "{}/.well-known/openid-configuration",
            issuer.trim_end_matches('/')
        );
        let doc: Discovery = serde_json::from_slice(&self.get(&url).await?)
            .map_err(|e| format!("{url}: not an OpenID discovery document: {e}"))?;
        // OpenID Connect Discovery 1.0, 4.3: the document must name the issuer it is for.
        if doc.issuer != issuer {
            return Err(format!(
                "{url} names issuer {:?}, not {issuer:?}",
                doc.issuer
            ));
        }
        *self.jwks_uri.lock().unwrap_or_else(|e| e.into_inner()) = Some(doc.jwks_uri.clone());
        Ok(doc.jwks_uri)
    }

    async fn get(&self, url: &str) -> Result<Vec<u8>, String> {
        let mut response = self
            .http
            .get(url)
            .send()
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        if !response.status().is_success() {
            return Err(format!("{url}: answered {}", response.status()));
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| format!("{url}: {e}"))? {
            body.extend_from_slice(&chunk);
            if body.len() > MAX_DOCUMENT_BYTES {
                return Err(format!("{url}: longer than {MAX_DOCUMENT_BYTES} bytes"));
            }
        }
        Ok(body)
    }

    /// Records the buyers seen, fetches the keys at start (again every five seconds until
    /// they come) and every `REFRESH_EVERY`, until `stop`.
    pub async fn run(self: Arc<Self>, store: Store, mut stop: watch::Receiver<bool>) {
        let mut next_refresh = Instant::now();
        loop {
            if Instant::now() >= next_refresh {
                self.fetch().await;
                next_refresh = Instant::now()
                    + if self.keys.load().fetched {
                        REFRESH_EVERY
                    } else {
                        REFETCH_AT_MOST_EVERY
                    };
            }
            self.record_buyers(&store).await;
            tokio::select! {
                _ = tokio::time::sleep(TICK) => {}
                _ = stop.changed() => {}
            }
            if crate::stop::requested(&mut stop) {
                self.record_buyers(&store).await;
                break;
            }
        }
    }

    async fn record_buyers(&self, store: &Store) {
        let waiting = {
            let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            let mut waiting = std::mem::take(&mut p.waiting);
            waiting.sort_unstable_by_key(|b| b.0);
            waiting.dedup_by_key(|b| b.0);
            waiting.retain(|b| !p.recorded.contains(&b.0));
            waiting
        };
        if waiting.is_empty() {
            return;
        }
        match store.register_shop_buyers(&waiting).await {
            Ok(collided) => {
                for id in collided {
                    tracing::error!(
                        user_id = id,
                        issuer = %self.issuer,
                        "two shop subjects share one buyer id; the first one recorded keeps it"
                    );
                }
                let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
                if p.recorded.len() > MAX_REMEMBERED_BUYERS {
                    p.recorded.clear();
                }
                p.recorded.extend(waiting.iter().map(|b| b.0));
                self.metrics
                    .buyers_recorded
                    .fetch_add(waiting.len() as u64, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::warn!(error = %e, buyers = waiting.len(), "cannot record shop buyers yet");
                let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
                let room = MAX_PENDING_BUYERS.saturating_sub(p.waiting.len());
                p.waiting.extend(waiting.into_iter().take(room));
            }
        }
    }

    /// Its series in Prometheus text.
    pub fn render(&self, out: &mut String) {
        let m = &self.metrics;
        for (name, help, v) in [
            (
                "seckill_shop_tokens_verified_total",
                "Shop tokens verified from scratch (signature and claims).",
                &m.verified,
            ),
            (
                "seckill_shop_tokens_cached_total",
                "Shop tokens found already verified.",
                &m.cache_hits,
            ),
            (
                "seckill_shop_tokens_refused_total",
                "Shop tokens refused.",
                &m.refused,
            ),
            (
                "seckill_shop_key_fetches_total",
                "Fetches of the shop's signing keys.",
                &m.key_fetches,
            ),
            (
                "seckill_shop_key_fetch_failures_total",
                "Fetches of the shop's signing keys that failed (the keys before stay in use).",
                &m.key_fetch_failures,
            ),
            (
                "seckill_shop_buyers_recorded_total",
                "Shop buyers recorded in SQL by this process.",
                &m.buyers_recorded,
            ),
        ] {
            render_counter(name, help, v.load(Ordering::Relaxed), out);
        }
    }
}

/// The `exp` of a token already verified (read again from its payload), seconds.
pub fn expiry_of(token: &str) -> Option<i64> {
    #[derive(Deserialize)]
    struct Exp {
        exp: f64,
    }
    let payload = token.split('.').nth(1)?;
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload)
        .ok()?;
    serde_json::from_slice::<Exp>(&json)
        .ok()
        .map(|e| e.exp as i64)
}

fn header_of(token: &str) -> Result<Header, Refused> {
    let mut parts = token.split('.');
    let (Some(header), Some(_), Some(_), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Refused::Malformed);
    };
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(header)
        .map_err(|_| Refused::Malformed)?;
    serde_json::from_slice(&json).map_err(|_| Refused::Malformed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buyer_id_is_the_pair_and_only_the_pair() {
        let a = buyer_id("https://id.shop", "alice");
        assert_eq!(a, buyer_id("https://id.shop", "alice"));
        assert!(a > 0);
        assert_ne!(a, buyer_id("https://id.shop", "bob"));
        assert_ne!(a, buyer_id("https://id.other", "alice"));
        assert_ne!(
            buyer_id("https://id.shop\nx", "y"),
            buyer_id("https://id.shop", "x\ny"),
            "no pair reads as another"
        );
    }

    #[test]
    fn only_jwts_look_like_jwts() {
        assert!(looks_like_jwt("eyJhbGciOiJSUzI1NiJ9.e30.sig"));
        assert!(!looks_like_jwt("42.2000.00ff"));
    }
}
