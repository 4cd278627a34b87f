//! `Idempotency-Key` on `POST /v1/submissions`: the same key with the same request is the
//! same submission (`200`, one build), with another request `409`; keys outlive a restart.

use kernelkite_testkit::harness::{harness, WAIT};
use kernelkite_testkit::sample_config;
use serde_json::{json, Value};

async fn post_with_key(
    h: &kernelkite_testkit::harness::Harness,
    key: &str,
    body: &Value,
) -> (u16, Value) {
    let r = h
        .http
        .post(format!("{}/v1/submissions", h.base))
        .header("Idempotency-Key", key)
        .json(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn the_same_key_and_request_is_the_same_submission() {
    let h = harness().await;
    let body = json!({"config": sample_config(), "queue": "h100", "run_id": "r-7"});
    let (s1, v1) = post_with_key(&h, "key-1", &body).await;
    assert_eq!(s1, 202, "{v1}");
    let number = h.fake.next_created(WAIT).await.unwrap();
    let (s2, v2) = post_with_key(&h, "key-1", &body).await;
    assert_eq!(s2, 200, "{v2}");
    assert_eq!(v2["id"], v1["id"]);
    assert_eq!(v2["status_url"], v1["status_url"]);
    // Whitespace is not the request; the fields are.
    let spaced = serde_json::to_string_pretty(&body).unwrap();
    let r = h
        .http
        .post(format!("{}/v1/submissions", h.base))
        .header("Idempotency-Key", "key-1")
        .header("content-type", "application/json")
        .body(spaced)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);

    let mut other = body.clone();
    other["run_id"] = json!("r-8");
    let (s3, v3) = post_with_key(&h, "key-1", &other).await;
    assert_eq!(s3, 409, "{v3}");
    assert!(
        v3["error"].as_str().unwrap().contains("Idempotency-Key"),
        "{v3}"
    );

    // One build for the key.
    assert_eq!(
        h.fake
            .next_created(std::time::Duration::from_millis(300))
            .await,
        None
    );
    assert_eq!(h.fake.builds_meta().len(), 1, "build {number} only");

    // Another key is another submission.
    let (s4, v4) = post_with_key(&h, "key-2", &body).await;
    assert_eq!(s4, 202);
    assert_ne!(v4["id"], v1["id"]);

    for bad in ["", &"k".repeat(256)] {
        let (s, v) = post_with_key(&h, bad, &body).await;
        assert_eq!(s, 400, "{bad:?}: {v}");
    }

    // The key is kept in the store: after a restart it still names the submission.
    let restarted = kernelkite_service::cli::serve::start_buildkite(&h.cfg).unwrap();
    let req: kernelkite_service::SubmitRequest = serde_json::from_value(body).unwrap();
    let again = restarted.submit(req, Some("key-1".into())).await.unwrap();
    assert!(!again.created);
    assert_eq!(json!(again.submission.id), v1["id"]);
}
