//! What the fleet dashboard shows (`GET /v1/fleet`): every queue (waiting, running, slots,
//! estimated waits, per-class and per-user counts, cache and quota figures), every slice
//! (connected, busy, idle, offline, quarantined; its GPU's last readings, its canary trend,
//! its versions) and the last failures that were not the contestant's fault, by node.
//!
//! A plain value built from the core's parts in one pass; the HTTP layer serializes it, and
//! streams it again whenever it changes.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{SecondsFormat, TimeZone, Utc};
use serde::Serialize;

use crate::app::App;
use crate::executor::{AgentCounts, AgentInfo};
use crate::fleet::{CanaryRun, FailureNote, Quarantine, SliceDoc};
use crate::metrics::{QueueLabel, QuotaLabel};

/// Canary ratios kept in a slice's trend.
const TREND: usize = 20;
/// Users listed per queue (the most active).
const TOP_USERS: usize = 10;

/// The whole fleet.
#[derive(Debug, Clone, Serialize)]
pub struct Overview {
    /// When it was read.
    pub generated_at: String,
    /// Whether canaries run.
    pub canaries: bool,
    /// A canary slower than its model's median by more than this share fails.
    pub canary_slower_by: f64,
    /// The runner version every slice should run (KERNELKITE_RUNNER_VERSION).
    pub expected_version: Option<String>,
    /// Counts over the fleet.
    pub totals: Totals,
    /// Every queue.
    pub queues: Vec<QueueView>,
    /// Every slice, by id.
    pub slices: Vec<SliceView>,
    /// The last failures that were not the contestant's fault, by node (`unknown`: the run
    /// named none).
    pub failures: Vec<NodeFailures>,
}

/// Counts over the fleet.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Totals {
    /// Slices known.
    pub slices: u64,
    /// Connected now.
    pub connected: u64,
    /// Running a job.
    pub busy: u64,
    /// Connected and idle.
    pub idle: u64,
    /// Known but not connected.
    pub offline: u64,
    /// Ranking no run.
    pub quarantined: u64,
    /// Running another runner version than the one expected.
    pub outdated: u64,
    /// Submissions waiting in the service's queues.
    pub waiting: u64,
    /// Submissions started and not ended.
    pub running: u64,
}

/// One queue.
#[derive(Debug, Clone, Serialize)]
pub struct QueueView {
    /// Its name.
    pub queue: String,
    /// Waiting in the service's queue.
    pub waiting: u64,
    /// Started, not ended.
    pub running: u64,
    /// Its slots (`None`: not limited).
    pub slots: Option<u64>,
    /// Mean of its recent runs, seconds.
    pub estimated_run_s: f64,
    /// When a new `test` submission would start, seconds.
    pub estimated_wait_s: f64,
    /// Waiting or running, by class.
    pub by_class: BTreeMap<String, u64>,
    /// The users with the most waiting or running, most first.
    pub top_users: Vec<UserCount>,
    /// Users with anything waiting or running.
    pub users: u64,
    /// Its agents, as last counted.
    pub agents: Option<AgentCounts>,
    /// Answers from the result cache since the service started.
    pub cache_hits: u64,
    /// Submissions refused by a quota since the service started.
    pub quota_refusals: u64,
}

/// A user's open submissions on a queue.
#[derive(Debug, Clone, Serialize)]
pub struct UserCount {
    /// The user (`(anonymous)` for none).
    pub user: String,
    /// Waiting or running.
    pub open: u64,
}

/// One slice.
#[derive(Debug, Clone, Serialize)]
pub struct SliceView {
    /// Its id (the agent's name).
    pub id: String,
    /// `busy`, `idle`, `offline`, `quarantined` or `unknown` (no roster to tell).
    pub state: &'static str,
    /// The queue it serves.
    pub queue: Option<String>,
    /// Its node.
    pub node: Option<String>,
    /// Its number on the node.
    pub index: Option<u32>,
    /// Its GPU model.
    pub model: Option<String>,
    /// Its GPU's UUID.
    pub gpu_uuid: Option<String>,
    /// The driver its last run saw.
    pub driver: Option<String>,
    /// The runner version its last run saw.
    pub kernelkite_version: Option<String>,
    /// The Buildkite agent's version, when listed.
    pub agent_version: Option<String>,
    /// Its image (docker mode).
    pub image: Option<String>,
    /// The runner version its last run named, when not the one expected.
    pub outdated: Option<String>,
    /// Paused in Buildkite.
    pub paused: bool,
    /// Runs it finished.
    pub runs: u64,
    /// When its last run ended.
    pub last_run_at: Option<String>,
    /// Its GPU's temperature at the end of its last run, °C.
    pub temperature_c: Option<u32>,
    /// Its SM clock then, MHz.
    pub sm_clock_mhz: Option<u32>,
    /// Its power limit then, W.
    pub power_limit_w: Option<f64>,
    /// What its last run's readings said may be unhealthy.
    pub concerns: Vec<String>,
    /// Its last canaries' ratios to their model's median, oldest first.
    pub canary_trend: Vec<f64>,
    /// Its last canary.
    pub canary: Option<CanaryRun>,
    /// A canary is in flight.
    pub canary_pending: bool,
    /// Why it ranks no run.
    pub quarantine: Option<Quarantine>,
    /// Its failures kept.
    pub failures: u64,
}

/// A node's recent failures.
#[derive(Debug, Clone, Serialize)]
pub struct NodeFailures {
    /// The node (`unknown` when the run named none).
    pub node: String,
    /// Its failures, newest first, each with its slice.
    pub failures: Vec<PlacedFailure>,
}

/// A failure and the slice it was on.
#[derive(Debug, Clone, Serialize)]
pub struct PlacedFailure {
    /// The slice (none: unknown).
    pub slice: Option<String>,
    /// The failure.
    #[serde(flatten)]
    pub note: FailureNote,
}

/// A wait to the second under a minute, to ten seconds under an hour, to the minute after.
fn coarse(s: f64) -> f64 {
    let step = if s < 60.0 {
        1.0
    } else if s < 3600.0 {
        10.0
    } else {
        60.0
    };
    (s / step).round() * step
}

fn iso_ms(ms: i64) -> Option<String> {
    Utc.timestamp_millis_opt(ms)
        .single()
        .map(|t| t.to_rfc3339_opts(SecondsFormat::Millis, true))
}

impl App {
    /// The fleet as the dashboard shows it, now.
    pub fn overview(&self) -> Overview {
        self.fleet.note_read(Utc::now().timestamp_millis());
        let slices = self.fleet.slices();
        let (roster, connected) = self.fleet.roster();
        let mut totals = Totals::default();
        let views = slice_views(&slices, &roster, connected.as_ref());
        for v in &views {
            totals.slices += 1;
            match v.state {
                "busy" => totals.busy += 1,
                "idle" => totals.idle += 1,
                "offline" => totals.offline += 1,
                _ => {}
            }
            if v.quarantine.is_some() {
                totals.quarantined += 1;
            }
            if v.outdated.is_some() {
                totals.outdated += 1;
            }
        }
        totals.connected = connected.as_ref().map_or(0, |c| c.len() as u64);
        let mut names: BTreeSet<String> = self.dispatch.lines().into_iter().collect();
        names.extend(slices.iter().filter_map(|s| s.queue.clone()));
        names.extend(roster.iter().filter_map(|a| a.queue.clone()));
        let queues: Vec<QueueView> = names.iter().map(|q| self.queue_view(q, &roster)).collect();
        for q in &queues {
            totals.waiting += q.waiting;
            totals.running += q.running;
        }
        Overview {
            generated_at: Utc::now().to_rfc3339_opts(SecondsFormat::Millis, true),
            canaries: self.fleet.schedule().enabled,
            canary_slower_by: self.fleet.schedule().slower_by,
            expected_version: self.fleet.expected_version().map(str::to_string),
            totals,
            queues,
            failures: failures_by_node(&slices, self.fleet.unplaced_failures()),
            slices: views,
        }
    }

    /// Every slice as the overview shows it (without the queues).
    pub fn overview_slices(&self) -> Vec<SliceView> {
        let (roster, connected) = self.fleet.roster();
        slice_views(&self.fleet.slices(), &roster, connected.as_ref())
    }

    fn queue_view(&self, queue: &str, roster: &[AgentInfo]) -> QueueView {
        let line = self.dispatch.status(queue, self.capacity(queue));
        let mut by_class: BTreeMap<String, u64> = BTreeMap::new();
        let mut by_user: BTreeMap<String, u64> = BTreeMap::new();
        for (class, user, n) in self.dispatch.open_by(queue) {
            *by_class.entry(class.as_str().to_string()).or_default() += n;
            *by_user.entry(user).or_default() += n;
        }
        let users = by_user.len() as u64;
        let mut top: Vec<UserCount> = by_user
            .into_iter()
            .map(|(user, open)| UserCount {
                user: if user.is_empty() {
                    "(anonymous)".into()
                } else {
                    user
                },
                open,
            })
            .collect();
        top.sort_by(|a, b| b.open.cmp(&a.open).then(a.user.cmp(&b.user)));
        top.truncate(TOP_USERS);
        let mine: Vec<&AgentInfo> = roster
            .iter()
            .filter(|a| a.queue.as_deref() == Some(queue))
            .collect();
        let agents = (!roster.is_empty()).then(|| AgentCounts {
            busy: mine.iter().filter(|a| a.busy).count() as u64,
            idle: mine.iter().filter(|a| !a.busy).count() as u64,
            total: mine.len() as u64,
        });
        let label = QueueLabel {
            queue: queue.to_string(),
        };
        let refused: u64 = ["queued", "hourly"]
            .iter()
            .map(|limit| {
                self.metrics
                    .quota_refusals
                    .get_or_create(&QuotaLabel {
                        queue: queue.to_string(),
                        limit: limit.to_string(),
                    })
                    .get()
            })
            .sum();
        QueueView {
            queue: queue.to_string(),
            waiting: line.waiting,
            running: line.started,
            slots: line.slots,
            estimated_run_s: line.estimated_run_s,
            // Coarse past a minute, so the overview does not change (and every open page is
            // not sent it again) only because time passed.
            estimated_wait_s: coarse(line.estimated_wait_s),
            by_class,
            top_users: top,
            users,
            agents,
            cache_hits: self.metrics.cache_hits.get_or_create(&label).get(),
            quota_refusals: refused,
        }
    }
}

/// Every record as the overview shows it, each beside its agent in the roster.
fn slice_views(
    slices: &[SliceDoc],
    roster: &[AgentInfo],
    connected: Option<&BTreeSet<String>>,
) -> Vec<SliceView> {
    let by_name: BTreeMap<&str, &AgentInfo> = roster.iter().map(|a| (a.name.as_str(), a)).collect();
    slices
        .iter()
        .map(|d| slice_view(d, by_name.get(d.id.as_str()).copied(), connected))
        .collect()
}

fn slice_view(
    d: &SliceDoc,
    agent: Option<&AgentInfo>,
    connected: Option<&BTreeSet<String>>,
) -> SliceView {
    let state = match (d.quarantine.is_some(), connected, agent) {
        (true, _, _) => "quarantined",
        (false, None, _) => "unknown",
        (false, Some(c), _) if !c.contains(&d.id) => "offline",
        (false, Some(_), Some(a)) if a.busy => "busy",
        (false, Some(_), _) => "idle",
    };
    let sample = d.last_sample.as_ref();
    let trend: Vec<f64> = d
        .canaries
        .iter()
        .filter_map(|c| c.ratio)
        .rev()
        .take(TREND)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    SliceView {
        id: d.id.clone(),
        state,
        queue: d
            .queue
            .clone()
            .or_else(|| agent.and_then(|a| a.queue.clone())),
        node: d
            .node
            .clone()
            .or_else(|| agent.and_then(|a| a.node.clone())),
        index: d.index,
        model: d.model.clone(),
        gpu_uuid: d.gpu_uuid.clone(),
        driver: d.driver.clone(),
        kernelkite_version: d.kernelkite_version.clone(),
        agent_version: agent.and_then(|a| a.version.clone()),
        image: d.image.clone(),
        outdated: d.outdated.clone(),
        paused: agent.is_some_and(|a| a.paused),
        runs: d.runs,
        last_run_at: d.last_run_ms.and_then(iso_ms),
        temperature_c: sample.and_then(|s| s.temperature_c),
        sm_clock_mhz: sample.and_then(|s| s.sm_clock_mhz),
        power_limit_w: sample.and_then(|s| s.power_limit_w),
        concerns: d.concerns.clone(),
        canary_trend: trend,
        canary: d.canaries.back().cloned(),
        canary_pending: d.canary_pending.is_some(),
        quarantine: d.quarantine.clone(),
        failures: d.failures.len() as u64,
    }
}

fn failures_by_node(slices: &[SliceDoc], unplaced: Vec<FailureNote>) -> Vec<NodeFailures> {
    let mut by: BTreeMap<String, Vec<PlacedFailure>> = BTreeMap::new();
    for s in slices {
        for f in &s.failures {
            by.entry(s.node.clone().unwrap_or_else(|| "unknown".into()))
                .or_default()
                .push(PlacedFailure {
                    slice: Some(s.id.clone()),
                    note: f.clone(),
                });
        }
    }
    for f in unplaced {
        by.entry("unknown".into()).or_default().push(PlacedFailure {
            slice: None,
            note: f,
        });
    }
    let mut out: Vec<NodeFailures> = by
        .into_iter()
        .map(|(node, mut failures)| {
            failures.sort_by_key(|f| std::cmp::Reverse(f.note.at_ms));
            NodeFailures { node, failures }
        })
        .collect();
    // The node with the most recent failure first.
    out.sort_by_key(|n| std::cmp::Reverse(n.failures.first().map_or(0, |f| f.note.at_ms)));
    out
}
