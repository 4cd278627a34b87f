//! The durable store in PostgreSQL (`KERNELKITE_DATABASE_URL`), for where the service has no
//! disk of its own that outlives it (a Heroku-style platform, kernelbot's: its state lives in
//! the database its `DATABASE_URL` names). The same statements as the SQLite store
//! (`store/sql.rs`) on a pool of connections, in a schema of kernelkite's own
//! (`KERNELKITE_DATABASE_SCHEMA`, default `kernelkite`: the connections' `search_path`), so it
//! can share kernelbot's database without touching kernelbot's tables. Its migrations are its
//! own (`service/migrations-postgres/`), run by sqlx's migrator at start. TLS is as the URL's
//! `sslmode` says (`require` for managed PostgreSQL services).
//!
//! One service serves a schema at a time, as one serves a SQLite data directory: the store
//! holds a session-level advisory lock on a connection of its own, kept on a thread of its own.
//! Every write is fenced by it: its transaction first takes the schema's writers' lock shared,
//! then checks that the lock is still granted to that connection's session, and is refused when
//! it is not. The holder beats: its connection asks the server something every [`BEAT`] (each
//! bounded by [`CHECK_TIMEOUT`]).
//!
//! A second service on the schema waits for the lock (`lock_wait`, or without limit as a
//! *standby*, `PgSettings::standby`) and takes over when the holder ends (its session with it,
//! at once when its process died) or when the holder's session has been silent for
//! [`TAKEOVER_AFTER`]: a process stopped (SIGSTOP), frozen or cut off from the server, whose
//! session the server would keep for as long as the TCP connection looks alive. The waiter
//! then ends that session (`pg_terminate_backend`), which lets go of the lock. Holding it, the
//! waiter takes the writers' lock alone once before it reads anything: every write whose fence
//! passed before the take-over has ended by then (the sessions of those that do not end, a
//! frozen predecessor's, are ended too), and every fence after it fails.
//!
//! The holder stops acting first: once its own last successful beat is older than
//! [`SELF_FENCE_AFTER`] (a second less than a waiter waits), or its connection is lost (the
//! server restarted, the network cut, a waiter ended it), the lock may be another's, so this
//! store refuses every write (and [`Durable::acting`] says no: no build is created or canceled
//! and no callback sent) and, in the service (`PgSettings::exit_on_lost`), the process exits for
//! its supervisor to start it again: a process that lost its lock must not go on acting on what
//! it holds in memory.

use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions, PgSslMode};
use sqlx::{ConnectOptions, Connection, Row};

use super::sql::{
    self, decode, encode, encode_ended, encode_kept, needs_result_of, BODY_FROM_SUBMISSION,
    RUNS_WINDOW_MS,
};
use super::{
    now_ms, Accepted, CacheQuery, CallbackState, DueCallback, Durable, Inserted, NewCallback,
    NewSubmission, Pending, Ran, Reopened, StoreError,
};
use crate::executor::Job;
use crate::report::report;
use crate::submission::Submission;

/// The schema's name when none is given.
pub const DEFAULT_SCHEMA: &str = "kernelkite";

/// How often the holder's connection asks the server something (its beat, which a waiter
/// reads as the session's last change of state).
pub const BEAT: Duration = Duration::from_secs(1);

/// Longest a beat may take before the lock counts as lost: with [`BEAT`], short enough that
/// a holder whose beats all succeed never has one older than [`SELF_FENCE_AFTER`].
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a holder's session may stay silent (by the server's clock) before a waiting
/// service ends it and takes the lock. A holder beats every [`BEAT`]: only a stopped, frozen
/// or cut-off one is silent this long. (Releases before the beat checked every 5 s.)
pub const TAKEOVER_AFTER: Duration = Duration::from_secs(6);

/// How long after its last successful beat a holder stops writing and exits: before any
/// waiter may take over ([`TAKEOVER_AFTER`], a second later).
pub const SELF_FENCE_AFTER: Duration = Duration::from_secs(5);

/// The exit status of a service that lost its lock (`EX_TEMPFAIL`).
pub const EXIT_LOST: i32 = 75;

/// Whether the schema's lock is still granted to the holder's session (`$3`, its backend pid):
/// the fence every write's transaction starts with, once it holds the writers' lock shared
/// ([`WRITERS_CLASS`]): a fence passed before a take-over is a write the one taking over waits
/// for, and one checked after it fails.
const FENCE: &str =
    "SELECT COUNT(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2
       AND classid = $1::bigint::oid AND objid = $2::bigint::oid AND pid = $3";

/// How long opening waits for the server to answer.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// The first key of the store's advisory lock (the second is the schema's hash): "kk".
const LOCK_CLASS: i32 = 0x6b6b;

/// The first key of the schema's writers' lock, "kw" (the second is the schema's hash too):
/// every write's transaction holds it shared; a service taking over holds it alone once, so
/// that every write its predecessor's fence let through has ended before it reads anything.
const WRITERS_CLASS: i32 = 0x6b77;

/// How long a start waits in the server's queue for a held lock before it looks at the holder
/// again (the server hands the lock over the moment its holder lets go).
const LOCK_POLL: Duration = Duration::from_millis(500);

/// PostgreSQL's "lock_not_available": a `lock_timeout` ran out.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// PostgreSQL's "unique_violation".
const UNIQUE_VIOLATION: &str = "23505";

/// The migrations of `service/migrations-postgres/`, embedded at build time.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations-postgres");

/// The setting (on every connection of the service) that names the channel the submissions
/// table's trigger announces changes on (`migrations-postgres/0002_replicas.sql`; see `super::replicas`).
pub(crate) const CHANGED_SETTING: &str = "kernelkite.changed";

/// The notification channels of one schema. Named from the schema's lock key: a channel's
/// name is at most 63 bytes, and a schema's name may be that long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Channels {
    /// A submission changed (payload: its id).
    pub changed: String,
    /// A request was relayed (payload: its id).
    pub relayed: String,
    /// A relayed request was answered (payload: its id).
    pub answered: String,
}

/// The channels of `schema`.
pub fn channels(schema: &str) -> Channels {
    let key = lock_key(schema) as u32;
    Channels {
        changed: format!("kernelkite_{key:08x}_changed"),
        relayed: format!("kernelkite_{key:08x}_relayed"),
        answered: format!("kernelkite_{key:08x}_answered"),
    }
}

/// Where the store is.
#[derive(Clone)]
pub struct PgSettings {
    /// `postgres://user:password@host:port/database?sslmode=...`.
    pub url: String,
    /// kernelkite's schema in that database.
    pub schema: String,
    /// Most connections the service opens (the lock's own not counted).
    pub max_connections: u32,
    /// How long a start waits for the schema's lock while another session holds it: a service
    /// that just died holds it until the server notices (at once when its process died); one
    /// whose session stays silent for [`TAKEOVER_AFTER`] is taken over.
    pub lock_wait: Duration,
    /// Wait for the lock without limit (a standby replica), instead of `lock_wait`.
    pub standby: bool,
    /// One of several replicas (`KERNELKITE_REPLICA`): its connections name the channel the
    /// submissions' changes are announced on ([`Channels::changed`]); others announce nothing.
    pub replica: bool,
    /// Whether losing the lock ends the process ([`EXIT_LOST`]): the service's choice; a test's
    /// store only refuses its writes.
    pub exit_on_lost: bool,
}

impl std::fmt::Debug for PgSettings {
    /// Without the URL, whose password it may carry.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgSettings")
            .field("url", &"<redacted>")
            .field("schema", &self.schema)
            .field("max_connections", &self.max_connections)
            .field("lock_wait", &self.lock_wait)
            .field("standby", &self.standby)
            .field("exit_on_lost", &self.exit_on_lost)
            .finish()
    }
}

/// Whether `schema` can be kernelkite's schema: lower-case letters, digits and `_`, not
/// starting with a digit, at most 63 bytes (PostgreSQL's limit), so it needs no quoting.
pub fn valid_schema(schema: &str) -> bool {
    let mut chars = schema.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && schema.len() <= 63
        // The server's own and the default schema: kernelkite's tables never go there.
        && !schema.starts_with("pg_")
        && !["public", "information_schema"].contains(&schema)
}

/// The URL without its password, for messages and logs.
pub fn shown(opts: &PgConnectOptions) -> String {
    format!(
        "postgres://{}@{}:{}/{}",
        opts.get_username(),
        opts.get_host(),
        opts.get_port(),
        opts.get_database().unwrap_or_default()
    )
}

/// The schema's advisory lock as `pg_locks` shows it, `(classid, objid)` (with `objsubid` 2):
/// how an operator (or a test) finds the session holding it.
pub fn lock_id(schema: &str) -> (i64, i64) {
    (i64::from(LOCK_CLASS), i64::from(lock_key(schema) as u32))
}

/// The schema's writers' lock as `pg_locks` shows it, `(classid, objid)` (with `objsubid` 2):
/// every write's transaction holds it shared.
pub fn writers_lock_id(schema: &str) -> (i64, i64) {
    (i64::from(WRITERS_CLASS), i64::from(lock_key(schema) as u32))
}

/// The second key of the schema's advisory lock: its name's FNV-1a hash.
pub(crate) fn lock_key(schema: &str) -> i32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in schema.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h as i32
}

/// The PostgreSQL store. Cloning is cheap; the lock is let go when the last clone drops.
#[derive(Clone)]
pub struct Postgres {
    pool: PgPool,
    /// What its connections were opened with.
    opts: PgConnectOptions,
    /// Its schema.
    schema: String,
    keeper: Arc<Keeper>,
    /// The lock's keys and the backend pid of the session holding it: every write's fence.
    fence: (i64, i64, i32),
    exit_on_lost: bool,
    /// Where, for messages: the URL without its password, and the schema.
    target: String,
    metrics: Option<Arc<crate::metrics::Metrics>>,
}

impl std::fmt::Debug for Postgres {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Postgres")
            .field("target", &self.target)
            .finish()
    }
}

/// The thread that holds the schema's lock on its connection; stopped (and the lock let go)
/// when dropped.
struct Keeper {
    stop: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Why the lock's connection was lost, once it was.
    lost: Arc<Mutex<Option<String>>>,
    /// When the holder's connection last answered.
    beat: Arc<Beat>,
}

/// When the holder's last successful beat began, on the boot clock
/// ([`kernelkite_sys::raw::boottime`]: a process stopped, or suspended with its machine, finds
/// it old as soon as it runs again).
struct Beat {
    last_ok_ms: std::sync::atomic::AtomicU64,
}

impl Beat {
    fn new() -> Beat {
        Beat {
            last_ok_ms: std::sync::atomic::AtomicU64::new(now_boot_ms()),
        }
    }

    /// A beat that began at `began_ms` (boot clock) was answered.
    fn answered(&self, began_ms: u64) {
        self.last_ok_ms
            .fetch_max(began_ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// How long before `now_ms` (boot clock) the last successful beat began.
    fn age(&self, now_ms: u64) -> Duration {
        Duration::from_millis(
            now_ms.saturating_sub(self.last_ok_ms.load(std::sync::atomic::Ordering::Relaxed)),
        )
    }

    /// Why this holder must stop acting, when its last beat is older than
    /// [`SELF_FENCE_AFTER`].
    fn stale(&self) -> Option<String> {
        stale_after(self.age(now_boot_ms()))
    }
}

/// The boot clock in milliseconds.
fn now_boot_ms() -> u64 {
    kernelkite_sys::raw::boottime().as_millis() as u64
}

/// Why a holder whose last beat is `age` old must stop acting, if it must.
fn stale_after(age: Duration) -> Option<String> {
    (age > SELF_FENCE_AFTER).then(|| {
        format!(
            "this service's last beat to the database was {:.1} s ago (the process was stopped, suspended or starved): another service may hold the schema by now",
            age.as_secs_f64()
        )
    })
}

impl Drop for Keeper {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = stop.send(());
        }
        // The lock is let go before the drop returns: a store opened next (a restart in the
        // same process) finds it free.
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
    }
}

impl Postgres {
    /// Opens the store: connects, takes the schema's lock, creates the schema when missing,
    /// brings it up to date and reads what a start needs ([`Reopened`]). Blocks while it does
    /// (it runs before the service serves anything); needs a tokio runtime, on which the
    /// pool's connections then serve.
    pub fn open(
        settings: &PgSettings,
        metrics: Option<Arc<crate::metrics::Metrics>>,
    ) -> Result<(Postgres, Reopened), StoreError> {
        let opts = connect_options(settings)?;
        let target = format!("{} (schema {})", shown(&opts), settings.schema);
        let lost = Arc::new(Mutex::new(None));
        let beat = Arc::new(Beat::new());
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let (opened, started) = std::sync::mpsc::channel();
        let thread = {
            let (opts, schema, lost, beat) = (
                opts.clone(),
                settings.schema.clone(),
                lost.clone(),
                beat.clone(),
            );
            let exit_on_lost = settings.exit_on_lost;
            let wait = if settings.standby {
                None
            } else {
                Some(settings.lock_wait)
            };
            std::thread::Builder::new()
                .name("kernelkite-db-lock".into())
                .spawn(move || {
                    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    else {
                        let _ = opened.send(Err(OpenError::Other(
                            "no runtime for the lock's thread".into(),
                        )));
                        return;
                    };
                    rt.block_on(async move {
                        match start(&opts, &schema, wait).await {
                            Ok((conn, reopened, pid)) => {
                                beat.answered(now_boot_ms());
                                let _ = opened.send(Ok((reopened, pid)));
                                let held = Held {
                                    lost,
                                    beat,
                                    exit_on_lost,
                                };
                                keep(conn, &schema, stopped, &held).await;
                            }
                            Err(e) => {
                                let _ = opened.send(Err(e));
                            }
                        }
                    })
                })
                .map_err(|e| StoreError::Database {
                    target: target.clone(),
                    cause: e.to_string(),
                })?
        };
        let (reopened, holder_pid) = match started.recv() {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e.into_error(&target, &settings.schema));
            }
            Err(_) => {
                let _ = thread.join();
                return Err(StoreError::Database {
                    target,
                    cause: "the opening thread ended".into(),
                });
            }
        };
        let pool = PgPoolOptions::new()
            .max_connections(settings.max_connections.max(1))
            .acquire_timeout(Duration::from_secs(10))
            .connect_lazy_with(opts.clone());
        tracing::info!(store = %target, "the store is in PostgreSQL");
        Ok((
            Postgres {
                opts,
                schema: settings.schema.clone(),
                pool,
                keeper: Arc::new(Keeper {
                    stop: Mutex::new(Some(stop)),
                    thread: Mutex::new(Some(thread)),
                    lost,
                    beat,
                }),
                fence: {
                    let (class, key) = lock_id(&settings.schema);
                    (class, key, holder_pid)
                },
                exit_on_lost: settings.exit_on_lost,
                target,
                metrics,
            },
            reopened,
        ))
    }

    /// Its connections, and the options they were opened with (the replicas' side of the
    /// store, `super::replicas`, works on them).
    pub(crate) fn connections(&self) -> (&PgPool, &PgConnectOptions, &str) {
        (&self.pool, &self.opts, &self.schema)
    }

    /// The backend pid of the session holding the schema's lock.
    pub fn holder(&self) -> i32 {
        self.fence.2
    }

    /// Where the store is: the URL without its password, and the schema.
    pub fn target(&self) -> &str {
        &self.target
    }

    fn observe(&self, op: &str, since: Instant) {
        if let Some(m) = &self.metrics {
            m.store_seconds
                .get_or_create(&crate::metrics::OpLabel { op: op.to_string() })
                .observe(since.elapsed().as_secs_f64());
        }
    }

    /// Refuses once the lock's connection is lost, or its last beat is too old to be sure
    /// no other service took over.
    pub(crate) fn held(&self) -> Result<(), StoreError> {
        if let Some(why) = self.keeper.beat.stale() {
            lose(&self.keeper.lost, why, self.exit_on_lost);
        }
        match self
            .keeper
            .lost
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            Some(why) => Err(StoreError::DatabaseLost {
                target: self.target.clone(),
                cause: why,
            }),
            None => Ok(()),
        }
    }

    pub(crate) fn write_err(&self, e: &sqlx::Error) -> StoreError {
        let why = report(e);
        tracing::error!(error = %why, store = %self.target, "the store could not commit");
        StoreError::DatabaseWrite(why)
    }

    async fn conn(&self) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, StoreError> {
        self.pool
            .acquire()
            .await
            .map_err(|e| StoreError::Read(report(&e)))
    }

    /// Begins a write: a transaction whose first statement is the fence (the schema's lock
    /// still granted to this store's holding session). A fence that fails loses the lock.
    async fn begin_fenced(&self) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, StoreError> {
        self.held()?;
        let mut tx = self.pool.begin().await.map_err(|e| self.write_err(&e))?;
        let (class, key, pid) = self.fence;
        sqlx::query("SELECT pg_advisory_xact_lock_shared($1, $2)")
            .bind(WRITERS_CLASS)
            .bind(key as u32 as i32)
            .execute(&mut *tx)
            .await
            .map_err(|e| self.write_err(&e))?;
        let granted: i64 = sqlx::query_scalar(FENCE)
            .bind(class)
            .bind(key)
            .bind(pid)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| self.write_err(&e))?;
        if granted == 0 {
            let why = "the schema's lock is no longer held by this service's session".to_string();
            lose(&self.keeper.lost, why.clone(), self.exit_on_lost);
            return Err(StoreError::DatabaseLost {
                target: self.target.clone(),
                cause: why,
            });
        }
        Ok(tx)
    }

    async fn insert(&self, new: NewSubmission) -> Result<Inserted, StoreError> {
        self.held()?;
        let t = Instant::now();
        if let Some((key, hash)) = &new.idempotency {
            if let Some(existing) = self.read(async |c| keyed(c, key, hash).await).await? {
                return Ok(existing);
            }
        }
        // The transaction's connection goes back to the pool before anything else is asked
        // of it (racers each holding one while waiting for another would drain it); dropped
        // without a commit, the transaction is rolled back.
        let done = {
            let mut tx = self.begin_fenced().await?;
            match insert(&mut tx, &new).await {
                Ok(()) => tx.commit().await,
                Err(e) => Err(e),
            }
        };
        self.observe("insert", t);
        match done {
            Ok(()) => Ok(Inserted::Created),
            // Another request's insert with the same key won the race: its submission is the
            // answer, as if it had been found first.
            Err(e) if is_unique_violation(&e) && new.idempotency.is_some() => {
                let (key, hash) = new.idempotency.as_ref().map_or(("", ""), |(k, h)| (k, h));
                self.read(async |c| keyed(c, key, hash).await)
                    .await?
                    .ok_or_else(|| self.write_err(&e))
            }
            Err(e) => Err(self.write_err(&e)),
        }
    }

    async fn save(&self, s: &Submission) -> Result<(), StoreError> {
        let t = Instant::now();
        let doc = encode_kept(s).map_err(|e| self.write_err(&e))?;
        let mut tx = self.begin_fenced().await?;
        sqlx::query(sql::SAVE)
            .bind(&s.id)
            .bind(s.state.as_str())
            .bind(doc)
            .bind(s.build.as_ref().map(|b| b.id.clone()))
            .bind(s.build.as_ref().map(|b| b.number as i64))
            .execute(&mut *tx)
            .await
            .map_err(|e| self.write_err(&e))?;
        tx.commit().await.map_err(|e| self.write_err(&e))?;
        self.observe("save", t);
        Ok(())
    }

    async fn finish(&self, s: &Submission, cb: Option<NewCallback>) -> Result<bool, StoreError> {
        let t = Instant::now();
        let mut tx = self.begin_fenced().await?;
        let ended = finish(&mut tx, s, cb)
            .await
            .map_err(|e| self.write_err(&e))?;
        tx.commit().await.map_err(|e| self.write_err(&e))?;
        self.observe("finish", t);
        Ok(ended)
    }

    async fn callback_attempted(
        &self,
        id: &str,
        state: CallbackState,
        attempts: i64,
        next_at_ms: i64,
        error: Option<String>,
    ) -> Result<(), StoreError> {
        let mut tx = self.begin_fenced().await?;
        sqlx::query(sql::CALLBACK_ATTEMPTED)
            .bind(id)
            .bind(state.as_str())
            .bind(attempts)
            .bind(next_at_ms)
            .bind(error)
            .execute(&mut *tx)
            .await
            .map_err(|e| self.write_err(&e))?;
        tx.commit().await.map_err(|e| self.write_err(&e))
    }

    async fn fleet_save(&self, id: &str, doc: &str) -> Result<(), StoreError> {
        let mut tx = self.begin_fenced().await?;
        sqlx::query(sql::FLEET_SAVE)
            .bind(id)
            .bind(doc)
            .bind(now_ms())
            .execute(&mut *tx)
            .await
            .map_err(|e| self.write_err(&e))?;
        tx.commit().await.map_err(|e| self.write_err(&e))
    }

    async fn fleet_forget(&self, id: &str) -> Result<(), StoreError> {
        let mut tx = self.begin_fenced().await?;
        sqlx::query(sql::FLEET_FORGET)
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(|e| self.write_err(&e))?;
        tx.commit().await.map_err(|e| self.write_err(&e))
    }

    async fn fleet_load(&self) -> Result<Vec<String>, StoreError> {
        self.read(async |c| sqlx::query_scalar(sql::FLEET_LOAD).fetch_all(&mut *c).await)
            .await
    }

    async fn load(&self, id: &str) -> Result<Option<Submission>, StoreError> {
        let mut c = self.conn().await?;
        load(&mut c, id)
            .await
            .map_err(|e| StoreError::Read(report(&e)))
    }

    async fn read<T>(
        &self,
        f: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, StoreError> {
        let mut c = self.conn().await?;
        f(&mut c).await.map_err(|e| StoreError::Read(report(&e)))
    }

    async fn job(&self, id: &str) -> Result<Option<Job>, StoreError> {
        self.read(async |c| {
            let job: Option<Option<String>> = sqlx::query_scalar(sql::JOB)
                .bind(id)
                .fetch_optional(&mut *c)
                .await?;
            job.flatten().map(|j| decode(&j)).transpose()
        })
        .await
    }

    async fn cached(&self, q: &CacheQuery) -> Result<Option<Submission>, StoreError> {
        self.read(async |c| {
            let doc: Option<String> = sqlx::query_scalar(sql::CACHED)
                .bind(&q.key)
                .bind(q.since_ms)
                .bind(crate::submission::State::Succeeded.as_str())
                .bind(q.max_timeout_ms)
                .fetch_optional(&mut *c)
                .await?;
            match doc {
                Some(doc) => shown_doc(c, &doc).await.map(Some),
                None => Ok(None),
            }
        })
        .await
    }

    async fn due_callbacks(&self, now: i64, limit: i64) -> Result<Vec<DueCallback>, StoreError> {
        self.read(async |c| due_callbacks(c, now, limit).await)
            .await
    }

    async fn next_callback_at(&self) -> Result<Option<i64>, StoreError> {
        self.read(async |c| {
            sqlx::query(sql::NEXT_CALLBACK_AT)
                .bind(CallbackState::Pending.as_str())
                .fetch_one(&mut *c)
                .await?
                .try_get(0)
        })
        .await
    }

    /// Reachable and writable: the lock is still held (the fence) and a probe write commits.
    async fn health(&self) -> Result<(), StoreError> {
        let mut tx = self.begin_fenced().await?;
        sqlx::query(sql::PROBE)
            .bind(now_ms())
            .execute(&mut *tx)
            .await
            .map_err(|e| StoreError::DatabaseWrite(report(&e)))?;
        tx.commit()
            .await
            .map_err(|e| StoreError::DatabaseWrite(report(&e)))
    }
}

/// Why opening failed, before the target is known to the message.
enum OpenError {
    InUse(String),
    Other(String),
}

impl From<String> for OpenError {
    fn from(s: String) -> OpenError {
        OpenError::Other(s)
    }
}

impl OpenError {
    fn into_error(self, target: &str, schema: &str) -> StoreError {
        match self {
            OpenError::Other(cause) => StoreError::Database {
                target: target.to_string(),
                cause,
            },
            OpenError::InUse(holder) => StoreError::DatabaseInUse {
                schema: schema.to_string(),
                holder,
            },
        }
    }
}

/// The URL's options, with the schema as the search path and who this is as the
/// application name (which a refused second service names).
pub(crate) fn connect_options(settings: &PgSettings) -> Result<PgConnectOptions, StoreError> {
    let malformed = |why: String| StoreError::Database {
        target: "KERNELKITE_DATABASE_URL".into(),
        cause: format!(
            "{why} (the form is postgres://user:password@host:port/database?sslmode=require)"
        ),
    };
    if !["postgres://", "postgresql://"]
        .iter()
        .any(|p| settings.url.starts_with(p))
    {
        return Err(malformed("not a postgres:// URL".into()));
    }
    let opts = PgConnectOptions::from_str(&settings.url).map_err(|e| malformed(report(&e)))?;
    // Checked by the configuration too; here because the name is spliced into SQL.
    if !valid_schema(&settings.schema) {
        return Err(StoreError::Database {
            target: shown(&opts),
            cause: format!(
                "the schema name {:?} is not plain (lower-case letters, digits and _; KERNELKITE_DATABASE_SCHEMA)",
                settings.schema
            ),
        });
    }
    let me = format!(
        "kernelkite-service pid {} on {}",
        std::process::id(),
        kernelkite_sys::host::name()
    );
    // The server's keepalives on every connection (TCP ones; a local socket has none): the
    // sessions of a service whose machine died end within about 25 s, where the server's
    // defaults would keep them for two hours (a waiting service takes the lock over after
    // `TAKEOVER_AFTER` of silence anyway).
    let tls = ssl_mode(&settings.url, &opts);
    // Where the submissions' trigger announces changes, for the replicas' waiters; a lone
    // service names no channel, and its commits notify nothing.
    let changed = if settings.replica {
        channels(&settings.schema).changed
    } else {
        String::new()
    };
    Ok(opts
        .options([
            ("search_path", settings.schema.as_str()),
            (CHANGED_SETTING, changed.as_str()),
            ("tcp_keepalives_idle", "10"),
            ("tcp_keepalives_interval", "5"),
            ("tcp_keepalives_count", "3"),
        ])
        .application_name(&me)
        .ssl_mode(tls)
        .disable_statement_logging())
}

/// The TLS mode: the URL's `sslmode` when it names one; else `require` for a server
/// elsewhere (where sqlx's default, `prefer`, would let a man in the middle talk it down to
/// plain text: a platform's `DATABASE_URL` often names none), and `prefer` on this machine.
/// `opts` are the URL's, as parsed (which cannot tell an `sslmode` named from its default).
fn ssl_mode(url: &str, opts: &PgConnectOptions) -> PgSslMode {
    let named = url
        .split_once('?')
        .is_some_and(|(_, q)| q.split('&').any(|kv| kv.starts_with("sslmode=")));
    if named {
        opts.get_ssl_mode()
    } else if is_local(opts) {
        PgSslMode::Prefer
    } else {
        PgSslMode::Require
    }
}

/// Whether the server is this machine (loopback, or a local socket).
fn is_local(opts: &PgConnectOptions) -> bool {
    let host = opts.get_host();
    host.starts_with('/')
        || host == "localhost"
        || host
            .trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Takes the schema's lock on `conn`: at once when it is free; else waits for it, `wait` long
/// (without limit for a standby, `None`), ending the holder's session once it has been silent
/// for [`TAKEOVER_AFTER`]. `pid` is `conn`'s backend.
async fn lock(
    conn: &mut PgConnection,
    schema: &str,
    wait: Option<Duration>,
    pid: i32,
) -> Result<(), OpenError> {
    let waited = Instant::now();
    let mut said = None;
    let mut locked = bounded(
        sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2)")
            .bind(LOCK_CLASS)
            .bind(lock_key(schema))
            .fetch_one(&mut *conn),
    )
    .await?;
    loop {
        if locked {
            if said.is_some() {
                tracing::warn!(
                    schema,
                    waited_s = waited.elapsed().as_secs_f64(),
                    "took the schema's lock: this service serves it now"
                );
            }
            return drain_writers(conn, schema).await;
        }
        let who = holder(conn, schema).await;
        let mut ended = false;
        if let Some(silent) = who.silent.filter(|s| *s > TAKEOVER_AFTER) {
            tracing::warn!(holder = %who.shown, silent_s = silent.as_secs_f64(), schema, "the schema's holder has been silent for longer than {} s (stopped, frozen or cut off): ending its database session to take over", TAKEOVER_AFTER.as_secs());
            ended = bounded(
                sqlx::query_scalar::<_, bool>("SELECT pg_terminate_backend($1)")
                    .bind(who.pid)
                    .fetch_one(&mut *conn),
            )
            .await
            .unwrap_or(false);
            if !ended {
                tracing::error!(holder = %who.shown, "could not end the silent holder's session: run every replica as the same database role (a session of another role can only be ended by a superuser)");
            }
        } else if said.as_deref() != Some(who.shown.as_str()) {
            match wait {
                None => {
                    tracing::warn!(holder = %who.shown, schema, "standing by: another service holds the schema; taking over when it ends or stays silent for {} s", TAKEOVER_AFTER.as_secs())
                }
                Some(w) => {
                    tracing::warn!(holder = %who.shown, schema, "the schema is held by another service; waiting up to {} s for it (a service that just died lets go at once, a silent one is taken over after {} s)", w.as_secs(), TAKEOVER_AFTER.as_secs())
                }
            }
            if who.silent.is_none() && who.pid != 0 {
                tracing::warn!(holder = %who.shown, "the server does not show this role how long the holder's session has been silent (another role's?): a frozen holder cannot be taken over; run every replica as the same database role");
            }
            said = Some(who.shown.clone());
        }
        // A round that ended the holder's session waits for its lock, whatever the deadline.
        if !ended && wait.is_some_and(|w| waited.elapsed() >= w) {
            return Err(OpenError::InUse(who.shown));
        }
        locked = queue_for_lock(conn, schema, pid).await?;
    }
}

/// A query of the lock's start, bounded: a server that stops answering (the network cut: the
/// connection's own keepalives are the server's, not this side's) ends the start instead of
/// hanging it, for the supervisor to start the service again.
async fn bounded<T>(
    query: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, OpenError> {
    let limit = LOCK_POLL + CHECK_TIMEOUT;
    match tokio::time::timeout(limit, query).await {
        Ok(r) => r.map_err(|e| report(&e).into()),
        Err(_) => Err(OpenError::Other(format!(
            "the server did not answer within {} s",
            limit.as_secs_f64()
        ))),
    }
}

/// A transaction whose lock waits last at most [`LOCK_POLL`] (then fail with
/// [`LOCK_NOT_AVAILABLE`]).
async fn waiting_at_most_a_poll(
    conn: &mut PgConnection,
) -> Result<sqlx::Transaction<'_, sqlx::Postgres>, OpenError> {
    let mut tx = bounded(conn.begin()).await?;
    bounded(
        sqlx::query(&format!(
            "SET LOCAL lock_timeout = {}",
            LOCK_POLL.as_millis()
        ))
        .execute(&mut *tx),
    )
    .await?;
    Ok(tx)
}

/// Once the lock is taken: waits until no write its predecessor's fence let through is still
/// open (each holds the writers' lock shared; none of this service's own has begun), ending
/// the sessions of those that do not end by themselves (a frozen predecessor's).
async fn drain_writers(conn: &mut PgConnection, schema: &str) -> Result<(), OpenError> {
    let key = lock_key(schema);
    for _ in 0..20 {
        let mut tx = waiting_at_most_a_poll(conn).await?;
        let alone = tokio::time::timeout(
            LOCK_POLL + CHECK_TIMEOUT,
            sqlx::query("SELECT pg_advisory_xact_lock($1, $2)")
                .bind(WRITERS_CLASS)
                .bind(key)
                .execute(&mut *tx),
        )
        .await;
        match alone {
            Ok(Ok(_)) => return bounded(tx.commit()).await,
            Ok(Err(sqlx::Error::Database(d)))
                if d.code().as_deref() == Some(LOCK_NOT_AVAILABLE) =>
            {
                bounded(tx.rollback()).await?;
            }
            Ok(Err(e)) => return Err(report(&e).into()),
            Err(_) => return Err(OpenError::Other("the server did not answer".into())),
        }
        let ended: Vec<bool> = bounded(
            sqlx::query_scalar(
                "SELECT pg_terminate_backend(pid) FROM pg_locks
                 WHERE locktype = 'advisory' AND granted AND objsubid = 2
                   AND classid = $1::bigint::oid AND objid = $2::bigint::oid
                   AND pid <> pg_backend_pid()",
            )
            .bind(i64::from(WRITERS_CLASS))
            .bind(i64::from(key as u32))
            .fetch_all(&mut *conn),
        )
        .await?;
        tracing::warn!(
            sessions = ended.len(),
            "ended the previous service's sessions still inside a write (it was frozen or cut off after its fence let them through)"
        );
    }
    Err(OpenError::Other(
        "the previous service's writes did not end (their sessions could not be ended: run every replica as the same database role)".into(),
    ))
}

/// Waits in the server's queue for the schema's lock, at most [`LOCK_POLL`]: whether it was
/// taken (the server hands it over the moment the holder's session lets go).
async fn queue_for_lock(
    conn: &mut PgConnection,
    schema: &str,
    pid: i32,
) -> Result<bool, OpenError> {
    let mut tx = waiting_at_most_a_poll(conn).await?;
    // A session lock: it outlives the transaction it was taken in.
    let taken = bounded(
        sqlx::query("SELECT pg_advisory_lock($1, $2)")
            .bind(LOCK_CLASS)
            .bind(lock_key(schema))
            .execute(&mut *tx),
    )
    .await;
    match taken {
        Ok(_) => {
            bounded(tx.commit()).await?;
            Ok(true)
        }
        Err(_) => {
            bounded(tx.rollback()).await?;
            // The server can grant the lock and still report the timeout (the two race):
            // whether this session holds it now is what counts.
            let (class, key) = lock_id(schema);
            let mine: i64 = bounded(
                sqlx::query_scalar(FENCE)
                    .bind(class)
                    .bind(key)
                    .bind(pid)
                    .fetch_one(&mut *conn),
            )
            .await?;
            Ok(mine > 0)
        }
    }
}

/// What the lock's thread does before serving: connect, lock, create and migrate the schema,
/// read what a start needs. The connection it returns holds the lock.
async fn start(
    opts: &PgConnectOptions,
    schema: &str,
    wait: Option<Duration>,
) -> Result<(PgConnection, Reopened, i32), OpenError> {
    let mut conn = match tokio::time::timeout(CONNECT_TIMEOUT, opts.connect()).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return Err(OpenError::Other(report(&e))),
        Err(_) => {
            return Err(OpenError::Other(format!(
                "no answer within {} s",
                CONNECT_TIMEOUT.as_secs()
            )))
        }
    };
    // This session's backend: the lock's holder, as every write's fence names it.
    let pid: i32 =
        bounded(sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut conn)).await?;
    lock(&mut conn, schema, wait, pid).await?;
    // Created only when missing: the server checks the right to create a schema before it
    // looks for one, so a schema the operator made for a user without that right is used as
    // it is. The name was checked (`valid_schema`): no quoting can be escaped.
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
            .bind(schema)
            .fetch_one(&mut conn)
            .await
            .map_err(|e| report(&e))?;
    if !exists {
        sqlx::query(&format!("CREATE SCHEMA \"{schema}\""))
            .execute(&mut conn)
            .await
            .map_err(|e| report(&e))?;
    }
    refuse_newer(&mut conn, schema).await?;
    MIGRATOR.run(&mut conn).await.map_err(|e| report(&e))?;
    let now = now_ms();
    let reopened = Reopened {
        pending: pending(&mut conn).await.map_err(|e| report(&e))?,
        accepted: accepted(&mut conn, now.saturating_sub(crate::dispatch::HOUR_MS))
            .await
            .map_err(|e| report(&e))?,
        runs: runs(&mut conn, now.saturating_sub(RUNS_WINDOW_MS))
            .await
            .map_err(|e| report(&e))?,
    };
    Ok((conn, reopened, pid))
}

/// Refuses a schema a later release migrated further than this one knows: its statements
/// might not hold there. Migrations only add (expand, then contract in a later release), so
/// during a rolling upgrade the replicas already running the earlier release go on; one of
/// them restarting is refused, and the upgrade goes on with the new release.
async fn refuse_newer(conn: &mut PgConnection, schema: &str) -> Result<(), OpenError> {
    let applied: Option<i64> =
        match sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations WHERE success")
            .fetch_one(&mut *conn)
            .await
        {
            Ok(v) => v,
            // UNDEFINED_TABLE: a schema never migrated.
            Err(sqlx::Error::Database(d)) if d.code().as_deref() == Some("42P01") => None,
            Err(e) => return Err(report(&e).into()),
        };
    let known = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
    match applied {
        Some(v) if v > known => Err(OpenError::Other(format!(
            "the schema {schema} was migrated by a later kernelkite-service release (to version {v}; this release knows up to {known}): run that release (or a later one), or restore a backup taken before the upgrade"
        ))),
        _ => Ok(()),
    }
}

/// The session holding the schema's lock, as the server shows it.
struct Holder {
    /// Its application name, address and start; what can be said when the server shows none.
    shown: String,
    /// Its backend's pid (0: not seen).
    pid: i32,
    /// How long its session has said nothing, by the server's clock: since its last query
    /// ended (or since the server began waiting to send it an answer it does not take); none
    /// while the server runs a query of its (a long migration is not silence). `None` when the
    /// server does not show it (another role's session).
    silent: Option<Duration>,
}

/// Who holds the schema's lock, and how long its session has been silent.
async fn holder(conn: &mut PgConnection, schema: &str) -> Holder {
    let (class, key) = lock_id(schema);
    let row = sqlx::query(
        "SELECT a.application_name, COALESCE(host(a.client_addr), 'a local socket'),
                to_char(a.backend_start AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'),
                a.pid,
                CASE WHEN a.state <> 'active' OR a.wait_event_type = 'Client'
                     THEN EXTRACT(EPOCH FROM (clock_timestamp() - a.state_change))::float8
                     ELSE 0 END
         FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
           AND l.classid = $1::bigint::oid AND l.objid = $2::bigint::oid
         LIMIT 1",
    )
    .bind(class)
    .bind(key)
    .fetch_optional(&mut *conn)
    .await;
    match row {
        Ok(Some(r)) => {
            let name: Option<String> = r.try_get(0).ok();
            let from: Option<String> = r.try_get(1).ok();
            let since: Option<String> = r.try_get(2).ok();
            let silent: Option<f64> = r.try_get(4).ok().flatten();
            Holder {
                shown: format!(
                    "{}, connected from {} since {}",
                    name.filter(|n| !n.is_empty())
                        .unwrap_or_else(|| "a session".into()),
                    from.unwrap_or_default(),
                    since.unwrap_or_default()
                ),
                pid: r.try_get(3).unwrap_or(0),
                silent: silent
                    .filter(|s| s.is_finite() && *s >= 0.0)
                    .map(Duration::from_secs_f64),
            }
        }
        _ => Holder {
            shown: "a session this role cannot see".into(),
            pid: 0,
            silent: None,
        },
    }
}

/// What the holder's thread shares with the store.
struct Held {
    lost: Arc<Mutex<Option<String>>>,
    beat: Arc<Beat>,
    exit_on_lost: bool,
}

/// Holds the lock until told to stop: beats every [`BEAT`] (each bounded by
/// [`CHECK_TIMEOUT`]) and, once the connection is lost or the last beat is older than
/// [`SELF_FENCE_AFTER`], says so; then lets go of the lock before closing, so that a store
/// opened next finds it free at once.
async fn keep(
    mut conn: PgConnection,
    schema: &str,
    mut stop: tokio::sync::oneshot::Receiver<()>,
    held: &Held,
) {
    loop {
        tokio::select! {
            _ = &mut stop => break,
            _ = tokio::time::sleep(BEAT) => {
                if let Some(why) = held.beat.stale() {
                    lose(&held.lost, why, held.exit_on_lost);
                    return;
                }
                let began = now_boot_ms();
                let check = tokio::time::timeout(CHECK_TIMEOUT, sqlx::query("SELECT 1").execute(&mut conn));
                let why = match check.await {
                    Ok(Ok(_)) => {
                        held.beat.answered(began);
                        continue;
                    }
                    Ok(Err(e)) => report(&e),
                    Err(_) => format!("no answer within {} s", CHECK_TIMEOUT.as_secs()),
                };
                lose(&held.lost, why, held.exit_on_lost);
                return;
            }
        }
    }
    let unlock = sqlx::query("SELECT pg_advisory_unlock($1, $2)")
        .bind(LOCK_CLASS)
        .bind(lock_key(schema))
        .execute(&mut conn);
    let _ = tokio::time::timeout(CHECK_TIMEOUT, unlock).await;
    let _ = tokio::time::timeout(CHECK_TIMEOUT, conn.close()).await;
}

/// Records that the lock is lost (every later write is refused) and, in the service, ends the
/// process: what it holds in memory (queued work, timers, callbacks) is another's to act on.
fn lose(lost: &Mutex<Option<String>>, why: String, exit_on_lost: bool) {
    if lost.lock().unwrap_or_else(|p| p.into_inner()).is_some() && !exit_on_lost {
        return;
    }
    tracing::error!(error = %why, "the store lost its hold on the PostgreSQL schema's lock; every write is refused");
    *lost.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
    if exit_on_lost {
        tracing::error!(
            "exiting (status {EXIT_LOST}) so that the service starts again and takes the lock anew"
        );
        std::process::exit(EXIT_LOST);
    }
}

fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some(UNIQUE_VIOLATION))
}

async fn insert(c: &mut PgConnection, new: &NewSubmission) -> Result<(), sqlx::Error> {
    let s = &new.sub;
    sqlx::query(sql::INSERT_SUBMISSION)
        .bind(&s.id)
        .bind(s.state.as_str())
        .bind(i64::from(s.state.is_terminal()))
        .bind(s.created_at.timestamp_millis())
        .bind(new.deadline_ms)
        .bind(s.build.as_ref().map(|b| b.id.clone()))
        .bind(s.build.as_ref().map(|b| b.number as i64))
        .bind(new.idempotency.as_ref().map(|k| k.0.clone()))
        .bind(new.idempotency.as_ref().map(|k| k.1.clone()))
        .bind(encode(&new.job)?)
        .bind(encode(s)?)
        .bind(&s.queue)
        .bind(&s.user)
        .bind(s.priority.as_str())
        .bind(sql::tag_column(new.fair_tag))
        .bind(&new.cache_key)
        .bind(&s.cached_from)
        .execute(&mut *c)
        .await
        .map(drop)
}

/// A submission's end and its callback, in the caller's transaction.
async fn finish(
    tx: &mut PgConnection,
    s: &Submission,
    cb: Option<NewCallback>,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(sql::FINISH)
        .bind(&s.id)
        .bind(s.state.as_str())
        .bind(encode_ended(s)?)
        .bind(s.build.as_ref().map(|b| b.id.clone()))
        .bind(s.build.as_ref().map(|b| b.number as i64))
        .bind(sql::ran_column(s))
        .bind(s.finished_at.map(|t| t.timestamp_millis()))
        .execute(&mut *tx)
        .await?;
    let ended = done.rows_affected() == 1;
    if let (true, Some(cb)) = (ended, cb) {
        sqlx::query(sql::INSERT_CALLBACK)
            .bind(&s.id)
            .bind(&cb.url)
            .bind(cb.body.as_deref().unwrap_or(BODY_FROM_SUBMISSION))
            .bind(CallbackState::Pending.as_str())
            .bind(now_ms())
            .bind(cb.give_up_at_ms)
            .execute(&mut *tx)
            .await?;
    }
    Ok(ended)
}

/// A stored `doc` as a reader sees it: an answer from the result cache gets the result of the
/// run it names (kept once, there).
/// The submission kept under `id`, as a client is shown it.
pub(crate) async fn load(
    c: &mut PgConnection,
    id: &str,
) -> Result<Option<Submission>, sqlx::Error> {
    let doc: Option<String> = sqlx::query_scalar(sql::DOC)
        .bind(id)
        .fetch_optional(&mut *c)
        .await?;
    match doc {
        Some(doc) => shown_doc(c, &doc).await.map(Some),
        None => Ok(None),
    }
}

/// The submissions kept under `ids` (those there are), as a client is shown them.
pub(crate) async fn load_many(
    c: &mut PgConnection,
    ids: &[String],
) -> Result<Vec<Submission>, sqlx::Error> {
    let docs: Vec<String> = sqlx::query_scalar("SELECT doc FROM submissions WHERE id = ANY($1)")
        .bind(ids)
        .fetch_all(&mut *c)
        .await?;
    let mut out = Vec::with_capacity(docs.len());
    for doc in docs {
        out.push(shown_doc(c, &doc).await?);
    }
    Ok(out)
}

async fn shown_doc(c: &mut PgConnection, doc: &str) -> Result<Submission, sqlx::Error> {
    let mut sub: Submission = decode(doc)?;
    let Some(from) = needs_result_of(&sub).map(str::to_string) else {
        return Ok(sub);
    };
    let origin: Option<String> = sqlx::query_scalar(sql::DOC)
        .bind(&from)
        .fetch_optional(&mut *c)
        .await?;
    if let Some(origin) = origin {
        sub.result = decode::<Submission>(&origin)?.result;
    }
    Ok(sub)
}

async fn keyed(
    c: &mut PgConnection,
    key: &str,
    hash: &str,
) -> Result<Option<Inserted>, sqlx::Error> {
    let Some(row) = sqlx::query(sql::KEYED)
        .bind(key)
        .fetch_optional(&mut *c)
        .await?
    else {
        return Ok(None);
    };
    let earlier: Option<String> = row.try_get(0)?;
    let doc: String = row.try_get(1)?;
    Ok(Some(Inserted::Existing {
        sub: Box::new(shown_doc(c, &doc).await?),
        same_request: earlier.as_deref() == Some(hash),
    }))
}

async fn pending(c: &mut PgConnection) -> Result<Vec<Pending>, sqlx::Error> {
    let rows = sqlx::query(sql::PENDING).fetch_all(&mut *c).await?;
    rows.iter().map(sql::pending_row).collect()
}

async fn accepted(c: &mut PgConnection, since_ms: i64) -> Result<Vec<Accepted>, sqlx::Error> {
    let rows = sqlx::query(sql::ACCEPTED)
        .bind(since_ms)
        .fetch_all(&mut *c)
        .await?;
    rows.iter().map(sql::accepted_row).collect()
}

async fn runs(c: &mut PgConnection, since_ms: i64) -> Result<Vec<Ran>, sqlx::Error> {
    let rows = sqlx::query(sql::RUNS)
        .bind(since_ms)
        .bind(crate::dispatch::RECENT_RUNS as i64)
        .fetch_all(&mut *c)
        .await?;
    rows.iter().map(sql::ran_row).collect()
}

async fn due_callbacks(
    c: &mut PgConnection,
    now: i64,
    limit: i64,
) -> Result<Vec<DueCallback>, sqlx::Error> {
    let rows = sqlx::query(sql::DUE_CALLBACKS)
        .bind(CallbackState::Pending.as_str())
        .bind(now)
        .bind(limit)
        .fetch_all(&mut *c)
        .await?;
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let submission_id: String = r.try_get(0)?;
        let mut body: String = r.try_get(2)?;
        if body == BODY_FROM_SUBMISSION {
            // One row that cannot be read must not hold up every other callback.
            let doc: Option<String> = sqlx::query_scalar(sql::DOC)
                .bind(&submission_id)
                .fetch_optional(&mut *c)
                .await?;
            let built = match doc {
                Some(doc) => match shown_doc(c, &doc).await {
                    Ok(sub) => encode(&sub),
                    Err(e) => Err(e),
                },
                None => Err(sqlx::Error::RowNotFound),
            };
            match built {
                Ok(b) => body = b,
                Err(e) => {
                    tracing::error!(id = %submission_id, error = %report(&e), "cannot build a callback's body from its submission; it is left out");
                    continue;
                }
            }
        }
        out.push(DueCallback {
            submission_id,
            url: r.try_get(1)?,
            body,
            attempts: r.try_get(3)?,
            give_up_at_ms: r.try_get(4)?,
        });
    }
    Ok(out)
}

impl Durable for Postgres {
    fn insert(&self, new: NewSubmission) -> BoxFuture<'_, Result<Inserted, StoreError>> {
        Box::pin(Postgres::insert(self, new))
    }
    fn save<'a>(&'a self, sub: &'a Submission) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(Postgres::save(self, sub))
    }
    fn finish<'a>(
        &'a self,
        sub: &'a Submission,
        callback: Option<NewCallback>,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(Postgres::finish(self, sub, callback))
    }
    fn load<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Submission>, StoreError>> {
        Box::pin(Postgres::load(self, id))
    }
    fn pending(&self) -> BoxFuture<'_, Result<Vec<Pending>, StoreError>> {
        Box::pin(self.read(async |c| pending(c).await))
    }
    fn job<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Job>, StoreError>> {
        Box::pin(Postgres::job(self, id))
    }
    fn keyed<'a>(
        &'a self,
        key: &'a str,
        hash: &'a str,
    ) -> BoxFuture<'a, Result<Option<Inserted>, StoreError>> {
        Box::pin(self.read(async |c| keyed(c, key, hash).await))
    }
    fn accepted_since(&self, since_ms: i64) -> BoxFuture<'_, Result<Vec<Accepted>, StoreError>> {
        Box::pin(self.read(async move |c| accepted(c, since_ms).await))
    }
    fn cached<'a>(
        &'a self,
        q: &'a CacheQuery,
    ) -> BoxFuture<'a, Result<Option<Submission>, StoreError>> {
        Box::pin(Postgres::cached(self, q))
    }
    fn due_callbacks(
        &self,
        now_ms: i64,
        limit: i64,
    ) -> BoxFuture<'_, Result<Vec<DueCallback>, StoreError>> {
        Box::pin(Postgres::due_callbacks(self, now_ms, limit))
    }
    fn next_callback_at(&self) -> BoxFuture<'_, Result<Option<i64>, StoreError>> {
        Box::pin(Postgres::next_callback_at(self))
    }
    fn callback_attempted<'a>(
        &'a self,
        id: &'a str,
        state: CallbackState,
        attempts: i64,
        next_at_ms: i64,
        error: Option<String>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(Postgres::callback_attempted(
            self, id, state, attempts, next_at_ms, error,
        ))
    }
    fn health(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(Postgres::health(self))
    }
    fn persistent(&self) -> bool {
        true
    }
    fn fleet_load(&self) -> BoxFuture<'_, Result<Vec<String>, StoreError>> {
        Box::pin(Postgres::fleet_load(self))
    }
    fn fleet_save<'a>(
        &'a self,
        id: &'a str,
        doc: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(Postgres::fleet_save(self, id, doc))
    }
    fn fleet_forget<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(Postgres::fleet_forget(self, id))
    }
    /// Not once the lock is lost or the last beat is stale (which, in the service, ends the
    /// process).
    fn acting(&self) -> bool {
        self.held().is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_stops_acting_a_second_before_any_waiter_may_take_over() {
        assert!(SELF_FENCE_AFTER + Duration::from_secs(1) <= TAKEOVER_AFTER);
        // A holder whose beats all succeed: the next begins at most a beat and a check after
        // the last began.
        assert!(BEAT + CHECK_TIMEOUT < SELF_FENCE_AFTER);
        assert!(stale_after(SELF_FENCE_AFTER).is_none());
        let why = stale_after(SELF_FENCE_AFTER + Duration::from_millis(1)).unwrap();
        assert!(why.contains("last beat"), "{why}");
        let beat = Beat::new();
        assert!(beat.stale().is_none(), "a beat just taken");
        // `now` is read after the beat was made: the answer is of now, whichever millisecond
        // the beat was made in (an answer of now - 1 failed the next line when a millisecond
        // passed in between).
        let now = now_boot_ms();
        beat.answered(now);
        assert!(beat.age(now + 5_000) <= SELF_FENCE_AFTER);
        assert!(beat.age(now + 5_002) > SELF_FENCE_AFTER);
        // An answer to an earlier beat, arriving late, never moves it back.
        beat.answered(now.saturating_sub(10_000));
        assert!(beat.age(now) <= Duration::from_millis(1));
    }

    #[test]
    fn schema_names_that_need_no_quoting_are_the_only_ones_taken() {
        for ok in ["kernelkite", "_k", "kk_2", &"a".repeat(63)] {
            assert!(valid_schema(ok), "{ok}");
        }
        for bad in [
            "",
            "public",
            "pg_catalog",
            "information_schema",
            "2k",
            "Kernelkite",
            "kernel-kite",
            "k\"; DROP TABLE x; --",
            "k k",
            &"a".repeat(64),
        ] {
            assert!(!valid_schema(bad), "{bad}");
        }
    }

    #[test]
    fn the_shown_url_has_no_password() {
        let opts =
            PgConnectOptions::from_str("postgres://kk:s3cret@db.example:6543/app?sslmode=require")
                .unwrap();
        let s = shown(&opts);
        assert_eq!(s, "postgres://kk@db.example:6543/app");
        assert!(!s.contains("s3cret"));
    }

    #[test]
    fn tls_is_required_for_a_server_elsewhere_unless_the_url_says_otherwise() {
        let mode = |u: &str| ssl_mode(u, &PgConnectOptions::from_str(u).unwrap());
        assert!(matches!(
            mode("postgres://u:p@db.example/app"),
            PgSslMode::Require
        ));
        assert!(matches!(
            mode("postgres://u:p@127.0.0.1:5432/app"),
            PgSslMode::Prefer
        ));
        assert!(matches!(
            mode("postgres://u:p@localhost/app"),
            PgSslMode::Prefer
        ));
        assert!(matches!(
            mode("postgres://u:p@db.example/app?sslmode=disable"),
            PgSslMode::Disable
        ));
        assert!(matches!(
            mode("postgres://u:p@db.example/app?application_name=x&sslmode=verify-full"),
            PgSslMode::VerifyFull
        ));
    }

    #[test]
    fn each_schema_has_its_own_lock() {
        assert_ne!(lock_key("kernelkite"), lock_key("kernelkite_staging"));
        assert_eq!(lock_key("kernelkite"), lock_key("kernelkite"));
    }
}
