//! The HTTP layer: the routes, and the translation between requests and the core. The
//! submission API lives under `/v1` (`submissions`, `events`; guarded by `auth`), Buildkite's
//! webhook at `/webhooks/buildkite` (`webhooks`); every error becomes a response in one place
//! (`error`: `impl IntoResponse for crate::Error`).

mod auth;
mod error;
mod events;
mod queues;
mod submissions;
mod webhooks;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use crate::app::App;

/// The HTTP routes.
pub fn router(app: Arc<App>) -> Router {
    let v1 = Router::new()
        .route("/v1/submissions", post(submissions::create))
        .route(
            "/v1/submissions/{id}",
            get(submissions::get).delete(submissions::cancel),
        )
        .route("/v1/submissions/{id}/events", get(events::stream))
        .route("/v1/queues/{queue}", queues::route(&app))
        .layer(DefaultBodyLimit::max(app.cfg.max_submission_bytes))
        .route_layer(axum::middleware::from_fn_with_state(
            app.clone(),
            auth::require_client,
        ));
    let hooks = Router::new()
        .route("/webhooks/buildkite", post(webhooks::buildkite))
        .layer(DefaultBodyLimit::max(app.cfg.webhook_max_bytes));
    Router::new()
        .merge(v1)
        .merge(hooks)
        .route("/healthz", get(|| async { "ok" }))
        .route("/openapi.json", get(openapi))
        .route("/metrics", get(metrics))
        .with_state(app)
}

/// Serves on `listener` until `shutdown` resolves.
pub async fn serve(
    app: Arc<App>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(
        listener,
        router(app).into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
}

/// `GET /metrics`: Prometheus text format.
async fn metrics(axum::extract::State(app): axum::extract::State<Arc<App>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.metrics.render(),
    )
        .into_response()
}

/// `GET /openapi.json`
async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        include_str!("../../openapi.json"),
    )
        .into_response()
}
