//! The job's checkout, bounded: inside the sandbox the checkout is an overlay whose writable
//! layer is a tmpfs of the job's own (`tmp-size` bytes, [`MAX_FILES`] files, its pages charged
//! to the job's memory cgroup), over the real checkout, which the job never writes. Everything
//! else the job could write on the host is read-only in its view (`mounts`), so a job that
//! fills its disk gets `ENOSPC` ("No space left on device") and the host's disk is untouched.
//!
//! When the job has ended (every process of it killed, by the namespace's init), the init
//! carries the job's artifacts (the step's `artifact_paths`, which the agent hands the hooks as
//! `BUILDKITE_ARTIFACT_PATHS`: `result.json`) back into the real checkout, where the agent's
//! upload and the local service find them: [`carry_back`]. Nothing else the job wrote reaches
//! the host's disk. The carry runs as root over files the job made, so it trusts none of them:
//! every open is relative to a directory descriptor, with `O_NOFOLLOW` (a symbolic link is
//! never followed, on either side) and `O_NONBLOCK` (a FIFO never blocks), only regular files
//! are carried (links, FIFOs, sockets and devices are left behind and counted), never one with
//! other names (hard links), each written under a new name and renamed into place, and the
//! walk is bounded in depth and count. At most `tmp-size` bytes reach the host disk per job,
//! counted by the files' sizes (a sparse file's holes included). Nothing is carried from a
//! command a signal ended (the evaluator killed: whatever it left is not its result).

use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};

/// Most files (inodes) the job's checkout layer holds.
pub const MAX_FILES: u64 = 262_144;

/// Deepest directory the carry walks.
const MAX_DEPTH: usize = 64;

/// An overlaid checkout, kept by the init until the job ends.
#[derive(Debug)]
pub struct Overlaid {
    /// Where the overlay is mounted (the checkout's path).
    pub mount_point: PathBuf,
    /// The overlay's upper directory (on the job's tmpfs, unreachable by path).
    pub upper: OwnedFd,
    /// The real checkout beneath (an `O_PATH` directory descriptor).
    pub real: OwnedFd,
    /// What is carried back when the job ends: the step's artifact patterns.
    pub carry: Vec<String>,
    /// At most this many bytes of it (the layer's size, `tmp-size`).
    pub budget: u64,
}

/// What [`carry_back`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Carried {
    /// Regular files copied.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Entries matching a pattern but left behind: links, FIFOs, sockets, devices.
    pub skipped: u64,
    /// What could not be carried, for the job log.
    pub errors: Vec<String>,
}

fn open_dir_at(dir: BorrowedFd<'_>, name: &OsStr) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// Copies one regular file `name` of `from` into `to` under the same name, at most `budget`
/// bytes: refused when its size is over (a sparse file's holes count: they would be written out
/// in full) or it has other names (hard links would carry one file many times). Written to a
/// new name first (`O_EXCL`) and renamed over the old one, so nothing already in the checkout,
/// a link, a FIFO or another name of a file, is ever opened or written through. Returns its
/// bytes.
fn carry_file(
    from: BorrowedFd<'_>,
    to: BorrowedFd<'_>,
    name: &OsStr,
    budget: u64,
) -> std::io::Result<u64> {
    let src = rustix::fs::openat(
        from,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    // The type seen by the walk is checked again on what was opened.
    let st = rustix::fs::fstat(&src)?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(std::io::Error::other("not a regular file any more"));
    }
    if st.st_nlink > 1 {
        return Err(std::io::Error::other(format!(
            "has {} names (hard links); an artifact must have one",
            st.st_nlink
        )));
    }
    let size = u64::try_from(st.st_size).unwrap_or(u64::MAX);
    if size > budget {
        return Err(std::io::Error::other(format!(
            "is {size} bytes, over the {budget} bytes left of the job's tmp-size"
        )));
    }
    let mut temp = name.to_os_string();
    temp.push(".kernelkite-carry");
    let _ = rustix::fs::unlinkat(to, temp.as_os_str(), AtFlags::empty());
    let dst = rustix::fs::openat(
        to,
        temp.as_os_str(),
        OFlags::WRONLY
            | OFlags::CREATE
            | OFlags::EXCL
            | OFlags::NOFOLLOW
            | OFlags::NONBLOCK
            | OFlags::CLOEXEC,
        Mode::from_raw_mode(st.st_mode & 0o777),
    )?;
    let mut src = std::fs::File::from(src);
    let mut dst = std::fs::File::from(dst);
    let copied = std::io::copy(&mut std::io::Read::take(&mut src, budget), &mut dst);
    let renamed = copied.and_then(|n| {
        rustix::fs::renameat(to, temp.as_os_str(), to, name)?;
        Ok(n)
    });
    if renamed.is_err() {
        let _ = rustix::fs::unlinkat(to, temp.as_os_str(), AtFlags::empty());
    }
    renamed
}

/// Whether `rel` (a path relative to the checkout) matches the artifact pattern `pattern`:
/// components compared one by one, `**` standing for any number of them, `*` and `?` within
/// one (as Buildkite's `artifact_paths` globs; `./` ignored).
pub fn matches(pattern: &str, rel: &Path) -> bool {
    let pat: Vec<&str> = pattern
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    let parts: Vec<&[u8]> = rel.iter().map(|c| c.as_bytes()).collect();
    matches_components(&pat, &parts)
}

fn matches_components(pat: &[&str], parts: &[&[u8]]) -> bool {
    match pat.split_first() {
        None => parts.is_empty(),
        Some((&"**", rest)) => (0..=parts.len()).any(|i| matches_components(rest, &parts[i..])),
        Some((first, rest)) => match parts.split_first() {
            Some((part, others)) => {
                wildcard(first.as_bytes(), part) && matches_components(rest, others)
            }
            None => false,
        },
    }
}

/// `*` and `?` within one path component.
fn wildcard(p: &[u8], s: &[u8]) -> bool {
    match (p.split_first(), s.split_first()) {
        (None, None) => true,
        (Some((b'*', rest)), _) => (0..=s.len()).any(|i| wildcard(rest, &s[i..])),
        (Some((b'?', rest)), Some((_, srest))) => wildcard(rest, srest),
        (Some((c, rest)), Some((d, srest))) => c == d && wildcard(rest, srest),
        _ => false,
    }
}

/// The artifact patterns of a `BUILDKITE_ARTIFACT_PATHS` value (`;`-separated, as the agent
/// splits it); absolute ones and ones climbing out (`..`) name nothing in the checkout.
pub fn artifact_patterns(value: &str) -> Vec<String> {
    value
        .split(';')
        .map(str::trim)
        .filter(|p| !p.is_empty() && !p.starts_with('/') && !p.split('/').any(|c| c == ".."))
        .map(str::to_string)
        .collect()
}

/// Regular files under `dir` matching `patterns` (relative paths), found without following
/// any link; other entries that match are counted in `out.skipped`.
fn find(
    dir: BorrowedFd<'_>,
    rel: &Path,
    depth: usize,
    patterns: &[String],
    found: &mut Vec<PathBuf>,
    out: &mut Carried,
    seen: &mut u64,
) {
    if depth > MAX_DEPTH {
        out.errors.push(format!(
            "{}: deeper than {MAX_DEPTH} directories",
            rel.display()
        ));
        return;
    }
    let Ok(entries) = rustix::fs::Dir::read_from(dir) else {
        return;
    };
    for entry in entries {
        let Ok(entry) = entry else { break };
        let name = OsStr::from_bytes(entry.file_name().to_bytes()).to_os_string();
        if name == "." || name == ".." {
            continue;
        }
        *seen += 1;
        if *seen > MAX_FILES {
            out.errors
                .push(format!("more than {MAX_FILES} entries; the rest is left"));
            return;
        }
        let path = rel.join(&name);
        let Ok(st) = rustix::fs::statat(dir, name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW) else {
            continue;
        };
        let wanted = patterns.iter().any(|p| matches(p, &path));
        match FileType::from_raw_mode(st.st_mode) {
            FileType::RegularFile if wanted => found.push(path),
            FileType::Directory => {
                if let Ok(sub) = open_dir_at(dir, &name) {
                    find(sub.as_fd(), &path, depth + 1, patterns, found, out, seen);
                }
            }
            _ if wanted => out.skipped += 1,
            _ => {}
        }
    }
}

/// Opens (making, on the `to` side) each directory of `rel`'s parent, link-free, and returns
/// the two parents and the file name.
fn parents(
    from: BorrowedFd<'_>,
    to: BorrowedFd<'_>,
    rel: &Path,
) -> std::io::Result<(OwnedFd, OwnedFd, std::ffi::OsString)> {
    let mut src = open_dir_at(from, OsStr::new("."))?;
    let mut dst = open_dir_at(to, OsStr::new("."))?;
    let mut parts: Vec<&OsStr> = rel.iter().collect();
    let name = parts
        .pop()
        .ok_or_else(|| std::io::Error::other("an empty path"))?
        .to_os_string();
    for part in parts {
        let next_src = open_dir_at(src.as_fd(), part)?;
        match rustix::fs::mkdirat(dst.as_fd(), part, Mode::from_raw_mode(0o755)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(e.into()),
        }
        let next_dst = open_dir_at(dst.as_fd(), part)?;
        src = next_src;
        dst = next_dst;
    }
    Ok((src, dst, name))
}

/// Carries the job's artifacts (regular files of the overlay's upper directory `upper` that
/// match `patterns`), `budget` bytes in all, into the real checkout `real` (see the module's
/// documentation). Every process of the job must be gone.
pub fn carry_back(
    upper: BorrowedFd<'_>,
    real: BorrowedFd<'_>,
    patterns: &[String],
    budget: u64,
) -> Carried {
    let mut out = Carried::default();
    if patterns.is_empty() {
        return out;
    }
    let mut found = Vec::new();
    let mut seen = 0;
    find(
        upper,
        Path::new(""),
        0,
        patterns,
        &mut found,
        &mut out,
        &mut seen,
    );
    for rel in found {
        let left = budget.saturating_sub(out.bytes);
        let carried = parents(upper, real, &rel)
            .and_then(|(from, to, name)| carry_file(from.as_fd(), to.as_fd(), &name, left));
        match carried {
            Ok(n) => {
                out.files += 1;
                out.bytes += n;
            }
            Err(e) => out.errors.push(format!("{}: {e}", rel.display())),
        }
    }
    out
}

/// The job log's line for a carry, if it says anything.
pub fn describe(c: &Carried) -> Option<String> {
    if c.files == 0 && c.skipped == 0 && c.errors.is_empty() {
        return None;
    }
    let mut line = format!(
        "sandbox: carried {} artifact file(s) ({} bytes) back into the checkout; nothing else the job wrote there leaves its layer",
        c.files, c.bytes
    );
    if c.skipped > 0 {
        line.push_str(&format!(
            "; left {} artifact path(s) that were not regular files (links, FIFOs, sockets, devices)",
            c.skipped
        ));
    }
    for e in c.errors.iter().take(5) {
        line.push_str(&format!("; could not carry {e}"));
    }
    Some(line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, MetadataExt};

    fn dir_fd(p: &Path) -> OwnedFd {
        rustix::fs::open(
            p,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .unwrap()
    }

    /// What a hostile job leaves in its layer: artifacts, other files, a symbolic link to a
    /// file only root may read named as an artifact (and one to /etc), a FIFO named as an
    /// artifact. Only the regular files the patterns name arrive; a link in the real checkout
    /// where an artifact goes is replaced, not written through; nothing blocks.
    #[test]
    fn only_regular_artifact_files_arrive_and_no_link_is_followed() {
        let upper = tempfile::tempdir().unwrap();
        let real = tempfile::tempdir().unwrap();
        let secret = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(secret.path(), "root's").unwrap();
        let u = upper.path();
        std::fs::write(u.join("result.json"), "{}").unwrap();
        std::fs::write(u.join("junk.bin"), "x".repeat(4096)).unwrap();
        std::fs::create_dir(u.join("out")).unwrap();
        std::fs::write(u.join("out/a.log"), "x".repeat(1000)).unwrap();
        symlink(secret.path(), u.join("out/leak.log")).unwrap();
        symlink("/etc", u.join("etc.log")).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            u.join("out/fifo.log"),
            FileType::Fifo,
            Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap();
        // The real checkout has a link where the job wrote its result: it is replaced.
        symlink(secret.path(), real.path().join("result.json")).unwrap();
        let patterns = artifact_patterns("result.json;out/*.log; *.log ;/etc/passwd;../x");
        assert_eq!(patterns, ["result.json", "out/*.log", "*.log"]);
        let c = carry_back(
            dir_fd(u).as_fd(),
            dir_fd(real.path()).as_fd(),
            &patterns,
            1 << 20,
        );
        assert_eq!((c.files, c.bytes, c.skipped), (2, 1002, 3), "{c:?}");
        assert!(c.errors.is_empty(), "{c:?}");
        assert_eq!(std::fs::read_to_string(secret.path()).unwrap(), "root's");
        let r = real.path();
        assert_eq!(
            std::fs::read_to_string(r.join("result.json")).unwrap(),
            "{}"
        );
        assert!(!std::fs::symlink_metadata(r.join("result.json"))
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(std::fs::read(r.join("out/a.log")).unwrap().len(), 1000);
        for left in ["junk.bin", "out/leak.log", "etc.log", "out/fifo.log"] {
            assert!(std::fs::symlink_metadata(r.join(left)).is_err(), "{left}");
        }
        let line = describe(&c).unwrap();
        assert!(
            line.contains("carried 2 artifact file(s) (1002 bytes)"),
            "{line}"
        );
    }

    /// A directory of the real checkout that is a link (to somewhere root can write) is not
    /// entered: the job's artifact for it goes nowhere.
    #[test]
    fn a_linked_directory_in_the_checkout_is_not_entered() {
        let upper = tempfile::tempdir().unwrap();
        let real = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        std::fs::create_dir(upper.path().join("d")).unwrap();
        std::fs::write(upper.path().join("d/planted"), "x").unwrap();
        symlink(elsewhere.path(), real.path().join("d")).unwrap();
        let c = carry_back(
            dir_fd(upper.path()).as_fd(),
            dir_fd(real.path()).as_fd(),
            &["d/*".to_string()],
            1 << 20,
        );
        assert!(!elsewhere.path().join("planted").exists());
        assert_eq!(c.files, 0, "{c:?}");
        assert_eq!(c.errors.len(), 1, "{c:?}");
        assert_eq!(
            std::fs::metadata(elsewhere.path()).unwrap().uid(),
            rustix::process::geteuid().as_raw()
        );
    }

    /// A sparse artifact of 4 GiB in a layer of 64 KiB, and one file under many names: neither
    /// is written out; a small artifact still arrives, within the budget.
    #[test]
    fn sparse_and_many_named_artifacts_are_refused_within_a_byte_budget() {
        let upper = tempfile::tempdir().unwrap();
        let real = tempfile::tempdir().unwrap();
        let u = upper.path();
        let sparse = std::fs::File::create(u.join("big.json")).unwrap();
        sparse.set_len(4 << 30).unwrap();
        std::fs::write(u.join("one.json"), "x".repeat(100)).unwrap();
        for i in 0..3 {
            std::fs::hard_link(u.join("one.json"), u.join(format!("alias{i}.json"))).unwrap();
        }
        std::fs::write(u.join("result.json"), "{}").unwrap();
        let c = carry_back(
            dir_fd(u).as_fd(),
            dir_fd(real.path()).as_fd(),
            &["*.json".to_string()],
            64 << 10,
        );
        assert_eq!((c.files, c.bytes), (1, 2), "{c:?}");
        assert_eq!(c.errors.len(), 5, "{c:?}");
        assert!(c.errors.iter().any(|e| e.contains("over the")), "{c:?}");
        assert!(c.errors.iter().any(|e| e.contains("hard links")), "{c:?}");
        let names: Vec<_> = std::fs::read_dir(real.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["result.json"]);
    }

    #[test]
    fn artifact_globs_match_as_buildkite_s() {
        let m = |p: &str, r: &str| matches(p, Path::new(r));
        assert!(m("result.json", "result.json"));
        assert!(m("./result.json", "result.json"));
        assert!(!m("result.json", "sub/result.json"));
        assert!(m("**/*.json", "result.json"));
        assert!(m("**/*.json", "a/b/c.json"));
        assert!(m("out/*", "out/x"));
        assert!(!m("out/*", "out/x/y"));
        assert!(m("out/**", "out/x/y"));
        assert!(m("r?sult.json", "result.json"));
        assert!(!m("*.json", "result.jsonx"));
    }
}
