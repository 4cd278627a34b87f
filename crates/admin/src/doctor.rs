//! `doctor`: checks a machine for everything isolation needs, one line per check.
//!
//! Every check reads from an injected root (sysfs/procfs) and asks an injected [`Host`] for
//! programs, so the logic is tested on fake trees; [`LiveHost`] is the real machine.

use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kernelkite_hooks::images::Fit;
pub use kernelkite_hooks::mountinfo::{parse_mountinfo, Mount};
use kernelkite_sys::nvidia;
use kernelkite_sys::nvml::DeviceInfo;
use kernelkite_topology::planner::{plan, PlanError, Policy};
use kernelkite_topology::topology::{Topology, Vendor};

/// Outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Status {
    /// Nothing to do.
    Ok,
    /// Works, but something is missing or degraded.
    Warn,
    /// Isolation cannot work until this is fixed.
    Fail,
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Fail => "fail",
        })
    }
}

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// What was checked (`cgroups`, `topology`, ...).
    pub name: &'static str,
    /// How it went.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// How to fix it, for warn and fail.
    pub fix: Option<String>,
}

impl Check {
    fn ok(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            name,
            status: Status::Ok,
            detail: detail.into(),
            fix: None,
        }
    }
    fn warn(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            name,
            status: Status::Warn,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
    fn fail(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            name,
            status: Status::Fail,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:<4}  {:<15} {}", self.status, self.name, self.detail)?;
        if let Some(fix) = &self.fix {
            write!(f, "\n      {:<15} fix: {fix}", "")?;
        }
        Ok(())
    }
}

/// What the checks ask of the machine besides files.
pub trait Host {
    /// Full path of a program on `PATH`.
    fn which(&self, program: &str) -> Option<PathBuf>;
    /// Runs a program; its stdout when it exits 0 within a few seconds.
    fn run(&self, program: &Path, args: &[&str]) -> Option<String>;
    /// The GPUs NVML reports (with their MIG devices), or why it cannot be loaded.
    fn nvml_devices(&self) -> Result<Vec<DeviceInfo>, String>;
}

/// The real machine.
pub struct LiveHost {
    /// The `PATH` programs are looked up on.
    pub path: Option<std::ffi::OsString>,
    /// How long one program may take.
    pub timeout: Duration,
}

impl Default for LiveHost {
    fn default() -> Self {
        LiveHost {
            path: std::env::var_os("PATH"),
            timeout: Duration::from_secs(5),
        }
    }
}

impl Host for LiveHost {
    fn which(&self, program: &str) -> Option<PathBuf> {
        which_in(self.path.as_deref()?, program)
    }

    fn run(&self, program: &Path, args: &[&str]) -> Option<String> {
        run_with_timeout(program, args, self.timeout)
    }

    fn nvml_devices(&self) -> Result<Vec<DeviceInfo>, String> {
        if !kernelkite_hooks::delegate::LOADS_NVML {
            let exe = std::env::current_exe().unwrap_or_default();
            let nvml_build =
                kernelkite_hooks::delegate::nvml_build(&std::collections::BTreeMap::new(), &exe);
            return Err(format!(
                "this is the static build of kernelkite-isolate, which cannot load NVML; hooks that need it run in {} ({}); run its `doctor` for the NVML check",
                nvml_build.display(),
                if nvml_build.is_file() { "present" } else { "missing: put the dynamically linked build there" }
            ));
        }
        let nvml = kernelkite_sys::nvml::Nvml::load().map_err(|e| e.to_string())?;
        nvml.devices().map_err(|e| e.to_string())
    }
}

/// Looks a program up in a `PATH`-style list, executables only.
pub fn which_in(path: &std::ffi::OsStr, program: &str) -> Option<PathBuf> {
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
    which::which_in(program, Some(path), cwd).ok()
}

/// A daemon that does not answer (`docker info` with a hung dockerd) must not hang `doctor`.
fn run_with_timeout(program: &Path, args: &[&str], timeout: Duration) -> Option<String> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let mut out = String::new();
                child.stdout.take()?.read_to_string(&mut out).ok()?;
                return status.success().then_some(out);
            }
            Ok(None) if start.elapsed() < timeout => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

/// What to check.
#[derive(Debug, Clone)]
pub struct DoctorOptions {
    /// sysfs/procfs root ("/" live): every file the checks read is under it.
    pub root: PathBuf,
    /// Check Docker and the NVIDIA container toolkit too.
    pub docker: bool,
}

/// Runs every check.
pub fn run_checks(opts: &DoctorOptions, host: &dyn Host) -> Vec<Check> {
    let mut checks = Vec::new();
    let mounts = std::fs::read_to_string(opts.root.join("proc/self/mountinfo")).unwrap_or_default();
    checks.push(check_cgroups(&opts.root, &mounts));
    checks.push(check_migrations(&opts.root, &mounts));
    let topo = Topology::discover(&opts.root);
    checks.push(check_topology(topo.as_ref().map_err(|e| e.to_string())));
    let gpus: Vec<Vendor> = topo
        .as_ref()
        .map(|t| t.gpus.iter().map(|g| g.vendor).collect())
        .unwrap_or_default();
    checks.extend(check_gpu_drivers(&opts.root, &gpus, host));
    if opts.docker {
        checks.extend(check_docker(&opts.root, &gpus, host));
    }
    checks.extend(check_runner_image(&gpus));
    checks.push(check_agent(host));
    checks.push(check_job_network(host));
    checks.push(check_plugin_binary(&opts.root));
    checks.push(check_sandbox(&opts.root));
    checks
}

/// A `major.minor` kernel release from `proc/sys/kernel/osrelease` text (`6.18.44-fc`).
fn kernel_version(osrelease: &str) -> Option<(u32, u32)> {
    let mut nums = osrelease
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse::<u32>().ok());
    Some((nums.next()?, nums.next()?))
}

/// What the host-mode sandbox needs from the kernel: overlayfs (the checkout's bounded layer),
/// seccomp filters that can answer with an errno, and Linux 5.12+ (`mount_setattr`: the host's
/// file systems read-only in the job's view; before it they stay writable where permissions
/// allow, and the job log does not list them as read-only).
pub fn check_sandbox(root: &Path) -> Check {
    const NAME: &str = "sandbox";
    let filesystems = std::fs::read_to_string(root.join("proc/filesystems")).unwrap_or_default();
    let has_fs = |fs: &str| {
        filesystems
            .lines()
            .any(|l| l.split_whitespace().last() == Some(fs))
    };
    let seccomp = std::fs::read_to_string(root.join("proc/sys/kernel/seccomp/actions_avail"))
        .unwrap_or_default();
    let release =
        std::fs::read_to_string(root.join("proc/sys/kernel/osrelease")).unwrap_or_default();
    let mut missing = Vec::new();
    if !has_fs("overlay") {
        missing.push("overlayfs (`modprobe overlay`): the job's checkout layer");
    }
    if !seccomp.split_whitespace().any(|a| a == "errno") {
        missing.push(
            "seccomp filters (a kernel with CONFIG_SECCOMP_FILTER): the job's system-call filter",
        );
    }
    if !missing.is_empty() {
        return Check::fail(
            NAME,
            format!(
                "the kernel lacks {}; host-mode jobs fail at `command`",
                missing.join(" and ")
            ),
            "load or build the kernel with what is missing, or run the pipelines in docker mode",
        );
    }
    match kernel_version(&release) {
        Some(v) if v >= (5, 12) => Check::ok(
            NAME,
            format!("Linux {}.{}: PID, mount, IPC and network namespaces, seccomp, overlayfs, the host's file systems read-only in a job's view", v.0, v.1),
        ),
        _ => Check::warn(
            NAME,
            format!("Linux {} has no mount_setattr: a job's view keeps the host's file systems writable where their permissions allow", release.trim()),
            "run Linux 5.12 or later",
        ),
    }
}

/// The binary the plugin's hook files name on their first line (a shebang cannot search):
/// without it every step that names the plugin fails at `environment`.
pub fn check_plugin_binary(root: &Path) -> Check {
    const NAME: &str = "plugin hooks";
    let bin = kernelkite_sys::node::plugin_hook_binary();
    let at = root.join(bin.trim_start_matches('/'));
    let executable = std::fs::metadata(&at).is_ok_and(|m| {
        m.is_file() && std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0
    });
    if executable {
        Check::ok(
            NAME,
            format!("{bin} is there for the plugin's hook files to run"),
        )
    } else {
        Check::warn(
            NAME,
            format!("{bin} is missing: steps that name the plugin fail at `environment` (its hook files run that path)"),
            "install the binaries with `kernelkite-isolate setup` (with another --prefix it links that path)",
        )
    }
}

const NEEDED: [&str; 3] = ["cpuset", "memory", "pids"];

/// Where the hooks create job cgroups under a hierarchy (see `cgroup::PARENT`).
const JOB_PARENT: &str = "kernelkite";

/// Whether a job's command starts without waiting for an RCU grace period: on cgroup v2 it is
/// born in its cgroup (`clone3`); on v1 it is migrated, which is quick only when the kernel
/// favours dynamic cgroup changes (`favordynmods`, seen in any cgroup mount's options).
pub fn check_migrations(root: &Path, mountinfo: &str) -> Check {
    const NAME: &str = "migrations";
    let mounts = parse_mountinfo(mountinfo);
    let v2_usable = mounts.iter().filter(|m| m.fs_type == "cgroup2").any(|m| {
        let controllers =
            std::fs::read_to_string(under_root(root, &m.mount_point).join("cgroup.controllers"))
                .unwrap_or_default();
        NEEDED
            .iter()
            .all(|c| controllers.split_whitespace().any(|h| h == *c))
    });
    if v2_usable {
        return Check::ok(
            NAME,
            "cgroup v2: the command is born in its cgroup (clone3), nothing to migrate",
        );
    }
    let favoured = mounts.iter().find(|m| {
        (m.fs_type == "cgroup" || m.fs_type == "cgroup2")
            && m.super_options.iter().any(|o| o == "favordynmods")
    });
    match favoured {
        Some(m) => Check::ok(
            NAME,
            format!(
                "favordynmods is on ({}): moving the command into its v1 cgroups does not wait for an RCU grace period",
                m.mount_point
            ),
        ),
        None => Check::warn(
            NAME,
            "cgroup v1 without favordynmods: every job's command waits for an RCU grace period (10-31 ms) as it joins its cgroups",
            format!("at node set-up, `mkdir -p {dir} && mount -t cgroup -o none,name=kernelkite,favordynmods cgroup {dir}` (what `setup` does; Linux 6.0+; it stays on until reboot), or boot with cgroup_favordynmods=true; see the plugin README", dir = crate::setup::paths::FAVORDYNMODS_DIR),
        ),
    }
}

/// Whether this user may create job cgroups under `dir`: its `kernelkite/` subtree when it
/// exists (it may have been delegated to the agent's user), else `dir` itself. `access(2)`
/// honours read-only mounts and permissions; root passes unless the mount is read-only.
pub fn cgroup_writable(dir: &Path) -> bool {
    let parent = dir.join(JOB_PARENT);
    let target = if parent.is_dir() {
        parent
    } else {
        dir.to_path_buf()
    };
    rustix::fs::access(&target, rustix::fs::Access::WRITE_OK).is_ok()
}

const DELEGATE_FIX: &str = "run the agent as root, or delegate the hierarchy's kernelkite/ subtree to the agent's user (systemd `Delegate=yes`, or `mkdir kernelkite && chown -R buildkite-agent kernelkite`)";

fn under_root(root: &Path, mount_point: &str) -> PathBuf {
    root.join(mount_point.trim_start_matches('/'))
}

/// The needed v1 controllers: those mounted and usable (`found`), and what is wrong with the
/// others (`problems`), each a phrase.
fn v1_controllers(root: &Path, mounts: &[Mount]) -> (Vec<String>, Vec<String>) {
    let mut found = Vec::new();
    let mut problems = Vec::new();
    for c in NEEDED {
        match mounts
            .iter()
            .find(|m| m.fs_type == "cgroup" && m.super_options.iter().any(|o| o == c))
        {
            Some(m) if m.read_only => {
                problems.push(format!("{c} at {} is read-only", m.mount_point))
            }
            Some(m) if !under_root(root, &m.mount_point).is_dir() => {
                problems.push(format!("{c} mount point {} is missing", m.mount_point))
            }
            Some(m) if !cgroup_writable(&under_root(root, &m.mount_point)) => problems.push(
                format!("{c} at {} is not writable by this user", m.mount_point),
            ),
            Some(m) => found.push(format!("{c} at {}", m.mount_point)),
            None => problems.push(format!("{c} is not mounted")),
        }
    }
    (found, problems)
}

/// cgroup v2 with cpuset, memory and pids available and writable, else v1 with each mounted rw.
pub fn check_cgroups(root: &Path, mountinfo: &str) -> Check {
    const NAME: &str = "cgroups";
    let mounts = parse_mountinfo(mountinfo);
    if mounts.is_empty() {
        return Check::fail(
            NAME,
            "cannot read /proc/self/mountinfo",
            "run doctor on the node itself, with /proc mounted",
        );
    }
    let mut v2_note = String::new();
    if let Some(m) = mounts.iter().find(|m| m.fs_type == "cgroup2") {
        let dir = under_root(root, &m.mount_point);
        let controllers =
            std::fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
        let have: Vec<&str> = controllers.split_whitespace().collect();
        let missing: Vec<&str> = NEEDED
            .iter()
            .copied()
            .filter(|c| !have.contains(c))
            .collect();
        if missing.is_empty() {
            if m.read_only {
                return Check::fail(
                    NAME,
                    format!("cgroup v2 at {} is mounted read-only", m.mount_point),
                    "run the agent on the host or in a container with a writable cgroup namespace (docker --cgroupns=private, or mount cgroup2 rw)",
                );
            }
            return Check::ok(
                NAME,
                format!("cgroup v2 at {} with cpuset, memory, pids", m.mount_point),
            );
        }
        v2_note = format!(
            "; cgroup2 at {} lacks {} (they are bound to v1)",
            m.mount_point,
            missing.join(", ")
        );
    }
    let (found, problems) = v1_controllers(root, &mounts);
    if problems.is_empty() {
        return Check::ok(NAME, format!("cgroup v1: {}{v2_note}", found.join(", ")));
    }
    if found.is_empty() && v2_note.is_empty() {
        return Check::fail(
            NAME,
            "no cgroup filesystem with cpuset, memory and pids",
            "boot with systemd.unified_cgroup_hierarchy=1 (cgroup v2), or mount the cpuset, memory and pids v1 controllers",
        );
    }
    if problems
        .iter()
        .all(|p| p.ends_with("not writable by this user"))
    {
        return Check::fail(
            NAME,
            format!("cgroup v1: {}", problems.join(", ")),
            DELEGATE_FIX,
        );
    }
    Check::fail(
        NAME,
        format!("cgroup v1: {}{v2_note}", problems.join(", ")),
        "mount the missing controllers read-write (`mount -t cgroup -o cpuset cgroup /sys/fs/cgroup/cpuset`), or switch to cgroup v2 with systemd.unified_cgroup_hierarchy=1",
    )
}

/// Topology readable and a default plan possible.
pub fn check_topology(topo: Result<&Topology, String>) -> Check {
    const NAME: &str = "topology";
    let topo = match topo {
        Ok(t) => t,
        Err(e) => {
            return Check::fail(
                NAME,
                e,
                "run doctor on the node, with /sys and /proc mounted",
            )
        }
    };
    let summary = format!(
        "{} package(s), {} NUMA node(s), {} core(s), {} online CPU(s), {} GPU(s)",
        topo.packages().len(),
        topo.numa_nodes.len(),
        topo.physical_cores().len(),
        topo.online_cpus().len(),
        topo.gpus.len()
    );
    match plan(topo, &Policy::default()) {
        Ok(p) => Check::ok(NAME, format!("{summary}; default plan: {} slice(s)", p.slices.len())),
        Err(PlanError::NoGpus) => Check::warn(
            NAME,
            format!("{summary}; no GPU, so only CPU-only slices can be planned"),
            "plan with `kernelkite-isolate plan --cpu-only-slices N`, or check the GPUs are seated and visible in `lspci`",
        ),
        Err(e) => Check::fail(NAME, format!("{summary}; {e}"), "adjust the policy flags of `kernelkite-isolate plan`"),
    }
}

/// NVIDIA driver and NVML for NVIDIA GPUs, amdgpu and ROCm for AMD ones.
pub fn check_gpu_drivers(root: &Path, gpus: &[Vendor], host: &dyn Host) -> Vec<Check> {
    let nvidia = gpus.iter().filter(|v| **v == Vendor::Nvidia).count();
    let amd = gpus.iter().filter(|v| **v == Vendor::Amd).count();
    let mut out = Vec::new();
    if nvidia == 0 && amd == 0 {
        let driver = std::fs::read_to_string(root.join("proc/driver/nvidia/version")).ok();
        let detail = match driver {
            Some(v) => format!(
                "no GPU on the PCI bus, though an NVIDIA driver is loaded ({})",
                v.lines().next().unwrap_or("").trim()
            ),
            None => "no GPU on the PCI bus, no NVIDIA driver, no ROCm".to_string(),
        };
        out.push(Check::warn(
            "gpu driver",
            detail,
            "on a GPU node install the NVIDIA driver (with NVML) or ROCm; a CPU-only node needs nothing",
        ));
        return out;
    }
    if nvidia > 0 {
        let version = std::fs::read_to_string(root.join("proc/driver/nvidia/version")).ok();
        match (version, host.nvml_devices()) {
            (Some(v), Ok(devices)) => {
                out.push(Check::ok(
                    "nvidia driver",
                    format!(
                        "{}; NVML sees {} of {nvidia} GPU(s)",
                        v.lines().next().unwrap_or("").trim(),
                        devices.len()
                    ),
                ));
                out.extend(check_mig(root, &devices));
            }
            (Some(v), Err(e)) => out.push(Check::warn(
                "nvidia driver",
                format!("{} but NVML failed: {e}", v.lines().next().unwrap_or("").trim()),
                "install the driver's libnvidia-ml.so.1 (package libnvidia-ml or nvidia-utils) so UUIDs can be read",
            )),
            (None, _) => out.push(Check::fail(
                "nvidia driver",
                format!("{nvidia} NVIDIA GPU(s) on the PCI bus but no driver loaded (/proc/driver/nvidia/version missing)"),
                "install the NVIDIA driver (e.g. `apt install nvidia-driver-550-server`) and reboot",
            )),
        }
        if root.join("proc/driver/nvidia/version").exists() {
            out.push(check_nvidia_uvm(root));
        }
    }
    if amd > 0 {
        let kfd = root.join("dev/kfd").exists();
        let amdgpu = root.join("sys/module/amdgpu").exists();
        let rocm = host.which("rocm-smi").or_else(|| host.which("amd-smi"));
        match (kfd && amdgpu, rocm) {
            (true, Some(tool)) => out.push(Check::ok(
                "rocm",
                format!("amdgpu loaded, /dev/kfd present, {}", tool.display()),
            )),
            (true, None) => out.push(Check::warn(
                "rocm",
                "amdgpu loaded and /dev/kfd present, but neither rocm-smi nor amd-smi is on PATH",
                "install ROCm (`apt install rocm`) so jobs and doctor can query the GPUs",
            )),
            (false, _) => out.push(Check::fail(
                "rocm",
                format!("{amd} AMD GPU(s) on the PCI bus but the amdgpu driver is not loaded (/dev/kfd or /sys/module/amdgpu missing)"),
                "install amdgpu-dkms and ROCm (https://rocm.docs.amd.com), then `modprobe amdgpu`",
            )),
        }
    }
    out
}

/// `/dev/nvidia-uvm` and `/dev/nvidia-uvm-tools`: CUDA needs the first (the profilers the
/// second), the sandbox binds only nodes that exist, and a job cannot make them. The kernel
/// module makes no node (it only registers its major); CUDA makes them by running the setuid
/// `nvidia-modprobe`, which a sandboxed job runs without privileges (`no_new_privs`) in a
/// read-only `/dev`. So they must exist on the host before a job starts.
pub fn check_nvidia_uvm(root: &Path) -> Check {
    const NAME: &str = "nvidia-uvm";
    const FIX: &str = "run `sudo nvidia-modprobe -u -c=0` (loads nvidia-uvm and makes /dev/nvidia-uvm and /dev/nvidia-uvm-tools), and make it run at every boot (a oneshot unit before kernelkite-agent@.service, or your distribution's udev rule)";
    let Some(major) = nvidia::char_major(root, nvidia::UVM_DEVICES_NAME) else {
        return Check::fail(
            NAME,
            "the nvidia-uvm module is not loaded (no nvidia-uvm in /proc/devices): CUDA cannot start without it, and a job cannot load it (its sandbox sets no_new_privs, so CUDA's setuid nvidia-modprobe runs without privileges)",
            FIX,
        );
    };
    let exists = |n: &str| std::fs::symlink_metadata(root.join("dev").join(n)).is_ok();
    if !exists("nvidia-uvm") {
        return Check::fail(
            NAME,
            format!("/dev/nvidia-uvm is missing (nvidia-uvm is loaded, major {major}): the sandbox binds only nodes that exist, and CUDA cannot make it inside a job (no_new_privs stops the setuid nvidia-modprobe)"),
            FIX,
        );
    }
    if !exists("nvidia-uvm-tools") {
        return Check::warn(
            NAME,
            format!("/dev/nvidia-uvm exists (major {major}) but /dev/nvidia-uvm-tools is missing: CUDA runs, profilers (Nsight, CUPTI) cannot"),
            FIX,
        );
    }
    Check::ok(
        NAME,
        format!("/dev/nvidia-uvm and /dev/nvidia-uvm-tools exist (major {major})"),
    )
}

/// The MIG layout, when a GPU is in MIG mode: its MIG devices (one slice each), and whether
/// the driver lists the capability nodes each needs in a job's private `/dev`.
pub fn check_mig(root: &Path, devices: &[DeviceInfo]) -> Option<Check> {
    let mig: Vec<&DeviceInfo> = devices
        .iter()
        .filter(|d| d.mig_enabled || !d.mig.is_empty())
        .collect();
    if mig.is_empty() {
        return None;
    }
    // MIG on, nothing made yet (just enabled, or after a reboot): CUDA cannot use the GPU,
    // and the plan leaves it out.
    let empty: Vec<String> = mig
        .iter()
        .filter(|d| d.mig.is_empty())
        .map(|d| kernelkite_topology::topology::canonical_bus_id(&d.pci_bus_id))
        .collect();
    if !empty.is_empty() {
        return Some(Check::fail(
            "mig",
            format!(
                "GPU(s) {} in MIG mode with no MIG device: CUDA cannot use them, and the plan leaves them out",
                empty.join(", ")
            ),
            "create MIG devices (`sudo nvidia-smi mig -i <bus id> -lgip` lists the profiles, `sudo nvidia-smi mig -i <bus id> -cgi <profiles> -C` makes them) or turn MIG off (`sudo nvidia-smi -i <bus id> -mig 0`, then reset the GPU or reboot), then run `sudo kernelkite-isolate setup` again",
        ));
    }
    if nvidia::caps_in_procfs(root) {
        return Some(Check::fail(
            "mig",
            format!(
                "{} GPU(s) in MIG mode, but the driver hands MIG capabilities out through /proc/driver/nvidia/capabilities (nv_cap_enable_devfs=0), which file permissions alone guard and every job's /proc shows: a job could open any MIG device",
                mig.len()
            ),
            "load the nvidia module with nv_cap_enable_devfs=1 (`options nvidia nv_cap_enable_devfs=1` in /etc/modprobe.d, then reload the driver or reboot)",
        ));
    }
    let mut layout = Vec::new();
    let mut unlisted = Vec::new();
    let mut no_node = Vec::new();
    // nvidia-modprobe's arguments for the missing nodes, and the nodes it may not make.
    let mut make_nodes: Vec<String> = Vec::new();
    let mut by_hand: Vec<u32> = Vec::new();
    for d in &mig {
        let bus = kernelkite_topology::topology::canonical_bus_id(&d.pci_bus_id);
        let minor = d.minor.or_else(|| nvidia::device_minor(root, &bus));
        let each: Vec<String> = d
            .mig
            .iter()
            .map(|m| {
                let caps = minor.and_then(|g| {
                    nvidia::mig_cap_minors(root, g, m.gpu_instance_id, m.compute_instance_id)
                });
                match (caps, minor) {
                    (Some(caps), Some(g)) => {
                        let missing: Vec<(u32, PathBuf)> = caps
                            .into_iter()
                            .zip(nvidia::mig_cap_proc_files(
                                g,
                                m.gpu_instance_id,
                                m.compute_instance_id,
                            ))
                            .filter(|(c, _)| !root.join("dev").join(nvidia::cap_node(*c)).exists())
                            .collect();
                        no_node.extend(
                            missing
                                .iter()
                                .map(|(c, _)| format!("/dev/{}", nvidia::cap_node(*c).display())),
                        );
                        for (cap, proc_file) in missing {
                            make_nodes.push(format!("-f {}", proc_file.display()));
                            if nvidia::cap_file_modify(root, &proc_file) == Some(false) {
                                by_hand.push(cap);
                            }
                        }
                    }
                    _ => unlisted.push(m.uuid.clone()),
                }
                format!(
                    "{} ({}GPU instance {}, compute instance {}, {})",
                    m.uuid,
                    m.name
                        .as_deref()
                        .and_then(|n| n.rsplit(' ').next())
                        .map_or(String::new(), |p| format!("{p}, ")),
                    m.gpu_instance_id,
                    m.compute_instance_id,
                    kernelkite_topology::planner::format_bytes(m.memory_bytes)
                )
            })
            .collect();
        layout.push(format!(
            "GPU {bus}: {} MIG device(s): {}",
            d.mig.len(),
            each.join(", ")
        ));
    }
    let text = format!("{}; one slice per MIG device", layout.join("; "));
    Some(if !unlisted.is_empty() {
        Check::fail(
            "mig",
            format!(
                "{text}; but /proc/driver/nvidia-caps/mig-minors lists no capability for {}, so a job could not open it",
                unlisted.join(", ")
            ),
            "check the driver loaded its nvidia-caps support (`grep nvidia-caps /proc/devices`), then recreate the MIG instances (nvidia-smi mig -dci; nvidia-smi mig -dgi; nvidia-smi mig -cgi <profiles> -C)",
        )
    } else if !no_node.is_empty() {
        Check::fail(
            "mig",
            format!(
                "{text}; but {} do not exist, so a job's /dev could not hold them",
                no_node.join(", ")
            ),
            mig_node_hint(&make_nodes, &by_hand, nvidia::caps_major(root)),
        )
    } else {
        Check::ok("mig", text)
    })
}

/// What makes missing MIG capability nodes: `nvidia-modprobe -f` with each capability's proc
/// file (it reads the minor there and makes `/dev/nvidia-caps/nvidia-cap<N>`); the kernel
/// module never makes them, and a job cannot run it. Where the module was loaded with
/// `NVreg_ModifyDeviceFiles=0` (`DeviceFileModify: 0` in those files) nvidia-modprobe makes
/// nothing, so those are made by hand.
fn mig_node_hint(make_nodes: &[String], by_hand: &[u32], caps_major: Option<u32>) -> String {
    let mut hint = format!(
        "create them with `sudo nvidia-modprobe {}` (nvidia-modprobe makes /dev/nvidia-caps nodes from the driver's /proc files; the kernel module never does, and a job cannot run it); run it again whenever the MIG devices are made (at boot, after `nvidia-smi mig`)",
        make_nodes.join(" ")
    );
    if !by_hand.is_empty() {
        let major = caps_major.map_or("<nvidia-caps major>".to_string(), |m| m.to_string());
        let mknod: Vec<String> =
            std::iter::once("sudo mkdir -p /dev/nvidia-caps".to_string())
                .chain(by_hand.iter().map(|n| {
                    format!("sudo mknod -m 444 /dev/nvidia-caps/nvidia-cap{n} c {major} {n}")
                }))
                .collect();
        hint.push_str(&format!(
            "; the nvidia module was loaded with NVreg_ModifyDeviceFiles=0, which forbids nvidia-modprobe to make them: `{}`, or load it with NVreg_ModifyDeviceFiles=1",
            mknod.join("; ")
        ));
    }
    hint
}

/// Docker daemon reachable, and for NVIDIA GPUs the NVIDIA container toolkit.
pub fn check_docker(root: &Path, gpus: &[Vendor], host: &dyn Host) -> Vec<Check> {
    let mut out = Vec::new();
    let Some(docker) = host.which("docker") else {
        out.push(Check::fail(
            "docker",
            "docker is not on PATH",
            "install Docker Engine (https://docs.docker.com/engine/install/) or use the plugin's process mode",
        ));
        return out;
    };
    match host.run(&docker, &["version", "--format", "{{.Server.Version}}"]) {
        Some(v) if !v.trim().is_empty() => {
            out.push(Check::ok("docker", format!("server {}", v.trim())))
        }
        _ => out.push(Check::fail(
            "docker",
            format!("{} cannot reach the daemon", docker.display()),
            "start dockerd (`systemctl start docker`) and add the agent's user to the docker group",
        )),
    }
    if gpus.contains(&Vendor::Nvidia) {
        let cdi = [
            "etc/cdi/nvidia.yaml",
            "var/run/cdi/nvidia.yaml",
            "etc/cdi/nvidia.json",
        ]
        .iter()
        .any(|p| root.join(p).exists());
        let tool = host
            .which("nvidia-ctk")
            .or_else(|| host.which("nvidia-container-runtime-hook"))
            .or_else(|| host.which("nvidia-container-runtime"));
        match tool {
            Some(t) => out.push(Check::ok(
                "nvidia toolkit",
                format!("{}{}", t.display(), if cdi { ", CDI spec present" } else { "" }),
            )),
            None => out.push(Check::fail(
                "nvidia toolkit",
                "the NVIDIA container toolkit is not installed: `docker run --gpus` cannot pass a single GPU",
                "install nvidia-container-toolkit and run `nvidia-ctk runtime configure --runtime=docker && systemctl restart docker`",
            )),
        }
    }
    out
}

/// Which runner image fits the node's GPUs (`kernelkite_hooks::images`): the one image of their vendor,
/// a warning when the node has both vendors' GPUs (each slice then needs its own), and no line
/// for a node without GPUs, which neither image serves.
pub fn check_runner_image(gpus: &[Vendor]) -> Option<Check> {
    const NAME: &str = "runner image";
    match kernelkite_hooks::images::for_gpus(gpus) {
        Fit::NoGpu => None,
        Fit::One(image) => Some(Check::ok(
            NAME,
            format!(
                "{} ({} GPUs; host mode's venv: {})",
                image.reference, image.vendor_name, image.requirements
            ),
        )),
        Fit::Mixed(images) => Some(Check::warn(
            NAME,
            format!(
                "the node has GPUs of several vendors, and each slice's jobs need their vendor's image: {}",
                images
                    .iter()
                    .map(|i| format!("{} ({} GPUs)", i.reference, i.vendor_name))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            "pull (or build) every one of them and run docker-mode steps with `image: auto`, which picks each job's by its slice; in host mode the node's one venv serves only one vendor's GPUs",
        )),
    }
}

/// `buildkite-agent version 3.108.0, build 11100` → (3, 108, 0).
pub fn parse_agent_version(s: &str) -> Option<(u32, u32, u32)> {
    let word = s
        .split_whitespace()
        .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()))?;
    let word = word.trim_end_matches(',');
    let mut it = word.split(['.', '-', '+']).map(|p| p.parse::<u32>().ok());
    Some((
        it.next()??,
        it.next().flatten().unwrap_or(0),
        it.next().flatten().unwrap_or(0),
    ))
}

/// `buildkite-agent` installed and at least 3.108 (plugins in a repository subdirectory).
pub fn check_agent(host: &dyn Host) -> Check {
    const NAME: &str = "buildkite-agent";
    let Some(agent) = host.which("buildkite-agent") else {
        return Check::fail(
            NAME,
            "buildkite-agent is not on PATH",
            "install buildkite-agent 3.108 or later (https://buildkite.com/docs/agent/v3/installation)",
        );
    };
    let Some(out) = host.run(&agent, &["--version"]) else {
        return Check::fail(
            NAME,
            format!("{} --version failed", agent.display()),
            "reinstall buildkite-agent 3.108 or later",
        );
    };
    match parse_agent_version(&out) {
        Some(v) if v >= (3, 108, 0) => Check::ok(NAME, format!("version {}.{}.{}", v.0, v.1, v.2)),
        Some(v) => Check::warn(
            NAME,
            format!("version {}.{}.{} is older than 3.108: it cannot load a plugin from a repository subdirectory", v.0, v.1, v.2),
            "upgrade buildkite-agent to 3.108 or later, or vendor the plugin into each pipeline repository",
        ),
        None => Check::warn(
            NAME,
            format!("cannot read a version from {:?}", out.trim()),
            "check `buildkite-agent --version` by hand; 3.108 or later is needed",
        ),
    }
}

/// What a step with `network: true` needs (`kernelkite_hooks::uplink`): `ip`, `unshare`,
/// `nsenter` and `nft` to make its own network namespace and its link out. Missing, such steps
/// fail (saying what to install) and the rest run: a warning.
pub fn check_job_network(host: &dyn Host) -> Check {
    const NAME: &str = "job network";
    let missing: Vec<&str> = ["ip", "unshare", "nsenter", "nft"]
        .into_iter()
        .filter(|p| host.which(p).is_none())
        .collect();
    if missing.is_empty() {
        Check::ok(
            NAME,
            "steps with `network: true` get a network namespace of their own, routed out through the node (ip, unshare, nsenter, nft)",
        )
    } else {
        Check::warn(
            NAME,
            format!(
                "{} not on PATH: steps with `network: true` would fail",
                missing.join(", ")
            ),
            "install iproute2, util-linux and nftables (only steps with `network: true` need them)",
        )
    }
}

/// Exit status for a report: 1 when any check failed, 0 otherwise (warnings do not fail).
pub fn exit_code(checks: &[Check]) -> u8 {
    u8::from(checks.iter().any(|c| c.status == Status::Fail))
}

#[cfg(test)]
mod sandbox_check_tests {
    use super::*;

    fn root(filesystems: &str, seccomp: Option<&str>, release: &str) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("proc/sys/kernel/seccomp")).unwrap();
        std::fs::write(d.path().join("proc/filesystems"), filesystems).unwrap();
        if let Some(s) = seccomp {
            std::fs::write(d.path().join("proc/sys/kernel/seccomp/actions_avail"), s).unwrap();
        }
        std::fs::write(d.path().join("proc/sys/kernel/osrelease"), release).unwrap();
        d
    }

    #[test]
    fn the_sandbox_check_names_what_the_kernel_lacks() {
        let fs = "nodev\ttmpfs\nnodev\tproc\nnodev\toverlay\n";
        let acts = "kill_process kill_thread trap errno user_notif trace log allow\n";
        let ok = check_sandbox(root(fs, Some(acts), "6.18.44-fc\n").path());
        assert_eq!(ok.status, Status::Ok, "{ok}");
        let old = check_sandbox(root(fs, Some(acts), "5.10.0\n").path());
        assert_eq!(old.status, Status::Warn, "{old}");
        let no_overlay = check_sandbox(root("nodev\ttmpfs\n", Some(acts), "6.1\n").path());
        assert_eq!(no_overlay.status, Status::Fail);
        assert!(no_overlay.to_string().contains("overlay"), "{no_overlay}");
        let no_seccomp = check_sandbox(root(fs, None, "6.1\n").path());
        assert!(no_seccomp.to_string().contains("seccomp"), "{no_seccomp}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelkite_topology::fakesys;
    use std::collections::BTreeMap;

    /// Programs on a pretend PATH, each with the stdout it answers (None = it fails).
    #[derive(Default)]
    struct FakeHost {
        programs: BTreeMap<&'static str, Option<String>>,
        nvml: Option<Vec<DeviceInfo>>,
    }

    impl FakeHost {
        fn with(mut self, program: &'static str, out: Option<&str>) -> Self {
            self.programs.insert(program, out.map(str::to_string));
            self
        }
    }

    impl Host for FakeHost {
        fn which(&self, program: &str) -> Option<PathBuf> {
            self.programs
                .contains_key(program)
                .then(|| PathBuf::from(format!("/usr/bin/{program}")))
        }
        fn run(&self, program: &Path, _args: &[&str]) -> Option<String> {
            let name = program.file_name()?.to_str()?;
            self.programs.get(name).cloned().flatten()
        }
        fn nvml_devices(&self) -> Result<Vec<DeviceInfo>, String> {
            self.nvml
                .clone()
                .ok_or_else(|| "cannot load libnvidia-ml.so.1".to_string())
        }
    }

    #[test]
    fn the_job_network_check_names_the_missing_tools() {
        let all = FakeHost::default()
            .with("ip", Some(""))
            .with("unshare", Some(""))
            .with("nsenter", Some(""))
            .with("nft", Some(""));
        assert_eq!(check_job_network(&all).status, Status::Ok);
        let no_nft = FakeHost::default()
            .with("ip", Some(""))
            .with("unshare", Some(""))
            .with("nsenter", Some(""));
        let c = check_job_network(&no_nft);
        assert_eq!(c.status, Status::Warn, "{c}");
        assert!(c.to_string().contains("nft not on PATH"), "{c}");
        assert!(c.to_string().contains("nftables"), "{c}");
    }

    #[test]
    fn a_gpu_in_mig_mode_without_mig_devices_fails_the_mig_check() {
        let root = tempfile::tempdir().unwrap();
        let gpu = |bus: &str, on: bool| DeviceInfo {
            pci_bus_id: bus.into(),
            uuid: None,
            minor: Some(0),
            name: None,
            mig: vec![],
            mig_enabled: on,
            nvlink_peers: vec![],
        };
        assert!(check_mig(root.path(), &[gpu("00000000:18:00.0", false)]).is_none());
        let c = check_mig(
            root.path(),
            &[
                gpu("00000000:18:00.0", false),
                gpu("00000000:2A:00.0", true),
            ],
        )
        .expect("a check");
        let text = format!("{c:?}");
        assert_eq!(c.status, Status::Fail, "{text}");
        assert!(
            text.contains("0000:2a:00.0")
                && text.contains("no MIG device")
                && text.contains("nvidia-smi mig"),
            "{text}"
        );
    }

    fn healthy() -> FakeHost {
        FakeHost {
            nvml: Some(
                (0..8)
                    .map(|i| DeviceInfo {
                        pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + i),
                        uuid: None,
                        minor: Some(i),
                        name: None,
                        mig: vec![],
                        mig_enabled: false,
                        nvlink_peers: vec![],
                    })
                    .collect(),
            ),
            ..FakeHost::default()
        }
        .with(
            "buildkite-agent",
            Some("buildkite-agent version 3.110.0, build 11500"),
        )
        .with("docker", Some("27.3.1"))
        .with("nvidia-ctk", Some(""))
        .with("ip", Some(""))
        .with("unshare", Some(""))
        .with("nsenter", Some(""))
        .with("nft", Some(""))
    }

    const V1: &str = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n\
        34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n\
        35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n\
        39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids\n\
        41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";

    fn v1_tree() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for d in ["cpuset", "memory", "pids", "unified"] {
            std::fs::create_dir_all(dir.path().join("sys/fs/cgroup").join(d)).unwrap();
        }
        std::fs::write(
            dir.path().join("sys/fs/cgroup/unified/cgroup.controllers"),
            "hugetlb\n",
        )
        .unwrap();
        dir
    }

    #[test]
    fn cgroup_v2_with_controllers_is_ok_and_read_only_fails() {
        let dir = tempfile::tempdir().unwrap();
        fakesys::cpu_only().write_to(dir.path()).unwrap();
        let mounts = std::fs::read_to_string(dir.path().join("proc/self/mountinfo")).unwrap();
        let c = check_cgroups(dir.path(), &mounts);
        assert_eq!(c.status, Status::Ok, "{c}");
        assert!(c.detail.contains("cgroup v2"));
        let ro = mounts.replace("/sys/fs/cgroup rw,", "/sys/fs/cgroup ro,");
        let c = check_cgroups(dir.path(), &ro);
        assert_eq!(c.status, Status::Fail, "{c}");
        assert!(c.fix.unwrap().contains("cgroupns"));
    }

    #[test]
    fn hybrid_hierarchy_falls_back_to_v1() {
        let dir = v1_tree();
        let c = check_cgroups(dir.path(), V1);
        assert_eq!(c.status, Status::Ok, "{c}");
        assert!(
            c.detail.contains("cgroup v1") && c.detail.contains("lacks cpuset, memory, pids"),
            "{c}"
        );
    }

    #[test]
    fn v1_missing_or_read_only_controllers_fail_by_name() {
        let dir = v1_tree();
        let no_pids: String = V1
            .lines()
            .filter(|l| !l.contains("pids"))
            .map(|l| format!("{l}\n"))
            .collect();
        let c = check_cgroups(dir.path(), &no_pids);
        assert_eq!(c.status, Status::Fail);
        assert!(c.detail.contains("pids is not mounted"), "{c}");
        let ro = V1.replace("/sys/fs/cgroup/memory rw,", "/sys/fs/cgroup/memory ro,");
        let c = check_cgroups(dir.path(), &ro);
        assert!(
            c.status == Status::Fail
                && c.detail
                    .contains("memory at /sys/fs/cgroup/memory is read-only"),
            "{c}"
        );
        let c = check_cgroups(dir.path(), "22 1 0:5 / / rw - ext4 /dev/sda1 rw\n");
        assert!(c.status == Status::Fail && c.fix.unwrap().contains("unified_cgroup_hierarchy"));
        assert_eq!(check_cgroups(dir.path(), "").status, Status::Fail);
    }

    #[test]
    fn migrations_are_quick_on_v2_and_on_v1_with_favordynmods() {
        let dir = tempfile::tempdir().unwrap();
        fakesys::cpu_only().write_to(dir.path()).unwrap();
        let mounts = std::fs::read_to_string(dir.path().join("proc/self/mountinfo")).unwrap();
        let c = check_migrations(dir.path(), &mounts);
        assert!(c.status == Status::Ok && c.detail.contains("clone3"), "{c}");
        let v1 = v1_tree();
        let c = check_migrations(v1.path(), V1);
        assert_eq!(c.status, Status::Warn, "{c}");
        assert!(c.fix.unwrap().contains("favordynmods"));
        let favoured = format!(
            "{V1}90 27 0:60 / /run/kernelkite-favordynmods rw,relatime - cgroup cgroup rw,favordynmods,name=kernelkite\n"
        );
        let c = check_migrations(v1.path(), &favoured);
        assert!(
            c.status == Status::Ok && c.detail.contains("/run/kernelkite-favordynmods"),
            "{c}"
        );
    }

    /// A file at the path the plugin's hook files run, under `root`, with `mode`.
    fn plugin_binary(root: &Path, mode: u32) {
        let bin = root.join("opt/kernelkite/bin/kernelkite-isolate");
        std::fs::create_dir_all(bin.parent().unwrap()).unwrap();
        std::fs::write(&bin, "").unwrap();
        std::fs::set_permissions(&bin, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
    }

    #[test]
    fn the_plugin_hooks_binary_must_be_an_executable_file() {
        let root = tempfile::tempdir().unwrap();
        assert_eq!(check_plugin_binary(root.path()).status, Status::Warn);
        plugin_binary(root.path(), 0o644);
        assert_eq!(
            check_plugin_binary(root.path()).status,
            Status::Warn,
            "not executable"
        );
        plugin_binary(root.path(), 0o755);
        let c = check_plugin_binary(root.path());
        assert_eq!(c.status, Status::Ok, "{c}");
    }

    #[test]
    fn agent_version_gate() {
        let c = check_agent(&FakeHost::default());
        assert_eq!(c.status, Status::Fail);
        assert!(c.fix.unwrap().contains("3.108"));
        let host = |out: Option<&str>| FakeHost::default().with("buildkite-agent", out);
        assert_eq!(
            check_agent(&host(Some("buildkite-agent version 3.108.0, build 1"))).status,
            Status::Ok
        );
        let old = check_agent(&host(Some("buildkite-agent version 3.97.1, build 1")));
        assert!(
            old.status == Status::Warn && old.detail.contains("subdirectory"),
            "{old}"
        );
        assert_eq!(check_agent(&host(Some("weird"))).status, Status::Warn);
        assert_eq!(check_agent(&host(None)).status, Status::Fail);
    }

    #[test]
    fn gpu_driver_checks() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let nv = [Vendor::Nvidia; 2];
        let c = check_gpu_drivers(root, &nv, &healthy());
        assert!(
            c[0].status == Status::Fail && c[0].detail.contains("no driver"),
            "{}",
            c[0]
        );
        std::fs::create_dir_all(root.join("proc/driver/nvidia")).unwrap();
        std::fs::write(
            root.join("proc/driver/nvidia/version"),
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.90.07\n",
        )
        .unwrap();
        let c = check_gpu_drivers(root, &nv, &healthy());
        assert!(
            c[0].status == Status::Ok && c[0].detail.contains("NVML sees 8"),
            "{}",
            c[0]
        );
        let c = check_gpu_drivers(root, &nv, &FakeHost::default());
        assert!(
            c[0].status == Status::Warn && c[0].detail.contains("NVML failed"),
            "{}",
            c[0]
        );

        let amd = [Vendor::Amd];
        let c = check_gpu_drivers(root, &amd, &healthy());
        assert_eq!(c[0].status, Status::Fail, "{}", c[0]);
        std::fs::create_dir_all(root.join("dev")).unwrap();
        std::fs::write(root.join("dev/kfd"), "").unwrap();
        std::fs::create_dir_all(root.join("sys/module/amdgpu")).unwrap();
        assert_eq!(
            check_gpu_drivers(root, &amd, &healthy())[0].status,
            Status::Warn
        );
        let c = check_gpu_drivers(root, &amd, &healthy().with("rocm-smi", Some("")));
        assert_eq!(c[0].status, Status::Ok, "{}", c[0]);

        let c = check_gpu_drivers(root, &[], &healthy());
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].status, Status::Warn);
    }

    #[test]
    fn doctor_checks_that_nvidia_uvm_exists() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let nv = [Vendor::Nvidia];
        // No driver: the driver's line says so, and there is no uvm line yet.
        let c = check_gpu_drivers(root, &nv, &healthy());
        assert!(!c.iter().any(|c| c.name == "nvidia-uvm"), "{c:?}");
        std::fs::create_dir_all(root.join("proc/driver/nvidia")).unwrap();
        std::fs::write(
            root.join("proc/driver/nvidia/version"),
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  595.45.04\n",
        )
        .unwrap();
        let uvm = || {
            let c = check_gpu_drivers(root, &nv, &healthy());
            let line = c.iter().find(|c| c.name == "nvidia-uvm").cloned();
            line.unwrap_or_else(|| panic!("no nvidia-uvm line: {c:?}"))
        };
        std::fs::write(
            root.join("proc/devices"),
            "Character devices:\n  1 mem\n195 nvidia\n",
        )
        .unwrap();
        let c = uvm();
        assert_eq!(c.status, Status::Fail, "{c}");
        assert!(c.detail.contains("not loaded"), "{c}");
        assert!(c.to_string().contains("nvidia-modprobe -u -c=0"), "{c}");
        std::fs::write(
            root.join("proc/devices"),
            "Character devices:\n  1 mem\n195 nvidia\n511 nvidia-uvm\n",
        )
        .unwrap();
        let c = uvm();
        assert_eq!(c.status, Status::Fail, "{c}");
        assert!(
            c.detail.contains("/dev/nvidia-uvm is missing") && c.detail.contains("511"),
            "{c}"
        );
        assert!(c.to_string().contains("nvidia-modprobe -u -c=0"), "{c}");
        std::fs::create_dir_all(root.join("dev")).unwrap();
        std::fs::write(root.join("dev/nvidia-uvm"), "").unwrap();
        let c = uvm();
        assert_eq!(c.status, Status::Warn, "{c}");
        assert!(c.detail.contains("nvidia-uvm-tools is missing"), "{c}");
        std::fs::write(root.join("dev/nvidia-uvm-tools"), "").unwrap();
        let c = uvm();
        assert_eq!(c.status, Status::Ok, "{c}");
    }

    /// The fix for missing MIG capability nodes names nvidia-modprobe with the device's own
    /// proc files, not a module option (the module never makes nodes); where the module
    /// forbids nvidia-modprobe to make them (`DeviceFileModify: 0`), the `mknod` lines.
    #[test]
    fn missing_mig_nodes_are_made_by_nvidia_modprobe_or_by_hand() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        kernelkite_testkit_leaf::fake_nvml::write_mig_minors(root, 508).unwrap();
        let mut devices = healthy().nvml.unwrap();
        devices[1].mig = vec![kernelkite_sys::nvml::MigDeviceInfo {
            uuid: "MIG-1".into(),
            gpu_instance_id: 3,
            compute_instance_id: 0,
            memory_bytes: 40 << 30,
            name: None,
        }];
        let c = check_mig(root, &devices).unwrap();
        assert_eq!(c.status, Status::Fail, "{c}");
        let text = c.to_string();
        assert!(
            text.contains("/dev/nvidia-caps/nvidia-cap165, /dev/nvidia-caps/nvidia-cap166"),
            "{text}"
        );
        assert!(
            text.contains("sudo nvidia-modprobe -f /proc/driver/nvidia/capabilities/gpu1/mig/gi3/access -f /proc/driver/nvidia/capabilities/gpu1/mig/gi3/ci0/access"),
            "{text}"
        );
        assert!(!text.contains("NVreg_ModifyDeviceFiles"), "{text}");
        // The module loaded with NVreg_ModifyDeviceFiles=0: nvidia-modprobe would make nothing.
        let gi = root.join("proc/driver/nvidia/capabilities/gpu1/mig/gi3");
        std::fs::create_dir_all(gi.join("ci0")).unwrap();
        for (file, minor) in [(gi.join("access"), 165), (gi.join("ci0/access"), 166)] {
            std::fs::write(
                file,
                format!("DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 0\n"),
            )
            .unwrap();
        }
        let text = check_mig(root, &devices).unwrap().to_string();
        assert!(
            text.contains("sudo mknod -m 444 /dev/nvidia-caps/nvidia-cap166 c 508 166"),
            "{text}"
        );
        assert!(text.contains("NVreg_ModifyDeviceFiles=0"), "{text}");
        // One node there, one missing: only the missing one is named.
        std::fs::create_dir_all(root.join("dev/nvidia-caps")).unwrap();
        std::fs::write(root.join("dev/nvidia-caps/nvidia-cap165"), "").unwrap();
        let text = check_mig(root, &devices).unwrap().to_string();
        assert!(!text.contains("nvidia-cap165 c 508"), "{text}");
        assert!(!text.contains("gi3/access -f"), "{text}");
        std::fs::write(root.join("dev/nvidia-caps/nvidia-cap166"), "").unwrap();
        assert_eq!(check_mig(root, &devices).unwrap().status, Status::Ok);
    }

    #[test]
    fn docker_and_the_nvidia_toolkit() {
        let dir = tempfile::tempdir().unwrap();
        let nv = [Vendor::Nvidia];
        let c = check_docker(dir.path(), &nv, &FakeHost::default());
        assert_eq!((c.len(), c[0].status), (1, Status::Fail));
        let c = check_docker(dir.path(), &nv, &FakeHost::default().with("docker", None));
        assert!(c[0].status == Status::Fail && c[0].detail.contains("daemon"));
        assert!(c[1].status == Status::Fail && c[1].fix.as_deref().unwrap().contains("nvidia-ctk"));
        let c = check_docker(dir.path(), &nv, &healthy());
        assert!(c.iter().all(|x| x.status == Status::Ok), "{c:?}");
        let c = check_docker(
            dir.path(),
            &[Vendor::Amd],
            &FakeHost::default().with("docker", Some("27.0")),
        );
        assert_eq!(c.len(), 1, "AMD needs no NVIDIA toolkit");
    }

    /// The kernel files the sandbox check reads, as a kernel with all it needs has them.
    fn sandbox_kernel(root: &Path) {
        std::fs::create_dir_all(root.join("proc/sys/kernel/seccomp")).unwrap();
        std::fs::write(
            root.join("proc/filesystems"),
            "nodev\ttmpfs\nnodev\toverlay\n",
        )
        .unwrap();
        std::fs::write(
            root.join("proc/sys/kernel/seccomp/actions_avail"),
            "kill_process kill_thread trap errno user_notif trace log allow\n",
        )
        .unwrap();
        std::fs::write(root.join("proc/sys/kernel/osrelease"), "6.8.0-generic\n").unwrap();
    }

    #[test]
    fn a_healthy_fixture_node_passes_and_exit_code_follows_fails() {
        let dir = tempfile::tempdir().unwrap();
        fakesys::dgx_h100().write_to(dir.path()).unwrap();
        plugin_binary(dir.path(), 0o755);
        sandbox_kernel(dir.path());
        // nvidia-uvm loaded and its nodes made at boot (`nvidia-modprobe -u -c=0`).
        std::fs::write(
            dir.path().join("proc/devices"),
            "Character devices:\n195 nvidia\n511 nvidia-uvm\n",
        )
        .unwrap();
        std::fs::create_dir_all(dir.path().join("dev")).unwrap();
        for n in ["nvidia-uvm", "nvidia-uvm-tools"] {
            std::fs::write(dir.path().join("dev").join(n), "").unwrap();
        }
        let opts = DoctorOptions {
            root: dir.path().to_path_buf(),
            docker: true,
        };
        let checks = run_checks(&opts, &healthy());
        assert!(checks.iter().all(|c| c.status == Status::Ok), "{checks:#?}");
        assert_eq!(checks.len(), 12);
        assert_eq!(exit_code(&checks), 0);
        let checks = run_checks(&opts, &FakeHost::default());
        assert_eq!(exit_code(&checks), 1);
        let warn_only = [Check::warn("x", "y", "z")];
        assert_eq!(exit_code(&warn_only), 0);
    }

    #[test]
    fn doctor_names_the_runner_image_that_fits_the_node() {
        let image_line = |fixture: fakesys::FakeSys| {
            let dir = tempfile::tempdir().unwrap();
            fixture.write_to(dir.path()).unwrap();
            let opts = DoctorOptions {
                root: dir.path().to_path_buf(),
                docker: false,
            };
            let checks = run_checks(&opts, &FakeHost::default());
            let mut lines = checks.into_iter().filter(|c| c.name == "runner image");
            let line = lines.next();
            assert!(lines.next().is_none());
            line
        };
        let amd = image_line(fakesys::mi300x_8()).expect("an MI300X node needs an image");
        assert_eq!(amd.status, Status::Ok, "{amd}");
        assert!(
            amd.to_string().contains(
                "runner image    ghcr.io/kernelkite/runner-rocm:0.1.0 (AMD GPUs; host mode's venv: deployment/runner/requirements-rocm.txt)"
            ),
            "{amd}"
        );
        let nvidia = image_line(fakesys::dgx_h100()).expect("a DGX needs an image");
        assert_eq!(nvidia.status, Status::Ok, "{nvidia}");
        assert!(
            nvidia
                .detail
                .starts_with("ghcr.io/kernelkite/runner:0.1.0 (NVIDIA GPUs;"),
            "{nvidia}"
        );
        let mixed = image_line(fakesys::mixed_vendors()).expect("a mixed node needs both");
        assert_eq!(mixed.status, Status::Warn, "{mixed}");
        assert!(
            mixed
                .detail
                .contains("ghcr.io/kernelkite/runner:0.1.0 (NVIDIA GPUs)")
                && mixed
                    .detail
                    .contains("ghcr.io/kernelkite/runner-rocm:0.1.0 (AMD GPUs)"),
            "{mixed}"
        );
        assert!(mixed.fix.as_deref().unwrap().contains("image: auto"));
        // Neither image serves a node without GPUs: no line.
        assert_eq!(image_line(fakesys::cpu_only()), None);
    }

    #[test]
    fn live_host_finds_programs_and_times_out_hung_ones() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let prog = dir.path().join("hang");
        std::fs::write(&prog, "#!/bin/sh\nexec sleep 5\n").unwrap();
        std::fs::set_permissions(&prog, std::fs::Permissions::from_mode(0o755)).unwrap();
        let plain = dir.path().join("not-executable");
        std::fs::write(&plain, "").unwrap();
        let host = LiveHost {
            path: Some(dir.path().as_os_str().to_owned()),
            timeout: Duration::from_millis(200),
        };
        assert_eq!(host.which("hang"), Some(prog.clone()));
        assert_eq!(host.which("not-executable"), None);
        let t = Instant::now();
        assert_eq!(host.run(&prog, &[]), None);
        assert!(t.elapsed() < Duration::from_secs(4));
        assert_eq!(
            host.run(Path::new("/bin/echo"), &["hi"]).as_deref(),
            Some("hi\n")
        );
    }

    #[test]
    fn agent_versions() {
        assert_eq!(
            parse_agent_version("buildkite-agent version 3.108.0, build 11100"),
            Some((3, 108, 0))
        );
        assert_eq!(
            parse_agent_version("buildkite-agent version 3.97.2+10088.abc"),
            Some((3, 97, 2))
        );
        assert_eq!(parse_agent_version("nothing here"), None);
    }
}
