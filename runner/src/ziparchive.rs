//! Zips profiler traces, which kernelbot ships as `base64(zip(profile_data/))` in
//! `ProfileResult.trace`, through the `zip` crate: deflate, UTF-8 names, zip64 for members
//! over 4 GiB, and a fixed timestamp so the same files give the same archive.

use std::io::{self, Cursor, Write};
use std::path::Path;

use zip::write::SimpleFileOptions;
use zip::{CompressionMethod, DateTime, ZipWriter};

/// Zips the files below `dir` (paths relative to it, sorted) into memory.
///
/// Never follows a link: `dir` itself must be a directory, not a link to one, and entries that
/// are not regular files or directories (links, FIFOs, devices) are left out; the profiler
/// that wrote them ran as the submission.
pub fn zip_dir(dir: &Path) -> io::Result<Vec<u8>> {
    if !std::fs::symlink_metadata(dir)?.file_type().is_dir() {
        return Err(io::Error::other(format!(
            "{} is not a directory (a link?); refused",
            dir.display()
        )));
    }
    let mut files = Vec::new();
    collect(dir, dir, &mut files)?;
    files.sort();
    let mut zip = ZipWriter::new(Cursor::new(Vec::new()));
    for rel in files {
        let data = std::fs::read(dir.join(&rel))?;
        let options = SimpleFileOptions::default()
            .compression_method(CompressionMethod::Deflated)
            .last_modified_time(DateTime::DEFAULT)
            .unix_permissions(0o644)
            .large_file(data.len() as u64 >= u64::from(u32::MAX));
        zip.start_file(rel, options).map_err(io::Error::other)?;
        zip.write_all(&data)?;
    }
    Ok(zip.finish().map_err(io::Error::other)?.into_inner())
}

fn collect(root: &Path, dir: &Path, out: &mut Vec<String>) -> io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let ty = entry.file_type()?;
        let path = entry.path();
        if ty.is_dir() {
            collect(root, &path, out)?;
        } else if ty.is_file() {
            if let Ok(rel) = path.strip_prefix(root) {
                out.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_are_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        std::fs::write(data.join("trace"), "t").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", data.join("passwd")).unwrap();
        let zip = zip_dir(&data).unwrap();
        let mut archive = zip::ZipArchive::new(Cursor::new(zip)).unwrap();
        assert_eq!(archive.len(), 1);
        assert_eq!(archive.by_index(0).unwrap().name().unwrap(), "trace");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&data, &link).unwrap();
        assert!(zip_dir(&link)
            .unwrap_err()
            .to_string()
            .contains("not a directory"));
    }

    #[test]
    fn python_reads_the_archive() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        std::fs::write(d.path().join("a.txt"), "hello ".repeat(100)).unwrap();
        std::fs::write(d.path().join("sub/b.bin"), [0u8, 1, 2, 255]).unwrap();
        let zip = zip_dir(d.path()).unwrap();
        let zpath = d.path().join("x.zip");
        std::fs::write(&zpath, &zip).unwrap();
        let script = "import sys, zipfile\nz = zipfile.ZipFile(sys.argv[1])\nassert z.testzip() is None\nprint(sorted((i.filename, len(z.read(i))) for i in z.infolist()))";
        let Ok(out) = std::process::Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(&zpath)
            .output()
        else {
            kernelkite_testkit_leaf::skip("python3 not available");
            return;
        };
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "[('a.txt', 600), ('sub/b.bin', 4)]"
        );
    }

    #[test]
    fn names_are_utf8_and_members_are_deflated() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("trace-é.json"), "{}".repeat(1000)).unwrap();
        let zip = zip_dir(d.path()).unwrap();
        let mut archive = zip::ZipArchive::new(Cursor::new(&zip)).unwrap();
        let member = archive.by_index(0).unwrap();
        assert_eq!(member.name().unwrap(), "trace-é.json");
        assert_eq!(member.compression(), CompressionMethod::Deflated);
        assert!(
            member.compressed_size() < 100,
            "{}",
            member.compressed_size()
        );
        // The same files give the same bytes (no clock in the archive).
        drop(member);
        assert_eq!(zip_dir(d.path()).unwrap(), zip);
        assert!(zip_dir(&d.path().join("absent")).is_err());
    }
}
