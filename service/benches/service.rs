//! kernelkite-service benchmark: completion latency, API calls per submission, webhook ingest
//! and memory per pending submission, each next to the prototype's strategy (poll the build
//! every 10 s) run against the same fake Buildkite in the same process; and, with the durable
//! store (SQLite on disk) in the path: submissions/s the store sustains, memory with 100,000
//! finished submissions, and the reconciler's API calls per minute per 1,000 pending.
//!
//! `cargo bench -p kernelkite-service --bench service` (full); `KERNELKITE_BENCH_SHORT=1` for
//! the CI-sized run. Figures are printed; docs/BENCHMARKS.md records them.

use kernelkite_testkit::harness as common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kernelkite_service::buildkite::artifact;
use kernelkite_service::buildkite::{BuildkiteClient, NewBuild};
use kernelkite_service::store::{Durable, NewSubmission};
use kernelkite_service::submission::{BuildInfo, State, Submission};
use kernelkite_service::Config;
use kernelkite_testkit::fake_buildkite::{
    signature_header, unix_now, ArtifactSpec, FakeBuildkite, FAKE_API_TOKEN, FAKE_ORG,
    FAKE_PIPELINE,
};
use kernelkite_testkit::{sample_config, sample_result_json};
use serde_json::{json, Value};

/// Counts live heap bytes, for memory per pending submission.
struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every method forwards to the system allocator with the caller's arguments unchanged
// and only adds atomic bookkeeping, so System's guarantees carry over.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = System.alloc(l);
        if !p.is_null() {
            LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(l);
        if !p.is_null() {
            LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l);
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = System.realloc(p, l, new);
        if !q.is_null() {
            LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The prototype polled every 10 s; the scaled run polls every 10 s / SCALE.
const PROTOTYPE_POLL: Duration = Duration::from_secs(10);
const SCALE: u32 = 100;

struct Sizes {
    latency_n: usize,
    polling_n: usize,
    count_jobs: usize,
    pending: usize,
    burst: usize,
    store_n: usize,
    finished_n: usize,
    reconcile_pending: usize,
    reconcile_minutes: u32,
    /// Store sizes the page check is timed on, MiB.
    check_mib: &'static [u64],
}

fn main() {
    let short = std::env::var("KERNELKITE_BENCH_SHORT").is_ok_and(|v| v == "1");
    let sizes = if short {
        Sizes {
            latency_n: 200,
            polling_n: 200,
            count_jobs: 5,
            pending: 2_000,
            burst: 50,
            store_n: 2_000,
            finished_n: 5_000,
            reconcile_pending: 1_000,
            reconcile_minutes: 5,
            check_mib: &[16],
        }
    } else {
        Sizes {
            latency_n: 1000,
            polling_n: 1000,
            count_jobs: 20,
            pending: 100_000,
            burst: 200,
            store_n: 50_000,
            finished_n: 100_000,
            reconcile_pending: 1_000,
            reconcile_minutes: 10,
            check_mib: &[16, 128],
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "# kernelkite-service benchmark ({} mode, {} CPUs)",
        if short { "short" } else { "full" },
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    rt.block_on(latency(&sizes));
    rt.block_on(call_counts(&sizes));
    rt.block_on(store_throughput(&sizes));
    rt.block_on(store_page_check(&sizes));
    rt.block_on(finished_memory(&sizes));
    rt.block_on(reconciler_calls(&sizes));
    // Last: the pending submissions of the ingest runs stay parked (their fetches are never
    // let go), so nothing of them runs behind the other measurements.
    rt.block_on(ingest(&sizes, Delivery::InProcess));
    rt.block_on(ingest(&sizes, Delivery::Loopback));
}

/// The service on loopback against the fake, as the integration tests run it, with its store
/// on disk (a temporary KERNELKITE_DATA_DIR on the VM's ext4 disk, `synchronous=NORMAL`):
/// every state change is committed before anyone is woken, so the store is in the measured
/// path.
type Service = common::Harness;

async fn service() -> Service {
    common::harness_with(|_| {}).await
}

/// Starts a client long-polling submission `id` and returns once the service has parked it
/// (it watches the submission; the timeout timer is the first watcher). The task yields the
/// moment the answer arrived and the answer.
async fn park_long_poll(s: &Service, id: &str) -> tokio::task::JoinHandle<(Instant, Value)> {
    let url = format!("{}/v1/submissions/{id}?wait=30", s.base);
    let http = s.http.clone();
    let waiter = tokio::spawn(async move {
        let v: Value = http
            .get(url)
            .send()
            .await
            .expect("poll")
            .json()
            .await
            .expect("json");
        (Instant::now(), v)
    });
    while s.app.store().watchers(id) < 2 {
        tokio::time::sleep(Duration::from_micros(100)).await;
    }
    waiter
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// Submits through the API and waits until the build exists; returns (id, build number).
async fn submit(s: &Service) -> (String, u64) {
    let v: Value = s
        .http
        .post(format!("{}/v1/submissions", s.base))
        .json(&json!({"config": sample_config(), "queue": "h100"}))
        .send()
        .await
        .expect("submit")
        .json()
        .await
        .expect("json");
    let id = v["id"].as_str().expect("id").to_string();
    let number = s
        .fake
        .next_created(Duration::from_secs(10))
        .await
        .expect("build created");
    let mut rx = s.app.store().subscribe(&id).expect("known");
    let _ = rx.wait_for(|x| x.build.is_some()).await;
    (id, number)
}

/// `n` submissions one after another: each waits in a long-poll, its build finishes, and the
/// time from the fake sending build.finished to the client holding the checked result is
/// taken. Returns the samples, sorted, and the build numbers.
async fn wake_to_result(s: &Service, n: usize) -> (Vec<Duration>, Vec<u64>) {
    let mut samples = Vec::with_capacity(n);
    let mut acked = Vec::with_capacity(n);
    let mut numbers = Vec::new();
    for _ in 0..n {
        let (id, number) = submit(s).await;
        numbers.push(number);
        s.fake.start_build(number).await;
        let waiter = park_long_poll(s, &id).await;
        s.fake
            .add_artifact(number, ArtifactSpec::result_json(sample_result_json()));
        let t0 = Instant::now();
        s.fake.finish_build(number, "passed", None).await;
        let ta = Instant::now();
        let (t1, v) = waiter.await.expect("waiter");
        assert_eq!(v["state"], "succeeded", "{v}");
        samples.push(t1 - t0);
        acked.push(ta - t0);
    }
    samples.sort();
    acked.sort();
    println!(
        "(of which the webhook's answer, after `fetching` is committed: p50 {}, p99 {}; n {n})",
        ms(pct(&acked, 0.5)),
        ms(pct(&acked, 0.99))
    );
    (samples, numbers)
}

/// A row of the completion-latency table without a mean: n, p50, p99, max of sorted `samples`.
fn print_row(label: &str, samples: &[Duration]) {
    println!(
        "| {label} | {} | {} | {} | - | {} |",
        samples.len(),
        ms(pct(samples, 0.5)),
        ms(pct(samples, 0.99)),
        ms(*samples.last().unwrap_or(&Duration::ZERO))
    );
}

async fn latency(sizes: &Sizes) {
    let s = service().await;
    s.fake.clear_requests();
    let (samples, numbers) = wake_to_result(&s, sizes.latency_n).await;
    // The same run's stand-in for the service before the durable store: the store in memory
    // (no data dir), so no disk write is on the path.
    let in_memory = {
        let m = common::harness_with(|c| c.store.data_dir = None).await;
        wake_to_result(&m, sizes.latency_n).await.0
    };
    let full_sync = {
        let f = common::harness_with(|c| {
            c.store.store_sync = kernelkite_service::store::SyncMode::Full
        })
        .await;
        wake_to_result(&f, sizes.latency_n / 4).await.0
    };
    let mean = samples.iter().sum::<Duration>() / samples.len() as u32;

    // API calls, counted by the fake: every request about these builds.
    let mut per_build = Vec::new();
    for n in &numbers {
        per_build.push(s.fake.api_calls_for(*n).len());
    }
    let total: usize = per_build.iter().sum();

    let mut burst = burst_latency(&s, sizes.burst).await;
    burst.sort();

    let (poll_lat, poll_detect) = polling_latency(&s.fake, sizes.polling_n).await;
    let mut scaled_back: Vec<Duration> = poll_lat
        .iter()
        .zip(&poll_detect)
        .map(|(l, d)| *d * SCALE + (*l - *d))
        .collect();
    scaled_back.sort();
    let mut scaled: Vec<Duration> = poll_lat.clone();
    scaled.sort();
    let pmean = scaled_back.iter().sum::<Duration>() / scaled_back.len() as u32;

    println!("\n## Completion latency (fake sends build.finished -> long-polling client holds the checked result)");
    println!("| strategy | n | p50 | p99 | mean | max |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| webhook + long-poll (this service) | {} | {} | {} | {} | {} |",
        samples.len(),
        ms(pct(&samples, 0.5)),
        ms(pct(&samples, 0.99)),
        ms(mean),
        ms(*samples.last().unwrap_or(&Duration::ZERO))
    );
    print_row(
        "webhook + long-poll, store in memory (no data dir; same-run baseline)",
        &in_memory,
    );
    print_row(
        "webhook + long-poll, store fsyncs every commit (KERNELKITE_STORE_SYNC=full)",
        &full_sync,
    );
    print_row(
        &format!(
            "poll every 10 s (prototype), scaled run: poll every {} ms, measured",
            (PROTOTYPE_POLL / SCALE).as_millis()
        ),
        &scaled,
    );
    println!(
        "| poll every 10 s (prototype), scaled back (detection delay x{SCALE} + fetch) | {} | {} | {} | {} | {} |",
        scaled_back.len(),
        ms(pct(&scaled_back, 0.5)),
        ms(pct(&scaled_back, 0.99)),
        ms(pmean),
        ms(*scaled_back.last().unwrap_or(&Duration::ZERO))
    );
    println!("| poll every 10 s (prototype), analytic: delay ~ U(0, 10 s) | - | 5000 ms | 9900 ms | 5000 ms | 10000 ms |");
    print_row(
        &format!(
            "webhook + long-poll, burst: {} builds finish at once (from the burst's start)",
            burst.len()
        ),
        &burst,
    );
    let p99 = pct(&samples, 0.99);
    let bound = pct(&in_memory, 0.99) * 2;
    println!(
        "target p99 <= 20 ms: {}; with the store on disk, p99 within 2x of the same run's in-memory p99 ({} <= {}): {} (the store-less service of issue 5 measured 0.62 ms on a quieter day)",
        if p99 <= Duration::from_millis(20) {
            "met"
        } else {
            "NOT met"
        },
        ms(p99),
        ms(bound),
        if p99 <= bound { "met" } else { "NOT met" }
    );
    println!("API calls per submission (event-driven, counted by the fake over {} submissions): total {total}, per submission min {} max {}", numbers.len(), per_build.iter().min().unwrap_or(&0), per_build.iter().max().unwrap_or(&0));
}

/// `k` submissions waiting (long-polls parked), then all their builds finish at once.
async fn burst_latency(s: &Service, k: usize) -> Vec<Duration> {
    let mut waiting = Vec::new();
    for _ in 0..k {
        let (id, number) = submit(s).await;
        s.fake.start_build(number).await;
        s.fake
            .add_artifact(number, ArtifactSpec::result_json(sample_result_json()));
        let waiter = park_long_poll(s, &id).await;
        waiting.push((number, waiter));
    }
    let t0 = Instant::now();
    futures_util::future::join_all(
        waiting
            .iter()
            .map(|(n, _)| s.fake.finish_build(*n, "passed", None)),
    )
    .await;
    let mut out = Vec::new();
    for (_, w) in waiting {
        let (t1, v) = w.await.expect("waiter");
        assert_eq!(v["state"], "succeeded");
        out.push(t1 - t0);
    }
    out
}

fn bench_client(fake: &FakeBuildkite) -> BuildkiteClient {
    let cfg = Config::new(&fake.api_url(), FAKE_ORG, FAKE_PIPELINE, FAKE_API_TOKEN);
    BuildkiteClient::new(&cfg).expect("client")
}

fn new_build() -> NewBuild {
    let payload = kernelkite_kernelbot::payload::encode(&sample_config()).expect("encode");
    NewBuild {
        commit: "HEAD".into(),
        branch: "main".into(),
        message: "polling baseline".into(),
        env: kernelkite_kernelbot::payload::to_env(&payload)
            .into_iter()
            .collect(),
        meta_data: Default::default(),
    }
}

/// The prototype's loop: GET the build every `interval` until it finished, then list and
/// download result.json (the same checks as the service, so only the wake-up differs).
async fn poll_until_done(
    client: &BuildkiteClient,
    number: u64,
    interval: Duration,
) -> (Instant, Instant) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let b = client.get_build(number).await.expect("get build");
        if matches!(b.state.as_str(), "passed" | "failed" | "canceled") {
            break;
        }
    }
    let detected = Instant::now();
    artifact::fetch_result(client, number)
        .await
        .expect("result");
    (detected, Instant::now())
}

/// Returns (finish -> result, finish -> detected) per build, measured at the scaled interval.
async fn polling_latency(fake: &FakeBuildkite, n: usize) -> (Vec<Duration>, Vec<Duration>) {
    let client = Arc::new(bench_client(fake));
    let interval = PROTOTYPE_POLL / SCALE;
    let mut lat = Vec::new();
    let mut det = Vec::new();
    let batch = 100;
    let mut rng = fastrand::Rng::with_seed(11);
    let mut done = 0;
    while done < n {
        let k = batch.min(n - done);
        let mut tasks = Vec::new();
        for _ in 0..k {
            let b = client.create_build(&new_build()).await.expect("create");
            let _ = fake.next_created(Duration::from_secs(5)).await;
            // The job ends at a uniformly random phase of the poll interval.
            let job = interval.mul_f64(rng.f64() * 2.0);
            let (client, number) = (client.clone(), b.number);
            let poller =
                tokio::spawn(async move { poll_until_done(&client, number, interval).await });
            tasks.push((number, job, poller));
        }
        let start = Instant::now();
        let mut finishes = Vec::new();
        let mut order: Vec<usize> = (0..tasks.len()).collect();
        order.sort_by_key(|i| tasks[*i].1);
        for i in order {
            let (number, job, _) = &tasks[i];
            tokio::time::sleep_until((start + *job).into()).await;
            let t0 = Instant::now();
            fake.complete_build(
                *number,
                "passed",
                Some(ArtifactSpec::result_json(sample_result_json())),
            );
            finishes.push((i, t0));
        }
        finishes.sort_by_key(|(i, _)| *i);
        for ((_, _, poller), (_, t0)) in tasks.into_iter().zip(finishes) {
            let (detected, got) = poller.await.expect("poller");
            lat.push(got.saturating_duration_since(t0));
            det.push(detected.saturating_duration_since(t0));
        }
        done += k;
    }
    (lat, det)
}

/// API calls per submission for a job that runs 60 s (scaled by SCALE), both strategies,
/// counted by the fake.
async fn call_counts(sizes: &Sizes) {
    let job = Duration::from_secs(60) / SCALE;
    let s = service().await;
    s.fake.clear_requests();
    let mut ids = Vec::new();
    for _ in 0..sizes.count_jobs {
        ids.push(submit(&s).await);
    }
    tokio::time::sleep(job).await;
    for (_, number) in &ids {
        s.fake
            .finish_build(
                *number,
                "passed",
                Some(ArtifactSpec::result_json(sample_result_json())),
            )
            .await;
    }
    for (id, _) in &ids {
        let v: Value = s
            .http
            .get(format!("{}/v1/submissions/{id}?wait=30", s.base))
            .send()
            .await
            .expect("get")
            .json()
            .await
            .expect("json");
        assert_eq!(v["state"], "succeeded");
    }
    let event: Vec<usize> = ids
        .iter()
        .map(|(_, n)| s.fake.api_calls_for(*n).len())
        .collect();

    let client = Arc::new(bench_client(&s.fake));
    let mut pollers = Vec::new();
    for _ in 0..sizes.count_jobs {
        let b = client.create_build(&new_build()).await.expect("create");
        let _ = s.fake.next_created(Duration::from_secs(5)).await;
        let c = client.clone();
        pollers.push((
            b.number,
            tokio::spawn(
                async move { poll_until_done(&c, b.number, PROTOTYPE_POLL / SCALE).await },
            ),
        ));
    }
    tokio::time::sleep(job).await;
    for (n, _) in &pollers {
        s.fake.complete_build(
            *n,
            "passed",
            Some(ArtifactSpec::result_json(sample_result_json())),
        );
    }
    let mut polling = Vec::new();
    for (n, p) in pollers {
        p.await.expect("poller");
        polling.push(s.fake.api_calls_for(n).len());
    }
    let show = |v: &[usize]| {
        format!(
            "mean {:.2}, min {}, max {}",
            v.iter().sum::<usize>() as f64 / v.len() as f64,
            v.iter().min().unwrap_or(&0),
            v.iter().max().unwrap_or(&0)
        )
    };
    println!("\n## Buildkite API calls per submission, 60 s job (counted by the fake; job time scaled 1/{SCALE})");
    println!("| strategy | submissions | calls per submission |");
    println!("|---|---|---|");
    println!(
        "| webhook (this service): create, list artifacts, download | {} | {} |",
        event.len(),
        show(&event)
    );
    println!(
        "| poll every 10 s (prototype): create, GET build x polls, list, download | {} | {} |",
        polling.len(),
        show(&polling)
    );
    println!("(blob-store fetches are not API calls and are not counted; rate limit: 50 calls/min per token)");
    // What the 50 calls/min per-token budget buys, from the counts just measured.
    let mean = |v: &[usize]| v.iter().sum::<usize>() as f64 / v.len().max(1) as f64;
    let gets_per_min = 60.0 / PROTOTYPE_POLL.as_secs_f64();
    println!(
        "at 50 calls/min per token: polling sustains {:.1} concurrently running builds ({gets_per_min:.0} GETs/min each) and \
         {:.1} submissions/min of 60 s jobs; webhook: no per-running-build cost, {:.1} submissions/min whatever their length",
        50.0 / gets_per_min,
        50.0 / mean(&polling),
        50.0 / mean(&event)
    );
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Delivery {
    InProcess,
    Loopback,
}

/// `pending` submissions in state `running`; then one signed build.finished per submission.
async fn ingest(sizes: &Sizes, how: Delivery) {
    let s = service().await;
    s.fake.set_recording(false);
    let n = sizes.pending;
    // Fetches are held back, so this measures the webhook path itself: verify, parse, route,
    // state change, fetch queued.
    let pause = s
        .app
        .fetch_slots()
        .acquire_many(s.app.cfg().fetch_concurrency as u32)
        .await
        .expect("permits");

    // One real build gives the exact body layout the fake (Buildkite) sends.
    let (_, number) = submit(&s).await;
    let template: Value =
        serde_json::from_slice(&s.fake.event_body("build.finished", number).expect("body"))
            .expect("json");

    let mut builds = Vec::with_capacity(n);
    for i in 0..n {
        builds.push((uuid::Uuid::new_v4().to_string(), 1_000_000 + i as u64));
    }
    let subs: Vec<Submission> = builds
        .iter()
        .map(|(bid, num)| {
            let now = chrono::Utc::now();
            let mut sub = Submission::new(
                uuid::Uuid::new_v4().to_string(),
                "h100".into(),
                Some(format!("run-{num}")),
                None,
                1800,
                now,
            );
            sub.attach_build(
                BuildInfo {
                    id: bid.clone(),
                    number: *num,
                    web_url: format!(
                        "https://buildkite.com/{FAKE_ORG}/{FAKE_PIPELINE}/builds/{num}"
                    ),
                },
                now,
            );
            sub.advance(State::Running, now);
            sub
        })
        .collect();
    let ids: Vec<String> = subs.iter().map(|x| x.id.clone()).collect();
    // In the store first (as after a restart), so each webhook's commit writes a real row.
    {
        use futures_util::StreamExt;
        let durable = s.app.store().durable().clone();
        futures_util::stream::iter(subs.iter().cloned())
            .map(|sub| {
                let durable = durable.clone();
                async move {
                    let job = job_for(&sub.id);
                    durable
                        .insert(NewSubmission {
                            sub,
                            job,
                            deadline_ms: i64::MAX,
                            idempotency: None,
                            fair_tag: Some(0),
                            cache_key: None,
                        })
                        .await
                        .expect("insert");
                }
            })
            .buffer_unordered(64)
            .collect::<Vec<()>>()
            .await;
    }
    let before = LIVE.load(Ordering::Relaxed);
    for sub in subs {
        s.app.adopt(sub);
    }
    tokio::task::yield_now().await;
    let after = LIVE.load(Ordering::Relaxed);
    let per_pending = (after - before) as f64 / n as f64;

    let ts = unix_now();
    let bodies: Vec<(String, bytes::Bytes)> = builds
        .iter()
        .map(|(bid, num)| {
            let mut v = template.clone();
            v["build"]["id"] = json!(bid);
            v["build"]["number"] = json!(num);
            v["build"]["state"] = json!("passed");
            let body = serde_json::to_vec(&v).expect("body");
            (
                signature_header(common::WEBHOOK_TOKEN, ts, &body),
                bytes::Bytes::from(body),
            )
        })
        .collect();
    let body_len = bodies[0].1.len();

    let t = Instant::now();
    let ok = match how {
        Delivery::InProcess => {
            use futures_util::StreamExt;
            use tower::ServiceExt;
            let router = kernelkite_service::router(s.app.clone(), &s.cfg);
            // 32 in flight, as over loopback: each answer waits for its state change to be
            // committed, and concurrent deliveries share a commit (group commit).
            futures_util::stream::iter(bodies)
                .map(|(sig, body)| {
                    let router = router.clone();
                    async move {
                        let req = axum::http::Request::post("/webhooks/buildkite")
                            .header("X-Buildkite-Event", "build.finished")
                            .header("X-Buildkite-Signature", sig)
                            .header("content-type", "application/json")
                            .body(axum::body::Body::from(body))
                            .expect("request");
                        let r = router.oneshot(req).await.expect("infallible");
                        usize::from(r.status() == 200)
                    }
                })
                .buffer_unordered(32)
                .fold(0usize, |a, b| async move { a + b })
                .await
        }
        Delivery::Loopback => {
            use futures_util::StreamExt;
            let url = format!("{}/webhooks/buildkite", s.base);
            let http = reqwest::Client::builder()
                .pool_max_idle_per_host(64)
                .build()
                .expect("client");
            futures_util::stream::iter(bodies)
                .map(|(sig, body)| {
                    let (http, url) = (http.clone(), url.clone());
                    async move {
                        let r = http
                            .post(url)
                            .header("X-Buildkite-Event", "build.finished")
                            .header("X-Buildkite-Signature", sig)
                            .header("content-type", "application/json")
                            .body(body)
                            .send()
                            .await;
                        usize::from(r.is_ok_and(|r| r.status() == 200))
                    }
                })
                .buffer_unordered(32)
                .fold(0usize, |a, b| async move { a + b })
                .await
        }
    };
    let took = t.elapsed();
    assert_eq!(ok, n, "every webhook must be accepted");
    let fetching = ids
        .iter()
        .filter(|id| {
            s.app
                .store()
                .get(id)
                .is_some_and(|x| x.state == State::Fetching)
        })
        .count();
    assert_eq!(
        fetching, n,
        "every webhook must move its submission to fetching"
    );
    // Their results would be fetched from builds that do not exist: not part of the
    // measurement, and not to run behind the next one.
    pause.forget();

    if how == Delivery::InProcess {
        println!("\n## Memory per pending submission");
        println!("{per_pending:.0} bytes (counting global allocator; {n} submissions adopted with build attached, state running, timeout timer armed; target <= 2048: {})", if per_pending <= 2048.0 { "met" } else { "NOT met" });
        println!("\n## Webhook ingest ({n} submissions pending; signed build.finished, body {body_len} bytes; artifact fetches held back)");
        println!("| delivery | webhooks | time | webhooks/s |");
        println!("|---|---|---|---|");
    }
    let label = match how {
        Delivery::InProcess => {
            "in-process (router, no TCP, 32 in flight): verify + parse + route + state change committed + fetch queued"
        }
        Delivery::Loopback => "HTTP over loopback, 32 in flight (client shares the 2 CPUs)",
    };
    let rate = n as f64 / took.as_secs_f64();
    println!(
        "| {label} | {n} | {} | {rate:.0} ({}) |",
        ms(took),
        if rate >= 20_000.0 {
            "target >= 20000/s met"
        } else {
            "target >= 20000/s NOT met"
        }
    );
}

/// A job as the core keeps it for a submission.
fn job_for(id: &str) -> kernelkite_service::executor::Job {
    kernelkite_service::executor::Job {
        submission_id: id.to_string(),
        run_id: id.to_string(),
        queue: "h100".into(),
        mode: "test".into(),
        payload: kernelkite_kernelbot::payload::encode(&sample_config()).expect("encode"),
        ranked: false,
        pin: None,
        pin_tags: Default::default(),
    }
}

/// The stores measured: SQLite on disk with each sync mode, and PostgreSQL where a server is
/// named (`KERNELKITE_BENCH_DATABASE_URL`, else the tests' `KERNELKITE_TEST_DATABASE_URL`),
/// labelled with the server's own durability settings.
async fn stores(dirs: &[tempfile::TempDir; 2]) -> Vec<(String, Arc<dyn Durable>)> {
    use kernelkite_service::store::{PgSettings, Postgres, Sqlite, SyncMode};
    let mut out: Vec<(String, Arc<dyn Durable>)> = Vec::new();
    for (sync, dir) in [SyncMode::Normal, SyncMode::Full].into_iter().zip(dirs) {
        let db = Sqlite::open(Some(dir.path()), sync, None).expect("store");
        out.push((format!("SQLite, {sync:?}"), Arc::new(db)));
    }
    let url = kernelkite_testkit::postgres::bench_url();
    let Some(url) = url else {
        println!("(PostgreSQL not measured: set KERNELKITE_BENCH_DATABASE_URL, or run scripts/postgres.sh start DIR durable)");
        return out;
    };
    let settings = PgSettings {
        url: url.clone(),
        schema: format!("kk_bench_{}", std::process::id()),
        max_connections: 8,
        lock_wait: Duration::ZERO,
        standby: false,
        replica: false,
        exit_on_lost: false,
    };
    let (db, _) = Postgres::open(&settings, None).expect("the PostgreSQL store opens");
    let mut c = <sqlx::PgConnection as sqlx::Connection>::connect(&url)
        .await
        .expect("connect");
    let mut shown = Vec::new();
    for name in ["fsync", "synchronous_commit"] {
        let v: String = sqlx::query_scalar(&format!("SHOW {name}"))
            .fetch_one(&mut c)
            .await
            .unwrap_or_default();
        shown.push(v);
    }
    let (fsync, commit) = (&shown[0], &shown[1]);
    out.push((
        format!(
            "PostgreSQL on loopback, 8 connections (fsync={fsync}, synchronous_commit={commit})"
        ),
        Arc::new(db),
    ));
    out
}

/// The store alone: new submissions written (as `POST /v1/submissions` writes them before
/// creating the build), 64 writers at once, on disk; each store in the same run.
async fn store_throughput(sizes: &Sizes) {
    use futures_util::StreamExt;
    println!("\n## Store throughput (SQLite on the VM's ext4 disk, WAL, group commit; PostgreSQL on this VM; 64 writers)");
    println!("| what | store | n | time | per second |");
    println!("|---|---|---|---|---|");
    let dirs = [
        tempfile::tempdir().expect("dir"),
        tempfile::tempdir().expect("dir"),
    ];
    let mut single = Vec::new();
    for (store, db) in stores(&dirs).await {
        let n = sizes.store_n;
        let t = Instant::now();
        futures_util::stream::iter(0..n)
            .map(|_| {
                let db = db.clone();
                async move {
                    let id = uuid::Uuid::new_v4().to_string();
                    let sub = Submission::new(
                        id.clone(),
                        "h100".into(),
                        None,
                        None,
                        1800,
                        chrono::Utc::now(),
                    );
                    db.insert(NewSubmission {
                        sub,
                        job: job_for(&id),
                        deadline_ms: i64::MAX,
                        idempotency: Some((id.clone(), "h".into())),
                        fair_tag: Some(0),
                        cache_key: None,
                    })
                    .await
                    .expect("insert");
                }
            })
            .buffer_unordered(64)
            .collect::<Vec<()>>()
            .await;
        let took = t.elapsed();
        println!(
            "| submissions written (insert + idempotency key + job) | {store} | {n} | {} | {:.0} |",
            ms(took),
            n as f64 / took.as_secs_f64()
        );
        // One change at a time (what a lone webhook waits for): the commit's own latency.
        let mut sub = Submission::new(
            uuid::Uuid::new_v4().to_string(),
            "h100".into(),
            None,
            None,
            1800,
            chrono::Utc::now(),
        );
        db.insert(NewSubmission {
            sub: sub.clone(),
            job: job_for(&sub.id),
            deadline_ms: i64::MAX,
            idempotency: None,
            fair_tag: Some(0),
            cache_key: None,
        })
        .await
        .expect("insert");
        let mut lat = Vec::with_capacity(1000);
        for _ in 0..1000 {
            sub.updated_at = chrono::Utc::now();
            let t = Instant::now();
            db.save(&sub).await.expect("save");
            lat.push(t.elapsed());
        }
        lat.sort();
        single.push((store, lat));
    }
    for (store, lat) in single {
        println!(
            "one state change committed alone ({store}): p50 {}, p99 {} over {}",
            ms(pct(&lat, 0.5)),
            ms(pct(&lat, 0.99)),
            lat.len()
        );
    }
}

/// What the store's damage check (issue 34: `Sqlite::check_pages`, SQLite's quick_check on a
/// fresh connection, every KERNELKITE_STORE_CHECK_S) costs on stores of a few sizes, beside
/// the floor for reading every page: the file read whole (both from the page cache).
async fn store_page_check(sizes: &Sizes) {
    use futures_util::StreamExt;
    use kernelkite_service::store::{Sqlite, SyncMode};
    println!("\n## Store page check (quick_check of every page, a fresh connection; baseline: the file read whole)");
    println!("| store | check p50 | check per MiB | read whole p50 | check / read |");
    println!("|---|---|---|---|---|");
    for &mib in sizes.check_mib {
        let dir = tempfile::tempdir().expect("dir");
        let db = Sqlite::open(Some(dir.path()), SyncMode::Normal, None).expect("store");
        // Rows of about 16 KiB (a job's payload of incompressible text), to the size asked.
        let pad: String = (0..16_000u32)
            .map(|i| char::from(b"0123456789abcdef"[(i.wrapping_mul(2654435761) >> 28) as usize]))
            .collect();
        let rows = mib * 1024 * 1024 / 16_500;
        futures_util::stream::iter(0..rows)
            .map(|_| {
                let (db, pad) = (db.clone(), pad.clone());
                async move {
                    let id = uuid::Uuid::new_v4().to_string();
                    let sub = Submission::new(
                        id.clone(),
                        "h100".into(),
                        None,
                        None,
                        1800,
                        chrono::Utc::now(),
                    );
                    let mut job = job_for(&id);
                    job.payload = pad;
                    db.insert(NewSubmission {
                        sub,
                        job,
                        deadline_ms: i64::MAX,
                        idempotency: None,
                        fair_tag: Some(0),
                        cache_key: None,
                    })
                    .await
                    .expect("insert");
                }
            })
            .buffer_unordered(64)
            .collect::<Vec<()>>()
            .await;
        let path = db.path().expect("on disk").to_path_buf();
        // Let the reader's checkpoints copy the WAL into the file.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let size = std::fs::metadata(&path).map_or(0, |m| m.len());
        let (mut check, mut read) = (Vec::new(), Vec::new());
        for _ in 0..7 {
            let t = Instant::now();
            db.check_pages().await.expect("a sound store");
            check.push(t.elapsed());
            let t = Instant::now();
            let bytes = std::fs::read(&path).expect("read");
            std::hint::black_box(bytes);
            read.push(t.elapsed());
        }
        check.sort();
        read.sort();
        let (c, r) = (pct(&check, 0.5), pct(&read, 0.5));
        let actual_mib = size as f64 / (1024.0 * 1024.0);
        println!(
            "| {actual_mib:.0} MiB ({rows} rows) | {} | {:.3} ms | {} | {:.1}x |",
            ms(c),
            c.as_secs_f64() * 1000.0 / actual_mib.max(1.0),
            ms(r),
            c.as_secs_f64() / r.as_secs_f64().max(1e-9)
        );
    }
}

/// An executor that runs nothing: the build exists at once and its result is the sample.
/// It isolates the core and the store from Buildkite's HTTP.
struct Instantly(std::sync::atomic::AtomicU64);

impl kernelkite_service::executor::Executor for Instantly {
    fn name(&self) -> &'static str {
        "in-process"
    }
    fn launch<'a>(
        &'a self,
        _job: &'a kernelkite_service::executor::Job,
    ) -> futures_util::future::BoxFuture<
        'a,
        Result<kernelkite_service::executor::Launched, kernelkite_service::report::BoxError>,
    > {
        let n = self.0.fetch_add(1, Ordering::Relaxed) + 1;
        Box::pin(async move {
            Ok(kernelkite_service::executor::Launched {
                build: BuildInfo {
                    id: format!("local-{n}"),
                    number: n,
                    web_url: String::new(),
                },
                running: true,
            })
        })
    }
    fn cancel<'a>(
        &'a self,
        _build: &'a BuildInfo,
    ) -> futures_util::future::BoxFuture<'a, Result<bool, kernelkite_service::report::BoxError>>
    {
        Box::pin(async { Ok(true) })
    }
    fn collect<'a>(
        &'a self,
        _build: &'a kernelkite_service::executor::BuildStatus,
    ) -> futures_util::future::BoxFuture<
        'a,
        Result<kernelkite_service::executor::Collected, kernelkite_service::report::BoxError>,
    > {
        Box::pin(async {
            let r = kernelkite_service::result::ResultJson::parse(sample_result_json().as_bytes())?;
            Ok(kernelkite_service::submission::Outcome::Succeeded(r).into())
        })
    }
}

/// Resident set size, from /proc/self/status.
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Whole submissions through the core and the store (accept, build attached, finished event,
/// result collected, end committed: four commits each), 64 at a time, with the executor above;
/// memory measured as finished submissions pile up in the store.
async fn finished_memory(sizes: &Sizes) {
    use futures_util::StreamExt;
    let dir = tempfile::tempdir().expect("dir");
    let mut cfg = kernelkite_service::Config::new("http://127.0.0.1:9/v2", "org", "pipe", "unused");
    cfg.store.data_dir = Some(dir.path().to_path_buf());
    // Every submission is the same sample run, and each must run.
    cfg.fair.cache = false;
    // Ended builds are remembered this long (to drop their late webhooks), then forgotten;
    // short here so the table shows the steady state within the run.
    cfg.store.early_event_ttl_s = 2;
    let app = kernelkite_service::cli::serve::start(
        &cfg,
        Arc::new(Instantly(std::sync::atomic::AtomicU64::new(0))),
    )
    .expect("app");
    let n = sizes.finished_n;
    let step = n / 4;
    println!("\n## Memory with finished submissions piling up (whole lifecycle through the core and the store, 64 at a time)");
    println!("| finished so far | RSS | live heap (counting allocator) | in memory (in flight) | submissions/s in this step |");
    println!("|---|---|---|---|---|");
    let show = |done: usize, rate: f64, app: &kernelkite_service::App| {
        println!(
            "| {done} | {:.1} MiB | {:.1} MiB | {} | {} |",
            rss_bytes() as f64 / 1048576.0,
            LIVE.load(Ordering::Relaxed) as f64 / 1048576.0,
            app.store().len(),
            if rate > 0.0 {
                format!("{rate:.0}")
            } else {
                "-".into()
            }
        )
    };
    show(0, 0.0, &app);
    let mut first_rate = 0.0;
    let mut rates = Vec::new();
    for chunk in 0..4 {
        let t = Instant::now();
        futures_util::stream::iter(0..step)
            .map(|i| {
                let app = app.clone();
                async move {
                    let req: kernelkite_service::SubmitRequest = serde_json::from_value(
                        json!({"config": sample_config(), "queue": "h100", "run_id": format!("m-{chunk}-{i}")}),
                    )
                    .expect("request");
                    let sub = app.submit(req, None).await.expect("accepted").submission;
                    let mut rx = app.store().subscribe(&sub.id).expect("in flight");
                    let attached = rx
                        .wait_for(|s| s.build.is_some())
                        .await
                        .expect("attached")
                        .build
                        .clone()
                        .expect("build");
                    kernelkite_service::events::for_executor(&app)
                        .deliver(kernelkite_service::executor::BuildEvent {
                        kind: kernelkite_service::executor::BuildEventKind::Finished,
                        build: kernelkite_service::executor::BuildStatus {
                            id: attached.id,
                            number: attached.number,
                            state: "passed".into(),
                            web_url: String::new(),
                            blocked: false,
                        },
                    })
                    .await;
                    let end = rx.wait_for(|s| s.state.is_terminal()).await.expect("ends").clone();
                    assert_eq!(end.state, State::Succeeded);
                }
            })
            .buffer_unordered(64)
            .collect::<Vec<()>>()
            .await;
        let rate = step as f64 / t.elapsed().as_secs_f64();
        if chunk == 0 {
            first_rate = rate;
        }
        rates.push(rate);
        show((chunk + 1) * step, rate, &app);
    }
    let db_size = std::fs::metadata(dir.path().join("kernelkite.db")).map_or(0, |m| m.len())
        + std::fs::metadata(dir.path().join("kernelkite.db-wal")).map_or(0, |m| m.len());
    println!(
        "whole submissions/s through the store: {:.0} (first quarter {first_rate:.0}); store files {:.1} MiB for {n} finished; memory holds only what is in flight",
        rates.iter().sum::<f64>() / rates.len() as f64,
        db_size as f64 / 1048576.0
    );
}

/// 1,000 submissions pending whose webhooks never arrive (all lost), a few builds finishing
/// every minute: the reconciler's list-builds calls per minute. Time is scaled 1/100 (backoff
/// 30 s..5 min becomes 300 ms..3 s, a minute 600 ms), which leaves calls per minute unchanged.
async fn reconciler_calls(sizes: &Sizes) {
    use kernelkite_testkit::fake_buildkite::Route;
    let s = common::harness_with(|c| {
        c.reconcile_min_ms = 300;
        c.reconcile_max_ms = 3_000;
    })
    .await;
    s.fake.drop_webhooks(1.0, 1);
    s.fake.set_recording(false);
    let n = sizes.reconcile_pending;
    let mut builds = Vec::with_capacity(n);
    for _ in 0..n {
        builds.push(submit(&s).await);
    }
    s.fake.clear_requests();
    s.fake.set_recording(true);
    let minute = Duration::from_millis(600);
    let minutes = sizes.reconcile_minutes;
    // 1 % of the builds finish each minute, unannounced.
    let per_minute = (n / 100).max(1);
    let t0 = Instant::now();
    let mut finished = Vec::new();
    for m in 0..minutes {
        for k in 0..per_minute {
            if let Some((id, number)) = builds.get(m as usize * per_minute + k) {
                s.fake.complete_build(
                    *number,
                    "passed",
                    Some(ArtifactSpec::result_json(sample_result_json())),
                );
                finished.push((id.clone(), chrono::Utc::now()));
            }
        }
        tokio::time::sleep_until((t0 + minute * (m + 1)).into()).await;
    }
    let lists: Vec<_> = s.fake.requests_to(Route::ListBuilds);
    // The last builds need up to the longest backoff to be found.
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let mut found = 0;
    let mut lags = Vec::new();
    for (id, at) in &finished {
        let x = match s.app.store().get(id) {
            Some(x) => Some(x),
            None => s.app.lookup(id).await.ok().flatten(),
        };
        if let Some(x) = x.filter(|x| x.state == State::Succeeded) {
            found += 1;
            if let Some(f) = x.finished_at {
                lags.push((f - *at).to_std().unwrap_or_default());
            }
        }
    }
    lags.sort();
    let per_min = lists.len() as f64 / minutes as f64;
    println!("\n## Reconciler API calls ({n} pending submissions, every webhook lost, {per_minute} builds finishing per minute; time scaled 1/100)");
    println!("| strategy | list/GET calls per minute per 1,000 pending | finished builds found |");
    println!("|---|---|---|");
    println!(
        "| reconciler: batched list-builds (finished_from, state[], 100 per page), backoff 30 s..5 min | {:.1} ({} calls in {minutes} minutes) | {found} of {} |",
        per_min * 1000.0 / n as f64,
        lists.len(),
        finished.len()
    );
    println!(
        "| polling every 10 s (prototype): one GET per pending build | {:.0} | - |",
        6.0 * 1000.0
    );
    if !lags.is_empty() {
        println!(
            "finish -> found by the reconciler (scaled; x100 for real time): p50 {}, max {} (bound: the longest backoff, 3000 ms scaled = 5 min, plus a tick)",
            ms(pct(&lags, 0.5)),
            ms(*lags.last().unwrap_or(&Duration::ZERO))
        );
    }
}
