//! `plugin.yml` as Buildkite's plugin linter sees it: valid against the linter's published
//! schema (vendored in `tests/data/buildkite-plugin-linter/`), its `configuration` itself a
//! valid JSON Schema, and every example in the plugin's README accepted by that
//! configuration schema and by the plugin's parser.

use std::path::Path;

use serde_json::Value;

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn yaml_file(rel: &str) -> Value {
    let text = std::fs::read_to_string(manifest_dir().join(rel)).unwrap();
    let v: serde_norway::Value = serde_norway::from_str(&text).unwrap();
    serde_json::to_value(v).unwrap()
}

fn errors(schema: &Value, instance: &Value) -> Vec<String> {
    let validator = jsonschema::validator_for(schema).expect("the schema compiles");
    validator
        .iter_errors(instance)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect()
}

fn linter_schema() -> Value {
    yaml_file("tests/data/buildkite-plugin-linter/plugin-yaml-schema.yml")
}

#[test]
fn plugin_yml_validates_against_buildkites_plugin_schema() {
    let schema = linter_schema();
    let plugin = yaml_file("plugin.yml");
    let errs = errors(&schema, &plugin);
    assert!(errs.is_empty(), "plugin.yml: {errs:#?}");
    // The vendored schema really checks something: what the linter rejects, it rejects.
    let mut broken = plugin.clone();
    broken.as_object_mut().unwrap().remove("requirements");
    assert!(
        !errors(&schema, &broken).is_empty(),
        "a plugin.yml without requirements passed"
    );
    let mut broken = plugin.clone();
    broken["configuration"]
        .as_object_mut()
        .unwrap()
        .remove("properties");
    assert!(
        !errors(&schema, &broken).is_empty(),
        "a configuration without properties passed"
    );
    let mut broken = plugin;
    broken["configuration"]["additionalProperties"] = Value::from("no");
    assert!(!errors(&schema, &broken).is_empty());
}

#[test]
fn the_configuration_is_itself_a_valid_json_schema() {
    let plugin = yaml_file("plugin.yml");
    let config = &plugin["configuration"];
    assert!(
        jsonschema::meta::is_valid(config),
        "configuration is not a valid JSON Schema: {:?}",
        jsonschema::meta::validate(config)
            .err()
            .map(|e| e.to_string())
    );
    // It closes the door on typos, as the linter recommends.
    assert_eq!(config["additionalProperties"], false);
}

/// The plugin blocks (`github.com/kernelkite/kernelkite/plugin#...: {...}`) in the YAML
/// examples of a Markdown file.
fn examples(markdown: &str) -> Vec<Value> {
    let mut out = Vec::new();
    let mut block: Option<String> = None;
    for line in markdown.lines() {
        match &mut block {
            None if line.trim_start() == "```yaml" => block = Some(String::new()),
            Some(b) if line.trim_start() == "```" => {
                let v: serde_norway::Value = serde_norway::from_str(b)
                    .unwrap_or_else(|e| panic!("example is not YAML: {e}\n{b}"));
                collect_plugins(&serde_json::to_value(v).unwrap(), &mut out);
                block = None;
            }
            Some(b) => {
                b.push_str(line);
                b.push('\n');
            }
            None => {}
        }
    }
    out
}

fn collect_plugins(v: &Value, out: &mut Vec<Value>) {
    match v {
        Value::Object(map) => {
            for (k, val) in map {
                if k.starts_with("github.com/kernelkite/kernelkite/plugin#") {
                    out.push(val.clone());
                } else {
                    collect_plugins(val, out);
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|x| collect_plugins(x, out)),
        _ => {}
    }
}

#[test]
fn every_readme_example_is_valid_configuration() {
    let plugin = yaml_file("plugin.yml");
    let schema = &plugin["configuration"];
    let readme = std::fs::read_to_string(manifest_dir().join("README.md")).unwrap();
    let found = examples(&readme);
    assert!(
        found.len() >= 4,
        "the README should show the plugin in examples, found {}",
        found.len()
    );
    for ex in &found {
        let errs = errors(schema, ex);
        assert!(errs.is_empty(), "README example {ex}: {errs:#?}");
        kernelkite_hooks::config::parse_config_value(ex)
            .unwrap_or_else(|e| panic!("README example {ex}: {e}"));
    }
    // And the schema catches a wrong example.
    assert!(!errors(schema, &serde_json::json!({"gpu": 1})).is_empty());
}
