//! `fake-buildkite`: the test fake of Buildkite (`kernelkite_testkit::fake_buildkite`) as a
//! process, for tests that run the service as a real process too (the Python client's).
//!
//! It prints one JSON line on stdout once both ports listen:
//! `{"api_url": "http://127.0.0.1:P/v2", "agent_api_url": ".../v3", "control_url":
//! "http://127.0.0.1:C", "org", "pipeline", "api_token", "agent_token"}`, then serves until it
//! is killed (or, with `--exit-on-stdin-eof`, until its stdin closes, so a test runner that
//! dies takes it along).
//!
//! The control API (JSON in and out) drives what Buildkite and its agents would do:
//!
//! | request | effect |
//! |---|---|
//! | `POST /webhook-target {"url", "token"}` | where webhooks go, signed with `token` (HMAC, `X-Buildkite-Signature`) |
//! | `POST /webhook-mode {"mode": "deliver"\|"drop"\|"delay", "delay_ms"}` | how the webhooks of `start`/`finish`/autoplay go out: at once, never (the build still changes), or late |
//! | `GET /builds` | every build: `number`, `id`, `state`, `web_url`, `env`, `meta_data`, `message` |
//! | `GET /builds/wait?count=N&timeout_ms=T` | waits until N builds exist: `200` with them, or `408` |
//! | `POST /builds/{n}/start` | the build runs (`build.running`) |
//! | `POST /builds/{n}/finish {"state", "result", "artifact_state", "provenance"}` | the build ends in `state` (`passed`, `failed`, `canceled`), uploading `result` (text of result.json; null: no artifact) and `provenance` (text of provenance.json; null: none) first (`build.finished`) |
//! | `POST /faults {"route", "status"\|"rate_limited_s"\|"delay_ms"}` | the next request on `route` (`create_build`, `get_build`, `cancel_build`, `list_artifacts`, `download`, `blob`, `list_agents`, `agent_metrics`) fails with `status`, answers `429` with `RateLimit-Reset`, or is delayed |
//! | `POST /agents [{"name", "queue", "busy", "connection_state"}]` | the organization's agents |
//! | `GET /requests` | every API request so far: `route`, `method`, `path`, `query`, `build`, `status` |
//! | `POST /autoplay {"start_after_ms", "finish_after_ms", "state", "result"}` (or `null`) | every build created from now on plays itself: runs, then finishes like `finish` |

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kernelkite_testkit::fake_buildkite::{
    ArtifactSpec, FakeAgent, FakeBuildkite, Fault, Route, Signing, FAKE_AGENT_TOKEN,
    FAKE_API_TOKEN, FAKE_ORG, FAKE_PIPELINE,
};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::io::AsyncReadExt as _;

#[derive(Debug, Clone, Default)]
enum WebhookMode {
    #[default]
    Deliver,
    Drop,
    Delay(Duration),
}

#[derive(Debug, Clone, Deserialize)]
struct Finish {
    state: String,
    #[serde(default)]
    result: Option<String>,
    #[serde(default)]
    artifact_state: Option<String>,
    /// Text of the `provenance.json` the job uploads beside the result (none: no such file).
    #[serde(default)]
    provenance: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
struct Autoplay {
    #[serde(default)]
    start_after_ms: u64,
    #[serde(default)]
    finish_after_ms: u64,
    #[serde(flatten)]
    finish: Finish,
}

struct Control {
    fake: FakeBuildkite,
    mode: Mutex<WebhookMode>,
    autoplay: Mutex<Option<Autoplay>>,
    created: tokio::sync::watch::Sender<u64>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn bad(msg: impl std::fmt::Display) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({"error": msg.to_string()})),
    )
        .into_response()
}

impl Control {
    /// Moves build `n` to `state` (with `artifact`), sending `event` per the webhook mode.
    async fn transition(
        self: &Arc<Self>,
        n: u64,
        state: &str,
        artifact: Option<ArtifactSpec>,
        event: &str,
    ) -> Option<u16> {
        let mode = lock(&self.mode).clone();
        match mode {
            WebhookMode::Deliver if event == "build.running" => self.fake.start_build(n).await,
            WebhookMode::Deliver => self.fake.finish_build(n, state, artifact).await,
            WebhookMode::Drop => {
                self.fake.complete_build(n, state, artifact);
                None
            }
            WebhookMode::Delay(d) => {
                self.fake.complete_build(n, state, artifact);
                let this = self.clone();
                let event = event.to_string();
                tokio::spawn(async move {
                    tokio::time::sleep(d).await;
                    this.fake.send_event(&event, n).await;
                });
                None
            }
        }
    }

    async fn finish(self: &Arc<Self>, n: u64, f: Finish) -> Option<u16> {
        if let Some(text) = f.provenance {
            let spec = ArtifactSpec {
                path: kernelkite_sys::provenance::FILE.into(),
                ..ArtifactSpec::result_json(text)
            };
            self.fake.complete_build(n, "running", Some(spec));
        }
        let artifact = f.result.map(|text| ArtifactSpec {
            state: f.artifact_state.unwrap_or_else(|| "finished".into()),
            ..ArtifactSpec::result_json(text)
        });
        self.transition(n, &f.state, artifact, "build.finished")
            .await
    }

    fn builds(&self) -> Vec<Value> {
        (1..=self.fake.build_count())
            .filter_map(|n| self.fake.build(n))
            .map(|b| {
                json!({
                    "number": b["number"], "id": b["id"], "state": b["state"], "web_url": b["web_url"],
                    "env": b["env"], "meta_data": b["meta_data"], "message": b["message"],
                })
            })
            .collect()
    }
}

/// The control API's names of the fake's routes, one table both ways.
const ROUTES: &[(&str, Route)] = &[
    ("create_build", Route::CreateBuild),
    ("get_build", Route::GetBuild),
    ("list_builds", Route::ListBuilds),
    ("cancel_build", Route::CancelBuild),
    ("list_artifacts", Route::ListArtifacts),
    ("download", Route::Download),
    ("blob", Route::Blob),
    ("list_agents", Route::ListAgents),
    ("agent_metrics", Route::AgentMetrics),
];

fn route_named(name: &str) -> Option<Route> {
    ROUTES.iter().find(|(n, _)| *n == name).map(|(_, r)| *r)
}

fn route_name(r: Route) -> &'static str {
    ROUTES
        .iter()
        .find(|(_, x)| *x == r)
        .map_or("other", |(n, _)| n)
}

async fn webhook_target(State(c): State<Arc<Control>>, Json(v): Json<Value>) -> Response {
    let (Some(url), Some(token)) = (v["url"].as_str(), v["token"].as_str()) else {
        return bad("need {\"url\", \"token\"}");
    };
    c.fake.set_webhook(url, Signing::Hmac(token.into()));
    Json(json!({})).into_response()
}

async fn webhook_mode(State(c): State<Arc<Control>>, Json(v): Json<Value>) -> Response {
    let mode = match v["mode"].as_str() {
        Some("deliver") => WebhookMode::Deliver,
        Some("drop") => WebhookMode::Drop,
        Some("delay") => WebhookMode::Delay(Duration::from_millis(
            v["delay_ms"].as_u64().unwrap_or(1000),
        )),
        _ => return bad("mode must be deliver, drop or delay"),
    };
    *lock(&c.mode) = mode;
    Json(json!({})).into_response()
}

async fn builds(State(c): State<Arc<Control>>) -> Response {
    Json(c.builds()).into_response()
}

async fn wait_builds(
    State(c): State<Arc<Control>>,
    Query(q): Query<HashMap<String, u64>>,
) -> Response {
    let want = q.get("count").copied().unwrap_or(1);
    let within = Duration::from_millis(q.get("timeout_ms").copied().unwrap_or(10_000));
    let mut rx = c.created.subscribe();
    let reached = tokio::time::timeout(within, rx.wait_for(|n| *n >= want))
        .await
        .is_ok_and(|r| r.is_ok());
    if reached {
        return Json(c.builds()).into_response();
    }
    let error = format!("fewer than {want} builds within {within:?}");
    (
        StatusCode::REQUEST_TIMEOUT,
        Json(json!({"error": error, "builds": c.builds()})),
    )
        .into_response()
}

async fn start(State(c): State<Arc<Control>>, Path(n): Path<u64>) -> Response {
    if c.fake.build(n).is_none() {
        return (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "no such build"})),
        )
            .into_response();
    }
    let status = c.transition(n, "running", None, "build.running").await;
    Json(json!({"webhook_status": status})).into_response()
}

async fn finish(
    State(c): State<Arc<Control>>,
    Path(n): Path<u64>,
    Json(f): Json<Finish>,
) -> Response {
    if c.fake.build(n).is_none() {
        return (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "no such build"})),
        )
            .into_response();
    }
    let status = c.finish(n, f).await;
    Json(json!({"webhook_status": status})).into_response()
}

async fn faults(State(c): State<Arc<Control>>, Json(v): Json<Value>) -> Response {
    let Some(route) = v["route"].as_str().and_then(route_named) else {
        return bad("unknown route");
    };
    let fault = if let Some(s) = v["status"].as_u64() {
        Fault::Status(s as u16)
    } else if let Some(r) = v["rate_limited_s"].as_u64() {
        Fault::RateLimited { reset_s: r }
    } else if let Some(d) = v["delay_ms"].as_u64() {
        Fault::Delay(Duration::from_millis(d))
    } else {
        return bad("need status, rate_limited_s or delay_ms");
    };
    c.fake.inject(route, fault);
    Json(json!({})).into_response()
}

#[derive(Deserialize)]
struct AgentSpec {
    name: String,
    #[serde(default)]
    queue: Option<String>,
    #[serde(default)]
    busy: bool,
    #[serde(default)]
    connection_state: Option<String>,
}

async fn agents(State(c): State<Arc<Control>>, Json(list): Json<Vec<AgentSpec>>) -> Response {
    let agents = list
        .into_iter()
        .map(|a| FakeAgent {
            name: a.name,
            queue: a.queue,
            tags: Vec::new(),
            busy: a.busy,
            connection_state: a.connection_state.unwrap_or_else(|| "connected".into()),
            paused: None,
        })
        .collect();
    c.fake.set_agents(agents);
    Json(json!({})).into_response()
}

async fn requests(State(c): State<Arc<Control>>) -> Response {
    let list: Vec<Value> = c
        .fake
        .requests()
        .into_iter()
        .map(|r| {
            json!({
                "route": route_name(r.route), "method": r.method, "path": r.path,
                "query": r.query, "build": r.build, "status": r.status,
            })
        })
        .collect();
    Json(list).into_response()
}

async fn autoplay(State(c): State<Arc<Control>>, Json(v): Json<Option<Autoplay>>) -> Response {
    *lock(&c.autoplay) = v;
    Json(json!({})).into_response()
}

/// Counts created builds for `/builds/wait` and plays them when autoplay is on.
async fn watch_created(c: Arc<Control>) {
    loop {
        let Some(n) = c.fake.next_created(Duration::from_secs(3600)).await else {
            continue;
        };
        c.created.send_modify(|count| *count = (*count).max(n));
        let Some(plan) = lock(&c.autoplay).clone() else {
            continue;
        };
        let c = c.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(plan.start_after_ms)).await;
            c.transition(n, "running", None, "build.running").await;
            tokio::time::sleep(Duration::from_millis(plan.finish_after_ms)).await;
            // Canceled meanwhile (the service gave up on it): nothing more to play.
            if c.fake.build_state(n).as_deref() == Some("running") {
                c.finish(n, plan.finish).await;
            }
        });
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut exit_on_eof = false;
    let mut webhook: (Option<String>, Option<String>) = (None, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--exit-on-stdin-eof" => exit_on_eof = true,
            "--webhook-url" => webhook.0 = it.next().cloned(),
            "--webhook-token" => webhook.1 = it.next().cloned(),
            "-h" | "--help" => {
                println!("fake-buildkite [--exit-on-stdin-eof] [--webhook-url URL --webhook-token TOKEN]\n\nA fake of Buildkite's REST API, webhooks and agent metrics on loopback, with a control API for tests (see the source's header).");
                return std::process::ExitCode::SUCCESS;
            }
            other => {
                eprintln!("fake-buildkite: unknown argument {other:?}; see --help");
                return std::process::ExitCode::from(2);
            }
        }
    }
    let fake = FakeBuildkite::start().await;
    if let (Some(url), Some(token)) = webhook {
        fake.set_webhook(url, Signing::Hmac(token));
    }
    let listener = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("fake-buildkite: cannot listen on loopback: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let control_url = match listener.local_addr() {
        Ok(a) => format!("http://{a}"),
        Err(e) => {
            eprintln!("fake-buildkite: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let info = json!({
        "api_url": fake.api_url(), "agent_api_url": fake.agent_api_url(), "control_url": control_url,
        "org": FAKE_ORG, "pipeline": FAKE_PIPELINE, "api_token": FAKE_API_TOKEN, "agent_token": FAKE_AGENT_TOKEN,
    });
    let control = Arc::new(Control {
        fake,
        mode: Mutex::new(WebhookMode::Deliver),
        autoplay: Mutex::new(None),
        created: tokio::sync::watch::channel(0).0,
    });
    tokio::spawn(watch_created(control.clone()));
    let router = Router::new()
        .route("/webhook-target", post(webhook_target))
        .route("/webhook-mode", post(webhook_mode))
        .route("/builds", get(builds))
        .route("/builds/wait", get(wait_builds))
        .route("/builds/{n}/start", post(start))
        .route("/builds/{n}/finish", post(finish))
        .route("/faults", post(faults))
        .route("/agents", post(agents))
        .route("/requests", get(requests))
        .route("/autoplay", post(autoplay))
        .with_state(control);
    println!("{info}");
    let serve = axum::serve(listener, router);
    if exit_on_eof {
        let eof = async {
            let mut stdin = tokio::io::stdin();
            let mut buf = [0u8; 256];
            while matches!(stdin.read(&mut buf).await, Ok(n) if n > 0) {}
        };
        tokio::select! {
            r = serve => if let Err(e) = r { eprintln!("fake-buildkite: {e}"); },
            _ = eof => {}
        }
    } else if let Err(e) = serve.await {
        eprintln!("fake-buildkite: {e}");
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
}
