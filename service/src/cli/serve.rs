//! The composition root. `kernelkite-service [serve]` and `kernelkite-service local`: the
//! HTTP API until SIGINT or SIGTERM, with the Buildkite executor (configured by the
//! BUILDKITE_* settings) or the local one (configured by the local executor's flags).
//!
//! This is where the parts are chosen and wired: the executor and the durable store are built
//! here and handed to the core ([`App`]), and the background loops that live beside the core
//! (housekeeping, [`recovery`](crate::recovery), the [`Reconciler`], the callback
//! [`Outbox`]) are started here. [`start`] and [`start_buildkite`] are that wiring, for the
//! commands, local mode in process, and tests.

use std::sync::Arc;

use anyhow::Context as _;

use super::ServeArgs;
use crate::app::App;
use crate::buildkite::BuildkiteExecutor;
use crate::callback::Outbox;
use crate::config::{Backend, ConfigError, ExecutorKind};
use crate::executor::Executor;
use crate::http::serve;
use crate::local::LocalExecutor;
use crate::metrics::Metrics;
use crate::reconcile::Reconciler;
use crate::store::{Durable, Postgres, Reopened, Sqlite, StoreError};

/// Why the service cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A setting is wrong; the cause names it.
    #[error("invalid configuration")]
    Config(#[from] ConfigError),
    /// The HTTP client cannot be built (no TLS roots, ...).
    #[error("cannot build the HTTP client")]
    Http(#[from] reqwest::Error),
    /// The store cannot be opened, is damaged, or cannot be read; the message says what to do.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The service with Buildkite as the executor: opens its store (blocking while it does),
/// reloads the submissions that had not ended and starts the background loops. Needs a
/// tokio runtime.
pub fn start_buildkite(cfg: &crate::Config) -> Result<Arc<App>, StartError> {
    cfg.check()?;
    let metrics = Arc::new(Metrics::new());
    let (db, reopened) = open_store(cfg, &metrics)?;
    let executor = Arc::new(
        BuildkiteExecutor::new(cfg)?
            .with_metrics(metrics.clone())
            .acting_for(db.clone()),
    );
    wire(cfg, executor, db, reopened, metrics)
}

/// The service around another executor (one that runs builds on this machine, a test's):
/// [`start_buildkite`] otherwise.
pub fn start(cfg: &crate::Config, executor: Arc<dyn Executor>) -> Result<Arc<App>, StartError> {
    cfg.check()?;
    assemble(cfg, executor, Arc::new(Metrics::new()))
}

/// One of several replicas (`KERNELKITE_REPLICA`) once it holds the schema's lock: the
/// service with Buildkite as the executor, counting into the replica's `metrics`, with its
/// store (whose lock session claims what the other replicas relay). Blocks until the lock is
/// taken.
pub fn start_replica(
    cfg: &crate::Config,
    metrics: Arc<Metrics>,
) -> Result<(Arc<App>, Postgres), StartError> {
    cfg.check()?;
    let Backend::Postgres(url) = cfg.store.backend() else {
        return Err(ConfigError::ReplicaWithoutDatabase.into());
    };
    let (db, reopened) = Postgres::open(&cfg.store.postgres(url), Some(metrics.clone()))?;
    let store: Arc<dyn Durable> = Arc::new(db.clone());
    let executor = Arc::new(
        BuildkiteExecutor::new(cfg)?
            .with_metrics(metrics.clone())
            .acting_for(store.clone()),
    );
    let app = wire(cfg, executor, store, reopened, metrics)?;
    Ok((app, db))
}

fn assemble(
    cfg: &crate::Config,
    executor: Arc<dyn Executor>,
    metrics: Arc<Metrics>,
) -> Result<Arc<App>, StartError> {
    let (db, reopened) = open_store(cfg, &metrics)?;
    wire(cfg, executor, db, reopened, metrics)
}

/// The core around its store, and the loops beside it, started.
fn wire(
    cfg: &crate::Config,
    executor: Arc<dyn Executor>,
    db: Arc<dyn Durable>,
    reopened: Reopened,
    metrics: Arc<Metrics>,
) -> Result<Arc<App>, StartError> {
    let app = App::new(cfg.core(), executor, db, metrics).map_err(ConfigError::from)?;
    let outbox = Outbox::new(&app, &cfg.callbacks)?;
    app.spawn_housekeeping();
    app.spawn_places();
    let reconciler = Reconciler::new(&app);
    crate::recovery::recover(&app, &reconciler, reopened);
    reconciler.spawn();
    outbox.spawn();
    let canary = if cfg.fleet.canary {
        Some(
            crate::task::canary_config(cfg.fleet.canary_task.as_deref())
                .map_err(|e| ConfigError::Canary(crate::report::report(&e).to_string()))?,
        )
    } else {
        None
    };
    let routes = cfg.alert_routes()?;
    let alerts = !routes.0.is_empty();
    crate::notify::spawn(
        &app,
        routes,
        cfg.fleet.alert_max_per_minute,
        cfg.edge.public_url.clone(),
    );
    let fleet = app.clone();
    tokio::spawn(async move {
        fleet.load_fleet().await;
        fleet.spawn_fleet(canary, alerts);
    });
    Ok(app)
}

/// The durable store the configuration names ([`crate::config::Backend`]), opened, with what
/// it kept.
fn open_store(
    cfg: &crate::Config,
    metrics: &Arc<Metrics>,
) -> Result<(Arc<dyn Durable>, Reopened), StartError> {
    match cfg.store.backend() {
        Backend::Postgres(url) => {
            let (db, reopened) = Postgres::open(&cfg.store.postgres(url), Some(metrics.clone()))?;
            Ok((Arc::new(db), reopened))
        }
        Backend::Sqlite(dir) => {
            if dir.is_none() {
                tracing::warn!(
                    "neither KERNELKITE_DATA_DIR nor KERNELKITE_DATABASE_URL is set: the store is in memory and nothing survives a restart"
                );
            }
            let (db, reopened) = Sqlite::open_with_pending(
                dir.as_deref(),
                cfg.store.store_sync,
                Some(metrics.clone()),
            )?;
            if cfg.store.store_check_s > 0 {
                db.watch_pages(std::time::Duration::from_secs(cfg.store.store_check_s));
            }
            Ok((Arc::new(db), reopened))
        }
    }
}

/// Serves until a shutdown signal; `local` forces the local executor (`kernelkite-service
/// local`).
pub async fn run(args: ServeArgs, local: bool) -> anyhow::Result<()> {
    let mut cfg = args.config;
    if local {
        cfg.executor = ExecutorKind::Local;
    }
    let platform_url = std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty());
    if platform_url.is_some() && cfg.store.data_dir.is_some() && cfg.store.database_url.is_none() {
        // A container image that names a data dir, run on a platform that names its database:
        // the data dir wins, and on a disk the platform wipes that loses everything.
        tracing::warn!("DATABASE_URL is set, but so is KERNELKITE_DATA_DIR, which wins: the store is SQLite in the data dir, not the platform's PostgreSQL; where the disk does not outlive the process, unset KERNELKITE_DATA_DIR (the image's entrypoint can: env -u KERNELKITE_DATA_DIR)");
    }
    cfg.store.adopt_platform_url(platform_url);
    cfg.check().context("invalid configuration")?;
    if cfg.edge.api_token.is_none() {
        tracing::warn!("KERNELKITE_API_TOKEN is not set: /v1 serves loopback clients only");
    }
    // systemd starts services with a soft limit of 1024 open files and a much higher hard
    // one; every connection is a file. The connection cap is derived from the raised limit.
    match crate::http::server::raise_open_files_limit() {
        Ok((before, after)) if before != after => {
            tracing::info!(
                ?before,
                ?after,
                "raised the open-files limit to its hard limit"
            )
        }
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(error = %e, "could not raise the open-files limit; the connection cap follows the current one")
        }
    }
    let listen = cfg.edge.listen;
    if cfg.store.replica {
        if cfg.executor == ExecutorKind::Local {
            anyhow::bail!("KERNELKITE_REPLICA runs with the Buildkite executor only: the local executor runs builds on this machine, one service at a time; unset KERNELKITE_REPLICA");
        }
        let listener = bind(listen).await?;
        let start: crate::replica::Start =
            Arc::new(|cfg, metrics| Ok(start_replica(cfg, metrics)?));
        return crate::replica::run(&cfg, listener, shutdown_signal(), start).await;
    }
    let app = match cfg.executor {
        ExecutorKind::Buildkite => {
            if cfg.buildkite.buildkite_webhook_token.is_none() {
                tracing::warn!("BUILDKITE_WEBHOOK_TOKEN is not set: every webhook will be refused and no submission can finish");
            }
            if cfg.buildkite.allow_plain_webhook_token {
                tracing::warn!(
                    "plain X-Buildkite-Token webhooks are accepted; prefer signed webhooks"
                );
            }
            start_buildkite(&cfg).context("cannot start kernelkite-service")?
        }
        ExecutorKind::Local => {
            let executor = LocalExecutor::new(&args.local, cfg.store.data_dir.as_deref())
                .await
                .context("cannot start the local executor")?;
            for s in executor.slices() {
                tracing::info!("local executor: {}", s.describe());
            }
            let app = start(&cfg, executor.clone()).context("cannot start kernelkite-service")?;
            executor.start(crate::events::for_executor(&app)).await;
            app
        }
    };
    let listener = bind(listen).await?;
    serve(app, &cfg, listener, shutdown_signal())
        .await
        .context("server failed")?;
    Ok(())
}

/// The listening socket, its bound address logged: with port 0 this is how a caller (a
/// test, a supervisor) learns which port the kernel picked.
async fn bind(listen: std::net::SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| {
            format!("cannot listen on {listen}; set KERNELKITE_LISTEN to a free address")
        })?;
    let addr = listener.local_addr().unwrap_or(listen);
    tracing::info!(%addr, "kernelkite-service listening");
    Ok(listener)
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down");
}
