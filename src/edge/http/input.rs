//! Reading what a client sends and writing what every answer shares: JSON object bodies
//! (never `null` for an optional field), ids, RFC 3339 times, ETags and cache headers.
//! Pure helpers; no handler lives here.

use std::marker::PhantomData;

use axum::extract::{FromRequestParts, Path};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use serde::Serialize;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use utoipa::openapi::path::{Parameter, ParameterBuilder, ParameterIn};
use utoipa::openapi::Required;

use super::error::ApiError;

/// A field that may be left out (`None`), set to `null` (`Some(None)`: remove it) or given
/// a value (`Some(Some(v))`).
pub fn null_removes<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de>,
{
    <Option<T> as serde::Deserialize>::deserialize(d).map(Some)
}

/// For the optional fields of request bodies (`#[serde(default, deserialize_with =
/// "crate::edge::http::input::not_null")]`): a field left out takes its default (or, in a change, stays
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

/// How an id travels in a path: a positive 64-bit integer in decimal, without leading
/// zeros (one id, one spelling); the pattern spells out 1 to 9223372036854775807.
pub struct Id;

impl utoipa::PartialSchema for Id {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .pattern(Some(ID_PATTERN))
            .into()
    }
}

impl utoipa::ToSchema for Id {}

/// What the `{id}` of a path names: its words in an error and in the contract.
pub trait IdOf {
    /// As an error message says it: "sale id".
    const WHAT: &'static str;
}

pub struct OfSale;
pub struct OfOrder;
pub struct OfIntent;
pub struct OfKey;

impl IdOf for OfSale {
    const WHAT: &'static str = "sale id";
}
impl IdOf for OfOrder {
    const WHAT: &'static str = "order id";
}
impl IdOf for OfIntent {
    const WHAT: &'static str = "payment intent id";
}
impl IdOf for OfKey {
    const WHAT: &'static str = "API key id";
}

/// The `{id}` of a path, parsed before the handler runs: a malformed one answers 400
/// `invalid_request`, after the extractors before it (the caller's credentials).
pub struct PathId<K>(pub i64, pub PhantomData<K>);

pub type SaleId = PathId<OfSale>;
pub type OrderId = PathId<OfOrder>;
pub type IntentId = PathId<OfIntent>;
pub type KeyId = PathId<OfKey>;

impl<S: Send + Sync, K: IdOf> FromRequestParts<S> for PathId<K> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError::invalid(e.body_text()))?;
        parse_id(&raw, K::WHAT).map(|id| PathId(id, PhantomData))
    }
}

impl<K: IdOf> utoipa::IntoParams for PathId<K> {
    fn into_params(_: impl Fn() -> Option<ParameterIn>) -> Vec<Parameter> {
        let mut what = K::WHAT.to_string();
        what[..1].make_ascii_uppercase();
        vec![ParameterBuilder::new()
            .name("id")
            .parameter_in(ParameterIn::Path)
            .required(Required::True)
            .description(Some(format!(
                "{what}: a positive 64-bit integer, in decimal"
            )))
            .schema(Some(utoipa::openapi::Ref::from_schema_name("Id")))
            .build()]
    }
}

/// 1 to 9223372036854775807 in decimal, without leading zeros, as a regular expression.
const ID_PATTERN: &str = "^([1-9][0-9]{0,17}|[1-8][0-9]{18}|9[0-1][0-9]{17}|92[0-1][0-9]{16}|922[0-2][0-9]{15}|9223[0-2][0-9]{14}|92233[0-6][0-9]{13}|922337[0-1][0-9]{12}|92233720[0-2][0-9]{10}|922337203[0-5][0-9]{9}|9223372036[0-7][0-9]{8}|92233720368[0-4][0-9]{7}|922337203685[0-3][0-9]{6}|9223372036854[0-6][0-9]{5}|92233720368547[0-6][0-9]{4}|922337203685477[0-4][0-9]{3}|9223372036854775[0-7][0-9]{2}|922337203685477580[0-6]|9223372036854775807)$";

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
    format!("\"{}\"", crate::text::hex(&Sha256::digest(body)[..12]))
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

pub fn rfc3339(ms: i64) -> String {
    OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_default()
}

pub fn parse_rfc3339(field: &str, s: &str) -> Result<i64, ApiError> {
    let t = OffsetDateTime::parse(s, &Rfc3339).map_err(|_| {
        ApiError::invalid(format!(
            "{field} must be an RFC 3339 time, like 2026-11-22T20:00:00Z"
        ))
    })?;
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000)
        .map_err(|_| ApiError::invalid(format!("{field} is out of range")))
}

/// A JSON answer with an ETag; a matching If-None-Match gets 304.
pub fn cacheable<T: Serialize>(headers: &HeaderMap, value: &T) -> Response {
    let body = match serde_json::to_vec(value) {
        Ok(b) => b,
        Err(e) => {
            return ApiError::Unavailable(format!("could not encode the answer: {e}"))
                .into_response()
        }
    };
    let etag = etag_of(&body);
    let mut response = if client_holds(headers, &etag) {
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

/// A JSON answer no cache may keep: live state, or single-use values.
pub fn no_store(value: impl Serialize) -> Response {
    let mut response = Json(value).into_response();
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
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

#[cfg(test)]
mod time_tests {
    use super::*;

    #[test]
    fn times_round_trip() {
        let ms = parse_rfc3339("t", "2026-11-22T20:00:00.250Z").unwrap();
        assert_eq!(rfc3339(ms), "2026-11-22T20:00:00.25Z");
        assert!(parse_rfc3339("t", "yesterday").is_err());
        assert!(parse_rfc3339("t", "2026-13-01T00:00:00Z").is_err());
    }
}
