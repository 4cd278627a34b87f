//! A `sleep` process a test points at (a job's anchor, a victim, a process in a cgroup) that
//! dies with the test, even one that fails. A plain `Child` outlives a panicking test, and one
//! that inherited the test's stdout keeps the test command's pipe open until it ends: a failed
//! test then cost CI the rest of its sleep (300 s once) before the run went on.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};

/// A `sleep` child with no standard streams, killed and reaped when dropped.
#[derive(Debug)]
pub struct Sleeper(Child);

impl Sleeper {
    /// `sleep secs` in the test's process group.
    pub fn new(secs: u32) -> Sleeper {
        Sleeper::spawn(secs, false)
    }

    /// `sleep secs` leading a process group of its own (as the command hook's process does).
    pub fn leader(secs: u32) -> Sleeper {
        Sleeper::spawn(secs, true)
    }

    fn spawn(secs: u32, leader: bool) -> Sleeper {
        let mut cmd = Command::new("sleep");
        cmd.arg(secs.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if leader {
            cmd.process_group(0);
        }
        Sleeper(cmd.spawn().expect("`sleep` starts"))
    }

    /// Its pid.
    pub fn id(&self) -> u32 {
        self.0.id()
    }

    /// Kills it and waits for it (a no-op when it has ended).
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }

    /// Whether it has ended (reaping it if so).
    pub fn exited(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(Some(_)))
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_sleeper_is_gone() {
        let s = Sleeper::leader(60);
        let pid = s.id();
        assert_eq!(
            rustix::process::getpgid(rustix::process::Pid::from_raw(pid as i32)).ok(),
            rustix::process::Pid::from_raw(pid as i32),
            "it leads its own group"
        );
        drop(s);
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "killed and reaped on drop"
        );
    }
}
