//! What can go wrong with a request, as the core says it: one enum of kinds (not found, bad
//! request, invalid submission, conflict, too large, unauthorized, forbidden, internal), each
//! carrying its cause. The core never picks an HTTP status; `http::error` maps each kind to
//! one, in one place.
//!
//! Causes are kept as [`std::error::Error::source`], not folded into the message;
//! [`crate::report::report`] writes a message with its causes for a person to read.

use kernelkite_kernelbot::config::ConfigError;
use kernelkite_kernelbot::payload::PayloadError;

use crate::report::BoxError;
use crate::submission::State;

/// Why a request was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No submission has this id, in memory or in the data dir.
    #[error("no submission {id}")]
    NotFound {
        /// The id asked for.
        id: String,
    },
    /// No slice has this id in the fleet.
    #[error(transparent)]
    UnknownSlice(#[from] crate::fleet::UnknownSlice),
    /// The request cannot be read at all (not JSON, a bad query string, a webhook body that
    /// is not an event).
    #[error(transparent)]
    BadRequest(#[from] BadRequest),
    /// The request was read but is refused: a field or the run config is not acceptable.
    #[error(transparent)]
    Invalid(#[from] Invalid),
    /// The submission already ended, in a state the request cannot change.
    #[error("submission already ended: {}", .state.as_str())]
    Conflict {
        /// The state it ended in.
        state: State,
    },
    /// The body is over its limit.
    #[error("request body is over the {limit} bytes allowed; send less, or raise {setting}")]
    PayloadTooLarge {
        /// The limit, bytes.
        limit: usize,
        /// The setting that raises it.
        setting: &'static str,
    },
    /// Credentials are missing or wrong.
    #[error(transparent)]
    Unauthorized(#[from] Unauthorized),
    /// No credentials would help: the client is not allowed here.
    #[error("KERNELKITE_API_TOKEN is not set, so only loopback clients are served")]
    Forbidden,
    /// An `Idempotency-Key` that made a submission from a different request.
    #[error("Idempotency-Key {key:?} was already used for a different request; send the same request to get its submission, or use a new key for a new submission")]
    KeyReused {
        /// The key.
        key: String,
    },
    /// The service failed on its side; the request may be retried.
    #[error("{what} failed; retry")]
    Internal {
        /// What failed.
        what: &'static str,
        /// Why.
        #[source]
        source: BoxError,
    },
    /// The service cannot take the request now; the same request may be retried later.
    #[error(transparent)]
    Unavailable(#[from] Unavailable),
    /// A per-user quota: the user has too many submissions queued, or sent too many this hour.
    #[error(transparent)]
    OverQuota(#[from] crate::dispatch::OverQuota),
    /// The request's body did not arrive in time.
    #[error("request body did not arrive within {seconds} s; send it faster, or raise {setting}")]
    RequestTimeout {
        /// The limit, seconds.
        seconds: u64,
        /// The setting that raises it.
        setting: &'static str,
    },
}

/// Why the service cannot take a request now. Each is temporary: retry later.
#[derive(Debug, thiserror::Error)]
pub enum Unavailable {
    /// SIGTERM/SIGINT: the service is draining before it exits.
    #[error("the service is shutting down; retry in a moment (on another instance, or this one once restarted)")]
    ShuttingDown,
    /// Unverified webhook bodies already hold all the memory allowed for them.
    #[error("too many unverified request bodies are being read; retry in a moment (the bound is KERNELKITE_UNAUTHENTICATED_BODY_BUDGET_BYTES)")]
    BodyBudget,
    /// The store cannot write; nothing was kept.
    #[error("{what}; nothing was kept, retry later")]
    Store {
        /// What could not be done.
        what: &'static str,
        /// Why.
        #[source]
        source: BoxError,
    },
    /// A replica could not get the request answered by the replica that runs the queue
    /// (`KERNELKITE_REPLICA`); the message says what happened and that a retry is safe.
    #[error("{0}")]
    Relay(&'static str),
    /// Every connection is busy (KERNELKITE_MAX_CONNECTIONS).
    #[error(
        "every connection is busy; retry in a moment (the bound is KERNELKITE_MAX_CONNECTIONS)"
    )]
    Connections,
}

/// A request that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum BadRequest {
    /// The submission body is not JSON.
    #[error("request body is not a submission")]
    NotJson(#[source] serde_json::Error),
    /// The body could not be received.
    #[error("request body could not be read")]
    Body(#[source] BoxError),
    /// The query string does not parse.
    #[error("bad query (use ?wait=SECONDS)")]
    Query(#[source] BoxError),
    /// `?wait=` is negative or not finite.
    #[error("wait must be a non-negative number of seconds")]
    Wait,
    /// `Idempotency-Key` is empty, too long, or not printable ASCII.
    #[error("Idempotency-Key must be 1-255 printable ASCII characters")]
    IdempotencyKey,
    /// A verified webhook whose body is not an event.
    #[error(transparent)]
    Webhook(WebhookRefusal),
}

/// A submission that is read but refused; nothing is created for it.
#[derive(Debug, thiserror::Error)]
pub enum Invalid {
    /// A canary asked for where none run.
    #[error("canaries do not run on this service (KERNELKITE_CANARY is off)")]
    Canary,
    /// A canary for a slice whose agent no tag singles out where Buildkite dispatches.
    #[error("slice {0:?} cannot be pinned: its agent has no node and gpu-index tags (setup gives them to per-slice agents; a pool agent's slices are not canaried)")]
    Unpinnable(String),
    /// A quarantine's reason is empty or too long.
    #[error("a quarantine needs a reason of 1-500 characters: {{\"reason\": \"…\"}}")]
    Reason,
    /// The body is JSON but not a submission (a missing or unknown field, a wrong type).
    #[error("request body is not a submission")]
    Shape(#[source] serde_json::Error),
    /// `queue` has characters Buildkite's queue tags do not take, or the wrong length.
    #[error("queue {0:?} must be 1-64 letters, digits, '-', '_' or '.'")]
    Queue(String),
    /// `run_id` is empty, too long or has control characters.
    #[error("run_id must be 1-256 characters without control characters")]
    RunId,
    /// `user` is empty, too long or has control characters.
    #[error("user must be 1-128 characters without control characters")]
    User,
    /// `priority` is not a class.
    #[error("priority {0:?} must be admin, ranked or test")]
    Priority(String),
    /// `callback_url` is not an absolute http(s) URL.
    #[error("callback_url {url:?} must be an absolute http(s) URL")]
    CallbackUrl {
        /// The URL as given.
        url: String,
        /// Why it does not parse, when it does not.
        #[source]
        source: Option<url::ParseError>,
    },
    /// `callback_url` is given but the service has no key to sign callbacks with.
    #[error("callback_url needs KERNELKITE_CALLBACK_SECRET set on the service (callbacks are signed); leave callback_url out and long-poll or stream instead")]
    CallbackUnsigned,
    /// `callback_url` names a host outside KERNELKITE_CALLBACK_ALLOWED_HOSTS.
    #[error("callback_url host {0:?} is not in KERNELKITE_CALLBACK_ALLOWED_HOSTS")]
    CallbackHost(String),
    /// `timeout_s` is 0 or above the configured maximum.
    #[error("timeout_s must be in 1..={max} (KERNELKITE_MAX_TIMEOUT_S)")]
    Timeout {
        /// KERNELKITE_MAX_TIMEOUT_S.
        max: u64,
    },
    /// `config` is not a JSON object.
    #[error("config must be a JSON object (kernelbot's run config)")]
    ConfigNotObject,
    /// The runner would refuse the run config; the message is the runner's.
    #[error(transparent)]
    RunConfig(#[from] ConfigError),
    /// The config cannot be made into a payload.
    #[error("config cannot be encoded as a payload")]
    Payload(#[source] PayloadError),
}

/// Missing or wrong credentials.
#[derive(Debug, thiserror::Error)]
pub enum Unauthorized {
    /// `/v1` without the configured bearer token.
    #[error("missing or wrong bearer token (Authorization: Bearer <KERNELKITE_API_TOKEN>)")]
    BearerToken,
    /// A webhook that is not the executor's (Buildkite: not signed with its token).
    #[error(transparent)]
    Webhook(WebhookRefusal),
}

/// Why a webhook's verifier (the executor's, `kernelkite_service::buildkite::webhook`) refused a
/// delivery: its error, kept whole (it reads as that error, and its causes are that error's),
/// without the core's errors naming the executor's types.
#[derive(Debug)]
pub struct WebhookRefusal(BoxError);

impl WebhookRefusal {
    /// Wraps the verifier's error.
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> WebhookRefusal {
        WebhookRefusal(Box::new(e))
    }
}

impl std::fmt::Display for WebhookRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for WebhookRefusal {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}
