//! The service's core: what happens on a submission, a build event, a cancel, a timeout.
//!
//! It speaks in submissions and domain errors ([`Error`]); requests, responses and status
//! codes are the HTTP layer's (`crate::http`). Builds run on an [`Executor`]; submissions live
//! in the [`Store`].
//!
//! Nothing here polls. A submission waits on its `watch` channel; the executor's events move
//! it; a per-submission timer (a sleeping task that also ends when the submission does)
//! enforces the timeout.

use std::path::PathBuf;
use std::sync::{Arc, Weak};
use std::time::Duration;

use chrono::Utc;
use kernelkite_kernelbot::config::RunConfig;
use serde::Deserialize;
use tokio::sync::{watch, Semaphore};

use crate::buildkite::BuildkiteExecutor;
use crate::config::{Config, ConfigError};
use crate::error::{Error, Invalid};
use crate::executor::{BuildEvent, BuildEventKind, BuildStatus, Executor, Job};
use crate::report::report;
use crate::store::{Archive, Durable, Routed, Store};
use crate::submission::{BuildInfo, Outcome, State, Submission};
use crate::webhook::{WebhookAuth, WebhookReceiver};

/// `POST /v1/submissions` body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubmitRequest {
    /// kernelbot's run config.
    pub config: serde_json::Value,
    /// Which machines run it (a Buildkite agent queue).
    pub queue: String,
    /// The backend's id for the run (default: the submission id).
    #[serde(default)]
    pub run_id: Option<String>,
    /// Where the finished submission is POSTed.
    #[serde(default)]
    pub callback_url: Option<String>,
    /// Seconds until the submission times out (default: KERNELKITE_DEFAULT_TIMEOUT_S).
    #[serde(default)]
    pub timeout_s: Option<u64>,
}

/// Unix seconds; injected so webhook-window tests can move the clock.
pub type Clock = Arc<dyn Fn() -> i64 + Send + Sync>;

/// The running service: configuration, submissions, the executor, and its background tasks.
pub struct App {
    /// The configuration it started with.
    pub cfg: Config,
    /// Every submission, and its waiters.
    pub store: Store,
    /// Where builds run.
    pub executor: Arc<dyn Executor>,
    /// The receiving end of Buildkite's webhook.
    pub webhooks: WebhookReceiver,
    /// The time webhook signatures are checked against.
    pub clock: Clock,
    /// Result collections in flight. Holding permits pauses collecting (the ingest benchmark
    /// does, to measure the webhook path alone).
    pub fetch_slots: Semaphore,
    /// What `GET /metrics` exports.
    pub metrics: crate::metrics::Metrics,
    callback_http: reqwest::Client,
}

/// Why the service cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A setting is wrong; the cause names it.
    #[error("invalid configuration")]
    Config(#[from] ConfigError),
    /// The HTTP client cannot be built (no TLS roots, ...).
    #[error("cannot build the HTTP client")]
    Http(#[from] reqwest::Error),
    /// The data dir cannot be created.
    #[error("cannot use KERNELKITE_DATA_DIR {}; create it or point the variable at a writable directory", .dir.display())]
    DataDir {
        /// KERNELKITE_DATA_DIR.
        dir: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// What a client watches: a submission in memory (it sees every change), or one read from
/// the durable store (it will not change again).
pub enum Watch {
    /// In memory: the receiver sees every later change.
    Live(watch::Receiver<Submission>),
    /// Finished and only in the durable store.
    Done(Box<Submission>),
}

impl App {
    /// Builds the service with Buildkite as the executor and starts its housekeeping task.
    /// Needs a tokio runtime.
    pub fn new(cfg: Config) -> Result<Arc<App>, StartError> {
        let clock: Clock = Arc::new(|| Utc::now().timestamp());
        App::with_clock(cfg, clock)
    }

    /// [`App::new`] with the clock webhook signatures are checked against.
    pub fn with_clock(cfg: Config, clock: Clock) -> Result<Arc<App>, StartError> {
        cfg.check()?;
        let executor = Arc::new(BuildkiteExecutor::new(&cfg)?);
        App::start(cfg, clock, executor)
    }

    /// Builds the service around another executor (one that runs builds on this machine, a
    /// test's) and starts its housekeeping task.
    pub fn with_executor(
        cfg: Config,
        clock: Clock,
        executor: Arc<dyn Executor>,
    ) -> Result<Arc<App>, StartError> {
        cfg.check()?;
        App::start(cfg, clock, executor)
    }

    fn start(
        cfg: Config,
        clock: Clock,
        executor: Arc<dyn Executor>,
    ) -> Result<Arc<App>, StartError> {
        let durable: Option<Box<dyn Durable>> = match &cfg.data_dir {
            Some(d) => Some(Box::new(Archive::open(d).map_err(|source| {
                StartError::DataDir {
                    dir: d.clone(),
                    source,
                }
            })?)),
            None => None,
        };
        let app = Arc::new(App {
            store: Store::new(
                cfg.early_event_max,
                Duration::from_secs(cfg.early_event_ttl_s),
                durable,
            ),
            executor,
            webhooks: WebhookReceiver {
                auth: WebhookAuth {
                    token: cfg.buildkite_webhook_token.clone(),
                    allow_plain_token: cfg.allow_plain_webhook_token,
                    window_s: cfg.webhook_window_s,
                },
                pipeline: cfg.buildkite_pipeline.clone(),
            },
            clock,
            fetch_slots: Semaphore::new(cfg.fetch_concurrency),
            metrics: crate::metrics::Metrics::new(),
            callback_http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?,
            cfg,
        });
        spawn_housekeeping(Arc::downgrade(&app));
        Ok(app)
    }

    /// Validates and accepts a submission; the build is created in the background.
    pub fn submit(self: &Arc<Self>, req: SubmitRequest) -> Result<Submission, Error> {
        check_request(&req, &self.cfg)?;
        RunConfig::from_json(req.config.clone()).map_err(Invalid::RunConfig)?;
        // The original JSON is encoded, not the parsed struct, so the runner sees exactly what
        // the backend sent (key order included).
        let payload =
            kernelkite_kernelbot::payload::encode(&req.config).map_err(Invalid::Payload)?;
        let id = uuid::Uuid::new_v4().to_string();
        let timeout_s = req.timeout_s.unwrap_or(self.cfg.default_timeout_s);
        let job = Job {
            submission_id: id.clone(),
            run_id: req.run_id.clone().unwrap_or_else(|| id.clone()),
            queue: req.queue.clone(),
            mode: req
                .config
                .get("mode")
                .and_then(|m| m.as_str())
                .unwrap_or("?")
                .to_string(),
            payload,
        };
        let sub = Submission::new(
            id.clone(),
            req.queue,
            req.run_id,
            req.callback_url,
            timeout_s,
            Utc::now(),
        );
        self.store.insert(sub.clone());
        self.spawn_timeout(&id, timeout_s, Duration::from_secs(timeout_s));
        let app = self.clone();
        tokio::spawn(async move { app.launch(id, job).await });
        tracing::info!(id = %sub.id, queue = %sub.queue, "submission accepted");
        Ok(sub)
    }

    async fn launch(self: Arc<Self>, id: String, job: Job) {
        match self.executor.launch(&job).await {
            Ok(launched) => {
                let build = launched.build;
                tracing::info!(%id, build = build.number, build_id = %build.id, "build created");
                let early = self.store.attach_build(&id, build.clone());
                if launched.running {
                    self.store
                        .update_quiet(&id, |s| s.advance(State::Running, Utc::now()));
                }
                for ev in early {
                    self.apply(&id, ev);
                }
                // Canceled or timed out while the create call was in flight (and perhaps
                // already evicted from memory, as a long 429 wait can outlast
                // KERNELKITE_RETAIN_S): the build must not run for nobody.
                if matches!(
                    self.store.state(&id),
                    None | Some(State::Canceled | State::TimedOut)
                ) {
                    self.spawn_cancel_build(build);
                }
            }
            Err(e) => {
                let why = report(&*e);
                tracing::warn!(%id, error = %why, "build creation failed");
                self.finish(
                    &id,
                    Outcome::Failed(format!(
                        "could not create the {} build: {why}",
                        self.executor.name()
                    )),
                );
            }
        }
    }

    /// Acts on a build's progress, as its executor reported it. Cheap: collecting the result
    /// of a finished build runs in the background.
    pub fn on_event(self: &Arc<Self>, event: BuildEvent) {
        match self.store.route(&event) {
            Routed::Submission(id) => self.apply(&id, event),
            Routed::Buffered => {
                tracing::debug!(build_id = %event.build.id, "event for an unknown build kept for a while")
            }
            Routed::Dropped => {
                tracing::warn!(build_id = %event.build.id, "event for an unknown build dropped: early-event buffer full")
            }
        }
    }

    fn apply(self: &Arc<Self>, id: &str, ev: BuildEvent) {
        let now = Utc::now();
        match ev.kind {
            BuildEventKind::Scheduled => {
                self.store
                    .update_quiet(id, |s| s.advance(State::Scheduled, now));
            }
            BuildEventKind::Running => {
                self.store
                    .update_quiet(id, |s| s.advance(State::Running, now));
            }
            BuildEventKind::Skipped => {
                self.finish(
                    id,
                    Outcome::Failed(format!(
                        "{} skipped build #{}; see {}",
                        self.executor.name(),
                        ev.build.number,
                        ev.build.web_url
                    )),
                );
            }
            BuildEventKind::Finished => {
                if ev.build.blocked {
                    // A block step paused it; a later build.finished brings the real end.
                    tracing::info!(%id, build = ev.build.number, "build is blocked; waiting");
                    return;
                }
                if self
                    .store
                    .update_quiet(id, |s| s.advance(State::Fetching, now))
                {
                    self.spawn_collect(id.to_string(), ev.build);
                }
            }
        }
    }

    fn spawn_collect(self: &Arc<Self>, id: String, build: BuildStatus) {
        let app = self.clone();
        tokio::spawn(async move {
            let Ok(_slot) = app.fetch_slots.acquire().await else {
                return;
            };
            if !matches!(app.store.state(&id), Some(s) if !s.is_terminal()) {
                return;
            }
            let outcome = app.executor.collect(&build).await;
            app.finish(&id, outcome);
        });
    }

    /// Ends a submission (no-op when it already ended) and runs the terminal side effects.
    /// Returns whether this call ended it, and its value afterwards.
    pub fn finish(self: &Arc<Self>, id: &str, outcome: Outcome) -> Option<(bool, Submission)> {
        let (changed, after) = self.store.update(id, |s| s.finish(outcome, Utc::now()))?;
        if changed {
            tracing::info!(%id, state = after.state.as_str(), build = after.build.as_ref().map(|b| b.number), "submission finished");
            self.spawn_terminal_effects(after.clone());
        }
        Some((changed, after))
    }

    /// Cancels the submission and its build. Canceling a canceled submission is not an error;
    /// one that ended otherwise is a conflict.
    pub async fn cancel(self: &Arc<Self>, id: &str) -> Result<Submission, Error> {
        let Some((changed, after)) =
            self.finish(id, Outcome::Canceled("canceled by request".into()))
        else {
            // Not in memory may still mean finished long ago (kept in the data dir only).
            return match self.store.lookup(id).await {
                Some(s) if s.state == State::Canceled => Ok(s),
                Some(s) => Err(Error::Conflict { state: s.state }),
                None => Err(Error::NotFound { id: id.to_string() }),
            };
        };
        if !changed {
            if after.state == State::Canceled {
                return Ok(after);
            }
            return Err(Error::Conflict { state: after.state });
        }
        if let Some(b) = &after.build {
            self.spawn_cancel_build(b.clone());
        }
        Ok(after)
    }

    /// Takes in a submission value (what a durable store reloads on restart) and arms its
    /// timeout for the time it has left.
    pub fn adopt(self: &Arc<Self>, sub: Submission) {
        let id = sub.id.clone();
        let (terminal, timeout_s) = (sub.state.is_terminal(), sub.timeout_s);
        let elapsed = (Utc::now() - sub.created_at).to_std().unwrap_or_default();
        self.store.insert(sub);
        if !terminal {
            self.spawn_timeout(
                &id,
                timeout_s,
                Duration::from_secs(timeout_s).saturating_sub(elapsed),
            );
        }
    }

    fn spawn_timeout(self: &Arc<Self>, id: &str, timeout_s: u64, after: Duration) {
        let Some(mut rx) = self.store.subscribe(id) else {
            return;
        };
        let app = Arc::downgrade(self);
        let id = id.to_string();
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(after) => {}
                // Ends the timer as soon as the submission ends (or is evicted).
                _ = rx.wait_for(|s| s.state.is_terminal()) => return,
            }
            let Some(app) = app.upgrade() else { return };
            let msg = format!("no result within {timeout_s} s");
            if let Some((true, s)) = app.finish(&id, Outcome::TimedOut(msg)) {
                if let Some(b) = s.build {
                    app.spawn_cancel_build(b);
                }
            }
        });
    }

    fn spawn_cancel_build(self: &Arc<Self>, build: BuildInfo) {
        let app = self.clone();
        tokio::spawn(async move {
            match app.executor.cancel(&build).await {
                Ok(true) => tracing::info!(build = build.number, "build canceled"),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(build = build.number, error = %report(&*e), "could not cancel the build")
                }
            }
        });
    }

    fn spawn_terminal_effects(self: &Arc<Self>, sub: Submission) {
        if !self.store.is_durable() && sub.callback_url.is_none() {
            return;
        }
        let app = self.clone();
        tokio::spawn(async move {
            if let Err(e) = app.store.keep_finished(&sub).await {
                tracing::error!(id = %sub.id, error = %report(&*e), "could not write the finished submission to KERNELKITE_DATA_DIR");
            }
            if let Some(url) = &sub.callback_url {
                app.post_callback(url, &sub).await;
            }
        });
    }

    async fn post_callback(&self, url: &str, sub: &Submission) {
        let attempts = self.cfg.callback_attempts.max(1);
        let base = Duration::from_millis(self.cfg.retry_base_ms);
        for attempt in 1..=attempts {
            match self.callback_http.post(url).json(sub).send().await {
                Ok(r) if r.status().is_success() => return,
                Ok(r)
                    if r.status().is_client_error()
                        && !matches!(r.status().as_u16(), 408 | 429) =>
                {
                    tracing::warn!(id = %sub.id, status = %r.status(), "callback refused; not retrying");
                    return;
                }
                Ok(r) => {
                    tracing::warn!(id = %sub.id, status = %r.status(), attempt, "callback failed")
                }
                Err(e) => {
                    tracing::warn!(id = %sub.id, error = %report(&e.without_url()), attempt, "callback failed")
                }
            }
            if attempt < attempts {
                tokio::time::sleep(base.saturating_mul(1 << (attempt - 1).min(10))).await;
            }
        }
    }

    /// A submission from memory, else from the data dir.
    pub async fn lookup(&self, id: &str) -> Option<Submission> {
        self.store.lookup(id).await
    }

    /// The submission, once it ended or `wait` passed, whichever comes first; at once when
    /// `wait` is zero. Sleeps on the submission's channel: woken by the change itself.
    pub async fn get(&self, id: &str, wait: Duration) -> Result<Submission, Error> {
        if !wait.is_zero() {
            if let Some(mut rx) = self.store.subscribe(id) {
                let _ = tokio::time::timeout(wait, rx.wait_for(|s| s.state.is_terminal())).await;
                let s = rx.borrow().clone();
                return Ok(s);
            }
        }
        self.lookup(id)
            .await
            .ok_or_else(|| Error::NotFound { id: id.to_string() })
    }

    /// The submission to follow, change by change.
    pub async fn watch(&self, id: &str) -> Result<Watch, Error> {
        if let Some(rx) = self.store.subscribe(id) {
            return Ok(Watch::Live(rx));
        }
        match self.lookup(id).await {
            Some(s) => Ok(Watch::Done(Box::new(s))),
            None => Err(Error::NotFound { id: id.to_string() }),
        }
    }

    /// Where clients read a submission.
    pub fn status_url(&self, id: &str) -> String {
        match &self.cfg.public_url {
            Some(base) => format!("{}/v1/submissions/{id}", base.trim_end_matches('/')),
            None => format!("/v1/submissions/{id}"),
        }
    }
}

fn check_request(req: &SubmitRequest, cfg: &Config) -> Result<(), Invalid> {
    if !crate::queues::valid_name(&req.queue) {
        return Err(Invalid::Queue(req.queue.clone()));
    }
    if let Some(r) = &req.run_id {
        if r.is_empty() || r.len() > 256 || r.chars().any(char::is_control) {
            return Err(Invalid::RunId);
        }
    }
    if let Some(u) = &req.callback_url {
        match url::Url::parse(u) {
            Ok(url) if matches!(url.scheme(), "http" | "https") && url.host().is_some() => {}
            parsed => {
                return Err(Invalid::CallbackUrl {
                    url: u.clone(),
                    source: parsed.err(),
                })
            }
        }
    }
    if let Some(t) = req.timeout_s {
        if t == 0 || t > cfg.max_timeout_s {
            return Err(Invalid::Timeout {
                max: cfg.max_timeout_s,
            });
        }
    }
    if !req.config.is_object() {
        return Err(Invalid::ConfigNotObject);
    }
    Ok(())
}

/// Forgets expired early events and old finished submissions, now and then.
fn spawn_housekeeping(app: Weak<App>) {
    tokio::spawn(async move {
        let period = {
            let Some(a) = app.upgrade() else { return };
            Duration::from_secs((a.cfg.early_event_ttl_s / 2).clamp(1, 60))
        };
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(a) = app.upgrade() else { return };
            a.store.sweep_early(std::time::Instant::now());
            if let Some(cutoff) = retention_cutoff(Utc::now(), a.cfg.retain_s) {
                a.store.evict_finished(cutoff);
            }
        }
    });
}

/// Submissions that finished before the returned time leave memory. `None` (keep them all):
/// `KERNELKITE_RETAIN_S=0`, or a retention longer than the calendar can express; computed
/// without panicking, as a panic here would end housekeeping (and early-event expiry) for good.
fn retention_cutoff(now: chrono::DateTime<Utc>, retain_s: u64) -> Option<chrono::DateTime<Utc>> {
    if retain_s == 0 {
        return None;
    }
    let keep = chrono::Duration::try_seconds(i64::try_from(retain_s).ok()?)?;
    now.checked_sub_signed(keep)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retention_cutoff_never_panics() {
        let now = Utc::now();
        assert_eq!(
            retention_cutoff(now, 60),
            Some(now - chrono::Duration::seconds(60))
        );
        assert_eq!(retention_cutoff(now, 0), None);
        // Past chrono's range (about 262,000 years): no cutoff rather than a panic.
        for huge in [u64::MAX, i64::MAX as u64, i64::MAX as u64 / 1000] {
            assert_eq!(retention_cutoff(now, huge), None, "{huge}");
        }
        assert!(
            retention_cutoff(now, 1 << 40).is_some(),
            "34,000 years is representable"
        );
    }
}
