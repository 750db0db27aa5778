//! A Redis Cluster of the test's own: masters with one replica each, from Debian's
//! `redis-server` and `redis-cli --cluster create`, on ports nobody else uses (each node's
//! port and its bus port, port + 10000). Nodes can be SIGKILLed and restarted; a restarted
//! node keeps its identity (nodes.conf) and rejoins, as a replica after a failover.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub struct PrivateCluster {
    ports: Vec<u16>,
    nodes: Vec<Option<Child>>,
    dir: PathBuf,
}

/// `--logfile` into SECKILL_TEST_LOGS, when it is set (each node's log beside the
/// processes' own, to read a failed run's failover from).
fn node_log(port: u16) -> Vec<String> {
    match std::env::var("SECKILL_TEST_LOGS") {
        Ok(dir) => vec![
            "--logfile".into(),
            format!("{dir}/redis-{port}-{}.log", super::unique("node")),
        ],
        Err(_) => Vec::new(),
    }
}

/// How long a master may be unreachable before its replica takes over.
const NODE_TIMEOUT_MS: u64 = 2000;

fn bindable(port: u16) -> bool {
    std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// `n` consecutive ports whose bus ports are free too.
fn free_ports(n: usize) -> Vec<u16> {
    loop {
        let base = 20_000 + rand::random::<u16>() % 9_000;
        let ports: Vec<u16> = (base..base + n as u16).collect();
        if ports.iter().all(|p| bindable(*p) && bindable(p + 10_000)) {
            return ports;
        }
    }
}

async fn conn(port: u16) -> Option<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).ok()?;
    tokio::time::timeout(
        Duration::from_secs(2),
        client.get_multiplexed_async_connection(),
    )
    .await
    .ok()?
    .ok()
}

async fn query<T: redis::FromRedisValue>(port: u16, cmd: &redis::Cmd) -> Option<T> {
    let mut c = conn(port).await?;
    tokio::time::timeout(Duration::from_secs(2), cmd.query_async(&mut c))
        .await
        .ok()?
        .ok()
}

impl PrivateCluster {
    /// `masters` masters and as many replicas, every slot covered, replicas in sync.
    pub async fn start(masters: usize) -> PrivateCluster {
        let ports = free_ports(masters * 2);
        let dir = std::env::temp_dir().join(super::unique("cluster"));
        let mut cluster = PrivateCluster {
            nodes: Vec::new(),
            ports: ports.clone(),
            dir,
        };
        for i in 0..ports.len() {
            let node = cluster.spawn_node(i);
            cluster.nodes.push(Some(node));
        }
        for port in &ports {
            super::eventually(10, "a cluster node answers", || async move {
                query::<String>(*port, &redis::cmd("PING")).await.is_some()
            })
            .await;
        }
        let created = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(ports.iter().map(|p| format!("127.0.0.1:{p}")))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli (Debian's redis-tools, beside redis-server)");
        assert!(created.success(), "redis-cli --cluster create failed");
        cluster.wait_healthy().await;
        cluster
    }

    fn spawn_node(&self, i: usize) -> Child {
        let port = self.ports[i];
        let dir = self.dir.join(port.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ])
            .args(["--cluster-node-timeout", &NODE_TIMEOUT_MS.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .args(node_log(port))
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server (scripts/test installs it)")
    }

    /// `redis+cluster://` with every node as a seed.
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+cluster://{}", seeds.join(","))
    }

    fn live_port(&self) -> u16 {
        self.ports
            .iter()
            .zip(&self.nodes)
            .find(|(_, n)| n.is_some())
            .map(|(p, _)| *p)
            .expect("a live node")
    }

    /// Port -> (is master, slots served), as a live node sees the cluster.
    async fn roles(&self) -> Option<HashMap<u16, (bool, Vec<(u16, u16)>)>> {
        let text: String = query(self.live_port(), redis::cmd("CLUSTER").arg("NODES")).await?;
        let mut roles = HashMap::new();
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 {
                continue;
            }
            let port: u16 = f[1].split('@').next()?.rsplit(':').next()?.parse().ok()?;
            let master = f[2].contains("master") && !f[2].contains("fail");
            let slots = f[8..]
                .iter()
                .filter_map(|r| {
                    let (a, b) = r.split_once('-').unwrap_or((r, r));
                    Some((a.parse().ok()?, b.parse().ok()?))
                })
                .collect();
            roles.insert(port, (master, slots));
        }
        Some(roles)
    }

    /// Waits until every live node says the cluster is ok and every master has a replica
    /// that acknowledges its writes.
    pub async fn wait_healthy(&self) {
        super::eventually(
            60,
            "the cluster is ok and every master has a replica",
            || async {
                for (port, node) in self.ports.iter().zip(&self.nodes) {
                    if node.is_none() {
                        continue;
                    }
                    let info: Option<String> =
                        query(*port, redis::cmd("CLUSTER").arg("INFO")).await;
                    if !info.is_some_and(|i| i.contains("cluster_state:ok")) {
                        return false;
                    }
                }
                let Some(roles) = self.roles().await else {
                    return false;
                };
                for (port, (master, slots)) in roles {
                    if master && !slots.is_empty() {
                        let acked: Option<i64> =
                            query(port, redis::cmd("WAIT").arg(1).arg(200)).await;
                        if acked.unwrap_or(0) < 1 {
                            return false;
                        }
                    }
                }
                true
            },
        )
        .await;
    }

    /// The node (index) that is master of `key`'s slot now.
    pub async fn master_of(&self, key: &str) -> usize {
        for _ in 0..20 {
            if let Some(node) = self.try_master_of(key).await {
                return node;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        panic!("no master named for {key} (CLUSTER KEYSLOT / CLUSTER NODES)");
    }

    /// [`PrivateCluster::master_of`], or `None` when a node did not answer in time (a busy
    /// box) or no master serves the slot yet (a failover under way).
    async fn try_master_of(&self, key: &str) -> Option<usize> {
        let slot: i64 = query(
            self.live_port(),
            redis::cmd("CLUSTER").arg("KEYSLOT").arg(key),
        )
        .await?;
        let roles = self.roles().await?;
        let port = roles
            .iter()
            .find(|(_, (master, slots))| {
                *master
                    && slots
                        .iter()
                        .any(|(a, b)| (*a as i64) <= slot && slot <= (*b as i64))
            })
            .map(|(p, _)| *p)?;
        self.ports.iter().position(|p| *p == port)
    }

    /// How many nodes the cluster has, masters and replicas.
    pub fn node_count(&self) -> usize {
        self.ports.len()
    }

    /// The port of node `i`.
    pub fn port(&self, i: usize) -> u16 {
        self.ports[i]
    }

    pub fn pid(&self, i: usize) -> u32 {
        self.nodes[i].as_ref().expect("a live node").id()
    }

    /// SIGKILL of node `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut n) = self.nodes[i].take() {
            let _ = n.kill();
            let _ = n.wait();
        }
    }

    /// Starts node `i` again with its data folder: it rejoins the cluster.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        let node = self.spawn_node(i);
        self.nodes[i] = Some(node);
    }

    /// The sale's key that decides which master holds it.
    pub fn sale_key(prefix: &str, sale_id: i64) -> String {
        format!("{prefix}:{{{sale_id}}}:sale")
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
