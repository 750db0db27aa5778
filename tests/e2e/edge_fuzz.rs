//! Arbitrary bytes and arbitrary JSON at every endpoint of the running binary: every answer
//! is below 500, every error is `{code, message}`, and nothing changes (the sale keeps its
//! stock, no order appears). Reproducible: the seed is printed and read from
//! SECKILL_FUZZ_SEED; SECKILL_FUZZ_CASES sets how many requests (default 3000).

use crate::common;

use crate::common::{Server, Sql};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use seckill::store::Store;

const PATHS: &[&str] = &[
    "/api/auth/code",
    "/api/auth/login",
    "/api/sales",
    "/api/sales/{sale}",
    "/api/sales/{sale}/stock",
    "/api/sales/{sale}/purchase",
    "/api/sales/{id}/purchase",
    "/api/sales/{sale}/token",
    "/api/sales/{sale}/captcha",
    "/api/orders",
    "/api/orders/{id}",
    "/api/orders/{id}/pay",
    "/api/orders/{id}/cancel",
    "/api/payments/notify",
    "/api/admin/sales",
    "/api/admin/sales/{sale}/approve",
    "/api/admin/sales/{sale}/pause",
    "/api/admin/sales/{sale}/resume",
    "/api/admin/sales/{sale}/stats",
    "/api/admin/sales/{sale}/audit",
    "/api/admin/sales/{sale}/order-ids",
    "/api/admin/payments/{id}/simulate",
    "/healthz",
    "/readyz",
    "/metrics",
    "/openapi.json",
    "/{junk}",
];

fn junk_segment(rng: &mut StdRng) -> String {
    match rng.random_range(0..8) {
        0 => "0".into(),
        1 => "-1".into(),
        2 => "99999999999999999999999".into(),
        3 => "%00%ff".into(),
        4 => "..%2f..%2fetc%2fpasswd".into(),
        5 => "9223372036854775807".into(),
        6 => (0..rng.random_range(1..40))
            .map(|_| rng.random_range(b'!'..=b'~') as char)
            .filter(|c| !"/?#%".contains(*c))
            .collect(),
        _ => rng.random_range(1..i64::MAX).to_string(),
    }
}

fn json_value(rng: &mut StdRng, depth: u32) -> serde_json::Value {
    use serde_json::{json, Value};
    let choice = if depth > 3 {
        rng.random_range(0..6)
    } else {
        rng.random_range(0..9)
    };
    match choice {
        0 => Value::Null,
        1 => json!(rng.random::<bool>()),
        2 => json!(rng.random::<i64>()),
        3 => json!(rng.random::<f64>() * 1e300),
        4 => json!(
            [
                "",
                "0",
                "-1",
                "1e400",
                "\u{0}",
                "😀",
                "2026-11-22T20:00:00Z",
                "+8613800000000"
            ][rng.random_range(0..8)]
        ),
        5 => json!((0..rng.random_range(0..30))
            .map(|_| rng.random::<char>())
            .collect::<String>()),
        6 => Value::Array(
            (0..rng.random_range(0..5))
                .map(|_| json_value(rng, depth + 1))
                .collect(),
        ),
        _ => {
            let keys = [
                "quantity",
                "phone",
                "code",
                "title",
                "stock",
                "price_cents",
                "begins_at",
                "ends_at",
                "per_user_limit",
                "intent_id",
                "status",
                "outcome",
                "x",
            ];
            let mut map = serde_json::Map::new();
            for _ in 0..rng.random_range(0..6) {
                map.insert(
                    keys[rng.random_range(0..keys.len())].to_string(),
                    json_value(rng, depth + 1),
                );
            }
            Value::Object(map)
        }
    }
}

fn body(rng: &mut StdRng) -> Vec<u8> {
    match rng.random_range(0..5) {
        0 => Vec::new(),
        1 => (0..rng.random_range(0..512))
            .map(|_| rng.random::<u8>())
            .collect(),
        2 => vec![b'{'; rng.random_range(1..20_000)],
        _ => serde_json::to_vec(&json_value(rng, 0)).unwrap_or_default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn arbitrary_requests_get_4xx_and_change_nothing() {
    let seed: u64 = std::env::var("SECKILL_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let cases: usize = std::env::var("SECKILL_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3000);
    println!("SECKILL_FUZZ_SEED={seed}");
    let mut rng = StdRng::seed_from_u64(seed);

    let db = common::fresh_database(Sql::Sqlite).await;
    let server = Server::start(
        vec![("SECKILL_DATABASE_URL".into(), db.clone())],
        vec!["serve".into()],
    )
    .await;
    let api = server.api();
    let sale = api.open_sale(5, 1).await;
    let token = api.login_users(1).await.remove(0);
    // The real token with its last signature digit changed: always invalid.
    let forged = {
        let last = if token.ends_with('0') { '1' } else { '0' };
        format!("{}{last}", &token[..token.len() - 1])
    };
    let methods = [
        reqwest::Method::GET,
        reqwest::Method::POST,
        reqwest::Method::PUT,
        reqwest::Method::DELETE,
        reqwest::Method::PATCH,
    ];

    for i in 0..cases {
        let path = PATHS[rng.random_range(0..PATHS.len())]
            .replace(
                "{sale}",
                &if rng.random_bool(0.7) {
                    sale.clone()
                } else {
                    junk_segment(&mut rng)
                },
            )
            .replace("{id}", &junk_segment(&mut rng))
            .replace("{junk}", &junk_segment(&mut rng));
        let method = methods[rng.random_range(0..methods.len())].clone();
        let mut req = api.request(method.clone(), &path);
        // The real user token only where it cannot buy: mutations get forged credentials.
        req = match rng.random_range(0..4) {
            0 => req,
            1 => req.header(
                "Authorization",
                format!("Bearer {}", junk_segment(&mut rng)),
            ),
            2 if method == reqwest::Method::GET => req.bearer_auth(&token),
            2 => req.bearer_auth(&forged),
            _ => req.header("Authorization", junk_segment(&mut rng)),
        };
        if rng.random_bool(0.3) {
            req = req
                .header("X-Seckill-Timestamp", junk_segment(&mut rng))
                .header("X-Seckill-Signature", junk_segment(&mut rng));
        }
        let payload = body(&mut rng);
        let r = req.body(payload.clone()).send().await.unwrap();
        let status = r.status().as_u16();
        let bytes = r.bytes().await.unwrap();
        let shown: String = String::from_utf8_lossy(&payload).chars().take(80).collect();
        assert!(
            status < 500,
            "case {i} (seed {seed}): {method} {path} {shown:?} -> {status} {}",
            String::from_utf8_lossy(&bytes)
        );
        if status >= 400 {
            let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_else(|_| {
                panic!("case {i} (seed {seed}): {method} {path}: error body is not JSON")
            });
            assert!(
                json["code"].is_string() && json["message"].is_string(),
                "case {i} (seed {seed}): {json}"
            );
        }
    }

    let store = Store::connect(&db, 2).await.unwrap();
    let sale_id: i64 = sale.parse().unwrap();
    assert_eq!(
        store.sale(sale_id).await.unwrap().unwrap().stock,
        5,
        "seed {seed}"
    );
    assert!(
        store.orders_of_sale(sale_id).await.unwrap().is_empty(),
        "seed {seed}"
    );
    assert_eq!(
        store.all_sales(10).await.unwrap().len(),
        1,
        "seed {seed}: no sale was created"
    );
}
