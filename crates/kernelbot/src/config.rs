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
    /// Python (`py`): `main` is run with the interpreter.
    #[serde(rename = "py")]
    Python,
    /// CUDA (`cu`): the sources are compiled with nvcc.
    #[serde(rename = "cu")]
    Cuda,
}

/// Evaluation mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Run the tests.
    Test,
    /// Run the benchmarks.
    Benchmark,
    /// Tests, benchmarks, then the ranked run, stopping at the first that does not pass.
    Leaderboard,
    /// As `leaderboard`, for a private submission.
    Private,
    /// Each benchmark line under a profiler.
    Profile,
}

impl Mode {
    /// The mode as kernelbot spells it.
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

/// kernelbot's `RankCriterion`: how the leaderboard score is made from the benchmarks.
/// `last` (the default) runs only the last benchmark line in `benchmark`, `leaderboard` and
/// `profile` runs; `mean` and `geom` run all of them (the backend averages the results).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RankingBy {
    /// Only the last benchmark line counts.
    Last,
    /// The arithmetic mean of all benchmarks.
    Mean,
    /// The geometric mean of all benchmarks.
    Geom,
}

impl RankingBy {
    /// Every criterion, in kernelbot's order.
    pub const ALL: [RankingBy; 3] = [RankingBy::Last, RankingBy::Mean, RankingBy::Geom];

    /// The criterion as kernelbot spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            RankingBy::Last => "last",
            RankingBy::Mean => "mean",
            RankingBy::Geom => "geom",
        }
    }
}

/// The run config as kernelbot sends it. Read it with [`RunConfig::from_json`], which validates
/// it and keeps the keys it does not read ([`RunConfig::extra`]); serde alone does neither.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    /// The submission's language.
    pub lang: Lang,
    /// What to run.
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
    /// CUDA: `-I` directories (must exist on the node).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub include_dirs: Vec<String>,
    /// CUDA: `-l` libraries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub libraries: Vec<String>,
    /// Extra nvcc flags (each must start with `-`); kernelbot's defaults when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flags: Option<Vec<String>>,
    /// Test cases, one `k: v; k: v` line each.
    #[serde(default)]
    pub tests: Vec<IndexMap<String, Value>>,
    /// Benchmark cases, one `k: v; k: v` line each.
    #[serde(default)]
    pub benchmarks: Vec<IndexMap<String, Value>>,
    /// Seed passed to the harness; never logged.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::integral::opt_i64"
    )]
    pub seed: Option<i64>,
    /// How the leaderboard score is made from the benchmarks.
    #[serde(default = "default_ranking")]
    pub ranking_by: RankingBy,
    /// Seconds the test run may take.
    #[serde(default = "default_timeout", deserialize_with = "crate::integral::u64")]
    pub test_timeout: u64,
    /// Seconds the benchmark run may take.
    #[serde(default = "default_timeout", deserialize_with = "crate::integral::u64")]
    pub benchmark_timeout: u64,
    /// Seconds the ranked (leaderboard) run may take.
    #[serde(default = "default_timeout", deserialize_with = "crate::integral::u64")]
    pub ranked_timeout: u64,
    /// Whether the task uses every GPU of the machine.
    #[serde(default)]
    pub multi_gpu: bool,
    /// Keys kernelbot does not read; kept so the config round-trips. Written flattened, read
    /// by [`RunConfig::from_json`] beside the fields: a flattened field would make serde buffer
    /// the whole config in a form that cannot hold an integer beyond 64 bits (which kernelbot,
    /// in Python, takes anywhere: in a case, in a key it ignores).
    #[serde(flatten, skip_deserializing)]
    pub extra: IndexMap<String, Value>,
}

/// Every key [`RunConfig`] reads; the rest of a config is [`RunConfig::extra`]. (A unit test
/// holds it to the struct's fields.)
const FIELDS: [&str; 18] = [
    "lang",
    "mode",
    "sources",
    "main",
    "headers",
    "arch",
    "defines",
    "include_dirs",
    "libraries",
    "flags",
    "tests",
    "benchmarks",
    "seed",
    "ranking_by",
    "test_timeout",
    "benchmark_timeout",
    "ranked_timeout",
    "multi_gpu",
];

fn default_ranking() -> RankingBy {
    RankingBy::Last
}
fn default_timeout() -> u64 {
    DEFAULT_TIMEOUT_S
}

/// A CUDA architecture, accepted as a number (`90`, or `90.0`: one integer to JSON Schema) or
/// a string (`"90a"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Arch {
    /// A number (`90`).
    Number(#[serde(deserialize_with = "crate::integral::u32")] u32),
    /// A string (`"90a"`).
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
    /// The JSON does not have the run config's shape; says where.
    #[error("config is not a valid kernelbot run config: {0}")]
    Shape(String),
    /// No source files.
    #[error("`sources` is empty; a submission needs at least one file")]
    NoSources,
    /// A Python submission without `main`.
    #[error("`main` is required when lang is \"py\"; name the file to run (one of `sources`)")]
    MissingMain,
    /// `main` (first) is not one of `sources` (second, listed).
    #[error("`main` is {0:?}, which is not among `sources` ({1}); kernelbot requires `main` to be one of the keys of `sources`, spelled the same")]
    MainNotInSources(String, String),
    /// Two fields name the same file in the work directory.
    #[error("{first:?} (in `{first_field}`) and {second:?} (in `{second_field}`) name the same file {path:?}; give each file once")]
    DuplicateFile {
        /// The field of the first name.
        first_field: &'static str,
        /// The first name.
        first: String,
        /// The field of the second name.
        second_field: &'static str,
        /// The second name.
        second: String,
        /// The path both resolve to.
        path: String,
    },
    /// A file name that is not a plain relative path inside the work directory.
    #[error("file name {name:?} in `{field}` is not allowed: {reason}; use a plain relative path inside the work directory")]
    BadFileName {
        /// The field it is in.
        field: &'static str,
        /// The name.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A define name that is not a C identifier.
    #[error(
        "define name {0:?} is not a C identifier (letters, digits, '_', not starting with a digit)"
    )]
    BadDefineName(String),
    /// A define value of an unsupported JSON type.
    #[error("define {0:?} has a value that is not a string, number, boolean or null")]
    BadDefineValue(String),
    /// A compiler flag that does not start with `-`.
    #[error("compiler flag {0:?} must start with '-'")]
    BadFlag(String),
    /// A timeout outside [`TIMEOUT_RANGE_S`].
    #[error("`{field}` is {value} s, outside the allowed range {min}..={max} s")]
    TimeoutOutOfRange {
        /// Which timeout.
        field: &'static str,
        /// Its value, seconds.
        value: u64,
        /// The least allowed.
        min: u64,
        /// The most allowed.
        max: u64,
    },
    /// An `arch` that is not a CUDA architecture.
    #[error("`arch` {0:?} is not a CUDA architecture like 90 or \"90a\"")]
    BadArch(String),
    /// A `ranking_by` kernelbot does not know.
    #[error("`ranking_by` is {0}, which is not one of kernelbot's ranking criteria: \"last\", \"mean\" or \"geom\"")]
    BadRanking(String),
    /// A test or benchmark case containing a line break (names `tests` or `benchmarks`).
    #[error(
        "`{0}` must not contain a newline or other line break (\\r, \\v, \\f, U+2028, ...) in key or value (each case is one line `k: v; k: v`)"
    )]
    BadCase(&'static str),
    /// A run that takes the last benchmark line while there are none (names the mode).
    #[error("the {0:?} run takes the last benchmark line (`ranking_by` is \"last\"), but `benchmarks` is empty; kernelbot fails here too (the last of no lines); add a benchmark or rank by \"mean\" or \"geom\"")]
    LastOfNoBenchmarks(&'static str),
    /// A profile run whose benchmark line is empty (its index).
    #[error("profile run {0} gets benchmark line {0}, which is empty (a case with no keys), and `ranking_by` \"last\" takes the last line of it; kernelbot fails here too (the last of no lines); give the case a key or rank by \"mean\" or \"geom\"")]
    LastOfEmptyProfileLine(usize),
}

impl RunConfig {
    /// Parses and validates a config from JSON.
    pub fn from_json(value: Value) -> Result<RunConfig, ConfigError> {
        // kernelbot turns `ranking_by` into its RankCriterion enum, which takes exactly these
        // three strings; anything else (`null` included) is refused there, and here.
        if let Some(r) = value.get("ranking_by") {
            if !RankingBy::ALL
                .iter()
                .any(|k| r.as_str() == Some(k.as_str()))
            {
                return Err(ConfigError::BadRanking(r.to_string()));
            }
        }
        let extra: IndexMap<String, Value> = match &value {
            Value::Object(map) => map
                .iter()
                .filter(|(k, _)| !FIELDS.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            _ => IndexMap::new(),
        };
        // The path names the offending field (`test_timeout: invalid type ...`).
        let mut cfg: RunConfig = serde_path_to_error::deserialize(value).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if path == "." {
                ConfigError::Shape(inner.to_string())
            } else {
                ConfigError::Shape(format!("{path}: {inner}"))
            }
        })?;
        cfg.extra = extra;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks everything kernelbot would trip over later, and the things it does not check
    /// but should (paths escaping the work directory). Returns the warnings on success.
    // Long because one check per field, in kernelbot's order, each with its own error.
    pub fn validate(&self) -> Result<Vec<String>, ConfigError> {
        if self.sources.is_empty() {
            return Err(ConfigError::NoSources);
        }
        // `./a.py` and `a.py` are one file to kernelbot (it writes both, the later wins); a
        // config that gives a file twice is refused rather than one content silently lost.
        // CUDA writes sources and headers into one directory; Python writes only sources.
        let mut seen: IndexMap<String, (&'static str, &str)> = IndexMap::new();
        let headers = self.headers.keys().map(|n| ("headers", n));
        for (field, name) in self.sources.keys().map(|n| ("sources", n)).chain(headers) {
            let path = work_path(field, name)?;
            if field == "headers" && self.lang == Lang::Python {
                continue;
            }
            if let Some(&(first_field, first)) = seen.get(&path) {
                return Err(ConfigError::DuplicateFile {
                    first_field,
                    first: first.to_string(),
                    second_field: field,
                    second: name.clone(),
                    path,
                });
            }
            seen.insert(path, (field, name));
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
        for (field, cases) in [("tests", &self.tests), ("benchmarks", &self.benchmarks)] {
            for case in cases {
                for (k, v) in case {
                    // Any break Python's splitlines() knows: kernelbot picks the last
                    // benchmark line and splits profile runs with it, so a case holding one
                    // would be cut in two there but not here.
                    if k.contains(crate::pyrepr::is_line_break)
                        || case_value_text(v).contains(crate::pyrepr::is_line_break)
                    {
                        return Err(ConfigError::BadCase(field));
                    }
                }
            }
        }
        // Empty `tests` or `benchmarks` are not refused: kernelbot hands the harness an empty
        // cases file (the harness decides), runs no profile at all, and only fails where it
        // takes the last of no benchmark lines, which the evaluation reports when it gets there.
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

/// Python's `str()` of a value as `json.loads` gives it (see [`crate::pyrepr`]).
pub fn case_value_text(v: &Value) -> String {
    crate::pyrepr::str_of(v)
}

fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
}

/// The file a name in `sources` or `headers` stands for, relative to the work directory,
/// normalized as Python's `pathlib` does (kernelbot writes `Path(name)` in its working
/// directory): `./a.py`, `a//b.py`, `a/./b.py` and `a/b.py/` are `a.py`, `a/b.py` and
/// `a/b.py`. The name must stay inside lexically: relative, without `..`. (Symlinks cannot
/// be smuggled in: the runner refuses to follow links; see `workdir`.)
pub fn work_path(field: &'static str, name: &str) -> Result<String, ConfigError> {
    let bad = |reason| ConfigError::BadFileName {
        field,
        name: name.to_string(),
        reason,
    };
    if name.is_empty() {
        return Err(bad("it is empty"));
    }
    // Printable ASCII (what service/openapi.json's FileName says): no control character (a
    // NUL, a line break, a terminal escape) reaches a file name, and characters are bytes, so
    // the 255 below is both what JSON Schema's maxLength counts and what a file system takes.
    if !name.bytes().all(|b| (b' '..=b'~').contains(&b)) {
        return Err(bad(
            "it has a character outside printable ASCII (space to ~: no control characters, no non-ASCII letters)",
        ));
    }
    if name.len() > 255 {
        return Err(bad("it is longer than 255 characters"));
    }
    let path = Path::new(name);
    if path.is_absolute() {
        return Err(bad("it is an absolute path"));
    }
    let mut parts: Vec<&str> = Vec::new();
    for c in path.components() {
        match c {
            Component::Normal(part) => parts.push(part.to_str().unwrap_or_default()),
            Component::CurDir => {}
            Component::ParentDir => return Err(bad("it contains '..'")),
            Component::RootDir | Component::Prefix(_) => return Err(bad("it is an absolute path")),
        }
    }
    if parts.is_empty() {
        return Err(bad("it names the work directory itself"));
    }
    Ok(parts.join("/"))
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
            (
                json!({"ranking_by": "WRONG"}),
                "not one of kernelbot's ranking criteria",
            ),
            (
                json!({"sources": {"eval.py": "", "./eval.py": ""}}),
                "name the same file \"eval.py\"",
            ),
            (
                json!({"sources": {"./../x.py": "", "eval.py": ""}}),
                "contains '..'",
            ),
            (json!({"main": "./eval.py"}), "spelled the same"),
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
    fn ranking_by_takes_kernelbots_three_criteria_only() {
        for r in RankingBy::ALL {
            let c = with(json!({"ranking_by": r.as_str()})).unwrap();
            assert_eq!(c.ranking_by, r);
            assert_eq!(serde_json::to_value(&c).unwrap()["ranking_by"], r.as_str());
        }
        for bad in [
            json!("LAST"),
            json!("Mean"),
            json!(""),
            json!(1),
            json!(["geom"]),
        ] {
            let err = with(json!({ "ranking_by": bad.clone() })).unwrap_err();
            assert_eq!(err, ConfigError::BadRanking(bad.to_string()));
        }
        let mut v = base();
        v["ranking_by"] = Value::Null;
        let err = RunConfig::from_json(v).unwrap_err().to_string();
        assert!(err.contains("`ranking_by` is null"), "{err}");
    }

    #[test]
    fn empty_cases_are_left_to_the_harness() {
        for mode in ["test", "benchmark", "leaderboard", "private", "profile"] {
            let c = with(json!({"mode": mode, "tests": [], "benchmarks": []}));
            assert!(c.is_ok(), "{mode}: {c:?}");
        }
    }

    #[test]
    fn the_fields_read_are_the_structs_and_the_rest_is_kept() {
        let full = json!({"lang": "cu", "mode": "test", "sources": {"k.cu": ""}, "main": "k.cu",
            "headers": {"h.h": ""}, "arch": 90, "defines": {"A": 1}, "include_dirs": ["/i"],
            "libraries": ["m"], "flags": ["-O3"], "tests": [{"a": 1}], "benchmarks": [{"b": 2}],
            "seed": 1, "ranking_by": "mean", "test_timeout": 1, "benchmark_timeout": 2,
            "ranked_timeout": 3, "multi_gpu": true});
        let cfg = RunConfig::from_json(full).unwrap();
        let written = serde_json::to_value(&cfg).unwrap();
        let mut keys: Vec<&str> = written
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        let mut fields = FIELDS.to_vec();
        keys.sort_unstable();
        fields.sort_unstable();
        assert_eq!(keys, fields);
        // Integers beyond 64 bits anywhere: kept digit for digit, as kernelbot (Python) keeps them.
        let big = json!({"lang": "py", "mode": "test", "main": "a.py", "sources": {"a.py": ""},
            "tests": [{"n": -145546438093087251609946161152_i128}],
            "note": [99999999999999999999999999999_u128, {"x": 1}]});
        let cfg = RunConfig::from_json(big.clone()).unwrap();
        assert_eq!(cfg.extra["note"], big["note"]);
        assert_eq!(
            cases_text(&cfg.tests),
            "n: -145546438093087251609946161152\n"
        );
        assert_eq!(serde_json::to_value(&cfg).unwrap()["note"], big["note"]);
    }

    #[test]
    fn file_names_are_normalized_like_pathlib() {
        for (name, want) in [
            ("a.py", "a.py"),
            ("./a.py", "a.py"),
            ("././a.py", "a.py"),
            ("pkg/./b.py", "pkg/b.py"),
            ("pkg//b.py", "pkg/b.py"),
            ("pkg/b.py/", "pkg/b.py"),
        ] {
            assert_eq!(work_path("sources", name).unwrap(), want, "{name}");
        }
        for name in ["", ".", "./", "..", "a/../b", "/abs.py", "x\0y"] {
            assert!(work_path("sources", name).is_err(), "{name:?}");
        }
        // Printable ASCII only, at most 255 characters (bytes, then).
        for name in ["a\nb.py", "\u{1b}[31m.py", "caf\u{e9}.py", "tab\t.py"] {
            let e = work_path("sources", name).unwrap_err().to_string();
            assert!(e.contains("printable ASCII"), "{name:?}: {e}");
        }
        assert!(work_path("sources", &"a".repeat(255)).is_ok());
        assert!(work_path("sources", &"a".repeat(256)).is_err());
        for name in ["...", " ", "a b/c~d.py", ".x", "x.", "a/."] {
            assert!(work_path("sources", name).is_ok(), "{name:?}");
        }
        // `./main.py` runs as given when it is the key.
        let c = with(json!({"sources": {"./eval.py": ""}, "main": "./eval.py"})).unwrap();
        assert_eq!(c.main.as_deref(), Some("./eval.py"));
        // A header of the same path clashes for CUDA, which writes both; Python ignores headers.
        let cu = json!({"lang": "cu", "sources": {"k.cu": ""}, "headers": {"./k.cu": ""}});
        assert!(matches!(with(cu), Err(ConfigError::DuplicateFile { .. })));
        assert!(with(json!({"headers": {"./eval.py": ""}})).is_ok());
    }

    #[test]
    fn arch_accepts_number_and_suffix() {
        assert!(with(json!({"lang": "cu", "arch": 90})).is_ok());
        assert!(with(json!({"lang": "cu", "arch": "90a"})).is_ok());
    }

    #[test]
    fn cases_text_matches_build_test_string() {
        let cases: Vec<IndexMap<String, Value>> = serde_json::from_str(
            r#"[{"size": 128, "seed": 5, "scale": 0.5, "flag": true, "name": "a b",
                 "shape": [2, 3], "opts": {"k": "v", "n": null}, "big": 1180591620717411303424,
                 "eps": 1e-7},
                {"size": 1}]"#,
        )
        .unwrap();
        assert_eq!(
            cases_text(&cases),
            "size: 128; seed: 5; scale: 0.5; flag: True; name: a b; shape: [2, 3]; \
             opts: {'k': 'v', 'n': None}; big: 1180591620717411303424; eps: 1e-07\nsize: 1\n"
        );
    }
}
