//! The failover window of an embedded server on PostgreSQL or MySQL, in files beside its
//! order log (the folder bound to that database): one file per minute of changes, a line
//! per change, and a file naming the identity the window is settled against. One process
//! decides purchases in memory on a database (it holds the database's claim), so the replay
//! needs no lease. A change is appended without an fsync: the window guards against the
//! database failing over, not against this machine dying at the same moment (the order log
//! guards against that, and fsyncs).
//!
//! A record's id is `{file}-{offset}`: the minute its file starts and where its line starts,
//! so that a replay reads on from the last record it applied without reading the window
//! from the start for every chunk.

use std::io::{BufRead, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;

use crate::store::failover::{Settled, Window, WindowError};

/// Each file holds this long of changes: a window of minutes is trimmed a file at a time.
const FILE_SPAN_MS: i64 = 60_000;
const IDENTITY: &str = "identity";

pub struct FileWindow {
    dir: PathBuf,
    /// The file being appended to, and the minute it starts.
    current: Mutex<Option<(i64, std::fs::File)>>,
    clock: crate::clock::SharedClock,
}

fn failed(e: std::io::Error) -> WindowError {
    WindowError::Unavailable(format!("failover window file: {e}"))
}

/// A record id as (file, offset).
fn parse_id(id: &str) -> Option<(i64, u64)> {
    let (file, offset) = id.split_once('-')?;
    Some((file.parse().ok()?, offset.parse().ok()?))
}

/// Whether the file's last byte is not the end of a line.
fn ends_mid_line(path: &Path) -> Result<bool, WindowError> {
    let mut file = std::fs::File::open(path).map_err(failed)?;
    let len = file.metadata().map_err(failed)?.len();
    if len == 0 {
        return Ok(false);
    }
    file.seek(SeekFrom::Start(len - 1)).map_err(failed)?;
    let mut last = [0u8; 1];
    std::io::Read::read_exact(&mut file, &mut last).map_err(failed)?;
    Ok(last[0] != b'\n')
}

impl FileWindow {
    pub fn open(dir: &Path, clock: crate::clock::SharedClock) -> Result<FileWindow, WindowError> {
        std::fs::create_dir_all(dir).map_err(failed)?;
        Ok(FileWindow {
            dir: dir.to_path_buf(),
            current: Mutex::new(None),
            clock,
        })
    }

    /// The files of changes, oldest first, by the minute each starts.
    fn files(&self) -> Result<Vec<i64>, WindowError> {
        let mut starts: Vec<i64> = std::fs::read_dir(&self.dir)
            .map_err(failed)?
            .filter_map(|e| {
                let name = e.ok()?.file_name();
                name.to_str()?.strip_suffix(".log")?.parse().ok()
            })
            .collect();
        starts.sort_unstable();
        Ok(starts)
    }

    fn file_path(&self, start: i64) -> PathBuf {
        self.dir.join(format!("{start}.log"))
    }

    fn read_identity(&self) -> Result<Option<String>, WindowError> {
        match std::fs::read_to_string(self.dir.join(IDENTITY)) {
            Ok(text) => Ok(Some(text.trim().to_string()).filter(|t| !t.is_empty())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(failed(e)),
        }
    }

    /// Written whole or not at all (a new file renamed over the old one).
    fn write_identity(&self, identity: &str) -> Result<(), WindowError> {
        let fresh = self.dir.join(format!("{IDENTITY}.new"));
        std::fs::write(&fresh, identity).map_err(failed)?;
        std::fs::rename(&fresh, self.dir.join(IDENTITY)).map_err(failed)
    }

    /// Whether any record follows the one named `last` ("0": any at all).
    fn holds_after(&self, last: &str) -> Result<bool, WindowError> {
        Ok(!self.read_after(last, 1)?.is_empty())
    }

    fn read_after(&self, after: &str, count: usize) -> Result<Vec<(String, String)>, WindowError> {
        let (after_file, after_offset) = parse_id(after).unwrap_or((i64::MIN, 0));
        let mut records = Vec::new();
        for start in self.files()?.into_iter().filter(|s| *s >= after_file) {
            let mut file = match std::fs::File::open(self.file_path(start)) {
                Ok(f) => f,
                // Trimmed meanwhile.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(failed(e)),
            };
            let mut offset = 0u64;
            let mut reader = std::io::BufReader::new(&mut file);
            if start == after_file {
                // Past the record already read: to its line's end.
                reader.seek(SeekFrom::Start(after_offset)).map_err(failed)?;
                let mut skipped = Vec::new();
                offset =
                    after_offset + reader.read_until(b'\n', &mut skipped).map_err(failed)? as u64;
            }
            loop {
                let mut line = Vec::new();
                let read = reader.read_until(b'\n', &mut line).map_err(failed)?;
                // A line cut short by a crash mid-append is no record.
                if read == 0 || line.last() != Some(&b'\n') {
                    break;
                }
                line.pop();
                records.push((
                    format!("{start}-{offset}"),
                    String::from_utf8_lossy(&line).into_owned(),
                ));
                offset += read as u64;
                if records.len() >= count {
                    return Ok(records);
                }
            }
        }
        Ok(records)
    }
}

#[async_trait]
impl Window for FileWindow {
    async fn keep(&self, identity: &str, record: &str) -> Result<(), WindowError> {
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        match self.read_identity()? {
            None => self.write_identity(identity)?,
            Some(settled) if settled != identity => return Err(WindowError::Moved(settled)),
            Some(_) => {}
        }
        let now = self.clock.now_ms();
        let minute = now - now.rem_euclid(FILE_SPAN_MS);
        if current.as_ref().is_none_or(|(start, _)| *start != minute) {
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.file_path(minute))
                .map_err(failed)?;
            // A line a crash cut short is ended first, so that it stays a record of its own
            // (one that does not read) and does not swallow the next.
            if ends_mid_line(&self.file_path(minute))? {
                file.write_all(b"\n").map_err(failed)?;
            }
            *current = Some((minute, file));
        }
        if let Some((_, file)) = current.as_mut() {
            let mut line = Vec::with_capacity(record.len() + 1);
            line.extend_from_slice(record.as_bytes());
            line.push(b'\n');
            file.write_all(&line).map_err(failed)?;
        }
        Ok(())
    }

    async fn settled(&self) -> Result<Option<String>, WindowError> {
        self.read_identity()
    }

    async fn read(&self, after: &str, count: usize) -> Result<Vec<(String, String)>, WindowError> {
        self.read_after(after, count)
    }

    async fn settle(
        &self,
        from: Option<&str>,
        to: &str,
        last: &str,
    ) -> Result<Settled, WindowError> {
        // Under the append lock: no change slips in between the check and the settle.
        let _appending = self.current.lock().unwrap_or_else(|p| p.into_inner());
        let settled = self.read_identity()?;
        if settled.as_deref() != from {
            return Ok(Settled::Moved(settled.unwrap_or_default()));
        }
        if self.holds_after(last)? {
            return Ok(Settled::More);
        }
        self.write_identity(to)?;
        Ok(Settled::Done)
    }

    async fn trim(&self, identity: &str, age: Duration) -> Result<(), WindowError> {
        let _appending = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if self.read_identity()?.as_deref() != Some(identity) {
            return Ok(());
        }
        let oldest = self.clock.now_ms() - age.as_millis() as i64;
        for start in self.files()? {
            // A file's last change is at most a file's span after its start.
            if start + FILE_SPAN_MS < oldest {
                match std::fs::remove_file(self.file_path(start)) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(failed(e)),
                }
            }
        }
        Ok(())
    }

    async fn lock(&self, _token: &str, _ttl: Duration) -> Result<bool, WindowError> {
        Ok(true)
    }

    async fn unlock(&self, _token: &str) -> Result<(), WindowError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn window() -> (FileWindow, PathBuf) {
        let dir = std::env::temp_dir().join(format!("window-{:x}", rand::random::<u64>()));
        (FileWindow::open(&dir, crate::clock::wall()).unwrap(), dir)
    }

    #[tokio::test]
    async fn a_line_cut_short_is_no_record() {
        let (w, dir) = window();
        w.keep("db", "whole").await.unwrap();
        let start = w.files().unwrap()[0];
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(w.file_path(start))
            .unwrap();
        file.write_all(b"{\"k\":\"cut").unwrap();
        let records = w.read("0", 10).await.unwrap();
        assert_eq!(records.len(), 1);
        let mut text = String::new();
        std::fs::File::open(w.file_path(start))
            .unwrap()
            .read_to_string(&mut text)
            .unwrap();
        assert!(text.ends_with("cut"));
        // The next change starts a line of its own.
        let reopened = FileWindow::open(&dir, crate::clock::wall()).unwrap();
        reopened.keep("db", "after").await.unwrap();
        let records = reopened.read("0", 10).await.unwrap();
        let texts: Vec<&str> = records.iter().map(|r| r.1.as_str()).collect();
        assert_eq!(texts, ["whole", "{\"k\":\"cut", "after"]);
        let _ = std::fs::remove_dir_all(dir);
    }
}
