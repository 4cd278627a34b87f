//! Nothing lost, nothing exhausted: the real `kernelkite-service` binary over loopback against
//! the fake Buildkite (in this process), killed with SIGKILL at random points, with webhooks
//! lost, a create-build answer that never comes back, a callback receiver that is down, a
//! store that is damaged, unreadable or full, and a spent rate limit.
//!
//! Its own test binary: each test runs the service as a child process.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kernelkite_testkit::callback_receiver::{signature_valid, CallbackReceiver, Mode};
use kernelkite_testkit::fake_buildkite::{ArtifactSpec, FakeBuildkite, Fault, Route};
use kernelkite_testkit::harness::CALLBACK_SECRET;
use kernelkite_testkit::service_process::{Limits, ServiceProcess};
use kernelkite_testkit::{sample_config, sample_result_json, skip};
use serde_json::{json, Value};

const EXE: &str = env!("CARGO_BIN_EXE_kernelkite-service");

/// The result a build of `run_id` uploads: the sample with the run id as the host name, so
/// every submission's result is its own.
fn result_for(run_id: &str) -> ArtifactSpec {
    ArtifactSpec::result_json(sample_result_json().replace("gpu-node-1", run_id))
}

/// Plays Buildkite's agents: every build created runs for a random while, then finishes
/// `passed` with its own result (its webhooks go wherever the service is, or are lost when
/// it is down).
fn spawn_agents(fake: Arc<FakeBuildkite>, seed: u64) -> tokio::task::JoinHandle<()> {
    spawn_agents_for(fake, seed, 30..300)
}

/// [`spawn_agents`], each build running for a time drawn from `run_ms`.
fn spawn_agents_for(
    fake: Arc<FakeBuildkite>,
    seed: u64,
    run_ms: std::ops::Range<u64>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut rng = fastrand::Rng::with_seed(seed);
        while let Some(n) = fake.next_created(Duration::from_secs(120)).await {
            let ms = rng.u64(run_ms.clone());
            let fake = fake.clone();
            tokio::spawn(async move {
                let run_id = fake.build(n).unwrap()["meta_data"]["run_id"]
                    .as_str()
                    .unwrap()
                    .to_string();
                fake.start_build(n).await;
                tokio::time::sleep(Duration::from_millis(ms)).await;
                fake.finish_build(n, "passed", Some(result_for(&run_id)))
                    .await;
            });
        }
    })
}

/// What a client retries besides a connection error: the service's 503 when it talks to the
/// service itself.
const DIRECT: &[u16] = &[503];

/// The same behind a load balancer: also its 502 and 504 (haproxy's answer when the replica it
/// sent the request to died under it), as the Python client does (every 5xx is transient to
/// it; safe with an idempotency key).
const BALANCED: &[u16] = &[502, 503, 504];

/// Submits with an idempotency key, retrying through restarts and 503s until the service
/// answers; returns the submission id.
async fn submit_until_accepted(
    http: &reqwest::Client,
    base: &str,
    key: &str,
    body: &Value,
) -> String {
    submit_retrying(http, base, key, body, DIRECT).await
}

/// [`submit_until_accepted`], retrying the statuses in `retried`.
async fn submit_retrying(
    http: &reqwest::Client,
    base: &str,
    key: &str,
    body: &Value,
    retried: &[u16],
) -> String {
    submit_over(http, &[base.to_string()], &mut 0, key, body, retried).await
}

/// [`submit_retrying`] to the services at `bases`, starting at `bases[*at]` and moving on to
/// the next whenever one does not answer (refused, cut, a retried status); `at` is left at
/// the one that accepted.
async fn submit_over(
    http: &reqwest::Client,
    bases: &[String],
    at: &mut usize,
    key: &str,
    body: &Value,
    retried: &[u16],
) -> String {
    loop {
        match http
            .post(format!("{}/v1/submissions", bases[*at]))
            .header("Idempotency-Key", key)
            .json(body)
            .send()
            .await
        {
            Ok(r) if matches!(r.status().as_u16(), 200 | 202) => {
                let v: Value = r.json().await.unwrap();
                return v["id"].as_str().unwrap().to_string();
            }
            Ok(r) => assert!(
                retried.contains(&r.status().as_u16()),
                "{}: {:?}",
                r.status(),
                r.text().await
            ),
            Err(_) => {}
        }
        *at = (*at + 1) % bases.len();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Long-polls until the submission ended, through restarts; its final JSON.
/// The submission as `GET /v1/submissions/{id}` answers now.
async fn get_submission(http: &reqwest::Client, base: &str, id: &str) -> Value {
    http.get(format!("{base}/v1/submissions/{id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn long_poll(http: &reqwest::Client, base: &str, id: &str) -> Value {
    long_poll_over(http, &[base.to_string()], &mut 0, id).await
}

/// [`long_poll`] at the services at `bases`, starting at `bases[*at]` and moving on to the
/// next whenever one does not answer.
async fn long_poll_over(
    http: &reqwest::Client,
    bases: &[String],
    at: &mut usize,
    id: &str,
) -> Value {
    loop {
        if let Ok(r) = http
            .get(format!("{}/v1/submissions/{id}?wait=3", bases[*at]))
            .send()
            .await
        {
            if r.status() == 200 {
                if let Ok(v) = r.json::<Value>().await {
                    let terminal = matches!(
                        v["state"].as_str(),
                        Some("succeeded" | "failed" | "canceled" | "timed_out")
                    );
                    if terminal {
                        return v;
                    }
                    continue;
                }
            }
        }
        *at = (*at + 1) % bases.len();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Builds per submission id, from the builds' meta-data.
fn builds_per_submission(fake: &FakeBuildkite) -> HashMap<String, Vec<u64>> {
    let mut out: HashMap<String, Vec<u64>> = HashMap::new();
    for (n, meta) in fake.builds_meta() {
        if let Some(id) = meta["kernelkite_submission_id"].as_str() {
            out.entry(id.to_string()).or_default().push(n);
        }
    }
    out
}

/// `n` clients, the i-th submitting (key `key-i`, run id `run-i`, calling back to `callback`)
/// after `i * every_ms` and long-polling to the end through restarts: each gives back its run
/// id, submission id and final JSON.
fn spread_clients(
    http: &reqwest::Client,
    base: &str,
    callback: &str,
    n: usize,
    every_ms: u64,
    retried: &'static [u16],
) -> Vec<tokio::task::JoinHandle<(String, String, Value)>> {
    (0..n)
        .map(|i| {
            let (http, base, cb) = (http.clone(), base.to_string(), callback.to_string());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(i as u64 * every_ms)).await;
                let run_id = format!("run-{i}");
                let body = json!({"config": sample_config(), "queue": "h100", "run_id": run_id, "callback_url": cb});
                let id = submit_retrying(&http, &base, &format!("key-{i}"), &body, retried).await;
                let done = long_poll(&http, &base, &id).await;
                (run_id, id, done)
            })
        })
        .collect()
}

/// Waits (90 s at most) for every client of [`spread_clients`]: each submission succeeded
/// with its own result and run id, one per key (`n`). The submission ids, each with its run id.
async fn every_one_succeeded(
    clients: Vec<tokio::task::JoinHandle<(String, String, Value)>>,
    n: usize,
) -> BTreeMap<String, String> {
    let mut ids = BTreeMap::new();
    for c in clients {
        let (run_id, id, done) = tokio::time::timeout(Duration::from_secs(90), c)
            .await
            .expect("every client hears the end")
            .unwrap();
        assert_eq!(done["state"], "succeeded", "{run_id}: {done}");
        assert_eq!(
            done["result"]["system"]["hostname"], run_id,
            "{id} has another submission's result"
        );
        assert_eq!(done["run_id"], run_id);
        ids.insert(id, run_id);
    }
    assert_eq!(ids.len(), n, "one submission per idempotency key");
    ids
}

/// Exactly one build per submission of `ids`, and none for any other: no twins, none lost.
fn one_build_each<'a>(fake: &FakeBuildkite, ids: impl ExactSizeIterator<Item = &'a String>) {
    let builds = builds_per_submission(fake);
    let n = ids.len();
    for id in ids {
        assert_eq!(
            builds.get(id).map(Vec::len),
            Some(1),
            "{id}: builds {:?}",
            builds.get(id)
        );
    }
    assert_eq!(builds.len(), n);
}

fn log_file(dir: &tempfile::TempDir) -> std::path::PathBuf {
    dir.path().join("service.log")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_submissions_survive_kill_9_at_random_points() {
    survive_kill_9(None).await;
}

/// The same with the store in PostgreSQL, named as a Heroku-style platform names it (only
/// `DATABASE_URL`): each restart waits for the killed process's session to let go of the
/// schema's lock (the server notices at once) and reads everything back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_submissions_survive_kill_9_at_random_points_with_postgres() {
    let Some(url) = kernelkite_testkit::postgres::url() else {
        return;
    };
    survive_kill_9(Some((url, kernelkite_testkit::postgres::schema()))).await;
}

// Over 80 lines: one scenario (submissions at every stage, five kills, then every promise
// checked), shared by both stores.
async fn survive_kill_9(postgres: Option<(String, String)>) {
    const N: usize = 200;
    const KILLS: usize = 5;
    let fake = Arc::new(FakeBuildkite::start().await);
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let receiver = CallbackReceiver::start().await;
    // Slow answers, so kills land while callbacks are in flight.
    receiver.set_mode(Mode::Slow(Duration::from_millis(100)));
    let mut svc = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
    if let Some((url, schema)) = &postgres {
        svc.use_postgres(url, schema);
    }
    svc.set_env("KERNELKITE_RECONCILE_MIN_MS", "200");
    svc.set_env("KERNELKITE_RECONCILE_MAX_MS", "1000");
    svc.set_env("KERNELKITE_HTTP_TIMEOUT_S", "2");
    svc.start().await.unwrap();
    // Slow downloads, so kills land while results are being fetched.
    for _ in 0..40 {
        fake.inject(Route::Download, Fault::Delay(Duration::from_millis(150)));
    }
    // Slow creates, so kills land while builds are being created: some made and answered
    // late, some not made yet.
    for _ in 0..40 {
        fake.inject(
            Route::CreateBuild,
            Fault::DelayResponse(Duration::from_millis(300)),
        );
        fake.inject(Route::CreateBuild, Fault::Delay(Duration::from_millis(300)));
    }
    let agents = spawn_agents_for(fake.clone(), 7, 100..600);
    let started = Instant::now();
    let http = reqwest::Client::new();
    let base = svc.base.clone();
    // Spread over 2.4 s, so every kill lands among submissions at every stage.
    let clients = spread_clients(&http, &base, &receiver.url(), N, 12, DIRECT);
    let mut rng = fastrand::Rng::with_seed(42);
    for _ in 0..KILLS {
        tokio::time::sleep(Duration::from_millis(rng.u64(350..650))).await;
        svc.kill9().await;
        tokio::time::sleep(Duration::from_millis(rng.u64(0..150))).await;
        svc.start().await.unwrap();
    }
    let ids = every_one_succeeded(clients, N).await;
    let took = started.elapsed();
    one_build_each(&fake, ids.keys());
    // Every callback arrived at least once, signed, with the submission id as its key.
    let all_called = receiver
        .wait_for(Duration::from_secs(60), |d| {
            let mut seen = std::collections::HashSet::new();
            for x in d {
                if let Some(k) = &x.idempotency_key {
                    seen.insert(k.clone());
                }
            }
            ids.keys().all(|id| seen.contains(id))
        })
        .await;
    assert!(all_called, "some callbacks never arrived");
    for d in receiver.deliveries() {
        let key = d.idempotency_key.clone().unwrap();
        let v: Value = serde_json::from_slice(&d.body).unwrap();
        assert_eq!(v["id"], key);
        assert_eq!(v["state"], "succeeded");
        assert_eq!(v["result"]["system"]["hostname"], ids[&key]);
        assert!(signature_valid(
            CALLBACK_SECRET,
            d.signature.as_deref().unwrap_or_default(),
            &d.body,
            300
        ));
    }
    let deliveries = receiver.deliveries().len();
    // Where the kills landed, as the restarted service saw it.
    let log = svc.log_text();
    let count = |needle: &str| log.matches(needle).count();
    println!(
        "recovery: {} restarts reloaded unfinished submissions; {} builds of interrupted creates adopted, {} created after a restart; {} results collected after the reconciler found them; {} callback attempts failed and retried",
        count("reloading submissions that had not ended"),
        count("adopting the build an interrupted create made"),
        count("creating the build of an interrupted submission"),
        count("reconciler found a finished build"),
        count("callback failed; retrying"),
    );
    assert!(
        count("reloading submissions that had not ended") >= 3,
        "kills missed the submissions in flight: {log}"
    );
    if postgres.is_some() {
        assert_eq!(
            count("the store is in PostgreSQL"),
            KILLS + 1,
            "every start used PostgreSQL: {log}"
        );
    }
    assert!(
        count("adopting the build an interrupted create made")
            + count("creating the build of an interrupted submission")
            >= 1,
        "no kill landed while a build was being created: {log}"
    );
    println!(
        "{N} submissions, {KILLS} kill -9 restarts: all succeeded in {took:?}; {} builds; {deliveries} callback deliveries",
        fake.builds_meta().len()
    );
    agents.abort();
    svc.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_webhooks_are_reconciled_in_batched_listings() {
    const N: usize = 100;
    const MIN_MS: u64 = 300;
    const MAX_MS: u64 = 1200;
    let fake = Arc::new(FakeBuildkite::start().await);
    fake.drop_webhooks(0.3, 11);
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut svc = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
    svc.set_env("KERNELKITE_RECONCILE_MIN_MS", MIN_MS.to_string());
    svc.set_env("KERNELKITE_RECONCILE_MAX_MS", MAX_MS.to_string());
    svc.start().await.unwrap();
    let agents = spawn_agents(fake.clone(), 3);
    let http = reqwest::Client::new();
    let started = Instant::now();
    let mut clients = Vec::new();
    for i in 0..N {
        let (http, base) = (http.clone(), svc.base.clone());
        clients.push(tokio::spawn(async move {
            let body =
                json!({"config": sample_config(), "queue": "h100", "run_id": format!("run-{i}")});
            let id = submit_until_accepted(&http, &base, &format!("k{i}"), &body).await;
            let done = long_poll(&http, &base, &id).await;
            (i, done, Instant::now())
        }));
    }
    let mut last = started;
    for c in clients {
        let (i, done, at) = tokio::time::timeout(Duration::from_secs(60), c)
            .await
            .expect("finished")
            .unwrap();
        assert_eq!(done["state"], "succeeded", "{done}");
        assert_eq!(done["result"]["system"]["hostname"], format!("run-{i}"));
        last = last.max(at);
    }
    let elapsed = last - started;
    let dropped_finished = fake
        .dropped_webhooks()
        .iter()
        .filter(|(e, _)| e == "build.finished")
        .count();
    assert!(dropped_finished >= 15, "only {dropped_finished} dropped");
    let lists: Vec<_> = fake.requests_to(Route::ListBuilds);
    // Batched: the passes, not the builds, decide the calls. A pass runs at most once per
    // MIN_MS (while something is due), so the calls are bounded by time, and fewer than the
    // lost webhooks.
    let bound = (elapsed.as_millis() as u64 / MIN_MS) as usize + 2;
    println!(
        "{N} submissions, {dropped_finished} build.finished webhooks lost: all succeeded within {elapsed:?}; the reconciler spent {} list-builds calls (bound {bound})",
        lists.len()
    );
    assert!(!lists.is_empty());
    assert!(lists.len() <= bound, "{} listings > {bound}", lists.len());
    assert!(
        lists.len() < dropped_finished,
        "{} listings for {dropped_finished} lost webhooks: not batched",
        lists.len()
    );
    for l in &lists {
        let q = l.query.clone().unwrap_or_default();
        for part in [
            "state%5B%5D=passed",
            "finished_from=",
            "exclude_jobs=true",
            "exclude_pipeline=true",
            "per_page=100",
        ] {
            assert!(q.contains(part), "{part} not in {q}");
        }
    }
    agents.abort();
    svc.kill9().await;
}

#[tokio::test]
async fn a_create_that_times_out_after_buildkite_made_the_build_leaves_exactly_one_build() {
    let fake = Arc::new(FakeBuildkite::start().await);
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut svc = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
    svc.set_env("KERNELKITE_HTTP_TIMEOUT_S", "1");
    svc.set_env("KERNELKITE_CREATE_LOOKUP_DELAY_MS", "300");
    svc.start().await.unwrap();
    // Buildkite makes the build, then answers after the client gave up (and once, the
    // request is held before anything is made, so the client's lookup finds nothing).
    fake.inject(
        Route::CreateBuild,
        Fault::DelayResponse(Duration::from_millis(2500)),
    );
    let agents = spawn_agents(fake.clone(), 5);
    let http = reqwest::Client::new();
    let body = json!({"config": sample_config(), "queue": "h100", "run_id": "solo"});
    let id = submit_until_accepted(&http, &svc.base, "solo", &body).await;
    let done = long_poll(&http, &svc.base, &id).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    let builds = builds_per_submission(&fake);
    assert_eq!(builds[&id].len(), 1, "{builds:?}");
    let creates = fake.requests_to(Route::CreateBuild).len();
    assert_eq!(creates, 1, "the create was repeated");
    let log = svc.log_text();
    assert!(
        log.contains("no answer within KERNELKITE_HTTP_TIMEOUT_S"),
        "a timeout is named as one: {log}"
    );
    assert!(log.contains("adopted the build"), "{log}");

    // Held before Buildkite made anything: the lookup finds nothing, a second create makes
    // the one build.
    fake.inject(
        Route::CreateBuild,
        Fault::Delay(Duration::from_millis(2500)),
    );
    let body = json!({"config": sample_config(), "queue": "h100", "run_id": "second"});
    let id = submit_until_accepted(&http, &svc.base, "second", &body).await;
    let done = long_poll(&http, &svc.base, &id).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(builds_per_submission(&fake)[&id].len(), 1);
    agents.abort();
    svc.kill9().await;
}

#[tokio::test]
async fn callbacks_survive_a_receiver_outage_and_a_restart_and_arrive_signed() {
    let fake = Arc::new(FakeBuildkite::start().await);
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut receiver = CallbackReceiver::start().await;
    receiver.down();
    let mut svc = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
    svc.start().await.unwrap();
    let agents = spawn_agents(fake.clone(), 9);
    let http = reqwest::Client::new();
    let mut ids = Vec::new();
    for i in 0..5 {
        let body = json!({"config": sample_config(), "queue": "h100", "run_id": format!("cb-{i}"), "callback_url": receiver.url()});
        ids.push(submit_until_accepted(&http, &svc.base, &format!("cb-{i}"), &body).await);
    }
    let mut finals = HashMap::new();
    for id in &ids {
        finals.insert(id.clone(), long_poll(&http, &svc.base, id).await);
    }
    // Attempts fail while the receiver is down; the service is killed meanwhile.
    tokio::time::sleep(Duration::from_millis(400)).await;
    svc.kill9().await;
    svc.start().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    receiver.up().await;
    let all = receiver
        .wait_for(Duration::from_secs(30), |d| {
            ids.iter()
                .all(|id| d.iter().any(|x| x.idempotency_key.as_deref() == Some(id)))
        })
        .await;
    assert!(all, "callbacks lost: {:?}", receiver.deliveries());
    for d in receiver.deliveries() {
        let key = d.idempotency_key.clone().unwrap();
        assert!(signature_valid(
            CALLBACK_SECRET,
            d.signature.as_deref().unwrap_or_default(),
            &d.body,
            300
        ));
        let v: Value = serde_json::from_slice(&d.body).unwrap();
        assert_eq!(v, finals[&key], "the callback is the final submission");
    }
    let log = svc.log_text();
    assert!(log.contains("callback failed; retrying"), "{log}");
    agents.abort();
    svc.kill9().await;
}

#[tokio::test]
async fn a_damaged_or_unreadable_store_is_refused_at_start_with_what_to_do() {
    let fake = FakeBuildkite::start().await;
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    // Damaged: bytes that are not a database.
    std::fs::write(data.path().join("kernelkite.db"), vec![0x42u8; 16 * 1024]).unwrap();
    let mut svc = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
    let (code, log) = svc.run_to_exit(Duration::from_secs(20)).await;
    assert_eq!(code, Some(1), "{log}");
    assert!(
        log.contains("is corrupted") && log.contains("restore it from a backup"),
        "{log}"
    );
    assert_eq!(
        std::fs::read(data.path().join("kernelkite.db")).unwrap(),
        vec![0x42u8; 16 * 1024],
        "a damaged store is left as it was"
    );

    // Unreadable by the service's user.
    let data = tempfile::tempdir().unwrap();
    let mut svc = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
    svc.start().await.unwrap();
    svc.kill9().await;
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        data.path().join("kernelkite.db"),
        std::fs::Permissions::from_mode(0o000),
    )
    .unwrap();
    if root {
        // Root reads any file: run the service as nobody, which may enter the directory
        // but not read the file.
        std::fs::set_permissions(data.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        svc.limits = Limits {
            user: Some(65534),
            ..Limits::default()
        };
    }
    let (code, log) = svc.run_to_exit(Duration::from_secs(20)).await;
    assert_eq!(code, Some(1), "{log}");
    assert!(
        log.contains("cannot open the store") && log.contains("readable and writable"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_new_submissions_and_loses_nothing_acknowledged() {
    let fake = Arc::new(FakeBuildkite::start().await);
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut svc = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
    svc.start().await.unwrap();
    svc.kill9().await;
    // The files may not grow past 160 KiB: a full disk, for this process only.
    let base_size = std::fs::metadata(data.path().join("kernelkite.db"))
        .unwrap()
        .len();
    svc.limits = Limits {
        file_size: Some(base_size.max(32 * 1024) + 160 * 1024),
        ..Limits::default()
    };
    if let Err(e) = svc.start().await {
        skip(format!(
            "the service does not start under RLIMIT_FSIZE here: {e}"
        ));
        return;
    }
    let http = reqwest::Client::new();
    let mut accepted = Vec::new();
    let mut refused = None;
    for i in 0..2000 {
        let r = http
            .post(format!("{}/v1/submissions", svc.base))
            .json(
                &json!({"config": sample_config(), "queue": "h100", "run_id": format!("full-{i}")}),
            )
            .send()
            .await
            .unwrap();
        match r.status().as_u16() {
            202 => accepted.push(
                r.json::<Value>().await.unwrap()["id"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            ),
            503 => {
                refused = Some(r.json::<Value>().await.unwrap());
                break;
            }
            s => panic!("{s}: {:?}", r.text().await),
        }
    }
    let refused = refused.expect("the store filled up");
    let msg = refused["error"].as_str().unwrap();
    assert!(
        msg.contains("free disk space") && msg.contains("nothing was kept"),
        "{msg}"
    );
    assert!(!accepted.is_empty());
    // Builds finish while the store is full: an end that fits in the pages the files hold
    // commits, the others cannot. Nobody may hear "succeeded" for an end that is not kept.
    let agents = spawn_agents(fake.clone(), 13);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut told = Vec::new();
    for id in &accepted {
        let v = get_submission(&http, &svc.base, id).await;
        if v["state"] == "succeeded" {
            told.push(v);
        }
    }
    eprintln!(
        "{} of {} acknowledged submissions ended while the store was full",
        told.len(),
        accepted.len()
    );
    // Space again: restart without the limit; everything acknowledged is there and finishes.
    svc.kill9().await;
    svc.limits = Limits::default();
    svc.set_env("KERNELKITE_RECONCILE_MIN_MS", "200");
    svc.start().await.unwrap();
    for id in &accepted {
        let v = tokio::time::timeout(Duration::from_secs(60), long_poll(&http, &svc.base, id))
            .await
            .expect("finished after the restart");
        assert_eq!(v["state"], "succeeded", "{v}");
    }
    // What was told is what was kept: the same end, not a second one after the restart.
    for v in &told {
        let id = v["id"].as_str().unwrap();
        let now = get_submission(&http, &svc.base, id).await;
        assert_eq!(now["finished_at"], v["finished_at"], "told {v}, kept {now}");
    }
    // Nothing was made for the refused submission: one build per accepted one.
    let builds = builds_per_submission(&fake);
    assert_eq!(builds.len(), accepted.len(), "{builds:?}");
    assert!(builds.values().all(|b| b.len() == 1));
    agents.abort();
    svc.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spent_rate_limit_queues_submissions_then_runs_them_all() {
    const N: usize = 8;
    let fake = Arc::new(FakeBuildkite::start().await);
    // 8 calls a second: 8 submissions need 24.
    fake.set_rate_limit(1_000_000, 8, Duration::from_secs(1));
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut svc = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
    svc.start().await.unwrap();
    let agents = spawn_agents(fake.clone(), 17);
    let http = reqwest::Client::new();
    let mut ids = Vec::new();
    for i in 0..N {
        let body = json!({"config": sample_config(), "queue": "h100", "run_id": format!("rl-{i}")});
        ids.push(submit_until_accepted(&http, &svc.base, &format!("rl-{i}"), &body).await);
    }
    // A 429 first: the budget learns the window from it.
    fake.inject(Route::ListArtifacts, Fault::RateLimited { reset_s: 1 });
    let mut queued_seen = false;
    for id in &ids {
        let v = get_submission(&http, &svc.base, id).await;
        queued_seen |= v["state"] == "queued";
    }
    for id in &ids {
        let v = tokio::time::timeout(Duration::from_secs(60), long_poll(&http, &svc.base, id))
            .await
            .expect("finished");
        assert_eq!(v["state"], "succeeded", "{v}");
    }
    assert!(queued_seen, "no submission waited for the budget");
    let statuses: Vec<u16> = fake
        .requests()
        .iter()
        .filter(|r| r.route.is_api())
        .map(|r| r.status)
        .collect();
    let limited = statuses.iter().filter(|s| **s == 429).count();

    println!(
        "{N} submissions under 8 calls/s: {} API calls, {limited} answered 429",
        statuses.len()
    );
    // The budget waits for the reset instead of earning 429s.
    assert!(limited <= 2, "{limited} 429s in {statuses:?}");
    agents.abort();
    svc.kill9().await;
}

#[tokio::test]
async fn zero_timeouts_and_limits_are_refused_at_start() {
    let fake = FakeBuildkite::start().await;
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    for var in [
        "KERNELKITE_HTTP_TIMEOUT_S",
        "KERNELKITE_MAX_SUBMISSION_BYTES",
    ] {
        let mut svc = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
        svc.set_env(var, "0");
        let (code, log) = svc.run_to_exit(Duration::from_secs(20)).await;
        assert_eq!(code, Some(1), "{var}: {log}");
        assert!(log.contains(&format!("{var} must be at least 1")), "{log}");
    }
}

/// A replica needs what replicas share: refused, saying what to set, on SQLite (a data dir), as
/// a standby at once, or with the local executor (whose builds run on its own machine); nothing
/// is served or written.
#[tokio::test]
async fn a_replica_without_postgresql_as_a_standby_or_with_the_local_executor_is_refused() {
    let fake = FakeBuildkite::start().await;
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    // (with PostgreSQL, also a standby, the command, what it says)
    let cases = [
        (
            false,
            false,
            "serve",
            "KERNELKITE_REPLICA needs the store in PostgreSQL",
        ),
        (true, true, "serve", "cannot be used with"),
        (
            true,
            false,
            "local",
            "KERNELKITE_REPLICA runs with the Buildkite executor only",
        ),
    ];
    for (postgres, standby, command, says) in cases {
        let mut svc = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
        svc.set_env("KERNELKITE_REPLICA", "true");
        if postgres {
            // Nothing answers there: refused before any connection.
            svc.use_postgres("postgres://kk@127.0.0.1:9/kk", "kernelkite");
        }
        if standby {
            svc.set_env("KERNELKITE_STANDBY", "true");
        }
        svc.set_args(&[command]);
        let (code, log) = svc.run_to_exit(Duration::from_secs(20)).await;
        assert!(matches!(code, Some(1 | 2)), "{says}: {code:?} {log}");
        assert!(log.contains(says), "{says}: {log}");
        assert!(!log.contains("listening"), "nothing served: {log}");
    }
}

#[tokio::test]
async fn deadlines_hold_across_a_restart_while_buildkite_is_down() {
    let fake = Arc::new(FakeBuildkite::start().await);
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut svc = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
    svc.start().await.unwrap();
    // Buildkite answers nothing but 503 for a long while: no build can be created or found.
    fake.fail_api_until(Instant::now() + Duration::from_secs(600));
    let http = reqwest::Client::new();
    let mut ids = Vec::new();
    for i in 0..3 {
        let body = json!({"config": sample_config(), "queue": "h100", "run_id": format!("dl-{i}"), "timeout_s": 3});
        ids.push(submit_until_accepted(&http, &svc.base, &format!("dl-{i}"), &body).await);
    }
    let accepted = Instant::now();
    tokio::time::sleep(Duration::from_millis(500)).await;
    svc.kill9().await;
    svc.start().await.unwrap();
    for id in &ids {
        let v = tokio::time::timeout(Duration::from_secs(20), long_poll(&http, &svc.base, id))
            .await
            .expect("the deadline ends it");
        assert_eq!(v["state"], "timed_out", "{v}");
        assert_eq!(v["timeout_s"], 3);
    }
    let took = accepted.elapsed();
    // The absolute deadline was kept through the restart, not started again.
    assert!(took < Duration::from_secs(6), "ended after {took:?}");
    assert!(builds_per_submission(&fake).is_empty());
    svc.kill9().await;
}

/// Issue 21, item 1: two service processes on one data directory would both recover its
/// in-flight submissions and create their builds again. The second one refuses to start,
/// naming the first; the first goes on, and every submission has exactly one build.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_service_on_the_same_data_dir_refuses_to_start_and_names_the_first() {
    let fake = Arc::new(FakeBuildkite::start().await);
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut first = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
    first.start().await.unwrap();
    let http = reqwest::Client::new();
    let mut ids = Vec::new();
    for i in 0..3 {
        let body =
            json!({"config": sample_config(), "queue": "h100", "run_id": format!("two-{i}")});
        ids.push(submit_until_accepted(&http, &first.base, &format!("two-{i}"), &body).await);
    }
    while fake.build_count() < 3 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut second = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
    let (code, log) = second.run_to_exit(Duration::from_secs(30)).await;
    assert_ne!(code, Some(0), "the second service ran: {log}");
    assert!(code.is_some(), "the second service did not exit: {log}");
    let first_pid = first.pid().expect("the first runs");
    assert!(
        log.contains("is in use by another kernelkite-service")
            && log.contains(&format!("pid {first_pid} on ")),
        "{log}"
    );
    // Nothing was created twice, and the first still serves.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(fake.build_count(), 3);
    assert!(builds_per_submission(&fake).values().all(|n| n.len() == 1));
    let r = http
        .get(format!("{}/v1/submissions/{}", first.base, ids[0]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // Once the first is gone (even killed), the lock goes with it: a new one starts.
    first.kill9().await;
    let mut third = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
    third.start().await.unwrap();
    third.kill9().await;
}

/// Issue 21, item 4: the database file deleted, or overwritten with garbage, while the service
/// runs. Before, `/healthz` said 200 and submissions were acknowledged into a file that was
/// gone (404 after a restart). Now the health check and every later write answer 503, saying
/// what happened, until an operator restores the file and restarts the service.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_deleted_or_overwritten_while_serving_turns_health_and_writes_to_503() {
    let fake = Arc::new(FakeBuildkite::start().await);
    for damage in ["delete", "overwrite"] {
        let data = tempfile::tempdir().unwrap();
        let logs = tempfile::tempdir().unwrap();
        let mut svc = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
        svc.start().await.unwrap();
        let http = reqwest::Client::new();
        let body =
            json!({"config": sample_config(), "queue": "h100", "run_id": format!("{damage}-0")});
        submit_until_accepted(&http, &svc.base, &format!("{damage}-0"), &body).await;
        let db = data.path().join("kernelkite.db");
        match damage {
            "delete" => std::fs::remove_file(&db).unwrap(),
            _ => {
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new().write(true).open(&db).unwrap();
                f.write_all(&[0x5a; 4096]).unwrap();
            }
        }
        let health = http
            .get(format!("{}/healthz", svc.base))
            .send()
            .await
            .unwrap();
        let status = health.status().as_u16();
        let text = health.text().await.unwrap();
        assert_eq!(status, 503, "{damage}: {text}");
        let said = if damage == "delete" {
            "was deleted"
        } else {
            "was overwritten"
        };
        assert!(text.contains(said), "{damage}: {text}");
        let r = http
            .post(format!("{}/v1/submissions", svc.base))
            .json(&json!({"config": sample_config(), "queue": "h100", "run_id": format!("{damage}-1")}))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        assert_eq!(
            status,
            503,
            "{damage}: a write was acknowledged: {}",
            r.text().await.unwrap()
        );
        svc.kill9().await;
    }
}

/// Issue 34: garbage written into the store's file past its header (its first page intact)
/// went unnoticed while serving: `/healthz` stayed 200 and submissions were acknowledged into a
/// file the next start refused as malformed, so they were lost until a restore. The service
/// now checks the file's pages on disk (KERNELKITE_STORE_CHECK_S; SQLite's quick_check) and
/// every statement's error: within the interval `/healthz` and every write turn 503 for good,
/// saying what SQLite found and what to do, and nothing is acknowledged after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_damaged_past_its_header_while_serving_turns_health_and_writes_to_503() {
    let fake = Arc::new(FakeBuildkite::start().await);
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut svc = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
    svc.set_env("KERNELKITE_STORE_CHECK_S", "1");
    svc.start().await.unwrap();
    let http = reqwest::Client::new();
    // Enough rows that the file has pages past the first, copied from the WAL into it.
    for i in 0..40 {
        let key = format!("dmg-{i}");
        let body = json!({"config": sample_config(), "queue": "h100", "run_id": key});
        submit_until_accepted(&http, &svc.base, &key, &body).await;
    }
    let db = data.path().join("kernelkite.db");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::metadata(&db).unwrap().len() < 5 * 4096 {
        assert!(Instant::now() < deadline, "the rows never reached the file");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let health = http
        .get(format!("{}/healthz", svc.base))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status().as_u16(), 200);
    {
        use std::io::{Seek, Write};
        let mut f = std::fs::OpenOptions::new().write(true).open(&db).unwrap();
        f.seek(std::io::SeekFrom::Start(4096)).unwrap();
        f.write_all(&vec![0x5a; 4 * 4096]).unwrap();
    }
    let damaged_at = Instant::now();
    let text = loop {
        let health = http
            .get(format!("{}/healthz", svc.base))
            .send()
            .await
            .unwrap();
        let status = health.status().as_u16();
        let text = health.text().await.unwrap();
        if status == 503 {
            break text;
        }
        assert!(
            damaged_at.elapsed() < Duration::from_secs(5),
            "healthz still {status} {:?} after the damage: {text}",
            damaged_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(text.contains("was found damaged"), "{text}");
    assert!(text.contains("Restart the service"), "{text}");
    assert!(text.contains("restore the last backup"), "{text}");
    for i in 0..3 {
        let r = http
            .post(format!("{}/v1/submissions", svc.base))
            .json(&json!({"config": sample_config(), "queue": "h100", "run_id": format!("after-{i}")}))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        assert_eq!(status, 503, "acknowledged into a damaged store: {text}");
        assert!(text.contains("was found damaged"), "{text}");
    }
    assert!(
        svc.log_text().contains("the store is damaged"),
        "{}",
        svc.log_text()
    );
    svc.kill9().await;
}

/// Issue 21, item 10: `kernelkite-service backup` copies the live store while submissions
/// keep arriving and finishing, and the documented restore (the copy as `kernelkite.db` of an
/// empty data directory) brings back every submission acknowledged before the backup began.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backup_taken_under_load_restores_every_acknowledged_submission() {
    let fake = Arc::new(FakeBuildkite::start().await);
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut svc = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
    svc.start().await.unwrap();
    let agents = spawn_agents_for(fake.clone(), 21, 5..50);
    let http = reqwest::Client::new();
    // Load: a submitter that never stops while the backup runs.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let acked = Arc::new(std::sync::Mutex::new(Vec::<(Instant, String)>::new()));
    let load = {
        let (stop, acked, http, base) =
            (stop.clone(), acked.clone(), http.clone(), svc.base.clone());
        tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let key = format!("bk-{i}");
                let body = json!({"config": sample_config(), "queue": "h100", "run_id": key});
                let id = submit_until_accepted(&http, &base, &key, &body).await;
                acked.lock().unwrap().push((Instant::now(), id));
                i += 1;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(800)).await;
    let copy = logs.path().join("backup.db");
    let began = Instant::now();
    let out = tokio::process::Command::new(EXE)
        .arg("backup")
        .arg("--data-dir")
        .arg(data.path())
        .arg("--to")
        .arg(&copy)
        .env_clear()
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("backed up"), "{said}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    load.await.unwrap();
    let before: Vec<String> = acked
        .lock()
        .unwrap()
        .iter()
        .filter(|(at, _)| *at < began)
        .map(|(_, id)| id.clone())
        .collect();
    assert!(before.len() >= 3, "too little load: {}", before.len());
    // A second backup never replaces the first.
    let again = std::process::Command::new(EXE)
        .args(["backup", "--data-dir"])
        .arg(data.path())
        .arg("--to")
        .arg(&copy)
        .env_clear()
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("exists"));
    svc.kill9().await;
    agents.abort();

    // The documented restore: the copy as kernelkite.db of an empty data directory.
    let restored = tempfile::tempdir().unwrap();
    std::fs::copy(&copy, restored.path().join("kernelkite.db")).unwrap();
    let mut svc = ServiceProcess::new(EXE, &fake, restored.path(), log_file(&logs));
    svc.start().await.unwrap();
    for id in &before {
        let r = http
            .get(format!("{}/v1/submissions/{id}", svc.base))
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.status().as_u16(),
            200,
            "{id} acknowledged before the backup is lost"
        );
    }
    svc.kill9().await;
}

/// Issue 21, item 12: a flood of webhooks for builds the service does not know, past its
/// early-event buffer, is logged as a few lines, not one per event; and background work (a
/// build's creation) logs under its own span, not the request's that started it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropped_events_are_logged_a_few_times_and_background_work_logs_under_its_own_span() {
    use kernelkite_testkit::fake_buildkite::{unix_now, FAKE_API_TOKEN};
    use kernelkite_testkit::harness::WEBHOOK_TOKEN;
    let fake = Arc::new(FakeBuildkite::start().await);
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut svc = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
    svc.set_env("KERNELKITE_EARLY_EVENT_MAX", "1");
    svc.start().await.unwrap();
    let http = reqwest::Client::new();
    // Builds the service never made (created straight through the API).
    let mut numbers = Vec::new();
    for i in 0..30 {
        let b: Value = http
            .post(format!(
                "{}/organizations/kernelkite/pipelines/submissions/builds",
                fake.api_url()
            ))
            .bearer_auth(FAKE_API_TOKEN)
            .json(&json!({"commit": "HEAD", "branch": "main", "message": format!("stranger {i}")}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        numbers.push(b["number"].as_u64().unwrap());
    }
    for n in numbers {
        let (headers, body) = fake
            .signed_event("build.finished", n, WEBHOOK_TOKEN, unix_now())
            .unwrap();
        let mut req = http.post(format!("{}/webhooks/buildkite", svc.base));
        for (k, v) in headers {
            req = req.header(k, v);
        }
        let r = req
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.status());
    }
    // A submission whose build cannot be made: its failure is logged by the launch task.
    fake.inject(Route::CreateBuild, Fault::Status(422));
    let body = json!({"config": sample_config(), "queue": "h100", "run_id": "span-1"});
    let id = submit_until_accepted(&http, &svc.base, "span-1", &body).await;
    let v = tokio::time::timeout(Duration::from_secs(20), long_poll(&http, &svc.base, &id))
        .await
        .unwrap();
    assert_eq!(v["state"], "failed", "{v}");
    svc.kill9().await;
    let log = svc.log_text();
    let drops = log.matches("early-event buffer is full").count();
    assert!(
        (1..=2).contains(&drops),
        "{drops} lines about dropped events:\n{log}"
    );
    let failed: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("build creation failed"))
        .collect();
    assert!(!failed.is_empty(), "{log}");
    for line in failed {
        assert!(line.contains("submission{"), "{line}");
        assert!(
            !line.contains("request{"),
            "logged under the request's span: {line}"
        );
    }
}

/// Two replicas on one PostgreSQL schema behind a load balancer (the test's, routing as
/// haproxy does with a health check): the first serves, the second stands by serving nothing.
/// The serving one is killed with SIGKILL, the one that took over is stopped with SIGTERM (a
/// rolling upgrade's step), and the one that took over then is frozen with SIGSTOP; each time
/// the other takes over within 10 s, through the same address, and the frozen one, let go on,
/// exits (status 75) instead of acting on what it held. Every submission ends
/// exactly once, with one build each, its own result, and its callback delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_replica_takes_over_from_one_killed_one_stopped_and_one_frozen() {
    const N: usize = 120;
    let Some(url) = kernelkite_testkit::postgres::url() else {
        return;
    };
    let schema = kernelkite_testkit::postgres::schema();
    let fake = Arc::new(FakeBuildkite::start().await);
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let receiver = CallbackReceiver::start().await;
    let replica =
        |name: &str| standby_replica(&fake, data.path(), &logs.path().join(name), &url, &schema);
    let (mut a, mut b) = (replica("a.log"), replica("b.log"));
    let lb = kernelkite_testkit::balancer::Balancer::start(&[a.base.clone(), b.base.clone()]).await;
    webhooks_to(&fake, &lb.base);
    a.start().await.unwrap();
    b.spawn().unwrap();
    b.standing_by().await;
    assert!(
        reqwest::get(format!("{}/healthz", b.base)).await.is_err(),
        "a standby serves nothing"
    );
    let agents = spawn_agents_for(fake.clone(), 3, 100..600);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let clients = spread_clients(&http, &lb.base, &receiver.url(), N, 40, BALANCED);
    // The serving replica dies.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    a.kill9().await;
    let after_kill = took_over(&mut b, "a killed replica").await;
    a.spawn().unwrap();
    a.standing_by().await;
    // A rolling upgrade: the serving one is stopped (SIGTERM) with the other standing by.
    tokio::time::sleep(Duration::from_millis(800)).await;
    b.signal(libc::SIGTERM);
    let after_stop = took_over(&mut a, "a stopped replica").await;
    assert_eq!(
        b.exited(Duration::from_secs(10)).await,
        Some(0),
        "a stopped replica ends cleanly: {}",
        b.log_text()
    );
    b.spawn().unwrap();
    b.standing_by().await;
    // The replica that took over freezes: its database session stays open.
    tokio::time::sleep(Duration::from_millis(800)).await;
    a.signal(libc::SIGSTOP);
    let after_freeze = took_over(&mut b, "a frozen replica").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    a.signal(libc::SIGCONT);
    let code = a.exited(Duration::from_secs(10)).await;
    assert!(
        a.log_text().contains("last beat to the database was"),
        "the frozen one stopped itself: {}",
        a.log_text()
    );
    println!(
        "took over {after_kill:?} after a kill -9, {after_stop:?} after a SIGTERM, {after_freeze:?} after a SIGSTOP; the frozen one, let go on, exited with {code:?}"
    );
    assert_eq!(
        code,
        Some(75),
        "a replica that was taken over stops: {}",
        a.log_text()
    );

    let ids = every_one_succeeded(clients, N).await;
    one_build_each(&fake, ids.keys());
    let all_called = receiver
        .wait_for(Duration::from_secs(60), |d| {
            let seen: std::collections::HashSet<_> =
                d.iter().filter_map(|x| x.idempotency_key.clone()).collect();
            ids.keys().all(|id| seen.contains(id))
        })
        .await;
    assert!(all_called, "some callbacks never arrived");
    agents.abort();
    b.kill9().await;
}

/// A service on PostgreSQL (`url`, `schema`) in the role `role` names
/// (`KERNELKITE_STANDBY` or `KERNELKITE_REPLICA`) behind the fake Buildkite, logging to `log`,
/// with quick reconciles and Buildkite calls.
fn on_postgres_as(
    role: &str,
    fake: &FakeBuildkite,
    data: &std::path::Path,
    log: &std::path::Path,
    url: &str,
    schema: &str,
) -> ServiceProcess {
    let mut svc = ServiceProcess::new(EXE, fake, data, log.to_path_buf());
    svc.use_postgres(url, schema);
    svc.set_env(role, "true");
    svc.set_env("KERNELKITE_RECONCILE_MIN_MS", "200");
    svc.set_env("KERNELKITE_RECONCILE_MAX_MS", "1000");
    svc.set_env("KERNELKITE_HTTP_TIMEOUT_S", "2");
    svc
}

/// A standby (`KERNELKITE_STANDBY`): [`on_postgres_as`].
fn standby_replica(
    fake: &FakeBuildkite,
    data: &std::path::Path,
    log: &std::path::Path,
    url: &str,
    schema: &str,
) -> ServiceProcess {
    on_postgres_as("KERNELKITE_STANDBY", fake, data, log, url, schema)
}

/// Points the fake's webhooks at `base` (a load balancer in front of the replicas).
fn webhooks_to(fake: &FakeBuildkite, base: &str) {
    fake.set_webhook(
        format!("{base}/webhooks/buildkite"),
        kernelkite_testkit::fake_buildkite::Signing::Hmac(
            kernelkite_testkit::harness::WEBHOOK_TOKEN.into(),
        ),
    );
}

/// How long `standby` took to serve once the replica it stood by for (`what`) went, which
/// must be within the issue's 10 s.
async fn took_over(standby: &mut ServiceProcess, what: &str) -> Duration {
    let t = Instant::now();
    standby
        .ready(Duration::from_secs(10))
        .await
        .unwrap_or_else(|e| panic!("the standby did not take over from {what}: {e}"));
    t.elapsed()
}

/// A service on PostgreSQL stopped (SIGSTOP) for longer than its beat may be old, with no
/// standby to take over, stops itself when let go on: it cannot know whether another took the
/// schema meanwhile, so it exits (75) for its supervisor to start it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_frozen_past_its_beat_stops_itself_when_let_go_on() {
    use kernelkite_service::store::postgres::SELF_FENCE_AFTER;
    let Some(url) = kernelkite_testkit::postgres::url() else {
        return;
    };
    let fake = FakeBuildkite::start().await;
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut svc = ServiceProcess::new(EXE, &fake, data.path(), log_file(&logs));
    svc.use_postgres(&url, &kernelkite_testkit::postgres::schema());
    svc.start().await.unwrap();
    svc.signal(libc::SIGSTOP);
    tokio::time::sleep(SELF_FENCE_AFTER + Duration::from_millis(500)).await;
    svc.signal(libc::SIGCONT);
    let code = svc.exited(Duration::from_secs(10)).await;
    let log = svc.log_text();
    assert_eq!(code, Some(75), "{log}");
    assert!(log.contains("last beat to the database was"), "{log}");
}

/// `deployment/service/haproxy.cfg`, as shipped (only its addresses made this machine's),
/// run by the real haproxy in front of two replicas (`KERNELKITE_REPLICA`) on PostgreSQL: it
/// passes haproxy's own check and spreads requests over both; the one running the queue is
/// killed, and the one that took over is frozen; every submission made through it ends once,
/// with one build each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_haproxy_config_spreads_over_replicas_through_a_kill_and_a_freeze() {
    const N: usize = 30;
    let Some(url) = kernelkite_testkit::postgres::url() else {
        return;
    };
    let haproxy = std::process::Command::new("haproxy").arg("-v").output();
    if !haproxy.is_ok_and(|o| o.status.success()) {
        skip("haproxy is not installed (Debian's haproxy package; the test command installs it)");
        return;
    }
    let schema = kernelkite_testkit::postgres::schema();
    let fake = Arc::new(FakeBuildkite::start().await);
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let receiver = CallbackReceiver::start().await;
    // Requests reach the replicas from haproxy: the deployment sets the API token.
    const TOKEN: &str = "kk-ha-test-token";
    let replica = |name: &str| {
        let mut svc = replica(&fake, data.path(), &logs.path().join(name), &url, &schema);
        svc.set_env("KERNELKITE_API_TOKEN", TOKEN);
        svc
    };
    let (mut a, mut b) = (replica("a.log"), replica("b.log"));
    let port = kernelkite_testkit::service_process::free_port();
    let shipped = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deployment/service/haproxy.cfg"),
    )
    .unwrap();
    let addr = |base: &str| base.trim_start_matches("http://").to_string();
    for named in ["bind :8080", " replica-a:8080", " replica-b:8080"] {
        assert_eq!(
            shipped.matches(named).count(),
            1,
            "the shipped file names {named:?} once: {shipped}"
        );
    }
    let cfg = shipped
        .replace("bind :8080", &format!("bind 127.0.0.1:{port}"))
        .replace(" replica-a:8080", &format!(" {}", addr(&a.base)))
        .replace(" replica-b:8080", &format!(" {}", addr(&b.base)));
    let cfg_file = logs.path().join("haproxy.cfg");
    std::fs::write(&cfg_file, &cfg).unwrap();
    let checked = std::process::Command::new("haproxy")
        .arg("-c")
        .arg("-f")
        .arg(&cfg_file)
        .output()
        .unwrap();
    assert!(
        checked.status.success(),
        "haproxy refuses the shipped configuration: {}",
        String::from_utf8_lossy(&checked.stderr)
    );
    let haproxy_log = std::fs::File::create(logs.path().join("haproxy.log")).unwrap();
    let _haproxy = tokio::process::Command::new("haproxy")
        .arg("-db")
        .arg("-f")
        .arg(&cfg_file)
        .stdout(haproxy_log.try_clone().unwrap())
        .stderr(haproxy_log)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let lb = format!("http://127.0.0.1:{port}");
    webhooks_to(&fake, &lb);
    a.start().await.unwrap();
    until_runs_queue(&a, Duration::from_secs(20)).await;
    b.start().await.unwrap();
    let mut auth = reqwest::header::HeaderMap::new();
    auth.insert(
        reqwest::header::AUTHORIZATION,
        format!("Bearer {TOKEN}").parse().unwrap(),
    );
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .default_headers(auth)
        .build()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !http
        .get(format!("{lb}/healthz"))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
    {
        assert!(Instant::now() < deadline, "haproxy never sent to a replica");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let agents = spawn_agents_for(fake.clone(), 5, 100..400);
    let clients = spread_clients(&http, &lb, &receiver.url(), N, 100, BALANCED);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let spread = std::fs::read_to_string(logs.path().join("haproxy.log")).unwrap();
    assert!(
        spread.contains("replicas/replica-a") && spread.contains("replicas/replica-b"),
        "haproxy sends requests to both replicas: {spread}"
    );
    a.kill9().await;
    until_runs_queue(&b, Duration::from_secs(10)).await;
    a.start().await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    b.signal(libc::SIGSTOP);
    until_runs_queue(&a, Duration::from_secs(10)).await;
    b.signal(libc::SIGCONT);
    assert_eq!(b.exited(Duration::from_secs(10)).await, Some(75));
    let ids = every_one_succeeded(clients, N).await;
    one_build_each(&fake, ids.keys());
    agents.abort();
    a.kill9().await;
}

/// A replica (`KERNELKITE_REPLICA`), serving from its start: [`on_postgres_as`].
fn replica(
    fake: &FakeBuildkite,
    data: &std::path::Path,
    log: &std::path::Path,
    url: &str,
    schema: &str,
) -> ServiceProcess {
    on_postgres_as("KERNELKITE_REPLICA", fake, data, log, url, schema)
}

/// What a replica logs when it starts, and when it takes the lock and runs the queue.
const SERVING_AS_REPLICA: &str = "serving as a replica";
const RUNS_QUEUE: &str = "this replica holds the schema's lock and runs the queue";

/// Whether the replica's current process runs the queue (its log is appended to by each
/// start).
fn runs_queue(svc: &ServiceProcess) -> bool {
    let log = svc.log_text();
    log.rfind(RUNS_QUEUE) > log.rfind(SERVING_AS_REPLICA)
}

/// Waits (`within`) until the replica's current process runs the queue.
async fn until_runs_queue(svc: &ServiceProcess, within: Duration) -> Duration {
    let t = Instant::now();
    while !runs_queue(svc) {
        assert!(
            t.elapsed() < within,
            "the replica did not take over within {within:?}: {}",
            svc.log_text()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    t.elapsed()
}

/// Reads `GET {base}/v1/submissions/{id}/events` until its terminal event; the text.
async fn events_until_end(http: reqwest::Client, base: String, id: String) -> String {
    let mut r = http
        .get(format!("{base}/v1/submissions/{id}/events"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut text = String::new();
    while let Some(chunk) = r.chunk().await.unwrap() {
        text.push_str(&String::from_utf8_lossy(&chunk));
        if ["succeeded", "failed", "canceled", "timed_out"]
            .iter()
            .any(|s| text.contains(&format!("event: {s}\n")))
        {
            break;
        }
    }
    text
}

/// Three replicas on one PostgreSQL schema, every guarantee as one process gives it,
/// whichever replica answers: a user over a quota is refused however their submissions are
/// spread; an idempotency key sent to two replicas at once makes one submission; light users
/// start before the heavy user's tenth run; a webhook received by one replica finishes the
/// long-poll and the event stream held on another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_keep_quotas_keys_and_the_fair_order_and_wake_each_others_waiters() {
    let Some(url) = kernelkite_testkit::postgres::url() else {
        return;
    };
    let schema = kernelkite_testkit::postgres::schema();
    let fake = Arc::new(FakeBuildkite::start().await);
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut r: Vec<ServiceProcess> = ["a", "b", "c"]
        .iter()
        .map(|n| {
            let mut svc = replica(
                &fake,
                data.path(),
                &logs.path().join(format!("{n}.log")),
                &url,
                &schema,
            );
            svc.set_env("KERNELKITE_QUEUE_SLOTS", "h100=2");
            svc.set_env("KERNELKITE_QUEUE_LIMITS", "*:queued=20");
            svc.set_env("KERNELKITE_CACHE", "false");
            svc
        })
        .collect();
    r[0].start().await.unwrap();
    until_runs_queue(&r[0], Duration::from_secs(20)).await;
    for svc in &mut r[1..] {
        svc.start().await.unwrap();
    }
    assert!(
        !runs_queue(&r[1]) && !runs_queue(&r[2]),
        "one runs the queue"
    );
    let (b, c) = (r[1].base.clone(), r[2].base.clone());
    // Buildkite's webhooks reach replica c only.
    webhooks_to(&fake, &c);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let submit = |base: String, user: String, key: String, i: usize| {
        let http = http.clone();
        async move {
            let body = json!({"config": sample_config(), "queue": "h100", "run_id": format!("run-{i}"), "user": user});
            let r = http
                .post(format!("{base}/v1/submissions"))
                .header("Idempotency-Key", key)
                .json(&body)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }
    };
    // The heavy user sends 24 at once, spread over b and c: the quota (20 waiting or running)
    // admits exactly 20.
    let heavy_sent: Vec<_> = (0..24)
        .map(|i| {
            let base = if i % 2 == 0 { b.clone() } else { c.clone() };
            tokio::spawn(submit(base, "heavy".into(), format!("heavy-{i}"), i))
        })
        .collect();
    let mut heavy = Vec::new();
    let mut refused = 0;
    for h in heavy_sent {
        match h.await.unwrap() {
            (202, v) => heavy.push(v["id"].as_str().unwrap().to_string()),
            (429, _) => refused += 1,
            other => panic!("{other:?}: {}", r[0].log_text()),
        }
    }
    assert_eq!(
        (heavy.len(), refused),
        (20, 4),
        "the quota holds across replicas"
    );
    // One key sent to two replicas at once: one submission.
    let (x, y) = tokio::join!(
        submit(b.clone(), "light0".into(), "twice".into(), 100),
        submit(c.clone(), "light0".into(), "twice".into(), 100)
    );
    assert_eq!(x.1["id"], y.1["id"], "{x:?} {y:?}");
    let mut light = vec![x.1["id"].as_str().unwrap().to_string()];
    for u in 0..5 {
        for k in 0..2 {
            if (u, k) == (0, 0) {
                continue;
            }
            let base = if k == 0 { b.clone() } else { c.clone() };
            let (status, v) = submit(
                base,
                format!("light{u}"),
                format!("light-{u}-{k}"),
                101 + u * 2 + k,
            )
            .await;
            assert_eq!(status, 202, "{v}");
            light.push(v["id"].as_str().unwrap().to_string());
        }
    }
    // Every light submission is long-polled on replica b, and the last one's event stream
    // followed there too.
    let polls: Vec<_> = light
        .iter()
        .map(|id| {
            let (http, b, id) = (http.clone(), b.clone(), id.clone());
            tokio::spawn(async move {
                let v = http
                    .get(format!("{b}/v1/submissions/{id}?wait=60"))
                    .send()
                    .await
                    .unwrap()
                    .json::<Value>()
                    .await
                    .unwrap();
                (Instant::now(), v)
            })
        })
        .collect();
    let followed = light.last().unwrap().clone();
    let stream = tokio::spawn(events_until_end(http.clone(), b.clone(), followed.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The test plays the agents: each build runs as it is created, one at a time; its
    // webhooks go to replica c.
    let total = heavy.len() + light.len();
    let mut finished_at = HashMap::new();
    for _ in 0..total {
        let n = fake
            .next_created(Duration::from_secs(30))
            .await
            .expect("every submission's build is created");
        let run_id = fake.build(n).unwrap()["meta_data"]["run_id"]
            .as_str()
            .unwrap()
            .to_string();
        fake.start_build(n).await;
        let sent = Instant::now();
        assert_eq!(
            fake.finish_build(n, "passed", Some(result_for(&run_id)))
                .await,
            Some(200),
            "replica c took the webhook"
        );
        finished_at.insert(run_id, sent);
    }
    // Each long-poll on b ended with its own result, woken by the database's notification:
    // well within the second after which b would read it again anyway.
    let mut woken = Vec::new();
    for p in polls {
        let (at, done) = tokio::time::timeout(Duration::from_secs(30), p)
            .await
            .expect("the long-poll on b ended")
            .unwrap();
        assert_eq!(done["state"], "succeeded", "{done}");
        let run_id = done["run_id"].as_str().unwrap();
        assert_eq!(done["result"]["system"]["hostname"], run_id);
        woken.push(at.duration_since(finished_at[run_id]));
    }
    woken.sort();
    println!("webhook on c -> long-poll on b answered: {woken:?}");
    assert!(
        woken[woken.len() / 2] < Duration::from_millis(200),
        "the waiters on b were not woken by the notifications: {woken:?}"
    );
    let events = tokio::time::timeout(Duration::from_secs(30), stream)
        .await
        .expect("the event stream on b ended")
        .unwrap();
    assert!(events.contains("event: running\n"), "{events}");
    assert!(events.contains("run-110"), "{events}");
    // Start order, from the builds' numbers: every light user's before the heavy user's tenth.
    let started: HashMap<String, u64> = builds_per_submission(&fake)
        .into_iter()
        .map(|(id, n)| (id, n[0]))
        .collect();
    assert_eq!(started.len(), total, "one build each");
    let mut heavy_starts: Vec<u64> = heavy.iter().map(|id| started[id]).collect();
    heavy_starts.sort();
    for id in &light {
        assert!(
            started[id] < heavy_starts[9],
            "{id} started at build {} after the heavy user's tenth ({})",
            started[id],
            heavy_starts[9]
        );
    }
    // Only the replica running the queue decided anything.
    for svc in &r[1..] {
        assert!(
            !svc.log_text().contains("submission accepted"),
            "{}",
            svc.log_text()
        );
    }
    assert!(r[0].log_text().contains("submission accepted"));
}

/// A PostgreSQL server of the test's own (`scripts/postgres.sh`), so it can be restarted
/// without touching the server the other tests share; stopped when dropped.
struct PrivatePostgres {
    dir: tempfile::TempDir,
    url: String,
}

const POSTGRES_SH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/postgres.sh");

impl PrivatePostgres {
    fn start() -> PrivatePostgres {
        let dir = tempfile::tempdir().unwrap();
        let url = postgres_sh("start", dir.path()).trim().to_string();
        PrivatePostgres { dir, url }
    }

    fn restart(&self) {
        postgres_sh("restart", self.dir.path());
    }
}

/// `scripts/postgres.sh COMMAND DIR`, which must succeed; its output.
fn postgres_sh(command: &str, dir: &std::path::Path) -> String {
    let out = std::process::Command::new(POSTGRES_SH)
        .arg(command)
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        // Not asserted: a drop during a failing test's unwinding must not panic again.
        let _ = std::process::Command::new(POSTGRES_SH)
            .arg("stop")
            .arg(self.dir.path())
            .output();
    }
}

/// `n` clients of users `user0`..`user5`, the i-th starting after `i * every_ms` at replica
/// `i % 3` and moving on to the next replica whenever one does not answer (refused, cut, a
/// 503, a timeout): each submits with its own key and long-polls to the end. Each gives back
/// its run id, submission id and final JSON.
fn clients_over_replicas(
    http: &reqwest::Client,
    bases: &[String],
    callback: &str,
    n: usize,
    every_ms: u64,
) -> Vec<tokio::task::JoinHandle<(String, String, Value)>> {
    (0..n)
        .map(|i| {
            let (http, bases, cb) = (http.clone(), bases.to_vec(), callback.to_string());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(i as u64 * every_ms)).await;
                let mut at = i % bases.len();
                let run_id = format!("run-{i}");
                let body = json!({"config": sample_config(), "queue": "h100", "run_id": run_id, "callback_url": cb, "user": format!("user{}", i % 6)});
                let key = format!("key-{i}");
                let id = submit_over(&http, &bases, &mut at, &key, &body, DIRECT).await;
                let done = long_poll_over(&http, &bases, &mut at, &id).await;
                (run_id, id, done)
            })
        })
        .collect()
}

/// The index of the replica whose current process runs the queue, waiting for one (10 s at
/// most: the issue's bound on a take-over); and how long that took.
async fn queue_runner(r: &[ServiceProcess], skip: Option<usize>) -> (usize, Duration) {
    let t = Instant::now();
    loop {
        if let Some(i) =
            (0..r.len()).find(|&i| Some(i) != skip && r[i].running() && runs_queue(&r[i]))
        {
            return (i, t.elapsed());
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no replica took over within 10 s: {}",
            r.iter()
                .map(ServiceProcess::log_text)
                .collect::<Vec<_>>()
                .join("\n----\n")
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Issue 38's multi-replica suite: three replicas on one PostgreSQL, 300 submissions from six
/// users spread over them, while the replica running the queue is killed (SIGKILL), then one
/// not running it, the one that took over is frozen (SIGSTOP) for 20 s, and PostgreSQL itself
/// is restarted; every
/// replica that ends is started again, as a supervisor would. Every submission ends once with
/// its own result and one build, every callback arrives, and the frozen replica, let go on,
/// stops itself without acting on the lock it lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hundred_submissions_over_three_replicas_survive_a_kill_a_freeze_and_a_database_restart(
) {
    const N: usize = 300;
    if kernelkite_testkit::postgres::url().is_none() {
        return;
    }
    let pg = PrivatePostgres::start();
    let schema = kernelkite_testkit::postgres::schema();
    let fake = Arc::new(FakeBuildkite::start().await);
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let receiver = CallbackReceiver::start().await;
    let mut r: Vec<ServiceProcess> = ["a", "b", "c"]
        .iter()
        .map(|n| {
            replica(
                &fake,
                data.path(),
                &logs.path().join(format!("{n}.log")),
                &pg.url,
                &schema,
            )
        })
        .collect();
    r[0].start().await.unwrap();
    until_runs_queue(&r[0], Duration::from_secs(20)).await;
    for svc in &mut r[1..] {
        svc.start().await.unwrap();
    }
    let bases: Vec<String> = r.iter().map(|s| s.base.clone()).collect();
    let lb = kernelkite_testkit::balancer::Balancer::start(&bases).await;
    webhooks_to(&fake, &lb.base);
    let agents = spawn_agents_for(fake.clone(), 38, 100..600);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let clients = clients_over_replicas(&http, &bases, &receiver.url(), N, 40);

    // The replica running the queue is killed, and started again.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    r[0].kill9().await;
    let (second, after_kill) = queue_runner(&r, Some(0)).await;
    r[0].start().await.unwrap();
    // A replica not running the queue is killed with requests in flight, and started again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let follower = (0..3).find(|&i| i != second).unwrap();
    r[follower].kill9().await;
    r[follower].start().await.unwrap();
    // The one that took over freezes for 20 s: another takes over meanwhile.
    tokio::time::sleep(Duration::from_millis(500)).await;
    r[second].signal(libc::SIGSTOP);
    let (third, after_freeze) = queue_runner(&r, Some(second)).await;
    tokio::time::sleep(Duration::from_secs(20).saturating_sub(after_freeze)).await;
    r[second].signal(libc::SIGCONT);
    let code = r[second].exited(Duration::from_secs(10)).await;
    assert_eq!(code, Some(75), "{}", r[second].log_text());
    r[second].start().await.unwrap();
    // PostgreSQL restarts: the replica running the queue loses its lock and ends; one takes
    // over once the server is back.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    pg.restart();
    let code = r[third].exited(Duration::from_secs(10)).await;
    assert_eq!(code, Some(75), "{}", r[third].log_text());
    r[third].start().await.unwrap();
    let (_, after_restart) = queue_runner(&r, None).await;
    println!(
        "took over {after_kill:?} after a kill -9, {after_freeze:?} after a SIGSTOP, {after_restart:?} after PostgreSQL came back"
    );

    let ids = every_one_succeeded(clients, N).await;
    one_build_each(&fake, ids.keys());
    let all_called = receiver
        .wait_for(Duration::from_secs(60), |d| {
            let seen: std::collections::HashSet<_> =
                d.iter().filter_map(|x| x.idempotency_key.clone()).collect();
            ids.keys().all(|id| seen.contains(id))
        })
        .await;
    assert!(all_called, "some callbacks never arrived");
    agents.abort();
}

/// What a replica not running the queue writes to the database is only what the core would
/// take from that client directly, and never a credential: an unknown path or method, a
/// request without the API token and a webhook without a valid signature are answered by the
/// replica itself and leave nothing in the relay table; a request it relays carries its
/// verdict, not the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_relays_nothing_unchecked_and_no_credential() {
    const TOKEN: &str = "kk-replica-secret-token";
    let Some(url) = kernelkite_testkit::postgres::url() else {
        return;
    };
    let schema = kernelkite_testkit::postgres::schema();
    let fake = Arc::new(FakeBuildkite::start().await);
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut r: Vec<ServiceProcess> = ["a", "b"]
        .iter()
        .map(|n| {
            let mut svc = replica(
                &fake,
                data.path(),
                &logs.path().join(format!("{n}.log")),
                &url,
                &schema,
            );
            svc.set_env("KERNELKITE_API_TOKEN", TOKEN);
            svc
        })
        .collect();
    r[0].start().await.unwrap();
    until_runs_queue(&r[0], Duration::from_secs(20)).await;
    r[1].start().await.unwrap();
    let b = r[1].base.clone();
    // Everything ever written to the relay table is kept aside for the test to read.
    let mut db = <sqlx::PgConnection as sqlx::Connection>::connect(&url)
        .await
        .unwrap();
    for stmt in [
        format!("CREATE TABLE {schema}.seen (uri TEXT, headers TEXT, body BYTEA)"),
        format!(
            "CREATE FUNCTION {schema}.keep_seen() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN INSERT INTO {schema}.seen VALUES (NEW.uri, NEW.headers, NEW.body); RETURN NULL; END $$"
        ),
        format!(
            "CREATE TRIGGER keep_seen AFTER INSERT ON {schema}.relayed \
             FOR EACH ROW EXECUTE FUNCTION {schema}.keep_seen()"
        ),
    ] {
        sqlx::query(&stmt).execute(&mut db).await.unwrap();
    }
    // A connection per request: one the replica closed after a refusal (before reading the
    // body) is never reused for the next request.
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let big = "x".repeat(64 << 10);
    let signed_badly = {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert(
            "x-buildkite-signature",
            format!(
                "timestamp={},signature=00ff",
                chrono::Utc::now().timestamp()
            )
            .parse()
            .unwrap(),
        );
        h.insert("x-buildkite-event", "build.finished".parse().unwrap());
        h
    };
    let refused = [
        (http.post(format!("{b}/x")).body(big.clone()), 404),
        (
            http.post(format!("{b}/v1/elsewhere")).body(big.clone()),
            404,
        ),
        // The client guard answers first, as the core's routes do.
        (http.delete(format!("{b}/v1/submissions")), 401),
        (
            http.post(format!("{b}/v1/submissions"))
                .json(&json!({"config": sample_config(), "queue": "h100"})),
            401,
        ),
        (http.get(format!("{b}/v1/queues/h100")), 401),
        (
            http.post(format!("{b}/webhooks/buildkite"))
                .body(big.clone()),
            401,
        ),
        (
            http.post(format!("{b}/webhooks/buildkite"))
                .headers(signed_badly)
                .body(big.clone()),
            401,
        ),
    ];
    for (req, status) in refused {
        match req.send().await {
            Ok(resp) => assert_eq!(resp.status().as_u16(), status, "{:?}", resp.text().await),
            // Refused before its body was read: the replica answered and closed the
            // connection while the client was still sending (hyper's IncompleteMessage).
            Err(e) => assert!(e.is_request(), "{e:?}"),
        }
    }
    let health = http.get(format!("{b}/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200, "the replica still serves");
    let seen_count = format!("SELECT COUNT(*) FROM {schema}.seen");
    let count: i64 = sqlx::query_scalar(&seen_count)
        .fetch_one(&mut db)
        .await
        .unwrap();
    assert_eq!(count, 0, "nothing refused reached the database");
    // A request with the token is relayed, with the verdict and without the token; its body
    // is dropped from the table once the core took it.
    let resp = http
        .post(format!("{b}/v1/submissions"))
        .bearer_auth(TOKEN)
        .header("Idempotency-Key", "relayed-1")
        .json(&json!({"config": sample_config(), "queue": "h100", "run_id": "run-r"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 202, "{:?}", resp.text().await);
    let resp = http
        .get(format!("{b}/v1/queues/h100"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let seen: Vec<(String, String)> =
        sqlx::query_as(&format!("SELECT uri, headers FROM {schema}.seen"))
            .fetch_all(&mut db)
            .await
            .unwrap();
    assert_eq!(seen.len(), 2, "{seen:?}");
    for (uri, headers) in &seen {
        assert!(!headers.contains(TOKEN), "{uri}: {headers}");
        assert!(
            !headers.to_lowercase().contains("authorization"),
            "{uri}: {headers}"
        );
    }
    let left: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {schema}.relayed"))
        .fetch_one(&mut db)
        .await
        .unwrap();
    assert_eq!(left, 0, "answered requests leave the table");
    // A key that is not text is refused, not dropped (its retries would each make one).
    let resp = http
        .post(format!("{b}/v1/submissions"))
        .bearer_auth(TOKEN)
        .header(
            "Idempotency-Key",
            reqwest::header::HeaderValue::from_bytes(b"k\xe9y").unwrap(),
        )
        .json(&json!({"config": sample_config(), "queue": "h100"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let count: i64 = sqlx::query_scalar(&seen_count)
        .fetch_one(&mut db)
        .await
        .unwrap();
    assert_eq!(count, 2);
}
