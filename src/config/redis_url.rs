//! The forms of a Redis URL, read at configuration time: one server (`redis://`,
//! `rediss://`), a Sentinel-managed master (`redis+sentinel://`) or a Redis Cluster
//! (`redis+cluster://`). Parsing only: connecting is `redis_client`'s.

/// The scheme of a Redis Cluster URL: `redis+cluster://HOST:PORT[,HOST:PORT...]`.
pub const CLUSTER_SCHEME: &str = "redis+cluster://";

pub fn is_cluster_url(url: &str) -> bool {
    url.starts_with(CLUSTER_SCHEME)
}

/// The seed nodes of a cluster URL as `redis://` URLs, credentials applied to each.
pub fn parse_cluster_url(url: &str) -> Result<Vec<String>, String> {
    let rest = url
        .strip_prefix(CLUSTER_SCHEME)
        .ok_or_else(|| format!("a cluster URL starts with {CLUSTER_SCHEME}"))?;
    let rest = rest.trim_end_matches('/');
    if rest.contains('/') {
        return Err("a cluster has one database (0): no /DB after the seed nodes".into());
    }
    let (auth, hosts) = match rest.rsplit_once('@') {
        Some((auth, hosts)) => (format!("{auth}@"), hosts),
        None => (String::new(), rest),
    };
    let seeds: Vec<String> = hosts
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(|h| format!("redis://{auth}{h}/"))
        .collect();
    if seeds.is_empty() {
        return Err("name at least one seed node: redis+cluster://HOST:PORT[,HOST:PORT...]".into());
    }
    for seed in &seeds {
        redis::Client::open(seed.as_str()).map_err(|e| format!("{e}"))?;
    }
    Ok(seeds)
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_urls_name_their_seeds() {
        assert_eq!(
            parse_cluster_url("redis+cluster://a:7000,b:7001/").unwrap(),
            vec!["redis://a:7000/", "redis://b:7001/"]
        );
        assert_eq!(
            parse_cluster_url("redis+cluster://:pw@a:7000,b:7001").unwrap(),
            vec!["redis://:pw@a:7000/", "redis://:pw@b:7001/"]
        );
        assert!(parse_cluster_url("redis+cluster://").is_err());
        assert!(parse_cluster_url("redis+cluster://a:7000/3").is_err());
        assert!(parse_cluster_url("redis://a:7000").is_err());
    }

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
