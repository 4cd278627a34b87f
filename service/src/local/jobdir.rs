//! A local job's directory, `<local dir>/jobs/<build id>/`: what the job is (`job.json`, the
//! payload included, so a restarted service can run it again), one `attempt-<n>/` per run of it
//! (the hooks' checkout directory: `result.json` and the runner's `work/`), and beside each the
//! service's own records of that attempt: `attempt-<n>.log` (the hooks' log) and
//! `attempt-<n>.pid` (the command hook's process while it runs).
//!
//! The job directory is the service's alone (mode 0700): the job user never writes it (the
//! sandbox shows the job its checkout only), so nothing the service creates, appends to or
//! trusts lives in the checkout, which the job user owns while its command runs. What the
//! service reads from the checkout goes through [`super::safe_read`].

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::hooks::{boot_id, ProcessId};
use super::safe_read::{self, ReadError};
use crate::submission::BuildInfo;

/// `job.json`: everything needed to run the job again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobFile {
    /// The submission it runs for.
    pub submission_id: String,
    /// `KERNELBOT_RUN_ID`.
    pub run_id: String,
    /// `KERNELBOT_QUEUE`.
    pub queue: String,
    /// The run config's mode.
    pub mode: String,
    /// The build as the submission records it.
    pub build: BuildInfo,
    /// kernelbot's payload (base64(zlib(JSON))).
    pub payload: String,
    /// When the executor took the job; the queue is kept in this order.
    pub accepted_at: DateTime<Utc>,
    /// A ranked run: a quarantined slice does not take it.
    #[serde(default)]
    pub ranked: bool,
    /// The slice (its agent name) it must run on: a canary.
    #[serde(default)]
    pub pin: Option<String>,
}

/// A build id that can name a directory (the executor makes UUIDs; anything else did not
/// come from it).
pub fn valid_build_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
}

/// One job's directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobDir {
    root: PathBuf,
}

impl JobDir {
    /// `<jobs>/<build id>`.
    pub fn new(jobs: &Path, build_id: &str) -> JobDir {
        JobDir {
            root: jobs.join(build_id),
        }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// Creates the directory (the service's alone: 0700, made here, never an existing one) and
    /// writes `job.json` (0600, atomically: a reader never sees half).
    pub fn create(&self, job: &JobFile) -> std::io::Result<()> {
        if let Some(jobs) = self.root.parent() {
            std::fs::create_dir_all(jobs)?;
        }
        std::fs::DirBuilder::new().mode(0o700).create(&self.root)?;
        let tmp = self.root.join(".job.json.tmp");
        private_file(&tmp, false)?.write_all(&serde_json::to_vec(job)?)?;
        std::fs::rename(tmp, self.root.join("job.json"))
    }

    /// `job.json`.
    pub fn read(&self) -> std::io::Result<JobFile> {
        let bytes = std::fs::read(self.root.join("job.json"))?;
        serde_json::from_slice(&bytes).map_err(std::io::Error::from)
    }

    /// The directory of attempt `n` (the hooks' checkout directory).
    pub fn attempt(&self, n: u32) -> PathBuf {
        self.root.join(format!("attempt-{n}"))
    }

    /// The highest attempt started, if any.
    pub fn last_attempt(&self) -> Option<u32> {
        std::fs::read_dir(&self.root)
            .ok()?
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_str()?
                    .strip_prefix("attempt-")?
                    .parse::<u32>()
                    .ok()
            })
            .max()
    }

    /// Where attempt `n`'s runner writes `result.json` (in the checkout: the job writes it).
    pub fn result(&self, n: u32) -> PathBuf {
        self.root.join(result_rel(n))
    }

    /// Attempt `n`'s `result.json`, read as [`safe_read::read_capped`] reads a file the job
    /// could have put there: refused unless it is a regular file of at most `cap` bytes.
    pub fn read_result(&self, n: u32, cap: u64) -> Result<Vec<u8>, ReadError> {
        safe_read::read_capped(&self.root, &result_rel(n), cap)
    }

    /// Attempt `n`'s `provenance.json` (the runner writes it beside the result), read as the
    /// result is.
    pub fn read_provenance(&self, n: u32) -> Result<Vec<u8>, ReadError> {
        let rel = Path::new(&format!("attempt-{n}")).join(kernelkite_sys::provenance::FILE);
        safe_read::read_capped(&self.root, &rel, kernelkite_sys::provenance::MAX_BYTES)
    }

    /// Attempt `n`'s log (the hooks' output), beside the checkout, not in it.
    pub fn log(&self, n: u32) -> PathBuf {
        self.root.join(log_name(n))
    }

    /// Opens attempt `n`'s log for appending, creating it (0600) if need be. The hooks and
    /// the command write through this descriptor; nothing is ever opened by a path the job
    /// could have changed.
    pub fn open_log(&self, n: u32) -> std::io::Result<File> {
        let f = private_file(&self.log(n), true)?;
        if !f.metadata()?.is_file() {
            return Err(std::io::Error::other(format!(
                "{} is not a regular file",
                self.log(n).display()
            )));
        }
        // O_NONBLOCK only kept the open from waiting on a FIFO; the hooks and the job write
        // this descriptor as their stdout, which must block as a file's does.
        let flags = rustix::fs::fcntl_getfl(&f)?;
        rustix::fs::fcntl_setfl(&f, flags - rustix::fs::OFlags::NONBLOCK)?;
        Ok(f)
    }

    /// The last `max` bytes of attempt `n`'s log (decoded lossily), for an error message
    /// (empty when there is none; what went wrong when it cannot be read).
    pub fn log_tail(&self, n: u32, max: u64) -> String {
        match safe_read::read_tail(&self.root, Path::new(&log_name(n)), max) {
            Ok(bytes) => String::from_utf8_lossy(&bytes).trim().to_string(),
            Err(ReadError::Missing { .. }) => String::new(),
            Err(e) => format!("(the job log was not read: {e})"),
        }
    }

    /// Records the command hook's process of attempt `n`, so a restarted service can stop it.
    pub fn write_process(&self, n: u32, p: ProcessId) -> std::io::Result<()> {
        let record = CommandRecord {
            pid: p.pid,
            start_time: p.start_time,
            boot_id: boot_id(),
        };
        private_file(&self.root.join(pid_name(n)), false)?.write_all(&serde_json::to_vec(&record)?)
    }

    /// The command hook's process of attempt `n`, as [`JobDir::write_process`] recorded it;
    /// `None` when nothing was recorded. Only a record in the service's own directory is
    /// read: a `command.pid` the job left in its checkout means nothing.
    pub fn read_process(&self, n: u32) -> Result<Option<CommandRecord>, ReadError> {
        let rel = pid_name(n);
        let bytes = match safe_read::read_capped(&self.root, Path::new(&rel), 4096) {
            Ok(b) => b,
            Err(ReadError::Missing { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| ReadError::Io {
                path: self.root.join(rel),
                source: e.into(),
            })
    }

    /// Removes the directory and everything in it.
    pub fn remove(&self) -> std::io::Result<()> {
        match std::fs::remove_dir_all(&self.root) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            other => other,
        }
    }
}

/// The job directories under `jobs`.
pub fn list(jobs: &Path) -> Vec<JobDir> {
    let Ok(entries) = std::fs::read_dir(jobs) else {
        return Vec::new();
    };
    let mut dirs: Vec<JobDir> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter(|e| e.file_name().to_str().is_some_and(valid_build_id))
        .map(|e| JobDir { root: e.path() })
        .collect();
    dirs.sort_by(|a, b| a.root.cmp(&b.root));
    dirs
}

/// `attempt-<n>/result.json`, relative to the job's directory.
fn result_rel(n: u32) -> PathBuf {
    Path::new(&format!("attempt-{n}")).join("result.json")
}

fn log_name(n: u32) -> String {
    format!("attempt-{n}.log")
}

fn pid_name(n: u32) -> String {
    format!("attempt-{n}.pid")
}

/// Opens a file of the service's in the job's directory for writing (`append`, else from
/// empty), creating it 0600; a link in its place is not followed (`O_NOFOLLOW`), and a FIFO
/// does not hold the open (`O_NONBLOCK`).
fn private_file(path: &Path, append: bool) -> std::io::Result<File> {
    let flags = rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK;
    let mut o = std::fs::OpenOptions::new();
    if append {
        o.append(true);
    } else {
        o.write(true).truncate(true);
    }
    o.create(true)
        .mode(0o600)
        .custom_flags(flags.bits() as i32)
        .open(path)
}

/// The command hook's process as the service recorded it (`attempt-<n>.pid`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandRecord {
    /// Its pid (and process group).
    pub pid: u32,
    /// Its start time in clock ticks since boot.
    pub start_time: u64,
    /// The boot it ran in (`/proc/sys/kernel/random/boot_id`): after a reboot, pids and start
    /// times begin again, and the same pair names another process.
    pub boot_id: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_dir_keeps_the_job_and_its_attempts() {
        let d = tempfile::tempdir().unwrap();
        let dir = JobDir::new(d.path(), "0b8c");
        let job = JobFile {
            submission_id: "s".into(),
            run_id: "r".into(),
            queue: "local".into(),
            mode: "test".into(),
            build: BuildInfo {
                id: "0b8c".into(),
                number: 3,
                web_url: "file:///x".into(),
            },
            payload: "eJw=".into(),
            accepted_at: Utc::now(),
            ranked: false,
            pin: None,
        };
        dir.create(&job).unwrap();
        assert_eq!(dir.read().unwrap(), job);
        assert_eq!(dir.last_attempt(), None);
        for n in [1, 2, 10] {
            std::fs::create_dir_all(dir.attempt(n)).unwrap();
        }
        assert_eq!(dir.last_attempt(), Some(10));
        let p = ProcessId {
            pid: 42,
            start_time: 7,
        };
        assert_eq!(dir.read_process(10).unwrap(), None);
        dir.write_process(10, p).unwrap();
        let rec = dir.read_process(10).unwrap().unwrap();
        assert_eq!((rec.pid, rec.start_time), (42, 7));
        assert_eq!(rec.boot_id, boot_id());
        // The service's files are its alone, and none of them is in a checkout.
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(dir.path()), 0o700);
        assert_eq!(mode(&dir.path().join("job.json")), 0o600);
        assert_eq!(mode(&dir.path().join("attempt-10.pid")), 0o600);
        let mut log = dir.open_log(10).unwrap();
        writeln!(log, "one").unwrap();
        drop(log);
        writeln!(dir.open_log(10).unwrap(), "two").unwrap();
        assert_eq!(mode(&dir.log(10)), 0o600);
        assert!(!dir.log(10).starts_with(dir.attempt(10)));
        assert_eq!(dir.log_tail(10, 100), "one\ntwo");
        assert_eq!(dir.log_tail(10, 4), "two");
        assert_eq!(dir.log_tail(9, 4), "");
        // A link in a record's place is neither followed nor written through.
        let outside = d.path().join("outside");
        std::fs::write(&outside, "root's").unwrap();
        std::fs::remove_file(dir.log(10)).unwrap();
        std::os::unix::fs::symlink(&outside, dir.log(10)).unwrap();
        assert!(dir.open_log(10).is_err());
        assert!(dir.log_tail(10, 100).contains("symbolic link"));
        std::os::unix::fs::symlink(&outside, dir.path().join("attempt-11.pid")).unwrap();
        assert!(dir.write_process(11, p).is_err());
        assert!(matches!(dir.read_process(11), Err(ReadError::Link { .. })));
        assert_eq!(std::fs::read_to_string(&outside).unwrap(), "root's");
        // A job directory is never one that was there already.
        assert!(dir.create(&job).is_err());
        assert_eq!(list(d.path()), vec![dir.clone()]);
        dir.remove().unwrap();
        dir.remove().unwrap();
        assert!(list(d.path()).is_empty());
        assert!(!valid_build_id("../x") && !valid_build_id("") && valid_build_id("a-1"));
    }
}
