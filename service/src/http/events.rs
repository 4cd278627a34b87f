//! `GET /v1/submissions/{id}/events`: one server-sent event per state change.
//!
//! The `text/event-stream` encoding is written here rather than with axum's `Sse` so that a
//! finished submission's events are encoded once and shared: the terminal event holds the
//! whole submission, its result included (up to KERNELKITE_MAX_ARTIFACT_BYTES), and every
//! stream of it sends the same bytes instead of a copy of its own. With the connection
//! layer's write-stall deadline (KERNELKITE_WRITE_STALL_S), a client that stops reading
//! holds neither its connection nor a copy of the result for long (issue 21, item 5).

use super::error::ApiError;
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State as AxState};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse as _, Response};
use bytes::Bytes;

use super::edge::Edge;
use crate::app::Watch;
use crate::submission::{Place, State, Submission};

/// How soon a client should reconnect after the service ended its stream to shut down.
pub(super) const RECONNECT: Duration = Duration::from_secs(1);

/// A comment line sent after this long without an event, so proxies and clients see the
/// stream is alive (axum's default interval, which the stream used before).
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// Finished submissions' encoded events, shared by every stream sending them; an entry lives
/// as long as a stream holds it.
#[derive(Default)]
pub struct Finished {
    map: Mutex<HashMap<String, Weak<Encoded>>>,
}

/// Every event of a finished submission, encoded, in history order.
pub struct Encoded(Vec<Bytes>);

impl Finished {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Weak<Encoded>>> {
        // A plain map: a panic elsewhere while holding it leaves nothing half-done.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The events of finished submission `id`, if a stream is sending them now.
    fn get(&self, id: &str) -> Option<Arc<Encoded>> {
        self.lock().get(id).and_then(Weak::upgrade)
    }

    /// The events of `s` (finished), encoded now unless a stream already holds them.
    fn get_or_encode(&self, s: &Submission) -> Arc<Encoded> {
        if let Some(e) = self.get(&s.id) {
            return e;
        }
        // Encoded outside the lock: a large result takes a while, and other streams go on.
        let fresh = Arc::new(Encoded(
            (0..s.history.len()).map(|i| state_event(s, i)).collect(),
        ));
        let mut map = self.lock();
        if let Some(e) = map.get(&s.id).and_then(Weak::upgrade) {
            return e; // another stream finished encoding first: share its copy
        }
        // Entries whose streams all ended are dropped now and then, not one by one.
        if map.len() >= 64 && map.len().is_power_of_two() {
            map.retain(|_, w| w.strong_count() > 0);
        }
        map.insert(s.id.clone(), Arc::downgrade(&fresh));
        fresh
    }
}

/// Where a stream's events come from.
enum Source {
    /// In flight: encoded one at a time as they happen, until the terminal one.
    Live(tokio::sync::watch::Receiver<Submission>),
    /// Finished: shared.
    Finished(Arc<Encoded>),
}

/// A stream's state between events.
struct Stream {
    source: Source,
    /// The next state event's index in the history.
    next: usize,
    /// `None` once the shutdown event went out.
    stopping: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    _edge: Arc<Edge>,
    finished: Arc<Finished>,
    /// The place last sent.
    place: Option<Place>,
}

/// What a live stream does next.
enum Step {
    Send(Bytes),
    /// A `queue` event: the submission's place moved.
    Place(Bytes, Place),
    Finished(Arc<Encoded>),
    End,
    Wait,
}

/// One SSE event per state change, the history so far first. `Last-Event-ID` resumes. When
/// the service starts shutting down, the stream ends after the events so far with a
/// `retry:` hint, so the client reconnects (elsewhere, or after the restart) with
/// `Last-Event-ID` and misses nothing.
pub(super) async fn stream(
    AxState(app): AxState<Arc<dyn super::Reader>>,
    AxState(edge): AxState<Arc<Edge>>,
    AxState(finished): AxState<Arc<Finished>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let start = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<usize>().ok())
        // Client-chosen: `usize::MAX` must not overflow (it means "after everything").
        .map_or(0, |n| n.saturating_add(1));
    let source = match finished.get(&id) {
        Some(encoded) => Source::Finished(encoded),
        None => match app.watch(&id).await? {
            Watch::Live(rx) => Source::Live(rx),
            // The submission read from the store is dropped here; only the encoding stays.
            Watch::Done(s) => Source::Finished(finished.get_or_encode(&s)),
        },
    };
    let stopping: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(edge.stopping());
    // The edge rides along: a stream keeps it (and so its phase) alive, as it keeps the cache.
    let state = Stream {
        source,
        next: start,
        stopping: Some(stopping),
        _edge: edge,
        finished,
        place: None,
    };
    let events = futures_util::stream::unfold(state, |mut st| async move {
        // `None`: the shutdown event went out; the stream is over.
        let mut stopping = st.stopping.take()?;
        loop {
            let rx = match &mut st.source {
                Source::Finished(encoded) => {
                    let event = encoded.0.get(st.next)?.clone();
                    st.next += 1;
                    st.stopping = Some(stopping);
                    return Some((event, st));
                }
                Source::Live(rx) => rx,
            };
            match live_step(&st.finished, rx, st.next, st.place.as_ref()) {
                Step::Send(event) => {
                    st.next += 1;
                    st.stopping = Some(stopping);
                    return Some((event, st));
                }
                Step::Place(event, place) => {
                    st.place = Some(place);
                    st.stopping = Some(stopping);
                    return Some((event, st));
                }
                Step::Finished(encoded) => st.source = Source::Finished(encoded),
                Step::End => return None,
                Step::Wait => tokio::select! {
                    r = rx.changed() => if r.is_err() {
                        return None;
                    },
                    () = &mut stopping => {
                        let bye = encode_comment_and_retry(
                            "shutting down; reconnect with Last-Event-ID",
                            RECONNECT,
                        );
                        return Some((bye, st));
                    }
                    () = tokio::time::sleep(KEEP_ALIVE) => {
                        let ping = Bytes::from_static(b":\n\n");
                        st.stopping = Some(stopping);
                        return Some((ping, st));
                    }
                },
            }
        }
    });
    let body = Body::from_stream(futures_util::StreamExt::map(events, Ok::<_, Infallible>));
    Ok((
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response())
}

/// The next step of a live stream at event `next`. Reads the submission in place (never a
/// copy of it: a result can be large); the terminal event switches to the shared encoding.
fn live_step(
    finished: &Finished,
    rx: &mut tokio::sync::watch::Receiver<Submission>,
    next: usize,
    sent: Option<&Place>,
) -> Step {
    let s = rx.borrow_and_update();
    match s.history.get(next) {
        Some(t) if t.state.is_terminal() => Step::Finished(finished.get_or_encode(&s)),
        Some(_) => Step::Send(state_event(&s, next)),
        None if s.state.is_terminal() => Step::End,
        None => match &s.place {
            Some(p) if Place::moved(sent, Some(p)) => Step::Place(place_event(&s.id, p), p.clone()),
            _ => Step::Wait,
        },
    }
}

/// `event: queue` with data `{"id","position","estimated_wait_s","estimated_start_at"}`, and
/// no `id:` line: a place is not part of the history `Last-Event-ID` counts, so a client
/// that reconnects resumes its state events where it was and gets the place then current.
fn place_event(id: &str, p: &Place) -> Bytes {
    #[derive(serde::Serialize)]
    struct PlaceEvent<'a> {
        id: &'a str,
        #[serde(flatten)]
        place: &'a Place,
    }
    let data = serde_json::to_string(&PlaceEvent { id, place: p }).unwrap_or_default();
    Bytes::from(format!("event: queue\ndata: {data}\n\n"))
}

/// `event: <state>`, `id: <index in history>`, data `{"id","seq","state","at"}`; the terminal
/// event's data also holds the whole submission (`"submission"`).
fn state_event(s: &Submission, seq: usize) -> Bytes {
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
    // Serialized straight after the event's head: one buffer the size of the submission,
    // split into lines only when the text has line breaks (a result written with them).
    let mut out = format!("event: {}\nid: {seq}\ndata: ", t.state.as_str()).into_bytes();
    let head = out.len();
    if let Err(e) = serde_json::to_writer(&mut out, &data) {
        // Unreachable for these types; an event without data still marks the state.
        tracing::error!("cannot encode the {} event: {e}", t.state.as_str());
        out.truncate(head);
    }
    if out[head..].iter().any(|b| matches!(b, b'\r' | b'\n')) {
        let text = String::from_utf8_lossy(&out[head..]).into_owned();
        return encode_event(t.state.as_str(), seq, &text);
    }
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// One event in the `text/event-stream` format. `data` is split at its line breaks (CRLF,
/// CR or LF), one `data:` line each, which clients join back with LF.
fn encode_event(event: &str, id: usize, data: &str) -> Bytes {
    let mut out = Vec::with_capacity(data.len() + 64);
    out.extend_from_slice(format!("event: {event}\nid: {id}\n").as_bytes());
    for line in data.split("\r\n").flat_map(|l| l.split(['\r', '\n'])) {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(line.as_bytes());
        out.push(b'\n');
    }
    out.push(b'\n');
    Bytes::from(out)
}

/// A comment and a reconnection delay, as one event.
fn encode_comment_and_retry(comment: &str, retry: Duration) -> Bytes {
    Bytes::from(format!(": {comment}\nretry: {}\n\n", retry.as_millis()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_data_at_every_kind_of_line_break() {
        let e = encode_event("passed", 3, "{\"a\":\r\n1,\r\"b\":\n2}");
        assert_eq!(
            std::str::from_utf8(&e).unwrap(),
            "event: passed\nid: 3\ndata: {\"a\":\ndata: 1,\ndata: \"b\":\ndata: 2}\n\n"
        );
        assert_eq!(
            &encode_comment_and_retry("bye", RECONNECT)[..],
            b": bye\nretry: 1000\n\n"
        );
    }
}
