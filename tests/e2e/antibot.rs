//! Anti-bot over HTTP. Purchase tokens: required when the sale asks for them, bound to one
//! user and one sale, single-use, issued only while the sale is open. Captchas: a picture
//! with no text, one guess each, required for a token when the sale asks for it. Then the
//! storm of the protection layer: 100 times more buyers than stock, a third of them
//! scripts replaying tokens and hammering, against a Redis of the test's own so that every
//! gate call can be counted.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use crate::common::api::Reply;
use crate::common::{metric, Api, PrivateRedis, Server, Sql};
use base64::Engine;
use serde_json::json;

const SECRET: &str = "e2e-antibot-secret";

/// A single-use purchase token for this buyer.
async fn purchase_token(api: &Api, sale: &str, bearer: &str) -> String {
    let answer = api.purchase_token(bearer, sale).await.expect(200);
    answer["token"].as_str().unwrap().to_string()
}

/// A purchase with this purchase token.
async fn buy_with(api: &Api, sale: &str, bearer: &str, token: &str) -> Reply {
    api.buy_with(bearer, sale, &json!({ "token": token })).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purchase_tokens_and_captchas_over_http() {
    let db = common::fresh_database(Sql::Sqlite).await;
    let env = vec![
        ("SECKILL_DATABASE_URL".into(), db),
        ("SECKILL_TOKEN_SECRET".into(), SECRET.into()),
    ];
    let server = Server::start(env, vec!["serve".into()]).await;
    let api = server.api();
    let with_token = api
        .open_sale_with(5, 1, &json!({"anti_bot": "token"}))
        .await;
    let with_captcha = api
        .open_sale_with(5, 1, &json!({"anti_bot": "captcha"}))
        .await;
    let in_an_hour = common::rfc3339_in(3600);
    let later = api
        .open_sale_with(
            5,
            1,
            &json!({"anti_bot": "token", "begins_at": in_an_hour, "ends_at": "2099-01-01T00:00:00Z"}),
        )
        .await;
    let users = api.login_users(5).await;
    let sale_view = api.sale(&with_token).await.json();
    assert_eq!(
        sale_view["anti_bot"], "token",
        "clients learn what to fetch"
    );

    // Tokens: required, bound to user and sale, single-use.
    let no_token = api.buy_with(&users[0], &with_token, &json!({})).await;
    assert_eq!(
        no_token.status_code(),
        (403, "token_required".into()),
        "{no_token}"
    );
    let t0 = purchase_token(&api, &with_token, &users[0]).await;
    let moved = buy_with(&api, &with_token, &users[1], &t0).await;
    assert_eq!(
        moved.status_code(),
        (403, "token_invalid".into()),
        "{moved}"
    );
    let other_sale = buy_with(&api, &with_captcha, &users[0], &t0).await;
    assert_eq!(other_sale.status_code(), (403, "token_invalid".into()));
    let forged = buy_with(&api, &with_token, &users[0], &t0.replace('.', "_")).await;
    assert_eq!(forged.status_code(), (403, "token_invalid".into()));
    let ok = buy_with(&api, &with_token, &users[0], &t0).await;
    assert_eq!(ok.status_code(), (200, "ok".into()), "{ok}");
    let replay = buy_with(&api, &with_token, &users[0], &t0).await;
    assert_eq!(replay.status_code(), (403, "token_used".into()), "{replay}");
    let t1 = purchase_token(&api, &with_token, &users[0]).await;
    let again = buy_with(&api, &with_token, &users[0], &t1).await;
    assert_eq!(again.status_code(), (409, "already_purchased".into()));
    let early = api.purchase_token(&users[0], &later).await;
    assert_eq!(
        early.status_code(),
        (409, "not_started".into()),
        "only inside the window"
    );
    let no_captcha_here = api.captcha(&users[0], &with_token).await;
    assert_eq!(no_captcha_here.status_code(), (409, "conflict".into()));
    let junk = api
        .get(
            &format!("/api/sales/{with_token}/token?x=1"),
            Some(&users[0]),
        )
        .await;
    assert_eq!(
        junk.status_code(),
        (400, "invalid_request".into()),
        "{junk}"
    );
    let anonymous = api
        .get(&format!("/api/sales/{with_token}/token"), None)
        .await;
    assert_eq!(anonymous.status, 401);

    // Captchas: a picture only, one guess each.
    let unsolved = api.purchase_token(&users[1], &with_captcha).await;
    assert_eq!(unsolved.status_code(), (403, "captcha_required".into()));
    let captcha = api.captcha(&users[1], &with_captcha).await.expect(200);
    let mut fields: Vec<_> = captcha.as_object().unwrap().keys().cloned().collect();
    fields.sort();
    assert_eq!(fields, ["captcha_id", "expires_at", "image"]);
    let image = captcha["image"].as_str().unwrap();
    let png = base64::engine::general_purpose::STANDARD
        .decode(image.strip_prefix("data:image/png;base64,").unwrap())
        .unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"));
    let id = captcha["captcha_id"].as_str().unwrap();
    let user1 = common::user_of(&users[1]);
    let answer =
        seckill::edge::antibot::answer_for(SECRET, with_captcha.parse().unwrap(), user1, id)
            .unwrap();
    assert!(!captcha.to_string().contains(&answer) || answer.len() < 5);
    let wrong = if answer == "00000" { "11111" } else { "00000" };
    let guess = |answer: String, id: String, user: String| {
        let (api, sale) = (api.clone(), with_captcha.clone());
        async move { api.purchase_token_for(&user, &sale, &id, &answer).await }
    };
    let miss = guess(wrong.into(), id.into(), users[1].clone()).await;
    assert_eq!(miss.status_code(), (403, "captcha_failed".into()));
    let second_guess = guess(answer.clone(), id.into(), users[1].clone()).await;
    assert_eq!(
        second_guess.status_code(),
        (403, "captcha_failed".into()),
        "one guess per picture: {second_guess}"
    );
    let fresh = api.captcha(&users[1], &with_captcha).await.json();
    let fresh_id = fresh["captcha_id"].as_str().unwrap().to_string();
    let fresh_answer =
        seckill::edge::antibot::answer_for(SECRET, with_captcha.parse().unwrap(), user1, &fresh_id)
            .unwrap();
    let not_yours = guess(fresh_answer.clone(), fresh_id.clone(), users[2].clone()).await;
    assert_eq!(not_yours.status_code(), (403, "captcha_failed".into()));
    let solved = guess(fresh_answer.clone(), fresh_id.clone(), users[1].clone()).await;
    assert_eq!(solved.status, 200, "{solved}");
    let token = solved["token"].as_str().unwrap();
    let bought = buy_with(&api, &with_captcha, &users[1], token).await;
    assert_eq!(bought.status_code(), (200, "ok".into()), "{bought}");
    let reused = guess(fresh_answer, fresh_id, users[1].clone()).await;
    assert_eq!(reused.status_code(), (403, "captcha_failed".into()));

    // Pictures are rationed per buyer and sale: five at once, then one every five seconds.
    let mut answers = Vec::new();
    for _ in 0..7 {
        let r = api.captcha(&users[3], &with_captcha).await;
        let retry_after = r.header("retry-after").map(str::to_string);
        let (status, body) = (r.status, r.json());
        answers.push((status, body["code"].clone(), retry_after));
    }
    assert!(answers[..5].iter().all(|a| a.0 == 200), "{answers:?}");
    for (status, code, retry_after) in &answers[5..] {
        assert_eq!(
            (*status, code.as_str()),
            (429, Some("rate_limited")),
            "{answers:?}"
        );
        let secs: u64 = retry_after.as_deref().unwrap().parse().unwrap();
        assert!((1..=5).contains(&secs), "{answers:?}");
    }
    let other = api.captcha(&users[4], &with_captcha).await;
    assert_eq!(
        (other.status, other.is_json()),
        (200, true),
        "another buyer is not affected"
    );

    let m = api.metrics().await;
    assert_eq!(metric(&m, "seckill_captchas_limited_total"), 2, "{m}");
    assert_eq!(
        metric(&m, "seckill_purchases_total{code=\"token_used\"}"),
        1,
        "{m}"
    );
    assert_eq!(metric(&m, "seckill_captchas_failed_total"), 5, "{m}");
    common::eventually(10, "the order is written", || async {
        api.books(&with_token, "audit").await.json()["live_orders"] == 1
    })
    .await;
}

/// What one buyer heard: honest buyers ask once; scripts replay and hammer.
struct Heard {
    user: i64,
    scripted: bool,
    codes: Vec<(u16, String)>,
    orders: Vec<String>,
}

async fn honest(api: Api, sale: String, bearer: String) -> Heard {
    let token = purchase_token(&api, &sale, &bearer).await;
    let answer = buy_with(&api, &sale, &bearer, &token).await;
    Heard {
        user: common::user_of(&bearer),
        scripted: false,
        codes: vec![answer.status_code()],
        orders: answer.order_id().into_iter().collect(),
    }
}

/// A script: one token fired 20 times at once, then three more tokens in a row.
async fn scripted(api: Api, sale: String, bearer: String) -> Heard {
    let token = purchase_token(&api, &sale, &bearer).await;
    let volley =
        futures_util::future::join_all((0..20).map(|_| buy_with(&api, &sale, &bearer, &token)))
            .await;
    let mut codes: Vec<_> = volley.iter().map(Reply::status_code).collect();
    let mut orders: Vec<_> = volley.iter().filter_map(Reply::order_id).collect();
    for _ in 0..3 {
        let token = purchase_token(&api, &sale, &bearer).await;
        let answer = buy_with(&api, &sale, &bearer, &token).await;
        codes.push(answer.status_code());
        orders.extend(answer.order_id());
    }
    Heard {
        user: common::user_of(&bearer),
        scripted: true,
        codes,
        orders,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bot_storm_against_an_anti_bot_sale_sells_exactly_the_stock() {
    const STOCK: i64 = 30;
    const BUYERS: usize = 3000;
    let dir = std::env::temp_dir().join(common::unique("redis"));
    std::fs::create_dir_all(&dir).unwrap();
    let redis = PrivateRedis::start(common::free_port(), &dir);
    let env = vec![
        (
            "SECKILL_DATABASE_URL".to_string(),
            common::fresh_database(Sql::Postgres).await,
        ),
        ("SECKILL_REDIS_URL".to_string(), redis.url()),
        ("SECKILL_DEV".to_string(), "1".to_string()),
        ("SECKILL_TOKEN_SECRET".to_string(), SECRET.to_string()),
        // 3,000 buyers on one loopback address, scripts firing 20 requests at once: far
        // past the default share of one address (1,000 connections).
        (
            "SECKILL_MAX_CONNECTIONS_PER_ADDRESS".to_string(),
            "10000".to_string(),
        ),
    ];
    let server = Server::start(env, vec!["serve".into()]).await;
    let api = server.api();
    let sale = api
        .open_sale_with(STOCK, 1, &json!({"anti_bot": "token"}))
        .await;
    let users = api.login_users(BUYERS).await;

    // First, while the stock is all there, one script's volley (its token fired 20 times
    // at once): the first attempt the gate decides buys, and every other one is refused
    // as a spent token: its buyer holds the limit, so it spends no place in the per-user
    // rate and never waits for it. In the storm below, most volleys arrive after the
    // sell-out and hear the cheaper `sold_out` from the flag instead.
    let first_script = scripted(api.clone(), sale.clone(), users[0].clone()).await;
    let volley = &first_script.codes[..20];
    let count = |code: &str| volley.iter().filter(|(_, c)| c == code).count();
    assert_eq!(count("ok"), 1, "{volley:?}");
    assert_eq!(count("token_used"), 19, "{volley:?}");

    let gate = Arc::new(tokio::sync::Semaphore::new(200));
    let tasks: Vec<_> = users
        .iter()
        .enumerate()
        .map(|(i, bearer)| {
            let (api, sale, bearer, gate) =
                (api.clone(), sale.clone(), bearer.clone(), gate.clone());
            tokio::spawn(async move {
                let _turn = gate.acquire().await.unwrap();
                if i % 3 == 0 {
                    scripted(api, sale, bearer).await
                } else {
                    honest(api, sale, bearer).await
                }
            })
        })
        .collect();
    let mut heard = vec![first_script];
    for t in tasks {
        heard.push(t.await.unwrap());
    }

    let mut wins: HashMap<i64, usize> = HashMap::new();
    let mut tally: HashMap<String, usize> = HashMap::new();
    for h in &heard {
        for (status, code) in &h.codes {
            *tally.entry(code.clone()).or_default() += 1;
            if code == "ok" {
                assert_eq!(*status, 200);
                *wins.entry(h.user).or_default() += 1;
            }
            let allowed: &[&str] = if h.scripted {
                &[
                    "ok",
                    "rate_limited",
                    "already_purchased",
                    "token_used",
                    "sold_out",
                ]
            } else {
                &["ok", "sold_out"]
            };
            assert!(
                allowed.contains(&code.as_str()),
                "scripted={} heard {status} {code}",
                h.scripted
            );
        }
    }
    assert_eq!(wins.values().sum::<usize>(), STOCK as usize, "{tally:?}");
    assert!(wins.values().all(|n| *n == 1), "one win per user");

    // The sold-out phase is answered from the instance's flag: the purchase script never
    // runs. Every run of it for a buyer below the limit stamps the buyer's entry in the
    // sale's rate hash (the per-user rate is on by default), so those entries must not
    // move; a run for a buyer who holds the limit would answer `already_purchased`, not
    // `sold_out`. (Counting EVALSHA in
    // INFO commandstats would also count the worker-id lease renewal every 15 s.)
    let late: Vec<&String> = users.iter().skip(1).step_by(10).take(200).collect();
    let rate_key = format!("seckill:{{{sale}}}:rate");
    let late_users: Vec<i64> = late.iter().map(|t| common::user_of(t)).collect();
    let stamps_before = redis.hmget(&rate_key, &late_users).await;
    let m = api.metrics().await;
    let shortcuts_before = metric(&m, "seckill_sold_out_shortcuts_total");
    for bearer in &late {
        let token = purchase_token(&api, &sale, bearer).await;
        let answer = buy_with(&api, &sale, bearer, &token).await;
        assert_eq!(answer.status_code(), (409, "sold_out".into()), "{answer}");
    }
    assert_eq!(
        redis.hmget(&rate_key, &late_users).await,
        stamps_before,
        "the purchase script did not run"
    );
    let m = api.metrics().await;
    assert_eq!(
        metric(&m, "seckill_sold_out_shortcuts_total") - shortcuts_before,
        200,
        "{m}"
    );

    // The database: exactly the stock, one unit per buyer, every `ok` there.
    common::eventually(30, "the order log drains", || async {
        api.books(&sale, "audit").await.json()["live_orders"] == STOCK
    })
    .await;
    let audit = api.books(&sale, "audit").await.json();
    assert_eq!(audit["live_units"], STOCK, "{audit}");
    assert_eq!(audit["distinct_buyers"], STOCK, "{audit}");
    assert_eq!(audit["max_units_per_buyer"], 1, "{audit}");
    assert_eq!(audit["oversold"], 0, "{audit}");
    assert_eq!(audit["sql_stock"], 0, "{audit}");
    let mut answered: Vec<String> = heard.iter().flat_map(|h| h.orders.clone()).collect();
    let ids = api.books(&sale, "order-ids").await.json();
    let mut stored: Vec<String> = ids["order_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    answered.sort();
    stored.sort();
    assert_eq!(
        answered, stored,
        "every ok is an order, and nothing else is"
    );
}
