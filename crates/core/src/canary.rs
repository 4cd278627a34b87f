//! Canaries: a short reference benchmark each slice runs (when it joins, after every N jobs,
//! after H hours without work, on demand), and the verdict on it.
//!
//! A canary is a submission like any other (kernelbot's run config, `benchmark` mode, the
//! organisers' `admin` class, never answered from the result cache), pinned to the slice it
//! measures. Its score is what kernelbot's harness reports: the geometric mean of the
//! benchmarks' `benchmark.<i>.mean`. A slice is judged against the fleet: the median of the
//! latest scores of every slice with the same GPU model. All of it here is pure: the fleet
//! ([`crate::fleet`]) keeps the histories and acts on the verdicts.

use serde::{Deserialize, Serialize};

/// When canaries run and how they are judged.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// Run canaries at all.
    pub enabled: bool,
    /// A canary after this many jobs on a slice.
    pub every_jobs: u64,
    /// A canary after this long without a job or a canary, seconds.
    pub idle_s: u64,
    /// A slice slower than its model's median by more than this share is quarantined.
    pub slower_by: f64,
    /// A slice whose last canaries' scores spread wider than this (coefficient of
    /// variation) is quarantined.
    pub max_spread: f64,
    /// How many of a slice's last canaries the spread is taken over (at least 3 count).
    pub spread_over: usize,
}

impl Default for Schedule {
    fn default() -> Schedule {
        Schedule {
            enabled: false,
            every_jobs: 200,
            idle_s: 6 * 3600,
            slower_by: 0.05,
            max_spread: 0.05,
            spread_over: 5,
        }
    }
}

/// What a canary's result measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measured {
    /// Geometric mean of the benchmarks' means, in the harness's unit.
    pub score: f64,
    /// The widest benchmark's own spread (std / mean), for the record.
    pub within: f64,
}

/// Reads a canary's `result.json`: its `benchmark` run's `benchmark.<i>.mean` and `.std`.
/// `Err`: why the canary did not measure (it failed, or reported no benchmark).
pub fn measure(result: &str) -> Result<Measured, String> {
    let v: serde_json::Value =
        serde_json::from_str(result).map_err(|e| format!("result.json unreadable: {e}"))?;
    if v["success"] != true {
        return Err(format!(
            "the runner could not evaluate it: {}",
            v["error"].as_str().unwrap_or("no reason given")
        ));
    }
    let run = &v["runs"]["benchmark"]["run"];
    if run.is_null() {
        return Err("it has no benchmark run".into());
    }
    if run["passed"] != true {
        return Err(format!(
            "its benchmark did not pass (exit {})",
            run["exit_code"].as_i64().unwrap_or(-1)
        ));
    }
    let field = |i: usize, name: &str| -> Option<f64> {
        let x = &run["result"][format!("benchmark.{i}.{name}")];
        x.as_f64()
            .or_else(|| x.as_str().and_then(|s| s.trim().parse().ok()))
    };
    let mut log_sum = 0.0;
    let mut n = 0usize;
    let mut within: f64 = 0.0;
    while let Some(mean) = field(n, "mean") {
        if !(mean.is_finite() && mean > 0.0) {
            return Err(format!("benchmark {n} has mean {mean}"));
        }
        log_sum += mean.ln();
        if let Some(std) = field(n, "std") {
            within = within.max(std / mean);
        }
        n += 1;
    }
    if n == 0 {
        return Err("its benchmark reported no benchmark.0.mean".into());
    }
    Ok(Measured {
        score: (log_sum / n as f64).exp(),
        within,
    })
}

/// The median of `xs` (the mean of the two middle ones for an even count).
pub fn median(xs: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    })
}

/// The coefficient of variation of `xs` (population), `None` under three values.
pub fn spread(xs: &[f64]) -> Option<f64> {
    if xs.len() < 3 {
        return None;
    }
    let mean = xs.iter().sum::<f64>() / xs.len() as f64;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
    (mean > 0.0).then(|| var.sqrt() / mean)
}

/// A canary's verdict.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "verdict")]
pub enum Verdict {
    /// Healthy.
    Pass,
    /// Slower than the model's median by more than the limit.
    Slow {
        /// Score over the median.
        ratio: f64,
    },
    /// The slice's last canaries spread too wide.
    Spread {
        /// Their coefficient of variation.
        cv: f64,
    },
    /// The run's GPU readings say it is unhealthy.
    Unhealthy,
    /// The canary did not measure (it failed, or its result is unusable).
    Failed,
}

impl Verdict {
    /// Whether the slice may rank runs after it.
    pub fn passed(&self) -> bool {
        matches!(self, Verdict::Pass)
    }

    /// One line for people and alerts.
    pub fn describe(&self, schedule: &Schedule) -> String {
        match self {
            Verdict::Pass => "canary passed".into(),
            Verdict::Slow { ratio } => format!(
                "canary {:.1}% slower than its GPU model's median (limit {:.1}%)",
                (ratio - 1.0) * 100.0,
                schedule.slower_by * 100.0
            ),
            Verdict::Spread { cv } => format!(
                "canary scores spread {:.1}% run to run (limit {:.1}%)",
                cv * 100.0,
                schedule.max_spread * 100.0
            ),
            Verdict::Unhealthy => "the canary's GPU readings say the GPU is unhealthy".into(),
            Verdict::Failed => "the canary could not be measured".into(),
        }
    }
}

/// Judges a slice's canary: `score` against its model's `median` (over the latest scores of
/// every slice of the model, this one's included), its own last `scores` (newest last, this
/// one included) for the spread, and the run's health `concerns`.
pub fn judge(
    score: f64,
    median: Option<f64>,
    scores: &[f64],
    concerns: &[String],
    schedule: &Schedule,
) -> Verdict {
    if !concerns.is_empty() {
        return Verdict::Unhealthy;
    }
    if let Some(m) = median.filter(|m| *m > 0.0) {
        let ratio = score / m;
        if ratio > 1.0 + schedule.slower_by {
            return Verdict::Slow { ratio };
        }
    }
    let last = &scores[scores.len().saturating_sub(schedule.spread_over.max(3))..];
    if let Some(cv) = spread(last).filter(|cv| *cv > schedule.max_spread) {
        return Verdict::Spread { cv };
    }
    Verdict::Pass
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn result(means: &[f64]) -> String {
        let mut r = serde_json::Map::new();
        for (i, m) in means.iter().enumerate() {
            r.insert(format!("benchmark.{i}.mean"), json!(m));
            r.insert(format!("benchmark.{i}.std"), json!(m / 100.0));
        }
        json!({"success": true, "error": "", "system": {},
               "runs": {"benchmark": {"run": {"passed": true, "exit_code": 0, "result": r}}}})
        .to_string()
    }

    #[test]
    fn the_score_is_the_geometric_mean_of_the_benchmark_means() {
        let m = measure(&result(&[100.0, 400.0])).unwrap();
        assert!((m.score - 200.0).abs() < 1e-9, "{m:?}");
        assert!((m.within - 0.01).abs() < 1e-12);
        // kernelbot's POPCORN values arrive as strings in result.json.
        let text = result(&[5.0]).replace("5.0", "\"5.0\"");
        assert!((measure(&text).unwrap().score - 5.0).abs() < 1e-9);
    }

    #[test]
    fn a_canary_that_did_not_measure_says_why() {
        let failed = json!({"success": false, "error": "no GPU", "system": {}, "runs": {}});
        assert!(measure(&failed.to_string()).unwrap_err().contains("no GPU"));
        let none = json!({"success": true, "error": "", "system": {}, "runs": {}});
        assert!(measure(&none.to_string())
            .unwrap_err()
            .contains("no benchmark"));
        let text = result(&[1.0]).replace("\"passed\":true", "\"passed\":false");
        assert!(measure(&text).unwrap_err().contains("did not pass"));
        assert!(measure(&result(&[]))
            .unwrap_err()
            .contains("benchmark.0.mean"));
        assert!(measure(&result(&[0.0])).is_err());
    }

    #[test]
    fn twenty_percent_slower_than_the_median_of_two_is_slow_and_equal_passes() {
        let s = Schedule::default();
        let med = median(&[1.0, 1.2]);
        assert_eq!(med, Some(1.1));
        assert!(matches!(
            judge(1.2, med, &[1.2], &[], &s),
            Verdict::Slow { ratio } if (ratio - 1.2 / 1.1).abs() < 1e-9
        ));
        assert_eq!(judge(1.0, med, &[1.0], &[], &s), Verdict::Pass);
        // Within the limit: 4% over the median passes.
        assert_eq!(judge(1.04, Some(1.0), &[1.04], &[], &s), Verdict::Pass);
        // A lone slice of its model is its own median.
        assert_eq!(judge(3.0, median(&[3.0]), &[3.0], &[], &s), Verdict::Pass);
    }

    #[test]
    fn a_wide_run_to_run_spread_or_a_health_concern_fails_the_canary() {
        let s = Schedule::default();
        assert!(matches!(
            judge(1.0, Some(1.0), &[0.8, 1.2, 1.0], &[], &s),
            Verdict::Spread { .. }
        ));
        // Two canaries are too few to speak of a spread.
        assert_eq!(judge(1.0, Some(1.0), &[0.5, 1.0], &[], &s), Verdict::Pass);
        // Only the last `spread_over` count: an old outlier is forgotten.
        assert_eq!(
            judge(1.0, Some(1.0), &[9.0, 1.0, 1.0, 1.0, 1.0, 1.0], &[], &s),
            Verdict::Pass
        );
        assert_eq!(
            judge(1.0, Some(1.0), &[1.0], &["GPU 0 at 91 °C".into()], &s),
            Verdict::Unhealthy
        );
        assert!(Verdict::Slow { ratio: 1.2 }
            .describe(&s)
            .contains("20.0% slower"));
    }
}
