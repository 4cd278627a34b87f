//! A harness that plays the Buildkite agent for the plugin's hooks.
//!
//! It sets the `BUILDKITE_*` variables a real agent sets, serves the Job API on a unix socket
//! (`kernelkite_agent::job_api`, the one emulation of it), runs hooks in the
//! agent's order (`environment` → `command` → `pre-exit`), either as agent-level binary hooks
//! (links named after the hook) or as the plugin's hook files (whose first line names the
//! binary: the agent executes them, the kernel runs the binary), whose `environment` leaves
//! the slice's variables in the job's state for kernelkite's `command` (and exports them
//! through the Job API with `export-to-agent`), and keeps a "bootstrap" process alive for the
//! job's lifetime as the job's anchor.
//!
//! What of it the real agent (v3.137.0) is known to do the same way, by
//! `tests/tests/real_agent.rs`: the plugin's variables for a plugin in a repository
//! subdirectory (`BUILDKITE_PLUGIN_NAME`, `BUILDKITE_PLUGIN_CONFIGURATION`,
//! `BUILDKITE_PLUGIN_PLUGIN_*`, from the same function local mode uses), a polyglot hook
//! executed rather than sourced, and its exports through the Job API reaching the command; and,
//! where both kinds run, agent-level hooks before the plugin's. `tests/tests/real_agent_node.rs`
//! runs the same hooks under real `buildkite-agent start` processes of a node `setup` made, on
//! real cgroups: agent-level `environment` and `pre-exit` with the plugin's hooks, the
//! sandboxed command, its artifact carried back and uploaded, a cancel (the agent's SIGTERM,
//! grace period, then `pre-exit`), a timeout, a lost (SIGKILLed) agent whose job the next one
//! reclaims, two slices at once, and the job's refusal of a repository hook or another plugin.
//! What only this harness does: the Job API's own protocol (the real one is the agent's, and
//! the hooks talk to it in those runs), the bootstrap as a separate process to kill, and the
//! variables beyond the plugin's, which are this harness's reading of the agent's source.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use kernelkite_agent::job_api;
use kernelkite_agent::job_env::JobEnv;
use kernelkite_testkit::PLUGIN_LOCATION;
use serde_json::{json, Value};

pub const BIN: &str = env!("CARGO_BIN_EXE_kernelkite-isolate");

pub fn plugin_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The helpers every test and benchmark shares (a test that includes this harness reaches them
/// here rather than including them a second time).
#[path = "../common/mod.rs"]
pub mod common;
pub use common::plugin_hooks;

/// Whether the agent would source `path` in its shell wrapper instead of executing it: its
/// rule (`hook.Type`) is a file without a `#!` line, or whose `#!` line names a POSIX shell
/// (directly or through `env`), unless it is a binary.
pub fn agent_wraps(path: &Path) -> bool {
    let bytes = std::fs::read(path).unwrap();
    if bytes.starts_with(b"\x7fELF") {
        return false;
    }
    let first = bytes.split(|b| *b == b'\n').next().unwrap_or_default();
    let Some(line) = std::str::from_utf8(first)
        .ok()
        .and_then(|l| l.strip_prefix("#!"))
    else {
        return true;
    };
    let words: Vec<&str> = line.split_whitespace().collect();
    let base = |w: &str| w.rsplit('/').next().unwrap_or(w).to_string();
    let mut bin = words.first().map(|w| base(w)).unwrap_or_default();
    if bin == "env" {
        bin = words.get(1).map(|w| base(w)).unwrap_or_default();
    }
    ["bash", "dash", "ksh", "sh", "zsh"].contains(&bin.as_str())
}

/// The Job API as the agent serves it: the one emulation
/// (`kernelkite_agent::job_api`), at a socket path a unix socket can have.
pub struct JobApiServer {
    pub socket: PathBuf,
    pub token: String,
    server: Option<job_api::JobApiServer>,
    /// The directory made for a socket whose natural path was too long; removed on drop.
    short_dir: Option<PathBuf>,
}

impl Drop for JobApiServer {
    fn drop(&mut self) {
        // The server first: it wakes its thread through the socket.
        drop(self.server.take());
        if let Some(d) = &self.short_dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// Where the socket of a job in `dir` goes: `dir/job-api.sock`, unless that is longer than a
/// unix socket path may be (108 bytes, which a deep checkout such as the test script's fresh
/// clone exceeds); then a fresh directory in `/run` (outside `/tmp`, which the sandbox
/// replaces, so hiding the socket is still the sandbox's doing) or, where `/run` is not
/// writable, in the temp dir.
fn socket_place(dir: &Path) -> (PathBuf, Option<PathBuf>) {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let natural = dir.join("job-api.sock");
    if natural.as_os_str().len() < 100 {
        return (natural, None);
    }
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!("kk-api-{}-{n}", std::process::id());
    for base in [PathBuf::from("/run"), std::env::temp_dir()] {
        let d = base.join(&name);
        if std::fs::create_dir_all(&d).is_ok() {
            return (d.join("job-api.sock"), Some(d));
        }
    }
    panic!("no directory for a job API socket")
}

impl JobApiServer {
    pub fn start(dir: &Path, token: &str, env: BTreeMap<String, String>) -> JobApiServer {
        let (socket, short_dir) = socket_place(dir);
        // A job id run again by the same agent gets a fresh socket, like a fresh job.
        let server = job_api::JobApiServer::start(&socket, token, env).unwrap();
        JobApiServer {
            socket,
            token: token.to_string(),
            server: Some(server),
            short_dir,
        }
    }

    fn server(&self) -> &job_api::JobApiServer {
        self.server
            .as_ref()
            .expect("the Job API is served until dropped")
    }

    /// The job's environment as the hooks left it.
    pub fn env(&self) -> BTreeMap<String, String> {
        self.server().env()
    }

    /// Replaces the job's environment.
    pub fn set_env(&self, env: BTreeMap<String, String>) {
        self.server().set_env(env)
    }

    /// Sets one variable (`Some`) or removes it (`None`).
    pub fn set(&self, key: &str, value: Option<&str>) {
        self.server().set(key, value)
    }

    /// The method of every request so far.
    pub fn requests(&self) -> Vec<String> {
        self.server().requests()
    }
}

/// How the hooks are installed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Install {
    /// Agent-level hooks: links named `environment`, `command`, `pre-exit` to the binary.
    AgentBinary,
    /// The plugin's `hooks/` files, executed (their first line names the binary).
    Plugin,
}

/// One agent on a node (several may share a run dir, like agents on one machine).
pub struct Agent {
    pub name: String,
    pub dir: PathBuf,
    pub hooks_dir: PathBuf,
    /// Environment the agent adds for every job (tags, node settings).
    pub env: BTreeMap<String, String>,
}

/// A job in progress.
pub struct Job {
    pub id: String,
    /// The job's environment as the next hook would see it.
    pub env: BTreeMap<String, String>,
    pub bootstrap: Child,
    pub api: JobApiServer,
    pub install: Install,
    pub hooks_dir: PathBuf,
    /// A program (and its arguments) each hook is run through, such as `nsenter` into a
    /// namespace standing for the node; empty runs hooks directly.
    pub wrapper: Vec<String>,
    slice_env: BTreeMap<String, String>,
}

impl Drop for Job {
    fn drop(&mut self) {
        let _ = self.bootstrap.kill();
        let _ = self.bootstrap.wait();
    }
}

pub fn output_text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

impl Agent {
    /// An agent whose node state lives under `node_dir` (run dir, fake cgroups, plan).
    pub fn new(node_dir: &Path, name: &str, node_env: &BTreeMap<String, String>) -> Agent {
        Agent::with_binary(node_dir, name, node_env, Path::new(BIN))
    }

    /// The same, its agent-level hooks links to `bin` instead of this build.
    pub fn with_binary(
        node_dir: &Path,
        name: &str,
        node_env: &BTreeMap<String, String>,
        bin: &Path,
    ) -> Agent {
        let dir = node_dir.join(format!("agent-{name}"));
        let hooks_dir = dir.join("hooks");
        std::fs::create_dir_all(&hooks_dir).unwrap();
        for hook in kernelkite_sys::node::HOOK_NAMES {
            let link = hooks_dir.join(hook);
            if !link.exists() {
                std::os::unix::fs::symlink(bin, &link).unwrap();
            }
        }
        let mut env = node_env.clone();
        env.insert("BUILDKITE_AGENT_NAME".into(), name.into());
        Agent {
            name: name.into(),
            dir,
            hooks_dir,
            env,
        }
    }

    /// Starts a job: the bootstrap process, the Job API and the job's environment.
    pub fn start_job(
        &self,
        job_id: &str,
        command: &str,
        plugin_config: Option<&str>,
        install: Install,
    ) -> Job {
        let job_dir = self.dir.join(job_id);
        let checkout = job_dir.join("checkout");
        std::fs::create_dir_all(&checkout).unwrap();
        let bootstrap = Command::new("sleep").arg("600").spawn().unwrap();
        let token = format!("token-{job_id}");
        let mut env: BTreeMap<String, String> = BTreeMap::new();
        for k in ["PATH", "HOME", "LANG"] {
            if let Ok(v) = std::env::var(k) {
                env.insert(k.into(), v);
            }
        }
        env.extend(self.env.clone());
        let api_env = env.clone();
        let api = JobApiServer::start(&job_dir, &token, api_env);
        let add = |env: &mut BTreeMap<String, String>, k: &str, v: &str| {
            env.insert(k.to_string(), v.to_string());
        };
        // The job's variables as local mode and setup's smoke job give them too
        // (`kernelkite_agent::job_env`), with the step's plugin: the variables the real agent
        // sets for the pipelines' plugin (checked against it in tests/tests/real_agent.rs).
        let plugin = plugin_config.map(|cfg| {
            (
                format!("{PLUGIN_LOCATION}#v1.0.0"),
                serde_json::from_str::<Value>(cfg).unwrap_or(Value::Null),
            )
        });
        env.extend(
            JobEnv {
                job_id,
                build_id: "0190b8c2-0000-4000-8000-000000000001",
                build_number: 42,
                organization: "kernelkite",
                pipeline: "kernelbot",
                agent_name: &self.name,
                tags: Vec::new(),
                checkout: &checkout,
                command,
                artifact_paths: None,
                plugin,
            }
            .variables(),
        );
        if let Some(cfg) = plugin_config {
            // A configuration that is not JSON reaches the hooks as written.
            add(&mut env, "BUILDKITE_PLUGIN_CONFIGURATION", cfg);
        }
        // What the agent's own process adds (`createEnvironment` in agent/job_runner.go), which
        // the hooks must keep from the job: its id and access token, its binaries' directory,
        // the Job API's socket and token; and the job's anchor process.
        add(
            &mut env,
            "BUILDKITE_AGENT_ID",
            &format!("agent-id-{}", self.name),
        );
        add(
            &mut env,
            "BUILDKITE_AGENT_ACCESS_TOKEN",
            "secret-agent-token",
        );
        add(&mut env, "BUILDKITE_BIN_PATH", "/usr/bin");
        add(
            &mut env,
            "BUILDKITE_AGENT_JOB_API_SOCKET",
            api.socket.to_str().unwrap(),
        );
        add(&mut env, "BUILDKITE_AGENT_JOB_API_TOKEN", &token);
        add(&mut env, "KERNELKITE_JOB_PID", &bootstrap.id().to_string());
        let hooks_dir = match install {
            Install::AgentBinary => self.hooks_dir.clone(),
            Install::Plugin => plugin_hooks(Path::new(BIN), &job_dir),
        };
        // The Job API serves the job's environment as the agent knows it.
        api.set_env(env.clone());
        Job {
            id: job_id.into(),
            env,
            bootstrap,
            api,
            install,
            hooks_dir,
            wrapper: Vec::new(),
            slice_env: BTreeMap::new(),
        }
    }
}

impl Job {
    /// Sets a variable of the job, as the pipeline's step `env` would (the Job API serves it
    /// too, so it survives the agent re-reading the environment after a hook).
    pub fn set_env(&mut self, key: &str, value: &str) {
        self.env.insert(key.into(), value.into());
        self.api.set(key, Some(value));
    }

    fn hook_command(&self, hook: &str, cwd: &Path) -> Command {
        let path = self.hooks_dir.join(hook);
        // Both kinds are executed; a hook the agent would source instead is not what either
        // installs.
        assert!(
            !agent_wraps(&path),
            "the agent would source {} in its shell wrapper",
            path.display()
        );
        let mut argv: Vec<std::ffi::OsString> = self.wrapper.iter().map(Into::into).collect();
        argv.push(path.clone().into());
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..]);
        cmd.env_clear().envs(&self.env).current_dir(cwd);
        // What the agent adds for a hook it executes.
        cmd.env("BUILDKITE_HOOK_PHASE", hook)
            .env("BUILDKITE_HOOK_PATH", &path)
            .env(
                "BUILDKITE_HOOK_SCOPE",
                match self.install {
                    Install::AgentBinary => "agent",
                    Install::Plugin => "plugin",
                },
            );
        cmd
    }

    fn checkout(&self) -> PathBuf {
        PathBuf::from(&self.env["BUILDKITE_BUILD_CHECKOUT_PATH"])
    }

    /// Runs one hook and applies its environment changes the way the agent does.
    pub fn run_hook(&mut self, hook: &str) -> Output {
        let out = output_of(|| self.hook_command(hook, &self.checkout()));
        if out.status.success() {
            // An executed hook changes the job's environment through the Job API only.
            self.env = self.api.env();
            if hook == "environment" {
                self.slice_env = self.read_slice_env();
            }
        }
        out
    }

    /// The variables the last successful `environment` left in the job's state for
    /// kernelkite's `command`: what the command gets besides the agent's (empty before one).
    pub fn slice_env(&self) -> BTreeMap<String, String> {
        self.slice_env.clone()
    }

    fn read_slice_env(&self) -> BTreeMap<String, String> {
        let settings = kernelkite_hooks::job::Settings {
            run_dir: PathBuf::from(&self.env["KERNELKITE_RUN_DIR"]),
            ..Default::default()
        };
        kernelkite_hooks::job::state::read_state(&settings, &self.id)
            .unwrap()
            .map(|state| state.exports)
            .unwrap_or_default()
    }

    /// Runs the job to the end the way the agent does: `pre-exit` runs even when an earlier
    /// hook failed. Returns the outputs of the hooks that ran.
    pub fn run_all(&mut self) -> Vec<(String, Output)> {
        let mut outs = Vec::new();
        let env = self.run_hook("environment");
        let ok = env.status.success();
        outs.push(("environment".to_string(), env));
        if ok {
            outs.push(("command".to_string(), self.run_hook("command")));
        }
        outs.push(("pre-exit".to_string(), self.run_hook("pre-exit")));
        outs
    }
}

/// A fake cgroup v2 tree (mountinfo + controllers) under `root`.
pub fn fake_cgroup_v2(root: &Path) {
    std::fs::create_dir_all(root.join("proc/self")).unwrap();
    std::fs::write(
        root.join("proc/self/mountinfo"),
        "30 23 0:27 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n",
    )
    .unwrap();
    let cg = root.join("sys/fs/cgroup");
    std::fs::create_dir_all(&cg).unwrap();
    std::fs::write(
        cg.join("cgroup.controllers"),
        "cpuset cpu io memory hugetlb pids rdma misc\n",
    )
    .unwrap();
    std::fs::write(cg.join("cgroup.subtree_control"), "").unwrap();
}

/// A plan with `n` single-GPU slices (NVIDIA, with UUIDs), one CPU each from `cpus`.
pub fn plan_json(n: u32, cpus: &[u32]) -> String {
    let slices: Vec<Value> = (0..n)
        .map(|i| {
            json!({
                "index": i,
                "gpu": {"vendor": "nvidia", "pci_bus_id": format!("0000:{:02x}:00.0", 0x18 + i),
                        "uuid": format!("GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd"), "numa_node": 0},
                "cpus": [cpus[i as usize % cpus.len()]],
                "mems": [0],
                "memory_bytes": 256u64 << 20,
            })
        })
        .collect();
    json!({"slices": slices, "reserved_cpus": [], "warnings": []}).to_string()
}

/// A node: run dir, plan file and fake cgroup v2 tree in a temp dir, and the variables that
/// point the hooks at them.
pub struct Node {
    pub dir: tempfile::TempDir,
    pub env: BTreeMap<String, String>,
}

impl Node {
    pub fn new(gpus: u32) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fake_cgroup_v2(&root.join("cgroot"));
        std::fs::write(root.join("plan.json"), plan_json(gpus, &[0, 1])).unwrap();
        let mut env = BTreeMap::new();
        env.insert(
            "KERNELKITE_RUN_DIR".into(),
            root.join("run").display().to_string(),
        );
        env.insert(
            "KERNELKITE_PLAN_FILE".into(),
            root.join("plan.json").display().to_string(),
        );
        env.insert(
            "KERNELKITE_CGROUP_ROOT".into(),
            root.join("cgroot").display().to_string(),
        );
        // A fake node tests the hooks' bookkeeping; the sandbox needs root and a real kernel
        // and has its own tests (`hooks_sandbox_real`).
        env.insert("KERNELKITE_SANDBOX".into(), "off".into());
        Node { dir, env }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn agent(&self, name: &str) -> Agent {
        Agent::new(self.path(), name, &self.env)
    }

    /// An agent whose agent-level hooks run `bin` instead of this build.
    pub fn agent_running(&self, name: &str, bin: &Path) -> Agent {
        Agent::with_binary(self.path(), name, &self.env, bin)
    }

    pub fn cgroup_dir(&self, job: &str) -> PathBuf {
        self.path()
            .join("cgroot/sys/fs/cgroup/kernelkite")
            .join(job)
    }
}

/// Runs the command `make` builds, its stdin empty. A hook file this harness has just written
/// can be `ETXTBSY` for a moment: another test thread's fork copied the descriptor it was
/// written through, until that child execs (the kernel refuses to execute a file open for
/// writing). The exec is tried again then, as the file is complete.
fn output_of(make: impl Fn() -> Command) -> Output {
    for _ in 0..100 {
        match make().stdin(Stdio::null()).output() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            r => return r.unwrap(),
        }
    }
    panic!("the hook stayed busy (ETXTBSY) for a second");
}
