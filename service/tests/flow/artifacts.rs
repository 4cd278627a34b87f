//! A finished build's `result.json`: missing, unfinished or corrupt artifacts fail the
//! submission with the build's state and URL; a failed build's valid result is the answer.

use kernelkite_testkit::fake_buildkite::{ArtifactSpec, Route};
use kernelkite_testkit::harness::{harness, result_artifact};
use kernelkite_testkit::sample_result_json;

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

/// Issue 21, item 6: the artifact download's redirect is followed only to the blob store the
/// service may fetch from. A redirect to another loopback service (an internal address) or to
/// a `file://` URL fails the submission at once, says why, never contacts the target and
/// copies nothing of it into the submission.
#[tokio::test]
async fn artifact_redirects_to_internal_or_non_http_targets_are_refused() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    // An internal service that would answer with something worth stealing.
    let hits = Arc::new(AtomicUsize::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let internal = format!(
        "http://{}/latest/meta-data/iam",
        listener.local_addr().unwrap()
    );
    let counted = hits.clone();
    tokio::spawn(async move {
        let app = axum::Router::new().fallback(move || {
            counted.fetch_add(1, Ordering::SeqCst);
            async { "INTERNAL-SECRET-CREDENTIALS" }
        });
        let _ = axum::serve(listener, app).await;
    });
    let h = harness().await;
    for target in [internal.clone(), "file:///etc/passwd".to_string()] {
        h.fake.redirect_downloads_to(Some(target.clone()));
        let (id, number) = h.submit().await;
        h.wait_build_attached(&id).await;
        let started = std::time::Instant::now();
        h.fake
            .finish_build(number, "passed", result_artifact())
            .await;
        let v = h.wait_terminal(&id).await;
        assert_eq!(v["state"], "failed", "{target}: {v}");
        let error = v["error"].as_str().unwrap();
        assert!(error.contains("refused"), "{target}: {error}");
        assert!(!error.contains("INTERNAL-SECRET"), "{error}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "{target}: not refused at once"
        );
    }
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "the internal target was contacted"
    );
    // The fake's own blob store (the API's origin) is fetched as before.
    h.fake.redirect_downloads_to(None);
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    assert_eq!(h.pass(&id, number).await, "succeeded");
}

/// The node's `provenance.json` (uploaded beside the result by the same job) is kept with the
/// submission and shown as it was written; one that is corrupt in transit or not in its format
/// is left out, and the result is the answer all the same.
#[tokio::test]
async fn the_provenance_beside_the_result_is_shown_and_a_bad_one_costs_nothing() {
    let provenance = serde_json::json!({
        "format": 1,
        "kernelkite_version": "9.9.9",
        "node": "gpu-node-1",
        "agent": "gpu-node-1-gpu3",
        "queue": "h100",
        "slice": {"index": 3, "cpus": [12, 13], "memory_bytes": 1024},
        "driver": "550.54.15",
        "gpus": [{"vendor": "nvidia", "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-3",
                  "start": {"sm_clock_mhz": 1980, "temperature_c": 41},
                  "end": {"sm_clock_mhz": 1980, "temperature_c": 66}}],
        "started_ms": 1, "ended_ms": 2
    });
    let spec = |bytes: Vec<u8>| ArtifactSpec {
        path: "provenance.json".into(),
        ..ArtifactSpec::result_json(bytes)
    };
    let h = harness().await;
    let good = serde_json::to_vec(&provenance).unwrap();
    let corrupt = ArtifactSpec {
        sha1sum: Some("0".repeat(40)),
        ..spec(good.clone())
    };
    let cases = [
        (Some(spec(good)), true),
        (Some(corrupt), false),
        (Some(spec(b"[1, 2]".to_vec())), false),
        (
            Some(spec(b"{\"format\": 1, \"gpus\": \"many\"}".to_vec())),
            false,
        ),
        (None, false),
    ];
    for (artifact, kept) in cases {
        let (id, number) = h.submit().await;
        h.wait_build_attached(&id).await;
        if let Some(a) = artifact {
            h.fake.complete_build(number, "running", Some(a));
        }
        h.fake
            .finish_build(number, "passed", result_artifact())
            .await;
        let v = h.wait_terminal(&id).await;
        assert_eq!(v["state"], "succeeded", "{v}");
        assert_eq!(v["result"]["system"]["hostname"], "gpu-node-1");
        if kept {
            let p = &v["provenance"];
            assert_eq!(p["agent"], "gpu-node-1-gpu3", "{v}");
            assert_eq!(p["slice"]["index"], 3);
            assert_eq!(p["gpus"][0]["uuid"], "GPU-3");
            assert_eq!(p["gpus"][0]["end"]["temperature_c"], 66);
            assert_eq!(p["driver"], "550.54.15");
        } else {
            assert!(v["provenance"].is_null(), "{v}");
        }
    }
}
