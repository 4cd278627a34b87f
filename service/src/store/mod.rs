//! Where submissions live: the one interface the core reads and writes them through.
//!
//! [`Store`] keeps every submission in memory (`memory`: each a `watch` channel that is at
//! once its value and its waiter list, plus the map from build id to submission), and hands
//! finished ones to a [`Durable`] store when there is one ([`Archive`] today: one file per
//! finished submission). A durable store that keeps every change (SQLite, later Postgres)
//! implements [`Durable`] and sits behind the same interface; what it must keep is the
//! [`Submission`] value alone, since the channels and the build map are rebuilt from it
//! ([`crate::App::adopt`]).

pub mod archive;
mod memory;

use std::time::{Duration, Instant};

use tokio::sync::watch;

pub use archive::Archive;
pub use memory::Routed;

use crate::executor::{BoxFuture, BuildEvent};
use crate::report::{report, BoxError};
use crate::submission::{BuildInfo, State, Submission};
use memory::Memory;

/// Keeps submissions beyond the process's memory.
pub trait Durable: Send + Sync + 'static {
    /// Keeps `sub`, replacing what was kept under its id.
    fn save<'a>(&'a self, sub: &'a Submission) -> BoxFuture<'a, Result<(), BoxError>>;

    /// The submission kept under `id`, if any.
    fn load<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Submission>, BoxError>>;
}

/// A queue's in-flight submissions, by what they wait for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InFlight {
    /// Waiting for a machine: `queued` or `scheduled`.
    pub queued: u64,
    /// On a machine, or its result being fetched: `running` or `fetching`.
    pub running: u64,
}

/// Submissions in memory with their waiters, and (optionally) a durable store behind them.
pub struct Store {
    memory: Memory,
    durable: Option<Box<dyn Durable>>,
}

impl Store {
    /// An empty store. Events for builds not yet attached are kept for at most `early_max`
    /// builds, for `early_ttl`.
    pub fn new(early_max: usize, early_ttl: Duration, durable: Option<Box<dyn Durable>>) -> Store {
        Store {
            memory: Memory::new(early_max, early_ttl),
            durable,
        }
    }

    /// Adds (or replaces) a submission in memory; its waiters start from this value.
    pub fn insert(&self, sub: Submission) {
        self.memory.insert(sub)
    }

    /// The submission in memory.
    pub fn get(&self, id: &str) -> Option<Submission> {
        self.memory.get(id)
    }

    /// The submission in memory, else from the durable store (finished submissions that left
    /// memory, or were kept before a restart).
    pub async fn lookup(&self, id: &str) -> Option<Submission> {
        if let Some(s) = self.memory.get(id) {
            return Some(s);
        }
        match self.durable.as_ref()?.load(id).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(%id, error = %report(&*e), "could not read the submission from KERNELKITE_DATA_DIR");
                None
            }
        }
    }

    /// The state of the submission in memory.
    pub fn state(&self, id: &str) -> Option<State> {
        self.memory.state(id)
    }

    /// A receiver that sees every later change of the submission (the waiter of long-polls,
    /// SSE streams and the timeout timer).
    pub fn subscribe(&self, id: &str) -> Option<watch::Receiver<Submission>> {
        self.memory.subscribe(id)
    }

    /// How many receivers watch the submission.
    pub fn watchers(&self, id: &str) -> usize {
        self.memory.watchers(id)
    }

    /// Applies `f`; when it reports a change, waiters are woken. Returns the change flag and
    /// the value after `f`, or `None` for an id not in memory.
    pub fn update(
        &self,
        id: &str,
        f: impl FnOnce(&mut Submission) -> bool,
    ) -> Option<(bool, Submission)> {
        self.memory.update(id, f)
    }

    /// Like [`Store::update`] but returns only whether it changed: no copy on the hot path.
    pub fn update_quiet(&self, id: &str, f: impl FnOnce(&mut Submission) -> bool) -> bool {
        self.memory.update_quiet(id, f)
    }

    /// Records the submission's build and returns the events that arrived for it early.
    pub fn attach_build(&self, id: &str, build: BuildInfo) -> Vec<BuildEvent> {
        self.memory.attach_build(id, build)
    }

    /// Finds the submission of `event`'s build, or keeps the event for a build not yet
    /// attached.
    pub fn route(&self, event: &BuildEvent) -> Routed {
        self.memory.route(event)
    }

    /// Forgets early events older than their TTL; returns how many builds' events went.
    pub fn sweep_early(&self, now: Instant) -> usize {
        self.memory.sweep_early(now)
    }

    /// Builds whose events wait for their create call to return.
    pub fn early_len(&self) -> usize {
        self.memory.early_len()
    }

    /// Drops finished submissions that ended before `cutoff` from memory (the durable store
    /// keeps them).
    pub fn evict_finished(&self, cutoff: chrono::DateTime<chrono::Utc>) -> usize {
        self.memory.evict_finished(cutoff)
    }

    /// The in-flight submissions on `queue` (all in memory: only finished ones leave it).
    pub fn in_flight(&self, queue: &str) -> InFlight {
        self.memory.in_flight(queue)
    }

    /// Submissions in memory.
    pub fn len(&self) -> usize {
        self.memory.len()
    }

    /// No submission in memory.
    pub fn is_empty(&self) -> bool {
        self.memory.is_empty()
    }

    /// Whether finished submissions are kept beyond memory.
    pub fn is_durable(&self) -> bool {
        self.durable.is_some()
    }

    /// Hands a finished submission to the durable store, if there is one.
    pub async fn keep_finished(&self, sub: &Submission) -> Result<(), BoxError> {
        match &self.durable {
            Some(d) => d.save(sub).await,
            None => Ok(()),
        }
    }

    /// Whether the store can be read and written now (`GET /healthz`, `GET /readyz`).
    // placeholder until the durable store lands: always healthy
    pub async fn health(&self) -> Result<(), crate::report::BoxError> {
        Ok(())
    }
}
