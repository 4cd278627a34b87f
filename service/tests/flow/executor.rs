//! The core is not tied to Buildkite: driven through the [`Executor`] interface by an
//! executor written here (builds "run" in this process), a submission is launched, moved by
//! the executor's events, collected and canceled exactly as with Buildkite, over the same HTTP
//! API, store and waiters.

use std::sync::{Arc, Mutex};

use futures_util::future::BoxFuture;
use kernelkite_service::executor::{
    BuildEvent, BuildEventKind, BuildStatus, Collected, Executor, Job, Launched,
};
use kernelkite_service::report::BoxError;
use kernelkite_service::result::ResultJson;
use kernelkite_service::submission::{BuildInfo, Outcome};
use kernelkite_service::Config;
use kernelkite_testkit::harness::WAIT;
use kernelkite_testkit::{sample_config, sample_result_json};
use serde_json::{json, Value};

/// Launches builds numbered from 1, records what it was asked to do, and collects the sample
/// result.
#[derive(Default)]
struct InProcess {
    jobs: Mutex<Vec<Job>>,
    canceled: Mutex<Vec<BuildInfo>>,
}

impl Executor for InProcess {
    fn name(&self) -> &'static str {
        "in-process"
    }

    fn launch<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Result<Launched, BoxError>> {
        Box::pin(async move {
            let mut jobs = self.jobs.lock().unwrap();
            jobs.push(job.clone());
            let number = jobs.len() as u64;
            Ok(Launched {
                build: BuildInfo {
                    id: format!("local-{number}"),
                    number,
                    web_url: format!("file:///builds/{number}"),
                },
                running: true,
            })
        })
    }

    fn cancel<'a>(&'a self, build: &'a BuildInfo) -> BoxFuture<'a, Result<bool, BoxError>> {
        Box::pin(async move {
            self.canceled.lock().unwrap().push(build.clone());
            Ok(true)
        })
    }

    fn collect<'a>(&'a self, build: &'a BuildStatus) -> BoxFuture<'a, Result<Collected, BoxError>> {
        Box::pin(async move {
            Ok(Outcome::into(
                match ResultJson::parse(sample_result_json().as_bytes()) {
                    Ok(r) if build.state == "passed" => Outcome::Succeeded(r),
                    _ => Outcome::Failed(format!("build {} ended {}", build.number, build.state)),
                },
            ))
        })
    }
}

fn finished(number: u64) -> BuildEvent {
    BuildEvent {
        kind: BuildEventKind::Finished,
        build: BuildStatus {
            id: format!("local-{number}"),
            number,
            state: "passed".into(),
            web_url: String::new(),
            blocked: false,
        },
    }
}

#[tokio::test]
async fn another_executor_drives_the_same_state_machine() {
    let executor = Arc::new(InProcess::default());
    // The configuration requires Buildkite settings; this executor never uses them.
    let mut cfg = Config::new("http://127.0.0.1:9/v2", "org", "pipe", "unused");
    // The same config is submitted again to run again.
    cfg.fair.cache = false;
    let app = kernelkite_service::cli::serve::start(&cfg, executor.clone()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(kernelkite_service::serve(
        app.clone(),
        &cfg,
        listener,
        std::future::pending(),
    ));
    let http = reqwest::Client::new();
    let submit = || async {
        let v: Value = http
            .post(format!("{base}/v1/submissions"))
            .json(&json!({"config": sample_config(), "queue": "local", "run_id": "r-1"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let id = v["id"].as_str().unwrap().to_string();
        let mut rx = app.store().subscribe(&id).unwrap();
        tokio::time::timeout(WAIT, rx.wait_for(|s| s.build.is_some()))
            .await
            .unwrap()
            .unwrap();
        id
    };

    let id = submit().await;
    {
        let jobs = executor.jobs.lock().unwrap();
        assert_eq!(
            (jobs[0].submission_id.as_str(), jobs[0].run_id.as_str()),
            (id.as_str(), "r-1")
        );
        assert_eq!(
            (jobs[0].queue.as_str(), jobs[0].mode.as_str()),
            ("local", "test")
        );
        let config = kernelkite_kernelbot::payload::decode(&jobs[0].payload).unwrap();
        assert_eq!(config, sample_config());
    }
    assert_eq!(app.store().get(&id).unwrap().state.as_str(), "running");
    kernelkite_service::events::for_executor(&app)
        .deliver(finished(1))
        .await;
    let v: Value = http
        .get(format!("{base}/v1/submissions/{id}?wait=10"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["state"], "succeeded", "{v}");
    assert_eq!(v["build"]["id"], "local-1");
    assert_eq!(v["result"]["system"]["hostname"], "gpu-node-1");

    let id = submit().await;
    let r = http
        .post(format!("{base}/v1/submissions/{id}/cancel"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    for _ in 0..500 {
        if !executor.canceled.lock().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let canceled = executor.canceled.lock().unwrap().clone();
    assert_eq!(canceled.len(), 1);
    assert_eq!(canceled[0].id, "local-2");
    server.abort();
}
