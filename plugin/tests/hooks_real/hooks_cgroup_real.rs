//! The hooks against the machine's real cgroups, whichever version the hooks pick (v1 or v2),
//! as root: cpuset and limits seen from inside, an OOM-killed memory hog, a daemonized
//! grandchild killed by `pre-exit`, a lost job cleaned up by the next, loopback-only network,
//! memory limits changed in place. Version-specific behaviour is in `hooks_cgroup_real_v1.rs`
//! and `hooks_cgroup_real_v2.rs`. Skipped with a reason when not root or when the hierarchy
//! is not writable.

use crate::agent;
use crate::real_cgroups;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agent::{output_text, Install};
use real_cgroups::{
    alive, claim, node, node_with_run_dir, online_cpus, real_cgroups, unique, wait_for_file,
    CgroupGuard,
};

#[test]
fn command_sees_only_its_cpuset_and_limits() {
    let Some(_cg) = real_cgroups() else { return };
    let cpus = online_cpus();
    let cpu = *cpus.last().unwrap();
    let (_dir, agent) = node(cpu, 0);
    let id = unique("cpuset");
    let _guard = CgroupGuard(vec![id.clone()]);
    let mut job = agent.start_job(
        &id,
        // Widening the affinity from inside must not help: the cpuset masks it.
        "taskset -pc 0-4095 $$ >/dev/null 2>&1 || true; echo nproc=$(nproc); grep -E '^(Cpus|Mems)_allowed_list' /proc/self/status",
        None,
        Install::AgentBinary,
    );
    let outs = job.run_all();
    for (hook, o) in &outs {
        assert!(o.status.success(), "{hook}: {}", output_text(o));
    }
    let stdout = String::from_utf8_lossy(&outs[1].1.stdout);
    assert!(stdout.contains("nproc=1"), "{stdout}");
    let allowed = stdout
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim();
    assert_eq!(
        allowed,
        cpu.to_string(),
        "sched_getaffinity must be the slice's cpuset"
    );
    assert!(stdout.contains("Mems_allowed_list:\t0"), "{stdout}");
}

#[test]
fn memory_hog_is_oom_killed_and_reported() {
    let Some(_cg) = real_cgroups() else { return };
    let (_dir, agent) = node(0, 1);
    let id = unique("oom");
    let _guard = CgroupGuard(vec![id.clone()]);
    // `tail -n 1` keeps a line without a newline in memory: 512 MiB against a 64 MiB limit.
    let mut job = agent.start_job(
        &id,
        "head -c 512M /dev/zero | tail -n 1 >/dev/null",
        None,
        Install::AgentBinary,
    );
    assert!(job.run_hook("environment").status.success());
    let cmd = job.run_hook("command");
    assert!(
        !cmd.status.success(),
        "the hog survived: {}",
        output_text(&cmd)
    );
    let err = String::from_utf8_lossy(&cmd.stderr);
    assert!(
        err.contains("memory limit of 67108864 bytes") && err.contains("OOM-killed"),
        "{}",
        output_text(&cmd)
    );
    assert!(job.run_hook("pre-exit").status.success());
}

#[test]
fn daemonized_grandchild_is_killed_by_pre_exit() {
    let Some(cg) = real_cgroups() else { return };
    let (dir, agent) = node(0, 2);
    let id = unique("daemon");
    let _guard = CgroupGuard(vec![id.clone()]);
    let pidfile: PathBuf = dir.path().join("daemon.pid");
    let command = format!(
        "(setsid sh -c 'echo $$ > {}; exec sleep 300' </dev/null >/dev/null 2>&1 &) ; echo started",
        pidfile.display()
    );
    let mut job = agent.start_job(&id, &command, None, Install::AgentBinary);
    assert!(job.run_hook("environment").status.success());
    let cmd = job.run_hook("command");
    assert!(cmd.status.success(), "{}", output_text(&cmd));
    let pid: u32 = wait_for_file(&pidfile).trim().parse().unwrap();
    assert!(alive(pid), "the daemon should outlive the command");
    assert!(
        cg.pids(&id).unwrap().contains(&pid),
        "the daemon escaped the job cgroup"
    );

    let exit = job.run_hook("pre-exit");
    assert!(exit.status.success(), "{}", output_text(&exit));
    let report = String::from_utf8_lossy(&exit.stdout);
    assert!(
        report.contains("killed 1 leftover process(es)") && report.contains(&pid.to_string()),
        "{report}"
    );
    let start = Instant::now();
    while alive(pid) && start.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!alive(pid), "pre-exit left the daemon running");
    assert!(
        cg.jobs().iter().all(|j| j != &id),
        "pre-exit left the cgroup"
    );
    let again = job.run_hook("pre-exit");
    assert!(
        again.status.success()
            && String::from_utf8_lossy(&again.stdout).contains("nothing to clean up")
    );
}

#[test]
fn next_job_cleans_up_after_a_lost_one() {
    let Some(cg) = real_cgroups() else { return };
    let (dir, agent) = node(0, 3);
    let lost_id = unique("lost");
    let next_id = unique("next");
    let _guard = CgroupGuard(vec![lost_id.clone(), next_id.clone()]);
    let pidfile = dir.path().join("lost.pid");
    let command = format!(
        "(setsid sh -c 'echo $$ > {}; exec sleep 300' </dev/null >/dev/null 2>&1 &)",
        pidfile.display()
    );
    let mut lost = agent.start_job(&lost_id, &command, None, Install::AgentBinary);
    assert!(lost.run_hook("environment").status.success());
    assert!(lost.run_hook("command").status.success());
    let pid: u32 = wait_for_file(&pidfile).trim().parse().unwrap();
    // Agent lost: the bootstrap dies and pre-exit never runs.
    lost.bootstrap.kill().unwrap();
    lost.bootstrap.wait().unwrap();
    assert!(alive(pid));

    let mut next = agent.start_job(
        &next_id,
        "true",
        Some(r#"{"lease-wait":0}"#),
        Install::AgentBinary,
    );
    let out = next.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
    // Every `environment` hook cleans every lost job of the node's run dir, and this binary's
    // tests share one (as a node's agents do): another test's job may get there first. Either
    // way the lost job is gone below; which hook did it is printed.
    let ours = String::from_utf8_lossy(&out.stderr).contains(&format!("job {lost_id}: killed 1"));
    if !ours {
        eprintln!(
            "the lost job was cleaned up by another job's environment hook on this shared node"
        );
    }
    let start = Instant::now();
    while alive(pid) && start.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        !alive(pid),
        "the lost job's process outlived the next job's environment hook"
    );
    assert!(!cg.jobs().contains(&lost_id));
    assert!(!real_cgroups::state_file(&lost_id).exists());
    assert!(next.run_hook("pre-exit").status.success());
}

/// A second kernelkite instance on the node (another run dir) does not take the first's
/// running job for a lost one: its `environment` refuses, naming the job's cgroup and the run
/// dir, holds nothing, and the job's processes live on until the first instance's `pre-exit`.
#[test]
fn a_second_instance_with_another_run_dir_is_refused_and_kills_nothing() {
    let Some(cg) = real_cgroups() else { return };
    let (dir, agent) = node(0, 5);
    let id = unique("first");
    let other_id = unique("second");
    let _guard = CgroupGuard(vec![id.clone(), other_id.clone()]);
    let pidfile = dir.path().join("first.pid");
    let command = format!(
        "(setsid sh -c 'echo $$ > {}; exec sleep 300' </dev/null >/dev/null 2>&1 &)",
        pidfile.display()
    );
    let mut first = agent.start_job(&id, &command, None, Install::AgentBinary);
    assert!(first.run_hook("environment").status.success());
    assert!(first.run_hook("command").status.success());
    let pid: u32 = wait_for_file(&pidfile).trim().parse().unwrap();

    let other_run = tempfile::tempdir().unwrap();
    let (_other_dir, other_agent) = node_with_run_dir(0, 6, &other_run.path().join("run"));
    let mut second = other_agent.start_job(&other_id, "true", None, Install::AgentBinary);
    let out = second.run_hook("environment");
    let text = output_text(&out);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("another kernelkite instance") && text.contains(&format!("kernelkite/{id}")),
        "{text}"
    );
    assert!(
        !cg.jobs().contains(&other_id),
        "the refused job holds nothing"
    );
    assert!(alive(pid), "the first instance's job was killed");
    assert!(cg.pids(&id).unwrap().contains(&pid));

    assert!(first.run_hook("pre-exit").status.success());
    let start = Instant::now();
    while alive(pid) && start.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!alive(pid));
}

#[test]
fn network_can_be_cut_to_loopback_only() {
    let Some(_cg) = real_cgroups() else { return };
    let (_dir, agent) = node(0, 4);
    let id = unique("net");
    let _guard = CgroupGuard(vec![id.clone()]);
    // /proc/net/dev is per network namespace; connecting to a closed loopback port is refused
    // (lo is up) while any other address is unreachable.
    let command = "cut -d: -f1 /proc/net/dev | tail -n +3 | tr -d ' '; \
        (exec 3<>/dev/tcp/127.0.0.1/9) 2>&1 | sed 's/.*: //' ; \
        (exec 3<>/dev/tcp/192.0.2.1/80) 2>&1 | sed 's/.*: //'; true";
    let mut job = agent.start_job(
        &id,
        command,
        Some(r#"{"network":false}"#),
        Install::AgentBinary,
    );
    let outs = job.run_all();
    for (hook, o) in &outs {
        assert!(o.status.success(), "{hook}: {}", output_text(o));
    }
    let stdout = String::from_utf8_lossy(&outs[1].1.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines[0], "lo", "only loopback may exist: {stdout}");
    assert!(
        stdout.contains("Connection refused"),
        "loopback must be up: {stdout}"
    );
    assert!(stdout.contains("Network is unreachable"), "{stdout}");
}

#[test]
fn an_existing_job_cgroup_can_be_given_a_larger_or_smaller_memory_limit() {
    let Some(cg) = real_cgroups() else { return };
    let name = unique("resize");
    let _guard = CgroupGuard(vec![name.clone()]);
    claim(&name);
    let limits = |memory_bytes: u64| kernelkite_hooks::cgroup::Limits {
        cpus: vec![0],
        mems: vec![0],
        memory_bytes,
        pids: 64,
        allow_devices: None,
    };
    // On v1 the memory limit may never exceed memory+swap: growing must raise memsw first,
    // shrinking must lower the memory limit first.
    cg.create(&name, &limits(64 << 20)).unwrap();
    cg.create(&name, &limits(256 << 20)).unwrap();
    cg.create(&name, &limits(128 << 20)).unwrap();
    let file = match cg.version() {
        1 => "/sys/fs/cgroup/memory/kernelkite",
        _ => "",
    };
    if !file.is_empty() {
        let dir = Path::new(file).join(&name);
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
        assert_eq!(
            read("memory.limit_in_bytes").trim(),
            (128u64 << 20).to_string()
        );
        if dir.join("memory.memsw.limit_in_bytes").exists() {
            assert_eq!(
                read("memory.memsw.limit_in_bytes").trim(),
                (128u64 << 20).to_string()
            );
        }
    }
}
