//! `POST /v1/submissions`, `GET /v1/submissions/{id}[?wait=SECONDS]`,
//! `POST /v1/submissions/{id}/cancel`.

use super::error::ApiError;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use super::edge::{Edge, Phase};
use crate::app::{App, Prepared, SubmitRequest};
use crate::error::{BadRequest, Error, Invalid, Unavailable};
use crate::submission::Submission;

/// Bodies above this are handled on the blocking pool.
const LARGE_BODY: usize = 256 * 1024;

/// `POST /v1/submissions` → `202` with the submission's id, state and status URL; `200` with
/// the same for a repeated `Idempotency-Key` and request; `409` for the key with another
/// request. The client guard has run: the body is read only now, within its limit and
/// timeout.
pub(super) async fn create(
    State(app): State<Arc<App>>,
    State(edge): State<Arc<Edge>>,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    if edge.phase() != Phase::Serving {
        return Err(Unavailable::ShuttingDown.into());
    }
    let key = match headers.get("idempotency-key") {
        Some(v) => Some(
            v.to_str()
                .map_err(|_| BadRequest::IdempotencyKey)?
                .to_string(),
        ),
        None => None,
    };
    let (body, _) = edge
        .read_body(
            body,
            edge.cfg.edge.max_submission_bytes,
            "KERNELKITE_MAX_SUBMISSION_BYTES",
            false,
        )
        .await?;
    let large = body.len() > LARGE_BODY;
    let accept = {
        let app = app.clone();
        move || -> Result<Prepared, Error> {
            let req: SubmitRequest = serde_json::from_slice(&body).map_err(|e| -> Error {
                // Well-formed JSON of the wrong shape is refused; anything else is unreadable.
                if e.is_data() {
                    Invalid::Shape(e).into()
                } else {
                    BadRequest::NotJson(e).into()
                }
            })?;
            app.prepare(req, key)
        }
    };
    // Parsing, validating and compressing a large config takes milliseconds of CPU; that
    // work must not stall the runtime threads that carry webhooks and long-polls.
    let prepared = if large {
        tokio::task::spawn_blocking(accept)
            .await
            .map_err(|e| Error::Internal {
                what: "submission worker",
                source: e.into(),
            })??
    } else {
        accept()?
    };
    let submitted = app.accept(prepared).await?;
    let sub = submitted.submission;
    let url = app.status_url(&sub.id);
    let status = if submitted.created {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    let mut r = (
        status,
        Json(json!({ "id": sub.id, "state": sub.state, "status_url": url, "place": sub.place })),
    )
        .into_response();
    if let Ok(v) = HeaderValue::from_str(&url) {
        r.headers_mut().insert(header::LOCATION, v);
    }
    Ok(r)
}

/// The query of `GET /v1/submissions/{id}`.
#[derive(Debug, Deserialize)]
pub(super) struct WaitQuery {
    /// Seconds to wait for the submission to end (fractions allowed).
    wait: Option<f64>,
}

/// `GET /v1/submissions/{id}[?wait=SECONDS]`. When the service starts shutting down, a
/// waiting request is answered at once with the submission as it is, as if its wait had run
/// out: the client polls again (elsewhere, or after the restart).
pub(super) async fn get(
    State(app): State<Arc<dyn super::Reader>>,
    State(edge): State<Arc<Edge>>,
    Path(id): Path<String>,
    query: Result<Query<WaitQuery>, QueryRejection>,
) -> Result<Json<Submission>, ApiError> {
    let Query(q) = query.map_err(|e| BadRequest::Query(e.into()))?;
    let wait = match q.wait {
        Some(w) if !w.is_finite() || w < 0.0 => return Err(BadRequest::Wait.into()),
        // try_: a KERNELKITE_MAX_WAIT_S near u64::MAX lets `wait` exceed Duration's range.
        Some(w) => Duration::try_from_secs_f64(w.min(edge.cfg.edge.max_wait_s as f64))
            .unwrap_or(Duration::MAX),
        None => Duration::ZERO,
    };
    if wait.is_zero() {
        return Ok(Json(app.get(&id, wait).await?));
    }
    let got = tokio::select! {
        r = app.get(&id, wait) => r,
        () = edge.stopping() => app.get(&id, Duration::ZERO).await,
    };
    Ok(Json(got?))
}

/// `POST /v1/submissions/{id}/cancel`
pub(super) async fn cancel(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Json<Submission>, ApiError> {
    Ok(Json(app.cancel(&id).await?))
}

/// A method `/v1/submissions/{id}` does not have: `405` with the methods it has, and for a
/// DELETE (this API's cancel before `POST …/cancel`) where to send it instead. A DELETE would
/// remove the submission (RFC 9110), and this API keeps a canceled one readable.
pub(super) async fn other_method(method: axum::http::Method) -> axum::response::Response {
    let error = if method == axum::http::Method::DELETE {
        "cancel a submission with POST /v1/submissions/{id}/cancel (it stays readable, canceled); DELETE is not a method of this resource".to_string()
    } else {
        format!("{method} is not a method of /v1/submissions/{{id}} (GET reads it; POST /v1/submissions/{{id}}/cancel cancels it)")
    };
    let mut r = (
        axum::http::StatusCode::METHOD_NOT_ALLOWED,
        Json(serde_json::json!({ "error": error })),
    )
        .into_response();
    r.headers_mut().insert(
        axum::http::header::ALLOW,
        axum::http::HeaderValue::from_static("GET,HEAD"),
    );
    r
}
