//! Benchmark: a trivial submission end to end through real Buildkite agents, against local
//! mode (the service's own emulation of an agent running the same hooks) in the same run.
//!
//! Through real agents (`kernelkite_testkit::deployment`: the service's Buildkite executor, the
//! fake Buildkite, the pipeline agent's `pipeline upload`, a node `setup` made with one real
//! `buildkite-agent start` per slice, real cgroups), per submission:
//! - **end to end**: `POST /v1/submissions` → the client holds the result (long-poll);
//! - build created → client: what Buildkite's side and the agents add;
//! - the waits for an agent to ping for a job (the pipeline agent for the routing step, a
//!   node's agent for the uploaded one: every second here, as the fake tells agents to), and
//!   the pipeline agent's upload job (assigned → finished);
//! - the node agent's own time for the evaluation job (accepted → finished), and within it the
//!   hooks (`environment`, `command` less the runner's evaluation, `pre-exit`, both levels),
//!   the checkout and the artifact upload, from the job log's section timestamps;
//! - finished → client (webhook, artifact fetch, check, store, wake).
//!
//! Local mode, same machine, same task: end to end, and its executor's overhead (all but the
//! evaluation).
//!
//! `cargo bench -p kernelkite-testkit --bench real_agent` (`KERNELKITE_BENCH_SHORT=1`: three
//! submissions each). Needs what `tests/tests/real_agent_node.rs` needs (root, writable
//! cgroups, the agent built by `scripts/buildkite-agent.sh`); says so and exits otherwise.

use std::time::{Duration, Instant};

use kernelkite_testkit::deployment::deployment;
use kernelkite_testkit::fake_buildkite::agent_api::AgentJob;
use kernelkite_testkit::fake_buildkite::Route;
use kernelkite_testkit::local::{local_stack, probe_config, Confinement};
use kernelkite_testkit::local_bins;
use serde_json::{json, Value};

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn row(name: &str, mut v: Vec<f64>) {
    if v.is_empty() {
        println!("  {name:<46} (no figures)");
        return;
    }
    v.sort_by(f64::total_cmp);
    let at = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    println!(
        "  {name:<46} median {:>8.1} ms   p95 {:>8.1} ms   mean {:>8.1} ms",
        at(0.5),
        at(0.95),
        v.iter().sum::<f64>() / v.len() as f64
    );
}

/// The log's sections: (header, start ms) in order, from the agent's ANSI timestamps
/// (`ESC _bk;t=<unix ms> BEL` before each line) and the bootstrap's `~~~ ` headers; the last
/// line's time closes the last section.
fn sections(log: &str) -> (Vec<(String, u64)>, u64) {
    let mut out = Vec::new();
    let mut last = 0;
    for line in log.lines() {
        let Some(rest) = line.split("_bk;t=").nth(1) else {
            continue;
        };
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        let Ok(t) = digits.parse::<u64>() else {
            continue;
        };
        last = t;
        let text = rest[digits.len()..].trim_start_matches('\u{7}');
        if let Some(h) = text.strip_prefix("~~~ ") {
            out.push((h.to_string(), t));
        }
    }
    (out, last)
}

/// Milliseconds of the sections whose header satisfies `pick`.
fn spent(log: &str, pick: &dyn Fn(&str) -> bool) -> f64 {
    let (s, end) = sections(log);
    let mut total = 0;
    for (i, (h, t)) in s.iter().enumerate() {
        let next = s.get(i + 1).map_or(end, |n| n.1);
        if pick(h) {
            total += next.saturating_sub(*t);
        }
    }
    total as f64
}

fn between(a: Option<Instant>, b: Option<Instant>) -> f64 {
    match (a, b) {
        (Some(a), Some(b)) => ms(b.saturating_duration_since(a)),
        _ => f64::NAN,
    }
}

#[derive(Default)]
struct Figures {
    end_to_end: Vec<f64>,
    created_to_client: Vec<f64>,
    wait_for_pipeline_agent: Vec<f64>,
    upload_job: Vec<f64>,
    wait_for_node_agent: Vec<f64>,
    agent_job: Vec<f64>,
    hooks: Vec<f64>,
    checkout: Vec<f64>,
    artifacts: Vec<f64>,
    agent_rest: Vec<f64>,
    finished_to_client: Vec<f64>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() {
    let short = std::env::var_os("KERNELKITE_BENCH_SHORT").is_some();
    let n = if short { 3 } else { 20 };
    let bins = local_bins!();
    let Some(d) = deployment(&bins.isolate, &bins.runner).await else {
        println!("real_agent: skipped (see the line above)");
        return;
    };
    let trivial = probe_config("test", json!([{}]));
    println!("real_agent: {n} trivial submissions one after another (one test case, no work)");

    // Warm-up: the first job clones the plugin and the repository on each agent.
    for _ in 0..2 {
        let id = d.submit(trivial.clone(), "h100").await;
        assert_eq!(
            d.wait(&id, Duration::from_secs(120)).await["state"],
            "succeeded"
        );
    }
    let mut f = Figures::default();
    for _ in 0..n {
        let t0 = Instant::now();
        let id = d.submit(trivial.clone(), "h100").await;
        let v = d.wait(&id, Duration::from_secs(120)).await;
        let client = Instant::now();
        assert_eq!(v["state"], "succeeded", "{v}\n{}", d.logs());
        f.end_to_end.push(ms(client - t0));
        let (number, eval) = d.eval_jobs(&id).await;
        let jobs = d.stack.fake.jobs_of(number);
        let upload: &AgentJob = jobs
            .iter()
            .find(|j| !j.step.label.contains("kernelbot"))
            .unwrap();
        let eval = &eval[0];
        let created = d
            .stack
            .fake
            .requests()
            .iter()
            .rev()
            .find(|r| r.route == Route::CreateBuild && r.build == Some(number))
            .map(|r| r.at);
        f.created_to_client.push(between(created, Some(client)));
        f.wait_for_pipeline_agent
            .push(between(created, upload.times.assigned));
        f.upload_job
            .push(between(upload.times.assigned, upload.times.finished));
        f.wait_for_node_agent
            .push(between(upload.times.finished, eval.times.assigned));
        let job = between(eval.times.accepted, eval.times.finished);
        f.agent_job.push(job);
        let log = eval.log();
        let evaluation = v["result"]["runs"]["test"]["run"]["duration"]
            .as_f64()
            .unwrap_or(0.0)
            * 1e3;
        let hooks = spent(&log, &|h| h.contains(" hook")) - evaluation;
        let checkout = spent(&log, &|h| h.starts_with("Preparing working directory"));
        let artifacts = spent(&log, &|h| h.starts_with("Uploading artifacts"));
        f.hooks.push(hooks);
        f.checkout.push(checkout);
        f.artifacts.push(artifacts);
        f.agent_rest
            .push(job - hooks - evaluation - checkout - artifacts);
        f.finished_to_client
            .push(between(eval.times.finished, Some(client)));
    }
    println!("through real agents (buildkite-agent v3.137.0, pipeline upload, real cgroups):");
    row("END TO END (POST -> client holds result)", f.end_to_end);
    row("build created -> client", f.created_to_client);
    row(
        "created -> pipeline agent takes its job",
        f.wait_for_pipeline_agent,
    );
    row("pipeline agent: upload job", f.upload_job);
    row(
        "upload done -> node agent takes the step",
        f.wait_for_node_agent,
    );
    row("node agent: evaluation job (accept->finish)", f.agent_job);
    row("  of which hooks (all but the evaluation)", f.hooks);
    row("  of which checkout", f.checkout);
    row("  of which artifact upload", f.artifacts);
    row("  of which the agent's own (the rest)", f.agent_rest);
    row(
        "job finished -> client (webhook, fetch)",
        f.finished_to_client,
    );
    drop(d);

    // The same task through local mode: the service's own agent emulation, same hooks.
    let stack = local_stack(&bins, None, Confinement::Real).await;
    let mut local = Vec::new();
    let mut overhead = Vec::new();
    for i in 0..n + 2 {
        let t0 = Instant::now();
        let id = stack.submit(trivial.clone()).await;
        let v: Value = stack.wait(&id).await;
        let took = ms(t0.elapsed());
        assert_eq!(v["state"], "succeeded", "{v}");
        if i >= 2 {
            local.push(took);
            if let Some(r) = stack.local.report(&id) {
                overhead.push(ms(r.timings.phases().overhead()));
            }
        }
    }
    println!("through local mode (the emulated agent: the same hooks run by the service):");
    row("END TO END (POST -> client holds result)", local);
    if !overhead.is_empty() {
        row("executor overhead (all but the evaluation)", overhead);
    }
}
