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

/// How often Sentinel is asked for the master.
const ASK_EVERY: Duration = Duration::from_millis(500);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentinelUrl {
    pub sentinels: Vec<(String, u16)>,
    pub master_name: String,
    /// `user:password@` for the Redis servers (not the Sentinels), if any.
    pub credentials: Option<String>,
    pub db: Option<String>,
}

pub fn is_sentinel_url(url: &str) -> bool {
    url.starts_with("redis+sentinel://")
}

/// Parses `redis+sentinel://[user:password@]HOST:PORT[,HOST:PORT…]/MASTER_NAME[/DB]`.
pub fn parse(url: &str) -> Result<SentinelUrl, String> {
    let rest = url
        .strip_prefix("redis+sentinel://")
        .ok_or("a Sentinel URL starts with redis+sentinel://")?;
    let (credentials, rest) = match rest.rsplit_once('@') {
        Some((c, r)) => (Some(c.to_string()), r),
        None => (None, rest),
    };
    let (hosts, path) = rest
        .split_once('/')
        .ok_or("name the master: redis+sentinel://HOST:PORT/MASTER_NAME")?;
    let mut parts = path.split('/');
    let master_name = parts.next().unwrap_or_default().to_string();
    if master_name.is_empty() {
        return Err("name the master: redis+sentinel://HOST:PORT/MASTER_NAME".into());
    }
    let db = parts.next().filter(|d| !d.is_empty()).map(String::from);
    if db.as_deref().is_some_and(|d| d.parse::<u32>().is_err()) {
        return Err("the database after the master name must be a number".into());
    }
    let mut sentinels = Vec::new();
    for host in hosts.split(',') {
        let (h, p) = host.rsplit_once(':').unwrap_or((host, "26379"));
        let port = p
            .parse::<u16>()
            .map_err(|_| format!("bad Sentinel port in {host:?}"))?;
        if h.is_empty() {
            return Err(format!("bad Sentinel address {host:?}"));
        }
        sentinels.push((h.to_string(), port));
    }
    Ok(SentinelUrl {
        sentinels,
        master_name,
        credentials,
        db,
    })
}

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
    let script = redis::Script::new(include_str!("gate/forget_stale.lua"));
    let mut cursor: u64 = 0;
    let mut forgotten = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}:{{*}}:sale"))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_urls() {
        let u = parse("redis+sentinel://a:26379,b:26380/mymaster").unwrap();
        assert_eq!(
            u.sentinels,
            vec![("a".to_string(), 26379), ("b".to_string(), 26380)]
        );
        assert_eq!(u.master_name, "mymaster");
        assert_eq!(u.credentials, None);
        let u = parse("redis+sentinel://:pw@h/m/2").unwrap();
        assert_eq!(u.sentinels, vec![("h".to_string(), 26379)]);
        assert_eq!(
            (u.credentials.as_deref(), u.db.as_deref()),
            (Some(":pw"), Some("2"))
        );
        for bad in [
            "redis://h/m",
            "redis+sentinel://h:1",
            "redis+sentinel://h:1/",
            "redis+sentinel://h:x/m",
            "redis+sentinel://h/m/x",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
