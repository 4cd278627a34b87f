//! The job's private view of the machine, built in the command's child (as root, in a new mount
//! namespace, before it drops privileges):
//!
//! 1. every mount made private (`MS_REC|MS_PRIVATE`): nothing done here reaches the host, and
//!    nothing mounted on the host later appears in the job;
//! 2. every mount of the host's read-only, the cgroup file systems included (one recursive
//!    `mount_setattr` on `/`), so that the job writes no host disk: what it may write is
//!    mounted afterwards, each bounded; before Linux 5.12 only the cgroup mounts (and the tmpfs
//!    holding v1's hierarchies), by a remount each;
//! 3. layers, shallowest first: an empty read-only tmpfs over the host's `/run` (its sockets:
//!    D-Bus, databases, container runtimes, the journal; with the resolver file
//!    `/etc/resolv.conf` points to there bound back, read-only, for a step with the network),
//!    fresh tmpfs on `/tmp`, `/var/tmp` and `/run/lock` (the host's world-writable directories;
//!    gone with the namespace), an empty read-only tmpfs over each
//!    hidden directory (`/dev/null` over a hidden file), and the checkout bound back over
//!    whatever hid it (its path is made inside the covering tmpfs first), under an overlay
//!    whose writable layer is a tmpfs of the job's own (`disk`), and the node's tools (the
//!    runner, where it lies out of the job's reach) bound back read-only the same way;
//! 4. the checkout's `.git` read-only (and, being a mount point, impossible to rename away);
//! 5. a private `/dev`: a read-only tmpfs holding `null`, `zero`, `full`, `random`, `urandom`,
//!    `tty`, a new `devpts` instance with `ptmx`, a fresh `/dev/shm`, `mqueue` (in the new IPC
//!    namespace) where the host has one, the `fd`/`stdin`/`stdout`/`stderr` links and the job's
//!    GPU nodes, bound from the real ones (never `mknod`): other GPUs' nodes do not exist;
//! 6. a new `/proc` that shows only the job user's processes (`hidepid`, Linux 5.8+, where it
//!    is per mount), in which (on older kernels, in the host's):
//!    * the NVIDIA driver's directory is covered by a read-only tmpfs holding copies of its
//!      `version`, `params` (with `ModifyDeviceFiles: 0`) and `registry`, and the job's own
//!      GPUs' `gpus/<bus>` and MIG capability files bound back read-only: other GPUs' models,
//!      UUIDs and MIG instances are not there, and no driver file is writable (as
//!      libnvidia-container does for a container); the UVM driver's directory, which names
//!      every GPU in use on the node, is covered empty;
//!    * `/proc/bus`, `/proc/fs`, `/proc/sys` and `/proc/sysrq-trigger` are bound read-only
//!      (runc's read-only paths): files root owns and writes by their mode alone,
//!      which an `allow-root` job (uid 0, no capabilities) could otherwise write;
//!    * the kernel's files that tell of the whole machine ([`MASKED`]: runc's masked paths,
//!      the physical page maps, interrupt counts by device, root's views of the kernel's
//!      internals) are covered, a directory by an empty read-only tmpfs, a file by `/dev/null`
//!      bound read-only, wherever the command could read them: what only root may read is
//!      left to its mode for a command that is not root;
//! 7. the working directory entered again, so that it resolves through the new mounts.
//!
//! Sources are cloned (`open_tree`) before anything covers them. Only `rustix` system calls;
//! the namespaces themselves are `kernelkite_sys::raw::unshare_namespaces`.

use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags, CWD};
use rustix::mount::{MountFlags, MountPropagationFlags, MoveMountFlags, OpenTreeFlags};

use super::disk::{self, Overlaid};
use super::spec::{DriverProc, SandboxSpec};
use super::SandboxError;

/// The device nodes every job gets, from the host's `/dev`.
pub const STANDARD_NODES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

/// Host directories anyone may write to, each replaced by a fresh tmpfs: what the job leaves
/// there goes with its namespace.
pub const FRESH_DIRS: &[&str] = &["/tmp", "/var/tmp", "/run/lock"];

/// The command's `HOME`: a directory of the fresh `/tmp`, the job user's alone (`0700`), so that
/// nothing another uid of the job (the submission's) plants there (a `.local` site directory,
/// a `.gitconfig`) is read by the job user's later processes.
pub const JOB_HOME: &str = "/tmp/.kernelkite-home";

/// The host's runtime directory: every daemon's sockets and state. Replaced whole by an empty
/// read-only tmpfs (whatever the hide settings say: it is never the job's), so that no host
/// socket (D-Bus, a database, a container runtime, the journal, which may take the command's
/// `CAP_SETUID`-forged credentials at their word) is reachable by its path.
pub const HOST_RUN: &str = "/run";

/// The NVIDIA driver's files a job is shown copies of (libnvidia-container's three): its
/// version, its module parameters (edited, [`unmodifiable_params`]) and its registry keys.
pub const DRIVER_FILES: &[&str] = &["version", "params", "registry"];

/// Paths of `/proc` bound read-only in the job's view: runc's read-only paths for a container
/// (less `/proc/irq`, which [`MASKED`] covers whole). Their files are root's and most check no
/// capability (a sysctl, the SysRq trigger), so uid 0 without capabilities (`allow-root`) could
/// write them.
pub const PROC_READ_ONLY: &[&str] = &["/proc/bus", "/proc/fs", "/proc/sys", "/proc/sysrq-trigger"];

/// Kernel files and directories a job is not shown (covered empty): runc's masked paths for a
/// container (`/proc/kcore`, `/proc/keys`, `/proc/timer_list`, ACPI, sound, SCSI, firmware
/// tables, RAPL energy counters), the physical page maps (`/proc/kpage*`, which map physical
/// memory for an attacker choosing rows to hammer, and `page_idle`), interrupt counts by device
/// (`/proc/interrupts`, `/proc/irq`, `/sys/kernel/irq`: how busy the node's other GPUs, and so
/// other jobs, are; `/proc/stat`'s `intr` line still sums them by number, and stays, as every
/// tool reading CPU times needs the file), and what root alone may read of the kernel's
/// internals (`slabinfo`, `pagetypeinfo`, debugfs, tracefs, pstore, the BPF file system), which
/// the job sees where the host mounts them under `/sys`.
pub const MASKED: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/interrupts",
    "/proc/irq",
    "/proc/kcore",
    "/proc/keys",
    "/proc/kpagecgroup",
    "/proc/kpagecount",
    "/proc/kpageflags",
    "/proc/latency_stats",
    "/proc/pagetypeinfo",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/slabinfo",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/sys/devices/virtual/powercap",
    "/sys/firmware",
    "/sys/fs/bpf",
    "/sys/fs/pstore",
    "/sys/kernel/debug",
    "/sys/kernel/irq",
    "/sys/kernel/mm/page_idle",
    "/sys/kernel/tracing",
];

/// Whether a command running as `uid` needs [`MASKED`]'s path covered: not where only root may
/// read it (a file or directory owned by root, no permission for group or others) and the
/// command is not root, since it cannot open or enter it anyway (it has no capability that
/// bypasses permissions), and every mount is time spent before the command starts.
pub fn needs_mask(uid: u32, owner: u32, mode: u32) -> bool {
    uid == 0 || owner != 0 || mode & 0o077 != 0
}

/// The driver's `params` as a job is shown them: `ModifyDeviceFiles: 0`, so that the user-space
/// driver (NVML, CUDA) does not try to make or fix `/dev/nvidia*` nodes for GPUs the job lacks
/// (libnvidia-container's edit). Every other line is kept.
pub fn unmodifiable_params(text: &str) -> String {
    text.replace("ModifyDeviceFiles: 1", "ModifyDeviceFiles: 0")
}

/// The resolver file to keep under the covered `/run`: where `/etc/resolv.conf` leads
/// (`resolved`, the real path), when that is under `/run` and the step has the network.
pub fn kept_resolver(resolved: Option<PathBuf>, network: bool) -> Option<PathBuf> {
    resolved.filter(|p| network && p.starts_with(HOST_RUN) && p != Path::new(HOST_RUN))
}

/// systemd-resolved's list of its upstream servers.
pub const RESOLVED_UPSTREAM: &str = "/run/systemd/resolve/resolv.conf";

/// Whether every `nameserver` of resolver file `text` is on loopback (systemd-resolved's stub
/// at 127.0.0.53, a local dnsmasq at 127.0.0.1): unreachable from a namespace of its own.
pub fn only_loopback_resolvers(text: &str) -> bool {
    let servers: Vec<&str> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .map(str::trim)
        .collect();
    !servers.is_empty()
        && servers.iter().all(|s| {
            s.parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
        })
}

/// For a job with its own network (`network: true`), what to show at the node's resolver file
/// `at` (where `/etc/resolv.conf` leads): `at` itself, unless it names only loopback resolvers,
/// which the job's namespace does not have; then systemd-resolved's upstream list where it is
/// (`upstream`), else `at` anyway (the job then resolves nothing; plugin/README.md says so).
pub fn resolver_for_own_network(at: &Path, text: &str, upstream: Option<&Path>) -> PathBuf {
    match upstream {
        Some(u) if only_loopback_resolvers(text) => u.to_path_buf(),
        _ => at.to_path_buf(),
    }
}

/// The text of the resolver file a job with its own network is shown (read as
/// [`resolver_for_own_network`] picks it), for the job's rules to open its servers.
pub fn own_network_resolver_text() -> String {
    let Some(at) = real(Path::new("/etc/resolv.conf")) else {
        return String::new();
    };
    let text = std::fs::read_to_string(&at).unwrap_or_default();
    let upstream = Path::new(RESOLVED_UPSTREAM);
    let shown = resolver_for_own_network(&at, &text, Some(upstream).filter(|u| u.is_file()));
    if shown == at {
        text
    } else {
        std::fs::read_to_string(shown).unwrap_or_default()
    }
}

/// One mount of step 3.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layer {
    /// A fresh, writable tmpfs of this size (`/tmp`).
    Fresh(PathBuf, u64),
    /// An empty read-only tmpfs (a hidden directory) or `/dev/null` (a hidden file).
    Hidden(PathBuf),
    /// A directory bound back, writable (the checkout).
    Writable(PathBuf),
    /// A host file bound back, read-only, under a hidden directory (the resolver file).
    Kept(PathBuf),
}

impl Layer {
    /// Where the layer is mounted.
    pub fn path(&self) -> &Path {
        match self {
            Layer::Fresh(p, _) | Layer::Hidden(p) | Layer::Writable(p) | Layer::Kept(p) => p,
        }
    }
}

fn depth(p: &Path) -> usize {
    p.components().count()
}

/// Step 3's mounts in the order they are made: shallowest first, covering layers before a
/// writable one at the same depth, so that a layer never hides one made before it that it
/// should not. Layers under `/dev` and `/proc` are dropped (both are replaced whole).
pub fn order_layers(mut layers: Vec<Layer>) -> Vec<Layer> {
    layers.retain(|l| !l.path().starts_with("/dev") && !l.path().starts_with("/proc"));
    layers.sort_by_key(|l| (depth(l.path()), matches!(l, Layer::Writable(_))));
    let mut out: Vec<Layer> = Vec::with_capacity(layers.len());
    for l in layers {
        if !out.contains(&l) {
            out.push(l);
        }
    }
    out
}

/// The directories to make inside a covering tmpfs at `cover` so that the writable paths
/// under it can be mounted there: each one's path relative to `cover`, parents first.
pub fn dirs_to_make(cover: &Path, writable: &[PathBuf]) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for w in writable {
        let Ok(rel) = w.strip_prefix(cover) else {
            continue;
        };
        let mut acc = PathBuf::new();
        for c in rel.components() {
            acc.push(c);
            if !out.contains(&acc) {
                out.push(acc.clone());
            }
        }
    }
    out
}

/// What [`build`] made, for the job log.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Built {
    /// Cgroup mounts (and v1's tmpfs) made read-only.
    pub read_only_cgroups: Vec<PathBuf>,
    /// Other paths made read-only (`.git`).
    pub read_only: Vec<PathBuf>,
    /// Fresh tmpfs mounts and their sizes, `/dev/shm` included.
    pub fresh: Vec<(PathBuf, u64)>,
    /// Hidden paths.
    pub hidden: Vec<PathBuf>,
    /// Writable paths bound back.
    pub writable: Vec<PathBuf>,
    /// Device nodes under the private `/dev` (GPU nodes first).
    pub devices: Vec<PathBuf>,
    /// `/proc` shows only the job user's processes.
    pub private_proc: bool,
    /// What the job is shown of the NVIDIA driver's `/proc` directory; `None` where there is
    /// none (no driver).
    pub driver_proc: Option<DriverShown>,
    /// Every host mount is read-only in the view (`mount_setattr`, Linux 5.12+).
    pub host_read_only: bool,
}

/// What [`build`] left of the NVIDIA driver's `/proc` directory.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DriverShown {
    /// The directory covered (its real path: `/proc/driver/nvidia` on a node).
    pub dir: PathBuf,
    /// The driver's files copied in ([`DRIVER_FILES`] that exist).
    pub files: Vec<String>,
    /// The job's GPUs, whose `gpus/<bus>` directories were bound back.
    pub gpus: Vec<String>,
    /// The job's MIG capability files bound back, relative to `dir`.
    pub caps: Vec<PathBuf>,
    /// The UVM driver's directory, covered empty, where it exists.
    pub uvm: Option<PathBuf>,
}

fn step(what: &'static str, path: &Path) -> impl FnOnce(rustix::io::Errno) -> SandboxError {
    let path = path.to_path_buf();
    move |e| SandboxError::Step {
        what,
        path,
        source: e.into(),
    }
}

fn io_step(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> SandboxError {
    let path = path.to_path_buf();
    move |source| SandboxError::Step { what, path, source }
}

/// A detached copy of the mount tree at `path` (recursive), to be attached elsewhere later.
fn clone_tree(path: &Path) -> Result<OwnedFd, SandboxError> {
    rustix::mount::open_tree(
        CWD,
        path,
        OpenTreeFlags::OPEN_TREE_CLONE
            | OpenTreeFlags::OPEN_TREE_CLOEXEC
            | OpenTreeFlags::AT_RECURSIVE,
    )
    .map_err(step("clone the mount of", path))
}

/// Attaches a detached copy at `target`.
fn attach(tree: &OwnedFd, target: &Path) -> Result<(), SandboxError> {
    rustix::mount::move_mount(
        tree,
        "",
        CWD,
        target,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )
    .map_err(step("mount onto", target))
}

fn tmpfs(target: &Path, flags: MountFlags, options: &str) -> Result<(), SandboxError> {
    let data = std::ffi::CString::new(options).map_err(|e| SandboxError::Step {
        what: "mount a tmpfs on",
        path: target.to_path_buf(),
        source: std::io::Error::other(e),
    })?;
    rustix::mount::mount("tmpfs", target, "tmpfs", flags, data.as_c_str())
        .map_err(step("mount a tmpfs on", target))
}

/// Makes an existing mount read-only, keeping its other flags (`nosuid`, `noexec`, ...).
fn bind_read_only(target: &Path) -> Result<(), SandboxError> {
    use rustix::fs::StatVfsMountFlags as V;
    let st = rustix::fs::statvfs(target).map_err(step("inspect the mount", target))?;
    let mut flags = MountFlags::BIND | MountFlags::RDONLY;
    for (v, m) in [
        (V::NOSUID, MountFlags::NOSUID),
        (V::NODEV, MountFlags::NODEV),
        (V::NOEXEC, MountFlags::NOEXEC),
        (V::NOATIME, MountFlags::NOATIME),
        (V::NODIRATIME, MountFlags::NODIRATIME),
        (V::RELATIME, MountFlags::RELATIME),
    ] {
        if st.f_flag.contains(v) {
            flags |= m;
        }
    }
    rustix::mount::mount_remount(target, flags, "").map_err(step("make read-only", target))
}

fn mkdir_p(base: &Path, rel: &[PathBuf]) -> Result<(), SandboxError> {
    for r in rel {
        let p = base.join(r);
        match rustix::fs::mkdir(&p, Mode::from_raw_mode(0o755)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(step("make the directory", &p)(e)),
        }
    }
    Ok(())
}

/// Makes `home`, the job user's alone.
fn private_home(home: &Path, user: &super::user::JobUser) -> Result<(), SandboxError> {
    rustix::fs::mkdir(home, Mode::from_raw_mode(0o700)).map_err(step("make", home))?;
    rustix::fs::chown(
        home,
        Some(rustix::process::Uid::from_raw(user.uid)),
        Some(rustix::process::Gid::from_raw(user.gid)),
    )
    .map_err(step("give the job user", home))
}

/// An empty file to mount a device node on.
fn touch(path: &Path) -> Result<(), SandboxError> {
    rustix::fs::open(
        path,
        OFlags::CREATE | OFlags::WRONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map(drop)
    .map_err(step("make the mount point", path))
}

/// Whether this kernel keeps `/proc` options per mount (5.8+): before that, a `hidepid` given
/// to a new mount would change the host's `/proc` too.
fn proc_options_are_per_mount() -> bool {
    let uname = rustix::system::uname();
    let release = uname.release().to_string_lossy();
    let mut nums = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse::<u32>().ok());
    matches!((nums.next(), nums.next()), (Some(major), Some(minor)) if (major, minor) >= (5, 8))
}

/// Cgroup file systems and v1's tmpfs at `/sys/fs/cgroup`, from this namespace's mountinfo.
fn cgroup_mounts() -> Result<Vec<PathBuf>, SandboxError> {
    let path = Path::new("/proc/self/mountinfo");
    let text = std::fs::read_to_string(path).map_err(io_step("read", path))?;
    let mut out: Vec<PathBuf> = crate::mountinfo::parse_mountinfo(&text)
        .into_iter()
        .filter(|m| {
            m.fs_type == "cgroup"
                || m.fs_type == "cgroup2"
                || (m.fs_type == "tmpfs" && m.mount_point == "/sys/fs/cgroup")
        })
        .map(|m| PathBuf::from(m.mount_point))
        .collect();
    out.dedup();
    Ok(out)
}

/// Makes the cgroup mounts read-only, one remount each: for kernels without `mount_setattr`,
/// where the host's tree cannot be made read-only in one call.
fn read_only_cgroups(mounts: &[PathBuf]) -> Result<(), SandboxError> {
    mounts.iter().try_for_each(|mp| bind_read_only(mp))
}

/// A path's real location (links resolved), when it exists.
fn real(path: &Path) -> Option<PathBuf> {
    std::fs::canonicalize(path).ok()
}

/// Builds the job's view (see the module's documentation). The caller has already entered new
/// mount and IPC (and, when asked, network) namespaces. Returns what was built, and the
/// overlaid checkouts whose writes the namespace's init carries back when the job ends.
pub fn build(spec: &SandboxSpec) -> Result<(Built, Vec<Overlaid>), SandboxError> {
    let mut built = Built::default();
    let root = Path::new("/");
    rustix::mount::mount_change(
        root,
        MountPropagationFlags::REC | MountPropagationFlags::PRIVATE,
    )
    .map_err(step("make every mount private under", root))?;

    // Everything to be attached later is cloned before anything covers it.
    let mut sources = clone_sources(spec)?;

    // Every mount of the host's read-only in this view (the cgroup mounts with the rest), so
    // that nothing the job can write lands on a host disk: what it may write (the fresh tmpfs
    // mounts, the checkout's overlay, `/dev`) is mounted afterwards, each bounded. Device nodes
    // stay usable (a read-only mount refuses writes to files and directories, not to
    // devices). A kernel without `mount_setattr` (before 5.12) gets the cgroup mounts
    // read-only one by one, and the host's other file systems stay as they are.
    built.read_only_cgroups = cgroup_mounts()?;
    built.host_read_only = kernelkite_sys::raw::make_tree_read_only(root).is_ok();
    if !built.host_read_only {
        read_only_cgroups(&built.read_only_cgroups)?;
    }

    // Step 3.
    let overlays = mount_layers(spec, &mut sources, &mut built)?;

    // Step 4.
    for p in spec.read_only.iter().filter_map(|p| real(p)) {
        rustix::mount::mount_bind(&p, &p).map_err(step("bind", &p))?;
        bind_read_only(&p)?;
        built.read_only.push(p);
    }

    // Step 5.
    private_dev(spec, &sources, &mut built)?;

    // Step 6.
    if proc_options_are_per_mount() {
        let proc = Path::new("/proc");
        rustix::mount::mount(
            "proc",
            proc,
            "proc",
            MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
            c"hidepid=invisible",
        )
        .map_err(step("mount a private /proc on", proc))?;
        built.private_proc = true;
    }
    // In the new `/proc` (on older kernels, in the host's, of which this namespace has a copy
    // of its own): the driver's directory masked, and root's writable files read-only.
    built.driver_proc = mask_driver_proc(&spec.driver_proc)?;
    proc_read_only(&mut built)?;
    mask_kernel_paths(spec.user.uid, sources.nodes_read_only, &mut built)?;

    // Step 7.
    rustix::process::chdir(&spec.cwd).map_err(step("enter", &spec.cwd))?;
    Ok((built, overlays))
}

/// What [`build`] attaches, cloned (`open_tree`) before anything covers it.
struct Sources {
    /// The writable paths (real locations) and their trees.
    writable: Vec<(PathBuf, OwnedFd)>,
    /// The hidden paths (real locations), each with whether it is a directory; `/run` last.
    hide: Vec<(PathBuf, bool)>,
    /// The resolver file kept under the covered `/run` and the node's tools, with their trees.
    kept: Vec<(PathBuf, OwnedFd)>,
    /// A clone of `/dev/null` for each hidden file.
    null_copies: Vec<OwnedFd>,
    /// The private `/dev`'s nodes: path under `/dev`, tree, whether it is a directory.
    nodes: Vec<(PathBuf, OwnedFd, bool)>,
    /// The host's `/dev/pts` and `/dev/ptmx`, for kernels without devpts instances.
    host_pts: Option<OwnedFd>,
    host_ptmx: Option<OwnedFd>,
    /// The host has `/dev/mqueue`.
    mqueue: bool,
    /// The nodes and `/dev/null` copies are read-only already ([`read_only_node`]); where the
    /// kernel could not make them so, each is made read-only once attached.
    nodes_read_only: bool,
}

/// Clones every source [`build`] attaches later, and settles what is hidden.
fn clone_sources(spec: &SandboxSpec) -> Result<Sources, SandboxError> {
    let writable: Vec<(PathBuf, OwnedFd)> = spec
        .writable
        .iter()
        .filter_map(|p| real(p))
        .map(|p| clone_tree(&p).map(|fd| (p, fd)))
        .collect::<Result<_, _>>()?;
    let hide: Vec<(PathBuf, bool)> = spec
        .hide
        .iter()
        .filter_map(|p| real(p))
        .filter(|p| super::spec::hideable(p))
        .filter_map(|p| {
            let is_dir = std::fs::metadata(&p).ok()?.is_dir();
            Some((p, is_dir))
        })
        .collect();
    let resolver = real(Path::new("/etc/resolv.conf"));
    // With the job's own network, loopback resolvers are not there: another list is shown at
    // the resolver's path, wherever it is.
    let source = |at: &Path| match &spec.uplink {
        Some(_) => resolver_for_own_network(
            at,
            &std::fs::read_to_string(at).unwrap_or_default(),
            Some(Path::new(RESOLVED_UPSTREAM)).filter(|u| u.is_file()),
        ),
        None => at.to_path_buf(),
    };
    let at = resolver.filter(|p| {
        kept_resolver(Some(p.clone()), !spec.isolate_network).is_some()
            || (!spec.isolate_network && source(p) != *p)
    });
    let mut kept: Vec<(PathBuf, OwnedFd)> = at
        .map(|p| clone_tree(&source(&p)).map(|fd| (p, fd)))
        .transpose()?
        .into_iter()
        .collect();
    for tool in &spec.tools {
        kept.push((tool.clone(), clone_tree(tool)?));
    }
    let mut hide = hide;
    if std::fs::symlink_metadata(HOST_RUN).is_ok_and(|m| m.is_dir()) {
        hide.push((PathBuf::from(HOST_RUN), true));
    }
    let mut read_only = true;
    let mut node = |path: &Path| {
        read_only_node(path).map(|(tree, ro)| {
            read_only &= ro;
            tree
        })
    };
    let null_copies: Vec<OwnedFd> = hide
        .iter()
        .filter(|(_, dir)| !dir)
        .map(|_| node(Path::new("/dev/null")))
        .collect::<Result<_, _>>()?;
    let dev = Path::new("/dev");
    let mut nodes: Vec<(PathBuf, OwnedFd, bool)> = Vec::new();
    for d in &spec.devices {
        let is_dir = std::fs::metadata(&d.source).is_ok_and(|m| m.is_dir());
        nodes.push((d.target.clone(), node(&d.source)?, is_dir));
    }
    for n in STANDARD_NODES {
        let source = dev.join(n);
        if source.exists() {
            nodes.push((PathBuf::from(n), node(&source)?, false));
        }
    }
    let host_pts = node(&dev.join("pts")).ok();
    let host_ptmx = node(&dev.join("ptmx")).ok();
    Ok(Sources {
        writable,
        hide,
        kept,
        null_copies,
        nodes,
        host_pts,
        host_ptmx,
        mqueue: dev.join("mqueue").is_dir(),
        nodes_read_only: read_only,
    })
}

/// A detached copy of the host's node at `path` (a device, `/dev/null` for a hidden file, the
/// host's devpts), read-only before it is attached anywhere, and whether that took: the job
/// opens the device as before (a device opens for writing on a read-only mount), but a root
/// command (`allow-root`: uid 0, the owner of the host's nodes, no capabilities needed to
/// chmod its own files) cannot change the host's node through it. Before Linux 5.12 the kernel
/// has no `mount_setattr`, and the node is made read-only once attached ([`bind_read_only`]).
fn read_only_node(path: &Path) -> Result<(OwnedFd, bool), SandboxError> {
    use std::os::fd::AsFd;
    let tree = clone_tree(path)?;
    let ro = kernelkite_sys::raw::make_detached_read_only(tree.as_fd()).is_ok();
    Ok((tree, ro))
}

/// Mounts the layers (step 3), shallowest first; returns the overlaid checkouts.
fn mount_layers(
    spec: &SandboxSpec,
    sources: &mut Sources,
    built: &mut Built,
) -> Result<Vec<Overlaid>, SandboxError> {
    let mut overlays: Vec<Overlaid> = Vec::new();
    let mut layers: Vec<Layer> = FRESH_DIRS
        .iter()
        .map(Path::new)
        .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir()))
        .map(|p| {
            let size = if p == Path::new("/run/lock") {
                spec.tmp_size.min(16 << 20)
            } else {
                spec.tmp_size
            };
            Layer::Fresh(p.to_path_buf(), size)
        })
        .collect();
    layers.extend(sources.hide.iter().map(|(p, _)| Layer::Hidden(p.clone())));
    layers.extend(
        sources
            .writable
            .iter()
            .map(|(p, _)| Layer::Writable(p.clone())),
    );
    layers.extend(sources.kept.iter().map(|(p, _)| Layer::Kept(p.clone())));
    let writable_paths: Vec<PathBuf> = sources.writable.iter().map(|(p, _)| p.clone()).collect();
    let kept_dirs: Vec<PathBuf> = sources
        .kept
        .iter()
        .filter_map(|(p, _)| p.parent().map(Path::to_path_buf))
        .collect();
    // What a covering tmpfs must hold mount points for: the writable paths, the fresh
    // directories (`/run/lock` under `/run`) and the kept files' directories.
    let mut deeper: Vec<PathBuf> = writable_paths.clone();
    deeper.extend(
        layers
            .iter()
            .filter(|l| matches!(l, Layer::Fresh(..)))
            .map(|l| l.path().to_path_buf()),
    );
    deeper.extend(kept_dirs.iter().cloned());
    for layer in order_layers(layers) {
        match &layer {
            Layer::Fresh(p, size) => {
                tmpfs(
                    p,
                    MountFlags::NOSUID | MountFlags::NODEV,
                    &format!("size={size},mode=1777"),
                )?;
                let mut inner = writable_paths.clone();
                inner.extend(kept_dirs.iter().cloned());
                mkdir_p(p, &dirs_to_make(p, &inner))?;
                // A tool under a fresh directory (a runner in a clone under /var/tmp) gets its
                // mount point there, as under a hidden one.
                for (k, _) in sources.kept.iter().filter(|(k, _)| k.starts_with(p)) {
                    touch(k)?;
                }
                if Path::new(JOB_HOME).parent() == Some(p.as_path()) {
                    private_home(Path::new(JOB_HOME), &spec.user)?;
                }
                built.fresh.push((p.clone(), *size));
            }
            Layer::Hidden(p) => hide_path(p, &deeper, sources, built)?,
            Layer::Writable(p) => {
                if let Some((_, tree)) = sources.writable.iter().find(|(w, _)| w == p) {
                    attach(tree, p)?;
                    overlays.push(overlay(p, spec, overlays.len())?);
                    built.writable.push(p.clone());
                }
            }
            Layer::Kept(p) => {
                // Its mount point exists only where a covering layer made it.
                if let Some((_, tree)) = sources.kept.iter().find(|(k, _)| k == p && k.exists()) {
                    attach(tree, p)?;
                    bind_read_only(p)?;
                    built.read_only.push(p.clone());
                }
            }
        }
    }
    Ok(overlays)
}

/// Covers a hidden path: a directory by an empty read-only tmpfs holding the mount points of
/// what `deeper` puts under it (and the kept files), a file by a copy of `/dev/null`.
fn hide_path(
    p: &Path,
    deeper: &[PathBuf],
    sources: &mut Sources,
    built: &mut Built,
) -> Result<(), SandboxError> {
    // A layer made before may have covered it (a hidden path under /tmp): it is gone from the
    // view already.
    let Ok(meta) = std::fs::metadata(p) else {
        built.hidden.push(p.to_path_buf());
        return Ok(());
    };
    if meta.is_dir() {
        let inner = dirs_to_make(p, deeper);
        empty_read_only(p, "mode=755", || {
            mkdir_p(p, &inner)?;
            for (k, _) in sources.kept.iter().filter(|(k, _)| k.starts_with(p)) {
                touch(k)?;
            }
            Ok(())
        })?;
    } else {
        let Some(null) = sources.null_copies.pop() else {
            return Ok(());
        };
        attach(&null, p)?;
        if !sources.nodes_read_only {
            bind_read_only(p)?;
        }
    }
    built.hidden.push(p.to_path_buf());
    Ok(())
}

/// Covers directory `p` with a small tmpfs (`nosuid`, `nodev`, `noexec`; `mode` its root's
/// mode), lets `fill` make what must be inside (mount points, copies), then makes it
/// read-only.
fn empty_read_only(
    p: &Path,
    mode: &str,
    fill: impl FnOnce() -> Result<(), SandboxError>,
) -> Result<(), SandboxError> {
    let flags = MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC;
    tmpfs(p, flags, &format!("size=64k,{mode}"))?;
    fill()?;
    rustix::mount::mount_remount(p, flags | MountFlags::RDONLY, "")
        .map_err(step("make read-only", p))
}

/// Whether `p` is a relative path of plain names only (never `..`): what the plan's bus ids
/// and MIG instance ids make of a path under the driver's directory.
fn plain_relative(p: &Path) -> bool {
    p.components().next().is_some()
        && p.components()
            .all(|c| matches!(c, std::path::Component::Normal(_)))
}

/// Whether `name` is one plain path component (a bus id from the plan).
fn one_component(name: &str) -> bool {
    plain_relative(Path::new(name)) && Path::new(name).components().count() == 1
}

/// Masks the NVIDIA driver's `/proc` directory as [`DriverProc`] says (see the module's
/// documentation): what is shown is read and cloned before the cover goes on. Nothing is done
/// where the directory does not exist (no driver, or a step-3 layer hid it); a GPU or MIG
/// file that vanished meanwhile is left out.
fn mask_driver_proc(d: &DriverProc) -> Result<Option<DriverShown>, SandboxError> {
    let Some(dir) = real(&d.dir).filter(|p| p.is_dir()) else {
        return Ok(None);
    };
    let copies: Vec<(&str, String)> = DRIVER_FILES
        .iter()
        .filter_map(|name| {
            let text = std::fs::read_to_string(dir.join(name)).ok()?;
            Some(match *name {
                "params" => (*name, unmodifiable_params(&text)),
                _ => (*name, text),
            })
        })
        .collect();
    let mut gpus: Vec<(String, OwnedFd)> = Vec::new();
    for bus in d.gpus.iter().filter(|b| one_component(b)) {
        let source = dir.join("gpus").join(bus);
        if source.is_dir() {
            gpus.push((bus.clone(), clone_tree(&source)?));
        }
    }
    let mut caps: Vec<(PathBuf, OwnedFd)> = Vec::new();
    for cap in d.caps.iter().filter(|c| plain_relative(c)) {
        let source = dir.join(cap);
        if source.is_file() {
            caps.push((cap.clone(), clone_tree(&source)?));
        }
    }
    empty_read_only(&dir, "mode=555", || {
        for (name, text) in &copies {
            let p = dir.join(name);
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o444)
                .open(&p)
                .and_then(|mut f| std::io::Write::write_all(&mut f, text.as_bytes()))
                .map_err(io_step("copy the driver's file to", &p))?;
        }
        for (bus, _) in &gpus {
            mkdir_p(
                &dir,
                &[PathBuf::from("gpus"), PathBuf::from("gpus").join(bus)],
            )?;
        }
        for (cap, _) in &caps {
            let parents: Vec<PathBuf> = cap
                .ancestors()
                .skip(1)
                .filter(|a| !a.as_os_str().is_empty())
                .map(Path::to_path_buf)
                .collect();
            mkdir_p(&dir, &parents.into_iter().rev().collect::<Vec<_>>())?;
            touch(&dir.join(cap))?;
        }
        Ok(())
    })?;
    // Bound back read-only: the files are the driver's own (a GPU's `registry`, writable by
    // root without a capability, among them).
    let shown = gpus
        .iter()
        .map(|(bus, tree)| (dir.join("gpus").join(bus), tree))
        .chain(caps.iter().map(|(cap, tree)| (dir.join(cap), tree)));
    for (at, tree) in shown {
        attach(tree, &at)?;
        bind_read_only(&at)?;
    }
    let uvm = match real(&d.uvm_dir).filter(|p| p.is_dir()) {
        Some(u) => {
            empty_read_only(&u, "mode=555", || Ok(()))?;
            Some(u)
        }
        None => None,
    };
    Ok(Some(DriverShown {
        dir,
        files: copies.iter().map(|(n, _)| n.to_string()).collect(),
        gpus: gpus.into_iter().map(|(b, _)| b).collect(),
        caps: caps.into_iter().map(|(c, _)| c).collect(),
        uvm,
    }))
}

/// Binds [`PROC_READ_ONLY`]'s paths read-only onto themselves, where they exist.
fn proc_read_only(built: &mut Built) -> Result<(), SandboxError> {
    for p in PROC_READ_ONLY.iter().map(Path::new) {
        if std::fs::symlink_metadata(p).is_err() {
            continue;
        }
        rustix::mount::mount_bind(p, p).map_err(step("bind", p))?;
        bind_read_only(p)?;
        built.read_only.push(p.to_path_buf());
    }
    Ok(())
}

/// Covers [`MASKED`]'s paths that exist and [`needs_mask`] says the command could read: a
/// directory by an empty read-only tmpfs, a file by the private `/dev`'s `null` bound over it
/// (read-only as that `null` is, which a bind keeps; `nodes_read_only` false: made so here).
fn mask_kernel_paths(
    uid: u32,
    nodes_read_only: bool,
    built: &mut Built,
) -> Result<(), SandboxError> {
    use std::os::unix::fs::MetadataExt;
    for p in MASKED.iter().map(Path::new) {
        let Ok(meta) = std::fs::symlink_metadata(p) else {
            continue;
        };
        if !needs_mask(uid, meta.uid(), meta.mode()) {
            continue;
        }
        if meta.is_dir() {
            empty_read_only(p, "mode=555", || Ok(()))?;
        } else {
            // The host's node, which a root command could otherwise chmod through it.
            let null = Path::new("/dev/null");
            rustix::mount::mount_bind(null, p).map_err(step("cover with /dev/null", p))?;
            if !nodes_read_only {
                bind_read_only(p)?;
            }
        }
        built.hidden.push(p.to_path_buf());
    }
    Ok(())
}

/// Mounts the private `/dev` (step 5) and makes it read-only.
fn private_dev(
    spec: &SandboxSpec,
    sources: &Sources,
    built: &mut Built,
) -> Result<(), SandboxError> {
    let dev = Path::new("/dev");
    tmpfs(
        dev,
        MountFlags::NOSUID | MountFlags::NOEXEC,
        "size=1m,nr_inodes=4096,mode=755",
    )?;
    for (target, tree, is_dir) in &sources.nodes {
        let at = dev.join(target);
        if let Some(parent) = target.parent().filter(|p| !p.as_os_str().is_empty()) {
            mkdir_p(dev, &[parent.to_path_buf()])?;
        }
        if *is_dir {
            mkdir_p(dev, std::slice::from_ref(target))?;
        } else {
            touch(&at)?;
        }
        attach(tree, &at)?;
        if !sources.nodes_read_only {
            bind_read_only(&at)?;
        }
        built.devices.push(at);
    }
    dev_pts(dev, sources)?;
    let shm = dev.join("shm");
    mkdir_p(dev, &[PathBuf::from("shm")])?;
    tmpfs(
        &shm,
        MountFlags::NOSUID | MountFlags::NODEV,
        &format!("size={},mode=1777", spec.shm_size),
    )?;
    built.fresh.push((shm, spec.shm_size));
    if sources.mqueue {
        let mq = dev.join("mqueue");
        mkdir_p(dev, &[PathBuf::from("mqueue")])?;
        rustix::mount::mount(
            "mqueue",
            &mq,
            "mqueue",
            MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
            None,
        )
        .map_err(step("mount mqueue on", &mq))?;
    }
    for (name, to) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        rustix::fs::symlink(to, dev.join(name)).map_err(step("link", &dev.join(name)))?;
    }
    rustix::mount::mount_remount(
        dev,
        MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NOEXEC,
        "",
    )
    .map_err(step("make read-only", dev))
}

/// Mounts a new devpts instance on `/dev/pts` with its `ptmx` linked, or binds the host's where
/// the kernel has no instances.
fn dev_pts(dev: &Path, sources: &Sources) -> Result<(), SandboxError> {
    let pts = dev.join("pts");
    mkdir_p(dev, &[PathBuf::from("pts")])?;
    let new_pts = rustix::mount::mount(
        "devpts",
        &pts,
        "devpts",
        MountFlags::NOSUID | MountFlags::NOEXEC,
        c"newinstance,ptmxmode=0666,mode=0620",
    );
    match (new_pts, &sources.host_pts, &sources.host_ptmx) {
        (Ok(()), _, _) => {
            rustix::fs::symlink("pts/ptmx", dev.join("ptmx"))
                .map_err(step("link", &dev.join("ptmx")))?;
        }
        // A kernel without multiple devpts instances: the host's, as it is.
        (Err(_), Some(host_pts), Some(host_ptmx)) => {
            attach(host_pts, &pts)?;
            touch(&dev.join("ptmx"))?;
            attach(host_ptmx, &dev.join("ptmx"))?;
        }
        (Err(e), _, _) => return Err(step("mount a devpts instance on", &pts)(e)),
    }
    Ok(())
}

/// Puts an overlay over the checkout bound at `path`: the real checkout as its lower layer,
/// a fresh tmpfs of `tmp-size` bytes and [`disk::MAX_FILES`] files as its writable layer (see
/// [`disk`]). The tmpfs is mounted on a scratch directory of the private `/tmp`, root's and
/// `0700`: the job cannot reach the layers by any path. Layers are named by `/proc/self/fd`
/// so that no path needs escaping in the options.
fn overlay(path: &Path, spec: &SandboxSpec, n: usize) -> Result<Overlaid, SandboxError> {
    let size = spec.tmp_size;
    let dir = |p: &Path| {
        rustix::fs::open(
            p,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(step("open", p))
    };
    let real = rustix::fs::open(
        path,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(step("open", path))?;
    let owner = rustix::fs::fstat(&real).map_err(step("inspect", path))?;
    let scratch = PathBuf::from(format!("/tmp/.kernelkite-checkout-{n}"));
    match rustix::fs::mkdir(&scratch, Mode::from_raw_mode(0o700)) {
        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
        Err(e) => return Err(step("make the directory", &scratch)(e)),
    }
    tmpfs(
        &scratch,
        MountFlags::NOSUID | MountFlags::NODEV,
        &format!("size={size},nr_inodes={},mode=0700", disk::MAX_FILES),
    )?;
    let upper_path = scratch.join("upper");
    let work_path = scratch.join("work");
    // The merged checkout's root takes the upper directory's owner and mode: the checkout's.
    rustix::fs::mkdir(&upper_path, Mode::from_raw_mode(owner.st_mode & 0o7777))
        .map_err(step("make the directory", &upper_path))?;
    rustix::fs::chown(
        &upper_path,
        Some(rustix::process::Uid::from_raw(owner.st_uid)),
        Some(rustix::process::Gid::from_raw(owner.st_gid)),
    )
    .map_err(step("hand over", &upper_path))?;
    rustix::fs::mkdir(&work_path, Mode::from_raw_mode(0o700))
        .map_err(step("make the directory", &work_path))?;
    let upper = dir(&upper_path)?;
    let work = dir(&work_path)?;
    let options = format!(
        "lowerdir=/proc/self/fd/{},upperdir=/proc/self/fd/{},workdir=/proc/self/fd/{}",
        std::os::fd::AsRawFd::as_raw_fd(&real),
        std::os::fd::AsRawFd::as_raw_fd(&upper),
        std::os::fd::AsRawFd::as_raw_fd(&work),
    );
    let data = std::ffi::CString::new(options).map_err(|e| SandboxError::Step {
        what: "mount an overlay on",
        path: path.to_path_buf(),
        source: std::io::Error::other(e),
    })?;
    rustix::mount::mount(
        "kernelkite-checkout",
        path,
        "overlay",
        MountFlags::NOSUID | MountFlags::NODEV,
        data.as_c_str(),
    )
    .map_err(step(
        "mount an overlay (its writable layer bounded in memory) on",
        path,
    ))?;
    // The scratch mount stays where it is: its directory is root's and 0700, which the job
    // user cannot enter (unmounting it would wait for an RCU grace period, ~6 ms).
    Ok(Overlaid {
        mount_point: path.to_path_buf(),
        upper,
        real,
        carry: spec.artifacts.clone(),
        budget: size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kernel_file_only_root_reads_is_masked_for_a_root_command_only() {
        let job = 1_950_000_000;
        // /proc/kpageflags, /proc/timer_list: 0400 root.
        assert!(!needs_mask(job, 0, 0o100400));
        assert!(needs_mask(0, 0, 0o100400));
        // /proc/interrupts, /proc/keys: 0444.
        assert!(needs_mask(job, 0, 0o100444));
        assert!(needs_mask(job, 0, 0o100440), "a group may read it");
        assert!(needs_mask(job, 1000, 0o100400), "not root's");
        // A directory only root may enter (debugfs, 0700), and one anyone may (/proc/irq).
        assert!(!needs_mask(job, 0, 0o040700));
        assert!(needs_mask(0, 0, 0o040700));
        assert!(needs_mask(job, 0, 0o040555));
    }

    #[test]
    fn a_job_with_its_own_network_gets_resolvers_it_can_reach() {
        let stub = "# systemd-resolved\nnameserver 127.0.0.53\noptions edns0 trust-ad\nsearch .\n";
        let at = Path::new("/run/systemd/resolve/stub-resolv.conf");
        let upstream = Path::new(RESOLVED_UPSTREAM);
        assert!(only_loopback_resolvers(stub));
        assert_eq!(resolver_for_own_network(at, stub, Some(upstream)), upstream);
        assert_eq!(
            resolver_for_own_network(at, stub, None),
            at,
            "nothing better"
        );
        let lan = "nameserver 10.255.255.53\nnameserver 127.0.0.1\n";
        assert!(!only_loopback_resolvers(lan));
        assert_eq!(resolver_for_own_network(at, lan, Some(upstream)), at);
        assert!(!only_loopback_resolvers("# no servers\n"));
        assert!(only_loopback_resolvers("nameserver ::1\n"));
    }

    #[test]
    fn the_resolver_file_is_kept_only_under_run_and_with_the_network() {
        let stub = PathBuf::from("/run/systemd/resolve/stub-resolv.conf");
        assert_eq!(kept_resolver(Some(stub.clone()), true), Some(stub.clone()));
        assert_eq!(kept_resolver(Some(stub), false), None);
        assert_eq!(
            kept_resolver(Some(PathBuf::from("/etc/resolv.conf")), true),
            None
        );
        assert_eq!(kept_resolver(Some(PathBuf::from("/run")), true), None);
        assert_eq!(kept_resolver(Some(PathBuf::from("/runner/x")), true), None);
        assert_eq!(kept_resolver(None, true), None);
    }

    fn p(s: &str) -> PathBuf {
        PathBuf::from(s)
    }

    #[test]
    fn params_shown_to_a_job_let_nothing_make_device_nodes() {
        let params = "ResmanDebugLevel: 4294967295\nModifyDeviceFiles: 1\nDeviceFileMode: 438\n";
        assert_eq!(
            unmodifiable_params(params),
            "ResmanDebugLevel: 4294967295\nModifyDeviceFiles: 0\nDeviceFileMode: 438\n"
        );
        let already = "ModifyDeviceFiles: 0\nDeviceFileUID: 0\n";
        assert_eq!(unmodifiable_params(already), already);
        assert_eq!(unmodifiable_params(""), "");
        assert_eq!(
            unmodifiable_params("DeviceFileGID: 1\n"),
            "DeviceFileGID: 1\n"
        );
    }

    #[test]
    fn only_plain_names_are_taken_for_gpu_directories() {
        assert!(one_component("0000:18:00.0"));
        for bad in ["", "..", "a/b", "/gpus", "."] {
            assert!(!one_component(bad), "{bad:?}");
        }
        assert!(plain_relative(Path::new(
            "capabilities/gpu0/mig/gi3/ci0/access"
        )));
        for bad in ["capabilities/../../etc", "/etc", "", "./x"] {
            assert!(!plain_relative(Path::new(bad)), "{bad:?}");
        }
    }

    #[test]
    fn layers_go_shallowest_first_and_cover_before_binding_back() {
        let ordered = order_layers(vec![
            Layer::Writable(p("/builds/a/org/pipe")),
            Layer::Hidden(p("/builds/a/org/pipe/.sockets")),
            Layer::Hidden(p("/builds")),
            Layer::Fresh(p("/tmp"), 1),
            Layer::Hidden(p("/tmp/kk/run")),
            Layer::Hidden(p("/dev/shm/x")),
            Layer::Hidden(p("/builds")),
            Layer::Writable(p("/srv")),
            Layer::Hidden(p("/srv")),
        ]);
        let paths: Vec<&str> = ordered.iter().filter_map(|l| l.path().to_str()).collect();
        assert_eq!(
            paths,
            [
                "/builds",
                "/tmp",
                "/srv",
                "/srv",
                "/tmp/kk/run",
                "/builds/a/org/pipe",
                "/builds/a/org/pipe/.sockets"
            ]
        );
        // At one depth the covering layer goes first.
        assert!(matches!(ordered[2], Layer::Hidden(_)));
        assert!(matches!(ordered[3], Layer::Writable(_)));
    }

    #[test]
    fn the_path_to_a_writable_directory_is_made_inside_its_cover() {
        let w = vec![p("/builds/a/org/pipe"), p("/builds/a/other"), p("/srv/x")];
        assert_eq!(
            dirs_to_make(Path::new("/builds"), &w),
            [p("a"), p("a/org"), p("a/org/pipe"), p("a/other")]
        );
        assert!(dirs_to_make(Path::new("/tmp"), &w).is_empty());
        assert_eq!(
            dirs_to_make(Path::new("/builds/a/org/pipe"), &w),
            [] as [PathBuf; 0]
        );
    }
}
