//! The local executor: runs each submission's job on this machine the way a Buildkite agent
//! with the kernelkite plugin runs it, and feeds its progress to the same state machine, store
//! and waiters as Buildkite's webhooks do.
//!
//! ```text
//! POST /v1/submissions → launch: job.json written, job queued (FIFO)          state: queued
//! worker of slice N takes it                                                   → scheduled
//!   kernelkite-isolate environment --export shell   (lease slice N, cgroup)   → running
//!   kernelkite-isolate command                      (BUILDKITE_COMMAND = kernelkite-runner
//!                                                    --output <attempt>/result.json, payload in env)
//!   kernelkite-isolate pre-exit                     (kill leftovers, remove cgroup, release)
//! finished → collect: result.json checked by ResultJson::parse                → succeeded
//! the job directory is removed once the submission's end is stored
//! ```
//!
//! One worker per slice of the node's plan (`kernelkite-isolate plan --json`, with CPU-only
//! slices on a machine without GPUs), each bound to its slice the way agents are
//! (`BUILDKITE_AGENT_META_DATA_GPU_INDEX`); jobs beyond the free slices wait in the queue in
//! the order they came. The binaries run as separate processes, never linked: what runs here
//! is what runs on a node. Where cgroups cannot be used the hooks run the job anyway with a
//! loud `UNENFORCED` warning (the plugin's `allow-unenforced`), unless `--enforce`.
//!
//! After a restart, [`LocalExecutor::recover`] picks a job up from its directory: a finished
//! attempt's `result.json` is collected, an interrupted one is stopped, cleaned up and run
//! again from the start; nothing is lost, and only one attempt's result is ever delivered.

pub mod binaries;
pub mod hooks;
pub mod jobdir;
pub mod settings;
pub mod timing;

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Deserialize;
use tokio::process::Command;
use tokio::sync::Notify;

use crate::app::App;
use crate::executor::{
    BoxFuture, BuildEvent, BuildEventKind, BuildStatus, Executor, Job, Launched, Recovered,
};
use crate::report::BoxError;
use crate::result::ResultJson;
use crate::submission::{BuildInfo, Outcome};
use hooks::{HookJob, ProcessId};
use jobdir::{JobDir, JobFile};
pub use settings::{LocalArgs, LocalSettings};
use timing::Timings;

/// Why local mode cannot start.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    /// A binary was not found.
    #[error("{name} not found beside this executable{} or on PATH; build it with `cargo build --release --workspace --bins` (it lands in target/release/), install it (deployment/README.md: `kernelkite-isolate setup`), or name it with --{}-bin", .searched.as_ref().map(|d| format!(" (in {})", d.display())).unwrap_or_default(), if *.name == binaries::RUNNER { "runner" } else { "isolate" })]
    MissingBinary {
        /// The binary.
        name: &'static str,
        /// The directory searched beside this executable.
        searched: Option<PathBuf>,
    },
    /// A binary given by flag is not there.
    #[error("{} (given for {name}) is not an executable file", .path.display())]
    NotExecutable {
        /// The binary.
        name: &'static str,
        /// The path given.
        path: PathBuf,
    },
    /// A directory cannot be made.
    #[error("cannot create {}; point --local-dir (KERNELKITE_LOCAL_DIR) at a writable directory", .path.display())]
    Dir {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `--plugin-config` is not a JSON object.
    #[error("--plugin-config (KERNELKITE_LOCAL_PLUGIN_CONFIG) must be a JSON object of plugin settings, not {0:?}")]
    PluginConfig(String),
    /// Planning the node failed.
    #[error("cannot plan this node's slices with {}: {stderr}", .isolate.display())]
    Plan {
        /// The binary run.
        isolate: PathBuf,
        /// What it said.
        stderr: String,
    },
    /// The plan is not a plan.
    #[error("{} is not a kernelkite plan (`kernelkite-isolate plan --json`)", .path.display())]
    PlanParse {
        /// The plan file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The plan has no slices.
    #[error("the node's plan has no slices; nothing can run (see `kernelkite-isolate plan`)")]
    NoSlices,
}

/// One slice of the node's plan, as far as the executor needs it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PlannedSlice {
    /// The slice's number (the GPU's, or the CPU-only slice's).
    pub index: u32,
    /// Its GPU, when it has one.
    #[serde(default)]
    pub gpu: Option<serde_json::Value>,
    /// Its CPUs.
    pub cpus: Vec<u32>,
    /// Its memory limit.
    pub memory_bytes: u64,
}

impl PlannedSlice {
    /// `slice 0 (GPU 0000:18:00.0, 13 CPUs, 230 GiB)`.
    pub fn describe(&self) -> String {
        let gpu = self
            .gpu
            .as_ref()
            .and_then(|g| g["pci_bus_id"].as_str())
            .map(|b| format!("GPU {b}, "))
            .unwrap_or_else(|| "CPU-only, ".into());
        format!(
            "slice {} ({gpu}{} CPU{}, {:.1} GiB)",
            self.index,
            self.cpus.len(),
            if self.cpus.len() == 1 { "" } else { "s" },
            self.memory_bytes as f64 / f64::from(1u32 << 30)
        )
    }
}

#[derive(Deserialize)]
struct PlanShape {
    slices: Vec<PlannedSlice>,
}

/// What the executor reports about one job (for `demo`, benchmarks and logs).
#[derive(Debug, Clone, PartialEq)]
pub struct JobReport {
    /// The submission.
    pub submission_id: String,
    /// The build number.
    pub number: u64,
    /// The slice it ran on.
    pub slice: Option<u32>,
    /// How it was confined, from the hooks' own words (`cgroup v1`, `UNENFORCED`).
    pub isolation: Option<String>,
    /// Which attempt delivered the result (1 unless a restart interrupted it).
    pub attempt: u32,
    /// When things happened.
    pub timings: Timings,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Queued,
    Running,
    Finished,
}

struct Record {
    file: JobFile,
    dir: JobDir,
    attempt: u32,
    stage: Stage,
    slice: Option<u32>,
    isolation: Option<String>,
    failure: Option<String>,
    exit_code: Option<i32>,
    cancel: Arc<Notify>,
    canceled: bool,
    /// Tells `launch` the job left the queue (the submission is then `scheduled`).
    started: Option<tokio::sync::oneshot::Sender<()>>,
    timings: Timings,
}

impl Record {
    fn report(&self) -> JobReport {
        JobReport {
            submission_id: self.file.submission_id.clone(),
            number: self.file.build.number,
            slice: self.slice,
            isolation: self.isolation.clone(),
            attempt: self.attempt,
            timings: self.timings.clone(),
        }
    }
}

struct Queued {
    build_id: String,
    accepted_at: DateTime<Utc>,
}

/// Reports of finished jobs kept for [`LocalExecutor::report`].
const HISTORY: usize = 4096;
/// How long a canceled job's command gets to stop on SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Runs submissions on this machine; see the module documentation.
pub struct LocalExecutor {
    me: Weak<LocalExecutor>,
    settings: LocalSettings,
    plan_file: PathBuf,
    slices: Vec<PlannedSlice>,
    queue: Mutex<VecDeque<Queued>>,
    wake: Arc<Notify>,
    jobs: Mutex<HashMap<String, Record>>,
    history: Mutex<VecDeque<JobReport>>,
    app: OnceLock<Weak<App>>,
    next_number: AtomicU64,
    host: String,
    _temp: Option<tempfile::TempDir>,
}

impl Drop for LocalExecutor {
    fn drop(&mut self) {
        // Workers hold only a weak reference between jobs; wake them so they see it is gone.
        self.wake.notify_waiters();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl LocalExecutor {
    /// Resolves `args`, plans the node and returns the executor (its workers start with
    /// [`LocalExecutor::start`]). `data_dir` is the service's KERNELKITE_DATA_DIR.
    pub async fn new(
        args: &LocalArgs,
        data_dir: Option<&Path>,
    ) -> Result<Arc<LocalExecutor>, LocalError> {
        let mut temp = None;
        let settings = args.resolve(data_dir, || {
            let t = tempfile::Builder::new()
                .prefix("kernelkite-local")
                .tempdir()?;
            let p = t.path().to_path_buf();
            temp = Some(t);
            Ok(p)
        })?;
        LocalExecutor::with_settings(settings, temp).await
    }

    /// [`LocalExecutor::new`] from resolved settings; `temp` is removed with the executor.
    pub async fn with_settings(
        settings: LocalSettings,
        temp: Option<tempfile::TempDir>,
    ) -> Result<Arc<LocalExecutor>, LocalError> {
        let (plan_file, slices) = load_plan(&settings).await?;
        let host = rustix::system::uname()
            .nodename()
            .to_string_lossy()
            .into_owned();
        Ok(Arc::new_cyclic(|me| LocalExecutor {
            me: me.clone(),
            settings,
            plan_file,
            slices,
            queue: Mutex::new(VecDeque::new()),
            wake: Arc::new(Notify::new()),
            jobs: Mutex::new(HashMap::new()),
            history: Mutex::new(VecDeque::new()),
            app: OnceLock::new(),
            next_number: AtomicU64::new(1),
            host,
            _temp: temp,
        }))
    }

    /// The slices jobs run on, one worker each.
    pub fn slices(&self) -> &[PlannedSlice] {
        &self.slices
    }

    /// The resolved settings.
    pub fn settings(&self) -> &LocalSettings {
        &self.settings
    }

    /// The plan the hooks read.
    pub fn plan_file(&self) -> &Path {
        &self.plan_file
    }

    /// Submissions waiting for a slice.
    pub fn queued(&self) -> usize {
        lock(&self.queue).len()
    }

    /// Connects the executor to the service it reports to, picks up the jobs a previous run
    /// left in the local directory (see [`LocalExecutor::sweep`]), then starts one worker per
    /// slice. Call once, after the service's store has loaded what it keeps.
    pub async fn start(self: &Arc<Self>, app: &Arc<App>) {
        let _ = self.app.set(Arc::downgrade(app));
        self.sweep(app).await;
        for slice in &self.slices {
            tokio::spawn(worker(
                Arc::downgrade(self),
                self.wake.clone(),
                slice.clone(),
            ));
        }
        tracing::info!(
            slices = self.slices.len(),
            plan = %self.plan_file.display(),
            run_dir = %self.settings.run_dir.display(),
            "local executor: one worker per slice"
        );
    }

    /// Goes through the job directories a previous run left: a job whose submission is still
    /// open with this job's build is recovered ([`crate::recovery::recover_submission`]); any
    /// other (its submission ended, is unknown, or never recorded this build, having waited in
    /// the queue when the service stopped) is cleaned up after (its leftover processes
    /// stopped, `pre-exit` run) and removed.
    pub async fn sweep(self: &Arc<Self>, app: &Arc<App>) {
        for dir in jobdir::list(&self.jobs_root()) {
            let file = match dir.read() {
                Ok(f) => f,
                Err(e) => {
                    tracing::warn!(dir = %dir.path().display(), error = %e, "removing a local job directory without a readable job.json");
                    let _ = dir.remove();
                    continue;
                }
            };
            if lock(&self.jobs).contains_key(&file.build.id) {
                continue;
            }
            match app.lookup(&file.submission_id).await {
                Some(sub)
                    if !sub.state.is_terminal()
                        && sub.build.as_ref().is_some_and(|b| b.id == file.build.id) =>
                {
                    crate::recovery::recover_submission(app, &sub).await;
                }
                found => {
                    if found.is_none() {
                        tracing::warn!(id = %file.submission_id, build = file.build.number, "the service does not know this local job's submission any more (the store keeps only finished submissions across restarts); dropping the job");
                    }
                    if let Some(n) = dir.last_attempt() {
                        self.stop_attempt(&dir, &file, n).await;
                    }
                    let _ = dir.remove();
                }
            }
        }
    }

    /// What the executor knows of the job of submission `id`: running, or finished recently.
    pub fn report(&self, id: &str) -> Option<JobReport> {
        if let Some(r) = lock(&self.jobs)
            .values()
            .find(|r| r.file.submission_id == id)
        {
            return Some(r.report());
        }
        lock(&self.history)
            .iter()
            .rev()
            .find(|r| r.submission_id == id)
            .cloned()
    }

    fn jobs_root(&self) -> PathBuf {
        self.settings.local_dir.join("jobs")
    }

    fn app(&self) -> Option<Arc<App>> {
        self.app.get().and_then(Weak::upgrade)
    }

    fn node_args(&self) -> Vec<std::ffi::OsString> {
        hooks::node_args(
            &self.settings.run_dir,
            &self.plan_file,
            &self.settings.sysfs_root,
            &self.settings.cgroup_root,
        )
    }

    fn emit(&self, kind: BuildEventKind, build: &BuildInfo, state: &str) {
        if let Some(app) = self.app() {
            app.on_event(BuildEvent {
                kind,
                build: BuildStatus {
                    id: build.id.clone(),
                    number: build.number,
                    state: state.to_string(),
                    web_url: build.web_url.clone(),
                    blocked: false,
                },
            });
        }
    }

    /// Puts a job in the queue, before every job accepted after it (FIFO by acceptance,
    /// also for jobs recovered after a restart).
    fn enqueue(&self, build_id: String, accepted_at: DateTime<Utc>) {
        let mut q = lock(&self.queue);
        let at = q
            .iter()
            .position(|e| e.accepted_at > accepted_at)
            .unwrap_or(q.len());
        q.insert(
            at,
            Queued {
                build_id,
                accepted_at,
            },
        );
        drop(q);
        self.wake.notify_one();
    }

    /// The next job, and when it left the queue (taken under the queue's lock, so the times
    /// are in queue order).
    fn pop(&self) -> Option<(Queued, DateTime<Utc>)> {
        let mut q = lock(&self.queue);
        q.pop_front().map(|j| (j, Utc::now()))
    }

    /// One job on `slice`, from the queue to its `Finished` event.
    async fn run(self: &Arc<Self>, slice: &PlannedSlice, q: Queued, dequeued: DateTime<Utc>) {
        let (file, dir, attempt, cancel) = {
            let mut jobs = lock(&self.jobs);
            let Some(rec) = jobs.get_mut(&q.build_id) else {
                return;
            };
            if rec.canceled || rec.stage != Stage::Queued {
                return;
            }
            rec.stage = Stage::Running;
            rec.slice = Some(slice.index);
            rec.timings.dequeued = Some(dequeued);
            if let Some(started) = rec.started.take() {
                let _ = started.send(());
            }
            (
                rec.file.clone(),
                rec.dir.clone(),
                rec.attempt,
                rec.cancel.clone(),
            )
        };
        let build = file.build.clone();
        self.emit(BuildEventKind::Scheduled, &build, "scheduled");
        let outcome = self.run_attempt(slice, &file, &dir, attempt, &cancel).await;
        let state = {
            let mut jobs = lock(&self.jobs);
            let Some(rec) = jobs.get_mut(&build.id) else {
                return;
            };
            rec.stage = Stage::Finished;
            rec.timings.cleaned = Some(Utc::now());
            rec.isolation = outcome.isolation.clone().or(rec.isolation.take());
            rec.exit_code = outcome.exit_code;
            rec.failure = outcome.failure.clone();
            if rec.timings.leased.is_none() {
                rec.timings.leased = outcome.leased;
            }
            rec.timings.command_done = outcome.command_done;
            if rec.canceled {
                "canceled"
            } else if outcome.exit_code == Some(0) {
                "passed"
            } else {
                "failed"
            }
        };
        self.emit(BuildEventKind::Finished, &build, state);
        self.spawn_cleanup(file.submission_id.clone(), build.id.clone());
    }

    /// The three hooks of one attempt, as the agent runs them.
    async fn run_attempt(
        self: &Arc<Self>,
        slice: &PlannedSlice,
        file: &JobFile,
        dir: &JobDir,
        attempt: u32,
        cancel: &Notify,
    ) -> AttemptOutcome {
        let mut out = AttemptOutcome::default();
        let checkout = dir.attempt(attempt);
        if let Err(e) = std::fs::create_dir_all(checkout.join("work")) {
            out.failure = Some(format!(
                "cannot create the job directory {}: {e}",
                checkout.display()
            ));
            return out;
        }
        let log_path = dir.log(attempt);
        let job_id = format!("{}-{attempt}", file.build.id);
        let (command, build_env) = self.command_for(file, dir, attempt);
        let agent_name = format!("local-{}-{}", self.host, slice.index);
        let job = HookJob {
            job_id: &job_id,
            build_id: &file.build.id,
            build_number: file.build.number,
            agent_name: &agent_name,
            slice: slice.index,
            queue: &file.queue,
            plugin_config: &self.settings.plugin_config,
            checkout: &checkout,
            command: &command,
            build_env: &build_env,
        };
        let env = hooks::hook_env(std::env::vars(), &job);

        // environment: lease, cgroup, exports.
        let environment = self
            .hook("environment")
            .args(["--export", "shell"])
            .envs(&env)
            .current_dir(&checkout)
            .stdin(std::process::Stdio::null())
            .output()
            .await;
        let environment = match environment {
            Ok(o) => o,
            Err(e) => {
                out.failure = Some(format!(
                    "cannot run {} environment: {e}",
                    self.settings.bins.isolate.display()
                ));
                return out;
            }
        };
        let env_log = String::from_utf8_lossy(&environment.stderr).into_owned();
        append_log(&log_path, "environment", &env_log);
        out.isolation = isolation_of(&env_log);
        if out.isolation.as_deref() == Some(UNENFORCED) {
            tracing::warn!(job = file.build.number, "job runs UNENFORCED: no CPU, memory or pids limits (cgroups cannot be used here; `kernelkite-isolate doctor` says why)");
        }
        let exports = if environment.status.success() {
            hooks::parse_exports(&String::from_utf8_lossy(&environment.stdout))
                .map_err(|e| format!("the environment hook's exports cannot be read: {e}"))
        } else {
            Err(format!(
                "the environment hook failed ({}): {}",
                environment.status,
                env_log.trim()
            ))
        };
        let exports = match exports {
            Ok(e) => e,
            Err(why) => {
                out.failure = Some(why);
                self.pre_exit(&env, &checkout, &log_path).await;
                return out;
            }
        };
        out.leased = Some(Utc::now());
        let canceled = match lock(&self.jobs).get_mut(&file.build.id) {
            Some(rec) => {
                rec.timings.leased = out.leased;
                rec.isolation = out.isolation.clone();
                rec.canceled
            }
            None => true,
        };
        if canceled {
            out.failure = Some("canceled before its command started".into());
            self.pre_exit(&env, &checkout, &log_path).await;
            return out;
        }
        self.emit(BuildEventKind::Running, &file.build, "running");

        // command: the runner, confined.
        let status = self
            .run_command(&env, &exports, &checkout, &log_path, dir, attempt, cancel)
            .await;
        out.command_done = Some(Utc::now());
        match status {
            Ok(code) => out.exit_code = Some(code),
            Err(why) => out.failure = Some(why),
        }

        // pre-exit: whatever happened above.
        self.pre_exit(&env, &checkout, &log_path).await;
        out
    }

    /// `BUILDKITE_COMMAND` and the build's env for an attempt: the runner writing the
    /// attempt's `result.json`, the payload in the env (in a file past 1 MiB, where the
    /// environment as a whole would crowd Linux's limit on exec's arguments).
    fn command_for(
        &self,
        file: &JobFile,
        dir: &JobDir,
        attempt: u32,
    ) -> (String, Vec<(String, String)>) {
        let checkout = dir.attempt(attempt);
        let mut command = format!(
            "{} --output {} --workdir {}",
            hooks::shell_quote(&self.settings.bins.runner.display().to_string()),
            hooks::shell_quote(&checkout.join("result.json").display().to_string()),
            hooks::shell_quote(&checkout.join("work").display().to_string()),
        );
        let mut env = Vec::new();
        if file.payload.len() <= PAYLOAD_IN_ENV_MAX {
            env.extend(kernelkite_kernelbot::payload::to_env(&file.payload));
        } else {
            let path = dir.path().join("payload.txt");
            if std::fs::write(&path, &file.payload).is_ok() {
                command.push_str(&format!(
                    " --payload-file {}",
                    hooks::shell_quote(&path.display().to_string())
                ));
            } else {
                env.extend(kernelkite_kernelbot::payload::to_env(&file.payload));
            }
        }
        env.push(("KERNELBOT_RUN_ID".into(), file.run_id.clone()));
        env.push(("KERNELBOT_QUEUE".into(), file.queue.clone()));
        env.push((
            "KERNELKITE_SUBMISSION_ID".into(),
            file.submission_id.clone(),
        ));
        (command, env)
    }

    fn hook(&self, name: &str) -> Command {
        let mut c = Command::new(&self.settings.bins.isolate);
        c.arg(name).args(self.node_args()).env_clear();
        c
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_command(
        &self,
        env: &std::collections::BTreeMap<String, String>,
        exports: &std::collections::BTreeMap<String, String>,
        checkout: &Path,
        log_path: &Path,
        dir: &JobDir,
        attempt: u32,
        cancel: &Notify,
    ) -> Result<i32, String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path)
            .map_err(|e| format!("cannot open the job log {}: {e}", log_path.display()))?;
        let log_err = log
            .try_clone()
            .map_err(|e| format!("cannot open the job log {}: {e}", log_path.display()))?;
        let mut child = self
            .hook("command")
            .envs(env)
            .envs(exports)
            .current_dir(checkout)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log_err)
            // Its own process group: a cancel (or a restarted service) stops the runner with
            // it, and the runner stops the harness's group on SIGTERM.
            .process_group(0)
            .spawn()
            .map_err(|e| {
                format!(
                    "cannot run {} command: {e}",
                    self.settings.bins.isolate.display()
                )
            })?;
        let me = child.id().and_then(|pid| {
            Some(ProcessId {
                pid,
                start_time: hooks::start_time(pid)?,
            })
        });
        if let Some(p) = me {
            let _ = dir.write_process(attempt, p);
        }
        let status = tokio::select! {
            s = child.wait() => s,
            _ = cancel.notified() => stop_child(&mut child, me).await,
        };
        let status = status.map_err(|e| format!("waiting for the command hook failed: {e}"))?;
        use std::os::unix::process::ExitStatusExt;
        Ok(status
            .code()
            .or_else(|| status.signal().map(|s| 128 + s))
            .unwrap_or(1))
    }

    async fn pre_exit(
        &self,
        env: &std::collections::BTreeMap<String, String>,
        checkout: &Path,
        log_path: &Path,
    ) {
        let out = self
            .hook("pre-exit")
            .envs(env)
            .current_dir(checkout)
            .stdin(std::process::Stdio::null())
            .output()
            .await;
        match out {
            Ok(o) => {
                let text = format!(
                    "{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                );
                append_log(log_path, "pre-exit", &text);
                if !o.status.success() {
                    tracing::warn!(report = %text.trim(), "pre-exit could not clean up everything");
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot run the pre-exit hook"),
        }
    }

    /// Stops what attempt `n` of a job left running (its command hook's process group, then
    /// `pre-exit`, which kills what is left in its cgroup and releases its slice).
    async fn stop_attempt(&self, dir: &JobDir, file: &JobFile, n: u32) {
        if let Some(p) = dir.read_process(n) {
            // Only a group whose leader is still the recorded process (or whose members
            // outlived it) is signalled: after a long downtime the pid may be another's.
            if hooks::is_alive(p) || hooks::group_exists(p.pid) {
                stop_group(p.pid, || hooks::is_alive(p)).await;
            }
        }
        let mut env = std::collections::BTreeMap::new();
        env.insert(
            "BUILDKITE_JOB_ID".to_string(),
            format!("{}-{n}", file.build.id),
        );
        if let Ok(path) = std::env::var("PATH") {
            env.insert("PATH".into(), path);
        }
        let checkout = dir.attempt(n);
        let cwd = if checkout.is_dir() {
            checkout.clone()
        } else {
            self.settings.local_dir.clone()
        };
        self.pre_exit(&env, &cwd, &dir.log(n)).await;
    }

    /// Once the submission's end is stored, removes the job's directory and keeps its report.
    fn spawn_cleanup(&self, submission_id: String, build_id: String) {
        let me = self.me.clone();
        tokio::spawn(async move {
            let rx = me
                .upgrade()
                .and_then(|m| m.app())
                .and_then(|app| app.store.subscribe(&submission_id));
            let mut stored = None;
            if let Some(mut rx) = rx {
                // Ends when the submission is terminal, or leaves memory (then it is too).
                if let Ok(s) = rx.wait_for(|s| s.state.is_terminal()).await {
                    stored = s.finished_at;
                }
            }
            let Some(me) = me.upgrade() else { return };
            let report = lock(&me.jobs).get_mut(&build_id).map(|rec| {
                rec.timings.stored = stored.or_else(|| Some(Utc::now()));
                (rec.report(), rec.dir.clone())
            });
            let Some((report, dir)) = report else { return };
            // The report moves to the history before the record goes, so it is never missing.
            {
                let mut h = lock(&me.history);
                if h.len() >= HISTORY {
                    h.pop_front();
                }
                h.push_back(report);
            }
            lock(&me.jobs).remove(&build_id);
            if let Err(e) = dir.remove() {
                tracing::warn!(dir = %dir.path().display(), error = %e, "cannot remove a local job directory");
            }
        });
    }
}

/// Stops a command hook this process started (SIGTERM to its group, SIGKILL after the
/// grace), and waits until nothing of its group is left: the runner stops its harness and
/// writes its result after the hook itself has gone.
async fn stop_child(
    child: &mut tokio::process::Child,
    me: Option<ProcessId>,
) -> std::io::Result<std::process::ExitStatus> {
    let Some(p) = me else {
        let _ = child.start_kill();
        return child.wait().await;
    };
    let mut status = None;
    stop_group(p.pid, || {
        if status.is_none() {
            status = child.try_wait().ok().flatten();
        }
        status.is_none()
    })
    .await;
    match status {
        Some(s) => Ok(s),
        None => child.wait().await,
    }
}

/// SIGTERM to group `pgid`, then waits until the group is empty and `leader_alive` says no;
/// SIGKILL once [`STOP_GRACE`] has passed, and gives up a second later (a member stuck in the
/// kernel cannot be helped here; `pre-exit` reports what it finds).
async fn stop_group(pgid: u32, mut leader_alive: impl FnMut() -> bool) {
    use rustix::process::Signal;
    hooks::signal_group(pgid, Signal::TERM);
    let start = tokio::time::Instant::now();
    let mut killed = false;
    loop {
        let alive = leader_alive();
        if !alive && !hooks::group_exists(pgid) {
            return;
        }
        let waited = start.elapsed();
        if !killed && waited >= STOP_GRACE {
            hooks::signal_group(pgid, Signal::KILL);
            killed = true;
        }
        if waited >= STOP_GRACE + Duration::from_secs(1) {
            tracing::warn!(pgid, "processes of a stopped job are still there");
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// How large a payload travels in the environment (above: in a file beside the job).
const PAYLOAD_IN_ENV_MAX: usize = 1 << 20;

/// What the hooks said when a job ran without limits.
pub const UNENFORCED: &str = "UNENFORCED";

/// How the hooks confined the job, from the `environment` hook's log.
fn isolation_of(log: &str) -> Option<String> {
    if log.contains("RUNNING UNENFORCED") {
        return Some(UNENFORCED.into());
    }
    log.lines()
        .find_map(|l| l.split(", cgroup ").nth(1))
        .map(|v| format!("cgroup {}", v.trim()))
}

fn append_log(path: &Path, hook: &str, text: &str) {
    use std::io::Write;
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = writeln!(f, "--- {hook}");
        let _ = f.write_all(text.as_bytes());
    }
}

#[derive(Debug, Default)]
struct AttemptOutcome {
    exit_code: Option<i32>,
    failure: Option<String>,
    isolation: Option<String>,
    leased: Option<DateTime<Utc>>,
    command_done: Option<DateTime<Utc>>,
}

/// One slice's worker: takes jobs off the queue in order, one at a time. It holds the executor
/// only while it runs a job, so dropping the service ends it.
async fn worker(me: Weak<LocalExecutor>, wake: Arc<Notify>, slice: PlannedSlice) {
    loop {
        let notified = wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let Some(this) = me.upgrade() else { return };
        if let Some((q, at)) = this.pop() {
            this.run(&slice, q, at).await;
            continue;
        }
        drop(this);
        notified.await;
    }
}

/// Plans the node (or reads the operator's plan) and writes the plan the hooks will read.
async fn load_plan(settings: &LocalSettings) -> Result<(PathBuf, Vec<PlannedSlice>), LocalError> {
    let (path, text) = match &settings.plan_file {
        Some(p) => (
            p.clone(),
            std::fs::read_to_string(p).map_err(|e| LocalError::PlanParse {
                path: p.clone(),
                source: e.into(),
            })?,
        ),
        None => {
            let isolate = &settings.bins.isolate;
            let plan = |extra: Vec<String>| {
                let mut c = Command::new(isolate);
                c.arg("plan")
                    .arg("--json")
                    .arg("--sysfs-root")
                    .arg(&settings.sysfs_root)
                    .args(extra)
                    .stdin(std::process::Stdio::null());
                c
            };
            let run = |mut c: Command| async move {
                c.output().await.map_err(|e| LocalError::Plan {
                    isolate: isolate.clone(),
                    stderr: e.to_string(),
                })
            };
            let mut out = run(plan(vec![])).await?;
            if !out.status.success()
                && String::from_utf8_lossy(&out.stderr).contains("--cpu-only-slices")
            {
                tracing::info!(
                    slices = settings.cpu_only_slices,
                    "no GPU on this machine: planning CPU-only slices"
                );
                out = run(plan(vec![
                    "--cpu-only-slices".into(),
                    settings.cpu_only_slices.to_string(),
                ]))
                .await?;
            }
            if !out.status.success() {
                return Err(LocalError::Plan {
                    isolate: isolate.clone(),
                    stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
                });
            }
            let path = settings.local_dir.join("plan.json");
            std::fs::write(&path, &out.stdout).map_err(|source| LocalError::Dir {
                path: path.clone(),
                source,
            })?;
            (path, String::from_utf8_lossy(&out.stdout).into_owned())
        }
    };
    let plan: PlanShape = serde_json::from_str(&text).map_err(|e| LocalError::PlanParse {
        path: path.clone(),
        source: e.into(),
    })?;
    if plan.slices.is_empty() {
        return Err(LocalError::NoSlices);
    }
    Ok((path, plan.slices))
}

impl Executor for LocalExecutor {
    fn name(&self) -> &'static str {
        "local"
    }

    fn launch<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Result<Launched, BoxError>> {
        Box::pin(async move {
            let id = uuid::Uuid::new_v4().to_string();
            let dir = JobDir::new(&self.jobs_root(), &id);
            let build = BuildInfo {
                id: id.clone(),
                number: self.next_number.fetch_add(1, Ordering::Relaxed),
                web_url: format!("file://{}", dir.path().display()),
            };
            // Queue order is the order the service accepted the submissions in (their
            // launches may run in any order).
            let accepted_at = self
                .app()
                .and_then(|app| app.store.get(&job.submission_id))
                .map_or_else(Utc::now, |s| s.created_at);
            let file = JobFile {
                submission_id: job.submission_id.clone(),
                run_id: job.run_id.clone(),
                queue: job.queue.clone(),
                mode: job.mode.clone(),
                build: build.clone(),
                payload: job.payload.clone(),
                accepted_at,
            };
            dir.create(&file).map_err(|e| {
                format!(
                    "cannot write the local job directory {}: {e}",
                    dir.path().display()
                )
            })?;
            let timings = Timings {
                accepted: Some(accepted_at),
                ..Timings::default()
            };
            let (started, left_queue) = tokio::sync::oneshot::channel();
            lock(&self.jobs).insert(
                id.clone(),
                Record {
                    file,
                    dir,
                    attempt: 1,
                    stage: Stage::Queued,
                    slice: None,
                    isolation: None,
                    failure: None,
                    exit_code: None,
                    cancel: Arc::new(Notify::new()),
                    canceled: false,
                    started: Some(started),
                    timings,
                },
            );
            self.enqueue(id, accepted_at);
            // The build is handed back (and the submission becomes `scheduled`) when a slice
            // takes the job: until then it waits in `queued`. A submission that ends while
            // queued (canceled, timed out) gets its build back at once, and the core cancels
            // it, which drops the job from the queue.
            let ended = async {
                match self
                    .app()
                    .and_then(|app| app.store.subscribe(&job.submission_id))
                {
                    Some(mut rx) => {
                        let _ = rx.wait_for(|s| s.state.is_terminal()).await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = left_queue => {}
                _ = ended => {}
            }
            Ok(Launched {
                build,
                running: false,
            })
        })
    }

    fn cancel<'a>(&'a self, build: &'a BuildInfo) -> BoxFuture<'a, Result<bool, BoxError>> {
        Box::pin(async move {
            let mut jobs = lock(&self.jobs);
            let Some(rec) = jobs.get_mut(&build.id) else {
                return Ok(false);
            };
            match rec.stage {
                Stage::Finished => Ok(false),
                Stage::Running => {
                    rec.canceled = true;
                    rec.cancel.notify_one();
                    Ok(true)
                }
                Stage::Queued => {
                    rec.canceled = true;
                    rec.stage = Stage::Finished;
                    let sub = rec.file.submission_id.clone();
                    drop(jobs);
                    lock(&self.queue).retain(|q| q.build_id != build.id);
                    // The submission has ended already (that is why it is canceled).
                    if let Some(rec) = lock(&self.jobs).remove(&build.id) {
                        let _ = rec.dir.remove();
                    }
                    tracing::info!(id = %sub, build = build.number, "queued local job dropped");
                    Ok(true)
                }
            }
        })
    }

    fn collect<'a>(&'a self, build: &'a BuildStatus) -> BoxFuture<'a, Outcome> {
        Box::pin(async move {
            let found = lock(&self.jobs).get(&build.id).map(|r| {
                (
                    r.dir.result(r.attempt),
                    r.dir.log(r.attempt),
                    r.failure.clone(),
                    r.exit_code,
                )
            });
            let Some((result, log, failure, exit_code)) = found else {
                return Outcome::Failed(format!(
                    "local job #{} is not known to this service",
                    build.number
                ));
            };
            let bytes = match tokio::fs::read(&result).await {
                Ok(b) => b,
                Err(_) => {
                    let why = failure.unwrap_or_else(|| {
                        format!(
                            "the job's command ended (exit {}) without writing result.json",
                            exit_code.map_or("?".into(), |c| c.to_string())
                        )
                    });
                    let tail = jobdir::tail(&log, 2000);
                    return Outcome::Failed(if tail.is_empty() || why.contains(&tail) {
                        format!("local job #{}: {why}", build.number)
                    } else {
                        format!(
                            "local job #{}: {why}; its log ends with:\n{tail}",
                            build.number
                        )
                    });
                }
            };
            match ResultJson::parse(&bytes) {
                Ok(r) => {
                    if let Some(rec) = lock(&self.jobs).get_mut(&build.id) {
                        rec.timings.note_result(r.get());
                    }
                    Outcome::Succeeded(r)
                }
                Err(e) => Outcome::Failed(format!(
                    "local job #{} wrote a result.json that cannot be used: {}",
                    build.number,
                    crate::report::report(&e)
                )),
            }
        })
    }

    fn recover<'a>(&'a self, build: &'a BuildInfo) -> BoxFuture<'a, Result<Recovered, BoxError>> {
        Box::pin(async move {
            if lock(&self.jobs).contains_key(&build.id) {
                return Ok(Recovered::Running);
            }
            if !jobdir::valid_build_id(&build.id) {
                return Ok(Recovered::Lost(format!(
                    "build {} was not made by the local executor",
                    build.id
                )));
            }
            let dir = JobDir::new(&self.jobs_root(), &build.id);
            let file = match dir.read() {
                Ok(f) => f,
                Err(e) => {
                    return Ok(Recovered::Lost(format!(
                        "the service restarted and local job #{}'s directory {} cannot be read ({e}); submit again",
                        build.number,
                        dir.path().display()
                    )))
                }
            };
            // A result written before anything is stopped is the attempt's own; one written
            // after is the runner reporting that it was stopped, and is not used.
            let last = dir.last_attempt();
            let finished = last.filter(|n| {
                std::fs::read(dir.result(*n))
                    .ok()
                    .is_some_and(|b| ResultJson::parse(&b).is_ok())
            });
            if let Some(n) = last {
                // Whatever the attempt left runs no longer, and its slice is free again,
                // before the job is collected or runs again.
                self.stop_attempt(&dir, &file, n).await;
            }
            let attempt = match finished {
                Some(n) => n,
                None => last.map_or(1, |n| n + 1),
            };
            let stage = if finished.is_some() {
                Stage::Finished
            } else {
                Stage::Queued
            };
            let accepted_at = file.accepted_at;
            lock(&self.jobs).insert(
                build.id.clone(),
                Record {
                    file: file.clone(),
                    dir,
                    attempt,
                    stage,
                    slice: None,
                    isolation: None,
                    failure: None,
                    exit_code: None,
                    cancel: Arc::new(Notify::new()),
                    canceled: false,
                    started: None,
                    timings: Timings {
                        accepted: Some(accepted_at),
                        ..Timings::default()
                    },
                },
            );
            if finished.is_some() {
                tracing::info!(
                    build = build.number,
                    attempt,
                    "local job finished while the service was down; collecting its result"
                );
                self.spawn_cleanup(file.submission_id.clone(), build.id.clone());
                return Ok(Recovered::Finished(BuildStatus {
                    id: build.id.clone(),
                    number: build.number,
                    state: "passed".into(),
                    web_url: build.web_url.clone(),
                    blocked: false,
                }));
            }
            tracing::info!(
                build = build.number,
                attempt,
                "local job interrupted by a restart; running it again"
            );
            self.enqueue(build.id.clone(), accepted_at);
            Ok(Recovered::Running)
        })
    }
}
