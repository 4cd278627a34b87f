//! Helpers shared by the runner's integration tests: the built binary, a real Python, the
//! test harness, fake tools on PATH.
#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

pub const BIN: &str = env!("CARGO_BIN_EXE_kernelkite-runner");

pub fn harness_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/harness")
}

pub fn harness_source() -> String {
    std::fs::read_to_string(harness_dir().join("popcorn_harness.py")).unwrap()
}

pub use kernelkite_testkit_leaf::{need_python, python};

/// A py config running the test harness; `patch` overrides top-level keys.
pub fn harness_config(mode: &str, behave: &str, patch: Value) -> Value {
    let mut cfg = json!({
        "lang": "py",
        "mode": mode,
        "sources": {"harness.py": harness_source()},
        "main": "harness.py",
        "tests": [{"behave": behave, "n": 1}, {"behave": behave, "n": 2}],
        "benchmarks": [{"behave": behave, "n": 10}, {"behave": behave, "n": 11}],
        "test_timeout": 20, "benchmark_timeout": 20, "ranked_timeout": 20,
    });
    for (k, v) in patch.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    cfg
}

pub struct Run {
    pub code: i32,
    pub result: Value,
    pub stdout: String,
    pub stderr: String,
    pub dir: tempfile::TempDir,
}

impl Run {
    pub fn result_path(&self) -> PathBuf {
        self.dir.path().join("result.json")
    }
    pub fn run(&self, name: &str) -> &Value {
        &self.result["runs"][name]["run"]
    }
    pub fn log(&self) -> String {
        format!("{}\n{}", self.stdout, self.stderr)
    }
}

/// A minimal PATH: the fake-tool directory (if any), then the system's.
pub fn path_with(fake: Option<&Path>) -> String {
    match fake {
        Some(d) => format!("{}:/usr/bin:/bin", d.display()),
        None => "/usr/bin:/bin".into(),
    }
}

/// Runs the CLI with `payload` (base64 text) in a payload file; `extra` args and `env` added.
pub fn run_payload_text(payload: &str, extra: &[&str], env: &[(&str, &str)]) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let pfile = dir.path().join("payload.txt");
    std::fs::write(&pfile, payload).unwrap();
    let mut cmd = Command::new(BIN);
    cmd.arg("--payload-file")
        .arg(&pfile)
        .arg("--output")
        .arg(dir.path().join("result.json"));
    cmd.env_clear()
        .env("PATH", path_with(None))
        .env("RUST_LOG", "info");
    if let (Some(py), false) = (python(), extra.contains(&"--python")) {
        cmd.arg("--python").arg(py);
    }
    cmd.args(extra);
    for (k, v) in env {
        cmd.env(k, v);
    }
    finish(cmd, dir)
}

pub fn finish(mut cmd: Command, dir: tempfile::TempDir) -> Run {
    let out = cmd.output().unwrap();
    let result = std::fs::read_to_string(dir.path().join("result.json"))
        .map(|t| serde_json::from_str(&t).unwrap())
        .unwrap_or(Value::Null);
    Run {
        code: out.status.code().unwrap_or(-1),
        result,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        dir,
    }
}

pub fn run_config(cfg: &Value, extra: &[&str], env: &[(&str, &str)]) -> Run {
    run_payload_text(
        &kernelkite_kernelbot::payload::encode(cfg).unwrap(),
        extra,
        env,
    )
}

/// Writes an executable script into `dir`.
pub fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

/// A fake `ncu` in `dir`: writes the report file it is asked for and runs the wrapped
/// command (exit 99 without kernelbot's `POPCORN_NCU=1`); `--import` prints a report.
pub fn fake_ncu(dir: &Path) -> PathBuf {
    script(
        dir,
        "ncu",
        r#"#!/bin/sh
if [ "$1" = "--import" ]; then
  printf '  vector_add(float*) (1, 1, 1)x(128, 1, 1)\n    ---- Table Name : GPU Throughput\n    DRAM  %%  42\n\n'
  exit 0
fi
out=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    -o) out="$2"; shift 2 ;;
    --) shift; break ;;
    *) shift ;;
  esac
done
echo "fake report for $*" > "$out"
[ "$POPCORN_NCU" = 1 ] || exit 99
exec "$@"
"#,
    )
}

/// Runs `script` with python3, `stdin` fed in; panics with Python's stderr on failure.
pub fn python_output(py: &str, script: &str, stdin: &[u8]) -> String {
    use std::io::Write as _;
    let mut child = Command::new(py)
        .arg("-c")
        .arg(script)
        .env("PYTHONIOENCODING", "utf-8")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    let data = stdin.to_vec();
    let feeder = std::thread::spawn(move || input.write_all(&data));
    let out = child.wait_with_output().unwrap();
    feeder.join().unwrap().unwrap();
    assert!(
        out.status.success(),
        "python3 failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs the Dataclass(**dict) rebuild on result files; panics with its message on failure.
pub fn assert_rebuilds(paths: &[PathBuf]) {
    let Some(py) = python() else { return };
    let out = Command::new(py)
        .arg(harness_dir().join("rebuild_result.py"))
        .args(paths)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kernelbot-style rebuild failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// True while `pid` exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    u32::try_from(pid)
        .is_ok_and(|pid| kernelkite_sys::procfs::is_running(std::path::Path::new("/proc"), pid))
}

/// Waits up to `ms` for `pid` to be gone (reaping by init can lag a little).
pub fn gone_within(pid: i32, ms: u64) -> bool {
    let end = std::time::Instant::now() + std::time::Duration::from_millis(ms);
    while std::time::Instant::now() < end {
        if !alive(pid) {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    !alive(pid)
}
