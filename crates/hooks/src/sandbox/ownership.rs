//! The checkout changes hands: the job user owns it while the command runs (so the job can
//! write `result.json` and build in tree), the agent's user again from `pre-exit` on (so the
//! agent can upload, clean and check out the next build).
//!
//! Chosen over an idmapped bind mount, which would need no walk: `chown` works on every file
//! system and kernel (idmapped mounts need 5.12+, a file system that supports them, NFS does
//! not, and a user namespace to describe the mapping), and a competition checkout is small
//! (the walk costs a few microseconds per file; `docs/BENCHMARKS.md`).
//!
//! The walk never follows a symbolic link (`lchown` semantics, directories opened with
//! `O_NOFOLLOW` relative to their parent), so a link the job planted cannot redirect it, and
//! it runs only while no process of the job is alive (before the command starts; after
//! `pre-exit` killed the job), so nothing can be swapped under it. `.git` at the top is left to
//! the agent: the sandbox mounts it read-only, and a job that owned it could plant hooks the
//! agent's next `git` would run.

use std::os::fd::OwnedFd;
use std::path::Path;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, CWD};
use rustix::process::{Gid, Uid};

/// Entries at the top of the checkout that keep their owner.
pub const KEPT_AT_TOP: &[&str] = &[".git"];

/// How deep the walk goes; deeper directories keep their owner (and are counted as skipped).
pub const MAX_DEPTH: usize = 256;

/// What [`chown_tree`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Chowned {
    /// Files, directories and links given the new owner.
    pub entries: u64,
    /// Directories below [`MAX_DEPTH`] that were not entered.
    pub too_deep: u64,
}

/// Gives `root` and everything under it (except [`KEPT_AT_TOP`]) to `uid:gid`, without
/// following symbolic links.
pub fn chown_tree(root: &Path, uid: u32, gid: u32) -> std::io::Result<Chowned> {
    let owner = (Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)));
    let top = rustix::fs::openat(
        CWD,
        root,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    rustix::fs::fchown(&top, owner.0, owner.1)?;
    let mut done = Chowned {
        entries: 1,
        too_deep: 0,
    };
    // Each level's directory stays open while its children are walked; the stack holds at most
    // MAX_DEPTH descriptors.
    let mut stack: Vec<(OwnedFd, usize)> = vec![(top, 0)];
    while let Some((dir_fd, depth)) = stack.pop() {
        let mut subdirs: Vec<std::ffi::CString> = Vec::new();
        let mut dir = rustix::fs::Dir::read_from(&dir_fd)?;
        while let Some(entry) = dir.read() {
            let entry = entry?;
            let name = entry.file_name();
            let bytes = name.to_bytes();
            if bytes == b"." || bytes == b".." {
                continue;
            }
            if depth == 0 && KEPT_AT_TOP.iter().any(|k| k.as_bytes() == bytes) {
                continue;
            }
            rustix::fs::chownat(&dir_fd, name, owner.0, owner.1, AtFlags::SYMLINK_NOFOLLOW)?;
            done.entries += 1;
            let is_dir = match entry.file_type() {
                FileType::Directory => true,
                FileType::Unknown => rustix::fs::statat(&dir_fd, name, AtFlags::SYMLINK_NOFOLLOW)
                    .is_ok_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::Directory),
                _ => false,
            };
            if is_dir {
                subdirs.push(name.to_owned());
            }
        }
        for name in subdirs {
            if depth + 1 > MAX_DEPTH {
                done.too_deep += 1;
                continue;
            }
            let child = rustix::fs::openat(
                &dir_fd,
                name.as_c_str(),
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )?;
            stack.push((child, depth + 1));
        }
    }
    Ok(done)
}

/// The owner of `path` (uid, gid).
pub fn owner(path: &Path) -> std::io::Result<(u32, u32)> {
    let st = rustix::fs::stat(path)?;
    Ok((st.st_uid, st.st_gid))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn the_tree_changes_hands_but_links_and_git_do_not_lead_it_astray() {
        if !rustix::process::geteuid().is_root() {
            kernelkite_testkit_leaf::skip("chown to another user needs root");
            return;
        }
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("victim");
        std::fs::write(&victim, "x").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("checkout");
        std::fs::create_dir_all(root.join("a/b/c")).unwrap();
        std::fs::create_dir_all(root.join(".git/hooks")).unwrap();
        std::fs::write(root.join("a/b/c/file"), "x").unwrap();
        std::fs::write(root.join("top"), "x").unwrap();
        std::os::unix::fs::symlink(&victim, root.join("a/link")).unwrap();
        std::os::unix::fs::symlink(outside.path(), root.join("a/dirlink")).unwrap();
        let done = chown_tree(&root, 4242, 4343).unwrap();
        // root, a, a/b, a/b/c, file, top, link, dirlink
        assert_eq!(
            done,
            Chowned {
                entries: 8,
                too_deep: 0
            }
        );
        for p in ["", "a", "a/b/c/file", "top"] {
            let m = std::fs::metadata(root.join(p)).unwrap();
            assert_eq!((m.uid(), m.gid()), (4242, 4343), "{p}");
        }
        let link = std::fs::symlink_metadata(root.join("a/link")).unwrap();
        assert_eq!(link.uid(), 4242, "the link itself changes hands");
        let v = std::fs::metadata(&victim).unwrap();
        assert_eq!((v.uid(), v.gid()), (0, 0), "what a link points at does not");
        assert_eq!(std::fs::metadata(outside.path()).unwrap().uid(), 0);
        assert_eq!(std::fs::metadata(root.join(".git")).unwrap().uid(), 0);
        assert_eq!(std::fs::metadata(root.join(".git/hooks")).unwrap().uid(), 0);
        assert_eq!(owner(&root).unwrap(), (4242, 4343));
        chown_tree(&root, 0, 0).unwrap();
        assert_eq!(owner(&root.join("a/b/c/file")).unwrap(), (0, 0));
        assert!(chown_tree(&dir.path().join("missing"), 1, 1).is_err());
    }
}
