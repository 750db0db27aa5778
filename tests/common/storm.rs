//! The buyers' side of storm tests against running instances: buyers who retry until a
//! final answer and remember what they were told, and the invariants checked against SQL
//! afterwards (each buyer at most one order, every `ok` in SQL, stock adds up).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use seckill::model::OrderStatus;
use seckill::store::Store;

use super::{Api, Worker};

/// The processes of a distributed test deployment: two `serve --no-writer` instances and
/// two `worker`s, all with `env` (database, Redis, token secret, ...).
pub async fn instances_and_workers(
    env: Vec<(String, String)>,
) -> (Vec<super::Server>, Vec<Worker>) {
    let mut instances = Vec::new();
    for _ in 0..2 {
        instances.push(
            super::Server::start(env.clone(), vec!["serve".into(), "--no-writer".into()]).await,
        );
    }
    let workers = start_workers(&env);
    (instances, workers)
}

/// Two more `worker`s for a deployment started by [`instances_and_workers`].
pub fn start_workers(env: &[(String, String)]) -> Vec<Worker> {
    (0..2).map(|_| super::worker(env)).collect()
}

/// Bearer tokens (signed with the deployment's `secret`, valid an hour) for these users.
pub fn tokens(secret: &str, users: std::ops::Range<i64>) -> Vec<(i64, String)> {
    let signer = seckill::edge::auth::TokenSigner::new(secret);
    let exp = seckill::clock::wall_ms() / 1000 + 3600;
    users.map(|u| (u, signer.sign(u, exp))).collect()
}

/// Orders per user in SQL for a sale (live ones).
pub async fn live_orders(store: &Store, sale_id: i64) -> HashMap<i64, Vec<i64>> {
    let mut by_user: HashMap<i64, Vec<i64>> = HashMap::new();
    for o in store.orders_of_sale(sale_id).await.unwrap() {
        by_user.entry(o.user_id).or_default().push(o.id);
    }
    by_user
}

/// What one buyer was told, attempt after attempt, until a final answer.
#[derive(Debug, Default, Clone)]
pub struct Told {
    /// Order ids answered `ok`.
    pub ok: Vec<i64>,
    /// Order ids answered `pending` (the attempt may have bought).
    pub pending: Vec<i64>,
    /// 503s (`unavailable`, `not_loaded`) and requests that got no answer.
    pub unavailable: usize,
    /// Requests that got no answer at all (the instance was killed or the connection cut
    /// while it decided): such an attempt may have bought, and nobody could tell the buyer.
    pub unanswered: usize,
    /// The final answer's code.
    pub last: String,
    /// When each answer came: (instant, code), for the timeline checks.
    pub times: Vec<(Instant, String)>,
}

/// Buys until a final answer (ok, already_purchased, sold_out), retrying 503s and pendings.
pub async fn buy_until_final(api: &Api, sale: &str, token: &str, give_up: Instant) -> Told {
    let mut told = Told::default();
    while Instant::now() < give_up {
        let Ok(r) = api.try_buy(token, sale).await else {
            told.unavailable += 1;
            told.unanswered += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let (status, body) = (r.status, r.body);
        assert_ne!(status, 500, "never a 500: {body}");
        let code = body["code"].as_str().unwrap_or("").to_string();
        told.times.push((Instant::now(), code.clone()));
        let id = || body["order_id"].as_str().unwrap().parse::<i64>().unwrap();
        match code.as_str() {
            "ok" => {
                told.ok.push(id());
                told.last = code;
                return told;
            }
            "already_purchased" | "sold_out" => {
                told.last = code;
                return told;
            }
            "pending" => {
                assert_eq!(status, 202, "{body}");
                told.pending.push(id());
            }
            "unavailable" | "not_loaded" => {
                assert_eq!(status, 503, "{body}");
                told.unavailable += 1;
            }
            other => panic!("unexpected answer {status} {other}: {body}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "no final answer before the time limit: ok {:?}, pending {:?}, {} unavailable, last answers {:?}",
        told.ok,
        told.pending,
        told.unavailable,
        told.times.iter().rev().take(3).map(|(_, c)| c).collect::<Vec<_>>()
    );
}

/// How buyers arrive.
#[derive(Debug, Clone, Copy)]
pub enum Arrival {
    /// All at once, this many at a time.
    Crowd(usize),
    /// One every this often, so that the storm outlasts what the test does meanwhile.
    Every(Duration),
}

/// Every buyer in `tokens` buys until a final answer, through the instances in turn;
/// `started` counts the buyers who have begun. Returns what each buyer was told.
pub async fn storm_on(
    bases: Vec<String>,
    sale: String,
    tokens: Vec<(i64, String)>,
    arrival: Arrival,
    started: Arc<AtomicUsize>,
) -> HashMap<i64, Told> {
    let api = Api::new(&bases[0]);
    let sem = Arc::new(tokio::sync::Semaphore::new(match arrival {
        Arrival::Crowd(n) => n,
        Arrival::Every(_) => tokio::sync::Semaphore::MAX_PERMITS,
    }));
    let begin = Instant::now();
    let give_up = begin + Duration::from_secs(120);
    let mut tasks = Vec::new();
    for (i, (user, token)) in tokens.into_iter().enumerate() {
        let (api, sale, sem, started) = (
            api.at(&bases[i % bases.len()]),
            sale.clone(),
            sem.clone(),
            started.clone(),
        );
        tasks.push(tokio::spawn(async move {
            if let Arrival::Every(every) = arrival {
                tokio::time::sleep_until((begin + every * i as u32).into()).await;
            }
            let _permit = sem.acquire().await.unwrap();
            started.fetch_add(1, Ordering::Relaxed);
            (user, buy_until_final(&api, &sale, &token, give_up).await)
        }));
    }
    let mut told = HashMap::new();
    for t in tasks {
        let (user, answers) = t.await.unwrap();
        told.insert(user, answers);
    }
    told
}

/// When the first `ok` after `since` came, if any.
pub fn first_ok_after(told: &HashMap<i64, Told>, since: Instant) -> Option<Instant> {
    told.values()
        .flat_map(|t| t.times.iter())
        .filter(|(at, code)| code == "ok" && *at >= since)
        .map(|(at, _)| *at)
        .min()
}

/// Adds a later storm's order ids to what each buyer was told so far.
pub fn merge(told: &mut HashMap<i64, Told>, later: HashMap<i64, Told>) {
    for (user, t) in later {
        let entry = told.entry(user).or_default();
        entry.ok.extend(t.ok);
        entry.pending.extend(t.pending);
        entry.unanswered += t.unanswered;
    }
}

/// The invariants after the storms: each buyer holds at most one order, every `ok` is in
/// SQL, every order in SQL was answered `ok` or `pending` to its buyer (or one of the
/// buyer's attempts got no answer at all: a 503 never hides an order), stock adds up.
pub async fn check_sql(store: &Store, sale_id: i64, stock: i64, told: &HashMap<i64, Told>) {
    // Each `ok` id itself, not a count: orders answered `pending` count too, and can reach
    // SQL while an `ok` whose stream read was lost in a fault waits for a writer to reclaim
    // it (10-15 s).
    let ok_ids: Vec<(i64, i64)> = told
        .iter()
        .flat_map(|(user, t)| t.ok.iter().map(move |id| (*user, *id)))
        .collect();
    let ok_ids = Arc::new(ok_ids);
    super::eventually(60, "every ok reaches SQL", || {
        let (store, ok_ids) = (store.clone(), ok_ids.clone());
        async move {
            let orders = live_orders(&store, sale_id).await;
            ok_ids
                .iter()
                .all(|(user, id)| orders.get(user).is_some_and(|ids| ids.contains(id)))
        }
    })
    .await;
    // Pending attempts settle within seconds; let the writers finish them.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let orders = live_orders(store, sale_id).await;
    let twice: Vec<_> = orders.iter().filter(|(_, ids)| ids.len() > 1).collect();
    assert!(twice.is_empty(), "buyers with two orders: {twice:?}");
    for (user, t) in told {
        for id in &t.ok {
            assert!(
                orders.get(user).is_some_and(|ids| ids.contains(id)),
                "buyer {user} was told ok for {id}, not in SQL"
            );
        }
    }
    for (user, ids) in &orders {
        let t = told.get(user);
        for id in ids {
            assert!(
                t.is_some_and(|t| t.ok.contains(id) || t.pending.contains(id) || t.unanswered > 0),
                "order {id} of buyer {user} was never answered ok or pending: {t:?}"
            );
        }
    }
    let sold: i64 = orders.values().map(|ids| ids.len() as i64).sum();
    let sale = store.sale(sale_id).await.unwrap().unwrap();
    assert_eq!(
        sale.stock,
        stock - sold,
        "SQL stock + orders = initial stock"
    );
}

/// Bearer tokens for these users (any ids, e.g. chosen by segment).
pub fn tokens_for(secret: &str, users: &[i64]) -> Vec<(i64, String)> {
    let signer = seckill::edge::auth::TokenSigner::new(secret);
    let exp = seckill::clock::wall_ms() / 1000 + 3600;
    users.iter().map(|u| (*u, signer.sign(*u, exp))).collect()
}

/// `count` user ids from `from` on whose buyers a sale of `segments` pins to `segment`.
pub fn users_of_segment(segments: i64, segment: i64, from: i64, count: usize) -> Vec<i64> {
    (from..)
        .filter(|u| seckill::model::segments::segment_of(*u, segments) == segment)
        .take(count)
        .collect()
}

/// The books of a segmented sale balance, segment by segment, once its orders are written:
/// every move finished (done or refused), and each segment's gate stock plus its buyers'
/// live units equals its allocation in SQL (even share, plus moves in, less moves out).
/// Returns each segment's gate stock.
pub async fn check_segments(
    store: &Store,
    redis_url: &str,
    prefix: &str,
    sale_id: i64,
) -> Vec<i64> {
    use seckill::gate::Gate;
    let sale = store.sale(sale_id).await.unwrap().unwrap();
    let n = sale.segments;
    let (_, conn) = seckill::app::redis_manager(redis_url).await.unwrap();
    let gate = seckill::gate::redis::RedisGate::new(conn, prefix);
    let moves = store.moves_of_sale(sale_id).await.unwrap();
    let unfinished: Vec<_> = moves
        .iter()
        .filter(|m| m.state != "done" && m.state != "refused")
        .collect();
    assert!(
        unfinished.is_empty(),
        "moves left unfinished: {unfinished:?}"
    );
    let orders = store.orders_of_sale(sale_id).await.unwrap();
    let stocks = gate.segment_stocks(sale_id, n).await.unwrap();
    let mut out = Vec::new();
    for s in 0..n {
        let live: i64 = orders
            .iter()
            .filter(|o| {
                matches!(o.status, OrderStatus::PendingPayment | OrderStatus::Paid)
                    && seckill::model::segments::segment_of(o.user_id, n) == s
            })
            .map(|o| o.quantity)
            .sum();
        let net: i64 = moves
            .iter()
            .filter(|m| m.state == "done")
            .map(|m| {
                i64::from(m.to_segment == s) * m.quantity
                    - i64::from(m.from_segment == s) * m.quantity
            })
            .sum();
        let stock = stocks[s as usize].expect("every segment is in the gate");
        assert_eq!(
            stock + live,
            seckill::model::segments::allocation(sale.initial_stock, n, s) + net,
            "segment {s}: gate stock {stock} + live units {live} = allocation + moves"
        );
        out.push(stock);
    }
    out
}
