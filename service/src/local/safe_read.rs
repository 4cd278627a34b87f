//! Reading a file that a job could have put in place, as the service's user (root on a node).
//!
//! A job's checkout (`attempt-<n>/`) belongs to the job user while its command runs, and the
//! job's processes may outlive the runner until `pre-exit` kills them: whatever the service
//! reads from there (`result.json`) may be a symbolic link to a file only root can read, a
//! FIFO that never delivers a byte, a sparse file of any size, or a second name (hard link)
//! of a file the job could not read itself. [`open_regular`] is the one way the service opens
//! such a file, and [`read_capped`] and [`read_tail`] the only ways it reads one:
//!
//! - the directory the path is resolved from is opened with `O_DIRECTORY | O_NOFOLLOW`, and
//!   the rest of the path beneath it with `openat2(RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH)`
//!   (one `O_NOFOLLOW` `openat` per component where the kernel has no `openat2`), so no link,
//!   in the file's place or in a directory's, is ever followed;
//! - `O_NONBLOCK`, so opening a FIFO returns at once instead of waiting for a writer;
//! - the opened descriptor is `fstat`ed: anything but a regular file with one name is refused;
//! - at most a cap is read, whatever the file's size says or becomes while it is read.

use std::ffi::OsStr;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

/// Why a file a job could have written was not read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// Nothing is there.
    #[error("{} does not exist", .path.display())]
    Missing {
        /// The file.
        path: PathBuf,
    },
    /// The file, or a directory on the way to it, is a symbolic link.
    #[error("{} is a symbolic link, or lies under one; the service never follows links in a job's directory: the job must write a regular file there", .path.display())]
    Link {
        /// The file.
        path: PathBuf,
    },
    /// Something other than a regular file.
    #[error("{} is a {kind}, not a regular file; the job must write a regular file there", .path.display())]
    NotRegular {
        /// The file.
        path: PathBuf,
        /// What it is.
        kind: &'static str,
    },
    /// A regular file with more than one name: another file the job linked in.
    #[error("{} has {links} names (hard links); the service reads only a file the job wrote itself, which has one", .path.display())]
    HardLinked {
        /// The file.
        path: PathBuf,
        /// Its link count.
        links: u64,
    },
    /// More bytes than the cap.
    #[error("{} holds more than the {limit} bytes allowed ({size} bytes)", .path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size (at least this much).
        size: u64,
        /// The cap.
        limit: u64,
    },
    /// The system refused.
    #[error("cannot read {}: {source}", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// How the file itself is opened: no link followed, no wait for a FIFO's writer, no
/// controlling terminal taken, not inherited by the hooks the service starts.
const FILE_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::NOFOLLOW)
    .union(OFlags::NONBLOCK)
    .union(OFlags::NOCTTY)
    .union(OFlags::CLOEXEC);

/// How a directory on the way is opened.
const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

/// Opens `rel` (a relative path of plain names) beneath the directory `base` (whose own last
/// component must not be a link either), and returns it only if it is a regular file with one
/// name. `base` is a directory the job cannot write (the job's directory); `rel` may lead into
/// one it can (its checkout).
pub fn open_regular(base: &Path, rel: &Path) -> Result<(File, std::fs::Metadata), ReadError> {
    let path = base.join(rel);
    let names = plain_names(rel).ok_or_else(|| ReadError::Io {
        path: path.clone(),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a relative path of plain names",
        ),
    })?;
    let opened = rustix::fs::open(base, DIR_FLAGS, Mode::empty())
        .and_then(|dir| open_beneath(&dir, rel, &names));
    let file = File::from(opened.map_err(|e| classify(e, &path))?);
    let meta = file.metadata().map_err(|source| ReadError::Io {
        path: path.clone(),
        source,
    })?;
    let kind = meta.file_type();
    if !kind.is_file() {
        return Err(ReadError::NotRegular {
            path,
            kind: kind_name(kind),
        });
    }
    if meta.nlink() != 1 {
        return Err(ReadError::HardLinked {
            path,
            links: meta.nlink(),
        });
    }
    Ok((file, meta))
}

/// All of `rel` beneath `base` ([`open_regular`]), if it holds at most `cap` bytes.
pub fn read_capped(base: &Path, rel: &Path, cap: u64) -> Result<Vec<u8>, ReadError> {
    let (file, meta) = open_regular(base, rel)?;
    let path = || base.join(rel);
    // A sparse file claims any size for free: refused before a byte is read.
    if meta.len() > cap {
        return Err(ReadError::TooLarge {
            path: path(),
            size: meta.len(),
            limit: cap,
        });
    }
    read_bounded(file, cap, meta.len()).map_err(|e| match e {
        Bounded::Over(read) => ReadError::TooLarge {
            path: path(),
            size: read.max(meta.len()),
            limit: cap,
        },
        Bounded::Io(source) => ReadError::Io {
            path: path(),
            source,
        },
    })
}

/// The last `max` bytes (at most) of `rel` beneath `base` ([`open_regular`]): a log's end,
/// without reading the rest of a log that may be any size.
pub fn read_tail(base: &Path, rel: &Path, max: u64) -> Result<Vec<u8>, ReadError> {
    let (mut file, meta) = open_regular(base, rel)?;
    let io = |source| ReadError::Io {
        path: base.join(rel),
        source,
    };
    file.seek(SeekFrom::Start(meta.len().saturating_sub(max)))
        .map_err(io)?;
    let mut out = Vec::new();
    // Bytes written since the fstat are not waited for, nor read past `max`.
    file.take(max).read_to_end(&mut out).map_err(io)?;
    Ok(out)
}

/// Why [`read_bounded`] stopped.
#[derive(Debug)]
pub(crate) enum Bounded {
    /// More than the cap: this many bytes were read (the cap plus one).
    Over(u64),
    /// A read failed.
    Io(std::io::Error),
}

/// Reads `r` to its end, but never more than `cap + 1` bytes (the one to tell "exactly the
/// cap" from "more"); `hint` sizes the buffer (never beyond the cap).
pub(crate) fn read_bounded(r: impl Read, cap: u64, hint: u64) -> Result<Vec<u8>, Bounded> {
    let mut out = Vec::with_capacity(usize::try_from(hint.min(cap)).unwrap_or(0));
    r.take(cap.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(Bounded::Io)?;
    let read = out.len() as u64;
    if read > cap {
        return Err(Bounded::Over(read));
    }
    Ok(out)
}

/// `rel`'s names, when it is a non-empty relative path with no `.`, `..` or root.
fn plain_names(rel: &Path) -> Option<Vec<&OsStr>> {
    let names = rel
        .components()
        .map(|c| match c {
            Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect::<Option<Vec<_>>>()?;
    (!names.is_empty()).then_some(names)
}

/// `rel` beneath `dir`, resolved by the kernel with no symbolic link allowed anywhere; where
/// `openat2` is missing (Linux before 5.6) or filtered (a seccomp profile that answers
/// `EPERM`), one component at a time with `O_NOFOLLOW`, which refuses the same links.
fn open_beneath(dir: &OwnedFd, rel: &Path, names: &[&OsStr]) -> Result<OwnedFd, Errno> {
    let how = ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS | ResolveFlags::BENEATH;
    match rustix::fs::openat2(dir, rel, FILE_FLAGS, Mode::empty(), how) {
        Err(Errno::NOSYS | Errno::PERM) => open_walk(dir, names),
        other => other,
    }
}

/// [`open_beneath`] without `openat2`: each directory opened `O_DIRECTORY | O_NOFOLLOW`
/// relative to the one before, the file itself with [`FILE_FLAGS`].
pub(crate) fn open_walk(dir: &OwnedFd, names: &[&OsStr]) -> Result<OwnedFd, Errno> {
    let Some((last, dirs)) = names.split_last() else {
        return Err(Errno::INVAL);
    };
    let mut held: Option<OwnedFd> = None;
    for name in dirs {
        let at = held.as_ref().unwrap_or(dir).as_fd();
        let next = rustix::fs::openat(at, *name, DIR_FLAGS, Mode::empty()).map_err(|e| {
            // `O_DIRECTORY | O_NOFOLLOW` says ENOTDIR of a link; openat2 says ELOOP, and so
            // does this, so that both ways name the link.
            let link = e == Errno::NOTDIR
                && rustix::fs::statat(at, *name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW).is_ok_and(
                    |st| {
                        rustix::fs::FileType::from_raw_mode(st.st_mode)
                            == rustix::fs::FileType::Symlink
                    },
                );
            if link {
                Errno::LOOP
            } else {
                e
            }
        })?;
        held = Some(next);
    }
    let at = held.as_ref().unwrap_or(dir).as_fd();
    rustix::fs::openat(at, *last, FILE_FLAGS, Mode::empty())
}

fn classify(e: Errno, path: &Path) -> ReadError {
    let path = path.to_path_buf();
    match e {
        Errno::NOENT => ReadError::Missing { path },
        // ELOOP: a link where O_NOFOLLOW or RESOLVE_NO_SYMLINKS stopped; EXDEV: RESOLVE_BENEATH
        // or RESOLVE_NO_MAGICLINKS stopped a way out.
        Errno::LOOP | Errno::XDEV => ReadError::Link { path },
        // What open(2) says of a socket, and of a device without a driver.
        Errno::NXIO => ReadError::NotRegular {
            path,
            kind: "socket or device",
        },
        e => ReadError::Io {
            path,
            source: e.into(),
        },
    }
}

fn kind_name(t: std::fs::FileType) -> &'static str {
    if t.is_dir() {
        "directory"
    } else if t.is_fifo() {
        "FIFO (named pipe)"
    } else if t.is_socket() {
        "socket"
    } else if t.is_char_device() {
        "character device"
    } else if t.is_block_device() {
        "block device"
    } else {
        "special file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::time::{Duration, Instant};

    /// A job's directory with its checkout, `attempt-1/`.
    fn job_dir() -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("attempt-1")).unwrap();
        let base = d.path().to_path_buf();
        (d, base)
    }

    fn rel() -> &'static Path {
        Path::new("attempt-1/result.json")
    }

    #[test]
    fn a_regular_file_is_read_whole_up_to_the_cap() {
        let (_d, base) = job_dir();
        std::fs::write(base.join(rel()), b"0123456789").unwrap();
        assert_eq!(read_capped(&base, rel(), 10).unwrap(), b"0123456789");
        let e = read_capped(&base, rel(), 9).unwrap_err();
        assert!(
            matches!(
                e,
                ReadError::TooLarge {
                    size: 10,
                    limit: 9,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(read_tail(&base, rel(), 4).unwrap(), b"6789");
        assert_eq!(read_tail(&base, rel(), 100).unwrap(), b"0123456789");
        let e = read_capped(&base, Path::new("attempt-1/absent"), 10).unwrap_err();
        assert!(matches!(e, ReadError::Missing { .. }), "{e}");
        for bad in [
            "../x",
            "/etc/passwd",
            "",
            "attempt-1/../attempt-1/result.json",
        ] {
            let e = read_capped(&base, Path::new(bad), 10).unwrap_err();
            assert!(matches!(e, ReadError::Io { .. }), "{bad}: {e}");
        }
    }

    #[test]
    fn links_in_the_files_place_or_a_directorys_are_not_followed() {
        let (_d, base) = job_dir();
        let outside = tempfile::tempdir().unwrap();
        let secret = outside.path().join("secret");
        std::fs::write(&secret, b"SECRET").unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        // The file itself a link.
        std::os::unix::fs::symlink(&secret, base.join(rel())).unwrap();
        let e = read_capped(&base, rel(), 1 << 20).unwrap_err();
        assert!(matches!(e, ReadError::Link { .. }), "{e}");
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert!(matches!(
            read_tail(&base, rel(), 10),
            Err(ReadError::Link { .. })
        ));
        // A directory on the way a link (the checkout swapped for a link to elsewhere).
        std::fs::write(outside.path().join("result.json"), b"SECRET").unwrap();
        std::os::unix::fs::symlink(outside.path(), base.join("swapped")).unwrap();
        let e = read_capped(&base, Path::new("swapped/result.json"), 1 << 20).unwrap_err();
        assert!(matches!(e, ReadError::Link { .. }), "{e}");
        // The base itself a link.
        let e = read_capped(&base.join("swapped"), Path::new("result.json"), 1 << 20).unwrap_err();
        assert!(
            matches!(e, ReadError::Link { .. } | ReadError::Io { .. }),
            "{e}"
        );
        assert!(!e.to_string().contains("SECRET"));
        // The fallback walk refuses the same links.
        let dir = rustix::fs::open(&base, DIR_FLAGS, Mode::empty()).unwrap();
        let walk = |p: &str| {
            let names: Vec<&OsStr> = Path::new(p).components().map(|c| c.as_os_str()).collect();
            open_walk(&dir, &names)
        };
        assert_eq!(walk("attempt-1/result.json").err(), Some(Errno::LOOP));
        assert_eq!(walk("swapped/result.json").err(), Some(Errno::LOOP));
        std::fs::remove_file(base.join(rel())).unwrap();
        std::fs::write(base.join(rel()), b"ok").unwrap();
        assert!(walk("attempt-1/result.json").is_ok());
    }

    #[test]
    fn a_fifo_is_refused_at_once_and_a_hard_link_is_refused() {
        let (_d, base) = job_dir();
        let fifo = base.join(rel());
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap();
        let start = Instant::now();
        let e = read_capped(&base, rel(), 1 << 20).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(
            matches!(
                e,
                ReadError::NotRegular {
                    kind: "FIFO (named pipe)",
                    ..
                }
            ),
            "{e}"
        );
        std::fs::remove_file(&fifo).unwrap();
        std::fs::create_dir(&fifo).unwrap();
        let e = read_capped(&base, rel(), 1 << 20).unwrap_err();
        assert!(
            matches!(
                e,
                ReadError::NotRegular {
                    kind: "directory",
                    ..
                }
            ),
            "{e}"
        );
        std::fs::remove_dir(&fifo).unwrap();
        let other = base.join("other");
        std::fs::write(&other, b"not the job's").unwrap();
        std::fs::hard_link(&other, &fifo).unwrap();
        let e = read_capped(&base, rel(), 1 << 20).unwrap_err();
        assert!(matches!(e, ReadError::HardLinked { links: 2, .. }), "{e}");
    }

    #[test]
    fn a_huge_sparse_file_is_refused_without_reading_it() {
        let (_d, base) = job_dir();
        let f = File::create(base.join(rel())).unwrap();
        f.set_len(3 << 30).unwrap();
        let e = read_capped(&base, rel(), 64 << 20).unwrap_err();
        match e {
            ReadError::TooLarge { size, limit, .. } => {
                assert_eq!((size, limit), (3 << 30, 64 << 20));
            }
            e => panic!("{e}"),
        }
        // The tail of it is only the tail.
        assert_eq!(read_tail(&base, rel(), 16).unwrap(), vec![0u8; 16]);
    }

    /// Counts what is read from an endless source: a file that grows while it is read.
    struct Endless {
        read: u64,
    }

    impl Read for Endless {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            buf.fill(b'x');
            self.read += buf.len() as u64;
            Ok(buf.len())
        }
    }

    #[test]
    fn never_more_than_the_cap_and_one_byte_is_read() {
        let mut src = Endless { read: 0 };
        let cap = 1_000_000;
        match read_bounded(&mut src, cap, 10) {
            Err(Bounded::Over(n)) => assert_eq!(n, cap + 1),
            other => panic!("{other:?}"),
        }
        assert_eq!(src.read, cap + 1);
        assert_eq!(read_bounded(&b"abc"[..], 3, 3).unwrap(), b"abc");
        assert!(matches!(
            read_bounded(&b"abcd"[..], 3, 3),
            Err(Bounded::Over(4))
        ));
    }
}
