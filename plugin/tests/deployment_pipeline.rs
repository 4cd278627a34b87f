//! The example pipeline in `deployment/` configures this plugin with keys the plugin accepts:
//! a renamed or retyped key fails here, not in a vendor's first build.

use kernelkite_isolate::config::parse_config_value;
use serde_json::Value;

#[test]
fn example_pipeline_plugin_config_is_accepted_by_the_parser() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deployment/pipelines/kernelbot.yml"
    );
    let text = std::fs::read_to_string(path).expect("deployment/pipelines/kernelbot.yml");
    let yaml: serde_norway::Value = serde_norway::from_str(&text).expect("pipeline is YAML");
    let pipeline: Value = serde_json::to_value(yaml).expect("YAML as JSON");
    let mut checked = 0;
    for step in pipeline["steps"].as_array().expect("steps") {
        for plugin in step["plugins"].as_array().into_iter().flatten() {
            for (reference, config) in plugin.as_object().expect("plugin map") {
                if reference.contains("/plugin#") {
                    parse_config_value(config)
                        .unwrap_or_else(|e| panic!("{reference} in {path} is misconfigured: {e}"));
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(
        checked, 1,
        "the example pipeline should use the plugin once"
    );
}
