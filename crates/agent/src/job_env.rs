//! The variables the agent gives a job, for its hooks and its command, where kernelkite plays
//! the agent: local mode's jobs, `setup`'s smoke job and the plugin's test harness build a
//! job's environment here, so what the hooks read is the same in all three.
//!
//! Where each variable comes from, in the agent's source (github.com/buildkite/agent v3.137.0):
//! Buildkite's job environment (`r.conf.Job.Env` in `agent/job_runner.go`, what the fake
//! Buildkite plays for the real-agent tests) names the job, build, organization, pipeline, the
//! agent, each of its tags `key=value` (`BUILDKITE_AGENT_META_DATA_<KEY>`), the step's command
//! and artifact paths and its plugins (`BUILDKITE_PLUGINS`, a JSON list); the agent adds its
//! own over it in `createEnvironment` (`BUILDKITE_SHELL`, its `shell` setting, by default
//! `/bin/bash -e -c`: `clicommand/agent_start.go`); the bootstrap sets the checkout path; and
//! each plugin's hooks get its variables ([`crate::plugins`]). `tests/tests/real_agent.rs`
//! checks the plugin's variables and the hook order against the real agent.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use crate::plugins::plugin_variables;

/// The shell the agent runs a command in on Linux unless it is configured otherwise.
pub const DEFAULT_SHELL: &str = "/bin/bash -e -c";

/// One job as the agent describes it to its hooks.
#[derive(Debug, Clone)]
pub struct JobEnv<'a> {
    /// `BUILDKITE_JOB_ID`.
    pub job_id: &'a str,
    /// `BUILDKITE_BUILD_ID`.
    pub build_id: &'a str,
    /// `BUILDKITE_BUILD_NUMBER`.
    pub build_number: u64,
    /// `BUILDKITE_ORGANIZATION_SLUG`.
    pub organization: &'a str,
    /// `BUILDKITE_PIPELINE_SLUG`.
    pub pipeline: &'a str,
    /// `BUILDKITE_AGENT_NAME`.
    pub agent_name: &'a str,
    /// The agent's tags, as `(key, value)`: `BUILDKITE_AGENT_META_DATA_<KEY>`.
    pub tags: Vec<(&'a str, String)>,
    /// `BUILDKITE_BUILD_CHECKOUT_PATH`.
    pub checkout: &'a Path,
    /// `BUILDKITE_COMMAND`: the step's command.
    pub command: &'a str,
    /// `BUILDKITE_ARTIFACT_PATHS`: the step's artifact paths (none: not set).
    pub artifact_paths: Option<&'a str>,
    /// The step's plugin: its location with its version (`<location>#<version>`) and its
    /// configuration (none: a step without plugins).
    pub plugin: Option<(String, Value)>,
}

impl JobEnv<'_> {
    /// The variables, as the agent sets them over whatever the job inherits.
    pub fn variables(&self) -> BTreeMap<String, String> {
        let mut env = BTreeMap::new();
        let mut set = |k: &str, v: String| {
            env.insert(k.to_string(), v);
        };
        set("BUILDKITE", "true".into());
        set("CI", "true".into());
        set("BUILDKITE_JOB_ID", self.job_id.into());
        set("BUILDKITE_BUILD_ID", self.build_id.into());
        set("BUILDKITE_BUILD_NUMBER", self.build_number.to_string());
        set("BUILDKITE_ORGANIZATION_SLUG", self.organization.into());
        set("BUILDKITE_PIPELINE_SLUG", self.pipeline.into());
        set("BUILDKITE_AGENT_NAME", self.agent_name.into());
        for (key, value) in &self.tags {
            set(&meta_data_variable(key), value.clone());
        }
        set(
            "BUILDKITE_BUILD_CHECKOUT_PATH",
            self.checkout.display().to_string(),
        );
        set("BUILDKITE_COMMAND", self.command.into());
        set("BUILDKITE_SHELL", DEFAULT_SHELL.into());
        if let Some(paths) = self.artifact_paths {
            set("BUILDKITE_ARTIFACT_PATHS", paths.into());
        }
        if let Some((location, config)) = &self.plugin {
            env.extend(plugin_variables(location, config));
            env.insert(
                "BUILDKITE_PLUGINS".into(),
                serde_json::json!([{ location.as_str(): config }]).to_string(),
            );
        }
        env
    }
}

/// The variable of agent tag `key`: upper case, every character but ASCII letters and digits
/// as `_` (`gpu-index` → `BUILDKITE_AGENT_META_DATA_GPU_INDEX`).
pub fn meta_data_variable(key: &str) -> String {
    let key: String = key
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("BUILDKITE_AGENT_META_DATA_{key}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(plugin: Option<(String, Value)>) -> BTreeMap<String, String> {
        JobEnv {
            job_id: "j1",
            build_id: "b1",
            build_number: 7,
            organization: "org",
            pipeline: "pipe",
            agent_name: "node-gpu0",
            tags: vec![("gpu-index", "0".into()), ("queue", "h100".into())],
            checkout: Path::new("/work/checkout"),
            command: "kernelkite-runner",
            artifact_paths: Some("result.json"),
            plugin,
        }
        .variables()
    }

    #[test]
    fn the_agent_s_variables_name_the_job_and_its_tags() {
        let env = job(None);
        for (k, v) in [
            ("BUILDKITE", "true"),
            ("CI", "true"),
            ("BUILDKITE_JOB_ID", "j1"),
            ("BUILDKITE_BUILD_NUMBER", "7"),
            ("BUILDKITE_AGENT_META_DATA_GPU_INDEX", "0"),
            ("BUILDKITE_AGENT_META_DATA_QUEUE", "h100"),
            ("BUILDKITE_BUILD_CHECKOUT_PATH", "/work/checkout"),
            ("BUILDKITE_SHELL", "/bin/bash -e -c"),
            ("BUILDKITE_ARTIFACT_PATHS", "result.json"),
        ] {
            assert_eq!(env.get(k).map(String::as_str), Some(v), "{k}: {env:?}");
        }
        assert!(!env.contains_key("BUILDKITE_PLUGINS"));
    }

    #[test]
    fn a_step_s_plugin_gets_its_variables_and_the_plugin_list() {
        let config = serde_json::json!({"gpus": 2});
        let location = format!("{}#v1", crate::plugins::PLUGIN_LOCATION);
        let env = job(Some((location.clone(), config.clone())));
        assert_eq!(env["BUILDKITE_PLUGIN_PLUGIN_GPUS"], "2", "{env:?}");
        let plugins: Value = serde_json::from_str(&env["BUILDKITE_PLUGINS"]).unwrap();
        assert_eq!(plugins, serde_json::json!([{ location: config }]));
    }
}
