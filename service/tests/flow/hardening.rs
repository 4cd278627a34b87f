//! The core hardening items of issue 11, each an attack or outage the previous service
//! failed: a short Buildkite outage after `build.finished`, a webhook naming another build
//! number, callbacks that redirect or go to hosts outside the allow-list, callback URLs the
//! service cannot sign for, and lost webhooks found again by the reconciler.

use std::time::{Duration, Instant};

use kernelkite_service::config::Secret;
use kernelkite_testkit::callback_receiver::{signature_valid, CallbackReceiver, Mode};
use kernelkite_testkit::fake_buildkite::{signature_header, unix_now, ArtifactSpec, Route};
use kernelkite_testkit::harness::{
    harness_with, result_artifact, CALLBACK_SECRET, WAIT, WEBHOOK_TOKEN,
};
use kernelkite_testkit::{sample_config, sample_result_json};
use serde_json::{json, Value};

#[tokio::test]
#[ignore = "full tier (scripts/test.sh runs it): waits out timeouts and intervals of seconds"]
async fn a_short_outage_after_build_finished_does_not_fail_the_submission() {
    // Two tries per call: the old service gave up after them and failed the submission for
    // good (Buildkite does not redeliver build.finished).
    let h = harness_with(|c| {
        c.buildkite.retry_attempts = 2;
        c.retry_base_ms = 20;
    })
    .await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    let outage = Duration::from_millis(2500);
    h.fake.fail_api_until(Instant::now() + outage);
    let t = Instant::now();
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    // Fetching (not failed) during the outage.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(h.state(&id).await, "fetching");
    let v = h.wait_terminal(&id).await;
    assert_eq!(v["state"], "succeeded", "{v}");
    assert!(t.elapsed() >= outage, "finished during the outage?");
    let refused = h
        .fake
        .api_calls_for(number)
        .iter()
        .filter(|c| c.route == Route::ListArtifacts && c.status == 503)
        .count();
    assert!(
        refused >= 3,
        "retried through the outage ({refused} refused tries)"
    );
}

#[tokio::test]
async fn artifacts_are_fetched_by_the_build_number_recorded_for_the_build_id() {
    let h = harness_with(|_| {}).await;
    let (a, na) = h.submit().await;
    h.wait_build_attached(&a).await;
    let (b, nb) = h.submit().await;
    h.wait_build_attached(&b).await;
    let result_of = |host: &str| sample_result_json().replace("gpu-node-1", host);
    h.fake
        .add_artifact(na, ArtifactSpec::result_json(result_of("node-a")));
    h.fake
        .add_artifact(nb, ArtifactSpec::result_json(result_of("node-b")));
    h.fake.complete_build(na, "passed", None);
    // A signed build.finished for A's build id that names B's number.
    let mut body: Value =
        serde_json::from_slice(&h.fake.event_body("build.finished", na).unwrap()).unwrap();
    body["build"]["number"] = json!(nb);
    let body = serde_json::to_vec(&body).unwrap();
    let headers = vec![
        ("X-Buildkite-Event", "build.finished".to_string()),
        (
            "X-Buildkite-Signature",
            signature_header(WEBHOOK_TOKEN, unix_now(), &body),
        ),
    ];
    assert_eq!(h.fake.post_webhook_raw(&headers, body).await, Some(200));
    let v = h.wait_terminal(&a).await;
    assert_eq!(v["state"], "succeeded", "{v}");
    assert_eq!(
        v["result"]["system"]["hostname"], "node-a",
        "A got B's result"
    );
    assert!(
        !h.fake
            .api_calls_for(nb)
            .iter()
            .any(|c| c.route == Route::ListArtifacts),
        "B's artifacts were read for A"
    );
    assert_ne!(h.state(&b).await, "succeeded");
}

#[tokio::test]
async fn callbacks_never_follow_redirects() {
    let target = CallbackReceiver::start().await;
    let redirecting = CallbackReceiver::start().await;
    redirecting.set_mode(Mode::Redirect(target.url()));
    let h = harness_with(|_| {}).await;
    let (id, number) = h
        .submit_body(
            json!({"config": sample_config(), "queue": "h100", "callback_url": redirecting.url()}),
        )
        .await;
    h.wait_build_attached(&id).await;
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    assert_eq!(h.wait_terminal(&id).await["state"], "succeeded");
    assert!(redirecting.wait_for(WAIT, |d| !d.is_empty()).await);
    // Refused for good: no retry, and nothing reaches the redirect's target.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(redirecting.deliveries().len(), 1);
    assert!(target.deliveries().is_empty(), "followed the redirect");
}

#[tokio::test]
async fn callback_urls_need_a_secret_and_an_allowed_host() {
    let h = harness_with(|c| c.callbacks.callback_secret = None).await;
    let (status, v) = h
        .post(json!({"config": sample_config(), "queue": "h100", "callback_url": "http://127.0.0.1:9/cb"}))
        .await;
    assert_eq!(status, 422, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("KERNELKITE_CALLBACK_SECRET"),
        "{v}"
    );
    assert!(
        h.fake.requests().is_empty(),
        "no build for a refused submission"
    );

    let h = harness_with(|c| {
        c.callbacks.callback_secret = Some(Secret::new(CALLBACK_SECRET));
        c.callbacks.callback_allowed_hosts = vec!["backend.example".into()];
    })
    .await;
    let (status, v) = h
        .post(json!({"config": sample_config(), "queue": "h100", "callback_url": "http://169.254.169.254/latest"}))
        .await;
    assert_eq!(status, 422, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("KERNELKITE_CALLBACK_ALLOWED_HOSTS"),
        "{v}"
    );
    let (status, _) = h
        .post(json!({"config": sample_config(), "queue": "h100", "callback_url": "https://backend.example/cb"}))
        .await;
    assert_eq!(status, 202);
}

#[tokio::test]
async fn callbacks_are_signed_with_an_idempotency_key_and_retried() {
    let rx = CallbackReceiver::start().await;
    rx.set_mode(Mode::Status(503));
    let h = harness_with(|_| {}).await;
    let (id, number) = h
        .submit_body(json!({"config": sample_config(), "queue": "h100", "callback_url": rx.url()}))
        .await;
    h.wait_build_attached(&id).await;
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    let done = h.wait_terminal(&id).await;
    assert!(rx.wait_for(WAIT, |d| d.len() >= 3).await, "retried");
    rx.set_mode(Mode::Accept);
    assert!(
        rx.wait_for(WAIT, |d| d.iter().any(|x| x.status == 204))
            .await
    );
    let deliveries = rx.deliveries();
    for d in &deliveries {
        assert_eq!(d.idempotency_key.as_deref(), Some(id.as_str()));
        assert!(
            signature_valid(
                CALLBACK_SECRET,
                d.signature.as_deref().unwrap_or_default(),
                &d.body,
                300
            ),
            "{:?}",
            d.signature
        );
        assert_eq!(serde_json::from_slice::<Value>(&d.body).unwrap(), done);
    }
    // Delivered: no more attempts.
    let n = deliveries.len();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(rx.deliveries().len(), n);
}

#[tokio::test]
async fn a_lost_build_finished_is_found_by_the_reconciler_in_one_listing() {
    let h = harness_with(|c| {
        c.reconcile_min_ms = 200;
        c.reconcile_max_ms = 800;
    })
    .await;
    let mut subs = Vec::new();
    for _ in 0..3 {
        let (id, number) = h.submit().await;
        h.wait_build_attached(&id).await;
        subs.push((id, number));
    }
    h.fake.clear_requests();
    // Finished without any webhook.
    for (_, n) in &subs {
        h.fake.complete_build(*n, "passed", result_artifact());
    }
    for (id, _) in &subs {
        assert_eq!(h.wait_terminal(id).await["state"], "succeeded");
    }
    let lists: Vec<_> = h.fake.requests_to(Route::ListBuilds);
    assert!(!lists.is_empty() && lists.len() < 3, "{lists:?}");
    let q = lists[0].query.clone().unwrap_or_default();
    for part in [
        "state%5B%5D=passed",
        "finished_from=",
        "exclude_jobs=true",
        "exclude_pipeline=true",
        "per_page=100",
    ] {
        assert!(q.contains(part), "{part} not in {q}");
    }
}

#[tokio::test]
async fn the_core_counts_what_operators_watch() {
    let h = harness_with(|c| {
        c.reconcile_min_ms = 200;
        c.reconcile_max_ms = 800;
    })
    .await;
    let (a, na) = h.submit().await;
    h.wait_build_attached(&a).await;
    h.fake.finish_build(na, "passed", result_artifact()).await;
    assert_eq!(h.wait_terminal(&a).await["state"], "succeeded");
    // One finished without its webhook: found by the reconciler.
    let (b, nb) = h.submit().await;
    h.wait_build_attached(&b).await;
    h.fake.complete_build(nb, "passed", result_artifact());
    assert_eq!(h.wait_terminal(&b).await["state"], "succeeded");
    let text = h.app.metrics().render();
    for line in [
        "kernelkite_submissions{state=\"succeeded\"} 2",
        "kernelkite_submissions{state=\"queued\"} 0",
        "kernelkite_buildkite_calls_total{call=\"create_build\"} 2",
        "kernelkite_buildkite_calls_total{call=\"list_artifacts\"} 2",
        "kernelkite_reconciler_finds_total 1",
        "kernelkite_wake_to_result_seconds_count 2",
    ] {
        assert!(text.contains(line), "{line} not in\n{text}");
    }
    for part in [
        "kernelkite_buildkite_calls_total{call=\"list_builds\"}",
        "kernelkite_store_seconds_count{op=\"update\"}",
        "kernelkite_store_seconds_count{op=\"insert\"}",
        "kernelkite_store_seconds_count{op=\"commit\"}",
    ] {
        assert!(text.contains(part), "{part} not in\n{text}");
    }
}
