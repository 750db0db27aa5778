//! A MariaDB primary and replica of the test's own (Debian's `mariadbd`, each with its own
//! folder, port and server id; binary log with GTIDs, the replica read-only), and one
//! movable address in front of them, as a proxy or a virtual IP gives clients: the test
//! promotes the replica and moves the address, cutting the connections to the old primary.
//! The shared server on 3306 is never touched.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

pub struct MariaDbServer {
    pub port: u16,
    server_id: u32,
    dir: PathBuf,
    child: Option<Child>,
}

impl MariaDbServer {
    async fn start(server_id: u32, dir: PathBuf) -> MariaDbServer {
        std::fs::create_dir_all(&dir).unwrap();
        super::run_to_success(
            Command::new("mariadb-install-db")
                .arg("--no-defaults")
                .arg(format!("--datadir={}", dir.join("data").display()))
                .args([
                    "--user=root",
                    "--auth-root-authentication-method=normal",
                    "--skip-test-db",
                ]),
            "mariadb-install-db (Debian's mariadb-server)",
        );
        let mut server = MariaDbServer {
            port: super::free_port(),
            server_id,
            dir,
            child: None,
        };
        server.start_again().await;
        server
    }

    async fn start_again(&mut self) {
        let log = std::fs::File::create(self.dir.join("server.log")).unwrap();
        let mut command = Command::new("/usr/sbin/mariadbd");
        command
            .arg("--no-defaults")
            .arg(format!("--datadir={}", self.dir.join("data").display()))
            .arg(format!(
                "--socket={}",
                self.dir.join("server.sock").display()
            ))
            .arg(format!("--port={}", self.port))
            .arg(format!("--server-id={}", self.server_id))
            .args([
                "--user=root",
                "--bind-address=127.0.0.1",
                "--skip-name-resolve",
                "--log-bin=binlog",
                "--binlog-format=ROW",
                "--innodb-flush-log-at-trx-commit=1",
                "--sync-binlog=1",
                "--max-connections=500",
            ]);
        self.child = Some(super::spawn_logged(
            &mut command,
            log,
            "mariadbd (Debian's mariadb-server)",
        ));
        let url = self.url("mysql");
        super::eventually(30, "the private MariaDB answers", || {
            let url = url.clone();
            async move { query(&url, "SELECT 1").await.is_ok() }
        })
        .await;
    }

    pub fn url(&self, db: &str) -> String {
        format!("mysql://root@127.0.0.1:{}/{db}", self.port)
    }

    /// SIGKILL: the machine dies.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for MariaDbServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn query(url: &str, sql: &str) -> Result<(), sqlx::Error> {
    use sqlx::Connection;
    let mut conn =
        tokio::time::timeout(Duration::from_secs(3), sqlx::MySqlConnection::connect(url))
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)??;
    sqlx::raw_sql(sql).execute(&mut conn).await?;
    let _ = conn.close().await;
    Ok(())
}

/// A primary and a replica replicating from it, behind a movable address.
pub struct MariaDbPair {
    pub primary: MariaDbServer,
    pub replica: MariaDbServer,
    pub address: MovableAddress,
}

impl MariaDbPair {
    /// `semi_sync`: MariaDB's semi-synchronous replication (a commit waits until the
    /// replica has the event, or falls back to asynchronous after a second).
    pub async fn start(semi_sync: bool) -> MariaDbPair {
        let dir = std::env::temp_dir().join(super::unique("mariadb"));
        let primary = MariaDbServer::start(1, dir.join("primary")).await;
        let replica = MariaDbServer::start(2, dir.join("replica")).await;
        if semi_sync {
            query(
                &primary.url("mysql"),
                "SET GLOBAL rpl_semi_sync_master_enabled = 1; \
                 SET GLOBAL rpl_semi_sync_master_timeout = 1000",
            )
            .await
            .unwrap();
            query(
                &replica.url("mysql"),
                "SET GLOBAL rpl_semi_sync_slave_enabled = 1",
            )
            .await
            .unwrap();
        }
        query(
            &replica.url("mysql"),
            &format!(
                "CHANGE MASTER TO MASTER_HOST = '127.0.0.1', MASTER_PORT = {}, \
                 MASTER_USER = 'root', MASTER_PASSWORD = '', MASTER_USE_GTID = slave_pos; \
                 START SLAVE; SET GLOBAL read_only = 1",
                primary.port
            ),
        )
        .await
        .unwrap();
        let address = MovableAddress::start(primary.port).await;
        MariaDbPair {
            primary,
            replica,
            address,
        }
    }

    /// A new database, made on the primary (and replicated); its URL through the address.
    pub async fn create_database(&self) -> String {
        let name = super::unique("db");
        query(
            &self.primary.url("mysql"),
            &format!("CREATE DATABASE {name}"),
        )
        .await
        .unwrap();
        let replica = self.replica.url("mysql");
        let check = format!("USE {name}");
        super::eventually(20, "the database reaches the replica", || {
            let (replica, check) = (replica.clone(), check.clone());
            async move { query(&replica, &check).await.is_ok() }
        })
        .await;
        format!("mysql://root@127.0.0.1:{}/{name}", self.address.port)
    }

    /// The replica stops receiving the primary's binary log: what the primary commits from
    /// now on is on its disk only.
    pub async fn stall_replication(&self) {
        query(&self.replica.url("mysql"), "STOP SLAVE IO_THREAD")
            .await
            .unwrap();
    }

    /// The primary's machine dies; the replica is promoted (it applies what it received,
    /// stops replicating, takes writes) and the address moved to it.
    pub async fn fail_over(&mut self) {
        self.primary.kill();
        query(
            &self.replica.url("mysql"),
            "STOP SLAVE; RESET SLAVE ALL; SET GLOBAL read_only = 0",
        )
        .await
        .unwrap();
        self.address.move_to(self.replica.port);
    }
}

/// One address clients connect to, forwarded to a server the test names, and moved from
/// one to another: connections to the old one are cut, as a proxy marking a server down.
pub struct MovableAddress {
    pub port: u16,
    target: Arc<AtomicU16>,
    /// Bumped at each move: a connection forwarded under an older one closes.
    generation: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl MovableAddress {
    pub async fn start(target: u16) -> MovableAddress {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = Arc::new(AtomicU16::new(target));
        let generation = Arc::new(AtomicU64::new(0));
        let (t, g) = (target.clone(), generation.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let (t, g) = (t.clone(), g.clone());
                tokio::spawn(forward(client, t, g));
            }
        });
        MovableAddress {
            port,
            target,
            generation,
            task,
        }
    }

    pub fn move_to(&self, port: u16) {
        self.target.store(port, Ordering::SeqCst);
        self.generation.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for MovableAddress {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn forward(mut client: TcpStream, target: Arc<AtomicU16>, generation: Arc<AtomicU64>) {
    let born = generation.load(Ordering::SeqCst);
    let Ok(mut server) = TcpStream::connect(("127.0.0.1", target.load(Ordering::SeqCst))).await
    else {
        let _ = client.shutdown().await;
        return;
    };
    let copying = tokio::io::copy_bidirectional(&mut client, &mut server);
    tokio::pin!(copying);
    loop {
        tokio::select! {
            _ = &mut copying => return,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {
                if generation.load(Ordering::SeqCst) != born {
                    return;
                }
            }
        }
    }
}
