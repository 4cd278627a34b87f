//! Byte identity with kernelbot's Python codec, both directions:
//! `base64.b64encode(zlib.compress(json.dumps(cfg).encode()))`.

use std::io::Write as _;
use std::process::{Command, Stdio};

use kernelkite_kernelbot::config::RunConfig;
use kernelkite_kernelbot::payload;
use kernelkite_testkit_leaf::need_python;
use serde_json::Value;

/// Configs built in Python (so key order and float spelling are Python's own), printed as
/// `json.dumps(cfg)` and as the payload, one pair per line.
const PY_ENCODE: &str = r##"
import base64, json, zlib
cfgs = [
    {"lang": "py", "mode": "test", "main": "eval.py",
     "sources": {"eval.py": "print('h\u00e9llo \u2603 \U0001F600')\n", "submission.py": "x = 1e-05\n"},
     "tests": [{"size": 128, "seed": 5, "eps": 1e-05, "big": 1e16, "ratio": 0.1, "neg": -2.5e-07,
                "flag": True, "none": None, "name": "a \"quoted\" \\ name\t\u0001",
                "huge": 2**70, "neghuge": -10**30}],
     "benchmarks": [{"size": 1024, "nested": {"list": [1, 2.5, None, [], {}], "deep": {"x": [1e300, 123456789.0]}}}],
     "seed": None, "ranking_by": "last", "test_timeout": 180, "multi_gpu": False},
    {"lang": "cu", "mode": "leaderboard", "sources": {"eval.cu": "// \u4e2d\u6587\n" * 50},
     "headers": {"task.h": "#pragma once"}, "arch": "90a", "defines": {"N": 4096, "X": None},
     "include_dirs": [], "libraries": ["cublas"], "tests": [], "benchmarks": [{"k": 1.5e16}], "seed": 918273645},
]
for cfg in cfgs:
    text = json.dumps(cfg)
    print(text)
    print(base64.b64encode(zlib.compress(text.encode())).decode())
"##;

/// Reads payloads on stdin, one per line, and prints `json.dumps` of each decoded config.
const PY_DECODE: &str = r#"
import base64, json, sys, zlib
for line in sys.stdin:
    print(json.dumps(json.loads(zlib.decompress(base64.b64decode(line.strip())))))
"#;

#[test]
fn python_payloads_decode_here_and_encode_back_identically() {
    let Some(py) = need_python() else { return };
    let out = Command::new(py).arg("-c").arg(PY_ENCODE).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4);
    for pair in lines.chunks(2) {
        let (json_text, py_payload) = (pair[0], pair[1]);
        // Python → here: the payload decodes to the very config Python serialized.
        let decoded = payload::decode(py_payload).unwrap();
        let expected: Value = serde_json::from_str(json_text).unwrap();
        assert_eq!(decoded, expected);
        // Here → Python, byte for byte: same JSON text, same zlib stream, same base64.
        assert_eq!(
            String::from_utf8(payload::python_json(&decoded).unwrap()).unwrap(),
            json_text
        );
        assert_eq!(payload::encode(&decoded).unwrap(), py_payload);
    }
    // And the configs are valid kernelbot run configs once decoded.
    let cfg = RunConfig::from_json(payload::decode(lines[1]).unwrap()).unwrap();
    assert_eq!(cfg.main.as_deref(), Some("eval.py"));
}

#[test]
fn payloads_encoded_here_decode_in_python_to_the_same_config() {
    let Some(py) = need_python() else { return };
    let configs = [
        serde_json::json!({"lang": "py", "mode": "test", "sources": {"é.py": "s = '😀'\n"}, "main": "é.py",
            "tests": [{"eps": 1e-05, "big": 1e16, "n": null, "t": true, "f": 0.30000000000000004}], "seed": -7}),
        // A task-sized config: several sources with newlines, quotes and tabs, nested cases.
        serde_json::json!({"lang": "py", "mode": "leaderboard", "main": "eval.py",
            "sources": {"eval.py": "import sys\n\tprint(\"it's\", sys.argv)\n", "submission.py": "def f(x):\n    return x\n",
                        "reference.py": "X = [1, 2.5, 'a']\n"},
            "tests": [{"size": 128, "seed": 5}, {"size": 4096, "seed": 6}],
            "benchmarks": [{"size": 1048576, "seed": 7}], "ranking_by": "geom",
            "test_timeout": 60, "benchmark_timeout": 120, "ranked_timeout": 180, "seed": 42}),
        // Literals as a backend may send them: Python reads 1E5 as a float and the big
        // integers exactly, and writes them back as `100000.0` and the same digits.
        serde_json::from_str(
            r#"{"lang": "py", "mode": "test", "sources": {"a.py": ""}, "main": "a.py",
                "tests": [{"huge": 1180591620717411303424, "neg": -98765432109876543210987654321,
                           "e": 1E5, "z": -0, "f": 1.50}]}"#,
        )
        .unwrap(),
    ];
    let payloads: Vec<String> = configs
        .iter()
        .map(|c| payload::encode(c).unwrap())
        .collect();
    let mut child = Command::new(py)
        .arg("-c")
        .arg(PY_DECODE)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    {
        let mut stdin = child.stdin.take().unwrap();
        for p in &payloads {
            writeln!(stdin, "{p}").unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for (line, cfg) in text.lines().zip(&configs) {
        // Python re-serializes what it decoded; that is exactly our Python-layout JSON.
        assert_eq!(
            line,
            String::from_utf8(payload::python_json(cfg).unwrap()).unwrap()
        );
    }
    assert_eq!(text.lines().count(), configs.len());
}
