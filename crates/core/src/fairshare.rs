//! Who runs next on a queue: a pure value, so the order can be tested, simulated and
//! benchmarked without a service (`crate::dispatch` holds one per queue).
//!
//! **Order**: the priority class first (`admin` before `ranked` before `test`); within a class,
//! start-time fair queueing over GPU time; then arrival.
//!
//! Each class keeps a virtual clock (the tag of the last submission started, in milliseconds
//! of GPU time) and, per user, where that user's queued work ends on it. A submission is
//! tagged when it is accepted: it starts at the later of the clock and its user's end, and
//! moves the user's end on by the queue's estimated run time. The queue starts the smallest
//! tag. So a user who submits fifty at once gets tags one estimate apart and everyone else's
//! first run slots in beside their first, second beside their second: the light users are
//! served before the heavy user's second run. A user's lead over the clock is their recent
//! use; once the clock passes it (the queue served the others), it is forgotten. When a run
//! ends its measured time replaces the estimate it was charged, for the user's next
//! submissions.
//!
//! Tags are fixed at acceptance, so the order of the submissions waiting now never changes
//! except by a later arrival with a smaller tag: the place reported is the place a
//! submission starts from, and a restart that reloads the tags restores the order exactly.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

/// A submission's priority class, highest first (set by the backend only).
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// Organisers' verification runs: next whenever a slice frees.
    Admin,
    /// Ranked (leaderboard) runs.
    Ranked,
    /// Tests, benchmarks and profiles.
    #[default]
    Test,
}

impl Class {
    /// Every class, highest first.
    pub const ALL: [Class; 3] = [Class::Admin, Class::Ranked, Class::Test];

    /// The class's name in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Admin => "admin",
            Class::Ranked => "ranked",
            Class::Test => "test",
        }
    }

    /// The class named `s` (as in the API).
    pub fn parse(s: &str) -> Option<Class> {
        Class::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// The class a run config's `mode` gets when the backend names none: kernelbot's ranked
    /// runs are `leaderboard` (and its secret `private` run of a leaderboard submission).
    pub fn of_mode(mode: &str) -> Class {
        if matches!(mode, "leaderboard" | "private") {
            Class::Ranked
        } else {
            Class::Test
        }
    }
}

/// A waiting submission, as the queue orders it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ticket {
    /// Its class (ordered first).
    pub class: Class,
    /// Its start tag: milliseconds of GPU time on its class's virtual clock.
    pub tag: u64,
    /// When it was accepted, unix microseconds (ties between equal tags).
    pub arrival: i64,
    /// The submission's id (the last tie).
    pub id: String,
}

/// The waiting submissions of one queue, and where each user's work ends on each class's
/// virtual clock.
#[derive(Debug, Clone, Default)]
pub struct FairQueue {
    waiting: BTreeSet<Ticket>,
    by_id: HashMap<String, Ticket>,
    /// Per class: the tag of the last submission started.
    clock: BTreeMap<Class, u64>,
    /// Per class and user: where the user's tagged work ends.
    ends: HashMap<(Class, String), u64>,
}

impl FairQueue {
    /// An empty queue.
    pub fn new() -> FairQueue {
        FairQueue::default()
    }

    fn clock(&self, class: Class) -> u64 {
        self.clock.get(&class).copied().unwrap_or(0)
    }

    /// The start tag of a new submission of `user` in `class`, charged `cost` (the queue's
    /// estimated run time); moves the user's end on by it. [`FairQueue::untag`] takes it back
    /// when the submission is not kept after all.
    pub fn tag(&mut self, class: Class, user: &str, cost: Duration) -> u64 {
        let clock = self.clock(class);
        let end = self.ends.entry((class, user.to_string())).or_insert(0);
        let start = (*end).max(clock);
        *end = start.saturating_add(millis(cost));
        start
    }

    /// Takes back [`FairQueue::tag`]'s charge for a submission that was not kept, when no
    /// later tag of the user's was given meanwhile.
    pub fn untag(&mut self, class: Class, user: &str, tag: u64, cost: Duration) {
        if let Some(end) = self.ends.get_mut(&(class, user.to_string())) {
            if *end == tag.saturating_add(millis(cost)) {
                *end = tag;
            }
        }
    }

    /// Adds a tagged submission.
    pub fn push(&mut self, t: Ticket) {
        if let Some(old) = self.by_id.insert(t.id.clone(), t.clone()) {
            self.waiting.remove(&old);
        }
        self.waiting.insert(t);
    }

    /// A submission tagged `tag` before a restart, charged `cost`: its user's end moves past
    /// it (then [`FairQueue::push`] it if it waits, [`FairQueue::started_restored`] if it ran).
    pub fn charge_restored(&mut self, class: Class, user: &str, tag: u64, cost: Duration) {
        let end = self.ends.entry((class, user.to_string())).or_insert(0);
        *end = (*end).max(tag.saturating_add(millis(cost)));
    }

    /// A submission tagged `tag` had started before a restart: the class's clock is at least
    /// there.
    pub fn started_restored(&mut self, class: Class, tag: u64) {
        let clock = self.clock.entry(class).or_insert(0);
        *clock = (*clock).max(tag);
    }

    /// How many are waiting.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Removes a waiting submission (canceled, timed out); what it was.
    pub fn remove(&mut self, id: &str) -> Option<Ticket> {
        let t = self.by_id.remove(id)?;
        self.waiting.remove(&t);
        Some(t)
    }

    /// The submission to start now; its class's clock moves to its tag.
    pub fn pop(&mut self) -> Option<Ticket> {
        let t = self.waiting.pop_first()?;
        self.by_id.remove(&t.id);
        let clock = self.clock.entry(t.class).or_insert(0);
        *clock = (*clock).max(t.tag);
        self.forget_idle_users();
        Some(t)
    }

    /// A run ended: it was charged `charged` when it was tagged and took `took`. The user's
    /// later submissions are tagged from the corrected end (those already waiting keep
    /// their tags, so the places reported stay true).
    pub fn correct(&mut self, class: Class, user: &str, charged: Duration, took: Duration) {
        let clock = self.clock(class);
        if let Some(end) = self.ends.get_mut(&(class, user.to_string())) {
            let corrected = end
                .saturating_add(millis(took))
                .saturating_sub(millis(charged));
            *end = corrected.max(clock);
        }
    }

    /// The waiting submissions in the order they start (position 0 next), as long as nothing
    /// else arrives.
    pub fn order(&self) -> impl Iterator<Item = &Ticket> {
        self.waiting.iter()
    }

    /// Users whose end the clock has passed weigh nothing: their entries go (now and then,
    /// so the map does not grow with every user ever seen).
    fn forget_idle_users(&mut self) {
        if self.ends.len() < 1024 || !self.ends.len().is_power_of_two() {
            return;
        }
        let clock = self.clock.clone();
        self.ends
            .retain(|(class, _), end| *end > clock.get(class).copied().unwrap_or(0));
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);

    fn add(q: &mut FairQueue, id: &str, user: &str, class: Class, arrival: i64) {
        let tag = q.tag(class, user, MIN);
        q.push(Ticket {
            class,
            tag,
            arrival,
            id: id.into(),
        });
    }

    fn drain(q: &mut FairQueue) -> Vec<String> {
        std::iter::from_fn(|| q.pop().map(|t| t.id)).collect()
    }

    #[test]
    fn a_heavy_user_does_not_hold_up_the_light_ones() {
        let mut q = FairQueue::new();
        let mut n = 0;
        for i in 0..50 {
            n += 1;
            add(&mut q, &format!("heavy-{i}"), "heavy", Class::Test, n);
        }
        for u in 0..5 {
            for i in 0..2 {
                n += 1;
                add(
                    &mut q,
                    &format!("light{u}-{i}"),
                    &format!("light{u}"),
                    Class::Test,
                    n,
                );
            }
        }
        let order: Vec<String> = q.order().map(|t| t.id.clone()).collect();
        assert_eq!(order.len(), 60);
        let third_heavy = order.iter().position(|id| id == "heavy-2").unwrap();
        let last_light = order
            .iter()
            .rposition(|id| id.starts_with("light"))
            .unwrap();
        assert!(last_light < third_heavy, "{order:?}");
        // The order reported is the order they start.
        assert_eq!(drain(&mut q), order);
    }

    #[test]
    fn classes_go_first_and_a_user_s_own_runs_keep_their_order() {
        let mut q = FairQueue::new();
        add(&mut q, "t1", "a", Class::Test, 1);
        add(&mut q, "r1", "b", Class::Ranked, 2);
        add(&mut q, "t2", "a", Class::Test, 3);
        add(&mut q, "adm", "org", Class::Admin, 4);
        let ids = |q: &FairQueue| q.order().map(|t| t.id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(&q), ["adm", "r1", "t1", "t2"]);
        assert!(q.remove("r1").is_some());
        assert!(q.remove("r1").is_none());
        assert_eq!(ids(&q), ["adm", "t1", "t2"]);
        assert_eq!(q.len(), 3);
    }

    #[test]
    fn use_is_forgotten_once_the_clock_passes_it_and_measured_time_corrects_it() {
        let mut q = FairQueue::new();
        // a ran three alone: a's end is ahead of the clock, so b, who used nothing, goes first.
        for i in 0..3 {
            add(&mut q, &format!("a{i}"), "a", Class::Test, i);
        }
        drain(&mut q);
        add(&mut q, "a3", "a", Class::Test, 10);
        add(&mut q, "b0", "b", Class::Test, 11);
        assert_eq!(drain(&mut q), ["b0", "a3"]);
        // Then b ran five alone: the clock passed a's end, a's use is forgotten, b's is not.
        for i in 1..6 {
            add(&mut q, &format!("b{i}"), "b", Class::Test, 11 + i);
        }
        drain(&mut q);
        add(&mut q, "b6", "b", Class::Test, 20);
        add(&mut q, "a4", "a", Class::Test, 21);
        assert_eq!(drain(&mut q), ["a4", "b6"]);
        // c's run was charged a minute and took ten: c's next waits behind d's two.
        add(&mut q, "c0", "c", Class::Test, 30);
        q.pop();
        q.correct(Class::Test, "c", MIN, MIN * 10);
        add(&mut q, "c1", "c", Class::Test, 31);
        add(&mut q, "d0", "d", Class::Test, 32);
        add(&mut q, "d1", "d", Class::Test, 33);
        assert_eq!(drain(&mut q), ["d0", "d1", "c1"]);
    }

    #[test]
    fn a_tag_not_kept_is_taken_back_and_a_restart_restores_the_order() {
        let mut q = FairQueue::new();
        let tag = q.tag(Class::Test, "a", MIN);
        q.untag(Class::Test, "a", tag, MIN);
        assert_eq!(
            q.tag(Class::Test, "a", MIN),
            tag,
            "the charge was taken back"
        );
        let mut tickets = Vec::new();
        let mut q = FairQueue::new();
        for i in 0..20 {
            let user = ["x", "y", "z"][i % 3];
            let class = [Class::Test, Class::Ranked][i % 2];
            let tag = q.tag(class, user, MIN);
            let t = Ticket {
                class,
                tag,
                arrival: i as i64,
                id: format!("s{i}"),
            };
            tickets.push((t.clone(), user));
            q.push(t);
        }
        let started = q.pop().unwrap();
        let before: Vec<String> = q.order().map(|t| t.id.clone()).collect();
        let mut again = FairQueue::new();
        for (t, user) in tickets {
            again.charge_restored(t.class, user, t.tag, MIN);
            if t.id == started.id {
                again.started_restored(t.class, t.tag);
            } else {
                again.push(t);
            }
        }
        assert_eq!(
            again.order().map(|t| t.id.clone()).collect::<Vec<_>>(),
            before
        );
        // And new arrivals are tagged as they would have been.
        assert_eq!(
            again.tag(Class::Test, "x", MIN),
            q.tag(Class::Test, "x", MIN)
        );
    }

    #[test]
    fn ten_thousand_waiting_are_ordered_as_they_start() {
        let mut q = FairQueue::new();
        for i in 0..10_000 {
            let user = format!("u{}", i % 97);
            let class = Class::ALL[i % 3];
            add(&mut q, &format!("s{i}"), &user, class, i as i64);
        }
        let order: Vec<String> = q.order().map(|t| t.id.clone()).collect();
        assert_eq!(order.len(), 10_000);
        assert_eq!(drain(&mut q), order);
    }
}
