//! The published contract: the OpenAPI document served at `/openapi.json`, generated from
//! the request and response types (their `ToSchema`) and the handlers' annotations, so that
//! it cannot drift from the code. Links tie the operations that make an id (a sale, an
//! order, a payment intent) to those that take it, so that a client, or a tool such as
//! schemathesis, can walk from one to the next with real ids.

use std::sync::OnceLock;

use utoipa::openapi::link::LinkBuilder;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{OpenApi as Document, RefOr};
use utoipa::{Modify, OpenApi};

use super::{admin, antibot, buyer, ops, provider, simulated};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "seckill",
        description = "A flash-sale service. Every error body is {code, message}; ids are \
                       64-bit integers written as strings."
    ),
    paths(
        buyer::login::request_code,
        buyer::login::login,
        buyer::login::me,
        buyer::login::exchange,
        buyer::catalogue::list_sales,
        buyer::catalogue::get_sale,
        buyer::catalogue::get_stock,
        buyer::catalogue::server_time,
        super::purchase,
        buyer::orders::get_order,
        buyer::orders::list_orders,
        buyer::payments::pay,
        buyer::payments::cancel,
        antibot::token,
        antibot::captcha,
        buyer::queue::join,
        buyer::queue::ticket,
        provider::notify,
        simulated::simulate,
        simulated::simulated_intent,
        simulated::simulated_pay,
        admin::sales::create_sale,
        admin::sales::admin_list_sales,
        admin::sales::upsert_by_ref,
        admin::sales::approve_sale,
        admin::sales::edit_sale,
        admin::sales::delete_sale,
        admin::sales::end_sale,
        admin::sales::pause_sale,
        admin::sales::resume_sale,
        admin::books::sale_stats,
        admin::books::sale_audit,
        admin::books::sale_order_ids,
        admin::books::reconcile,
        admin::books::repair,
        admin::books::start_recount,
        admin::books::recount,
        admin::books::journal,
        admin::books::live,
        admin::books::rooms,
        admin::keys::create_key,
        admin::keys::list_keys,
        admin::keys::rotate_key,
        admin::keys::revoke_key,
        ops::healthz,
        ops::readyz,
        ops::metrics,
        ops::openapi,
    ),
    components(
        schemas(super::http::input::Id),
        responses(super::http::error::ErrorResponse)
    ),
    modifiers(&SecuritySchemes, &KeyScopes, &IdempotencyKeys, &Links, &OptionalBodies)
)]
pub struct ApiDoc;

/// The document, as JSON text: built once.
pub fn document() -> &'static str {
    static DOCUMENT: OnceLock<String> = OnceLock::new();
    DOCUMENT.get_or_init(|| {
        let mut doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or_default();
        camel_case_links(&mut doc);
        serde_json::to_string_pretty(&doc).unwrap_or_default()
    })
}

/// utoipa 5.5 writes a link's fields in snake case (`operation_id`); OpenAPI spells them
/// in camel case (`operationId`), and tools ignore a link without one.
fn camel_case_links(doc: &mut serde_json::Value) {
    let Some(paths) = doc.get_mut("paths").and_then(|p| p.as_object_mut()) else {
        return;
    };
    for item in paths.values_mut() {
        let Some(item) = item.as_object_mut() else {
            continue;
        };
        for op in item.values_mut() {
            let Some(responses) = op.get_mut("responses").and_then(|r| r.as_object_mut()) else {
                continue;
            };
            for response in responses.values_mut() {
                let Some(links) = response.get_mut("links").and_then(|l| l.as_object_mut()) else {
                    continue;
                };
                for link in links.values_mut() {
                    let Some(link) = link.as_object_mut() else {
                        continue;
                    };
                    for (snake, camel) in [
                        ("operation_id", "operationId"),
                        ("operation_ref", "operationRef"),
                        ("request_body", "requestBody"),
                    ] {
                        if let Some(v) = link.remove(snake) {
                            link.insert(camel.to_string(), v);
                        }
                    }
                }
            }
        }
    }
}

/// The bearer tokens: a buyer's (from `/api/auth/login`) and the admin token.
struct SecuritySchemes;

impl Modify for SecuritySchemes {
    fn modify(&self, doc: &mut Document) {
        let components = doc.components.get_or_insert_with(Default::default);
        let bearer = |what: &str| {
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(what))
                    .build(),
            )
        };
        components.add_security_scheme(
            "user",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("JWT")
                    .description(Some(
                        "a buyer's token: seckill's own (from /api/auth/login), or with shop \
                         sign-in on a JWT from the shop's issuer (RS256, ES256, EdDSA or \
                         HS256; iss, aud, exp and nbf checked)",
                    ))
                    .build(),
            ),
        );
        components.add_security_scheme(
            "admin",
            bearer("the bootstrap admin token (SECKILL_ADMIN_TOKEN): every scope"),
        );
        components.add_security_scheme(
            "api_key",
            bearer(
                "an admin API key (`sk_{id}_{secret}`, from POST /api/admin/keys) holding the \
                 scope the call names: sales:read, sales:write, orders:read, payments, \
                 operations, metrics or keys; a key without it gets 403 forbidden naming the \
                 scope",
            ),
        );
    }
}

/// Each admin call (and `/metrics`) also takes an API key holding its scope, as
/// `auth::keys::scope_for` decides it: published from that one table.
struct KeyScopes;

impl Modify for KeyScopes {
    fn modify(&self, doc: &mut Document) {
        for (path, item) in doc.paths.paths.iter_mut() {
            for (method, op) in [
                (axum::http::Method::GET, &mut item.get),
                (axum::http::Method::POST, &mut item.post),
                (axum::http::Method::PATCH, &mut item.patch),
                (axum::http::Method::PUT, &mut item.put),
                (axum::http::Method::DELETE, &mut item.delete),
            ] {
                // Only where a credential is asked for (`/metrics` may be public).
                let Some(op) = op.as_mut().filter(|op| op.security.is_some()) else {
                    continue;
                };
                if !(path.starts_with("/api/admin") || path == "/metrics") {
                    continue;
                }
                let Some(scope) = super::auth::keys::scope_for(&method, path) else {
                    continue;
                };
                op.security.get_or_insert_with(Vec::new).push(
                    utoipa::openapi::security::SecurityRequirement::new("api_key", [scope.name()]),
                );
            }
        }
    }
}

/// The creating calls that honour `Idempotency-Key`: the router layers them with
/// `idempotency::idempotent`, and the purchase keeps its key in the gate.
const IDEMPOTENT: [&str; 5] = ["create_sale", "pay", "cancel", "create_key", "purchase"];

const KEPT_ANSWER: &str = "1 to 255 printable ASCII characters, unique per request: a retry \
     with the same key and request answers the first answer again (with Idempotent-Replayed: \
     true) for 24 hours, on every instance; the same key with another request answers 422 \
     idempotency_key_reused; a retry while the first call runs waits for it up to 5 s, then \
     answers 409 idempotency_in_progress";

const KEPT_PURCHASE: &str = "1 to 255 printable ASCII characters, unique per purchase and \
     kept per buyer and sale: a retry of a purchase that bought answers its order again (200 \
     ok, the first order_id) for 24 hours, on every instance, and takes nothing, even once \
     the sale has sold out or ended; the same key with another quantity answers 422 \
     idempotency_key_reused. A refused purchase changed nothing and keeps nothing: its retry \
     is decided again";

/// Declares the `Idempotency-Key` header, and its answers, on `IDEMPOTENT`.
struct IdempotencyKeys;

impl Modify for IdempotencyKeys {
    fn modify(&self, doc: &mut Document) {
        use utoipa::openapi::path::{ParameterBuilder, ParameterIn};
        for item in doc.paths.paths.values_mut() {
            for op in operations_of_mut(item) {
                let named = op
                    .operation_id
                    .as_deref()
                    .is_some_and(|id| IDEMPOTENT.contains(&id));
                if !named {
                    continue;
                }
                let purchase = op.operation_id.as_deref() == Some("purchase");
                let header = ParameterBuilder::new()
                    .name("Idempotency-Key")
                    .parameter_in(ParameterIn::Header)
                    .required(utoipa::openapi::Required::False)
                    .description(Some(if purchase { KEPT_PURCHASE } else { KEPT_ANSWER }))
                    .schema(Some(
                        utoipa::openapi::ObjectBuilder::new()
                            .schema_type(utoipa::openapi::schema::Type::String)
                            .min_length(Some(1))
                            .max_length(Some(255))
                            .pattern(Some("^[!-~]{1,255}$")),
                    ))
                    .build();
                op.parameters.get_or_insert_with(Vec::new).push(header);
                let statuses: &[&str] = if purchase { &["422"] } else { &["409", "422"] };
                for status in statuses {
                    op.responses
                        .responses
                        .entry(status.to_string())
                        .or_insert_with(|| {
                            RefOr::Ref(utoipa::openapi::Ref::from_response_name("ErrorResponse"))
                        });
                }
            }
        }
    }
}

/// Operations whose body may be left out entirely (each field has its default).
const OPTIONAL_BODIES: [&str; 2] = ["purchase", "repair"];

/// Marks the bodies of `OPTIONAL_BODIES` as not required (`request_body = Option<T>` would
/// also publish `null` as a body, which the server refuses).
struct OptionalBodies;

impl Modify for OptionalBodies {
    fn modify(&self, doc: &mut Document) {
        for item in doc.paths.paths.values_mut() {
            for op in operations_of_mut(item) {
                let optional = op
                    .operation_id
                    .as_deref()
                    .is_some_and(|id| OPTIONAL_BODIES.contains(&id));
                if let (true, Some(body)) = (optional, op.request_body.as_mut()) {
                    body.required = Some(utoipa::openapi::Required::False);
                }
            }
        }
    }
}

/// Where an id comes from, and which operations take it: (operation that answers it,
/// status, JSON pointer into its body, path prefix of the operations that take it as
/// `{id}`).
const LINKS: [(&str, &str, &str, &str); 10] = [
    ("create_sale", "201", "/id", "/api/admin/sales/{id}"),
    ("create_sale", "201", "/id", "/api/sales/{id}"),
    // An approved sale is the one buyers can see and buy.
    ("approve_sale", "200", "/id", "/api/admin/sales/{id}"),
    ("approve_sale", "200", "/id", "/api/sales/{id}"),
    ("admin_list_sales", "200", "/0/id", "/api/admin/sales/{id}"),
    ("list_sales", "200", "/0/id", "/api/sales/{id}"),
    ("purchase", "200", "/order_id", "/api/orders/{id}"),
    ("list_orders", "200", "/0/id", "/api/orders/{id}"),
    ("pay", "200", "/intent_id", "/api/simulated-pay/{id}"),
    ("pay", "200", "/intent_id", "/api/admin/payments/{id}"),
];

/// Links from each answer that makes an id to every operation that takes it.
struct Links;

impl Modify for Links {
    fn modify(&self, doc: &mut Document) {
        // (operation id, path) of every operation.
        let mut operations = Vec::new();
        for (path, item) in &doc.paths.paths {
            for op in operations_of(item) {
                if let Some(id) = &op.operation_id {
                    operations.push((id.clone(), path.clone()));
                }
            }
        }
        let mut paths = std::mem::take(&mut doc.paths.paths);
        for item in paths.values_mut() {
            for op in operations_of_mut(item) {
                let Some(from) = op.operation_id.clone() else {
                    continue;
                };
                for (source, status, pointer, prefix) in LINKS {
                    if source != from {
                        continue;
                    }
                    let Some(RefOr::T(response)) = op.responses.responses.get_mut(status) else {
                        continue;
                    };
                    for (target, path) in &operations {
                        if !path.starts_with(prefix) {
                            continue;
                        }
                        let link = LinkBuilder::new()
                            .operation_id(target.clone())
                            .parameter("id", format!("$response.body#{pointer}"))
                            .build();
                        response.links.insert(target.clone(), RefOr::T(link));
                    }
                }
            }
        }
        doc.paths.paths = paths;
    }
}

fn operations_of(item: &utoipa::openapi::PathItem) -> Vec<&utoipa::openapi::path::Operation> {
    [
        &item.get,
        &item.put,
        &item.post,
        &item.delete,
        &item.patch,
        &item.head,
        &item.options,
        &item.trace,
    ]
    .into_iter()
    .flatten()
    .collect()
}

fn operations_of_mut(
    item: &mut utoipa::openapi::PathItem,
) -> Vec<&mut utoipa::openapi::path::Operation> {
    [
        &mut item.get,
        &mut item.put,
        &mut item.post,
        &mut item.delete,
        &mut item.patch,
        &mut item.head,
        &mut item.options,
        &mut item.trace,
    ]
    .into_iter()
    .flatten()
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The document names every route the router serves (read from the router's source),
    /// and every operation is reachable from one that makes its id.
    #[test]
    fn the_document_covers_every_route_and_links_every_id() {
        let doc: serde_json::Value = serde_json::from_str(document()).unwrap();
        let paths = doc["paths"].as_object().unwrap();
        let router = include_str!("mod.rs");
        let routes: Vec<&str> = router
            .split(".route(")
            .skip(1)
            .filter_map(|rest| rest.trim_start().strip_prefix('"')?.split('"').next())
            .collect();
        assert!(routes.len() >= 30, "{routes:?}");
        for route in routes {
            assert!(
                paths.contains_key(route),
                "{route} is served but not published"
            );
        }
        let created = &doc["paths"]["/api/admin/sales"]["post"]["responses"]["201"]["links"];
        for op in [
            "approve_sale",
            "edit_sale",
            "end_sale",
            "get_sale",
            "purchase",
        ] {
            assert_eq!(
                created[op]["parameters"]["id"], "$response.body#/id",
                "{op}: {created}"
            );
        }
        let bought = &doc["paths"]["/api/sales/{id}/purchase"]["post"]["responses"]["200"];
        for op in ["get_order", "pay", "cancel"] {
            assert_eq!(
                bought["links"][op]["parameters"]["id"],
                "$response.body#/order_id"
            );
        }
    }
}
