//! The shop's own sign-in: tokens minted by a JOSE library from the shop's keys
//! (`tests/fixtures/shop`), against the real binary. Every algorithm buys; one person is one
//! buyer whatever the token; every malformed or forged token is refused naming its check
//! and changes nothing; the keys rotate mid-storm on two instances without a restart, and
//! keep working while the issuer is away.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use base64::Engine;
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use seckill::edge::auth::shop::buyer_id;
use seckill::store::Store;
use serde_json::{json, Value};

use crate::common::storm::{check_sql, instances_and_workers, storm_on, Arrival};
use crate::common::{self, Api, Server, Sql};

const ISSUER: &str = "https://id.shop.example";
const AUDIENCE: &str = "seckill";
const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/shop");

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{FIXTURES}/{name}")).unwrap()
}

fn now() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

/// A token of `kid`'s key (the fixture `{kid}.pem`) with these claims.
fn signed(kid: &str, claims: &Value) -> String {
    let pem = fixture(&format!("{kid}.pem"));
    let (alg, key) = match &kid[..2] {
        "rs" => (Algorithm::RS256, EncodingKey::from_rsa_pem(&pem).unwrap()),
        "ec" => (Algorithm::ES256, EncodingKey::from_ec_pem(&pem).unwrap()),
        _ => (Algorithm::EdDSA, EncodingKey::from_ed_pem(&pem).unwrap()),
    };
    let mut header = Header::new(alg);
    header.kid = Some(kid.into());
    encode(&header, claims, &key).unwrap()
}

fn claims_of(issuer: &str, subject: &str) -> Value {
    json!({"iss": issuer, "aud": AUDIENCE, "sub": subject, "exp": now() + 600, "iat": now()})
}

fn token(kid: &str, subject: &str) -> String {
    signed(kid, &claims_of(ISSUER, subject))
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// An embedded server taking the shop's tokens with keys from `jwks` (a fixture).
async fn shop_server(jwks: &str) -> Server {
    let jwks = format!("{FIXTURES}/{jwks}");
    Server::embedded(&[
        ("SECKILL_AUTH_ISSUER", ISSUER),
        ("SECKILL_AUTH_AUDIENCE", AUDIENCE),
        ("SECKILL_AUTH_JWKS_FILE", &jwks),
    ])
    .await
}

async fn me(api: &Api, token: &str) -> common::api::Reply {
    api.get("/api/auth/me", Some(token)).await
}

async fn store_of(server: &Server) -> Store {
    Store::connect(&server.env_value("SECKILL_DATABASE_URL"), 2)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shop_tokens_of_every_algorithm_buy_and_one_person_is_one_buyer() {
    let server = shop_server("jwks-all.json").await;
    let api = server.api();
    let sale = api.open_sale(10, 1).await;
    let alice = [
        token("rsa-1", "alice"),
        token("ec-1", "alice"),
        token("ed-1", "alice"),
    ];
    let alice_id = buyer_id(ISSUER, "alice").to_string();
    for t in &alice {
        let who = me(&api, t).await.expect(200);
        assert_eq!(
            who["user_id"],
            alice_id.as_str(),
            "one person whatever the key"
        );
    }
    assert_eq!(api.buy(&alice[0], &sale).await.expect(200)["code"], "ok");
    for t in &alice[1..] {
        let again = api.buy(t, &sale).await;
        assert_eq!(
            again.status_code(),
            (409, "already_purchased".into()),
            "{again}"
        );
    }
    for (kid, who) in [("ec-1", "bob"), ("ed-1", "carol"), ("rsa-2", "dave")] {
        assert_eq!(
            api.buy(&token(kid, who), &sale).await.expect(200)["code"],
            "ok"
        );
    }
    let store = store_of(&server).await;
    common::eventually(10, "each buyer recorded once", || async {
        let rows: Vec<_> = futures_util::future::join_all(
            ["alice", "bob", "carol", "dave"].map(|s| store.shop_buyer(buyer_id(ISSUER, s))),
        )
        .await;
        rows.iter()
            .all(|r| matches!(r, Ok(Some((i, _))) if i == ISSUER))
    })
    .await;
    assert_eq!(
        store.shop_buyer(buyer_id(ISSUER, "bob")).await.unwrap(),
        Some((ISSUER.to_string(), "bob".to_string()))
    );
    // Exchanged at sign-in: seckill's own token for the same buyer, expiring with the
    // shop token.
    let short = signed(
        "ed-1",
        &json!({"iss": ISSUER, "aud": AUDIENCE, "sub": "erin", "exp": now() + 120}),
    );
    let exchanged = api
        .post("/api/auth/exchange", Some(&short), None)
        .await
        .expect(200);
    let own = exchanged["token"].as_str().unwrap().to_string();
    assert_eq!(
        exchanged["user_id"],
        buyer_id(ISSUER, "erin").to_string().as_str()
    );
    let expires: i64 = own.split('.').nth(1).unwrap().parse().unwrap();
    assert!(expires <= now() + 120, "{own}");
    assert_eq!(api.buy(&own, &sale).await.expect(200)["code"], "ok");
    assert_eq!(
        api.buy(&short, &sale).await.status_code(),
        (409, "already_purchased".into()),
        "one buyer, either token"
    );
    let refused = api.post("/api/auth/exchange", Some(&own), None).await;
    assert_eq!(
        refused.status, 401,
        "only a shop token is exchanged: {refused}"
    );
    api.check_reconciled(&sale).await;
    let orders = api.orders(&alice[2]).await.expect(200);
    assert_eq!(
        orders.as_array().unwrap().len(),
        1,
        "alice's order, seen with another token: {orders}"
    );
}

/// Tokens that must each be refused, with a word of the message that names the check.
fn bad_tokens() -> Vec<(&'static str, String, &'static str)> {
    let good = token("rsa-1", "mallory");
    let parts: Vec<&str> = good.split('.').collect();
    let mut other = claims_of(ISSUER, "victim");
    other["exp"] = json!(now() + 600);
    let tampered = format!(
        "{}.{}.{}",
        parts[0],
        b64(other.to_string().as_bytes()),
        parts[2]
    );
    let mut flipped = parts[2].to_string();
    let middle = flipped.len() / 2;
    let other = if &flipped[middle..=middle] == "A" {
        "B"
    } else {
        "A"
    };
    flipped.replace_range(middle..=middle, other);
    let bad_sig = format!("{}.{}.{flipped}", parts[0], parts[1]);
    let none = format!(
        "{}.{}.",
        b64(br#"{"alg":"none","typ":"JWT","kid":"rsa-1"}"#),
        parts[1]
    );
    // Algorithm confusion: an HS256 token "signed" with the RSA public key's text, as a
    // verifier that took the algorithm from the token would check it.
    let mut hs = Header::new(Algorithm::HS256);
    hs.kid = Some("rsa-1".into());
    let confused = encode(
        &hs,
        &claims_of(ISSUER, "mallory"),
        &EncodingKey::from_secret(&fixture("rsa-1.pub.pem")),
    )
    .unwrap();
    let with = |change: &dyn Fn(&mut Value)| {
        let mut c = claims_of(ISSUER, "mallory");
        change(&mut c);
        signed("rsa-1", &c)
    };
    vec![
        (
            "expired",
            with(&|c| c["exp"] = json!(now() - 120)),
            "expired",
        ),
        (
            "not yet valid",
            with(&|c| c["nbf"] = json!(now() + 600)),
            "not yet valid",
        ),
        (
            "wrong issuer",
            signed("rsa-1", &claims_of("https://evil.example", "mallory")),
            "issuer",
        ),
        (
            "wrong audience",
            with(&|c| c["aud"] = json!("another-api")),
            "audience",
        ),
        (
            "no exp",
            with(&|c| {
                c.as_object_mut().unwrap().remove("exp");
            }),
            "exp",
        ),
        (
            "no subject",
            with(&|c| {
                c.as_object_mut().unwrap().remove("sub");
            }),
            "subject",
        ),
        (
            "unknown key",
            {
                let mut h = Header::new(Algorithm::RS256);
                h.kid = Some("rsa-9".into());
                encode(
                    &h,
                    &claims_of(ISSUER, "mallory"),
                    &EncodingKey::from_rsa_pem(&fixture("rsa-1.pem")).unwrap(),
                )
                .unwrap()
            },
            "key id",
        ),
        (
            "signed by another key",
            {
                let mut h = Header::new(Algorithm::RS256);
                h.kid = Some("rsa-1".into());
                encode(
                    &h,
                    &claims_of(ISSUER, "mallory"),
                    &EncodingKey::from_rsa_pem(&fixture("rsa-2.pem")).unwrap(),
                )
                .unwrap()
            },
            "signature",
        ),
        ("tampered payload", tampered, "signature"),
        ("tampered signature", bad_sig, "signature"),
        ("alg none", none, "none"),
        ("algorithm confusion", confused, "alg"),
        (
            "too large",
            with(&|c| c["pad"] = json!("x".repeat(10_000))),
            "longer than",
        ),
        (
            "not a JWT",
            "eyJhbGciOiJSUzI1NiJ9.!!!".to_string(),
            "not a JWT",
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_shop_token_is_refused_naming_its_check_and_changes_nothing() {
    let server = shop_server("jwks-rsa-1.json").await;
    let api = server.api();
    let sale = api.open_sale(10, 1).await;
    for (what, bad, says) in bad_tokens() {
        for answer in [api.buy(&bad, &sale).await, me(&api, &bad).await] {
            assert_eq!(
                answer.status_code(),
                (401, "unauthorized".into()),
                "{what}: {answer}"
            );
            let message = answer.body["message"].as_str().unwrap();
            assert!(message.contains(says), "{what}: {message}");
        }
    }
    assert_eq!(api.remaining(&sale).await, 10);
    let store = store_of(&server).await;
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    assert_eq!(
        store.shop_buyer(buyer_id(ISSUER, "mallory")).await.unwrap(),
        None
    );
    assert_eq!(
        store.shop_buyer(buyer_id(ISSUER, "victim")).await.unwrap(),
        None
    );
    assert!(store
        .orders_of_sale(sale.parse().unwrap())
        .await
        .unwrap()
        .is_empty());
    // The good token of the same buyer still buys.
    assert_eq!(
        api.buy(&token("rsa-1", "mallory"), &sale).await.expect(200)["code"],
        "ok"
    );
    let metrics = api.metrics().await;
    assert!(
        common::metric(&metrics, "seckill_shop_tokens_refused_total") >= 28,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_hs256_secret_takes_hs256_tokens_and_nothing_else() {
    let secret = "a-secret-the-shop-shares-with-seckill-0123";
    let server = Server::embedded(&[
        ("SECKILL_AUTH_ISSUER", ISSUER),
        ("SECKILL_AUTH_AUDIENCE", AUDIENCE),
        ("SECKILL_AUTH_HS256_SECRET", secret),
    ])
    .await;
    let api = server.api();
    let good = encode(
        &Header::new(Algorithm::HS256),
        &claims_of(ISSUER, "erin"),
        &EncodingKey::from_secret(secret.as_bytes()),
    )
    .unwrap();
    assert_eq!(
        me(&api, &good).await.expect(200)["user_id"],
        buyer_id(ISSUER, "erin").to_string().as_str()
    );
    let other_secret = encode(
        &Header::new(Algorithm::HS256),
        &claims_of(ISSUER, "erin"),
        &EncodingKey::from_secret(b"another-secret-of-32-bytes-or-more-000"),
    )
    .unwrap();
    for (bad, says) in [(other_secret, "signature"), (token("rsa-1", "erin"), "alg")] {
        let answer = me(&api, &bad).await;
        assert_eq!(answer.status, 401, "{answer}");
        assert!(
            answer.body["message"].as_str().unwrap().contains(says),
            "{answer}"
        );
    }
}

/// The shop's issuer as a plain HTTP server: a discovery document and a key set that the
/// test changes, or takes away.
struct Issuer {
    base: String,
    keys: Arc<Mutex<Value>>,
    down: Arc<AtomicBool>,
    fetches: Arc<AtomicUsize>,
}

async fn issuer(keys: &str) -> Issuer {
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let initial: Value = serde_json::from_slice(&fixture(keys)).unwrap();
    let (keys, down, fetches) = (
        Arc::new(Mutex::new(initial)),
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicUsize::new(0)),
    );
    let discovery = json!({"issuer": base, "jwks_uri": format!("{base}/keys")});
    let (k, d, f) = (keys.clone(), down.clone(), fetches.clone());
    let app = axum::Router::new()
        .route(
            "/.well-known/openid-configuration",
            get(move || async move { axum::Json(discovery) }),
        )
        .route(
            "/keys",
            get(move || async move {
                f.fetch_add(1, Ordering::Relaxed);
                if d.load(Ordering::Relaxed) {
                    return Err(axum::http::StatusCode::SERVICE_UNAVAILABLE);
                }
                Ok(axum::Json(k.lock().unwrap().clone()))
            }),
        );
    tokio::spawn(async move { axum::serve(listener, app).await });
    Issuer {
        base,
        keys,
        down,
        fetches,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_rotate_mid_storm_on_two_instances_and_survive_the_issuer_going_away() {
    let issuer = issuer("jwks-rsa-1.json").await;
    let db = common::fresh_database(Sql::Postgres).await;
    let env = vec![
        ("SECKILL_DATABASE_URL".to_string(), db.clone()),
        ("SECKILL_REDIS_URL".to_string(), common::redis_url()),
        ("SECKILL_REDIS_PREFIX".to_string(), common::unique("shop")),
        ("SECKILL_AUTH_ISSUER".to_string(), issuer.base.clone()),
        ("SECKILL_AUTH_AUDIENCE".to_string(), AUDIENCE.to_string()),
    ];
    let (instances, _workers) = instances_and_workers(env).await;
    let bases: Vec<String> = instances.iter().map(|s| s.base.clone()).collect();
    let api = instances[0].api();
    let (stock, buyers) = (1_500, 2_000);
    let sale = api.open_sale(stock, 1).await;
    let shop_token = |kid: &str, i: usize| {
        let subject = format!("buyer-{i}");
        (
            buyer_id(&issuer.base, &subject),
            signed(kid, &claims_of(&issuer.base, &subject)),
        )
    };
    // The first half signed by the old key; the second by a key the issuer publishes once
    // the storm runs.
    let old: Vec<_> = (0..buyers / 2).map(|i| shop_token("rsa-1", i)).collect();
    let new: Vec<_> = (buyers / 2..buyers)
        .map(|i| shop_token("rsa-2", i))
        .collect();
    let started = Arc::new(AtomicUsize::new(0));
    let first = tokio::spawn(storm_on(
        bases.clone(),
        sale.clone(),
        old,
        Arrival::Crowd(256),
        started.clone(),
    ));
    common::eventually(30, "the storm is under way", || {
        let started = started.clone();
        async move { started.load(Ordering::Relaxed) > 200 }
    })
    .await;
    *issuer.keys.lock().unwrap() = serde_json::from_slice(&fixture("jwks-both-rsa.json")).unwrap();
    let fetches_before = issuer.fetches.load(Ordering::Relaxed);
    let second = tokio::spawn(storm_on(
        bases.clone(),
        sale.clone(),
        new,
        Arrival::Crowd(256),
        started.clone(),
    ));
    let mut told: HashMap<i64, common::storm::Told> = first.await.unwrap();
    told.extend(second.await.unwrap());
    // A thousand tokens of an unknown key on two instances: one fetch each, give or take
    // the five-second spacing, not one per token.
    let fetched = issuer.fetches.load(Ordering::Relaxed) - fetches_before;
    assert!(
        (1..=8).contains(&fetched),
        "{fetched} fetches for one new key"
    );
    let oks = told.values().filter(|t| !t.ok.is_empty()).count();
    assert_eq!(
        oks as i64, stock,
        "every unit sold, to shop buyers of both keys"
    );
    let store = Store::connect(&db, 2).await.unwrap();
    check_sql(&store, sale.parse().unwrap(), stock, &told).await;

    // The issuer goes away: the keys fetched keep working on every instance.
    issuer.down.store(true, Ordering::Relaxed);
    for (i, base) in bases.iter().enumerate() {
        let at = Api::new(base);
        let (id, t) = shop_token(if i == 0 { "rsa-1" } else { "rsa-2" }, 10_000 + i);
        assert_eq!(
            me(&at, &t).await.expect(200)["user_id"],
            id.to_string().as_str()
        );
        let unknown = token("ec-1", "someone");
        assert_eq!(me(&at, &unknown).await.status, 401);
    }
}
