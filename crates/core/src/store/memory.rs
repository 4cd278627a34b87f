//! The in-memory part of the store: the submissions in flight by id, each behind a `watch`
//! channel that is at once its current value and its waiter list, and a map from build id to
//! submission. A submission leaves memory the moment it ends (after its end is committed);
//! finished submissions are read from the durable store.
//!
//! The build map also holds *early* events: a webhook can arrive before the create-build call
//! that made its build has returned, so the build id is not yet known. Such events wait here
//! (bounded in number and age) and are handed over when the build is keyed. The hand-over
//! happens under the map's per-key lock, so an event is either routed or buffered-then-handed
//! over, never lost in between. Builds of submissions that just ended are remembered for the
//! same time, so their late or repeated deliveries are dropped instead of buffered.
//!
//! Everything a durable store must keep is the [`Submission`] value itself; the channels and
//! the build map are rebuilt from it on start.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::mapref::entry::Entry;
use dashmap::DashMap;
use tokio::sync::watch;

use super::InFlight;
use crate::executor::BuildEvent;
use crate::submission::{State, Submission};

enum BuildSlot {
    Known(String),
    Early {
        events: Vec<BuildEvent>,
        since: Instant,
    },
    /// The submission ended; late deliveries are ignored until the slot expires.
    Done(Instant),
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
    /// The build's submission already ended; the event changes nothing.
    Ended,
}

/// When a submission was last heard of, and when the reconciler looks at it next.
#[derive(Debug, Clone, Copy)]
pub struct Heard {
    /// The last event, create response or check.
    pub at: Instant,
    /// The wait before the next check; doubles after each check that found nothing.
    pub backoff: Duration,
    /// When it is due for a check.
    pub due: Instant,
}

/// A submission in flight.
pub struct Live {
    pub(crate) tx: watch::Sender<Submission>,
    /// Serializes changes: each is committed, then sent, before the next starts.
    pub(crate) lock: tokio::sync::Mutex<()>,
    /// When it must have ended (unix ms).
    pub deadline_ms: i64,
    /// The reconciler's view of it.
    pub heard: std::sync::Mutex<Heard>,
    /// Its result is being collected.
    pub collecting: AtomicBool,
}

/// Submissions in flight, each with its waiters; builds mapped to submissions.
pub struct Memory {
    subs: DashMap<String, Arc<Live>>,
    builds: DashMap<String, BuildSlot>,
    early: AtomicUsize,
    early_max: usize,
    early_ttl: Duration,
    first_check: Duration,
}

/// Most events kept per unknown build (a build sends a handful).
const EARLY_EVENTS_PER_BUILD: usize = 8;

impl Memory {
    /// An empty store that keeps early events of at most `early_max` builds, for `early_ttl`;
    /// a new submission is first due for a reconciler check after `first_check`.
    pub fn new(early_max: usize, early_ttl: Duration, first_check: Duration) -> Memory {
        Memory {
            subs: DashMap::new(),
            builds: DashMap::new(),
            early: AtomicUsize::new(0),
            early_max,
            early_ttl,
            first_check,
        }
    }

    /// Adds (or replaces) a submission; its waiters start from this value. Its build, if it
    /// has one, is keyed too.
    pub fn insert(&self, sub: Submission, deadline_ms: i64) {
        self.put(sub, deadline_ms, true);
    }

    /// Inserts `sub` unless it is already in memory; whether it was inserted. The check and
    /// the insert are one step under the map's lock: of two callers racing with one
    /// submission, one inserts it.
    pub fn insert_if_absent(&self, sub: Submission, deadline_ms: i64) -> bool {
        self.put(sub, deadline_ms, false)
    }

    /// Inserts `sub`, over one already in memory only with `replace`; whether it did.
    fn put(&self, sub: Submission, deadline_ms: i64, replace: bool) -> bool {
        let id = sub.id.clone();
        let build = sub.build.as_ref().map(|b| b.id.clone());
        let now = Instant::now();
        let live = || {
            let (tx, _) = watch::channel(sub);
            Arc::new(Live {
                tx,
                lock: tokio::sync::Mutex::new(()),
                deadline_ms,
                heard: std::sync::Mutex::new(Heard {
                    at: now,
                    backoff: self.first_check,
                    due: now + self.first_check,
                }),
                collecting: AtomicBool::new(false),
            })
        };
        let inserted = match self.subs.entry(id.clone()) {
            Entry::Occupied(mut e) if replace => {
                e.insert(live());
                true
            }
            Entry::Occupied(_) => false,
            Entry::Vacant(e) => {
                e.insert(live());
                true
            }
        };
        if let (true, Some(b)) = (inserted, build) {
            self.builds.insert(b, BuildSlot::Known(id));
        }
        inserted
    }

    /// The submission in flight.
    pub fn live(&self, id: &str) -> Option<Arc<Live>> {
        self.subs.get(id).map(|l| l.clone())
    }

    /// Every submission in flight.
    pub fn all(&self) -> Vec<(String, Arc<Live>)> {
        self.subs
            .iter()
            .map(|e| (e.key().clone(), e.value().clone()))
            .collect()
    }

    /// Forgets an ended submission; its build's late deliveries are ignored for a while.
    pub fn remove(&self, id: &str) {
        if let Some((_, live)) = self.subs.remove(id) {
            if let Some(b) = &live.tx.borrow().build {
                self.builds
                    .insert(b.id.clone(), BuildSlot::Done(Instant::now()));
            }
        }
    }

    /// How many receivers (long-polls, SSE streams, the timeout timer) watch a submission.
    pub fn watchers(&self, id: &str) -> usize {
        self.subs.get(id).map_or(0, |l| l.tx.receiver_count())
    }

    /// Submissions in flight.
    pub fn len(&self) -> usize {
        self.subs.len()
    }

    /// None in flight.
    pub fn is_empty(&self) -> bool {
        self.subs.is_empty()
    }

    /// Counts the in-flight submissions on `queue`: one pass, no copies.
    pub fn in_flight(&self, queue: &str) -> InFlight {
        let mut n = InFlight::default();
        for entry in self.subs.iter() {
            let s = entry.value().tx.borrow();
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
        self.subs.get(id).map(|l| l.tx.borrow().clone())
    }

    /// The submission's current state (no copy of the rest).
    pub fn state(&self, id: &str) -> Option<State> {
        self.subs.get(id).map(|l| l.tx.borrow().state)
    }

    /// A receiver that sees every later change (the waiter for long-polls and SSE).
    pub fn subscribe(&self, id: &str) -> Option<watch::Receiver<Submission>> {
        self.subs.get(id).map(|l| l.tx.subscribe())
    }

    /// Keys `build_id` to the submission and returns the events that arrived for it early.
    pub fn key_build(&self, id: &str, build_id: &str) -> Vec<BuildEvent> {
        if !self.subs.contains_key(id) {
            // Ended while its create call was in flight: keying the build to it would leave
            // an entry nothing ever removes.
            return Vec::new();
        }
        match self.builds.entry(build_id.to_string()) {
            Entry::Occupied(mut e) => {
                let old = std::mem::replace(e.get_mut(), BuildSlot::Known(id.to_string()));
                match old {
                    BuildSlot::Early { events, .. } => {
                        self.early.fetch_sub(1, Ordering::Relaxed);
                        events
                    }
                    BuildSlot::Known(_) | BuildSlot::Done(_) => Vec::new(),
                }
            }
            Entry::Vacant(e) => {
                e.insert(BuildSlot::Known(id.to_string()));
                Vec::new()
            }
        }
    }

    /// The submission a build is keyed to.
    pub fn submission_of(&self, build_id: &str) -> Option<String> {
        match self.builds.get(build_id).as_deref() {
            Some(BuildSlot::Known(id)) => Some(id.clone()),
            _ => None,
        }
    }

    /// Finds the submission of `event`'s build, or keeps the event for a build not yet keyed.
    pub fn route(&self, event: &BuildEvent) -> Routed {
        if let Some(slot) = self.builds.get(&event.build.id) {
            match &*slot {
                BuildSlot::Known(id) => return Routed::Submission(id.clone()),
                BuildSlot::Done(_) => return Routed::Ended,
                BuildSlot::Early { .. } => {}
            }
        }
        match self.builds.entry(event.build.id.clone()) {
            Entry::Occupied(mut e) => match e.get_mut() {
                BuildSlot::Known(id) => Routed::Submission(id.clone()),
                BuildSlot::Done(_) => Routed::Ended,
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

    /// Forgets early events, and ended builds, older than the TTL; returns how many builds'
    /// early events went.
    pub fn sweep_early(&self, now: Instant) -> usize {
        let ttl = self.early_ttl;
        let mut removed = 0;
        self.builds.retain(|_, slot| match slot {
            BuildSlot::Early { since, .. } if now.saturating_duration_since(*since) >= ttl => {
                removed += 1;
                false
            }
            BuildSlot::Done(since) => now.saturating_duration_since(*since) < ttl,
            _ => true,
        });
        self.early.fetch_sub(removed, Ordering::Relaxed);
        removed
    }

    /// Builds whose events wait for their create call to return.
    pub fn early_len(&self) -> usize {
        self.early.load(Ordering::Relaxed)
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

    fn mem(max: usize, ttl: Duration) -> Memory {
        Memory::new(max, ttl, Duration::from_secs(30))
    }

    #[test]
    fn early_events_are_handed_over_when_the_build_is_keyed() {
        let store = mem(10, Duration::from_secs(60));
        store.insert(sub("s1"), 0);
        assert_eq!(
            store.route(&ev("b1", BuildEventKind::Running)),
            Routed::Buffered
        );
        assert_eq!(store.early_len(), 1);
        let got = store.key_build("s1", "b1");
        assert_eq!(got.len(), 1);
        assert_eq!(store.early_len(), 0);
        assert_eq!(
            store.route(&ev("b1", BuildEventKind::Running)),
            Routed::Submission("s1".into())
        );
    }

    #[test]
    fn early_buffer_is_bounded_and_expires() {
        let store = mem(2, Duration::from_millis(0));
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
    fn concurrent_route_and_key_never_lose_an_event() {
        // Race a webhook against the create-build response many times: the event must reach
        // the submission exactly once, either directly or through the hand-over.
        for i in 0..200 {
            let store = std::sync::Arc::new(mem(100, Duration::from_secs(60)));
            let sid = format!("s{i}");
            store.insert(sub(&sid), 0);
            let s2 = store.clone();
            let routed = std::thread::spawn(move || s2.route(&ev("b", BuildEventKind::Finished)));
            let handed = store.key_build(&sid, "b");
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
            let store = std::sync::Arc::new(mem(2, Duration::from_secs(60)));
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
    fn an_ended_submission_leaves_memory_and_its_late_events_are_ignored() {
        let store = mem(10, Duration::from_millis(0));
        for id in ["done", "pending"] {
            let mut s = sub(id);
            s.attach_build(
                crate::submission::BuildInfo {
                    id: format!("b-{id}"),
                    number: 1,
                    web_url: String::new(),
                },
                chrono::Utc::now(),
            );
            store.insert(s, 0);
        }
        store.remove("done");
        assert!(store.get("done").is_none() && store.get("pending").is_some());
        assert_eq!(
            store.route(&ev("b-done", BuildEventKind::Finished)),
            Routed::Ended
        );
        assert_eq!(store.early_len(), 0, "not buffered as early");
        assert_eq!(
            store.route(&ev("b-pending", BuildEventKind::Finished)),
            Routed::Submission("pending".into())
        );
        // The memory of ended builds expires with the early events.
        store.sweep_early(Instant::now());
        assert_eq!(
            store.route(&ev("b-done", BuildEventKind::Finished)),
            Routed::Buffered
        );
    }

    #[test]
    fn keying_a_build_to_an_unknown_submission_keys_nothing() {
        let store = mem(10, Duration::from_secs(60));
        assert!(store.key_build("gone", "b").is_empty());
        assert_eq!(
            store.route(&ev("b", BuildEventKind::Finished)),
            Routed::Buffered,
            "no build entry points at a submission that does not exist"
        );
    }

    #[test]
    fn in_flight_counts_by_queue_and_state() {
        let store = Memory::new(1, Duration::from_secs(1), Duration::from_secs(30));
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
            store.insert(s, 0);
        }
        let mut done = Submission::new("f".into(), "h100".into(), None, None, 60, now);
        done.finish(crate::submission::Outcome::Failed("x".into()), now);
        store.insert(done, 0);
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
}
