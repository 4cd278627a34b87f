//! Accepting a submission: the build it creates (payload, chunked carrier, ids), the
//! requests refused before any build exists, and the API description.

use kernelkite_testkit::fake_buildkite::Route;
use kernelkite_testkit::harness::{harness, harness_with, result_artifact};
use kernelkite_testkit::{sample_config, sample_result_json};
use serde_json::{json, Value};

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
    assert_eq!(calls[1].query.as_deref(), Some("per_page=100"));
    let blobs: Vec<_> = h.fake.requests_to(Route::Blob);
    assert_eq!(blobs.len(), 1);
    assert!(blobs[0].authorization.is_none() && blobs[0].status == 200);

    // The result was committed to the store before the long-poll heard of it: another
    // connection to the database file reads it back at once.
    let db = kernelkite_service::store::Sqlite::open(
        Some(h._dir.path()),
        kernelkite_service::store::SyncMode::Normal,
        None,
    )
    .unwrap();
    let on_disk = serde_json::to_value(db.load(&id).await.unwrap().unwrap()).unwrap();
    assert_eq!(on_disk, v);
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
    assert!(h.app.store().is_empty());
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
        "/v1/submissions/{id}/cancel",
        "/v1/submissions/{id}/events",
        "/webhooks/buildkite",
        "/healthz",
        "/readyz",
        "/metrics",
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
    for (path, status) in [("healthz", "ok"), ("readyz", "ready")] {
        let v: Value = h
            .http
            .get(format!("{}/{path}", h.base))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(v, json!({ "status": status }), "{path}");
    }
}

#[tokio::test]
async fn oversized_bodies_are_refused_with_a_json_error_naming_the_limit() {
    let h = harness_with(|c| {
        c.edge.max_submission_bytes = 1024;
        c.edge.webhook_max_bytes = 1024;
    })
    .await;
    let mut cfg = sample_config();
    cfg["sources"]["data.py"] = json!("x".repeat(4096));
    let (status, v) = h.post(json!({"config": cfg, "queue": "h100"})).await;
    assert_eq!(status, 413, "{v}");
    let err = v["error"].as_str().unwrap();
    assert!(err.contains("KERNELKITE_MAX_SUBMISSION_BYTES"), "{err}");
    assert!(h.fake.requests().is_empty() && h.app.store().is_empty());

    let r = h
        .http
        .post(format!("{}/webhooks/buildkite", h.base))
        .body(vec![b' '; 4096])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 413);
    let v: Value = r.json().await.unwrap();
    let err = v["error"].as_str().unwrap();
    assert!(err.contains("KERNELKITE_WEBHOOK_MAX_BYTES"), "{err}");
}
