//! Finished submissions outlive memory: they leave it the moment they end, the store answers
//! for them, after a restart too; housekeeping expires early events.

use std::time::{Duration, Instant};

use kernelkite_service::Config;
use kernelkite_testkit::fake_buildkite::{
    signature_header, unix_now, FAKE_API_TOKEN, FAKE_ORG, FAKE_PIPELINE,
};
use kernelkite_testkit::harness::{harness, harness_with, result_artifact, WAIT, WEBHOOK_TOKEN};
use serde_json::Value;

#[tokio::test]
#[ignore = "full tier (scripts/test.sh runs it): waits out timeouts and intervals of seconds"]
async fn finished_submissions_leave_memory_at_once_and_early_events_expire() {
    let h = harness_with(|c| {
        c.store.early_event_ttl_s = 1;
    })
    .await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    let done = h.wait_terminal(&id).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    // Memory holds only what is in flight: the finished submission is served from the store.
    assert!(
        h.app.store().is_empty(),
        "a finished submission stayed in memory"
    );
    assert_eq!(h.get(&id, "").await, (200, done));
    let body = br#"{"event":"build.running","build":{"id":"00000000-0000-0000-0000-0000000000ee","number":77,"state":"running"},"pipeline":{},"sender":{}}"#.to_vec();
    let headers = vec![(
        "X-Buildkite-Signature",
        signature_header(WEBHOOK_TOKEN, unix_now(), &body),
    )];
    assert_eq!(h.fake.post_webhook_raw(&headers, body).await, Some(200));
    let deadline = Instant::now() + WAIT;
    while h.app.store().early_len() == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(h.app.store().early_len(), 1);
    // The housekeeping task runs every second here; the event must go within a few ticks.
    while h.app.store().early_len() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        h.app.store().early_len(),
        0,
        "early events outlived their TTL"
    );
}

#[tokio::test]
async fn finished_submissions_are_read_back_from_the_data_dir_after_a_restart() {
    let h = harness().await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    let before = h.wait_terminal(&id).await;
    // A second service on the same data dir, with nothing in memory.
    let mut cfg = Config::new(&h.fake.api_url(), FAKE_ORG, FAKE_PIPELINE, FAKE_API_TOKEN);
    cfg.fair.cache = false;
    cfg.fair.queue_slots = kernelkite_service::dispatch::Slots::parse("*=none").unwrap();
    cfg.store.data_dir = Some(h._dir.path().to_path_buf());
    let restarted = kernelkite_service::cli::serve::start_buildkite(&cfg).unwrap();
    assert!(restarted.store().is_empty());
    let after = restarted
        .lookup(&id)
        .await
        .unwrap()
        .expect("read from the store");
    assert_eq!(serde_json::to_value(after).unwrap(), before);

    // Through the HTTP API of the restarted service: GET and the SSE replay.
    use tower::ServiceExt;
    let router = kernelkite_service::router(restarted, &cfg);
    let local: std::net::SocketAddr = "127.0.0.1:9".parse().unwrap();
    let req = |path: String| {
        let mut r = axum::http::Request::get(path)
            .body(axum::body::Body::empty())
            .unwrap();
        r.extensions_mut().insert(axum::extract::ConnectInfo(local));
        r
    };
    let r = router
        .clone()
        .oneshot(req(format!("/v1/submissions/{id}?wait=5")))
        .await
        .unwrap();
    let body = axum::body::to_bytes(r.into_body(), usize::MAX)
        .await
        .unwrap();
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap(), before);
    // Cancelling it there is "already ended", not "no such submission".
    let mut cancel = req(format!("/v1/submissions/{id}/cancel"));
    *cancel.method_mut() = axum::http::Method::POST;
    let r = router.clone().oneshot(cancel).await.unwrap();
    assert_eq!(r.status().as_u16(), 409);
    let r = router
        .oneshot(req(format!("/v1/submissions/{id}/events")))
        .await
        .unwrap();
    let body = tokio::time::timeout(WAIT, axum::body::to_bytes(r.into_body(), usize::MAX))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8(body.to_vec()).unwrap();
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(
        events,
        ["queued", "scheduled", "fetching", "succeeded"],
        "{text}"
    );
}
