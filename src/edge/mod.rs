//! The HTTP edge: routes, input parsing, authentication, and the mapping of every error to
//! the contract (see `error`). Handlers live per resource: `auth`, `sales`, `orders`,
//! `payments`; the web pages that use them live in `pages`.
//! The edge never writes SQL on the purchase path and never decides a purchase itself
//! beyond shortcuts the gate would answer the same way.

pub mod antibot;
pub mod auth;
pub mod captcha;
pub mod connections;
pub mod cors;
pub mod error;
pub mod front;
pub mod limits;
pub mod orders;
pub mod pages;
pub mod payments;
pub mod sales;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::de::DeserializeOwned;

use crate::config::Config;
use crate::gate::Gate;
use crate::ids::IdGenerator;
use crate::loader::SaleCache;
use crate::metrics::{render_counter, Counter, Histogram};
use crate::store::Store;
use crate::writer::WriterStats;
use auth::TokenSigner;
use error::ApiError;

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

const PURCHASE_CODES: [&str; 17] = [
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
    "other",
];

impl Metrics {
    pub fn count_purchase(&self, code: &str) {
        let i = PURCHASE_CODES
            .iter()
            .position(|c| *c == code)
            .unwrap_or(PURCHASE_CODES.len() - 1);
        self.purchases[i].add(1);
    }
}

/// For the optional fields of request bodies (`#[serde(default, deserialize_with =
/// "crate::edge::not_null")]`): a field left out takes its default (or, in a change, stays
/// as it is), and `null` is refused, as the published schema says. Read leniently, a
/// change's `null` could mean "clear it" to one client and "leave it" to another.
pub fn not_null<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de>,
{
    match <Option<T> as serde::Deserialize>::deserialize(d)? {
        Some(v) => Ok(Some(v)),
        None => Err(serde::de::Error::custom(
            "null is not a value here: leave the field out instead",
        )),
    }
}

/// Parses a JSON object body into `T`, answering `invalid_request` with serde's reason.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if !crate::is_json_object(body) {
        return Err(ApiError::invalid("the body must be a JSON object"));
    }
    serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))
}

/// A strong ETag for a body: the first 12 bytes of its SHA-256, quoted.
pub fn etag_of(body: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    format!("\"{}\"", auth::hex(&Sha256::digest(body)[..12]))
}

/// Whether the request's If-None-Match names `etag` (or `*`): the client holds it.
pub fn client_holds(headers: &HeaderMap, etag: &str) -> bool {
    headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag || t.trim() == "*"))
}

/// Ids in paths are positive 64-bit integers.
pub fn parse_id(s: &str, what: &str) -> Result<i64, ApiError> {
    // No leading zeros: one id has one spelling, as the published pattern says.
    match decimal(s) {
        Some(id) if id > 0 && !s.starts_with('0') => Ok(id),
        _ => Err(ApiError::invalid(format!(
            "{what} must be a positive 64-bit integer, without leading zeros"
        ))),
    }
}

/// A non-negative decimal integer, digits only, that fits an i64. Every purchase parses
/// two or three (the sale id, the fields of its token): `str::parse` cost twice as much.
pub fn decimal(s: &str) -> Option<i64> {
    if s.is_empty() || s.len() > 19 {
        return None;
    }
    s.bytes().try_fold(0i64, |n, b| {
        let digit = b.wrapping_sub(b'0');
        (digit < 10)
            .then_some(n)?
            .checked_mul(10)?
            .checked_add(digit as i64)
    })
}

pub fn router(state: Arc<AppState>) -> Router {
    let simulated = state.simulator.is_some();
    let routes = Router::new()
        .route("/api/auth/code", post(auth::request_code))
        .route("/api/auth/login", post(auth::login))
        .route("/api/sales", get(sales::list_sales))
        .route("/api/sales/{id}", get(sales::get_sale))
        .route("/api/sales/{id}/stock", get(sales::get_stock))
        .route("/api/sales/{id}/purchase", post(purchase))
        .route("/api/sales/{id}/token", get(antibot::token))
        .route("/api/sales/{id}/captcha", get(antibot::captcha))
        .route("/api/orders", get(orders::list_orders))
        .route("/api/orders/{id}", get(orders::get_order))
        .route("/api/orders/{id}/pay", post(payments::pay))
        .route("/api/orders/{id}/cancel", post(payments::cancel))
        .route("/api/payments/notify", post(payments::notify))
        .route(
            "/api/simulated-pay/{id}",
            get(payments::simulated_intent).post(payments::simulated_pay),
        )
        .route("/api/time", get(server_time))
        .route("/api/admin/live", get(live))
        .route(
            "/api/admin/payments/{id}/simulate",
            post(payments::simulate),
        )
        .route(
            "/api/admin/sales",
            post(sales::create_sale).get(sales::admin_list_sales),
        )
        .route(
            "/api/admin/sales/{id}",
            axum::routing::patch(sales::edit_sale).delete(sales::delete_sale),
        )
        .route("/api/admin/sales/{id}/approve", post(sales::approve_sale))
        .route("/api/admin/sales/{id}/end", post(sales::end_sale))
        .route("/api/admin/sales/{id}/pause", post(sales::pause_sale))
        .route("/api/admin/sales/{id}/resume", post(sales::resume_sale))
        .route("/api/admin/sales/{id}/stats", get(sales::sale_stats))
        .route("/api/admin/sales/{id}/audit", get(sales::sale_audit))
        .route(
            "/api/admin/sales/{id}/reconcile",
            get(sales::reconcile).post(sales::repair),
        )
        .route("/api/admin/sales/{id}/journal", get(sales::journal))
        .route(
            "/api/admin/sales/{id}/order-ids",
            get(sales::sale_order_ids),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .merge(pages::routes(simulated))
        .fallback(|| async { ApiError::NotFound("no such endpoint".into()) })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed });
    // The per-address limit is applied by the front door, to this router's calls too.
    routes
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            REQUEST_TIMEOUT,
        ))
        .layer(axum::middleware::map_response(json_rejections))
        .with_state(state)
}

/// Purchases whose sale id the front door leaves to the router (percent-escaped).
async fn purchase(
    State(st): State<Arc<AppState>>,
    Path(sale): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    orders::purchase(&st, &sale, &headers, body).wait().await
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

async fn readyz(State(st): State<Arc<AppState>>) -> Result<&'static str, ApiError> {
    sqlx::query("SELECT 1")
        .execute(st.store.pool())
        .await
        .map_err(|e| ApiError::Unavailable(format!("database: {e}")))?;
    if let Some(conn) = &st.redis {
        conn.clone()
            .check_health()
            .await
            .map_err(|e| ApiError::Unavailable(format!("redis: {e}")))?;
    }
    if st.breaker.as_ref().is_some_and(|b| b.is_open()) {
        return Err(ApiError::Unavailable("the gate's circuit is open".into()));
    }
    if !st.ids.can_issue() {
        return Err(ApiError::Unavailable(
            "this instance holds no valid worker id lease: it cannot issue order ids".into(),
        ));
    }
    // Orders answered `ok` must reach SQL: an instance whose deployment has no writer (or
    // writers far behind) is not ready, even though it could still take purchases.
    if let Some((sale, age_ms)) = oldest_unwritten(&st).await? {
        if age_ms >= st.config.writer_lag_not_ready_secs as i64 * 1000 {
            return Err(ApiError::Unavailable(format!(
                "orders of sale {sale} have waited {} s to be written to the database: is a \
                 `seckill worker` (or a server with its writer) running?",
                age_ms / 1000
            )));
        }
    }
    // An open sale missing from the gate is being rebuilt (Redis lost it): purchases of it
    // answer `not_loaded` until then.
    let now = crate::now_ms();
    for sale in st.sales.all() {
        if sale.begins_at <= now && now < sale.ends_at && !st.gate.is_loaded(sale.id).await? {
            return Err(ApiError::Unavailable(format!(
                "sale {} is not in the gate yet (being loaded or rebuilt)",
                sale.id
            )));
        }
    }
    Ok("ready")
}

/// Sales whose order log is worth watching: those not ended more than an hour ago.
fn recent_sales(st: &AppState) -> Vec<(i64, i64)> {
    let since = crate::now_ms() - 3_600_000;
    st.sales
        .all()
        .iter()
        .filter(|s| s.ends_at > since)
        .map(|s| (s.id, s.segments))
        .collect()
}

/// Per recent sale: (sale, unwritten orders, age of the oldest in ms, 0 when the log does
/// not know it). Empty when no order ever waits (the SQL gates).
async fn order_log_lag(st: &AppState) -> Result<Vec<(i64, i64, i64)>, ApiError> {
    if !st.backlog.holds_orders() {
        return Ok(Vec::new());
    }
    let now = crate::now_ms();
    let mut out = Vec::new();
    for (sale, segments) in recent_sales(st) {
        let (len, oldest) = st.backlog.lag(sale, segments).await?;
        out.push((sale, len, oldest.map_or(0, |t| (now - t).max(0))));
    }
    Ok(out)
}

/// The sale whose oldest unwritten order has waited longest, and how long.
async fn oldest_unwritten(st: &AppState) -> Result<Option<(i64, i64)>, ApiError> {
    Ok(order_log_lag(st)
        .await?
        .into_iter()
        .filter(|(_, len, _)| *len > 0)
        .map(|(sale, _, age)| (sale, age))
        .max_by_key(|(_, age)| *age))
}

#[derive(serde::Serialize)]
struct ServerTime {
    now: String,
    now_ms: i64,
}

/// `GET /api/time`: the server's clock, so that pages count down to an opening by the
/// clock that decides it, not by the visitor's.
async fn server_time() -> Response {
    let now = crate::now_ms();
    sales::no_store(ServerTime {
        now: sales::rfc3339(now),
        now_ms: now,
    })
}

#[derive(serde::Serialize)]
struct Live {
    now_ms: i64,
    /// Purchase answers of this instance since it started, by code.
    purchases: std::collections::BTreeMap<&'static str, u64>,
    /// Purchase request latency of this instance: (upper bound in seconds, requests at or
    /// under it), cumulative; differences between two readings give the interval's.
    latency_buckets: Vec<(f64, u64)>,
    latency_count: u64,
    writer_orders_written: u64,
}

/// `GET /api/admin/live`: this instance's counters for the dashboard, which turns two
/// readings a second apart into rates and the interval's p99.
async fn live(_: auth::Admin, State(st): State<Arc<AppState>>) -> Response {
    let (latency_buckets, latency_count) = st.metrics.request_seconds.cumulative();
    sales::no_store(Live {
        now_ms: crate::now_ms(),
        purchases: PURCHASE_CODES
            .iter()
            .zip(&st.metrics.purchases)
            .map(|(code, n)| (*code, n.get()))
            .collect(),
        latency_buckets,
        latency_count,
        writer_orders_written: st.writer_stats.written.load(Ordering::Relaxed),
    })
}

async fn metrics(_: auth::MetricsReader, State(st): State<Arc<AppState>>) -> Response {
    let mut out = String::new();
    out.push_str("# HELP seckill_purchases_total Purchase answers by code.\n# TYPE seckill_purchases_total counter\n");
    for (i, code) in PURCHASE_CODES.iter().enumerate() {
        let n = st.metrics.purchases[i].get();
        out.push_str(&format!("seckill_purchases_total{{code=\"{code}\"}} {n}\n"));
    }
    // What this instance runs, for dashboards and `seckill bench --target`.
    out.push_str(&format!(
        "# HELP seckill_info This instance's version and gate.\n# TYPE seckill_info gauge\nseckill_info{{version=\"{}\",gate=\"{}\",durability=\"{}\"}} 1\n",
        env!("CARGO_PKG_VERSION"),
        st.config.gate.name(),
        st.config.redis_durability.name()
    ));
    let m = &st.metrics;
    m.request_seconds.render(
        "seckill_purchase_request_seconds",
        "Purchase request latency.",
        &mut out,
    );
    m.gate_seconds.render(
        "seckill_gate_seconds",
        "Latency of the gate's decision.",
        &mut out,
    );
    let w = &st.writer_stats;
    for (name, help, v) in [
        (
            "seckill_writer_orders_written_total",
            "Orders inserted by this process's writer.",
            &w.written,
        ),
        (
            "seckill_writer_duplicates_total",
            "Redelivered orders found already written.",
            &w.duplicates,
        ),
        (
            "seckill_writer_batches_total",
            "Committed writer batches.",
            &w.batches,
        ),
        (
            "seckill_writer_failed_batches_total",
            "Writer batches that failed.",
            &w.failed_batches,
        ),
        (
            "seckill_writer_dead_letters_total",
            "Order log entries moved to dead letters.",
            &w.dead_letters,
        ),
        (
            "seckill_writer_refused_over_limit_total",
            "Orders SQL refused as over the buyer's limit: a gate fault; alert on any.",
            &w.over_limit,
        ),
    ] {
        render_counter(name, help, v.load(Ordering::Relaxed), &mut out);
    }
    w.batch_orders.render(
        "seckill_writer_batch_orders",
        "Orders per committed writer transaction.",
        &mut out,
    );
    w.lag_seconds.render(
        "seckill_order_log_lag_seconds",
        "From the gate's acceptance to the commit in SQL.",
        &mut out,
    );
    if let Some(b) = &st.breaker {
        render_counter(
            "seckill_gate_circuit_opened_total",
            "Times the Redis gate's circuit opened.",
            b.opened.load(Ordering::Relaxed),
            &mut out,
        );
        render_counter(
            "seckill_gate_circuit_refused_total",
            "Gate calls refused while the circuit was open.",
            b.refused.load(Ordering::Relaxed),
            &mut out,
        );
    }
    let audit = &st.audit;
    render_counter(
        "seckill_reconcile_audits_total",
        "Rounds of the continuous audit of gate against SQL run by this instance.",
        audit.audits.load(Ordering::Relaxed),
        &mut out,
    );
    out.push_str(&format!(
        "# HELP seckill_reconcile_auditing Whether this instance holds the audit lease.\n# TYPE seckill_reconcile_auditing gauge\nseckill_reconcile_auditing {}\n",
        audit.auditing.load(Ordering::Relaxed) as u8
    ));
    render_counter(
        "seckill_reconcile_repairs_total",
        "Gates this instance's audit rebuilt from SQL by itself, after confirming drift.",
        audit.repairs.load(Ordering::Relaxed),
        &mut out,
    );
    let paused = audit.paused();
    if !paused.is_empty() {
        out.push_str("# HELP seckill_reconcile_paused Sales this instance's audit paused because their gate kept drifting from SQL: alert on any.\n# TYPE seckill_reconcile_paused gauge\n");
        for sale in paused.keys() {
            out.push_str(&format!("seckill_reconcile_paused{{sale=\"{sale}\"}} 1\n"));
        }
    }
    let drift = audit.drift();
    if !drift.is_empty() {
        out.push_str("# HELP seckill_reconcile_drift Confirmed differences between a sale's gate and SQL plus what is in flight, by kind (stock units; buyers missing from or unknown to SQL; journal minus stock).\n# TYPE seckill_reconcile_drift gauge\n");
        for (sale, f) in &drift {
            let a = &f.account;
            for (kind, v) in [
                ("stock", a.stock_drift),
                ("buyers_missing", a.buyers_missing),
                ("buyers_unknown", a.buyers_unknown),
                ("journal", a.journal_drift),
            ] {
                out.push_str(&format!(
                    "seckill_reconcile_drift{{sale=\"{sale}\",kind=\"{kind}\"}} {v}\n"
                ));
            }
        }
    }
    if let Ok(lag) = order_log_lag(&st).await {
        if !lag.is_empty() {
            out.push_str("# HELP seckill_order_log_unwritten Orders accepted and not yet written to SQL, per sale.\n# TYPE seckill_order_log_unwritten gauge\n");
            for (sale, len, _) in &lag {
                out.push_str(&format!(
                    "seckill_order_log_unwritten{{sale=\"{sale}\"}} {len}\n"
                ));
            }
            out.push_str("# HELP seckill_order_log_oldest_unwritten_seconds Age of the oldest order not yet written to SQL, per sale (0 when none).\n# TYPE seckill_order_log_oldest_unwritten_seconds gauge\n");
            for (sale, _, age) in &lag {
                out.push_str(&format!(
                    "seckill_order_log_oldest_unwritten_seconds{{sale=\"{sale}\"}} {:.3}\n",
                    *age as f64 / 1000.0
                ));
            }
        }
    }
    let conns = &st.connections;
    out.push_str(&format!(
        "# HELP seckill_connections_open Client connections open now.\n# TYPE seckill_connections_open gauge\nseckill_connections_open {}\n\
         # HELP seckill_connections_max The cap on client connections.\n# TYPE seckill_connections_max gauge\nseckill_connections_max {}\n",
        conns.open(),
        conns.max()
    ));
    render_counter(
        "seckill_connections_saturated_total",
        "Times the connection cap was reached and accepting paused.",
        conns.saturated.load(Ordering::Relaxed),
        &mut out,
    );
    render_counter(
        "seckill_connections_refused_per_address_total",
        "Connections closed at once because their address held its share.",
        conns.refused_per_address(),
        &mut out,
    );
    render_counter(
        "seckill_connections_timed_out_total",
        "Connections closed for being idle, or too slow sending a request's head.",
        conns.timed_out.load(Ordering::Relaxed),
        &mut out,
    );
    render_counter(
        "seckill_auth_failures_total",
        "Wrong admin or metrics tokens presented.",
        st.secret_guard.failures.load(Ordering::Relaxed),
        &mut out,
    );
    render_counter(
        "seckill_auth_throttled_total",
        "Requests refused (429) because their address sent too many wrong tokens.",
        st.secret_guard.throttled.load(Ordering::Relaxed),
        &mut out,
    );
    render_counter(
        "seckill_login_failures_total",
        "Wrong login codes sent.",
        m.login_failures.load(Ordering::Relaxed),
        &mut out,
    );
    render_counter(
        "seckill_rate_limited_addresses_total",
        "Requests refused by the per-address limit.",
        st.address_limiter.limited.load(Ordering::Relaxed),
        &mut out,
    );
    for (name, help, v) in [
        (
            "seckill_purchase_tokens_issued_total",
            "Anti-bot purchase tokens issued.",
            &m.tokens_issued,
        ),
        (
            "seckill_captchas_issued_total",
            "Captcha pictures issued.",
            &m.captchas_issued,
        ),
        (
            "seckill_captchas_failed_total",
            "Token requests refused for a missing, wrong, reused or expired captcha.",
            &m.captchas_failed,
        ),
        (
            "seckill_captchas_limited_total",
            "Captcha requests refused because the buyer asked for too many (429).",
            &m.captchas_limited,
        ),
    ] {
        render_counter(name, help, v.load(Ordering::Relaxed), &mut out);
    }
    render_counter(
        "seckill_sold_out_shortcuts_total",
        "Purchases answered sold_out from this instance's flag, without the gate.",
        st.sold_out.shortcuts.get(),
        &mut out,
    );
    render_counter(
        "seckill_gate_script_calls_total",
        "Purchase script calls to Redis (each decides a batch of attempts).",
        crate::gate::batch::CALLS.load(Ordering::Relaxed),
        &mut out,
    );
    render_counter(
        "seckill_gate_script_attempts_total",
        "Purchase attempts decided by those calls.",
        crate::gate::batch::ATTEMPTS.load(Ordering::Relaxed),
        &mut out,
    );
    render_counter(
        "seckill_gate_durability_waits_total",
        "Accepted batches that waited for --redis-durability (WAITAOF or WAIT).",
        crate::gate::batch::DURABILITY_WAITS.load(Ordering::Relaxed),
        &mut out,
    );
    render_counter(
        "seckill_gate_durability_misses_total",
        "Durability waits not confirmed in time: their buyers were answered pending.",
        crate::gate::batch::DURABILITY_MISSES.load(Ordering::Relaxed),
        &mut out,
    );
    render_counter(
        "seckill_database_errors_total",
        "Database errors seen by this process.",
        crate::store::DB_ERRORS.load(Ordering::Relaxed),
        &mut out,
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        include_str!("openapi.json"),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::parse_id;

    #[test]
    fn ids_are_positive_decimal_i64s_and_nothing_else() {
        assert_eq!(parse_id("42", "id").unwrap(), 42);
        assert_eq!(parse_id("9223372036854775807", "id").unwrap(), i64::MAX);
        for bad in [
            "",
            "0",
            "007",
            "-1",
            "+5",
            " 5",
            "5 ",
            "4a",
            "9223372036854775808",
            "99999999999999999999",
            "１２",
        ] {
            assert!(parse_id(bad, "id").is_err(), "{bad:?}");
        }
    }
}
