//! Running the plugin's job hooks the way a Buildkite agent runs them: the variables an agent
//! gives every hook, the `environment` hook's exports handed on to the command (as the
//! plugin's hooks hand them on through the agent: `environment --export shell`, evaluated), and the
//! processes behind a job.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::Path;

/// Variables of the service's own environment that never reach a job: the service's secrets,
/// a stale job's variables, and the runner's and hooks' own settings, which the executor sets
/// per job (a `KERNELKITE_PAYLOAD_FILE` left in the service's environment would otherwise make
/// every job evaluate that file).
fn inherited(name: &str) -> bool {
    const RUNNER_SETTINGS: &[&str] = &[
        "KERNELKITE_PYTHON",
        "KERNELKITE_NVCC",
        "KERNELKITE_REQUIRE_GPU",
        "KERNELKITE_TORCH_PROBE",
        "KERNELKITE_DOCKER",
    ];
    if name.starts_with("KERNELKITE_") {
        return RUNNER_SETTINGS.contains(&name);
    }
    !(name.starts_with("BUILDKITE_") || name.starts_with("KERNELBOT_") || name == "BUILDKITE")
}

/// What a job's hooks are told about it.
#[derive(Debug, Clone)]
pub struct HookJob<'a> {
    /// `BUILDKITE_JOB_ID`: unique per attempt, and a valid cgroup name.
    pub job_id: &'a str,
    /// `BUILDKITE_BUILD_ID`.
    pub build_id: &'a str,
    /// `BUILDKITE_BUILD_NUMBER`.
    pub build_number: u64,
    /// `BUILDKITE_AGENT_NAME`.
    pub agent_name: &'a str,
    /// The slice the worker is bound to (`BUILDKITE_AGENT_META_DATA_GPU_INDEX`, the agent tag
    /// the hooks lease by).
    pub slice: u32,
    /// The queue (`BUILDKITE_AGENT_META_DATA_QUEUE`).
    pub queue: &'a str,
    /// `BUILDKITE_PLUGIN_CONFIGURATION`.
    pub plugin_config: &'a serde_json::Map<String, serde_json::Value>,
    /// `BUILDKITE_BUILD_CHECKOUT_PATH`, where the hooks run.
    pub checkout: &'a Path,
    /// `BUILDKITE_COMMAND`.
    pub command: &'a str,
    /// The build's env (the payload carrier, `KERNELBOT_RUN_ID`, ...).
    pub build_env: &'a [(String, String)],
}

/// The environment an agent gives each hook of `job`: its own (here: the service's, less what
/// `inherited` keeps out), the build's env, and the `BUILDKITE_*` variables.
pub fn hook_env(
    service_env: impl IntoIterator<Item = (String, String)>,
    job: &HookJob<'_>,
) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = service_env
        .into_iter()
        .filter(|(k, _)| inherited(k))
        .collect();
    env.extend(job.build_env.iter().cloned());
    let config = serde_json::Value::Object(job.plugin_config.clone());
    let mut set = |k: &str, v: String| {
        env.insert(k.to_string(), v);
    };
    set("BUILDKITE", "true".into());
    set("CI", "true".into());
    set("BUILDKITE_JOB_ID", job.job_id.into());
    set("BUILDKITE_BUILD_ID", job.build_id.into());
    set("BUILDKITE_BUILD_NUMBER", job.build_number.to_string());
    set("BUILDKITE_ORGANIZATION_SLUG", "local".into());
    set("BUILDKITE_PIPELINE_SLUG", "kernelkite-local".into());
    set("BUILDKITE_AGENT_NAME", job.agent_name.into());
    set("BUILDKITE_AGENT_META_DATA_GPU_INDEX", job.slice.to_string());
    set("BUILDKITE_AGENT_META_DATA_QUEUE", job.queue.into());
    set(
        "BUILDKITE_BUILD_CHECKOUT_PATH",
        job.checkout.display().to_string(),
    );
    set("BUILDKITE_COMMAND", job.command.into());
    set("BUILDKITE_PLUGIN_CONFIGURATION", config.to_string());
    set(
        "BUILDKITE_PLUGINS",
        serde_json::json!([{ "kernelkite-local": config }]).to_string(),
    );
    // The agent also flattens each top-level key of a plugin's configuration.
    for (k, v) in job.plugin_config {
        let name = format!(
            "BUILDKITE_PLUGIN_KERNELKITE_{}",
            k.to_uppercase().replace('-', "_")
        );
        let value = match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        set(&name, value);
    }
    env
}

/// The node flags every hook subcommand takes.
pub fn node_args(
    run_dir: &Path,
    plan_file: &Path,
    sysfs_root: &Path,
    cgroup_root: &Path,
) -> Vec<OsString> {
    let mut a = Vec::new();
    for (flag, value) in [
        ("--run-dir", run_dir),
        ("--plan-file", plan_file),
        ("--sysfs-root", sysfs_root),
        ("--cgroup-root", cgroup_root),
    ] {
        a.push(OsString::from(flag));
        a.push(value.as_os_str().to_os_string());
    }
    a
}

/// Single-quotes `v` for a POSIX shell: every byte but `'` is literal inside single quotes.
pub fn shell_quote(v: &str) -> String {
    format!("'{}'", v.replace('\'', r"'\''"))
}

/// The variables in `export NAME='value'` lines, as `kernelkite-isolate environment --export
/// shell` prints them and the local executor evaluates them. Strict: anything else is an error,
/// since a job must not run without the variables that tell it its slice.
pub fn parse_exports(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    let mut rest = text;
    loop {
        rest = rest.trim_start_matches(['\n', ' ', '\t']);
        if rest.is_empty() {
            return Ok(out);
        }
        let Some(after) = rest.strip_prefix("export ") else {
            return Err(format!("not an export line: {:?}", first_line(rest)));
        };
        let Some(eq) = after.find('=') else {
            return Err(format!("export without '=': {:?}", first_line(rest)));
        };
        let name = &after[..eq];
        let valid = name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            return Err(format!("not a variable name: {name:?}"));
        }
        // The value: single-quoted runs and `\'`, up to the end of the line.
        let mut value = String::new();
        let mut s = &after[eq + 1..];
        loop {
            if let Some(q) = s.strip_prefix('\'') {
                let Some(end) = q.find('\'') else {
                    return Err(format!("unterminated quote in the value of {name}"));
                };
                value.push_str(&q[..end]);
                s = &q[end + 1..];
            } else if let Some(q) = s.strip_prefix("\\'") {
                value.push('\'');
                s = q;
            } else if s.is_empty() || s.starts_with('\n') {
                break;
            } else {
                return Err(format!(
                    "unquoted text in the value of {name}: {:?}",
                    first_line(s)
                ));
            }
        }
        out.insert(name.to_string(), value);
        rest = s;
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("")
}

/// A process, told apart from a later one that reuses its pid by its start time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProcessId {
    /// The pid (also its process group: hooks are started as group leaders).
    pub pid: u32,
    /// Start time in clock ticks since boot (`/proc/<pid>/stat` field 22).
    pub start_time: u64,
}

/// `pid`'s state letter and start time, or `None` when it is gone.
fn stat(pid: u32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses; fields resume after the last ')'.
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    let state = fields.next()?.chars().next()?;
    Some((state, fields.nth(18)?.parse().ok()?))
}

/// `pid`'s start time, or `None` when it is gone.
pub fn start_time(pid: u32) -> Option<u64> {
    stat(pid).map(|(_, t)| t)
}

/// Whether the process is still the one recorded and still running (not gone, not a reused
/// pid, not a zombie waiting for a parent that no longer reaps it).
pub fn is_alive(p: ProcessId) -> bool {
    matches!(stat(p.pid), Some((state, t)) if t == p.start_time && state != 'Z' && state != 'X')
}

/// Sends `signal` to process group `pgid` (a hook started as its group's leader).
pub fn signal_group(pgid: u32, signal: rustix::process::Signal) {
    if let Some(pid) = rustix::process::Pid::from_raw(pgid as i32) {
        let _ = rustix::process::kill_process_group(pid, signal);
    }
}

/// Whether any process is left in group `pgid` (the runner outlives a hook killed by a
/// signal, for as long as it takes to stop its harness and write its result).
pub fn group_exists(pgid: u32) -> bool {
    rustix::process::Pid::from_raw(pgid as i32)
        .is_some_and(|pid| rustix::process::test_kill_process_group(pid).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exports_round_trip_the_plugins_quoting() {
        let text =
            "export A='plain'\nexport B='it'\\''s'\nexport C='{\"cpus\":[0,1]}'\nexport D=''\n";
        let e = parse_exports(text).unwrap();
        assert_eq!(e["A"], "plain");
        assert_eq!(e["B"], "it's");
        assert_eq!(e["C"], r#"{"cpus":[0,1]}"#);
        assert_eq!(e["D"], "");
        // A value with a line break stays one value.
        let e = parse_exports("export M='a\nb'\n").unwrap();
        assert_eq!(e["M"], "a\nb");
        for v in ["a", "b c d", "'", "''", "x'y'z", "\\'"] {
            let line = format!("export V={}\n", shell_quote(v));
            assert_eq!(parse_exports(&line).unwrap()["V"], v, "{line}");
        }
        for bad in [
            "echo hi\n",
            "export 1A='x'\n",
            "export A=x\n",
            "export A='x\n",
            "export A\n",
        ] {
            assert!(parse_exports(bad).is_err(), "{bad}");
        }
        assert!(parse_exports("").unwrap().is_empty());
    }

    #[test]
    fn hooks_get_the_agents_variables_and_none_of_the_services_secrets() {
        let cfg = serde_json::json!({"allow-unenforced": true, "gpus": 1});
        let build_env = vec![("KERNELBOT_PAYLOAD".to_string(), "eJw=".to_string())];
        let job = HookJob {
            job_id: "b-1",
            build_id: "b",
            build_number: 7,
            agent_name: "local-host-0",
            slice: 3,
            queue: "local",
            plugin_config: cfg.as_object().unwrap(),
            checkout: Path::new("/tmp/x"),
            command: "true",
            build_env: &build_env,
        };
        let service = [
            ("PATH", "/usr/bin"),
            ("KERNELKITE_API_TOKEN", "secret"),
            ("BUILDKITE_API_TOKEN", "secret"),
            ("KERNELKITE_PAYLOAD_FILE", "/etc/passwd"),
            ("KERNELBOT_PAYLOAD", "stale"),
            ("KERNELKITE_PYTHON", "python3.11"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let env = hook_env(service, &job);
        assert_eq!(env["PATH"], "/usr/bin");
        assert_eq!(env["KERNELKITE_PYTHON"], "python3.11");
        assert_eq!(env["KERNELBOT_PAYLOAD"], "eJw=");
        assert!(!env.values().any(|v| v == "secret" || v == "/etc/passwd"));
        assert_eq!(env["BUILDKITE_AGENT_META_DATA_GPU_INDEX"], "3");
        assert_eq!(env["BUILDKITE_PLUGIN_KERNELKITE_ALLOW_UNENFORCED"], "true");
        let cfg_back: serde_json::Value =
            serde_json::from_str(&env["BUILDKITE_PLUGIN_CONFIGURATION"]).unwrap();
        assert_eq!(cfg_back, cfg);
    }

    #[test]
    fn a_process_is_known_by_pid_and_start_time() {
        let me = std::process::id();
        let t = start_time(me).unwrap();
        assert!(is_alive(ProcessId {
            pid: me,
            start_time: t
        }));
        assert!(!is_alive(ProcessId {
            pid: me,
            start_time: t + 1
        }));
    }
}
