//! Buildkite as the executor: a submission becomes a build of the configured pipeline, with
//! the payload in the build's env; Buildkite's signed webhooks report its progress; once it
//! finished, its `result.json` artifact is downloaded and checked.
//!
//! All the service's Buildkite code is here:
//! - [`client`]: the REST client (create, cancel, list artifacts, download), with retries,
//!   and the `Link` reader every paged listing uses; [`budget`]: the one rate budget all its
//!   calls spend.
//! - [`webhook`]: verifying and reading webhook deliveries.
//! - [`artifact`]: choosing, downloading and checking `result.json`.
//! - [`agents`]: the agents serving each queue (REST agents list or agent metrics), for queue
//!   status, through the client's HTTP client and budget.

pub mod agents;
pub mod artifact;
pub mod budget;
pub mod client;
pub mod webhook;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;

pub use budget::{Priority, RateBudget};
pub use client::{
    Build, BuildFilter, BuildkiteClient, BuildkiteError, NewBuild, MAX_RATE_LIMITED_RETRIES,
    SUBMISSION_META_KEY,
};

use crate::config::{Config, Secret};
use crate::executor::{
    AgentSource, BuildStatus, Collected, Executor, Found, Job, Launched, Listing, PauseOutcome,
    FINISHED_STATES,
};
use crate::metrics::Metrics;
use crate::report::{report, BoxError};
use crate::submission::{BuildInfo, Outcome};
use artifact::ArtifactError;

/// Runs submissions as builds of one Buildkite pipeline.
#[derive(Debug, Clone)]
pub struct BuildkiteExecutor {
    client: BuildkiteClient,
    commit: String,
    branch: String,
    /// How long after an ambiguous create (timeout, broken connection) the build is looked
    /// for: a request still in flight at Buildkite has had time to land.
    lookup_delay: Duration,
    /// Most create attempts for one job.
    attempts: u32,
    retry_base: Duration,
    /// Most pages one listing reads.
    max_pages: u32,
    /// The organization, whose agents queue status counts.
    org: String,
    /// Agent counts from the agent API's metrics endpoint with this token and URL, instead
    /// of the REST agents list (BUILDKITE_AGENT_TOKEN, BUILDKITE_AGENT_API_URL).
    agent_api: Option<(Secret, String)>,
}

impl BuildkiteExecutor {
    /// An executor for the configured pipeline, commit and branch.
    pub fn new(cfg: &Config) -> Result<BuildkiteExecutor, reqwest::Error> {
        Ok(BuildkiteExecutor {
            client: BuildkiteClient::new(cfg)?,
            commit: cfg.buildkite.commit.clone(),
            branch: cfg.buildkite.branch.clone(),
            lookup_delay: Duration::from_millis(cfg.buildkite.create_lookup_delay_ms),
            attempts: cfg.buildkite.retry_attempts.max(1),
            retry_base: Duration::from_millis(cfg.retry_base_ms),
            max_pages: cfg.buildkite.reconcile_max_pages.max(1),
            org: cfg.buildkite.buildkite_org.clone(),
            agent_api: cfg
                .queues
                .buildkite_agent_token
                .clone()
                .map(|t| (t, cfg.queues.buildkite_agent_api_url.clone())),
        })
    }

    /// Counts its Buildkite calls in `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> BuildkiteExecutor {
        self.client = self.client.with_metrics(metrics);
        self
    }

    /// Creates no build once `store` says this process no longer acts for it
    /// ([`BuildkiteClient::acting_while`]).
    pub fn acting_for(mut self, store: Arc<dyn crate::store::Durable>) -> BuildkiteExecutor {
        self.client = self.client.acting_while(Arc::new(move || store.acting()));
        self
    }

    /// Looks for the build of `submission_id` (after an ambiguous create). When twins exist,
    /// the lowest-numbered one is kept and the others are canceled.
    async fn find(&self, submission_id: &str) -> Result<Option<Build>, BuildkiteError> {
        let mut builds = self.client.builds_of_submission(submission_id).await?;
        if builds.is_empty() {
            return Ok(None);
        }
        let keep = builds.remove(0);
        for twin in builds {
            tracing::warn!(id = %submission_id, build = twin.number, kept = keep.number, "canceling a second build of the same submission");
            if let Err(e) = self.client.cancel_build(twin.number).await {
                tracing::warn!(build = twin.number, error = %report(&e), "could not cancel the twin build");
            }
        }
        Ok(Some(keep))
    }

    async fn launch_job(&self, job: &Job) -> Result<Launched, BoxError> {
        let request = self.new_build(job);
        let mut attempt = 0;
        loop {
            attempt += 1;
            // A definite refusal (4xx) made nothing. Anything else may have made the build:
            // it is looked up before the create is tried again, and before it is given up (a
            // build the last try made is adopted, never left behind).
            let err = match self.client.create_build(&request).await {
                Ok(b) => return Ok(launched(b)),
                Err(e) if e.is_ambiguous() => e,
                Err(e) => return Err(e.into()),
            };
            tracing::warn!(id = %job.submission_id, attempt, error = %report(&err), "create-build failed in a way that may have created the build; looking for it before trying again");
            if err.may_be_in_flight() {
                tokio::time::sleep(self.lookup_delay).await;
            }
            // Until the lookup answers, creating again could make a twin: keep asking (the
            // submission's own timeout ends this).
            let mut tries = 0u32;
            let found = loop {
                match self.find(&job.submission_id).await {
                    Ok(found) => break found,
                    Err(e) => {
                        tries += 1;
                        tracing::warn!(id = %job.submission_id, error = %report(&e), "could not look the build up; retrying");
                        let wait = self
                            .retry_base
                            .saturating_mul(1 << tries.min(7))
                            .min(Duration::from_secs(30));
                        tokio::time::sleep(wait).await;
                    }
                }
            };
            if let Some(b) = found {
                tracing::info!(id = %job.submission_id, build = b.number, "adopted the build the ambiguous create made");
                return Ok(launched(b));
            }
            if attempt >= self.attempts {
                return Err(err.into());
            }
            // Nothing was made: wait the promised backoff before the next try, so a short
            // outage of the create endpoint (a 5xx blip) is ridden out, not burned through.
            tokio::time::sleep(self.client.retry_policy().backoff(attempt)).await;
        }
    }

    async fn list(&self, filter: BuildFilter) -> Result<Listing, BuildkiteError> {
        let (builds, complete) = self
            .client
            .list_builds(&filter, Priority::Reconcile, self.max_pages)
            .await?;
        if !complete {
            tracing::warn!(pages = self.max_pages, "build listing cut at KERNELKITE_RECONCILE_MAX_PAGES; the rest waits for the next pass");
        }
        Ok(Listing {
            builds: builds
                .into_iter()
                .map(|b| Found {
                    submission_id: b.submission_id().map(str::to_string),
                    build: status(&b),
                })
                .collect(),
            complete,
        })
    }

    /// Every connected agent named `name` (a name is its node's to choose: there may be
    /// two), `None` when none is.
    async fn connected_named(&self, name: &str) -> Result<Option<Vec<client::AgentRef>>, BoxError> {
        let found = self
            .client
            .find_agents(&self.org, name)
            .await
            .map_err(scoped)?;
        Ok((!found.is_empty()).then_some(found))
    }

    /// The REST client.
    pub fn client(&self) -> &BuildkiteClient {
        &self.client
    }

    /// The create-build request for `job`: the payload (chunked when large) and the ids in
    /// the env, the ids in the meta-data.
    pub fn new_build(&self, job: &Job) -> NewBuild {
        let mut env: BTreeMap<String, String> = kernelkite_kernelbot::payload::to_env(&job.payload)
            .into_iter()
            .collect();
        env.insert("KERNELBOT_RUN_ID".into(), job.run_id.clone());
        env.insert("KERNELBOT_QUEUE".into(), job.queue.clone());
        // A canary: the pipelines' agent rules take a tag's name and value from these
        // (deployment/pipelines/host.yml).
        for (tag, name_var, value_var) in PIN_VARIABLES {
            if let Some(value) = job.pin_tags.get(tag) {
                env.insert(name_var.to_string(), tag.to_string());
                env.insert(value_var.to_string(), value.clone());
            }
        }
        env.insert(
            kernelkite_sys::node::SUBMISSION_ID_ENV.into(),
            job.submission_id.clone(),
        );
        let meta_data = BTreeMap::from([
            ("run_id".to_string(), job.run_id.clone()),
            (
                "kernelkite_submission_id".to_string(),
                job.submission_id.clone(),
            ),
            ("queue".to_string(), job.queue.clone()),
        ]);
        NewBuild {
            commit: self.commit.clone(),
            branch: self.branch.clone(),
            message: format!(
                "kernelkite {} run {} on {}",
                job.mode, job.run_id, job.queue
            ),
            env,
            meta_data,
        }
    }
}

/// For each tag a canary's build pins (`kernelkite_core::upkeep::PIN_TAGS`), the build
/// variables the pipelines' agent rules read its name and value from.
const PIN_VARIABLES: [(&str, &str, &str); 2] = [
    ("node", "KERNELBOT_PIN_NODE_TAG", "KERNELBOT_PIN_NODE"),
    (
        "gpu-index",
        "KERNELBOT_PIN_GPU_TAG",
        "KERNELBOT_PIN_GPU_INDEX",
    ),
];

/// A refused agents call, saying which scope the token needs.
fn scoped(e: BuildkiteError) -> BoxError {
    match e.status() {
        Some(s) if s == reqwest::StatusCode::UNAUTHORIZED || s == reqwest::StatusCode::FORBIDDEN => {
            format!("{}: give BUILDKITE_API_TOKEN the read_agents and write_agents scopes, so quarantined slices' agents can be paused", report(&e)).into()
        }
        _ => e.into(),
    }
}

impl Executor for BuildkiteExecutor {
    /// The agent metrics endpoint when an agent token is configured (one call for every
    /// queue of the token's cluster), else the REST agents list (needs `read_agents`).
    fn agents(&self) -> Option<Arc<dyn AgentSource>> {
        Some(match &self.agent_api {
            Some((token, url)) => Arc::new(agents::AgentMetrics::new(
                self.client.http().clone(),
                url,
                token.clone(),
            )),
            None => Arc::new(agents::AgentsList::new(self.client.clone(), &self.org)),
        })
    }

    fn name(&self) -> &'static str {
        "Buildkite"
    }

    /// A quarantined slice's agent is paused through the REST API (needs the token's
    /// `write_agents` scope): Buildkite then dispatches it no job.
    fn pauses_agents(&self) -> bool {
        true
    }

    fn pause_agent<'a>(
        &'a self,
        agent: &'a str,
        note: &'a str,
        minutes: u32,
        renew: bool,
    ) -> BoxFuture<'a, Result<PauseOutcome, BoxError>> {
        Box::pin(async move {
            let Some(found) = self.connected_named(agent).await? else {
                return Ok(PauseOutcome::NotConnected);
            };
            let mut outcome = PauseOutcome::Done;
            for a in found {
                let paused = a.paused == Some(true);
                if paused && !kernelkite_core::pauses::is_ours(a.paused_note.as_deref()) {
                    outcome = PauseOutcome::NotOurs;
                    continue;
                }
                if paused && !renew {
                    continue;
                }
                match self
                    .client
                    .pause_agent(&self.org, &a.id, note, minutes)
                    .await
                {
                    // A paused agent paused again: Buildkite's documentation does not say it
                    // may be, so a refusal is met by a resume and a pause back to back (the
                    // agent's next ping, seconds away, finds it paused again).
                    Err(e) if paused && e.status().is_some_and(|s| s.is_client_error()) => {
                        self.client
                            .resume_agent(&self.org, &a.id)
                            .await
                            .map_err(scoped)?;
                        self.client
                            .pause_agent(&self.org, &a.id, note, minutes)
                            .await
                            .map_err(scoped)?;
                    }
                    other => other.map_err(scoped)?,
                }
            }
            Ok(outcome)
        })
    }

    fn resume_agent<'a>(&'a self, agent: &'a str) -> BoxFuture<'a, Result<PauseOutcome, BoxError>> {
        Box::pin(async move {
            let Some(found) = self.connected_named(agent).await? else {
                return Ok(PauseOutcome::NotConnected);
            };
            let mut outcome = PauseOutcome::Done;
            for a in found.into_iter().filter(|a| a.paused == Some(true)) {
                if !kernelkite_core::pauses::is_ours(a.paused_note.as_deref()) {
                    outcome = PauseOutcome::NotOurs;
                    continue;
                }
                self.client
                    .resume_agent(&self.org, &a.id)
                    .await
                    .map_err(scoped)?;
            }
            Ok(outcome)
        })
    }

    fn launch<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Result<Launched, BoxError>> {
        Box::pin(self.launch_job(job))
    }

    fn finished_since(
        &self,
        since: chrono::DateTime<chrono::Utc>,
    ) -> BoxFuture<'_, Result<Listing, BoxError>> {
        Box::pin(async move {
            let filter = BuildFilter {
                states: FINISHED_STATES.to_vec(),
                finished_from: Some(since),
                ..BuildFilter::default()
            };
            Ok(self.list(filter).await?)
        })
    }

    fn created_since(
        &self,
        since: chrono::DateTime<chrono::Utc>,
    ) -> BoxFuture<'_, Result<Listing, BoxError>> {
        Box::pin(async move {
            let filter = BuildFilter {
                created_from: Some(since),
                ..BuildFilter::default()
            };
            Ok(self.list(filter).await?)
        })
    }

    fn status<'a>(
        &'a self,
        build: &'a BuildInfo,
    ) -> BoxFuture<'a, Result<Option<BuildStatus>, BoxError>> {
        Box::pin(async move {
            let b = self.client.get_build(build.number).await?;
            // The number is Buildkite's; the id is what ties it to this submission.
            if b.id != build.id {
                return Ok(None);
            }
            Ok(Some(status(&b)))
        })
    }

    fn cancel<'a>(&'a self, build: &'a BuildInfo) -> BoxFuture<'a, Result<bool, BoxError>> {
        Box::pin(async move {
            match self.client.cancel_build(build.number).await {
                Ok(_) => Ok(true),
                // 422: it already finished; nothing to cancel.
                Err(e) if e.status().is_some_and(|s| s.as_u16() == 422) => Ok(false),
                Err(e) => Err(e.into()),
            }
        })
    }

    fn collect<'a>(&'a self, build: &'a BuildStatus) -> BoxFuture<'a, Result<Collected, BoxError>> {
        Box::pin(async move {
            Ok(match artifact::fetch_result(&self.client, build.number).await {
                Ok((r, provenance)) => {
                    return Ok(Collected {
                        outcome: Outcome::Succeeded(r),
                        provenance,
                    })
                }
                // Buildkite unreachable or failing: not the build's fault; tried again.
                Err(ArtifactError::Buildkite(e)) if e.is_transient() => return Err(e.into()),
                Err(ArtifactError::Missing { listed }) => Outcome::Failed(format!(
                    "build #{} finished with state {:?} without result.json{}; see {}",
                    build.number,
                    build.state,
                    artifact::listed_states(&listed),
                    build.web_url
                )),
                Err(e) => Outcome::Failed(format!(
                    "build #{} finished with state {:?} but its result.json could not be used: {}; see {}",
                    build.number,
                    build.state,
                    report(&e),
                    build.web_url
                )),
            }
            .into())
        })
    }
}

fn status(b: &Build) -> BuildStatus {
    BuildStatus {
        id: b.id.clone(),
        number: b.number,
        state: b.state.clone(),
        web_url: b.web_url.clone(),
        blocked: b.blocked,
    }
}

fn launched(b: Build) -> Launched {
    Launched {
        running: b.state == "running",
        build: BuildInfo {
            id: b.id,
            number: b.number,
            web_url: b.web_url,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn executor() -> BuildkiteExecutor {
        BuildkiteExecutor::new(&crate::config::tests::parse_minimal()).unwrap()
    }

    fn job() -> Job {
        Job {
            submission_id: "s".into(),
            run_id: "r".into(),
            queue: "h100".into(),
            mode: "benchmark".into(),
            payload: "eJyrrgUAAXUA+Q==".into(),
            ranked: false,
            pin: None,
            pin_tags: Default::default(),
        }
    }

    #[test]
    fn only_a_canary_s_build_pins_an_agent_and_no_build_names_the_runner_version() {
        let x = executor();
        let b = x.new_build(&job());
        // The expected runner is the pipeline agent's to say, never a build's.
        assert!(!b.env.contains_key("KERNELBOT_RUNNER_VERSION"));
        assert!(
            !b.env.keys().any(|k| k.starts_with("KERNELBOT_PIN_")),
            "{:?}",
            b.env
        );
        let mut canary = job();
        canary.pin = Some("dgx1-slice3".into());
        canary.pin_tags = BTreeMap::from([
            ("node".to_string(), "dgx1".to_string()),
            ("gpu-index".to_string(), "3".to_string()),
        ]);
        let b = x.new_build(&canary);
        for (k, v) in [
            ("KERNELBOT_PIN_NODE_TAG", "node"),
            ("KERNELBOT_PIN_NODE", "dgx1"),
            ("KERNELBOT_PIN_GPU_TAG", "gpu-index"),
            ("KERNELBOT_PIN_GPU_INDEX", "3"),
        ] {
            assert_eq!(b.env.get(k).map(String::as_str), Some(v), "{k}");
        }
    }
}
