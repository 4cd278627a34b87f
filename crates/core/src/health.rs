//! Liveness and readiness: what `GET /healthz` and `GET /readyz` report.
//!
//! - **Healthy** (`/healthz`): the process answers and its store can be used, so whatever
//!   it acknowledges is kept. An orchestrator restarts an instance that stays unhealthy.
//! - **Ready** (`/readyz`): healthy, and taking new submissions: not shutting down. A load
//!   balancer sends traffic only to ready instances; an instance that is draining is still
//!   healthy (it must not be killed early) but no longer ready.

use std::time::Duration;

use crate::app::App;
use crate::report::BoxError;

/// How long a check waits for the store before calling it unhealthy.
pub const STORE_CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// Why the service is not healthy.
#[derive(Debug, thiserror::Error)]
pub enum Unhealthy {
    /// The store refused the check.
    #[error("the store cannot be used; check KERNELKITE_DATA_DIR (disk full, permissions, a corrupted database)")]
    Store(#[source] BoxError),
    /// The store did not answer in time.
    #[error("the store did not answer within {} s; check KERNELKITE_DATA_DIR's disk", .0.as_secs())]
    StoreTimeout(Duration),
}

/// Why the service does not take new submissions.
#[derive(Debug, thiserror::Error)]
pub enum NotReady {
    /// SIGTERM/SIGINT: draining before exit.
    #[error("shutting down")]
    ShuttingDown,
    /// Not healthy.
    #[error(transparent)]
    Unhealthy(#[from] Unhealthy),
}

impl NotReady {
    /// The `status` of `/readyz`'s answer.
    pub fn status(&self) -> &'static str {
        match self {
            NotReady::ShuttingDown => "shutting_down",
            NotReady::Unhealthy(_) => "unhealthy",
        }
    }
}

impl App {
    /// Liveness: the store answers its health check within [`STORE_CHECK_TIMEOUT`].
    pub async fn health(&self) -> Result<(), Unhealthy> {
        match tokio::time::timeout(STORE_CHECK_TIMEOUT, self.store.health()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Unhealthy::Store(e)),
            Err(_) => Err(Unhealthy::StoreTimeout(STORE_CHECK_TIMEOUT)),
        }
    }

    /// Readiness: healthy and `serving` (the HTTP edge is not shutting down).
    pub async fn readiness(&self, serving: bool) -> Result<(), NotReady> {
        if !serving {
            return Err(NotReady::ShuttingDown);
        }
        Ok(self.health().await?)
    }
}
