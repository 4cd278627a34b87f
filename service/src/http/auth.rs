//! Who may use `/v1`: the bearer token when one is configured, else loopback clients only.

use super::error::ApiError;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;

use super::Edge;
use crate::error::{Error, Unauthorized};

/// Guards `/v1`: the bearer token when one is configured, else loopback clients only.
pub(super) async fn require_client(
    State(edge): State<Arc<Edge>>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    allowed(&edge, req.headers(), req.extensions())?;
    Ok(next.run(req).await)
}

/// Guards the fleet's reads: what [`require_client`] admits, or the read-only dashboard
/// token (KERNELKITE_DASHBOARD_TOKEN) from anywhere.
pub(super) async fn require_reader(
    State(edge): State<Arc<Edge>>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let dashboard = edge.cfg.fleet.dashboard_token.as_ref().is_some_and(|t| {
        req.headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token)
            .is_some_and(|g| t.matches(g.as_bytes()))
    });
    if !dashboard {
        allowed(&edge, req.headers(), req.extensions())?;
    }
    Ok(next.run(req).await)
}

/// A request another replica received, checked and relayed ([`crate::replica::relay`]): it
/// authenticated the client (or verified the webhook) itself and relays its verdict, never
/// the credentials. Set only in process, by the relay: no client can send it.
#[derive(Debug, Clone, Copy)]
pub struct Vouched;

/// Whether a request with `headers` from the peer in `extensions` may use `/v1`.
pub(super) fn allowed(
    edge: &Edge,
    headers: &axum::http::HeaderMap,
    extensions: &axum::http::Extensions,
) -> Result<(), ApiError> {
    if extensions.get::<Vouched>().is_some() {
        return Ok(());
    }
    match &edge.cfg.edge.api_token {
        Some(token) => {
            let given = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(bearer_token);
            if !given.is_some_and(|g| token.matches(g.as_bytes())) {
                return Err(Unauthorized::BearerToken.into());
            }
        }
        None => {
            let loopback = extensions
                .get::<ConnectInfo<SocketAddr>>()
                .is_some_and(|c| is_loopback(c.0.ip()));
            if !loopback {
                return Err(Error::Forbidden.into());
            }
        }
    }
    Ok(())
}

/// The token of an `Authorization: Bearer <token>` value. The scheme's name is
/// case-insensitive (RFC 7235 section 2.1) and may be followed by more than one space.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = token.trim_start_matches(' ');
    (!token.is_empty()).then_some(token)
}

/// A loopback address, including IPv4 loopback as a dual-stack listener (`[::]:P`) sees it:
/// `::ffff:127.0.0.1`.
fn is_loopback(ip: IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        for v in ["Bearer t0k", "bearer t0k", "BEARER t0k", "bEaReR   t0k"] {
            assert_eq!(bearer_token(v), Some("t0k"), "{v}");
        }
        for v in ["Basic t0k", "Bearer", "Bearer ", "Bearert0k", "t0k", ""] {
            assert_eq!(bearer_token(v), None, "{v}");
        }
        // The token itself stays case-sensitive.
        assert_eq!(bearer_token("bearer T0K"), Some("T0K"));
    }

    #[test]
    fn mapped_ipv4_loopback_is_loopback() {
        for ip in [
            "127.0.0.1",
            "127.1.2.3",
            "::1",
            "::ffff:127.0.0.1",
            "::ffff:127.9.9.9",
        ] {
            assert!(is_loopback(ip.parse().unwrap()), "{ip}");
        }
        for ip in ["10.0.0.1", "::ffff:10.0.0.1", "::2", "0.0.0.0", "::"] {
            assert!(!is_loopback(ip.parse().unwrap()), "{ip}");
        }
    }
}
