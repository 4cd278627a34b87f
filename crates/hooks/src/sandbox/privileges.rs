//! Dropping root: `no_new_privs`, an empty capability bounding set and ambient set,
//! supplementary groups replaced by the GPU device group (if any), then gid and uid (real,
//! effective and saved), then every remaining capability (root's, with `allow-root`). A
//! command whose evaluator runs the submission as another uid keeps three capabilities
//! instead of none (`kernelkite_sys::identity::EVALUATOR_CAPABILITIES`, in every set but the
//! bounding set's others, and ambient, so that they survive the exec of the step's shell and
//! of the runner); the system-call filter holds their use to the job's two identities.
//!
//! rustix's calls act on the calling thread only (Linux keeps credentials per thread); the
//! command's child is the only thread of its process (the hooks are single-threaded, checked
//! before each fork), so thread and process are one.

use rustix::process::{Gid, Uid};
use rustix::thread::{CapabilitySet, CapabilitySets};

use kernelkite_sys::identity::{EVALUATOR_CAPABILITIES, EVALUATOR_CAPABILITY_MASK};

use super::user::JobUser;
use super::SandboxError;

/// What the process's credentials are once dropped (from `/proc/self/status`), for the log
/// and for the check that the drop took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    /// Real, effective, saved and file-system uid.
    pub uids: Vec<u32>,
    /// Real, effective, saved and file-system gid.
    pub gids: Vec<u32>,
    /// Supplementary groups.
    pub groups: Vec<u32>,
    /// Effective, permitted, inheritable, bounding and ambient capability sets, as hex.
    pub caps: Vec<(String, u64)>,
    /// `no_new_privs`.
    pub no_new_privs: bool,
}

/// Parses the credential lines of `/proc/<pid>/status`.
pub fn parse_status(status: &str) -> Credentials {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .unwrap_or("")
            .trim()
            .to_string()
    };
    let nums = |s: String| -> Vec<u32> {
        s.split_whitespace()
            .filter_map(|n| n.parse().ok())
            .collect()
    };
    let caps = ["CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb"]
        .iter()
        .map(|n| {
            let v = u64::from_str_radix(&field(n), 16).unwrap_or(u64::MAX);
            (n.to_string(), v)
        })
        .collect();
    Credentials {
        uids: nums(field("Uid")),
        gids: nums(field("Gid")),
        groups: nums(field("Groups")),
        caps,
        no_new_privs: field("NoNewPrivs") == "1",
    }
}

impl Credentials {
    /// The process's own.
    pub fn current() -> Credentials {
        parse_status(&std::fs::read_to_string("/proc/self/status").unwrap_or_default())
    }

    /// Whether every capability set is empty.
    pub fn no_capabilities(&self) -> bool {
        self.only_capabilities(0)
    }

    /// Whether every capability set is exactly `mask` (`0`: none at all).
    pub fn only_capabilities(&self, mask: u64) -> bool {
        !self.caps.is_empty() && self.caps.iter().all(|(_, v)| *v == mask)
    }

    /// The capabilities held (the effective set), `0` when unknown.
    pub fn effective(&self) -> u64 {
        self.caps
            .iter()
            .find(|(n, _)| n == "CapEff")
            .map_or(0, |(_, v)| *v)
    }
}

/// The highest capability this kernel knows (`/proc/sys/kernel/cap_last_cap`).
fn last_capability() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(63)
        .min(63)
}

fn failed(what: &'static str) -> impl FnOnce(rustix::io::Errno) -> SandboxError {
    move |e| SandboxError::Privileges {
        what,
        source: e.into(),
    }
}

/// Becomes `user` with supplementary `groups` only, `no_new_privs`, and no capabilities or,
/// with `evaluator`, only [`EVALUATOR_CAPABILITIES`] (ambient); then checks that it took.
pub fn drop_to(
    user: &JobUser,
    groups: &[u32],
    evaluator: bool,
) -> Result<Credentials, SandboxError> {
    let kept: CapabilitySet = if evaluator && !user.is_root() {
        CapabilitySet::from_bits_retain(EVALUATOR_CAPABILITY_MASK)
    } else {
        CapabilitySet::empty()
    };
    rustix::thread::set_no_new_privs(true).map_err(failed("set no_new_privs"))?;
    // The bounding set limits what any later exec could gain; dropping needs CAP_SETPCAP,
    // which goes with the uid below, so it comes first.
    for cap in 0..=last_capability() {
        let one = CapabilitySet::from_bits_retain(1 << cap);
        if kept.contains(one) {
            continue;
        }
        match rustix::thread::remove_capability_from_bounding_set(one) {
            Ok(()) | Err(rustix::io::Errno::INVAL) => {}
            Err(e) => return Err(failed("empty the capability bounding set")(e)),
        }
    }
    rustix::thread::clear_ambient_capability_set()
        .map_err(failed("clear the ambient capabilities"))?;
    let gids: Vec<Gid> = groups.iter().map(|g| Gid::from_raw(*g)).collect();
    rustix::thread::set_thread_groups(&gids).map_err(failed("set the supplementary groups"))?;
    let gid = Gid::from_raw(user.gid);
    rustix::thread::set_thread_res_gid(gid, gid, gid).map_err(failed("set the gid"))?;
    // Leaving root clears the permitted set unless this is on (and always the ambient set).
    rustix::thread::set_keep_capabilities(!kept.is_empty())
        .map_err(failed("keep capabilities across the uid change"))?;
    let uid = Uid::from_raw(user.uid);
    rustix::thread::set_thread_res_uid(uid, uid, uid).map_err(failed("set the uid"))?;
    // A non-root uid has lost every other capability with the line above; root keeps them
    // until this.
    rustix::thread::set_capabilities(
        None,
        CapabilitySets {
            effective: kept,
            permitted: kept,
            inheritable: kept,
        },
    )
    .map_err(failed("drop the capabilities"))?;
    for cap in EVALUATOR_CAPABILITIES {
        let one = CapabilitySet::from_bits_retain(1 << cap);
        if kept.contains(one) {
            rustix::thread::configure_capability_in_ambient_set(one, true)
                .map_err(failed("keep the evaluator's capabilities across exec"))?;
        }
    }
    rustix::thread::set_keep_capabilities(false)
        .map_err(failed("stop keeping capabilities across uid changes"))?;
    let now = Credentials::current();
    let took = now.uids.iter().all(|u| *u == user.uid)
        && now.gids.iter().all(|g| *g == user.gid)
        && now.groups == {
            let mut g = groups.to_vec();
            g.sort_unstable();
            g.dedup();
            g
        }
        && now.only_capabilities(kept.bits())
        && now.no_new_privs;
    if !took {
        return Err(SandboxError::Privileges {
            what: "confirm the dropped credentials",
            source: std::io::Error::other(format!("{now:?}")),
        });
    }
    Ok(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines_give_the_credentials() {
        let status = "Name:\tsh\nUid:\t998\t998\t998\t998\nGid:\t997\t997\t997\t997\n\
                      Groups:\t44 993 \nCapInh:\t0000000000000000\nCapPrm:\t0000000000000000\n\
                      CapEff:\t0000000000000000\nCapBnd:\t0000000000000000\n\
                      CapAmb:\t0000000000000000\nNoNewPrivs:\t1\n";
        let c = parse_status(status);
        assert_eq!(c.uids, [998; 4]);
        assert_eq!(c.gids, [997; 4]);
        assert_eq!(c.groups, [44, 993]);
        assert!(c.no_capabilities());
        assert!(c.no_new_privs);
        let evaluator = parse_status(&status.replace("0000000000000000", "00000000000000e0"));
        assert!(evaluator.only_capabilities(EVALUATOR_CAPABILITY_MASK));
        assert!(!evaluator.no_capabilities());
        assert_eq!(evaluator.effective(), 0xe0);
        let root =
            parse_status(&status.replace("CapBnd:\t0000000000000000", "CapBnd:\t000001ffffffffff"));
        assert!(!root.no_capabilities());
        assert!(
            !parse_status("").no_capabilities(),
            "unreadable means not proven"
        );
    }
}
