//! Who may use `/v1`: the bearer token when one is configured, else loopback clients only.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;

use crate::app::App;
use crate::error::{Error, Unauthorized};

/// Guards `/v1`: the bearer token when one is configured, else loopback clients only.
pub(super) async fn require_client(
    State(app): State<Arc<App>>,
    req: Request,
    next: Next,
) -> Result<Response, Error> {
    match &app.cfg.api_token {
        Some(token) => {
            let given = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            if !given.is_some_and(|g| token.matches(g.as_bytes())) {
                return Err(Unauthorized::BearerToken.into());
            }
        }
        None => {
            let loopback = req
                .extensions()
                .get::<ConnectInfo<SocketAddr>>()
                .is_some_and(|c| c.0.ip().is_loopback());
            if !loopback {
                return Err(Error::Forbidden);
            }
        }
    }
    Ok(next.run(req).await)
}
