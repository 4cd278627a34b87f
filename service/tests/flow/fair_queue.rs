//! Issue 25's simulation through the real service (HTTP API, core, store, the service's queue)
//! with an executor whose builds end when the test says: one heavy user submitting 50 at once
//! and five light users 2 each on a queue of 2 slots; an admin submission; the per-user
//! quotas; the result cache; and the queue across a restart. Written here rather than with
//! the local executor so the start order is exact: every build is launched (and recorded) in
//! the order the service started it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use kernelkite_service::executor::{
    BuildEvent, BuildEventKind, BuildStatus, Collected, Executor, Job, Launched,
};
use kernelkite_service::report::BoxError;
use kernelkite_service::result::ResultJson;
use kernelkite_service::submission::{BuildInfo, Outcome};
use kernelkite_service::{App, Config};
use kernelkite_testkit::harness::WAIT;
use kernelkite_testkit::{sample_config, sample_result_json};
use serde_json::{json, Value};

/// Launches builds numbered from 1 and records them; they "run" until the test finishes them.
#[derive(Default)]
struct Slots {
    launched: Mutex<Vec<Job>>,
    changed: tokio::sync::Notify,
    /// Its runner reports it could not evaluate (`success: false`, a machine's fault).
    runner_fails: std::sync::atomic::AtomicBool,
    /// Bytes of output the test run's `stdout` carries (a large result).
    stdout_bytes: std::sync::atomic::AtomicUsize,
    /// Slots of its own, one node's for every queue (as the local executor's slices are).
    node_slots: Option<u64>,
}

impl Executor for Slots {
    fn name(&self) -> &'static str {
        "test slots"
    }

    fn launch<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Result<Launched, BoxError>> {
        Box::pin(async move {
            let number = {
                let mut l = self.launched.lock().unwrap();
                l.push(job.clone());
                l.len() as u64
            };
            self.changed.notify_waiters();
            Ok(Launched {
                build: BuildInfo {
                    id: format!("b-{number}"),
                    number,
                    web_url: String::new(),
                },
                running: true,
            })
        })
    }

    fn slots(&self) -> Option<u64> {
        self.node_slots
    }

    fn cancel<'a>(&'a self, _: &'a BuildInfo) -> BoxFuture<'a, Result<bool, BoxError>> {
        Box::pin(async { Ok(true) })
    }

    fn collect<'a>(&'a self, _: &'a BuildStatus) -> BoxFuture<'a, Result<Collected, BoxError>> {
        Box::pin(async {
            let mut result: Value = serde_json::from_str(&sample_result_json()).unwrap();
            if self.runner_fails.load(std::sync::atomic::Ordering::SeqCst) {
                result["success"] = json!(false);
                result["error"] = json!("the GPU fell off the bus");
            }
            let pad = self.stdout_bytes.load(std::sync::atomic::Ordering::SeqCst);
            if pad > 0 {
                result["runs"]["test"]["run"]["stdout"] = json!(noise(pad));
            }
            ResultJson::parse(result.to_string().as_bytes())
                .map(|r| Outcome::Succeeded(r).into())
                .map_err(|e| e.to_string().into())
        })
    }
}

impl Slots {
    fn ids(&self) -> Vec<String> {
        let l = self.launched.lock().unwrap();
        l.iter().map(|j| j.submission_id.clone()).collect()
    }

    /// Waits until `n` builds were launched.
    async fn wait_launched(&self, n: usize) {
        tokio::time::timeout(WAIT, async {
            loop {
                let changed = self.changed.notified();
                if self.launched.lock().unwrap().len() >= n {
                    return;
                }
                changed.await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{n} builds were not launched: {:?}", self.ids()));
    }
}

struct Service {
    app: Arc<App>,
    slots: Arc<Slots>,
    base: String,
    http: reqwest::Client,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Service {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn service(tweak: impl FnOnce(&mut Config)) -> Service {
    service_on(Slots::default(), tweak).await
}

async fn service_on(slots: Slots, tweak: impl FnOnce(&mut Config)) -> Service {
    let mut cfg = Config::new("http://127.0.0.1:9/v2", "org", "pipe", "unused");
    cfg.fair.queue_slots = kernelkite_service::dispatch::Slots::parse("h100=2").unwrap();
    tweak(&mut cfg);
    let slots = Arc::new(slots);
    let app = kernelkite_service::cli::serve::start(&cfg, slots.clone()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let serving = app.clone();
    let server = tokio::spawn(async move {
        let _ = kernelkite_service::serve(serving, &cfg, listener, std::future::pending()).await;
    });
    Service {
        app,
        slots,
        base,
        http: reqwest::Client::new(),
        server,
    }
}

/// `n` characters of hex noise (SQLite stores text as it is; noise keeps any layer from
/// making a copy look small).
fn noise(n: usize) -> String {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            char::from(b"0123456789abcdef"[(x >> 60) as usize])
        })
        .collect()
}

/// The bytes of the SQLite store in `dir`.
async fn store_bytes(dir: &std::path::Path) -> u64 {
    // The logical size (its pages as a reader sees them, the WAL's included), not the files':
    // those move with checkpoints, and a checkpoint of the run's own result during the answers
    // grew the file by a copy while the WAL kept its size.
    use sqlx::Connection as _;
    let url = format!("sqlite://{}?mode=ro", dir.join("kernelkite.db").display());
    let mut c = sqlx::SqliteConnection::connect(&url).await.unwrap();
    let pages: (i64,) = sqlx::query_as("PRAGMA page_count")
        .fetch_one(&mut c)
        .await
        .unwrap();
    let size: (i64,) = sqlx::query_as("PRAGMA page_size")
        .fetch_one(&mut c)
        .await
        .unwrap();
    (pages.0 * size.0) as u64
}

/// A config that differs from every other by `n` (the cache must not answer it).
fn config(n: usize) -> Value {
    let mut c = sample_config();
    c["seed"] = json!(n);
    c
}

impl Service {
    async fn post(&self, body: Value) -> reqwest::Response {
        self.http
            .post(format!("{}/v1/submissions", self.base))
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    async fn submit(&self, user: &str, priority: Option<&str>, config: Value) -> String {
        let mut body = json!({"config": config, "queue": "h100", "user": user});
        if let Some(p) = priority {
            body["priority"] = json!(p);
        }
        let r = self.post(body).await;
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap();
        assert_eq!(status, 202, "{v}");
        v["id"].as_str().unwrap().to_string()
    }

    async fn metrics(&self) -> String {
        let r = self.http.get(format!("{}/metrics", self.base)).send();
        r.await.unwrap().text().await.unwrap()
    }

    async fn get(&self, id: &str) -> Value {
        self.http
            .get(format!("{}/v1/submissions/{id}", self.base))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Every waiting submission's reported position, once they form 1..=n (the queue's
    /// places were told after its last change): the ids in position order.
    async fn places(&self, ids: &[String]) -> Vec<String> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let mut placed = Vec::new();
            let mut waiting = 0;
            for id in ids {
                let v = self.get(id).await;
                if v["state"] == "queued" && v["build"].is_null() {
                    waiting += 1;
                    if let Some(p) = v["place"]["position"].as_u64() {
                        placed.push((p, id.clone()));
                    }
                }
            }
            placed.sort();
            let positions: Vec<u64> = placed.iter().map(|p| p.0).collect();
            if placed.len() == waiting && positions == (1..=waiting as u64).collect::<Vec<_>>() {
                return placed.into_iter().map(|p| p.1).collect();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the places never settled: {placed:?} of {waiting} waiting"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Ends build `number` as passed, as its executor's event would.
    async fn finish(&self, number: usize) {
        kernelkite_service::events::for_executor(&self.app)
            .deliver(BuildEvent {
                kind: BuildEventKind::Finished,
                build: BuildStatus {
                    id: format!("b-{number}"),
                    number: number as u64,
                    state: "passed".into(),
                    web_url: String::new(),
                    blocked: false,
                },
            })
            .await;
    }

    async fn wait_ended(&self, id: &str) -> Value {
        let v: Value = self
            .http
            .get(format!("{}/v1/submissions/{id}?wait=10", self.base))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(v["state"], "succeeded", "{v}");
        v
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_from_one_user_do_not_hold_up_five_light_users_and_places_match_starts() {
    let s = service(|c| c.fair.cache = false).await;
    let mut heavy = Vec::new();
    for i in 0..50 {
        heavy.push(s.submit("heavy", None, config(i)).await);
    }
    let mut light = Vec::new();
    for u in 0..5 {
        for k in 0..2 {
            light.push(
                s.submit(&format!("light{u}"), None, config(100 + u * 2 + k))
                    .await,
            );
        }
    }
    s.slots.wait_launched(2).await;
    let all: Vec<String> = heavy.iter().chain(&light).cloned().collect();
    let predicted = s.places(&all).await;
    assert_eq!(predicted.len(), 58, "two run, the rest wait");
    let place = |id: &String| predicted.iter().position(|p| p == id);
    let tenth_heavy = place(&heavy[9]).unwrap();
    for id in &light {
        assert!(
            place(id).is_some_and(|p| p < tenth_heavy),
            "a light user's run was placed after the heavy user's tenth: {predicted:?}"
        );
    }
    // The wait estimates grow along the queue (2 slots, the default estimate of 60 s each).
    let first = s.get(&predicted[0]).await;
    let last = s.get(predicted.last().unwrap()).await;
    let wait = |v: &Value| v["place"]["estimated_wait_s"].as_f64().unwrap();
    assert!((55.0..=60.0).contains(&wait(&first)), "{first}");
    assert!(
        (29.0 * 60.0 - 5.0..=29.0 * 60.0).contains(&wait(&last)),
        "{last}"
    );

    // Run them: each time a build ends, the next starts; an admin submission, sent while
    // everything waits, starts when the first slot frees.
    let admin = s.submit("organiser", Some("admin"), config(999)).await;
    let mut finished = 0;
    while finished < 61 {
        finished += 1;
        s.finish(finished).await;
        let want = (finished + 2).min(61);
        s.slots.wait_launched(want).await;
        // What still waits is reported where it is, in the order predicted.
        if finished % 10 == 0 {
            let left: Vec<String> = all
                .iter()
                .filter(|id| !s.slots.ids().contains(id))
                .cloned()
                .collect();
            assert!(predicted.ends_with(&s.places(&left).await));
        }
    }
    let started = s.slots.ids();
    assert_eq!(started.len(), 61);
    kernelkite_testkit::assert_fair_start_order(&started, &admin, &predicted, &heavy, &light);
    let mut ended = Vec::new();
    for id in started {
        ended.push(s.wait_ended(&id).await);
    }
    // The outcome, not only the order: while anything waited, both slots held a build.
    kernelkite_testkit::assert_no_slot_idles_while_work_waits(&ended, 2, 0.5);
    let metrics = s.metrics().await;
    assert!(
        metrics.contains(
            r#"kernelkite_queue_wait_seconds_count{queue="h100",class="admin",user_bucket="1"} 1"#
        ),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_over_a_quota_is_refused_with_429_and_when_it_frees() {
    let s = service(|c| {
        c.fair.cache = false;
        c.fair.queue_limits = kernelkite_service::dispatch::Limits::parse("*:queued=10").unwrap();
    })
    .await;
    let mut ids = Vec::new();
    for i in 0..9 {
        ids.push(s.submit("heavy", None, config(i)).await);
    }
    // The tenth with an idempotency key: its replay is answered as without quotas.
    let keyed = |n: usize| {
        s.http
            .post(format!("{}/v1/submissions", s.base))
            .header("idempotency-key", "heavy-10")
            .json(&json!({"config": config(n), "queue": "h100", "user": "heavy"}))
            .send()
    };
    let r = keyed(9).await.unwrap();
    assert_eq!(r.status().as_u16(), 202);
    let tenth: Value = r.json().await.unwrap();
    ids.push(tenth["id"].as_str().unwrap().to_string());
    let r = keyed(9).await.unwrap();
    assert_eq!(
        r.status().as_u16(),
        200,
        "a replay at the limit is its submission, not a 429"
    );
    assert_eq!(r.json::<Value>().await.unwrap()["id"], tenth["id"]);
    assert_eq!(
        keyed(99).await.unwrap().status().as_u16(),
        409,
        "the key with another request"
    );
    let r = s
        .post(json!({"config": config(10), "queue": "h100", "user": "heavy"}))
        .await;
    assert_eq!(r.status().as_u16(), 429);
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    let body: Value = r.json().await.unwrap();
    let msg = body["error"].as_str().unwrap();
    assert!(
        msg.contains("heavy") && msg.contains("10") && msg.contains("at once") && msg.contains("s"),
        "the message says which limit and when it frees: {msg}"
    );
    // Nothing of the refused one was kept: still ten of heavy's.
    let status = queue_status(&s.http, &s.base).await;
    assert_eq!(
        (status["waiting"].as_u64(), status["started"].as_u64()),
        (Some(8), Some(2)),
        "{status}"
    );
    assert_eq!(status["slots"], 2);
    // Other users are not limited by heavy's count, and heavy is again once one ends.
    s.submit("light", None, config(11)).await;
    s.slots.wait_launched(2).await;
    s.finish(1).await;
    s.wait_ended(&ids[0]).await;
    s.submit("heavy", None, config(12)).await;
    // A bad priority and a bad user are refused, not queued.
    for (k, v) in [
        ("priority", json!("boss")),
        ("user", json!("")),
        ("user", json!("a\nb")),
    ] {
        let mut body = json!({"config": config(13), "queue": "h100"});
        body[k] = v;
        let r = s.post(body).await;
        assert_eq!(r.status().as_u16(), 422, "{k}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_identical_test_run_is_answered_from_the_cache_and_a_ranked_run_is_not() {
    let s = service(|_| {}).await;
    let first = s.submit("a", None, config(1)).await;
    s.slots.wait_launched(1).await;
    s.finish(1).await;
    let original = s.wait_ended(&first).await;

    let again = s.submit("b", None, config(1)).await;
    let cached = s.get(&again).await;
    assert_eq!(cached["state"], "succeeded", "{cached}");
    assert_eq!(cached["cached_from"], first.as_str());
    assert_eq!(cached["result"], original["result"]);
    assert_eq!(s.slots.ids().len(), 1, "nothing ran");
    // Its events say so: queued, then succeeded with the cached result.
    let events = s
        .http
        .get(format!("{}/v1/submissions/{again}/events", s.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let names: Vec<&str> = events
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(names, ["queued", "succeeded"], "{events}");
    assert!(
        events.contains(&format!(r#""cached_from":"{first}""#)),
        "{events}"
    );

    // Turned off for the submission; a leaderboard run; another queue: each runs.
    let off = json!({"config": config(1), "queue": "h100", "cache": false});
    let r = s.post(off).await;
    assert_eq!(r.status().as_u16(), 202);
    let mut ranked = config(1);
    ranked["mode"] = json!("leaderboard");
    let ranked_id = s.submit("a", None, ranked.clone()).await;
    s.slots.wait_launched(3).await;
    s.finish(2).await;
    s.finish(3).await;
    s.wait_ended(&ranked_id).await;
    let ranked_again = s.submit("a", None, ranked).await;
    s.slots.wait_launched(4).await;
    assert!(s.get(&ranked_again).await["cached_from"].is_null());
    let metrics = s.metrics().await;
    assert!(
        metrics.contains(r#"kernelkite_cache_hits_total{queue="h100"} 1"#),
        "{metrics}"
    );
}

/// Issue 34: a user already at their `queued` quota sent 30 identical requests for a run with
/// an 8 MiB result; each was answered from the cache and stored a copy of the result (the
/// database grew 240 MiB). Now each answer refers to the run's result, and answers are
/// bounded per user (KERNELKITE_CACHE_HOURLY, here 20), across a restart too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "full tier (scripts/test.sh runs it): waits out timeouts and intervals of seconds"]
async fn cache_answers_keep_one_copy_of_the_result_and_are_bounded_per_user() {
    const MIB: usize = 1 << 20;
    let data = tempfile::tempdir().unwrap();
    let tweak = |c: &mut Config| {
        c.store.data_dir = Some(data.path().to_path_buf());
        c.fair.cache_hourly = kernelkite_service::dispatch::Most(Some(20));
        c.fair.queue_limits = kernelkite_service::dispatch::Limits::parse("*:queued=1").unwrap();
    };
    let s = service(tweak).await;
    s.slots
        .stdout_bytes
        .store(8 * MIB, std::sync::atomic::Ordering::SeqCst);
    let ran = s.submit("a", None, config(1)).await;
    s.slots.wait_launched(1).await;
    s.finish(1).await;
    let original = s.wait_ended(&ran).await;
    assert_eq!(
        original["result"]["runs"]["test"]["run"]["stdout"]
            .as_str()
            .map(str::len),
        Some(8 * MIB)
    );
    // The user "u" is at the queued quota (one run of theirs waits for a slot's end).
    s.submit("u", None, config(2)).await;
    let r = s
        .post(json!({"config": config(3), "queue": "h100", "user": "u"}))
        .await;
    assert_eq!(r.status().as_u16(), 429, "u is at queued=1");
    let before = store_bytes(data.path()).await;
    let mut answered = Vec::new();
    let mut refused = Vec::new();
    for _ in 0..30 {
        let r = s
            .post(json!({"config": config(1), "queue": "h100", "user": "u"}))
            .await;
        let status = r.status().as_u16();
        let retry_after = r.headers().get("retry-after").cloned();
        let v: Value = r.json().await.unwrap();
        match status {
            202 => answered.push(v["id"].as_str().unwrap().to_string()),
            429 => {
                assert!(retry_after.is_some(), "{v}");
                assert!(
                    v["error"]
                        .as_str()
                        .unwrap()
                        .contains("KERNELKITE_CACHE_HOURLY"),
                    "{v}"
                );
                refused.push(v);
            }
            other => panic!("{other}: {v}"),
        }
    }
    assert_eq!((answered.len(), refused.len()), (20, 10));
    let grown = store_bytes(data.path()).await.saturating_sub(before);
    assert!(
        grown < 8 * MIB as u64,
        "20 answers grew the store by {grown} bytes: more than one copy of the result"
    );
    // Each answer reads as the run's result, byte for byte.
    for id in [&answered[0], &answered[19]] {
        let v = s.get(id).await;
        assert_eq!(v["state"], "succeeded");
        assert_eq!(v["cached_from"], ran.as_str());
        assert_eq!(v["result"], original["result"], "{id}");
    }
    let metrics = s.metrics().await;
    assert!(
        metrics.contains(r#"kernelkite_quota_refusals_total{queue="h100",limit="cached"} 10"#),
        "{metrics}"
    );
    drop(s);
    // After a restart the hour's answers still count, and each still reads whole.
    let s = service(tweak).await;
    let r = s
        .post(json!({"config": config(1), "queue": "h100", "user": "u"}))
        .await;
    assert_eq!(r.status().as_u16(), 429, "the limit survived the restart");
    assert_eq!(s.get(&answered[5]).await["result"], original["result"]);
    // Another user is answered (the limit is per user).
    let other = s.submit("w", None, config(1)).await;
    assert_eq!(s.get(&other).await["cached_from"], ran.as_str());
}

/// A cache answer is written `queued`, then ended: a service killed between the two found it
/// pending at its restart, queued it first in line and ran it on a GPU. It is ended as it
/// would have been, from the run it repeats, and nothing runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_answer_interrupted_before_its_end_ends_from_its_run_after_a_restart() {
    use kernelkite_service::store::{NewSubmission, Sqlite, SyncMode};
    let data = tempfile::tempdir().unwrap();
    let tweak = |c: &mut Config| c.store.data_dir = Some(data.path().to_path_buf());
    let s = service(tweak).await;
    let ran = s.submit("a", None, config(1)).await;
    s.slots.wait_launched(1).await;
    s.finish(1).await;
    let original = s.wait_ended(&ran).await;
    drop(s);
    // What the killed service had written of the answer: its acceptance, nothing more.
    {
        let db = Sqlite::open(Some(data.path()), SyncMode::Normal, None).unwrap();
        let mut sub = kernelkite_service::submission::Submission::new(
            "00000000-0000-4000-8000-00000000cac4".into(),
            "h100".into(),
            None,
            None,
            600,
            chrono::Utc::now(),
        );
        sub.cached_from = Some(ran.clone());
        let job = s_job(&sub.id);
        db.insert(NewSubmission {
            sub,
            job,
            deadline_ms: chrono::Utc::now().timestamp_millis() + 600_000,
            idempotency: None,
            fair_tag: None,
            cache_key: None,
        })
        .await
        .unwrap();
    }
    let s = service(tweak).await;
    let answer = s.wait_ended("00000000-0000-4000-8000-00000000cac4").await;
    assert_eq!(answer["cached_from"], ran.as_str());
    assert_eq!(answer["result"], original["result"]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(s.slots.ids().is_empty(), "it ran: {:?}", s.slots.ids());
}

/// A job for a submission written straight to the store.
fn s_job(id: &str) -> kernelkite_service::executor::Job {
    kernelkite_service::executor::Job {
        submission_id: id.to_string(),
        run_id: id.to_string(),
        queue: "h100".into(),
        mode: "test".into(),
        payload: kernelkite_kernelbot::payload::encode(&config(1)).unwrap(),
        ranked: false,
        pin: None,
        pin_tags: Default::default(),
    }
}

/// Issue 34, item 10: the cache key leaves `timeout_s` out on purpose (a run's result does not
/// depend on it), but a run that succeeded within 600 s proves nothing for a request that
/// gives 60 s: it is answered only by a run that had no more time than it gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shorter_timeout_is_not_answered_by_a_run_that_had_longer() {
    let s = service(|_| {}).await;
    let body = |timeout: u64| json!({"config": config(1), "queue": "h100", "timeout_s": timeout});
    let r = s.post(body(600)).await;
    let ran: Value = r.json().await.unwrap();
    s.slots.wait_launched(1).await;
    s.finish(1).await;
    s.wait_ended(ran["id"].as_str().unwrap()).await;
    let shorter: Value = s.post(body(60)).await.json().await.unwrap();
    s.slots.wait_launched(2).await;
    let shorter = s.get(shorter["id"].as_str().unwrap()).await;
    assert!(shorter["cached_from"].is_null(), "it runs: {shorter}");
    for timeout in [600, 1200] {
        let v: Value = s.post(body(timeout)).await.json().await.unwrap();
        let v = s.get(v["id"].as_str().unwrap()).await;
        assert_eq!(v["cached_from"], ran["id"], "timeout_s {timeout}: {v}");
    }
}

/// Issue 34: a GET right after the 202 said `place: null` for 60-100 ms (until the place
/// publisher's pass). The 202 and every read after it carry the place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_202_and_the_first_read_carry_the_place() {
    let s = service(|c| {
        c.fair.cache = false;
        c.fair.queue_slots = kernelkite_service::dispatch::Slots::parse("h100=1").unwrap();
    })
    .await;
    // The first takes the slot: no place (it left the queue at once).
    let r = s
        .post(json!({"config": config(0), "queue": "h100", "user": "a"}))
        .await;
    let v: Value = r.json().await.unwrap();
    assert!(v["place"].is_null(), "{v}");
    for n in 1..=3u64 {
        let body = json!({"config": config(n as usize), "queue": "h100", "user": "a"});
        let r = s.post(body).await;
        assert_eq!(r.status().as_u16(), 202);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["place"]["position"].as_u64(), Some(n), "the 202: {v}");
        assert!(v["place"]["estimated_wait_s"].as_f64().is_some(), "{v}");
        let read = s.get(v["id"].as_str().unwrap()).await;
        assert_eq!(
            read["place"]["position"].as_u64(),
            Some(n),
            "the first GET: {read}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_keeps_its_order_and_counters_across_a_restart() {
    let data = tempfile::tempdir().unwrap();
    let tweak = |c: &mut Config| {
        c.fair.cache = false;
        c.store.data_dir = Some(data.path().to_path_buf());
        c.fair.queue_slots = kernelkite_service::dispatch::Slots::parse("h100=1").unwrap();
        c.fair.queue_limits =
            kernelkite_service::dispatch::Limits::parse("*:queued=3,hourly=4").unwrap();
    };
    let s = service(tweak).await;
    let mut ids = Vec::new();
    for (i, user) in ["u", "u", "u", "v", "v", "w"].into_iter().enumerate() {
        ids.push(s.submit(user, None, config(i)).await);
    }
    s.slots.wait_launched(1).await;
    let before = s.places(&ids).await;
    assert_eq!(before.len(), 5);
    drop(s);

    // Another service on the same data dir: the same places, the same counts.
    let s = service(tweak).await;
    let after = s.places(&ids).await;
    assert_eq!(after, before, "the queue's order survived the restart");
    // So did the class's clock: a new user starts beside the others' first runs (tag 0, after
    // them by arrival), not behind everything that waited before the restart.
    let x = s.submit("x", None, config(20)).await;
    let mut with_x = ids.clone();
    with_x.push(x.clone());
    let placed = s.places(&with_x).await;
    assert_eq!(placed.iter().position(|id| *id == x), Some(2), "{placed:?}");
    assert!(
        s.slots.ids().is_empty(),
        "nothing started twice: the one started holds the slot"
    );
    let r = s
        .post(json!({"config": config(10), "queue": "h100", "user": "u"}))
        .await;
    assert_eq!(r.status().as_u16(), 429, "u still has 3 queued");
    // The started one ends: its slot goes to the first in line.
    s.app
        .finish(&ids[0], Outcome::Failed("ended for the test".into()))
        .await
        .unwrap();
    s.slots.wait_launched(1).await;
    assert_eq!(s.slots.ids()[0], before[0]);
    s.submit("u", None, config(11)).await;
    // u cancels one: 2 queued, but 4 accepted this hour (3 of them before the restart).
    let r = s
        .http
        .post(format!("{}/v1/submissions/{}/cancel", s.base, ids[1]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let r = s
        .post(json!({"config": config(12), "queue": "h100", "user": "u"}))
        .await;
    assert_eq!(r.status().as_u16(), 429, "u's fifth this hour");
    let body: Value = r.json().await.unwrap();
    assert!(body["error"].as_str().unwrap().contains("hour"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queues_on_one_node_share_its_slots_and_one_line() {
    // An executor with slots of its own (local mode's slices) runs every queue on them:
    // slots for one queue name of it are a mistake, said at start.
    let mut cfg = Config::new("http://127.0.0.1:9/v2", "org", "pipe", "unused");
    cfg.fair.queue_slots = kernelkite_service::dispatch::Slots::parse("h100=1").unwrap();
    let node = Slots {
        node_slots: Some(2),
        ..Slots::default()
    };
    let refused = kernelkite_service::cli::serve::start(&cfg, Arc::new(node)).err();
    let e = kernelkite_service::report::report(&refused.expect("per-queue slots are refused"));
    assert!(e.contains("\"h100\"") && e.contains("local=N"), "{e}");
    let node = Slots {
        node_slots: Some(2),
        ..Slots::default()
    };
    let s = service_on(node, |c| {
        c.fair.cache = false;
        c.fair.queue_slots = kernelkite_service::dispatch::Slots::parse("").unwrap();
    })
    .await;
    let mut ids = Vec::new();
    for (i, (queue, user)) in [("h100", "a"), ("mi300", "b"), ("h100", "a"), ("mi300", "c")]
        .into_iter()
        .enumerate()
    {
        let body = json!({"config": config(i), "queue": queue, "user": user});
        let r = s.post(body).await;
        assert_eq!(r.status().as_u16(), 202);
        ids.push(
            r.json::<Value>().await.unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    s.slots.wait_launched(2).await;
    let waiting = s.places(&ids).await;
    assert_eq!(
        s.slots.ids(),
        [ids[0].clone(), ids[1].clone()],
        "two for the node"
    );
    assert_eq!(
        waiting,
        [ids[3].clone(), ids[2].clone()],
        "one line: c before a's second"
    );
    for queue in ["h100", "mi300"] {
        let r = s.http.get(format!("{}/v1/queues/{queue}", s.base)).send();
        let status: Value = r.await.unwrap().json().await.unwrap();
        assert_eq!(
            (&status["waiting"], &status["started"]),
            (&json!(2), &json!(2)),
            "{status}"
        );
    }
    // An h100 run ends: the first in the node's line starts, though it is an mi300 one.
    s.finish(1).await;
    s.slots.wait_launched(3).await;
    assert_eq!(s.slots.ids()[2], ids[3]);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(s.slots.ids().len(), 3, "still two at once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_s_measured_run_time_survives_a_restart() {
    let data = tempfile::tempdir().unwrap();
    let tweak = |c: &mut Config| {
        c.fair.cache = false;
        c.store.data_dir = Some(data.path().to_path_buf());
        c.fair.queue_slots = kernelkite_service::dispatch::Slots::parse("h100=1").unwrap();
    };
    let s = service(tweak).await;
    let first = s.submit("u", None, config(1)).await;
    s.slots.wait_launched(1).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    s.finish(1).await;
    s.wait_ended(&first).await;
    // The end is published a moment before the queue learns the run's time.
    let deadline = tokio::time::Instant::now() + WAIT;
    let measured = loop {
        let estimate = queue_status(&s.http, &s.base).await["estimated_run_s"]
            .as_f64()
            .unwrap();
        if estimate != 60.0 || tokio::time::Instant::now() > deadline {
            break estimate;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // The run's own time, from its submission: running to its end.
    let doc = s.get(&first).await;
    let at = |v: &Value| chrono::DateTime::parse_from_rfc3339(v.as_str().unwrap()).unwrap();
    let running = doc["history"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["state"] == "running")
        .map(|t| at(&t["at"]))
        .unwrap();
    let took = (at(&doc["finished_at"]) - running)
        .num_microseconds()
        .unwrap() as f64
        / 1e6;
    assert!(took >= 0.3, "{doc}");
    assert!((measured - took).abs() < 0.002, "{measured} vs {took}");
    drop(s);

    // The default (60 s) would say every place waits a minute per run ahead of it.
    let s = service(tweak).await;
    let status = queue_status(&s.http, &s.base).await;
    let restored = status["estimated_run_s"].as_f64().unwrap();
    assert!(
        (restored - measured).abs() < 0.002,
        "the estimate after the restart: {restored}, before: {measured}"
    );
    let ids = [
        s.submit("u", None, config(2)).await,
        s.submit("v", None, config(3)).await,
    ];
    s.slots.wait_launched(1).await;
    s.places(&ids).await;
    let waiting = s.get(&ids[1]).await;
    let wait = waiting["place"]["estimated_wait_s"].as_f64().unwrap();
    assert!(wait <= restored + 0.1, "{waiting}");
}

/// Reads SSE events (name, data, whether it had an `id:`) from `stream` until `until` holds
/// for the last one.
async fn read_events(
    stream: &mut reqwest::Response,
    buf: &mut String,
    until: impl Fn(&str, &Value) -> bool,
) -> Vec<(String, Value, bool)> {
    let mut out = Vec::new();
    loop {
        while let Some(end) = buf.find("\n\n") {
            let block: String = buf.drain(..end + 2).collect();
            let (mut name, mut data, mut id) = (String::new(), Value::Null, false);
            for line in block.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = n.to_string();
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = serde_json::from_str(d).unwrap();
                } else if line.starts_with("id: ") {
                    id = true;
                }
            }
            if name.is_empty() {
                continue;
            }
            let done = until(&name, &data);
            out.push((name, data, id));
            if done {
                return out;
            }
        }
        let chunk = tokio::time::timeout(WAIT, stream.chunk())
            .await
            .expect("an event in time")
            .unwrap()
            .expect("the stream goes on");
        buf.push_str(std::str::from_utf8(&chunk).unwrap());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_stream_tells_a_waiting_submission_its_place_as_it_moves() {
    let s = service(|c| {
        c.fair.cache = false;
        c.fair.queue_slots = kernelkite_service::dispatch::Slots::parse("h100=1").unwrap();
    })
    .await;
    s.submit("a", None, config(1)).await;
    s.slots.wait_launched(1).await;
    let b = s.submit("b", None, config(2)).await;
    let mut stream = s
        .http
        .get(format!("{}/v1/submissions/{b}/events", s.base))
        .send()
        .await
        .unwrap();
    let mut buf = String::new();
    let first = read_events(&mut stream, &mut buf, |n, _| n == "queue").await;
    let names: Vec<&str> = first.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(names, ["queued", "queue"]);
    let (_, place, had_id) = &first[1];
    assert!(
        !had_id,
        "a place is not part of the history Last-Event-ID counts"
    );
    assert_eq!(
        (place["id"].as_str(), place["position"].as_u64()),
        (Some(b.as_str()), Some(1))
    );
    assert!(place["estimated_wait_s"].as_f64().unwrap() > 0.0, "{place}");
    // An admin run goes ahead of it: b moves back to second.
    s.submit("org", Some("admin"), config(3)).await;
    let moved = read_events(&mut stream, &mut buf, |n, _| n == "queue").await;
    assert_eq!(moved.last().unwrap().1["position"], 2);
    // The running build ends: the admin run starts, b is next again; then b starts.
    s.finish(1).await;
    let moved = read_events(&mut stream, &mut buf, |n, _| n == "queue").await;
    assert_eq!(moved.last().unwrap().1["position"], 1);
    s.slots.wait_launched(2).await;
    s.finish(2).await;
    let rest = read_events(&mut stream, &mut buf, |n, _| n == "running").await;
    let names: Vec<&str> = rest.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(
        names,
        ["scheduled", "running"],
        "no place once it left the queue"
    );
}

/// Buildkite's agents are the queue's slots: none connected holds the queue in the service
/// (nothing is created in Buildkite); an agent that connects is used, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "full tier (scripts/test.sh runs it): waits out timeouts and intervals of seconds"]
async fn a_queue_s_connected_buildkite_agents_are_its_slots() {
    use kernelkite_testkit::fake_buildkite::FakeAgent;
    let h = kernelkite_testkit::harness::harness_with(|c| {
        // The harness turns the queue off for the other tests; this one uses the agents.
        c.fair.queue_slots = kernelkite_service::dispatch::Slots::default();
        // Below clap's floor of 60 s, so the test need not wait a minute for a new count.
        c.queues.agents_refresh_s = 1;
    })
    .await;
    let body = |n: usize| json!({"config": config(n), "queue": "h100", "user": "u"});
    let (first, _) = h.post(body(1)).await;
    let (second, _) = h.post(body(2)).await;
    assert_eq!((first, second), (202, 202));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        h.fake.build_count(),
        0,
        "no agent: the service holds the queue"
    );
    let status = queue_status(&h.http, &h.base).await;
    assert_eq!(
        (status["slots"].as_u64(), status["waiting"].as_u64()),
        (Some(0), Some(2)),
        "{status}"
    );
    h.fake
        .set_agents(vec![FakeAgent::new("gpu-0", "h100", false)]);
    // A fetch starts at the next pass over the queue (every 5 s) and the queue moves when it
    // ends.
    let number = h
        .fake
        .next_created(Duration::from_secs(8))
        .await
        .expect("a build once an agent connects");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(h.fake.build_count(), 1, "one agent, one build at a time");
    h.fake
        .finish_build(
            number,
            "passed",
            kernelkite_testkit::harness::result_artifact(),
        )
        .await;
    h.fake
        .next_created(WAIT)
        .await
        .expect("the second, once the first ended");
}

/// Issue 34: a token without `read_agents` is answered 403 on the agents list. That is an
/// answer, not an outage: the queue stops waiting for counts at once (it waited for three
/// failed fetches, one a minute: 123 s measured), and counts again when the scope comes.
#[tokio::test]
async fn a_token_refused_the_agents_list_does_not_hold_the_queue() {
    use kernelkite_testkit::fake_buildkite::{FakeAgent, Route};
    let h = kernelkite_testkit::harness::harness_with(|c| {
        c.fair.queue_slots = kernelkite_service::dispatch::Slots::default();
        c.queues.agents_refresh_s = 1;
    })
    .await;
    let forever = std::time::Instant::now() + Duration::from_secs(3600);
    h.fake.fail_route_until(Route::ListAgents, 403, forever);
    let body = |n: usize| json!({"config": config(n), "queue": "h100", "user": "u"});
    let sent = std::time::Instant::now();
    let (status, _) = h.post(body(1)).await;
    assert_eq!(status, 202);
    h.fake
        .next_created(Duration::from_secs(5))
        .await
        .expect("a build within seconds of a refused agents list, not minutes");
    let took = sent.elapsed();
    assert!(took < Duration::from_secs(5), "{took:?}");
    let status = queue_status(&h.http, &h.base).await;
    assert!(status["slots"].is_null(), "not limited: {status}");
    // The scope is added: the next fetch counts, and the queue is limited by its agents.
    h.fake
        .fail_route_until(Route::ListAgents, 403, std::time::Instant::now());
    h.fake
        .set_agents(vec![FakeAgent::new("gpu-0", "h100", true)]);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let status = queue_status(&h.http, &h.base).await;
        if status["slots"].as_u64() == Some(1) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{status}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "full tier (scripts/test.sh runs it): waits out timeouts and intervals of seconds"]
async fn the_cache_repeats_only_evaluations_that_ran_and_only_while_they_are_fresh() {
    let s = service(|c| c.fair.cache_max_age_s = 3).await;
    // A runner that could not evaluate is not repeated: the same run runs again.
    s.slots
        .runner_fails
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let failed = s.submit("a", None, config(1)).await;
    s.slots.wait_launched(1).await;
    s.finish(1).await;
    assert_eq!(s.wait_ended(&failed).await["result"]["success"], false);
    s.slots
        .runner_fails
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let ran = s.submit("a", None, config(1)).await;
    s.slots.wait_launched(2).await;
    s.finish(2).await;
    s.wait_ended(&ran).await;
    // An organiser's run is not answered from the cache unless it asks.
    let admin = s.submit("org", Some("admin"), config(1)).await;
    s.slots.wait_launched(3).await;
    s.finish(3).await;
    s.wait_ended(&admin).await;
    // Answered from the cache (by the newest run that succeeded: the organiser's); that
    // answer does not make the result younger: past the maximum age of the run itself (3 s),
    // the same run runs again.
    let hit = s.submit("b", None, config(1)).await;
    let hit = s.get(&hit).await;
    assert_eq!(hit["cached_from"], admin.as_str(), "{hit}");
    let ran_at = s.get(&admin).await["created_at"]
        .as_str()
        .unwrap()
        .to_string();
    let ran_at = chrono::DateTime::parse_from_rfc3339(&ran_at).unwrap();
    let old = ran_at + chrono::Duration::milliseconds(3_500);
    let left = (old - chrono::Utc::now().fixed_offset())
        .to_std()
        .unwrap_or_default();
    tokio::time::sleep(left).await;
    let fresh = s.submit("b", None, config(1)).await;
    s.slots.wait_launched(4).await;
    assert!(s.get(&fresh).await["cached_from"].is_null());
}

/// `GET /v1/queues/h100`.
async fn queue_status(http: &reqwest::Client, base: &str) -> Value {
    let r = http
        .get(format!("{base}/v1/queues/h100"))
        .send()
        .await
        .unwrap();
    r.json().await.unwrap()
}
