//! Who runs next on a queue (issue 25, the policy alone; not yet wired to the service): a pure
//! value, so the order can be tested, simulated and benchmarked without a service.
//!
//! Order: the priority class first (`admin` before `ranked` before `test`); within a class,
//! the user who used least of the queue's GPU time recently (decayed: each second of use
//! counts half after `half_life`); then arrival. A user's own submissions run in arrival order.
//! A start is charged the queue's estimated duration and corrected by the measured one when it
//! finishes, so a user who submits dozens at once falls behind after the first start, not after
//! the first finish.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

/// A submission's priority class, highest first (set by the backend only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    /// Organisers' verification runs: next whenever a slice frees.
    Admin,
    /// Ranked (leaderboard) runs.
    Ranked,
    /// Tests and benchmarks.
    Test,
}

/// One waiting submission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiting {
    /// The submission.
    pub id: String,
    /// Who submitted it (the backend's user id).
    pub user: String,
    /// Its class.
    pub class: Class,
}

/// A user's recent use of the queue: `value` GPU-seconds as of `at` (seconds on the queue's
/// clock), decaying with the queue's half-life.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Usage {
    value: f64,
    at: f64,
}

impl Usage {
    fn at(self, now: f64, half_life: f64) -> f64 {
        let age = (now - self.at).max(0.0);
        self.value * (-age / half_life).exp2()
    }

    fn add(&mut self, secs: f64, now: f64, half_life: f64) {
        self.value = self.at(now, half_life) + secs;
        self.at = now;
    }
}

/// The waiting submissions of one queue and its users' recent use.
#[derive(Debug, Clone)]
pub struct FairQueue {
    half_life: f64,
    /// Per class, per user: that user's waiting submissions, oldest first, each with its
    /// arrival number.
    waiting: BTreeMap<Class, BTreeMap<String, VecDeque<(u64, String)>>>,
    usage: BTreeMap<String, Usage>,
    arrivals: u64,
}

impl FairQueue {
    /// An empty queue whose users' use counts half after `half_life`.
    pub fn new(half_life: Duration) -> FairQueue {
        FairQueue {
            half_life: half_life.as_secs_f64().max(1.0),
            waiting: BTreeMap::new(),
            usage: BTreeMap::new(),
            arrivals: 0,
        }
    }

    /// Adds a submission at the back of its user's line.
    pub fn push(&mut self, w: Waiting) {
        self.arrivals += 1;
        self.waiting
            .entry(w.class)
            .or_default()
            .entry(w.user)
            .or_default()
            .push_back((self.arrivals, w.id));
    }

    /// How many are waiting.
    pub fn len(&self) -> usize {
        self.waiting
            .values()
            .flat_map(|u| u.values())
            .map(VecDeque::len)
            .sum()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes a waiting submission (cancelled); whether it was there.
    pub fn remove(&mut self, id: &str) -> bool {
        for users in self.waiting.values_mut() {
            for line in users.values_mut() {
                if let Some(i) = line.iter().position(|(_, w)| w == id) {
                    line.remove(i);
                    users.retain(|_, l| !l.is_empty());
                    return true;
                }
            }
        }
        false
    }

    /// The submission to start now (at `now` seconds), charged `estimate` of GPU time to its
    /// user; `None` when nothing waits.
    pub fn start(&mut self, now: f64, estimate: Duration) -> Option<Waiting> {
        let (class, user) = self.pick(now)?;
        let users = self.waiting.get_mut(&class)?;
        let line = users.get_mut(&user)?;
        let (_, id) = line.pop_front()?;
        if line.is_empty() {
            users.remove(&user);
        }
        self.usage.entry(user.clone()).or_default().add(
            estimate.as_secs_f64(),
            now,
            self.half_life,
        );
        Some(Waiting { id, user, class })
    }

    /// A finished run's correction: it was charged `estimate` at its start and took `took`.
    pub fn finished(&mut self, user: &str, estimate: Duration, took: Duration, now: f64) {
        let delta = took.as_secs_f64() - estimate.as_secs_f64();
        let usage = self.usage.entry(user.to_string()).or_default();
        usage.add(delta, now, self.half_life);
        usage.value = usage.value.max(0.0);
    }

    /// Every waiting submission in the order they would start if nothing else arrived and
    /// each start were charged `estimate`: position 0 starts next. One heap of users per
    /// class (least used, then earliest waiting): O(n log users).
    pub fn order(&self, now: f64, estimate: Duration) -> Vec<String> {
        use std::cmp::Reverse;
        let mut out = Vec::with_capacity(self.len());
        let mut charged: BTreeMap<&str, f64> = BTreeMap::new();
        for users in self.waiting.values() {
            let mut heap = std::collections::BinaryHeap::new();
            let key = |user: &str, charged: &BTreeMap<&str, f64>| {
                self.used(user, now) + charged.get(user).copied().unwrap_or(0.0)
            };
            for (user, line) in users {
                if let Some((arrival, _)) = line.front() {
                    heap.push(Reverse((
                        Used(key(user, &charged)),
                        *arrival,
                        user.as_str(),
                        0,
                    )));
                }
            }
            while let Some(Reverse((_, _, user, at))) = heap.pop() {
                let line = &users[user];
                out.push(line[at].1.clone());
                *charged.entry(user).or_default() += estimate.as_secs_f64();
                if let Some((arrival, _)) = line.get(at + 1) {
                    heap.push(Reverse((Used(key(user, &charged)), *arrival, user, at + 1)));
                }
            }
        }
        out
    }

    /// `user`'s recent GPU-seconds as of `now`.
    fn used(&self, user: &str, now: f64) -> f64 {
        self.usage
            .get(user)
            .map_or(0.0, |u| u.at(now, self.half_life))
    }

    /// The class and user whose next submission goes first: the highest class with anyone
    /// waiting, its least-used user, then the earliest waiting.
    fn pick(&self, now: f64) -> Option<(Class, String)> {
        for (class, users) in &self.waiting {
            let best = users
                .iter()
                .filter_map(|(user, line)| {
                    let (arrival, _) = line.front()?;
                    Some((Used(self.used(user, now)), *arrival, user))
                })
                .min();
            if let Some((_, _, user)) = best {
                return Some((*class, user.clone()));
            }
        }
        None
    }
}

/// GPU-seconds, ordered (never NaN: sums of durations and their decay).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Used(f64);

impl Eq for Used {}

impl PartialOrd for Used {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Used {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(id: &str, user: &str, class: Class) -> Waiting {
        Waiting {
            id: id.into(),
            user: user.into(),
            class,
        }
    }

    const MIN: Duration = Duration::from_secs(60);

    #[test]
    fn a_heavy_user_does_not_hold_up_the_light_ones() {
        let mut q = FairQueue::new(Duration::from_secs(3600));
        for i in 0..50 {
            q.push(w(&format!("heavy-{i}"), "heavy", Class::Test));
        }
        for u in 0..5 {
            for i in 0..2 {
                q.push(w(
                    &format!("light{u}-{i}"),
                    &format!("light{u}"),
                    Class::Test,
                ));
            }
        }
        let order = q.order(0.0, MIN);
        assert_eq!(order.len(), 60);
        let tenth_heavy = order.iter().position(|id| id == "heavy-9").unwrap();
        let last_light = order
            .iter()
            .rposition(|id| id.starts_with("light"))
            .unwrap();
        assert!(last_light < tenth_heavy, "{order:?}");
        // The order `order` predicts is the order `start` gives.
        let mut started = Vec::new();
        while let Some(s) = q.start(0.0, MIN) {
            started.push(s.id);
        }
        assert_eq!(started, order);
    }

    #[test]
    fn ten_thousand_waiting_are_ordered_as_they_start() {
        let mut q = FairQueue::new(Duration::from_secs(3600));
        for i in 0..10_000 {
            let user = format!("u{}", i % 97);
            let class = [Class::Test, Class::Ranked, Class::Admin][i % 3];
            q.push(w(&format!("s{i}"), &user, class));
        }
        let order = q.order(0.0, MIN);
        let mut started = Vec::new();
        while let Some(s) = q.start(0.0, MIN) {
            started.push(s.id);
        }
        assert_eq!(order.len(), 10_000);
        assert_eq!(started, order);
    }

    #[test]
    fn classes_go_first_and_a_user_s_own_runs_keep_their_order() {
        let mut q = FairQueue::new(Duration::from_secs(3600));
        q.push(w("t1", "a", Class::Test));
        q.push(w("r1", "b", Class::Ranked));
        q.push(w("t2", "a", Class::Test));
        q.push(w("adm", "org", Class::Admin));
        assert_eq!(q.order(0.0, MIN), ["adm", "r1", "t1", "t2"]);
        assert!(q.remove("r1"));
        assert!(!q.remove("r1"));
        assert_eq!(q.order(0.0, MIN), ["adm", "t1", "t2"]);
        assert_eq!(q.len(), 3);
    }

    #[test]
    fn recent_use_decays_and_measured_time_corrects_the_estimate() {
        let half = Duration::from_secs(100);
        let mut q = FairQueue::new(half);
        q.push(w("a1", "a", Class::Test));
        assert_eq!(q.start(0.0, MIN).unwrap().id, "a1");
        // a has used 60 s; b nothing: b goes first.
        q.push(w("a2", "a", Class::Test));
        q.push(w("b1", "b", Class::Test));
        assert_eq!(q.order(1.0, MIN), ["b1", "a2"]);
        // a's run took no time at all: corrected to nothing used, a's older arrival wins.
        q.finished("a", MIN, Duration::ZERO, 1.0);
        assert_eq!(q.order(1.0, MIN), ["a2", "b1"]);
        // Use fades: 60 s used 10 half-lives ago is less than 1 s used now.
        let mut q = FairQueue::new(half);
        q.push(w("a1", "a", Class::Test));
        q.start(0.0, MIN);
        q.push(w("b1", "b", Class::Test));
        q.start(1000.0, Duration::from_secs(1));
        q.push(w("a2", "a", Class::Test));
        q.push(w("b2", "b", Class::Test));
        assert_eq!(q.order(1000.0, MIN)[0], "a2");
    }
}
