//! Writing submission files into the work directory without following symlinks.
//!
//! [`kernelkite_kernelbot::config`] already refuses names that escape lexically (absolute, `..`). What is
//! left are symlink tricks: a link already in the directory (`lib -> /etc`) that a name like
//! `lib/x` would walk through, or a dangling link at the very name being written. Every
//! component is therefore opened relative to its parent with `O_NOFOLLOW`, directories are
//! created with `mkdirat`, and the file itself is created with `O_CREAT | O_EXCL`, which
//! refuses any existing entry, a link included.

use std::ffi::{CStr, CString};
use std::io::{self, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;

/// Why a file could not be written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The name collides with something already there, or walks through a symlink: the
    /// config's fault (duplicate names, `a` and `a/b`) or a planted link.
    #[error("cannot write {name:?}: {reason}")]
    Refused {
        /// The name as the config gave it.
        name: String,
        /// What is in the way, in words.
        reason: String,
    },
    /// The file system failed (full disk, permissions): the node's fault.
    #[error("cannot write {name:?} into the work directory: {source}")]
    Io {
        /// The name as the config gave it.
        name: String,
        /// What the file system said.
        source: io::Error,
    },
}

fn open_dir_at(parent: impl AsFd, name: &CStr) -> io::Result<OwnedFd> {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    Ok(rustix::fs::openat(parent, name, flags, Mode::empty())?)
}

fn open_root(root: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(root.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))?;
    // The root itself is the operator's choice and may be reached through links.
    open_dir_at(rustix::fs::CWD, &c)
}

/// Splits a (validated) relative name into C strings, one per component.
fn components(name: &str) -> Result<Vec<CString>, WriteError> {
    let refused = |reason: &str| WriteError::Refused {
        name: name.to_string(),
        reason: reason.to_string(),
    };
    let mut out = Vec::new();
    for c in Path::new(name).components() {
        match c {
            Component::Normal(s) => {
                out.push(CString::new(s.as_bytes()).map_err(|_| refused("it contains a NUL byte"))?)
            }
            // `./a.py` is `a.py` (see `config::work_path`).
            Component::CurDir => {}
            _ => return Err(refused("it is not a plain relative path")),
        }
    }
    if out.is_empty() {
        return Err(refused("it is empty"));
    }
    Ok(out)
}

fn classify(name: &str, e: io::Error, what: &str) -> WriteError {
    let reason = match Errno::from_io_error(&e) {
        Some(Errno::LOOP) => format!("{what} is a symbolic link, which the runner does not follow"),
        Some(Errno::NOTDIR) => format!("{what} is not a directory (a symbolic link or a file of the same name)"),
        Some(Errno::EXIST) => format!("{what} already exists (a duplicate name in the config, or a file left in the work directory)"),
        _ => return WriteError::Io { name: name.to_string(), source: e },
    };
    WriteError::Refused {
        name: name.to_string(),
        reason,
    }
}

/// Opens (creating as needed) the parent directory of `name` below `root`, never following
/// a link. Returns it with the last component.
fn walk_parents(root: &Path, name: &str, create: bool) -> Result<(OwnedFd, CString), WriteError> {
    let mut parts = components(name)?;
    let leaf = parts.pop().ok_or_else(|| WriteError::Refused {
        name: name.into(),
        reason: "it is empty".into(),
    })?;
    let mut dir = open_root(root).map_err(|e| WriteError::Io {
        name: name.to_string(),
        source: e,
    })?;
    for (i, part) in parts.iter().enumerate() {
        let shown = parts[..=i]
            .iter()
            .map(|p| p.to_string_lossy())
            .collect::<Vec<_>>()
            .join("/");
        if create {
            match rustix::fs::mkdirat(&dir, part.as_c_str(), Mode::from_raw_mode(0o755)) {
                Ok(()) | Err(Errno::EXIST) => {}
                Err(e) => return Err(classify(name, e.into(), &format!("directory {shown:?}"))),
            }
        }
        dir = open_dir_at(&dir, part)
            .map_err(|e| classify(name, e, &format!("path component {shown:?}")))?;
    }
    Ok((dir, leaf))
}

/// Writes `content` to `root/name`, refusing links anywhere below `root` and existing files.
pub fn write_file(root: &Path, name: &str, content: &[u8]) -> Result<(), WriteError> {
    let (dir, leaf) = walk_parents(root, name, true)?;
    let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd = rustix::fs::openat(&dir, leaf.as_c_str(), flags, Mode::from_raw_mode(0o644))
        .map_err(|e| classify(name, e.into(), "the file"))?;
    let mut file = std::fs::File::from(fd);
    file.write_all(content).map_err(|e| WriteError::Io {
        name: name.to_string(),
        source: e,
    })
}

/// Removes `root/name` if it is there, without following links. Errors other than "not
/// there" are returned.
pub fn remove_file(root: &Path, name: &str) -> Result<(), WriteError> {
    let (dir, leaf) = match walk_parents(root, name, false) {
        Ok(v) => v,
        Err(WriteError::Refused { .. }) => return Ok(()),
        Err(WriteError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            return Ok(())
        }
        Err(e) => return Err(e),
    };
    match rustix::fs::unlinkat(&dir, leaf.as_c_str(), rustix::fs::AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => Ok(()),
        Err(e) => Err(WriteError::Io {
            name: name.to_string(),
            source: e.into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn writes_nested_files() {
        let d = tempfile::tempdir().unwrap();
        write_file(d.path(), "a/b/c.py", b"x").unwrap();
        write_file(d.path(), "a/d.py", b"y").unwrap();
        assert_eq!(std::fs::read(d.path().join("a/b/c.py")).unwrap(), b"x");
        remove_file(d.path(), "a/b/c.py").unwrap();
        assert!(!d.path().join("a/b/c.py").exists());
        remove_file(d.path(), "a/b/c.py").unwrap();
        remove_file(d.path(), "no/such/dir.py").unwrap();
    }

    #[test]
    fn dot_components_name_the_same_file() {
        let d = tempfile::tempdir().unwrap();
        write_file(d.path(), "./pkg/./a.py", b"x").unwrap();
        assert_eq!(std::fs::read(d.path().join("pkg/a.py")).unwrap(), b"x");
        assert!(matches!(
            write_file(d.path(), "pkg/a.py", b"y"),
            Err(WriteError::Refused { .. })
        ));
        remove_file(d.path(), "./pkg//a.py").unwrap();
        assert!(!d.path().join("pkg/a.py").exists());
    }

    #[test]
    fn refuses_to_walk_through_a_directory_link() {
        let d = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        symlink(outside.path(), d.path().join("lib")).unwrap();
        let e = write_file(d.path(), "lib/evil.py", b"x").unwrap_err();
        assert!(matches!(e, WriteError::Refused { .. }), "{e}");
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert!(!outside.path().join("evil.py").exists());
    }

    #[test]
    fn refuses_a_dangling_link_at_the_name() {
        let d = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let target = outside.path().join("planted.py");
        symlink(&target, d.path().join("sub.py")).unwrap();
        let e = write_file(d.path(), "sub.py", b"x").unwrap_err();
        assert!(matches!(e, WriteError::Refused { .. }), "{e}");
        assert!(!target.exists());
    }

    #[test]
    fn refuses_duplicates_and_file_dir_clashes() {
        let d = tempfile::tempdir().unwrap();
        write_file(d.path(), "a", b"x").unwrap();
        assert!(matches!(
            write_file(d.path(), "a", b"y"),
            Err(WriteError::Refused { .. })
        ));
        let e = write_file(d.path(), "a/b", b"y").unwrap_err();
        assert!(matches!(e, WriteError::Refused { .. }), "{e}");
        assert_eq!(std::fs::read(d.path().join("a")).unwrap(), b"x");
    }

    #[test]
    fn remove_does_not_follow_links() {
        let d = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep.py"), b"k").unwrap();
        symlink(outside.path(), d.path().join("lib")).unwrap();
        remove_file(d.path(), "lib/keep.py").unwrap();
        assert!(outside.path().join("keep.py").exists());
    }
}
