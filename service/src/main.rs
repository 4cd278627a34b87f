//! kernelkite-service: submissions in, Buildkite builds out, signed webhooks wake the waiters.

use anyhow::Context as _;
use clap::Parser as _;
use kernelkite_service::{serve, App, Config};

fn main() -> std::process::ExitCode {
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kernelkite-service: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kernelkite-service: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, never in a journal or a file.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cfg = Config::parse();
    cfg.check().context("invalid configuration")?;
    if cfg.buildkite_webhook_token.is_none() {
        tracing::warn!("BUILDKITE_WEBHOOK_TOKEN is not set: every webhook will be refused and no submission can finish");
    }
    if cfg.api_token.is_none() {
        tracing::warn!("KERNELKITE_API_TOKEN is not set: /v1 serves loopback clients only");
    }
    if cfg.allow_plain_webhook_token {
        tracing::warn!("plain X-Buildkite-Token webhooks are accepted; prefer signed webhooks");
    }
    // systemd starts services with a soft limit of 1024 open files and a much higher hard
    // one; every connection is a file. The connection cap is derived from the raised limit.
    match kernelkite_service::http::server::raise_open_files_limit() {
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
    let app = App::new(cfg).context("cannot start kernelkite-service")?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| {
            format!("cannot listen on {listen}; set KERNELKITE_LISTEN to a free address")
        })?;
    tracing::info!(%listen, "kernelkite-service listening");
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
