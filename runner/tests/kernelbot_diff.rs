//! Differential tests against kernelbot's `run_eval.py`, with python3 as the oracle where
//! Python is the reference: the cases file each run gets (ranking modes, every value type,
//! profile lines, empty cases), Python's whitespace in the POPCORN reader, Python's `repr`
//! of strings, `./` file names. The oracle scripts here restate kernelbot's documented rules
//! in Python (`json.loads`, `str()`, `splitlines`, `partition`/`strip`, `pathlib`), so what
//! the runner does is compared with what Python itself does on the same input.

mod common;

use base64::Engine as _;
use common::*;
use kernelkite_kernelbot::{config, pyrepr};
use kernelkite_runner::eval;
use serde_json::{json, Value};

/// kernelbot's cases files for a payload: `json.loads` of the decoded payload, each case
/// written as `"; ".join(f"{k}: {v}")` plus a line break, and per run the text
/// `run_single_evaluation` writes: `test` all tests; `benchmark`, `leaderboard` and `profile`
/// all benchmarks, or with `ranking_by == "last"` `splitlines(keepends=True)[-1]` (null
/// where that raises); `profile` runs one `splitlines()` line each. Prints
/// `{run name: base64 of the text, or null}` in run order.
const ORACLE_CASES: &str = r#"
import base64, json, sys, zlib
cfg = json.loads(zlib.decompress(base64.b64decode(sys.stdin.read())))

def cases_text(cases):
    out = ""
    for case in cases:
        out += "; ".join(f"{k}: {v}" for k, v in case.items()) + "\n"
    return out

tests = cases_text(cfg.get("tests", []))
benchmarks = cases_text(cfg.get("benchmarks", []))
ranking = cfg.get("ranking_by", "last")

def cases_for(mode, benchmarks):
    if mode == "test":
        return tests
    if ranking == "last":
        lines = benchmarks.splitlines(keepends=True)
        return lines[-1] if lines else None
    return benchmarks

mode = cfg["mode"]
runs = {}
if mode == "profile":
    for i, line in enumerate(benchmarks.splitlines()):
        runs[f"profile.{i}"] = cases_for("profile", line)
elif mode in ("test", "benchmark"):
    runs[mode] = cases_for(mode, benchmarks)
else:
    for m in ("test", "benchmark", "leaderboard"):
        runs[m] = cases_for(m, benchmarks)
enc = lambda t: None if t is None else base64.b64encode(t.encode()).decode()
print(json.dumps({k: enc(v) for k, v in runs.items()}))
"#;

/// kernelbot's reading of the POPCORN pipe, on the bytes given (base64 on stdin): text mode
/// (UTF-8, universal newlines) as `os.fdopen(fd, "r").read()`, then per `splitlines()` line
/// `partition(":")`, skip when both sides are empty, `strip()` both. Prints the items.
const ORACLE_POPCORN: &str = r#"
import base64, io, json, sys
raw = base64.b64decode(sys.stdin.read())
text = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8").read()
result = {}
for line in text.splitlines():
    key, _, value = line.partition(":")
    if key != "" or value != "":
        result[key.strip()] = value.strip()
print(json.dumps(list(result.items())))
"#;

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn unb64(text: &str) -> String {
    String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(text)
            .unwrap(),
    )
    .unwrap()
}

/// The oracle's run name → expected cases text (None where kernelbot raises), in order.
fn expected_cases(py: &str, payload: &str) -> Vec<(String, Option<String>)> {
    let out = python_output(py, ORACLE_CASES, payload.as_bytes());
    let v: Value = serde_json::from_str(&out).unwrap();
    v.as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().map(unb64)))
        .collect()
}

/// The cases file the harness of run `name` received, byte for byte.
fn received_cases(r: &Run, name: &str) -> String {
    let b = r.run(name)["result"]["cases-b64"]
        .as_str()
        .unwrap_or_else(|| panic!("{name}: no cases-b64 in {}", r.result));
    unb64(b)
}

fn run_names(r: &Run) -> Vec<String> {
    r.result["runs"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect()
}

/// Runs the payload and checks every run's cases file against the oracle; returns the run.
fn run_against_oracle(py: &str, cfg: &Value, env: &[(&str, &str)]) -> Run {
    let payload = kernelkite_kernelbot::payload::encode(cfg).unwrap();
    let want = expected_cases(py, &payload);
    let r = run_payload_text(&payload, &[], env);
    assert_eq!(r.code, 0, "{}", r.log());
    let names: Vec<&String> = want.iter().map(|(k, _)| k).collect();
    assert_eq!(run_names(&r).iter().collect::<Vec<_>>(), names, "runs");
    for (name, text) in &want {
        let text = text
            .as_ref()
            .expect("the oracle raised where the runner ran");
        assert_eq!(&received_cases(&r, name), text, "cases file of run {name}");
    }
    r
}

fn three_benchmarks(mode: &str, ranking: &str) -> Value {
    let mut cfg = harness_config(mode, "pass", json!({ "ranking_by": ranking }));
    cfg["benchmarks"] = json!([
        {"behave": "pass", "n": 10},
        {"behave": "pass", "n": 11},
        {"behave": "pass", "n": 12}
    ]);
    cfg
}

#[test]
fn ranking_modes_pick_the_benchmark_lines_kernelbot_picks() {
    let Some(py) = need_python() else { return };
    for mode in ["benchmark", "leaderboard", "private"] {
        for ranking in ["last", "mean", "geom"] {
            let r = run_against_oracle(py, &three_benchmarks(mode, ranking), &[]);
            // Stated plainly: `last` gives benchmark and leaderboard runs the last line only,
            // `mean` and `geom` all lines; tests always get all tests.
            let want = if ranking == "last" { "1" } else { "3" };
            for run in ["benchmark", "leaderboard"] {
                if mode == "benchmark" && run == "leaderboard" {
                    continue;
                }
                let res = &r.run(run)["result"];
                assert_eq!(res["cases"], want, "{mode}/{ranking}/{run}");
                assert_eq!(res["last-case"], "12", "{mode}/{ranking}/{run}");
            }
            if mode != "benchmark" {
                assert_eq!(r.run("test")["result"]["cases"], "2", "{mode}/{ranking}");
            }
        }
    }
}

#[test]
fn profile_runs_get_one_line_without_a_line_break() {
    let Some(py) = need_python() else { return };
    let tools = tempfile::tempdir().unwrap();
    fake_ncu(tools.path());
    let path = path_with(Some(tools.path()));
    let env = [("PATH", path.as_str())];
    for ranking in ["last", "mean", "geom"] {
        let r = run_against_oracle(py, &three_benchmarks("profile", ranking), &env);
        assert_eq!(received_cases(&r, "profile.2"), "behave: pass; n: 12");
    }

    // A case without keys is an empty line: `mean` hands it over as an empty file, `last`
    // fails on it as kernelbot does (the last line of an empty string), keeping the runs
    // made before it.
    let mut cfg = three_benchmarks("profile", "mean");
    cfg["benchmarks"][1] = json!({});
    let r = run_against_oracle(py, &cfg, &env);
    assert_eq!(received_cases(&r, "profile.1"), "");
    cfg["ranking_by"] = json!("last");
    let payload = kernelkite_kernelbot::payload::encode(&cfg).unwrap();
    let want = expected_cases(py, &payload);
    assert_eq!(want[1], ("profile.1".to_string(), None));
    let r = run_payload_text(&payload, &[], &env);
    assert_eq!(r.code, 2, "{}", r.log());
    assert_eq!(run_names(&r), ["profile.0"]);
    let err = r.result["error"].as_str().unwrap();
    assert!(
        err.contains("profile run 1") && err.contains("empty"),
        "{err}"
    );
}

/// One case of every type `json.loads` can give, with the strings Python's `repr` quotes
/// and escapes in each way; numbers as literals (big, negative zero, exponents).
const VALUE_CASES: &str = r#"[
  {"behave": "pass", "s": "plain 'single' \"double\" é 😀 \\ back", "list": ["a", "b"],
   "mixed": [true, null, false, 1, -2, 2.0, 1e-07, 1e16, 1E5, -0, -0.0, 0.1, 0.30000000000000004,
             123456789012345678.0, 5e-324, 1.7976931348623157e308],
   "dict": {"k": "v", "n": 1, "nested": {"l": [[], {}], "t": [true]}},
   "big": 1180591620717411303424, "negbig": -98765432109876543210987654321, "zero": -0,
   "quotes": ["it's", "say \"hi\"", "both ' \"", "back\\slash", "tab\tnl\ncr\r"],
   "controls": ["\u0000\u0007\u001b\u001f\u007f", "\u0080\u0085\u009f\u00a0\u00ad\u00e9\u00ff"],
   "unicode": ["\u0378\u200b\u2028\u2029\u3000\ue000\ufeff\uffff", "\ud83d\ude00\udb40\udc01\udbff\udfff\ud800\udc00"],
   "bool": true, "none": null, "int": 42, "float": 3.14, "exp": 1e-05, "empty": ""},
  {"behave": "pass", "empty_list": [], "empty_dict": {}, "k with spaces": "v; with: separators"},
  {}
]"#;

#[test]
fn cases_file_values_are_written_as_pythons_str() {
    let Some(py) = need_python() else { return };
    let cases: Value = serde_json::from_str(VALUE_CASES).unwrap();
    for mode in ["test", "benchmark"] {
        let mut cfg = harness_config(mode, "pass", json!({"ranking_by": "mean"}));
        cfg["tests"] = cases.clone();
        cfg["benchmarks"] = cases.clone();
        let r = run_against_oracle(py, &cfg, &[]);
        let got = received_cases(&r, mode);
        // A few of the oracle's answers spelled out, so a reader sees what is compared.
        for want in [
            "list: ['a', 'b']",
            "big: 1180591620717411303424",
            "negbig: -98765432109876543210987654321; zero: 0",
            "[True, None, False, 1, -2, 2.0, 1e-07, 1e+16, 100000.0, 0, -0.0, 0.1,",
            "dict: {'k': 'v', 'n': 1, 'nested': {'l': [[], {}], 't': [True]}}",
            r#"quotes: ["it's", 'say "hi"', 'both \' "', 'back\\slash', 'tab\tnl\ncr\r']"#,
            r"'\x00\x07\x1b\x1f\x7f', '\x80\x85\x9f\xa0\xadéÿ'",
            r"'\u0378\u200b\u2028\u2029\u3000\ue000\ufeff\uffff', '😀\U000e0001\U0010ffff𐀀'",
            "bool: True; none: None; int: 42; float: 3.14; exp: 1e-05; empty: \n",
            "empty_list: []; empty_dict: {}; k with spaces: v; with: separators\n\n",
        ] {
            assert!(got.contains(want), "{want:?} not in\n{got}");
        }
    }
}

#[test]
fn empty_tests_run_the_harness_on_an_empty_cases_file() {
    let Some(py) = need_python() else { return };
    let mut cfg = harness_config("test", "pass", json!({}));
    cfg["tests"] = json!([]);
    let r = run_against_oracle(py, &cfg, &[]);
    assert_eq!(received_cases(&r, "test"), "");
    assert_eq!(r.run("test")["passed"], true);
    // In the leaderboard chain too: the harness decides, here it passes and the chain goes on.
    cfg["mode"] = json!("leaderboard");
    let r = run_against_oracle(py, &cfg, &[]);
    assert_eq!(run_names(&r), ["test", "benchmark", "leaderboard"]);
    assert_rebuilds(&[r.result_path()]);
}

#[test]
fn empty_benchmarks_are_handled_as_kernelbot_does() {
    let Some(py) = need_python() else { return };
    // `mean`/`geom`: an empty cases file, the harness decides.
    for ranking in ["mean", "geom"] {
        let mut cfg = harness_config("benchmark", "pass", json!({ "ranking_by": ranking }));
        cfg["benchmarks"] = json!([]);
        let r = run_against_oracle(py, &cfg, &[]);
        assert_eq!(received_cases(&r, "benchmark"), "");
    }

    // `last`: kernelbot takes the last of no lines and fails; so does the runner, as a bad
    // config, where kernelbot would (the oracle says which run).
    let mut cfg = harness_config("benchmark", "pass", json!({"ranking_by": "last"}));
    cfg["benchmarks"] = json!([]);
    let payload = kernelkite_kernelbot::payload::encode(&cfg).unwrap();
    assert_eq!(
        expected_cases(py, &payload),
        [("benchmark".to_string(), None)]
    );
    let r = run_payload_text(&payload, &[], &[]);
    assert_eq!(r.code, 2, "{}", r.log());
    assert!(r.result["error"]
        .as_str()
        .unwrap()
        .contains("`benchmarks` is empty"));
    assert_eq!(r.result["runs"], json!({}));
    assert_rebuilds(&[r.result_path()]);

    // In the leaderboard chain kernelbot only gets there when the tests pass.
    cfg["mode"] = json!("leaderboard");
    let r = run_config(&cfg, &[], &[]);
    assert_eq!(r.code, 2, "{}", r.log());
    assert_eq!(run_names(&r), ["test"]);
    let mut failing = harness_config("leaderboard", "fail", json!({"ranking_by": "last"}));
    failing["benchmarks"] = json!([]);
    let r = run_config(&failing, &[], &[]);
    assert_eq!(r.code, 0, "{}", r.log());
    assert_eq!(r.result["success"], true);
    assert_eq!(run_names(&r), ["test"]);

    // Profile with no benchmarks profiles nothing, and so needs no profiler: success, no runs.
    let mut cfg = harness_config("profile", "pass", json!({}));
    cfg["benchmarks"] = json!([]);
    let r = run_config(&cfg, &[], &[]);
    assert_eq!(r.code, 0, "{}", r.log());
    assert_eq!(r.result["success"], true);
    assert_eq!(r.result["runs"], json!({}));
    assert_rebuilds(&[r.result_path()]);
}

#[test]
fn ranking_values_kernelbot_rejects_are_refused() {
    // kernelbot's task loader builds RankCriterion(value), an Enum of "last", "mean" and
    // "geom" (a ValueError for anything else), and its scoring raises "Invalid ranking
    // criterion" for other values (tests/test_submission.py, test_compute_score).
    for bad in [
        json!("WRONG"),
        json!("LAST"),
        json!("Geom"),
        json!(""),
        json!(null),
        json!(1),
    ] {
        let cfg = harness_config("benchmark", "pass", json!({ "ranking_by": bad.clone() }));
        let r = run_config(&cfg, &[], &[]);
        assert_eq!(r.code, 2, "{bad}: {}", r.log());
        let err = r.result["error"].as_str().unwrap();
        assert!(
            err.contains(&format!("`ranking_by` is {bad}"))
                && err.contains("\"last\", \"mean\" or \"geom\""),
            "{bad}: {err}"
        );
        assert_eq!(r.result["runs"], json!({}));
    }
}

/// Lines padded with each code point on both sides of the key and the value.
fn padded_lines(code_points: impl Iterator<Item = u32>) -> String {
    let mut text = String::new();
    for cp in code_points {
        let Some(c) = char::from_u32(cp) else {
            continue;
        };
        text.push_str(&format!("{c}{c}k{cp:x}{c}:{c}v {cp:x}{c}{c}\n"));
    }
    // Line ends, empty sides and repeated keys, as a harness may write them.
    text.push_str("no colon\r\n: \r\n\x1f:\x1f\rk0: first\nk0: last\n \u{3000}pad\u{200b}ded\x1f\t:\u{a0}x\u{2003}\x1f\n");
    text
}

fn python_popcorn(py: &str, raw: &[u8]) -> Vec<(String, String)> {
    let out = python_output(py, ORACLE_POPCORN, b64(raw).as_bytes());
    serde_json::from_str(&out).unwrap()
}

#[test]
fn python_whitespace_is_str_isspace() {
    let Some(py) = need_python() else { return };
    let out = python_output(
        py,
        "print([c for c in range(0x110000) if chr(c).isspace()])",
        b"",
    );
    let want: Vec<u32> = serde_json::from_str(&out).unwrap();
    let ours: Vec<u32> = (0..=0x10FFFFu32)
        .filter(|&c| char::from_u32(c).is_some_and(pyrepr::is_space))
        .collect();
    assert_eq!(ours, want);
}

#[test]
fn popcorn_lines_are_read_as_kernelbot_reads_them() {
    let Some(py) = need_python() else { return };
    // Every code point below U+3100 (all of ASCII, the C1 controls, Latin-1, the Unicode
    // spaces up to U+3000) and a stride through the rest of the planes.
    let points = (0..0x3100u32).chain((0x3100..=0x10FFFF).step_by(251));
    let raw = padded_lines(points);
    let want = python_popcorn(py, raw.as_bytes());
    let got: Vec<(String, String)> = eval::parse_popcorn(raw.as_bytes()).into_iter().collect();
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g, w);
    }
}

#[test]
fn popcorn_lines_from_a_harness_are_stripped_like_kernelbot() {
    let Some(py) = need_python() else { return };
    let spaces: Vec<u32> = (0..=0x10FFFFu32)
        .filter(|&c| char::from_u32(c).is_some_and(pyrepr::is_space))
        .collect();
    let points = (0..0x100u32)
        .chain(spaces)
        .chain([0x180e, 0x200b, 0x2060, 0xfeff, 0x10FFFF]);
    let raw = padded_lines(points);
    let want = python_popcorn(py, raw.as_bytes());
    let mut cfg = harness_config("test", "raw", json!({}));
    cfg["tests"] = json!([{"behave": "raw", "raw": b64(raw.as_bytes())}]);
    let r = run_config(&cfg, &[], &[]);
    assert_eq!(r.code, 0, "{}", r.log());
    let got: Vec<(String, String)> = r.run("test")["result"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
        .collect();
    assert_eq!(got, want);
    // Spelled out: U+001F and U+3000 are stripped, the zero-width space is no whitespace.
    assert!(got.contains(&("pad\u{200b}ded".to_string(), "x".to_string())));
    assert!(got.contains(&("k0".to_string(), "last".to_string())));
}

#[test]
fn string_repr_is_pythons_for_every_code_point() {
    let Some(py) = need_python() else { return };
    let version = python_output(
        py,
        "import unicodedata; print(unicodedata.unidata_version)",
        b"",
    );
    let same_unicode = version.trim() == pyrepr::UNICODE_VERSION;
    let end = if same_unicode {
        0x110000u32
    } else {
        eprintln!(
            "note: python3 has Unicode {} and the printable table Unicode {}; only U+0000..U+00FF are compared",
            version.trim(),
            pyrepr::UNICODE_VERSION
        );
        0x100
    };
    // Strings of 128 consecutive code points (no surrogates, which a Rust string cannot
    // hold), each with both kinds of quote in some of them.
    let strings: Vec<String> = (0..end)
        .step_by(128)
        .map(|start| {
            (start..(start + 128).min(end))
                .filter_map(char::from_u32)
                .collect::<String>()
        })
        .filter(|s| !s.is_empty())
        .chain(["it's".into(), "\"".into(), "'\"".into(), String::new()])
        .collect();
    let input = serde_json::to_string(&strings).unwrap();
    let out = python_output(
        py,
        "import json, sys\nfor s in json.loads(sys.stdin.read()):\n    print(repr(s))",
        input.as_bytes(),
    );
    let want: Vec<&str> = out.split('\n').collect();
    assert_eq!(want.len(), strings.len() + 1);
    for (s, w) in strings.iter().zip(&want) {
        assert_eq!(&pyrepr::str_repr(s), w);
    }
}

#[test]
fn file_names_resolve_like_pathlib() {
    let Some(py) = need_python() else { return };
    let names = [
        "a.py",
        "./a.py",
        "././a.py",
        ".//a.py",
        "pkg/./b.py",
        "pkg//b.py",
        "./pkg/b.py",
        "pkg/b.py/",
        "pkg/b.py/.",
        "../a.py",
        "./../a.py",
        "pkg/../../a.py",
        "pkg/../a.py",
        "/etc/passwd",
        ".",
        "./",
        "..",
    ];
    // What kernelbot's `_create_files` makes of each: inside the working directory or not
    // (its assertion), and which file `Path(name)` is there.
    let script = r#"
import json, os, sys, tempfile
from pathlib import Path
os.chdir(tempfile.mkdtemp())
out = []
for name in json.loads(sys.stdin.read()):
    p = Path(name).resolve()
    inside = p.is_relative_to(Path.cwd())
    out.append([inside, p.relative_to(Path.cwd()).as_posix() if inside else None])
print(json.dumps(out))
"#;
    let out = python_output(
        py,
        script,
        serde_json::to_string(&names).unwrap().as_bytes(),
    );
    let python: Vec<(bool, Option<String>)> = serde_json::from_str(&out).unwrap();
    for (name, (inside, rel)) in names.iter().zip(python) {
        let ours = config::work_path("sources", name);
        let has_dotdot = name.split('/').any(|p| p == "..");
        match rel {
            // Anything that escapes is refused, as kernelbot's assertion refuses it.
            _ if !inside => assert!(ours.is_err(), "{name}: escapes, but {ours:?}"),
            // The work directory itself is no file.
            Some(rel) if rel == "." => assert!(ours.is_err(), "{name}: {ours:?}"),
            // `..` that stays inside is refused (a documented difference).
            _ if has_dotdot => assert!(ours.is_err(), "{name}: {ours:?}"),
            Some(rel) => assert_eq!(ours.as_deref(), Ok(rel.as_str()), "{name}"),
            None => unreachable!(),
        }
    }
}

#[test]
fn dot_slash_names_are_the_files_kernelbot_writes() {
    let Some(_) = need_python() else { return };
    let mut cfg = harness_config("test", "pass", json!({"main": "./harness.py"}));
    cfg["sources"] = json!({
        "./harness.py": harness_source(),
        "./pkg/./helper.py": "X = 1\n",
        "./submission.py": "print('-DTORCH_EXTENSION_NAME')\n",
    });
    let r = run_config(&cfg, &[], &[]);
    assert_eq!(r.code, 0, "{}", r.log());
    let run = r.run("test");
    assert_eq!(run["passed"], true);
    assert!(
        run["command"]
            .as_str()
            .unwrap()
            .contains(" ./harness.py test /"),
        "{}",
        run["command"]
    );
    assert_eq!(run["result"]["cwd-files"], "harness.py,pkg,submission.py");
    // `./submission.py` is kernelbot's `submission.py`: the pre-run happens.
    assert_eq!(
        r.result["runs"]["test"]["compilation"]["stdout"],
        "-DTORCH_EXTENSION_NAME\n"
    );

    // kernelbot asserts `main in sources.keys()`: the spelling must match.
    let mut cfg = harness_config("test", "pass", json!({"main": "./harness.py"}));
    let r = run_config(&cfg, &[], &[]);
    assert_eq!(r.code, 2, "{}", r.log());
    assert!(r.result["error"]
        .as_str()
        .unwrap()
        .contains("spelled the same"));

    // One file given twice is refused rather than one content dropped.
    cfg["main"] = json!("harness.py");
    cfg["sources"]["./harness.py"] = json!("print('other')\n");
    let r = run_config(&cfg, &[], &[]);
    assert_eq!(r.code, 2, "{}", r.log());
    let err = r.result["error"].as_str().unwrap();
    assert!(err.contains("name the same file \"harness.py\""), "{err}");

    // And `./` does not open a way out.
    let mut cfg = harness_config("test", "pass", json!({}));
    cfg["sources"]["./../escape.py"] = json!("x");
    let r = run_config(&cfg, &[], &[]);
    assert_eq!(r.code, 2, "{}", r.log());
    assert!(r.result["error"].as_str().unwrap().contains("'..'"));
}

#[test]
fn json_only_python_reads_is_refused_with_a_clear_error() {
    // Python's json.dumps writes `Infinity` for float("inf") and json.loads reads it back;
    // serde_json does not (a documented difference): a bad payload, not a crash.
    use std::io::Write as _;
    let text = br#"{"lang": "py", "mode": "test", "sources": {"a.py": ""}, "main": "a.py", "tests": [{"x": Infinity}]}"#;
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    z.write_all(text).unwrap();
    let r = run_payload_text(&b64(&z.finish().unwrap()), &[], &[]);
    assert_eq!(r.code, 2, "{}", r.log());
    assert!(r.result["error"]
        .as_str()
        .unwrap()
        .contains("not valid JSON"));
    assert_rebuilds(&[r.result_path()]);
}
