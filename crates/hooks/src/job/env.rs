//! Reading the job from the variables the agent sets: its id, its configuration, the GPU(s)
//! the agent is bound to, the Job API.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use super::JobError;
use crate::config::{self, ConfigError, PluginConfig};

/// A variable the agent always sets; missing or empty is an error naming it.
pub fn var<'e>(env: &'e BTreeMap<String, String>, name: &'static str) -> Result<&'e str, JobError> {
    env.get(name)
        .map(String::as_str)
        .filter(|v| !v.is_empty())
        .ok_or(JobError::MissingEnv { name })
}

/// The job's checkout (`BUILDKITE_BUILD_CHECKOUT_PATH`), `None` when unset. The agent
/// computes it under its build path (`BUILDKITE_BUILD_PATH`, which a job cannot set:
/// `env/protected.go`) but keeps a value the job's variables give (`internal/job/executor.go`),
/// and these hooks hand the checkout to the job's user: anything else (not absolute, `..`,
/// outside the build path) is refused. The `pre-bootstrap` hook refuses the variable first
/// ([`crate::admission`]); this holds where that hook is not installed.
pub fn checkout_path(env: &BTreeMap<String, String>) -> Result<Option<PathBuf>, JobError> {
    let Some(path) = env
        .get("BUILDKITE_BUILD_CHECKOUT_PATH")
        .filter(|p| !p.is_empty())
    else {
        return Ok(None);
    };
    let build_path = env
        .get("BUILDKITE_BUILD_PATH")
        .map(String::as_str)
        .unwrap_or("");
    let p = Path::new(path);
    let lexical = p.is_absolute()
        && !p
            .components()
            .any(|c| matches!(c, Component::ParentDir | Component::CurDir));
    let inside = build_path.is_empty() || (p.starts_with(build_path) && p != Path::new(build_path));
    if lexical && inside {
        Ok(Some(p.to_path_buf()))
    } else {
        Err(JobError::CheckoutOutside {
            path: path.clone(),
            build_path: build_path.to_string(),
        })
    }
}

/// The agent's Job API socket (`BUILDKITE_AGENT_JOB_API_SOCKET`), when it has one.
pub fn job_api_socket(env: &BTreeMap<String, String>) -> Option<&str> {
    env.get("BUILDKITE_AGENT_JOB_API_SOCKET")
        .map(String::as_str)
        .filter(|v| !v.is_empty())
}

/// The configuration for this hook: the plugin's (`BUILDKITE_PLUGIN_CONFIGURATION`) when run
/// as a plugin, else `KERNELKITE_CONFIG` from the agent's environment (agent-level hooks).
pub fn job_config(env: &BTreeMap<String, String>) -> Result<PluginConfig, ConfigError> {
    let text = env
        .get("BUILDKITE_PLUGIN_CONFIGURATION")
        .or_else(|| env.get("KERNELKITE_CONFIG"))
        .map(String::as_str)
        .unwrap_or("");
    config::parse_config(text)
}

/// Whether this hook runs as the plugin's (the agent gives plugin hooks their step's
/// configuration) rather than as an agent-level hook.
fn is_plugin_hook(env: &BTreeMap<String, String>) -> bool {
    env.contains_key("BUILDKITE_PLUGIN_CONFIGURATION")
}

/// Whether a plugin location (a key of `BUILDKITE_PLUGINS`, `<location>#<ref>`) is this plugin:
/// the repository's plugin directory (`github.com/kernelkite/kernelkite/plugin`), or a copy
/// published as a plugin repository of its own (`.../kernelkite`,
/// `.../kernelkite-buildkite-plugin`, or the shorthand `kernelkite`).
pub fn is_this_plugin(location: &str) -> bool {
    let place = location.split('#').next().unwrap_or_default();
    let place = place.trim_end_matches('/').to_ascii_lowercase();
    let mut segments = place
        .rsplit('/')
        .map(|s| s.strip_suffix(".git").unwrap_or(s));
    match segments.next() {
        Some("kernelkite" | "kernelkite-buildkite-plugin") => true,
        Some("plugin") => segments.next() == Some("kernelkite"),
        _ => false,
    }
}

/// Whether the step names this plugin (`BUILDKITE_PLUGINS`, a JSON list of one-key objects
/// `{"<location>#<ref>": config}`). Unreadable JSON names nothing.
pub fn step_names_this_plugin(env: &BTreeMap<String, String>) -> bool {
    let Some(text) = env.get("BUILDKITE_PLUGINS") else {
        return false;
    };
    let Ok(serde_json::Value::Array(plugins)) = serde_json::from_str::<serde_json::Value>(text)
    else {
        return false;
    };
    plugins
        .iter()
        .filter_map(serde_json::Value::as_object)
        .flat_map(|o| o.keys())
        .any(|k| is_this_plugin(k))
}

/// Why an agent-level hook (`environment` or `pre-exit`) leaves this job to the plugin's, if it
/// does: the step names the plugin, whose hooks the agent runs with the step's configuration,
/// which replaces whatever an agent-level `environment` prepared. The agent runs both hooks
/// agent-level first, then the plugin's (`environment` and `pre-exit` alike; checked against
/// the real agent in `tests/tests/real_agent.rs`), so the plugin's hooks do the work and the
/// agent-level ones would only repeat it: a second lease, check and cgroup per job, and a
/// second clean-up walk, on a node whose agents have the agent-level hooks and run the
/// plugin's pipelines. Should the plugin's hooks
/// not run, its `command` does not either, and the agent-level `command` finds no state and
/// fails the job; a job the plugin prepared and did not clean up is cleaned up as an orphan by
/// the next `environment` on the node.
pub fn left_to_the_plugin(env: &BTreeMap<String, String>) -> Option<&'static str> {
    (!is_plugin_hook(env) && step_names_this_plugin(env)).then_some(
        "the step uses the kernelkite plugin, whose own hooks prepare and clean up this job",
    )
}

fn parse_index_list(name: &'static str, value: &str) -> Result<Vec<u32>, JobError> {
    let bad = || JobError::BadGpuIndex {
        name,
        value: value.to_string(),
    };
    // `+` is how an agent's configuration writes a list (its tags are split at commas, so
    // `gpu-index=0,1` would reach the job as `0`); `,` still reads, for a tag given otherwise.
    let list: Vec<u32> = value
        .split([',', '+'])
        .map(|p| p.trim().parse::<u32>().map_err(|_| bad()))
        .collect::<Result<_, _>>()?;
    // "3,3" would pass the `gpus: 2` check with one GPU, and merging its slice twice would
    // double the memory limit past the node's share.
    let mut seen = list.clone();
    seen.sort_unstable();
    seen.dedup();
    if list.is_empty() || seen.len() != list.len() {
        return Err(bad());
    }
    Ok(list)
}

/// The GPU(s) the agent is bound to: tag `gpu-index=N` (or `N+M`), else a name ending in
/// `-gpu<N>` (agents started with `--name host-gpu%spawn`); `None` for pool agents.
pub fn agent_gpus(env: &BTreeMap<String, String>) -> Result<Option<Vec<u32>>, JobError> {
    if let Some(v) = env
        .get("BUILDKITE_AGENT_META_DATA_GPU_INDEX")
        .filter(|v| !v.trim().is_empty())
    {
        return parse_index_list("BUILDKITE_AGENT_META_DATA_GPU_INDEX", v).map(Some);
    }
    let name = env
        .get("BUILDKITE_AGENT_NAME")
        .map(String::as_str)
        .unwrap_or("");
    if let Some(pos) = name.rfind("-gpu") {
        let digits = &name[pos + 4..];
        if !digits.is_empty() && digits.chars().all(|c| c.is_ascii_digit()) {
            return parse_index_list("BUILDKITE_AGENT_NAME", digits).map(Some);
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::test_support::env;

    #[test]
    fn the_checkout_must_lie_under_the_agent_s_build_path() {
        let at = |checkout: &str, builds: &str| {
            let mut e = BTreeMap::new();
            e.insert(
                "BUILDKITE_BUILD_CHECKOUT_PATH".to_string(),
                checkout.to_string(),
            );
            if !builds.is_empty() {
                e.insert("BUILDKITE_BUILD_PATH".to_string(), builds.to_string());
            }
            checkout_path(&e)
        };
        let b = "/var/lib/kernelkite/builds";
        assert_eq!(
            at("/var/lib/kernelkite/builds/kk-0/org/p", b).unwrap(),
            Some(PathBuf::from("/var/lib/kernelkite/builds/kk-0/org/p"))
        );
        for bad in [
            "/usr",
            "/",
            "/var/lib/kernelkite/builds",
            "/var/lib/kernelkite/builds/../../../etc",
            "/var/lib/kernelkite/builds-other/x",
            "relative/path",
        ] {
            let e = at(bad, b).unwrap_err();
            assert!(matches!(e, JobError::CheckoutOutside { .. }), "{bad}: {e}");
            assert!(e.to_string().contains("refused"), "{e}");
        }
        // Without a build path (a hook run by hand), only the form is checked.
        assert!(at("/tmp/x", "").unwrap().is_some());
        assert!(at("/tmp/../etc", "").is_err());
        assert_eq!(checkout_path(&BTreeMap::new()).unwrap(), None);
    }

    #[test]
    fn this_plugin_is_recognised_by_its_location_in_the_step() {
        for yes in [
            "github.com/kernelkite/kernelkite/plugin#v0.1.0",
            "https://github.com/kernelkite/kernelkite.git/plugin#main",
            "ssh://git@github.com/kernelkite/kernelkite/plugin/#v1",
            "github.com/vendor/kernelkite-buildkite-plugin#v2.0.0",
            "kernelkite#v1.0.0",
            "git.example.com/mirror/kernelkite.git#abc",
        ] {
            assert!(is_this_plugin(yes), "{yes}");
        }
        for no in [
            "docker#v5.12.0",
            "github.com/buildkite-plugins/docker-buildkite-plugin#v5",
            "github.com/other/tools/plugin#v1",
            "github.com/kernelkite/kernelkite-extras#v1",
            "",
        ] {
            assert!(!is_this_plugin(no), "{no}");
        }
        let plugins = |json: &str| env(&[("BUILDKITE_PLUGINS", json)]);
        assert!(step_names_this_plugin(&plugins(
            r#"[{"docker#v5.12.0":{"image":"x"}},{"github.com/kernelkite/kernelkite/plugin#v0.1.0":{"gpus":1}}]"#
        )));
        assert!(!step_names_this_plugin(&plugins(
            r#"[{"docker#v5.12.0":{}}]"#
        )));
        assert!(!step_names_this_plugin(&plugins("not json")));
        assert!(!step_names_this_plugin(&BTreeMap::new()));
    }

    #[test]
    fn agent_binding_from_tag_or_name() {
        assert_eq!(agent_gpus(&env(&[])).unwrap(), None);
        assert_eq!(
            agent_gpus(&env(&[("BUILDKITE_AGENT_META_DATA_GPU_INDEX", "3")])).unwrap(),
            Some(vec![3])
        );
        assert_eq!(
            agent_gpus(&env(&[("BUILDKITE_AGENT_META_DATA_GPU_INDEX", "2, 3")])).unwrap(),
            Some(vec![2, 3])
        );
        assert_eq!(
            agent_gpus(&env(&[("BUILDKITE_AGENT_NAME", "dgx01-gpu7")])).unwrap(),
            Some(vec![7])
        );
        assert_eq!(
            agent_gpus(&env(&[("BUILDKITE_AGENT_NAME", "dgx01-gpux")])).unwrap(),
            None
        );
        assert!(agent_gpus(&env(&[("BUILDKITE_AGENT_META_DATA_GPU_INDEX", "one")])).is_err());
        assert!(agent_gpus(&env(&[("BUILDKITE_AGENT_META_DATA_GPU_INDEX", "3,3")])).is_err());
    }

    #[test]
    fn the_job_api_socket_is_absent_when_empty_and_plugin_config_wins() {
        assert_eq!(job_api_socket(&env(&[])), None);
        assert_eq!(
            job_api_socket(&env(&[("BUILDKITE_AGENT_JOB_API_SOCKET", "")])),
            None
        );
        assert_eq!(
            job_api_socket(&env(&[("BUILDKITE_AGENT_JOB_API_SOCKET", "/s")])),
            Some("/s")
        );
        let both = env(&[
            ("BUILDKITE_PLUGIN_CONFIGURATION", r#"{"gpus":2}"#),
            ("KERNELKITE_CONFIG", r#"{"gpus":3}"#),
        ]);
        assert_eq!(job_config(&both).unwrap().gpus, Some(2));
        let agent = env(&[("KERNELKITE_CONFIG", r#"{"gpus":3}"#)]);
        assert_eq!(job_config(&agent).unwrap().gpus, Some(3));
        assert!(matches!(
            var(&env(&[("BUILDKITE_JOB_ID", "")]), "BUILDKITE_JOB_ID"),
            Err(JobError::MissingEnv { .. })
        ));
    }
}
