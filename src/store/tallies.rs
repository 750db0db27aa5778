//! A sale's tallies: its orders by status, its payment intents by status, and its buyers by
//! the units they hold in live orders. Kept in `sale_tallies` by the transaction that changes
//! them (one upsert per transaction, rows in key order so that no two transactions lock them
//! crosswise), so that the admin's stats and audit read a few rows however many orders the
//! sale holds. The full recount counts them again from the rows (`Store::recount_paced`).

use std::collections::BTreeMap;

use sqlx::Row;

use super::{Dialect, Store, StoreError};
use crate::model::OrderStatus;

/// What one tally counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tally {
    /// Orders in this status (`queued` is never in SQL).
    Orders(OrderStatus),
    /// Payment intents in this status.
    Payments(PaymentStatus),
    /// Buyers holding exactly this many units in live orders (pending payment or paid).
    Holding(i64),
}

/// The states of a payment intent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum PaymentStatus {
    Created,
    Paid,
    Failed,
    Superseded,
    RefundDue,
}

impl PaymentStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            PaymentStatus::Created => "created",
            PaymentStatus::Paid => "paid",
            PaymentStatus::Failed => "failed",
            PaymentStatus::Superseded => "superseded",
            PaymentStatus::RefundDue => "refund_due",
        }
    }

    pub fn parse(s: &str) -> Option<PaymentStatus> {
        Some(match s {
            "created" => PaymentStatus::Created,
            "paid" => PaymentStatus::Paid,
            "failed" => PaymentStatus::Failed,
            "superseded" => PaymentStatus::Superseded,
            "refund_due" => PaymentStatus::RefundDue,
            _ => return None,
        })
    }
}

impl Tally {
    fn key(&self) -> String {
        match self {
            Tally::Orders(s) => format!("orders:{}", s.as_str()),
            Tally::Payments(s) => format!("payments:{}", s.as_str()),
            Tally::Holding(units) => format!("holding:{units}"),
        }
    }

    fn parse(key: &str) -> Option<Tally> {
        let (kind, value) = key.split_once(':')?;
        match kind {
            "orders" => OrderStatus::parse(value).map(Tally::Orders),
            "payments" => PaymentStatus::parse(value).map(Tally::Payments),
            "holding" => value.parse().ok().map(Tally::Holding),
            _ => None,
        }
    }
}

/// Changes to tallies, gathered over a transaction and written at its end in one statement.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tallies(BTreeMap<(i64, String), i64>);

impl Tallies {
    pub fn add(&mut self, sale_id: i64, tally: Tally, delta: i64) {
        if delta != 0 {
            *self.0.entry((sale_id, tally.key())).or_default() += delta;
        }
    }

    /// A buyer of the sale held `before` live units and holds `after` now.
    pub fn holding_moved(&mut self, sale_id: i64, before: i64, after: i64) {
        if before == after {
            return;
        }
        if before > 0 {
            self.add(sale_id, Tally::Holding(before), -1);
        }
        if after > 0 {
            self.add(sale_id, Tally::Holding(after), 1);
        }
    }

    /// An order of the sale moved from one status to another (`None`: it is new).
    pub fn order_moved(&mut self, sale_id: i64, from: Option<OrderStatus>, to: OrderStatus) {
        if let Some(from) = from {
            self.add(sale_id, Tally::Orders(from), -1);
        }
        self.add(sale_id, Tally::Orders(to), 1);
    }

    /// A payment intent of the sale moved from one status to another (`None`: it is new).
    pub fn payment_moved(&mut self, sale_id: i64, from: Option<PaymentStatus>, to: PaymentStatus) {
        if from == Some(to) {
            return;
        }
        if let Some(from) = from {
            self.add(sale_id, Tally::Payments(from), -1);
        }
        self.add(sale_id, Tally::Payments(to), 1);
    }

    fn changes(&self) -> impl Iterator<Item = (&(i64, String), &i64)> {
        self.0.iter().filter(|(_, delta)| **delta != 0)
    }
}

/// A sale's tallies as read.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SaleTallies(pub BTreeMap<Tally, i64>);

impl SaleTallies {
    pub fn get(&self, tally: Tally) -> i64 {
        self.0.get(&tally).copied().unwrap_or(0)
    }

    /// (status, orders) of the statuses that have any.
    pub fn orders(&self) -> BTreeMap<String, i64> {
        self.0
            .iter()
            .filter_map(|(t, n)| match t {
                Tally::Orders(s) if *n != 0 => Some((s.as_str().to_string(), *n)),
                _ => None,
            })
            .collect()
    }

    /// (status, intents) of the statuses that have any.
    pub fn payments(&self) -> BTreeMap<String, i64> {
        self.0
            .iter()
            .filter_map(|(t, n)| match t {
                Tally::Payments(s) if *n != 0 => Some((s.as_str().to_string(), *n)),
                _ => None,
            })
            .collect()
    }

    /// The most units any buyer holds in live orders (0 when nobody holds any).
    pub fn most_held(&self) -> i64 {
        self.0
            .iter()
            .filter_map(|(t, n)| match t {
                Tally::Holding(units) if *n > 0 => Some(*units),
                _ => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// Orders written, whatever their status.
    pub fn orders_written(&self) -> i64 {
        self.orders().values().sum()
    }

    /// Orders pending payment or paid.
    pub fn live_orders(&self) -> i64 {
        self.get(Tally::Orders(OrderStatus::PendingPayment))
            + self.get(Tally::Orders(OrderStatus::Paid))
    }

    /// The tallies that differ from `other`'s, as (key, this, other).
    pub fn differences(&self, other: &SaleTallies) -> Vec<(String, i64, i64)> {
        let keys: std::collections::BTreeSet<&Tally> =
            self.0.keys().chain(other.0.keys()).collect();
        keys.into_iter()
            .map(|t| (t.key(), self.get(*t), other.get(*t)))
            .filter(|(_, a, b)| a != b)
            .collect()
    }
}

impl Store {
    /// Applies `tallies` in the caller's transaction: one statement, rows in key order.
    pub(crate) async fn tally_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        tallies: &Tallies,
    ) -> Result<(), StoreError> {
        let changes: Vec<_> = tallies.changes().collect();
        if changes.is_empty() {
            return Ok(());
        }
        let values = vec!["(?, ?, ?)"; changes.len()].join(", ");
        let add = match self.dialect {
            Dialect::Sqlite => "ON CONFLICT (sale_id, tally) DO UPDATE SET n = n + excluded.n",
            Dialect::Postgres => {
                "ON CONFLICT (sale_id, tally) DO UPDATE SET n = sale_tallies.n + EXCLUDED.n"
            }
            Dialect::MySql => "ON DUPLICATE KEY UPDATE n = n + VALUES(n)",
        };
        let q = self.sql(&format!(
            "INSERT INTO sale_tallies (sale_id, tally, n) VALUES {values} {add}"
        ));
        // One statement shape per number of rows: not worth a prepared statement each.
        let mut query = sqlx::query(&q).persistent(false);
        for ((sale_id, key), delta) in changes {
            query = query.bind(*sale_id).bind(key.as_str()).bind(*delta);
        }
        query.execute(&mut *conn).await?;
        Ok(())
    }

    /// The sale's tallies: a few rows, whatever it holds.
    pub async fn tallies(&self, sale_id: i64) -> Result<SaleTallies, StoreError> {
        let mut conn = self.pool.acquire().await?;
        self.tallies_in(&mut conn, sale_id).await
    }

    pub(crate) async fn tallies_in(
        &self,
        conn: &mut sqlx::AnyConnection,
        sale_id: i64,
    ) -> Result<SaleTallies, StoreError> {
        // A tally once counted that went back to 0 is no tally.
        let q = "SELECT tally, n FROM sale_tallies WHERE sale_id = ? AND n <> 0";
        let rows = sqlx::query(&self.sql(q))
            .bind(sale_id)
            .fetch_all(&mut *conn)
            .await?;
        let mut out = BTreeMap::new();
        for r in &rows {
            let key: String = r.try_get(0)?;
            if let Some(tally) = Tally::parse(&key) {
                out.insert(tally, r.try_get::<i64, _>(1)?);
            }
        }
        Ok(SaleTallies(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_changes_net_out() {
        for t in [
            Tally::Orders(OrderStatus::PendingPayment),
            Tally::Payments(PaymentStatus::RefundDue),
            Tally::Holding(3),
        ] {
            assert_eq!(Tally::parse(&t.key()), Some(t));
        }
        let mut t = Tallies::default();
        t.order_moved(7, None, OrderStatus::PendingPayment);
        t.order_moved(7, Some(OrderStatus::PendingPayment), OrderStatus::Paid);
        t.holding_moved(7, 0, 1);
        t.holding_moved(7, 1, 2);
        t.holding_moved(7, 2, 2);
        let changes: Vec<_> = t.changes().map(|((s, k), d)| (*s, k.clone(), *d)).collect();
        assert_eq!(
            changes,
            [
                (7, "holding:2".to_string(), 1),
                (7, "orders:paid".to_string(), 1)
            ]
        );
    }
}
