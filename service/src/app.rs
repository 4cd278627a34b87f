//! The service's core: what happens on a submission, a webhook, a cancel, a timeout; and the
//! router that exposes it.
//!
//! Nothing here polls Buildkite. A submission waits on its `watch` channel; the webhook moves
//! it; a per-submission timer (a sleeping task that also ends when the submission does)
//! enforces the timeout.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use chrono::Utc;
use kernelkite_kernelbot::config::RunConfig;
use serde::Deserialize;
use tokio::sync::Semaphore;

use crate::archive::Archive;
use crate::artifact::{self, ArtifactError};
use crate::buildkite::{Build, BuildkiteClient, NewBuild};
use crate::config::Config;
use crate::store::{Routed, Store};
use crate::submission::{BuildInfo, Outcome, State, Submission};
use crate::webhook::{BuildEvent, BuildEventKind, Delivery, WebhookAuth};

/// `POST /v1/submissions` body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubmitRequest {
    pub config: serde_json::Value,
    pub queue: String,
    #[serde(default)]
    pub run_id: Option<String>,
    #[serde(default)]
    pub callback_url: Option<String>,
    #[serde(default)]
    pub timeout_s: Option<u64>,
}

/// A refusal, with the HTTP status it maps to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: u16,
    pub message: String,
}

impl ApiError {
    pub fn new(status: u16, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }
}

/// Unix seconds; injected so webhook-window tests can move the clock.
pub type Clock = Arc<dyn Fn() -> i64 + Send + Sync>;

pub struct App {
    pub cfg: Config,
    pub store: Store,
    pub buildkite: BuildkiteClient,
    pub webhook_auth: WebhookAuth,
    pub archive: Option<Archive>,
    pub clock: Clock,
    /// Artifact fetches in flight. Holding permits pauses fetching (the ingest benchmark
    /// does, to measure the webhook path alone).
    pub fetch_slots: Semaphore,
    callback_http: reqwest::Client,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("configuration: {0}")]
    Config(String),
    #[error("cannot build the HTTP client: {0}")]
    Http(#[from] reqwest::Error),
    #[error("cannot use KERNELKITE_DATA_DIR {0}: {1}; create it or point the variable at a writable directory")]
    DataDir(String, std::io::Error),
}

impl App {
    /// Builds the service and starts its housekeeping task. Needs a tokio runtime.
    pub fn new(cfg: Config) -> Result<Arc<App>, StartError> {
        let clock: Clock = Arc::new(|| Utc::now().timestamp());
        App::with_clock(cfg, clock)
    }

    pub fn with_clock(cfg: Config, clock: Clock) -> Result<Arc<App>, StartError> {
        cfg.check().map_err(StartError::Config)?;
        let archive = match &cfg.data_dir {
            Some(d) => Some(
                Archive::open(d).map_err(|e| StartError::DataDir(d.display().to_string(), e))?,
            ),
            None => None,
        };
        let app = Arc::new(App {
            store: Store::new(
                cfg.early_event_max,
                Duration::from_secs(cfg.early_event_ttl_s),
            ),
            buildkite: BuildkiteClient::new(&cfg)?,
            webhook_auth: WebhookAuth {
                token: cfg.buildkite_webhook_token.clone(),
                allow_plain_token: cfg.allow_plain_webhook_token,
                window_s: cfg.webhook_window_s,
            },
            archive,
            clock,
            fetch_slots: Semaphore::new(cfg.fetch_concurrency),
            callback_http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?,
            cfg,
        });
        spawn_housekeeping(Arc::downgrade(&app));
        Ok(app)
    }

    /// Validates and accepts a submission; the build is created in the background.
    pub fn submit(self: &Arc<Self>, req: SubmitRequest) -> Result<Submission, ApiError> {
        check_request(&req, &self.cfg)?;
        RunConfig::from_json(req.config.clone()).map_err(|e| ApiError::new(422, e.to_string()))?;
        // The original JSON is encoded, not the parsed struct, so the runner sees exactly what
        // the backend sent (key order included).
        let payload = kernelkite_kernelbot::payload::encode(&req.config).map_err(|e| {
            ApiError::new(422, format!("config cannot be encoded as a payload: {e}"))
        })?;
        let id = uuid::Uuid::new_v4().to_string();
        let timeout_s = req.timeout_s.unwrap_or(self.cfg.default_timeout_s);
        let run_id = req.run_id.clone().unwrap_or_else(|| id.clone());
        let mode = req
            .config
            .get("mode")
            .and_then(|m| m.as_str())
            .unwrap_or("?")
            .to_string();

        let mut env: BTreeMap<String, String> = kernelkite_kernelbot::payload::to_env(&payload)
            .into_iter()
            .collect();
        env.insert("KERNELBOT_RUN_ID".into(), run_id.clone());
        env.insert("KERNELBOT_QUEUE".into(), req.queue.clone());
        env.insert("KERNELKITE_SUBMISSION_ID".into(), id.clone());
        let meta_data = BTreeMap::from([
            ("run_id".to_string(), run_id.clone()),
            ("kernelkite_submission_id".to_string(), id.clone()),
            ("queue".to_string(), req.queue.clone()),
        ]);
        let build = NewBuild {
            commit: self.cfg.commit.clone(),
            branch: self.cfg.branch.clone(),
            message: format!("kernelkite {mode} run {run_id} on {}", req.queue),
            env,
            meta_data,
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
        tokio::spawn(async move { app.create_build(id, build).await });
        tracing::info!(id = %sub.id, queue = %sub.queue, "submission accepted");
        Ok(sub)
    }

    async fn create_build(self: Arc<Self>, id: String, build: NewBuild) {
        match self.buildkite.create_build(&build).await {
            Ok(b) => {
                tracing::info!(%id, build = b.number, build_id = %b.id, "build created");
                let early = self.store.attach_build(
                    &id,
                    BuildInfo {
                        id: b.id.clone(),
                        number: b.number,
                        web_url: b.web_url.clone(),
                    },
                );
                if b.state == "running" {
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
                    self.store_state(&id),
                    None | Some(State::Canceled | State::TimedOut)
                ) {
                    self.spawn_cancel_build(b.number);
                }
            }
            Err(e) => {
                tracing::warn!(%id, error = %e, "build creation failed");
                self.finish(
                    &id,
                    Outcome::Failed(format!("could not create the Buildkite build: {e}")),
                );
            }
        }
    }

    fn store_state(&self, id: &str) -> Option<State> {
        self.store.state(id)
    }

    /// Handles a verified webhook delivery. Cheap: the artifact fetch runs in the background.
    pub fn on_delivery(self: &Arc<Self>, delivery: Delivery) {
        match delivery {
            Delivery::Ping => tracing::info!("webhook ping"),
            Delivery::Ignored(event) => tracing::debug!(%event, "webhook event ignored"),
            Delivery::Build(ev) => match self.store.route(&ev) {
                Routed::Submission(id) => self.apply(&id, ev),
                Routed::Buffered => {
                    tracing::debug!(build_id = %ev.build.id, "event for an unknown build kept for a while")
                }
                Routed::Dropped => {
                    tracing::warn!(build_id = %ev.build.id, "event for an unknown build dropped: early-event buffer full")
                }
            },
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
                        "Buildkite skipped build #{}; see {}",
                        ev.build.number, ev.build.web_url
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
                    self.spawn_fetch(id.to_string(), ev.build);
                }
            }
        }
    }

    fn spawn_fetch(self: &Arc<Self>, id: String, build: Build) {
        let app = self.clone();
        tokio::spawn(async move {
            let Ok(_slot) = app.fetch_slots.acquire().await else {
                return;
            };
            if !matches!(app.store_state(&id), Some(s) if !s.is_terminal()) {
                return;
            }
            let outcome = match artifact::fetch_result(&app.buildkite, build.number).await {
                Ok(r) => Outcome::Succeeded(r),
                Err(ArtifactError::Missing(why)) => Outcome::Failed(format!(
                    "build #{} finished with state {:?} without result.json{why}; see {}",
                    build.number, build.state, build.web_url
                )),
                Err(e) => Outcome::Failed(format!(
                    "build #{} finished with state {:?} but its result.json could not be used: {e}; see {}",
                    build.number, build.state, build.web_url
                )),
            };
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

    /// `DELETE`: cancels the submission and its build.
    pub fn cancel(self: &Arc<Self>, id: &str) -> Result<Submission, ApiError> {
        let (changed, after) = self
            .finish(id, Outcome::Canceled("canceled by request".into()))
            .ok_or_else(|| ApiError::new(404, format!("no submission {id}")))?;
        if !changed {
            if after.state == State::Canceled {
                return Ok(after);
            }
            return Err(ApiError::new(
                409,
                format!("submission already ended: {}", after.state.as_str()),
            ));
        }
        if let Some(b) = &after.build {
            self.spawn_cancel_build(b.number);
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
                    app.spawn_cancel_build(b.number);
                }
            }
        });
    }

    fn spawn_cancel_build(self: &Arc<Self>, number: u64) {
        let app = self.clone();
        tokio::spawn(async move {
            match app.buildkite.cancel_build(number).await {
                Ok(_) => tracing::info!(build = number, "build canceled"),
                // 422: it already finished; nothing to cancel.
                Err(e) if e.status().is_some_and(|s| s.as_u16() == 422) => {}
                Err(e) => tracing::warn!(build = number, error = %e, "could not cancel the build"),
            }
        });
    }

    fn spawn_terminal_effects(self: &Arc<Self>, sub: Submission) {
        if self.archive.is_none() && sub.callback_url.is_none() {
            return;
        }
        let app = self.clone();
        tokio::spawn(async move {
            if let Some(a) = &app.archive {
                if let Err(e) = a.write(&sub).await {
                    tracing::error!(id = %sub.id, error = %e, "could not write the finished submission to KERNELKITE_DATA_DIR");
                }
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
                    tracing::warn!(id = %sub.id, error = %e.without_url(), attempt, "callback failed")
                }
            }
            if attempt < attempts {
                tokio::time::sleep(base.saturating_mul(1 << (attempt - 1).min(10))).await;
            }
        }
    }

    /// A submission from memory, else from the data dir.
    pub async fn lookup(&self, id: &str) -> Option<Submission> {
        if let Some(s) = self.store.get(id) {
            return Some(s);
        }
        match &self.archive {
            Some(a) => a.read(id).await.ok().flatten(),
            None => None,
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

fn check_request(req: &SubmitRequest, cfg: &Config) -> Result<(), ApiError> {
    let bad = |m: String| Err(ApiError::new(422, m));
    if req.queue.is_empty()
        || req.queue.len() > 64
        || !req
            .queue
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return bad(format!(
            "queue {:?} must be 1-64 letters, digits, '-', '_' or '.'",
            req.queue
        ));
    }
    if let Some(r) = &req.run_id {
        if r.is_empty() || r.len() > 256 || r.chars().any(char::is_control) {
            return bad("run_id must be 1-256 characters without control characters".into());
        }
    }
    if let Some(u) = &req.callback_url {
        match reqwest::Url::parse(u) {
            Ok(url) if matches!(url.scheme(), "http" | "https") && url.host().is_some() => {}
            _ => {
                return bad(format!(
                    "callback_url {u:?} must be an absolute http(s) URL"
                ))
            }
        }
    }
    if let Some(t) = req.timeout_s {
        if t == 0 || t > cfg.max_timeout_s {
            return bad(format!(
                "timeout_s must be in 1..={} (KERNELKITE_MAX_TIMEOUT_S)",
                cfg.max_timeout_s
            ));
        }
    }
    if !req.config.is_object() {
        return bad("config must be a JSON object (kernelbot's run config)".into());
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

/// The HTTP routes.
pub fn router(app: Arc<App>) -> Router {
    use crate::api;
    let v1 = Router::new()
        .route("/v1/submissions", post(api::create_submission))
        .route(
            "/v1/submissions/{id}",
            get(api::get_submission).delete(api::cancel_submission),
        )
        .route("/v1/submissions/{id}/events", get(api::submission_events))
        .layer(DefaultBodyLimit::max(app.cfg.max_submission_bytes))
        .route_layer(axum::middleware::from_fn_with_state(
            app.clone(),
            api::require_client,
        ));
    let hooks = Router::new()
        .route("/webhooks/buildkite", post(api::buildkite_webhook))
        .layer(DefaultBodyLimit::max(app.cfg.webhook_max_bytes));
    Router::new()
        .merge(v1)
        .merge(hooks)
        .route("/healthz", get(|| async { "ok" }))
        .route("/openapi.json", get(api::openapi))
        .with_state(app)
}

/// Serves on `listener` until `shutdown` resolves.
pub async fn serve(
    app: Arc<App>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(
        listener,
        router(app).into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
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
