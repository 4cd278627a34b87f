//! The fleet as the service sees it: every slice (an agent, in Buildkite's words) that ran a
//! job or is connected, with what its last run said of it (the node's provenance), its canary
//! history, its quarantine and its recent failures that were not the contestant's fault.
//!
//! A slice's record ([`SliceDoc`]) is kept in the store (one JSON document per slice), so a
//! restart or a take-over keeps canary histories and quarantines. The fleet decides, the core
//! acts: [`Fleet::ended`] reads a submission's end into its slice's record and answers what to
//! save and what to tell (quarantines and releases, for the alerts); [`Fleet::held_back`] is
//! what an executor asks before it starts a ranked run on a slice; [`Fleet::due_canaries`]
//! says which slices need a canary now.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::canary::{self, Schedule, Verdict};
use crate::executor::AgentInfo;
use crate::fairshare::Class;
use crate::submission::{State, Submission};
use kernelkite_sys::provenance::{Provenance, Sample};

/// The user canaries are submitted as (fair share counts them apart from everyone's).
pub const CANARY_USER: &str = "kernelkite-canary";

/// Canaries kept per slice.
const CANARIES_KEPT: usize = 20;
/// Failures kept per slice, and for runs that named no slice.
const FAILURES_KEPT: usize = 10;
/// Ranked runs remembered per slice since its last passing canary (flagged for a re-run when
/// it is quarantined).
const RANKED_KEPT: usize = 200;
/// A quarantined slice's first canary after the one that put it there, ms.
const RECHECK_MS: i64 = 600_000;

/// A slice gone from the roster this long, with no run since and no quarantine, is retired (a
/// node given back, repartitioned, renamed): its record is dropped, so the dashboard shows the
/// fleet as it is. A quarantined one stays: its runs to run again matter until it is released.
pub const FORGET_AFTER_MS: i64 = 7 * 24 * 3600 * 1000;

/// One slice's record.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SliceDoc {
    /// The slice's id: its agent's name (`dgx01-gpu3`; local mode `local-<host>-<n>`), or
    /// `<node>/slice-<n>` when the run named no agent.
    pub id: String,
    /// The queue it serves.
    pub queue: Option<String>,
    /// Its node's host name.
    pub node: Option<String>,
    /// The slice's number on its node.
    pub index: Option<u32>,
    /// Its GPU model (`cpu` for a CPU-only slice): canaries are compared within a model.
    pub model: Option<String>,
    /// Its GPU's UUID (or MIG device / partition).
    pub gpu_uuid: Option<String>,
    /// The GPU driver its last run saw.
    pub driver: Option<String>,
    /// The runner's (kernelkite's) version its last run saw.
    pub kernelkite_version: Option<String>,
    /// The image its last run ran in (docker mode).
    pub image: Option<String>,
    /// When the service first saw it, Unix ms.
    pub first_seen_ms: i64,
    /// When its last run ended.
    pub last_run_ms: Option<i64>,
    /// Its GPU's state at the end of its last run.
    pub last_sample: Option<Sample>,
    /// Runs it finished (canaries apart).
    pub runs: u64,
    /// Runs since its last canary.
    pub runs_since_canary: u64,
    /// What its last run's readings said may be unhealthy.
    pub concerns: Vec<String>,
    /// Of those, the hardware faults a run cannot cause (`Provenance::faults`): only these
    /// quarantine a slice without a canary.
    pub faults: Vec<String>,
    /// Canaries in a row that did not pass (a quarantined slice's next one waits longer
    /// after each).
    pub canary_failures: u32,
    /// Ranked runs to run again that a release took out of their quarantine (kept for the
    /// organisers, newest last).
    pub rerun: VecDeque<String>,
    /// The runner version its last run named, when it is not the one expected.
    pub outdated: Option<String>,
    /// Its last canaries, oldest first.
    pub canaries: VecDeque<CanaryRun>,
    /// The canary submission in flight for it.
    pub canary_pending: Option<String>,
    /// An operator (or the fleet, after a health concern) asked for a canary.
    pub canary_requested: bool,
    /// Why it ranks no run now.
    pub quarantine: Option<Quarantine>,
    /// Its last failures that were not the contestant's fault, oldest first.
    pub failures: VecDeque<FailureNote>,
    /// Ranked runs that ended on it since its last passing canary.
    pub ranked_since_canary: VecDeque<String>,
    /// When the roster last listed it (this process's memory only: after a restart, a slice
    /// counts as seen at the first look).
    #[serde(skip)]
    pub last_seen_ms: Option<i64>,
    /// Its vendor was told it went offline (and is told when it is back).
    pub offline_told: bool,
}

/// One canary of a slice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CanaryRun {
    /// When it ended, Unix ms.
    pub at_ms: i64,
    /// Its submission.
    pub submission: String,
    /// Its score (`None`: it did not measure).
    pub score: Option<f64>,
    /// Its score over its model's median then.
    pub ratio: Option<f64>,
    /// The verdict.
    #[serde(flatten)]
    pub verdict: Verdict,
    /// Why, for people.
    pub reason: String,
    /// How many other slices of its model had a score to compare it with (none: it was its
    /// own median, and it runs again once another slice of its model has one).
    #[serde(default)]
    pub peers: usize,
}

/// Why a slice ranks no run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// A canary failed.
    Canary,
    /// A run's GPU readings said the GPU was unhealthy.
    Health,
    /// An operator took it out.
    Operator,
}

/// A slice's quarantine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Quarantine {
    /// Since when, Unix ms.
    pub since_ms: i64,
    /// What put it there.
    pub cause: Cause,
    /// Why, for people.
    pub reason: String,
    /// The submission whose run showed it (a canary, or the run with the readings).
    pub evidence: Option<String>,
    /// Ranked runs that ended on the slice since its last passing canary: their timings may
    /// be off, and they should be run again.
    pub flagged: Vec<String>,
}

/// A failure that was not the contestant's fault.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailureNote {
    /// When, Unix ms.
    pub at_ms: i64,
    /// The submission.
    pub submission: String,
    /// Its queue.
    pub queue: String,
    /// How it ended (`failed`, `timed_out`, or `succeeded` with the runner's error).
    pub state: String,
    /// Why.
    pub error: String,
}

/// Something an operator or a vendor should hear of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Notice {
    /// The slice.
    pub slice: String,
    /// Its node, when known.
    pub node: Option<String>,
    /// What happened.
    pub kind: NoticeKind,
    /// In words.
    pub text: String,
}

/// What a [`Notice`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NoticeKind {
    /// The slice was quarantined.
    Quarantined,
    /// The slice was released.
    Released,
    /// The slice's agent has not been connected for the offline limit.
    Offline,
    /// The slice's agent is connected again after it was said offline.
    Online,
    /// The slice's last run named another runner version than the one expected.
    Outdated,
    /// The slice runs the expected version again.
    UpToDate,
}

/// What [`Fleet::ended`] changed.
#[derive(Debug, Default)]
pub struct Changes {
    /// Records to save.
    pub save: Vec<SliceDoc>,
    /// What to tell.
    pub notices: Vec<Notice>,
    /// Records to drop: retired slices ([`FORGET_AFTER_MS`]).
    pub forget: Vec<String>,
}

/// The fleet.
#[derive(Debug)]
pub struct Fleet {
    schedule: Schedule,
    /// A slice not connected this long is said offline, ms.
    offline_after_ms: i64,
    inner: Mutex<Inner>,
    /// Bumped on every change: the live dashboard waits on it.
    version: watch::Sender<u64>,
    /// When somebody last read the fleet (Unix ms): its roster is kept fresh meanwhile.
    read_at: std::sync::atomic::AtomicI64,
    /// The runner version every slice should run (`None`: not checked).
    expected: Option<String>,
}

#[derive(Debug, Default)]
struct Inner {
    slices: BTreeMap<String, SliceDoc>,
    /// Failures of runs that named no slice (no provenance came back).
    unplaced: VecDeque<FailureNote>,
    /// The agents connected at the last look (`None`: not known).
    connected: Option<BTreeSet<String>>,
    /// Busy agents at the last look.
    busy: BTreeSet<String>,
    /// The last roster, as the executor or Buildkite gave it.
    roster: Vec<AgentInfo>,
}

/// The id of the slice a run's provenance names.
pub fn slice_id(p: &Provenance) -> String {
    match (&p.agent, &p.slice) {
        (Some(a), _) if !a.is_empty() => a.clone(),
        (_, Some(s)) => format!("{}/slice-{}", p.node, s.index),
        _ => format!("{}/slice-?", p.node),
    }
}

/// Whether a submission's end is a failure that was not the contestant's: no result (the
/// build failed or timed out), or a result whose runner could not evaluate.
pub fn failure_of(sub: &Submission) -> Option<String> {
    match sub.state {
        State::Failed | State::TimedOut => Some(
            sub.error
                .clone()
                .unwrap_or_else(|| "no reason given".into()),
        ),
        State::Succeeded => {
            let r = sub.result.as_ref()?;
            if r.success() {
                return None;
            }
            let v: serde_json::Value = serde_json::from_str(r.get()).ok()?;
            Some(
                v["error"]
                    .as_str()
                    .unwrap_or("the runner could not evaluate")
                    .to_string(),
            )
        }
        _ => None,
    }
}

impl Fleet {
    /// An empty fleet, judging canaries by `schedule`, saying a slice offline once its agent
    /// was not connected for `offline_after_s`.
    pub fn new(schedule: Schedule, offline_after_s: u64) -> Fleet {
        Fleet {
            schedule,
            offline_after_ms: (offline_after_s as i64).saturating_mul(1000),
            inner: Mutex::new(Inner::default()),
            version: watch::channel(0).0,
            read_at: std::sync::atomic::AtomicI64::new(i64::MIN),
            expected: None,
        }
    }

    /// Checks every run's runner version against `version` (KERNELKITE_RUNNER_VERSION): a
    /// slice that runs another is marked outdated, and its vendor told.
    pub fn expecting(mut self, version: String) -> Fleet {
        self.expected = Some(version);
        self
    }

    /// The runner version every slice should run, when checked.
    pub fn expected_version(&self) -> Option<&str> {
        self.expected.as_deref()
    }

    /// Notes that somebody reads the fleet now.
    pub fn note_read(&self, now_ms: i64) {
        self.read_at
            .store(now_ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether somebody read the fleet in the last `ms`.
    pub fn read_within(&self, ms: i64) -> bool {
        let at = self.read_at.load(std::sync::atomic::Ordering::Relaxed);
        chrono::Utc::now().timestamp_millis().saturating_sub(at) <= ms
    }

    /// The canary schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// Changes as they happen (a counter): the dashboard's live updates.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    /// Takes the records the store kept (on start, or on taking the store over).
    pub fn load(&self, docs: Vec<SliceDoc>) {
        let mut inner = self.lock();
        // A slice recorded since start (a run recovery ended first) keeps its newer record.
        for d in docs {
            inner.slices.entry(d.id.clone()).or_insert(d);
        }
        drop(inner);
        self.bump();
    }

    /// Every slice's record, by id.
    pub fn slices(&self) -> Vec<SliceDoc> {
        self.lock().slices.values().cloned().collect()
    }

    /// Slice `id`'s record now.
    pub fn slice(&self, id: &str) -> Option<SliceDoc> {
        self.lock().slices.get(id).cloned()
    }

    /// Failures of runs that named no slice, oldest first.
    pub fn unplaced_failures(&self) -> Vec<FailureNote> {
        self.lock().unplaced.iter().cloned().collect()
    }

    /// The last roster and which of its agents are busy.
    pub fn roster(&self) -> (Vec<AgentInfo>, Option<BTreeSet<String>>) {
        let inner = self.lock();
        (inner.roster.clone(), inner.connected.clone())
    }

    /// The quarantined slices: why (what their agents' pauses say), and whether a canary is
    /// in flight for one (its agent must take it).
    pub fn quarantined(&self) -> BTreeMap<String, crate::pauses::Quarantined> {
        self.lock()
            .slices
            .values()
            .filter_map(|s| {
                let q = s.quarantine.as_ref()?;
                Some((
                    s.id.clone(),
                    crate::pauses::Quarantined {
                        reason: q.reason.clone(),
                        canary: s.canary_pending.is_some(),
                        requested: s.canary_requested,
                    },
                ))
            })
            .collect()
    }

    /// Whether slice `id` may not start a ranked run now (it is quarantined).
    pub fn held_back(&self, id: &str) -> bool {
        self.lock()
            .slices
            .get(id)
            .is_some_and(|s| s.quarantine.is_some())
    }

    /// Learns which agents are connected now (the executor's slices, or Buildkite's agents
    /// list): a new one gets a record (and so its first canary); one missing for the offline
    /// limit is said offline, and back when it returns. Returns what to save and tell.
    pub fn seen(&self, roster: Vec<AgentInfo>, now_ms: i64) -> Changes {
        let mut inner = self.lock();
        let mut save = Vec::new();
        let mut notices = Vec::new();
        for a in &roster {
            let doc = inner.slices.entry(a.name.clone()).or_insert_with(|| {
                let d = SliceDoc {
                    id: a.name.clone(),
                    first_seen_ms: now_ms,
                    ..SliceDoc::default()
                };
                save.push(d.clone());
                d
            });
            let mut changed = false;
            if doc.queue.is_none() && a.queue.is_some() {
                doc.queue = a.queue.clone();
                changed = true;
            }
            if doc.node.is_none() && a.node.is_some() {
                doc.node = a.node.clone();
                changed = true;
            }
            if changed {
                save.retain(|d| d.id != a.name);
                save.push(doc.clone());
            }
        }
        let connected: BTreeSet<String> = roster.iter().map(|a| a.name.clone()).collect();
        for doc in inner.slices.values_mut() {
            if connected.contains(&doc.id) {
                doc.last_seen_ms = Some(now_ms);
                if doc.offline_told {
                    doc.offline_told = false;
                    notices.push(Notice {
                        slice: doc.id.clone(),
                        node: doc.node.clone(),
                        kind: NoticeKind::Online,
                        text: format!("{} is connected again", doc.id),
                    });
                    save.push(doc.clone());
                }
                continue;
            }
            let since = *doc.last_seen_ms.get_or_insert(now_ms);
            if !doc.offline_told && now_ms.saturating_sub(since) >= self.offline_after_ms {
                doc.offline_told = true;
                notices.push(Notice {
                    slice: doc.id.clone(),
                    node: doc.node.clone(),
                    kind: NoticeKind::Offline,
                    text: format!(
                        "{} has not been connected for {} min",
                        doc.id,
                        now_ms.saturating_sub(since) / 60_000
                    ),
                });
                save.push(doc.clone());
            }
        }
        let busy = roster
            .iter()
            .filter(|a| a.busy)
            .map(|a| a.name.clone())
            .collect();
        let moved = inner.connected.as_ref() != Some(&connected) || inner.busy != busy;
        inner.connected = Some(connected);
        inner.busy = busy;
        inner.roster = roster;
        // Retired slices: gone a week (seen then, in this process), nothing since, not out.
        let forget: Vec<String> = inner
            .slices
            .values()
            .filter(|d| d.quarantine.is_none() && d.canary_pending.is_none())
            .filter(|d| {
                let last = d.last_seen_ms.into_iter().chain(d.last_run_ms).max();
                last.is_some_and(|t| now_ms.saturating_sub(t) >= FORGET_AFTER_MS)
            })
            .map(|d| d.id.clone())
            .collect();
        for id in &forget {
            tracing::info!(slice = %id, "a slice gone from the roster for a week is forgotten");
            inner.slices.remove(id);
        }
        save.retain(|d| !forget.contains(&d.id));
        drop(inner);
        if moved || !save.is_empty() || !forget.is_empty() {
            self.bump();
        }
        Changes {
            save,
            notices,
            forget,
        }
    }

    /// Reads an ended submission into its slice's record.
    pub fn ended(&self, sub: &Submission, now_ms: i64) -> Changes {
        let mut changes = Changes::default();
        let failure = failure_of(sub);
        // A canary that ran on another slice than its own (a node reusing another's name or
        // tags) judges neither: its slice may have a canary again, and nothing is concluded.
        if let (Some(c), Some(p)) = (&sub.canary, &sub.provenance) {
            if slice_id(p) != *c {
                tracing::warn!(slice = %c, ran_on = %slice_id(p), id = %sub.id, "a canary ran on another slice than the one it was pinned to; it judges neither");
                let mut inner = self.lock();
                if let Some(doc) = inner.slices.get_mut(c) {
                    if doc.canary_pending.as_deref() == Some(sub.id.as_str()) {
                        doc.canary_pending = None;
                        changes.save.push(doc.clone());
                    }
                }
                drop(inner);
                self.bump();
                return changes;
            }
        }
        let id = match (&sub.canary, &sub.provenance) {
            (Some(c), _) => c.clone(),
            (None, Some(p)) => slice_id(p),
            (None, None) => {
                if let Some(error) = failure {
                    let mut inner = self.lock();
                    push_capped(&mut inner.unplaced, note(sub, error, now_ms), FAILURES_KEPT);
                    drop(inner);
                    self.bump();
                }
                return changes;
            }
        };
        let mut inner = self.lock();
        let medians = model_scores(&inner.slices);
        let doc = inner.slices.entry(id.clone()).or_insert_with(|| SliceDoc {
            id: id.clone(),
            first_seen_ms: now_ms,
            ..SliceDoc::default()
        });
        if let Some(p) = &sub.provenance {
            absorb(doc, p, now_ms);
            if let Some(want) = &self.expected {
                check_version(doc, &p.kernelkite_version, want, &mut changes);
            }
        }
        if doc.queue.is_none() {
            doc.queue = Some(sub.queue.clone());
        }
        if sub.canary.is_some() {
            self.canary_ended(doc, sub, &medians, now_ms, &mut changes);
        } else {
            doc.runs += 1;
            doc.runs_since_canary += 1;
            if sub.priority == Class::Ranked && sub.state == State::Succeeded {
                push_capped(&mut doc.ranked_since_canary, sub.id.clone(), RANKED_KEPT);
            }
            if let Some(error) = failure {
                push_capped(&mut doc.failures, note(sub, error, now_ms), FAILURES_KEPT);
            }
            // A ranked run that ended on a quarantined slice (it started before the
            // quarantine) is as suspect as those before it.
            if sub.priority == Class::Ranked && sub.state == State::Succeeded {
                if let Some(q) = &mut doc.quarantine {
                    if q.flagged.len() < RANKED_KEPT && !q.flagged.contains(&sub.id) {
                        q.flagged.push(sub.id.clone());
                    }
                }
            }
            // Only where canaries run is a quarantine enforced and lifted by one (local mode,
            // for now): elsewhere the readings are shown, and decide nothing.
            if self.schedule.enabled {
                if !doc.faults.is_empty() && doc.quarantine.is_none() {
                    let reason = format!("its last run's GPU readings: {}", doc.faults.join("; "));
                    quarantine(
                        doc,
                        Cause::Health,
                        reason,
                        Some(sub.id.clone()),
                        now_ms,
                        &mut changes,
                    );
                    // A canary says when it is well again.
                    doc.canary_requested = true;
                } else if !doc.concerns.is_empty() {
                    // Heat or slowdowns a run can cause itself: a canary looks (it, not the
                    // run, decides).
                    doc.canary_requested = true;
                }
            }
        }
        changes.save.push(doc.clone());
        drop(inner);
        self.bump();
        changes
    }

    fn canary_ended(
        &self,
        doc: &mut SliceDoc,
        sub: &Submission,
        medians: &BTreeMap<String, Vec<(String, f64)>>,
        now_ms: i64,
        changes: &mut Changes,
    ) {
        doc.canary_pending = None;
        if sub.state == State::Canceled {
            // Not a verdict on the slice (the service stopped it, or an operator did): ask again.
            doc.canary_requested = true;
            return;
        }
        let measured = match (&sub.state, &sub.result) {
            (State::Succeeded, Some(r)) => canary::measure(r.get()),
            _ => Err(sub
                .error
                .clone()
                .unwrap_or_else(|| sub.state.as_str().to_string())),
        };
        let (verdict, score, ratio, reason, peers) = match measured {
            Ok(m) => {
                let model = doc.model.clone().unwrap_or_else(|| "cpu".into());
                // The latest score of every other slice of the model, and this one's new one.
                let mut latest: Vec<f64> = medians
                    .get(&model)
                    .into_iter()
                    .flatten()
                    .filter(|(other, _)| *other != doc.id)
                    .map(|(_, s)| *s)
                    .collect();
                let peers = latest.len();
                latest.push(m.score);
                let median = canary::median(&latest);
                // The spread is taken over the canaries that passed against peers, and this
                // one: a slow one had its verdict, and must not keep a mended slice out.
                let mut scores: Vec<f64> = doc
                    .canaries
                    .iter()
                    .filter(|c| c.verdict.passed() && c.peers > 0)
                    .filter_map(|c| c.score)
                    .collect();
                scores.push(m.score);
                let v = canary::judge(m.score, median, &scores, &doc.faults, &self.schedule);
                let reason = match &v {
                    Verdict::Unhealthy => {
                        format!("{}: {}", v.describe(&self.schedule), doc.faults.join("; "))
                    }
                    v => v.describe(&self.schedule),
                };
                (
                    v,
                    Some(m.score),
                    median.map(|md| m.score / md),
                    reason,
                    peers,
                )
            }
            Err(why) => (
                Verdict::Failed,
                None,
                None,
                format!("{}: {why}", Verdict::Failed.describe(&self.schedule)),
                0,
            ),
        };
        doc.runs_since_canary = 0;
        doc.canary_requested = false;
        let passed = verdict.passed();
        doc.canary_failures = if passed {
            0
        } else {
            doc.canary_failures.saturating_add(1)
        };
        push_capped(
            &mut doc.canaries,
            CanaryRun {
                at_ms: now_ms,
                submission: sub.id.clone(),
                score,
                ratio,
                verdict,
                reason: reason.clone(),
                peers,
            },
            CANARIES_KEPT,
        );
        if passed {
            doc.ranked_since_canary.clear();
            let releasable = doc
                .quarantine
                .as_ref()
                .is_some_and(|q| q.cause != Cause::Operator);
            if releasable {
                if let Some(q) = doc.quarantine.take() {
                    keep_reruns(doc, q.flagged);
                }
                changes.notices.push(Notice {
                    slice: doc.id.clone(),
                    node: doc.node.clone(),
                    kind: NoticeKind::Released,
                    text: format!("{} is back: {reason}", doc.id),
                });
            }
        } else if doc.quarantine.is_none() {
            quarantine(
                doc,
                Cause::Canary,
                reason,
                Some(sub.id.clone()),
                now_ms,
                changes,
            );
        }
    }

    /// An operator takes slice `id` out of ranking (`Some(reason)`), or puts it back
    /// (`None`). `Err`: no such slice.
    pub fn set_quarantine(
        &self,
        id: &str,
        reason: Option<String>,
        now_ms: i64,
    ) -> Result<Changes, UnknownSlice> {
        let mut changes = Changes::default();
        let mut inner = self.lock();
        let doc = inner
            .slices
            .get_mut(id)
            .ok_or_else(|| UnknownSlice(id.to_string()))?;
        match reason {
            Some(reason) => {
                let reason = format!("taken out by an operator: {reason}");
                match &mut doc.quarantine {
                    Some(q) => {
                        q.cause = Cause::Operator;
                        q.reason = reason;
                    }
                    None => quarantine(doc, Cause::Operator, reason, None, now_ms, &mut changes),
                }
            }
            None => {
                if let Some(q) = doc.quarantine.take() {
                    keep_reruns(doc, q.flagged);
                    changes.notices.push(Notice {
                        slice: doc.id.clone(),
                        node: doc.node.clone(),
                        kind: NoticeKind::Released,
                        text: format!("{} was released by an operator", doc.id),
                    });
                }
            }
        }
        changes.save.push(doc.clone());
        drop(inner);
        self.bump();
        Ok(changes)
    }

    /// Asks for a canary on slice `id` as soon as it can run. `Err`: no such slice.
    pub fn request_canary(&self, id: &str) -> Result<SliceDoc, UnknownSlice> {
        let mut inner = self.lock();
        let doc = inner
            .slices
            .get_mut(id)
            .ok_or_else(|| UnknownSlice(id.to_string()))?;
        doc.canary_requested = true;
        let d = doc.clone();
        drop(inner);
        self.bump();
        Ok(d)
    }

    /// Records that `submission` is slice `id`'s canary now.
    pub fn canary_started(&self, id: &str, submission: &str) -> Option<SliceDoc> {
        let mut inner = self.lock();
        let doc = inner.slices.get_mut(id)?;
        doc.canary_pending = Some(submission.to_string());
        doc.canary_requested = false;
        let d = doc.clone();
        drop(inner);
        self.bump();
        Some(d)
    }

    /// The slices that need a canary now, with their queues: connected ones (when the roster
    /// is known) without one in flight that never ran one, were asked for one, ran the
    /// schedule's number of jobs since their last, or had nothing to do for its idle time.
    pub fn due_canaries(&self, now_ms: i64) -> Vec<(String, String)> {
        if !self.schedule.enabled {
            return Vec::new();
        }
        let inner = self.lock();
        let idle_ms = (self.schedule.idle_s as i64).saturating_mul(1000);
        let models = model_scores(&inner.slices);
        // A slice whose last canary had no other slice of its model to compare with, now
        // that one has a score: compared at last (the first slices to join judge themselves).
        let unjudged = |s: &SliceDoc| {
            s.canaries
                .back()
                .is_some_and(|c| c.score.is_some() && c.peers == 0)
                && models
                    .get(s.model.as_deref().unwrap_or("cpu"))
                    .is_some_and(|m| m.iter().any(|(id, _)| *id != s.id))
        };
        inner
            .slices
            .values()
            .filter(|s| s.canary_pending.is_none())
            .filter(|s| inner.connected.as_ref().is_none_or(|c| c.contains(&s.id)))
            .filter(|s| {
                let last_activity = s
                    .canaries
                    .back()
                    .map(|c| c.at_ms)
                    .into_iter()
                    .chain(s.last_run_ms)
                    .max()
                    .unwrap_or(s.first_seen_ms);
                // A slice a canary or its readings quarantined is looked at again, later after
                // each canary that does not pass: 10 min, 20, 40 … up to the idle time.
                let recheck = s
                    .quarantine
                    .as_ref()
                    .is_some_and(|q| q.cause != Cause::Operator)
                    && {
                        let last = s.canaries.back().map_or(0, |c| c.at_ms);
                        let backoff = s.canary_failures.saturating_sub(1).min(10);
                        now_ms.saturating_sub(last) >= (RECHECK_MS << backoff).min(idle_ms)
                    };
                recheck
                    || unjudged(s)
                    || s.canary_requested
                    || s.canaries.is_empty()
                    || s.runs_since_canary >= self.schedule.every_jobs
                    || now_ms.saturating_sub(last_activity) >= idle_ms
            })
            .filter_map(|s| Some((s.id.clone(), s.queue.clone()?)))
            .collect()
    }
}

/// A slice id the fleet does not know.
#[derive(Debug, thiserror::Error)]
#[error("no slice {0:?} in the fleet (GET /v1/fleet lists them)")]
pub struct UnknownSlice(pub String);

fn quarantine(
    doc: &mut SliceDoc,
    cause: Cause,
    reason: String,
    evidence: Option<String>,
    now_ms: i64,
    changes: &mut Changes,
) {
    let flagged: Vec<String> = doc.ranked_since_canary.drain(..).collect();
    let mut text = format!("{} is quarantined: {reason}", doc.id);
    if !flagged.is_empty() {
        text = format!(
            "{text}; {} ranked run(s) since its last passing canary should be run again",
            flagged.len()
        );
    }
    doc.quarantine = Some(Quarantine {
        since_ms: now_ms,
        cause,
        reason,
        evidence,
        flagged,
    });
    changes.notices.push(Notice {
        slice: doc.id.clone(),
        node: doc.node.clone(),
        kind: NoticeKind::Quarantined,
        text,
    });
}

/// The latest canary score of every slice, by GPU model.
fn model_scores(slices: &BTreeMap<String, SliceDoc>) -> BTreeMap<String, Vec<(String, f64)>> {
    let mut out: BTreeMap<String, Vec<(String, f64)>> = BTreeMap::new();
    for s in slices.values() {
        if let Some(score) = s.canaries.iter().rev().find_map(|c| c.score) {
            let model = s.model.clone().unwrap_or_else(|| "cpu".into());
            out.entry(model).or_default().push((s.id.clone(), score));
        }
    }
    out
}

fn absorb(doc: &mut SliceDoc, p: &Provenance, now_ms: i64) {
    let gpu = p.gpus.first();
    doc.queue = p.queue.clone().or(doc.queue.take());
    doc.node = Some(p.node.clone());
    doc.index = p.slice.as_ref().map(|s| s.index).or(doc.index);
    doc.model = Some(
        gpu.and_then(|g| g.name.clone())
            .unwrap_or_else(|| "cpu".into()),
    );
    doc.gpu_uuid = gpu.and_then(|g| g.partition.clone().or(g.uuid.clone()));
    doc.driver = p.driver.clone();
    doc.kernelkite_version = Some(p.kernelkite_version.clone());
    doc.image = p.image.clone();
    doc.last_run_ms = Some(now_ms);
    doc.last_sample = gpu.and_then(|g| g.end.clone().or(g.start.clone()));
    doc.concerns = p.concerns.clone();
    doc.faults = p.faults.clone();
}

/// Marks `doc` outdated when its run named another version than `want` (and back), saying
/// so when that changes.
fn check_version(doc: &mut SliceDoc, seen: &str, want: &str, changes: &mut Changes) {
    let outdated = (seen != want).then(|| seen.to_string());
    if outdated == doc.outdated {
        return;
    }
    let (kind, text) = match &outdated {
        Some(v) => (
            NoticeKind::Outdated,
            format!(
                "{} runs kernelkite {v}, not {want}: update the node",
                doc.id
            ),
        ),
        None => (
            NoticeKind::UpToDate,
            format!("{} runs kernelkite {want} again", doc.id),
        ),
    };
    doc.outdated = outdated;
    changes.notices.push(Notice {
        slice: doc.id.clone(),
        node: doc.node.clone(),
        kind,
        text,
    });
}

/// Keeps a released quarantine's ranked runs to run again.
fn keep_reruns(doc: &mut SliceDoc, flagged: Vec<String>) {
    for id in flagged {
        push_capped(&mut doc.rerun, id, RANKED_KEPT);
    }
}

fn note(sub: &Submission, error: String, now_ms: i64) -> FailureNote {
    FailureNote {
        at_ms: now_ms,
        submission: sub.id.clone(),
        queue: sub.queue.clone(),
        state: sub.state.as_str().to_string(),
        error: error.chars().take(500).collect(),
    }
}

fn push_capped<T>(q: &mut VecDeque<T>, item: T, cap: usize) {
    q.push_back(item);
    while q.len() > cap {
        q.pop_front();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::result::ResultJson;
    use crate::submission::Outcome;
    use chrono::Utc;
    use kernelkite_sys::provenance::{Gpu, SliceRef};

    fn schedule() -> Schedule {
        Schedule {
            enabled: true,
            ..Schedule::default()
        }
    }

    fn provenance(agent: &str, index: u32, temperature: u32) -> Provenance {
        let p = Provenance {
            format: 1,
            node: "n1".into(),
            agent: Some(agent.into()),
            queue: Some("h100".into()),
            slice: Some(SliceRef {
                index,
                ..SliceRef::default()
            }),
            gpus: vec![Gpu {
                vendor: "nvidia".into(),
                name: Some("H100".into()),
                end: Some(Sample {
                    temperature_c: Some(temperature),
                    ..Sample::default()
                }),
                ..Gpu::default()
            }],
            ..Provenance::default()
        };
        p.reviewed(&Default::default())
    }

    fn bench_result(mean: f64) -> ResultJson {
        let text = serde_json::json!({"success": true, "error": "", "system": {}, "runs": {
            "benchmark": {"start": "", "end": "", "compilation": null, "profile": null,
                "run": {"passed": true, "exit_code": 0, "result": {"benchmark.0.mean": mean.to_string()}}}}});
        ResultJson::parse(text.to_string().as_bytes()).unwrap()
    }

    fn ended(
        id: &str,
        agent: &str,
        canary: bool,
        class: Class,
        outcome: Outcome,
        temperature: u32,
    ) -> Submission {
        let mut s = Submission::new(id.into(), "h100".into(), None, None, 60, Utc::now());
        s.priority = class;
        s.canary = canary.then(|| agent.to_string());
        s.provenance = Some(provenance(agent, agent.len() as u32, temperature));
        s.finish(outcome, Utc::now());
        s
    }

    fn canary(f: &Fleet, id: &str, agent: &str, mean: f64) -> Changes {
        let s = ended(
            id,
            agent,
            true,
            Class::Admin,
            Outcome::Succeeded(bench_result(mean)),
            50,
        );
        f.ended(&s, 1_000)
    }

    #[test]
    fn a_slice_gone_a_week_is_forgotten_unless_quarantined() {
        let f = Fleet::new(schedule(), 600);
        let roster = |names: &[&str]| names.iter().map(|n| agent(n)).collect::<Vec<_>>();
        f.seen(roster(&["a", "b", "c"]), 0);
        f.set_quarantine("c", Some("fan".into()), 0).unwrap();
        // a and c leave; b stays.
        let day = 24 * 3600 * 1000;
        assert!(f.seen(roster(&["b"]), 6 * day).forget.is_empty());
        let changes = f.seen(roster(&["b"]), FORGET_AFTER_MS);
        assert_eq!(changes.forget, ["a"]);
        assert!(!changes.save.iter().any(|d| d.id == "a"));
        let ids: Vec<String> = f.slices().into_iter().map(|d| d.id).collect();
        assert_eq!(ids, ["b", "c"], "b is connected, c quarantined");
        // Back after all: a new record.
        f.seen(roster(&["a", "b"]), FORGET_AFTER_MS + 1);
        assert!(f.slice("a").is_some());
    }

    #[test]
    fn a_canary_that_ran_on_another_slice_judges_neither() {
        let f = Fleet::new(schedule(), 600);
        canary(&f, "c0", "g0", 100.0);
        f.canary_started("g0", "c1");
        // Pinned to g0, run on g9 (a node reusing g0's tags), 50% slower.
        let mut s = ended(
            "c1",
            "g9",
            true,
            Class::Admin,
            Outcome::Succeeded(bench_result(150.0)),
            50,
        );
        s.canary = Some("g0".into());
        let changes = f.ended(&s, 2_000);
        assert!(changes.notices.is_empty(), "{:?}", changes.notices);
        let g0 = f.slice("g0").unwrap();
        assert!(g0.quarantine.is_none() && g0.canary_pending.is_none());
        assert_eq!(g0.canaries.len(), 1);
        assert!(f.slice("g9").is_none());
    }

    #[test]
    fn a_slow_canary_quarantines_flags_the_ranked_runs_and_a_passing_one_releases() {
        let f = Fleet::new(schedule(), 600);
        assert!(canary(&f, "c1", "g0", 100.0).notices.is_empty());
        let ranked = ended(
            "r1",
            "g1",
            false,
            Class::Ranked,
            Outcome::Succeeded(bench_result(1.0)),
            50,
        );
        f.ended(&ranked, 1_100);
        let test = ended(
            "t1",
            "g1",
            false,
            Class::Test,
            Outcome::Succeeded(bench_result(1.0)),
            50,
        );
        f.ended(&test, 1_200);
        let slow = canary(&f, "c2", "g1", 120.0);
        assert_eq!(slow.notices.len(), 1);
        assert_eq!(slow.notices[0].kind, NoticeKind::Quarantined);
        assert!(f.held_back("g1") && !f.held_back("g0"));
        let doc = f.slices().into_iter().find(|d| d.id == "g1").unwrap();
        let q = doc.quarantine.unwrap();
        assert_eq!(q.cause, Cause::Canary);
        assert_eq!(q.evidence.as_deref(), Some("c2"));
        assert_eq!(
            q.flagged,
            ["r1"],
            "the ranked run since the last passing canary, not the test"
        );
        assert!(matches!(
            doc.canaries.back().unwrap().verdict,
            Verdict::Slow { .. }
        ));
        // Fast again: released, and told.
        let back = canary(&f, "c3", "g1", 100.0);
        assert_eq!(back.notices[0].kind, NoticeKind::Released);
        assert!(!f.held_back("g1"));
        // An operator's quarantine outlives a passing canary.
        f.set_quarantine("g1", Some("maintenance".into()), 2_000)
            .unwrap();
        assert!(canary(&f, "c4", "g1", 100.0).notices.is_empty());
        assert!(f.held_back("g1"));
        assert!(f.set_quarantine("nope", None, 0).is_err());
        f.set_quarantine("g1", None, 3_000).unwrap();
        assert!(!f.held_back("g1"));
    }

    #[test]
    fn heat_asks_for_a_canary_a_fault_quarantines_and_a_failed_canary_quarantines_too() {
        let f = Fleet::new(schedule(), 600);
        // Hot: a run can do that to its GPU; a canary looks, nothing is quarantined.
        let hot = ended(
            "h1",
            "g0",
            false,
            Class::Test,
            Outcome::Succeeded(bench_result(1.0)),
            91,
        );
        let c = f.ended(&hot, 1_000);
        assert!(c.notices.is_empty(), "{:?}", c.notices);
        assert!(c.save[0].canary_requested && c.save[0].quarantine.is_none());
        // An uncorrected ECC error: a fault no run causes; quarantined until a canary passes.
        let mut broken = ended(
            "e1",
            "g1",
            false,
            Class::Test,
            Outcome::Succeeded(bench_result(1.0)),
            50,
        );
        if let Some(p) = &mut broken.provenance {
            p.gpus[0].end.as_mut().unwrap().ecc_uncorrected = Some(2);
            *p = p.clone().reviewed(&Default::default());
        }
        let c = f.ended(&broken, 1_000);
        assert_eq!(c.notices[0].kind, NoticeKind::Quarantined);
        let doc = &c.save[0];
        assert_eq!(doc.quarantine.as_ref().unwrap().cause, Cause::Health);
        assert!(doc.canary_requested, "a canary says when it is well again");
        // Without canaries (Buildkite mode, for now), readings decide nothing.
        let shown = Fleet::new(Schedule::default(), 600);
        assert!(shown.ended(&broken, 1_000).notices.is_empty());
        assert!(!shown.held_back("g1"));
        let failed = ended(
            "c1",
            "g2",
            true,
            Class::Admin,
            Outcome::Failed("no GPU".into()),
            50,
        );
        let c = f.ended(&failed, 1_000);
        assert_eq!(c.notices[0].kind, NoticeKind::Quarantined);
        assert!(c.notices[0].text.contains("no GPU"), "{:?}", c.notices);
        // Looked at again ten minutes later, then twenty after another failure.
        assert!(!f
            .due_canaries(1_000 + 599_000)
            .iter()
            .any(|(id, _)| id == "g2"));
        assert!(f
            .due_canaries(1_000 + 600_000)
            .iter()
            .any(|(id, _)| id == "g2"));
        f.canary_started("g2", "c1b");
        let again = ended(
            "c1b",
            "g2",
            true,
            Class::Admin,
            Outcome::Failed("no GPU".into()),
            50,
        );
        f.ended(&again, 700_000);
        assert!(!f
            .due_canaries(700_000 + 1_199_000)
            .iter()
            .any(|(id, _)| id == "g2"));
        assert!(f
            .due_canaries(700_000 + 1_200_000)
            .iter()
            .any(|(id, _)| id == "g2"));
        // A canceled canary is no verdict: asked for again.
        let canceled = ended(
            "c2",
            "g3",
            true,
            Class::Admin,
            Outcome::Canceled("stop".into()),
            50,
        );
        let c = f.ended(&canceled, 1_000);
        assert!(c.notices.is_empty() && c.save[0].canary_requested);
    }

    #[test]
    fn failures_not_the_contestants_are_kept_by_slice_or_apart() {
        let f = Fleet::new(schedule(), 600);
        let lost = {
            let mut s = Submission::new("x".into(), "h100".into(), None, None, 60, Utc::now());
            s.finish(Outcome::Failed("no result.json".into()), Utc::now());
            s
        };
        f.ended(&lost, 1);
        assert_eq!(f.unplaced_failures().len(), 1);
        let broken = ended(
            "y",
            "g0",
            false,
            Class::Test,
            Outcome::TimedOut("late".into()),
            50,
        );
        f.ended(&broken, 2);
        let own = ended(
            "z",
            "g0",
            false,
            Class::Test,
            Outcome::Succeeded(bench_result(1.0)),
            50,
        );
        f.ended(&own, 3);
        let doc = f.slices().into_iter().find(|d| d.id == "g0").unwrap();
        assert_eq!(
            doc.failures.len(),
            1,
            "a run that ended with a result is not a failure"
        );
        assert_eq!(doc.failures[0].error, "late");
        assert_eq!(doc.runs, 2);
    }

    fn agent(name: &str) -> AgentInfo {
        AgentInfo {
            name: name.into(),
            queue: Some("h100".into()),
            ..AgentInfo::default()
        }
    }

    #[test]
    fn canaries_are_due_on_joining_after_n_jobs_after_idling_and_when_asked() {
        let f = Fleet::new(
            Schedule {
                every_jobs: 2,
                idle_s: 100,
                ..schedule()
            },
            600,
        );
        f.seen(vec![agent("g0"), agent("g1")], 0);
        assert_eq!(f.due_canaries(0).len(), 2, "both joined");
        for (i, g) in ["g0", "g1"].iter().enumerate() {
            f.canary_started(g, &format!("c{i}"));
        }
        assert!(f.due_canaries(0).is_empty(), "in flight");
        canary(&f, "c0", "g0", 100.0);
        canary(&f, "c1", "g1", 100.0);
        // g0 judged itself alone; now that g1 has a score, it runs again to be compared.
        assert_eq!(
            f.due_canaries(1_000),
            [("g0".to_string(), "h100".to_string())]
        );
        f.canary_started("g0", "c0b");
        canary(&f, "c0b", "g0", 100.0);
        assert!(f.due_canaries(1_000).is_empty());
        for i in 0..2 {
            let s = ended(
                &format!("j{i}"),
                "g0",
                false,
                Class::Test,
                Outcome::Succeeded(bench_result(1.0)),
                50,
            );
            f.ended(&s, 2_000);
        }
        assert_eq!(
            f.due_canaries(2_000),
            [("g0".to_string(), "h100".to_string())]
        );
        // g1 idle for 100 s since its canary (at 1 s).
        assert_eq!(f.due_canaries(101_000).len(), 2);
        f.request_canary("g1").unwrap();
        assert!(f.due_canaries(2_000).iter().any(|(id, _)| id == "g1"));
        // Not connected: nothing runs there.
        f.seen(vec![agent("g0")], 2_000);
        assert!(!f.due_canaries(2_000).iter().any(|(id, _)| id == "g1"));
        let off = Fleet::new(Schedule::default(), 600);
        off.seen(vec![agent("g0")], 0);
        assert!(off.due_canaries(0).is_empty(), "canaries off");
    }

    #[test]
    fn a_slice_on_another_runner_version_is_outdated_until_it_runs_the_expected_one() {
        let f = Fleet::new(schedule(), 600).expecting("1.0".into());
        let run = |id: &str, version: &str| {
            let mut s = ended(
                id,
                "g0",
                false,
                Class::Test,
                Outcome::Succeeded(bench_result(1.0)),
                50,
            );
            if let Some(p) = &mut s.provenance {
                p.kernelkite_version = version.into();
            }
            f.ended(&s, 1)
        };
        let c = run("a", "0.9");
        assert_eq!(c.notices[0].kind, NoticeKind::Outdated);
        assert!(
            c.notices[0].text.contains("runs kernelkite 0.9, not 1.0"),
            "{:?}",
            c.notices
        );
        assert_eq!(c.save[0].outdated.as_deref(), Some("0.9"));
        assert!(run("b", "0.9").notices.is_empty(), "told once");
        let c = run("c", "1.0");
        assert_eq!(c.notices[0].kind, NoticeKind::UpToDate);
        assert!(c.save[0].outdated.is_none());
        assert!(
            !f.held_back("g0"),
            "outdated is shown and told, not a quarantine"
        );
    }

    #[test]
    fn a_slice_missing_for_the_limit_is_said_offline_once_and_back_when_it_returns() {
        let f = Fleet::new(schedule(), 60);
        f.seen(vec![agent("g0"), agent("g1")], 0);
        assert!(
            f.seen(vec![agent("g0")], 30_000).notices.is_empty(),
            "not yet"
        );
        let c = f.seen(vec![agent("g0")], 61_000);
        assert_eq!(c.notices.len(), 1);
        assert_eq!(
            (c.notices[0].slice.as_str(), c.notices[0].kind),
            ("g1", NoticeKind::Offline)
        );
        assert!(
            f.seen(vec![agent("g0")], 120_000).notices.is_empty(),
            "told once"
        );
        let c = f.seen(vec![agent("g0"), agent("g1")], 121_000);
        assert_eq!(c.notices[0].kind, NoticeKind::Online);
    }
}
