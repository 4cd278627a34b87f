//! kernelbot's run config: the typed model, and validation that names the problem.
//!
//! Field names, defaults and semantics follow kernelbot's `run_config`. Keys kernelbot does
//! not read are kept in [`RunConfig::extra`] (kernelbot ignores them too) so a config
//! round-trips unchanged; [`RunConfig::validate`] reports them as warnings.

use std::path::{Component, Path};

use indexmap::IndexMap;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Default for `test_timeout`, `benchmark_timeout` and `ranked_timeout` (kernelbot's).
pub const DEFAULT_TIMEOUT_S: u64 = 180;
/// nvcc gets this long (kernelbot's `Timeout.COMPILE`).
pub const COMPILE_TIMEOUT_S: u64 = 120;
/// Accepted range for the per-mode timeouts, in seconds.
pub const TIMEOUT_RANGE_S: std::ops::RangeInclusive<u64> = 1..=3600;

/// Submission language.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Lang {
    #[serde(rename = "py")]
    Python,
    #[serde(rename = "cu")]
    Cuda,
}

/// Evaluation mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Test,
    Benchmark,
    Leaderboard,
    Private,
    Profile,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Test => "test",
            Mode::Benchmark => "benchmark",
            Mode::Leaderboard => "leaderboard",
            Mode::Private => "private",
            Mode::Profile => "profile",
        }
    }
}

/// How benchmark lines are ranked; `last` (kernelbot's default) runs only the last line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RankingBy {
    Last,
    #[serde(untagged)]
    Other(String),
}

/// The run config as kernelbot sends it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    pub lang: Lang,
    pub mode: Mode,
    /// File name → contents, in the order given (the nvcc command lists them in this order).
    pub sources: IndexMap<String, String>,
    /// Python: the file to run; must be one of `sources`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main: Option<String>,
    /// CUDA: extra files written for the compile but not passed to nvcc.
    #[serde(default, skip_serializing_if = "IndexMap::is_empty")]
    pub headers: IndexMap<String, String>,
    /// CUDA: compute capability (`90`, `"90a"`); `None` compiles with `-arch=native`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arch: Option<Arch>,
    /// CUDA: preprocessor defines; a `null` value gives `-DNAME`.
    #[serde(default, skip_serializing_if = "IndexMap::is_empty")]
    pub defines: IndexMap<String, Value>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub include_dirs: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub libraries: Vec<String>,
    /// Extra nvcc flags (each must start with `-`); kernelbot's defaults when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flags: Option<Vec<String>>,
    #[serde(default)]
    pub tests: Vec<IndexMap<String, Value>>,
    #[serde(default)]
    pub benchmarks: Vec<IndexMap<String, Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    #[serde(default = "default_ranking")]
    pub ranking_by: RankingBy,
    #[serde(default = "default_timeout")]
    pub test_timeout: u64,
    #[serde(default = "default_timeout")]
    pub benchmark_timeout: u64,
    #[serde(default = "default_timeout")]
    pub ranked_timeout: u64,
    #[serde(default)]
    pub multi_gpu: bool,
    /// Keys kernelbot does not read; kept so the config round-trips.
    #[serde(flatten)]
    pub extra: IndexMap<String, Value>,
}

fn default_ranking() -> RankingBy {
    RankingBy::Last
}
fn default_timeout() -> u64 {
    DEFAULT_TIMEOUT_S
}

/// A CUDA architecture, accepted as a number (`90`) or a string (`"90a"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Arch {
    Number(u32),
    Text(String),
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Arch::Number(n) => write!(f, "{n}"),
            Arch::Text(s) => f.write_str(s),
        }
    }
}

/// Why a config is refused. Each names the field and what is allowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("config is not a valid kernelbot run config: {0}")]
    Shape(String),
    #[error("`sources` is empty; a submission needs at least one file")]
    NoSources,
    #[error("`main` is required when lang is \"py\"; name the file to run (one of `sources`)")]
    MissingMain,
    #[error("`main` is {0:?}, which is not among `sources` ({1})")]
    MainNotInSources(String, String),
    #[error("file name {name:?} in `{field}` is not allowed: {reason}; use a plain relative path inside the work directory")]
    BadFileName {
        field: &'static str,
        name: String,
        reason: &'static str,
    },
    #[error(
        "define name {0:?} is not a C identifier (letters, digits, '_', not starting with a digit)"
    )]
    BadDefineName(String),
    #[error("define {0:?} has a value that is not a string, number, boolean or null")]
    BadDefineValue(String),
    #[error("compiler flag {0:?} must start with '-'")]
    BadFlag(String),
    #[error("`{field}` is {value} s, outside the allowed range {min}..={max} s")]
    TimeoutOutOfRange {
        field: &'static str,
        value: u64,
        min: u64,
        max: u64,
    },
    #[error("`arch` {0:?} is not a CUDA architecture like 90 or \"90a\"")]
    BadArch(String),
    #[error("`ranking_by` {0:?} is not supported; kernelbot's runner supports \"last\"")]
    BadRanking(String),
    #[error(
        "`{0}` must not contain a newline or other line break (\\r, \\v, \\f, U+2028, ...) in key or value (each case is one line `k: v; k: v`)"
    )]
    BadCase(&'static str),
    #[error("mode {0:?} needs at least one entry in `benchmarks`")]
    NoBenchmarks(&'static str),
    #[error("mode \"test\" needs at least one entry in `tests`")]
    NoTests,
}

impl RunConfig {
    /// Parses and validates a config from JSON.
    pub fn from_json(value: Value) -> Result<RunConfig, ConfigError> {
        // The path names the offending field (`test_timeout: invalid type ...`).
        let cfg: RunConfig = serde_path_to_error::deserialize(value).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if path == "." {
                ConfigError::Shape(inner.to_string())
            } else {
                ConfigError::Shape(format!("{path}: {inner}"))
            }
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks everything kernelbot would trip over later, and the things it does not check
    /// but should (paths escaping the work directory). Returns the warnings on success.
    pub fn validate(&self) -> Result<Vec<String>, ConfigError> {
        if self.sources.is_empty() {
            return Err(ConfigError::NoSources);
        }
        for name in self.sources.keys() {
            check_file_name("sources", name)?;
        }
        for name in self.headers.keys() {
            check_file_name("headers", name)?;
        }
        if self.lang == Lang::Python {
            let main = self.main.as_deref().ok_or(ConfigError::MissingMain)?;
            if !self.sources.contains_key(main) {
                let names: Vec<&str> = self.sources.keys().map(String::as_str).collect();
                return Err(ConfigError::MainNotInSources(
                    main.to_string(),
                    names.join(", "),
                ));
            }
        }
        for (name, value) in &self.defines {
            if !is_identifier(name) {
                return Err(ConfigError::BadDefineName(name.clone()));
            }
            if value.is_array() || value.is_object() {
                return Err(ConfigError::BadDefineValue(name.clone()));
            }
        }
        for flag in self.flags.iter().flatten() {
            if !flag.starts_with('-') {
                return Err(ConfigError::BadFlag(flag.clone()));
            }
        }
        for (field, value) in [
            ("test_timeout", self.test_timeout),
            ("benchmark_timeout", self.benchmark_timeout),
            ("ranked_timeout", self.ranked_timeout),
        ] {
            if !TIMEOUT_RANGE_S.contains(&value) {
                return Err(ConfigError::TimeoutOutOfRange {
                    field,
                    value,
                    min: *TIMEOUT_RANGE_S.start(),
                    max: *TIMEOUT_RANGE_S.end(),
                });
            }
        }
        if let Some(arch) = &self.arch {
            let s = arch.to_string();
            let digits = s.trim_end_matches(|c: char| c.is_ascii_lowercase());
            let ok = !digits.is_empty()
                && digits.len() <= 4
                && digits.chars().all(|c| c.is_ascii_digit())
                && s.len() - digits.len() <= 1;
            if !ok {
                return Err(ConfigError::BadArch(s));
            }
        }
        if let RankingBy::Other(other) = &self.ranking_by {
            return Err(ConfigError::BadRanking(other.clone()));
        }
        for (field, cases) in [("tests", &self.tests), ("benchmarks", &self.benchmarks)] {
            for case in cases {
                for (k, v) in case {
                    // Any break Python's splitlines() knows: kernelbot picks the last
                    // benchmark line and splits profile runs with it, so a case holding one
                    // would be cut in two there but not here.
                    if k.contains(is_line_break) || case_value_text(v).contains(is_line_break) {
                        return Err(ConfigError::BadCase(field));
                    }
                }
            }
        }
        match self.mode {
            Mode::Test if self.tests.is_empty() => return Err(ConfigError::NoTests),
            Mode::Benchmark | Mode::Profile if self.benchmarks.is_empty() => {
                return Err(ConfigError::NoBenchmarks(self.mode.as_str()))
            }
            Mode::Leaderboard | Mode::Private if self.tests.is_empty() => {
                return Err(ConfigError::NoTests)
            }
            Mode::Leaderboard | Mode::Private if self.benchmarks.is_empty() => {
                return Err(ConfigError::NoBenchmarks(self.mode.as_str()))
            }
            _ => {}
        }
        Ok(self
            .extra
            .keys()
            .map(|k| format!("config key {k:?} is not used by the runner; ignored"))
            .collect())
    }
}

/// kernelbot's `build_test_string`: one line per case, `k: v; k: v`, values as Python's `str`.
pub fn cases_text(cases: &[IndexMap<String, Value>]) -> String {
    let mut out = String::new();
    for case in cases {
        let kv: Vec<String> = case
            .iter()
            .map(|(k, v)| format!("{k}: {}", case_value_text(v)))
            .collect();
        out.push_str(&kv.join("; "));
        out.push('\n');
    }
    out
}

/// Python's `str()` of a JSON value, for the scalar values cases hold.
pub fn case_value_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Null => "None".into(),
        Value::Number(n) => match n.as_f64() {
            Some(f) if !n.is_i64() && !n.is_u64() => {
                String::from_utf8(crate::payload::python_json(&f).unwrap_or_default())
                    .unwrap_or_default()
            }
            _ => n.to_string(),
        },
        other => String::from_utf8(crate::payload::python_json(other).unwrap_or_default())
            .unwrap_or_default(),
    }
}

/// A line boundary of Python's `str.splitlines()`.
fn is_line_break(c: char) -> bool {
    matches!(
        c,
        '\n' | '\r'
            | '\x0b'
            | '\x0c'
            | '\x1c'
            | '\x1d'
            | '\x1e'
            | '\u{85}'
            | '\u{2028}'
            | '\u{2029}'
    )
}

fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
}

/// A file name must stay inside the work directory lexically: relative, made of plain
/// components only. (Symlinks cannot be smuggled in: the runner writes into a fresh directory
/// and refuses to follow links; see `workdir`.)
fn check_file_name(field: &'static str, name: &str) -> Result<(), ConfigError> {
    let bad = |reason| ConfigError::BadFileName {
        field,
        name: name.to_string(),
        reason,
    };
    if name.is_empty() {
        return Err(bad("it is empty"));
    }
    if name.contains('\0') {
        return Err(bad("it contains a NUL byte"));
    }
    if name.len() > 255 {
        return Err(bad("it is longer than 255 bytes"));
    }
    let path = Path::new(name);
    if path.is_absolute() {
        return Err(bad("it is an absolute path"));
    }
    for c in path.components() {
        match c {
            Component::Normal(_) => {}
            Component::ParentDir => return Err(bad("it contains '..'")),
            Component::CurDir => return Err(bad("it contains '.' components")),
            Component::RootDir | Component::Prefix(_) => return Err(bad("it is an absolute path")),
        }
    }
    if name.ends_with('/') {
        return Err(bad("it names a directory"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"lang": "py", "mode": "test", "main": "eval.py",
               "sources": {"eval.py": "print(1)", "submission.py": ""},
               "tests": [{"size": 128, "seed": 5}], "benchmarks": [{"size": 1024}]})
    }

    fn with(patch: Value) -> Result<RunConfig, ConfigError> {
        let mut v = base();
        for (k, val) in patch.as_object().unwrap() {
            if val.is_null() {
                v.as_object_mut().unwrap().remove(k);
            } else {
                v[k] = val.clone();
            }
        }
        RunConfig::from_json(v)
    }

    #[test]
    fn accepts_a_kernelbot_config_with_defaults() {
        let c = with(json!({})).unwrap();
        assert_eq!(c.test_timeout, 180);
        assert_eq!(c.ranking_by, RankingBy::Last);
        assert!(!c.multi_gpu);
    }

    #[test]
    fn names_each_problem() {
        let cases = [
            (json!({"lang": "rust"}), "not a valid kernelbot run config"),
            (json!({"mode": "fast"}), "not a valid kernelbot run config"),
            (json!({"main": null}), "`main` is required"),
            (json!({"main": "x.py"}), "not among `sources`"),
            (json!({"sources": {}}), "`sources` is empty"),
            (
                json!({"sources": {"/etc/passwd": "", "eval.py": ""}}),
                "absolute path",
            ),
            (
                json!({"sources": {"../x": "", "eval.py": ""}}),
                "contains '..'",
            ),
            (
                json!({"sources": {"a/../../x": "", "eval.py": ""}}),
                "contains '..'",
            ),
            (
                json!({"lang": "cu", "defines": {"A-B": "1"}}),
                "not a C identifier",
            ),
            (
                json!({"lang": "cu", "flags": ["O3"]}),
                "must start with '-'",
            ),
            (json!({"test_timeout": 0}), "outside the allowed range"),
            (
                json!({"ranked_timeout": 100000}),
                "outside the allowed range",
            ),
            (
                json!({"test_timeout": -5}),
                "not a valid kernelbot run config",
            ),
            (
                json!({"lang": "cu", "arch": "sm_90; rm"}),
                "not a CUDA architecture",
            ),
            (json!({"ranking_by": "mean"}), "supports \"last\""),
            (json!({"tests": []}), "needs at least one entry in `tests`"),
            (
                json!({"tests": [{"a": "x\ny"}]}),
                "must not contain a newline",
            ),
            (
                json!({"benchmarks": [{"a": "x\ry"}]}),
                "must not contain a newline",
            ),
            (
                json!({"benchmarks": [{"a\u{2028}b": 1}]}),
                "must not contain a newline",
            ),
            (
                json!({"sources": "nope"}),
                "not a valid kernelbot run config",
            ),
        ];
        for (patch, want) in cases {
            let err = with(patch.clone())
                .expect_err(&patch.to_string())
                .to_string();
            assert!(err.contains(want), "{patch}: {err}");
        }
    }

    #[test]
    fn unknown_keys_are_kept_and_warned() {
        let mut v = base();
        v["submission_id"] = json!(42);
        let c = RunConfig::from_json(v.clone()).unwrap();
        assert_eq!(c.extra["submission_id"], json!(42));
        assert_eq!(c.validate().unwrap().len(), 1);
        let back = serde_json::to_value(&c).unwrap();
        assert_eq!(back["submission_id"], json!(42));
    }

    #[test]
    fn arch_accepts_number_and_suffix() {
        assert!(with(json!({"lang": "cu", "arch": 90})).is_ok());
        assert!(with(json!({"lang": "cu", "arch": "90a"})).is_ok());
    }

    #[test]
    fn cases_text_matches_build_test_string() {
        let cases: Vec<IndexMap<String, Value>> = serde_json::from_value(json!([
            {"size": 128, "seed": 5, "scale": 0.5, "flag": true, "name": "a b"},
            {"size": 1}
        ]))
        .unwrap();
        assert_eq!(
            cases_text(&cases),
            "size: 128; seed: 5; scale: 0.5; flag: True; name: a b\nsize: 1\n"
        );
    }
}
