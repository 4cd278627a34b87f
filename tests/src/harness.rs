//! The service on loopback against the fake Buildkite, as the service's integration tests,
//! its benchmark and the end-to-end tests run it.

use std::sync::Arc;
use std::time::Duration;

use crate::fake_buildkite::{
    ArtifactSpec, FakeBuildkite, Signing, FAKE_API_TOKEN, FAKE_ORG, FAKE_PIPELINE,
};
use crate::{sample_config, sample_result_json};
use kernelkite_service::config::Secret;
use kernelkite_service::{App, Config};
use serde_json::{json, Value};

/// The webhook token the service and the fake share.
pub const WEBHOOK_TOKEN: &str = "whsec-test-token";
/// The key callbacks are signed with.
pub const CALLBACK_SECRET: &str = "cbsec-test-key";
/// How long a test waits for anything that should happen at once.
pub const WAIT: Duration = Duration::from_secs(10);

/// The service on a loopback port, its fake Buildkite (webhooks signed and pointed at the
/// service), its data dir, and a client.
pub struct Harness {
    /// The fake Buildkite.
    pub fake: FakeBuildkite,
    /// The service's core, for looking inside.
    pub app: Arc<App>,
    /// The settings it was started with (a restart in a test starts another with them).
    pub cfg: Config,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    /// A client for the service.
    pub http: reqwest::Client,
    /// KERNELKITE_DATA_DIR (removed on drop).
    pub _dir: tempfile::TempDir,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// A [`Harness`] whose configuration `tweak` adjusts (retries are fast, the data dir is a
/// temporary one) before the service starts.
pub async fn harness_with(tweak: impl FnOnce(&mut Config)) -> Harness {
    let fake = FakeBuildkite::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config::new(&fake.api_url(), FAKE_ORG, FAKE_PIPELINE, FAKE_API_TOKEN);
    // The tests submit the same fixture config again on purpose, to run it again.
    cfg.fair.cache = false;
    // The fake's agents list is empty unless a test fills it: builds are created at once, as
    // they were before the service held queues (`fair_queue` tests the queue).
    cfg.fair.queue_slots = kernelkite_service::dispatch::Slots::parse("*=none").expect("slots");
    cfg.buildkite.buildkite_webhook_token = Some(Secret::new(WEBHOOK_TOKEN));
    cfg.retry_base_ms = 5;
    cfg.buildkite.http_timeout_s = 5;
    cfg.store.data_dir = Some(dir.path().to_path_buf());
    // Never the real agent API, even when a test configures an agent token.
    cfg.queues.buildkite_agent_api_url = fake.agent_api_url();
    cfg.callbacks.callback_secret = Some(Secret::new(CALLBACK_SECRET));
    cfg.callbacks.callback_backoff_ms = 20;
    cfg.buildkite.create_lookup_delay_ms = 200;
    tweak(&mut cfg);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = kernelkite_service::cli::serve::start_buildkite(&cfg).unwrap();
    let serving = app.clone();
    let http_cfg = cfg.clone();
    let server = tokio::spawn(async move {
        let _ =
            kernelkite_service::serve(serving, &http_cfg, listener, std::future::pending()).await;
    });
    fake.set_webhook(
        format!("http://{addr}/webhooks/buildkite"),
        Signing::Hmac(WEBHOOK_TOKEN.into()),
    );
    Harness {
        fake,
        app,
        cfg,
        base: format!("http://{addr}"),
        http: reqwest::Client::new(),
        _dir: dir,
        server,
    }
}

/// A [`Harness`] with the test configuration.
pub async fn harness() -> Harness {
    harness_with(|_| {}).await
}

impl Harness {
    /// `GET /v1/fleet`, asked every 100 ms until `ok` holds for it; at most `within`, then a
    /// panic with the last answer and what `context` says (logs, say).
    pub async fn wait_fleet(
        &self,
        within: Duration,
        ok: impl Fn(&Value) -> bool,
        context: impl Fn() -> String,
    ) -> Value {
        let deadline = std::time::Instant::now() + within;
        loop {
            let f: Value = self
                .http
                .get(format!("{}/v1/fleet", self.base))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            if ok(&f) {
                return f;
            }
            assert!(std::time::Instant::now() < deadline, "{f:#}\n{}", context());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `POST /v1/submissions` with `body`: the status and the JSON answer.
    pub async fn post(&self, body: Value) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}/v1/submissions", self.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// Submits the sample config and waits for its build; returns (submission id, build number).
    pub async fn submit(&self) -> (String, u64) {
        self.submit_body(json!({"config": sample_config(), "queue": "h100", "run_id": "run-1"}))
            .await
    }

    /// Submits `body` (which must be accepted) and waits for its build; returns (submission
    /// id, build number).
    pub async fn submit_body(&self, body: Value) -> (String, u64) {
        let (status, v) = self.post(body).await;
        assert_eq!(status, 202, "{v}");
        let number = self.fake.next_created(WAIT).await.expect("build created");
        (v["id"].as_str().unwrap().to_string(), number)
    }

    /// `GET /v1/submissions/{id}{query}`: the status and the JSON answer.
    pub async fn get(&self, id: &str, query: &str) -> (u16, Value) {
        let r = self
            .http
            .get(format!("{}/v1/submissions/{id}{query}", self.base))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    /// Long-polls the submission until it ended (at most 10 s); its JSON.
    pub async fn wait_terminal(&self, id: &str) -> Value {
        let (status, v) = self.get(id, "?wait=10").await;
        assert_eq!(status, 200, "{v}");
        v
    }

    /// Waits until the submission's build is attached (the create call returned and the
    /// build id is committed).
    pub async fn wait_build_attached(&self, id: &str) {
        let Some(mut rx) = self.app.store().subscribe(id) else {
            // Already ended (and so attached, or never to be).
            return;
        };
        tokio::time::timeout(
            WAIT,
            rx.wait_for(|s| s.build.is_some() || s.state.is_terminal()),
        )
        .await
        .unwrap()
        .unwrap();
    }

    /// Finishes build `number` `passed` with the sample result and waits for submission `id`
    /// to end; its state.
    pub async fn pass(&self, id: &str, number: u64) -> String {
        self.wait_build_attached(id).await;
        self.fake
            .finish_build(number, "passed", result_artifact())
            .await;
        self.wait_terminal(id).await["state"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// The submission's state now.
    pub async fn state(&self, id: &str) -> String {
        self.get(id, "").await.1["state"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }
}

/// The sample `result.json` as the artifact a finished build uploads.
pub fn result_artifact() -> Option<ArtifactSpec> {
    Some(ArtifactSpec::result_json(sample_result_json()))
}

/// A well-formed submission id that no submission has.
pub fn uuid_like() -> &'static str {
    "11111111-2222-4333-8444-555555555555"
}
