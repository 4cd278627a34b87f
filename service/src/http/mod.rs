//! The HTTP layer: the routes, and the translation between requests and the core. The
//! submission API lives under `/v1` (`submissions`, `events`; guarded by `auth`), Buildkite's
//! webhook at `/webhooks/buildkite` (`webhooks`), the operational routes (`/healthz`,
//! `/readyz`, `/metrics`) here; every error becomes a response in one place (`error`:
//! `impl IntoResponse for crate::Error`). Connections are served by `server` (accept loop,
//! cap, timeouts, graceful shutdown); what connections and handlers share is `edge`.

mod auth;
mod edge;
mod error;
mod events;
mod fleet;
mod follower;
pub mod openapi;
mod queues;
pub mod server;
mod submissions;
mod webhooks;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRef, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::app::{App, Watch};
use crate::buildkite::webhook::WebhookReceiver;
use crate::config::Config;
use crate::error::Error;
use crate::executor::Events;
use crate::submission::Submission;
pub use auth::Vouched;
pub use edge::{Edge, Phase};
pub use error::ApiError;
pub use follower::follower_router;
use futures_util::future::BoxFuture;
pub use server::RequestId;

/// Where the read routes (`GET /v1/submissions/{id}[?wait=]` and its events) read a
/// submission: the core ([`App`]) where the process runs the queue, a replica's mirror of the
/// database ([`crate::replica`]) where another does.
pub trait Reader: Send + Sync + 'static {
    /// The submission once it ended or `wait` passed; at once when `wait` is zero.
    fn get<'a>(&'a self, id: &'a str, wait: Duration) -> BoxFuture<'a, Result<Submission, Error>>;
    /// The submission to follow, change by change.
    fn watch<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Watch, Error>>;
}

impl Reader for App {
    fn get<'a>(&'a self, id: &'a str, wait: Duration) -> BoxFuture<'a, Result<Submission, Error>> {
        Box::pin(App::get(self, id, wait))
    }
    fn watch<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Watch, Error>> {
        Box::pin(App::watch(self, id))
    }
}

/// Where a replica that does not run the queue hands the requests the core answers
/// (`crate::replica::relay`: through the database, to the replica that runs it).
pub trait Relayer: Send + Sync + 'static {
    /// `r` answered by the replica running the queue, waiting at most `claim_wait` for one to
    /// take it.
    fn send(
        &self,
        r: crate::store::replicas::Relayed,
        claim_wait: Duration,
    ) -> BoxFuture<'_, Result<Response, Error>>;
}

/// Headers never relayed: those of one connection, and credentials (the receiving replica
/// checked them and relays its verdict, [`crate::http::Vouched`]: no secret is written to the
/// database).
const NOT_RELAYED: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "cookie",
    "x-buildkite-token",
    "x-buildkite-signature",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "upgrade",
    "te",
    "trailer",
    "proxy-connection",
];

/// The headers whose values are text, without those of one connection and credentials.
pub fn text_headers(h: &axum::http::HeaderMap) -> Vec<(String, String)> {
    h.iter()
        .filter(|(k, _)| !NOT_RELAYED.contains(&k.as_str()))
        .filter_map(|(k, v)| Some((k.as_str().to_string(), v.to_str().ok()?.to_string())))
        .collect()
}

/// What the handlers are given: the core, the edge's shared state, and the receiving end of
/// Buildkite's webhook (the edge's, not the core's: the core hears only executor events).
#[derive(Clone)]
pub(crate) struct Http {
    app: Arc<App>,
    /// The same core, as the read routes see it.
    reader: Arc<dyn Reader>,
    edge: Arc<Edge>,
    webhooks: Arc<WebhookReceiver>,
    /// The core's one way in for build events (`kernelkite_core::events`), which Buildkite's
    /// webhooks take as the local executor's events do.
    events: Arc<dyn Events>,
    /// Finished submissions' events, shared by the streams sending them.
    finished: Arc<events::Finished>,
    /// The fleet's overview, shared by its readers.
    fleet: Arc<fleet::Cache>,
}

impl FromRef<Http> for Arc<fleet::Cache> {
    fn from_ref(h: &Http) -> Arc<fleet::Cache> {
        h.fleet.clone()
    }
}

impl FromRef<Http> for Arc<events::Finished> {
    fn from_ref(h: &Http) -> Arc<events::Finished> {
        h.finished.clone()
    }
}

impl FromRef<Http> for Arc<WebhookReceiver> {
    fn from_ref(h: &Http) -> Arc<WebhookReceiver> {
        h.webhooks.clone()
    }
}

impl FromRef<Http> for Arc<dyn Events> {
    fn from_ref(h: &Http) -> Arc<dyn Events> {
        h.events.clone()
    }
}

impl FromRef<Http> for Arc<dyn Reader> {
    fn from_ref(h: &Http) -> Arc<dyn Reader> {
        h.reader.clone()
    }
}

impl FromRef<Http> for Arc<App> {
    fn from_ref(h: &Http) -> Arc<App> {
        h.app.clone()
    }
}

impl FromRef<Http> for Arc<Edge> {
    fn from_ref(h: &Http) -> Arc<Edge> {
        h.edge.clone()
    }
}

/// The HTTP routes, with an edge of their own (always serving). Bodies are read by the
/// handlers themselves (authentication first, then a bounded, timed read), so no body-limit
/// layer is needed.
pub fn router(app: Arc<App>, cfg: &Config) -> Router {
    let edge = Arc::new(Edge::new(app.metrics().clone(), Arc::new(cfg.clone())));
    router_with(app, edge)
}

/// The routes around `edge` (whose phase the long-polls, streams and `/readyz` follow).
pub fn router_with(app: Arc<App>, edge: Arc<Edge>) -> Router {
    let v1 = Router::new()
        .route("/v1/submissions", post(submissions::create))
        .route(
            "/v1/submissions/{id}",
            get(submissions::get).fallback(submissions::other_method),
        )
        // Canceling keeps the submission (it ends `canceled`, readable as any other end), so
        // it is a POST: a DELETE removes what it names (RFC 9110).
        .route("/v1/submissions/{id}/cancel", post(submissions::cancel))
        .route("/v1/submissions/{id}/events", get(events::stream))
        .route("/v1/queues/{queue}", queues::route(&app))
        .route("/v1/fleet/slices/{id}/canary", post(fleet::canary))
        .route(
            "/v1/fleet/slices/{id}/quarantine",
            post(fleet::quarantine).delete(fleet::release),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            edge.clone(),
            auth::require_client,
        ));
    // The fleet's reads take the read-only dashboard token too.
    let fleet_reads = Router::new()
        .route("/v1/fleet", get(fleet::overview))
        .route("/v1/fleet/events", get(fleet::events))
        .route_layer(axum::middleware::from_fn_with_state(
            edge.clone(),
            auth::require_reader,
        ));
    Router::new()
        .merge(v1)
        .merge(fleet_reads)
        .route("/dashboard", get(fleet::page))
        .route("/webhooks/buildkite", post(webhooks::buildkite))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/openapi.json", get(openapi::serve))
        .route("/metrics", get(metrics))
        .with_state(Http {
            webhooks: Arc::new(WebhookReceiver::from_config(&edge.cfg)),
            events: crate::events::for_executor(&app),
            finished: Arc::new(events::Finished::default()),
            fleet: Arc::new(fleet::Cache::default()),
            reader: app.clone(),
            app,
            edge,
        })
}

/// Serves `app` under the service's settings `cfg` on `listener` until `shutdown` resolves,
/// then drains for up to KERNELKITE_SHUTDOWN_GRACE_S (see [`server`]).
/// The settings are read now, so the future borrows nothing and can be spawned.
pub fn serve(
    app: Arc<App>,
    cfg: &Config,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> impl std::future::Future<Output = std::io::Result<()>> + Send + 'static {
    let edge = Arc::new(Edge::new(app.metrics().clone(), Arc::new(cfg.clone())));
    let router = router_with(app.clone(), edge.clone());
    server::run(server::Served::by(app), edge, router, listener, shutdown)
}

/// `GET /healthz`: `200 {"status":"ok"}` while the store answers; `503` with the reason.
async fn healthz(State(app): State<Arc<App>>) -> Response {
    match app.health().await {
        Ok(()) => status(StatusCode::OK, json!({"status": "ok"})),
        Err(e) => {
            tracing::warn!(error = %crate::report::report(&e), "health check failed");
            status(
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"status": "unhealthy", "error": crate::report::report(&e)}),
            )
        }
    }
}

/// `GET /readyz`: `200 {"status":"ready"}` while healthy and not shutting down; `503`
/// otherwise.
async fn readyz(State(app): State<Arc<App>>, State(edge): State<Arc<Edge>>) -> Response {
    match app.readiness(edge.phase() == Phase::Serving).await {
        Ok(()) => status(StatusCode::OK, json!({"status": "ready"})),
        Err(e) => status(
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"status": e.status(), "error": crate::report::report(&e)}),
        ),
    }
}

fn status(code: StatusCode, body: serde_json::Value) -> Response {
    (code, [(header::CACHE_CONTROL, "no-store")], Json(body)).into_response()
}

/// `GET /metrics`: OpenMetrics text (what Prometheus scrapes). Unauthenticated, like
/// `/healthz`: label values are fixed names (states, reasons, calls), never ids or input. The
/// edge counts into the core's metrics, or a replica's before it runs the queue.
async fn metrics(State(edge): State<Arc<Edge>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        edge.metrics.render(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::ServiceExt as _;

    async fn call(router: &Router, method: &str, path: &str) -> (u16, serde_json::Value) {
        let req = axum::http::Request::builder()
            .method(method)
            .uri(path)
            .header("content-type", "application/json")
            .body(axum::body::Body::from(
                json!({"config": {}, "queue": "h100"}).to_string(),
            ))
            .unwrap();
        // In process there is no peer: loopback is what the client guard needs.
        let mut req = req;
        req.extensions_mut()
            .insert(axum::extract::ConnectInfo(std::net::SocketAddr::from((
                [127, 0, 0, 1],
                1,
            ))));
        let r = router.clone().oneshot(req).await.unwrap();
        let status = r.status().as_u16();
        let body = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        (status, serde_json::from_slice(&body).unwrap_or_default())
    }

    #[tokio::test]
    async fn draining_is_healthy_but_not_ready_and_takes_no_submissions() {
        let cfg = crate::Config::new("http://127.0.0.1:9/v2", "org", "pipe", "t");
        let app = crate::cli::serve::start_buildkite(&cfg).unwrap();
        let edge = Arc::new(Edge::new(app.metrics().clone(), Arc::new(cfg)));
        let router = router_with(app, edge.clone());
        assert_eq!(
            call(&router, "GET", "/readyz").await,
            (200, json!({"status": "ready"}))
        );
        edge.set_phase(Phase::Draining);
        assert_eq!(
            call(&router, "GET", "/healthz").await,
            (200, json!({"status": "ok"}))
        );
        let (status, v) = call(&router, "GET", "/readyz").await;
        assert_eq!(
            (status, &v["status"]),
            (503, &json!("shutting_down")),
            "{v}"
        );
        let (status, v) = call(&router, "POST", "/v1/submissions").await;
        assert_eq!(status, 503, "{v}");
        assert!(
            v["error"].as_str().unwrap().contains("shutting down"),
            "{v}"
        );
        // The phase never goes back.
        edge.set_phase(Phase::Serving);
        assert_eq!(edge.phase(), Phase::Draining);
    }
}
