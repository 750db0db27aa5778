//! The simulated disk under the order log, and the crash shared by everything in one
//! simulated process. Files live in memory, each with what the process sees and how much
//! of it is durable. On the seed's say an append or a sync fails (EIO), an append is
//! torn, or the process dies mid-write; when it dies, each file keeps its durable bytes and
//! a random prefix of the rest, maybe garbled at its end, as a machine losing power would.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use seckill::orderlog::disk::{Disk, DiskFile};
use seckill::store::Store;

/// The death of the simulated process: the store stops, the disk answers nothing more.
#[derive(Default)]
pub struct Crash {
    down: AtomicBool,
    store: Mutex<Option<Store>>,
    /// The store of the process that died, until its connections are closed for good
    /// ([`Crash::bury`]).
    halted: Mutex<Option<Store>>,
}

impl Crash {
    /// A process is running with `store`.
    pub fn boot(&self, store: Store) {
        self.down.store(false, Ordering::SeqCst);
        *self.store.lock().unwrap() = Some(store);
    }

    /// The process dies here: nothing it does from now on reaches the disk or SQL.
    pub fn strike(&self) {
        self.down.store(true, Ordering::SeqCst);
        if let Some(store) = self.store.lock().unwrap().take() {
            store.halt();
            *self.halted.lock().unwrap() = Some(store);
        }
    }

    /// Waits until every connection of the dead process is closed, as the kernel closes a
    /// dead process's files: none may hold a lock when the next process starts. (The store
    /// holds this crash through its faults: kept here, it would never be freed.)
    pub async fn bury(&self) {
        let halted = self.halted.lock().unwrap().take();
        if let Some(store) = halted {
            store.close().await;
        }
    }

    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::SeqCst)
    }
}

/// How often the disk misbehaves, per call.
#[derive(Debug, Clone, Copy)]
pub struct DiskFaults {
    /// An append or a sync fails (an append may have written part of its bytes).
    pub fail: f64,
    /// The process dies during an append (part of its bytes written) or a sync.
    pub crash: f64,
}

#[derive(Default)]
struct File {
    /// What the process reads back.
    content: Vec<u8>,
    /// How much of `content` survives a crash for sure.
    durable: usize,
}

struct State {
    files: BTreeMap<PathBuf, File>,
    rng: StdRng,
    faults: DiskFaults,
    locked: bool,
}

#[derive(Clone)]
pub struct SimDisk {
    state: Arc<Mutex<State>>,
    crash: Arc<Crash>,
}

fn gone() -> std::io::Error {
    std::io::Error::other("the process is down")
}

fn eio() -> std::io::Error {
    std::io::Error::other("EIO (simulated)")
}

enum Roll {
    Fine,
    Fail,
    Crash,
}

impl SimDisk {
    pub fn new(seed: u64, faults: DiskFaults, crash: Arc<Crash>) -> SimDisk {
        SimDisk {
            state: Arc::new(Mutex::new(State {
                files: BTreeMap::new(),
                rng: StdRng::seed_from_u64(seed),
                faults,
                locked: false,
            })),
            crash,
        }
    }

    /// After a crash, before the next start: each file keeps its durable bytes and a
    /// random prefix of the rest, whose last bytes may be garbage.
    pub fn lose_unsynced(&self) {
        let mut st = self.state.lock().unwrap();
        let State { files, rng, .. } = &mut *st;
        for file in files.values_mut() {
            let unsynced = file.content.len() - file.durable;
            if unsynced > 0 {
                let keep = rng.random_range(0..=unsynced);
                file.content.truncate(file.durable + keep);
                if keep > 0 && rng.random_bool(0.3) {
                    let at = rng.random_range(file.durable..file.content.len());
                    file.content[at] ^= 0x5a;
                }
            }
            file.durable = file.content.len();
        }
        st.locked = false;
    }

    /// Fault rates from now on.
    pub fn set_faults(&self, faults: DiskFaults) {
        self.state.lock().unwrap().faults = faults;
    }

    /// Total bytes in the log's files (what a restart reads).
    pub fn bytes(&self) -> usize {
        let st = self.state.lock().unwrap();
        st.files.values().map(|f| f.content.len()).sum()
    }

    fn roll(st: &mut State) -> Roll {
        let x: f64 = st.rng.random();
        if x < st.faults.crash {
            Roll::Crash
        } else if x < st.faults.crash + st.faults.fail {
            Roll::Fail
        } else {
            Roll::Fine
        }
    }

    fn up(&self) -> std::io::Result<std::sync::MutexGuard<'_, State>> {
        if self.crash.is_down() {
            return Err(gone());
        }
        Ok(self.state.lock().unwrap())
    }
}

struct Handle {
    disk: SimDisk,
    path: PathBuf,
}

impl DiskFile for Handle {
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        let mut st = self.disk.up()?;
        let roll = SimDisk::roll(&mut st);
        let written = match roll {
            Roll::Fine => bytes.len(),
            _ => st.rng.random_range(0..=bytes.len()),
        };
        st.files
            .entry(self.path.clone())
            .or_default()
            .content
            .extend_from_slice(&bytes[..written]);
        match roll {
            Roll::Fine => Ok(()),
            Roll::Fail => Err(eio()),
            Roll::Crash => {
                drop(st);
                self.disk.crash.strike();
                Err(gone())
            }
        }
    }

    fn sync(&mut self) -> std::io::Result<()> {
        let mut st = self.disk.up()?;
        match SimDisk::roll(&mut st) {
            Roll::Fine => {
                let file = st.files.entry(self.path.clone()).or_default();
                file.durable = file.content.len();
                Ok(())
            }
            Roll::Fail => Err(eio()),
            Roll::Crash => {
                drop(st);
                self.disk.crash.strike();
                Err(gone())
            }
        }
    }

    fn truncate_synced(&mut self, len: u64) -> std::io::Result<()> {
        let mut st = self.disk.up()?;
        if let Roll::Fail | Roll::Crash = SimDisk::roll(&mut st) {
            return Err(eio());
        }
        let file = st.files.entry(self.path.clone()).or_default();
        file.content.truncate(len as usize);
        file.durable = file.content.len();
        Ok(())
    }
}

struct Lock(SimDisk);

impl Drop for Lock {
    fn drop(&mut self) {
        self.0.state.lock().unwrap().locked = false;
    }
}

impl Disk for SimDisk {
    fn create_dir_all(&self, _dir: &Path) -> std::io::Result<()> {
        self.up().map(|_| ())
    }

    fn lock(&self, _dir: &Path) -> std::io::Result<Option<Box<dyn Send + Sync>>> {
        let mut st = self.up()?;
        if st.locked {
            return Ok(None);
        }
        st.locked = true;
        Ok(Some(Box::new(Lock(self.clone()))))
    }

    fn list(&self, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
        let st = self.up()?;
        Ok(st
            .files
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .cloned()
            .collect())
    }

    fn read(&self, path: &Path) -> std::io::Result<Vec<u8>> {
        let st = self.up()?;
        st.files
            .get(path)
            .map(|f| f.content.clone())
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
    }

    fn create_new(&self, path: &Path) -> std::io::Result<Box<dyn DiskFile>> {
        let mut st = self.up()?;
        if st.files.contains_key(path) {
            return Err(std::io::Error::from(std::io::ErrorKind::AlreadyExists));
        }
        st.files.insert(path.to_path_buf(), File::default());
        Ok(Box::new(Handle {
            disk: self.clone(),
            path: path.to_path_buf(),
        }))
    }

    fn write_synced(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
        let mut st = self.up()?;
        st.files.insert(
            path.to_path_buf(),
            File {
                content: bytes.to_vec(),
                durable: bytes.len(),
            },
        );
        Ok(())
    }

    fn append_synced(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
        let mut st = self.up()?;
        let file = st.files.entry(path.to_path_buf()).or_default();
        file.content.extend_from_slice(bytes);
        file.durable = file.content.len();
        Ok(())
    }

    fn remove(&self, path: &Path) -> std::io::Result<()> {
        let mut st = self.up()?;
        st.files
            .remove(path)
            .map(|_| ())
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
    }
}
