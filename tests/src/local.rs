//! Local mode under test: the binaries it runs (built with this crate's tests), fixture nodes
//! (a fake sysfs tree with this machine's CPUs, planned by the real `kernelkite-isolate`), the
//! service with the local executor on loopback, and a probe harness whose jobs report where
//! and when they ran.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kernelkite_service::local::{LocalArgs, LocalExecutor};
use kernelkite_service::{App, Config};
use kernelkite_topology::fakesys::{FakeSys, SmtNumbering};
use kernelkite_topology::plan::Vendor;
use serde_json::{json, Value};

/// The binaries local mode runs, as this crate's tests build them; make it with
/// [`local_bins!`](crate::local_bins) in an integration test or benchmark.
#[derive(Debug, Clone)]
pub struct Bins {
    /// The runner.
    pub runner: PathBuf,
    /// The plugin's binary (the hooks).
    pub isolate: PathBuf,
    /// The service.
    pub service: PathBuf,
}

/// The [`Bins`] of this crate's integration tests and benchmarks (where cargo sets
/// `CARGO_BIN_EXE_*`).
#[macro_export]
macro_rules! local_bins {
    () => {
        $crate::local::Bins {
            runner: env!("CARGO_BIN_EXE_kernelkite-testkit-runner").into(),
            isolate: env!("CARGO_BIN_EXE_kernelkite-testkit-isolate").into(),
            service: env!("CARGO_BIN_EXE_kernelkite-testkit-service").into(),
        }
    };
}

/// How long a local-mode test waits for a submission that should end.
pub const LOCAL_WAIT: Duration = Duration::from_secs(120);

/// This machine's online CPUs (`/sys/devices/system/cpu/online`).
pub fn online_cpus() -> Vec<u32> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_default();
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) {
                    cpus.extend(a..=b);
                }
            }
            None => cpus.extend(part.parse::<u32>().ok()),
        }
    }
    if cpus.is_empty() {
        cpus.push(0);
    }
    cpus
}

/// A fixture node: a fake sysfs tree with this machine's CPUs (one socket, one NUMA node, no
/// SMT, so real cgroups accept its cpusets) and `gpus` fake NVIDIA GPUs, and its plan: one
/// slice per GPU, no housekeeping core, as `kernelkite-isolate plan --json` makes it.
pub struct Node {
    /// Holds the tree and the plan.
    pub dir: tempfile::TempDir,
    /// The sysfs/procfs root.
    pub sysfs: PathBuf,
    /// The plan file.
    pub plan_file: PathBuf,
    /// The plan.
    pub plan: Value,
}

/// A [`Node`] with `gpus` GPUs (at most one per CPU of this machine).
pub fn fixture_node(bins: &Bins, gpus: u32) -> Node {
    let cpus = online_cpus();
    let top = cpus.iter().copied().max().unwrap_or(0);
    let mut fake = FakeSys::machine(1, top + 1, 1, SmtNumbering::Offset, 1, 8 << 30);
    let offline: Vec<u32> = (0..=top).filter(|c| !cpus.contains(c)).collect();
    fake = fake.with_offline(&offline);
    for g in 0..gpus {
        fake = fake.with_gpu(Vendor::Nvidia, &format!("0000:{:02x}:00.0", 0x18 + g), 0);
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let sysfs = dir.path().join("sys-root");
    fake.write_to(&sysfs).expect("fake sysfs tree");
    let out = std::process::Command::new(&bins.isolate)
        .args([
            "plan",
            "--json",
            "--housekeeping-cores",
            "0",
            "--sysfs-root",
        ])
        .arg(&sysfs)
        .env_clear()
        .output()
        .expect("run kernelkite-isolate plan");
    assert!(
        out.status.success(),
        "plan failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan_file = dir.path().join("plan.json");
    std::fs::write(&plan_file, &out.stdout).expect("write plan");
    let plan: Value = serde_json::from_slice(&out.stdout).expect("plan JSON");
    Node {
        dir,
        sysfs,
        plan_file,
        plan,
    }
}

/// A run dir every real-cgroup test of one test binary shares, as every agent on a node must:
/// the `environment` hook cleans up job cgroups that have no state in its run dir.
pub fn shared_run_dir() -> PathBuf {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(crate::scratch).path().join("run")
}

/// Whether jobs can be confined with real cgroups here (root, and a cgroup can be made); the
/// reason when not.
pub fn real_cgroups() -> Result<(), String> {
    use kernelkite_hooks::cgroup::{Cgroups, Limits};
    if !is_root() {
        return Err("real cgroups need root".into());
    }
    let cg = Cgroups::detect(Path::new("/")).map_err(|e| format!("no usable cgroups: {e}"))?;
    let probe = format!("kk-testkit-probe-{}-{}", std::process::id(), unique());
    let limits = Limits {
        cpus: vec![online_cpus()[0]],
        mems: vec![0],
        memory_bytes: 64 << 20,
        pids: 64,
        allow_devices: None,
    };
    let made = cg.create(&probe, &limits);
    let _ = cg.clean_up(&probe);
    made.map(|_| ())
        .map_err(|e| format!("cgroups not writable here: {e}"))
}

/// Whether this process runs with effective uid 0.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

fn unique() -> u32 {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
}

/// How a [`LocalStack`] confines its jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confinement {
    /// Real cgroups (the machine's `/`), run dir shared by the test binary.
    Real,
    /// No cgroups (an empty cgroup root): jobs run with the hooks' UNENFORCED warning, in a
    /// run dir of their own, so tests cannot touch each other's jobs.
    Unenforced,
}

/// Local mode in this process, serving on loopback.
pub struct LocalStack {
    /// The service's core.
    pub app: Arc<App>,
    /// Its executor.
    pub local: Arc<LocalExecutor>,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    /// A client.
    pub http: reqwest::Client,
    /// The local dir (job directories) and, unless shared, the run dir.
    pub dir: Arc<tempfile::TempDir>,
    /// The executor's flags, to start another service on the same directories.
    pub args: LocalArgs,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for LocalStack {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// The local executor's flags for `bins` and `node` (`None`: this machine's own plan).
pub fn local_args(bins: &Bins, node: Option<&Node>, how: Confinement, dir: &Path) -> LocalArgs {
    let (run_dir, cgroup_root) = match how {
        Confinement::Real => (shared_run_dir(), PathBuf::from("/")),
        Confinement::Unenforced => {
            let empty = dir.join("no-cgroups");
            let _ = std::fs::create_dir_all(&empty);
            (dir.join("run"), empty)
        }
    };
    LocalArgs {
        runner_bin: Some(bins.runner.clone()),
        isolate_bin: Some(bins.isolate.clone()),
        local_dir: Some(dir.join("local")),
        run_dir: Some(run_dir),
        plan_file: node.map(|n| n.plan_file.clone()),
        cpu_only_slices: 1,
        sysfs_root: node.map_or_else(|| PathBuf::from("/"), |n| n.sysfs.clone()),
        cgroup_root,
        plugin_config: kernelkite_service::local::settings::DEFAULT_PLUGIN_CONFIG.into(),
        enforce: false,
        // Off unless a test asks: whether `auto` turns it on depends on the machine (root, a
        // job user), and a test must mean the same everywhere.
        sandbox: kernelkite_service::local::SandboxChoice::Off,
    }
}

/// Starts local mode with `args` on a free loopback port; `tweak` adjusts the service's
/// configuration first.
pub async fn start_stack(
    args: LocalArgs,
    dir: Arc<tempfile::TempDir>,
    tweak: impl FnOnce(&mut Config),
) -> LocalStack {
    let mut cfg = Config::local();
    // The tests submit the same fixture config again on purpose, to run it again.
    cfg.fair.cache = false;
    tweak(&mut cfg);
    let local = LocalExecutor::new(&args, None)
        .await
        .expect("local executor starts");
    let app = kernelkite_service::cli::serve::start(&cfg, local.clone()).expect("service starts");
    local
        .start(kernelkite_service::events::for_executor(&app))
        .await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("loopback port");
    let addr = listener.local_addr().expect("address");
    let serving = app.clone();
    let server = tokio::spawn(async move {
        let _ = kernelkite_service::serve(serving, &cfg, listener, std::future::pending()).await;
    });
    LocalStack {
        app,
        local,
        base: format!("http://{addr}"),
        http: reqwest::Client::new(),
        dir,
        args,
        server,
    }
}

/// Local mode on `node` (or this machine), confined as `how`; its directories on tmpfs where
/// there is one ([`crate::scratch`]), as `/run/kernelkite` is on a node.
pub async fn local_stack(bins: &Bins, node: Option<&Node>, how: Confinement) -> LocalStack {
    let dir = Arc::new(crate::scratch());
    let args = local_args(bins, node, how, dir.path());
    start_stack(args, dir, |_| {}).await
}

impl LocalStack {
    /// `POST /v1/submissions`: the status and the answer.
    pub async fn post(&self, body: Value) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}/v1/submissions", self.base))
            .json(&body)
            .send()
            .await
            .expect("POST");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// Submits `config` (which must be accepted) to queue `local`; the submission id.
    pub async fn submit(&self, config: Value) -> String {
        self.submit_body(json!({"config": config, "queue": "local"}))
            .await
    }

    /// Submits `body` (which must be accepted); the submission id.
    pub async fn submit_body(&self, body: Value) -> String {
        let (status, v) = self.post(body).await;
        assert_eq!(status, 202, "{v}");
        v["id"].as_str().expect("id").to_string()
    }

    /// `GET /v1/submissions/{id}`: the submission as it is now.
    pub async fn get(&self, id: &str) -> Value {
        self.http
            .get(format!("{}/v1/submissions/{id}", self.base))
            .send()
            .await
            .expect("GET")
            .json()
            .await
            .expect("JSON")
    }

    /// `POST /v1/submissions/{id}/cancel`: the status of the answer.
    pub async fn cancel(&self, id: &str) -> u16 {
        self.http
            .post(format!("{}/v1/submissions/{id}/cancel", self.base))
            .send()
            .await
            .expect("POST cancel")
            .status()
            .as_u16()
    }

    /// Long-polls the submission until it ends; its JSON.
    pub async fn wait(&self, id: &str) -> Value {
        let deadline = tokio::time::Instant::now() + LOCAL_WAIT;
        loop {
            let v: Value = self
                .http
                .get(format!("{}/v1/submissions/{id}?wait=30", self.base))
                .send()
                .await
                .expect("GET")
                .json()
                .await
                .expect("JSON");
            let terminal = matches!(
                v["state"].as_str(),
                Some("succeeded" | "failed" | "canceled" | "timed_out")
            );
            if terminal || tokio::time::Instant::now() > deadline {
                return v;
            }
        }
    }

    /// Waits until the submission has reached `state` (or passed it).
    pub async fn wait_for_state(&self, id: &str, state: &str) {
        let mut rx = self
            .app
            .store()
            .subscribe(id)
            .expect("submission in memory");
        let want = state.to_string();
        tokio::time::timeout(
            LOCAL_WAIT,
            rx.wait_for(|s| s.history.iter().any(|t| t.state.as_str() == want)),
        )
        .await
        .expect("state reached in time")
        .expect("submission kept");
    }
}

/// A POPCORN harness for tests, in Python: every case of every mode reports where and when
/// it ran (`probe.<i>.slice`, `.cpus` (its CPU affinity), `.start_ns`, `.end_ns`, `.pid`, `.uid`) and
/// passes, after doing what the case asks: `sleep_ms: N`, `hang: 1` (sleep for an hour),
/// `fail: 1`, `pidfile: PATH` (write its pid there), `marker: PATH` (append a line there when
/// it starts).
pub const PROBE_HARNESS: &str = r#"
import os, sys, time
out = os.fdopen(int(os.environ["POPCORN_FD"]), "w")
mode, path = sys.argv[1], sys.argv[2]
lines = [l for l in open(path).read().splitlines() if l.strip()]
prefix = "test" if mode == "test" else "benchmark"
out.write(f"{prefix}-count: {len(lines)}\n")
ok = True
for i, line in enumerate(lines):
    case = {}
    for part in line.split(";"):
        k, _, v = part.partition(":")
        case[k.strip()] = v.strip()
    start = time.time_ns()
    if "marker" in case:
        with open(case["marker"], "a") as m:
            m.write(f"{os.getpid()}\n")
    if "pidfile" in case:
        with open(case["pidfile"], "w") as p:
            p.write(str(os.getpid()))
    if "hang" in case:
        time.sleep(3600)
    time.sleep(int(case.get("sleep_ms", "0")) / 1000)
    good = "fail" not in case
    ok = ok and good
    out.write(f"probe.{i}.slice: {os.environ.get('KERNELBOT_GPU_INDEX', '')}\n")
    out.write(f"probe.{i}.cpus: {','.join(map(str, sorted(os.sched_getaffinity(0))))}\n")
    out.write(f"probe.{i}.cpuset: {os.environ.get('KERNELBOT_CPUSET', '')}\n")
    out.write(f"probe.{i}.pid: {os.getpid()}\n")
    out.write(f"probe.{i}.uid: {os.getuid()}\n")
    out.write(f"probe.{i}.start_ns: {start}\n")
    out.write(f"probe.{i}.end_ns: {time.time_ns()}\n")
    out.write(f"{prefix}.{i}.spec: {line}\n")
    out.write(f"{prefix}.{i}.status: {'pass' if good else 'fail'}\n")
    if mode != "test":
        out.write(f"{prefix}.{i}.mean: 1000.0\n")
out.write(f"check: {'pass' if ok else 'fail'}\n")
out.flush()
sys.exit(0 if ok else 112)
"#;

/// A run config evaluating [`PROBE_HARNESS`] on `cases` (as tests and benchmarks) in `mode`.
pub fn probe_config(mode: &str, cases: Value) -> Value {
    json!({
        "lang": "py",
        "mode": mode,
        "main": "eval.py",
        "sources": {"eval.py": PROBE_HARNESS},
        "tests": cases,
        "benchmarks": cases,
        "ranking_by": "mean",
        "test_timeout": 120,
        "benchmark_timeout": 120,
        "ranked_timeout": 120,
    })
}

/// What a probe case reported, from a finished submission's run `run`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// `KERNELBOT_GPU_INDEX`: the slice.
    pub slice: String,
    /// Its CPU affinity.
    pub cpus: String,
    /// `KERNELBOT_CPUSET`.
    pub cpuset: String,
    /// Its pid.
    pub pid: u32,
    /// Start, ns since the epoch.
    pub start_ns: u128,
    /// End, ns since the epoch.
    pub end_ns: u128,
}

/// The probes of run `run` of a finished submission.
pub fn probes(submission: &Value, run: &str) -> Vec<Probe> {
    let r = &submission["result"]["runs"][run]["run"]["result"];
    let mut out = Vec::new();
    for i in 0.. {
        let get = |k: &str| r[format!("probe.{i}.{k}")].as_str().map(str::to_string);
        let Some(slice) = get("slice") else { break };
        out.push(Probe {
            slice,
            cpus: get("cpus").unwrap_or_default(),
            cpuset: get("cpuset").unwrap_or_default(),
            pid: get("pid").and_then(|p| p.parse().ok()).unwrap_or(0),
            start_ns: get("start_ns").and_then(|p| p.parse().ok()).unwrap_or(0),
            end_ns: get("end_ns").and_then(|p| p.parse().ok()).unwrap_or(0),
        });
    }
    out
}

/// The repository's `examples/` directory.
pub fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .join("examples")
}

/// A local-mode service on its own thread and runtime that a test can kill mid-run (every task
/// of the service goes at once; its jobs' processes are not touched) and start again on the
/// same data dir and directories: the restart tests.
pub struct Crashable {
    /// The service's core (its store, to check the state it died in).
    pub app: Arc<App>,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    stop: std::sync::mpsc::Sender<()>,
    thread: std::thread::JoinHandle<()>,
    /// What the next life of the service starts with: the same flags and data dir.
    args: LocalArgs,
    dir: Arc<tempfile::TempDir>,
}

/// The service's durable store for the restart tests: both lives of the service open it.
fn data_dir(dir: &tempfile::TempDir) -> impl FnOnce(&mut Config) {
    let data = dir.path().join("data");
    move |c| c.store.data_dir = Some(data)
}

/// Starts local mode with `args` and a durable store under `dir`, ready to be crashed.
pub fn crashable(args: LocalArgs, dir: Arc<tempfile::TempDir>) -> Crashable {
    let (tx, rx) = std::sync::mpsc::channel();
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    let (next_args, next_dir) = (args.clone(), dir.clone());
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime");
        let durable = data_dir(&dir);
        let stack = rt.block_on(start_stack(args, dir, durable));
        let _ = tx.send((stack.app.clone(), stack.base.clone()));
        let _ = stopped.recv();
        rt.shutdown_background();
        drop(stack);
    });
    let (app, base) = rx.recv().expect("the service started");
    Crashable {
        app,
        base,
        stop,
        thread,
        args: next_args,
        dir: next_dir,
    }
}

impl Crashable {
    /// Submits `config` to the local queue over the API; the submission's id.
    pub async fn submit(&self, config: Value) -> String {
        let v: Value = reqwest::Client::new()
            .post(format!("{}/v1/submissions", self.base))
            .json(&json!({"config": config, "queue": "local"}))
            .send()
            .await
            .expect("the service answers")
            .json()
            .await
            .expect("a JSON answer");
        v["id"].as_str().expect("an id").to_string()
    }

    /// Kills the service while submission `id` is in `state` (checked), then starts it again
    /// on the same data dir: its durable store brings the submission back, and the executor
    /// finds the job's directory.
    pub async fn crash_and_restart(self, id: &str, state: &str) -> LocalStack {
        let _ = self.stop.send(());
        self.thread.join().expect("the service's thread");
        let now = self.app.store().get(id).expect("the submission");
        assert_eq!(now.state.as_str(), state);
        drop(self.app);
        start_stack(self.args, self.dir.clone(), data_dir(&self.dir)).await
    }
}

/// Waits until `f` holds, checking every 20 ms; fails the test, naming `what`, after `within`.
pub async fn wait_until(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !f() {
        assert!(start.elapsed() < within, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
