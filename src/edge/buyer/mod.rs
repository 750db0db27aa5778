//! What a buyer calls: logging in, the catalogue and a sale's live stock, the purchase and
//! their orders, paying and cancelling. A buyer's calls see only their own orders.

pub mod catalogue;
pub mod login;
pub mod orders;
pub mod payments;
pub mod queue;
