//! What the embedded order log asks of its folder, as one seam: the real file system in a
//! server, a simulated disk in the simulation (`tests/sim`), which fails writes, tears
//! them and loses what was never synced when it "crashes", on a seed's say. Only the
//! operations the log needs, each with the durability it relies on named in its doc.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// A file the log appends to.
pub trait DiskFile: Send {
    /// Appends `bytes`; durable only once [`DiskFile::sync`] returns.
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()>;

    /// Makes everything appended so far durable.
    fn sync(&mut self) -> std::io::Result<()>;

    /// Cuts the file back to `len` bytes and makes that durable: what a failed append may
    /// have left behind it is gone.
    fn truncate_synced(&mut self, len: u64) -> std::io::Result<()>;
}

/// The log's folder.
pub trait Disk: Send + Sync {
    fn create_dir_all(&self, dir: &Path) -> std::io::Result<()>;

    /// An exclusive hold on `dir` for as long as the returned value lives; `None` when
    /// another process holds it.
    fn lock(&self, dir: &Path) -> std::io::Result<Option<Box<dyn Send + Sync>>>;

    /// The paths of the files in `dir`.
    fn list(&self, dir: &Path) -> std::io::Result<Vec<PathBuf>>;

    /// A whole file (`NotFound` when there is none).
    fn read(&self, path: &Path) -> std::io::Result<Vec<u8>>;

    /// Creates `path` (which must not exist) for appending; its name is durable on return.
    fn create_new(&self, path: &Path) -> std::io::Result<Box<dyn DiskFile>>;

    /// Replaces `path` with `bytes`, durably, name included.
    fn write_synced(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()>;

    /// Appends `bytes` to `path` (created if missing), durably.
    fn append_synced(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()>;

    fn remove(&self, path: &Path) -> std::io::Result<()>;
}

/// The machine's file system.
#[derive(Debug, Default)]
pub struct RealDisk;

struct RealFile(File);

impl DiskFile for RealFile {
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.0.write_all(bytes)
    }

    fn sync(&mut self) -> std::io::Result<()> {
        self.0.sync_data()
    }

    fn truncate_synced(&mut self, len: u64) -> std::io::Result<()> {
        // Opened for appending: later writes go to the new end.
        self.0.set_len(len)?;
        self.0.sync_data()
    }
}

fn sync_dir(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => File::open(dir)?.sync_all(),
        _ => Ok(()),
    }
}

impl Disk for RealDisk {
    fn create_dir_all(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)
    }

    fn lock(&self, dir: &Path) -> std::io::Result<Option<Box<dyn Send + Sync>>> {
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join("lock"))?;
        Ok(match lock.try_lock() {
            Ok(()) => Some(Box::new(lock)),
            Err(_) => None,
        })
    }

    fn list(&self, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
        std::fs::read_dir(dir)?
            .map(|entry| entry.map(|e| e.path()))
            .collect()
    }

    fn read(&self, path: &Path) -> std::io::Result<Vec<u8>> {
        let mut bytes = Vec::new();
        File::open(path)?.read_to_end(&mut bytes)?;
        Ok(bytes)
    }

    fn create_new(&self, path: &Path) -> std::io::Result<Box<dyn DiskFile>> {
        let file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(path)?;
        // The new name must survive a crash too.
        sync_dir(path)?;
        Ok(Box::new(RealFile(file)))
    }

    fn write_synced(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
        let mut f = File::create(path)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        sync_dir(path)
    }

    fn append_synced(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
        let mut f = OpenOptions::new().create(true).append(true).open(path)?;
        f.write_all(bytes)?;
        f.sync_data()
    }

    fn remove(&self, path: &Path) -> std::io::Result<()> {
        std::fs::remove_file(path)
    }
}
