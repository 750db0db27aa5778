//! Admin API keys against two instances on Redis + PostgreSQL: each key does what its
//! scopes allow and gets 403 `forbidden` naming the scope otherwise, changing nothing; a
//! key never grants more than it holds; rotation and revocation reach every instance
//! within seconds; only the secret's hash is stored; the admin token keeps working.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{json, Value};

use crate::common::{self, Api, Server, Sql};

async fn two_instances() -> (Server, Server, String) {
    let db = common::fresh_database(Sql::Postgres).await;
    let env = vec![
        ("SECKILL_DATABASE_URL".to_string(), db.clone()),
        ("SECKILL_REDIS_URL".to_string(), common::redis_url()),
        ("SECKILL_REDIS_PREFIX".to_string(), common::unique("keys")),
        ("SECKILL_DEV".to_string(), "0".to_string()),
        // The keys rotated and revoked here are tried again on purpose: not guesses to
        // throttle (tests/e2e/security.rs tries the throttle).
        ("SECKILL_WRONG_TOKEN_LIMIT".to_string(), "50".to_string()),
    ];
    let a = Server::start(env.clone(), vec!["serve".into()]).await;
    let b = Server::start(env, vec!["serve".into(), "--no-writer".into()]).await;
    (a, b, db)
}

async fn make_key(admin: &Api, name: &str, scopes: &[&str]) -> (String, String) {
    let made = admin
        .admin_call(
            Method::POST,
            "/api/admin/keys",
            Some(&json!({"name": name, "scopes": scopes})),
        )
        .await
        .expect(201);
    let secret = made["secret"].as_str().unwrap().to_string();
    assert!(secret.starts_with("sk_"), "{made}");
    (made["id"].as_str().unwrap().to_string(), secret)
}

fn new_sale() -> Value {
    let now = time::OffsetDateTime::now_utc();
    json!({
        "title": "made by a key",
        "price_cents": 100,
        "stock": 5,
        "begins_at": common::rfc3339(now + time::Duration::hours(1)),
        "ends_at": common::rfc3339(now + time::Duration::hours(2)),
    })
}

/// Waits until `key`'s call to `path` on `api` answers `status`; how long it took.
async fn until_status(api: &Api, key: &str, path: &str, status: u16) -> Duration {
    let started = Instant::now();
    loop {
        let got = api.get(path, Some(key)).await.status;
        if got == status {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{path} still answers {got}, not {status}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_do_what_their_scopes_allow_on_every_instance_until_revoked() {
    let (a, b, db) = two_instances().await;
    let admin = a.api();
    let (sync_id, sync) = make_key(&admin, "catalogue sync", &["sales:read", "sales:write"]).await;
    let (dash_id, dash) = make_key(&admin, "dashboard", &["sales:read", "metrics"]).await;
    let (at_a, at_b) = (Api::new(&a.base), Api::new(&b.base));

    // A key made on one instance works on the other within seconds.
    until_status(&at_b, &sync, "/api/admin/sales", 200).await;
    let created = at_b
        .post("/api/admin/sales", Some(&sync), Some(&new_sale()))
        .await
        .expect(201);
    let sale = created["id"].as_str().unwrap().to_string();

    // Without the scope: 403 naming it, and nothing changes.
    let before = admin
        .admin_sales()
        .await
        .expect(200)
        .as_array()
        .unwrap()
        .len();
    for (api, key, method, path, scope) in [
        (
            &at_a,
            &dash,
            Method::POST,
            "/api/admin/sales".to_string(),
            "sales:write",
        ),
        (
            &at_b,
            &dash,
            Method::POST,
            format!("/api/admin/sales/{sale}/approve"),
            "sales:write",
        ),
        (
            &at_a,
            &sync,
            Method::POST,
            format!("/api/admin/sales/{sale}/end"),
            "operations",
        ),
        (&at_a, &sync, Method::GET, "/metrics".to_string(), "metrics"),
        (
            &at_b,
            &sync,
            Method::GET,
            format!("/api/admin/sales/{sale}/order-ids"),
            "orders:read",
        ),
        (
            &at_a,
            &sync,
            Method::GET,
            "/api/admin/keys".to_string(),
            "keys",
        ),
    ] {
        let body = (method == Method::POST).then(new_sale);
        let answer = api
            .call(method.clone(), &path, Some(key), body.as_ref())
            .await;
        assert_eq!(
            answer.status_code(),
            (403, "forbidden".into()),
            "{method} {path}: {answer}"
        );
        let message = answer.body["message"].as_str().unwrap();
        assert!(message.contains(scope), "{path}: {message}");
    }
    assert_eq!(
        admin
            .admin_sales()
            .await
            .expect(200)
            .as_array()
            .unwrap()
            .len(),
        before
    );
    assert_eq!(admin.admin_sale(&sale).await.unwrap()["status"], "draft");
    assert_eq!(at_a.get("/metrics", Some(&dash)).await.status, 200);

    // A key that manages keys cannot grant what it lacks.
    let (_, keymaster) = make_key(&admin, "key manager", &["keys"]).await;
    let wider = at_a
        .post(
            "/api/admin/keys",
            Some(&keymaster),
            Some(&json!({"name": "x", "scopes": ["sales:write"]})),
        )
        .await;
    assert_eq!(wider.status_code(), (403, "forbidden".into()), "{wider}");
    let narrow = at_a
        .post(
            "/api/admin/keys",
            Some(&keymaster),
            Some(&json!({"name": "y", "scopes": ["keys"]})),
        )
        .await;
    assert_eq!(narrow.status, 201, "{narrow}");
    // Nor take over, or silence, a key holding more than it does.
    for (method, path) in [
        (Method::POST, format!("/api/admin/keys/{sync_id}/rotate")),
        (Method::DELETE, format!("/api/admin/keys/{sync_id}")),
    ] {
        let answer = at_a.call(method, &path, Some(&keymaster), None).await;
        assert_eq!(
            answer.status_code(),
            (403, "forbidden".into()),
            "{path}: {answer}"
        );
    }
    assert_eq!(at_a.get("/api/admin/sales", Some(&sync)).await.status, 200);

    // Listed with names, scopes and last use; never a secret. Only hashes in SQL.
    let listed = admin
        .admin_call(Method::GET, "/api/admin/keys", None)
        .await
        .expect(200);
    let text = listed.to_string();
    assert!(
        !text.contains(&sync[10..]) && !text.contains("secret"),
        "{text}"
    );
    common::eventually(10, "the sync key's last use is noted", || async {
        let listed = admin
            .admin_call(Method::GET, "/api/admin/keys", None)
            .await
            .expect(200);
        listed
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["id"] == sync_id.as_str() && k["last_used_at"].is_string())
    })
    .await;
    let store = seckill::store::Store::connect(&db, 2).await.unwrap();
    for row in store.api_keys().await.unwrap() {
        let stored = format!("{row:?}");
        for secret in [&sync, &dash, &keymaster] {
            assert!(!stored.contains(&secret[secret.len() - 40..]), "{stored}");
        }
    }

    // Rotated: the old secret dies here at once and there within seconds; the new one works.
    let rotated = admin
        .admin_call(
            Method::POST,
            &format!("/api/admin/keys/{sync_id}/rotate"),
            None,
        )
        .await
        .expect(200);
    let new_sync = rotated["secret"].as_str().unwrap().to_string();
    assert_eq!(at_a.get("/api/admin/sales", Some(&sync)).await.status, 401);
    assert_eq!(
        at_a.get("/api/admin/sales", Some(&new_sync)).await.status,
        200
    );
    let there = until_status(&at_b, &sync, "/api/admin/sales", 401).await;
    assert!(there < Duration::from_secs(4), "{there:?}");
    until_status(&at_b, &new_sync, "/api/admin/sales", 200).await;

    // Revoked: refused everywhere within seconds, listed as revoked, not revoked twice.
    let revoked = admin
        .admin_call(Method::DELETE, &format!("/api/admin/keys/{dash_id}"), None)
        .await
        .expect(200);
    assert!(revoked["revoked_at"].is_string(), "{revoked}");
    assert_eq!(at_a.get("/metrics", Some(&dash)).await.status, 401);
    let there = until_status(&at_b, &dash, "/metrics", 401).await;
    assert!(
        there < Duration::from_secs(4),
        "revocation took {there:?} to reach the other instance"
    );
    let again = admin
        .admin_call(Method::DELETE, &format!("/api/admin/keys/{dash_id}"), None)
        .await;
    assert_eq!(again.status, 409, "{again}");

    // Bad keys are 401; the bootstrap token keeps every scope.
    for bad in [
        "sk_",
        "sk_1_nope",
        &format!("sk_{sync_id}_{}", "0".repeat(64)),
        "sk_-1_x",
    ] {
        assert_eq!(
            at_a.get("/api/admin/sales", Some(bad)).await.status,
            401,
            "{bad}"
        );
    }
    for bad_body in [
        json!({"name": "", "scopes": ["metrics"]}),
        json!({"name": "n", "scopes": []}),
        json!({"name": "n", "scopes": ["root"]}),
    ] {
        let answer = admin
            .admin_call(Method::POST, "/api/admin/keys", Some(&bad_body))
            .await;
        assert_eq!(answer.status, 400, "{bad_body}: {answer}");
    }
    let metrics = admin.metrics().await;
    assert!(
        common::metric(&metrics, "seckill_api_keys_forbidden_total") >= 4,
        "{metrics}"
    );
}
