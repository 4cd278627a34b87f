//! What `environment` leaves for the job's later hooks: `<run dir>/jobs/<job id>.json`.
//!
//! The file is replaced atomically (a temporary file in the same directory, flushed to disk,
//! renamed over it, then the directory flushed), so a crash or a full disk leaves the old
//! state or the new one, never half a file that would make `pre-exit` lose track of a lease.

use std::collections::BTreeMap;
use std::path::PathBuf;

use kernelkite_topology::plan::Slice;
use serde::{Deserialize, Serialize};

use super::{JobError, Settings};
use crate::config::PluginConfig;
use crate::process::ProcessId;
use crate::sandbox::JobUser;

/// What `environment` leaves for the job's later hooks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobState {
    /// `BUILDKITE_JOB_ID`.
    pub job_id: String,
    /// `BUILDKITE_AGENT_NAME` of the agent running it.
    pub agent: String,
    /// The process that lives as long as the job.
    pub anchor: ProcessId,
    /// Leased GPU indices (slice numbers), ascending.
    pub gpus: Vec<u32>,
    /// Host device numbers of the job's GPUs (see
    /// [`device_indices`](super::devices::device_indices)); empty in state written by an older
    /// version, where the slice numbers stand in.
    #[serde(default)]
    pub device_indices: Vec<u32>,
    /// The job's slice (several planned slices merged when `gpus > 1`).
    pub slice: Slice,
    /// The step's configuration.
    pub config: PluginConfig,
    /// cgroup version holding the job, `None` when running unenforced (or docker mode).
    pub cgroup_version: Option<u8>,
    /// Clocks were locked and must be reset.
    pub clocks_locked: bool,
    /// Variables exported to the job.
    pub exports: BTreeMap<String, String>,
    /// Who the command runs as (host mode with the sandbox, docker mode); `None` when it runs
    /// as the agent's user.
    #[serde(default)]
    pub job_user: Option<JobUser>,
    /// The checkout and whose it is outside the command (the agent's user): `command` gives it
    /// to the job user, `pre-exit` gives it back.
    #[serde(default)]
    pub checkout_owner: Option<CheckoutOwner>,
}

/// The checkout and the owner it returns to after the command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckoutOwner {
    /// The checkout.
    pub path: PathBuf,
    /// Its owner's uid.
    pub uid: u32,
    /// Its owner's gid.
    pub gid: u32,
}

/// The directory holding every job's state.
pub fn jobs_dir(settings: &Settings) -> PathBuf {
    settings.run_dir.join(kernelkite_sys::node::JOB_STATE_DIR)
}

/// Where a job's state lives; the job id must be one that can name a cgroup.
pub fn state_path(settings: &Settings, job_id: &str) -> Result<PathBuf, JobError> {
    let name = crate::cgroup::job_cgroup_name(job_id)?;
    Ok(jobs_dir(settings).join(format!("{name}.json")))
}

/// The ids of the jobs that have a state file, in directory order; none when there is no
/// directory yet.
pub fn listed_jobs(settings: &Settings) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(jobs_dir(settings)) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_suffix(".json").map(str::to_string)
        })
        .collect()
}

/// Reads a job's state; `None` when there is none.
pub fn read_state(settings: &Settings, job_id: &str) -> Result<Option<JobState>, JobError> {
    let path = state_path(settings, job_id)?;
    match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|source| JobError::StateParse { path, source }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(JobError::StateRead { path, source }),
    }
}

/// Writes a job's state atomically and durably (see the module's documentation).
pub fn write_state(settings: &Settings, state: &JobState) -> Result<(), JobError> {
    let path = state_path(settings, &state.job_id)?;
    let dir = jobs_dir(settings);
    let written = std::fs::create_dir_all(&dir).and_then(|()| {
        let bytes = serde_json::to_vec(state).map_err(std::io::Error::other)?;
        // The temporary name does not end in `.json`: a half-written file is never taken
        // for a job's state.
        kernelkite_sys::fs::write_atomic(&path, &bytes, 0o600)
    });
    written.map_err(|source| JobError::StateWrite { path, source })
}

/// Removes a job's state; a job without state is fine.
pub fn remove_state(settings: &Settings, job_id: &str) -> Result<(), JobError> {
    let path = state_path(settings, job_id)?;
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(JobError::StateRemove { path, source: e })
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::test_support::state;

    #[test]
    fn state_is_replaced_whole_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let settings = Settings {
            run_dir: dir.path().join("run"),
            ..Settings::default()
        };
        assert_eq!(read_state(&settings, "job-1").unwrap(), None);
        let mut s = state("job-1");
        write_state(&settings, &s).unwrap();
        s.cgroup_version = None;
        write_state(&settings, &s).unwrap();
        assert_eq!(read_state(&settings, "job-1").unwrap(), Some(s));
        let names: Vec<String> = std::fs::read_dir(jobs_dir(&settings))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["job-1.json"]);
        assert_eq!(listed_jobs(&settings), vec!["job-1"]);
        remove_state(&settings, "job-1").unwrap();
        remove_state(&settings, "job-1").unwrap();
        assert_eq!(read_state(&settings, "job-1").unwrap(), None);
    }

    #[test]
    fn unreadable_or_unwritable_state_says_which_file() {
        let dir = tempfile::tempdir().unwrap();
        let settings = Settings {
            run_dir: dir.path().join("run"),
            ..Settings::default()
        };
        std::fs::create_dir_all(jobs_dir(&settings)).unwrap();
        std::fs::write(jobs_dir(&settings).join("job-2.json"), "{\"job_id\":").unwrap();
        let e = read_state(&settings, "job-2").unwrap_err();
        assert!(matches!(e, JobError::StateParse { .. }), "{e}");
        assert!(e.to_string().contains("job-2.json"), "{e}");
        // A job id that cannot name a file is refused before any path is built.
        assert!(read_state(&settings, "../x").is_err());
        // The run dir is a file: nothing can be written under it.
        let blocked = Settings {
            run_dir: dir.path().join("run/jobs/job-2.json"),
            ..Settings::default()
        };
        let e = write_state(&blocked, &state("job-3")).unwrap_err();
        let JobError::StateWrite { path, .. } = &e else {
            panic!("{e}")
        };
        assert!(path.ends_with("jobs/job-3.json"), "{e}");
    }
}
