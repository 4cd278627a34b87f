//! Self-healing: recovery on start, and the reconciler for lost webhooks.
//!
//! **Recovery.** Every submission that had not ended is reloaded into memory with its
//! absolute deadline. Submissions whose build was never recorded (the process died around
//! the create call) are matched with one listing of the builds created since the oldest of
//! them (each build carries its submission id in its meta-data): a build found is adopted, and
//! only a submission with no build gets one created. Every other reloaded submission is due
//! for the reconciler at once, and its timer is armed after that first pass (at most 30 s).
//!
//! **Reconciler.** Buildkite's webhooks are best-effort. A submission that has heard nothing
//! for a while (KERNELKITE_RECONCILE_MIN_MS, doubling to KERNELKITE_RECONCILE_MAX_MS after each
//! check that finds nothing) is *due*. When any is due, one pass lists the builds that
//! finished since the previous complete pass (one `GET .../builds?state[]=...&finished_from=`
//! call per 100 finished builds, `exclude_jobs`, `exclude_pipeline`), however many
//! submissions wait, and each finished build of a submission in flight is fed through
//! exactly the code a `build.finished` webhook goes through. A pass counts as a check of every
//! submission that has been quiet for the minimum wait, so passes happen at most once per
//! KERNELKITE_RECONCILE_MIN_MS: the API cost is bounded by time and by the number of builds
//! that finish, not by the number pending. Its calls have the lowest priority in the rate
//! budget, so they yield to result fetching.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use chrono::Utc;

use crate::app::App;
use crate::executor::{BuildEvent, BuildEventKind, Found, Launched};
use crate::report::report;
use crate::store::Pending;
use crate::submission::{Outcome, State};

/// Listings start this long before the previous pass began (and before the oldest
/// submission was created): Buildkite's clock and the time it records a finish may differ
/// from ours.
pub const MARGIN: Duration = Duration::from_secs(60);

/// Longest wait for the first pass after a restart before deadlines are enforced anyway.
const FIRST_PASS_LIMIT: Duration = Duration::from_secs(30);

impl App {
    /// Reloads the submissions that had not ended and starts putting them right.
    pub(crate) fn recover(self: &Arc<Self>, pending: Vec<Pending>) {
        if pending.is_empty() {
            return;
        }
        tracing::info!(
            count = pending.len(),
            "reloading submissions that had not ended"
        );
        let now = Instant::now();
        let mut orphans = Vec::new();
        let mut timers = Vec::new();
        for p in pending {
            let id = p.sub.id.clone();
            let build = p.sub.build.clone();
            let queued_without_build = build.is_none();
            self.store.reload(p.sub.clone(), p.deadline_ms);
            if let Some(live) = self.store.live(&id) {
                // Due at once: the first pass looks at every reloaded build.
                live.heard.lock().unwrap_or_else(|e| e.into_inner()).due = now;
            }
            if let Some(b) = &build {
                // Events that arrived before the reload were only buffered; none is lost.
                let early = self.store.key_build(&id, &b.id);
                for ev in early {
                    let app = self.clone();
                    let id = id.clone();
                    tokio::spawn(async move { app.apply(&id, ev).await });
                }
            }
            if queued_without_build {
                // No build to look at: its deadline holds from now on.
                self.spawn_timeout(&id, p.deadline_ms);
                orphans.push(p.clone());
            } else {
                timers.push((id, p.deadline_ms));
            }
        }
        let app = self.clone();
        tokio::spawn(async move { app.recover_orphans(orphans).await });
        let app = self.clone();
        tokio::spawn(async move {
            // One pass over every reloaded build before their deadlines are enforced, so a
            // build that finished while the service was down is collected rather than timed
            // out; bounded, so an unreachable Buildkite cannot hold the deadlines off.
            match tokio::time::timeout(FIRST_PASS_LIMIT, app.reconcile_pass(true)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    tracing::warn!(error = %report(&*e), "the first reconciler pass after the restart failed; it is retried")
                }
                Err(_) => tracing::warn!(
                    "the first reconciler pass after the restart is slow; deadlines are enforced meanwhile"
                ),
            }
            for (id, deadline) in timers {
                app.spawn_timeout(&id, deadline);
            }
        });
    }

    /// Submissions without a recorded build: adopt the build each may already have (one
    /// listing for all of them), create the rest.
    async fn recover_orphans(self: &Arc<Self>, orphans: Vec<Pending>) {
        if orphans.is_empty() {
            return;
        }
        let oldest = orphans
            .iter()
            .map(|p| p.sub.created_at)
            .min()
            .unwrap_or_else(Utc::now);
        let since = oldest - chrono::Duration::from_std(MARGIN).unwrap_or_default();
        let mut wait = Duration::from_millis(self.cfg.retry_base_ms.max(10));
        let found: Vec<Found> = loop {
            match self.executor.created_since(since).await {
                Ok(f) => {
                    if !f.complete {
                        tracing::warn!("the listing of builds created since the oldest interrupted submission was cut at KERNELKITE_RECONCILE_MAX_PAGES; submissions not matched get their build created (a twin is canceled when seen)");
                    }
                    break f.builds;
                }
                Err(e) => {
                    // Creating without knowing could make twins: ask again until it answers
                    // (each submission's deadline still ends it).
                    tracing::warn!(error = %report(&*e), retry_in = ?wait, "could not list the builds of interrupted submissions; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(30));
                    if orphans.iter().all(|p| self.store.live(&p.sub.id).is_none()) {
                        return;
                    }
                }
            }
        };
        let mut by_submission: HashMap<String, Found> = HashMap::new();
        for f in found {
            if let Some(sid) = f.submission_id.clone() {
                // The lowest-numbered build of a submission is its build.
                match by_submission.get(&sid) {
                    Some(have) if have.build.number <= f.build.number => {
                        self.cancel_twin(&sid, &f);
                    }
                    Some(have) => {
                        self.cancel_twin(&sid, have);
                        by_submission.insert(sid, f);
                    }
                    None => {
                        by_submission.insert(sid, f);
                    }
                }
            }
        }
        for p in orphans {
            let id = p.sub.id.clone();
            if self.store.live(&id).is_none() {
                continue;
            }
            match by_submission.remove(&id) {
                Some(f) => {
                    tracing::info!(%id, build = f.build.number, "adopting the build an interrupted create made");
                    let finished =
                        crate::buildkite::FINISHED_STATES.contains(&f.build.state.as_str());
                    self.attach(
                        &id,
                        Launched {
                            build: f.info(),
                            running: f.build.state == "running",
                        },
                    )
                    .await;
                    if finished {
                        self.apply(
                            &id,
                            BuildEvent {
                                kind: BuildEventKind::Finished,
                                build: f.build,
                            },
                        )
                        .await;
                    }
                }
                None => match p.job {
                    Some(job) => {
                        tracing::info!(%id, "creating the build of an interrupted submission");
                        self.spawn_launch(job);
                    }
                    None => {
                        self.finish_durably(
                            &id,
                            Outcome::Failed(
                                "the submission's job was not kept; submit it again".into(),
                            ),
                        )
                        .await;
                    }
                },
            }
        }
    }

    fn cancel_twin(self: &Arc<Self>, submission_id: &str, twin: &Found) {
        tracing::warn!(id = %submission_id, build = twin.build.number, "canceling a second build of the same submission");
        self.spawn_cancel_build(twin.info());
    }

    /// One reconciler pass: lists the builds finished since the last complete pass and feeds
    /// each of a submission in flight through the webhook path. `all`: every submission with
    /// a build counts as due (after a restart). Returns how many builds were fed.
    pub async fn reconcile_pass(
        self: &Arc<Self>,
        all: bool,
    ) -> Result<usize, crate::report::BoxError> {
        let now = Instant::now();
        let live = self.store.all_live();
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
            let until = *self
                .reconciled_until
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            match until {
                Some(t) if !all => t.max(oldest),
                _ => oldest,
            }
        } - chrono::Duration::from_std(MARGIN).unwrap_or_default();
        let started = Utc::now();
        let listed = self.executor.finished_since(from).await;
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
            *self
                .reconciled_until
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some(started);
        }
        let mut fed = 0;
        for f in listing.builds {
            // The listing asked for finished builds; each build's own state is what counts (a
            // filter the API ignored, or a build that changed between its pages, must not end
            // a submission whose build still runs).
            if !crate::buildkite::FINISHED_STATES.contains(&f.build.state.as_str()) {
                tracing::debug!(build = f.build.number, state = %f.build.state, "listed among finished builds but not finished; left alone");
                continue;
            }
            let id = match self.store.submission_of(&f.build.id) {
                Some(id) => id,
                None => match f.submission_id.as_deref().and_then(|sid| {
                    self.store
                        .get(sid)
                        .filter(|s| s.build.is_none() && !s.state.is_terminal())
                        .map(|_| sid.to_string())
                }) {
                    // A build whose create response never came back (and was not found by
                    // the lookup yet): adopt it.
                    Some(sid) => {
                        self.attach(
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
            let Some(l) = self.store.live(&id) else {
                continue;
            };
            let state = l.tx.borrow().state;
            if state.is_terminal()
                || (state == State::Fetching && l.collecting.load(Ordering::Acquire))
            {
                continue;
            }
            fed += 1;
            self.metrics.reconciler_finds.inc();
            tracing::info!(%id, build = f.build.number, state = %f.build.state, "reconciler found a finished build whose webhook did not arrive");
            self.apply(
                &id,
                BuildEvent {
                    kind: BuildEventKind::Finished,
                    build: f.build,
                },
            )
            .await;
        }
        // The pass checked every quiet submission: each waits its (doubled) backoff again.
        let min = Duration::from_millis(self.cfg.reconcile_min_ms);
        let max = Duration::from_millis(self.cfg.reconcile_max_ms);
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

    /// Whether any submission in flight is due for a check.
    fn any_due(&self, now: Instant) -> bool {
        self.store.all_live().iter().any(|(_, l)| {
            let s = l.tx.borrow();
            !s.state.is_terminal()
                && s.build.is_some()
                && !l.collecting.load(Ordering::Acquire)
                && l.heard.lock().unwrap_or_else(|e| e.into_inner()).due <= now
        })
    }
}

/// Runs the reconciler until the service is dropped.
pub(crate) fn spawn(app: Weak<App>) {
    tokio::spawn(async move {
        let tick = {
            let Some(a) = app.upgrade() else { return };
            Duration::from_millis((a.cfg.reconcile_min_ms / 4).clamp(20, 5_000))
        };
        let mut last_pass: Option<Instant> = None;
        loop {
            tokio::time::sleep(tick).await;
            let Some(a) = app.upgrade() else { return };
            let now = Instant::now();
            // At most one pass per minimum wait: a pass looks at every finished build, so
            // the calls per minute are bounded by time, whatever the number pending.
            let min = Duration::from_millis(a.cfg.reconcile_min_ms);
            if last_pass.is_some_and(|t| now.saturating_duration_since(t) < min) {
                continue;
            }
            if !a.any_due(now) {
                continue;
            }
            last_pass = Some(now);
            match a.reconcile_pass(false).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(builds = n, "reconciler pass fed finished builds"),
                Err(e) => {
                    tracing::warn!(error = %report(&*e), "reconciler pass failed; retried later")
                }
            }
        }
    });
}
