//! Starting the step's command already confined: the child joins the job's cgroup(s) and,
//! when asked, a fresh network namespace between `fork` and `exec`, so not one instruction of
//! the command (nor any child it forks) runs outside them.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command};

/// What the child joins before `exec`.
#[derive(Debug, Clone, Default)]
pub struct Confinement {
    /// `cgroup.procs` files of the job's cgroup(s).
    pub procs_files: Vec<PathBuf>,
    /// Run in a new network namespace with only loopback up.
    pub isolate_network: bool,
}

/// A started command.
#[derive(Debug)]
pub enum Started {
    Std(Child),
    /// Created by `clone3` straight into a cgroup v2 directory.
    Raw(u32),
}

impl Started {
    pub fn id(&self) -> u32 {
        match self {
            Started::Std(c) => c.id(),
            Started::Raw(pid) => *pid,
        }
    }

    pub fn wait(&mut self) -> io::Result<std::process::ExitStatus> {
        use std::os::unix::process::ExitStatusExt;
        match self {
            Started::Std(c) => c.wait(),
            Started::Raw(pid) => loop {
                let mut status = 0;
                // SAFETY: waitpid on our own child.
                let rc = unsafe { libc::waitpid(*pid as i32, &mut status, 0) };
                if rc == *pid as i32 {
                    return Ok(std::process::ExitStatus::from_raw(status));
                }
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(err);
                }
            },
        }
    }
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

fn cstring(s: &std::ffi::OsStr) -> io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(s.as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "argument contains a NUL byte"))
}

/// Starts `program args` with exactly `env`, created by `clone3(CLONE_INTO_CGROUP)` inside the
/// cgroup v2 directory `cgroup_dir`: the child is born there, so no task is migrated (a
/// migration waits for an RCU grace period, ~10 ms). `Ok(None)` when the kernel or the
/// directory does not support it (old kernel, not cgroup2, a fake tree): use [`spawn`].
pub fn spawn_into_cgroup2(
    program: &std::ffi::OsStr,
    args: &[std::ffi::OsString],
    env: &std::collections::BTreeMap<String, String>,
    cgroup_dir: &std::path::Path,
    isolate_network: bool,
) -> io::Result<Option<Started>> {
    use std::os::unix::ffi::OsStrExt;
    let dir = match std::fs::File::open(cgroup_dir) {
        Ok(d) => d,
        Err(_) => return Ok(None),
    };
    // Everything the child touches is built before the clone: it may not allocate.
    let path = if program.as_bytes().contains(&b'/') {
        PathBuf::from(program)
    } else {
        let search = env
            .get("PATH")
            .cloned()
            .unwrap_or_else(|| "/usr/bin:/bin".into());
        std::env::split_paths(&search)
            .map(|d| d.join(program))
            .find(|p| p.is_file())
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("{program:?} not found on PATH"),
                )
            })?
    };
    let c_path = cstring(path.as_os_str())?;
    let c_args: Vec<std::ffi::CString> = std::iter::once(program)
        .chain(args.iter().map(|a| a.as_os_str()))
        .map(cstring)
        .collect::<io::Result<_>>()?;
    let c_env: Vec<std::ffi::CString> = env
        .iter()
        .map(|(k, v)| cstring(std::ffi::OsStr::new(&format!("{k}={v}"))))
        .collect::<io::Result<_>>()?;
    let mut argv: Vec<*const libc::c_char> = c_args.iter().map(|c| c.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = c_env.iter().map(|c| c.as_ptr()).collect();
    envp.push(std::ptr::null());
    let mut pipe = [0i32; 2];
    // SAFETY: pipe2 fills two fds.
    if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let (rd, wr) = (pipe[0], pipe[1]);
    let args_struct = CloneArgs {
        flags: CLONE_INTO_CGROUP,
        exit_signal: libc::SIGCHLD as u64,
        cgroup: dir.as_raw_fd() as u64,
        ..Default::default()
    };
    // SAFETY: clone3 with no new stack behaves like fork; the child below only makes
    // async-signal-safe calls on data prepared above, then execs or exits.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &args_struct as *const CloneArgs,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if rc == 0 {
        unsafe {
            let fail = |err: i32| -> ! {
                let bytes = err.to_ne_bytes();
                libc::write(wr, bytes.as_ptr().cast(), bytes.len());
                libc::_exit(127)
            };
            if isolate_network {
                if libc::unshare(libc::CLONE_NEWNET) != 0 {
                    fail(*libc::__errno_location());
                }
                if let Err(e) = loopback_up() {
                    fail(e.raw_os_error().unwrap_or(libc::EIO));
                }
            }
            libc::execve(c_path.as_ptr(), argv.as_ptr(), envp.as_ptr());
            fail(*libc::__errno_location());
        }
    }
    // SAFETY: closing our copy of the write end.
    unsafe { libc::close(wr) };
    if rc < 0 {
        let err = io::Error::last_os_error();
        unsafe { libc::close(rd) };
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
    let mut buf = [0u8; 4];
    // SAFETY: reading up to 4 bytes into a stack buffer; EOF means exec succeeded.
    let n = loop {
        let n = unsafe { libc::read(rd, buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            break n;
        }
    };
    unsafe { libc::close(rd) };
    let mut started = Started::Raw(pid);
    if n == 4 {
        let _ = started.wait();
        return Err(io::Error::from_raw_os_error(i32::from_ne_bytes(buf)));
    }
    Ok(Some(started))
}

/// Formats a pid into `buf` without allocating (this runs after `fork`).
fn format_pid(mut pid: u32, buf: &mut [u8; 12]) -> &[u8] {
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

/// Brings up `lo` in the current network namespace.
fn loopback_up() -> io::Result<()> {
    // SAFETY: a datagram socket and SIOC[GS]IFFLAGS on a zeroed ifreq naming "lo".
    unsafe {
        let sock = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if sock < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut req: libc::ifreq = std::mem::zeroed();
        for (d, s) in req.ifr_name.iter_mut().zip(b"lo\0") {
            *d = *s as libc::c_char;
        }
        let mut rc = libc::ioctl(sock, libc::SIOCGIFFLAGS, &mut req);
        if rc == 0 {
            req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
            rc = libc::ioctl(sock, libc::SIOCSIFFLAGS, &req);
        }
        let err = io::Error::last_os_error();
        libc::close(sock);
        if rc != 0 {
            return Err(err);
        }
    }
    Ok(())
}

/// Spawns `cmd` confined as `c` says. Errors from the child's set-up (a cgroup that refuses
/// the task, no permission for a network namespace) come back from `spawn`.
pub fn spawn(cmd: &mut Command, c: &Confinement) -> io::Result<Child> {
    let files: Vec<File> = c
        .procs_files
        .iter()
        .map(|p| {
            // Fake trees (tests) have no interface files until written; cgroupfs always has.
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(p)
                .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", p.display())))
        })
        .collect::<io::Result<_>>()?;
    let fds: Vec<i32> = files.iter().map(|f| f.as_raw_fd()).collect();
    let isolate_network = c.isolate_network;
    // SAFETY: the closure only makes async-signal-safe system calls on pre-opened fds and a
    // stack buffer; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            let mut buf = [0u8; 12];
            let pid = format_pid(libc::getpid() as u32, &mut buf);
            for &fd in &fds {
                if libc::write(fd, pid.as_ptr().cast(), pid.len()) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            if isolate_network {
                if libc::unshare(libc::CLONE_NEWNET) != 0 {
                    return Err(io::Error::last_os_error());
                }
                loopback_up()?;
            }
            Ok(())
        });
    }
    let child = cmd.spawn();
    drop(files);
    child
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn child_writes_its_own_pid_into_the_procs_files() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("cgroup.procs");
        std::fs::write(&f, "").unwrap();
        let c = Confinement {
            procs_files: vec![f.clone()],
            isolate_network: false,
        };
        let mut child = spawn(Command::new("true").arg(""), &c).unwrap();
        let pid = child.id();
        assert!(child.wait().unwrap().success());
        assert_eq!(std::fs::read_to_string(&f).unwrap(), pid.to_string());
        let missing = Confinement {
            procs_files: vec![dir.path().join("nope/cgroup.procs")],
            isolate_network: false,
        };
        assert!(spawn(&mut Command::new("true"), &missing).is_err());
    }
}
