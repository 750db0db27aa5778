//! Safe retries with `Idempotency-Key` against two instances on Redis + PostgreSQL: a
//! retried creating call runs once, on whichever instance and after a restart; the same
//! key with another body is 422; concurrent retries create one thing; a new key's secret
//! is never kept to be replayed. A retried purchase buys once, on two instances and on an
//! embedded server, and still answers its order once the sale has sold out.

use reqwest::Method;
use serde_json::{json, Value};

use crate::common::{self, Api, Server, Sql};

fn sale_body(title: &str) -> Value {
    let now = time::OffsetDateTime::now_utc();
    json!({
        "title": title,
        "price_cents": 100,
        "stock": 5,
        "begins_at": common::rfc3339(now - time::Duration::seconds(5)),
        "ends_at": common::rfc3339(now + time::Duration::hours(1)),
    })
}

async fn sale_count(api: &Api) -> usize {
    api.admin_sales()
        .await
        .expect(200)
        .as_array()
        .unwrap()
        .len()
}

async fn with_key(
    api: &Api,
    method: Method,
    path: &str,
    bearer: &str,
    key: &str,
    body: Option<&Value>,
) -> common::api::Reply {
    let mut r = api
        .request(method, path)
        .bearer_auth(bearer)
        .header("Idempotency-Key", key);
    if let Some(b) = body {
        r = r.json(b);
    }
    Api::send(r).await
}

/// Two instances on Redis + PostgreSQL (the second without a writer), and their database.
async fn two_instances() -> (String, Server, Server) {
    let db = common::fresh_database(Sql::Postgres).await;
    let env = vec![
        ("SECKILL_DATABASE_URL".to_string(), db.clone()),
        ("SECKILL_REDIS_URL".to_string(), common::redis_url()),
        ("SECKILL_REDIS_PREFIX".to_string(), common::unique("idem")),
        ("SECKILL_DEV".to_string(), "1".to_string()),
    ];
    let a = Server::start(env.clone(), vec!["serve".into()]).await;
    let b = Server::start(env, vec!["serve".into(), "--no-writer".into()]).await;
    (db, a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_creating_call_runs_once_on_every_instance_and_after_a_restart() {
    let (_, mut a, b) = two_instances().await;
    let (at_a, at_b) = (a.api(), b.api());
    let admin = a.admin.clone();
    let sales_before = sale_count(&at_a).await;

    // The same sale created five times at once, on both instances: one sale.
    let body = sale_body("retried");
    let tries = futures_util::future::join_all((0..6).map(|i| {
        let api = if i % 2 == 0 {
            at_a.clone()
        } else {
            at_b.clone()
        };
        let (admin, body) = (admin.clone(), body.clone());
        async move {
            // A retry that waited its 5 s for a slow first call is told to ask again.
            loop {
                let r = with_key(
                    &api,
                    Method::POST,
                    "/api/admin/sales",
                    &admin,
                    "sync-42",
                    Some(&body),
                )
                .await;
                if r.code() != "idempotency_in_progress" {
                    return r;
                }
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
    }))
    .await;
    let ids: Vec<&Value> = tries.iter().map(|r| &r.body["id"]).collect();
    for r in &tries {
        assert_eq!(r.status, 201, "{r}");
    }
    assert!(ids.iter().all(|id| *id == ids[0]), "{ids:?}");
    assert!(
        tries
            .iter()
            .filter(|r| r.header("idempotent-replayed") == Some("true"))
            .count()
            >= 5
    );
    let sale = ids[0].as_str().unwrap().to_string();
    assert_eq!(sale_count(&at_b).await, sales_before + 1);

    // Another body under the same key: 422, nothing made.
    let other = with_key(
        &at_b,
        Method::POST,
        "/api/admin/sales",
        &admin,
        "sync-42",
        Some(&sale_body("other")),
    )
    .await;
    assert_eq!(
        other.status_code(),
        (422, "idempotency_key_reused".into()),
        "{other}"
    );
    // A bad key: 400, nothing made.
    let bad = with_key(
        &at_a,
        Method::POST,
        "/api/admin/sales",
        &admin,
        "",
        Some(&body),
    )
    .await;
    assert_eq!(bad.status, 400, "{bad}");
    assert_eq!(sale_count(&at_a).await, sales_before + 1);

    // A buyer's cancel retried: the first answer again, not 409 invalid_transition; another
    // buyer's same key is another key.
    at_a.approve(&sale).await.expect(200);
    let token = at_a
        .log_in(&common::test_phone(common::common_phone_block() + 901))
        .await;
    let order = at_a.buy(&token, &sale).await.expect(200)["order_id"]
        .as_str()
        .unwrap()
        .to_string();
    at_a.written(&token, &order).await;
    let path = format!("/api/orders/{order}/cancel");
    let first = with_key(&at_a, Method::POST, &path, &token, "cancel-1", None).await;
    assert_eq!(first.status, 200, "{first}");
    let again = with_key(&at_b, Method::POST, &path, &token, "cancel-1", None).await;
    assert_eq!((again.status, &again.body), (200, &first.body), "{again}");
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    let unkeyed = at_b.post(&path, Some(&token), None).await;
    assert_eq!(
        unkeyed.status, 409,
        "without a key a second cancel is refused: {unkeyed}"
    );

    // A key's secret is shown once: a replay names the key but not its secret.
    let made = with_key(
        &at_a,
        Method::POST,
        "/api/admin/keys",
        &admin,
        "key-1",
        Some(&json!({"name": "ci", "scopes": ["metrics"]})),
    )
    .await;
    assert_eq!(made.status, 201, "{made}");
    let replayed = with_key(
        &at_b,
        Method::POST,
        "/api/admin/keys",
        &admin,
        "key-1",
        Some(&json!({"name": "ci", "scopes": ["metrics"]})),
    )
    .await;
    assert_eq!(replayed.body["id"], made.body["id"]);
    assert!(
        !replayed
            .text
            .contains(made.body["secret"].as_str().unwrap()),
        "{replayed}"
    );

    // After a restart, the same answers.
    a.kill();
    a.restart().await;
    let later = with_key(
        &at_a,
        Method::POST,
        "/api/admin/sales",
        &admin,
        "sync-42",
        Some(&body),
    )
    .await;
    assert_eq!((later.status, &later.body["id"]), (201, ids[0]), "{later}");
    assert_eq!(sale_count(&at_a).await, sales_before + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sale_carries_the_shops_reference_and_a_sync_job_upserts_by_it() {
    let server = Server::embedded(&[]).await;
    let api = server.api();
    let admin = server.admin.clone();
    let mut body = sale_body("SKU 1234 flash");
    body["external_ref"] = json!("sku-1234");
    let made = api.create_sale(&body).await.expect(201);
    let id = made["id"].as_str().unwrap().to_string();
    // Unique: another sale cannot take it.
    let twice = api.create_sale(&body).await;
    assert_eq!(twice.status, 409, "{twice}");
    assert!(
        twice.body["message"].as_str().unwrap().contains(&id),
        "{twice}"
    );
    // Looked up by it.
    let found = api
        .admin_call(Method::GET, "/api/admin/sales?external_ref=sku-1234", None)
        .await
        .expect(200);
    assert_eq!(found.as_array().unwrap().len(), 1, "{found}");
    assert_eq!(found[0]["id"], id.as_str());
    assert_eq!(found[0]["external_ref"], "sku-1234");
    let none = api
        .admin_call(Method::GET, "/api/admin/sales?external_ref=nope", None)
        .await
        .expect(200);
    assert_eq!(none, json!([]));
    // Upserted by it: the draft edited, then a new reference created.
    let mut changed = sale_body("SKU 1234, now 7 units");
    changed["stock"] = json!(7);
    let edited = api
        .call(
            Method::PUT,
            "/api/admin/sales/by-ref/sku-1234",
            Some(&admin),
            Some(&changed),
        )
        .await;
    assert_eq!(
        (edited.status, &edited.body["id"]),
        (200, &json!(id)),
        "{edited}"
    );
    assert_eq!(api.admin_sale(&id).await.unwrap()["stock"], 7);
    let created = api
        .call(
            Method::PUT,
            "/api/admin/sales/by-ref/sku-9",
            Some(&admin),
            Some(&changed),
        )
        .await;
    assert_eq!(created.status, 201, "{created}");
    assert_ne!(created.body["id"], json!(id));
    // A body naming another reference, or an approved sale: refused, nothing changed.
    let mut other = changed.clone();
    other["external_ref"] = json!("sku-1");
    let refused = api
        .call(
            Method::PUT,
            "/api/admin/sales/by-ref/sku-1234",
            Some(&admin),
            Some(&other),
        )
        .await;
    assert_eq!(refused.status, 400, "{refused}");
    api.approve(&id).await.expect(200);
    let late = api
        .call(
            Method::PUT,
            "/api/admin/sales/by-ref/sku-1234",
            Some(&admin),
            Some(&sale_body("late")),
        )
        .await;
    assert_eq!(late.status, 409, "{late}");
    assert_eq!(
        api.admin_sale(&id).await.unwrap()["title"],
        "SKU 1234, now 7 units"
    );
    let bad = api
        .call(
            Method::PUT,
            "/api/admin/sales/by-ref/%07bell",
            Some(&admin),
            Some(&changed),
        )
        .await;
    assert_eq!(bad.status, 400, "{bad}");
}

/// Buys through `apis` in turn with an `Idempotency-Key`, at most `limit` units a buyer:
/// six tries of one purchase at once make one order, answered six times; the key with
/// another quantity is 422; the same tries without a key buy up to the limit; once the
/// sale has sold out, the key still answers its order. Returns the sale, whose orders in
/// SQL the caller counts: 5 in all, one of them the keyed buyer's (whose phone it is given).
async fn a_purchase_retried(apis: &[Api]) -> (i64, String, String) {
    let at = |i: usize| &apis[i % apis.len()];
    let sale = at(0).open_sale(5, 3).await;
    let phones = common::common_phone_block();
    let buyer = |n| {
        let api = at(0).clone();
        async move { api.log_in(&common::test_phone(phones + n)).await }
    };
    let keyed = buyer(0).await;
    let buy = |i: usize, token: String, key: Option<&'static str>, quantity: i64| {
        let (api, path) = (at(i).clone(), format!("/api/sales/{sale}/purchase"));
        async move {
            let mut r = api
                .request(Method::POST, &path)
                .bearer_auth(&token)
                .json(&json!({ "quantity": quantity }));
            if let Some(key) = key {
                r = r.header("Idempotency-Key", key);
            }
            Api::send(r).await
        }
    };
    let tries =
        futures_util::future::join_all((0..6).map(|i| buy(i, keyed.clone(), Some("buy-1"), 1)))
            .await;
    for r in &tries {
        assert_eq!(r.status_code(), (200, "ok".into()), "{r}");
    }
    let order = tries[0].body["order_id"].as_str().unwrap().to_string();
    assert!(tries.iter().all(|r| r.body["order_id"] == order.as_str()));

    let other = buy(1, keyed.clone(), Some("buy-1"), 2).await;
    assert_eq!(
        other.status_code(),
        (422, "idempotency_key_reused".into()),
        "{other}"
    );
    // The same tries without a key: each buys, up to the limit of 3.
    let unkeyed = buyer(1).await;
    let mut bought = 0;
    for i in 0..5 {
        let r = buy(i, unkeyed.clone(), None, 1).await;
        if r.status == 200 {
            bought += 1;
        } else {
            assert_eq!(r.code(), "already_purchased", "{r}");
        }
    }
    assert_eq!(bought, 3, "without a key, retries buy up to the limit");
    // The last unit, then the first purchase retried on every instance: its order.
    let last = buyer(2).await;
    assert_eq!(buy(0, last.clone(), None, 1).await.status, 200);
    assert_eq!(buy(1, last, None, 1).await.code(), "sold_out");
    for i in 0..apis.len() {
        let again = buy(i, keyed.clone(), Some("buy-1"), 1).await;
        assert_eq!(again.status_code(), (200, "ok".into()), "{again}");
        assert_eq!(again.body["order_id"], order.as_str(), "{again}");
    }
    (sale.parse().unwrap(), order, common::test_phone(phones))
}

async fn orders_in_sql(db: &str, sale: i64, order: &str) {
    let store = seckill::store::Store::connect(db, 2).await.unwrap();
    common::eventually(30, "the sale's 5 orders are written", || async {
        store.orders_of_sale(sale).await.unwrap().len() == 5
    })
    .await;
    let orders = store.orders_of_sale(sale).await.unwrap();
    let keyed: Vec<_> = orders
        .iter()
        .filter(|o| o.id.to_string() == order)
        .collect();
    assert_eq!(keyed.len(), 1, "{orders:?}");
    let of_keyed_buyer = orders
        .iter()
        .filter(|o| o.user_id == keyed[0].user_id)
        .count();
    assert_eq!(of_keyed_buyer, 1, "one order for six tries: {orders:?}");
    assert_eq!(orders.iter().map(|o| o.quantity).sum::<i64>(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_purchase_buys_once_on_two_instances() {
    let (db, mut a, b) = two_instances().await;
    let (sale, order, phone) = a_purchase_retried(&[a.api(), b.api()]).await;
    orders_in_sql(&db, sale, &order).await;
    // After a restart, the same answer: the record is in Redis, beside the sale.
    a.kill();
    a.restart().await;
    let keyed = a.api().log_in(&phone).await;
    let again = keyed_purchase(&a.api(), sale, &keyed, "buy-1", 1).await;
    assert_eq!(again.status_code(), (200, "ok".into()), "{again}");
    assert_eq!(again.body["order_id"], order.as_str(), "{again}");
    orders_in_sql(&db, sale, &order).await;
}

/// A purchase of `quantity` with `Idempotency-Key: key`.
async fn keyed_purchase(
    api: &Api,
    sale: i64,
    token: &str,
    key: &str,
    quantity: i64,
) -> common::api::Reply {
    Api::send(
        api.request(Method::POST, &format!("/api/sales/{sale}/purchase"))
            .bearer_auth(token)
            .header("Idempotency-Key", key)
            .json(&json!({ "quantity": quantity })),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_purchase_buys_once_on_an_embedded_server_and_after_its_restart() {
    let mut server = Server::embedded(&[("SECKILL_DEV", "1")]).await;
    let (sale, order, phone) = a_purchase_retried(&[server.api()]).await;
    let db = server.env_value("SECKILL_DATABASE_URL");
    orders_in_sql(&db, sale, &order).await;
    // The gate's records live in its memory; SQL keeps them with their orders.
    server.kill();
    server.restart().await;
    let token = server.api().log_in(&phone).await;
    let again = keyed_purchase(&server.api(), sale, &token, "buy-1", 1).await;
    assert_eq!(again.status_code(), (200, "ok".into()), "{again}");
    assert_eq!(again.body["order_id"], order.as_str(), "{again}");
    let other = keyed_purchase(&server.api(), sale, &token, "buy-1", 2).await;
    assert_eq!(other.code(), "idempotency_key_reused", "{other}");
    orders_in_sql(&db, sale, &order).await;
}

/// An order acknowledged while only in the embedded order log (the database locked by
/// someone else), then a SIGKILL: the restart writes it to SQL with its key, and a retry
/// answers it rather than buying again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purchase_acknowledged_only_in_the_order_log_keeps_its_key_across_a_sigkill() {
    use sqlx::{Connection, Row};
    let mut server = Server::embedded(&[("SECKILL_DEV", "1")]).await;
    let api = server.api();
    let sale: i64 = api.open_sale(5, 3).await.parse().unwrap();
    let phone = common::test_phone(common::common_phone_block());
    let token = api.log_in(&phone).await;
    let db = server.env_value("SECKILL_DATABASE_URL");
    let mut locker = sqlx::sqlite::SqliteConnection::connect(&db).await.unwrap();
    sqlx::query("BEGIN EXCLUSIVE")
        .execute(&mut locker)
        .await
        .unwrap();
    let first = keyed_purchase(&api, sale, &token, "press-1", 1).await;
    assert_eq!(first.status_code(), (200, "ok".into()), "{first}");
    let order = first.body["order_id"].as_str().unwrap().to_string();
    async fn in_sql(conn: &mut sqlx::sqlite::SqliteConnection, sale: i64) -> i64 {
        let q = format!("SELECT COUNT(*) FROM orders WHERE sale_id = {sale}");
        sqlx::query(&q).fetch_one(conn).await.unwrap().get(0)
    }
    assert_eq!(
        in_sql(&mut locker, sale).await,
        0,
        "the order is only in the log"
    );
    server.kill();
    sqlx::query("ROLLBACK").execute(&mut locker).await.unwrap();
    drop(locker);
    server.restart().await;
    let token = server.api().log_in(&phone).await;
    for _ in 0..3 {
        let again = keyed_purchase(&server.api(), sale, &token, "press-1", 1).await;
        assert_eq!(again.status_code(), (200, "ok".into()), "{again}");
        assert_eq!(again.body["order_id"], order.as_str(), "{again}");
    }
    let mut conn = sqlx::sqlite::SqliteConnection::connect(&db).await.unwrap();
    assert_eq!(in_sql(&mut conn, sale).await, 1, "one order for four tries");
    let units: i64 = sqlx::query(&format!("SELECT stock FROM sales WHERE id = {sale}"))
        .fetch_one(&mut conn)
        .await
        .unwrap()
        .get(0);
    assert_eq!(units, 4);
}
