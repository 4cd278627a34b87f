//! kernelbot's `FullResult`, field for field.
//!
//! kernelbot rebuilds results with `Dataclass(**dict)` on every level, so a missing or an
//! extra field is a crash on their side: every struct here denies unknown fields and has no
//! defaults, and `Option` fields serialize as `null` (never omitted).

use chrono::{DateTime, SecondsFormat, Utc};
use indexmap::IndexMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The whole result of a job: `result.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FullResult {
    /// Did the runner itself work (not: did the tests pass).
    pub success: bool,
    /// Why not, when `success` is false; empty otherwise (kernelbot writes `""`).
    pub error: String,
    /// What the job ran on.
    pub system: SystemInfo,
    /// `test`, `benchmark`, `leaderboard`, `profile`, in the order they ran.
    pub runs: IndexMap<String, EvalResult>,
}

/// What the job ran on, as kernelbot's `SystemInfo`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SystemInfo {
    /// The first visible GPU's name.
    pub gpu: String,
    /// How many GPUs the job sees.
    pub device_count: u32,
    /// The CPU model.
    pub cpu: String,
    /// `CUDA`, `ROCm` or empty.
    pub runtime: String,
    /// Python's `platform.platform()`.
    pub platform: String,
    /// torch's version, empty when unknown.
    pub torch: String,
    /// The machine's host name.
    pub hostname: String,
}

/// One run (`test`, `benchmark`, ...) of the evaluation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalResult {
    /// When it started.
    pub start: Timestamp,
    /// When it ended.
    pub end: Timestamp,
    /// The CUDA compile; `None` for Python.
    pub compilation: Option<CompileResult>,
    /// The harness run; `None` when it did not start.
    pub run: Option<RunResult>,
    /// The profiler's output in profile mode.
    pub profile: Option<ProfileResult>,
}

/// nvcc's outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompileResult {
    /// Whether nvcc was found.
    pub nvcc_found: bool,
    /// `nvcc --version`'s output.
    pub nvcc_version: String,
    /// Whether it compiled.
    pub success: bool,
    /// The command, as one string.
    pub command: String,
    /// nvcc's stdout.
    pub stdout: String,
    /// nvcc's stderr.
    pub stderr: String,
    /// nvcc's exit code.
    pub exit_code: i32,
}

/// The harness's outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunResult {
    /// Exit code 0 or 112 (validation failed is still a successful run).
    pub success: bool,
    /// The harness wrote `check: pass`.
    pub passed: bool,
    /// The command, as one string.
    pub command: String,
    /// The harness's stdout (bounded).
    pub stdout: String,
    /// The harness's stderr (bounded).
    pub stderr: String,
    /// The exit code, or minus the signal that killed it.
    pub exit_code: i32,
    /// Wall time of the run, seconds. A whole number is written without a fraction: a
    /// timed-out run's duration is its time limit, which kernelbot writes as an integer.
    #[serde(serialize_with = "whole_as_integer")]
    pub duration: f64,
    /// `key: value` lines the harness wrote to the POPCORN pipe.
    pub result: IndexMap<String, String>,
}

/// The profiler's outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileResult {
    /// Which profiler ran (`ncu`, `rocprofv3`).
    pub profiler: String,
    /// base64 of a zip of the profile data.
    pub trace: Option<String>,
    /// Where the trace was uploaded, when it was.
    pub download_url: Option<String>,
}

/// kernelbot's exit codes for the harness process.
pub mod exit_code {
    /// The harness finished.
    pub const SUCCESS: i32 = 0;
    /// A CUDA error in the harness.
    pub const CUDA_FAIL: i32 = 110;
    /// The POPCORN pipe could not be used.
    pub const PIPE_FAILED: i32 = 111;
    /// A test failed its check (the run still succeeded).
    pub const VALIDATE_FAIL: i32 = 112;
    /// The test specification was wrong.
    pub const TEST_SPEC: i32 = 113;
    /// The run was killed at its timeout.
    pub const TIMEOUT_EXPIRED: i32 = 114;
}

/// A point in time, written as ISO 8601 with microseconds and an explicit UTC offset
/// (`2026-11-22T10:40:00.123456+00:00`), which Python's `datetime.fromisoformat` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Timestamp(pub DateTime<Utc>);

impl Timestamp {
    /// The current time.
    pub fn now() -> Timestamp {
        Timestamp(Utc::now())
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0.to_rfc3339_opts(SecondsFormat::Micros, false))
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Timestamp, D::Error> {
        let s = String::deserialize(d)?;
        // Python's isoformat() of a naive datetime has no offset; read it as UTC.
        DateTime::parse_from_rfc3339(&s)
            .map(|t| Timestamp(t.with_timezone(&Utc)))
            .or_else(|_| {
                chrono::NaiveDateTime::parse_from_str(&s, "%Y-%m-%dT%H:%M:%S%.f")
                    .map(|n| Timestamp(n.and_utc()))
            })
            .map_err(|e| serde::de::Error::custom(format!("bad timestamp {s:?}: {e}")))
    }
}

impl FullResult {
    /// The result written when the runner could not evaluate at all (bad payload, no GPU):
    /// kernelbot still gets a well-formed `result.json` saying why.
    pub fn failure(error: impl Into<String>, system: SystemInfo) -> FullResult {
        FullResult {
            success: false,
            error: error.into(),
            system,
            runs: IndexMap::new(),
        }
    }
}

/// `180.0` as `180`, as kernelbot's evaluator writes a timed-out run's duration (its time
/// limit, an int); other values as they are.
fn whole_as_integer<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    // 2^53: every whole f64 below it is an exact integer.
    if v.fract() == 0.0 && v.abs() < 9_007_199_254_740_992.0 {
        s.serialize_i64(*v as i64)
    } else {
        s.serialize_f64(*v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn missing_or_extra_fields_are_refused() {
        let good = json!({"success": true, "error": "", "runs": {},
            "system": {"gpu": "", "device_count": 1, "cpu": "", "runtime": "", "platform": "", "torch": "", "hostname": "h"}});
        assert!(serde_json::from_value::<FullResult>(good.clone()).is_ok());
        let mut extra = good.clone();
        extra["system"]["kernel"] = json!("6.1");
        assert!(serde_json::from_value::<FullResult>(extra).is_err());
        let mut missing = good;
        missing["system"]
            .as_object_mut()
            .unwrap()
            .remove("hostname");
        assert!(serde_json::from_value::<FullResult>(missing).is_err());
    }

    #[test]
    fn timestamps_are_iso8601_with_offset_and_read_python_naive() {
        let t: Timestamp = serde_json::from_value(json!("2025-01-02T03:04:05.123456")).unwrap();
        assert_eq!(
            serde_json::to_value(t).unwrap(),
            json!("2025-01-02T03:04:05.123456+00:00")
        );
    }

    #[test]
    fn none_fields_serialize_as_null() {
        let r = EvalResult {
            start: Timestamp::now(),
            end: Timestamp::now(),
            compilation: None,
            run: None,
            profile: None,
        };
        let v = serde_json::to_value(r).unwrap();
        assert!(v["compilation"].is_null() && v["run"].is_null() && v["profile"].is_null());
        assert!(v.as_object().unwrap().contains_key("profile"));
    }

    #[test]
    fn a_whole_duration_is_written_as_an_integer_like_kernelbots_timeout() {
        let run = |duration: f64| RunResult {
            success: false,
            passed: false,
            command: "c".into(),
            stdout: String::new(),
            stderr: String::new(),
            exit_code: 114,
            duration,
            result: IndexMap::new(),
        };
        let text = |d| serde_json::to_string(&run(d)).unwrap();
        assert!(text(180.0).contains("\"duration\":180,"), "{}", text(180.0));
        assert!(text(3.53).contains("\"duration\":3.53,"), "{}", text(3.53));
        // Read back either way.
        let back: RunResult = serde_json::from_str(&text(180.0)).unwrap();
        assert_eq!(back.duration, 180.0);
    }
}
