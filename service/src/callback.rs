//! Callbacks: the final submission POSTed to its `callback_url`, at least once.
//!
//! The callback is written to the store's outbox in the same transaction as the submission's
//! end, so no crash can lose it. A worker delivers due callbacks, signed the way Buildkite
//! signs webhooks: `X-Kernelkite-Signature: timestamp=<unix s>,signature=<hex HMAC-SHA256 of
//! "<timestamp>.<body>">` keyed by KERNELKITE_CALLBACK_SECRET, with `Idempotency-Key: <submission
//! id>` (the same on every attempt, so the receiver can drop repeats). Failures (connection
//! errors, 5xx, 408, 429) are retried with exponential backoff for KERNELKITE_CALLBACK_RETRY_S;
//! any other 4xx, and any redirect (never followed: a 307 could send the submission to another
//! address), ends the attempts.

use std::sync::{Arc, Weak};
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::sync::Semaphore;

use crate::app::App;
use crate::config::{host_allowed, CallbackConfig};
use crate::metrics::OutcomeLabel;
use crate::report::report;
use crate::store::{now_ms, CallbackState, DueCallback};

/// The signature header of callbacks.
pub const HEADER_SIGNATURE: &str = "x-kernelkite-signature";

/// Longest wait between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(600);
/// Deliveries at once.
const CONCURRENCY: usize = 16;

/// `timestamp=<t>,signature=<hex HMAC-SHA256(secret, "<t>." + body)>`.
pub fn signature(secret: &str, timestamp: i64, body: &[u8]) -> String {
    // HMAC takes keys of any length; new_from_slice cannot fail for it.
    let mut mac = match Hmac::<Sha256>::new_from_slice(secret.as_bytes()) {
        Ok(m) => m,
        Err(_) => return String::new(),
    };
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!(
        "timestamp={timestamp},signature={}",
        hex::encode(mac.finalize().into_bytes())
    )
}

/// The wait before attempt `attempts + 1`: base·2^(attempts-1), capped.
pub fn backoff(base: Duration, attempts: i64) -> Duration {
    let n = u32::try_from(attempts.saturating_sub(1).clamp(0, 20)).unwrap_or(20);
    base.saturating_mul(1 << n).min(MAX_BACKOFF)
}

enum Attempt {
    Delivered,
    Refused(String),
    Failed(String),
}

/// The outbox's worker: what it delivers with, and what it is delivering now. Started by the
/// composition root (`crate::cli::serve`); it holds the core weakly and stops once the core
/// is dropped.
pub struct Outbox {
    app: Weak<App>,
    /// KERNELKITE_CALLBACK_*.
    cfg: CallbackConfig,
    /// Never follows redirects, with KERNELKITE_CALLBACK_TIMEOUT_S per attempt.
    http: reqwest::Client,
    /// Callbacks being delivered now (never two attempts of one at once).
    inflight: dashmap::DashSet<String>,
}

impl Outbox {
    /// The outbox of `app`'s store, configured by the KERNELKITE_CALLBACK_* settings `cfg`.
    pub fn new(app: &Arc<App>, cfg: &CallbackConfig) -> Result<Arc<Outbox>, reqwest::Error> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(cfg.callback_timeout_s))
            // A redirect could send the full submission to another (internal) address.
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        Ok(Arc::new(Outbox {
            app: Arc::downgrade(app),
            cfg: cfg.clone(),
            http,
            inflight: dashmap::DashSet::new(),
        }))
    }

    /// Delivers due callbacks until the core is dropped: at once when one is written, and
    /// otherwise as their retries come due.
    pub fn spawn(self: Arc<Self>) {
        tokio::spawn(async move {
            let slots = Arc::new(Semaphore::new(CONCURRENCY));
            let tick = Duration::from_millis(self.cfg.callback_backoff_ms.clamp(10, 1_000));
            loop {
                let Some(a) = self.app.upgrade() else { return };
                let due = match a.store().durable().due_callbacks(now_ms(), 64).await {
                    Ok(d) => d,
                    Err(e) => {
                        tracing::warn!(error = %report(&e), "could not read the callback outbox");
                        Vec::new()
                    }
                };
                for cb in due {
                    if !self.inflight.insert(cb.submission_id.clone()) {
                        continue;
                    }
                    let Ok(permit) = slots.clone().acquire_owned().await else {
                        return;
                    };
                    let (outbox, app) = (self.clone(), a.clone());
                    tokio::spawn(async move {
                        let id = cb.submission_id.clone();
                        outbox.deliver(&app, cb).await;
                        outbox.inflight.remove(&id);
                        drop(permit);
                    });
                }
                // Asleep until the next retry is due (looked up, not polled) or a new
                // callback is written; at most a minute, and at least a tick apart.
                let next = match a.store().durable().next_callback_at().await {
                    Ok(Some(at)) => Duration::from_millis(
                        u64::try_from(at.saturating_sub(now_ms())).unwrap_or(0),
                    ),
                    Ok(None) => Duration::from_secs(60),
                    Err(_) => tick,
                };
                let wake = a.clone();
                drop(a);
                tokio::select! {
                    _ = wake.callbacks_due().notified() => {}
                    _ = tokio::time::sleep(next.clamp(tick, Duration::from_secs(60))) => {}
                }
            }
        });
    }

    async fn deliver(&self, app: &App, cb: DueCallback) {
        if !app.store().durable().acting() {
            // Another service may hold the store now: the callback is its to send.
            tracing::error!(id = %cb.submission_id, "not sending the callback: this service no longer holds the store");
            return;
        }
        let attempts = cb.attempts + 1;
        let outcome = self.attempt(&cb).await;
        let now = now_ms();
        let base = Duration::from_millis(self.cfg.callback_backoff_ms.max(1));
        let capped =
            self.cfg.callback_attempts > 0 && attempts >= i64::from(self.cfg.callback_attempts);
        let (state, next_at, error, label) = match outcome {
            Attempt::Delivered => (CallbackState::Delivered, now, None, "delivered"),
            Attempt::Refused(why) => {
                tracing::warn!(id = %cb.submission_id, error = %why, "callback refused; not retrying");
                (CallbackState::Refused, now, Some(why), "refused")
            }
            Attempt::Failed(why) if now >= cb.give_up_at_ms || capped => {
                tracing::error!(id = %cb.submission_id, attempts, error = %why, "callback given up");
                (CallbackState::GivenUp, now, Some(why), "given_up")
            }
            Attempt::Failed(why) => {
                let wait = backoff(base, attempts);
                tracing::warn!(id = %cb.submission_id, attempts, error = %why, retry_in = ?wait, "callback failed; retrying");
                (
                    CallbackState::Pending,
                    now.saturating_add(wait.as_millis() as i64),
                    Some(why),
                    "retried",
                )
            }
        };
        app.metrics()
            .callbacks
            .get_or_create(&OutcomeLabel {
                outcome: label.to_string(),
            })
            .inc();
        if let Err(e) = app
            .store()
            .durable()
            .callback_attempted(&cb.submission_id, state, attempts, next_at, error)
            .await
        {
            // Not recorded: it stays due and is sent again (at least once, not at most once).
            tracing::error!(id = %cb.submission_id, error = %report(&e), "could not record the callback attempt");
        }
    }

    async fn attempt(&self, cb: &DueCallback) -> Attempt {
        let Some(secret) = &self.cfg.callback_secret else {
            return Attempt::Failed(
                "KERNELKITE_CALLBACK_SECRET is not set, so the callback cannot be signed".into(),
            );
        };
        match url::Url::parse(&cb.url) {
            Ok(u) if host_allowed(&u, &self.cfg.callback_allowed_hosts) => {}
            _ => {
                return Attempt::Refused(format!(
                    "callback_url {:?} is not allowed by KERNELKITE_CALLBACK_ALLOWED_HOSTS",
                    cb.url
                ))
            }
        }
        let ts = chrono::Utc::now().timestamp();
        let sent = self
            .http
            .post(&cb.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(
                HEADER_SIGNATURE,
                signature(secret.expose(), ts, cb.body.as_bytes()),
            )
            .header("idempotency-key", &cb.submission_id)
            .body(cb.body.clone())
            .send()
            .await;
        match sent {
            Ok(r) if r.status().is_success() => Attempt::Delivered,
            Ok(r) if r.status().is_redirection() => Attempt::Refused(format!(
                "the receiver answered {} (a redirect); callbacks never follow redirects",
                r.status()
            )),
            Ok(r) if r.status().is_client_error() && !matches!(r.status().as_u16(), 408 | 429) => {
                Attempt::Refused(format!("the receiver answered {}", r.status()))
            }
            Ok(r) => Attempt::Failed(format!("the receiver answered {}", r.status())),
            Err(e) => Attempt::Failed(report(&e.without_url())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_like_buildkite_signs_webhooks() {
        // Same construction and test vector as the webhook verifier's (Python's hmac module).
        assert_eq!(
            signature("whsec-test", 1_700_000_000, br#"{"event":"ping"}"#),
            "timestamp=1700000000,signature=18edb01b9146fe04b3de9e92ca1594f97bbf2547c75e7584f34d3bedfe76f0a6"
        );
    }

    #[test]
    fn the_allow_list_matches_hosts_exactly() {
        let u = |s: &str| url::Url::parse(s).unwrap();
        assert!(host_allowed(&u("http://anything.example/x"), &[]));
        let list = vec!["backend.example".to_string(), "127.0.0.1".to_string()];
        assert!(host_allowed(&u("https://BACKEND.example:8443/cb"), &list));
        assert!(host_allowed(&u("http://127.0.0.1:9/cb"), &list));
        assert!(!host_allowed(&u("https://evil.backend.example/cb"), &list));
        assert!(!host_allowed(&u("https://backend.example.evil/cb"), &list));
        assert!(!host_allowed(&u("http://169.254.169.254/"), &list));
    }

    #[test]
    fn backoff_doubles_and_is_capped() {
        let b = Duration::from_secs(1);
        assert_eq!(backoff(b, 1), Duration::from_secs(1));
        assert_eq!(backoff(b, 3), Duration::from_secs(4));
        assert_eq!(backoff(b, 40), MAX_BACKOFF);
    }
}
