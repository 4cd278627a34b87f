//! The fake's agents: the REST agents list and the agent API's metrics endpoint.
//!
//! As Buildkite does: `GET /v2/organizations/{org}/agents` lists only *connected* agents, in
//! pages (`page`, 1-based; `per_page`, default 30, at most 100) with a `Link` header naming the
//! `next`/`last` (and `first`/`prev`) pages; an agent's tags are `meta_data` strings
//! `key=value`, its queue the `queue=<q>` tag (none: the `default` queue); a busy agent has
//! its current `job` object, an idle one `"job": null`. `GET /v3/metrics` (agent API, header
//! `Authorization: Token <agent token>`) counts idle, busy and total agents per queue, and
//! scheduled and running jobs.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::{gate, lock, with_rate_headers, Inner, Route};

/// The only agent token the fake's metrics endpoint accepts.
pub const FAKE_AGENT_TOKEN: &str = "bkat_fake_agent_token";

/// An agent of the fake organization.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeAgent {
    /// Its name.
    pub name: String,
    /// Its `queue=` tag (`None`: untagged, which Buildkite treats as the `default` queue).
    pub queue: Option<String>,
    /// Other tags, `key=value`.
    pub tags: Vec<String>,
    /// Running a job.
    pub busy: bool,
    /// `connected`, `disconnected`, `stopping`, `stopped`, `lost`, `never_connected`.
    pub connection_state: String,
    /// Paused, with this note (Buildkite dispatches it no job).
    pub paused: Option<String>,
}

impl FakeAgent {
    /// A connected agent in `queue`, idle or busy.
    pub fn new(name: &str, queue: &str, busy: bool) -> FakeAgent {
        FakeAgent {
            name: name.into(),
            queue: Some(queue.into()),
            tags: Vec::new(),
            busy,
            connection_state: "connected".into(),
            paused: None,
        }
    }

    fn queue_name(&self) -> &str {
        self.queue.as_deref().unwrap_or("default")
    }
}

/// Stable ids, so the same agent looks the same across pages and calls.
fn agent_id(index: usize) -> String {
    format!("0190aaaa-0000-4000-8000-{index:012}")
}

fn rest_agent(inner: &Inner, index: usize, a: &FakeAgent) -> Value {
    let id = agent_id(index);
    let mut meta_data: Vec<String> = a.queue.iter().map(|q| format!("queue={q}")).collect();
    meta_data.extend(a.tags.iter().cloned());
    let job = a.busy.then(|| {
        json!({
            "id": format!("0190bbbb-0000-4000-8000-{index:012}"),
            "type": "script",
            "name": "evaluate",
            "agent_query_rules": [format!("queue={}", a.queue_name())],
            "state": "running",
            "build_url": format!("{}/v2/organizations/{}/pipelines/{}/builds/1", inner.base, inner.org, inner.pipeline),
            "web_url": format!("https://buildkite.com/{}/{}/builds/1", inner.org, inner.pipeline),
        })
    });
    json!({
        "id": id,
        "graphql_id": format!("QWdlbnQtLS0{index}"),
        "url": format!("{}/v2/organizations/{}/agents/{id}", inner.base, inner.org),
        "web_url": format!("https://buildkite.com/organizations/{}/agents/{id}", inner.org),
        "name": a.name,
        "connection_state": a.connection_state,
        "hostname": format!("{}.gpu.example", a.name),
        "ip_address": "192.0.2.10",
        "user_agent": "buildkite-agent/3.110.0 (linux; amd64)",
        "version": "3.110.0",
        "creator": null,
        "created_at": "2026-11-01T00:00:00.000Z",
        "job": job,
        "last_job_finished_at": null,
        "priority": 0,
        "meta_data": meta_data,
        "paused": a.paused.is_some(),
        "paused_note": a.paused,
    })
}

/// `GET /v2/organizations/{org}/agents[?page=N&per_page=M]`
pub(super) async fn list_agents(
    State(inner): State<Arc<Inner>>,
    Path(org): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
    uri: axum::http::Uri,
) -> Response {
    let path = format!("/v2/organizations/{org}/agents");
    let query = uri.query().map(str::to_string);
    if let Some(r) = gate(
        &inner,
        Route::ListAgents,
        &headers,
        "GET",
        &path,
        query,
        None,
    )
    .await
    {
        return with_rate_headers(&inner, r);
    }
    if org != inner.org {
        let r = (
            StatusCode::NOT_FOUND,
            Json(json!({"message": "No organization found"})),
        )
            .into_response();
        return with_rate_headers(&inner, r);
    }
    let page: usize = q
        .get("page")
        .and_then(|p| p.parse().ok())
        .filter(|p| *p >= 1)
        .unwrap_or(1);
    let per_page: usize = q
        .get("per_page")
        .and_then(|p| p.parse().ok())
        .unwrap_or(30)
        .clamp(1, 100);
    // `name` filters (Buildkite's documented parameter; matched loosely here, as a part of
    // the name, so a caller must pick the exact one).
    let named = q.get("name").cloned();
    // The agents a test set, then the real agents registered through the agent API.
    let mut connected: Vec<Value> = lock(&inner.agents)
        .iter()
        .enumerate()
        .filter(|(_, a)| a.connection_state == "connected")
        .map(|(i, a)| rest_agent(&inner, i, a))
        .collect();
    connected.extend(super::agent_api::rest_agents(&lock(&inner.world)));
    connected.retain(|a| {
        named
            .as_ref()
            .is_none_or(|n| a["name"].as_str().is_some_and(|x| x.contains(n.as_str())))
    });
    let pages = connected.len().div_ceil(per_page).max(1);
    let body: Vec<Value> = connected
        .into_iter()
        .skip((page - 1) * per_page)
        .take(per_page)
        .collect();
    let mut r = Json(body).into_response();
    let link_to = |n: usize, rel: &str| {
        format!(
            "<{}{path}?page={n}&per_page={per_page}>; rel=\"{rel}\"",
            inner.base
        )
    };
    let mut links = Vec::new();
    if page < pages {
        links.push(link_to(page + 1, "next"));
        links.push(link_to(pages, "last"));
    }
    if page > 1 {
        links.push(link_to(1, "first"));
        links.push(link_to(page - 1, "prev"));
    }
    if !links.is_empty() {
        if let Ok(v) = HeaderValue::from_str(&links.join(", ")) {
            r.headers_mut().insert("link", v);
        }
    }
    with_rate_headers(&inner, r)
}

/// `PUT /v2/organizations/{org}/agents/{id}/pause` (<https://buildkite.com/docs/apis/rest-api/agents>,
/// go-buildkite's `AgentsService.Pause`): body `note`, `timeout_in_minutes` (1 to 10,080; 5
/// when absent). A disconnected agent, or one already paused, answers `422`: Buildkite's
/// documentation does not say what a second pause does, and the fake takes the stricter
/// reading, so a caller renewing a pause must resume first.
pub(super) async fn pause_agent(
    State(inner): State<Arc<Inner>>,
    Path((org, id)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let path = format!("/v2/organizations/{org}/agents/{id}/pause");
    let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    set_paused(
        &inner,
        Route::PauseAgent,
        &org,
        &id,
        &headers,
        &path,
        Some(req),
    )
    .await
}

/// `PUT /v2/organizations/{org}/agents/{id}/resume`: a paused agent is dispatched jobs again.
pub(super) async fn resume_agent(
    State(inner): State<Arc<Inner>>,
    Path((org, id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let path = format!("/v2/organizations/{org}/agents/{id}/resume");
    set_paused(&inner, Route::ResumeAgent, &org, &id, &headers, &path, None).await
}

async fn set_paused(
    inner: &Arc<Inner>,
    route: Route,
    org: &str,
    id: &str,
    headers: &HeaderMap,
    path: &str,
    pause: Option<Value>,
) -> Response {
    if let Some(r) = gate(inner, route, headers, "PUT", path, None, None).await {
        return with_rate_headers(inner, r);
    }
    let unprocessable = |m: &str| {
        with_rate_headers(
            inner,
            (
                StatusCode::UNPROCESSABLE_ENTITY,
                Json(json!({"message": m})),
            )
                .into_response(),
        )
    };
    let not_found = || {
        let r = (
            StatusCode::NOT_FOUND,
            Json(json!({"message": "No agent found"})),
        )
            .into_response();
        with_rate_headers(inner, r)
    };
    if org != inner.org {
        return not_found();
    }
    let mut agents = lock(&inner.agents);
    let Some(i) = (0..agents.len()).find(|i| agent_id(*i) == id) else {
        drop(agents);
        // A real agent registered through the agent API.
        let asked = pause.map(|req| {
            (
                req["note"].as_str().unwrap_or_default().to_string(),
                req["timeout_in_minutes"].as_u64().unwrap_or(5),
            )
        });
        if asked
            .as_ref()
            .is_some_and(|(_, m)| !(1..=10_080).contains(m))
        {
            return unprocessable("timeout_in_minutes must be between 1 and 10080");
        }
        let changed = super::agent_api::set_paused_by_id(&mut lock(&inner.world), id, asked);
        return match changed {
            None => not_found(),
            Some(Err(m)) => unprocessable(m),
            Some(Ok(())) => with_rate_headers(inner, Json(json!({"id": id})).into_response()),
        };
    };
    let a = &mut agents[i];
    if a.connection_state != "connected" {
        return unprocessable("Agent is not connected");
    }
    match pause {
        Some(req) => {
            let minutes = req["timeout_in_minutes"].as_u64().unwrap_or(5);
            if !(1..=10_080).contains(&minutes) {
                return unprocessable("timeout_in_minutes must be between 1 and 10080");
            }
            if a.paused.is_some() {
                return unprocessable("Agent is already paused");
            }
            a.paused = Some(req["note"].as_str().unwrap_or_default().to_string());
        }
        None => {
            if a.paused.is_none() {
                return unprocessable("Agent is not paused");
            }
            a.paused = None;
        }
    }
    let body = rest_agent(inner, i, a);
    drop(agents);
    with_rate_headers(inner, Json(body).into_response())
}

/// `GET /v3/metrics` (agent API).
pub(super) async fn metrics(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> Response {
    if let Some(r) = gate(
        &inner,
        Route::AgentMetrics,
        &headers,
        "GET",
        "/v3/metrics",
        None,
        None,
    )
    .await
    {
        return r;
    }
    let auth = headers.get("authorization").and_then(|v| v.to_str().ok());
    if auth != Some(&format!("Token {FAKE_AGENT_TOKEN}")) {
        return (
            StatusCode::UNAUTHORIZED,
            Json(json!({"message": "Invalid agent token"})),
        )
            .into_response();
    }
    let mut queues: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for a in lock(&inner.agents)
        .iter()
        .filter(|a| a.connection_state == "connected")
    {
        let e = queues.entry(a.queue_name().to_string()).or_default();
        if a.busy {
            e.1 += 1;
        } else {
            e.0 += 1;
        }
    }
    let mut jobs: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for b in lock(&inner.builds).iter() {
        let queue = b
            .body
            .pointer("/env/KERNELBOT_QUEUE")
            .and_then(Value::as_str)
            .unwrap_or("default")
            .to_string();
        match b.state.as_str() {
            "scheduled" => jobs.entry(queue).or_default().0 += 1,
            "running" => jobs.entry(queue).or_default().1 += 1,
            _ => {}
        }
    }
    let (idle, busy) = queues
        .values()
        .fold((0, 0), |(i, b), (qi, qb)| (i + qi, b + qb));
    let (scheduled, running) = jobs
        .values()
        .fold((0, 0), |(s, r), (qs, qr)| (s + qs, r + qr));
    Json(json!({
        "agents": {
            "idle": idle, "busy": busy, "total": idle + busy,
            "queues": queues.iter().map(|(q, (i, b))| (q.clone(), json!({"idle": i, "busy": b, "total": i + b}))).collect::<serde_json::Map<_, _>>(),
        },
        "jobs": {
            "scheduled": scheduled, "running": running, "waiting": 0, "total": scheduled + running,
            "queues": jobs.iter().map(|(q, (s, r))| (q.clone(), json!({"scheduled": s, "running": r, "waiting": 0, "total": s + r}))).collect::<serde_json::Map<_, _>>(),
        },
        "organization": {"slug": inner.org},
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::super::*;

    #[tokio::test]
    async fn agents_are_paginated_with_link_headers_and_metrics_count_per_queue() {
        let fake = FakeBuildkite::start().await;
        let mut agents: Vec<FakeAgent> = (0..5)
            .map(|i| FakeAgent::new(&format!("h100-{i}"), "h100", i % 2 == 0))
            .collect();
        agents.push(FakeAgent {
            connection_state: "disconnected".into(),
            ..FakeAgent::new("gone", "h100", false)
        });
        agents.push(FakeAgent {
            queue: None,
            ..FakeAgent::new("plain", "x", false)
        });
        fake.set_agents(agents);
        let http = reqwest::Client::new();
        let url = format!("{}/organizations/{FAKE_ORG}/agents", fake.api_url());
        let r = http
            .get(format!("{url}?per_page=4"))
            .bearer_auth(FAKE_API_TOKEN)
            .send()
            .await
            .unwrap();
        let link = r.headers()["link"].to_str().unwrap().to_string();
        let page1: Vec<Value> = r.json().await.unwrap();
        assert_eq!(page1.len(), 4);
        assert!(link.contains("page=2&per_page=4>; rel=\"next\""), "{link}");
        let next = link.split(['<', '>']).nth(1).unwrap().to_string();
        let r = http
            .get(&next)
            .bearer_auth(FAKE_API_TOKEN)
            .send()
            .await
            .unwrap();
        assert!(!r.headers()["link"].to_str().unwrap().contains("next"));
        let page2: Vec<Value> = r.json().await.unwrap();
        assert_eq!(page2.len(), 2, "the disconnected agent is not listed");
        assert_eq!(page1[0]["meta_data"], json!(["queue=h100"]));
        assert!(page1[0]["job"].is_object() && page1[1]["job"].is_null());
        assert_eq!(page2[1]["meta_data"], json!([]));

        let unauth = http
            .get(format!("{}/metrics", fake.agent_api_url()))
            .bearer_auth(FAKE_API_TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(unauth.status(), 401, "the REST token is not an agent token");
        let m: Value = http
            .get(format!("{}/metrics", fake.agent_api_url()))
            .header("authorization", format!("Token {FAKE_AGENT_TOKEN}"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            m["agents"]["queues"]["h100"],
            json!({"idle": 2, "busy": 3, "total": 5})
        );
        assert_eq!(m["agents"]["queues"]["default"]["total"], 1);
        assert_eq!(m["agents"]["total"], 6);
        let calls: Vec<Route> = fake.requests().iter().map(|r| r.route).collect();
        assert_eq!(
            calls,
            [
                Route::ListAgents,
                Route::ListAgents,
                Route::AgentMetrics,
                Route::AgentMetrics
            ]
        );
    }
}
