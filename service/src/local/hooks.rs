//! Running the plugin's job hooks the way a Buildkite agent runs them: the variables an agent
//! gives every hook, the `environment` hook's exports handed on to the command (as the
//! plugin's hooks hand them on through the agent: `environment --export shell`, evaluated), and the
//! processes behind a job.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::Path;

use kernelkite_agent::job_env::JobEnv;
use kernelkite_agent::plugins::PLUGIN_LOCATION;

/// Variables of the service's own environment that never reach a job: the service's secrets,
/// a stale job's variables, and the runner's and hooks' own settings, which the executor sets
/// per job (a `KERNELKITE_PAYLOAD_FILE` left in the service's environment would otherwise make
/// every job evaluate that file).
fn inherited(name: &str) -> bool {
    const RUNNER_SETTINGS: &[&str] = &[
        "KERNELKITE_PYTHON",
        "KERNELKITE_NVCC",
        "KERNELKITE_REQUIRE_GPU",
        "KERNELKITE_TORCH_PROBE",
        "KERNELKITE_DOCKER",
    ];
    if name.starts_with("KERNELKITE_") {
        return RUNNER_SETTINGS.contains(&name);
    }
    !(name.starts_with("BUILDKITE_") || name.starts_with("KERNELBOT_") || name == "BUILDKITE")
}

/// The organization local mode's jobs name, as an agent's would name Buildkite's.
pub const ORGANIZATION: &str = "local";
/// The pipeline local mode's jobs name.
pub const PIPELINE: &str = "kernelkite-local";
/// The step's artifact_paths: in the sandbox, what of the job's writes to its checkout reaches
/// this machine's disk (crates/hooks/src/sandbox/disk.rs).
pub const ARTIFACT_PATHS: &str = "result.json;provenance.json";

/// The step's plugin as the pipeline names it (`deployment/pipelines/host.yml` takes it from
/// its repository subdirectory), with the configuration every local job gets.
pub fn plugin_step(
    config: &serde_json::Map<String, serde_json::Value>,
) -> (String, serde_json::Value) {
    (
        format!("{PLUGIN_LOCATION}#local"),
        serde_json::Value::Object(config.clone()),
    )
}

/// The environment an agent gives each hook of `job`: its own (here: the service's, less what
/// `inherited` keeps out), the build's env (`build_env`: the payload carrier,
/// `KERNELBOT_RUN_ID`, ...), and the variables the agent sets for the job.
pub fn hook_env(
    service_env: impl IntoIterator<Item = (String, String)>,
    build_env: &[(String, String)],
    job: &JobEnv<'_>,
) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = service_env
        .into_iter()
        .filter(|(k, _)| inherited(k))
        .collect();
    env.extend(build_env.iter().cloned());
    env.extend(job.variables());
    env
}

/// The node flags every hook subcommand takes.
pub fn node_args(
    run_dir: &Path,
    plan_file: &Path,
    sysfs_root: &Path,
    cgroup_root: &Path,
) -> Vec<OsString> {
    let mut a = Vec::new();
    for (flag, value) in [
        ("--run-dir", run_dir),
        ("--plan-file", plan_file),
        ("--sysfs-root", sysfs_root),
        ("--cgroup-root", cgroup_root),
    ] {
        a.push(OsString::from(flag));
        a.push(value.as_os_str().to_os_string());
    }
    a
}

pub use kernelkite_sys::shell::{parse_exports, quote as shell_quote};

/// A process, told apart from a later one that reuses its pid by its start time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProcessId {
    /// The pid (also its process group: hooks are started as group leaders).
    pub pid: u32,
    /// Start time in clock ticks since boot (`/proc/<pid>/stat` field 22).
    pub start_time: u64,
}

/// This boot's id (empty where the kernel does not say): a [`ProcessId`] means something
/// only within the boot that recorded it.
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// `pid` as `/proc/<pid>/stat` shows it, or `None` when it is gone.
fn stat(pid: u32) -> Option<kernelkite_sys::procfs::Stat> {
    kernelkite_sys::procfs::read_stat(Path::new("/proc"), pid)
}

/// `pid`'s start time, or `None` when it is gone.
pub fn start_time(pid: u32) -> Option<u64> {
    stat(pid)?.start_time
}

/// Whether the process is still the one recorded and still running (not gone, not a reused
/// pid, not a zombie waiting for a parent that no longer reaps it).
pub fn is_alive(p: ProcessId) -> bool {
    stat(p.pid).is_some_and(|s| s.start_time == Some(p.start_time) && !s.is_exited())
}

/// Why a recorded command hook is not signalled after a restart.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotTheHook {
    /// Pid 0 or 1 (or past the pid range): as a process group, `kill(-1)` or `kill(0)` would
    /// reach every process, or the service's own group.
    #[error("pid {0} can never be a job's command hook")]
    Reserved(u32),
    /// The service itself, or its process group.
    #[error("pid {0} is this service or its process group")]
    Service(u32),
    /// Recorded before the machine rebooted: the same pid and start time name another process.
    #[error("pid {0} was recorded before this machine rebooted")]
    OtherBoot(u32),
    /// Nothing runs under the pid any more (the hook ended).
    #[error("pid {0} has ended")]
    Gone(u32),
    /// The pid belongs to a process that started at another time.
    #[error("pid {pid} is another process now (started at tick {now}, the hook at {recorded})")]
    Reused {
        /// The pid.
        pid: u32,
        /// The recorded start time.
        recorded: u64,
        /// The process's.
        now: u64,
    },
    /// The process leads no process group of its own, as the hook (started with its own
    /// group) does.
    #[error("pid {0} does not lead its own process group, as the command hook does")]
    NotLeader(u32),
}

/// The command hook a job's record names, if that process runs now: never pid 0 or 1 or this
/// service, recorded in this boot, started at the recorded time, and the leader of its own
/// process group (as the service started it). Only then may its group be signalled; the record
/// is the service's own (`attempt-<n>.pid` in the job's directory, which the job cannot write),
/// and this check keeps a stale one, or a damaged one, from reaching another process.
pub fn verify_hook(pid: u32, start_time: u64, boot_id: &str) -> Result<ProcessId, NotTheHook> {
    if group_target(pid).is_none() {
        return Err(NotTheHook::Reserved(pid));
    }
    let me = std::process::id();
    let my_group = rustix::process::getpgrp().as_raw_pid();
    if pid == me || i64::from(pid) == i64::from(my_group) {
        return Err(NotTheHook::Service(pid));
    }
    if boot_id != self::boot_id() {
        return Err(NotTheHook::OtherBoot(pid));
    }
    let Some(s) = stat(pid).filter(|s| !s.is_exited()) else {
        return Err(NotTheHook::Gone(pid));
    };
    match s.start_time {
        Some(t) if t == start_time => {}
        now => {
            return Err(NotTheHook::Reused {
                pid,
                recorded: start_time,
                now: now.unwrap_or(0),
            })
        }
    }
    let leader = group_target(pid)
        .and_then(|p| rustix::process::getpgid(Some(p)).ok())
        .is_some_and(|g| i64::from(g.as_raw_pid()) == i64::from(pid));
    if !leader {
        return Err(NotTheHook::NotLeader(pid));
    }
    Ok(ProcessId { pid, start_time })
}

/// The process group `pgid` names for `kill`, or `None` for 0 and 1 and numbers past the pid
/// range: `kill(-1)` reaches every process the caller may signal (as root: all of them) and
/// `kill(0)` the caller's own group, so neither is ever a job's group.
fn group_target(pgid: u32) -> Option<rustix::process::Pid> {
    if pgid <= 1 {
        return None;
    }
    rustix::process::Pid::from_raw(i32::try_from(pgid).ok()?)
}

/// Sends `signal` to process group `pgid` (a hook started as its group's leader); nothing for
/// a number that names no single group (`group_target`).
pub fn signal_group(pgid: u32, signal: rustix::process::Signal) {
    if let Some(pid) = group_target(pgid) {
        let _ = rustix::process::kill_process_group(pid, signal);
    }
}

/// Whether any process of group `pgid` still runs (the runner outlives a hook killed by a
/// signal, for as long as it takes to stop its harness and write its result). Members that
/// have exited do not count: the runner, orphaned when the hook ends, is reaped by whoever
/// inherits it, and an init that reaps late (this machine's took 1.1-1.8 s) held a freed
/// slice idle while work waited (issue 34's CI).
pub fn group_running(pgid: u32) -> bool {
    group_target(pgid).is_some_and(|pid| rustix::process::test_kill_process_group(pid).is_ok())
        && kernelkite_sys::procfs::group_runs(Path::new("/proc"), pgid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hooks_get_the_agents_variables_and_none_of_the_services_secrets() {
        let cfg = serde_json::json!({"allow-unenforced": true, "gpus": 1});
        let build_env = vec![("KERNELBOT_PAYLOAD".to_string(), "eJw=".to_string())];
        let job = JobEnv {
            job_id: "b-1",
            build_id: "b",
            build_number: 7,
            organization: ORGANIZATION,
            pipeline: PIPELINE,
            agent_name: "local-host-0",
            tags: vec![("gpu-index", "3".into()), ("queue", "local".into())],
            checkout: Path::new("/tmp/x"),
            command: "true",
            artifact_paths: Some(ARTIFACT_PATHS),
            plugin: Some(plugin_step(cfg.as_object().unwrap())),
        };
        let service = [
            ("PATH", "/usr/bin"),
            ("KERNELKITE_API_TOKEN", "secret"),
            ("BUILDKITE_API_TOKEN", "secret"),
            ("KERNELKITE_PAYLOAD_FILE", "/etc/passwd"),
            ("KERNELBOT_PAYLOAD", "stale"),
            ("KERNELKITE_PYTHON", "python3.11"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let env = hook_env(service, &build_env, &job);
        assert_eq!(env["PATH"], "/usr/bin");
        assert_eq!(env["KERNELKITE_PYTHON"], "python3.11");
        assert_eq!(env["KERNELBOT_PAYLOAD"], "eJw=");
        assert!(!env.values().any(|v| v == "secret" || v == "/etc/passwd"));
        assert_eq!(env["BUILDKITE_AGENT_META_DATA_GPU_INDEX"], "3");
        assert_eq!(env["BUILDKITE_PLUGIN_PLUGIN_ALLOW_UNENFORCED"], "true");
        assert_eq!(env["BUILDKITE_PLUGIN_NAME"], "PLUGIN");
        let cfg_back: serde_json::Value =
            serde_json::from_str(&env["BUILDKITE_PLUGIN_CONFIGURATION"]).unwrap();
        assert_eq!(cfg_back, cfg);
    }

    #[test]
    fn a_process_is_known_by_pid_and_start_time() {
        let me = std::process::id();
        let t = start_time(me).unwrap();
        assert!(is_alive(ProcessId {
            pid: me,
            start_time: t
        }));
        assert!(!is_alive(ProcessId {
            pid: me,
            start_time: t + 1
        }));
    }

    #[test]
    fn no_signal_ever_goes_to_every_process_or_the_services_group() {
        for pgid in [0, 1, u32::MAX, i32::MAX as u32 + 1] {
            assert_eq!(group_target(pgid), None, "{pgid}");
            assert!(!group_running(pgid), "{pgid}");
        }
        assert!(group_target(2).is_some());
        let boot = super::boot_id();
        // pid 1 with its true start time: still never the hook.
        let init = start_time(1).unwrap_or(0);
        assert_eq!(verify_hook(1, init, &boot), Err(NotTheHook::Reserved(1)));
        assert_eq!(verify_hook(0, 0, &boot), Err(NotTheHook::Reserved(0)));
        let me = std::process::id();
        assert_eq!(
            verify_hook(me, start_time(me).unwrap(), &boot),
            Err(NotTheHook::Service(me))
        );
    }

    #[test]
    fn a_group_its_leader_left_runs_until_its_last_member_exits() {
        use std::os::unix::process::CommandExt;
        // The leader ends at once; its child, orphaned, sleeps, then exits and waits to be
        // reaped by whoever inherited it.
        let mut leader = std::process::Command::new("sh")
            .args(["-c", "sleep 0.3 & exit 0"])
            .process_group(0)
            .spawn()
            .unwrap();
        let pgid = leader.id();
        leader.wait().unwrap();
        assert!(group_running(pgid), "the orphaned sleep still runs");
        let start = std::time::Instant::now();
        while group_running(pgid) {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(5),
                "the sleep ended"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(
            start.elapsed() < std::time::Duration::from_millis(1500),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn only_the_recorded_group_leader_of_this_boot_is_the_hook() {
        let boot = super::boot_id();
        // A process in this test's group (not a leader), and one leading its own group.
        let mut member = kernelkite_testkit::Sleeper::new(30);
        let mut leader = kernelkite_testkit::Sleeper::leader(30);
        let (m, l) = (member.id(), leader.id());
        let (mt, lt) = (start_time(m).unwrap(), start_time(l).unwrap());
        assert_eq!(verify_hook(m, mt, &boot), Err(NotTheHook::NotLeader(m)));
        assert!(matches!(
            verify_hook(l, lt + 1, &boot),
            Err(NotTheHook::Reused { pid, .. }) if pid == l
        ));
        assert_eq!(
            verify_hook(l, lt, "another-boot"),
            Err(NotTheHook::OtherBoot(l))
        );
        assert_eq!(
            verify_hook(l, lt, &boot),
            Ok(ProcessId {
                pid: l,
                start_time: lt
            })
        );
        leader.kill();
        assert_eq!(verify_hook(l, lt, &boot), Err(NotTheHook::Gone(l)));
        member.kill();
    }
}
