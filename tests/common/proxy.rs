//! A seeded fault proxy, after Jepsen's nemesis: a TCP proxy that instances reach Redis or
//! the database through, and that breaks what passes on a seed's say. Per chunk forwarded:
//! a delay, a stall (longer than a client's timeout), a reset (RST both ways); per new
//! connection: a refusal; and partitions set by the test, during which new connections are
//! refused and existing ones hold every byte until it heals. Each connection draws from a
//! random source made from the seed and its number, so a seed names the same faults for
//! the same connections; timing decides which requests they meet.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// How often each fault strikes.
#[derive(Debug, Clone, Copy, Default)]
pub struct Faults {
    /// Per chunk: held back `delay_ms` before it is forwarded.
    pub delay: f64,
    pub delay_ms: (u64, u64),
    /// Per chunk: the connection forwards nothing for `stall_ms`.
    pub stall: f64,
    pub stall_ms: (u64, u64),
    /// Per chunk: the connection is reset, both ways.
    pub reset: f64,
    /// Per new connection: refused (reset at once).
    pub refuse: f64,
}

impl Faults {
    pub const NONE: Faults = Faults {
        delay: 0.0,
        delay_ms: (0, 0),
        stall: 0.0,
        stall_ms: (0, 0),
        reset: 0.0,
        refuse: 0.0,
    };
}

/// What the proxy did, for the test's report.
#[derive(Debug, Default)]
pub struct Struck {
    pub connections: AtomicU64,
    pub delays: AtomicU64,
    pub stalls: AtomicU64,
    pub resets: AtomicU64,
    pub refusals: AtomicU64,
}

impl std::fmt::Display for Struck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        write!(
            f,
            "{} connections, {} delays, {} stalls, {} resets, {} refusals",
            n(&self.connections),
            n(&self.delays),
            n(&self.stalls),
            n(&self.resets),
            n(&self.refusals)
        )
    }
}

struct Shared {
    faults: Mutex<Faults>,
    partitioned: AtomicBool,
    /// Wakes connections held by a partition when it heals, and resets them all on demand.
    healed: Notify,
    reset_all: Notify,
    struck: Struck,
}

pub struct FaultProxy {
    pub port: u16,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// A proxy on a port of its own in front of 127.0.0.1:`target`, passing everything
    /// until told otherwise.
    pub async fn start(target: u16, seed: u64) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let shared = Arc::new(Shared {
            faults: Mutex::new(Faults::NONE),
            partitioned: AtomicBool::new(false),
            healed: Notify::new(),
            reset_all: Notify::new(),
            struck: Struck::default(),
        });
        let task = tokio::spawn(accept(listener, target, seed, shared.clone()));
        FaultProxy { port, shared, task }
    }

    pub fn set(&self, faults: Faults) {
        *self.shared.faults.lock().unwrap() = faults;
    }

    /// Cuts the proxy off (new connections refused, open ones hold every byte) until
    /// [`FaultProxy::heal`].
    pub fn partition(&self) {
        self.shared.partitioned.store(true, Ordering::SeqCst);
    }

    pub fn heal(&self) {
        self.shared.partitioned.store(false, Ordering::SeqCst);
        self.shared.healed.notify_waiters();
    }

    /// Resets every open connection.
    pub fn reset_all(&self) {
        self.shared.reset_all.notify_waiters();
    }

    pub fn struck(&self) -> &Struck {
        &self.shared.struck
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept(listener: TcpListener, target: u16, seed: u64, shared: Arc<Shared>) {
    let mut number: u64 = 0;
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        number += 1;
        let mut rng = StdRng::seed_from_u64(seed ^ number.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        shared.struck.connections.fetch_add(1, Ordering::Relaxed);
        let refuse = shared.faults.lock().unwrap().refuse;
        if shared.partitioned.load(Ordering::SeqCst) || rng.random_bool(refuse.clamp(0.0, 1.0)) {
            shared.struck.refusals.fetch_add(1, Ordering::Relaxed);
            reset(client);
            continue;
        }
        let shared = shared.clone();
        tokio::spawn(async move {
            if let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await {
                pass(client, server, rng, shared).await;
            }
        });
    }
}

fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

/// What to do with the next chunk.
enum Fate {
    Pass,
    Wait(Duration),
    Reset,
}

fn fate(rng: &mut StdRng, shared: &Shared) -> Fate {
    let f = *shared.faults.lock().unwrap();
    let x: f64 = rng.random();
    let ms = |rng: &mut StdRng, (lo, hi): (u64, u64)| {
        Duration::from_millis(rng.random_range(lo..=hi.max(lo)))
    };
    if x < f.reset {
        shared.struck.resets.fetch_add(1, Ordering::Relaxed);
        Fate::Reset
    } else if x < f.reset + f.stall {
        shared.struck.stalls.fetch_add(1, Ordering::Relaxed);
        Fate::Wait(ms(rng, f.stall_ms))
    } else if x < f.reset + f.stall + f.delay {
        shared.struck.delays.fetch_add(1, Ordering::Relaxed);
        Fate::Wait(ms(rng, f.delay_ms))
    } else {
        Fate::Pass
    }
}

/// Forwards both ways, one chunk at a time, each meeting its fate first.
async fn pass(mut client: TcpStream, mut server: TcpStream, mut rng: StdRng, shared: Arc<Shared>) {
    let (mut up, mut down) = (vec![0u8; 16 * 1024], vec![0u8; 16 * 1024]);
    loop {
        let (n, to_server) = tokio::select! {
            read = client.read(&mut up) => match read {
                Ok(n) if n > 0 => (n, true),
                _ => break,
            },
            read = server.read(&mut down) => match read {
                Ok(n) if n > 0 => (n, false),
                _ => break,
            },
            _ = shared.reset_all.notified() => {
                shared.struck.resets.fetch_add(1, Ordering::Relaxed);
                reset(client);
                reset(server);
                return;
            }
        };
        while shared.partitioned.load(Ordering::SeqCst) {
            let healed = shared.healed.notified();
            if !shared.partitioned.load(Ordering::SeqCst) {
                break;
            }
            tokio::select! {
                _ = healed => {}
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
        match fate(&mut rng, &shared) {
            Fate::Pass => {}
            Fate::Wait(d) => tokio::time::sleep(d).await,
            Fate::Reset => {
                reset(client);
                reset(server);
                return;
            }
        }
        let written = if to_server {
            server.write_all(&up[..n]).await
        } else {
            client.write_all(&down[..n]).await
        };
        if written.is_err() {
            break;
        }
    }
}
