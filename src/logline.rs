//! Log lines that would repeat once per request during an outage (a database or gate
//! error answered to thousands of buyers) are written at most once per interval, with the
//! count of those left out; state changes are logged where they happen, once.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

pub struct Every {
    every_ms: i64,
    last: AtomicI64,
    left_out: AtomicU64,
}

impl Every {
    pub const fn new(every_ms: i64) -> Self {
        Every {
            every_ms,
            last: AtomicI64::new(i64::MIN),
            left_out: AtomicU64::new(0),
        }
    }

    /// `Some(lines left out since the last one)` when a line may be written now.
    pub fn ready(&self) -> Option<u64> {
        let now = crate::clock::wall_ms();
        let last = self.last.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= self.every_ms
            && self
                .last
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.left_out.swap(0, Ordering::AcqRel));
        }
        self.left_out.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_with_the_count_left_out() {
        let every = Every::new(60_000);
        assert_eq!(every.ready(), Some(0));
        for _ in 0..5 {
            assert_eq!(every.ready(), None);
        }
        every.last.store(0, Ordering::Relaxed);
        assert_eq!(every.ready(), Some(5));
    }
}
