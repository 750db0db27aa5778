//! A PostgreSQL server of the test's own (Debian's binaries, `initdb` into a folder of its
//! own, its own port), to be stopped and started again: the shared server on 5432 is never
//! touched. Runs as the `postgres` user when the tests run as root (see `patroni`).

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

use super::patroni::{as_postgres, bin_dir, give_to_postgres};

pub struct PrivatePostgres {
    pub port: u16,
    dir: PathBuf,
    server: Option<Child>,
}

impl PrivatePostgres {
    /// A new server on a free port, answering.
    pub async fn start() -> PrivatePostgres {
        let dir = std::env::temp_dir().join(super::unique("pg"));
        std::fs::create_dir_all(&dir).unwrap();
        give_to_postgres(&dir);
        super::run_to_success(
            as_postgres(
                Command::new(bin_dir().join("initdb"))
                    .args(["-A", "trust", "-U", "postgres", "-D"])
                    .arg(dir.join("data")),
            ),
            "initdb (Debian's postgresql package)",
        );
        let mut pg = PrivatePostgres {
            port: super::free_port(),
            dir,
            server: None,
        };
        pg.start_again().await;
        pg
    }

    /// The URL of database `name` on it.
    pub fn url(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    /// A new database on it; its URL.
    pub async fn create_database(&self) -> String {
        seckill::store::Store::create_database(&self.url("postgres"), &super::unique("db"))
            .await
            .unwrap()
    }

    /// Stops it as an operator would (`pg_ctl stop -m fast`: SIGINT): clients are cut off
    /// and new ones refused.
    pub fn stop(&mut self) {
        if let Some(mut server) = self.server.take() {
            // SAFETY: a signal to the server this test started.
            unsafe {
                libc::kill(server.id() as i32, libc::SIGINT);
            }
            let _ = server.wait();
        }
    }

    /// Starts it again on its port and folder, and waits until it answers.
    pub async fn start_again(&mut self) {
        let log = std::fs::File::create(self.dir.join("server.log")).unwrap();
        let server = super::spawn_logged(
            as_postgres(
                Command::new(bin_dir().join("postgres"))
                    .arg("-D")
                    .arg(self.dir.join("data"))
                    .args(["-p", &self.port.to_string()])
                    .args(["-c", "listen_addresses=127.0.0.1", "-k"])
                    .arg(&self.dir),
            ),
            log,
            "postgres (Debian's postgresql package)",
        );
        self.server = Some(server);
        let url = self.url("postgres");
        super::eventually(30, "the private PostgreSQL answers", || {
            let url = url.clone();
            async move {
                use sqlx::Connection;
                matches!(
                    tokio::time::timeout(Duration::from_secs(2), sqlx::PgConnection::connect(&url))
                        .await,
                    Ok(Ok(_))
                )
            }
        })
        .await;
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
