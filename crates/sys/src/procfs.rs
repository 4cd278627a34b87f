//! Processes as `/proc` shows them, under an injected procfs root (a fake tree in tests).
//!
//! Hand-written on purpose: the crates that parse procfs (`procfs`, `sysinfo`) read the live
//! `/proc` of the machine, while every caller here must be testable against a fake tree, and
//! the two fields needed are a dozen lines to parse.

use std::path::Path;

/// The fields of `/proc/<pid>/stat` the runner and the hooks use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stat {
    /// The command name (field 2), which may contain spaces and parentheses.
    pub comm: String,
    /// The state letter (field 3): `R`, `S`, `D`, `Z` (zombie), `X` (dead), ...
    pub state: char,
    /// The parent's pid (field 4).
    pub ppid: u32,
    /// The process group (field 5), when the line has it.
    pub pgrp: Option<u32>,
    /// Start time in clock ticks since boot (field 22), when the line is long enough.
    pub start_time: Option<u64>,
}

impl Stat {
    /// Whether the process has exited (a zombie waiting to be reaped, or dead).
    pub fn is_exited(&self) -> bool {
        matches!(self.state, 'Z' | 'X')
    }
}

/// Parses one `/proc/<pid>/stat` line. The command name may contain spaces and parentheses,
/// so the fields after it are counted from the last `)`.
pub fn parse_stat(stat: &str) -> Option<Stat> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?.to_string();
    let mut rest = stat.get(close + 1..)?.split_whitespace();
    let state = rest.next()?.chars().next()?;
    let ppid = rest.next()?.parse().ok()?;
    let pgrp = rest.next().and_then(|s| s.parse().ok());
    // rest is now at field 6; start time is field 22.
    let start_time = rest.nth(16).and_then(|s| s.parse().ok());
    Some(Stat {
        comm,
        state,
        ppid,
        pgrp,
        start_time,
    })
}

/// Reads and parses `<proc_root>/<pid>/stat`; `None` when the process is gone.
pub fn read_stat(proc_root: &Path, pid: u32) -> Option<Stat> {
    let text = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
    parse_stat(&text)
}

/// Pids whose parent is `parent`, from `<proc_root>/*/stat`.
pub fn children_of(proc_root: &Path, parent: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir(proc_root) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| read_stat(proc_root, pid).is_some_and(|s| s.ppid == parent))
        .collect()
}

/// Whether `pid` runs: its stat can be read and it is neither a zombie nor dead.
pub fn is_running(proc_root: &Path, pid: u32) -> bool {
    read_stat(proc_root, pid).is_some_and(|s| !s.is_exited())
}

/// Whether any process of group `pgid` still runs: a member that has exited but is not yet
/// reaped (a zombie whose parent died, waiting for init) has done all it will do. A leader
/// whose main thread exited while its other threads run also reads `Z`: it still runs.
pub fn group_runs(proc_root: &Path, pgid: u32) -> bool {
    let Ok(dir) = std::fs::read_dir(proc_root) else {
        return false;
    };
    dir.flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, read_stat(proc_root, pid)?)))
        .any(|(pid, s)| s.pgrp == Some(pgid) && (!s.is_exited() || threads(proc_root, pid) > 1))
}

/// The `Threads:` count of `<proc_root>/<pid>/status`; 0 when it cannot be read.
fn threads(proc_root: &Path, pid: u32) -> u32 {
    std::fs::read_to_string(proc_root.join(pid.to_string()).join("status"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Whether `<proc_root>/<pid>` exists (the process has not been reaped).
pub fn exists(proc_root: &Path, pid: u32) -> bool {
    proc_root.join(pid.to_string()).exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odd_command_names_and_short_lines() {
        let s = parse_stat(
            "1234 (a) b (c)) S 77 1234 1234 0 -1 4194560 100 0 0 0 0 0 0 0 20 0 1 0 987654 1000 10",
        )
        .unwrap();
        assert_eq!(s.comm, "a) b (c)");
        assert_eq!(
            (s.state, s.ppid, s.pgrp, s.start_time),
            ('S', 77, Some(1234), Some(987654))
        );
        let short = parse_stat("123 (a) b) c) Z 77 123 123 0").unwrap();
        assert_eq!((short.ppid, short.start_time), (77, None));
        assert!(short.is_exited());
        assert!(parse_stat("garbage").is_none());
        assert!(parse_stat("1 (x) S notanumber").is_none());
    }

    #[test]
    fn children_are_found_in_a_fake_tree() {
        let root = tempfile::tempdir().unwrap();
        for (pid, ppid) in [(10, 1), (11, 10), (12, 10), (13, 11)] {
            let d = root.path().join(pid.to_string());
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("stat"), format!("{pid} (sh) S {ppid} 1 1 0")).unwrap();
        }
        std::fs::create_dir_all(root.path().join("self")).unwrap();
        let mut kids = children_of(root.path(), 10);
        kids.sort_unstable();
        assert_eq!(kids, vec![11, 12]);
        assert!(children_of(&root.path().join("absent"), 10).is_empty());
        assert!(exists(root.path(), 13) && !exists(root.path(), 14));
        assert_eq!(read_stat(root.path(), 13).map(|s| s.ppid), Some(11));
    }

    #[test]
    fn a_group_of_zombies_runs_no_more() {
        let root = tempfile::tempdir().unwrap();
        for (pid, state, pgrp) in [(20, 'Z', 20), (21, 'Z', 20), (22, 'S', 30), (23, 'R', 40)] {
            let d = root.path().join(pid.to_string());
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("stat"), format!("{pid} (x) {state} 1 {pgrp} 1 0")).unwrap();
        }
        assert!(!group_runs(root.path(), 20), "only zombies are left of it");
        // A leader whose main thread is gone while two threads still run.
        std::fs::write(root.path().join("21/status"), "Name:\tx\nThreads:\t3\n").unwrap();
        assert!(group_runs(root.path(), 20), "its threads still run");
        std::fs::write(root.path().join("21/status"), "Name:\tx\nThreads:\t1\n").unwrap();
        assert!(!group_runs(root.path(), 20));
        assert!(group_runs(root.path(), 30) && group_runs(root.path(), 40));
        assert!(!group_runs(root.path(), 50) && !group_runs(&root.path().join("absent"), 30));
    }

    #[test]
    fn the_live_proc_knows_this_process() {
        let me = read_stat(Path::new("/proc"), std::process::id()).unwrap();
        assert_eq!(me.ppid, std::os::unix::process::parent_id());
        assert!(me.start_time.is_some());
        assert!(!me.is_exited());
        assert_eq!(
            me.pgrp,
            Some(rustix::process::getpgrp().as_raw_nonzero().get() as u32)
        );
        assert!(is_running(Path::new("/proc"), std::process::id()));
        assert!(!is_running(Path::new("/proc/absent"), std::process::id()));
    }
}
