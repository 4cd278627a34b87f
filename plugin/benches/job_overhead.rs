//! Benchmark: the per-job overhead of the hooks in host mode on the DGX H100 fixture —
//! `environment` (orphan scan, plan, lease, cgroup), `command` (the step's shell started in the
//! job's cgroup, the sandbox set up in its child first: namespaces and mounts, the privilege
//! drop) and `pre-exit` (kill, checkout ownership back, cgroup removal, lease release).
//!
//! Measured the way the agent runs a job: every hook a separate process, as the plugin's hook
//! files (`hooks/*`, executed by the agent: the kernel runs the binary their first line names,
//! which leaves the slice's variables in the job's state; a Job API is served here as the agent
//! serves one), as agent-level binary hooks, or both (a node
//! `setup` made, running a step that names the plugin), with idle gaps between hooks (the
//! agent checks out, uploads, ...; 200 ms here). The gaps matter on cgroup v1: a task's first
//! migration into a cgroup after a quiet spell waits for an RCU grace period unless the kernel
//! favours dynamic cgroup changes (`favordynmods`). "Command start" is from the hook's spawn to
//! the first instruction of the step's command (the command writes `$EPOCHREALTIME`). Next to
//! it, in the same run: the plugin's previous hooks (shell shims the agent sources in its
//! wrapper: the baseline of the plugin's row), the old back-to-back loop (binary hooks, no
//! gaps), the same hooks with the sandbox off, the bare command, the RCU grace period of this
//! kernel, the start of a process in a cgroup v2 directory by migration or by
//! `clone3(CLONE_INTO_CGROUP)`, the checkout hand-over per file, and the prototype's
//! environment hook.
//!
//! `cargo bench -p kernelkite-isolate --bench job_overhead` (`KERNELKITE_BENCH_SHORT=1`: a run
//! of about 25 s). Uses the machine's real cgroups when root and writable (the sandbox needs
//! root), else a fake v2 tree with the sandbox off.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use kernelkite_hooks::cgroup::{Cgroups, Limits};
use kernelkite_topology::fakesys;

mod common;
use common::{ms, output_ok, path_with, plugin_hooks, stats, stub_nvidia_smi_bin, Stats, Table};

/// The agent's idle time between two hooks of a job.
const GAP: Duration = Duration::from_millis(200);

/// Runs `cmd`; its duration, or its stderr when it failed.
fn try_run(cmd: &mut Command) -> Result<Duration, String> {
    let t = Instant::now();
    let out = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| e.to_string())?;
    let took = t.elapsed();
    if out.status.success() {
        Ok(took)
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// From `wall` to the first instruction of a command that wrote `$EPOCHREALTIME` to
/// `dir/started`.
fn command_started(dir: &Path, wall: SystemTime) -> Duration {
    let marker = std::fs::read_to_string(dir.join("started")).unwrap();
    let started = SystemTime::UNIX_EPOCH + Duration::from_secs_f64(marker.trim().parse().unwrap());
    started.duration_since(wall).unwrap_or_default()
}

fn run(cmd: &mut Command) -> Duration {
    let t = Instant::now();
    let out = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let took = t.elapsed();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    took
}

fn fake_cgroup_v2(dir: &Path) -> PathBuf {
    let root = dir.join("cgroot");
    std::fs::create_dir_all(root.join("proc/self")).unwrap();
    std::fs::write(
        root.join("proc/self/mountinfo"),
        "30 23 0:27 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
    )
    .unwrap();
    std::fs::create_dir_all(root.join("sys/fs/cgroup")).unwrap();
    std::fs::write(
        root.join("sys/fs/cgroup/cgroup.controllers"),
        "cpuset memory pids\n",
    )
    .unwrap();
    root
}

/// Real cgroups when usable (root, writable), else the fake v2 tree.
fn cgroup_root(fake: &Path) -> (PathBuf, Option<Cgroups>) {
    if rustix::process::geteuid().is_root() {
        if let Ok(cg) = Cgroups::detect(Path::new("/")) {
            let probe = format!("kk-bench-probe-{}", std::process::id());
            let limits = Limits {
                cpus: vec![0],
                mems: vec![0],
                memory_bytes: 64 << 20,
                pids: 64,
                allow_devices: None,
            };
            let ok = cg.create(&probe, &limits).is_ok();
            let _ = cg.clean_up(&probe);
            if ok {
                return ("/".into(), Some(cg));
            }
        }
    }
    (fake.to_path_buf(), None)
}

/// How the agent runs the hooks.
#[derive(Clone, Copy, PartialEq)]
enum Install {
    /// The plugin's `hooks/*` files, executed (the agent runs a hook whose first line names no
    /// shell directly); copies whose first line names the binary measured.
    Plugin,
    /// The plugin's previous hooks: shell shims, each sourced by bash in a wrapper that saves
    /// the environment afterwards, as the agent does with shell hooks (the baseline).
    Shims,
    /// The binary under the hook's name (agent-level hooks, vendors).
    Binary,
    /// Both, as on a node `setup` made running a step that names the plugin (the deployment
    /// pipelines): the agent runs `environment` agent-level first (which leaves the job to the
    /// plugin's), then the plugin's; the plugin's `command` only; `pre-exit` the plugin's, then
    /// the agent-level one (which leaves it to the plugin's too).
    SetupNode,
}

/// The plugin's location in the step, as the deployment pipelines name it.
const PLUGIN_LOCATION: &str = "github.com/kernelkite/kernelkite/plugin#v0.1.0";

struct JobTimes {
    environment: Duration,
    command_start: Duration,
    command: Duration,
    pre_exit: Duration,
    /// CPU time (user + system) of the three hooks and everything they waited for, the job
    /// (`printf` in bash) included: what the job costs a machine that is not busy otherwise.
    cpu: Duration,
}

fn cpu_now() -> Duration {
    kernelkite_sys::raw::children_cpu_time().unwrap_or_default()
}

struct Bench {
    exe: PathBuf,
    /// The plugin's hook files naming `exe` on their first line.
    plugin_hooks: PathBuf,
    /// The previous shell shims.
    shims: PathBuf,
    dir: PathBuf,
    env: BTreeMap<String, String>,
    n: usize,
}

impl Bench {
    fn hook(&self, install: Install, name: &str, env: &BTreeMap<String, String>) -> Command {
        let mut c = match install {
            Install::Plugin | Install::SetupNode => Command::new(self.plugin_hooks.join(name)),
            Install::Shims => {
                let mut c = Command::new("bash");
                c.arg("-c")
                    .arg(r#"set -e; source "$1"; status=$?; env -0 > "$2"; exit $status"#)
                    .arg("kernelkite-bench-wrapper")
                    .arg(self.shims.join(name))
                    .arg(self.dir.join("env-after"));
                c
            }
            Install::Binary => {
                let mut c = Command::new(&self.exe);
                c.arg(name);
                if name == "environment" {
                    c.args(["--export", "shell"]);
                }
                c
            }
        };
        c.env_clear().envs(env);
        if let Some(cwd) = env.get("BUILDKITE_BUILD_CHECKOUT_PATH") {
            c.current_dir(cwd);
        }
        c
    }

    /// One job through the three hooks, `gap` before each; `None` (said why) when a hook
    /// failed because something else on this shared machine removed the job's cgroup: every
    /// `environment` hook cleans up job cgroups that have no state in its run dir, and other
    /// checkouts' tests run their hooks with run dirs of their own.
    fn job(
        &mut self,
        install: Install,
        gap: Duration,
        extra: &[(&str, &str)],
        tag: &str,
    ) -> Option<JobTimes> {
        self.n += 1;
        let job = format!("bench-{}-{tag}-{}", std::process::id(), self.n);
        let checkout = self.dir.join("builds/agent").join(&job);
        std::fs::create_dir_all(&checkout).unwrap();
        let mut env = self.env.clone();
        env.insert("BUILDKITE_JOB_ID".into(), job.clone());
        env.insert(
            "BUILDKITE_BUILD_CHECKOUT_PATH".into(),
            checkout.display().to_string(),
        );
        for (k, v) in extra {
            env.insert(k.to_string(), v.to_string());
        }
        // On a set-up node the agent-level hooks see the step's plugins but not the plugin's
        // configuration, which the agent gives the plugin's hooks only.
        let agent_level = (install == Install::SetupNode).then(|| {
            let cfg = env["KERNELKITE_CONFIG"].clone();
            let plugins = format!(r#"[{{"{PLUGIN_LOCATION}":{cfg}}}]"#);
            env.insert("BUILDKITE_PLUGINS".into(), plugins);
            let agent_env = env.clone();
            env.insert("BUILDKITE_PLUGIN_CONFIGURATION".into(), cfg);
            agent_env
        });
        let agent_hook = |bench: &Bench, name: &str| -> Result<Duration, String> {
            match &agent_level {
                Some(agent_env) => try_run(&mut bench.hook(Install::Binary, name, agent_env)),
                None => Ok(Duration::ZERO),
            }
        };
        let times = (|| -> Result<JobTimes, String> {
            std::thread::sleep(gap);
            let cpu_before = cpu_now();
            let environment = agent_hook(self, "environment")?
                + try_run(&mut self.hook(install, "environment", &env))?;
            std::thread::sleep(gap);
            let wall = SystemTime::now();
            let command = try_run(&mut self.hook(install, "command", &env))?;
            let command_start = command_started(&checkout, wall);
            std::thread::sleep(gap);
            let pre_exit =
                try_run(&mut self.hook(install, "pre-exit", &env))? + agent_hook(self, "pre-exit")?;
            let cpu = cpu_now().saturating_sub(cpu_before);
            Ok(JobTimes {
                environment,
                command_start,
                command,
                pre_exit,
                cpu,
            })
        })();
        let _ = std::fs::remove_dir_all(&checkout);
        match times {
            Ok(t) => Some(t),
            Err(e) if e.contains("cgroup.procs") || e.contains("/kernelkite/") => {
                let _ = try_run(&mut self.hook(install, "pre-exit", &env));
                println!("  (job {job} discarded: its cgroup went away under it: {e})");
                None
            }
            Err(e) => panic!("job {job} failed: {e}"),
        }
    }

    fn jobs(
        &mut self,
        count: usize,
        install: Install,
        gap: Duration,
        extra: &[(&str, &str)],
        tag: &str,
    ) -> Vec<JobTimes> {
        // Two jobs to warm the caches, not counted.
        self.jobs_warmed(count, 2, install, gap, extra, tag)
    }

    /// `count` jobs after `warm` uncounted ones.
    fn jobs_warmed(
        &mut self,
        count: usize,
        warm: usize,
        install: Install,
        gap: Duration,
        extra: &[(&str, &str)],
        tag: &str,
    ) -> Vec<JobTimes> {
        for _ in 0..warm {
            self.job(install, Duration::ZERO, extra, tag);
        }
        let mut out = Vec::new();
        let mut discarded = 0;
        while out.len() < count {
            match self.job(install, gap, extra, tag) {
                Some(t) => out.push(t),
                None => {
                    discarded += 1;
                    assert!(
                        discarded <= count,
                        "too many jobs disturbed; is the machine shared?"
                    );
                }
            }
        }
        out
    }
}

fn report(table: &Table, title: &str, jobs: &[JobTimes]) -> Stats {
    println!("{title}");
    let col = |f: fn(&JobTimes) -> Duration| stats(jobs.iter().map(f).collect());
    table.row("  environment", &col(|j| j.environment));
    table.row(
        "  command start (hook spawn -> job's first instruction)",
        &col(|j| j.command_start),
    );
    table.row(
        "  command, whole hook (job is `printf`)",
        &col(|j| j.command),
    );
    table.row("  pre-exit", &col(|j| j.pre_exit));
    let sum = col(|j| j.environment + j.command_start + j.pre_exit);
    table.row("  environment + command start + pre-exit", &sum);
    table.row(
        "  CPU time of the three hooks and the job (user + sys)",
        &col(|j| j.cpu),
    );
    sum
}

/// Median of `synchronize_rcu()` (what `membarrier(MEMBARRIER_CMD_GLOBAL)` waits for): the wait
/// a v1 migration pays after a quiet spell when the kernel does not favour dynamic changes.
fn rcu_grace_period(n: usize) -> Option<Stats> {
    let mut samples = Vec::new();
    for _ in 0..n {
        std::thread::sleep(Duration::from_millis(50));
        let t = Instant::now();
        rustix::thread::membarrier(rustix::thread::MembarrierCommand::Global).ok()?;
        samples.push(t.elapsed());
    }
    Some(stats(samples))
}

/// One migration into a cgroup after a quiet spell, timed: whether this kernel favours dynamic
/// cgroup changes (a fraction of a millisecond) or waits for a grace period (milliseconds).
fn isolated_migration(cg_root: &Path, n: usize) -> Option<Stats> {
    let dir = cg_root.join(format!("kk-bench-migrate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).ok()?;
    let mut samples = Vec::new();
    for _ in 0..n {
        std::thread::sleep(GAP);
        let mut child = Command::new("sleep").arg("5").spawn().ok()?;
        let t = Instant::now();
        let ok = std::fs::write(dir.join("cgroup.procs"), child.id().to_string()).is_ok();
        samples.push(t.elapsed());
        let _ = child.kill();
        let _ = child.wait();
        if !ok {
            let _ = std::fs::remove_dir(&dir);
            return None;
        }
    }
    let _ = std::fs::remove_dir(&dir);
    Some(stats(samples))
}

/// Start cost of a process in a cgroup v2 directory after a quiet spell: migrated after fork
/// (what v1 must do) vs born inside (`clone3`, what `command` does on v2).
fn cgroup2_start_costs(iterations: usize, gap: Duration) -> Option<(Stats, Stats, Stats)> {
    use kernelkite_hooks::cgroup::v2::V2;
    use kernelkite_hooks::confine::{spawn, spawn_into_cgroup2, Confinement};
    if !rustix::process::geteuid().is_root() {
        return None;
    }
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mount = kernelkite_hooks::cgroup::parse_mountinfo(&text)
        .into_iter()
        .find(|m| m.fs_type == "cgroup2")?;
    let v2 = V2::new(PathBuf::from(&mount.mount_point));
    let name = format!("kk-bench-{}", std::process::id());
    std::fs::create_dir_all(v2.base().join(&name)).ok()?;
    let dir = v2.base().join(&name);
    let env: BTreeMap<String, String> = [("PATH".to_string(), "/usr/bin:/bin".to_string())].into();
    let c = Confinement {
        procs_files: v2.procs_files(&name),
        isolate_network: false,
    };
    let mut migrate = Vec::new();
    let mut born = Vec::new();
    let mut plain = Vec::new();
    for _ in 0..iterations {
        std::thread::sleep(gap);
        let t = Instant::now();
        assert!(Command::new("/bin/true").status().unwrap().success());
        plain.push(t.elapsed());
        std::thread::sleep(gap);
        let t = Instant::now();
        let mut child = spawn(&mut Command::new("/bin/true"), &c).unwrap();
        assert!(child.wait().unwrap().success());
        migrate.push(t.elapsed());
        std::thread::sleep(gap);
        let t = Instant::now();
        let mut child =
            spawn_into_cgroup2("/bin/true".as_ref(), &[], &env, &dir, false).unwrap()?;
        assert!(child.wait().unwrap().success());
        born.push(t.elapsed());
    }
    let _ = v2.clean_up(&name);
    Some((stats(migrate), stats(born), stats(plain)))
}

/// The checkout's hand-over to the job user and back, per file (1000 files in 10 directories).
fn chown_per_file() -> Option<Duration> {
    use kernelkite_hooks::sandbox::ownership::chown_tree;
    if !rustix::process::geteuid().is_root() {
        return None;
    }
    let dir = tempfile::tempdir().ok()?;
    for d in 0..10 {
        let sub = dir.path().join(format!("d{d}"));
        std::fs::create_dir_all(&sub).ok()?;
        for f in 0..99 {
            std::fs::write(sub.join(format!("f{f}")), "x").ok()?;
        }
    }
    let t = Instant::now();
    let mut files = 0;
    for _ in 0..5 {
        files += chown_tree(dir.path(), 65534, 65534).ok()?.entries;
        files += chown_tree(dir.path(), 0, 0).ok()?.entries;
    }
    Some(t.elapsed() / files as u32)
}

/// The plugin's previous hooks, reduced to what they did per job: shell shims the agent
/// sourced, running the binary named by `KERNELKITE_ISOLATE_BIN` (`environment` printed
/// `export` lines for the shim to evaluate).
fn shell_shims(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    for (hook, body) in [
        (
            "environment",
            r#"exports="$("$KERNELKITE_ISOLATE_BIN" environment --export shell)" && eval "$exports""#,
        ),
        ("command", r#""$KERNELKITE_ISOLATE_BIN" command"#),
        ("pre-exit", r#""$KERNELKITE_ISOLATE_BIN" pre-exit"#),
    ] {
        std::fs::write(dir.join(hook), format!("#!/bin/bash\n{body}\n")).unwrap();
    }
    dir.to_path_buf()
}

fn main() {
    let short = std::env::var_os("KERNELKITE_BENCH_SHORT").is_some();
    let (b2b_jobs, gap_jobs) = if short { (15, 4) } else { (200, 60) };
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The ordinary (dynamically linked) release build a node installs beside the static one
    // (`kernelkite-isolate-nvml`), where scripts/node-binaries.sh built it; else this
    // benchmark's own build (unoptimised in the test command's short runs).
    let exe = kernelkite_testkit::node_binary("kernelkite-isolate-nvml")
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_kernelkite-isolate")));
    // What nodes run the hooks from (scripts/node-binaries.sh); the ordinary build above is
    // measured beside it, in the same run, as the baseline.
    let static_exe = kernelkite_testkit::static_isolate();
    // The run dir is /run/kernelkite in production, a tmpfs; /dev/shm stands in for it (and for
    // sysfs). Checkouts live on disk, as the agent's do (and outside /dev, which the sandbox
    // replaces).
    let shm = if Path::new("/dev/shm").is_dir() {
        tempfile::tempdir_in("/dev/shm").unwrap()
    } else {
        tempfile::tempdir().unwrap()
    };
    let disk = tempfile::Builder::new()
        .prefix("kk-bench")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap();
    std::fs::set_permissions(
        disk.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let sys = shm.path().join("dgx-h100");
    fakesys::dgx_h100().write_to(&sys).unwrap();
    let fake = fake_cgroup_v2(shm.path());
    let (cgroot, real) = cgroup_root(&fake);
    let sandbox = real.is_some();

    // The live machine has fewer CPUs than the fixture: the job's cgroup gets one of ours, so
    // the plan file is the fixture's plan with CPUs folded onto this machine (same sizes).
    let plan_out = output_ok(
        Command::new(&exe)
            .args(["plan", "--json", "--sysfs-root"])
            .arg(&sys),
    );
    let mut plan: serde_json::Value = serde_json::from_slice(&plan_out.stdout).unwrap();
    for s in plan["slices"].as_array_mut().unwrap() {
        s["cpus"] = serde_json::json!([0]);
        s["mems"] = serde_json::json!([0]);
        s["memory_bytes"] = serde_json::json!(1u64 << 30);
    }
    let plan_file = shm.path().join("plan.json");
    std::fs::write(&plan_file, plan.to_string()).unwrap();

    let mut env = BTreeMap::new();
    let mut set = |k: &str, v: String| {
        env.insert(k.to_string(), v);
    };
    set("PATH", std::env::var("PATH").unwrap_or_default());
    set("BUILDKITE_AGENT_NAME", "dgx01".into());
    set(
        "BUILDKITE_COMMAND",
        r#"printf %s "$EPOCHREALTIME" > started"#.into(),
    );
    set("BUILDKITE_SHELL", "/bin/bash -e -c".into());
    // The step's artifact_paths: in the sandbox, the marker the command writes reaches the host's
    // checkout only as an artifact (crates/hooks/src/sandbox/disk.rs), as result.json does.
    set("BUILDKITE_ARTIFACT_PATHS", "result.json;started".into());
    set(
        "BUILDKITE_BUILD_PATH",
        disk.path().join("builds").display().to_string(),
    );
    set(
        "KERNELKITE_RUN_DIR",
        shm.path().join("run").display().to_string(),
    );
    set("KERNELKITE_CGROUP_ROOT", cgroot.display().to_string());
    set("KERNELKITE_PLAN_FILE", plan_file.display().to_string());
    set("KERNELKITE_JOB_PID", std::process::id().to_string());
    // The hooks run what setup installs: the static build when there is one.
    let node_exe = static_exe.clone().unwrap_or_else(|| exe.clone());
    set("KERNELKITE_ISOLATE_BIN", node_exe.display().to_string());
    // The agent's Job API (the hooks export through it only with `export-to-agent`).
    let job_api = kernelkite_agent::job_api::JobApiServer::start(
        &shm.path().join("job-api.sock"),
        "bench-token",
        BTreeMap::new(),
    )
    .unwrap();
    set(
        "BUILDKITE_AGENT_JOB_API_SOCKET",
        job_api.socket().display().to_string(),
    );
    set("BUILDKITE_AGENT_JOB_API_TOKEN", "bench-token".into());
    set("KERNELKITE_CONFIG", r#"{"user":"nobody"}"#.into());
    // As every job the deployment's pipelines run: the step names the runner version the
    // service expects, and `environment` checks the node's runner against it (its answer is
    // cached in the run dir after the first job, as on a node).
    let runner = disk.path().join("kernelkite-runner");
    std::fs::write(
        &runner,
        format!(
            "#!/bin/sh\necho 'kernelkite-runner {}'\n",
            env!("CARGO_PKG_VERSION")
        ),
    )
    .unwrap();
    std::fs::set_permissions(&runner, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    set("KERNELKITE_RUNNER_BINARY", runner.display().to_string());
    set(
        kernelkite_sys::node::EXPECTED_RUNNER_ENV,
        env!("CARGO_PKG_VERSION").into(),
    );
    set(
        "KERNELKITE_SANDBOX",
        if sandbox { "on" } else { "off" }.into(),
    );
    let mut bench = Bench {
        plugin_hooks: plugin_hooks(&node_exe, &disk.path().join("plugin")),
        shims: shell_shims(&disk.path().join("shell-shims")),
        exe: node_exe,
        dir: disk.path().to_path_buf(),
        env,
        n: 0,
    };

    let cg_kind = match &real {
        Some(cg) => format!(
            "real cgroup v{}, sandbox on (job user nobody)",
            cg.version()
        ),
        None => "fake cgroup v2 tree, sandbox off (not root)".into(),
    };
    println!(
        "job overhead benchmark: DGX H100 fixture (224 CPUs, 8 GPUs), host mode, {cg_kind}; {gap_jobs} jobs per agent-style row ({} ms idle before each hook), {b2b_jobs} back to back",
        GAP.as_millis()
    );
    let table = Table::new(60);

    // Is the v1 migration wait there on this kernel right now?
    if let Some(Cgroups::V1(_)) = &real {
        if let Some(m) = isolated_migration(Path::new("/sys/fs/cgroup/pids"), 5) {
            let favoured = m.median < Duration::from_millis(2);
            println!(
                "one cgroup v1 migration after {} ms idle: median {} -> the threadgroup rwsem {}",
                GAP.as_millis(),
                ms(m.median),
                if favoured {
                    "is in favordynmods mode (no grace-period wait)"
                } else {
                    "waits for an RCU grace period (no favordynmods)"
                }
            );
        }
    }

    // What the agent's wrapper costs around any shell hook: an empty hook sourced the same way.
    // The shims paid it three times per job; hook files the agent executes do not. (The real
    // wrapper runs `buildkite-agent env dump`, a far larger program than `env`, twice.)
    let empty_hook = disk.path().join("empty-hook");
    std::fs::write(&empty_hook, "").unwrap();
    let empty: Vec<Duration> = (0..gap_jobs + 2)
        .map(|_| {
            std::thread::sleep(GAP);
            run(Command::new("bash")
                .arg("-c")
                .arg(r#"set -e; source "$1"; status=$?; env -0 > "$2"; exit $status"#)
                .arg("kernelkite-bench-wrapper")
                .arg(&empty_hook)
                .arg(disk.path().join("env-after"))
                .env_clear()
                .envs(&bench.env))
        })
        .skip(2)
        .collect();
    let empty = stats(empty);
    // The plugin's hooks now and before alternate, so a slow spell falls on both.
    let (mut plugin_jobs, mut shim_jobs, mut node_jobs) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..gap_jobs {
        let warm = if round == 0 { 2 } else { 0 };
        plugin_jobs.extend(bench.jobs_warmed(1, warm, Install::Plugin, GAP, &[], "plugin"));
        shim_jobs.extend(bench.jobs_warmed(1, warm, Install::Shims, GAP, &[], "shim"));
        node_jobs.extend(bench.jobs_warmed(1, warm, Install::SetupNode, GAP, &[], "node"));
    }
    let plugin_sum = report(
        &table,
        "agent-style: the plugin's hook files (executed), idle gaps",
        &plugin_jobs,
    );
    let shim_sum = report(
        &table,
        "agent-style: the plugin's previous shell shims (sourced in the agent's wrapper; baseline)",
        &shim_jobs,
    );
    let node_sum = report(
        &table,
        "agent-style: a node `setup` made (agent-level hooks too) running a step that names the plugin",
        &node_jobs,
    );
    table.row(
        "  the agent's wrapper around an empty shell hook (with `env -0` for `buildkite-agent env dump`)",
        &empty,
    );
    // The two builds' jobs alternate, so a slow spell of this shared machine falls on both.
    let mut builds: Vec<(&str, PathBuf)> = match &static_exe {
        Some(st) => vec![
            ("static build (what nodes run)", st.clone()),
            ("ordinary build (dynamically linked; baseline)", exe.clone()),
        ],
        None => vec![("ordinary build (dynamically linked)", exe.clone())],
    };
    // An earlier build to compare with in the same run (issue 19: the build before the job's
    // PID namespace, seccomp filter, bounded checkout and per-slice identity).
    if let Some(base) = std::env::var_os("KERNELKITE_BENCH_BASELINE_ISOLATE") {
        builds.push((
            "earlier build (KERNELKITE_BENCH_BASELINE_ISOLATE; baseline)",
            PathBuf::from(base),
        ));
    }
    let mut per_build: Vec<Vec<JobTimes>> = builds.iter().map(|_| Vec::new()).collect();
    for round in 0..gap_jobs {
        for (i, (_, bin)) in builds.iter().enumerate() {
            bench.exe = bin.clone();
            let warm = if round == 0 { 2 } else { 0 };
            per_build[i].extend(bench.jobs_warmed(1, warm, Install::Binary, GAP, &[], "bin"));
        }
    }
    bench.exe = builds[0].1.clone();
    let sums: Vec<Stats> = builds
        .iter()
        .zip(&per_build)
        .map(|((name, _), jobs)| {
            report(
                &table,
                &format!("agent-style: agent-level binary hooks, idle gaps, {name}"),
                jobs,
            )
        })
        .collect();
    if static_exe.is_none() {
        println!("  the static build was not measured: build it with `scripts/node-binaries.sh target/node` (or name it in KERNELKITE_STATIC_ISOLATE)");
    }
    if sandbox {
        let off = bench.jobs(
            gap_jobs,
            Install::Binary,
            GAP,
            &[("KERNELKITE_SANDBOX", "off")],
            "nosbx",
        );
        report(
            &table,
            &format!("  same, {}, sandbox off (command as root, no namespaces): the sandbox's own cost is the difference", builds[0].0),
            &off,
        );
    }
    let b2b = bench.jobs(b2b_jobs, Install::Binary, Duration::ZERO, &[], "b2b");
    let b2b_sum = report(
        &table,
        &format!(
            "back to back (the previous benchmark): binary hooks, no gaps, {}",
            builds[0].0
        ),
        &b2b,
    );

    // Planning live instead of from a plan file (fixture sysfs, fake cgroups: the fixture's
    // CPUs are not this machine's).
    let mut env_live = Vec::new();
    for i in 0..b2b_jobs + 3 {
        let mut env = bench.env.clone();
        env.remove("KERNELKITE_PLAN_FILE");
        env.insert("KERNELKITE_SYSFS_ROOT".into(), sys.display().to_string());
        env.insert("KERNELKITE_CGROUP_ROOT".into(), fake.display().to_string());
        env.insert(
            "BUILDKITE_JOB_ID".into(),
            format!("bench-{}-live-{i}", std::process::id()),
        );
        let t = run(&mut bench.hook(Install::Binary, "environment", &env));
        run(&mut bench.hook(Install::Binary, "pre-exit", &env));
        if i >= 3 {
            env_live.push(t);
        }
    }
    table.row(
        "environment, live plan from sysfs (binary, fake cgroups)",
        &stats(env_live),
    );

    // What the command itself costs without any hook: the agent would run it anyway.
    let bare_dir = disk.path().join("bare");
    std::fs::create_dir_all(&bare_dir).unwrap();
    let mut bare_start = Vec::new();
    let mut bare = Vec::new();
    let mut bare_cpu = Vec::new();
    for _ in 0..b2b_jobs {
        let wall = SystemTime::now();
        let cpu_before = cpu_now();
        bare.push(run(Command::new("/bin/bash")
            .args(["-e", "-c", r#"printf %s "$EPOCHREALTIME" > started"#])
            .current_dir(&bare_dir)));
        bare_cpu.push(cpu_now().saturating_sub(cpu_before));
        bare_start.push(command_started(&bare_dir, wall));
    }
    table.row(
        "the command alone: start (bash -e -c printf, bare)",
        &stats(bare_start),
    );
    // The same after the agent's idle time, as the hooks are measured: the part of "command
    // start" that a job pays with or without any hook.
    let mut bare_idle = Vec::new();
    for _ in 0..gap_jobs {
        std::thread::sleep(GAP);
        let wall = SystemTime::now();
        run(Command::new("/bin/bash")
            .args(["-e", "-c", r#"printf %s "$EPOCHREALTIME" > started"#])
            .current_dir(&bare_dir));
        bare_idle.push(command_started(&bare_dir, wall));
    }
    let bare_idle = stats(bare_idle);
    table.row(
        &format!("the command alone: start after {} ms idle", GAP.as_millis()),
        &bare_idle,
    );
    table.row("the command alone: whole process", &stats(bare));
    table.row("the command alone: CPU time (user + sys)", &stats(bare_cpu));

    let path_with_stub = path_with(&stub_nvidia_smi_bin(shm.path()));
    let proto_hook = manifest.join("benches/prototype-environment-hook.sh");
    let proto: Vec<Duration> = (0..b2b_jobs + 3)
        .map(|_| {
            run(Command::new("bash")
                .arg(&proto_hook)
                .env("PATH", &path_with_stub)
                .env("KERNELKITE_PROTO_ROOT", &sys)
                .env("BUILDKITE_AGENT_NAME", "dgx01-4"))
        })
        .skip(3)
        .collect();
    table.row("prototype environment hook (bash, baseline)", &stats(proto));

    if let Some(rcu) = rcu_grace_period(if short { 10 } else { 40 }) {
        table.row(
            "RCU grace period (membarrier GLOBAL = synchronize_rcu)",
            &rcu,
        );
        if let Some(Cgroups::V1(_)) = &real {
            println!(
                "  cgroup v1 without favordynmods: the command's first migration waits about one grace period more ({} median)",
                ms(rcu.median)
            );
        }
    }
    if let Some((migrate, born, plain)) = cgroup2_start_costs(if short { 5 } else { 30 }, GAP) {
        println!(
            "starting /bin/true in a real cgroup v2 directory (this machine's cgroup2 mount), {} ms idle before each:",
            GAP.as_millis()
        );
        table.row("  plain spawn, no cgroup", &plain);
        table.row(
            "  spawn + write cgroup.procs (migration, as on v1)",
            &migrate,
        );
        table.row("  clone3(CLONE_INTO_CGROUP) (`command` on v2)", &born);
    }
    if let Some(per_file) = chown_per_file() {
        println!(
            "checkout hand-over (chown walk, no links followed): {:.2} us per file",
            per_file.as_secs_f64() * 1e6
        );
    }
    let mut totals = vec![
        (
            "agent-style, the plugin's hook files".to_string(),
            &plugin_sum,
        ),
        (
            "agent-style, the plugin's previous shell shims (baseline)".to_string(),
            &shim_sum,
        ),
        (
            "agent-style, agent-level hooks and the plugin (a set-up node)".to_string(),
            &node_sum,
        ),
    ];
    for ((name, _), sum) in builds.iter().zip(&sums) {
        totals.push((format!("agent-style, binary hooks, {name}"), sum));
    }
    totals.push(("back to back".to_string(), &b2b_sum));
    for (name, sum) in totals {
        println!(
            "environment + command start + pre-exit, {name}: median {}; target <= 10 ms: {}",
            ms(sum.median),
            if sum.median <= Duration::from_millis(10) {
                "met"
            } else {
                "MISSED"
            }
        );
    }
    // "Command start" runs to the command's first instruction, so it holds the shell's own
    // start, which the agent pays without any hook; this is what the hooks add on top of it.
    for ((name, _), sum) in builds.iter().zip(&sums) {
        println!(
            "what the hooks add to a job, agent-style, binary hooks, {name}: {} (median sum - the bare command's start after the same idle)",
            ms(sum.median.saturating_sub(bare_idle.median))
        );
    }
}
