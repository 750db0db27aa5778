//! Operating an instance: liveness, readiness (everything a purchase needs, and writers
//! keeping up), Prometheus metrics (behind a token), and the published contract.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use super::auth::MetricsReader;
use super::http::error::{ApiError, ErrorResponse};
use super::AppState;

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
    // The dependencies as the health probe last saw them (half a second ago at most): an
    // answer at once, even while one of them does not answer at all.
    if let Some(down) = st.health.down(st.now_ms()) {
        return Err(ApiError::Unavailable(down));
    }
    if !st.store.settled() {
        return Err(ApiError::Unavailable(
            "database: its identity changed (a failover); the failover window is being \
             written into the new primary, and writes wait until it is"
                .into(),
        ));
    }
    match tokio::time::timeout(READY_WITHIN, ready_to_sell(&st)).await {
        Ok(ready) => ready.map(|()| "ready"),
        Err(_) => Err(ApiError::Unavailable(format!(
            "redis: the gate and the order log did not answer within {READY_WITHIN:?}"
        ))),
    }
}

/// Longest the gate's and the log's answers are waited for: a probe wants an answer within
/// a second, and a Redis that takes longer is not ready to sell.
const READY_WITHIN: std::time::Duration = std::time::Duration::from_millis(800);

/// What a purchase needs beyond the dependencies answering: the gate's circuit closed, ids,
/// writers keeping up, every open sale loaded.
async fn ready_to_sell(st: &AppState) -> Result<(), ApiError> {
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
    if let Some((sale, age_ms)) = oldest_unwritten(st).await? {
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
    // All of them in one call: a probe every few seconds must not cost a round trip per
    // sale.
    let now = st.now_ms();
    let open: Vec<i64> = st
        .sales
        .all()
        .iter()
        .filter(|sale| sale.begins_at <= now && now < sale.ends_at)
        .map(|sale| sale.id)
        .collect();
    let loaded = st.gate.are_loaded(&open).await;
    if loaded.len() != open.len() {
        return Err(ApiError::Unavailable(
            "the gate did not answer for every open sale".into(),
        ));
    }
    for (sale, loaded) in open.iter().zip(loaded) {
        if !loaded? {
            return Err(ApiError::Unavailable(format!(
                "sale {sale} is not in the gate yet (being loaded or rebuilt)"
            )));
        }
    }
    Ok(())
}

/// Sales whose order log is worth watching: those not ended more than an hour ago.
fn recent_sales(st: &AppState) -> Vec<(i64, i64)> {
    let since = st.now_ms() - 3_600_000;
    st.sales
        .all()
        .iter()
        .filter(|s| s.ends_at > since)
        .map(|s| (s.id, s.segments))
        .collect()
}

/// Per recent sale: (sale, unwritten entries, age of the oldest in ms, 0 when the log does
/// not know it). Empty when no order ever waits (the SQL gates).
async fn order_log_lag(st: &AppState) -> Result<Vec<(i64, i64, i64)>, ApiError> {
    if !st.backlog.holds_orders() {
        return Ok(Vec::new());
    }
    let now = st.now_ms();
    let sales = recent_sales(st);
    let lags = st.backlog.lags(&sales).await?;
    Ok(sales
        .iter()
        .zip(lags)
        .map(|((sale, _), (len, oldest))| (*sale, len, oldest.map_or(0, |t| (now - t).max(0))))
        .collect())
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
    // What this instance runs, for dashboards and `seckill bench --target`; the order log's
    // entry form, to see where a fleet's upgrade stands.
    out.push_str(&format!(
        "# HELP seckill_info This instance's version and gate.\n# TYPE seckill_info gauge\nseckill_info{{version=\"{}\",gate=\"{}\",durability=\"{}\",entry=\"{}\"}} 1\n",
        env!("CARGO_PKG_VERSION"),
        st.config.gate.name(),
        st.config.redis_durability.name(),
        st.config.order_log_entry.name()
    ));
    st.metrics.render(&mut out);
    st.health.render(&mut out);
    st.store.failover().render(&mut out);
    st.writer_stats.render(&mut out);
    if let Some(breaker) = &st.breaker {
        breaker.render(&mut out);
    }
    st.audit.render(&mut out);
    if let Ok(lag) = order_log_lag(&st).await {
        if !lag.is_empty() {
            out.push_str("# HELP seckill_order_log_unwritten Order log entries not yet written to SQL, per sale (an order each; a purchase call's orders each with --order-log-entry batch).\n# TYPE seckill_order_log_unwritten gauge\n");
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
    st.connections.render(&mut out);
    st.secret_guard.render(&mut out);
    st.api_keys.render(&mut out);
    if let Some(shop) = &st.shop {
        shop.render(&mut out);
    }
    st.address_limiter.render(&mut out);
    st.sold_out.render(&mut out);
    st.rooms.render(&mut out);
    crate::gate::batch::render_metrics(&mut out);
    crate::orderlog::local::render_metrics(&mut out);
    crate::store::render_metrics(&mut out);
    if st
        .config
        .redis_url
        .as_deref()
        .is_some_and(crate::redis_client::is_cluster_url)
    {
        crate::redis_client::cluster::render_metrics(&mut out);
    }
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
