//! The rate limits over HTTP: a user firing requests gets 429 `rate_limited` with
//! Retry-After while a person clicking does not; the per-address limit (when configured)
//! throttles an address, believing X-Forwarded-For only from a trusted proxy.

mod common;

use std::time::Duration;

use common::{Server, Sql};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripted_buyers_are_throttled_people_are_not() {
    let db = common::fresh_database(Sql::Sqlite).await;
    let env = vec![
        ("SECKILL_DATABASE_URL".into(), db),
        ("SECKILL_RATE_USER_PER_SEC".into(), "2".into()),
        ("SECKILL_RATE_USER_BURST".into(), "4".into()),
    ];
    let server = Server::start(env, vec!["serve".into()]).await;
    let c = common::client();
    let sale = common::open_sale(&c, &server, 5, 1).await;
    let tokens = common::login_users(&c, &server.base, 2).await;

    // A script: 20 requests at once.
    let mut codes = Vec::new();
    let mut retry_after = None;
    for _ in 0..20 {
        let r = c
            .post(format!("{}/api/sales/{sale}/purchase", server.base))
            .bearer_auth(&tokens[0])
            .send()
            .await
            .unwrap();
        if r.status() == 429 {
            retry_after = r
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_string());
        }
        let body: serde_json::Value = r.json().await.unwrap();
        codes.push(body["code"].as_str().unwrap().to_string());
    }
    assert_eq!(codes.iter().filter(|c| *c == "ok").count(), 1, "{codes:?}");
    assert_eq!(
        codes.iter().filter(|c| *c == "already_purchased").count(),
        3,
        "{codes:?}"
    );
    assert_eq!(
        codes.iter().filter(|c| *c == "rate_limited").count(),
        16,
        "{codes:?}"
    );
    assert_eq!(retry_after.as_deref(), Some("1"));

    // A person: one click, a pause, another click: never throttled.
    for _ in 0..3 {
        let (status, body) = common::buy(&c, &server.base, &sale, &tokens[1]).await;
        assert_ne!(status, 429, "{body}");
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    let metrics = common::metrics(&c, &server).await;
    assert!(
        metrics.contains("seckill_purchases_total{code=\"rate_limited\"} 16"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_address_limit_believes_only_trusted_proxies() {
    let db = common::fresh_database(Sql::Sqlite).await;
    let env = vec![
        ("SECKILL_DATABASE_URL".into(), db),
        ("SECKILL_RATE_ADDRESS_PER_SEC".into(), "1".into()),
        ("SECKILL_RATE_ADDRESS_BURST".into(), "3".into()),
        ("SECKILL_TRUSTED_PROXIES".into(), "127.0.0.1".into()),
    ];
    let server = Server::start(env, vec!["serve".into()]).await;
    let c = common::client();
    let get = |xff: &'static str| {
        let c = c.clone();
        let url = format!("{}/api/sales", server.base);
        async move {
            c.get(url)
                .header("X-Forwarded-For", xff)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    // Behind the trusted proxy (the tests connect from 127.0.0.1) each client has its bucket.
    let a: Vec<u16> = futures_util::future::join_all((0..5).map(|_| get("203.0.113.1"))).await;
    assert_eq!(a.iter().filter(|s| **s == 429).count(), 2, "{a:?}");
    let b: Vec<u16> = futures_util::future::join_all((0..3).map(|_| get("203.0.113.2"))).await;
    assert!(
        b.iter().all(|s| *s == 200),
        "another client is not throttled: {b:?}"
    );
    let metrics = c
        .get(format!("{}/metrics", server.base))
        .header("X-Forwarded-For", "203.0.113.3")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("seckill_rate_limited_addresses_total 2"),
        "{metrics}"
    );
}

/// Sends one keep-alive request on a raw connection and reads the answer's status line,
/// leaving the connection open (and holding its slot).
async fn hold_a_connection(base: &str) -> tokio::net::TcpStream {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = base.trim_start_matches("http://");
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = [0u8; 256];
    let n = conn.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
    conn
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_wait_their_turn() {
    let db = common::fresh_database(Sql::Sqlite).await;
    let env = vec![
        ("SECKILL_DATABASE_URL".into(), db),
        ("SECKILL_MAX_CONNECTIONS".into(), "2".into()),
    ];
    let server = Server::start(env, vec!["serve".into()]).await;
    let first = hold_a_connection(&server.base).await;
    let _second = hold_a_connection(&server.base).await;
    let third = reqwest::Client::builder()
        .timeout(Duration::from_millis(800))
        .build()
        .unwrap();
    let url = format!("{}/healthz", server.base);
    assert!(
        third.get(&url).send().await.is_err(),
        "a third connection is not served while two are open"
    );
    drop(first);
    let patient = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let r = patient.get(&url).send().await.unwrap();
    assert_eq!(r.status(), 200, "served once a slot is free");
    let metrics = common::metrics(&patient, &server).await;
    assert!(metrics.contains("seckill_connections_max 2"), "{metrics}");
    assert!(
        !metrics.contains("seckill_connections_saturated_total 0"),
        "{metrics}"
    );
}
