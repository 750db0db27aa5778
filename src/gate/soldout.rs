//! The sold-out shortcut: once the gate says a sale is sold out, this instance answers
//! `sold_out` itself, without asking the gate again, until stock comes back. Stock comes
//! back by a release through this instance, a reload, or (distributed) a message on the
//! `{prefix}:stock-returned` channel that `release.lua` publishes to every instance.
//! A decorator at the gate seam, so every gate gets it. It must never answer `sold_out`
//! for stock that is back: a flag is only set if no return arrived since the call began.

use crate::metrics::render_counter;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;

use super::layer::Layer;

use crate::metrics::Counter;
use crate::model::BySale;

use super::{Gate, GateError, Purchase, Rejection, Release, Released, SaleLoad, Verdict};

/// Per sale: (returns seen << 1) | sold-out bit.
type Flag = Arc<AtomicU64>;

pub struct SoldOutShortcut {
    inner: Arc<dyn Gate>,
    /// Read by every purchase, written when a sale is first seen: readers take no lock.
    flags: ArcSwap<BySale<Flag>>,
    /// Purchases answered from the flag, without the gate.
    pub shortcuts: Counter,
}

impl SoldOutShortcut {
    /// Its series in Prometheus text.
    pub fn render(&self, out: &mut String) {
        render_counter(
            "seckill_sold_out_shortcuts_total",
            "Purchases answered sold_out from this instance's flag, without the gate.",
            self.shortcuts.get(),
            out,
        );
    }

    pub fn new(inner: Arc<dyn Gate>) -> Self {
        SoldOutShortcut {
            inner,
            flags: ArcSwap::default(),
            shortcuts: Counter::default(),
        }
    }

    fn flag(&self, sale_id: i64) -> Flag {
        if let Some(f) = self.flags.load().get(sale_id) {
            return f.clone();
        }
        // Concurrent first sights of a sale agree on one flag: rcu retries on a race, and
        // an entry already there is kept.
        self.flags.rcu(|flags| {
            let mut flags = BySale::clone(flags);
            flags.get_or_insert_with(sale_id, Flag::default);
            flags
        });
        self.flags.load().get(sale_id).cloned().unwrap_or_default()
    }

    /// Stock of this sale may be back: ask the gate again from now on.
    pub fn reopen(&self, sale_id: i64) {
        let flag = self.flag(sale_id);
        let _ = flag.fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
            Some(((s >> 1) + 1) << 1)
        });
    }

    /// Forget every flag (after missing messages, e.g. a lost subscription).
    pub fn reopen_all(&self) {
        let ids: Vec<i64> = self.flags.load().ids().collect();
        ids.into_iter().for_each(|id| self.reopen(id));
    }

    /// `sold_out` if this instance knows the sale is sold out. The edge asks this before
    /// it takes an order id or calls the gate: it is most of a storm's answers.
    pub fn answer(&self, sale_id: i64) -> Option<Verdict> {
        let flag = self.flags.load().get(sale_id)?.load(Ordering::Acquire);
        self.answer_from(flag)
    }

    fn answer_from(&self, flag: u64) -> Option<Verdict> {
        (flag & 1 == 1).then(|| {
            self.shortcuts.add(1);
            Verdict::Rejected(Rejection::SoldOut { remaining: 0 })
        })
    }
}

#[async_trait]
impl Layer for SoldOutShortcut {
    fn inner(&self) -> &dyn Gate {
        self.inner.as_ref()
    }

    async fn purchase(&self, p: Purchase) -> Result<Verdict, GateError> {
        let flag = self.flag(p.sale_id);
        let seen = flag.load(Ordering::Acquire);
        // A retry's record may name a unit bought before the sale sold out.
        if let Some(sold_out) = self.answer_from(seen).filter(|_| p.retry_key.is_none()) {
            return Ok(sold_out);
        }
        let verdict = self.inner.purchase(p).await?;
        if verdict == Verdict::Rejected(Rejection::SoldOut { remaining: 0 }) {
            // Fails (and leaves the sale open) if stock came back while the gate answered.
            let _ = flag.compare_exchange(seen, seen | 1, Ordering::AcqRel, Ordering::Acquire);
        }
        Ok(verdict)
    }

    async fn load(&self, load: &SaleLoad) -> Result<bool, GateError> {
        let loaded = self.inner.load(load).await?;
        if loaded {
            self.reopen(load.sale.id);
        }
        Ok(loaded)
    }

    async fn finish_load(
        &self,
        ticket: super::LoadTicket,
        load: &SaleLoad,
    ) -> Result<bool, GateError> {
        let loaded = self.inner.finish_load(ticket, load).await?;
        if loaded {
            self.reopen(load.sale.id);
        }
        Ok(loaded)
    }

    async fn give_for_move(&self, leg: super::MoveLeg) -> Result<super::MoveStep, GateError> {
        let given = self.inner.give_for_move(leg).await?;
        self.reopen(leg.sale_id);
        Ok(given)
    }

    async fn release(&self, r: Release) -> Result<Released, GateError> {
        let released = self.inner.release(r).await?;
        self.reopen(r.sale_id);
        Ok(released)
    }
}

/// Listens for stock returned on any instance and reopens the sale here. Reconnects after
/// a lost subscription (in a cluster, to another live node: PUBLISH reaches every node),
/// reopening everything since messages may have been missed.
pub async fn follow_stock_returns(
    client: crate::redis_client::RedisClient,
    mut conn: crate::redis_client::RedisConn,
    prefix: String,
    shortcut: Arc<SoldOutShortcut>,
) {
    use futures_util::StreamExt;
    let channel = crate::redis_client::keys::stock_channel(&prefix);
    let complaints = crate::logline::Every::new(30_000);
    loop {
        for node in client.subscription_nodes(&mut conn).await {
            let Ok(mut pubsub) = node.get_async_pubsub().await else {
                continue;
            };
            if pubsub.subscribe(&channel).await.is_err() {
                continue;
            }
            shortcut.reopen_all();
            let mut messages = pubsub.on_message();
            while let Some(msg) = messages.next().await {
                if let Ok(sale_id) = msg.get_payload::<i64>() {
                    shortcut.reopen(sale_id);
                }
            }
            tracing::warn!("stock-return subscription lost; subscribing again");
            break;
        }
        if complaints.ready().is_some() {
            tracing::warn!("cannot subscribe to stock returns on any Redis node yet; retrying");
        }
        shortcut.reopen_all();
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_return_during_the_gate_call_keeps_the_sale_open() {
        let flag = AtomicU64::new(0);
        let seen = flag.load(Ordering::Acquire);
        // A return arrives while the gate is answering sold_out...
        let _ = flag.fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
            Some(((s >> 1) + 1) << 1)
        });
        // ...so the sold_out answer must not set the flag.
        assert!(flag
            .compare_exchange(seen, seen | 1, Ordering::AcqRel, Ordering::Acquire)
            .is_err());
        assert_eq!(flag.load(Ordering::Acquire) & 1, 0);
    }
}
