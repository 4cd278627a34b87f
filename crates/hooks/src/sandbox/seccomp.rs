//! The job's system-call filter: at least what Docker's default profile refuses a container
//! without capabilities, installed in the command's process after it dropped root and before
//! it executes the step's shell, so the whole job (and everything it forks) is held to it.
//!
//! Refused calls fail with `EPERM` (`clone3` with `ENOSYS`, below), never by killing the
//! process: a library that probes a call (io_uring, `perf_event_open`) falls back as it would
//! in a container. Built with `seccompiler` (rust-vmm's, Firecracker's filter compiler); the
//! filter also refuses every call of another ABI (x32's numbers on x86-64; a 32-bit `int 0x80`
//! is a different audit architecture, which seccompiler's program kills).
//!
//! Why each rule: [`RULES`], listed in `plugin/README.md` ("The system-call filter").

use std::collections::BTreeMap;

use seccompiler::{
    SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
};

/// One group of refused calls and why.
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    /// The calls, by name (as `man 2` spells them).
    pub calls: &'static [(&'static str, i64)],
    /// Why a kernel task's job never needs them and an attacker wants them.
    pub why: &'static str,
    /// The `allow-syscalls` name that lifts this group for a pipeline, if any may.
    pub opt_out: Option<&'static str>,
}

macro_rules! calls {
    ($($name:ident),* $(,)?) => {
        &[$((stringify!($name), libc::$name as i64)),*]
    };
}

/// Calls that exist on x86-64 only (legacy interfaces aarch64 never had).
#[cfg(target_arch = "x86_64")]
const LEGACY: &[(&str, i64)] = calls!(
    SYS_iopl,
    SYS_ioperm,
    SYS_uselib,
    SYS__sysctl,
    SYS_ustat,
    SYS_sysfs,
    SYS_nfsservctl
);
#[cfg(not(target_arch = "x86_64"))]
const LEGACY: &[(&str, i64)] = &[];

/// The refused groups. `clone` (namespace flags only) and `personality` (all but the values
/// Docker allows) are refused by argument, in [`filter_rules`].
pub const RULES: &[Rule] = &[
    Rule {
        calls: calls!(SYS_unshare, SYS_setns),
        why: "new or other namespaces: a user namespace gives back every capability inside it and opens kernel code a job never needs (the same for `clone` with a CLONE_NEW* flag; `clone3`, whose flags a filter cannot read, answers ENOSYS so that libc falls back to `clone`)",
        opt_out: None,
    },
    Rule {
        calls: calls!(
            SYS_mount,
            SYS_umount2,
            SYS_pivot_root,
            SYS_open_tree,
            SYS_move_mount,
            SYS_fsopen,
            SYS_fsconfig,
            SYS_fsmount,
            SYS_fspick,
            SYS_mount_setattr
        ),
        why: "changing the file system view (uncovering what the sandbox hides)",
        opt_out: None,
    },
    Rule {
        calls: calls!(SYS_io_uring_setup, SYS_io_uring_enter, SYS_io_uring_register),
        why: "io_uring: its operations are not seen by this filter, and it has been a steady source of kernel privilege escalations",
        opt_out: None,
    },
    Rule {
        calls: calls!(SYS_keyctl, SYS_add_key, SYS_request_key),
        why: "the kernel keyring is not namespaced: keys of the node and of other jobs",
        opt_out: None,
    },
    Rule {
        calls: calls!(SYS_perf_event_open),
        why: "performance counters: side channels on other jobs' CPUs and a large kernel surface; a profiling task may lift it",
        opt_out: Some("perf_event_open"),
    },
    Rule {
        calls: calls!(SYS_ptrace),
        why: "tracing another process of the job user (the evaluator that writes result.json); a debugging task may lift it",
        opt_out: Some("ptrace"),
    },
    Rule {
        calls: calls!(
            SYS_process_vm_readv,
            SYS_process_vm_writev,
            SYS_kcmp,
            SYS_pidfd_getfd
        ),
        why: "reading or writing another process's memory or descriptors (the evaluator's)",
        opt_out: None,
    },
    Rule {
        calls: calls!(
            SYS_mbind,
            SYS_set_mempolicy,
            SYS_move_pages,
            SYS_migrate_pages,
            SYS_process_madvise
        ),
        why: "placing memory on other NUMA nodes than the slice's, or advising on another process's memory (Docker allows the NUMA calls only with CAP_SYS_NICE)",
        opt_out: None,
    },
    Rule {
        calls: calls!(SYS_userfaultfd),
        why: "userfaultfd: stalls the kernel mid-copy, the usual way to win kernel races",
        opt_out: None,
    },
    Rule {
        calls: calls!(SYS_bpf),
        why: "BPF programs in the kernel",
        opt_out: None,
    },
    Rule {
        calls: calls!(
            SYS_kexec_load,
            SYS_kexec_file_load,
            SYS_reboot,
            SYS_init_module,
            SYS_finit_module,
            SYS_delete_module
        ),
        why: "another kernel, a reboot, kernel modules",
        opt_out: None,
    },
    Rule {
        calls: calls!(
            SYS_acct,
            SYS_swapon,
            SYS_swapoff,
            SYS_syslog,
            SYS_quotactl,
            SYS_quotactl_fd,
            SYS_open_by_handle_at,
            SYS_name_to_handle_at,
            SYS_lookup_dcookie,
            SYS_settimeofday,
            SYS_clock_settime,
            SYS_clock_adjtime,
            SYS_vhangup,
            SYS_fanotify_init
        ),
        why: "machine-wide state: accounting, swap, the kernel log, quotas, files by handle (outside the mount namespace), the clock, terminals, file system notifications",
        opt_out: None,
    },
    Rule {
        calls: LEGACY,
        why: "legacy interfaces (I/O ports, old module and sysctl calls)",
        opt_out: None,
    },
];

/// `personality(2)` values Docker's default profile allows: `PER_LINUX`, `PER_LINUX32`,
/// `UNAME26`, `PER_LINUX32|UNAME26` and the query `0xffffffff`. Anything else (turning off
/// address-space randomisation, `READ_IMPLIES_EXEC`) is refused.
pub const PERSONALITIES: &[u64] = &[0x0, 0x8, 0x2_0000, 0x2_0008, 0xffff_ffff];

/// `clone` flags that make a namespace (`CLONE_NEWTIME` shares its bit with `CSIGNAL` in
/// `clone`, which cannot make one).
pub const NAMESPACE_FLAGS: &[(&str, u64)] = &[
    ("CLONE_NEWNS", libc::CLONE_NEWNS as u64),
    ("CLONE_NEWUTS", libc::CLONE_NEWUTS as u64),
    ("CLONE_NEWIPC", libc::CLONE_NEWIPC as u64),
    ("CLONE_NEWUSER", libc::CLONE_NEWUSER as u64),
    ("CLONE_NEWPID", libc::CLONE_NEWPID as u64),
    ("CLONE_NEWNET", libc::CLONE_NEWNET as u64),
    ("CLONE_NEWCGROUP", libc::CLONE_NEWCGROUP as u64),
];

/// `socket` families refused: `AF_VSOCK` (40) reaches the hypervisor's services on a virtual
/// node whatever the network namespace (Docker refuses it too).
pub const SOCKET_FAMILIES: &[(&str, u64)] = &[("AF_VSOCK", 40)];

/// `ioctl` requests refused: `TIOCSTI` types into the terminal the job inherited (the agent's
/// pty: input, a Ctrl-C for processes outside the job), `TIOCLINUX` does the same on a console.
pub const IOCTLS: &[(&str, u64)] = &[("TIOCSTI", 0x5412), ("TIOCLINUX", 0x541C)];

/// The two identities a command holding the evaluator's capabilities
/// (`kernelkite_sys::identity`) may take: its own and the submission's. With them the filter
/// refuses every `set*id` call naming another id (`-1`, "unchanged", where the call has it) and
/// `setgroups` whole (the command keeps the groups the sandbox gave it), so `CAP_SETUID` and
/// `CAP_SETGID` reach neither root nor another job's uid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identities {
    /// The command's uid and the submission's.
    pub uids: [u32; 2],
    /// Their gids.
    pub gids: [u32; 2],
}

impl Identities {
    /// The command user's and the submission's ids.
    pub fn of(command: &super::user::JobUser, submission: &super::user::JobUser) -> Identities {
        Identities {
            uids: [command.uid, submission.uid],
            gids: [command.gid, submission.gid],
        }
    }
}

/// `set*id` calls and their id arguments; `true` where `-1` means "leave unchanged".
const ID_CALLS: &[(&str, i64, &[u8], bool, bool)] = &[
    // (name, number, id arguments, takes -1, names uids (else gids))
    ("setuid", libc::SYS_setuid, &[0], false, true),
    ("setreuid", libc::SYS_setreuid, &[0, 1], true, true),
    ("setresuid", libc::SYS_setresuid, &[0, 1, 2], true, true),
    ("setfsuid", libc::SYS_setfsuid, &[0], true, true),
    ("setgid", libc::SYS_setgid, &[0], false, false),
    ("setregid", libc::SYS_setregid, &[0, 1], true, false),
    ("setresgid", libc::SYS_setresgid, &[0, 1, 2], true, false),
    ("setfsgid", libc::SYS_setfsgid, &[0], true, false),
];

/// The rules refusing (by [`Identities`]) every id change but to the job's two identities.
fn identity_rules(ids: &Identities) -> Result<BTreeMap<i64, Vec<SeccompRule>>, SeccompError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for (_, nr, args, unchanged, uid) in ID_CALLS {
        let allowed = if *uid { ids.uids } else { ids.gids };
        let mut values: Vec<u64> = allowed.iter().map(|v| u64::from(*v)).collect();
        if *unchanged {
            values.push(u64::from(u32::MAX));
        }
        // One rule per argument: it matches (refused) when that argument is none of `values`.
        // Ids are 32-bit: compared on the low half the kernel reads.
        let per_arg = args
            .iter()
            .map(|arg| {
                values
                    .iter()
                    .map(|v| {
                        SeccompCondition::new(*arg, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, *v)
                            .map_err(|e| SeccompError::Build(e.to_string()))
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .and_then(rule)
            })
            .collect::<Result<Vec<_>, _>>()?;
        rules.insert(*nr, per_arg);
    }
    rules.insert(libc::SYS_setgroups, Vec::new());
    Ok(rules)
}

/// The names `allow-syscalls` accepts.
pub fn opt_outs() -> Vec<&'static str> {
    RULES.iter().filter_map(|r| r.opt_out).collect()
}

/// Why the filter could not be built or installed.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// This architecture has no filter here.
    #[error("no system-call filter for this architecture ({0}); kernelkite's sandbox supports x86_64 and aarch64")]
    Arch(&'static str),
    /// seccompiler refused the rules (a bug here).
    #[error("cannot build the system-call filter: {0}")]
    Build(String),
    /// The kernel refused it.
    #[error("cannot install the system-call filter (does the kernel have CONFIG_SECCOMP_FILTER?)")]
    Install(#[source] std::io::Error),
}

fn cond(arg: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition, SeccompError> {
    SeccompCondition::new(arg, SeccompCmpArgLen::Qword, op, value)
        .map_err(|e| SeccompError::Build(e.to_string()))
}

fn rule(conditions: Vec<SeccompCondition>) -> Result<SeccompRule, SeccompError> {
    SeccompRule::new(conditions).map_err(|e| SeccompError::Build(e.to_string()))
}

/// The EPERM filter's rules: every call of [`RULES`] not lifted by `allowed`, `clone` with a
/// namespace flag, `personality` outside [`PERSONALITIES`].
pub fn filter_rules(allowed: &[String]) -> Result<BTreeMap<i64, Vec<SeccompRule>>, SeccompError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for r in RULES {
        if r.opt_out.is_some_and(|o| allowed.iter().any(|a| a == o)) {
            continue;
        }
        for (_, nr) in r.calls {
            rules.insert(*nr, Vec::new());
        }
    }
    let clone_rules = NAMESPACE_FLAGS
        .iter()
        .map(|(_, f)| cond(0, SeccompCmpOp::MaskedEq(*f), *f).and_then(|c| rule(vec![c])))
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_clone, clone_rules);
    let personality = PERSONALITIES
        .iter()
        .map(|p| cond(0, SeccompCmpOp::Ne, *p))
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_personality, vec![rule(personality)?]);
    // Families and requests are ints: compared on the low 32 bits the kernel reads.
    let dword = |arg: u8, v: u64| {
        SeccompCondition::new(arg, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, v)
            .map_err(|e| SeccompError::Build(e.to_string()))
            .and_then(|c| rule(vec![c]))
    };
    rules.insert(
        libc::SYS_socket,
        SOCKET_FAMILIES
            .iter()
            .map(|(_, f)| dword(0, *f))
            .collect::<Result<_, _>>()?,
    );
    rules.insert(
        libc::SYS_ioctl,
        IOCTLS
            .iter()
            .map(|(_, r)| dword(1, *r))
            .collect::<Result<_, _>>()?,
    );
    Ok(rules)
}

fn arch() -> Result<seccompiler::TargetArch, SeccompError> {
    std::env::consts::ARCH
        .try_into()
        .map_err(|_| SeccompError::Arch(std::env::consts::ARCH))
}

fn compile(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    action: SeccompAction,
) -> Result<seccompiler::BpfProgram, SeccompError> {
    SeccompFilter::new(rules, SeccompAction::Allow, action, arch()?)
        .and_then(TryInto::try_into)
        .map_err(|e| SeccompError::Build(e.to_string()))
}

/// The programs: the x32 ABI refused whole (`kernelkite_sys::raw::x32_refusal`), `clone3` →
/// `ENOSYS`, then the `EPERM` rules. (One seccompiler filter has one match action; the kernel
/// runs them all, and a call only one of them matches gets its answer.)
///
/// With `ids` (a command holding the evaluator's capabilities), a fourth program holds
/// `set*id` to the two identities ([`Identities`]).
pub fn programs(
    allowed: &[String],
    ids: Option<&Identities>,
) -> Result<Vec<seccompiler::BpfProgram>, SeccompError> {
    let mut clone3: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    clone3.insert(libc::SYS_clone3, Vec::new());
    let mut out: Vec<seccompiler::BpfProgram> = vec![kernelkite_sys::raw::x32_refusal()];
    out.push(compile(clone3, SeccompAction::Errno(libc::ENOSYS as u32))?);
    out.push(compile(
        filter_rules(allowed)?,
        SeccompAction::Errno(libc::EPERM as u32),
    )?);
    if let Some(ids) = ids {
        out.push(compile(
            identity_rules(ids)?,
            SeccompAction::Errno(libc::EPERM as u32),
        )?);
    }
    Ok(out)
}

/// Installs the filter on the calling thread (the command's process, single-threaded, after it
/// dropped root; `no_new_privs` is already set). It holds for every process the job starts.
pub fn install(allowed: &[String], ids: Option<&Identities>) -> Result<(), SeccompError> {
    let programs = programs(allowed, ids)?;
    let refs: Vec<&seccompiler::BpfProgram> = programs.iter().collect();
    kernelkite_sys::raw::apply_filters(&refs).map_err(SeccompError::Install)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errno_of(rc: libc::c_long) -> i32 {
        if rc == -1 {
            std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
        } else {
            0
        }
    }

    /// Runs `body` in a forked child with the filter installed; the child's exit code is the
    /// number of failed checks, its stderr says which.
    fn in_filtered_child(allowed: &[String], body: fn() -> Vec<String>) -> Vec<String> {
        in_child_with(programs(allowed, None).unwrap(), body)
    }

    fn in_child_with(
        programs: Vec<seccompiler::BpfProgram>,
        body: fn() -> Vec<String>,
    ) -> Vec<String> {
        let refs: Vec<&seccompiler::BpfProgram> = programs.iter().collect();
        let (r, w) = rustix::pipe::pipe().unwrap();
        // SAFETY: the test forks to get a process whose filter dies with it; the child only
        // installs the (prebuilt) filter, makes raw calls, writes to a pipe and _exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            if kernelkite_sys::raw::apply_filters(&refs).is_err() {
                // SAFETY: ends the forked test child.
                unsafe { libc::_exit(99) };
            }
            let out = body().join("\n");
            let _ = rustix::io::write(&w, out.as_bytes());
            // SAFETY: ends the forked test child without running the test harness's code.
            unsafe { libc::_exit(0) };
        }
        drop(w);
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::fs::File::from(r), &mut text).unwrap();
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "the child could not install the filter"
        );
        text.lines().map(str::to_string).collect()
    }

    /// Every refused call, made with arguments that would otherwise fail some other way (or
    /// harmlessly), answers EPERM: each rule is tried, not just listed.
    fn every_rule_answers_eperm() -> Vec<String> {
        let mut bad = Vec::new();
        for r in RULES {
            for (name, nr) in r.calls {
                // SAFETY: the arguments are all invalid (null pointers, -1 descriptors); the
                // filter answers before the kernel would look at them.
                let rc = unsafe { libc::syscall(*nr, -1i64, 0i64, 0i64, 0i64, 0i64, 0i64) };
                let e = errno_of(rc);
                if e != libc::EPERM {
                    bad.push(format!("{name}: rc {rc}, errno {e}"));
                }
            }
        }
        for (name, flag) in NAMESPACE_FLAGS {
            // SAFETY: clone with a namespace flag is refused by the filter before it forks.
            let rc =
                unsafe { libc::syscall(libc::SYS_clone, *flag | libc::SIGCHLD as u64, 0, 0, 0, 0) };
            if rc == 0 {
                // SAFETY: the (unexpected) child ends at once.
                unsafe { libc::_exit(0) };
            }
            if errno_of(rc) != libc::EPERM {
                bad.push(format!("clone({name}): rc {rc}"));
            }
        }
        // SAFETY: clone3 with a null argument; the filter answers ENOSYS first.
        let rc = unsafe { libc::syscall(libc::SYS_clone3, 0, 0) };
        if errno_of(rc) != libc::ENOSYS {
            bad.push(format!("clone3: rc {rc}, errno {}", errno_of(rc)));
        }
        // SAFETY: personality(ADDR_NO_RANDOMIZE) would turn ASLR off for later execs.
        let rc = unsafe { libc::syscall(libc::SYS_personality, 0x0040000u64) };
        if errno_of(rc) != libc::EPERM {
            bad.push(format!("personality(ADDR_NO_RANDOMIZE): rc {rc}"));
        }
        #[cfg(target_arch = "x86_64")]
        for (name, nr) in [
            ("unshare", libc::SYS_unshare | 0x4000_0000),
            ("ptrace (x32's own number)", 521 | 0x4000_0000),
            ("process_vm_readv (x32's own number)", 539 | 0x4000_0000),
        ] {
            // SAFETY: x32 numbers, refused by the filter whatever the kernel's x32 support.
            let rc = unsafe { libc::syscall(nr, 0i64, 0i64, 0i64, 0i64) };
            if errno_of(rc) != libc::EPERM {
                bad.push(format!("x32 {name}: rc {rc}, errno {}", errno_of(rc)));
            }
        }
        // SAFETY: socket(AF_VSOCK, SOCK_STREAM, 0); refused before a socket is made.
        let rc = unsafe { libc::syscall(libc::SYS_socket, 40i64, 1i64, 0i64) };
        if errno_of(rc) != libc::EPERM {
            bad.push(format!("socket(AF_VSOCK): rc {rc}"));
        }
        // SAFETY: ioctl(0, TIOCSTI, NULL): refused before the kernel reads the pointer.
        let rc = unsafe { libc::syscall(libc::SYS_ioctl, 0i64, 0x5412i64, 0i64) };
        if errno_of(rc) != libc::EPERM {
            bad.push(format!("ioctl(TIOCSTI): rc {rc}"));
        }
        bad
    }

    /// What a job needs still works: fork (clone without namespace flags), the personality
    /// query, getpid, an ordinary file.
    fn ordinary_calls_work() -> Vec<String> {
        let mut bad = Vec::new();
        // SAFETY: an ordinary fork; the child exits at once.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: ends the grandchild.
            unsafe { libc::_exit(0) };
        }
        if pid < 0 {
            bad.push(format!("fork: {}", std::io::Error::last_os_error()));
        } else {
            let mut st = 0;
            // SAFETY: reaps the child forked above.
            unsafe { libc::waitpid(pid, &mut st, 0) };
        }
        // SAFETY: the query form of personality changes nothing.
        let rc = unsafe { libc::syscall(libc::SYS_personality, 0xffff_ffffu64) };
        if rc < 0 {
            bad.push("personality query refused".into());
        }
        if std::fs::read("/proc/self/status").is_err() {
            bad.push("read a file".into());
        }
        bad
    }

    #[test]
    fn each_refused_call_answers_eperm_and_ordinary_ones_work() {
        let bad = in_filtered_child(&[], every_rule_answers_eperm);
        assert!(bad.is_empty(), "not refused: {bad:?}");
        let bad = in_filtered_child(&[], ordinary_calls_work);
        assert!(bad.is_empty(), "refused: {bad:?}");
    }

    fn perf_is_not_refused() -> Vec<String> {
        // SAFETY: a null attribute pointer: EFAULT from the kernel, not the filter's EPERM.
        let perf = errno_of(unsafe {
            libc::syscall(libc::SYS_perf_event_open, 0i64, 0i64, -1i64, -1i64, 0i64)
        });
        // SAFETY: ptrace(PTRACE_PEEKDATA) of pid 0: ESRCH from the kernel, not the filter.
        let pt = errno_of(unsafe {
            libc::syscall(
                libc::SYS_ptrace,
                libc::PTRACE_PEEKDATA as i64,
                0i64,
                0i64,
                0i64,
            )
        });
        let mut bad = Vec::new();
        if perf == libc::EPERM {
            bad.push("perf_event_open still refused".into());
        }
        if pt != libc::EPERM {
            bad.push(format!("ptrace was lifted too (errno {pt})"));
        }
        bad
    }

    const COMMAND_ID: u32 = 1234;
    const SUBMISSION_ID: u32 = 5678;

    /// As root (which may take any id without the filter), only the two identities are
    /// reachable: root, a third id and `setgroups` are refused, the submission's id is not.
    fn only_the_two_identities() -> Vec<String> {
        let mut bad = Vec::new();
        let refused: [(&str, i64, [i64; 3]); 6] = [
            ("setuid(0)", libc::SYS_setuid, [0, 0, 0]),
            ("setresuid(0, 0, 0)", libc::SYS_setresuid, [0, 0, 0]),
            (
                "setresuid(-1, 4242, -1)",
                libc::SYS_setresuid,
                [-1, 4242, -1],
            ),
            ("setreuid(1234, 0)", libc::SYS_setreuid, [1234, 0, 0]),
            ("setgid(0)", libc::SYS_setgid, [0, 0, 0]),
            ("setgroups(0, NULL)", libc::SYS_setgroups, [0, 0, 0]),
        ];
        for (name, nr, [a, b, c]) in refused {
            // SAFETY: credential calls on this forked child only; refused before they act.
            let rc = unsafe { libc::syscall(nr, a, b, c) };
            if errno_of(rc) != libc::EPERM {
                bad.push(format!("{name}: rc {rc}, errno {}", errno_of(rc)));
            }
        }
        // A query (-1) of the file-system uid still answers.
        // SAFETY: setfsuid(-1) changes nothing.
        if unsafe { libc::syscall(libc::SYS_setfsuid, -1i64) } < 0 {
            bad.push("setfsuid(-1) failed".into());
        }
        let s = i64::from(SUBMISSION_ID);
        for (name, nr, args) in [
            ("setresgid(s, s, s)", libc::SYS_setresgid, [s, s, s]),
            ("setresuid(-1, s, -1)", libc::SYS_setresuid, [-1, s, -1]),
        ] {
            // SAFETY: this forked child becomes the submission's id, as the runner's does.
            let rc = unsafe { libc::syscall(nr, args[0], args[1], args[2]) };
            if rc != 0 {
                bad.push(format!("{name}: rc {rc}, errno {}", errno_of(rc)));
            }
        }
        bad
    }

    #[test]
    fn with_the_evaluator_s_capabilities_only_the_two_identities_are_reachable() {
        if !rustix::process::geteuid().is_root() {
            kernelkite_testkit_leaf::skip("needs root: without it every id change fails anyway");
            return;
        }
        let ids = Identities {
            uids: [COMMAND_ID, SUBMISSION_ID],
            gids: [COMMAND_ID, SUBMISSION_ID],
        };
        let bad = in_child_with(programs(&[], Some(&ids)).unwrap(), only_the_two_identities);
        assert!(bad.is_empty(), "{bad:?}");
        // Without the identities (a root command, `allow-root`) nothing of that is refused.
        let bad = in_child_with(programs(&[], None).unwrap(), only_the_two_identities);
        assert!(bad.len() >= 5, "the rules must be what refuses: {bad:?}");
    }

    #[test]
    fn an_opt_out_lifts_its_own_group_only() {
        let bad = in_filtered_child(&["perf_event_open".into()], perf_is_not_refused);
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(opt_outs(), ["perf_event_open", "ptrace"]);
    }

    #[test]
    fn every_rule_says_why_and_the_readme_lists_every_call() {
        let readme = include_str!("../../../../plugin/README.md");
        let table = &readme[readme
            .find("#### The system-call filter")
            .expect("the README has the filter's section")..];
        for r in RULES {
            assert!(r.why.len() > 10, "{:?}", r.calls);
            for (name, _) in r.calls {
                let call = name.trim_start_matches("SYS_");
                assert!(table.contains(&format!("`{call}`")), "README lacks {call}");
            }
            if let Some(o) = r.opt_out {
                assert!(
                    table.contains(&format!("| `{o}` |")),
                    "README lacks opt-out {o}"
                );
            }
        }
    }
}
