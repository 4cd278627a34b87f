//! `kernelkite-service demo`, `submit` and `local` as a user runs them: the binary as a
//! process, local mode on loopback, the plugin's hooks and the runner as real processes, and
//! task directories in kernelbot's format.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use kernelkite_testkit::local::{examples_dir, Bins};
use kernelkite_testkit::{local_bins, need_python};
use serde_json::{json, Value};

/// The local executor's flags for a command run by a test: the test's binaries, and jobs run
/// without cgroups (an empty cgroup root, a run dir of the test's own). Real cgroups are
/// `local_executor.rs`'s confinement test: every user of a node's job cgroups must share one
/// run dir, and commands of parallel tests would clean up each other's jobs as lost.
/// `sandbox` is `--sandbox`: these tests say it (`auto` would depend on this machine's users).
fn local_flags(bins: &Bins, scratch: &Path, sandbox: &str) -> Vec<String> {
    let empty = scratch.join("no-cgroups");
    std::fs::create_dir_all(&empty).unwrap();
    let p = |p: &Path| p.to_str().unwrap().to_string();
    vec![
        "--runner-bin".into(),
        p(&bins.runner),
        "--isolate-bin".into(),
        p(&bins.isolate),
        "--run-dir".into(),
        p(&scratch.join("run")),
        "--cgroup-root".into(),
        p(&empty),
        "--local-dir".into(),
        p(&scratch.join("local")),
        "--sandbox".into(),
        sandbox.into(),
    ]
}

fn service(bins: &Bins) -> Command {
    let mut c = Command::new(&bins.service);
    // The service's own settings come from flags here, not from whatever the test inherits.
    for (k, _) in std::env::vars() {
        if k.starts_with("KERNELKITE_") || k.starts_with("BUILDKITE_") {
            c.env_remove(k);
        }
    }
    c.env("RUST_LOG", "warn");
    c
}

/// One HTTP request (`POST` with `body`, else `GET`), its JSON answer (`null` if none).
fn http(req: &str, url: &str, body: Option<Value>) -> Value {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let c = reqwest::Client::new();
        let r = match (req, body) {
            ("POST", Some(b)) => c.post(url).json(&b).send().await,
            _ => c.get(url).send().await,
        };
        r.unwrap().json::<Value>().await.unwrap_or(Value::Null)
    })
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn submit(bins: &Bins, scratch: &Path, args: &[&str]) -> (i32, String, String) {
    let out = service(bins)
        .arg("submit")
        .args(args)
        .args(local_flags(bins, scratch, "off"))
        .output()
        .unwrap();
    let (o, e) = text(&out);
    (out.status.code().unwrap_or(-1), o, e)
}

#[test]
fn the_demo_runs_every_mode_and_prints_results_and_timings() {
    if need_python().is_none() {
        return;
    }
    let bins = local_bins!();
    let scratch = tempfile::tempdir().unwrap();
    let out = service(&bins)
        .args(["demo", "--example", "cpu"])
        .args(local_flags(&bins, scratch.path(), "off"))
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for want in [
        "node plan",
        "── test ── test with submission.py",
        "── leaderboard ── leaderboard with submission.py",
        "size: 1023; seed: 9173",
        "benchmark: passed (exit 0",
        "leaderboard: passed (exit 0",
        "score (geom of the ranked run's means)",
        "✓ failed its tests, as a wrong submission must",
        "where the time went",
        "demo passed",
    ] {
        assert!(stdout.contains(want), "no {want:?} in:\n{stdout}");
    }
    // Each state change is printed as it happens, in order.
    let states: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix('+'))
        .filter_map(|l| l.split_whitespace().nth(2))
        .collect();
    assert_eq!(
        states[..5],
        ["queued", "scheduled", "running", "fetching", "succeeded"],
        "{stdout}"
    );
    // Benchmark means with units.
    assert!(
        stdout
            .lines()
            .any(|l| l.contains("size: 100000; seed: 6256")
                && (l.contains(" ms ±") || l.contains(" µs ±"))),
        "{stdout}"
    );
    assert_eq!(
        scratch
            .path()
            .join("local/jobs")
            .read_dir()
            .unwrap()
            .count(),
        0
    );
}

#[test]
fn submit_runs_a_kernelbot_task_directory_in_every_mode() {
    if need_python().is_none() {
        return;
    }
    let bins = local_bins!();
    let scratch = tempfile::tempdir().unwrap();
    let task = examples_dir().join("prefixsum_py");
    let t = task.to_str().unwrap();
    let good = task.join("submission.py");
    let good = good.to_str().unwrap();

    let (code, out, err) = submit(
        &bins,
        scratch.path(),
        &["--task", t, "--submission", good, "--mode", "test"],
    );
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("test: passed (exit 0"), "{out}");
    for state in ["queued", "scheduled", "running", "fetching", "succeeded"] {
        assert!(
            err.contains(&format!("] {state}")),
            "progress lacks {state}: {err}"
        );
    }

    let (code, out, err) = submit(
        &bins,
        scratch.path(),
        &["--task", t, "--submission", good, "--mode", "benchmark"],
    );
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("size: 100000; seed: 6256"), "{out}");

    let (code, out, err) = submit(
        &bins,
        scratch.path(),
        &["--task", t, "--submission", good, "--mode", "leaderboard"],
    );
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("leaderboard: passed") && out.contains("score (geom): "),
        "{out}"
    );

    // Profile mode needs a profiler; on a machine without one the runner says so, and the
    // result comes back with its reason.
    let (code, out, err) = submit(
        &bins,
        scratch.path(),
        &["--task", t, "--submission", good, "--mode", "profile"],
    );
    let profiler = ["ncu", "rocprofv3"].iter().any(|p| which(p));
    if !profiler {
        assert_eq!(code, 1, "{out}\n{err}");
        assert!(out.contains("profile mode needs a profiler"), "{out}");
    } else {
        assert!(code == 0 || code == 1, "{out}\n{err}");
    }

    // A wrong submission runs and fails its tests: exit 1, each failure shown.
    let wrong = task.join("wrong_submission.py");
    let (code, out, _) = submit(
        &bins,
        scratch.path(),
        &["--task", t, "--submission", wrong.to_str().unwrap()],
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL (mismatch at index 0"), "{out}");
}

fn which(name: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
}

/// A task laid out as kernelbot's own examples are: files shared between tasks one directory
/// up (`../eval.py`), a template, the submission's slot anywhere in the list.
#[test]
fn submit_reads_kernelbots_layout_and_builds_its_config() {
    if need_python().is_none() {
        return;
    }
    let bins = local_bins!();
    let scratch = tempfile::tempdir().unwrap();
    let root = scratch.path().join("examples");
    let src = examples_dir().join("prefixsum_py");
    std::fs::create_dir_all(root.join("scan_py")).unwrap();
    std::fs::copy(src.join("eval.py"), root.join("eval.py")).unwrap();
    std::fs::copy(src.join("reference.py"), root.join("scan_py/reference.py")).unwrap();
    std::fs::copy(src.join("template.py"), root.join("template.py")).unwrap();
    std::fs::write(
        root.join("scan_py/task.yml"),
        "files:\n  - {\"name\": \"submission.py\", \"source\": \"@SUBMISSION@\"}\n  - {\"name\": \"reference.py\", \"source\": \"reference.py\"}\n  - {\"name\": \"eval.py\", \"source\": \"../eval.py\"}\nlang: \"py\"\ndescription: A scan.\nconfig:\n  main: \"eval.py\"\ntemplates:\n  Python: \"../template.py\"\ntests:\n  - {\"size\": 17, \"seed\": 4242}\n  - {\"size\": 018, \"seed\": 1_000}\nbenchmarks:\n  - {\"size\": 100, \"seed\": 3}\n",
    )
    .unwrap();
    let sub = src.join("submission.py");
    let dir = root.join("scan_py");
    let args = [
        "--task",
        dir.to_str().unwrap(),
        "--submission",
        sub.to_str().unwrap(),
        "--mode",
        "benchmark",
    ];
    // The config, key for key as kernelbot's build_task_config: `018` and `1_000` are YAML 1.1
    // integers (PyYAML), and `ranking_by` defaults to `last`.
    let (code, out, err) = submit(
        &bins,
        scratch.path(),
        &[&args[..], &["--print-config"]].concat(),
    );
    assert_eq!(code, 0, "{err}");
    let cfg: Value = serde_json::from_str(&out).unwrap();
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
        cfg["tests"],
        json!([{"size": 17, "seed": 4242}, {"size": "018", "seed": 1000}])
    );
    assert_eq!(cfg["ranking_by"], "last");
    assert_eq!(
        cfg["sources"]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        ["submission.py", "reference.py", "eval.py"]
    );
    let (code, out, err) = submit(&bins, scratch.path(), &args);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("benchmark  size: 100; seed: 3"), "{out}");
}

#[test]
fn submit_refuses_what_is_not_a_task_or_a_submission() {
    let bins = local_bins!();
    let scratch = tempfile::tempdir().unwrap();
    let task = examples_dir().join("prefixsum_py");
    let (code, _, err) = submit(
        &bins,
        scratch.path(),
        &[
            "--task",
            scratch.path().to_str().unwrap(),
            "--submission",
            "x.py",
        ],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("task.yml"), "{err}");
    let bad = scratch.path().join("bad.py");
    std::fs::write(&bad, [0xff, 0xfe, 0x00]).unwrap();
    let (code, _, err) = submit(
        &bins,
        scratch.path(),
        &[
            "--task",
            task.to_str().unwrap(),
            "--submission",
            bad.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not UTF-8"), "{err}");
}

/// The service as a process: `kernelkite-service local`, on a port of its own.
struct Served {
    child: std::process::Child,
    base: String,
    log: std::path::PathBuf,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            eprintln!("--- service log {} ---\n{log}", self.log.display());
        }
    }
}

/// Starts `kernelkite-service local` on a port the kernel picks (`--listen 127.0.0.1:0`) and
/// reads the bound address from its log, so that two tests (or a test and any other process)
/// can never race for one port between a probe and the service's bind.
fn serve_local(bins: &Bins, scratch: &Path, data: &Path, token: Option<&str>) -> Served {
    let env: Vec<(&str, &str)> = token
        .map(|t| ("KERNELKITE_API_TOKEN", t))
        .into_iter()
        .collect();
    serve_local_with(bins, scratch, data, "off", &[], &env)
}

/// [`serve_local`] with `--sandbox sandbox`, `extra` flags and `env`.
fn serve_local_with(
    bins: &Bins,
    scratch: &Path,
    data: &Path,
    sandbox: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Served {
    let log = tempfile::Builder::new()
        .prefix("service-")
        .suffix(".log")
        .tempfile_in(scratch)
        .unwrap()
        .into_temp_path()
        .keep()
        .unwrap();
    let mut c = service(bins);
    c.args(["local", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data)
        .args(local_flags(bins, scratch, sandbox))
        .args(extra)
        .envs(env.iter().copied())
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let child = c.spawn().unwrap();
    let mut served = Served {
        child,
        base: String::new(),
        log,
    };
    let start = Instant::now();
    served.base = loop {
        let text = std::fs::read_to_string(&served.log).unwrap_or_default();
        if let Some(addr) = kernelkite_testkit::service_process::bound_addr(&text) {
            break format!("http://{addr}");
        }
        if let Ok(Some(status)) = served.child.try_wait() {
            panic!("the service exited before listening ({status}):\n{text}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the service did not start:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    served
}

#[test]
fn submit_talks_to_a_running_service_with_its_token() {
    if need_python().is_none() {
        return;
    }
    let bins = local_bins!();
    let scratch = tempfile::tempdir().unwrap();
    let data = scratch.path().join("data");
    let served = serve_local(&bins, scratch.path(), &data, Some("s3cret"));
    let task = examples_dir().join("prefixsum_py");
    let sub = task.join("submission.py");
    let base = [
        "--task",
        task.to_str().unwrap(),
        "--submission",
        sub.to_str().unwrap(),
        "--server",
        &served.base,
    ];
    let out = service(&bins)
        .arg("submit")
        .args(base)
        .args(["--token", "s3cret", "--json"])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    let v: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["state"], "succeeded");
    assert_eq!(v["result"]["runs"]["test"]["run"]["passed"], true);
    // Where it ran: the runner's provenance.json, taken from the job's directory.
    let p = &v["provenance"];
    assert_eq!(p["format"], 1, "{v}");
    assert_eq!(p["node"], v["result"]["system"]["hostname"], "{v}");
    assert_eq!(p["queue"], v["queue"], "{v}");
    assert_eq!(p["slice"]["index"], 0, "{v}");
    assert_eq!(p["kernelkite_version"], env!("CARGO_PKG_VERSION"), "{v}");
    // Local mode names its slices' agents as an agent per slice would be named.
    assert_eq!(
        p["agent"],
        format!("local-{}-0", p["node"].as_str().unwrap_or_default()),
        "{v}"
    );
    // Without the token: refused, no result (exit 3), the reason shown.
    let out = service(&bins).arg("submit").args(base).output().unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("401"), "{stderr}");
}

#[test]
#[ignore = "full tier (scripts/test.sh runs it): the service killed with SIGKILL"]
fn a_service_killed_mid_run_delivers_every_result_after_its_restart() {
    if need_python().is_none() {
        return;
    }
    let bins = local_bins!();
    let scratch = tempfile::tempdir().unwrap();
    let data = scratch.path().join("data");
    let marker = scratch.path().join("starts");
    let served = serve_local(&bins, scratch.path(), &data, None);
    let probe = |sleep: u64| {
        kernelkite_testkit::local::probe_config(
            "test",
            json!([{"sleep_ms": sleep, "marker": marker.to_str().unwrap()}]),
        )
    };
    let running = http(
        "POST",
        &format!("{}/v1/submissions", served.base),
        Some(json!({"config": probe(1500), "queue": "local"})),
    );
    let queued = http(
        "POST",
        &format!("{}/v1/submissions", served.base),
        Some(json!({"config": probe(10), "queue": "local"})),
    );
    let ids = [
        running["id"].as_str().unwrap().to_string(),
        queued["id"].as_str().unwrap().to_string(),
    ];
    let start = Instant::now();
    while std::fs::read_to_string(&marker)
        .unwrap_or_default()
        .lines()
        .count()
        < 1
    {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the first job never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(served); // SIGKILL: no shutdown, the job's processes live on
    let served = serve_local(&bins, scratch.path(), &data, None);
    for id in &ids {
        let v = http(
            "GET",
            &format!("{}/v1/submissions/{id}?wait=60", served.base),
            None,
        );
        assert_eq!(v["state"], "succeeded", "{v}");
        assert_eq!(v["result"]["runs"]["test"]["run"]["passed"], true, "{v}");
    }
}

#[test]
fn local_jobs_run_in_the_sandbox_the_submission_as_its_own_uid() {
    if need_python().is_none() {
        return;
    }
    if !kernelkite_testkit::local::is_root() {
        kernelkite_testkit::skip("the sandbox needs root");
        return;
    }
    // The job user runs Python, which must be reachable for it (a python under /root, as
    // pyenv installs it, is not). The runner is wherever this clone is (under /var/tmp, in
    // /root): the sandbox binds it into the job.
    let python = Path::new("/usr/bin/python3");
    let bins = local_bins!();
    if let Some(blocked) = kernelkite_testkit::users::out_of_the_job_users_reach(python) {
        kernelkite_testkit::skip(format!(
            "{} is not reachable by another user (through {})",
            python.display(),
            blocked.display()
        ));
        return;
    }
    let user = kernelkite_testkit::users::TestUser::new("loc");
    let scratch = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        scratch.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let data = scratch.path().join("data");
    let config = json!({"allow-unenforced": true, "user": user.name}).to_string();
    let served = serve_local_with(
        &bins,
        scratch.path(),
        &data,
        "on",
        &["--plugin-config", &config],
        &[("KERNELKITE_PYTHON", "/usr/bin/python3")],
    );
    let probe = kernelkite_testkit::local::probe_config("test", json!([{"sleep_ms": 1}]));
    let v = http(
        "POST",
        &format!("{}/v1/submissions", served.base),
        Some(json!({"config": probe, "queue": "local"})),
    );
    let id = v["id"].as_str().unwrap().to_string();
    let v = http(
        "GET",
        &format!("{}/v1/submissions/{id}?wait=60", served.base),
        None,
    );
    assert_eq!(v["state"], "succeeded", "{v}");
    let run = &v["result"]["runs"]["test"]["run"];
    assert_eq!(run["passed"], true, "{v}");
    // The runner ran as the job user, the submission it evaluated as slice 0's submission
    // identity: another uid.
    assert_eq!(
        run["result"]["probe.0.uid"],
        kernelkite_hooks::sandbox::user::SUBMISSION_ID_BASE.to_string(),
        "the submission ran as slice 0's submission identity: {v}"
    );
    assert_ne!(run["result"]["probe.0.uid"], user.uid.to_string());
    // The provenance comes back out of the sandbox beside the result (the step's artifact
    // paths name both).
    assert_eq!(v["provenance"]["slice"]["index"], 0, "{v}");
    let log = std::fs::read_to_string(&served.log).unwrap();
    assert!(
        log.contains("commands run in the plugin's sandbox"),
        "{log}"
    );
}
