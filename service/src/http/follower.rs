//! A replica's routes while another replica runs the queue (`KERNELKITE_REPLICA`,
//! [`crate::replica`]): a submission and its events are read here, from the database (the
//! same handlers as the core's, over the replica's [`Reader`]); the operational routes answer
//! for this process; every other request is relayed to the replica that runs the queue and
//! its answer given back as it is.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, FromRef, Request, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use serde_json::json;

use super::error::ApiError;
use super::{auth, events, openapi, status, submissions, webhooks, Edge, Phase, Reader};
use super::{text_headers, Relayer};
use crate::buildkite::webhook::WebhookReceiver;
use crate::error::{BadRequest, Error, Unauthorized, Unavailable, WebhookRefusal};
use crate::store::replicas::{Relayed, Replica, CLAIM_WAIT};

/// What a replica's own routes are given.
#[derive(Clone)]
pub(crate) struct Follower {
    reader: Arc<dyn Reader>,
    edge: Arc<Edge>,
    finished: Arc<events::Finished>,
    relay: Arc<dyn Relayer>,
    db: Replica,
    webhooks: Arc<WebhookReceiver>,
}

impl FromRef<Follower> for Arc<dyn Reader> {
    fn from_ref(f: &Follower) -> Arc<dyn Reader> {
        f.reader.clone()
    }
}

impl FromRef<Follower> for Arc<Edge> {
    fn from_ref(f: &Follower) -> Arc<Edge> {
        f.edge.clone()
    }
}

impl FromRef<Follower> for Arc<events::Finished> {
    fn from_ref(f: &Follower) -> Arc<events::Finished> {
        f.finished.clone()
    }
}

/// The routes of a replica that does not run the queue: reads from `reader`, everything
/// else handed to `relay`; `db` answers its health.
pub fn follower_router(
    reader: Arc<dyn Reader>,
    edge: Arc<Edge>,
    relay: Arc<dyn Relayer>,
    db: Replica,
) -> Router {
    // The routes relayed are the core's that change something or need its memory; any other
    // path or method is answered here (404, 405) and never reaches the database.
    let v1 = Router::new()
        .route("/v1/submissions", post(relayed))
        .route(
            "/v1/submissions/{id}",
            get(submissions::get).fallback(submissions::other_method),
        )
        .route("/v1/submissions/{id}/cancel", post(relayed))
        .route("/v1/submissions/{id}/events", get(events::stream))
        .route("/v1/queues/{queue}", get(relayed))
        .route("/v1/fleet/slices/{id}/canary", post(relayed))
        .route(
            "/v1/fleet/slices/{id}/quarantine",
            post(relayed).delete(relayed),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            edge.clone(),
            auth::require_client,
        ));
    // The fleet lives in the memory of the replica running the queue: its overview is
    // relayed; its event stream is that replica's alone (the page polls here instead).
    let fleet_reads = Router::new().route("/v1/fleet", get(relayed)).route_layer(
        axum::middleware::from_fn_with_state(edge.clone(), auth::require_reader),
    );
    Router::new()
        .merge(v1)
        .merge(fleet_reads)
        .route("/dashboard", get(super::fleet::page))
        .route("/webhooks/buildkite", post(relayed))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/openapi.json", get(openapi::serve))
        .route("/metrics", get(super::metrics))
        .with_state(Follower {
            reader,
            finished: Arc::new(events::Finished::default()),
            relay,
            db,
            webhooks: Arc::new(WebhookReceiver::from_config(&edge.cfg)),
            edge,
        })
}

/// `GET /healthz` of a replica: the database answers.
async fn healthz(State(f): State<Follower>) -> Response {
    match f.db.ping().await {
        Ok(()) => status(StatusCode::OK, json!({"status": "ok", "runs_queue": false})),
        Err(e) => status(
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"status": "unhealthy", "error": crate::report::report(&e)}),
        ),
    }
}

/// `GET /readyz` of a replica: healthy, and not shutting down.
async fn readyz(State(f): State<Follower>) -> Response {
    if f.edge.phase() != Phase::Serving {
        return status(
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"status": "shutting_down", "error": Unavailable::ShuttingDown.to_string()}),
        );
    }
    healthz(State(f)).await
}

/// A request the core answers: checked as far as this replica can (the client guard on `/v1`,
/// run before this; the body's bound; a webhook's signature: the checks that need no state),
/// then relayed with this replica's verdict and without the credentials. A webhook's body
/// counts against the budget of unauthenticated bodies while it is read, as it does where the
/// queue runs.
async fn relayed(State(f): State<Follower>, req: Request) -> Result<Response, ApiError> {
    if f.edge.phase() != Phase::Serving {
        return Err(Error::from(Unavailable::ShuttingDown).into());
    }
    let (parts, body) = req.into_parts();
    let webhook = parts.uri.path() == "/webhooks/buildkite";
    // Headers that are not text are not relayed; a key that is not text would be lost, and the
    // retries it protects would each make a submission.
    if parts
        .headers
        .get("idempotency-key")
        .is_some_and(|k| k.to_str().is_err())
    {
        return Err(Error::from(BadRequest::IdempotencyKey).into());
    }
    let (limit, setting) = if webhook {
        (
            f.edge.cfg.edge.webhook_max_bytes,
            "KERNELKITE_WEBHOOK_MAX_BYTES",
        )
    } else {
        (
            f.edge.cfg.edge.max_submission_bytes,
            "KERNELKITE_MAX_SUBMISSION_BYTES",
        )
    };
    let now = chrono::Utc::now().timestamp();
    if webhook {
        // Checked here as the replica running the queue checks it again: an unsigned body
        // never reaches the database.
        if let Err(e) = f.webhooks.auth.precheck(&parts.headers, now) {
            webhooks::refused(&f.edge, e.reason(), &e);
            return Err(Error::from(Unauthorized::Webhook(WebhookRefusal::new(e))).into());
        }
    }
    let (body, _budget) = f.edge.read_body(body, limit, setting, webhook).await?;
    if webhook {
        if let Err(e) = f.webhooks.auth.verify(&parts.headers, &body, now) {
            webhooks::refused(&f.edge, e.reason(), &e);
            return Err(Error::from(Unauthorized::Webhook(WebhookRefusal::new(e))).into());
        }
    }
    let peer = parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.to_string())
        .unwrap_or_default();
    let r = Relayed {
        method: parts.method.to_string(),
        uri: parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path().to_string(), |p| p.to_string()),
        headers: text_headers(&parts.headers),
        peer,
        body: body.to_vec(),
    };
    Ok(f.relay.send(r, CLAIM_WAIT).await?)
}
