//! The core's settings, as plain values.
//!
//! The service's command line (`kernelkite-service`'s clap configuration, where every flag,
//! variable and default lives) converts into a [`Config`]; an embedder or a test builds one
//! directly. Only what the core itself reads is here: the HTTP edge's, Buildkite's, the
//! store's and the callback sender's own settings stay with those adapters.

use std::time::Duration;

use crate::dispatch::{Limits, Most, Slots, NODE_LINE};

/// The largest result.json taken unless the operator says otherwise.
pub const DEFAULT_MAX_ARTIFACT_BYTES: u64 = 64 << 20;

/// What the core reads.
#[derive(Clone, Debug)]
pub struct Config {
    /// A submission's timeout when it names none, seconds.
    pub default_timeout_s: u64,
    /// The longest timeout a submission may ask for, seconds.
    pub max_timeout_s: u64,
    /// The largest result.json taken, bytes.
    pub max_artifact_bytes: u64,
    /// The first wait between retries of an executor call, milliseconds.
    pub retry_base_ms: u64,
    /// Result fetches at once.
    pub fetch_concurrency: usize,
    /// The reconciler's shortest wait, milliseconds.
    pub reconcile_min_ms: u64,
    /// The reconciler's longest wait, milliseconds.
    pub reconcile_max_ms: u64,
    /// The base of the status URLs the core hands out (none: relative URLs).
    pub public_url: Option<String>,
    /// Most events kept for builds not yet known.
    pub early_event_max: usize,
    /// How long an event for a build not yet known is kept, seconds.
    pub early_event_ttl_s: u64,
    /// The shortest time between two fetches of a queue's agent counts, seconds.
    pub agents_refresh_s: u64,
    /// Callbacks as far as the core checks and schedules them.
    pub callbacks: Callbacks,
    /// The service's queue and result cache.
    pub fair: Fair,
    /// Canaries: when they run and how they are judged (`crate::canary`).
    pub canary: crate::canary::Schedule,
    /// A slice whose agent is not connected this long is said offline (its vendor is told),
    /// seconds.
    pub offline_after_s: u64,
}

/// Callbacks as far as the core sees them (the sender's own settings are the adapter's).
#[derive(Clone, Debug)]
pub struct Callbacks {
    /// Whether callbacks are signed (a key is set); without one, a `callback_url` is refused.
    pub signed: bool,
    /// The hosts a callback may go to (empty: any), see [`host_allowed`].
    pub allowed_hosts: Vec<String>,
    /// How long after its submission ended a callback is still tried, seconds.
    pub retry_s: u64,
}

/// The service's queue (`crate::dispatch`) and result cache.
#[derive(Clone, Debug)]
pub struct Fair {
    /// Slots per queue.
    pub queue_slots: Slots,
    /// Per-user quotas.
    pub queue_limits: Limits,
    /// A run's estimated time on a queue without measured runs yet, seconds.
    pub queue_estimate_s: u64,
    /// Whether identical test and benchmark submissions are answered from the cache.
    pub cache: bool,
    /// The oldest result the cache answers with, seconds.
    pub cache_max_age_s: u64,
    /// Most cache answers per user, queue and class in any hour.
    pub cache_hourly: Most,
    /// The runner version cache keys name.
    pub runner_version: String,
}

/// A setting the core cannot work with. Each message names the variable to fix and how.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// KERNELKITE_QUEUE_SLOTS names a queue where every queue waits in the node's one line.
    #[error("KERNELKITE_QUEUE_SLOTS names queue {0:?}, but this executor runs every queue on the node's slices, in one line: set `local=N` (or `*=N`) for the node, or leave it unset to use every slice")]
    QueueSlotsOfOneLine(String),
    /// KERNELKITE_FETCH_CONCURRENCY is 0.
    #[error("KERNELKITE_FETCH_CONCURRENCY must be at least 1")]
    NoFetchConcurrency,
    /// KERNELKITE_DEFAULT_TIMEOUT_S is 0 or above KERNELKITE_MAX_TIMEOUT_S.
    #[error("KERNELKITE_DEFAULT_TIMEOUT_S must be in 1..=KERNELKITE_MAX_TIMEOUT_S")]
    DefaultTimeout,
    /// The reconciler's waits are out of order.
    #[error(
        "KERNELKITE_RECONCILE_MIN_MS must be at least 1 and at most KERNELKITE_RECONCILE_MAX_MS"
    )]
    ReconcileBackoff,
}

impl Config {
    /// Checks what the core cannot run with; the error says what to fix.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.fetch_concurrency == 0 {
            return Err(ConfigError::NoFetchConcurrency);
        }
        if self.default_timeout_s == 0 || self.default_timeout_s > self.max_timeout_s {
            return Err(ConfigError::DefaultTimeout);
        }
        if self.reconcile_min_ms == 0 || self.reconcile_min_ms > self.reconcile_max_ms {
            return Err(ConfigError::ReconcileBackoff);
        }
        Ok(())
    }

    /// With an executor that has slots of its own (local mode's slices), every queue waits
    /// in one line, so KERNELKITE_QUEUE_SLOTS may name only that line (or `*`).
    pub fn check_one_line(&self) -> Result<(), ConfigError> {
        let mut names = self.fair.queue_slots.names();
        match names.find(|q| !["*", NODE_LINE].contains(q)) {
            Some(q) => Err(ConfigError::QueueSlotsOfOneLine(q.to_string())),
            None => Ok(()),
        }
    }

    /// How long after its submission ended a callback is still tried.
    pub fn callback_retry(&self) -> Duration {
        Duration::from_secs(self.callbacks.retry_s)
    }
}

/// Whether `url`'s host may receive callbacks under KERNELKITE_CALLBACK_ALLOWED_HOSTS
/// (`allowed`): any host when the list is empty, else one of the list (exact,
/// case-insensitive). Checked when a submission names its `callback_url` and again before
/// every delivery.
pub fn host_allowed(url: &url::Url, allowed: &[String]) -> bool {
    if allowed.iter().all(|h| h.trim().is_empty()) {
        return true;
    }
    let host = url.host_str().unwrap_or_default().trim_matches(['[', ']']);
    allowed
        .iter()
        .map(|h| h.trim().trim_matches(['[', ']']))
        .any(|h| !h.is_empty() && h.eq_ignore_ascii_case(host))
}
