//! Gates wrapped around another gate (the circuit breaker, the sold-out shortcut, the
//! mover between segments): a `Layer` names its inner gate and overrides only the calls it
//! changes; every other call goes through to the inner gate. `Gate` is implemented once,
//! here, for every layer, so a method added to `Gate` is forwarded by every layer or the
//! crate does not build (a default method would otherwise be answered by `Gate`'s default,
//! silently skipping the gate underneath); a test below checks the two lists match.

use async_trait::async_trait;

use super::{
    Gate, GateError, GateStock, LoadStart, LoadTicket, MoveLeg, MoveStep, Purchase, Release,
    Released, SaleLoad, SegmentCheck, Spend, Verdict,
};
use crate::model::{KeptPurchase, NewOrder};

/// A gate around `inner()`: each method forwards to it unless the layer overrides it.
#[async_trait]
pub trait Layer: Send + Sync {
    fn inner(&self) -> &dyn Gate;

    async fn purchase(&self, p: Purchase) -> Result<Verdict, GateError> {
        self.inner().purchase(p).await
    }

    async fn load(&self, load: &SaleLoad) -> Result<bool, GateError> {
        self.inner().load(load).await
    }

    async fn begin_load(&self, sale_id: i64) -> Result<LoadStart, GateError> {
        self.inner().begin_load(sale_id).await
    }

    async fn begin_segment_load(&self, sale_id: i64, segment: i64) -> Result<LoadStart, GateError> {
        self.inner().begin_segment_load(sale_id, segment).await
    }

    async fn finish_load(&self, ticket: LoadTicket, load: &SaleLoad) -> Result<bool, GateError> {
        self.inner().finish_load(ticket, load).await
    }

    async fn stage_buyers(
        &self,
        ticket: &LoadTicket,
        segments: i64,
        buyers: &[(i64, i64)],
    ) -> Result<bool, GateError> {
        self.inner().stage_buyers(ticket, segments, buyers).await
    }

    async fn abandon_load(&self, ticket: LoadTicket) {
        self.inner().abandon_load(ticket).await
    }

    async fn forget_if_stale(&self, sale_id: i64) -> Result<bool, GateError> {
        self.inner().forget_if_stale(sale_id).await
    }

    async fn holders(
        &self,
        sale_id: i64,
        cap: usize,
    ) -> Result<Option<Vec<(i64, i64)>>, GateError> {
        self.inner().holders(sale_id, cap).await
    }

    async fn forget_segment_for_repair(&self, sale_id: i64, segment: i64) -> Result<(), GateError> {
        self.inner()
            .forget_segment_for_repair(sale_id, segment)
            .await
    }

    async fn forget_segment_if_stale(&self, sale_id: i64, segment: i64) -> Result<bool, GateError> {
        self.inner().forget_segment_if_stale(sale_id, segment).await
    }

    async fn check_segments(&self, parts: &[(i64, i64)]) -> Vec<Result<SegmentCheck, GateError>> {
        self.inner().check_segments(parts).await
    }

    fn know_segments(&self, sales: &[(i64, i64)]) {
        self.inner().know_segments(sales)
    }

    fn keeps_order_ids(&self) -> bool {
        self.inner().keeps_order_ids()
    }

    fn forget_ended(&self, before: i64) {
        self.inner().forget_ended(before)
    }

    async fn segment_stocks(
        &self,
        sale_id: i64,
        segments: i64,
    ) -> Result<Vec<Option<i64>>, GateError> {
        self.inner().segment_stocks(sale_id, segments).await
    }

    async fn take_for_move(&self, leg: MoveLeg) -> Result<MoveStep, GateError> {
        self.inner().take_for_move(leg).await
    }

    async fn give_for_move(&self, leg: MoveLeg) -> Result<MoveStep, GateError> {
        self.inner().give_for_move(leg).await
    }

    async fn confirm_written(&self, orders: &[NewOrder]) -> Result<(), GateError> {
        self.inner().confirm_written(orders).await
    }

    async fn restore_retries(&self, kept: &[KeptPurchase]) -> usize {
        self.inner().restore_retries(kept).await
    }

    async fn is_loaded(&self, sale_id: i64) -> Result<bool, GateError> {
        self.inner().is_loaded(sale_id).await
    }

    async fn are_loaded(&self, sale_ids: &[i64]) -> Vec<Result<bool, GateError>> {
        self.inner().are_loaded(sale_ids).await
    }

    async fn stock(&self, sale_id: i64) -> Result<Option<GateStock>, GateError> {
        self.inner().stock(sale_id).await
    }

    async fn stocks(&self, sale_ids: &[i64]) -> Vec<Result<Option<GateStock>, GateError>> {
        self.inner().stocks(sale_ids).await
    }

    async fn release(&self, r: Release) -> Result<Released, GateError> {
        self.inner().release(r).await
    }

    async fn set_paused(&self, sale_id: i64, paused: bool) -> Result<(), GateError> {
        self.inner().set_paused(sale_id, paused).await
    }

    async fn end_early(&self, sale_id: i64, at: i64) -> Result<(), GateError> {
        self.inner().end_early(sale_id, at).await
    }

    async fn spend(&self, sale_id: i64, spend: Spend) -> Result<bool, GateError> {
        self.inner().spend(sale_id, spend).await
    }

    async fn queued_order(
        &self,
        sale_id: i64,
        order_id: i64,
    ) -> Result<Option<(i64, i64)>, GateError> {
        self.inner().queued_order(sale_id, order_id).await
    }
}

#[async_trait]
impl<T: Layer> Gate for T {
    async fn purchase(&self, p: Purchase) -> Result<Verdict, GateError> {
        Layer::purchase(self, p).await
    }

    async fn load(&self, load: &SaleLoad) -> Result<bool, GateError> {
        Layer::load(self, load).await
    }

    async fn begin_load(&self, sale_id: i64) -> Result<LoadStart, GateError> {
        Layer::begin_load(self, sale_id).await
    }

    async fn begin_segment_load(&self, sale_id: i64, segment: i64) -> Result<LoadStart, GateError> {
        Layer::begin_segment_load(self, sale_id, segment).await
    }

    async fn finish_load(&self, ticket: LoadTicket, load: &SaleLoad) -> Result<bool, GateError> {
        Layer::finish_load(self, ticket, load).await
    }

    async fn stage_buyers(
        &self,
        ticket: &LoadTicket,
        segments: i64,
        buyers: &[(i64, i64)],
    ) -> Result<bool, GateError> {
        Layer::stage_buyers(self, ticket, segments, buyers).await
    }

    async fn abandon_load(&self, ticket: LoadTicket) {
        Layer::abandon_load(self, ticket).await
    }

    async fn forget_if_stale(&self, sale_id: i64) -> Result<bool, GateError> {
        Layer::forget_if_stale(self, sale_id).await
    }

    async fn holders(
        &self,
        sale_id: i64,
        cap: usize,
    ) -> Result<Option<Vec<(i64, i64)>>, GateError> {
        Layer::holders(self, sale_id, cap).await
    }

    async fn forget_segment_for_repair(&self, sale_id: i64, segment: i64) -> Result<(), GateError> {
        Layer::forget_segment_for_repair(self, sale_id, segment).await
    }

    async fn forget_segment_if_stale(&self, sale_id: i64, segment: i64) -> Result<bool, GateError> {
        Layer::forget_segment_if_stale(self, sale_id, segment).await
    }

    async fn check_segments(&self, parts: &[(i64, i64)]) -> Vec<Result<SegmentCheck, GateError>> {
        Layer::check_segments(self, parts).await
    }

    fn know_segments(&self, sales: &[(i64, i64)]) {
        Layer::know_segments(self, sales)
    }

    fn keeps_order_ids(&self) -> bool {
        Layer::keeps_order_ids(self)
    }

    fn forget_ended(&self, before: i64) {
        Layer::forget_ended(self, before)
    }

    async fn segment_stocks(
        &self,
        sale_id: i64,
        segments: i64,
    ) -> Result<Vec<Option<i64>>, GateError> {
        Layer::segment_stocks(self, sale_id, segments).await
    }

    async fn take_for_move(&self, leg: MoveLeg) -> Result<MoveStep, GateError> {
        Layer::take_for_move(self, leg).await
    }

    async fn give_for_move(&self, leg: MoveLeg) -> Result<MoveStep, GateError> {
        Layer::give_for_move(self, leg).await
    }

    async fn confirm_written(&self, orders: &[NewOrder]) -> Result<(), GateError> {
        Layer::confirm_written(self, orders).await
    }

    async fn restore_retries(&self, kept: &[KeptPurchase]) -> usize {
        Layer::restore_retries(self, kept).await
    }

    async fn is_loaded(&self, sale_id: i64) -> Result<bool, GateError> {
        Layer::is_loaded(self, sale_id).await
    }

    async fn are_loaded(&self, sale_ids: &[i64]) -> Vec<Result<bool, GateError>> {
        Layer::are_loaded(self, sale_ids).await
    }

    async fn stock(&self, sale_id: i64) -> Result<Option<GateStock>, GateError> {
        Layer::stock(self, sale_id).await
    }

    async fn stocks(&self, sale_ids: &[i64]) -> Vec<Result<Option<GateStock>, GateError>> {
        Layer::stocks(self, sale_ids).await
    }

    async fn release(&self, r: Release) -> Result<Released, GateError> {
        Layer::release(self, r).await
    }

    async fn set_paused(&self, sale_id: i64, paused: bool) -> Result<(), GateError> {
        Layer::set_paused(self, sale_id, paused).await
    }

    async fn end_early(&self, sale_id: i64, at: i64) -> Result<(), GateError> {
        Layer::end_early(self, sale_id, at).await
    }

    async fn spend(&self, sale_id: i64, spend: Spend) -> Result<bool, GateError> {
        Layer::spend(self, sale_id, spend).await
    }

    async fn queued_order(
        &self,
        sale_id: i64,
        order_id: i64,
    ) -> Result<Option<(i64, i64)>, GateError> {
        Layer::queued_order(self, sale_id, order_id).await
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    /// The names of the `fn`s in the block of `text` that starts with `opening`.
    fn methods(text: &str, opening: &str) -> BTreeSet<String> {
        let start = text.find(opening).expect("the block");
        let mut depth = 0;
        let mut end = start;
        for (i, c) in text[start..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = start + i;
                        break;
                    }
                }
                _ => {}
            }
        }
        text[start..end]
            .split("fn ")
            .skip(1)
            .filter_map(|rest| rest.split(['(', '<']).next())
            .map(|name| name.trim().to_string())
            .collect()
    }

    /// Every method of `Gate` is forwarded by every layer: a new one must be added here.
    #[test]
    fn every_gate_method_goes_through_every_layer() {
        let gate = methods(include_str!("mod.rs"), "pub trait Gate: Send + Sync {");
        let forwarded = methods(include_str!("layer.rs"), "impl<T: Layer> Gate for T {");
        let mut layer = methods(include_str!("layer.rs"), "pub trait Layer: Send + Sync {");
        assert!(layer.remove("inner"));
        assert!(gate.len() >= 20, "{gate:?}");
        assert_eq!(
            forwarded, gate,
            "Gate's methods, as forwarded to every layer"
        );
        assert_eq!(layer, gate, "Gate's methods, as a layer may override them");
    }
}
