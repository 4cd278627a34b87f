//! The agent API (`/v3`), enough for a real `buildkite-agent` v3.137.0 to run the fake's builds:
//! the pipeline's settings steps become jobs when a build is created ([`super::pipeline`]), agents
//! register and poll for the jobs their tags match, run them, and the builds they finish fire the
//! same signed webhooks and show the same REST state and artifacts as the rest of the fake.
//!
//! Every endpoint and field follows the agent's own client at the tag `v3.137.0` (its `api/`
//! package and the callers named below); `docs/DESIGN.md` ("The agent API in the fake
//! Buildkite") lists them. Facts the fake depends on, from that source:
//! - register's `ping_interval`, `job_status_interval` and `heartbeat_interval` must be at least
//!   1 (`agent/agent_worker_ping.go`, `agent/job_runner.go` make tickers of them);
//! - the accept answer's `chunks_max_size_bytes` must be above 0 (`agent/log_streamer.go`);
//! - a ping or heartbeat answered 401/404 stops the agent (`agent/agent_worker_ping.go`), so an
//!   unknown token gets 401 only where the agent should stop;
//! - v3.137 first tries a streaming ping (`POST /agentedge.v1.AgentEdgeService/StreamPings`,
//!   `api/pings_streaming.go`); answered 404 it falls back to `GET /v3/ping` for good;
//! - cancellation reaches the agent only through `GET /v3/jobs/{id}` (`canceling`,
//!   `timing_out`: `agent/job_runner.go` `jobCancellationChecker`); the agent never enforces
//!   `timeout_in_minutes` itself, Buildkite does, and so does the fake;
//! - artifacts: a batch create answers one id per artifact and upload instructions
//!   (`api/artifacts.go`, `internal/artifact/bk_uploader.go`); the file goes to the
//!   instruction's URL as a multipart form POST without `Authorization`; states come back in a
//!   `PUT` (`internal/artifact/uploader.go`).
//!
//! An agent that stops talking while it holds a job (no heartbeat, ping, log or job call for
//! [`World::lost_after`]) is lost: its job finishes with exit status `-1` and no signal reason,
//! as Buildkite marks a lost agent's job, and the step's automatic retry rules apply.
//!
//! Real Buildkite does not answer every call with success. A test makes calls fail
//! ([`super::FakeBuildkite::fail_agent_calls`]: a status, so many times, for the jobs of one
//! queue) and reads every call the agent made ([`super::FakeBuildkite::agent_calls`]); what the
//! agent does then is its own code's (v3.137.0, with `roko` retries): a `401` on the job-state
//! poll cancels the job (`agent/job_runner.go` `jobCancellationChecker`); finish retries 5xx
//! and 429 (`core/client.go` `FinishJob`, about 2-3 s later) and gives up at once on another
//! 4xx; a chunk retries 5xx only, and any 4xx (429 too) is given up and counted in finish's
//! `chunks_failed_count` (`UploadChunk`); an artifact batch refused with a 4xx other than 429
//! fails the upload, which turns a passed command's exit status into 1
//! (`internal/artifact/batch_creator.go`, `internal/job/executor.go`).

use std::collections::{BTreeMap, HashMap};
use std::io::Read as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use sha1::{Digest, Sha1};

use super::pipeline::{self, Step};
use super::{lock, now_iso, send_event, set_state, FakeArtifact, Inner, FAKE_AGENT_TOKEN};

/// How often registered agents are told to ping, heartbeat and poll their job's state (s).
const PING_INTERVAL_S: u64 = 1;
const HEARTBEAT_INTERVAL_S: u64 = 1;
const JOB_STATUS_INTERVAL_S: u64 = 1;
/// The pipeline's id (in its REST form too).
pub(super) const PIPELINE_ID: &str = "0183c3ba-0000-0000-0000-0000000000aa";
/// The log chunk size the fake accepts (the agent sends chunks up to this).
const CHUNK_MAX: u64 = 100 * 1024;

/// A call of the agent API, as faults and the record name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AgentCall {
    /// `GET /v3/ping`
    Ping,
    /// `POST /v3/heartbeat`
    Heartbeat,
    /// `PUT /v3/jobs/{id}/accept`
    Accept,
    /// `PUT /v3/jobs/{id}/start`
    Start,
    /// `GET /v3/jobs/{id}` (the job-state poll)
    JobState,
    /// `POST /v3/jobs/{id}/chunks`
    Chunks,
    /// `PUT /v3/jobs/{id}/finish`
    Finish,
    /// `POST /v3/jobs/{id}/artifacts` (the batch create)
    CreateArtifacts,
    /// `POST /uploads/{artifact}` (the file, to the blob store)
    UploadFile,
    /// `PUT /v3/jobs/{id}/artifacts` (the states)
    UpdateArtifacts,
    /// `POST /v3/pause` (`buildkite-agent pause`, with a job's token)
    Pause,
    /// `POST /v3/resume`
    Resume,
}

/// Calls that fail ([`super::FakeBuildkite::fail_agent_calls`]): the next `times` calls of
/// `call` answer `status` (with Buildkite's `{"message"}`), for the jobs of steps on `queue`
/// only when it is given (the calls of agents, not jobs, when `call` is one of theirs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentFault {
    /// The call.
    pub call: AgentCall,
    /// The status it answers.
    pub status: u16,
    /// How many calls it answers so (then they are answered as usual).
    pub times: u32,
    /// Only for jobs of steps that run on this queue.
    pub queue: Option<String>,
}

/// One call the agent API received.
#[derive(Debug, Clone)]
pub struct AgentCallRecord {
    /// The call.
    pub call: AgentCall,
    /// The job it was about, if any.
    pub job: Option<String>,
    /// The status a fault answered it with (`None`: answered as usual).
    pub failed: Option<u16>,
    /// When it arrived.
    pub at: Instant,
    /// Its JSON body (finish's: exit status, signal, `chunks_failed_count`).
    pub body: Option<Value>,
}

/// A registered agent.
#[derive(Debug, Clone)]
pub struct RegisteredAgent {
    /// Its id (`id` in the register answer).
    pub id: String,
    /// The name it registered with.
    pub name: String,
    /// Its tags (`meta_data`, `key=value`).
    pub tags: Vec<String>,
    token: String,
    /// When it last called the API.
    pub seen: Instant,
    /// Whether it said goodbye (`POST /disconnect`).
    pub disconnected: bool,
    /// Paused (no job is dispatched to it): the note, and when the pause times out.
    pub paused: Option<(String, Instant)>,
    /// The host it runs on and its version, as it registered (`api/agents.go`).
    pub hostname: String,
    /// Its version.
    pub version: String,
}

impl RegisteredAgent {
    /// Paused now (a pause past its timeout has ended).
    pub fn is_paused(&self) -> bool {
        self.paused
            .as_ref()
            .is_some_and(|(_, until)| Instant::now() < *until)
    }
}

/// The longest pause Buildkite allows (minutes), and the one it gives when none is asked
/// (<https://buildkite.com/docs/agent/self-hosted/pausing-and-resuming>).
const PAUSE_MAX_MINUTES: u64 = 10_080;
const PAUSE_DEFAULT_MINUTES: u64 = 5;

/// A job of a build played by agents.
#[derive(Debug, Clone)]
pub struct AgentJob {
    /// Its id.
    pub id: String,
    /// Its build's number.
    pub build: u64,
    /// The step it runs.
    pub step: Step,
    /// `scheduled`, `assigned`, `accepted`, `running`, `canceling`, `timing_out`, then
    /// `passed`, `failed`, `canceled`, `timed_out`.
    pub state: String,
    /// The agent that holds or held it.
    pub agent: Option<String>,
    token: String,
    /// The exit status it finished with (`-1`: lost, or stopped by a signal).
    pub exit_status: Option<i64>,
    /// The signal that ended it (`SIGTERM`, ...).
    pub signal: Option<String>,
    /// `cancel`, `agent_stop`, ... (`None`: none).
    pub signal_reason: Option<String>,
    /// Log chunks the agent gave up on (finish's `chunks_failed_count`).
    pub chunks_failed: Option<u64>,
    /// Retries used so far by each of its step's automatic rules.
    rule_counts: Vec<u32>,
    /// Which try of its step this is (0 first).
    pub retry_count: u32,
    /// Whether a later job retried it (it then no longer counts for the build's state).
    pub retried: bool,
    log: BTreeMap<u64, Vec<u8>>,
    /// When it was made (its step created or uploaded), given to an agent, accepted, started and
    /// finished.
    pub times: JobTimes,
}

/// When a job reached each of its states (the benchmark's clock).
#[derive(Debug, Clone, Copy)]
pub struct JobTimes {
    /// Made (scheduled).
    pub scheduled: Instant,
    /// Given to an agent in a ping.
    pub assigned: Option<Instant>,
    /// Accepted by the agent.
    pub accepted: Option<Instant>,
    /// Started (`PUT .../start`).
    pub started: Option<Instant>,
    /// Finished (by the agent, or lost).
    pub finished: Option<Instant>,
}

impl AgentJob {
    fn finished(&self) -> bool {
        matches!(
            self.state.as_str(),
            "passed" | "failed" | "canceled" | "timed_out"
        )
    }

    /// The job's log as the agent streamed it (chunks put back in order).
    pub fn log(&self) -> String {
        let bytes: Vec<u8> = self.log.values().flatten().copied().collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// The agent side of the fake.
#[derive(Debug)]
pub struct World {
    /// The pipeline's settings steps (YAML); `None` until a test asks builds to be played by
    /// agents ([`super::FakeBuildkite::run_builds_on_agents`]).
    pub settings: Option<String>,
    /// The pipeline's repository (`BUILDKITE_REPO`).
    pub repository: String,
    /// Registered agents.
    pub agents: Vec<RegisteredAgent>,
    /// Every job, in the order made.
    pub jobs: Vec<AgentJob>,
    /// Build meta-data, per build.
    meta: HashMap<u64, BTreeMap<String, String>>,
    /// Uploaded artifacts waiting for their file: artifact id → (build, index in its list).
    pending_uploads: HashMap<String, u64>,
    /// Silence after which an agent holding a job is lost.
    pub lost_after: Duration,
    /// How long a `timeout_in_minutes` minute lasts (shortened by tests).
    pub minute: Duration,
    /// Builds whose cancel was asked for.
    canceled_builds: Vec<u64>,
    /// The uuids of the pipeline uploads taken.
    uploads: std::collections::HashSet<String>,
    /// Calls made to fail.
    faults: Vec<AgentFault>,
    /// Jobs of steps on this queue are given this command instead of their step's (a
    /// backend, or a token, that runs something else than what was signed).
    forged_command: Option<(String, String)>,
    /// Every call received, in order.
    calls: Vec<AgentCallRecord>,
}

impl Default for World {
    fn default() -> World {
        World {
            settings: None,
            repository: String::new(),
            agents: Vec::new(),
            jobs: Vec::new(),
            meta: HashMap::new(),
            pending_uploads: HashMap::new(),
            lost_after: Duration::from_secs(10),
            minute: Duration::from_secs(60),
            canceled_builds: Vec::new(),
            uploads: std::collections::HashSet::new(),
            faults: Vec::new(),
            forged_command: None,
            calls: Vec::new(),
        }
    }
}

/// Records a call, and answers it with a fault's status when one applies (its count goes down).
fn gate(
    world: &mut World,
    call: AgentCall,
    job: Option<&str>,
    body: Option<Value>,
) -> Option<Response> {
    let queue = job
        .and_then(|id| world.jobs.iter().find(|j| j.id == id))
        .and_then(|j| j.step.agents.get("queue").cloned());
    let fault = world.faults.iter_mut().find(|f| {
        f.call == call && f.times > 0 && f.queue.as_ref().is_none_or(|q| Some(q) == queue.as_ref())
    });
    let failed = fault.map(|f| {
        f.times -= 1;
        f.status
    });
    world.calls.push(AgentCallRecord {
        call,
        job: job.map(str::to_string),
        failed,
        at: Instant::now(),
        body,
    });
    let status = StatusCode::from_u16(failed?).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    Some(error(status, "Injected failure"))
}

/// The calls of `call` gate [`gate`]s in a handler, returning its answer when a fault applies.
macro_rules! gate_or_answer {
    ($world:expr, $call:expr, $job:expr) => {
        gate_or_answer!($world, $call, $job, None)
    };
    ($world:expr, $call:expr, $job:expr, $body:expr) => {
        if let Some(r) = gate(&mut $world, $call, $job, $body) {
            return r;
        }
    };
}

fn token() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

fn error(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "message": message }))).into_response()
}

fn bearer(headers: &HeaderMap) -> Option<String> {
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Token "))
        .map(str::to_string)
}

/// Who a token is: the agent, and the job when it is a job's token.
fn caller(world: &mut World, headers: &HeaderMap) -> Option<(usize, Option<usize>)> {
    let t = bearer(headers)?;
    if let Some(a) = world.agents.iter().position(|a| a.token == t) {
        world.agents[a].seen = Instant::now();
        return Some((a, None));
    }
    // A job's token says nothing of its agent's health: the bootstrap and its subcommands
    // outlive a killed agent (the agent starts them in their own process group), and Buildkite
    // tells a lost agent by its own heartbeats and pings.
    let j = world.jobs.iter().position(|j| j.token == t)?;
    let agent = world.jobs[j].agent.clone()?;
    let a = world.agents.iter().position(|a| a.id == agent)?;
    Some((a, Some(j)))
}

/// The job `id` for the caller ([`job_of`]), or the handler answers its refusal.
macro_rules! job_or_refuse {
    ($world:ident, $headers:ident, $id:ident) => {
        match job_of(&mut $world, &$headers, &$id) {
            Ok(j) => j,
            Err((status, message)) => return error(status, message),
        }
    };
}

/// The job `id` when the caller may act on it (its agent, or its own token) and it has not
/// finished (a lost, canceled or timed-out job takes no more logs, artifacts or uploads: 422).
fn job_of(
    world: &mut World,
    headers: &HeaderMap,
    id: &str,
) -> Result<usize, (StatusCode, &'static str)> {
    let Some((a, by_job)) = caller(world, headers) else {
        return Err((StatusCode::UNAUTHORIZED, "Unauthorized"));
    };
    let Some(j) = world.jobs.iter().position(|j| j.id == id) else {
        return Err((StatusCode::NOT_FOUND, "No job found"));
    };
    let agent_id = world.agents[a].id.clone();
    if by_job.is_some_and(|bj| bj != j) || world.jobs[j].agent.as_deref() != Some(&agent_id) {
        return Err((StatusCode::FORBIDDEN, "This job is not yours"));
    }
    if world.jobs[j].finished() {
        return Err((
            StatusCode::UNPROCESSABLE_ENTITY,
            "This job has already finished",
        ));
    }
    Ok(j)
}

/// The variables Buildkite itself interpolates in settings steps, from the build.
fn build_variables(inner: &Inner, repository: &str, body: &Value) -> BTreeMap<String, String> {
    let s = |k: &str| {
        body.get(k)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    BTreeMap::from([
        ("BUILDKITE_BRANCH".into(), s("branch")),
        ("BUILDKITE_COMMIT".into(), s("commit")),
        ("BUILDKITE_MESSAGE".into(), s("message")),
        ("BUILDKITE_TAG".into(), String::new()),
        ("BUILDKITE_PIPELINE_SLUG".into(), inner.pipeline.clone()),
        ("BUILDKITE_PIPELINE_NAME".into(), "Submissions".into()),
        ("BUILDKITE_ORGANIZATION_SLUG".into(), inner.org.clone()),
        ("BUILDKITE_REPO".into(), repository.to_string()),
        ("BUILDKITE_PULL_REQUEST".into(), "false".into()),
        ("BUILDKITE_PIPELINE_ID".into(), PIPELINE_ID.into()),
        (
            "BUILDKITE_TRIGGERED_FROM_BUILD_PIPELINE_SLUG".into(),
            String::new(),
        ),
        ("BUILDKITE_PULL_REQUEST_BASE_BRANCH".into(), String::new()),
        ("BUILDKITE_PULL_REQUEST_REPO".into(), String::new()),
    ])
}

fn new_job(build: u64, step: Step, retry_count: u32) -> AgentJob {
    AgentJob {
        id: uuid::Uuid::new_v4().to_string(),
        build,
        step,
        state: "scheduled".into(),
        agent: None,
        token: token(),
        exit_status: None,
        signal: None,
        signal_reason: None,
        chunks_failed: None,
        rule_counts: Vec::new(),
        retry_count,
        retried: false,
        log: BTreeMap::new(),
        times: JobTimes {
            scheduled: Instant::now(),
            assigned: None,
            accepted: None,
            started: None,
            finished: None,
        },
    }
}

/// A build was created: when builds are played by agents, its settings steps become its jobs.
/// `Err` when the settings cannot be read (Buildkite then fails the build at once).
pub(super) fn build_created(
    inner: &Inner,
    number: u64,
    body: &Value,
) -> Option<Result<(), String>> {
    let mut world = lock(&inner.world);
    let settings = world.settings.clone()?;
    let vars = build_variables(inner, &world.repository, body);
    Some(pipeline::settings_steps(&settings, &vars).map(|steps| {
        for step in steps {
            world.jobs.push(new_job(number, step, 0));
        }
    }))
}

/// The build's jobs as the REST API lists them (`None` when agents do not play the fake's
/// builds).
pub(super) fn rest_jobs(inner: &Inner, number: u64) -> Option<Vec<Value>> {
    let world = lock(&inner.world);
    world.settings.as_ref()?;
    Some(
        world
            .jobs
            .iter()
            .filter(|j| j.build == number)
            .map(|j| {
                json!({
                    "id": j.id,
                    "type": "script",
                    "name": j.step.label,
                    "step_key": j.step.key,
                    "state": j.state,
                    "exit_status": j.exit_status,
                    "retried": j.retried,
                    "retries_count": j.retry_count,
                    "agent_query_rules": j.step.agents.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>(),
                    "agent": j.agent.as_ref().and_then(|a| world.agents.iter().find(|x| &x.id == a)).map(|a| json!({"id": a.id, "name": a.name})),
                })
            })
            .collect(),
    )
}

/// A cancel of build `number` through the REST API, when agents play it: jobs not yet on an
/// agent are canceled, running ones are `canceling` until their agent finishes them. Returns
/// `false` when agents do not play the fake's builds.
pub(super) async fn cancel(inner: &Arc<Inner>, number: u64) -> bool {
    {
        let mut world = lock(&inner.world);
        if world.settings.is_none() {
            return false;
        }
        world.canceled_builds.push(number);
        for j in world.jobs.iter_mut().filter(|j| j.build == number) {
            match j.state.as_str() {
                "scheduled" | "assigned" => j.state = "canceled".into(),
                "accepted" | "running" | "timing_out" => j.state = "canceling".into(),
                _ => {}
            }
        }
    }
    set_state(inner, number, "canceling");
    settle(inner, number).await;
    true
}

/// Ends build `number` once none of its jobs is left to run: `canceled` when it was canceled,
/// else `failed` when a job (not retried) failed or timed out, else `passed`; then sends
/// `build.finished`.
async fn settle(inner: &Arc<Inner>, number: u64) {
    let state = {
        let world = lock(&inner.world);
        let jobs: Vec<&AgentJob> = world
            .jobs
            .iter()
            .filter(|j| j.build == number && !j.retried)
            .collect();
        if jobs.iter().any(|j| !j.finished()) {
            return;
        }
        if world.canceled_builds.contains(&number) {
            "canceled"
        } else if jobs.iter().all(|j| j.state == "passed") {
            "passed"
        } else {
            "failed"
        }
    };
    let already = lock(&inner.builds)
        .get(number as usize - 1)
        .is_some_and(|b| matches!(b.state.as_str(), "passed" | "failed" | "canceled"));
    if already {
        return;
    }
    set_state(inner, number, state);
    send_event(inner, "build.finished", number).await;
}

/// Marks the jobs of agents silent for longer than [`World::lost_after`] as lost (exit status
/// `-1`), retrying them where their step says so. Returns the builds to settle.
fn find_lost(world: &mut World) -> Vec<u64> {
    let now = Instant::now();
    let lost: Vec<String> = world
        .agents
        .iter()
        .filter(|a| now.duration_since(a.seen) > world.lost_after)
        .map(|a| a.id.clone())
        .collect();
    let mut builds = Vec::new();
    for j in 0..world.jobs.len() {
        let job = &world.jobs[j];
        if job.finished() || job.state == "scheduled" {
            continue;
        }
        if job.agent.as_ref().is_some_and(|a| lost.contains(a)) {
            finish(world, j, -1, None, None);
            builds.push(world.jobs[j].build);
        }
    }
    builds
}

/// Finishes job `j` with `exit_status`, `signal` and `signal_reason`, and makes its retry when
/// one of its step's automatic rules matches and has retries left (each rule counts its own).
fn finish(
    world: &mut World,
    j: usize,
    exit_status: i64,
    signal: Option<String>,
    signal_reason: Option<String>,
) {
    let job = &mut world.jobs[j];
    job.state = match job.state.as_str() {
        "canceling" => "canceled",
        "timing_out" => "timed_out",
        _ if exit_status == 0 => "passed",
        _ => "failed",
    }
    .into();
    job.exit_status = Some(exit_status);
    job.signal = signal;
    job.signal_reason = signal_reason;
    job.times.finished = Some(Instant::now());
    let job = job.clone();
    if !matches!(job.state.as_str(), "failed" | "timed_out")
        || world.canceled_builds.contains(&job.build)
    {
        return;
    }
    let rule = job.step.retry.iter().position(|r| {
        r.matches(
            exit_status,
            job.signal.as_deref(),
            job.signal_reason.as_deref(),
        )
    });
    if let Some(rule) = rule {
        let used = job.rule_counts.get(rule).copied().unwrap_or(0);
        if used < job.step.retry[rule].limit {
            world.jobs[j].retried = true;
            let mut retry = new_job(job.build, job.step.clone(), job.retry_count + 1);
            retry.rule_counts = job.rule_counts.clone();
            retry.rule_counts.resize(job.step.retry.len(), 0);
            retry.rule_counts[rule] += 1;
            world.jobs.push(retry);
        }
    }
}

/// Watches for lost agents and timed-out jobs while the fake runs.
pub(super) async fn watch(inner: std::sync::Weak<Inner>) {
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let builds = {
            let mut world = lock(&inner.world);
            if world.settings.is_none() {
                continue;
            }
            let now = Instant::now();
            let minute = world.minute;
            for j in world.jobs.iter_mut() {
                let due = j
                    .step
                    .timeout_in_minutes
                    .zip(j.times.started)
                    .is_some_and(|(m, at)| now.duration_since(at) > minute * m as u32);
                if due && matches!(j.state.as_str(), "accepted" | "running") {
                    j.state = "timing_out".into();
                }
            }
            find_lost(&mut world)
        };
        for b in builds {
            settle(&inner, b).await;
        }
    }
}

/// `POST /v3/register` (`api/agents.go` `Register`), with the registration token.
pub(super) async fn register(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if bearer(&headers).as_deref() != Some(FAKE_AGENT_TOKEN) {
        return error(StatusCode::UNAUTHORIZED, "Invalid registration token");
    }
    let req: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(_) => return error(StatusCode::BAD_REQUEST, "Problems parsing JSON"),
    };
    let tags: Vec<String> = req["meta_data"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    let agent = RegisteredAgent {
        id: uuid::Uuid::new_v4().to_string(),
        name: req["name"].as_str().unwrap_or("agent").to_string(),
        tags: tags.clone(),
        token: token(),
        seen: Instant::now(),
        disconnected: false,
        paused: None,
        hostname: req["hostname"].as_str().unwrap_or_default().to_string(),
        version: req["version"].as_str().unwrap_or_default().to_string(),
    };
    let answer = json!({
        "id": agent.id,
        "name": agent.name,
        "access_token": agent.token,
        "endpoint": "",
        "ping_interval": PING_INTERVAL_S,
        "job_status_interval": JOB_STATUS_INTERVAL_S,
        "heartbeat_interval": HEARTBEAT_INTERVAL_S,
        "meta_data": tags,
    });
    lock(&inner.world).agents.push(agent);
    Json(answer).into_response()
}

/// `POST /v3/connect` (no body; `api/agents.go`).
pub(super) async fn connect(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> Response {
    set_connected(&inner, &headers, true)
}

/// `POST /v3/disconnect` (no body; `api/agents.go`).
pub(super) async fn disconnect(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> Response {
    set_connected(&inner, &headers, false)
}

fn set_connected(inner: &Inner, headers: &HeaderMap, connected: bool) -> Response {
    let mut world = lock(&inner.world);
    match caller(&mut world, headers) {
        Some((a, None)) => {
            world.agents[a].disconnected = !connected;
            Json(json!({})).into_response()
        }
        _ => error(StatusCode::UNAUTHORIZED, "Unauthorized"),
    }
}

/// `POST /v3/heartbeat` (`api/heartbeats.go`): the answer must be JSON.
pub(super) async fn heartbeat(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut world = lock(&inner.world);
    gate_or_answer!(world, AgentCall::Heartbeat, None);
    if caller(&mut world, &headers).is_none() {
        return error(StatusCode::UNAUTHORIZED, "Unauthorized");
    }
    let sent = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["sent_at"].as_str().map(str::to_string));
    Json(json!({"sent_at": sent, "received_at": now_iso()})).into_response()
}

/// `GET /v3/ping` (`api/pings.go`): a job whose step's `agents` rules the agent's tags match,
/// oldest first, when the agent holds none.
pub(super) async fn ping(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> Response {
    let mut world = lock(&inner.world);
    gate_or_answer!(world, AgentCall::Ping, None);
    let Some((a, None)) = caller(&mut world, &headers) else {
        return error(StatusCode::UNAUTHORIZED, "Unauthorized");
    };
    let me = world.agents[a].clone();
    if me.is_paused() {
        // agent/agent_worker_ping.go: with the action `pause` the agent takes no job and keeps
        // pinging; agent/agent_worker_action.go logs its resumption when the action changes.
        return Json(json!({"action": "pause"})).into_response();
    }
    let busy = world
        .jobs
        .iter()
        .any(|j| j.agent.as_deref() == Some(&me.id) && !j.finished());
    if busy {
        return Json(json!({"action": "idle"})).into_response();
    }
    let next = world
        .jobs
        .iter_mut()
        .find(|j| j.state == "scheduled" && j.step.runs_on(&me.tags));
    match next {
        Some(j) => {
            j.state = "assigned".into();
            j.agent = Some(me.id.clone());
            j.times.assigned = Some(Instant::now());
            Json(json!({"job": {"id": j.id}})).into_response()
        }
        None => Json(json!({"action": "idle"})).into_response(),
    }
}

/// The registered agents connected now, as the REST agents list shows them (an agent is
/// connected from its registration until it disconnects or stops talking for
/// [`World::lost_after`]): its id, name, host, version, tags, pause and current job.
pub(super) fn rest_agents(world: &World) -> Vec<Value> {
    world
        .agents
        .iter()
        .filter(|a| !a.disconnected && a.seen.elapsed() < world.lost_after)
        .map(|a| {
            let job = world
                .jobs
                .iter()
                .find(|j| j.agent.as_deref() == Some(&a.id) && !j.finished())
                .map(|j| json!({"id": j.id, "type": "script", "state": j.state}));
            let paused = a
                .is_paused()
                .then(|| a.paused.as_ref().map(|(n, _)| n.clone()));
            json!({
                "id": a.id,
                "name": a.name,
                "connection_state": "connected",
                "hostname": a.hostname,
                "version": a.version,
                "meta_data": a.tags,
                "job": job,
                "paused": paused.is_some(),
                "paused_note": paused.flatten(),
            })
        })
        .collect()
}

/// Pauses (`Some(note, minutes)`) or resumes (`None`) registered agent `id` for the REST API;
/// `None` when no connected agent has that id.
pub(super) fn set_paused_by_id(
    world: &mut World,
    id: &str,
    pause: Option<(String, u64)>,
) -> Option<Result<(), &'static str>> {
    let minute = world.minute;
    let lost_after = world.lost_after;
    let a = world
        .agents
        .iter_mut()
        .find(|a| a.id == id && !a.disconnected && a.seen.elapsed() < lost_after)?;
    Some(match pause {
        Some(_) if a.is_paused() => Err("Agent is already paused"),
        Some((note, minutes)) => {
            a.paused = Some((note, Instant::now() + minute * minutes as u32));
            Ok(())
        }
        None if !a.is_paused() => Err("Agent is not paused"),
        None => {
            a.paused = None;
            Ok(())
        }
    })
}

/// `POST /v3/pause` (`api/agents.go` `Pause`, sent by `buildkite-agent pause` from a job with
/// the job's access token: `clicommand/agent_pause.go`): pauses the caller's agent, with the
/// body's `note` and `timeout_in_minutes` (default 5, at most 10,080, as Buildkite documents).
pub(super) async fn pause(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut world = lock(&inner.world);
    let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let who = caller(&mut world, &headers);
    let job = who.and_then(|(_, j)| j).map(|j| world.jobs[j].id.clone());
    gate_or_answer!(world, AgentCall::Pause, job.as_deref(), Some(req.clone()));
    let Some((a, _)) = who else {
        return error(StatusCode::UNAUTHORIZED, "Unauthorized");
    };
    let minutes = req["timeout_in_minutes"]
        .as_u64()
        .filter(|m| *m > 0)
        .unwrap_or(PAUSE_DEFAULT_MINUTES);
    if minutes > PAUSE_MAX_MINUTES {
        return error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "timeout_in_minutes must be at most 10080",
        );
    }
    let note = req["note"].as_str().unwrap_or_default().to_string();
    let until = Instant::now() + world.minute * minutes as u32;
    world.agents[a].paused = Some((note, until));
    Json(json!({})).into_response()
}

/// `POST /v3/resume` (`api/agents.go` `Resume`).
pub(super) async fn resume(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> Response {
    let mut world = lock(&inner.world);
    gate_or_answer!(world, AgentCall::Resume, None);
    let Some((a, _)) = caller(&mut world, &headers) else {
        return error(StatusCode::UNAUTHORIZED, "Unauthorized");
    };
    world.agents[a].paused = None;
    Json(json!({})).into_response()
}

/// `POST /agentedge.v1.AgentEdgeService/StreamPings`: not here, so the agent polls
/// (`api/pings_streaming.go`; connect-go maps 404 to Unimplemented, which the agent takes as
/// "streaming unavailable, fall back to polling for good").
pub(super) async fn stream_pings() -> Response {
    StatusCode::NOT_FOUND.into_response()
}

/// The job's environment as Buildkite gives it: the pipeline's and step's `env`, the build's
/// `env`, then Buildkite's own variables (which win).
fn job_env(
    inner: &Inner,
    repository: &str,
    j: &AgentJob,
    agent: &RegisteredAgent,
) -> BTreeMap<String, String> {
    let build = lock(&inner.builds).get(j.build as usize - 1).cloned();
    let body = build
        .as_ref()
        .map(|b| b.body.clone())
        .unwrap_or(Value::Null);
    let mut env = BTreeMap::new();
    if let Some(o) = body.get("env").and_then(Value::as_object) {
        for (k, v) in o {
            env.insert(
                k.clone(),
                v.as_str().map_or_else(|| v.to_string(), str::to_string),
            );
        }
    }
    env.extend(j.step.env.clone());
    env.extend(build_variables(inner, repository, &body));
    let number = j.build.to_string();
    let standard = [
        ("BUILDKITE", "true".to_string()),
        ("CI", "true".into()),
        ("BUILDKITE_JOB_ID", j.id.clone()),
        (
            "BUILDKITE_BUILD_ID",
            build.as_ref().map(|b| b.id.clone()).unwrap_or_default(),
        ),
        ("BUILDKITE_BUILD_NUMBER", number.clone()),
        (
            "BUILDKITE_BUILD_URL",
            format!(
                "https://buildkite.com/{}/{}/builds/{number}",
                inner.org, inner.pipeline
            ),
        ),
        ("BUILDKITE_AGENT_ID", agent.id.clone()),
        ("BUILDKITE_AGENT_NAME", agent.name.clone()),
        ("BUILDKITE_PIPELINE_PROVIDER", "github".into()),
        ("BUILDKITE_SOURCE", "api".into()),
        ("BUILDKITE_COMMAND", j.step.command.clone()),
        ("BUILDKITE_LABEL", j.step.label.clone()),
        ("BUILDKITE_RETRY_COUNT", j.retry_count.to_string()),
        (
            "BUILDKITE_TIMEOUT",
            j.step
                .timeout_in_minutes
                .map_or("false".into(), |m| m.to_string()),
        ),
    ];
    env.extend(standard.into_iter().map(|(k, v)| (k.to_string(), v)));
    if let Some(k) = &j.step.key {
        env.insert("BUILDKITE_STEP_KEY".into(), k.clone());
    }
    if let Some(p) = &j.step.plugins {
        env.insert("BUILDKITE_PLUGINS".into(), p.to_string());
    }
    if let Some(p) = &j.step.artifact_paths {
        env.insert("BUILDKITE_ARTIFACT_PATHS".into(), p.clone());
    }
    for t in &agent.tags {
        if let Some((k, v)) = t.split_once('=') {
            let name = k
                .to_ascii_uppercase()
                .replace(|c: char| !c.is_ascii_alphanumeric(), "_");
            env.insert(format!("BUILDKITE_AGENT_META_DATA_{name}"), v.to_string());
        }
    }
    env
}

/// `PUT /v3/jobs/{id}/accept` (no body; `api/jobs.go` `AcceptJob`): the whole job, with its
/// environment and its own token.
pub(super) async fn accept(
    State(inner): State<Arc<Inner>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let mut world = lock(&inner.world);
    gate_or_answer!(world, AgentCall::Accept, Some(&id));
    let j = job_or_refuse!(world, headers, id);
    if world.jobs[j].state != "assigned" {
        return error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "This job is not waiting to be accepted",
        );
    }
    world.jobs[j].state = "accepted".into();
    world.jobs[j].times.accepted = Some(Instant::now());
    let agent = world
        .agents
        .iter()
        .find(|a| Some(&a.id) == world.jobs[j].agent.as_ref())
        .cloned();
    let Some(agent) = agent else {
        return error(StatusCode::NOT_FOUND, "No agent found");
    };
    let job = world.jobs[j].clone();
    let repository = world.repository.clone();
    let forged = world
        .forged_command
        .clone()
        .filter(|(q, _)| job.step.agents.get("queue") == Some(q))
        .map(|(_, c)| c);
    // Lock order: the builds are never locked while the world is (the REST handlers hold the
    // builds when they list a build's jobs).
    drop(world);
    let mut env = job_env(&inner, &repository, &job, &agent);
    if let Some(c) = forged {
        env.insert("BUILDKITE_COMMAND".into(), c);
    }
    Json(json!({
        "id": job.id,
        "endpoint": "",
        "state": "accepted",
        "env": env,
        "step": job.step.raw,
        "chunks_max_size_bytes": CHUNK_MAX,
        "log_max_size_bytes": 0,
        "token": job.token,
        "runnable_at": now_iso(),
    }))
    .into_response()
}

/// `PUT /v3/jobs/{id}/start` (`{"started_at"}`): the job runs; the build runs with its first
/// job (and sends `build.running` then).
pub(super) async fn start(
    State(inner): State<Arc<Inner>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let number = {
        let mut world = lock(&inner.world);
        gate_or_answer!(world, AgentCall::Start, Some(&id));
        let j = job_or_refuse!(world, headers, id);
        if world.jobs[j].state == "accepted" {
            world.jobs[j].state = "running".into();
        }
        world.jobs[j].times.started = Some(Instant::now());
        world.jobs[j].build
    };
    let first = lock(&inner.builds)
        .get(number as usize - 1)
        .is_some_and(|b| b.state == "scheduled");
    if first {
        set_state(&inner, number, "running");
        send_event(&inner, "build.running", number).await;
    }
    Json(json!({})).into_response()
}

/// `GET /v3/jobs/{id}` (`api/jobs.go` `GetJobState`): how the agent learns of a cancel or a
/// timeout.
pub(super) async fn job_state(
    State(inner): State<Arc<Inner>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let mut world = lock(&inner.world);
    gate_or_answer!(world, AgentCall::JobState, Some(&id));
    match job_of(&mut world, &headers, &id) {
        Ok(j) => Json(json!({"state": world.jobs[j].state})).into_response(),
        // A finished job's state is still its own to read.
        Err((StatusCode::UNPROCESSABLE_ENTITY, _)) => {
            let state = world
                .jobs
                .iter()
                .find(|j| j.id == id)
                .map(|j| j.state.clone());
            Json(json!({ "state": state })).into_response()
        }
        Err((status, message)) => error(status, message),
    }
}

/// `POST /v3/jobs/{id}/chunks?sequence&offset&size` (`api/chunks.go`): a gzip-compressed piece
/// of the log at `offset`.
pub(super) async fn chunk(
    State(inner): State<Arc<Inner>>,
    Path(id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut world = lock(&inner.world);
    gate_or_answer!(world, AgentCall::Chunks, Some(&id));
    let j = job_or_refuse!(world, headers, id);
    let Some(offset) = q.get("offset").and_then(|o| o.parse::<u64>().ok()) else {
        return error(StatusCode::UNPROCESSABLE_ENTITY, "offset is required");
    };
    let mut raw = Vec::new();
    if flate2::read::GzDecoder::new(&body[..])
        .read_to_end(&mut raw)
        .is_err()
    {
        return error(StatusCode::BAD_REQUEST, "the chunk is not gzip");
    }
    if q.get("size").and_then(|s| s.parse::<usize>().ok()) != Some(raw.len()) {
        return error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "size does not match the chunk",
        );
    }
    world.jobs[j].log.insert(offset, raw);
    (StatusCode::CREATED, Json(json!({}))).into_response()
}

/// `POST /v3/jobs/{id}/header_times`: accepted and dropped.
pub(super) async fn header_times() -> Response {
    Json(json!({})).into_response()
}

/// `PUT /v3/jobs/{id}/finish` (`api/jobs.go` `FinishJob`; `exit_status` is a string).
pub(super) async fn finish_job(
    State(inner): State<Arc<Inner>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let number = {
        let mut world = lock(&inner.world);
        let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        gate_or_answer!(world, AgentCall::Finish, Some(&id), Some(req.clone()));
        let j = job_or_refuse!(world, headers, id);
        let Some(exit) = req["exit_status"]
            .as_str()
            .and_then(|s| s.parse::<i64>().ok())
        else {
            return error(StatusCode::UNPROCESSABLE_ENTITY, "exit_status is required");
        };
        let signal = req["signal"].as_str().map(str::to_string);
        let reason = req["signal_reason"].as_str().map(str::to_string);
        world.jobs[j].chunks_failed = req["chunks_failed_count"].as_u64();
        finish(&mut world, j, exit, signal, reason);
        world.jobs[j].build
    };
    settle(&inner, number).await;
    Json(json!({})).into_response()
}

/// `POST /v3/jobs/{id}/data/{set,get,exists,keys}` (`api/meta_data.go`): the build's
/// meta-data (`get` of a missing key is 404).
pub(super) async fn meta_data(
    State(inner): State<Arc<Inner>>,
    Path((id, op)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut world = lock(&inner.world);
    let j = job_or_refuse!(world, headers, id);
    let build = world.jobs[j].build;
    let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let key = req["key"].as_str().unwrap_or_default().to_string();
    let meta = world.meta.entry(build).or_default();
    match op.as_str() {
        "set" => {
            if key.trim().is_empty() {
                return error(StatusCode::UNPROCESSABLE_ENTITY, "key can't be blank");
            }
            meta.insert(key, req["value"].as_str().unwrap_or_default().to_string());
            Json(json!({})).into_response()
        }
        "get" => match meta.get(&key) {
            Some(v) => Json(json!({"key": key, "value": v})).into_response(),
            None => error(StatusCode::NOT_FOUND, "No key found"),
        },
        "exists" => Json(json!({"exists": meta.contains_key(&key)})).into_response(),
        "keys" => Json(json!(meta.keys().collect::<Vec<_>>())).into_response(),
        _ => error(StatusCode::NOT_FOUND, "Not found"),
    }
}

/// `POST /v3/jobs/{id}/pipelines` (`api/pipelines.go`): the uploaded pipeline (JSON, already
/// interpolated by the agent) becomes jobs of the build after the uploading one. Answered 201:
/// done at once (an answer other than 202 means no status polling).
pub(super) async fn upload_pipeline(
    State(inner): State<Arc<Inner>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut world = lock(&inner.world);
    let j = job_or_refuse!(world, headers, id);
    let req: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(_) => return error(StatusCode::BAD_REQUEST, "Problems parsing JSON"),
    };
    let steps = match pipeline::steps(&req["pipeline"]) {
        Ok(s) => s,
        Err(e) => {
            return error(
                StatusCode::UNPROCESSABLE_ENTITY,
                &format!("Pipeline upload rejected: {e}"),
            )
        }
    };
    let build = world.jobs[j].build;
    if world.canceled_builds.contains(&build) {
        return error(StatusCode::UNPROCESSABLE_ENTITY, "The build was canceled");
    }
    // The agent retries an upload with the same uuid: its steps are added once.
    let uuid = req["uuid"].as_str().unwrap_or_default().to_string();
    if !world.uploads.insert(uuid) {
        return (StatusCode::CREATED, Json(json!({}))).into_response();
    }
    let used: Vec<String> = world
        .jobs
        .iter()
        .filter(|x| x.build == build)
        .filter_map(|x| x.step.key.clone())
        .collect();
    if let Some(k) = steps
        .iter()
        .filter_map(|s| s.key.as_ref())
        .find(|k| used.contains(k))
    {
        return error(
            StatusCode::UNPROCESSABLE_ENTITY,
            &format!("Pipeline upload rejected: the key {k:?} is already used in this build"),
        );
    }
    for step in steps {
        world.jobs.push(new_job(build, step, 0));
    }
    (StatusCode::CREATED, Json(json!({}))).into_response()
}

/// `POST /v3/jobs/{id}/artifacts` (`api/artifacts.go` `CreateArtifacts`): ids for the batch,
/// in order, and where each file goes (a form POST to `/uploads/<artifact id>`).
pub(super) async fn create_artifacts(
    State(inner): State<Arc<Inner>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (build, job_id) = {
        let mut world = lock(&inner.world);
        gate_or_answer!(world, AgentCall::CreateArtifacts, Some(&id));
        let j = job_or_refuse!(world, headers, id);
        (world.jobs[j].build, world.jobs[j].id.clone())
    };
    let req: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(_) => return error(StatusCode::BAD_REQUEST, "Problems parsing JSON"),
    };
    let Some(list) = req["artifacts"].as_array() else {
        return error(StatusCode::UNPROCESSABLE_ENTITY, "artifacts is required");
    };
    let mut ids = Vec::new();
    let mut per = serde_json::Map::new();
    for a in list {
        let aid = uuid::Uuid::new_v4().to_string();
        let artifact = FakeArtifact {
            id: aid.clone(),
            job_id: job_id.clone(),
            path: a["path"].as_str().unwrap_or_default().to_string(),
            state: "new".into(),
            file_size: a["file_size"].as_u64().unwrap_or(0),
            sha1sum: a["sha1sum"].as_str().unwrap_or_default().to_string(),
            blob: uuid::Uuid::new_v4().to_string(),
        };
        if let Some(b) = lock(&inner.builds).get_mut(build as usize - 1) {
            b.artifacts.push(artifact);
        }
        lock(&inner.world)
            .pending_uploads
            .insert(aid.clone(), build);
        per.insert(
            aid.clone(),
            json!({"action": {"url": inner.base, "method": "POST", "path": format!("/uploads/{aid}"), "file_input": "file"}, "data": {}}),
        );
        ids.push(aid);
    }
    (
        StatusCode::CREATED,
        Json(json!({
            "id": req["id"],
            "artifact_ids": ids,
            "upload_instructions": {"action": {"url": inner.base, "method": "POST", "path": "/uploads/unknown", "file_input": "file"}, "data": {}},
            "per_artifact_instructions": per,
        })),
    )
        .into_response()
}

/// The file part of a multipart form (`name="file"`), as the agent sends it
/// (`internal/artifact/bk_uploader.go` `createFormUploadRequest`).
fn form_file(content_type: &str, body: &[u8]) -> Option<Vec<u8>> {
    let boundary = content_type.split("boundary=").nth(1)?.trim_matches('"');
    let delim = format!("--{boundary}");
    let text = body;
    let mut parts = Vec::new();
    let mut at = 0;
    while let Some(i) = find(&text[at..], delim.as_bytes()) {
        parts.push(at + i);
        at += i + delim.len();
    }
    for w in parts.windows(2) {
        let part = &text[w[0] + delim.len()..w[1]];
        let part = part.strip_prefix(b"\r\n").unwrap_or(part);
        let split = find(part, b"\r\n\r\n")?;
        let head = String::from_utf8_lossy(&part[..split]);
        if head.contains("name=\"file\"") {
            let content = &part[split + 4..];
            return Some(content.strip_suffix(b"\r\n").unwrap_or(content).to_vec());
        }
    }
    None
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// `POST /uploads/{artifact id}`: the blob store's form upload (no `Authorization`, as S3's).
/// The file must be what the batch said (size and SHA-1), else the upload is refused.
pub(super) async fn upload_file(
    State(inner): State<Arc<Inner>>,
    Path(aid): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if headers.contains_key("authorization") {
        return error(
            StatusCode::BAD_REQUEST,
            "the upload must not carry Authorization",
        );
    }
    let job = lock(&inner.builds)
        .iter()
        .flat_map(|b| b.artifacts.iter())
        .find(|a| a.id == aid)
        .map(|a| a.job_id.clone());
    let Some(build) = ({
        let mut world = lock(&inner.world);
        gate_or_answer!(world, AgentCall::UploadFile, job.as_deref());
        world.pending_uploads.get(&aid).copied()
    }) else {
        return error(StatusCode::NOT_FOUND, "no such upload");
    };
    let ct = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let Some(file) = form_file(ct, &body) else {
        return error(StatusCode::BAD_REQUEST, "no file part in the form");
    };
    let mut builds = lock(&inner.builds);
    let Some(a) = builds
        .get_mut(build as usize - 1)
        .and_then(|b| b.artifacts.iter_mut().find(|a| a.id == aid))
    else {
        return error(StatusCode::NOT_FOUND, "no such artifact");
    };
    if a.file_size != file.len() as u64 || a.sha1sum != hex::encode(Sha1::digest(&file)) {
        return error(
            StatusCode::BAD_REQUEST,
            "the file is not the one the batch described",
        );
    }
    let blob = a.blob.clone();
    drop(builds);
    lock(&inner.blobs).insert(blob, Bytes::from(file));
    lock(&inner.world).pending_uploads.remove(&aid);
    StatusCode::CREATED.into_response()
}

/// `PUT /v3/jobs/{id}/artifacts` (`{"artifacts":[{"id","state"}]}`): the uploads' outcome.
/// `finished` is only believed for a file the blob store holds.
pub(super) async fn update_artifacts(
    State(inner): State<Arc<Inner>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let build = {
        let mut world = lock(&inner.world);
        gate_or_answer!(
            world,
            AgentCall::UpdateArtifacts,
            Some(&id),
            Some(req.clone())
        );
        let j = job_or_refuse!(world, headers, id);
        world.jobs[j].build
    };
    let blobs = lock(&inner.blobs)
        .keys()
        .cloned()
        .collect::<std::collections::HashSet<_>>();
    let mut builds = lock(&inner.builds);
    let Some(b) = builds.get_mut(build as usize - 1) else {
        return error(StatusCode::NOT_FOUND, "No build found");
    };
    for u in req["artifacts"].as_array().into_iter().flatten() {
        let Some(a) = b
            .artifacts
            .iter_mut()
            .find(|a| Some(a.id.as_str()) == u["id"].as_str())
        else {
            continue;
        };
        a.state = match u["state"].as_str() {
            Some("finished") if blobs.contains(&a.blob) => "finished",
            _ => "error",
        }
        .into();
    }
    Json(json!({})).into_response()
}

/// The fake's view of the agents and their jobs, for tests.
impl super::FakeBuildkite {
    /// From now on, every build created is played by real agents: the pipeline's settings
    /// steps (`settings_yaml`, as pasted into the pipeline's settings) become its jobs, with
    /// `repository` as the pipeline's repository.
    pub fn run_builds_on_agents(&self, settings_yaml: &str, repository: &str) {
        let mut world = lock(&self.inner.world);
        world.settings = Some(settings_yaml.to_string());
        world.repository = repository.to_string();
    }

    /// How long an agent holding a job may be silent before it is lost, and how long a
    /// `timeout_in_minutes` minute lasts.
    pub fn set_agent_clock(&self, lost_after: Duration, minute: Duration) {
        let mut world = lock(&self.inner.world);
        world.lost_after = lost_after;
        world.minute = minute;
    }

    /// From now on, jobs of steps on `queue` run `command` (their `BUILDKITE_COMMAND`) instead of
    /// their step's, as a backend or a token running something other than what was uploaded
    /// would have them do; `None` stops it.
    pub fn forge_command(&self, forged: Option<(&str, &str)>) {
        lock(&self.inner.world).forged_command =
            forged.map(|(q, c)| (q.to_string(), c.to_string()));
    }

    /// Makes agent API calls fail as `fault` says (faults are matched in the order given).
    pub fn fail_agent_calls(&self, fault: AgentFault) {
        lock(&self.inner.world).faults.push(fault);
    }

    /// Every agent API call received so far, in order (`call`: only those).
    pub fn agent_calls(&self, call: Option<AgentCall>) -> Vec<AgentCallRecord> {
        lock(&self.inner.world)
            .calls
            .iter()
            .filter(|c| call.is_none_or(|k| c.call == k))
            .cloned()
            .collect()
    }

    /// The agents that registered.
    pub fn registered_agents(&self) -> Vec<RegisteredAgent> {
        lock(&self.inner.world).agents.clone()
    }

    /// Build `number`'s jobs, in the order made.
    pub fn jobs_of(&self, number: u64) -> Vec<AgentJob> {
        lock(&self.inner.world)
            .jobs
            .iter()
            .filter(|j| j.build == number)
            .cloned()
            .collect()
    }

    /// The name of the agent that ran (or runs) job `job`.
    pub fn agent_of(&self, job: &AgentJob) -> Option<String> {
        let world = lock(&self.inner.world);
        let id = job.agent.as_ref()?;
        world
            .agents
            .iter()
            .find(|a| &a.id == id)
            .map(|a| a.name.clone())
    }

    /// Build `number`'s meta-data.
    pub fn meta_data_of(&self, number: u64) -> BTreeMap<String, String> {
        lock(&self.inner.world)
            .meta
            .get(&number)
            .cloned()
            .unwrap_or_default()
    }

    /// Build `number`'s artifacts, in the order the agents created them.
    pub fn artifacts_of(&self, number: u64) -> Vec<Uploaded> {
        let arts = lock(&self.inner.builds)
            .get(number as usize - 1)
            .map(|b| b.artifacts.clone())
            .unwrap_or_default();
        let blobs = lock(&self.inner.blobs);
        arts.into_iter()
            .map(|a| Uploaded {
                bytes: blobs.get(&a.blob).map(|b| b.to_vec()),
                path: a.path,
                state: a.state,
                job_id: a.job_id,
            })
            .collect()
    }
}

/// An artifact an agent uploaded.
#[derive(Debug, Clone)]
pub struct Uploaded {
    /// Its path.
    pub path: String,
    /// `new`, `finished` or `error`.
    pub state: String,
    /// The job that uploaded it.
    pub job_id: String,
    /// Its content, once the file arrived.
    pub bytes: Option<Vec<u8>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_form_file_is_found_between_its_boundaries() {
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"key\"\r\n\r\nresult.json\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"result.json\"\r\nContent-Type: application/octet-stream\r\n\r\n{\"a\":\r\n1}\r\n--XyZ--\r\n";
        assert_eq!(
            form_file("multipart/form-data; boundary=XyZ", body).unwrap(),
            b"{\"a\":\r\n1}"
        );
        assert!(form_file("multipart/form-data; boundary=Other", body).is_none());
    }
}
