//! What the real-cgroup tests share (`hooks_cgroup_real*.rs`): a check that this machine's
//! cgroups are usable (else the test is skipped with the reason), the node's turn (tests on the
//! shared run dir side by side, a test with a run dir of its own alone), guards that remove a
//! test's job cgroups however it ends, a run dir shared by every test of a binary (as every
//! agent on a node shares one), and agents bound to one GPU of a plan whose slices sit on one
//! CPU. Included with `#[path]` by test crates that also declare `mod agent;`.
#![allow(dead_code)]

use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use crate::agent::Agent;
use kernelkite_hooks::cgroup::Cgroups;
use serde_json::json;

/// Removes the test's job cgroups (and any state claiming them) however the test ends.
pub struct CgroupGuard(pub Vec<String>);

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

/// Where the hooks keep `job`'s state in the shared run dir.
pub fn state_file(job: &str) -> PathBuf {
    shared_run_dir()
        .join(kernelkite_sys::node::JOB_STATE_DIR)
        .join(format!("{job}.json"))
}

/// Records a live job for a cgroup a test creates directly (not through the hooks). Tests run
/// in parallel and the `environment` hooks of the others clean every job cgroup that has no
/// live state as an orphan, which would kill this test's processes mid-run.
pub fn claim(job: &str) {
    use kernelkite_hooks::job::JobState;
    let state = JobState {
        job_id: job.to_string(),
        agent: "test".into(),
        anchor: kernelkite_hooks::process::identify(Path::new("/proc"), std::process::id())
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
        job_user: None,
        checkout_owner: None,
    };
    let path = state_file(job);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    // Atomic, as the hooks write state: a sweep that read a half-written file would take the
    // job for a lost one and remove its state.
    kernelkite_sys::fs::write_atomic(
        &path,
        serde_json::to_string(&state).unwrap().as_bytes(),
        0o600,
    )
    .unwrap();
}

/// The node's job cgroups, as the tests of one binary take turns at them. Every `environment`
/// hook looks at every job cgroup of the node: one with running processes and no state in the
/// hook's run dir is another instance's, and the hook refuses to start. Tests on the shared run
/// dir may therefore run side by side; a test with a run dir of its own (the sandbox tests,
/// which check that their run dir is left as it was) must run alone, or its jobs and the
/// others' make each other's hooks refuse.
static NODE: RwLock<()> = RwLock::new(());

/// A test's turn at the node, held until the test ends.
pub enum Turn {
    Shared(RwLockReadGuard<'static, ()>),
    Alone(RwLockWriteGuard<'static, ()>),
}

/// The turn of a test whose jobs use the shared run dir.
pub fn shared_turn() -> Turn {
    Turn::Shared(NODE.read().unwrap_or_else(|e| e.into_inner()))
}

/// The turn of a test whose jobs use a run dir of their own: no other real-cgroup test runs.
pub fn turn_alone() -> Turn {
    Turn::Alone(NODE.write().unwrap_or_else(|e| e.into_inner()))
}

/// This machine's cgroups as the hooks will use them, and the test's turn at them.
pub struct RealCgroups {
    cg: Cgroups,
    _turn: Turn,
}

impl Deref for RealCgroups {
    type Target = Cgroups;
    fn deref(&self) -> &Cgroups {
        &self.cg
    }
}

/// This machine's cgroups, for a test on the shared run dir ([`shared_turn`]); `None`, after
/// recording why the test is skipped, when not root or not writable.
pub fn real_cgroups() -> Option<RealCgroups> {
    let turn = shared_turn();
    usable_cgroups().map(|cg| RealCgroups { cg, _turn: turn })
}

/// [`real_cgroups`] for a test whose jobs use a run dir of their own ([`turn_alone`]).
pub fn real_cgroups_alone() -> Option<RealCgroups> {
    let turn = turn_alone();
    usable_cgroups().map(|cg| RealCgroups { cg, _turn: turn })
}

/// This machine's cgroups as the hooks will use them, once a probe cgroup could be created;
/// `None`, after recording why the test is skipped, when not root or not writable.
fn usable_cgroups() -> Option<Cgroups> {
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
    // One probe per call: tests run in parallel, and one test removing a shared probe while
    // another writes its limits would skip the other for no reason.
    let probe = unique("probe");
    let _guard = CgroupGuard(vec![probe.clone()]);
    claim(&probe);
    let limits = kernelkite_hooks::cgroup::Limits {
        cpus: vec![0],
        mems: vec![0],
        memory_bytes: 64 << 20,
        pids: 64,
        allow_devices: None,
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

/// A job id no other test (or run) uses.
pub fn unique(tag: &str) -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    format!("kk-test-{tag}-{}-{n}", std::process::id())
}

/// All tests share one run dir, as every agent on a node must: the `environment` hook treats a
/// job cgroup with no state in its run dir as orphaned.
pub fn shared_run_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().unwrap())
        .path()
        .join("run")
}

/// An agent bound to GPU `gpu` of a node whose slices all sit on `cpu` with a 64 MiB limit.
pub fn node(cpu: u32, gpu: u32) -> (tempfile::TempDir, Agent) {
    node_with_run_dir(cpu, gpu, &shared_run_dir())
}

/// [`node`] with a run dir of its own: another kernelkite instance on the same machine.
pub fn node_with_run_dir(cpu: u32, gpu: u32, run_dir: &Path) -> (tempfile::TempDir, Agent) {
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
        run_dir.display().to_string(),
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
    // These tests hold the cgroups to account, against a command as strong as a job can be
    // without the sandbox (root, the agent's view); `hooks_sandbox_real` tests the sandbox.
    env.insert("KERNELKITE_SANDBOX".to_string(), "off".to_string());
    let agent = Agent::new(dir.path(), &format!("real-gpu{gpu}"), &env);
    (dir, agent)
}

/// This machine's online CPUs.
pub fn online_cpus() -> Vec<u32> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_default();
    kernelkite_topology::cpulist::parse_cpu_list(&text).unwrap_or_default()
}

/// Whether `pid` is running (a zombie is not).
pub fn alive(pid: u32) -> bool {
    kernelkite_sys::procfs::is_running(Path::new("/proc"), pid)
}

/// The contents of `path` once it is written (a daemon's pid file); fails after 5 s.
pub fn wait_for_file(path: &Path) -> String {
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
