//! kernelkite-service benchmark of fail-over on PostgreSQL (issue 38: "another takes over
//! within 10 s"): real service processes on one schema against the fake Buildkite, each figure
//! beside its baseline in the same run:
//!
//! - a standby replica taking over from the serving one killed with SIGKILL: from the kill to
//!   the standby answering `/healthz`;
//! - the same from a serving one frozen with SIGSTOP (its database session stays open, silent);
//! - the same from a serving one stopped with SIGTERM, as a rolling upgrade stops the old
//!   release (it lets go of the lock as it exits);
//! - the baseline: one service and no standby, started again at once after the kill (what a
//!   supervisor restarting a single process gives, less its own restart delay);
//! - with replicas (`KERNELKITE_REPLICA`): the replica running the queue killed with SIGKILL,
//!   timed to a submission sent to the other one (retried as a client retries a 503) being
//!   accepted; meanwhile a client reads a submission through the other replica without pause,
//!   and every read's outcome and the slowest are counted.
//!
//! `cargo bench -p kernelkite-service --bench failover` with `KERNELKITE_BENCH_DATABASE_URL`
//! (or `KERNELKITE_TEST_DATABASE_URL`; `scripts/postgres.sh start DIR` prints one);
//! `KERNELKITE_BENCH_SHORT=1` for one round instead of five. Figures are printed;
//! docs/BENCHMARKS.md records them.

use std::path::Path;
use std::time::{Duration, Instant};

use kernelkite_testkit::fake_buildkite::FakeBuildkite;
use kernelkite_testkit::service_process::ServiceProcess;

const EXE: &str = env!("CARGO_BIN_EXE_kernelkite-service");

/// Longest any step may take before the round fails.
const WITHIN: Duration = Duration::from_secs(30);

/// The bound on a take-over.
const TARGET: Duration = Duration::from_secs(10);

fn replica(fake: &FakeBuildkite, dir: &Path, log: &str, url: &str, schema: &str) -> ServiceProcess {
    let mut svc = ServiceProcess::new(EXE, fake, dir, dir.join(log));
    svc.use_postgres(url, schema);
    svc.set_env("KERNELKITE_STANDBY", "true");
    svc
}

/// One round: (after a kill, after a freeze, after a stop, a lone service restarted).
async fn round(url: &str) -> (Duration, Duration, Duration, Duration) {
    let schema = kernelkite_testkit::postgres::schema();
    let fake = FakeBuildkite::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut a = replica(&fake, dir.path(), "a.log", url, &schema);
    let mut b = replica(&fake, dir.path(), "b.log", url, &schema);
    a.start().await.expect("the first replica serves");
    b.spawn().expect("spawn");
    b.standing_by().await;
    a.kill9().await;
    let t = Instant::now();
    b.ready(WITHIN).await.expect("the standby takes over");
    let killed = t.elapsed();
    a.spawn().expect("spawn");
    a.standing_by().await;
    b.signal(libc::SIGSTOP);
    let t = Instant::now();
    a.ready(WITHIN).await.expect("the standby takes over");
    let frozen = t.elapsed();
    b.signal(libc::SIGCONT);
    assert_eq!(b.exited(WITHIN).await, Some(75), "{}", b.log_text());
    // A rolling upgrade: the new release stands by, the old one is stopped.
    b.spawn().expect("spawn");
    b.standing_by().await;
    a.signal(libc::SIGTERM);
    let t = Instant::now();
    b.ready(WITHIN).await.expect("the standby takes over");
    let stopped = t.elapsed();
    assert_eq!(a.exited(WITHIN).await, Some(0), "{}", a.log_text());
    // The baseline: a lone service (no standby) killed and started again at once.
    b.kill9().await;
    let mut lone = ServiceProcess::new(EXE, &fake, dir.path(), dir.path().join("lone.log"));
    lone.use_postgres(url, &schema);
    let t = Instant::now();
    lone.start().await.expect("a lone service starts again");
    let restarted = t.elapsed();
    lone.kill9().await;
    (killed, frozen, stopped, restarted)
}

/// One round with two replicas: (from the kill to a submission through the other accepted,
/// reads through the other meanwhile: answered, failed, the slowest).
async fn replica_round(url: &str) -> (Duration, usize, usize, Duration) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let schema = kernelkite_testkit::postgres::schema();
    let fake = FakeBuildkite::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let as_replica = |log: &str| {
        let mut svc = ServiceProcess::new(EXE, &fake, dir.path(), dir.path().join(log));
        svc.use_postgres(url, &schema);
        svc.set_env("KERNELKITE_REPLICA", "true");
        svc
    };
    let (mut a, mut b) = (as_replica("ra.log"), as_replica("rb.log"));
    a.start().await.expect("the first replica serves");
    let t = Instant::now();
    while !a.log_text().contains("runs the queue") {
        assert!(t.elapsed() < WITHIN, "{}", a.log_text());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    b.start().await.expect("the second replica serves");
    let http = reqwest::Client::builder()
        .timeout(WITHIN)
        .build()
        .expect("client");
    let submit = |key: &'static str| {
        let (http, base) = (http.clone(), b.base.clone());
        async move {
            let body =
                serde_json::json!({"config": kernelkite_testkit::sample_config(), "queue": "h100"});
            loop {
                if let Ok(r) = http
                    .post(format!("{base}/v1/submissions"))
                    .header("Idempotency-Key", key)
                    .json(&body)
                    .send()
                    .await
                {
                    if r.status() == 202 || r.status() == 200 {
                        let v: serde_json::Value = r.json().await.expect("json");
                        return v["id"].as_str().expect("id").to_string();
                    }
                    assert_eq!(r.status(), 503, "{:?}", r.text().await);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    let id = submit("before").await;
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let reader = {
        let (http, url, stop) = (
            http.clone(),
            format!("{}/v1/submissions/{id}", b.base),
            stop.clone(),
        );
        tokio::spawn(async move {
            let (mut ok, mut failed, mut slowest) = (0, 0, Duration::ZERO);
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                match http.get(&url).send().await {
                    Ok(r) if r.status() == 200 => ok += 1,
                    _ => failed += 1,
                }
                slowest = slowest.max(t.elapsed());
            }
            (ok, failed, slowest)
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    a.kill9().await;
    let t = Instant::now();
    submit("after").await;
    let took = t.elapsed();
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::Relaxed);
    let (ok, failed, slowest) = reader.await.expect("reader");
    b.kill9().await;
    (took, ok, failed, slowest)
}

fn row(what: &str, mut xs: Vec<Duration>, against: &str) {
    xs.sort();
    let median = xs[xs.len() / 2];
    let max = xs[xs.len() - 1];
    println!(
        "{what:<58} median {:>8.3} s  max {:>8.3} s  ({against})",
        median.as_secs_f64(),
        max.as_secs_f64()
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let short = std::env::var("KERNELKITE_BENCH_SHORT").is_ok_and(|v| v == "1");
    let rounds = if short { 1 } else { 5 };
    let url = kernelkite_testkit::postgres::bench_url();
    let Some(url) = url else {
        println!("failover: not measured: set KERNELKITE_BENCH_DATABASE_URL, or run scripts/postgres.sh start DIR");
        return;
    };
    println!("failover benchmark: two kernelkite-service replicas on one PostgreSQL schema, {rounds} round(s)");
    let (mut killed, mut frozen, mut stopped, mut restarted) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let (k, f, s, r) = round(&url).await;
        killed.push(k);
        frozen.push(f);
        stopped.push(s);
        restarted.push(r);
    }
    let (mut accepted_after, mut reads) = (Vec::new(), (0, 0, Duration::ZERO));
    for _ in 0..rounds {
        let (took, ok, failed, slowest) = replica_round(&url).await;
        accepted_after.push(took);
        reads = (reads.0 + ok, reads.1 + failed, reads.2.max(slowest));
    }
    let worst = killed
        .iter()
        .chain(&accepted_after)
        .chain(&frozen)
        .chain(&stopped)
        .max()
        .copied()
        .unwrap_or_default();
    row(
        "standby takes over from a replica killed (SIGKILL)",
        killed,
        "target <= 10 s",
    );
    row(
        "standby takes over from a replica frozen (SIGSTOP)",
        frozen,
        "target <= 10 s; the silence it waits out: 6 s",
    );
    row(
        "standby takes over from a replica stopped (SIGTERM: an upgrade)",
        stopped,
        "target <= 10 s",
    );
    row(
        "baseline: a lone service started again at once after a kill",
        restarted,
        "no standby; a supervisor adds its restart delay",
    );
    row(
        "replicas: a submission through the other accepted after a kill",
        accepted_after,
        "target <= 10 s; the same lock's take-over as the standby's above",
    );
    println!(
        "replicas: reads through the other replica meanwhile: {} answered, {} failed, the slowest {:.3} s",
        reads.0,
        reads.1,
        reads.2.as_secs_f64()
    );
    println!(
        "take-over, slowest of every round: {:.3} s; target <= {} s: {}",
        worst.as_secs_f64(),
        TARGET.as_secs(),
        if worst <= TARGET { "met" } else { "MISSED" }
    );
}
