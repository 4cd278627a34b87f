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

use crate::app::App;
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
pub(super) async fn serve(State(app): State<Arc<App>>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        document(&app.cfg),
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
