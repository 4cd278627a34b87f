//! `task.yml` is read as kernelbot reads it: checked against PyYAML itself. Each document goes
//! through `yaml.safe_load` and `json.dumps` in python3 and through the service's loader and
//! kernelbot's JSON encoder (`payload::python_json`); the bytes must be the same, and what
//! Python cannot turn into JSON (dates, infinities) must be refused here too. Skipped (counted
//! as skipped) without python3 and PyYAML.

use kernelkite_service::task::pyyaml;
use kernelkite_testkit::{python, skip};

const DOCS: &[&str] = &[
    // YAML 1.1 plain scalars, where 1.2 loaders answer otherwise.
    "[yes, No, ON, off, y, n, true, True, TRUE, false, ~, null, Null, '', \"\"]",
    "[017, 0o17, 0x1F, -0x10, 0b101, 1_000, 1:30, -1:30, 190:20:30, 08, 09, 0, -0, +0, +7]",
    "[1e3, 1.0e+3, 1.e+3, 1.5, .5, -2., 1_2.3_4e+5, 190:20:30.15, 6.8523015e+5, 1.0e-7, 3.]",
    "[-.NaN, .Inf5, '.inf', 12:60, 1:2:3:4, 0x, 0b, 1__0, _1, 1_]",
    "big: 123456789012345678901234567890\nneg: -98765432109876543210\n",
    // Strings, styles, escapes, unicode.
    "a: 'it''s'\nb: \"tab\\there\\u00e9\"\nc: |\n  line1\n  line2\nd: >\n  folded\n  text\ne: plain text here\nf: é ü 中\n",
    // Mappings: order, repeated keys, keys Python compares equal, merge keys, anchors.
    "b: 1\na: 2\nb: 3\n",
    "1: x\ntrue: y\n~: z\n1.5: w\n2.0: v\n2: u\nfalse: a\n0: b\n",
    "base: &b {size: 1, seed: 2}\nt: {<<: *b, seed: 3, n: 4}\nl: [*b, *b]\n",
    "x: {<<: [{a: 1}, {a: 2, b: 2}], c: 3}\n",
    "- &anchor {k: v}\n- *anchor\n- !!str 12\n- !!int '7'\n- !!float '1'\n",
    // A whole task in kernelbot's format.
    "files:\n  - {\"name\": \"submission.py\", \"source\": \"@SUBMISSION@\"}\n  - {\"name\": \"eval.py\", \"source\": \"../eval.py\"}\nlang: \"py\"\ndescription: |\n  A task.\nconfig:\n  main: \"eval.py\"\ntemplates:\n  Python: \"../template.py\"\ntests:\n  - {\"size\": 127, \"seed\": 4242}\n  - {\"size\": 128, \"seed\": 5236, \"dtype\": float16}\nbenchmarks:\n  - {\"size\": 1024, \"seed\": 54352}\nranking_by: \"geom\"\n",
    // What JSON cannot carry.
    "d: 2024-01-02",
    "t: 2001-12-14t21:59:43.10-05:00",
    "x: .inf",
    "y: -.Inf",
    "z: .nan",
];

const ORACLE: &str = r#"
import json, sys, yaml
out = []
for doc in json.load(sys.stdin):
    try:
        out.append(["ok", json.dumps(yaml.safe_load(doc), allow_nan=False)])
    except Exception as e:
        out.append(["err", type(e).__name__])
print(json.dumps(out))
"#;

#[test]
fn task_yml_reads_as_pyyaml_reads_it() {
    let Some(py) = python() else {
        skip("python3 is not available");
        return;
    };
    let has_yaml = std::process::Command::new(py)
        .args(["-c", "import yaml"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_yaml {
        skip("PyYAML is not installed (pip install pyyaml)");
        return;
    }
    let mut child = std::process::Command::new(py)
        .args(["-c", ORACLE])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(
        child.stdin.as_mut().unwrap(),
        serde_json::to_string(DOCS).unwrap().as_bytes(),
    )
    .unwrap();
    drop(child.stdin.take());
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let answers: Vec<(String, String)> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answers.len(), DOCS.len());
    // The last five documents are the ones Python cannot turn into JSON.
    let refused = answers.iter().filter(|(k, _)| k != "ok").count();
    assert_eq!(refused, 5, "{answers:?}");
    for (doc, (kind, python_json)) in DOCS.iter().zip(answers) {
        let ours = pyyaml::load(doc);
        match kind.as_str() {
            "ok" => {
                let v = ours.unwrap_or_else(|e| panic!("{doc:?}: PyYAML reads it, we refuse: {e}"));
                let mine =
                    String::from_utf8(kernelkite_kernelbot::payload::python_json(&v).unwrap())
                        .unwrap();
                assert_eq!(mine, python_json, "{doc:?}");
            }
            _ => assert!(
                ours.is_err(),
                "{doc:?}: Python cannot make JSON of it ({python_json}), we gave {:?}",
                ours.ok()
            ),
        }
    }
}
