//! cgroup v2: `<root>/kernelkite/<job>` with the cpuset, memory and pids controllers.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{
    kill_pids, mkdir, populated, read, read_pids, remove_tree, tree_pids, wait_until, write,
    CgroupError, Cleanup, Limits, PARENT,
};
use kernelkite_topology::cpulist::format_cpu_list;

/// Controllers a job cgroup needs.
pub const CONTROLLERS: &[&str] = &["cpuset", "memory", "pids"];

/// A cgroup v2 hierarchy.
#[derive(Debug, Clone)]
pub struct V2 {
    root: PathBuf,
    proc_root: PathBuf,
}

impl V2 {
    /// A v2 hierarchy mounted (or faked) at `root`, judging pids through `/proc`.
    pub fn new(root: PathBuf) -> V2 {
        V2 {
            root,
            proc_root: PathBuf::from(super::DEFAULT_PROC_ROOT),
        }
    }

    /// The same hierarchy, judging whether a listed pid is alive through `proc_root`.
    pub fn with_proc_root(self, proc_root: &Path) -> V2 {
        V2 {
            proc_root: proc_root.to_path_buf(),
            ..self
        }
    }

    /// `<root>/kernelkite`, the parent of every job cgroup.
    pub fn base(&self) -> PathBuf {
        self.root.join(PARENT)
    }

    fn dir(&self, name: &str) -> PathBuf {
        self.base().join(name)
    }

    /// Turns on the controllers for children of `dir`, keeping what is already on.
    fn enable_controllers(dir: &Path) -> Result<(), CgroupError> {
        let path = dir.join("cgroup.subtree_control");
        let on = std::fs::read_to_string(&path).unwrap_or_default();
        let missing: Vec<String> = CONTROLLERS
            .iter()
            .filter(|c| !on.split_whitespace().any(|o| o == **c))
            .map(|c| format!("+{c}"))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        write(&path, &missing.join(" "))
    }

    /// Creates (or reuses) the job's cgroup with its limits; returns warnings worth printing.
    pub fn create(&self, name: &str, limits: &Limits) -> Result<Vec<String>, CgroupError> {
        Self::enable_controllers(&self.root)?;
        mkdir(&self.base())?;
        Self::enable_controllers(&self.base())?;
        let dir = self.dir(name);
        mkdir(&dir)?;
        write(&dir.join("cpuset.cpus"), &format_cpu_list(&limits.cpus))?;
        write(&dir.join("cpuset.mems"), &format_cpu_list(&limits.mems))?;
        write(&dir.join("memory.max"), &limits.memory_bytes.to_string())?;
        let mut warnings = Vec::new();
        // memory.swap.max only exists with swap accounting; without it swap is not limited.
        let swap = dir.join("memory.swap.max");
        if swap.exists() || !super::is_cgroupfs(&dir) {
            write(&swap, "0")?;
        } else {
            warnings
                .push("memory.swap.max is missing (no swap accounting): the job may swap".into());
        }
        write(&dir.join("pids.max"), &limits.pids.to_string())?;
        if limits.allow_devices.is_some() {
            warnings.push(
                "cgroup v2 restricts devices only through BPF, which kernelkite does not load: other GPUs are kept out by the sandbox's private /dev, where their nodes do not exist (with the sandbox off, only by the exported variables), and a device node the job finds elsewhere on the host opens as its mode allows (mode: docker refuses it)".into(),
            );
        }
        Ok(warnings)
    }

    /// The file a process writes its pid into to join the job's cgroup.
    pub fn procs_files(&self, name: &str) -> Vec<PathBuf> {
        vec![self.dir(name).join("cgroup.procs")]
    }

    /// The live processes in the job's cgroup.
    pub fn pids(&self, name: &str) -> Vec<u32> {
        read_pids(&self.dir(name).join("cgroup.procs"), &self.proc_root)
    }

    /// How many times the OOM killer killed a process of the job (`memory.events`).
    pub fn oom_kills(&self, name: &str) -> u64 {
        read(&self.dir(name).join("memory.events"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
            .unwrap_or(0)
    }

    /// `cgroup.kill` where the kernel has it (5.14+), else freeze, kill each, thaw, repeat.
    /// Both reach the whole subtree: sub-cgroups the job made under its cgroup included.
    pub fn clean_up(&self, name: &str) -> Result<Cleanup, CgroupError> {
        let dir = self.dir(name);
        if !dir.exists() {
            return Ok(Cleanup::default());
        }
        let mut killed = tree_pids(&dir, &self.proc_root);
        // `populated` covers the whole subtree, including cgroups past the walk's bounds.
        let left = || tree_pids(&dir, &self.proc_root);
        let empty = || left().is_empty() && !populated(&dir);
        let kill_file = dir.join("cgroup.kill");
        if kill_file.exists() {
            // Kills the whole subtree at any depth, so written whatever the walk saw.
            write(&kill_file, "1")?;
        } else if !killed.is_empty() {
            for _ in 0..20 {
                // Freezing a cgroup freezes its descendants too.
                let freeze = dir.join("cgroup.freeze");
                let _ = write(&freeze, "1");
                let now = left();
                if now.is_empty() {
                    break;
                }
                for p in &now {
                    if !killed.contains(p) {
                        killed.push(*p);
                    }
                }
                kill_pids(&now);
                let _ = write(&freeze, "0");
                wait_until(Duration::from_millis(100), empty);
            }
        }
        // The processes' teardown is the kernel's, and takes seconds for a job that mapped
        // much (see v1's `clean_up`).
        if !wait_until(super::KILL_WAIT, empty) {
            return Err(CgroupError::Unkillable {
                path: dir.clone(),
                pids: left(),
            });
        }
        killed.sort_unstable();
        remove_tree(&dir)?;
        Ok(Cleanup {
            killed,
            removed: true,
        })
    }
}
