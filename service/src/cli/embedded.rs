//! Local mode inside this process, on a loopback port: what `demo` and `submit` talk to when
//! no `--server` is given. The same service as `kernelkite-service local` (the same routes,
//! store, state machine and executor), only started and stopped with the command.

use std::sync::Arc;

use anyhow::Context as _;

use crate::app::App;
use crate::config::Config;
use crate::local::{LocalArgs, LocalExecutor};

/// Local mode serving on `127.0.0.1:<port>` until dropped.
pub struct Embedded {
    /// The service's core.
    pub app: Arc<App>,
    /// Its executor.
    pub local: Arc<LocalExecutor>,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Embedded {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// Starts local mode with the local executor's `args` on a free loopback port.
pub async fn start(args: &LocalArgs) -> anyhow::Result<Embedded> {
    let mut cfg = Config::local();
    cfg.edge.listen = "127.0.0.1:0".parse().context("loopback address")?;
    let local = LocalExecutor::new(args, None)
        .await
        .context("cannot start local mode")?;
    let app = super::serve::start(&cfg, local.clone()).context("cannot start local mode")?;
    local.start(crate::events::for_executor(&app)).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("cannot listen on a loopback port")?;
    let addr = listener.local_addr().context("loopback address")?;
    let serving = app.clone();
    let server = tokio::spawn(async move {
        if let Err(e) = crate::http::serve(serving, &cfg, listener, std::future::pending()).await {
            tracing::error!(error = %e, "the embedded service stopped");
        }
    });
    Ok(Embedded {
        app,
        local,
        base: format!("http://{addr}"),
        server,
    })
}
