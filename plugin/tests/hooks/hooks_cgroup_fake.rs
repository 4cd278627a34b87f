//! cgroup v2 and v1 against fake cgroupfs trees (plain files), with a small "kernel" thread
//! that acts on `cgroup.kill` / `cgroup.freeze` the way the real one does, and real processes
//! to kill. The real kernel is exercised by `hooks_cgroup_real*.rs`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kernelkite_hooks::cgroup::{Cgroups, Limits};

fn limits() -> Limits {
    Limits {
        cpus: vec![2, 3, 114, 115],
        mems: vec![0],
        memory_bytes: 8 << 30,
        pids: 512,
        allow_devices: None,
    }
}

fn v2_tree(root: &Path) -> PathBuf {
    std::fs::create_dir_all(root.join("proc/self")).unwrap();
    std::fs::write(
        root.join("proc/self/mountinfo"),
        "30 23 0:27 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
    )
    .unwrap();
    let cg = root.join("sys/fs/cgroup");
    std::fs::create_dir_all(&cg).unwrap();
    std::fs::write(cg.join("cgroup.controllers"), "cpuset cpu io memory pids\n").unwrap();
    std::fs::write(cg.join("cgroup.subtree_control"), "cpu io\n").unwrap();
    cg
}

/// A `sleep` with no standard streams: one left by a failing test must not hold the test
/// command's pipe open.
fn sleeper() -> Child {
    Command::new("sleep")
        .arg("300")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// Emulates the kernel for one fake cgroup dir: writing 1 to `cgroup.kill` kills every
/// listed process and empties `cgroup.procs`.
fn fake_kernel(
    dir: PathBuf,
    stop: Arc<AtomicBool>,
    mut children: Vec<Child>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::SeqCst) {
            let kill = std::fs::read_to_string(dir.join("cgroup.kill")).unwrap_or_default();
            if kill.trim() == "1" {
                // Files first, then the kills: the code under test sees the cgroup empty as
                // soon as the processes are gone and removes the directory, which must not
                // race with this thread still writing into it.
                let _ = std::fs::write(dir.join("cgroup.procs"), "");
                let _ = std::fs::remove_file(dir.join("cgroup.kill"));
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        for c in &mut children {
            let _ = c.kill();
            let _ = c.wait();
        }
    })
}

#[test]
fn v2_job_cgroup_gets_every_limit_and_controllers_are_enabled() {
    let root = tempfile::tempdir().unwrap();
    let cg = v2_tree(root.path());
    let c = Cgroups::detect(root.path()).unwrap();
    assert_eq!(c.version(), 2);
    c.create("job-1", &limits()).unwrap();
    let dir = cg.join("kernelkite/job-1");
    let read = |p: PathBuf| std::fs::read_to_string(p).unwrap();
    assert_eq!(read(dir.join("cpuset.cpus")), "2-3,114-115");
    assert_eq!(read(dir.join("cpuset.mems")), "0");
    assert_eq!(read(dir.join("memory.max")), (8u64 << 30).to_string());
    assert_eq!(read(dir.join("memory.swap.max")), "0", "swap off");
    assert_eq!(read(dir.join("pids.max")), "512");
    // Only the missing controllers are added at the root; all three for kernelkite/.
    assert_eq!(
        read(cg.join("cgroup.subtree_control")),
        "+cpuset +memory +pids"
    );
    assert_eq!(
        read(cg.join("kernelkite/cgroup.subtree_control")),
        "+cpuset +memory +pids"
    );
    assert_eq!(
        c.procs_files("job-1").unwrap(),
        vec![dir.join("cgroup.procs")]
    );
    assert_eq!(c.jobs(), vec!["job-1"]);
    assert!(c.create("../escape", &limits()).is_err());
}

#[test]
fn v2_clean_up_uses_cgroup_kill_and_reports_the_dead() {
    let root = tempfile::tempdir().unwrap();
    let cg = v2_tree(root.path());
    let c = Cgroups::detect(root.path()).unwrap();
    c.create("job-2", &limits()).unwrap();
    let dir = cg.join("kernelkite/job-2");
    let kids = vec![sleeper(), sleeper()];
    let mut pids: Vec<u32> = kids.iter().map(Child::id).collect();
    pids.sort();
    let procs: String = pids.iter().map(|p| format!("{p}\n")).collect();
    std::fs::write(dir.join("cgroup.procs"), procs).unwrap();
    std::fs::write(dir.join("cgroup.kill"), "").unwrap();
    std::fs::write(
        dir.join("memory.events"),
        "low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n",
    )
    .unwrap();
    assert_eq!(c.oom_kills("job-2"), 2);
    let stop = Arc::new(AtomicBool::new(false));
    let kernel = fake_kernel(dir.clone(), stop.clone(), kids);
    let report = c.clean_up("job-2").unwrap();
    stop.store(true, Ordering::SeqCst);
    kernel.join().unwrap();
    assert_eq!(report.killed, pids);
    assert!(report.removed);
    assert!(!dir.exists());
    // Idempotent.
    let again = c.clean_up("job-2").unwrap();
    assert!(again.killed.is_empty() && !again.removed);
}

#[test]
fn v2_without_cgroup_kill_freezes_and_kills_each_process() {
    let root = tempfile::tempdir().unwrap();
    let cg = v2_tree(root.path());
    let c = Cgroups::detect(root.path()).unwrap();
    c.create("job-3", &limits()).unwrap();
    let dir = cg.join("kernelkite/job-3");
    let mut kid = sleeper();
    std::fs::write(dir.join("cgroup.procs"), format!("{}\n", kid.id())).unwrap();
    // A reaper so the killed child does not linger as a zombie listed in /proc.
    let pid = kid.id();
    let reaper = std::thread::spawn(move || kid.wait().unwrap());
    let report = c.clean_up("job-3").unwrap();
    let status = reaper.join().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        status.signal(),
        Some(rustix::process::Signal::KILL.as_raw())
    );
    assert_eq!(report.killed, vec![pid]);
    assert!(!dir.exists());
}

#[test]
fn v1_copies_the_parent_cpuset_and_limits_swap() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    std::fs::create_dir_all(r.join("proc/self")).unwrap();
    let mut mi = String::new();
    for c in ["cpuset", "memory", "pids", "freezer", "devices"] {
        std::fs::create_dir_all(r.join("sys/fs/cgroup").join(c)).unwrap();
        mi.push_str(&format!(
            "1 1 0:1 / /sys/fs/cgroup/{c} rw - cgroup cgroup rw,{c}\n"
        ));
    }
    std::fs::write(r.join("proc/self/mountinfo"), mi).unwrap();
    std::fs::write(r.join("sys/fs/cgroup/cpuset/cpuset.cpus"), "0-223\n").unwrap();
    std::fs::write(r.join("sys/fs/cgroup/cpuset/cpuset.mems"), "0-1\n").unwrap();
    let c = Cgroups::detect(r).unwrap();
    assert_eq!(c.version(), 1);
    let mut l = limits();
    l.allow_devices = Some(vec![kernelkite_hooks::cgroup::CharDevice {
        major: 195,
        minor: 5,
    }]);
    c.create("job-4", &l).unwrap();
    let read = |p: &str| std::fs::read_to_string(r.join("sys/fs/cgroup").join(p)).unwrap();
    assert_eq!(read("cpuset/kernelkite/cpuset.cpus"), "0-223");
    assert_eq!(read("cpuset/kernelkite/cpuset.mems"), "0-1");
    assert_eq!(read("cpuset/kernelkite/job-4/cpuset.cpus"), "2-3,114-115");
    assert_eq!(
        read("memory/kernelkite/job-4/memory.limit_in_bytes"),
        (8u64 << 30).to_string()
    );
    assert_eq!(
        read("memory/kernelkite/job-4/memory.memsw.limit_in_bytes"),
        (8u64 << 30).to_string()
    );
    assert_eq!(read("pids/kernelkite/job-4/pids.max"), "512");
    // Deny all, then allow the base set and the job's own GPU, one rule per line.
    assert_eq!(read("devices/kernelkite/job-4/devices.deny"), "a");
    let mut want: Vec<&str> = kernelkite_hooks::cgroup::BASE_DEVICE_RULES.to_vec();
    want.push("c 195:5 rwm");
    assert_eq!(
        read("devices/kernelkite/job-4/devices.allow")
            .lines()
            .collect::<Vec<_>>(),
        want
    );
    // Made again (a retried job): the rules are the same, not appended twice.
    c.create("job-4", &l).unwrap();
    assert_eq!(
        read("devices/kernelkite/job-4/devices.allow")
            .lines()
            .count(),
        want.len()
    );
    let files = c.procs_files("job-4").unwrap();
    assert_eq!(
        files.len(),
        5,
        "cpuset, memory, pids, freezer, devices: {files:?}"
    );
    std::fs::write(
        r.join("sys/fs/cgroup/memory/kernelkite/job-4/memory.oom_control"),
        "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n",
    )
    .unwrap();
    assert_eq!(c.oom_kills("job-4"), 1);
    // CPUs 112-223 went offline and came back (SMT off and on): v1 left the parent without
    // them; the next job's set-up gives them back before asking for them.
    std::fs::write(
        r.join("sys/fs/cgroup/cpuset/kernelkite/cpuset.cpus"),
        "0-111",
    )
    .unwrap();
    c.create("job-5", &l).unwrap();
    assert_eq!(read("cpuset/kernelkite/cpuset.cpus"), "0-223");
    c.clean_up("job-5").unwrap();
    let report = c.clean_up("job-4").unwrap();
    assert!(report.removed && report.killed.is_empty());
    for h in ["cpuset", "memory", "pids", "freezer", "devices"] {
        assert!(
            !r.join("sys/fs/cgroup")
                .join(h)
                .join("kernelkite/job-4")
                .exists(),
            "{h}"
        );
    }
}

/// A job that made `a/b` and `c` under its cgroup and moved processes there: the kill reaches
/// all of them and the children go before the job cgroup.
#[test]
fn v2_clean_up_kills_and_removes_nested_child_cgroups() {
    let root = tempfile::tempdir().unwrap();
    let cg = v2_tree(root.path());
    let c = Cgroups::detect(root.path()).unwrap();
    c.create("job-6", &limits()).unwrap();
    let dir = cg.join("kernelkite/job-6");
    for sub in ["a/b", "c"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    // No cgroup.kill (kernel before 5.14): each process is killed by pid.
    let mut kids = vec![sleeper(), sleeper()];
    let mut pids: Vec<u32> = kids.iter().map(Child::id).collect();
    std::fs::write(dir.join("a/b/cgroup.procs"), format!("{}\n", pids[0])).unwrap();
    std::fs::write(dir.join("c/cgroup.procs"), format!("{}\n", pids[1])).unwrap();
    pids.sort();
    // Reapers, so the killed children do not linger as zombies listed in /proc.
    let dir2 = dir.clone();
    let reapers: Vec<_> = kids
        .drain(..)
        .map(|mut k| std::thread::spawn(move || k.wait().unwrap()))
        .collect();
    let report = c.clean_up("job-6").unwrap();
    for r in reapers {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            r.join().unwrap().signal(),
            Some(rustix::process::Signal::KILL.as_raw())
        );
    }
    assert_eq!(report.killed, pids);
    assert!(report.removed);
    assert!(!dir2.exists());
    let again = c.clean_up("job-6").unwrap();
    assert!(again.killed.is_empty() && !again.removed);
}

/// With `cgroup.kill` the kernel kills the subtree; removal waits for each child to report
/// `populated 0` and removes the deepest first.
#[test]
fn v2_removal_waits_for_nested_children_to_empty_deepest_first() {
    let root = tempfile::tempdir().unwrap();
    let cg = v2_tree(root.path());
    let c = Cgroups::detect(root.path()).unwrap();
    c.create("job-7", &limits()).unwrap();
    let dir = cg.join("kernelkite/job-7");
    let leaf = dir.join("x/y/z");
    std::fs::create_dir_all(&leaf).unwrap();
    let kid = sleeper();
    let pid = kid.id();
    std::fs::write(leaf.join("cgroup.procs"), format!("{pid}\n")).unwrap();
    std::fs::write(dir.join("cgroup.kill"), "").unwrap();
    for sub in ["", "x", "x/y", "x/y/z"] {
        std::fs::write(
            dir.join(sub).join("cgroup.events"),
            "populated 1\nfrozen 0\n",
        )
        .unwrap();
    }
    // The "kernel": on cgroup.kill, empty the leaf and kill; then report the cgroups
    // unpopulated one at a time, deepest first, with a pause, checking that nothing above a
    // populated cgroup has been removed yet.
    let stop = Arc::new(AtomicBool::new(false));
    let (d, s) = (dir.clone(), stop.clone());
    let kernel = std::thread::spawn(move || {
        let mut kid = kid;
        while !s.load(Ordering::SeqCst) {
            let kill = std::fs::read_to_string(d.join("cgroup.kill")).unwrap_or_default();
            if kill.trim() == "1" {
                let _ = std::fs::write(d.join("x/y/z/cgroup.procs"), "");
                let _ = std::fs::remove_file(d.join("cgroup.kill"));
                kid.kill().unwrap();
                kid.wait().unwrap();
                for sub in ["x/y/z", "x/y", "x", ""] {
                    std::thread::sleep(Duration::from_millis(50));
                    assert!(d.join(sub).exists(), "{sub} removed while populated");
                    std::fs::write(d.join(sub).join("cgroup.events"), "populated 0\nfrozen 0\n")
                        .unwrap();
                }
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = kid.kill();
        let _ = kid.wait();
    });
    let report = c.clean_up("job-7").unwrap();
    stop.store(true, Ordering::SeqCst);
    kernel.join().unwrap();
    assert_eq!(report.killed, vec![pid]);
    assert!(!dir.exists());
}

/// Nesting cgroups past the walk's bounds must not shield a job's processes: what the walk can
/// see is killed, then the oversized tree is reported.
#[test]
fn an_oversized_tree_still_has_its_visible_processes_killed() {
    let root = tempfile::tempdir().unwrap();
    let cg = v2_tree(root.path());
    let c = Cgroups::detect(root.path()).unwrap();
    c.create("job-10", &limits()).unwrap();
    let dir = cg.join("kernelkite/job-10");
    let mut deep = dir.join("deep");
    for _ in 0..40 {
        deep.push("d");
    }
    std::fs::create_dir_all(&deep).unwrap();
    std::fs::create_dir_all(dir.join("a")).unwrap();
    let mut kid = sleeper();
    std::fs::write(dir.join("a/cgroup.procs"), format!("{}\n", kid.id())).unwrap();
    let reaper = std::thread::spawn(move || kid.wait().unwrap());
    let e = c.clean_up("job-10").unwrap_err();
    assert!(e.to_string().contains("deeper than 32"), "{e}");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        reaper.join().unwrap().signal(),
        Some(rustix::process::Signal::KILL.as_raw())
    );
}

#[test]
fn a_hostile_cgroup_tree_is_refused_not_walked_forever() {
    let root = tempfile::tempdir().unwrap();
    let cg = v2_tree(root.path());
    let c = Cgroups::detect(root.path()).unwrap();
    c.create("job-8", &limits()).unwrap();
    let dir = cg.join("kernelkite/job-8");
    let mut deep = dir.clone();
    for _ in 0..40 {
        deep.push("d");
    }
    std::fs::create_dir_all(&deep).unwrap();
    let e = c.clean_up("job-8").unwrap_err();
    assert!(e.to_string().contains("deeper than 32"), "{e}");
    // A symlink out of the job's subtree is not followed: the target survives.
    let outside = root.path().join("outside");
    std::fs::create_dir_all(outside.join("keep")).unwrap();
    std::fs::remove_dir_all(dir.join("d")).unwrap();
    std::os::unix::fs::symlink(&outside, dir.join("link")).unwrap();
    c.clean_up("job-8").unwrap();
    assert!(outside.join("keep").exists());
    assert!(!dir.exists());
    // Too many cgroups.
    c.create("job-9", &limits()).unwrap();
    let dir = cg.join("kernelkite/job-9");
    for i in 0..10_001 {
        std::fs::create_dir_all(dir.join(format!("{}/{i}", i % 100))).unwrap();
    }
    let e = c.clean_up("job-9").unwrap_err();
    assert!(e.to_string().contains("more than 10000"), "{e}");
}
