//! Redis Sentinel: follows the master of a Sentinel-managed Redis
//! (`redis+sentinel://HOST:PORT[,HOST:PORT…]/MASTER_NAME`). Every Redis connection of this
//! process goes through a local forwarder that connects to the master Sentinel names (and
//! that says `ROLE master` itself). When Sentinel names a new master, the forwarder first
//! forgets the gates loaded into the old one (they are rebuilt from SQL + their streams),
//! then drops every connection, so that clients reconnect — to the new master.
//! Never decides anything, never writes to a replica.

use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub use crate::config::redis_url::{is_sentinel_url, parse, SentinelUrl};

/// Counts this process's master changes: work begun on the old master (a gate load) is
/// given up when it moves, and started again on the new one.
static MASTER_CHANGES: std::sync::LazyLock<watch::Sender<u64>> =
    std::sync::LazyLock::new(|| watch::channel(0).0);

/// Sees each change of master from here on (never, without Sentinel).
pub fn master_changes() -> watch::Receiver<u64> {
    MASTER_CHANGES.subscribe()
}

/// How often Sentinel is asked for the master.
const ASK_EVERY: Duration = Duration::from_millis(500);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Starts following the master; returns the URL every Redis client of this process uses
/// (the local forwarder). Fails if no Sentinel names a master that answers.
pub async fn follow(url: &SentinelUrl, prefix: &str) -> Result<String, redis::RedisError> {
    let master = resolve(url).await.ok_or_else(|| {
        redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::NotConnected,
            format!(
                "no Sentinel of {:?} names a reachable master {:?}",
                url.sentinels, url.master_name
            ),
        ))
    })?;
    tracing::info!(master = %format!("{}:{}", master.0, master.1), name = url.master_name, "Redis master (Sentinel)");
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let local = listener.local_addr()?;
    let (current, watching) = watch::channel(master);
    tokio::spawn(forward(listener, watching));
    let local_url = server_url(url, "127.0.0.1", local.port());
    tokio::spawn(watch_master(url.clone(), prefix.to_string(), current));
    Ok(local_url)
}

/// The URL of one Redis server of the deployment, with its credentials and database.
fn server_url(url: &SentinelUrl, host: &str, port: u16) -> String {
    format!(
        "redis://{}{host}:{port}/{}",
        url.credentials
            .as_deref()
            .map(|c| format!("{c}@"))
            .unwrap_or_default(),
        url.db.as_deref().unwrap_or("")
    )
}

/// The master Sentinel names, if it answers as a master.
async fn resolve(url: &SentinelUrl) -> Option<(String, u16)> {
    for (host, port) in &url.sentinels {
        let Ok(client) = redis::Client::open(format!("redis://{host}:{port}/")) else {
            continue;
        };
        let asked = async {
            let mut conn = client.get_multiplexed_async_connection().await?;
            redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(&url.master_name)
                .query_async::<Option<(String, u16)>>(&mut conn)
                .await
        };
        let Ok(Ok(Some(master))) = tokio::time::timeout(CONNECT_TIMEOUT, asked).await else {
            continue;
        };
        if is_master(url, &master).await {
            return Some(master);
        }
    }
    None
}

/// Whether the server says it is a master (Sentinel may name one mid-failover).
async fn is_master(url: &SentinelUrl, (host, port): &(String, u16)) -> bool {
    let Ok(client) = redis::Client::open(server_url(url, host, *port)) else {
        return false;
    };
    let asked = async {
        let mut conn = client.get_multiplexed_async_connection().await?;
        redis::cmd("ROLE")
            .query_async::<redis::Value>(&mut conn)
            .await
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, asked).await {
        Ok(Ok(redis::Value::Array(parts))) => matches!(
            parts.first(),
            Some(redis::Value::BulkString(role)) if role == b"master"
        ),
        _ => false,
    }
}

/// Asks Sentinel for the master twice a second; on a change, forgets the gates loaded into
/// the old master (through the new one, before anyone else reaches it), then switches.
async fn watch_master(url: SentinelUrl, prefix: String, current: watch::Sender<(String, u16)>) {
    loop {
        tokio::time::sleep(ASK_EVERY).await;
        let Some(master) = resolve(&url).await else {
            continue;
        };
        if *current.borrow() == master {
            continue;
        }
        let old = current.borrow().clone();
        tracing::error!(
            from = %format!("{}:{}", old.0, old.1),
            to = %format!("{}:{}", master.0, master.1),
            "Redis master changed (Sentinel failover): rebuilding the gates from SQL; connections move to the new master"
        );
        match forget_stale_sales(&url, &master, &prefix).await {
            Ok(forgotten) => tracing::warn!(
                forgotten,
                "sales loaded into the old master forgotten on the new one; they are rebuilt from SQL and their streams"
            ),
            Err(e) => tracing::warn!(error = %e, "could not check the sales on the new master; the scheduler will"),
        }
        current.send_replace(master);
        MASTER_CHANGES.send_modify(|changes| *changes += 1);
    }
}

/// Runs forget_stale.lua on every sale of this prefix on `master`.
async fn forget_stale_sales(
    url: &SentinelUrl,
    (host, port): &(String, u16),
    prefix: &str,
) -> Result<usize, redis::RedisError> {
    let client = redis::Client::open(server_url(url, host, *port))?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let script = redis::Script::new(super::lease::FORGET_STALE_LUA);
    let mut cursor: u64 = 0;
    let mut forgotten = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(super::keys::every_sale_pattern(prefix))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        for key in keys {
            let n: i64 = script.key(&key).invoke_async(&mut conn).await?;
            forgotten += n as usize;
        }
        if next == 0 {
            return Ok(forgotten);
        }
        cursor = next;
    }
}

/// Accepts the process's Redis connections and pipes each to the current master until
/// the master changes (then it is closed, and its client reconnects).
async fn forward(listener: TcpListener, master: watch::Receiver<(String, u16)>) {
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let mut master = master.clone();
        tokio::spawn(async move {
            let (host, port) = master.borrow_and_update().clone();
            let connected =
                tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect((host.as_str(), port)))
                    .await;
            let Ok(Ok(mut outbound)) = connected else {
                return;
            };
            let _ = inbound.set_nodelay(true);
            let _ = outbound.set_nodelay(true);
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                _ = master.changed() => {}
            }
        });
    }
}
