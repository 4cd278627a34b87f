//! The fleet: `GET /v1/fleet` (what the dashboard shows, `kernelkite_core::overview`), its
//! live stream `GET /v1/fleet/events`, an operator's `POST /v1/fleet/slices/{id}/canary` and
//! `POST|DELETE /v1/fleet/slices/{id}/quarantine`, and `GET /dashboard`, the page itself.
//!
//! The page is one file served by the binary (no build step, no CDN): it holds no data and no
//! secret, so it is served to anyone; what it shows comes from `/v1/fleet`, which needs the
//! API token or the read-only dashboard token (KERNELKITE_DASHBOARD_TOKEN), or a loopback
//! client when no API token is set.
//!
//! The stream sends the whole overview as one `fleet` event when it connects and again each
//! time it changed: at once for a change of the fleet (a run's end, a canary, a quarantine),
//! within [`TICK`] for the queues' counts, at most every [`MIN_GAP`]. One overview is built for
//! every stream at a time ([`Cache`]), so ten screens cost what one does.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde::Deserialize;

use super::error::ApiError;
use crate::app::App;
use crate::error::{BadRequest, Error};

/// The dashboard page.
const PAGE: &str = include_str!("dashboard.html");

/// How often a stream looks at the queues' counts when the fleet did not change.
const TICK: Duration = Duration::from_millis(500);
/// The least time between two events of a stream.
const MIN_GAP: Duration = Duration::from_millis(200);
/// How long a built overview is shared by the streams and reads asking for it.
const FRESH: Duration = Duration::from_millis(150);

/// The last overview built, encoded, shared by every reader.
#[derive(Default)]
pub struct Cache {
    last: Mutex<Option<(Instant, Bytes)>>,
}

impl Cache {
    /// The overview as JSON, built now unless one younger than [`FRESH`] is at hand (or
    /// `fresh` asks for a new one: the fleet changed).
    fn get(&self, app: &App, fresh: bool) -> Bytes {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, b)) = last.as_ref() {
            if !fresh && at.elapsed() < FRESH {
                return b.clone();
            }
        }
        let body = Bytes::from(serde_json::to_vec(&app.overview()).unwrap_or_default());
        *last = Some((Instant::now(), body.clone()));
        body
    }
}

/// `GET /dashboard`.
pub(super) async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // Nothing of it may be framed, sniffed or loaded from elsewhere.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'",
            ),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        PAGE,
    )
        .into_response()
}

/// `GET /v1/fleet`.
pub(super) async fn overview(
    State(app): State<Arc<App>>,
    State(cache): State<Arc<Cache>>,
) -> Response {
    let body = cache.get(&app, false);
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// A stream's state.
struct Streamer {
    app: std::sync::Weak<App>,
    cache: Arc<Cache>,
    changes: tokio::sync::watch::Receiver<u64>,
    stopping: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
    sent: Option<Bytes>,
    first: bool,
}

/// `GET /v1/fleet/events`: `event: fleet` with the overview, now and on every change, until
/// the service stops serving.
pub(super) async fn events(
    State(app): State<Arc<App>>,
    State(cache): State<Arc<Cache>>,
    State(edge): State<Arc<super::Edge>>,
) -> Response {
    let state = Streamer {
        app: Arc::downgrade(&app),
        cache,
        changes: app.fleet().changes(),
        stopping: Box::pin(edge.stopping()),
        sent: None,
        first: true,
    };
    drop(app);
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        if !st.first {
            tokio::select! {
                () = tokio::time::sleep(MIN_GAP) => {}
                () = &mut st.stopping => return None,
            }
        }
        st.first = false;
        loop {
            let fleet_moved = st.changes.has_changed().unwrap_or(false);
            if fleet_moved {
                st.changes.borrow_and_update();
            }
            let body = {
                let app = st.app.upgrade()?;
                st.cache.get(&app, fleet_moved)
            };
            // Sent only when it says something new (`generated_at` aside).
            if st.sent.as_ref().is_none_or(|s| differs(s, &body)) {
                let mut event = Vec::with_capacity(body.len() + 32);
                event.extend_from_slice(b"event: fleet\ndata: ");
                event.extend_from_slice(&body);
                event.extend_from_slice(b"\n\n");
                st.sent = Some(body);
                return Some((Ok::<_, std::convert::Infallible>(Bytes::from(event)), st));
            }
            tokio::select! {
                r = st.changes.changed() => if r.is_err() { return None },
                () = tokio::time::sleep(TICK) => {}
                () = &mut st.stopping => return None,
            }
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .header("x-accel-buffering", "no")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// Whether two encoded overviews differ in more than when they were built.
fn differs(a: &[u8], b: &[u8]) -> bool {
    fn rest(x: &[u8]) -> &[u8] {
        // `{"generated_at":"…",` comes first (the field order is the struct's).
        let skip = x.iter().position(|c| *c == b',').map_or(0, |i| i + 1);
        &x[skip..]
    }
    rest(a) != rest(b)
}

/// `POST /v1/fleet/slices/{id}/canary`: a canary on the slice as soon as it can run.
pub(super) async fn canary(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    if !app.fleet().schedule().enabled {
        return Err(Error::from(crate::error::Invalid::Canary).into());
    }
    app.request_canary(&id).map_err(Error::from)?;
    Ok((
        StatusCode::ACCEPTED,
        Json(serde_json::json!({"slice": id, "canary": "requested"})),
    )
        .into_response())
}

/// The body of `POST /v1/fleet/slices/{id}/quarantine`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct QuarantineRequest {
    reason: String,
}

/// `POST /v1/fleet/slices/{id}/quarantine {"reason": …}`: an operator takes the slice out of
/// ranking (maintenance, a suspicion) until released.
pub(super) async fn quarantine(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: QuarantineRequest = serde_json::from_slice(&body).map_err(BadRequest::NotJson)?;
    let reason = req.reason.trim();
    if reason.is_empty() || reason.len() > 500 {
        return Err(Error::from(crate::error::Invalid::Reason).into());
    }
    app.set_quarantine(&id, Some(reason.to_string()))
        .map_err(Error::from)?;
    Ok(Json(serde_json::json!({"slice": id, "quarantined": true})).into_response())
}

/// `DELETE /v1/fleet/slices/{id}/quarantine`: an operator puts the slice back.
pub(super) async fn release(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    app.set_quarantine(&id, None).map_err(Error::from)?;
    Ok(Json(serde_json::json!({"slice": id, "quarantined": false})).into_response())
}
