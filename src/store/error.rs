//! The store's errors: what a failed call tells its caller ([`StoreError`]), which of them
//! may succeed when the same work is tried again, the count of database errors this
//! process has seen (for `/metrics`), and what to check when the database cannot be opened.
//!
//! What it must never do: talk to the database, or decide what a caller does about an
//! error (trying again is `retry`'s and the caller's call).

use super::Dialect;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database: {0}")]
    Db(sqlx::Error),
    #[error("sale {0} does not exist")]
    UnknownSale(i64),
    #[error("sale {sale_id} has less stock in SQL than its orders need (guard stock >= qty)")]
    StockGuard { sale_id: i64 },
    #[error(
        "user {user_id} already holds {held} unit(s) of sale {sale_id} in SQL; this order would \
         take them over the limit of {limit} (the gate let it through: a gate fault)"
    )]
    UserLimit {
        sale_id: i64,
        user_id: i64,
        held: i64,
        limit: i64,
    },
    #[error("another writer inserted some of these orders concurrently")]
    ConcurrentWrite,
    /// The database answers as another server than the one the failover window is
    /// settled against (a failover): writes wait until the window is written into it.
    #[error(
        "the database changed under this process (now {found}, settled {}): a failover; \
         writes wait until the failover window is written into the new primary",
        expected.as_deref().unwrap_or("not yet")
    )]
    Settling {
        found: String,
        expected: Option<String>,
    },
    /// The change committed, but could not be kept in the failover window: the caller is
    /// told to try again (each change applies once, whatever is tried again).
    #[error("{0}")]
    Window(String),
    /// The server reached is not a primary (a replica behind a stale address).
    #[error("the database server is not a primary: {0}")]
    NotPrimary(String),
    #[error("not found")]
    NotFound,
    #[error("unsupported database URL: {0}")]
    BadUrl(String),
    /// Opening the database failed: names where (the URL, password masked) and what to
    /// check, since the driver's words alone ("pool timed out") say neither.
    #[error("cannot open {url}: {source}{hint}")]
    Connect {
        url: String,
        source: sqlx::Error,
        hint: String,
    },
}

/// Database errors seen by this process, for `/metrics`.
pub static DB_ERRORS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        DB_ERRORS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        StoreError::Db(e)
    }
}

impl StoreError {
    /// Transient errors may succeed if the same work is tried again later; the others are
    /// about the data itself and will fail the same way every time.
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::ConcurrentWrite
            | StoreError::Settling { .. }
            | StoreError::Window(_)
            | StoreError::NotPrimary(_) => true,
            StoreError::Db(e) | StoreError::Connect { source: e, .. } => match e {
                sqlx::Error::Io(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed
                | sqlx::Error::Protocol(_)
                | sqlx::Error::Tls(_) => true,
                sqlx::Error::Database(db) => {
                    let code = db.code().map(|c| c.to_string()).unwrap_or_default();
                    let msg = db.message();
                    // PG serialization failure, deadlock, shutdown; SQLite busy/locked (and
                    // their extended codes); MySQL reports deadlocks as 40001 and the rest
                    // only in words.
                    matches!(
                        code.as_str(),
                        "40001" | "40P01" | "57P01" | "57P03" | "25006" | "5" | "6" | "261" | "517"
                    ) || msg.contains("Deadlock found")
                        || msg.contains("Lock wait timeout")
                        || msg.contains("server has gone away")
                }
                _ => false,
            },
            _ => false,
        }
    }
}

impl StoreError {
    /// Whether the database answered with an error (busy, a deadlock, a constraint): the
    /// statement did not take effect. An I/O error may have come after a commit.
    pub fn refused_by_database(&self) -> bool {
        matches!(self, StoreError::Db(sqlx::Error::Database(_)))
    }
}

/// A failure to open the database, with what to check.
pub(super) fn connect_error(dialect: Dialect, url: &str, source: sqlx::Error) -> StoreError {
    let hint = match (&source, dialect) {
        (_, Dialect::Sqlite) => {
            let path = url
                .trim_start_matches("sqlite://")
                .trim_start_matches("sqlite:")
                .split('?')
                .next()
                .unwrap_or_default();
            let folder = std::path::Path::new(path)
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| ".".into());
            format!(" (does the folder {folder} exist, and may this user write there?)")
        }
        (sqlx::Error::PoolTimedOut | sqlx::Error::Io(_), _) => {
            " (is the database server up, and listening at that host and port?)".into()
        }
        _ => String::new(),
    };
    StoreError::Connect {
        url: url.to_string(),
        source,
        hint,
    }
}
