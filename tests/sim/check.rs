//! The invariants of docs/ARCHITECTURE.md, checked from outside after every step: against
//! SQL (read by an observer connection of its own), the order log, the gate, and what each
//! buyer was told.

use std::collections::{BTreeMap, HashMap};

use seckill::store::Store;
use sqlx::Row;

use crate::run::{Sim, Told};

/// What SQL holds of one order.
struct Row_ {
    sale: i64,
    user: i64,
    quantity: i64,
    status: String,
}

async fn orders(store: &Store) -> Result<BTreeMap<i64, Row_>, String> {
    let rows = sqlx::query("SELECT id, sale_id, user_id, quantity, status FROM orders")
        .fetch_all(store.pool())
        .await
        .map_err(|e| format!("reading orders: {e}"))?;
    rows.iter()
        .map(|r| {
            Ok((
                r.try_get::<i64, _>(0)?,
                Row_ {
                    sale: r.try_get(1)?,
                    user: r.try_get(2)?,
                    quantity: r.try_get(3)?,
                    status: r.try_get(4)?,
                },
            ))
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(|e| e.to_string())
}

fn is_live(status: &str) -> bool {
    status == "pending_payment" || status == "paid"
}

/// Whether an order may go from `from` to `to`: only forward.
fn forward(from: &str, to: &str) -> bool {
    from == to || (from == "pending_payment" && matches!(to, "paid" | "cancelled" | "expired"))
}

/// Panics (failing the seed) unless order `id` is in `status` now.
pub async fn status_is(store: &Store, id: i64, status: &str, after: &str) {
    let found: Option<String> = sqlx::query("SELECT status FROM orders WHERE id = ?")
        .bind(id)
        .fetch_optional(store.pool())
        .await
        .expect("reading an order")
        .map(|r| r.get(0));
    assert_eq!(
        found.as_deref(),
        Some(status),
        "order {id} after {after} answered success"
    );
}

/// A sale's row: its stock and the counters its transactions keep.
#[derive(Debug, PartialEq, Eq, Default, Clone, Copy)]
struct Kept {
    stock: i64,
    live_units: i64,
    live_buyers: i64,
    returns_owed_orders: i64,
    returns_owed_units: i64,
    journal_sum: i64,
}

async fn kept(store: &Store) -> Result<HashMap<i64, Kept>, String> {
    let rows = sqlx::query(
        "SELECT s.id, s.stock, s.live_units, s.live_buyers, s.returns_owed_orders, \
         s.returns_owed_units, s.journal_sum, \
         (SELECT COALESCE(SUM(delta), 0) FROM stock_journal j WHERE j.sale_id = s.id) \
         FROM sales s",
    )
    .fetch_all(store.pool())
    .await
    .map_err(|e| format!("reading sales: {e}"))?;
    let mut out = HashMap::new();
    for r in &rows {
        let journal: i64 = r.get(7);
        let k = Kept {
            stock: r.get(1),
            live_units: r.get(2),
            live_buyers: r.get(3),
            returns_owed_orders: r.get(4),
            returns_owed_units: r.get(5),
            journal_sum: r.get(6),
        };
        if journal != k.journal_sum {
            return Err(format!(
                "sale {}: journal rows sum to {journal}, its counter says {}",
                r.get::<i64, _>(0),
                k.journal_sum
            ));
        }
        out.insert(r.get(0), k);
    }
    Ok(out)
}

/// The invariants that hold after every step of a running process. SQL is read in four
/// queries and every figure recounted here from the rows, so that a step costs little.
pub async fn after_step(sim: &mut Sim) -> Result<(), String> {
    let snapshot = match sim.sql.take() {
        Some(unchanged) => unchanged,
        None => read_sql(&sim.observer).await?,
    };
    let result = check(sim, &snapshot).await;
    sim.sql = Some(snapshot);
    result
}

/// What SQL holds, as the checks read it.
pub struct SqlSnapshot {
    rows: BTreeMap<i64, Row_>,
    /// Order -> whether its stock return was handed to the gate.
    returned: HashMap<i64, bool>,
    kept: HashMap<i64, Kept>,
    /// (sale, tally) -> n, as the transactions kept them (rows at 0 left out).
    tallies: BTreeMap<(i64, String), i64>,
    /// (sale, status) of every payment intent.
    payments: Vec<(i64, String)>,
}

async fn read_sql(store: &Store) -> Result<SqlSnapshot, String> {
    let rows = orders(store).await?;
    let returns: Vec<(i64, bool)> = sqlx::query(
        "SELECT order_id, CASE WHEN gate_done_at IS NULL THEN 0 ELSE 1 END FROM stock_returns",
    )
    .fetch_all(store.pool())
    .await
    .map_err(|e| e.to_string())?
    .iter()
    .map(|r| (r.get::<i64, _>(0), r.get::<i64, _>(1) == 1))
    .collect();
    // Invariant 5 in SQL: one return per order.
    let mut returned: HashMap<i64, bool> = HashMap::new();
    for (id, done) in &returns {
        if returned.insert(*id, *done).is_some() {
            return Err(format!("order {id} has two stock returns"));
        }
    }
    let tallies = sqlx::query("SELECT sale_id, tally, n FROM sale_tallies WHERE n <> 0")
        .fetch_all(store.pool())
        .await
        .map_err(|e| e.to_string())?
        .iter()
        .map(|r| {
            (
                (r.get::<i64, _>(0), r.get::<String, _>(1)),
                r.get::<i64, _>(2),
            )
        })
        .collect();
    let payments = sqlx::query(
        "SELECT o.sale_id, p.status FROM payments p JOIN orders o ON o.id = p.order_id",
    )
    .fetch_all(store.pool())
    .await
    .map_err(|e| e.to_string())?
    .iter()
    .map(|r| (r.get::<i64, _>(0), r.get::<String, _>(1)))
    .collect();
    Ok(SqlSnapshot {
        rows,
        returned,
        kept: kept(store).await?,
        tallies,
        payments,
    })
}

async fn check(sim: &mut Sim, sql: &SqlSnapshot) -> Result<(), String> {
    let SqlSnapshot {
        rows,
        returned,
        kept,
        tallies,
        payments,
    } = sql;
    // Order states only move forward (4, 5: an order is written once, leaves
    // pending_payment once).
    for (id, row) in rows {
        if let Some(before) = sim.statuses.get(id) {
            if !forward(before, &row.status) {
                return Err(format!("order {id} went from {before} to {}", row.status));
            }
        }
    }
    for id in sim.statuses.keys() {
        if !rows.contains_key(id) {
            return Err(format!("order {id} was in SQL and is gone"));
        }
    }
    sim.statuses = rows.iter().map(|(id, r)| (*id, r.status.clone())).collect();
    // Invariant 5 in SQL: a return for each cancelled or expired order, none for a live one.
    for (id, row) in rows {
        let closed = matches!(row.status.as_str(), "cancelled" | "expired");
        if closed != returned.contains_key(id) {
            return Err(format!(
                "order {id} is {} and has no return, or a live one has",
                row.status
            ));
        }
    }
    let world = sim.world.as_ref().expect("checked while running");
    let between = world.pump.waiting() > 0;
    for spec in &sim.sales {
        let k = kept.get(&spec.id).copied().ok_or("a sale vanished")?;
        let mut held: BTreeMap<i64, i64> = BTreeMap::new();
        let mut counted = Kept {
            stock: k.stock,
            journal_sum: k.stock,
            ..Kept::default()
        };
        for (id, row) in rows.iter().filter(|(_, r)| r.sale == spec.id) {
            if is_live(&row.status) {
                *held.entry(row.user).or_default() += row.quantity;
                counted.live_units += row.quantity;
            } else if returned.get(id) == Some(&false) {
                counted.returns_owed_orders += 1;
                counted.returns_owed_units += row.quantity;
            }
        }
        counted.live_buyers = held.len() as i64;
        // The counters kept by the transactions equal a recount; the journal's sum is the
        // stock.
        if counted != k {
            return Err(format!(
                "sale {}: kept {k:?}, recounted {counted:?}",
                spec.id
            ));
        }
        // Invariants 1 and 6: never more sold than the stock; SQL's stock and its live
        // orders add up to the initial stock at every instant.
        if k.stock < 0 || k.stock + k.live_units != spec.stock {
            return Err(format!(
                "sale {}: SQL stock {} + live units {} != initial {}",
                spec.id, k.stock, k.live_units, spec.stock
            ));
        }
        // The tallies the admin reads (orders and intents by status, buyers by units held)
        // equal their count from the rows.
        let mut counted_tallies: BTreeMap<(i64, String), i64> = BTreeMap::new();
        for row in rows.values().filter(|r| r.sale == spec.id) {
            *counted_tallies
                .entry((spec.id, format!("orders:{}", row.status)))
                .or_default() += 1;
        }
        for units in held.values() {
            *counted_tallies
                .entry((spec.id, format!("holding:{units}")))
                .or_default() += 1;
        }
        for (sale, status) in payments.iter().filter(|(sale, _)| *sale == spec.id) {
            *counted_tallies
                .entry((*sale, format!("payments:{status}")))
                .or_default() += 1;
        }
        let kept_tallies: BTreeMap<(i64, String), i64> = tallies
            .iter()
            .filter(|((sale, _), _)| *sale == spec.id)
            .map(|(k, n)| (k.clone(), *n))
            .collect();
        if kept_tallies != counted_tallies {
            return Err(format!(
                "sale {}: tallies kept {kept_tallies:?}, counted {counted_tallies:?}",
                spec.id
            ));
        }
        // Invariant 2 in SQL.
        if let Some((user, units)) = held.iter().find(|(_, u)| **u > spec.limit) {
            return Err(format!(
                "sale {}: user {user} holds {units} > limit {}",
                spec.id, spec.limit
            ));
        }
        // The gate against SQL and the log, unit for unit and buyer for buyer, as the
        // audit would find it; not while purchases are between the gate and the log (their
        // units are in neither yet).
        let Some(gate) = world.gate.stock(spec.id).await.map_err(|e| e.to_string())? else {
            continue;
        };
        if gate.remaining < 0 {
            return Err(format!(
                "sale {}: the gate's stock is {}",
                spec.id, gate.remaining
            ));
        }
        let holders = world
            .gate
            .holders(spec.id, usize::MAX)
            .await
            .map_err(|e| e.to_string())?
            .unwrap_or_default();
        if let Some((user, units)) = holders.iter().find(|(_, u)| *u > spec.limit) {
            return Err(format!(
                "sale {}: the gate lets user {user} hold {units}",
                spec.id
            ));
        }
        if between {
            continue;
        }
        let mut owed = held.clone();
        let mut unwritten_units = 0;
        for (user, units) in world.log.unwritten(spec.id) {
            *owed.entry(user).or_default() += units;
            unwritten_units += units;
        }
        for (id, row) in rows.iter().filter(|(_, r)| r.sale == spec.id) {
            if returned.get(id) == Some(&false) {
                *owed.entry(row.user).or_default() += row.quantity;
            }
        }
        owed.retain(|_, units| *units > 0);
        let expected = k.stock - unwritten_units - k.returns_owed_units;
        if gate.remaining != expected {
            return Err(format!(
                "sale {}: the gate holds {} units, SQL and the log say {expected}",
                spec.id, gate.remaining
            ));
        }
        let in_gate: BTreeMap<i64, i64> = holders.into_iter().filter(|(_, u)| *u > 0).collect();
        if in_gate != owed {
            return Err(format!(
                "sale {}: the gate's buyers {in_gate:?}, SQL and the log say {owed:?}",
                spec.id
            ));
        }
    }
    // Invariant 3 while running: every `ok` is in SQL or in the log on its way; and an
    // answered "no" is never executed later.
    for (id, a) in &sim.attempts {
        let in_sql = rows.contains_key(id);
        let queued = world.log.queued(a.sale, *id).is_some();
        match a.told {
            Told::Ok if !in_sql && !queued => {
                return Err(format!("order {id} was answered ok and is nowhere"))
            }
            Told::No if in_sql || queued => {
                return Err(format!("order {id} was refused and became an order"))
            }
            _ => {}
        }
        if let Some(row) = rows.get(id) {
            if (row.sale, row.user, row.quantity) != (a.sale, a.user, a.quantity) {
                return Err(format!("order {id} is not what the buyer asked for"));
            }
        }
    }
    Ok(())
}

/// The production audit's own account, as a second opinion at rest: it must find nothing.
pub async fn audit_agrees(sim: &Sim) -> Result<(), String> {
    let world = sim.world.as_ref().ok_or("not running")?;
    for spec in &sim.sales {
        let account =
            seckill::reconcile::account(&sim.observer, world.gate.as_ref(), &world.log, spec.id)
                .await
                .map_err(|e| format!("account: {e}"))?;
        if account.gate_loaded && !account.exact() {
            return Err(format!(
                "sale {}: the audit finds drift: {account:?}",
                spec.id
            ));
        }
    }
    Ok(())
}

/// Once everything is written and handed back: every `ok` is in SQL, the gate agrees with
/// SQL, every return reached the gate.
pub async fn at_rest(sim: &mut Sim) -> Result<(), String> {
    sim.sql = None;
    after_step(sim).await?;
    audit_agrees(sim).await?;
    let rows = orders(&sim.observer).await?;
    for (id, a) in &sim.attempts {
        if a.told == Told::Ok && !rows.contains_key(id) {
            return Err(format!("order {id} was answered ok and is not in SQL"));
        }
    }
    sim.tally.expired = rows.values().filter(|r| r.status == "expired").count();
    let pending: i64 = sqlx::query("SELECT COUNT(*) FROM stock_returns WHERE gate_done_at IS NULL")
        .fetch_one(sim.observer.pool())
        .await
        .map_err(|e| e.to_string())?
        .get(0);
    if pending != 0 {
        return Err(format!("{pending} stock returns never reached the gate"));
    }
    Ok(())
}
