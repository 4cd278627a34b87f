//! What `demo` and `submit` print: a kernelbot result as a table (pass/fail per test,
//! benchmark means with units), kernelbot's score, and durations people can read.

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::Value;

/// `1.23 ms`, `456 µs`, `12.0 s`: three significant digits and a unit.
pub fn duration(d: Duration) -> String {
    seconds(d.as_secs_f64())
}

/// A time in seconds, with a unit.
pub fn seconds(s: f64) -> String {
    let (v, unit) = if s >= 1.0 {
        (s, "s")
    } else if s >= 1e-3 {
        (s * 1e3, "ms")
    } else if s >= 1e-6 {
        (s * 1e6, "µs")
    } else {
        (s * 1e9, "ns")
    };
    if v >= 100.0 {
        format!("{v:.0} {unit}")
    } else if v >= 10.0 {
        format!("{v:.1} {unit}")
    } else {
        format!("{v:.2} {unit}")
    }
}

/// A POPCORN time (nanoseconds, as the harness wrote it), with a unit.
fn nanos(text: &str) -> Option<String> {
    text.trim().parse::<f64>().ok().map(|ns| seconds(ns / 1e9))
}

fn get<'a>(r: &'a serde_json::Map<String, Value>, key: &str) -> Option<&'a str> {
    r.get(key).and_then(Value::as_str)
}

/// kernelbot's score of a leaderboard run (`compute_score`), in seconds: the last benchmark's
/// mean (`last`), the arithmetic mean of the means (`mean`) or their geometric mean (`geom`).
pub fn score(result: &Value, ranking_by: &str) -> Option<f64> {
    let run = result["runs"]["leaderboard"]["run"].as_object()?;
    if run.get("passed") != Some(&Value::Bool(true)) {
        return None;
    }
    let r = run.get("result")?.as_object()?;
    let count: usize = get(r, "benchmark-count")?.parse().ok()?;
    let means: Vec<f64> = (0..count)
        .map(|i| {
            get(r, &format!("benchmark.{i}.mean"))
                .and_then(|m| m.parse::<f64>().ok())
                .map(|ns| ns / 1e9)
        })
        .collect::<Option<_>>()?;
    match ranking_by {
        "last" if count == 1 => means.first().copied(),
        "mean" if count > 0 => Some(means.iter().sum::<f64>() / count as f64),
        "geom" if count > 0 => Some(means.iter().product::<f64>().powf(1.0 / count as f64)),
        _ => None,
    }
}

/// The result as a table: one row per test and benchmark of each run, then each run's
/// verdict (and the start of its stderr when it failed).
pub fn result_table(result: &Value) -> String {
    let mut out = String::new();
    if result["success"] == Value::Bool(false) {
        let _ = writeln!(
            out,
            "  the runner could not evaluate the submission: {}",
            result["error"].as_str().unwrap_or("(no reason given)")
        );
    }
    let Some(runs) = result["runs"].as_object() else {
        return out;
    };
    let mut rows: Vec<(String, String, String)> = Vec::new();
    let mut verdicts = Vec::new();
    for (name, eval) in runs {
        if let Some(c) = eval["compilation"].as_object() {
            if c.get("success") == Some(&Value::Bool(false)) {
                verdicts.push(format!(
                    "  {name}: compilation failed (exit {}):\n{}",
                    c.get("exit_code").unwrap_or(&Value::Null),
                    indent(get(c, "stderr").unwrap_or(""), 6, 20)
                ));
                continue;
            }
        }
        let Some(run) = eval["run"].as_object() else {
            verdicts.push(format!("  {name}: did not run"));
            continue;
        };
        let empty = serde_json::Map::new();
        let r = run
            .get("result")
            .and_then(Value::as_object)
            .unwrap_or(&empty);
        rows.extend(case_rows(name, r));
        let passed = run.get("passed") == Some(&Value::Bool(true));
        let exit = run.get("exit_code").cloned().unwrap_or(Value::Null);
        let took = run
            .get("duration")
            .and_then(Value::as_f64)
            .map(seconds)
            .unwrap_or_default();
        let reason = match exit.as_i64() {
            Some(114) => " (timeout)",
            Some(110) => " (CUDA error)",
            _ => "",
        };
        let mut line = format!(
            "  {name}: {}{reason} (exit {exit}, {took})",
            if passed { "passed" } else { "FAILED" }
        );
        if !passed {
            if let Some(err) = get(run, "stderr").filter(|e| !e.trim().is_empty()) {
                line.push_str(&format!(":\n{}", indent(err, 6, 12)));
            }
        }
        verdicts.push(line);
    }
    if !rows.is_empty() {
        let w0 = rows.iter().map(|r| r.0.len()).max().unwrap_or(0).max(3);
        let w1 = rows
            .iter()
            .map(|r| r.1.chars().count())
            .max()
            .unwrap_or(0)
            .max(4);
        let _ = writeln!(out, "  {:w0$}  {:w1$}  result", "run", "case");
        for (run, case, res) in &rows {
            let _ = writeln!(out, "  {run:w0$}  {case:w1$}  {res}");
        }
    }
    for v in verdicts {
        let _ = writeln!(out, "{v}");
    }
    out
}

fn case_rows(run: &str, r: &serde_json::Map<String, Value>) -> Vec<(String, String, String)> {
    let mut rows = Vec::new();
    let count = |k: &str| get(r, k).and_then(|c| c.parse::<usize>().ok());
    if let Some(n) = count("test-count") {
        for i in 0..n {
            let spec = get(r, &format!("test.{i}.spec")).unwrap_or("?").to_string();
            let status = get(r, &format!("test.{i}.status")).unwrap_or("?");
            let res = match get(r, &format!("test.{i}.error"))
                .or_else(|| get(r, &format!("test.{i}.message")))
            {
                Some(e) if status != "pass" => format!("{} ({e})", status.to_uppercase()),
                _ if status == "pass" => "pass".to_string(),
                _ => status.to_uppercase(),
            };
            rows.push((run.to_string(), spec, res));
        }
    }
    if let Some(n) = count("benchmark-count") {
        for i in 0..n {
            let k = |f: &str| format!("benchmark.{i}.{f}");
            let spec = get(r, &k("spec")).unwrap_or("?").to_string();
            let res = if let Some(mean) = get(r, &k("mean")).and_then(nanos) {
                let mut s = mean;
                if let Some(e) = get(r, &k("err")).and_then(nanos) {
                    s.push_str(&format!(" ± {e}"));
                }
                let mut extra = Vec::new();
                if let Some(b) = get(r, &k("best")).and_then(nanos) {
                    extra.push(format!("best {b}"));
                }
                if let Some(n) = get(r, &k("runs")) {
                    extra.push(format!("{n} runs"));
                }
                if !extra.is_empty() {
                    s.push_str(&format!("  ({})", extra.join(", ")));
                }
                s
            } else if get(r, &k("report")).is_some() {
                "profiled (report in result)".to_string()
            } else {
                format!(
                    "{}{}",
                    get(r, &k("status")).unwrap_or("?").to_uppercase(),
                    get(r, &k("error"))
                        .map(|e| format!(" ({e})"))
                        .unwrap_or_default()
                )
            };
            rows.push((run.to_string(), spec, res));
        }
    }
    rows
}

/// At most `max` lines of `text`, each indented by `by` spaces.
fn indent(text: &str, by: usize, max: usize) -> String {
    let lines: Vec<&str> = text.trim_end().lines().collect();
    let pad = " ".repeat(by);
    let mut s: Vec<String> = lines
        .iter()
        .take(max)
        .map(|l| format!("{pad}{l}"))
        .collect();
    if lines.len() > max {
        s.push(format!("{pad}[... {} more lines]", lines.len() - max));
    }
    s.join("\n")
}

/// Whether every run of the result ran and passed.
pub fn all_passed(result: &Value) -> bool {
    result["success"] == Value::Bool(true)
        && result["runs"].as_object().is_some_and(|runs| {
            runs.values()
                .all(|e| e["run"]["passed"] == Value::Bool(true))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn durations_have_units_and_three_digits() {
        assert_eq!(seconds(0.000_000_5), "500 ns");
        assert_eq!(seconds(0.000_012_34), "12.3 µs");
        assert_eq!(seconds(0.001_234), "1.23 ms");
        assert_eq!(seconds(12.0), "12.0 s");
        assert_eq!(duration(Duration::from_millis(250)), "250 ms");
    }

    #[test]
    fn the_table_shows_tests_benchmarks_and_verdicts() {
        let result = json!({"success": true, "error": "", "system": {}, "runs": {
            "test": {"run": {"passed": false, "exit_code": 112, "duration": 0.05, "stderr": "",
                "result": {"test-count": "2", "test.0.spec": "size: 1", "test.0.status": "pass",
                           "test.1.spec": "size: 7", "test.1.status": "fail", "test.1.error": "mismatch at 0"}}},
            "leaderboard": {"run": {"passed": true, "exit_code": 0, "duration": 1.5,
                "result": {"benchmark-count": "2", "benchmark.0.spec": "size: 10", "benchmark.0.mean": "1500.0",
                           "benchmark.0.err": "20", "benchmark.0.best": "1400", "benchmark.0.runs": "25",
                           "benchmark.1.spec": "size: 100", "benchmark.1.mean": "6000.0", "check": "pass"}}}
        }});
        let t = result_table(&result);
        let row = |case: &str| {
            t.lines()
                .find(|l| l.split("  ").any(|c| c.trim() == case))
                .unwrap_or_else(|| panic!("no row for {case}: {t}"))
                .to_string()
        };
        assert!(row("size: 7").starts_with("  test "), "{t}");
        assert!(row("size: 7").ends_with("  FAIL (mismatch at 0)"), "{t}");
        assert!(
            row("size: 10").ends_with("  1.50 µs ± 20.0 ns  (best 1.40 µs, 25 runs)"),
            "{t}"
        );
        assert!(t.contains("  test: FAILED (exit 112, 50.0 ms)"), "{t}");
        assert!(t.contains("  leaderboard: passed (exit 0, 1.50 s)"), "{t}");
        // geom of 1.5 µs and 6 µs = 3 µs.
        let s = score(&result, "geom").unwrap();
        assert!((s - 3e-6).abs() < 1e-12, "{s}");
        assert_eq!(score(&result, "last"), None);
        assert!(!all_passed(&result));
        let bad = json!({"success": false, "error": "bad payload", "system": {}, "runs": {}});
        assert!(result_table(&bad).contains("could not evaluate the submission: bad payload"));
    }
}
