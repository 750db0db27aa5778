//! Opening and closing the database: the URL read into a [`Dialect`], SQLite's file put in
//! WAL mode, the pools and their tuning (waits, SQLite's pragmas, the write connection's
//! page cache), a health probe on a connection of its own, the single server's claim on
//! the database, and the scratch databases a bench run makes and drops.
//!
//! What it must never do: report a failure to open without where and what to check, or
//! let a probe wait on a pool that is busy or on a server gone away.

use std::str::FromStr;
use std::sync::Arc;

use sqlx::any::{AnyConnectOptions, AnyPoolOptions};
use sqlx::Row;

use super::error::connect_error;
use super::{buyers, Dialect, Store, StoreError};

/// The page cache of SQLite's write connection, KiB (SQLite's default: 2,000). The writer's
/// per-user guard seeks the large run of the buyer index (`buyers`) for each buyer of a
/// batch, and each merge rewrites that run; the default cache held too little of it, and
/// each seek read a page from the file. At a million buyers the run is 8,184 pages, 33 MB
/// (`dbstat` after a 1M storm), more than this cache too: what it misses comes from the
/// OS's page cache (at the end of a 1M storm SQLite read 1.6-2.1 KB per order from files,
/// checkpoints included). 40 MB, which holds the run, read 0.8 KB but spent no less CPU
/// per order over six 1M storms, for 17 MB more RSS (91-92 MB after the storm, against a
/// bound of 100 MB): its whole size counts in the process's memory once filled.
const WRITER_CACHE_KIB: u32 = 24 * 1024;

/// Puts a SQLite file in WAL mode (readers run beside the writer), once: the mode is a
/// property of the file. Switching needs an exclusive lock that SQLite does not wait for
/// (its busy timeout does not apply; it answers "database is locked" at once), so when
/// several processes open a new file together all but one fail. Wait here instead, as
/// long as any other SQLite lock waits (30 s); a file already in WAL mode takes no lock.
async fn switch_to_wal(options: &AnyConnectOptions) -> Result<(), StoreError> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut pause = std::time::Duration::from_millis(5);
    loop {
        let tried = async {
            let mut one = AnyPoolOptions::new()
                .max_connections(1)
                .connect_with(options.clone())
                .await?
                .acquire()
                .await?;
            sqlx::query("PRAGMA journal_mode=WAL")
                .execute(&mut *one)
                .await
                .map(|_| ())
        }
        .await;
        match tried {
            Err(sqlx::Error::Database(e))
                if e.code().as_deref() == Some("5") && std::time::Instant::now() < deadline =>
            {
                let jitter = std::time::Duration::from_millis(rand::random::<u64>() % 5);
                tokio::time::sleep(pause + jitter).await;
                pause = (pause * 2).min(std::time::Duration::from_millis(200));
            }
            other => return Ok(other?),
        }
    }
}

/// The dialect of a database URL, and the URL as sqlx is to open it: a SQLite file is
/// created when missing (`mode=rwc`, unless the URL names a mode), `mariadb:` is `mysql:`.
fn dialect_of(url: &str) -> Result<(Dialect, String), StoreError> {
    if url.starts_with("sqlite:") {
        let url = if url.contains("mode=") {
            url.to_string()
        } else if url.contains('?') {
            format!("{url}&mode=rwc")
        } else {
            format!("{url}?mode=rwc")
        };
        Ok((Dialect::Sqlite, url))
    } else if url.starts_with("postgres") {
        Ok((Dialect::Postgres, url.to_string()))
    } else if url.starts_with("mysql:") || url.starts_with("mariadb:") {
        Ok((Dialect::MySql, url.replacen("mariadb:", "mysql:", 1)))
    } else {
        Err(StoreError::BadUrl(crate::text::mask_url(url)))
    }
}

/// One direct connection to a database server, closed at once, before any pool: a closed
/// port, an unknown host or a refused password is told at once and with its cause, not as
/// the pool's "timed out" after its wait. A server merely slow to answer still gets the
/// whole wait (no error here).
async fn connect_once(
    options: &AnyConnectOptions,
    wait: std::time::Duration,
) -> Result<(), sqlx::Error> {
    use sqlx::Connection;
    match tokio::time::timeout(wait, sqlx::AnyConnection::connect_with(options)).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            Ok(())
        }
        Ok(Err(e)) => Err(e),
        Err(_) => Ok(()),
    }
}

/// A pool of `size` connections, each waited for up to `wait`. On SQLite each connection
/// is tuned as it opens: the WAL's checkpoint, the page cache (`cache_kib`, when given)
/// and how long a statement waits for another connection's lock (`sqlite_busy`, or `wait`).
fn pool_options(
    dialect: Dialect,
    size: u32,
    cache_kib: Option<u32>,
    wait: std::time::Duration,
    sqlite_busy: Option<std::time::Duration>,
) -> AnyPoolOptions {
    let pool = AnyPoolOptions::new()
        .max_connections(size)
        .min_connections(1)
        .acquire_timeout(wait);
    if dialect != Dialect::Sqlite {
        return pool;
    }
    let busy_ms = sqlite_busy.unwrap_or(wait).as_millis() as u64;
    // A commit of a writer's batch dirties thousands of index pages (buyers' ids are
    // random), past SQLite's default checkpoint of 1,000 WAL pages: each commit was
    // followed by a checkpoint writing every page a second time. Checkpointing every
    // 16,000 pages (64 MB of WAL) writes a page dirtied by many commits back once.
    pool.after_connect(move |conn, _| {
        Box::pin(async move {
            sqlx::query("PRAGMA wal_autocheckpoint = 16000")
                .execute(&mut *conn)
                .await?;
            if let Some(kib) = cache_kib {
                sqlx::query(&format!("PRAGMA cache_size = -{kib}"))
                    .execute(&mut *conn)
                    .await?;
            }
            sqlx::query(&format!("PRAGMA busy_timeout = {busy_ms}"))
                .execute(conn)
                .await
                .map(|_| ())
        })
    })
}

impl Store {
    pub async fn connect(url: &str, max_connections: u32) -> Result<Store, StoreError> {
        Store::connect_waiting(url, max_connections, None).await
    }

    /// A SQLite store whose statements wait `busy` (not 30 s) for another connection's
    /// write lock before they fail busy: the simulation holds the lock from outside and
    /// wants the failure at once.
    pub async fn connect_sqlite_busy(
        url: &str,
        max_connections: u32,
        busy: std::time::Duration,
    ) -> Result<Store, StoreError> {
        Store::connect_tuned(url, max_connections, None, Some(busy)).await
    }

    /// As `connect`, waiting up to `wait` for a connection instead of the product's bound
    /// (5 s for a server database, 30 s for SQLite). For test suites that run many heavy
    /// tests at once against one shared server: there a slow moment is not an outage.
    pub async fn connect_waiting(
        url: &str,
        max_connections: u32,
        wait: Option<std::time::Duration>,
    ) -> Result<Store, StoreError> {
        Store::connect_tuned(url, max_connections, wait, None).await
    }

    async fn connect_tuned(
        url: &str,
        max_connections: u32,
        wait: Option<std::time::Duration>,
        sqlite_busy: Option<std::time::Duration>,
    ) -> Result<Store, StoreError> {
        sqlx::any::install_default_drivers();
        let shown = crate::text::mask_url(url);
        let (dialect, url) = dialect_of(url)?;
        let failed = |source: sqlx::Error| connect_error(dialect, &shown, source);
        let options = AnyConnectOptions::from_str(&url).map_err(failed)?;
        if dialect == Dialect::Sqlite {
            switch_to_wal(&options).await.map_err(|e| match e {
                StoreError::Db(source) => failed(source),
                other => other,
            })?;
        }
        // A server that does not answer for 5 s is down. A local file is never down, only
        // slow: while the disk is busy (say, writing back a large build) every SQLite
        // commit waits on its fsync, and 5 s of waiting for the lock or for a connection
        // failed test suites that pass in 10 s on a quiet disk. Callers are bounded by
        // their own time limits (a request's is 10 s).
        let wait = wait.unwrap_or(std::time::Duration::from_secs(
            if dialect == Dialect::Sqlite { 30 } else { 5 },
        ));
        if dialect != Dialect::Sqlite {
            connect_once(&options, wait).await.map_err(failed)?;
        }
        let pool = pool_options(dialect, max_connections.max(2), None, wait, sqlite_busy)
            .connect_with(options.clone())
            .await
            .map_err(failed)?;
        let writes = if dialect == Dialect::Sqlite {
            pool_options(dialect, 1, Some(WRITER_CACHE_KIB), wait, sqlite_busy)
                .connect_with(options.clone())
                .await
                .map_err(failed)?
        } else {
            pool.clone()
        };
        Ok(Store {
            pool,
            writes,
            dialect,
            clock: crate::clock::wall(),
            faults: None,
            phone_region: phonenumber::country::Id::CN,
            buyer_merge: buyers::MergeState::default(),
            failover: Arc::default(),
            replay_as: None,
            options: Arc::new(options),
        })
    }

    /// Creates an empty database named `name` on the server of `url` (same credentials and
    /// options) and returns its URL: for runs that must leave nothing in the database they
    /// were given (`seckill bench`). `name` must be a plain identifier.
    pub async fn create_database(url: &str, name: &str) -> Result<String, StoreError> {
        let sibling =
            sibling_url(url, name).ok_or_else(|| StoreError::BadUrl(crate::text::mask_url(url)))?;
        let store = Store::connect(url, 2).await?;
        if store.dialect == Dialect::Sqlite {
            return Err(StoreError::BadUrl(
                "a SQLite file is not a database server".into(),
            ));
        }
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&store.pool)
            .await?;
        store.pool.close().await;
        Ok(sibling)
    }

    /// Drops a database made by [`Store::create_database`], even with clients still on it.
    pub async fn drop_database(url: &str, name: &str) -> Result<(), StoreError> {
        let store = Store::connect(url, 2).await?;
        let drop = match store.dialect {
            Dialect::Postgres => format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            _ => format!("DROP DATABASE IF EXISTS {name}"),
        };
        sqlx::query(&drop).execute(&store.pool).await?;
        store.pool.close().await;
        Ok(())
    }

    /// Closes both pools and waits until every connection is closed (no lock left held).
    pub async fn close(&self) {
        self.pool.close().await;
        self.writes.close().await;
    }

    /// Stops this store at once, as the death of its process would: every call from now on
    /// fails (`PoolClosed`), and transactions still open roll back when dropped.
    pub fn halt(&self) {
        // Marks the pools closed when called; the closing of idle connections is left.
        drop(self.pool.close());
        drop(self.writes.close());
    }

    /// Asks the server to answer on `conn`, a connection of the caller's own (opened here
    /// when `None`, dropped on a failure), within `limit`: what a health probe asks, never
    /// held up by a pool that is busy or waits for a server gone away. SQLite, a file, is
    /// always there.
    pub async fn ping(
        &self,
        conn: &mut Option<sqlx::AnyConnection>,
        limit: std::time::Duration,
    ) -> Result<(), StoreError> {
        use sqlx::Connection;
        if self.dialect == Dialect::Sqlite {
            return Ok(());
        }
        let attempt = async {
            if conn.is_none() {
                *conn = Some(sqlx::AnyConnection::connect_with(&self.options).await?);
            }
            if let Some(c) = conn.as_mut() {
                sqlx::query("SELECT 1").execute(c).await?;
            }
            Ok::<(), sqlx::Error>(())
        };
        let answered = match tokio::time::timeout(limit, attempt).await {
            Ok(done) => done.map_err(StoreError::Db),
            Err(_) => Err(StoreError::Db(sqlx::Error::PoolTimedOut)),
        };
        if answered.is_err() {
            *conn = None;
        }
        answered
    }

    /// Claims this database for the one server that decides its purchases in memory (no
    /// Redis): two such servers would each sell the whole stock. Held as long as the
    /// returned connection lives (a session lock); `None` when another server holds it.
    /// SQLite needs none: its order log folder, beside the file, is locked already.
    pub async fn claim_single_server(
        &self,
    ) -> Result<Option<Option<sqlx::pool::PoolConnection<sqlx::Any>>>, StoreError> {
        let claim = match self.dialect {
            Dialect::Sqlite => return Ok(Some(None)),
            Dialect::Postgres => {
                "SELECT CAST(CAST(pg_try_advisory_lock(7362002) AS INTEGER) AS BIGINT)"
            }
            Dialect::MySql => "SELECT CAST(GET_LOCK('seckill_single_server', 0) AS SIGNED)",
        };
        let mut conn = self.pool.acquire().await?;
        let got: Option<i64> = sqlx::query(claim).fetch_one(&mut *conn).await?.try_get(0)?;
        Ok((got == Some(1)).then_some(Some(conn)))
    }
}

/// The URL of database `name` on the server of `url`, with its credentials and options.
fn sibling_url(url: &str, name: &str) -> Option<String> {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, format!("?{q}")),
        None => (url, String::new()),
    };
    let host_start = base.find("://")? + 3;
    let server = match base[host_start..].find('/') {
        Some(i) => &base[..host_start + i],
        None => base,
    };
    Some(format!("{server}/{name}{query}"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_sibling_database_keeps_server_credentials_and_options() {
        assert_eq!(
            super::sibling_url("postgres://u:p@h:5432/shop?sslmode=disable", "b").as_deref(),
            Some("postgres://u:p@h:5432/b?sslmode=disable")
        );
        assert_eq!(
            super::sibling_url("mysql://root@127.0.0.1", "b").as_deref(),
            Some("mysql://root@127.0.0.1/b")
        );
        assert_eq!(super::sibling_url("nonsense", "b"), None);
    }
}
