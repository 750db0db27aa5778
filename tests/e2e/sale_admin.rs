//! Managing sales through the admin API: a draft is edited and deleted, an approved sale
//! cannot be (409); a sale ended early turns away the next purchase on every instance at
//! once, and what it sold stays sold.

use crate::common;

use crate::common::{Api, Server, Sql};
use serde_json::json;

/// Creates a draft opening in an hour; its id.
async fn create_draft(api: &Api, title: &str, stock: i64) -> String {
    let created = api
        .create_sale(&json!({"title": title, "price_cents": 100, "stock": stock,
                             "begins_at": common::rfc3339_in(3600), "ends_at": common::rfc3339_in(7200)}))
        .await
        .expect(201);
    created["id"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafts_are_edited_and_deleted_approved_sales_are_not() {
    let server = Server::embedded(&[]).await;
    let api = server.api();
    let id = create_draft(&api, "draft", 5).await;

    let body = api
        .edit_sale(
            &id,
            &json!({"title": "renamed", "stock": 9, "ends_at": common::rfc3339_in(3 * 3600)}),
        )
        .await;
    assert_eq!(
        (body.status, body["status"].as_str()),
        (200, Some("draft")),
        "{body}"
    );
    let sale = api.admin_sale(&id).await.unwrap();
    assert_eq!(sale["title"], "renamed");
    assert_eq!(sale["stock"], 9);
    assert_eq!(sale["price_cents"], 100, "untouched settings stay");

    // A change that breaks the sale's rules changes nothing.
    let answer = api
        .edit_sale(&id, &json!({"ends_at": common::rfc3339_in(-3600)}))
        .await;
    assert_eq!(answer.status_code(), (400, "invalid_request".into()));
    let answer = api.edit_sale(&id, &json!({"stok": 1})).await;
    assert_eq!(answer.status, 400, "unknown fields are refused");
    assert_eq!(api.admin_sale(&id).await.unwrap()["stock"], 9);

    // Once approved: no edits, no deletion.
    assert_eq!(api.approve(&id).await.status, 200);
    let answer = api.edit_sale(&id, &json!({"stock": 1})).await;
    assert_eq!(answer.status_code(), (409, "conflict".into()), "{answer}");
    assert_eq!(api.delete_sale(&id).await.status, 409);
    assert_eq!(api.admin_sale(&id).await.unwrap()["stock"], 9);

    // A draft is deleted once; then it is gone, with what a recount of it left (schemathesis
    // found its recount still answered after the delete). A draft cannot be ended.
    let other = create_draft(&api, "gone", 1).await;
    assert_eq!(api.end_sale(&other).await.status, 409);
    let recount = format!("/api/admin/sales/{other}/recount");
    let started = api.admin_call(reqwest::Method::POST, &recount, None).await;
    assert_eq!(started.status, 202, "{started}");
    common::eventually(30, "the draft's recount ends", || async {
        api.admin_call(reqwest::Method::GET, &recount, None).await["state"] == "done"
    })
    .await;
    let answer = api.delete_sale(&other).await;
    assert_eq!(
        (answer.status, answer["status"].as_str()),
        (200, Some("deleted")),
        "{answer}"
    );
    assert_eq!(api.delete_sale(&other).await.status, 404);
    assert!(api.admin_sale(&other).await.is_none());
    let gone = api.admin_call(reqwest::Method::GET, &recount, None).await;
    assert_eq!(gone.status, 404, "{gone}");
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
    let (api_a, api_b) = (a.api(), b.api());
    let sale = api_a.open_sale(100, 1).await;
    let signer = seckill::edge::auth::TokenSigner::new(&secret);
    let buy = |api: &Api, user: i64| {
        let token = signer.sign(user, seckill::clock::wall_ms() / 1000 + 600);
        let (api, sale) = (api.clone(), sale.clone());
        async move {
            api.buy(&token, &sale).await.json()["code"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        }
    };
    for user in 1..=3 {
        assert_eq!(buy(&api_b, user).await, "ok");
    }

    let body = api_a.end_sale(&sale).await;
    assert_eq!(
        (body.status, body["status"].as_str()),
        (200, Some("ended")),
        "{body}"
    );
    // The other instance's very next purchase, before its sale cache refreshes.
    assert_eq!(buy(&api_b, 4).await, "ended");
    assert_eq!(buy(&api_a, 5).await, "ended");

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
    assert!(row.ends_at <= seckill::clock::wall_ms());
    // Each instance's sale cache (the public pages) follows within its refresh.
    common::eventually(10, "the other instance shows the sale ended", || async {
        api_b.stock(&sale).await.json()["state"] == "ended"
    })
    .await;
    // Ending again is harmless and never reopens it.
    let again = api_a.end_sale(&sale).await;
    assert_eq!((again.status, &again["ends_at"]), (200, &body["ends_at"]));
}
