//! Queue status: how busy a queue is, for a backend choosing where (or whether) to send work and
//! for the competitor waiting in it.
//!
//! Two sources, read differently. The service's own counts (its in-flight submissions on the queue,
//! by state) are exact and read from the store on every request. The agents (GPU machines) serving
//! the queue come from the executor's world ([`Executor::agents`]; Buildkite: its agents list or
//! its agent metrics endpoint, `kernelkite_service::buildkite::agents`), which costs API calls
//! against the same 50/min budget that submissions spend; so they are fetched in the background at
//! most once per `KERNELKITE_AGENTS_REFRESH_S` (at least a minute), for every queue at once, only
//! while somebody asks, and every request in between is answered from that snapshot. A request
//! never waits for Buildkite except the very first, and then only briefly.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::sync::watch;
// Tokio's clock, so tests can pause it.
use tokio::time::Instant;

use crate::config::Config;
use crate::executor::{AgentCounts, AgentSource, AgentsByQueue, AgentsUnavailable, Executor};
use crate::report::report;
use crate::store::Store;

/// How long the first request after start waits for the first agent counts.
const FIRST_WAIT: Duration = Duration::from_secs(3);

/// `GET /v1/queues/{queue}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueStatus {
    /// The queue.
    pub queue: String,
    /// This service's submissions on the queue that wait for a machine (`queued`, `scheduled`).
    pub queued: u64,
    /// This service's submissions on the queue that run (`running`, `fetching`).
    pub running: u64,
    /// The queue's agents, as last fetched; `None` when unknown (no source, or no answer yet).
    pub agents: Option<AgentCounts>,
    /// When `queued` and `running` were counted (now).
    #[serde(with = "crate::submission::iso")]
    pub updated_at: DateTime<Utc>,
    /// When `agents` was fetched.
    #[serde(with = "crate::submission::iso_opt")]
    pub agents_updated_at: Option<DateTime<Utc>>,
    /// The service's own queue: waiting, started, slots, estimates (`crate::dispatch`).
    #[serde(flatten)]
    pub line: crate::dispatch::LineStatus,
}

/// Fetches that must fail, with none ever succeeding, before a queue's slots are taken for
/// unknowable rather than not yet known. A refusal (a token without `read_agents`) needs no
/// second try: it is unknowable at once.
const FETCHES_BEFORE_UNKNOWN: u64 = 3;

/// What the agents say of a queue's slots ([`Queues::agent_slots`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentSlots {
    /// The executor has no agents (none to count).
    NoSource,
    /// No fetch has succeeded yet, and fewer than three ended.
    NotFetched,
    /// The token was refused (a token without `read_agents`) before any fetch succeeded, or
    /// every fetch so far failed, three or more.
    Unknown,
    /// This many agents of the queue were connected at the last fetch that succeeded (however
    /// old: a failed fetch keeps them).
    Connected(u64),
}

/// Wakes when a fetch of agent counts ended ([`Queues::fetched`]).
pub struct Fetched(watch::Receiver<Snapshot>);

impl Fetched {
    /// Until the next fetch ends (never, once the counts are dropped).
    pub async fn next(&mut self) {
        if self.0.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

#[derive(Debug, Clone, Default)]
struct Snapshot {
    /// Fetches finished (successful or not); the first request waits for the first.
    attempts: u64,
    counts: Option<Arc<AgentsByQueue>>,
    fetched_at: Option<DateTime<Utc>>,
    /// `fetched_at` on the (pausable) monotonic clock, for ageing.
    fetched: Option<Instant>,
    /// The last counts a fetch brought, however old: the service's queue keeps using them
    /// through failed fetches (a Buildkite outage must not lift every queue's limit).
    last_good: Option<Arc<AgentsByQueue>>,
    /// The token was refused before any fetch succeeded: nothing can be counted until it
    /// changes (a later fetch that succeeds clears it).
    refused: bool,
}

/// Queue status: the store's counts, and agent counts refreshed in the background.
pub struct Queues {
    source: Option<Arc<dyn AgentSource>>,
    refresh: Duration,
    /// When the last fetch started; a fetch starts only when this is older than `refresh`.
    last_attempt: Mutex<Option<Instant>>,
    snapshot: watch::Sender<Snapshot>,
}

impl Queues {
    /// Queue status with agent counts from `source` (none: `agents` is always null), fetched
    /// at most once per `refresh`.
    pub fn new(source: Option<Arc<dyn AgentSource>>, refresh: Duration) -> Queues {
        Queues {
            source,
            refresh,
            last_attempt: Mutex::new(None),
            snapshot: watch::channel(Snapshot::default()).0,
        }
    }

    /// Queue status with the agents `executor` counts (Buildkite: its agents list or agent
    /// metrics; an executor without a source of its own: `agents` is null), refreshed as
    /// KERNELKITE_AGENTS_REFRESH_S says.
    pub fn for_executor(cfg: &Config, executor: &dyn Executor) -> Queues {
        let refresh = Duration::from_secs(cfg.agents_refresh_s);
        Queues::new(executor.agents(), refresh)
    }

    /// The queue's status: the store's counts now, the agents as last fetched. Starts a
    /// background fetch when the last one is older than the refresh interval.
    pub async fn status(
        self: &Arc<Self>,
        store: &Store,
        queue: &str,
        line: crate::dispatch::LineStatus,
    ) -> QueueStatus {
        let agents = self.agents(queue).await;
        let counts = store.in_flight(queue);
        QueueStatus {
            queue: queue.to_string(),
            queued: counts.queued,
            running: counts.running,
            agents: agents.map(|a| a.0),
            updated_at: Utc::now(),
            agents_updated_at: agents.map(|a| a.1),
            line,
        }
    }

    /// The queue's agents as last fetched, and when.
    pub async fn agents(self: &Arc<Self>, queue: &str) -> Option<(AgentCounts, DateTime<Utc>)> {
        self.source.as_ref()?;
        let mut rx = self.snapshot.subscribe();
        self.refresh_if_due();
        if rx.borrow().attempts == 0 {
            // Only before the first fetch ended: better a short wait than a null the caller
            // would cache.
            let _ = tokio::time::timeout(FIRST_WAIT, rx.wait_for(|s| s.attempts > 0)).await;
        }
        let snap = rx.borrow();
        let counts = snap.counts.as_ref()?;
        Some((
            counts.get(queue).copied().unwrap_or_default(),
            snap.fetched_at?,
        ))
    }

    /// What the agents say of `queue`'s slots, without waiting; starts a fetch when the last
    /// is older than the refresh interval. The service's queue reads its slots here.
    pub fn agent_slots(self: &Arc<Self>, queue: &str) -> AgentSlots {
        if self.source.is_none() {
            return AgentSlots::NoSource;
        }
        self.refresh_if_due();
        let snap = self.snapshot.borrow();
        match &snap.last_good {
            _ if snap.refused => AgentSlots::Unknown,
            Some(c) => AgentSlots::Connected(c.get(queue).map_or(0, |a| a.total)),
            None if snap.attempts < FETCHES_BEFORE_UNKNOWN => AgentSlots::NotFetched,
            None => AgentSlots::Unknown,
        }
    }

    /// How often agent counts (and the roster) are fetched at most.
    pub fn refresh(&self) -> Duration {
        self.refresh
    }

    /// The agents the last successful fetch listed one by one (`None`: no source, or one that
    /// only counts); starts a fetch when the last is older than the refresh interval.
    pub fn roster(self: &Arc<Self>) -> Option<Vec<crate::executor::AgentInfo>> {
        let source = self.source.clone()?;
        self.refresh_if_due();
        source.roster()
    }

    /// Changes each time a fetch ends (the service's queue starts what new agents have room
    /// for).
    pub fn fetched(&self) -> Fetched {
        Fetched(self.snapshot.subscribe())
    }

    /// Starts a fetch when none started within `refresh`. The start time is taken before the
    /// fetch runs, so concurrent requests start one fetch, not one each.
    fn refresh_if_due(self: &Arc<Self>) {
        let Some(source) = self.source.clone() else {
            return;
        };
        {
            let mut last = self.last_attempt.lock().unwrap_or_else(|p| p.into_inner());
            if last.is_some_and(|t| t.elapsed() < self.refresh) {
                return;
            }
            *last = Some(Instant::now());
        }
        let this = Arc::downgrade(self);
        tokio::spawn(async move {
            let result = source.fetch().await;
            let Some(this) = this.upgrade() else { return };
            // Counts older than three refreshes say more about the past than the queue.
            let stale_after = this.refresh * 3;
            this.snapshot.send_modify(|s| {
                s.attempts += 1;
                match result {
                    Ok(counts) => {
                        if s.refused {
                            tracing::info!(source = source.name(), "agent counts can be read again: each queue starts no more than its connected agents");
                        }
                        let counts = Arc::new(counts);
                        s.last_good = Some(counts.clone());
                        s.counts = Some(counts);
                        s.fetched_at = Some(Utc::now());
                        s.fetched = Some(Instant::now());
                        s.refused = false;
                    }
                    // A token that never could count: an answer, not an outage, so the queues
                    // stop waiting for counts at once (said once, until it changes), and later
                    // fetches look again. Once counts came, a refusal (a proxy's 403, a token
                    // being rotated) is taken as any failure: the last counts hold, or a
                    // stray 403 would flush every waiting submission into Buildkite at once.
                    Err(AgentsUnavailable::Refused(e)) if s.last_good.is_none() => {
                        if !s.refused {
                            tracing::warn!(source = source.name(), error = %report(&*e), "agent counts are refused for the token: queues are not limited by their agents (Buildkite orders what waits) until the token can read them; this service asks again every KERNELKITE_AGENTS_REFRESH_S");
                        }
                        *s = Snapshot {
                            attempts: s.attempts,
                            refused: true,
                            ..Snapshot::default()
                        };
                    }
                    Err(AgentsUnavailable::Failed(e) | AgentsUnavailable::Refused(e)) => {
                        tracing::warn!(source = source.name(), error = %report(&*e), "could not fetch agent counts for queue status");
                        if s.fetched.is_none_or(|t| t.elapsed() > stale_after) {
                            *s = Snapshot {
                                attempts: s.attempts,
                                last_good: s.last_good.take(),
                                ..Snapshot::default()
                            };
                        }
                    }
                }
            });
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::BoxError;
    use futures_util::future::BoxFuture;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};

    struct Counting {
        calls: AtomicU64,
        fail: std::sync::atomic::AtomicBool,
        refuse: std::sync::atomic::AtomicBool,
    }

    impl AgentSource for Counting {
        fn name(&self) -> &'static str {
            "test"
        }
        fn fetch(&self) -> BoxFuture<'_, Result<AgentsByQueue, AgentsUnavailable>> {
            Box::pin(async move {
                let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
                if self.refuse.load(Ordering::SeqCst) {
                    return Err(AgentsUnavailable::Refused("403 Forbidden".into()));
                }
                if self.fail.load(Ordering::SeqCst) {
                    return Err(AgentsUnavailable::Failed(BoxError::from("boom")));
                }
                Ok(HashMap::from([(
                    "h100".to_string(),
                    AgentCounts {
                        idle: n,
                        busy: 1,
                        total: n + 1,
                    },
                )]))
            })
        }
    }

    fn counting() -> Arc<Counting> {
        Arc::new(Counting {
            calls: AtomicU64::new(0),
            fail: std::sync::atomic::AtomicBool::new(false),
            refuse: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Waits (in paused time: at once) until `n` fetches have ended.
    async fn settled(q: &Queues, n: u64) {
        let mut rx = q.snapshot.subscribe();
        rx.wait_for(|s| s.attempts >= n).await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn many_requests_cost_one_fetch_per_refresh_interval() {
        let source = counting();
        let q = Arc::new(Queues::new(Some(source.clone()), Duration::from_secs(60)));
        let answers = futures_util::future::join_all((0..50).map(|_| q.agents("h100"))).await;
        assert!(answers.iter().all(|a| a.map(|a| a.0.idle) == Some(1)));
        assert_eq!(source.calls.load(Ordering::SeqCst), 1);
        tokio::time::sleep(Duration::from_secs(59)).await;
        for _ in 0..20 {
            assert_eq!(
                q.agents("other").await.map(|a| a.0),
                Some(AgentCounts::default()),
                "a queue without agents has zero, not unknown"
            );
        }
        assert_eq!(
            source.calls.load(Ordering::SeqCst),
            1,
            "within the interval: cached"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        // Due: this request starts a fetch and is answered from the snapshot it had.
        assert_eq!(q.agents("h100").await.map(|a| a.0.idle), Some(1));
        settled(&q, 2).await;
        assert_eq!(q.agents("h100").await.map(|a| a.0.idle), Some(2));
        assert_eq!(source.calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_fetch_keeps_recent_counts_and_drops_old_ones() {
        let source = counting();
        let minute = Duration::from_secs(60);
        source.fail.store(true, Ordering::SeqCst);
        let q = Arc::new(Queues::new(Some(source.clone()), minute));
        assert_eq!(q.agents("h100").await, None, "never fetched: unknown");
        source.fail.store(false, Ordering::SeqCst);
        tokio::time::sleep(minute).await;
        q.agents("h100").await;
        settled(&q, 2).await;
        assert!(q.agents("h100").await.is_some());
        source.fail.store(true, Ordering::SeqCst);
        tokio::time::sleep(minute).await;
        q.agents("h100").await;
        settled(&q, 3).await;
        assert!(
            q.agents("h100").await.is_some(),
            "one failure keeps recent counts"
        );
        // Past three intervals without a success the counts are dropped.
        for n in 4..=6 {
            tokio::time::sleep(minute + Duration::from_secs(1)).await;
            q.agents("h100").await;
            settled(&q, n).await;
        }
        assert_eq!(q.agents("h100").await, None);
        assert_eq!(source.calls.load(Ordering::SeqCst), 6);
    }

    #[tokio::test(start_paused = true)]
    async fn the_queue_s_slots_hold_until_counts_come_and_survive_failed_fetches() {
        let source = counting();
        let minute = Duration::from_secs(60);
        source.fail.store(true, Ordering::SeqCst);
        let q = Arc::new(Queues::new(Some(source.clone()), minute));
        assert_eq!(q.agent_slots("h100"), AgentSlots::NotFetched);
        for n in 1..FETCHES_BEFORE_UNKNOWN {
            settled(&q, n).await;
            assert_eq!(
                q.agent_slots("h100"),
                AgentSlots::NotFetched,
                "a failure or two: wait"
            );
            tokio::time::sleep(minute).await;
            q.agent_slots("h100");
        }
        settled(&q, FETCHES_BEFORE_UNKNOWN).await;
        assert_eq!(
            q.agent_slots("h100"),
            AgentSlots::Unknown,
            "they never come: unlimited"
        );
        source.fail.store(false, Ordering::SeqCst);
        tokio::time::sleep(minute).await;
        q.agent_slots("h100");
        settled(&q, FETCHES_BEFORE_UNKNOWN + 1).await;
        let n = source.calls.load(Ordering::SeqCst);
        assert_eq!(q.agent_slots("h100"), AgentSlots::Connected(n + 1));
        assert_eq!(q.agent_slots("b200"), AgentSlots::Connected(0));
        // Buildkite down for longer than queue status keeps counts: the slots keep the last.
        source.fail.store(true, Ordering::SeqCst);
        for k in 2..=6 {
            tokio::time::sleep(minute + Duration::from_secs(1)).await;
            q.agent_slots("h100");
            settled(&q, FETCHES_BEFORE_UNKNOWN + k).await;
        }
        assert_eq!(q.agents("h100").await, None, "queue status drops them");
        assert_eq!(q.agent_slots("h100"), AgentSlots::Connected(n + 1));
    }

    #[tokio::test(start_paused = true)]
    async fn once_counts_came_a_refusal_keeps_them_as_any_failure_does() {
        let source = counting();
        let minute = Duration::from_secs(60);
        let q = Arc::new(Queues::new(Some(source.clone()), minute));
        q.agent_slots("h100");
        settled(&q, 1).await;
        assert_eq!(q.agent_slots("h100"), AgentSlots::Connected(2));
        // A proxy's stray 403, a token being rotated: the last counts hold (unlimited here
        // would flush every waiting submission into Buildkite at once).
        source.refuse.store(true, Ordering::SeqCst);
        for n in 2..=6 {
            tokio::time::sleep(minute + Duration::from_secs(1)).await;
            q.agent_slots("h100");
            settled(&q, n).await;
            assert_eq!(q.agent_slots("h100"), AgentSlots::Connected(2), "fetch {n}");
        }
        source.refuse.store(false, Ordering::SeqCst);
        tokio::time::sleep(minute).await;
        q.agent_slots("h100");
        settled(&q, 7).await;
        assert_eq!(
            q.agent_slots("h100"),
            AgentSlots::Connected(8),
            "counting again"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_token_that_never_could_count_is_unknown_at_once_and_counts_when_it_can() {
        let source = counting();
        source.refuse.store(true, Ordering::SeqCst);
        let minute = Duration::from_secs(60);
        let q = Arc::new(Queues::new(Some(source.clone()), minute));
        assert_eq!(q.agent_slots("h100"), AgentSlots::NotFetched);
        settled(&q, 1).await;
        assert_eq!(
            q.agent_slots("h100"),
            AgentSlots::Unknown,
            "one refusal: unlimited, no three-fetch wait"
        );
        assert_eq!(q.agents("h100").await, None);
        source.refuse.store(false, Ordering::SeqCst);
        tokio::time::sleep(minute).await;
        q.agent_slots("h100");
        settled(&q, 2).await;
        assert_eq!(
            q.agent_slots("h100"),
            AgentSlots::Connected(3),
            "the scope came"
        );
    }

    #[tokio::test]
    async fn without_a_source_agents_are_unknown() {
        let q = Arc::new(Queues::new(None, Duration::from_secs(60)));
        assert_eq!(q.agents("h100").await, None);
    }
}
