//! Benchmark: local mode end to end, through the HTTP API, the local executor, the plugin's
//! hooks and the runner as separate processes.
//!
//! - The demo's phase timings: the bundled prefix-sum task in test mode, by phase (queue →
//!   slice leased → isolation → evaluation → result stored → client).
//! - The local executor's own overhead per job (everything but the evaluation), on a trivial
//!   task, against the same run's baseline: the runner alone on the same payload (its own
//!   start-up and result writing, which the executor's overhead includes). Target: ≤ 30 ms
//!   median.
//! - Submissions per minute with the trivial task, all submitted at once: on this machine's
//!   own plan, and on a two-slice fixture of its CPUs.
//!
//! `cargo bench -p kernelkite-testkit --bench local_mode` (`KERNELKITE_BENCH_SHORT=1`: a
//! run of a few seconds). Jobs are confined by real cgroups where this machine allows it
//! (root), else run unenforced; the output says which.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kernelkite_service::local::timing::Phases;
use kernelkite_service::task::{self, Mode};
use kernelkite_testkit::local::{
    examples_dir, fixture_node, local_args, local_stack, probe_config, real_cgroups, start_stack,
    Confinement, LocalStack,
};
use kernelkite_testkit::local_bins;
use serde_json::{json, Value};

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

struct Row {
    median: f64,
    p95: f64,
    mean: f64,
}

fn stats(mut v: Vec<f64>) -> Row {
    v.sort_by(f64::total_cmp);
    Row {
        median: percentile(&v, 0.5),
        p95: percentile(&v, 0.95),
        mean: v.iter().sum::<f64>() / v.len().max(1) as f64,
    }
}

fn print_row(name: &str, r: &Row) {
    println!(
        "  {name:<44} median {:>8.2} ms   p95 {:>8.2} ms   mean {:>8.2} ms",
        r.median, r.p95, r.mean
    );
}

/// Runs `config` `n` times, one after another; the phases of each job and the client phase.
async fn sequential(stack: &LocalStack, config: &Value, n: usize) -> Vec<(Phases, Duration)> {
    let mut out = Vec::new();
    for _ in 0..n {
        let id = stack.submit(config.clone()).await;
        let done = stack.wait(&id).await;
        let seen = chrono::Utc::now();
        assert_eq!(done["state"], "succeeded", "{done}");
        let mut report = stack.local.report(&id);
        for _ in 0..100 {
            if report.as_ref().is_some_and(|r| r.timings.stored.is_some()) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
            report = stack.local.report(&id);
        }
        let r = report.expect("report");
        let client = r
            .timings
            .stored
            .and_then(|s| (seen - s).to_std().ok())
            .unwrap_or_default();
        out.push((r.timings.phases(), client));
    }
    out
}

fn print_phases(runs: &[(Phases, Duration)]) {
    let col = |f: &dyn Fn(&(Phases, Duration)) -> Duration| {
        stats(runs.iter().map(|r| ms(f(r))).collect())
    };
    print_row("queue", &col(&|r| r.0.queue));
    print_row("slice leased (environment hook)", &col(&|r| r.0.lease));
    print_row(
        "isolation (command hook, runner start)",
        &col(&|r| r.0.isolation),
    );
    print_row("evaluation (the runs)", &col(&|r| r.0.evaluation));
    print_row(
        "result stored (runner exit, check, store)",
        &col(&|r| r.0.store),
    );
    print_row("client (event reaches the client)", &col(&|r| r.1));
    print_row(
        "slice released (runner exit, pre-exit)",
        &col(&|r| r.0.release),
    );
    print_row(
        "OVERHEAD local executor (all but runs)",
        &col(&|r| r.0.overhead()),
    );
    print_row(
        "slice held beyond the runs",
        &col(&|r| r.0.slice_overhead()),
    );
}

/// The plugin's three hooks alone, as the executor runs them for a job (same plan, run dir,
/// cgroups), around a command that does nothing: what a job costs in hooks.
fn hooks_alone(bins: &kernelkite_testkit::local::Bins, stack: &LocalStack, n: usize) -> Vec<f64> {
    let s = stack.local.settings();
    let slice = stack.local.slices()[0].index.to_string();
    let dir = tempfile::tempdir().unwrap();
    let mut out = Vec::new();
    for i in 0..n {
        let job = format!("bench-hooks-{}-{i}", std::process::id());
        let hook = |name: &str| {
            let mut c = Command::new(&bins.isolate);
            c.arg(name)
                .arg("--run-dir")
                .arg(&s.run_dir)
                .arg("--plan-file")
                .arg(stack.local.plan_file())
                .arg("--sysfs-root")
                .arg(&s.sysfs_root)
                .arg("--cgroup-root")
                .arg(&s.cgroup_root)
                .env_clear()
                .env("PATH", std::env::var("PATH").unwrap_or_default())
                .env("BUILDKITE_JOB_ID", &job)
                .env("BUILDKITE_AGENT_NAME", "bench")
                .env("BUILDKITE_AGENT_META_DATA_GPU_INDEX", &slice)
                .env(
                    "BUILDKITE_PLUGIN_CONFIGURATION",
                    serde_json::Value::Object(s.plugin_config.clone()).to_string(),
                )
                .env("BUILDKITE_COMMAND", "true")
                // As the executor runs them: in the sandbox only where it decided so.
                .env(
                    "KERNELKITE_SANDBOX",
                    if s.sandbox.on { "on" } else { "off" },
                )
                .current_dir(dir.path());
            c
        };
        let t = Instant::now();
        for (name, extra) in [
            ("environment", vec!["--export", "shell"]),
            ("command", vec![]),
            ("pre-exit", vec![]),
        ] {
            let o = hook(name).args(extra).output().unwrap();
            assert!(
                o.status.success(),
                "{name}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        out.push(ms(t.elapsed()));
    }
    out
}

/// The runner alone on `config`: its wall time minus the evaluation span it records.
fn runner_alone(runner: &std::path::Path, config: &Value, n: usize) -> Vec<f64> {
    let dir = tempfile::tempdir().unwrap();
    let payload = dir.path().join("payload.txt");
    std::fs::write(
        &payload,
        kernelkite_kernelbot::payload::encode(config).unwrap(),
    )
    .unwrap();
    let mut out = Vec::new();
    for i in 0..n {
        let result = dir.path().join(format!("result-{i}.json"));
        let t = Instant::now();
        let st = Command::new(runner)
            .arg("--payload-file")
            .arg(&payload)
            .arg("--output")
            .arg(&result)
            .arg("--workdir")
            .arg(dir.path().join(format!("work-{i}")))
            .output()
            .unwrap();
        let wall = t.elapsed();
        assert!(
            st.status.success(),
            "{}",
            String::from_utf8_lossy(&st.stderr)
        );
        let text = std::fs::read_to_string(&result).unwrap();
        let mut timings = kernelkite_service::local::timing::Timings::default();
        timings.note_result(&text);
        let eval = match (timings.eval_start, timings.eval_end) {
            (Some(s), Some(e)) => (e - s).to_std().unwrap_or_default(),
            _ => Duration::ZERO,
        };
        out.push(ms(wall.saturating_sub(eval)));
    }
    out
}

async fn throughput(stack: &LocalStack, config: &Value, n: usize) -> (f64, Duration) {
    let t = Instant::now();
    let mut ids = Vec::new();
    for _ in 0..n {
        ids.push(stack.submit(config.clone()).await);
    }
    for id in &ids {
        let done = stack.wait(id).await;
        assert_eq!(done["state"], "succeeded", "{done}");
    }
    let took = t.elapsed();
    (n as f64 / took.as_secs_f64() * 60.0, took)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    if kernelkite_testkit::python().is_none() {
        println!("local_mode: skipped, python3 is not available");
        return;
    }
    let short = std::env::var_os("KERNELKITE_BENCH_SHORT").is_some();
    let (n_jobs, n_demo, n_burst) = if short { (15, 3, 12) } else { (100, 10, 60) };
    let bins = local_bins!();
    let how = match real_cgroups() {
        Ok(()) => Confinement::Real,
        Err(why) => {
            println!("local_mode: jobs run UNENFORCED here ({why})");
            Confinement::Unenforced
        }
    };
    // As on a node: job directories on disk (the data dir), the hooks' run dir on tmpfs
    // (`/run/kernelkite`).
    let disk = Arc::new(tempfile::tempdir().unwrap());
    let tmpfs = kernelkite_testkit::scratch();
    let mut args = local_args(&bins, None, how, disk.path());
    if how == Confinement::Unenforced {
        args.run_dir = Some(tmpfs.path().join("run"));
    }
    let stack = start_stack(args, disk.clone(), |_| {}).await;
    let runner_dir = bins.runner.parent().map(|p| p.display().to_string());
    println!(
        "local mode benchmark: {} slice(s) on this machine's own plan, jobs {}, binaries in {}",
        stack.local.slices().len(),
        if how == Confinement::Real {
            "confined by real cgroups"
        } else {
            "unenforced"
        },
        runner_dir.unwrap_or_default()
    );
    println!(
        "job directories in {} (disk), run dir {} (tmpfs)",
        stack.local.settings().local_dir.display(),
        stack.local.settings().run_dir.display(),
    );

    // The demo's phase timings: the bundled task in test mode.
    let dir = examples_dir().join("prefixsum_py");
    let t = task::load(&dir).unwrap();
    let sub = std::fs::read_to_string(dir.join("submission.py")).unwrap();
    let demo = task::build_config(&t, &sub, None, Mode::Test);
    let _ = sequential(&stack, &demo, 1).await; // warm-up
    println!(
        "\nthe demo's phases: examples/prefixsum_py, test mode, {n_demo} runs one after another"
    );
    print_phases(&sequential(&stack, &demo, n_demo).await);

    // The executor's own overhead on a trivial task, and the runner alone in the same run.
    let trivial = probe_config("test", json!([{"sleep_ms": 0}]));
    println!("\ntrivial task (one case, no work), {n_jobs} jobs one after another");
    let runs = sequential(&stack, &trivial, n_jobs).await;
    print_phases(&runs);
    let baseline = stats(runner_alone(&bins.runner, &trivial, n_jobs));
    print_row("BASELINE runner alone (its own share)", &baseline);
    let hooks = stats(hooks_alone(&bins, &stack, n_jobs));
    print_row("BASELINE the three hooks alone (command `true`)", &hooks);
    let overhead = stats(runs.iter().map(|r| ms(r.0.overhead())).collect());
    println!(
        "  target: local executor overhead <= 30 ms median: {} ({:.2} ms; the runner alone {:.2} ms, the hooks alone {:.2} ms)",
        if overhead.median <= 30.0 { "met" } else { "MISSED" },
        overhead.median,
        baseline.median,
        hooks.median,
    );

    // Throughput.
    println!("\nthroughput: {n_burst} trivial submissions at once");
    let (per_min, took) = throughput(&stack, &trivial, n_burst).await;
    println!(
        "  this machine's plan ({} slice(s)): {per_min:.0} submissions/min ({:.2} s for {n_burst})",
        stack.local.slices().len(),
        took.as_secs_f64()
    );
    drop(stack);
    let node = fixture_node(&bins, 2);
    let two = local_stack(&bins, Some(&node), how).await;
    let (per_min, took) = throughput(&two, &trivial, n_burst).await;
    println!(
        "  fixture of this machine's CPUs, 2 slices: {per_min:.0} submissions/min ({:.2} s for {n_burst})",
        took.as_secs_f64()
    );
}
