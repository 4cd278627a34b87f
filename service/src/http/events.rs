//! `GET /v1/submissions/{id}/events`: one server-sent event per state change.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State as AxState};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures_util::Stream;

use super::edge::Edge;
use crate::app::{App, Watch};
use crate::error::Error;
use crate::submission::{State, Submission};

/// How soon a client should reconnect after the service ended its stream to shut down.
pub(super) const RECONNECT: Duration = Duration::from_secs(1);

/// One SSE event per state change, the history so far first. `Last-Event-ID` resumes. When
/// the service starts shutting down, the stream ends after the events so far with a
/// `retry:` hint, so the client reconnects (elsewhere, or after the restart) with
/// `Last-Event-ID` and misses nothing.
pub(super) async fn stream(
    AxState(app): AxState<Arc<App>>,
    AxState(edge): AxState<Arc<Edge>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, Error> {
    let start = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<usize>().ok())
        // Client-chosen: `usize::MAX` must not overflow (it means "after everything").
        .map_or(0, |n| n.saturating_add(1));
    let source = app.watch(&id).await?;
    let stopping: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(edge.stopping());
    let state = (source, start, Some(stopping));
    let stream = futures_util::stream::unfold(state, |(mut source, next, stopping)| async move {
        // `None`: the shutdown event went out; the stream is over.
        let mut stopping = stopping?;
        loop {
            let snapshot = match &mut source {
                Watch::Live(rx) => rx.borrow_and_update().clone(),
                Watch::Done(s) => (**s).clone(),
            };
            if next < snapshot.history.len() {
                let ev = state_event(&snapshot, next);
                return Some((Ok(ev), (source, next + 1, Some(stopping))));
            }
            if snapshot.state.is_terminal() {
                return None;
            }
            match &mut source {
                Watch::Live(rx) => {
                    tokio::select! {
                        r = rx.changed() => if r.is_err() {
                            return None;
                        },
                        () = &mut stopping => {
                            let bye = Event::default()
                                .comment("shutting down; reconnect with Last-Event-ID")
                                .retry(RECONNECT);
                            return Some((Ok(bye), (source, next, None)));
                        }
                    }
                }
                Watch::Done(_) => return None,
            }
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
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
