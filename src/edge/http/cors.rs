//! Cross-origin calls (CORS), off unless an allow-list of origins is configured
//! (`--cors-origins`): a shop's pages on another origin may then call the API from the
//! browser. Tokens travel in `Authorization`, never in cookies, so credentials are never
//! allowed and no origin is ever reflected unless it is on the list.

use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::http::{Method, StatusCode};
use axum::response::Response;

/// Preflight answers may be cached by the browser this long (seconds).
const MAX_AGE: &str = "600";

pub struct Cors {
    origins: Vec<HeaderValue>,
}

impl Cors {
    pub fn new(origins: &[String]) -> Cors {
        Cors {
            origins: origins
                .iter()
                .filter_map(|o| HeaderValue::from_str(o).ok())
                .collect(),
        }
    }

    pub fn enabled(&self) -> bool {
        !self.origins.is_empty()
    }

    /// The request's `Origin`, when it is on the list.
    pub fn allowed(&self, headers: &HeaderMap) -> Option<HeaderValue> {
        let origin = headers.get(header::ORIGIN)?;
        self.origins.iter().find(|o| *o == origin).cloned()
    }

    /// The answer to a preflight (`OPTIONS` with `Access-Control-Request-Method`) from an
    /// allowed origin; `None` for anything else, which is served as usual.
    pub fn preflight(&self, method: &Method, headers: &HeaderMap) -> Option<Response> {
        if method != Method::OPTIONS || !headers.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
        {
            return None;
        }
        let origin = self.allowed(headers)?;
        let mut response = Response::new(axum::body::Body::empty());
        *response.status_mut() = StatusCode::NO_CONTENT;
        let h = response.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("authorization, content-type, if-none-match"),
        );
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static(MAX_AGE),
        );
        h.insert(header::VARY, HeaderValue::from_static("Origin"));
        Some(response)
    }
}

/// Lets the page of `origin` read this answer, and the headers it needs from it.
pub fn allow(response: &mut Response, origin: HeaderValue) {
    let h = response.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static("etag, retry-after"),
    );
    h.append(header::VARY, HeaderValue::from_static("Origin"));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn only_listed_origins_are_allowed() {
        let cors = Cors::new(&["https://shop.example".into()]);
        assert!(cors.enabled());
        assert!(!Cors::new(&[]).enabled());
        let ok = headers(&[("origin", "https://shop.example")]);
        assert_eq!(cors.allowed(&ok).unwrap(), "https://shop.example");
        for other in ["https://evil.example", "https://shop.example.evil", "null"] {
            assert!(
                cors.allowed(&headers(&[("origin", other)])).is_none(),
                "{other}"
            );
        }
        assert!(cors.allowed(&HeaderMap::new()).is_none());
    }

    #[test]
    fn a_preflight_from_a_listed_origin_is_answered() {
        let cors = Cors::new(&["https://shop.example".into()]);
        let pre = headers(&[
            ("origin", "https://shop.example"),
            ("access-control-request-method", "POST"),
        ]);
        let r = cors.preflight(&Method::OPTIONS, &pre).unwrap();
        assert_eq!(r.status(), StatusCode::NO_CONTENT);
        assert_eq!(
            r.headers()["access-control-allow-origin"],
            "https://shop.example"
        );
        assert!(r
            .headers()
            .get("access-control-allow-credentials")
            .is_none());
        assert!(
            cors.preflight(&Method::POST, &pre).is_none(),
            "not a preflight"
        );
        let evil = headers(&[
            ("origin", "https://evil.example"),
            ("access-control-request-method", "POST"),
        ]);
        assert!(cors.preflight(&Method::OPTIONS, &evil).is_none());
    }
}
