//! cgroup v2 against this machine's cgroup2 mount, even one without controllers (hybrid v1
//! machines have one at /sys/fs/cgroup/unified), as root: `cgroup.kill` of a daemonized
//! grandchild, of a process hidden below the clean-up walk's bound and in nested child
//! cgroups, and a command born inside its cgroup by `clone3(CLONE_INTO_CGROUP)`. Skipped with
//! a reason where there is no writable cgroup2 mount.

use crate::real_cgroups;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use real_cgroups::{alive, claim, shared_turn, state_file, unique, wait_for_file, Turn};

#[test]
fn real_cgroup_v2_kills_a_daemonized_grandchild() {
    let Some((v2, name, dir, _claim)) = real_v2("v2", "") else {
        return;
    };
    let _guard = scopeguard(v2.clone(), name.clone());
    let pid = spawn_daemon_into(v2.procs_files(&name));
    assert!(
        v2.pids(&name).contains(&pid),
        "the grandchild left the v2 cgroup"
    );
    let report = v2.clean_up(&name).unwrap();
    assert_eq!(report.killed, vec![pid]);
    let start = Instant::now();
    while alive(pid) && start.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!alive(pid));
    assert!(!dir.exists());
}

#[test]
fn real_cgroup_v2_command_is_born_inside_its_cgroup() {
    let Some((v2, name, dir, _claim)) = real_v2("clone3", "") else {
        return;
    };
    let _guard = scopeguard(v2.clone(), name.clone());
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("cgroup");
    let env: std::collections::BTreeMap<String, String> =
        [("PATH".to_string(), "/usr/bin:/bin".to_string())].into();
    let script = format!("cat /proc/self/cgroup > {}", out.display());
    let started = kernelkite_hooks::confine::spawn_into_cgroup2(
        std::ffi::OsStr::new("sh"),
        &["-c".into(), script.into()],
        &env,
        &dir,
        false,
    )
    .unwrap();
    let Some(mut child) = started else {
        kernelkite_testkit::skip("this kernel has no clone3(CLONE_INTO_CGROUP)");
        return;
    };
    assert!(child.wait().unwrap().success());
    let cgroup = std::fs::read_to_string(&out).unwrap();
    assert!(
        cgroup
            .lines()
            .any(|l| l.starts_with("0::") && l.ends_with(&format!("/kernelkite/{name}"))),
        "{cgroup}"
    );
    // A program that cannot be executed is an error, not a silent success.
    let err = kernelkite_hooks::confine::spawn_into_cgroup2(
        std::ffi::OsStr::new("/nonexistent/prog"),
        &[],
        &env,
        &dir,
        false,
    )
    .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
}

/// A process hidden deeper than clean-up walks is still killed on v2: `cgroup.kill` covers the
/// whole subtree, and is written whatever the walk saw.
#[test]
fn real_cgroup_v2_kills_a_process_hidden_below_the_walk_bound() {
    let deep = vec!["d"; kernelkite_hooks::cgroup::MAX_TREE_DEPTH + 2].join("/");
    let Some((v2, name, dir, _claim)) = real_v2("v2hidden", &deep) else {
        return;
    };
    let leaf = dir.join(&deep);
    if !dir.join("cgroup.kill").exists() {
        let _ = remove_bottom_up(&dir);
        kernelkite_testkit::skip("this kernel has no cgroup.kill");
        return;
    }
    let pid = spawn_daemon_into(vec![leaf.join("cgroup.procs")]);
    let outcome = v2.clean_up(&name);
    let start = Instant::now();
    while alive(pid) && start.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let survived = alive(pid);
    // Leave nothing behind before asserting, whatever clean-up did.
    if survived {
        if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
    let _ = std::fs::write(dir.join("cgroup.kill"), "1");
    remove_bottom_up(&dir).unwrap();
    assert!(
        !survived,
        "a process below the walk bound survived clean-up"
    );
    let e = outcome.expect_err("an oversized tree is reported");
    assert!(e.to_string().contains("deeper than"), "{e}");
}

#[test]
fn real_cgroup_v2_kills_and_removes_nested_child_cgroups() {
    let Some((v2, name, dir, _claim)) = real_v2("v2nested", "sub/deeper") else {
        return;
    };
    let leaf = dir.join("sub/deeper");
    std::fs::create_dir_all(dir.join("other")).unwrap();
    let _guard = scopeguard(v2.clone(), name.clone());
    // The process starts in a grandchild cgroup of the job's, as if the job had moved it.
    let pid = spawn_daemon_into(vec![leaf.join("cgroup.procs")]);
    assert!(
        v2.pids(&name).is_empty(),
        "nothing in the job cgroup itself"
    );
    let report = v2.clean_up(&name).unwrap();
    assert_eq!(report.killed, vec![pid]);
    assert!(report.removed);
    let start = Instant::now();
    while alive(pid) && start.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!alive(pid));
    assert!(!dir.exists());
    let again = v2.clean_up(&name).unwrap();
    assert!(again.killed.is_empty() && !again.removed);
}

/// The machine's cgroup2 mount, even one without controllers (hybrid v1 machines have one at
/// /sys/fs/cgroup/unified): membership, `cgroup.kill` and removal work the same there.
fn cgroup2_mount() -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    kernelkite_hooks::cgroup::parse_mountinfo(&text)
        .into_iter()
        .find(|m| m.fs_type == "cgroup2")
        .map(|m| PathBuf::from(m.mount_point))
}

/// A job the test made directly on the cgroup2 mount, claimed as live in the shared run dir
/// for as long as the test runs: on a machine whose job cgroups are v2 the hooks of the tests
/// beside it see it, and would take an unclaimed one with processes for another instance's.
struct V2Claim {
    name: String,
    _turn: Turn,
}

impl Drop for V2Claim {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(state_file(&self.name));
    }
}

/// A fresh job cgroup on this machine's cgroup2 mount, with `sub` (a relative path, or "")
/// created under it: (the v2 interface, the job's name, its directory, its claim). `None`,
/// after saying why, where real cgroup v2 tests cannot run.
fn real_v2(
    prefix: &str,
    sub: &str,
) -> Option<(
    kernelkite_hooks::cgroup::v2::V2,
    String,
    std::path::PathBuf,
    V2Claim,
)> {
    let turn = shared_turn();
    if !rustix::process::geteuid().is_root() {
        kernelkite_testkit::skip("real cgroup tests need root");
        return None;
    }
    let Some(mount) = cgroup2_mount() else {
        kernelkite_testkit::skip("no cgroup2 mount");
        return None;
    };
    let v2 = kernelkite_hooks::cgroup::v2::V2::new(mount.clone());
    let name = unique(prefix);
    let dir = v2.base().join(&name);
    claim(&name);
    let held = V2Claim {
        name: name.clone(),
        _turn: turn,
    };
    if std::fs::create_dir_all(dir.join(sub)).is_err() {
        kernelkite_testkit::skip(format_args!("{} is not writable", mount.display()));
        return None;
    }
    Some((v2, name, dir, held))
}

struct V2Guard(kernelkite_hooks::cgroup::v2::V2, String);
impl Drop for V2Guard {
    fn drop(&mut self) {
        let _ = self.0.clean_up(&self.1);
    }
}
fn scopeguard(v2: kernelkite_hooks::cgroup::v2::V2, name: String) -> V2Guard {
    V2Guard(v2, name)
}

/// Starts a `setsid` daemon (`sleep 300`) through `confine::spawn` with its first process written
/// to `procs_files` (so the daemon starts in those cgroups), and returns the daemon's pid.
fn spawn_daemon_into(procs_files: Vec<std::path::PathBuf>) -> u32 {
    let tmp = tempfile::tempdir().unwrap();
    let pidfile = tmp.path().join("pid");
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.arg("-c").arg(format!(
        "(setsid sh -c 'echo $$ > {}; exec sleep 300' </dev/null >/dev/null 2>&1 &)",
        pidfile.display()
    ));
    let confinement = kernelkite_hooks::confine::Confinement {
        procs_files,
        isolate_network: false,
    };
    let mut child = kernelkite_hooks::confine::spawn(&mut cmd, &confinement).unwrap();
    assert!(child.wait().unwrap().success());
    wait_for_file(&pidfile).trim().parse().unwrap()
}

/// Removes a test's deep cgroup tree, deepest first.
fn remove_bottom_up(dir: &std::path::Path) -> std::io::Result<()> {
    let mut dirs = vec![dir.to_path_buf()];
    let mut i = 0;
    while i < dirs.len() {
        for e in std::fs::read_dir(&dirs[i])?.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                dirs.push(e.path());
            }
        }
        i += 1;
    }
    for d in dirs.iter().rev() {
        let start = Instant::now();
        while std::fs::remove_dir(d).is_err() && start.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    if dir.exists() {
        return Err(std::io::Error::other(format!("{} remains", dir.display())));
    }
    Ok(())
}
