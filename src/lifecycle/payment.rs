//! Payments through a provider. A buyer's `/pay` opens an intent and is shown where to pay
//! it; only the provider's callback, `POST /api/payments/notify` signed with the secret
//! seckill shares with it (HMAC-SHA256 over `"{timestamp}.{raw body}"` in
//! `X-Seckill-Signature`, the timestamp in `X-Seckill-Timestamp`), marks it paid.
//! Verification refuses bad signatures and stale timestamps.
//!
//! Two providers: `RedirectProvider`, a real provider's hosted pay page, and
//! `SimulatedProvider`, which lets the whole flow run on one machine: its pay page has the
//! server sign and deliver a callback to itself, so anyone may mark their own order paid.
//! It runs only in dev mode or when chosen by name (`--payment-provider simulated`).

use std::net::SocketAddr;
use std::time::Duration;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

type HmacSha256 = Hmac<Sha256>;

pub const TIMESTAMP_HEADER: &str = "x-seckill-timestamp";
pub const SIGNATURE_HEADER: &str = "x-seckill-signature";
/// Notifications older (or newer) than this are refused, so a captured one cannot be replayed later.
pub const MAX_SKEW_SECS: i64 = 300;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NotifyError {
    #[error("missing or malformed signature headers")]
    MissingHeaders,
    #[error("the notification timestamp is too old or in the future")]
    Stale,
    #[error("the signature does not match")]
    BadSignature,
    #[error("the notification body is not valid: {0}")]
    BadBody(String),
}

/// What the provider tells us about an intent.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Notification {
    pub intent_id: String,
    pub status: NotifiedStatus,
    /// The provider's own reference of the payment (64 characters at most).
    #[serde(default)]
    #[schema(max_length = 64)]
    pub provider_ref: String,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum NotifiedStatus {
    Paid,
    Failed,
}

/// What a client shows the buyer to pay.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct IntentView {
    pub intent_id: String,
    pub order_id: String,
    pub amount_cents: i64,
    pub pay_url: String,
    pub qr_payload: String,
    pub expires_at: String,
}

/// The intent a buyer is to pay, as a provider is told of it.
pub struct Intent<'a> {
    pub intent_id: i64,
    pub order_id: i64,
    pub amount_cents: i64,
    /// RFC 3339: the order's payment deadline.
    pub expires_at: &'a str,
}

/// Where a buyer pays an intent: a page to open, and the same for a QR code.
pub struct PayAt {
    pub pay_url: String,
    pub qr_payload: String,
}

/// What seckill needs of a payment provider: where a buyer pays, and the secret that
/// signs the provider's callbacks.
pub trait PaymentProvider: Send + Sync {
    fn pay_at(&self, intent: &Intent) -> PayAt;

    fn signer(&self) -> &CallbackSigner;

    /// What the buyer's client shows to pay an intent.
    fn intent_view(&self, intent: &Intent) -> IntentView {
        let PayAt {
            pay_url,
            qr_payload,
        } = self.pay_at(intent);
        IntentView {
            intent_id: intent.intent_id.to_string(),
            order_id: intent.order_id.to_string(),
            amount_cents: intent.amount_cents,
            pay_url,
            qr_payload,
            expires_at: intent.expires_at.to_string(),
        }
    }

    /// Reads a callback, refusing it unless it is signed and fresh.
    fn verify(
        &self,
        timestamp: Option<&str>,
        signature: Option<&str>,
        body: &[u8],
        now_secs: i64,
    ) -> Result<Notification, NotifyError> {
        self.signer().verify(timestamp, signature, body, now_secs)
    }
}

/// The secret shared with a provider: signs and checks its callbacks.
#[derive(Clone)]
pub struct CallbackSigner {
    secret: Vec<u8>,
}

impl CallbackSigner {
    pub fn new(secret: &str) -> Self {
        CallbackSigner {
            secret: secret.as_bytes().to_vec(),
        }
    }

    fn mac(&self, timestamp: i64, body: &[u8]) -> HmacSha256 {
        let mut mac =
            <HmacSha256 as Mac>::new_from_slice(&self.secret).unwrap_or_else(|_| unreachable!());
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        mac
    }

    pub fn sign(&self, timestamp: i64, body: &[u8]) -> String {
        crate::text::hex(&self.mac(timestamp, body).finalize().into_bytes())
    }

    /// Checks a callback's signature and age, then reads it.
    pub fn verify(
        &self,
        timestamp: Option<&str>,
        signature: Option<&str>,
        body: &[u8],
        now_secs: i64,
    ) -> Result<Notification, NotifyError> {
        let ts: i64 = timestamp
            .and_then(|t| t.trim().parse().ok())
            .ok_or(NotifyError::MissingHeaders)?;
        let sig = signature
            .and_then(|s| unhex(s.trim()))
            .ok_or(NotifyError::MissingHeaders)?;
        // The timestamp is the caller's: any i64, so no subtraction that could overflow.
        if now_secs.abs_diff(ts) > MAX_SKEW_SECS as u64 {
            return Err(NotifyError::Stale);
        }
        self.mac(ts, body)
            .verify_slice(&sig)
            .map_err(|_| NotifyError::BadSignature)?;
        if !crate::is_json_object(body) {
            return Err(NotifyError::BadBody(
                "the body must be a JSON object".into(),
            ));
        }
        serde_json::from_slice(body).map_err(|e| NotifyError::BadBody(e.to_string()))
    }
}

/// A real provider with a hosted pay page: the buyer is sent to `url_template` with the
/// intent filled in, pays there, and the provider calls back, signed.
pub struct RedirectProvider {
    signer: CallbackSigner,
    url_template: String,
}

impl RedirectProvider {
    /// `url_template` may hold `{intent_id}`, `{order_id}`, `{amount_cents}` and
    /// `{expires_at}`.
    pub fn new(url_template: &str, secret: &str) -> Self {
        RedirectProvider {
            signer: CallbackSigner::new(secret),
            url_template: url_template.to_string(),
        }
    }
}

impl PaymentProvider for RedirectProvider {
    fn pay_at(&self, intent: &Intent) -> PayAt {
        let url = self
            .url_template
            .replace("{intent_id}", &intent.intent_id.to_string())
            .replace("{order_id}", &intent.order_id.to_string())
            .replace("{amount_cents}", &intent.amount_cents.to_string())
            .replace("{expires_at}", intent.expires_at);
        PayAt {
            qr_payload: url.clone(),
            pay_url: url,
        }
    }

    fn signer(&self) -> &CallbackSigner {
        &self.signer
    }
}

impl PaymentProvider for SimulatedProvider {
    fn pay_at(&self, intent: &Intent) -> PayAt {
        let (id, amount) = (intent.intent_id, intent.amount_cents);
        PayAt {
            pay_url: format!("/simulated-pay/{id}"),
            qr_payload: format!("seckill-sim://pay?intent={id}&amount={amount}"),
        }
    }

    fn signer(&self) -> &CallbackSigner {
        &self.signer
    }
}

/// The built-in provider for trials: its pay page's buttons have this server sign and
/// deliver the callback a provider would. Whoever can open the page can pay for nothing.
#[derive(Clone)]
pub struct SimulatedProvider {
    signer: CallbackSigner,
}

impl SimulatedProvider {
    pub fn new(secret: &str) -> Self {
        SimulatedProvider {
            signer: CallbackSigner::new(secret),
        }
    }

    pub fn sign(&self, timestamp: i64, body: &[u8]) -> String {
        self.signer.sign(timestamp, body)
    }

    /// Delivers a signed notification to a seckill server, as the provider would.
    pub async fn deliver(&self, target: SocketAddr, n: &Notification) -> std::io::Result<u16> {
        let body = serde_json::to_vec(n).map_err(std::io::Error::other)?;
        let ts = crate::clock::wall_ms() / 1000;
        let request = format!(
            "POST /api/payments/notify HTTP/1.1\r\nHost: {target}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n{TIMESTAMP_HEADER}: {ts}\r\n{SIGNATURE_HEADER}: {}\r\nConnection: close\r\n\r\n",
            body.len(),
            self.sign(ts, &body)
        );
        let mut stream = tokio::time::timeout(
            Duration::from_secs(5),
            tokio::net::TcpStream::connect(target),
        )
        .await??;
        stream.write_all(request.as_bytes()).await?;
        stream.write_all(&body).await?;
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await??;
        let status = String::from_utf8_lossy(&answer)
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        Ok(status)
    }
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.is_ascii() {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::PaymentProvider as _;
    use super::*;

    #[test]
    fn signatures_bind_body_and_time() {
        let p = SimulatedProvider::new("k");
        let body = br#"{"intent_id":"5","status":"paid"}"#;
        let sig = p.sign(1000, body);
        let ok = p.verify(Some("1000"), Some(&sig), body, 1010).unwrap();
        assert_eq!(ok.status, NotifiedStatus::Paid);
        assert_eq!(
            p.verify(Some("1000"), Some(&sig), body, 1000 + MAX_SKEW_SECS + 1),
            Err(NotifyError::Stale)
        );
        assert_eq!(
            p.verify(Some("1001"), Some(&sig), body, 1001),
            Err(NotifyError::BadSignature)
        );
        let other = br#"{"intent_id":"6","status":"paid"}"#;
        assert_eq!(
            p.verify(Some("1000"), Some(&sig), other, 1000),
            Err(NotifyError::BadSignature)
        );
        assert_eq!(
            SimulatedProvider::new("x").verify(Some("1000"), Some(&sig), body, 1000),
            Err(NotifyError::BadSignature)
        );
        assert_eq!(
            p.verify(None, Some(&sig), body, 1000),
            Err(NotifyError::MissingHeaders)
        );
        assert_eq!(
            p.verify(Some("1000"), Some("zz"), body, 1000),
            Err(NotifyError::MissingHeaders)
        );
    }

    #[test]
    fn a_timestamp_at_the_ends_of_i64_is_stale_not_a_panic() {
        let p = SimulatedProvider::new("k");
        let body = br#"{"intent_id":"5","status":"paid"}"#;
        for ts in [i64::MIN, i64::MIN + 1, i64::MAX] {
            let (t, sig) = (ts.to_string(), p.sign(ts, body));
            for now in [0, 1_700_000_000, -1_700_000_000] {
                assert_eq!(
                    p.verify(Some(&t), Some(&sig), body, now),
                    Err(NotifyError::Stale),
                    "ts {ts}, now {now}"
                );
            }
            assert!(
                p.verify(Some(&t), Some(&sig), body, ts).is_ok(),
                "signed and on time, however odd the clock"
            );
        }
    }

    #[test]
    fn a_real_provider_fills_its_pay_page_and_checks_its_callbacks() {
        let p = RedirectProvider::new(
            "https://pay.example/checkout?ref={intent_id}&order={order_id}&amount={amount_cents}",
            "shared",
        );
        let v = p.intent_view(&Intent {
            intent_id: 7,
            order_id: 8,
            amount_cents: 999,
            expires_at: "2026-01-01T00:00:00Z",
        });
        assert_eq!(
            v.pay_url,
            "https://pay.example/checkout?ref=7&order=8&amount=999"
        );
        let body = br#"{"intent_id":"7","status":"paid"}"#;
        let signed = CallbackSigner::new("shared").sign(1000, body);
        assert!(p.verify(Some("1000"), Some(&signed), body, 1000).is_ok());
        let forged = CallbackSigner::new("guess").sign(1000, body);
        assert_eq!(
            p.verify(Some("1000"), Some(&forged), body, 1000),
            Err(NotifyError::BadSignature)
        );
    }
}
