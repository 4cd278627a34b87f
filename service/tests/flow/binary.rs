//! The `kernelkite-service` binary itself: configured by its environment, serving a
//! submission end to end, stopping cleanly on SIGTERM without printing a token.

use std::time::Duration;

use kernelkite_testkit::fake_buildkite::{
    FakeBuildkite, Signing, FAKE_API_TOKEN, FAKE_ORG, FAKE_PIPELINE,
};
use kernelkite_testkit::harness::{result_artifact, WAIT, WEBHOOK_TOKEN};
use kernelkite_testkit::sample_config;
use serde_json::{json, Value};

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
        .env("KERNELKITE_CACHE", "false")
        .env("KERNELKITE_QUEUE_SLOTS", "*=none")
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
    assert!(data.path().join("kernelkite.db").is_file());

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
