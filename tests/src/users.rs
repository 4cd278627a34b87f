//! A system user made for a test (as root) and removed after it: the job user of sandbox tests.

use std::process::Command;

/// Whether the job user can reach a path (local mode decides its sandbox with it).
pub use kernelkite_service::local::settings::out_of_the_job_users_reach;

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
