//! HTTP handlers: the submission API under `/v1`, and Buildkite's webhook.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{ConnectInfo, Path, Query, Request, State as AxState};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::Stream;
use serde::Deserialize;
use serde_json::json;

use crate::app::{ApiError, App, SubmitRequest};
use crate::submission::{State, Submission};
use crate::webhook::{parse_delivery, HEADER_EVENT};

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(json!({ "error": self.message }))).into_response()
    }
}

/// Guards `/v1`: the bearer token when one is configured, else loopback clients only.
pub async fn require_client(AxState(app): AxState<Arc<App>>, req: Request, next: Next) -> Response {
    match &app.cfg.api_token {
        Some(token) => {
            let given = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            if !given.is_some_and(|g| token.matches(g.as_bytes())) {
                let mut r = ApiError::new(
                    401,
                    "missing or wrong bearer token (Authorization: Bearer <KERNELKITE_API_TOKEN>)",
                )
                .into_response();
                r.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                return r;
            }
        }
        None => {
            let loopback = req
                .extensions()
                .get::<ConnectInfo<SocketAddr>>()
                .is_some_and(|c| c.0.ip().is_loopback());
            if !loopback {
                return ApiError::new(
                    403,
                    "KERNELKITE_API_TOKEN is not set, so only loopback clients are served",
                )
                .into_response();
            }
        }
    }
    next.run(req).await
}

/// Bodies above this are handled on the blocking pool.
const LARGE_BODY: usize = 256 * 1024;

/// `POST /v1/submissions`
pub async fn create_submission(
    AxState(app): AxState<Arc<App>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let large = body.len() > LARGE_BODY;
    let accept = {
        let app = app.clone();
        move || -> Result<Submission, ApiError> {
            let req: SubmitRequest = serde_json::from_slice(&body).map_err(|e| {
                let status = if e.is_data() { 422 } else { 400 };
                ApiError::new(status, format!("request body is not a submission: {e}"))
            })?;
            app.submit(req)
        }
    };
    // Parsing, validating and compressing a large config takes milliseconds of CPU; that
    // work must not stall the runtime threads that carry webhooks and long-polls.
    let sub = if large {
        tokio::task::spawn_blocking(accept)
            .await
            .map_err(|_| ApiError::new(500, "submission worker failed; retry"))??
    } else {
        accept()?
    };
    let url = app.status_url(&sub.id);
    let mut r = (
        StatusCode::ACCEPTED,
        Json(json!({ "id": sub.id, "state": sub.state, "status_url": url })),
    )
        .into_response();
    if let Ok(v) = HeaderValue::from_str(&url) {
        r.headers_mut().insert(header::LOCATION, v);
    }
    Ok(r)
}

#[derive(Debug, Deserialize)]
pub struct WaitQuery {
    /// Seconds to wait for the submission to end (fractions allowed).
    pub wait: Option<f64>,
}

/// `GET /v1/submissions/{id}[?wait=SECONDS]`
pub async fn get_submission(
    AxState(app): AxState<Arc<App>>,
    Path(id): Path<String>,
    query: Result<Query<WaitQuery>, QueryRejection>,
) -> Result<Json<Submission>, ApiError> {
    let Query(q) =
        query.map_err(|e| ApiError::new(400, format!("bad query: {e}; use ?wait=SECONDS")))?;
    let wait = match q.wait {
        Some(w) if !w.is_finite() || w < 0.0 => {
            return Err(ApiError::new(
                400,
                "wait must be a non-negative number of seconds",
            ))
        }
        Some(w) => w.min(app.cfg.max_wait_s as f64),
        None => 0.0,
    };
    if wait > 0.0 {
        if let Some(mut rx) = app.store.subscribe(&id) {
            // Sleeps on the submission's channel: woken by the change itself, no polling.
            // try_: a KERNELKITE_MAX_WAIT_S near u64::MAX lets `wait` exceed Duration's range.
            let _ = tokio::time::timeout(
                Duration::try_from_secs_f64(wait).unwrap_or(Duration::MAX),
                rx.wait_for(|s| s.state.is_terminal()),
            )
            .await;
            let s = rx.borrow().clone();
            return Ok(Json(s));
        }
    }
    app.lookup(&id)
        .await
        .map(Json)
        .ok_or_else(|| ApiError::new(404, format!("no submission {id}")))
}

/// `DELETE /v1/submissions/{id}`
pub async fn cancel_submission(
    AxState(app): AxState<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Json<Submission>, ApiError> {
    match app.cancel(&id) {
        // Not in memory may still mean finished long ago (kept in the data dir only).
        Err(e) if e.status == 404 => match app.lookup(&id).await {
            Some(s) if s.state == crate::submission::State::Canceled => Ok(Json(s)),
            Some(s) => Err(ApiError::new(
                409,
                format!("submission already ended: {}", s.state.as_str()),
            )),
            None => Err(e),
        },
        r => r.map(Json),
    }
}

/// `GET /v1/submissions/{id}/events`: one SSE event per state change. `Last-Event-ID` resumes.
pub async fn submission_events(
    AxState(app): AxState<Arc<App>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let start = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<usize>().ok())
        // Client-chosen: `usize::MAX` must not overflow (it means "after everything").
        .map_or(0, |n| n.saturating_add(1));
    let source = match app.store.subscribe(&id) {
        Some(rx) => EventSource::Live(rx),
        None => match app.lookup(&id).await {
            Some(s) => EventSource::Done(Box::new(s)),
            None => return Err(ApiError::new(404, format!("no submission {id}"))),
        },
    };
    let stream = futures_util::stream::unfold((source, start), |(mut source, next)| async move {
        loop {
            let snapshot = match &mut source {
                EventSource::Live(rx) => rx.borrow_and_update().clone(),
                EventSource::Done(s) => (**s).clone(),
            };
            if next < snapshot.history.len() {
                let ev = state_event(&snapshot, next);
                return Some((Ok(ev), (source, next + 1)));
            }
            if snapshot.state.is_terminal() {
                return None;
            }
            match &mut source {
                EventSource::Live(rx) => {
                    if rx.changed().await.is_err() {
                        return None;
                    }
                }
                EventSource::Done(_) => return None,
            }
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

enum EventSource {
    Live(tokio::sync::watch::Receiver<Submission>),
    Done(Box<Submission>),
}

/// `event: <state>`, `id: <index in history>`, data `{"id","seq","state","at"}`; the terminal
/// event's data also holds the whole submission (`"submission"`).
fn state_event(s: &Submission, seq: usize) -> Event {
    /// Serialized directly (never through `serde_json::Value`), so the result's JSON text is
    /// written verbatim.
    #[derive(serde::Serialize)]
    struct StateEvent<'a> {
        id: &'a str,
        seq: usize,
        state: State,
        at: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        submission: Option<&'a Submission>,
    }
    let t = &s.history[seq];
    let data = StateEvent {
        id: &s.id,
        seq,
        state: t.state,
        at: t.at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        submission: t.state.is_terminal().then_some(s),
    };
    let event = Event::default().event(t.state.as_str()).id(seq.to_string());
    // `data` (not `json_data`, which drops line breaks): a result written with line breaks
    // goes out as several `data:` lines, which clients join back with the same breaks.
    match serde_json::to_string(&data) {
        Ok(text) => event.data(text),
        // Unreachable for these types; an event without data still marks the state.
        Err(e) => {
            tracing::error!("cannot encode the {} event: {e}", t.state.as_str());
            event
        }
    }
}

/// `POST /webhooks/buildkite`: verify, then parse, then answer; the work runs in the background.
pub async fn buildkite_webhook(
    AxState(app): AxState<Arc<App>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(e) = app.webhook_auth.verify(&headers, &body, (app.clock)()) {
        tracing::warn!(reason = %e, "webhook refused");
        return ApiError::new(401, e.to_string()).into_response();
    }
    let header_event = headers.get(HEADER_EVENT).and_then(|v| v.to_str().ok());
    match parse_delivery(header_event, &app.cfg.buildkite_pipeline, &body) {
        Ok(d) => {
            app.on_delivery(d);
            (StatusCode::OK, Json(json!({ "ok": true }))).into_response()
        }
        Err(e) => {
            tracing::warn!(error = %e, "verified webhook has an unreadable body");
            ApiError::new(400, e.to_string()).into_response()
        }
    }
}

/// `GET /openapi.json`
pub async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        include_str!("../openapi.json"),
    )
        .into_response()
}
