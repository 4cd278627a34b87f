//! The `command` hook: run `BUILDKITE_COMMAND` held to the job's slice, in its cgroup (host
//! mode) or in a container holding only its GPU(s), CPUs and memory (docker mode), and report
//! how it ended. Nothing here needs undoing: what the command leaves is `pre-exit`'s.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use kernelkite_topology::plan::Vendor;

use super::env::var;
use super::state::{jobs_dir, read_state, write_state, CheckoutOwner, JobState};
use super::{JobError, Settings};
use crate::cgroup::Cgroups;
use crate::config::{ConfigError, Mode};
use crate::confine::{self, Confinement};
use crate::docker;
use crate::images;
use crate::sandbox::{self, ownership, spec, JobUser, SandboxSpec};

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
    // `auto`: the runner image of the slice's GPUs' vendor.
    let image = c
        .image
        .as_deref()
        .ok_or_else(|| ConfigError::new("image", "required when mode is \"docker\""))
        .and_then(|image| images::step_image(image, &state.slice))?;
    let checkout = if c.mount_checkout {
        Some(
            super::env::checkout_path(env)?
                .or_else(|| std::env::current_dir().ok())
                .unwrap_or_else(|| PathBuf::from(".")),
        )
    } else {
        None
    };
    let mut job_env = env.clone();
    job_env.extend(state.exports.clone());
    let amd_render_nodes: Vec<PathBuf> = state
        .slice
        .gpus()
        .iter()
        .filter(|g| g.vendor == Vendor::Amd)
        .filter_map(|g| docker::amd_render_node(&settings.sysfs_root, &g.pci_bus_id))
        .collect();
    let amd_nodes: Vec<spec::DeviceNode> = amd_render_nodes
        .iter()
        .cloned()
        .chain((!amd_render_nodes.is_empty()).then(|| PathBuf::from("/dev/kfd")))
        .map(|p| spec::DeviceNode {
            target: p.clone(),
            source: match p.strip_prefix("/dev") {
                Ok(rel) => settings.dev_root.join(rel),
                Err(_) => p,
            },
        })
        .collect();
    let run = docker::DockerRun {
        job_id: state.job_id.clone(),
        image,
        slice: state.slice.clone(),
        pids_limit: c.pids_limit,
        network: c.network_allowed(),
        git_read_only: checkout
            .as_ref()
            .is_some_and(|p| std::fs::symlink_metadata(p.join(".git")).is_ok()),
        checkout,
        workdir: c.workdir.clone(),
        amd_render_nodes,
        device_groups: spec::device_groups(&amd_nodes),
        user: state.job_user.as_ref().map(|u| (u.uid, u.gid)),
        shm_size: spec::tmpfs_size(c.shm_size, state.slice.memory_bytes),
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
///
/// `say` gets the lines the job log needs before the command's own output (warnings); the
/// sandbox prints what the job can see from the command's child, just before the command.
pub fn run(
    settings: &Settings,
    env: &BTreeMap<String, String>,
    say: &mut dyn FnMut(&str),
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
        Mode::Docker => in_container(settings, &state, env, command, &child_env, say),
        Mode::Host => on_host(settings, &state, env, command, &child_env, say),
    }
}

/// Docker mode: `docker run` with only the job's GPU(s), CPUs and memory.
fn in_container(
    settings: &Settings,
    state: &JobState,
    env: &BTreeMap<String, String>,
    command: &str,
    child_env: &BTreeMap<String, String>,
    say: &mut dyn FnMut(&str),
) -> Result<CommandOutcome, JobError> {
    let mut notices = Vec::new();
    if state.config.image.as_deref() == Some(images::AUTO) {
        let image = images::for_slice(&state.slice)?;
        say(&format!(
            "image auto: {}, the runner image for {} GPUs",
            image.reference, image.vendor_name
        ));
    }
    if let (Some(user), true) = (&state.job_user, state.config.mount_checkout) {
        if let Some(c) = checkout_dir(env) {
            give_checkout(settings, state, &c, user)?;
        }
    }
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

/// Host mode: the shell in the job's cgroup (born there on cgroup v2), inside the sandbox
/// (or, with the sandbox off, as the agent's user in a network namespace of its own unless the
/// step allows the network).
fn on_host(
    settings: &Settings,
    state: &JobState,
    env: &BTreeMap<String, String>,
    command: &str,
    child_env: &BTreeMap<String, String>,
    say: &mut dyn FnMut(&str),
) -> Result<CommandOutcome, JobError> {
    let job_id = state.job_id.as_str();
    let mut notices = Vec::new();
    let mut argv: Vec<OsString> = shell_words(env).into_iter().map(OsString::from).collect();
    argv.push(OsString::from(command));
    let cgroups = match state.cgroup_version {
        Some(_) => Some(Cgroups::detect_with(
            &settings.cgroup_root,
            &settings.proc_root,
        )?),
        None => {
            say("WARNING: RUNNING UNENFORCED: the command has no CPU, memory or pids limits");
            None
        }
    };
    let oom_before = cgroups.as_ref().map_or(0, |c| c.oom_kills(job_id));
    let mut child = if settings.sandbox {
        start_sandboxed(settings, state, env, &argv, child_env, cgroups.as_ref())?
    } else {
        let me = rustix::process::geteuid().as_raw();
        say(&format!(
            "WARNING: RUNNING WITHOUT THE SANDBOX (KERNELKITE_SANDBOX=off): the command runs as uid {me}{} with the agent's view of the machine",
            if me == 0 { " (root)" } else { "" }
        ));
        let isolate_network = !state.config.network_allowed();
        // Even unsandboxed, the command does not get the agent's credentials.
        let env: BTreeMap<String, String> = child_env
            .iter()
            .filter(|(k, _)| !sandbox::environ::withheld(k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        start_in_cgroup(job_id, &argv, &env, cgroups.as_ref(), isolate_network, None)?
    };
    let status = child.wait().map_err(JobError::Wait)?;
    if settings.sandbox && state.config.network_allowed() {
        // What the command left running (pre-exit kills it) has no network from now on.
        crate::uplink::close(&settings.run_dir, job_id, Some(state.slice.index));
    }
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

/// Starts `argv` with exactly `env` in the job's cgroup: born there on cgroup v2
/// (`clone3`), written into the `cgroup.procs` files between fork and exec otherwise, not
/// confined at all without cgroups. With `isolate_network`, in a new network namespace with
/// only loopback (the sandbox makes its own). `setup` runs in the child, in its cgroups,
/// before the program (the sandbox).
fn start_in_cgroup(
    job_id: &str,
    argv: &[OsString],
    env: &BTreeMap<String, String>,
    cgroups: Option<&Cgroups>,
    isolate_network: bool,
    mut setup: Option<confine::ChildSetup>,
) -> Result<confine::Started, JobError> {
    let (program, args) = argv.split_first().ok_or_else(|| JobError::Spawn {
        what: "an empty command".into(),
        source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
    })?;
    let mut confinement = Confinement {
        procs_files: Vec::new(),
        isolate_network,
    };
    if let Some(cg) = cgroups {
        confinement.procs_files = cg.procs_files(job_id)?;
    }
    let spawn_error = |source: std::io::Error| JobError::Spawn {
        what: format!(
            "{program:?} in the job's cgroup{}",
            if isolate_network {
                " and a new network namespace (needs root or CAP_SYS_ADMIN; or set `network: true`)"
            } else {
                ""
            }
        ),
        source,
    };
    // On cgroup v2 the command is born in its cgroup (no migration to wait for).
    let born_inside = match (
        cgroups,
        confinement.procs_files.first().and_then(|p| p.parent()),
    ) {
        (Some(Cgroups::V2(_)), Some(dir)) => match setup.as_mut() {
            Some(setup) => confine::spawn_into_cgroup2_with_setup(program, args, env, dir, setup),
            None => confine::spawn_into_cgroup2(program, args, env, dir, isolate_network),
        }
        .map_err(spawn_error)?,
        _ => None,
    };
    if let Some(started) = born_inside {
        return Ok(started);
    }
    let mut cmd = Command::new(program);
    cmd.args(args).env_clear().envs(env);
    match setup {
        Some(setup) => confine::spawn_with_setup(&mut cmd, &confinement, setup),
        None => confine::spawn(&mut cmd, &confinement),
    }
    .map(confine::Started::Std)
    .map_err(spawn_error)
}

/// Hands the checkout to `user` for the command. `environment` recorded whose it is to be again
/// (the agent's); a state from before that record gets it now, before anything changes hands,
/// so that `pre-exit` (or the clean-up after a lost job) gives it back whatever happens next.
fn give_checkout(
    settings: &Settings,
    state: &JobState,
    checkout: &Path,
    user: &JobUser,
) -> Result<(), JobError> {
    let recorded = state
        .checkout_owner
        .as_ref()
        .is_some_and(|o| o.path == checkout);
    if !recorded {
        let mut updated = state.clone();
        updated.checkout_owner = Some(CheckoutOwner {
            path: checkout.to_path_buf(),
            uid: rustix::process::geteuid().as_raw(),
            gid: rustix::process::getegid().as_raw(),
        });
        write_state(settings, &updated)?;
    }
    ownership::chown_tree(checkout, user.uid, user.gid)
        .map(drop)
        .map_err(|source| JobError::Checkout {
            path: checkout.to_path_buf(),
            uid: user.uid,
            source,
        })
}

/// The job's checkout: `BUILDKITE_BUILD_CHECKOUT_PATH` when it is a directory. Nothing else is
/// ever handed to the job user (not the working directory, which could be anything).
/// The checkout, where it is one the hooks may hand over ([`super::env::checkout_path`];
/// `environment` refused the job otherwise) and exists.
fn checkout_dir(env: &BTreeMap<String, String>) -> Option<PathBuf> {
    super::env::checkout_path(env)
        .ok()
        .flatten()
        .filter(|p| p.is_dir())
}

/// What the sandbox is to build for this job.
pub fn sandbox_spec(
    settings: &Settings,
    state: &JobState,
    env: &BTreeMap<String, String>,
    user: &JobUser,
    submission: Option<&JobUser>,
    checkout: Option<&Path>,
) -> SandboxSpec {
    let devices =
        super::devices::gpu_device_nodes(&settings.sysfs_root, &settings.dev_root, &state.slice);
    let git = checkout
        .map(|c| c.join(".git"))
        .filter(|g| std::fs::symlink_metadata(g).is_ok());
    let groups = spec::device_groups(&devices);
    let mut hide = spec::hidden_paths(env, &settings.run_dir, checkout, &settings.hide);
    // Whoever owns this binary can change what runs as root already: a tool of theirs adds
    // no one.
    let trusted = std::env::current_exe()
        .ok()
        .and_then(|exe| spec::Access::of(&exe))
        .map_or(0, |a| a.uid);
    let (tools, tools_refused) = spec::tool_paths(&settings.job_tools, trusted, spec::Access::of);
    let covered: Vec<PathBuf> = crate::sandbox::mounts::FRESH_DIRS
        .iter()
        .chain([&crate::sandbox::mounts::HOST_RUN])
        .map(PathBuf::from)
        .chain(hide.iter().cloned())
        .collect();
    hide.extend(spec::tool_covers(
        &tools,
        &covered,
        (user.uid, user.gid, &groups),
        spec::Access::of,
    ));
    SandboxSpec {
        user: user.clone(),
        submission: submission.cloned(),
        groups,
        cwd: std::env::current_dir()
            .ok()
            .or_else(|| checkout.map(Path::to_path_buf))
            .unwrap_or_else(|| PathBuf::from("/")),
        isolate_network: !state.config.network_allowed(),
        uplink: None,
        tmp_size: spec::tmpfs_size(state.config.tmp_size, state.slice.memory_bytes),
        shm_size: spec::tmpfs_size(state.config.shm_size, state.slice.memory_bytes),
        devices,
        hide,
        writable: checkout.map(Path::to_path_buf).into_iter().collect(),
        read_only: git.into_iter().collect(),
        tools,
        tools_refused,
        driver_proc: spec::driver_proc(&settings.sysfs_root, &state.slice),
        allow_syscalls: state.config.allow_syscalls.clone(),
        artifacts: env
            .get("BUILDKITE_ARTIFACT_PATHS")
            .map(|v| crate::sandbox::disk::artifact_patterns(v))
            .unwrap_or_default(),
        limits: spec::LimitsNote {
            memory_bytes: state.slice.memory_bytes,
            pids: state.config.pids_limit,
            cgroup: state.cgroup_version,
        },
    }
}

/// The identity the evaluator runs this slice's submissions as
/// (`sandbox::user::submission_for_slice`); none for a root command (`allow-root`).
fn submission_identity(user: &JobUser, slice: u32) -> Result<Option<JobUser>, JobError> {
    if user.is_root() {
        return Ok(None);
    }
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    sandbox::user::submission_for_slice(&passwd, slice)
        .map(Some)
        .map_err(|e| JobError::Sandbox(e.to_string()))
}

/// Starts the step's shell in the job's cgroup with the sandbox set up in the child first (as
/// root, then dropped); returns the command once it runs, or why it could not start.
fn start_sandboxed(
    settings: &Settings,
    state: &JobState,
    env: &BTreeMap<String, String>,
    argv: &[OsString],
    child_env: &BTreeMap<String, String>,
    cgroups: Option<&Cgroups>,
) -> Result<confine::Started, JobError> {
    let user = match &state.job_user {
        Some(u) => u.clone(),
        // Prepared on a node whose sandbox was off: settle the user now, with the same rules
        // (the default user is the slice's own identity, as `environment` makes it).
        None => {
            let user = super::environment::job_user(settings, &state.config, &mut Vec::new())?;
            super::environment::slice_identity(user, &state.config, state.slice.index)?
                .ok_or_else(|| JobError::Sandbox("no job user for the sandbox".into()))?
        }
    };
    let checkout = checkout_dir(env);
    if let Some(c) = &checkout {
        give_checkout(settings, state, c, &user)?;
    }
    let submission = submission_identity(&user, state.slice.index)?;
    let mut spec = sandbox_spec(
        settings,
        state,
        env,
        &user,
        submission.as_ref(),
        checkout.as_deref(),
    );
    // `network: true`: the job's own network, made now, while this hook may still start
    // commands (below, its next child is the job's init).
    if state.config.network_allowed() {
        let openings = crate::uplink::Openings {
            resolvers: crate::uplink::resolvers(
                &crate::sandbox::mounts::own_network_resolver_text(),
            ),
            allowed: settings.job_network_allow.clone(),
        };
        let uplink = crate::uplink::open(
            &settings.run_dir,
            &state.job_id,
            state.slice.index,
            &openings,
        )
        .map_err(|e| JobError::Sandbox(e.to_string()))?;
        spec.uplink = Some(uplink.netns);
    }
    let (report_r, report_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| JobError::Sandbox(format!("cannot make the report pipe: {e}")))?;
    let env = sandbox::job_env(
        child_env,
        &user,
        submission.as_ref(),
        &state.config.environment,
    );
    // The child this hook starts next is the job's PID namespace's init (`sandbox::init`): the
    // hook starts nothing else after it.
    kernelkite_sys::raw::unshare_pid_namespace()
        .map_err(|e| JobError::Sandbox(format!("cannot make the job's PID namespace: {e}")))?;
    let started = start_in_cgroup(
        &state.job_id,
        argv,
        &env,
        cgroups,
        false,
        Some(sandbox::child_setup(spec, report_w)),
    );
    // End of file: the command was executed (the pipe is close-on-exec). Text: why not. The
    // write end went with the set-up (closed here once the spawn returned).
    let mut why = String::new();
    let _ = std::fs::File::from(report_r).read_to_string(&mut why);
    match started {
        Ok(child) if why.is_empty() => Ok(child),
        Ok(mut child) => {
            let _ = child.wait();
            Err(JobError::Sandbox(why))
        }
        Err(e) if why.is_empty() => Err(e),
        Err(_) => Err(JobError::Sandbox(why)),
    }
}
