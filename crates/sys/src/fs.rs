//! Files that are never seen half-written, even after a crash.

use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Writes `contents` to `path` atomically and durably, with permissions `mode`.
///
/// The bytes go to a temporary file in the same directory, which is fsynced and renamed over
/// `path` (`tempfile`'s persist), and then the directory is fsynced so the rename itself
/// survives a power cut. A reader sees the old file or the new one, never a part; a crash
/// leaves at most a stray temporary file (`.<name>.<random>`), never a truncated `path`.
pub fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
    let dir = parent_dir(path);
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path names no file"))?;
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{}.", name.to_string_lossy()))
        .tempfile_in(&dir)?;
    tmp.write_all(contents)?;
    // tempfile creates 0600; the file is meant for whoever reads it next.
    tmp.as_file()
        .set_permissions(std::fs::Permissions::from_mode(mode))?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    std::fs::File::open(&dir)?.sync_all()
}

/// The directory `path` lives in (`.` for a bare file name).
fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_file_whole_with_the_mode_asked() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("result.json");
        std::fs::write(&p, "old and longer than the new content").unwrap();
        write_atomic(&p, b"new", 0o644).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644);
        let names: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("result.json")]);
    }

    #[test]
    fn a_missing_directory_is_an_error_and_nothing_is_written() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("no/such/dir/x.json");
        let e = write_atomic(&p, b"x", 0o600).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(!d.path().join("no").exists());
        assert_eq!(
            write_atomic(Path::new("/"), b"x", 0o600)
                .unwrap_err()
                .kind(),
            io::ErrorKind::InvalidInput
        );
    }

    #[test]
    fn a_bare_name_is_written_in_the_current_directory() {
        assert_eq!(parent_dir(Path::new("r.json")), PathBuf::from("."));
        assert_eq!(parent_dir(Path::new("/a/r.json")), PathBuf::from("/a"));
    }
}
