//! The two identities of a sandboxed job, and how the sandbox tells the evaluator the second.
//!
//! The job's command (the step's shell, then the runner) runs as the slice's job user. The
//! submission the runner evaluates runs as another uid, the slice's *submission* identity, so
//! the kernel's own rules keep it from signalling, tracing or reading the runner and from
//! writing where the runner writes `result.json`. The sandbox hands the command the three
//! capabilities that switch (`CAP_SETUID`, `CAP_SETGID`) and clean up (`CAP_KILL`), as ambient
//! capabilities, with a system-call filter that lets `set*id` name only the two identities,
//! and names the submission identity in [`SUBMISSION_USER_ENV`]. The runner drops to it, and
//! drops every capability, in each harness process before it executes
//! ([`crate::raw::harden_before_exec`]).

/// The variable in which the sandbox names the submission identity, as `uid:gid`.
pub const SUBMISSION_USER_ENV: &str = "KERNELKITE_SUBMISSION_USER";

/// `CAP_KILL`, `CAP_SETGID` and `CAP_SETUID` (include/uapi/linux/capability.h): what the
/// command keeps so that its evaluator can run the submission as the submission identity and
/// kill it afterwards.
pub const EVALUATOR_CAPABILITIES: [u32; 3] = [5, 6, 7];

/// [`EVALUATOR_CAPABILITIES`] as a capability mask (`/proc/<pid>/status`'s hex).
pub const EVALUATOR_CAPABILITY_MASK: u64 = (1 << 5) | (1 << 6) | (1 << 7);

/// A uid and gid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ids {
    /// The user id.
    pub uid: u32,
    /// The (primary) group id.
    pub gid: u32,
}

impl Ids {
    /// The value of [`SUBMISSION_USER_ENV`] naming these ids.
    pub fn to_env(self) -> String {
        format!("{}:{}", self.uid, self.gid)
    }

    /// Reads a [`SUBMISSION_USER_ENV`] value; `None` unless it is `uid:gid`, neither root's
    /// nor `-1` (which `set*id` reads as "unchanged").
    pub fn from_env(value: &str) -> Option<Ids> {
        let (uid, gid) = value.trim().split_once(':')?;
        let ids = Ids {
            uid: uid.parse().ok()?,
            gid: gid.parse().ok()?,
        };
        let usable = |id: u32| id != 0 && id != u32::MAX;
        (usable(ids.uid) && usable(ids.gid)).then_some(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_round_trips_and_root_or_garbage_is_refused() {
        let ids = Ids {
            uid: 1_960_000_003,
            gid: 1_960_000_003,
        };
        assert_eq!(Ids::from_env(&ids.to_env()), Some(ids));
        for bad in [
            "",
            "5",
            "0:5",
            "5:0",
            "a:b",
            "5:5:5",
            "-1:5",
            "4294967295:5",
            "5:4294967295",
        ] {
            assert_eq!(Ids::from_env(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_mask_is_the_list() {
        let mask = EVALUATOR_CAPABILITIES
            .iter()
            .fold(0u64, |m, c| m | (1u64 << c));
        assert_eq!(mask, EVALUATOR_CAPABILITY_MASK);
        use rustix::thread::CapabilitySet;
        let named = CapabilitySet::KILL | CapabilitySet::SETGID | CapabilitySet::SETUID;
        assert_eq!(named.bits(), EVALUATOR_CAPABILITY_MASK);
    }
}
