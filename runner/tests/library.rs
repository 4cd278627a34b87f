//! The evaluation called in process (`eval::run_config` / `eval::evaluate`), with the system
//! info injected so GPU-dependent behaviour is testable without a GPU.

mod common;

use common::*;
use kernelkite_kernelbot::config::RunConfig;
use kernelkite_kernelbot::result::SystemInfo;
use kernelkite_runner::eval::{self, FailureKind, Options};
use serde_json::json;

fn gpus(n: u32) -> SystemInfo {
    SystemInfo {
        gpu: if n > 0 {
            "Test GPU".into()
        } else {
            String::new()
        },
        device_count: n,
        runtime: if n > 0 { "CUDA".into() } else { String::new() },
        ..SystemInfo::default()
    }
}

fn opts(work: &std::path::Path, py: &str, system: SystemInfo) -> Options {
    Options {
        python: py.into(),
        system: Some(system),
        ..Options::new(work)
    }
}

#[test]
fn run_config_in_process_matches_kernelbots_shape() {
    let Some(py) = need_python() else { return };
    let work = tempfile::tempdir().unwrap();
    let cfg = RunConfig::from_json(harness_config("test", "pass", json!({"seed": 9}))).unwrap();
    let result = eval::run_config(&cfg, &opts(work.path(), py, gpus(1)));
    assert!(result.success, "{}", result.error);
    assert_eq!(result.system.gpu, "Test GPU");
    let run = result.runs["test"].run.as_ref().unwrap();
    assert!(run.passed);
    assert_eq!(run.result["seed"], "9");
    assert_eq!(
        run.result["gpus"], "none",
        "POPCORN_GPUS only for multi_gpu"
    );
}

#[test]
fn multi_gpu_passes_the_gpu_count() {
    let Some(py) = need_python() else { return };
    let work = tempfile::tempdir().unwrap();
    let cfg =
        RunConfig::from_json(harness_config("test", "pass", json!({"multi_gpu": true}))).unwrap();
    let result = eval::run_config(&cfg, &opts(work.path(), py, gpus(4)));
    assert_eq!(
        result.runs["test"].run.as_ref().unwrap().result["gpus"],
        "4"
    );
}

#[test]
fn the_python_pre_run_gets_seed_1_and_no_gpu_count() {
    // kernelbot's "compile" pre-run is `run_program(..., seed=1)` without multi_gpu.
    let Some(py) = need_python() else { return };
    let work = tempfile::tempdir().unwrap();
    let mut cfg = harness_config("test", "pass", json!({"multi_gpu": true, "seed": 5}));
    cfg["sources"]["submission.py"] = json!(
        "import os\nprint('-DTORCH_EXTENSION_NAME', os.environ.get('POPCORN_SEED'), os.environ.get('POPCORN_GPUS'))\n"
    );
    let cfg = RunConfig::from_json(cfg).unwrap();
    let result = eval::run_config(&cfg, &opts(work.path(), py, gpus(4)));
    let test = &result.runs["test"];
    let comp = test.compilation.as_ref().expect("pre-run recorded");
    assert_eq!(comp.stdout, "-DTORCH_EXTENSION_NAME 1 None\n");
    let run = test.run.as_ref().unwrap();
    assert_eq!(
        (run.result["seed"].as_str(), run.result["gpus"].as_str()),
        ("5", "4")
    );
}

#[test]
fn multi_gpu_without_gpus_is_an_infrastructure_failure() {
    let Some(py) = need_python() else { return };
    let work = tempfile::tempdir().unwrap();
    let cfg =
        RunConfig::from_json(harness_config("test", "pass", json!({"multi_gpu": true}))).unwrap();
    let ev = eval::evaluate(&cfg, &opts(work.path(), py, gpus(0)));
    assert_eq!(
        ev.failure.as_ref().map(|f| f.kind),
        Some(FailureKind::Infrastructure)
    );
    assert!(!ev.result.success);
    assert!(ev.result.error.contains("multi_gpu"));
    assert!(ev.result.runs.is_empty());
}

#[test]
fn require_gpu_is_satisfied_by_a_detected_gpu() {
    let Some(py) = need_python() else { return };
    let work = tempfile::tempdir().unwrap();
    let cfg = RunConfig::from_json(harness_config("test", "pass", json!({}))).unwrap();
    let mut o = opts(work.path(), py, gpus(1));
    o.require_gpu = true;
    assert!(eval::evaluate(&cfg, &o).failure.is_none());
    o.system = Some(gpus(0));
    let ev = eval::evaluate(&cfg, &o);
    assert_eq!(
        ev.failure.map(|f| f.kind),
        Some(FailureKind::Infrastructure)
    );
}

#[test]
fn an_invalid_config_given_directly_is_a_bad_config() {
    let work = tempfile::tempdir().unwrap();
    let mut cfg = RunConfig::from_json(harness_config("test", "pass", json!({}))).unwrap();
    cfg.main = Some("missing.py".into());
    let ev = eval::evaluate(&cfg, &opts(work.path(), "python3", gpus(0)));
    assert_eq!(ev.failure.map(|f| f.kind), Some(FailureKind::BadConfig));
    assert!(ev.result.error.contains("missing.py"));
}
