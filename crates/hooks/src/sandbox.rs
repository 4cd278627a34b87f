//! The host-mode sandbox: the step's command runs as an unprivileged user, with no
//! capabilities and `no_new_privs`, in new mount and IPC namespaces (and, unless the step
//! allows the network, a network namespace with only loopback) whose view of the machine is
//! private: read-only cgroup file systems, fresh size-limited `/tmp`, `/var/tmp`, `/run/lock`
//! and `/dev/shm`, a `/dev` holding only the job's GPU nodes, a `/proc` showing only the job's
//! processes and, of the NVIDIA driver's, only its GPUs (read-only, as are `/proc/sys` and the
//! like), and the agent's secrets, the node's leases and other jobs' checkouts hidden.
//!
//! How: the `command` hook plans a [`SandboxSpec`] and starts the step's shell in the job's
//! cgroup (born there by `clone3` on cgroup v2, written into `cgroup.procs` on v1) with
//! [`child_setup`] run in the child before the shell is executed: [`enter`] enters the
//! namespaces, builds the view ([`mounts`]), drops privileges ([`privileges`]) and says in the
//! job log what the job can see. The hooks are single-threaded, so that set-up may be ordinary
//! Rust (allocate, read files, format errors) rather than the async-signal-safe minimum of a
//! `pre_exec` closure; `kernelkite_sys::raw::spawn_with_setup` checks it before each fork.
//! An earlier version started a hidden sub-command of the binary as a helper instead; it cost
//! a fourth process start per job (~1.3 ms on the project's VM) and is gone. The command keeps
//! its pid: the hook waits for it as before. A failure before the `exec` goes back to the hook
//! through a pipe with its reason, so it is never mistaken for the command's exit status.
//!
//! | module | what |
//! |---|---|
//! | [`spec`] | what the hook decides: the user, GPU nodes, hidden and writable paths, sizes |
//! | [`user`] | the plugin's `user` looked up in `/etc/passwd` |
//! | [`mounts`] | the private view, built in the child |
//! | [`privileges`] | dropping root |
//! | [`ownership`] | the checkout handed to the job user and back |

use std::os::fd::OwnedFd;
use std::path::PathBuf;

pub mod disk;
pub mod environ;
pub mod init;
pub mod mounts;
pub mod ownership;
pub mod privileges;
pub mod seccomp;
pub mod spec;
pub mod user;

pub use spec::SandboxSpec;
pub use user::JobUser;

/// Why the sandbox could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The namespaces could not be entered.
    #[error("cannot enter new mount and IPC namespaces (and a network namespace without `network: true`); the hooks must run as root")]
    Namespaces(#[source] std::io::Error),
    /// A mount step failed.
    #[error("cannot {what} {path}")]
    Step {
        /// What was being done.
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// The system-call filter could not be installed.
    #[error(transparent)]
    Seccomp(#[from] seccomp::SeccompError),
    /// Dropping privileges failed.
    #[error("cannot {what}")]
    Privileges {
        /// The step.
        what: &'static str,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
}

impl SandboxError {
    /// The kernel's error number behind it (for the spawn's own error report).
    fn errno(&self) -> i32 {
        let source = match self {
            SandboxError::Namespaces(e)
            | SandboxError::Step { source: e, .. }
            | SandboxError::Privileges { source: e, .. } => e,
            SandboxError::Seccomp(seccomp::SeccompError::Install(e)) => e,
            SandboxError::Seccomp(_) => return rustix::io::Errno::INVAL.raw_os_error(),
        };
        source
            .raw_os_error()
            .unwrap_or(rustix::io::Errno::IO.raw_os_error())
    }
}

pub use environ::job_env;

/// Who the command runs as: its user, groups and capabilities.
fn identity_line(spec: &SandboxSpec, creds: &privileges::Credentials) -> String {
    let groups = if creds.groups.is_empty() {
        "no supplementary groups".to_string()
    } else {
        format!(
            "groups {} (GPU device nodes)",
            creds
                .groups
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        )
    };
    let caps = match &spec.submission {
        Some(s) if creds.effective() != 0 => format!(
            "no capabilities but CAP_SETUID, CAP_SETGID and CAP_KILL, with which its evaluator runs the submission as {} (uid {}): its filter lets it take no other id",
            s.name, s.uid
        ),
        _ => "no capabilities".into(),
    };
    format!(
        "the command runs as {} (uid {}, gid {}, {groups}), no_new_privs, {caps}",
        spec.user.name, spec.user.uid, spec.user.gid
    )
}

/// What the view made read-only: the cgroup mounts, the host's other file systems, `.git`.
fn read_only_parts(built: &mounts::Built) -> Vec<String> {
    let mut ro: Vec<String> = Vec::new();
    if !built.read_only_cgroups.is_empty() {
        ro.push(format!(
            "the cgroup file system ({} mount{})",
            built.read_only_cgroups.len(),
            if built.read_only_cgroups.len() == 1 {
                ""
            } else {
                "s"
            }
        ));
    }
    if built.host_read_only {
        ro.push("every other file system of the host's".into());
    }
    ro.extend(built.read_only.iter().map(|p| p.display().to_string()));
    ro
}

/// What the job sees of the NVIDIA driver's `/proc` directory.
fn driver_proc_line(d: &mounts::DriverShown) -> String {
    let mut what = if d.gpus.is_empty() {
        "no GPU".to_string()
    } else {
        format!("only GPU {}", d.gpus.join(", "))
    };
    if !d.caps.is_empty() {
        let caps: Vec<String> = d.caps.iter().map(|c| c.display().to_string()).collect();
        what.push_str(&format!(" and its MIG device's {}", caps.join(", ")));
    }
    if !d.files.is_empty() {
        what.push_str(&format!(" (and the driver's {})", d.files.join(", ")));
    }
    let mut line = format!("{}: {what}, read-only", d.dir.display());
    if let Some(uvm) = &d.uvm {
        line.push_str(&format!("; {}: empty", uvm.display()));
    }
    line
}

/// The lines the job log gets: what the job can see.
// Long because one line per fact of the job's view, in the order the job log shows them.
pub fn describe(
    spec: &SandboxSpec,
    built: &mounts::Built,
    creds: &privileges::Credentials,
    status: &str,
    cwd_reachable: bool,
) -> Vec<String> {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_string())
            .unwrap_or_else(|| "?".into())
    };
    let list = |v: &[PathBuf]| {
        v.iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut lines = vec![identity_line(spec, creds)];
    if spec.user.is_root() {
        lines.push("WARNING: the command runs as root (allow-root: true): without capabilities, but it can change files root owns on the host (/etc, /usr, ...)".into());
    }
    let limits = match spec.limits.cgroup {
        Some(v) => format!(
            "memory limit {} (cgroup v{v}), at most {} tasks",
            spec::human_size(spec.limits.memory_bytes),
            spec.limits.pids
        ),
        None => "no cgroup limits (RUNNING UNENFORCED)".into(),
    };
    lines.push(format!(
        "CPUs {}, memory nodes {}, {limits}",
        field("Cpus_allowed_list"),
        field("Mems_allowed_list")
    ));
    let gpu: Vec<PathBuf> = spec
        .devices
        .iter()
        .map(|d| PathBuf::from("/dev").join(&d.target))
        .collect();
    lines.push(if gpu.is_empty() {
        "GPU device nodes: none".into()
    } else {
        format!(
            "GPU device nodes: {} (no other GPU's node exists in this /dev)",
            list(&gpu)
        )
    });
    if let Some(d) = &built.driver_proc {
        lines.push(driver_proc_line(d));
    }
    let fresh: Vec<String> = built
        .fresh
        .iter()
        .map(|(p, s)| format!("{} ({})", p.display(), spec::human_size(*s)))
        .collect();
    lines.push(format!(
        "private: {}, /dev (only the nodes above and null, zero, full, random, urandom, tty, pts), SysV IPC and POSIX message queues{}; all gone when the job ends",
        fresh.join(", "),
        if built.private_proc {
            ", /proc (only the job's processes)"
        } else {
            ""
        }
    ));
    let ro = read_only_parts(built);
    if !ro.is_empty() {
        lines.push(format!("read-only: {}", ro.join(", ")));
    }
    if !built.hidden.is_empty() {
        lines.push(format!("hidden: {}", list(&built.hidden)));
    }
    if !built.writable.is_empty() {
        lines.push(format!(
            "writable, owned by {}: {} (its writes held in a layer of the job's own, at most {} and {} files, carried back when the job ends; nothing else on the host's disks is writable)",
            spec.user.name,
            list(&built.writable),
            spec::human_size(spec.tmp_size),
            disk::MAX_FILES
        ));
    }
    lines.push(format!(
        "network: {}",
        if spec.isolate_network {
            "loopback only"
        } else if spec.uplink.is_some() {
            "its own, routed out through the node (NAT); the node itself (its loopback, its addresses, its abstract sockets) and other jobs unreachable"
        } else {
            "the host's (`network: false` cuts it to loopback)"
        }
    ));
    lines.extend(spec.tools_refused.iter().map(|w| format!("WARNING: {w}")));
    if !cwd_reachable {
        lines.push(format!(
            "WARNING: {} cannot reach {} by its path (a parent directory is not searchable by it); paths relative to the working directory work",
            spec.user.name,
            spec.cwd.display()
        ));
    }
    lines
}

/// Everything between the fork and the command's `exec`, in the child (the init of the job's
/// PID namespace, see [`init`]), as root: namespaces, the private view, the command's own
/// process forked, the privilege drop, the system-call filter, the job log's lines, and every
/// inherited descriptor but stdio marked close-on-exec. The child must be the only thread of
/// its process (it is: see [`child_setup`]). Returns only in the command's process; the init
/// never returns.
pub fn enter(spec: &SandboxSpec) -> Result<(), SandboxError> {
    use kernelkite_sys::raw::{self, Forked};
    raw::unshare_namespaces(true, true, spec.isolate_network).map_err(SandboxError::Namespaces)?;
    // `network: true`: the job's own namespace, which the hook made with its link out; joined
    // here, as root, before /run (where it is bound) is hidden.
    if let Some(netns) = &spec.uplink {
        let ns = std::fs::File::open(netns).map_err(SandboxError::Namespaces)?;
        rustix::thread::move_into_link_name_space(
            std::os::fd::AsFd::as_fd(&ns),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .map_err(|e| SandboxError::Namespaces(e.into()))?;
    }
    let fork = |what| move |source| SandboxError::Privileges { what, source };
    // This process is the init: pid 1 of the job's PID namespace (the hook made it before the
    // spawn), dying with the hook.
    raw::die_with_parent(rustix::process::Signal::KILL)
        .map_err(fork("tie the init to the hook"))?;
    let (built, overlays) = mounts::build(spec)?;
    if let Forked::Parent(command) =
        raw::fork_single_threaded().map_err(fork("start the job's command"))?
    {
        init::reap_until(command, overlays);
    }
    drop(overlays);
    let creds = privileges::drop_to(&spec.user, &spec.groups, spec.submission.is_some())?;
    let ids = spec
        .submission
        .as_ref()
        .map(|s| seccomp::Identities::of(&spec.user, s));
    seccomp::install(&spec.allow_syscalls, ids.as_ref())?;
    let reachable = rustix::fs::access(&spec.cwd, rustix::fs::Access::EXEC_OK).is_ok()
        || !spec.cwd.is_absolute();
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let lines = describe(spec, &built, &creds, &status, reachable);
    crate::joblog::say_all(lines.iter().map(|l| format!("sandbox: {l}")));
    // Only stdio goes on to the command (the report pipe closes with the exec: success).
    kernelkite_sys::raw::cloexec_from(3).map_err(|source| SandboxError::Privileges {
        what: "mark inherited descriptors close-on-exec",
        source,
    })
}

/// The child set-up that runs [`enter`] for `spec`; on failure it writes the reason to
/// `report` (the write end of a close-on-exec pipe the hook reads: end-of-file means the
/// command was executed) and fails the spawn.
pub fn child_setup(spec: SandboxSpec, report: OwnedFd) -> crate::confine::ChildSetup {
    Box::new(move || {
        enter(&spec).map_err(|e| {
            let why = kernelkite_sys::error::Chain(&e).to_string();
            let _ = rustix::io::write(&report, why.as_bytes());
            std::io::Error::from_raw_os_error(e.errno())
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user() -> JobUser {
        JobUser::example()
    }

    #[test]
    fn the_log_says_what_the_job_can_see() {
        let spec = SandboxSpec {
            user: user(),
            submission: None,
            groups: vec![],
            cwd: "/builds/a/checkout".into(),
            isolate_network: true,
            uplink: None,
            tmp_size: 64 << 20,
            shm_size: 32 << 20,
            devices: vec![spec::DeviceNode {
                source: "/dev/nvidia1".into(),
                target: "nvidia1".into(),
            }],
            hide: vec![],
            writable: vec![],
            read_only: vec![],
            tools: vec![],
            tools_refused: vec![],
            driver_proc: spec::DriverProc::default(),
            allow_syscalls: vec![],
            artifacts: vec![],
            limits: spec::LimitsNote {
                memory_bytes: 64 << 20,
                pids: 4096,
                cgroup: Some(1),
            },
        };
        let built = mounts::Built {
            read_only_cgroups: vec!["/sys/fs/cgroup".into(), "/sys/fs/cgroup/cpuset".into()],
            read_only: vec!["/builds/a/checkout/.git".into()],
            fresh: vec![("/tmp".into(), 64 << 20), ("/dev/shm".into(), 32 << 20)],
            hidden: vec!["/run/kernelkite".into()],
            writable: vec!["/builds/a/checkout".into()],
            devices: vec![],
            private_proc: true,
            driver_proc: Some(mounts::DriverShown {
                dir: "/proc/driver/nvidia".into(),
                files: vec!["version".into(), "params".into(), "registry".into()],
                gpus: vec!["0000:18:00.0".into()],
                caps: vec![],
                uvm: Some("/proc/driver/nvidia-uvm".into()),
            }),
            host_read_only: true,
        };
        let creds = privileges::parse_status("Uid:\t998\t998\t998\t998\nGroups:\t\n");
        let status = "Cpus_allowed_list:\t3\nMems_allowed_list:\t0\n";
        let lines = describe(&spec, &built, &creds, status, false);
        let text = lines.join("\n");
        for want in [
            "runs as kernelkite-job (uid 998, gid 997, no supplementary groups), no_new_privs, no capabilities",
            "CPUs 3, memory nodes 0, memory limit 64 MiB (cgroup v1), at most 4096 tasks",
            "GPU device nodes: /dev/nvidia1 (no other GPU's node exists in this /dev)",
            "private: /tmp (64 MiB), /dev/shm (32 MiB), /dev",
            "/proc (only the job's processes)",
            "read-only: the cgroup file system (2 mounts), every other file system of the host's, /builds/a/checkout/.git",
            "hidden: /run/kernelkite",
            "writable, owned by kernelkite-job: /builds/a/checkout",
            "network: loopback only",
            "WARNING: kernelkite-job cannot reach /builds/a/checkout",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
        assert!(!text.contains("runs as root"));
        // The driver's `/proc`, right after the GPU nodes.
        let gpu_line = lines.iter().position(|l| l.starts_with("GPU device nodes"));
        assert_eq!(
            gpu_line.and_then(|i| lines.get(i + 1)).map(String::as_str),
            Some("/proc/driver/nvidia: only GPU 0000:18:00.0 (and the driver's version, params, registry), read-only; /proc/driver/nvidia-uvm: empty")
        );
        let mig = mounts::DriverShown {
            dir: "/proc/driver/nvidia".into(),
            files: vec!["params".into()],
            gpus: vec!["0000:18:00.0".into()],
            caps: vec![
                "capabilities/gpu0/mig/gi3/access".into(),
                "capabilities/gpu0/mig/gi3/ci0/access".into(),
            ],
            uvm: None,
        };
        assert_eq!(
            driver_proc_line(&mig),
            "/proc/driver/nvidia: only GPU 0000:18:00.0 and its MIG device's capabilities/gpu0/mig/gi3/access, capabilities/gpu0/mig/gi3/ci0/access (and the driver's params), read-only"
        );
        let none = mounts::DriverShown {
            gpus: vec![],
            caps: vec![],
            ..mig
        };
        assert_eq!(
            driver_proc_line(&none),
            "/proc/driver/nvidia: no GPU (and the driver's params), read-only"
        );
        // No driver: no line.
        let bare = mounts::Built {
            driver_proc: None,
            ..built
        };
        let text = describe(&spec, &bare, &creds, status, true).join("\n");
        assert!(!text.contains("/proc/driver"), "{text}");
    }
}
