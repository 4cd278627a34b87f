//! Reading the job from the variables the agent sets: its id, its configuration, the GPU(s)
//! the agent is bound to, the Job API.

use std::collections::BTreeMap;

use super::JobError;
use crate::config::{self, ConfigError, PluginConfig};

/// A variable the agent always sets; missing or empty is an error naming it.
pub fn var<'e>(env: &'e BTreeMap<String, String>, name: &'static str) -> Result<&'e str, JobError> {
    env.get(name)
        .map(String::as_str)
        .filter(|v| !v.is_empty())
        .ok_or(JobError::MissingEnv { name })
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

fn parse_index_list(name: &'static str, value: &str) -> Result<Vec<u32>, JobError> {
    let bad = || JobError::BadGpuIndex {
        name,
        value: value.to_string(),
    };
    let list: Vec<u32> = value
        .split(',')
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

/// The GPU(s) the agent is bound to: tag `gpu-index=N` (or `N,M`), else a name ending in
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
        assert_eq!(job_config(&both).unwrap().gpus, 2);
        let agent = env(&[("KERNELKITE_CONFIG", r#"{"gpus":3}"#)]);
        assert_eq!(job_config(&agent).unwrap().gpus, 3);
        assert!(matches!(
            var(&env(&[("BUILDKITE_JOB_ID", "")]), "BUILDKITE_JOB_ID"),
            Err(JobError::MissingEnv { .. })
        ));
    }
}
