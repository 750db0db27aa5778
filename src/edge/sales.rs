//! Sale endpoints: the public catalogue (cacheable, served from the instance's sale
//! cache), live stock from the gate, and the admin calls that create, approve, pause and
//! inspect sales.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use super::auth::Admin;
use super::error::ApiError;
use super::{parse_id, parse_json, AppState};
use crate::model::{Sale, SaleState};

pub fn rfc3339(ms: i64) -> String {
    OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_default()
}

fn parse_rfc3339(field: &str, s: &str) -> Result<i64, ApiError> {
    let t = OffsetDateTime::parse(s, &Rfc3339).map_err(|_| {
        ApiError::invalid(format!(
            "{field} must be an RFC 3339 time, like 2026-11-22T20:00:00Z"
        ))
    })?;
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000)
        .map_err(|_| ApiError::invalid(format!("{field} is out of range")))
}

#[derive(Serialize)]
pub struct SaleView {
    id: String,
    title: String,
    price_cents: i64,
    stock: i64,
    per_user_limit: i64,
    begins_at: String,
    ends_at: String,
    payment_window_secs: i64,
    /// `off`, `token` or `captcha`: what a buyer must fetch before purchasing.
    anti_bot: crate::model::AntiBot,
    /// Parts the stock is kept in (each on its own Redis master in a cluster).
    segments: i64,
}

impl From<&Sale> for SaleView {
    fn from(s: &Sale) -> Self {
        SaleView {
            id: s.id.to_string(),
            title: s.title.clone(),
            price_cents: s.price_cents,
            stock: s.initial_stock,
            per_user_limit: s.per_user_limit,
            begins_at: rfc3339(s.begins_at),
            ends_at: rfc3339(s.ends_at),
            payment_window_secs: s.payment_window_secs,
            anti_bot: s.anti_bot,
            segments: s.segments,
        }
    }
}

/// A JSON answer with an ETag; a matching If-None-Match gets 304.
fn cacheable<T: Serialize>(headers: &HeaderMap, value: &T) -> Response {
    let body = match serde_json::to_vec(value) {
        Ok(b) => b,
        Err(e) => {
            return ApiError::Unavailable(format!("could not encode the answer: {e}"))
                .into_response()
        }
    };
    let etag = super::etag_of(&body);
    let mut response = if super::client_holds(headers, &etag) {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        ([(header::CONTENT_TYPE, "application/json")], body).into_response()
    };
    let h = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&etag) {
        h.insert(header::ETAG, v);
    }
    h.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("public, max-age=2"),
    );
    response
}

pub async fn list_sales(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let now = crate::now_ms();
    let views: Vec<SaleView> = st
        .sales
        .all()
        .iter()
        .filter(|s| s.ends_at > now)
        .map(|s| SaleView::from(s.as_ref()))
        .collect();
    cacheable(&headers, &views)
}

pub async fn approved_sale(st: &AppState, id: i64) -> Result<Arc<Sale>, ApiError> {
    if let Some(s) = st.sales.get(id) {
        return Ok(s);
    }
    // Approved moments ago on another instance, or ended long ago: ask SQL once.
    match st.store.sale(id).await? {
        Some(s) if s.approved => Ok(Arc::new(s)),
        _ => Err(ApiError::NotFound(format!("sale {id} does not exist"))),
    }
}

pub async fn get_sale(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let sale = approved_sale(&st, parse_id(&id, "sale id")?).await?;
    Ok(cacheable(&headers, &SaleView::from(sale.as_ref())))
}

#[derive(Serialize)]
pub struct StockView {
    state: SaleState,
    remaining: i64,
}

pub async fn get_stock(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let sale = approved_sale(&st, parse_id(&id, "sale id")?).await?;
    let (remaining, paused) = match st.gate.stock(sale.id).await? {
        Some(g) => (g.remaining, g.paused),
        None => (sale.stock, sale.paused),
    };
    let mut paused_sale = (*sale).clone();
    paused_sale.paused = paused;
    let view = StockView {
        state: paused_sale.state_at(crate::now_ms(), remaining),
        remaining,
    };
    Ok(no_store(view))
}

/// A JSON answer no cache may keep: live state, or single-use values.
pub fn no_store(value: impl Serialize) -> Response {
    let mut response = Json(value).into_response();
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

// ---- admin ------------------------------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewSale {
    title: String,
    price_cents: i64,
    stock: i64,
    #[serde(default, deserialize_with = "crate::edge::not_null")]
    per_user_limit: Option<i64>,
    begins_at: String,
    ends_at: String,
    #[serde(default, deserialize_with = "crate::edge::not_null")]
    payment_window_secs: Option<i64>,
    #[serde(default, deserialize_with = "crate::edge::not_null")]
    anti_bot: Option<crate::model::AntiBot>,
    #[serde(default, deserialize_with = "crate::edge::not_null")]
    segments: Option<SegmentsAsked>,
}

/// `"segments"`: a number of parts, or `"auto"` (see `segments::auto_segments`).
#[derive(Deserialize, Clone, Copy)]
#[serde(untagged)]
enum SegmentsAsked {
    Count(i64),
    Auto(AutoWord),
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum AutoWord {
    Auto,
}

/// The segments a new or edited sale gets.
async fn segments_for(
    st: &AppState,
    asked: Option<SegmentsAsked>,
    stock: i64,
) -> Result<i64, ApiError> {
    match asked {
        None => Ok(1),
        Some(SegmentsAsked::Count(n))
            if (1..=crate::model::segments::MAX_SEGMENTS).contains(&n) =>
        {
            if n > stock {
                return Err(ApiError::invalid(format!(
                    "segments ({n}) must not exceed the stock ({stock}): every segment starts with a unit"
                )));
            }
            Ok(n)
        }
        Some(SegmentsAsked::Count(_)) => Err(ApiError::invalid(format!(
            "segments must be between 1 and {}, or \"auto\"",
            crate::model::segments::MAX_SEGMENTS
        ))),
        Some(SegmentsAsked::Auto(AutoWord::Auto)) => {
            let masters = match &st.redis {
                Some(conn) => crate::redis_client::master_count(&mut conn.clone()).await,
                None => 1,
            };
            Ok(crate::model::segments::auto_segments(masters, stock))
        }
    }
}

pub const MAX_STOCK: i64 = 100_000_000;
pub const MAX_PER_USER_LIMIT: i64 = 1000;

fn validate_new_sale(n: &NewSale) -> Result<(i64, i64), ApiError> {
    if n.title.trim().is_empty() || n.title.chars().count() > 200 {
        return Err(ApiError::invalid(
            "title must be 1 to 200 characters, not only spaces",
        ));
    }
    if !(0..=100_000_000_000).contains(&n.price_cents) {
        return Err(ApiError::invalid(
            "price_cents must be between 0 and 100000000000",
        ));
    }
    if !(1..=MAX_STOCK).contains(&n.stock) {
        return Err(ApiError::invalid(format!(
            "stock must be between 1 and {MAX_STOCK}"
        )));
    }
    if let Some(l) = n.per_user_limit {
        if !(1..=MAX_PER_USER_LIMIT).contains(&l) {
            return Err(ApiError::invalid(format!(
                "per_user_limit must be between 1 and {MAX_PER_USER_LIMIT}"
            )));
        }
    }
    if let Some(w) = n.payment_window_secs {
        if !(1..=7 * 86400).contains(&w) {
            return Err(ApiError::invalid(
                "payment_window_secs must be between 1 and 604800",
            ));
        }
    }
    let begins = parse_rfc3339("begins_at", &n.begins_at)?;
    let ends = parse_rfc3339("ends_at", &n.ends_at)?;
    if ends <= begins {
        return Err(ApiError::invalid("ends_at must be after begins_at"));
    }
    if ends <= crate::now_ms() {
        return Err(ApiError::invalid(
            "ends_at is in the past: the sale would never open",
        ));
    }
    Ok((begins, ends))
}

#[derive(Serialize)]
pub struct Created {
    id: String,
    status: &'static str,
}

pub async fn create_sale(
    _: Admin,
    State(st): State<Arc<AppState>>,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<Created>), ApiError> {
    let n: NewSale = parse_json(&body)?;
    let (begins_at, ends_at) = validate_new_sale(&n)?;
    let segments = segments_for(&st, n.segments, n.stock).await?;
    let sale = Sale {
        id: st.ids.next()?,
        title: n.title.trim().to_string(),
        price_cents: n.price_cents,
        initial_stock: n.stock,
        stock: n.stock,
        per_user_limit: n.per_user_limit.unwrap_or(1),
        begins_at,
        ends_at,
        payment_window_secs: n.payment_window_secs.unwrap_or(900),
        approved: false,
        paused: false,
        updated_at: 0,
        anti_bot: n.anti_bot.unwrap_or_default(),
        segments,
    };
    st.store.create_sale(&sale).await?;
    tracing::info!(
        sale = sale.id,
        title = sale.title,
        stock = sale.stock,
        "sale created"
    );
    Ok((
        StatusCode::CREATED,
        Json(Created {
            id: sale.id.to_string(),
            status: "draft",
        }),
    ))
}

#[derive(Serialize)]
pub struct Approved {
    id: String,
    status: &'static str,
    loaded: bool,
}

pub async fn approve_sale(
    _: Admin,
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Approved>, ApiError> {
    let id = parse_id(&id, "sale id")?;
    let first_time = st.store.approve_sale(id).await?;
    st.sales.refresh(&st.store).await?;
    let sale = approved_sale(&st, id).await?;
    let now = crate::now_ms();
    let opens_soon = sale.begins_at <= now + st.config.preload_ahead_secs as i64 * 1000;
    let loaded = if sale.ends_at > now && opens_soon {
        crate::loader::load_sale_and_wait(&st.store, st.gate.as_ref(), &st.sales, &sale).await?;
        true
    } else {
        false
    };
    if first_time {
        tracing::info!(sale = id, loaded, "sale approved");
    }
    Ok(Json(Approved {
        id: id.to_string(),
        status: "approved",
        loaded,
    }))
}

/// New values for some of a draft's settings (the others stay).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SaleChanges {
    #[serde(default, deserialize_with = "crate::edge::not_null")]
    title: Option<String>,
    #[serde(default, deserialize_with = "crate::edge::not_null")]
    price_cents: Option<i64>,
    #[serde(default, deserialize_with = "crate::edge::not_null")]
    stock: Option<i64>,
    #[serde(default, deserialize_with = "crate::edge::not_null")]
    per_user_limit: Option<i64>,
    #[serde(default, deserialize_with = "crate::edge::not_null")]
    begins_at: Option<String>,
    #[serde(default, deserialize_with = "crate::edge::not_null")]
    ends_at: Option<String>,
    #[serde(default, deserialize_with = "crate::edge::not_null")]
    payment_window_secs: Option<i64>,
    #[serde(default, deserialize_with = "crate::edge::not_null")]
    anti_bot: Option<crate::model::AntiBot>,
    #[serde(default, deserialize_with = "crate::edge::not_null")]
    segments: Option<SegmentsAsked>,
}

/// The sale, or 404.
async fn existing_sale(st: &AppState, id: i64) -> Result<Sale, ApiError> {
    st.store
        .sale(id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("sale {id} does not exist")))
}

/// Edits a draft: a sale not approved yet was never in a gate, so anything may change.
pub async fn edit_sale(
    _: Admin,
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Json<Created>, ApiError> {
    let id = parse_id(&id, "sale id")?;
    let c: SaleChanges = parse_json(&body)?;
    let sale = existing_sale(&st, id).await?;
    let not_a_draft = || {
        ApiError::Conflict(format!(
            "sale {id} is approved: only a draft can be edited (pause it, or end it early)"
        ))
    };
    if sale.approved {
        return Err(not_a_draft());
    }
    let merged = NewSale {
        title: c.title.unwrap_or(sale.title),
        price_cents: c.price_cents.unwrap_or(sale.price_cents),
        stock: c.stock.unwrap_or(sale.initial_stock),
        per_user_limit: Some(c.per_user_limit.unwrap_or(sale.per_user_limit)),
        begins_at: c.begins_at.unwrap_or_else(|| rfc3339(sale.begins_at)),
        ends_at: c.ends_at.unwrap_or_else(|| rfc3339(sale.ends_at)),
        payment_window_secs: Some(c.payment_window_secs.unwrap_or(sale.payment_window_secs)),
        anti_bot: Some(c.anti_bot.unwrap_or(sale.anti_bot)),
        segments: Some(c.segments.unwrap_or(SegmentsAsked::Count(sale.segments))),
    };
    let (begins_at, ends_at) = validate_new_sale(&merged)?;
    let segments = segments_for(&st, merged.segments, merged.stock).await?;
    let edited = Sale {
        title: merged.title.trim().to_string(),
        price_cents: merged.price_cents,
        initial_stock: merged.stock,
        stock: merged.stock,
        per_user_limit: merged.per_user_limit.unwrap_or(1),
        begins_at,
        ends_at,
        payment_window_secs: merged.payment_window_secs.unwrap_or(900),
        anti_bot: merged.anti_bot.unwrap_or_default(),
        segments,
        ..sale
    };
    // Approved meanwhile: the draft's check above is re-made by the update itself.
    if !st.store.update_draft(&edited).await? {
        return Err(not_a_draft());
    }
    tracing::info!(sale = id, "draft sale edited");
    Ok(Json(Created {
        id: id.to_string(),
        status: "draft",
    }))
}

/// Deletes a draft; an approved sale may have buyers and orders, and stays.
pub async fn delete_sale(
    _: Admin,
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Created>, ApiError> {
    let id = parse_id(&id, "sale id")?;
    existing_sale(&st, id).await?;
    if !st.store.delete_draft(id).await? {
        return Err(ApiError::Conflict(format!(
            "sale {id} is approved: only a draft can be deleted (end it early instead)"
        )));
    }
    tracing::info!(sale = id, "draft sale deleted");
    Ok(Json(Created {
        id: id.to_string(),
        status: "deleted",
    }))
}

#[derive(Serialize)]
pub struct Ended {
    id: String,
    status: &'static str,
    ends_at: String,
}

/// Ends an approved sale now: SQL first (the record, and the SQL gates' window), then the
/// gate, which every instance's next purchase reads. Units already sold stay sold. When
/// the gate cannot be told, the answer is 503 and calling again finishes it.
pub async fn end_sale(
    _: Admin,
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Ended>, ApiError> {
    let id = parse_id(&id, "sale id")?;
    let sale = existing_sale(&st, id).await?;
    if !sale.approved {
        return Err(ApiError::Conflict(format!(
            "sale {id} is a draft: it never opened (delete it instead)"
        )));
    }
    let now = crate::now_ms();
    let sale = st
        .store
        .end_early(id, now)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("sale {id} does not exist")))?;
    st.gate.end_early(id, sale.ends_at).await?;
    st.sales.refresh(&st.store).await?;
    tracing::info!(sale = id, ends_at = sale.ends_at, "sale ended early");
    Ok(Json(Ended {
        id: id.to_string(),
        status: "ended",
        ends_at: rfc3339(sale.ends_at),
    }))
}

#[derive(Serialize)]
pub struct PauseState {
    id: String,
    paused: bool,
}

async fn set_paused(st: &AppState, id: &str, paused: bool) -> Result<Json<PauseState>, ApiError> {
    let id = parse_id(id, "sale id")?;
    st.store.set_paused(id, paused).await?;
    st.gate.set_paused(id, paused).await?;
    st.sales.refresh(&st.store).await?;
    Ok(Json(PauseState {
        id: id.to_string(),
        paused,
    }))
}

pub async fn pause_sale(
    _: Admin,
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<PauseState>, ApiError> {
    set_paused(&st, &id, true).await
}

pub async fn resume_sale(
    _: Admin,
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<PauseState>, ApiError> {
    set_paused(&st, &id, false).await
}

#[derive(Serialize)]
pub struct AdminSaleView {
    #[serde(flatten)]
    sale: SaleView,
    status: &'static str,
    paused: bool,
    sql_stock: i64,
}

pub async fn admin_list_sales(
    _: Admin,
    State(st): State<Arc<AppState>>,
) -> Result<Json<Vec<AdminSaleView>>, ApiError> {
    let sales = st.store.all_sales(500).await?;
    Ok(Json(
        sales
            .iter()
            .map(|s| AdminSaleView {
                sale: SaleView::from(s),
                status: if s.approved { "approved" } else { "draft" },
                paused: s.paused,
                sql_stock: s.stock,
            })
            .collect(),
    ))
}

#[derive(Serialize)]
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
    log_backlog: Option<i64>,
    log_pending: Option<i64>,
    dead_letters: Option<i64>,
}

pub async fn sale_stats(
    _: Admin,
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<SaleStats>, ApiError> {
    let id = parse_id(&id, "sale id")?;
    let sale = st
        .store
        .sale(id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("sale {id} does not exist")))?;
    let counts = st.store.sale_counts(id).await?;
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
        orders_written: counts.orders,
        units_in_live_orders: counts.units,
        orders_by_status: counts.by_status,
        payments_by_status: st.store.payment_counts(id).await?.into_iter().collect(),
        log_backlog: backlog.map(|b| b.unwritten),
        log_pending: backlog.map(|b| b.pending),
        dead_letters: backlog.map(|b| b.dead),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_round_trip() {
        let ms = parse_rfc3339("t", "2026-11-22T20:00:00.250Z").unwrap();
        assert_eq!(rfc3339(ms), "2026-11-22T20:00:00.25Z");
        assert!(parse_rfc3339("t", "yesterday").is_err());
        assert!(parse_rfc3339("t", "2026-13-01T00:00:00Z").is_err());
    }
}

#[derive(Serialize)]
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
    /// Orders accepted by the gate and not yet in SQL.
    log_backlog: Option<i64>,
}

/// The database's own account of a sale, for load tests and operators: what was sold, to
/// how many buyers, the most any buyer holds. Computed in SQL, in constant memory.
pub async fn sale_audit(
    _: Admin,
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Audit>, ApiError> {
    let id = parse_id(&id, "sale id")?;
    let sale = st
        .store
        .sale(id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("sale {id} does not exist")))?;
    let (live_orders, live_units, distinct_buyers, max_units_per_buyer) =
        st.store.live_totals(id).await?;
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
#[derive(Deserialize)]
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

#[derive(Serialize)]
pub struct OrderIds {
    order_ids: Vec<String>,
    /// Pass as `after` for the next page; absent on the last page.
    next: Option<String>,
}

/// The ids of a sale's live orders, a page at a time (`?after=ID&limit=N`, N <= 100000).
pub async fn sale_order_ids(
    _: Admin,
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    page: Result<axum::extract::Query<Page>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<OrderIds>, ApiError> {
    let id = parse_id(&id, "sale id")?;
    let page = page.map_err(|e| ApiError::invalid(format!("bad query: {e}")))?;
    let (after, limit) = page.bounds(10_000, 100_000)?;
    // An unknown (or deleted) sale is 404, not an empty list.
    existing_sale(&st, id).await?;
    let ids = st.store.live_order_ids(id, after, limit).await?;
    let next = next_after(ids.iter().copied(), limit);
    Ok(Json(OrderIds {
        order_ids: ids.iter().map(|i| i.to_string()).collect(),
        next,
    }))
}

// ---- reconciliation -----------------------------------------------------------------------

#[derive(Serialize)]
pub struct Reconciliation {
    #[serde(flatten)]
    account: crate::reconcile::Account,
    exact: bool,
    /// Drift the continuous audit confirmed (on the instance holding the audit lease).
    drift_confirmed_since: Option<String>,
}

/// `GET /api/admin/sales/{id}/reconcile`: the sale's gate against SQL and what is in flight.
pub async fn reconcile(
    _: Admin,
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = parse_id(&id, "sale id")?;
    let account =
        crate::reconcile::account(&st.store, st.gate.as_ref(), st.backlog.as_ref(), id).await?;
    Ok(no_store(Reconciliation {
        exact: account.exact(),
        account,
        drift_confirmed_since: st.audit.finding(id).map(|f| rfc3339(f.since_ms)),
    }))
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RepairRequest {
    #[serde(default, deserialize_with = "crate::edge::not_null")]
    reason: Option<String>,
}

/// `POST /api/admin/sales/{id}/reconcile {reason?}`: rebuilds the sale's gate from SQL
/// and the order log, and journals who asked and why.
pub async fn repair(
    _: Admin,
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let id = parse_id(&id, "sale id")?;
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

#[derive(Serialize)]
struct JournalRow {
    id: String,
    segment: Option<i64>,
    delta: i64,
    cause: String,
    order_id: Option<String>,
    actor: Option<String>,
    detail: Option<String>,
    at: String,
}

#[derive(Serialize)]
struct Journal {
    sale_id: String,
    /// The sum of every row's delta, and the sale's stock: equal, always.
    sum: i64,
    stock: i64,
    rows: Vec<JournalRow>,
    /// Pass as `after` for the next page; absent on the last page.
    next: Option<String>,
}

/// `GET /api/admin/sales/{id}/journal?after=&limit=`: the sale's stock movements, oldest first.
pub async fn journal(
    _: Admin,
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    query: Result<axum::extract::Query<Page>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let axum::extract::Query(page) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    let id = parse_id(&id, "sale id")?;
    let (after, limit) = page.bounds(1000, 10_000)?;
    let (sum, stock) = st.store.journal_balance(id).await?;
    let stock = stock.ok_or_else(|| ApiError::NotFound(format!("sale {id} does not exist")))?;
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
