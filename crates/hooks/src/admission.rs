//! What a GPU node's agent checks before a job's bootstrap starts (its `pre-bootstrap` hook):
//! the job's variables as Buildkite handed them over, read from the file the agent writes
//! (`BUILDKITE_ENV_JSON_FILE`), never sourced.
//!
//! Why: a signed step proves its command, plugins and env, but not the rest of the job. The
//! agents accept every `BUILDKITE_*` variable (the allow-list always admits them), and the
//! build's env (whoever creates a build chooses it) is part of the job's. Some of those
//! variables steer what the root bootstrap and these hooks do with paths:
//! `BUILDKITE_BUILD_CHECKOUT_PATH` (the agent keeps a value it is given, removes that directory
//! for a clean checkout and the hooks hand it to the job's user), the artifact upload's
//! destination and settings, and `BUILDKITE_PLUGIN_CONFIGURATION` (which these hooks read).
//! And what a signed step says binds it to no build or queue: the same signature is valid
//! for every build, so a step could be uploaded again, elsewhere, with other unsigned fields
//! (`artifact_paths`, the queue). The deployment's pipeline signs a binding into its env
//! ([`SIGNED_BUILD`], [`SIGNED_QUEUE`]); this checks it.
//!
//! Everything here is pure; [`crate::cli`] reads the file and the node's setting.

use std::collections::BTreeMap;

/// The build a signed step was uploaded for (`deployment/pipelines/host.yml` signs
/// `${BUILDKITE_BUILD_ID}` into its env at upload): must be the job's build.
pub const SIGNED_BUILD: &str = "KERNELBOT_SIGNED_BUILD";

/// The queue a signed step was uploaded for (`${KERNELBOT_QUEUE}`): must be this agent's.
pub const SIGNED_QUEUE: &str = "KERNELBOT_SIGNED_QUEUE";

/// The node's setting (from `agent.env`, which setup writes when the agents verify
/// signatures): `on` refuses a job whose step carries no binding.
pub const SIGNED_STEPS_SETTING: &str = "KERNELKITE_SIGNED_STEPS";

/// Job variables refused outright: Buildkite's backend never sets them, and each steers the
/// root bootstrap or these hooks (see the module's docs).
pub const REFUSED: &[&str] = &[
    "BUILDKITE_BUILD_CHECKOUT_PATH",
    "BUILDKITE_PLUGIN_CONFIGURATION",
];

/// Prefixes of refused job variables: the artifact upload's destination and settings
/// (`clicommand/artifact_upload.go`: the destination, delimiter, symlink handling; the
/// S3, GCS, Artifactory and Azure uploaders' settings). `BUILDKITE_ARTIFACT_PATHS`, which
/// the backend sets from the step, is checked instead ([`artifact_pattern_problem`]).
pub const REFUSED_PREFIXES: &[&str] = &[
    "BUILDKITE_ARTIFACT_",
    "BUILDKITE_AGENT_ARTIFACT_",
    "BUILDKITE_S3_",
    "BUILDKITE_GS_",
    "BUILDKITE_ARTIFACTORY_",
    "BUILDKITE_AZURE_",
];

/// The step's artifact patterns (`;`-separated, as the agent splits them with its default
/// delimiter, which a job cannot change: [`REFUSED_PREFIXES`]).
pub const ARTIFACT_PATHS: &str = "BUILDKITE_ARTIFACT_PATHS";

/// Why an artifact pattern is refused, if it is: the agent (root) uploads what it matches,
/// relative to the checkout, so a pattern must stay inside it.
pub fn artifact_pattern_problem(pattern: &str) -> Option<String> {
    let p = pattern.trim();
    if p.starts_with('/') || p.starts_with('~') {
        return Some(format!(
            "artifact pattern {p:?} is not relative to the checkout"
        ));
    }
    if p.split(['/', '\\']).any(|part| part == "..") {
        return Some(format!("artifact pattern {p:?} leaves the checkout (`..`)"));
    }
    None
}

/// Why the job is refused: one line per problem, none when it may start. `signed_steps`: the
/// node verifies signatures ([`SIGNED_STEPS_SETTING`]), so a step without a binding is refused.
pub fn refusals(env: &BTreeMap<String, String>, signed_steps: bool) -> Vec<String> {
    let mut out = Vec::new();
    for name in env.keys() {
        let refused = REFUSED.contains(&name.as_str())
            || (name != ARTIFACT_PATHS && REFUSED_PREFIXES.iter().any(|p| name.starts_with(p)));
        if refused {
            out.push(format!(
                "{name} is set by the job (its build's or step's env): it steers the root bootstrap or the hooks, and Buildkite never sets it"
            ));
        }
    }
    if let Some(paths) = env.get(ARTIFACT_PATHS) {
        out.extend(paths.split(';').filter_map(artifact_pattern_problem));
    }
    let binding = [
        (SIGNED_BUILD, "BUILDKITE_BUILD_ID", "build"),
        (SIGNED_QUEUE, "BUILDKITE_AGENT_META_DATA_QUEUE", "queue"),
    ];
    for (signed, actual, what) in binding {
        match (env.get(signed), env.get(actual)) {
            (Some(s), Some(a)) if s == a => {}
            (Some(s), a) => out.push(format!(
                "the step was signed for {what} {s:?}, and this job's {what} is {:?} ({actual}): a signed step uploaded again elsewhere",
                a.map_or("", String::as_str)
            )),
            (None, _) if signed_steps => out.push(format!(
                "the step carries no {signed}: this node runs only steps signed for their {what} (deployment/pipelines/host.yml signs it)"
            )),
            (None, _) => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const BOUND: &[(&str, &str)] = &[
        ("BUILDKITE_BUILD_ID", "b-1"),
        ("BUILDKITE_AGENT_META_DATA_QUEUE", "h100"),
        ("KERNELBOT_SIGNED_BUILD", "b-1"),
        ("KERNELBOT_SIGNED_QUEUE", "h100"),
        ("BUILDKITE_ARTIFACT_PATHS", "result.json"),
        (
            "BUILDKITE_COMMAND",
            "kernelkite-runner --output result.json",
        ),
    ];

    #[test]
    fn a_bound_job_of_buildkite_s_own_variables_starts() {
        assert!(refusals(&env(BOUND), true).is_empty());
        // Without the node's setting, a step without a binding starts too (signing is off).
        let unbound = env(&[
            ("BUILDKITE_BUILD_ID", "b-1"),
            ("BUILDKITE_ARTIFACT_PATHS", "a/*.json;b.txt"),
        ]);
        assert!(refusals(&unbound, false).is_empty());
        let r = refusals(&unbound, true);
        assert_eq!(r.len(), 2, "{r:?}");
        assert!(r[0].contains("carries no KERNELBOT_SIGNED_BUILD"), "{r:?}");
    }

    #[test]
    fn variables_that_steer_the_bootstrap_are_refused_by_name() {
        for name in [
            "BUILDKITE_BUILD_CHECKOUT_PATH",
            "BUILDKITE_PLUGIN_CONFIGURATION",
            "BUILDKITE_ARTIFACT_UPLOAD_DESTINATION",
            "BUILDKITE_AGENT_ARTIFACT_DELIMITER",
            "BUILDKITE_AGENT_ARTIFACT_SYMLINKS",
            "BUILDKITE_S3_ENDPOINT",
            "BUILDKITE_GS_APPLICATION_CREDENTIALS",
            "BUILDKITE_ARTIFACTORY_URL",
            "BUILDKITE_AZURE_BLOB_CONTAINER_URL",
        ] {
            let mut e = env(BOUND);
            e.insert(name.into(), "/usr".into());
            let r = refusals(&e, true);
            assert_eq!(r.len(), 1, "{name}: {r:?}");
            assert!(r[0].starts_with(name), "{r:?}");
        }
    }

    #[test]
    fn artifact_patterns_stay_in_the_checkout() {
        for bad in [
            "/etc/shadow",
            "~/.ssh/*",
            "../x",
            "a/../../etc/*",
            "a\\..\\b",
        ] {
            assert!(artifact_pattern_problem(bad).is_some(), "{bad}");
        }
        for ok in ["result.json", "out/**/*.log", "a..b", "./x"] {
            assert!(artifact_pattern_problem(ok).is_none(), "{ok}");
        }
        let mut e = env(BOUND);
        e.insert(ARTIFACT_PATHS.into(), "result.json;/etc/shadow".into());
        let r = refusals(&e, true);
        assert_eq!(r.len(), 1, "{r:?}");
        assert!(r[0].contains("/etc/shadow"), "{r:?}");
    }

    #[test]
    fn a_signed_step_uploaded_for_another_build_or_queue_is_refused() {
        let mut e = env(BOUND);
        e.insert("BUILDKITE_BUILD_ID".into(), "b-2".into());
        e.insert("BUILDKITE_AGENT_META_DATA_QUEUE".into(), "h100-x8".into());
        let r = refusals(&e, false);
        assert_eq!(r.len(), 2, "{r:?}");
        assert!(
            r[0].contains("signed for build \"b-1\"") && r[0].contains("\"b-2\""),
            "{r:?}"
        );
        assert!(r[1].contains("signed for queue \"h100\""), "{r:?}");
        e.remove("BUILDKITE_AGENT_META_DATA_QUEUE");
        assert!(refusals(&e, false)[1].contains("is \"\""));
    }
}
