//! Recovery on start: picking up the submissions that had not ended when the service stopped. The
//! one place that does it; the composition root (`kernelkite_service::cli::serve`) calls
//! [`recover`] once the store is open, and the local executor calls [`recover_submission`] for the
//! jobs it finds on disk.
//!
//! Every submission that had not ended is reloaded into memory with its absolute deadline.
//! Submissions whose build was never recorded (the process died around the create call) are matched
//! with one listing of the builds created since the oldest of them (each build carries its
//! submission id in its meta-data): a build found is adopted, and only a submission with no build
//! gets one created. Every other reloaded submission is due for the reconciler at once, and its
//! timer is armed after that first pass (at most 30 s).
//!
//! An executor that keeps state of its own (the local one) is asked what became of each build
//! ([`Executor::recover`](crate::executor::Executor::recover)), and the core acts on the answer as
//! it would on the executor's events.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;

use crate::app::App;
use crate::dispatch::Restored;
use crate::executor::{BuildEvent, BuildEventKind, Found, Launched, Recovered};
use crate::reconcile::{Reconciler, MARGIN};
use crate::report::report;
use crate::store::{Pending, Reopened};
use crate::submission::{Outcome, State, Submission};

/// Longest wait for the first pass after a restart before deadlines are enforced anyway.
const FIRST_PASS_LIMIT: Duration = Duration::from_secs(30);

/// Reloads the submissions that had not ended (`pending`, read when the store was opened)
/// and starts putting them right; `reconciler` makes the first pass over their builds.
pub fn recover(app: &Arc<App>, reconciler: &Arc<Reconciler>, reopened: Reopened) {
    // The run times first: the submissions restored below are charged the queue's estimate.
    for r in &reopened.runs {
        app.dispatch.restore_run(&r.queue, r.took);
    }
    for a in &reopened.accepted {
        let who = crate::dispatch::Who::new(&a.queue, a.user.as_deref(), a.class);
        app.dispatch
            .restore_accepted(&who, a.created_at_ms, a.cached);
    }
    // An answer from the result cache interrupted between its two writes (accepted, then
    // ended): it never waits for a slot or runs, so it is ended as it would have been, from
    // the run it repeats.
    let (answers, pending): (Vec<Pending>, Vec<Pending>) = reopened
        .pending
        .into_iter()
        .partition(|p| p.sub.cached_from.is_some());
    for p in answers {
        let id = p.sub.id.clone();
        let from = p.sub.cached_from.clone().unwrap_or_default();
        app.store.reload(p.sub, p.deadline_ms);
        let app = app.clone();
        tokio::spawn(async move {
            let run = app.store.lookup(&from).await;
            let outcome = match run {
                Ok(Some(Submission {
                    state: State::Succeeded,
                    result: Some(result),
                    ..
                })) => Outcome::Succeeded(result),
                Ok(_) => Outcome::Failed(format!(
                    "answered from the result cache by {from}, whose result is no longer in the store; submit it again"
                )),
                Err(e) => Outcome::Failed(format!(
                    "answered from the result cache by {from}, whose result could not be read ({}); submit it again",
                    report(&e)
                )),
            };
            if let Err(e) = app.finish(&id, outcome).await {
                tracing::warn!(%id, error = %report(&e), "could not end an interrupted answer from the result cache; it times out instead");
            }
        });
    }
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
        // Every one holds a slot of its queue until its build is known: one that never got
        // a build goes back in the queue, in its old place, once the listing below says so.
        let how = match build {
            Some(_) => Restored::Started,
            None => Restored::Held,
        };
        app.dispatch.restore(
            &app.who(&p.sub),
            &id,
            p.fair_tag.unwrap_or(0),
            p.sub.created_at.timestamp_micros(),
            how,
        );
        app.store.reload(p.sub.clone(), p.deadline_ms);
        if let Some(live) = app.store.live(&id) {
            // Due at once: the first pass looks at every reloaded build.
            live.heard.lock().unwrap_or_else(|e| e.into_inner()).due = now;
        }
        if let Some(b) = &build {
            // Events that arrived before the reload were only buffered; none is lost.
            let early = app.store.key_build(&id, &b.id);
            for ev in early {
                let app = app.clone();
                let id = id.clone();
                tokio::spawn(async move { app.apply(&id, ev).await });
            }
        }
        if queued_without_build {
            // No build to look at: its deadline holds from now on.
            app.spawn_timeout(&id, p.deadline_ms);
            orphans.push(p.clone());
        } else {
            timers.push((id, p.deadline_ms));
        }
    }
    let orphan_app = app.clone();
    tokio::spawn(async move { recover_orphans(&orphan_app, orphans).await });
    let (app, reconciler) = (app.clone(), reconciler.clone());
    tokio::spawn(async move {
        // One pass over every reloaded build before their deadlines are enforced, so a
        // build that finished while the service was down is collected rather than timed
        // out; bounded, so an unreachable Buildkite cannot hold the deadlines off.
        match tokio::time::timeout(FIRST_PASS_LIMIT, reconciler.pass(true)).await {
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

// Over 80 lines: the one listing, the twin check and each submission's decision (adopt, create,
// fail) share the listing's results.
/// Submissions without a recorded build: adopt the build each may already have (one
/// listing for all of them), create the rest.
async fn recover_orphans(app: &Arc<App>, orphans: Vec<Pending>) {
    if orphans.is_empty() {
        return;
    }
    let oldest = orphans
        .iter()
        .map(|p| p.sub.created_at)
        .min()
        .unwrap_or_else(Utc::now);
    let since = oldest - chrono::Duration::from_std(MARGIN).unwrap_or_default();
    let mut wait = Duration::from_millis(app.cfg.retry_base_ms.max(10));
    let found: Vec<Found> = loop {
        match app.executor.created_since(since).await {
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
                if orphans.iter().all(|p| app.store.live(&p.sub.id).is_none()) {
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
                    cancel_twin(app, &sid, &f);
                }
                Some(have) => {
                    cancel_twin(app, &sid, have);
                    by_submission.insert(sid, f);
                }
                None => {
                    by_submission.insert(sid, f);
                }
            }
        }
    }
    let mut requeued = std::collections::BTreeSet::new();
    for p in orphans {
        let id = p.sub.id.clone();
        if app.store.live(&id).is_none() {
            continue;
        }
        match by_submission.remove(&id) {
            Some(f) => {
                tracing::info!(%id, build = f.build.number, "adopting the build an interrupted create made");
                app.dispatch.adopted(&p.sub.queue, &id);
                let finished = f.build.finished();
                app.attach(
                    &id,
                    Launched {
                        build: f.info(),
                        running: f.build.state == "running",
                    },
                )
                .await;
                if finished {
                    app.apply(
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
                Some(_) => {
                    // Its build is created from the store's copy of the job when its turn
                    // comes.
                    tracing::info!(%id, "an interrupted submission waits in the queue again");
                    app.dispatch.requeue(&p.sub.queue, &id);
                    requeued.insert(p.sub.queue.clone());
                }
                None => {
                    app.finish_durably(
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
    for queue in requeued {
        app.pump(&queue, None);
    }
}

fn cancel_twin(app: &Arc<App>, submission_id: &str, twin: &Found) {
    tracing::warn!(id = %submission_id, build = twin.build.number, "canceling a second build of the same submission");
    app.spawn_cancel_build(twin.info());
}

/// Recovers `sub` (a submission that had not ended when the service stopped, already back in
/// the store): its build is collected if it finished meanwhile, left to run (or run again) if
/// the executor has it, and failed with the executor's reason if it is lost. A submission
/// without a build, or one that ended, is left alone. Safe to call twice.
pub async fn recover_submission(app: &Arc<App>, sub: &Submission) -> Option<Recovered> {
    if sub.state.is_terminal() {
        return None;
    }
    let build = sub.build.as_ref()?;
    let recovered = match app.executor.recover(build).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(id = %sub.id, build = build.number, error = %report(&*e), "could not recover the build; its events or its timeout will end the submission");
            return None;
        }
    };
    match &recovered {
        Recovered::Running | Recovered::Unknown => {}
        Recovered::Lost(why) => {
            app.finish_durably(&sub.id, Outcome::Failed(why.clone()))
                .await;
        }
        Recovered::Finished(status) if sub.state == State::Fetching => {
            // The collection was under way when the service stopped; the event that starts
            // one will not move a fetching submission again, so collect here.
            app.spawn_collect(&sub.id, sub, status, std::time::Instant::now());
        }
        Recovered::Finished(status) => app.on_event(BuildEvent {
            kind: BuildEventKind::Finished,
            build: status.clone(),
        }),
    }
    Some(recovered)
}
