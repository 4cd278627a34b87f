//! A fake Buildkite on loopback, for the service's tests and benchmark.
//!
//! It follows the REST API and webhook formats in `docs/DESIGN.md`: builds are created,
//! read and canceled under `/v2/organizations/{org}/pipelines/{pipeline}/builds`; artifacts
//! are listed with their real `file_size` and `sha1sum`; a download answers `302` to a blob
//! endpoint that refuses any request carrying `Authorization`; webhooks are signed the way
//! Buildkite signs them (`X-Buildkite-Signature: timestamp=..,signature=HMAC-SHA256(token,
//! "<timestamp>." + body)`). Every request is recorded, so tests count API calls instead of
//! computing them. Faults (5xx, 429 with `RateLimit-Reset`, delays, an outage, a create that
//! is answered late after the build exists, lost webhooks) are injected per route. Every API
//! answer carries `RateLimit-*` and `RateLimit-User-*` headers counted over a real window;
//! [`FakeBuildkite::set_rate_limit`] makes the window small enough to run out (then `429`).
//!
//! It also lists the organization's agents (`GET /v2/organizations/{org}/agents`, paginated
//! with a `Link` header, tags in `meta_data` as `queue=<q>`) and serves the agent API's
//! metrics endpoint (`GET /v3/metrics`, `Authorization: Token <agent token>`); see [`agents`].

pub mod agent_api;
pub mod agents;
pub mod pipeline;

pub use agents::{FakeAgent, FAKE_AGENT_TOKEN};

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha1::{Digest, Sha1};
use sha2::Sha256;
use tokio::sync::{mpsc, Notify};

/// The API routes, for fault injection and request counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// `POST .../builds`
    CreateBuild,
    /// `GET .../builds` (the list, with its filters)
    ListBuilds,
    /// `GET .../builds/{number}`
    GetBuild,
    /// `PUT .../builds/{number}/cancel`
    CancelBuild,
    /// `GET .../builds/{number}/artifacts`
    ListArtifacts,
    /// `GET .../artifacts/{id}/download` (answers `302` to the blob)
    Download,
    /// `GET /v2/organizations/{org}/agents`
    ListAgents,
    /// `PUT /v2/organizations/{org}/agents/{id}/pause`
    PauseAgent,
    /// `PUT /v2/organizations/{org}/agents/{id}/resume`
    ResumeAgent,
    /// `GET /v3/metrics` (the agent API, with an agent token; not counted as a REST call)
    AgentMetrics,
    /// The blob store (not the API)
    Blob,
    /// Anything else (answered `404`)
    Other,
}

impl Route {
    /// Whether the route is a REST API call (counted against Buildkite's rate limit); the blob
    /// store is not.
    pub fn is_api(self) -> bool {
        !matches!(self, Route::Blob | Route::Other | Route::AgentMetrics)
    }
}

/// One request the fake received.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// Which route it hit.
    pub route: Route,
    /// Its method.
    pub method: String,
    /// Its path.
    pub path: String,
    /// Its query string, as sent.
    pub query: Option<String>,
    /// Its `Authorization` header.
    pub authorization: Option<String>,
    /// When it arrived.
    pub at: Instant,
    /// The build number the request was about, when it names one.
    pub build: Option<u64>,
    /// The status it was (or will be) answered with.
    pub status: u16,
}

/// An injected failure for the next request on a route.
#[derive(Debug, Clone)]
pub enum Fault {
    /// Answer with this status and a `{"message"}` body, as Buildkite does.
    Status(u16),
    /// `429` with `RateLimit-Reset: <secs>`.
    RateLimited {
        /// Seconds until the window resets.
        reset_s: u64,
    },
    /// Answer normally, but only after this long. The request is recorded on arrival (with
    /// the status it will get), so one the client abandons is still counted.
    Delay(Duration),
    /// Create-build only: create the build at once, then answer only after this long (a
    /// client that gave up before has made a build it does not know of).
    DelayResponse(Duration),
    /// Create-build only: create the build, then answer with this status (a 5xx from a proxy
    /// or a failure after the commit: the client is told it failed, the build exists).
    StatusAfterCreate(u16),
}

/// A webhook's headers and body.
pub type RawWebhook = (Vec<(&'static str, String)>, Vec<u8>);

/// How the fake signs the webhooks it sends.
#[derive(Debug, Clone)]
pub enum Signing {
    /// `X-Buildkite-Signature`, keyed by this token (Buildkite's signed mode).
    Hmac(String),
    /// `X-Buildkite-Token: <token>` (Buildkite's plain mode).
    Token(String),
}

/// A `result.json` (or other) artifact to attach to a build.
#[derive(Debug, Clone)]
pub struct ArtifactSpec {
    /// The path it is uploaded under.
    pub path: String,
    /// Its content.
    pub bytes: Vec<u8>,
    /// Its state (`finished`, `error`, ...).
    pub state: String,
    /// Lie about the size (corrupt-artifact tests).
    pub file_size: Option<u64>,
    /// Lie about the SHA-1 (corrupt-artifact tests).
    pub sha1sum: Option<String>,
}

impl ArtifactSpec {
    /// A finished `result.json` with these bytes, listed truthfully.
    pub fn result_json(bytes: impl Into<Vec<u8>>) -> ArtifactSpec {
        ArtifactSpec {
            path: "result.json".into(),
            bytes: bytes.into(),
            state: "finished".into(),
            file_size: None,
            sha1sum: None,
        }
    }
}

/// Plays the build to its end inside the create-build handler, before the create response is
/// sent: artifact, `build.finished` webhook delivered, then the response.
#[derive(Debug, Clone)]
pub struct FinishBeforeCreateResponse {
    /// The state the build finishes in.
    pub state: String,
    /// The artifact it uploads first.
    pub artifact: Option<ArtifactSpec>,
}

#[derive(Debug, Clone)]
struct FakeArtifact {
    id: String,
    job_id: String,
    path: String,
    state: String,
    file_size: u64,
    sha1sum: String,
    blob: String,
}

#[derive(Debug, Clone)]
struct FakeBuild {
    id: String,
    number: u64,
    state: String,
    job_id: String,
    body: Value,
    artifacts: Vec<FakeArtifact>,
    blocked: bool,
    created_at: String,
    started_at: Option<String>,
    finished_at: Option<String>,
}

struct Inner {
    org: String,
    pipeline: String,
    api_token: String,
    base: String,
    builds: Mutex<Vec<FakeBuild>>,
    by_id: Mutex<HashMap<String, u64>>,
    blobs: Mutex<HashMap<String, Bytes>>,
    requests: Mutex<Vec<Recorded>>,
    faults: Mutex<HashMap<Route, VecDeque<Fault>>>,
    webhook: Mutex<Option<(String, Signing)>>,
    finish_before_create: Mutex<Option<FinishBeforeCreateResponse>>,
    record: std::sync::atomic::AtomicBool,
    created_tx: mpsc::UnboundedSender<u64>,
    created_rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<u64>>,
    rate: Mutex<RateWindow>,
    down_until: Mutex<Option<Instant>>,
    route_down: Mutex<HashMap<Route, (u16, Instant)>>,
    ignore_state_filter: std::sync::atomic::AtomicBool,
    redirect_downloads: Mutex<Option<String>>,
    drop_webhooks: Mutex<Option<(f64, fastrand::Rng)>>,
    dropped: Mutex<Vec<(String, u64)>>,
    http: reqwest::Client,
    changed: Notify,
    agents: Mutex<Vec<FakeAgent>>,
    /// The agents and their jobs. Lock order: `builds` may be held while `world` is taken
    /// (a build's REST form lists its jobs), never the other way round.
    world: Mutex<agent_api::World>,
}

/// Buildkite's rate limits: one window, counted for the organization and the token.
#[derive(Debug)]
struct RateWindow {
    org_limit: u64,
    user_limit: u64,
    window: Duration,
    start: Instant,
    count: u64,
}

impl RateWindow {
    /// Counts one request; returns whether it is over the limit.
    fn count(&mut self, now: Instant) -> bool {
        if now.saturating_duration_since(self.start) >= self.window {
            self.start = now;
            self.count = 0;
        }
        self.count += 1;
        self.count > self.org_limit.min(self.user_limit)
    }

    fn reset_s(&self, now: Instant) -> u64 {
        let left = self
            .window
            .saturating_sub(now.saturating_duration_since(self.start));
        // Whole seconds, rounded up, as Buildkite sends them.
        left.as_millis().div_ceil(1000) as u64
    }
}

/// A running fake. Dropping it stops the server.
pub struct FakeBuildkite {
    inner: Arc<Inner>,
    addr: SocketAddr,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for FakeBuildkite {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// The organization the fake serves.
pub const FAKE_ORG: &str = "kernelkite";
/// The pipeline the fake serves.
pub const FAKE_PIPELINE: &str = "submissions";
/// The only API token the fake accepts.
pub const FAKE_API_TOKEN: &str = "bkua_fake_api_token";

/// The `X-Buildkite-Signature` value Buildkite sends for `body` at `timestamp`.
pub fn signature_header(token: &str, timestamp: i64, body: &[u8]) -> String {
    let mut mac =
        Hmac::<Sha256>::new_from_slice(token.as_bytes()).expect("HMAC takes any key length");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!(
        "timestamp={timestamp},signature={}",
        hex::encode(mac.finalize().into_bytes())
    )
}

/// Now, unix seconds.
pub fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

fn now_iso() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

impl FakeBuildkite {
    /// Starts the fake on a free loopback port.
    pub async fn start() -> FakeBuildkite {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let (created_tx, created_rx) = mpsc::unbounded_channel();
        let inner = Arc::new(Inner {
            org: FAKE_ORG.into(),
            pipeline: FAKE_PIPELINE.into(),
            api_token: FAKE_API_TOKEN.into(),
            base: format!("http://{addr}"),
            builds: Mutex::new(Vec::new()),
            by_id: Mutex::new(HashMap::new()),
            blobs: Mutex::new(HashMap::new()),
            requests: Mutex::new(Vec::new()),
            faults: Mutex::new(HashMap::new()),
            webhook: Mutex::new(None),
            finish_before_create: Mutex::new(None),
            record: std::sync::atomic::AtomicBool::new(true),
            created_tx,
            created_rx: tokio::sync::Mutex::new(created_rx),
            rate: Mutex::new(RateWindow {
                org_limit: 1_000_000,
                user_limit: 1_000_000,
                window: Duration::from_secs(60),
                start: Instant::now(),
                count: 0,
            }),
            down_until: Mutex::new(None),
            route_down: Mutex::new(HashMap::new()),
            ignore_state_filter: std::sync::atomic::AtomicBool::new(false),
            redirect_downloads: Mutex::new(None),
            drop_webhooks: Mutex::new(None),
            dropped: Mutex::new(Vec::new()),
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(256)
                .build()
                .expect("client"),
            changed: Notify::new(),
            agents: Mutex::new(Vec::new()),
            world: Mutex::new(agent_api::World::default()),
        });
        let builds = "/v2/organizations/{org}/pipelines/{pipeline}/builds";
        let router = Router::new()
            .route(builds, post(create_build).get(list_builds))
            .route(&format!("{builds}/{{number}}"), get(get_build))
            .route(&format!("{builds}/{{number}}/cancel"), put(cancel_build))
            .route(
                &format!("{builds}/{{number}}/artifacts"),
                get(list_artifacts),
            )
            .route(
                &format!("{builds}/{{number}}/jobs/{{job}}/artifacts/{{id}}/download"),
                get(download),
            )
            .route("/v2/organizations/{org}/agents", get(agents::list_agents))
            .route(
                "/v2/organizations/{org}/agents/{id}/pause",
                put(agents::pause_agent),
            )
            .route(
                "/v2/organizations/{org}/agents/{id}/resume",
                put(agents::resume_agent),
            )
            .route("/v3/metrics", get(agents::metrics))
            .route("/blobs/{blob}", get(blob))
            // The agent API (agent_api.rs), for real agents.
            .route("/v3/register", post(agent_api::register))
            .route("/v3/connect", post(agent_api::connect))
            .route("/v3/disconnect", post(agent_api::disconnect))
            .route("/v3/heartbeat", post(agent_api::heartbeat))
            .route("/v3/ping", get(agent_api::ping))
            .route("/v3/pause", post(agent_api::pause))
            .route("/v3/resume", post(agent_api::resume))
            .route(
                "/agentedge.v1.AgentEdgeService/StreamPings",
                post(agent_api::stream_pings),
            )
            .route("/v3/jobs/{id}", get(agent_api::job_state))
            .route("/v3/jobs/{id}/accept", put(agent_api::accept))
            .route("/v3/jobs/{id}/start", put(agent_api::start))
            .route("/v3/jobs/{id}/finish", put(agent_api::finish_job))
            .route("/v3/jobs/{id}/chunks", post(agent_api::chunk))
            .route("/v3/jobs/{id}/header_times", post(agent_api::header_times))
            .route("/v3/jobs/{id}/data/{op}", post(agent_api::meta_data))
            .route("/v3/jobs/{id}/pipelines", post(agent_api::upload_pipeline))
            .route(
                "/v3/jobs/{id}/artifacts",
                post(agent_api::create_artifacts).put(agent_api::update_artifacts),
            )
            .route("/uploads/{id}", post(agent_api::upload_file))
            .fallback(fallback)
            .with_state(inner.clone());
        tokio::spawn(agent_api::watch(Arc::downgrade(&inner)));
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        FakeBuildkite {
            inner,
            addr,
            server,
        }
    }

    /// The REST base URL, like `https://api.buildkite.com/v2`.
    pub fn api_url(&self) -> String {
        format!("{}/v2", self.inner.base)
    }

    /// The agent API's base URL, like `https://agent.buildkite.com/v3`.
    pub fn agent_api_url(&self) -> String {
        format!("{}/v3", self.inner.base)
    }

    /// Replaces the organization's agents (what the agents list and the metrics show).
    pub fn set_agents(&self, agents: Vec<FakeAgent>) {
        *lock(&self.inner.agents) = agents;
    }

    /// The organization's agents as they are now (paused or not).
    pub fn agent_list(&self) -> Vec<FakeAgent> {
        lock(&self.inner.agents).clone()
    }

    /// Ends agent `name`'s pause, as its timeout does (or as an agent that restarted, a new
    /// registration, comes back unpaused).
    pub fn end_pause(&self, name: &str) {
        for a in lock(&self.inner.agents)
            .iter_mut()
            .filter(|a| a.name == name)
        {
            a.paused = None;
        }
    }

    /// How many builds were created.
    pub fn build_count(&self) -> u64 {
        lock(&self.inner.builds).len() as u64
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where webhooks go, and how they are signed.
    pub fn set_webhook(&self, url: impl Into<String>, signing: Signing) {
        *lock(&self.inner.webhook) = Some((url.into(), signing));
    }

    /// Queues `fault` for the next request on `route` (faults on a route are used in order).
    pub fn inject(&self, route: Route, fault: Fault) {
        lock(&self.inner.faults)
            .entry(route)
            .or_default()
            .push_back(fault);
    }

    /// Calls on `route` answer `status` until `until` (one endpoint's outage; the others
    /// answer).
    pub fn fail_route_until(&self, route: Route, status: u16, until: Instant) {
        lock(&self.inner.route_down).insert(route, (status, until));
    }

    /// The builds list ignores its `state[]` and `finished_from` filters (as a proxy or an
    /// API change might): a client must check each build's own state.
    pub fn ignore_state_filter(&self, on: bool) {
        self.inner.ignore_state_filter.store(on, Ordering::Relaxed);
    }

    /// Artifact downloads redirect to `url` instead of the fake's blob store (a hostile or
    /// misconfigured API sending the service elsewhere).
    pub fn redirect_downloads_to(&self, url: Option<String>) {
        *lock(&self.inner.redirect_downloads) = url;
    }

    /// Every API call answers `503` until `until` (an outage).
    pub fn fail_api_until(&self, until: Instant) {
        *lock(&self.inner.down_until) = Some(until);
    }

    /// Buildkite's limits, counted over a window of `window` (default: 1,000,000 a minute,
    /// which no test reaches). Past `user_limit` requests in a window the API answers `429`.
    pub fn set_rate_limit(&self, org_limit: u64, user_limit: u64, window: Duration) {
        let mut r = lock(&self.inner.rate);
        r.org_limit = org_limit;
        r.user_limit = user_limit;
        r.window = window;
        r.start = Instant::now();
        r.count = 0;
    }

    /// Loses each webhook with probability `p` (seeded, so a run is repeatable), as
    /// Buildkite's best-effort delivery may.
    pub fn drop_webhooks(&self, p: f64, seed: u64) {
        *lock(&self.inner.drop_webhooks) = Some((p, fastrand::Rng::with_seed(seed)));
    }

    /// The webhooks lost so far: (event, build number).
    pub fn dropped_webhooks(&self) -> Vec<(String, u64)> {
        lock(&self.inner.dropped).clone()
    }

    /// Every build's number and meta-data (to count builds per submission).
    pub fn builds_meta(&self) -> Vec<(u64, Value)> {
        lock(&self.inner.builds)
            .iter()
            .map(|b| {
                (
                    b.number,
                    b.body.get("meta_data").cloned().unwrap_or(json!({})),
                )
            })
            .collect()
    }

    /// The next create-build call plays the build to its end before it answers.
    pub fn finish_before_create_response(&self, plan: FinishBeforeCreateResponse) {
        *lock(&self.inner.finish_before_create) = Some(plan);
    }

    /// Turns request recording off (the ingest benchmark sends 100k requests).
    pub fn set_recording(&self, on: bool) {
        self.inner.record.store(on, Ordering::Relaxed);
    }

    /// Waits for the next build created through the API; returns its number.
    pub async fn next_created(&self, within: Duration) -> Option<u64> {
        let mut rx = self.inner.created_rx.lock().await;
        tokio::time::timeout(within, rx.recv()).await.ok().flatten()
    }

    /// The build as `GET .../builds/{number}` shows it.
    pub fn build(&self, number: u64) -> Option<Value> {
        let builds = lock(&self.inner.builds);
        builds
            .get(number.checked_sub(1)? as usize)
            .map(|b| rest_build(&self.inner, b, true))
    }

    /// Build `number`'s UUID.
    pub fn build_id(&self, number: u64) -> Option<String> {
        let builds = lock(&self.inner.builds);
        builds
            .get(number.checked_sub(1)? as usize)
            .map(|b| b.id.clone())
    }

    /// Build `number`'s state.
    pub fn build_state(&self, number: u64) -> Option<String> {
        let builds = lock(&self.inner.builds);
        builds
            .get(number.checked_sub(1)? as usize)
            .map(|b| b.state.clone())
    }

    /// Waits until build `number` is in `state` (cancel requests arrive asynchronously).
    pub async fn wait_state(&self, number: u64, state: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            let notified = self.inner.changed.notified();
            if self.build_state(number).as_deref() == Some(state) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || tokio::time::timeout(left, notified).await.is_err() {
                return self.build_state(number).as_deref() == Some(state);
            }
        }
    }

    /// Every request recorded so far.
    pub fn requests(&self) -> Vec<Recorded> {
        lock(&self.inner.requests).clone()
    }

    /// The recorded requests to `route`, in order.
    pub fn requests_to(&self, route: Route) -> Vec<Recorded> {
        self.requests()
            .into_iter()
            .filter(|r| r.route == route)
            .collect()
    }

    /// REST API calls about build `number` (create included; the blob store excluded).
    pub fn api_calls_for(&self, number: u64) -> Vec<Recorded> {
        self.requests()
            .into_iter()
            .filter(|r| r.route.is_api() && r.build == Some(number))
            .collect()
    }

    /// How many REST calls on `route` were about build `number`.
    pub fn calls_to(&self, number: u64, route: Route) -> usize {
        self.api_calls_for(number)
            .iter()
            .filter(|c| c.route == route)
            .count()
    }

    /// Forgets the recorded requests.
    pub fn clear_requests(&self) {
        lock(&self.inner.requests).clear();
    }

    /// Adds an artifact to a build (its real size and SHA-1 are listed unless the spec lies).
    pub fn add_artifact(&self, number: u64, spec: ArtifactSpec) {
        add_artifact(&self.inner, number, spec);
    }

    /// Moves a build to `running` and sends `build.running`. Returns the webhook's status.
    pub async fn start_build(&self, number: u64) -> Option<u16> {
        set_state(&self.inner, number, "running");
        self.send_event("build.running", number).await
    }

    /// Finishes a build in `state` (`passed`, `failed`, `canceled`), with an optional artifact,
    /// and sends `build.finished`. Returns the webhook's status once delivered.
    pub async fn finish_build(
        &self,
        number: u64,
        state: &str,
        artifact: Option<ArtifactSpec>,
    ) -> Option<u16> {
        if let Some(a) = artifact {
            add_artifact(&self.inner, number, a);
        }
        set_state(&self.inner, number, state);
        self.send_event("build.finished", number).await
    }

    /// Marks a build as stopped at a block step (`blocked: true` in its JSON).
    pub fn set_blocked(&self, number: u64, blocked: bool) {
        let mut builds = lock(&self.inner.builds);
        if let Some(b) = number
            .checked_sub(1)
            .and_then(|i| builds.get_mut(i as usize))
        {
            b.blocked = blocked;
        }
    }

    /// Finishes a build without sending any webhook (what a poller would discover).
    pub fn complete_build(&self, number: u64, state: &str, artifact: Option<ArtifactSpec>) {
        if let Some(a) = artifact {
            add_artifact(&self.inner, number, a);
        }
        set_state(&self.inner, number, state);
    }

    /// The body Buildkite sends for `event` about build `number`.
    pub fn event_body(&self, event: &str, number: u64) -> Option<Vec<u8>> {
        event_body(&self.inner, event, number)
    }

    /// Sends `event` for build `number` through the configured webhook. Returns the status.
    pub async fn send_event(&self, event: &str, number: u64) -> Option<u16> {
        send_event(&self.inner, event, number).await
    }

    /// Posts raw bytes with the given headers to the webhook URL (forgery tests).
    pub async fn post_webhook_raw(&self, headers: &[(&str, String)], body: Vec<u8>) -> Option<u16> {
        let url = lock(&self.inner.webhook).as_ref()?.0.clone();
        let mut req = self
            .inner
            .http
            .post(url)
            .body(body)
            .header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, v);
        }
        req.send().await.ok().map(|r| r.status().as_u16())
    }

    /// A webhook for `event` on build `number`, signed at `timestamp` with `token`: the
    /// headers and body, for tests that send it themselves (or many times).
    pub fn signed_event(
        &self,
        event: &str,
        number: u64,
        token: &str,
        timestamp: i64,
    ) -> Option<RawWebhook> {
        let body = self.event_body(event, number)?;
        let headers = vec![
            ("X-Buildkite-Event", event.to_string()),
            (
                "X-Buildkite-Signature",
                signature_header(token, timestamp, &body),
            ),
        ];
        Some((headers, body))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn add_artifact(inner: &Inner, number: u64, spec: ArtifactSpec) {
    let blob = uuid::Uuid::new_v4().to_string();
    let mut builds = lock(&inner.builds);
    let Some(b) = number
        .checked_sub(1)
        .and_then(|i| builds.get_mut(i as usize))
    else {
        return;
    };
    b.artifacts.push(FakeArtifact {
        id: uuid::Uuid::new_v4().to_string(),
        job_id: b.job_id.clone(),
        path: spec.path.clone(),
        state: spec.state.clone(),
        file_size: spec.file_size.unwrap_or(spec.bytes.len() as u64),
        sha1sum: spec
            .sha1sum
            .clone()
            .unwrap_or_else(|| hex::encode(Sha1::digest(&spec.bytes))),
        blob: blob.clone(),
    });
    drop(builds);
    lock(&inner.blobs).insert(blob, Bytes::from(spec.bytes));
}

fn body_of(inner: &Inner, number: u64) -> Value {
    lock(&inner.builds)
        .get(number as usize - 1)
        .map(|b| b.body.clone())
        .unwrap_or(Value::Null)
}

fn set_state(inner: &Inner, number: u64, state: &str) {
    {
        let mut builds = lock(&inner.builds);
        let Some(b) = number
            .checked_sub(1)
            .and_then(|i| builds.get_mut(i as usize))
        else {
            return;
        };
        b.state = state.to_string();
        match state {
            "running" => b.started_at = Some(now_iso()),
            "passed" | "failed" | "canceled" | "skipped" | "not_run" => {
                b.finished_at = Some(now_iso())
            }
            _ => {}
        }
    }
    inner.changed.notify_waiters();
}

fn event_body(inner: &Inner, event: &str, number: u64) -> Option<Vec<u8>> {
    let build = {
        let builds = lock(&inner.builds);
        rest_build(inner, builds.get(number.checked_sub(1)? as usize)?, false)
    };
    let body = json!({
        "event": event,
        "build": build,
        "pipeline": pipeline_json(inner),
        "sender": {"id": "0183c3ba-0000-0000-0000-000000000001", "name": "Kernel Kite"},
    });
    serde_json::to_vec(&body).ok()
}

async fn send_event(inner: &Inner, event: &str, number: u64) -> Option<u16> {
    let lost = lock(&inner.drop_webhooks)
        .as_mut()
        .is_some_and(|(p, rng)| rng.f64() < *p);
    if lost {
        lock(&inner.dropped).push((event.to_string(), number));
        return None;
    }
    let body = event_body(inner, event, number)?;
    let (url, signing) = lock(&inner.webhook).clone()?;
    let mut req = inner
        .http
        .post(url)
        .header("content-type", "application/json")
        .header("X-Buildkite-Event", event);
    req = match &signing {
        Signing::Hmac(token) => req.header(
            "X-Buildkite-Signature",
            signature_header(token, unix_now(), &body),
        ),
        Signing::Token(token) => req.header("X-Buildkite-Token", token),
    };
    req.body(body)
        .send()
        .await
        .ok()
        .map(|r| r.status().as_u16())
}

fn pipeline_json(inner: &Inner) -> Value {
    json!({
        "id": agent_api::PIPELINE_ID,
        "url": format!("{}/v2/organizations/{}/pipelines/{}", inner.base, inner.org, inner.pipeline),
        "web_url": format!("https://buildkite.com/{}/{}", inner.org, inner.pipeline),
        "name": "Submissions",
        "slug": inner.pipeline,
    })
}

/// A build as the REST API shows it; webhooks carry it without `jobs`.
fn rest_build(inner: &Inner, b: &FakeBuild, with_jobs: bool) -> Value {
    let mut v = json!({
        "id": b.id,
        "graphql_id": format!("QnVpbGQtLS0{}", b.number),
        "url": format!("{}/v2/organizations/{}/pipelines/{}/builds/{}", inner.base, inner.org, inner.pipeline, b.number),
        "web_url": format!("https://buildkite.com/{}/{}/builds/{}", inner.org, inner.pipeline, b.number),
        "number": b.number,
        "state": b.state,
        "blocked": b.blocked,
        "message": b.body.get("message").cloned().unwrap_or(Value::Null),
        "commit": b.body.get("commit").cloned().unwrap_or(Value::Null),
        "branch": b.body.get("branch").cloned().unwrap_or(Value::Null),
        "env": b.body.get("env").cloned().unwrap_or(json!({})),
        "source": "api",
        "creator": {"id": "0183c3ba-0000-0000-0000-000000000001", "name": "Kernel Kite"},
        "created_at": b.created_at,
        "scheduled_at": b.created_at,
        "started_at": b.started_at,
        "finished_at": b.finished_at,
        "meta_data": b.body.get("meta_data").cloned().unwrap_or(json!({})),
        "pull_request": null,
        "pipeline": pipeline_json(inner),
    });
    if with_jobs {
        if let Some(jobs) = agent_api::rest_jobs(inner, b.number) {
            v["jobs"] = Value::Array(jobs);
            return v;
        }
        v["jobs"] = json!([{
            "id": b.job_id,
            "type": "script",
            "name": "evaluate",
            "state": b.state,
            "web_url": format!("https://buildkite.com/{}/{}/builds/{}#{}", inner.org, inner.pipeline, b.number, b.job_id),
        }]);
    }
    v
}

fn rest_artifact(inner: &Inner, b: &FakeBuild, a: &FakeArtifact) -> Value {
    let url = format!(
        "{}/v2/organizations/{}/pipelines/{}/builds/{}/jobs/{}/artifacts/{}",
        inner.base, inner.org, inner.pipeline, b.number, a.job_id, a.id
    );
    let filename = a.path.rsplit('/').next().unwrap_or(&a.path).to_string();
    json!({
        "id": a.id,
        "job_id": a.job_id,
        "url": url,
        "download_url": format!("{url}/download"),
        "state": a.state,
        "path": a.path,
        "dirname": a.path.rsplit_once('/').map_or(".", |(d, _)| d),
        "filename": filename,
        "mime_type": "application/json",
        "file_size": a.file_size,
        "sha1sum": a.sha1sum,
    })
}

/// Records the request, applies an injected fault when one is queued, and checks the token.
/// `Some(response)` ends the request there.
async fn gate(
    inner: &Inner,
    route: Route,
    req_headers: &HeaderMap,
    method: &str,
    path: &str,
    query: Option<String>,
    build: Option<u64>,
) -> Option<Response> {
    let fault = lock(&inner.faults)
        .get_mut(&route)
        .and_then(|q| q.pop_front());
    let authorization = req_headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let mut resp = None;
    let mut delay = None;
    match fault {
        Some(Fault::Status(s)) => {
            let status = StatusCode::from_u16(s).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            resp = Some((status, Json(json!({"message": "Injected failure"}))).into_response());
        }
        Some(Fault::RateLimited { reset_s }) => {
            let mut r = (StatusCode::TOO_MANY_REQUESTS, Json(json!({"message": "You have exceeded your rate limit. Please try again later."}))).into_response();
            r.headers_mut()
                .insert("RateLimit-Reset", HeaderValue::from(reset_s));
            r.headers_mut()
                .insert("RateLimit-Remaining", HeaderValue::from(0u64));
            resp = Some(r);
        }
        // Create-build takes it before the gate; elsewhere it is a delay.
        Some(Fault::Delay(d) | Fault::DelayResponse(d)) => delay = Some(d),
        Some(Fault::StatusAfterCreate(_)) => {}
        None => {}
    }
    let now = Instant::now();
    let route_down = lock(&inner.route_down)
        .get(&route)
        .filter(|(_, until)| now < *until)
        .map(|(status, _)| *status);
    if let (None, Some(status)) = (&resp, route_down) {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        resp = Some((status, Json(json!({"message": "Injected outage"}))).into_response());
    }
    if resp.is_none() && route.is_api() && lock(&inner.down_until).is_some_and(|t| now < t) {
        resp = Some(
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({"message": "Service Unavailable"})),
            )
                .into_response(),
        );
    }
    if resp.is_none() && route.is_api() && lock(&inner.rate).count(now) {
        let reset = lock(&inner.rate).reset_s(now);
        let mut r = (
            StatusCode::TOO_MANY_REQUESTS,
            Json(json!({"message": "You have exceeded your rate limit. Please try again later."})),
        )
            .into_response();
        r.headers_mut()
            .insert("RateLimit-Reset", HeaderValue::from(reset));
        r.headers_mut()
            .insert("RateLimit-Remaining", HeaderValue::from(0u64));
        resp = Some(r);
    }
    if resp.is_none()
        && route.is_api()
        && authorization.as_deref() != Some(&format!("Bearer {}", inner.api_token))
    {
        resp = Some((StatusCode::UNAUTHORIZED, Json(json!({"message": "Authentication required. Please supply a valid API Access Token: https://buildkite.com/docs/apis/rest-api#authentication"}))).into_response());
    }
    if resp.is_none() && route == Route::Blob && authorization.is_some() {
        // Like S3 given two auth mechanisms: the API token must never reach the blob store.
        resp = Some((StatusCode::BAD_REQUEST, "Only one auth mechanism allowed; the Authorization header must not be sent to the blob store").into_response());
    }
    if inner.record.load(Ordering::Relaxed) {
        lock(&inner.requests).push(Recorded {
            route,
            method: method.to_string(),
            path: path.to_string(),
            query,
            authorization,
            at: Instant::now(),
            build,
            status: resp.as_ref().map_or(200, |r| r.status().as_u16()),
        });
    }
    // Recorded before the delay: a client that gives up drops this handler mid-sleep, and
    // the request it sent must still be counted.
    if let Some(d) = delay {
        tokio::time::sleep(d).await;
    }
    resp
}

fn with_rate_headers(inner: &Inner, mut r: Response) -> Response {
    let (org_limit, user_limit, count, reset) = {
        let w = lock(&inner.rate);
        (
            w.org_limit,
            w.user_limit,
            w.count,
            w.reset_s(Instant::now()),
        )
    };
    let h = r.headers_mut();
    // Buildkite sends the organization's limit and the token's (RateLimit-User-*), counted
    // over the same window here.
    h.insert("RateLimit-Limit", HeaderValue::from(org_limit));
    h.insert("RateLimit-User-Limit", HeaderValue::from(user_limit));
    h.insert(
        "RateLimit-User-Remaining",
        HeaderValue::from(user_limit.saturating_sub(count)),
    );
    h.insert("RateLimit-User-Reset", HeaderValue::from(reset));
    if !h.contains_key("RateLimit-Remaining") {
        h.insert(
            "RateLimit-Remaining",
            HeaderValue::from(org_limit.saturating_sub(count)),
        );
    }
    if !h.contains_key("RateLimit-Reset") {
        h.insert("RateLimit-Reset", HeaderValue::from(reset));
    }
    r
}

fn check_pipeline(inner: &Inner, org: &str, pipeline: &str) -> Option<Response> {
    (org != inner.org || pipeline != inner.pipeline).then(|| {
        (
            StatusCode::NOT_FOUND,
            Json(json!({"message": "No pipeline found"})),
        )
            .into_response()
    })
}

async fn create_build(
    State(inner): State<Arc<Inner>>,
    Path((org, pipeline)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = format!("/v2/organizations/{org}/pipelines/{pipeline}/builds");
    // Attributed to the number the next build gets, so a failed attempt counts for it too
    // (exact when creates do not overlap, as in the tests and the benchmark).
    let next_number = lock(&inner.builds).len() as u64 + 1;
    let (late_answer, failed_answer) = {
        let mut faults = lock(&inner.faults);
        let q = faults.entry(Route::CreateBuild).or_default();
        match q.front() {
            Some(Fault::DelayResponse(d)) => {
                let d = *d;
                q.pop_front();
                (Some(d), None)
            }
            Some(Fault::StatusAfterCreate(s)) => {
                let s = *s;
                q.pop_front();
                (None, Some(s))
            }
            _ => (None, None),
        }
    };
    if let Some(r) = gate(
        &inner,
        Route::CreateBuild,
        &headers,
        "POST",
        &path,
        None,
        Some(next_number),
    )
    .await
    {
        return with_rate_headers(&inner, r);
    }
    if let Some(r) = check_pipeline(&inner, &org, &pipeline) {
        return with_rate_headers(&inner, r);
    }
    let parsed: Value = match serde_json::from_slice(&body) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            return with_rate_headers(
                &inner,
                (
                    StatusCode::BAD_REQUEST,
                    Json(json!({"message": "Problems parsing JSON"})),
                )
                    .into_response(),
            )
        }
    };
    for field in ["commit", "branch"] {
        if !parsed.get(field).is_some_and(Value::is_string) {
            return with_rate_headers(&inner, (StatusCode::UNPROCESSABLE_ENTITY, Json(json!({"message": "Validation Failed", "errors": [format!("{field} can't be blank")]}))).into_response());
        }
    }
    let (number, json) = {
        let mut builds = lock(&inner.builds);
        let number = builds.len() as u64 + 1;
        let b = FakeBuild {
            id: uuid::Uuid::new_v4().to_string(),
            number,
            state: "scheduled".into(),
            job_id: uuid::Uuid::new_v4().to_string(),
            body: parsed,
            artifacts: Vec::new(),
            blocked: false,
            created_at: now_iso(),
            started_at: None,
            finished_at: None,
        };
        let json = rest_build(&inner, &b, true);
        lock(&inner.by_id).insert(b.id.clone(), number);
        builds.push(b);
        (number, json)
    };
    if let Some(Err(e)) = agent_api::build_created(&inner, number, &body_of(&inner, number)) {
        // Buildkite fails a build whose pipeline it cannot read, with the reason in its log.
        eprintln!("fake buildkite: build {number}'s settings steps: {e}");
        set_state(&inner, number, "failed");
        send_event(&inner, "build.finished", number).await;
    }
    let plan = lock(&inner.finish_before_create).take();
    if let Some(plan) = plan {
        if let Some(a) = plan.artifact {
            add_artifact(&inner, number, a);
        }
        set_state(&inner, number, &plan.state);
        send_event(&inner, "build.finished", number).await;
    }
    let _ = inner.created_tx.send(number);
    inner.changed.notify_waiters();
    if let Some(d) = late_answer {
        tokio::time::sleep(d).await;
    }
    if let Some(status) = failed_answer {
        if let Some(r) = lock(&inner.requests)
            .iter_mut()
            .rev()
            .find(|r| r.route == Route::CreateBuild)
        {
            r.status = status;
        }
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
        return with_rate_headers(
            &inner,
            (
                status,
                Json(json!({"message": "Injected failure after the build was made"})),
            )
                .into_response(),
        );
    }
    with_rate_headers(&inner, (StatusCode::CREATED, Json(json)).into_response())
}

/// `GET .../builds`: Buildkite's filters `state[]=` (repeatable; `state=` too),
/// `created_from`, `finished_from` (ISO 8601), `meta_data[key]=value`, `exclude_jobs`,
/// `exclude_pipeline`; newest first, `per_page` (default 30, at most 100) and `page`, with a
/// `Link: <...>; rel="next"` header while more pages follow.
async fn list_builds(
    State(inner): State<Arc<Inner>>,
    Path((org, pipeline)): Path<(String, String)>,
    headers: HeaderMap,
    req: Request,
) -> Response {
    let path = format!("/v2/organizations/{org}/pipelines/{pipeline}/builds");
    let raw = req.uri().query().unwrap_or_default().to_string();
    if let Some(r) = gate(
        &inner,
        Route::ListBuilds,
        &headers,
        "GET",
        &path,
        Some(raw.clone()),
        None,
    )
    .await
    {
        return with_rate_headers(&inner, r);
    }
    if let Some(r) = check_pipeline(&inner, &org, &pipeline) {
        return with_rate_headers(&inner, r);
    }
    let pairs: Vec<(String, String)> = url::form_urlencoded::parse(raw.as_bytes())
        .into_owned()
        .collect();
    let mut states = Vec::new();
    let mut meta = Vec::new();
    let (mut created_from, mut finished_from) = (None, None);
    let (mut exclude_jobs, mut exclude_pipeline) = (false, false);
    let (mut per_page, mut page) = (30usize, 1usize);
    let bad = |what: String| {
        with_rate_headers(
            &inner,
            (
                StatusCode::UNPROCESSABLE_ENTITY,
                Json(json!({"message": what})),
            )
                .into_response(),
        )
    };
    let time =
        |v: &str| chrono::DateTime::parse_from_rfc3339(v).map(|t| t.with_timezone(&chrono::Utc));
    for (k, v) in &pairs {
        match k.as_str() {
            "state[]" | "state" => states.push(v.clone()),
            "created_from" => match time(v) {
                Ok(t) => created_from = Some(t),
                Err(_) => return bad(format!("created_from {v:?} is not an ISO 8601 time")),
            },
            "finished_from" => match time(v) {
                Ok(t) => finished_from = Some(t),
                Err(_) => return bad(format!("finished_from {v:?} is not an ISO 8601 time")),
            },
            "exclude_jobs" => exclude_jobs = v == "true",
            "exclude_pipeline" => exclude_pipeline = v == "true",
            "per_page" => per_page = v.parse::<usize>().unwrap_or(30).clamp(1, 100),
            "page" => page = v.parse::<usize>().unwrap_or(1).max(1),
            _ => {
                if let Some(key) = k
                    .strip_prefix("meta_data[")
                    .and_then(|r| r.strip_suffix(']'))
                {
                    meta.push((key.to_string(), v.clone()));
                }
            }
        }
    }
    let (list, more) = {
        let builds = lock(&inner.builds);
        let matching: Vec<&FakeBuild> = builds
            .iter()
            .rev()
            .filter(|b| {
                states.is_empty()
                    || states.contains(&b.state)
                    || inner.ignore_state_filter.load(Ordering::Relaxed)
            })
            .filter(|b| {
                created_from.is_none_or(|from| time(&b.created_at).is_ok_and(|t| t >= from))
            })
            .filter(|b| {
                inner.ignore_state_filter.load(Ordering::Relaxed)
                    || finished_from.is_none_or(|from| {
                        b.finished_at
                            .as_deref()
                            .is_some_and(|f| time(f).is_ok_and(|t| t >= from))
                    })
            })
            .filter(|b| {
                meta.iter().all(|(k, v)| {
                    b.body
                        .get("meta_data")
                        .and_then(|m| m.get(k))
                        .and_then(Value::as_str)
                        == Some(v.as_str())
                })
            })
            .collect();
        let start = (page - 1).saturating_mul(per_page);
        let list: Vec<Value> = matching
            .iter()
            .skip(start)
            .take(per_page)
            .map(|b| {
                let mut v = rest_build(&inner, b, !exclude_jobs);
                if exclude_pipeline {
                    if let Some(o) = v.as_object_mut() {
                        o.remove("pipeline");
                    }
                }
                v
            })
            .collect();
        (list, start + per_page < matching.len())
    };
    let mut r = Json(list).into_response();
    if more {
        let next: String = url::form_urlencoded::Serializer::new(String::new())
            .extend_pairs(pairs.iter().filter(|(k, _)| k != "page"))
            .append_pair("page", &(page + 1).to_string())
            .finish();
        if let Ok(v) =
            HeaderValue::from_str(&format!("<{}{path}?{next}>; rel=\"next\"", inner.base))
        {
            r.headers_mut().insert("link", v);
        }
    }
    with_rate_headers(&inner, r)
}

async fn get_build(
    State(inner): State<Arc<Inner>>,
    Path((org, pipeline, number)): Path<(String, String, u64)>,
    headers: HeaderMap,
) -> Response {
    let path = format!("/v2/organizations/{org}/pipelines/{pipeline}/builds/{number}");
    if let Some(r) = gate(
        &inner,
        Route::GetBuild,
        &headers,
        "GET",
        &path,
        None,
        Some(number),
    )
    .await
    {
        return with_rate_headers(&inner, r);
    }
    let r = match (
        check_pipeline(&inner, &org, &pipeline),
        FakeBuildkite::build_of(&inner, number),
    ) {
        (Some(r), _) => r,
        (None, Some(b)) => Json(b).into_response(),
        (None, None) => (
            StatusCode::NOT_FOUND,
            Json(json!({"message": "No build found"})),
        )
            .into_response(),
    };
    with_rate_headers(&inner, r)
}

impl FakeBuildkite {
    fn build_of(inner: &Inner, number: u64) -> Option<Value> {
        let builds = lock(&inner.builds);
        builds
            .get(number.checked_sub(1)? as usize)
            .map(|b| rest_build(inner, b, true))
    }
}

async fn cancel_build(
    State(inner): State<Arc<Inner>>,
    Path((org, pipeline, number)): Path<(String, String, u64)>,
    headers: HeaderMap,
) -> Response {
    let path = format!("/v2/organizations/{org}/pipelines/{pipeline}/builds/{number}/cancel");
    if let Some(r) = gate(
        &inner,
        Route::CancelBuild,
        &headers,
        "PUT",
        &path,
        None,
        Some(number),
    )
    .await
    {
        return with_rate_headers(&inner, r);
    }
    if let Some(r) = check_pipeline(&inner, &org, &pipeline) {
        return with_rate_headers(&inner, r);
    }
    let state = {
        let builds = lock(&inner.builds);
        number
            .checked_sub(1)
            .and_then(|i| builds.get(i as usize))
            .map(|b| b.state.clone())
    };
    let r = match state.as_deref() {
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"message": "No build found"})),
        )
            .into_response(),
        Some("passed" | "failed" | "canceled" | "skipped" | "not_run") => (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({"message": "Build can't be canceled because it's already finished"})),
        )
            .into_response(),
        Some(_) if agent_api::cancel(&inner, number).await => {
            Json(FakeBuildkite::build_of(&inner, number).unwrap_or(Value::Null)).into_response()
        }
        Some(_) => {
            set_state(&inner, number, "canceled");
            let body = FakeBuildkite::build_of(&inner, number).unwrap_or(Value::Null);
            // Buildkite reports the cancellation as build.finished with state canceled.
            let inner2 = inner.clone();
            tokio::spawn(async move {
                send_event(&inner2, "build.finished", number).await;
            });
            Json(body).into_response()
        }
    };
    with_rate_headers(&inner, r)
}

async fn list_artifacts(
    State(inner): State<Arc<Inner>>,
    Path((org, pipeline, number)): Path<(String, String, u64)>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
    req: Request,
) -> Response {
    let path = format!("/v2/organizations/{org}/pipelines/{pipeline}/builds/{number}/artifacts");
    let query = req.uri().query().map(str::to_string);
    if let Some(r) = gate(
        &inner,
        Route::ListArtifacts,
        &headers,
        "GET",
        &path,
        query,
        Some(number),
    )
    .await
    {
        return with_rate_headers(&inner, r);
    }
    if let Some(r) = check_pipeline(&inner, &org, &pipeline) {
        return with_rate_headers(&inner, r);
    }
    let list = {
        let builds = lock(&inner.builds);
        number
            .checked_sub(1)
            .and_then(|i| builds.get(i as usize))
            .map(|b| {
                b.artifacts
                    .iter()
                    .filter(|a| !q.contains_key("path") || q.get("path") == Some(&a.path))
                    .filter(|a| !q.contains_key("state") || q.get("state") == Some(&a.state))
                    .map(|a| rest_artifact(&inner, b, a))
                    .collect::<Vec<_>>()
            })
    };
    let r = match list {
        Some(l) => Json(l).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"message": "No build found"})),
        )
            .into_response(),
    };
    with_rate_headers(&inner, r)
}

async fn download(
    State(inner): State<Arc<Inner>>,
    Path((org, pipeline, number, job, id)): Path<(String, String, u64, String, String)>,
    headers: HeaderMap,
) -> Response {
    let path = format!("/v2/organizations/{org}/pipelines/{pipeline}/builds/{number}/jobs/{job}/artifacts/{id}/download");
    if let Some(r) = gate(
        &inner,
        Route::Download,
        &headers,
        "GET",
        &path,
        None,
        Some(number),
    )
    .await
    {
        return with_rate_headers(&inner, r);
    }
    let blob = {
        let builds = lock(&inner.builds);
        number
            .checked_sub(1)
            .and_then(|i| builds.get(i as usize))
            .and_then(|b| b.artifacts.iter().find(|a| a.id == id && a.job_id == job))
            .map(|a| a.blob.clone())
    };
    let r = match blob {
        Some(blob) => {
            let mut r = (
                StatusCode::FOUND,
                Json(json!({"url": format!("{}/blobs/{blob}", inner.base)})),
            )
                .into_response();
            let to = lock(&inner.redirect_downloads)
                .clone()
                .unwrap_or_else(|| format!("{}/blobs/{blob}?X-Amz-Signature=fake", inner.base));
            if let Ok(v) = HeaderValue::from_str(&to) {
                r.headers_mut().insert("location", v);
            }
            r
        }
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"message": "No artifact found"})),
        )
            .into_response(),
    };
    with_rate_headers(&inner, r)
}

async fn blob(
    State(inner): State<Arc<Inner>>,
    Path(blob): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Some(r) = gate(
        &inner,
        Route::Blob,
        &headers,
        "GET",
        &format!("/blobs/{blob}"),
        None,
        None,
    )
    .await
    {
        return r;
    }
    match lock(&inner.blobs).get(&blob).cloned() {
        Some(b) => ([("content-type", "application/json")], b).into_response(),
        None => (StatusCode::NOT_FOUND, "NoSuchKey").into_response(),
    }
}

async fn fallback(State(inner): State<Arc<Inner>>, req: Request) -> Response {
    let (method, path, headers) = (
        req.method().to_string(),
        req.uri().path().to_string(),
        req.headers().clone(),
    );
    gate(&inner, Route::Other, &headers, &method, &path, None, None).await;
    (StatusCode::NOT_FOUND, Json(json!({"message": "Not Found"}))).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_like_buildkite() {
        // Expected value from Python: hmac.new(b"whsec-test", b'1700000000.{"event":"ping"}', sha256).
        assert_eq!(
            signature_header("whsec-test", 1_700_000_000, br#"{"event":"ping"}"#),
            "timestamp=1700000000,signature=18edb01b9146fe04b3de9e92ca1594f97bbf2547c75e7584f34d3bedfe76f0a6"
        );
    }

    #[tokio::test]
    async fn artifacts_carry_real_sha1_and_the_blob_refuses_authorization() {
        let fake = FakeBuildkite::start().await;
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap();
        let api = fake.api_url();
        let builds = format!("{api}/organizations/{FAKE_ORG}/pipelines/{FAKE_PIPELINE}/builds");
        let r = http
            .post(&builds)
            .json(&json!({"commit": "HEAD", "branch": "main"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "no token, no build");
        let b: Value = http
            .post(&builds)
            .bearer_auth(FAKE_API_TOKEN)
            .json(&json!({"commit": "HEAD", "branch": "main", "env": {"A": "1"}}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            (
                b["number"].as_u64(),
                b["state"].as_str(),
                b["env"]["A"].as_str()
            ),
            (Some(1), Some("scheduled"), Some("1"))
        );
        fake.complete_build(
            1,
            "passed",
            Some(ArtifactSpec::result_json(b"abc".to_vec())),
        );
        let list: Value = http
            .get(format!("{builds}/1/artifacts?path=result.json"))
            .bearer_auth(FAKE_API_TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            list[0]["sha1sum"],
            "a9993e364706816aba3e25717850c26c9cd0d89d"
        ); // sha1("abc"), FIPS 180 test vector
        assert_eq!(list[0]["file_size"], 3);
        let none: Value = http
            .get(format!("{builds}/1/artifacts?path=other.json"))
            .bearer_auth(FAKE_API_TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(none, json!([]));
        let r = http
            .get(list[0]["download_url"].as_str().unwrap())
            .bearer_auth(FAKE_API_TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 302);
        let blob = r.headers()["location"].to_str().unwrap().to_string();
        assert_eq!(
            http.get(&blob)
                .bearer_auth(FAKE_API_TOKEN)
                .send()
                .await
                .unwrap()
                .status(),
            400
        );
        assert_eq!(
            http.get(&blob)
                .send()
                .await
                .unwrap()
                .bytes()
                .await
                .unwrap()
                .as_ref(),
            b"abc"
        );
        let r = http
            .put(format!("{builds}/1/cancel"))
            .bearer_auth(FAKE_API_TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 422, "a finished build cannot be canceled");
        assert!(
            r.headers().contains_key("RateLimit-Remaining")
                && r.headers().contains_key("RateLimit-Reset")
        );
    }
}
