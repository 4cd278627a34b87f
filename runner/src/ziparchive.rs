//! A minimal zip writer (deflate entries, no zip64) for profiler traces, which kernelbot
//! ships as `base64(zip(profile_data/))` in `ProfileResult.trace`.

use std::io::{self, Write};
use std::path::Path;

use flate2::write::DeflateEncoder;
use flate2::{Compression, Crc};

struct Entry {
    name: Vec<u8>,
    crc: u32,
    compressed: u32,
    size: u32,
    offset: u32,
}

fn too_big() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        "profile data exceeds 4 GiB; zip64 is not supported",
    )
}

/// Zips the files below `dir` (paths relative to it, sorted) into memory.
pub fn zip_dir(dir: &Path) -> io::Result<Vec<u8>> {
    let mut files = Vec::new();
    collect(dir, dir, &mut files)?;
    files.sort();
    let mut out: Vec<u8> = Vec::new();
    let mut entries = Vec::new();
    for rel in files {
        let data = std::fs::read(dir.join(&rel))?;
        let mut crc = Crc::new();
        crc.update(&data);
        let mut enc = DeflateEncoder::new(Vec::new(), Compression::default());
        enc.write_all(&data)?;
        let packed = enc.finish()?;
        let name = rel.into_bytes();
        let e = Entry {
            crc: crc.sum(),
            compressed: u32::try_from(packed.len()).map_err(|_| too_big())?,
            size: u32::try_from(data.len()).map_err(|_| too_big())?,
            offset: u32::try_from(out.len()).map_err(|_| too_big())?,
            name,
        };
        out.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        out.extend_from_slice(&[20, 0, 0, 0, 8, 0, 0, 0, 0x21, 0]); // version, flags, deflate, time, date (1980-01-01)
        out.extend_from_slice(&e.crc.to_le_bytes());
        out.extend_from_slice(&e.compressed.to_le_bytes());
        out.extend_from_slice(&e.size.to_le_bytes());
        out.extend_from_slice(&(e.name.len() as u16).to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&e.name);
        out.extend_from_slice(&packed);
        entries.push(e);
    }
    let cd_start = u32::try_from(out.len()).map_err(|_| too_big())?;
    for e in &entries {
        out.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        out.extend_from_slice(&[20, 3, 20, 0, 0, 0, 8, 0, 0, 0, 0x21, 0]); // made by unix, needed, flags, method, time, date
        out.extend_from_slice(&e.crc.to_le_bytes());
        out.extend_from_slice(&e.compressed.to_le_bytes());
        out.extend_from_slice(&e.size.to_le_bytes());
        out.extend_from_slice(&(e.name.len() as u16).to_le_bytes());
        out.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0]); // extra, comment, disk, internal attrs
        out.extend_from_slice(&((0o100644u32) << 16).to_le_bytes());
        out.extend_from_slice(&e.offset.to_le_bytes());
        out.extend_from_slice(&e.name);
    }
    let cd_size = u32::try_from(out.len()).map_err(|_| too_big())? - cd_start;
    let n = u16::try_from(entries.len()).map_err(|_| too_big())?;
    out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&cd_size.to_le_bytes());
    out.extend_from_slice(&cd_start.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    Ok(out)
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
            kernelkite_testkit::skip("python3 not available");
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
}
