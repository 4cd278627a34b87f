//! Where a local job's time goes: the moments the executor sees, and the phases between them
//! (queue → slice leased → isolation → evaluation → result stored). The evaluation is what the
//! runner records in `result.json` (from the first run's start to the last run's end); the
//! executor's own overhead is everything from the job leaving the queue to its result being
//! stored, less that.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

/// The moments of one local job, as far as it got.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Timings {
    /// The executor took the job (the submission was accepted a moment before).
    pub accepted: Option<DateTime<Utc>>,
    /// It joined the queue (its launch wrote the job's directory first; launches run
    /// side by side, so this order may differ from `accepted`'s).
    pub queued: Option<DateTime<Utc>>,
    /// A worker took it off the queue.
    pub dequeued: Option<DateTime<Utc>>,
    /// The `environment` hook leased the slice and prepared its cgroup.
    pub leased: Option<DateTime<Utc>>,
    /// The first run's start, as `result.json` records it.
    pub eval_start: Option<DateTime<Utc>>,
    /// The last run's end, as `result.json` records it.
    pub eval_end: Option<DateTime<Utc>>,
    /// The `command` hook exited (the runner wrote `result.json` and exited).
    pub command_done: Option<DateTime<Utc>>,
    /// The `pre-exit` hook cleaned up and released the slice.
    pub cleaned: Option<DateTime<Utc>>,
    /// The submission ended with the result (its `finished_at`).
    pub stored: Option<DateTime<Utc>>,
}

/// The phases of one job.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Phases {
    /// Waiting for a free slice.
    pub queue: Duration,
    /// The `environment` hook: lease, cgroup, exports.
    pub lease: Duration,
    /// From the slice being ready to the first run starting: the `command` hook confining
    /// the runner, and the runner's start-up.
    pub isolation: Duration,
    /// The runs themselves.
    pub evaluation: Duration,
    /// From the last run's end to the result being stored: the runner writing
    /// `result.json` and exiting, the result read, checked and stored. (`pre-exit` runs
    /// beside it, see `release`.)
    pub store: Duration,
    /// From the last run's end to the slice being free again: the runner exiting and
    /// `pre-exit` (killing leftovers, removing the cgroup, releasing the lease).
    pub release: Duration,
}

impl Phases {
    /// Everything the executor added to the evaluation on the way to the stored result, once
    /// the job left the queue.
    pub fn overhead(&self) -> Duration {
        self.lease + self.isolation + self.store
    }

    /// How much longer than the evaluation the job held its slice.
    pub fn slice_overhead(&self) -> Duration {
        self.lease + self.isolation + self.release
    }
}

fn between(a: Option<DateTime<Utc>>, b: Option<DateTime<Utc>>) -> Duration {
    match (a, b) {
        (Some(a), Some(b)) => (b - a).to_std().unwrap_or_default(),
        _ => Duration::ZERO,
    }
}

impl Timings {
    /// The phases, for a job that got to the end (zero for the parts it did not reach).
    pub fn phases(&self) -> Phases {
        // Without runs (a refused payload) the evaluation is empty and ends with the command.
        let (start, end) = match (self.eval_start, self.eval_end) {
            (Some(s), Some(e)) => (Some(s), Some(e)),
            _ => (self.command_done, self.command_done),
        };
        Phases {
            queue: between(self.accepted, self.dequeued),
            lease: between(self.dequeued, self.leased),
            isolation: between(self.leased, start),
            evaluation: between(start, end),
            store: between(end, self.stored),
            release: between(end, self.cleaned),
        }
    }

    /// Takes the evaluation's span from a `result.json`: the earliest `start` and the latest
    /// `end` among its runs.
    pub fn note_result(&mut self, result_json: &str) {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(result_json) else {
            return;
        };
        let parse = |s: &serde_json::Value| {
            s.as_str()
                .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
                .map(|t| t.with_timezone(&Utc))
        };
        for run in v["runs"].as_object().into_iter().flat_map(|m| m.values()) {
            if let Some(s) = parse(&run["start"]) {
                self.eval_start = Some(self.eval_start.map_or(s, |e| e.min(s)));
            }
            if let Some(e) = parse(&run["end"]) {
                self.eval_end = Some(self.eval_end.map_or(e, |x| x.max(e)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_split_the_jobs_time_and_overhead_excludes_the_runs() {
        let t0 = DateTime::parse_from_rfc3339("2026-01-01T00:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let ms = |n: i64| Some(t0 + chrono::Duration::milliseconds(n));
        let mut t = Timings {
            accepted: ms(0),
            dequeued: ms(100),
            leased: ms(105),
            command_done: ms(600),
            cleaned: ms(604),
            stored: ms(610),
            ..Timings::default()
        };
        t.note_result(
            r#"{"runs":{"test":{"start":"2026-01-01T00:00:00.110000+00:00","end":"2026-01-01T00:00:00.300000+00:00"},
                        "benchmark":{"start":"2026-01-01T00:00:00.310000+00:00","end":"2026-01-01T00:00:00.590000+00:00"}}}"#,
        );
        let p = t.phases();
        assert_eq!(p.queue, Duration::from_millis(100));
        assert_eq!(p.lease, Duration::from_millis(5));
        assert_eq!(p.isolation, Duration::from_millis(5));
        assert_eq!(p.evaluation, Duration::from_millis(480));
        assert_eq!(p.store, Duration::from_millis(20));
        assert_eq!(p.overhead(), Duration::from_millis(30));
        assert_eq!(p.release, Duration::from_millis(14));
        assert_eq!(p.slice_overhead(), Duration::from_millis(24));
        // No runs: the evaluation is empty and the command's end stands in.
        let mut none = t.clone();
        none.eval_start = None;
        none.eval_end = None;
        assert_eq!(none.phases().evaluation, Duration::ZERO);
        assert_eq!(none.phases().store, Duration::from_millis(10));
    }
}
