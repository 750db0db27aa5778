//! Waits between retries: exponential, capped, with jitter, so that processes that lost
//! Redis or SQL together do not all come back in the same instant.

use std::time::Duration;

/// `base` scaled by a random factor in [0.5, 1.5).
pub fn jittered(base: Duration) -> Duration {
    base.mul_f64(0.5 + rand::random::<f64>())
}

/// Doubling waits from `first` up to `cap`, each jittered.
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
    cap: Duration,
}

impl Backoff {
    pub fn new(first: Duration, cap: Duration) -> Self {
        Backoff { next: first, cap }
    }

    /// The wait before the next try.
    pub fn next_wait(&mut self) -> Duration {
        let wait = jittered(self.next);
        self.next = (self.next * 2).min(self.cap);
        wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_up_to_the_cap_with_jitter() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(400));
        let waits: Vec<u128> = (0..5).map(|_| b.next_wait().as_millis()).collect();
        assert!((50..150).contains(&waits[0]), "{waits:?}");
        assert!((100..300).contains(&waits[1]), "{waits:?}");
        assert!(
            waits[2..].iter().all(|w| (200..600).contains(w)),
            "{waits:?}"
        );
    }
}
