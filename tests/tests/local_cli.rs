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

/// A canary task whose timing the test controls: the bundled prefix sum's harness, one small
/// benchmark, and a submission that sleeps 10 ms a call, or 12 ms (20% slower) on the slice
/// `control`'s `slow_slice` names (the slice it runs on is in `KERNELKITE_SLICE`).
fn controlled_canary(dir: &Path, control: &Path) {
    let example = examples_dir().join("prefixsum_py");
    for f in ["eval.py", "reference.py"] {
        std::fs::copy(example.join(f), dir.join(f)).unwrap();
    }
    std::fs::write(
        dir.join("task.yml"),
        "files:\n  - {name: \"submission.py\", source: \"@SUBMISSION@\"}\n  - {name: \"reference.py\", source: \"reference.py\"}\n  - {name: \"eval.py\", source: \"eval.py\"}\nlang: \"py\"\ndescription: \"a canary whose timing the test controls\"\nconfig:\n  main: \"eval.py\"\ntests:\n  - {size: 8, seed: 1}\nbenchmarks:\n  - {size: 8, seed: 2}\nranking_by: \"geom\"\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("submission.py"),
        format!(
            "import json, os, time\n\
             def custom_kernel(data):\n\
             \x20   me = json.loads(os.environ.get('KERNELKITE_SLICE', '{{}}')).get('index')\n\
             \x20   slow = json.load(open({:?})).get('slow_slice')\n\
             \x20   time.sleep(0.012 if me == slow else 0.010)\n\
             \x20   total, out = 0, []\n\
             \x20   for x in data:\n\
             \x20       total += x\n\
             \x20       out.append(total)\n\
             \x20   return out\n",
            control.display().to_string()
        ),
    )
    .unwrap();
}

/// Canaries and quarantine end to end in local mode (issue 39): two slices run the canary when
/// they join; the one whose canary is 20% slower is quarantined, with the evidence shown;
/// ranked runs then go only to the healthy slice while test runs may still use the other;
/// once its canary is fast again, an operator's canary releases it; and an operator can take
/// a slice out and put it back. Every claim is read from what a user sees: the API's fleet
/// and each submission's provenance (which slice it ran on).
#[test]
fn a_slow_slice_is_quarantined_ranks_nothing_and_is_released_by_a_passing_canary() {
    if need_python().is_none() {
        return;
    }
    let bins = local_bins!();
    let scratch = tempfile::tempdir().unwrap();
    let data = scratch.path().join("data");
    let task = scratch.path().join("canary");
    std::fs::create_dir_all(&task).unwrap();
    let control = scratch.path().join("control.json");
    std::fs::write(&control, r#"{"slow_slice": 1}"#).unwrap();
    controlled_canary(&task, &control);
    let task_arg = task.to_str().unwrap().to_string();
    // Two CPU-only slices on a machine of two cores: none kept for housekeeping.
    let served = serve_local_with(
        &bins,
        scratch.path(),
        &data,
        "off",
        &[
            "--cpu-only-slices",
            "2",
            "--canary",
            "true",
            "--canary-task",
            &task_arg,
        ],
        &[("KERNELKITE_HOUSEKEEPING_CORES", "0")],
    );
    let fleet = || http("GET", &format!("{}/v1/fleet", served.base), None);
    let slice = |f: &Value, i: usize| f["slices"][i].clone();
    let wait_for = |what: &str, ok: &dyn Fn(&Value) -> bool| -> Value {
        let start = Instant::now();
        loop {
            let f = fleet();
            if ok(&f) {
                return f;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{what}: {f:#}\n{}",
                std::fs::read_to_string(&served.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    // Each slice's canary is compared with the other's (the first to end is compared once the
    // other has a score: it runs again then).
    let f = wait_for("the slow slice's quarantine", &|f| {
        f["slices"].as_array().is_some_and(|s| {
            s.len() == 2
                && s.iter().all(|x| !x["canary"].is_null())
                && !s[1]["quarantine"].is_null()
        })
    });
    let (healthy, slow) = (slice(&f, 0), slice(&f, 1));
    assert_eq!(healthy["index"], 0, "{f:#}");
    assert_eq!(healthy["canary"]["verdict"], "pass", "{f:#}");
    assert!(healthy["quarantine"].is_null(), "{f:#}");
    assert_eq!(slow["index"], 1, "{f:#}");
    assert_eq!(slow["canary"]["verdict"], "slow", "{f:#}");
    let ratio = slow["canary"]["ratio"].as_f64().unwrap();
    assert!(
        (1.05..1.15).contains(&ratio),
        "20% slower than the other: {ratio} over the median of two"
    );
    assert_eq!(slow["state"], "quarantined");
    let q = &slow["quarantine"];
    assert_eq!(q["cause"], "canary", "{f:#}");
    assert!(
        q["reason"]
            .as_str()
            .unwrap()
            .contains("slower than its GPU model's median"),
        "{q}"
    );
    assert_eq!(q["evidence"], slow["canary"]["submission"]);
    assert_eq!(f["totals"]["quarantined"], 1);
    let slow_id = slow["id"].as_str().unwrap().to_string();

    // Ranked runs and test runs, all at once: the ranked ones run on the healthy slice only.
    let config = |mode: &str| {
        let out = service(&bins)
            .args(["submit", "--task"])
            .arg(examples_dir().join("prefixsum_py"))
            .arg("--submission")
            .arg(examples_dir().join("prefixsum_py/submission.py"))
            .args(["--mode", mode, "--print-config"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{:?}", text(&out));
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    };
    let test_config = config("test");
    let mut ranked = Vec::new();
    let mut tests = Vec::new();
    for i in 0..4 {
        for (priority, ids) in [("ranked", &mut ranked), ("test", &mut tests)] {
            let mut c = test_config.clone();
            c["seed"] = json!(1000 + i);
            let v = http(
                "POST",
                &format!("{}/v1/submissions", served.base),
                Some(json!({"config": c, "queue": "local", "priority": priority, "cache": false})),
            );
            ids.push(
                v["id"]
                    .as_str()
                    .unwrap_or_else(|| panic!("{v}"))
                    .to_string(),
            );
        }
    }
    let ran_on = |id: &str| -> u64 {
        let v = http(
            "GET",
            &format!("{}/v1/submissions/{id}?wait=60", served.base),
            None,
        );
        assert_eq!(v["state"], "succeeded", "{v}");
        v["provenance"]["slice"]["index"]
            .as_u64()
            .unwrap_or_else(|| panic!("{v}"))
    };
    for id in &ranked {
        assert_eq!(ran_on(id), 0, "a ranked run on the quarantined slice: {id}");
    }
    let test_slices: Vec<u64> = tests.iter().map(|id| ran_on(id)).collect();
    assert!(
        test_slices.contains(&1),
        "test runs may use the quarantined slice, and one did: {test_slices:?}"
    );

    // Fast again: an operator asks for a canary, which passes and releases the slice.
    std::fs::write(&control, r#"{"slow_slice": null}"#).unwrap();
    let asked = http(
        "POST",
        &format!("{}/v1/fleet/slices/{slow_id}/canary", served.base),
        Some(json!({})),
    );
    assert_eq!(asked["canary"], "requested", "{asked}");
    let f = wait_for("the passing canary's release", &|f| {
        f["slices"][1]["quarantine"].is_null()
    });
    let s = slice(&f, 1);
    assert_eq!(s["canary"]["verdict"], "pass", "{f:#}");
    let trend = s["canary_trend"].as_array().unwrap();
    assert!(trend.len() >= 2, "a slow canary, then a passing one: {f:#}");
    assert_eq!(s["state"], "idle");
    // Ranked runs may use it again.
    let mut c = test_config.clone();
    c["seed"] = json!(77);
    let a = http(
        "POST",
        &format!("{}/v1/submissions", served.base),
        Some(json!({"config": c.clone(), "queue": "local", "priority": "ranked", "cache": false})),
    );
    c["seed"] = json!(78);
    let b = http(
        "POST",
        &format!("{}/v1/submissions", served.base),
        Some(json!({"config": c, "queue": "local", "priority": "ranked", "cache": false})),
    );
    let mut both = [
        ran_on(a["id"].as_str().unwrap()),
        ran_on(b["id"].as_str().unwrap()),
    ];
    both.sort();
    assert_eq!(
        both,
        [0, 1],
        "two ranked runs at once use both slices again"
    );

    // An operator takes a slice out (maintenance) and puts it back; an unknown slice is a 404
    // with the way to find the right name.
    let out = http(
        "POST",
        &format!("{}/v1/fleet/slices/{slow_id}/quarantine", served.base),
        Some(json!({"reason": "fan replacement"})),
    );
    assert_eq!(out["quarantined"], true, "{out}");
    let f = fleet();
    assert_eq!(f["slices"][1]["quarantine"]["cause"], "operator", "{f:#}");
    let unknown = http(
        "POST",
        &format!("{}/v1/fleet/slices/no-such-agent/quarantine", served.base),
        Some(json!({"reason": "x"})),
    );
    assert!(
        unknown["error"]
            .as_str()
            .is_some_and(|m| m.contains("GET /v1/fleet")),
        "{unknown}"
    );
}
