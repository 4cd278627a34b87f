//! The fleet's upkeep around the core: its records loaded from and saved to the store, the
//! roster refreshed, canaries submitted when due, quarantines and releases announced.
//!
//! The fleet ([`crate::fleet`]) decides; this is where its decisions meet the store, the
//! executor and the queue. A canary is submitted as any submission is (`admin` class, the
//! [`CANARY_USER`], never from the result cache), pinned to its slice.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;

use crate::app::{App, SubmitRequest, Submitted};
use crate::error::Error;
use crate::fleet::{Changes, SliceDoc, CANARY_USER};
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
        let mut p = self.prepare(req, None)?;
        p.pin(id);
        let submitted = self.accept(p).await?;
        if let Some(doc) = self.fleet.canary_started(id, &submitted.submission.id) {
            self.save_slices(vec![doc]);
        }
        tracing::info!(slice = %id, id = %submitted.submission.id, "canary submitted");
        Ok(submitted)
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

    /// Runs the fleet's upkeep until the core is dropped: every couple of seconds, the
    /// roster (the executor's slices, or the queues' agents list) is read into the fleet and
    /// a canary (`canary`: the run config; `None`: none run) is submitted for each slice due.
    /// Buildkite's agents list costs API calls from the budget submissions spend, so it is
    /// read only while something needs it: `always` (vendors' alerts watch for agents going
    /// offline, canaries for slices joining), or somebody reading the fleet in the last
    /// [`ROSTER_DEMAND`].
    pub fn spawn_fleet(self: &Arc<Self>, canary: Option<serde_json::Value>, always: bool) {
        let app = Arc::downgrade(self);
        tokio::spawn(async move {
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
                let wanted = always
                    || canary.is_some()
                    || a.fleet.read_within(ROSTER_DEMAND.as_millis() as i64);
                let roster = a
                    .executor
                    .roster()
                    .or_else(|| wanted.then(|| a.queues.roster()).flatten());
                let now = Utc::now().timestamp_millis();
                if let Some(r) = roster {
                    let changes = a.fleet.seen(r, now);
                    a.fleet_changed(changes);
                }
                a.export_fleet_metrics();
                let Some(config) = &canary else { continue };
                for (id, queue) in a.fleet.due_canaries(now) {
                    if let Err(e) = a.submit_canary(&id, &queue, config.clone()).await {
                        tracing::warn!(slice = %id, error = %report(&e), "could not submit a canary; trying again later");
                    }
                }
            }
        });
    }
}
