//! The finished submission POSTed to its `callback_url`, retried on failure.

use kernelkite_testkit::callback_receiver::{CallbackReceiver, Mode};
use kernelkite_testkit::harness::{harness, result_artifact, WAIT};
use kernelkite_testkit::sample_config;
use serde_json::{json, Value};

#[tokio::test]
async fn callback_receives_the_final_submission() {
    let cb = CallbackReceiver::start().await;
    // The first delivery fails, so the retry is exercised.
    cb.set_mode(Mode::Status(503));
    let h = harness().await;
    let (id, number) = h
        .submit_body(json!({"config": sample_config(), "queue": "h100", "callback_url": cb.url()}))
        .await;
    h.wait_build_attached(&id).await;
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    assert!(
        cb.wait_for(WAIT, |d| !d.is_empty()).await,
        "no first delivery"
    );
    cb.set_mode(Mode::Accept);
    assert!(
        cb.wait_for(WAIT, |d| d.iter().any(|d| d.status == 204))
            .await,
        "no retry after a 503"
    );
    let deliveries = cb.deliveries();
    assert_eq!(deliveries[0].status, 503);
    let accepted: Vec<_> = deliveries.iter().filter(|d| d.status == 204).collect();
    assert_eq!(accepted.len(), 1, "one accepted delivery: {deliveries:?}");
    // The retry carries the same submission under the same idempotency key.
    assert_eq!(deliveries[0].idempotency_key, accepted[0].idempotency_key);
    let v: Value = serde_json::from_slice(&accepted[0].body).unwrap();
    assert_eq!(
        (v["id"].as_str(), v["state"].as_str()),
        (Some(id.as_str()), Some("succeeded"))
    );
}
