//! The service's core: what happens on a submission, a build event, a cancel, a timeout.
//!
//! It speaks in submissions and domain errors ([`Error`]); requests, responses and status codes are
//! the HTTP layer's (`kernelkite_service::http`). Builds run on an [`Executor`]; submissions live
//! in the [`Store`], which commits every change before any waiter hears of it.
//!
//! Nothing here polls a build. A submission waits on its `watch` channel; the executor's events
//! move it; a per-submission timer enforces its absolute deadline. It names no executor and no
//! database: the composition root (`kernelkite_service::cli::serve`) picks both and hands them in,
//! and starts the background loops that make it self-healing beside it (recovery after a restart,
//! `crate::recovery`; the reconciler for lost events, `crate::reconcile`; the callback outbox,
//! `kernelkite_service::callback`). Those loops call into the core; the core calls none of them.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use kernelkite_kernelbot::config::RunConfig;
use serde::{Deserialize, Serialize};
use sha2::Digest;
use tokio::sync::{watch, Notify, Semaphore};
use tracing::Instrument;

use crate::config::{Config, ConfigError};
use crate::dispatch::{Dispatcher, Who};
use crate::error::{BadRequest, Error, Invalid};
use crate::executor::{
    BuildEvent, BuildEventKind, BuildStatus, Collected, Executor, Job, Launched,
};
use crate::fairshare::Class;
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::queues::{AgentSlots, Queues};
use crate::report::report;
use crate::store::{Changed, Durable, Inserted, NewSubmission, Routed, Store, StoreError};
use crate::submission::{BuildInfo, Outcome, State, Submission};
use kernelkite_sys::provenance::Provenance;

/// A started submission whose build is to be created.
enum Launch {
    /// With its job in hand.
    Job(Job),
    /// Its job is read from the store.
    Stored(String),
}

impl Launch {
    fn id(&self) -> &str {
        match self {
            Launch::Job(j) => &j.submission_id,
            Launch::Stored(id) => id,
        }
    }
}

/// The longest a queue's next build creation waits for the one before it.
const ORDER_WAIT: Duration = Duration::from_secs(30);

/// `POST /v1/submissions` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubmitRequest {
    /// kernelbot's run config.
    pub config: serde_json::Value,
    /// Which machines run it (a Buildkite agent queue).
    pub queue: String,
    /// The backend's id for the run (default: the submission id).
    #[serde(default)]
    pub run_id: Option<String>,
    /// Where the finished submission is POSTed.
    #[serde(default)]
    pub callback_url: Option<String>,
    /// Seconds until the submission times out (default: KERNELKITE_DEFAULT_TIMEOUT_S); `3.0`
    /// is `3`, as JSON Schema counts integers.
    #[serde(default, deserialize_with = "kernelkite_kernelbot::integral::opt_u64")]
    pub timeout_s: Option<u64>,
    /// The backend's id of the user who submitted it: fair share and quotas count per user
    /// (none: one shared anonymous user). Left out of the request's hash when absent, so an
    /// `Idempotency-Key` made before this field existed still matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Its priority class: `admin`, `ranked` or `test` (default: `ranked` for a
    /// `leaderboard` or `private` run, else `test`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<String>,
    /// Whether the result cache may answer it (default: for `test` and `benchmark` runs;
    /// `true` lets it answer other modes too, `false` never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<bool>,
}

/// At most one log line per this while about events dropped for a full early-event buffer.
const DROP_LOG_EVERY: Duration = Duration::from_secs(10);

/// A waiting submission's place is told at least this often (its estimate drifts; slots
/// come and go).
const PLACES_REFRESH: Duration = Duration::from_secs(5);

/// After a queue moved, its places are told this much later: a burst of changes is one pass.
const PLACES_DEBOUNCE: Duration = Duration::from_millis(100);

/// How long the deadline waits for a build found finished at the last moment to be collected.
const TIMEOUT_GRACE: Duration = Duration::from_secs(10);

/// The service's core: configuration, submissions and the executor. Its background loops
/// live beside it and hold it, never the other way round.
pub struct App {
    /// The configuration it started with.
    pub(crate) cfg: Config,
    /// Every submission, and its waiters.
    pub(crate) store: Store,
    /// Where builds run.
    pub(crate) executor: Arc<dyn Executor>,
    /// Result collections in flight. Holding permits pauses collecting (the ingest benchmark
    /// does, to measure the webhook path alone).
    pub(crate) fetch_slots: Semaphore,
    /// What `GET /metrics` exports.
    pub(crate) metrics: Arc<Metrics>,
    /// Wakes the callback outbox (the service's `callback`) when a callback was written.
    pub(crate) callbacks_due: Notify,
    /// The service's queue: who waits for a slot, who starts next, the quotas.
    pub(crate) dispatch: Dispatcher,
    /// Agent counts (a queue's slots, and `GET /v1/queues/{queue}`).
    pub(crate) queues: Arc<Queues>,
    /// Wakes the place publisher (`App::spawn_places`) when a queue moved.
    places_due: Arc<Notify>,
    /// When each queue held for want of agents was last said so (`App::warn_held`).
    held_logged: Mutex<std::collections::HashMap<String, Instant>>,
    /// Per queue with slots: where its started submissions' builds are created, in order.
    launchers: Mutex<std::collections::HashMap<String, tokio::sync::mpsc::UnboundedSender<Launch>>>,
    /// Events dropped for a full early-event buffer, and when that was last logged.
    dropped_events: std::sync::atomic::AtomicU64,
    dropped_logged: Mutex<Option<Instant>>,
    /// The fleet: slices, canaries, quarantines (`crate::fleet`).
    pub(crate) fleet: Arc<Fleet>,
    /// Held while a slice's record is saved (`crate::upkeep`).
    pub(crate) fleet_saving: tokio::sync::Mutex<()>,
    /// Quarantines and releases, for whoever tells vendors (the service's notifier).
    pub(crate) notices: tokio::sync::broadcast::Sender<crate::fleet::Notice>,
}

/// What a client watches: a submission in flight (it sees every change), or one read from
/// the store (it will not change again).
pub enum Watch {
    /// In flight: the receiver sees every later change.
    Live(watch::Receiver<Submission>),
    /// Finished, or read from the store.
    Done(Box<Submission>),
}

/// A checked submission request, ready to be written.
#[derive(Debug, Clone)]
pub struct Prepared {
    sub: Submission,
    job: Job,
    deadline_ms: i64,
    idempotency: Option<(String, String)>,
    who: Who,
    cache_key: String,
    use_cache: bool,
}

impl Prepared {
    /// Pins it to slice `id` as its canary: its job runs there and nowhere else.
    pub(crate) fn pin(&mut self, id: &str, tags: std::collections::BTreeMap<String, String>) {
        self.sub.canary = Some(id.to_string());
        self.job.pin = Some(id.to_string());
        self.job.pin_tags = tags;
    }
}

/// What [`App::accept`] did.
#[derive(Debug, Clone)]
pub struct Submitted {
    /// The submission (new, or the one the idempotency key made before).
    pub submission: Submission,
    /// A new submission (`202`); false: the key's earlier submission (`200`).
    pub created: bool,
}

/// The longest an `Idempotency-Key` may be.
pub const MAX_IDEMPOTENCY_KEY: usize = 255;

impl App {
    /// The configuration it started with.
    pub fn cfg(&self) -> &Config {
        &self.cfg
    }

    /// Every submission, and its waiters.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Where builds run.
    pub fn executor(&self) -> &Arc<dyn Executor> {
        &self.executor
    }

    /// Result collections in flight: holding permits pauses collecting (the ingest benchmark
    /// does, to measure the webhook path alone), and shutdown waits for them all.
    pub fn fetch_slots(&self) -> &Semaphore {
        &self.fetch_slots
    }

    /// What `GET /metrics` exports.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Resolves when a callback was written (the callback outbox waits on it).
    pub fn callbacks_due(&self) -> &Notify {
        &self.callbacks_due
    }

    /// The service's queue: who waits for a slot, who starts next, the quotas.
    pub fn dispatch(&self) -> &Dispatcher {
        &self.dispatch
    }

    /// Agent counts (a queue's slots, and `GET /v1/queues/{queue}`).
    pub fn queues(&self) -> &Arc<Queues> {
        &self.queues
    }

    /// The fleet: slices, canaries, quarantines.
    pub fn fleet(&self) -> &Arc<Fleet> {
        &self.fleet
    }

    /// Quarantines and releases as they happen.
    pub fn notices(&self) -> tokio::sync::broadcast::Receiver<crate::fleet::Notice> {
        self.notices.subscribe()
    }

    /// The core around `executor` (where builds run) and `durable` (where submissions are kept),
    /// both chosen by the composition root (`kernelkite_service::cli::serve`). Nothing runs yet:
    /// the root starts the background loops (housekeeping, recovery, the reconciler, the callback
    /// outbox) around it.
    pub fn new(
        cfg: Config,
        executor: Arc<dyn Executor>,
        durable: Arc<dyn Durable>,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<App>, ConfigError> {
        cfg.check()?;
        let queues = Arc::new(Queues::for_executor(&cfg, executor.as_ref()));
        let mut dispatch = Dispatcher::new(
            cfg.fair.queue_limits.clone(),
            Duration::from_secs(cfg.fair.queue_estimate_s),
        );
        // An executor with slots of its own runs every queue on them (local mode's slices).
        if executor.slots().is_some() {
            cfg.check_one_line()?;
            dispatch = dispatch.one_line();
        }
        Ok(Arc::new(App {
            dispatch,
            queues,
            places_due: Arc::new(Notify::new()),
            launchers: Mutex::new(std::collections::HashMap::new()),
            held_logged: Mutex::new(std::collections::HashMap::new()),
            store: Store::new(
                cfg.early_event_max,
                Duration::from_secs(cfg.early_event_ttl_s),
                Duration::from_millis(cfg.reconcile_min_ms),
                cfg.callback_retry(),
                durable,
                metrics.clone(),
            ),
            executor,
            fetch_slots: Semaphore::new(cfg.fetch_concurrency),
            metrics,
            callbacks_due: Notify::new(),
            dropped_events: std::sync::atomic::AtomicU64::new(0),
            dropped_logged: Mutex::new(None),
            fleet: Arc::new(
                Fleet::new(cfg.canary.clone(), cfg.offline_after_s)
                    .expecting(cfg.fair.runner_version.clone()),
            ),
            notices: tokio::sync::broadcast::channel(256).0,
            fleet_saving: tokio::sync::Mutex::new(()),
            cfg,
        }))
    }

    /// Forgets expired early events now and then, until the core is dropped.
    pub fn spawn_housekeeping(self: &Arc<Self>) {
        let app = Arc::downgrade(self);
        let period = Duration::from_secs((self.cfg.early_event_ttl_s / 2).clamp(1, 60));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(a) = app.upgrade() else { return };
                a.store.sweep_early(std::time::Instant::now());
            }
        });
    }

    /// Checks a request and makes its payload (CPU work: a large config takes milliseconds,
    /// so the HTTP layer runs this off the async threads). Nothing is written yet.
    pub fn prepare(
        &self,
        req: SubmitRequest,
        idempotency_key: Option<String>,
    ) -> Result<Prepared, Error> {
        if let Some(k) = &idempotency_key {
            if k.is_empty()
                || k.len() > MAX_IDEMPOTENCY_KEY
                || !k.bytes().all(|b| b.is_ascii_graphic() || b == b' ')
            {
                return Err(BadRequest::IdempotencyKey.into());
            }
        }
        check_request(&req, &self.cfg)?;
        RunConfig::from_json(req.config.clone()).map_err(Invalid::RunConfig)?;
        // The original JSON is encoded, not the parsed struct, so the runner sees exactly what
        // the backend sent (key order included).
        let payload =
            kernelkite_kernelbot::payload::encode(&req.config).map_err(Invalid::Payload)?;
        // "The same request" for an idempotency key: the same JSON document (whitespace
        // aside; key order in `config` counts, as the runner sees it).
        let idempotency = match idempotency_key {
            Some(k) => {
                let canonical = serde_json::to_vec(&req).map_err(|e| Error::Internal {
                    what: "encoding the request",
                    source: e.into(),
                })?;
                Some((k, hex::encode(sha2::Sha256::digest(&canonical))))
            }
            None => None,
        };
        let mode = req
            .config
            .get("mode")
            .and_then(|m| m.as_str())
            .unwrap_or("?")
            .to_string();
        let class = match &req.priority {
            Some(p) => Class::parse(p).ok_or_else(|| Invalid::Priority(p.clone()))?,
            None => Class::of_mode(&mode),
        };
        // An organiser's verification run is meant to run: the cache answers it only when
        // asked to.
        let use_cache = self.cfg.fair.cache
            && match req.cache {
                Some(allowed) => allowed,
                None => class != Class::Admin && matches!(mode.as_str(), "test" | "benchmark"),
            };
        let cache_key = cache_key(&self.cfg.fair.runner_version, &req.queue, &payload);
        let id = uuid::Uuid::new_v4().to_string();
        let timeout_s = req.timeout_s.unwrap_or(self.cfg.default_timeout_s);
        let job = Job {
            submission_id: id.clone(),
            run_id: req.run_id.clone().unwrap_or_else(|| id.clone()),
            queue: req.queue.clone(),
            mode,
            payload,
            ranked: class == Class::Ranked,
            pin: None,
            pin_tags: Default::default(),
        };
        let now = Utc::now();
        let mut sub = Submission::new(id, req.queue, req.run_id, req.callback_url, timeout_s, now);
        sub.user = req.user;
        sub.priority = class;
        let who = self.who(&sub);
        let deadline_ms = sub.deadline_ms();
        Ok(Prepared {
            sub,
            job,
            deadline_ms,
            idempotency,
            who,
            cache_key,
            use_cache,
        })
    }

    /// Writes a prepared submission, and only then queues it: its build is created when its
    /// queue has a free slot and its turn came (`crate::dispatch`). An identical earlier
    /// submission's stored result answers it at once where the cache may; an idempotency key
    /// used before returns that submission instead; a user over a quota is refused.
    pub async fn accept(self: &Arc<Self>, p: Prepared) -> Result<Submitted, Error> {
        // Its own task: a client that hangs up drops the request's future, and admitting,
        // writing and queueing must finish (or be taken back) all the same, or the user's
        // quota would keep counting a submission that does not exist.
        let app = self.clone();
        tokio::spawn(async move { app.accept_now(p).await }.instrument(tracing::Span::current()))
            .await
            .map_err(|e| Error::Internal {
                what: "accepting the submission",
                source: e.into(),
            })?
    }

    async fn accept_now(self: &Arc<Self>, p: Prepared) -> Result<Submitted, Error> {
        if p.job.pin.is_some() {
            // A canary measures one slice, and must run whatever the queue holds (a queue whose
            // every slot is held by ranked runs that quarantined slices leave waiting would
            // otherwise never see the canary that releases one): it takes none of the queue's
            // slots and no quota; its slice runs it when it is free.
            let job = p.job.clone();
            let s = self.write(p, None, None).await?;
            if s.created {
                let app = self.clone();
                tokio::spawn(async move { app.launch(Launch::Job(job)).await });
            }
            return Ok(s);
        }
        if p.use_cache {
            if let Some((origin, result)) = self.cached(&p).await {
                return self.accept_cached(p, origin, result).await;
            }
        }
        let now_ms = p.sub.created_at.timestamp_millis();
        let slots = self.capacity(&p.who.queue);
        let admission = match self.dispatch.admit(&p.who, now_ms, slots) {
            Ok(a) => a,
            Err(q) => return self.refused(&p, q).await,
        };
        let arrival = p.sub.created_at.timestamp_micros();
        let who = p.who.clone();
        let (id, job) = (p.sub.id.clone(), p.job.clone());
        let cache_key = Some(p.cache_key.clone());
        match self.write(p, Some(admission.tag), cache_key).await {
            Ok(s) if s.created => {
                self.dispatch.enqueue(&who, &id, arrival, admission);
                if self.store.live(&id).is_none() {
                    // It ended before it was queued (canceled through its idempotency key's
                    // replay, say): its end found nothing to free.
                    self.dispatch.ended(&who.queue, &id, None);
                }
                self.pump(&who.queue, Some(job));
                Ok(self.placed(&who.queue, s))
            }
            Ok(s) if self.unanswered(&s) => match self.queue_unanswered(&who, &s).await {
                Some(job) => {
                    let id = s.submission.id.clone();
                    self.dispatch.enqueue(
                        &who,
                        &id,
                        s.submission.created_at.timestamp_micros(),
                        admission,
                    );
                    if self.store.live(&id).is_none() {
                        // It ended (canceled, timed out) while it was being taken in: its end
                        // found nothing to free.
                        self.dispatch.ended(&who.queue, &id, None);
                    }
                    self.pump(&who.queue, Some(job));
                    Ok(self.placed(&who.queue, s))
                }
                None => {
                    self.dispatch.withdraw(&who, admission, now_ms);
                    Ok(s)
                }
            },
            other => {
                self.dispatch.withdraw(&who, admission, now_ms);
                other
            }
        }
    }

    /// Whether a replayed key's submission is one an earlier attempt wrote without being
    /// answered: the store committed it, but its reply was lost (the connection dropped after
    /// the commit), so that attempt failed, withdrew from the queue and queued nothing; the
    /// submission has not ended and this process does not hold it. Nothing else leaves one so
    /// (a restart reloads every submission that had not ended).
    fn unanswered(&self, s: &Submitted) -> bool {
        !s.created
            && !s.submission.state.is_terminal()
            // An answer from the result cache never runs (recovery ends an interrupted one).
            && s.submission.cached_from.is_none()
            && self.store.live(&s.submission.id).is_none()
    }

    /// Takes in a submission [`App::unanswered`] found: into memory, its deadline armed; its
    /// job, to queue it (the caller queues it with this request's admission: the attempt that
    /// wrote it withdrew its own). `None` when another request took it in first, or the store
    /// keeps no job for it (it ended meanwhile) or cannot be read (left to the next restart's
    /// recovery, as before).
    async fn queue_unanswered(self: &Arc<Self>, who: &Who, s: &Submitted) -> Option<Job> {
        let sub = &s.submission;
        let deadline_ms = sub.deadline_ms();
        if !self.store.reload_if_absent(sub.clone(), deadline_ms) {
            return None;
        }
        // Read again now that it is held here: a copy read before another request took it in,
        // ran and ended it is stale (ended rows keep no job), and is let go without a word.
        let job = match self.store.durable().job(&sub.id).await {
            Ok(Some(job)) => job,
            Ok(None) | Err(_) => {
                self.store.forget(&sub.id);
                return None;
            }
        };
        tracing::warn!(id = %sub.id, queue = %who.queue, "queuing a submission an earlier attempt wrote without being answered (the store's reply was lost)");
        self.spawn_timeout(&sub.id, deadline_ms);
        Some(job)
    }

    /// A submission just accepted, with its place in the queue when it waits there: the
    /// answer to the request and every read after it say where it stands (the publisher's
    /// pass, a moment later, tells the others theirs).
    fn placed(&self, queue: &str, mut s: Submitted) -> Submitted {
        let id = s.submission.id.clone();
        if let Some(place) = self.dispatch.place_of(queue, &id, self.capacity(queue)) {
            self.store.set_place(&id, Some(place));
        }
        if let Some(now) = self.store.get(&id) {
            s.submission = now;
        }
        s
    }

    /// A quota refused `p`, unless its idempotency key was used before: a replay is answered
    /// with what the key made (`200`, or `409` for another request), as without quotas.
    async fn refused(
        self: &Arc<Self>,
        p: &Prepared,
        q: crate::dispatch::OverQuota,
    ) -> Result<Submitted, Error> {
        if let Some((key, hash)) = &p.idempotency {
            match self.store.durable().keyed(key, hash).await {
                Ok(Some(Inserted::Existing { sub, same_request })) => {
                    return self.replayed(key.clone(), *sub, same_request);
                }
                Ok(_) => {}
                Err(e) => {
                    return Err(crate::error::Unavailable::Store {
                        what: "the store could not be read",
                        source: e.into(),
                    }
                    .into())
                }
            }
        }
        self.metrics
            .quota_refusals
            .get_or_create(&crate::metrics::QuotaLabel {
                queue: p.who.queue.clone(),
                limit: q.limit().to_string(),
            })
            .inc();
        tracing::info!(user = %p.who.user, queue = %p.who.queue, "submission refused: {q}");
        Err(q.into())
    }

    /// The answer to a replayed idempotency key: its submission as it is now, or a conflict
    /// when the key came with another request.
    fn replayed(
        &self,
        key: String,
        sub: Submission,
        same_request: bool,
    ) -> Result<Submitted, Error> {
        if !same_request {
            return Err(Error::KeyReused { key });
        }
        tracing::info!(id = %sub.id, "idempotent replay of a submission");
        let current = self.store.get(&sub.id).unwrap_or(sub);
        Ok(Submitted {
            submission: current,
            created: false,
        })
    }

    /// Writes a submission (with its start tag in the queue, if it waits there), arms its
    /// timeout; an idempotency key used before returns that key's submission.
    async fn write(
        self: &Arc<Self>,
        p: Prepared,
        fair_tag: Option<u64>,
        cache_key: Option<String>,
    ) -> Result<Submitted, Error> {
        let key = p.idempotency.as_ref().map(|k| k.0.clone());
        let (id, deadline_ms) = (p.sub.id.clone(), p.deadline_ms);
        let inserted = self
            .store
            .create(NewSubmission {
                sub: p.sub.clone(),
                job: p.job,
                deadline_ms,
                idempotency: p.idempotency,
                fair_tag,
                cache_key,
            })
            .await
            .map_err(|e| {
                Error::from(crate::error::Unavailable::Store {
                    what: "the submission could not be saved",
                    source: e.into(),
                })
            })?;
        match inserted {
            Inserted::Created => {
                self.spawn_timeout(&id, deadline_ms);
                tracing::info!(id = %id, queue = %p.sub.queue, user = %p.who.user, priority = p.sub.priority.as_str(), "submission accepted");
                Ok(Submitted {
                    submission: p.sub,
                    created: true,
                })
            }
            Inserted::Existing { sub, same_request } => {
                self.replayed(key.unwrap_or_default(), *sub, same_request)
            }
        }
    }

    /// The earlier submission whose result may answer `p`, and that result: the newest that
    /// ran and succeeded with the same cache key within KERNELKITE_CACHE_MAX_AGE_S (only runs
    /// carry a key). A store that cannot be read is a miss (the submission runs).
    async fn cached(&self, p: &Prepared) -> Option<(String, crate::result::ResultJson)> {
        let max_age =
            i64::try_from(self.cfg.fair.cache_max_age_s.saturating_mul(1000)).unwrap_or(i64::MAX);
        let query = crate::store::CacheQuery {
            key: p.cache_key.clone(),
            since_ms: p.sub.created_at.timestamp_millis().saturating_sub(max_age),
            max_timeout_ms: p.deadline_ms - p.sub.created_at.timestamp_millis(),
        };
        match self.store.durable().cached(&query).await {
            // A runner that could not evaluate (`success: false`: a machine's fault, say) is
            // no answer to repeat: the submission runs.
            Ok(hit) => {
                let hit = hit?;
                hit.result.filter(|r| r.success()).map(|r| (hit.id, r))
            }
            Err(e) => {
                tracing::warn!(error = %report(&e), "could not read the result cache; the submission runs");
                None
            }
        }
    }

    /// Answers `p` with `result`, that of submission `from` (which ran): written `queued`,
    /// then ended `succeeded` with `cached_from`, as any other end is: committed, then woken,
    /// then its callback is due. The store keeps the result once, with `from`; the answer
    /// refers to it. Never queued, so the `queued` quota does not count it; the `hourly` one
    /// and the cache's own limit (KERNELKITE_CACHE_HOURLY) do.
    async fn accept_cached(
        self: &Arc<Self>,
        mut p: Prepared,
        from: String,
        result: crate::result::ResultJson,
    ) -> Result<Submitted, Error> {
        let now_ms = p.sub.created_at.timestamp_millis();
        if let Err(q) = self
            .dispatch
            .admit_cached(&p.who, now_ms, self.cfg.fair.cache_hourly.0)
        {
            return self.refused(&p, q).await;
        }
        p.sub.cached_from = Some(from.clone());
        let queue = p.sub.queue.clone();
        let who = p.who.clone();
        // Without a cache key: only a submission that ran answers later ones, so an answer
        // from the cache never renews the age of the result it repeats.
        let submitted = match self.write(p, None, None).await {
            Ok(s) if s.created => s,
            other => {
                self.dispatch.withdraw_cached(&who, now_ms);
                return other;
            }
        };
        let id = submitted.submission.id.clone();
        let ended = self.finish_durably(&id, Outcome::Succeeded(result)).await;
        self.metrics
            .cache_hits
            .get_or_create(&crate::metrics::QueueLabel { queue })
            .inc();
        tracing::info!(%id, cached_from = %from, "answered from the result cache");
        Ok(Submitted {
            submission: ended.map_or(submitted.submission, |c| c.after),
            created: true,
        })
    }

    /// `sub`'s user, queue and class, as the queue counts them.
    pub(crate) fn who(&self, sub: &Submission) -> Who {
        Who::new(&sub.queue, sub.user.as_deref(), sub.priority)
    }

    /// How many submissions of `queue`'s line may be started at once (`None`: not limited):
    /// KERNELKITE_QUEUE_SLOTS (`none`: not limited), else the executor's own slots (the
    /// local executor's slices, one line for every queue), else the queue's connected
    /// Buildkite agents as last fetched (`crate::queues`): none connected, or none fetched
    /// yet, is no slot (the queue holds its submissions, in order, until agents connect);
    /// counts that cannot be had at all (the token cannot list agents) do not limit, as
    /// before the queue.
    pub fn capacity(&self, queue: &str) -> Option<u64> {
        let queue = self.dispatch.line(queue);
        if let Some(set) = self.cfg.fair.queue_slots.of(queue) {
            return set;
        }
        if let Some(n) = self.executor.slots() {
            return Some(n);
        }
        match self.queues.agent_slots(queue) {
            AgentSlots::NoSource | AgentSlots::Unknown => None,
            AgentSlots::NotFetched => Some(0),
            AgentSlots::Connected(n) => Some(n),
        }
    }

    /// Starts what `queue` has room for, and has its waiting submissions told their new
    /// places soon.
    pub(crate) fn pump(self: &Arc<Self>, queue: &str, ready: Option<Job>) {
        self.start_ready(queue, self.capacity(queue), ready);
        self.places_due.notify_one();
    }

    /// Starts what `queue` has room for with `slots`: each started submission's build is
    /// created (from `ready`, the job in hand, when it is that one; else from the store's
    /// copy).
    fn start_ready(self: &Arc<Self>, queue: &str, slots: Option<u64>, mut ready: Option<Job>) {
        let queue = self.dispatch.line(queue);
        for s in self.dispatch.take(queue, slots) {
            self.store.set_place(&s.id, None);
            self.metrics
                .queue_wait_seconds
                .get_or_create(&crate::metrics::WaitLabel {
                    queue: queue.to_string(),
                    class: s.class.as_str().to_string(),
                    user_bucket: crate::metrics::WaitLabel::bucket(s.user_open).to_string(),
                })
                .observe(s.waited.as_secs_f64());
            let what = match ready.take_if(|j| j.submission_id == s.id) {
                Some(job) => Launch::Job(job),
                None => Launch::Stored(s.id),
            };
            if slots.is_some() {
                self.launch_in_order(queue, what);
            } else {
                // Not limited: Buildkite orders them; creating them side by side is faster.
                let app = self.clone();
                tokio::spawn(async move { app.launch(what).await });
            }
        }
    }

    /// Tells every waiting submission its place, whenever a queue moved (a little after, so a
    /// burst of changes is one pass) and every few seconds (slots can change: agents come and
    /// go), until the core is dropped. Queues with free slots start their next submissions
    /// on the way.
    pub fn spawn_places(self: &Arc<Self>) {
        let app = Arc::downgrade(self);
        let due = self.places_due.clone();
        let mut agents = self.queues.fetched();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = due.notified() => {}
                    // New agent counts: a queue may have slots now.
                    () = agents.next() => {}
                    () = tokio::time::sleep(PLACES_REFRESH) => {}
                }
                tokio::time::sleep(PLACES_DEBOUNCE).await;
                let Some(a) = app.upgrade() else { return };
                a.publish_places();
            }
        });
    }

    /// Says (at most once a minute per queue) that a queue holds submissions for want of a
    /// connected agent: a queue name no agent serves, or agents outside the agent token's
    /// cluster, would otherwise only show as submissions timing out.
    fn warn_held(&self, queue: &str) {
        let mut held = self.held_logged.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if held
            .get(queue)
            .is_some_and(|t| now.duration_since(*t) < Duration::from_secs(60))
        {
            return;
        }
        held.insert(queue.to_string(), now);
        tracing::warn!(%queue, waiting = self.dispatch.status(queue, Some(0)).waiting, "no Buildkite agent of this queue is connected: its submissions wait in the service until one connects (set KERNELKITE_QUEUE_SLOTS for a queue whose agents this service cannot count)");
    }

    /// One pass of [`App::spawn_places`]: every queue with anything waiting starts what
    /// its slots (asked again: agents come and go) have room for, then tells the rest their
    /// places.
    pub fn publish_places(self: &Arc<Self>) {
        for queue in self.dispatch.busy_queues() {
            let slots = self.capacity(&queue);
            if slots == Some(0) {
                self.warn_held(&queue);
            }
            self.start_ready(&queue, slots, None);
            for (id, place) in self.dispatch.places(&queue, slots) {
                self.store.set_place(&id, Some(place));
            }
        }
    }

    /// Validates, writes and starts a submission ([`App::prepare`] then [`App::accept`]).
    pub async fn submit(
        self: &Arc<Self>,
        req: SubmitRequest,
        idempotency_key: Option<String>,
    ) -> Result<Submitted, Error> {
        let p = self.prepare(req, idempotency_key)?;
        self.accept(p).await
    }

    /// Creates the build of a started submission: from the job in hand, or from the store's
    /// copy (the queue keeps ids, not payloads; read again while the store cannot be read
    /// and the submission is in flight). A submission that ended meanwhile needs no build.
    async fn launch(self: &Arc<Self>, what: Launch) {
        let job = match what {
            Launch::Job(job) => job,
            Launch::Stored(id) => match self.stored_job(&id).await {
                Some(job) => job,
                None => return,
            },
        };
        let id = job.submission_id.clone();
        if self.store.live(&id).is_none() {
            // Ended while it waited for its turn (canceled, timed out): no build for nobody,
            // and its slot is free (a no-op when its end already freed it).
            self.dispatch.ended(&job.queue, &id, None);
            self.pump(&job.queue, None);
            return;
        }
        // A root span: the work outlives the request that started it, and its logs must not
        // read as that request's.
        let span = tracing::info_span!(parent: None, "submission", id = %id);
        async {
            if !self.store.durable().acting() {
                // Another service may hold the store now: the submission is its to launch.
                tracing::error!("not creating the build: this service no longer holds the store");
                return;
            }
            match self.executor.launch(&job).await {
                Ok(launched) => self.attach(&id, launched).await,
                Err(e) => {
                    let why = report(&*e);
                    tracing::warn!(error = %why, "build creation failed");
                    let msg = format!("could not create the {} build: {why}", self.executor.name());
                    self.finish_durably(&id, Outcome::Failed(msg)).await;
                }
            }
        }
        .instrument(span)
        .await
    }

    async fn stored_job(self: &Arc<Self>, id: &str) -> Option<Job> {
        let mut wait = Duration::from_millis(self.cfg.retry_base_ms.max(10));
        loop {
            self.store.live(id)?;
            match self.store.durable().job(id).await {
                Ok(Some(job)) => return Some(job),
                Ok(None) => {
                    let why = "the submission's job was not kept; submit it again";
                    self.finish_durably(id, Outcome::Failed(why.into())).await;
                    return None;
                }
                Err(e) => {
                    tracing::error!(%id, error = %report(&e), retry_in = ?wait, "could not read the job of a started submission; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(10));
                }
            }
        }
    }

    /// Creates the builds of a queue with slots one after another, in the order the queue
    /// started them, so builds are made (and the submissions become `scheduled`) in the order
    /// their places said. One task per queue, which ends with the core.
    fn launch_in_order(self: &Arc<Self>, queue: &str, what: Launch) {
        let mut lines = self.launchers.lock().unwrap_or_else(|p| p.into_inner());
        let what = match lines.get(queue) {
            Some(tx) => match tx.send(what) {
                Ok(()) => return,
                Err(e) => e.0,
            },
            None => what,
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let _ = tx.send(what);
        lines.insert(queue.to_string(), tx);
        let app = Arc::downgrade(self);
        tokio::spawn(async move {
            while let Some(what) = rx.recv().await {
                let Some(a) = app.upgrade() else { return };
                let ended = a.store.subscribe(what.id());
                let launch = tokio::spawn(async move { a.launch(what).await });
                // The next build waits for this one, so they are made in the queue's order;
                // but not past this one's end, nor longer than ORDER_WAIT: a create that
                // hangs (Buildkite unreachable) must not hold up the queue behind it.
                let ended = async move {
                    if let Some(mut rx) = ended {
                        let _ = rx.wait_for(|s| s.state.is_terminal()).await;
                    }
                };
                let _ = tokio::time::timeout(ORDER_WAIT, async {
                    tokio::select! {
                        _ = launch => {}
                        () = ended => {}
                    }
                })
                .await;
            }
        });
    }

    /// Records a submission's build (committed before anyone hears of it), hands it the events
    /// that beat the create response, and cancels the build if the submission ended meanwhile.
    pub(crate) async fn attach(self: &Arc<Self>, id: &str, launched: Launched) {
        let build = launched.build;
        tracing::info!(build = build.number, build_id = %build.id, "build created");
        let mut wait = Duration::from_millis(self.cfg.retry_base_ms.max(10));
        let attached = loop {
            let b = build.clone();
            let running = launched.running;
            match self
                .store
                .update(id, |s| {
                    let now = Utc::now();
                    let mut changed = s.attach_build(b, now);
                    if running {
                        changed |= s.advance(State::Running, now);
                    }
                    changed
                })
                .await
            {
                Ok(Some(c)) => break c.after.build.as_ref() == Some(&build),
                Ok(None) => break false,
                Err(e) => {
                    // The build exists; until its id is kept, a restart would only find it
                    // by listing. Keep trying while the submission is in flight.
                    tracing::error!(error = %report(&e), "could not save the build of the submission; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(10));
                }
            }
        };
        self.heard(id);
        if attached {
            for ev in self.store.key_build(id, &build.id) {
                self.apply(id, ev).await;
            }
        }
        // Canceled or timed out while the create call was in flight: the build must not run
        // for nobody.
        if !attached
            || matches!(
                self.store.state(id),
                None | Some(State::Canceled | State::TimedOut)
            )
        {
            self.spawn_cancel_build(build);
        }
    }

    /// Acts on a build's progress, as its executor reported it, in the background: the
    /// webhook is answered at once, and an event lost to a crash before its commit is found
    /// again by the reconciler. [`App::handle_event`] is the same, awaited.
    pub(crate) fn on_event(self: &Arc<Self>, event: BuildEvent) {
        let app = self.clone();
        tokio::spawn(
            async move { app.handle_event(event).await }
                .instrument(tracing::info_span!(parent: None, "event")),
        );
    }

    /// Acts on a build's progress and returns once its effect is committed. Collecting the
    /// result of a finished build runs in the background. Adapters deliver events through the
    /// events handle (`crate::events::for_executor`), the one way in.
    pub(crate) async fn handle_event(self: &Arc<Self>, event: BuildEvent) {
        match self.store.route(&event) {
            Routed::Submission(id) => self.apply(&id, event).await,
            Routed::Buffered => {
                tracing::debug!(build_id = %event.build.id, "event for an unknown build kept for a while")
            }
            Routed::Dropped => {
                // Once per DROP_LOG_EVERY at most: a flood of unknown builds' events must not
                // become a flood of log lines.
                let n = self
                    .dropped_events
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                    + 1;
                let mut last = self
                    .dropped_logged
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                if last.is_none_or(|t| t.elapsed() >= DROP_LOG_EVERY) {
                    *last = Some(Instant::now());
                    tracing::warn!(build_id = %event.build.id, dropped_so_far = n, "events for unknown builds dropped: the early-event buffer is full (KERNELKITE_EARLY_EVENT_MAX)")
                }
            }
            Routed::Ended => {
                tracing::debug!(build_id = %event.build.id, "event for a build whose submission ended")
            }
        }
    }

    /// Something was heard of the submission: the reconciler leaves it alone for a while.
    pub(crate) fn heard(&self, id: &str) {
        if let Some(live) = self.store.live(id) {
            let now = Instant::now();
            let first = Duration::from_millis(self.cfg.reconcile_min_ms);
            let mut h = live.heard.lock().unwrap_or_else(|p| p.into_inner());
            h.at = now;
            h.backoff = first;
            h.due = now + first;
        }
    }

    /// One event, for a submission in flight. The same code serves webhooks, the
    /// reconciler's finds and the events that beat the create response.
    pub(crate) async fn apply(self: &Arc<Self>, id: &str, ev: BuildEvent) {
        let span = tracing::info_span!("submission", %id, build = ev.build.number);
        async {
            self.heard(id);
            let now = Utc::now();
            let advance = |to: State| move |s: &mut Submission| s.advance(to, now);
            let result = match ev.kind {
                BuildEventKind::Scheduled => self.store.update(id, advance(State::Scheduled)).await,
                BuildEventKind::Running => self.store.update(id, advance(State::Running)).await,
                BuildEventKind::Skipped => {
                    let msg = format!(
                        "{} skipped build #{}; see {}",
                        self.executor.name(),
                        ev.build.number,
                        ev.build.web_url
                    );
                    self.finish(id, Outcome::Failed(msg)).await
                }
                BuildEventKind::Finished => {
                    if ev.build.blocked {
                        // A block step paused it; a later build.finished brings the real end.
                        tracing::info!("build is blocked; waiting");
                        return;
                    }
                    // Collecting starts at once, beside the `fetching` commit: the result's own
                    // commit waits for that one (one change per submission at a time), so the
                    // downloads overlap it instead of following it.
                    if let Some(sub) = self.store.get(id).filter(|s| !s.state.is_terminal()) {
                        self.spawn_collect(id, &sub, &ev.build, Instant::now());
                    }
                    self.store.update(id, advance(State::Fetching)).await
                }
            };
            if let Err(e) = result {
                // Not kept, so not acknowledged to anyone; the reconciler finds the build again.
                tracing::error!(error = %report(&e), "could not save the event; the reconciler will pick the build up again");
            }
        }
        .instrument(span)
        .await
    }

    /// Collects a finished build's result, once per submission at a time, retrying
    /// transient failures (Buildkite down, 5xx) with backoff until the submission's deadline.
    /// The build number used is the one recorded for the build id at create time, never the
    /// one an event carries.
    pub(crate) fn spawn_collect(
        self: &Arc<Self>,
        id: &str,
        sub: &Submission,
        ev: &BuildStatus,
        since: Instant,
    ) {
        let Some(live) = self.store.live(id) else {
            return;
        };
        let Some(recorded) = sub.build.clone() else {
            return;
        };
        if ev.id != recorded.id {
            tracing::warn!(%id, event_build = %ev.id, build_id = %recorded.id, "finished event for another build than the submission's; ignored");
            return;
        }
        if live.collecting.swap(true, Ordering::AcqRel) {
            return;
        }
        let status = BuildStatus {
            id: recorded.id.clone(),
            number: recorded.number,
            state: ev.state.clone(),
            web_url: recorded.web_url.clone(),
            blocked: false,
        };
        let app = self.clone();
        let id = id.to_string();
        let span = tracing::info_span!(parent: None, "submission", %id, build = recorded.number);
        tokio::spawn(
            async move {
                let mut wait = Duration::from_millis(app.cfg.retry_base_ms.max(10));
                loop {
                    if !matches!(app.store.state(&id), Some(s) if !s.is_terminal()) {
                        break;
                    }
                    // A slot per attempt, never held across the backoff: fetches stuck on a
                    // blob store that stalls (each attempt ends within the stall timeout,
                    // KERNELKITE_BLOB_STALL_S) cannot keep a healthy one waiting for long.
                    let Ok(slot) = app.fetch_slots.acquire().await else {
                        return;
                    };
                    let collected = app.executor.collect(&status).await;
                    drop(slot);
                    match collected {
                        Ok(collected) => {
                            let succeeded = matches!(collected.outcome, Outcome::Succeeded(_));
                            if let Some(c) = app.end_collected(&id, collected).await {
                                if c.changed && succeeded {
                                    app.metrics
                                        .wake_to_result_seconds
                                        .observe(since.elapsed().as_secs_f64());
                                }
                            }
                            break;
                        }
                        Err(e) => {
                            // Until the deadline: the timer ends the submission, and this loop
                            // with it.
                            tracing::warn!(error = %report(&*e), retry_in = ?wait, "could not collect the result yet; retrying");
                            tokio::time::sleep(wait).await;
                            wait = (wait * 2).min(Duration::from_secs(30));
                        }
                    }
                }
                if let Some(live) = app.store.live(&id) {
                    live.collecting.store(false, Ordering::Release);
                }
            }
            .instrument(span),
        );
    }

    /// Ends a submission (no-op when it already ended): committed, then woken, then its
    /// callback is due. `Ok(None)`: not in flight.
    pub async fn finish(
        self: &Arc<Self>,
        id: &str,
        outcome: Outcome,
    ) -> Result<Option<Changed>, StoreError> {
        self.finish_from(id, outcome, None, None).await
    }

    /// [`App::finish`] for a collected result: its build finished, so the submission passes
    /// through `fetching` (should the result beat that commit) on its way to the end.
    async fn end_collected(self: &Arc<Self>, id: &str, collected: Collected) -> Option<Changed> {
        let mut wait = Duration::from_millis(100);
        loop {
            match self
                .finish_from(
                    id,
                    collected.outcome.clone(),
                    Some(State::Fetching),
                    collected
                        .provenance
                        .clone()
                        .map(|p| p.reviewed(&Default::default())),
                )
                .await
            {
                Ok(c) => return c,
                Err(e) => {
                    tracing::error!(%id, error = %report(&e), retry_in = ?wait, "could not save the submission's end; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(10));
                    self.store.live(id)?;
                }
            }
        }
    }

    async fn finish_from(
        self: &Arc<Self>,
        id: &str,
        outcome: Outcome,
        via: Option<State>,
        provenance: Option<Provenance>,
    ) -> Result<Option<Changed>, StoreError> {
        let changed = self
            .store
            .update(id, |s| {
                let now = Utc::now();
                if let Some(via) = via {
                    s.advance(via, now);
                }
                if s.state.is_terminal() {
                    return false;
                }
                // Kept with the end it came with, whatever the end (a failed run still ran
                // somewhere, and which node it was is what an operator asks first).
                if provenance.is_some() {
                    s.provenance = provenance;
                }
                s.finish(outcome, now)
            })
            .await?;
        if let Some(c) = &changed {
            if c.changed {
                let s = &c.after;
                tracing::info!(id = %s.id, state = s.state.as_str(), build = s.build.as_ref().map(|b| b.number), "submission finished");
                if s.callback_url.is_some() {
                    self.callbacks_due.notify_one();
                }
                // Its slot frees (or its place in the queue), and the next one starts.
                self.dispatch.ended(&s.queue, &s.id, s.ran());
                self.pump(&s.queue, None);
                let fleet = self.fleet.ended(s, Utc::now().timestamp_millis());
                self.fleet_changed(fleet);
            }
        }
        Ok(changed)
    }

    /// [`App::finish`], retried while the store cannot write (the outcome is in hand; a
    /// client must not hear of it before it is kept). Gives up when the submission left
    /// memory some other way.
    pub(crate) async fn finish_durably(
        self: &Arc<Self>,
        id: &str,
        outcome: Outcome,
    ) -> Option<Changed> {
        let mut wait = Duration::from_millis(100);
        loop {
            match self.finish(id, outcome.clone()).await {
                Ok(c) => return c,
                Err(e) => {
                    tracing::error!(%id, error = %report(&e), retry_in = ?wait, "could not save the submission's end; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(10));
                    self.store.live(id)?;
                }
            }
        }
    }

    /// Cancels the submission and its build. Canceling a canceled submission is not an error;
    /// one that ended otherwise is a conflict.
    pub async fn cancel(self: &Arc<Self>, id: &str) -> Result<Submission, Error> {
        let unavailable = |e: StoreError| {
            Error::from(crate::error::Unavailable::Store {
                what: "the cancel could not be saved",
                source: e.into(),
            })
        };
        let changed = self
            .finish(id, Outcome::Canceled("canceled by request".into()))
            .await
            .map_err(unavailable)?;
        let Some(c) = changed else {
            // Not in flight: finished (or unknown).
            return match self.store.lookup(id).await.map_err(unavailable)? {
                Some(s) if s.state == State::Canceled => Ok(s),
                Some(s) => Err(Error::Conflict { state: s.state }),
                None => Err(Error::NotFound { id: id.to_string() }),
            };
        };
        if !c.changed {
            if c.after.state == State::Canceled {
                return Ok(c.after);
            }
            return Err(Error::Conflict {
                state: c.after.state,
            });
        }
        if let Some(b) = &c.after.build {
            self.spawn_cancel_build(b.clone());
        }
        Ok(c.after)
    }

    /// Takes in a submission value into memory and arms its timeout for the time it has
    /// left. Its changes are committed to the store, so it must be there already (recovery
    /// reads it from there; the ingest benchmark adopts values that are not, and their
    /// changes then write nothing).
    pub fn adopt(self: &Arc<Self>, sub: Submission) {
        let deadline_ms = sub.deadline_ms();
        let id = sub.id.clone();
        let build = sub.build.as_ref().map(|b| b.id.clone());
        let terminal = sub.state.is_terminal();
        self.store.reload(sub, deadline_ms);
        if let Some(b) = build {
            self.store.key_build(&id, &b);
        }
        if !terminal {
            self.spawn_timeout(&id, deadline_ms);
        }
    }

    /// Ends the submission as `timed_out` at its absolute deadline (kept in the store, so a
    /// restart keeps it too), and cancels its build.
    pub(crate) fn spawn_timeout(self: &Arc<Self>, id: &str, deadline_ms: i64) {
        let Some(mut rx) = self.store.subscribe(id) else {
            return;
        };
        let app = Arc::downgrade(self);
        let id = id.to_string();
        let left = Duration::from_millis(
            u64::try_from(deadline_ms.saturating_sub(Utc::now().timestamp_millis())).unwrap_or(0),
        );
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(left) => {}
                // Ends the timer as soon as the submission ends.
                _ = rx.wait_for(|s| s.state.is_terminal()) => return,
            }
            let Some(app) = app.upgrade() else { return };
            // Before giving up, ask about the build once: its finish event may have been lost
            // inside the reconciler's interval. A finished build is collected (for a short
            // grace), never timed out and canceled.
            let build = rx.borrow().build.clone();
            if let Some(build) = build {
                if app.collect_if_finished(&id, &build, &mut rx).await {
                    return;
                }
            }
            let timeout_s = rx.borrow().timeout_s;
            let msg = format!("no result within {timeout_s} s");
            // Boxed: the ending is rare, and inline its state would make every waiting
            // timer (one per pending submission) that much larger.
            let ended = Box::pin(app.finish_durably(&id, Outcome::TimedOut(msg))).await;
            if let Some(c) = ended {
                if c.changed {
                    if let Some(b) = c.after.build {
                        app.spawn_cancel_build(b);
                    }
                }
            }
        });
    }

    /// At the deadline: asks the executor for the build's state; when it finished, collects it
    /// as its finish event would have, and waits (at most [`TIMEOUT_GRACE`]) for the
    /// submission to end. Returns whether it ended.
    async fn collect_if_finished(
        self: &Arc<Self>,
        id: &str,
        build: &BuildInfo,
        rx: &mut tokio::sync::watch::Receiver<Submission>,
    ) -> bool {
        let status = match tokio::time::timeout(TIMEOUT_GRACE, self.executor.status(build)).await {
            Ok(Ok(Some(s))) => s,
            Ok(Ok(None)) | Err(_) => return false,
            Ok(Err(e)) => {
                tracing::warn!(%id, build = build.number, error = %report(&*e), "at the deadline the build's state could not be asked; timing out");
                return false;
            }
        };
        if !status.finished() || status.blocked {
            return false;
        }
        tracing::info!(%id, build = build.number, state = %status.state, "at the deadline the build had finished (its event was lost): collecting it");
        self.apply(
            id,
            BuildEvent {
                kind: BuildEventKind::Finished,
                build: status,
            },
        )
        .await;
        tokio::time::timeout(TIMEOUT_GRACE, rx.wait_for(|s| s.state.is_terminal()))
            .await
            .is_ok()
    }

    pub(crate) fn spawn_cancel_build(self: &Arc<Self>, build: BuildInfo) {
        let app = self.clone();
        tokio::spawn(async move {
            if !app.store.durable().acting() {
                tracing::error!(
                    build = build.number,
                    "not canceling the build: this service no longer holds the store"
                );
                return;
            }
            match app.executor.cancel(&build).await {
                Ok(true) => tracing::info!(build = build.number, "build canceled"),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(build = build.number, error = %report(&*e), "could not cancel the build")
                }
            }
        });
    }

    /// A submission from memory, else from the store.
    pub async fn lookup(&self, id: &str) -> Result<Option<Submission>, Error> {
        self.store.lookup(id).await.map_err(|e| {
            Error::from(crate::error::Unavailable::Store {
                what: "the store could not be read",
                source: e.into(),
            })
        })
    }

    /// The submission, once it ended or `wait` passed, whichever comes first; at once when
    /// `wait` is zero. Sleeps on the submission's channel: woken by the change itself.
    pub async fn get(&self, id: &str, wait: Duration) -> Result<Submission, Error> {
        if !wait.is_zero() {
            if let Some(mut rx) = self.store.subscribe(id) {
                let _ = tokio::time::timeout(wait, rx.wait_for(|s| s.state.is_terminal())).await;
                let s = rx.borrow().clone();
                return Ok(s);
            }
        }
        self.lookup(id)
            .await?
            .ok_or_else(|| Error::NotFound { id: id.to_string() })
    }

    /// The submission to follow, change by change.
    pub async fn watch(&self, id: &str) -> Result<Watch, Error> {
        if let Some(rx) = self.store.subscribe(id) {
            return Ok(Watch::Live(rx));
        }
        match self.lookup(id).await? {
            Some(s) => Ok(Watch::Done(Box::new(s))),
            None => Err(Error::NotFound { id: id.to_string() }),
        }
    }

    /// Where clients read a submission.
    pub fn status_url(&self, id: &str) -> String {
        match &self.cfg.public_url {
            Some(base) => format!("{}/v1/submissions/{id}", base.trim_end_matches('/')),
            None => format!("/v1/submissions/{id}"),
        }
    }
}

/// What an identical submission is found by: the SHA-256 of the runner version, the queue
/// and the payload, the run config exactly as sent (key order counts, as the runner sees it),
/// already encoded for the build: hashing it costs no second encoding of a large config.
fn cache_key(runner_version: &str, queue: &str, payload: &str) -> String {
    let mut h = sha2::Sha256::new();
    for part in [
        b"kernelkite-cache-1".as_slice(),
        runner_version.as_bytes(),
        queue.as_bytes(),
        payload.as_bytes(),
    ] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    hex::encode(h.finalize())
}

/// Whether `s` is a label the request may carry: 1 to `max` characters (characters, not
/// bytes: what the OpenAPI document's maxLength counts), none a control character.
fn label(s: &str, max: usize) -> bool {
    !s.is_empty() && s.chars().count() <= max && !s.chars().any(char::is_control)
}

fn check_request(req: &SubmitRequest, cfg: &Config) -> Result<(), Invalid> {
    if !crate::dispatch::valid_name(&req.queue) {
        return Err(Invalid::Queue(req.queue.clone()));
    }
    if req.user.as_deref().is_some_and(|u| !label(u, 128)) {
        return Err(Invalid::User);
    }
    if req.run_id.as_deref().is_some_and(|r| !label(r, 256)) {
        return Err(Invalid::RunId);
    }
    if let Some(u) = &req.callback_url {
        match url::Url::parse(u) {
            Ok(url) if matches!(url.scheme(), "http" | "https") && url.host().is_some() => {
                if !cfg.callbacks.signed {
                    return Err(Invalid::CallbackUnsigned);
                }
                if !crate::config::host_allowed(&url, &cfg.callbacks.allowed_hosts) {
                    return Err(Invalid::CallbackHost(
                        url.host_str().unwrap_or_default().to_string(),
                    ));
                }
            }
            parsed => {
                return Err(Invalid::CallbackUrl {
                    url: u.clone(),
                    source: parsed.err(),
                })
            }
        }
    }
    if let Some(t) = req.timeout_s {
        if t == 0 || t > cfg.max_timeout_s {
            return Err(Invalid::Timeout {
                max: cfg.max_timeout_s,
            });
        }
    }
    if !req.config.is_object() {
        return Err(Invalid::ConfigNotObject);
    }
    Ok(())
}
