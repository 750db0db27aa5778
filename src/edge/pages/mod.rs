//! The web pages: the buyer's list of sales, sale page, orders, the simulated provider's
//! pay page, and the admin dashboard. Static shells and scripts compiled into the binary
//! (`assets/`), no build step and nothing fetched from elsewhere; every page talks to the
//! same JSON API as any client, so the pages never reach past the contract.
//!
//! Everything here is identical for every visitor and every sale id, so it is cacheable
//! by a CDN (ETag, Cache-Control); live state is only ever fetched by the scripts. Pages
//! carry a strict Content-Security-Policy: scripts and styles only from this origin, no
//! inline code. This module must never touch the purchase path.

use std::sync::OnceLock;

use axum::extract::Path;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use sha2::{Digest, Sha256};

use super::http::error::ApiError;
use super::http::input::{client_holds, parse_id};

/// Scripts and styles only from this origin, no inline code, no plugins, no framing;
/// captchas are `data:` images; the API is on the same origin.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; \
     base-uri 'none'; frame-ancestors 'none'";

/// HTML shells may be kept a minute: a new release reaches browsers within one.
const PAGE_CACHE: &str = "public, max-age=60";
/// Assets are named by the release's digest in every page (`?v=`), so they may be kept
/// long; an ETag still answers revalidations cheaply.
const ASSET_CACHE: &str = "public, max-age=86400";

struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: Vec<u8>,
    etag: HeaderValue,
    cache: &'static str,
}

/// Every page: the shell (`assets/shell.html`: head, scripts, header) around its own body.
const SHELL: &str = include_str!("assets/shell.html");

/// The header of the buyer's pages, and of the admin's.
const BUYER_HEADER: &str = r#"<header class="top">
<a class="brand" href="/">seckill</a>
<nav aria-label="Main"><a href="/">Sales</a> · <a href="/orders">My orders</a></nav>
<div class="who" id="who"></div>
</header>"#;
const ADMIN_HEADER: &str = r#"<header class="top">
<a class="brand" href="/admin">seckill admin</a>
<nav aria-label="Main"><a href="/">Buyer's view</a></nav>
<div class="who"><button type="button" id="signout" class="hidden">Sign out</button></div>
</header>"#;

/// (name, title, its script, its header, its body).
const PAGES: [(&str, &str, &str, &str, &str); 5] = [
    (
        "index.html",
        "Flash sales · seckill",
        "index.js",
        BUYER_HEADER,
        include_str!("assets/index.html"),
    ),
    (
        "sale.html",
        "Sale · seckill",
        "sale.js",
        BUYER_HEADER,
        include_str!("assets/sale.html"),
    ),
    (
        "orders.html",
        "My orders · seckill",
        "orders.js",
        BUYER_HEADER,
        include_str!("assets/orders.html"),
    ),
    (
        "pay.html",
        "Pay · simulated provider · seckill",
        "pay.js",
        BUYER_HEADER,
        include_str!("assets/pay.html"),
    ),
    (
        "admin.html",
        "Admin · seckill",
        "admin.js",
        ADMIN_HEADER,
        include_str!("assets/admin.html"),
    ),
];

const ASSETS: [(&str, &str, &str); 7] = [
    (
        "app.css",
        "text/css; charset=utf-8",
        include_str!("assets/app.css"),
    ),
    (
        "common.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/common.js"),
    ),
    (
        "index.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/index.js"),
    ),
    (
        "sale.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/sale.js"),
    ),
    (
        "orders.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/orders.js"),
    ),
    (
        "pay.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/pay.js"),
    ),
    (
        "admin.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/admin.js"),
    ),
];

fn etag_of(body: &[u8]) -> HeaderValue {
    // Hex digits in quotes: always a valid header value.
    HeaderValue::from_str(&super::http::input::etag_of(body))
        .unwrap_or_else(|_| HeaderValue::from_static("\"0\""))
}

/// Every page and asset, with its digest; built once.
fn all() -> &'static [Asset] {
    static ALL: OnceLock<Vec<Asset>> = OnceLock::new();
    ALL.get_or_init(|| {
        let mut release = Sha256::new();
        for (_, _, body) in ASSETS {
            release.update(body.as_bytes());
        }
        let version = super::auth::hex(&release.finalize()[..6]);
        let assets = ASSETS.iter().map(|(name, content_type, body)| Asset {
            name,
            content_type,
            body: body.as_bytes().to_vec(),
            etag: etag_of(body.as_bytes()),
            cache: ASSET_CACHE,
        });
        let pages = PAGES.iter().map(|(name, title, script, header, body)| {
            // The body last: nothing in it is taken for a placeholder.
            let body = SHELL
                .replace("{{title}}", title)
                .replace("{{script}}", script)
                .replace("{{v}}", &version)
                .replace("{{header}}", header)
                .replace("{{body}}", body)
                .into_bytes();
            Asset {
                name,
                content_type: "text/html; charset=utf-8",
                etag: etag_of(&body),
                body,
                cache: PAGE_CACHE,
            }
        });
        assets.chain(pages).collect()
    })
}

fn find(name: &str) -> Option<&'static Asset> {
    all().iter().find(|a| a.name == name)
}

/// Serves one page or asset: 304 when the client holds this version already.
fn serve(asset: &'static Asset, headers: &HeaderMap) -> Response {
    let fresh = asset
        .etag
        .to_str()
        .is_ok_and(|etag| client_holds(headers, etag));
    let mut response = if fresh {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        (
            [(header::CONTENT_TYPE, asset.content_type)],
            asset.body.as_slice(),
        )
            .into_response()
    };
    let h = response.headers_mut();
    h.insert(header::ETAG, asset.etag.clone());
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static(asset.cache));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    response
}

fn page(name: &'static str) -> impl Fn(HeaderMap) -> std::future::Ready<Response> + Clone {
    move |headers| {
        std::future::ready(match find(name) {
            Some(asset) => serve(asset, &headers),
            None => ApiError::NotFound("no such page".into()).into_response(),
        })
    }
}

/// A page whose path names one thing (a sale, a payment): the same shell for every id,
/// once the id is one.
fn page_with_id(
    name: &'static str,
) -> impl Fn(Path<String>, HeaderMap) -> std::future::Ready<Response> + Clone {
    move |Path(id), headers| {
        std::future::ready(match (parse_id(&id, "id"), find(name)) {
            (Ok(_), Some(asset)) => serve(asset, &headers),
            (Err(e), _) => e.into_response(),
            (_, None) => ApiError::NotFound("no such page".into()).into_response(),
        })
    }
}

async fn asset(Path(name): Path<String>, headers: HeaderMap) -> Response {
    match find(&name).filter(|a| !a.name.ends_with(".html")) {
        Some(asset) => serve(asset, &headers),
        None => ApiError::NotFound(format!("no asset named {name}")).into_response(),
    }
}

/// The pages' routes, merged into the API's router; the simulated provider's pay page
/// only when it is the configured provider.
pub fn routes<S: Clone + Send + Sync + 'static>(simulated_provider: bool) -> Router<S> {
    let routes = Router::new()
        .route("/", get(page("index.html")))
        .route("/sales/{id}", get(page_with_id("sale.html")))
        .route("/orders", get(page("orders.html")))
        .route("/admin", get(page("admin.html")))
        .route("/assets/{name}", get(asset));
    if simulated_provider {
        routes.route("/simulated-pay/{id}", get(page_with_id("pay.html")))
    } else {
        routes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_page_names_only_assets_that_exist() {
        for (name, ..) in PAGES {
            let page = find(name).expect("page");
            let html = std::str::from_utf8(&page.body).unwrap();
            assert!(!html.contains("{{"), "{name}: a placeholder left");
            for part in html.split("/assets/").skip(1) {
                let asset = part.split(['?', '"']).next().unwrap();
                assert!(
                    find(asset).is_some(),
                    "{name} names a missing asset {asset}"
                );
            }
            // The policy forbids inline code: a page holding some would break silently.
            assert!(!html.contains("<script>"), "{name} has an inline script");
            assert!(!html.contains(" style="), "{name} has an inline style");
            assert!(!html.contains(" onclick="), "{name} has an inline handler");
            assert!(html.contains("<html lang="), "{name} names no language");
            assert!(
                html.contains("name=\"viewport\""),
                "{name} is not sized for phones"
            );
        }
    }

    #[test]
    fn a_page_the_client_holds_is_answered_not_modified() {
        let sale = find("sale.html").unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(header::IF_NONE_MATCH, sale.etag.clone());
        assert_eq!(serve(sale, &headers).status(), StatusCode::NOT_MODIFIED);
        let fresh = serve(sale, &HeaderMap::new());
        assert_eq!(fresh.status(), StatusCode::OK);
        assert_eq!(fresh.headers()[header::ETAG], sale.etag);
        assert!(fresh
            .headers()
            .contains_key(header::CONTENT_SECURITY_POLICY));
    }
}
