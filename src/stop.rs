//! The background loops' stop signal: a `watch` of `bool` that start-up hands to each loop
//! (writer, scheduler, auditor, waiting rooms) and sets at shutdown. Owns nothing else; never
//! blocks.
//!
//! A sender dropped without sending counts as a stop. Its receivers' `changed()` is ready at
//! once from then on, so a loop that waits on it between rounds and looks only at the value
//! would run its rounds back to back on a core for ever (a test harness dropped with its
//! writer did that, and slowed every other test in the process by minutes).

use tokio::sync::watch;

/// True once the loop holding `stop` should end: stop was sent, or nobody can send it any
/// more. Marks the value seen, so that `changed()` waits for the next send.
pub fn requested(stop: &mut watch::Receiver<bool>) -> bool {
    *stop.borrow_and_update() || stop.has_changed().is_err()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sent_stop_and_a_dropped_sender_both_stop() {
        let (tx, mut rx) = watch::channel(false);
        assert!(!requested(&mut rx));
        tx.send(true).unwrap();
        assert!(requested(&mut rx));

        let (tx, mut rx) = watch::channel(false);
        assert!(!requested(&mut rx));
        drop(tx);
        assert!(requested(&mut rx));
    }
}
