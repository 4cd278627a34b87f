//! The runner binary end to end on CPU: the POPCORN harness in every behaviour, bad payloads,
//! carriers, exit codes, and kernelbot's `Dataclass(**dict)` rebuild of every result.

mod common;

use std::process::Command;

use common::*;
use serde_json::{json, Value};

#[test]
fn all_tests_pass_and_the_protocol_is_kept() {
    let Some(_) = need_python() else { return };
    let env = [
        ("BUILDKITE_AGENT_ACCESS_TOKEN", "bkaa_secret"),
        ("BUILDKITE_AGENT_JOB_API_TOKEN", "job_api"),
        ("MY_API_TOKEN", "x"),
        ("KERNELBOT_RUN_ID", "run-42"),
    ];
    let r = run_config(
        &harness_config("test", "pass", json!({"seed": 5})),
        &[],
        &env,
    );
    assert_eq!(r.code, 0, "{}", r.log());
    // Credentials never reach the submission; ordinary job variables do.
    assert_eq!(r.run("test")["result"]["secret-vars"], "none");
    assert_eq!(r.run("test")["result"]["run-id"], "run-42");
    assert_eq!(r.result["success"], true);
    assert_eq!(r.result["error"], "");
    let run = r.run("test");
    assert_eq!(run["success"], true);
    assert_eq!(run["passed"], true);
    assert_eq!(run["exit_code"], 0);
    assert_eq!(run["stdout"], "harness test pass\n");
    let res = &run["result"];
    assert_eq!(res["mode"], "test");
    assert_eq!(res["cases"], "2");
    assert_eq!(res["seed"], "5");
    assert_eq!(res["gpus"], "none");
    assert_eq!(res["popcorn-fd"], "3");
    // Only stdio and the pipe (plus the descriptor listdir itself holds) reach the harness.
    let fds: Vec<&str> = res["fds"].as_str().unwrap().split(',').collect();
    assert_eq!(&fds[..4], ["0", "1", "2", "3"], "{fds:?}");
    assert!(fds.len() <= 5, "{fds:?}");
    assert_eq!(res["payload-vars"], "none");
    assert_eq!(res["cwd-files"], "harness.py");
    let cmd = run["command"].as_str().unwrap();
    assert!(cmd.contains(" harness.py test /"), "{cmd}");
    assert!(r.result["runs"]["test"]["compilation"].is_null());
    assert!(r.stdout.contains("--- test: run: passed"), "{}", r.stdout);
    assert_rebuilds(&[r.result_path()]);
}

#[test]
fn failing_tests_exit_112_and_still_exit_0() {
    let Some(_) = need_python() else { return };
    let r = run_config(&harness_config("test", "fail", json!({})), &[], &[]);
    assert_eq!(r.code, 0, "{}", r.log());
    assert_eq!(r.result["success"], true);
    let run = r.run("test");
    assert_eq!(
        (
            run["success"].clone(),
            run["passed"].clone(),
            run["exit_code"].clone()
        ),
        (json!(true), json!(false), json!(112))
    );
    assert_rebuilds(&[r.result_path()]);
}

#[test]
fn a_crash_is_reported_with_its_traceback() {
    let Some(_) = need_python() else { return };
    let r = run_config(&harness_config("benchmark", "crash", json!({})), &[], &[]);
    assert_eq!(r.code, 0, "{}", r.log());
    let run = r.run("benchmark");
    assert_eq!(run["success"], false);
    assert_eq!(run["passed"], false);
    assert_eq!(run["exit_code"], 1);
    assert!(run["stderr"]
        .as_str()
        .unwrap()
        .contains("RuntimeError: harness crashed on purpose"));
    // benchmark mode with ranking_by last sees only the last benchmark line.
    assert_eq!(run["result"]["cases"], "1");
    assert_eq!(run["result"]["last-case"], "11");
    assert!(r.stdout.contains("crashed"), "{}", r.stdout);
}

#[test]
fn timeout_kills_the_harness_and_its_grandchild() {
    let Some(_) = need_python() else { return };
    let pids = tempfile::tempdir().unwrap();
    let pidfile = pids.path().join("sleeper.pid");
    let mut cfg = harness_config("test", "hang", json!({"test_timeout": 1}));
    cfg["tests"] = json!([{"behave": "hang", "pidfile": pidfile.to_str().unwrap()}]);
    let t = std::time::Instant::now();
    let r = run_config(&cfg, &[], &[]);
    assert!(
        t.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(r.code, 0, "{}", r.log());
    let run = r.run("test");
    assert_eq!(run["exit_code"], 114);
    assert_eq!(run["success"], false);
    assert_eq!(run["duration"], 1.0);
    assert_eq!(run["result"], json!({}));
    assert!(
        run["stdout"]
            .as_str()
            .unwrap()
            .contains("partial output before the hang"),
        "{run}"
    );
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        gone_within(pid, 2000),
        "grandchild {pid} survived the timeout"
    );
    assert!(r.stdout.contains("timed out"), "{}", r.stdout);
    assert_rebuilds(&[r.result_path()]);
}

#[test]
fn a_daemonized_grandchild_is_killed_after_the_harness_exits() {
    let Some(_) = need_python() else { return };
    let pids = tempfile::tempdir().unwrap();
    let pidfile = pids.path().join("daemon.pid");
    let mut cfg = harness_config("test", "daemon", json!({}));
    cfg["tests"] = json!([{"behave": "daemon", "pidfile": pidfile.to_str().unwrap()}]);
    let r = run_config(&cfg, &[], &[]);
    assert_eq!(r.code, 0, "{}", r.log());
    assert_eq!(r.run("test")["passed"], true);
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        gone_within(pid, 2000),
        "setsid daemon {pid} survived the job"
    );
}

#[test]
fn a_daemonized_grandchild_dies_on_timeout_too() {
    let Some(_) = need_python() else { return };
    let pids = tempfile::tempdir().unwrap();
    let pidfile = pids.path().join("daemon.pid");
    let mut cfg = harness_config("test", "daemon", json!({"test_timeout": 1}));
    cfg["tests"] =
        json!([{"behave": "daemon", "then": "hang", "pidfile": pidfile.to_str().unwrap()}]);
    let r = run_config(&cfg, &[], &[]);
    assert_eq!(r.run("test")["exit_code"], 114, "{}", r.log());
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        gone_within(pid, 2000),
        "setsid daemon {pid} survived the timeout"
    );
}

#[test]
fn garbage_and_duplicate_lines_are_read_like_kernelbot() {
    let Some(_) = need_python() else { return };
    let r = run_config(&harness_config("test", "garbage", json!({})), &[], &[]);
    assert_eq!(r.code, 0, "{}", r.log());
    let res = r.run("test")["result"].as_object().unwrap();
    assert_eq!(res["no colon here"], "");
    assert_eq!(res[""], "");
    assert_eq!(res["key"], "second");
    assert_eq!(res["value"], "with: colons");
    assert_eq!(res["\u{0}binary"], "");
    // The first `check: fail` was overwritten by the later `check: pass`.
    assert_eq!(res["check"], "pass");
    assert_eq!(r.run("test")["passed"], true);
    let keys: Vec<&String> = res.keys().collect();
    let check_pos = keys.iter().position(|k| *k == "check").unwrap();
    let key_pos = keys.iter().position(|k| *k == "key").unwrap();
    assert!(
        check_pos < key_pos,
        "a repeated key keeps its first position: {keys:?}"
    );
    assert_rebuilds(&[r.result_path()]);
}

#[test]
fn output_far_over_the_limit_is_cut_by_kernelbots_rule() {
    let Some(_) = need_python() else { return };
    let r = run_config(&harness_config("test", "flood", json!({})), &[], &[]);
    assert_eq!(r.code, 0, "{}", r.log());
    let run = r.run("test");
    let stdout = run["stdout"].as_str().unwrap();
    // 1,000,000 lines of 12 characters + "\n" after the harness's first line (18 + 1).
    // kernelbot cuts at the first line i where size + 100 > 16384.
    let mut size = 19;
    let mut i = 1;
    while size + 13 + 100 <= 16384 {
        size += 13;
        i += 1;
    }
    let total_lines = 1 + 1_000_000 + 1; // split("\n") counts the empty tail
    assert!(
        stdout.ends_with(&format!("\n[...] {} lines omitted", total_lines - i)),
        "{}",
        &stdout[stdout.len() - 80..]
    );
    assert_eq!(stdout.lines().count(), i + 1);
    assert!(stdout.chars().count() <= 16384);
    assert_eq!(run["stderr"], "[...] 2 lines omitted");
    assert_eq!(run["passed"], true);
}

#[test]
fn the_seed_reaches_every_run_and_never_the_log() {
    let Some(_) = need_python() else { return };
    let seed = 918_273_645i64;
    let r = run_config(
        &harness_config("leaderboard", "pass", json!({"seed": seed})),
        &[],
        &[],
    );
    assert_eq!(r.code, 0, "{}", r.log());
    let names: Vec<&String> = r.result["runs"].as_object().unwrap().keys().collect();
    assert_eq!(names, ["test", "benchmark", "leaderboard"]);
    for name in names {
        assert_eq!(r.run(name)["result"]["seed"], seed.to_string());
        assert_eq!(r.run(name)["result"]["mode"], name.as_str());
    }
    assert!(
        !r.log().contains(&seed.to_string()),
        "the seed leaked into the log:\n{}",
        r.log()
    );
    assert!(r.stdout.contains("--- leaderboard"), "{}", r.stdout);
    assert_rebuilds(&[r.result_path()]);
}

#[test]
fn private_runs_the_same_chain() {
    let Some(_) = need_python() else { return };
    let r = run_config(&harness_config("private", "pass", json!({})), &[], &[]);
    let names: Vec<&String> = r.result["runs"].as_object().unwrap().keys().collect();
    assert_eq!(names, ["test", "benchmark", "leaderboard"]);
    assert_eq!(r.run("leaderboard")["result"]["mode"], "leaderboard");
}

#[test]
fn leaderboard_chain_stops_after_a_failed_test() {
    let Some(_) = need_python() else { return };
    let r = run_config(&harness_config("leaderboard", "fail", json!({})), &[], &[]);
    assert_eq!(r.code, 0, "{}", r.log());
    let names: Vec<&String> = r.result["runs"].as_object().unwrap().keys().collect();
    assert_eq!(names, ["test"]);
    assert_eq!(r.result["success"], true);
}

#[test]
fn leaderboard_chain_stops_after_a_failed_benchmark() {
    let Some(_) = need_python() else { return };
    let r = run_config(
        &harness_config("leaderboard", "bench-fail", json!({})),
        &[],
        &[],
    );
    let names: Vec<&String> = r.result["runs"].as_object().unwrap().keys().collect();
    assert_eq!(names, ["test", "benchmark"]);
}

#[test]
fn profile_without_a_profiler_is_a_clear_infrastructure_error() {
    let Some(_) = need_python() else { return };
    if ["ncu", "rocprofv3"].iter().any(|t| {
        ["/usr/bin", "/bin"]
            .iter()
            .any(|d| std::path::Path::new(d).join(t).exists())
    }) {
        kernelkite_testkit_leaf::skip("a real profiler is installed in /usr/bin or /bin");
        return;
    }
    let r = run_config(&harness_config("profile", "pass", json!({})), &[], &[]);
    assert_eq!(r.code, 3, "{}", r.log());
    assert_eq!(r.result["success"], false);
    let err = r.result["error"].as_str().unwrap();
    assert!(err.contains("ncu") && err.contains("rocprofv3"), "{err}");
    assert_eq!(r.result["runs"], json!({}));
    assert!(r.stdout.contains("infrastructure failure"), "{}", r.stdout);
    assert_rebuilds(&[r.result_path()]);
}

#[test]
fn profile_runs_each_benchmark_under_a_fake_ncu() {
    let Some(_) = need_python() else { return };
    let tools = tempfile::tempdir().unwrap();
    fake_ncu(tools.path());
    let path = path_with(Some(tools.path()));
    let r = run_config(
        &harness_config("profile", "pass", json!({})),
        &[],
        &[("PATH", &path)],
    );
    assert_eq!(r.code, 0, "{}", r.log());
    let names: Vec<&String> = r.result["runs"].as_object().unwrap().keys().collect();
    assert_eq!(names, ["profile.0", "profile.1"]);
    for (i, name) in ["profile.0", "profile.1"].iter().enumerate() {
        let run = r.run(name);
        assert_eq!(run["passed"], true, "{run}");
        assert_eq!(run["result"]["mode"], "profile");
        assert_eq!(run["result"]["cases"], "1");
        assert_eq!(run["result"]["last-case"], (10 + i).to_string());
        assert!(
            run["command"].as_str().unwrap().contains("--set full"),
            "{}",
            run["command"]
        );
        let report = base64_decode(run["result"]["benchmark.0.report"].as_str().unwrap());
        assert!(report.contains("DRAM  %  42"), "{report}");
        let prof = &r.result["runs"][name]["profile"];
        assert_eq!(prof["profiler"], "Nsight-Compute");
        assert!(prof["download_url"].is_null());
        let zip = base64_decode_bytes(prof["trace"].as_str().unwrap());
        assert_eq!(&zip[..4], b"PK\x03\x04");
        assert!(String::from_utf8_lossy(&zip).contains("profile.ncu-rep"));
    }
    assert_rebuilds(&[r.result_path()]);
}

fn base64_decode_bytes(s: &str) -> Vec<u8> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.decode(s).unwrap()
}

fn base64_decode(s: &str) -> String {
    String::from_utf8(base64_decode_bytes(s)).unwrap()
}

#[test]
fn bad_payloads_write_a_result_with_the_reason_and_exit_2() {
    use base64::Engine as _;
    use std::io::Write as _;
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
    let zlib = |bytes: &[u8]| {
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        z.write_all(bytes).unwrap();
        b64(&z.finish().unwrap())
    };
    let enc = |v: Value| kernelkite_kernelbot::payload::encode(&v).unwrap();
    let good = harness_config("test", "pass", json!({}));
    let mut traversal = good.clone();
    traversal["sources"] = json!({"../escape.py": "x", "harness.py": "x"});
    let mut absolute = good.clone();
    absolute["sources"] = json!({"/tmp/abs.py": "x", "harness.py": "x"});
    let mut wrong_type = good.clone();
    wrong_type["test_timeout"] = json!("soon");
    let mut unknown_mode = good.clone();
    unknown_mode["mode"] = json!("turbo");
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "not base64",
            "%%% definitely not base64 %%%".into(),
            "not valid base64",
        ),
        ("not zlib", b64(b"plain bytes, not compressed"), "not zlib"),
        ("not JSON", zlib(b"{\"lang\": py"), "not valid JSON"),
        ("empty", "\n".into(), "empty"),
        ("wrong types", enc(wrong_type), "test_timeout"),
        ("unknown mode", enc(unknown_mode), "turbo"),
        ("path traversal", enc(traversal), "contains '..'"),
        ("absolute path", enc(absolute), "absolute path"),
        (
            "not an object",
            enc(json!([1, 2])),
            "not a valid kernelbot run config",
        ),
    ];
    let mut paths = Vec::new();
    let mut keep = Vec::new();
    for (what, payload, want) in cases {
        let r = run_payload_text(&payload, &[], &[]);
        assert_eq!(r.code, 2, "{what}: {}", r.log());
        assert_eq!(r.result["success"], false, "{what}");
        let err = r.result["error"].as_str().unwrap();
        assert!(
            err.contains(want),
            "{what}: error {err:?} should mention {want:?}"
        );
        assert_eq!(r.result["runs"], json!({}), "{what}");
        assert!(
            r.stdout.contains("bad payload or config"),
            "{what}: {}",
            r.stdout
        );
        assert!(
            !r.log().contains(&payload) || payload.trim().is_empty(),
            "{what}: payload printed"
        );
        paths.push(r.result_path());
        keep.push(r);
    }
    assert_rebuilds(&paths);
}

/// In a job (`BUILDKITE` set) a missing payload is the build's fault: result.json says so,
/// naming the carriers.
#[test]
fn a_missing_payload_names_the_carriers() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(BIN);
    cmd.current_dir(dir.path())
        .env_clear()
        .env("PATH", path_with(None))
        .env("BUILDKITE", "true");
    let r = finish(cmd, dir);
    assert_eq!(r.code, 2, "{}", r.log());
    let err = r.result["error"].as_str().unwrap();
    assert!(
        err.contains("KERNELBOT_PAYLOAD") && err.contains("--payload-file"),
        "{err}"
    );
}

/// Run by hand with nothing to evaluate (issue 35): it says what to pass, and leaves no
/// result.json in the current directory.
#[test]
fn run_by_hand_without_a_payload_it_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .current_dir(dir.path())
        .env_clear()
        .env("PATH", path_with(None))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no run config to evaluate") && err.contains("--example"),
        "{err}"
    );
    assert!(!dir.path().join("result.json").exists());
}

#[test]
fn a_symlink_planted_in_the_workdir_is_refused() {
    let Some(_) = need_python() else { return };
    let work = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path(), work.path().join("pkg")).unwrap();
    let mut cfg = harness_config("test", "pass", json!({}));
    cfg["sources"]["pkg/evil.py"] = json!("print('owned')");
    let r = run_config(&cfg, &["--workdir", work.path().to_str().unwrap()], &[]);
    assert_eq!(r.code, 2, "{}", r.log());
    let err = r.result["error"].as_str().unwrap();
    assert!(
        err.contains("pkg/evil.py") && err.contains("symbolic link"),
        "{err}"
    );
    assert!(!outside.path().join("evil.py").exists());
}

#[test]
fn sources_are_removed_from_a_given_workdir_afterwards() {
    let Some(_) = need_python() else { return };
    let work = tempfile::tempdir().unwrap();
    let mut cfg = harness_config("test", "pass", json!({}));
    cfg["sources"]["pkg/helper.py"] = json!("X = 1\n");
    let r = run_config(&cfg, &["--workdir", work.path().to_str().unwrap()], &[]);
    assert_eq!(r.code, 0, "{}", r.log());
    assert_eq!(r.run("test")["result"]["cwd-files"], "harness.py,pkg");
    assert!(!work.path().join("harness.py").exists());
    assert!(!work.path().join("pkg/helper.py").exists());
}

#[test]
fn python_pre_run_reports_a_torch_extension_build() {
    let Some(_) = need_python() else { return };
    let mut cfg = harness_config("test", "pass", json!({"seed": 77}));
    cfg["sources"]["submission.py"] = json!(
        "import os\nprint('c++ -DTORCH_EXTENSION_NAME=ext seed', os.environ.get('POPCORN_SEED'))\n"
    );
    let r = run_config(&cfg, &[], &[]);
    assert_eq!(r.code, 0, "{}", r.log());
    let comp = &r.result["runs"]["test"]["compilation"];
    assert_eq!(comp["success"], true);
    assert_eq!(comp["nvcc_found"], true);
    assert_eq!(comp["stdout"], "c++ -DTORCH_EXTENSION_NAME=ext seed 1\n");
    assert!(comp["command"]
        .as_str()
        .unwrap()
        .ends_with(" submission.py"));

    // Without the marker there is no compilation record.
    cfg["sources"]["submission.py"] = json!("print('hello')\n");
    let r = run_config(&cfg, &[], &[]);
    assert!(r.result["runs"]["test"]["compilation"].is_null());
}

#[test]
fn missing_python_is_an_infrastructure_failure() {
    let r = run_config(
        &harness_config("test", "pass", json!({})),
        &["--python", "/nonexistent/python3"],
        &[],
    );
    assert_eq!(r.code, 3, "{}", r.log());
    assert!(r.result["error"]
        .as_str()
        .unwrap()
        .contains("/nonexistent/python3"));
}

#[test]
fn unwritable_output_is_an_infrastructure_failure() {
    let Some(_) = need_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let pfile = dir.path().join("p.txt");
    std::fs::write(
        &pfile,
        kernelkite_kernelbot::payload::encode(&harness_config("test", "pass", json!({}))).unwrap(),
    )
    .unwrap();
    let out = Command::new(BIN)
        .args([
            "--python",
            python().unwrap(),
            "--output",
            "/nonexistent-dir/result.json",
            "--payload-file",
        ])
        .arg(&pfile)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot write"));
}

#[test]
fn require_gpu_without_a_gpu_is_an_infrastructure_failure() {
    if std::path::Path::new("/dev/nvidia0").exists() || std::path::Path::new("/dev/kfd").exists() {
        kernelkite_testkit_leaf::skip("this machine has a GPU");
        return;
    }
    let r = run_config(
        &harness_config("test", "pass", json!({})),
        &["--require-gpu"],
        &[],
    );
    assert_eq!(r.code, 3, "{}", r.log());
    assert!(r.result["error"].as_str().unwrap().contains("no GPU"));
    // The environment form, as a pipeline sets it.
    let cfg = harness_config("test", "pass", json!({}));
    let r = run_config(&cfg, &[], &[("KERNELKITE_REQUIRE_GPU", "1")]);
    assert_eq!(r.code, 3, "{}", r.log());
    if python().is_some() {
        let r = run_config(&cfg, &[], &[("KERNELKITE_REQUIRE_GPU", "0")]);
        assert_eq!(r.code, 0, "{}", r.log());
    }
}

#[test]
fn the_chunked_env_carrier_carries_a_large_payload() {
    let Some(py) = need_python() else { return };
    // Incompressible filler pushes the payload over one variable's 128 KiB.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let filler: String = (0..200_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b'!' + (x % 90) as u8)
        })
        .collect();
    let mut cfg = harness_config("test", "pass", json!({}));
    cfg["sources"]["blob.txt"] = json!(filler);
    let payload = kernelkite_kernelbot::payload::encode(&cfg).unwrap();
    let vars = kernelkite_kernelbot::payload::to_env(&payload);
    assert!(vars.len() > 3, "payload should need chunks");
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(BIN);
    cmd.env_clear()
        .env("PATH", path_with(None))
        .args(["--python", py, "--output"])
        .arg(dir.path().join("result.json"));
    for (k, v) in &vars {
        cmd.env(k, v);
    }
    let r = finish(cmd, dir);
    assert_eq!(r.code, 0, "{}", r.log());
    assert_eq!(r.run("test")["passed"], true);
    assert_eq!(r.run("test")["result"]["payload-vars"], "none");
}

#[test]
fn example_runs_and_its_payload_round_trips_through_a_file() {
    let Some(py) = need_python() else { return };
    let out = Command::new(BIN)
        .args(["--example", "--print-payload"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let payload = String::from_utf8(out.stdout).unwrap();
    let cfg = kernelkite_kernelbot::payload::decode(&payload).unwrap();
    assert_eq!(cfg["mode"], "leaderboard");
    let r = run_payload_text(&payload, &[], &[]);
    assert_eq!(r.code, 0, "{}", r.log());
    let names: Vec<&String> = r.result["runs"].as_object().unwrap().keys().collect();
    assert_eq!(names, ["test", "benchmark", "leaderboard"]);
    assert!(names.iter().all(|n| r.run(n)["passed"] == true));

    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(BIN);
    cmd.args(["--example", "--example-mode", "test", "--python", py])
        .current_dir(dir.path());
    let r = finish(cmd, dir);
    assert_eq!(r.code, 0, "{}", r.log());
    assert_eq!(r.run("test")["result"]["check"], "pass");
}

#[test]
fn help_explains_carriers_and_exit_codes() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for want in [
        "--payload-file",
        "KERNELBOT_PAYLOAD_CHUNKS",
        "KERNELBOT_PAYLOAD_SHA256",
        "EXIT CODES",
        "infrastructure failure",
    ] {
        assert!(help.contains(want), "--help lacks {want}");
    }
}

#[test]
fn sigterm_kills_the_harness_and_still_writes_the_result() {
    let Some(py) = need_python() else { return };
    let pids = tempfile::tempdir().unwrap();
    let pidfile = pids.path().join("sleeper.pid");
    let mut cfg = harness_config("leaderboard", "hang", json!({}));
    cfg["tests"] = json!([{"behave": "hang", "pidfile": pidfile.to_str().unwrap()}]);
    let dir = tempfile::tempdir().unwrap();
    let pfile = dir.path().join("payload.txt");
    std::fs::write(&pfile, kernelkite_kernelbot::payload::encode(&cfg).unwrap()).unwrap();
    let mut child = Command::new(BIN)
        .args(["--python", py, "--payload-file"])
        .arg(&pfile)
        .arg("--output")
        .arg(dir.path().join("result.json"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Wait until the harness has started its grandchild, then cancel as the agent does.
    let t = std::time::Instant::now();
    while std::fs::read_to_string(&pidfile).map_or(true, |s| s.trim().is_empty()) {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "harness never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&child),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let status = child.wait().unwrap();
    assert!(t.elapsed() < std::time::Duration::from_secs(10));
    assert_eq!(status.code(), Some(3));
    let text = std::fs::read_to_string(dir.path().join("result.json")).unwrap();
    let result: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(result["success"], false);
    assert!(
        result["error"].as_str().unwrap().contains("cancelled"),
        "{result}"
    );
    let names: Vec<&String> = result["runs"].as_object().unwrap().keys().collect();
    assert_eq!(names, ["test"]);
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        gone_within(pid, 2000),
        "grandchild {pid} survived the cancellation"
    );
}

#[test]
fn gpu_info_comes_from_nvidia_smi_or_rocm_smi_without_nvml() {
    let Some(_) = need_python() else { return };
    if kernelkite_runner::sysinfo::nvml_available() {
        kernelkite_testkit_leaf::skip("NVML is loadable here, so the smi fallbacks are not used");
        return;
    }
    let tools = tempfile::tempdir().unwrap();
    script(
        tools.path(),
        "nvidia-smi",
        "#!/bin/sh\nprintf 'NVIDIA H100 80GB HBM3\\nNVIDIA H100 80GB HBM3\\n'\n",
    );
    let path = path_with(Some(tools.path()));
    let cfg = harness_config("test", "pass", json!({}));
    let r = run_config(&cfg, &[], &[("PATH", &path)]);
    let sys = &r.result["system"];
    assert_eq!(sys["gpu"], "NVIDIA H100 80GB HBM3", "{sys}");
    assert_eq!(sys["device_count"], 2);
    assert_eq!(sys["runtime"], "CUDA");
    let r = run_config(&cfg, &[], &[("PATH", &path), ("CUDA_VISIBLE_DEVICES", "1")]);
    assert_eq!(r.result["system"]["device_count"], 1);

    let amd = tempfile::tempdir().unwrap();
    script(
        amd.path(),
        "rocm-smi",
        "#!/bin/sh\necho '{\"card0\": {\"Card Series\": \"AMD Instinct MI300X\"}}'\n",
    );
    let path = path_with(Some(amd.path()));
    let r = run_config(&cfg, &["--require-gpu"], &[("PATH", &path)]);
    assert_eq!(r.code, 0, "{}", r.log());
    let sys = &r.result["system"];
    assert_eq!(
        (
            sys["gpu"].as_str(),
            sys["device_count"].as_u64(),
            sys["runtime"].as_str()
        ),
        (Some("AMD Instinct MI300X"), Some(1), Some("ROCm"))
    );
    assert!(!sys["hostname"].as_str().unwrap().is_empty());
    assert!(sys["platform"].as_str().unwrap().starts_with("Linux-"));
}

/// In a job NVML counts every GPU of the node but lets the job open only its own (the others
/// answer NO_PERMISSION, as the stand-in does for a GPU whose node is not in
/// `KERNELKITE_FAKE_NVML_DEV`): its answer is the count, and `nvidia-smi`, which would list the
/// node's GPUs, is never asked, not even when NVML lets the job use none.
#[test]
fn the_gpu_count_is_nvml_s_and_never_nvidia_smi_s_when_nvml_loads() {
    let Some(_) = need_python() else { return };
    if kernelkite_runner::sysinfo::nvml_available() {
        kernelkite_testkit_leaf::skip(
            "a real NVML loads here and would answer instead of the stand-in",
        );
        return;
    }
    use kernelkite_testkit_leaf::fake_nvml::{h100, FakeNvml};
    let fake = match FakeNvml::build() {
        Ok(f) => f,
        Err(why) => return kernelkite_testkit_leaf::skip(&why),
    };
    fake.configure(&format!(
        "{}{}",
        h100("0000:18:00.0", 0, 0),
        h100("0000:19:00.0", 1, 0)
    ));
    let tools = tempfile::tempdir().unwrap();
    let marker = tools.path().join("nvidia-smi-ran");
    script(
        tools.path(),
        "nvidia-smi",
        &format!(
            "#!/bin/sh\ntouch '{}'\nprintf 'NVIDIA H100 80GB HBM3\\nNVIDIA H100 80GB HBM3\\n'\n",
            marker.display()
        ),
    );
    let dev = tempfile::tempdir().unwrap();
    let path = path_with(Some(tools.path()));
    let dev_dir = dev.path().display().to_string();
    let mut env: Vec<(String, String)> = fake.env();
    env.push(("PATH".into(), path));
    env.push(("KERNELKITE_FAKE_NVML_DEV".into(), dev_dir));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let cfg = harness_config("test", "pass", json!({}));
    // The job may open GPU 0 only (NVML lists it; its /dev/nvidia0 does not open on this
    // machine, so it is not usable either), then none of them.
    std::fs::write(dev.path().join("nvidia0"), "").unwrap();
    let r = run_config(&cfg, &[], &env);
    let sys = &r.result["system"];
    assert_eq!(sys["gpu"], "NVIDIA H100 80GB HBM3", "{sys}\n{}", r.log());
    assert_eq!(sys["device_count"], 0, "{sys}");
    assert_eq!(sys["runtime"], "CUDA", "{sys}");
    std::fs::remove_file(dev.path().join("nvidia0")).unwrap();
    let r = run_config(&cfg, &[], &env);
    let sys = &r.result["system"];
    assert_eq!(
        (sys["device_count"].as_u64(), sys["runtime"].as_str()),
        (Some(0), Some("CUDA")),
        "{sys}\n{}",
        r.log()
    );
    assert!(!marker.exists(), "nvidia-smi was asked");
}

#[test]
fn profile_uses_rocprofv3_when_that_is_the_profiler_present() {
    let Some(_) = need_python() else { return };
    if kernelkite_runner::sysinfo::find_on_path("ncu").is_some() {
        kernelkite_testkit_leaf::skip("a real ncu is on PATH and would be preferred");
        return;
    }
    let tools = tempfile::tempdir().unwrap();
    // Writes two per-process traces into the -d directory, then runs the wrapped command.
    script(
        tools.path(),
        "rocprofv3",
        r#"#!/bin/sh
dir=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    -d) dir="$2"; shift 2 ;;
    --) shift; break ;;
    *) shift ;;
  esac
done
echo "trace-a" > "$dir/100_results.pftrace"
echo "trace-b" > "$dir/101_results.pftrace"
echo "kernel,0" > "$dir/100_kernel_trace.csv"
[ "$GPU_DUMP_CODE_OBJECT" = 1 ] || exit 99
exec "$@"
"#,
    );
    let path = path_with(Some(tools.path()));
    let mut cfg = harness_config("profile", "pass", json!({}));
    cfg["benchmarks"] = json!([{"behave": "pass", "n": 7}]);
    let r = run_config(&cfg, &[], &[("PATH", &path)]);
    assert_eq!(r.code, 0, "{}", r.log());
    let prof = &r.result["runs"]["profile.0"]["profile"];
    assert_eq!(prof["profiler"], "rocPROF");
    let zip = base64_decode_bytes(prof["trace"].as_str().unwrap());
    let listing = String::from_utf8_lossy(&zip);
    assert!(listing.contains("combined.pftrace") && listing.contains("100_kernel_trace.csv"));
    assert!(
        !listing.contains("100_results.pftrace"),
        "per-process traces are merged"
    );
    assert!(r.run("profile.0")["command"]
        .as_str()
        .unwrap()
        .contains("--kernel-trace"));
    assert_rebuilds(&[r.result_path()]);
}

#[test]
fn a_usage_error_still_writes_the_result_and_is_an_infrastructure_failure() {
    // A bad flag, with --output given: the result lands there.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r.json");
    let mut cmd = Command::new(BIN);
    cmd.env_clear()
        .env("PATH", path_with(None))
        .args(["--no-such-flag", "--output"])
        .arg(&out);
    let r = finish(cmd, tempfile::tempdir().unwrap());
    assert_eq!(r.code, 3, "{}", r.log());
    let result: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(result["success"], false);
    let err = result["error"].as_str().unwrap();
    assert!(
        err.contains("--no-such-flag") && err.contains("--help"),
        "{err}"
    );
    assert_eq!(result["runs"], json!({}));
    assert_rebuilds(&[out]);

    // A bad value in the agent's environment, the output named there too.
    let out = dir.path().join("env.json");
    let mut cmd = Command::new(BIN);
    cmd.env_clear()
        .env("PATH", path_with(None))
        .env("KERNELKITE_TORCH_PROBE", "bogus")
        .env("KERNELKITE_OUTPUT", &out);
    let r = finish(cmd, tempfile::tempdir().unwrap());
    assert_eq!(r.code, 3, "{}", r.log());
    let result: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert!(
        result["error"].as_str().unwrap().contains("bogus"),
        "{result}"
    );

    // A payload passed as an argument by mistake is not echoed, however small; the default
    // output is used.
    let payload = kernelkite_kernelbot::payload::encode(&json!({"lang": "py", "mode": "test",
        "sources": {"a.py": ""}, "main": "a.py", "tests": [{"n": 1}], "seed": 918273645}))
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(BIN);
    cmd.current_dir(dir.path())
        .env_clear()
        .env("PATH", path_with(None))
        .arg(&payload);
    let r = finish(cmd, dir);
    assert_eq!(r.code, 3, "{}", r.log());
    assert_eq!(r.result["success"], false);
    let text = std::fs::read_to_string(r.result_path()).unwrap();
    assert!(
        !text.contains(&payload[..40]),
        "payload in result.json: {text}"
    );
    assert!(!r.log().contains(&payload[..40]), "payload in the log");

    // --help and --version are not errors.
    for flag in ["--help", "--version"] {
        let out = Command::new(BIN).arg(flag).output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{flag}");
    }
}

#[test]
fn popcorn_variables_come_only_from_the_config() {
    let Some(_) = need_python() else { return };
    // Left in the agent's environment, they must not stand in for the config's.
    let env = [("POPCORN_SEED", "4242"), ("POPCORN_GPUS", "8")];
    let r = run_config(&harness_config("test", "pass", json!({})), &[], &env);
    assert_eq!(r.code, 0, "{}", r.log());
    assert_eq!(r.run("test")["result"]["seed"], "none");
    assert_eq!(r.run("test")["result"]["gpus"], "none");
    let r = run_config(
        &harness_config("test", "pass", json!({"seed": 77})),
        &[],
        &env,
    );
    assert_eq!(r.run("test")["result"]["seed"], "77");
}

#[test]
fn a_seed_quoted_in_a_config_error_is_redacted_from_the_log() {
    // A seed of the wrong type makes the config error quote it; the log must not.
    let cfg = harness_config("leaderboard", "pass", json!({"seed": "918273645"}));
    let r = run_config(&cfg, &[], &[]);
    assert_eq!(r.code, 2, "{}", r.log());
    assert!(
        r.result["error"].as_str().unwrap().contains("seed"),
        "{}",
        r.result
    );
    assert!(r.stdout.contains("<redacted>"), "{}", r.stdout);
    assert!(
        !r.log().contains("918273645"),
        "the seed leaked into the log:\n{}",
        r.log()
    );
}

#[test]
fn print_payload_into_a_closed_pipe_exits_quietly() {
    // `kernelkite-runner --example --print-payload | head -c 10`: the reader may be gone
    // before the payload is written. Closing the read end first makes that certain.
    let (read, write) = std::io::pipe().unwrap();
    drop(read);
    let out = Command::new(BIN)
        .args(["--example", "--print-payload"])
        .stdout(std::process::Stdio::from(write))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.is_empty(), "not quiet: {stderr}");
}

/// The run's provenance is written beside the result (which stays kernelbot's, with no field
/// of it): the node, the agent, the queue and the slice from the job's environment, and the
/// job's GPU as NVML reports it (the stand-in's `health` and `driver` lines), sampled at the
/// start and at the end; a GPU the job may not open is not listed.
#[test]
fn provenance_json_names_where_and_on_what_the_run_ran() {
    let Some(_) = need_python() else { return };
    if kernelkite_runner::sysinfo::nvml_available() {
        kernelkite_testkit_leaf::skip(
            "a real NVML loads here and would answer instead of the stand-in",
        );
        return;
    }
    use kernelkite_testkit_leaf::fake_nvml::{h100, h100_uuid, FakeNvml};
    let fake = match FakeNvml::build() {
        Ok(f) => f,
        Err(why) => return kernelkite_testkit_leaf::skip(&why),
    };
    fake.configure(&format!(
        "{}{}health 0000:18:00.0 1755 2619 700000 64 0 0x4 1980 96.00.99.00.01\n\
         health 0000:19:00.0 1980 2619 700000 40 0 0x0 1980 96.00.99.00.02\n\
         driver 550.54.15\n",
        h100("0000:18:00.0", 0, 0),
        h100("0000:19:00.0", 1, 0)
    ));
    let dev = tempfile::tempdir().unwrap();
    // GPU 0 opens (its node is in the job's /dev); GPU 1 is another job's.
    std::fs::write(dev.path().join("nvidia0"), "").unwrap();
    let dev_dir = dev.path().display().to_string();
    let mut env: Vec<(String, String)> = fake.env();
    env.push(("KERNELKITE_FAKE_NVML_DEV".into(), dev_dir));
    env.push(("BUILDKITE_AGENT_NAME".into(), "dgx01-gpu0".into()));
    env.push(("KERNELBOT_QUEUE".into(), "h100".into()));
    env.push((
        "KERNELKITE_SLICE".into(),
        r#"{"index":0,"gpu":{"pci_bus_id":"0000:18:00.0"},"cpus":[0,1,2,3],"mems":[0],"memory_bytes":17179869184}"#.into(),
    ));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let r = run_config(&harness_config("test", "pass", json!({})), &[], &env);
    assert_eq!(r.code, 0, "{}", r.log());
    let text = std::fs::read_to_string(r.dir.path().join("provenance.json"))
        .unwrap_or_else(|e| panic!("no provenance.json ({e}): {}", r.log()));
    let p = kernelkite_sys::provenance::Provenance::parse(text.as_bytes()).unwrap();
    assert_eq!(p.format, kernelkite_sys::provenance::FORMAT);
    assert_eq!(p.agent.as_deref(), Some("dgx01-gpu0"));
    assert_eq!(p.queue.as_deref(), Some("h100"));
    assert_eq!(p.slice.as_ref().map(|s| s.index), Some(0));
    assert_eq!(p.slice.as_ref().map(|s| s.cpus.len()), Some(4));
    assert_eq!(p.driver.as_deref(), Some("550.54.15"));
    assert_eq!(p.kernelkite_version, env!("CARGO_PKG_VERSION"));
    assert!(!p.node.is_empty());
    assert!(p.started_ms > 0 && p.ended_ms >= p.started_ms, "{p:?}");
    assert_eq!(p.gpus.len(), 1, "only the job's own GPU: {p:?}");
    let g = &p.gpus[0];
    assert_eq!(g.uuid.as_deref(), Some(h100_uuid("0000:18:00.0").as_str()));
    assert_eq!(g.name.as_deref(), Some("NVIDIA H100 80GB HBM3"));
    assert_eq!(g.vbios.as_deref(), Some("96.00.99.00.01"));
    assert_eq!(g.max_sm_clock_mhz, Some(1980));
    for s in [&g.start, &g.end] {
        let s = s.as_ref().expect("sampled at the start and the end");
        assert_eq!(s.sm_clock_mhz, Some(1755));
        assert_eq!(s.mem_clock_mhz, Some(2619));
        assert_eq!(s.power_limit_w, Some(700.0));
        assert_eq!(s.temperature_c, Some(64));
        assert_eq!(s.ecc_uncorrected, Some(0));
        assert_eq!(s.throttle, ["sw_power_cap"]);
    }
    assert!(
        p.concerns(&Default::default()).is_empty(),
        "a power cap is a setting, not a fault"
    );
    // result.json is kernelbot's own: the provenance adds nothing to it.
    let keys: Vec<&String> = r.result.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["success", "error", "system", "runs"]);
}
