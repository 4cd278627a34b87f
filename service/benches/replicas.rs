//! kernelkite-service benchmark of replicas on PostgreSQL (issue 38, "Measure"): real service
//! processes against the fake Buildkite, every figure beside its baseline in the same run:
//!
//! - accepted submissions per second and accept p50/p99, with 16 clients submitting at once:
//!   one process on SQLite (the baseline: the embedded default), one on PostgreSQL, and three
//!   replicas (`KERNELKITE_REPLICA`) on PostgreSQL with the clients spread over them (two of
//!   every three requests are relayed through the database to the replica running the queue);
//! - from Buildkite's `build.finished` webhook being sent to the result reaching a long-poll:
//!   held on the same process as the webhook (one process on PostgreSQL, the baseline), and
//!   held on replica B while the webhook goes to replica C (relayed to A, which runs the queue;
//!   B hears the change from the database). Goal: p99 <= 20 ms on loopback.
//!
//! `cargo bench -p kernelkite-service --bench replicas` with `KERNELKITE_BENCH_DATABASE_URL`
//! (or `KERNELKITE_TEST_DATABASE_URL`; `scripts/postgres.sh start DIR durable` prints one);
//! `KERNELKITE_BENCH_SHORT=1` for shorter runs. `KERNELKITE_BENCH_BASELINE_EXE=PATH` (another
//! release's `kernelkite-service`) adds its SQLite row, measured right after this build's, so
//! that the SQLite path is compared in the same run. Figures are printed; docs/BENCHMARKS.md
//! records them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kernelkite_testkit::fake_buildkite::{ArtifactSpec, FakeBuildkite, Signing};
use kernelkite_testkit::service_process::ServiceProcess;
use kernelkite_testkit::{sample_config, sample_result_json};
use serde_json::{json, Value};

const EXE: &str = env!("CARGO_BIN_EXE_kernelkite-service");

/// Clients submitting at once.
const CLIENTS: usize = 16;

/// Where a setup's processes keep their state.
enum Store<'a> {
    Sqlite,
    /// SQLite, served by another build of the service.
    SqliteBy(&'a str),
    Postgres(&'a str),
    Replicas(&'a str),
}

/// The processes of one setup, started, with the fake's webhooks going to the last one.
async fn setup(
    fake: &FakeBuildkite,
    dir: &std::path::Path,
    store: &Store<'_>,
) -> Vec<ServiceProcess> {
    let schema = kernelkite_testkit::postgres::schema();
    let n = if matches!(store, Store::Replicas(_)) {
        3
    } else {
        1
    };
    let mut out = Vec::new();
    for i in 0..n {
        let data = dir.join(format!("data-{i}"));
        std::fs::create_dir_all(&data).expect("data dir");
        let exe = match store {
            Store::SqliteBy(exe) => exe,
            _ => EXE,
        };
        let mut svc = ServiceProcess::new(exe, fake, &data, dir.join(format!("{i}.log")));
        match store {
            Store::Sqlite | Store::SqliteBy(_) => {}
            Store::Postgres(url) => svc.use_postgres(url, &schema),
            Store::Replicas(url) => {
                svc.use_postgres(url, &schema);
                svc.set_env("KERNELKITE_REPLICA", "true");
            }
        }
        // Every submission's build is created at once; identical ones are not cached.
        svc.set_env("KERNELKITE_QUEUE_SLOTS", "*=none");
        svc.set_env("KERNELKITE_CACHE", "false");
        svc.start().await.expect("the service starts");
        if i == 0 && n > 1 {
            // The first runs the queue before the others start.
            let t = Instant::now();
            while !svc.log_text().contains("runs the queue") {
                assert!(t.elapsed() < Duration::from_secs(20), "{}", svc.log_text());
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        out.push(svc);
    }
    let last = &out[out.len() - 1].base;
    fake.set_webhook(
        format!("{last}/webhooks/buildkite"),
        Signing::Hmac(kernelkite_testkit::harness::WEBHOOK_TOKEN.into()),
    );
    out
}

fn body(i: usize) -> Value {
    let mut config = sample_config();
    // Each its own run config: nothing is answered from another.
    config["seed"] = json!(i);
    json!({"config": config, "queue": "h100", "run_id": format!("run-{i}")})
}

/// `CLIENTS` clients submitting for `secs`, client k to replica `k % n`: accepted per second,
/// each accept's latency, and what did not answer 202 (counted and shown, not hidden).
async fn accept(bases: &[String], secs: u64) -> (f64, Vec<Duration>, Vec<String>) {
    let http = reqwest::Client::new();
    let stop = Arc::new(AtomicBool::new(false));
    let began = Instant::now();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|k| {
            let (http, base, stop) = (http.clone(), bases[k % bases.len()].clone(), stop.clone());
            tokio::spawn(async move {
                let mut lat = Vec::new();
                let mut failed = Vec::new();
                let mut i = k;
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    match http
                        .post(format!("{base}/v1/submissions"))
                        .json(&body(i))
                        .send()
                        .await
                    {
                        Ok(r) if r.status() == 202 => lat.push(t.elapsed()),
                        Ok(r) => failed.push(format!("{}: {:?}", r.status(), r.text().await)),
                        Err(e) => failed.push(e.to_string()),
                    }
                    i += CLIENTS;
                }
                (lat, failed)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let (mut all, mut failed) = (Vec::new(), Vec::new());
    for t in tasks {
        let (lat, f) = t.await.expect("client");
        all.extend(lat);
        failed.extend(f);
    }
    let rate = all.len() as f64 / began.elapsed().as_secs_f64();
    all.sort();
    (rate, all, failed)
}

/// `n` times: a submission through `wait_on`, its build created, a long-poll parked on
/// `wait_on`; then the build's `build.finished` webhook is sent (to wherever the fake sends
/// them): from sending it to the long-poll's answer.
async fn webhook_to_waiter(fake: &FakeBuildkite, wait_on: &str, n: usize) -> Vec<Duration> {
    let http = reqwest::Client::new();
    let mut out = Vec::new();
    for i in 0..n {
        let r = http
            .post(format!("{wait_on}/v1/submissions"))
            .json(&body(1_000_000 + i))
            .send()
            .await
            .expect("submit");
        assert_eq!(r.status(), 202);
        let id = r.json::<Value>().await.expect("json")["id"]
            .as_str()
            .expect("id")
            .to_string();
        let build = fake
            .next_created(Duration::from_secs(30))
            .await
            .expect("its build is created");
        fake.start_build(build).await;
        let poll = {
            let (http, url) = (
                http.clone(),
                format!("{wait_on}/v1/submissions/{id}?wait=30"),
            );
            tokio::spawn(async move {
                let v: Value = http
                    .get(url)
                    .send()
                    .await
                    .expect("poll")
                    .json()
                    .await
                    .expect("json");
                (Instant::now(), v)
            })
        };
        // The long-poll is parked (and, on a replica, its submission followed).
        tokio::time::sleep(Duration::from_millis(30)).await;
        let run_id = format!("run-{}", 1_000_000 + i);
        let sent = Instant::now();
        fake.finish_build(
            build,
            "passed",
            Some(ArtifactSpec::result_json(
                sample_result_json().replace("gpu-node-1", &run_id),
            )),
        )
        .await;
        let (at, v) = poll.await.expect("poll task");
        assert_eq!(v["state"], "succeeded", "{v}");
        out.push(at.duration_since(sent));
    }
    out.sort();
    out
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let short = std::env::var("KERNELKITE_BENCH_SHORT").is_ok_and(|v| v == "1");
    let (secs, samples) = if short { (2, 30) } else { (5, 200) };
    let Some(url) = kernelkite_testkit::postgres::bench_url() else {
        println!("replicas: not measured: set KERNELKITE_BENCH_DATABASE_URL, or run scripts/postgres.sh start DIR durable");
        return;
    };
    println!(
        "replicas benchmark: {CLIENTS} clients for {secs} s per setup; {samples} webhook samples"
    );
    let mut webhook_rows = Vec::new();
    let baseline = std::env::var("KERNELKITE_BENCH_BASELINE_EXE").ok();
    let mut setups = vec![("one process, SQLite (baseline)", Store::Sqlite)];
    if let Some(exe) = &baseline {
        setups.push((
            "one process, SQLite, the baseline binary",
            Store::SqliteBy(exe),
        ));
        setups.push(("one process, SQLite, this build again", Store::Sqlite));
        setups.push((
            "one process, SQLite, the baseline binary again",
            Store::SqliteBy(exe),
        ));
    }
    setups.push(("one process, PostgreSQL", Store::Postgres(&url)));
    setups.push((
        "three replicas, PostgreSQL, clients spread",
        Store::Replicas(&url),
    ));
    for (label, store) in setups {
        let fake = FakeBuildkite::start().await;
        let dir = tempfile::tempdir().expect("tempdir");
        let mut procs = setup(&fake, dir.path(), &store).await;
        let bases: Vec<String> = procs.iter().map(|p| p.base.clone()).collect();
        let (rate, lat, failed) = accept(&bases, secs).await;
        println!(
            "accept  {label:<44} {rate:>8.0} /s  p50 {:>9}  p99 {:>9}",
            ms(pct(&lat, 0.5)),
            ms(pct(&lat, 0.99))
        );
        if let Some(first) = failed.first() {
            println!("        {} not accepted; the first: {first}", failed.len());
        }
        if !matches!(store, Store::Sqlite | Store::SqliteBy(_)) {
            // The accept run's builds are drained before the webhook samples.
            while fake
                .next_created(Duration::from_millis(200))
                .await
                .is_some()
            {}
            // The waiter on the first process (one process), or on replica B with the webhook
            // to replica C.
            let wait_on = if bases.len() == 3 {
                &bases[1]
            } else {
                &bases[0]
            };
            let xs = webhook_to_waiter(&fake, wait_on, samples).await;
            let what = if bases.len() == 3 {
                "webhook to replica C, long-poll on replica B"
            } else {
                "webhook and long-poll on one process (baseline)"
            };
            webhook_rows.push((what, xs));
        }
        for p in &mut procs {
            p.kill9().await;
        }
    }
    for (what, xs) in webhook_rows {
        let p99 = pct(&xs, 0.99);
        let goal = if what.starts_with("webhook to replica") {
            let met = p99 <= Duration::from_millis(20);
            format!(
                "  (goal p99 <= 20 ms: {})",
                if met { "met" } else { "MISSED" }
            )
        } else {
            String::new()
        };
        println!(
            "webhook -> waiter  {what:<48} p50 {:>9}  p99 {:>9}{goal}",
            ms(pct(&xs, 0.5)),
            ms(p99),
        );
    }
}
