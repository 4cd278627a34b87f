//! Running one child process the way kernelbot's `run_program` does, without its ways to hang.
//!
//! * The child starts in a new session (so a new process group) and inherits exactly one
//!   extra descriptor: the write end of the POPCORN pipe, at fd [`POPCORN_FD`].
//! * stdout, stderr and the pipe are read together with `poll`, into bounded buffers.
//! * On timeout the whole group is killed with SIGKILL. Once the child is gone, whatever is
//!   left in its group is killed too, and, when the caller is a child subreaper, so are
//!   descendants that escaped the group (`setsid` daemons), which were reparented to us.
//! * Pipes still held open by something we could not kill are abandoned after a short grace
//!   period instead of being waited for.

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Once, OnceLock};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::process::{Pid, Signal};

use crate::text::{Capture, MAX_OUTPUT_CHARS};

/// The descriptor number the harness finds the POPCORN pipe at (`POPCORN_FD`).
pub const POPCORN_FD: RawFd = 3;
/// Most bytes read from the POPCORN pipe; the rest is drained and dropped.
pub const MAX_POPCORN_BYTES: usize = 16 * 1024 * 1024;
/// How long output pipes are still read after the child is gone.
const PIPE_GRACE: Duration = Duration::from_millis(500);

/// What to run.
#[derive(Debug, Clone)]
pub struct Spec {
    /// The program, looked up on `PATH` when it has no slash.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// The directory it starts in.
    pub cwd: PathBuf,
    /// Variables set on top of the inherited environment.
    pub env: Vec<(OsString, OsString)>,
    /// Variables removed from the inherited environment.
    pub env_remove: Vec<OsString>,
    /// How long it may run before its whole process group is killed.
    pub timeout: Duration,
    /// Open the POPCORN pipe and set `POPCORN_FD`.
    pub popcorn: bool,
    /// Kill descendants reparented to this process after the child ends (needs
    /// [`become_subreaper`] to have been called; only safe when nothing else in this
    /// process spawns children concurrently).
    pub reap_orphans: bool,
    /// procfs the orphan reaping walks for this process's children (`/proc`).
    pub proc_root: PathBuf,
    /// The evaluator's guard against the child (`crate::guard`): its filter installed in the
    /// child, and the namespace-wide kill after it. `None` for library callers.
    pub guard: Option<crate::guard::Guard>,
}

/// How it went.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// kernelbot's `returncode`: the exit code, or minus the signal number.
    pub exit_code: i32,
    /// Whether it was killed for running past [`Spec::timeout`].
    pub timed_out: bool,
    /// How long it ran (the timeout, when it timed out).
    pub duration: Duration,
    /// What it wrote to stdout (bounded).
    pub stdout: Capture,
    /// What it wrote to stderr (bounded).
    pub stderr: Capture,
    /// Raw POPCORN pipe content (bounded by [`MAX_POPCORN_BYTES`]).
    pub popcorn: Vec<u8>,
    /// Whether the POPCORN pipe carried more than [`MAX_POPCORN_BYTES`].
    pub popcorn_truncated: bool,
}

/// Set by the signal handler on SIGTERM, SIGINT or SIGHUP.
fn cancel_flag() -> &'static Arc<AtomicBool> {
    static FLAG: OnceLock<Arc<AtomicBool>> = OnceLock::new();
    FLAG.get_or_init(|| Arc::new(AtomicBool::new(false)))
}

/// On SIGTERM, SIGINT or SIGHUP (Buildkite cancelling the job signals the runner's process
/// group, which the harness has left by `setsid`), mark the run cancelled: [`run`] wakes (the
/// signal interrupts its `poll`, which is never restarted), kills the running child's group at
/// once and returns, and the caller sees [`cancelled`]. Installing twice is harmless.
///
/// The handler only sets a flag (`signal_hook::flag`): no thread. The runner stays a single
/// thread while a harness runs, so a submission that may signal no pid of the runner's
/// (`crate::guard`) has no other thread id of it to aim at either.
pub fn install_cancel_handlers() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        for sig in [SIGTERM, SIGINT, SIGHUP] {
            if let Err(e) = signal_hook::flag::register(sig, Arc::clone(cancel_flag())) {
                tracing::warn!("cannot handle cancellation signal {sig} ({e}); a cancelled job may leave its processes running");
            }
        }
    });
}

/// Whether a cancellation signal has arrived.
pub fn cancelled() -> bool {
    cancel_flag().load(Ordering::SeqCst)
}

/// Makes this process the reaper of orphaned descendants, so a harness's `setsid` daemons
/// are reparented here (not to init) and can be found and killed.
pub fn become_subreaper() -> io::Result<()> {
    Ok(rustix::process::set_child_subreaper(Some(
        rustix::process::getpid(),
    ))?)
}

fn pipe_cloexec() -> io::Result<(OwnedFd, OwnedFd)> {
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    // Started with stdio closed, the pipe could land on 0..2, where the child's stdio setup
    // would overwrite it before POPCORN_FD is put in place: move it higher.
    Ok((above_stdio(r)?, above_stdio(w)?))
}

fn above_stdio(fd: OwnedFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    Ok(rustix::io::fcntl_dupfd_cloexec(&fd, 10)?)
}

fn set_nonblocking(fd: &OwnedFd) -> io::Result<()> {
    let flags = rustix::fs::fcntl_getfl(fd)?;
    rustix::fs::fcntl_setfl(fd, flags | rustix::fs::OFlags::NONBLOCK)?;
    Ok(())
}

/// Runs `spec` to completion (or timeout). `Err` only when the child could not be started.
pub fn run(spec: &Spec) -> io::Result<Outcome> {
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        .current_dir(&spec.cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for k in &spec.env_remove {
        cmd.env_remove(k);
    }
    for (k, v) in &spec.env {
        cmd.env(k, v);
    }
    let pipe = if spec.popcorn {
        let (r, w) = pipe_cloexec()?;
        cmd.env("POPCORN_FD", POPCORN_FD.to_string());
        Some((r, w))
    } else {
        None
    };
    // A new session (so a new process group); nothing but stdio and the pipe crosses exec,
    // even descriptors a parent of ours leaked without CLOEXEC.
    let inherit = pipe.as_ref().map(|(_, w)| (w.as_fd(), POPCORN_FD));
    if let Some(g) = &spec.guard {
        if g.submission.is_some() {
            // The job's HOME (its private /tmp) may hold the runner's files; the submission's
            // caches (torch extensions, Triton) go to the directory it works in.
            cmd.env("HOME", &spec.cwd);
        }
        kernelkite_sys::raw::harden_before_exec(&mut cmd, g.filter.clone(), g.submission);
    }
    let start = Instant::now();
    let mut child = kernelkite_sys::raw::spawn_in_new_session(cmd, inherit)?;
    let pid = child.id() as i32;
    let result = supervise(spec, &mut child, pid, start, pipe);
    if result.is_err() {
        // Never leave a child behind, whatever failed while watching it.
        kill_group(pid);
        let _ = child.wait();
    }
    result
}

/// Reads the child's output until it is gone (or timed out / cancelled) and cleaned up.
// Long because one poll loop: exit, cancellation and deadline share the pipe-draining state.
fn supervise(
    spec: &Spec,
    child: &mut std::process::Child,
    pid: i32,
    start: Instant,
    pipe: Option<(OwnedFd, OwnedFd)>,
) -> io::Result<Outcome> {
    let popcorn_read = pipe.map(|(r, w)| {
        drop(w);
        r
    });

    let mut streams: Vec<Stream> = Vec::new();
    if let Some(out) = child.stdout.take() {
        streams.push(Stream::new(OwnedFd::from(out), Sink::Stdout));
    }
    if let Some(err) = child.stderr.take() {
        streams.push(Stream::new(OwnedFd::from(err), Sink::Stderr));
    }
    if let Some(r) = popcorn_read {
        streams.push(Stream::new(r, Sink::Popcorn));
    }
    for s in &streams {
        set_nonblocking(&s.fd)?;
    }
    let pidfd = open_pidfd(pid);

    let mut out = Outcome {
        exit_code: 0,
        timed_out: false,
        duration: Duration::ZERO,
        stdout: Capture::new(MAX_OUTPUT_CHARS),
        stderr: Capture::new(MAX_OUTPUT_CHARS),
        popcorn: Vec::new(),
        popcorn_truncated: false,
    };
    let deadline = start + spec.timeout;
    let mut exited: Option<Instant> = None;
    loop {
        let now = Instant::now();
        if exited.is_none() {
            if let Some(status) = child.try_wait()? {
                out.duration = now - start;
                out.exit_code = status.code().or(status.signal().map(|s| -s)).unwrap_or(-1);
                exited = Some(now);
                cleanup_after(pid, spec);
            } else if cancelled() {
                // The handler already killed the group if it knew it; make sure.
                kill_group(pid);
                let status = child.wait()?;
                out.duration = now - start;
                out.exit_code = status.code().or(status.signal().map(|s| -s)).unwrap_or(-1);
                exited = Some(Instant::now());
                cleanup_after(pid, spec);
            } else if now >= deadline {
                out.timed_out = true;
                out.duration = spec.timeout;
                kill_group(pid);
                let status = child.wait()?;
                out.exit_code = status.code().or(status.signal().map(|s| -s)).unwrap_or(-1);
                let now = Instant::now();
                exited = Some(now);
                cleanup_after(pid, spec);
            }
        }
        streams.retain(|s| s.open);
        if streams.is_empty() && exited.is_some() {
            break;
        }
        let wait_until = match exited {
            Some(t) => t + PIPE_GRACE,
            None => deadline,
        };
        let now = Instant::now();
        if now >= wait_until {
            if exited.is_some() {
                tracing::warn!(
                    "output pipes still open {} ms after the process ended (an escaped descendant holds them); not waiting further",
                    PIPE_GRACE.as_millis()
                );
                break;
            }
            continue;
        }
        poll_once(
            &mut streams,
            pidfd.as_ref(),
            wait_until - now,
            exited.is_none(),
            &mut out,
        )?;
    }
    Ok(out)
}

fn open_pidfd(pid: i32) -> Option<OwnedFd> {
    rustix::process::pidfd_open(Pid::from_raw(pid)?, rustix::process::PidfdFlags::empty()).ok()
}

/// Waits for output or the child's exit (through its pidfd; without one, checks every 5 ms).
fn poll_once(
    streams: &mut [Stream],
    pidfd: Option<&OwnedFd>,
    max_wait: Duration,
    watch_exit: bool,
    out: &mut Outcome,
) -> io::Result<()> {
    let mut fds: Vec<PollFd<'_>> = streams
        .iter()
        .map(|s| PollFd::new(&s.fd, PollFlags::IN))
        .collect();
    let mut wait = max_wait;
    if watch_exit {
        match pidfd {
            Some(p) => fds.push(PollFd::new(p, PollFlags::IN)),
            None => wait = wait.min(Duration::from_millis(5)),
        }
    }
    // Whole milliseconds, at least one, as poll(2) took them before.
    let ms = wait.as_millis().clamp(1, i32::MAX as u128) as u64;
    let timeout = rustix::event::Timespec::try_from(Duration::from_millis(ms))
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    match rustix::event::poll(&mut fds, Some(&timeout)) {
        Ok(_) => {}
        Err(rustix::io::Errno::INTR) => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    let ready: Vec<bool> = fds.iter().map(|p| !p.revents().is_empty()).collect();
    drop(fds);
    for (s, ready) in streams.iter_mut().zip(ready) {
        if ready {
            s.drain(out);
        }
    }
    Ok(())
}

#[derive(Clone, Copy)]
enum Sink {
    Stdout,
    Stderr,
    Popcorn,
}

struct Stream {
    fd: OwnedFd,
    sink: Sink,
    open: bool,
}

impl Stream {
    fn new(fd: OwnedFd, sink: Sink) -> Stream {
        Stream {
            fd,
            sink,
            open: true,
        }
    }

    /// Reads what is available without blocking.
    fn drain(&mut self, out: &mut Outcome) {
        let mut buf = [0u8; 64 * 1024];
        loop {
            let n = match rustix::io::read(&self.fd, &mut buf) {
                Ok(0) => {
                    self.open = false;
                    return;
                }
                Ok(n) => n,
                Err(rustix::io::Errno::AGAIN) => return,
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => {
                    self.open = false;
                    return;
                }
            };
            let data = &buf[..n];
            match self.sink {
                Sink::Stdout => out.stdout.push(data),
                Sink::Stderr => out.stderr.push(data),
                Sink::Popcorn => {
                    let room = MAX_POPCORN_BYTES.saturating_sub(out.popcorn.len());
                    out.popcorn.extend_from_slice(&data[..data.len().min(room)]);
                    out.popcorn_truncated |= data.len() > room;
                }
            }
        }
    }
}

/// SIGKILL to the child's process group (its pgid is its pid: it called setsid).
fn kill_group(pid: i32) {
    if let Some(group) = Pid::from_raw(pid) {
        // ESRCH (group gone) is fine.
        let _ = rustix::process::kill_process_group(group, Signal::KILL);
    }
}

/// After the child has been reaped: kill what it left in its group and, at the top of a job's
/// PID namespace, every other process in it; otherwise, when we are the subreaper,
/// descendants that left the group and were reparented to us.
fn cleanup_after(pid: i32, spec: &Spec) {
    kill_group(pid);
    if spec.guard.as_ref().is_some_and(|g| g.kill_namespace) {
        crate::guard::kill_all_others();
    } else if spec.reap_orphans {
        kill_orphans(&spec.proc_root);
    }
}

/// Kills and reaps every child of this process, repeatedly, as killing one reparents its
/// own children to us. Bounded in time, so a fork bomb or a process stuck in the kernel
/// (uninterruptible sleep in a driver) cannot keep the runner here.
pub fn kill_orphans(proc_root: &Path) {
    let me = rustix::process::getpid().as_raw_nonzero().get();
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let kids = children_of(proc_root, me);
        if kids.is_empty() {
            return;
        }
        tracing::debug!("killing escaped descendants: {kids:?}");
        for kid in kids.iter().filter_map(|&k| Pid::from_raw(k)) {
            let _ = rustix::process::kill_process_group(kid, Signal::KILL);
            let _ = rustix::process::kill_process(kid, Signal::KILL);
        }
        std::thread::sleep(Duration::from_millis(2));
        for kid in kids.iter().filter_map(|&k| Pid::from_raw(k)) {
            let _ = rustix::process::waitpid(Some(kid), rustix::process::WaitOptions::NOHANG);
        }
        if Instant::now() >= deadline {
            tracing::warn!("descendants {kids:?} did not die within 2 s of SIGKILL; leaving them");
            return;
        }
    }
}

/// Pids whose parent is `parent`, from `<proc_root>/*/stat`.
pub fn children_of(proc_root: &Path, parent: i32) -> Vec<i32> {
    let Ok(parent) = u32::try_from(parent) else {
        return Vec::new();
    };
    kernelkite_sys::procfs::children_of(proc_root, parent)
        .into_iter()
        .filter_map(|pid| i32::try_from(pid).ok())
        .collect()
}

/// The ppid field of `/proc/PID/stat` (after the parenthesised command, which may itself
/// contain spaces and parentheses).
pub fn parse_ppid(stat: &str) -> Option<i32> {
    kernelkite_sys::procfs::parse_stat(stat).and_then(|s| i32::try_from(s.ppid).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str, timeout_ms: u64) -> Outcome {
        run(&Spec {
            program: "sh".into(),
            args: vec!["-c".into(), script.into()],
            cwd: std::env::temp_dir(),
            env: vec![],
            env_remove: vec![],
            timeout: Duration::from_millis(timeout_ms),
            popcorn: true,
            reap_orphans: false,
            proc_root: PathBuf::from("/proc"),
            guard: None,
        })
        .unwrap()
    }

    #[test]
    fn captures_streams_pipe_and_exit_code() {
        let o = sh(
            "echo out; echo err >&2; echo 'check: pass' >&3; exit 112",
            5000,
        );
        assert_eq!(o.stdout.finish(), "out\n");
        assert_eq!(o.stderr.finish(), "err\n");
        assert_eq!(o.popcorn, b"check: pass\n");
        assert_eq!(o.exit_code, 112);
        assert!(!o.timed_out);
    }

    #[test]
    fn only_the_popcorn_fd_is_inherited() {
        let o = sh("ls /proc/self/fd | sort -n | tr '\\n' ' '", 5000);
        // 0,1,2, the pipe at 3, and the fd `ls` itself opened for the directory.
        let fds: Vec<i32> = o
            .stdout
            .finish()
            .split_whitespace()
            .filter_map(|s| s.parse().ok())
            .collect();
        assert_eq!(&fds[..4], &[0, 1, 2, 3], "{fds:?}");
        assert!(fds.len() <= 5, "{fds:?}");
    }

    #[test]
    fn a_leaked_descriptor_does_not_reach_the_child() {
        // A descriptor without CLOEXEC, like one leaked by a careless parent.
        let leaked = rustix::io::fcntl_dupfd_cloexec(std::io::stderr(), 10).unwrap();
        rustix::io::fcntl_setfd(&leaked, rustix::io::FdFlags::empty()).unwrap();
        let number = leaked.as_raw_fd();
        assert!(number > 3);
        let o = sh(
            &format!("[ -e /proc/self/fd/{number} ] && echo leaked || echo clean"),
            5000,
        );
        drop(leaked);
        assert_eq!(o.stdout.finish(), "clean\n");
    }

    /// True while `pid` exists and is not a zombie (a killed orphan may wait for init's reaping).
    fn alive(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| {
                let rest = &stat[stat.rfind(')')? + 1..];
                rest.split_whitespace().next().map(|s| s != "Z" && s != "X")
            })
            .unwrap_or(false)
    }

    fn gone_within(pid: i32, within: Duration) -> bool {
        let end = Instant::now() + within;
        while Instant::now() < end {
            if !alive(pid) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        !alive(pid)
    }

    /// The pid a script wrote as `pid: N` on the POPCORN pipe.
    fn reported_pid(o: &Outcome) -> i32 {
        let text = String::from_utf8_lossy(&o.popcorn);
        text.lines()
            .find_map(|l| l.strip_prefix("pid: "))
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("no pid reported: {text:?}"))
    }

    #[test]
    fn an_escaped_descendant_holding_stdout_is_abandoned_after_the_grace() {
        // Without the subreaper the setsid'd sleeper survives; the runner must not wait on it.
        // The shell waits (through a fifo) until the daemon has left the group, so the daemon
        // cannot be killed with the group by accident, which would make this test vacuous.
        let t = Instant::now();
        let o = sh(
            "f=$(mktemp -u); mkfifo \"$f\"; \
             setsid sh -c 'echo \"pid: $$\" >&3; echo up > \"$1\"; exec sleep 5' sh \"$f\" & \
             read x < \"$f\"; rm -f \"$f\"; echo done",
            5000,
        );
        let daemon = reported_pid(&o);
        let survived = alive(daemon);
        if let Some(daemon) = Pid::from_raw(daemon) {
            let _ = rustix::process::kill_process(daemon, Signal::KILL);
        }
        assert_eq!(o.stdout.finish(), "done\n");
        assert!(survived, "the daemon should have escaped the group");
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    }

    #[test]
    fn signal_gives_negative_code() {
        let o = sh("kill -9 $$", 5000);
        assert_eq!(o.exit_code, -9);
    }

    #[test]
    fn timeout_kills_the_group_and_keeps_partial_output() {
        // reap_orphans is off here (as for library callers): only the group kill can get the
        // grandchild, which outlives the shell and so would be reparented away, not killed.
        let t = Instant::now();
        let o = sh(
            "echo partial; sleep 30 & echo \"pid: $!\" >&3; sleep 30; echo never",
            300,
        );
        assert!(o.timed_out);
        assert_eq!(o.stdout.finish(), "partial\n");
        assert!(t.elapsed() < Duration::from_secs(5));
        let grandchild = reported_pid(&o);
        assert!(
            gone_within(grandchild, Duration::from_secs(2)),
            "grandchild {grandchild} survived the timeout"
        );
    }

    #[test]
    fn background_child_holding_stdout_does_not_block() {
        // The shell exits at once; its background child would keep stdout open for 30 s.
        let t = Instant::now();
        let o = sh("sleep 30 & echo \"pid: $!\" >&3; echo done", 5000);
        assert_eq!(o.exit_code, 0);
        assert_eq!(o.stdout.finish(), "done\n");
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        // ...and it does not outlive the run either.
        let grandchild = reported_pid(&o);
        assert!(
            gone_within(grandchild, Duration::from_secs(2)),
            "background child {grandchild} survived the run"
        );
    }

    #[test]
    fn missing_program_is_an_error() {
        let e = run(&Spec {
            program: "/nonexistent/prog".into(),
            args: vec![],
            cwd: std::env::temp_dir(),
            env: vec![],
            env_remove: vec![],
            timeout: Duration::from_secs(1),
            popcorn: true,
            reap_orphans: false,
            proc_root: PathBuf::from("/proc"),
            guard: None,
        })
        .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn ppid_parsing_handles_odd_command_names() {
        assert_eq!(parse_ppid("123 (a) b) c) S 77 123 123 0"), Some(77));
        assert_eq!(parse_ppid("garbage"), None);
    }
}
