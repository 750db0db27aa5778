//! A PostgreSQL cluster of the test's own, as most high-availability installations run it:
//! three servers managed by Patroni (Debian's `patroni`), one etcd (`etcd-server`), and
//! HAProxy giving one read-write address (it routes to the node whose Patroni answers 200 on
//! `/primary`, and cuts the sessions of a node marked down). Every process is started here,
//! on ports nobody else uses, in a folder of its own, and stopped by its PID; a node's
//! "machine" is killed by SIGKILL of its Patroni and of its PostgreSQL processes.
//!
//! Patroni, etcd and PostgreSQL run as the `postgres` user when the tests run as root
//! (`initdb` refuses root). Timings are short (a leader key of 10 s) so that a failover
//! takes about 10 s, not the 30 s of the defaults.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How the primary replicates to the standbys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// PostgreSQL's default: a commit returns once it is on the primary's disk.
    Asynchronous,
    /// Patroni's `synchronous_mode`: a commit returns once a standby has it too, and only
    /// that standby may be promoted.
    Synchronous,
}

struct Node {
    name: String,
    pg_port: u16,
    api_port: u16,
    data: PathBuf,
    config: PathBuf,
    patroni: Option<Child>,
}

pub struct PatroniCluster {
    dir: PathBuf,
    etcd: Child,
    haproxy: Child,
    nodes: Vec<Node>,
    /// HAProxy's read-write address.
    pub port: u16,
    pub replication: Replication,
    http: reqwest::Client,
}

/// The newest PostgreSQL server binaries Debian installed.
pub fn bin_dir() -> PathBuf {
    let mut versions: Vec<u32> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL from Debian's packages (/usr/lib/postgresql)")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    versions.sort_unstable();
    let version = versions.last().expect("a PostgreSQL version");
    PathBuf::from(format!("/usr/lib/postgresql/{version}/bin"))
}

/// The `postgres` user's (uid, gid) when the tests run as root, else `None` (run as is).
fn postgres_user() -> Option<(u32, u32)> {
    // SAFETY: getuid and getpwnam read process and system state; the name is a C string.
    unsafe {
        if libc::getuid() != 0 {
            return None;
        }
        let user = libc::getpwnam(c"postgres".as_ptr());
        assert!(
            !user.is_null(),
            "a postgres user (Debian's postgresql package makes it)"
        );
        Some(((*user).pw_uid, (*user).pw_gid))
    }
}

pub fn as_postgres(command: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    if let Some((uid, gid)) = postgres_user() {
        command.uid(uid).gid(gid);
    }
    command
}

pub fn give_to_postgres(path: &Path) {
    if let Some((uid, gid)) = postgres_user() {
        std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap();
    }
}

/// Where a process's output goes: SECKILL_TEST_LOGS when set, else the cluster's folder.
fn log_file(dir: &Path, name: &str) -> std::fs::File {
    let path = match std::env::var("SECKILL_TEST_LOGS") {
        Ok(logs) => PathBuf::from(logs).join(format!("{}-{name}.log", super::unique("patroni"))),
        Err(_) => dir.join(format!("{name}.log")),
    };
    std::fs::File::create(path).unwrap()
}

fn kill(pid: u32, signal: i32) {
    // SAFETY: a signal to a process this test started (or its PostgreSQL's children).
    unsafe {
        libc::kill(pid as i32, signal);
    }
}

/// The processes whose parent is `parent`, with their command lines.
fn children_of(parent: u32) -> Vec<(u32, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| {
            let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // The command is in parentheses and may hold spaces: the fields after it.
            let after = &stat[stat.rfind(')')? + 2..];
            let ppid: u32 = after.split(' ').nth(1)?.parse().ok()?;
            let cmdline = std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                .unwrap_or_default()
                .replace('\0', " ");
            (ppid == parent).then_some((pid, cmdline))
        })
        .collect()
}

impl Node {
    /// Its PostgreSQL's postmaster, from the pid file (when it runs).
    fn postmaster(&self) -> Option<u32> {
        let text = std::fs::read_to_string(self.data.join("postmaster.pid")).ok()?;
        let pid: u32 = text.lines().next()?.trim().parse().ok()?;
        Path::new(&format!("/proc/{pid}")).exists().then_some(pid)
    }

    fn spawn(&mut self, dir: &Path) {
        let log = log_file(dir, &self.name);
        let child = super::spawn_logged(
            as_postgres(Command::new("patroni").arg(&self.config)),
            log,
            "patroni (Debian's patroni package; scripts/test installs it)",
        );
        self.patroni = Some(child);
    }

    /// Its machine dies: Patroni and PostgreSQL, at once.
    fn kill_machine(&mut self) {
        if let Some(mut patroni) = self.patroni.take() {
            let _ = patroni.kill();
            let _ = patroni.wait();
        }
        if let Some(postmaster) = self.postmaster() {
            // Its children first: once it is dead they are the init process's, and a backend
            // left running holds the shared memory a restart needs.
            let children = children_of(postmaster);
            kill(postmaster, libc::SIGKILL);
            for (pid, _) in children {
                kill(pid, libc::SIGKILL);
            }
        }
    }
}

impl PatroniCluster {
    /// Three nodes, one leader and two streaming replicas (one of them the synchronous
    /// standby with `Synchronous`), and HAProxy routing to the leader.
    pub async fn start(replication: Replication) -> PatroniCluster {
        let dir = std::env::temp_dir().join(super::unique("patroni"));
        std::fs::create_dir_all(&dir).unwrap();
        give_to_postgres(&dir);
        let port = |_| super::free_port();
        let (etcd_port, peer_port) = (port(0), port(1));
        let etcd = as_postgres(
            Command::new("etcd")
                .args(["--name", "e1", "--data-dir"])
                .arg(dir.join("etcd"))
                .arg("--listen-client-urls")
                .arg(format!("http://127.0.0.1:{etcd_port}"))
                .arg("--advertise-client-urls")
                .arg(format!("http://127.0.0.1:{etcd_port}"))
                .arg("--listen-peer-urls")
                .arg(format!("http://127.0.0.1:{peer_port}"))
                .arg("--initial-advertise-peer-urls")
                .arg(format!("http://127.0.0.1:{peer_port}"))
                .arg("--initial-cluster")
                .arg(format!("e1=http://127.0.0.1:{peer_port}"))
                .stdout(log_file(&dir, "etcd"))
                .stderr(log_file(&dir, "etcd-err")),
        )
        .spawn()
        .expect("etcd (Debian's etcd-server package; scripts/test installs it)");
        let bin = bin_dir();
        let mut nodes: Vec<Node> = (1..=3)
            .map(|i| {
                let name = format!("n{i}");
                let (pg_port, api_port) = (port(0), port(0));
                let data = dir.join(format!("data{i}"));
                let config = dir.join(format!("{name}.yml"));
                let yaml = node_config(&NodeConfig {
                    name: &name,
                    dir: &dir,
                    bin: &bin,
                    etcd_port,
                    pg_port,
                    api_port,
                    data: &data,
                    synchronous: replication == Replication::Synchronous,
                });
                std::fs::write(&config, yaml).unwrap();
                Node {
                    name,
                    pg_port,
                    api_port,
                    data,
                    config,
                    patroni: None,
                }
            })
            .collect();
        let front = port(0);
        let haproxy_config = dir.join("haproxy.cfg");
        std::fs::write(&haproxy_config, haproxy_config_text(front, &nodes)).unwrap();
        let haproxy = Command::new("haproxy")
            .arg("-db")
            .arg("-f")
            .arg(&haproxy_config)
            .stdout(log_file(&dir, "haproxy"))
            .stderr(log_file(&dir, "haproxy-err"))
            .spawn()
            .expect("haproxy (Debian's haproxy package; scripts/test installs it)");
        // The first node bootstraps the cluster; the others clone it once it leads.
        nodes[0].spawn(&dir);
        let mut cluster = PatroniCluster {
            dir,
            etcd,
            haproxy,
            nodes,
            port: front,
            replication,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(2))
                .build()
                .unwrap(),
        };
        super::eventually(60, "the first Patroni node leads", || async {
            cluster.role(0).await.as_deref() == Some("primary")
        })
        .await;
        for i in 1..3 {
            let dir = cluster.dir.clone();
            cluster.nodes[i].spawn(&dir);
        }
        cluster.wait_healthy().await;
        cluster
    }

    /// A URL of database `name` through HAProxy's read-write address.
    pub fn url(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    /// A new database on the cluster; its URL through HAProxy.
    pub async fn create_database(&self) -> String {
        let name = super::unique("db");
        seckill::store::Store::create_database(&self.url("postgres"), &name)
            .await
            .unwrap()
    }

    /// What node `i`'s Patroni says of its role (`primary`, `replica`, `sync_standby`...),
    /// or `None` when it does not answer.
    async fn role(&self, i: usize) -> Option<String> {
        let url = format!("http://127.0.0.1:{}/patroni", self.nodes[i].api_port);
        let body: Value = self.http.get(url).send().await.ok()?.json().await.ok()?;
        let role = body["role"].as_str()?.to_string();
        Some(if role == "master" {
            "primary".into()
        } else {
            role
        })
    }

    /// The cluster as its leader's Patroni sees it (`GET /cluster`).
    pub async fn members(&self) -> Value {
        for node in &self.nodes {
            let url = format!("http://127.0.0.1:{}/cluster", node.api_port);
            if let Ok(r) = self.http.get(url).send().await {
                if let Ok(v) = r.json::<Value>().await {
                    return v;
                }
            }
        }
        Value::Null
    }

    /// Every node running, one leader, the replicas streaming (one in sync with
    /// `Synchronous`), and HAProxy routing writes.
    pub async fn wait_healthy(&self) {
        super::eventually(90, "the Patroni cluster is healthy", || async {
            let members = self.members().await;
            let Some(list) = members["members"].as_array() else {
                return false;
            };
            let running = list
                .iter()
                .filter(|m| m["state"] == "running" || m["state"] == "streaming")
                .count();
            let leaders = list.iter().filter(|m| m["role"] == "leader").count();
            let sync = list.iter().any(|m| m["role"] == "sync_standby");
            let lag_known = list
                .iter()
                .filter(|m| m["role"] != "leader")
                .all(|m| m["lag"].is_number());
            running == self.nodes.len()
                && leaders == 1
                && lag_known
                && (self.replication == Replication::Asynchronous || sync)
                && self.streaming().await == Some(self.nodes.len() as i64 - 1)
        })
        .await;
    }

    /// How many standbys the primary behind HAProxy streams to (`None`: it does not take
    /// writes).
    async fn streaming(&self) -> Option<i64> {
        use sqlx::Connection;
        let mut conn = tokio::time::timeout(
            Duration::from_secs(2),
            sqlx::PgConnection::connect(&self.url("postgres")),
        )
        .await
        .ok()?
        .ok()?;
        let streaming: Option<i64> = sqlx::query_scalar(
            "SELECT CASE WHEN pg_is_in_recovery() THEN NULL ELSE \
             (SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming') END",
        )
        .fetch_one(&mut conn)
        .await
        .ok()?;
        let _ = conn.close().await;
        streaming
    }

    /// Whether HAProxy's address reaches a primary that takes writes.
    pub async fn writable(&self) -> bool {
        use sqlx::Connection;
        let Ok(Ok(mut conn)) = tokio::time::timeout(
            Duration::from_secs(2),
            sqlx::PgConnection::connect(&self.url("postgres")),
        )
        .await
        else {
            return false;
        };
        let in_recovery: Result<bool, _> = sqlx::query_scalar("SELECT pg_is_in_recovery()")
            .fetch_one(&mut conn)
            .await;
        let _ = conn.close().await;
        matches!(in_recovery, Ok(false))
    }

    /// The node that leads now.
    pub async fn leader(&self) -> usize {
        for i in 0..self.nodes.len() {
            if self.nodes[i].patroni.is_some() && self.role(i).await.as_deref() == Some("primary") {
                return i;
            }
        }
        panic!("no Patroni node leads: {}", self.members().await);
    }

    /// The leader stops sending WAL to its standbys (its walsenders SIGSTOPped): what it
    /// commits from now on is on its disk only, as when the replication link stalls.
    /// Returns how many streams it stalled.
    pub fn stall_replication(&self, leader: usize) -> usize {
        let Some(postmaster) = self.nodes[leader].postmaster() else {
            return 0;
        };
        let senders: Vec<u32> = children_of(postmaster)
            .into_iter()
            .filter(|(_, cmd)| cmd.contains("walsender"))
            .map(|(pid, _)| pid)
            .collect();
        for pid in &senders {
            kill(*pid, libc::SIGSTOP);
        }
        senders.len()
    }

    /// Node `i`'s machine dies (Patroni and PostgreSQL SIGKILLed, as a power cut): its
    /// leader key lapses after the TTL and a replica is promoted.
    pub fn kill_machine(&mut self, i: usize) {
        self.nodes[i].kill_machine();
    }

    /// Node `i` started again (after `kill_machine`): Patroni brings it back as a replica
    /// of the new leader (rewinding or cloning it as needed).
    pub fn restart(&mut self, i: usize) {
        let dir = self.dir.clone();
        self.nodes[i].spawn(&dir);
    }

    /// Waits until a node other than `old` leads and HAProxy routes writes to it; when.
    pub async fn wait_new_leader(&self, old: usize) -> (usize, Instant) {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            for i in 0..self.nodes.len() {
                if i == old || self.nodes[i].patroni.is_none() {
                    continue;
                }
                if self.role(i).await.as_deref() == Some("primary") && self.writable().await {
                    return (i, Instant::now());
                }
            }
            assert!(
                Instant::now() < deadline,
                "no new leader within 90 s: {}",
                self.members().await
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `patronictl switchover` from `leader` to `candidate`, now: the leader hands over
    /// once the candidate caught up (nothing is lost; the old leader becomes a replica).
    /// Returns when the candidate takes writes through HAProxy.
    pub async fn switchover(&self, leader: usize, candidate: usize) -> Instant {
        super::run_to_success(
            as_postgres(
                Command::new("patronictl")
                    .arg("-c")
                    .arg(&self.nodes[leader].config)
                    .args(["switchover", "--force", "--leader"])
                    .arg(&self.nodes[leader].name)
                    .arg("--candidate")
                    .arg(&self.nodes[candidate].name),
            ),
            "patronictl switchover",
        );
        let (new_leader, at) = self.wait_new_leader(leader).await;
        assert_eq!(new_leader, candidate, "the candidate leads");
        at
    }

    /// The port of node `i`'s PostgreSQL (to read it directly, past HAProxy).
    pub fn node_port(&self, i: usize) -> u16 {
        self.nodes[i].pg_port
    }
}

impl Drop for PatroniCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill_machine();
        }
        let _ = self.haproxy.kill();
        let _ = self.haproxy.wait();
        let _ = self.etcd.kill();
        let _ = self.etcd.wait();
        if std::env::var_os("SECKILL_TEST_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

struct NodeConfig<'a> {
    name: &'a str,
    dir: &'a Path,
    bin: &'a Path,
    etcd_port: u16,
    pg_port: u16,
    api_port: u16,
    data: &'a Path,
    synchronous: bool,
}

/// A node's Patroni configuration. `maximum_lag_on_failover` is left high: the tests stall
/// replication on purpose and want the lagging replica promoted, as an installation that
/// values availability (most of them) would.
fn node_config(c: &NodeConfig) -> String {
    format!(
        "scope: seckill-test
name: {name}
restapi:
  listen: 127.0.0.1:{api}
  connect_address: 127.0.0.1:{api}
etcd3:
  hosts: 127.0.0.1:{etcd}
bootstrap:
  dcs:
    ttl: 10
    loop_wait: 2
    retry_timeout: 4
    maximum_lag_on_failover: 1073741824
    synchronous_mode: {sync}
    postgresql:
      use_pg_rewind: true
      parameters:
        wal_level: replica
        hot_standby: 'on'
        wal_log_hints: 'on'
        max_wal_senders: 10
        max_replication_slots: 10
        max_connections: 200
  initdb:
  - encoding: UTF8
  - auth: trust
  pg_hba:
  - local all all trust
  - host all all 127.0.0.1/32 trust
  - host replication all 127.0.0.1/32 trust
postgresql:
  listen: 127.0.0.1:{pg}
  connect_address: 127.0.0.1:{pg}
  data_dir: {data}
  bin_dir: {bin}
  pgpass: {dir}/pgpass-{name}
  authentication:
    replication:
      username: postgres
    superuser:
      username: postgres
    rewind:
      username: postgres
  parameters:
    unix_socket_directories: {dir}
    fsync: 'on'
",
        name = c.name,
        api = c.api_port,
        etcd = c.etcd_port,
        pg = c.pg_port,
        data = c.data.display(),
        bin = c.bin.display(),
        dir = c.dir.display(),
        sync = c.synchronous,
    )
}

/// HAProxy in front: one read-write address, to the node whose Patroni says it is primary.
fn haproxy_config_text(front: u16, nodes: &[Node]) -> String {
    let mut text = format!(
        "global
    maxconn 2000
defaults
    mode tcp
    timeout connect 2s
    timeout client 30m
    timeout server 30m
    timeout check 1s
listen primary
    bind 127.0.0.1:{front}
    option httpchk OPTIONS /primary
    http-check expect status 200
    default-server inter 500ms fall 2 rise 1 on-marked-down shutdown-sessions
"
    );
    for n in nodes {
        text.push_str(&format!(
            "    server {} 127.0.0.1:{} check port {}\n",
            n.name, n.pg_port, n.api_port
        ));
    }
    text
}
