//! Cross-crate end-to-end tests live in `tests/tests/`; this library holds what they and the
//! service's tests and benchmark share: the fake Buildkite, the service on loopback against
//! it, sample kernelbot documents, and [`skip()`], which every crate's tests use to report a
//! test that could not run here as skipped. None of it is in a product's path.

pub mod fake_buildkite;
pub mod harness;
pub mod skip;

pub use skip::skip;

/// A valid kernelbot run config (Python, test mode).
pub fn sample_config() -> serde_json::Value {
    serde_json::json!({
        "lang": "py",
        "mode": "test",
        "main": "eval.py",
        "sources": {"eval.py": "print('hi')\n", "submission.py": "def kernel(x):\n    return x\n"},
        "tests": [{"size": 128, "seed": 1}],
        "benchmarks": [{"size": 4096, "seed": 2}],
        "seed": 42,
        "test_timeout": 60
    })
}

/// A `result.json` as the runner writes it (kernelbot's FullResult, every field present).
pub fn sample_result_json() -> String {
    serde_json::json!({
        "success": true,
        "error": "",
        "system": {"gpu": "NVIDIA H100 80GB HBM3", "device_count": 1, "cpu": "AMD EPYC 9654", "runtime": "CUDA",
                   "platform": "Linux-6.8.0-x86_64-with-glibc2.39", "torch": "2.6.0", "hostname": "gpu-node-1"},
        "runs": {"test": {
            "start": "2026-11-22T10:40:00.123456+00:00",
            "end": "2026-11-22T10:40:03.654321+00:00",
            "compilation": null,
            "run": {"success": true, "passed": true, "command": "python3 eval.py test cases.txt",
                    "stdout": "", "stderr": "", "exit_code": 0, "duration": 3.53,
                    "result": {"check": "pass", "test-count": "1"}},
            "profile": null
        }}
    })
    .to_string()
}
