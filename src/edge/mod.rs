//! The HTTP edge: everything that knows of HTTP, grouped by who calls it.
//!
//! - `http/`: the plumbing every call goes through: the front door (`front`), connection
//!   limits and timeouts, CORS, rate limits, reading input (`input`), and the one mapping
//!   of every error to the contract's `{code, message}` (`error`).
//! - `auth`: tokens (HMAC, verified without a lookup), the buyer and admin extractors, the
//!   guard against guessed secrets.
//! - `buyer/`: logging in, the catalogue, purchases and orders, paying and cancelling.
//! - `antibot/`: purchase tokens and captchas.
//! - `admin/`: managing sales; their books (stats, audit, journal, reconciliation).
//! - `provider`: the payment provider's signed callback; `simulated`: the simulated one.
//! - `ops`: health, readiness, metrics, the OpenAPI document (`openapi`, from the types).
//! - `pages/`: the web pages, static shells over the JSON API.
//!
//! The edge never writes SQL on the purchase path and never decides a purchase itself
//! beyond shortcuts the gate would answer the same way.

pub mod admin;
pub mod antibot;
pub mod auth;
pub mod buyer;
pub mod http;
pub mod idempotency;
pub mod openapi;
pub mod ops;
pub mod pages;
pub mod provider;
pub mod simulated;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use crate::config::Config;
use crate::gate::Gate;
use crate::ids::IdGenerator;
use crate::loader::SaleCache;
use crate::metrics::{render_counter, Counter, Histogram};
use crate::model::Sale;
use crate::store::Store;
use crate::writer::WriterStats;
use auth::TokenSigner;
use http::error::{ApiError, ErrorResponse};
use http::input::SaleId;
pub use http::{connections, limits};

/// Largest request body accepted; every call of the contract fits in far less.
pub const MAX_BODY_BYTES: usize = 16 * 1024;

/// Longest a call may take before it is answered 503 `unavailable`.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

pub struct AppState {
    pub config: Arc<Config>,
    pub store: Store,
    pub gate: Arc<dyn Gate>,
    pub ids: Arc<IdGenerator>,
    pub tokens: TokenSigner,
    /// The admin API keys, as this instance holds them.
    pub api_keys: Arc<auth::keys::ApiKeys>,
    /// The shop's own tokens, when shop sign-in is configured (`--auth-issuer`).
    pub shop: Option<Arc<auth::shop::ShopTokens>>,
    /// Who takes payments; `None`: paying answers 503 `payment_unavailable`.
    pub payments: Option<Arc<dyn crate::lifecycle::payment::PaymentProvider>>,
    /// The built-in simulated provider, when it is the one configured (its pay page, and
    /// the admin call that has it call back); `None` otherwise.
    pub simulator: Option<crate::lifecycle::payment::SimulatedProvider>,
    /// Guesses of the admin and metrics tokens, throttled per client address.
    pub secret_guard: auth::SecretGuard,
    pub sales: Arc<SaleCache>,
    pub redis: Option<crate::redis_client::RedisConn>,
    /// What waits in the order log (the local log, the Redis streams, or nothing).
    pub backlog: Arc<dyn crate::orderlog::Backlog>,
    pub writer_stats: Arc<WriterStats>,
    pub address_limiter: limits::AddressLimiter,
    /// Captchas issued per (sale, user), in this process (`antibot::CAPTCHA_RATE`).
    pub captcha_limiter: limits::RateTable<(i64, i64)>,
    pub connections: Arc<connections::Connections>,
    /// The Redis gate's circuit breaker (distributed only), for readiness and metrics.
    pub breaker: Option<Arc<crate::gate::breaker::Breaker>>,
    /// The gate's sold-out shortcut (also inside `gate`), for its metrics.
    pub sold_out: Arc<crate::gate::soldout::SoldOutShortcut>,
    pub metrics: Metrics,
    /// Drift the continuous audit found (filled on the instance holding the audit lease).
    pub audit: Arc<crate::reconcile::auditor::Board>,
    /// The sales' waiting rooms (see `room`).
    pub rooms: Arc<crate::room::Rooms>,
    /// Whether the database and Redis answer (see `health`).
    pub health: Arc<crate::health::Health>,
}

/// What the edge measures, for `/metrics`.
pub struct Metrics {
    purchases: [Counter; PURCHASE_CODES.len()],
    /// Purchase requests, from the handler's start to its answer.
    pub request_seconds: Histogram,
    /// The gate's decision alone.
    pub gate_seconds: Histogram,
    pub tokens_issued: AtomicU64,
    pub captchas_issued: AtomicU64,
    pub captchas_failed: AtomicU64,
    pub captchas_limited: AtomicU64,
    /// Wrong login codes sent.
    pub login_failures: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            purchases: Default::default(),
            request_seconds: Histogram::new(crate::metrics::LATENCY_BUCKETS),
            gate_seconds: Histogram::new(crate::metrics::LATENCY_BUCKETS),
            tokens_issued: AtomicU64::new(0),
            captchas_issued: AtomicU64::new(0),
            captchas_failed: AtomicU64::new(0),
            captchas_limited: AtomicU64::new(0),
            login_failures: AtomicU64::new(0),
        }
    }
}

/// The purchase answers counted apart, for `/metrics` and the dashboard.
pub const PURCHASE_CODES: [&str; 18] = [
    "ok",
    "pending",
    "not_loaded",
    "sold_out",
    "already_purchased",
    "not_started",
    "ended",
    "paused",
    "invalid_request",
    "not_found",
    "unavailable",
    "rate_limited",
    "unauthorized",
    "token_required",
    "token_invalid",
    "token_used",
    "queue_pass_required",
    "other",
];

impl Metrics {
    /// Its series in Prometheus text: answers by code, latencies, anti-bot and login counts.
    pub fn render(&self, out: &mut String) {
        out.push_str("# HELP seckill_purchases_total Purchase answers by code.\n# TYPE seckill_purchases_total counter\n");
        for code in PURCHASE_CODES {
            let n = self.purchases(code);
            out.push_str(&format!("seckill_purchases_total{{code=\"{code}\"}} {n}\n"));
        }
        self.request_seconds.render(
            "seckill_purchase_request_seconds",
            "Purchase request latency.",
            out,
        );
        self.gate_seconds.render(
            "seckill_gate_seconds",
            "Latency of the gate's decision.",
            out,
        );
        render_counter(
            "seckill_login_failures_total",
            "Wrong login codes sent.",
            self.login_failures.load(Ordering::Relaxed),
            out,
        );
        for (name, help, v) in [
            (
                "seckill_purchase_tokens_issued_total",
                "Anti-bot purchase tokens issued.",
                &self.tokens_issued,
            ),
            (
                "seckill_captchas_issued_total",
                "Captcha pictures issued.",
                &self.captchas_issued,
            ),
            (
                "seckill_captchas_failed_total",
                "Token requests refused for a missing, wrong, reused or expired captcha.",
                &self.captchas_failed,
            ),
            (
                "seckill_captchas_limited_total",
                "Captcha requests refused because the buyer asked for too many (429).",
                &self.captchas_limited,
            ),
        ] {
            render_counter(name, help, v.load(Ordering::Relaxed), out);
        }
    }

    /// Purchases answered with `code` since this instance started.
    pub fn purchases(&self, code: &str) -> u64 {
        PURCHASE_CODES
            .iter()
            .position(|c| *c == code)
            .map_or(0, |i| self.purchases[i].get())
    }

    pub fn count_purchase(&self, code: &str) {
        let i = PURCHASE_CODES
            .iter()
            .position(|c| *c == code)
            .unwrap_or(PURCHASE_CODES.len() - 1);
        self.purchases[i].add(1);
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    let simulated = state.simulator.is_some();
    // The creating calls that honour `Idempotency-Key`.
    let once = axum::middleware::from_fn_with_state(state.clone(), idempotency::idempotent);
    let routes = Router::new()
        .route("/api/auth/code", post(buyer::login::request_code))
        .route("/api/auth/login", post(buyer::login::login))
        .route("/api/auth/me", get(buyer::login::me))
        .route("/api/auth/exchange", post(buyer::login::exchange))
        .route("/api/sales", get(buyer::catalogue::list_sales))
        .route("/api/sales/{id}", get(buyer::catalogue::get_sale))
        .route("/api/sales/{id}/stock", get(buyer::catalogue::get_stock))
        .route("/api/sales/{id}/purchase", post(purchase))
        .route("/api/sales/{id}/token", get(antibot::token))
        .route("/api/sales/{id}/captcha", get(antibot::captcha))
        .route(
            "/api/sales/{id}/queue",
            post(buyer::queue::join).get(buyer::queue::ticket),
        )
        .route("/api/admin/rooms", get(admin::books::rooms))
        .route("/api/orders", get(buyer::orders::list_orders))
        .route("/api/orders/{id}", get(buyer::orders::get_order))
        .route(
            "/api/orders/{id}/pay",
            post(buyer::payments::pay).layer(once.clone()),
        )
        .route(
            "/api/orders/{id}/cancel",
            post(buyer::payments::cancel).layer(once.clone()),
        )
        .route("/api/payments/notify", post(provider::notify))
        .route(
            "/api/simulated-pay/{id}",
            get(simulated::simulated_intent).post(simulated::simulated_pay),
        )
        .route("/api/time", get(buyer::catalogue::server_time))
        .route("/api/admin/live", get(admin::books::live))
        .route(
            "/api/admin/payments/{id}/simulate",
            post(simulated::simulate),
        )
        .route(
            "/api/admin/sales",
            post(admin::sales::create_sale)
                .get(admin::sales::admin_list_sales)
                .layer(once.clone()),
        )
        .route(
            "/api/admin/sales/{id}",
            axum::routing::patch(admin::sales::edit_sale).delete(admin::sales::delete_sale),
        )
        .route(
            "/api/admin/sales/by-ref/{ref}",
            axum::routing::put(admin::sales::upsert_by_ref),
        )
        .route(
            "/api/admin/sales/{id}/approve",
            post(admin::sales::approve_sale),
        )
        .route("/api/admin/sales/{id}/end", post(admin::sales::end_sale))
        .route(
            "/api/admin/sales/{id}/pause",
            post(admin::sales::pause_sale),
        )
        .route(
            "/api/admin/sales/{id}/resume",
            post(admin::sales::resume_sale),
        )
        .route("/api/admin/sales/{id}/stats", get(admin::books::sale_stats))
        .route("/api/admin/sales/{id}/audit", get(admin::books::sale_audit))
        .route(
            "/api/admin/sales/{id}/reconcile",
            get(admin::books::reconcile).post(admin::books::repair),
        )
        .route(
            "/api/admin/sales/{id}/recount",
            get(admin::books::recount).post(admin::books::start_recount),
        )
        .route("/api/admin/sales/{id}/journal", get(admin::books::journal))
        .route(
            "/api/admin/sales/{id}/order-ids",
            get(admin::books::sale_order_ids),
        )
        .route(
            "/api/admin/keys",
            post(admin::keys::create_key)
                .get(admin::keys::list_keys)
                .layer(once.clone()),
        )
        .route(
            "/api/admin/keys/{id}",
            axum::routing::delete(admin::keys::revoke_key),
        )
        .route("/api/admin/keys/{id}/rotate", post(admin::keys::rotate_key))
        .route("/healthz", get(ops::healthz))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .route("/openapi.json", get(ops::openapi))
        .merge(pages::routes(simulated))
        .fallback(|| async { ApiError::NotFound("no such endpoint".into()) })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed });
    // The per-address limit is applied by the front door, to this router's calls too.
    routes
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            while_database_away,
        ))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            REQUEST_TIMEOUT,
        ))
        .layer(axum::middleware::map_response(json_rejections))
        .with_state(state)
}

/// Purchases whose sale id the front door leaves to the router (percent-escaped).
#[utoipa::path(
    post,
    path = "/api/sales/{id}/purchase",
    tag = "buyer",
    summary = "Buy: one atomic decision",
    description = "409 carries the reason in `code`: sold_out, already_purchased, not_started, ended, paused; 403 token_required, token_invalid, token_used, queue_pass_required; 503 unavailable or not_loaded: nothing was bought.",
    params(SaleId),
    request_body(content = crate::edge::buyer::orders::PurchaseBody, description = "Optional: one unit without a token when left out"),
    responses((status = 200, description = "Bought: the order is accepted (queued until written to SQL)", body = crate::edge::buyer::orders::PurchaseOk), (status = 202, description = "The attempt reached the gate and its answer was lost: it may or may not have bought; GET /api/orders/{order_id} settles it within seconds", body = crate::edge::buyer::orders::PendingView), (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse), (status = 403, response = ErrorResponse), (status = 404, response = ErrorResponse), (status = 409, response = ErrorResponse), (status = 413, response = ErrorResponse), (status = 429, response = ErrorResponse), (status = 503, response = ErrorResponse)),
    security(("user" = []))
)]
async fn purchase(
    State(st): State<Arc<AppState>>,
    Path(sale): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    buyer::orders::purchase(&st, &sale, &headers, body)
        .wait()
        .await
}

/// A call that needs the database, while the health probe finds it away, is answered 503
/// at once, naming it: waiting out the pool would hold the caller for seconds to tell it
/// the same. Purchases (decided by the gate), the catalogue and stock (cached), the
/// waiting room, the pages' files and the operator's endpoints go on.
async fn while_database_away(
    State(st): State<Arc<AppState>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if uses_database(request.uri().path()) {
        if let Some(down) = st.health.database.down(st.now_ms()) {
            return ApiError::Unavailable(format!("{down}; retry shortly")).into_response();
        }
    }
    next.run(request).await
}

/// The calls that read or write SQL on every request.
fn uses_database(path: &str) -> bool {
    const LIVE: [&str; 2] = ["/api/admin/live", "/api/admin/rooms"];
    [
        "/api/auth/",
        "/api/orders",
        "/api/payments/",
        "/api/simulated-pay/",
        "/api/admin/",
    ]
    .iter()
    .any(|prefix| path.starts_with(prefix))
        && !LIVE.contains(&path)
}

/// Axum's own extractor rejections (a bad path, a body over the limit) are plain text;
/// rewrite them into the contract's `{code, message}`.
async fn json_rejections(response: Response) -> Response {
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    let status = response.status();
    if is_json || !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    match status {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::PayloadTooLarge.into_response(),
        StatusCode::NOT_FOUND => ApiError::NotFound("no such endpoint".into()).into_response(),
        StatusCode::METHOD_NOT_ALLOWED => ApiError::MethodNotAllowed.into_response(),
        s if s.is_client_error() => ApiError::invalid(format!("bad request ({s})")).into_response(),
        _ => ApiError::too_slow().into_response(),
    }
}

impl AppState {
    /// Now, by the process's one clock (the store's; see `clock`).
    pub fn now_ms(&self) -> i64 {
        self.store.now_ms()
    }

    /// An approved sale: from this instance's cache, else (approved moments ago on another
    /// instance, or ended long ago) from SQL once; 404 otherwise.
    pub async fn approved_sale(&self, id: i64) -> Result<Arc<Sale>, ApiError> {
        if let Some(s) = self.sales.get(id) {
            return Ok(s);
        }
        match self.store.sale(id).await? {
            Some(s) if s.approved => Ok(Arc::new(s)),
            _ => Err(ApiError::NotFound(format!("sale {id} does not exist"))),
        }
    }
}
