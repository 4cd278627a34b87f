//! The service's queue (issue 25): per queue, the submissions waiting for a slot, who starts
//! next ([`crate::fairshare`]), the per-user quotas, and each waiting submission's place.
//!
//! The service creates a build only when the queue has a free slot, so Buildkite never holds
//! a backlog and the order is the service's alone. A slot is taken from the moment a
//! submission leaves the queue until it ends, however long its build waits in Buildkite (an
//! agent died): such a build is counted, not ignored. How many slots a queue has is the
//! caller's to say ([`crate::app::App::capacity`]): KERNELKITE_QUEUE_SLOTS, else the local
//! executor's slices, else the queue's connected Buildkite agents; unknown: no limit (builds
//! wait in Buildkite, first come first served, as before).
//!
//! Everything here is a plain value under one lock, with no I/O: the core (`crate::app`)
//! writes to the store and launches builds around it.

use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use crate::fairshare::{Class, FairQueue, Ticket};
use crate::submission::Place;

/// Whether `name` is a queue name the service takes: 1-64 of `A-Za-z0-9._-`, what Buildkite
/// takes in a `queue=` agent tag.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

/// The user of submissions that name none: they share one fair share and one quota.
pub const ANONYMOUS: &str = "anonymous";

/// An hour, in ms: the window of the hourly quota.
pub const HOUR_MS: i64 = 3_600_000;

/// Run times kept per queue for the estimate (and read back from the store on start).
pub const RECENT_RUNS: usize = 32;

/// The quotas of one queue and class (`None`: no limit).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limit {
    /// Most of a user's submissions waiting or running at once.
    pub queued: Option<u64>,
    /// Most of a user's submissions accepted in any hour.
    pub hourly: Option<u64>,
}

/// One rule of KERNELKITE_QUEUE_LIMITS: where it applies and what it sets.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LimitRule {
    queue: Option<String>,
    class: Option<Class>,
    queued: Option<Option<u64>>,
    hourly: Option<Option<u64>>,
}

/// KERNELKITE_QUEUE_LIMITS, parsed: rules `SCOPE:queued=N,hourly=M` separated by `;`, where
/// SCOPE is `*`, `QUEUE`, `*/CLASS` or `QUEUE/CLASS` and a number may be `none`. For each
/// limit the most specific rule that sets it wins (queue and class, then queue, then class,
/// then `*`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Limits(Vec<LimitRule>);

impl Limits {
    /// Parses the setting; the error says what is wrong with which rule.
    pub fn parse(text: &str) -> Result<Limits, String> {
        let mut rules = Vec::new();
        for rule in text.split(';').map(str::trim).filter(|r| !r.is_empty()) {
            let (scope, sets) = rule
                .split_once(':')
                .ok_or_else(|| format!("{rule:?}: write SCOPE:queued=N,hourly=M (SCOPE: *, QUEUE, */CLASS or QUEUE/CLASS)"))?;
            let (queue, class) = match scope.trim().split_once('/') {
                Some((q, c)) => (q.trim(), Some(c.trim())),
                None => (scope.trim(), None),
            };
            let queue = match queue {
                "*" => None,
                q if valid_name(q) => Some(q.to_string()),
                q => {
                    return Err(format!(
                        "{rule:?}: {q:?} is not a queue name (1-64 of A-Za-z0-9._-) or *"
                    ))
                }
            };
            let class = match class {
                None | Some("*") => None,
                Some(c) => Some(Class::parse(c).ok_or_else(|| {
                    format!("{rule:?}: {c:?} is not a class (admin, ranked, test or *)")
                })?),
            };
            let mut r = LimitRule {
                queue,
                class,
                queued: None,
                hourly: None,
            };
            for set in sets.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let (key, value) = set
                    .split_once('=')
                    .ok_or_else(|| format!("{rule:?}: {set:?} is not KEY=NUMBER"))?;
                let value = count_or_none(value).ok_or_else(|| {
                    format!(
                        "{rule:?}: {key}={} must be a whole number of at least 1, or none",
                        value.trim()
                    )
                })?;
                match key.trim() {
                    "queued" => r.queued = Some(value),
                    "hourly" => r.hourly = Some(value),
                    k => return Err(format!("{rule:?}: unknown limit {k:?} (queued or hourly)")),
                }
            }
            rules.push(r);
        }
        Ok(Limits(rules))
    }

    /// The limits of `class` on `queue`.
    pub fn of(&self, queue: &str, class: Class) -> Limit {
        let specificity =
            |r: &LimitRule| u8::from(r.queue.is_some()) * 2 + u8::from(r.class.is_some());
        let mut applies: Vec<&LimitRule> = self
            .0
            .iter()
            .filter(|r| r.queue.as_deref().is_none_or(|q| q == queue))
            .filter(|r| r.class.is_none_or(|c| c == class))
            .collect();
        // Most specific last, so it is applied last; a later rule beats an earlier equal one.
        applies.sort_by_key(|r| specificity(r));
        let mut out = Limit::default();
        for r in applies {
            if let Some(q) = r.queued {
                out.queued = q;
            }
            if let Some(h) = r.hourly {
                out.hourly = h;
            }
        }
        out
    }
}

/// A user's times of the last hour in `map` (older ones dropped), kept under `key`. Users with
/// nothing in the last hour weigh nothing: their entries go now and then, so the map does not
/// grow with every user ever seen.
fn last_hour<'a>(
    map: &'a mut HashMap<(Class, String), VecDeque<i64>>,
    key: &(Class, String),
    now_ms: i64,
) -> &'a mut VecDeque<i64> {
    if map.len() >= 1024 && map.len().is_power_of_two() {
        map.retain(|_, r| r.back().is_some_and(|t| *t > now_ms - HOUR_MS));
    }
    let times = map.entry(key.clone()).or_default();
    while times.front().is_some_and(|t| *t <= now_ms - HOUR_MS) {
        times.pop_front();
    }
    times
}

/// Whether the hour's `times` have reached `max`: then the seconds until the oldest leaves
/// the hour (at least 1).
fn full(times: &VecDeque<i64>, max: Option<u64>, now_ms: i64) -> Option<u64> {
    let max = max?;
    if (times.len() as u64) < max {
        return None;
    }
    let oldest = times.front().copied().unwrap_or(now_ms);
    let frees_in_ms = (oldest + HOUR_MS - now_ms).max(1000);
    Some(u64::try_from(frees_in_ms).unwrap_or(1000).div_ceil(1000))
}

/// A count setting: a whole number of at least 1, or `none` (`Most(None)`: no limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Most(pub Option<u64>);

impl Most {
    /// Parses the setting; the error says what to write.
    pub fn parse(text: &str) -> Result<Most, String> {
        count_or_none(text)
            .map(Most)
            .ok_or_else(|| format!("{text:?}: write a whole number of at least 1, or none"))
    }
}

/// A setting's number: a whole number of at least 1 (`Some(Some(n))`) or `none`
/// (`Some(None)`: no limit); anything else is `None`.
fn count_or_none(text: &str) -> Option<Option<u64>> {
    match text.trim() {
        "none" => Some(None),
        n => n.parse::<u64>().ok().filter(|n| *n > 0).map(Some),
    }
}

/// KERNELKITE_QUEUE_SLOTS, parsed: `QUEUE=N` pairs separated by `,` (`*=N` for every other
/// queue); `N` may be `none`: not limited.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Slots(BTreeMap<String, Option<u64>>);

impl Slots {
    /// The queue names it sets (`*` included).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }

    /// Parses the setting.
    pub fn parse(text: &str) -> Result<Slots, String> {
        let mut out = BTreeMap::new();
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (queue, n) = pair
                .split_once('=')
                .ok_or_else(|| format!("{pair:?}: write QUEUE=N (or *=N)"))?;
            let queue = queue.trim();
            if queue != "*" && !valid_name(queue) {
                return Err(format!("{pair:?}: {queue:?} is not a queue name or *"));
            }
            let n = count_or_none(n).ok_or_else(|| {
                format!("{pair:?}: the slots must be a whole number of at least 1, or none")
            })?;
            out.insert(queue.to_string(), n);
        }
        Ok(Slots(out))
    }

    /// The slots set for `queue`, if a pair names it (or `*`): `Some(None)` when that is
    /// `none`, not limited.
    pub fn of(&self, queue: &str) -> Option<Option<u64>> {
        self.0.get(queue).or_else(|| self.0.get("*")).copied()
    }
}

/// Why a submission was refused by a quota. The message is read by whoever sent the run, and a
/// backend passes it on to the person it runs for (kernelbot's contestant): it says which limit
/// was hit and when to try again, in words; `Retry-After` carries the same wait in seconds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OverQuota {
    /// The user has the most submissions waiting or running at once.
    #[error("user {user:?} already has {} waiting or running on {}, the most at once; one is expected to end in {}", runs(.limit, .class), counted_on(.queue, .every_queue), in_words(.retry_after_s))]
    Queued {
        /// The user.
        user: String,
        /// The queue.
        queue: String,
        /// Counted over every queue: they share one node's slots (local mode).
        every_queue: bool,
        /// The class.
        class: &'static str,
        /// The limit.
        limit: u64,
        /// When a slot of the user's is expected to free, seconds.
        retry_after_s: u64,
    },
    /// The user had the most submissions accepted in the last hour.
    #[error("user {user:?} already sent {} to {} in the last hour, the most per hour; the next is accepted in {}", runs(.limit, .class), counted_on(.queue, .every_queue), in_words(.retry_after_s))]
    Hourly {
        /// The user.
        user: String,
        /// The queue.
        queue: String,
        /// Counted over every queue: they share one node's slots (local mode).
        every_queue: bool,
        /// The class.
        class: &'static str,
        /// The limit.
        limit: u64,
        /// When the oldest of them leaves the hour, seconds.
        retry_after_s: u64,
    },
    /// The user had the most answers from the result cache in the last hour.
    #[error("user {user:?} was answered {} for {} from the result cache in the last hour, the most per hour (KERNELKITE_CACHE_HOURLY); the next is accepted in {}, or at once when sent with \"cache\": false, which runs it", runs(.limit, .class), counted_on(.queue, .every_queue), in_words(.retry_after_s))]
    Cached {
        /// The user.
        user: String,
        /// The queue.
        queue: String,
        /// Counted over every queue: they share one node's slots (local mode).
        every_queue: bool,
        /// The class.
        class: &'static str,
        /// The limit.
        limit: u64,
        /// When the oldest of them leaves the hour, seconds.
        retry_after_s: u64,
    },
}

/// `1 test submission`, `10 test submissions`.
fn runs(n: &u64, class: &str) -> String {
    let s = if *n == 1 { "" } else { "s" };
    format!("{n} {class} submission{s}")
}

/// What a quota refusal says the user's submissions were counted on: the queue, or, where
/// every queue shares one node's slots (local mode), all of them, said without the node.
fn counted_on(queue: &str, every_queue: &bool) -> String {
    if *every_queue {
        "any GPU of this service".to_string()
    } else {
        queue.to_string()
    }
}

/// A wait as a person reads it: `about 40 s` under 90 s, `about 3 min` under 90 minutes,
/// else `about 2 h`.
fn in_words(seconds: &u64) -> String {
    let s = *seconds;
    if s < 90 {
        format!("about {} s", s.max(1))
    } else if s < 90 * 60 {
        format!("about {} min", (s + 30) / 60)
    } else {
        format!("about {} h", (s + 1800) / 3600)
    }
}

impl OverQuota {
    /// Seconds until it is worth trying again (`Retry-After`).
    pub fn retry_after_s(&self) -> u64 {
        match self {
            OverQuota::Queued { retry_after_s, .. }
            | OverQuota::Hourly { retry_after_s, .. }
            | OverQuota::Cached { retry_after_s, .. } => *retry_after_s,
        }
    }

    /// The limit's name, for metrics.
    pub fn limit(&self) -> &'static str {
        match self {
            OverQuota::Queued { .. } => "queued",
            OverQuota::Hourly { .. } => "hourly",
            OverQuota::Cached { .. } => "cached",
        }
    }
}

/// How a submission open before a restart comes back ([`Dispatcher::restore`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restored {
    /// Its build exists: it holds a slot, and its tag moves its class's clock.
    Started,
    /// Whether its build was created is not known yet (recovery looks): it holds a slot
    /// until [`Dispatcher::requeue`] puts it back, and leaves the clock alone.
    Held,
}

/// A submission's admission: its start tag and what it was charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// Its start tag.
    pub tag: u64,
    /// The estimate it was charged.
    pub charged: Duration,
}

/// Who a submission is, as the queue counts it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Who {
    /// The queue.
    pub queue: String,
    /// The user.
    pub user: String,
    /// The class.
    pub class: Class,
}

impl Who {
    /// `user` on `queue` in `class`; a submission that names no user is the shared
    /// [`ANONYMOUS`] one's.
    pub fn new(queue: &str, user: Option<&str>, class: Class) -> Who {
        Who {
            queue: queue.to_string(),
            user: user.unwrap_or(ANONYMOUS).to_string(),
            class,
        }
    }
}

/// A submission that left the queue: its build is to be created now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Started {
    /// The submission.
    pub id: String,
    /// How long it waited in the queue.
    pub waited: Duration,
    /// Its class.
    pub class: Class,
    /// How many of its user's submissions were open when it started (the metrics' bucket).
    pub user_open: u64,
}

/// A waiting submission's details.
#[derive(Debug, Clone)]
struct Waiting {
    user: String,
    charged: Duration,
    since: Instant,
}

/// A started submission's details, until it ends.
#[derive(Debug, Clone)]
struct Run {
    ticket: Ticket,
    user: String,
    class: Class,
    charged: Duration,
    started: Instant,
}

/// One queue.
#[derive(Debug, Default)]
struct Line {
    fair: FairQueue,
    waiting: HashMap<String, Waiting>,
    running: HashMap<String, Run>,
    /// Per class and user: submissions waiting or running.
    open: HashMap<(Class, String), u64>,
    /// Per class and user: when their submissions of the last hour were accepted (unix ms),
    /// answers from the result cache among them.
    recent: HashMap<(Class, String), VecDeque<i64>>,
    /// Per class and user: when they were answered from the result cache in the last hour.
    cached: HashMap<(Class, String), VecDeque<i64>>,
    /// The last runs' measured times, newest last.
    runs: VecDeque<Duration>,
}

impl Line {
    fn estimate(&self, default: Duration) -> Duration {
        if self.runs.is_empty() {
            return default;
        }
        self.runs.iter().sum::<Duration>() / self.runs.len() as u32
    }

    /// Learns a run's measured time: the estimate is the mean of the last [`RECENT_RUNS`].
    fn measured(&mut self, took: Duration) {
        self.runs.push_back(took);
        if self.runs.len() > RECENT_RUNS {
            self.runs.pop_front();
        }
    }

    fn close(&mut self, class: Class, user: &str) {
        let key = (class, user.to_string());
        if let Some(n) = self.open.get_mut(&key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.open.remove(&key);
            }
        }
    }

    /// Seconds until the user's soonest open submission is expected to end.
    fn next_end_of(&self, user: &str, class: Class, estimate: Duration, slots: Option<u64>) -> u64 {
        let running = self
            .running
            .values()
            .filter(|r| r.user == user && r.class == class)
            .map(|r| estimate.saturating_sub(r.started.elapsed()))
            .min();
        let end = running.or_else(|| {
            let places = self.places(estimate, slots, Utc::now());
            self.fair
                .order()
                .zip(places)
                .find(|(t, _)| {
                    t.class == class && self.waiting.get(&t.id).is_some_and(|w| w.user == user)
                })
                .map(|(_, p)| Duration::from_secs_f64(p.estimated_wait_s) + estimate)
        });
        end.map_or(1, |d| d.as_secs().max(1))
    }

    /// Every waiting submission's place, in order: each starts when the next slot frees
    /// (a running submission's slot after the estimate less its time so far; a started one
    /// after the estimate). Without a slot count, everything starts now.
    fn places(&self, estimate: Duration, slots: Option<u64>, now: DateTime<Utc>) -> Vec<Place> {
        self.places_upto(estimate, slots, now, self.fair.len())
    }

    /// [`Line::places`] of the first `count` waiting submissions only.
    fn places_upto(
        &self,
        estimate: Duration,
        slots: Option<u64>,
        now: DateTime<Utc>,
        count: usize,
    ) -> Vec<Place> {
        use std::cmp::Reverse;
        let mut free: BinaryHeap<Reverse<Duration>> = BinaryHeap::new();
        // No slot now (a queue without connected agents): the estimate is as if it had one.
        let slots = slots.map_or(usize::MAX, |s| {
            usize::try_from(s.max(1)).unwrap_or(usize::MAX)
        });
        for r in self.running.values() {
            free.push(Reverse(estimate.saturating_sub(r.started.elapsed())));
        }
        let idle = slots
            .saturating_sub(self.running.len())
            .min(self.fair.len());
        for _ in 0..idle {
            free.push(Reverse(Duration::ZERO));
        }
        let count = count.min(self.fair.len());
        let mut out = Vec::with_capacity(count);
        for position in 1..=count as u64 {
            let Reverse(at) = free.pop().unwrap_or(Reverse(Duration::ZERO));
            free.push(Reverse(at + estimate));
            let wait = (at.as_secs_f64() * 10.0).round() / 10.0;
            out.push(Place {
                position,
                estimated_wait_s: wait,
                estimated_start_at: now
                    + chrono::Duration::from_std(at).unwrap_or(chrono::Duration::zero()),
            });
        }
        out
    }
}

/// What `GET /v1/queues/{queue}` shows of the service's queue.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LineStatus {
    /// Submissions waiting in the service's queue.
    pub waiting: u64,
    /// Submissions started (their builds created) and not ended: the slots taken.
    pub started: u64,
    /// The queue's slots (`None`: not known, so not limited).
    pub slots: Option<u64>,
    /// The run time the estimates assume: the mean of the queue's recent runs, seconds.
    pub estimated_run_s: f64,
    /// When a submission arriving now in class `test` is expected to start, seconds.
    pub estimated_wait_s: f64,
}

/// The one line of a node that runs every queue on the same slices (local mode), as the
/// queue status and metrics name it.
pub const NODE_LINE: &str = "local";

/// Every queue's line, under one lock.
#[derive(Debug)]
pub struct Dispatcher {
    limits: Limits,
    default_estimate: Duration,
    /// Every queue waits in this one line ([`Dispatcher::one_line`]).
    one_line: Option<&'static str>,
    lines: Mutex<HashMap<String, Line>>,
}

impl Dispatcher {
    /// Lines with these quotas, estimating a run at `default_estimate` until a queue has
    /// measured runs.
    pub fn new(limits: Limits, default_estimate: Duration) -> Dispatcher {
        Dispatcher {
            limits,
            default_estimate,
            one_line: None,
            lines: Mutex::new(HashMap::new()),
        }
    }

    /// Every queue name waits in one line, [`NODE_LINE`]: an executor whose slots are one
    /// node's, whatever the queue (local mode), starts no more than the node has, in one
    /// order, and each submission's place counts everything ahead of it on the node.
    /// Quotas are still looked up by the queue's name; the counts are the line's.
    pub fn one_line(mut self) -> Dispatcher {
        self.one_line = Some(NODE_LINE);
        self
    }

    /// The line `queue` waits in.
    pub fn line<'a>(&self, queue: &'a str) -> &'a str {
        self.one_line.unwrap_or(queue)
    }

    /// Whether a quota counts a user's submissions over every queue (they share one line).
    fn every_queue(&self) -> bool {
        self.one_line.is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Line>> {
        // Plain values: a panic elsewhere while holding it leaves nothing half-done.
        self.lines.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks `who`'s quotas at `now_ms` and, within them, tags a new submission and counts
    /// it. [`Dispatcher::withdraw`] takes it back when it is not kept.
    pub fn admit(
        &self,
        who: &Who,
        now_ms: i64,
        slots: Option<u64>,
    ) -> Result<Admission, OverQuota> {
        let limit = self.limits.of(&who.queue, who.class);
        let mut lines = self.lock();
        let line = lines.entry(self.line(&who.queue).to_string()).or_default();
        let key = (who.class, who.user.clone());
        let estimate = line.estimate(self.default_estimate);
        if let Some(max) = limit.queued {
            if line.open.get(&key).copied().unwrap_or(0) >= max {
                return Err(OverQuota::Queued {
                    user: who.user.clone(),
                    queue: who.queue.clone(),
                    every_queue: self.every_queue(),
                    class: who.class.as_str(),
                    limit: max,
                    retry_after_s: line.next_end_of(&who.user, who.class, estimate, slots),
                });
            }
        }
        let recent = last_hour(&mut line.recent, &key, now_ms);
        if let Some(retry_after_s) = full(recent, limit.hourly, now_ms) {
            return Err(OverQuota::Hourly {
                user: who.user.clone(),
                queue: who.queue.clone(),
                every_queue: self.every_queue(),
                class: who.class.as_str(),
                limit: limit.hourly.unwrap_or_default(),
                retry_after_s,
            });
        }
        recent.push_back(now_ms);
        *line.open.entry(key).or_insert(0) += 1;
        let tag = line.fair.tag(who.class, &who.user, estimate);
        Ok(Admission {
            tag,
            charged: estimate,
        })
    }

    /// Checks `who`'s hourly quota and the result cache's own hourly limit (`cache_hourly`)
    /// for an answer from the cache at `now_ms` and, within them, counts it in both. It never
    /// waits or runs, so the `queued` quota does not count it.
    /// [`Dispatcher::withdraw_cached`] takes it back when it is not kept.
    pub fn admit_cached(
        &self,
        who: &Who,
        now_ms: i64,
        cache_hourly: Option<u64>,
    ) -> Result<(), OverQuota> {
        let limit = self.limits.of(&who.queue, who.class);
        let mut lines = self.lock();
        let line = lines.entry(self.line(&who.queue).to_string()).or_default();
        let key = (who.class, who.user.clone());
        let cached = last_hour(&mut line.cached, &key, now_ms);
        if let Some(retry_after_s) = full(cached, cache_hourly, now_ms) {
            return Err(OverQuota::Cached {
                user: who.user.clone(),
                queue: who.queue.clone(),
                every_queue: self.every_queue(),
                class: who.class.as_str(),
                limit: cache_hourly.unwrap_or_default(),
                retry_after_s,
            });
        }
        let recent = last_hour(&mut line.recent, &key, now_ms);
        if let Some(retry_after_s) = full(recent, limit.hourly, now_ms) {
            return Err(OverQuota::Hourly {
                user: who.user.clone(),
                queue: who.queue.clone(),
                every_queue: self.every_queue(),
                class: who.class.as_str(),
                limit: limit.hourly.unwrap_or_default(),
                retry_after_s,
            });
        }
        recent.push_back(now_ms);
        last_hour(&mut line.cached, &key, now_ms).push_back(now_ms);
        Ok(())
    }

    /// Takes back [`Dispatcher::admit_cached`]'s counts for an answer that was not kept.
    pub fn withdraw_cached(&self, who: &Who, now_ms: i64) {
        let mut lines = self.lock();
        let Some(line) = lines.get_mut(self.line(&who.queue)) else {
            return;
        };
        let key = (who.class, who.user.clone());
        for times in [&mut line.recent, &mut line.cached] {
            if let Some(t) = times.get_mut(&key) {
                if let Some(i) = t.iter().rposition(|t| *t == now_ms) {
                    t.remove(i);
                }
            }
        }
    }

    /// Takes back an admission whose submission was not kept (the store failed, or its
    /// idempotency key returned an earlier one).
    pub fn withdraw(&self, who: &Who, admission: Admission, now_ms: i64) {
        let mut lines = self.lock();
        let Some(line) = lines.get_mut(self.line(&who.queue)) else {
            return;
        };
        line.close(who.class, &who.user);
        let key = (who.class, who.user.clone());
        if let Some(recent) = line.recent.get_mut(&key) {
            if let Some(i) = recent.iter().rposition(|t| *t == now_ms) {
                recent.remove(i);
            }
        }
        line.fair
            .untag(who.class, &who.user, admission.tag, admission.charged);
    }

    /// Puts an admitted submission in its queue.
    pub fn enqueue(&self, who: &Who, id: &str, arrival_us: i64, admission: Admission) {
        let mut lines = self.lock();
        let line = lines.entry(self.line(&who.queue).to_string()).or_default();
        line.fair.push(Ticket {
            class: who.class,
            tag: admission.tag,
            arrival: arrival_us,
            id: id.to_string(),
        });
        line.waiting.insert(
            id.to_string(),
            Waiting {
                user: who.user.clone(),
                charged: admission.charged,
                since: Instant::now(),
            },
        );
    }

    /// Takes a submission that was open before a restart back, with the tag it was given.
    pub fn restore(&self, who: &Who, id: &str, tag: u64, arrival_us: i64, how: Restored) {
        let mut lines = self.lock();
        let line = lines.entry(self.line(&who.queue).to_string()).or_default();
        let charged = line.estimate(self.default_estimate);
        let ticket = Ticket {
            class: who.class,
            tag,
            arrival: arrival_us,
            id: id.to_string(),
        };
        line.fair
            .charge_restored(who.class, &who.user, tag, charged);
        if how == Restored::Started {
            line.fair.started_restored(who.class, tag);
        }
        *line.open.entry((who.class, who.user.clone())).or_insert(0) += 1;
        line.running.insert(
            id.to_string(),
            Run {
                ticket,
                user: who.user.clone(),
                class: who.class,
                charged,
                started: Instant::now(),
            },
        );
    }

    /// Learns a run of `queue` measured before a restart (oldest first), so the estimates and
    /// the charges of the submissions restored after it start from the queue's own run times,
    /// not the default.
    pub fn restore_run(&self, queue: &str, took: Duration) {
        self.lock()
            .entry(self.line(queue).to_string())
            .or_default()
            .measured(took);
    }

    /// Counts a submission accepted at `accepted_ms` (before a restart) for the hourly quota,
    /// and an answer from the result cache (`cached`) for the cache's limit too.
    pub fn restore_accepted(&self, who: &Who, accepted_ms: i64, cached: bool) {
        let mut lines = self.lock();
        let line = lines.entry(self.line(&who.queue).to_string()).or_default();
        let key = (who.class, who.user.clone());
        let mut maps = vec![&mut line.recent];
        if cached {
            maps.push(&mut line.cached);
        }
        for map in maps {
            let times = map.entry(key.clone()).or_default();
            let at = times.partition_point(|t| *t <= accepted_ms);
            times.insert(at, accepted_ms);
        }
    }

    /// The submissions to start on `queue` now: while it has a free slot (`slots`; `None`:
    /// every one).
    pub fn take(&self, queue: &str, slots: Option<u64>) -> Vec<Started> {
        let mut lines = self.lock();
        let Some(line) = lines.get_mut(self.line(queue)) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        while slots.is_none_or(|s| (line.running.len() as u64) < s) {
            let Some(t) = line.fair.pop() else { break };
            let Some(w) = line.waiting.remove(&t.id) else {
                continue;
            };
            let user_open = line
                .open
                .get(&(t.class, w.user.clone()))
                .copied()
                .unwrap_or(0);
            out.push(Started {
                id: t.id.clone(),
                waited: w.since.elapsed(),
                class: t.class,
                user_open,
            });
            let class = t.class;
            line.running.insert(
                t.id.clone(),
                Run {
                    ticket: t,
                    user: w.user,
                    class,
                    charged: w.charged,
                    started: Instant::now(),
                },
            );
        }
        out
    }

    /// A submission restored as held turned out to have its build (recovery adopted it): its
    /// tag moves its class's clock, as a start does.
    pub fn adopted(&self, queue: &str, id: &str) {
        let mut lines = self.lock();
        let Some(line) = lines.get_mut(self.line(queue)) else {
            return;
        };
        if let Some(run) = line.running.get(id) {
            let (class, tag) = (run.ticket.class, run.ticket.tag);
            line.fair.started_restored(class, tag);
        }
    }

    /// Puts a submission restored as started back in the queue: after a restart, no build
    /// of it was found, so it waits for a slot again, in its old place.
    pub fn requeue(&self, queue: &str, id: &str) {
        let mut lines = self.lock();
        let Some(line) = lines.get_mut(self.line(queue)) else {
            return;
        };
        let Some(run) = line.running.remove(id) else {
            return;
        };
        line.waiting.insert(
            id.to_string(),
            Waiting {
                user: run.user,
                charged: run.charged,
                since: run.started,
            },
        );
        line.fair.push(run.ticket);
    }

    /// A submission ended (or left the queue for good): its slot frees, and a run's measured
    /// time (`ran`: from `running` to its end) corrects its user's charge and the queue's
    /// estimate.
    pub fn ended(&self, queue: &str, id: &str, ran: Option<Duration>) {
        let mut lines = self.lock();
        let Some(line) = lines.get_mut(self.line(queue)) else {
            return;
        };
        if let Some(t) = line.fair.remove(id) {
            if let Some(w) = line.waiting.remove(id) {
                line.close(t.class, &w.user);
            }
            return;
        }
        let Some(run) = line.running.remove(id) else {
            return;
        };
        line.close(run.class, &run.user);
        if let Some(took) = ran {
            line.fair.correct(run.class, &run.user, run.charged, took);
            line.measured(took);
        }
    }

    /// Every waiting submission of `queue` with its place, in order.
    pub fn places(&self, queue: &str, slots: Option<u64>) -> Vec<(String, Place)> {
        let lines = self.lock();
        let Some(line) = lines.get(self.line(queue)) else {
            return Vec::new();
        };
        let estimate = line.estimate(self.default_estimate);
        let places = line.places(estimate, slots, Utc::now());
        line.fair
            .order()
            .map(|t| t.id.clone())
            .zip(places)
            .collect()
    }

    /// One waiting submission's place (`None`: it does not wait in `queue`'s line): what
    /// [`Dispatcher::places`] would say of it, computed only as far as it.
    pub fn place_of(&self, queue: &str, id: &str, slots: Option<u64>) -> Option<Place> {
        let lines = self.lock();
        let line = lines.get(self.line(queue))?;
        let ahead = line.fair.order().position(|t| t.id == id)?;
        let estimate = line.estimate(self.default_estimate);
        line.places_upto(estimate, slots, Utc::now(), ahead + 1)
            .pop()
    }

    /// Every line's name (a queue, or [`NODE_LINE`]), known since start.
    pub fn lines(&self) -> Vec<String> {
        let mut v: Vec<String> = self.lock().keys().cloned().collect();
        v.sort();
        v
    }

    /// Per class and user, submissions of `queue`'s line waiting or running (none listed
    /// when there are none).
    pub fn open_by(&self, queue: &str) -> Vec<(Class, String, u64)> {
        let lines = self.lock();
        let Some(line) = lines.get(self.line(queue)) else {
            return Vec::new();
        };
        line.open
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|((c, u), n)| (*c, u.clone(), *n))
            .collect()
    }

    /// The queues that have anything waiting.
    pub fn busy_queues(&self) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|(_, l)| !l.fair.is_empty())
            .map(|(q, _)| q.clone())
            .collect()
    }

    /// What `GET /v1/queues/{queue}` shows.
    pub fn status(&self, queue: &str, slots: Option<u64>) -> LineStatus {
        let lines = self.lock();
        let empty = Line::default();
        let line = lines.get(self.line(queue)).unwrap_or(&empty);
        let estimate = line.estimate(self.default_estimate);
        // A new `test` submission of a new user waits behind every `admin` and `ranked`
        // one and the `test` ones tagged at or before the class's clock; behind all of them
        // is the cautious answer.
        let places = line.places(estimate, slots, Utc::now());
        let wait = match places.last() {
            None => line.places_after(estimate, slots),
            Some(p) => {
                p.estimated_wait_s + estimate.as_secs_f64() / slots.unwrap_or(1).max(1) as f64
            }
        };
        LineStatus {
            waiting: line.fair.len() as u64,
            started: line.running.len() as u64,
            slots,
            estimated_run_s: estimate.as_secs_f64(),
            estimated_wait_s: (wait * 10.0).round() / 10.0,
        }
    }
}

impl Line {
    /// With nothing waiting: when the next slot frees, seconds (zero when one is free).
    fn places_after(&self, estimate: Duration, slots: Option<u64>) -> f64 {
        if slots.is_none_or(|s| (self.running.len() as u64) < s) {
            return 0.0;
        }
        self.running
            .values()
            .map(|r| estimate.saturating_sub(r.started.elapsed()))
            .min()
            .unwrap_or_default()
            .as_secs_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who(user: &str, class: Class) -> Who {
        Who {
            queue: "h100".into(),
            user: user.into(),
            class,
        }
    }

    #[test]
    fn queue_names() {
        for ok in ["h100", "b200.nebius", "mi300_x8", "a-b", &"q".repeat(64)] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", "h100 ", "a/b", "queue=x", &"q".repeat(65), "ü"] {
            assert!(!valid_name(bad), "{bad}");
        }
    }

    #[test]
    fn limits_parse_and_the_most_specific_rule_wins() {
        let l = Limits::parse("*:queued=10,hourly=60; h100:queued=5; */admin:queued=none,hourly=none; h100/test:hourly=3").unwrap();
        assert_eq!(
            l.of("b200", Class::Test),
            Limit {
                queued: Some(10),
                hourly: Some(60)
            }
        );
        assert_eq!(
            l.of("h100", Class::Ranked),
            Limit {
                queued: Some(5),
                hourly: Some(60)
            }
        );
        assert_eq!(
            l.of("h100", Class::Test),
            Limit {
                queued: Some(5),
                hourly: Some(3)
            }
        );
        assert_eq!(
            l.of("h100", Class::Admin),
            Limit {
                queued: Some(5),
                hourly: None
            }
        );
        assert_eq!(l.of("b200", Class::Admin), Limit::default());
        assert_eq!(
            Limits::parse("").unwrap().of("x", Class::Test),
            Limit::default()
        );
        for bad in [
            "queued=1",
            "h100:queued=0",
            "h100:queued=-1",
            "a b:queued=1",
            "*/boss:queued=1",
            "*:often=2",
            "*:queued",
        ] {
            let e = Limits::parse(bad).unwrap_err();
            assert!(e.contains(bad.split(':').next().unwrap()), "{bad}: {e}");
        }
        assert_eq!(
            Slots::parse("h100=8, *=2").unwrap().of("mi300"),
            Some(Some(2))
        );
        assert_eq!(Slots::parse("h100=8").unwrap().of("h100"), Some(Some(8)));
        assert_eq!(Slots::parse("*=none").unwrap().of("h100"), Some(None));
        assert_eq!(Slots::parse("h100=8").unwrap().of("mi300"), None);
        for bad in ["h100", "h100=0", "h100=x", "a/b=1"] {
            assert!(Slots::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_queued_limit_counts_waiting_and_running_and_frees_at_the_end() {
        let d = Dispatcher::new(
            Limits::parse("*:queued=2").unwrap(),
            Duration::from_secs(60),
        );
        let heavy = who("heavy", Class::Test);
        for i in 0..2 {
            let a = d.admit(&heavy, 0, Some(1)).unwrap();
            d.enqueue(&heavy, &format!("h{i}"), i, a);
        }
        let e = d.admit(&heavy, 0, Some(1)).unwrap_err();
        assert!(matches!(e, OverQuota::Queued { limit: 2, .. }), "{e}");
        assert!(
            e.to_string().contains("heavy") && e.retry_after_s() >= 1,
            "{e}"
        );
        // Another user and another class are counted apart.
        d.admit(&who("light", Class::Test), 0, Some(1)).unwrap();
        d.admit(&who("heavy", Class::Ranked), 0, Some(1)).unwrap();
        let started = d.take("h100", Some(1));
        assert_eq!(started.len(), 1);
        assert!(
            d.admit(&heavy, 0, Some(1)).is_err(),
            "a started one still counts"
        );
        d.ended("h100", &started[0].id, Some(Duration::from_secs(30)));
        d.admit(&heavy, 0, Some(1)).unwrap();
    }

    #[test]
    fn a_refusal_says_the_limit_and_when_to_retry_in_words() {
        let words: Vec<String> = [0, 7, 89, 90, 185, 89 * 60, 90 * 60, 5 * 3600 + 100]
            .iter()
            .map(in_words)
            .collect();
        assert_eq!(
            words,
            [
                "about 1 s",
                "about 7 s",
                "about 89 s",
                "about 2 min",
                "about 3 min",
                "about 89 min",
                "about 2 h",
                "about 5 h"
            ]
        );
        let hourly = OverQuota::Hourly {
            user: "42".into(),
            queue: "h100".into(),
            every_queue: false,
            class: "test",
            limit: 20,
            retry_after_s: 185,
        };
        assert_eq!(
            hourly.to_string(),
            "user \"42\" already sent 20 test submissions to h100 in the last hour, the most \
             per hour; the next is accepted in about 3 min"
        );
        let cached = OverQuota::Cached {
            user: "42".into(),
            queue: "h100".into(),
            every_queue: true,
            class: "test",
            limit: 1,
            retry_after_s: 3600,
        };
        assert_eq!(
            cached.to_string(),
            "user \"42\" was answered 1 test submission for any GPU of this service from the \
             result cache in the last hour, the most per hour (KERNELKITE_CACHE_HOURLY); the \
             next is accepted in about 60 min, or at once when sent with \"cache\": false, \
             which runs it"
        );
    }

    #[test]
    fn one_line_starts_no_more_than_the_node_has_in_one_order_whatever_the_queue() {
        let d = Dispatcher::new(Limits::default(), Duration::from_secs(60)).one_line();
        let on = |queue: &str, user: &str| Who::new(queue, Some(user), Class::Test);
        let users = [("h100", "a"), ("mi300", "b"), ("h100", "a"), ("mi300", "c")];
        for (n, (queue, user)) in users.into_iter().enumerate() {
            let w = on(queue, user);
            let a = d.admit(&w, 0, Some(2)).unwrap();
            d.enqueue(&w, &format!("{queue}-{user}-{n}"), n as i64, a);
        }
        assert_eq!(d.line("h100"), NODE_LINE);
        assert_eq!(d.busy_queues(), [NODE_LINE]);
        // Two slots for the node, not two per queue name: a and b first (fair share), then c
        // (a's second is behind every other user's first).
        let started: Vec<String> = d.take("h100", Some(2)).into_iter().map(|s| s.id).collect();
        assert_eq!(started, ["h100-a-0", "mi300-b-1"]);
        assert!(d.take("mi300", Some(2)).is_empty(), "the node is full");
        let waiting: Vec<(String, u64)> = d
            .places("mi300", Some(2))
            .into_iter()
            .map(|(id, p)| (id, p.position))
            .collect();
        assert_eq!(
            waiting,
            [("mi300-c-3".to_string(), 1), ("h100-a-2".to_string(), 2)]
        );
        assert_eq!(d.status("h100", Some(2)), d.status("mi300", Some(2)));
        assert_eq!(d.status("h100", Some(2)).started, 2);
        // An h100 run ends: the first in the node's line starts, an mi300 one.
        d.ended("h100", "h100-a-0", Some(Duration::from_secs(30)));
        let next: Vec<String> = d.take("h100", Some(2)).into_iter().map(|s| s.id).collect();
        assert_eq!(next, ["mi300-c-3"]);
        // Quotas are looked up by the queue's name and counted on the node's line; a
        // refusal says so in words a contestant reads (no node, no queue names).
        let d1 = Dispatcher::new(
            Limits::parse("h100:queued=1").unwrap(),
            Duration::from_secs(60),
        )
        .one_line();
        let w = on("mi300", "a");
        let a = d1.admit(&w, 0, Some(2)).unwrap();
        d1.enqueue(&w, "m", 0, a);
        let e = d1.admit(&on("h100", "a"), 0, Some(2)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "user \"a\" already has 1 test submission waiting or running on any GPU of this \
             service, the most at once; one is expected to end in about 60 s"
        );
        assert!(
            matches!(&e, OverQuota::Queued { queue, every_queue: true, .. } if queue == "h100")
        );
        d1.admit(&on("mi300", "a"), 0, Some(2)).unwrap();
        // Without one line, each queue name has its own slots.
        let d = Dispatcher::new(Limits::default(), Duration::from_secs(60));
        for (i, queue) in ["h100", "mi300"].into_iter().enumerate() {
            let w = on(queue, "a");
            let a = d.admit(&w, 0, Some(1)).unwrap();
            d.enqueue(&w, queue, i as i64, a);
        }
        assert_eq!(d.take("h100", Some(1)).len(), 1);
        assert_eq!(d.take("mi300", Some(1)).len(), 1);
    }

    #[test]
    fn cache_answers_count_toward_the_hourly_quota_and_their_own_limit_not_queued() {
        let d = Dispatcher::new(
            Limits::parse("*:queued=1,hourly=3").unwrap(),
            Duration::from_secs(60),
        );
        let u = who("u", Class::Test);
        let a = d.admit(&u, 0, Some(1)).unwrap();
        d.enqueue(&u, "run", 0, a);
        // At queued=1, answers from the cache still come (they never wait)...
        d.admit_cached(&u, 1, None).unwrap();
        d.admit_cached(&u, 2, None).unwrap();
        // ...until the hour has three accepted.
        let e = d.admit_cached(&u, 3, None).unwrap_err();
        assert!(matches!(e, OverQuota::Hourly { limit: 3, .. }), "{e}");
        // Their own limit, for another user.
        let v = who("v", Class::Test);
        d.admit_cached(&v, 0, Some(1)).unwrap();
        let e = d.admit_cached(&v, 1, Some(1)).unwrap_err();
        assert!(matches!(e, OverQuota::Cached { limit: 1, .. }), "{e}");
        assert_eq!(e.retry_after_s(), 3600, "{e}");
        assert_eq!(e.limit(), "cached");
        // An answer not kept is taken back from both counts.
        d.withdraw_cached(&v, 0);
        d.admit_cached(&v, 2, Some(1)).unwrap();
        // A restart restores both.
        let r = Dispatcher::new(Limits::default(), Duration::from_secs(60));
        r.restore_accepted(&v, 2, true);
        assert!(matches!(
            r.admit_cached(&v, 3, Some(1)),
            Err(OverQuota::Cached { .. })
        ));
        r.restore_accepted(&u, 2, false);
        r.admit_cached(&u, 3, Some(1)).unwrap();
    }

    #[test]
    fn the_hourly_limit_frees_when_the_oldest_leaves_the_hour() {
        let d = Dispatcher::new(
            Limits::parse("*:hourly=2").unwrap(),
            Duration::from_secs(60),
        );
        let u = who("u", Class::Test);
        let a = d.admit(&u, 1_000, None).unwrap();
        d.admit(&u, 2_000, None).unwrap();
        let e = d.admit(&u, 10_000, None).unwrap_err();
        assert_eq!(e.retry_after_s(), 3_591, "{e}");
        // A withdrawn admission does not count.
        d.withdraw(&u, a, 1_000);
        d.admit(&u, 10_000, None).unwrap();
        assert!(d.admit(&u, 10_001, None).is_err());
        d.admit(&u, 2_000 + HOUR_MS, None).unwrap();
    }

    #[test]
    fn slots_bound_the_starts_and_places_follow_the_start_order() {
        let d = Dispatcher::new(Limits::default(), Duration::from_secs(10));
        let mut n = 0;
        for user in ["a", "a", "a", "b", "c"] {
            let w = who(user, Class::Test);
            let adm = d.admit(&w, 0, Some(2)).unwrap();
            n += 1;
            d.enqueue(&w, &format!("{user}{n}"), n, adm);
        }
        let places = d.places("h100", Some(2));
        let waits: Vec<f64> = places.iter().map(|p| p.1.estimated_wait_s).collect();
        assert_eq!(waits, [0.0, 0.0, 10.0, 10.0, 20.0]);
        let predicted: Vec<String> = places.into_iter().map(|p| p.0).collect();
        let (mut started, mut running) = (Vec::new(), Vec::new());
        loop {
            let took: Vec<String> = d.take("h100", Some(2)).into_iter().map(|s| s.id).collect();
            assert!(running.len() + took.len() <= 2, "never more than the slots");
            started.extend(took.iter().cloned());
            running.extend(took);
            if running.is_empty() {
                break;
            }
            // What still waits is where it was said to be, in the same order.
            let ids: Vec<String> = d.places("h100", Some(2)).into_iter().map(|p| p.0).collect();
            assert!(predicted.ends_with(&ids), "{ids:?}");
            let id = running.remove(0);
            d.ended("h100", &id, Some(Duration::from_secs(10)));
        }
        assert_eq!(started, predicted);
        assert_eq!(d.status("h100", Some(2)).estimated_run_s, 10.0);
    }
}
