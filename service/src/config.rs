//! The service's configuration: flags, each with an environment fallback.
//!
//! [`Config`] holds what the core itself reads (the executor, submission timeouts, result
//! size, fetch concurrency, the reconciler's waits) and one group per part that reads the
//! rest: [`EdgeConfig`] (the HTTP edge), [`BuildkiteConfig`], [`StoreConfig`],
//! [`CallbackConfig`] and [`QueueSettings`]. The groups are flattened into one command line,
//! so every flag and variable keeps its name. What the core reads is handed to it as its own
//! plain settings ([`Config::core`], a `kernelkite_core::config::Config`), so the core never
//! depends on clap.
//!
//! Tokens are wrapped in [`Secret`], whose `Debug` and `Display` never show the value, so a
//! config printed in a log or a panic message leaks nothing.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// A token, held in a [`secrecy::SecretString`] (zeroed when dropped, read only through
/// [`Secret::expose`]). Printing it (Debug or Display) shows `<redacted>`, as every log line and
/// panic message that shows a config always has.
#[derive(Clone)]
pub struct Secret(secrecy::SecretString);

impl Secret {
    /// Wraps a token.
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(secrecy::SecretString::from(value.into()))
    }
    /// The token itself; call it only where the value goes on the wire or into a MAC.
    pub fn expose(&self) -> &str {
        use secrecy::ExposeSecret;
        self.0.expose_secret()
    }

    /// Compares `given` with the token in constant time. Both sides are MACed first, so
    /// neither the content nor the length leaks through timing.
    pub fn matches(&self, given: &[u8]) -> bool {
        use hmac::{Hmac, Mac};
        use subtle::ConstantTimeEq;
        let mac = |v: &[u8]| {
            Hmac::<sha2::Sha256>::new_from_slice(b"kernelkite secret compare")
                .map(|m| m.chain_update(v).finalize().into_bytes())
        };
        match (mac(given), mac(self.expose().as_bytes())) {
            (Ok(a), Ok(b)) => bool::from(a.as_slice().ct_eq(b.as_slice())),
            _ => false,
        }
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Secret, Self::Err> {
        Ok(Secret::new(s))
    }
}

/// Where the service listens unless told otherwise: loopback only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
/// Buildkite's REST API.
pub const DEFAULT_API_URL: &str = "https://api.buildkite.com/v2";
pub use kernelkite_core::config::{host_allowed, DEFAULT_MAX_ARTIFACT_BYTES};

/// A setting that cannot work. Each message names the variable to fix and how.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// BUILDKITE_API_URL does not parse.
    #[error("BUILDKITE_API_URL {url:?} is not a URL")]
    ApiUrl {
        /// The value.
        url: String,
        /// Why it does not parse.
        #[source]
        source: url::ParseError,
    },
    /// Both stores were asked for.
    #[error("KERNELKITE_DATA_DIR and KERNELKITE_DATABASE_URL are both set: the store is either a SQLite file in the data dir or PostgreSQL; unset one")]
    TwoStores,
    /// A standby without PostgreSQL: SQLite's file has one writer, on one machine.
    #[error("KERNELKITE_STANDBY needs the store in PostgreSQL (KERNELKITE_DATABASE_URL): a SQLite store is one service on one machine; unset KERNELKITE_STANDBY or set KERNELKITE_DATABASE_URL")]
    StandbyWithoutDatabase,
    /// The canary task cannot be read.
    #[error("the canary (KERNELKITE_CANARY_TASK) cannot be used: {0}")]
    Canary(String),
    /// KERNELKITE_ALERT_WEBHOOKS cannot be read.
    #[error("KERNELKITE_ALERT_WEBHOOKS: {0}")]
    AlertWebhooks(String),
    /// Thresholds that are not shares.
    #[error("KERNELKITE_CANARY_SLOWER_BY and KERNELKITE_CANARY_MAX_SPREAD are shares between 0 and 1 (0.05: 5%)")]
    CanaryLimits,
    /// An empty dashboard token would let anyone read the fleet.
    #[error("KERNELKITE_DASHBOARD_TOKEN is set but empty; set a token or unset it")]
    EmptyDashboardToken,
    /// A replica without PostgreSQL: replicas share their store.
    #[error("KERNELKITE_REPLICA needs the store in PostgreSQL (KERNELKITE_DATABASE_URL), which the replicas share; unset KERNELKITE_REPLICA or set KERNELKITE_DATABASE_URL")]
    ReplicaWithoutDatabase,
    /// The schema name would need quoting.
    #[error("KERNELKITE_DATABASE_SCHEMA {0:?} is not a plain schema name: use lower-case letters, digits and _ (not first), at most 63")]
    Schema(String),
    /// BUILDKITE_API_URL is not http(s).
    #[error("BUILDKITE_API_URL {0:?} must be http(s)")]
    ApiUrlScheme(String),
    /// An organization or pipeline slug with characters slugs do not have.
    #[error("{name} {value:?} must be a Buildkite slug (letters, digits, '-', '_')")]
    Slug {
        /// The variable.
        name: &'static str,
        /// The value.
        value: String,
    },
    /// A setting the core reads.
    #[error(transparent)]
    Core(#[from] kernelkite_core::config::ConfigError),
    /// BUILDKITE_API_TOKEN is empty.
    #[error("BUILDKITE_API_TOKEN is empty; create an API token with read_builds, write_builds and read_artifacts")]
    EmptyApiToken,
    /// BUILDKITE_WEBHOOK_TOKEN is set to the empty string.
    #[error("BUILDKITE_WEBHOOK_TOKEN is set but empty; set it to the webhook's token, or unset it to refuse every webhook")]
    EmptyWebhookToken,
    /// KERNELKITE_API_TOKEN is set to the empty string.
    #[error("KERNELKITE_API_TOKEN is set but empty; set a token (e.g. `openssl rand -hex 32`), or unset it to serve loopback clients only")]
    EmptyClientToken,
    /// KERNELKITE_RETRY_ATTEMPTS is 0.
    #[error("KERNELKITE_RETRY_ATTEMPTS must be at least 1")]
    NoRetryAttempts,
    /// A setting that is 0 where 0 makes the service useless.
    #[error("{0} must be at least 1 (0 would make {1})")]
    Zero(&'static str, &'static str),
    /// KERNELKITE_CALLBACK_SECRET is set to the empty string.
    #[error("KERNELKITE_CALLBACK_SECRET is set but empty; set a key (e.g. `openssl rand -hex 32`), or unset it to refuse callback_url")]
    EmptyCallbackSecret,
    /// A setting of the HTTP edge.
    #[error(transparent)]
    Edge(#[from] EdgeConfigError),
    /// A Buildkite setting the Buildkite executor needs is not set.
    #[error("{name} is not set; the Buildkite executor needs it (or run on this machine, without Buildkite: `kernelkite-service local`)")]
    MissingBuildkite {
        /// The variable.
        name: &'static str,
    },
}

/// Where submissions run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ExecutorKind {
    /// As Buildkite builds (REST API out, signed webhooks in); needs the BUILDKITE_* settings.
    #[default]
    Buildkite,
    /// On this machine, through the plugin's job hooks and the runner, one worker per planned
    /// slice; no Buildkite account (see `kernelkite-service local --help`).
    Local,
}

/// kernelkite-service: accepts kernelbot submissions, runs each as a Buildkite build, and answers
/// when Buildkite's signed `build.finished` webhook says the build is done.
#[derive(Clone, Debug, Parser)]
#[command(name = "kernelkite-service", version)]
pub struct Config {
    /// Where submissions run: `buildkite` (builds of BUILDKITE_PIPELINE) or `local` (on this
    /// machine; the BUILDKITE_* settings are then not needed).
    #[arg(
        long,
        env = "KERNELKITE_EXECUTOR",
        value_enum,
        default_value = "buildkite"
    )]
    pub executor: ExecutorKind,

    /// The HTTP edge.
    #[command(flatten)]
    pub edge: EdgeConfig,

    /// Buildkite.
    #[command(flatten)]
    pub buildkite: BuildkiteConfig,

    /// The store.
    #[command(flatten)]
    pub store: StoreConfig,

    /// Callbacks.
    #[command(flatten)]
    pub callbacks: CallbackConfig,

    /// Queue status (`GET /v1/queues/{queue}`): where agent counts come from, how often.
    #[command(flatten)]
    pub queues: QueueSettings,

    /// The service's queue: slots, quotas, estimates, the result cache.
    #[command(flatten)]
    pub fair: FairConfig,

    /// The fleet: canaries, quarantine, the dashboard, vendors' alerts.
    #[command(flatten)]
    pub fleet: FleetConfig,

    /// Timeout of a submission when the request names none, seconds. On expiry the submission
    /// becomes `timed_out` and its build is canceled.
    #[arg(long, env = "KERNELKITE_DEFAULT_TIMEOUT_S", default_value_t = 1800)]
    pub default_timeout_s: u64,

    /// Largest `timeout_s` a request may ask for, seconds.
    #[arg(long, env = "KERNELKITE_MAX_TIMEOUT_S", default_value_t = 86_400)]
    pub max_timeout_s: u64,

    /// Largest result.json accepted, bytes (a Buildkite artifact, or a local job's file).
    #[arg(long, env = "KERNELKITE_MAX_ARTIFACT_BYTES", default_value_t = DEFAULT_MAX_ARTIFACT_BYTES)]
    pub max_artifact_bytes: u64,

    /// First retry backoff, milliseconds; doubles per attempt (with jitter), capped at 30 s.
    #[arg(long, env = "KERNELKITE_RETRY_BASE_MS", default_value_t = 250)]
    pub retry_base_ms: u64,

    /// Artifact fetches running at once (the rest queue).
    #[arg(long, env = "KERNELKITE_FETCH_CONCURRENCY", default_value_t = 32)]
    pub fetch_concurrency: usize,

    /// A submission that has heard nothing from Buildkite this long (milliseconds) is
    /// checked by the reconciler; the wait doubles after each check that finds nothing.
    #[arg(long, env = "KERNELKITE_RECONCILE_MIN_MS", default_value_t = 30_000)]
    pub reconcile_min_ms: u64,

    /// The longest wait between checks of one submission, milliseconds.
    #[arg(long, env = "KERNELKITE_RECONCILE_MAX_MS", default_value_t = 300_000)]
    pub reconcile_max_ms: u64,
}

/// The HTTP edge: where it listens, who it serves, how large and slow requests may be, connections, shutdown. Checked by [`EdgeConfig::check`]; read by `crate::http`.
#[derive(Clone, Debug, clap::Args)]
pub struct EdgeConfig {
    /// Address to listen on (HTTP).
    #[arg(long, env = "KERNELKITE_LISTEN", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,

    /// Bearer token required on /v1/*. Unset: only loopback clients are served.
    #[arg(long, env = "KERNELKITE_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<Secret>,

    /// Public base URL of this service (e.g. `https://kite.example.org`); makes `status_url`
    /// absolute. Unset: `status_url` is a path.
    #[arg(long, env = "KERNELKITE_PUBLIC_URL")]
    pub public_url: Option<String>,

    /// Longest `?wait=` a long-poll may ask for, seconds (longer asks are cut to this).
    #[arg(long, env = "KERNELKITE_MAX_WAIT_S", default_value_t = 600)]
    pub max_wait_s: u64,

    /// Largest submission request body, bytes.
    #[arg(long, env = "KERNELKITE_MAX_SUBMISSION_BYTES", default_value_t = 16 << 20)]
    pub max_submission_bytes: usize,

    /// Largest webhook body, bytes. Buildkite's build object carries the build's env, which
    /// holds the payload, so this must exceed the largest submission's payload.
    #[arg(long, env = "KERNELKITE_WEBHOOK_MAX_BYTES", default_value_t = 16 << 20)]
    pub webhook_max_bytes: usize,

    /// A request's head must arrive complete within this many seconds of its first byte
    /// (slow-header clients are disconnected).
    #[arg(long, env = "KERNELKITE_HEADER_READ_TIMEOUT_S", default_value_t = 10)]
    pub header_read_timeout_s: u64,

    /// A connection with no request in progress and no byte received for this many seconds
    /// is closed (the keep-alive idle timeout; also bounds a connection that never sends).
    #[arg(long, env = "KERNELKITE_IDLE_TIMEOUT_S", default_value_t = 60)]
    pub idle_timeout_s: u64,

    /// A request body must arrive complete within this many seconds of the handler starting
    /// to read it (`408` otherwise).
    #[arg(long, env = "KERNELKITE_BODY_READ_TIMEOUT_S", default_value_t = 30)]
    pub body_read_timeout_s: u64,

    /// A response the client has stopped reading (the socket's buffers full, no byte taken)
    /// for this many seconds has its connection closed: an event stream or long-poll whose
    /// client went away or stalled holds nothing for long. Detected within twice this.
    #[arg(long, env = "KERNELKITE_WRITE_STALL_S", default_value_t = 30)]
    pub write_stall_s: u64,

    /// Most client connections held at once. 0: automatic, the open-files limit less a
    /// reserve (an eighth, at least 128) for the service's own files and Buildkite
    /// connections, at most 8192. Over the cap the longest-idle connection is closed to make
    /// room; when every connection is busy the new one is answered `503` and closed.
    #[arg(long, env = "KERNELKITE_MAX_CONNECTIONS", default_value_t = 0)]
    pub max_connections: usize,

    /// Bytes that all webhook bodies not yet verified may hold in memory together; a
    /// delivery that would go over is answered `503` without being read. At least
    /// KERNELKITE_WEBHOOK_MAX_BYTES.
    #[arg(long, env = "KERNELKITE_UNAUTHENTICATED_BODY_BUDGET_BYTES", default_value_t = 64 << 20)]
    pub unauthenticated_body_budget_bytes: usize,

    /// On SIGTERM/SIGINT: seconds to let in-flight requests finish after listening stops
    /// (long-polls and event streams are answered at once); then the process exits anyway.
    #[arg(long, env = "KERNELKITE_SHUTDOWN_GRACE_S", default_value_t = 10)]
    pub shutdown_grace_s: u64,
}

/// The store: where submissions are kept and how commits reach the disk, and how long memory keeps events for builds not yet known.
#[derive(Clone, Debug, clap::Args)]
pub struct StoreConfig {
    /// Directory of the store (`kernelkite.db`, SQLite): every submission, its state changes
    /// and result, idempotency keys and the callback outbox, so a restart loses nothing.
    /// Unset: the store is in memory and nothing survives a restart (for tests and trials).
    #[arg(long, env = "KERNELKITE_DATA_DIR")]
    pub data_dir: Option<PathBuf>,

    /// The store in PostgreSQL instead (`postgres://user:password@host:port/database`, TLS as
    /// its `sslmode` says): for a service without a disk that outlives it (a Heroku-style
    /// platform). Unset, and no data dir given: `DATABASE_URL` (the platform's database) when
    /// set. Not with a data dir.
    #[arg(long, env = "KERNELKITE_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<Secret>,

    /// The PostgreSQL schema kernelkite's tables live in (created when missing), so it can
    /// share a database (kernelbot's) without touching other tables: lower-case letters,
    /// digits and `_`.
    #[arg(long, env = "KERNELKITE_DATABASE_SCHEMA", default_value = crate::store::postgres::DEFAULT_SCHEMA)]
    pub database_schema: String,

    /// Most connections the service opens to PostgreSQL (one more holds its lock).
    #[arg(long, env = "KERNELKITE_DATABASE_CONNECTIONS", default_value_t = 8)]
    pub database_connections: u32,

    /// Seconds a start waits for the PostgreSQL schema's lock while another session holds it
    /// (a service that just died lets go at once; one whose session stays silent for 6 s,
    /// stopped or its machine gone, is taken over); then it exits, naming the holder.
    #[arg(long, env = "KERNELKITE_DATABASE_LOCK_WAIT_S", default_value_t = 30)]
    pub database_lock_wait_s: u64,

    /// Start as a standby replica (PostgreSQL only): wait without limit for the schema's lock,
    /// serving nothing (not even `/healthz`, so a load balancer's health check sends nothing
    /// here) until the service holding it ends or stays silent for 6 s (stopped, frozen, its
    /// machine or network gone: its database session is then ended), then take over: read
    /// everything back and serve.
    #[arg(long, env = "KERNELKITE_STANDBY", conflicts_with = "replica")]
    pub standby: bool,

    /// Run as one of several replicas on one PostgreSQL schema (PostgreSQL only, the Buildkite
    /// executor): serve every request from the start, behind any load balancer or a
    /// Heroku-style router; the replica holding the schema's lock runs the queue, and the
    /// others read submissions from the database and hand it every other request through the
    /// database. When it ends or stays silent for 6 s, another takes over.
    #[arg(long, env = "KERNELKITE_REPLICA")]
    pub replica: bool,

    /// How commits reach the disk: `normal` survives the process being killed at any
    /// instant; `full` also survives a power loss (an fsync per commit).
    #[arg(long, env = "KERNELKITE_STORE_SYNC", value_enum, default_value_t = crate::store::SyncMode::Normal)]
    pub store_sync: crate::store::SyncMode,

    /// How often the store's file is checked for damage, seconds (SQLite's quick_check of
    /// every page on disk, about 0.4 ms per MiB of store): a file damaged under the service
    /// turns `/healthz` and every write to 503 within this long. 0: never (only each
    /// statement's errors and the start's check say so).
    #[arg(long, env = "KERNELKITE_STORE_CHECK_S", default_value_t = 10)]
    pub store_check_s: u64,

    /// Webhooks for builds not yet known (their create call has not returned) are kept this
    /// long, seconds.
    #[arg(long, env = "KERNELKITE_EARLY_EVENT_TTL_S", default_value_t = 120)]
    pub early_event_ttl_s: u64,

    /// At most this many builds' early webhooks are kept.
    #[arg(long, env = "KERNELKITE_EARLY_EVENT_MAX", default_value_t = 10_000)]
    pub early_event_max: usize,
}

/// Which durable store the service opens.
#[derive(Clone, PartialEq, Eq)]
pub enum Backend {
    /// SQLite in the data dir (`None`: in memory).
    Sqlite(Option<PathBuf>),
    /// PostgreSQL at the URL.
    Postgres(String),
}

impl std::fmt::Debug for Backend {
    /// Without the URL, whose password it may carry.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backend::Sqlite(dir) => f.debug_tuple("Sqlite").field(dir).finish(),
            Backend::Postgres(_) => f.debug_tuple("Postgres").field(&"<redacted>").finish(),
        }
    }
}

impl StoreConfig {
    /// The store asked for: KERNELKITE_DATABASE_URL, else KERNELKITE_DATA_DIR, else SQLite in
    /// memory.
    pub fn backend(&self) -> Backend {
        match (&self.database_url, &self.data_dir) {
            (Some(url), _) => Backend::Postgres(url.expose().to_string()),
            (None, dir) => Backend::Sqlite(dir.clone()),
        }
    }

    /// Takes the platform's database (`DATABASE_URL`, as a Heroku-style platform sets it) when
    /// neither store is asked for. The command line does this; a service started in process
    /// (the demo, tests) never reads it.
    pub fn adopt_platform_url(&mut self, platform_url: Option<String>) {
        if self.database_url.is_none() && self.data_dir.is_none() {
            self.database_url = platform_url.filter(|u| !u.is_empty()).map(Secret::new);
        }
    }

    /// PostgreSQL's settings for `url`.
    pub fn postgres(&self, url: String) -> crate::store::PgSettings {
        crate::store::PgSettings {
            url,
            schema: self.database_schema.clone(),
            max_connections: self.database_connections,
            lock_wait: std::time::Duration::from_secs(self.database_lock_wait_s),
            standby: self.standby || self.replica,
            replica: self.replica,
            // A service that lost its lock must stop acting on what it holds in memory.
            exit_on_lost: true,
        }
    }

    fn check(&self) -> Result<(), ConfigError> {
        if self.database_url.is_some() && self.data_dir.is_some() {
            return Err(ConfigError::TwoStores);
        }
        if self.standby && self.database_url.is_none() {
            return Err(ConfigError::StandbyWithoutDatabase);
        }
        if self.replica && self.database_url.is_none() {
            return Err(ConfigError::ReplicaWithoutDatabase);
        }
        if !crate::store::postgres::valid_schema(&self.database_schema) {
            return Err(ConfigError::Schema(self.database_schema.clone()));
        }
        if self.database_connections == 0 {
            return Err(ConfigError::Zero(
                "KERNELKITE_DATABASE_CONNECTIONS",
                "the service open no connection to PostgreSQL",
            ));
        }
        Ok(())
    }
}

/// Buildkite: the REST API, the pipeline and its builds, the webhook, artifact downloads, retries and the rate budget. Read by `crate::buildkite`; checked only when Buildkite is the executor (the webhook token always).
#[derive(Clone, Debug, clap::Args)]
pub struct BuildkiteConfig {
    /// Buildkite REST API base URL. Every Buildkite call goes through it (point it at a fake
    /// or a local stand-in for tests).
    #[arg(long, env = "BUILDKITE_API_URL", default_value = DEFAULT_API_URL)]
    pub buildkite_api_url: String,

    /// Buildkite organization slug (required by the Buildkite executor).
    #[arg(
        long,
        env = "BUILDKITE_ORG",
        default_value = "",
        hide_default_value = true
    )]
    pub buildkite_org: String,

    /// Buildkite pipeline slug that runs submissions (required by the Buildkite executor).
    #[arg(
        long,
        env = "BUILDKITE_PIPELINE",
        default_value = "",
        hide_default_value = true
    )]
    pub buildkite_pipeline: String,

    /// Buildkite API access token (scopes: read_builds, write_builds, read_artifacts;
    /// required by the Buildkite executor).
    #[arg(
        long,
        env = "BUILDKITE_API_TOKEN",
        hide_env_values = true,
        default_value = "",
        hide_default_value = true
    )]
    pub buildkite_api_token: Secret,

    /// Token of the Buildkite webhook (notification service). `X-Buildkite-Signature` is
    /// verified with it. Unset: every webhook is refused.
    #[arg(long, env = "BUILDKITE_WEBHOOK_TOKEN", hide_env_values = true)]
    pub buildkite_webhook_token: Option<Secret>,

    /// Also accept webhooks that carry the token in plain text (`X-Buildkite-Token`). Off by
    /// default: a plain token can be replayed forever by anyone who sees one request.
    #[arg(
        long,
        env = "KERNELKITE_ALLOW_PLAIN_WEBHOOK_TOKEN",
        default_value_t = false
    )]
    pub allow_plain_webhook_token: bool,

    /// A signed webhook older or newer than this (seconds) is refused as a replay.
    #[arg(long, env = "KERNELKITE_WEBHOOK_WINDOW_S", default_value_t = 300)]
    pub webhook_window_s: u64,

    /// Branch the builds run on.
    #[arg(long, env = "KERNELKITE_BRANCH", default_value = "main")]
    pub branch: String,

    /// Commit the builds run at (`HEAD`: the branch's head).
    #[arg(long, env = "KERNELKITE_COMMIT", default_value = "HEAD")]
    pub commit: String,

    /// Hosts an artifact download may be redirected to besides public https ones (comma
    /// separated; e.g. an S3 endpoint on a private network). Loopback, private and link-local
    /// addresses and plain http are refused otherwise.
    #[arg(long, env = "KERNELKITE_ARTIFACT_HOSTS", value_delimiter = ',')]
    pub artifact_hosts: Vec<String>,

    /// An artifact download that receives nothing for this long (seconds) is given up and
    /// tried again later, so a stalled blob store cannot hold a fetch slot for the whole
    /// request timeout; a slow download that keeps receiving goes on.
    #[arg(long, env = "KERNELKITE_BLOB_STALL_S", default_value_t = 5)]
    pub blob_stall_s: u64,

    /// Timeout of one Buildkite HTTP request, seconds.
    #[arg(long, env = "KERNELKITE_HTTP_TIMEOUT_S", default_value_t = 30)]
    pub http_timeout_s: u64,

    /// Attempts per Buildkite call on connect errors, 5xx, and timeouts of calls other than
    /// create-build (first try included). A 429 is not a failure: it waits for
    /// `RateLimit-Reset` and is counted apart (at most 30 waits).
    #[arg(long, env = "KERNELKITE_RETRY_ATTEMPTS", default_value_t = 6)]
    pub retry_attempts: u32,

    /// Longest wait honoured from a 429's `RateLimit-Reset`, seconds.
    #[arg(long, env = "KERNELKITE_RATE_LIMIT_MAX_WAIT_S", default_value_t = 60)]
    pub rate_limit_max_wait_s: u64,

    /// After a create-build call timed out or lost its connection, wait this long
    /// (milliseconds) before looking the build up by its meta-data.
    #[arg(
        long,
        env = "KERNELKITE_CREATE_LOOKUP_DELAY_MS",
        default_value_t = 5_000
    )]
    pub create_lookup_delay_ms: u64,

    /// Most pages (100 builds each) one reconciler listing reads.
    #[arg(long, env = "KERNELKITE_RECONCILE_MAX_PAGES", default_value_t = 50)]
    pub reconcile_max_pages: u32,
}

/// Callbacks: how finished submissions are signed and POSTed to their `callback_url`. Read by `crate::callback` and the submission checks.
#[derive(Clone, Debug, clap::Args)]
pub struct CallbackConfig {
    /// Most attempts to POST a finished submission to its `callback_url`; 0: no cap (retried
    /// until KERNELKITE_CALLBACK_RETRY_S has passed).
    #[arg(long, env = "KERNELKITE_CALLBACK_ATTEMPTS", default_value_t = 0)]
    pub callback_attempts: u32,

    /// HMAC-SHA256 key of callbacks (`X-Kernelkite-Signature`). Unset: submissions with a
    /// `callback_url` are refused.
    #[arg(long, env = "KERNELKITE_CALLBACK_SECRET", hide_env_values = true)]
    pub callback_secret: Option<Secret>,

    /// Hosts `callback_url` may name (comma-separated, exact names). Empty: any host.
    #[arg(long, env = "KERNELKITE_CALLBACK_ALLOWED_HOSTS", value_delimiter = ',')]
    pub callback_allowed_hosts: Vec<String>,

    /// How long a callback is retried, seconds (from the submission's end).
    #[arg(long, env = "KERNELKITE_CALLBACK_RETRY_S", default_value_t = 86_400)]
    pub callback_retry_s: u64,

    /// First wait between callback attempts, milliseconds; doubles per attempt, up to 10 min.
    #[arg(long, env = "KERNELKITE_CALLBACK_BACKOFF_MS", default_value_t = 1_000)]
    pub callback_backoff_ms: u64,

    /// Per callback attempt, seconds.
    #[arg(long, env = "KERNELKITE_CALLBACK_TIMEOUT_S", default_value_t = 10)]
    pub callback_timeout_s: u64,
}

/// A setting of the HTTP edge that cannot work.
#[derive(Debug, thiserror::Error)]
pub enum EdgeConfigError {
    /// A timeout of 0 seconds.
    #[error("{0} must be at least 1 second")]
    ZeroTimeout(&'static str),
    /// The body budget cannot hold one webhook of the largest size allowed.
    #[error("KERNELKITE_UNAUTHENTICATED_BODY_BUDGET_BYTES ({budget}) is below KERNELKITE_WEBHOOK_MAX_BYTES ({max}), so the largest webhook could never be read; raise the budget or lower the limit")]
    BodyBudget {
        /// KERNELKITE_UNAUTHENTICATED_BODY_BUDGET_BYTES.
        budget: usize,
        /// KERNELKITE_WEBHOOK_MAX_BYTES.
        max: usize,
    },
    /// The budget is over what one semaphore counts.
    #[error("KERNELKITE_UNAUTHENTICATED_BODY_BUDGET_BYTES must be at most {0}")]
    BodyBudgetTooLarge(usize),
}

/// Where queue status gets its agent counts: the flags of `GET /v1/queues/{queue}`.
#[derive(Clone, Debug, clap::Args)]
pub struct QueueSettings {
    /// Buildkite agent token. When set, agent counts come from the agent API's metrics
    /// endpoint (one call for every queue of the token's cluster) instead of the REST agents
    /// list (which needs the `read_agents` scope on BUILDKITE_API_TOKEN).
    #[arg(long, env = "BUILDKITE_AGENT_TOKEN", hide_env_values = true)]
    pub buildkite_agent_token: Option<Secret>,

    /// Base URL of Buildkite's agent API (its metrics endpoint is `<url>/metrics`).
    #[arg(long, env = "BUILDKITE_AGENT_API_URL", default_value = DEFAULT_AGENT_API_URL)]
    pub buildkite_agent_api_url: String,

    /// Agent counts are fetched from Buildkite at most this often, seconds (at least 60: the
    /// calls share the API token's 50 requests/min with submissions).
    #[arg(
        long,
        env = "KERNELKITE_AGENTS_REFRESH_S",
        default_value_t = 60,
        value_parser = clap::value_parser!(u64).range(60..)
    )]
    pub agents_refresh_s: u64,
}

/// The fleet (issue 39): canaries that quarantine slow or unhealthy slices, the dashboard.
#[derive(Clone, Debug, clap::Args)]
pub struct FleetConfig {
    /// Run canaries: a short reference benchmark on each slice when it joins, after
    /// --canary-every-jobs jobs, after --canary-idle-s without work, and on demand
    /// (`POST /v1/fleet/slices/{id}/canary`); a slice slower than its GPU model's median by
    /// more than --canary-slower-by, or whose canaries spread wider than --canary-max-spread,
    /// or whose readings say the GPU is unhealthy, ranks no run until a canary passes or an
    /// operator releases it. With Buildkite, a canary's build is pinned to the slice's agent
    /// (its node and gpu-index tags), a quarantined slice's agent is paused, and it is
    /// canaried again when an operator asks (the agent is resumed for that canary).
    #[arg(long, env = "KERNELKITE_CANARY", default_value_t = false, action = clap::ArgAction::Set)]
    pub canary: bool,

    /// The canary: a kernelbot task directory (task.yml with a benchmark), run in `benchmark`
    /// mode with its own submission. Default: the bundled prefixsum_py example.
    #[arg(long, env = "KERNELKITE_CANARY_TASK", value_name = "DIR")]
    pub canary_task: Option<std::path::PathBuf>,

    /// A canary on a slice after this many jobs.
    #[arg(long, env = "KERNELKITE_CANARY_EVERY_JOBS", default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..))]
    pub canary_every_jobs: u64,

    /// A canary on a slice after this long without a job or a canary, seconds.
    #[arg(long, env = "KERNELKITE_CANARY_IDLE_S", default_value_t = 6 * 3600, value_parser = clap::value_parser!(u64).range(1..))]
    pub canary_idle_s: u64,

    /// A slice whose canary is slower than its GPU model's median by more than this share is
    /// quarantined (0.05: 5%).
    #[arg(long, env = "KERNELKITE_CANARY_SLOWER_BY", default_value_t = 0.05)]
    pub canary_slower_by: f64,

    /// A slice whose last five canaries spread wider than this (coefficient of variation) is
    /// quarantined.
    #[arg(long, env = "KERNELKITE_CANARY_MAX_SPREAD", default_value_t = 0.05)]
    pub canary_max_spread: f64,

    /// A token that may read the fleet (`GET /v1/fleet`, its event stream and the dashboard's
    /// data) and nothing else: for organisers' and vendors' screens.
    #[arg(
        long,
        env = "KERNELKITE_DASHBOARD_TOKEN",
        value_name = "TOKEN",
        hide_env_values = true
    )]
    pub dashboard_token: Option<crate::config::Secret>,

    /// Vendors' alerts: Slack-compatible incoming webhooks, `PATTERN=URL` pairs separated by
    /// `;` or spaces, PATTERN a node name (`*` any run of characters: `dgx-*`, `*` for every
    /// node). Each webhook is told when a slice of its nodes is quarantined or released, or
    /// offline for --alert-offline-after-s and back. The URLs are secrets: never logged.
    // Read as a secret and parsed by `Config::check`: clap's own error would print the value.
    #[arg(
        long,
        env = "KERNELKITE_ALERT_WEBHOOKS",
        value_name = "PATTERN=URL;...",
        hide_env_values = true
    )]
    pub alert_webhooks: Option<crate::config::Secret>,

    /// A slice whose agent is not connected this long is said offline, seconds.
    #[arg(long, env = "KERNELKITE_ALERT_OFFLINE_AFTER_S", default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    pub alert_offline_after_s: u64,

    /// Most messages per webhook in any minute; what comes beyond waits as one digest.
    #[arg(long, env = "KERNELKITE_ALERT_MAX_PER_MINUTE", default_value_t = 6, value_parser = clap::value_parser!(u32).range(1..))]
    pub alert_max_per_minute: u32,
}

/// The service's queue (issue 25; `crate::dispatch`) and result cache.
#[derive(Clone, Debug, clap::Args)]
pub struct FairConfig {
    /// Slots per queue: `QUEUE=N` pairs separated by commas, `*=N` for the rest; `N` may be
    /// `none`: not limited (builds wait in Buildkite; for autoscaled agents). A queue without
    /// one has the local executor's slices, else its connected Buildkite agents (none
    /// connected: the queue waits for one). Local mode has one line, `local`, for every
    /// queue name.
    #[arg(long, env = "KERNELKITE_QUEUE_SLOTS", default_value = "", value_parser = crate::dispatch::Slots::parse)]
    pub queue_slots: crate::dispatch::Slots,

    /// Per-user quotas: rules `SCOPE:queued=N,hourly=M` separated by `;` (SCOPE: `*`, `QUEUE`,
    /// `*/CLASS` or `QUEUE/CLASS`; a number may be `none`); the most specific rule wins.
    /// `queued`: most of a user's submissions waiting or running at once; `hourly`: most
    /// accepted in any hour. Over either: 429 with Retry-After. Default: no limits.
    #[arg(long, env = "KERNELKITE_QUEUE_LIMITS", default_value = "", value_parser = crate::dispatch::Limits::parse)]
    pub queue_limits: crate::dispatch::Limits,

    /// A run's estimated time on a queue without measured runs yet, seconds (fair-share
    /// charges and wait estimates; then the mean of the queue's last 32 runs).
    #[arg(long, env = "KERNELKITE_QUEUE_ESTIMATE_S", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub queue_estimate_s: u64,

    /// Answer identical `test`/`benchmark` submissions (same run config, queue and runner
    /// version) from the stored result of an earlier one. `false`: every submission runs.
    #[arg(long, env = "KERNELKITE_CACHE", default_value_t = true, action = clap::ArgAction::Set)]
    pub cache: bool,

    /// The oldest result the cache answers with, seconds.
    #[arg(long, env = "KERNELKITE_CACHE_MAX_AGE_S", default_value_t = 86_400)]
    pub cache_max_age_s: u64,

    /// Most answers from the result cache per user, queue and class in any hour (`none`: no
    /// limit of its own). Past it: 429 with Retry-After. Cache answers also count toward
    /// KERNELKITE_QUEUE_LIMITS' `hourly` (never toward `queued`: they do not wait).
    #[arg(long, env = "KERNELKITE_CACHE_HOURLY", default_value = "120", value_parser = crate::dispatch::Most::parse)]
    pub cache_hourly: crate::dispatch::Most,

    /// The runner version the nodes run, which cache keys name and the fleet checks each run
    /// against (default: this release's; set it when the agents run another runner, and
    /// change it when they are upgraded). Give the pipeline agent the same value (its
    /// KERNELKITE_RUNNER_VERSION, deployment/service/compose.yaml): the nodes refuse jobs on
    /// another runner.
    #[arg(long, env = "KERNELKITE_RUNNER_VERSION", default_value = env!("CARGO_PKG_VERSION"))]
    pub runner_version: String,
}

/// Buildkite's agent API.
pub const DEFAULT_AGENT_API_URL: &str = "https://agent.buildkite.com/v3";

impl EdgeConfig {
    /// KERNELKITE_HEADER_READ_TIMEOUT_S.
    pub fn header_read_timeout(&self) -> Duration {
        Duration::from_secs(self.header_read_timeout_s)
    }

    /// KERNELKITE_IDLE_TIMEOUT_S.
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_secs(self.idle_timeout_s)
    }

    /// KERNELKITE_BODY_READ_TIMEOUT_S.
    pub fn body_read_timeout(&self) -> Duration {
        Duration::from_secs(self.body_read_timeout_s)
    }

    /// KERNELKITE_WRITE_STALL_S.
    pub fn write_stall(&self) -> Duration {
        Duration::from_secs(self.write_stall_s)
    }

    /// KERNELKITE_SHUTDOWN_GRACE_S.
    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_secs(self.shutdown_grace_s)
    }

    /// The HTTP edge's settings; part of [`Config::check`].
    pub fn check(&self) -> Result<(), EdgeConfigError> {
        for (name, v) in [
            (
                "KERNELKITE_HEADER_READ_TIMEOUT_S",
                self.header_read_timeout_s,
            ),
            ("KERNELKITE_IDLE_TIMEOUT_S", self.idle_timeout_s),
            ("KERNELKITE_BODY_READ_TIMEOUT_S", self.body_read_timeout_s),
            ("KERNELKITE_WRITE_STALL_S", self.write_stall_s),
        ] {
            if v == 0 {
                return Err(EdgeConfigError::ZeroTimeout(name));
            }
        }
        if self.unauthenticated_body_budget_bytes < self.webhook_max_bytes {
            return Err(EdgeConfigError::BodyBudget {
                budget: self.unauthenticated_body_budget_bytes,
                max: self.webhook_max_bytes,
            });
        }
        if self.unauthenticated_body_budget_bytes > tokio::sync::Semaphore::MAX_PERMITS {
            return Err(EdgeConfigError::BodyBudgetTooLarge(
                tokio::sync::Semaphore::MAX_PERMITS,
            ));
        }
        Ok(())
    }
}

impl BuildkiteConfig {
    /// KERNELKITE_HTTP_TIMEOUT_S.
    pub fn http_timeout(&self) -> Duration {
        Duration::from_secs(self.http_timeout_s)
    }
}

impl Config {
    /// A config with every default, for the given Buildkite endpoint; used by tests, the
    /// benchmark and embedders that do not parse flags. The environment is ignored, so a
    /// stray `KERNELKITE_*` variable cannot change what a test runs with.
    pub fn new(api_url: &str, org: &str, pipeline: &str, api_token: &str) -> Config {
        use clap::{CommandFactory, FromArgMatches};
        let cmd = Config::command().mut_args(|a| a.env(None));
        let matches = cmd.get_matches_from([
            "kernelkite-service",
            "--buildkite-api-url",
            api_url,
            "--buildkite-org",
            org,
            "--buildkite-pipeline",
            pipeline,
            "--buildkite-api-token",
            api_token,
        ]);
        match Config::from_arg_matches(&matches) {
            Ok(c) => c,
            Err(e) => e.exit(),
        }
    }

    /// A config with every default and the local executor (no Buildkite settings), for
    /// embedders and tests; like [`Config::new`], the environment is ignored.
    pub fn local() -> Config {
        use clap::{CommandFactory, FromArgMatches};
        let cmd = Config::command().mut_args(|a| a.env(None));
        let matches = cmd.get_matches_from(["kernelkite-service", "--executor", "local"]);
        match Config::from_arg_matches(&matches) {
            Ok(c) => c,
            Err(e) => e.exit(),
        }
    }

    /// What the core reads, as the core's plain settings (the flags' values; the HTTP edge's,
    /// Buildkite's, the store's and the callback sender's own settings stay here).
    pub fn core(&self) -> kernelkite_core::config::Config {
        let f = &self.fair;
        kernelkite_core::config::Config {
            default_timeout_s: self.default_timeout_s,
            max_timeout_s: self.max_timeout_s,
            max_artifact_bytes: self.max_artifact_bytes,
            retry_base_ms: self.retry_base_ms,
            fetch_concurrency: self.fetch_concurrency,
            reconcile_min_ms: self.reconcile_min_ms,
            reconcile_max_ms: self.reconcile_max_ms,
            public_url: self.edge.public_url.clone(),
            early_event_max: self.store.early_event_max,
            early_event_ttl_s: self.store.early_event_ttl_s,
            agents_refresh_s: self.queues.agents_refresh_s,
            callbacks: kernelkite_core::config::Callbacks {
                signed: self.callbacks.callback_secret.is_some(),
                allowed_hosts: self.callbacks.callback_allowed_hosts.clone(),
                retry_s: self.callbacks.callback_retry_s,
            },
            fair: kernelkite_core::config::Fair {
                queue_slots: f.queue_slots.clone(),
                queue_limits: f.queue_limits.clone(),
                queue_estimate_s: f.queue_estimate_s,
                cache: f.cache,
                cache_max_age_s: f.cache_max_age_s,
                cache_hourly: f.cache_hourly,
                runner_version: f.runner_version.clone(),
            },
            canary: kernelkite_core::canary::Schedule {
                enabled: self.fleet.canary,
                every_jobs: self.fleet.canary_every_jobs,
                idle_s: self.fleet.canary_idle_s,
                slower_by: self.fleet.canary_slower_by,
                max_spread: self.fleet.canary_max_spread,
                ..Default::default()
            },
            offline_after_s: self.fleet.alert_offline_after_s,
        }
    }

    /// The vendors' webhooks (KERNELKITE_ALERT_WEBHOOKS), parsed; the error names the item by
    /// its position, never by its text.
    pub fn alert_routes(&self) -> Result<crate::notify::Routes, ConfigError> {
        match &self.fleet.alert_webhooks {
            None => Ok(crate::notify::Routes::default()),
            Some(s) => crate::notify::Routes::parse(s.expose()).map_err(ConfigError::AlertWebhooks),
        }
    }

    /// Checks what clap cannot; the error says what to fix.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.executor == ExecutorKind::Buildkite {
            self.check_buildkite()?;
        }
        self.check_common()
    }

    /// The settings only the Buildkite executor uses.
    fn check_buildkite(&self) -> Result<(), ConfigError> {
        let b = &self.buildkite;
        for (name, v) in [
            ("BUILDKITE_ORG", &b.buildkite_org),
            ("BUILDKITE_PIPELINE", &b.buildkite_pipeline),
        ] {
            if v.is_empty() {
                return Err(ConfigError::MissingBuildkite { name });
            }
        }
        if b.buildkite_api_token.expose().is_empty() {
            return Err(ConfigError::EmptyApiToken);
        }
        let url = url::Url::parse(&b.buildkite_api_url).map_err(|source| ConfigError::ApiUrl {
            url: b.buildkite_api_url.clone(),
            source,
        })?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(ConfigError::ApiUrlScheme(b.buildkite_api_url.clone()));
        }
        for (name, v) in [
            ("BUILDKITE_ORG", &b.buildkite_org),
            ("BUILDKITE_PIPELINE", &b.buildkite_pipeline),
        ] {
            if v.is_empty()
                || !v
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(ConfigError::Slug {
                    name,
                    value: v.clone(),
                });
            }
        }
        Ok(())
    }

    /// The settings every executor uses.
    fn check_common(&self) -> Result<(), ConfigError> {
        let f = &self.fleet;
        let share = |x: f64| x.is_finite() && x > 0.0 && x < 1.0;
        if !share(f.canary_slower_by) || !share(f.canary_max_spread) {
            return Err(ConfigError::CanaryLimits);
        }
        if f.dashboard_token
            .as_ref()
            .is_some_and(|t| t.expose().is_empty())
        {
            return Err(ConfigError::EmptyDashboardToken);
        }
        self.alert_routes()?;
        // A variable set to the empty string is not "unset": clap reads it as an empty token.
        // An empty webhook key lets anyone sign webhooks, and an empty API token would admit
        // any client sending `Authorization: Bearer `, while unset means loopback only. Both
        // would fail open, so an empty value is refused instead.
        if self
            .buildkite
            .buildkite_webhook_token
            .as_ref()
            .is_some_and(|t| t.expose().is_empty())
        {
            return Err(ConfigError::EmptyWebhookToken);
        }
        if self
            .edge
            .api_token
            .as_ref()
            .is_some_and(|t| t.expose().is_empty())
        {
            return Err(ConfigError::EmptyClientToken);
        }
        if self.buildkite.retry_attempts == 0 {
            return Err(ConfigError::NoRetryAttempts);
        }
        self.core().check()?;
        self.edge.check()?;
        self.store.check()?;
        for (value, name, effect) in [
            (
                self.buildkite.http_timeout_s,
                "KERNELKITE_HTTP_TIMEOUT_S",
                "every Buildkite call time out at once",
            ),
            (
                self.edge.max_submission_bytes as u64,
                "KERNELKITE_MAX_SUBMISSION_BYTES",
                "every submission too large",
            ),
            (
                self.callbacks.callback_timeout_s,
                "KERNELKITE_CALLBACK_TIMEOUT_S",
                "every callback time out at once",
            ),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero(name, effect));
            }
        }
        if self
            .callbacks
            .callback_secret
            .as_ref()
            .is_some_and(|t| t.expose().is_empty())
        {
            return Err(ConfigError::EmptyCallbackSecret);
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn the_store_is_the_one_asked_for_and_two_are_refused() {
        let mut c = Config::local();
        assert_eq!(c.store.backend(), Backend::Sqlite(None));
        let heroku = || Some("postgres://u:p@db:5432/app".to_string());
        c.store.adopt_platform_url(Some(String::new()));
        assert_eq!(c.store.backend(), Backend::Sqlite(None));
        c.store.data_dir = Some("/var/lib/kk".into());
        c.store.adopt_platform_url(heroku());
        assert_eq!(
            c.store.backend(),
            Backend::Sqlite(Some("/var/lib/kk".into())),
            "a data dir wins over the platform's database"
        );
        c.store.data_dir = None;
        c.store.adopt_platform_url(heroku());
        assert_eq!(
            c.store.backend(),
            Backend::Postgres("postgres://u:p@db:5432/app".into()),
            "the platform's DATABASE_URL when nothing else is set"
        );
        c.store.database_url = Some(Secret::new("postgres://kk:SECRET-4@db/kk"));
        c.store.adopt_platform_url(heroku());
        assert_eq!(
            c.store.backend(),
            Backend::Postgres("postgres://kk:SECRET-4@db/kk".into()),
            "KERNELKITE_DATABASE_URL wins"
        );
        assert!(c.check().is_ok());
        c.store.data_dir = Some("/var/lib/kk".into());
        assert!(matches!(c.check(), Err(ConfigError::TwoStores)));
        c.store.data_dir = None;
        c.store.standby = true;
        assert!(c.check().is_ok(), "a standby on PostgreSQL");
        let url = c.store.database_url.take();
        let e = c.check().unwrap_err().to_string();
        assert!(e.contains("KERNELKITE_STANDBY needs"), "{e}");
        c.store.database_url = url;
        c.store.standby = false;
        c.store.replica = true;
        assert!(c.check().is_ok(), "a replica on PostgreSQL");
        assert!(
            c.store.postgres("postgres://x/y".into()).standby,
            "a replica waits without limit"
        );
        let url = c.store.database_url.take();
        let e = c.check().unwrap_err().to_string();
        assert!(e.contains("KERNELKITE_REPLICA needs"), "{e}");
        c.store.database_url = url;
        c.store.replica = false;
        assert!(
            !format!("{c:?} {:?}", c.store.backend()).contains("SECRET-4"),
            "the URL's password is never shown"
        );
        c.store.database_schema = "Kernel-Kite".into();
        let e = c.check().unwrap_err().to_string();
        assert!(e.contains("KERNELKITE_DATABASE_SCHEMA"), "{e}");
    }

    #[test]
    fn debug_redacts_every_token() {
        let mut c = Config::new("http://127.0.0.1:1/v2", "org", "pipe", "bk-api-SECRET-1");
        c.buildkite.buildkite_webhook_token = Some(Secret::new("wh-SECRET-2"));
        c.edge.api_token = Some(Secret::new("kk-SECRET-3"));
        let shown = format!("{c:?} {c:#?}");
        assert!(!shown.contains("SECRET"), "{shown}");
        assert!(shown.contains("<redacted>"));
        assert_eq!(c.buildkite.buildkite_api_token.expose(), "bk-api-SECRET-1");
    }

    /// The fewest flags the service starts with; the rest from defaults and the environment.
    pub(crate) fn parse_minimal() -> Config {
        Config::try_parse_from([
            "x",
            "--buildkite-org",
            "o",
            "--buildkite-pipeline",
            "p",
            "--buildkite-api-token",
            "t",
        ])
        .unwrap()
    }

    #[test]
    fn defaults_match_the_issue() {
        let c = Config::new("http://127.0.0.1:1/v2", "org", "pipe", "t");
        assert_eq!(c.edge.listen.to_string(), "127.0.0.1:8080");
        assert_eq!(c.buildkite.branch, "main");
        assert!(
            c.buildkite.buildkite_webhook_token.is_none() && !c.buildkite.allow_plain_webhook_token
        );
        assert!(c.check().is_ok());
        let d = parse_minimal();
        assert_eq!(
            d.buildkite.buildkite_api_url,
            "https://api.buildkite.com/v2"
        );
    }

    #[test]
    fn new_ignores_the_environment() {
        // Set for this process only; no other test reads KERNELKITE_BRANCH.
        std::env::set_var("KERNELKITE_BRANCH", "from-env");
        let c = Config::new("http://127.0.0.1:1/v2", "org", "pipe", "t");
        assert_eq!(c.buildkite.branch, "main");
        let d = parse_minimal();
        assert_eq!(d.buildkite.branch, "from-env");
        std::env::remove_var("KERNELKITE_BRANCH");
    }

    #[test]
    fn zero_timeouts_and_limits_are_refused_naming_the_variable() {
        let mut c = Config::new("http://127.0.0.1:1/v2", "org", "pipe", "t");
        c.buildkite.http_timeout_s = 0;
        let e = c.check().unwrap_err().to_string();
        assert!(
            e.contains("KERNELKITE_HTTP_TIMEOUT_S must be at least 1"),
            "{e}"
        );
        let mut c = Config::new("http://127.0.0.1:1/v2", "org", "pipe", "t");
        c.edge.max_submission_bytes = 0;
        let e = c.check().unwrap_err().to_string();
        assert!(
            e.contains("KERNELKITE_MAX_SUBMISSION_BYTES must be at least 1"),
            "{e}"
        );
        let mut c = Config::new("http://127.0.0.1:1/v2", "org", "pipe", "t");
        c.reconcile_min_ms = c.reconcile_max_ms + 1;
        assert!(c.check().is_err());
    }

    #[test]
    fn check_names_the_bad_setting() {
        let mut c = Config::new("http://127.0.0.1:1/v2", "org", "pipe", "t");
        c.buildkite.buildkite_org = "a/b".into();
        assert!(c.check().unwrap_err().to_string().contains("BUILDKITE_ORG"));
        let c = Config::new("ftp://x", "org", "pipe", "t");
        assert!(c
            .check()
            .unwrap_err()
            .to_string()
            .contains("BUILDKITE_API_URL"));
    }

    #[test]
    fn buildkite_settings_are_required_by_the_buildkite_executor_only() {
        use clap::{CommandFactory, FromArgMatches};
        let parse = |args: &[&str]| {
            let m = Config::command()
                .mut_args(|a| a.env(None))
                .try_get_matches_from(args)
                .unwrap();
            Config::from_arg_matches(&m).unwrap()
        };
        let e = parse(&["x"]).check().unwrap_err().to_string();
        assert!(
            e.contains("BUILDKITE_ORG is not set") && e.contains("kernelkite-service local"),
            "{e}"
        );
        let local = Config::local();
        assert_eq!(local.executor, ExecutorKind::Local);
        local.check().unwrap();
        parse(&["x", "--executor", "local"]).check().unwrap();
        // The checks every executor shares still apply.
        let mut c = Config::local();
        c.edge.api_token = Some(Secret::new(""));
        assert!(c.check().is_err());
    }

    #[test]
    fn empty_tokens_are_refused_not_taken_as_keys() {
        // `BUILDKITE_WEBHOOK_TOKEN=` in an env file parses as Some(""); an empty HMAC key is
        // public, and an empty bearer token matches `Authorization: Bearer `.
        let from_env = |flag: &str| {
            Config::try_parse_from([
                "x",
                "--buildkite-org",
                "o",
                "--buildkite-pipeline",
                "p",
                "--buildkite-api-token",
                "t",
                flag,
                "",
            ])
            .unwrap()
        };
        let c = from_env("--buildkite-webhook-token");
        assert_eq!(
            c.buildkite
                .buildkite_webhook_token
                .as_ref()
                .map(Secret::expose),
            Some("")
        );
        assert!(c
            .check()
            .unwrap_err()
            .to_string()
            .contains("BUILDKITE_WEBHOOK_TOKEN"));
        let c = from_env("--api-token");
        assert!(c
            .check()
            .unwrap_err()
            .to_string()
            .contains("KERNELKITE_API_TOKEN"));
    }
}
