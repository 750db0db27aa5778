//! Operating an instance: liveness, readiness (everything a purchase needs, and writers
//! keeping up), Prometheus metrics (behind a token), and the published contract.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use super::auth::MetricsReader;
use super::http::error::{ApiError, ErrorResponse};
use super::{AppState, PURCHASE_CODES};
use crate::metrics::render_counter;

#[utoipa::path(
    get,
    path = "/healthz",
    tag = "ops",
    summary = "Liveness",
    responses((status = 200, description = "ok", body = String, content_type = "text/plain"))
)]
pub async fn healthz() -> &'static str {
    "ok"
}

#[utoipa::path(
    get,
    path = "/readyz",
    tag = "ops",
    summary = "Readiness: database and Redis reachable, the gate serving, writers keeping up",
    responses((status = 200, description = "ready", body = String, content_type = "text/plain"), (status = 503, response = ErrorResponse))
)]
pub async fn readyz(State(st): State<Arc<AppState>>) -> Result<&'static str, ApiError> {
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

#[utoipa::path(
    get,
    path = "/metrics",
    tag = "ops",
    summary = "Prometheus metrics",
    description = "Needs the metrics token or the admin token as a bearer token, unless the server runs with --metrics-public or in dev mode.",
    responses((status = 200, description = "Prometheus text, version 0.0.4", body = String, content_type = "text/plain"), (status = 401, response = ErrorResponse), (status = 429, response = ErrorResponse))
)]
pub async fn metrics(_: MetricsReader, State(st): State<Arc<AppState>>) -> Response {
    let mut out = String::new();
    out.push_str("# HELP seckill_purchases_total Purchase answers by code.\n# TYPE seckill_purchases_total counter\n");
    for code in PURCHASE_CODES {
        let n = st.metrics.purchases(code);
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

#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "ops",
    summary = "This document",
    responses((status = 200, description = "OpenAPI 3.1", body = Object))
)]
pub async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        super::openapi::document(),
    )
        .into_response()
}
