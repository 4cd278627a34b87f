//! Buildkite's webhooks: forgeries refused, plain tokens only when allowed, duplicates,
//! reordering and races harmless, unknown builds and other events acknowledged, body limit.

use kernelkite_testkit::fake_buildkite::{
    signature_header, unix_now, ArtifactSpec, FinishBeforeCreateResponse, Route, Signing,
};
use kernelkite_testkit::harness::{harness, harness_with, result_artifact, WEBHOOK_TOKEN};
use kernelkite_testkit::sample_result_json;

#[tokio::test]
async fn forged_webhooks_are_refused_and_change_nothing() {
    let h = harness().await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake
        .add_artifact(number, ArtifactSpec::result_json(sample_result_json()));
    let body = h.fake.event_body("build.finished", number).unwrap();
    let now = unix_now();
    let ev = ("X-Buildkite-Event", "build.finished".to_string());
    type Case<'a> = (&'a str, Vec<(&'a str, String)>, Vec<u8>);
    let cases: Vec<Case> = vec![
        (
            "wrong key",
            vec![
                ev.clone(),
                (
                    "X-Buildkite-Signature",
                    signature_header("not-the-token", now, &body),
                ),
            ],
            body.clone(),
        ),
        (
            "tampered body",
            vec![
                ev.clone(),
                (
                    "X-Buildkite-Signature",
                    signature_header(WEBHOOK_TOKEN, now, &body),
                ),
            ],
            {
                let mut b = body.clone();
                let i = b.len() / 2;
                b[i] ^= 1;
                b
            },
        ),
        (
            "stale",
            vec![
                ev.clone(),
                (
                    "X-Buildkite-Signature",
                    signature_header(WEBHOOK_TOKEN, now - 400, &body),
                ),
            ],
            body.clone(),
        ),
        (
            "future",
            vec![
                ev.clone(),
                (
                    "X-Buildkite-Signature",
                    signature_header(WEBHOOK_TOKEN, now + 400, &body),
                ),
            ],
            body.clone(),
        ),
        ("missing", vec![ev.clone()], body.clone()),
        (
            "garbled",
            vec![
                ev.clone(),
                ("X-Buildkite-Signature", "timestamp=abc,signature=zz".into()),
            ],
            body.clone(),
        ),
        (
            "empty",
            vec![ev.clone(), ("X-Buildkite-Signature", String::new())],
            body.clone(),
        ),
        (
            "plain token, mode off",
            vec![ev.clone(), ("X-Buildkite-Token", WEBHOOK_TOKEN.into())],
            body.clone(),
        ),
    ];
    for (name, headers, b) in cases {
        assert_eq!(
            h.fake.post_webhook_raw(&headers, b).await,
            Some(401),
            "{name}"
        );
    }
    assert_eq!(h.state(&id).await, "scheduled");
    assert!(h
        .fake
        .api_calls_for(number)
        .iter()
        .all(|c| c.route == Route::CreateBuild));

    // Inside the window (4 minutes old) and correctly signed: accepted.
    let ok = vec![
        ev,
        (
            "X-Buildkite-Signature",
            signature_header(WEBHOOK_TOKEN, now - 240, &body),
        ),
    ];
    assert_eq!(h.fake.post_webhook_raw(&ok, body).await, Some(200));
    assert_eq!(h.wait_terminal(&id).await["state"], "succeeded");
}

#[tokio::test]
async fn plain_token_mode_only_when_allowed() {
    let h = harness_with(|c| c.buildkite.allow_plain_webhook_token = true).await;
    let url = format!("{}/webhooks/buildkite", h.base);
    h.fake
        .set_webhook(url.clone(), Signing::Token("wrong".into()));
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    assert_eq!(h.fake.start_build(number).await, Some(401));
    h.fake
        .set_webhook(url, Signing::Token(WEBHOOK_TOKEN.into()));
    assert_eq!(
        h.fake
            .finish_build(number, "passed", result_artifact())
            .await,
        Some(200)
    );
    assert_eq!(h.wait_terminal(&id).await["state"], "succeeded");
}

#[tokio::test]
async fn without_a_webhook_token_every_webhook_is_refused() {
    let h = harness_with(|c| {
        c.buildkite.buildkite_webhook_token = None;
        c.buildkite.allow_plain_webhook_token = true;
    })
    .await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    assert_eq!(
        h.fake
            .finish_build(number, "passed", result_artifact())
            .await,
        Some(401)
    );
    let (headers, body) = h
        .fake
        .signed_event("build.finished", number, "", unix_now())
        .unwrap();
    assert_eq!(h.fake.post_webhook_raw(&headers, body).await, Some(401));
    assert_eq!(
        h.fake
            .post_webhook_raw(&[("X-Buildkite-Token", String::new())], b"{}".to_vec())
            .await,
        Some(401)
    );
    assert_eq!(h.state(&id).await, "scheduled");
}

#[tokio::test]
async fn duplicate_and_reordered_webhooks_are_harmless() {
    let h = harness().await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    // Reordered: running arrives before scheduled; scheduled must not move it back.
    h.fake.start_build(number).await;
    assert_eq!(
        h.fake.send_event("build.scheduled", number).await,
        Some(200)
    );
    assert_eq!(h.state(&id).await, "running");
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    let first = h.wait_terminal(&id).await;
    assert_eq!(first["state"], "succeeded");
    // Duplicates and stragglers after the end.
    for ev in [
        "build.finished",
        "build.finished",
        "build.running",
        "build.scheduled",
        "build.skipped",
    ] {
        assert_eq!(h.fake.send_event(ev, number).await, Some(200));
    }
    assert_eq!(h.get(&id, "").await.1, first);
    let fetches = h.fake.calls_to(number, Route::ListArtifacts);
    assert_eq!(
        fetches, 1,
        "a duplicate build.finished must not fetch again"
    );
}

#[tokio::test]
async fn concurrent_duplicate_finishes_fetch_once() {
    let h = harness().await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake
        .add_artifact(number, ArtifactSpec::result_json(sample_result_json()));
    h.fake.finish_build(number, "passed", None).await; // sets state; sends one
    let sends = (0..8).map(|_| h.fake.send_event("build.finished", number));
    for s in futures_util::future::join_all(sends).await {
        assert_eq!(s, Some(200));
    }
    assert_eq!(h.wait_terminal(&id).await["state"], "succeeded");
    assert_eq!(h.fake.api_calls_for(number).len(), 3);
}

#[tokio::test]
async fn webhook_racing_the_create_response_is_not_lost() {
    let h = harness().await;
    h.fake
        .finish_before_create_response(FinishBeforeCreateResponse {
            state: "passed".into(),
            artifact: result_artifact(),
        });
    let (id, number) = h.submit().await;
    // The fake delivered build.finished (and got 200) before it answered the create call.
    let finished = h
        .fake
        .requests()
        .into_iter()
        .find(|r| r.route == Route::CreateBuild)
        .unwrap();
    assert_eq!(finished.status, 200);
    let v = h.wait_terminal(&id).await;
    assert_eq!(v["state"], "succeeded", "{v}");
    assert_eq!(v["build"]["number"], number);
    assert_eq!(h.app.store().early_len(), 0);
}

#[tokio::test]
async fn unknown_builds_and_pings_are_acknowledged() {
    let h = harness().await;
    let ping = br#"{"event":"ping","service":{"id":"x","provider":"webhook"},"organization":{},"sender":{}}"#.to_vec();
    let headers = vec![
        ("X-Buildkite-Event", "ping".to_string()),
        (
            "X-Buildkite-Signature",
            signature_header(WEBHOOK_TOKEN, unix_now(), &ping),
        ),
    ];
    assert_eq!(h.fake.post_webhook_raw(&headers, ping).await, Some(200));
    let body = br#"{"event":"build.finished","build":{"id":"00000000-0000-0000-0000-000000000000","number":999,"state":"passed","web_url":"w"},"pipeline":{},"sender":{}}"#.to_vec();
    let headers = vec![
        ("X-Buildkite-Event", "build.finished".to_string()),
        (
            "X-Buildkite-Signature",
            signature_header(WEBHOOK_TOKEN, unix_now(), &body),
        ),
    ];
    assert_eq!(h.fake.post_webhook_raw(&headers, body).await, Some(200));
    assert!(
        h.fake.requests().is_empty(),
        "an unknown build must cause no Buildkite call"
    );
    assert_eq!(
        h.app.store().early_len(),
        1,
        "kept briefly: its create call may not have returned yet"
    );
    // Another pipeline's build (an organization-wide webhook) is not even kept.
    let body = br#"{"event":"build.finished","build":{"id":"00000000-0000-0000-0000-000000000001","number":5,"state":"passed"},"pipeline":{"slug":"someone-else"},"sender":{}}"#.to_vec();
    let headers = vec![(
        "X-Buildkite-Signature",
        signature_header(WEBHOOK_TOKEN, unix_now(), &body),
    )];
    assert_eq!(h.fake.post_webhook_raw(&headers, body).await, Some(200));
    assert_eq!(h.app.store().early_len(), 1);
}

#[tokio::test]
async fn webhook_body_limit_applies() {
    let h = harness_with(|c| c.edge.webhook_max_bytes = 1024).await;
    let body = vec![b' '; 4096];
    let headers = vec![(
        "X-Buildkite-Signature",
        signature_header(WEBHOOK_TOKEN, unix_now(), &body),
    )];
    assert_eq!(h.fake.post_webhook_raw(&headers, body).await, Some(413));
}

#[tokio::test]
async fn blocked_builds_wait_and_skipped_builds_fail() {
    let h = harness().await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake.start_build(number).await;
    h.fake.set_blocked(number, true);
    assert_eq!(h.fake.finish_build(number, "passed", None).await, Some(200));
    assert_eq!(
        h.state(&id).await,
        "running",
        "a blocked build has not really finished"
    );
    assert!(h
        .fake
        .api_calls_for(number)
        .iter()
        .all(|c| c.route == Route::CreateBuild));
    h.fake.set_blocked(number, false);
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    assert_eq!(h.wait_terminal(&id).await["state"], "succeeded");

    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake.complete_build(number, "skipped", None);
    assert_eq!(h.fake.send_event("build.skipped", number).await, Some(200));
    let v = h.wait_terminal(&id).await;
    assert_eq!(v["state"], "failed");
    assert!(v["error"].as_str().unwrap().contains("skipped"), "{v}");
}

#[tokio::test]
async fn job_events_are_acknowledged_and_ignored() {
    let h = harness().await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    for ev in [
        "job.scheduled",
        "job.started",
        "job.finished",
        "build.failing",
    ] {
        assert_eq!(h.fake.send_event(ev, number).await, Some(200), "{ev}");
    }
    assert_eq!(h.state(&id).await, "scheduled");
    // A verified body that is not an event: 400, so Buildkite shows the delivery failed.
    let body = b"[1, 2]".to_vec();
    let headers = vec![(
        "X-Buildkite-Signature",
        signature_header(WEBHOOK_TOKEN, unix_now(), &body),
    )];
    assert_eq!(h.fake.post_webhook_raw(&headers, body).await, Some(400));
}
