//! A sale's books, for the admin and the dashboard: stats, the SQL audit, its order ids
//! and stock journal a page at a time, the reconciliation of gate and SQL and its repair,
//! and this instance's live counters.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;
use axum::Json;
use serde::{Deserialize, Serialize};

use super::super::auth::Admin;
use super::super::http::error::{ApiError, ChangeErrors, ErrorResponse, ReadErrors};
use super::super::http::input::{no_store, parse_json, rfc3339, PathId, SaleId};
use super::super::{AppState, PURCHASE_CODES};

#[derive(Serialize, utoipa::ToSchema)]
pub struct SaleStats {
    id: String,
    initial_stock: i64,
    gate_stock: Option<i64>,
    gate_buyers: Option<i64>,
    /// Orders the gate accepted since it was (last) loaded.
    gate_accepted: Option<i64>,
    sql_stock: i64,
    orders_written: i64,
    units_in_live_orders: i64,
    orders_by_status: std::collections::HashMap<String, i64>,
    payments_by_status: std::collections::HashMap<String, i64>,
    /// Entries of the order log not yet in SQL: an order each, or with
    /// `--order-log-entry batch` the orders of one purchase-script call (0: every accepted
    /// order is in SQL).
    log_backlog: Option<i64>,
    /// Of those, entries a writer holds (read, not yet acknowledged).
    log_pending: Option<i64>,
    dead_letters: Option<i64>,
}

#[utoipa::path(
    get,
    path = "/api/admin/sales/{id}/stats",
    tag = "admin",
    summary = "Gate stock, SQL stock, orders by status, order-log backlog, dead letters",
    params(SaleId),
    responses((status = 200, description = "The sale's numbers", body = SaleStats), ReadErrors),
    security(("admin" = []))
)]
pub async fn sale_stats(
    _: Admin,
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
) -> Result<Json<SaleStats>, ApiError> {
    let sale = st
        .store
        .sale(id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("sale {id} does not exist")))?;
    // Tallies and counters kept by the transactions: a few rows at any size.
    let tallies = st.store.tallies(id).await?;
    let units = st.store.sql_account(id).await?.map_or(0, |a| a.live_units);
    let gate = st.gate.stock(id).await?;
    let backlog = match st.backlog.holds_orders() {
        true => Some(st.backlog.counts(id, sale.segments).await?),
        false => None,
    };
    Ok(Json(SaleStats {
        id: id.to_string(),
        initial_stock: sale.initial_stock,
        gate_stock: gate.map(|g| g.remaining),
        gate_buyers: gate.map(|g| g.buyers),
        gate_accepted: gate.map(|g| g.accepted),
        sql_stock: sale.stock,
        orders_written: tallies.orders_written(),
        units_in_live_orders: units,
        orders_by_status: tallies.orders().into_iter().collect(),
        payments_by_status: tallies.payments().into_iter().collect(),
        log_backlog: backlog.map(|b| b.unwritten),
        log_pending: backlog.map(|b| b.pending),
        dead_letters: backlog.map(|b| b.dead),
    }))
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct Audit {
    id: String,
    initial_stock: i64,
    sql_stock: i64,
    per_user_limit: i64,
    /// Orders in SQL that hold stock (pending payment or paid).
    live_orders: i64,
    live_units: i64,
    distinct_buyers: i64,
    max_units_per_buyer: i64,
    /// Units sold beyond the stock; anything but 0 is a bug.
    oversold: i64,
    /// Entries of the order log not yet in SQL (as in the sale's stats): an order each, or
    /// with `--order-log-entry batch` the orders of one purchase-script call.
    log_backlog: Option<i64>,
}

/// The database's own account of a sale, for load tests and operators: what was sold, to
/// how many buyers, the most any buyer holds. From the counters and tallies the
/// transactions keep (a few rows, whatever the sale holds); the full recount
/// (`/recount`) checks them against the rows.
#[utoipa::path(
    get,
    path = "/api/admin/sales/{id}/audit",
    tag = "admin",
    summary = "The database's account of a sale, from the figures its transactions keep",
    params(SaleId),
    responses((status = 200, description = "Live orders and units, distinct buyers, most units per buyer, oversold, order-log backlog", body = Audit), ReadErrors),
    security(("admin" = []))
)]
pub async fn sale_audit(
    _: Admin,
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
) -> Result<Json<Audit>, ApiError> {
    let sale = st
        .store
        .sale(id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("sale {id} does not exist")))?;
    let tallies = st.store.tallies(id).await?;
    let kept = st
        .store
        .sql_account(id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("sale {id} does not exist")))?;
    let (live_orders, live_units, distinct_buyers, max_units_per_buyer) = (
        tallies.live_orders(),
        kept.live_units,
        kept.live_buyers,
        tallies.most_held(),
    );
    let log_backlog = match st.backlog.holds_orders() {
        true => Some(st.backlog.counts(id, sale.segments).await?.unwritten),
        false => None,
    };
    Ok(Json(Audit {
        id: id.to_string(),
        initial_stock: sale.initial_stock,
        sql_stock: sale.stock,
        per_user_limit: sale.per_user_limit,
        live_orders,
        live_units,
        distinct_buyers,
        max_units_per_buyer,
        oversold: (live_units - sale.initial_stock).max(0),
        log_backlog,
    }))
}

/// `?after=&limit=` of the paged admin lists: after the last id of the previous page.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Page {
    after: Option<i64>,
    limit: Option<i64>,
}

impl Page {
    /// `(after, limit)`, the limit `default` when left out and at most `max`.
    fn bounds(&self, default: i64, max: i64) -> Result<(i64, i64), ApiError> {
        let limit = self.limit.unwrap_or(default);
        if !(1..=max).contains(&limit) {
            return Err(ApiError::invalid(format!(
                "limit must be between 1 and {max}"
            )));
        }
        match self.after.unwrap_or(0) {
            after if after < 0 => Err(ApiError::invalid("after must be an id of the list, or 0")),
            after => Ok((after, limit)),
        }
    }
}

/// The `next` of a page that came back full: its last id.
fn next_after(
    ids: impl DoubleEndedIterator<Item = i64> + ExactSizeIterator,
    limit: i64,
) -> Option<String> {
    let full = ids.len() as i64 == limit;
    ids.last().filter(|_| full).map(|id| id.to_string())
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct OrderIds {
    order_ids: Vec<String>,
    /// Pass as `after` for the next page; absent on the last page.
    next: Option<String>,
}

/// The ids of a sale's live orders, a page at a time (`?after=ID&limit=N`, N <= 100000).
#[utoipa::path(
    get,
    path = "/api/admin/sales/{id}/order-ids",
    tag = "admin",
    summary = "Ids of a sale's live orders, a page at a time",
    params(SaleId, ("after" = Option<i64>, Query, minimum = 0, description = "The last id of the previous page"), ("limit" = Option<i64>, Query, minimum = 1, maximum = 100000, description = "Ids per page (10,000 when left out)")),
    responses((status = 200, description = "A page; `next` is absent on the last", body = OrderIds), ReadErrors),
    security(("admin" = []))
)]
pub async fn sale_order_ids(
    _: Admin,
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
    page: Result<axum::extract::Query<Page>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<OrderIds>, ApiError> {
    let page = page.map_err(|e| ApiError::invalid(format!("bad query: {e}")))?;
    let (after, limit) = page.bounds(10_000, 100_000)?;
    // An unknown (or deleted) sale is 404, not an empty list.
    super::sales::existing_sale(&st, id).await?;
    let ids = st.store.live_order_ids(id, after, limit).await?;
    let next = next_after(ids.iter().copied(), limit);
    Ok(Json(OrderIds {
        order_ids: ids.iter().map(|i| i.to_string()).collect(),
        next,
    }))
}

// ---- reconciliation -----------------------------------------------------------------------

#[derive(Serialize, utoipa::ToSchema)]
pub struct Reconciliation {
    #[serde(flatten)]
    account: crate::reconcile::Account,
    exact: bool,
    /// Drift the continuous audit confirmed (on the instance holding the audit lease).
    drift_confirmed_since: Option<String>,
}

/// `GET /api/admin/sales/{id}/reconcile`: the sale's gate against SQL and what is in flight.
#[utoipa::path(
    get,
    path = "/api/admin/sales/{id}/reconcile",
    tag = "admin",
    summary = "The sale's gate against SQL and what is in flight, and the journal against the stock",
    params(SaleId),
    responses((status = 200, description = "The account; `exact` when nothing differs", body = Reconciliation), ReadErrors),
    security(("admin" = []))
)]
pub async fn reconcile(
    _: Admin,
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
) -> Result<Response, ApiError> {
    let account =
        crate::reconcile::account(&st.store, st.gate.as_ref(), st.backlog.as_ref(), id).await?;
    Ok(no_store(Reconciliation {
        exact: account.exact(),
        account,
        drift_confirmed_since: st.audit.finding(id).map(|f| rfc3339(f.since_ms)),
    }))
}

#[derive(Deserialize, Default, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RepairRequest {
    /// Why, for the journal row the repair leaves.
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(max_length = 200, nullable = false)]
    reason: Option<String>,
}

/// `POST /api/admin/sales/{id}/reconcile {reason?}`: rebuilds the sale's gate from SQL
/// and the order log, and journals who asked and why.
#[utoipa::path(
    post,
    path = "/api/admin/sales/{id}/reconcile",
    tag = "admin",
    summary = "Repair: rebuild the sale's gate from SQL and the order log (fenced), leaving a journal row with who and why",
    params(SaleId),
    request_body(content = RepairRequest, description = "Why, for the journal"),
    responses((status = 200, description = "The account before and after", body = crate::reconcile::Repair), ChangeErrors),
    security(("admin" = []))
)]
pub async fn repair(
    _: Admin,
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let req: RepairRequest = if body.iter().all(crate::is_json_space) {
        RepairRequest::default()
    } else {
        parse_json(&body)?
    };
    let reason = req
        .reason
        .unwrap_or_else(|| "repair asked through the admin API".into());
    if reason.chars().count() > 200 {
        return Err(ApiError::invalid("reason must be at most 200 characters"));
    }
    let sale = st
        .store
        .sale(id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("sale {id} does not exist")))?;
    if !sale.approved {
        return Err(ApiError::Conflict(format!(
            "sale {id} is a draft: it has no gate to repair"
        )));
    }
    // A task of its own: cut short by the request's time limit (a rebuild may wait for
    // writers and for another process's load), a repair would leave its segments to the
    // schedulers and no journal row saying who repaired what.
    let repair = tokio::spawn(async move {
        crate::reconcile::repair(
            &st.store,
            st.gate.as_ref(),
            st.backlog.as_ref(),
            &st.sales,
            &sale,
            "admin api",
            &reason,
        )
        .await
    });
    let done = repair
        .await
        .map_err(|e| ApiError::Unavailable(format!("the repair failed: {e}")))??;
    Ok(no_store(done))
}

/// A full recount of a sale, and how far it got.
#[derive(Serialize, utoipa::ToSchema)]
pub struct RecountJob {
    sale_id: String,
    /// `running`, `done` or `failed`; `none` when the sale was never recounted.
    state: String,
    started_at: Option<String>,
    /// When it last reported: a running job reports every second.
    updated_at: Option<String>,
    orders_read: i64,
    /// The orders the sale held when it began.
    orders_total: i64,
    /// Once done: the gate against the recounted SQL (`account`, `exact`), and whether the
    /// figures the transactions keep disagreed with the rows (and were corrected).
    #[schema(value_type = Option<Object>)]
    outcome: Option<serde_json::Value>,
    /// Once failed: why.
    error: Option<String>,
}

impl From<crate::store::recount::RecountJob> for RecountJob {
    fn from(j: crate::store::recount::RecountJob) -> Self {
        RecountJob {
            sale_id: j.sale_id.to_string(),
            state: j.state,
            started_at: Some(rfc3339(j.started_at)),
            updated_at: Some(rfc3339(j.updated_at)),
            orders_read: j.orders_read,
            orders_total: j.orders_total,
            outcome: j.outcome.and_then(|o| serde_json::from_str(&o).ok()),
            error: j.error,
        }
    }
}

/// `POST /api/admin/sales/{id}/recount`: starts the full recount of the sale in the
/// background and answers at once.
#[utoipa::path(
    post,
    path = "/api/admin/sales/{id}/recount",
    tag = "admin",
    summary = "Start the full recount: every row of the sale counted again in the background (a bounded share of the database), its buyers compared with the gate's one by one, the kept figures checked",
    params(SaleId),
    responses((status = 202, description = "Started; GET the same path for its progress", body = RecountJob), ChangeErrors),
    security(("admin" = []))
)]
pub async fn start_recount(
    _: Admin,
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
) -> Result<(axum::http::StatusCode, Json<RecountJob>), ApiError> {
    super::sales::existing_sale(&st, id).await?;
    let started =
        crate::reconcile::job::start(st.store.clone(), st.gate.clone(), st.backlog.clone(), id)
            .await?;
    if !started {
        return Err(ApiError::Conflict(format!(
            "a recount of sale {id} is running: GET /api/admin/sales/{id}/recount for its progress"
        )));
    }
    let job = st
        .store
        .recount_job(id)
        .await?
        .ok_or_else(|| ApiError::Unavailable("the recount did not record its start".into()))?;
    Ok((axum::http::StatusCode::ACCEPTED, Json(job.into())))
}

/// `GET /api/admin/sales/{id}/recount`: the sale's latest recount, running or ended.
#[utoipa::path(
    get,
    path = "/api/admin/sales/{id}/recount",
    tag = "admin",
    summary = "The sale's latest full recount: how far it got, and once done what it found",
    params(SaleId),
    responses((status = 200, description = "The job", body = RecountJob), ReadErrors),
    security(("admin" = []))
)]
pub async fn recount(
    _: Admin,
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
) -> Result<Response, ApiError> {
    // An unknown (or deleted) sale is 404, whatever a recount left behind.
    super::sales::existing_sale(&st, id).await?;
    let job = match st.store.recount_job(id).await? {
        Some(job) => RecountJob::from(job),
        None => {
            // A sale never recounted has a state too.
            RecountJob {
                sale_id: id.to_string(),
                state: "none".into(),
                started_at: None,
                updated_at: None,
                orders_read: 0,
                orders_total: 0,
                outcome: None,
                error: None,
            }
        }
    };
    Ok(no_store(job))
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct JournalRow {
    id: String,
    segment: Option<i64>,
    delta: i64,
    cause: String,
    /// The order the row moved; absent where the row is not one order's (a writer's
    /// batch, the sale's creation, moves, the gate's trail).
    order_id: Option<String>,
    actor: Option<String>,
    detail: Option<String>,
    at: String,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct Journal {
    sale_id: String,
    /// The sum of every row's delta, and the sale's stock: equal, always.
    sum: i64,
    stock: i64,
    rows: Vec<JournalRow>,
    /// Pass as `after` for the next page; absent on the last page.
    next: Option<String>,
}

/// `GET /api/admin/sales/{id}/journal?after=&limit=`: the sale's stock movements, oldest first.
#[utoipa::path(
    get,
    path = "/api/admin/sales/{id}/journal",
    tag = "admin",
    summary = "The sale's stock journal, oldest first: one row per movement; the rows sum to the stock",
    params(SaleId, ("after" = Option<i64>, Query, minimum = 0, description = "The last row id of the previous page"), ("limit" = Option<i64>, Query, minimum = 1, maximum = 10000, description = "Rows per page (1,000 when left out)")),
    responses((status = 200, description = "A page of rows; `next` is absent on the last", body = Journal), ReadErrors),
    security(("admin" = []))
)]
pub async fn journal(
    _: Admin,
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
    query: Result<axum::extract::Query<Page>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let axum::extract::Query(page) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    let (after, limit) = page.bounds(1000, 10_000)?;
    // The journal's sum as its rows' transactions kept it (the full recount adds the rows).
    let kept = st
        .store
        .sql_account(id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("sale {id} does not exist")))?;
    let (sum, stock) = (kept.journal_sum, kept.stock);
    let entries = st.store.journal(id, after, limit).await?;
    let next = next_after(entries.iter().map(|e| e.id), limit);
    Ok(no_store(Journal {
        sale_id: id.to_string(),
        sum,
        stock,
        rows: entries
            .into_iter()
            .map(|e| JournalRow {
                id: e.id.to_string(),
                segment: e.segment,
                delta: e.delta,
                cause: e.cause,
                order_id: e.order_id.map(|o| o.to_string()),
                actor: e.actor,
                detail: e.detail,
                at: rfc3339(e.at),
            })
            .collect(),
        next,
    }))
}

#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct Live {
    now_ms: i64,
    /// Purchase answers of this instance since it started, by code.
    purchases: std::collections::BTreeMap<&'static str, u64>,
    /// Purchase request latency of this instance: (upper bound in seconds, requests at or
    /// under it), cumulative; differences between two readings give the interval's.
    #[schema(value_type = Vec<Vec<f64>>)]
    latency_buckets: Vec<(f64, u64)>,
    latency_count: u64,
    writer_orders_written: u64,
}

/// `GET /api/admin/live`: this instance's counters for the dashboard, which turns two
/// readings a second apart into rates and the interval's p99.
#[utoipa::path(
    get,
    path = "/api/admin/live",
    tag = "admin",
    summary = "This instance's purchase answers by code and latency buckets, for the live dashboard",
    responses((status = 200, description = "Cumulative counters: two readings give rates", body = Live), (status = 401, response = ErrorResponse), (status = 429, response = ErrorResponse)),
    security(("admin" = []))
)]
pub async fn live(_: Admin, State(st): State<Arc<AppState>>) -> Response {
    let (latency_buckets, latency_count) = st.metrics.request_seconds.cumulative();
    no_store(Live {
        now_ms: st.now_ms(),
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

/// One sale's waiting room, as the last advance on this instance saw it.
#[derive(Serialize, utoipa::ToSchema)]
pub struct RoomView {
    sale_id: String,
    title: String,
    /// Tickets in the room, let through or not.
    tickets: u64,
    /// Tickets not yet let through.
    waiting: u64,
    admitted: u64,
    /// The sale's setting.
    admit_per_sec: i64,
    /// Measured over the last seconds.
    admitted_per_sec: f64,
    /// How long the ticket next in line has waited.
    oldest_wait_secs: f64,
    /// Why nobody is let through (`sold_out`, `ended`, `paused`), when so.
    #[serde(skip_serializing_if = "Option::is_none")]
    closed: Option<crate::room::Closed>,
}

/// `GET /api/admin/rooms`: every waiting room that takes buyers now.
#[utoipa::path(
    get,
    path = "/api/admin/rooms",
    tag = "admin",
    summary = "The waiting rooms: length, admissions per second, the oldest wait",
    responses((status = 200, description = "One entry per room open to buyers", body = Vec<RoomView>), (status = 401, response = ErrorResponse), (status = 429, response = ErrorResponse)),
    security(("admin" = []))
)]
pub async fn rooms(_: Admin, State(st): State<Arc<AppState>>) -> Response {
    let views: Vec<RoomView> = st
        .rooms
        .reports()
        .into_iter()
        .map(|r| RoomView {
            sale_id: r.sale_id.to_string(),
            title: st
                .sales
                .get(r.sale_id)
                .map(|s| s.title.clone())
                .unwrap_or_default(),
            tickets: r.stats.tickets,
            waiting: r.stats.waiting(),
            admitted: r.stats.admitted,
            admit_per_sec: r.admit_per_sec,
            admitted_per_sec: (r.admitted_per_sec * 10.0).round() / 10.0,
            oldest_wait_secs: r.oldest_wait_ms as f64 / 1000.0,
            closed: r.stats.closed,
        })
        .collect();
    no_store(views)
}
