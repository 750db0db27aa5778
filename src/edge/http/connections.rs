//! Client connections: the cap on connections served at once, the cap per client
//! address, and what each connection is doing (for the idle and header-read timeouts).
//!
//! At the global cap, the connections waiting the longest for a request (silent since
//! they connected, or idle between requests) are shed, as nginx reuses its idle
//! keep-alive connections, so that a flood of silent sockets from many addresses cannot
//! keep anyone else out. Only when every connection is receiving or being served a
//! request does the listener stop: the connection it accepted waits for a slot, later ones
//! in the kernel's accept queue (long, see `cli`). A slot is freed when its connection closes, however it closes. Over the
//! per-address cap, a new connection is closed at once, so that one address holding
//! thousands of silent sockets cannot take every slot from everyone else.

use crate::metrics::render_counter;
use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::serve::Listener;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub struct Connections {
    slots: Arc<Semaphore>,
    max: usize,
    /// Times the cap was reached and accepting paused.
    pub saturated: AtomicU64,
    per_address: PerAddress,
    /// How long a request's head may take once its first bytes arrived.
    pub header_read_timeout: Duration,
    /// How long a connection may stay open without a request.
    pub idle_timeout: Duration,
    /// Connections closed because they were idle, or too slow sending a request's head.
    pub timed_out: AtomicU64,
    /// Connections closed at the cap, to make room, because they waited the longest.
    pub shed: AtomicU64,
    /// Every open connection's activity, for choosing whom to shed.
    registry: Mutex<Registry>,
}

/// The open connections, by a number of their own.
#[derive(Default)]
struct Registry {
    next: u64,
    open: HashMap<u64, Weak<Activity>>,
}

/// The limits on one client's connections (see `Config`).
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    pub max: usize,
    pub per_address: usize,
    /// Peers exempt from the per-address cap: a proxy in front carries a whole crowd.
    pub exempt: Vec<IpAddr>,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
}

impl Connections {
    /// Its series in Prometheus text.
    pub fn render(&self, out: &mut String) {
        out.push_str(&format!(
            "# HELP seckill_connections_open Client connections open now.\n# TYPE seckill_connections_open gauge\nseckill_connections_open {}\n\
             # HELP seckill_connections_max The cap on client connections.\n# TYPE seckill_connections_max gauge\nseckill_connections_max {}\n",
            self.open(),
            self.max()
        ));
        render_counter(
            "seckill_connections_saturated_total",
            "Times the connection cap was reached and accepting paused.",
            self.saturated.load(Ordering::Relaxed),
            out,
        );
        render_counter(
            "seckill_connections_refused_per_address_total",
            "Connections closed at once because their address held its share.",
            self.refused_per_address(),
            out,
        );
        render_counter(
            "seckill_connections_timed_out_total",
            "Connections closed for being idle, or too slow sending a request's head.",
            self.timed_out.load(Ordering::Relaxed),
            out,
        );
        render_counter(
            "seckill_connections_shed_total",
            "Connections closed at the cap to make room: those waiting longest for a request.",
            self.shed.load(Ordering::Relaxed),
            out,
        );
    }

    pub fn new(limits: ConnectionLimits) -> Arc<Self> {
        let max = limits.max.max(1);
        Arc::new(Connections {
            slots: Arc::new(Semaphore::new(max)),
            max,
            saturated: AtomicU64::new(0),
            per_address: PerAddress {
                max: limits.per_address.max(1),
                exempt: limits.exempt,
                open: Arc::new(Mutex::new(HashMap::new())),
                refused: AtomicU64::new(0),
            },
            header_read_timeout: limits.header_read_timeout,
            idle_timeout: limits.idle_timeout,
            timed_out: AtomicU64::new(0),
            shed: AtomicU64::new(0),
            registry: Mutex::new(Registry::default()),
        })
    }

    /// Enters a new connection's activity in the registry, until the guard is dropped.
    fn register(self: &Arc<Self>, activity: &Arc<Activity>) -> Registration {
        let mut registry = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        registry.next += 1;
        let id = registry.next;
        registry.open.insert(id, Arc::downgrade(activity));
        Registration {
            connections: self.clone(),
            id,
        }
    }

    /// Closes the connections that have waited longest for a request, and at least
    /// `SHED_GRACE` (a share of the cap at once, so that a flood does not pay a scan per
    /// connection); returns how many. None is closed while it is sending a request or
    /// being answered.
    pub fn shed_idlest(&self) -> usize {
        self.shed_idlest_at(clock_ms())
    }

    fn shed_idlest_at(&self, now_ms: u64) -> usize {
        let waited_enough = now_ms.saturating_sub(SHED_GRACE.as_millis() as u64);
        let mut waiting: Vec<(u64, Arc<Activity>)> = {
            let registry = self.registry.lock().unwrap_or_else(|p| p.into_inner());
            registry
                .open
                .values()
                .filter_map(Weak::upgrade)
                .filter_map(|a| a.waiting_since().map(|since| (since, a)))
                .filter(|(since, _)| *since <= waited_enough)
                .collect()
        };
        let n = (self.max / SHED_SHARE).max(1).min(waiting.len());
        if n == 0 {
            return 0;
        }
        waiting.select_nth_unstable_by_key(n - 1, |(since, _)| *since);
        for (_, activity) in &waiting[..n] {
            activity.shed();
        }
        self.shed.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// A slot for a connection accepted at the cap: sheds the connections waiting longest
    /// (again each `SHED_GRACE`, as more of them pass it) until one closes.
    async fn room_at_the_cap(&self) -> Option<OwnedSemaphorePermit> {
        let times = self.saturated.fetch_add(1, Ordering::Relaxed);
        let shed = self.shed_idlest();
        // A flood would hit this once per connection: log the first of each thousand.
        if times.is_multiple_of(1000) {
            tracing::warn!(
                max = self.max,
                times = times + 1,
                shed,
                "connection cap reached; the connections waiting longest for a request are closed to make room (none: new ones wait in the accept queue)"
            );
        }
        loop {
            match tokio::time::timeout(SHED_GRACE, self.slots.clone().acquire_owned()).await {
                Ok(slot) => return slot.ok(),
                Err(_) => self.shed_idlest(),
            };
        }
    }

    /// Takes one of `peer`'s connection slots, or `None` when it holds its share already.
    pub fn admit(&self, peer: IpAddr) -> Option<AddressSlot> {
        self.per_address.admit(peer)
    }

    /// Connections closed at once because their address held its share.
    pub fn refused_per_address(&self) -> u64 {
        self.per_address.refused.load(Ordering::Relaxed)
    }

    pub fn open(&self) -> usize {
        self.max - self.slots.available_permits()
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Wraps a listener so that it holds at most `max` connections open.
    pub fn limit<L: Listener>(self: &Arc<Self>, inner: L) -> Limited<L> {
        Limited {
            inner,
            connections: self.clone(),
        }
    }
}

pub struct Limited<L> {
    inner: L,
    connections: Arc<Connections>,
}

/// At the cap, 1/64 of it is shed at once.
const SHED_SHARE: usize = 64;

/// A connection is shed only once it has waited this long for a request: a keep-alive
/// client sends its next request within a round trip of its last answer, and closing the
/// connection just as that request arrives would lose it.
const SHED_GRACE: Duration = Duration::from_secs(1);

impl<L: Listener> Listener for Limited<L> {
    type Io = Counted<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        // The connection first, then its slot: shedding makes room for a connection that
        // is there, never in advance for one that may not come (it would close the newest
        // connection before it could send its request).
        let (io, addr) = self.inner.accept().await;
        let slots = self.connections.slots.clone();
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => match self.connections.room_at_the_cap().await {
                Some(slot) => slot,
                // The semaphore is never closed; if it ever were, serving without the cap
                // beats refusing every connection.
                None => return (Counted::new(io, None), addr),
            },
        };
        let mut counted = Counted::new(io, Some(slot));
        counted.registration = Some(self.connections.register(&counted.activity));
        (counted, addr)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// A connection holding its slot until dropped, telling its `Activity` when bytes come in
/// and answers go out.
pub struct Counted<I> {
    io: I,
    _slot: Option<OwnedSemaphorePermit>,
    activity: Arc<Activity>,
    registration: Option<Registration>,
}

impl<I> Counted<I> {
    fn new(io: I, slot: Option<OwnedSemaphorePermit>) -> Self {
        Counted {
            io,
            _slot: slot,
            activity: Activity::new(),
            registration: None,
        }
    }

    pub fn get_mut(&mut self) -> &mut I {
        &mut self.io
    }

    /// What this connection is doing, for its watchdog and its requests.
    pub fn activity(&self) -> Arc<Activity> {
        self.activity.clone()
    }
}

/// A connection's place in the registry, given up when it closes.
struct Registration {
    connections: Arc<Connections>,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut registry = self
            .connections
            .registry
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        registry.open.remove(&self.id);
    }
}

/// Connections open now, per client address.
type OpenPerAddress = Arc<Mutex<HashMap<IpAddr, usize>>>;

/// The per-address cap.
struct PerAddress {
    max: usize,
    exempt: Vec<IpAddr>,
    open: OpenPerAddress,
    refused: AtomicU64,
}

impl PerAddress {
    fn admit(&self, peer: IpAddr) -> Option<AddressSlot> {
        if self.exempt.contains(&peer) {
            return Some(AddressSlot { held: None });
        }
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let count = open.entry(peer).or_insert(0);
        if *count >= self.max {
            drop(open);
            let times = self.refused.fetch_add(1, Ordering::Relaxed);
            // A flood would hit this once per connection: log the first of each thousand.
            if times.is_multiple_of(1000) {
                tracing::warn!(
                    %peer,
                    max = self.max,
                    times = times + 1,
                    "an address holds its share of connections; closing its new ones"
                );
            }
            return None;
        }
        *count += 1;
        Some(AddressSlot {
            held: Some((self.open.clone(), peer)),
        })
    }
}

/// One connection of an address, given back when dropped.
pub struct AddressSlot {
    held: Option<(OpenPerAddress, IpAddr)>,
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        if let Some((open, peer)) = self.held.take() {
            let mut open = open.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(count) = open.get_mut(&peer) {
                *count -= 1;
                if *count == 0 {
                    open.remove(&peer);
                }
            }
        }
    }
}

/// How far behind `clock_ms` may be: the timeouts it serves are whole seconds, so a tenth
/// of one is fine enough (at 20 ms its wake-ups were a twentieth of an idle instance's CPU).
const CLOCK_TICK: Duration = Duration::from_millis(100);

/// Milliseconds on a monotonic clock, never 0 (0 means "not set" in `Activity`), to within
/// `CLOCK_TICK`: read by every request twice, so it is a load of a number a thread of its
/// own keeps current, not a clock call.
fn clock_ms() -> u64 {
    static NOW_MS: AtomicU64 = AtomicU64::new(0);
    static TICKER: OnceLock<()> = OnceLock::new();
    TICKER.get_or_init(|| {
        let start = Instant::now();
        let now = move || start.elapsed().as_millis() as u64 + 1;
        NOW_MS.store(now(), Ordering::Relaxed);
        let ticking = std::thread::Builder::new()
            .name("seckill-clock".into())
            .spawn(move || loop {
                std::thread::sleep(CLOCK_TICK);
                NOW_MS.store(now(), Ordering::Relaxed);
            });
        // Without the thread the clock stands still and no connection ever times out;
        // threads are only refused when the process is out of them.
        if let Err(e) = ticking {
            tracing::error!("cannot start the connection clock: {e}");
        }
    });
    NOW_MS.load(Ordering::Relaxed)
}

/// What a connection is doing, as seen from its bytes: waiting for a request (idle since),
/// receiving a request's head (head since), or neither (a request is being served).
/// Written by the connection's own task only; atomics because hyper owns the I/O.
#[derive(Default)]
pub struct Activity {
    idle_since: AtomicU64,
    head_since: AtomicU64,
    /// Set by the watchdog when a deadline passed, or by the cap when it is shed; the
    /// connection's task is woken.
    expired: AtomicBool,
    expired_waker: futures_util::task::AtomicWaker,
    /// Closed to make room at the cap (not for a timeout).
    was_shed: AtomicBool,
}

impl Activity {
    pub fn new() -> Arc<Self> {
        let a = Activity::default();
        a.idle_since.store(clock_ms(), Ordering::Relaxed);
        Arc::new(a)
    }

    /// A request's head is complete: from here on the request is served, not awaited.
    pub fn head_complete(&self) {
        self.head_since.store(0, Ordering::Relaxed);
    }

    fn read(&self, bytes: usize) {
        if bytes > 0 && self.idle_since.load(Ordering::Relaxed) != 0 {
            self.idle_since.store(0, Ordering::Relaxed);
            self.head_since.store(clock_ms(), Ordering::Relaxed);
        }
    }

    fn wrote(&self) {
        self.head_since.store(0, Ordering::Relaxed);
        self.idle_since.store(clock_ms(), Ordering::Relaxed);
    }

    /// Since when this connection has been waiting for a request (since it connected, or
    /// since its last answer); `None` while a request is received or served, or once it
    /// is closing.
    fn waiting_since(&self) -> Option<u64> {
        let since = self.idle_since.load(Ordering::Relaxed);
        (since != 0 && !self.expired.load(Ordering::Acquire)).then_some(since)
    }

    /// Closes the connection to make room; a request that started meanwhile is lost
    /// with it, as with any idle keep-alive connection a server closes.
    fn shed(&self) {
        self.was_shed.store(true, Ordering::Relaxed);
        self.expire();
    }

    /// Whether the connection was closed to make room, rather than for a timeout.
    pub fn was_shed(&self) -> bool {
        self.was_shed.load(Ordering::Relaxed)
    }

    fn expire(&self) {
        self.expired.store(true, Ordering::Release);
        self.expired_waker.wake();
    }

    /// The watchdog of one connection, run as a task of its own: a timer polled beside the
    /// connection would be polled again at every wake-up of every request.
    pub async fn watch(self: Arc<Self>, header: Duration, idle: Duration) {
        self.expired(header, idle).await;
        self.expire();
    }

    /// Ready once `watch` saw a deadline pass: an atomic load on the connection's path.
    pub fn poll_expired(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.expired.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        self.expired_waker.register(cx.waker());
        if self.expired.load(Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Resolves when the connection has been idle longer than `idle`, or has been sending
    /// one request's head for longer than `header`; never while a request is served.
    pub async fn expired(&self, header: Duration, idle: Duration) {
        let (header, idle) = (header.as_millis() as u64, idle.as_millis() as u64);
        loop {
            let now = clock_ms();
            let head = self.head_since.load(Ordering::Relaxed);
            let since = self.idle_since.load(Ordering::Relaxed);
            let deadline = if head != 0 {
                head + header
            } else if since != 0 {
                // A request's first byte may come while this sleeps: look again within
                // `header`, so that its head is held to `header` from that byte, not to the
                // idle deadline (a slow head would otherwise be served until then).
                (since + idle).min(now + header)
            } else {
                // Serving: nothing can expire before the request is answered; look again.
                now + header.min(idle)
            };
            if deadline <= now {
                return;
            }
            tokio::time::sleep(Duration::from_millis(deadline - now)).await;
        }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Counted<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            self.activity.read(buf.filled().len() - before);
        }
        polled
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Counted<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        if let Poll::Ready(Ok(_)) = polled {
            self.activity.wrote();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(_)) = polled {
            self.activity.wrote();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(per_address: usize, exempt: &[&str]) -> ConnectionLimits {
        ConnectionLimits {
            max: 100,
            per_address,
            exempt: exempt.iter().map(|a| a.parse().unwrap()).collect(),
            header_read_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn an_address_holds_at_most_its_share_and_gets_it_back() {
        let c = Connections::new(limits(2, &["10.0.0.9"]));
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let first = c.admit(a).unwrap();
        let _second = c.admit(a).unwrap();
        assert!(c.admit(a).is_none(), "a third is refused");
        assert!(
            c.admit("10.0.0.2".parse().unwrap()).is_some(),
            "others are not"
        );
        drop(first);
        assert!(c.admit(a).is_some(), "a closed connection frees its slot");
        let proxy: IpAddr = "10.0.0.9".parse().unwrap();
        let held: Vec<_> = (0..10).map(|_| c.admit(proxy).unwrap()).collect();
        assert_eq!(held.len(), 10, "a trusted proxy is exempt");
        assert_eq!(c.refused_per_address(), 1);
    }

    #[test]
    fn at_the_cap_the_longest_waiting_are_shed_and_never_one_being_served() {
        let c = Connections::new(ConnectionLimits {
            max: 128,
            ..limits(1000, &[])
        });
        // 128 connections: every other one is serving a request; the rest waited since
        // 1, 2, 3... (the lower, the longer).
        let activities: Vec<Arc<Activity>> = (0..128u64)
            .map(|i| {
                let a = Activity::new();
                if i % 2 == 0 {
                    a.idle_since.store(i + 1, Ordering::Relaxed);
                } else {
                    a.read(10);
                }
                a
            })
            .collect();
        // The last waiting one came back from an answer half a second before "now".
        let now = 10_000;
        activities[126]
            .idle_since
            .store(now - 500, Ordering::Relaxed);
        let registrations: Vec<Registration> = activities.iter().map(|a| c.register(a)).collect();
        assert_eq!(c.shed_idlest_at(now), 2, "1/64 of the cap at once");
        let shed: Vec<usize> = (0..128).filter(|&i| activities[i].was_shed()).collect();
        assert_eq!(shed, vec![0, 2], "the two that waited longest");
        assert!(activities[0].expired.load(Ordering::Acquire));
        assert_eq!(
            c.shed_idlest_at(now),
            2,
            "the next two: shed ones are not counted again"
        );
        assert!(activities[4].was_shed() && activities[6].was_shed());
        while c.shed_idlest_at(now) > 0 {}
        assert!(
            (0..128)
                .filter(|i| i % 2 == 1)
                .all(|i| !activities[i].was_shed()),
            "nothing being served is shed"
        );
        assert!(
            !activities[126].was_shed(),
            "nor what waited less than the grace a keep-alive client has"
        );
        assert_eq!(c.shed.load(Ordering::Relaxed), 63);
        drop(registrations);
        activities[126].idle_since.store(1, Ordering::Relaxed);
        assert_eq!(
            c.shed_idlest_at(now),
            0,
            "closed connections leave the registry"
        );
    }

    #[tokio::test]
    async fn idle_and_slow_heads_expire_but_a_served_request_does_not() {
        let ms = Duration::from_millis;
        // Idle long ago: expired at once.
        let a = Activity::new();
        a.idle_since.store(1, Ordering::Relaxed);
        tokio::time::timeout(ms(500), a.expired(ms(50), ms(50)))
            .await
            .expect("an idle connection expires");
        // A head started and never finished: expired after the header timeout.
        let a = Activity::new();
        a.read(10);
        let started = Instant::now();
        tokio::time::timeout(ms(2000), a.expired(ms(300), ms(60_000)))
            .await
            .expect("a slow head expires");
        // Its start was stamped by the clock, which may be a tick behind.
        let earliest = ms(300) - CLOCK_TICK - ms(20);
        assert!(started.elapsed() >= earliest, "{:?}", started.elapsed());
        // Serving: neither idle nor reading a head, so it must not resolve.
        a.head_complete();
        let served = tokio::time::timeout(ms(400), a.expired(ms(50), ms(50))).await;
        assert!(served.is_err(), "a request being served never expires");
        // Answered: idle again, and expires after the idle timeout.
        a.wrote();
        tokio::time::timeout(ms(2000), a.expired(ms(50), ms(100)))
            .await
            .expect("idle after the answer");
    }

    #[tokio::test]
    async fn a_head_that_starts_while_the_watchdog_waits_out_the_idle_time_is_held_to_its_own_deadline(
    ) {
        let ms = Duration::from_millis;
        // Idle for a minute at most, but a head may take only 200 ms once it starts.
        let a = Activity::new();
        let watched = a.clone();
        let watchdog = tokio::spawn(async move { watched.expired(ms(200), ms(60_000)).await });
        tokio::time::sleep(ms(300)).await;
        // The first byte arrives while the watchdog waits for the idle deadline.
        let first_byte = Instant::now();
        a.read(1);
        tokio::time::timeout(ms(2_000), watchdog)
            .await
            .expect("the slow head expired within its header deadline, not the idle one")
            .unwrap();
        let took = first_byte.elapsed();
        // The head's start is stamped by the clock, which may be a tick behind.
        let earliest = ms(200) - CLOCK_TICK - ms(20);
        assert!(took >= earliest && took < ms(700), "{took:?}");
    }
}
