//! The reconciler for lost events: a loop that lists the builds that finished while their
//! event (Buildkite: the webhook) was lost, and feeds them through the core as the event would
//! have been.
//!
//! Buildkite's webhooks are best-effort. A submission that has heard nothing for a while
//! (KERNELKITE_RECONCILE_MIN_MS, doubling to KERNELKITE_RECONCILE_MAX_MS after each check that
//! finds nothing) is *due*. When any is due, one pass lists the builds that finished since the
//! previous complete pass (one `GET .../builds?state[]=...&finished_from=` call per 100
//! finished builds, `exclude_jobs`, `exclude_pipeline`), however many submissions wait, and
//! each finished build of a submission in flight is fed through exactly the code a
//! `build.finished` webhook goes through. A pass counts as a check of every submission that
//! has been quiet for the minimum wait, so passes happen at most once per
//! KERNELKITE_RECONCILE_MIN_MS: the API cost is bounded by time and by the number of builds
//! that finish, not by the number pending. Its calls have the lowest priority in the rate
//! budget, so they yield to result fetching. After a restart, recovery ([`crate::recovery`])
//! runs one pass over every reloaded build before their deadlines are enforced.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use crate::app::App;
use crate::executor::{BuildEvent, BuildEventKind, Launched};
use crate::report::report;
use crate::submission::State;

/// Listings start this long before the previous pass began (and before the oldest
/// submission was created): Buildkite's clock and the time it records a finish may differ
/// from ours.
pub const MARGIN: Duration = Duration::from_secs(60);

/// The reconciler: the core it feeds (held weakly: it stops once the core is dropped) and where its
/// next listing starts. Started by the composition root (`kernelkite_service::cli::serve`).
pub struct Reconciler {
    app: Weak<App>,
    /// Where the next listing starts (the start of the last complete pass).
    until: Mutex<Option<DateTime<Utc>>>,
}

impl Reconciler {
    /// The reconciler of `app`; nothing runs until [`Reconciler::spawn`].
    pub fn new(app: &Arc<App>) -> Arc<Reconciler> {
        Arc::new(Reconciler {
            app: Arc::downgrade(app),
            until: Mutex::new(None),
        })
    }

    // Over 80 lines: list, feed and reschedule work on one snapshot of the due submissions and one
    // pass start; split, each part would re-read or carry them.
    /// One reconciler pass: lists the builds finished since the last complete pass and feeds
    /// each of a submission in flight through the webhook path. `all`: every submission with
    /// a build counts as due (after a restart). Returns how many builds were fed.
    pub async fn pass(&self, all: bool) -> Result<usize, crate::report::BoxError> {
        let Some(app) = self.app.upgrade() else {
            return Ok(0);
        };
        let now = Instant::now();
        let live = app.store.all_live();
        let with_build: Vec<_> = live
            .iter()
            .filter(|(_, l)| {
                let s = l.tx.borrow();
                !s.state.is_terminal() && s.build.is_some()
            })
            .collect();
        if with_build.is_empty() {
            return Ok(0);
        }
        let oldest = with_build
            .iter()
            .map(|(_, l)| l.tx.borrow().created_at)
            .min()
            .unwrap_or_else(Utc::now);
        let from = {
            let until = *self.until.lock().unwrap_or_else(|e| e.into_inner());
            match until {
                Some(t) if !all => t.max(oldest),
                _ => oldest,
            }
        } - chrono::Duration::from_std(MARGIN).unwrap_or_default();
        let started = Utc::now();
        let listed = app.executor.finished_since(from).await;
        let listing = match listed {
            Ok(f) => f,
            Err(e) => {
                // Counted as no check: the due ones are looked at again after their wait.
                for (_, l) in &with_build {
                    let mut h = l.heard.lock().unwrap_or_else(|e| e.into_inner());
                    if h.due <= now {
                        h.due = now + h.backoff;
                    }
                }
                return Err(e);
            }
        };
        // A listing cut at its page limit saw only the newest builds: the next pass starts
        // from the same point again.
        if listing.complete {
            *self.until.lock().unwrap_or_else(|e| e.into_inner()) = Some(started);
        }
        let mut fed = 0;
        for f in listing.builds {
            // The listing asked for finished builds; each build's own state is what counts (a
            // filter the API ignored, or a build that changed between its pages, must not end
            // a submission whose build still runs).
            if !f.build.finished() {
                tracing::debug!(build = f.build.number, state = %f.build.state, "listed among finished builds but not finished; left alone");
                continue;
            }
            let id = match app.store.submission_of(&f.build.id) {
                Some(id) => id,
                None => match f.submission_id.as_deref().and_then(|sid| {
                    app.store
                        .get(sid)
                        .filter(|s| s.build.is_none() && !s.state.is_terminal())
                        .map(|_| sid.to_string())
                }) {
                    // A build whose create response never came back (and was not found by
                    // the lookup yet): adopt it.
                    Some(sid) => {
                        app.attach(
                            &sid,
                            Launched {
                                build: f.info(),
                                running: false,
                            },
                        )
                        .await;
                        sid
                    }
                    None => continue,
                },
            };
            let Some(l) = app.store.live(&id) else {
                continue;
            };
            let state = l.tx.borrow().state;
            if state.is_terminal()
                || (state == State::Fetching && l.collecting.load(Ordering::Acquire))
            {
                continue;
            }
            fed += 1;
            app.metrics.reconciler_finds.inc();
            tracing::info!(%id, build = f.build.number, state = %f.build.state, "reconciler found a finished build whose webhook did not arrive");
            app.apply(
                &id,
                BuildEvent {
                    kind: BuildEventKind::Finished,
                    build: f.build,
                },
            )
            .await;
        }
        // The pass checked every quiet submission: each waits its (doubled) backoff again.
        let min = Duration::from_millis(app.cfg.reconcile_min_ms);
        let max = Duration::from_millis(app.cfg.reconcile_max_ms);
        for (_, l) in &with_build {
            let mut h = l.heard.lock().unwrap_or_else(|e| e.into_inner());
            if now.saturating_duration_since(h.at) >= min || h.due <= now {
                if h.due <= now {
                    h.backoff = (h.backoff * 2).min(max);
                }
                h.due = now + h.backoff;
            }
        }
        Ok(fed)
    }

    /// Runs passes until the core is dropped: one whenever a submission is due, at most one
    /// per KERNELKITE_RECONCILE_MIN_MS.
    pub fn spawn(self: &Arc<Self>) {
        let Some(tick) = self
            .app
            .upgrade()
            .map(|a| Duration::from_millis((a.cfg.reconcile_min_ms / 4).clamp(20, 5_000)))
        else {
            return;
        };
        let this = self.clone();
        tokio::spawn(async move {
            let mut last_pass: Option<Instant> = None;
            loop {
                tokio::time::sleep(tick).await;
                let Some(a) = this.app.upgrade() else { return };
                let now = Instant::now();
                // At most one pass per minimum wait: a pass looks at every finished build,
                // so the calls per minute are bounded by time, whatever the number pending.
                let min = Duration::from_millis(a.cfg.reconcile_min_ms);
                if last_pass.is_some_and(|t| now.saturating_duration_since(t) < min) {
                    continue;
                }
                if !any_due(&a, now) {
                    continue;
                }
                // Not held across the pass: the pass takes its own, and the core must be free
                // to drop meanwhile.
                drop(a);
                last_pass = Some(now);
                match this.pass(false).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(builds = n, "reconciler pass fed finished builds"),
                    Err(e) => {
                        tracing::warn!(error = %report(&*e), "reconciler pass failed; retried later")
                    }
                }
            }
        });
    }
}

/// Whether any submission in flight is due for a check.
fn any_due(app: &App, now: Instant) -> bool {
    app.store.all_live().iter().any(|(_, l)| {
        let s = l.tx.borrow();
        !s.state.is_terminal()
            && s.build.is_some()
            && !l.collecting.load(Ordering::Acquire)
            && l.heard.lock().unwrap_or_else(|e| e.into_inner()).due <= now
    })
}
