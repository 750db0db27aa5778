//! Managing admin API keys: create (the key's text shown once), list, rotate (a new secret,
//! the old one dead at once here and within seconds everywhere), revoke. A key holding the
//! `keys` scope may manage keys, but never grant a scope it lacks.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};

use super::super::auth::keys::{ApiKeys, Scopes};
use super::super::auth::Admin;
use super::super::http::error::{ApiError, ChangeErrors, ErrorResponse};
use super::super::http::input::{parse_json, rfc3339, KeyId, PathId};
use super::super::AppState;
use crate::store::api_keys::ApiKeyRow;

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewKey {
    /// Who holds it, for people: 1 to 100 characters.
    #[schema(min_length = 1, max_length = 100)]
    name: String,
    /// Any of `sales:read`, `sales:write`, `orders:read`, `payments`, `operations`,
    /// `metrics`, `keys`; at least one.
    #[schema(min_items = 1)]
    scopes: Vec<String>,
}

/// A key as listed: never its secret.
#[derive(Serialize, utoipa::ToSchema)]
pub struct KeyView {
    id: String,
    name: String,
    scopes: Vec<String>,
    created_at: String,
    rotated_at: Option<String>,
    /// To within a few seconds.
    last_used_at: Option<String>,
    revoked_at: Option<String>,
}

impl From<&ApiKeyRow> for KeyView {
    fn from(r: &ApiKeyRow) -> Self {
        KeyView {
            id: r.id.to_string(),
            name: r.name.clone(),
            scopes: r.scopes.split_whitespace().map(String::from).collect(),
            created_at: rfc3339(r.created_at),
            rotated_at: r.rotated_at.map(rfc3339),
            last_used_at: r.last_used_at.map(rfc3339),
            revoked_at: r.revoked_at.map(rfc3339),
        }
    }
}

/// A key just made or rotated, with its text: shown this once, never again.
#[derive(Serialize, utoipa::ToSchema)]
pub struct KeyShown {
    #[serde(flatten)]
    key: KeyView,
    /// `sk_{id}_{secret}`: the bearer token of the admin calls its scopes allow.
    secret: String,
}

fn scopes_of(req: &NewKey) -> Result<Scopes, ApiError> {
    if req.scopes.is_empty() {
        return Err(ApiError::invalid("scopes: at least one"));
    }
    Scopes::parse(req.scopes.iter().map(String::as_str)).map_err(|name| {
        ApiError::invalid(format!(
            "scopes: unknown scope {name:?} (sales:read, sales:write, orders:read, payments, \
             operations, metrics, keys)"
        ))
    })
}

#[utoipa::path(
    post,
    path = "/api/admin/keys",
    tag = "admin",
    summary = "Create an API key with scopes; its secret is in this answer only",
    description = "A key calling this (scope keys) cannot grant a scope it lacks: 403 forbidden.",
    request_body = NewKey,
    responses((status = 201, description = "Created", body = KeyShown), (status = 400, response = ErrorResponse), (status = 401, response = ErrorResponse), (status = 403, response = ErrorResponse), (status = 429, response = ErrorResponse), (status = 503, response = ErrorResponse)),
    security(("admin" = []))
)]
pub async fn create_key(
    admin: Admin,
    State(st): State<Arc<AppState>>,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<KeyShown>), ApiError> {
    let req: NewKey = parse_json(&body)?;
    let name = req.name.trim();
    if name.is_empty() || name.chars().count() > 100 {
        return Err(ApiError::invalid(
            "name: 1 to 100 characters, not only spaces",
        ));
    }
    let scopes = scopes_of(&req)?;
    if !admin.scopes().covers(scopes) {
        return Err(ApiError::Forbidden {
            code: "forbidden",
            message: "a key cannot grant scopes it lacks".into(),
        });
    }
    let new = ApiKeys::mint(st.ids.next()?, name, scopes, st.now_ms());
    st.store.create_api_key(&new.row).await?;
    st.api_keys.reload(&st.store).await?;
    tracing::info!(key = new.row.id, name, scopes = %new.row.scopes, by = %admin.name(), "API key created");
    Ok((
        StatusCode::CREATED,
        Json(KeyShown {
            key: KeyView::from(&new.row),
            secret: new.text,
        }),
    ))
}

#[utoipa::path(
    get,
    path = "/api/admin/keys",
    tag = "admin",
    summary = "Every API key, revoked ones included (never a secret)",
    responses((status = 200, description = "The keys, oldest first", body = [KeyView]), (status = 401, response = ErrorResponse), (status = 403, response = ErrorResponse), (status = 429, response = ErrorResponse), (status = 503, response = ErrorResponse)),
    security(("admin" = []))
)]
pub async fn list_keys(
    _: Admin,
    State(st): State<Arc<AppState>>,
) -> Result<Json<Vec<KeyView>>, ApiError> {
    let rows = st.store.api_keys().await?;
    Ok(Json(rows.iter().map(KeyView::from).collect()))
}

/// 403 unless the caller holds every scope of the key it would rotate or revoke: a key that
/// manages keys must not take over (or silence) a more powerful one.
fn may_manage(admin: &Admin, target: &ApiKeyRow) -> Result<(), ApiError> {
    let scopes = Scopes::parse(target.scopes.split_whitespace()).unwrap_or_else(|_| Scopes::all());
    if admin.scopes().covers(scopes) {
        Ok(())
    } else {
        Err(ApiError::Forbidden {
            code: "forbidden",
            message: "this API key lacks scopes the key it would change holds".into(),
        })
    }
}

async fn live_key(st: &AppState, id: i64) -> Result<ApiKeyRow, ApiError> {
    match st.store.api_key(id).await? {
        Some(row) if row.revoked_at.is_none() => Ok(row),
        Some(_) => Err(ApiError::Conflict(format!("API key {id} is revoked"))),
        None => Err(ApiError::NotFound(format!("no API key {id}"))),
    }
}

#[utoipa::path(
    post,
    path = "/api/admin/keys/{id}/rotate",
    tag = "admin",
    summary = "Give a key a new secret (in this answer only); the old one stops working",
    params(KeyId),
    responses((status = 200, description = "Rotated", body = KeyShown), ChangeErrors),
    security(("admin" = []))
)]
pub async fn rotate_key(
    admin: Admin,
    State(st): State<Arc<AppState>>,
    PathId(id, _): KeyId,
) -> Result<Json<KeyShown>, ApiError> {
    may_manage(&admin, &live_key(&st, id).await?)?;
    let (text, hash) = ApiKeys::new_secret(id);
    if !st.store.rotate_api_key(id, &hash, st.now_ms()).await? {
        return Err(ApiError::Conflict(format!("API key {id} is revoked")));
    }
    st.api_keys.reload(&st.store).await?;
    let row = live_key(&st, id).await?;
    tracing::info!(key = id, by = %admin.name(), "API key rotated");
    Ok(Json(KeyShown {
        key: KeyView::from(&row),
        secret: text,
    }))
}

#[utoipa::path(
    delete,
    path = "/api/admin/keys/{id}",
    tag = "admin",
    summary = "Revoke a key: refused here at once, on every instance within 2 s",
    params(KeyId),
    responses((status = 200, description = "Revoked", body = KeyView), ChangeErrors),
    security(("admin" = []))
)]
pub async fn revoke_key(
    admin: Admin,
    State(st): State<Arc<AppState>>,
    PathId(id, _): KeyId,
) -> Result<Json<KeyView>, ApiError> {
    may_manage(&admin, &live_key(&st, id).await?)?;
    st.store.revoke_api_key(id, st.now_ms()).await?;
    st.api_keys.reload(&st.store).await?;
    let row = st
        .store
        .api_key(id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no API key {id}")))?;
    tracing::info!(key = id, by = %admin.name(), "API key revoked");
    Ok(Json(KeyView::from(&row)))
}
