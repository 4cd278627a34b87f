//! Processes as /proc sees them: whether a recorded holder is still the same live process, and
//! which process stands for "the job" across its hooks.
//!
//! A pid alone is not an identity (pids are reused), so holders are recorded as pid plus the
//! process start time from `/proc/<pid>/stat` (field 22, clock ticks since boot). The stat
//! parsing itself is [`kernelkite_sys::procfs`], shared with the runner.

use std::path::Path;

use kernelkite_sys::procfs;
use serde::{Deserialize, Serialize};

/// A process, identified so that a reused pid does not look alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessId {
    /// The pid.
    pub pid: u32,
    /// Its start time in clock ticks since boot (`/proc/<pid>/stat` field 22).
    pub start_time: u64,
}

/// Parses `/proc/<pid>/stat` into (comm, ppid, start time). The command name may contain
/// spaces and parentheses, so fields are counted from the last `)`.
pub fn parse_stat(stat: &str) -> Option<(String, u32, u64)> {
    let s = procfs::parse_stat(stat)?;
    Some((s.comm, s.ppid, s.start_time?))
}

fn read_stat(proc_root: &Path, pid: u32) -> Option<(String, u32, u64)> {
    let s = procfs::read_stat(proc_root, pid)?;
    Some((s.comm, s.ppid, s.start_time?))
}

/// The identity of a live process, or `None` when it is gone.
pub fn identify(proc_root: &Path, pid: u32) -> Option<ProcessId> {
    read_stat(proc_root, pid).map(|(_, _, start_time)| ProcessId { pid, start_time })
}

/// Whether the recorded process still runs (same pid, same start time, not a zombie).
pub fn is_alive(proc_root: &Path, id: ProcessId) -> bool {
    procfs::read_stat(proc_root, id.pid)
        .is_some_and(|s| !s.is_exited() && s.start_time == Some(id.start_time))
}

/// Shells the agent runs hooks through; none of them outlives the hook.
const SHELLS: &[&str] = &["bash", "sh", "dash", "zsh", "ksh", "mksh", "busybox"];

/// The process that lives as long as the job: `explicit` when given (the harness and
/// unusual runners set `KERNELKITE_JOB_PID`), else the nearest ancestor named
/// `buildkite-agent` (the agent's per-job bootstrap: binary hooks are its children, sourced
/// shell hooks its grandchildren or deeper), else the nearest ancestor that is not a shell.
///
/// Not simply our parent: a caller that runs the binary from a shell (a wrapper script, a
/// `$(...)` subshell) exits with the hook. A lease anchored there would look dead, and free for another job,
/// while this job still runs.
pub fn job_anchor(proc_root: &Path, me: u32, explicit: Option<u32>) -> Option<ProcessId> {
    if let Some(pid) = explicit {
        return identify(proc_root, pid);
    }
    let (_, parent, _) = read_stat(proc_root, me)?;
    let mut pid = parent;
    let mut first_non_shell: Option<ProcessId> = None;
    for _ in 0..32 {
        if pid <= 1 {
            break;
        }
        // An ancestor that exited while we walked ends the walk, not the search.
        let Some((comm, ppid, start)) = read_stat(proc_root, pid) else {
            break;
        };
        let id = ProcessId {
            pid,
            start_time: start,
        };
        if comm == "buildkite-agent" {
            return Some(id);
        }
        if first_non_shell.is_none() && !SHELLS.contains(&comm.as_str()) {
            first_non_shell = Some(id);
        }
        pid = ppid;
    }
    first_non_shell.or_else(|| identify(proc_root, parent))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_with_odd_command_names() {
        let s =
            "1234 (a) b (c)) S 77 1234 1234 0 -1 4194560 100 0 0 0 0 0 0 0 20 0 1 0 987654 1000 10";
        let (comm, ppid, start) = parse_stat(s).unwrap();
        assert_eq!(comm, "a) b (c)");
        assert_eq!(ppid, 77);
        assert_eq!(start, 987654);
        assert!(parse_stat("garbage").is_none());
    }

    #[test]
    fn own_process_is_alive_and_a_changed_start_time_is_not() {
        let proc_root = Path::new("/proc");
        let me = identify(proc_root, std::process::id()).unwrap();
        assert!(is_alive(proc_root, me));
        assert!(!is_alive(
            proc_root,
            ProcessId {
                pid: me.pid,
                start_time: me.start_time + 1
            }
        ));
    }

    #[test]
    fn a_zombie_anchor_is_dead() {
        // A bootstrap that died but was not yet reaped by its agent must not hold a GPU.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let proc_root = Path::new("/proc");
        let id = identify(proc_root, child.id());
        let start = std::time::Instant::now();
        let zombie = loop {
            let stat =
                std::fs::read_to_string(format!("/proc/{}/stat", child.id())).unwrap_or_default();
            if stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
            {
                break true;
            }
            if start.elapsed() > std::time::Duration::from_secs(5) {
                break false;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        assert!(zombie, "the child never became a zombie");
        let id = id.or_else(|| identify(proc_root, child.id())).unwrap();
        assert!(!is_alive(proc_root, id));
        child.wait().unwrap();
    }

    /// A fake `/proc` with the given (pid, comm, ppid) processes.
    fn fake_proc(procs: &[(u32, &str, u32)]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for &(pid, comm, ppid) in procs {
            let d = root.path().join(pid.to_string());
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(
                d.join("stat"),
                format!(
                    "{pid} ({comm}) S {ppid} 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {} 0 0",
                    1000 + pid
                ),
            )
            .unwrap();
        }
        root
    }

    #[test]
    fn anchor_is_never_the_shim_s_short_lived_subshell() {
        // hook binary 50 <- $(...) subshell 40 <- hook wrapper bash 30 <- runner 20 <- 10
        let proc_root = fake_proc(&[
            (50, "kernelkite-isol", 40),
            (40, "bash", 30),
            (30, "bash", 20),
            (20, "agent-runner", 10),
            (10, "systemd", 1),
        ]);
        let a = job_anchor(proc_root.path(), 50, None).unwrap();
        assert_eq!(a.pid, 20);
        // With the agent's bootstrap among the ancestors, it wins.
        let proc_root = fake_proc(&[
            (50, "kernelkite-isol", 40),
            (40, "bash", 30),
            (30, "buildkite-agent", 20),
            (20, "agent-runner", 10),
        ]);
        assert_eq!(job_anchor(proc_root.path(), 50, None).unwrap().pid, 30);
        // An ancestor gone mid-walk: the best found so far, not no anchor at all.
        let proc_root = fake_proc(&[(50, "kernelkite-isol", 40), (40, "bash", 30)]);
        assert_eq!(job_anchor(proc_root.path(), 50, None).unwrap().pid, 40);
    }

    #[test]
    fn anchor_falls_back_to_parent() {
        let proc_root = Path::new("/proc");
        let a = job_anchor(proc_root, std::process::id(), None).unwrap();
        let ppid = std::os::unix::process::parent_id();
        // Under a real Buildkite agent the anchor is the bootstrap further up.
        let (comm, _, _) = read_stat(proc_root, a.pid).unwrap();
        assert!(a.pid == ppid || comm == "buildkite-agent", "{a:?} {comm}");
        let explicit = job_anchor(proc_root, std::process::id(), Some(std::process::id())).unwrap();
        assert_eq!(explicit.pid, std::process::id());
    }
}
