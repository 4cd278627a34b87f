//! Runner overhead: the runner's wall time minus the harness's own, for a trivial harness.
//!
//! Each round runs, in turn: the harness directly (`python3 eval.py test CASES`, the
//! baseline), the release runner on the same harness, and a prototype-style Python runner
//! (`benches/prototype_runner.py`: interpreter start, imports, decode, run, result.json).
//! Overheads are paired per round (runner − direct, prototype − direct) and reported as
//! median and p95, together with the runner's wall time minus the harness duration it
//! measured itself. `KERNELKITE_BENCH_SHORT=1` runs 30 rounds instead of 200;
//! `KERNELKITE_BENCH_ROUNDS=N` sets any count.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

const HARNESS: &str = "import os, sys\n\
with open(sys.argv[2]) as f:\n    cases = f.read().splitlines()\n\
out = os.fdopen(int(os.environ['POPCORN_FD']), 'w')\n\
out.write(f'test-count: {len(cases)}\\ncheck: pass\\n')\n";

fn time_it(cmd: &mut Command) -> Duration {
    let t = Instant::now();
    let status = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("spawn");
    let d = t.elapsed();
    assert!(status.success(), "{cmd:?} failed: {status}");
    d
}

fn ms(d: f64) -> String {
    format!("{:.2} ms", d * 1e3)
}

fn stats(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let median = if v.len() % 2 == 1 {
        v[v.len() / 2]
    } else {
        (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
    };
    let p95 = v[((v.len() as f64 * 0.95).ceil() as usize).clamp(1, v.len()) - 1];
    (median, p95)
}

fn main() {
    let Some(py) = kernelkite_testkit_leaf::python() else {
        println!("skipping: python3 is not available");
        return;
    };
    let rounds: usize = std::env::var("KERNELKITE_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if std::env::var_os("KERNELKITE_BENCH_SHORT").is_some() {
            30
        } else {
            200
        });
    // The release runner a node installs (scripts/node-binaries.sh), where it was built; else
    // this benchmark's own build (unoptimised in the test command's short runs).
    let runner = kernelkite_testkit_leaf::node_binary("kernelkite-runner")
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_kernelkite-runner")));
    println!("the runner measured: {}", runner.display());
    let proto = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/prototype_runner.py");
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = json!({"lang": "py", "mode": "test", "main": "eval.py", "sources": {"eval.py": HARNESS},
                     "tests": [{"size": 1024, "seed": 1}]});
    let payload = kernelkite_kernelbot::payload::encode(&cfg).expect("encode");
    let pfile = dir.path().join("payload.txt");
    std::fs::write(&pfile, &payload).expect("payload");
    std::fs::write(dir.path().join("eval.py"), HARNESS).expect("harness");
    std::fs::write(dir.path().join("cases.txt"), "size: 1024; seed: 1\n").expect("cases");
    let result = dir.path().join("result.json");

    let direct = || {
        time_it(
            Command::new(py)
                .args(["eval.py", "test", "cases.txt"])
                .current_dir(dir.path())
                .env("POPCORN_FD", "1"),
        )
    };
    let ours = || {
        let wall = time_it(
            Command::new(&runner)
                .arg("--payload-file")
                .arg(&pfile)
                .arg("--output")
                .arg(&result)
                .args(["--python", py])
                .env("RUST_LOG", "warn"),
        );
        let r: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&result).expect("result")).expect("json");
        assert_eq!(r["runs"]["test"]["run"]["passed"], true, "{r}");
        (
            wall,
            r["runs"]["test"]["run"]["duration"]
                .as_f64()
                .expect("duration"),
        )
    };
    let prototype = || {
        time_it(
            Command::new(py)
                .arg(&proto)
                .arg(&result)
                .env("KERNELBOT_PAYLOAD", &payload)
                .current_dir(dir.path()),
        )
    };

    for _ in 0..3 {
        direct();
        ours();
        prototype();
    }
    let (mut d_all, mut r_all, mut p_all) = (Vec::new(), Vec::new(), Vec::new());
    let (mut over, mut self_over, mut proto_over) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let d = direct().as_secs_f64();
        let (r, harness) = ours();
        let r = r.as_secs_f64();
        let p = prototype().as_secs_f64();
        over.push(r - d);
        self_over.push(r - harness);
        proto_over.push(p - d);
        d_all.push(d);
        r_all.push(r);
        p_all.push(p);
    }
    let line = |name: &str, v: Vec<f64>| {
        let (m, p) = stats(v);
        println!("{name:<52} median {:>10}   p95 {:>10}", ms(m), ms(p));
        m
    };
    println!("kernelkite-runner overhead, {rounds} rounds, python {py}");
    line("harness run directly (baseline)", d_all);
    line("kernelkite-runner wall", r_all);
    line("prototype-style Python runner wall", p_all);
    let ours_m = line("OVERHEAD kernelkite-runner (runner - direct)", over);
    line("  runner wall - harness duration it measured", self_over);
    let proto_m = line("OVERHEAD Python prototype (prototype - direct)", proto_over);
    println!(
        "target: median runner overhead <= 20 ms: {}",
        if ours_m <= 0.020 { "met" } else { "NOT met" }
    );
    if ours_m > 0.0 {
        println!(
            "the prototype-style runner costs {:.1}x the Rust runner's overhead",
            proto_m / ours_m
        );
    }
}
