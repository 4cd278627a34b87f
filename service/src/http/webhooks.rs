//! `POST /webhooks/buildkite`: check what can be checked without the body, read the body
//! within its limits, verify, parse, commit the state change, then answer; collecting a
//! finished build's result runs in the background.
//!
//! Nobody is authenticated until the MAC over the body checks out, so until then the body
//! costs the sender more than it costs the service: the size, the signature header's form and
//! its timestamp window are checked before a byte of the body is read; the body is read with
//! a size limit and a timeout, and only while the memory all unverified bodies hold together
//! stays within KERNELKITE_UNAUTHENTICATED_BODY_BUDGET_BYTES; and the connection may be
//! closed to make room for others while it is being read.

use super::error::ApiError;
use std::sync::Arc;

use axum::body::HttpBody as _;
use axum::extract::{Request, State};
use axum::Json;
use serde_json::{json, Value};

use super::edge::Edge;
use super::server::{unauthenticated, ConnSlot};
use crate::buildkite::webhook::{WebhookError, WebhookReceiver};
use crate::error::{BadRequest, Error, Unauthorized, WebhookRefusal};
use crate::executor::Events;
use crate::metrics::ReasonLabel;

/// `POST /webhooks/buildkite` → `200 {"ok": true}` once the delivery is verified and read.
pub(super) async fn buildkite(
    State(edge): State<Arc<Edge>>,
    State(webhooks): State<Arc<WebhookReceiver>>,
    State(events): State<Arc<dyn Events>>,
    req: Request,
) -> Result<Json<Value>, ApiError> {
    let (parts, body) = req.into_parts();
    let limit = edge.cfg.edge.webhook_max_bytes;
    const SETTING: &str = "KERNELKITE_WEBHOOK_MAX_BYTES";
    if body.size_hint().lower() > limit as u64 {
        refused(
            &edge,
            "too_large",
            &"body over KERNELKITE_WEBHOOK_MAX_BYTES",
        );
        return Err(Error::PayloadTooLarge {
            limit,
            setting: SETTING,
        }
        .into());
    }
    let now = chrono::Utc::now().timestamp();
    // Relayed by the replica that received it, which verified it (and relays no signature).
    let vouched = parts.extensions.get::<super::Vouched>().is_some();
    if vouched {
        let (body, _) = edge.read_body(body, limit, SETTING, false).await?;
        return match webhooks.read(&parts.headers, &body) {
            Ok(Some(event)) => {
                events.deliver(event).await;
                Ok(Json(json!({ "ok": true })))
            }
            Ok(None) => Ok(Json(json!({ "ok": true }))),
            Err(e) => Err(BadRequest::Webhook(WebhookRefusal::new(e)).into()),
        };
    }
    if let Err(e) = webhooks.auth.precheck(&parts.headers, now) {
        refused(&edge, e.reason(), &e);
        return Err(Unauthorized::Webhook(WebhookRefusal::new(e)).into());
    }
    let reading = unauthenticated(parts.extensions.get::<ConnSlot>());
    let (body, _budget) = match edge.read_body(body, limit, SETTING, true).await {
        Ok(b) => b,
        Err(e) => {
            // Budget and timeout refusals are counted by the reader.
            if matches!(e, Error::PayloadTooLarge { .. }) {
                refused(&edge, "too_large", &e);
            }
            return Err(e.into());
        }
    };
    drop(reading);
    match webhooks.receive(&parts.headers, &body, now) {
        // Into the core the one way every executor's events go, and answered once the change
        // is committed (commit, then acknowledge).
        Ok(Some(event)) => events.deliver(event).await,
        Ok(None) => {}
        Err(WebhookError::Auth(e)) => {
            refused(&edge, e.reason(), &e);
            return Err(Unauthorized::Webhook(WebhookRefusal::new(e)).into());
        }
        Err(WebhookError::Parse(e)) => {
            return Err(BadRequest::Webhook(WebhookRefusal::new(e)).into())
        }
    }
    Ok(Json(json!({ "ok": true })))
}

/// Counts a refused webhook by reason and logs it: at most one line per reason
/// per [`super::edge::LOG_INTERVAL`], saying how many were left out.
pub(super) fn refused(edge: &Edge, reason: &'static str, why: &dyn std::fmt::Display) {
    edge.metrics
        .webhook_rejections
        .get_or_create(&ReasonLabel {
            reason: reason.to_string(),
        })
        .inc();
    if let Some(suppressed) = edge.log.allow(reason) {
        // The request's span carries the peer and the request id.
        tracing::warn!(reason, suppressed, "webhook refused: {why}");
    }
}
