//! Reconciliation: a sale's gate compared with SQL's account of it plus what is on its
//! way between them, continuously (`Auditor`, one instance at a time) and on request
//! (`seckill reconcile`, `GET /api/admin/sales/{id}/reconcile`), and the repair of a gate
//! that drifted: a fenced rebuild from SQL and the order log, with a journal row naming
//! who asked and why. It never changes SQL's orders or stock, and repairs only when asked.
//!
//! The balance it checks, per sale, when nothing is lost:
//! gate stock = SQL stock - units accepted and not yet written (the order log)
//!              - units SQL took back and the gate not yet (returns owed)
//!              - units between two segments;
//! SQL's live buyers <= gate buyers <= live buyers + unwritten orders + returns owed;
//! the journal's sum = SQL stock.
//! Reads of the gate, the log and SQL are not one snapshot, so a busy sale shows passing
//! differences; only one that stays the same over `CONFIRM_ROUNDS` audits is drift.

pub mod auditor;
pub mod job;

use std::collections::HashMap;

use serde::Serialize;

use crate::gate::{Gate, GateError};
use crate::loader::{LoadError, SaleCache};
use crate::model::Sale;
use crate::orderlog::LogError;
use crate::orderlog::{Backlog, Unwritten};
use crate::store::journal::{Cause, Movement};
use crate::store::{Store, StoreError};

/// Most unwritten entries read from one stream to count them; past it, too much is in
/// flight for an audit to mean anything (the writers are far behind: readiness says so).
pub const MAX_IN_FLIGHT: usize = 20_000;

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Gate(#[from] GateError),
    #[error(transparent)]
    Log(#[from] LogError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("sale {0} does not exist")]
    NoSuchSale(i64),
    #[error("more than {MAX_IN_FLIGHT} orders of sale {0} wait in a stream: too much in flight to audit")]
    TooMuchInFlight(i64),
}

/// Most buyers compared one by one; past it, only their numbers are compared.
pub const MAX_BUYERS_COMPARED: usize = 50_000;

/// One sale's gate against SQL and what is in flight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Account {
    pub sale_id: String,
    /// False when the gate holds no state for the sale apart from SQL (not loaded yet, or
    /// lost, and loaded by the scheduler; or a SQL gate, which is SQL): only the journal
    /// is compared.
    pub gate_loaded: bool,
    pub gate_stock: Option<i64>,
    pub gate_buyers: Option<i64>,
    pub sql_stock: i64,
    pub sql_live_units: i64,
    pub sql_live_buyers: i64,
    /// Orders accepted and not yet in SQL: in the order log, or still being appended to it.
    pub unwritten_orders: i64,
    pub unwritten_units: i64,
    /// Entries set aside as unwritable: accepted by the gate, never to reach SQL.
    pub dead_letters: i64,
    pub returns_owed_orders: i64,
    pub returns_owed_units: i64,
    pub units_in_transit: i64,
    pub journal_sum: i64,
    /// What the gate's stock should be.
    pub expected_gate_stock: i64,
    /// Gate stock minus what it should be: below 0 the gate sells less than it may (lost
    /// units, or orders it counted that never reached SQL); above 0 it may oversell.
    pub stock_drift: i64,
    /// Buyers for whom the gate holds fewer units than SQL and the log account for (a
    /// buyer forgotten by the gate could buy again past the limit).
    pub buyers_missing: i64,
    /// Buyers for whom the gate holds more units than SQL and the log account for.
    pub buyers_unknown: i64,
    /// Whether buyers were compared one by one (else by number only: too many).
    pub buyers_compared_each: bool,
    /// The journal's sum minus SQL's stock: anything but 0 means SQL was changed by hand.
    pub journal_drift: i64,
}

impl Account {
    /// The differences that make drift, in one comparable value.
    pub fn differences(&self) -> (i64, i64, i64, i64) {
        (
            self.stock_drift,
            self.buyers_missing,
            self.buyers_unknown,
            self.journal_drift,
        )
    }

    pub fn exact(&self) -> bool {
        self.differences() == (0, 0, 0, 0)
    }
}

/// How far an account reads.
#[derive(Debug, Clone, Copy)]
pub enum Depth {
    /// SQL's figures from the counters on the sale's row, buyers compared by number: a few
    /// rows whatever the sale holds (the audit's every round).
    Counters,
    /// The counters, and buyers compared one by one when the sale has at most
    /// `SMALL_SALE_BUYERS` of them (a cheap read then): the admin's reconcile.
    Read,
    /// SQL's figures counted again from every row at this pace (correcting the counters if
    /// they disagree), buyers compared one by one up to `MAX_BUYERS_COMPARED`: the recount
    /// job, the CLI, and the audit's confirmation of a difference and its slow check.
    Recount(crate::store::Pace),
}

/// Live buyers up to which a plain read compares them one by one.
pub const SMALL_SALE_BUYERS: i64 = 10_000;

/// The account the admin reads: counters, and buyers one by one for a small sale.
pub async fn account(
    store: &Store,
    gate: &dyn Gate,
    in_flight: &dyn Backlog,
    sale_id: i64,
) -> Result<Account, ReconcileError> {
    account_to(store, gate, in_flight, sale_id, Depth::Read).await
}

/// [`account`], reading SQL to `depth`.
pub async fn account_to(
    store: &Store,
    gate: &dyn Gate,
    in_flight: &dyn Backlog,
    sale_id: i64,
    depth: Depth,
) -> Result<Account, ReconcileError> {
    let (account, _) = account_with(store, gate, in_flight, sale_id, depth, &|_| {}).await?;
    Ok(account)
}

/// [`account_to`], with the recount's own findings when it recounted, and `progress` told
/// the orders it has read so far.
pub async fn account_with(
    store: &Store,
    gate: &dyn Gate,
    in_flight: &dyn Backlog,
    sale_id: i64,
    depth: Depth,
    progress: &(dyn Fn(i64) + Send + Sync),
) -> Result<(Account, Option<crate::store::Recount>), ReconcileError> {
    let segments = store
        .sale(sale_id)
        .await?
        .ok_or(ReconcileError::NoSuchSale(sale_id))?
        .segments;
    let seen = in_flight_of(gate, in_flight, sale_id, segments).await?;
    let mut recounted = None;
    let (sql, sql_buyers) = match depth {
        Depth::Counters | Depth::Read => {
            let sql = store
                .sql_account(sale_id)
                .await?
                .ok_or(ReconcileError::NoSuchSale(sale_id))?;
            let small = matches!(depth, Depth::Read) && sql.live_buyers <= SMALL_SALE_BUYERS;
            let buyers = match small && seen.gate.is_some() {
                true => Some(store.live_buyers(sale_id).await?),
                false => None,
            };
            (sql, buyers)
        }
        Depth::Recount(pace) => {
            let mut recount = store
                .recount_paced(sale_id, pace, MAX_BUYERS_COMPARED, progress)
                .await?
                .ok_or(ReconcileError::NoSuchSale(sale_id))?;
            let figures = (recount.counted, recount.buyers.take());
            recounted = Some(recount);
            figures
        }
    };
    let account = settle(store, gate, sale_id, seen, sql, sql_buyers).await?;
    Ok((account, recounted))
}

/// The accounts of many sales, `(sale, segments)`, from their counters: the gate and the
/// log of each read first, then SQL's figures of them all in one query. What the audit
/// reads every round, a few rows whatever the sales hold and however many they are.
pub async fn accounts_of_counters(
    store: &Store,
    gate: &dyn Gate,
    in_flight: &dyn Backlog,
    sales: &[(i64, i64)],
) -> Result<Vec<(i64, Result<Account, ReconcileError>)>, ReconcileError> {
    let ids: Vec<i64> = sales.iter().map(|(id, _)| *id).collect();
    let seen = in_flight_of_sales(gate, in_flight, sales, &ids).await;
    let mut sql = store.sql_accounts(&ids).await?;
    let mut accounts = Vec::with_capacity(seen.len());
    for (sale, seen) in seen {
        let account = match (seen, sql.remove(&sale)) {
            (Ok(seen), Some(figures)) => settle(store, gate, sale, seen, figures, None).await,
            (Ok(_), None) => Err(ReconcileError::NoSuchSale(sale)),
            (Err(e), _) => Err(e),
        };
        accounts.push((sale, account));
    }
    Ok(accounts)
}

/// What the gate and the order log hold of a sale: read before SQL, so that an order on
/// its way between them while they are read is seen at least once (possibly twice: in the
/// gate's appending figures and the log, or in the log and SQL; a busy sale's passing
/// difference, which the audit never confirms without a quiet recount).
struct Seen {
    gate: Option<crate::gate::GateStock>,
    /// (user, quantity) of each order not yet in SQL.
    unwritten: Vec<(i64, i64)>,
    dead_letters: i64,
}

async fn in_flight_of(
    gate: &dyn Gate,
    in_flight: &dyn Backlog,
    sale_id: i64,
    segments: i64,
) -> Result<Seen, ReconcileError> {
    // A SQL gate decides in SQL itself: nothing apart from SQL to compare, only the journal.
    let gate = match in_flight.holds_orders() {
        false => None,
        true => gate.stock(sale_id).await?,
    };
    let (unwritten, dead_letters) = in_flight
        .unwritten(sale_id, segments, MAX_IN_FLIGHT)
        .await?
        .ok_or(ReconcileError::TooMuchInFlight(sale_id))?;
    Ok(Seen {
        gate,
        unwritten,
        dead_letters,
    })
}

/// [`in_flight_of`] of many sales, `(sale, segments)` (`ids`: theirs): the gate's figures of
/// them all in one call, then their logs' in one, where the gate and the log can (one Redis
/// server): the audit's rounds cost a few calls whatever the number of sales.
async fn in_flight_of_sales(
    gate: &dyn Gate,
    in_flight: &dyn Backlog,
    sales: &[(i64, i64)],
    ids: &[i64],
) -> Vec<(i64, Result<Seen, ReconcileError>)> {
    // A SQL gate decides in SQL itself: nothing apart from SQL to compare, only the journal.
    let stocks = match in_flight.holds_orders() {
        false => ids.iter().map(|_| Ok(None)).collect(),
        true => gate.stocks(ids).await,
    };
    let mut stocks = stocks.into_iter();
    let mut unwritten = in_flight
        .unwritten_of_sales(sales, MAX_IN_FLIGHT)
        .await
        .into_iter();
    let mut seen = Vec::with_capacity(ids.len());
    for sale in ids {
        // A sale left without an answer fails its round rather than dropping out of the audit.
        let (Some(gate), Some(log)) = (stocks.next(), unwritten.next()) else {
            let missing = GateError::BadReply("no answer for the sale".into());
            seen.push((*sale, Err(missing.into())));
            continue;
        };
        let read = |gate: Result<_, GateError>, log: Result<Option<Unwritten>, LogError>| {
            let (unwritten, dead_letters) = log?.ok_or(ReconcileError::TooMuchInFlight(*sale))?;
            Ok(Seen {
                gate: gate?,
                unwritten,
                dead_letters,
            })
        };
        seen.push((*sale, read(gate, log)));
    }
    seen
}

/// The account of what was seen in the gate and the log against SQL's figures;
/// `sql_buyers` when the buyers are to be compared one by one.
async fn settle(
    store: &Store,
    gate: &dyn Gate,
    sale_id: i64,
    seen: Seen,
    sql: crate::store::journal::SqlAccount,
    sql_buyers: Option<Vec<(i64, i64)>>,
) -> Result<Account, ReconcileError> {
    let Seen {
        gate: gate_now,
        unwritten: in_flight_orders,
        dead_letters,
    } = seen;
    let holders = match (&gate_now, &sql_buyers) {
        (Some(_), Some(_)) => gate.holders(sale_id, MAX_BUYERS_COMPARED).await?,
        _ => None,
    };
    // Orders the gate decided that are still being appended to the log are on their way
    // to SQL as much as those the log holds.
    let (appending_orders, appending_units) =
        gate_now.map_or((0, 0), |g| (g.appending_orders, g.appending_units));
    let unwritten_orders = in_flight_orders.len() as i64 + appending_orders;
    let unwritten_units: i64 =
        in_flight_orders.iter().map(|(_, q)| q).sum::<i64>() + appending_units;
    let expected_gate_stock =
        sql.stock - unwritten_units - sql.returns_owed_units - sql.units_in_transit;
    let (buyers_missing, buyers_unknown) = match (&gate_now, &holders, sql_buyers) {
        (Some(_), Some(holders), Some(sql_buyers)) => {
            // What each buyer should hold in the gate: live units in SQL, units on their
            // way to SQL, units SQL took back that the gate has not yet.
            let mut owed: HashMap<i64, i64> = HashMap::new();
            for (user, units) in sql_buyers {
                *owed.entry(user).or_default() += units;
            }
            for (user, units) in &in_flight_orders {
                *owed.entry(*user).or_default() += units;
            }
            for (user, units) in store.returns_owed_by_buyer(sale_id).await? {
                *owed.entry(user).or_default() += units;
            }
            compare_buyers(&owed, holders)
        }
        (Some(g), _, _) => (
            (sql.live_buyers - g.buyers).max(0),
            (g.buyers - (sql.live_buyers + unwritten_orders + sql.returns_owed_orders)).max(0),
        ),
        (None, _, _) => (0, 0),
    };
    let stock_drift = gate_now.map_or(0, |g| g.remaining - expected_gate_stock);
    Ok(Account {
        sale_id: sale_id.to_string(),
        gate_loaded: gate_now.is_some(),
        gate_stock: gate_now.map(|g| g.remaining),
        gate_buyers: gate_now.map(|g| g.buyers),
        sql_stock: sql.stock,
        sql_live_units: sql.live_units,
        sql_live_buyers: sql.live_buyers,
        unwritten_orders,
        unwritten_units,
        dead_letters,
        returns_owed_orders: sql.returns_owed_orders,
        returns_owed_units: sql.returns_owed_units,
        units_in_transit: sql.units_in_transit,
        journal_sum: sql.journal_sum,
        expected_gate_stock,
        stock_drift,
        buyers_missing,
        buyers_unknown,
        buyers_compared_each: holders.is_some(),
        journal_drift: sql.journal_sum - sql.stock,
    })
}

/// (buyers the gate holds fewer units for than owed, buyers it holds more for).
fn compare_buyers(owed: &HashMap<i64, i64>, holders: &[(i64, i64)]) -> (i64, i64) {
    let held: HashMap<i64, i64> = holders.iter().copied().filter(|(_, q)| *q > 0).collect();
    let missing = owed
        .iter()
        .filter(|(user, units)| **units > 0 && held.get(user).copied().unwrap_or(0) < **units)
        .count();
    let unknown = held
        .iter()
        .filter(|(user, units)| **units > owed.get(user).copied().unwrap_or(0))
        .count();
    (missing as i64, unknown as i64)
}

/// What a repair did.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Repair {
    pub before: Account,
    pub after: Account,
}

/// Brings a sale's gate back to SQL's account: each segment forgotten and rebuilt from
/// SQL and the order log under the sale's load lock (the same fenced rebuild as after a
/// Redis loss), then a journal row saying who asked, why, and what was off.
pub async fn repair(
    store: &Store,
    gate: &dyn Gate,
    in_flight: &dyn Backlog,
    cache: &SaleCache,
    sale: &Sale,
    actor: &str,
    reason: &str,
) -> Result<Repair, ReconcileError> {
    let before = account(store, gate, in_flight, sale.id).await?;
    {
        let lock = cache.load_lock(sale.id);
        let _one_at_a_time = lock.lock().await;
        for segment in 0..sale.segments.max(1) {
            gate.forget_segment_for_repair(sale.id, segment).await?;
        }
    }
    crate::loader::load_sale_and_wait(store, gate, cache, sale).await?;
    let after = account(store, gate, in_flight, sale.id).await?;
    let detail = format!(
        "{reason}: gate stock {} -> {} (expected {}), buyers missing {} -> {}, unknown {} -> {}",
        before.gate_stock.map_or("-".into(), |s| s.to_string()),
        after.gate_stock.map_or("-".into(), |s| s.to_string()),
        after.expected_gate_stock,
        before.buyers_missing,
        after.buyers_missing,
        before.buyers_unknown,
        after.buyers_unknown,
    );
    store
        .journal_note(&[Movement::new(sale.id, 0, Cause::Repaired).by(actor, &detail)])
        .await?;
    tracing::warn!(sale = sale.id, actor, %detail, "gate repaired from SQL");
    Ok(Repair { before, after })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buyers_are_compared_one_by_one_so_that_faults_do_not_cancel_out() {
        let owed: HashMap<i64, i64> = [(1, 1), (2, 2), (3, 1)].into_iter().collect();
        // The gate forgot buyer 1 and holds buyer 9 nobody accounts for: as many buyers
        // as owed, yet two differences.
        let held = [(2, 2), (3, 1), (9, 1)];
        assert_eq!(compare_buyers(&owed, &held), (1, 1));
        // One unit short for buyer 2, one over for buyer 3.
        assert_eq!(compare_buyers(&owed, &[(1, 1), (2, 1), (3, 2)]), (1, 1));
        assert_eq!(compare_buyers(&owed, &[(1, 1), (2, 2), (3, 1)]), (0, 0));
        // Buyers at zero are no buyers.
        assert_eq!(compare_buyers(&HashMap::new(), &[(4, 0)]), (0, 0));
    }
}
