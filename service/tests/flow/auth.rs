//! Who may use `/v1`: the bearer token, or loopback clients when no token is configured.

use kernelkite_service::config::Secret;
use kernelkite_testkit::harness::{harness, harness_with, uuid_like};
use kernelkite_testkit::sample_config;
use serde_json::json;

#[tokio::test]
async fn bearer_token_guards_the_api() {
    let h = harness_with(|c| c.edge.api_token = Some(Secret::new("kk-token"))).await;
    let url = format!("{}/v1/submissions", h.base);
    let body = json!({"config": sample_config(), "queue": "h100"});
    let r = h.http.post(&url).json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert_eq!(r.headers()["www-authenticate"], "Bearer");
    let r = h
        .http
        .post(&url)
        .bearer_auth("kk-tokeN")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = h
        .http
        .post(&url)
        .bearer_auth("kk-token")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 202);
    // Webhooks are authenticated by their signature, not the API token.
    let r = h
        .http
        .post(format!("{}/webhooks/buildkite", h.base))
        .bearer_auth("kk-token")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
}

#[tokio::test]
async fn without_an_api_token_only_loopback_is_served() {
    use tower::ServiceExt;
    let h = harness().await;
    let router = kernelkite_service::router(h.app.clone(), &h.cfg);
    let req = |peer: Option<std::net::SocketAddr>| {
        let mut r = axum::http::Request::get(format!("/v1/submissions/{}", uuid_like()))
            .body(axum::body::Body::empty())
            .unwrap();
        if let Some(p) = peer {
            r.extensions_mut().insert(axum::extract::ConnectInfo(p));
        }
        r
    };
    let remote = router
        .clone()
        .oneshot(req(Some("10.1.2.3:5555".parse().unwrap())))
        .await
        .unwrap();
    assert_eq!(remote.status().as_u16(), 403);
    let unknown = router.clone().oneshot(req(None)).await.unwrap();
    assert_eq!(unknown.status().as_u16(), 403);
    let local = router
        .oneshot(req(Some("127.0.0.1:5555".parse().unwrap())))
        .await
        .unwrap();
    assert_eq!(
        local.status().as_u16(),
        404,
        "loopback passes the guard (and the id is unknown)"
    );
}
