//! What the HTTP edge shares between its connections and its handlers: the serving phase
//! (for readiness and shutdown), the memory budget of unauthenticated bodies, the
//! rate-limited log of refusals, and the one body reader every handler uses.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes, HttpBody as _};
use futures_util::StreamExt as _;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

use crate::config::Config;
use crate::error::{BadRequest, Error, Unavailable};
use crate::metrics::Metrics;
use crate::metrics::{Refusal, RefusalLabel};

/// Where the server is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Accepting connections and requests.
    Serving,
    /// SIGTERM/SIGINT: no new connections or submissions; long-polls and event streams
    /// answer at once; requests in flight finish.
    Draining,
    /// Every connection is being closed.
    Stopped,
}

/// At most one log line per key per this interval; the others are counted and the count goes
/// with the next line.
pub const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Log lines of one kind, at most one per interval: a flood of forged webhooks or slow
/// connections must not become a flood of log lines (each refusal is counted in the metrics
/// whatever the log shows).
pub struct RateLimitedLog {
    interval: Duration,
    last: Mutex<HashMap<&'static str, (Instant, u64)>>,
}

impl RateLimitedLog {
    /// At most one line per key per `interval`.
    pub fn new(interval: Duration) -> RateLimitedLog {
        RateLimitedLog {
            interval,
            last: Mutex::new(HashMap::new()),
        }
    }

    /// `Some(lines suppressed since the last one)` when a line for `key` may be written now;
    /// `None` (and the line is counted as suppressed) otherwise.
    pub fn allow(&self, key: &'static str) -> Option<u64> {
        self.allow_at(key, Instant::now())
    }

    fn allow_at(&self, key: &'static str, now: Instant) -> Option<u64> {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        match last.get_mut(key) {
            Some((at, suppressed)) if now.duration_since(*at) < self.interval => {
                *suppressed += 1;
                None
            }
            Some((at, suppressed)) => {
                let n = *suppressed;
                *at = now;
                *suppressed = 0;
                Some(n)
            }
            None => {
                last.insert(key, (now, 0));
                Some(0)
            }
        }
    }
}

/// The state the edge shares: one per served router.
pub struct Edge {
    /// Where refusals are counted.
    pub(crate) metrics: Arc<Metrics>,
    /// The service's settings (the edge's own: limits, timeouts, the client token).
    pub(crate) cfg: Arc<Config>,
    phase: watch::Sender<Phase>,
    /// Bytes all unauthenticated bodies in memory may hold together.
    budget: Arc<Semaphore>,
    /// Refusal log lines, rate-limited.
    pub log: RateLimitedLog,
}

impl Edge {
    /// An edge counting into `metrics` under the service's settings `cfg`, serving.
    pub fn new(metrics: Arc<Metrics>, cfg: Arc<Config>) -> Edge {
        let budget = cfg.edge.unauthenticated_body_budget_bytes;
        Edge {
            metrics,
            cfg,
            phase: watch::channel(Phase::Serving).0,
            budget: Arc::new(Semaphore::new(budget.min(Semaphore::MAX_PERMITS))),
            log: RateLimitedLog::new(LOG_INTERVAL),
        }
    }

    /// The phase now.
    pub fn phase(&self) -> Phase {
        *self.phase.borrow()
    }

    /// Moves to `phase` (never back).
    pub fn set_phase(&self, phase: Phase) {
        self.phase.send_if_modified(|p| {
            let later = matches!(
                (*p, phase),
                (Phase::Serving, Phase::Draining | Phase::Stopped)
                    | (Phase::Draining, Phase::Stopped)
            );
            if later {
                *p = phase;
            }
            later
        });
    }

    /// A receiver of phase changes.
    pub fn phase_receiver(&self) -> watch::Receiver<Phase> {
        self.phase.subscribe()
    }

    /// Resolves once the service stops serving (draining or stopped): long-polls and event
    /// streams answer then.
    pub fn stopping(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.phase.subscribe();
        async move {
            // An error means the edge is gone: stopping too.
            let _ = rx.wait_for(|p| *p != Phase::Serving).await;
        }
    }

    /// Counts a refusal and logs it, rate-limited, with the peer (`None` inside a request,
    /// whose span already names it).
    pub fn refused(&self, why: Refusal, peer: Option<SocketAddr>, what: &'static str) {
        self.metrics
            .http_refusals
            .get_or_create(&RefusalLabel {
                reason: why.clone(),
            })
            .inc();
        if let Some(suppressed) = self.log.allow(why.as_str()) {
            match peer {
                Some(peer) => tracing::warn!(%peer, reason = why.as_str(), suppressed, "{what}"),
                None => tracing::warn!(reason = why.as_str(), suppressed, "{what}"),
            }
        }
    }

    /// Reads a request body: at most `limit` bytes (`413` at once when `Content-Length` says
    /// more, else as soon as more arrives), within KERNELKITE_BODY_READ_TIMEOUT_S (`408`).
    /// With `unauthenticated`, the bytes are also taken from the budget of unauthenticated
    /// bodies first (`503` when it is spent); the permit returned keeps them counted until
    /// dropped.
    pub async fn read_body(
        &self,
        body: Body,
        limit: usize,
        setting: &'static str,
        unauthenticated: bool,
    ) -> Result<(Bytes, Option<OwnedSemaphorePermit>), Error> {
        let too_large = || Error::PayloadTooLarge { limit, setting };
        let hint = body.size_hint();
        if hint.lower() > limit as u64 {
            return Err(too_large());
        }
        let exact = hint.exact().map(|n| n as usize);
        let mut permit = None;
        if unauthenticated {
            // Known length: the whole of it now; chunked: chunk by chunk below.
            if let Some(n) = exact.filter(|n| *n > 0) {
                permit = Some(self.take_budget(n)?);
            }
        }
        let timeout = self.cfg.edge.body_read_timeout();
        let read = async {
            let mut stream = body.into_data_stream();
            let mut first: Option<Bytes> = None;
            let mut buf: Option<bytes::BytesMut> = None;
            let mut len = 0usize;
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| BadRequest::Body(e.into()))?;
                len += chunk.len();
                if len > limit {
                    return Err(too_large());
                }
                if unauthenticated && exact.is_none() {
                    let more = self.take_budget(chunk.len())?;
                    match &mut permit {
                        Some(p) => p.merge(more),
                        None => permit = Some(more),
                    }
                }
                // One chunk (the usual case for small bodies) is kept as it came.
                match (&mut first, &mut buf) {
                    (None, None) => first = Some(chunk),
                    (Some(f), None) => {
                        let mut b = bytes::BytesMut::with_capacity(exact.unwrap_or(len).max(len));
                        b.extend_from_slice(f);
                        b.extend_from_slice(&chunk);
                        buf = Some(b);
                    }
                    (_, Some(b)) => b.extend_from_slice(&chunk),
                }
            }
            Ok(match (first, buf) {
                (_, Some(b)) => b.freeze(),
                (Some(f), None) => f,
                (None, None) => Bytes::new(),
            })
        };
        match tokio::time::timeout(timeout, read).await {
            Ok(Ok(bytes)) => Ok((bytes, permit)),
            Ok(Err(e)) => Err(e),
            Err(_) => {
                self.refused(
                    Refusal::Timeout,
                    None,
                    "request body not received within KERNELKITE_BODY_READ_TIMEOUT_S; answered 408",
                );
                Err(Error::RequestTimeout {
                    seconds: timeout.as_secs(),
                    setting: "KERNELKITE_BODY_READ_TIMEOUT_S",
                })
            }
        }
    }

    fn take_budget(&self, n: usize) -> Result<OwnedSemaphorePermit, Error> {
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        self.budget
            .clone()
            .try_acquire_many_owned(n)
            .map_err(|_| {
                self.refused(
                    Refusal::BodyBudget,
                    None,
                    "unverified bodies are over KERNELKITE_UNAUTHENTICATED_BODY_BUDGET_BYTES; answered 503",
                );
                Unavailable::BodyBudget.into()
            })
    }

    /// Bytes of the unauthenticated-body budget free now.
    pub fn budget_available(&self) -> usize {
        self.budget.available_permits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_writes_one_line_per_interval_and_counts_the_rest() {
        let log = RateLimitedLog::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(log.allow_at("a", t0), Some(0));
        for i in 1..=5 {
            assert_eq!(log.allow_at("a", t0 + Duration::from_secs(i)), None);
        }
        // Another key has its own interval.
        assert_eq!(log.allow_at("b", t0 + Duration::from_secs(1)), Some(0));
        assert_eq!(log.allow_at("a", t0 + Duration::from_secs(10)), Some(5));
        assert_eq!(log.allow_at("a", t0 + Duration::from_secs(11)), None);
        assert_eq!(log.allow_at("a", t0 + Duration::from_secs(25)), Some(1));
    }
}
