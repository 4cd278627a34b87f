//! What the sandbox is to build, decided by the `command` hook from the job's state, the node
//! settings and the agent's variables, before it forks the command's child.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use kernelkite_sys::nvidia;
use kernelkite_topology::cpulist::format_cpu_list;
use kernelkite_topology::plan::{Slice, Vendor};

use super::user::JobUser;

/// A device node of the job's GPU(s): bound from `source` (the real node) to `/dev/<target>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceNode {
    /// The node on the host (`/dev/nvidia3`, or a directory such as `/dev/nvidia-caps`).
    pub source: PathBuf,
    /// Where it appears under the private `/dev` (`nvidia3`, `dri/renderD130`).
    pub target: PathBuf,
}

/// The job's limits as the job log states them (the cgroup enforces them; the sandbox only
/// reports them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LimitsNote {
    /// Memory limit in bytes.
    pub memory_bytes: u64,
    /// Most tasks.
    pub pids: u32,
    /// The cgroup version holding the job, `None` when unenforced.
    pub cgroup: Option<u8>,
}

/// Everything the sandbox does before the command runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxSpec {
    /// Who the command runs as.
    pub user: JobUser,
    /// Who the evaluator runs the submission as (`kernelkite_sys::identity`): the command then
    /// keeps `CAP_SETUID`, `CAP_SETGID` and `CAP_KILL`, its filter holding `set*id` to the
    /// two identities. `None` for a root command (`allow-root`), which keeps nothing.
    pub submission: Option<JobUser>,
    /// Supplementary groups the command keeps: the groups owning GPU device nodes that are
    /// not open to everyone (AMD's `render`/`video`); none otherwise.
    pub groups: Vec<u32>,
    /// The command's working directory (the checkout), entered again once the view is built.
    pub cwd: PathBuf,
    /// A network namespace with only loopback.
    pub isolate_network: bool,
    /// The job's own network namespace to join, bound at this path (`network: true`:
    /// [`crate::uplink`]); `None` with `isolate_network` is a fresh one with only loopback.
    pub uplink: Option<PathBuf>,
    /// Size of the private `/tmp` (and `/var/tmp`), bytes.
    pub tmp_size: u64,
    /// Size of the private `/dev/shm`, bytes.
    pub shm_size: u64,
    /// The job's GPU device nodes (and the driver's shared ones).
    pub devices: Vec<DeviceNode>,
    /// Paths the job must not reach: directories are covered by an empty read-only tmpfs,
    /// files and sockets by `/dev/null`.
    pub hide: Vec<PathBuf>,
    /// Directories bound back, writable, over whatever hides them: the checkout.
    pub writable: Vec<PathBuf>,
    /// Paths made read-only inside the view: the checkout's `.git`.
    pub read_only: Vec<PathBuf>,
    /// Host files bound back, read-only, at their own path over whatever hides them (the
    /// node's `--job-tool`s: the runner where it lies out of the job's reach, as in a clone
    /// under `/var/tmp` or `/root`). A directory on the way the job user may not search is
    /// covered too ([`tool_covers`]).
    pub tools: Vec<PathBuf>,
    /// The `--job-tool`s left out because someone other than root could change them, each
    /// with why ([`tool_paths`]): warnings for the job log.
    pub tools_refused: Vec<String>,
    /// The NVIDIA driver's `/proc` directory and what of it the job keeps ([`driver_proc`]).
    pub driver_proc: DriverProc,
    /// The step's artifact patterns (`BUILDKITE_ARTIFACT_PATHS`): what of the job's writes to
    /// its checkout is carried back to the host's disk (`sandbox::disk`).
    pub artifacts: Vec<String>,
    /// System calls the filter lets through for this step (`allow-syscalls`).
    pub allow_syscalls: Vec<String>,
    /// What the job log says about the limits.
    pub limits: LimitsNote,
}

/// What the job is shown of the NVIDIA driver's `/proc` directory (`/proc/driver/nvidia` on a
/// node, `<sysfs-root>/proc/driver/nvidia` in a test's tree): its own GPUs' directories and MIG
/// capability files, bound read-only over an empty tmpfs holding copies of the driver's
/// `version`, `params` and `registry` (what libnvidia-container shows a container). Every other
/// GPU's `gpus/<bus>/information` (model, UUID, bus id, minor), the MIG instances of other
/// jobs and the driver's writable files (`registry`, per-GPU `registry`, `numa_status`,
/// `unbindLock`, which uid 0 may write without a capability) are not there.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DriverProc {
    /// The directory covered; nothing is done where it does not exist (no driver).
    pub dir: PathBuf,
    /// The UVM driver's directory, covered whole by an empty read-only tmpfs: its `gpus/`
    /// names every GPU some process on the node is using, as `GPU-<uuid>`.
    pub uvm_dir: PathBuf,
    /// The job's GPUs' directories under `gpus/`, as the driver names them (`0000:18:00.0`).
    pub gpus: Vec<String>,
    /// The job's MIG capability files, relative to `dir`
    /// (`capabilities/gpu0/mig/gi3/access`, `capabilities/gpu0/mig/gi3/ci0/access`).
    pub caps: Vec<PathBuf>,
}

/// A bus id as the driver names its `gpus/` directories: lower case, a 4-digit domain (NVML's
/// 8-digit form, `00000000:18:00.0`, loses its 4 leading zeros, as libnvidia-container's
/// fallback does).
pub fn driver_bus_id(bus: &str) -> String {
    let bus = bus.to_ascii_lowercase();
    match bus.split_once(':') {
        Some((domain, rest)) if domain.len() == 8 && domain.starts_with("0000") => {
            format!("{}:{rest}", &domain[4..])
        }
        _ => bus,
    }
}

/// What of the driver's `/proc` directory under `sysfs_root` the job keeps ([`DriverProc`]):
/// the directories of the slice's NVIDIA GPUs that exist, and for a MIG device its GPU
/// instance's and compute instance's `access` files (the GPU's minor from its `information`),
/// where the driver has them. An AMD or CPU slice keeps nothing, and the directory is covered
/// all the same.
pub fn driver_proc(sysfs_root: &Path, slice: &Slice) -> DriverProc {
    let dir = sysfs_root.join("proc/driver/nvidia");
    let mut gpus: Vec<String> = Vec::new();
    let mut caps: Vec<PathBuf> = Vec::new();
    for g in slice.gpus().iter().filter(|g| g.vendor == Vendor::Nvidia) {
        let bus = driver_bus_id(&g.pci_bus_id);
        if !dir.join("gpus").join(&bus).is_dir() {
            continue;
        }
        if let Some(mig) = &g.mig {
            if let Some(minor) = nvidia::device_minor(sysfs_root, &bus) {
                let gi = PathBuf::from(format!(
                    "capabilities/gpu{minor}/mig/gi{}",
                    mig.gpu_instance_id
                ));
                for cap in [
                    gi.join("access"),
                    gi.join(format!("ci{}/access", mig.compute_instance_id)),
                ] {
                    if dir.join(&cap).is_file() && !caps.contains(&cap) {
                        caps.push(cap);
                    }
                }
            }
        }
        if !gpus.contains(&bus) {
            gpus.push(bus);
        }
    }
    DriverProc {
        uvm_dir: sysfs_root.join("proc/driver/nvidia-uvm"),
        dir,
        gpus,
        caps,
    }
}

/// Top-level directories the system needs: a setting that would hide one of them (say an
/// agent whose config lives directly in `/etc`) hides nothing instead.
const NEVER_HIDDEN: &[&str] = &[
    "bin", "boot", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "run", "sbin", "sys",
    "tmp", "usr", "var",
];

/// Whether a path may be hidden: absolute, normalised, and not `/` or a system directory.
pub fn hideable(path: &Path) -> bool {
    let parts: Vec<&std::ffi::OsStr> = match path
        .components()
        .map(|c| match c {
            Component::RootDir => Ok(None),
            Component::Normal(n) => Ok(Some(n)),
            _ => Err(()),
        })
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(p) if path.is_absolute() => p.into_iter().flatten().collect(),
        _ => return false,
    };
    match parts.as_slice() {
        [] => false,
        [top] => !NEVER_HIDDEN.iter().any(|n| top.to_str() == Some(n)),
        _ => true,
    }
}

/// The node's `--job-tool`s as the sandbox binds them: real paths (no link on the way, so the
/// path the job runs is the path bound), regular files only, each once, that no one but root
/// and `trusted` (the owner of the hooks' own binary, who can change what runs as root
/// already) can change ([`changeable_by_others`]): a tool someone else could replace would run
/// in every job with the evaluator's capabilities. A tool that cannot be resolved is left out
/// silently (the job fails to run it, saying where it looked); one others could change is left
/// out with the reason, for the job log. `access` reads a path's owner and mode.
pub fn tool_paths(
    given: &[PathBuf],
    trusted: u32,
    access: impl Fn(&Path) -> Option<Access>,
) -> (Vec<PathBuf>, Vec<String>) {
    let mut out: Vec<PathBuf> = Vec::new();
    let mut refused = Vec::new();
    for p in given.iter().filter(|p| p.is_absolute()) {
        let Ok(real) = std::fs::canonicalize(p) else {
            continue;
        };
        let Some(meta) = std::fs::metadata(&real).ok().filter(|m| m.is_file()) else {
            continue;
        };
        if out.contains(&real) {
            continue;
        }
        match changeable_by_others(&real, meta.nlink(), trusted, &access) {
            None => out.push(real),
            Some(why) => refused.push(format!(
                "the job tool {} is not bound into the sandbox: {why}; make it and every directory above it root's (or the hooks' owner's) and writable by that owner alone",
                real.display()
            )),
        }
    }
    (out, refused)
}

/// Why someone other than root and `trusted` could change the file `tool` (with `links` hard
/// links) or what its path leads to: the file, or a directory on its way, owned by another
/// user or writable by its group or others (a directory with the sticky bit excepted, as
/// `/tmp`: only an entry's owner may rename or remove it, and the entry is checked in turn).
/// In such a directory the file must have no other link: anyone may link a file of root's
/// there under the tool's name where the kernel does not protect hard links. `None` when only
/// they can.
pub fn changeable_by_others(
    tool: &Path,
    links: u64,
    trusted: u32,
    access: impl Fn(&Path) -> Option<Access>,
) -> Option<String> {
    const STICKY: u32 = 0o1000;
    for p in tool.ancestors() {
        let is_file = p == tool;
        let is_parent = tool.parent() == Some(p);
        let Some(a) = access(p) else {
            return Some(format!("cannot inspect {}", p.display()));
        };
        if a.uid != 0 && a.uid != trusted {
            return Some(format!("{} belongs to uid {}", p.display(), a.uid));
        }
        if a.mode & 0o022 != 0 && (is_file || a.mode & STICKY == 0) {
            return Some(format!(
                "{} is writable by its group or others (mode {:o})",
                p.display(),
                a.mode & 0o7777
            ));
        }
        if is_parent && a.mode & 0o022 != 0 && links > 1 {
            return Some(format!(
                "it has {links} hard links and lies in {}, where anyone may make one",
                p.display()
            ));
        }
    }
    None
}

/// Who may search a directory, as `stat` says: its owner, group and mode bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    /// Owner uid.
    pub uid: u32,
    /// Group gid.
    pub gid: u32,
    /// Mode bits (`st_mode`).
    pub mode: u32,
}

impl Access {
    /// Of `path` on this machine, `None` when it cannot be read.
    pub fn of(path: &Path) -> Option<Access> {
        std::fs::metadata(path).ok().map(|m| Access {
            uid: m.uid(),
            gid: m.gid(),
            mode: m.mode(),
        })
    }

    /// Whether `uid` (primary group `gid`, further `groups`) may search (enter) it; root's
    /// bypass is not counted, since the job user never has it.
    pub fn searchable_by(&self, uid: u32, gid: u32, groups: &[u32]) -> bool {
        let bit = if self.uid == uid {
            0o100
        } else if self.gid == gid || groups.contains(&self.gid) {
            0o010
        } else {
            0o001
        };
        self.mode & bit != 0
    }
}

/// The directories to cover so that the job user reaches `tool` through the sandbox's own
/// empty, searchable tmpfs: for each of `tools` not already under a path the sandbox covers
/// (`covered`: the fresh directories, `/run`, the hidden paths), the shallowest directory on
/// its way the user may not search, when it may be hidden ([`hideable`]). What such a
/// directory held was out of the user's reach anyway; only the tool (and the checkout, bound
/// back over any cover) appears inside. `access` reads a directory's owner and mode.
pub fn tool_covers(
    tools: &[PathBuf],
    covered: &[PathBuf],
    user: (u32, u32, &[u32]),
    access: impl Fn(&Path) -> Option<Access>,
) -> Vec<PathBuf> {
    let (uid, gid, groups) = user;
    let mut out: Vec<PathBuf> = Vec::new();
    for tool in tools {
        if covered.iter().chain(&out).any(|c| tool.starts_with(c)) {
            continue;
        }
        let mut ancestors: Vec<&Path> = tool.ancestors().skip(1).collect();
        ancestors.reverse();
        let blocked = ancestors
            .into_iter()
            .find(|d| !access(d).is_some_and(|a| a.searchable_by(uid, gid, groups)));
        if let Some(d) = blocked.filter(|d| hideable(d)) {
            out.push(d.to_path_buf());
        }
    }
    out
}

/// What the job must not reach, from the agent's variables and the node settings: the run dir
/// (leases, job state), the Job API socket's directory (every job's socket), the builds root
/// (other jobs' checkouts; the job's own is bound back), the agent's configuration file (its
/// token), hooks and plugins directories, and `extra`. Paths that are not [`hideable`], the
/// checkout itself and duplicates are dropped.
pub fn hidden_paths(
    env: &BTreeMap<String, String>,
    run_dir: &Path,
    checkout: Option<&Path>,
    extra: &[PathBuf],
) -> Vec<PathBuf> {
    let var = |k: &str| {
        env.get(k)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let mut out: Vec<PathBuf> = vec![run_dir.to_path_buf()];
    if let Some(socket) = var("BUILDKITE_AGENT_JOB_API_SOCKET") {
        out.extend(socket.parent().map(Path::to_path_buf));
    }
    // The builds root holds every job's checkout; without the variable, the checkout's parent
    // (the pipeline's directory, beside other pipelines' checkouts) is the most that is known.
    match (var("BUILDKITE_BUILD_PATH"), checkout) {
        (Some(builds), _) => out.push(builds),
        (None, Some(c)) => out.extend(c.parent().map(Path::to_path_buf)),
        (None, None) => {}
    }
    for k in [
        "BUILDKITE_CONFIG_PATH",
        "BUILDKITE_HOOKS_PATH",
        "BUILDKITE_PLUGINS_PATH",
    ] {
        out.extend(var(k));
    }
    out.extend(extra.iter().cloned());
    let mut kept: Vec<PathBuf> = Vec::new();
    for p in out {
        if hideable(&p) && Some(p.as_path()) != checkout && !kept.contains(&p) {
            kept.push(p);
        }
    }
    kept
}

/// The groups the job needs to open `devices`: for each node that others may not read and
/// write but its group may, that group (AMD's `render` or `video`); NVIDIA's nodes are usually
/// `0666` and need none.
pub fn device_groups(devices: &[DeviceNode]) -> Vec<u32> {
    let mut out: Vec<u32> = devices
        .iter()
        .filter_map(|d| std::fs::metadata(&d.source).ok())
        .filter(|m| m.mode() & 0o006 != 0o006 && m.mode() & 0o060 == 0o060)
        .map(|m| m.gid())
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// A size for the private `/tmp` or `/dev/shm`: the step's, else the job's memory limit (the
/// pages are charged to the job's memory cgroup either way, so a larger size could not be
/// used; the environment hook refuses a step's size above the limit).
pub fn tmpfs_size(asked: Option<u64>, memory_bytes: u64) -> u64 {
    asked.unwrap_or(memory_bytes).min(memory_bytes).max(1 << 20)
}

/// A one-line description of a size: `64 MiB`, `230 GiB`.
pub fn human_size(bytes: u64) -> String {
    const UNITS: &[(&str, u32)] = &[("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)];
    for (unit, shift) in UNITS {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{} {unit}", bytes >> shift);
        }
    }
    for (unit, shift) in UNITS {
        if bytes >= 1 << shift {
            return format!("{:.1} {unit}", bytes as f64 / (1u64 << shift) as f64);
        }
    }
    format!("{bytes} B")
}

/// The slice's CPUs and memory nodes as the log states them.
pub fn slice_note(slice: &Slice) -> String {
    format!(
        "CPUs {} ({} CPU{}), memory nodes {}",
        format_cpu_list(&slice.cpus),
        slice.cpus.len(),
        if slice.cpus.len() == 1 { "" } else { "s" },
        format_cpu_list(&slice.mems)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::test_support::slice_of;
    use kernelkite_topology::plan::SliceGpu;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_tool_behind_a_closed_directory_gets_a_cover_there() {
        // /root is 0700 (a clone in $HOME), /srv/open is open, /var/tmp is covered anyway.
        let access = |p: &Path| -> Option<Access> {
            let (uid, gid, mode) = match p.to_str()? {
                "/" | "/srv" | "/srv/open" | "/srv/open/bin" | "/var" | "/var/tmp" => {
                    (0, 0, 0o40755)
                }
                "/root" => (0, 0, 0o40700),
                "/root/kk" | "/root/kk/target" => (0, 0, 0o40755),
                "/home" => (0, 0, 0o40755),
                // The job user's group may enter, others not.
                "/home/team" => (0, 1500, 0o40750),
                _ => return None,
            };
            Some(Access { uid, gid, mode })
        };
        let tools = [
            PathBuf::from("/root/kk/target/kernelkite-runner"),
            PathBuf::from("/root/kk/target/other"),
            PathBuf::from("/srv/open/bin/kernelkite-runner"),
            PathBuf::from("/var/tmp/kk/kernelkite-runner"),
            PathBuf::from("/home/team/kernelkite-runner"),
        ];
        let covered = [PathBuf::from("/var/tmp")];
        assert_eq!(
            tool_covers(&tools, &covered, (1000, 1000, &[]), access),
            [PathBuf::from("/root"), PathBuf::from("/home/team")]
        );
        // In the directory's group: nothing to cover there.
        assert_eq!(
            tool_covers(&tools, &covered, (1000, 1000, &[1500]), access),
            [PathBuf::from("/root")]
        );
        // A closed system directory is never covered (the job would lose the system).
        let closed_var = |p: &Path| {
            Some(Access {
                uid: 0,
                gid: 0,
                mode: if p == Path::new("/var") {
                    0o40700
                } else {
                    0o40755
                },
            })
        };
        assert!(tool_covers(&tools[3..4], &[], (1000, 1000, &[]), closed_var).is_empty());
    }

    #[test]
    fn tools_are_real_files() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("tool");
        std::fs::write(&file, "").unwrap();
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let real = std::fs::canonicalize(&file).unwrap();
        // Root's, whoever runs the test.
        let roots = |p: &Path| {
            Access::of(p).map(|a| Access {
                uid: 0,
                mode: a.mode & !0o022,
                ..a
            })
        };
        assert_eq!(
            tool_paths(
                &[
                    link,
                    file.clone(),
                    d.path().to_path_buf(),
                    d.path().join("absent"),
                    PathBuf::from("relative/tool"),
                ],
                0,
                roots
            ),
            (vec![real], vec![])
        );
    }

    #[test]
    fn a_tool_someone_else_could_replace_is_not_bound() {
        let table = |owner: u32, tmp_mode: u32, bin_mode: u32, tool_mode: u32| {
            move |p: &Path| {
                let (uid, mode) = match p.to_str()? {
                    "/" => (0, 0o40755),
                    "/var" => (0, 0o40755),
                    "/var/tmp" => (0, tmp_mode),
                    "/var/tmp/kk" => (owner, bin_mode),
                    "/var/tmp/kk/runner" => (0, tool_mode),
                    _ => return None,
                };
                Some(Access { uid, gid: 0, mode })
            }
        };
        let tool = Path::new("/var/tmp/kk/runner");
        // A clone in /var/tmp (sticky, anyone may write) that root owns: bound.
        assert_eq!(
            changeable_by_others(tool, 1, 0, table(0, 0o41777, 0o40755, 0o100755)),
            None
        );
        for (access, why) in [
            (
                table(1000, 0o41777, 0o40755, 0o100755),
                "/var/tmp/kk belongs to uid 1000",
            ),
            (
                table(0, 0o40777, 0o40755, 0o100755),
                "/var/tmp is writable by its group or others (mode 777)",
            ),
            (
                table(0, 0o41777, 0o40775, 0o100755),
                "/var/tmp/kk is writable by its group or others (mode 775)",
            ),
            (
                table(0, 0o41777, 0o40755, 0o101777),
                "/var/tmp/kk/runner is writable by its group or others (mode 1777)",
            ),
        ] {
            assert_eq!(
                changeable_by_others(tool, 1, 0, access).as_deref(),
                Some(why)
            );
        }
        assert_eq!(
            changeable_by_others(Path::new("/opt/runner"), 1, 0, table(0, 0, 0, 0)).as_deref(),
            Some("cannot inspect /opt/runner")
        );
        // A clone of the user who owns the hooks' binary too (local mode from a clone in
        // their home): they can change what runs as root already.
        assert_eq!(
            changeable_by_others(tool, 1, 1000, table(1000, 0o41777, 0o40755, 0o100755)),
            None
        );
        // Straight in a sticky directory anyone may write: a second link could be anyone's
        // doing (a program of root's linked under the tool's name).
        let in_tmp = Path::new("/var/tmp/runner");
        let table_tmp = |p: &Path| {
            let mode = match p.to_str()? {
                "/var/tmp" => 0o41777,
                "/var/tmp/runner" => 0o100755,
                _ => 0o40755,
            };
            Some(Access {
                uid: 0,
                gid: 0,
                mode,
            })
        };
        assert_eq!(changeable_by_others(in_tmp, 1, 0, table_tmp), None);
        assert_eq!(
            changeable_by_others(in_tmp, 2, 0, table_tmp).as_deref(),
            Some("it has 2 hard links and lies in /var/tmp, where anyone may make one")
        );
        // Elsewhere a second link is root's own doing.
        assert_eq!(
            changeable_by_others(tool, 2, 0, table(0, 0o41777, 0o40755, 0o100755)),
            None
        );
    }

    #[test]
    fn system_directories_are_never_hidden() {
        for p in ["/", "/etc", "/usr", "/var", "/tmp", "relative", "/a/../etc"] {
            assert!(!hideable(Path::new(p)), "{p}");
        }
        for p in [
            "/builds",
            "/run/kernelkite",
            "/etc/buildkite-agent",
            "/var/lib/x",
        ] {
            assert!(hideable(Path::new(p)), "{p}");
        }
    }

    #[test]
    fn what_the_agent_knows_is_hidden_and_the_checkout_is_not() {
        let e = env(&[
            (
                "BUILDKITE_AGENT_JOB_API_SOCKET",
                "/var/lib/bk/sockets/job-api/1.sock",
            ),
            ("BUILDKITE_BUILD_PATH", "/var/lib/bk/builds"),
            (
                "BUILDKITE_CONFIG_PATH",
                "/etc/buildkite-agent/buildkite-agent.cfg",
            ),
            ("BUILDKITE_HOOKS_PATH", "/etc/buildkite-agent/hooks"),
            ("BUILDKITE_PLUGINS_PATH", ""),
        ]);
        let checkout = Path::new("/var/lib/bk/builds/a/org/p");
        let h = hidden_paths(
            &e,
            Path::new("/run/kernelkite"),
            Some(checkout),
            &[
                PathBuf::from("/etc"),
                PathBuf::from("/srv/secrets"),
                checkout.into(),
            ],
        );
        let h: Vec<&str> = h.iter().filter_map(|p| p.to_str()).collect();
        assert_eq!(
            h,
            [
                "/run/kernelkite",
                "/var/lib/bk/sockets/job-api",
                "/var/lib/bk/builds",
                "/etc/buildkite-agent/buildkite-agent.cfg",
                "/etc/buildkite-agent/hooks",
                "/srv/secrets",
            ]
        );
        // Without BUILDKITE_BUILD_PATH the checkout's parent stands in.
        let h = hidden_paths(&env(&[]), Path::new("/run/kk"), Some(checkout), &[]);
        assert_eq!(
            h,
            [
                PathBuf::from("/run/kk"),
                PathBuf::from("/var/lib/bk/builds/a/org")
            ]
        );
    }

    #[test]
    fn the_job_keeps_only_its_own_gpus_and_mig_capabilities_of_the_driver_s_proc() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        kernelkite_testkit_leaf::fake_nvml::write_driver_proc(
            r,
            &[("0000:18:00.0", 0), ("0000:19:00.0", 1)],
            &[(0, 3, 0), (0, 5, 0)],
        )
        .unwrap();
        let gpu = |bus: &str| SliceGpu {
            vendor: Vendor::Nvidia,
            pci_bus_id: bus.into(),
            uuid: None,
            numa_node: Some(0),
            mig: None,
        };
        let d = driver_proc(r, &slice_of(vec![gpu("0000:18:00.0")]));
        assert_eq!(d.dir, r.join("proc/driver/nvidia"));
        assert_eq!(d.uvm_dir, r.join("proc/driver/nvidia-uvm"));
        assert_eq!(d.gpus, ["0000:18:00.0"]);
        assert!(d.caps.is_empty(), "{:?}", d.caps);
        // NVML's form of the bus id names the same directory.
        let d = driver_proc(r, &slice_of(vec![gpu("00000000:18:00.0")]));
        assert_eq!(d.gpus, ["0000:18:00.0"]);
        assert_eq!(driver_bus_id("00000000:2A:00.0"), "0000:2a:00.0");
        assert_eq!(driver_bus_id("0001:2a:00.0"), "0001:2a:00.0");
        // Two GPUs, both kept; a GPU the driver does not list is not.
        let d = driver_proc(
            r,
            &slice_of(vec![
                gpu("0000:19:00.0"),
                gpu("0000:18:00.0"),
                gpu("0000:99:00.0"),
            ]),
        );
        assert_eq!(d.gpus, ["0000:19:00.0", "0000:18:00.0"]);
        // A MIG device: its GPU's directory and its own two access files, no other instance's
        // and not MIG's config or monitor.
        let mig = |gi: u32| SliceGpu {
            mig: Some(kernelkite_topology::plan::MigInstance {
                uuid: format!("MIG-{gi}"),
                gpu_instance_id: gi,
                compute_instance_id: 0,
                memory_bytes: 10 << 30,
            }),
            ..gpu("0000:18:00.0")
        };
        let d = driver_proc(r, &slice_of(vec![mig(3)]));
        assert_eq!(d.gpus, ["0000:18:00.0"]);
        assert_eq!(
            d.caps,
            [
                PathBuf::from("capabilities/gpu0/mig/gi3/access"),
                PathBuf::from("capabilities/gpu0/mig/gi3/ci0/access")
            ]
        );
        // A MIG device the driver does not list gets no access file, not another's.
        assert!(driver_proc(r, &slice_of(vec![mig(9)])).caps.is_empty());
        // An AMD slice keeps nothing (the directory is covered all the same).
        let amd = SliceGpu {
            vendor: Vendor::Amd,
            ..gpu("0000:18:00.0")
        };
        let d = driver_proc(r, &slice_of(vec![amd]));
        assert!(d.gpus.is_empty() && d.caps.is_empty());
        // No driver: nothing to keep, and no directory.
        let bare = tempfile::tempdir().unwrap();
        let d = driver_proc(bare.path(), &slice_of(vec![gpu("0000:18:00.0")]));
        assert!(d.gpus.is_empty() && d.caps.is_empty());
        assert!(!d.dir.exists());
    }

    #[test]
    fn a_group_is_kept_only_for_nodes_closed_to_others() {
        let dir = tempfile::tempdir().unwrap();
        let node = |name: &str, mode: u32| {
            let p = dir.path().join(name);
            std::fs::write(&p, "").unwrap();
            std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(mode))
                .unwrap();
            DeviceNode {
                source: p,
                target: name.into(),
            }
        };
        let open = node("nvidia0", 0o666);
        let render = node("renderD128", 0o660);
        let gid = std::fs::metadata(&render.source).unwrap().gid();
        assert!(device_groups(std::slice::from_ref(&open)).is_empty());
        assert_eq!(device_groups(&[open, render.clone(), render]), vec![gid]);
    }

    #[test]
    fn sizes_stay_within_the_memory_limit_and_read_well() {
        assert_eq!(tmpfs_size(None, 64 << 20), 64 << 20);
        assert_eq!(tmpfs_size(Some(8 << 30), 64 << 20), 64 << 20);
        assert_eq!(tmpfs_size(Some(16 << 20), 64 << 20), 16 << 20);
        assert_eq!(human_size(64 << 20), "64 MiB");
        assert_eq!(human_size(230 << 30), "230 GiB");
        assert_eq!(human_size(1536 << 20), "1536 MiB");
        assert_eq!(human_size((1 << 30) + 1), "1.0 GiB");
        assert_eq!(human_size(12), "12 B");
        assert_eq!(
            slice_note(&slice_of(vec![])),
            "CPUs 1-2 (2 CPUs), memory nodes 0"
        );
    }
}
