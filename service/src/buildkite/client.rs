//! The Buildkite REST client: create, cancel, list artifacts, download.
//!
//! Every call goes through `BuildkiteClient::send`, which first takes a unit of the shared
//! [`RateBudget`] (waiting for the window's reset when it is spent), retries connect errors
//! and 5xx with exponential backoff, and on `429` waits for `RateLimit-Reset`. Nothing here
//! logs a token, a request body or a payload: errors carry the method, path and status only.
//!
//! The retry budget (`classify`, `Tries`) is written here rather than taken from a retry
//! crate (`reqwest-retry`, `backoff`) because it needs what those do not offer together: 429s
//! counted apart from failures and waited out by Buildkite's two `RateLimit-*Reset` headers,
//! and timeouts retried only for calls that are safe to repeat (never create-build).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::{Method, RequestBuilder, StatusCode, Url};
use serde::{Deserialize, Serialize};

use super::budget::{Priority, RateBudget};
use crate::config::{Config, Secret};
use crate::metrics::{CallLabel, Metrics};

/// A build as the REST API returns it, and as webhooks carry it (the REST object without its
/// jobs): the fields the service reads.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Build {
    /// The build's UUID.
    pub id: String,
    /// The build's number within the pipeline.
    pub number: u64,
    /// `scheduled`, `running`, `passed`, `failed`, `canceled`, `blocked`, ...
    pub state: String,
    /// The build's page.
    #[serde(default)]
    pub web_url: String,
    /// The build's REST URL.
    #[serde(default)]
    pub url: String,
    /// Stopped at a block step.
    #[serde(default)]
    pub blocked: bool,
    /// The build's meta-data (the submission id is under [`SUBMISSION_META_KEY`]).
    #[serde(default)]
    pub meta_data: BTreeMap<String, serde_json::Value>,
}

/// The meta-data key that carries the submission id on every build this service creates.
pub const SUBMISSION_META_KEY: &str = "kernelkite_submission_id";

impl Build {
    /// The submission id in the build's meta-data.
    pub fn submission_id(&self) -> Option<&str> {
        self.meta_data
            .get(SUBMISSION_META_KEY)
            .and_then(|v| v.as_str())
    }
}

/// The filters of `GET .../builds` (Buildkite's names).
#[derive(Debug, Clone, Default)]
pub struct BuildFilter {
    /// `state[]=`: builds in any of these states.
    pub states: Vec<&'static str>,
    /// `created_from=`: created at or after (ISO 8601).
    pub created_from: Option<chrono::DateTime<chrono::Utc>>,
    /// `finished_from=`: finished at or after (ISO 8601).
    pub finished_from: Option<chrono::DateTime<chrono::Utc>>,
    /// `meta_data[key]=value`.
    pub meta_data: Option<(String, String)>,
}

/// An artifact as listed by the REST API.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Artifact {
    /// The artifact's UUID.
    pub id: String,
    /// The job that uploaded it.
    #[serde(default)]
    pub job_id: Option<String>,
    /// Its REST URL.
    #[serde(default)]
    pub url: String,
    /// Where to download it (answers `302` to the blob store).
    pub download_url: String,
    /// `new`, `error`, `finished`, `deleted`, `expired`.
    pub state: String,
    /// The path it was uploaded under.
    pub path: String,
    /// The file name part of `path`.
    #[serde(default)]
    pub filename: String,
    /// Its MIME type, when Buildkite knows it.
    #[serde(default)]
    pub mime_type: Option<String>,
    /// Its size, bytes.
    pub file_size: u64,
    /// Its SHA-1, hex.
    pub sha1sum: String,
}

/// Body of `POST .../builds`.
#[derive(Debug, Clone, Serialize)]
pub struct NewBuild {
    /// Commit to build (`HEAD`: the branch's head).
    pub commit: String,
    /// Branch to build.
    pub branch: String,
    /// The build's title.
    pub message: String,
    /// Environment of every job of the build.
    pub env: BTreeMap<String, String>,
    /// The build's meta-data.
    pub meta_data: BTreeMap<String, String>,
}

/// Why a Buildkite call failed.
#[derive(Debug, thiserror::Error)]
pub enum BuildkiteError {
    /// This process no longer holds the store: the create is another's to send.
    #[error(
        "not sent: this service no longer holds the store, and the build is the holder's to create"
    )]
    NotActing,
    /// Buildkite answered with an error status (after any retries).
    #[error("Buildkite answered {status} to {method} {path}: {message}")]
    Status {
        /// The request's method.
        method: Method,
        /// The request's path below the API base URL.
        path: String,
        /// The answer's status.
        status: StatusCode,
        /// Buildkite's own explanation (its `message`), or "no message".
        message: String,
    },
    /// No answer (after any retries).
    #[error("could not reach Buildkite for {method} {path}")]
    Transport {
        /// The request's method.
        method: Method,
        /// The request's path below the API base URL.
        path: String,
        /// Why.
        #[source]
        source: TransportError,
    },
    /// The request body could not be written.
    #[error("the request body of {method} {path} could not be encoded")]
    Encode {
        /// The request's method.
        method: Method,
        /// The request's path below the API base URL.
        path: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// An answer that is not the documented JSON.
    #[error("Buildkite's answer to {method} {path} is not what the REST API documents")]
    Decode {
        /// The request's method.
        method: Method,
        /// The request's path below the API base URL.
        path: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// An artifact's download URL is not below the API base URL.
    #[error("artifact download URL {0:?} is not on the Buildkite API host; refusing to send the API token there")]
    ForeignDownloadUrl(String),
    /// A download answered a redirect without a usable `Location`.
    #[error("artifact download answered {0} without a Location to the blob store")]
    NoRedirect(StatusCode),
    /// The download redirected somewhere the service does not fetch from.
    #[error("artifact download redirected to {url:?}, which is refused ({why}); the blob store must be https on a public address, or a host in KERNELKITE_ARTIFACT_HOSTS")]
    ForbiddenBlob {
        /// Where it redirected (without its query, which may hold a signature).
        url: String,
        /// Why it is refused.
        why: String,
    },
    /// The blob store answered an error (its body is never kept: it may be anyone's).
    #[error("the blob store answered {status} for the artifact")]
    Blob {
        /// Its status.
        status: StatusCode,
    },
    /// The artifact is over KERNELKITE_MAX_ARTIFACT_BYTES.
    #[error("artifact is larger than the {0} bytes allowed (KERNELKITE_MAX_ARTIFACT_BYTES)")]
    TooLarge(u64),
}

/// Why a request got no answer. The three kinds of network failure are told apart because
/// they mean different things for a create-build call: refused means nothing was sent; a
/// timeout or a reset means Buildkite may have created the build.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// No connection could be made: nothing was sent.
    #[error("connection refused or unreachable (nothing was sent)")]
    Refused(#[source] reqwest::Error),
    /// Sent, but no answer came within KERNELKITE_HTTP_TIMEOUT_S: it may have been received.
    #[error("no answer within KERNELKITE_HTTP_TIMEOUT_S (the request may have been received)")]
    Timeout(#[source] reqwest::Error),
    /// The connection broke after the request was sent: it may have been received.
    #[error("the connection broke after the request was sent (it may have been received)")]
    Reset(#[source] reqwest::Error),
    /// Buildkite kept answering this status (429, 5xx) through every retry.
    #[error("still {0} after every retry")]
    Exhausted(StatusCode),
    /// The blob store's name did not resolve, or no client could be made for it.
    #[error("the blob store could not be reached: {0}")]
    Resolve(String),
}

impl TransportError {
    fn from_http(e: reqwest::Error) -> TransportError {
        // without_url: the URL is in the BuildkiteError's path already; never a header.
        let e = e.without_url();
        if e.is_timeout() {
            TransportError::Timeout(e)
        } else if e.is_connect() {
            TransportError::Refused(e)
        } else {
            TransportError::Reset(e)
        }
    }
}

impl BuildkiteError {
    /// Buildkite's answer status, when it answered with an error.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            BuildkiteError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The request may have been received and acted on although no success came back: a
    /// timeout, a connection broken after sending, or a 5xx.
    pub fn is_ambiguous(&self) -> bool {
        match self {
            BuildkiteError::Transport { source, .. } => matches!(
                source,
                TransportError::Timeout(_)
                    | TransportError::Reset(_)
                    | TransportError::Exhausted(_)
            ),
            BuildkiteError::Status { status, .. } => status.is_server_error(),
            _ => false,
        }
    }

    /// No answer arrived in time, or the connection broke: Buildkite may still be acting on
    /// the request.
    pub fn may_be_in_flight(&self) -> bool {
        matches!(
            self,
            BuildkiteError::Transport {
                source: TransportError::Timeout(_) | TransportError::Reset(_),
                ..
            }
        )
    }

    /// Worth retrying later: Buildkite could not be reached or failed on its side (as
    /// opposed to refusing the request).
    pub fn is_transient(&self) -> bool {
        match self {
            BuildkiteError::Transport { .. } => true,
            BuildkiteError::Status { status, .. } | BuildkiteError::Blob { status } => {
                status.is_server_error() || matches!(status.as_u16(), 408 | 429)
            }
            BuildkiteError::Decode { .. } => true,
            _ => false,
        }
    }
}

/// Retry schedule; injectable so tests run with millisecond backoffs.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Tries per call on failures (connect errors, 5xx, timeouts of safe calls), the first
    /// included.
    pub attempts: u32,
    /// First backoff; doubles per failure.
    pub base: Duration,
    /// Longest backoff.
    pub max_backoff: Duration,
    /// Longest wait taken from a 429's reset header.
    pub max_rate_limit_wait: Duration,
}

impl RetryPolicy {
    /// Backoff before retry `n` (1-based): base·2^(n-1), capped, with ±25 % jitter so many
    /// clients retrying together spread out.
    pub fn backoff(&self, n: u32) -> Duration {
        let exp = self
            .base
            .saturating_mul(1u32 << n.saturating_sub(1).min(16));
        let d = exp.min(self.max_backoff);
        d.mul_f64(0.75 + fastrand::f64() * 0.5)
    }
}

/// How long to wait after a 429: the `RateLimit-Reset` (seconds until the window resets) of
/// the limit that is spent. Buildkite counts the organization (`RateLimit-*`) and the token
/// (`RateLimit-User-*`, 50/min, the one a busy service hits first) in windows that need not
/// end together; waiting for the organization's reset when the token's budget is the one at 0
/// would only earn another 429. A limit whose `Remaining` is 0 decides; when the answer does
/// not say which, the later reset is used. No reset header at all: 1 s.
pub fn rate_limit_wait(headers: &reqwest::header::HeaderMap, cap: Duration) -> Duration {
    let num = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    let limits = [
        (num("ratelimit-remaining"), num("ratelimit-reset")),
        (num("ratelimit-user-remaining"), num("ratelimit-user-reset")),
    ];
    let spent = limits
        .iter()
        .filter(|(remaining, _)| *remaining == Some(0))
        .filter_map(|(_, reset)| *reset)
        .max();
    let secs = spent
        .or_else(|| limits.iter().filter_map(|(_, reset)| *reset).max())
        .unwrap_or(1);
    Duration::from_secs(secs).min(cap)
}

/// A client of one pipeline's REST API, with the retry policy above and one rate budget
/// shared by its clones.
#[derive(Clone)]
pub struct BuildkiteClient {
    http: reqwest::Client,
    /// For the blob store (no `Authorization`, no redirects, a stall timeout).
    blob_http: reqwest::Client,
    base: String,
    builds_path: String,
    token: Secret,
    retry: RetryPolicy,
    max_artifact_bytes: u64,
    /// Hosts the artifact download may redirect to besides public https ones
    /// (`KERNELKITE_ARTIFACT_HOSTS`).
    artifact_hosts: Vec<String>,
    http_timeout: Duration,
    blob_stall: Duration,
    budget: Arc<RateBudget>,
    metrics: Option<Arc<Metrics>>,
    /// Asked right before each create is sent: whether this process still holds the store
    /// ([`BuildkiteClient::acting_while`]).
    acting: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
}

impl std::fmt::Debug for BuildkiteClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BuildkiteClient")
            .field("base", &self.base)
            .field("token", &self.token)
            .finish()
    }
}

impl BuildkiteClient {
    /// A client for the configured organization and pipeline.
    pub fn new(cfg: &Config) -> Result<BuildkiteClient, reqwest::Error> {
        let http = reqwest::Client::builder()
            // Redirects are followed by hand: the blob store must not see the API token.
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(5).min(cfg.buildkite.http_timeout()))
            .timeout(cfg.buildkite.http_timeout())
            .pool_idle_timeout(Duration::from_secs(60))
            .build()?;
        let blob_stall = Duration::from_secs(cfg.buildkite.blob_stall_s.max(1));
        let blob_http = blob_client(cfg.buildkite.http_timeout(), blob_stall, None)?;
        Ok(BuildkiteClient {
            blob_http,
            http,
            base: cfg
                .buildkite
                .buildkite_api_url
                .trim_end_matches('/')
                .to_string(),
            builds_path: format!(
                "/organizations/{}/pipelines/{}/builds",
                cfg.buildkite.buildkite_org, cfg.buildkite.buildkite_pipeline
            ),
            token: cfg.buildkite.buildkite_api_token.clone(),
            retry: RetryPolicy {
                attempts: cfg.buildkite.retry_attempts.max(1),
                base: Duration::from_millis(cfg.retry_base_ms),
                max_backoff: Duration::from_secs(30),
                max_rate_limit_wait: Duration::from_secs(cfg.buildkite.rate_limit_max_wait_s),
            },
            max_artifact_bytes: cfg.max_artifact_bytes,
            artifact_hosts: cfg.buildkite.artifact_hosts.clone(),
            http_timeout: cfg.buildkite.http_timeout(),
            blob_stall,
            budget: Arc::new(RateBudget::new(Duration::from_secs(
                cfg.buildkite.rate_limit_max_wait_s.max(1),
            ))),
            metrics: None,
            acting: None,
        })
    }

    /// Sends no create unless `acting` says this process still holds the store, asked right
    /// before each send: a process frozen (or waiting out the rate budget) between the core's
    /// own check and the send would otherwise create a build the store's new holder has
    /// created too.
    pub fn acting_while(mut self, acting: Arc<dyn Fn() -> bool + Send + Sync>) -> BuildkiteClient {
        self.acting = Some(acting);
        self
    }

    /// Counts calls and 429s in `metrics` (`buildkite_calls`, `buildkite_rate_limited`).
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> BuildkiteClient {
        self.metrics = Some(metrics);
        self
    }

    /// The rate budget every call of this client (and its clones) spends.
    pub fn budget(&self) -> &RateBudget {
        &self.budget
    }

    /// How this client backs off between tries (the create-build loop uses it too).
    pub fn retry_policy(&self) -> &RetryPolicy {
        &self.retry
    }

    /// The API's base URL (BUILDKITE_API_URL, no trailing `/`): the token goes only below it.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// The HTTP client every call of this client (and its clones) goes through: no redirect
    /// followed, KERNELKITE_HTTP_TIMEOUT_S. Other Buildkite calls (the agent API) share it.
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// `GET <base><path_and_query>` with the API token, once: it spends the shared rate
    /// budget at `priority` and is counted as `name`, but is not retried (a caller whose
    /// answer can wait for its next interval, queue status, keeps its last one instead).
    pub async fn get_once(
        &self,
        name: &'static str,
        priority: Priority,
        path_and_query: &str,
    ) -> Result<reqwest::Response, reqwest::Error> {
        self.budget.acquire(priority).await;
        let label = CallLabel {
            call: name.to_string(),
        };
        let req = self
            .http
            .get(format!("{}{path_and_query}", self.base))
            .bearer_auth(self.token.expose());
        self.send_counted(req, &label).await
    }

    /// Sends one request, counted as `label`; its answer feeds the shared rate budget (and a
    /// `429` the rate-limited count). Every call to Buildkite's REST API goes through here.
    async fn send_counted(
        &self,
        req: reqwest::RequestBuilder,
        label: &CallLabel,
    ) -> Result<reqwest::Response, reqwest::Error> {
        if let Some(m) = &self.metrics {
            m.buildkite_calls.get_or_create(label).inc();
        }
        let sent = req.send().await;
        if let Ok(resp) = &sent {
            let limited = resp.status() == StatusCode::TOO_MANY_REQUESTS;
            self.budget.observe(resp.headers(), limited, Instant::now());
            if limited {
                if let Some(m) = &self.metrics {
                    m.buildkite_rate_limited.get_or_create(label).inc();
                }
            }
        }
        sent
    }

    /// `POST .../builds`: creates a build. Never repeated once the request may have arrived
    /// (a timeout, a broken connection, a 5xx): the caller looks the build up first. A `429`
    /// is waited out as long as it takes; a refused connection is retried.
    pub async fn create_build(&self, build: &NewBuild) -> Result<Build, BuildkiteError> {
        let path = self.builds_path.clone();
        let body = serde_json::to_vec(build).map_err(|source| BuildkiteError::Encode {
            method: Method::POST,
            path: path.clone(),
            source,
        })?;
        let resp = self
            .send(
                Call::new("create_build", Priority::Create),
                Method::POST,
                &path,
                &[],
                Some(body),
            )
            .await?;
        decode(Method::POST, &path, resp).await
    }

    /// `GET .../builds/{number}`.
    pub async fn get_build(&self, number: u64) -> Result<Build, BuildkiteError> {
        let path = format!("{}/{number}", self.builds_path);
        let resp = self
            .send(
                Call::new("get_build", Priority::Result),
                Method::GET,
                &path,
                &[],
                None,
            )
            .await?;
        decode(Method::GET, &path, resp).await
    }

    /// `PUT .../builds/{number}/cancel`. A finished build answers `422`.
    pub async fn cancel_build(&self, number: u64) -> Result<Build, BuildkiteError> {
        let path = format!("{}/{number}/cancel", self.builds_path);
        let resp = self
            .send(
                Call::new("cancel_build", Priority::Result),
                Method::PUT,
                &path,
                &[],
                None,
            )
            .await?;
        decode(Method::PUT, &path, resp).await
    }

    /// The connected agents of `org` named exactly `name` (`GET /organizations/{org}/agents
    /// ?name=`, which matches names loosely: the exact ones are kept; a name is its node's to
    /// choose, so there may be two), none when none is connected. Queue status's priority:
    /// pauses wait behind builds and results.
    pub async fn find_agents(
        &self,
        org: &str,
        name: &str,
    ) -> Result<Vec<AgentRef>, BuildkiteError> {
        let path = format!("/organizations/{org}/agents");
        let resp = self
            .send(
                Call::new("find_agent", Priority::Reconcile),
                Method::GET,
                &path,
                &[("name", name), ("per_page", "100")],
                None,
            )
            .await?;
        let agents: Vec<AgentRef> = decode(Method::GET, &path, resp).await?;
        Ok(agents
            .into_iter()
            .filter(|a| {
                a.name == name
                    && a.connection_state
                        .as_deref()
                        .is_none_or(|s| s == "connected")
            })
            .collect())
    }

    /// `PUT /organizations/{org}/agents/{id}/pause` with `note` and `minutes` (1 to 10,080):
    /// Buildkite dispatches no job to the agent until it is resumed or the time is up.
    pub async fn pause_agent(
        &self,
        org: &str,
        id: &str,
        note: &str,
        minutes: u32,
    ) -> Result<(), BuildkiteError> {
        let path = format!("/organizations/{org}/agents/{id}/pause");
        let body = serde_json::to_vec(&serde_json::json!({
            "note": note,
            "timeout_in_minutes": minutes,
        }))
        .map_err(|source| BuildkiteError::Encode {
            method: Method::PUT,
            path: path.clone(),
            source,
        })?;
        self.send(
            Call::new("pause_agent", Priority::Reconcile),
            Method::PUT,
            &path,
            &[],
            Some(body),
        )
        .await?;
        Ok(())
    }

    /// `PUT /organizations/{org}/agents/{id}/resume`.
    pub async fn resume_agent(&self, org: &str, id: &str) -> Result<(), BuildkiteError> {
        let path = format!("/organizations/{org}/agents/{id}/resume");
        self.send(
            Call::new("resume_agent", Priority::Reconcile),
            Method::PUT,
            &path,
            &[],
            Some(b"{}".to_vec()),
        )
        .await?;
        Ok(())
    }

    /// `GET .../builds` with `filter`, without jobs or pipeline, 100 per page, every page
    /// (following the `Link: <...>; rel="next"` header), at most `max_pages`. Returns the
    /// builds and whether the listing was complete.
    pub async fn list_builds(
        &self,
        filter: &BuildFilter,
        priority: Priority,
        max_pages: u32,
    ) -> Result<(Vec<Build>, bool), BuildkiteError> {
        let iso = |t: &chrono::DateTime<chrono::Utc>| {
            t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        };
        let mut query: Vec<(String, String)> = filter
            .states
            .iter()
            .map(|s| ("state[]".to_string(), s.to_string()))
            .collect();
        if let Some(t) = &filter.created_from {
            query.push(("created_from".into(), iso(t)));
        }
        if let Some(t) = &filter.finished_from {
            query.push(("finished_from".into(), iso(t)));
        }
        if let Some((k, v)) = &filter.meta_data {
            query.push((format!("meta_data[{k}]"), v.clone()));
        }
        query.push(("exclude_jobs".into(), "true".into()));
        query.push(("exclude_pipeline".into(), "true".into()));
        query.push(("per_page".into(), "100".into()));
        let path = self.builds_path.clone();
        let mut out = Vec::new();
        for page in 1..=max_pages.max(1) {
            let mut q: Vec<(&str, &str)> = query
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let page_s = page.to_string();
            if page > 1 {
                q.push(("page", &page_s));
            }
            let resp = self
                .send(
                    Call::new("list_builds", priority),
                    Method::GET,
                    &path,
                    &q,
                    None,
                )
                .await?;
            let more = next_link(resp.headers()).is_some();
            let builds: Vec<Build> = decode(Method::GET, &path, resp).await?;
            let short = builds.len() < 100;
            out.extend(builds);
            if !more || short {
                return Ok((out, true));
            }
        }
        Ok((out, false))
    }

    /// The builds carrying `meta_data[kernelkite_submission_id]=submission_id`, lowest
    /// number first.
    pub async fn builds_of_submission(
        &self,
        submission_id: &str,
    ) -> Result<Vec<Build>, BuildkiteError> {
        let filter = BuildFilter {
            meta_data: Some((SUBMISSION_META_KEY.to_string(), submission_id.to_string())),
            ..BuildFilter::default()
        };
        let (mut builds, _) = self.list_builds(&filter, Priority::Create, 1).await?;
        builds.retain(|b| b.submission_id() == Some(submission_id));
        builds.sort_by_key(|b| b.number);
        Ok(builds)
    }

    /// A build's artifacts, every job's.
    pub async fn list_artifacts(&self, number: u64) -> Result<Vec<Artifact>, BuildkiteError> {
        let p = format!("{}/{number}/artifacts", self.builds_path);
        // Unfiltered: the result and its provenance in one call. A job uploads what its step's
        // artifact_paths name (two files), so one page holds a build's (Buildkite's default
        // page is 30 artifacts; retries add two each).
        let resp = self
            .send(
                Call::new("list_artifacts", Priority::Result),
                Method::GET,
                &p,
                &[("per_page", "100")],
                None,
            )
            .await?;
        decode(Method::GET, &p, resp).await
    }

    /// Downloads an artifact: the API answers 302 to the blob store, which is fetched
    /// without the Authorization header. At most `max_artifact_bytes` are read.
    pub async fn download(&self, download_url: &str) -> Result<bytes::Bytes, BuildkiteError> {
        let Some(path) = download_url
            .strip_prefix(&self.base)
            .filter(|p| p.starts_with('/'))
        else {
            return Err(BuildkiteError::ForeignDownloadUrl(download_url.to_string()));
        };
        let path = path.to_string();
        let resp = self
            .send(
                Call::new("download", Priority::Result),
                Method::GET,
                &path,
                &[],
                None,
            )
            .await?;
        let resp = if resp.status().is_redirection() {
            let status = resp.status();
            let location = resp
                .headers()
                .get(reqwest::header::LOCATION)
                .and_then(|v| v.to_str().ok())
                .ok_or(BuildkiteError::NoRedirect(status))?;
            let blob = Url::parse(download_url)
                .and_then(|u| u.join(location))
                .map_err(|_| BuildkiteError::NoRedirect(status))?;
            self.fetch_blob(blob).await?
        } else {
            resp
        };
        read_capped(resp, self.max_artifact_bytes).await
    }

    /// Where a download's redirect may lead, and the address to connect to: the API's own
    /// origin (its host serves the blobs, as the fake Buildkite does); a host the operator
    /// listed in `KERNELKITE_ARTIFACT_HOSTS`; else only https on a public address (resolved
    /// here and pinned for the request, so a name cannot turn private between the check and
    /// the connection). Anything else (another scheme, loopback, a private or link-local
    /// address) is refused, once and for good.
    async fn blob_target(&self, url: &Url) -> Result<Option<std::net::SocketAddr>, BuildkiteError> {
        let shown = {
            let mut u = url.clone();
            u.set_query(None);
            u.to_string()
        };
        let refuse = |why: &str| BuildkiteError::ForbiddenBlob {
            url: shown.clone(),
            why: why.to_string(),
        };
        if !matches!(url.scheme(), "http" | "https") {
            return Err(refuse("not http(s)"));
        }
        let api = Url::parse(&self.base).map_err(|_| refuse("the API URL does not parse"))?;
        if url.origin() == api.origin() {
            return Ok(None);
        }
        let host = url.host_str().ok_or_else(|| refuse("no host"))?;
        if self
            .artifact_hosts
            .iter()
            .any(|h| h.eq_ignore_ascii_case(host))
        {
            return Ok(None);
        }
        if url.scheme() != "https" {
            return Err(refuse("not https"));
        }
        let port = url.port_or_known_default().unwrap_or(443);
        let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host((host, port))
            .await
            .map_err(|e| BuildkiteError::Transport {
                method: Method::GET,
                path: url.path().to_string(),
                source: TransportError::Resolve(e.to_string()),
            })?
            .collect();
        match addrs.iter().find(|a| !public_ip(a.ip())) {
            Some(a) => Err(refuse(&format!("{} is not a public address", a.ip()))),
            None => Ok(addrs.first().copied()),
        }
    }

    async fn fetch_blob(&self, url: Url) -> Result<reqwest::Response, BuildkiteError> {
        let path = url.path().to_string();
        let pinned = self.blob_target(&url).await?;
        // Pinned to the address checked above; no redirect is followed from the blob store.
        let http = match (pinned, url.host_str()) {
            (Some(addr), Some(host)) => {
                blob_client(self.http_timeout, self.blob_stall, Some((host, addr))).map_err(
                    |e| BuildkiteError::Transport {
                        method: Method::GET,
                        path: path.clone(),
                        source: TransportError::Resolve(e.to_string()),
                    },
                )?
            }
            _ => self.blob_http.clone(),
        };
        // One try: a failure is transient for the caller, whose retries wait without holding
        // a fetch slot (a stalled blob store must not keep one through every backoff).
        // A plain request: no Authorization header reaches the blob store.
        match http.get(url.clone()).send().await {
            Ok(resp) if resp.status().is_success() => Ok(resp),
            // The body is not read: it is the blob store's (or whoever's), not ours to
            // repeat in a submission.
            Ok(resp) => Err(BuildkiteError::Blob {
                status: resp.status(),
            }),
            Err(e) => Err(BuildkiteError::Transport {
                method: Method::GET,
                path,
                source: TransportError::from_http(e),
            }),
        }
    }

    /// An authenticated API request. `path` is below the base URL; `query` is encoded by
    /// reqwest (form encoding, so a `&` or a space in a value cannot split it).
    fn request(&self, method: Method, path: &str, query: &[(&str, &str)]) -> RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.base))
            .query(query)
            .bearer_auth(self.token.expose())
    }

    /// Sends one API request with retries, spending the rate budget.
    async fn send(
        &self,
        call: Call,
        method: Method,
        path: &str,
        query: &[(&str, &str)],
        body: Option<Vec<u8>>,
    ) -> Result<reqwest::Response, BuildkiteError> {
        let mut tries = Tries {
            // A new build waits for the budget as long as it takes (its submission stays
            // queued and its own timeout ends the wait); other calls give up eventually.
            unbounded_rate_limit: call.priority == Priority::Create && method == Method::POST,
            ..Tries::default()
        };
        let label = CallLabel {
            call: call.name.to_string(),
        };
        loop {
            let waited = self.budget.acquire(call.priority).await;
            if waited > Duration::from_millis(50) {
                tracing::info!(
                    call = call.name,
                    ?waited,
                    "waited for the Buildkite rate budget"
                );
            }
            if method == Method::POST && self.acting.as_ref().is_some_and(|a| !a()) {
                return Err(BuildkiteError::NotActing);
            }
            let mut req = self.request(method.clone(), path, query);
            if let Some(b) = &body {
                req = req
                    .header(reqwest::header::CONTENT_TYPE, "application/json")
                    .body(b.clone());
            }
            let sent = self.send_counted(req, &label).await;
            // Only POST (create build) is unsafe to repeat after a request may have arrived:
            // its timeouts, broken connections and 5xx go back to the caller, which looks for
            // the build before creating another.
            let idempotent = method != Method::POST;
            match classify(sent, idempotent, &mut tries, &self.retry) {
                Next::Done(resp) => {
                    if resp.status().is_success() || resp.status().is_redirection() {
                        return Ok(resp);
                    }
                    return Err(status_error(method, path, resp).await);
                }
                Next::Fail(e) => return Err(transport(method, path, e)),
                Next::Retry(wait) => {
                    tracing::debug!(%method, path, failures = tries.failures, rate_limited = tries.rate_limited, ?wait, "retrying Buildkite call");
                    tokio::time::sleep(wait).await
                }
            }
        }
    }
}

/// An agent as the REST API shows it, for pausing and resuming it.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct AgentRef {
    /// Its id (the path's).
    pub id: String,
    /// Its name.
    pub name: String,
    /// `connected`, `disconnected`, ...
    #[serde(default)]
    pub connection_state: Option<String>,
    /// Paused now.
    #[serde(default)]
    pub paused: Option<bool>,
    /// Why it was paused.
    #[serde(default)]
    pub paused_note: Option<String>,
}

/// Which call, for metrics, and how urgent it is, for the budget.
#[derive(Debug, Clone, Copy)]
struct Call {
    name: &'static str,
    priority: Priority,
}

impl Call {
    fn new(name: &'static str, priority: Priority) -> Call {
        Call { name, priority }
    }
}

/// The `rel="next"` URL of a response's `Link` header, when it names one: how every paged
/// Buildkite listing (builds, agents) knows another page follows.
pub fn next_link(headers: &reqwest::header::HeaderMap) -> Option<&str> {
    headers
        .get_all(reqwest::header::LINK)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find_map(next_in)
}

/// The `rel="next"` URL of one `Link` header value.
fn next_in(link: &str) -> Option<&str> {
    link.split(',').find_map(|part| {
        let (url, params) = part.split_once(';')?;
        let is_next = params
            .split(';')
            .any(|p| matches!(p.trim(), "rel=\"next\"" | "rel=next"));
        let url = url.trim().strip_prefix('<')?.strip_suffix('>')?;
        is_next.then_some(url)
    })
}

enum Next {
    Done(reqwest::Response),
    Retry(Duration),
    Fail(Failure),
}

enum Failure {
    Transport(reqwest::Error),
    Exhausted(StatusCode),
}

/// Counts tries of one call: failures (connect errors, 5xx) and rate-limit waits separately,
/// because a 429 says nothing about Buildkite's health, only that the budget is spent.
#[derive(Default)]
struct Tries {
    failures: u32,
    rate_limited: u32,
    unbounded_rate_limit: bool,
}

/// Most `429` waits per call. With Buildkite's 60 s windows this rides out a half-hour
/// backlog; a submission's own timeout usually ends the wait first.
pub const MAX_RATE_LIMITED_RETRIES: u32 = 30;

fn classify(
    r: Result<reqwest::Response, reqwest::Error>,
    idempotent: bool,
    tries: &mut Tries,
    retry: &RetryPolicy,
) -> Next {
    match r {
        Ok(resp) if resp.status() == StatusCode::TOO_MANY_REQUESTS => {
            tries.rate_limited += 1;
            if tries.rate_limited > MAX_RATE_LIMITED_RETRIES && !tries.unbounded_rate_limit {
                return Next::Fail(Failure::Exhausted(resp.status()));
            }
            let wait = rate_limit_wait(resp.headers(), retry.max_rate_limit_wait);
            tracing::warn!(
                ?wait,
                "Buildkite rate limit reached (429); waiting for RateLimit-Reset"
            );
            // The budget has taken the answer in: the next acquire waits for the reset.
            Next::Retry(Duration::ZERO)
        }
        // A 5xx to create-build may still have created the build: not repeated here.
        Ok(resp) if resp.status().is_server_error() && !idempotent => Next::Done(resp),
        Ok(resp) if resp.status().is_server_error() => {
            tries.failures += 1;
            if tries.failures >= retry.attempts {
                Next::Done(resp)
            } else {
                Next::Retry(retry.backoff(tries.failures))
            }
        }
        Ok(resp) => Next::Done(resp),
        // Connect errors never reached Buildkite, so a retry cannot duplicate a build. A
        // timeout or a dropped connection may have: it is retried only where repeating is
        // harmless (GET, PUT cancel, the blob), so a network blip while fetching a finished
        // build's result.json does not fail the submission.
        Err(e)
            if e.is_connect()
                || (idempotent && (e.is_timeout() || e.is_request() || e.is_body())) =>
        {
            tries.failures += 1;
            if tries.failures >= retry.attempts {
                Next::Fail(Failure::Transport(e))
            } else {
                Next::Retry(retry.backoff(tries.failures))
            }
        }
        Err(e) => Next::Fail(Failure::Transport(e)),
    }
}

fn transport(method: Method, path: &str, f: Failure) -> BuildkiteError {
    let source = match f {
        Failure::Transport(e) => TransportError::from_http(e),
        Failure::Exhausted(s) => TransportError::Exhausted(s),
    };
    BuildkiteError::Transport {
        method,
        path: path.to_string(),
        source,
    }
}

/// A client for the blob store: no redirect followed, and a read that stalls for `stall` ends
/// the attempt; `pin` connects a host name to the address checked for it.
fn blob_client(
    timeout: Duration,
    stall: Duration,
    pin: Option<(&str, std::net::SocketAddr)>,
) -> Result<reqwest::Client, reqwest::Error> {
    let b = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(Duration::from_secs(5).min(timeout))
        .read_timeout(stall)
        .timeout(timeout);
    match pin {
        Some((host, addr)) => b.resolve(host, addr),
        None => b,
    }
    .build()
}

/// Whether `ip` is a public address (not loopback, private, link-local, unspecified,
/// multicast, shared or documentation space, nor an IPv4-mapped one of those).
fn public_ip(ip: std::net::IpAddr) -> bool {
    match ip {
        std::net::IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b)))
        }
        std::net::IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return public_ip(std::net::IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80)
        }
    }
}

async fn status_error(method: Method, path: &str, resp: reqwest::Response) -> BuildkiteError {
    let status = resp.status();
    // Buildkite explains errors as {"message": "..."}; keep only that, never echo bodies.
    let message = match resp.bytes().await {
        Ok(b) => serde_json::from_slice::<serde_json::Value>(&b)
            .ok()
            .and_then(|v| {
                v.get("message")
                    .and_then(|m| m.as_str())
                    .map(|m| m.chars().take(300).collect())
            })
            .unwrap_or_else(|| "no message".to_string()),
        Err(_) => "no message".to_string(),
    };
    BuildkiteError::Status {
        method,
        path: path.to_string(),
        status,
        message,
    }
}

async fn decode<T: serde::de::DeserializeOwned>(
    method: Method,
    path: &str,
    resp: reqwest::Response,
) -> Result<T, BuildkiteError> {
    let bytes = resp.bytes().await.map_err(|e| BuildkiteError::Transport {
        method: method.clone(),
        path: path.to_string(),
        source: TransportError::from_http(e),
    })?;
    serde_json::from_slice(&bytes).map_err(|source| BuildkiteError::Decode {
        method,
        path: path.to_string(),
        source,
    })
}

async fn read_capped(
    mut resp: reqwest::Response,
    cap: u64,
) -> Result<bytes::Bytes, BuildkiteError> {
    if resp.content_length().is_some_and(|n| n > cap) {
        return Err(BuildkiteError::TooLarge(cap));
    }
    let mut out = bytes::BytesMut::new();
    loop {
        match resp.chunk().await {
            Ok(Some(c)) => {
                if out.len() as u64 + c.len() as u64 > cap {
                    return Err(BuildkiteError::TooLarge(cap));
                }
                out.extend_from_slice(&c);
            }
            Ok(None) => return Ok(out.freeze()),
            Err(e) => {
                return Err(BuildkiteError::Transport {
                    method: Method::GET,
                    path: "artifact blob".into(),
                    source: TransportError::from_http(e),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_link_reads_rel_next_only() {
        let h = r#"<https://api.buildkite.com/v2/organizations/o/agents?page=2&per_page=100>; rel="next", <https://api.buildkite.com/v2/organizations/o/agents?page=9&per_page=100>; rel="last""#;
        assert_eq!(
            next_in(h),
            Some("https://api.buildkite.com/v2/organizations/o/agents?page=2&per_page=100")
        );
        let last_page =
            r#"<https://x/v2/a?page=1>; rel="first", <https://x/v2/a?page=8>; rel="prev""#;
        assert_eq!(next_in(last_page), None);
        assert_eq!(next_in(""), None);
        assert_eq!(next_in("garbage; rel=\"next\""), None);
        let mut headers = reqwest::header::HeaderMap::new();
        headers.append(
            reqwest::header::LINK,
            "<https://x/v2/a?page=1>; rel=\"prev\"".parse().unwrap(),
        );
        headers.append(
            reqwest::header::LINK,
            "<https://x/v2/a?page=3>; rel=\"next\"".parse().unwrap(),
        );
        assert_eq!(next_link(&headers), Some("https://x/v2/a?page=3"));
    }

    #[test]
    fn only_public_addresses_are_public() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
        ] {
            assert!(!public_ip(private.parse().unwrap()), "{private}");
        }
        for public in ["52.217.1.1", "2600:1f18::1", "8.8.8.8"] {
            assert!(public_ip(public.parse().unwrap()), "{public}");
        }
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        let p = RetryPolicy {
            attempts: 5,
            base: Duration::from_millis(100),
            max_backoff: Duration::from_millis(500),
            max_rate_limit_wait: Duration::from_secs(1),
        };
        assert!(
            p.backoff(1) >= Duration::from_millis(75) && p.backoff(1) <= Duration::from_millis(125)
        );
        assert!(p.backoff(3) >= Duration::from_millis(300));
        assert!(p.backoff(30) <= Duration::from_millis(625));
    }

    #[test]
    fn rate_limit_reset_is_read_and_capped() {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert("RateLimit-Reset", "7".parse().unwrap());
        assert_eq!(
            rate_limit_wait(&h, Duration::from_secs(60)),
            Duration::from_secs(7)
        );
        assert_eq!(
            rate_limit_wait(&h, Duration::from_secs(2)),
            Duration::from_secs(2)
        );
        h.insert("RateLimit-Reset", "soon".parse().unwrap());
        assert_eq!(
            rate_limit_wait(&h, Duration::from_secs(60)),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn rate_limit_wait_follows_the_spent_limit() {
        let headers = |pairs: &[(&'static str, &str)]| {
            let mut h = reqwest::header::HeaderMap::new();
            for (k, v) in pairs {
                h.insert(*k, v.parse().unwrap());
            }
            h
        };
        let cap = Duration::from_secs(60);
        // The token's 50/min is spent, the organization has room: wait for the token's window.
        let user_spent = headers(&[
            ("RateLimit-Remaining", "150"),
            ("RateLimit-Reset", "5"),
            ("RateLimit-User-Remaining", "0"),
            ("RateLimit-User-Reset", "40"),
        ]);
        assert_eq!(rate_limit_wait(&user_spent, cap), Duration::from_secs(40));
        // The organization's limit is spent: its reset decides, even if the token's is later.
        let org_spent = headers(&[
            ("RateLimit-Remaining", "0"),
            ("RateLimit-Reset", "7"),
            ("RateLimit-User-Remaining", "30"),
            ("RateLimit-User-Reset", "40"),
        ]);
        assert_eq!(rate_limit_wait(&org_spent, cap), Duration::from_secs(7));
        // Neither says which: the later reset, never an early retry.
        let unknown = headers(&[("RateLimit-Reset", "3"), ("RateLimit-User-Reset", "9")]);
        assert_eq!(rate_limit_wait(&unknown, cap), Duration::from_secs(9));
        assert_eq!(
            rate_limit_wait(&user_spent, Duration::from_secs(10)),
            Duration::from_secs(10)
        );
    }

    #[tokio::test]
    async fn the_token_only_goes_to_download_urls_below_the_api_base() {
        // A base URL without a path, so only the '/' check stops a look-alike host.
        let cfg = Config::new("http://127.0.0.1:9", "org", "pipe", "t");
        let client = BuildkiteClient::new(&cfg).unwrap();
        for foreign in [
            "http://127.0.0.1:9.evil.example/artifacts/1/download",
            "http://127.0.0.1:9@evil.example/artifacts/1/download",
            "https://evil.example/v2/artifacts/1/download",
            "",
        ] {
            assert!(
                matches!(
                    client.download(foreign).await,
                    Err(BuildkiteError::ForeignDownloadUrl(_))
                ),
                "{foreign}"
            );
        }
    }

    #[test]
    fn query_values_are_encoded() {
        let cfg = Config::new("http://127.0.0.1:9/v2", "org", "pipe", "t");
        let client = BuildkiteClient::new(&cfg).unwrap();
        let url = |value: &str| {
            let req = client.request(Method::GET, "/x", &[("path", value)]);
            req.build().unwrap().url().clone()
        };
        assert_eq!(url("result.json").query(), Some("path=result.json"));
        // Form encoding: a space is `+`, and a `&` cannot split the value.
        let odd = url("a b&c");
        assert_eq!(odd.query(), Some("path=a+b%26c"));
        let pairs: Vec<(String, String)> = odd.query_pairs().into_owned().collect();
        assert_eq!(pairs, [("path".to_string(), "a b&c".to_string())]);
    }
}
