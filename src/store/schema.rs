//! The SQL schema, as versioned migrations written once per dialect. Timestamps are Unix
//! milliseconds in BIGINT columns so that one set of queries serves every backend.

use super::Dialect;

/// (version, statements). Append new versions; never edit an applied one.
pub fn migrations(d: Dialect) -> Vec<(i64, Vec<String>)> {
    let int = match d {
        Dialect::Sqlite => "INTEGER",
        _ => "BIGINT",
    };
    let tail = match d {
        Dialect::MySql => " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4",
        _ => "",
    };
    vec![
        (1, first_tables(int, tail)),
        (2, order_events_payments_and_returns(int, tail)),
        (3, anti_bot_and_spent_nonces(int, tail)),
        (4, writer_fence(int, tail)),
        (5, segment_moves(int, tail)),
        (6, stock_journal(d, int, tail)),
        (7, logins_phones_and_intents(d, int, tail)),
        (9, orders_by_sale_id()),
        (10, sale_counters(int)),
        (11, tallies(d, int, tail)),
        // A sale's waiting room (see `room`): admissions per second, and how long before
        // the opening buyers may join; NULL when the sale has none.
        (
            12,
            vec![
                format!("ALTER TABLE sales ADD COLUMN room_admit_per_sec {int}"),
                format!("ALTER TABLE sales ADD COLUMN room_prequeue_secs {int}"),
            ],
        ),
        (13, narrow_orders_by_user(d)),
        (14, buyers_indexed_by_sale_only(d)),
        (15, buyers_indexed_in_runs(d)),
        (16, shop_buyers(int, tail)),
        (17, api_keys(int, tail)),
        (18, idempotency_keys_and_external_refs(d, int, tail)),
    ]
}

/// Buyers who sign in with the shop's own tokens: the pair (issuer, subject) each id was
/// made from (see `edge::auth::shop`), recorded once at its first token.
fn shop_buyers(int: &str, tail: &str) -> Vec<String> {
    vec![format!(
        "CREATE TABLE IF NOT EXISTS shop_buyers (
            user_id {int} PRIMARY KEY,
            issuer VARCHAR(255) NOT NULL,
            subject VARCHAR(255) NOT NULL,
            created_at {int} NOT NULL
        ){tail}"
    )]
}

/// Admin API keys (see `edge::auth::keys`): a name, scopes, the SHA-256 of the secret
/// (never the secret), when it was last used (to the nearest few seconds) and when revoked.
fn api_keys(int: &str, tail: &str) -> Vec<String> {
    vec![format!(
        "CREATE TABLE IF NOT EXISTS api_keys (
            id {int} PRIMARY KEY,
            name VARCHAR(100) NOT NULL,
            scopes VARCHAR(500) NOT NULL,
            secret_sha256 VARCHAR(64) NOT NULL,
            created_at {int} NOT NULL,
            rotated_at {int},
            last_used_at {int},
            revoked_at {int}
        ){tail}"
    )]
}

/// The answers of creating calls sent with an `Idempotency-Key` (see `edge::idempotency`):
/// per caller and key, the request's fingerprint and, once it is done, its answer. Old
/// ones are removed in batches by their creation time. And a sale's `external_ref`, the
/// shop's own reference, unique (NULLs apart).
fn idempotency_keys_and_external_refs(d: Dialect, int: &str, tail: &str) -> Vec<String> {
    // MySQL compares text without case (and MariaDB without trailing spaces) by default:
    // two references or keys that differ only so are two, as on the other databases.
    let (exact, ascii) = match d {
        Dialect::MySql => (
            " CHARACTER SET utf8mb4 COLLATE utf8mb4_bin",
            " CHARACTER SET ascii COLLATE ascii_bin",
        ),
        _ => ("", ""),
    };
    vec![
        format!(
            "CREATE TABLE IF NOT EXISTS idempotency_keys (
                caller VARCHAR(64){ascii} NOT NULL,
                idem_key VARCHAR(255){ascii} NOT NULL,
                fingerprint VARCHAR(64) NOT NULL,
                status {int},
                body TEXT,
                created_at {int} NOT NULL,
                PRIMARY KEY (caller, idem_key)
            ){tail}"
        ),
        "CREATE INDEX idempotency_keys_by_age ON idempotency_keys (created_at)".to_string(),
        format!("ALTER TABLE sales ADD COLUMN external_ref VARCHAR(200){exact}"),
        "CREATE UNIQUE INDEX sales_by_external_ref ON sales (external_ref)".to_string(),
    ]
}

/// The first tables: sales, orders (indexed by sale and buyer, and by buyer), users,
/// login codes and the shared `meta` values.
fn first_tables(int: &str, tail: &str) -> Vec<String> {
    vec![
        format!(
            "CREATE TABLE IF NOT EXISTS sales (
                id {int} PRIMARY KEY,
                title VARCHAR(200) NOT NULL,
                price_cents {int} NOT NULL,
                initial_stock {int} NOT NULL,
                stock {int} NOT NULL,
                per_user_limit {int} NOT NULL,
                begins_at {int} NOT NULL,
                ends_at {int} NOT NULL,
                payment_window_secs {int} NOT NULL,
                status VARCHAR(16) NOT NULL,
                paused {int} NOT NULL DEFAULT 0,
                created_at {int} NOT NULL,
                updated_at {int} NOT NULL,
                CONSTRAINT sales_stock_not_negative CHECK (stock >= 0)
            ){tail}"
        ),
        // No CHECK, UNIQUE, foreign key or trigger on orders: SQLite's writer inserts with
        // `OR IGNORE`, which would skip a row breaking one and retry the batch forever
        // (`sqlite_orders_hold_no_constraint_an_ignored_insert_could_hide`).
        format!(
            "CREATE TABLE IF NOT EXISTS orders (
                id {int} PRIMARY KEY,
                sale_id {int} NOT NULL,
                user_id {int} NOT NULL,
                quantity {int} NOT NULL,
                price_cents {int} NOT NULL,
                status VARCHAR(20) NOT NULL,
                accepted_at {int} NOT NULL,
                written_at {int} NOT NULL,
                pay_deadline {int} NOT NULL,
                updated_at {int} NOT NULL
            ){tail}"
        ),
        "CREATE INDEX orders_by_sale_user ON orders (sale_id, user_id)".to_string(),
        "CREATE INDEX orders_by_user ON orders (user_id, id)".to_string(),
        format!(
            "CREATE TABLE IF NOT EXISTS users (
                id {int} PRIMARY KEY,
                phone VARCHAR(64) NOT NULL UNIQUE,
                created_at {int} NOT NULL
            ){tail}"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS login_codes (
                phone VARCHAR(64) PRIMARY KEY,
                code VARCHAR(16) NOT NULL,
                created_at {int} NOT NULL,
                expires_at {int} NOT NULL,
                attempts {int} NOT NULL
            ){tail}"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS meta (
                k VARCHAR(64) PRIMARY KEY,
                v VARCHAR(512) NOT NULL
            ){tail}"
        ),
    ]
}

/// Each order's history of statuses, payment intents, and the outbox of stock going back
/// to the gate.
fn order_events_payments_and_returns(int: &str, tail: &str) -> Vec<String> {
    vec![
        // Each status is reached at most once per order, so (order_id, status) is the key
        // and doubles as a guard against recording a transition twice.
        format!(
            "CREATE TABLE IF NOT EXISTS order_events (
                order_id {int} NOT NULL,
                status VARCHAR(20) NOT NULL,
                at {int} NOT NULL,
                detail VARCHAR(200) NOT NULL,
                PRIMARY KEY (order_id, status)
            ){tail}"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS payments (
                intent_id {int} PRIMARY KEY,
                order_id {int} NOT NULL,
                user_id {int} NOT NULL,
                amount_cents {int} NOT NULL,
                status VARCHAR(16) NOT NULL,
                provider_ref VARCHAR(64) NOT NULL,
                created_at {int} NOT NULL,
                updated_at {int} NOT NULL
            ){tail}"
        ),
        "CREATE INDEX payments_by_order ON payments (order_id)".to_string(),
        // The outbox of stock going back to the gate: written in the transaction that
        // cancels or expires the order, cleared once the gate has taken the units back.
        format!(
            "CREATE TABLE IF NOT EXISTS stock_returns (
                order_id {int} PRIMARY KEY,
                sale_id {int} NOT NULL,
                user_id {int} NOT NULL,
                quantity {int} NOT NULL,
                reason VARCHAR(16) NOT NULL,
                created_at {int} NOT NULL,
                gate_done_at {int}
            ){tail}"
        ),
        "CREATE INDEX orders_by_deadline ON orders (status, pay_deadline)".to_string(),
    ]
}

/// A sale's anti-bot setting, and the single-use nonces the SQL gates spend.
fn anti_bot_and_spent_nonces(int: &str, tail: &str) -> Vec<String> {
    vec![
        "ALTER TABLE sales ADD COLUMN anti_bot VARCHAR(16) NOT NULL DEFAULT 'off'".to_string(),
        // Single-use nonces (purchase tokens, captchas) spent through the SQL gate; each row
        // is kept until the nonce could no longer be honoured anyway.
        format!(
            "CREATE TABLE IF NOT EXISTS spent_nonces (
                sale_id {int} NOT NULL,
                nonce {int} NOT NULL,
                keep_until {int} NOT NULL,
                PRIMARY KEY (sale_id, nonce)
            ){tail}"
        ),
    ]
}

/// The row order writers and a gate rebuild take turns on.
fn writer_fence(int: &str, tail: &str) -> Vec<String> {
    vec![
        // One row that order writers share-lock while they hold a batch read from Redis,
        // and that a gate rebuild locks exclusively before its snapshot: the rebuild waits
        // for batches read before Redis lost its data (see `Store::hold_writer_fence`).
        format!("CREATE TABLE IF NOT EXISTS writer_fence (id {int} PRIMARY KEY){tail}"),
        "INSERT INTO writer_fence (id) VALUES (1)".to_string(),
    ]
}

/// A sale's segments, and the stock moved between them.
fn segment_moves(int: &str, tail: &str) -> Vec<String> {
    vec![
        format!("ALTER TABLE sales ADD COLUMN segments {int} NOT NULL DEFAULT 1"),
        // Stock moved between the segments of a sale (see `segments`): each segment's
        // allocation is its even share of the initial stock plus the moves in and out
        // that took effect, so one lost segment is rebuilt from SQL alone.
        format!(
            "CREATE TABLE IF NOT EXISTS segment_moves (
                id {int} PRIMARY KEY,
                sale_id {int} NOT NULL,
                from_segment {int} NOT NULL,
                to_segment {int} NOT NULL,
                quantity {int} NOT NULL,
                state VARCHAR(16) NOT NULL,
                created_at {int} NOT NULL,
                updated_at {int} NOT NULL
            ){tail}"
        ),
        "CREATE INDEX segment_moves_by_sale ON segment_moves (sale_id, state)".to_string(),
    ]
}

/// The stock journal (see `journal`); existing sales open it with their stock.
fn stock_journal(d: Dialect, int: &str, tail: &str) -> Vec<String> {
    vec![
        super::journal::table(d, int, tail),
        "CREATE INDEX stock_journal_by_sale ON stock_journal (sale_id, id)".to_string(),
        "INSERT INTO stock_journal (sale_id, delta, cause, detail, at) \
         SELECT id, stock, 'opening_balance', 'the stock when the journal began', updated_at FROM sales"
            .to_string(),
    ]
}

/// A phone's guesses at login codes, users kept apart by the phones' migration, and at
/// most one open payment intent per order.
fn logins_phones_and_intents(d: Dialect, int: &str, tail: &str) -> Vec<String> {
    let open_intents_index = match d {
        // MySQL has no partial index: a generated column that holds the order only while
        // the intent is open, NULL (never equal to another NULL) once it is settled.
        Dialect::MySql => vec![
            "ALTER TABLE payments ADD COLUMN open_order_id BIGINT AS \
             (CASE WHEN status = 'created' THEN order_id END) VIRTUAL"
                .to_string(),
            "CREATE UNIQUE INDEX payments_one_open ON payments (open_order_id)".to_string(),
        ],
        _ => vec![
            "CREATE UNIQUE INDEX payments_one_open ON payments (order_id) WHERE status = 'created'"
                .to_string(),
        ],
    };
    let mut v = vec![
        // A phone's guesses at login codes in its current day, whatever codes it asked for.
        format!(
            "CREATE TABLE IF NOT EXISTS login_guesses (
                phone VARCHAR(64) PRIMARY KEY,
                window_start {int} NOT NULL,
                guesses {int} NOT NULL
            ){tail}"
        ),
        // Users whose phone, normalised to E.164, names another user already (see
        // `Store::normalise_phones`): kept apart and listed here, never merged silently.
        format!(
            "CREATE TABLE IF NOT EXISTS phone_conflicts (
                user_id {int} PRIMARY KEY,
                phone VARCHAR(64) NOT NULL,
                normalised VARCHAR(64) NOT NULL,
                other_user_id {int},
                reason VARCHAR(200) NOT NULL,
                found_at {int} NOT NULL
            ){tail}"
        ),
        // At most one open intent per order (concurrent /pay calls opened two before): the
        // older of any two open ones already there is superseded (still payable: a provider
        // that confirms it is recorded, see `settle_payment`).
        "UPDATE payments SET status = 'superseded' WHERE status = 'created' AND intent_id NOT IN \
         (SELECT keep FROM (SELECT MAX(intent_id) AS keep FROM payments WHERE status = 'created' \
         GROUP BY order_id) AS k)"
            .to_string(),
    ];
    v.extend(open_intents_index);
    v
}

/// The admin's pages of a sale's order ids walk this index from the cursor and stop after
/// a page: without it, each page sorted every order of the sale (seconds at a million
/// orders).
fn orders_by_sale_id() -> Vec<String> {
    vec!["CREATE INDEX orders_by_sale_id ON orders (sale_id, id)".to_string()]
}

/// A sale's counters (see `COUNTERS`), filled by a recount of its rows.
fn sale_counters(int: &str) -> Vec<String> {
    let mut v: Vec<String> = COUNTERS
        .iter()
        .map(|c| format!("ALTER TABLE sales ADD COLUMN {c} {int} NOT NULL DEFAULT 0"))
        .collect();
    v.push(format!(
        "UPDATE sales SET {}",
        recounted_counters("sales.id")
    ));
    v
}

/// On SQLite, orders by (sale, buyer) in two runs of their own instead of an index on
/// `orders` (see `store::buyers`): a writer's batch of a million-order sale wrote back a page
/// of that index per order, and SQLite's CPU per order grew with the sale (docs/adr/0004).
/// The orders there are moved into the large run in key order.
fn buyers_indexed_in_runs(d: Dialect) -> Vec<String> {
    if d != Dialect::Sqlite {
        return Vec::new();
    }
    let run = |name: &str| {
        format!(
            "CREATE TABLE IF NOT EXISTS {name} (
                sale_id INTEGER NOT NULL,
                user_id INTEGER NOT NULL,
                order_id INTEGER NOT NULL,
                PRIMARY KEY (sale_id, user_id, order_id)
            ) WITHOUT ROWID"
        )
    };
    vec![
        run("buyer_orders"),
        run("buyer_orders_new"),
        "INSERT INTO buyer_orders (sale_id, user_id, order_id) \
         SELECT sale_id, user_id, id FROM orders ORDER BY sale_id, user_id, id"
            .to_string(),
        "DROP INDEX IF EXISTS orders_by_sale_user".to_string(),
        "CREATE VIEW IF NOT EXISTS buyer_orders_all AS \
         SELECT sale_id, user_id, order_id FROM buyer_orders \
         UNION ALL SELECT sale_id, user_id, order_id FROM buyer_orders_new"
            .to_string(),
    ]
}

/// On SQLite, no index of orders by buyer alone: a buyer's list seeks `orders_by_sale_user`
/// (since migration 15, both runs of the buyer index) once per sale instead
/// (`store::SQLITE_ORDERS_OF_USER`; 0.4 ms at 1,000 sales). A writer's batch of a
/// million-order sale rewrote nearly every page of each index keyed by buyer, on the disk
/// the order log syncs to. Measured without this one, on repeated 1M-order storms: the
/// p99.9 fell from 7.6-11.3x the mean wait to 5.5-7.5x, the slow log commits by about 30%,
/// and SQLite's CPU per order from 27-31 to 19-26 µs. PostgreSQL and MySQL keep it: their
/// costs at a million orders were flat already, and a buyer's list there is one walk of
/// it. (Measured without it on PostgreSQL: CPU per order written fell 10%, but a buyer's
/// list, a seek per sale, took 2-8 ms at 1,000 sales against 0.2 ms.)
fn buyers_indexed_by_sale_only(d: Dialect) -> Vec<String> {
    match d {
        Dialect::Sqlite => vec!["DROP INDEX IF EXISTS orders_by_user".to_string()],
        _ => Vec::new(),
    }
}

/// On SQLite, a buyer's orders indexed by `(user_id)` alone (until migration 14 dropped the
/// index): an index entry of a rowid table ends with the rowid, which is the order's id, so
/// `(user_id)` orders a buyer's orders by id as `(user_id, id)` did, in entries 8 bytes
/// narrower. Each writer batch writes back every page of this index it touched (a page per
/// order or so at a million orders), so fewer pages are less CPU and less I/O per order.
/// PostgreSQL's index does not hold the id unless it names it; MySQL's would, but is left
/// as it is.
fn narrow_orders_by_user(d: Dialect) -> Vec<String> {
    match d {
        Dialect::Sqlite => vec![
            "DROP INDEX IF EXISTS orders_by_user".to_string(),
            "CREATE INDEX orders_by_user ON orders (user_id)".to_string(),
        ],
        _ => Vec::new(),
    }
}

/// The sale's tallies (see `store::tallies`): orders and payment intents by status, buyers
/// by the units they hold, filled from the rows there are; and the recount job's table
/// (see `reconcile::job`), and an index the recount counts unreturned stock by.
fn tallies(d: Dialect, int: &str, tail: &str) -> Vec<String> {
    let mut v = vec![
        format!(
            "CREATE TABLE IF NOT EXISTS sale_tallies (
                sale_id {int} NOT NULL,
                tally VARCHAR(40) NOT NULL,
                n {int} NOT NULL,
                PRIMARY KEY (sale_id, tally)
            ){tail}"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS recount_jobs (
                sale_id {int} PRIMARY KEY,
                state VARCHAR(16) NOT NULL,
                started_at {int} NOT NULL,
                updated_at {int} NOT NULL,
                orders_read {int} NOT NULL,
                orders_total {int} NOT NULL,
                outcome TEXT,
                error VARCHAR(500)
            ){tail}"
        ),
        "CREATE INDEX stock_returns_by_sale ON stock_returns (sale_id, gate_done_at)".to_string(),
    ];
    v.extend(tally_backfill(d, "sale_id"));
    v
}

/// The statements that fill `sale_tallies` from the rows, for the sales whose id equals
/// `sale` (the column itself for every sale, or `?` for one).
pub fn tally_backfill(d: Dialect, sale: &str) -> Vec<String> {
    let text = |prefix: &str, expr: &str| match d {
        Dialect::Sqlite => format!("'{prefix}' || {expr}"),
        _ => format!("CONCAT('{prefix}', {expr})"),
    };
    let order_sale = if sale == "sale_id" { "o.sale_id" } else { sale };
    vec![
        format!(
            "INSERT INTO sale_tallies (sale_id, tally, n) \
             SELECT sale_id, {}, COUNT(*) FROM orders WHERE sale_id = {sale} \
             GROUP BY sale_id, status",
            text("orders:", "status")
        ),
        format!(
            "INSERT INTO sale_tallies (sale_id, tally, n) \
             SELECT o.sale_id, {}, COUNT(*) FROM payments p JOIN orders o ON o.id = p.order_id \
             WHERE o.sale_id = {order_sale} GROUP BY o.sale_id, p.status",
            text("payments:", "p.status")
        ),
        format!(
            "INSERT INTO sale_tallies (sale_id, tally, n) \
             SELECT sale_id, {}, COUNT(*) FROM (SELECT sale_id, user_id, SUM(quantity) AS held \
             FROM orders WHERE sale_id = {sale} AND status IN ('pending_payment', 'paid') \
             GROUP BY sale_id, user_id) h GROUP BY sale_id, held",
            text("holding:", "held")
        ),
    ]
}

/// A sale's figures that the audit compares, kept on its row by every transaction that
/// changes them (see `store::counters`), so that reading them costs one row whatever the
/// sale holds: live units and buyers (pending payment or paid), returns SQL counted back
/// and the gate not yet (orders, units), units between two segments, the journal's sum.
pub const COUNTERS: [&str; 6] = [
    "live_units",
    "live_buyers",
    "returns_owed_orders",
    "returns_owed_units",
    "units_in_transit",
    "journal_sum",
];

/// `counter = (its recount), ...` for the sale whose id is `sale`: what the counters are
/// when nothing went wrong (the migration's backfill, and the audit's slow check).
pub fn recounted_counters(sale: &str) -> String {
    let live = format!("sale_id = {sale} AND status IN ('pending_payment', 'paid')");
    let owed = format!("sale_id = {sale} AND gate_done_at IS NULL");
    [
        format!("live_units = (SELECT COALESCE(SUM(quantity), 0) FROM orders WHERE {live})"),
        format!("live_buyers = (SELECT COUNT(DISTINCT user_id) FROM orders WHERE {live})"),
        format!("returns_owed_orders = (SELECT COUNT(*) FROM stock_returns WHERE {owed})"),
        format!(
            "returns_owed_units = (SELECT COALESCE(SUM(quantity), 0) FROM stock_returns WHERE {owed})"
        ),
        format!(
            "units_in_transit = (SELECT COALESCE(SUM(quantity), 0) FROM segment_moves \
             WHERE sale_id = {sale} AND state = 'taken')"
        ),
        format!("journal_sum = (SELECT COALESCE(SUM(delta), 0) FROM stock_journal WHERE sale_id = {sale})"),
    ]
    .join(", ")
}

/// The migration that rewrites stored phones to E.164 (in Rust: SQL cannot parse phone
/// numbers), applied after the SQL ones.
pub const PHONES_NORMALISED: i64 = 8;
