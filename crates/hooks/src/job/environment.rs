//! The `environment` hook: clean up after lost jobs, lease the job's GPU(s), check them, record
//! the state, create the job's cgroup and hand the slice's variables to the job. Whatever fails
//! after the lease is undone here, before the error goes back to the agent.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use kernelkite_topology::plan::{Plan, Slice, SliceGpu};

use super::cleanup::{clean_job, clean_orphans};
use super::devices::{device_indices, job_devices, other_gpu_devices_exist};
use super::env::{agent_gpus, job_api_socket, job_config, var};
use super::error::Chain;
use super::exports::exports_for;
use super::slice::{job_slice, node_plan, pool_tiers, spread_notice};
use super::state::{read_state, write_state, JobState};
use super::{GpuOpener, JobError, Settings};
use crate::cgroup::{CgroupError, Cgroups, CharDevice, Limits};
use crate::config::{LockClocks, Mode, PluginConfig};
use crate::gpucheck;
use crate::jobapi::JobApi;
use crate::lease::{Holder, Want};
use crate::process;
use crate::sandbox::JobUser;

/// The result of the `environment` hook.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// What the job's later hooks will find.
    pub state: JobState,
    /// Lines for the job log (orphans cleaned, unenforced warnings, ...).
    pub notices: Vec<String>,
}

/// The `environment` hook: clean orphans, lease GPU(s), check and prepare the slice, record
/// the state. Every failure after the lease releases it.
// Long because the steps run in this order, and all after the lease is one chain undone on failure.
pub fn run(
    settings: &Settings,
    env: &BTreeMap<String, String>,
    gpu: GpuOpener<'_>,
) -> Result<Prepared, JobError> {
    let config = job_config(env)?;
    let job_id = var(env, "BUILDKITE_JOB_ID")?.to_string();
    // Before anything is held: a checkout the job's variables chose is never handed over.
    let checkout = super::env::checkout_path(env)?;
    crate::cgroup::job_cgroup_name(&job_id)?;
    let agent = env.get("BUILDKITE_AGENT_NAME").cloned().unwrap_or_default();
    let mut notices = Vec::new();
    // Before anything is held: a node whose runner is not the one the job expects is
    // refused, and the caller pauses its agent (super::version).
    if let Some(v) = super::version::check(
        env,
        config.mode,
        settings.runner.as_deref(),
        &settings.run_dir,
    )? {
        notices.push(format!("kernelkite-runner {v}, as the job expects"));
    }
    // Who runs the command is settled before anything is held: a missing user or a refused
    // root fails the job up front.
    let job_user = job_user(settings, &config, &mut notices)?;

    // Decided before anything is held: a broken cgroup set-up fails the job up front.
    let cgroups = detect_cgroups(settings, &config, &mut notices)?;

    let scan = clean_orphans(settings, &job_id, cgroups.as_ref(), gpu);
    for r in scan.cleaned {
        notices.push(format!("cleaned up after a lost job: {}", r.summary()));
    }
    if !scan.foreign.is_empty() {
        return Err(JobError::ForeignJobs {
            jobs: scan.foreign,
            run_dir: settings.run_dir.clone(),
        });
    }

    // Hooks may run twice for one job (agent-level hook and plugin); the last config wins.
    if let Some(prev) = read_state(settings, &job_id)? {
        if prev.config == config {
            return Ok(Prepared {
                state: prev,
                notices,
            });
        }
        let r = clean_job(settings, &job_id, cgroups.as_ref(), gpu);
        tracing::info!("replacing this job's earlier preparation: {}", r.summary());
    }

    let anchor = process::job_anchor(&settings.proc_root, std::process::id(), settings.job_pid)
        .ok_or(JobError::NoAnchor)?;
    let plan = node_plan(settings)?;
    let want = wanted_gpus(env, &config, &plan)?;
    let me = Holder {
        job_id: job_id.clone(),
        agent: agent.clone(),
        anchor,
    };
    let leases = settings.leases();
    let gpus = leases.acquire(&want, &me, Duration::from_secs(config.lease_wait_secs))?;
    if matches!(want, Want::Pool { .. }) {
        notices.extend(spread_notice(&plan, &gpus));
    }

    // Clocks locked before the state that records them is on disk must still be reset if
    // writing it fails.
    let mut locked_gpus: Vec<SliceGpu> = Vec::new();
    let prepared = job_slice(&plan, &gpus, &config, &settings.sysfs_root)
        .and_then(|slice| {
            // Before anything is held: a MIG device the node no longer has is refused.
            super::mig::check_current(settings, &slice)?;
            let locked = check_gpus(&config, &slice, gpu, &mut notices)?;
            Ok((slice, locked))
        })
        .and_then(|(slice, clocks_locked)| {
            if clocks_locked {
                locked_gpus = gpucheck::clock_owned(&slice.gpus());
            }
            let job_user = slice_identity(job_user.clone(), &config, slice.index)?;
            // CPU-only slices have no devices; their slice numbers stand in, as before.
            let mut devices = device_indices(&plan, &slice);
            if devices.is_empty() {
                devices = gpus.clone();
            }
            check_sizes_fit(&config, &slice)?;
            let mut state = JobState {
                job_id: job_id.clone(),
                agent,
                anchor,
                exports: exports_for(
                    &slice,
                    &devices,
                    config.mode == Mode::Host && settings.sandbox,
                ),
                gpus: gpus.clone(),
                device_indices: devices,
                slice,
                config: config.clone(),
                // What the job's cgroup will be, recorded with the state's one write: only a
                // failure `allow-unenforced` lets through changes it (written again then).
                cgroup_version: cgroups
                    .as_ref()
                    .filter(|_| config.mode == Mode::Host)
                    .map(Cgroups::version),
                clocks_locked,
                job_user: job_user.clone(),
                checkout_owner: checkout_owner(checkout.as_deref(), &config, job_user.as_ref()),
            };
            // The state goes first: a job cgroup without state is an orphan to other jobs.
            write_state(settings, &state)?;
            if config.mode == Mode::Host && settings.sandbox {
                restrict_run_dir(&settings.run_dir);
            }
            if config.mode == Mode::Host {
                // Deny every device but the base set and the job's own GPU nodes (a few rules,
                // whatever the node's size): on cgroup v1 always, so that a device node the
                // job finds outside its /dev (a disk's, in a directory the host left open)
                // is refused whatever its mode; on v2, which restricts devices through BPF
                // only, where there is another GPU to keep out (the hierarchy warns then).
                let v1 = cgroups.as_ref().is_some_and(|c| c.version() == 1);
                let allow = (v1
                    || other_gpu_devices_exist(&settings.sysfs_root, &plan, &state.slice))
                .then(|| job_devices(&settings.sysfs_root, &state.slice));
                let made = create_cgroup(
                    &job_id,
                    &config,
                    &state.slice,
                    allow,
                    cgroups.as_ref(),
                    &mut notices,
                )?;
                if made != state.cgroup_version {
                    state.cgroup_version = made;
                    write_state(settings, &state)?;
                }
            }
            Ok(state)
        });
    match prepared {
        Ok(state) => Ok(Prepared { state, notices }),
        Err(e) => {
            undo_failed(
                settings,
                &job_id,
                cgroups.as_ref(),
                &gpus,
                &locked_gpus,
                gpu,
            );
            Err(e)
        }
    }
}

/// The node's cgroups; `None` where they cannot be used and the job may run unenforced (docker
/// mode, or `allow-unenforced`), with a warning in host mode.
fn detect_cgroups(
    settings: &Settings,
    config: &PluginConfig,
    notices: &mut Vec<String>,
) -> Result<Option<Cgroups>, JobError> {
    match Cgroups::detect_with(&settings.cgroup_root, &settings.proc_root) {
        Ok(c) => Ok(Some(c)),
        Err(e) if config.mode == Mode::Host && !config.allow_unenforced => Err(e.into()),
        Err(e) => {
            if config.mode == Mode::Host {
                notices.push(format!("WARNING: {}", Chain(&e)));
            }
            Ok(None)
        }
    }
}

/// The job's tmpfs sizes (`tmp-size`, `shm-size`) must fit in its slice's memory limit.
fn check_sizes_fit(config: &PluginConfig, slice: &Slice) -> Result<(), JobError> {
    for (key, asked) in [("tmp-size", config.tmp_size), ("shm-size", config.shm_size)] {
        if let Some(asked) = asked.filter(|a| *a > slice.memory_bytes) {
            return Err(JobError::OverSlice {
                key,
                asked: format!("{asked} bytes"),
                has: format!("a memory limit of {} bytes", slice.memory_bytes),
            });
        }
    }
    Ok(())
}

/// The default job user becomes the slice's own identity (`sandbox::user::for_slice`): one uid
/// per slice, so no two concurrent jobs share one. A user the step names stays as named.
pub(super) fn slice_identity(
    user: Option<JobUser>,
    config: &PluginConfig,
    slice: u32,
) -> Result<Option<JobUser>, JobError> {
    match user {
        Some(u)
            if config.user == crate::config::DEFAULT_JOB_USER
                && !u.is_root()
                && rustix::process::geteuid().is_root() =>
        {
            let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
            crate::sandbox::user::for_slice(&passwd, slice)
                .map(Some)
                .map_err(|e| JobError::Sandbox(e.to_string()))
        }
        other => Ok(other),
    }
}

/// Who the command will run as: the step's `user` (default `kernelkite-job`, whose slice's own
/// identity [`slice_identity`] settles once the slice is leased) in host mode with the sandbox
/// and in docker mode; `None` (the agent's user) in host mode without it. Root is refused
/// unless the step allows it, and the sandbox needs the hooks to be root.
pub(super) fn job_user(
    settings: &Settings,
    config: &PluginConfig,
    notices: &mut Vec<String>,
) -> Result<Option<JobUser>, JobError> {
    if config.mode == Mode::Host && !settings.sandbox {
        return Ok(None);
    }
    let me = rustix::process::geteuid();
    if config.mode == Mode::Host && !me.is_root() {
        return Err(JobError::SandboxNeedsRoot { uid: me.as_raw() });
    }
    if !me.is_root() {
        // Only root can hand the checkout to another user: the container runs as the agent's
        // own user, which owns the checkout already (docker still confines it).
        let gid = rustix::process::getegid().as_raw();
        notices.push(format!(
            "the hooks are not root: the container runs as the agent's user (uid {}) instead of `user: {}`",
            me.as_raw(),
            config.user
        ));
        return Ok(Some(JobUser {
            name: format!("uid {}", me.as_raw()),
            uid: me.as_raw(),
            gid,
        }));
    }
    if config.user == crate::config::DEFAULT_JOB_USER {
        // The slice's own identity, settled once the slice is leased (`slice_identity`): no
        // account needs to exist for it.
        let id = crate::sandbox::user::SLICE_ID_BASE;
        return Ok(Some(JobUser {
            name: config.user.clone(),
            uid: id,
            gid: id,
        }));
    }
    let user = crate::sandbox::user::resolve(Path::new("/"), &config.user)?;
    if user.is_root() {
        if !config.allow_root {
            return Err(JobError::RootRefused {
                user: config.user.clone(),
            });
        }
        notices.push(format!(
            "WARNING: the command will run as root ({}, allow-root: true)",
            config.user
        ));
    }
    Ok(Some(user))
}

/// Where the checkout will be and whose it is to be again after the command: the agent's (these
/// hooks' user). Recorded now, before the agent checks out, so that `command` need not write
/// the state again and a lost job's clean-up still knows what to give back. `None` when the
/// command runs as the agent's user or the checkout is not mounted into the container.
fn checkout_owner(
    checkout: Option<&Path>,
    config: &PluginConfig,
    job_user: Option<&JobUser>,
) -> Option<crate::job::state::CheckoutOwner> {
    job_user?;
    if config.mode == Mode::Docker && !config.mount_checkout {
        return None;
    }
    let path = checkout?;
    Some(crate::job::state::CheckoutOwner {
        path: path.into(),
        uid: rustix::process::geteuid().as_raw(),
        gid: rustix::process::getegid().as_raw(),
    })
}

/// The run dir holds every job's state and the node's leases: root's alone, so that a job
/// that somehow reached it could not read it (the sandbox also hides it).
fn restrict_run_dir(run_dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(run_dir) {
        if meta.permissions().mode() & 0o077 != 0 {
            let _ = std::fs::set_permissions(run_dir, std::fs::Permissions::from_mode(0o700));
        }
    }
}

/// Undoes a failed `environment` after the lease: what [`clean_job`] finds from the state,
/// the clocks of `locked_gpus` (locked before a state could record them) and the lease of
/// `gpus` itself.
fn undo_failed(
    settings: &Settings,
    job_id: &str,
    cgroups: Option<&Cgroups>,
    gpus: &[u32],
    locked_gpus: &[SliceGpu],
    gpu: GpuOpener<'_>,
) {
    let r = clean_job(settings, job_id, cgroups, gpu);
    if !r.clocks_reset && !locked_gpus.is_empty() {
        if let Err(reset) =
            gpu().and_then(|mut ctl| gpucheck::reset_clocks(ctl.as_mut(), locked_gpus))
        {
            // The job fails with the error that stopped it; this goes to the log beside it.
            tracing::warn!("could not reset GPU clocks: {reset}");
        }
    }
    let _ = settings.leases().release(gpus, job_id);
    tracing::info!("environment failed, undone: {}", r.summary());
}

/// Hands the job's variables to it through the agent's Job API (binary hooks cannot
/// `export`). A job that cannot be told its slice must not run: a failed export undoes
/// everything [`run`] did.
pub fn export_through_job_api(
    settings: &Settings,
    state: &JobState,
    env: &BTreeMap<String, String>,
    gpu: GpuOpener<'_>,
) -> Result<(), JobError> {
    let exported = job_api_socket(env)
        .ok_or(JobError::NoJobApi)
        .and_then(|socket| {
            let token = env
                .get("BUILDKITE_AGENT_JOB_API_TOKEN")
                .ok_or(JobError::NoJobApiToken)?;
            JobApi::new(Path::new(socket), token)
                .patch_env(&state.exports)
                .map_err(JobError::Export)
        });
    if exported.is_err() {
        let cgroups = Cgroups::detect_with(&settings.cgroup_root, &settings.proc_root).ok();
        let r = clean_job(settings, &state.job_id, cgroups.as_ref(), gpu);
        tracing::info!("undone: {}", r.summary());
    }
    exported
}

/// Which GPU(s) to lease: the ones the agent is bound to (their number must match `gpus`, and
/// the plan must have them), else `gpus` of the node's pool, one vendor's and neighbours where
/// it can ([`pool_tiers`]).
fn wanted_gpus(
    env: &BTreeMap<String, String>,
    config: &PluginConfig,
    plan: &Plan,
) -> Result<Want, JobError> {
    let candidates: Vec<u32> = plan.slices.iter().map(|s| s.index).collect();
    match agent_gpus(env)? {
        Some(bound) if config.gpus.is_some_and(|n| n as usize != bound.len()) => {
            Err(JobError::GpuCountMismatch {
                bound: bound.len(),
                wanted: config.gpus.unwrap_or(1),
            })
        }
        Some(bound) => {
            if let Some(&missing) = bound.iter().find(|g| !candidates.contains(g)) {
                return Err(JobError::NoSuchSlice { bound, missing });
            }
            Ok(Want::Exactly(bound))
        }
        None => {
            let count = config.gpus.unwrap_or(1);
            Ok(Want::Pool {
                count,
                tiers: pool_tiers(plan, count)?,
            })
        }
    }
}

/// The step's GPU checks (`require-idle-gpu`) and clock locking (`lock-clocks`); true when
/// clocks were locked. The driver is opened only when one of them is asked for.
fn check_gpus(
    config: &PluginConfig,
    slice: &Slice,
    gpu: GpuOpener<'_>,
    notices: &mut Vec<String>,
) -> Result<bool, JobError> {
    if !config.require_idle_gpu && config.lock_clocks.is_none() {
        return Ok(false);
    }
    let slice_gpus: Vec<SliceGpu> = slice.gpus().into_iter().cloned().collect();
    let mut ctl = gpu()?;
    if config.require_idle_gpu {
        gpucheck::require_idle(ctl.as_mut(), &slice_gpus, config.idle_memory_mib)?;
    }
    let Some(lock) = config.lock_clocks else {
        return Ok(false);
    };
    let mhz = match lock {
        LockClocks::Max => None,
        LockClocks::Mhz(m) => Some(m),
    };
    // A MIG device's clock is its GPU's, which the other MIG devices' jobs share: one job
    // must not set it for them (nor reset it under them at its end).
    let own = gpucheck::clock_owned(&slice.gpus());
    for g in slice_gpus.iter().filter(|g| g.mig.is_some()) {
        notices.push(format!(
            "lock-clocks skipped for GPU {}: it is in MIG mode, and its clock is shared by every MIG device on it (lock it for the whole node with `nvidia-smi -lgc` instead)",
            g.pci_bus_id
        ));
    }
    if own.is_empty() {
        return Ok(false);
    }
    let set = gpucheck::lock_clocks(ctl.as_mut(), &own, mhz)?;
    notices.push(format!("locked graphics clocks at {set:?} MHz"));
    Ok(true)
}

/// Creates the job's cgroup; with `allow-unenforced`, a failure becomes a loud warning.
fn create_cgroup(
    job_id: &str,
    config: &PluginConfig,
    slice: &Slice,
    allow_devices: Option<Vec<CharDevice>>,
    cgroups: Option<&Cgroups>,
    notices: &mut Vec<String>,
) -> Result<Option<u8>, JobError> {
    let limits = Limits {
        cpus: slice.cpus.clone(),
        mems: slice.mems.clone(),
        memory_bytes: slice.memory_bytes,
        pids: config.pids_limit,
        allow_devices,
    };
    let created = match cgroups {
        Some(cg) => cg.create(job_id, &limits).map(|w| (cg.version(), w)),
        None => Err(CgroupError::Unavailable("cgroups were not detected".into())),
    };
    match created {
        Ok((version, warnings)) => {
            notices.extend(warnings.into_iter().map(|w| format!("warning: {w}")));
            Ok(Some(version))
        }
        Err(e) if config.allow_unenforced => {
            if let Some(cg) = cgroups {
                let _ = cg.clean_up(job_id);
            }
            notices.push(format!(
                "WARNING: RUNNING UNENFORCED (allow-unenforced: true): no CPU, memory or pids limits for this job: {}",
                Chain(&e)
            ));
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpucheck::GpuControl;
    use crate::job::state::jobs_dir;
    use crate::job::test_support::{env, fake_node, FakeDriver};
    use crate::lease::Leases;

    #[test]
    fn the_state_records_the_cgroup_it_will_have_and_what_allow_unenforced_leaves() {
        let (_dir, settings) = fake_node();
        let driver = FakeDriver::default();
        let mut open = move || Ok(Box::new(driver.clone()) as Box<dyn GpuControl>);
        let e = env(&[("BUILDKITE_JOB_ID", "job-cg")]);
        let prepared = run(&settings, &e, &mut open).unwrap();
        assert_eq!(prepared.state.cgroup_version, Some(2));
        let stored = crate::job::state::read_state(&settings, "job-cg")
            .unwrap()
            .unwrap();
        assert_eq!(stored.cgroup_version, Some(2));
        crate::job::pre_exit::run(&settings, &e, &mut open).unwrap();
        // The cgroups are there but the job's cannot be made: with `allow-unenforced` the job
        // runs without one, and its state says so (the command hook warns from it).
        let parent = settings.cgroup_root.join("sys/fs/cgroup/kernelkite");
        std::fs::remove_dir_all(&parent).unwrap();
        std::fs::write(&parent, "not a directory").unwrap();
        let e = env(&[
            ("BUILDKITE_JOB_ID", "job-uncg"),
            (
                "BUILDKITE_PLUGIN_CONFIGURATION",
                r#"{"allow-unenforced":true}"#,
            ),
        ]);
        let prepared = run(&settings, &e, &mut open).unwrap();
        assert_eq!(prepared.state.cgroup_version, None);
        assert!(
            prepared
                .notices
                .iter()
                .any(|n| n.contains("RUNNING UNENFORCED")),
            "{:?}",
            prepared.notices
        );
        let stored = crate::job::state::read_state(&settings, "job-uncg")
            .unwrap()
            .unwrap();
        assert_eq!(stored.cgroup_version, None);
    }

    #[test]
    fn clocks_are_reset_when_the_state_cannot_be_written() {
        let (_dir, settings) = fake_node();
        // The jobs directory is a dangling link: there is no state to read, and none can be
        // written.
        std::fs::create_dir_all(&settings.run_dir).unwrap();
        std::os::unix::fs::symlink(settings.run_dir.join("gone"), jobs_dir(&settings)).unwrap();
        let driver = FakeDriver::default();
        let d = driver.clone();
        let mut open = move || Ok(Box::new(d.clone()) as Box<dyn GpuControl>);
        let e = env(&[
            ("BUILDKITE_JOB_ID", "job-nostate"),
            ("BUILDKITE_PLUGIN_CONFIGURATION", r#"{"lock-clocks":1410}"#),
        ]);
        assert!(run(&settings, &e, &mut open).is_err());
        assert_eq!(
            *driver.log.lock().unwrap(),
            vec!["lock 0000:18:00.0 1410", "reset 0000:18:00.0"]
        );
        let leases = Leases::new(&settings.run_dir, &settings.proc_root);
        assert!(leases.holder(0).unwrap().is_none());
    }

    #[test]
    fn busy_gpu_fails_the_job_and_releases_its_lease() {
        let (_dir, settings) = fake_node();
        let busy = FakeDriver {
            busy_pid: Some(777),
            ..Default::default()
        };
        let mut open = move || Ok(Box::new(busy.clone()) as Box<dyn GpuControl>);
        let e = env(&[
            ("BUILDKITE_JOB_ID", "job-busy"),
            (
                "BUILDKITE_PLUGIN_CONFIGURATION",
                r#"{"require-idle-gpu":true}"#,
            ),
        ]);
        let err = run(&settings, &e, &mut open).unwrap_err().to_string();
        assert!(err.contains("pid 777"), "{err}");
        let leases = Leases::new(&settings.run_dir, &settings.proc_root);
        assert!(
            leases.holder(0).unwrap().is_none(),
            "the lease must be released"
        );
        assert!(read_state(&settings, "job-busy").unwrap().is_none());
    }

    #[test]
    fn a_job_that_cannot_be_told_its_slice_is_undone() {
        let (_dir, settings) = fake_node();
        let mut open = || Ok(Box::new(FakeDriver::default()) as Box<dyn GpuControl>);
        let e = env(&[("BUILDKITE_JOB_ID", "job-export")]);
        let prepared = run(&settings, &e, &mut open).unwrap();
        let leases = Leases::new(&settings.run_dir, &settings.proc_root);
        assert!(leases.holder(0).unwrap().is_some());
        // No Job API: the export fails, and the lease and state are gone with it.
        let err = export_through_job_api(&settings, &prepared.state, &e, &mut open).unwrap_err();
        assert!(matches!(err, JobError::NoJobApi), "{err}");
        assert!(leases.holder(0).unwrap().is_none());
        assert!(read_state(&settings, "job-export").unwrap().is_none());
        // A socket nobody serves: the connection error is kept as the cause.
        run(&settings, &e, &mut open).unwrap();
        let with_api = env(&[
            ("BUILDKITE_JOB_ID", "job-export"),
            (
                "BUILDKITE_AGENT_JOB_API_SOCKET",
                "/nonexistent/job-api.sock",
            ),
            ("BUILDKITE_AGENT_JOB_API_TOKEN", "t"),
        ]);
        let err =
            export_through_job_api(&settings, &prepared.state, &with_api, &mut open).unwrap_err();
        let text = Chain(&err).to_string();
        assert!(
            text.starts_with("cannot export the job's slice through the Job API: cannot reach the Job API at /nonexistent/job-api.sock"),
            "{text}"
        );
        assert!(leases.holder(0).unwrap().is_none());
    }
}
