//! Waiting for a submission: `?wait=` long-polls and the SSE stream of state changes.

use std::time::{Duration, Instant};

use kernelkite_testkit::harness::{harness, harness_with, result_artifact, uuid_like, WAIT};
use serde_json::Value;

#[tokio::test]
async fn long_poll_returns_current_state_when_the_wait_ends() {
    let h = harness().await;
    let (id, _) = h.submit().await;
    h.wait_build_attached(&id).await;
    let t = Instant::now();
    let (status, v) = h.get(&id, "?wait=0.3").await;
    assert_eq!((status, v["state"].as_str()), (200, Some("scheduled")));
    assert!(t.elapsed() >= Duration::from_millis(290));
    assert_eq!(h.get(&id, "?wait=abc").await.0, 400);
    assert_eq!(h.get(&id, "?wait=-1").await.0, 400);
    assert_eq!(h.get(uuid_like(), "?wait=1").await.0, 404);
}

#[tokio::test]
async fn sse_streams_every_state_change() {
    let h = harness().await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    let mut resp = h
        .http
        .get(format!("{}/v1/submissions/{id}/events", h.base))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    h.fake.start_build(number).await;
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    let mut text = String::new();
    let read = async {
        while let Some(chunk) = resp.chunk().await.unwrap() {
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
    };
    tokio::time::timeout(WAIT, read)
        .await
        .expect("stream ends after the terminal event");
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(
        events,
        ["queued", "scheduled", "running", "fetching", "succeeded"],
        "{text}"
    );
    let last: Value = serde_json::from_str(
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .next_back()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(last["submission"]["result"]["success"], true);

    // Resuming after event 3 replays only the last one.
    let r = h
        .http
        .get(format!("{}/v1/submissions/{id}/events", h.base))
        .header("Last-Event-ID", "3")
        .send()
        .await
        .unwrap();
    let body = r.text().await.unwrap();
    assert_eq!(
        body.lines()
            .filter_map(|l| l.strip_prefix("event: "))
            .collect::<Vec<_>>(),
        ["succeeded"]
    );
}

#[tokio::test]
async fn sse_resume_id_past_the_end_replays_nothing() {
    let h = harness().await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    h.wait_terminal(&id).await;
    // A client-chosen Last-Event-ID: the largest number must not overflow (a panic drops the
    // connection; a wrap would replay everything).
    for last in ["4", "1000", &usize::MAX.to_string()] {
        let r = h
            .http
            .get(format!("{}/v1/submissions/{id}/events", h.base))
            .header("Last-Event-ID", last)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200, "{last}");
        let body = tokio::time::timeout(WAIT, r.text()).await.unwrap().unwrap();
        assert!(!body.contains("event: "), "{last}: {body}");
    }
}

#[tokio::test]
async fn long_poll_on_a_finished_submission_returns_at_once() {
    // The waiter must look at the current value before sleeping: a submission that ended
    // before the request arrived (or between reading and subscribing) must not wait for a
    // change that never comes.
    let h = harness().await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake.finish_build(number, "failed", None).await;
    h.wait_terminal(&id).await;
    let t = Instant::now();
    let (status, v) = h.get(&id, "?wait=5").await;
    assert_eq!((status, v["state"].as_str()), (200, Some("failed")));
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "waited {:?}",
        t.elapsed()
    );
}

#[tokio::test]
async fn a_huge_wait_under_a_huge_cap_does_not_panic() {
    let h = harness_with(|c| c.edge.max_wait_s = u64::MAX).await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake.finish_build(number, "failed", None).await;
    h.wait_terminal(&id).await;
    let (status, v) = h.get(&id, "?wait=1e300").await;
    assert_eq!((status, v["state"].as_str()), (200, Some("failed")));
}
