//! A local job's directory, `<local dir>/jobs/<build id>/`: what the job is (`job.json`, the
//! payload included, so a restarted service can run it again), and one `attempt-<n>/` per run
//! of it (the hooks' checkout directory: `result.json`, the runner's `work/`, the hooks' log,
//! and `command.pid`, the command hook's process while it runs).

use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::hooks::ProcessId;
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

    /// Creates the directory and writes `job.json` (atomically: a reader never sees half).
    pub fn create(&self, job: &JobFile) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.root)?;
        let tmp = self.root.join(".job.json.tmp");
        std::fs::write(&tmp, serde_json::to_vec(job)?)?;
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

    /// Where attempt `n`'s runner writes `result.json`.
    pub fn result(&self, n: u32) -> PathBuf {
        self.attempt(n).join("result.json")
    }

    /// Where attempt `n`'s hooks log.
    pub fn log(&self, n: u32) -> PathBuf {
        self.attempt(n).join("job.log")
    }

    /// Records the command hook's process of attempt `n`, so a restarted service can stop it.
    pub fn write_process(&self, n: u32, p: ProcessId) -> std::io::Result<()> {
        std::fs::write(self.attempt(n).join("command.pid"), serde_json::to_vec(&p)?)
    }

    /// The command hook's process of attempt `n`, if one was recorded.
    pub fn read_process(&self, n: u32) -> Option<ProcessId> {
        let bytes = std::fs::read(self.attempt(n).join("command.pid")).ok()?;
        serde_json::from_slice(&bytes).ok()
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

/// The last `max` bytes of a log, on a character boundary, for an error message.
pub fn tail(path: &Path, max: usize) -> String {
    let Ok(bytes) = std::fs::read(path) else {
        return String::new();
    };
    let start = bytes.len().saturating_sub(max);
    let text = String::from_utf8_lossy(&bytes[start..]);
    text.trim().to_string()
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
        dir.write_process(10, p).unwrap();
        assert_eq!(dir.read_process(10), Some(p));
        assert_eq!(list(d.path()), vec![dir.clone()]);
        dir.remove().unwrap();
        dir.remove().unwrap();
        assert!(list(d.path()).is_empty());
        assert!(!valid_build_id("../x") && !valid_build_id("") && valid_build_id("a-1"));
    }
}
