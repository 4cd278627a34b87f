//! `GET /v1/queues/{queue}`: how busy a queue is (see [`crate::queues`]).

use super::error::ApiError;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::routing::{get, MethodRouter};
use axum::Json;

use crate::app::App;
use crate::error::Invalid;
use crate::queues::{QueueStatus, Queues};

/// The route, with its agent-count cache. The cache lives as long as the router: one per
/// server, so one Buildkite fetch per refresh interval however many clients ask.
pub(super) fn route(app: &Arc<App>) -> MethodRouter<super::Http> {
    let queues = app.queues().clone();
    get(
        move |State(app): State<Arc<App>>, Path(queue): Path<String>| async move {
            status(&app, &queues, &queue).await
        },
    )
}

async fn status(
    app: &App,
    queues: &Arc<Queues>,
    queue: &str,
) -> Result<Json<QueueStatus>, ApiError> {
    if !crate::dispatch::valid_name(queue) {
        return Err(Invalid::Queue(queue.to_string()).into());
    }
    // Asked first: the agents' first fetch, which `status` may wait for, then counts.
    let _ = queues.agents(queue).await;
    let line = app.dispatch().status(queue, app.capacity(queue));
    Ok(Json(queues.status(app.store(), queue, line).await))
}
