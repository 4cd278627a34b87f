//! The finished submission POSTed to its `callback_url`, retried on failure.

use std::sync::Arc;

use kernelkite_testkit::harness::{harness, result_artifact, WAIT};
use kernelkite_testkit::sample_config;
use serde_json::{json, Value};

#[tokio::test]
async fn callback_receives_the_final_submission() {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Value>();
    let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let hits2 = hits.clone();
    let cb = axum::Router::new().route(
        "/done",
        axum::routing::post(move |axum::Json(v): axum::Json<Value>| {
            let (tx, hits) = (tx.clone(), hits2.clone());
            async move {
                // The first delivery fails, so the retry is exercised.
                if hits.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                    return axum::http::StatusCode::SERVICE_UNAVAILABLE;
                }
                let _ = tx.send(v);
                axum::http::StatusCode::NO_CONTENT
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let cb_url = format!("http://{}/done", l.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(l, cb).await.unwrap() });
    let h = harness().await;
    let (id, number) = h
        .submit_body(json!({"config": sample_config(), "queue": "h100", "callback_url": cb_url}))
        .await;
    h.wait_build_attached(&id).await;
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    let v = tokio::time::timeout(WAIT, rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (v["id"].as_str(), v["state"].as_str()),
        (Some(id.as_str()), Some("succeeded"))
    );
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 2);
    server.abort();
}
