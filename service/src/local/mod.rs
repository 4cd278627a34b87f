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
pub mod job;
pub mod jobdir;
pub mod plan;
pub mod safe_read;
pub mod settings;
pub mod timing;

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use tokio::sync::Notify;

use crate::executor::{
    BuildEvent, BuildEventKind, BuildStatus, Collected, Events, Executor, Job, Launched, Reclaim,
    Recovered,
};
use crate::report::BoxError;
use crate::result::ResultJson;
use crate::submission::{BuildInfo, Outcome};
use jobdir::{JobDir, JobFile};
use kernelkite_sys::provenance::Provenance;
pub use plan::PlannedSlice;
use safe_read::ReadError;
pub use settings::{LocalArgs, LocalSettings, SandboxChoice, SandboxDecision};
use timing::Timings;
use tracing::Instrument;

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
    /// Whether the removal of its directory (once the submission's end is stored) is under way.
    cleanup_spawned: bool,
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
    /// A ranked run (a quarantined slice leaves it to the others).
    ranked: bool,
    /// The only slice (agent name) that may take it.
    pin: Option<String>,
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
    /// The core, once [`LocalExecutor::start`] connected it.
    events: OnceLock<Arc<dyn Events>>,
    next_number: AtomicU64,
    warned_unenforced: std::sync::atomic::AtomicBool,
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
        let (plan_file, slices) = plan::load_plan(&settings).await?;
        let host = kernelkite_sys::host::name();
        Ok(Arc::new_cyclic(|me| LocalExecutor {
            me: me.clone(),
            settings,
            plan_file,
            slices,
            queue: Mutex::new(VecDeque::new()),
            wake: Arc::new(Notify::new()),
            jobs: Mutex::new(HashMap::new()),
            history: Mutex::new(VecDeque::new()),
            events: OnceLock::new(),
            next_number: AtomicU64::new(1),
            warned_unenforced: std::sync::atomic::AtomicBool::new(false),
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

    /// Connects the executor to the core it reports to (`crate::events::for_executor`), picks up the jobs a
    /// previous run left in the local directory (see [`LocalExecutor::sweep`]), then starts
    /// one worker per slice. Call once, after the service's store has loaded what it keeps.
    pub async fn start(self: &Arc<Self>, events: Arc<dyn Events>) {
        let _ = self.events.set(events.clone());
        self.sweep(events.as_ref()).await;
        for slice in &self.slices {
            tokio::spawn(job::worker(
                Arc::downgrade(self),
                self.wake.clone(),
                slice.clone(),
            ));
        }
        match &self.settings.sandbox.why_off {
            Some(why) => tracing::warn!("local executor: no sandbox: {why}"),
            None if self.settings.sandbox.on => {
                tracing::info!("local executor: commands run in the plugin's sandbox")
            }
            None => tracing::warn!(
                "local executor: no sandbox (--sandbox off): commands run as this service's user"
            ),
        }
        tracing::info!(
            slices = self.slices.len(),
            plan = %self.plan_file.display(),
            run_dir = %self.settings.run_dir.display(),
            "local executor: one worker per slice"
        );
    }

    /// Goes through the job directories a previous run left: a job whose submission is still
    /// open with this job's build is recovered by the core ([`Events::reclaim`]); any other
    /// (its submission ended, is unknown, or never recorded this build, having waited in the
    /// queue when the service stopped) is cleaned up after (its leftover processes stopped,
    /// `pre-exit` run) and removed.
    pub async fn sweep(self: &Arc<Self>, events: &dyn Events) {
        for dir in jobdir::list(&self.jobs_root()) {
            // A job this process launched is its own, whatever its directory holds yet: `launch`
            // registers the job before it makes the directory, so a directory listed here
            // while being written (no `job.json` yet) is never taken for a leftover.
            let ours = dir
                .path()
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|id| lock(&self.jobs).contains_key(id));
            if ours {
                continue;
            }
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
            match events.reclaim(&file.submission_id, &file.build.id).await {
                Reclaim::Recovered => {}
                other => {
                    match other {
                        Reclaim::Unknown => {
                            tracing::warn!(id = %file.submission_id, build = file.build.number, "the store does not know this local job's submission; dropping the job")
                        }
                        Reclaim::Unreadable(why) => {
                            tracing::warn!(id = %file.submission_id, build = file.build.number, error = %why, "the store could not be read for this local job's submission; dropping the job (its submission times out if it is still in flight)")
                        }
                        Reclaim::NotOpen | Reclaim::Recovered => {}
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

    fn events(&self) -> Option<&Arc<dyn Events>> {
        self.events.get()
    }

    /// The largest `result.json` taken from a job: the service's `--max-artifact-bytes`
    /// (KERNELKITE_MAX_ARTIFACT_BYTES), the cap the Buildkite executor's downloads have.
    fn result_cap(&self) -> u64 {
        self.events()
            .map_or(crate::config::DEFAULT_MAX_ARTIFACT_BYTES, |e| {
                e.max_artifact_bytes()
            })
    }

    /// The provenance the job's runner wrote beside its result, when it wrote one that can be
    /// used (read as the result is: a regular file, capped; anything else is logged and left
    /// out, never costing the result).
    async fn provenance_of(&self, build: &BuildStatus) -> Option<Provenance> {
        let (dir, attempt) = lock(&self.jobs)
            .get(&build.id)
            .map(|r| (r.dir.clone(), r.attempt))?;
        let read = tokio::task::spawn_blocking(move || dir.read_provenance(attempt)).await;
        let why = match read {
            Ok(Ok(bytes)) => match Provenance::parse(&bytes) {
                Ok(p) => return Some(p),
                Err(e) => e.to_string(),
            },
            Ok(Err(ReadError::Missing { .. })) => return None,
            Ok(Err(e)) => e.to_string(),
            Err(e) => e.to_string(),
        };
        tracing::warn!(build = build.number, %why, "the job's provenance.json is not used");
        None
    }

    fn node_args(&self) -> Vec<std::ffi::OsString> {
        hooks::node_args(
            &self.settings.run_dir,
            &self.plan_file,
            &self.settings.sysfs_root,
            &self.settings.cgroup_root,
        )
    }

    /// Hands the core a build event in the background (the job goes on meanwhile).
    fn emit(&self, kind: BuildEventKind, build: &BuildInfo, state: &str) {
        if let Some(events) = self.events().cloned() {
            let event = BuildEvent {
                kind,
                build: BuildStatus {
                    id: build.id.clone(),
                    number: build.number,
                    state: state.to_string(),
                    web_url: build.web_url.clone(),
                    blocked: false,
                },
            };
            tokio::spawn(
                async move { events.deliver(event).await }
                    .instrument(tracing::info_span!(parent: None, "event")),
            );
        }
    }

    /// Puts a job in the queue, before every job whose key is later. A launch's key is the
    /// time it was launched (the service's queue chose that order, and launches a job only
    /// when a slice is free, so this queue is short); a job recovered after a restart keeps
    /// its submission's acceptance time, so it goes before every later launch.
    fn enqueue(&self, file: &JobFile) {
        let (build_id, accepted_at) = (file.build.id.clone(), file.accepted_at);
        let mut q = lock(&self.queue);
        // Read under the queue's lock, like `pop`'s time: the two compare.
        let queued = Utc::now();
        let at = q
            .iter()
            .position(|e| e.accepted_at > accepted_at)
            .unwrap_or(q.len());
        q.insert(
            at,
            Queued {
                build_id: build_id.clone(),
                accepted_at,
                ranked: file.ranked,
                pin: file.pin.clone(),
            },
        );
        drop(q);
        if let Some(rec) = lock(&self.jobs).get_mut(&build_id) {
            rec.timings.queued = Some(queued);
        }
        // Every idle worker looks: a job pinned to one slice, or a ranked one that a
        // quarantined slice leaves, is not every worker's to take.
        self.wake.notify_waiters();
    }

    /// The next job slice `slice` may take, and when it left the queue (taken under the
    /// queue's lock, so the times are in queue order): the first not pinned to another slice
    /// and, while the slice is quarantined, not ranked.
    fn pop(&self, slice: &PlannedSlice) -> Option<(Queued, DateTime<Utc>)> {
        let me = self.agent_name(slice);
        let held = self.events().is_some_and(|e| e.held_back(&me));
        let mut q = lock(&self.queue);
        let at = q
            .iter()
            .position(|j| j.pin.as_ref().is_none_or(|p| *p == me) && !(held && j.ranked))?;
        q.remove(at).map(|j| (j, Utc::now()))
    }

    /// Slice `slice`'s agent name: the name a Buildkite agent bound to it would have, and the
    /// slice's id in the fleet.
    pub fn agent_name(&self, slice: &PlannedSlice) -> String {
        format!("local-{}-{}", self.host, slice.index)
    }

    /// Once the submission's end is stored, removes the job's directory and keeps its report.
    fn spawn_cleanup(&self, submission_id: String, build_id: String) {
        if let Some(rec) = lock(&self.jobs).get_mut(&build_id) {
            rec.cleanup_spawned = true;
        }
        let me = self.me.clone();
        tokio::spawn(async move {
            let rx = me
                .upgrade()
                .and_then(|m| m.events().and_then(|e| e.watch(&submission_id)));
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

/// What the hooks said when a job ran without limits.
pub const UNENFORCED: &str = "UNENFORCED";

impl Executor for LocalExecutor {
    fn name(&self) -> &'static str {
        "local"
    }

    fn slots(&self) -> Option<u64> {
        Some(self.slices.len() as u64)
    }

    fn roster(&self) -> Option<Vec<crate::executor::AgentInfo>> {
        let busy: std::collections::HashSet<u32> = lock(&self.jobs)
            .values()
            .filter(|r| r.stage == Stage::Running)
            .filter_map(|r| r.slice)
            .collect();
        Some(
            self.slices
                .iter()
                .map(|s| crate::executor::AgentInfo {
                    name: self.agent_name(s),
                    queue: Some(kernelkite_core::dispatch::NODE_LINE.to_string()),
                    node: Some(self.host.clone()),
                    busy: busy.contains(&s.index),
                    paused: false,
                    paused_note: None,
                    version: Some(env!("CARGO_PKG_VERSION").to_string()),
                    tags: vec![format!("gpu-index={}", s.index)],
                })
                .collect(),
        )
    }

    // Over 80 lines: the job is registered, written to its directory and queued in one place, in
    // the order the start-up sweep relies on.
    fn launch<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Result<Launched, BoxError>> {
        Box::pin(async move {
            let id = uuid::Uuid::new_v4().to_string();
            let dir = JobDir::new(&self.jobs_root(), &id);
            let build = BuildInfo {
                id: id.clone(),
                number: self.next_number.fetch_add(1, Ordering::Relaxed),
                // Nothing a competitor could open: the job directory is on this machine and gone
                // after the run (kernelbot's launcher links only http(s) pages).
                web_url: String::new(),
            };
            // When the submission was accepted (its timings); the queue's order is the order
            // of the launches below.
            let accepted_at = self
                .events()
                .and_then(|e| e.watch(&job.submission_id))
                .map_or_else(Utc::now, |rx| rx.borrow().created_at);
            let file = JobFile {
                submission_id: job.submission_id.clone(),
                run_id: job.run_id.clone(),
                queue: job.queue.clone(),
                mode: job.mode.clone(),
                build: build.clone(),
                payload: job.payload.clone(),
                accepted_at,
                ranked: job.ranked,
                pin: job.pin.clone(),
            };
            let timings = Timings {
                accepted: Some(accepted_at),
                ..Timings::default()
            };
            let (started, left_queue) = tokio::sync::oneshot::channel();
            // Registered before its directory exists, so the start-up sweep (which may still
            // be going through the previous run's directories) never removes it half-written.
            lock(&self.jobs).insert(
                id.clone(),
                Record {
                    file: file.clone(),
                    dir: dir.clone(),
                    attempt: 1,
                    stage: Stage::Queued,
                    slice: None,
                    isolation: None,
                    failure: None,
                    exit_code: None,
                    cancel: Arc::new(Notify::new()),
                    canceled: false,
                    started: Some(started),
                    cleanup_spawned: false,
                    timings,
                },
            );
            if let Err(e) = dir.create(&file) {
                lock(&self.jobs).remove(&id);
                if e.kind() != std::io::ErrorKind::AlreadyExists {
                    let _ = dir.remove();
                }
                return Err(format!(
                    "cannot write the local job directory {}: {e}",
                    dir.path().display()
                )
                .into());
            }
            self.enqueue(&file);
            // The build is handed back (and the submission becomes `scheduled`) when a slice
            // takes the job: until then it waits in `queued`. A submission that ends while
            // queued (canceled, timed out) gets its build back at once, and the core cancels
            // it, which drops the job from the queue.
            let ended = async {
                match self.events().and_then(|e| e.watch(&job.submission_id)) {
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

    // Over 80 lines: each way a job's result.json can be missing, too large or unusable gets
    // its own message, naming what to do.
    fn collect<'a>(&'a self, build: &'a BuildStatus) -> BoxFuture<'a, Result<Collected, BoxError>> {
        // A local job's result is on this machine: nothing transient to retry.
        Box::pin(async move {
            let outcome = async move {
                let found = lock(&self.jobs).get(&build.id).map(|r| {
                    (r.dir.clone(), r.attempt, r.failure.clone(), r.exit_code)
                });
                let Some((dir, attempt, failure, exit_code)) = found else {
                    return Outcome::Failed(format!(
                        "local job #{} is not known to this service",
                        build.number
                    ));
                };
                // A job recovered as finished has no worker to clean up after it: its directory
                // goes once its end is stored, as any other's, whatever its result turns out to be.
                let recovered = {
                    let mut jobs = lock(&self.jobs);
                    jobs.get_mut(&build.id).and_then(|rec| {
                        let first = rec.stage == Stage::Finished && !rec.cleanup_spawned;
                        first.then(|| rec.file.submission_id.clone())
                    })
                };
                if let Some(submission_id) = recovered {
                    self.spawn_cleanup(submission_id, build.id.clone());
                }
                // Up to the cap of bytes, read off the async threads.
                let cap = self.result_cap();
                let reader = dir.clone();
                let read =
                    tokio::task::spawn_blocking(move || reader.read_result(attempt, cap)).await;
                let bytes = match read {
                    Ok(Ok(b)) => b,
                    Ok(Err(ReadError::Missing { .. })) => {
                        let tail = dir.log_tail(attempt, 2000);
                        let why = failure
                            .or_else(|| not_started(exit_code, &tail))
                            .unwrap_or_else(|| {
                                format!(
                                    "the job's command ended (exit {}) without writing result.json",
                                    exit_code.map_or("?".into(), |c| c.to_string())
                                )
                            });
                        return Outcome::Failed(if tail.is_empty() || why.contains(&tail) {
                            format!("local job #{}: {why}", build.number)
                        } else {
                            format!(
                                "local job #{}: {why}; its log ends with:\n{tail}",
                                build.number
                            )
                        });
                    }
                    Ok(Err(e @ ReadError::TooLarge { .. })) => {
                        return Outcome::Failed(format!(
                            "local job #{}: its result.json is not used: {e}; the limit is the service's --max-artifact-bytes (KERNELKITE_MAX_ARTIFACT_BYTES): make the run's output smaller, or raise the limit",
                            build.number
                        ))
                    }
                    Ok(Err(e)) => {
                        return Outcome::Failed(format!(
                            "local job #{}: its result.json is not used: {e}",
                            build.number
                        ))
                    }
                    Err(e) => {
                        return Outcome::Failed(format!(
                            "local job #{}: reading its result.json failed: {e}",
                            build.number
                        ))
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
            }
            .await;
            let provenance = self.provenance_of(build).await;
            Ok(Collected {
                outcome,
                provenance,
            })
        })
    }

    // Over 80 lines: a job directory found after a restart is checked, its last attempt stopped and
    // the job re-registered in one place, so nothing else sees it half-recovered.
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
            let cap = self.result_cap();
            let finished = last.filter(|n| {
                dir.read_result(*n, cap)
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
                    cleanup_spawned: false,
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
            self.enqueue(&file);
            Ok(Recovered::Running)
        })
    }
}

/// Why a job's command never ran, in one line, when its shell says so: exit 126 (found, not
/// executable) or 127 (not found), with the shell's own line from the log's end. The job's
/// log also holds the sandbox's description, which would otherwise come first.
fn not_started(exit_code: Option<i32>, log_tail: &str) -> Option<String> {
    let code = exit_code.filter(|c| *c == 126 || *c == 127)?;
    let said = log_tail.lines().rev().map(str::trim).find(|l| {
        [
            "No such file",
            "not found",
            "Permission denied",
            "cannot execute",
        ]
        .iter()
        .any(|m| l.contains(m))
    });
    Some(match said {
        Some(line) => format!("the runner could not be started (exit {code}): {line}"),
        None => {
            format!("the runner could not be started (exit {code}: the shell could not run it)")
        }
    })
}

#[cfg(test)]
mod tests {
    use super::not_started;

    #[test]
    fn a_runner_that_never_started_is_named_in_one_line() {
        let tail = "--- environment\njob holds GPU(s) [0]\n--- command\nthe command will run in the sandbox\nbash: line 1: /var/tmp/kk/target/release/kernelkite-runner: No such file or directory\n";
        assert_eq!(
            not_started(Some(127), tail).as_deref(),
            Some("the runner could not be started (exit 127): bash: line 1: /var/tmp/kk/target/release/kernelkite-runner: No such file or directory")
        );
        assert!(not_started(Some(126), "").unwrap().contains("exit 126"));
        // Any other end is the runner's own.
        assert_eq!(not_started(Some(1), tail), None);
        assert_eq!(not_started(None, tail), None);
    }
}
