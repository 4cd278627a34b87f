//! Starting the step's command already confined: the child joins the job's cgroup(s) and,
//! when asked, a fresh network namespace between `fork` and `exec`, so not one instruction of
//! the command (nor any child it forks) runs outside them. The code that runs in the child
//! is [`kernelkite_sys::raw`]'s; this module decides what it gets.

use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};

pub use kernelkite_sys::raw::ChildSetup;

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
    /// Started by std (the child joined its cgroups itself).
    Std(Child),
    /// Created by `clone3` straight into a cgroup v2 directory; the pid.
    Raw(u32),
}

impl Started {
    /// The child's pid.
    pub fn id(&self) -> u32 {
        match self {
            Started::Std(c) => c.id(),
            Started::Raw(pid) => *pid,
        }
    }

    /// Waits for the child to exit.
    pub fn wait(&mut self) -> io::Result<std::process::ExitStatus> {
        use std::os::unix::process::ExitStatusExt;
        match self {
            Started::Std(c) => c.wait(),
            Started::Raw(pid) => {
                let child = i32::try_from(*pid)
                    .ok()
                    .and_then(rustix::process::Pid::from_raw)
                    .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
                loop {
                    match rustix::process::waitpid(
                        Some(child),
                        rustix::process::WaitOptions::empty(),
                    ) {
                        Ok(Some((_, status))) => {
                            return Ok(std::process::ExitStatus::from_raw(status.as_raw()))
                        }
                        Ok(None) => continue,
                        Err(rustix::io::Errno::INTR) => continue,
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
    }
}

fn cstring(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "argument contains a NUL byte"))
}

/// Starts `program args` with exactly `env`, created by `clone3(CLONE_INTO_CGROUP)` inside the
/// cgroup v2 directory `cgroup_dir`: the child is born there, so no task is migrated (a
/// migration waits for an RCU grace period, ~10 ms). `Ok(None)` when the kernel or the
/// directory does not support it (old kernel, not cgroup2, a fake tree): use [`spawn`].
pub fn spawn_into_cgroup2(
    program: &OsStr,
    args: &[OsString],
    env: &std::collections::BTreeMap<String, String>,
    cgroup_dir: &Path,
    isolate_network: bool,
) -> io::Result<Option<Started>> {
    into_cgroup2(program, args, env, cgroup_dir, isolate_network, None)
}

/// [`spawn_into_cgroup2`] with `setup` run in the child before the program (the sandbox): see
/// [`kernelkite_sys::raw::spawn_with_setup`] for when a set-up may do more than a `pre_exec`
/// closure. `Ok(None)` leaves `setup` to the caller for [`spawn_with_setup`].
pub fn spawn_into_cgroup2_with_setup(
    program: &OsStr,
    args: &[OsString],
    env: &std::collections::BTreeMap<String, String>,
    cgroup_dir: &Path,
    setup: &mut ChildSetup,
) -> io::Result<Option<Started>> {
    into_cgroup2(program, args, env, cgroup_dir, false, Some(setup))
}

fn into_cgroup2(
    program: &OsStr,
    args: &[OsString],
    env: &std::collections::BTreeMap<String, String>,
    cgroup_dir: &Path,
    isolate_network: bool,
    setup: Option<&mut ChildSetup>,
) -> io::Result<Option<Started>> {
    let dir = match File::open(cgroup_dir) {
        Ok(d) => d,
        Err(_) => return Ok(None),
    };
    // Everything the child touches is built before the clone: it may not allocate. The
    // program is looked up on the job's PATH, not ours.
    let path = if program.as_bytes().contains(&b'/') {
        PathBuf::from(program)
    } else {
        let search = env
            .get("PATH")
            .cloned()
            .unwrap_or_else(|| "/usr/bin:/bin".into());
        let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
        which::which_in(program, Some(&search), cwd).map_err(|_| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{program:?} not found on PATH"),
            )
        })?
    };
    let c_path = cstring(path.as_os_str())?;
    let argv: Vec<CString> = std::iter::once(program)
        .chain(args.iter().map(|a| a.as_os_str()))
        .map(cstring)
        .collect::<io::Result<_>>()?;
    let envp: Vec<CString> = env
        .iter()
        .map(|(k, v)| cstring(OsStr::new(&format!("{k}={v}"))))
        .collect::<io::Result<_>>()?;
    let exec = kernelkite_sys::raw::Exec {
        path: &c_path,
        argv: &argv,
        envp: &envp,
    };
    let started = match setup {
        Some(setup) => {
            kernelkite_sys::raw::clone3_into_cgroup_with_setup(&exec, dir.as_fd(), setup)?
        }
        None => kernelkite_sys::raw::clone3_into_cgroup(&exec, dir.as_fd(), isolate_network)?,
    };
    Ok(started.map(Started::Raw))
}

/// Spawns `cmd` confined as `c` says. Errors from the child's set-up (a cgroup that refuses
/// the task, no permission for a network namespace) come back from `spawn`.
pub fn spawn(cmd: &mut Command, c: &Confinement) -> io::Result<Child> {
    join(cmd, c)?;
    cmd.spawn()
}

/// [`spawn`], with `setup` run in the child once it is in its cgroups, before `cmd`'s program
/// (the sandbox); refused in a process with more than one thread (see
/// [`kernelkite_sys::raw::spawn_with_setup`]).
pub fn spawn_with_setup(
    cmd: &mut Command,
    c: &Confinement,
    setup: ChildSetup,
) -> io::Result<Child> {
    join(cmd, c)?;
    kernelkite_sys::raw::spawn_with_setup(cmd, setup)
}

/// Makes `cmd`'s child join `c`'s cgroups (and network namespace) before anything else.
fn join(cmd: &mut Command, c: &Confinement) -> io::Result<()> {
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
    kernelkite_sys::raw::join_before_exec(cmd, files, c.isolate_network);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
