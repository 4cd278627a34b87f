//! The `command` hook: run `BUILDKITE_COMMAND` held to the job's slice, in its cgroup (host
//! mode) or in a container holding only its GPU(s), CPUs and memory (docker mode), and report
//! how it ended. Nothing here needs undoing: what the command leaves is `pre-exit`'s.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use kernelkite_topology::plan::Vendor;

use super::env::var;
use super::state::{jobs_dir, read_state, JobState};
use super::{JobError, Settings};
use crate::cgroup::Cgroups;
use crate::config::{ConfigError, Mode};
use crate::confine::{self, Confinement};
use crate::docker;

/// Exit status of a command as the agent reports it: the code, or 128 + the signal.
fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1)
}

/// The result of the `command` hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandOutcome {
    /// The hook's exit status: the command's, 128 + the signal that killed it.
    pub exit_code: i32,
    /// Lines for the job log (OOM kills, unenforced warnings).
    pub notices: Vec<String>,
}

/// The shell the agent would run the command with (`BUILDKITE_SHELL`, default
/// `/bin/bash -e -c`).
fn shell_words(env: &BTreeMap<String, String>) -> Vec<String> {
    let shell = env
        .get("BUILDKITE_SHELL")
        .map(String::as_str)
        .filter(|s| !s.trim().is_empty())
        .unwrap_or("/bin/bash -e -c");
    shell.split_whitespace().map(str::to_string).collect()
}

/// The docker invocation for a prepared job.
pub fn docker_run_for(
    settings: &Settings,
    state: &JobState,
    env: &BTreeMap<String, String>,
    command: &str,
) -> Result<Vec<String>, JobError> {
    let c = &state.config;
    let image = c
        .image
        .clone()
        .ok_or_else(|| ConfigError::new("image", "required when mode is \"docker\""))?;
    let checkout = if c.mount_checkout {
        Some(
            env.get("BUILDKITE_BUILD_CHECKOUT_PATH")
                .map(PathBuf::from)
                .or_else(|| std::env::current_dir().ok())
                .unwrap_or_else(|| PathBuf::from(".")),
        )
    } else {
        None
    };
    let mut job_env = env.clone();
    job_env.extend(state.exports.clone());
    let run = docker::DockerRun {
        job_id: state.job_id.clone(),
        image,
        slice: state.slice.clone(),
        pids_limit: c.pids_limit,
        network: c.network_allowed(),
        checkout,
        workdir: c.workdir.clone(),
        amd_render_nodes: docker::slice_gpus(&state.slice)
            .iter()
            .filter(|g| g.vendor == Vendor::Amd)
            .filter_map(|g| docker::amd_render_node(&settings.sysfs_root, &g.pci_bus_id))
            .collect(),
        env_names: docker::pass_through_names(&job_env, &c.environment),
        env_overrides: docker::container_device_env(&state.slice),
        extra_args: c.docker_args.clone(),
        command: command.to_string(),
    };
    let devices = if state.device_indices.is_empty() {
        &state.gpus
    } else {
        &state.device_indices
    };
    Ok(docker::run_args(&run, devices))
}

/// The `command` hook: runs `BUILDKITE_COMMAND` held to the job's slice and reports how it ended.
pub fn run(
    settings: &Settings,
    env: &BTreeMap<String, String>,
) -> Result<CommandOutcome, JobError> {
    let job_id = var(env, "BUILDKITE_JOB_ID")?;
    let state = read_state(settings, job_id)?.ok_or_else(|| JobError::NoState {
        job_id: job_id.to_string(),
        dir: jobs_dir(settings),
    })?;
    // A step made only of plugins has no command; the agent then has nothing to run either.
    let Some(command) = env
        .get("BUILDKITE_COMMAND")
        .map(String::as_str)
        .filter(|c| !c.trim().is_empty())
    else {
        return Ok(CommandOutcome {
            exit_code: 0,
            notices: vec!["the step has no command; nothing to run".into()],
        });
    };
    let mut child_env = env.clone();
    child_env.extend(state.exports.clone());
    match state.config.mode {
        Mode::Docker => in_container(settings, &state, env, command, &child_env),
        Mode::Host => on_host(settings, &state, env, command, &child_env),
    }
}

/// Docker mode: `docker run` with only the job's GPU(s), CPUs and memory.
fn in_container(
    settings: &Settings,
    state: &JobState,
    env: &BTreeMap<String, String>,
    command: &str,
    child_env: &BTreeMap<String, String>,
) -> Result<CommandOutcome, JobError> {
    let mut notices = Vec::new();
    let args = docker_run_for(settings, state, env, command)?;
    let status = Command::new(&settings.docker)
        .args(&args)
        .env_clear()
        .envs(child_env)
        .status()
        .map_err(|source| JobError::Spawn {
            what: format!(
                "{} (is docker installed and on PATH?)",
                settings.docker.display()
            ),
            source,
        })?;
    let code = exit_code(status);
    if code == 137 {
        notices.push(format!(
            "the container was killed (exit 137); if it hit its memory limit of {} bytes, lower the job's memory use",
            state.slice.memory_bytes
        ));
    }
    Ok(CommandOutcome {
        exit_code: code,
        notices,
    })
}

/// Host mode: the shell in the job's cgroup (born there on cgroup v2), in a network namespace
/// of its own unless the step allows the network.
fn on_host(
    settings: &Settings,
    state: &JobState,
    env: &BTreeMap<String, String>,
    command: &str,
    child_env: &BTreeMap<String, String>,
) -> Result<CommandOutcome, JobError> {
    let job_id = state.job_id.as_str();
    let mut notices = Vec::new();
    let words = shell_words(env);
    let mut cmd = Command::new(&words[0]);
    cmd.args(&words[1..])
        .arg(command)
        .env_clear()
        .envs(child_env);
    let mut confinement = Confinement {
        procs_files: Vec::new(),
        isolate_network: !state.config.network_allowed(),
    };
    let cgroups = match state.cgroup_version {
        Some(_) => {
            let cg = Cgroups::detect_with(&settings.cgroup_root, &settings.proc_root)?;
            confinement.procs_files = cg.procs_files(job_id)?;
            Some(cg)
        }
        None => {
            notices.push(
                "WARNING: RUNNING UNENFORCED: the command has no CPU, memory or pids limits".into(),
            );
            None
        }
    };
    let oom_before = cgroups.as_ref().map_or(0, |c| c.oom_kills(job_id));
    let spawn_error = |source: std::io::Error| JobError::Spawn {
        what: format!(
            "the command in the job's cgroup{}",
            if confinement.isolate_network {
                " and a new network namespace (needs root or CAP_SYS_ADMIN; or set `network: true`)"
            } else {
                ""
            }
        ),
        source,
    };
    // On cgroup v2 the command is born in its cgroup (no migration to wait for).
    let born_inside = match (
        &cgroups,
        confinement.procs_files.first().and_then(|p| p.parent()),
    ) {
        (Some(Cgroups::V2(_)), Some(dir)) => {
            let args: Vec<std::ffi::OsString> = words[1..]
                .iter()
                .map(std::ffi::OsString::from)
                .chain([std::ffi::OsString::from(command)])
                .collect();
            confine::spawn_into_cgroup2(
                std::ffi::OsStr::new(&words[0]),
                &args,
                child_env,
                dir,
                confinement.isolate_network,
            )
            .map_err(spawn_error)?
        }
        _ => None,
    };
    let mut child = match born_inside {
        Some(started) => started,
        None => confine::Started::Std(confine::spawn(&mut cmd, &confinement).map_err(spawn_error)?),
    };
    let status = child.wait().map_err(JobError::Wait)?;
    if let Some(cg) = &cgroups {
        let ooms = cg.oom_kills(job_id).saturating_sub(oom_before);
        if ooms > 0 {
            notices.push(format!(
                "the job hit its memory limit of {} bytes: the kernel OOM-killed {ooms} process(es)",
                state.slice.memory_bytes
            ));
        }
    }
    Ok(CommandOutcome {
        exit_code: exit_code(status),
        notices,
    })
}
