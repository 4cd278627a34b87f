//! cgroup v1: the same `kernelkite/<job>` path in the cpuset, memory and pids hierarchies (and
//! freezer, when mounted, to stop a fork loop while it is being killed).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{
    kill_pids, mkdir, read, read_pids, remove_tree, tree_pids, wait_until, write, CgroupError,
    CharDevice, Cleanup, Limits, BASE_DEVICE_RULES, PARENT,
};
use kernelkite_topology::cpulist::format_cpu_list;

/// Denies `dir` every device, then allows [`BASE_DEVICE_RULES`] and `allow`: what runc does
/// (its device emulator's transition from allow-all starts with the `a` rule), and a handful of
/// writes where denying other GPUs one by one took one per capability the driver lists
/// (4,322, about 106 ms per job). A cgroup never gains what its parent lacks, and `kernelkite/`
/// under the hierarchy's root allows everything, so each rule is accepted or the error says
/// why. The kernel takes one rule per `write(2)` (`devcgroup_access_write`), so the allow file
/// is opened once and written once per rule; on a fake tree the rules accumulate in the file.
pub fn restrict_devices(dir: &Path, allow: &[CharDevice]) -> Result<(), CgroupError> {
    let deny = dir.join("devices.deny");
    std::fs::write(&deny, "a").map_err(|error| match error.raw_os_error() {
        // The kernel refuses to reset the rules of a cgroup with children.
        Some(libc::EINVAL) => CgroupError::DevicesInUse {
            dir: dir.to_path_buf(),
            error,
        },
        _ => super::io_err(&deny, error),
    })?;
    let path = dir.join("devices.allow");
    let fake = !super::is_cgroupfs(dir);
    if fake {
        // A plain file stands in for the controller: `a` dropped the old exceptions.
        let _ = std::fs::remove_file(&path);
    }
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .create(fake)
        .open(&path)
        .map_err(|e| super::io_err(&path, e))?;
    let own = allow
        .iter()
        .map(|d| format!("c {}:{} rwm", d.major, d.minor));
    for rule in BASE_DEVICE_RULES.iter().map(|r| r.to_string()).chain(own) {
        let line = format!("{rule}\n");
        match file.write(line.as_bytes()) {
            Ok(n) if n == line.len() => {}
            Ok(n) => {
                return Err(CgroupError::Io {
                    path,
                    error: std::io::Error::other(format!(
                        "wrote {n} of {} bytes of `{rule}`",
                        line.len()
                    )),
                })
            }
            Err(error) if error.raw_os_error() == Some(libc::EPERM) => {
                let parent = dir.parent().unwrap_or(dir).to_path_buf();
                return Err(CgroupError::DeviceDenied {
                    dir: dir.to_path_buf(),
                    parent,
                    rule,
                    error,
                });
            }
            Err(e) => return Err(super::io_err(&path, e)),
        }
    }
    Ok(())
}

/// The cgroup v1 hierarchies a job's cgroup spans.
#[derive(Debug, Clone)]
pub struct V1 {
    cpuset: PathBuf,
    memory: PathBuf,
    pids: PathBuf,
    freezer: Option<PathBuf>,
    devices: Option<PathBuf>,
    proc_root: PathBuf,
}

impl V1 {
    /// Hierarchies mounted (or faked) at these paths, judging pids through `/proc`.
    pub fn new(
        cpuset: PathBuf,
        memory: PathBuf,
        pids: PathBuf,
        freezer: Option<PathBuf>,
        devices: Option<PathBuf>,
    ) -> V1 {
        V1 {
            cpuset,
            memory,
            pids,
            freezer,
            devices,
            proc_root: PathBuf::from(super::DEFAULT_PROC_ROOT),
        }
    }

    /// The same hierarchies, judging whether a listed pid is alive through `proc_root`.
    pub fn with_proc_root(self, proc_root: &Path) -> V1 {
        V1 {
            proc_root: proc_root.to_path_buf(),
            ..self
        }
    }

    fn hierarchies(&self) -> Vec<&Path> {
        let mut h = vec![
            self.cpuset.as_path(),
            self.memory.as_path(),
            self.pids.as_path(),
        ];
        if let Some(f) = &self.freezer {
            h.push(f.as_path());
        }
        if let Some(d) = &self.devices {
            h.push(d.as_path());
        }
        h
    }

    /// `<hierarchy>/kernelkite` in each hierarchy: the parents of every job cgroup.
    pub fn base_dirs(&self) -> Vec<PathBuf> {
        self.hierarchies().iter().map(|h| h.join(PARENT)).collect()
    }

    fn dir(hierarchy: &Path, name: &str) -> PathBuf {
        hierarchy.join(PARENT).join(name)
    }

    /// A new v1 cpuset starts with empty `cpus`/`mems` and takes no tasks until both are
    /// set, so the parent copies its own parent's (CPUs first, then memory nodes) before any
    /// job is made under it. It is widened again whenever it lacks some of the root's: a v1
    /// cpuset loses a CPU that goes offline and does not get it back when it returns (SMT
    /// switched off and on), after which every job asking for that CPU would fail with EINVAL.
    fn prepare_cpuset_parent(&self) -> Result<(), CgroupError> {
        let base = self.cpuset.join(PARENT);
        mkdir(&base)?;
        for file in ["cpuset.cpus", "cpuset.mems"] {
            let mine = std::fs::read_to_string(base.join(file)).unwrap_or_default();
            let parent = read(&self.cpuset.join(file))?;
            if mine.trim() != parent.trim() {
                write(&base.join(file), parent.trim())?;
            }
        }
        Ok(())
    }

    /// Creates (or reuses) the job's cgroup in every hierarchy with its limits; returns
    /// warnings worth printing.
    pub fn create(&self, name: &str, limits: &Limits) -> Result<Vec<String>, CgroupError> {
        self.prepare_cpuset_parent()?;
        for h in self.hierarchies() {
            mkdir(&h.join(PARENT))?;
            mkdir(&Self::dir(h, name))?;
        }
        let cs = Self::dir(&self.cpuset, name);
        write(&cs.join("cpuset.cpus"), &format_cpu_list(&limits.cpus))?;
        write(&cs.join("cpuset.mems"), &format_cpu_list(&limits.mems))?;
        let mem = Self::dir(&self.memory, name);
        let limit = mem.join("memory.limit_in_bytes");
        let memsw = mem.join("memory.memsw.limit_in_bytes");
        let value = limits.memory_bytes.to_string();
        let mut warnings = Vec::new();
        let has_memsw = memsw.exists() || !super::is_cgroupfs(&mem);
        // The kernel keeps memory <= memory+swap at every write. A new cgroup has both
        // unlimited, so the memory limit goes first; a reused one being raised needs memsw
        // raised first.
        let current = std::fs::read_to_string(&limit)
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok());
        let growing = current.is_some_and(|c| limits.memory_bytes > c);
        if has_memsw && growing {
            write(&memsw, &value)?;
            write(&limit, &value)?;
        } else {
            write(&limit, &value)?;
            if has_memsw {
                write(&memsw, &value)?;
            }
        }
        if !has_memsw {
            let _ = write(&mem.join("memory.swappiness"), "0");
            warnings.push(
                "memory.memsw.limit_in_bytes is missing (boot with swapaccount=1): swap is only discouraged (swappiness 0), not forbidden"
                    .into(),
            );
        }
        write(
            &Self::dir(&self.pids, name).join("pids.max"),
            &limits.pids.to_string(),
        )?;
        if let Some(allow) = &limits.allow_devices {
            match &self.devices {
                Some(d) => restrict_devices(&Self::dir(d, name), allow)?,
                None => warnings.push(
                    "the devices hierarchy is not mounted: other GPUs are kept out by the sandbox's private /dev alone (with the sandbox off, only by the exported variables), and a device node the job finds elsewhere on the host opens as its mode allows"
                        .into(),
                ),
            }
        }
        Ok(warnings)
    }

    /// The cpuset file goes first: a task that joins memory before cpuset would briefly run
    /// on every CPU under the memory limit, which is harmless; the reverse order is too.
    pub fn procs_files(&self, name: &str) -> Vec<PathBuf> {
        self.hierarchies()
            .iter()
            .map(|h| Self::dir(h, name).join("cgroup.procs"))
            .collect()
    }

    /// The live processes in the job's cgroups.
    pub fn pids(&self, name: &str) -> Vec<u32> {
        let mut all: Vec<u32> = self
            .hierarchies()
            .iter()
            .flat_map(|h| read_pids(&Self::dir(h, name).join("cgroup.procs"), &self.proc_root))
            .collect();
        all.sort_unstable();
        all.dedup();
        all
    }

    /// How many times the OOM killer killed a process of the job (`memory.oom_control`).
    pub fn oom_kills(&self, name: &str) -> u64 {
        read(&Self::dir(&self.memory, name).join("memory.oom_control"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
            .unwrap_or(0)
    }

    fn set_frozen(&self, name: &str, frozen: bool) {
        let Some(f) = &self.freezer else { return };
        let state = Self::dir(f, name).join("freezer.state");
        if !state.exists() {
            return;
        }
        let want = if frozen { "FROZEN" } else { "THAWED" };
        let _ = write(&state, want);
        if frozen {
            // FREEZING until every task has stopped; a task in D state can hold it there.
            wait_until(Duration::from_millis(500), || {
                read(&state).map(|s| s.trim() == want).unwrap_or(true)
            });
        }
    }

    /// The processes in the job's cgroup and every sub-cgroup under it, in every hierarchy.
    fn tree_pids(&self, name: &str) -> Vec<u32> {
        let mut all = Vec::new();
        for h in self.hierarchies() {
            all.extend(tree_pids(&Self::dir(h, name), &self.proc_root));
        }
        all.sort_unstable();
        all.dedup();
        all
    }

    /// Freeze, SIGKILL everything, thaw (so the kills are delivered), then wait until empty,
    /// killing again only what was not killed yet (nothing, unless a task was mid-fork). Covers
    /// the sub-cgroups the job made under its cgroup in any hierarchy (the v1 freezer freezes a
    /// frozen cgroup's descendants too). The wait is the kernel's: tearing down what the
    /// processes mapped (issue 34's cancel budget: 1,400 processes sharing 256 MiB take about
    /// 4 s on 2 cores); a frozen-kill-thaw round per look, as before, added half a second of
    /// dead time to each look while they died.
    pub fn clean_up(&self, name: &str) -> Result<Cleanup, CgroupError> {
        let dirs: Vec<PathBuf> = self
            .hierarchies()
            .iter()
            .map(|h| Self::dir(h, name))
            .collect();
        if !dirs.iter().any(|d| d.exists()) {
            return Ok(Cleanup::default());
        }
        // A tree too large to walk whole still has what the walk sees killed; remove_tree then
        // reports its size.
        let left = || self.tree_pids(name);
        let mut killed: std::collections::BTreeSet<u32> = std::collections::BTreeSet::new();
        let deadline = std::time::Instant::now() + super::KILL_WAIT;
        // What the last look found: an empty look ends the loop and is the answer (another
        // walk of every hierarchy would cost the common case, a job that left nothing, again).
        let mut now = left();
        while !now.is_empty() && std::time::Instant::now() < deadline {
            if now.iter().any(|p| !killed.contains(p)) {
                self.set_frozen(name, true);
                let frozen = left();
                kill_pids(&frozen);
                killed.extend(frozen);
                self.set_frozen(name, false);
            }
            wait_until(Duration::from_millis(50), || left().is_empty());
            now = left();
        }
        let killed: Vec<u32> = killed.into_iter().collect();
        if !now.is_empty() {
            return Err(CgroupError::Unkillable {
                path: Self::dir(&self.cpuset, name),
                pids: now,
            });
        }
        for d in &dirs {
            remove_tree(d)?;
        }
        Ok(Cleanup {
            killed,
            removed: true,
        })
    }
}
