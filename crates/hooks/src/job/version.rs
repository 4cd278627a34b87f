//! The runner version check of the `environment` hook: a job whose step names the runner
//! version the service expects ([`EXPECTED_RUNNER_ENV`]) runs only on a node whose runner is
//! that version. On another node the hook pauses its own agent, so Buildkite dispatches it
//! nothing more for a while, and fails the job with [`kernelkite_sys::node::EXIT_NODE_FAULT`], which the
//! deployment's pipelines retry: the retry goes to another agent.
//!
//! Why the agent pauses itself: Buildkite's automatic retry may dispatch the retry to the same
//! agent, which would refuse it again until the retries run out. A paused agent gets no job
//! (`agent/agent_worker_action.go`: a ping answered `pause` is not a job). The pause lasts
//! [`PAUSE_MINUTES`] and is not renewed: an upgraded node comes back by itself, and one still
//! outdated refuses one more job and pauses again. `buildkite-agent pause` (agent 3.93 and
//! later, `clicommand/agent_pause.go`) sends `POST /v3/pause` with the job's access token
//! (`api/agents.go`), so the hook needs no token of its own.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kernelkite_sys::node::{EXPECTED_RUNNER_ENV, RUNNER_BINARY};

use super::JobError;
use crate::config::Mode;

/// How long a node with another runner stays paused (minutes). Buildkite allows 1 to 10,080.
pub const PAUSE_MINUTES: u32 = 60;

/// The longest note a pause carries (characters): a runner's path and error can be long.
const NOTE_MAX: usize = 250;

/// How long the hook waits for `buildkite-agent pause` (its own retries take up to 5 s).
const PAUSE_WAIT: Duration = Duration::from_secs(15);

/// The runner version a job expects, when its step names one.
pub fn expected(env: &BTreeMap<String, String>) -> Option<&str> {
    env.get(EXPECTED_RUNNER_ENV)
        .map(|v| v.trim())
        .filter(|v| !v.is_empty())
}

/// `major.minor.patch` of a version (`0.1.0`, `0.1.0-rc1`: the numbers before anything else),
/// `None` when it does not start so.
fn numbers(v: &str) -> Option<[u64; 3]> {
    let core = v.split(['-', '+']).next()?;
    let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
    let n = [parts.next()??, parts.next()??, parts.next()??];
    parts.next().is_none().then_some(n)
}

/// Whether the node's runner `here` is older than `expected`: only then does the node pause
/// itself. A newer node (upgraded before the pipeline agent's setting) refuses the job without
/// pausing, so it takes jobs again the moment the setting follows; an expectation that is not
/// a version pauses nothing either.
pub fn is_older(here: &str, expected: &str) -> bool {
    matches!((numbers(here), numbers(expected)), (Some(h), Some(e)) if h < e)
}

/// The node's runner: `KERNELKITE_RUNNER_BINARY`, else beside the hooks' own binary (setup
/// installs both in `<prefix>/bin`). Never looked up in the job's `PATH`: the hook runs it as
/// root.
pub fn runner_binary(setting: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = setting {
        return Some(p.to_path_buf());
    }
    let exe = std::env::current_exe().ok()?;
    Some(exe.parent()?.join(RUNNER_BINARY))
}

/// The version a `--version` line names (`kernelkite-runner 0.1.0`): its last word.
pub fn parse_version(out: &str) -> Option<String> {
    let line = out.lines().next()?.trim();
    let (name, version) = line.rsplit_once(' ')?;
    (name.trim() == RUNNER_BINARY && !version.is_empty()).then(|| version.to_string())
}

/// The runner's version, from the cache in `run_dir` when the file is the one asked last time
/// (same device, inode, size and modification time), else from the runner itself (then
/// cached). Every job checks the version; asking the runner is a process start (about 2 ms),
/// a stat is microseconds. The run dir is root's, so a job cannot plant an answer.
pub fn installed_cached(path: &Path, run_dir: &Path) -> Result<String, JobError> {
    use std::os::unix::fs::MetadataExt;
    let cache = run_dir.join(VERSION_CACHE);
    // ctime too: a copy that keeps the modification time (`cp -p`) still changes it.
    let key = std::fs::metadata(path).ok().map(|m| {
        format!(
            "{} {} {} {} {} {} {}",
            m.dev(),
            m.ino(),
            m.size(),
            m.mtime(),
            m.mtime_nsec(),
            m.ctime(),
            m.ctime_nsec()
        )
    });
    if let (Some(key), Ok(text)) = (&key, std::fs::read_to_string(&cache)) {
        if let Some((k, v)) = text.trim_end().split_once('\n') {
            if k == key.as_str() && !v.is_empty() {
                return Ok(v.to_string());
            }
        }
    }
    let v = installed(path)?;
    if let Some(key) = key {
        // Best effort: a run dir that cannot be written costs the next job a process start.
        let tmp = run_dir.join(format!("{VERSION_CACHE}.{}", std::process::id()));
        if std::fs::write(&tmp, format!("{key}\n{v}\n")).is_ok() {
            let _ = std::fs::rename(&tmp, &cache);
        }
    }
    Ok(v)
}

/// The cache's file name under the run dir.
const VERSION_CACHE: &str = "runner-version";

/// Asks the runner at `path` its version.
pub fn installed(path: &Path) -> Result<String, JobError> {
    let unreadable = |why: String| JobError::RunnerVersion {
        path: path.to_path_buf(),
        why,
    };
    let out = Command::new(path)
        .arg("--version")
        .env_clear()
        .stdin(Stdio::null())
        .output()
        .map_err(|e| unreadable(e.to_string()))?;
    if !out.status.success() {
        return Err(unreadable(format!(
            "`--version` exited with {}",
            out.status
        )));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    parse_version(&text).ok_or_else(|| unreadable(format!("`--version` printed {:?}", text.trim())))
}

/// Checks the node's runner against the job's expectation: `Ok(None)` when the step names
/// none, `Ok(Some(version))` when they agree, [`JobError::OutdatedRunner`] when not. In host
/// mode the runner is the node's binary; in docker mode it is the runner image, whose tag the
/// hooks name ([`crate::images`]: the release's own), so the hooks' version is the runner's.
pub fn check(
    env: &BTreeMap<String, String>,
    mode: Mode,
    runner: Option<&Path>,
    run_dir: &Path,
) -> Result<Option<String>, JobError> {
    let Some(want) = expected(env) else {
        return Ok(None);
    };
    let here = match mode {
        Mode::Docker => env!("CARGO_PKG_VERSION").to_string(),
        Mode::Host => {
            let path = runner_binary(runner).ok_or_else(|| JobError::RunnerVersion {
                path: PathBuf::from(RUNNER_BINARY),
                why: "the hooks' own binary has no directory".into(),
            })?;
            installed_cached(&path, run_dir)?
        }
    };
    if here == want {
        Ok(Some(here))
    } else {
        Err(JobError::OutdatedRunner {
            here,
            expected: want.to_string(),
        })
    }
}

/// The note a node's pause carries: what it runs and what the job wanted.
pub fn pause_note(here: &str, expected: &str) -> String {
    format!("kernelkite: runner {here} here, jobs expect {expected}; upgrade the node (kernelkite-isolate setup)")
}

/// Pauses this job's agent through `buildkite-agent pause` (found in `BUILDKITE_BIN_PATH`,
/// which the agent sets for every job), with the job's access token. Returns what to say in
/// the job's log.
pub fn pause_agent(env: &BTreeMap<String, String>, note: &str) -> String {
    let (Some(bin), Some(token), Some(endpoint)) = (
        env.get("BUILDKITE_BIN_PATH")
            .filter(|v| Path::new(v.as_str()).is_absolute()),
        env.get("BUILDKITE_AGENT_ACCESS_TOKEN")
            .filter(|v| !v.is_empty()),
        env.get("BUILDKITE_AGENT_ENDPOINT")
            .filter(|v| !v.is_empty()),
    ) else {
        return "this agent is not paused: the job has no absolute BUILDKITE_BIN_PATH, BUILDKITE_AGENT_ACCESS_TOKEN or BUILDKITE_AGENT_ENDPOINT (not run by a Buildkite agent)".into();
    };
    let agent = Path::new(bin).join("buildkite-agent");
    let note: String = note.chars().take(NOTE_MAX).collect();
    let child = Command::new(&agent)
        .args(["pause", "--note", &note, "--timeout-in-minutes"])
        .arg(PAUSE_MINUTES.to_string())
        .env_clear()
        .env("BUILDKITE_AGENT_ACCESS_TOKEN", token)
        .env("BUILDKITE_AGENT_ENDPOINT", endpoint)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            return format!(
                "could not run {} pause: {e}; the retry may land here again",
                agent.display()
            )
        }
    };
    let deadline = Instant::now() + PAUSE_WAIT;
    loop {
        match child.try_wait() {
            Ok(Some(s)) if s.success() => {
                return format!(
                    "paused this agent for {PAUSE_MINUTES} min (buildkite-agent pause): Buildkite sends the retry elsewhere"
                )
            }
            Ok(Some(s)) => {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    use std::io::Read as _;
                    let _ = (&mut e).take(4096).read_to_string(&mut err);
                }
                return format!(
                    "buildkite-agent pause failed ({s}): {}; the retry may land here again (agent 3.93 or later pauses)",
                    err.trim()
                );
            }
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return "buildkite-agent pause did not answer in time; the retry may land here again".into();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    #[test]
    fn the_version_is_the_last_word_of_the_runner_s_line() {
        assert_eq!(
            parse_version("kernelkite-runner 0.1.0\n").as_deref(),
            Some("0.1.0")
        );
        assert_eq!(parse_version("something-else 0.1.0"), None);
        assert_eq!(parse_version(""), None);
        assert_eq!(parse_version("kernelkite-runner"), None);
    }

    #[test]
    fn only_a_node_older_than_expected_pauses() {
        assert!(is_older("0.0.9", "0.1.0"));
        assert!(is_older("0.1.0", "1.0.0-rc1"));
        assert!(!is_older("0.2.0", "0.1.0"));
        assert!(!is_older("0.1.0", "0.1.0"));
        assert!(!is_older("0.1.0", "x"));
        assert!(!is_older("0.1.0", "0.1"));
        assert!(!is_older("0.1.0", "0.1.0.0"));
    }

    #[test]
    fn a_job_naming_no_version_is_not_checked() {
        let missing = Path::new("/nonexistent/kernelkite-runner");
        assert!(check(
            &env(&[]),
            Mode::Host,
            Some(missing),
            Path::new("/nonexistent")
        )
        .unwrap()
        .is_none());
        assert!(check(
            &env(&[(EXPECTED_RUNNER_ENV, " ")]),
            Mode::Host,
            Some(missing),
            Path::new("/nonexistent"),
        )
        .unwrap()
        .is_none());
    }

    #[test]
    fn another_runner_version_is_refused_and_the_same_one_passes() {
        let dir = tempfile::tempdir().unwrap();
        let old = script(dir.path(), "old", "echo kernelkite-runner 0.0.9");
        let e = check(
            &env(&[(EXPECTED_RUNNER_ENV, "0.1.0")]),
            Mode::Host,
            Some(&old),
            dir.path(),
        )
        .unwrap_err();
        let JobError::OutdatedRunner { here, expected } = &e else {
            panic!("{e}")
        };
        assert_eq!((here.as_str(), expected.as_str()), ("0.0.9", "0.1.0"));
        assert!(e.to_string().contains("0.0.9") && e.to_string().contains("0.1.0"));
        let same = script(dir.path(), "same", "echo kernelkite-runner 0.1.0");
        assert_eq!(
            check(
                &env(&[(EXPECTED_RUNNER_ENV, "0.1.0")]),
                Mode::Host,
                Some(&same),
                dir.path(),
            )
            .unwrap()
            .as_deref(),
            Some("0.1.0")
        );
    }

    #[test]
    fn the_version_is_asked_once_per_runner_file_and_asked_again_when_it_changes() {
        let dir = tempfile::tempdir().unwrap();
        let count = dir.path().join("asked");
        let runner = script(
            dir.path(),
            "runner",
            &format!(
                "echo x >> {}; echo kernelkite-runner 0.1.0",
                count.display()
            ),
        );
        let asked = || {
            std::fs::read_to_string(&count)
                .unwrap_or_default()
                .lines()
                .count()
        };
        for _ in 0..3 {
            assert_eq!(installed_cached(&runner, dir.path()).unwrap(), "0.1.0");
        }
        assert_eq!(asked(), 1);
        // Replaced (an upgrade): another file, asked again.
        let new = dir.path().join("new");
        std::fs::write(
            &new,
            format!(
                "#!/bin/sh\necho x >> {}; echo kernelkite-runner 0.2.0\n",
                count.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&new, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::rename(&new, &runner).unwrap();
        assert_eq!(installed_cached(&runner, dir.path()).unwrap(), "0.2.0");
        assert_eq!(asked(), 2);
        // A cache that names another file is not believed.
        std::fs::write(dir.path().join(VERSION_CACHE), "0 0 0 0 0\n9.9.9\n").unwrap();
        assert_eq!(installed_cached(&runner, dir.path()).unwrap(), "0.2.0");
    }

    #[test]
    fn in_docker_mode_the_image_the_hooks_name_is_the_runner() {
        let missing = Path::new("/nonexistent/kernelkite-runner");
        let mine = env!("CARGO_PKG_VERSION");
        assert_eq!(
            check(
                &env(&[(EXPECTED_RUNNER_ENV, mine)]),
                Mode::Docker,
                Some(missing),
                Path::new("/nonexistent"),
            )
            .unwrap()
            .as_deref(),
            Some(mine)
        );
        let e = check(
            &env(&[(EXPECTED_RUNNER_ENV, "99.0.0")]),
            Mode::Docker,
            Some(missing),
            Path::new("/nonexistent"),
        )
        .unwrap_err();
        assert!(matches!(e, JobError::OutdatedRunner { .. }), "{e}");
    }

    #[test]
    fn a_runner_that_cannot_say_its_version_fails_the_job_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let broken = script(dir.path(), "broken", "echo nonsense");
        let e = check(
            &env(&[(EXPECTED_RUNNER_ENV, "0.1.0")]),
            Mode::Host,
            Some(&broken),
            dir.path(),
        )
        .unwrap_err();
        assert!(matches!(e, JobError::RunnerVersion { .. }), "{e}");
        assert!(e.to_string().contains("broken"), "{e}");
        let gone = dir.path().join("gone");
        let e = check(
            &env(&[(EXPECTED_RUNNER_ENV, "0.1.0")]),
            Mode::Host,
            Some(&gone),
            dir.path(),
        )
        .unwrap_err();
        assert!(matches!(e, JobError::RunnerVersion { .. }), "{e}");
    }

    #[test]
    fn the_agent_is_paused_with_the_job_s_token_and_the_note() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("args");
        script(
            dir.path(),
            "buildkite-agent",
            &format!(
                "printf '%s\\n' \"$@\" \"token=$BUILDKITE_AGENT_ACCESS_TOKEN\" \"endpoint=$BUILDKITE_AGENT_ENDPOINT\" \"other=$OTHER\" > {}",
                log.display()
            ),
        );
        let e = env(&[
            ("BUILDKITE_BIN_PATH", dir.path().to_str().unwrap()),
            ("BUILDKITE_AGENT_ACCESS_TOKEN", "job-token"),
            ("BUILDKITE_AGENT_ENDPOINT", "http://127.0.0.1:1/v3"),
            ("OTHER", "not passed on"),
        ]);
        let said = pause_agent(&e, &pause_note("0.0.9", "0.1.0"));
        assert!(said.starts_with("paused this agent"), "{said}");
        let args = std::fs::read_to_string(&log).unwrap();
        let lines: Vec<&str> = args.lines().collect();
        assert_eq!(lines[0], "pause");
        assert_eq!(lines[1], "--note");
        assert!(lines[2].contains("runner 0.0.9 here"), "{args}");
        assert_eq!(lines[3..5], ["--timeout-in-minutes", "60"]);
        assert!(
            lines.contains(&"token=job-token") && lines.contains(&"other="),
            "{args}"
        );
    }

    #[test]
    fn a_pause_that_fails_or_cannot_run_is_said_and_does_not_hang() {
        let dir = tempfile::tempdir().unwrap();
        script(
            dir.path(),
            "buildkite-agent",
            "echo 'unknown command pause' >&2; exit 1",
        );
        let e = env(&[
            ("BUILDKITE_BIN_PATH", dir.path().to_str().unwrap()),
            ("BUILDKITE_AGENT_ACCESS_TOKEN", "t"),
            ("BUILDKITE_AGENT_ENDPOINT", "http://127.0.0.1:1/v3"),
        ]);
        let said = pause_agent(&e, "n");
        assert!(
            said.contains("failed") && said.contains("unknown command pause"),
            "{said}"
        );
        let said = pause_agent(&env(&[]), "n");
        assert!(said.contains("not paused"), "{said}");
    }
}
