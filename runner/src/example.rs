//! The embedded example task behind `kernelkite-runner --example`: the repository's bundled
//! CPU task (`examples/prefixsum_py`, an inclusive prefix sum in plain Python with its own
//! POPCORN harness), so the runner can be tried on any machine with `python3`. The same files
//! are what `kernelkite-service demo` runs through the whole system.

use serde_json::{json, Value};

use kernelkite_kernelbot::config::Mode;

/// The harness (kernelbot's `eval.py` role).
pub const HARNESS: &str = include_str!("../../examples/prefixsum_py/eval.py");
/// The reference the harness checks against.
pub const REFERENCE: &str = include_str!("../../examples/prefixsum_py/reference.py");
/// The submission it evaluates.
pub const SUBMISSION: &str = include_str!("../../examples/prefixsum_py/submission.py");

/// The example's run config for `mode`, in kernelbot's key order, with fewer and smaller
/// cases than the task's own (`examples/prefixsum_py/task.yml`) so it runs in a moment.
pub fn config(mode: Mode) -> Value {
    json!({
        "lang": "py",
        "mode": mode.as_str(),
        "sources": {"submission.py": SUBMISSION, "reference.py": REFERENCE, "eval.py": HARNESS},
        "main": "eval.py",
        "tests": [{"size": 7, "seed": 1001}, {"size": 1023, "seed": 9173}],
        "benchmarks": [{"size": 1000, "seed": 54352}, {"size": 10000, "seed": 93246}],
        "seed": 4242,
        "ranking_by": "geom",
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
