//! What setup wrote and changed, kept in `/var/lib/kernelkite/setup-manifest.json` (root-only):
//! every file with its mode and SHA-256 (or link target), the directories it created, the
//! files it moved aside with `--replace`, whether it created the job user or added it to
//! groups, and the units it enabled. The next run compares against it (so it changes nothing
//! when nothing changed, and removes what is no longer wanted); `--uninstall` undoes exactly it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::SetupError;

/// The manifest's format version.
pub const VERSION: u32 = 1;

/// A file setup wrote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Entry {
    /// A regular file.
    File {
        /// The path on the node.
        path: PathBuf,
        /// Its permission bits, in octal (`"0644"`).
        mode: String,
        /// The SHA-256 of what was written, in hex.
        sha256: String,
    },
    /// A symbolic link.
    Link {
        /// The path on the node.
        path: PathBuf,
        /// Where it points.
        target: PathBuf,
    },
}

impl Entry {
    /// The path on the node.
    pub fn path(&self) -> &Path {
        match self {
            Entry::File { path, .. } | Entry::Link { path, .. } => path,
        }
    }
}

/// A file that was there before setup and was moved aside with `--replace`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Backup {
    /// The path setup writes.
    pub path: PathBuf,
    /// Where the earlier file was moved (`<path>.kernelkite-orig`).
    pub moved_to: PathBuf,
}

/// What setup wrote and changed on a node.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Manifest {
    /// [`VERSION`].
    pub version: u32,
    /// The node's name when it was written.
    pub node: String,
    /// Files and links, in the order they were written.
    pub files: Vec<Entry>,
    /// Directories setup created (parents first); `--uninstall` removes those left empty.
    pub created_dirs: Vec<PathBuf>,
    /// Earlier files moved aside with `--replace`, restored by `--uninstall`.
    pub backups: Vec<Backup>,
    /// Whether setup created the job user (then `--uninstall` deletes it).
    pub created_job_user: bool,
    /// Groups setup added the job user to (when it did not create it).
    pub added_groups: Vec<String>,
    /// Units setup enabled and started.
    pub enabled_units: Vec<String>,
}

impl Manifest {
    /// The entry for `path`, if setup wrote it.
    pub fn entry(&self, path: &Path) -> Option<&Entry> {
        self.files.iter().find(|e| e.path() == path)
    }

    /// The manifest as written: pretty JSON and a newline, stable across runs.
    pub fn to_text(&self) -> String {
        let mut s = serde_json::to_string_pretty(self).unwrap_or_else(|_| "{}".into());
        s.push('\n');
        s
    }

    /// Reads a manifest; `Ok(None)` when there is none.
    pub fn read(path: &Path) -> Result<Option<Manifest>, SetupError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(SetupError::io(path, e)),
        };
        let m: Manifest = serde_json::from_str(&text).map_err(|e| SetupError::Manifest {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        if m.version != VERSION {
            return Err(SetupError::Manifest {
                path: path.to_path_buf(),
                reason: format!(
                    "version {} is not {VERSION} (written by another kernelkite release)",
                    m.version
                ),
            });
        }
        Ok(Some(m))
    }
}

/// The SHA-256 of `bytes`, in hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// `0o644` as `"0644"`.
pub fn mode_text(mode: u32) -> String {
    format!("{:04o}", mode & 0o7777)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manifest_reads_back_what_was_written() {
        let m = Manifest {
            version: VERSION,
            node: "n".into(),
            files: vec![
                Entry::File {
                    path: "/etc/kernelkite/plan.json".into(),
                    mode: mode_text(0o644),
                    sha256: sha256_hex(b"x"),
                },
                Entry::Link {
                    path: "/etc/kernelkite/hooks/command".into(),
                    target: "/opt/kernelkite/bin/kernelkite-isolate".into(),
                },
            ],
            created_dirs: vec!["/etc/kernelkite".into()],
            backups: vec![],
            created_job_user: true,
            added_groups: vec![],
            enabled_units: vec!["kernelkite-agent@gpu0.service".into()],
        };
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("m.json");
        std::fs::write(&p, m.to_text()).unwrap();
        assert_eq!(Manifest::read(&p).unwrap(), Some(m.clone()));
        assert!(m.to_text().contains("\"kind\": \"link\""));
        assert_eq!(Manifest::read(&d.path().join("none")).unwrap(), None);
        std::fs::write(&p, m.to_text().replace("\"version\": 1", "\"version\": 9")).unwrap();
        let e = Manifest::read(&p).unwrap_err().to_string();
        assert!(e.contains("version 9"), "{e}");
        std::fs::write(&p, "{").unwrap();
        assert!(Manifest::read(&p).is_err());
    }

    #[test]
    fn hashes_and_modes_are_written_as_expected() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(mode_text(0o600), "0600");
        assert_eq!(mode_text(0o100755), "0755");
    }
}
