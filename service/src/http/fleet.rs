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

use std::sync::Arc;
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
/// A comment line sent after this long without an event, so proxies and clients see the
/// stream is alive, and a client that left is found out.
const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// How long a built overview is shared by the streams and reads asking for it.
const FRESH: Duration = Duration::from_millis(150);

/// The last overview built, encoded, shared by every reader: built once per change of the
/// fleet (its version) and at most once per [`FRESH`] otherwise, however many streams and
/// readers ask.
#[derive(Default)]
pub struct Cache {
    last: tokio::sync::Mutex<Option<(Instant, u64, Bytes)>>,
}

impl Cache {
    /// The overview as JSON: the one at hand when it is of the fleet's current version and
    /// younger than [`FRESH`], else built now (off the async threads).
    async fn get(&self, app: &Arc<App>) -> Bytes {
        let version = *app.fleet().changes().borrow();
        let mut last = self.last.lock().await;
        if let Some((at, v, b)) = last.as_ref() {
            if *v == version && at.elapsed() < FRESH {
                return b.clone();
            }
        }
        let a = app.clone();
        let body = tokio::task::spawn_blocking(move || {
            Bytes::from(serde_json::to_vec(&a.overview()).unwrap_or_default())
        })
        .await
        .unwrap_or_default();
        *last = Some((Instant::now(), version, body.clone()));
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
    let body = cache.get(&app).await;
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
    /// When the last bytes went out.
    wrote: tokio::time::Instant,
    /// When the stream ends (the page connects again at once): no request is held longer
    /// than KERNELKITE_MAX_WAIT_S.
    until: tokio::time::Instant,
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
        wrote: tokio::time::Instant::now(),
        until: tokio::time::Instant::now() + Duration::from_secs(edge.cfg.edge.max_wait_s.max(1)),
    };
    drop(app);
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        if !st.first {
            tokio::select! {
                () = tokio::time::sleep(MIN_GAP) => {}
                () = &mut st.stopping => return None,
            }
            if tokio::time::Instant::now() >= st.until {
                return None;
            }
        }
        st.first = false;
        loop {
            if st.changes.has_changed().unwrap_or(false) {
                st.changes.borrow_and_update();
            }
            let body = {
                let app = st.app.upgrade()?;
                st.cache.get(&app).await
            };
            // Sent only when it says something new (`generated_at` aside).
            if st.sent.as_ref().is_none_or(|s| differs(s, &body)) {
                let mut event = Vec::with_capacity(body.len() + 32);
                event.extend_from_slice(b"event: fleet\ndata: ");
                event.extend_from_slice(&body);
                event.extend_from_slice(b"\n\n");
                st.sent = Some(body);
                st.wrote = tokio::time::Instant::now();
                return Some((Ok::<_, std::convert::Infallible>(Bytes::from(event)), st));
            }
            if st.wrote.elapsed() >= KEEP_ALIVE {
                st.wrote = tokio::time::Instant::now();
                return Some((Ok(Bytes::from_static(b": keep-alive\n\n")), st));
            }
            tokio::select! {
                r = st.changes.changed() => if r.is_err() { return None },
                () = tokio::time::sleep(TICK) => {}
                () = &mut st.stopping => return None,
                () = tokio::time::sleep_until(st.until) => return None,
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
    // An unknown slice is a 404 whether canaries run or not.
    if app.fleet().slice(&id).is_none() {
        return Err(Error::from(kernelkite_core::fleet::UnknownSlice(id)).into());
    }
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
    // The document's rule (`pattern: \S`, 1-500 characters), with JSON Schema's (ECMAScript's)
    // idea of a space, so a reason the document accepts is never refused.
    let reason = req.reason.trim_matches(ecma_space);
    if reason.is_empty() || req.reason.chars().count() > 500 {
        return Err(Error::from(crate::error::Invalid::Reason).into());
    }
    app.set_quarantine(&id, Some(reason.to_string()))
        .map_err(Error::from)?;
    Ok(Json(serde_json::json!({"slice": id, "quarantined": true})).into_response())
}

/// ECMAScript's `\s`: its white space and line terminators.
fn ecma_space(c: char) -> bool {
    matches!(
        c,
        '\t' | '\n' | '\u{b}' | '\u{c}' | '\r' | ' ' | '\u{a0}' | '\u{1680}' | '\u{2000}'
            ..='\u{200a}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{202f}'
                | '\u{205f}'
                | '\u{3000}'
                | '\u{feff}'
    )
}

/// `DELETE /v1/fleet/slices/{id}/quarantine`: an operator puts the slice back.
pub(super) async fn release(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    app.set_quarantine(&id, None).map_err(Error::from)?;
    Ok(Json(serde_json::json!({"slice": id, "quarantined": false})).into_response())
}
