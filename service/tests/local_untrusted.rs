//! Local mode never follows a job's path: what a hostile job leaves in its checkout (the
//! directory it owns while its command runs) cannot make the service read another file,
//! hang, fill its memory, write where the job chose, or signal a process outside the job.
//!
//! The service here is the real one (HTTP API, store, local executor); the hooks and the runner
//! are small shell scripts that do what the plugin and the runner do for these tests (run the
//! command, write `result.json`) and, as the job, the attack. Each test has its own service and
//! directories. None needs root: the service reads as its own user whatever it reads, so a
//! service that followed the job's link would read the test's private file just the same.
//!
//! Its own test binary: the processes these tests start and signal stay apart from others'.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kernelkite_service::config::Config;
use kernelkite_service::local::{LocalArgs, SandboxChoice};
use kernelkite_testkit::local::{crashable, start_stack, wait_until, LocalStack};
use kernelkite_testkit::{sample_config, sample_result_json};
use serde_json::Value;

/// The plugin's hooks as far as these tests need them: `environment` leases nothing and
/// exports one variable, `command` runs `BUILDKITE_COMMAND` (the runner) as the plugin's does,
/// in the process the service started, and `pre-exit` has nothing to clean.
const HOOKS: &str = r#"#!/bin/sh
case "$1" in
environment)
  echo "kernelkite: job $BUILDKITE_JOB_ID: fake hooks, nothing confined" >&2
  echo "export KKT_SLICE='$BUILDKITE_AGENT_META_DATA_GPU_INDEX'"
  ;;
command)
  exec /bin/sh -c "$BUILDKITE_COMMAND"
  ;;
pre-exit)
  echo "pre-exit: nothing to clean"
  ;;
*)
  echo "no such hook: $1" >&2
  exit 2
  ;;
esac
"#;

/// A result.json whose host name marks it: `marker` appearing in a submission means this
/// file's content reached it.
fn result_marked(marker: &str) -> String {
    sample_result_json().replace("gpu-node-1", marker)
}

/// A service whose jobs' runner is `/bin/sh` running `runner` with `OUT` (the result.json
/// path the service asked for) and `CHECKOUT` (its directory) set; `tweak` adjusts the
/// service's configuration.
struct Setup {
    stack: LocalStack,
    dir: Arc<tempfile::TempDir>,
}

fn write_exe(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
}

fn local_args(dir: &Path, runner: &str) -> LocalArgs {
    let hooks = dir.join("hooks.sh");
    write_exe(&hooks, HOOKS);
    let runner_path = dir.join("runner.sh");
    write_exe(
        &runner_path,
        &format!(
            "#!/bin/sh\n# runner --output OUT --workdir WORK\nOUT=\"$2\"\nCHECKOUT=\"$(dirname \"$OUT\")\"\n{runner}\n"
        ),
    );
    let plan = dir.join("plan.json");
    std::fs::write(
        &plan,
        r#"{"slices":[{"index":0,"cpus":[0],"memory_bytes":1073741824}]}"#,
    )
    .unwrap();
    LocalArgs {
        runner_bin: Some(runner_path),
        isolate_bin: Some(hooks),
        local_dir: Some(dir.join("local")),
        run_dir: Some(dir.join("run")),
        plan_file: Some(plan),
        cpu_only_slices: 1,
        sysfs_root: PathBuf::from("/"),
        cgroup_root: dir.join("no-cgroups"),
        plugin_config: kernelkite_service::local::settings::DEFAULT_PLUGIN_CONFIG.into(),
        enforce: false,
        sandbox: SandboxChoice::Off,
    }
}

async fn setup(runner: &str, tweak: impl FnOnce(&mut Config)) -> Setup {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let args = local_args(dir.path(), runner);
    let stack = start_stack(args, dir.clone(), tweak).await;
    Setup { stack, dir }
}

/// A file only its owner may read, outside every job's directory, holding a usable
/// result.json marked with `marker`.
fn private_file(dir: &Path, marker: &str) -> PathBuf {
    let p = dir.join(format!("{marker}.json"));
    std::fs::write(&p, result_marked(marker)).unwrap();
    std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    p
}

/// Submits the sample run and waits (at most `limit`) for its end: its JSON.
async fn run_one(s: &Setup, limit: Duration) -> Value {
    let id = s.stack.submit(sample_config()).await;
    let v = tokio::time::timeout(limit, s.stack.wait(&id))
        .await
        .unwrap_or_else(|_| panic!("submission {id} did not end within {limit:?}"));
    assert_eq!(
        v["state"], "failed",
        "the attack must end the submission failed: {v}"
    );
    v
}

fn error_of(v: &Value) -> String {
    v["error"].as_str().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_json_linked_to_another_file_is_not_read() {
    let outside = tempfile::tempdir().unwrap();
    let secret = private_file(outside.path(), "SECRET-HOST-LINK");
    let s = setup(&format!("ln -s '{}' \"$OUT\"", secret.display()), |_| {}).await;
    let v = run_one(&s, Duration::from_secs(60)).await;
    let e = error_of(&v);
    assert!(e.contains("result.json is a symbolic link"), "{v}");
    assert!(!v.to_string().contains("SECRET-HOST"), "{v}");

    // A second name (hard link) of the file: a regular file, but not the job's.
    let secret = private_file(outside.path(), "SECRET-HOST-HARD");
    let s = setup(&format!("ln '{}' \"$OUT\"", secret.display()), |_| {}).await;
    let v = run_one(&s, Duration::from_secs(60)).await;
    assert!(error_of(&v).contains("has 2 names (hard links)"), "{v}");
    assert!(!v.to_string().contains("SECRET-HOST"), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_result_json_ends_the_submission_at_once() {
    let s = setup("mkfifo \"$OUT\"", |_| {}).await;
    let id = s.stack.submit(sample_config()).await;
    // A reader that opened the FIFO would wait for a writer that never comes.
    let Ok(v) = tokio::time::timeout(Duration::from_secs(30), s.stack.wait(&id)).await else {
        // Be that writer, so the stuck reader lets this test's runtime end, and fail.
        use std::os::unix::fs::OpenOptionsExt;
        for p in walk(&s.dir.path().join("local/jobs")) {
            if p.ends_with("result.json") {
                let _ = std::fs::OpenOptions::new()
                    .write(true)
                    .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
                    .open(&p);
            }
        }
        panic!("the service is stuck reading a FIFO result.json");
    };
    assert_eq!(v["state"], "failed", "{v}");
    assert!(
        error_of(&v).contains("result.json is a FIFO (named pipe), not a regular file"),
        "{v}"
    );
}

/// Bytes this process has read (`rchar` of `/proc/self/io`, every thread's).
fn bytes_read() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("rchar: ")?.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_sparse_result_json_is_refused_without_being_read() {
    const SIZE: u64 = 1536 << 20;
    let s = setup(&format!("truncate -s {SIZE} \"$OUT\""), |_| {}).await;
    let before = bytes_read();
    let v = run_one(&s, Duration::from_secs(60)).await;
    let read = bytes_read() - before;
    let e = error_of(&v);
    assert!(e.contains(&format!("({SIZE} bytes)")), "{v}");
    assert!(
        e.contains("more than the 67108864 bytes allowed")
            && e.contains("KERNELKITE_MAX_ARTIFACT_BYTES"),
        "the error names the limit: {v}"
    );
    // Nowhere near the file: the cap is 64 MiB, and the file was refused by its size.
    assert!(read < SIZE / 4, "{read} bytes were read");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_services_artifact_cap_is_local_modes_too() {
    let good = tempfile::tempdir().unwrap();
    let result = good.path().join("result.json");
    std::fs::write(&result, result_marked("ok-host")).unwrap();
    let size = std::fs::metadata(&result).unwrap().len();
    // One byte less than the result: refused, naming the configured limit.
    let s = setup(&format!("cp '{}' \"$OUT\"", result.display()), |c| {
        c.max_artifact_bytes = size - 1
    })
    .await;
    let v = run_one(&s, Duration::from_secs(60)).await;
    assert!(
        error_of(&v).contains(&format!("more than the {} bytes allowed", size - 1)),
        "{v}"
    );
    // Exactly the limit: taken.
    let s = setup(&format!("cp '{}' \"$OUT\"", result.display()), |c| {
        c.max_artifact_bytes = size
    })
    .await;
    let id = s.stack.submit(sample_config()).await;
    let v = s.stack.wait(&id).await;
    assert_eq!(v["state"], "succeeded", "{v}");
    assert_eq!(v["result"]["system"]["hostname"], "ok-host", "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_log_link_is_neither_read_nor_written_nor_created() {
    let outside = tempfile::tempdir().unwrap();
    let secret = outside.path().join("root-only.txt");
    std::fs::write(&secret, "SECRET-LOG-TEXT\n").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let created = outside.path().join("made-by-root");
    // The job puts a link where its log used to be (its checkout) and fails without a result,
    // so the service reports its log's end: first to a file it could not read itself, then to
    // a path where nothing is yet.
    let runner = |target: &Path| {
        format!(
            "ln -sf '{}' \"$CHECKOUT/job.log\"\necho 'the runner gave up' >&2\nexit 3",
            target.display()
        )
    };
    let s = setup(&runner(&secret), |_| {}).await;
    let v = run_one(&s, Duration::from_secs(60)).await;
    let e = error_of(&v);
    assert!(e.contains("exit 3"), "{v}");
    // The log is the service's: what the command printed is in it.
    assert!(e.contains("the runner gave up"), "{v}");
    assert!(!e.contains("SECRET-LOG-TEXT"), "{v}");
    assert_eq!(
        std::fs::read_to_string(&secret).unwrap(),
        "SECRET-LOG-TEXT\n",
        "nothing was appended to the link's target"
    );
    let s2 = setup(&runner(&created), |_| {}).await;
    let v = run_one(&s2, Duration::from_secs(60)).await;
    assert!(error_of(&v).contains("the runner gave up"), "{v}");
    assert!(!created.exists(), "the service created the link's target");
    // The service's log lives in the job's directory, the service's alone, not in the
    // checkout.
    let jobs = s.dir.path().join("local/jobs");
    let logs: Vec<PathBuf> = walk(&jobs)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    for log in &logs {
        assert!(
            log.parent().and_then(Path::parent) == Some(jobs.as_path()),
            "{}",
            log.display()
        );
    }
}

/// Every path under `dir` (links not followed).
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            out.extend(walk(&p));
        }
        out.push(p);
    }
    out
}

fn alive(pid: u32) -> bool {
    kernelkite_sys::procfs::is_running(std::path::Path::new("/proc"), pid)
}

fn start_time(pid: u32) -> u64 {
    kernelkite_sys::procfs::read_stat(std::path::Path::new("/proc"), pid)
        .and_then(|s| s.start_time)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_command_pid_signals_nothing_after_a_restart() {
    // The process the job points at: not the job's, and leading a process group of its own,
    // as the command hook does, so that only where the record comes from tells them apart.
    let mut victim = kernelkite_testkit::Sleeper::leader(300);
    let v = victim.id();
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let marks = dir.path().join("marks");
    std::fs::create_dir(&marks).unwrap();
    let result = dir.path().join("good.json");
    std::fs::write(&result, result_marked("second-attempt")).unwrap();
    // Attempt 1 forges the record a previous layout kept in the checkout (`command.pid`) and
    // waits to be interrupted; attempt 2 writes its result.
    let runner = format!(
        r#"case "$CHECKOUT" in
*/attempt-1)
  printf '{{"pid":{v},"start_time":{t}}}' > "$CHECKOUT/command.pid"
  echo $$ > '{marks}/attempt-1'
  exec sleep 600
  ;;
*)
  cp '{result}' "$OUT"
  ;;
esac"#,
        t = start_time(v),
        marks = marks.display(),
        result = result.display(),
    );
    let args = local_args(dir.path(), &runner);
    let first = crashable(args, dir.clone());
    let id = first.submit(sample_config()).await;
    let mark = marks.join("attempt-1");
    wait_until("attempt 1 to run", Duration::from_secs(60), || {
        std::fs::read_to_string(&mark).is_ok_and(|s| s.ends_with('\n'))
    })
    .await;
    let sleeper: u32 = std::fs::read_to_string(&mark)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(alive(sleeper));

    // Kill the service mid-run, and start it again on the same store and directories.
    let second = first.crash_and_restart(&id, "running").await;
    let done = tokio::time::timeout(Duration::from_secs(90), second.wait(&id))
        .await
        .expect("the recovered submission ends");
    let victim_survived = alive(v);
    victim.kill();
    assert!(victim_survived, "the service signalled the forged pid {v}");
    // The attempt the restart interrupted was stopped: its recorded hook (the service's own
    // record) was signalled, with its group.
    wait_until(
        "the interrupted attempt to stop",
        Duration::from_secs(60),
        || !alive(sleeper),
    )
    .await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(
        done["result"]["system"]["hostname"], "second-attempt",
        "{done}"
    );
    assert_eq!(second.local.report(&id).unwrap().attempt, 2);
}
