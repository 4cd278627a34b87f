//! A small tmpfs on a temporary directory: a disk a test can fill, gone when the test ends.

use std::path::{Path, PathBuf};

/// A mounted tmpfs, unmounted (lazily) when dropped.
pub struct SmallTmpfs {
    dir: tempfile::TempDir,
}

impl SmallTmpfs {
    /// Mounts a tmpfs of `size` bytes on a new temporary directory. `None`, after recording
    /// the test as skipped, where this process may not mount (it needs root).
    pub fn mount(size: u64) -> Option<SmallTmpfs> {
        Self::mount_on(tempfile::tempdir(), size, "")
    }

    /// The same on a new directory inside `parent` (a mount inside another), with extra mount
    /// `options` (`"noexec"`, ...).
    pub fn mount_in(parent: &Path, size: u64, options: &str) -> Option<SmallTmpfs> {
        Self::mount_on(tempfile::tempdir_in(parent), size, options)
    }

    fn mount_on(
        dir: std::io::Result<tempfile::TempDir>,
        size: u64,
        options: &str,
    ) -> Option<SmallTmpfs> {
        let dir = dir.expect("a temporary directory");
        let mut opts = format!("size={size}");
        if !options.is_empty() {
            opts = format!("{opts},{options}");
        }
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &opts, "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            crate::skip("cannot mount a small tmpfs to fill (needs root)");
            return None;
        }
        Some(SmallTmpfs { dir })
    }

    /// Where it is mounted.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Fills it with a file (`filler`) but for about `room` bytes; returns the file's path,
    /// to remove when the test gives the room back.
    pub fn fill_leaving(&self, room: u64) -> PathBuf {
        let fs = rustix::fs::statvfs(self.path()).expect("statvfs of the tmpfs");
        let free = fs.f_bavail.saturating_mul(fs.f_frsize);
        let filler = self.path().join("filler");
        let len = usize::try_from(free.saturating_sub(room)).expect("a small tmpfs");
        std::fs::write(&filler, vec![0u8; len]).expect("fill the tmpfs");
        filler
    }
}

impl Drop for SmallTmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}
