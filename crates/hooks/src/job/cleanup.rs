//! Undoing a job: what `pre-exit` runs for its own job, `environment` for jobs whose process is
//! gone (agent lost mid-run) and for its own half-done preparation. Idempotent, and it keeps
//! going past failures, reporting each.

use std::process::Command;

use serde::Serialize;

use super::error::Chain;
use super::state::{listed_jobs, read_state, remove_state, state_path, CheckoutOwner};
use super::{GpuOpener, JobError, Settings};
use crate::cgroup::Cgroups;
use crate::config::Mode;
use crate::docker;
use crate::gpucheck;
use crate::process;
use crate::sandbox::ownership;

/// What `pre-exit` (or orphan clean-up) did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CleanupReport {
    /// The job cleaned up after.
    pub job_id: String,
    /// Processes killed (the job's leftovers).
    pub killed: Vec<u32>,
    /// The job's cgroup was removed.
    pub cgroup_removed: bool,
    /// GPU leases released.
    pub released: Vec<u32>,
    /// Locked GPU clocks were reset.
    pub clocks_reset: bool,
    /// The job's container was removed (docker mode).
    pub container_removed: bool,
    /// The checkout went back to its owner from before the command (the job user had it).
    pub checkout_returned: bool,
    /// What could not be cleaned up, one sentence each.
    pub problems: Vec<String>,
}

impl CleanupReport {
    /// One line for the job log.
    pub fn summary(&self) -> String {
        let mut parts = Vec::new();
        if !self.killed.is_empty() {
            let pids: Vec<String> = self.killed.iter().map(u32::to_string).collect();
            parts.push(format!(
                "killed {} leftover process(es): {}",
                self.killed.len(),
                pids.join(", ")
            ));
        }
        if self.cgroup_removed {
            parts.push("removed the job cgroup".into());
        }
        if !self.released.is_empty() {
            parts.push(format!("released GPU lease(s) {:?}", self.released));
        }
        if self.clocks_reset {
            parts.push("reset GPU clocks".into());
        }
        if self.container_removed {
            parts.push("removed the job's container".into());
        }
        if self.checkout_returned {
            parts.push("returned the checkout to its owner".into());
        }
        for p in &self.problems {
            parts.push(format!("PROBLEM: {p}"));
        }
        if parts.is_empty() {
            parts.push("nothing to clean up".into());
        }
        format!("job {}: {}", self.job_id, parts.join("; "))
    }

    fn problem(&mut self, e: &(dyn std::error::Error + 'static)) {
        self.problems.push(Chain(e).to_string());
    }
}

/// Removes the job's container (docker mode); one already gone is no problem.
fn remove_container(settings: &Settings, job_id: &str, report: &mut CleanupReport) {
    let out = Command::new(&settings.docker)
        .args(["rm", "--force", &docker::container_name(job_id)])
        .output();
    match out {
        Ok(o) if o.status.success() => report.container_removed = true,
        Ok(o) => {
            let err = String::from_utf8_lossy(&o.stderr);
            if !err.contains("No such container") {
                report.problems.push(format!("docker rm: {}", err.trim()));
            }
        }
        Err(e) => report
            .problems
            .push(format!("cannot run {}: {e}", settings.docker.display())),
    }
}

/// Undoes everything a job did to the node; idempotent, keeps going past failures and
/// reports them. Works from the state file when there is one, else from the job id alone.
pub fn clean_job(
    settings: &Settings,
    job_id: &str,
    cgroups: Option<&Cgroups>,
    gpu: GpuOpener<'_>,
) -> CleanupReport {
    let mut report = CleanupReport {
        job_id: job_id.to_string(),
        ..Default::default()
    };
    let state = match read_state(settings, job_id) {
        Ok(s) => s,
        Err(e) => {
            report.problem(&e);
            None
        }
    };
    if state
        .as_ref()
        .is_some_and(|s| s.config.mode == Mode::Docker)
    {
        remove_container(settings, job_id, &mut report);
    }
    if let Some(cg) = cgroups {
        match cg.clean_up(job_id) {
            Ok(c) => {
                report.killed = c.killed;
                report.cgroup_removed = c.removed;
            }
            Err(e) => report.problem(&e),
        }
    }
    // A `network: true` job's network (its command hook takes it down, unless it was killed).
    crate::uplink::close(
        &settings.run_dir,
        job_id,
        state.as_ref().map(|s| s.slice.index),
    );
    // After the kill: nothing of the job is left to race the walk.
    // Only a checkout the command was handed (its top is no longer its owner's) is walked: a
    // job that never got to its command leaves nothing to give back.
    let handed_over = |o: &CheckoutOwner| {
        ownership::owner(&o.path).is_ok_and(|(uid, gid)| (uid, gid) != (o.uid, o.gid))
    };
    if let Some(o) = state
        .as_ref()
        .and_then(|s| s.checkout_owner.as_ref())
        .filter(|o| handed_over(o))
    {
        match ownership::chown_tree(&o.path, o.uid, o.gid) {
            Ok(_) => report.checkout_returned = true,
            // The agent removed the checkout: nothing to give back.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => report.problems.push(format!(
                "cannot give the checkout {} back to uid {}: {e}",
                o.path.display(),
                o.uid
            )),
        }
    }
    if let Some(s) = state.as_ref().filter(|s| s.clocks_locked) {
        let gpus = gpucheck::clock_owned(&s.slice.gpus());
        match gpu().and_then(|mut ctl| gpucheck::reset_clocks(ctl.as_mut(), &gpus)) {
            Ok(()) => report.clocks_reset = true,
            Err(e) => report.problem(&e),
        }
    }
    let released = match &state {
        Some(s) => settings.leases().release(&s.gpus, job_id),
        None => settings.leases().release_all(job_id),
    };
    match released {
        Ok(r) => report.released = r,
        Err(e) => report.problem(&e),
    }
    // A job id that cannot name a state file has none to remove.
    if let Err(e @ JobError::StateRemove { .. }) = remove_state(settings, job_id) {
        report.problem(&e);
    }
    report
}

/// How old an empty job cgroup without state must be before it is taken for a lost job's: a
/// job of another instance spends its checkout (minutes, for a large repository) between the
/// `environment` hook that made its cgroup and the `command` hook that fills it.
pub const STALE_EMPTY_CGROUP: std::time::Duration = std::time::Duration::from_secs(3600);

/// Whether `job`'s cgroup directory was made more than [`STALE_EMPTY_CGROUP`] ago (a cgroup
/// directory's modification time is its creation, or its last child's).
fn stale(cg: &Cgroups, job: &str) -> bool {
    let made = cg
        .procs_files(job)
        .ok()
        .and_then(|files| files.first()?.parent().map(std::path::Path::to_path_buf))
        .and_then(|dir| std::fs::metadata(dir).ok()?.modified().ok());
    made.and_then(|t| t.elapsed().ok())
        .is_some_and(|age| age > STALE_EMPTY_CGROUP)
}

/// What [`clean_orphans`] did, and what it would not touch.
#[derive(Debug, Default)]
pub struct OrphanScan {
    /// Lost jobs cleaned up.
    pub cleaned: Vec<CleanupReport>,
    /// Job cgroups with running processes and no state in this run dir: jobs of another
    /// kernelkite instance (another run dir) on this node, never taken for lost ones.
    pub foreign: Vec<String>,
}

/// Cleans up after jobs whose process is gone: state files whose anchor died, and empty job
/// cgroups with no state at all, made over an hour ago. A job cgroup with running processes
/// and no state here is never killed: it is listed in [`OrphanScan::foreign`] (another
/// instance's job) for the caller to refuse to run beside. `me` is never touched.
pub fn clean_orphans(
    settings: &Settings,
    me: &str,
    cgroups: Option<&Cgroups>,
    gpu: GpuOpener<'_>,
) -> OrphanScan {
    let mut scan = OrphanScan::default();
    let known = listed_jobs(settings);
    for job in known.iter().filter(|j| *j != me) {
        let orphaned = match read_state(settings, job) {
            // Lost only when its anchor is really gone (pid and start time: a reused pid is
            // not the anchor).
            Ok(Some(s)) => !process::is_alive(&settings.proc_root, s.anchor),
            Ok(None) => false,
            // Unreadable state cannot belong to a job that could use it.
            Err(_) => true,
        };
        if orphaned {
            scan.cleaned.push(clean_job(settings, job, cgroups, gpu));
        }
    }
    if let Some(cg) = cgroups {
        for job in cg.jobs() {
            // A job writes its state before it creates its cgroup, so a state file that
            // appeared since the listing above belongs to a job starting right now.
            let has_state = state_path(settings, &job)
                .map(|p| p.exists())
                .unwrap_or(false);
            if job == me || known.contains(&job) || has_state {
                continue;
            }
            if cg.pids(&job).is_ok_and(|p| !p.is_empty()) {
                scan.foreign.push(job);
            } else if stale(cg, &job) {
                scan.cleaned.push(clean_job(settings, &job, cgroups, gpu));
            }
            // An empty one made lately may be another instance's job between its
            // `environment` and its `command` (its checkout can take minutes): left alone.
        }
    }
    scan
}
