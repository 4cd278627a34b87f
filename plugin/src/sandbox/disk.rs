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
//! are carried (links, FIFOs, sockets and devices are left behind and counted), and the walk is
//! bounded in depth and count. At most `tmp-size` bytes reach the host disk per job.

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

/// Copies one regular file `name` of `from` into `to`, replacing whatever non-directory is
/// there (a symbolic link is removed, never followed). Returns its bytes.
fn carry_file(
    from: BorrowedFd<'_>,
    to: BorrowedFd<'_>,
    name: &OsStr,
    mode: u32,
) -> std::io::Result<u64> {
    let src = rustix::fs::openat(
        from,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    // The type seen by the walk is checked again on what was opened.
    if FileType::from_raw_mode(rustix::fs::fstat(&src)?.st_mode) != FileType::RegularFile {
        return Err(std::io::Error::other("not a regular file any more"));
    }
    let flags =
        OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let perm = Mode::from_raw_mode(mode & 0o777);
    let dst = match rustix::fs::openat(to, name, flags, perm) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::LOOP) | Err(rustix::io::Errno::MLINK) => {
            rustix::fs::unlinkat(to, name, AtFlags::empty())?;
            rustix::fs::openat(to, name, flags | OFlags::EXCL, perm)?
        }
        Err(e) => return Err(e.into()),
    };
    if FileType::from_raw_mode(rustix::fs::fstat(&dst)?.st_mode) != FileType::RegularFile {
        return Err(std::io::Error::other(
            "the checkout has something else there",
        ));
    }
    let mut src = std::fs::File::from(src);
    let mut dst = std::fs::File::from(dst);
    std::io::copy(&mut src, &mut dst)
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
/// match `patterns`) into the real checkout `real` (see the module's documentation). Every
/// process of the job must be gone.
pub fn carry_back(upper: BorrowedFd<'_>, real: BorrowedFd<'_>, patterns: &[String]) -> Carried {
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
        let carried = parents(upper, real, &rel).and_then(|(from, to, name)| {
            let st = rustix::fs::statat(&from, name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW)?;
            carry_file(from.as_fd(), to.as_fd(), &name, st.st_mode)
        });
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
        let c = carry_back(dir_fd(u).as_fd(), dir_fd(real.path()).as_fd(), &patterns);
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
        );
        assert!(!elsewhere.path().join("planted").exists());
        assert_eq!(c.files, 0, "{c:?}");
        assert_eq!(c.errors.len(), 1, "{c:?}");
        assert_eq!(
            std::fs::metadata(elsewhere.path()).unwrap().uid(),
            rustix::process::geteuid().as_raw()
        );
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
