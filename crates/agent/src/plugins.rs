//! The variables a Buildkite agent gives a plugin's hooks, as the agent makes them
//! (`agent/plugin/plugin.go` in github.com/buildkite/agent v3.137.0: `CreatePlugin`, `Name`,
//! `formatEnvKey`, `flattenConfigToEnvMap`, `ConfigurationToEnvironment`). Local mode gives the
//! plugin's hooks exactly these, and `tests/tests/real_agent.rs` checks them against the real
//! agent.

use std::collections::BTreeMap;

use serde_json::Value;

/// Where the deployment pipelines take the plugin from (`deployment/pipelines/host.yml`), less
/// its version. The agent names a plugin after the last element of its location, so this
/// plugin's variables are `BUILDKITE_PLUGIN_PLUGIN_*`.
pub const PLUGIN_LOCATION: &str = "github.com/kernelkite/kernelkite/plugin";

/// The place a location names: what the agent keeps of it (`url.Parse`: host and path; no
/// scheme, user or `#version`).
fn place(location: &str) -> &str {
    let no_version = location.split('#').next().unwrap_or_default();
    match no_version.split_once("://") {
        Some((_, rest)) => rest.rsplit_once('@').map_or(rest, |(_, host)| host),
        None => no_version,
    }
}

/// The name the agent gives a plugin at `location`: its last path element, leading dots
/// trimmed, lower case, every character but ASCII letters and digits as `-`, without a
/// `-buildkite-plugin` suffix.
pub fn plugin_name(location: &str) -> String {
    let place = place(location).replace('\\', "/");
    let last = place
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or_default();
    let mut name: String = last
        .trim_start_matches('.')
        .to_lowercase()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    for suffix in ["-buildkite-plugin-git", "-buildkite-plugin"] {
        name = name.replace(suffix, "");
    }
    name
}

/// A name or key as an environment variable's part: upper case, `-` and whitespace as `_`.
fn env_key(key: &str) -> String {
    key.to_uppercase()
        .chars()
        .map(|c| {
            if c == '-' || c.is_whitespace() {
                '_'
            } else {
                c
            }
        })
        .collect()
}

/// `value` with every object's keys in byte order, as Go's `encoding/json` writes a map.
fn sorted(value: &Value) -> Value {
    match value {
        Value::Object(map) => {
            let keys: BTreeMap<&String, &Value> = map.iter().collect();
            Value::Object(
                keys.into_iter()
                    .map(|(k, v)| (k.clone(), sorted(v)))
                    .collect(),
            )
        }
        Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
        other => other.clone(),
    }
}

/// Flattens `value` under `prefix`: a list by index (`_0`, `_1`), an object by key, a string,
/// number or boolean as its text. The agent refuses a `null` (an unknown type) and fails the
/// job; here it is left out.
fn flatten(into: &mut BTreeMap<String, String>, value: &Value, prefix: &str) {
    match value {
        Value::String(s) => {
            into.insert(prefix.to_string(), s.clone());
        }
        Value::Bool(_) | Value::Number(_) => {
            into.insert(prefix.to_string(), value.to_string());
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                flatten(into, item, &format!("{prefix}_{i}"));
            }
        }
        Value::Object(map) => {
            for (k, v) in map {
                flatten(into, v, &format!("{prefix}_{}", env_key(k)));
            }
        }
        Value::Null => {}
    }
}

/// The variables the agent sets for the hooks of the plugin at `location` configured with
/// `config`: `BUILDKITE_PLUGIN_NAME`, `BUILDKITE_PLUGIN_CONFIGURATION` (compact JSON, keys
/// sorted) and the configuration flattened under `BUILDKITE_PLUGIN_<NAME>`.
pub fn plugin_variables(location: &str, config: &Value) -> BTreeMap<String, String> {
    let name = env_key(&plugin_name(location));
    let mut out = BTreeMap::new();
    out.insert("BUILDKITE_PLUGIN_NAME".to_string(), name.clone());
    out.insert(
        "BUILDKITE_PLUGIN_CONFIGURATION".to_string(),
        sorted(config).to_string(),
    );
    flatten(&mut out, config, &format!("BUILDKITE_PLUGIN_{name}"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_plugin_in_a_repository_subdirectory_is_named_after_its_last_element() {
        for (location, name) in [
            ("github.com/kernelkite/kernelkite/plugin#v0.1.0", "plugin"),
            (
                "https://github.com/kernelkite/kernelkite.git/plugin#main",
                "plugin",
            ),
            (
                "ssh://git@github.com/kernelkite/kernelkite/plugin/#v1",
                "plugin",
            ),
            ("/srv/kernelkite.git/plugin#0123abc", "plugin"),
            ("github.com/org/docker-buildkite-plugin#v5", "docker"),
            ("docker#v5.12.0", "docker"),
            ("github.com/org/repo/.buildkite", "buildkite"),
            ("github.com/org/My Plugin", "my-plugin"),
        ] {
            assert_eq!(plugin_name(location), name, "{location}");
        }
    }

    #[test]
    fn configuration_is_flattened_as_the_agent_flattens_it() {
        let config = json!({"user": "nobody", "allow-syscalls": ["ptrace", "perf_event_open"],
                            "nested": {"a-b": 1}, "network": true, "gone": null});
        let vars = plugin_variables("github.com/kernelkite/kernelkite/plugin#v0.1.0", &config);
        let want: BTreeMap<String, String> = [
            ("BUILDKITE_PLUGIN_NAME", "PLUGIN"),
            (
                "BUILDKITE_PLUGIN_CONFIGURATION",
                r#"{"allow-syscalls":["ptrace","perf_event_open"],"gone":null,"nested":{"a-b":1},"network":true,"user":"nobody"}"#,
            ),
            ("BUILDKITE_PLUGIN_PLUGIN_ALLOW_SYSCALLS_0", "ptrace"),
            ("BUILDKITE_PLUGIN_PLUGIN_ALLOW_SYSCALLS_1", "perf_event_open"),
            ("BUILDKITE_PLUGIN_PLUGIN_NESTED_A_B", "1"),
            ("BUILDKITE_PLUGIN_PLUGIN_NETWORK", "true"),
            ("BUILDKITE_PLUGIN_PLUGIN_USER", "nobody"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(vars, want);
    }
}
