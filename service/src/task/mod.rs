//! kernelbot task directories: `task.yml` read as kernelbot's `make_task_definition` reads it,
//! and the run config built from it as kernelbot's backend builds it (`build_task_config`).
//!
//! A task directory holds `task.yml` and the files it names:
//!
//! ```yaml
//! files:
//!   - {name: "eval.py", source: "eval.py"}
//!   - {name: "submission.py", source: "@SUBMISSION@"}   # the submission goes here
//! lang: "py"                 # or "cu"
//! description: "..."         # required
//! config: {main: "eval.py"}  # cu: {sources: [...], include_dirs: [...], defines: {...}, compile_flags: [...]}
//! templates: {Python: "template.py"}
//! tests: [{size: 128, seed: 1}]
//! benchmarks: [{size: 4096, seed: 2}]
//! ranking_by: "geom"         # last (default), mean, geom
//! ```
//!
//! Other keys: `libraries`, `test_timeout`, `benchmark_timeout`, `ranked_timeout` (180 s each
//! by default), `seed`, `multi_gpu` (then every test and benchmark needs `world_size`), `gpus`
//! and `validation` (kernelbot's, not part of a run). An unknown key is refused, as kernelbot's
//! `LeaderboardTask(**raw)` refuses it. The YAML is read with PyYAML's rules ([`pyyaml`]), and
//! files as Python's `read_text` reads them (universal newlines), so the config is the one
//! kernelbot would send for the same directory.

pub mod bundled;
pub mod pyyaml;

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

/// What is wrong with a task directory or a submission; each says which file and how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// A file could not be read.
    #[error("cannot read {}", .path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `task.yml` is not YAML kernelbot can read.
    #[error("{}: not a task kernelbot can read", .path.display())]
    Yaml {
        /// `task.yml`.
        path: PathBuf,
        /// Why.
        #[source]
        source: pyyaml::YamlError,
    },
    /// `task.yml` is YAML but not a kernelbot task.
    #[error("{}: {what}", .path.display())]
    Invalid {
        /// `task.yml`.
        path: PathBuf,
        /// What is wrong, and what kernelbot accepts.
        what: String,
    },
    /// The submission is not UTF-8 text.
    #[error("{} is not UTF-8 text; kernelbot reads submissions as UTF-8", .path.display())]
    NotText {
        /// The submission.
        path: PathBuf,
    },
}

/// The keys `task.yml` may have at the top level (kernelbot's `LeaderboardTask` fields, plus
/// `description`, `templates` and `gpus`, which `make_task_definition` takes out).
const TOP_KEYS: &[&str] = &[
    "files",
    "lang",
    "description",
    "config",
    "templates",
    "gpus",
    "libraries",
    "tests",
    "test_timeout",
    "benchmarks",
    "benchmark_timeout",
    "ranked_timeout",
    "ranking_by",
    "seed",
    "multi_gpu",
    "validation",
];

/// kernelbot's template languages.
const TEMPLATE_LANGS: &[&str] = &["CUDA", "Python", "Triton", "HIP", "CuteDSL"];

/// The placeholder file content the submission replaces.
pub const SUBMISSION_PLACEHOLDER: &str = "@SUBMISSION@";

/// kernelbot's submission modes (`SubmissionMode`): the run config's own type, defined once in
/// `kernelkite_kernelbot` (its `clap` feature gives the CLI's `--mode`).
pub use kernelkite_kernelbot::config::Mode;

/// A task directory as kernelbot's `make_task_definition` reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskDefinition {
    /// The directory.
    pub dir: PathBuf,
    /// `py` or `cu`.
    pub lang: String,
    /// File name → content, in `task.yml`'s order; the submission's slot holds
    /// [`SUBMISSION_PLACEHOLDER`].
    pub files: Map<String, Value>,
    /// `config` (`main` for `py`; `sources`, `include_dirs`, `defines`, `compile_flags` for `cu`).
    pub config: Map<String, Value>,
    /// `description`.
    pub description: String,
    /// Template language → file content.
    pub templates: Map<String, Value>,
    /// `gpus` (kernelbot uses it for local development only).
    pub gpus: Value,
    /// Everything else of `LeaderboardTask`, with kernelbot's defaults filled in.
    pub task: Map<String, Value>,
}

/// Reads `<dir>/task.yml` (or `dir` itself when it is a file) and the files it names.
pub fn load(dir: &Path) -> Result<TaskDefinition, TaskError> {
    let yml = if dir.is_dir() {
        dir.join("task.yml")
    } else {
        dir.to_path_buf()
    };
    let root = yml.parent().unwrap_or(Path::new(".")).to_path_buf();
    let text = read_text(&yml)?;
    let raw = pyyaml::load(&text).map_err(|source| TaskError::Yaml {
        path: yml.clone(),
        source,
    })?;
    let invalid = &|what: String| TaskError::Invalid {
        path: yml.clone(),
        what,
    };
    let Value::Object(mut raw) = raw else {
        return Err(invalid(
            "the file must be a YAML mapping of the task's keys".into(),
        ));
    };
    if let Some(k) = raw.keys().find(|k| !TOP_KEYS.contains(&k.as_str())) {
        return Err(invalid(format!(
            "unknown key {k:?}; kernelbot accepts: {}",
            TOP_KEYS.join(", ")
        )));
    }

    let files = read_files(&mut raw, &root, invalid)?;
    read_validation(&mut raw, &root, invalid)?;
    let templates = read_templates(&mut raw, &root, invalid)?;

    let description = match raw.remove("description") {
        Some(Value::String(d)) => d,
        Some(other) => other.to_string(),
        None => return Err(invalid("`description` is required".into())),
    };
    let gpus = raw.remove("gpus").unwrap_or_else(|| json!([]));

    let lang = match raw.remove("lang") {
        Some(Value::String(l)) if l == "py" || l == "cu" => l,
        other => {
            return Err(invalid(format!(
                "`lang` must be \"py\" or \"cu\", not {}",
                other.map_or("missing".into(), |v| v.to_string())
            )))
        }
    };
    let config = match raw.remove("config") {
        Some(Value::Object(c)) => c,
        _ => return Err(invalid("`config` is required (a mapping)".into())),
    };
    check_task_config(&lang, &config).map_err(invalid)?;

    let task = run_settings(&mut raw, invalid)?;

    Ok(TaskDefinition {
        dir: root,
        lang,
        files,
        config,
        description,
        templates,
        gpus,
        task,
    })
}

/// Builds a [`TaskError::Invalid`] for the `task.yml` being read.
type Invalid<'a> = &'a dyn Fn(String) -> TaskError;

/// `files`: each `{name, source}` read from the task directory (the submission's slot keeps
/// [`SUBMISSION_PLACEHOLDER`]), in order; one of them must be the submission's.
fn read_files(
    raw: &mut Map<String, Value>,
    root: &Path,
    invalid: Invalid<'_>,
) -> Result<Map<String, Value>, TaskError> {
    let files = match raw.remove("files") {
        Some(Value::Array(specs)) => {
            let mut files = Map::new();
            for (i, spec) in specs.iter().enumerate() {
                let field = |key: &str| {
                    spec.get(key).and_then(Value::as_str).ok_or_else(|| {
                        invalid(format!(
                            "files[{i}] needs a string {key:?} (each entry is {{name: ..., source: ...}})"
                        ))
                    })
                };
                let (name, source) = (field("name")?, field("source")?);
                let content = if source == SUBMISSION_PLACEHOLDER {
                    SUBMISSION_PLACEHOLDER.to_string()
                } else {
                    read_text(&root.join(source))?
                };
                files.insert(name.to_string(), Value::String(content));
            }
            files
        }
        _ => {
            return Err(invalid(
                "`files` is required: a list of {name, source} entries".into(),
            ))
        }
    };
    if !files
        .values()
        .any(|v| v.as_str() == Some(SUBMISSION_PLACEHOLDER))
    {
        return Err(invalid(format!(
            "no file has source {SUBMISSION_PLACEHOLDER:?}, so a submission has nowhere to go"
        )));
    }
    Ok(files)
}

/// `validation`: its `script` is read in now, as kernelbot does at load time (it is not part
/// of a run), and kept as `source`.
fn read_validation(
    raw: &mut Map<String, Value>,
    root: &Path,
    invalid: Invalid<'_>,
) -> Result<(), TaskError> {
    if let Some(v) = raw.get_mut("validation") {
        // kernelbot reads the script in at load time; it is not part of a run.
        let script = v
            .as_object_mut()
            .and_then(|m| m.remove("script"))
            .and_then(|s| s.as_str().map(str::to_string))
            .ok_or_else(|| invalid("`validation` needs `version` and `script`".into()))?;
        let source = read_text(&root.join(&script))?;
        if let Some(m) = v.as_object_mut() {
            m.insert("source".into(), Value::String(source));
        }
    }
    Ok(())
}

/// `templates`: language → the named file's content.
fn read_templates(
    raw: &mut Map<String, Value>,
    root: &Path,
    invalid: Invalid<'_>,
) -> Result<Map<String, Value>, TaskError> {
    let mut templates = Map::new();
    match raw.remove("templates") {
        None => {}
        Some(Value::Object(t)) if !t.is_empty() => {
            for (lang, source) in t {
                if !TEMPLATE_LANGS.contains(&lang.as_str()) {
                    return Err(invalid(format!(
                        "template language {lang:?} is not one of {}",
                        TEMPLATE_LANGS.join(", ")
                    )));
                }
                let source = source
                    .as_str()
                    .ok_or_else(|| invalid(format!("templates.{lang} must be a file name")))?;
                templates.insert(lang, Value::String(read_text(&root.join(source))?));
            }
        }
        // kernelbot keeps an empty `templates:` in the task, where its dataclass refuses it.
        Some(_) => {
            return Err(invalid(
                "`templates` must map languages to files; leave it out when there are none".into(),
            ))
        }
    }
    Ok(templates)
}

/// The rest of `LeaderboardTask` (tests, benchmarks, timeouts, seed, `ranking_by`, ...), with
/// kernelbot's defaults filled in; a multi-GPU task's cases must each name their world size.
fn run_settings(
    raw: &mut Map<String, Value>,
    invalid: Invalid<'_>,
) -> Result<Map<String, Value>, TaskError> {
    let ranking_by = match raw.remove("ranking_by") {
        None => "last".to_string(),
        Some(Value::String(r)) if ["last", "mean", "geom"].contains(&r.as_str()) => r,
        Some(other) => {
            return Err(invalid(format!(
                "`ranking_by` must be last, mean or geom, not {other}"
            )))
        }
    };
    let mut task = Map::new();
    for (key, default) in [
        ("libraries", json!([])),
        ("tests", json!([])),
        ("test_timeout", json!(180)),
        ("benchmarks", json!([])),
        ("benchmark_timeout", json!(180)),
        ("ranked_timeout", json!(180)),
        ("seed", Value::Null),
        ("multi_gpu", json!(false)),
        ("validation", Value::Null),
    ] {
        task.insert(key.into(), raw.remove(key).unwrap_or(default));
    }
    task.insert("ranking_by".into(), Value::String(ranking_by));

    if truthy(&task["multi_gpu"]) {
        for key in ["tests", "benchmarks"] {
            for case in task[key].as_array().into_iter().flatten() {
                if case.get("world_size").is_none() {
                    return Err(invalid(format!(
                        "multi_gpu is set, but {} {case} does not specify world_size",
                        &key[..key.len() - 1]
                    )));
                }
            }
        }
    }
    Ok(task)
}

/// kernelbot's `PythonTaskData(main)` / `CudaTaskData(sources, include_dirs, defines,
/// compile_flags)`: required and allowed keys.
fn check_task_config(lang: &str, config: &Map<String, Value>) -> Result<(), String> {
    let (required, allowed): (&[&str], &[&str]) = if lang == "py" {
        (&["main"], &["main"])
    } else {
        (
            &["sources"],
            &["sources", "include_dirs", "defines", "compile_flags"],
        )
    };
    if let Some(k) = config.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(format!(
            "config.{k} is not a {lang} task setting; allowed: {}",
            allowed.join(", ")
        ));
    }
    if let Some(k) = required.iter().find(|k| !config.contains_key(**k)) {
        return Err(format!("config.{k} is required for a {lang} task"));
    }
    Ok(())
}

/// Python's truthiness of a JSON value.
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// A text file as Python's `Path.read_text()` gives it: UTF-8, universal newlines.
fn read_text(path: &Path) -> Result<String, TaskError> {
    let bytes = std::fs::read(path).map_err(|source| TaskError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let text = String::from_utf8(bytes).map_err(|e| TaskError::Read {
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
    })?;
    Ok(text.replace("\r\n", "\n").replace('\r', "\n"))
}

/// A submission file's content, as kernelbot's backend receives it (UTF-8, unchanged).
pub fn read_submission(path: &Path) -> Result<String, TaskError> {
    let bytes = std::fs::read(path).map_err(|source| TaskError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    String::from_utf8(bytes).map_err(|_| TaskError::NotText {
        path: path.to_path_buf(),
    })
}

/// The run config for `submission` in `mode`, key for key as kernelbot's `build_task_config`
/// builds it. `arch` is what kernelbot's `GPU_TO_SM` gives for the GPU (`"90a"` for H100),
/// `None` for `-arch=native`.
pub fn build_config(
    task: &TaskDefinition,
    submission: &str,
    arch: Option<&str>,
    mode: Mode,
) -> Value {
    let all_files: Map<String, Value> = task
        .files
        .iter()
        .map(|(name, content)| {
            let c = if content.as_str() == Some(SUBMISSION_PLACEHOLDER) {
                Value::String(submission.to_string())
            } else {
                content.clone()
            };
            (name.clone(), c)
        })
        .collect();
    let mut out = Map::new();
    if task.lang == "py" {
        out.insert(
            "main".into(),
            task.config.get("main").cloned().unwrap_or(Value::Null),
        );
        out.insert("sources".into(), Value::Object(all_files));
    } else {
        let listed: Vec<&str> = task
            .config
            .get("sources")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let (mut sources, mut headers) = (Map::new(), Map::new());
        for (name, content) in all_files {
            if listed.contains(&name.as_str()) {
                sources.insert(name, content);
            } else {
                headers.insert(name, content);
            }
        }
        out.insert("sources".into(), Value::Object(sources));
        out.insert("headers".into(), Value::Object(headers));
        for (key, default) in [
            ("defines", json!({})),
            ("compile_flags", json!([])),
            ("include_dirs", json!([])),
        ] {
            out.insert(key.into(), task.config.get(key).cloned().unwrap_or(default));
        }
    }
    out.insert("lang".into(), Value::String(task.lang.clone()));
    out.insert("arch".into(), arch.map_or(Value::Null, |a| json!(a)));
    out.insert("benchmarks".into(), task.task["benchmarks"].clone());
    out.insert("tests".into(), task.task["tests"].clone());
    out.insert("mode".into(), json!(mode.as_str()));
    for key in [
        "test_timeout",
        "benchmark_timeout",
        "ranked_timeout",
        "ranking_by",
        "seed",
        "multi_gpu",
    ] {
        out.insert(key.into(), task.task[key].clone());
    }
    Value::Object(out)
}

/// The canary's run config (`benchmark` mode): the task in `dir` with its own `submission.py`
/// (or `submission.cu` for a CUDA task), or, without a directory, the bundled `prefixsum_py`
/// example with its submission.
pub fn canary_config(dir: Option<&Path>) -> Result<Value, TaskError> {
    let Some(dir) = dir else {
        let example = bundled::PREFIXSUM_PY;
        let tmp = tempfile::tempdir().map_err(|source| TaskError::Read {
            path: std::env::temp_dir(),
            source,
        })?;
        example
            .write_to(tmp.path())
            .map_err(|source| TaskError::Read {
                path: tmp.path().to_path_buf(),
                source,
            })?;
        let task = load(tmp.path())?;
        let submission = example.file(example.submission).unwrap_or_default();
        return Ok(build_config(&task, submission, None, Mode::Benchmark));
    };
    let task = load(dir)?;
    let name = if task.lang == "py" {
        "submission.py"
    } else {
        "submission.cu"
    };
    let submission = read_submission(&dir.join(name))?;
    Ok(build_config(&task, &submission, None, Mode::Benchmark))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        for (name, text) in files {
            let p = d.path().join(name);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        d
    }

    const PY_TASK: &str = r#"
files:
  - {name: "submission.py", source: "@SUBMISSION@"}
  - {name: "eval.py", source: "../shared/eval.py"}
  - {name: "reference.py", source: "reference.py"}
lang: "py"
description: |
  A test task.
config:
  main: "eval.py"
templates:
  Python: "template.py"
tests:
  - {size: 127, seed: 4242}
  - {size: 128, seed: 5236}
benchmarks:
  - {size: 1024, seed: 54352}
ranking_by: "geom"
"#;

    #[test]
    fn a_python_task_builds_kernelbots_config_key_for_key() {
        let d = dir_with(&[
            ("t/task.yml", PY_TASK),
            ("shared/eval.py", "# eval\r\nprint(1)\r\n"),
            ("t/reference.py", "# ref\n"),
            ("t/template.py", "# template\n"),
        ]);
        let task = load(&d.path().join("t")).unwrap();
        assert_eq!(task.description, "A test task.\n");
        assert_eq!(task.templates["Python"], "# template\n");
        let cfg = build_config(&task, "def k(): pass\r\n", None, Mode::Benchmark);
        // kernelbot's key order: main, sources, then lang, arch, benchmarks, tests, mode,
        // the three timeouts, ranking_by, seed, multi_gpu.
        let keys: Vec<&String> = cfg.as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            [
                "main",
                "sources",
                "lang",
                "arch",
                "benchmarks",
                "tests",
                "mode",
                "test_timeout",
                "benchmark_timeout",
                "ranked_timeout",
                "ranking_by",
                "seed",
                "multi_gpu"
            ]
        );
        assert_eq!(
            cfg,
            json!({
                "main": "eval.py",
                "sources": {
                    // The submission as uploaded; task files with universal newlines.
                    "submission.py": "def k(): pass\r\n",
                    "eval.py": "# eval\nprint(1)\n",
                    "reference.py": "# ref\n"
                },
                "lang": "py", "arch": null,
                "benchmarks": [{"size": 1024, "seed": 54352}],
                "tests": [{"size": 127, "seed": 4242}, {"size": 128, "seed": 5236}],
                "mode": "benchmark",
                "test_timeout": 180, "benchmark_timeout": 180, "ranked_timeout": 180,
                "ranking_by": "geom", "seed": null, "multi_gpu": false
            })
        );
        kernelkite_kernelbot::config::RunConfig::from_json(cfg).unwrap();
    }

    #[test]
    fn a_cuda_task_splits_sources_from_headers() {
        let d = dir_with(&[
            (
                "task.yml",
                "files:\n  - {name: eval.cu, source: eval.cu}\n  - {name: task.h, source: task.h}\n  - {name: submission.cu, source: '@SUBMISSION@'}\nlang: cu\ndescription: d\nconfig: {sources: [eval.cu, submission.cu], include_dirs: []}\n",
            ),
            ("eval.cu", "int main(){}\n"),
            ("task.h", "#pragma once\n"),
        ]);
        let task = load(d.path()).unwrap();
        let cfg = build_config(&task, "// sub\n", Some("90a"), Mode::Leaderboard);
        let keys: Vec<&String> = cfg.as_object().unwrap().keys().collect();
        assert_eq!(
            keys[..6],
            [
                "sources",
                "headers",
                "defines",
                "compile_flags",
                "include_dirs",
                "lang"
            ]
        );
        assert_eq!(
            cfg["sources"],
            json!({"eval.cu": "int main(){}\n", "submission.cu": "// sub\n"})
        );
        assert_eq!(cfg["headers"], json!({"task.h": "#pragma once\n"}));
        assert_eq!(cfg["arch"], "90a");
        assert_eq!(cfg["ranking_by"], "last");
        assert_eq!(
            (cfg["defines"].clone(), cfg["compile_flags"].clone()),
            (json!({}), json!([]))
        );
    }

    #[test]
    fn what_kernelbot_refuses_is_refused_with_the_reason() {
        let base = "files:\n  - {name: s.py, source: '@SUBMISSION@'}\nlang: py\ndescription: d\nconfig: {main: s.py}\n";
        let cases = [
            (format!("{base}gpu: [H100]\n"), "unknown key \"gpu\""),
            (format!("{base}ranking_by: best\n"), "`ranking_by` must be"),
            (format!("{base}templates: {{}}\n"), "`templates` must map"),
            (
                format!("{base}templates: {{Rust: t.rs}}\n"),
                "template language \"Rust\"",
            ),
            (base.replace("lang: py", "lang: rs"), "`lang` must be"),
            (
                base.replace("description: d\n", ""),
                "`description` is required",
            ),
            (
                base.replace("{main: s.py}", "{main: s.py, sources: []}"),
                "config.sources is not a py task setting",
            ),
            (
                format!("{base}multi_gpu: true\ntests: [{{seed: 1}}]\n"),
                "does not specify world_size",
            ),
            (base.replace("'@SUBMISSION@'", "s.py"), "cannot read"),
        ];
        for (yml, want) in cases {
            let d = dir_with(&[("task.yml", &yml)]);
            let e = load(d.path()).unwrap_err();
            let text = format!(
                "{e}: {}",
                std::error::Error::source(&e)
                    .map(|s| s.to_string())
                    .unwrap_or_default()
            );
            assert!(text.contains(want), "{yml}\n→ {text}");
        }
        let d = dir_with(&[("task.yml", "files:\n  - {name: a.py, source: a.py}\nlang: py\ndescription: d\nconfig: {main: a.py}\n"), ("a.py", "")]);
        assert!(load(d.path())
            .unwrap_err()
            .to_string()
            .contains("nowhere to go"));
    }

    #[test]
    fn submissions_must_be_utf8() {
        let d = dir_with(&[("ok.py", "x = 'é'\n")]);
        assert_eq!(
            read_submission(&d.path().join("ok.py")).unwrap(),
            "x = 'é'\n"
        );
        std::fs::write(d.path().join("bad.py"), [0xff, 0xfe]).unwrap();
        assert!(matches!(
            read_submission(&d.path().join("bad.py")),
            Err(TaskError::NotText { .. })
        ));
    }
}
