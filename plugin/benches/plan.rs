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

use kernelkite_topology::fakesys;
use kernelkite_topology::planner::{plan, Policy};
use kernelkite_topology::topology::Topology;

mod common;
use common::{output_ok, path_with, stats, stub_nvidia_smi_bin, Stats, Table};
use kernelkite_testkit::scratch;

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
    let path = path_with(&stub_nvidia_smi_bin(dir.path()));
    let exe = env!("CARGO_BIN_EXE_kernelkite-isolate");
    let hook = manifest.join("benches/prototype-environment-hook.sh");

    // Both must produce their answer before they are timed.
    output_ok(
        Command::new(exe)
            .args(["plan", "--json", "--sysfs-root"])
            .arg(&root),
    );
    output_ok(
        Command::new("bash")
            .arg(&hook)
            .env("PATH", &path)
            .env("KERNELKITE_PROTO_ROOT", &root)
            .env("BUILDKITE_AGENT_NAME", "dgx-4"),
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
    let table = Table::new(46);
    let row = |name: &str, s: &Stats| table.row(name, s);
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
