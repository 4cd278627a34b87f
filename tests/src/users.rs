//! A system user made for a test (as root) and removed after it: the job user of sandbox tests.

use std::process::Command;

use std::path::{Path, PathBuf};

/// Where the job user's way to `path` ends inside the sandbox: a directory the sandbox
/// replaces (its fresh `/tmp`, `/var/tmp` and `/run/lock`, the covered `/run`, its own
/// `/dev`), or the first directory on the way that others may not search, or the file itself
/// when others may not read it; `None` when the job user reaches it. The node's tools
/// (`--job-tool`, the runner in local mode) are bound over all of these; anything else a job
/// runs (Python) must be reachable on its own.
pub fn out_of_the_job_users_reach(path: &Path) -> Option<PathBuf> {
    use kernelkite_hooks::sandbox::mounts::{FRESH_DIRS, HOST_RUN};
    use kernelkite_hooks::sandbox::spec::Access;
    use std::os::unix::fs::PermissionsExt;
    let real = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let replaced = FRESH_DIRS.iter().chain([&HOST_RUN, &"/dev"]).map(Path::new);
    for r in replaced {
        if real.starts_with(r) {
            return Some(r.to_path_buf());
        }
    }
    let mut ancestors: Vec<&Path> = real.ancestors().skip(1).collect();
    ancestors.reverse();
    // As any user who owns nothing there (the job user's own ids own nothing on the host).
    let anyone =
        |d: &&Path| Access::of(d).is_some_and(|a| a.searchable_by(u32::MAX - 1, u32::MAX - 1, &[]));
    let closed_dir = ancestors.into_iter().find(|d| !anyone(d));
    if let Some(d) = closed_dir {
        return Some(d.to_path_buf());
    }
    let readable = std::fs::metadata(&real).is_ok_and(|m| m.permissions().mode() & 0o004 != 0);
    (!readable).then_some(real)
}

/// A system user made for the test and removed when dropped; `nobody` where `useradd` is
/// missing or fails.
pub struct TestUser {
    /// Its name.
    pub name: String,
    /// Its uid.
    pub uid: u32,
    made: bool,
}

impl TestUser {
    /// Makes `kkt<pid><tag>` (no home, no login shell, its own group).
    pub fn new(tag: &str) -> TestUser {
        let name = format!("kkt{}{tag}", std::process::id() % 100_000);
        let made = Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                "--user-group",
                &name,
            ])
            .status()
            .is_ok_and(|s| s.success());
        let name = if made {
            name
        } else {
            eprintln!("useradd failed: the test runs as nobody");
            "nobody".to_string()
        };
        let out = Command::new("id")
            .args(["-u", &name])
            .output()
            .expect("run id");
        let uid = String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("a uid from id -u");
        TestUser { name, uid, made }
    }
}

impl Drop for TestUser {
    fn drop(&mut self) {
        if self.made {
            let _ = Command::new("userdel").arg(&self.name).status();
        }
    }
}
