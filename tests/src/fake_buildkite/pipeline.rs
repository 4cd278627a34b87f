//! Pipelines as Buildkite turns them into jobs: the steps of the pipeline's settings (when a
//! build is created) and the steps an agent uploads (`buildkite-agent pipeline upload`).
//!
//! Two rules matter to kernelkite, and the fake keeps both:
//! - **Interpolation.** The steps in the pipeline's settings are interpolated by Buildkite with a
//!   handful of the build's own variables only ([`SETTINGS_VARIABLES`]); the build's `env` (what
//!   the service sets through the REST API) is not among them, so `${KERNELBOT_QUEUE:-h100}` there
//!   is `h100` for every build. An uploaded pipeline was interpolated by the agent, with the
//!   job's whole environment, before it arrived. See [`interpolate`].
//! - **Targeting.** A command step runs on an agent whose tags match every one of its `agents`
//!   rules; `queue` is `default` when the step names none. See [`Step::runs_on`].
//!
//! Only the step keys kernelkite's pipelines use are understood (command steps: `label`, `key`,
//! `command`/`commands`, `agents`, `plugins`, `env`, `artifact_paths`, `timeout_in_minutes`,
//! `retry.automatic`); a step of another kind, or a key the fake does not know, is refused,
//! so a pipeline never silently means less here than on Buildkite.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

/// The variables Buildkite interpolates in the steps of a pipeline's settings, from the build
/// itself (Buildkite docs, "Environment variables" → "Runtime variable interpolation"; the
/// build's `env` is not among them: it reaches steps only through `pipeline upload`).
pub const SETTINGS_VARIABLES: &[&str] = &[
    "BUILDKITE_BRANCH",
    "BUILDKITE_TAG",
    "BUILDKITE_MESSAGE",
    "BUILDKITE_COMMIT",
    "BUILDKITE_PIPELINE_SLUG",
    "BUILDKITE_PIPELINE_NAME",
    "BUILDKITE_PIPELINE_ID",
    "BUILDKITE_ORGANIZATION_SLUG",
    "BUILDKITE_TRIGGERED_FROM_BUILD_PIPELINE_SLUG",
    "BUILDKITE_REPO",
    "BUILDKITE_PULL_REQUEST",
    "BUILDKITE_PULL_REQUEST_BASE_BRANCH",
    "BUILDKITE_PULL_REQUEST_REPO",
];

/// One automatic retry rule (`retry.automatic`), as Buildkite's retry docs define it
/// (<https://buildkite.com/docs/pipelines/configure/retry>): `exit_status` defaults to `*`,
/// which matches 1 to 255 only (a lost agent's `-1` must be named); `signal` and
/// `signal_reason` default to `*` (any), and `none` matches a job without one; each value may
/// be a list. Each rule counts its own retries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryRule {
    /// The exit statuses it matches (`None`: `*`, 1 to 255).
    pub exit_status: Option<Vec<i64>>,
    /// The signals it matches (`None`: any).
    pub signal: Option<Vec<String>>,
    /// The signal reasons it matches (`None`: any).
    pub signal_reason: Option<Vec<String>>,
    /// How many retries it allows.
    pub limit: u32,
}

fn one_of(want: &Option<Vec<String>>, got: Option<&str>) -> bool {
    match want {
        None => true,
        Some(list) => list.iter().any(|w| match w.as_str() {
            "*" => true,
            "none" => got.is_none(),
            w => got == Some(w),
        }),
    }
}

impl RetryRule {
    /// Whether a job that ended with `exit_status`, `signal` and `signal_reason` is retried by
    /// this rule.
    pub fn matches(
        &self,
        exit_status: i64,
        signal: Option<&str>,
        signal_reason: Option<&str>,
    ) -> bool {
        let status = match &self.exit_status {
            None => (1..=255).contains(&exit_status),
            Some(list) => list.contains(&exit_status),
        };
        status && one_of(&self.signal, signal) && one_of(&self.signal_reason, signal_reason)
    }
}

/// A command step, as the jobs made from it need it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// `label` (or `name`).
    pub label: String,
    /// `key`.
    pub key: Option<String>,
    /// `command` / `commands`, joined by newlines as the agent receives them.
    pub command: String,
    /// `agents`: the tags an agent must have (`queue` defaults to `default`).
    pub agents: BTreeMap<String, String>,
    /// `plugins`, normalized to a list of one-key objects (`BUILDKITE_PLUGINS`).
    pub plugins: Option<Value>,
    /// The pipeline's `env` and the step's, the step's winning.
    pub env: BTreeMap<String, String>,
    /// `artifact_paths`, `;`-joined (`BUILDKITE_ARTIFACT_PATHS`).
    pub artifact_paths: Option<String>,
    /// `timeout_in_minutes`.
    pub timeout_in_minutes: Option<u64>,
    /// `retry.automatic`.
    pub retry: Vec<RetryRule>,
    /// The step as it came (uploaded, or interpolated from the settings), its `signature`
    /// included: what Buildkite gives the agent as the job's `step` (`api/jobs.go`), which an
    /// agent with a verification key checks (`agent/verify_job.go`).
    pub raw: Value,
}

impl Step {
    /// Whether an agent with these tags (`k=v` each) may run the step's jobs.
    pub fn runs_on(&self, tags: &[String]) -> bool {
        let tag = |k: &str| {
            tags.iter()
                .find_map(|t| t.split_once('=').filter(|(tk, _)| *tk == k).map(|(_, v)| v))
        };
        let queue = self.agents.get("queue").map_or("default", String::as_str);
        tag("queue").unwrap_or("default") == queue
            && self
                .agents
                .iter()
                .filter(|(k, _)| k.as_str() != "queue")
                .all(|(k, v)| tag(k).is_some_and(|t| v == "*" || t == v))
    }
}

/// Expands `$NAME`, `${NAME}`, `${NAME:-default}`, `${NAME-default}` (the default itself
/// expanded) and `${NAME?message}` (an error when NAME is unset); `$$` and `\$` are a literal
/// `$`, and a `$` not followed by a name (which starts with a letter) stays as it is. This is the
/// agent's interpolation (`github.com/buildkite/interpolate` v0.1.5, which the agent pins) for
/// the forms pipelines use; substrings (`${NAME:1:2}`) are refused. `lookup` answers `None` for
/// a variable that is not set.
pub fn interpolate(text: &str, lookup: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(['$', '\\']) {
        out.push_str(&rest[..at]);
        let (c, after) = (&rest[at..at + 1], &rest[at + 1..]);
        if c == "\\" {
            // `\$` escapes a `$`; any other backslash is itself.
            match after.strip_prefix('$') {
                Some(tail) => {
                    out.push('$');
                    rest = tail;
                }
                None => {
                    out.push('\\');
                    rest = after;
                }
            }
        } else if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(braced) = after.strip_prefix('{') {
            let end =
                closing_brace(braced).ok_or_else(|| format!("unterminated ${{ in {text:?}"))?;
            out.push_str(&expand(&braced[..end], text, lookup)?);
            rest = &braced[end + 1..];
        } else {
            let len = name_len(after);
            if len == 0 {
                out.push('$');
                rest = after;
                continue;
            }
            out.push_str(&lookup(&after[..len]).unwrap_or_default());
            rest = &after[len..];
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// The length of the variable name `s` starts with (a letter, then letters, digits, `_`).
fn name_len(s: &str) -> usize {
    if !s.starts_with(|c: char| c.is_ascii_alphabetic()) {
        return 0;
    }
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .count()
}

/// Where the `}` closing a `${` is, counting nested `${...}` in a default.
fn closing_brace(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    let bytes = s.as_bytes();
    for (i, b) in bytes.iter().enumerate() {
        match b {
            b'{' if i > 0 && bytes[i - 1] == b'$' => depth += 1,
            b'}' if depth == 0 => return Some(i),
            b'}' => depth -= 1,
            _ => {}
        }
    }
    None
}

/// One `${...}`'s inside.
fn expand(
    inner: &str,
    text: &str,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<String, String> {
    let len = name_len(inner);
    let (name, op) = inner.split_at(len);
    if name.is_empty() {
        return Err(format!("invalid variable name in ${{{inner}}} in {text:?}"));
    }
    let value = lookup(name);
    if op.is_empty() {
        return Ok(value.unwrap_or_default());
    }
    // `:-` takes the default for an empty value too, `-` only for an unset one.
    if let Some(default) = op.strip_prefix(":-") {
        return match value.filter(|v| !v.is_empty()) {
            Some(v) => Ok(v),
            None => interpolate(default, lookup),
        };
    }
    if let Some(default) = op.strip_prefix('-') {
        return match value {
            Some(v) => Ok(v),
            None => interpolate(default, lookup),
        };
    }
    if let Some(message) = op.strip_prefix('?') {
        return value.ok_or_else(|| {
            format!(
                "${name}: {}",
                if message.is_empty() {
                    "not set"
                } else {
                    message
                }
            )
        });
    }
    Err(format!("unsupported expansion ${{{inner}}} in {text:?}"))
}

/// Interpolates every string (keys included) of a parsed pipeline.
pub fn interpolate_value(
    v: &Value,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<Value, String> {
    Ok(match v {
        Value::String(s) => Value::String(interpolate(s, lookup)?),
        Value::Array(a) => Value::Array(
            a.iter()
                .map(|x| interpolate_value(x, lookup))
                .collect::<Result<_, _>>()?,
        ),
        Value::Object(o) => {
            let mut m = Map::new();
            for (k, x) in o {
                m.insert(interpolate(k, lookup)?, interpolate_value(x, lookup)?);
            }
            Value::Object(m)
        }
        other => other.clone(),
    })
}

fn string_of(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// `env` or `agents` (`key`) of `what`: a map of scalars; `agents` may also be a list of
/// `key=value`.
fn pairs_of(v: Option<&Value>, what: &str, key: &str) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    match v {
        None | Some(Value::Null) => {}
        Some(Value::Object(o)) => {
            for (k, x) in o {
                let value =
                    string_of(x).ok_or_else(|| format!("{what}.{key}.{k} is not a scalar"))?;
                out.insert(k.clone(), value);
            }
        }
        Some(Value::Array(a)) if key == "agents" => {
            for x in a {
                let (k, value) = x
                    .as_str()
                    .and_then(|s| s.split_once('='))
                    .ok_or_else(|| format!("{what}.agents entries must be key=value"))?;
                out.insert(k.to_string(), value.to_string());
            }
        }
        Some(_) => return Err(format!("{what}.{key} must be a map")),
    }
    Ok(out)
}

fn env_of(v: Option<&Value>, what: &str) -> Result<BTreeMap<String, String>, String> {
    pairs_of(v, what, "env")
}

fn agents_of(v: Option<&Value>, what: &str) -> Result<BTreeMap<String, String>, String> {
    pairs_of(v, what, "agents")
}

/// `plugins` as the agent receives it: a list of one-key objects (a bare string is a plugin
/// without configuration, `null`).
fn plugins_of(v: Option<&Value>, what: &str) -> Result<Option<Value>, String> {
    let list = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) => a.clone(),
        Some(Value::Object(o)) => o
            .iter()
            .map(|(k, x)| Value::Object(Map::from_iter([(k.clone(), x.clone())])))
            .collect(),
        Some(_) => return Err(format!("{what}.plugins must be a list")),
    };
    let mut out = Vec::new();
    for p in list {
        match p {
            Value::String(s) => out.push(Value::Object(Map::from_iter([(s, Value::Null)]))),
            Value::Object(o) if o.len() == 1 => out.push(Value::Object(o)),
            _ => {
                return Err(format!(
                    "{what}.plugins entries must be a name or a one-key map"
                ))
            }
        }
    }
    Ok(Some(Value::Array(out)))
}

fn retry_of(v: Option<&Value>, what: &str) -> Result<Vec<RetryRule>, String> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let auto = v
        .get("automatic")
        .ok_or_else(|| format!("{what}.retry: only `automatic` is understood"))?;
    let rules = match auto {
        Value::Array(a) => a.clone(),
        Value::Object(_) => vec![auto.clone()],
        Value::Bool(true) => vec![serde_json::json!({"limit": 2})],
        _ => Vec::new(),
    };
    rules
        .iter()
        .map(|r| {
            let exit_status = match r.get("exit_status") {
                None => None,
                Some(Value::String(s)) if s == "*" => None,
                Some(Value::Array(a)) => Some(
                    a.iter()
                        .map(|x| {
                            x.as_i64()
                                .ok_or_else(|| format!("{what}.retry exit_status {x}"))
                        })
                        .collect::<Result<Vec<_>, _>>()?,
                ),
                Some(x) => Some(vec![x
                    .as_i64()
                    .ok_or_else(|| format!("{what}.retry exit_status {x}"))?]),
            };
            let words = |key: &str| -> Result<Option<Vec<String>>, String> {
                match r.get(key) {
                    None => Ok(None),
                    Some(Value::String(s)) => Ok(Some(vec![s.clone()])),
                    Some(Value::Array(a)) => a
                        .iter()
                        .map(|x| {
                            x.as_str()
                                .map(str::to_string)
                                .ok_or_else(|| format!("{what}.retry {key} {x}"))
                        })
                        .collect::<Result<Vec<_>, _>>()
                        .map(Some),
                    Some(x) => Err(format!("{what}.retry {key} {x}")),
                }
            };
            let limit = r.get("limit").and_then(Value::as_u64).unwrap_or(2);
            if limit > 10 {
                return Err(format!("{what}.retry limit {limit}: at most 10"));
            }
            Ok(RetryRule {
                exit_status,
                signal: words("signal")?,
                signal_reason: words("signal_reason")?,
                limit: limit as u32,
            })
        })
        .collect()
}

const STEP_KEYS: &[&str] = &[
    "label",
    "name",
    "key",
    "command",
    "commands",
    "agents",
    "plugins",
    "env",
    "artifact_paths",
    "timeout_in_minutes",
    "retry",
    // `pipeline upload` with a signing key (go-pipeline `signature.SignSteps`): kept in the
    // step given to the agent, never read here.
    "signature",
];

/// The command steps of a parsed pipeline (`{"steps": [...]}`, or a bare list), with the
/// pipeline's `env` and `agents` applied to each.
pub fn steps(pipeline: &Value) -> Result<Vec<Step>, String> {
    let (list, top_env, top_agents) = match pipeline {
        Value::Array(a) => (a.clone(), BTreeMap::new(), BTreeMap::new()),
        Value::Object(o) => (
            o.get("steps")
                .and_then(Value::as_array)
                .cloned()
                .ok_or("the pipeline has no `steps` list")?,
            env_of(o.get("env"), "pipeline")?,
            agents_of(o.get("agents"), "pipeline")?,
        ),
        _ => return Err("a pipeline is a map with `steps`, or a list of steps".into()),
    };
    let mut out = Vec::new();
    for (i, s) in list.iter().enumerate() {
        let what = format!("steps[{i}]");
        let s = match s {
            Value::Object(o) => o,
            _ => return Err(format!("{what} is not a command step")),
        };
        if let Some(k) = s.keys().find(|k| !STEP_KEYS.contains(&k.as_str())) {
            return Err(format!("{what}.{k} is not understood by the fake"));
        }
        let command = match s.get("command").or_else(|| s.get("commands")) {
            Some(Value::String(c)) => c.clone(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| string_of(x).ok_or_else(|| format!("{what}.commands entry")))
                .collect::<Result<Vec<_>, _>>()?
                .join("\n"),
            None => String::new(),
            Some(_) => return Err(format!("{what}.command must be text")),
        };
        let mut env = top_env.clone();
        env.extend(env_of(s.get("env"), &what)?);
        let mut agents = top_agents.clone();
        agents.extend(agents_of(s.get("agents"), &what)?);
        let artifact_paths = match s.get("artifact_paths") {
            None | Some(Value::Null) => None,
            Some(Value::String(p)) => Some(p.clone()),
            Some(Value::Array(a)) => Some(
                a.iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join(";"),
            ),
            Some(_) => return Err(format!("{what}.artifact_paths")),
        };
        out.push(Step {
            label: s
                .get("label")
                .or_else(|| s.get("name"))
                .and_then(string_of)
                .unwrap_or_default(),
            key: s.get("key").and_then(string_of),
            command,
            agents,
            plugins: plugins_of(s.get("plugins"), &what)?,
            env,
            artifact_paths,
            timeout_in_minutes: s.get("timeout_in_minutes").and_then(Value::as_u64),
            retry: retry_of(s.get("retry"), &what)?,
            raw: Value::Object(s.clone()),
        });
    }
    Ok(out)
}

/// The steps of a pipeline's settings (YAML), interpolated as Buildkite does there: with
/// [`SETTINGS_VARIABLES`] only, from `build_vars`.
pub fn settings_steps(
    yaml: &str,
    build_vars: &BTreeMap<String, String>,
) -> Result<Vec<Step>, String> {
    let parsed = kernelkite_service::task::pyyaml::load(yaml).map_err(|e| e.to_string())?;
    let lookup = |name: &str| {
        SETTINGS_VARIABLES
            .contains(&name)
            .then(|| build_vars.get(name).cloned())
            .flatten()
    };
    steps(&interpolate_value(&parsed, &lookup)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn interpolation_expands_defaults_and_escapes() {
        let l = vars(&[("Q", "mi300x"), ("EMPTY", "")]);
        assert_eq!(interpolate("${Q:-h100}", &l).unwrap(), "mi300x");
        assert_eq!(interpolate("${NOPE:-h100}", &l).unwrap(), "h100");
        assert_eq!(interpolate("${EMPTY:-h100}", &l).unwrap(), "h100");
        assert_eq!(interpolate("${EMPTY-h100}", &l).unwrap(), "");
        assert_eq!(
            interpolate("a $Q b $$Q c $NOPE.", &l).unwrap(),
            "a mi300x b $Q c ."
        );
        assert!(interpolate("${Q", &l).is_err());
        assert_eq!(interpolate("${Q?needed}", &l).unwrap(), "mi300x");
        assert_eq!(
            interpolate("${NOPE?needed}", &l).unwrap_err(),
            "$NOPE: needed"
        );
        assert_eq!(interpolate("${NOPE?}", &l).unwrap_err(), "$NOPE: not set");
        // As github.com/buildkite/interpolate v0.1.5 does (run against it).
        assert_eq!(interpolate("\\$Q $_X", &l).unwrap(), "$Q $_X");
        assert_eq!(
            interpolate("${NOPE:-${Q}} ${NOPE:-$Q}", &l).unwrap(),
            "mi300x mi300x"
        );
        assert!(interpolate("${Q:1:2}", &l).is_err());
    }

    #[test]
    fn settings_steps_ignore_the_builds_env_but_not_its_branch() {
        let yaml = "steps:\n  - label: \"run ${KERNELBOT_RUN_ID:-} on ${BUILDKITE_BRANCH}\"\n    command: x\n    agents:\n      queue: \"${KERNELBOT_QUEUE:-h100}\"\n";
        let build: BTreeMap<String, String> = [
            ("KERNELBOT_QUEUE", "mi300x"),
            ("KERNELBOT_RUN_ID", "r1"),
            ("BUILDKITE_BRANCH", "main"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let s = settings_steps(yaml, &build).unwrap();
        assert_eq!(s[0].agents["queue"], "h100");
        assert_eq!(s[0].label, "run  on main");
    }

    #[test]
    fn the_deployment_pipelines_cannot_be_the_settings_steps_but_settings_yml_is() {
        // Pasted as settings steps, host.yml would need the build's queue, which Buildkite does
        // not interpolate there: the build fails instead of running on some default queue.
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deployment/pipelines");
        let build: BTreeMap<String, String> =
            [("KERNELBOT_QUEUE", "mi300x"), ("BUILDKITE_BRANCH", "main")]
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
        for f in ["host.yml", "docker.yml"] {
            let text = std::fs::read_to_string(root.join(f)).unwrap();
            let e = settings_steps(&text, &build).unwrap_err();
            assert!(e.contains("KERNELBOT_QUEUE"), "{f}: {e}");
        }
        let s = settings_steps(
            &std::fs::read_to_string(root.join("settings.yml")).unwrap(),
            &build,
        )
        .unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].agents["queue"], "kernelkite-pipeline");
        assert!(
            s[0].command.starts_with("buildkite-agent pipeline upload"),
            "{}",
            s[0].command
        );
    }

    #[test]
    fn targeting_needs_every_rule_and_the_default_queue() {
        let s = steps(&serde_json::json!({"steps": [{"command": "x", "agents": {"queue": "h100", "gpu-index": "1"}}, {"command": "y"}]})).unwrap();
        let tags = |t: &[&str]| t.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(s[0].runs_on(&tags(&["queue=h100", "gpu-index=1"])));
        assert!(!s[0].runs_on(&tags(&["queue=h100", "gpu-index=0"])));
        assert!(!s[0].runs_on(&tags(&["queue=mi300x", "gpu-index=1"])));
        assert!(s[1].runs_on(&tags(&["node=x"])));
        assert!(!s[1].runs_on(&tags(&["queue=h100"])));
        let any = steps(&serde_json::json!({"steps": [{"command": "x", "agents": {"queue": "h100", "gpu-index": "*"}}]})).unwrap();
        assert!(any[0].runs_on(&tags(&["queue=h100", "gpu-index=3"])));
        assert!(!any[0].runs_on(&tags(&["queue=h100"])), "`*` needs the tag");
    }

    #[test]
    fn the_deployment_pipelines_retry_lost_and_stopped_agents_and_infrastructure_failures_only() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deployment/pipelines");
        for f in ["host.yml", "docker.yml"] {
            let p = kernelkite_service::task::pyyaml::load(
                &std::fs::read_to_string(root.join(f)).unwrap(),
            )
            .unwrap();
            let s = &steps(&p).unwrap()[0];
            let retried = |exit: i64, signal: Option<&str>, reason: Option<&str>| {
                s.retry.iter().any(|r| r.matches(exit, signal, reason))
            };
            assert!(
                retried(3, None, None),
                "{f}: the runner's infrastructure failure"
            );
            assert!(retried(-1, None, None), "{f}: a lost agent");
            // What the agent reports for a job its stopping agent interrupted (agent/run_job.go:
            // the bootstrap re-raises SIGTERM, so the wait status is -1).
            assert!(
                retried(-1, Some("SIGTERM"), Some("agent_stop")),
                "{f}: a stopped agent"
            );
            assert!(
                !retried(-1, Some("SIGTERM"), Some("cancel")),
                "{f}: a cancel"
            );
            assert!(!retried(2, None, None), "{f}: a bad payload");
            assert!(!retried(1, None, None), "{f}: the submission's failure");
        }
    }

    #[test]
    fn a_star_exit_status_is_one_to_255() {
        let s = steps(&serde_json::json!({"steps": [{"command": "x", "retry": {"automatic": [{"signal_reason": "agent_stop", "limit": 1}]}}]})).unwrap();
        assert!(!s[0].retry[0].matches(-1, Some("SIGTERM"), Some("agent_stop")));
        assert!(s[0].retry[0].matches(143, None, Some("agent_stop")));
    }

    #[test]
    fn unknown_step_keys_are_refused() {
        assert!(
            steps(&serde_json::json!({"steps": [{"command": "x", "parallelism": 2}]})).is_err()
        );
        assert!(steps(&serde_json::json!({"steps": [{"wait": null}]})).is_err());
    }
}
