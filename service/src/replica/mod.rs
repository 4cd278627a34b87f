//! Several `kernelkite-service` processes on one PostgreSQL schema, each serving every request
//! (`KERNELKITE_REPLICA`), behind any load balancer or a Heroku-style router that spreads
//! requests over them.
//!
//! One replica at a time runs the queue: the one holding the schema's lock
//! ([`crate::store::postgres`]), which runs the core ([`App`]) with every singleton loop (the
//! fair queue's decisions, the reconciler, the callback outbox, recovery, housekeeping), fenced
//! and taken over as a standby's is. Every replica serves from its start:
//! - a submission (`GET`, long-polls) and its event stream are read from the database
//!   ([`mirror`]), woken by the database's change notifications, so a webhook received by any
//!   replica wakes the waiters held by every other;
//! - every other request is relayed through the database to the replica running the queue
//!   ([`relay`]), which answers it with its own routes: one replica decides, so idempotency
//!   keys, quotas, the fair order, places and the cache are the same whichever replica answers.
//!
//! When this replica takes the lock, its own requests go to its core directly; the waits it
//! held as a follower go on as they were.

pub mod mirror;
pub mod relay;

use std::sync::{Arc, OnceLock};

use axum::extract::{Request, State};
use axum::response::Response;
use axum::Router;
use tower_service::Service as _;

use crate::app::App;
use crate::config::Config;
use crate::http::server::Served;
use crate::http::{follower_router, router_with, Edge, Phase};
use crate::metrics::Metrics;
use crate::report::BoxError;
use crate::store::replicas::{Heard, Replica, RECHECK};
use crate::store::Postgres;
use mirror::Mirror;
use relay::Relay;

/// How long a replica waits before trying again to take the lock after a start that failed.
const RETRY_START: std::time::Duration = std::time::Duration::from_secs(2);

/// A replica's state: its own routes, and the core's once it runs the queue.
struct Front {
    follower: Router,
    leader: OnceLock<Leading>,
}

/// The core's routes and their edge, while this replica runs the queue.
struct Leading {
    routes: Router,
    edge: Arc<Edge>,
}

/// How a replica starts the core once it may (blocking until it holds the schema's lock): the
/// composition root's wiring (`crate::cli::serve::start_replica`), handed in.
pub type Start =
    Arc<dyn Fn(&Config, Arc<Metrics>) -> Result<(Arc<App>, Postgres), BoxError> + Send + Sync>;

/// Serves as a replica on `listener` until `shutdown` resolves; meanwhile waits for the
/// schema's lock and, once it holds it, runs the queue, started by `start`.
pub async fn run(
    cfg: &Config,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    start: Start,
) -> anyhow::Result<()> {
    let crate::config::Backend::Postgres(url) = cfg.store.backend() else {
        anyhow::bail!(crate::config::ConfigError::ReplicaWithoutDatabase);
    };
    let db = Replica::connect(&cfg.store.postgres(url))?;
    let metrics = Arc::new(Metrics::new());
    let shared = Arc::new(cfg.clone());
    let edge = Arc::new(Edge::new(metrics.clone(), shared));
    let relay = Relay::new(db.clone());
    let mirror = Mirror::new(db.clone(), relay.clone());
    let front = Arc::new(Front {
        follower: follower_router(mirror.clone(), edge.clone(), relay.clone(), db.clone()),
        leader: OnceLock::new(),
    });
    let served = Served {
        metrics: metrics.clone(),
        app: Arc::new(OnceLock::new()),
    };
    tokio::spawn(listen(db.clone(), mirror, relay));
    tokio::spawn(lead(
        cfg.clone(),
        metrics,
        front.clone(),
        served.app.clone(),
        edge.clone(),
        start,
    ));
    // Draining reaches the core's routes too: their long-polls and streams answer.
    {
        let (edge, front) = (edge.clone(), front.clone());
        tokio::spawn(async move {
            edge.stopping().await;
            if let Some(l) = front.leader.get() {
                l.edge.set_phase(Phase::Draining);
            }
        });
    }
    tracing::info!(store = %db.target(), "serving as a replica; the replica holding the schema's lock runs the queue");
    let routes = Router::new().fallback(dispatch).with_state(front);
    crate::http::server::run(served, edge, routes, listener, shutdown).await?;
    Ok(())
}

/// A request to the core's routes while this replica runs the queue, else to its own.
async fn dispatch(State(front): State<Arc<Front>>, req: Request) -> Response {
    let mut routes = match front.leader.get() {
        Some(l) => l.routes.clone(),
        None => front.follower.clone(),
    };
    let Ok(r) = routes.call(req).await;
    r
}

/// Waits for the schema's lock (without limit), then starts the core, takes this replica's
/// requests to it, and claims what the others relay.
async fn lead(
    cfg: Config,
    metrics: Arc<Metrics>,
    front: Arc<Front>,
    serving: Arc<OnceLock<Arc<App>>>,
    own: Arc<Edge>,
    start: Start,
) {
    let (app, db) = loop {
        if own.phase() != Phase::Serving {
            return; // draining: this process will not run the queue
        }
        let (cfg, metrics, start) = (cfg.clone(), metrics.clone(), start.clone());
        let started = tokio::task::spawn_blocking(move || start(&cfg, metrics)).await;
        match started {
            Ok(Ok(x)) => break x,
            Ok(Err(e)) => {
                tracing::error!(error = %crate::report::report(&*e), "this replica could not take the schema's lock or start the queue; trying again");
            }
            Err(e) => tracing::error!(error = %e, "the start of the queue panicked; trying again"),
        }
        tokio::time::sleep(RETRY_START).await;
    };
    let edge = Arc::new(Edge::new(metrics, Arc::new(cfg)));
    let routes = router_with(app.clone(), edge.clone());
    let _ = serving.set(app);
    let _ = front.leader.set(Leading {
        routes: routes.clone(),
        edge: edge.clone(),
    });
    tracing::info!("this replica holds the schema's lock and runs the queue");
    if own.phase() != Phase::Serving {
        // The lock came while draining: the core's routes drain too, and nothing is claimed.
        edge.set_phase(Phase::Draining);
        return;
    }
    relay::serve_relayed(db, routes, own.stopping()).await;
}

/// Hears the database's notifications for this replica: a submission changed (its waiters
/// here read it again), a relayed request was answered. Everything waited for is also read
/// again every [`RECHECK`], and whenever the listener had to reconnect.
async fn listen(db: Replica, mirror: Arc<Mirror>, relay: Arc<Relay>) {
    let ch = db.channels().clone();
    let mut heard = db.hear(vec![ch.changed.clone(), ch.answered.clone()]);
    let mut tick = tokio::time::interval(RECHECK);
    loop {
        tokio::select! {
            h = heard.recv() => match h {
                Some(Heard::Said { channel, payload }) if channel == ch.answered => {
                    if let Ok(id) = payload.parse() {
                        relay.answered(id);
                    }
                }
                Some(Heard::Said { payload, .. }) => {
                    let mirror = mirror.clone();
                    tokio::spawn(async move { mirror.changed(&payload).await });
                }
                // Listening (again): what was said meanwhile was missed.
                Some(Heard::Listening) => {
                    relay.recheck();
                    mirror.recheck().await;
                }
                None => return,
            },
            _ = tick.tick() => {
                relay.recheck();
                mirror.recheck().await;
            }
        }
    }
}
