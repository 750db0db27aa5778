//! The waiting room over HTTP, embedded: joining (one ticket per buyer, not before the
//! pre-queue opens), the lottery among those who joined before the opening and first come
//! first served after it, passes (missing, forged, another buyer's, expired), the room
//! closing on a sell-out, and the admission rate held over 30 s with 10,000 waiting.

use crate::common;

use std::time::{Duration, Instant};

use crate::common::storm::tokens;
use crate::common::{Api, Server};
use serde_json::{json, Value};

const SECRET: &str = "e2e-waiting-room-secret";

async fn server() -> Server {
    Server::embedded(&[("SECKILL_TOKEN_SECRET", SECRET)]).await
}

/// A sale with a room letting `rate` through a second, opening in `opens_in` seconds.
async fn room_sale(api: &Api, stock: i64, rate: i64, opens_in: i64, extra: Value) -> String {
    let mut fields = json!({
        "begins_at": common::rfc3339_in(opens_in),
        "waiting_room": {"admit_per_sec": rate},
    });
    if let (Some(f), Some(e)) = (fields.as_object_mut(), extra.as_object()) {
        f.extend(e.clone());
    }
    api.open_sale_with(stock, 1, &fields).await
}

async fn join(api: &Api, sale: &str, bearer: &str) -> Value {
    api.post(&format!("/api/sales/{sale}/queue"), Some(bearer), None)
        .await
        .expect(200)
}

async fn ticket(api: &Api, sale: &str, bearer: &str) -> Value {
    api.get(&format!("/api/sales/{sale}/queue"), Some(bearer))
        .await
        .expect(200)
}

/// Polls a ticket until it is let through; its pass.
async fn pass_of(api: &Api, sale: &str, bearer: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let t = ticket(api, sale, bearer).await;
        if t["state"] == "admitted" {
            return t["pass"].as_str().unwrap().to_string();
        }
        assert!(Instant::now() < deadline, "never let through: {t}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The sale's room as `GET /api/admin/rooms` reports it.
async fn room_report(api: &Api, sale: &str) -> Value {
    let rooms = api
        .admin_call(reqwest::Method::GET, "/api/admin/rooms", None)
        .await
        .expect(200);
    rooms
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["sale_id"] == sale)
        .cloned()
        .unwrap_or_else(|| panic!("no room for sale {sale}: {rooms}"))
}

/// Spearman's rank correlation of two orders of the same n items (1 to n each).
fn spearman(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len() as f64;
    let d2: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    1.0 - 6.0 * d2 / (n * (n * n - 1.0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lottery_before_the_opening_then_first_come_first_served_and_only_with_ones_own_pass() {
    let server = server().await;
    let api = server.api();
    let buyers = tokens(SECRET, 1..301);
    let sale = room_sale(&api, 1000, 100, 4, json!({})).await;
    assert_eq!(
        api.sale(&sale).await.json()["waiting_room"],
        json!({"admit_per_sec": 100, "prequeue_secs": 600}),
        "clients learn the sale has a room"
    );

    // Before the opening: 200 join one after another; nobody has a place yet.
    let (early, late) = buyers.split_at(200);
    for (_, bearer) in early {
        let t = join(&api, &sale, bearer).await;
        assert_eq!(t["state"], "waiting", "{t}");
        assert!(t["position"].is_null(), "no place before the draw: {t}");
        assert!(t["eta_secs"].as_u64().unwrap() <= 4, "{t}");
    }
    let again = join(&api, &sale, &early[0].1).await;
    assert_eq!(again["tickets"], 200, "joining again keeps the one ticket");
    let waiting = &early[5].1;
    let refused = api.buy_with(waiting, &sale, &json!({"quantity": 1})).await;
    assert_eq!(refused.status_code(), (409, "not_started".into()));

    // After the opening, 100 more, in turn.
    tokio::time::sleep(Duration::from_millis(4200)).await;
    for (_, bearer) in late {
        join(&api, &sale, bearer).await;
    }
    let mut place = Vec::new();
    for (_, bearer) in &buyers {
        place.push(
            ticket(&api, &sale, bearer).await["position"]
                .as_u64()
                .unwrap(),
        );
    }
    let (early_places, late_places) = place.split_at(200);
    let mut sorted = early_places.to_vec();
    sorted.sort();
    assert_eq!(
        sorted,
        (1..=200).collect::<Vec<u64>>(),
        "the lottery places exactly the early joiners at the head"
    );
    let joined: Vec<f64> = (1..=200).map(|i| i as f64).collect();
    let drawn: Vec<f64> = early_places.iter().map(|p| *p as f64).collect();
    let rho = spearman(&joined, &drawn);
    assert!(
        rho.abs() < 0.3,
        "the order of the draw follows the order of joining (rho {rho:.3})"
    );
    assert_eq!(
        late_places,
        (201..=300).collect::<Vec<u64>>(),
        "after the opening, first come first served"
    );

    // Passes: none, forged, another's, one's own.
    let (first, second) = (&buyers[0].1, &buyers[1].1);
    let pass = pass_of(&api, &sale, first).await;
    let other_pass = pass_of(&api, &sale, second).await;
    for (body, why) in [
        (json!({}), "no pass"),
        (json!({"pass": other_pass}), "another buyer's pass"),
        (json!({"pass": format!("{pass}0")}), "a forged pass"),
        (json!({"pass": "4102444800000.0.AAAA"}), "a made-up pass"),
    ] {
        let r = api.buy_with(first, &sale, &body).await;
        assert_eq!(
            r.status_code(),
            (403, "queue_pass_required".into()),
            "{why}"
        );
    }
    let ok = api.buy_with(first, &sale, &json!({"pass": pass})).await;
    assert_eq!(ok.code(), "ok", "one's own pass buys");
    let seen = ticket(&api, &sale, first).await;
    assert_eq!(seen["state"], "admitted", "{seen}");

    // Bad input: no room, no ticket, a room not open for joining yet.
    let plain = api.open_sale(5, 1).await;
    let no_room = api
        .post(&format!("/api/sales/{plain}/queue"), Some(first), None)
        .await;
    assert_eq!(no_room.status_code().0, 409);
    let strangers = tokens(SECRET, 5000..5001);
    let none = api
        .get(&format!("/api/sales/{sale}/queue"), Some(&strangers[0].1))
        .await;
    assert_eq!(none.status_code().0, 404);
    let later = room_sale(
        &api,
        5,
        10,
        7200,
        json!({"ends_at": common::rfc3339_in(10_800), "waiting_room": {"admit_per_sec": 10, "prequeue_secs": 60}}),
    )
    .await;
    let early_bird = api
        .post(&format!("/api/sales/{later}/queue"), Some(first), None)
        .await;
    assert_eq!(early_bird.status_code(), (409, "queue_not_open".into()));
    for bad in [
        json!({"admit_per_sec": 0}),
        json!({"admit_per_sec": 10, "prequeue_secs": -1}),
        json!({"admit_per_sec": "ten"}),
        json!({"admit_per_sec": 10, "extra": 1}),
    ] {
        let created = api
            .create_sale(&json!({
                "title": "bad room", "price_cents": 1, "stock": 1,
                "begins_at": common::rfc3339_in(60), "ends_at": common::rfc3339_in(3600),
                "waiting_room": bad,
            }))
            .await;
        assert_eq!(created.status_code().0, 400, "{bad}: {}", created.code());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sold_out_room_closes_every_ticket_and_an_unused_pass_expires() {
    let server = server().await;
    let api = server.api();
    let buyers = tokens(SECRET, 1..41);
    let sale = room_sale(&api, 3, 1000, 0, json!({})).await;
    for (_, bearer) in &buyers {
        join(&api, &sale, bearer).await;
    }
    let mut sold = 0;
    for (_, bearer) in &buyers[..3] {
        let pass = pass_of(&api, &sale, bearer).await;
        let r = api.buy_with(bearer, &sale, &json!({"pass": pass})).await;
        assert_eq!(r.code(), "ok");
        sold += 1;
    }
    assert_eq!(sold, 3);
    let deadline = Instant::now() + Duration::from_secs(2);
    for (_, bearer) in &buyers[3..] {
        loop {
            let t = ticket(&api, &sale, bearer).await;
            if t["state"] == "closed" {
                assert_eq!(t["reason"], "sold_out", "{t}");
                assert!(
                    t.get("pass").is_none(),
                    "a closed ticket holds no pass: {t}"
                );
                break;
            }
            assert!(
                Instant::now() < deadline,
                "still open 2 s after the sell-out: {t}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    // A pass lives as long as the payment window: one second here.
    let short = room_sale(&api, 10, 1000, 0, json!({"payment_window_secs": 1})).await;
    let (_, bearer) = &buyers[10];
    join(&api, &short, bearer).await;
    let pass = pass_of(&api, &short, bearer).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let late = api.buy_with(bearer, &short, &json!({"pass": pass})).await;
    assert_eq!(late.status_code(), (403, "queue_pass_required".into()));
    let t = ticket(&api, &short, bearer).await;
    assert_eq!(
        (t["state"].clone(), t["reason"].clone()),
        (json!("closed"), json!("pass_expired"))
    );
}

/// 10,000 join before the opening; from the opening, 200 a second are let through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_room_lets_through_its_rate_over_30_s_with_10000_waiting() {
    let server = server().await;
    let api = server.api();
    let rate = 200;
    let created = Instant::now();
    let sale = room_sale(&api, 100_000, rate, 20, json!({})).await;
    let buyers = tokens(SECRET, 1..10_001);
    for chunk in buyers.chunks(200) {
        let mut joins = tokio::task::JoinSet::new();
        for (_, bearer) in chunk {
            let (api, sale, bearer) = (api.clone(), sale.clone(), bearer.clone());
            joins.spawn(async move { join(&api, &sale, &bearer).await });
        }
        joins.join_all().await;
    }
    let admitted = || async { (Instant::now(), room_report(&api, &sale).await) };
    // From two seconds after the opening, for 30 s.
    assert!(
        created.elapsed() < Duration::from_secs(20),
        "10,000 joined before the opening"
    );
    tokio::time::sleep_until((created + Duration::from_secs(22)).into()).await;
    let (t0, r0) = admitted().await;
    assert_eq!(r0["tickets"], 10_000, "{r0}");
    tokio::time::sleep(Duration::from_secs(30)).await;
    let (t1, r1) = admitted().await;
    let per_sec = (r1["admitted"].as_f64().unwrap() - r0["admitted"].as_f64().unwrap())
        / (t1 - t0).as_secs_f64();
    assert!(
        (per_sec - rate as f64).abs() <= rate as f64 * 0.1,
        "{per_sec:.1} let through a second, the room's rate is {rate}: {r0} {r1}"
    );
    assert!(r1["oldest_wait_secs"].as_f64().unwrap() >= 30.0, "{r1}");
    let text = api
        .admin_call(reqwest::Method::GET, "/metrics", None)
        .await
        .text;
    assert!(
        text.contains(&format!("seckill_room_waiting{{sale=\"{sale}\"}}")),
        "the room in /metrics"
    );
}

/// Two instances on one Redis and PostgreSQL: one line and one rate for both, and an
/// instance SIGKILLed while 5,000 wait loses no ticket and no place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_one_line_and_one_rate_and_a_killed_one_loses_no_ticket() {
    let env = vec![
        (
            "SECKILL_DATABASE_URL".to_string(),
            common::fresh_database(common::Sql::Postgres).await,
        ),
        ("SECKILL_REDIS_URL".to_string(), common::redis_url()),
        ("SECKILL_REDIS_PREFIX".to_string(), common::unique("room")),
        ("SECKILL_TOKEN_SECRET".to_string(), SECRET.to_string()),
    ];
    let mut a = Server::start(env.clone(), vec!["serve".into()]).await;
    let b = Server::start(env, vec!["serve".into(), "--no-writer".into()]).await;
    let (api_a, api_b) = (a.api(), b.api());
    let rate = 100;
    let created = Instant::now();
    let sale = room_sale(&api_a, 100_000, rate, 15, json!({})).await;
    let buyers = tokens(SECRET, 1..5_001);
    for chunk in buyers.chunks(100) {
        let mut joins = tokio::task::JoinSet::new();
        for (i, (_, bearer)) in chunk.iter().cloned().enumerate() {
            let (api, sale) = (
                if i % 2 == 0 { &api_a } else { &api_b }.clone(),
                sale.clone(),
            );
            joins.spawn(async move { join(&api, &sale, &bearer).await });
        }
        joins.join_all().await;
    }
    assert!(
        created.elapsed() < Duration::from_secs(15),
        "5,000 joined before the opening"
    );
    tokio::time::sleep_until((created + Duration::from_secs(17)).into()).await;
    let places = |api: Api| {
        let (buyers, sale) = (buyers.clone(), sale.clone());
        async move {
            let mut places = Vec::new();
            for chunk in buyers.chunks(100) {
                let mut reads = tokio::task::JoinSet::new();
                for (_, bearer) in chunk {
                    let (api, sale, bearer) = (api.clone(), sale.clone(), bearer.clone());
                    reads.spawn(
                        async move { ticket(&api, &sale, &bearer).await["position"].clone() },
                    );
                }
                places.extend(reads.join_all().await);
            }
            let mut places: Vec<u64> = places.iter().map(|p| p.as_u64().unwrap()).collect();
            places.sort();
            places
        }
    };
    assert_eq!(
        places(api_a.clone()).await,
        (1..=5_000).collect::<Vec<u64>>(),
        "every ticket has one place, whichever instance it joined through"
    );
    let admitted = |api: Api| {
        let sale = sale.clone();
        async move {
            let room = room_report(&api, &sale).await;
            (Instant::now(), room["admitted"].as_f64().unwrap())
        }
    };
    let (t0, n0) = admitted(api_b.clone()).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    a.kill();
    tokio::time::sleep(Duration::from_secs(15)).await;
    let (t1, n1) = admitted(api_b.clone()).await;
    let per_sec = (n1 - n0) / (t1 - t0).as_secs_f64();
    assert!(
        (per_sec - rate as f64).abs() <= rate as f64 * 0.1,
        "{per_sec:.1} let through a second by two instances then one, the rate is {rate}"
    );
    assert_eq!(
        places(api_b.clone()).await,
        (1..=5_000).collect::<Vec<u64>>(),
        "no ticket lost with the instance"
    );
    // A pass from one instance is good on the other.
    let mut admitted_buyer = None;
    for (_, bearer) in &buyers {
        let t = ticket(&api_b, &sale, bearer).await;
        if t["state"] == "admitted" {
            admitted_buyer = Some((bearer.clone(), t["pass"].as_str().unwrap().to_string()));
            break;
        }
    }
    let (first, pass) = admitted_buyer.expect("about 2,000 were let through");
    a.restart().await;
    let bought = a
        .api()
        .buy_with(&first, &sale, &json!({"pass": pass}))
        .await;
    assert_eq!(bought.code(), "ok", "{}", bought.text);
}
