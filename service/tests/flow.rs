//! The service against the fake Buildkite, over real loopback HTTP: submissions, signed
//! webhooks, artifact checks, faults, races, cancel, timeouts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kernelkite_service::config::Secret;
use kernelkite_service::{App, Config};
use kernelkite_testkit::fake_buildkite::{
    signature_header, unix_now, ArtifactSpec, FakeBuildkite, Fault, FinishBeforeCreateResponse,
    Route, Signing, FAKE_API_TOKEN, FAKE_ORG, FAKE_PIPELINE,
};
use kernelkite_testkit::{sample_config, sample_result_json};
use serde_json::{json, Value};

use common::*;
use kernelkite_testkit::harness as common;

#[tokio::test]
async fn happy_path_creates_the_build_and_returns_the_checked_result() {
    let h = harness().await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;

    // The build carries what the runner needs, exactly as DESIGN.md lays it out.
    let build = h.fake.build(number).unwrap();
    let env = &build["env"];
    let payload = env["KERNELBOT_PAYLOAD"].as_str().unwrap();
    assert_eq!(
        kernelkite_kernelbot::payload::decode(payload).unwrap(),
        sample_config()
    );
    assert_eq!(env["KERNELBOT_RUN_ID"], "run-1");
    assert_eq!(env["KERNELBOT_QUEUE"], "h100");
    assert_eq!(build["meta_data"]["run_id"], "run-1");
    assert_eq!(build["branch"], "main");

    let (_, v) = h.get(&id, "").await;
    assert_eq!(v["state"], "scheduled");
    assert_eq!(
        v["build"],
        json!({"id": build["id"], "number": number, "web_url": build["web_url"]})
    );

    assert_eq!(h.fake.start_build(number).await, Some(200));
    assert_eq!(h.state(&id).await, "running");

    // Long-poll first, then finish: the poll must return the result.
    let waiter = {
        let (http, url) = (
            h.http.clone(),
            format!("{}/v1/submissions/{id}?wait=10", h.base),
        );
        tokio::spawn(async move {
            http.get(url)
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        })
    };
    assert_eq!(
        h.fake
            .finish_build(number, "passed", result_artifact())
            .await,
        Some(200)
    );
    let v = waiter.await.unwrap();
    assert_eq!(v["state"], "succeeded", "{v}");
    let want: Value = serde_json::from_str(&sample_result_json()).unwrap();
    assert_eq!(v["result"], want);
    assert!(v["error"].is_null());
    assert!(v["finished_at"].is_string() && v["created_at"].is_string());
    let states: Vec<&str> = v["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["state"].as_str().unwrap())
        .collect();
    assert_eq!(
        states,
        ["queued", "scheduled", "running", "fetching", "succeeded"]
    );

    // Exactly three API calls: create, list artifacts (filtered), download; blob without auth.
    let calls = h.fake.api_calls_for(number);
    let routes: Vec<Route> = calls.iter().map(|c| c.route).collect();
    assert_eq!(
        routes,
        [Route::CreateBuild, Route::ListArtifacts, Route::Download],
        "{calls:?}"
    );
    assert_eq!(calls[1].query.as_deref(), Some("path=result.json"));
    let blobs: Vec<_> = h
        .fake
        .requests()
        .into_iter()
        .filter(|r| r.route == Route::Blob)
        .collect();
    assert_eq!(blobs.len(), 1);
    assert!(blobs[0].authorization.is_none() && blobs[0].status == 200);

    // Terminal submissions are written to the data dir.
    let file = h._dir.path().join("submissions").join(format!("{id}.json"));
    let mut on_disk = Value::Null;
    for _ in 0..200 {
        if let Ok(b) = std::fs::read(&file) {
            on_disk = serde_json::from_slice(&b).unwrap();
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(on_disk["state"], "succeeded");
}

#[tokio::test]
async fn large_payload_travels_in_chunks() {
    let h = harness().await;
    let mut cfg = sample_config();
    // Incompressible text, so the base64 payload exceeds the 128 KiB single-variable limit.
    let mut rng = fastrand::Rng::with_seed(7);
    let noise: String = (0..400_000).map(|_| rng.alphanumeric()).collect();
    cfg["sources"]["data.py"] = json!(noise);
    let (_, number) = h.submit_body(json!({"config": cfg, "queue": "h100"})).await;
    let env = h.fake.build(number).unwrap()["env"].clone();
    assert!(env.get("KERNELBOT_PAYLOAD").is_none());
    assert!(
        env["KERNELBOT_PAYLOAD_CHUNKS"]
            .as_str()
            .unwrap()
            .parse::<usize>()
            .unwrap()
            >= 2
    );
    for (k, v) in env.as_object().unwrap() {
        assert!(
            k.len() + v.as_str().unwrap().len() + 2 <= 131_072,
            "{k} is over MAX_ARG_STRLEN"
        );
    }
    let joined = kernelkite_kernelbot::payload::from_env(|k| {
        env.get(k).and_then(|v| v.as_str()).map(str::to_string)
    })
    .unwrap();
    assert_eq!(kernelkite_kernelbot::payload::decode(&joined).unwrap(), cfg);
}

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
    let h = harness_with(|c| c.allow_plain_webhook_token = true).await;
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
        c.buildkite_webhook_token = None;
        c.allow_plain_webhook_token = true;
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
async fn failed_and_canceled_builds_without_the_artifact_fail_with_state_and_url() {
    let h = harness().await;
    for state in ["failed", "canceled"] {
        let (id, number) = h.submit().await;
        h.wait_build_attached(&id).await;
        h.fake.finish_build(number, state, None).await;
        let v = h.wait_terminal(&id).await;
        assert_eq!(v["state"], "failed", "{v}");
        let err = v["error"].as_str().unwrap();
        assert!(
            err.contains(&format!("{state:?}")) && err.contains("without result.json"),
            "{err}"
        );
        assert!(
            err.contains(h.fake.build(number).unwrap()["web_url"].as_str().unwrap()),
            "{err}"
        );
        assert!(v["result"].is_null());
    }
}

#[tokio::test]
async fn failed_build_with_a_result_returns_the_result() {
    // The runner writes result.json even when the evaluation fails; that result is the answer.
    let h = harness().await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake
        .finish_build(number, "failed", result_artifact())
        .await;
    let v = h.wait_terminal(&id).await;
    assert_eq!(v["state"], "succeeded");
    assert_eq!(v["result"]["system"]["hostname"], "gpu-node-1");
}

#[tokio::test]
async fn missing_or_unfinished_artifact_fails() {
    let h = harness().await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake.finish_build(number, "passed", None).await;
    let v = h.wait_terminal(&id).await;
    assert_eq!(v["state"], "failed");
    assert!(
        v["error"].as_str().unwrap().contains("without result.json"),
        "{v}"
    );

    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    let mut spec = ArtifactSpec::result_json(sample_result_json());
    spec.state = "error".into();
    h.fake.finish_build(number, "passed", Some(spec)).await;
    let v = h.wait_terminal(&id).await;
    assert!(
        v["error"].as_str().unwrap().contains("in state error"),
        "{v}"
    );
    // An artifact that is not finished is never downloaded.
    assert!(!h
        .fake
        .api_calls_for(number)
        .iter()
        .any(|c| c.route == Route::Download));
}

#[tokio::test]
async fn corrupt_artifacts_are_refused() {
    let h = harness().await;
    let good = sample_result_json();
    let cases = [
        (
            "SHA-1",
            ArtifactSpec {
                sha1sum: Some("da39a3ee5e6b4b0d3255bfef95601890afd80709".into()),
                ..ArtifactSpec::result_json(good.clone())
            },
        ),
        (
            "bytes but Buildkite lists",
            ArtifactSpec {
                file_size: Some(good.len() as u64 + 10),
                ..ArtifactSpec::result_json(good.clone())
            },
        ),
        (
            "not a kernelbot FullResult",
            // `runs` missing: not a result at all (an unknown field alone would be kept).
            ArtifactSpec::result_json(good.replace("\"runs\"", "\"rungs\"")),
        ),
    ];
    for (want, spec) in cases {
        let (id, number) = h.submit().await;
        h.wait_build_attached(&id).await;
        h.fake.finish_build(number, "passed", Some(spec)).await;
        let v = h.wait_terminal(&id).await;
        assert_eq!(v["state"], "failed");
        assert!(v["error"].as_str().unwrap().contains(want), "{want}: {v}");
        assert!(v["result"].is_null());
    }
}

#[tokio::test]
async fn rate_limit_is_honoured_then_the_call_succeeds() {
    let h = harness().await;
    h.fake
        .inject(Route::CreateBuild, Fault::RateLimited { reset_s: 1 });
    let (id, number) = h.submit().await;
    let creates: Vec<_> = h
        .fake
        .requests()
        .into_iter()
        .filter(|r| r.route == Route::CreateBuild)
        .collect();
    assert_eq!(
        creates.iter().map(|r| r.status).collect::<Vec<_>>(),
        [429, 200]
    );
    let gap = creates[1].at - creates[0].at;
    assert!(
        gap >= Duration::from_millis(950),
        "retried after {gap:?}, before RateLimit-Reset"
    );
    h.wait_build_attached(&id).await;
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    assert_eq!(h.wait_terminal(&id).await["state"], "succeeded");
}

#[tokio::test]
async fn server_errors_are_retried() {
    let h = harness().await;
    h.fake.inject(Route::CreateBuild, Fault::Status(500));
    h.fake.inject(Route::ListArtifacts, Fault::Status(502));
    h.fake.inject(Route::ListArtifacts, Fault::Status(503));
    h.fake.inject(Route::Download, Fault::Status(500));
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    let v = h.wait_terminal(&id).await;
    assert_eq!(v["state"], "succeeded", "{v}");
    let statuses: Vec<(Route, u16)> = h
        .fake
        .api_calls_for(number)
        .iter()
        .map(|c| (c.route, c.status))
        .collect();
    assert_eq!(
        statuses,
        [
            (Route::CreateBuild, 500),
            (Route::CreateBuild, 200),
            (Route::ListArtifacts, 502),
            (Route::ListArtifacts, 503),
            (Route::ListArtifacts, 200),
            (Route::Download, 500),
            (Route::Download, 200),
        ]
    );
}

#[tokio::test]
async fn a_timed_out_artifact_fetch_is_retried_but_a_timed_out_create_is_not() {
    let h = harness_with(|c| c.http_timeout_s = 1).await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    // The first listing answers after the client gave up: GET is safe to repeat.
    h.fake.inject(
        Route::ListArtifacts,
        Fault::Delay(Duration::from_millis(1500)),
    );
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    let v = h.wait_terminal(&id).await;
    assert_eq!(v["state"], "succeeded", "{v}");
    let lists = h
        .fake
        .api_calls_for(number)
        .iter()
        .filter(|c| c.route == Route::ListArtifacts)
        .count();
    assert_eq!(lists, 2, "the abandoned listing, then the retry");

    // A create that timed out may have created the build: it fails instead of creating a
    // second one (a retry would succeed here, and the submission would not fail).
    h.fake.inject(
        Route::CreateBuild,
        Fault::Delay(Duration::from_millis(1500)),
    );
    h.fake.clear_requests();
    let (_, v) = h
        .post(json!({"config": sample_config(), "queue": "h100"}))
        .await;
    let v = h.wait_terminal(v["id"].as_str().unwrap()).await;
    assert_eq!(v["state"], "failed", "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("could not reach Buildkite"),
        "{v}"
    );
    let creates = h
        .fake
        .requests()
        .iter()
        .filter(|r| r.route == Route::CreateBuild)
        .count();
    assert_eq!(creates, 1, "a create that may have arrived is not repeated");
}

#[tokio::test]
async fn persistent_client_errors_fail_the_submission_with_buildkites_message() {
    let h = harness_with(|c| c.retry_attempts = 2).await;
    h.fake.inject(Route::CreateBuild, Fault::Status(500));
    h.fake.inject(Route::CreateBuild, Fault::Status(500));
    let (_, v) = h
        .post(json!({"config": sample_config(), "queue": "h100"}))
        .await;
    let v = h.wait_terminal(v["id"].as_str().unwrap()).await;
    assert_eq!(v["state"], "failed");
    assert!(v["error"].as_str().unwrap().contains("500"), "{v}");
    assert!(v["build"].is_null());
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
    let fetches = h
        .fake
        .api_calls_for(number)
        .iter()
        .filter(|c| c.route == Route::ListArtifacts)
        .count();
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
    assert_eq!(h.app.store.early_len(), 0);
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
        h.app.store.early_len(),
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
    assert_eq!(h.app.store.early_len(), 1);
}

#[tokio::test]
async fn housekeeping_expires_early_events_and_evicts_finished_submissions() {
    let h = harness_with(|c| {
        c.early_event_ttl_s = 1;
        c.retain_s = 1;
    })
    .await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    let done = h.wait_terminal(&id).await;
    let body = br#"{"event":"build.running","build":{"id":"00000000-0000-0000-0000-0000000000ee","number":77,"state":"running"},"pipeline":{},"sender":{}}"#.to_vec();
    let headers = vec![(
        "X-Buildkite-Signature",
        signature_header(WEBHOOK_TOKEN, unix_now(), &body),
    )];
    assert_eq!(h.fake.post_webhook_raw(&headers, body).await, Some(200));
    assert_eq!(h.app.store.early_len(), 1);
    // The housekeeping task runs every second here; both must go within a few ticks.
    let deadline = Instant::now() + WAIT;
    while (h.app.store.early_len() > 0 || !h.app.store.is_empty()) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        h.app.store.early_len(),
        0,
        "early events outlived their TTL"
    );
    assert!(
        h.app.store.is_empty(),
        "finished submission kept past KERNELKITE_RETAIN_S"
    );
    // Gone from memory, still answered from the data dir.
    assert_eq!(h.get(&id, "").await, (200, done));
}

#[tokio::test]
async fn webhook_body_limit_applies() {
    let h = harness_with(|c| c.webhook_max_bytes = 1024).await;
    let body = vec![b' '; 4096];
    let headers = vec![(
        "X-Buildkite-Signature",
        signature_header(WEBHOOK_TOKEN, unix_now(), &body),
    )];
    assert_eq!(h.fake.post_webhook_raw(&headers, body).await, Some(413));
}

#[tokio::test]
async fn cancel_cancels_the_build_and_sticks() {
    let h = harness().await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake.start_build(number).await;
    let r = h
        .http
        .delete(format!("{}/v1/submissions/{id}", h.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["state"], "canceled");
    assert!(
        h.fake.wait_state(number, "canceled", WAIT).await,
        "the build was not canceled on Buildkite"
    );
    // The fake's own build.finished(canceled) follows; the submission stays canceled.
    let r = h
        .http
        .delete(format!("{}/v1/submissions/{id}", h.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "cancel is idempotent");
    let v = h.wait_terminal(&id).await;
    assert_eq!(v["state"], "canceled");
    assert_eq!(v["error"], "canceled by request");

    let r = h
        .http
        .delete(format!("{}/v1/submissions/{}", h.base, uuid_like()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);

    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    h.wait_terminal(&id).await;
    let r = h
        .http
        .delete(format!("{}/v1/submissions/{id}", h.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 409);
}

#[tokio::test]
async fn cancel_before_the_build_exists_cancels_it_once_created() {
    let h = harness().await;
    h.fake
        .inject(Route::CreateBuild, Fault::Delay(Duration::from_millis(200)));
    let (_, v) = h
        .post(json!({"config": sample_config(), "queue": "h100"}))
        .await;
    let id = v["id"].as_str().unwrap();
    let r = h
        .http
        .delete(format!("{}/v1/submissions/{id}", h.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["state"], "canceled");
    let number = h.fake.next_created(WAIT).await.unwrap();
    assert!(h.fake.wait_state(number, "canceled", WAIT).await);
}

#[tokio::test]
async fn a_build_created_after_its_canceled_submission_was_evicted_is_canceled() {
    // Housekeeping every second, finished submissions kept one second: the canceled
    // submission leaves memory while its (slow) create call is still out.
    let h = harness_with(|c| {
        c.early_event_ttl_s = 2;
        c.retain_s = 1;
    })
    .await;
    h.fake.inject(
        Route::CreateBuild,
        Fault::Delay(Duration::from_millis(3500)),
    );
    let (_, v) = h
        .post(json!({"config": sample_config(), "queue": "h100"}))
        .await;
    let id = v["id"].as_str().unwrap();
    let r = h
        .http
        .delete(format!("{}/v1/submissions/{id}", h.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let number = h.fake.next_created(WAIT).await.unwrap();
    assert!(
        h.app.store.get(id).is_none(),
        "evicted before the create returned"
    );
    assert!(
        h.fake.wait_state(number, "canceled", WAIT).await,
        "the build runs for a submission nobody holds"
    );
}

fn uuid_like() -> &'static str {
    "11111111-2222-4333-8444-555555555555"
}

#[tokio::test]
async fn timeout_times_out_and_cancels_the_build() {
    let h = harness().await;
    let (id, number) = h
        .submit_body(json!({"config": sample_config(), "queue": "h100", "timeout_s": 1}))
        .await;
    let v = h.wait_terminal(&id).await;
    assert_eq!(v["state"], "timed_out");
    assert!(v["error"].as_str().unwrap().contains("1 s"));
    assert!(h.fake.wait_state(number, "canceled", WAIT).await);
}

#[tokio::test]
async fn invalid_requests_are_refused_without_a_build() {
    let h = harness().await;
    let mut no_main = sample_config();
    no_main.as_object_mut().unwrap().remove("main");
    let cases = [
        (
            json!({"config": no_main, "queue": "h100"}),
            422,
            "`main` is required",
        ),
        (
            json!({"config": {"lang": "rust"}, "queue": "h100"}),
            422,
            "not a valid kernelbot run config",
        ),
        (
            json!({"config": sample_config(), "queue": "h100; rm"}),
            422,
            "queue",
        ),
        (
            json!({"config": sample_config(), "queue": "h100", "timeout_s": 0}),
            422,
            "timeout_s",
        ),
        (
            json!({"config": sample_config(), "queue": "h100", "callback_url": "file:///etc"}),
            422,
            "callback_url",
        ),
        (
            json!({"config": sample_config(), "queue": "h100", "extra": 1}),
            422,
            "unknown field",
        ),
        (json!({"queue": "h100"}), 422, "config"),
    ];
    for (body, status, want) in cases {
        let (s, v) = h.post(body.clone()).await;
        assert_eq!(s, status, "{body}: {v}");
        assert!(v["error"].as_str().unwrap().contains(want), "{body}: {v}");
    }
    let r = h
        .http
        .post(format!("{}/v1/submissions", h.base))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    assert!(
        h.fake.requests().is_empty(),
        "no build may be created for a refused submission"
    );
    assert!(h.app.store.is_empty());
}

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
    let h = harness_with(|c| c.max_wait_s = u64::MAX).await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake.finish_build(number, "failed", None).await;
    h.wait_terminal(&id).await;
    let (status, v) = h.get(&id, "?wait=1e300").await;
    assert_eq!((status, v["state"].as_str()), (200, Some("failed")));
}

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

#[tokio::test]
async fn finished_submissions_are_read_back_from_the_data_dir_after_a_restart() {
    let h = harness().await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    let before = h.wait_terminal(&id).await;
    let file = h._dir.path().join("submissions").join(format!("{id}.json"));
    for _ in 0..200 {
        if file.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A second service on the same data dir, with nothing in memory.
    let mut cfg = Config::new(&h.fake.api_url(), FAKE_ORG, FAKE_PIPELINE, FAKE_API_TOKEN);
    cfg.data_dir = Some(h._dir.path().to_path_buf());
    let restarted = App::new(cfg).unwrap();
    assert!(restarted.store.is_empty());
    let after = restarted.lookup(&id).await.expect("read from disk");
    assert_eq!(serde_json::to_value(after).unwrap(), before);

    // Through the HTTP API of the restarted service: GET and the SSE replay.
    use tower::ServiceExt;
    let router = kernelkite_service::router(restarted);
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
    let mut del = req(format!("/v1/submissions/{id}"));
    *del.method_mut() = axum::http::Method::DELETE;
    let r = router.clone().oneshot(del).await.unwrap();
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

#[tokio::test]
async fn bearer_token_guards_the_api() {
    let h = harness_with(|c| c.api_token = Some(Secret::new("kk-token"))).await;
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
    let router = kernelkite_service::router(h.app.clone());
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

#[tokio::test]
async fn openapi_document_describes_the_routes() {
    let h = harness().await;
    let doc: Value = h
        .http
        .get(format!("{}/openapi.json", h.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for path in [
        "/v1/submissions",
        "/v1/submissions/{id}",
        "/v1/submissions/{id}/events",
        "/webhooks/buildkite",
    ] {
        assert!(
            doc["paths"][path].is_object(),
            "{path} missing from openapi.json"
        );
    }
    let states = doc["components"]["schemas"]["State"]["enum"].clone();
    assert_eq!(
        states,
        json!([
            "queued",
            "scheduled",
            "running",
            "fetching",
            "succeeded",
            "failed",
            "canceled",
            "timed_out"
        ])
    );
    assert_eq!(
        h.http
            .get(format!("{}/healthz", h.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
        "ok"
    );
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

#[tokio::test]
async fn unreachable_buildkite_is_retried_then_fails_the_submission() {
    // A port with nothing listening: every attempt is a connect error.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let h = harness_with(|c| {
        c.buildkite_api_url = format!("http://127.0.0.1:{port}/v2");
        c.retry_attempts = 4;
        c.retry_base_ms = 20;
    })
    .await;
    let t = Instant::now();
    let (_, v) = h
        .post(json!({"config": sample_config(), "queue": "h100"}))
        .await;
    let v = h.wait_terminal(v["id"].as_str().unwrap()).await;
    assert_eq!(v["state"], "failed");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("could not reach Buildkite"),
        "{v}"
    );
    // Three backoffs of 20, 40, 80 ms (each at least 75 %, so 105 ms) passed before giving up.
    assert!(
        t.elapsed() >= Duration::from_millis(100),
        "gave up after {:?}",
        t.elapsed()
    );
}

#[tokio::test]
async fn rate_limits_do_not_use_up_failure_retries_but_are_bounded() {
    let h = harness_with(|c| c.retry_attempts = 2).await;
    for _ in 0..5 {
        h.fake
            .inject(Route::CreateBuild, Fault::RateLimited { reset_s: 0 });
    }
    h.fake.inject(Route::CreateBuild, Fault::Status(503));
    let (id, _) = h.submit().await;
    h.wait_build_attached(&id).await;
    let statuses: Vec<u16> = h
        .fake
        .requests()
        .iter()
        .filter(|r| r.route == Route::CreateBuild)
        .map(|r| r.status)
        .collect();
    assert_eq!(statuses, [429, 429, 429, 429, 429, 503, 200]);

    h.fake.clear_requests();
    for _ in 0..=kernelkite_service::buildkite::MAX_RATE_LIMITED_RETRIES {
        h.fake
            .inject(Route::CreateBuild, Fault::RateLimited { reset_s: 0 });
    }
    let (_, v) = h
        .post(json!({"config": sample_config(), "queue": "h100"}))
        .await;
    let v = h.wait_terminal(v["id"].as_str().unwrap()).await;
    assert_eq!(v["state"], "failed");
    assert!(v["error"].as_str().unwrap().contains("429"), "{v}");
    assert_eq!(
        h.fake.requests().len() as u32,
        kernelkite_service::buildkite::MAX_RATE_LIMITED_RETRIES + 1
    );
}

#[tokio::test]
async fn the_binary_serves_a_submission_end_to_end_and_stops_on_sigterm() {
    let fake = FakeBuildkite::start().await;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let data = tempfile::tempdir().unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_kernelkite-service"))
        .env_clear()
        .env("KERNELKITE_LISTEN", format!("127.0.0.1:{port}"))
        .env("BUILDKITE_API_URL", fake.api_url())
        .env("BUILDKITE_ORG", FAKE_ORG)
        .env("BUILDKITE_PIPELINE", FAKE_PIPELINE)
        .env("BUILDKITE_API_TOKEN", FAKE_API_TOKEN)
        .env("BUILDKITE_WEBHOOK_TOKEN", WEBHOOK_TOKEN)
        .env("KERNELKITE_API_TOKEN", "kk")
        .env("KERNELKITE_BRANCH", "release")
        .env("KERNELKITE_DATA_DIR", data.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let mut up = false;
    for _ in 0..200 {
        if http.get(format!("{base}/healthz")).send().await.is_ok() {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(up, "the service did not start listening");
    fake.set_webhook(
        format!("{base}/webhooks/buildkite"),
        Signing::Hmac(WEBHOOK_TOKEN.into()),
    );

    let v: Value = http
        .post(format!("{base}/v1/submissions"))
        .bearer_auth("kk")
        .json(&json!({"config": sample_config(), "queue": "h100"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = v["id"].as_str().unwrap().to_string();
    let number = fake.next_created(WAIT).await.unwrap();
    assert_eq!(fake.build(number).unwrap()["branch"], "release");
    // The create response may still be on its way; webhooks that beat it are kept.
    fake.finish_build(number, "passed", result_artifact()).await;
    let v: Value = http
        .get(format!("{base}/v1/submissions/{id}?wait=10"))
        .bearer_auth("kk")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["state"], "succeeded", "{v}");
    assert!(data.path().join("submissions").is_dir());

    let pid = child.id().unwrap() as libc::pid_t;
    // SAFETY: plain kill(2) on the child this test spawned and still owns.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let status = tokio::time::timeout(WAIT, child.wait())
        .await
        .expect("exits after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
    let mut err = String::new();
    tokio::io::AsyncReadExt::read_to_string(child.stderr.as_mut().unwrap(), &mut err)
        .await
        .unwrap();
    for secret in [FAKE_API_TOKEN, WEBHOOK_TOKEN] {
        assert!(!err.contains(secret), "stderr shows a token: {err}");
    }
    assert!(
        err.contains("listening") && err.contains("shutting down"),
        "{err}"
    );
}
