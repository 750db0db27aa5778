//! Anti-bot over HTTP. Purchase tokens: required when the sale asks for them, bound to one
//! user and one sale, single-use, issued only while the sale is open. Captchas: a picture
//! with no text, one guess each, required for a token when the sale asks for it. Then the
//! storm of the protection layer: 100 times more buyers than stock, a third of them
//! scripts replaying tokens and hammering, against a Redis of the test's own so that every
//! gate call can be counted.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use base64::Engine;
use common::{metric, metrics, PrivateRedis, Server, Sql};
use serde_json::{json, Value};

const SECRET: &str = "e2e-antibot-secret";

async fn get(c: &reqwest::Client, url: String, bearer: &str) -> (u16, Value) {
    let r = c.get(url).bearer_auth(bearer).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

async fn buy_with(
    c: &reqwest::Client,
    base: &str,
    sale: &str,
    bearer: &str,
    token: Option<&str>,
) -> (u16, Value) {
    let body = match token {
        Some(t) => json!({ "token": t }),
        None => json!({}),
    };
    let r = c
        .post(format!("{base}/api/sales/{sale}/purchase"))
        .bearer_auth(bearer)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

async fn purchase_token(c: &reqwest::Client, base: &str, sale: &str, bearer: &str) -> String {
    let (status, body) = get(c, format!("{base}/api/sales/{sale}/token"), bearer).await;
    assert_eq!(status, 200, "{body}");
    body["token"].as_str().unwrap().to_string()
}

/// The order id of an `ok` answer.
fn order_of(answer: &(u16, Value)) -> Option<String> {
    answer.1["order_id"].as_str().map(str::to_string)
}

fn code(answer: &(u16, Value)) -> (u16, String) {
    (
        answer.0,
        answer.1["code"].as_str().unwrap_or_default().to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purchase_tokens_and_captchas_over_http() {
    let db = common::fresh_database(Sql::Sqlite).await;
    let env = vec![
        ("SECKILL_DATABASE_URL".into(), db),
        ("SECKILL_TOKEN_SECRET".into(), SECRET.into()),
    ];
    let server = Server::start(env, vec!["serve".into()]).await;
    let base = server.base.clone();
    let c = common::client();
    let with_token = common::open_sale_with(&c, &server, 5, 1, json!({"anti_bot": "token"})).await;
    let with_captcha =
        common::open_sale_with(&c, &server, 5, 1, json!({"anti_bot": "captcha"})).await;
    let in_an_hour = (time::OffsetDateTime::now_utc() + time::Duration::hours(1))
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap();
    let later = common::open_sale_with(
        &c,
        &server,
        5,
        1,
        json!({"anti_bot": "token", "begins_at": in_an_hour, "ends_at": "2099-01-01T00:00:00Z"}),
    )
    .await;
    let users = common::login_users(&c, &base, 5).await;
    let sale_view = common::get_json(&c, format!("{base}/api/sales/{with_token}"), None).await;
    assert_eq!(
        sale_view["anti_bot"], "token",
        "clients learn what to fetch"
    );

    // Tokens: required, bound to user and sale, single-use.
    let no_token = buy_with(&c, &base, &with_token, &users[0], None).await;
    assert_eq!(
        code(&no_token),
        (403, "token_required".into()),
        "{no_token:?}"
    );
    let t0 = purchase_token(&c, &base, &with_token, &users[0]).await;
    let moved = buy_with(&c, &base, &with_token, &users[1], Some(&t0)).await;
    assert_eq!(code(&moved), (403, "token_invalid".into()), "{moved:?}");
    let other_sale = buy_with(&c, &base, &with_captcha, &users[0], Some(&t0)).await;
    assert_eq!(code(&other_sale), (403, "token_invalid".into()));
    let forged = buy_with(
        &c,
        &base,
        &with_token,
        &users[0],
        Some(&t0.replace('.', "_")),
    )
    .await;
    assert_eq!(code(&forged), (403, "token_invalid".into()));
    let ok = buy_with(&c, &base, &with_token, &users[0], Some(&t0)).await;
    assert_eq!(code(&ok), (200, "ok".into()), "{ok:?}");
    let replay = buy_with(&c, &base, &with_token, &users[0], Some(&t0)).await;
    assert_eq!(code(&replay), (403, "token_used".into()), "{replay:?}");
    let t1 = purchase_token(&c, &base, &with_token, &users[0]).await;
    let again = buy_with(&c, &base, &with_token, &users[0], Some(&t1)).await;
    assert_eq!(code(&again), (409, "already_purchased".into()));
    let early = get(&c, format!("{base}/api/sales/{later}/token"), &users[0]).await;
    assert_eq!(
        code(&early),
        (409, "not_started".into()),
        "only inside the window"
    );
    let no_captcha_here = get(
        &c,
        format!("{base}/api/sales/{with_token}/captcha"),
        &users[0],
    )
    .await;
    assert_eq!(code(&no_captcha_here), (409, "conflict".into()));
    let junk = get(
        &c,
        format!("{base}/api/sales/{with_token}/token?x=1"),
        &users[0],
    )
    .await;
    assert_eq!(code(&junk), (400, "invalid_request".into()), "{junk:?}");
    let anonymous = c
        .get(format!("{base}/api/sales/{with_token}/token"))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);

    // Captchas: a picture only, one guess each.
    let cap_url = format!("{base}/api/sales/{with_captcha}/captcha");
    let token_url = format!("{base}/api/sales/{with_captcha}/token");
    let unsolved = get(&c, token_url.clone(), &users[1]).await;
    assert_eq!(code(&unsolved), (403, "captcha_required".into()));
    let (status, captcha) = get(&c, cap_url.clone(), &users[1]).await;
    assert_eq!(status, 200, "{captcha}");
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
        let (c, url) = (c.clone(), token_url.clone());
        async move { get(&c, format!("{url}?captcha_id={id}&answer={answer}"), &user).await }
    };
    let miss = guess(wrong.into(), id.into(), users[1].clone()).await;
    assert_eq!(code(&miss), (403, "captcha_failed".into()));
    let second_guess = guess(answer.clone(), id.into(), users[1].clone()).await;
    assert_eq!(
        code(&second_guess),
        (403, "captcha_failed".into()),
        "one guess per picture: {second_guess:?}"
    );
    let (_, fresh) = get(&c, cap_url.clone(), &users[1]).await;
    let fresh_id = fresh["captcha_id"].as_str().unwrap().to_string();
    let fresh_answer =
        seckill::edge::antibot::answer_for(SECRET, with_captcha.parse().unwrap(), user1, &fresh_id)
            .unwrap();
    let not_yours = guess(fresh_answer.clone(), fresh_id.clone(), users[2].clone()).await;
    assert_eq!(code(&not_yours), (403, "captcha_failed".into()));
    let solved = guess(fresh_answer.clone(), fresh_id.clone(), users[1].clone()).await;
    assert_eq!(solved.0, 200, "{solved:?}");
    let token = solved.1["token"].as_str().unwrap();
    let bought = buy_with(&c, &base, &with_captcha, &users[1], Some(token)).await;
    assert_eq!(code(&bought), (200, "ok".into()), "{bought:?}");
    let reused = guess(fresh_answer, fresh_id, users[1].clone()).await;
    assert_eq!(code(&reused), (403, "captcha_failed".into()));

    // Pictures are rationed per buyer and sale: five at once, then one every five seconds.
    let mut answers = Vec::new();
    for _ in 0..7 {
        let r = c.get(&cap_url).bearer_auth(&users[3]).send().await.unwrap();
        let retry_after = r
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string());
        let status = r.status().as_u16();
        let body: serde_json::Value = r.json().await.unwrap();
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
    let (status, _) = get(&c, cap_url.clone(), &users[4]).await;
    assert_eq!(status, 200, "another buyer is not affected");

    let m = metrics(&c, &server).await;
    assert_eq!(metric(&m, "seckill_captchas_limited_total"), 2, "{m}");
    assert_eq!(
        metric(&m, "seckill_purchases_total{code=\"token_used\"}"),
        1,
        "{m}"
    );
    assert_eq!(metric(&m, "seckill_captchas_failed_total"), 5, "{m}");
    common::eventually(10, "the order is written", || {
        let (c, url, admin) = (
            c.clone(),
            format!("{base}/api/admin/sales/{with_token}/audit"),
            server.admin.clone(),
        );
        async move { common::get_json(&c, url, Some(&admin)).await["live_orders"] == 1 }
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

async fn honest(c: reqwest::Client, base: String, sale: String, bearer: String) -> Heard {
    let token = purchase_token(&c, &base, &sale, &bearer).await;
    let answer = buy_with(&c, &base, &sale, &bearer, Some(&token)).await;
    Heard {
        user: common::user_of(&bearer),
        scripted: false,
        codes: vec![code(&answer)],
        orders: order_of(&answer).into_iter().collect(),
    }
}

/// A script: one token fired 20 times at once, then three more tokens in a row.
async fn scripted(c: reqwest::Client, base: String, sale: String, bearer: String) -> Heard {
    let token = purchase_token(&c, &base, &sale, &bearer).await;
    let volley = futures_util::future::join_all(
        (0..20).map(|_| buy_with(&c, &base, &sale, &bearer, Some(&token))),
    )
    .await;
    let mut codes: Vec<_> = volley.iter().map(code).collect();
    let mut orders: Vec<_> = volley.iter().filter_map(order_of).collect();
    for _ in 0..3 {
        let token = purchase_token(&c, &base, &sale, &bearer).await;
        let answer = buy_with(&c, &base, &sale, &bearer, Some(&token)).await;
        codes.push(code(&answer));
        orders.extend(order_of(&answer));
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
    let c = common::client();
    let sale = common::open_sale_with(&c, &server, STOCK, 1, json!({"anti_bot": "token"})).await;
    let users = common::login_users(&c, &server.base, BUYERS).await;

    // First, while the stock is all there, one script's volley (its token fired 20 times
    // at once): one purchase, every repeat refused as a repeat, by the per-user rate limit
    // (its burst is 10) or as a spent token. In the storm below, most volleys arrive after
    // the sell-out and hear the cheaper `sold_out` from the flag instead.
    let first_script = scripted(
        c.clone(),
        server.base.clone(),
        sale.clone(),
        users[0].clone(),
    )
    .await;
    let volley = &first_script.codes[..20];
    let count = |code: &str| volley.iter().filter(|(_, c)| c == code).count();
    assert_eq!(count("ok"), 1, "{volley:?}");
    assert_eq!(
        count("rate_limited") + count("token_used"),
        19,
        "{volley:?}"
    );
    assert!(count("rate_limited") >= 1, "{volley:?}");

    let gate = Arc::new(tokio::sync::Semaphore::new(200));
    let tasks: Vec<_> = users
        .iter()
        .enumerate()
        .map(|(i, bearer)| {
            let (c, base, sale, bearer) =
                (c.clone(), server.base.clone(), sale.clone(), bearer.clone());
            let gate = gate.clone();
            tokio::spawn(async move {
                let _turn = gate.acquire().await.unwrap();
                if i % 3 == 0 {
                    scripted(c, base, sale, bearer).await
                } else {
                    honest(c, base, sale, bearer).await
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
    // runs. Every run of it stamps the buyer's entry in the sale's rate hash (the per-user
    // limit is on by default), so those entries must not move. (Counting EVALSHA in
    // INFO commandstats would also count the worker-id lease renewal every 15 s.)
    let late: Vec<&String> = users.iter().skip(1).step_by(10).take(200).collect();
    let rate_key = format!("seckill:{{{sale}}}:rate");
    let late_users: Vec<i64> = late.iter().map(|t| common::user_of(t)).collect();
    let stamps_before = redis.hmget(&rate_key, &late_users).await;
    let m = metrics(&c, &server).await;
    let shortcuts_before = metric(&m, "seckill_sold_out_shortcuts_total");
    for bearer in &late {
        let token = purchase_token(&c, &server.base, &sale, bearer).await;
        let answer = buy_with(&c, &server.base, &sale, bearer, Some(&token)).await;
        assert_eq!(code(&answer), (409, "sold_out".into()), "{answer:?}");
    }
    assert_eq!(
        redis.hmget(&rate_key, &late_users).await,
        stamps_before,
        "the purchase script did not run"
    );
    let m = metrics(&c, &server).await;
    assert_eq!(
        metric(&m, "seckill_sold_out_shortcuts_total") - shortcuts_before,
        200,
        "{m}"
    );

    // The database: exactly the stock, one unit per buyer, every `ok` there.
    let audit_url = format!("{}/api/admin/sales/{sale}/audit", server.base);
    common::eventually(30, "the order log drains", || {
        let (c, url, admin) = (c.clone(), audit_url.clone(), server.admin.clone());
        async move { common::get_json(&c, url, Some(&admin)).await["live_orders"] == STOCK }
    })
    .await;
    let audit = common::get_json(&c, audit_url, Some(&server.admin)).await;
    assert_eq!(audit["live_units"], STOCK, "{audit}");
    assert_eq!(audit["distinct_buyers"], STOCK, "{audit}");
    assert_eq!(audit["max_units_per_buyer"], 1, "{audit}");
    assert_eq!(audit["oversold"], 0, "{audit}");
    assert_eq!(audit["sql_stock"], 0, "{audit}");
    let mut answered: Vec<String> = heard.iter().flat_map(|h| h.orders.clone()).collect();
    let ids = common::get_json(
        &c,
        format!("{}/api/admin/sales/{sale}/order-ids", server.base),
        Some(&server.admin),
    )
    .await;
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
