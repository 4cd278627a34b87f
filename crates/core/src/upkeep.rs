//! The fleet's upkeep around the core: its records loaded from and saved to the store, the
//! roster refreshed, canaries submitted when due, quarantines and releases announced.
//!
//! The fleet ([`crate::fleet`]) decides; this is where its decisions meet the store, the
//! executor and the queue. A canary is submitted as any submission is (`admin` class, the
//! [`CANARY_USER`], never from the result cache), pinned to its slice.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;

use crate::app::{App, SubmitRequest, Submitted};
use crate::error::Error;
use crate::executor::PauseOutcome;
use crate::fleet::{Changes, SliceDoc, CANARY_USER};
use crate::pauses::{Act, Pauses};
use crate::report::report;

/// A node-named string as a Prometheus label value: the exposition writes label values as
/// they are, so anything but `[A-Za-z0-9._:/-]` becomes `_`, and it is cut at 128 characters
/// (a node names its agents and its host: a quote or a new line there would end the
/// exposition, and every alert with it).
pub fn label_value(s: &str) -> String {
    s.chars()
        .take(128)
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '/' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The agent tags a canary's build targets to reach one slice's agent: setup tags every
/// per-slice agent with its node and its GPU(s) (`crates/admin/src/setup/render.rs`).
pub const PIN_TAGS: [&str; 2] = ["node", "gpu-index"];

/// How often the upkeep looks at the roster and the canaries due.
const TICK: Duration = Duration::from_secs(2);

/// How long after somebody read the fleet its roster is kept fresh.
pub const ROSTER_DEMAND: Duration = Duration::from_secs(120);

impl App {
    /// Saves what the fleet changed (in the background: a record lost to a failing store is
    /// rebuilt by the next run on the slice) and announces its notices.
    pub(crate) fn fleet_changed(self: &Arc<Self>, changes: Changes) {
        for n in changes.notices {
            tracing::warn!(slice = %n.slice, kind = ?n.kind, "{}", n.text);
            // Nobody listening is not an error.
            let _ = self.notices.send(n);
        }
        self.save_slices(changes.save);
        self.forget_slices(changes.forget);
    }

    /// Drops retired slices' records from the store in the background (one that fails is
    /// dropped again at the next start's first week without it).
    fn forget_slices(self: &Arc<Self>, ids: Vec<String>) {
        if ids.is_empty() {
            return;
        }
        let app = self.clone();
        tokio::spawn(async move {
            let _one_at_a_time = app.fleet_saving.lock().await;
            for id in ids {
                if app.fleet.slice(&id).is_some() {
                    // Back since: its record is the fleet's again.
                    continue;
                }
                if let Err(e) = app.store.durable().fleet_forget(&id).await {
                    tracing::warn!(slice = %id, error = %report(&e), "could not drop a retired slice's record");
                }
            }
        });
    }

    /// Saves the named slices' records in the background. Each save writes the record as it
    /// is when it runs, under one lock: saves may start in any order, and the last to run
    /// still writes the newest record.
    fn save_slices(self: &Arc<Self>, docs: Vec<SliceDoc>) {
        if docs.is_empty() {
            return;
        }
        let app = self.clone();
        tokio::spawn(async move {
            let _one_at_a_time = app.fleet_saving.lock().await;
            for id in docs.into_iter().map(|d| d.id) {
                let Some(d) = app.fleet.slice(&id) else {
                    continue;
                };
                let Ok(text) = serde_json::to_string(&d) else {
                    continue;
                };
                if let Err(e) = app.store.durable().fleet_save(&d.id, &text).await {
                    tracing::warn!(slice = %d.id, error = %report(&e), "could not save the slice's record; it is rebuilt by its next run");
                }
            }
        });
    }

    /// Loads the fleet's records from the store (on start). A record that cannot be read is
    /// skipped and logged: the slice starts afresh.
    pub async fn load_fleet(&self) {
        match self.store.durable().fleet_load().await {
            Ok(texts) => {
                let docs: Vec<SliceDoc> = texts
                    .iter()
                    .filter_map(|t| match serde_json::from_str(t) {
                        Ok(d) => Some(d),
                        Err(e) => {
                            tracing::warn!(error = %e, "a slice's stored record is unreadable; the slice starts afresh");
                            None
                        }
                    })
                    .collect();
                tracing::info!(slices = docs.len(), "fleet records loaded");
                self.fleet.load(docs);
            }
            Err(e) => {
                tracing::warn!(error = %report(&e), "could not load the fleet's records; slices start afresh")
            }
        }
    }

    /// Takes slice `id` out of ranking (`Some(reason)`) or puts it back (`None`), as an
    /// operator asked.
    pub fn set_quarantine(
        self: &Arc<Self>,
        id: &str,
        reason: Option<String>,
    ) -> Result<(), crate::fleet::UnknownSlice> {
        let changes = self
            .fleet
            .set_quarantine(id, reason, Utc::now().timestamp_millis())?;
        self.fleet_changed(changes);
        Ok(())
    }

    /// Asks for a canary on slice `id` now (it starts at the next look, when the slice is
    /// connected and canaries run).
    pub fn request_canary(self: &Arc<Self>, id: &str) -> Result<(), crate::fleet::UnknownSlice> {
        let doc = self.fleet.request_canary(id)?;
        self.save_slices(vec![doc]);
        Ok(())
    }

    /// Submits a canary for slice `id` on `queue` with run config `config` (its mode set to
    /// `benchmark`), pinned to the slice.
    pub async fn submit_canary(
        self: &Arc<Self>,
        id: &str,
        queue: &str,
        mut config: serde_json::Value,
    ) -> Result<Submitted, Error> {
        config["mode"] = serde_json::Value::from("benchmark");
        let req = SubmitRequest {
            config,
            queue: queue.to_string(),
            run_id: Some(format!("canary-{id}")),
            callback_url: None,
            timeout_s: None,
            user: Some(CANARY_USER.to_string()),
            priority: Some("admin".into()),
            cache: Some(false),
        };
        let tags = self.pin_tags(id)?;
        let mut p = self.prepare(req, None)?;
        p.pin(id, tags);
        let submitted = self.accept(p).await?;
        if let Some(doc) = self.fleet.canary_started(id, &submitted.submission.id) {
            self.save_slices(vec![doc]);
        }
        tracing::info!(slice = %id, id = %submitted.submission.id, "canary submitted");
        Ok(submitted)
    }

    /// The tags that single out slice `id`'s agent where Buildkite dispatches: `node` and
    /// `gpu-index` from the roster ([`PIN_TAGS`]). None needed where the executor runs the
    /// slices itself (local mode pins by id).
    fn pin_tags(&self, id: &str) -> Result<BTreeMap<String, String>, Error> {
        if !self.executor.pauses_agents() {
            return Ok(BTreeMap::new());
        }
        let (roster, _) = self.fleet.roster();
        let pins = |a: &crate::executor::AgentInfo| -> BTreeMap<String, String> {
            a.tags
                .iter()
                .filter_map(|t| t.split_once('='))
                .filter(|(k, _)| PIN_TAGS.contains(k))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let me = roster.iter().find(|a| a.name == id);
        let tags = me.map(pins).unwrap_or_default();
        // Tags another agent of the queue has too (a node reusing another's name) would send
        // the canary to either.
        let shared = roster
            .iter()
            .filter(|a| me.is_some_and(|m| m.queue == a.queue) && pins(a) == tags)
            .count()
            > 1;
        if tags.len() == PIN_TAGS.len() && !shared {
            Ok(tags)
        } else {
            Err(crate::error::Invalid::Unpinnable(id.to_string()).into())
        }
    }

    /// Sets the fleet's gauges (`GET /metrics`) from its records now: slices by state, the
    /// quarantined ones, each slice's GPU temperature and last canary ratio.
    pub fn export_fleet_metrics(&self) {
        use crate::metrics::{SliceLabel, StateLabel};
        let o = self.overview_slices();
        let m = &self.metrics;
        self.clear_fleet_metrics();
        for state in ["busy", "idle", "offline", "quarantined", "unknown"] {
            m.fleet_slices
                .get_or_create(&StateLabel {
                    state: state.into(),
                })
                .set(o.iter().filter(|s| s.state == state).count() as i64);
        }
        for s in &o {
            let label = SliceLabel {
                slice: label_value(&s.id),
                node: label_value(s.node.as_deref().unwrap_or_default()),
                queue: label_value(s.queue.as_deref().unwrap_or_default()),
            };
            m.slice_quarantined
                .get_or_create(&label)
                .set(i64::from(s.quarantine.is_some()));
            if let Some(t) = s.temperature_c {
                m.slice_gpu_temperature
                    .get_or_create(&label)
                    .set(i64::from(t));
            }
            if let Some(r) = s.canary_trend.last() {
                m.slice_canary_permille
                    .get_or_create(&label)
                    .set((r * 1000.0).round() as i64);
            }
        }
    }

    /// Empties the fleet's gauges.
    pub fn clear_fleet_metrics(&self) {
        let m = &self.metrics;
        m.fleet_slices.clear();
        m.slice_quarantined.clear();
        m.slice_gpu_temperature.clear();
        m.slice_canary_permille.clear();
    }

    /// Asks the executor to pause the agents of quarantined slices, renew their pauses and
    /// resume released ones ([`crate::pauses`]), one call at a time; a failure is logged and
    /// tried again a minute later.
    async fn keep_paused(
        &self,
        pauses: &mut Pauses,
        quarantined: &BTreeMap<String, crate::pauses::Quarantined>,
        roster: Option<&[crate::executor::AgentInfo]>,
        now_ms: i64,
    ) {
        for act in pauses.plan(quarantined, roster, now_ms) {
            let outcome = match &act {
                Act::Pause { slice, note, renew } => {
                    self.executor
                        .pause_agent(slice, note, crate::pauses::PAUSE_MINUTES, *renew)
                        .await
                }
                Act::Resume { slice } => self.executor.resume_agent(slice).await,
            };
            match (&act, &outcome) {
                (_, Err(e)) => {
                    tracing::warn!(?act, error = %report(&**e), "could not change the agent's pause; trying again in a minute")
                }
                (Act::Pause { slice, .. }, Ok(PauseOutcome::Done)) => {
                    tracing::info!(slice = %slice, "paused the quarantined slice's agent: Buildkite dispatches it nothing")
                }
                (Act::Resume { slice }, Ok(PauseOutcome::Done)) => {
                    tracing::info!(slice = %slice, "resumed the released slice's agent")
                }
                (_, Ok(o)) => {
                    tracing::info!(?act, outcome = ?o, "the agent's pause is left as it is")
                }
            }
            pauses.done(&act, outcome.map_err(|_| ()), now_ms);
        }
    }

    /// Runs the fleet's upkeep until the core is dropped: every couple of seconds, the
    /// roster (the executor's slices, or the queues' agents list) is read into the fleet and
    /// a canary (`canary`: the run config; `None`: none run) is submitted for each slice due.
    /// Buildkite's agents list costs API calls from the budget submissions spend, so it is
    /// read only while something needs it: `always` (vendors' alerts watch for agents going
    /// offline, canaries for slices joining), or somebody reading the fleet in the last
    /// [`ROSTER_DEMAND`].
    pub fn spawn_fleet(self: &Arc<Self>, canary: Option<serde_json::Value>, always: bool) {
        let app = Arc::downgrade(self);
        let mut pauses = Pauses::new(self.queues.refresh());
        tokio::spawn(async move {
            // The agents' pauses this loop holds (Buildkite mode): its own state, no lock.
            let mut tick = tokio::time::interval(TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(a) = app.upgrade() else { return };
                if !a.store.durable().acting() {
                    // Another process runs the queue now: its figures are the fleet's, and
                    // these, frozen, would keep alerts firing after it released a slice.
                    a.clear_fleet_metrics();
                    continue;
                }
                let pausing = a.executor.pauses_agents();
                let quarantined = if pausing {
                    a.fleet.quarantined()
                } else {
                    Default::default()
                };
                let wanted = always
                    || canary.is_some()
                    || !quarantined.is_empty()
                    || !pauses.held().is_empty()
                    || a.fleet.read_within(ROSTER_DEMAND.as_millis() as i64);
                let roster = a
                    .executor
                    .roster()
                    .or_else(|| wanted.then(|| a.queues.roster()).flatten());
                let now = Utc::now().timestamp_millis();
                if pausing {
                    a.keep_paused(&mut pauses, &quarantined, roster.as_deref(), now)
                        .await;
                }
                if let Some(r) = roster {
                    let changes = a.fleet.seen(r, now);
                    a.fleet_changed(changes);
                }
                a.export_fleet_metrics();
                let Some(config) = &canary else { continue };
                for (id, queue) in a.fleet.due_canaries(now) {
                    // Where Buildkite dispatches, a quarantined slice's agent is paused: it is
                    // resumed for a canary an operator asks for, never on a schedule (ranked
                    // jobs waiting on the queue would reach it first).
                    if pausing && quarantined.get(&id).is_some_and(|q| !q.requested) {
                        continue;
                    }
                    // A slice no tag singles out (a pool agent's) is not canaried there.
                    if pausing && a.pin_tags(&id).is_err() {
                        continue;
                    }
                    if let Err(e) = a.submit_canary(&id, &queue, config.clone()).await {
                        tracing::warn!(slice = %id, error = %report(&e), "could not submit a canary; trying again later");
                    }
                }
            }
        });
    }
}
