//! The hooks against the machine's real cgroups (v1 or v2, whichever it has), as root.
//! Skipped with a reason when not root or when the hierarchy is not writable.

mod agent;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agent::{output_text, Agent, Install};
use kernelkite_isolate::cgroup::Cgroups;
use serde_json::json;

/// Removes the test's job cgroups (and any state claiming them) however the test ends.
struct CgroupGuard(Vec<String>);

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        if let Ok(cg) = Cgroups::detect(Path::new("/")) {
            for job in &self.0 {
                let _ = cg.clean_up(job);
                let _ = std::fs::remove_file(state_file(job));
            }
        }
    }
}

fn state_file(job: &str) -> PathBuf {
    shared_run_dir().join("jobs").join(format!("{job}.json"))
}

/// Records a live job for a cgroup a test creates directly (not through the hooks). Tests run
/// in parallel and the `environment` hooks of the others clean every job cgroup that has no
/// live state as an orphan, which would kill this test's processes mid-run.
fn claim(job: &str) {
    use kernelkite_isolate::job::JobState;
    let state = JobState {
        job_id: job.to_string(),
        agent: "test".into(),
        anchor: kernelkite_isolate::process::identify(Path::new("/proc"), std::process::id())
            .unwrap(),
        gpus: vec![],
        device_indices: vec![],
        slice: kernelkite_topology::plan::Slice {
            index: 0,
            gpu: None,
            extra_gpus: vec![],
            cpus: vec![0],
            mems: vec![0],
            memory_bytes: 64 << 20,
        },
        config: Default::default(),
        cgroup_version: None,
        clocks_locked: false,
        exports: Default::default(),
    };
    let path = state_file(job);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, serde_json::to_string(&state).unwrap()).unwrap();
}

fn real_cgroups() -> Option<Cgroups> {
    if !rustix::process::geteuid().is_root() {
        kernelkite_testkit::skip("real cgroup tests need root");
        return None;
    }
    let cg = match Cgroups::detect(Path::new("/")) {
        Ok(cg) => cg,
        Err(e) => {
            kernelkite_testkit::skip(format_args!("no usable cgroups here: {e}"));
            return None;
        }
    };
    let probe = format!("kk-probe-{}", std::process::id());
    let _guard = CgroupGuard(vec![probe.clone()]);
    claim(&probe);
    let limits = kernelkite_isolate::cgroup::Limits {
        cpus: vec![0],
        mems: vec![0],
        memory_bytes: 64 << 20,
        pids: 64,
        deny_devices: vec![],
    };
    let ok = cg.create(&probe, &limits);
    let _ = cg.clean_up(&probe);
    if let Err(e) = ok {
        kernelkite_testkit::skip(format_args!("cgroups not writable here: {e}"));
        return None;
    }
    eprintln!("using real cgroup v{}", cg.version());
    Some(cg)
}

fn unique(tag: &str) -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    format!("kk-test-{tag}-{}-{n}", std::process::id())
}

/// All tests share one run dir, as every agent on a node must: the `environment` hook treats a
/// job cgroup with no state in its run dir as orphaned.
fn shared_run_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().unwrap())
        .path()
        .join("run")
}

/// An agent bound to GPU `gpu` of a node whose slices all sit on `cpu` with a 64 MiB limit.
fn node(cpu: u32, gpu: u32) -> (tempfile::TempDir, Agent) {
    let dir = tempfile::tempdir().unwrap();
    let slices: Vec<serde_json::Value> = (0..8)
        .map(|i| {
            json!({"index": i, "gpu": {"vendor": "nvidia", "pci_bus_id": format!("0000:{:02x}:00.0", 0x18 + i),
                     "uuid": null, "numa_node": 0},
                   "cpus": [cpu], "mems": [0], "memory_bytes": 64u64 << 20})
        })
        .collect();
    let plan = json!({"slices": slices, "reserved_cpus": [], "warnings": []});
    std::fs::write(dir.path().join("plan.json"), plan.to_string()).unwrap();
    let mut env = std::collections::BTreeMap::new();
    env.insert(
        "KERNELKITE_RUN_DIR".to_string(),
        shared_run_dir().display().to_string(),
    );
    env.insert(
        "KERNELKITE_PLAN_FILE".to_string(),
        dir.path().join("plan.json").display().to_string(),
    );
    env.insert("KERNELKITE_CGROUP_ROOT".to_string(), "/".to_string());
    env.insert(
        "BUILDKITE_AGENT_META_DATA_GPU_INDEX".to_string(),
        gpu.to_string(),
    );
    let agent = Agent::new(dir.path(), &format!("real-gpu{gpu}"), &env);
    (dir, agent)
}

fn online_cpus() -> Vec<u32> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_default();
    kernelkite_topology::cpulist::parse_cpu_list(&text).unwrap_or_default()
}

fn alive(pid: u32) -> bool {
    // A zombie is dead for our purpose.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}

fn wait_for_file(path: &Path) -> String {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        if let Ok(s) = std::fs::read_to_string(path) {
            if !s.trim().is_empty() {
                return s;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("{} never appeared", path.display());
}

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
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!("job {lost_id}: killed 1")),
        "{}",
        output_text(&out)
    );
    let start = Instant::now();
    while alive(pid) && start.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!alive(pid));
    assert!(!cg.jobs().contains(&lost_id));
    assert!(next.run_hook("pre-exit").status.success());
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

/// The machine's cgroup2 mount, even one without controllers (hybrid v1 machines have one at
/// /sys/fs/cgroup/unified): membership, `cgroup.kill` and removal work the same there.
fn cgroup2_mount() -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    kernelkite_isolate::cgroup::parse_mountinfo(&text)
        .into_iter()
        .find(|m| m.fs_type == "cgroup2")
        .map(|m| PathBuf::from(m.mount_point))
}

#[test]
fn real_cgroup_v2_kills_a_daemonized_grandchild() {
    let Some((v2, name, dir)) = real_v2("v2", "") else {
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
    let Some((v2, name, dir)) = real_v2("clone3", "") else {
        return;
    };
    let _guard = scopeguard(v2.clone(), name.clone());
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("cgroup");
    let env: std::collections::BTreeMap<String, String> =
        [("PATH".to_string(), "/usr/bin:/bin".to_string())].into();
    let script = format!("cat /proc/self/cgroup > {}", out.display());
    let started = kernelkite_isolate::confine::spawn_into_cgroup2(
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
    let err = kernelkite_isolate::confine::spawn_into_cgroup2(
        std::ffi::OsStr::new("/nonexistent/prog"),
        &[],
        &env,
        &dir,
        false,
    )
    .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
}

/// A fresh job cgroup on this machine's cgroup2 mount, with `sub` (a relative path, or "")
/// created under it: (the v2 interface, the job's name, its directory). `None`, after saying
/// why, where real cgroup v2 tests cannot run.
fn real_v2(
    prefix: &str,
    sub: &str,
) -> Option<(
    kernelkite_isolate::cgroup::v2::V2,
    String,
    std::path::PathBuf,
)> {
    if !rustix::process::geteuid().is_root() {
        kernelkite_testkit::skip("real cgroup tests need root");
        return None;
    }
    let Some(mount) = cgroup2_mount() else {
        kernelkite_testkit::skip("no cgroup2 mount");
        return None;
    };
    let v2 = kernelkite_isolate::cgroup::v2::V2::new(mount.clone());
    let name = unique(prefix);
    let dir = v2.base().join(&name);
    if std::fs::create_dir_all(dir.join(sub)).is_err() {
        kernelkite_testkit::skip(format_args!("{} is not writable", mount.display()));
        return None;
    }
    Some((v2, name, dir))
}

struct V2Guard(kernelkite_isolate::cgroup::v2::V2, String);
impl Drop for V2Guard {
    fn drop(&mut self) {
        let _ = self.0.clean_up(&self.1);
    }
}
fn scopeguard(v2: kernelkite_isolate::cgroup::v2::V2, name: String) -> V2Guard {
    V2Guard(v2, name)
}

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
    let limits = kernelkite_isolate::cgroup::Limits {
        cpus: vec![0],
        mems: vec![0],
        memory_bytes: 64 << 20,
        pids: 64,
        deny_devices: vec![kernelkite_isolate::cgroup::CharDevice { major: 1, minor: 5 }],
    };
    cg.create(&name, &limits).unwrap();
    let confinement = kernelkite_isolate::confine::Confinement {
        procs_files: cg.procs_files(&name).unwrap(),
        isolate_network: false,
    };
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.args(["-c", "head -c 1 /dev/zero >/dev/null && echo zero-ok; head -c 1 /dev/urandom >/dev/null && echo urandom-ok"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = kernelkite_isolate::confine::spawn(&mut cmd, &confinement).unwrap();
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
fn an_existing_job_cgroup_can_be_given_a_larger_or_smaller_memory_limit() {
    let Some(cg) = real_cgroups() else { return };
    let name = unique("resize");
    let _guard = CgroupGuard(vec![name.clone()]);
    claim(&name);
    let limits = |memory_bytes: u64| kernelkite_isolate::cgroup::Limits {
        cpus: vec![0],
        mems: vec![0],
        memory_bytes,
        pids: 64,
        deny_devices: vec![],
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

/// A process hidden deeper than clean-up walks is still killed on v2: `cgroup.kill` covers the
/// whole subtree, and is written whatever the walk saw.
#[test]
fn real_cgroup_v2_kills_a_process_hidden_below_the_walk_bound() {
    let deep = vec!["d"; kernelkite_isolate::cgroup::MAX_TREE_DEPTH + 2].join("/");
    let Some((v2, name, dir)) = real_v2("v2hidden", &deep) else {
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
        if let Some(daemon) = rustix::process::Pid::from_raw(pid as i32) {
            let _ = rustix::process::kill_process(daemon, rustix::process::Signal::KILL);
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
    let confinement = kernelkite_isolate::confine::Confinement {
        procs_files,
        isolate_network: false,
    };
    let mut child = kernelkite_isolate::confine::spawn(&mut cmd, &confinement).unwrap();
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

#[test]
fn real_cgroup_v2_kills_and_removes_nested_child_cgroups() {
    let Some((v2, name, dir)) = real_v2("v2nested", "sub/deeper") else {
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
