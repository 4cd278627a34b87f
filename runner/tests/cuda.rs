//! CUDA submissions: a fake `nvcc` on PATH exercises discovery, the compile command, compile
//! errors, the removal of sources before the binary runs, and the compile timeout. A real
//! nvcc + GPU test runs where both exist and otherwise says why it skipped.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use kernelkite_kernelbot::config::RunConfig;
use kernelkite_kernelbot::result::SystemInfo;
use kernelkite_runner::eval::{self, FailureKind, Options};
use serde_json::{json, Value};

/// A fake nvcc: `--version` like the real one; a compile logs its arguments, fails on
/// `#error` in a source, else writes `eval.out`, a script that runs the test harness.
fn fake_nvcc(dir: &Path, python: &str) -> std::path::PathBuf {
    let harness = harness_dir().join("popcorn_harness.py");
    script(
        dir,
        "nvcc",
        &format!(
            r#"#!/bin/sh
if [ "$1" = "--version" ]; then
  echo "nvcc: NVIDIA (R) Cuda compiler driver"
  echo "Cuda compilation tools, release 12.4, V12.4.131"
  exit 0
fi
echo "$@" > "{log}"
[ -f slow.cu ] && sleep 30
out=""
for a in "$@"; do
  case "$a" in *.cu) if grep -q '#error' "$a"; then echo "$a(1): error: user code does not compile" >&2; exit 1; fi ;; esac
done
while [ "$#" -gt 0 ]; do
  [ "$1" = "-o" ] && out="$2"
  shift
done
[ -f task.h ] || {{ echo "task.h missing at compile time" >&2; exit 2; }}
printf '#!/bin/sh\nexec {python} {harness} "$@"\n' > "$out"
chmod +x "$out"
echo "ptxas info: 0 bytes spill stores"
"#,
            log = dir.join("nvcc-args.log").display(),
            python = python,
            harness = harness.display(),
        ),
    )
}

fn cu_config(mode: &str, main_source: &str) -> Value {
    json!({
        "lang": "cu",
        "mode": mode,
        "sources": {"eval.cu": main_source, "submission.cu": "__global__ void k() {}\n"},
        "headers": {"task.h": "#pragma once\n"},
        "arch": 90,
        "defines": {"N": 1024},
        "tests": [{"behave": "pass", "n": 1}],
        "benchmarks": [{"behave": "pass", "n": 2}],
        "seed": 31337,
        "test_timeout": 20, "benchmark_timeout": 20, "ranked_timeout": 20,
    })
}

#[test]
fn fake_nvcc_compiles_and_the_binary_runs_without_the_sources() {
    let Some(py) = need_python() else { return };
    let tools = tempfile::tempdir().unwrap();
    let nvcc = fake_nvcc(tools.path(), py);
    let path = path_with(Some(tools.path()));
    let r = run_config(
        &cu_config("leaderboard", "int main() {}\n"),
        &[],
        &[("PATH", &path)],
    );
    assert_eq!(r.code, 0, "{}", r.log());
    let names: Vec<&String> = r.result["runs"].as_object().unwrap().keys().collect();
    assert_eq!(names, ["test", "benchmark", "leaderboard"]);
    let comp = &r.result["runs"]["test"]["compilation"];
    assert_eq!(comp["nvcc_found"], true);
    assert_eq!(comp["success"], true);
    assert_eq!(comp["exit_code"], 0);
    assert!(comp["nvcc_version"]
        .as_str()
        .unwrap()
        .contains("release 12.4"));
    assert_eq!(comp["stdout"], "ptxas info: 0 bytes spill stores\n");
    let expected = format!(
        "{} --std=c++20 -DNDEBUG -Xcompiler=-Wno-psabi -Xcompiler=-fno-strict-aliasing --expt-extended-lambda \
         --expt-relaxed-constexpr -forward-unknown-to-host-compiler -O3 -Xnvlink=--verbose -Xptxas=--verbose \
         -Xptxas=--warn-on-spills -DN=1024 eval.cu submission.cu -gencode=arch=compute_90,code=sm_90 -o eval.out",
        nvcc.display()
    );
    assert_eq!(comp["command"], expected);
    let logged = std::fs::read_to_string(tools.path().join("nvcc-args.log")).unwrap();
    assert_eq!(format!("{} {}", nvcc.display(), logged.trim()), expected);
    let run = r.run("test");
    assert_eq!(run["passed"], true, "{run}");
    assert_eq!(
        run["command"].as_str().unwrap().split(' ').next(),
        Some("./eval.out")
    );
    // Sources and headers were removed before the user's binary ran.
    assert_eq!(run["result"]["cwd-files"], "eval.out");
    assert_eq!(run["result"]["seed"], "31337");
    assert!(!r.log().contains("31337"));
    assert_rebuilds(&[r.result_path()]);
}

#[test]
fn a_compile_error_is_reported_and_stops_the_chain() {
    let Some(py) = need_python() else { return };
    let tools = tempfile::tempdir().unwrap();
    fake_nvcc(tools.path(), py);
    let path = path_with(Some(tools.path()));
    let r = run_config(
        &cu_config("leaderboard", "#error nope\n"),
        &[],
        &[("PATH", &path)],
    );
    assert_eq!(r.code, 0, "{}", r.log());
    let names: Vec<&String> = r.result["runs"].as_object().unwrap().keys().collect();
    assert_eq!(names, ["test"]);
    let test = &r.result["runs"]["test"];
    assert_eq!(test["compilation"]["success"], false);
    assert_eq!(test["compilation"]["exit_code"], 1);
    assert!(test["compilation"]["stderr"]
        .as_str()
        .unwrap()
        .contains("error: user code does not compile"));
    assert!(test["run"].is_null());
    assert!(r.stdout.contains("compile: failed"), "{}", r.stdout);
    assert_rebuilds(&[r.result_path()]);
}

#[test]
fn no_nvcc_is_recorded_as_kernelbot_records_it_and_exits_as_an_infrastructure_failure() {
    if Path::new("/usr/local/cuda/bin/nvcc").exists() || Path::new("/usr/bin/nvcc").exists() {
        kernelkite_testkit_leaf::skip("a real nvcc is installed where the runner looks");
        return;
    }
    let r = run_config(&cu_config("test", "int main() {}\n"), &[], &[]);
    // The node is at fault (exit 3, and the summary says what to do), but result.json is
    // kernelbot's: success, no error, and the failed `which nvcc` that its report shows as
    // "NVCC could not be found ... not in your code".
    assert_eq!(r.code, 3, "{}", r.log());
    assert_eq!(r.result["success"], true);
    assert_eq!(r.result["error"], "");
    assert!(r.stdout.contains("nvcc not found"), "{}", r.stdout);
    assert!(r.stdout.contains("success=true"), "{}", r.stdout);
    assert!(r.result["runs"]["test"]["run"].is_null());
    let comp = &r.result["runs"]["test"]["compilation"];
    assert_eq!(comp["nvcc_found"], false);
    assert_eq!(comp["command"], "which nvcc");
    assert_rebuilds(&[r.result_path()]);
}

#[test]
fn a_missing_include_directory_is_named() {
    let Some(py) = need_python() else { return };
    let tools = tempfile::tempdir().unwrap();
    fake_nvcc(tools.path(), py);
    let path = path_with(Some(tools.path()));
    let mut cfg = cu_config("test", "int main() {}\n");
    cfg["include_dirs"] = json!(["/ThunderKittens/include"]);
    let r = run_config(&cfg, &[], &[("PATH", &path)]);
    assert_eq!(r.code, 3, "{}", r.log());
    assert!(r.result["error"]
        .as_str()
        .unwrap()
        .contains("/ThunderKittens/include"));
}

#[test]
fn a_hanging_compile_is_killed_at_the_compile_timeout() {
    let Some(py) = need_python() else { return };
    let tools = tempfile::tempdir().unwrap();
    let nvcc = fake_nvcc(tools.path(), py);
    let work = tempfile::tempdir().unwrap();
    let mut cfg = cu_config("test", "int main() {}\n");
    cfg["sources"]["slow.cu"] = json!("");
    let cfg = RunConfig::from_json(cfg).unwrap();
    let opts = Options {
        nvcc: Some(nvcc),
        system: Some(SystemInfo::default()),
        compile_timeout: Duration::from_secs(1),
        ..Options::new(work.path())
    };
    let t = Instant::now();
    let ev = eval::evaluate(&cfg, &opts);
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(ev.failure.is_none(), "{:?}", ev.failure);
    let comp = ev.result.runs["test"].compilation.as_ref().unwrap();
    assert!(!comp.success);
    assert_eq!(comp.exit_code, 114);
    assert!(
        comp.stderr.contains("did not finish within 1 s"),
        "{}",
        comp.stderr
    );
    assert!(ev.result.runs["test"].run.is_none());
    assert!(
        !work.path().join("slow.cu").exists(),
        "sources must be removed after a failed compile"
    );
}

#[test]
fn library_reports_missing_nvcc_as_infrastructure_recorded_like_kernelbot() {
    let work = tempfile::tempdir().unwrap();
    let cfg = RunConfig::from_json(cu_config("test", "")).unwrap();
    let opts = Options {
        nvcc: Some("/nonexistent/nvcc".into()),
        system: Some(SystemInfo::default()),
        ..Options::new(work.path())
    };
    let ev = eval::evaluate(&cfg, &opts);
    // The node's failure, recorded in the runs as kernelbot records it (and reported as
    // kernelbot's evaluator reports it: success, no error).
    let failure = ev.failure.expect("a failure of the node");
    assert_eq!(failure.kind, FailureKind::Infrastructure);
    assert!(failure.recorded);
    assert!(ev.result.success && ev.result.error.is_empty());
    let comp = ev.result.runs["test"].compilation.as_ref().unwrap();
    assert!(!comp.nvcc_found && comp.command == "which nvcc");
}

/// Issue 34: kernelbot checks `include_dirs` before it looks for nvcc, so a node missing both
/// fails on the directory, as the node's fault, with no run recorded as the contestant's
/// (the runner looked for nvcc first, and stored "NVCC not found" as the submission's run).
#[test]
fn a_node_missing_nvcc_and_an_include_directory_fails_on_the_directory_first() {
    let work = tempfile::tempdir().unwrap();
    let mut cfg = cu_config("test", "");
    cfg["include_dirs"] = json!(["/ThunderKittens/include"]);
    let cfg = RunConfig::from_json(cfg).unwrap();
    let opts = Options {
        nvcc: Some("/nonexistent/nvcc".into()),
        system: Some(SystemInfo::default()),
        ..Options::new(work.path())
    };
    let ev = eval::evaluate(&cfg, &opts);
    let failure = ev.failure.expect("a failure of the node");
    assert_eq!(failure.kind, FailureKind::Infrastructure);
    assert!(!failure.recorded, "{failure:?}");
    assert!(ev.result.runs.is_empty(), "{:?}", ev.result.runs);
    assert!(!ev.result.success);
    assert!(
        ev.result.error.contains("/ThunderKittens/include"),
        "{}",
        ev.result.error
    );
}

/// A real CUDA POPCORN program: adds two vectors on the GPU and reports through the pipe.
const REAL_CUDA: &str = r#"
#include <cstdio>
#include <cstdlib>
__global__ void add(const float* a, const float* b, float* c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}
int main(int argc, char** argv) {
    const char* fd_env = getenv("POPCORN_FD");
    if (!fd_env) return 111;
    FILE* out = fdopen(atoi(fd_env), "w");
    const int n = 1 << 20;
    float *a, *b, *c;
    if (cudaMallocManaged(&a, n * 4) || cudaMallocManaged(&b, n * 4) || cudaMallocManaged(&c, n * 4)) return 110;
    for (int i = 0; i < n; ++i) { a[i] = i; b[i] = 2 * i; }
    add<<<(n + 255) / 256, 256>>>(a, b, c, n);
    if (cudaDeviceSynchronize() != cudaSuccess) return 110;
    bool ok = true;
    for (int i = 0; i < n; ++i) ok = ok && c[i] == 3.0f * i;
    fprintf(out, "mode: %s\ncheck: %s\n", argc > 1 ? argv[1] : "", ok ? "pass" : "fail");
    fclose(out);
    return ok ? 0 : 112;
}
"#;

#[test]
fn real_nvcc_and_gpu_when_present() {
    let Some(nvcc) = kernelkite_runner::cuda::find_nvcc(None, &["/usr/local/cuda".into()]) else {
        kernelkite_testkit_leaf::skip(
            "no nvcc on this machine (PATH, $CUDA_HOME, /usr/local/cuda)",
        );
        return;
    };
    if !Path::new("/dev/nvidia0").exists() {
        kernelkite_testkit_leaf::skip(format_args!(
            "nvcc found at {} but no NVIDIA GPU (/dev/nvidia0)",
            nvcc.display()
        ));
        return;
    }
    let cfg = json!({
        "lang": "cu", "mode": "test", "sources": {"eval.cu": REAL_CUDA},
        "tests": [{"n": 1}], "test_timeout": 120,
    });
    let r = run_config(
        &cfg,
        &["--nvcc", nvcc.to_str().unwrap(), "--require-gpu"],
        &[],
    );
    assert_eq!(r.code, 0, "{}", r.log());
    let test = &r.result["runs"]["test"];
    assert_eq!(
        test["compilation"]["success"], true,
        "{}",
        test["compilation"]["stderr"]
    );
    assert_eq!(test["run"]["passed"], true, "{}", test["run"]);
    assert!(r.result["system"]["device_count"].as_u64().unwrap() >= 1);
    assert_eq!(r.result["system"]["runtime"], "CUDA");
}
