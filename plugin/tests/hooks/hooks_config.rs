//! `plugin.yml`'s JSON Schema and the parser in `config.rs` describe the same configuration.

use kernelkite_hooks::config::{parse_config, PluginConfig, KEYS};
use serde_json::{json, Value};

fn schema() -> Value {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/plugin.yml")).unwrap();
    let yaml: serde_norway::Value = serde_norway::from_str(&text).unwrap();
    serde_json::to_value(yaml).unwrap()
}

#[test]
fn plugin_yml_has_the_agent_fields_and_hooks_exist() {
    let s = schema();
    assert_eq!(s["name"], "kernelkite");
    assert!(s["description"].as_str().is_some_and(|d| !d.is_empty()));
    assert_eq!(s["configuration"]["type"], "object");
    assert_eq!(s["configuration"]["additionalProperties"], false);
    let hooks = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("hooks");
    for hook in ["environment", "command", "pre-exit"] {
        let meta = std::fs::metadata(hooks.join(hook)).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert!(
            meta.permissions().mode() & 0o111 != 0,
            "hooks/{hook} must be executable"
        );
        // The agent executes it (its first line names no shell) and the kernel runs the
        // binary `setup` installs.
        let text = std::fs::read_to_string(hooks.join(hook)).unwrap();
        assert_eq!(
            text.lines().next(),
            Some(kernelkite_sys::node::PLUGIN_HOOK_SHEBANG),
            "hooks/{hook}"
        );
    }
}

#[test]
fn schema_keys_are_exactly_the_parsers_keys() {
    let s = schema();
    let props = s["configuration"]["properties"].as_object().unwrap();
    let mut schema_keys: Vec<&str> = props.keys().map(String::as_str).collect();
    schema_keys.sort();
    let mut parser_keys = KEYS.to_vec();
    parser_keys.sort();
    assert_eq!(schema_keys, parser_keys);
}

#[test]
fn schema_defaults_are_the_parsers_defaults() {
    let s = schema();
    let props = s["configuration"]["properties"].as_object().unwrap();
    let d = PluginConfig::default();
    let expected = json!({
        "gpus": d.gpus, "mode": "host", "mount-checkout": d.mount_checkout, "workdir": d.workdir,
        "pids-limit": d.pids_limit, "require-idle-gpu": d.require_idle_gpu,
        "idle-memory-mib": d.idle_memory_mib, "lease-wait": d.lease_wait_secs,
        "allow-unenforced": d.allow_unenforced,
    });
    for (k, v) in expected.as_object().unwrap() {
        assert_eq!(&props[k]["default"], v, "default of {k}");
    }
    // Feeding every schema default back through the parser is accepted and changes nothing.
    let defaults: serde_json::Map<String, Value> = props
        .iter()
        .filter_map(|(k, p)| Some((k.clone(), p.get("default")?.clone())))
        .collect();
    assert_eq!(
        parse_config(&Value::Object(defaults).to_string()).unwrap(),
        d
    );
}

#[test]
fn schema_bounds_match_the_parser() {
    let s = schema();
    let props = s["configuration"]["properties"].as_object().unwrap();
    for (key, p) in props {
        if p["type"] != "integer" {
            continue;
        }
        let (min, max) = (
            p["minimum"].as_u64().unwrap(),
            p["maximum"].as_u64().unwrap(),
        );
        let doc = |v: u64| {
            let mut m = serde_json::Map::new();
            m.insert(key.clone(), json!(v));
            Value::Object(m).to_string()
        };
        assert!(parse_config(&doc(min)).is_ok(), "{key}={min}");
        assert!(parse_config(&doc(max)).is_ok(), "{key}={max}");
        assert!(parse_config(&doc(max + 1)).is_err(), "{key}={}", max + 1);
        if min > 0 {
            assert!(parse_config(&doc(min - 1)).is_err(), "{key}={}", min - 1);
        }
    }
    let modes: Vec<&str> = props["mode"]["enum"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(modes, ["host", "docker"]);
}

#[test]
fn schema_user_pattern_matches_the_parser() {
    let s = schema();
    let pattern = s["configuration"]["properties"]["user"]["pattern"]
        .as_str()
        .unwrap()
        .to_string();
    // The pattern, spelled out: a lowercase name of at most 32 characters plus an optional
    // trailing `$` (machine accounts), a uid, or `uid:gid`.
    assert_eq!(
        pattern,
        "^([a-z_][a-z0-9_-]{0,31}[$]?|[0-9]{1,10}(:[0-9]{1,10})?)$"
    );
    let name32 = format!("a{}", "b".repeat(31));
    let name33 = format!("a{}", "b".repeat(32));
    for (user, ok) in [
        ("kernelkite-job", true),
        ("build$", true),
        (name32.as_str(), true),
        (name33.as_str(), false),
        ("1500:1500", true),
        ("12345678901", false),
        ("Eval", false),
        ("a$$", false),
    ] {
        let doc = json!({ "user": user }).to_string();
        assert_eq!(parse_config(&doc).is_ok(), ok, "{user}");
    }
}
