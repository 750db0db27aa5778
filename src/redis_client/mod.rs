//! How this process reaches Redis: one standalone server (directly, or through the
//! Sentinel follower's local forwarder) or a Redis Cluster (`redis+cluster://` seed nodes).
//! Owns the connection settings, the key layout (`keys`), many keys' commands in one round
//! trip per server (`keyed`), a cluster connection that recovers from a wedge (`cluster`),
//! leases (`lease`), the Sentinel follower (`sentinel`) and the
//! one connection type every other module uses, so that the gate, order log, ids and
//! scheduler are the same code for both.
//! It never decides anything and never retries a command of its own accord: in a cluster,
//! MOVED/ASK/TRYAGAIN are followed by the cluster client (routing, not failures), and a
//! pipeline's command sent to a master that no longer serves its slot goes again on its
//! own, through that client.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
use redis::cluster::ClusterClient;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, Slot, SlotAddr};
use redis::{Cmd, FromRedisValue, Pipeline, RedisError, RedisFuture, RedisResult, Value};

pub use crate::config::redis_url::{is_cluster_url, parse_cluster_url};

pub mod cluster;
pub mod keyed;
pub mod keys;
pub mod lease;
pub mod sentinel;

/// How long a command or a connection attempt may take before it fails.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);

/// What a process opens connections from.
#[derive(Clone)]
pub enum RedisClient {
    Single(redis::Client),
    Cluster {
        client: Box<ClusterClient>,
        seeds: Vec<String>,
    },
}

impl RedisClient {
    pub fn open(url: &str) -> Result<Self, RedisError> {
        if !is_cluster_url(url) {
            return Ok(RedisClient::Single(redis::Client::open(url)?));
        }
        let seeds = parse_cluster_url(url).map_err(|e| {
            RedisError::from((redis::ErrorKind::InvalidClientConfig, "bad cluster URL", e))
        })?;
        let client = ClusterClient::builder(seeds.iter().map(String::as_str))
            .connection_timeout(COMMAND_TIMEOUT)
            .response_timeout(COMMAND_TIMEOUT)
            // Enough for MOVED/ASK after a failover or resharding; a dead master is the
            // breaker's business, not a reason to hold a buyer's request for seconds.
            .retries(3)
            .build()?;
        Ok(RedisClient::Cluster {
            client: Box::new(client),
            seeds,
        })
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self, RedisClient::Cluster { .. })
    }

    /// A shared, self-reconnecting connection whose calls give up after 2 s.
    pub async fn connect(&self) -> Result<RedisConn, RedisError> {
        match self {
            RedisClient::Single(client) => {
                // One plain connection first: the manager retries a refused connection for
                // about 10 s before it reports anything; a start-up (which retries with its
                // own log line) must hear at once that Redis is not there.
                let probe = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(COMMAND_TIMEOUT))
                    .set_response_timeout(Some(COMMAND_TIMEOUT));
                drop(
                    client
                        .get_multiplexed_async_connection_with_config(&probe)
                        .await?,
                );
                let config = redis::aio::ConnectionManagerConfig::new()
                    .set_response_timeout(Some(COMMAND_TIMEOUT))
                    .set_connection_timeout(Some(COMMAND_TIMEOUT));
                Ok(RedisConn::Single(
                    client.get_connection_manager_with_config(config).await?,
                ))
            }
            RedisClient::Cluster { client, .. } => {
                Ok(RedisConn::Cluster(cluster::Cluster::open(client).await?))
            }
        }
    }

    /// A standalone server's connection for blocking commands, whose answers may take
    /// `response_timeout` (it must outlast their BLOCK); `None` in a cluster, where reads
    /// do not block (see the order log).
    pub async fn blocking(
        &self,
        response_timeout: Duration,
    ) -> Result<Option<MultiplexedConnection>, RedisError> {
        match self {
            RedisClient::Single(client) => {
                let config = redis::AsyncConnectionConfig::new()
                    .set_response_timeout(Some(response_timeout));
                Ok(Some(
                    client
                        .get_multiplexed_async_connection_with_config(&config)
                        .await?,
                ))
            }
            RedisClient::Cluster { .. } => Ok(None),
        }
    }

    /// Clients of single servers to subscribe on, best first. A cluster broadcasts plain
    /// PUBLISH to every node, so any live node will do: the nodes the cluster knows now
    /// (asked through `conn`), then the seeds.
    pub async fn subscription_nodes(&self, conn: &mut RedisConn) -> Vec<redis::Client> {
        match self {
            RedisClient::Single(client) => vec![client.clone()],
            RedisClient::Cluster { seeds, .. } => {
                let mut urls = match redis::cmd("CLUSTER")
                    .arg("NODES")
                    .query_async::<String>(conn)
                    .await
                {
                    Ok(nodes) => live_nodes(&nodes, seeds.first().map(String::as_str)),
                    Err(_) => Vec::new(),
                };
                for seed in seeds {
                    if !urls.contains(seed) {
                        urls.push(seed.clone());
                    }
                }
                urls.iter()
                    .filter_map(|u| redis::Client::open(u.as_str()).ok())
                    .collect()
            }
        }
    }
}

/// Masters serving slots: those of the cluster (from `CLUSTER NODES`), or 1.
pub async fn master_count(conn: &mut RedisConn) -> usize {
    if !conn.is_cluster() {
        return 1;
    }
    match redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async::<String>(conn)
        .await
    {
        Ok(nodes) => serving_masters(&nodes).max(1),
        Err(_) => 1,
    }
}

/// Masters of a `CLUSTER NODES` reply that are not failing and own slots.
fn serving_masters(nodes: &str) -> usize {
    nodes
        .lines()
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.len() > 8 && fields[2].contains("master") && !fields[2].contains("fail")
        })
        .count()
}

/// The `redis://` URLs of the nodes of a `CLUSTER NODES` reply not marked failing,
/// with the credentials of `like` (a seed URL).
fn live_nodes(nodes: &str, like: Option<&str>) -> Vec<String> {
    let auth = like
        .and_then(|u| u.strip_prefix("redis://"))
        .and_then(|u| u.rsplit_once('@'))
        .map(|(a, _)| format!("{a}@"))
        .unwrap_or_default();
    nodes
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let addr = fields.nth(1)?;
            let flags = fields.next()?;
            if flags.contains("fail") || flags.contains("noaddr") || flags.contains("handshake") {
                return None;
            }
            let host_port = addr.split('@').next()?;
            Some(format!("redis://{auth}{host_port}/"))
        })
        .collect()
}

/// A connection to a standalone Redis or to a cluster; cheap to clone (clones share it).
/// A cluster's also holds which master serves which slot, for [`RedisConn::query_keyed`].
#[derive(Clone)]
pub enum RedisConn {
    Single(ConnectionManager),
    Cluster(std::sync::Arc<cluster::Cluster>),
}

impl RedisConn {
    pub fn is_cluster(&self) -> bool {
        matches!(self, RedisConn::Cluster(..))
    }

    /// Runs a keyless command on the master that serves `key`: WAIT and WAITAOF must reach
    /// the server that took the writes they wait for (a cluster client would otherwise send
    /// them to every master).
    pub async fn query_at_master_of<T: FromRedisValue>(
        &mut self,
        key: &str,
        cmd: Cmd,
    ) -> RedisResult<T> {
        match self {
            RedisConn::Single(conn) => cmd.query_async(conn).await,
            RedisConn::Cluster(cluster) => {
                let route = Route::with_slot(Slot::for_key(key), SlotAddr::Master);
                let reply = cluster
                    .conn()
                    .route_command(
                        cmd,
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
                    )
                    .await;
                cluster.observe(&reply);
                redis::from_redis_value(reply?).map_err(RedisError::from)
            }
        }
    }

    /// Runs a keyless `cmd` on every master (the one server, standalone): their answers,
    /// in the order of their addresses. Fails when one master fails, or answers an error:
    /// what it asks must be known of every master.
    pub async fn on_every_master(&mut self, cmd: Cmd) -> RedisResult<Vec<Value>> {
        match self {
            RedisConn::Single(conn) => Ok(vec![cmd.query_async(conn).await?]),
            RedisConn::Cluster(cluster) => {
                let everywhere = RoutingInfo::MultiNode((
                    redis::cluster_routing::MultipleNodeRoutingInfo::AllMasters,
                    None,
                ));
                // Without a way to combine them, the client answers each master's answer
                // by its address.
                let reply = cluster.conn().route_command(cmd, everywhere).await;
                cluster.observe(&reply);
                let mut answers = match reply? {
                    Value::Map(by_address) => by_address,
                    other => vec![(Value::Nil, other)],
                };
                answers.sort_by(|a, b| format!("{:?}", a.0).cmp(&format!("{:?}", b.0)));
                answers
                    .into_iter()
                    .map(|(_, answer)| match answer {
                        Value::ServerError(e) => Err(RedisError::from(e)),
                        answer => Ok(answer),
                    })
                    .collect()
            }
        }
    }

    /// Runs `pipe`'s commands where their keys live, in one round trip per server (see
    /// [`keyed`]): an answer per command, in order. Fails as a whole only when a standalone
    /// server cannot be reached; in a cluster a master that cannot be reached fails its own
    /// commands.
    pub async fn query_keyed(
        &mut self,
        pipe: keyed::KeyedPipe,
    ) -> RedisResult<Vec<RedisResult<Value>>> {
        let answered = self.query_keyed_with_first(pipe).await?;
        Ok(answered.answers.into_iter().map(|(_, a)| a).collect())
    }

    /// [`RedisConn::query_keyed`] of a pipe with a first command for each server
    /// ([`keyed::KeyedPipe::first_on_each_server`]), whose answer comes from the same
    /// connection as the commands that follow it: what a command's answer says can be
    /// compared with what its own server said of itself.
    pub async fn query_keyed_with_first(
        &mut self,
        pipe: keyed::KeyedPipe,
    ) -> RedisResult<keyed::KeyedAnswers> {
        if pipe.is_empty() {
            return Ok(keyed::KeyedAnswers {
                firsts: Vec::new(),
                answers: Vec::new(),
            });
        }
        match self {
            RedisConn::Single(conn) => pipe.query_single(conn).await,
            RedisConn::Cluster(cluster) => Ok(pipe.query_cluster(cluster).await),
        }
    }

    /// The cluster's own view of its health (`CLUSTER INFO`'s `cluster_state`), or a PING
    /// of the standalone server. An error names what is wrong.
    pub async fn check_health(&mut self) -> Result<(), String> {
        match self {
            RedisConn::Single(conn) => redis::cmd("PING")
                .query_async::<String>(conn)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            RedisConn::Cluster(_) => {
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query_async(self)
                    .await
                    .map_err(|e| e.to_string())?;
                match cluster_state(&info) {
                    Some("ok") => Ok(()),
                    Some(state) => Err(format!("the cluster's state is {state}")),
                    None => Err("CLUSTER INFO has no cluster_state".into()),
                }
            }
        }
    }
}

fn cluster_state(info: &str) -> Option<&str> {
    info.lines()
        .find_map(|l| l.trim().strip_prefix("cluster_state:"))
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConn::Single(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(cluster) => {
                let cluster = cluster.clone();
                Box::pin(async move {
                    let reply = cluster.conn().req_packed_command(cmd).await;
                    cluster.observe(&reply);
                    reply
                })
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConn::Single(c) => c.req_packed_commands(cmd, offset, count),
            RedisConn::Cluster(cluster) => {
                let cluster = cluster.clone();
                Box::pin(async move {
                    let reply = cluster.conn().req_packed_commands(cmd, offset, count).await;
                    cluster.observe(&reply);
                    reply
                })
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Single(c) => c.get_db(),
            RedisConn::Cluster(cluster) => cluster.conn().get_db(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failing_nodes_are_not_subscribed_to() {
        let nodes = "\
07c3 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460
67ed 127.0.0.1:7001@17001 master,fail - 0 0 2 connected
292f 127.0.0.1:7004@17004 slave 07c3 0 0 1 connected
";
        assert_eq!(
            live_nodes(nodes, Some("redis://:pw@127.0.0.1:7000/")),
            vec!["redis://:pw@127.0.0.1:7000/", "redis://:pw@127.0.0.1:7004/"]
        );
    }

    #[test]
    fn cluster_state_is_read_from_cluster_info() {
        assert_eq!(
            cluster_state("cluster_enabled:1\r\ncluster_state:fail\r\n"),
            Some("fail")
        );
        assert_eq!(cluster_state("nothing"), None);
    }
}
