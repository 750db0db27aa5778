//! A change committed to SQL that an answer or an acknowledgement depends on, as the
//! failover window keeps it (see `failover`): plain data, written as one line of text, and
//! applied again idempotently by the failover's replay. Owns the record's form; never
//! touches the database or the window itself.

use serde::{Deserialize, Serialize};

use crate::model::{NewOrder, Outcome, Sale};

/// A change committed to SQL, as it is kept in the window and applied again after a
/// failover. Each one applies idempotently: applied twice, or to a database that has it,
/// it changes nothing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "k", rename_all = "snake_case")]
pub enum Change {
    /// A writer's batch (written, or found written).
    Orders {
        #[serde(with = "packed_orders")]
        orders: Vec<NewOrder>,
    },
    /// An order moved out of `pending_payment` (a buyer's cancel).
    Transition {
        order: i64,
        owner: Option<i64>,
        outcome: Outcome,
        now: i64,
        detail: String,
    },
    /// A batch of unpaid orders expired.
    Expired {
        ids: Vec<i64>,
        now: i64,
    },
    PaymentOpened {
        intent: i64,
        order: i64,
        user: i64,
        amount_cents: i64,
        created_at: i64,
    },
    PaymentSettled {
        intent: i64,
        provider_ref: String,
        now: i64,
    },
    PaymentFailed {
        intent: i64,
        provider_ref: String,
        now: i64,
    },
    SaleCreated {
        sale: Sale,
    },
    DraftUpdated {
        sale: Sale,
    },
    DraftDeleted {
        id: i64,
    },
    SaleApproved {
        id: i64,
    },
    SalePaused {
        id: i64,
        paused: bool,
    },
    SaleEnded {
        id: i64,
        at: i64,
    },
    /// Users made by a sign-in or in bulk, as (id, phone).
    Users {
        users: Vec<(i64, String)>,
    },
    ApiKeyCreated {
        key: crate::model::ApiKeyRow,
    },
    ApiKeyRotated {
        id: i64,
        secret_sha256: String,
        now: i64,
    },
    ApiKeyRevoked {
        id: i64,
        now: i64,
    },
}

/// Orders as one text of `id:sale:user:quantity:price:accepted_at` records joined by `;`
/// (and `:key`, in hex, for an order bought with an `Idempotency-Key`): about 80 bytes an
/// order, where JSON objects take 130 (a window holds every order of its minutes).
mod packed_orders {
    use crate::model::{NewOrder, RetryKey};
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(orders: &[NewOrder], s: S) -> Result<S::Ok, S::Error> {
        let text: Vec<String> = orders
            .iter()
            .map(|o| {
                let record = format!(
                    "{}:{}:{}:{}:{}:{}",
                    o.id, o.sale_id, o.user_id, o.quantity, o.price_cents, o.accepted_at
                );
                match o.retry_key {
                    Some(key) => format!("{record}:{}", key.hex()),
                    None => record,
                }
            })
            .collect();
        s.serialize_str(&text.join(";"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<NewOrder>, D::Error> {
        let text = String::deserialize(d)?;
        text.split(';')
            .filter(|r| !r.is_empty())
            .map(|record| {
                let (record, retry_key) = match record.split(':').nth(6) {
                    Some(hex) => (
                        &record[..record.len() - hex.len() - 1],
                        Some(RetryKey::from_hex(hex).ok_or_else(|| {
                            serde::de::Error::custom("a retry key is 32 hex digits")
                        })?),
                    ),
                    None => (record, None),
                };
                let v: Vec<i64> = record
                    .split(':')
                    .map(str::parse)
                    .collect::<Result<_, _>>()
                    .map_err(serde::de::Error::custom)?;
                match v.as_slice() {
                    [id, sale_id, user_id, quantity, price_cents, accepted_at] => Ok(NewOrder {
                        id: *id,
                        sale_id: *sale_id,
                        user_id: *user_id,
                        quantity: *quantity,
                        price_cents: *price_cents,
                        accepted_at: *accepted_at,
                        retry_key,
                    }),
                    _ => Err(serde::de::Error::custom("an order has six values")),
                }
            })
            .collect()
    }
}

impl Change {
    pub fn encode(&self) -> String {
        // A change is plain data: serialising it cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn decode(text: &str) -> Result<Change, String> {
        serde_json::from_str(text).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_change_reads_back_as_written() {
        let order = |id| NewOrder {
            id,
            sale_id: 7,
            user_id: 100 + id,
            quantity: 2,
            price_cents: 999,
            accepted_at: 1_700_000_000_000,
            retry_key: None,
        };
        let changes = [
            Change::Orders {
                orders: vec![
                    order(1),
                    NewOrder {
                        retry_key: Some(crate::model::RetryKey(u128::MAX - 7)),
                        ..order(2)
                    },
                ],
            },
            Change::Transition {
                order: 1,
                owner: Some(101),
                outcome: Outcome::Cancelled,
                now: 5,
                detail: "cancelled by the buyer".into(),
            },
            Change::Expired {
                ids: vec![1, 2],
                now: 9,
            },
            Change::PaymentSettled {
                intent: 3,
                provider_ref: "ref;with:colons".into(),
                now: 4,
            },
            Change::Users {
                users: vec![(1, "+8613800000000".into())],
            },
            Change::ApiKeyCreated {
                key: crate::model::ApiKeyRow {
                    id: 5,
                    name: "sync".into(),
                    scopes: "sales:read sales:write".into(),
                    secret_sha256: "ab".repeat(32),
                    created_at: 1,
                    rotated_at: None,
                    last_used_at: Some(2),
                    revoked_at: None,
                },
            },
            Change::ApiKeyRotated {
                id: 5,
                secret_sha256: "cd".repeat(32),
                now: 3,
            },
            Change::ApiKeyRevoked { id: 5, now: 4 },
        ];
        for change in changes {
            let text = change.encode();
            assert_eq!(Change::decode(&text), Ok(change), "{text}");
        }
        assert!(Change::decode("{\"k\":\"orders\",\"orders\":\"1:2:3\"}").is_err());
        assert!(Change::decode("not json").is_err());
    }

    #[test]
    fn orders_are_kept_packed() {
        let orders: Vec<NewOrder> = (0..500)
            .map(|i| NewOrder {
                id: 7_400_000_000_000_000_000 + i,
                sale_id: 7_400_000_000_000_000_000,
                user_id: 7_400_000_000_000_000_000 + i,
                quantity: 1,
                price_cents: 100,
                accepted_at: 1_764_000_000_000,
                retry_key: None,
            })
            .collect();
        let objects = serde_json::to_string(&orders).unwrap().len();
        let text = Change::Orders { orders }.encode();
        assert!(
            text.len() * 10 < objects * 7,
            "{} bytes packed, {objects} as objects",
            text.len()
        );
    }
}
