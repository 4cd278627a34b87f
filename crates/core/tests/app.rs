//! The core alone: the App over the in-memory store and an executor that runs builds in this
//! process, driven through the events handle an executor is given. No HTTP, no database, no
//! kernelkite crate but the core and its leaves; the service's tests drive the same core over
//! HTTP against the fake Buildkite and the SQLite store.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use kernelkite_core::config::{Callbacks, Config, Fair};
use kernelkite_core::dispatch::{Limits, Most, Slots};
use kernelkite_core::executor::{
    BuildEvent, BuildEventKind, BuildStatus, Collected, Executor, Job, Launched,
};
use kernelkite_core::metrics::Metrics;
use kernelkite_core::report::BoxError;
use kernelkite_core::result::ResultJson;
use kernelkite_core::store::{Durable, InMemory, StoreError};
use kernelkite_core::submission::{BuildInfo, Outcome, State, Submission};
use kernelkite_core::{events, App, Error, SubmitRequest};

/// Builds run "here": each launch is recorded, and the test says how each ends.
#[derive(Default)]
struct InProcess {
    launched: Mutex<Vec<Job>>,
    canceled: Mutex<Vec<String>>,
    /// Builds at once (`None`: as many as are started).
    slots: Option<u64>,
}

impl Executor for InProcess {
    fn name(&self) -> &'static str {
        "in-process"
    }

    fn launch<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Result<Launched, BoxError>> {
        Box::pin(async move {
            let mut launched = self.launched.lock().unwrap();
            launched.push(job.clone());
            let number = launched.len() as u64;
            Ok(Launched {
                build: BuildInfo {
                    id: format!("build-{number}"),
                    number,
                    web_url: format!("file:///builds/{number}"),
                },
                running: true,
            })
        })
    }

    fn cancel<'a>(&'a self, build: &'a BuildInfo) -> BoxFuture<'a, Result<bool, BoxError>> {
        Box::pin(async move {
            self.canceled.lock().unwrap().push(build.id.clone());
            Ok(true)
        })
    }

    fn collect<'a>(&'a self, build: &'a BuildStatus) -> BoxFuture<'a, Result<Collected, BoxError>> {
        Box::pin(async move {
            Ok(Outcome::into(if build.state == "passed" {
                Outcome::Succeeded(ResultJson::parse(RESULT.as_bytes())?)
            } else {
                Outcome::Failed(format!("build {} ended {}", build.number, build.state))
            }))
        })
    }

    fn slots(&self) -> Option<u64> {
        self.slots
    }
}

/// kernelbot's `result.json`, as the runner writes it.
const RESULT: &str = r#"{"success": true, "error": "",
  "system": {"gpu": "NVIDIA H100 80GB HBM3", "device_count": 1, "cpu": "AMD EPYC 9654",
             "runtime": "CUDA", "platform": "Linux", "torch": "2.6.0", "hostname": "node-1"},
  "runs": {"test": {"start": "2026-11-22T10:40:00.123456+00:00",
                    "end": "2026-11-22T10:40:03.654321+00:00", "compilation": null,
                    "run": {"success": true, "passed": true, "command": "python3 eval.py test",
                            "stdout": "", "stderr": "", "exit_code": 0, "duration": 3.53,
                            "result": {"check": "pass"}},
                    "profile": null}}}"#;

/// The command line's defaults, as an embedder would set them.
fn config() -> Config {
    Config {
        default_timeout_s: 1800,
        max_timeout_s: 86_400,
        max_artifact_bytes: 64 << 20,
        retry_base_ms: 5,
        fetch_concurrency: 4,
        reconcile_min_ms: 30_000,
        reconcile_max_ms: 600_000,
        public_url: None,
        early_event_max: 100,
        early_event_ttl_s: 120,
        agents_refresh_s: 60,
        callbacks: Callbacks {
            signed: false,
            allowed_hosts: Vec::new(),
            retry_s: 86_400,
        },
        fair: Fair {
            queue_slots: Slots::parse("*=none").unwrap(),
            queue_limits: Limits::parse("").unwrap(),
            queue_estimate_s: 60,
            cache: false,
            cache_max_age_s: 86_400,
            cache_hourly: Most(None),
            runner_version: "test".into(),
        },
        canary: Default::default(),
        offline_after_s: 600,
    }
}

fn request(user: &str) -> SubmitRequest {
    serde_json::from_value(serde_json::json!({
        "config": {
            "lang": "py", "mode": "test", "main": "eval.py",
            "sources": {"eval.py": "print('hi')\n", "submission.py": "x = 1\n"},
            "tests": [{"size": 128, "seed": 1}], "benchmarks": [], "seed": 42,
            "test_timeout": 60
        },
        "queue": "gpu",
        "user": user,
    }))
    .unwrap()
}

fn core(cfg: Config, executor: Arc<InProcess>, durable: Arc<InMemory>) -> Arc<App> {
    App::new(cfg, executor, durable, Arc::new(Metrics::new())).unwrap()
}

fn finished(number: u64, state: &str) -> BuildEvent {
    BuildEvent {
        kind: BuildEventKind::Finished,
        build: BuildStatus {
            id: format!("build-{number}"),
            number,
            state: state.into(),
            web_url: String::new(),
            blocked: false,
        },
    }
}

/// Waits (at most 5 s) until `f` holds.
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn state(app: &App, id: &str) -> Submission {
    app.lookup(id).await.unwrap().expect("known")
}

#[tokio::test]
async fn a_submission_runs_on_the_executor_and_ends_with_its_result_once_committed() {
    let executor = Arc::new(InProcess::default());
    let durable = Arc::new(InMemory::new());
    let app = core(config(), executor.clone(), durable.clone());
    let events = events::for_executor(&app);

    let sub = app.submit(request("alice"), None).await.unwrap().submission;
    until("the build is launched", || {
        executor.launched.lock().unwrap().len() == 1
    })
    .await;
    assert_eq!(executor.launched.lock().unwrap()[0].submission_id, sub.id);
    let mut watch = events.watch(&sub.id).expect("in flight");

    events.deliver(finished(1, "passed")).await;
    // The event's change was committed before `deliver` returned: the build finished and its
    // result is being fetched (what a webhook is acknowledged after).
    let kept = durable.load(&sub.id).await.unwrap().expect("kept");
    assert!(
        matches!(kept.state, State::Fetching | State::Succeeded),
        "{kept:?}"
    );
    // Then the result is collected, committed, and the waiter told.
    tokio::time::timeout(
        Duration::from_secs(5),
        watch.wait_for(|s| s.state.is_terminal()),
    )
    .await
    .expect("the watcher is told")
    .unwrap();
    let kept = durable.load(&sub.id).await.unwrap().expect("kept");
    assert_eq!(kept.state, State::Succeeded, "{kept:?}");
    assert_eq!(
        kept.result
            .as_ref()
            .map(|r| serde_json::from_str::<serde_json::Value>(r.get()).unwrap()),
        Some(serde_json::from_str::<serde_json::Value>(RESULT).unwrap()),
        "the result is the runner's, unchanged"
    );
}

/// Waits (at most 5 s) for `id` to end, and returns it.
async fn ended(app: &App, id: &str) -> Submission {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let s = state(app, id).await;
        if s.state.is_terminal() {
            return s;
        }
        assert!(tokio::time::Instant::now() < deadline, "never ended: {s:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_failed_build_fails_its_submission_and_a_second_finish_changes_nothing() {
    let executor = Arc::new(InProcess::default());
    let app = core(config(), executor.clone(), Arc::new(InMemory::new()));
    let events = events::for_executor(&app);
    let sub = app.submit(request("alice"), None).await.unwrap().submission;
    until("launched", || executor.launched.lock().unwrap().len() == 1).await;
    events.deliver(finished(1, "failed")).await;
    let end = ended(&app, &sub.id).await;
    assert_eq!(end.state, State::Failed, "{end:?}");
    // A late or repeated event for an ended submission is dropped.
    events.deliver(finished(1, "passed")).await;
    assert_eq!(state(&app, &sub.id).await.state, State::Failed);
}

#[tokio::test]
async fn an_idempotency_key_returns_the_first_submission_and_refuses_another_request() {
    let executor = Arc::new(InProcess::default());
    let app = core(config(), executor.clone(), Arc::new(InMemory::new()));
    let first = app
        .submit(request("alice"), Some("key-1".into()))
        .await
        .unwrap();
    assert!(first.created);
    let again = app
        .submit(request("alice"), Some("key-1".into()))
        .await
        .unwrap();
    assert!(!again.created);
    assert_eq!(again.submission.id, first.submission.id);
    let other = app.submit(request("bob"), Some("key-1".into())).await;
    assert!(matches!(other, Err(Error::KeyReused { .. })), "{other:?}");
    until("one build", || executor.launched.lock().unwrap().len() == 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(executor.launched.lock().unwrap().len(), 1, "a second build");
}

#[tokio::test]
async fn cancel_cancels_the_build_once_and_sticks() {
    let executor = Arc::new(InProcess::default());
    let app = core(config(), executor.clone(), Arc::new(InMemory::new()));
    let events = events::for_executor(&app);
    let sub = app.submit(request("alice"), None).await.unwrap().submission;
    until("launched", || executor.launched.lock().unwrap().len() == 1).await;
    let canceled = app.cancel(&sub.id).await.unwrap();
    assert_eq!(canceled.state, State::Canceled);
    until("the build is canceled", || {
        executor.canceled.lock().unwrap().len() == 1
    })
    .await;
    events.deliver(finished(1, "passed")).await;
    assert_eq!(state(&app, &sub.id).await.state, State::Canceled);
    assert_eq!(executor.canceled.lock().unwrap().as_slice(), ["build-1"]);
}

/// What a user of a one-slot executor feels: while work waits, the slot is never idle, and
/// the next submission starts as soon as the running one ends.
#[tokio::test]
async fn with_one_slot_the_next_submission_starts_when_the_running_one_ends() {
    let executor = Arc::new(InProcess {
        slots: Some(1),
        ..InProcess::default()
    });
    let mut cfg = config();
    cfg.fair.queue_slots = Slots::parse("").unwrap();
    let app = core(cfg, executor.clone(), Arc::new(InMemory::new()));
    let events = events::for_executor(&app);
    let a = app.submit(request("alice"), None).await.unwrap().submission;
    let b = app.submit(request("bob"), None).await.unwrap().submission;
    until("the first is launched", || {
        executor.launched.lock().unwrap().len() == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        executor.launched.lock().unwrap().len(),
        1,
        "two on one slot"
    );
    assert_eq!(state(&app, &b.id).await.state, State::Queued);

    events.deliver(finished(1, "passed")).await;
    assert_eq!(ended(&app, &a.id).await.state, State::Succeeded);
    until("the second is launched", || {
        executor.launched.lock().unwrap().len() == 2
    })
    .await;
    assert_eq!(executor.launched.lock().unwrap()[1].submission_id, b.id);
}

#[tokio::test]
async fn bad_input_is_refused_and_nothing_is_written() {
    let executor = Arc::new(InProcess::default());
    let durable = Arc::new(InMemory::new());
    let app = core(config(), executor.clone(), durable.clone());
    let mut no_sources = request("alice");
    no_sources.config = serde_json::json!({"lang": "py", "mode": "test"});
    let refused = app.submit(no_sources, None).await;
    assert!(matches!(refused, Err(Error::Invalid(_))), "{refused:?}");
    let mut bad_queue = request("alice");
    bad_queue.queue = "no spaces".into();
    assert!(matches!(
        app.submit(bad_queue, None).await,
        Err(Error::Invalid(_))
    ));
    assert!(durable.pending().await.unwrap().is_empty());
    assert!(executor.launched.lock().unwrap().is_empty());
}

/// The in-memory store whose first insert is committed and then reported failed, as when the
/// database's reply to a commit is lost (the connection dropped after the commit).
struct LostReply {
    inner: InMemory,
    lost: std::sync::atomic::AtomicBool,
    /// The retries' replays wait for each other here, so they race on what follows.
    together: tokio::sync::Barrier,
}

impl Durable for LostReply {
    fn insert(
        &self,
        new: kernelkite_core::store::NewSubmission,
    ) -> BoxFuture<'_, Result<kernelkite_core::store::Inserted, StoreError>> {
        Box::pin(async move {
            let done = self.inner.insert(new).await;
            if !self.lost.swap(true, std::sync::atomic::Ordering::SeqCst) {
                return Err(StoreError::Write(
                    "the connection closed before the reply".into(),
                ));
            }
            if let Ok(kernelkite_core::store::Inserted::Existing { .. }) = &done {
                self.together.wait().await;
            }
            done
        })
    }
    fn save<'a>(&'a self, sub: &'a Submission) -> BoxFuture<'a, Result<(), StoreError>> {
        self.inner.save(sub)
    }
    fn finish<'a>(
        &'a self,
        sub: &'a Submission,
        callback: Option<kernelkite_core::store::NewCallback>,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.finish(sub, callback)
    }
    fn load<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Submission>, StoreError>> {
        self.inner.load(id)
    }
    fn pending(&self) -> BoxFuture<'_, Result<Vec<kernelkite_core::store::Pending>, StoreError>> {
        self.inner.pending()
    }
    fn job<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Job>, StoreError>> {
        self.inner.job(id)
    }
    fn keyed<'a>(
        &'a self,
        key: &'a str,
        hash: &'a str,
    ) -> BoxFuture<'a, Result<Option<kernelkite_core::store::Inserted>, StoreError>> {
        self.inner.keyed(key, hash)
    }
    fn accepted_since(
        &self,
        since_ms: i64,
    ) -> BoxFuture<'_, Result<Vec<kernelkite_core::store::Accepted>, StoreError>> {
        self.inner.accepted_since(since_ms)
    }
    fn cached<'a>(
        &'a self,
        q: &'a kernelkite_core::store::CacheQuery,
    ) -> BoxFuture<'a, Result<Option<Submission>, StoreError>> {
        self.inner.cached(q)
    }
    fn due_callbacks(
        &self,
        now_ms: i64,
        limit: i64,
    ) -> BoxFuture<'_, Result<Vec<kernelkite_core::store::DueCallback>, StoreError>> {
        self.inner.due_callbacks(now_ms, limit)
    }
    fn next_callback_at(&self) -> BoxFuture<'_, Result<Option<i64>, StoreError>> {
        self.inner.next_callback_at()
    }
    fn callback_attempted<'a>(
        &'a self,
        id: &'a str,
        state: kernelkite_core::store::CallbackState,
        attempts: i64,
        next_at_ms: i64,
        error: Option<String>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.inner
            .callback_attempted(id, state, attempts, next_at_ms, error)
    }
    fn health(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        self.inner.health()
    }
    fn persistent(&self) -> bool {
        true
    }
}

/// A submission whose write was committed but whose answer was lost: the client, told the
/// store failed, sends the request again with its key, and is answered with that submission,
/// which is then queued and run, once, however many retries race (before this, it was
/// answered but ran only after the next restart's recovery).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_submission_written_but_unanswered_runs_once_when_its_key_is_sent_again() {
    let executor = Arc::new(InProcess::default());
    let durable = Arc::new(LostReply {
        inner: InMemory::new(),
        lost: std::sync::atomic::AtomicBool::new(false),
        together: tokio::sync::Barrier::new(4),
    });
    let app = App::new(
        config(),
        executor.clone(),
        durable,
        Arc::new(Metrics::new()),
    )
    .unwrap();
    let first = app.submit(request("alice"), Some("key-1".into())).await;
    assert!(first.is_err(), "the first attempt is told the store failed");
    assert!(executor.launched.lock().unwrap().is_empty());
    let retries: Vec<_> = (0..4)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { app.submit(request("alice"), Some("key-1".into())).await })
        })
        .collect();
    let mut ids = std::collections::BTreeSet::new();
    for r in retries {
        let s = r.await.unwrap().expect("a retry is answered");
        assert!(!s.created, "the key's submission, not a new one");
        ids.insert(s.submission.id);
    }
    assert_eq!(ids.len(), 1, "{ids:?}");
    let id = ids.into_iter().next().unwrap();
    until("its build", || executor.launched.lock().unwrap().len() == 1).await;
    assert_eq!(executor.launched.lock().unwrap()[0].submission_id, id);
    events::for_executor(&app)
        .deliver(finished(1, "passed"))
        .await;
    let done = ended(&app, &id).await;
    assert_eq!(done.state, State::Succeeded);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(executor.launched.lock().unwrap().len(), 1, "a second build");
}
