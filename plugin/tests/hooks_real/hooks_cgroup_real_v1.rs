//! What only cgroup v1 does, against the machine's real v1 hierarchies, as root: the job's
//! `devices` cgroup denies other GPUs' device nodes, and `pre-exit` finds processes a job moved
//! into child cgroups of its own in every hierarchy. Skipped with a reason where the hooks'
//! cgroups are not v1 or not writable.

use crate::agent;
use crate::real_cgroups;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agent::{output_text, Install};
use real_cgroups::{alive, claim, node, real_cgroups, unique, wait_for_file, CgroupGuard};

#[test]
fn denied_devices_cannot_be_opened_on_v1() {
    let Some(cg) = real_cgroups() else { return };
    if cg.version() != 1 || !Path::new("/sys/fs/cgroup/devices/devices.deny").exists() {
        kernelkite_testkit::skip("no cgroup v1 devices hierarchy here");
        return;
    }
    let name = unique("devices");
    let _guard = CgroupGuard(vec![name.clone()]);
    claim(&name);
    // /dev/zero (c 1:5) stands in for another job's GPU, which this machine lacks.
    let limits = kernelkite_hooks::cgroup::Limits {
        cpus: vec![0],
        mems: vec![0],
        memory_bytes: 64 << 20,
        pids: 64,
        deny_devices: vec![kernelkite_hooks::cgroup::CharDevice { major: 1, minor: 5 }],
    };
    cg.create(&name, &limits).unwrap();
    let confinement = kernelkite_hooks::confine::Confinement {
        procs_files: cg.procs_files(&name).unwrap(),
        isolate_network: false,
    };
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.args(["-c", "head -c 1 /dev/zero >/dev/null && echo zero-ok; head -c 1 /dev/urandom >/dev/null && echo urandom-ok"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = kernelkite_hooks::confine::spawn(&mut cmd, &confinement).unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stdout.contains("zero-ok"),
        "the denied device opened: {stdout}"
    );
    assert!(stderr.contains("Operation not permitted"), "{stderr}");
    assert!(
        stdout.contains("urandom-ok"),
        "other devices must still work: {stdout} {stderr}"
    );
}

#[test]
fn pre_exit_kills_a_process_moved_into_a_child_cgroup_on_v1() {
    let Some(cg) = real_cgroups() else { return };
    if cg.version() != 1 {
        kernelkite_testkit::skip("this machine's job cgroups are not cgroup v1");
        return;
    }
    let root = Path::new("/sys/fs/cgroup");
    let mut hierarchies = vec!["cpuset", "memory", "pids", "freezer"];
    if root.join("devices/cgroup.procs").exists() {
        hierarchies.push("devices");
    }
    if hierarchies
        .iter()
        .any(|h| !root.join(h).join("cgroup.procs").exists())
    {
        kernelkite_testkit::skip("not every v1 hierarchy is mounted under /sys/fs/cgroup");
        return;
    }
    let (dir, agent) = node(0, 5);
    let id = unique("nested");
    let _guard = CgroupGuard(vec![id.clone()]);
    let pidfile: PathBuf = dir.path().join("daemon.pid");
    // The job (root, host mode) makes `sub/deeper` under its cgroup in every hierarchy and a
    // daemon moves itself there before the command returns.
    let job_dirs: Vec<String> = hierarchies
        .iter()
        .map(|h| format!("{}/{h}/kernelkite/{id}", root.display()))
        .collect();
    let cs = &job_dirs[0];
    let command = format!(
        "set -e; for d in {dirs}; do mkdir -p $d/sub/deeper; done; \
         for c in $(echo {cs}/sub {cs}/sub/deeper); do \
           cat $(dirname $c)/cpuset.cpus > $c/cpuset.cpus; cat $(dirname $c)/cpuset.mems > $c/cpuset.mems; done; \
         (setsid sh -c 'for d in {dirs}; do echo $$ > $d/sub/deeper/cgroup.procs; done; echo $$ > {pidfile}; exec sleep 300' </dev/null >/dev/null 2>&1 &); echo started",
        dirs = job_dirs.join(" "),
        pidfile = pidfile.display()
    );
    let mut job = agent.start_job(&id, &command, None, Install::AgentBinary);
    assert!(job.run_hook("environment").status.success());
    let cmd = job.run_hook("command");
    assert!(cmd.status.success(), "{}", output_text(&cmd));
    let pid: u32 = wait_for_file(&pidfile).trim().parse().unwrap();
    assert!(alive(pid), "the daemon should outlive the command");
    assert!(
        !cg.pids(&id).unwrap().contains(&pid),
        "the daemon should have left the job cgroup itself for its child"
    );
    for d in &job_dirs {
        let procs = std::fs::read_to_string(format!("{d}/sub/deeper/cgroup.procs")).unwrap();
        assert!(
            procs.lines().any(|l| l.trim() == pid.to_string()),
            "{d}: {procs}"
        );
    }

    let exit = job.run_hook("pre-exit");
    assert!(exit.status.success(), "{}", output_text(&exit));
    let report = String::from_utf8_lossy(&exit.stdout);
    assert!(
        report.contains("killed 1 leftover process(es)") && report.contains(&pid.to_string()),
        "{}",
        output_text(&exit)
    );
    let start = Instant::now();
    while alive(pid) && start.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!alive(pid), "pre-exit left the daemon running");
    for d in &job_dirs {
        assert!(!Path::new(d).exists(), "pre-exit left {d}");
    }
    assert!(
        cg.jobs().iter().all(|j| j != &id),
        "pre-exit left the cgroup"
    );
    let again = job.run_hook("pre-exit");
    assert!(
        again.status.success()
            && String::from_utf8_lossy(&again.stdout).contains("nothing to clean up"),
        "{}",
        output_text(&again)
    );
}
