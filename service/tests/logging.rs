//! Logs never carry a token or a payload. Its own test binary: the subscriber is installed
//! before anything logs, with no other test running in the process (a thread-local subscriber
//! races with other threads' callsite registration).

use common::*;
use kernelkite_testkit::harness as common;

use std::sync::Arc;

use kernelkite_service::config::Secret;
use kernelkite_testkit::fake_buildkite::{unix_now, ArtifactSpec, Fault, Route, FAKE_API_TOKEN};
use kernelkite_testkit::{sample_config, sample_result_json};
use serde_json::{json, Value};

/// A `MakeWriter` that appends every log line to a shared buffer.
#[derive(Clone, Default)]
struct LogBuffer(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for LogBuffer {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogBuffer {
    type Writer = LogBuffer;
    fn make_writer(&'a self) -> LogBuffer {
        self.clone()
    }
}

#[tokio::test]
async fn logs_never_contain_tokens_or_payloads() {
    // Installed globally before anything logs: every thread of this process writes here.
    let logs = LogBuffer::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(logs.clone())
        .with_ansi(false)
        .finish();
    tracing::subscriber::set_global_default(subscriber)
        .expect("the only subscriber in this process");

    let h = harness_with(|c| c.edge.api_token = Some(Secret::new("kk-api-SECRET"))).await;
    let authed = |r: reqwest::RequestBuilder| r.bearer_auth("kk-api-SECRET");
    h.fake
        .inject(Route::CreateBuild, Fault::RateLimited { reset_s: 0 });
    h.fake.inject(Route::ListArtifacts, Fault::Status(500));
    let v: Value = authed(h.http.post(format!("{}/v1/submissions", h.base)))
        .json(&json!({"config": sample_config(), "queue": "h100"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = v["id"].as_str().unwrap().to_string();
    let number = h.fake.next_created(WAIT).await.unwrap();
    h.wait_build_attached(&id).await;
    let payload = h.fake.build(number).unwrap()["env"]["KERNELBOT_PAYLOAD"]
        .as_str()
        .unwrap()
        .to_string();
    // A forged webhook (logged as refused), then a corrupt artifact (logged as failed).
    let (headers, body) = h
        .fake
        .signed_event("build.finished", number, "wrong", unix_now())
        .unwrap();
    assert_eq!(h.fake.post_webhook_raw(&headers, body).await, Some(401));
    let spec = ArtifactSpec {
        sha1sum: Some("0".repeat(40)),
        ..ArtifactSpec::result_json(sample_result_json())
    };
    h.fake.finish_build(number, "passed", Some(spec)).await;
    let v: Value = authed(
        h.http
            .get(format!("{}/v1/submissions/{id}?wait=10", h.base)),
    )
    .send()
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    assert_eq!(v["state"], "failed");
    drop(h);

    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(
        text.contains("webhook refused")
            && text.contains("rate limit")
            && text.contains("submission finished"),
        "{text}"
    );
    // Structured: what happened to a submission carries its id and build number, even
    // when logged deep in the Buildkite client (through the submission's span).
    let line = |needles: &[&str]| {
        text.lines()
            .find(|l| needles.iter().all(|n| l.contains(n)))
            .unwrap_or_else(|| panic!("no {needles:?} line in:\n{text}"))
            .to_string()
    };
    let rate = line(&["rate limit reached"]);
    assert!(rate.contains(&id), "{rate}");
    let finished = line(&["submission finished"]);
    assert!(
        finished.contains(&id) && finished.contains(&format!("build={number}")),
        "{finished}"
    );
    let retried = line(&["retrying Buildkite call", "artifacts"]);
    assert!(
        retried.contains(&id) && retried.contains(&format!("build={number}")),
        "{retried}"
    );
    for secret in [
        FAKE_API_TOKEN,
        WEBHOOK_TOKEN,
        "kk-api-SECRET",
        payload.as_str(),
        "def kernel(x)",
    ] {
        assert!(!text.contains(secret), "logs contain {secret:?}:\n{text}");
    }
}
