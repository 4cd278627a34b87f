//! A simulated fleet for the dashboard's test and benchmark: 800 slices on 100 nodes (90 of
//! H100s, 10 of MI300Xs), each with its last run's readings and five canaries near its model's
//! median; one quarantined after a slow canary, with the ranked runs to run again; failures on
//! two nodes; and the agents Buildkite would list (node099 down).

use kernelkite_service::fleet::{CanaryRun, Cause, FailureNote, Quarantine, SliceDoc};

use crate::fake_buildkite::FakeAgent;

/// Nodes in the fleet.
pub const NODES: usize = 100;
/// Slices (GPUs) per node.
pub const PER_NODE: usize = 8;
/// The quarantined slice.
pub const SICK: &str = "node003-gpu5";

/// Slice `g` of node `n`'s agent name.
pub fn agent(n: usize, g: usize) -> String {
    format!("node{n:03}-gpu{g}")
}

/// 800 slices' records as a fleet that has been running: each with its last run's readings
/// and five canaries near the median; one quarantined after a slow canary, with the ranked
/// runs to run again; failures on two nodes.
/// The slices' records.
pub fn simulated_fleet() -> Vec<SliceDoc> {
    let mut docs = Vec::new();
    for n in 0..NODES {
        for g in 0..PER_NODE {
            let id = agent(n, g);
            let mut d = SliceDoc {
                id: id.clone(),
                queue: Some(if n < 90 { "h100" } else { "mi300x" }.into()),
                node: Some(format!("node{n:03}")),
                index: Some(g as u32),
                model: Some(
                    if n < 90 {
                        "NVIDIA H100 80GB HBM3"
                    } else {
                        "AMD Instinct MI300X"
                    }
                    .into(),
                ),
                driver: Some("550.54.15".into()),
                kernelkite_version: Some("0.1.0".into()),
                runs: 100 + (n * 7 + g) as u64,
                last_run_ms: Some(chrono::Utc::now().timestamp_millis() - 60_000),
                ..SliceDoc::default()
            };
            d.last_sample = Some(kernelkite_sys::provenance::Sample {
                temperature_c: Some(55 + ((n + g) % 20) as u32),
                sm_clock_mhz: Some(1980),
                power_limit_w: Some(700.0),
                ..Default::default()
            });
            for k in 0..5 {
                let ratio = 1.0 + (((n * 31 + g * 7 + k * 3) % 9) as f64 - 4.0) / 400.0;
                d.canaries.push_back(CanaryRun {
                    at_ms: 1_795_000_000_000 + k as i64 * 3_600_000,
                    submission: format!("canary-{id}-{k}"),
                    score: Some(1000.0 * ratio),
                    ratio: Some(ratio),
                    verdict: kernelkite_service::canary::Verdict::Pass,
                    reason: "canary passed".into(),
                    peers: 799,
                });
            }
            docs.push(d);
        }
    }
    let sick = &mut docs[3 * PER_NODE + 5];
    sick.canaries.push_back(CanaryRun {
        at_ms: 1_795_020_000_000,
        submission: "canary-slow".into(),
        score: Some(1200.0),
        ratio: Some(1.2),
        verdict: kernelkite_service::canary::Verdict::Slow { ratio: 1.2 },
        reason: "canary 20.0% slower than its GPU model's median (limit 5.0%)".into(),
        peers: 799,
    });
    sick.quarantine = Some(Quarantine {
        since_ms: 1_795_020_000_000,
        cause: Cause::Canary,
        reason: "canary 20.0% slower than its GPU model's median (limit 5.0%)".into(),
        evidence: Some("canary-slow".into()),
        flagged: vec!["ranked-1".into(), "ranked-2".into()],
    });
    for (n, error) in [
        (7, "the GPU fell off the bus (Xid 79)"),
        (42, "no result.json: the agent was lost"),
    ] {
        let d = &mut docs[n * PER_NODE];
        d.failures.push_back(FailureNote {
            at_ms: chrono::Utc::now().timestamp_millis() - 5_000,
            submission: format!("sub-{n}"),
            queue: "h100".into(),
            state: "failed".into(),
            error: error.into(),
        });
    }
    docs
}

/// The agents Buildkite lists (node099's are not connected).
pub fn roster() -> Vec<FakeAgent> {
    let mut out = Vec::new();
    for n in 0..NODES {
        for g in 0..PER_NODE {
            // One node is down: its slices are offline.
            if n == 99 {
                continue;
            }
            let queue = if n < 90 { "h100" } else { "mi300x" };
            out.push(FakeAgent::new(&agent(n, g), queue, (n + g) % 3 == 0));
        }
    }
    out
}
