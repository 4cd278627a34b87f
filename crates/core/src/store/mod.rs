//! Where submissions live: the one interface the core reads and writes them through.
//!
//! [`Store`] joins two parts. Memory (`memory`) holds only the submissions in flight, each a
//! `watch` channel that is at once its value and its waiter list, plus the map from build id to
//! submission. The durable part ([`Durable`]; the service's SQLite store by default) holds everything, and is
//! written first: a change is committed, then sent to the waiters ("commit, then wake"), so
//! nothing a client, an SSE stream or a webhook answer was told can be lost by a crash. A
//! submission leaves memory the moment its end is committed; from then on it is read from the
//! durable store, so memory does not grow with history.

mod in_memory;
mod memory;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

pub use in_memory::InMemory;
pub use memory::{Heard, Live, Routed};

use futures_util::future::BoxFuture;

use crate::executor::{BuildEvent, Job};
use crate::metrics::{Metrics, StateLabel};
use crate::report::BoxError;
use crate::submission::{Place, State, Submission};
use memory::Memory;

// The types of the `Durable` interface: any backend's (SQLite's now, Postgres's later).

/// Why the store cannot be used. Each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be opened or created.
    #[error("cannot open the store {}: {}; check that KERNELKITE_DATA_DIR and the file are readable and writable by this user", .path.display(), .cause)]
    Open {
        /// The database file.
        path: PathBuf,
        /// Why, with its causes.
        cause: String,
    },
    /// Another process holds the data directory (one service per data directory: two would
    /// both recover and run its submissions).
    #[error("the data directory {} is in use by another kernelkite-service ({holder}); stop that one first, or give this one another KERNELKITE_DATA_DIR", .dir.display())]
    Locked {
        /// The data directory.
        dir: PathBuf,
        /// Who holds it, as its lock file says (pid, host, since when).
        holder: String,
    },
    /// The database file was deleted, replaced or overwritten while the service ran: what it
    /// writes would be lost (an unlinked file) or land in another file.
    #[error("the store {} {what} while the service ran; nothing more is written. Put the file back (restore it from a backup) and restart the service", .path.display())]
    Gone {
        /// The database file.
        path: PathBuf,
        /// What happened to it.
        what: String,
    },
    /// The database file was found damaged while the service ran: nothing more is written.
    #[error("the store {} was found damaged while the service ran (SQLite: {detail}); nothing more is written. Restart the service: it checks the file at start, and if it refuses the file, restore the last backup (service/README.md, \"Backups\")", .path.display())]
    Damaged {
        /// The database file.
        path: PathBuf,
        /// What SQLite said.
        detail: String,
    },
    /// The database file is damaged.
    #[error("the store {} is corrupted ({detail}); restore it from a backup, or move it and its -wal and -shm files away to start with an empty store", .path.display())]
    Corrupt {
        /// The database file.
        path: PathBuf,
        /// What SQLite reported.
        detail: String,
    },
    /// The PostgreSQL store cannot be opened: the server does not answer, refuses the
    /// credentials, or the schema cannot be created or migrated.
    #[error("cannot open the store in PostgreSQL at {target}: {cause}; check KERNELKITE_DATABASE_URL (host, port, user, password, sslmode), that the server accepts connections from here, and that the user may create the schema (KERNELKITE_DATABASE_SCHEMA) or that it exists")]
    Database {
        /// The URL without its password, and the schema.
        target: String,
        /// Why, with its causes.
        cause: String,
    },
    /// Another service holds the PostgreSQL schema (one service per schema: two would both
    /// recover and run its submissions).
    #[error("the PostgreSQL schema {schema} is in use by another kernelkite-service ({holder}); stop that one first, or give this one another KERNELKITE_DATABASE_SCHEMA")]
    DatabaseInUse {
        /// The schema.
        schema: String,
        /// Who holds it, as the server shows its session.
        holder: String,
    },
    /// The connection holding the PostgreSQL schema's lock was lost while the service ran:
    /// another service may hold it now, so nothing more is written.
    #[error("the store lost its hold on PostgreSQL at {target} ({cause}); nothing more is written. Restart the service once the database answers again")]
    DatabaseLost {
        /// The URL without its password, and the schema.
        target: String,
        /// Why the connection was lost.
        cause: String,
    },
    /// A change could not be committed to PostgreSQL; nothing of it was kept.
    #[error("the store could not save the change in PostgreSQL ({0}); check that the database server answers and accepts writes, then retry")]
    DatabaseWrite(String),
    /// A change could not be committed; nothing of it was kept.
    #[error("the store could not save the change ({0}); free disk space in KERNELKITE_DATA_DIR or check the disk, then retry")]
    Write(String),
    /// A read failed.
    #[error("the store could not be read ({0})")]
    Read(String),
    /// The database thread is gone (the service is stopping).
    #[error("the store is closed")]
    Closed,
}

/// What the result cache looks for ([`Durable::cached`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheQuery {
    /// The cache key (runner version, queue, run config).
    pub key: String,
    /// Accepted at or after this, unix ms (KERNELKITE_CACHE_MAX_AGE_S).
    pub since_ms: i64,
    /// Its own timeout at most this, ms: a run that succeeded within a timeout also succeeds
    /// within a longer one, but might have been cut short by a shorter one, so a request
    /// is only answered by a run that had no more time than the request gives.
    pub max_timeout_ms: i64,
}

/// A finished submission's callback, written with its terminal state in one transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewCallback {
    /// Where it is POSTed.
    pub url: String,
    /// The exact bytes POSTed on every attempt (the final submission's JSON); `None`: the
    /// submission as stored, read when it is due (an answer from the result cache, which
    /// keeps no copy of the result it refers to).
    pub body: Option<String>,
    /// After this (unix ms) no further attempt is made.
    pub give_up_at_ms: i64,
}

/// A callback waiting in the outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueCallback {
    /// The submission (also the callback's idempotency key).
    pub submission_id: String,
    /// Where it is POSTed.
    pub url: String,
    /// What is POSTed.
    pub body: String,
    /// Attempts made so far.
    pub attempts: i64,
    /// After this (unix ms) it is given up.
    pub give_up_at_ms: i64,
}

/// Where a callback stands after an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallbackState {
    /// Waiting for its next attempt.
    Pending,
    /// The receiver answered 2xx.
    Delivered,
    /// The receiver refused it for good (4xx other than 408/429, or a redirect).
    Refused,
    /// Retried until KERNELKITE_CALLBACK_RETRY_S passed.
    GivenUp,
}

impl CallbackState {
    /// The state as the store writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            CallbackState::Pending => "pending",
            CallbackState::Delivered => "delivered",
            CallbackState::Refused => "refused",
            CallbackState::GivenUp => "given_up",
        }
    }
}

/// A submission to write before its build is created.
#[derive(Debug, Clone)]
pub struct NewSubmission {
    /// The submission.
    pub sub: Submission,
    /// What its executor needs to (re)create its build.
    pub job: Job,
    /// Its absolute deadline, unix ms.
    pub deadline_ms: i64,
    /// The client's `Idempotency-Key`, with the SHA-256 of the request it came with.
    pub idempotency: Option<(String, String)>,
    /// Its start tag in the fair queue (`crate::fairshare`); none: it never waits there (a
    /// cache answer).
    pub fair_tag: Option<u64>,
    /// What an identical submission is found by (the result cache, `App::prepare`).
    pub cache_key: Option<String>,
}

/// A submission queued recently, as the quotas count it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    /// Its queue.
    pub queue: String,
    /// Its user (none: the anonymous user).
    pub user: Option<String>,
    /// Its class.
    pub class: crate::fairshare::Class,
    /// When it was accepted, unix ms.
    pub created_at_ms: i64,
    /// An answer from the result cache (counted by the cache's own limit too).
    pub cached: bool,
}

/// A run's measured time, as a restart reads it back for its queue's estimate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ran {
    /// Its queue.
    pub queue: String,
    /// From `running` to its end.
    pub took: Duration,
}

/// What inserting a submission did.
#[derive(Debug, Clone)]
pub enum Inserted {
    /// Written.
    Created,
    /// The idempotency key was used before: the submission it made, and whether the earlier
    /// request was the same.
    Existing {
        /// The submission the key made.
        sub: Box<Submission>,
        /// The earlier request had the same hash.
        same_request: bool,
    },
}

/// A submission that had not ended when the store was last written.
#[derive(Debug, Clone)]
pub struct Pending {
    /// The submission.
    pub sub: Submission,
    /// Its job, to create its build again.
    pub job: Option<Job>,
    /// Its absolute deadline, unix ms.
    pub deadline_ms: i64,
    /// Its start tag in the fair queue, when it was queued there.
    pub fair_tag: Option<u64>,
}

/// What a store opened with: the submissions that had not ended, those queued in the last
/// hour (the hourly quotas' count), and each queue's last runs (its estimated run time).
#[derive(Debug, Clone, Default)]
pub struct Reopened {
    /// Every submission that had not ended.
    pub pending: Vec<Pending>,
    /// The submissions queued in the last hour.
    pub accepted: Vec<Accepted>,
    /// Per queue its last [`RECENT_RUNS`](crate::dispatch::RECENT_RUNS) runs to end, of the
    /// submissions of the last week, earliest end first.
    pub runs: Vec<Ran>,
}

/// Now, unix milliseconds.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// What must outlive the process: every submission with its job, deadline and idempotency
/// key, and the callback outbox. Narrow on purpose, so a Postgres backend (several replicas)
/// can implement it with the same portable SQL.
pub trait Durable: Send + Sync + 'static {
    /// Writes a new submission, or returns the one its idempotency key made.
    fn insert(&self, new: NewSubmission) -> BoxFuture<'_, Result<Inserted, StoreError>>;
    /// Saves a change of a submission that has not ended.
    fn save<'a>(&'a self, sub: &'a Submission) -> BoxFuture<'a, Result<(), StoreError>>;
    /// Saves a submission's end and its callback in one transaction; false when the store
    /// already had it ended.
    fn finish<'a>(
        &'a self,
        sub: &'a Submission,
        callback: Option<NewCallback>,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;
    /// The submission kept under `id`.
    fn load<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Submission>, StoreError>>;
    /// Every submission that has not ended.
    fn pending(&self) -> BoxFuture<'_, Result<Vec<Pending>, StoreError>>;
    /// The job of a submission that has not ended (what its build is created from).
    fn job<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Job>, StoreError>>;
    /// What idempotency key `key` made, if it was used ([`Inserted::Existing`], `hash` the
    /// SHA-256 of the request now): a replay is answered with it before any quota counts.
    fn keyed<'a>(
        &'a self,
        key: &'a str,
        hash: &'a str,
    ) -> BoxFuture<'a, Result<Option<Inserted>, StoreError>>;
    /// The submissions accepted since `since_ms` (queued, or answered from the result cache),
    /// for the quotas.
    fn accepted_since(&self, since_ms: i64) -> BoxFuture<'_, Result<Vec<Accepted>, StoreError>>;
    /// The newest submission that succeeded under the query's cache key, as
    /// [`CacheQuery`] bounds it.
    fn cached<'a>(
        &'a self,
        q: &'a CacheQuery,
    ) -> BoxFuture<'a, Result<Option<Submission>, StoreError>>;
    /// Callbacks due at `now_ms`.
    fn due_callbacks(
        &self,
        now_ms: i64,
        limit: i64,
    ) -> BoxFuture<'_, Result<Vec<DueCallback>, StoreError>>;
    /// When the next pending callback is due (unix ms).
    fn next_callback_at(&self) -> BoxFuture<'_, Result<Option<i64>, StoreError>>;
    /// Records a callback attempt.
    fn callback_attempted<'a>(
        &'a self,
        id: &'a str,
        state: CallbackState,
        attempts: i64,
        next_at_ms: i64,
        error: Option<String>,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    /// Reachable and writable.
    fn health(&self) -> BoxFuture<'_, Result<(), StoreError>>;
    /// Whether it survives a restart (false: in memory).
    fn persistent(&self) -> bool;
    /// Whether this process may still act outside the store (create or cancel a build, send
    /// a callback): a store another service can take over says no once it may have. Asked
    /// right before each such act.
    fn acting(&self) -> bool {
        true
    }
    /// Every slice's record in the fleet (`crate::fleet`), as JSON documents. A store that
    /// keeps none (in memory) has none.
    fn fleet_load(&self) -> BoxFuture<'_, Result<Vec<String>, StoreError>> {
        Box::pin(async { Ok(Vec::new()) })
    }
    /// Keeps slice `id`'s record (a JSON document), replacing the one before.
    fn fleet_save<'a>(
        &'a self,
        id: &'a str,
        doc: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let _ = (id, doc);
        Box::pin(async { Ok(()) })
    }
    /// Drops slice `id`'s record (a retired slice: gone from the roster for a week).
    fn fleet_forget<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), StoreError>> {
        let _ = id;
        Box::pin(async { Ok(()) })
    }
}

/// A queue's in-flight submissions, by what they wait for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InFlight {
    /// Waiting for a machine: `queued` or `scheduled`.
    pub queued: u64,
    /// On a machine, or its result being fetched: `running` or `fetching`.
    pub running: u64,
}

/// A change as [`Store::update`] made it.
#[derive(Debug, Clone)]
pub struct Changed {
    /// Whether anything changed (and was committed, and sent).
    pub changed: bool,
    /// The state before.
    pub before: State,
    /// The value after.
    pub after: Submission,
}

/// Submissions in flight in memory, every submission in the durable store.
pub struct Store {
    memory: Memory,
    durable: Arc<dyn Durable>,
    metrics: Arc<Metrics>,
    callback_retry: Duration,
}

impl Store {
    /// A store over `durable`. Events for builds not yet keyed are kept for at most
    /// `early_max` builds, for `early_ttl`; a submission is first due for a reconciler check
    /// `first_check` after it was last heard of; callbacks are retried for `callback_retry`.
    pub fn new(
        early_max: usize,
        early_ttl: Duration,
        first_check: Duration,
        callback_retry: Duration,
        durable: Arc<dyn Durable>,
        metrics: Arc<Metrics>,
    ) -> Store {
        Store {
            memory: Memory::new(early_max, early_ttl, first_check),
            durable,
            metrics,
            callback_retry,
        }
    }

    /// The durable part.
    pub fn durable(&self) -> &Arc<dyn Durable> {
        &self.durable
    }

    fn gauge(&self, state: State) -> prometheus_client::metrics::gauge::Gauge {
        self.metrics
            .submissions
            .get_or_create(&StateLabel {
                state: state.as_str().to_string(),
            })
            .clone()
    }

    /// Writes a new submission (before anything else happens to it) and, when it is new,
    /// puts it in memory. With an idempotency key used before, returns what that key made.
    pub async fn create(&self, new: NewSubmission) -> Result<Inserted, StoreError> {
        let (sub, deadline) = (new.sub.clone(), new.deadline_ms);
        let t = Instant::now();
        let inserted = self.durable.insert(new).await?;
        self.observe("insert", t);
        if let Inserted::Created = inserted {
            self.gauge(sub.state).inc();
            self.memory.insert(sub, deadline);
        }
        Ok(inserted)
    }

    /// Puts a submission read back from the durable store in memory (recovery).
    pub fn reload(&self, mut sub: Submission, deadline_ms: i64) {
        // A place kept with it is stale: the queue gives it a new one.
        sub.place = None;
        self.gauge(sub.state).inc();
        self.memory.insert(sub, deadline_ms);
    }

    /// Lets go of a submission [`Store::reload_if_absent`] took in and that is not to be held
    /// after all (its copy was stale).
    pub fn forget(&self, id: &str) {
        if let Some(state) = self.state(id) {
            self.gauge(state).dec();
        }
        self.memory.remove(id);
    }

    /// [`Store::reload`] unless it is in memory already; whether it was reloaded (of two
    /// callers racing with one submission, one is told yes).
    pub fn reload_if_absent(&self, mut sub: Submission, deadline_ms: i64) -> bool {
        sub.place = None;
        let state = sub.state;
        let reloaded = self.memory.insert_if_absent(sub, deadline_ms);
        if reloaded {
            self.gauge(state).inc();
        }
        reloaded
    }

    fn observe(&self, op: &str, since: Instant) {
        self.metrics
            .store_seconds
            .get_or_create(&crate::metrics::OpLabel { op: op.to_string() })
            .observe(since.elapsed().as_secs_f64());
    }

    /// The submission in memory (in flight).
    pub fn get(&self, id: &str) -> Option<Submission> {
        self.memory.get(id)
    }

    /// The submission in flight, with its lock, deadline and reconciler state.
    pub fn live(&self, id: &str) -> Option<Arc<Live>> {
        self.memory.live(id)
    }

    /// Every submission in flight.
    pub fn all_live(&self) -> Vec<(String, Arc<Live>)> {
        self.memory.all()
    }

    /// The submission in memory, else from the durable store.
    pub async fn lookup(&self, id: &str) -> Result<Option<Submission>, StoreError> {
        if let Some(s) = self.memory.get(id) {
            return Ok(Some(s));
        }
        let t = Instant::now();
        let s = self.durable.load(id).await;
        self.observe("load", t);
        s
    }

    /// The state of the submission in memory.
    pub fn state(&self, id: &str) -> Option<State> {
        self.memory.state(id)
    }

    /// A receiver that sees every later change of the submission in flight (the waiter of
    /// long-polls, SSE streams and the timeout timer).
    pub fn subscribe(&self, id: &str) -> Option<watch::Receiver<Submission>> {
        self.memory.subscribe(id)
    }

    /// Tells the waiters of a submission that waits in the service's queue where it is now
    /// (`None`: it left the queue). Not committed: a place is derived from the queue, which
    /// a restart rebuilds. Returns whether it was news ([`Place::moved`]).
    pub fn set_place(&self, id: &str, place: Option<Place>) -> bool {
        let Some(live) = self.memory.live(id) else {
            return false;
        };
        live.tx.send_if_modified(|s| {
            if s.state != State::Queued || s.build.is_some() {
                return false;
            }
            if !Place::moved(s.place.as_ref(), place.as_ref()) {
                return false;
            }
            s.place = place;
            true
        })
    }

    /// How many receivers watch the submission.
    pub fn watchers(&self, id: &str) -> usize {
        self.memory.watchers(id)
    }

    /// Applies `f` to a copy of the submission; when it changed anything, commits the new
    /// value, then sends it to the waiters, and when it ended, removes it from memory (with
    /// its callback in the outbox, in the same transaction). One change per submission at a
    /// time. `Ok(None)`: not in flight. An error: nothing was kept or sent.
    pub async fn update(
        &self,
        id: &str,
        f: impl FnOnce(&mut Submission) -> bool,
    ) -> Result<Option<Changed>, StoreError> {
        let Some(live) = self.memory.live(id) else {
            return Ok(None);
        };
        let _turn = live.lock.lock().await;
        let before = live.tx.borrow().clone();
        let mut next = before.clone();
        if before.state.is_terminal() || !f(&mut next) || next == before {
            return Ok(Some(Changed {
                changed: false,
                before: before.state,
                after: before,
            }));
        }
        let t = Instant::now();
        if next.state.is_terminal() {
            let callback = match &next.callback_url {
                Some(url) => Some(NewCallback {
                    url: url.clone(),
                    body: match next.cached_from {
                        Some(_) => None,
                        None => Some(
                            serde_json::to_string(&next)
                                .map_err(|e| StoreError::Write(e.to_string()))?,
                        ),
                    },
                    give_up_at_ms: now_ms().saturating_add(self.callback_retry.as_millis() as i64),
                }),
                None => None,
            };
            if !self.durable.finish(&next, callback).await? {
                tracing::warn!(%id, "the store already had this submission ended");
            }
        } else {
            self.durable.save(&next).await?;
        }
        self.observe("update", t);
        live.tx.send_replace(next.clone());
        if next.state.is_terminal() {
            self.memory.remove(id);
        }
        self.gauge(before.state).dec();
        self.gauge(next.state).inc();
        Ok(Some(Changed {
            changed: true,
            before: before.state,
            after: next,
        }))
    }

    /// Keys a build to its submission; returns the events that arrived for it early.
    pub fn key_build(&self, id: &str, build_id: &str) -> Vec<BuildEvent> {
        self.memory.key_build(id, build_id)
    }

    /// The submission in flight a build is keyed to.
    pub fn submission_of(&self, build_id: &str) -> Option<String> {
        self.memory.submission_of(build_id)
    }

    /// Finds the submission of `event`'s build, or keeps the event for a build not yet keyed.
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

    /// The in-flight submissions on `queue` (all in memory: only finished ones leave it).
    pub fn in_flight(&self, queue: &str) -> InFlight {
        self.memory.in_flight(queue)
    }

    /// Submissions in flight.
    pub fn len(&self) -> usize {
        self.memory.len()
    }

    /// None in flight.
    pub fn is_empty(&self) -> bool {
        self.memory.is_empty()
    }

    /// Whether submissions survive a restart (a data dir is set).
    pub fn is_durable(&self) -> bool {
        self.durable.persistent()
    }

    /// The store is reachable and writable: a probe write commits, and the last write did
    /// not fail.
    pub async fn health(&self) -> Result<(), BoxError> {
        self.durable.health().await.map_err(Into::into)
    }
}
