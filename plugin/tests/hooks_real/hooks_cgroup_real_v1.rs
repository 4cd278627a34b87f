//! What only cgroup v1 does, against the machine's real v1 hierarchies, as root: the job's
//! `devices` cgroup allows only the base set and the job's own GPU nodes (set up in under a
//! millisecond against the driver's whole capability table), and `pre-exit` finds processes a
//! job moved into child cgroups of its own in every hierarchy. Skipped with a reason where the hooks'
//! cgroups are not v1 or not writable.

use crate::agent;
use crate::real_cgroups;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agent::{output_text, Install};
use kernelkite_hooks::cgroup::{CharDevice, BASE_DEVICE_RULES};
use real_cgroups::{alive, claim, node, real_cgroups, unique, wait_for_file, CgroupGuard};

/// The v1 devices hierarchy the job cgroups are made in, or a skip saying why not.
fn devices_hierarchy() -> Option<crate::real_cgroups::RealCgroups> {
    let cg = real_cgroups()?;
    if cg.version() != 1 || !Path::new("/sys/fs/cgroup/devices/devices.deny").exists() {
        kernelkite_testkit::skip("no cgroup v1 devices hierarchy here");
        return None;
    }
    Some(cg)
}

/// A job cgroup `name` made with `allow_devices` (`None`: none yet).
fn job_cgroup(
    cg: &kernelkite_hooks::cgroup::Cgroups,
    name: &str,
    allow_devices: Option<Vec<CharDevice>>,
) -> PathBuf {
    let limits = kernelkite_hooks::cgroup::Limits {
        cpus: vec![0],
        mems: vec![0],
        memory_bytes: 64 << 20,
        pids: 64,
        allow_devices,
    };
    cg.create(name, &limits).unwrap();
    Path::new("/sys/fs/cgroup/devices")
        .join(kernelkite_hooks::cgroup::PARENT)
        .join(name)
}

/// Only the base set and the job's own nodes open: a node the cgroup allows but no driver
/// serves says ENXIO, one it does not says EPERM, and `/dev/urandom` (the base set) reads.
#[test]
fn only_the_job_s_devices_open_on_v1() {
    let Some(cg) = devices_hierarchy() else {
        return;
    };
    let name = unique("devices");
    let _guard = CgroupGuard(vec![name.clone()]);
    claim(&name);
    // A major no driver of this machine has: the job's capability node (30) and another MIG
    // device's (31), made where device nodes open (the target directory, not /tmp).
    const CAPS_MAJOR: u32 = 508;
    let own = CharDevice {
        major: CAPS_MAJOR,
        minor: 30,
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    for minor in [30, 31] {
        let ok = std::process::Command::new("mknod")
            .arg(dir.path().join(format!("cap{minor}")))
            .args(["c", &CAPS_MAJOR.to_string(), &minor.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "mknod cap{minor}");
    }
    let devices = job_cgroup(&cg, &name, Some(vec![own]));
    let listed = std::fs::read_to_string(devices.join("devices.list")).unwrap();
    let mut listed: Vec<&str> = listed.lines().collect();
    let mut want: Vec<&str> = BASE_DEVICE_RULES.to_vec();
    want.push("c 508:30 rwm");
    listed.sort_unstable();
    want.sort_unstable();
    assert_eq!(listed, want);
    let confinement = kernelkite_hooks::confine::Confinement {
        procs_files: cg.procs_files(&name).unwrap(),
        isolate_network: false,
    };
    let script = format!(
        "echo \"own: $( (exec 3< {0}/cap30) 2>&1 | sed 's/.*: //')\"; \
         echo \"other: $( (exec 3< {0}/cap31) 2>&1 | sed 's/.*: //')\"; \
         head -c 1 /dev/urandom >/dev/null && echo urandom-ok",
        dir.path().display()
    );
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.args(["-c", &script])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = kernelkite_hooks::confine::spawn(&mut cmd, &confinement).unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stdout.contains("own: No such device or address"),
        "{stdout} {stderr}"
    );
    assert!(
        stdout.contains("other: Operation not permitted"),
        "{stdout} {stderr}"
    );
    assert!(stdout.contains("urandom-ok"), "{stdout} {stderr}");
}

/// Issue 36: a job's device set-up on a node whose driver lists its whole capability table
/// (4,322 minors, every NVIDIA node's) costs under a millisecond: reading the job's nodes from
/// the driver's files and writing its rules. Denying every capability one by one, as before,
/// measured 105.6 ms per job on a real node; printed here beside it for the record.
#[test]
fn device_rules_take_under_a_millisecond_on_v1() {
    let Some(cg) = devices_hierarchy() else {
        return;
    };
    let driver = tempfile::tempdir().unwrap();
    let r = driver.path();
    kernelkite_testkit::fake_nvml::write_mig_minors(r, 508).unwrap();
    let info = r.join("proc/driver/nvidia/gpus/0000:2a:00.0");
    std::fs::create_dir_all(&info).unwrap();
    std::fs::write(info.join("information"), "Device Minor: \t 1\n").unwrap();
    let slice: kernelkite_topology::plan::Slice = serde_json::from_value(serde_json::json!({
        "index": 0,
        "gpu": {"vendor": "nvidia", "pci_bus_id": "0000:2a:00.0", "uuid": "MIG-x", "numa_node": 0,
                "mig": {"uuid": "MIG-x", "gpu_instance_id": 3, "compute_instance_id": 0,
                        "memory_bytes": 20u64 << 30}},
        "cpus": [0], "mems": [0], "memory_bytes": 64u64 << 20}))
    .unwrap();
    let runs = 9;
    let names: Vec<String> = (0..=runs).map(|i| unique(&format!("devcost{i}"))).collect();
    let _guard = CgroupGuard(names.clone());
    let (mut times, mut reads, mut writes) = (Vec::new(), Vec::new(), Vec::new());
    for name in &names[..runs] {
        claim(name);
        let dir = job_cgroup(&cg, name, None);
        let t = Instant::now();
        let allow = kernelkite_hooks::job::devices::job_devices(r, &slice);
        let read = t.elapsed();
        kernelkite_hooks::cgroup::v1::restrict_devices(&dir, &allow).unwrap();
        times.push(t.elapsed());
        reads.push(read);
        writes.push(t.elapsed() - read);
        assert_eq!(allow.len(), 7, "{allow:?}");
    }
    for v in [&mut times, &mut reads, &mut writes] {
        v.sort_unstable();
    }
    let median = times[runs / 2];
    // The old way, once: one deny rule per capability the driver lists.
    let old = &names[runs];
    claim(old);
    let dir = job_cgroup(&cg, old, None);
    let table = kernelkite_testkit::fake_nvml::mig_minors_table();
    let t = Instant::now();
    for line in table.lines() {
        let minor = line.rsplit(' ').next().unwrap();
        std::fs::write(dir.join("devices.deny"), format!("c 508:{minor} rwm")).unwrap();
    }
    let before = t.elapsed();
    println!(
        "device set-up per job, {} capability minors listed: median {:.3} ms of {runs} (reading the driver's files {:.3}, writing {} rules {:.3}; min {:.3}, max {:.3}); one deny rule per minor: {:.1} ms",
        table.lines().count(),
        median.as_secs_f64() * 1e3,
        reads[runs / 2].as_secs_f64() * 1e3,
        BASE_DEVICE_RULES.len() + 7,
        writes[runs / 2].as_secs_f64() * 1e3,
        times[0].as_secs_f64() * 1e3,
        times[runs - 1].as_secs_f64() * 1e3,
        before.as_secs_f64() * 1e3,
    );
    assert!(median <= Duration::from_millis(1), "median {median:?}");
}

/// On v1 every host-mode job's `devices` cgroup holds only the base set, on a node with no GPU
/// driver too (no other GPU to keep out): a device node the job finds outside its `/dev` does
/// not open whatever its mode. Root without the sandbox here, the strongest a job can be.
#[test]
fn a_job_on_a_node_without_gpu_drivers_gets_device_rules_on_v1() {
    let Some(_cg) = devices_hierarchy() else {
        return;
    };
    let (dir, agent) = node(0, 6);
    let kmsg = dir.path().join("kmsg-copy");
    let made = std::process::Command::new("mknod")
        .arg(&kmsg)
        .args(["c", "1", "11"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(made, "mknod {}", kmsg.display());
    let id = unique("devrules");
    let _guard = CgroupGuard(vec![id.clone()]);
    let command = format!(
        "echo \"copy: $( (exec 3< '{}') 2>&1 | sed 's/.*: //')\"; head -c 1 /dev/urandom >/dev/null && echo urandom-ok",
        kmsg.display()
    );
    let mut job = agent.start_job(&id, &command, None, Install::AgentBinary);
    let env_out = job.run_hook("environment");
    assert!(env_out.status.success(), "{}", output_text(&env_out));
    let name = kernelkite_hooks::cgroup::job_cgroup_name(&id).unwrap();
    let devices = Path::new("/sys/fs/cgroup/devices")
        .join(kernelkite_hooks::cgroup::PARENT)
        .join(name);
    // The base set and the NVIDIA slice's shared nodes (`nvidiactl`, `nvidia-modeset`: the
    // driver's fixed numbers), nothing else; an unrestricted cgroup lists `a *:* rwm`.
    let listed = std::fs::read_to_string(devices.join("devices.list")).unwrap();
    let mut listed: Vec<&str> = listed.lines().collect();
    let mut want: Vec<&str> = BASE_DEVICE_RULES.to_vec();
    want.extend(["c 195:254 rwm", "c 195:255 rwm"]);
    listed.sort_unstable();
    want.sort_unstable();
    assert_eq!(listed, want);
    let cmd = job.run_hook("command");
    let stdout = String::from_utf8_lossy(&cmd.stdout);
    assert!(
        stdout.contains("copy: Operation not permitted"),
        "{}",
        output_text(&cmd)
    );
    assert!(stdout.contains("urandom-ok"), "{}", output_text(&cmd));
    assert!(job.run_hook("pre-exit").status.success());
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
