//! The evaluator's guard against the submission it runs.
//!
//! In the sandbox the runner runs as the slice's job user and every harness process as the
//! slice's submission identity, another uid ([`kernelkite_sys::identity`]): the kernel's own
//! rules then keep the submission from signalling, tracing or reading the runner, and from
//! writing the checkout, where `result.json` goes. The sandbox names that identity in
//! `KERNELKITE_SUBMISSION_USER` and gives the runner the three capabilities that switch to it
//! and clean up after it (`CAP_SETUID`, `CAP_SETGID`, `CAP_KILL`; its filter lets `set*id`
//! name only the two identities); each harness process drops to it and drops every
//! capability before it executes ([`submission_identity`]). The harness works in a work
//! directory open to it (mode 1777, in the job's private `/tmp`) with `HOME` there.
//!
//! Outside the sandbox (no identity named) the runner and the submission share a uid, and
//! the rest of this guard is all there is. Both ways:
//!
//! * **Reading or tracing the runner**: the runner makes itself non-dumpable at start
//!   ([`protect_self`]): its `/proc/<pid>/*` files belong to root, and `ptrace`,
//!   `process_vm_readv`/`writev` and `pidfd_getfd` need `CAP_SYS_PTRACE`, which no job has
//!   (the sandbox's filter refuses those calls too).
//! * **Signalling or starving the runner**: every harness process carries a seccomp filter
//!   ([`submission_filter`], with the x32 ABI refused whole) refusing `kill`, `tgkill`,
//!   `rt_sigqueueinfo`, `rt_tgsigqueueinfo`, `pidfd_open` aimed at the runner's pid,
//!   `kill(-1)` (which would reach it), the runner's process group, `tkill` and
//!   `pidfd_send_signal` (whose targets a filter cannot read), naming the runner as the owner
//!   of a file's `SIGIO`, and changing another process's limits, priority, CPUs or scheduling
//!   (`prlimit64`, `setpriority`, `ioprio_set`, `sched_set*` with a pid other than 0). The
//!   runner has one thread while a harness runs (its cancellation handler sets a flag), so its
//!   pid is its only thread id.
//! * **Outliving the runner's clean-up**: at the top of the job's PID namespace (the sandbox
//!   starts the command as the only child of the namespace's init), the runner kills every
//!   other process of its namespace with one `kill(-1, SIGKILL)` after each run
//!   ([`kill_all_others`]; `CAP_KILL` lets it reach the submission's uid); the kernel refuses
//!   a `fork` to a process with a fatal signal pending, so no fork chain escapes it. It writes
//!   `result.json` only after that.
//! * **Being chosen by the OOM killer**: each harness process raises its own
//!   `oom_score_adj` to 1000 before it executes.
//!
//! What stays the harness's limit: kernelbot's `eval.py` imports the submission into its own
//! process, so the submission can rewrite the harness's checks and its POPCORN lines from the
//! inside. The result is then the harness's word on itself; a task author who needs more runs
//! the reference check in another process (see `runner/README.md`).

use std::path::{Path, PathBuf};

use std::collections::BTreeMap;

use kernelkite_sys::identity::{Ids, EVALUATOR_CAPABILITY_MASK, SUBMISSION_USER_ENV};

use seccompiler::{
    BackendError, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};

/// What [`crate::process::run`] does for the evaluator's safety, decided once at start.
#[derive(Debug, Clone)]
pub struct Guard {
    /// The seccomp program each harness process installs before it executes.
    pub filter: seccompiler::BpfProgram,
    /// After each run, kill every other process of the job's PID namespace
    /// ([`kill_all_others`]).
    pub kill_namespace: bool,
    /// The uid and gid each harness process runs as ([`submission_identity`]); `None`: the
    /// runner's own.
    pub submission: Option<Ids>,
}

/// Why the guard could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    /// The runner cannot protect itself (non-dumpable, filter): it goes on unguarded, and says
    /// so.
    #[error("{0}")]
    Unprotected(String),
    /// The sandbox named a submission identity the runner cannot switch to: evaluating anyway
    /// would run the submission as the runner's uid, so the evaluation fails.
    #[error("{0}")]
    Identity(String),
}

impl Guard {
    /// Whether `guard` runs the submission under its own identity, apart from the runner.
    pub fn runs_apart(guard: Option<&Guard>) -> bool {
        guard.is_some_and(|g| g.submission.is_some())
    }

    /// This process's guard: non-dumpable from now on ([`protect_self`]), the filter built for
    /// its pid, and the namespace-wide kill when it is [`at_top_of_job_namespace`].
    /// The submission identity comes from `named` (the sandbox's
    /// `KERNELKITE_SUBMISSION_USER`).
    pub fn for_this_process(proc_root: &Path, named: Option<&str>) -> Result<Guard, GuardError> {
        let effective = rustix::thread::capabilities(None)
            .map(|c| c.effective.bits())
            .unwrap_or(0);
        let me = rustix::process::getuid().as_raw();
        let submission = submission_identity(named, effective, me).map_err(GuardError::Identity)?;
        // Where an identity is named (the sandbox), a runner that cannot guard itself does not
        // evaluate at all; elsewhere it goes on and says so.
        let unguarded = |e: String| match submission {
            Some(_) => GuardError::Identity(e),
            None => GuardError::Unprotected(e),
        };
        protect_self()
            .map_err(|e| unguarded(format!("cannot make the runner non-dumpable: {e}")))?;
        Ok(Guard {
            filter: submission_filter().map_err(unguarded)?,
            kill_namespace: at_top_of_job_namespace(proc_root),
            submission,
        })
    }
}

/// The identity the submission runs as: the one the sandbox `named`
/// (`KERNELKITE_SUBMISSION_USER`, `uid:gid`), once it is known usable: this process (uid `me`,
/// `effective` capabilities) holds `CAP_SETUID`, `CAP_SETGID` and `CAP_KILL` and is not that
/// uid already. `None` when nothing is named (outside the sandbox).
pub fn submission_identity(
    named: Option<&str>,
    effective: u64,
    me: u32,
) -> Result<Option<Ids>, String> {
    let Some(value) = named.filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    let ids = Ids::from_env(value).ok_or_else(|| {
        format!("{SUBMISSION_USER_ENV}={value:?} is not uid:gid (both non-zero); the sandbox sets it, so run the runner as the sandbox starts it, or unset it")
    })?;
    if ids.uid == me {
        return Err(format!(
            "{SUBMISSION_USER_ENV} names uid {me}, the runner's own: the submission would share the evaluator's uid; the sandbox gives them different ids"
        ));
    }
    if effective & EVALUATOR_CAPABILITY_MASK != EVALUATOR_CAPABILITY_MASK {
        return Err(format!(
            "{SUBMISSION_USER_ENV} names uid {} for the submission, but the runner lacks the capabilities to switch to it (CAP_SETUID, CAP_SETGID, CAP_KILL; effective {effective:#x}): start it directly from the step's command in the kernelkite sandbox, not through sudo, su or a setuid wrapper",
            ids.uid
        ));
    }
    Ok(Some(ids))
}

/// The directory the submission works in, when it runs under its own identity: a fresh one
/// inside a work directory the operator `named` (whose mode is left alone), else `dir` itself
/// (the runner's temporary directory); opened to it ([`open_to_submission`]). The fresh one
/// lives as long as the returned guard.
pub fn submission_workdir(
    dir: PathBuf,
    named: bool,
) -> std::io::Result<(PathBuf, Option<tempfile::TempDir>)> {
    let (dir, fresh) = if named {
        let t = tempfile::Builder::new()
            .prefix("kernelkite-")
            .tempdir_in(&dir)?;
        (t.path().to_path_buf(), Some(t))
    } else {
        (dir, None)
    };
    open_to_submission(&dir)?;
    Ok((dir, fresh))
}

/// Opens a directory the runner made to the submission's uid (mode 1777): it works and builds
/// there, and cannot rename or remove what the runner wrote (the sticky bit; the runner, the
/// directory's owner, still may). The runner's own writes into it never follow a link
/// (`crate::workdir`).
pub fn open_to_submission(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777))
}

/// Makes this process non-dumpable: its `/proc/<pid>` files become root's, and a process of the
/// same user without `CAP_SYS_PTRACE` can no longer trace it or read its memory, environment
/// or descriptors.
pub fn protect_self() -> std::io::Result<()> {
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)?;
    Ok(())
}

/// The inode number of the kernel's initial PID namespace (`PROC_PID_INIT_INO`,
/// include/linux/proc_ns.h): `/proc/self/ns/pid` reads `pid:[4026531836]` there and only there.
const INITIAL_PID_NAMESPACE: &str = "pid:[4026531836]";

/// Whether a `/proc/<pid>/ns/pid` link's text names a PID namespace other than the host's.
pub fn names_a_nested_namespace(link: &str) -> bool {
    link.starts_with("pid:[") && link != INITIAL_PID_NAMESPACE
}

/// Whether `kill(-1)` from this process reaches exactly the submission's processes: it is in a
/// PID namespace of its own (not the host's), directly under that namespace's init (so no
/// shell or other process of the job is above it), and not root.
pub fn at_top_of_job_namespace(proc_root: &Path) -> bool {
    let link = std::fs::read_link(proc_root.join("self/ns/pid")).unwrap_or_default();
    names_a_nested_namespace(&link.to_string_lossy())
        && rustix::process::getppid().is_some_and(|p| p.as_raw_nonzero().get() == 1)
        && !rustix::process::geteuid().is_root()
}

/// Kills every other process of this PID namespace (every process of the job but the init)
/// and reaps them, for at most 2 s. Only for a process [`at_top_of_job_namespace`].
pub fn kill_all_others() {
    if !kernelkite_sys::raw::kill_all_others(std::time::Duration::from_secs(2)) {
        tracing::warn!("processes of the submission did not die within 2 s of SIGKILL");
    }
}

/// `F_SETOWN_EX` (include/uapi/asm-generic/fcntl.h), `FIOSETOWN` and `SIOCSPGRP`
/// (include/uapi/asm-generic/sockios.h): the same numbers on x86-64 and aarch64; the libc crate
/// does not export them for every target.
const F_SETOWN_EX: u32 = 15;
const FIOSETOWN: u32 = 0x8901;
const SIOCSPGRP: u32 = 0x8902;

/// One condition on a 32-bit argument (pids and commands: the kernel reads only the low half
/// of the register, so the filter must not compare the high half an attacker controls).
fn arg_is(arg: u8, value: u32) -> Result<SeccompCondition, BackendError> {
    SeccompCondition::new(
        arg,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Eq,
        u64::from(value),
    )
}

/// Rules matching when argument `arg` is any of `values`.
fn any_of(arg: u8, values: &[u32]) -> Result<Vec<SeccompRule>, BackendError> {
    values
        .iter()
        .map(|v| SeccompRule::new(vec![arg_is(arg, *v)?]))
        .collect()
}

/// The rules of [`submission_filter`] for a runner with pid `me` in process group `group`.
fn rules(me: u32, group: u32) -> Result<BTreeMap<i64, Vec<SeccompRule>>, BackendError> {
    let minus = |v: u32| v.wrapping_neg();
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    // kill(me), kill(-1), kill(-group).
    let mut kill_targets = vec![me, u32::MAX];
    if group > 0 {
        kill_targets.push(minus(group));
    }
    rules.insert(libc::SYS_kill, any_of(0, &kill_targets)?);
    for call in [
        libc::SYS_tgkill,
        libc::SYS_rt_sigqueueinfo,
        libc::SYS_rt_tgsigqueueinfo,
        libc::SYS_pidfd_open,
    ] {
        rules.insert(call, any_of(0, &[me])?);
    }
    rules.insert(libc::SYS_tkill, Vec::new());
    rules.insert(libc::SYS_pidfd_send_signal, Vec::new());
    let mut fcntl = Vec::new();
    for owner in [me, minus(group)].into_iter().filter(|o| *o != 0) {
        fcntl.push(SeccompRule::new(vec![
            arg_is(1, libc::F_SETOWN as u32)?,
            arg_is(2, owner)?,
        ])?);
    }
    fcntl.push(SeccompRule::new(vec![arg_is(1, F_SETOWN_EX)?])?);
    rules.insert(libc::SYS_fcntl, fcntl);
    // Changing another process's limits, priority, CPUs or scheduling needs only the same uid
    // (not ptrace access): a submission could starve the runner or take its descriptors away
    // (RLIMIT_NOFILE 0: no result.json). Only the caller's own (pid 0) stays allowed.
    for (call, pid_arg) in [
        (libc::SYS_prlimit64, 0),
        (libc::SYS_setpriority, 1),
        (libc::SYS_ioprio_set, 1),
        (libc::SYS_sched_setaffinity, 0),
        (libc::SYS_sched_setscheduler, 0),
        (libc::SYS_sched_setparam, 0),
        (libc::SYS_sched_setattr, 0),
    ] {
        rules.insert(
            call,
            vec![SeccompRule::new(vec![SeccompCondition::new(
                pid_arg,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::Ne,
                0,
            )?])?],
        );
    }
    // FIOSETOWN and SIOCSPGRP name a SIGIO owner too (through a pointer: refused whole).
    rules.insert(libc::SYS_ioctl, any_of(1, &[FIOSETOWN, SIOCSPGRP])?);
    Ok(rules)
}

/// The seccomp program every harness process gets (see the module's documentation): built
/// before the spawn, from this process's pid and process group.
pub fn submission_filter() -> Result<seccompiler::BpfProgram, String> {
    let me = rustix::process::getpid().as_raw_nonzero().get() as u32;
    // 0 when the group is led from outside the namespace: then no kill(-group) can name it.
    let group = kernelkite_sys::raw::process_group_in_namespace().max(0) as u32;
    let build = || -> Result<seccompiler::BpfProgram, BackendError> {
        let arch: seccompiler::TargetArch = std::env::consts::ARCH.try_into()?;
        SeccompFilter::new(
            rules(me, group)?,
            SeccompAction::Allow,
            SeccompAction::Errno(libc::EPERM as u32),
            arch,
        )?
        .try_into()
    };
    build().map_err(|e| format!("cannot build the harness's system-call filter: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_identity_is_used_only_with_the_capabilities_to_switch() {
        let all = EVALUATOR_CAPABILITY_MASK;
        assert_eq!(submission_identity(None, 0, 1000), Ok(None));
        assert_eq!(submission_identity(Some(""), all, 1000), Ok(None));
        assert_eq!(
            submission_identity(Some("1960000001:1960000001"), all, 1950000001),
            Ok(Some(Ids {
                uid: 1960000001,
                gid: 1960000001
            }))
        );
        let without_kill = all & !(1 << 5);
        let e = submission_identity(Some("7:7"), without_kill, 1000).unwrap_err();
        assert!(
            e.contains("lacks the capabilities") && e.contains("CAP_KILL"),
            "{e}"
        );
        let e = submission_identity(Some("1000:1000"), all, 1000).unwrap_err();
        assert!(e.contains("the runner's own"), "{e}");
        let e = submission_identity(Some("0:0"), all, 1000).unwrap_err();
        assert!(e.contains("not uid:gid"), "{e}");
    }

    #[test]
    fn only_a_namespace_other_than_the_host_s_counts() {
        assert!(!names_a_nested_namespace("pid:[4026531836]"));
        assert!(names_a_nested_namespace("pid:[4026532301]"));
        assert!(!names_a_nested_namespace(""));
    }

    #[test]
    fn a_test_process_is_never_at_the_top_of_a_job_namespace() {
        // Its parent is the test harness, not a namespace's init.
        assert!(!at_top_of_job_namespace(Path::new("/proc")));
    }

    /// With a submission identity, the harness process runs as it, with no capability left in
    /// any set but the bounding set (which only an exec with file capabilities, refused under
    /// `no_new_privs`, could use). Needs root, which may switch to any id.
    #[test]
    fn a_harness_runs_as_the_submission_identity_without_capabilities() {
        if !rustix::process::geteuid().is_root() {
            kernelkite_testkit_leaf::skip("needs root to switch to another uid");
            return;
        }
        let ids = Ids {
            uid: 1_960_000_042,
            gid: 1_960_000_042,
        };
        let mut cmd = std::process::Command::new("sh");
        cmd.args([
            "-c",
            "id -u; id -g; grep -E '^Cap(Eff|Prm|Inh|Amb)' /proc/self/status",
        ]);
        kernelkite_sys::raw::harden_before_exec(&mut cmd, submission_filter().unwrap(), Some(ids));
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}");
        assert!(text.starts_with("1960000042\n1960000042\n"), "{text}");
        for set in ["CapEff", "CapPrm", "CapInh", "CapAmb"] {
            assert!(
                text.contains(&format!("{set}:\t0000000000000000")),
                "{set}: {text}"
            );
        }
    }

    /// A child under the filter cannot signal this process, by pid, by `-1` or by its group
    /// (signal 0: the permission check only), while signalling itself still works.
    #[test]
    fn a_filtered_child_cannot_signal_its_evaluator() {
        let filter = submission_filter().unwrap();
        let me = std::process::id();
        let script = format!(
            "for t in {me} -1 -$(ps -o pgid= -p {me} | tr -d ' '); do \
               if kill -0 -- $t 2>/dev/null; then echo \"ESCAPED $t\"; else echo \"blocked $t\"; fi; done; \
             if renice -n 1 -p {me} >/dev/null 2>&1; then echo \"ESCAPED renice\"; else echo \"blocked renice\"; fi; \
             kill -0 $$ && echo self-ok"
        );
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", &script]);
        kernelkite_sys::raw::harden_before_exec(&mut cmd, filter, None);
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(!text.contains("ESCAPED"), "{text}");
        assert_eq!(text.matches("blocked").count(), 4, "{text}");
        assert!(text.contains("self-ok"), "{text}");
    }
}
