//! Managing sales: create (a draft), edit and delete drafts, approve (loads it into the
//! gate when it opens soon), end early, pause and resume, list. SQL first, then the gate.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};

use super::super::auth::Admin;
use super::super::buyer::catalogue::SaleView;
use super::super::http::error::{ApiError, ChangeErrors, ErrorResponse, ReadErrors};
use super::super::http::input::{parse_json, parse_rfc3339, rfc3339, PathId, SaleId};
use super::super::AppState;
use crate::model::Sale;

// ---- admin ------------------------------------------------------------------------------

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewSale {
    /// 1 to 200 characters, not only spaces.
    #[schema(min_length = 1, max_length = 200, pattern = "\\S")]
    title: String,
    #[schema(minimum = 0, maximum = 100_000_000_000_i64)]
    price_cents: i64,
    #[schema(minimum = 1, maximum = 100_000_000)]
    stock: i64,
    /// At most this many units per buyer (1 when left out).
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(minimum = 1, maximum = 1000, default = 1, nullable = false)]
    per_user_limit: Option<i64>,
    #[schema(format = DateTime)]
    begins_at: String,
    /// After begins_at and in the future (400 otherwise).
    #[schema(format = DateTime)]
    ends_at: String,
    /// Time a buyer has to pay (900 s when left out).
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(minimum = 1, maximum = 604_800, default = 900, nullable = false)]
    payment_window_secs: Option<i64>,
    /// What a buyer must fetch before purchasing (`off` when left out).
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(nullable = false)]
    anti_bot: Option<crate::model::AntiBot>,
    /// Keep the stock in this many parts (1 to 64, at most the stock), each with its own
    /// Redis hash tag, or `"auto"`: one per Redis Cluster master, at least 20 units each.
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(nullable = false)]
    segments: Option<SegmentsAsked>,
    /// A waiting room in front of the sale (none when left out): buyers join
    /// `POST /api/sales/{id}/queue` and only those let through may buy.
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(nullable = false)]
    waiting_room: Option<RoomAsked>,
    /// The shop's own reference (its SKU or campaign id): 1 to 200 characters, no control
    /// characters, unique among sales (409 `conflict` names the sale holding it). Set at
    /// creation; `PUT /api/admin/sales/by-ref/{ref}` creates or edits by it.
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(min_length = 1, max_length = 200, nullable = false)]
    external_ref: Option<String>,
}

/// An `external_ref` as the shop may write it.
fn checked_ref(r: &str) -> Result<&str, ApiError> {
    if r.is_empty() || r.chars().count() > 200 || r.chars().any(char::is_control) {
        return Err(ApiError::invalid(
            "external_ref must be 1 to 200 characters, without control characters",
        ));
    }
    Ok(r)
}

/// 409 when another sale holds `external_ref` already.
async fn ref_free(st: &AppState, external_ref: Option<&str>) -> Result<(), ApiError> {
    let Some(r) = external_ref else {
        return Ok(());
    };
    match st.store.sale_by_external_ref(checked_ref(r)?).await? {
        Some(holder) => Err(ApiError::Conflict(format!(
            "sale {} holds external_ref {r:?} already",
            holder.id
        ))),
        None => Ok(()),
    }
}

/// `"waiting_room"`: admissions per second, and how early buyers may join.
#[derive(Deserialize, Clone, Copy, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RoomAsked {
    /// Buyers let through per second, across every instance, from the opening.
    #[schema(minimum = 1, maximum = 1_000_000)]
    admit_per_sec: i64,
    /// Buyers may join this long before the opening (600 when left out); those placed by
    /// the lottery drawn at the opening.
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(minimum = 0, maximum = 604_800, default = 600, nullable = false)]
    prequeue_secs: Option<i64>,
}

impl RoomAsked {
    fn checked(self) -> Result<crate::model::WaitingRoom, ApiError> {
        use crate::model::WaitingRoom;
        if !(1..=WaitingRoom::MAX_ADMIT_PER_SEC).contains(&self.admit_per_sec) {
            return Err(ApiError::invalid(format!(
                "waiting_room.admit_per_sec must be between 1 and {}",
                WaitingRoom::MAX_ADMIT_PER_SEC
            )));
        }
        let prequeue_secs = self
            .prequeue_secs
            .unwrap_or(WaitingRoom::DEFAULT_PREQUEUE_SECS);
        if !(0..=WaitingRoom::MAX_PREQUEUE_SECS).contains(&prequeue_secs) {
            return Err(ApiError::invalid(format!(
                "waiting_room.prequeue_secs must be between 0 and {}",
                WaitingRoom::MAX_PREQUEUE_SECS
            )));
        }
        Ok(WaitingRoom {
            admit_per_sec: self.admit_per_sec,
            prequeue_secs,
        })
    }

    fn of(room: crate::model::WaitingRoom) -> Self {
        RoomAsked {
            admit_per_sec: room.admit_per_sec,
            prequeue_secs: Some(room.prequeue_secs),
        }
    }
}

/// `"segments"`: a number of parts, or `"auto"` (see `model::segments::auto_segments`).
#[derive(Deserialize, Clone, Copy)]
#[serde(untagged)]
pub enum SegmentsAsked {
    Count(i64),
    Auto(AutoWord),
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
pub enum AutoWord {
    Auto,
}

/// A count of 1 to `MAX_SEGMENTS`, or the word `auto`, as the schema says it.
impl utoipa::PartialSchema for SegmentsAsked {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, OneOfBuilder, Type};
        OneOfBuilder::new()
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .minimum(Some(1))
                    .maximum(Some(crate::model::segments::MAX_SEGMENTS)),
            )
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .enum_values(Some(["auto"])),
            )
            .into()
    }
}

impl utoipa::ToSchema for SegmentsAsked {}

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

fn validate_new_sale(n: &NewSale, now: i64) -> Result<(i64, i64), ApiError> {
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
    if ends <= now {
        return Err(ApiError::invalid(
            "ends_at is in the past: the sale would never open",
        ));
    }
    Ok((begins, ends))
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct Created {
    id: String,
    status: &'static str,
}

#[utoipa::path(
    post,
    path = "/api/admin/sales",
    tag = "admin",
    summary = "Create a sale (draft)",
    description = "ends_at must be after begins_at and in the future; otherwise 400 invalid_request.",
    request_body = NewSale,
    responses((status = 201, description = "Created as a draft", body = Created), (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse), (status = 429, response = ErrorResponse), (status = 503, response = ErrorResponse)),
    security(("admin" = []))
)]
pub async fn create_sale(
    _: Admin,
    State(st): State<Arc<AppState>>,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<Created>), ApiError> {
    let n: NewSale = parse_json(&body)?;
    let id = create_from(&st, n).await?;
    Ok((
        StatusCode::CREATED,
        Json(Created {
            id: id.to_string(),
            status: "draft",
        }),
    ))
}

/// Creates a draft from a new sale's fields; its id.
async fn create_from(st: &AppState, n: NewSale) -> Result<i64, ApiError> {
    let (begins_at, ends_at) = validate_new_sale(&n, st.now_ms())?;
    ref_free(st, n.external_ref.as_deref()).await?;
    let waiting_room = n.waiting_room.map(RoomAsked::checked).transpose()?;
    let segments = segments_for(st, n.segments, n.stock).await?;
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
        waiting_room,
        external_ref: n.external_ref,
    };
    if let Err(e) = st.store.create_sale(&sale).await {
        // Two creations of one reference at once: the unique index took the first.
        ref_free(st, sale.external_ref.as_deref()).await?;
        return Err(e.into());
    }
    tracing::info!(
        sale = sale.id,
        title = sale.title,
        stock = sale.stock,
        "sale created"
    );
    Ok(sale.id)
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct Approved {
    id: String,
    status: &'static str,
    loaded: bool,
}

#[utoipa::path(
    post,
    path = "/api/admin/sales/{id}/approve",
    tag = "admin",
    summary = "Approve a sale; loads it into the gate if it opens soon",
    params(SaleId),
    responses((status = 200, description = "Approved", body = Approved), ChangeErrors),
    security(("admin" = []))
)]
pub async fn approve_sale(
    _: Admin,
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
) -> Result<Json<Approved>, ApiError> {
    let first_time = st.store.approve_sale(id).await?;
    st.sales.refresh(&st.store).await?;
    let sale = st.approved_sale(id).await?;
    let now = st.now_ms();
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
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SaleChanges {
    /// 1 to 200 characters, not only spaces.
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(min_length = 1, max_length = 200, pattern = "\\S", nullable = false)]
    title: Option<String>,
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(minimum = 0, maximum = 100_000_000_000_i64, nullable = false)]
    price_cents: Option<i64>,
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(minimum = 1, maximum = 100_000_000, nullable = false)]
    stock: Option<i64>,
    /// At most this many units per buyer (1 when left out).
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(minimum = 1, maximum = 1000, nullable = false)]
    per_user_limit: Option<i64>,
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(format = DateTime, nullable = false)]
    begins_at: Option<String>,
    /// After begins_at and in the future (400 otherwise).
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(format = DateTime, nullable = false)]
    ends_at: Option<String>,
    /// Time a buyer has to pay (900 s when left out).
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(minimum = 1, maximum = 604_800, nullable = false)]
    payment_window_secs: Option<i64>,
    /// What a buyer must fetch before purchasing (`off` when left out).
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(nullable = false)]
    anti_bot: Option<crate::model::AntiBot>,
    /// Keep the stock in this many parts (1 to 64, at most the stock), each with its own
    /// Redis hash tag, or `"auto"`: one per Redis Cluster master, at least 20 units each.
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(nullable = false)]
    segments: Option<SegmentsAsked>,
    /// A waiting room, or `null` to take it away.
    #[serde(default, deserialize_with = "crate::edge::http::input::null_removes")]
    #[schema(value_type = Option<RoomAsked>)]
    waiting_room: Option<Option<RoomAsked>>,
}

/// The sale, or 404.
pub async fn existing_sale(st: &AppState, id: i64) -> Result<Sale, ApiError> {
    st.store
        .sale(id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("sale {id} does not exist")))
}

/// Edits a draft: a sale not approved yet was never in a gate, so anything may change.
#[utoipa::path(
    patch,
    path = "/api/admin/sales/{id}",
    tag = "admin",
    summary = "Edit a draft sale (any of its settings); an approved sale answers 409",
    params(SaleId),
    request_body = SaleChanges,
    responses((status = 200, description = "Edited", body = Created), ChangeErrors),
    security(("admin" = []))
)]
pub async fn edit_sale(
    _: Admin,
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
    body: axum::body::Bytes,
) -> Result<Json<Created>, ApiError> {
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
        title: c.title.unwrap_or_else(|| sale.title.clone()),
        price_cents: c.price_cents.unwrap_or(sale.price_cents),
        stock: c.stock.unwrap_or(sale.initial_stock),
        per_user_limit: Some(c.per_user_limit.unwrap_or(sale.per_user_limit)),
        begins_at: c.begins_at.unwrap_or_else(|| rfc3339(sale.begins_at)),
        ends_at: c.ends_at.unwrap_or_else(|| rfc3339(sale.ends_at)),
        payment_window_secs: Some(c.payment_window_secs.unwrap_or(sale.payment_window_secs)),
        anti_bot: Some(c.anti_bot.unwrap_or(sale.anti_bot)),
        segments: Some(c.segments.unwrap_or(SegmentsAsked::Count(sale.segments))),
        waiting_room: match c.waiting_room {
            Some(asked) => asked,
            None => sale.waiting_room.map(RoomAsked::of),
        },
        external_ref: sale.external_ref.clone(),
    };
    edit_draft(&st, sale, merged).await?;
    tracing::info!(sale = id, "draft sale edited");
    Ok(Json(Created {
        id: id.to_string(),
        status: "draft",
    }))
}

/// Edits a draft to `merged`'s fields; 409 once it is approved.
async fn edit_draft(st: &AppState, sale: Sale, merged: NewSale) -> Result<(), ApiError> {
    let id = sale.id;
    let not_a_draft = || {
        ApiError::Conflict(format!(
            "sale {id} is approved: only a draft can be edited (pause it, or end it early)"
        ))
    };
    let (begins_at, ends_at) = validate_new_sale(&merged, st.now_ms())?;
    let waiting_room = merged.waiting_room.map(RoomAsked::checked).transpose()?;
    let segments = segments_for(st, merged.segments, merged.stock).await?;
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
        waiting_room,
        ..sale
    };
    // Approved meanwhile: the draft's check above is re-made by the update itself.
    if !st.store.update_draft(&edited).await? {
        return Err(not_a_draft());
    }
    Ok(())
}

/// Deletes a draft; an approved sale may have buyers and orders, and stays.
#[utoipa::path(
    delete,
    path = "/api/admin/sales/{id}",
    tag = "admin",
    summary = "Delete a draft sale; an approved sale answers 409 (end it early instead)",
    params(SaleId),
    responses((status = 200, description = "Deleted", body = Created), ChangeErrors),
    security(("admin" = []))
)]
pub async fn delete_sale(
    _: Admin,
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
) -> Result<Json<Created>, ApiError> {
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

#[derive(Serialize, utoipa::ToSchema)]
pub struct Ended {
    id: String,
    status: &'static str,
    ends_at: String,
}

/// Ends an approved sale now: SQL first (the record, and the SQL gates' window), then the
/// gate, which every instance's next purchase reads. Units already sold stay sold. When
/// the gate cannot be told, the answer is 503 and calling again finishes it.
#[utoipa::path(
    post,
    path = "/api/admin/sales/{id}/end",
    tag = "admin",
    summary = "End an approved sale now; units sold stay sold. A draft answers 409",
    params(SaleId),
    responses((status = 200, description = "Ended: no purchase is decided after this answer, on any instance", body = Ended), ChangeErrors),
    security(("admin" = []))
)]
pub async fn end_sale(
    _: Admin,
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
) -> Result<Json<Ended>, ApiError> {
    let sale = existing_sale(&st, id).await?;
    if !sale.approved {
        return Err(ApiError::Conflict(format!(
            "sale {id} is a draft: it never opened (delete it instead)"
        )));
    }
    let now = st.now_ms();
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

#[derive(Serialize, utoipa::ToSchema)]
pub struct PauseState {
    id: String,
    paused: bool,
}

async fn set_paused(st: &AppState, id: i64, paused: bool) -> Result<Json<PauseState>, ApiError> {
    st.store.set_paused(id, paused).await?;
    st.gate.set_paused(id, paused).await?;
    st.sales.refresh(&st.store).await?;
    Ok(Json(PauseState {
        id: id.to_string(),
        paused,
    }))
}

#[utoipa::path(
    post,
    path = "/api/admin/sales/{id}/pause",
    tag = "admin",
    summary = "Stop purchases (kill switch)",
    params(SaleId),
    responses((status = 200, description = "Paused", body = PauseState), ReadErrors),
    security(("admin" = []))
)]
pub async fn pause_sale(
    _: Admin,
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
) -> Result<Json<PauseState>, ApiError> {
    set_paused(&st, id, true).await
}

#[utoipa::path(
    post,
    path = "/api/admin/sales/{id}/resume",
    tag = "admin",
    summary = "Restart purchases",
    params(SaleId),
    responses((status = 200, description = "Resumed", body = PauseState), ReadErrors),
    security(("admin" = []))
)]
pub async fn resume_sale(
    _: Admin,
    State(st): State<Arc<AppState>>,
    PathId(id, _): SaleId,
) -> Result<Json<PauseState>, ApiError> {
    set_paused(&st, id, false).await
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct AdminSaleView {
    #[serde(flatten)]
    sale: SaleView,
    status: &'static str,
    paused: bool,
    sql_stock: i64,
    /// The shop's own reference, when it gave one.
    #[serde(skip_serializing_if = "Option::is_none")]
    external_ref: Option<String>,
}

impl From<&Sale> for AdminSaleView {
    fn from(s: &Sale) -> Self {
        AdminSaleView {
            sale: SaleView::from(s),
            status: if s.approved { "approved" } else { "draft" },
            paused: s.paused,
            sql_stock: s.stock,
            external_ref: s.external_ref.clone(),
        }
    }
}

#[derive(Deserialize)]
pub struct SalesQuery {
    external_ref: Option<String>,
}

#[utoipa::path(
    get,
    path = "/api/admin/sales",
    tag = "admin",
    summary = "All sales with their SQL stock (or the one holding ?external_ref=)",
    params(("external_ref" = Option<String>, Query, description = "Only the sale holding this reference")),
    responses((status = 200, description = "Newest first", body = Vec<AdminSaleView>), (status = 401, response = ErrorResponse), (status = 429, response = ErrorResponse), (status = 503, response = ErrorResponse)),
    security(("admin" = []))
)]
pub async fn admin_list_sales(
    _: Admin,
    State(st): State<Arc<AppState>>,
    query: Result<axum::extract::Query<SalesQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Vec<AdminSaleView>>, ApiError> {
    let query = query.map_err(|e| ApiError::invalid(format!("bad query: {e}")))?;
    let sales = match &query.external_ref {
        // No sale holds a reference that is not one.
        Some(r) if checked_ref(r).is_err() => Vec::new(),
        Some(r) => st
            .store
            .sale_by_external_ref(r)
            .await?
            .into_iter()
            .collect(),
        None => st.store.all_sales(500).await?,
    };
    Ok(Json(sales.iter().map(AdminSaleView::from).collect()))
}

#[utoipa::path(
    put,
    path = "/api/admin/sales/by-ref/{ref}",
    tag = "admin",
    summary = "Create or edit the draft sale the shop knows by this reference (a sync job's upsert)",
    description = "With no sale holding the reference: creates a draft with the body's fields \
                   (201). With a draft holding it: sets its fields to the body's (200). With an \
                   approved sale holding it: 409 conflict. A body naming another external_ref: \
                   400.",
    params(("ref" = String, Path, description = "The shop's reference: 1 to 200 characters")),
    request_body = NewSale,
    responses((status = 200, description = "The draft edited", body = Created), (status = 201, description = "Created as a draft", body = Created), (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse), (status = 403, response = ErrorResponse), (status = 409, response = ErrorResponse), (status = 503, response = ErrorResponse)),
    security(("admin" = []))
)]
pub async fn upsert_by_ref(
    _: Admin,
    State(st): State<Arc<AppState>>,
    axum::extract::Path(external_ref): axum::extract::Path<String>,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<Created>), ApiError> {
    let mut n: NewSale = parse_json(&body)?;
    checked_ref(&external_ref)?;
    if n.external_ref.as_ref().is_some_and(|r| r != &external_ref) {
        return Err(ApiError::invalid(
            "the body's external_ref differs from the path's",
        ));
    }
    n.external_ref = Some(external_ref.clone());
    let (status, id) = match st.store.sale_by_external_ref(&external_ref).await? {
        None => (StatusCode::CREATED, create_from(&st, n).await?),
        Some(sale) => {
            let id = sale.id;
            if sale.approved {
                return Err(ApiError::Conflict(format!(
                    "sale {id} ({external_ref:?}) is approved: only a draft can be edited"
                )));
            }
            edit_draft(&st, sale, n).await?;
            tracing::info!(sale = id, external_ref, "draft sale set by its reference");
            (StatusCode::OK, id)
        }
    };
    Ok((
        status,
        Json(Created {
            id: id.to_string(),
            status: "draft",
        }),
    ))
}
