//! The rate limits over HTTP: a user firing requests gets 429 `rate_limited` with
//! Retry-After while a person clicking does not; the per-address limit (when configured)
//! throttles an address, believing X-Forwarded-For only from a trusted proxy.

use crate::common;

use std::time::Duration;

use crate::common::{Api, Server};
use reqwest::Method;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripted_buyers_are_throttled_people_are_not() {
    let server = Server::embedded(&[
        ("SECKILL_RATE_USER_PER_SEC", "2"),
        ("SECKILL_RATE_USER_BURST", "4"),
    ])
    .await;
    let api = server.api();
    // A limit of 10 a buyer: the script below stays under it, so the rate is what stops it.
    let sale = api.open_sale(20, 10).await;
    let tokens = api.login_users(3).await;

    // A script: 20 requests at once.
    let mut codes = Vec::new();
    let mut retry_after = None;
    for _ in 0..20 {
        let r = api.buy(&tokens[0], &sale).await;
        if r.status == 429 {
            retry_after = r.header("retry-after").map(str::to_string);
        }
        codes.push(r.json()["code"].as_str().unwrap().to_string());
    }
    assert_eq!(codes.iter().filter(|c| *c == "ok").count(), 4, "{codes:?}");
    assert_eq!(
        codes.iter().filter(|c| *c == "rate_limited").count(),
        16,
        "{codes:?}"
    );
    assert_eq!(retry_after.as_deref(), Some("1"));

    // A person: one click, a pause, another click: never throttled.
    for _ in 0..3 {
        let answer = api.buy(&tokens[1], &sale).await;
        assert_ne!(answer.status, 429, "{answer}");
        tokio::time::sleep(Duration::from_millis(600)).await;
    }

    // A buyer who holds the limit can take nothing more: every further request, however
    // fast, hears so (409 already_purchased) rather than a wait that would change nothing.
    let one_each = api.open_sale(5, 1).await;
    assert_eq!(api.buy(&tokens[2], &one_each).await.status, 200);
    for _ in 0..20 {
        let answer = api.buy(&tokens[2], &one_each).await;
        assert_eq!(
            answer.status_code(),
            (409, "already_purchased".into()),
            "{answer}"
        );
    }
    let metrics = api.metrics().await;
    assert!(
        metrics.contains("seckill_purchases_total{code=\"rate_limited\"} 16"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_address_limit_believes_only_trusted_proxies() {
    let server = Server::embedded(&[
        ("SECKILL_RATE_ADDRESS_PER_SEC", "1"),
        ("SECKILL_RATE_ADDRESS_BURST", "3"),
        ("SECKILL_TRUSTED_PROXIES", "127.0.0.1"),
    ])
    .await;
    let api = server.api();
    let get = |xff: &'static str| {
        let request = api
            .request(Method::GET, "/api/sales")
            .header("X-Forwarded-For", xff);
        async move { Api::send(request).await.status }
    };
    // Behind the trusted proxy (the tests connect from 127.0.0.1) each client has its bucket.
    let a: Vec<u16> = futures_util::future::join_all((0..5).map(|_| get("203.0.113.1"))).await;
    assert_eq!(a.iter().filter(|s| **s == 429).count(), 2, "{a:?}");
    let b: Vec<u16> = futures_util::future::join_all((0..3).map(|_| get("203.0.113.2"))).await;
    assert!(
        b.iter().all(|s| *s == 200),
        "another client is not throttled: {b:?}"
    );
    let metrics = Api::send(
        api.request(Method::GET, "/metrics")
            .bearer_auth(&server.admin)
            .header("X-Forwarded-For", "203.0.113.3"),
    )
    .await
    .text;
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

/// Opens a connection and sends the start of a request's head, leaving it unfinished: the
/// connection is busy receiving a request (never shed) until the head deadline.
async fn half_a_head(base: &str) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let addr = base.trim_start_matches("http://");
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\n").as_bytes())
        .await
        .unwrap();
    conn
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_wait_their_turn() {
    let server = Server::embedded(&[("SECKILL_MAX_CONNECTIONS", "2")]).await;
    // Both slots taken by connections that are sending a request: nothing to shed.
    let first = half_a_head(&server.base).await;
    let mut second = half_a_head(&server.base).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let third = reqwest::Client::builder()
        .timeout(Duration::from_millis(800))
        .build()
        .unwrap();
    let url = format!("{}/healthz", server.base);
    assert!(
        Api::try_send(third.get(&url)).await.is_err(),
        "a third connection is not served while two are receiving requests"
    );
    drop(first);
    let patient = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let patient = Api::with_client(patient, &server.base).admin(&server.admin);
    let r = patient.get("/healthz", None).await;
    assert_eq!(r.status, 200, "served once a slot is free");
    let metrics = patient.metrics().await;
    assert!(metrics.contains("seckill_connections_max 2"), "{metrics}");
    assert!(
        !metrics.contains("seckill_connections_saturated_total 0"),
        "{metrics}"
    );
    assert_eq!(
        closed_within(&mut second, Duration::from_millis(300)).await,
        None,
        "a connection receiving a request is never shed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_cap_the_connection_idle_longest_makes_room() {
    let server = Server::embedded(&[("SECKILL_MAX_CONNECTIONS", "2")]).await;
    // One slot idle on keep-alive after its answer, the other receiving a request.
    let mut idle = hold_a_connection(&server.base).await;
    let _busy = half_a_head(&server.base).await;
    // Past the grace a keep-alive client has to send its next request.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let quick = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let quick = Api::with_client(quick, &server.base).admin(&server.admin);
    let r = Api::try_send(quick.request(Method::GET, "/healthz"))
        .await
        .expect("a new connection is served at once: the idle one makes room");
    assert_eq!(r.status, 200);
    closed_within(&mut idle, Duration::from_secs(1))
        .await
        .expect("the idle keep-alive connection is closed");
    // (Its own keep-alive connection may be shed in turn, if the client opens another.)
    let metrics = quick.metrics().await;
    assert!(
        common::metric(&metrics, "seckill_connections_shed_total") >= 1,
        "{metrics}"
    );
    assert_eq!(
        common::metric(&metrics, "seckill_connections_timed_out_total"),
        0,
        "shed is not counted as a timeout: {metrics}"
    );
}

/// Opens `n` TCP connections from `local` (a loopback address of its own) that never send
/// a byte. Connections the server closed at once are dropped; the rest are returned.
async fn silent_sockets(base: &str, local: &str, n: usize) -> Vec<tokio::net::TcpStream> {
    let addr: std::net::SocketAddr = base.trim_start_matches("http://").parse().unwrap();
    let local: std::net::SocketAddr = format!("{local}:0").parse().unwrap();
    let mut held = Vec::new();
    for chunk in (0..n).collect::<Vec<_>>().chunks(500) {
        let opened = futures_util::future::join_all(chunk.iter().map(|_| async move {
            let socket = tokio::net::TcpSocket::new_v4().ok()?;
            socket.bind(local).ok()?;
            tokio::time::timeout(Duration::from_secs(5), socket.connect(addr))
                .await
                .ok()?
                .ok()
        }))
        .await;
        held.extend(opened.into_iter().flatten());
    }
    held
}

/// While a flood is held: /healthz five times and a purchase by each of `tokens`, from an
/// address of their own, each answered within `within`; then the server's metrics.
async fn others_are_served(
    server: &Server,
    sale: &str,
    tokens: &[String],
    within: Duration,
) -> String {
    let quick = reqwest::Client::builder().timeout(within).build().unwrap();
    let quick = Api::with_client(quick, &server.base).admin(&server.admin);
    for _ in 0..5 {
        let r = Api::try_send(quick.request(Method::GET, "/healthz"))
            .await
            .unwrap_or_else(|e| panic!("/healthz not answered within {within:?}: {e}"));
        assert_eq!(r.status, 200);
    }
    for t in tokens {
        let r = quick
            .try_buy(t, sale)
            .await
            .unwrap_or_else(|e| panic!("a purchase not answered within {within:?}: {e}"));
        assert_eq!(r.status, 200, "{r}");
    }
    quick.metrics().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_silent_sockets_from_one_address_stop_nobody_else() {
    // Default caps: 10,000 connections in all, 1,000 per address. Floods take turns: two
    // at once would pass this process's open-file limit.
    let _turn = common::one_at_a_time().await;
    let server = Server::embedded(&[]).await;
    let api = server.api();
    let sale = api.open_sale(5, 1).await;
    let tokens = api.login_users(3).await;

    let silent = silent_sockets(&server.base, "127.0.0.2", 10_000).await;
    assert!(silent.len() >= 9_000, "opened {}", silent.len());
    // Let the server accept (and close) the whole flood.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let metrics = others_are_served(&server, &sale, &tokens, Duration::from_secs(2)).await;
    let open = common::metric(&metrics, "seckill_connections_open");
    assert!(
        open <= 1_010,
        "one address holds at most its share: {open} open"
    );
    assert!(
        common::metric(&metrics, "seckill_connections_refused_per_address_total") >= 8_000,
        "{metrics}"
    );
    drop(silent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_silent_sockets_from_fifty_addresses_stop_nobody_else() {
    // Default caps: 10,000 connections in all, 1,000 per address; 200 from each of 50
    // addresses stay under the per-address cap and reach the global one.
    let _turn = common::one_at_a_time().await;
    let server = Server::embedded(&[]).await;
    let api = server.api();
    let sale = api.open_sale(5, 1).await;
    let tokens = api.login_users(3).await;

    let floods = (10..60).map(|i| {
        let base = server.base.clone();
        async move { silent_sockets(&base, &format!("127.0.0.{i}"), 200).await }
    });
    let silent: Vec<_> = futures_util::future::join_all(floods)
        .await
        .into_iter()
        .flatten()
        .collect();
    assert!(silent.len() >= 9_900, "opened {}", silent.len());
    tokio::time::sleep(Duration::from_millis(500)).await;

    let metrics = others_are_served(&server, &sale, &tokens, Duration::from_secs(1)).await;
    assert!(
        common::metric(&metrics, "seckill_connections_shed_total") >= 1,
        "room was made by shedding silent connections: {metrics}"
    );
    assert!(
        common::metric(&metrics, "seckill_connections_open") <= 10_000,
        "{metrics}"
    );
    drop(silent);
}

/// Reads until the server closes the connection; the time it took, or None if it stayed
/// open for `within`.
async fn closed_within(conn: &mut tokio::net::TcpStream, within: Duration) -> Option<Duration> {
    use tokio::io::AsyncReadExt;
    let started = std::time::Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout_at(
            tokio::time::Instant::from_std(started + within),
            conn.read(&mut buf),
        )
        .await
        {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(started.elapsed()),
            Ok(Ok(_)) => continue,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_slow_connections_are_closed_busy_ones_are_not() {
    use tokio::io::AsyncWriteExt;
    let server = Server::embedded(&[
        ("SECKILL_IDLE_TIMEOUT_SECS", "2"),
        ("SECKILL_HEADER_READ_TIMEOUT_SECS", "1"),
    ])
    .await;
    let addr = server.base.trim_start_matches("http://").to_string();

    // Never sends a byte: closed after the idle timeout (watched from the moment it opens).
    let mut silent = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let silent =
        tokio::spawn(async move { closed_within(&mut silent, Duration::from_secs(8)).await });
    // Answered once, then idle on keep-alive: closed after the idle timeout.
    let mut idle = hold_a_connection(&server.base).await;
    // Slowloris: starts a head and trickles a byte every 300 ms, forever.
    let mut slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let trickle = {
        let mut slow_w = slow.into_split();
        let writer = tokio::spawn(async move {
            for _ in 0..30 {
                tokio::time::sleep(Duration::from_millis(300)).await;
                if slow_w.1.write_all(b"X").await.is_err() {
                    break;
                }
            }
        });
        (slow_w.0, writer)
    };

    // Busy: a request every 500 ms on one keep-alive connection for 4 s stays served.
    let busy = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .build()
        .unwrap();
    let busy = Api::with_client(busy, &server.base).admin(&server.admin);
    for _ in 0..8 {
        assert_eq!(busy.get("/healthz", None).await.status, 200);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    let limit = Duration::from_secs(6);
    let t = silent
        .await
        .unwrap()
        .expect("a silent connection is closed");
    assert!(
        t >= Duration::from_millis(1500),
        "not before the idle timeout: {t:?}"
    );
    closed_within(&mut idle, limit)
        .await
        .expect("an idle keep-alive connection is closed");
    let (mut slow_r, writer) = trickle;
    {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 256];
        let read = tokio::time::timeout(limit, slow_r.read(&mut buf)).await;
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "a head trickled a byte at a time is cut off: {read:?}"
        );
    }
    writer.abort();
    let metrics = busy.metrics().await;
    assert!(
        common::metric(&metrics, "seckill_connections_timed_out_total") >= 3,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_of_listed_origins_may_call_the_api_others_may_not() {
    let server = Server::embedded(&[(
        "SECKILL_CORS_ORIGINS",
        "https://shop.example,http://localhost:3000",
    )])
    .await;
    let api = server.api();
    let sale = api.open_sale(5, 1).await;
    let token = api.login_users(1).await.remove(0);
    let purchase = format!("/api/sales/{sale}/purchase");
    let from = |origin: &str, method: Method, path: &str| {
        api.request(method, path).header("Origin", origin)
    };

    // The browser's preflight before a purchase with a bearer token.
    let pre = Api::send(
        from("https://shop.example", Method::OPTIONS, &purchase)
            .header("Access-Control-Request-Method", "POST")
            .header(
                "Access-Control-Request-Headers",
                "authorization, content-type",
            ),
    )
    .await;
    assert_eq!(pre.status, 204);
    assert_eq!(
        pre.header("access-control-allow-origin"),
        Some("https://shop.example")
    );
    let allowed = pre.header("access-control-allow-headers").unwrap();
    assert!(allowed.contains("authorization"), "{allowed}");

    // The purchase itself (served by the front door, not the router) and a routed call.
    let r =
        Api::send(from("https://shop.example", Method::POST, &purchase).bearer_auth(&token)).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("https://shop.example")
    );
    let r = Api::send(from("http://localhost:3000", Method::GET, "/api/sales")).await;
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://localhost:3000")
    );
    let exposed = r.header("access-control-expose-headers").unwrap();
    assert!(exposed.contains("etag"), "{exposed}");

    // Another origin gets nothing that would let its page read the answer.
    let pre = Api::send(
        from("https://evil.example", Method::OPTIONS, &purchase)
            .header("Access-Control-Request-Method", "POST"),
    )
    .await;
    assert!(pre.header("access-control-allow-origin").is_none());
    let r = Api::send(from("https://evil.example", Method::GET, "/api/sales")).await;
    assert!(r.header("access-control-allow-origin").is_none());
}
