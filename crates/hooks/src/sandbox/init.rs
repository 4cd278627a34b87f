//! The job's process tree above its command, made by the `command` hook (the hooks are
//! single-threaded, so these are plain forks of ordinary Rust):
//!
//! ```text
//! hook ── init (root, pid 1 of the job's PID namespace, the hook's child: its exit status is
//!           │    the command's; killed with the hook by PR_SET_PDEATHSIG; it keeps root's
//!           │    capabilities for the carry)
//!           └── command (the job user: the step's shell, then the runner, ...)
//! ```
//!
//! The hook `unshare`s the PID namespace just before it spawns the job's process, which is
//! then the namespace's pid 1 (`unshare(CLONE_NEWPID)` moves only later children); the hook
//! starts nothing else afterwards. The init builds the view, forks the command, reaps every
//! orphan and, when the command ends, kills every process left in the namespace and exits
//! with the command's status, as `docker run --init` does (a daemon a job left cannot outlive
//! it, or rewrite its result after the evaluator exited). Inside, the job sees only its own
//! processes: no other job's to signal, trace or read through `/proc`, and `kill(-1)` reaches
//! only its own. The init ignores every signal its namespace sends it (the kernel's rule for
//! a namespace's pid 1 without handlers) and, from outside, all but SIGKILL: a cancellation
//! the agent sends the hook's process group reaches the command (same group), which decides.
//! It runs as root; the command's `CAP_KILL` (kept for its evaluator) could name it, but the
//! kernel delivers to a namespace's init, from inside, only the signals it has handlers for,
//! and it has none.

use std::os::fd::{AsFd, AsRawFd};

use rustix::process::{Pid, WaitOptions, WaitStatus};

/// The exit status the hook reports for a wait status: the code, or 128 + the signal, as a
/// shell reports a command killed by a signal.
pub fn status_code(status: WaitStatus) -> i32 {
    code_of(status.exit_status(), status.terminating_signal())
}

fn code_of(exit: Option<i32>, signal: Option<i32>) -> i32 {
    exit.or_else(|| signal.map(|s| 128 + s)).unwrap_or(1)
}

/// The init's whole life once the command is started: reaps every child (orphans of the job
/// are re-parented here) until the command ends; then kills every other process of the
/// namespace (`kill(-1)` from the init reaches all of them, and the kernel refuses a fork to
/// a process with a fatal signal pending, so nothing escapes), reaps them, carries the job's
/// artifacts back into the real checkout (`disk`; not when a signal ended the command), and
/// exits with the command's status. Only the overlays' descriptors stay open: the spawn's pipes must see end of file
/// when the command is executed.
pub fn reap_until(command: Pid, overlays: Vec<super::disk::Overlaid>) -> ! {
    let keep: Vec<i32> = overlays
        .iter()
        .flat_map(|o| [o.upper.as_raw_fd(), o.real.as_raw_fd()])
        .collect();
    close_all_but(&keep);
    let (code, signalled) = loop {
        match rustix::process::wait(WaitOptions::empty()) {
            Ok(Some((pid, status))) if pid == command => {
                break (status_code(status), status.terminating_signal().is_some())
            }
            Ok(_) | Err(rustix::io::Errno::INTR) => continue,
            // No child at all: the command is gone without being seen (cannot happen).
            Err(_) => break (1, true),
        }
    };
    // A process stuck in the kernel for longer is left to the namespace's end.
    kernelkite_sys::raw::kill_all_others(std::time::Duration::from_secs(2));
    let mut lines = Vec::new();
    if signalled && overlays.iter().any(|o| !o.carry.is_empty()) {
        // The evaluator killed: what its job left in the checkout is not its result.
        lines.push(format!(
            "sandbox: the command was killed (exit {code}); its artifacts are not carried back"
        ));
    }
    for o in overlays.iter().filter(|_| !signalled) {
        // Nothing of the job is left to write; the real checkout is no longer a layer.
        let _ = rustix::mount::unmount(&o.mount_point, rustix::mount::UnmountFlags::DETACH);
        let carried = super::disk::carry_back(o.upper.as_fd(), o.real.as_fd(), &o.carry, o.budget);
        lines.extend(super::disk::describe(&carried));
    }
    crate::joblog::say_all(lines);
    kernelkite_sys::raw::exit_now(code)
}

/// Closes every descriptor from 3 up except `keep`.
fn close_all_but(keep: &[i32]) {
    let mut keep: Vec<i32> = keep.iter().copied().filter(|fd| *fd >= 3).collect();
    keep.sort_unstable();
    let mut next = 3;
    for fd in keep {
        if fd > next {
            kernelkite_sys::raw::close_range(next, fd - 1);
        }
        next = fd + 1;
    }
    kernelkite_sys::raw::close_from(next);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_reads_as_128_plus_its_number() {
        assert_eq!(code_of(Some(9), None), 9);
        assert_eq!(code_of(None, Some(libc::SIGKILL)), 137);
        assert_eq!(code_of(Some(0), None), 0);
        assert_eq!(code_of(None, None), 1);
    }
}
