//! `POST /webhooks/buildkite`: verify, then parse, then commit the state change, then answer;
//! collecting a finished build's result runs in the background.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use serde_json::{json, Value};

use super::error::body_error;
use crate::app::App;
use crate::error::Error;

/// `POST /webhooks/buildkite` → `200 {"ok": true}` once the delivery is verified and read.
pub(super) async fn buildkite(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, Error> {
    let body =
        body.map_err(|r| body_error(r, app.cfg.webhook_max_bytes, "KERNELKITE_WEBHOOK_MAX_BYTES"))?;
    if let Some(event) = app.webhooks.receive(&headers, &body, (app.clock)())? {
        // Answered once the change is committed (commit, then acknowledge).
        app.handle_event(event).await;
    }
    Ok(Json(json!({ "ok": true })))
}
