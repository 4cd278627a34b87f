//! One rate-limit budget for every Buildkite call, fed by the `RateLimit-*` headers of every
//! answer.
//!
//! Buildkite counts requests per organization (`RateLimit-*`, 200/min) and per token
//! (`RateLimit-User-*`, 50/min) in windows that reset `RateLimit-Reset` seconds from now. The
//! budget keeps the smaller `Remaining` and its reset, spends one unit per call as it goes out
//! (so a crowd of waiting calls cannot all leave at once), and when it is spent makes callers
//! wait for the reset instead of earning `429`s. Calls have priorities: collecting a finished
//! build's result may spend the last units, creating builds keeps a small reserve for it, and
//! the reconciler keeps a larger one, so reconciliation yields to results.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Who is asking; lower is more urgent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Priority {
    /// Collecting a finished build's result, canceling a build: may spend the last unit.
    Result,
    /// Creating a build (and looking one up after an ambiguous create).
    Create,
    /// The reconciler's listings: yields to everything else.
    Reconcile,
}

impl Priority {
    /// Units left for the more urgent callers, in a window of `limit` calls (when known). A
    /// reserve is at most a quarter of the window: in a tiny one (Buildkite's limits are
    /// configurable, a proxy may say less) a fixed reserve would be the whole window, and
    /// every create would wait for a unit that never frees.
    fn reserve(self, limit: Option<u64>) -> u64 {
        let fixed = match self {
            Priority::Result => 0,
            Priority::Create => 2,
            Priority::Reconcile => 5,
        };
        limit.map_or(fixed, |l| fixed.min(l / 4))
    }
}

#[derive(Debug)]
struct State {
    /// Calls left in this window; `None`: not known (nothing heard yet, or the window reset
    /// with no limit known).
    remaining: Option<u64>,
    /// The window's size, when an answer said it.
    limit: Option<u64>,
    /// When the window resets.
    reset_at: Instant,
    /// `reset_at` came from an answer (false right after a refill, until one arrives).
    reset_known: bool,
}

/// The shared budget.
#[derive(Debug)]
pub struct RateBudget {
    state: Mutex<State>,
    max_wait: Duration,
}

/// What an answer's headers say about the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observed {
    /// The smaller of the organization's and the token's remaining calls.
    pub remaining: u64,
    /// That limit's window size, when given.
    pub limit: Option<u64>,
    /// Seconds until that limit's window resets.
    pub reset_s: u64,
}

/// Reads `RateLimit-*` and `RateLimit-User-*`: the tighter of the two decides.
pub fn observe_headers(headers: &reqwest::header::HeaderMap) -> Option<Observed> {
    let num = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    let org = num("ratelimit-remaining").map(|r| Observed {
        remaining: r,
        limit: num("ratelimit-limit"),
        reset_s: num("ratelimit-reset").unwrap_or(1),
    });
    let user = num("ratelimit-user-remaining").map(|r| Observed {
        remaining: r,
        limit: num("ratelimit-user-limit"),
        reset_s: num("ratelimit-user-reset").unwrap_or(1),
    });
    // A window holds at most the smaller limit, whichever is spent now.
    let limit = match (num("ratelimit-limit"), num("ratelimit-user-limit")) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let tighter = match (org, user) {
        (Some(a), Some(b)) if a.remaining == b.remaining => Some(Observed {
            reset_s: a.reset_s.max(b.reset_s),
            ..a
        }),
        (Some(a), Some(b)) => Some(if a.remaining < b.remaining { a } else { b }),
        (a, b) => a.or(b),
    };
    tighter.map(|o| Observed { limit, ..o })
}

impl RateBudget {
    /// A budget that knows nothing yet; no wait is longer than `max_wait`.
    pub fn new(max_wait: Duration) -> RateBudget {
        RateBudget {
            state: Mutex::new(State {
                remaining: None,
                limit: None,
                reset_at: Instant::now(),
                reset_known: true,
            }),
            max_wait,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How long a caller of `priority` must wait before it may call, taking one unit when it
    /// may go now (`Duration::ZERO`).
    pub fn try_take(&self, priority: Priority, now: Instant) -> Duration {
        let mut s = self.lock();
        if now >= s.reset_at {
            // A new window: as much as the last limit said, or unknown. Its end is not known
            // until an answer from it says so; until then this window's units are all there
            // is.
            s.remaining = s.limit;
            s.reset_at = now + self.max_wait;
            s.reset_known = false;
        }
        match s.remaining {
            None => Duration::ZERO,
            Some(r) if r > priority.reserve(s.limit) => {
                s.remaining = Some(r - 1);
                Duration::ZERO
            }
            // The window's end is not known yet: an answer will say it soon.
            Some(_) if !s.reset_known => Duration::from_millis(20),
            Some(_) => s
                .reset_at
                .saturating_duration_since(now)
                .max(Duration::from_millis(5)),
        }
    }

    /// Waits until a caller of `priority` may call, and takes a unit. Returns how long it
    /// waited.
    pub async fn acquire(&self, priority: Priority) -> Duration {
        let start = Instant::now();
        loop {
            let wait = self.try_take(priority, Instant::now());
            if wait.is_zero() {
                return start.elapsed();
            }
            // Looked at again at least every 250 ms: an answer may move the reset.
            tokio::time::sleep(wait.min(self.max_wait).min(Duration::from_millis(250))).await;
        }
    }

    /// Takes in an answer: its headers say what is left; a `429` says nothing is.
    pub fn observe(&self, headers: &reqwest::header::HeaderMap, rate_limited: bool, now: Instant) {
        let seen = observe_headers(headers);
        let mut s = self.lock();
        if let Some(o) = seen {
            if o.limit.is_some() {
                s.limit = o.limit;
            }
            let reset_at = now + Duration::from_secs(o.reset_s).min(self.max_wait);
            // Within the window the lower figure wins: answers arrive out of order (an early
            // one still says more is left), and calls already sent are counted here first.
            // After a reset the local figure was refilled from the limit, so it is never
            // the stale one.
            let remaining = s.remaining.map_or(o.remaining, |l| l.min(o.remaining));
            // A 429 names the reset that matters; otherwise answers of one window agree
            // on its end up to rounding, and the later end is kept.
            let reset_at = if !rate_limited && s.reset_known && now < s.reset_at {
                reset_at.max(s.reset_at)
            } else {
                reset_at
            };
            s.remaining = Some(if rate_limited { 0 } else { remaining });
            s.reset_at = reset_at;
            s.reset_known = true;
        } else if rate_limited {
            s.remaining = Some(0);
            s.reset_at = now + Duration::from_secs(1).min(self.max_wait);
            s.reset_known = true;
        }
    }

    /// Calls left in the current window, when known.
    pub fn remaining(&self) -> Option<u64> {
        self.lock().remaining
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderMap;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn the_tighter_limit_decides() {
        let h = headers(&[
            ("RateLimit-Remaining", "150"),
            ("RateLimit-Limit", "200"),
            ("RateLimit-Reset", "5"),
            ("RateLimit-User-Remaining", "3"),
            ("RateLimit-User-Limit", "50"),
            ("RateLimit-User-Reset", "40"),
        ]);
        assert_eq!(
            observe_headers(&h),
            Some(Observed {
                remaining: 3,
                limit: Some(50),
                reset_s: 40
            })
        );
        assert_eq!(observe_headers(&HeaderMap::new()), None);
    }

    #[test]
    fn priorities_keep_reserves_and_a_spent_budget_waits_for_the_reset() {
        let b = RateBudget::new(Duration::from_secs(60));
        let now = Instant::now();
        assert_eq!(
            b.try_take(Priority::Reconcile, now),
            Duration::ZERO,
            "unknown: go"
        );
        b.observe(
            &headers(&[
                ("RateLimit-Remaining", "6"),
                ("RateLimit-Limit", "200"),
                ("RateLimit-Reset", "10"),
            ]),
            false,
            now,
        );
        assert_eq!(b.try_take(Priority::Reconcile, now), Duration::ZERO);
        // 5 left: the reconciler keeps 5 for the others.
        assert!(b.try_take(Priority::Reconcile, now) >= Duration::from_secs(9));
        for _ in 0..3 {
            assert_eq!(b.try_take(Priority::Create, now), Duration::ZERO);
        }
        assert!(
            b.try_take(Priority::Create, now) > Duration::ZERO,
            "2 kept for results"
        );
        assert_eq!(b.try_take(Priority::Result, now), Duration::ZERO);
        assert_eq!(b.try_take(Priority::Result, now), Duration::ZERO);
        assert!(b.try_take(Priority::Result, now) > Duration::ZERO);
        // After the reset the window is full again.
        let later = now + Duration::from_secs(11);
        assert_eq!(b.try_take(Priority::Reconcile, later), Duration::ZERO);
        assert_eq!(b.remaining(), Some(199));
    }

    /// Issue 21, item 8: with `RateLimit-Limit: 2` the creates' fixed reserve of 2 was the
    /// whole window, so no create ever went out.
    #[test]
    fn a_tiny_window_still_lets_creates_and_the_reconciler_through() {
        let b = RateBudget::new(Duration::from_secs(60));
        let now = Instant::now();
        b.observe(
            &headers(&[
                ("RateLimit-Remaining", "0"),
                ("RateLimit-Limit", "2"),
                ("RateLimit-Reset", "1"),
            ]),
            false,
            now,
        );
        assert!(b.try_take(Priority::Create, now) > Duration::ZERO);
        let next = now + Duration::from_secs(2);
        assert_eq!(b.try_take(Priority::Create, next), Duration::ZERO);
        assert_eq!(b.try_take(Priority::Reconcile, next), Duration::ZERO);
        assert!(b.try_take(Priority::Result, next) > Duration::ZERO, "spent");
        // A window of 8 keeps 2 for results, as the fixed reserve says.
        let c = RateBudget::new(Duration::from_secs(60));
        c.observe(
            &headers(&[
                ("RateLimit-Remaining", "2"),
                ("RateLimit-Limit", "8"),
                ("RateLimit-Reset", "10"),
            ]),
            false,
            now,
        );
        assert!(c.try_take(Priority::Create, now) > Duration::ZERO);
        assert_eq!(c.try_take(Priority::Result, now), Duration::ZERO);
    }

    #[test]
    fn a_429_spends_the_budget_until_its_reset() {
        let b = RateBudget::new(Duration::from_secs(60));
        let now = Instant::now();
        b.observe(&headers(&[("RateLimit-Reset", "3")]), true, now);
        let wait = b.try_take(Priority::Result, now);
        assert!(wait > Duration::from_millis(900), "{wait:?}");
        assert_eq!(
            b.try_take(Priority::Result, now + Duration::from_secs(2)),
            Duration::ZERO
        );
    }
}
