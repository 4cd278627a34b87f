//! The in-memory part of the store: submissions by id, each behind a `watch` channel that is at once its
//! current value and its waiter list, and a map from Buildkite build id to submission.
//!
//! The build map also holds *early* events: a webhook can arrive before the create-build call
//! that made its build has returned, so the build id is not yet known. Such events wait here
//! (bounded in number and age) and are handed over when the build is attached. The hand-over
//! happens under the map's per-key lock, so an event is either routed or buffered-then-handed
//! over, never lost in between.
//!
//! Everything a durable store must keep is the [`Submission`] value itself; the channels and
//! the build map can be rebuilt from the submissions.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dashmap::mapref::entry::Entry;
use dashmap::DashMap;
use tokio::sync::watch;

use super::InFlight;
use crate::executor::BuildEvent;
use crate::submission::{BuildInfo, State, Submission};

enum BuildSlot {
    Known(String),
    Early {
        events: Vec<BuildEvent>,
        since: Instant,
    },
}

/// Where an event for a build went.
#[derive(Debug, PartialEq, Eq)]
pub enum Routed {
    /// To this submission.
    Submission(String),
    /// Kept until the build is attached (or the TTL passes).
    Buffered,
    /// The early-event buffer is full; the event was dropped.
    Dropped,
}

/// Submissions in memory, each with its waiters; builds mapped to submissions.
pub struct Memory {
    subs: DashMap<String, watch::Sender<Submission>>,
    builds: DashMap<String, BuildSlot>,
    early: AtomicUsize,
    early_max: usize,
    early_ttl: Duration,
}

/// Most events kept per unknown build (a build sends a handful).
const EARLY_EVENTS_PER_BUILD: usize = 8;

impl Memory {
    /// An empty store that keeps early events of at most `early_max` builds, for `early_ttl`.
    pub fn new(early_max: usize, early_ttl: Duration) -> Memory {
        Memory {
            subs: DashMap::new(),
            builds: DashMap::new(),
            early: AtomicUsize::new(0),
            early_max,
            early_ttl,
        }
    }

    /// Adds (or replaces) a submission; its waiters start from this value.
    pub fn insert(&self, sub: Submission) {
        // Re-key the build (a durable store reloading submissions goes through here too).
        if let Some(b) = &sub.build {
            self.builds
                .insert(b.id.clone(), BuildSlot::Known(sub.id.clone()));
        }
        let id = sub.id.clone();
        let (tx, _) = watch::channel(sub);
        self.subs.insert(id, tx);
    }

    /// How many receivers (long-polls, SSE streams, the timeout timer) watch a submission.
    pub fn watchers(&self, id: &str) -> usize {
        self.subs.get(id).map_or(0, |tx| tx.receiver_count())
    }

    /// Submissions in memory.
    pub fn len(&self) -> usize {
        self.subs.len()
    }

    /// No submission in memory.
    pub fn is_empty(&self) -> bool {
        self.subs.is_empty()
    }

    /// Counts the in-flight submissions on `queue`: one pass, no copies.
    pub fn in_flight(&self, queue: &str) -> InFlight {
        let mut n = InFlight::default();
        for entry in self.subs.iter() {
            let s = entry.value().borrow();
            if s.queue != queue {
                continue;
            }
            match s.state {
                State::Queued | State::Scheduled => n.queued += 1,
                State::Running | State::Fetching => n.running += 1,
                State::Succeeded | State::Failed | State::Canceled | State::TimedOut => {}
            }
        }
        n
    }

    /// A copy of the submission's current value.
    pub fn get(&self, id: &str) -> Option<Submission> {
        self.subs.get(id).map(|tx| tx.borrow().clone())
    }

    /// The submission's current state (no copy of the rest).
    pub fn state(&self, id: &str) -> Option<State> {
        self.subs.get(id).map(|tx| tx.borrow().state)
    }

    /// A receiver that sees every later change (the waiter for long-polls and SSE).
    pub fn subscribe(&self, id: &str) -> Option<watch::Receiver<Submission>> {
        self.subs.get(id).map(|tx| tx.subscribe())
    }

    /// Applies `f`; when it reports a change, waiters are woken. Returns the change flag and
    /// the value after `f`, or `None` for an unknown id.
    pub fn update(
        &self,
        id: &str,
        f: impl FnOnce(&mut Submission) -> bool,
    ) -> Option<(bool, Submission)> {
        let tx = self.subs.get(id)?;
        let mut after = None;
        let changed = tx.send_if_modified(|s| {
            let changed = f(s);
            if changed {
                after = Some(s.clone());
            }
            changed
        });
        let after = match after {
            Some(s) => s,
            None => tx.borrow().clone(),
        };
        Some((changed, after))
    }

    /// Like [`Memory::update`] but returns only whether it changed: no clone on the hot path.
    pub fn update_quiet(&self, id: &str, f: impl FnOnce(&mut Submission) -> bool) -> bool {
        match self.subs.get(id) {
            Some(tx) => tx.send_if_modified(f),
            None => false,
        }
    }

    /// Records the submission's build and returns the events that arrived for it early.
    pub fn attach_build(&self, id: &str, build: BuildInfo) -> Vec<BuildEvent> {
        let build_id = build.id.clone();
        let now = chrono::Utc::now();
        if !self.subs.contains_key(id) {
            // Evicted while its create call was in flight: keying the build to it would leave
            // an entry nothing ever removes.
            return Vec::new();
        }
        self.update_quiet(id, |s| s.attach_build(build, now));
        match self.builds.entry(build_id) {
            Entry::Occupied(mut e) => {
                let old = std::mem::replace(e.get_mut(), BuildSlot::Known(id.to_string()));
                match old {
                    BuildSlot::Early { events, .. } => {
                        self.early.fetch_sub(1, Ordering::Relaxed);
                        events
                    }
                    BuildSlot::Known(_) => Vec::new(),
                }
            }
            Entry::Vacant(e) => {
                e.insert(BuildSlot::Known(id.to_string()));
                Vec::new()
            }
        }
    }

    /// Finds the submission of `event`'s build, or keeps the event for a build not yet attached.
    pub fn route(&self, event: &BuildEvent) -> Routed {
        if let Some(slot) = self.builds.get(&event.build.id) {
            if let BuildSlot::Known(id) = &*slot {
                return Routed::Submission(id.clone());
            }
        }
        match self.builds.entry(event.build.id.clone()) {
            Entry::Occupied(mut e) => match e.get_mut() {
                BuildSlot::Known(id) => Routed::Submission(id.clone()),
                BuildSlot::Early { events, .. } => {
                    if events.len() < EARLY_EVENTS_PER_BUILD {
                        events.push(event.clone());
                        Routed::Buffered
                    } else {
                        Routed::Dropped
                    }
                }
            },
            Entry::Vacant(e) => {
                // Check and take a slot in one step: a load then an add lets concurrent
                // deliveries for different builds (different shards) all pass the check.
                let max = self.early_max;
                let reserved = self
                    .early
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                        (n < max).then_some(n + 1)
                    });
                if reserved.is_err() {
                    return Routed::Dropped;
                }
                e.insert(BuildSlot::Early {
                    events: vec![event.clone()],
                    since: Instant::now(),
                });
                Routed::Buffered
            }
        }
    }

    /// Forgets early events older than the TTL; returns how many builds' events went.
    pub fn sweep_early(&self, now: Instant) -> usize {
        let ttl = self.early_ttl;
        let mut removed = 0;
        self.builds.retain(|_, slot| match slot {
            BuildSlot::Early { since, .. } if now.saturating_duration_since(*since) >= ttl => {
                removed += 1;
                false
            }
            _ => true,
        });
        self.early.fetch_sub(removed, Ordering::Relaxed);
        removed
    }

    /// Builds whose events wait for their create call to return.
    pub fn early_len(&self) -> usize {
        self.early.load(Ordering::Relaxed)
    }

    /// Drops finished submissions that ended before `cutoff` (they live on in the data dir).
    pub fn evict_finished(&self, cutoff: chrono::DateTime<chrono::Utc>) -> usize {
        let mut gone = Vec::new();
        let mut evicted = 0;
        self.subs.retain(|_, tx| {
            let s = tx.borrow();
            let old = s.finished_at.is_some_and(|t| t < cutoff);
            if old {
                evicted += 1;
                if let Some(b) = &s.build {
                    gone.push(b.id.clone());
                }
            }
            !old
        });
        for b in &gone {
            self.builds.remove(b);
        }
        evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::executor::{BuildEventKind, BuildStatus};

    fn ev(build: &str, kind: BuildEventKind) -> BuildEvent {
        BuildEvent {
            kind,
            build: BuildStatus {
                id: build.into(),
                number: 1,
                state: "running".into(),
                web_url: String::new(),
                blocked: false,
            },
        }
    }

    fn sub(id: &str) -> Submission {
        Submission::new(id.into(), "q".into(), None, None, 60, chrono::Utc::now())
    }

    #[test]
    fn early_events_are_handed_over_on_attach() {
        let store = Memory::new(10, Duration::from_secs(60));
        store.insert(sub("s1"));
        assert_eq!(
            store.route(&ev("b1", BuildEventKind::Running)),
            Routed::Buffered
        );
        assert_eq!(store.early_len(), 1);
        let got = store.attach_build(
            "s1",
            BuildInfo {
                id: "b1".into(),
                number: 1,
                web_url: "w".into(),
            },
        );
        assert_eq!(got.len(), 1);
        assert_eq!(store.early_len(), 0);
        assert_eq!(
            store.route(&ev("b1", BuildEventKind::Running)),
            Routed::Submission("s1".into())
        );
        assert_eq!(store.get("s1").unwrap().state, State::Scheduled);
    }

    #[test]
    fn early_buffer_is_bounded_and_expires() {
        let store = Memory::new(2, Duration::from_millis(0));
        assert_eq!(
            store.route(&ev("a", BuildEventKind::Running)),
            Routed::Buffered
        );
        assert_eq!(
            store.route(&ev("b", BuildEventKind::Running)),
            Routed::Buffered
        );
        assert_eq!(
            store.route(&ev("c", BuildEventKind::Running)),
            Routed::Dropped
        );
        for _ in 0..EARLY_EVENTS_PER_BUILD - 1 {
            assert_eq!(
                store.route(&ev("a", BuildEventKind::Running)),
                Routed::Buffered
            );
        }
        assert_eq!(
            store.route(&ev("a", BuildEventKind::Running)),
            Routed::Dropped
        );
        assert_eq!(store.sweep_early(Instant::now()), 2);
        assert_eq!(store.early_len(), 0);
        assert_eq!(
            store.route(&ev("c", BuildEventKind::Running)),
            Routed::Buffered
        );
    }

    #[test]
    fn concurrent_route_and_attach_never_lose_an_event() {
        // Race a webhook against the create-build response many times: the event must reach
        // the submission exactly once, either directly or through the hand-over.
        for i in 0..200 {
            let store = std::sync::Arc::new(Memory::new(100, Duration::from_secs(60)));
            let sid = format!("s{i}");
            store.insert(sub(&sid));
            let s2 = store.clone();
            let routed = std::thread::spawn(move || s2.route(&ev("b", BuildEventKind::Finished)));
            let handed = store.attach_build(
                &sid,
                BuildInfo {
                    id: "b".into(),
                    number: 1,
                    web_url: String::new(),
                },
            );
            let routed = routed.join().unwrap();
            let direct = matches!(routed, Routed::Submission(_));
            assert!(
                direct ^ (handed.len() == 1),
                "routed={routed:?} handed={}",
                handed.len()
            );
        }
    }

    #[test]
    fn the_early_bound_holds_under_concurrent_webhooks() {
        // Many deliveries for distinct unknown builds at once: never more than early_max kept.
        for round in 0..300 {
            let store = std::sync::Arc::new(Memory::new(2, Duration::from_secs(60)));
            let start = std::sync::Arc::new(std::sync::Barrier::new(8));
            let threads: Vec<_> = (0..8)
                .map(|t| {
                    let (store, start) = (store.clone(), start.clone());
                    std::thread::spawn(move || {
                        start.wait();
                        (0..4)
                            .filter(|i| {
                                let ev = ev(&format!("b{t}-{i}"), BuildEventKind::Finished);
                                store.route(&ev) == Routed::Buffered
                            })
                            .count()
                    })
                })
                .collect();
            let kept: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
            assert_eq!((kept, store.early_len()), (2, 2), "round {round}");
        }
    }

    #[test]
    fn eviction_drops_only_old_finished_submissions() {
        let store = Memory::new(10, Duration::from_secs(60));
        for id in ["done", "pending"] {
            store.insert(sub(id));
            store.attach_build(
                id,
                BuildInfo {
                    id: format!("b-{id}"),
                    number: 1,
                    web_url: String::new(),
                },
            );
        }
        let rx = store.subscribe("done").unwrap();
        store.update_quiet("done", |s| {
            s.finish(
                crate::submission::Outcome::Failed("x".into()),
                chrono::Utc::now(),
            )
        });
        assert_eq!(
            store.evict_finished(chrono::Utc::now() - chrono::Duration::hours(1)),
            0
        );
        assert_eq!(
            store.evict_finished(chrono::Utc::now() + chrono::Duration::seconds(1)),
            1
        );
        assert!(store.get("done").is_none() && store.get("pending").is_some());
        assert!(rx.has_changed().is_err(), "waiters see the channel close");
        // The evicted build is unknown again: its late events are only buffered.
        assert_eq!(
            store.route(&ev("b-done", BuildEventKind::Finished)),
            Routed::Buffered
        );
        assert_eq!(
            store.route(&ev("b-pending", BuildEventKind::Finished)),
            Routed::Submission("pending".into())
        );
    }

    #[test]
    fn attaching_to_an_unknown_submission_keys_nothing() {
        let store = Memory::new(10, Duration::from_secs(60));
        let info = BuildInfo {
            id: "b".into(),
            number: 1,
            web_url: String::new(),
        };
        assert!(store.attach_build("gone", info).is_empty());
        assert_eq!(
            store.route(&ev("b", BuildEventKind::Finished)),
            Routed::Buffered,
            "no build entry points at a submission that does not exist"
        );
    }

    #[test]
    fn in_flight_counts_by_queue_and_state() {
        let store = Memory::new(1, Duration::from_secs(1));
        let now = chrono::Utc::now();
        for (id, queue, state) in [
            ("a", "h100", State::Queued),
            ("b", "h100", State::Scheduled),
            ("c", "h100", State::Running),
            ("d", "h100", State::Fetching),
            ("e", "b200", State::Running),
        ] {
            let mut s = Submission::new(id.into(), queue.into(), None, None, 60, now);
            s.advance(state, now);
            store.insert(s);
        }
        let mut done = Submission::new("f".into(), "h100".into(), None, None, 60, now);
        done.finish(crate::submission::Outcome::Failed("x".into()), now);
        store.insert(done);
        assert_eq!(
            store.in_flight("h100"),
            InFlight {
                queued: 2,
                running: 2
            }
        );
        assert_eq!(store.in_flight("b200").running, 1);
        assert_eq!(store.in_flight("none"), InFlight::default());
    }

    #[test]
    fn waiters_wake_on_change_only() {
        let store = Memory::new(1, Duration::from_secs(1));
        store.insert(sub("s"));
        let mut rx = store.subscribe("s").unwrap();
        rx.borrow_and_update();
        assert!(!store.update_quiet("s", |s| s.advance(State::Queued, chrono::Utc::now())));
        assert!(!rx.has_changed().unwrap());
        assert!(store.update_quiet("s", |s| s.advance(State::Running, chrono::Utc::now())));
        assert!(rx.has_changed().unwrap());
    }
}
