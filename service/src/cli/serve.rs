//! `kernelkite-service [serve]` and `kernelkite-service local`: the HTTP API until SIGINT or
//! SIGTERM, with the Buildkite executor (configured by the BUILDKITE_* settings) or the local
//! one (configured by the local executor's flags).

use std::sync::Arc;

use anyhow::Context as _;
use chrono::Utc;

use super::ServeArgs;
use crate::app::{App, Clock};
use crate::config::ExecutorKind;
use crate::http::serve;
use crate::local::LocalExecutor;

/// Serves until a shutdown signal; `local` forces the local executor (`kernelkite-service
/// local`).
pub async fn run(args: ServeArgs, local: bool) -> anyhow::Result<()> {
    let mut cfg = args.config;
    if local {
        cfg.executor = ExecutorKind::Local;
    }
    cfg.check().context("invalid configuration")?;
    if cfg.api_token.is_none() {
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
    let listen = cfg.listen;
    let app = match cfg.executor {
        ExecutorKind::Buildkite => {
            if cfg.buildkite_webhook_token.is_none() {
                tracing::warn!("BUILDKITE_WEBHOOK_TOKEN is not set: every webhook will be refused and no submission can finish");
            }
            if cfg.allow_plain_webhook_token {
                tracing::warn!(
                    "plain X-Buildkite-Token webhooks are accepted; prefer signed webhooks"
                );
            }
            App::new(cfg).context("cannot start kernelkite-service")?
        }
        ExecutorKind::Local => {
            let executor = LocalExecutor::new(&args.local, cfg.data_dir.as_deref())
                .await
                .context("cannot start the local executor")?;
            for s in executor.slices() {
                tracing::info!("local executor: {}", s.describe());
            }
            let clock: Clock = Arc::new(|| Utc::now().timestamp());
            let app = App::with_executor(cfg, clock, executor.clone())
                .context("cannot start kernelkite-service")?;
            executor.start(&app).await;
            app
        }
    };
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| {
            format!("cannot listen on {listen}; set KERNELKITE_LISTEN to a free address")
        })?;
    // The bound address, not the configured one: with port 0 this is how a caller (a test, a
    // supervisor) learns which port the kernel picked.
    let addr = listener.local_addr().unwrap_or(listen);
    tracing::info!(%addr, executor = app.executor.name(), "kernelkite-service listening");
    serve(app, listener, shutdown_signal())
        .await
        .context("server failed")?;
    Ok(())
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
