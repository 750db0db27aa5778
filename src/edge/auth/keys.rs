//! Admin API keys with scopes: a catalogue sync job, a read-only dashboard and a person who
//! ends sales early each hold a key of their own, with the scopes they need, revocable on
//! every instance within seconds. The bootstrap admin token (`--admin-token`) keeps every
//! scope, for the first key and for operators who want only it.
//!
//! A key reads `sk_{id}_{secret}`; only the SHA-256 of the secret is stored. Each instance
//! holds the live keys in memory, read again from SQL every `RELOAD_EVERY`, so a revocation
//! anywhere takes effect everywhere within that; last use is noted in memory and written
//! in batches.
//!
//! The scope each admin call needs is declared once, in `scope_for`.
//!
//! What it must never do: keep or log a secret, or let a key grant scopes it lacks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use axum::http::Method;
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use crate::metrics::render_counter;
use crate::store::api_keys::ApiKeyRow;
use crate::store::{Store, StoreError};

/// How often every instance reads the live keys again: a revoked key stops working
/// everywhere within this.
pub const RELOAD_EVERY: Duration = Duration::from_secs(2);
/// The prefix of every key: a leaked one is easy to recognise (and to scan for).
pub const KEY_PREFIX: &str = "sk_";

/// What a key may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    /// List sales, their stats, audit, journal, reconciliation reports, rooms, live figures.
    SalesRead,
    /// Create, edit, delete and approve sales.
    SalesWrite,
    /// Read a sale's orders.
    OrdersRead,
    /// Payments and refunds (the simulated provider's callbacks).
    Payments,
    /// End, pause and resume sales; repair and recount.
    Operations,
    /// Read `/metrics`.
    Metrics,
    /// Create, list, rotate and revoke API keys.
    Keys,
}

impl Scope {
    pub const ALL: [Scope; 7] = [
        Scope::SalesRead,
        Scope::SalesWrite,
        Scope::OrdersRead,
        Scope::Payments,
        Scope::Operations,
        Scope::Metrics,
        Scope::Keys,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scope::SalesRead => "sales:read",
            Scope::SalesWrite => "sales:write",
            Scope::OrdersRead => "orders:read",
            Scope::Payments => "payments",
            Scope::Operations => "operations",
            Scope::Metrics => "metrics",
            Scope::Keys => "keys",
        }
    }

    pub fn parse(name: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|s| s.name() == name)
    }

    fn bit(self) -> u32 {
        1 << Scope::ALL.iter().position(|s| *s == self).unwrap_or(0)
    }
}

/// A set of scopes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Scopes(u32);

impl Scopes {
    pub fn all() -> Scopes {
        Scopes(Scope::ALL.iter().fold(0, |bits, s| bits | s.bit()))
    }

    pub fn has(self, scope: Scope) -> bool {
        self.0 & scope.bit() != 0
    }

    pub fn covers(self, other: Scopes) -> bool {
        self.0 & other.0 == other.0
    }

    pub fn names(self) -> Vec<&'static str> {
        Scope::ALL
            .into_iter()
            .filter(|s| self.has(*s))
            .map(Scope::name)
            .collect()
    }

    /// Scopes from their names; the first unknown name is the error.
    pub fn parse<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Scopes, String> {
        names.into_iter().try_fold(Scopes(0), |acc, name| {
            Scope::parse(name)
                .map(|s| Scopes(acc.0 | s.bit()))
                .ok_or_else(|| name.to_string())
        })
    }

    /// As stored: names separated by spaces.
    pub fn stored(self) -> String {
        self.names().join(" ")
    }
}

/// The scope an admin call needs, by its method and route (as the router matched it);
/// `None` for a route no key may call (none today: every admin route is listed).
pub fn scope_for(method: &Method, route: &str) -> Option<Scope> {
    let read = method == Method::GET || method == Method::HEAD;
    let action = route.rsplit('/').next().unwrap_or("");
    Some(match route {
        "/metrics" => Scope::Metrics,
        r if r.starts_with("/api/admin/keys") => Scope::Keys,
        r if r.starts_with("/api/admin/payments/") => Scope::Payments,
        "/api/admin/sales/{id}/order-ids" => Scope::OrdersRead,
        "/api/admin/live" | "/api/admin/rooms" => Scope::SalesRead,
        r if r.starts_with("/api/admin/sales") && read => Scope::SalesRead,
        "/api/admin/sales"
        | "/api/admin/sales/{id}"
        | "/api/admin/sales/by-ref/{ref}"
        | "/api/admin/sales/{id}/approve" => Scope::SalesWrite,
        r if r.starts_with("/api/admin/sales/")
            && matches!(action, "end" | "pause" | "resume" | "reconcile" | "recount") =>
        {
            Scope::Operations
        }
        _ => return None,
    })
}

/// A live key as each instance holds it.
#[derive(Clone)]
struct LiveKey {
    name: String,
    scopes: Scopes,
    secret_sha256: [u8; 32],
}

/// The caller behind a key.
#[derive(Debug, Clone)]
pub struct KeyHolder {
    pub id: i64,
    pub name: String,
    pub scopes: Scopes,
}

/// A key just made or rotated: the only time its text exists outside its holder.
pub struct NewKey {
    pub row: ApiKeyRow,
    pub text: String,
}

/// A key id this instance does not know reads the keys again at most this often: a key
/// made on another instance works here at once, and made-up ids cost SQL little.
const RELOAD_FOR_UNKNOWN_AT_MOST_EVERY: Duration = Duration::from_millis(250);

/// Every instance's view of the keys.
#[derive(Default)]
pub struct ApiKeys {
    live: ArcSwap<HashMap<i64, LiveKey>>,
    /// When the keys were last read again for an unknown id.
    unknown_reload: tokio::sync::Mutex<Option<std::time::Instant>>,
    /// Held across a reload's read and store, so that the last read is the last stored (an
    /// older read stored after a revocation's would bring the revoked key back).
    reloading: tokio::sync::Mutex<()>,
    /// Last use per key since the last write, ms.
    used: Mutex<HashMap<i64, i64>>,
    pub refused: AtomicU64,
    pub forbidden: AtomicU64,
}

fn sha256(text: &str) -> [u8; 32] {
    Sha256::digest(text.as_bytes()).into()
}

/// (id, secret) of a key's text.
fn parse_key(text: &str) -> Option<(i64, &str)> {
    let rest = text.strip_prefix(KEY_PREFIX)?;
    let (id, secret) = rest.split_once('_')?;
    let id = id.parse().ok().filter(|id| *id > 0)?;
    (!secret.is_empty() && secret.len() <= 128).then_some((id, secret))
}

/// Whether a bearer token is an API key rather than the admin token or a metrics token.
pub fn looks_like_key(token: &str) -> bool {
    token.starts_with(KEY_PREFIX)
}

impl ApiKeys {
    /// Whether any key is live (an admin API without the admin token is open only then).
    pub fn any(&self) -> bool {
        !self.live.load().is_empty()
    }

    /// The holder of a key's text, if it is a live key; notes its use at `now_ms`.
    pub fn holder(&self, text: &str, now_ms: i64) -> Option<KeyHolder> {
        let (id, secret) = parse_key(text)?;
        let live = self.live.load();
        let key = live.get(&id)?;
        if !super::constant_time_eq(&sha256(secret), &key.secret_sha256) {
            return None;
        }
        self.used
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, now_ms);
        Some(KeyHolder {
            id,
            name: key.name.clone(),
            scopes: key.scopes,
        })
    }

    /// Reads the keys again if `text` names a key id this instance does not hold (made on
    /// another instance moments ago), at most every `RELOAD_FOR_UNKNOWN_AT_MOST_EVERY`.
    pub async fn learn(&self, text: &str, store: &Store) {
        let Some((id, _)) = parse_key(text) else {
            return;
        };
        if self.live.load().contains_key(&id) {
            return;
        }
        let mut last = self.unknown_reload.lock().await;
        if last.is_some_and(|at| at.elapsed() < RELOAD_FOR_UNKNOWN_AT_MOST_EVERY) {
            return;
        }
        *last = Some(std::time::Instant::now());
        if let Err(e) = self.reload(store).await {
            tracing::debug!(error = %e, "cannot read the API keys again");
        }
    }

    /// A new key's text and row, not stored yet.
    pub fn mint(id: i64, name: &str, scopes: Scopes, now_ms: i64) -> NewKey {
        let secret = crate::text::hex(&rand::random::<[u8; 32]>());
        NewKey {
            row: ApiKeyRow {
                id,
                name: name.to_string(),
                scopes: scopes.stored(),
                secret_sha256: crate::text::hex(&sha256(&secret)),
                created_at: now_ms,
                rotated_at: None,
                last_used_at: None,
                revoked_at: None,
            },
            text: format!("{KEY_PREFIX}{id}_{secret}"),
        }
    }

    /// A fresh secret for key `id`: (its text, its hash as stored).
    pub fn new_secret(id: i64) -> (String, String) {
        let secret = crate::text::hex(&rand::random::<[u8; 32]>());
        (
            format!("{KEY_PREFIX}{id}_{secret}"),
            crate::text::hex(&sha256(&secret)),
        )
    }

    /// Reads the live keys again from SQL.
    pub async fn reload(&self, store: &Store) -> Result<(), StoreError> {
        let _turn = self.reloading.lock().await;
        let rows = store.live_api_keys().await?;
        let live = rows
            .into_iter()
            .filter_map(|row| {
                let sha = unhex32(&row.secret_sha256)?;
                let scopes = Scopes::parse(row.scopes.split_whitespace()).ok()?;
                Some((
                    row.id,
                    LiveKey {
                        name: row.name,
                        scopes,
                        secret_sha256: sha,
                    },
                ))
            })
            .collect();
        self.live.store(Arc::new(live));
        Ok(())
    }

    async fn write_last_use(&self, store: &Store) {
        let used: Vec<(i64, i64)> =
            std::mem::take(&mut *self.used.lock().unwrap_or_else(|p| p.into_inner()))
                .into_iter()
                .collect();
        if used.is_empty() {
            return;
        }
        if let Err(e) = store.touch_api_keys(&used).await {
            tracing::debug!(error = %e, "cannot note the API keys' last use yet");
            let mut pending = self.used.lock().unwrap_or_else(|p| p.into_inner());
            for (id, at) in used {
                let t = pending.entry(id).or_insert(at);
                *t = (*t).max(at);
            }
        }
    }

    /// Reads the keys again and writes their last use, every `RELOAD_EVERY`, until `stop`.
    pub async fn run(self: Arc<Self>, store: Store, mut stop: watch::Receiver<bool>) {
        loop {
            if let Err(e) = self.reload(&store).await {
                tracing::warn!(error = %e, "cannot read the API keys again; the keys read before stay in use");
            }
            self.write_last_use(&store).await;
            tokio::select! {
                _ = tokio::time::sleep(RELOAD_EVERY) => {}
                _ = stop.changed() => {}
            }
            if crate::stop::requested(&mut stop) {
                self.write_last_use(&store).await;
                break;
            }
        }
    }

    /// Its series in Prometheus text.
    pub fn render(&self, out: &mut String) {
        render_counter(
            "seckill_api_keys_refused_total",
            "API keys presented that are unknown, revoked or wrong.",
            self.refused.load(Ordering::Relaxed),
            out,
        );
        render_counter(
            "seckill_api_keys_forbidden_total",
            "Calls refused (403) because the key lacks the call's scope.",
            self.forbidden.load(Ordering::Relaxed),
            out,
        );
    }
}

fn unhex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_admin_route_needs_a_scope() {
        let router = include_str!("../mod.rs");
        // Each route with the methods its handlers are declared under.
        let routes: Vec<(&str, &str)> = router
            .split(".route(")
            .skip(1)
            .filter_map(|rest| {
                let path = rest.trim_start().strip_prefix('"')?.split('"').next()?;
                Some((path, rest))
            })
            .filter(|(r, _)| r.starts_with("/api/admin") || *r == "/metrics")
            .collect();
        assert!(routes.len() > 15, "{routes:?}");
        for (route, handlers) in routes {
            for (method, word) in [
                (Method::GET, "get("),
                (Method::POST, "post("),
                (Method::PATCH, "patch("),
                (Method::PUT, "put("),
                (Method::DELETE, "delete("),
            ] {
                if handlers.contains(word) {
                    assert!(
                        scope_for(&method, route).is_some(),
                        "{method} {route} has no scope"
                    );
                }
            }
        }
        assert_eq!(
            scope_for(&Method::GET, "/api/admin/sales"),
            Some(Scope::SalesRead)
        );
        assert_eq!(
            scope_for(&Method::POST, "/api/admin/sales"),
            Some(Scope::SalesWrite)
        );
        assert_eq!(
            scope_for(&Method::POST, "/api/admin/sales/{id}/end"),
            Some(Scope::Operations)
        );
        assert_eq!(
            scope_for(&Method::GET, "/api/admin/sales/{id}/reconcile"),
            Some(Scope::SalesRead)
        );
        assert_eq!(
            scope_for(&Method::POST, "/api/admin/sales/{id}/reconcile"),
            Some(Scope::Operations)
        );
    }

    #[test]
    fn a_key_is_its_text_and_only_its_text() {
        let keys = ApiKeys::default();
        let new = ApiKeys::mint(7, "sync", Scopes::parse(["sales:read"]).unwrap(), 1);
        let live = HashMap::from([(
            7,
            LiveKey {
                name: "sync".into(),
                scopes: Scopes::parse(["sales:read"]).unwrap(),
                secret_sha256: unhex32(&new.row.secret_sha256).unwrap(),
            },
        )]);
        keys.live.store(Arc::new(live));
        let holder = keys.holder(&new.text, 5).unwrap();
        assert!(holder.scopes.has(Scope::SalesRead));
        assert!(!holder.scopes.has(Scope::SalesWrite));
        let mut wrong = new.text.clone();
        wrong.pop();
        wrong.push('x');
        assert!(keys.holder(&wrong, 5).is_none());
        assert!(keys
            .holder(&new.text.replace("sk_7_", "sk_8_"), 5)
            .is_none());
        assert!(keys.holder("sk_7", 5).is_none());
        assert!(
            !new.row.secret_sha256.contains(&new.text[5..]),
            "only the hash is stored"
        );
        assert_eq!(Scopes::parse(["sales:read", "nope"]), Err("nope".into()));
        assert!(Scopes::all().covers(Scopes::parse(["keys", "metrics"]).unwrap()));
    }
}
