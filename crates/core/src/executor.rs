//! Where builds run, behind one interface: the core hands an [`Executor`] a [`Job`], learns the
//! build it became ([`Launched`]), hears of its progress as [`BuildEvent`]s, and asks the executor
//! for the [`Outcome`] once the build finished.
//!
//! Buildkite's executor (`kernelkite_service::buildkite`: REST calls out, signed webhooks in) and
//! the local one (`kernelkite_service::local`: builds run on this machine) implement the same
//! trait; the local one is handed the core as an [`Events`] handle (`crate::events::for_executor`)
//! and delivers its builds' events through it, so both share one state machine, one store and one
//! set of waiters.

use futures_util::future::BoxFuture;

use crate::report::BoxError;
use crate::submission::{BuildInfo, Outcome, Submission};
use kernelkite_sys::provenance::Provenance;

/// The core as an executor sees it, handed to an executor that runs builds itself when it
/// starts (instead of the App): where its builds' events go, and what it may watch of a
/// submission. Events flow one way, executor → core; what the core decides reaches the
/// executor through [`Executor`]'s calls and the submission's watch.
pub trait Events: Send + Sync {
    /// Hands the core a build's event; returns once its effect is committed.
    fn deliver(&self, event: BuildEvent) -> BoxFuture<'_, ()>;
    /// The submission as it changes, while the core holds it; `None` once it does not (it
    /// ended long ago, or the core is gone).
    fn watch(&self, submission_id: &str) -> Option<tokio::sync::watch::Receiver<Submission>>;
    /// After a restart, for a build this executor found left by its previous run: takes the
    /// submission back when it is still open with that build ([`Reclaim`]).
    fn reclaim<'a>(&'a self, submission_id: &'a str, build_id: &'a str) -> BoxFuture<'a, Reclaim>;
    /// The largest result artifact the core takes (`--max-artifact-bytes`).
    fn max_artifact_bytes(&self) -> u64;

    /// Whether slice `slice` (an agent name) may not start a ranked run now: it is
    /// quarantined ([`crate::fleet`]).
    fn held_back(&self, slice: &str) -> bool {
        let _ = slice;
        false
    }
}

/// What [`Events::reclaim`] made of a build left by an executor's previous run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reclaim {
    /// The submission is open with this build: recovered (collected, left to run, run again
    /// or failed, as the executor's `recover` says).
    Recovered,
    /// The submission ended, or is open with another build: the build is nobody's.
    NotOpen,
    /// The store does not know the submission.
    Unknown,
    /// The store could not be read: why.
    Unreadable(String),
}

/// An accepted submission, as an executor needs it to run. Kept in the store until the
/// submission ends, so a build that was never created can be created after a restart.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Job {
    /// The submission's id.
    pub submission_id: String,
    /// The backend's run id (the submission id when it gave none).
    pub run_id: String,
    /// Which machines run it (a Buildkite agent queue).
    pub queue: String,
    /// The run config's `mode` (`test`, `benchmark`, ...), for people reading build lists.
    pub mode: String,
    /// The run config as kernelbot's payload: base64(zlib(JSON)), the backend's JSON
    /// unchanged.
    pub payload: String,
    /// A ranked run: a quarantined slice does not start it ([`Events::held_back`]).
    #[serde(default)]
    pub ranked: bool,
    /// The slice (agent) it must run on: a canary measures one slice.
    #[serde(default)]
    pub pin: Option<String>,
    /// The agent tags that single out the pinned slice's agent where Buildkite dispatches
    /// (`node`, `gpu-index`: what setup tags each per-slice agent with).
    #[serde(default)]
    pub pin_tags: std::collections::BTreeMap<String, String>,
}

/// What collecting a finished build gave: how the submission ends and, when the node wrote
/// one, where and on what it ran ([`kernelkite_sys::provenance`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Collected {
    /// How the submission ends.
    pub outcome: Outcome,
    /// The run's provenance (`None`: the node wrote none, or one that could not be used).
    pub provenance: Option<Provenance>,
}

impl From<Outcome> for Collected {
    fn from(outcome: Outcome) -> Collected {
        Collected {
            outcome,
            provenance: None,
        }
    }
}

/// What launching a job made: the build, as the submission records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launched {
    /// The build's identity.
    pub build: BuildInfo,
    /// The executor says the build already runs.
    pub running: bool,
}

/// A build's progress, as its executor reports it (Buildkite: a verified webhook).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildEvent {
    /// What happened.
    pub kind: BuildEventKind,
    /// The build as the event shows it.
    pub build: BuildStatus,
}

/// The events the state machine acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildEventKind {
    /// The build waits for a machine.
    Scheduled,
    /// The build runs.
    Running,
    /// The build ended (in any state); its result can be collected.
    Finished,
    /// The build was skipped and will not run.
    Skipped,
}

/// A build as an event shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildStatus {
    /// The executor's unique id of the build; events are matched to submissions on it.
    pub id: String,
    /// The build's number, as people see it.
    pub number: u64,
    /// The executor's own word for the build's state (`passed`, `failed`, ...).
    pub state: String,
    /// Where people see the build.
    pub web_url: String,
    /// Paused (a Buildkite block step): a later event brings the real end.
    pub blocked: bool,
}

/// The build states in which a build has ended: Buildkite's words, which every executor
/// speaks in [`BuildStatus::state`] (the local one too), so the core can tell an end without
/// knowing who ran the build.
pub const FINISHED_STATES: &[&str] = &["passed", "failed", "canceled", "skipped", "not_run"];

impl BuildStatus {
    /// Whether the build has ended (in any of [`FINISHED_STATES`]).
    pub fn finished(&self) -> bool {
        FINISHED_STATES.contains(&self.state.as_str())
    }
}

/// What an executor knows of a build after the service restarted ([`Executor::recover`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovered {
    /// The executor runs it (still, or again from the start); its events will follow.
    Running,
    /// It finished while the service was down: collect it as if the event had come now.
    Finished(BuildStatus),
    /// The executor cannot bring it back; the submission fails with this reason.
    Lost(String),
    /// This executor keeps no state to recover from; its events (or a reconciler asking its
    /// API) must tell.
    Unknown,
}

/// A build an executor found by looking (not by an event), with the submission it carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// The submission id in the build's meta-data, when it has one.
    pub submission_id: Option<String>,
    /// The build.
    pub build: BuildStatus,
}

impl Found {
    /// The build as a submission records it.
    pub fn info(&self) -> BuildInfo {
        BuildInfo {
            id: self.build.id.clone(),
            number: self.build.number,
            web_url: self.build.web_url.clone(),
        }
    }
}

/// What a listing found, and whether it saw everything it was asked for (a listing cut at
/// its page limit saw the newest builds only).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listing {
    /// The builds.
    pub builds: Vec<Found>,
    /// Every matching build was listed.
    pub complete: bool,
}

impl Listing {
    /// A complete listing that found no build: an executor whose events cannot be lost.
    pub fn nothing() -> Listing {
        Listing {
            builds: Vec::new(),
            complete: true,
        }
    }
}

/// Agents of one queue (for queue status, `crate::queues`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct AgentCounts {
    /// Connected and not running a job.
    pub idle: u64,
    /// Running a job.
    pub busy: u64,
    /// Connected.
    pub total: u64,
}

/// One agent (a slice) as its source lists it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AgentInfo {
    /// Its name: the slice's id in the fleet.
    pub name: String,
    /// The queue it serves.
    pub queue: Option<String>,
    /// Its node's host name.
    pub node: Option<String>,
    /// Running a job now.
    pub busy: bool,
    /// Paused (Buildkite dispatches no job to it).
    #[serde(default)]
    pub paused: bool,
    /// Why, when paused.
    #[serde(default)]
    pub paused_note: Option<String>,
    /// Its agent's version (Buildkite's agent), when the source says.
    #[serde(default)]
    pub version: Option<String>,
    /// Its tags (`key=value`).
    #[serde(default)]
    pub tags: Vec<String>,
}

/// What [`Executor::pause_agent`] or [`Executor::resume_agent`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseOutcome {
    /// Done (paused, renewed, resumed, or already as asked).
    Done,
    /// No agent of that name is connected (it is paused when it is back).
    NotConnected,
    /// Paused by somebody else (an operator's maintenance): left as it is.
    NotOurs,
    /// This executor does not pause agents.
    Unsupported,
}

/// Agent counts for every queue the source knows of.
pub type AgentsByQueue = std::collections::HashMap<String, AgentCounts>;

/// Where agent counts come from (Buildkite's REST agents list, its agent metrics endpoint; a
/// local executor's own slices).
pub trait AgentSource: Send + Sync + 'static {
    /// For log lines ("Buildkite agents list").
    fn name(&self) -> &'static str;

    /// Every connected agent, counted by queue. A queue missing from the map has no agent.
    fn fetch(&self) -> BoxFuture<'_, Result<AgentsByQueue, AgentsUnavailable>>;

    /// The agents the last successful [`AgentSource::fetch`] listed, one by one (`None`: the
    /// source counts without listing, as Buildkite's agent metrics do).
    fn roster(&self) -> Option<Vec<AgentInfo>> {
        None
    }
}

/// Why agent counts could not be had ([`AgentSource::fetch`]).
#[derive(Debug, thiserror::Error)]
pub enum AgentsUnavailable {
    /// The source refused the credentials (HTTP 401 or 403: a token without the scope): an
    /// answer, which asking again will not change until an operator changes the token.
    #[error(transparent)]
    Refused(BoxError),
    /// Not this time (no answer, another error status, an answer that could not be read).
    #[error(transparent)]
    Failed(BoxError),
}

/// Runs builds for submissions.
pub trait Executor: Send + Sync + 'static {
    /// Who runs the builds, for messages ("Buildkite").
    fn name(&self) -> &'static str;

    /// Creates a build for `job`, and never two: when a create call fails in a way that may
    /// have created the build anyway, the executor looks for it before trying again. An error
    /// means no build is known to exist.
    fn launch<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Result<Launched, BoxError>>;

    /// Stops a build; returns whether this call stopped it (`false`: it had already ended,
    /// which is not an error).
    fn cancel<'a>(&'a self, build: &'a BuildInfo) -> BoxFuture<'a, Result<bool, BoxError>>;

    /// Collects the result of a build that finished and says how the submission ends. An
    /// error is transient (the executor could not be reached): the core tries again later.
    fn collect<'a>(&'a self, build: &'a BuildStatus) -> BoxFuture<'a, Result<Collected, BoxError>>;

    /// The build's state now, asked of the executor (`None`: it cannot tell). The timeout
    /// asks once before it ends a submission, so a build whose finish event was lost is
    /// collected instead of timed out (and canceled).
    fn status<'a>(
        &'a self,
        build: &'a BuildInfo,
    ) -> BoxFuture<'a, Result<Option<BuildStatus>, BoxError>> {
        let _ = build;
        Box::pin(async { Ok(None) })
    }

    /// Builds that finished since `since`, in one listing however many submissions wait: what
    /// the reconciler feeds through the same path as events when an event was lost. An
    /// executor whose events cannot be lost finds none.
    fn finished_since(
        &self,
        since: chrono::DateTime<chrono::Utc>,
    ) -> BoxFuture<'_, Result<Listing, BoxError>> {
        let _ = since;
        Box::pin(async { Ok(Listing::nothing()) })
    }

    /// Builds created since `since`, whatever their state: after a restart, the builds of
    /// submissions whose create call was interrupted.
    fn created_since(
        &self,
        since: chrono::DateTime<chrono::Utc>,
    ) -> BoxFuture<'_, Result<Listing, BoxError>> {
        let _ = since;
        Box::pin(async { Ok(Listing::nothing()) })
    }

    /// Called on start for each submission that had a build and had not ended when the
    /// service stopped: picks the build up again. Must be idempotent (a second call for a
    /// build it already runs answers [`Recovered::Running`] and starts nothing).
    fn recover<'a>(&'a self, build: &'a BuildInfo) -> BoxFuture<'a, Result<Recovered, BoxError>> {
        let _ = build;
        Box::pin(async { Ok(Recovered::Unknown) })
    }

    /// How many builds this executor runs at once on any queue, when it knows (the local
    /// executor: its slices); the service's queue starts no more than that.
    fn slots(&self) -> Option<u64> {
        None
    }

    /// The slices this executor runs builds on itself, as agents (local mode), with which
    /// are busy; `None`: its machines are someone else's to list ([`Executor::agents`]).
    fn roster(&self) -> Option<Vec<AgentInfo>> {
        None
    }

    /// Whether this executor keeps a quarantined slice out by pausing its agent
    /// ([`Executor::pause_agent`]); `false`: it skips quarantined slices itself (local mode).
    fn pauses_agents(&self) -> bool {
        false
    }

    /// Pauses the connected agent named `agent` for `minutes`, saying `note`, so no job is
    /// dispatched to it. An agent already paused by this service
    /// ([`crate::pauses::NOTE_PREFIX`]) is left so, or with `renew` has its pause renewed.
    fn pause_agent<'a>(
        &'a self,
        agent: &'a str,
        note: &'a str,
        minutes: u32,
        renew: bool,
    ) -> BoxFuture<'a, Result<PauseOutcome, BoxError>> {
        let _ = (agent, note, minutes, renew);
        Box::pin(async { Ok(PauseOutcome::Unsupported) })
    }

    /// Resumes the agent named `agent` when this service paused it (an operator's own pause,
    /// with another note, is left alone).
    fn resume_agent<'a>(&'a self, agent: &'a str) -> BoxFuture<'a, Result<PauseOutcome, BoxError>> {
        let _ = agent;
        Box::pin(async { Ok(PauseOutcome::Unsupported) })
    }

    /// Where queue status counts the machines that serve the queues (`None`: this executor
    /// has no source; queue status then shows no agent counts).
    fn agents(&self) -> Option<std::sync::Arc<dyn AgentSource>> {
        None
    }
}
