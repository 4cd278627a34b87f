//! `kernelkite-service demo`: the whole system on this machine in one command. It starts local
//! mode on a loopback port, submits the bundled example task over the HTTP API in test,
//! benchmark and leaderboard mode (and a wrong submission, which must fail its tests), follows
//! each over server-sent events as a backend would, and prints every state change as it
//! happens, the results, and where the time went.

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use serde_json::json;

use super::client::{Client, StateEvent};
use super::display;
use super::embedded::{self, Embedded};
use crate::local::timing::Phases;
use crate::local::LocalArgs;
use crate::task::bundled::{self, Bundled};
use crate::task::{self, Mode};

/// Which bundled task the demo runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Example {
    /// CUDA when this node has a GPU slice and nvcc, else the CPU task.
    Auto,
    /// Prefix sum in plain Python (any machine with python3).
    Cpu,
    /// Vector add in CUDA (nvcc and an NVIDIA GPU).
    Cuda,
}

/// `demo`'s settings.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// The bundled task to run.
    #[arg(long, value_enum, default_value = "auto")]
    pub example: Example,
    /// The local executor.
    #[command(flatten, next_help_heading = "Local executor")]
    pub local: LocalArgs,
}

/// One submission of the demo.
struct Step {
    mode: Mode,
    submission: &'static str,
    label: &'static str,
    expect_pass: bool,
}

/// What one step measured.
struct Measured {
    label: &'static str,
    phases: Option<Phases>,
    client: Duration,
    total: Duration,
    ok: bool,
}

// Over 80 lines: the demo's script: start, each step, the summary, in the order it prints.
/// Runs the demo; exit 0 when every step ended as expected.
pub async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let mut out = std::io::stdout();
    println!("kernelkite demo: the whole system on this machine, no Buildkite account\n");
    let service = embedded::start(&args.local).await?;
    let example = choose(args.example, &service);
    if example.name == bundled::PREFIXSUM_PY.name && std::env::var_os("KERNELKITE_PYTHON").is_none()
    {
        which::which("python3").context(
            "the bundled example needs python3 on PATH (or KERNELKITE_PYTHON); install python3",
        )?;
    }
    let dir = tempfile::tempdir().context("cannot create a temporary directory")?;
    example
        .write_to(dir.path())
        .context("cannot write the example task")?;
    let task = task::load(dir.path())?;

    let slices = service.local.slices();
    println!(
        "node plan   {} slice{} (one worker each), leases in {}",
        slices.len(),
        if slices.len() == 1 { "" } else { "s" },
        service.local.settings().run_dir.display()
    );
    for s in slices {
        println!("            {}", s.describe());
    }
    let sandbox = &service.local.settings().sandbox;
    match (sandbox.on, &sandbox.why_off) {
        (true, _) => println!(
            "sandbox     on: each job as its slice's own user, private /tmp and /dev, no network, read-only system"
        ),
        (false, Some(why)) => println!("sandbox     OFF: {why}"),
        (false, None) => println!(
            "sandbox     OFF (--sandbox off): commands run as this service's user with its view of the machine"
        ),
    }
    println!(
        "service     {} (the production HTTP API, local executor)",
        service.base
    );
    println!(
        "task        examples/{} ({}; ranking_by {})",
        example.name,
        example.about,
        task.task["ranking_by"].as_str().unwrap_or("last")
    );
    let _ = out.flush();

    let steps = [
        Step {
            mode: Mode::Test,
            submission: example.submission,
            label: "test",
            expect_pass: true,
        },
        Step {
            mode: Mode::Benchmark,
            submission: example.submission,
            label: "benchmark",
            expect_pass: true,
        },
        Step {
            mode: Mode::Leaderboard,
            submission: example.submission,
            label: "leaderboard",
            expect_pass: true,
        },
        Step {
            mode: Mode::Test,
            submission: example.wrong_submission,
            label: "test (wrong)",
            expect_pass: false,
        },
    ];
    let client = Client::new(&service.base, None);
    let mut measured = Vec::new();
    for step in &steps {
        let m = run_step(&service, &client, &task, &example, step).await?;
        measured.push(m);
    }
    print_timings(&measured);
    let failed: Vec<&str> = measured.iter().filter(|m| !m.ok).map(|m| m.label).collect();
    if failed.is_empty() {
        println!("\ndemo passed: every submission ended as expected.");
        println!("next: submit your own task with `kernelkite-service submit --task DIR --submission FILE --mode test`");
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!(
            "\ndemo FAILED: {} did not end as expected (see above)",
            failed.join(", ")
        );
        Ok(ExitCode::FAILURE)
    }
}

/// The CUDA task when asked, or on `auto` when a slice has a GPU and nvcc is installed.
fn choose(example: Example, service: &Embedded) -> Bundled {
    let has_gpu = service.local.slices().iter().any(|s| s.gpu.is_some());
    let nvcc = std::env::var_os("KERNELKITE_NVCC").is_some()
        || which::which("nvcc").is_ok()
        || std::path::Path::new("/usr/local/cuda/bin/nvcc").exists();
    match example {
        Example::Cuda => bundled::VECTORADD_CUDA,
        Example::Auto if has_gpu && nvcc => bundled::VECTORADD_CUDA,
        _ => bundled::PREFIXSUM_PY,
    }
}

// Over 80 lines: one demo step from submission to printed result, in the order the user reads it.
async fn run_step(
    service: &Embedded,
    client: &Client,
    task: &task::TaskDefinition,
    example: &Bundled,
    step: &Step,
) -> anyhow::Result<Measured> {
    println!(
        "\n── {} ── {} with {}",
        step.label,
        step.mode.as_str(),
        step.submission
    );
    let text = example.file(step.submission).unwrap_or_default();
    let config = task::build_config(task, text, None, step.mode);
    let body = json!({
        "config": config,
        "queue": "local",
        "run_id": format!("demo-{}", step.label.replace([' ', '(', ')'], "")),
        "timeout_s": 600,
    });
    let sent = Utc::now();
    let id = client.submit(&body).await?;
    let mut first: Option<DateTime<Utc>> = None;
    let local = service.local.clone();
    let mut terminal: Option<StateEvent> = None;
    let submission = client
        .follow(&id, |ev| {
            let t0 = *first.get_or_insert(ev.at.unwrap_or(ev.received));
            let at = ev.at.unwrap_or(ev.received);
            let ms = (at - t0).num_microseconds().unwrap_or(0) as f64 / 1000.0;
            let report = local.report(&id);
            let note = match ev.state.as_str() {
                "scheduled" => report
                    .as_ref()
                    .and_then(|r| r.slice)
                    .map(|s| format!("job #{} on slice {s}", report.as_ref().map_or(0, |r| r.number)))
                    .unwrap_or_default(),
                "running" => report
                    .as_ref()
                    .and_then(|r| r.isolation.clone())
                    .map(|i| {
                        if i == crate::local::UNENFORCED {
                            "UNENFORCED: no CPU/memory limits here (run as root with cgroups to enforce)".to_string()
                        } else {
                            format!("confined: {i}")
                        }
                    })
                    .unwrap_or_default(),
                "fetching" => "the job ended; reading its result.json".into(),
                _ => String::new(),
            };
            println!("  +{ms:8.1} ms  {:<10} {note}", ev.state);
            let _ = std::io::stdout().flush();
            if ev.submission.is_some() {
                terminal = Some(ev.clone());
            }
        })
        .await?;
    let received = terminal.map_or_else(Utc::now, |t| t.received);
    let state = submission["state"].as_str().unwrap_or("?");
    let result = &submission["result"];
    let passed = state == "succeeded" && display::all_passed(result);
    if state == "succeeded" {
        print!("{}", display::result_table(result));
    } else {
        println!(
            "  no result: {}",
            submission["error"].as_str().unwrap_or("(no reason given)")
        );
    }
    if step.mode == Mode::Leaderboard {
        let rank = task.task["ranking_by"].as_str().unwrap_or("last");
        if let Some(s) = display::score(result, rank) {
            println!(
                "  score ({rank} of the ranked run's means): {}",
                display::seconds(s)
            );
        }
    }
    let ok = state == "succeeded" && passed == step.expect_pass;
    println!(
        "  {}",
        match (ok, step.expect_pass) {
            (true, true) => "✓ passed".to_string(),
            (true, false) => "✓ failed its tests, as a wrong submission must".to_string(),
            (false, true) => format!("✗ expected to pass; the submission ended {state}"),
            (false, false) => format!("✗ expected its tests to fail; the submission ended {state}"),
        }
    );
    let report = service.local.report(&id);
    // The job's directory and report are settled once the end is stored; give it a moment.
    let mut report = report;
    for _ in 0..50 {
        if report.as_ref().is_some_and(|r| r.timings.stored.is_some()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        report = service.local.report(&id);
    }
    let stored = report.as_ref().and_then(|r| r.timings.stored);
    let client_phase = stored
        .and_then(|s| (received - s).to_std().ok())
        .unwrap_or_default();
    Ok(Measured {
        label: step.label,
        phases: report.map(|r| r.timings.phases()),
        client: client_phase,
        total: (received - sent).to_std().unwrap_or_default(),
        ok,
    })
}

fn print_timings(measured: &[Measured]) {
    println!("\nwhere the time went (end to end, by phase)");
    let ms = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1e3);
    println!(
        "  {:<13} {:>8} {:>8} {:>10} {:>11} {:>8} {:>8} {:>9} {:>10}",
        "ms", "queue", "lease", "isolation", "evaluation", "stored", "client", "total", "overhead"
    );
    for m in measured {
        let p = m.phases.unwrap_or_default();
        println!(
            "  {:<13} {:>8} {:>8} {:>10} {:>11} {:>8} {:>8} {:>9} {:>10}",
            m.label,
            ms(p.queue),
            ms(p.lease),
            ms(p.isolation),
            ms(p.evaluation),
            ms(p.store),
            ms(m.client),
            ms(m.total),
            ms(p.overhead()),
        );
    }
    for line in [
        "queue: waiting for a free slice; lease: the environment hook (slice lease, cgroup);",
        "isolation: the command hook confining the runner, and the runner starting;",
        "evaluation: the runs, as result.json records them; stored: the runner writing",
        "result.json and exiting, the result checked and stored (pre-exit cleans up beside it);",
        "client: until this client's event stream had it;",
        "overhead: the local executor's own share (lease + isolation + stored).",
    ] {
        println!("  {line}");
    }
}
