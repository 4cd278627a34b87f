//! The fleet dashboard (`GET /dashboard`) in a real browser: Debian's chromium, headless,
//! driven over the W3C WebDriver protocol by Debian's chromedriver, against the service with a
//! simulated fleet (800 fake Buildkite agents on 100 nodes, canary histories, one quarantined
//! slice, failures on two nodes, 10,000 submissions waiting). It checks what the page shows
//! on its first render, then that its live updates show what happens after (an operator's
//! quarantine, more submissions), on a desktop window and a phone's, and with the read-only
//! token. Screenshots are written to `target/test-output/dashboard/`.
//!
//! WebDriver's calls (`POST /session`, `/session/{id}/url`, `/execute/sync`, `/window/rect`,
//! `GET /screenshot`) are the W3C specification's; chromedriver's `goog:chromeOptions` carry
//! the binary and its flags.

use std::time::Duration;

use kernelkite_testkit::browser::Browser;
use kernelkite_testkit::fleet_sim::{roster, simulated_fleet};
use kernelkite_testkit::harness::harness_with;
use kernelkite_testkit::{sample_config, skip};
use serde_json::json;

const WAITING: usize = 10_000;
const API_TOKEN: &str = "api-secret-token";
const VIEW_TOKEN: &str = "view-only-token";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_the_fleet_and_follows_it_live_in_a_real_browser() {
    let browser = match Browser::start().await {
        Ok(b) => b,
        Err(why) => return skip(why),
    };
    let h = harness_with(|cfg| {
        cfg.fair.queue_slots = kernelkite_service::dispatch::Slots::parse("*=2").unwrap();
        // The agents list is read again every second (the flag's floor is a minute; the
        // roster is set once the service runs).
        cfg.queues.agents_refresh_s = 1;
        cfg.edge.api_token = Some(kernelkite_service::config::Secret::new(API_TOKEN));
        cfg.fleet.dashboard_token = Some(kernelkite_service::config::Secret::new(VIEW_TOKEN));
    })
    .await;
    h.fake.set_agents(roster());
    h.app.fleet().load(simulated_fleet());
    // 10,000 submissions waiting in the service's queue (two slots, two builds).
    let req = |i: usize| {
        let mut c = sample_config();
        c["seed"] = json!(i);
        serde_json::from_value::<kernelkite_service::app::SubmitRequest>(json!({
            "config": c, "queue": "h100", "user": format!("user-{}", i % 37),
            "priority": if i.is_multiple_of(10) { "ranked" } else { "test" }
        }))
        .unwrap()
    };
    for i in 0..WAITING + 2 {
        h.app.submit(req(i), None).await.unwrap();
    }

    // The page, opened with the read-only token in its fragment (which never reaches a log).
    browser
        .open(&format!("{}/dashboard#token={VIEW_TOKEN}", h.base))
        .await;
    browser
        .until(
            "the first render with the agents' roster",
            "return window.kk && kk.renders > 0 && kk.data.totals.offline === 8 && kk.mode === 'live' && kk.slicesDone === kk.slicesSeq",
            Duration::from_secs(30),
        )
        .await;
    let shown = browser
        .js(r#"
            const q = (s) => document.querySelector(s);
            const card = (k) => q(`#totals [data-k=${k}] b`).textContent;
            const sick = q('#slices tr[data-slice="node003-gpu5"]');
            return {
              slices: document.querySelectorAll('#slices tbody tr').length,
              quarantinedRows: document.querySelectorAll('#slices tr[data-state=quarantined]').length,
              sickState: sick && sick.dataset.state,
              sickText: sick && sick.innerText,
              offline: document.querySelectorAll('#slices tr[data-state=offline]').length,
              cards: { slices: card('slices'), waiting: card('waiting'), quarantined: card('quarantined'), offline: card('offline') },
              h100Waiting: q('#queues tr[data-queue=h100] [data-k=waiting]').textContent,
              h100Row: q('#queues tr[data-queue=h100]').innerText,
              failures: [...document.querySelectorAll('#failures details')].map((d) => d.dataset.node),
              failureText: q('#failures').innerText,
              trends: document.querySelectorAll('#slices svg.trend polyline').length,
              token: location.hash,
              status: q('#status').dataset.s,
            };
        "#)
        .await;
    assert_eq!(shown["slices"], 800, "{shown:#}");
    assert_eq!(shown["cards"]["slices"], "800", "{shown:#}");
    assert_eq!(shown["cards"]["waiting"], "10000", "{shown:#}");
    assert_eq!(shown["h100Waiting"], "10000", "{shown:#}");
    assert_eq!(shown["cards"]["quarantined"], "1", "{shown:#}");
    assert_eq!(shown["quarantinedRows"], 1);
    assert_eq!(shown["sickState"], "quarantined");
    let sick = shown["sickText"].as_str().unwrap();
    assert!(
        sick.contains("20.0% slower") && sick.contains("2 ranked run(s) to run again"),
        "{sick}"
    );
    assert_eq!(
        shown["offline"], 8,
        "node099's slices are offline: {shown:#}"
    );
    assert_eq!(shown["trends"], 800, "a canary trend per slice");
    let row = shown["h100Row"].as_str().unwrap();
    assert!(
        row.contains("ranked 1001") && row.contains("test 9001"),
        "per-class counts: {row}"
    );
    assert!(row.contains("user-"), "per-user counts: {row}");
    let failures = shown["failures"].as_array().unwrap();
    assert_eq!(failures.len(), 2, "{shown:#}");
    assert!(shown["failureText"].as_str().unwrap().contains("Xid 79"));
    assert_eq!(
        shown["token"], "",
        "the token is taken out of the address bar"
    );
    assert_eq!(shown["status"], "live");
    browser.screenshot("dashboard", "desktop.png").await;

    // Live: an operator takes a slice out, and more work arrives; the open page shows both
    // without a reload.
    let renders = browser.js("return kk.renders").await.as_u64().unwrap();
    let r = h
        .http
        .post(format!(
            "{}/v1/fleet/slices/node050-gpu1/quarantine",
            h.base
        ))
        .bearer_auth(API_TOKEN)
        .json(&json!({"reason": "fan replacement"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    browser
        .until(
            "the operator's quarantine on the open page",
            "return document.querySelector('#slices tr[data-slice=\"node050-gpu1\"]').dataset.state === 'quarantined' && document.querySelector('#totals [data-k=quarantined] b').textContent === '2'",
            Duration::from_secs(10),
        )
        .await;
    for i in 0..5 {
        h.app.submit(req(WAITING + 10 + i), None).await.unwrap();
    }
    browser
        .until(
            "new submissions on the open page",
            "return document.querySelector('#queues tr[data-queue=h100] [data-k=waiting]').textContent === '10005'",
            Duration::from_secs(10),
        )
        .await;
    let later = browser.js("return kk.renders").await.as_u64().unwrap();
    assert!(
        later >= renders + 2,
        "rendered again by the stream: {renders} → {later}"
    );
    let reloads = browser
        .js("return performance.getEntriesByType('navigation').length")
        .await;
    assert_eq!(reloads, 1, "no reload");
    browser.screenshot("dashboard", "desktop-live.png").await;

    // A phone: the page fits its width (the tables scroll inside their boxes), and the
    // filter narrows the slices.
    browser.size(390, 844).await;
    let fits = browser
        .until(
            "the phone layout",
            "return document.documentElement.scrollWidth <= window.innerWidth + 1 ? 'fits' : ''",
            Duration::from_secs(5),
        )
        .await;
    assert_eq!(fits, "fits");
    browser
        .js("const f = document.getElementById('filter'); f.value = 'node003'; f.dispatchEvent(new Event('input')); return 1")
        .await;
    let rows = browser
        .js("return document.querySelectorAll('#slices tbody tr').length")
        .await;
    assert_eq!(rows, 8, "node003's eight slices");
    browser.screenshot("dashboard", "phone.png").await;

    // The read-only token reads the fleet and nothing else; no token, no fleet.
    let r = h
        .http
        .post(format!("{}/v1/fleet/slices/node050-gpu1/canary", h.base))
        .bearer_auth(VIEW_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "the dashboard token changes nothing");
    let r = h
        .http
        .get(format!("{}/v1/submissions/x", h.base))
        .bearer_auth(VIEW_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "nor reads submissions");
    browser
        .call(
            "POST",
            "/execute/sync",
            Some(json!({"script": "sessionStorage.clear(); return 1", "args": []})),
        )
        .await;
    browser.open(&format!("{}/dashboard", h.base)).await;
    browser
        .until(
            "the token form",
            "return getComputedStyle(document.getElementById('login')).display === 'block' && document.getElementById('status').dataset.s === 'error'",
            Duration::from_secs(10),
        )
        .await;
}
