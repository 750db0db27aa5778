//! The process's dependencies, the database and Redis, asked every half second whether they
//! answer within a second (the database on a connection of its own, Redis on the shared
//! multiplexed one, which nothing holds up): what `/readyz` and
//! `/metrics` say of them, at once and without a round trip of their own, and what tells the
//! HTTP edge to answer a call that needs the database with a clear 503 while it is away,
//! instead of making it wait out the pool. Never decides anything else.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;

use crate::redis_client::RedisConn;
use crate::store::Store;

/// What the process's start waits for, while it does (see `app::until_up`).
static WAITING: Mutex<Option<String>> = Mutex::new(None);

/// The start waits for `what` (`None`: no longer).
pub fn wait_for(what: Option<String>) {
    if let Ok(mut waiting) = WAITING.lock() {
        *waiting = what;
    }
}

/// What the process's start waits for, while it does.
pub fn waiting_for() -> Option<String> {
    WAITING.lock().ok().and_then(|w| w.clone())
}

/// How often each dependency is asked, and how long it may take to answer.
const EVERY: Duration = Duration::from_millis(500);
const ANSWER_WITHIN: Duration = Duration::from_secs(1);

/// One dependency as last seen.
pub struct Dependency {
    name: &'static str,
    up: AtomicBool,
    /// When it was last seen changing between up and down (Unix ms).
    since_ms: AtomicI64,
    error: Mutex<String>,
}

impl Dependency {
    fn new(name: &'static str, now_ms: i64) -> Self {
        Dependency {
            name,
            up: AtomicBool::new(true),
            since_ms: AtomicI64::new(now_ms),
            error: Mutex::new(String::new()),
        }
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// Why it is down, and for how long, or `None` while it answers.
    pub fn down(&self, now_ms: i64) -> Option<String> {
        if self.is_up() {
            return None;
        }
        let secs = (now_ms - self.since_ms.load(Ordering::Relaxed)).max(0) / 1000;
        let error = self.error.lock().map(|e| e.clone()).unwrap_or_default();
        Some(format!("{} unreachable for {secs} s ({error})", self.name))
    }

    fn saw(&self, answered: Result<(), String>, now_ms: i64) {
        let up = answered.is_ok();
        if self.up.swap(up, Ordering::Relaxed) != up {
            self.since_ms.store(now_ms, Ordering::Relaxed);
            match &answered {
                Ok(()) => tracing::info!(dependency = self.name, "answers again"),
                Err(e) => tracing::warn!(dependency = self.name, error = %e, "does not answer"),
            }
        }
        if let (Err(e), Ok(mut error)) = (answered, self.error.lock()) {
            *error = e;
        }
    }

    fn render(&self, out: &mut String) {
        out.push_str(&format!(
            "# HELP seckill_{0}_up Whether the {0} answered this instance's last probe (every 0.5 s).\n# TYPE seckill_{0}_up gauge\nseckill_{0}_up {1}\n",
            self.name,
            self.is_up() as u8
        ));
    }
}

/// The database and, when there is one, Redis.
pub struct Health {
    pub database: Dependency,
    pub redis: Option<Dependency>,
}

impl Health {
    pub fn new(redis: bool, now_ms: i64) -> Self {
        Health {
            database: Dependency::new("database", now_ms),
            redis: redis.then(|| Dependency::new("redis", now_ms)),
        }
    }

    /// What is down, named, or `None` when both answer.
    pub fn down(&self, now_ms: i64) -> Option<String> {
        let down: Vec<String> = [Some(&self.database), self.redis.as_ref()]
            .into_iter()
            .flatten()
            .filter_map(|d| d.down(now_ms))
            .collect();
        (!down.is_empty()).then(|| down.join("; "))
    }

    pub fn render(&self, out: &mut String) {
        self.database.render(out);
        if let Some(redis) = &self.redis {
            redis.render(out);
        }
    }

    /// Asks both every `EVERY` until `stop`.
    pub async fn run(
        self: std::sync::Arc<Self>,
        store: Store,
        redis: Option<RedisConn>,
        mut stop: watch::Receiver<bool>,
    ) {
        let mut conn = None;
        loop {
            let answered = store.ping(&mut conn, ANSWER_WITHIN).await;
            self.database
                .saw(answered.map_err(|e| e.to_string()), store.now_ms());
            if let (Some(dependency), Some(redis)) = (&self.redis, &redis) {
                let answered =
                    match tokio::time::timeout(ANSWER_WITHIN, redis.clone().check_health()).await {
                        Ok(answered) => answered,
                        Err(_) => Err(format!("no answer within {ANSWER_WITHIN:?}")),
                    };
                dependency.saw(answered, store.now_ms());
            }
            tokio::select! {
                _ = tokio::time::sleep(EVERY) => {}
                _ = stop.changed() => {}
            }
            if crate::stop::requested(&mut stop) {
                return;
            }
        }
    }
}
