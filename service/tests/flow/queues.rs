//! `GET /v1/queues/{queue}`: the service's own counts, and agent counts fetched from the
//! (fake) Buildkite at most once per refresh interval, never once per request.

use kernelkite_service::config::Secret;
use kernelkite_testkit::fake_buildkite::{FakeAgent, Fault, Route, FAKE_AGENT_TOKEN};
use kernelkite_testkit::harness::{harness, harness_with, result_artifact, Harness};
use kernelkite_testkit::sample_config;
use serde_json::{json, Value};

async fn queue(h: &Harness, name: &str) -> (u16, Value) {
    let r = h
        .http
        .get(format!("{}/v1/queues/{name}", h.base))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

fn calls(h: &Harness, route: Route) -> usize {
    h.fake
        .requests()
        .iter()
        .filter(|r| r.route == route)
        .count()
}

#[tokio::test]
async fn counts_submissions_by_state_and_agents_from_one_listing() {
    let h = harness().await;
    // 150 agents: two pages of the list, still one fetch.
    let mut agents: Vec<FakeAgent> = (0..140)
        .map(|i| FakeAgent::new(&format!("h100-{i}"), "h100", i < 100))
        .collect();
    agents.extend((0..10).map(|i| FakeAgent::new(&format!("b200-{i}"), "b200", false)));
    h.fake.set_agents(agents);

    let (a, build_a) = h.submit().await;
    let (_b, _) = h.submit().await;
    let body = json!({"config": sample_config(), "queue": "b200"});
    h.submit_body(body).await;
    h.wait_build_attached(&a).await;
    h.fake.start_build(build_a).await;

    let (status, v) = queue(&h, "h100").await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (
            v["queue"].as_str(),
            v["queued"].as_u64(),
            v["running"].as_u64()
        ),
        (Some("h100"), Some(1), Some(1)),
        "{v}"
    );
    assert_eq!(v["agents"], json!({"idle": 40, "busy": 100, "total": 140}));
    assert!(
        v["updated_at"].as_str().is_some_and(|t| t.ends_with('Z')),
        "{v}"
    );
    assert!(v["agents_updated_at"].is_string(), "{v}");
    assert_eq!(calls(&h, Route::ListAgents), 2, "one fetch of two pages");
    // Through the REST client, as every other Buildkite call: counted with them, and spending
    // the same rate budget.
    let metrics = h.app.metrics().render();
    assert!(
        metrics.contains("kernelkite_buildkite_calls_total{call=\"list_agents\"} 2"),
        "{metrics}"
    );
    let list = h
        .fake
        .requests()
        .into_iter()
        .find(|r| r.route == Route::ListAgents)
        .unwrap();
    assert_eq!(list.query.as_deref(), Some("per_page=100"));

    // Many more requests, for any queue: answered from the snapshot.
    for _ in 0..20 {
        let (_, v) = queue(&h, "b200").await;
        assert_eq!(v["agents"], json!({"idle": 10, "busy": 0, "total": 10}));
        assert_eq!(
            (v["queued"].as_u64(), v["running"].as_u64()),
            (Some(1), Some(0))
        );
    }
    let (_, v) = queue(&h, "mi300").await;
    assert_eq!(
        v["agents"],
        json!({"idle": 0, "busy": 0, "total": 0}),
        "no agents: zero"
    );
    assert_eq!(
        calls(&h, Route::ListAgents),
        2,
        "no Buildkite call per request"
    );

    // A finished submission leaves the counts.
    h.fake
        .finish_build(build_a, "passed", result_artifact())
        .await;
    assert_eq!(h.wait_terminal(&a).await["state"], "succeeded");
    let (_, v) = queue(&h, "h100").await;
    assert_eq!(
        (v["queued"].as_u64(), v["running"].as_u64()),
        (Some(1), Some(0)),
        "{v}"
    );
}

#[tokio::test]
async fn an_agent_token_reads_the_metrics_endpoint_instead() {
    let h = harness_with(|c| c.queues.buildkite_agent_token = Some(Secret::new(FAKE_AGENT_TOKEN)))
        .await;
    h.fake.set_agents(vec![
        FakeAgent::new("a", "h100", true),
        FakeAgent::new("b", "h100", false),
        FakeAgent::new("c", "h100", false),
    ]);
    for _ in 0..5 {
        let (status, v) = queue(&h, "h100").await;
        assert_eq!(status, 200);
        assert_eq!(v["agents"], json!({"idle": 2, "busy": 1, "total": 3}));
    }
    assert_eq!(calls(&h, Route::AgentMetrics), 1);
    assert_eq!(calls(&h, Route::ListAgents), 0);
}

#[tokio::test]
async fn agents_are_null_when_buildkite_refuses_and_the_counts_still_come() {
    let h = harness().await;
    // The API token lacks read_agents.
    h.fake.inject(Route::ListAgents, Fault::Status(403));
    let (status, v) = queue(&h, "h100").await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["agents"], Value::Null);
    assert!(v["agents_updated_at"].is_null());
    assert_eq!(
        (v["queued"].as_u64(), v["running"].as_u64()),
        (Some(0), Some(0))
    );
    queue(&h, "h100").await;
    assert_eq!(
        calls(&h, Route::ListAgents),
        1,
        "a refusal is not retried per request"
    );
}

#[tokio::test]
async fn a_bad_queue_name_is_refused_and_the_token_is_required() {
    let h = harness_with(|c| c.edge.api_token = Some(Secret::new("kk"))).await;
    let r = h
        .http
        .get(format!("{}/v1/queues/h100", h.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = h
        .http
        .get(format!("{}/v1/queues/a%20b", h.base))
        .bearer_auth("kk")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 422);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"].as_str().unwrap().contains("queue \"a b\""),
        "{v}"
    );
}

#[tokio::test]
async fn the_openapi_document_describes_the_route() {
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
    assert!(doc["paths"]["/v1/queues/{queue}"]["get"].is_object());
    let schema = &doc["components"]["schemas"]["QueueStatus"];
    let (_, v) = queue(&h, "h100").await;
    let mut fields: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    let mut documented: Vec<&str> = schema["required"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    fields.sort_unstable();
    documented.sort_unstable();
    assert_eq!(
        fields, documented,
        "the answer has exactly the documented fields"
    );
}
