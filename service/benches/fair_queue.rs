//! kernelkite-service benchmark of the service's queue (issue 25), each figure beside the
//! baseline the issue names, in the same run:
//!
//! - the queue's scheduling overhead per submission with 10,000 queued (admit, queue, start,
//!   end: `kernelkite_service::dispatch`), beside a plain first-come-first-served queue;
//! - a submission accepted through the core (store included) with 10,000 queued, beside the
//!   same with the queue empty; and one pass telling 10,000 waiting submissions their places;
//! - an identical `test` submission answered from the result cache, over loopback HTTP (POST,
//!   then GET of the result), beside a submission that is queued;
//! - the simulation (one heavy user submitting 50 at once, five light users 2 each, 2
//!   slots): Jain's fairness index of per-user GPU time, and when the light users are done,
//!   with the fair queue and with plain first-come-first-served.
//!
//! `cargo bench -p kernelkite-service --bench fair_queue`; `KERNELKITE_BENCH_SHORT=1` for the
//! CI-sized run (2,000 queued instead of 10,000, fewer samples). Figures are printed;
//! docs/BENCHMARKS.md records them.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use kernelkite_service::dispatch::{Dispatcher, Limits, Slots, Who};
use kernelkite_service::executor::{BuildStatus, Collected, Executor, Job, Launched};
use kernelkite_service::fairshare::Class;
use kernelkite_service::report::BoxError;
use kernelkite_service::submission::{BuildInfo, Outcome};
use kernelkite_service::{App, Config, SubmitRequest};
use kernelkite_testkit::sample_config;
use serde_json::json;

fn main() {
    let short = std::env::var("KERNELKITE_BENCH_SHORT").is_ok_and(|v| v == "1");
    // The 10,000 waiting; a short run (the test command's) fills a fifth of that, which
    // took most of its 30 s.
    let queued = if short { 2_000 } else { 10_000 };
    let ops = if short { 20_000 } else { 200_000 };
    let accepts = if short { 500 } else { 5_000 };
    let cached = if short { 200 } else { 2_000 };
    println!(
        "# kernelkite-service fair-queue benchmark ({} mode, {} CPUs)",
        if short { "short" } else { "full" },
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    scheduling_overhead(queued, ops);
    simulation();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(accept_latency(queued, accepts));
    rt.block_on(cache_latency(cached));
}

fn who(user: usize, class: Class) -> Who {
    Who {
        queue: "h100".into(),
        user: format!("user-{user}"),
        class,
    }
}

/// Per submission with `queued` waiting: admitted, queued, started and ended (one cycle keeps
/// the queue at its size), beside a VecDeque pushed and popped as often.
fn scheduling_overhead(queued: usize, ops: usize) {
    let d = Dispatcher::new(Limits::default(), Duration::from_secs(60));
    let slots = Some(64);
    let mut n = 0usize;
    let add = |d: &Dispatcher, n: &mut usize| {
        let w = who(*n % 997, Class::ALL[*n % 3]);
        let a = d.admit(&w, 0, slots).expect("no limits");
        d.enqueue(&w, &format!("s{n}"), *n as i64, a);
        *n += 1;
    };
    for _ in 0..queued {
        add(&d, &mut n);
    }
    let mut running: VecDeque<String> = d.take("h100", slots).into_iter().map(|s| s.id).collect();
    let t = Instant::now();
    for _ in 0..ops {
        add(&d, &mut n);
        if let Some(id) = running.pop_front() {
            d.ended("h100", &id, Some(Duration::from_secs(60)));
        }
        running.extend(d.take("h100", slots).into_iter().map(|s| s.id));
    }
    let fair = t.elapsed() / ops as u32;
    let waiting = d.status("h100", slots).waiting;

    let mut fifo: VecDeque<(String, String)> = (0..queued)
        .map(|i| (format!("s{i}"), format!("user-{}", i % 997)))
        .collect();
    let t = Instant::now();
    for i in 0..ops {
        fifo.push_back((format!("s{}", queued + i), format!("user-{}", i % 997)));
        std::hint::black_box(fifo.pop_front());
    }
    let fifo_t = t.elapsed() / ops as u32;

    let t = Instant::now();
    let places = d.places("h100", slots);
    let pass = t.elapsed();
    println!();
    println!("## Scheduling overhead per submission, {waiting} queued ({ops} submissions through)");
    println!("| queue | per submission (admit + queue + start + end) |");
    println!("|---|---|");
    println!(
        "| the fair queue (classes, fair share, quotas checked) | {:.2} µs |",
        fair.as_secs_f64() * 1e6
    );
    println!(
        "| plain first come, first served (a VecDeque) | {:.2} µs |",
        fifo_t.as_secs_f64() * 1e6
    );
    println!(
        "| computing all {} places (one pass of the place publisher) | {:.2} ms |",
        places.len(),
        pass.as_secs_f64() * 1e3
    );
}

/// The simulation in virtual time: `jobs` (user, run time), submitted at 0 in that
/// order, on 2 slots; the fair queue (the service's `Dispatcher`, started after each
/// submission as the service does) or first come, first served. Returns each job's (user,
/// start, end).
fn simulate(jobs: &[(usize, f64)], fair: bool) -> Vec<(usize, f64, f64)> {
    const SLOTS: usize = 2;
    let d = Dispatcher::new(Limits::default(), Duration::from_secs(60));
    let mut fifo: VecDeque<usize> = VecDeque::new();
    let mut running: Vec<(f64, usize)> = Vec::new(); // (end, job)
    let mut out = Vec::new();
    let start = |job: usize, now: f64, running: &mut Vec<(f64, usize)>, out: &mut Vec<_>| {
        let end = now + jobs[job].1;
        running.push((end, job));
        out.push((jobs[job].0, now, end));
    };
    for (i, (user, _)) in jobs.iter().enumerate() {
        if fair {
            let w = who(*user, Class::Test);
            let a = d.admit(&w, 0, Some(SLOTS as u64)).expect("no limits");
            d.enqueue(&w, &i.to_string(), i as i64, a);
            for s in d.take("h100", Some(SLOTS as u64)) {
                start(s.id.parse().expect("index"), 0.0, &mut running, &mut out);
            }
        } else {
            fifo.push_back(i);
            while running.len() < SLOTS {
                let Some(j) = fifo.pop_front() else { break };
                start(j, 0.0, &mut running, &mut out);
            }
        }
    }
    while !running.is_empty() {
        running.sort_by(|a, b| b.0.total_cmp(&a.0));
        let (now, job) = running.pop().expect("running");
        if fair {
            d.ended(
                "h100",
                &job.to_string(),
                Some(Duration::from_secs_f64(jobs[job].1)),
            );
            for s in d.take("h100", Some(SLOTS as u64)) {
                start(s.id.parse().expect("index"), now, &mut running, &mut out);
            }
        } else if let Some(j) = fifo.pop_front() {
            start(j, now, &mut running, &mut out);
        }
    }
    out
}

/// Jain's fairness index of `x`: 1 when all are equal, 1/n when one has everything.
fn jain(x: &[f64]) -> f64 {
    let sum: f64 = x.iter().sum();
    let squares: f64 = x.iter().map(|v| v * v).sum();
    if squares == 0.0 {
        return 1.0;
    }
    sum * sum / (x.len() as f64 * squares)
}

/// Each user's GPU time within [0, until].
fn gpu_time(runs: &[(usize, f64, f64)], users: usize, until: f64) -> Vec<f64> {
    let mut t = vec![0.0; users];
    for (u, s, e) in runs {
        t[*u] += (e.min(until) - s).max(0.0);
    }
    t
}

fn simulation() {
    println!();
    println!(
        "## The issue's simulation: user 0 submits 50 at once, users 1-5 then 2 each; 2 slots"
    );
    println!("| run times | queue | Jain's index of per-user GPU time until the light users are done (fair) | light users' last run ends | light users' mean wait | heavy user's tenth starts |");
    println!("|---|---|---|---|---|---|");
    for (label, heavy_s, light_s) in [
        ("every run 60 s", 60.0, 60.0),
        ("heavy runs 120 s, light 30 s", 120.0, 30.0),
    ] {
        let mut jobs: Vec<(usize, f64)> = (0..50).map(|_| (0, heavy_s)).collect();
        for u in 1..=5 {
            jobs.extend([(u, light_s), (u, light_s)]);
        }
        let fair = simulate(&jobs, true);
        let fcfs = simulate(&jobs, false);
        let light_done = |runs: &[(usize, f64, f64)]| {
            runs.iter()
                .filter(|r| r.0 > 0)
                .map(|r| r.2)
                .fold(0.0, f64::max)
        };
        let until = light_done(&fair);
        let mut first = true;
        for (name, runs) in [("fair queue", &fair), ("first come, first served", &fcfs)] {
            let index = jain(&gpu_time(runs, 6, until));
            let waits: Vec<f64> = runs.iter().filter(|r| r.0 > 0).map(|r| r.1).collect();
            let mean_wait = waits.iter().sum::<f64>() / waits.len() as f64;
            let mut heavy_starts: Vec<f64> =
                runs.iter().filter(|r| r.0 == 0).map(|r| r.1).collect();
            heavy_starts.sort_by(f64::total_cmp);
            println!(
                "| {} | {name} | **{index:.3}** | {:.0} s | {mean_wait:.0} s | {:.0} s |",
                if first { label } else { "" },
                light_done(runs),
                heavy_starts[9],
            );
            first = false;
        }
    }
}

/// An executor whose builds never end: everything started stays started.
struct Hold;

impl Executor for Hold {
    fn name(&self) -> &'static str {
        "hold"
    }
    fn launch<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Result<Launched, BoxError>> {
        Box::pin(async move {
            Ok(Launched {
                build: BuildInfo {
                    id: job.submission_id.clone(),
                    number: 1,
                    web_url: String::new(),
                },
                running: true,
            })
        })
    }
    fn cancel<'a>(&'a self, _: &'a BuildInfo) -> BoxFuture<'a, Result<bool, BoxError>> {
        Box::pin(async { Ok(true) })
    }
    fn collect<'a>(&'a self, _: &'a BuildStatus) -> BoxFuture<'a, Result<Collected, BoxError>> {
        Box::pin(async { Err("never".into()) })
    }
}

fn request(n: usize, user: usize) -> SubmitRequest {
    let mut config = sample_config();
    config["seed"] = json!(n);
    serde_json::from_value(
        json!({"config": config, "queue": "h100", "user": format!("user-{user}")}),
    )
    .expect("request")
}

fn core(dir: &std::path::Path) -> Arc<App> {
    let mut cfg = Config::new("http://127.0.0.1:9/v2", "org", "pipe", "unused");
    cfg.store.data_dir = Some(dir.to_path_buf());
    cfg.fair.queue_slots = Slots::parse("h100=2").expect("slots");
    kernelkite_service::cli::serve::start(&cfg, Arc::new(Hold)).expect("service")
}

fn percentile(mut v: Vec<Duration>, p: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// A submission accepted through the core (checked, written to the store on disk, queued,
/// started when a slot is free) with `queued` already waiting, beside the same with an empty
/// queue; and one pass of the place publisher over them.
async fn accept_latency(queued: usize, n: usize) {
    let empty_dir = tempfile::tempdir().expect("dir");
    let empty = core(empty_dir.path());
    let mut base = Vec::with_capacity(n);
    for i in 0..n {
        let req = request(i, i % 997);
        let t = Instant::now();
        empty.submit(req, None).await.expect("accepted");
        base.push(t.elapsed());
        // Keep it empty: the Hold executor never ends a run, so end each here.
        empty
            .finish(
                &empty.store().all_live()[0].0,
                Outcome::Canceled("bench".into()),
            )
            .await
            .ok();
    }
    let full_dir = tempfile::tempdir().expect("dir");
    let full = core(full_dir.path());
    for i in 0..queued {
        full.submit(request(i, i % 997), None)
            .await
            .expect("accepted");
    }
    let mut at = Vec::with_capacity(n);
    for i in 0..n {
        let req = request(queued + i, i % 997);
        let t = Instant::now();
        full.submit(req, None).await.expect("accepted");
        at.push(t.elapsed());
    }
    let t = Instant::now();
    full.publish_places();
    let pass = t.elapsed();
    let waiting = full.dispatch().status("h100", Some(2)).waiting;
    println!();
    println!("## A submission accepted through the core, store on disk ({n} submissions)");
    println!("| queue | p50 | p99 |");
    println!("|---|---|---|");
    println!(
        "| {queued}+ waiting (ended with {waiting}) | {:.3} ms | {:.3} ms |",
        percentile(at.clone(), 0.5).as_secs_f64() * 1e3,
        percentile(at, 0.99).as_secs_f64() * 1e3
    );
    println!(
        "| empty (baseline) | {:.3} ms | {:.3} ms |",
        percentile(base.clone(), 0.5).as_secs_f64() * 1e3,
        percentile(base, 0.99).as_secs_f64() * 1e3
    );
    println!(
        "| telling all {waiting} their places (one publisher pass) | {:.2} ms | |",
        pass.as_secs_f64() * 1e3
    );
}

/// An identical `test` submission answered from the cache, as a client sees it over loopback
/// HTTP: POST (answered `202` once the cached result is stored), then GET of the result;
/// beside a POST of a new submission (queued, not yet run).
async fn cache_latency(n: usize) {
    let dir = tempfile::tempdir().expect("dir");
    let mut cfg = Config::new("http://127.0.0.1:9/v2", "org", "pipe", "unused");
    cfg.store.data_dir = Some(dir.path().to_path_buf());
    // What a cache answer costs, not its limit: one user asks `n` times, past the default of
    // 120 answers an hour (issue 34), which would answer 429 from the 121st on.
    cfg.fair.cache_hourly = kernelkite_service::dispatch::Most(None);
    let app = kernelkite_service::cli::serve::start(&cfg, Arc::new(Hold)).expect("service");
    // The original: a succeeded submission whose result the cache returns.
    let first = app
        .submit(request(0, 0), None)
        .await
        .expect("accepted")
        .submission;
    let result = kernelkite_service::result::ResultJson::parse(
        kernelkite_testkit::sample_result_json().as_bytes(),
    )
    .expect("result");
    app.finish(&first.id, Outcome::Succeeded(result))
        .await
        .expect("stored");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("port");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let serving = app.clone();
    tokio::spawn(async move {
        let _ = kernelkite_service::serve(serving, &cfg, listener, std::future::pending()).await;
    });
    let http = reqwest::Client::new();
    let body = |n: usize| {
        let mut config = sample_config();
        config["seed"] = json!(n);
        json!({"config": config, "queue": "h100", "user": "user-1"})
    };
    let mut hits = Vec::with_capacity(n);
    let mut misses = Vec::with_capacity(n);
    let mut by: BTreeMap<bool, usize> = BTreeMap::new();
    for i in 0..n {
        let t = Instant::now();
        let v: serde_json::Value = http
            .post(format!("{base}/v1/submissions"))
            .json(&body(0))
            .send()
            .await
            .expect("POST")
            .json()
            .await
            .expect("JSON");
        let id = v["id"]
            .as_str()
            .unwrap_or_else(|| panic!("no id in the answer: {v}"));
        let got: serde_json::Value = http
            .get(format!("{base}/v1/submissions/{id}"))
            .send()
            .await
            .expect("GET")
            .json()
            .await
            .expect("JSON");
        hits.push(t.elapsed());
        *by.entry(got["cached_from"] == first.id.as_str() && got["state"] == "succeeded")
            .or_default() += 1;
        let t = Instant::now();
        let r = http
            .post(format!("{base}/v1/submissions"))
            .json(&body(1 + i))
            .send()
            .await
            .expect("POST");
        assert_eq!(r.status().as_u16(), 202);
        misses.push(t.elapsed());
    }
    assert_eq!(
        by.get(&true),
        Some(&n),
        "every identical one was answered from the cache"
    );
    println!();
    println!("## An identical test submission answered from the cache, loopback HTTP ({n})");
    println!("| what | p50 | p99 |");
    println!("|---|---|---|");
    println!(
        "| cached: POST, then GET of the result | {:.3} ms | {:.3} ms |",
        percentile(hits.clone(), 0.5).as_secs_f64() * 1e3,
        percentile(hits, 0.99).as_secs_f64() * 1e3
    );
    println!(
        "| a new submission: POST, queued (baseline; its run is still to come) | {:.3} ms | {:.3} ms |",
        percentile(misses.clone(), 0.5).as_secs_f64() * 1e3,
        percentile(misses, 0.99).as_secs_f64() * 1e3
    );
}
