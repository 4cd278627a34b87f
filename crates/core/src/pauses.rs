//! Keeping a quarantined slice's agent paused, where Buildkite dispatches the jobs (Buildkite
//! mode: the service cannot skip a slice itself, so it asks Buildkite to send it nothing).
//!
//! A pause is Buildkite's, per connected agent, and ends by itself after its timeout (at most
//! 10,080 minutes): so the fleet's upkeep renews it before then ([`RENEW_AFTER_MS`]), pauses
//! again an agent that reconnected (a restarted agent is a new registration, not paused), and
//! resumes the agent when its slice is released. Only pauses whose note starts with
//! [`NOTE_PREFIX`] are this service's: an operator's maintenance pause is never resumed here.
//! What is held lives in the upkeep's loop (one owner); after a restart, the roster's notes
//! say which paused agents were ours.
//!
//! Everything here is pure: [`Pauses::plan`] says what to ask, [`Pauses::done`] learns how
//! it went.

use std::collections::{BTreeMap, HashMap};

use crate::executor::{AgentInfo, PauseOutcome};

/// How every pause this service asks for starts its note.
pub const NOTE_PREFIX: &str = "kernelkite: quarantined";

/// How long each pause lasts (minutes): the most Buildkite allows, seven days.
pub const PAUSE_MINUTES: u32 = 10_080;

/// A pause is renewed after six days, a day before it would end.
pub const RENEW_AFTER_MS: i64 = 6 * 24 * 3600 * 1000;

/// After a failed call, the next try for that slice waits this long.
pub const RETRY_AFTER_MS: i64 = 60_000;

/// What to ask the executor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Act {
    /// Pause (or renew the pause of) the slice's agent.
    Pause {
        /// The slice (its agent's name).
        slice: String,
        /// The pause's note.
        note: String,
        /// A pause this service holds is near its end: renew it. Otherwise an agent found
        /// paused by this service already (the roster was older than the pause) is left so.
        renew: bool,
    },
    /// Resume the slice's agent.
    Resume {
        /// The slice.
        slice: String,
    },
}

/// A quarantined slice, as the pauses see it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Quarantined {
    /// Why (the pause's note says it).
    pub reason: String,
    /// A canary is in flight for it: its agent is resumed to take it (a paused agent takes
    /// no job, the canary included), and paused again when the canary is over.
    pub canary: bool,
    /// An operator asked for a canary on it (one is submitted at the next look).
    pub requested: bool,
}

/// The note of a slice's pause: the prefix and the quarantine's reason, cut to fit a note.
pub fn note(reason: &str) -> String {
    let reason: String = reason.chars().take(200).collect();
    format!("{NOTE_PREFIX}: {reason} (kernelkite resumes it when a canary passes or an operator releases the slice)")
}

/// Whether a pause's note is this service's.
pub fn is_ours(note: Option<&str>) -> bool {
    note.is_some_and(|n| n.starts_with(NOTE_PREFIX))
}

/// The pauses this service holds, and the slices whose last call failed.
#[derive(Debug, Default)]
pub struct Pauses {
    /// Slice → when its pause was last asked for (ms).
    held: HashMap<String, i64>,
    /// Slice → when a call for it last failed (ms).
    failed: HashMap<String, i64>,
    /// Slice → when a call for it last did what it asked (ms): the roster may be older than
    /// that for a while ([`Pauses::new`]), and is not acted on for the slice until then.
    acted: HashMap<String, i64>,
    /// How long a roster may lag behind what was done (ms).
    settle_ms: i64,
}

impl Pauses {
    /// Pauses planned from a roster read at most every `refresh` (twice that, and the upkeep's
    /// tick, pass before a roster is trusted over what was just done).
    pub fn new(refresh: std::time::Duration) -> Pauses {
        Pauses {
            settle_ms: (refresh.as_millis() as i64)
                .saturating_mul(2)
                .saturating_add(2_000),
            ..Pauses::default()
        }
    }

    /// What to ask now, given the quarantined slices and the roster (`None`: the agents are
    /// not listed one by one; then pauses are asked for blind and renewed on time).
    // Over 80 lines: one pass over the quarantined slices and one over the released, each
    // case a line or two, read together.
    pub fn plan(
        &self,
        quarantined: &BTreeMap<String, Quarantined>,
        roster: Option<&[AgentInfo]>,
        now_ms: i64,
    ) -> Vec<Act> {
        let since = |m: &HashMap<String, i64>, slice: &str, ms: i64| {
            m.get(slice).is_some_and(|t| now_ms.saturating_sub(*t) < ms)
        };
        let waiting = |slice: &str| since(&self.failed, slice, RETRY_AFTER_MS);
        let settling = |slice: &str| since(&self.acted, slice, self.settle_ms);
        let stale = |slice: &str| !since(&self.held, slice, RENEW_AFTER_MS);
        let agent = |slice: &str| roster.and_then(|r| r.iter().find(|a| a.name == slice));
        let mut acts = Vec::new();
        let mut resume: Vec<&String> = Vec::new();
        for (slice, q) in quarantined {
            if waiting(slice) {
                continue;
            }
            let pause = |renew: bool| Act::Pause {
                slice: slice.clone(),
                note: note(&q.reason),
                renew,
            };
            match (roster.is_some(), agent(slice)) {
                // Not connected: nothing to pause until it is back.
                (true, None) => {}
                // An operator's pause keeps every job away already; it is left as it is.
                (_, Some(a)) if a.paused && !is_ours(a.paused_note.as_deref()) => {}
                (_, Some(_)) if settling(slice) => {}
                // A canary waits for it: resumed while idle, paused again the moment it is
                // busy (with the canary, or a ranked job that came first: one at most).
                (_, Some(a)) if q.canary => {
                    if a.busy && !a.paused {
                        acts.push(pause(false));
                    } else if !a.busy && a.paused {
                        resume.push(slice);
                    }
                }
                (false, None) if q.canary => {
                    if self.held.contains_key(slice) {
                        resume.push(slice);
                    }
                }
                // Paused by this service: adopted from an earlier process (its pause's age
                // unknown, so renewed now), or renewed when it nears its end.
                (_, Some(a)) if a.paused => {
                    if stale(slice) {
                        acts.push(pause(true));
                    }
                }
                (_, Some(_)) => acts.push(pause(false)),
                (false, None) => {
                    if stale(slice) {
                        acts.push(pause(self.held.contains_key(slice)));
                    }
                }
            }
        }
        let mut released: Vec<&String> = self
            .held
            .keys()
            .filter(|s| !quarantined.contains_key(*s))
            .chain(resume)
            .collect();
        // A pause of ours that this process does not hold: left by an earlier one.
        if let Some(agents) = roster {
            released.extend(
                agents
                    .iter()
                    .filter(|a| a.paused && is_ours(a.paused_note.as_deref()))
                    .map(|a| &a.name)
                    .filter(|n| {
                        !quarantined.contains_key(*n) && !self.held.contains_key(*n) && !settling(n)
                    }),
            );
        }
        released.sort();
        released.dedup();
        acts.extend(
            released
                .into_iter()
                .filter(|s| !waiting(s))
                .map(|s| Act::Resume { slice: s.clone() }),
        );
        acts
    }

    /// Learns how `act` went.
    pub fn done(&mut self, act: &Act, outcome: Result<PauseOutcome, ()>, now_ms: i64) {
        match (act, outcome) {
            (Act::Pause { slice, .. } | Act::Resume { slice }, Err(())) => {
                self.failed.insert(slice.clone(), now_ms);
            }
            (Act::Pause { slice, .. }, Ok(PauseOutcome::Done)) => {
                self.failed.remove(slice);
                self.acted.insert(slice.clone(), now_ms);
                self.held.insert(slice.clone(), now_ms);
            }
            (Act::Pause { slice, .. }, Ok(_)) => {
                // Not connected, or somebody else's pause: asked again later.
                self.held.remove(slice);
                self.failed.insert(slice.clone(), now_ms);
            }
            (Act::Resume { slice }, Ok(_)) => {
                self.failed.remove(slice);
                self.acted.insert(slice.clone(), now_ms);
                self.held.remove(slice);
            }
        }
    }

    /// The slices whose pause this service holds.
    pub fn held(&self) -> Vec<String> {
        let mut v: Vec<String> = self.held.keys().cloned().collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent(name: &str, paused: Option<&str>) -> AgentInfo {
        AgentInfo {
            name: name.into(),
            paused: paused.is_some(),
            paused_note: paused.map(str::to_string),
            ..AgentInfo::default()
        }
    }

    fn q(pairs: &[(&str, &str)]) -> BTreeMap<String, Quarantined> {
        pairs
            .iter()
            .map(|(a, b)| {
                (
                    a.to_string(),
                    Quarantined {
                        reason: b.to_string(),
                        ..Quarantined::default()
                    },
                )
            })
            .collect()
    }

    const DAY: i64 = 24 * 3600 * 1000;

    #[test]
    fn a_quarantined_connected_agent_is_paused_once_and_renewed_before_the_pause_ends() {
        let mut p = Pauses::default();
        let roster = vec![agent("a", None), agent("b", None)];
        let acts = p.plan(&q(&[("a", "canary 20% slower")]), Some(&roster), 0);
        assert_eq!(acts.len(), 1);
        let Act::Pause { slice, note, .. } = &acts[0] else {
            panic!("{acts:?}")
        };
        assert_eq!(slice, "a");
        assert!(is_ours(Some(note)) && note.contains("canary 20% slower"));
        p.done(&acts[0], Ok(PauseOutcome::Done), 0);
        // Paused now: nothing more to ask, until six days have passed.
        let roster = vec![agent("a", Some(note)), agent("b", None)];
        assert!(p.plan(&q(&[("a", "x")]), Some(&roster), DAY).is_empty());
        let renew = p.plan(&q(&[("a", "x")]), Some(&roster), 6 * DAY);
        assert!(matches!(&renew[..], [Act::Pause { slice, renew: true, .. }] if slice == "a"));
        // A pause that ended early (the agent restarted, a new registration) is asked again.
        p.done(&renew[0], Ok(PauseOutcome::Done), 6 * DAY);
        let roster = vec![agent("a", None)];
        let again = p.plan(&q(&[("a", "x")]), Some(&roster), 6 * DAY + 1);
        assert!(
            matches!(&again[..], [Act::Pause { renew: false, .. }]),
            "{again:?}"
        );
    }

    #[test]
    fn a_roster_older_than_the_last_call_is_not_acted_on_and_an_inherited_pause_is_renewed() {
        let mut p = Pauses::new(std::time::Duration::from_secs(60));
        let unpaused = vec![agent("a", None)];
        let acts = p.plan(&q(&[("a", "x")]), Some(&unpaused), 0);
        assert_eq!(acts.len(), 1);
        p.done(&acts[0], Ok(PauseOutcome::Done), 0);
        // The roster read before the pause still says "not paused": no second call.
        assert!(p.plan(&q(&[("a", "x")]), Some(&unpaused), 1_000).is_empty());
        assert!(p
            .plan(&q(&[("a", "x")]), Some(&unpaused), 100_000)
            .is_empty());
        // Past two refreshes, a roster that says so is believed (the pause ended early).
        assert_eq!(p.plan(&q(&[("a", "x")]), Some(&unpaused), 130_000).len(), 1);
        // A pause of ours that this process did not make (a restart): renewed at once, its age
        // being unknown.
        let fresh = Pauses::new(std::time::Duration::from_secs(60));
        let inherited = vec![agent("a", Some(&note("x")))];
        let acts = fresh.plan(&q(&[("a", "x")]), Some(&inherited), 0);
        assert!(
            matches!(&acts[..], [Act::Pause { renew: true, .. }]),
            "{acts:?}"
        );
    }

    #[test]
    fn an_agent_not_connected_waits_and_an_operator_s_pause_is_left_alone() {
        let p = Pauses::default();
        assert!(p.plan(&q(&[("a", "x")]), Some(&[]), 0).is_empty());
        let roster = vec![agent("a", Some("maintenance: new PSU"))];
        assert!(p.plan(&q(&[("a", "x")]), Some(&roster), 0).is_empty());
        // Released, an operator's pause is not resumed either.
        assert!(p.plan(&q(&[]), Some(&roster), 0).is_empty());
    }

    #[test]
    fn a_released_slice_is_resumed_and_so_is_a_pause_an_earlier_process_left() {
        let mut p = Pauses::default();
        let pause = Act::Pause {
            slice: "a".into(),
            note: note("x"),
            renew: false,
        };
        p.done(&pause, Ok(PauseOutcome::Done), 0);
        let roster = vec![agent("a", Some(&note("x"))), agent("c", Some(&note("old")))];
        let acts = p.plan(&q(&[]), Some(&roster), 1);
        assert_eq!(
            acts,
            [
                Act::Resume { slice: "a".into() },
                Act::Resume { slice: "c".into() }
            ]
        );
        for a in &acts {
            p.done(a, Ok(PauseOutcome::Done), 1);
        }
        assert!(p.held().is_empty());
    }

    #[test]
    fn a_canary_in_flight_has_the_agent_resumed_while_idle_and_paused_again_after() {
        let mut p = Pauses::default();
        let pause = Act::Pause {
            slice: "a".into(),
            note: note("slow"),
            renew: false,
        };
        p.done(&pause, Ok(PauseOutcome::Done), 0);
        let mut quarantined = q(&[("a", "slow")]);
        quarantined.get_mut("a").unwrap().canary = true;
        let paused = vec![agent("a", Some(&note("slow")))];
        assert_eq!(
            p.plan(&quarantined, Some(&paused), 1),
            [Act::Resume { slice: "a".into() }]
        );
        // Busy (the canary runs), or resumed already: nothing to do.
        let mut busy = agent("a", Some(&note("slow")));
        busy.busy = true;
        assert!(p.plan(&quarantined, Some(&[busy]), 1).is_empty());
        p.done(
            &Act::Resume { slice: "a".into() },
            Ok(PauseOutcome::Done),
            1,
        );
        assert!(p
            .plan(&quarantined, Some(&[agent("a", None)]), 2)
            .is_empty());
        // The canary is over and the slice still quarantined: paused again.
        quarantined.get_mut("a").unwrap().canary = false;
        let again = p.plan(&quarantined, Some(&[agent("a", None)]), 3);
        assert!(
            matches!(&again[..], [Act::Pause { renew: false, .. }]),
            "{again:?}"
        );
        // An operator's pause is never resumed for a canary.
        quarantined.get_mut("a").unwrap().canary = true;
        assert!(p
            .plan(&quarantined, Some(&[agent("a", Some("maintenance"))]), 4)
            .is_empty());
    }

    #[test]
    fn without_a_roster_pauses_are_asked_blind_and_a_failure_waits_a_minute() {
        let mut p = Pauses::default();
        let acts = p.plan(&q(&[("a", "x")]), None, 0);
        assert_eq!(acts.len(), 1);
        p.done(&acts[0], Err(()), 0);
        assert!(p
            .plan(&q(&[("a", "x")]), None, RETRY_AFTER_MS - 1)
            .is_empty());
        let acts = p.plan(&q(&[("a", "x")]), None, RETRY_AFTER_MS);
        assert_eq!(acts.len(), 1);
        p.done(&acts[0], Ok(PauseOutcome::Done), RETRY_AFTER_MS);
        assert!(p
            .plan(&q(&[("a", "x")]), None, RETRY_AFTER_MS + DAY)
            .is_empty());
        assert_eq!(p.held(), ["a"]);
    }
}
