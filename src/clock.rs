//! Time, as every part that decides by it reads it: sale windows, payment deadlines and
//! expiry, the writer's and the order log's waits, retries, id minting. One [`Clock`] per
//! process, chosen at assembly: the wall clock in production, a [`SimClock`] in tests and
//! in the simulation, where a fifteen-minute payment window passes in one step and a
//! writer's back-off costs no real time. The store carries the process's clock (it stamps
//! rows) and hands it to the writer, lifecycle, loader and scheduler; the memory gate and
//! the id generator are given the same one. Reads nothing but time; never blocks.
//!
//! [`wall_ms`] is the wall clock read directly: for what no seam reaches (the load
//! generator, log throttling, tests that drive a real server).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// A wait on a clock.
pub type Sleep = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// The time of a process, and waits measured in it.
pub trait Clock: Send + Sync {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> i64;

    /// Resolves once `d` of this clock's time has passed.
    fn sleep(&self, d: Duration) -> Sleep;
}

/// The clock every part of one process shares.
pub type SharedClock = Arc<dyn Clock>;

/// Milliseconds since the Unix epoch, by the machine's wall clock.
pub fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The machine's clock, and tokio's timers.
#[derive(Debug, Default)]
pub struct WallClock;

impl Clock for WallClock {
    fn now_ms(&self) -> i64 {
        wall_ms()
    }

    fn sleep(&self, d: Duration) -> Sleep {
        Box::pin(tokio::time::sleep(d))
    }
}

/// The wall clock, shared (one allocation per process).
pub fn wall() -> SharedClock {
    static WALL: OnceLock<SharedClock> = OnceLock::new();
    WALL.get_or_init(|| Arc::new(WallClock)).clone()
}

/// Time that moves only when told to: by [`SimClock::advance`], or by a sleep, which
/// moves it by the sleep's length and returns at once. Every reader sees the same
/// instant, so a run driven by a seed reads the same times each time it is replayed.
#[derive(Debug)]
pub struct SimClock {
    now: AtomicI64,
}

impl SimClock {
    pub fn new(start_ms: i64) -> Arc<SimClock> {
        Arc::new(SimClock {
            now: AtomicI64::new(start_ms),
        })
    }

    /// Moves time forward by `ms` (never back).
    pub fn advance(&self, ms: i64) {
        self.now.fetch_add(ms.max(0), Ordering::SeqCst);
    }
}

impl Clock for SimClock {
    fn now_ms(&self) -> i64 {
        self.now.load(Ordering::SeqCst)
    }

    fn sleep(&self, d: Duration) -> Sleep {
        self.advance(d.as_millis().min(i64::MAX as u128) as i64);
        // Still a suspension point, as a real wait is: other tasks run before it returns.
        Box::pin(tokio::task::yield_now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn simulated_time_moves_only_when_told_and_a_sleep_costs_no_real_time() {
        let clock = SimClock::new(1_000);
        assert_eq!(clock.now_ms(), 1_000);
        clock.advance(500);
        clock.advance(-7);
        assert_eq!(clock.now_ms(), 1_500, "never back");
        let started = std::time::Instant::now();
        clock.sleep(Duration::from_secs(900)).await;
        assert_eq!(clock.now_ms(), 901_500);
        assert!(started.elapsed() < Duration::from_secs(1));
        let wall = wall();
        assert!((wall.now_ms() - wall_ms()).abs() < 1_000);
    }
}
