//! The system calls no crate covers safely, in one place, each `unsafe` block with its
//! `// SAFETY:` argument. Everything else goes through `rustix`.
//!
//! What is here and why:
//! * code that runs in a child between `fork` and `exec` (std's `pre_exec` is `unsafe` by
//!   design: only async-signal-safe calls, no allocation);
//! * `clone3` with `CLONE_INTO_CGROUP`, which neither std, rustix nor nix offers;
//! * `close_range`, `unshare` and the interface-flags `ioctl` used in those children;
//! * running a set-up closure that may do anything (allocate, read files) in the child of a
//!   single-threaded process, between fork (or `clone3`) and exec: the sandbox's set-up;
//! * `unshare` of the sandbox's mount, IPC and network namespaces, and marking every inherited
//!   descriptor close-on-exec before the job is executed;
//! * `getrusage` of waited-for children (benchmarks tell CPU cost from waiting);
//! * glibc's own version string (Python's `platform.platform()` names it).

use std::ffi::{c_char, CStr, CString};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};

/// Spawns `cmd` as the leader of a new session (so of a new process group) that inherits, of
/// all the parent's descriptors, only stdio and `inherit` (placed at the given number).
///
/// Descriptors a parent of ours leaked without `CLOEXEC` are marked close-on-exec in the
/// child (not closed, which keeps std's own exec-error pipe working); kernels before 5.11
/// lack that flag, and ours are `CLOEXEC` regardless. `cmd` is consumed so that the set-up,
/// which refers to `inherit` by number, can never run again after the borrow ends.
pub fn spawn_in_new_session(
    mut cmd: Command,
    inherit: Option<(BorrowedFd<'_>, RawFd)>,
) -> io::Result<Child> {
    let inherit = inherit.map(|(fd, at)| (fd.as_raw_fd(), at));
    let first_unkept = match inherit {
        Some((_, at)) => at + 1,
        None => 3,
    };
    let setup = move || -> io::Result<()> {
        rustix::process::setsid()?;
        if let Some((fd, at)) = inherit {
            if fd == at {
                // SAFETY: `fd` is open in the child: the parent borrowed it for the whole
                // spawn, and the child's descriptor table is a copy of the parent's.
                let fd = unsafe { BorrowedFd::borrow_raw(fd) };
                rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::empty())?;
            } else {
                // SAFETY: dup2 takes two integers and touches no memory; `fd` is open (see
                // above) and `at` is replaced, which is the point.
                if unsafe { libc::dup2(fd, at) } < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
        }
        const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
        // SAFETY: close_range with CLOSE_RANGE_CLOEXEC only sets a flag on descriptors at or
        // above `first_unkept`; it touches no memory. Its failure (old kernel) is harmless.
        unsafe {
            libc::syscall(
                libc::SYS_close_range,
                first_unkept as libc::c_uint,
                libc::c_uint::MAX,
                CLOSE_RANGE_CLOEXEC,
            );
        }
        Ok(())
    };
    // SAFETY: `setup` runs between fork and exec and only makes async-signal-safe system calls
    // (setsid, fcntl, dup2, close_range) on integers captured by value; it allocates nothing
    // (rustix's and io::Error's errors from raw OS codes do not allocate).
    unsafe {
        cmd.pre_exec(setup);
    }
    cmd.spawn()
}

/// Makes `cmd`'s child write its own pid into each of `procs` (cgroup `cgroup.procs` files,
/// opened by the caller) and, when `isolate_network` is set, enter a new network namespace
/// with only loopback up, between `fork` and `exec`: not one instruction of the command runs
/// outside them. The files move into `cmd` and are closed with it (they are close-on-exec).
pub fn join_before_exec(cmd: &mut Command, procs: Vec<File>, isolate_network: bool) {
    let setup = move || -> io::Result<()> {
        let mut buf = [0u8; 12];
        let me = rustix::process::getpid().as_raw_nonzero().get() as u32;
        let pid = format_pid(me, &mut buf);
        for file in &procs {
            rustix::io::write(file, pid)?;
        }
        if isolate_network {
            enter_new_network_namespace()?;
        }
        Ok(())
    };
    // SAFETY: `setup` runs between fork and exec and only makes async-signal-safe system calls
    // (getpid, write, unshare, socket, ioctl, close) on descriptors it owns and a stack
    // buffer; it allocates nothing.
    unsafe {
        cmd.pre_exec(setup);
    }
}

/// A seccomp program refusing (`EPERM`) every system call of the x32 ABI: on x86-64 their
/// numbers are the 64-bit ABI's with bit 30 set (and some have numbers of their own, 512 and
/// up), under the same audit architecture, so a filter keyed on 64-bit numbers would let them
/// through on a kernel built with `CONFIG_X86_X32_ABI`. Installed beside every filter that
/// refuses calls by number (the sandbox's, the evaluator's). Empty elsewhere (aarch64 has no
/// second ABI under its audit architecture).
pub fn x32_refusal() -> seccompiler::BpfProgram {
    use seccompiler::sock_filter;
    if !cfg!(target_arch = "x86_64") {
        return Vec::new();
    }
    // linux/filter.h and linux/seccomp.h; struct seccomp_data has nr at 0, arch at 4.
    const LD_W_ABS: u16 = 0x20;
    const JEQ_K: u16 = 0x15;
    const JGE_K: u16 = 0x35;
    const RET_K: u16 = 0x06;
    const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
    const X32_SYSCALL_BIT: u32 = 0x4000_0000;
    const RET_ERRNO: u32 = 0x0005_0000;
    const RET_ALLOW: u32 = 0x7fff_0000;
    let op = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    vec![
        op(LD_W_ABS, 0, 0, 4),
        op(JEQ_K, 0, 3, AUDIT_ARCH_X86_64),
        op(LD_W_ABS, 0, 0, 0),
        op(JGE_K, 0, 1, X32_SYSCALL_BIT),
        op(RET_K, 0, 0, RET_ERRNO | libc::EPERM as u32),
        op(RET_K, 0, 0, RET_ALLOW),
    ]
}

/// Has `cmd`'s child, just before `exec`: become `submission` if given (ambient capabilities
/// cleared, gid then uid set, real, effective and saved, then every capability dropped: the
/// caller needs `CAP_SETUID` and `CAP_SETGID`, see [`crate::identity`]), give up the parent's
/// non-dumpable state (exec would anyway), raise its own OOM score to the maximum
/// (`/proc/self/oom_score_adj` = 1000: when the job's memory runs out, the kernel kills the
/// child, not the parent), and install `filter`, a compiled seccomp program (and
/// [`x32_refusal`]), which holds for it and everything it starts. The evaluator uses it to
/// run a submission that cannot signal the evaluator (its uid, and its filter).
pub fn harden_before_exec(
    cmd: &mut Command,
    filter: seccompiler::BpfProgram,
    submission: Option<crate::identity::Ids>,
) {
    let x32 = x32_refusal();
    let setup = move || -> io::Result<()> {
        match submission {
            Some(ids) => become_without_capabilities(ids)?,
            // Whatever ambient capabilities the parent holds do not pass to the child's program
            // (a kernel without ambient capabilities answers EINVAL: there are none).
            None => {
                let _ = rustix::thread::clear_ambient_capability_set();
            }
        }
        rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::Dumpable)?;
        if let Ok(fd) = rustix::fs::open(
            c"/proc/self/oom_score_adj",
            rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        ) {
            // Best effort: a /proc without the file (or read-only) leaves the score as it is.
            let _ = rustix::io::write(&fd, b"1000");
        }
        apply_filters(&[&x32, &filter])
    };
    // SAFETY: `setup` runs between fork and exec and makes only async-signal-safe system calls
    // (prctl, setresgid, setresuid, capset, open, write, close, seccomp) on a constant path,
    // plain integers and the program it owns, which was built before the fork; it allocates
    // nothing (an error from a raw OS code does not allocate). rustix's credential calls are
    // the raw per-thread system calls, and the forked child has one thread.
    unsafe {
        cmd.pre_exec(setup);
    }
}

/// The calling thread becomes `ids` with no capability left in any set (the bounding set
/// stays as it is; `no_new_privs`, which the sandbox sets, keeps an exec from refilling the
/// others). Between a non-root uid and another, `setresuid` keeps capabilities, so they are
/// dropped explicitly after it.
fn become_without_capabilities(ids: crate::identity::Ids) -> io::Result<()> {
    use rustix::process::{Gid, Uid};
    use rustix::thread::{CapabilitySet, CapabilitySets};
    rustix::thread::clear_ambient_capability_set()?;
    let gid = Gid::from_raw(ids.gid);
    rustix::thread::set_thread_res_gid(gid, gid, gid)?;
    let uid = Uid::from_raw(ids.uid);
    rustix::thread::set_thread_res_uid(uid, uid, uid)?;
    rustix::thread::set_capabilities(
        None,
        CapabilitySets {
            effective: CapabilitySet::empty(),
            permitted: CapabilitySet::empty(),
            inheritable: CapabilitySet::empty(),
        },
    )?;
    Ok(())
}

/// This process's process group as its own PID namespace numbers it: 0 when the group's
/// leader lives outside the namespace (a job's command, whose group the hook leads), where
/// rustix's `getpgrp` would assert.
pub fn process_group_in_namespace() -> i32 {
    // SAFETY: getpgrp takes nothing, touches no memory and cannot fail.
    unsafe { libc::getpgrp() }
}

/// Kills (`SIGKILL`) every other process of this PID namespace that this one may signal, with
/// `kill(-1)`, and reaps those that are its children (all of them, for a namespace's init or a
/// child subreaper), again until none is left or `within` has passed (a process stuck in the
/// kernel). One `kill(-1)` reaches every process at once, and the kernel refuses a `fork` to a
/// process with a fatal signal pending, so no chain of forks escapes it. For the sandbox's
/// init and the evaluator at the top of the job's namespace only: outside a namespace of its
/// own it would kill every process of this user on the machine. Returns whether none is left.
pub fn kill_all_others(within: std::time::Duration) -> bool {
    let deadline = std::time::Instant::now() + within;
    loop {
        // SAFETY: kill takes two integers and touches no memory of this process.
        let signalled = unsafe { libc::kill(-1, libc::SIGKILL) } == 0;
        while let Ok(Some(_)) = rustix::process::wait(rustix::process::WaitOptions::NOHANG) {}
        // ESRCH: nothing left to signal (a zombie still counts until it is reaped).
        if !signalled {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::yield_now();
    }
}

/// Installs seccomp `programs` on the calling thread, in order, skipping empty ones (the
/// x32 program where there is no x32). Allocates nothing, so a child may call it between
/// fork and exec on programs built before the fork.
pub fn apply_filters(programs: &[&seccompiler::BpfProgram]) -> io::Result<()> {
    for program in programs.iter().filter(|p| !p.is_empty()) {
        seccompiler::apply_filter(program).map_err(|e| match e {
            seccompiler::Error::Seccomp(io) | seccompiler::Error::Prctl(io) => io,
            _ => io::Error::from_raw_os_error(libc::EINVAL),
        })?;
    }
    Ok(())
}

/// Work a child does between fork (or `clone3`) and exec: see [`spawn_with_setup`].
pub type ChildSetup = Box<dyn FnMut() -> io::Result<()> + Send + Sync>;

/// Whether this process has exactly one thread (`/proc/self/task`).
pub fn is_single_threaded() -> bool {
    std::fs::read_dir("/proc/self/task").is_ok_and(|d| d.count() == 1)
}

fn require_single_thread() -> io::Result<()> {
    if is_single_threaded() {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "a child set-up that may allocate needs a single-threaded parent, and this process has other threads",
        ))
    }
}

/// Spawns `cmd` with `setup` run in the child between fork and exec, after whatever set-up
/// `cmd` already has (joining cgroups). Unlike a bare `pre_exec` closure, `setup` may do what
/// any program does (allocate, read files, format messages): this process is single-threaded,
/// checked right here before the fork, so no other thread can hold a lock (the allocator's,
/// stdio's) that the child would inherit held; glibc's `fork` also re-initialises the
/// allocator's locks in the child. Refuses (spawning nothing) when there are other threads.
pub fn spawn_with_setup(cmd: &mut Command, setup: ChildSetup) -> io::Result<Child> {
    require_single_thread()?;
    // SAFETY: the closure runs in the forked child of a process that had one thread at the
    // fork (checked above, on the thread that forks: no thread can start in between), so
    // every lock in the copied address space is free and the child may run ordinary code.
    unsafe {
        cmd.pre_exec(setup);
    }
    cmd.spawn()
}

/// Formats a pid into `buf` without allocating (this runs after `fork`).
pub fn format_pid(mut pid: u32, buf: &mut [u8; 12]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (pid % 10) as u8;
        pid /= 10;
        if pid == 0 {
            break;
        }
    }
    &buf[i..]
}

/// Moves the calling process into a new network namespace and brings its `lo` up. Meant for
/// a child about to `exec` (it is async-signal-safe).
fn enter_new_network_namespace() -> io::Result<()> {
    // SAFETY: unshare(CLONE_NEWNET) changes which network stack this thread sees; it shares no
    // memory and breaks no invariant of the Rust runtime. It runs in a single-threaded child.
    unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNET) }?;
    loopback_up()
}

/// Moves the calling thread into new namespaces: mount (with `mount`), IPC (`ipc`) and network
/// (`net`, with `lo` brought up). Meant for a single-threaded process about to set up a view
/// of the machine and `exec` (the sandbox helper); on a multi-threaded one the kernel refuses
/// a new mount namespace.
pub fn unshare_namespaces(mount: bool, ipc: bool, net: bool) -> io::Result<()> {
    use rustix::thread::UnshareFlags;
    let mut flags = UnshareFlags::empty();
    if mount {
        flags |= UnshareFlags::NEWNS;
    }
    if ipc {
        flags |= UnshareFlags::NEWIPC;
    }
    if net {
        flags |= UnshareFlags::NEWNET;
    }
    if flags.is_empty() {
        return Ok(());
    }
    // SAFETY: rustix marks unshare unsafe for CLONE_FILES only (a thread could then see
    // descriptors another thread does not); these flags never include it. New mount, IPC and
    // network namespaces change what this thread sees of the machine, not its memory.
    unsafe { rustix::thread::unshare_unsafe(flags) }?;
    if net {
        loopback_up()?;
    }
    Ok(())
}

/// Moves the calling process's future children into a new PID namespace: the next child it
/// forks is that namespace's pid 1, and the namespace ends (every process in it killed) when
/// that child exits; a fork after that fails. The caller itself stays where it is. The
/// `command` hook calls it just before it spawns the job.
pub fn unshare_pid_namespace() -> io::Result<()> {
    // SAFETY: CLONE_NEWPID changes only which PID namespace this process's later children are
    // born in; it touches no memory and breaks no invariant of the Rust runtime.
    unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWPID) }?;
    Ok(())
}

/// Who goes on after [`fork_single_threaded`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forked {
    /// The parent, with the child's pid.
    Parent(rustix::process::Pid),
    /// The child.
    Child,
}

/// `fork(2)` for a process with exactly one thread (checked first, as
/// [`spawn_with_setup`] does): the child is a whole copy and may run ordinary code. The
/// sandbox's init uses it to start the job's command below itself.
pub fn fork_single_threaded() -> io::Result<Forked> {
    require_single_thread()?;
    // SAFETY: this process has one thread (checked just above, on the thread that forks), so
    // the child inherits no lock held by a thread it lacks and may allocate and run any code.
    let rc = unsafe { libc::fork() };
    match rc {
        0 => Ok(Forked::Child),
        n if n > 0 => rustix::process::Pid::from_raw(n)
            .map(Forked::Parent)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ECHILD)),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Closes every descriptor from `first` up. For a forked copy that goes on without `exec`
/// (the sandbox's init): it must not keep pipes open whose end of file tells the hook that
/// the job's command was executed.
pub fn close_from(first: RawFd) {
    close_range(first.max(0), RawFd::MAX);
}

/// Closes the descriptors `first..=last` (`close_range`; one by one, up to the soft limit on
/// open files, where the kernel lacks it: before 5.9).
pub fn close_range(first: RawFd, last: RawFd) {
    if first > last || first < 0 {
        return;
    }
    // SAFETY: close_range closes descriptors in the range; the caller owns every one of them
    // (a forked copy whose Rust objects for them are never used again).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            first as libc::c_uint,
            last as libc::c_uint,
            0 as libc::c_uint,
        )
    };
    if rc != 0 {
        let max = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(1024)
            .min(1 << 20) as RawFd;
        for fd in first..=last.min(max) {
            // SAFETY: as above; a number not open fails with EBADF, ignored.
            unsafe { libc::close(fd) };
        }
    }
}

/// Ends this process at once with `code`, running no destructor and no `atexit` handler: for
/// a forked copy, whose parent's state must not be torn down twice.
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit ends the process; nothing of this address space is used afterwards.
    unsafe { libc::_exit(code) }
}

/// Has the kernel send `signal` to this process when its parent dies (`PR_SET_PDEATHSIG`).
/// A PID namespace's init gets it even though it ignores other signals without a handler:
/// the sender (the dying parent) lives in an ancestor namespace.
pub fn die_with_parent(signal: rustix::process::Signal) -> io::Result<()> {
    rustix::process::set_parent_process_death_signal(Some(signal))?;
    Ok(())
}

/// Marks every descriptor from `first` up close-on-exec, so that a program about to `exec`
/// hands on only what it means to (stdio, and below `first`). Kernels before 5.11 lack the
/// flag; there the descriptors are marked one by one from `/proc/self/fd`.
pub fn cloexec_from(first: RawFd) -> io::Result<()> {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    let first = first.max(0);
    // SAFETY: close_range with CLOSE_RANGE_CLOEXEC only sets a flag on descriptors at or above
    // `first`; it touches no memory.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            first as libc::c_uint,
            libc::c_uint::MAX,
            CLOSE_RANGE_CLOEXEC,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let listed: Vec<RawFd> = std::fs::read_dir("/proc/self/fd")?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|&fd| fd >= first)
        .collect();
    for fd in listed {
        // SAFETY: F_GETFD/F_SETFD only read and set the flags of `fd`; a number that closed
        // since the listing (the listing's own directory descriptor) fails harmlessly.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 {
                libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
    Ok(())
}

/// Makes the mount at `path` and every mount below it read-only with one `mount_setattr(2)`
/// (`AT_RECURSIVE`), leaving their other flags as they are. Linux 5.12+: older kernels answer
/// `ENOSYS`, and the caller remounts each mount instead.
pub fn make_tree_read_only(path: &std::path::Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt as _;
    let path = CString::new(path.as_os_str().as_bytes())?;
    set_read_only(libc::AT_FDCWD, &path, libc::AT_RECURSIVE as libc::c_uint)
}

/// The same for a detached mount tree (`open_tree(2)` with `OPEN_TREE_CLONE`), before it is
/// attached anywhere: what is attached from it is read-only from the start. Linux 5.12+.
pub fn make_detached_read_only(tree: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
    use std::os::fd::AsRawFd as _;
    set_read_only(
        tree.as_raw_fd(),
        c"",
        (libc::AT_RECURSIVE | libc::AT_EMPTY_PATH) as libc::c_uint,
    )
}

/// `mount_setattr(dirfd, path, flags, {attr_set: MOUNT_ATTR_RDONLY})`.
fn set_read_only(dirfd: libc::c_int, path: &std::ffi::CStr, flags: libc::c_uint) -> io::Result<()> {
    // `struct mount_attr`, MOUNT_ATTR_SIZE_VER0 (32 bytes).
    #[repr(C)]
    struct MountAttr {
        attr_set: u64,
        attr_clr: u64,
        propagation: u64,
        userns_fd: u64,
    }
    const MOUNT_ATTR_RDONLY: u64 = 0x1;
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_RDONLY,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: `path` is NUL-terminated and `attr` is a `mount_attr` of the size passed; both
    // outlive the call, and the kernel only reads them.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            dirfd,
            path.as_ptr(),
            flags,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Brings up `lo` in the current network namespace (a new namespace starts with it down).
pub fn loopback_up() -> io::Result<()> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let sock = rustix::net::socket_with(
        AddressFamily::INET,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    // SAFETY: ifreq is plain old data, for which all zero bytes are a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *d = *s as c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads the interface named in `req` and writes its flags into the
    // ifreq we pass, which lives on this stack frame.
    let mut rc = unsafe {
        libc::ioctl(
            sock.as_raw_fd(),
            libc::SIOCGIFFLAGS as libc::Ioctl,
            &mut req,
        )
    };
    if rc == 0 {
        // SAFETY: SIOCGIFFLAGS succeeded, so `ifru_flags` is the union member it wrote.
        unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
        // SAFETY: SIOCSIFFLAGS only reads the ifreq we pass.
        rc = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS as libc::Ioctl, &req) };
    }
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// What `clone3_into_cgroup` should execute: everything built before the clone, since the
/// child may not allocate.
#[derive(Debug)]
pub struct Exec<'a> {
    /// The program's path (already looked up on `PATH`).
    pub path: &'a CStr,
    /// `argv`, the program name first.
    pub argv: &'a [CString],
    /// The whole environment, as `KEY=value` strings.
    pub envp: &'a [CString],
}

/// `struct clone_args` of clone3(2), up to `cgroup` (CLONE_ARGS_SIZE_VER2).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// Starts `exec` with `clone3(CLONE_INTO_CGROUP)` inside the cgroup v2 directory `cgroup`
/// (an open directory): the child is born there, so no task is migrated (a migration waits
/// for an RCU grace period, ~10 ms). With `isolate_network` it first enters a new network
/// namespace with only loopback up.
///
/// `Ok(Some(pid))` once the program has been executed; `Ok(None)` when the kernel or the
/// directory does not support it (old kernel, not cgroup2, no permission): the caller falls
/// back to an ordinary spawn. When the child could not `exec`, it is reaped and its error
/// returned.
pub fn clone3_into_cgroup(
    exec: &Exec<'_>,
    cgroup: BorrowedFd<'_>,
    isolate_network: bool,
) -> io::Result<Option<u32>> {
    clone3_into_cgroup_inner(exec, cgroup, isolate_network, None)
}

/// [`clone3_into_cgroup`] with `setup` run in the child before it executes the program, as
/// [`spawn_with_setup`] does after a fork (and on the same condition: this process is
/// single-threaded, checked before the clone; an error otherwise). `setup` is borrowed, so a
/// caller whose kernel answers `Ok(None)` can hand it to [`spawn_with_setup`] instead.
pub fn clone3_into_cgroup_with_setup(
    exec: &Exec<'_>,
    cgroup: BorrowedFd<'_>,
    setup: &mut ChildSetup,
) -> io::Result<Option<u32>> {
    require_single_thread()?;
    clone3_into_cgroup_inner(exec, cgroup, false, Some(setup))
}

fn clone3_into_cgroup_inner(
    exec: &Exec<'_>,
    cgroup: BorrowedFd<'_>,
    isolate_network: bool,
    setup: Option<&mut ChildSetup>,
) -> io::Result<Option<u32>> {
    let mut argv: Vec<*const c_char> = exec.argv.iter().map(|c| c.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const c_char> = exec.envp.iter().map(|c| c.as_ptr()).collect();
    envp.push(std::ptr::null());
    let (rd, wr) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let args = CloneArgs {
        flags: CLONE_INTO_CGROUP,
        exit_signal: libc::SIGCHLD as u64,
        cgroup: cgroup.as_raw_fd() as u64,
        ..Default::default()
    };
    // SAFETY: clone3 without CLONE_VM and without a new stack behaves like fork: the child
    // gets a copy of this address space. It runs `exec_child` only, which makes
    // async-signal-safe calls on data prepared above and then execs or exits; or, given a
    // `setup`, first runs it, which the public callers allow only in a single-threaded
    // process (no lock can be held by a thread the child lacks).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &args as *const CloneArgs,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if rc == 0 {
        exec_child(exec.path, &argv, &envp, wr.as_fd(), isolate_network, setup);
    }
    drop(wr);
    if rc < 0 {
        let err = io::Error::last_os_error();
        return match err.raw_os_error() {
            Some(
                libc::ENOSYS
                | libc::EINVAL
                | libc::EBADF
                | libc::EOPNOTSUPP
                | libc::E2BIG
                | libc::EPERM
                | libc::EACCES,
            ) => Ok(None),
            _ => Err(err),
        };
    }
    let pid = rc as u32;
    // EOF means the exec succeeded (the pipe is close-on-exec); 4 bytes are the child's errno.
    let mut buf = [0u8; 4];
    let n = loop {
        match rustix::io::read(&rd, &mut buf) {
            Err(rustix::io::Errno::INTR) => continue,
            other => break other,
        }
    };
    if let Ok(4) = n {
        if let Some(child) = rustix::process::Pid::from_raw(pid as i32) {
            let _ = rustix::process::waitpid(Some(child), rustix::process::WaitOptions::empty());
        }
        return Err(io::Error::from_raw_os_error(i32::from_ne_bytes(buf)));
    }
    Ok(Some(pid))
}

/// The child's side of [`clone3_into_cgroup`]: never returns.
fn exec_child(
    path: &CStr,
    argv: &[*const c_char],
    envp: &[*const c_char],
    report: BorrowedFd<'_>,
    isolate_network: bool,
    setup: Option<&mut ChildSetup>,
) -> ! {
    let fail = |errno: i32| -> ! {
        let _ = rustix::io::write(report, &errno.to_ne_bytes());
        // SAFETY: _exit ends this child without running the parent's atexit handlers or
        // destructors, which must not run twice.
        unsafe { libc::_exit(127) }
    };
    if isolate_network {
        if let Err(e) = enter_new_network_namespace() {
            fail(e.raw_os_error().unwrap_or(libc::EIO));
        }
    }
    if let Some(setup) = setup {
        if let Err(e) = setup() {
            fail(e.raw_os_error().unwrap_or(libc::EIO));
        }
    }
    // SAFETY: `path` is NUL-terminated, and `argv` and `envp` are NULL-terminated arrays of
    // pointers to NUL-terminated strings that the parent keeps alive (this is its copy).
    unsafe { libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
    fail(
        io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO),
    )
}

/// CPU time (user + system) used so far by this process's children that have been waited for
/// (and their waited-for descendants): `getrusage(RUSAGE_CHILDREN)`. Benchmarks difference it
/// around a child to tell its CPU cost from the time it spent waiting for a busy machine.
pub fn children_cpu_time() -> io::Result<std::time::Duration> {
    // SAFETY: rusage is plain old data, for which all zero bytes are a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes one rusage into the struct we pass, which lives on this frame.
    if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let tv = |t: libc::timeval| {
        std::time::Duration::from_secs(t.tv_sec.max(0) as u64)
            + std::time::Duration::from_micros(t.tv_usec.max(0) as u64)
    };
    Ok(tv(usage.ru_utime) + tv(usage.ru_stime))
}

/// glibc's version (`2.36`), as Python's `platform.libc_ver()` reports it; `None` on other
/// C libraries.
pub fn glibc_version() -> Option<String> {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: gnu_get_libc_version returns a pointer to a static NUL-terminated string.
        let v = unsafe { CStr::from_ptr(libc::gnu_get_libc_version()) };
        Some(v.to_string_lossy().into_owned())
    }
    #[cfg(not(target_env = "gnu"))]
    {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn pids_format_without_allocation() {
        let mut b = [0u8; 12];
        assert_eq!(format_pid(0, &mut b), b"0");
        let mut b = [0u8; 12];
        assert_eq!(format_pid(4_194_304, &mut b), b"4194304");
        let mut b = [0u8; 12];
        assert_eq!(format_pid(u32::MAX, &mut b), b"4294967295");
    }

    #[test]
    fn a_new_session_keeps_only_the_given_descriptor() {
        let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            "echo \"$(ps -o sid= -p $$) $$\" >&3; ls /proc/self/fd >&3",
        ])
        .stdout(std::process::Stdio::null());
        let mut child = spawn_in_new_session(cmd, Some((w.as_fd(), 3))).unwrap();
        drop(w);
        let status = child.wait().unwrap();
        assert!(status.success(), "{status:?}");
        let mut out = String::new();
        std::io::Read::read_to_string(&mut File::from(r), &mut out).unwrap();
        let mut lines = out.lines();
        let ids: Vec<&str> = lines.next().unwrap_or("").split_whitespace().collect();
        // A session leader's session id is its pid (when ps is there to say so).
        if ids.len() == 2 {
            assert_eq!(ids[0], ids[1], "{out}");
        }
        let fds: Vec<i32> = lines.filter_map(|l| l.trim().parse().ok()).collect();
        assert!(fds.contains(&3), "{out}");
        assert!(fds.iter().all(|&fd| fd <= 4), "{out}");
    }

    #[test]
    fn the_child_joins_the_procs_files_before_exec() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("cgroup.procs");
        std::fs::write(&f, "").unwrap();
        let mut cmd = Command::new("true");
        join_before_exec(
            &mut cmd,
            vec![File::options().write(true).open(&f).unwrap()],
            false,
        );
        let mut child = cmd.spawn().unwrap();
        let pid = child.id();
        assert!(child.wait().unwrap().success());
        assert_eq!(std::fs::read_to_string(&f).unwrap(), pid.to_string());
    }

    #[test]
    fn clone3_outside_a_cgroup2_directory_is_refused_or_runs() {
        // A plain directory is no cgroup: the kernel refuses CLONE_INTO_CGROUP (or, on an
        // old kernel, clone3 itself), and the caller falls back to an ordinary spawn.
        let dir = tempfile::tempdir().unwrap();
        let d = File::open(dir.path()).unwrap();
        let path = CString::new("/bin/true").unwrap();
        let argv = [CString::new("true").unwrap()];
        let exec = Exec {
            path: &path,
            argv: &argv,
            envp: &[],
        };
        match clone3_into_cgroup(&exec, d.as_fd(), false).unwrap() {
            None => {}
            Some(pid) => {
                let (_, status) = rustix::process::waitpid(
                    rustix::process::Pid::from_raw(pid as i32),
                    rustix::process::WaitOptions::empty(),
                )
                .unwrap()
                .unwrap();
                let status = std::process::ExitStatus::from_raw(status.as_raw());
                assert!(status.success(), "{status:?}");
            }
        }
    }

    #[test]
    fn a_child_set_up_is_refused_in_a_multi_threaded_process() {
        // The test harness runs tests on threads: this process is not single-threaded, so the
        // set-up is refused and nothing is spawned.
        let mut cmd = Command::new("true");
        let refused = spawn_with_setup(&mut cmd, Box::new(|| Ok(())));
        if is_single_threaded() {
            return;
        }
        let e = refused.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::Unsupported, "{e}");
        assert!(e.to_string().contains("single-threaded"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let mut setup: ChildSetup = Box::new(|| Ok(()));
        let path = CString::new("/bin/true").unwrap();
        let argv = [CString::new("true").unwrap()];
        let exec = Exec {
            path: &path,
            argv: &argv,
            envp: &[],
        };
        let d = File::open(dir.path()).unwrap();
        assert!(clone3_into_cgroup_with_setup(&exec, d.as_fd(), &mut setup).is_err());
    }

    /// Runs `body` in a forked child of this (multi-threaded) test process, where it is the
    /// only thread, and returns its exit status.
    fn in_single_threaded_child(body: impl FnOnce() -> i32) -> i32 {
        // SAFETY: the child calls `body` and `_exit`s: it never returns into the test harness.
        // It inherits the test threads' locks in whatever state they were; glibc's fork
        // re-initialises the allocator's, and `body` prints nothing (stdio's lock is the
        // other one a test thread might hold).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", io::Error::last_os_error());
        if pid == 0 {
            let code = body();
            // SAFETY: ends the child without running the harness's destructors twice.
            unsafe { libc::_exit(code) }
        }
        let (_, status) = rustix::process::waitpid(
            rustix::process::Pid::from_raw(pid),
            rustix::process::WaitOptions::empty(),
        )
        .unwrap()
        .unwrap();
        status.exit_status().unwrap_or(-1)
    }

    #[test]
    fn a_single_threaded_parent_s_child_runs_its_set_up_before_exec() {
        let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        let plain = tempfile::tempdir().unwrap();
        // A cgroup2 directory where this is root and one is mounted, else a plain directory
        // (clone3 refuses it and the fork path runs the set-up instead).
        let cgroup2 = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let (left, right) = l.split_once(" - ")?;
                right
                    .starts_with("cgroup2 ")
                    .then(|| left.split_whitespace().nth(4).map(str::to_string))?
            })
            .next()
            .map(|m| {
                std::path::PathBuf::from(m).join(format!("kk-raw-setup-{}", std::process::id()))
            })
            .filter(|d| rustix::process::geteuid().is_root() && std::fs::create_dir(d).is_ok());
        let dir = cgroup2
            .clone()
            .unwrap_or_else(|| plain.path().to_path_buf());
        let w_fd = w.as_raw_fd();
        let code = in_single_threaded_child(|| {
            if !is_single_threaded() {
                return 10;
            }
            let path = CString::new("/bin/true").unwrap();
            let argv = [CString::new("true").unwrap()];
            let exec = Exec {
                path: &path,
                argv: &argv,
                envp: &[],
            };
            let setup = || -> ChildSetup {
                Box::new(move || {
                    // Allocation and formatting, which a bare pre_exec closure could not do.
                    let line = format!("set up in {}\n", std::process::id());
                    // SAFETY: `w_fd` is the pipe's write end, open in this child (inherited).
                    let fd = unsafe { BorrowedFd::borrow_raw(w_fd) };
                    rustix::io::write(fd, line.as_bytes())?;
                    Ok(())
                })
            };
            let Ok(d) = File::open(&dir) else { return 11 };
            let mut first = setup();
            let pid = match clone3_into_cgroup_with_setup(&exec, d.as_fd(), &mut first) {
                Ok(Some(pid)) => pid,
                Ok(None) => match spawn_with_setup(&mut Command::new("/bin/true"), setup()) {
                    Ok(mut child) => {
                        return if child.wait().is_ok_and(|s| s.success()) {
                            0
                        } else {
                            12
                        }
                    }
                    Err(_) => return 13,
                },
                Err(_) => return 14,
            };
            match rustix::process::waitpid(
                rustix::process::Pid::from_raw(pid as i32),
                rustix::process::WaitOptions::empty(),
            ) {
                Ok(Some((_, st))) if st.exit_status() == Some(0) => 0,
                _ => 15,
            }
        });
        if let Some(d) = &cgroup2 {
            let _ = std::fs::remove_dir(d);
        }
        assert_eq!(code, 0);
        drop(w);
        let mut out = String::new();
        std::io::Read::read_to_string(&mut File::from(r), &mut out).unwrap();
        assert!(out.starts_with("set up in "), "{out:?}");
    }

    #[test]
    fn cloexec_from_keeps_only_lower_descriptors_across_exec() {
        // A child marks everything from `high` up, then execs a shell that writes to `low` and
        // tries `high` (a redirection, which opens nothing of its own).
        let (ra, wa) = rustix::pipe::pipe().unwrap();
        let (rb, wb) = rustix::pipe::pipe().unwrap();
        let (low, high) = if wa.as_raw_fd() < wb.as_raw_fd() {
            (wa.as_raw_fd(), wb.as_raw_fd())
        } else {
            (wb.as_raw_fd(), wa.as_raw_fd())
        };
        let report = if low == wa.as_raw_fd() { ra } else { rb };
        // bash, not sh: dash redirects descriptors 0-9 only, and files other tests of this
        // binary hold open meanwhile can push these two past 9.
        let mut cmd = Command::new("bash");
        cmd.args([
            "-c",
            &format!(
                "echo low >&{low}; if (: >&{high}) 2>/dev/null; then echo high-open >&{low}; fi"
            ),
        ]);
        let setup = move || -> io::Result<()> { cloexec_from(high) };
        // SAFETY: close_range is async-signal-safe and allocates nothing when it works, which
        // it does on the kernels this suite runs on (5.11+).
        unsafe { cmd.pre_exec(setup) };
        let status = cmd.status().unwrap();
        assert!(status.success());
        drop(wa);
        drop(wb);
        let mut out = String::new();
        std::io::Read::read_to_string(&mut File::from(report), &mut out).unwrap();
        assert_eq!(out, "low\n");
    }

    #[test]
    fn a_thread_can_move_into_new_ipc_and_network_namespaces() {
        if !rustix::process::geteuid().is_root() {
            kernelkite_testkit_leaf::skip("new namespaces need root");
            return;
        }
        let before = std::fs::read_link("/proc/thread-self/ns/ipc").unwrap();
        // A thread of its own: the namespaces are per thread and die with it.
        let after = std::thread::spawn(|| {
            unshare_namespaces(false, true, true).unwrap();
            (
                std::fs::read_link("/proc/thread-self/ns/ipc").unwrap(),
                std::fs::read_link("/proc/thread-self/ns/net").unwrap(),
            )
        })
        .join()
        .unwrap();
        assert_ne!(before, after.0);
        assert_ne!(
            std::fs::read_link("/proc/thread-self/ns/net").unwrap(),
            after.1
        );
        unshare_namespaces(false, false, false).unwrap();
    }

    /// A tmpfs with another mounted inside it: one call makes both read-only, and they keep
    /// their other flags. On a tmpfs of the test's own (root), unmounted at the end.
    #[test]
    fn a_tree_of_mounts_becomes_read_only_in_one_call() {
        let Some(outer) = kernelkite_testkit_leaf::tmpfs::SmallTmpfs::mount(1 << 20) else {
            return;
        };
        let inner_mount =
            kernelkite_testkit_leaf::tmpfs::SmallTmpfs::mount_in(outer.path(), 64 << 10, "noexec")
                .expect("a tmpfs inside the first");
        let inner = inner_mount.path().to_path_buf();
        let writable = |p: &std::path::Path| std::fs::write(p.join("f"), b"x").is_ok();
        assert!(writable(outer.path()) && writable(&inner));

        match make_tree_read_only(outer.path()) {
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                kernelkite_testkit_leaf::skip("mount_setattr needs Linux 5.12");
                return;
            }
            r => r.unwrap(),
        }
        for p in [outer.path(), inner.as_path()] {
            let e = std::fs::write(p.join("g"), b"x").unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{}", p.display());
        }
        let flags = rustix::fs::statvfs(&inner).unwrap().f_flag;
        assert!(
            flags.contains(rustix::fs::StatVfsMountFlags::NOEXEC),
            "{flags:?}"
        );
    }

    #[test]
    fn a_waited_child_s_cpu_time_is_counted() {
        let before = children_cpu_time().unwrap();
        // A child that burns some CPU: 200,000 shell arithmetic steps.
        let status = Command::new("sh")
            .args(["-c", "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done"])
            .status()
            .unwrap();
        assert!(status.success());
        let used = children_cpu_time().unwrap() - before;
        assert!(used > std::time::Duration::ZERO, "{used:?}");
    }

    #[test]
    fn glibc_names_its_version() {
        if cfg!(target_env = "gnu") {
            let v = glibc_version().unwrap();
            assert!(v.starts_with("2."), "{v}");
        } else {
            assert!(glibc_version().is_none());
        }
    }
}

/// Time since boot, the time the machine (or its VM) was suspended included
/// (`CLOCK_BOOTTIME`): unlike `Instant` (`CLOCK_MONOTONIC`), it has moved on when a process
/// suspended with its machine runs again, which is what a lease measured on it must see.
pub fn boottime() -> std::time::Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we pass, which lives on this stack frame.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    if rc != 0 {
        // Never on Linux (CLOCK_BOOTTIME exists since 2.6.39); the monotonic clock is the
        // next best.
        // SAFETY: as above.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    }
    std::time::Duration::new(
        ts.tv_sec.max(0) as u64,
        ts.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}

#[cfg(test)]
mod boottime_tests {
    #[test]
    fn boottime_moves_forward_with_the_monotonic_clock() {
        let (b, m) = (super::boottime(), std::time::Instant::now());
        std::thread::sleep(std::time::Duration::from_millis(20));
        let (db, dm) = (super::boottime() - b, m.elapsed());
        assert!(db >= std::time::Duration::from_millis(20), "{db:?}");
        assert!(
            db <= dm + std::time::Duration::from_millis(5),
            "{db:?} vs {dm:?}"
        );
    }
}
