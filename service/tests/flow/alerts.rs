//! Vendors' alerts against a fake Slack incoming webhook (`kernelkite_testkit::fake_slack`):
//! a quarantine, its release, a node's agent offline and back each reach the vendor's hook;
//! news beyond the hook's limit per minute waits; and a hook that fails or is down costs the
//! queue nothing (submissions run and end as before) while the alert is given up, counted.
//! And in Buildkite mode a quarantined slice's agent is paused through Buildkite's REST API
//! (so Buildkite dispatches it nothing), paused again when its pause ends, and resumed when the
//! slice is released; an operator's own pause is left alone.

use std::time::{Duration, Instant};

use kernelkite_service::config::Secret;
use kernelkite_testkit::fake_buildkite::{FakeAgent, Route};
use kernelkite_testkit::fake_slack::{FakeSlack, Mode, SECRET};
use kernelkite_testkit::harness::{harness_with, result_artifact, Harness};
use serde_json::{json, Value};

async fn alerting(slack: &FakeSlack, per_minute: u32) -> Harness {
    let url = slack.url();
    let h = harness_with(move |cfg| {
        cfg.fleet.alert_webhooks = Some(Secret::new(format!("*={url}")));
        cfg.fleet.alert_offline_after_s = 1;
        cfg.fleet.alert_max_per_minute = per_minute;
        // The agents list is read every second (the flag's floor is a minute).
        cfg.queues.agents_refresh_s = 1;
    })
    .await;
    h.fake.set_agents(agents(true));
    wait_fleet(&h, |f| {
        f["totals"]["slices"] == 3 && f["totals"]["offline"] == 0
    })
    .await;
    h
}

fn agents(with_b1: bool) -> Vec<FakeAgent> {
    let mut v = vec![
        FakeAgent::new("a1", "h100", false),
        FakeAgent::new("a2", "h100", false),
    ];
    if with_b1 {
        v.push(FakeAgent::new("b1", "h100", false));
    }
    v
}

async fn wait_fleet(h: &Harness, ok: impl Fn(&Value) -> bool) -> Value {
    h.wait_fleet(Duration::from_secs(20), ok, String::new).await
}

async fn wait_message(slack: &FakeSlack, n: usize, says: &str) -> String {
    let start = Instant::now();
    loop {
        let m = slack.messages();
        if m.len() >= n {
            assert!(
                m[n - 1].contains(says),
                "message {n} should say {says:?}: {m:#?}"
            );
            return m[n - 1].clone();
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no message {n} ({says:?}): {m:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn alerts_metric(h: &Harness, outcome: &str) -> u64 {
    let text = h
        .http
        .get(format!("{}/metrics", h.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let prefix = format!("kernelkite_alerts_total{{outcome=\"{outcome}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

async fn quarantine(h: &Harness, slice: &str, reason: Option<&str>) {
    let url = format!("{}/v1/fleet/slices/{slice}/quarantine", h.base);
    let r = match reason {
        Some(r) => h.http.post(url).json(&json!({"reason": r})).send().await,
        None => h.http.delete(url).send().await,
    }
    .unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn quarantine_release_offline_and_back_reach_the_vendor_and_the_limit_holds_the_rest() {
    let slack = FakeSlack::start().await;
    let h = alerting(&slack, 4).await;
    quarantine(&h, "a1", Some("fan replacement")).await;
    let m = wait_message(
        &slack,
        1,
        "a1 is quarantined: taken out by an operator: fan replacement",
    )
    .await;
    assert!(m.starts_with("kernelkite fleet\n🚫 "), "{m}");
    quarantine(&h, "a1", None).await;
    wait_message(&slack, 2, "a1 was released by an operator").await;
    // b1's agent disconnects: after the offline limit its vendor hears of it, once; and again
    // when it is back.
    h.fake.set_agents(agents(false));
    wait_message(&slack, 3, "b1 has not been connected for").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        slack.messages().len(),
        3,
        "told once: {:#?}",
        slack.messages()
    );
    h.fake.set_agents(agents(true));
    wait_message(&slack, 4, "b1 is connected again").await;
    // The hook's four messages of the minute are spent: the next news waits for the minute.
    quarantine(&h, "a2", Some("suspect")).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        slack.messages().len(),
        4,
        "held past the limit: {:#?}",
        slack.messages()
    );
    assert_eq!(alerts_metric(&h, "sent").await, 4);
    // Nothing any message or the overview says holds the hook's secret.
    let f = wait_fleet(&h, |_| true).await;
    assert!(!f.to_string().contains(SECRET));
}

#[tokio::test]
async fn a_failing_or_absent_hook_costs_the_queue_nothing() {
    let slack = FakeSlack::start().await;
    let h = alerting(&slack, 6).await;
    slack.set_mode(Mode::Fail);
    let t = Instant::now();
    quarantine(&h, "a1", Some("x")).await;
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "the request did not wait for the hook"
    );
    // A submission runs and ends while the hook fails.
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    let v = h.wait_terminal(&id).await;
    assert_eq!(v["state"], "succeeded", "{v}");
    // The alert was tried three times, then given up and counted.
    let start = Instant::now();
    while alerts_metric(&h, "given_up").await < 1 {
        assert!(start.elapsed() < Duration::from_secs(20), "never given up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(slack.refused(), 3);
    // Down altogether: the same.
    slack.take_down();
    quarantine(&h, "a2", Some("y")).await;
    let (id, number) = h.submit().await;
    h.wait_build_attached(&id).await;
    h.fake
        .finish_build(number, "passed", result_artifact())
        .await;
    assert_eq!(h.wait_terminal(&id).await["state"], "succeeded");
    let start = Instant::now();
    while alerts_metric(&h, "given_up").await < 2 {
        assert!(start.elapsed() < Duration::from_secs(20), "never given up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The note of agent `name`'s pause in the fake, once `ok` holds for it (at most 20 s).
async fn wait_pause(h: &Harness, name: &str, ok: impl Fn(Option<&str>) -> bool) -> Option<String> {
    let start = Instant::now();
    loop {
        let paused = h
            .fake
            .agent_list()
            .into_iter()
            .find(|a| a.name == name)
            .and_then(|a| a.paused);
        if ok(paused.as_deref()) {
            return paused;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{name}'s pause is {paused:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_quarantined_slice_s_agent_is_paused_kept_paused_and_resumed_and_an_operator_s_pause_is_kept(
) {
    let h = harness_with(|cfg| cfg.queues.agents_refresh_s = 1).await;
    let mut agents = agents(true);
    agents[2].paused = Some("maintenance: new PSU".into());
    h.fake.set_agents(agents);
    wait_fleet(&h, |f| f["totals"]["slices"] == 3).await;

    quarantine(&h, "a1", Some("fan replacement")).await;
    let note = wait_pause(&h, "a1", |p| p.is_some()).await.unwrap();
    assert!(
        note.starts_with("kernelkite: quarantined") && note.contains("fan replacement"),
        "{note}"
    );
    let pauses = h.fake.requests_to(Route::PauseAgent);
    assert_eq!(pauses.len(), 1, "{pauses:?}");
    assert!(pauses[0].path.ends_with("/pause") && pauses[0].status == 200);
    // The other slices' agents are not touched.
    assert_eq!(wait_pause(&h, "a2", |_| true).await, None);

    // The pause ends (its timeout, or the agent restarted and registered afresh): the agent is
    // paused again, as long as the slice is quarantined.
    h.fake.end_pause("a1");
    wait_pause(&h, "a1", |p| p.is_some()).await;
    assert_eq!(h.fake.requests_to(Route::PauseAgent).len(), 2);

    // A slice whose agent an operator paused is quarantined: the operator's pause and its note
    // stay; released, the agent stays paused (the operator resumes it).
    quarantine(&h, "b1", Some("suspect")).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(h.fake.requests_to(Route::PauseAgent).len(), 2);
    quarantine(&h, "b1", None).await;

    // Released: a1's agent is resumed, once.
    quarantine(&h, "a1", None).await;
    wait_pause(&h, "a1", |p| p.is_none()).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let resumed = h.fake.requests_to(Route::ResumeAgent);
    assert_eq!(resumed.len(), 1, "{resumed:?}");
    assert_eq!(
        wait_pause(&h, "b1", |_| true).await.as_deref(),
        Some("maintenance: new PSU")
    );
    assert_eq!(h.fake.requests_to(Route::PauseAgent).len(), 2);
}
