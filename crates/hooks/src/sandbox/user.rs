//! Who the command runs as: the plugin's `user` option (a name, a uid or `uid:gid`) looked up
//! in `<root>/etc/passwd`.
//!
//! Read from the file rather than through NSS (`getpwnam`): the job user is a local system
//! account node set-up creates (`kernelkite-isolate setup`, `useradd --system`), the lookup runs
//! in a hook that must not load NSS modules, and tests point the root at a fixture. An account
//! that lives only in a directory service can still be named by number (`user: "1500:1500"`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use kernelkite_sys::node::JOB_USER as DEFAULT_JOB_USER;

/// The account the command runs as.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobUser {
    /// The user name (`uid N` when named by a number `/etc/passwd` does not list).
    pub name: String,
    /// Its uid.
    pub uid: u32,
    /// Its primary gid.
    pub gid: u32,
}

impl JobUser {
    /// The account `setup` makes, as the unit tests name it.
    #[cfg(test)]
    pub(crate) fn example() -> JobUser {
        JobUser {
            name: DEFAULT_JOB_USER.into(),
            uid: 998,
            gid: 997,
        }
    }

    /// Whether this is root.
    pub fn is_root(&self) -> bool {
        self.uid == 0
    }
}

/// Why the job user cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    /// The default job user has not been created on this node.
    #[error("the job user {DEFAULT_JOB_USER:?} does not exist on this node; create it with `kernelkite-isolate setup` (or `useradd --system --no-create-home --shell /usr/sbin/nologin {DEFAULT_JOB_USER}`)")]
    MissingDefault,
    /// A user the step names does not exist.
    #[error("the job user {name:?} (plugin option `user`) does not exist on this node; create it (`useradd --system --no-create-home --shell /usr/sbin/nologin {name}`) or name one that does")]
    Missing {
        /// The name asked for.
        name: String,
    },
    /// `/etc/passwd` cannot be read.
    #[error("cannot read {path} to look up the job user")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// `/etc/passwd` entries as (name, uid, gid): `kernelkite_sys::passwd`, which skips comments.
fn entries(passwd: &str) -> impl Iterator<Item = (&str, u32, u32)> {
    kernelkite_sys::passwd::entries(passwd).map(|e| (e.name, e.uid, e.gid))
}

/// Looks `user` up in a `/etc/passwd` text: a name, a uid (its primary group from the file,
/// else the same number) or `uid:gid` (as given).
pub fn lookup(passwd: &str, user: &str) -> Result<JobUser, UserError> {
    let numeric = |s: &str| s.parse::<u32>().ok();
    let by_uid = |uid: u32| entries(passwd).find(|e| e.1 == uid);
    let name_of = |uid: u32| by_uid(uid).map_or_else(|| format!("uid {uid}"), |e| e.0.to_string());
    if let Some((uid, gid)) = user.split_once(':') {
        if let (Some(uid), Some(gid)) = (numeric(uid), numeric(gid)) {
            return Ok(JobUser {
                name: name_of(uid),
                uid,
                gid,
            });
        }
    }
    if let Some(uid) = numeric(user) {
        let gid = by_uid(uid).map_or(uid, |e| e.2);
        return Ok(JobUser {
            name: name_of(uid),
            uid,
            gid,
        });
    }
    match entries(passwd).find(|e| e.0 == user) {
        Some((name, uid, gid)) => Ok(JobUser {
            name: name.to_string(),
            uid,
            gid,
        }),
        None if user == DEFAULT_JOB_USER => Err(UserError::MissingDefault),
        None => Err(UserError::Missing {
            name: user.to_string(),
        }),
    }
}

/// The first of the ids reserved for per-slice job identities: slice `n`'s command runs as uid
/// and gid `SLICE_ID_BASE + n`. Above systemd's container ranges and below 2^31 (some tools
/// read ids as signed), where no distribution allocates accounts; a node whose `/etc/passwd`
/// names one of them is refused (see [`for_slice`]).
pub const SLICE_ID_BASE: u32 = 1_950_000_000;

/// The first of the ids reserved for per-slice submission identities: on slice `n` the
/// evaluator runs the submission as uid and gid `SUBMISSION_ID_BASE + n`
/// (`kernelkite_sys::identity`). Ten million above [`SLICE_ID_BASE`], so the two ranges never
/// meet.
pub const SUBMISSION_ID_BASE: u32 = 1_960_000_000;

/// Why a per-slice identity cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("uid {uid} (reserved by kernelkite for slice {slice}'s {what}) belongs to the account {account:?} on this node; remove or renumber that account{hint}")]
pub struct SliceIdTaken {
    /// The slice.
    pub slice: u32,
    /// The reserved id.
    pub uid: u32,
    /// Who has it.
    pub account: String,
    /// Which identity: "jobs" or "submissions".
    pub what: &'static str,
    /// What else the operator can do.
    pub hint: &'static str,
}

/// The identity `base + slice` named `<prefix>-<slice>`, unless `passwd` gives that uid or gid
/// to an account.
fn reserved(
    passwd: &str,
    base: u32,
    prefix: &str,
    slice: u32,
    what: &'static str,
    hint: &'static str,
) -> Result<JobUser, SliceIdTaken> {
    let id = base.saturating_add(slice);
    if let Some((account, _, _)) = entries(passwd).find(|e| e.1 == id || e.2 == id) {
        return Err(SliceIdTaken {
            slice,
            uid: id,
            account: account.to_string(),
            what,
            hint,
        });
    }
    Ok(JobUser {
        name: format!("{prefix}-{slice}"),
        uid: id,
        gid: id,
    })
}

/// The identity the default job user takes on slice `slice`: uid and gid
/// `SLICE_ID_BASE + slice`, named `kernelkite-job-<slice>`. Two jobs that run at once never
/// share a slice (the leases), so never a uid: neither can signal, trace or read `/proc` of
/// the other, or write the other's files, whatever else went wrong. Refused when `passwd`
/// gives that uid or gid to an account.
pub fn for_slice(passwd: &str, slice: u32) -> Result<JobUser, SliceIdTaken> {
    reserved(
        passwd,
        SLICE_ID_BASE,
        DEFAULT_JOB_USER,
        slice,
        "jobs",
        ", or name the job user with the plugin option `user`",
    )
}

/// The identity the evaluator runs slice `slice`'s submissions as: uid and gid
/// `SUBMISSION_ID_BASE + slice`, named `kernelkite-submission-<slice>`: not the command's,
/// not another slice's. Refused when `passwd` gives that uid or gid to an account.
pub fn submission_for_slice(passwd: &str, slice: u32) -> Result<JobUser, SliceIdTaken> {
    reserved(
        passwd,
        SUBMISSION_ID_BASE,
        "kernelkite-submission",
        slice,
        "submissions",
        "",
    )
}

/// Resolves `user` against `<etc_root>/etc/passwd`.
pub fn resolve(etc_root: &Path, user: &str) -> Result<JobUser, UserError> {
    let path = etc_root.join("etc/passwd");
    let text = std::fs::read_to_string(&path).map_err(|source| UserError::Read { path, source })?;
    lookup(&text, user)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "\
root:x:0:0:root:/root:/bin/bash
daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin
kernelkite-job:x:998:997::/nonexistent:/usr/sbin/nologin
broken line
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
";

    #[test]
    fn names_uids_and_pairs_resolve() {
        let u = lookup(PASSWD, "kernelkite-job").unwrap();
        assert_eq!(
            (u.name.as_str(), u.uid, u.gid),
            ("kernelkite-job", 998, 997)
        );
        let u = lookup(PASSWD, "65534").unwrap();
        assert_eq!((u.name.as_str(), u.uid, u.gid), ("nobody", 65534, 65534));
        let u = lookup(PASSWD, "1500").unwrap();
        assert_eq!((u.name.as_str(), u.uid, u.gid), ("uid 1500", 1500, 1500));
        let u = lookup(PASSWD, "998:44").unwrap();
        assert_eq!((u.name.as_str(), u.uid, u.gid), ("kernelkite-job", 998, 44));
        assert!(lookup(PASSWD, "root").unwrap().is_root());
        assert!(!lookup(PASSWD, "daemon").unwrap().is_root());
    }

    #[test]
    fn each_slice_has_its_own_identity_unless_an_account_has_it() {
        let a = for_slice(PASSWD, 0).unwrap();
        let b = for_slice(PASSWD, 7).unwrap();
        assert_eq!(
            (a.name.as_str(), a.uid, a.gid),
            ("kernelkite-job-0", SLICE_ID_BASE, SLICE_ID_BASE)
        );
        assert_eq!(b.uid, SLICE_ID_BASE + 7);
        assert_ne!(a.uid, b.uid);
        let taken = format!("{PASSWD}intruder:x:{}:100::/:/bin/sh\n", SLICE_ID_BASE + 7);
        let e = for_slice(&taken, 7).unwrap_err().to_string();
        assert!(e.contains("\"intruder\"") && e.contains("slice 7"), "{e}");
        // The submission's identity is another, and refused the same way.
        let s = submission_for_slice(PASSWD, 7).unwrap();
        assert_eq!(
            (s.name.as_str(), s.uid, s.gid),
            (
                "kernelkite-submission-7",
                SUBMISSION_ID_BASE + 7,
                SUBMISSION_ID_BASE + 7
            )
        );
        assert_ne!(s.uid, b.uid);
        let taken = format!(
            "{PASSWD}intruder:x:100:{}::/:/bin/sh\n",
            SUBMISSION_ID_BASE + 7
        );
        let e = submission_for_slice(&taken, 7).unwrap_err().to_string();
        assert!(e.contains("slice 7's submissions"), "{e}");
        // A commented-out account is no account: it takes no slice's id (it once refused the
        // slice, as the parser here read comments) and names no uid.
        let commented = format!("{PASSWD}#old:x:{}:100::/:/bin/sh\n", SLICE_ID_BASE + 7);
        assert_eq!(for_slice(&commented, 7).unwrap().uid, SLICE_ID_BASE + 7);
        let named = lookup(&commented, &(SLICE_ID_BASE + 7).to_string()).unwrap();
        assert_eq!(named.name, format!("uid {}", SLICE_ID_BASE + 7));
    }

    #[test]
    fn a_missing_user_names_the_way_to_create_it() {
        let without = PASSWD.replace("kernelkite-job", "someone-else");
        let e = lookup(&without, DEFAULT_JOB_USER).unwrap_err().to_string();
        assert!(e.contains("kernelkite-isolate setup"), "{e}");
        assert!(e.contains("useradd --system"), "{e}");
        let e = lookup(PASSWD, "evaluator").unwrap_err().to_string();
        assert!(
            e.contains("\"evaluator\"") && e.contains("plugin option `user`"),
            "{e}"
        );
        let dir = tempfile::tempdir().unwrap();
        let e = resolve(dir.path(), "x").unwrap_err().to_string();
        assert!(e.contains("etc/passwd"), "{e}");
    }
}
