//! A submission's state machine, as a plain value: it serializes to the API's JSON and back,
//! so a durable store can keep and reload it unchanged.
//!
//! States only move forward (`queued` → `scheduled` → `running` → `fetching` → terminal), and a
//! terminal submission never changes again. That one rule is what makes duplicate and
//! out-of-order webhooks harmless.

use chrono::{DateTime, SecondsFormat, SubsecRound, Utc};
use serde::{Deserialize, Serialize};

use crate::fairshare::Class;
use crate::result::ResultJson;
use kernelkite_sys::provenance::Provenance;

/// Where a submission is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Accepted; the build is being created.
    Queued,
    /// Buildkite created the build; it waits for an agent.
    Scheduled,
    /// The build runs.
    Running,
    /// The build finished; result.json is being downloaded and checked.
    Fetching,
    /// Ended with a checked result (which may itself report a failed evaluation).
    Succeeded,
    /// Ended without a usable result; `error` says why.
    Failed,
    /// Canceled through `POST /v1/submissions/{id}/cancel`.
    Canceled,
    /// No result within the submission's `timeout_s`; its build was canceled.
    TimedOut,
}

impl State {
    /// Ended: the submission never changes again.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            State::Succeeded | State::Failed | State::Canceled | State::TimedOut
        )
    }

    fn rank(self) -> u8 {
        match self {
            State::Queued => 0,
            State::Scheduled => 1,
            State::Running => 2,
            State::Fetching => 3,
            State::Succeeded | State::Failed | State::Canceled | State::TimedOut => 4,
        }
    }

    /// The state's name in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Queued => "queued",
            State::Scheduled => "scheduled",
            State::Running => "running",
            State::Fetching => "fetching",
            State::Succeeded => "succeeded",
            State::Failed => "failed",
            State::Canceled => "canceled",
            State::TimedOut => "timed_out",
        }
    }
}

/// The Buildkite build behind a submission.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildInfo {
    /// Buildkite's build UUID; webhooks are matched on it.
    pub id: String,
    /// The build's number, as people see it.
    pub number: u64,
    /// Where people see the build.
    pub web_url: String,
}

/// One state change, with the time it happened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transition {
    /// The state entered.
    pub state: State,
    /// When.
    #[serde(with = "iso")]
    pub at: DateTime<Utc>,
}

/// A submission: what the API returns, and all a durable store must keep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Submission {
    /// Its id (a UUID).
    pub id: String,
    /// Where it is.
    pub state: State,
    /// The machines it runs on.
    pub queue: String,
    /// The backend's run id, as given.
    pub run_id: Option<String>,
    /// Where the finished submission is POSTed.
    pub callback_url: Option<String>,
    /// Seconds it may take.
    pub timeout_s: u64,
    /// Its build, once created.
    pub build: Option<BuildInfo>,
    /// The runner's `result.json`, verbatim.
    pub result: Option<ResultJson>,
    /// Why it failed, was canceled or timed out.
    pub error: Option<String>,
    /// When it was accepted.
    #[serde(with = "iso")]
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    #[serde(with = "iso")]
    pub updated_at: DateTime<Utc>,
    /// When it ended.
    #[serde(with = "iso_opt")]
    pub finished_at: Option<DateTime<Utc>>,
    /// Every state this submission has been in, in order; SSE replays it.
    pub history: Vec<Transition>,
    /// The backend's user id (fair share and quotas count per user; none: one shared
    /// anonymous user).
    #[serde(default)]
    pub user: Option<String>,
    /// Its priority class.
    #[serde(default)]
    pub priority: Class,
    /// Answered from the result cache: the submission whose result this is.
    #[serde(default)]
    pub cached_from: Option<String>,
    /// Where and on what its run ran, as the node reported it (`provenance.json`).
    #[serde(default)]
    pub provenance: Option<Provenance>,
    /// A canary: the slice it measures (`crate::fleet`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<String>,
    /// Its place in the service's queue, while it waits there (never kept in the store: it
    /// is recomputed as the queue moves).
    #[serde(default)]
    pub place: Option<Place>,
}

/// A waiting submission's place in its queue.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Place {
    /// 1: it starts next.
    pub position: u64,
    /// Seconds from when the place was computed until it is expected to start (from the
    /// queue's recent run times). Written out as the seconds left when it is sent, so a
    /// place read long after it was computed does not overstate the wait.
    pub estimated_wait_s: f64,
    /// When it is expected to start.
    #[serde(with = "iso")]
    pub estimated_start_at: DateTime<Utc>,
}

impl Serialize for Place {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let left_ms = (self.estimated_start_at - Utc::now())
            .num_milliseconds()
            .max(0);
        let mut out = s.serialize_struct("Place", 3)?;
        out.serialize_field("position", &self.position)?;
        out.serialize_field(
            "estimated_wait_s",
            &((left_ms as f64 / 100.0).round() / 10.0),
        )?;
        out.serialize_field(
            "estimated_start_at",
            &self
                .estimated_start_at
                .to_rfc3339_opts(SecondsFormat::Micros, true),
        )?;
        out.end()
    }
}

impl Place {
    /// Whether `new` says something `old` did not: another position, or a start estimate
    /// that moved by 5 s or a fifth of the wait, whichever is more (an estimate that only
    /// drifts is not news: runs that overrun move every estimate a little at each refresh).
    pub fn moved(old: Option<&Place>, new: Option<&Place>) -> bool {
        match (old, new) {
            (None, None) => false,
            (Some(a), Some(b)) => {
                let shift = (a.estimated_start_at - b.estimated_start_at).num_milliseconds();
                let enough = (a.estimated_wait_s * 200.0).max(5_000.0);
                a.position != b.position || shift.abs() as f64 >= enough
            }
            _ => true,
        }
    }
}

/// How a submission ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// With this result.
    Succeeded(ResultJson),
    /// Without a result, for this reason.
    Failed(String),
    /// Canceled, for this reason.
    Canceled(String),
    /// Out of time.
    TimedOut(String),
}

impl Submission {
    /// When it must have ended, unix ms: its creation plus its timeout.
    pub fn deadline_ms(&self) -> i64 {
        self.created_at
            .timestamp_millis()
            .saturating_add(i64::try_from(self.timeout_s.saturating_mul(1000)).unwrap_or(i64::MAX))
    }

    /// How long it ran: from `running` to its end (`None` before it ended, or when it never
    /// ran: a cache answer, one canceled in the queue). What the queue's estimates learn from.
    /// At most its `timeout_s`: an end seen only after the service was down (recovery
    /// collects it) would otherwise count the outage as run time.
    pub fn ran(&self) -> Option<std::time::Duration> {
        let start = self.history.iter().find(|t| t.state == State::Running)?.at;
        let took = (self.finished_at? - start).to_std().ok()?;
        Some(took.min(std::time::Duration::from_secs(self.timeout_s)))
    }

    /// A new submission, `queued`.
    pub fn new(
        id: String,
        queue: String,
        run_id: Option<String>,
        callback_url: Option<String>,
        timeout_s: u64,
        now: DateTime<Utc>,
    ) -> Submission {
        let now = now.trunc_subsecs(6);
        Submission {
            id,
            state: State::Queued,
            queue,
            run_id,
            callback_url,
            timeout_s,
            build: None,
            result: None,
            error: None,
            created_at: now,
            updated_at: now,
            finished_at: None,
            history: vec![Transition {
                state: State::Queued,
                at: now,
            }],
            user: None,
            priority: Class::Test,
            cached_from: None,
            provenance: None,
            canary: None,
            place: None,
        }
    }

    /// Moves to a non-terminal `to` if that is forward; returns whether anything changed.
    pub fn advance(&mut self, to: State, now: DateTime<Utc>) -> bool {
        if to.is_terminal() || self.state.is_terminal() || to.rank() <= self.state.rank() {
            return false;
        }
        self.set_state(to, now);
        true
    }

    /// Ends the submission; a no-op (false) when it already ended.
    pub fn finish(&mut self, outcome: Outcome, now: DateTime<Utc>) -> bool {
        if self.state.is_terminal() {
            return false;
        }
        let (state, result, error) = match outcome {
            Outcome::Succeeded(r) => (State::Succeeded, Some(r), None),
            Outcome::Failed(e) => (State::Failed, None, Some(e)),
            Outcome::Canceled(e) => (State::Canceled, None, Some(e)),
            Outcome::TimedOut(e) => (State::TimedOut, None, Some(e)),
        };
        self.result = result;
        self.error = error;
        self.finished_at = Some(now.trunc_subsecs(6));
        self.set_state(state, now);
        true
    }

    /// Records the build once; a second, different build is refused (false).
    pub fn attach_build(&mut self, build: BuildInfo, now: DateTime<Utc>) -> bool {
        match &self.build {
            Some(b) => b == &build,
            None => {
                self.build = Some(build);
                self.place = None;
                self.updated_at = now.trunc_subsecs(6);
                // The create response means Buildkite has the build; it is at least scheduled.
                self.advance(State::Scheduled, now);
                true
            }
        }
    }

    /// Times are kept to the microsecond, which is what the JSON form holds, so a value
    /// survives a round trip through a store unchanged.
    fn set_state(&mut self, state: State, now: DateTime<Utc>) {
        let now = now.trunc_subsecs(6);
        self.state = state;
        self.updated_at = now;
        // A place is only had while waiting in the service's queue.
        self.place = None;
        self.history.push(Transition { state, at: now });
    }
}

/// Timestamps as RFC 3339 with microseconds and `Z`.
pub(crate) mod iso {
    use super::*;
    pub fn serialize<S: serde::Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&t.to_rfc3339_opts(SecondsFormat::Micros, true))
    }
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<DateTime<Utc>, D::Error> {
        let s = String::deserialize(d)?;
        DateTime::parse_from_rfc3339(&s)
            .map(|t| t.with_timezone(&Utc))
            .map_err(serde::de::Error::custom)
    }
}

pub(crate) mod iso_opt {
    use super::*;
    pub fn serialize<S: serde::Serializer>(
        t: &Option<DateTime<Utc>>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => iso::serialize(t, s),
            None => s.serialize_none(),
        }
    }
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Option<DateTime<Utc>>, D::Error> {
        let s = Option::<String>::deserialize(d)?;
        s.map(|s| {
            DateTime::parse_from_rfc3339(&s)
                .map(|t| t.with_timezone(&Utc))
                .map_err(serde::de::Error::custom)
        })
        .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sub() -> Submission {
        Submission::new("s".into(), "h100".into(), None, None, 60, Utc::now())
    }

    #[test]
    fn a_run_time_is_from_running_to_the_end_and_at_most_the_timeout() {
        let t0 = Utc::now();
        let mut s = sub();
        assert_eq!(s.ran(), None, "not ended");
        s.advance(State::Running, t0 + chrono::Duration::seconds(5));
        s.finish(
            Outcome::Failed("x".into()),
            t0 + chrono::Duration::seconds(45),
        );
        assert_eq!(s.ran(), Some(std::time::Duration::from_secs(40)));
        // An end seen two hours late (the service was down): the timeout, not the outage.
        let mut late = sub();
        late.advance(State::Running, t0);
        late.finish(Outcome::Failed("x".into()), t0 + chrono::Duration::hours(2));
        assert_eq!(late.ran(), Some(std::time::Duration::from_secs(60)));
        let mut never = sub();
        never.finish(Outcome::Canceled("in the queue".into()), t0);
        assert_eq!(never.ran(), None, "never ran");
    }

    #[test]
    fn states_only_move_forward() {
        let mut s = sub();
        assert!(s.advance(State::Running, Utc::now()));
        assert!(
            !s.advance(State::Scheduled, Utc::now()),
            "a late build.scheduled must not move running back"
        );
        assert!(s.advance(State::Fetching, Utc::now()));
        assert!(!s.advance(State::Fetching, Utc::now()));
        assert_eq!(s.state, State::Fetching);
    }

    #[test]
    fn terminal_never_changes() {
        let mut s = sub();
        assert!(s.finish(Outcome::Failed("boom".into()), Utc::now()));
        assert!(!s.finish(Outcome::Canceled("late".into()), Utc::now()));
        assert!(!s.advance(State::Running, Utc::now()));
        assert_eq!((s.state, s.error.as_deref()), (State::Failed, Some("boom")));
        assert_eq!(s.history.len(), 2);
        assert!(s.finished_at.is_some());
    }

    #[test]
    fn round_trips_as_json() {
        let mut s = sub();
        s.attach_build(
            BuildInfo {
                id: "b".into(),
                number: 7,
                web_url: "w".into(),
            },
            Utc::now(),
        );
        let json = serde_json::to_string(&s).unwrap();
        let back: Submission = serde_json::from_str(&json).unwrap();
        assert_eq!(back, s);
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["state"], "scheduled");
        assert_eq!(v["build"]["number"], 7);
        assert!(v["result"].is_null() && v["error"].is_null() && v["finished_at"].is_null());
    }

    fn arb_state() -> impl Strategy<Value = State> {
        prop_oneof![
            Just(State::Queued),
            Just(State::Scheduled),
            Just(State::Running),
            Just(State::Fetching),
        ]
    }

    proptest! {
        /// Any interleaving of events leaves a history that never goes backwards and at most
        /// one terminal entry, which is the last.
        #[test]
        fn any_event_order_keeps_history_monotonic(events in proptest::collection::vec((arb_state(), any::<bool>()), 0..20)) {
            let mut s = sub();
            for (st, fin) in events {
                if fin { s.finish(Outcome::Failed("x".into()), Utc::now()); } else { s.advance(st, Utc::now()); }
            }
            let ranks: Vec<u8> = s.history.iter().map(|t| t.state.rank()).collect();
            prop_assert!(ranks.windows(2).all(|w| w[0] < w[1]));
            prop_assert_eq!(s.history.last().map(|t| t.state), Some(s.state));
        }
    }
}
