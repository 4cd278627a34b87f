//! The runner's `result.json` reaches every consumer exactly as the runner wrote it: fields
//! this service does not know (a newer kernelbot's) at any depth, naive timestamps, number
//! spellings and spacing all survive GET, SSE, the callback and the store.

use kernelkite_testkit::callback_receiver::CallbackReceiver;
use kernelkite_testkit::fake_buildkite::ArtifactSpec;
use kernelkite_testkit::harness::{harness, WAIT};
use kernelkite_testkit::sample_config;
use serde::Deserialize;
use serde_json::json;
use serde_json::value::RawValue;

/// A result a newer runner might write: unknown fields at the top, in `system`, in a run and
/// in the run's record; naive timestamps (Python's `isoformat()` without a zone); `1.50` and a
/// huge integer that a re-encode would rewrite; a line break between fields.
const ARTIFACT: &str = r#"{"success": true, "error": "", "kernelbot_next": {"nested": [1.50, {"deep": null}]},
 "system": {"gpu": "NVIDIA H100 80GB HBM3", "device_count": 1, "cpu": "AMD EPYC 9654", "runtime": "CUDA", "platform": "Linux", "torch": "2.6.0", "hostname": "gpu-node-1", "gpu_uuid": "GPU-1"},
 "runs": {"test": {"start": "2026-11-22T10:40:00.123456", "end": "2026-11-22T10:40:03", "compilation": null,
   "run": {"success": true, "passed": true, "command": "python3 eval.py test cases", "stdout": "", "stderr": "", "exit_code": 0, "duration": 3.50,
           "result": {"check": "pass"}, "energy_j": 123456789012345678901234567890}, "profile": null, "attempt": 1}}}"#;

#[derive(Deserialize)]
struct WithResult<'a> {
    #[serde(borrow)]
    result: &'a RawValue,
}

#[derive(Deserialize)]
struct TerminalEvent<'a> {
    #[serde(borrow)]
    submission: WithResult<'a>,
}

/// The `result` member of a submission document, as the text the service sent.
fn raw_result(doc: &str) -> String {
    let d: WithResult = serde_json::from_str(doc).unwrap_or_else(|e| panic!("{e}: {doc}"));
    d.result.get().to_string()
}

#[tokio::test]
async fn the_result_comes_back_byte_for_byte_through_get_sse_callback_and_store() {
    // The callback receiver keeps the raw body.
    let cb = CallbackReceiver::start().await;
    let h = harness().await;
    let (id, number) = h
        .submit_body(json!({"config": sample_config(), "queue": "h100", "callback_url": cb.url()}))
        .await;
    h.wait_build_attached(&id).await;
    let mut events = h
        .http
        .get(format!("{}/v1/submissions/{id}/events", h.base))
        .send()
        .await
        .unwrap();
    h.fake
        .finish_build(number, "passed", Some(ArtifactSpec::result_json(ARTIFACT)))
        .await;

    // GET (long-poll until terminal).
    let get = h
        .http
        .get(format!("{}/v1/submissions/{id}?wait=10", h.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&get).unwrap();
    assert_eq!(v["state"], "succeeded", "{get}");
    assert_eq!(raw_result(&get), ARTIFACT);

    // SSE: the terminal event's data lines, joined as a client joins them.
    let mut text = String::new();
    tokio::time::timeout(WAIT, async {
        while let Some(chunk) = events.chunk().await.unwrap() {
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
    })
    .await
    .expect("the stream ends after the terminal event");
    let last_event = text
        .split("\n\n")
        .filter(|e| e.contains("event: succeeded"))
        .last()
        .unwrap_or_else(|| panic!("no terminal event in {text}"));
    let data: Vec<&str> = last_event
        .lines()
        .filter_map(|l| l.strip_prefix("data: ").or(l.strip_prefix("data:")))
        .collect();
    let data = data.join("\n");
    let ev: TerminalEvent = serde_json::from_str(&data).unwrap();
    assert_eq!(ev.submission.result.get(), ARTIFACT);

    // The callback.
    assert!(cb.wait_for(WAIT, |d| !d.is_empty()).await, "no callback");
    let body = String::from_utf8(cb.deliveries()[0].body.to_vec()).unwrap();
    assert_eq!(raw_result(&body), ARTIFACT);
    // And after a restart, GET serves the stored copy unchanged too.
    let restarted = kernelkite_service::cli::serve::start_buildkite(&h.cfg).unwrap();
    let after = restarted
        .lookup(&id)
        .await
        .unwrap()
        .expect("read from the store");
    assert_eq!(
        raw_result(&serde_json::to_string(&after).unwrap()),
        ARTIFACT
    );
}
