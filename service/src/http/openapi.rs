//! `GET /openapi.json`: the API's description, as this service's configuration shapes it.
//!
//! `service/openapi.json` is the document; a few of its limits are settings, so the served
//! copy states this deployment's: `timeout_s`'s maximum is KERNELKITE_MAX_TIMEOUT_S, and
//! `callback_url` is left out where the service has no KERNELKITE_CALLBACK_SECRET (such a
//! request is refused with `422`). A client or a fuzzer reading it is then told what this
//! service accepts, not what some other configuration would.

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse as _, Response};
use serde_json::Value;
use std::sync::Arc;

use crate::config::Config;

/// The document as written in the repository.
pub const DOCUMENT: &str = include_str!("../../openapi.json");

/// The document for `cfg`.
pub fn document(cfg: &Config) -> String {
    let Ok(mut doc) = serde_json::from_str::<Value>(DOCUMENT) else {
        // Unreachable (a unit test parses it); the document as written beats none.
        return DOCUMENT.to_string();
    };
    let request = doc.pointer_mut("/components/schemas/SubmitRequest");
    if let Some(Value::Object(request)) = request {
        if let Some(Value::Object(props)) = request.get_mut("properties") {
            if let Some(Value::Object(t)) = props.get_mut("timeout_s") {
                t.insert("maximum".into(), cfg.max_timeout_s.into());
            }
            if cfg.callbacks.callback_secret.is_none() {
                props.remove("callback_url");
                request.insert(
                    "description".into(),
                    "callback_url is not accepted here: this service has no KERNELKITE_CALLBACK_SECRET to sign callbacks with (long-poll or stream instead)".into(),
                );
            }
        }
    }
    serde_json::to_string_pretty(&doc).unwrap_or_else(|_| DOCUMENT.to_string())
}

/// `GET /openapi.json`
pub(super) async fn serve(State(edge): State<Arc<super::Edge>>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        document(&edge.cfg),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request_schema(doc: &str) -> Value {
        let v: Value = serde_json::from_str(doc).unwrap();
        v.pointer("/components/schemas/SubmitRequest")
            .unwrap()
            .clone()
    }

    /// A validator of the document's `RunConfig` (its `$ref`s resolved in the document).
    fn run_config_schema() -> jsonschema::Validator {
        let doc: Value = serde_json::from_str(DOCUMENT).unwrap();
        let schema = serde_json::json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$ref": "#/components/schemas/RunConfig",
            "components": doc["components"],
        });
        jsonschema::validator_for(&schema).expect("the schema compiles")
    }

    fn runner_accepts(v: &Value) -> bool {
        kernelkite_kernelbot::config::RunConfig::from_json(v.clone()).is_ok()
    }

    /// Issue 34: the document said `config` was any object, so `{}` was schema-valid and
    /// refused 422 (Schemathesis' positive_data_acceptance). Every rule of the runner's that
    /// JSON Schema can say is now in the document: for each field, values of every kind and
    /// at every edge are accepted by the schema exactly when the runner accepts them.
    #[test]
    fn the_documented_run_config_is_what_the_runner_accepts() {
        use serde_json::json;
        let schema = run_config_schema();
        let py = json!({"lang": "py", "mode": "test", "main": "eval.py",
                        "sources": {"eval.py": "", "submission.py": ""}});
        let cu = json!({"lang": "cu", "mode": "benchmark", "sources": {"k.cu": ""}});
        let name_values = [
            json!("a.py"),
            json!("./a.py"),
            json!("a//b.py/"),
            json!("..."),
            json!(" "),
            json!(".x"),
            json!("a/."),
            json!(""),
            json!("."),
            json!("./"),
            json!(".."),
            json!("a/../b"),
            json!("/abs"),
            json!("a\nb"),
            json!("caf\u{e9}"),
            json!("x\u{0}y"),
            json!("a".repeat(255)),
            json!("a".repeat(256)),
        ];
        let odd = [
            json!(null),
            json!(0),
            json!(-1),
            json!(1.5),
            json!(true),
            json!("x"),
            json!([]),
            json!({}),
            json!(["-O3"]),
            json!(["O3"]),
            json!([1]),
            json!({"A": 1}),
            json!({"1A": 1}),
            json!({"A": [1]}),
            json!({"A": null}),
            json!(90),
            json!(10000),
            json!("90a"),
            json!("90ab"),
            json!("9999a"),
            json!("a90"),
            json!(1),
            json!(3600),
            json!(3601),
            json!("last"),
            json!("mean"),
            json!("geom"),
            json!("best"),
            json!(i64::MAX),
            json!(u64::MAX),
            json!(i64::MIN),
            json!([{"size": 1}]),
            json!([{"a\nb": 1}]),
            json!([{"a": "x\u{2028}y"}]),
            json!([{"a": [1, "x\ny"]}]),
            json!([1]),
            json!([{"a": {"b": "c"}}]),
            // One integer to JSON Schema, two to serde: taken as the integer.
            json!(3.0),
            json!(3600.0),
            json!(90.0),
            json!(-0.0),
            json!(2.5),
            // Beyond 64 bits, which kernelbot (Python) takes where it takes any value.
            json!(-145546438093087251609946161152_i128),
            json!([{"n": 99999999999999999999999_u128}]),
        ];
        let fields = [
            "lang",
            "mode",
            "main",
            "arch",
            "defines",
            "include_dirs",
            "libraries",
            "flags",
            "tests",
            "benchmarks",
            "seed",
            "ranking_by",
            "test_timeout",
            "benchmark_timeout",
            "ranked_timeout",
            "multi_gpu",
            "unknown_key",
            "headers",
            "sources",
        ];
        let mut checked = 0;
        let mut disagree = Vec::new();
        for base in [&py, &cu] {
            let mut cases = Vec::new();
            for field in fields {
                for v in odd
                    .iter()
                    .chain(&[json!("py"), json!("cu"), json!("private")])
                {
                    let mut c = base.clone();
                    c[field] = v.clone();
                    cases.push(c);
                }
                let mut c = base.clone();
                c.as_object_mut().unwrap().remove(field);
                cases.push(c);
            }
            for name in &name_values {
                let name = name.as_str().unwrap();
                for field in ["sources", "headers"] {
                    let mut c = base.clone();
                    c[field] = json!({ name: "" });
                    if base["lang"] == "py" && field == "sources" {
                        c["main"] = json!(name);
                    }
                    cases.push(c);
                }
                let mut c = base.clone();
                c["main"] = json!(name);
                cases.push(c);
            }
            for c in cases {
                let (doc, runner) = (schema.is_valid(&c), runner_accepts(&c));
                // The two rules JSON Schema cannot say (the document names them): `main` among
                // `sources`, and no file given twice. The schema is wider there, never narrower.
                let cross_field = doc && !runner && {
                    let e =
                        kernelkite_kernelbot::config::RunConfig::from_json(c.clone()).unwrap_err();
                    matches!(
                        e,
                        kernelkite_kernelbot::config::ConfigError::MainNotInSources(..)
                            | kernelkite_kernelbot::config::ConfigError::DuplicateFile { .. }
                    )
                };
                if doc != runner && !cross_field {
                    disagree.push((c, doc, runner));
                }
                checked += 1;
            }
        }
        assert!(checked > 1000, "{checked}");
        assert!(
            disagree.is_empty(),
            "{} configs where the document and the runner disagree (config, document, runner): {:#?}",
            disagree.len(),
            &disagree[..disagree.len().min(10)]
        );
        // What the issue found: an empty config is not schema-valid.
        assert!(!schema.is_valid(&json!({})));
    }

    #[test]
    fn the_served_document_states_this_services_limits() {
        let mut cfg = Config::new("http://127.0.0.1:1", "o", "p", "t");
        cfg.max_timeout_s = 600;
        let schema = request_schema(&document(&cfg));
        assert_eq!(schema["properties"]["timeout_s"]["maximum"], 600);
        assert!(schema["properties"].get("callback_url").is_none());
        cfg.callbacks.callback_secret = Some(crate::config::Secret::new("s"));
        let schema = request_schema(&document(&cfg));
        assert!(schema["properties"]["callback_url"].is_object());
        // Everything else is the document as written.
        let written: Value = serde_json::from_str(DOCUMENT).unwrap();
        let served: Value = serde_json::from_str(&document(&cfg)).unwrap();
        assert_eq!(written["paths"], served["paths"]);
    }
}
