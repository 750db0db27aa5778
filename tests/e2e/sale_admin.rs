//! Managing sales through the admin API: a draft is edited and deleted, an approved sale
//! cannot be (409); a sale ended early turns away the next purchase on every instance at
//! once, and what it sold stays sold.

mod common;

use common::{Server, Sql};
use serde_json::json;

async fn call(
    c: &reqwest::Client,
    s: &Server,
    method: reqwest::Method,
    path: &str,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    let mut req = c
        .request(method, format!("{}{path}", s.base))
        .bearer_auth(&s.admin);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or_default())
}

fn in_hours(h: i64) -> String {
    let t = time::OffsetDateTime::now_utc() + time::Duration::hours(h);
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap()
}

/// Creates a draft opening in an hour; its id.
async fn create_draft(c: &reqwest::Client, s: &Server, title: &str, stock: i64) -> String {
    let (status, created) = call(
        c,
        s,
        reqwest::Method::POST,
        "/api/admin/sales",
        Some(json!({"title": title, "price_cents": 100, "stock": stock,
                    "begins_at": in_hours(1), "ends_at": in_hours(2)})),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    created["id"].as_str().unwrap().to_string()
}

async fn admin_sale(c: &reqwest::Client, s: &Server, id: &str) -> Option<serde_json::Value> {
    let (_, all) = call(c, s, reqwest::Method::GET, "/api/admin/sales", None).await;
    all.as_array()?.iter().find(|v| v["id"] == id).cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafts_are_edited_and_deleted_approved_sales_are_not() {
    use reqwest::Method;
    let server = Server::embedded(&[]).await;
    let c = common::client();
    let id = create_draft(&c, &server, "draft", 5).await;
    let path = format!("/api/admin/sales/{id}");

    let (status, body) = call(
        &c,
        &server,
        Method::PATCH,
        &path,
        Some(json!({"title": "renamed", "stock": 9, "ends_at": in_hours(3)})),
    )
    .await;
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("draft")),
        "{body}"
    );
    let sale = admin_sale(&c, &server, &id).await.unwrap();
    assert_eq!(sale["title"], "renamed");
    assert_eq!(sale["stock"], 9);
    assert_eq!(sale["price_cents"], 100, "untouched settings stay");

    // A change that breaks the sale's rules changes nothing.
    let (status, body) = call(
        &c,
        &server,
        Method::PATCH,
        &path,
        Some(json!({"ends_at": in_hours(-1)})),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("invalid_request"))
    );
    let (status, _) = call(&c, &server, Method::PATCH, &path, Some(json!({"stok": 1}))).await;
    assert_eq!(status, 400, "unknown fields are refused");
    assert_eq!(admin_sale(&c, &server, &id).await.unwrap()["stock"], 9);

    // Once approved: no edits, no deletion.
    let (status, _) = call(&c, &server, Method::POST, &format!("{path}/approve"), None).await;
    assert_eq!(status, 200);
    let (status, body) = call(&c, &server, Method::PATCH, &path, Some(json!({"stock": 1}))).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("conflict")),
        "{body}"
    );
    let (status, _) = call(&c, &server, Method::DELETE, &path, None).await;
    assert_eq!(status, 409);
    assert_eq!(admin_sale(&c, &server, &id).await.unwrap()["stock"], 9);

    // A draft is deleted once; then it is gone. A draft cannot be ended.
    let other = create_draft(&c, &server, "gone", 1).await;
    let (status, _) = call(
        &c,
        &server,
        Method::POST,
        &format!("/api/admin/sales/{other}/end"),
        None,
    )
    .await;
    assert_eq!(status, 409);
    let (status, body) = call(
        &c,
        &server,
        Method::DELETE,
        &format!("/api/admin/sales/{other}"),
        None,
    )
    .await;
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("deleted")),
        "{body}"
    );
    let (status, _) = call(
        &c,
        &server,
        Method::DELETE,
        &format!("/api/admin/sales/{other}"),
        None,
    )
    .await;
    assert_eq!(status, 404);
    assert!(admin_sale(&c, &server, &other).await.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sale_ended_early_stops_purchases_on_every_instance_at_once() {
    let db = common::fresh_database(Sql::Postgres).await;
    let secret = common::unique("secret");
    let env = vec![
        ("SECKILL_DATABASE_URL".to_string(), db.clone()),
        ("SECKILL_REDIS_URL".to_string(), common::redis_url()),
        ("SECKILL_REDIS_PREFIX".to_string(), common::unique("end")),
        ("SECKILL_TOKEN_SECRET".to_string(), secret.clone()),
    ];
    let a = Server::start(env.clone(), vec!["serve".into()]).await;
    let b = Server::start(env, vec!["serve".into(), "--no-writer".into()]).await;
    let c = common::client();
    let sale = common::open_sale(&c, &a, 100, 1).await;
    let signer = seckill::edge::auth::TokenSigner::new(&secret);
    let buy = |s: &Server, user: i64| {
        let token = signer.sign(user, seckill::now_ms() / 1000 + 600);
        let url = format!("{}/api/sales/{sale}/purchase", s.base);
        let c = c.clone();
        async move {
            let r = c.post(url).bearer_auth(token).send().await.unwrap();
            let body: serde_json::Value = r.json().await.unwrap();
            body["code"].as_str().unwrap_or_default().to_string()
        }
    };
    for user in 1..=3 {
        assert_eq!(buy(&b, user).await, "ok");
    }

    let (status, body) = call(
        &c,
        &a,
        reqwest::Method::POST,
        &format!("/api/admin/sales/{sale}/end"),
        None,
    )
    .await;
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("ended")),
        "{body}"
    );
    // The other instance's very next purchase, before its sale cache refreshes.
    assert_eq!(buy(&b, 4).await, "ended");
    assert_eq!(buy(&a, 5).await, "ended");

    // What was sold stays sold.
    let store = seckill::store::Store::connect(&db, 2).await.unwrap();
    let id: i64 = sale.parse().unwrap();
    common::eventually(30, "the three orders are written", || {
        let store = store.clone();
        async move { store.orders_of_sale(id).await.unwrap().len() == 3 }
    })
    .await;
    let row = store.sale(id).await.unwrap().unwrap();
    assert_eq!(row.stock, 97);
    assert!(row.ends_at <= seckill::now_ms());
    // Each instance's sale cache (the public pages) follows within its refresh.
    common::eventually(10, "the other instance shows the sale ended", || async {
        let url = format!("{}/api/sales/{sale}/stock", b.base);
        common::get_json(&c, url, None).await["state"] == "ended"
    })
    .await;
    // Ending again is harmless and never reopens it.
    let (status, again) = call(
        &c,
        &a,
        reqwest::Method::POST,
        &format!("/api/admin/sales/{sale}/end"),
        None,
    )
    .await;
    assert_eq!((status, &again["ends_at"]), (200, &body["ends_at"]));
}
