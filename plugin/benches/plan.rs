//! Benchmark: one whole `kernelkite-isolate plan` process on the DGX H100 fixture, against the
//! prototype's environment-hook logic (nproc, /proc/meminfo, a stub nvidia-smi) run in the same
//! process, same tree, same machine.
//!
//! `cargo bench -p kernelkite-isolate --bench plan` (set `KERNELKITE_BENCH_SHORT=1` for a run
//! under 30 s). Prints mean, median and p95 per invocation of each, and the in-process cost of
//! discovery + planning alone.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kernelkite_isolate::fakesys;
use kernelkite_isolate::planner::{plan, Policy};
use kernelkite_isolate::topology::Topology;

/// A scratch directory on tmpfs when there is one: fake trees are thousands of small files, and
/// sysfs itself lives in memory, so disk-backed /tmp would only measure the disk.
fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("kernelkite-fake")
        .tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .unwrap()
}

struct Stats {
    mean: Duration,
    median: Duration,
    p95: Duration,
}

fn stats(mut samples: Vec<Duration>) -> Stats {
    samples.sort_unstable();
    let n = samples.len();
    Stats {
        mean: samples.iter().sum::<Duration>() / n as u32,
        median: samples[n / 2],
        p95: samples[(n * 95 / 100).min(n - 1)],
    }
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

fn time_process(iterations: usize, mut make: impl FnMut() -> Command) -> Stats {
    let run = |cmd: &mut Command| {
        let status = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "{cmd:?} failed");
    };
    for _ in 0..3 {
        run(&mut make());
    }
    let samples = (0..iterations)
        .map(|_| {
            let mut cmd = make();
            let t = Instant::now();
            run(&mut cmd);
            t.elapsed()
        })
        .collect();
    stats(samples)
}

fn main() {
    let short = std::env::var_os("KERNELKITE_BENCH_SHORT").is_some();
    let iterations = if short { 30 } else { 300 };
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = scratch();
    let root = dir.path().join("dgx-h100");
    fakesys::dgx_h100().write_to(&root).unwrap();
    let bin_dir = dir.path().join("bin");
    std::fs::create_dir_all(&bin_dir).unwrap();
    std::fs::copy(
        manifest.join("benches/stub-nvidia-smi"),
        bin_dir.join("nvidia-smi"),
    )
    .unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let exe = env!("CARGO_BIN_EXE_kernelkite-isolate");
    let hook = manifest.join("benches/prototype-environment-hook.sh");

    // Both must produce their answer before they are timed.
    let out = Command::new(exe)
        .args(["plan", "--json", "--sysfs-root"])
        .arg(&root)
        .output()
        .unwrap();
    assert!(out.status.success());
    let out = Command::new("bash")
        .arg(&hook)
        .env("PATH", &path)
        .env("KERNELKITE_PROTO_ROOT", &root)
        .env("BUILDKITE_AGENT_NAME", "dgx-4")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let ours = time_process(iterations, || {
        let mut c = Command::new(exe);
        c.args(["plan", "--json", "--sysfs-root"]).arg(&root);
        c
    });
    let proto = time_process(iterations, || {
        let mut c = Command::new("bash");
        c.arg(&hook)
            .env("PATH", &path)
            .env("KERNELKITE_PROTO_ROOT", &root)
            .env("BUILDKITE_AGENT_NAME", "dgx-4");
        c
    });

    // The floor any process pays on this machine: fork, exec, exit.
    let floor = time_process(iterations, || Command::new("/bin/true"));

    let in_process: Vec<Duration> = (0..iterations)
        .map(|_| {
            let t = Instant::now();
            let topo = Topology::discover(&root).unwrap();
            let p = plan(&topo, &Policy::default()).unwrap();
            assert_eq!(p.slices.len(), 8);
            t.elapsed()
        })
        .collect();
    let lib = stats(in_process);
    let topo = Topology::discover(&root).unwrap();
    let plan_only: Vec<Duration> = (0..iterations)
        .map(|_| {
            let t = Instant::now();
            let p = plan(&topo, &Policy::default()).unwrap();
            std::hint::black_box(p);
            t.elapsed()
        })
        .collect();
    let planner = stats(plan_only);

    println!(
        "plan benchmark: DGX H100 fixture (224 CPUs, 8 GPUs) in {}, {iterations} iterations each",
        root.display()
    );
    println!("{:<46} {:>10} {:>10} {:>10}", "", "mean", "median", "p95");
    let row = |name: &str, s: &Stats| {
        println!(
            "{name:<46} {:>10} {:>10} {:>10}",
            ms(s.mean),
            ms(s.median),
            ms(s.p95)
        );
    };
    row("kernelkite-isolate plan --json (process)", &ours);
    row("prototype environment hook (bash, baseline)", &proto);
    row("/bin/true (process spawn floor)", &floor);
    row("Topology::discover + plan (in process)", &lib);
    row("plan only (in process)", &planner);
    let target = Duration::from_millis(5);
    println!(
        "target <= 5 ms per invocation: {}; faster than the prototype's hook: {} ({:.1}x)",
        if ours.median <= target {
            "met"
        } else {
            "MISSED"
        },
        if ours.median < proto.median {
            "yes"
        } else {
            "NO"
        },
        proto.median.as_secs_f64() / ours.median.as_secs_f64()
    );
}
