//! Domain types shared by every part of the flow: sales, orders, their states.
//! Pure data: nothing here does I/O.

pub mod segments;

use serde::Serialize;

/// A sale as the gate and the edge need it: its window, limits and price.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Sale {
    pub id: i64,
    pub title: String,
    pub price_cents: i64,
    pub initial_stock: i64,
    /// Remaining stock as the SQL database knows it (lags the gate until the log drains).
    pub stock: i64,
    pub per_user_limit: i64,
    pub begins_at: i64,
    pub ends_at: i64,
    pub payment_window_secs: i64,
    pub approved: bool,
    pub paused: bool,
    pub updated_at: i64,
    pub anti_bot: AntiBot,
    /// Parts the gate keeps the stock in, each on its own Redis slot (1: one part); see
    /// `segments`. Fixed once the sale is approved.
    pub segments: i64,
    /// The queue buyers wait in before they may buy (see `room`); `None`: buyers go
    /// straight to the purchase.
    pub waiting_room: Option<WaitingRoom>,
    /// The shop's own reference for the sale (its SKU or campaign id), unique; `None`: none.
    #[serde(default)]
    pub external_ref: Option<String>,
}

/// A sale's waiting room: buyers are let through `admit_per_sec` a second from the
/// opening, and may join `prequeue_secs` before it (those are placed by lottery).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct WaitingRoom {
    pub admit_per_sec: i64,
    pub prequeue_secs: i64,
}

impl WaitingRoom {
    /// Joining opens this long before the sale when the seller does not say.
    pub const DEFAULT_PREQUEUE_SECS: i64 = 600;
    pub const MAX_ADMIT_PER_SEC: i64 = 1_000_000;
    pub const MAX_PREQUEUE_SECS: i64 = 7 * 86_400;

    /// When buyers may start joining the room of a sale opening at `begins_at`.
    pub fn opens_at(&self, begins_at: i64) -> i64 {
        begins_at - self.prequeue_secs * 1000
    }
}

/// What a sale asks of a buyer before the purchase call, against scripts.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, serde::Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum AntiBot {
    /// Purchases need nothing but the login token.
    #[default]
    Off,
    /// Each purchase spends a single-use purchase token (`GET /api/sales/{id}/token`).
    Token,
    /// As `Token`, and the purchase token is only issued for a solved captcha.
    Captcha,
}

impl AntiBot {
    pub fn as_str(self) -> &'static str {
        match self {
            AntiBot::Off => "off",
            AntiBot::Token => "token",
            AntiBot::Captcha => "captcha",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "off" => AntiBot::Off,
            "token" => AntiBot::Token,
            "captcha" => AntiBot::Captcha,
            _ => return None,
        })
    }
}

/// The public phase of a sale, as `GET /api/sales/{id}/stock` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SaleState {
    Upcoming,
    Active,
    SoldOut,
    Ended,
    Paused,
}

impl Sale {
    pub fn state_at(&self, now_ms: i64, remaining: i64) -> SaleState {
        if now_ms >= self.ends_at {
            SaleState::Ended
        } else if self.paused {
            SaleState::Paused
        } else if now_ms < self.begins_at {
            SaleState::Upcoming
        } else if remaining <= 0 {
            SaleState::SoldOut
        } else {
            SaleState::Active
        }
    }
}

/// Where an order may go from `pending_payment`: one of them wins (see
/// `store::transitions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub enum Outcome {
    Paid,
    Cancelled,
    Expired,
}

impl Outcome {
    pub fn status(self) -> OrderStatus {
        match self {
            Outcome::Paid => OrderStatus::Paid,
            Outcome::Cancelled => OrderStatus::Cancelled,
            Outcome::Expired => OrderStatus::Expired,
        }
    }

    /// Whether the order's units go back to the stock.
    pub fn returns_stock(self) -> bool {
        self != Outcome::Paid
    }
}

/// An order the gate accepted, as it travels through the order log to the writer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct NewOrder {
    pub id: i64,
    pub sale_id: i64,
    pub user_id: i64,
    pub quantity: i64,
    pub price_cents: i64,
    pub accepted_at: i64,
    /// The buyer's `Idempotency-Key` of the purchase, carried to SQL where the gate's own
    /// record of it does not survive a restart (the embedded deployment).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_key: Option<RetryKey>,
}

/// A purchase made with an `Idempotency-Key`, as SQL keeps it for a gate that rebuilds its
/// records at start-up (the memory gate).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptPurchase {
    pub sale_id: i64,
    pub user_id: i64,
    pub key: RetryKey,
    pub order_id: i64,
    pub quantity: i64,
    /// When it was bought (Unix ms): its record answers until a day after.
    pub at: i64,
}

/// How long a purchase's `Idempotency-Key` answers its retries (a day).
pub const RETRY_KEY_MS: i64 = 86_400_000;

/// A buyer's `Idempotency-Key`, as the gate keeps it: 128 bits of its SHA-256, scoped by
/// the buyer and the sale. A purchase made with one is recorded for [`RETRY_KEY_MS`]; an
/// attempt with the same key is answered from the record (`Verdict::Again`, or
/// `Rejection::RetryKeyReused` for another quantity) and takes nothing. A refusal records
/// nothing: it changed nothing, so its retry is decided again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RetryKey(pub u128);

impl RetryKey {
    pub fn of(key: &str) -> RetryKey {
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(key.as_bytes());
        let mut first = [0u8; 16];
        first.copy_from_slice(&digest[..16]);
        RetryKey(u128::from_be_bytes(first))
    }

    /// As SQL keeps it, in the purchase's idempotency record and a kept change.
    pub fn hex(self) -> String {
        format!("{:032x}", self.0)
    }

    pub fn from_hex(text: &str) -> Option<RetryKey> {
        if text.len() != 32 {
            return None;
        }
        u128::from_str_radix(text, 16).ok().map(RetryKey)
    }
}

impl Serialize for RetryKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.hex())
    }
}

impl<'de> serde::Deserialize<'de> for RetryKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = <String as serde::Deserialize>::deserialize(d)?;
        RetryKey::from_hex(&text)
            .ok_or_else(|| serde::de::Error::custom("a retry key is 32 hex digits"))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OrderStatus {
    /// Accepted by the gate, not yet written to SQL.
    Queued,
    PendingPayment,
    Paid,
    Cancelled,
    Expired,
}

impl OrderStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            OrderStatus::Queued => "queued",
            OrderStatus::PendingPayment => "pending_payment",
            OrderStatus::Paid => "paid",
            OrderStatus::Cancelled => "cancelled",
            OrderStatus::Expired => "expired",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "queued" => OrderStatus::Queued,
            "pending_payment" => OrderStatus::PendingPayment,
            "paid" => OrderStatus::Paid,
            "cancelled" => OrderStatus::Cancelled,
            "expired" => OrderStatus::Expired,
            _ => return None,
        })
    }

    /// Whether an order may move from this state to `next`: only forward (queued, then
    /// pending payment, then exactly one of paid, cancelled, expired).
    pub fn may_become(self, next: OrderStatus) -> bool {
        use OrderStatus::*;
        matches!(
            (self, next),
            (Queued, PendingPayment) | (PendingPayment, Paid | Cancelled | Expired)
        )
    }

    /// Live orders hold stock; cancelled and expired ones gave it back.
    pub const LIVE: [&'static str; 2] = ["pending_payment", "paid"];
}

/// An order as stored in SQL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Order {
    pub id: i64,
    pub sale_id: i64,
    pub user_id: i64,
    pub quantity: i64,
    pub price_cents: i64,
    pub status: OrderStatus,
    pub accepted_at: i64,
    pub pay_deadline: i64,
    /// When the writer put it in SQL: the step from `queued` to `pending_payment`.
    pub written_at: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sale() -> Sale {
        Sale {
            id: 1,
            title: "t".into(),
            price_cents: 100,
            initial_stock: 10,
            stock: 10,
            per_user_limit: 1,
            begins_at: 1000,
            ends_at: 2000,
            payment_window_secs: 900,
            approved: true,
            paused: false,
            updated_at: 0,
            anti_bot: AntiBot::Off,
            segments: 1,
            waiting_room: None,
            external_ref: None,
        }
    }

    #[test]
    fn state_follows_window_then_pause_then_stock() {
        let mut s = sale();
        assert_eq!(s.state_at(999, 5), SaleState::Upcoming);
        assert_eq!(s.state_at(1000, 5), SaleState::Active);
        assert_eq!(s.state_at(1500, 0), SaleState::SoldOut);
        assert_eq!(s.state_at(2000, 5), SaleState::Ended);
        s.paused = true;
        assert_eq!(s.state_at(1500, 5), SaleState::Paused);
        assert_eq!(s.state_at(2000, 5), SaleState::Ended);
    }

    #[test]
    fn status_names_round_trip() {
        for s in [
            OrderStatus::Queued,
            OrderStatus::PendingPayment,
            OrderStatus::Paid,
            OrderStatus::Cancelled,
            OrderStatus::Expired,
        ] {
            assert_eq!(OrderStatus::parse(s.as_str()), Some(s));
        }
        assert_eq!(OrderStatus::parse("bogus"), None);
    }
}

/// A map from sale id to `T` for the lookups every purchase makes: a vector sorted by id,
/// searched by bisection. There are a few dozen live sales at most, and hashing an id with
/// the standard library's SipHash cost more than the rest of the lookup.
#[derive(Debug, Clone)]
pub struct BySale<T>(Vec<(i64, T)>);

impl<T> Default for BySale<T> {
    fn default() -> Self {
        BySale(Vec::new())
    }
}

impl<T> BySale<T> {
    pub fn get(&self, sale_id: i64) -> Option<&T> {
        let i = self.0.binary_search_by_key(&sale_id, |(id, _)| *id).ok()?;
        Some(&self.0[i].1)
    }

    /// The entry of `sale_id`, made by `make` if missing.
    pub fn get_or_insert_with(&mut self, sale_id: i64, make: impl FnOnce() -> T) -> &mut T {
        let i = match self.0.binary_search_by_key(&sale_id, |(id, _)| *id) {
            Ok(i) => i,
            Err(i) => {
                self.0.insert(i, (sale_id, make()));
                i
            }
        };
        &mut self.0[i].1
    }

    pub fn ids(&self) -> impl Iterator<Item = i64> + '_ {
        self.0.iter().map(|(id, _)| *id)
    }

    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.0.iter().map(|(_, v)| v)
    }
}

impl<T> FromIterator<(i64, T)> for BySale<T> {
    fn from_iter<I: IntoIterator<Item = (i64, T)>>(entries: I) -> Self {
        let mut v: Vec<(i64, T)> = entries.into_iter().collect();
        v.sort_by_key(|(id, _)| *id);
        // One entry per id, the last one given, as a map built from them would hold.
        v.reverse();
        v.dedup_by_key(|(id, _)| *id);
        v.reverse();
        BySale(v)
    }
}

#[cfg(test)]
mod by_sale_tests {
    use super::BySale;

    #[test]
    fn finds_what_was_put_and_nothing_else() {
        let mut m: BySale<&str> = [(30, "c"), (10, "a"), (20, "b"), (10, "a2")]
            .into_iter()
            .collect();
        assert_eq!(m.get(10), Some(&"a2"), "the last entry of an id wins");
        assert_eq!(m.get(20), Some(&"b"));
        assert_eq!(m.get(30), Some(&"c"));
        assert_eq!(m.get(15), None);
        assert_eq!(m.ids().collect::<Vec<_>>(), [10, 20, 30]);
        *m.get_or_insert_with(15, || "x") = "y";
        assert_eq!(
            *m.get_or_insert_with(15, || "z"),
            "y",
            "kept, not made again"
        );
        assert_eq!(m.ids().collect::<Vec<_>>(), [10, 15, 20, 30]);
        assert_eq!(BySale::<u8>::default().get(1), None);
    }
}

/// An admin API key as stored (see `edge::auth::keys`): never its secret, only the hash.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ApiKeyRow {
    pub id: i64,
    pub name: String,
    /// Space-separated, as the edge wrote them.
    pub scopes: String,
    pub secret_sha256: String,
    pub created_at: i64,
    pub rotated_at: Option<i64>,
    pub last_used_at: Option<i64>,
    pub revoked_at: Option<i64>,
}
