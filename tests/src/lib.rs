//! kernelkite's test support. Cross-crate end-to-end tests live beside it in `tests/tests/`;
//! this library holds what they and every crate's tests and benchmarks share: the fake
//! Buildkite (also a process with a control API, the `fake-buildkite` binary, for the Python
//! client's tests), the service on loopback against it, sample kernelbot documents, scratch trees, a small tmpfs to fill,
//! and [`skip()`], which reports a test that could not run here as skipped. None of it is in a
//! product's path.

#![deny(missing_docs)]

pub mod agent_node;
pub mod balancer;
pub mod browser;
pub mod callback_receiver;
pub mod deployment;
pub mod fake_buildkite;
pub mod fake_slack;
pub mod fleet_sim;
pub mod harness;
pub mod local;
pub mod service_process;
pub mod users;

// The leaf crates' test support, under the paths every test already uses.
pub use kernelkite_testkit_leaf::{
    assert_warns, built_binary, fake_nvml, kfd, need_python, node_binary, postgres, python,
    scratch, skip, static_isolate, tmpfs, Sleeper,
};

/// The variables a Buildkite agent gives a plugin's hooks (the service's, which local mode
/// uses; `tests/real_agent.rs` checks them against the real agent), for the plugin's emulated
/// agent.
pub use kernelkite_agent::plugins::{plugin_variables, PLUGIN_LOCATION};

/// Issue 25's claims on the order a queue of two slots started its submissions in, as the
/// service's and local mode's simulations both check them (`order`: every submission, first
/// started first): after the two that held the slots, the `admin` run sent while everything
/// waited; then the rest exactly in the order their reported places said (`predicted`); and
/// every `light` user's run before the `heavy` user's tenth.
pub fn assert_fair_start_order(
    order: &[String],
    admin: &str,
    predicted: &[String],
    heavy: &[String],
    light: &[String],
) {
    assert_eq!(
        order[2], admin,
        "the admin run starts when the first slot frees"
    );
    let rest: Vec<&String> = order[2..].iter().filter(|id| *id != admin).collect();
    let predicted: Vec<&String> = predicted.iter().collect();
    assert_eq!(
        rest, predicted,
        "the places reported are the order they started in"
    );
    let at = |id: &String| order.iter().position(|o| o == id);
    let tenth_heavy = at(&heavy[9]).expect("the heavy user's tenth started");
    for id in light {
        assert!(at(id).is_some_and(|p| p < tenth_heavy), "{order:?}");
    }
}

/// When one submission waited and held a slot, seconds on one clock, read from its history:
/// accepted (`created_at`), left the queue (its first state after `queued`: its build was
/// created, or a local slice took it), ended (`finished_at`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    /// Accepted.
    pub accepted: f64,
    /// Left the queue.
    pub started: f64,
    /// Ended.
    pub ended: f64,
}

impl Span {
    /// The span of an ended submission as GET shows it; `None` when it never left the queue.
    pub fn of(sub: &serde_json::Value) -> Option<Span> {
        let at = |v: &serde_json::Value| {
            chrono::DateTime::parse_from_rfc3339(v.as_str()?)
                .ok()
                .map(|t| t.timestamp_micros() as f64 / 1e6)
        };
        let started = sub["history"]
            .as_array()?
            .iter()
            .find(|t| t["state"] != "queued")?;
        Some(Span {
            accepted: at(&sub["created_at"])?,
            started: at(&started["at"])?,
            ended: at(&sub["finished_at"])?,
        })
    }
}

/// The stretches of time (start, length, seconds) during which a submission waited while
/// fewer than `slots` submissions held a slot: a free slot left idle while work waited.
pub fn idle_while_waiting(spans: &[Span], slots: usize) -> Vec<(f64, f64)> {
    // (time, change of waiting, change of running); everything at one instant is applied
    // before the state is read, so a hand-over at one instant is no gap.
    let mut events: Vec<(f64, i64, i64)> = Vec::new();
    for s in spans {
        events.push((s.accepted, 1, 0));
        events.push((s.started, -1, 1));
        events.push((s.ended, 0, -1));
    }
    events.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut waiting, mut running) = (0i64, 0i64);
    let mut gaps = Vec::new();
    let mut open: Option<f64> = None;
    let mut i = 0;
    while i < events.len() {
        let t = events[i].0;
        while i < events.len() && events[i].0 == t {
            waiting += events[i].1;
            running += events[i].2;
            i += 1;
        }
        let idle = waiting > 0 && running < slots as i64;
        match (idle, open) {
            (true, None) => open = Some(t),
            (false, Some(from)) => {
                gaps.push((from, t - from));
                open = None;
            }
            _ => {}
        }
    }
    gaps
}

/// Fails unless every slot was busy while work waited, but for hand-overs shorter than
/// `handover` seconds (a slot freed and the next submission taking it). The check the fair-queue
/// simulations make on the outcome, not on the start order: a 2-slot queue that ran one job at
/// a time while others waited passed every order check (issue 34).
pub fn assert_no_slot_idles_while_work_waits(
    subs: &[serde_json::Value],
    slots: usize,
    handover: f64,
) {
    let spans: Vec<Span> = subs.iter().filter_map(Span::of).collect();
    assert_eq!(
        spans.len(),
        subs.len(),
        "every submission left the queue and ended"
    );
    let gaps = idle_while_waiting(&spans, slots);
    let worst = gaps.iter().map(|g| g.1).fold(0.0, f64::max);
    let first = spans.iter().map(|s| s.accepted).fold(f64::MAX, f64::min);
    let mut longest = gaps.clone();
    longest.sort_by(|a, b| b.1.total_cmp(&a.1));
    let longest: Vec<String> = longest
        .iter()
        .take(3)
        .map(|(from, len)| format!("{len:.3} s from {:.3} s", from - first))
        .collect();
    assert!(
        worst < handover,
        "a slot sat idle for {worst:.3} s while work waited ({} such stretches, {:.3} s in all; hand-overs may take up to {handover} s); the longest, counted from the first submission: {}",
        gaps.len(),
        gaps.iter().map(|g| g.1).sum::<f64>(),
        longest.join(", ")
    );
}

/// A valid kernelbot run config (Python, test mode)./// A valid kernelbot run config (Python, test mode).
pub fn sample_config() -> serde_json::Value {
    serde_json::json!({
        "lang": "py",
        "mode": "test",
        "main": "eval.py",
        "sources": {"eval.py": "print('hi')\n", "submission.py": "def kernel(x):\n    return x\n"},
        "tests": [{"size": 128, "seed": 1}],
        "benchmarks": [{"size": 4096, "seed": 2}],
        "seed": 42,
        "test_timeout": 60
    })
}

/// A `result.json` as the runner writes it (kernelbot's FullResult, every field present).
pub fn sample_result_json() -> String {
    serde_json::json!({
        "success": true,
        "error": "",
        "system": {"gpu": "NVIDIA H100 80GB HBM3", "device_count": 1, "cpu": "AMD EPYC 9654", "runtime": "CUDA",
                   "platform": "Linux-6.8.0-x86_64-with-glibc2.39", "torch": "2.6.0", "hostname": "gpu-node-1"},
        "runs": {"test": {
            "start": "2026-11-22T10:40:00.123456+00:00",
            "end": "2026-11-22T10:40:03.654321+00:00",
            "compilation": null,
            "run": {"success": true, "passed": true, "command": "python3 eval.py test cases.txt",
                    "stdout": "", "stderr": "", "exit_code": 0, "duration": 3.53,
                    "result": {"check": "pass", "test-count": "1"}},
            "profile": null
        }}
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(accepted: f64, started: f64, ended: f64) -> Span {
        Span {
            accepted,
            started,
            ended,
        }
    }

    #[test]
    fn a_free_slot_left_idle_while_work_waits_is_found_and_hand_overs_are_not() {
        // Two slots, four jobs of 1 s sent at 0: 0-1 and 0-1, then 1-2 and 1-2.
        let busy = [
            span(0.0, 0.0, 1.0),
            span(0.0, 0.0, 1.0),
            span(0.0, 1.0, 2.0),
            span(0.0, 1.0, 2.0),
        ];
        assert!(idle_while_waiting(&busy, 2).is_empty());
        // The fourth waits for the third to end although the second slot freed at 1.
        let one_at_a_time = [
            span(0.0, 0.0, 1.0),
            span(0.0, 0.0, 1.0),
            span(0.0, 1.0, 2.0),
            span(0.0, 2.0, 3.0),
        ];
        assert_eq!(idle_while_waiting(&one_at_a_time, 2), [(1.0, 1.0)]);
        // Nothing waits: a free slot is no gap.
        let idle = [span(0.0, 0.0, 1.0), span(5.0, 5.0, 6.0)];
        assert!(idle_while_waiting(&idle, 2).is_empty());
    }
}
