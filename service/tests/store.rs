//! One suite for every durable store, written once and run against each: the core's in-memory
//! store, SQLite (a file in a data dir) and PostgreSQL (the server the test command starts,
//! `scripts/postgres.sh`; skipped, and counted so, without it). What the core relies on:
//! a submission written is read back as written, its end is final and written with its
//! callback, an idempotency key answers with the first submission (also when two requests
//! race), the quotas, the cache and the estimates find what they count, and a store that
//! outlives its process gives it all back on reopening.

use std::sync::Arc;

use kernelkite_service::executor::Job;
use kernelkite_service::result::ResultJson;
use kernelkite_service::store::{
    now_ms, CacheQuery, CallbackState, Durable, InMemory, Inserted, NewCallback, NewSubmission,
    PgSettings, Postgres, Reopened, Sqlite, StoreError, SyncMode,
};
use kernelkite_service::submission::{Outcome, State, Submission};

/// A store to test, able to open it again (a restart) when it outlives its process.
enum Backend {
    InMemory,
    Sqlite(tempfile::TempDir),
    Postgres(PgSettings),
}

impl Backend {
    fn in_memory() -> Option<Backend> {
        Some(Backend::InMemory)
    }

    fn sqlite() -> Option<Backend> {
        Some(Backend::Sqlite(tempfile::tempdir().unwrap()))
    }

    fn postgres() -> Option<Backend> {
        Some(Backend::Postgres(PgSettings {
            url: kernelkite_testkit::postgres::url()?,
            schema: kernelkite_testkit::postgres::schema(),
            max_connections: 4,
            lock_wait: std::time::Duration::ZERO,
            standby: false,
            // Its connections announce changes, as a replica's do (the relay test listens).
            replica: true,
            exit_on_lost: false,
        }))
    }

    /// Opens it (again), with what it kept.
    fn open(&self) -> (Arc<dyn Durable>, Reopened) {
        match self {
            Backend::InMemory => (Arc::new(InMemory::new()), Reopened::default()),
            Backend::Sqlite(dir) => {
                let (db, r) = Sqlite::open_with_pending(Some(dir.path()), SyncMode::Normal, None)
                    .expect("the SQLite store opens");
                (Arc::new(db), r)
            }
            Backend::Postgres(s) => {
                let (db, r) = Postgres::open(s, None).expect("the PostgreSQL store opens");
                (Arc::new(db), r)
            }
        }
    }

    fn db(&self) -> Arc<dyn Durable> {
        self.open().0
    }
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
    // One clock reading for both: the cache's query bounds `deadline - created` by the
    // timeout, which two readings a millisecond apart would exceed.
    let now = chrono::Utc::now();
    let mut sub = Submission::new(id.clone(), "q".into(), None, None, 60, now);
    sub.user = Some("ada".into());
    NewSubmission {
        sub,
        job: job(&id),
        deadline_ms: now.timestamp_millis() + 60_000,
        idempotency: key.map(|(k, h)| (k.to_string(), h.to_string())),
        fair_tag: Some(7),
        cache_key: Some("cache-key".into()),
    }
}

fn result() -> ResultJson {
    ResultJson::parse(kernelkite_testkit::sample_result_json().as_bytes()).unwrap()
}

fn callback(body: Option<&str>) -> NewCallback {
    NewCallback {
        url: "http://127.0.0.1:1/cb".into(),
        body: body.map(str::to_string),
        give_up_at_ms: now_ms() + 60_000,
    }
}

async fn created(db: &dyn Durable, n: &NewSubmission) {
    assert!(matches!(
        db.insert(n.clone()).await.expect("insert"),
        Inserted::Created
    ));
}

/// Written, changed and read back as written; its end is final, its job gone with it.
async fn a_submission_is_read_back_as_written_and_its_end_is_final(b: Backend) {
    let db = b.db();
    let n = new_sub(None);
    let id = n.sub.id.clone();
    created(db.as_ref(), &n).await;
    assert_eq!(db.load(&id).await.unwrap().as_ref(), Some(&n.sub));
    assert_eq!(db.job(&id).await.unwrap().as_ref(), Some(&n.job));
    let mut s = n.sub.clone();
    s.advance(State::Running, chrono::Utc::now());
    db.save(&s).await.unwrap();
    let pending = db.pending().await.unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].sub, s);
    assert_eq!(pending[0].deadline_ms, n.deadline_ms);
    assert_eq!(pending[0].fair_tag, Some(7));

    let mut ended = s.clone();
    ended.finish(Outcome::Succeeded(result()), chrono::Utc::now());
    assert!(db.finish(&ended, None).await.unwrap());
    let mut again = s.clone();
    again.finish(Outcome::Failed("late".into()), chrono::Utc::now());
    assert!(
        !db.finish(&again, None).await.unwrap(),
        "a second end is refused"
    );
    // A change that arrives after the end changes nothing.
    let mut late = s.clone();
    late.error = Some("late".into());
    let _ = db.save(&late).await;
    assert_eq!(db.load(&id).await.unwrap().as_ref(), Some(&ended));
    assert!(db.pending().await.unwrap().is_empty());
    assert!(
        db.job(&id).await.unwrap().is_none(),
        "the job goes with the end"
    );
    assert!(db.load("no-such-id").await.unwrap().is_none());
}

/// A key answers with the first submission, saying whether the request was the same; a
/// duplicate id is refused and the first kept.
async fn an_idempotency_key_answers_with_the_first_submission(b: Backend) {
    let db = b.db();
    let first = new_sub(Some(("k1", "h1")));
    assert!(db.keyed("k1", "h1").await.unwrap().is_none());
    created(db.as_ref(), &first).await;
    for (hash, same) in [("h1", true), ("h2", false)] {
        match db.insert(new_sub(Some(("k1", hash)))).await.unwrap() {
            Inserted::Existing { sub, same_request } => {
                assert_eq!(sub.id, first.sub.id);
                assert_eq!(same_request, same, "{hash}");
            }
            Inserted::Created => panic!("key k1 made a second submission"),
        }
        match db.keyed("k1", hash).await.unwrap() {
            Some(Inserted::Existing { sub, same_request }) => {
                assert_eq!(
                    (sub.id.as_str(), same_request),
                    (first.sub.id.as_str(), same)
                );
            }
            other => panic!("keyed: {other:?}"),
        }
    }
    let mut twin = new_sub(None);
    twin.sub.id = first.sub.id.clone();
    twin.sub.queue = "other".into();
    assert!(db.insert(twin).await.is_err(), "a duplicate id is refused");
    assert_eq!(db.load(&first.sub.id).await.unwrap().unwrap().queue, "q");
    assert_eq!(db.pending().await.unwrap().len(), 1);
}

/// Many requests with one key at once (several replicas, or one client retrying): one
/// submission, every answer naming it.
async fn requests_racing_with_one_key_make_one_submission(b: Backend) {
    let db = b.db();
    let tries: Vec<NewSubmission> = (0..16).map(|_| new_sub(Some(("race", "h")))).collect();
    let answers = futures_util::future::join_all(tries.iter().map(|n| db.insert(n.clone()))).await;
    let mut made = Vec::new();
    let mut named = Vec::new();
    for (n, a) in tries.iter().zip(answers) {
        match a.expect("every racer is answered") {
            Inserted::Created => made.push(n.sub.id.clone()),
            Inserted::Existing { sub, .. } => named.push(sub.id),
        }
    }
    assert_eq!(made.len(), 1, "{made:?}");
    assert!(named.iter().all(|id| *id == made[0]), "{named:?}");
    assert_eq!(db.pending().await.unwrap().len(), 1);
}

/// A callback is written with the end, due until it is delivered; one whose body is the
/// submission as stored is built from it.
async fn a_callback_is_written_with_the_end_and_due_until_delivered(b: Backend) {
    let db = b.db();
    let (n1, n2) = (new_sub(None), new_sub(None));
    for n in [&n1, &n2] {
        created(db.as_ref(), n).await;
    }
    assert_eq!(db.next_callback_at().await.unwrap(), None);
    let mut e1 = n1.sub.clone();
    e1.finish(Outcome::Failed("x".into()), chrono::Utc::now());
    assert!(db
        .finish(&e1, Some(callback(Some("{\"a\":1}"))))
        .await
        .unwrap());
    let mut e2 = n2.sub.clone();
    e2.finish(Outcome::Succeeded(result()), chrono::Utc::now());
    assert!(db.finish(&e2, Some(callback(None))).await.unwrap());
    assert!(
        !db.finish(&e2, Some(callback(None))).await.unwrap(),
        "no second callback"
    );
    assert!(db
        .next_callback_at()
        .await
        .unwrap()
        .is_some_and(|t| t <= now_ms()));
    let mut due = db.due_callbacks(now_ms() + 1, 10).await.unwrap();
    due.sort_by_key(|d| d.submission_id != n1.sub.id);
    assert_eq!(due.len(), 2, "{due:?}");
    assert_eq!(due[0].body, "{\"a\":1}");
    let built: Submission = serde_json::from_str(&due[1].body).unwrap();
    assert_eq!(built, e2, "the body is the ended submission");
    assert_eq!(due[0].attempts, 0);
    db.callback_attempted(
        &n1.sub.id,
        CallbackState::Pending,
        1,
        now_ms() + 60_000,
        Some("503".into()),
    )
    .await
    .unwrap();
    db.callback_attempted(&n2.sub.id, CallbackState::Delivered, 1, 0, None)
        .await
        .unwrap();
    assert!(db.due_callbacks(now_ms() + 1, 10).await.unwrap().is_empty());
    let at = db.next_callback_at().await.unwrap().unwrap();
    assert!(at > now_ms() + 50_000, "the retry is due later: {at}");
    assert_eq!(db.due_callbacks(at, 10).await.unwrap()[0].attempts, 1);
}

/// The quotas count what was queued or answered from the cache since a time; the cache
/// finds the newest success within its bounds, and an answer from it shows the run's result.
async fn the_quotas_and_the_cache_find_what_they_count(b: Backend) {
    let db = b.db();
    let since = now_ms() - 1;
    let run = new_sub(None);
    created(db.as_ref(), &run).await;
    let mut unqueued = new_sub(None);
    unqueued.fair_tag = None;
    unqueued.cache_key = None;
    created(db.as_ref(), &unqueued).await;
    let q = CacheQuery {
        key: "cache-key".into(),
        since_ms: since,
        max_timeout_ms: 60_000,
    };
    assert!(
        db.cached(&q).await.unwrap().is_none(),
        "not until it succeeded"
    );
    let mut ended = run.sub.clone();
    ended.finish(Outcome::Succeeded(result()), chrono::Utc::now());
    db.finish(&ended, None).await.unwrap();
    assert_eq!(
        db.cached(&q).await.unwrap().map(|s| s.id),
        Some(run.sub.id.clone())
    );
    let tighter = CacheQuery {
        max_timeout_ms: 1_000,
        ..q.clone()
    };
    assert!(
        db.cached(&tighter).await.unwrap().is_none(),
        "a run with more time does not answer a request with less"
    );
    let later = CacheQuery {
        since_ms: now_ms() + 60_000,
        ..q.clone()
    };
    assert!(db.cached(&later).await.unwrap().is_none(), "too old");

    // An answer from the cache: stored without the result, shown with the run's.
    let mut answer = new_sub(None);
    answer.fair_tag = None;
    answer.cache_key = None;
    answer.sub.cached_from = Some(run.sub.id.clone());
    created(db.as_ref(), &answer).await;
    let mut answered = answer.sub.clone();
    answered.finish(Outcome::Succeeded(result()), chrono::Utc::now());
    db.finish(&answered, None).await.unwrap();
    let shown = db.load(&answer.sub.id).await.unwrap().unwrap();
    assert_eq!(shown.result, ended.result);

    let counted = db.accepted_since(since).await.unwrap();
    assert_eq!(counted.len(), 2, "{counted:?}");
    assert_eq!(counted.iter().filter(|a| a.cached).count(), 1);
    assert!(counted
        .iter()
        .all(|a| a.user.as_deref() == Some("ada") && a.queue == "q"));
    assert!(db
        .accepted_since(now_ms() + 60_000)
        .await
        .unwrap()
        .is_empty());
}

/// Reopened, a store that outlives its process gives back what had not ended, what the
/// quotas count and each queue's runs; an ended submission stays readable.
async fn reopened_it_gives_back_what_a_start_needs(b: Backend) {
    let (pending_id, ended_id) = {
        let db = b.db();
        if !db.persistent() {
            kernelkite_testkit::skip("this store does not outlive its process");
            return;
        }
        let (p, e) = (new_sub(None), new_sub(None));
        created(db.as_ref(), &p).await;
        created(db.as_ref(), &e).await;
        let mut s = e.sub.clone();
        s.advance(State::Running, chrono::Utc::now());
        db.save(&s).await.unwrap();
        s.finish(
            Outcome::Failed("x".into()),
            chrono::Utc::now() + chrono::Duration::seconds(3),
        );
        db.finish(&s, None).await.unwrap();
        (p.sub.id, e.sub.id)
    };
    let (db, reopened) = b.open();
    assert_eq!(
        reopened
            .pending
            .iter()
            .map(|p| p.sub.id.as_str())
            .collect::<Vec<_>>(),
        [pending_id.as_str()]
    );
    assert_eq!(
        reopened.pending[0]
            .job
            .as_ref()
            .map(|j| j.submission_id.as_str()),
        Some(pending_id.as_str())
    );
    assert_eq!(reopened.accepted.len(), 2);
    assert_eq!(reopened.runs.len(), 1);
    assert_eq!(reopened.runs[0].queue, "q");
    assert!(reopened.runs[0].took >= std::time::Duration::from_secs(2));
    assert_eq!(
        db.load(&ended_id).await.unwrap().unwrap().state,
        State::Failed
    );
    db.health().await.unwrap();
}

/// The fleet's records (`kernelkite_core::fleet`): kept per slice, replaced whole by the next
/// save, read back after a reopen as last written; a forgotten one (a retired slice) is gone,
/// and forgetting one that is not there is no error.
async fn the_fleet_records_are_kept_and_read_back_as_last_written(b: Backend) {
    {
        let db = b.db();
        if !db.persistent() {
            kernelkite_testkit::skip("this store keeps no fleet records (nothing outlives it)");
            return;
        }
        db.fleet_save("a", r#"{"id":"a","runs":1}"#).await.unwrap();
        db.fleet_save("b", r#"{"id":"b","runs":7}"#).await.unwrap();
        db.fleet_save("a", r#"{"id":"a","runs":2}"#).await.unwrap();
        db.fleet_save("c", r#"{"id":"c","runs":3}"#).await.unwrap();
        db.fleet_forget("c").await.unwrap();
        db.fleet_forget("never-there").await.unwrap();
    }
    let db = b.db();
    assert_eq!(
        db.fleet_load().await.unwrap(),
        [r#"{"id":"a","runs":2}"#, r#"{"id":"b","runs":7}"#]
    );
}

macro_rules! suite {
    ($backend:ident: $($test:ident),* $(,)?) => {
        mod $backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    if let Some(b) = super::Backend::$backend() {
                        super::$test(b).await;
                    }
                }
            )*
        }
    };
}

macro_rules! every_store {
    ($($backend:ident),*) => {
        $(
            suite!($backend:
                a_submission_is_read_back_as_written_and_its_end_is_final,
                an_idempotency_key_answers_with_the_first_submission,
                requests_racing_with_one_key_make_one_submission,
                a_callback_is_written_with_the_end_and_due_until_delivered,
                the_quotas_and_the_cache_find_what_they_count,
                reopened_it_gives_back_what_a_start_needs,
                the_fleet_records_are_kept_and_read_back_as_last_written,
            );
        )*
    };
}

every_store!(in_memory, sqlite, postgres);

/// PostgreSQL's own: one service per schema (a second is refused, naming the holder, and
/// opens once the first let go); kernelkite's tables stay in its schema; a schema a later
/// release migrated further is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_one_service_per_schema_and_nothing_outside_it() {
    let Some(Backend::Postgres(s)) = Backend::postgres() else {
        return;
    };
    let (first, _) = Postgres::open(&s, None).unwrap();
    match Postgres::open(&s, None) {
        Err(StoreError::DatabaseInUse { schema, holder }) => {
            assert_eq!(schema, s.schema);
            assert!(
                holder.contains(&format!("pid {}", std::process::id())),
                "{holder}"
            );
            let shown = StoreError::DatabaseInUse { schema, holder }.to_string();
            assert!(shown.contains("KERNELKITE_DATABASE_SCHEMA"), "{shown}");
        }
        other => panic!(
            "a second service on {} was not refused: {other:?}",
            s.schema
        ),
    }
    // Another schema on the same server is another service's.
    let other = PgSettings {
        schema: kernelkite_testkit::postgres::schema(),
        ..s.clone()
    };
    let (beside, _) = Postgres::open(&other, None).expect("another schema opens beside it");
    drop(beside);
    // A start that waits for the lock takes it once the holder lets go (a service restarted
    // right after its predecessor died).
    let t = std::time::Instant::now();
    let letting_go = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(500));
        drop(first);
    });
    let waiting = PgSettings {
        lock_wait: std::time::Duration::from_secs(20),
        ..s.clone()
    };
    let (again, _) = Postgres::open(&waiting, None).expect("it opens once the first let go");
    assert!(
        t.elapsed() >= std::time::Duration::from_millis(500),
        "it waited for the first"
    );
    letting_go.join().unwrap();
    again.health().await.unwrap();

    let mut c = <sqlx::PgConnection as sqlx::Connection>::connect(&s.url)
        .await
        .unwrap();
    let tables: Vec<(String, String)> = sqlx::query_as(
        "SELECT table_schema, table_name FROM information_schema.tables
         WHERE table_name IN ('submissions', 'callbacks', 'kernelkite_health', '_sqlx_migrations')
           AND table_schema IN ($1, 'public')",
    )
    .bind(&s.schema)
    .fetch_all(&mut c)
    .await
    .unwrap();
    assert_eq!(tables.len(), 4, "{tables:?}");
    assert!(
        tables.iter().all(|(schema, _)| *schema == s.schema),
        "{tables:?}"
    );

    // A later release's migration, recorded: this release refuses the schema, saying what
    // to do, and writes nothing.
    drop(again);
    sqlx::query(&format!(
        "INSERT INTO {}._sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (9999, 'a later release', true, '\\x00', 0)",
        s.schema
    ))
    .execute(&mut c)
    .await
    .unwrap();
    let e = Postgres::open(&s, None).unwrap_err().to_string();
    assert!(
        e.contains("version 9999") && e.contains("later kernelkite-service release"),
        "{e}"
    );
    let recorded: i64 = sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM {}._sqlx_migrations",
        s.schema
    ))
    .fetch_one(&mut c)
    .await
    .unwrap();
    assert_eq!(
        recorded, 4,
        "this release's three and the later one's: nothing more was applied"
    );
}

/// A store whose lock's session is ended under it (the server restarted it, an operator
/// terminated it, the network cut it) writes nothing more: its next write's fence finds the
/// lock gone, and another service takes the schema while it is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_store_that_lost_its_lock_writes_nothing_more() {
    let Some(Backend::Postgres(s)) = Backend::postgres() else {
        return;
    };
    let (first, _) = Postgres::open(&s, None).unwrap();
    let kept = new_sub(None);
    created(&first, &kept).await;
    let ended = end_lock_session(&s).await;
    assert!(!ended.is_empty(), "no holder session found");
    // The server lets go of the lock as the session ends; another service takes the schema.
    let waiting = PgSettings {
        lock_wait: std::time::Duration::from_secs(10),
        ..s.clone()
    };
    let (second, reopened) = Postgres::open(&waiting, None).expect("the schema is free again");
    assert_eq!(reopened.pending.len(), 1);
    // The first store's writes are refused, whatever its pool's connections still could do.
    match first.insert(new_sub(None)).await {
        Err(StoreError::DatabaseLost { .. }) => {}
        other => panic!("a store without its lock wrote: {other:?}"),
    }
    let mut ended_kept = kept.sub.clone();
    ended_kept.finish(Outcome::Failed("x".into()), chrono::Utc::now());
    assert!(first.finish(&ended_kept, None).await.is_err());
    assert!(first.health().await.is_err());
    assert_eq!(
        second.pending().await.unwrap().len(),
        1,
        "nothing of the first's got in"
    );
    assert!(second.finish(&ended_kept, None).await.unwrap());
}

/// Bad settings are refused with what to do, and write nothing.
#[tokio::test]
async fn postgres_unreachable_or_malformed_is_refused_with_what_to_do() {
    let malformed = PgSettings {
        url: "mysql://nope".into(),
        schema: "kernelkite".into(),
        max_connections: 1,
        lock_wait: std::time::Duration::ZERO,
        standby: false,
        replica: false,
        exit_on_lost: false,
    };
    let e = Postgres::open(&malformed, None).unwrap_err().to_string();
    assert!(e.contains("KERNELKITE_DATABASE_URL"), "{e}");
    // Nothing listens on port 1.
    let closed = PgSettings {
        url: "postgres://kk:secret@127.0.0.1:1/db".into(),
        ..malformed
    };
    let e = Postgres::open(&closed, None).unwrap_err().to_string();
    assert!(e.contains("postgres://kk@127.0.0.1:1/db"), "{e}");
    assert!(!e.contains("secret"), "the password is never shown: {e}");
    // A schema name that would need quoting never reaches the server.
    let spliced = PgSettings {
        schema: "x\"; DROP SCHEMA public; --".into(),
        ..closed
    };
    let e = Postgres::open(&spliced, None).unwrap_err().to_string();
    assert!(e.contains("not plain"), "{e}");
}

/// A holder whose session stays silent (a service stopped with SIGSTOP, frozen, cut off: the
/// server would keep its session for as long as TCP looks alive) is taken over after
/// `TAKEOVER_AFTER`, not before, and its session is ended, so nothing it tries later lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_silent_holder_is_taken_over_and_its_session_ended() {
    use kernelkite_service::store::postgres::{lock_id, TAKEOVER_AFTER};
    let Some(Backend::Postgres(s)) = Backend::postgres() else {
        return;
    };
    // Made and migrated by a store first, as a service's start would.
    drop(Postgres::open(&s, None).unwrap());
    let mut silent = <sqlx::PgConnection as sqlx::Connection>::connect(&s.url)
        .await
        .unwrap();
    let (class, key) = lock_id(&s.schema);
    sqlx::query("SELECT pg_advisory_lock($1::int, $2::int)")
        .bind(class as i32)
        .bind(key as u32 as i32)
        .execute(&mut silent)
        .await
        .unwrap();
    let t = std::time::Instant::now();
    let waiting = PgSettings {
        lock_wait: std::time::Duration::from_secs(20),
        ..s.clone()
    };
    let (taken, _) = Postgres::open(&waiting, None).expect("the silent holder is taken over");
    let took = t.elapsed();
    assert!(
        took >= TAKEOVER_AFTER - std::time::Duration::from_millis(100),
        "taken over after {took:?}, before the holder was silent for {TAKEOVER_AFTER:?}"
    );
    assert!(
        took < TAKEOVER_AFTER + std::time::Duration::from_secs(3),
        "taken over only after {took:?}"
    );
    println!("a silent holder was taken over after {took:?}");
    taken.health().await.unwrap();
    let later = sqlx::query("SELECT 1").execute(&mut silent).await;
    assert!(later.is_err(), "the silent holder's session was ended");
}

/// A standby waits past any `lock_wait` while the holder beats (a live service is never
/// taken over, however long the standby waits), and takes over the moment it lets go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_standby_waits_while_the_holder_beats_and_takes_over_when_it_ends() {
    use kernelkite_service::store::postgres::TAKEOVER_AFTER;
    let Some(Backend::Postgres(s)) = Backend::postgres() else {
        return;
    };
    let (first, _) = Postgres::open(&s, None).unwrap();
    let kept = new_sub(None);
    created(&first, &kept).await;
    let standby = PgSettings {
        standby: true,
        ..s.clone()
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = tokio::runtime::Handle::current();
    let waiter = std::thread::spawn(move || {
        let _rt = handle.enter();
        let opened = Postgres::open(&standby, None);
        let _ = tx.send(std::time::Instant::now());
        opened
    });
    let waited = TAKEOVER_AFTER + std::time::Duration::from_secs(2);
    assert!(
        rx.recv_timeout(waited).is_err(),
        "the standby took over from a holder that beats"
    );
    first.health().await.expect("the holder still writes");
    let let_go = std::time::Instant::now();
    drop(first);
    let opened_at = rx
        .recv_timeout(std::time::Duration::from_secs(5))
        .expect("the standby takes over once the holder let go");
    let (second, reopened) = waiter.join().unwrap().expect("the standby opens");
    println!(
        "the standby took over {:?} after the holder let go",
        opened_at.saturating_duration_since(let_go)
    );
    assert!(
        reopened.pending.iter().any(|p| p.sub.id == kept.sub.id),
        "what the first accepted is the standby's to finish"
    );
    second.health().await.unwrap();
}

/// A write its predecessor's fence let through and that is still open when another service
/// takes over (its process frozen between the fence and the commit) is waited for, then its
/// session ended, before the one taking over reads anything: it never commits after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_write_still_open_at_a_take_over_never_commits_after_it() {
    use kernelkite_service::store::postgres::writers_lock_id;
    let Some(Backend::Postgres(s)) = Backend::postgres() else {
        return;
    };
    let (first, _) = Postgres::open(&s, None).unwrap();
    // The predecessor's write, as its fence leaves it: inside a transaction holding the
    // writers' lock shared.
    let mut writer = <sqlx::PgConnection as sqlx::Connection>::connect(&s.url)
        .await
        .unwrap();
    let (wclass, wkey) = writers_lock_id(&s.schema);
    sqlx::query("BEGIN").execute(&mut writer).await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock_shared($1::int, $2::int)")
        .bind(wclass as i32)
        .bind(wkey as u32 as i32)
        .execute(&mut writer)
        .await
        .unwrap();
    sqlx::query(&format!("CREATE TABLE {}.late_write (x int)", s.schema))
        .execute(&mut writer)
        .await
        .unwrap();
    // The predecessor loses its lock (its lock's session ended, as a take-over does).
    assert!(!end_lock_session(&s).await.is_empty());
    let mut admin = <sqlx::PgConnection as sqlx::Connection>::connect(&s.url)
        .await
        .unwrap();
    let waiting = PgSettings {
        lock_wait: std::time::Duration::from_secs(20),
        ..s.clone()
    };
    let (taken, _) = Postgres::open(&waiting, None).expect("the schema is taken over");
    let committed = sqlx::query("COMMIT").execute(&mut writer).await;
    assert!(
        committed.is_err(),
        "the predecessor's open write committed after the take-over"
    );
    let landed: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name = 'late_write')",
    )
    .bind(&s.schema)
    .fetch_one(&mut admin)
    .await
    .unwrap();
    assert!(!landed, "the late write landed");
    taken.health().await.unwrap();
    drop(first);
}

/// Ends the session holding `s`'s schema lock, as a server restart, an operator or a service
/// taking over does; whether each found was ended.
async fn end_lock_session(s: &PgSettings) -> Vec<bool> {
    let mut c = <sqlx::PgConnection as sqlx::Connection>::connect(&s.url)
        .await
        .unwrap();
    let (class, key) = kernelkite_service::store::postgres::lock_id(&s.schema);
    sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_locks
         WHERE locktype = 'advisory' AND granted AND objsubid = 2
           AND classid = $1::bigint::oid AND objid = $2::bigint::oid",
    )
    .bind(class)
    .bind(key)
    .fetch_all(&mut c)
    .await
    .unwrap()
}

/// What replicas share (`KERNELKITE_REPLICA`): a request relayed by one replica is claimed by
/// the lock's holder only once, its answer taken once; a request nobody claimed can be taken
/// back, a claimed one cannot; one whose claimant's session ended is seen as orphaned (its
/// receiver answers 503 at once); every committed change of a submission is announced on the
/// schema's channel, and a listener hears it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_relayed_requests_are_claimed_once_answered_once_and_orphaned_with_their_claimant()
{
    use kernelkite_service::store::replicas::{
        Answer, Heard, Holder, RelayState, Relayed, Replica,
    };
    let Some(Backend::Postgres(s)) = Backend::postgres() else {
        return;
    };
    let (store, _) = Postgres::open(&s, None).unwrap();
    let holder = Holder::new(store.clone());
    let replica = Replica::connect(&s).unwrap();
    let mut heard = replica.hear(vec![replica.channels().changed.clone()]);
    assert_eq!(heard.recv().await, Some(Heard::Listening));
    let request = |body: &str| Relayed {
        method: "POST".into(),
        uri: "/v1/submissions".into(),
        headers: vec![("idempotency-key".into(), "k".into())],
        peer: "127.0.0.1:1".into(),
        body: body.as_bytes().to_vec(),
    };
    replica.relay(1, &request("one")).await.unwrap();
    replica.relay(2, &request("two")).await.unwrap();
    assert_eq!(replica.relay_state(1).await.unwrap(), RelayState::Waiting);
    assert!(
        replica.withdraw(2).await.unwrap(),
        "nobody took it: taken back"
    );
    assert_eq!(replica.relay_state(2).await.unwrap(), RelayState::Gone);
    let claimed = holder.claim(10).await.unwrap();
    assert_eq!(claimed, vec![(1, request("one"))]);
    assert!(holder.claim(10).await.unwrap().is_empty(), "claimed once");
    assert!(
        !replica.withdraw(1).await.unwrap(),
        "a claimed request stays"
    );
    assert_eq!(
        replica.relay_state(1).await.unwrap(),
        RelayState::Claimed { orphaned: false }
    );
    let answer = Answer {
        status: 202,
        headers: vec![("content-type".into(), "application/json".into())],
        body: b"{}".to_vec(),
    };
    replica.answer(1, holder.pid(), &answer).await.unwrap();
    assert_eq!(replica.take_answer(1).await.unwrap(), Some(answer));
    assert_eq!(replica.take_answer(1).await.unwrap(), None, "taken once");

    // A change of a submission is announced.
    let n = new_sub(None);
    created(&store, &n).await;
    let said = tokio::time::timeout(std::time::Duration::from_secs(5), heard.recv())
        .await
        .expect("the change is announced");
    assert_eq!(
        said,
        Some(Heard::Said {
            channel: replica.channels().changed.clone(),
            payload: n.sub.id.clone()
        })
    );
    assert_eq!(replica.load(&n.sub.id).await.unwrap().unwrap().id, n.sub.id);

    // The claimant's lock session ends with a request of it unanswered.
    replica.relay(3, &request("three")).await.unwrap();
    assert_eq!(holder.claim(10).await.unwrap().len(), 1);
    drop((holder, store));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while replica.relay_state(3).await.unwrap() != (RelayState::Claimed { orphaned: true }) {
        assert!(
            std::time::Instant::now() < deadline,
            "never seen as orphaned"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
