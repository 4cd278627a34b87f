//! The durable store: one SQLite database, `<KERNELKITE_DATA_DIR>/kernelkite.db` (in memory when
//! no data dir is set), reached through `sqlx`.
//!
//! Every call is a message to a task that owns a connection. The writer takes every write
//! waiting in its queue and commits them in one transaction (group commit; a lone one-statement
//! write is its own transaction), then answers each caller: a caller hears "saved" only after
//! the commit, which is what lets the core commit first and wake waiters second. In a file
//! database a reader with its own connection serves reads, so `GET` of a finished submission
//! never queues behind a commit, and checkpoints the WAL, so no commit pays for that fsync; an
//! in-memory database has one connection, so its one task does both.
//!
//! Its statements are the PostgreSQL store's too, kept portable in one place (`store/sql.rs`).
//! The schema is created by the numbered migrations in `service/migrations/`,
//! run by sqlx's migrator and recorded in `_sqlx_migrations` (a database from before then
//! also keeps its old `kernelkite_schema` table, unused).
//!
//! Durability: WAL mode with `synchronous=NORMAL` by default: a commit survives the process
//! being killed at any instant (the WAL is in the kernel's page cache); a power loss may roll
//! back the last commits. `KERNELKITE_STORE_SYNC=full` fsyncs every commit.

use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::{ConnectOptions, Row, SqliteConnection};
use tokio::sync::{mpsc, oneshot};

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

/// The database file's name inside KERNELKITE_DATA_DIR.
pub const DB_FILE: &str = "kernelkite.db";

/// Most writes committed in one transaction.
const MAX_BATCH: usize = 512;
/// How often the reader of a file database checkpoints the WAL.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(250);
/// WAL frames (4 KiB pages) past which the writer truncates the WAL itself.
const WAL_LIMIT_FRAMES: i64 = 16_384;

/// How commits reach the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SyncMode {
    /// Survives the process being killed at any instant; a power loss may lose the last
    /// commits (SQLite WAL with `synchronous=NORMAL`).
    Normal,
    /// Every commit is fsynced: survives a power loss too, at a disk flush per commit.
    Full,
}

enum Op {
    Insert(Box<NewSubmission>),
    Save(Box<Submission>),
    Finish(Box<Submission>, Option<NewCallback>),
    Callback {
        id: String,
        state: CallbackState,
        attempts: i64,
        next_at_ms: i64,
        error: Option<String>,
    },
    Probe,
    Load(String),
    Pending,
    DueCallbacks {
        now_ms: i64,
        limit: i64,
    },
    NextCallbackAt,
    Job(String),
    Accepted(i64),
    Keyed {
        key: String,
        hash: String,
    },
    Cached(CacheQuery),
    FleetSave {
        id: String,
        doc: String,
    },
    FleetForget(String),
    FleetLoad,
}

impl Op {
    /// Written by one statement (atomic without a transaction around it).
    fn is_one_statement(&self) -> bool {
        match self {
            Op::Insert(n) => n.idempotency.is_none(),
            Op::Finish(_, cb) => cb.is_none(),
            Op::Save(_)
            | Op::Callback { .. }
            | Op::Probe
            | Op::FleetSave { .. }
            | Op::FleetForget(_) => true,
            _ => false,
        }
    }

    fn is_write(&self) -> bool {
        matches!(
            self,
            Op::Insert(_)
                | Op::Save(_)
                | Op::Finish(..)
                | Op::Callback { .. }
                | Op::Probe
                | Op::FleetSave { .. }
                | Op::FleetForget(_)
        )
    }
}

enum Reply {
    Inserted(Inserted),
    Done(bool),
    Loaded(Option<Box<Submission>>),
    Pending(Vec<Pending>),
    Due(Vec<DueCallback>),
    At(Option<i64>),
    Job(Option<Box<Job>>),
    Keyed(Option<Inserted>),
    Accepted(Vec<Accepted>),
    Docs(Vec<String>),
}

struct Request {
    op: Op,
    reply: oneshot::Sender<Result<Reply, StoreError>>,
}

/// What happened to a store's file while the service ran ([`Shared::gone`]).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Broken {
    /// Deleted, replaced or overwritten: what happened.
    Gone(String),
    /// Damaged, as SQLite found it: what it said.
    Damaged(String),
}

/// What every database thread shares: the last write's outcome, whether the file is known
/// gone or damaged, and the latency metric.
struct Shared {
    /// The database file (`None`: in memory).
    path: Option<PathBuf>,
    last_write_failed: Mutex<Option<WriteFailure>>,
    /// Set for good once the file was found gone or damaged: every later write and health
    /// check fails, saying what happened (a restart on a good file is the operator's act).
    gone: Mutex<Option<Broken>>,
    metrics: Option<Arc<crate::metrics::Metrics>>,
    /// The reader's checkpoints cannot keep the WAL small (writes never pause): the writer
    /// truncates it at its next turn.
    wal_too_big: AtomicBool,
    /// A page check ([`Sqlite::check_pages`]) holds a read snapshot: a truncating checkpoint
    /// would wait for it (up to the busy timeout, every commit behind it), so it waits for
    /// the check's end instead.
    checking: AtomicBool,
}

impl Shared {
    fn observe(&self, op: &str, since: Instant) {
        if let Some(m) = &self.metrics {
            m.store_seconds
                .get_or_create(&crate::metrics::OpLabel { op: op.to_string() })
                .observe(since.elapsed().as_secs_f64());
        }
    }
}

/// The SQLite store. Cloning is cheap; the database threads end when the last clone drops.
#[derive(Clone)]
pub struct Sqlite {
    writer: mpsc::Sender<Request>,
    reader: mpsc::Sender<Request>,
    shared: Arc<Shared>,
    path: Option<PathBuf>,
    closed: Arc<AtomicBool>,
    /// The data directory's lock, held while the store is open ([`lock_dir`]).
    _lock: Option<Arc<std::fs::File>>,
    /// The database file's device and inode when opened: a file found otherwise later was
    /// deleted or replaced ([`Sqlite::check_file`]).
    identity: Option<(u64, u64)>,
}

impl std::fmt::Debug for Sqlite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sqlite").field("path", &self.path).finish()
    }
}

impl Sqlite {
    /// Opens (creating when missing) the store in `dir`, or an in-memory store when `dir` is
    /// `None`; checks it and brings its schema up to date. Blocks while it does (it runs
    /// before the service serves anything); needs a tokio runtime, whose tasks then serve it.
    pub fn open(
        dir: Option<&Path>,
        sync: SyncMode,
        metrics: Option<Arc<crate::metrics::Metrics>>,
    ) -> Result<Sqlite, StoreError> {
        Sqlite::open_with_pending(dir, sync, metrics).map(|(s, _)| s)
    }

    /// [`Sqlite::open`], also returning the submissions that had not ended (read before
    /// anything else can write).
    pub fn open_with_pending(
        dir: Option<&Path>,
        sync: SyncMode,
        metrics: Option<Arc<crate::metrics::Metrics>>,
    ) -> Result<(Sqlite, Reopened), StoreError> {
        let shared = Arc::new(Shared {
            path: dir.map(|d| d.join(DB_FILE)),
            last_write_failed: Mutex::new(None),
            gone: Mutex::new(None),
            metrics,
            wal_too_big: AtomicBool::new(false),
            checking: AtomicBool::new(false),
        });
        let mut lock = None;
        let (opts, path) = match dir {
            Some(dir) => {
                let path = dir.join(DB_FILE);
                prepare_files(dir, &path).map_err(|e| StoreError::Open {
                    path: path.clone(),
                    cause: report(&e),
                })?;
                lock = Some(hold_dir(dir)?);
                let opts = SqliteConnectOptions::new()
                    .filename(&path)
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal)
                    .synchronous(match sync {
                        SyncMode::Normal => SqliteSynchronous::Normal,
                        SyncMode::Full => SqliteSynchronous::Full,
                    })
                    .busy_timeout(Duration::from_secs(10));
                (opts, Some(path))
            }
            None => {
                let opts = SqliteConnectOptions::from_str("sqlite::memory:").map_err(|e| {
                    StoreError::Open {
                        path: PathBuf::from(":memory:"),
                        cause: report(&e),
                    }
                })?;
                (opts, None)
            }
        };
        let opts = opts.disable_statement_logging();
        let shown = path.clone().unwrap_or_else(|| PathBuf::from(":memory:"));
        let (wconn, rconn, reopened) = open_connections(opts, shown, path.is_some())?;
        // The connections serve from tasks of the caller's runtime: one hop less per call
        // than a thread of their own.
        let (writer, wrx) = mpsc::channel(4096);
        tokio::spawn(serve(wconn, wrx, true, shared.clone()));
        // A file database gets a reader of its own; an in-memory one exists only in its one
        // connection, so its reads go to the writer.
        let reader = match rconn {
            Some(conn) => {
                let (reader, rrx) = mpsc::channel(4096);
                tokio::spawn(serve(conn, rrx, false, shared.clone()));
                reader
            }
            None => writer.clone(),
        };
        Ok((
            Sqlite {
                writer,
                reader,
                shared,
                identity: path.as_deref().and_then(file_identity),
                path,
                closed: Arc::new(AtomicBool::new(false)),
                _lock: lock,
            },
            reopened,
        ))
    }

    /// The database file (`None`: in memory).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Whether the database file is still the one opened: there, the same inode, and (with
    /// `contents`, as the health check asks) still a SQLite file. Once it is not, the store
    /// stays gone (a restart is the operator's act).
    fn check_file(&self, contents: bool) -> Result<(), StoreError> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let gone = |what: String| StoreError::Gone {
            path: path.clone(),
            what,
        };
        let mut held = self.shared.gone.lock().unwrap_or_else(|p| p.into_inner());
        match held.as_ref() {
            Some(Broken::Gone(what)) => return Err(gone(what.clone())),
            Some(Broken::Damaged(detail)) => {
                return Err(StoreError::Damaged {
                    path: path.clone(),
                    detail: detail.clone(),
                })
            }
            None => {}
        }
        let what = match (file_identity(path), self.identity) {
            (None, _) => Some("was deleted or moved".to_string()),
            (Some(now), Some(then)) if now != then => Some("was replaced by another file".into()),
            _ if contents && !sqlite_header(path) => {
                Some("was overwritten (it is no longer a SQLite database)".into())
            }
            _ => None,
        };
        match what {
            Some(what) => {
                tracing::error!(path = %path.display(), "the store {what}; refusing every write until the service is restarted on a good file");
                *held = Some(Broken::Gone(what.clone()));
                Err(gone(what))
            }
            None => Ok(()),
        }
    }

    async fn call(&self, op: Op) -> Result<Reply, StoreError> {
        // A write into a deleted file is acknowledged and then lost: every write (and the
        // health probe) first checks the file is still the store's.
        if op.is_write() {
            self.check_file(false)?;
        }
        let to = if op.is_write() {
            &self.writer
        } else {
            &self.reader
        };
        let (reply, rx) = oneshot::channel();
        if to.send(Request { op, reply }).await.is_err() {
            self.closed.store(true, Ordering::Relaxed);
            return Err(StoreError::Closed);
        }
        rx.await.map_err(|_| StoreError::Closed)?
    }

    /// Writes a new submission (before its build is created). With an idempotency key that
    /// was used before, writes nothing and returns the submission it made.
    pub async fn insert(&self, new: NewSubmission) -> Result<Inserted, StoreError> {
        match self.call(Op::Insert(Box::new(new))).await? {
            Reply::Inserted(i) => Ok(i),
            _ => Err(StoreError::Closed),
        }
    }

    /// Saves a change of a submission that has not ended.
    pub async fn save(&self, sub: &Submission) -> Result<(), StoreError> {
        self.call(Op::Save(Box::new(sub.clone()))).await.map(|_| ())
    }

    /// Saves a submission's end and, in the same transaction, its callback. Returns false
    /// when the store already had it ended (nothing is written).
    pub async fn finish(
        &self,
        sub: &Submission,
        callback: Option<NewCallback>,
    ) -> Result<bool, StoreError> {
        match self
            .call(Op::Finish(Box::new(sub.clone()), callback))
            .await?
        {
            Reply::Done(b) => Ok(b),
            _ => Err(StoreError::Closed),
        }
    }

    /// When the next pending callback is due (unix ms), if any is pending.
    pub async fn next_callback_at(&self) -> Result<Option<i64>, StoreError> {
        match self.call(Op::NextCallbackAt).await? {
            Reply::At(t) => Ok(t),
            _ => Err(StoreError::Closed),
        }
    }

    /// Records a callback attempt's outcome.
    pub async fn callback_attempted(
        &self,
        id: &str,
        state: CallbackState,
        attempts: i64,
        next_at_ms: i64,
        error: Option<String>,
    ) -> Result<(), StoreError> {
        self.call(Op::Callback {
            id: id.to_string(),
            state,
            attempts,
            next_at_ms,
            error,
        })
        .await
        .map(|_| ())
    }

    /// The submission kept under `id`.
    pub async fn load(&self, id: &str) -> Result<Option<Submission>, StoreError> {
        match self.call(Op::Load(id.to_string())).await? {
            Reply::Loaded(s) => Ok(s.map(|b| *b)),
            _ => Err(StoreError::Closed),
        }
    }

    /// Every submission that has not ended, with its job and deadline.
    pub async fn pending(&self) -> Result<Vec<Pending>, StoreError> {
        match self.call(Op::Pending).await? {
            Reply::Pending(p) => Ok(p),
            _ => Err(StoreError::Closed),
        }
    }

    /// The job of a submission that has not ended.
    pub async fn job(&self, id: &str) -> Result<Option<Job>, StoreError> {
        match self.call(Op::Job(id.to_string())).await? {
            Reply::Job(j) => Ok(j.map(|b| *b)),
            _ => Err(StoreError::Closed),
        }
    }

    /// What the idempotency key `key` made, if it was used: as [`Sqlite::insert`] answers it
    /// (`hash`: the SHA-256 of the request now).
    pub async fn keyed(&self, key: &str, hash: &str) -> Result<Option<Inserted>, StoreError> {
        match self
            .call(Op::Keyed {
                key: key.to_string(),
                hash: hash.to_string(),
            })
            .await?
        {
            Reply::Keyed(k) => Ok(k),
            _ => Err(StoreError::Closed),
        }
    }

    /// The submissions queued since `since_ms` (cache answers left out), for the quotas.
    pub async fn accepted_since(&self, since_ms: i64) -> Result<Vec<Accepted>, StoreError> {
        match self.call(Op::Accepted(since_ms)).await? {
            Reply::Accepted(a) => Ok(a),
            _ => Err(StoreError::Closed),
        }
    }

    /// The newest submission that succeeded under `key`, accepted since `since_ms`.
    pub async fn cached(&self, q: &CacheQuery) -> Result<Option<Submission>, StoreError> {
        match self.call(Op::Cached(q.clone())).await? {
            Reply::Loaded(s) => Ok(s.map(|b| *b)),
            _ => Err(StoreError::Closed),
        }
    }

    /// Callbacks due at `now_ms`, oldest first, at most `limit`.
    pub async fn due_callbacks(
        &self,
        now_ms: i64,
        limit: i64,
    ) -> Result<Vec<DueCallback>, StoreError> {
        match self.call(Op::DueCallbacks { now_ms, limit }).await? {
            Reply::Due(d) => Ok(d),
            _ => Err(StoreError::Closed),
        }
    }

    /// Reachable and writable: a probe write commits, and the last write before it did not
    /// fail. A store whose last write failed stays unhealthy until a write succeeds again;
    /// when that write failed for want of space and the disk has room again, the probe is
    /// that write (nothing else may write on an idle service, and it must not stay
    /// unhealthy, and be restarted, only because nobody submitted since).
    pub async fn health(&self) -> Result<(), StoreError> {
        // A full disk can still take writes that fit in pages the files already hold (a
        // probe, a state change), while a new submission needs new pages: the free space is
        // what says whether the store can take work.
        if let Some(dir) = self.path().and_then(Path::parent) {
            if let Ok(fs) = rustix::fs::statvfs(dir) {
                let free = fs.f_bavail.saturating_mul(fs.f_frsize);
                if free < MIN_FREE_BYTES {
                    return Err(StoreError::Write(format!(
                        "{free} bytes free on the disk of {} (fewer than {MIN_FREE_BYTES})",
                        dir.display()
                    )));
                }
            }
        }
        self.check_file(true)?;
        // Any other failure (an I/O error, a corrupted table) is not cured by a probe of
        // one row that happens to commit.
        if let Some(f) = self.last_failure().filter(|f| !f.disk_full) {
            return Err(StoreError::Write(f.why));
        }
        self.call(Op::Probe).await.map(|_| ())
    }

    /// Why the last write failed, while the store has not written successfully since.
    pub fn last_write_error(&self) -> Option<String> {
        self.last_failure().map(|f| f.why)
    }

    fn last_failure(&self) -> Option<WriteFailure> {
        self.shared
            .last_write_failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Checks the file's pages as they are on disk (SQLite's `PRAGMA quick_check`, on a
    /// connection of its own, whose empty page cache reads every page the file has): a file
    /// damaged under the service (its header intact, garbage past it) is found here, where the
    /// service's own connections, reading their cached pages, would go on acknowledging writes
    /// into it. It checks the file's structure (pages, b-trees, the free list), not the bytes
    /// of a record whose structure stays sound (SQLite keeps no checksums of those). Once
    /// damaged, the store takes no more writes and its health check fails for good, saying what
    /// SQLite found. An in-memory store has nothing to check.
    pub async fn check_pages(&self) -> Result<(), StoreError> {
        check_pages(&self.shared).await;
        self.check_file(false)
    }

    /// Runs [`Sqlite::check_pages`] every `every`, until the store is closed or found damaged.
    /// Its cost is a read of the whole file (about 0.4 ms per MiB here; docs/BENCHMARKS.md).
    pub fn watch_pages(&self, every: Duration) {
        if self.path.is_none() {
            return;
        }
        let shared = Arc::downgrade(&self.shared);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(shared) = shared.upgrade() else {
                    return;
                };
                if shared
                    .gone
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .is_some()
                {
                    return;
                }
                check_pages(&shared).await;
            }
        });
    }
}

/// [`Sqlite::check_pages`]: a fresh read-only connection's `quick_check`; a verdict other than
/// `ok` (or SQLite refusing the file as damaged) marks the store damaged.
async fn check_pages(shared: &Shared) {
    let Some(path) = shared.path.clone() else {
        return;
    };
    let t = Instant::now();
    shared.checking.store(true, Ordering::Release);
    let verdict = async {
        let mut conn = SqliteConnectOptions::new()
            .filename(&path)
            .read_only(true)
            .busy_timeout(Duration::from_secs(10))
            .disable_statement_logging()
            .connect()
            .await?;
        let rows = sqlx::query("PRAGMA quick_check")
            .fetch_all(&mut conn)
            .await?;
        let _ = sqlx::Connection::close(conn).await;
        Ok::<Vec<String>, sqlx::Error>(
            rows.iter()
                .filter_map(|r| r.try_get::<String, _>(0).ok())
                .collect(),
        )
    }
    .await;
    shared.checking.store(false, Ordering::Release);
    shared.observe("quick_check", t);
    match verdict {
        Ok(v) if v == ["ok"] => {}
        Ok(v) => mark_damaged(shared, &v.join("; ")),
        Err(e) if is_corrupt(&e) => mark_damaged(shared, &report(&e)),
        Err(e) => tracing::warn!(error = %report(&e), "could not check the store's pages"),
    }
}

/// Whether SQLite says the bytes are not a sound database: SQLITE_CORRUPT (11) or
/// SQLITE_NOTADB (26), extended codes included.
fn is_corrupt(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|c| c.parse::<i64>().ok())
            .is_some_and(|c| matches!(c & 0xff, 11 | 26)),
        _ => false,
    }
}

/// Records for good that the file is damaged (`detail`: what SQLite said), once.
fn mark_damaged(shared: &Shared, detail: &str) {
    let mut gone = shared.gone.lock().unwrap_or_else(|p| p.into_inner());
    if gone.is_some() {
        return;
    }
    let detail: String = detail.chars().take(500).collect();
    let path = shared.path.as_deref().unwrap_or(Path::new(":memory:"));
    tracing::error!(path = %path.display(), %detail, "the store is damaged; refusing every write until the service is restarted: a restart checks the file again, and a damaged one is refused with what to do (restore the last backup: service/README.md, \"The store\")");
    *gone = Some(Broken::Damaged(detail));
}

/// The file's device and inode, when it exists.
fn file_identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Whether the file starts with SQLite's header (`SQLite format 3\0`); an empty file (a store
/// not yet written) counts as one.
fn sqlite_header(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 16];
    match std::fs::File::open(path).and_then(|mut f| f.read(&mut head)) {
        Ok(0) => true,
        Ok(n) => n == 16 && &head == b"SQLite format 3\0",
        Err(_) => false,
    }
}

/// The data directory's lock file: who holds it, for the next process's error.
pub const LOCK_FILE: &str = "kernelkite-service.lock";

/// The data directories this process holds: a second store of this process on one of them
/// (a restart in a test, an inspection) shares the lock; another process is refused. One the
/// process is letting go of meanwhile (its last holder closing it) is taken anew, once free
/// ([`lock_dir`] waits for a lock the file says is this process's own).
fn hold_dir(dir: &Path) -> Result<Arc<std::fs::File>, StoreError> {
    static HELD: std::sync::Mutex<Vec<(PathBuf, std::sync::Weak<std::fs::File>)>> =
        std::sync::Mutex::new(Vec::new());
    let key = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let mut held = HELD.lock().unwrap_or_else(|p| p.into_inner());
    held.retain(|(_, f)| f.strong_count() > 0);
    if let Some(file) = held
        .iter()
        .find(|(d, _)| *d == key)
        .and_then(|(_, f)| f.upgrade())
    {
        return Ok(file);
    }
    let file = Arc::new(lock_dir(dir)?);
    held.push((key, Arc::downgrade(&file)));
    Ok(file)
}

/// How long a lock this process itself is letting go of may take to be free ([`lock_dir`]).
const OWN_LOCK_WAIT: Duration = Duration::from_secs(5);

/// Who holds a lock: this process as its lock file names it (`pid N on HOST, since T`).
fn holder_name() -> String {
    format!(
        "pid {} on {}",
        std::process::id(),
        kernelkite_sys::host::name()
    )
}

/// Takes the data directory's exclusive lock (`flock` on [`LOCK_FILE`], which the kernel drops
/// when the process ends, however it ends) and writes who holds it; `Locked`, naming the
/// holder, when another process has it.
///
/// A lock the file says is this process's own is waited for (up to [`OWN_LOCK_WAIT`]): it is
/// being let go (a store of this process closing while another opens, as a restart in a test
/// does), but a child this process is forking elsewhere holds a copy of the descriptor until
/// it execs, and the lock with it. Refused at once, that restart failed in CI.
fn lock_dir(dir: &Path) -> Result<std::fs::File, StoreError> {
    use std::io::{Read, Seek, Write};
    let path = dir.join(LOCK_FILE);
    let open_err = |e: std::io::Error| StoreError::Open {
        path: path.clone(),
        cause: report(&e),
    };
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(open_err)?;
    let me = holder_name();
    let start = Instant::now();
    while let Err(e) =
        rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
    {
        if e != rustix::io::Errno::WOULDBLOCK {
            return Err(open_err(e.into()));
        }
        let mut holder = String::new();
        let _ = file
            .rewind()
            .and_then(|()| file.read_to_string(&mut holder));
        let holder = holder.trim();
        let own = holder.starts_with(&format!("{me},"));
        if own && start.elapsed() < OWN_LOCK_WAIT {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        return Err(StoreError::Locked {
            dir: dir.to_path_buf(),
            holder: if holder.is_empty() {
                "it did not say who it is".into()
            } else {
                holder.to_string()
            },
        });
    }
    let me = format!(
        "{me}, since {}",
        chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    );
    file.set_len(0).map_err(open_err)?;
    file.rewind().map_err(open_err)?;
    file.write_all(me.as_bytes()).map_err(open_err)?;
    Ok(file)
}

/// Creates the data dir (0700) and the database file (0600) when missing, and narrows the
/// modes of existing files: SQLite gives its -wal and -shm files the database file's mode.
fn prepare_files(dir: &Path, path: &Path) -> std::io::Result<()> {
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)?;
    for suffix in ["", "-wal", "-shm"] {
        let f = PathBuf::from(format!("{}{suffix}", path.display()));
        if let Ok(meta) = std::fs::metadata(&f) {
            if meta.permissions().mode() & 0o077 != 0 {
                std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600))?;
            }
        }
    }
    Ok(())
}

/// Opens the connections (the writer's first: it checks the file and migrates), and reads
/// the submissions that had not ended, on a helper thread: connecting needs no runtime, so
/// this works in or out of one, and blocks only the caller.
fn open_connections(
    opts: SqliteConnectOptions,
    path: PathBuf,
    reader: bool,
) -> Result<(SqliteConnection, Option<SqliteConnection>, Reopened), StoreError> {
    let open_err = |path: &Path, cause: String| StoreError::Open {
        path: path.to_path_buf(),
        cause,
    };
    let thread_path = path.clone();
    let handle = std::thread::Builder::new()
        .name("kernelkite-db-open".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| open_err(&thread_path, e.to_string()))?;
            rt.block_on(async move {
                let mut w = connect(&opts, &thread_path, true).await?;
                let pending = reopened(&mut w)
                    .await
                    .map_err(|e| StoreError::Read(report(&e)))?;
                let r = if reader {
                    Some(connect(&opts, &thread_path, false).await?)
                } else {
                    None
                };
                Ok((w, r, pending))
            })
        })
        .map_err(|e| open_err(&path, e.to_string()))?;
    handle
        .join()
        .map_err(|_| open_err(&path, "the opening thread panicked".into()))?
}

/// What a start reads before anything can write: the submissions that had not ended, those
/// queued in the quotas' last hour (so a restart cannot reset a user's hourly count), and each
/// queue's last runs (so its estimates survive a restart).
async fn reopened(conn: &mut SqliteConnection) -> Result<Reopened, sqlx::Error> {
    let now = now_ms();
    Ok(Reopened {
        pending: pending(conn).await?,
        accepted: accepted(conn, now.saturating_sub(crate::dispatch::HOUR_MS)).await?,
        runs: runs(conn, now.saturating_sub(RUNS_WINDOW_MS)).await?,
    })
}

/// Connects; the writer also checks the file and migrates the schema.
async fn connect(
    opts: &SqliteConnectOptions,
    path: &Path,
    writer: bool,
) -> Result<SqliteConnection, StoreError> {
    let classify = |e: sqlx::Error| classify_open(path, e);
    let mut conn = opts.connect().await.map_err(classify)?;
    sqlx::query("PRAGMA cache_size = -8192")
        .execute(&mut conn)
        .await
        .map_err(classify)?;
    if writer && path != Path::new(":memory:") {
        // Checkpoints (which fsync the database file) are the reader's job, off the commit
        // path; see `serve`.
        sqlx::query("PRAGMA wal_autocheckpoint = 0")
            .execute(&mut conn)
            .await
            .map_err(classify)?;
    }
    if writer {
        // A damaged file is refused before anything is written to it.
        let rows = sqlx::query("PRAGMA quick_check")
            .fetch_all(&mut conn)
            .await
            .map_err(classify)?;
        let verdict: Vec<String> = rows
            .iter()
            .filter_map(|r| r.try_get::<String, _>(0).ok())
            .collect();
        if verdict != ["ok"] {
            return Err(StoreError::Corrupt {
                path: path.to_path_buf(),
                detail: verdict.join("; ").chars().take(500).collect(),
            });
        }
        migrate(&mut conn).await.map_err(classify)?;
    }
    Ok(conn)
}

fn classify_open(path: &Path, e: sqlx::Error) -> StoreError {
    let text = report(&e);
    // SQLITE_NOTADB (26) and SQLITE_CORRUPT (11): the bytes are not a sound database.
    let corrupt = match &e {
        sqlx::Error::Database(d) => matches!(d.code().as_deref(), Some("26" | "11")),
        _ => false,
    } || text.contains("not a database")
        || text.contains("malformed");
    if corrupt {
        StoreError::Corrupt {
            path: path.to_path_buf(),
            detail: text,
        }
    } else {
        StoreError::Open {
            path: path.to_path_buf(),
            cause: text,
        }
    }
}

/// The schema: the files of `service/migrations/`, embedded at build time, applied in order
/// by sqlx's migrator (each in a transaction, once) and recorded in `_sqlx_migrations`.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

async fn migrate(conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    // A database a later release migrated further opens too (every migration only adds,
    // so this release's statements still work on it): what makes a rollback possible.
    let mut migrator = sqlx::migrate::Migrator {
        migrations: MIGRATOR.migrations.clone(),
        ..sqlx::migrate::Migrator::DEFAULT
    };
    migrator.set_ignore_missing(true);
    migrator
        .run(&mut *conn)
        .await
        .map_err(|e| sqlx::Error::Migrate(Box::new(e)))
}

// Transactions are begun and ended by hand, not with sqlx's `Transaction`: sqlx counts the
// nesting itself and loses count when SQLite rolls a transaction back on its own (it may,
// on SQLITE_FULL and I/O errors). Its ROLLBACK then fails, it believes a transaction is still
// open, the next `begin` becomes a SAVEPOINT, and after one more failed write a transaction
// stays open that every later write joins and nothing commits: each acknowledged, all lost
// (seen on a full disk; `every_write_acknowledged_on_a_filling_disk_is_kept`).

/// Runs `body` in a transaction begun and ended by hand: committed when everything in it
/// succeeded, rolled back when anything (the BEGIN included) failed.
async fn transaction<T>(
    conn: &mut SqliteConnection,
    body: impl AsyncFnOnce(&mut SqliteConnection) -> Result<T, sqlx::Error>,
) -> Result<T, sqlx::Error> {
    let done = async {
        begin(&mut *conn).await?;
        let out = body(&mut *conn).await?;
        commit(&mut *conn).await?;
        Ok(out)
    }
    .await;
    if done.is_err() {
        rollback(conn).await;
    }
    done
}

async fn begin(conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    sqlx::query("BEGIN").execute(&mut *conn).await.map(drop)
}

async fn commit(conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    sqlx::query("COMMIT").execute(&mut *conn).await.map(drop)
}

/// Ends a failed transaction. When SQLite has already rolled it back, ROLLBACK answers that
/// no transaction is active: that is the state wanted.
async fn rollback(conn: &mut SqliteConnection) {
    if let Err(e) = sqlx::query("ROLLBACK").execute(&mut *conn).await {
        tracing::debug!(error = %report(&e), "ROLLBACK after a failed transaction");
    }
}

async fn serve(
    mut conn: SqliteConnection,
    mut rx: mpsc::Receiver<Request>,
    writer: bool,
    shared: Arc<Shared>,
) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut checkpoints = tokio::time::interval(CHECKPOINT_EVERY);
    checkpoints.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let first = tokio::select! {
            r = rx.recv() => match r {
                Some(r) => r,
                None => break,
            },
            // The reader copies the WAL into the database file now and then (a passive
            // checkpoint never blocks the writer), so no commit pays for it.
            _ = checkpoints.tick(), if !writer => {
                checkpoint(&mut conn, &shared).await;
                continue;
            }
        };
        if writer
            && !shared.checking.load(Ordering::Acquire)
            && shared.wal_too_big.swap(false, Ordering::AcqRel)
        {
            let t = Instant::now();
            if let Err(e) = sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
                .execute(&mut conn)
                .await
            {
                tracing::warn!(error = %report(&e), "could not truncate the WAL");
            }
            shared.observe("truncate", t);
        }
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        let (writes, reads): (Vec<Request>, Vec<Request>) =
            batch.drain(..).partition(|r| r.op.is_write());
        if writer && !writes.is_empty() {
            commit_batch(&mut conn, writes, &shared).await;
        }
        for r in reads {
            let t = Instant::now();
            let out = read(&mut conn, r.op).await.map_err(|e| {
                if is_corrupt(&e) {
                    mark_damaged(&shared, &report(&e));
                }
                StoreError::Read(report(&e))
            });
            shared.observe("read", t);
            let _ = r.reply.send(out);
        }
    }
}

/// A passive checkpoint; a WAL that keeps growing (it only restarts when a checkpoint
/// catches up with the writer) is handed to the writer to truncate.
async fn checkpoint(conn: &mut SqliteConnection, shared: &Shared) {
    let t = Instant::now();
    match sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
        .fetch_optional(&mut *conn)
        .await
    {
        Ok(Some(row)) => {
            let frames: i64 = row.try_get(1).unwrap_or(0);
            if frames > WAL_LIMIT_FRAMES {
                shared.wal_too_big.store(true, Ordering::Release);
            }
        }
        Ok(None) => {}
        Err(e) => tracing::warn!(error = %report(&e), "WAL checkpoint failed"),
    }
    shared.observe("checkpoint", t);
}

/// Commits `writes` in one transaction and answers each after the commit. When the batch
/// fails, each write is tried alone, so one bad write cannot sink the others.
async fn commit_batch(conn: &mut SqliteConnection, writes: Vec<Request>, shared: &Shared) {
    let t = Instant::now();
    if writes.len() == 1 && writes[0].op.is_one_statement() {
        // One statement is its own transaction: no BEGIN and COMMIT round trips.
        let r = writes.into_iter().next();
        if let Some(r) = r {
            match write(conn, &r.op).await {
                Ok(reply) => {
                    shared.observe("commit", t);
                    set_failed(shared, None);
                    let _ = r.reply.send(Ok(reply));
                }
                Err(e) => {
                    let why = record_failure(shared, &e);
                    let _ = r.reply.send(Err(StoreError::Write(why)));
                }
            }
        }
        return;
    }
    let together = transaction(conn, async |c| {
        let mut out = Vec::with_capacity(writes.len());
        for r in &writes {
            out.push(write(c, &r.op).await?);
        }
        Ok(out)
    })
    .await;
    match together {
        Ok(replies) => {
            shared.observe("commit", t);
            set_failed(shared, None);
            for (r, reply) in writes.into_iter().zip(replies) {
                let _ = r.reply.send(Ok(reply));
            }
        }
        Err(e) if writes.len() == 1 => {
            let why = record_failure(shared, &e);
            for r in writes {
                let _ = r.reply.send(Err(StoreError::Write(why.clone())));
            }
        }
        Err(_) => {
            for r in writes {
                match transaction(conn, async |c| write(c, &r.op).await).await {
                    Ok(reply) => {
                        set_failed(shared, None);
                        let _ = r.reply.send(Ok(reply));
                    }
                    Err(e) => {
                        let why = record_failure(shared, &e);
                        let _ = r.reply.send(Err(StoreError::Write(why)));
                    }
                }
            }
        }
    }
}

/// Below this much free space on the data dir's disk the store reports itself unhealthy.
const MIN_FREE_BYTES: u64 = 1 << 20;

/// A write that failed, and whether for want of space (`SQLITE_FULL`, or the disk's
/// `ENOSPC` as an I/O error).
#[derive(Debug, Clone)]
struct WriteFailure {
    why: String,
    disk_full: bool,
}

impl WriteFailure {
    fn of(e: &sqlx::Error) -> WriteFailure {
        WriteFailure {
            why: report(e),
            disk_full: is_disk_full(e),
        }
    }
}

fn is_disk_full(e: &sqlx::Error) -> bool {
    const SQLITE_FULL: i64 = 13;
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|c| c.parse::<i64>().ok())
            .is_some_and(|c| c & 0xff == SQLITE_FULL),
        sqlx::Error::Io(io) => io.raw_os_error() == Some(rustix::io::Errno::NOSPC.raw_os_error()),
        _ => false,
    }
}

/// Logs a failed write and keeps it for [`Sqlite::health`]; returns why, for the callers.
fn record_failure(shared: &Shared, e: &sqlx::Error) -> String {
    if is_corrupt(e) {
        mark_damaged(shared, &report(e));
    }
    let failure = WriteFailure::of(e);
    tracing::error!(error = %failure.why, "the store could not commit");
    let why = failure.why.clone();
    set_failed(shared, Some(failure));
    why
}

fn set_failed(shared: &Shared, failure: Option<WriteFailure>) {
    *shared
        .last_write_failed
        .lock()
        .unwrap_or_else(|p| p.into_inner()) = failure;
}

/// A submission as a reader sees it: an answer from the result cache gets the result of the
/// run it names (kept once, there).
async fn with_result(
    conn: &mut SqliteConnection,
    mut sub: Submission,
) -> Result<Submission, sqlx::Error> {
    let Some(from) = needs_result_of(&sub) else {
        return Ok(sub);
    };
    let doc: Option<String> = sqlx::query_scalar(sql::DOC)
        .bind(from)
        .fetch_optional(&mut *conn)
        .await?;
    if let Some(doc) = doc {
        let origin: Submission = decode(&doc)?;
        sub.result = origin.result;
    }
    Ok(sub)
}

/// The body of a callback kept as [`BODY_FROM_SUBMISSION`]: the ended submission's JSON, with
/// the result it refers to; the same bytes on every attempt (an ended submission does not
/// change).
async fn callback_body(conn: &mut SqliteConnection, id: &str) -> Result<String, sqlx::Error> {
    let doc: String = sqlx::query_scalar(sql::DOC)
        .bind(id)
        .fetch_one(&mut *conn)
        .await?;
    encode(&with_result(conn, decode(&doc)?).await?)
}

// Over 80 lines: one match arm per write operation, each a few SQL statements side by side.
async fn write(conn: &mut SqliteConnection, op: &Op) -> Result<Reply, sqlx::Error> {
    match op {
        Op::Insert(new) => {
            if let Some((key, hash)) = &new.idempotency {
                if let Some(existing) = keyed(conn, key, hash).await? {
                    return Ok(Reply::Inserted(existing));
                }
            }
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
                .execute(&mut *conn)
                .await?;
            Ok(Reply::Inserted(Inserted::Created))
        }
        Op::Save(s) => {
            let done = sqlx::query(sql::SAVE)
                .bind(&s.id)
                .bind(s.state.as_str())
                .bind(encode_kept(s)?)
                .bind(s.build.as_ref().map(|b| b.id.clone()))
                .bind(s.build.as_ref().map(|b| b.number as i64))
                .execute(&mut *conn)
                .await?;
            Ok(Reply::Done(done.rows_affected() == 1))
        }
        Op::Finish(s, callback) => {
            let done = sqlx::query(sql::FINISH)
                .bind(&s.id)
                .bind(s.state.as_str())
                .bind(encode_ended(s)?)
                .bind(s.build.as_ref().map(|b| b.id.clone()))
                .bind(s.build.as_ref().map(|b| b.number as i64))
                .bind(sql::ran_column(s))
                .bind(s.finished_at.map(|t| t.timestamp_millis()))
                .execute(&mut *conn)
                .await?;
            let ended = done.rows_affected() == 1;
            if let (true, Some(cb)) = (ended, callback) {
                sqlx::query(sql::INSERT_CALLBACK)
                    .bind(&s.id)
                    .bind(&cb.url)
                    .bind(cb.body.as_deref().unwrap_or(BODY_FROM_SUBMISSION))
                    .bind(CallbackState::Pending.as_str())
                    .bind(now_ms())
                    .bind(cb.give_up_at_ms)
                    .execute(&mut *conn)
                    .await?;
            }
            Ok(Reply::Done(ended))
        }
        Op::Callback {
            id,
            state,
            attempts,
            next_at_ms,
            error,
        } => {
            sqlx::query(sql::CALLBACK_ATTEMPTED)
                .bind(id)
                .bind(state.as_str())
                .bind(attempts)
                .bind(next_at_ms)
                .bind(error)
                .execute(&mut *conn)
                .await?;
            Ok(Reply::Done(true))
        }
        Op::Probe => {
            sqlx::query(sql::PROBE)
                .bind(now_ms())
                .execute(&mut *conn)
                .await?;
            Ok(Reply::Done(true))
        }
        Op::FleetSave { id, doc } => {
            sqlx::query(sql::FLEET_SAVE)
                .bind(id)
                .bind(doc)
                .bind(now_ms())
                .execute(&mut *conn)
                .await?;
            Ok(Reply::Done(true))
        }
        Op::FleetForget(id) => {
            sqlx::query(sql::FLEET_FORGET)
                .bind(id)
                .execute(&mut *conn)
                .await?;
            Ok(Reply::Done(true))
        }
        Op::FleetLoad
        | Op::Load(_)
        | Op::Pending
        | Op::DueCallbacks { .. }
        | Op::NextCallbackAt
        | Op::Job(_)
        | Op::Accepted(_)
        | Op::Keyed { .. }
        | Op::Cached(_) => Ok(Reply::Done(false)),
    }
}

/// Every submission that had not ended, oldest first.
async fn pending(conn: &mut SqliteConnection) -> Result<Vec<Pending>, sqlx::Error> {
    let rows = sqlx::query(sql::PENDING).fetch_all(&mut *conn).await?;
    rows.iter().map(sql::pending_row).collect()
}

/// The submissions accepted since `since_ms`, queued or answered from the result cache, for
/// the quotas.
async fn accepted(
    conn: &mut SqliteConnection,
    since_ms: i64,
) -> Result<Vec<Accepted>, sqlx::Error> {
    let rows = sqlx::query(sql::ACCEPTED)
        .bind(since_ms)
        .fetch_all(&mut *conn)
        .await?;
    rows.iter().map(sql::accepted_row).collect()
}

/// Per queue its last [`RECENT_RUNS`](crate::dispatch::RECENT_RUNS) runs to end, of the
/// submissions accepted since `since_ms`, earliest end first.
async fn runs(conn: &mut SqliteConnection, since_ms: i64) -> Result<Vec<Ran>, sqlx::Error> {
    let rows = sqlx::query(sql::RUNS)
        .bind(since_ms)
        .bind(crate::dispatch::RECENT_RUNS as i64)
        .fetch_all(&mut *conn)
        .await?;
    rows.iter().map(sql::ran_row).collect()
}

/// A submission read as its `doc` (the row's first column), if there was a row.
async fn loaded(
    conn: &mut SqliteConnection,
    row: Option<sqlx::sqlite::SqliteRow>,
) -> Result<Reply, sqlx::Error> {
    let Some(row) = row else {
        return Ok(Reply::Loaded(None));
    };
    let sub = with_result(conn, decode(&row.try_get::<String, _>(0)?)?).await?;
    Ok(Reply::Loaded(Some(Box::new(sub))))
}

/// What idempotency key `key` made, if it was used: the submission, and whether it came with
/// the same request (`hash`).
async fn keyed(
    conn: &mut SqliteConnection,
    key: &str,
    hash: &str,
) -> Result<Option<Inserted>, sqlx::Error> {
    let row = sqlx::query(sql::KEYED)
        .bind(key)
        .fetch_optional(&mut *conn)
        .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let earlier: Option<String> = row.try_get(0)?;
    let doc: String = row.try_get(1)?;
    Ok(Some(Inserted::Existing {
        sub: Box::new(with_result(conn, decode(&doc)?).await?),
        same_request: earlier.as_deref() == Some(hash),
    }))
}

async fn read(conn: &mut SqliteConnection, op: Op) -> Result<Reply, sqlx::Error> {
    match op {
        Op::Load(id) => {
            let row = sqlx::query(sql::DOC)
                .bind(&id)
                .fetch_optional(&mut *conn)
                .await?;
            loaded(conn, row).await
        }
        Op::Pending => Ok(Reply::Pending(pending(conn).await?)),
        Op::DueCallbacks { now_ms, limit } => {
            let rows = sqlx::query(sql::DUE_CALLBACKS)
                .bind(CallbackState::Pending.as_str())
                .bind(now_ms)
                .bind(limit)
                .fetch_all(&mut *conn)
                .await?;
            let mut out = Vec::with_capacity(rows.len());
            for r in rows {
                let submission_id: String = r.try_get(0)?;
                let mut body: String = r.try_get(2)?;
                if body == BODY_FROM_SUBMISSION {
                    // One row that cannot be read must not hold up every other callback.
                    match callback_body(conn, &submission_id).await {
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
            Ok(Reply::Due(out))
        }
        Op::NextCallbackAt => {
            let at: Option<i64> = sqlx::query(sql::NEXT_CALLBACK_AT)
                .bind(CallbackState::Pending.as_str())
                .fetch_one(&mut *conn)
                .await?
                .try_get(0)?;
            Ok(Reply::At(at))
        }
        Op::Job(id) => {
            let job: Option<Option<String>> = sqlx::query_scalar(sql::JOB)
                .bind(&id)
                .fetch_optional(&mut *conn)
                .await?;
            let job = job.flatten().map(|j| decode(&j)).transpose()?;
            Ok(Reply::Job(job.map(Box::new)))
        }
        Op::Keyed { key, hash } => Ok(Reply::Keyed(keyed(conn, &key, &hash).await?)),
        Op::Accepted(since_ms) => Ok(Reply::Accepted(accepted(conn, since_ms).await?)),
        Op::Cached(q) => {
            let row = sqlx::query(sql::CACHED)
                .bind(&q.key)
                .bind(q.since_ms)
                .bind(crate::submission::State::Succeeded.as_str())
                .bind(q.max_timeout_ms)
                .fetch_optional(&mut *conn)
                .await?;
            loaded(conn, row).await
        }
        Op::FleetLoad => Ok(Reply::Docs(
            sqlx::query_scalar(sql::FLEET_LOAD)
                .fetch_all(&mut *conn)
                .await?,
        )),
        other => write(conn, &other).await,
    }
}

// The SQLite store is the default `Durable`: each call one message to its connections' tasks.
impl Durable for Sqlite {
    fn insert(&self, new: NewSubmission) -> BoxFuture<'_, Result<Inserted, StoreError>> {
        Box::pin(Sqlite::insert(self, new))
    }
    fn save<'a>(&'a self, sub: &'a Submission) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(Sqlite::save(self, sub))
    }
    fn finish<'a>(
        &'a self,
        sub: &'a Submission,
        callback: Option<NewCallback>,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(Sqlite::finish(self, sub, callback))
    }
    fn load<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Submission>, StoreError>> {
        Box::pin(Sqlite::load(self, id))
    }
    fn job<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Job>, StoreError>> {
        Box::pin(Sqlite::job(self, id))
    }
    fn keyed<'a>(
        &'a self,
        key: &'a str,
        hash: &'a str,
    ) -> BoxFuture<'a, Result<Option<Inserted>, StoreError>> {
        Box::pin(Sqlite::keyed(self, key, hash))
    }
    fn accepted_since(&self, since_ms: i64) -> BoxFuture<'_, Result<Vec<Accepted>, StoreError>> {
        Box::pin(Sqlite::accepted_since(self, since_ms))
    }
    fn cached<'a>(
        &'a self,
        q: &'a CacheQuery,
    ) -> BoxFuture<'a, Result<Option<Submission>, StoreError>> {
        Box::pin(Sqlite::cached(self, q))
    }
    fn pending(&self) -> BoxFuture<'_, Result<Vec<Pending>, StoreError>> {
        Box::pin(Sqlite::pending(self))
    }
    fn due_callbacks(
        &self,
        now_ms: i64,
        limit: i64,
    ) -> BoxFuture<'_, Result<Vec<DueCallback>, StoreError>> {
        Box::pin(Sqlite::due_callbacks(self, now_ms, limit))
    }
    fn next_callback_at(&self) -> BoxFuture<'_, Result<Option<i64>, StoreError>> {
        Box::pin(Sqlite::next_callback_at(self))
    }
    fn callback_attempted<'a>(
        &'a self,
        id: &'a str,
        state: CallbackState,
        attempts: i64,
        next_at_ms: i64,
        error: Option<String>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(Sqlite::callback_attempted(
            self, id, state, attempts, next_at_ms, error,
        ))
    }
    fn health(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(Sqlite::health(self))
    }
    fn persistent(&self) -> bool {
        self.path().is_some()
    }
    fn fleet_load(&self) -> BoxFuture<'_, Result<Vec<String>, StoreError>> {
        Box::pin(async move {
            match self.call(Op::FleetLoad).await? {
                Reply::Docs(d) => Ok(d),
                _ => Err(StoreError::Closed),
            }
        })
    }
    fn fleet_save<'a>(
        &'a self,
        id: &'a str,
        doc: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.call(Op::FleetSave {
                id: id.to_string(),
                doc: doc.to_string(),
            })
            .await
            .map(|_| ())
        })
    }
    fn fleet_forget<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move { self.call(Op::FleetForget(id.to_string())).await.map(|_| ()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::executor::Job;
    use crate::submission::{Outcome, State};

    /// A store of this process let go on one thread while another opens the same directory
    /// (an in-process restart): the second shares the lock or takes it, and is never refused
    /// as if another process held it.
    #[test]
    fn a_lock_let_go_while_the_directory_is_opened_again_is_never_refused() {
        let dir = tempfile::tempdir().unwrap();
        // Processes started meanwhile, as a service's hooks are: each child holds a copy of
        // every descriptor from its fork to its exec (the lock's too).
        let stop = Arc::new(AtomicBool::new(false));
        let forker = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let _ = std::process::Command::new("true").status();
                }
            })
        };
        for i in 0..2000 {
            let first = hold_dir(dir.path()).unwrap();
            let go = Arc::new(std::sync::Barrier::new(2));
            let go2 = go.clone();
            let dropper = std::thread::spawn(move || {
                go2.wait();
                drop(first);
            });
            go.wait();
            let second = hold_dir(dir.path());
            dropper.join().unwrap();
            assert!(second.is_ok(), "attempt {i}: {:?}", second.err());
        }
        stop.store(true, Ordering::Relaxed);
        forker.join().unwrap();
    }

    fn job(id: &str) -> Job {
        Job {
            submission_id: id.into(),
            run_id: "r".into(),
            queue: "q".into(),
            mode: "test".into(),
            payload: "eJw=".into(),
            ranked: false,
            pin: None,
            pin_tags: Default::default(),
        }
    }

    fn new_sub(key: Option<(&str, &str)>) -> NewSubmission {
        let id = uuid::Uuid::new_v4().to_string();
        NewSubmission {
            sub: Submission::new(id.clone(), "q".into(), None, None, 60, chrono::Utc::now()),
            job: job(&id),
            deadline_ms: now_ms() + 60_000,
            idempotency: key.map(|(k, h)| (k.to_string(), h.to_string())),
            fair_tag: Some(0),
            cache_key: None,
        }
    }

    #[tokio::test]
    async fn a_submission_survives_reopening_and_its_end_is_final() {
        let dir = tempfile::tempdir().unwrap();
        let n = new_sub(None);
        let id = n.sub.id.clone();
        {
            let db = Sqlite::open(Some(dir.path()), SyncMode::Normal, None).unwrap();
            assert!(matches!(
                db.insert(n.clone()).await.unwrap(),
                Inserted::Created
            ));
            let mut s = n.sub.clone();
            s.advance(State::Running, chrono::Utc::now());
            db.save(&s).await.unwrap();
            let pending = db.pending().await.unwrap();
            assert_eq!(pending.len(), 1);
            assert_eq!(pending[0].sub, s);
            assert_eq!(pending[0].job.as_ref(), Some(&n.job));
        }
        let db = Sqlite::open(Some(dir.path()), SyncMode::Normal, None).unwrap();
        let mut s = db.load(&id).await.unwrap().unwrap();
        assert_eq!(s.state, State::Running);
        s.finish(Outcome::Failed("x".into()), chrono::Utc::now());
        let cb = NewCallback {
            url: "http://127.0.0.1:1/cb".into(),
            body: Some("{}".into()),
            give_up_at_ms: now_ms() + 1000,
        };
        assert!(db.finish(&s, Some(cb.clone())).await.unwrap());
        assert!(
            !db.finish(&s, Some(cb)).await.unwrap(),
            "a second end is refused"
        );
        assert!(db.pending().await.unwrap().is_empty());
        let due = db.due_callbacks(now_ms() + 1, 10).await.unwrap();
        assert_eq!(due.len(), 1, "one callback, written with the end");
        db.callback_attempted(&id, CallbackState::Delivered, 1, 0, None)
            .await
            .unwrap();
        assert!(db.due_callbacks(now_ms() + 1, 10).await.unwrap().is_empty());
        db.health().await.unwrap();
        for f in ["kernelkite.db", "kernelkite.db-wal", "kernelkite.db-shm"] {
            let mode = std::fs::metadata(dir.path().join(f))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{f}: {mode:o}");
        }
    }

    /// A write that failed for want of space is retried by the health probe once there is
    /// room (nothing else need write on an idle service); any other failure keeps the store
    /// unhealthy until a real write succeeds.
    #[tokio::test]
    async fn only_a_disk_full_failure_is_cleared_by_the_health_probe() {
        let dir = tempfile::tempdir().unwrap();
        let db = Sqlite::open(Some(dir.path()), SyncMode::Normal, None).unwrap();
        let fail = |why: &str, disk_full| {
            set_failed(
                &db.shared,
                Some(WriteFailure {
                    why: why.into(),
                    disk_full,
                }),
            )
        };

        fail("database or disk is full", true);
        db.health().await.expect("room again: the probe commits");
        assert_eq!(db.last_write_error(), None);

        fail("disk I/O error", false);
        let e = db.health().await.unwrap_err();
        assert!(e.to_string().contains("disk I/O error"), "{e}");
        assert_eq!(db.last_write_error().as_deref(), Some("disk I/O error"));
        db.insert(new_sub(None)).await.unwrap();
        db.health().await.expect("a write succeeded since");
    }

    /// Writes acknowledged on a disk that fills up are all there after reopening: a write that
    /// fails with SQLITE_FULL must not leave the connection inside a transaction that later
    /// "successful" writes join and nobody commits. Needs a small tmpfs (root).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_write_acknowledged_on_a_filling_disk_is_kept() {
        let Some(disk) = kernelkite_testkit::tmpfs::SmallTmpfs::mount(1 << 20) else {
            return;
        };
        let data = disk.path().join("data");
        let db = Sqlite::open(Some(&data), SyncMode::Normal, None).unwrap();
        // Room for a few dozen submissions: some writes commit, then the disk fills.
        let filler = disk.fill_leaving(96 << 10);
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..400 {
            let db = db.clone();
            tasks.spawn(async move {
                let n = new_sub(None);
                let mut s = n.sub.clone();
                db.insert(n).await.ok()?;
                s.advance(State::Running, chrono::Utc::now());
                let saved = db.save(&s).await.is_ok();
                Some((s, saved))
            });
        }
        let mut acked = Vec::new();
        let mut refused = 0;
        while let Some(r) = tasks.join_next().await {
            match r.unwrap() {
                Some(x) => acked.push(x),
                None => refused += 1,
            }
        }
        eprintln!("{} writes acknowledged, {refused} refused", acked.len());
        assert!(
            refused > 0 && !acked.is_empty(),
            "the disk must fill part way through for this test to prove anything"
        );
        drop(db);
        tokio::time::sleep(Duration::from_millis(200)).await;
        std::fs::remove_file(&filler).unwrap();
        let db = Sqlite::open(Some(&data), SyncMode::Normal, None).unwrap();
        let (mut lost, mut half) = (0, 0);
        for (s, saved) in &acked {
            match db.load(&s.id).await.unwrap() {
                Some(got) if *saved && got.state == State::Running => {}
                // A refused change left the submission as it was.
                Some(got) if !saved && got.state == State::Queued => {}
                Some(_) => half += 1,
                None => lost += 1,
            }
        }
        assert_eq!(
            lost,
            0,
            "{lost} of {} acknowledged writes lost",
            acked.len()
        );
        assert_eq!(half, 0, "{half} refused changes were kept anyway");
    }

    #[test]
    fn disk_full_is_sqlite_full_or_enospc() {
        let enospc = std::io::Error::from_raw_os_error(rustix::io::Errno::NOSPC.raw_os_error());
        assert!(is_disk_full(&sqlx::Error::Io(enospc)));
        let eio = std::io::Error::from_raw_os_error(rustix::io::Errno::IO.raw_os_error());
        assert!(!is_disk_full(&sqlx::Error::Io(eio)));
        assert!(!is_disk_full(&sqlx::Error::RowNotFound));
    }

    #[tokio::test]
    async fn an_idempotency_key_returns_the_first_submission() {
        let db = Sqlite::open(None, SyncMode::Normal, None).unwrap();
        let a = new_sub(Some(("k1", "h1")));
        assert!(matches!(
            db.insert(a.clone()).await.unwrap(),
            Inserted::Created
        ));
        match db.insert(new_sub(Some(("k1", "h1")))).await.unwrap() {
            Inserted::Existing { sub, same_request } => {
                assert_eq!(sub.id, a.sub.id);
                assert!(same_request);
            }
            Inserted::Created => panic!("key reused"),
        }
        match db.insert(new_sub(Some(("k1", "h2")))).await.unwrap() {
            Inserted::Existing { same_request, .. } => assert!(!same_request),
            Inserted::Created => panic!("key reused"),
        }
        assert_eq!(db.pending().await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn garbage_is_refused_as_corrupt_with_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(DB_FILE), vec![0x5a; 8192]).unwrap();
        let e = Sqlite::open(Some(dir.path()), SyncMode::Normal, None).unwrap_err();
        assert!(matches!(e, StoreError::Corrupt { .. }), "{e}");
        assert!(e.to_string().contains("restore it from a backup"), "{e}");
    }

    /// What a database made before sqlx's migrator holds: the schema as that release's own
    /// migrator wrote it (its version 1, verbatim), recorded in its `kernelkite_schema`.
    const PRE_SQLX_SCHEMA: &str = "CREATE TABLE kernelkite_schema (version BIGINT PRIMARY KEY, applied_at_ms BIGINT NOT NULL);
        CREATE TABLE submissions (
            id TEXT PRIMARY KEY,
            state TEXT NOT NULL,
            terminal BIGINT NOT NULL,
            created_at_ms BIGINT NOT NULL,
            deadline_ms BIGINT NOT NULL,
            build_id TEXT,
            build_number BIGINT,
            idempotency_key TEXT UNIQUE,
            request_sha256 TEXT,
            job TEXT,
            doc TEXT NOT NULL
        );
        CREATE INDEX submissions_open ON submissions (terminal);
        CREATE TABLE callbacks (
            submission_id TEXT PRIMARY KEY,
            url TEXT NOT NULL,
            body TEXT NOT NULL,
            state TEXT NOT NULL,
            attempts BIGINT NOT NULL,
            next_at_ms BIGINT NOT NULL,
            give_up_at_ms BIGINT NOT NULL,
            last_error TEXT
        );
        CREATE INDEX callbacks_due ON callbacks (state, next_at_ms);
        CREATE TABLE kernelkite_health (id BIGINT PRIMARY KEY, checked_at_ms BIGINT NOT NULL);
        INSERT INTO kernelkite_health (id, checked_at_ms) VALUES (1, 0);
        INSERT INTO kernelkite_schema (version, applied_at_ms) VALUES (1, 1700000000000);";

    async fn raw(dir: &Path) -> SqliteConnection {
        SqliteConnectOptions::new()
            .filename(dir.join(DB_FILE))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .connect()
            .await
            .unwrap()
    }

    /// Every table's columns and every index's columns, the migrators' bookkeeping aside.
    async fn layout(conn: &mut SqliteConnection) -> Vec<String> {
        let rows = sqlx::query(
            "SELECT m.type || ' ' || m.name || ' on ' || m.tbl_name || ': ' || COALESCE(
                 (SELECT group_concat(c.name || ' ' || c.type || ' ' || c.\"notnull\" || ' ' || c.pk, ', ')
                  FROM pragma_table_info(m.name) c),
                 (SELECT group_concat(i.name, ', ') FROM pragma_index_info(m.name) i), '')
             FROM sqlite_master m
             WHERE m.name NOT IN ('_sqlx_migrations', 'kernelkite_schema')
               AND m.tbl_name NOT IN ('_sqlx_migrations', 'kernelkite_schema')
             ORDER BY m.type, m.name",
        )
        .fetch_all(&mut *conn)
        .await
        .unwrap();
        rows.iter().map(|r| r.get::<String, _>(0)).collect()
    }

    #[tokio::test]
    async fn a_database_from_before_sqlx_migrations_opens_with_its_submissions() {
        // The schema the migrations make is the one the old migrator made.
        let old = tempfile::tempdir().unwrap();
        let old_layout = {
            let mut c = raw(old.path()).await;
            sqlx::raw_sql(PRE_SQLX_SCHEMA)
                .execute(&mut c)
                .await
                .unwrap();
            layout(&mut c).await
        };
        assert!(old_layout.len() >= 6, "{old_layout:?}");
        let dir = tempfile::tempdir().unwrap();
        let n = new_sub(None);
        {
            let db = Sqlite::open(Some(dir.path()), SyncMode::Normal, None).unwrap();
            db.insert(n.clone()).await.unwrap();
        }
        // Made old: the submission kept, the bookkeeping the old release's.
        let new_layout = {
            let mut c = raw(dir.path()).await;
            let new_layout = layout(&mut c).await;
            // The first migration makes the old schema; later ones only add to it.
            assert!(new_layout.len() > old_layout.len(), "{new_layout:?}");
            // The previous release skips its first schema when it finds version 1 here:
            // what lets it open (after a rollback) a database this release made.
            let old_version: Option<i64> =
                sqlx::query_scalar("SELECT MAX(version) FROM kernelkite_schema")
                    .fetch_one(&mut c)
                    .await
                    .unwrap();
            assert_eq!(old_version, Some(1));
            // A later release's migration (a rollback to this one): the database still opens.
            sqlx::raw_sql(
                "INSERT INTO _sqlx_migrations (version, description, installed_on, success, checksum, execution_time)
                 VALUES (99, 'later', CURRENT_TIMESTAMP, 1, X'00', 0);",
            )
            .execute(&mut c)
            .await
            .unwrap();
            new_layout
        };
        for d in [old.path()] {
            let db = Sqlite::open(Some(d), SyncMode::Normal, None).unwrap();
            db.health().await.unwrap();
            db.insert(new_sub(None)).await.unwrap();
            drop(db);
            let mut c = raw(d).await;
            assert_eq!(layout(&mut c).await, new_layout, "{}", d.display());
            let applied: Vec<(i64, bool)> =
                sqlx::query_as("SELECT version, success FROM _sqlx_migrations ORDER BY version")
                    .fetch_all(&mut c)
                    .await
                    .unwrap();
            assert_eq!(
                applied,
                [(1, true), (2, true), (3, true), (4, true), (5, true)]
            );
        }
        let db = Sqlite::open(Some(dir.path()), SyncMode::Normal, None).unwrap();
        db.insert(new_sub(None)).await.unwrap();
        let pending = db.pending().await.unwrap();
        assert!(
            pending.iter().any(|p| p.sub == n.sub),
            "the old submission is kept"
        );
        assert_eq!(pending.len(), 2);
    }

    #[tokio::test]
    async fn each_queue_s_last_runs_are_read_back_on_opening() {
        let dir = tempfile::tempdir().unwrap();
        let t0 = chrono::Utc::now() - chrono::Duration::hours(1);
        let at = |s: i64| t0 + chrono::Duration::seconds(s);
        {
            let db = Sqlite::open(Some(dir.path()), SyncMode::Normal, None).unwrap();
            // Queue q: 40 runs, each started a second after it came, the later ones ending
            // first (fair share can do that) at 1000 - i s; queue r: one of 7 s; and three
            // that never ran.
            let ran = |queue: &str, i: i64, end: Option<i64>| {
                let mut n = new_sub(None);
                n.sub.queue = queue.into();
                n.sub.timeout_s = 3600;
                n.sub.created_at = at(i);
                let db = &db;
                async move {
                    db.insert(n.clone()).await.unwrap();
                    let mut s = n.sub;
                    let start = at(i + 1);
                    if let Some(end) = end {
                        s.advance(State::Running, start);
                        s.finish(Outcome::Failed("done".into()), at(end));
                    } else {
                        s.finish(Outcome::Canceled("in the queue".into()), start);
                    }
                    assert!(db.finish(&s, None).await.unwrap());
                }
            };
            for i in 1..=40 {
                ran("q", i, Some(1000 - i)).await;
            }
            ran("r", 5, Some(13)).await;
            ran("q", 50, None).await;
            ran("r", 51, None).await;
            // One still running: no run time yet.
            let mut open = new_sub(None);
            open.sub.created_at = at(60);
            db.insert(open.clone()).await.unwrap();
        }
        let (_db, reopened) =
            Sqlite::open_with_pending(Some(dir.path()), SyncMode::Normal, None).unwrap();
        let of = |q: &str| -> Vec<u64> {
            reopened
                .runs
                .iter()
                .filter(|r| r.queue == q)
                .map(|r| r.took.as_secs())
                .collect()
        };
        // The last 32 to end are runs 32 down to 1, of 999 - 2i s each.
        let last: Vec<u64> = (1..=32).rev().map(|i| 999 - 2 * i).collect();
        assert_eq!(of("q"), last, "q's last 32 to end, the earliest end first");
        assert_eq!(of("r"), [7], "r's own, however busy q is");
        assert_eq!(reopened.runs.len(), 33);
    }

    #[tokio::test]
    async fn a_database_rolled_back_as_the_readme_says_upgrades_again() {
        let dir = tempfile::tempdir().unwrap();
        let n = new_sub(None);
        {
            let db = Sqlite::open(Some(dir.path()), SyncMode::Normal, None).unwrap();
            db.insert(n.clone()).await.unwrap();
        }
        let fresh = layout(&mut raw(dir.path()).await).await;
        {
            // service/README.md, "Durable": the rollback, then what to drop before upgrading.
            let mut c = raw(dir.path()).await;
            let mut steps = vec![
                "DELETE FROM _sqlx_migrations WHERE version >= 2".to_string(),
                "DROP INDEX submissions_created".into(),
                "DROP INDEX submissions_cache".into(),
            ];
            for col in [
                "queue",
                "user_id",
                "class",
                "fair_tag",
                "cache_key",
                "ran_ms",
                "ended_at_ms",
                "cached_from",
            ] {
                steps.push(format!("ALTER TABLE submissions DROP COLUMN {col}"));
            }
            for step in steps {
                sqlx::raw_sql(&step).execute(&mut c).await.unwrap();
            }
        }
        let db = Sqlite::open(Some(dir.path()), SyncMode::Normal, None).unwrap();
        let pending = db.pending().await.unwrap();
        assert_eq!(pending.len(), 1, "the submission is kept");
        drop(db);
        assert_eq!(layout(&mut raw(dir.path()).await).await, fresh);
    }

    #[test]
    fn an_applied_migration_is_never_edited() {
        // sqlx refuses to open a database whose applied migration's bytes changed (a comment,
        // whitespace, line endings): add a new migration instead of editing one.
        let checksums: Vec<String> = MIGRATOR.iter().map(|m| hex::encode(&m.checksum)).collect();
        // The SHA-384 of each of migrations/*.sql (`sha384sum`).
        assert_eq!(
            checksums,
            [
                "c9f0df05af4a0da052b7b8079a60e80ffdeba71c5e1f1891127935f4f486f30d1187de756d06cd34cad8ea6d740c4241",
                "2f8e198223c1ad28bd49430e30223cd41e41afa8d77385f174f45616ecd8b2dba5a0e2bf26d78998542eac8002b0dd59",
                "45ed3f2ee71a4afebde020e2d4ceb6276f603a4dcbc05b844ff9859184795c1cc724d18acf89a46e09cecabb5a9540a6",
                "a01626c40f6a22236ddc53a59f94498d3031c5a30b8dde43a8c5fa471be0df60502d8d33dccedd27c53625fb2ce9dae0",
                "24e35937881a115ad31ff82e47fdae22cfb5c37bbbfbc5081e82aac5c8e7cf1437ee2a108ca6d8002a7e3e2f66aacd6c"
            ]
        );
    }
}
