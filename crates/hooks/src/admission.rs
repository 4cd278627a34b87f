//! What a GPU node's agent checks before a job's bootstrap starts (its `pre-bootstrap` hook):
//! the job's variables as Buildkite handed them over, read from the file the agent writes
//! (`BUILDKITE_ENV_JSON_FILE`), never sourced.
//!
//! Why: a signed step proves its command, plugins and env, but not the rest of the job. The
//! agents accept every `BUILDKITE_*` variable (the allow-list always admits them), and the
//! build's env (whoever creates a build chooses it) is part of the job's. Many of those
//! variables steer what the root bootstrap and these hooks do: so a job may carry only the
//! ones Buildkite's backend sets ([`BACKEND_VARIABLES`]), and its artifact patterns must stay
//! in the checkout ([`artifact_pattern_problem`]). And what a signed step says binds it to no build or queue: the same signature is valid
//! for every build, so a step could be uploaded again, elsewhere, with other unsigned fields
//! (`artifact_paths`, the queue). The deployment's pipeline signs a binding into its env
//! ([`SIGNED_BUILD`], [`SIGNED_QUEUE`]); this checks it.
//!
//! Everything here is pure; [`crate::cli`] reads the file and the node's setting.

use std::collections::BTreeMap;

use kernelkite_sys::node::SUBMISSION_ID_ENV;

/// The build a signed step was uploaded for (`deployment/pipelines/host.yml` signs
/// `${BUILDKITE_BUILD_ID}` into its env at upload): must be the job's build.
pub const SIGNED_BUILD: &str = "KERNELBOT_SIGNED_BUILD";

/// The queue a signed step was uploaded for (`${KERNELBOT_QUEUE}`): must be this agent's.
pub const SIGNED_QUEUE: &str = "KERNELBOT_SIGNED_QUEUE";

/// The node's setting (from `agent.env`, which setup writes when the agents verify
/// signatures): `on` refuses a job whose step carries no binding.
pub const SIGNED_STEPS_SETTING: &str = "KERNELKITE_SIGNED_STEPS";

/// The `BUILDKITE_*` variables a job may carry (less the prefix; a trailing `*` is a prefix):
/// those Buildkite's backend sets, describing the build, its source, the step and the agent
/// (<https://buildkite.com/docs/pipelines/configure/environment-variables>). Any other one
/// came from the build's or the step's env, which the agents' allow-lists always admit
/// (`^BUILDKITE_.*$`), and may steer the root bootstrap or the hooks: the checkout path
/// (which the agent keeps, empties for a clean checkout, and the hooks hand to the job's
/// user), the artifact upload's destination, delimiter and globbing, git and its
/// credentials, secrets into variables, the plugin configuration these hooks read, and for
/// `pipeline upload` its dry run, interpolation and signing key. Such a job is refused,
/// naming the variable: should Buildkite start to set another harmless one, it goes here
/// (and in the pipeline agent's hook, `deployment/service/pipeline-agent/hooks/pre-bootstrap`,
/// which a test keeps equal).
pub const BACKEND_VARIABLES: &[&str] = &[
    "AGENT_ID",
    "AGENT_META_DATA_*",
    "AGENT_NAME",
    "BRANCH",
    "BUILD_AUTHOR",
    "BUILD_AUTHOR_EMAIL",
    "BUILD_CREATOR",
    "BUILD_CREATOR_EMAIL",
    "BUILD_CREATOR_TEAMS",
    "BUILD_ID",
    "BUILD_NUMBER",
    "BUILD_URL",
    "CLUSTER_*",
    "COMMAND",
    "COMMIT",
    "COMPUTE_TYPE",
    // Buildkite's mirror of the repository, which the agent checks against its
    // allowed-repositories (and writes, empty, when there is none: agent/job_runner.go).
    "GIT_REMOTE_MIRROR_URL",
    "GROUP_*",
    "JOB_ID",
    "LABEL",
    "MESSAGE",
    "ORGANIZATION_ID",
    "ORGANIZATION_SLUG",
    "PARALLEL_JOB",
    "PARALLEL_JOB_COUNT",
    "PIPELINE_DEFAULT_BRANCH",
    "PIPELINE_ID",
    "PIPELINE_NAME",
    "PIPELINE_PROVIDER",
    "PIPELINE_SLUG",
    "PIPELINE_TEAMS",
    "PLUGINS",
    "PROJECT_PROVIDER",
    "PROJECT_SLUG",
    "PULL_REQUEST*",
    "REBUILT_FROM_*",
    "REFSPEC",
    "REPO",
    "RETRY_COUNT",
    "RETRY_TYPE",
    "SCRIPT_PATH",
    "SOURCE",
    "STEP_ID",
    "STEP_KEY",
    "TAG",
    "TIMEOUT",
    "TRIGGERED_FROM_*",
    "UNBLOCKER*",
];

/// Whether `name` (a `BUILDKITE_*` variable's name) is one of [`BACKEND_VARIABLES`].
pub fn is_backend_variable(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("BUILDKITE_") else {
        return false;
    };
    BACKEND_VARIABLES.iter().any(|v| match v.strip_suffix('*') {
        Some(prefix) => rest.starts_with(prefix),
        None => rest == *v,
    })
}

/// The step's artifact patterns (`;`-separated, as the agent splits them with its default
/// delimiter, which a job cannot change: it is not one of [`BACKEND_VARIABLES`]). The one
/// `BUILDKITE_*` variable outside that list a node accepts, each pattern checked.
pub const ARTIFACT_PATHS: &str = "BUILDKITE_ARTIFACT_PATHS";

/// Why an artifact pattern is refused, if it is: the agent (root) uploads what it matches,
/// relative to the checkout, so a pattern must stay inside it. Its glob library (zzglob, as
/// `internal/artifact/uploader.go` calls it) takes `\` as an escape and `{a,b}` and `[ab]` as
/// alternatives, so `\/etc/shadow` or `.\./` would pass a look at the text alone: a
/// pattern holding any of `\ { } [ ]` is refused; `*` and `?` never match a `/`.
pub fn artifact_pattern_problem(pattern: &str) -> Option<String> {
    let p = pattern.trim();
    if p.contains(['\\', '{', '}', '[', ']']) {
        return Some(format!(
            "artifact pattern {p:?} holds a glob escape or alternative (\\ {{ }} [ ])"
        ));
    }
    if p.starts_with('/') || p.starts_with('~') {
        return Some(format!(
            "artifact pattern {p:?} is not relative to the checkout"
        ));
    }
    if p.split('/').any(|part| part == "..") {
        return Some(format!("artifact pattern {p:?} leaves the checkout (`..`)"));
    }
    None
}

/// Why the job is refused: one line per problem, none when it may start. `signed_steps`: the
/// node verifies signatures ([`SIGNED_STEPS_SETTING`]), so a step without a binding is refused.
pub fn refusals(env: &BTreeMap<String, String>, signed_steps: bool) -> Vec<String> {
    let mut out = Vec::new();
    for name in env.keys() {
        let refused =
            name.starts_with("BUILDKITE_") && name != ARTIFACT_PATHS && !is_backend_variable(name);
        if refused {
            out.push(format!(
                "{name} is set by the job (its build's or step's env): Buildkite's backend does not set it, and such variables steer the root bootstrap or the hooks (crates/hooks/src/admission.rs lists those a job may carry)"
            ));
        }
        // The hooks read their settings (`job::Settings`: the sandbox switch, the run dir,
        // the roots, what is hidden, what the network opens; the NVML build they hand over
        // to; the agent-level plugin configuration) from their environment, the agent's and
        // the job's together: a job's `KERNELKITE_SANDBOX=off` would run its command as root.
        // The agents' allow-list (setup) refuses them first; this holds where it is wider.
        if name.starts_with("KERNELKITE_") && name != SUBMISSION_ID_ENV {
            out.push(format!(
                "{name} is set by the job (its build's or step's env): it is a setting of the node's hooks, which only the agent's environment gives; of KERNELKITE_* a job carries only {SUBMISSION_ID_ENV}"
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
            "BUILDKITE_SECRETS_CONFIG",
            "BUILDKITE_GIT_LFS_ENABLED",
            "BUILDKITE_USE_REPOSITORY_PROVIDER_GIT_CREDENTIALS",
            "BUILDKITE_BOOTSTRAP_PHASES",
            "BUILDKITE_AGENT_NO_JOB_API",
            "BUILDKITE_TRACING_BACKEND",
            "BUILDKITE_CLEAN_CHECKOUT",
            "BUILDKITE_PIPELINE_UPLOAD_DRY_RUN",
            "BUILDKITE_AGENT_AWS_KMS_KEY",
            "BUILDKITE_BUILD_PATH",
            "BUILDKITE_PULLREQUEST",
        ] {
            let mut e = env(BOUND);
            e.insert(name.into(), "/usr".into());
            let r = refusals(&e, true);
            assert_eq!(r.len(), 1, "{name}: {r:?}");
            assert!(r[0].starts_with(name), "{r:?}");
        }
        // What the backend sets, prefixes included; other variables are the agent's
        // allow-list's to judge.
        for name in [
            "BUILDKITE_AGENT_META_DATA_GPU_INDEX",
            "BUILDKITE_PULL_REQUEST_BASE_BRANCH",
            "BUILDKITE_TRIGGERED_FROM_BUILD_ID",
            "BUILDKITE_REPO",
            "BUILDKITE",
            "KERNELBOT_PAYLOAD",
        ] {
            let mut e = env(BOUND);
            e.insert(name.into(), "x".into());
            assert!(refusals(&e, true).is_empty(), "{name}");
        }
        assert!(!is_backend_variable("BUILDKITE_AGENT_NAME_X"));
    }

    #[test]
    fn a_job_may_not_set_the_hooks_settings() {
        use clap::Args;
        // Every variable a hook reads its settings from, as clap declares them.
        let declared = crate::job::Settings::augment_args(clap::Command::new("hook"));
        let mut names: Vec<String> = declared
            .get_arguments()
            .filter_map(|a| a.get_env())
            .map(|v| v.to_string_lossy().into_owned())
            .collect();
        assert!(names.len() >= 10, "{names:?}");
        names.extend(
            [
                "KERNELKITE_SANDBOX",
                SIGNED_STEPS_SETTING,
                crate::delegate::NVML_BUILD_ENV,
                "KERNELKITE_CONFIG",
                "KERNELKITE_SLICE",
                // The runner's settings: the node's too (the agent's environment), even
                // though they reach only the job's sandbox.
                "KERNELKITE_PYTHON",
                "KERNELKITE_REQUIRE_GPU",
                "KERNELKITE_SOMETHING_NEW",
            ]
            .map(String::from),
        );
        for name in names {
            let mut e = env(BOUND);
            e.insert(name.clone(), "off".into());
            let r = refusals(&e, true);
            assert_eq!(r.len(), 1, "{name}: {r:?}");
            assert!(r[0].starts_with(&name), "{r:?}");
        }
        let mut e = env(BOUND);
        e.insert(SUBMISSION_ID_ENV.into(), "s-1".into());
        assert!(refusals(&e, true).is_empty());
    }

    /// The pipeline agent's pre-bootstrap hook (a shell script in the stock agent image)
    /// admits the same `BUILDKITE_*` variables, less `BUILDKITE_ARTIFACT_PATHS` (its step
    /// uploads nothing): the two lists are one.
    #[test]
    fn the_pipeline_agent_admits_the_same_variables() {
        let hook = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../deployment/service/pipeline-agent/hooks/pre-bootstrap"),
        )
        .unwrap();
        let list = hook
            .split("# BEGIN backend variables")
            .nth(1)
            .and_then(|rest| rest.split("# END backend variables").next())
            .expect("the hook marks its list");
        let mut theirs: Vec<&str> = list
            .split(|c: char| c == '|' || c.is_whitespace())
            .map(|w| w.trim_end_matches(')'))
            .filter(|w| !matches!(*w, "" | "\\" | ";;"))
            .collect();
        theirs.sort_unstable();
        let mut ours = BACKEND_VARIABLES.to_vec();
        ours.sort_unstable();
        assert_eq!(theirs, ours);
    }

    #[test]
    fn artifact_patterns_stay_in_the_checkout() {
        for bad in [
            "/etc/shadow",
            "~/.ssh/*",
            "../x",
            "a/../../etc/*",
            "a\\..\\b",
            "\\/etc/shadow",
            ".\\./.\\./x",
            "{/abs,x}",
            "[/]abs",
            " /etc/shadow",
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
