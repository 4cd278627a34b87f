//! The embedded example task behind `kernelkite-runner --example`: a CPU-only vector add with
//! a POPCORN harness, so the runner can be tried on any machine with `python3`.

use serde_json::{json, Value};

use kernelkite_kernelbot::config::Mode;

/// The harness (kernelbot's `eval.py` role).
pub const HARNESS: &str = include_str!("example/eval.py");
/// The submission it evaluates.
pub const SUBMISSION: &str = include_str!("example/submission.py");

/// The example's run config for `mode`, in kernelbot's key order.
pub fn config(mode: Mode) -> Value {
    json!({
        "lang": "py",
        "mode": mode.as_str(),
        "sources": {"eval.py": HARNESS, "submission.py": SUBMISSION},
        "main": "eval.py",
        "tests": [{"size": 16, "seed": 1}, {"size": 1000, "seed": 2}],
        "benchmarks": [{"size": 1000, "seed": 3}, {"size": 10000, "seed": 4}],
        "seed": 4242,
        "ranking_by": "last",
        "test_timeout": 60,
        "benchmark_timeout": 60,
        "ranked_timeout": 60,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelkite_kernelbot::config::RunConfig;

    #[test]
    fn example_configs_validate() {
        for m in [
            Mode::Test,
            Mode::Benchmark,
            Mode::Leaderboard,
            Mode::Private,
            Mode::Profile,
        ] {
            RunConfig::from_json(config(m)).unwrap();
        }
    }
}
