//! End to end, across crates: the service creates a build on the fake Buildkite, an "agent"
//! evaluates the payload it finds in that build's env with the runner's library (the same
//! calls `kernelkite-runner` makes), uploads `result.json`, and Buildkite's signed webhook
//! wakes the client that long-polls the service. This proves the service's payload and the
//! runner's decoder agree (single and chunked carriers), and that a real `result.json`
//! passes the service's checks unchanged.

use std::collections::HashMap;

use kernelkite_kernelbot::config::{Mode, RunConfig};
use kernelkite_kernelbot::payload;
use kernelkite_runner::{cli, eval, example};
use kernelkite_testkit::fake_buildkite::ArtifactSpec;
use kernelkite_testkit::harness::{self, Harness, WAIT};
use serde_json::{json, Value};

/// What the GPU agent does with a build: read the payload from the build's env exactly as
/// the runner's CLI does, evaluate, and write `result.json` bytes.
fn agent_runs_build(env: &HashMap<String, String>) -> Vec<u8> {
    let text = payload::from_env(|k| env.get(k).cloned()).expect("payload carrier");
    let cfg = RunConfig::from_json(payload::decode(&text).expect("payload decodes"))
        .expect("config valid");
    let work = tempfile::tempdir().expect("workdir");
    let result = eval::run_config(&cfg, &eval::Options::new(work.path()));
    let out = work.path().join("result.json");
    cli::write_result(&out, &result).expect("write result.json");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&out).expect("stat").permissions(),
    );
    assert_eq!(
        mode & 0o777,
        0o644,
        "result.json must be readable by the uploader"
    );
    std::fs::read(out).expect("read result.json")
}

fn python3_available() -> bool {
    std::process::Command::new("python3")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

async fn submit_and_complete(stack: &Harness, config: Value) -> (Value, HashMap<String, String>) {
    let r = stack
        .http
        .post(format!("{}/v1/submissions", stack.base))
        .json(&json!({"config": config, "queue": "h100", "run_id": "e2e-1"}))
        .send()
        .await
        .expect("POST");
    assert_eq!(r.status().as_u16(), 202);
    let id = r.json::<Value>().await.expect("json")["id"]
        .as_str()
        .expect("id")
        .to_string();

    let number = stack.fake.next_created(WAIT).await.expect("build created");
    let build = stack.fake.build(number).expect("build");
    let env: HashMap<String, String> = build["env"]
        .as_object()
        .expect("env object")
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
        .collect();
    assert_eq!(
        env.get("KERNELBOT_RUN_ID").map(String::as_str),
        Some("e2e-1")
    );
    assert_eq!(env.get("KERNELBOT_QUEUE").map(String::as_str), Some("h100"));
    assert!(
        env.iter().all(|(k, v)| k.len() + v.len() + 2 <= 128 * 1024),
        "an env string exceeds MAX_ARG_STRLEN"
    );

    stack.fake.start_build(number).await;
    let bytes = tokio::task::spawn_blocking(move || {
        let env = env;
        let bytes = agent_runs_build(&env);
        (bytes, env)
    })
    .await
    .expect("agent");
    let (result_bytes, env) = bytes;
    stack
        .fake
        .finish_build(
            number,
            "passed",
            Some(ArtifactSpec::result_json(result_bytes.clone())),
        )
        .await;

    let done: Value = stack
        .http
        .get(format!("{}/v1/submissions/{id}?wait=30", stack.base))
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("json");
    let uploaded: Value = serde_json::from_slice(&result_bytes).expect("result.json");
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(
        done["result"], uploaded,
        "service must return result.json unchanged"
    );
    (done, env)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submission_runs_through_service_buildkite_and_runner() {
    if !python3_available() {
        eprintln!("skipping: python3 is not installed; the example task needs it");
        return;
    }
    let stack = harness::harness().await;
    let (done, env) = submit_and_complete(&stack, example::config(Mode::Leaderboard)).await;
    assert!(
        env.contains_key("KERNELBOT_PAYLOAD"),
        "small payload uses one variable"
    );
    let runs = done["result"]["runs"].as_object().expect("runs");
    assert_eq!(
        runs.keys().collect::<Vec<_>>(),
        ["test", "benchmark", "leaderboard"]
    );
    for (name, run) in runs {
        assert_eq!(run["run"]["passed"], true, "{name}: {run}");
    }
    assert_eq!(done["result"]["success"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_payload_travels_in_chunks_and_evaluates() {
    if !python3_available() {
        eprintln!("skipping: python3 is not installed; the example task needs it");
        return;
    }
    // Incompressible-ish padding (hex of an LCG) so the encoded payload is well over 128 KiB.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let pad: String = (0..300_000)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            char::from(b"0123456789abcdef"[(x >> 60) as usize])
        })
        .collect();
    let mut config = example::config(Mode::Test);
    config["sources"]["padding.txt"] = json!(pad);
    let stack = harness::harness().await;
    let (done, env) = submit_and_complete(&stack, config).await;
    let chunks: usize = env
        .get("KERNELBOT_PAYLOAD_CHUNKS")
        .expect("chunked carrier used")
        .parse()
        .expect("count");
    assert!(chunks >= 2, "{chunks} chunks");
    assert!(!env.contains_key("KERNELBOT_PAYLOAD"));
    assert_eq!(done["result"]["runs"]["test"]["run"]["passed"], true);
}
