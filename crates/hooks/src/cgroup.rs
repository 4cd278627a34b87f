//! Per-job cgroups: one interface over cgroup v2 (`<mount>/kernelkite/<job>`) and v1 (the same
//! path in the cpuset, memory, pids and freezer hierarchies), chosen by what the machine mounts.
//!
//! Every path is under an injectable root (`fs_root` for the mounts, `proc_root` for telling
//! live pids from stale ones), so the same code runs against a fake cgroupfs tree of plain
//! files in tests. Fake trees differ from cgroupfs in one way that
//! matters: a directory with files in it cannot be `rmdir`ed, so removal falls back to a
//! recursive delete when (and only when) the directory is not on a cgroup filesystem.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use crate::mountinfo::{parse_mountinfo, Mount};

pub mod v1;
pub mod v2;

/// The limits a job's cgroup enforces.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Limits {
    /// CPUs the job may run on (`cpuset.cpus`).
    pub cpus: Vec<u32>,
    /// NUMA nodes the job may allocate from (`cpuset.mems`).
    pub mems: Vec<u32>,
    /// Memory limit in bytes; swap is not allowed on top.
    pub memory_bytes: u64,
    /// Most processes and threads at once (`pids.max`).
    pub pids: u32,
    /// Character devices the job may open besides [`BASE_DEVICE_RULES`]: its GPUs' nodes
    /// (`crate::job::devices::job_devices`). Where the devices controller is there (cgroup
    /// v1), every other device is denied. `None`: no device rules (docker mode, nodes with no
    /// other GPU to keep out, tests).
    pub allow_devices: Option<Vec<CharDevice>>,
}

/// What every job may open whatever its GPUs: runc's default set
/// (`libcontainer/specconv`'s `AllowedDevices`) less mknod-anything, `/dev/console` and
/// `/dev/net/tun`, which is the sandbox's private `/dev`: `null`, `zero`, `full`, `random`,
/// `urandom`, `tty` (`sandbox::mounts::STANDARD_NODES`), `ptmx` and its devpts instance's
/// terminals (major 136). `rwm`, as runc gives them.
pub const BASE_DEVICE_RULES: &[&str] = &[
    "c 1:3 rwm",
    "c 1:5 rwm",
    "c 1:7 rwm",
    "c 1:8 rwm",
    "c 1:9 rwm",
    "c 5:0 rwm",
    "c 5:2 rwm",
    "c 136:* rwm",
];

/// A character device by number, as the devices controller names it (`c 195:3`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CharDevice {
    /// The driver's major number (195 for NVIDIA).
    pub major: u32,
    /// The device's minor number.
    pub minor: u32,
}

/// The parent of every job cgroup, directly under each hierarchy's mount point.
pub const PARENT: &str = "kernelkite";

/// Why a job's cgroup could not be set up or cleaned up.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// This user may not write the cgroup tree (not root, not delegated, read-only mount).
    #[error("cannot write {path}: {error}; run the hooks as root or delegate {parent} to the agent's user (see README \"Cgroups\"), or set `allow-unenforced: true` to run without limits")]
    NotWritable {
        /// The file or directory that was refused.
        path: PathBuf,
        /// The `kernelkite/` parent to delegate (or `path` itself).
        parent: PathBuf,
        /// What the kernel said.
        #[source]
        error: std::io::Error,
    },
    /// Any other failure of the cgroup file system.
    #[error("{path}: {error}")]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// What the kernel said.
        #[source]
        error: std::io::Error,
    },
    /// No hierarchy offers the controllers a job needs; says what is missing.
    #[error("no usable cgroup hierarchy: {0}; mount cgroup v2 with the cpuset, memory and pids controllers (or v1 cpuset, memory and pids hierarchies), or set `allow-unenforced: true`")]
    Unavailable(String),
    /// The job id is not a safe path component.
    #[error("job id {0:?} cannot name a cgroup (allowed: letters, digits, '-', '_', '.')")]
    BadName(String),
    /// Processes were still there after every kill.
    #[error("processes {pids:?} in {path} survived being killed; check for processes stuck in uninterruptible sleep (D state)")]
    Unkillable {
        /// The job's cgroup.
        path: PathBuf,
        /// The survivors.
        pids: Vec<u32>,
    },
    /// The devices controller refused to reset a job cgroup's rules (`a` to `devices.deny`):
    /// the kernel does that only on a cgroup without sub-cgroups.
    #[error("{dir} has sub-cgroups, so its device rules cannot be reset ({error}); remove {dir} (a job's leftovers) and retry")]
    DevicesInUse {
        /// The job's devices cgroup.
        dir: PathBuf,
        /// What the kernel said.
        #[source]
        error: std::io::Error,
    },
    /// The devices controller refused an allow rule: the parent cgroup denies that device.
    #[error("{dir}/devices.allow refused `{rule}` ({error}): its parent {parent} denies it, and a cgroup never gains a device its parent lacks (cgroup-v1 devices.rst); allow it in {parent}/devices.allow, or remove {parent} so that it is made anew from the hierarchy's root")]
    DeviceDenied {
        /// The job's devices cgroup.
        dir: PathBuf,
        /// Its parent.
        parent: PathBuf,
        /// The rule refused.
        rule: String,
        /// What the kernel said.
        #[source]
        error: std::io::Error,
    },
    /// The job made more (or deeper) sub-cgroups than clean-up walks.
    #[error("the cgroup tree under {path} is {what}; clean-up gives up rather than walk it (remove it by hand)")]
    TreeTooLarge {
        /// The job's cgroup.
        path: PathBuf,
        /// Too deep or too many, in words.
        what: String,
    },
}

pub(crate) fn io_err(path: &Path, error: std::io::Error) -> CgroupError {
    if matches!(
        error.kind(),
        std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem
    ) {
        let parent = path
            .ancestors()
            .find(|p| p.file_name().is_some_and(|n| n == PARENT))
            .unwrap_or(path)
            .to_path_buf();
        return CgroupError::NotWritable {
            path: path.to_path_buf(),
            parent,
            error,
        };
    }
    CgroupError::Io {
        path: path.to_path_buf(),
        error,
    }
}

pub(crate) fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    std::fs::write(path, value).map_err(|e| io_err(path, e))
}

pub(crate) fn read(path: &Path) -> Result<String, CgroupError> {
    std::fs::read_to_string(path).map_err(|e| io_err(path, e))
}

pub(crate) fn mkdir(path: &Path) -> Result<(), CgroupError> {
    match std::fs::create_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io_err(path, e)),
    }
}

/// The procfs a [`Cgroups`] judges pids by, unless told otherwise.
pub const DEFAULT_PROC_ROOT: &str = "/proc";

/// Pids listed in a `cgroup.procs` file. The kernel lists only live processes; the filter
/// (a pid counts while `<proc_root>/<pid>` exists) gives fake trees (plain files in tests) the
/// same meaning, so a stale pid written there is never signalled.
pub(crate) fn read_pids(path: &Path, proc_root: &Path) -> Vec<u32> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .filter(|&pid: &u32| kernelkite_sys::procfs::exists(proc_root, pid))
        .collect()
}

pub(crate) fn is_cgroupfs(path: &Path) -> bool {
    const CGROUP_SUPER_MAGIC: i64 = 0x27e0eb;
    const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
    rustix::fs::statfs(path).is_ok_and(|st| {
        // The word's type differs between architectures (i64 on x86_64).
        #[allow(clippy::useless_conversion)]
        let magic = i64::from(st.f_type);
        magic == CGROUP_SUPER_MAGIC || magic == CGROUP2_SUPER_MAGIC
    })
}

/// How long clean-up waits for a killed job's processes to leave its cgroup before it says
/// they cannot be killed. Their teardown is the kernel's and grows with what they mapped; the
/// agent's signal grace (setup's `cancel-grace-period`) leaves room for this wait.
pub const KILL_WAIT: Duration = Duration::from_secs(20);

/// How deep clean-up follows sub-cgroups a job made under its cgroup.
pub const MAX_TREE_DEPTH: usize = 32;
/// How many sub-cgroups clean-up accepts under one job cgroup.
pub const MAX_TREE_CGROUPS: usize = 10_000;

/// Every cgroup directory of the tree rooted at `root`: `root` first, each parent before its
/// children (so the reverse is deepest first). Symlinks are never followed, so the walk stays
/// inside the tree; it is bounded by [`MAX_TREE_DEPTH`] and [`MAX_TREE_CGROUPS`], beyond which
/// it is an error. Empty when `root` is not a directory.
pub(crate) fn subtree(root: &Path) -> Result<Vec<PathBuf>, CgroupError> {
    match bounded_subtree(root) {
        (dirs, None) => Ok(dirs),
        (_, Some(too_large)) => Err(too_large),
    }
}

/// The walk behind [`subtree`]: what lies within the bounds, and the error when the tree goes
/// beyond them. Clean-up kills what it can see even in an oversized tree (a job must not be able
/// to shield its processes by nesting cgroups deeper than the bound), then reports the error.
fn bounded_subtree(root: &Path) -> (Vec<PathBuf>, Option<CgroupError>) {
    if !std::fs::symlink_metadata(root).is_ok_and(|m| m.is_dir()) {
        return (Vec::new(), None);
    }
    let too_large = |what: String| CgroupError::TreeTooLarge {
        path: root.to_path_buf(),
        what,
    };
    let mut out = vec![root.to_path_buf()];
    let mut error = None;
    let mut stack = vec![(root.to_path_buf(), 0usize)];
    while let Some((dir, depth)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            // DirEntry::file_type does not follow symlinks.
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            if depth + 1 > MAX_TREE_DEPTH {
                error.get_or_insert_with(|| {
                    too_large(format!(
                        "deeper than {MAX_TREE_DEPTH} levels ({})",
                        e.path().display()
                    ))
                });
                continue;
            }
            if out.len() > MAX_TREE_CGROUPS {
                return (
                    out,
                    Some(too_large(format!("more than {MAX_TREE_CGROUPS} cgroups"))),
                );
            }
            out.push(e.path());
            stack.push((e.path(), depth + 1));
        }
    }
    (out, error)
}

/// The live pids in every cgroup of the tree rooted at `root` that lies within the walk's
/// bounds, sorted. An oversized tree still yields the pids it could see; [`remove_tree`]
/// reports the size.
pub(crate) fn tree_pids(root: &Path, proc_root: &Path) -> Vec<u32> {
    let mut all: Vec<u32> = bounded_subtree(root)
        .0
        .iter()
        .flat_map(|d| read_pids(&d.join("cgroup.procs"), proc_root))
        .collect();
    all.sort_unstable();
    all.dedup();
    all
}

/// Whether a v2 cgroup still has live processes in its subtree (`populated 1` in
/// `cgroup.events`); v1 and fake cgroups without the file count as empty.
pub(crate) fn populated(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("cgroup.events"))
        .unwrap_or_default()
        .lines()
        .any(|l| l.trim() == "populated 1")
}

/// Removes a cgroup directory and any sub-cgroups the job made, deepest first; on v2 each waits
/// (bounded) for its `cgroup.events` to say `populated 0`, as killed processes take a moment to
/// leave.
pub(crate) fn remove_tree(path: &Path) -> Result<(), CgroupError> {
    for dir in subtree(path)?.iter().rev() {
        wait_until(Duration::from_secs(2), || !populated(dir));
        match std::fs::remove_dir(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            // remove_dir_all does not follow symlinks either.
            Err(_) if !is_cgroupfs(dir) => {
                std::fs::remove_dir_all(dir).map_err(|e| io_err(dir, e))?
            }
            Err(e) => return Err(io_err(dir, e)),
        }
    }
    Ok(())
}

/// Sends SIGKILL to each pid, ignoring ones already gone.
pub(crate) fn kill_pids(pids: &[u32]) {
    let pids = pids
        .iter()
        .filter_map(|&pid| i32::try_from(pid).ok())
        .filter_map(rustix::process::Pid::from_raw);
    for pid in pids {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    }
}

/// Polls `cond` until it holds or `limit` passes.
pub(crate) fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    let mut pause = Duration::from_micros(200);
    loop {
        if cond() {
            return true;
        }
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// Checks a job id is safe as one path component.
pub fn job_cgroup_name(job_id: &str) -> Result<String, CgroupError> {
    let ok = !job_id.is_empty()
        && job_id.len() <= 128
        && job_id != "."
        && job_id != ".."
        && job_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(job_id.to_string())
    } else {
        Err(CgroupError::BadName(job_id.to_string()))
    }
}

/// The machine's cgroups, whichever version.
#[derive(Debug, Clone)]
pub enum Cgroups {
    /// Separate cpuset, memory and pids hierarchies.
    V1(v1::V1),
    /// The unified hierarchy.
    V2(v2::V2),
}

/// What `pre-exit` found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Cleanup {
    /// Pids that were still running and were killed.
    pub killed: Vec<u32>,
    /// Whether the cgroup existed and was removed.
    pub removed: bool,
}

impl Cgroups {
    /// Picks the hierarchy from `<fs_root>/proc/self/mountinfo`: cgroup v2 when it offers the
    /// cpuset, memory and pids controllers, else v1 when all three are mounted. Pids are
    /// judged alive through [`DEFAULT_PROC_ROOT`]; see [`Cgroups::detect_with`].
    pub fn detect(fs_root: &Path) -> Result<Cgroups, CgroupError> {
        Self::detect_with(fs_root, Path::new(DEFAULT_PROC_ROOT))
    }

    /// [`Cgroups::detect`], judging whether a listed pid is still alive through `proc_root`
    /// (the hooks' `--proc-root`), as leases do.
    pub fn detect_with(fs_root: &Path, proc_root: &Path) -> Result<Cgroups, CgroupError> {
        Self::detect_hierarchy(fs_root).map(|c| c.with_proc_root(proc_root))
    }

    /// The same cgroups, judging pids through `proc_root`.
    pub fn with_proc_root(self, proc_root: &Path) -> Cgroups {
        match self {
            Cgroups::V1(c) => Cgroups::V1(c.with_proc_root(proc_root)),
            Cgroups::V2(c) => Cgroups::V2(c.with_proc_root(proc_root)),
        }
    }

    fn detect_hierarchy(fs_root: &Path) -> Result<Cgroups, CgroupError> {
        let path = fs_root.join("proc/self/mountinfo");
        let text = read(&path)?;
        let mounts = parse_mountinfo(&text);
        let under = |m: &Mount| fs_root.join(m.mount_point.trim_start_matches('/'));
        let mut v2_problem = "no cgroup2 mount".to_string();
        for m in mounts.iter().filter(|m| m.fs_type == "cgroup2") {
            let root = under(m);
            let ctrls =
                std::fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
            let have: Vec<&str> = ctrls.split_whitespace().collect();
            let missing: Vec<&str> = v2::CONTROLLERS
                .iter()
                .copied()
                .filter(|c| !have.contains(c))
                .collect();
            if missing.is_empty() {
                return Ok(Cgroups::V2(v2::V2::new(root)));
            }
            v2_problem = format!("cgroup2 at {} lacks {}", root.display(), missing.join(", "));
        }
        let find = |ctrl: &str| {
            mounts
                .iter()
                .find(|m| m.fs_type == "cgroup" && m.super_options.iter().any(|o| o == ctrl))
                .map(under)
        };
        match (find("cpuset"), find("memory"), find("pids")) {
            (Some(cpuset), Some(memory), Some(pids)) => Ok(Cgroups::V1(v1::V1::new(
                cpuset,
                memory,
                pids,
                find("freezer"),
                find("devices"),
            ))),
            _ => Err(CgroupError::Unavailable(format!(
                "{v2_problem}, and cgroup v1 lacks one of the cpuset, memory, pids hierarchies"
            ))),
        }
    }

    /// 1 or 2.
    pub fn version(&self) -> u8 {
        match self {
            Cgroups::V1(_) => 1,
            Cgroups::V2(_) => 2,
        }
    }

    /// Creates (or reuses) the job's cgroup with its limits; returns warnings worth printing.
    pub fn create(&self, job: &str, limits: &Limits) -> Result<Vec<String>, CgroupError> {
        let name = job_cgroup_name(job)?;
        match self {
            Cgroups::V1(c) => c.create(&name, limits),
            Cgroups::V2(c) => c.create(&name, limits),
        }
    }

    /// The files a process writes its pid into to join the job's cgroup(s).
    pub fn procs_files(&self, job: &str) -> Result<Vec<PathBuf>, CgroupError> {
        let name = job_cgroup_name(job)?;
        Ok(match self {
            Cgroups::V1(c) => c.procs_files(&name),
            Cgroups::V2(c) => c.procs_files(&name),
        })
    }

    /// Moves `pid` into the job's cgroup(s).
    pub fn join(&self, job: &str, pid: u32) -> Result<(), CgroupError> {
        for f in self.procs_files(job)? {
            write(&f, &pid.to_string())?;
        }
        Ok(())
    }

    /// The processes now in the job's cgroup.
    pub fn pids(&self, job: &str) -> Result<Vec<u32>, CgroupError> {
        let name = job_cgroup_name(job)?;
        Ok(match self {
            Cgroups::V1(c) => c.pids(&name),
            Cgroups::V2(c) => c.pids(&name),
        })
    }

    /// How many times the kernel's OOM killer killed a process of the job.
    pub fn oom_kills(&self, job: &str) -> u64 {
        let Ok(name) = job_cgroup_name(job) else {
            return 0;
        };
        match self {
            Cgroups::V1(c) => c.oom_kills(&name),
            Cgroups::V2(c) => c.oom_kills(&name),
        }
    }

    /// Kills everything left in the job's cgroup and removes it. Idempotent.
    pub fn clean_up(&self, job: &str) -> Result<Cleanup, CgroupError> {
        let name = job_cgroup_name(job)?;
        match self {
            Cgroups::V1(c) => c.clean_up(&name),
            Cgroups::V2(c) => c.clean_up(&name),
        }
    }

    /// Job cgroups that exist now (for finding orphans).
    pub fn jobs(&self) -> Vec<String> {
        let base = match self {
            Cgroups::V1(c) => c.base_dirs(),
            Cgroups::V2(c) => vec![c.base()],
        };
        let mut names: Vec<String> = base
            .iter()
            .filter_map(|b| std::fs::read_dir(b).ok())
            .flat_map(|entries| entries.flatten())
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        names.sort();
        names.dedup();
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mountinfo::tests::MOUNTINFO_V1;

    #[test]
    fn hybrid_machine_without_v2_controllers_uses_v1() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("proc/self")).unwrap();
        std::fs::write(root.path().join("proc/self/mountinfo"), MOUNTINFO_V1).unwrap();
        std::fs::create_dir_all(root.path().join("sys/fs/cgroup/unified")).unwrap();
        std::fs::write(
            root.path().join("sys/fs/cgroup/unified/cgroup.controllers"),
            "\n",
        )
        .unwrap();
        let c = Cgroups::detect(root.path()).unwrap();
        assert_eq!(c.version(), 1);
        // With the controllers offered, v2 wins.
        std::fs::write(
            root.path().join("sys/fs/cgroup/unified/cgroup.controllers"),
            "cpuset cpu io memory hugetlb pids rdma misc\n",
        )
        .unwrap();
        let c = Cgroups::detect(root.path()).unwrap();
        assert_eq!(c.version(), 2);
    }

    #[test]
    fn missing_hierarchies_say_what_is_missing() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("proc/self")).unwrap();
        std::fs::write(
            root.path().join("proc/self/mountinfo"),
            "34 31 0:31 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n",
        )
        .unwrap();
        let e = Cgroups::detect(root.path()).unwrap_err();
        assert!(e.to_string().contains("no cgroup2 mount"), "{e}");
    }

    #[test]
    fn job_names_are_single_path_components() {
        assert!(job_cgroup_name("0190b8c2-1234-4d5e-9f00-aabbccddeeff").is_ok());
        for bad in ["", "..", "a/b", "a b", "x\n"] {
            assert!(job_cgroup_name(bad).is_err(), "{bad:?}");
        }
    }
}
