//! `kernelkite-isolate setup`: from a bare GPU node to serving jobs with one command.
//!
//! Setup is split the way the rest of the crate is: what to install is a pure function of the
//! node's plan and facts and the operator's options ([`render`]: files with their modes and
//! contents, the job user, the units to enable), what to do about it is a pure function of that
//! and what is on disk ([`apply::decide`]: write, keep, replace, remove, and the commands), and
//! a thin executor ([`apply::execute`]) does it, under a fake root for tests (`--root`), where
//! commands are recorded instead of run. A manifest ([`manifest`]) records what setup wrote
//! and changed, so a second run changes nothing and `--uninstall` removes exactly that.
//!
//! | module | what |
//! |---|---|
//! | [`paths`] | where everything goes on the node |
//! | [`facts`] | what setup reads from the machine: cgroup version, kernel, users and groups, device owners |
//! | [`render`] | the files and state a node needs, from its plan |
//! | [`manifest`] | what setup wrote, for the next run and for `--uninstall` |
//! | [`apply`] | comparing with the disk, the commands, and the executor |
//! | [`report`] | how setup prints what it does (and, with `--dry-run`, would do) |
//! | [`smoke`] | the smoke job: plays the agent for one job per slice through the installed hooks |

pub mod apply;
pub mod facts;
pub mod manifest;
pub mod paths;
pub mod render;
pub mod report;
pub mod smoke;

use std::path::{Path, PathBuf};

/// Why setup cannot go on; each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// An option has a value setup cannot use.
    #[error("{0}")]
    Invalid(String),
    /// A file or directory could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The path on the machine (under the root).
        path: PathBuf,
        /// What the file system said.
        #[source]
        source: std::io::Error,
    },
    /// Files setup would write already exist, were not written by it, and differ.
    #[error("{} already exist(s) and {} not written by setup: move them away, or pass --replace to overwrite them (each is kept as <name>.kernelkite-orig and restored by --uninstall)", .0.join(", "), if .0.len() == 1 { "was" } else { "were" })]
    Conflicts(Vec<String>),
    /// The manifest of an earlier run cannot be read.
    #[error("cannot read setup's manifest {path}: {reason}; if the node was set up by hand, remove what setup would write and run it again")]
    Manifest {
        /// The manifest.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A command setup runs failed.
    #[error("`{command}` failed: {reason}")]
    Command {
        /// The command line.
        command: String,
        /// Its status and output.
        reason: String,
    },
}

impl SetupError {
    /// An I/O error about `path`.
    pub fn io(path: &Path, source: std::io::Error) -> SetupError {
        SetupError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// `path` (absolute on the node) under `root`: `/etc/x` under `/tmp/r` is `/tmp/r/etc/x`.
pub fn under(root: &Path, path: &Path) -> PathBuf {
    match path.strip_prefix("/") {
        Ok(rel) => root.join(rel),
        Err(_) => root.join(path),
    }
}
