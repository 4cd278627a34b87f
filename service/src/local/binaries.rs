//! Finding the binaries local jobs run: the runner (inside the job) and the plugin's
//! `kernelkite-isolate` (the hooks). The service never links either; it runs them as an agent
//! runs them, so what is tested locally is what runs on a node.

use std::path::{Path, PathBuf};

use super::LocalError;

/// The runner's and the plugin's binary names: the node's layout, `kernelkite_sys::node`.
pub use kernelkite_sys::node::{ISOLATE_BINARY as ISOLATE, RUNNER_BINARY as RUNNER};

/// The binaries local jobs run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binaries {
    /// `kernelkite-runner`.
    pub runner: PathBuf,
    /// `kernelkite-isolate`.
    pub isolate: PathBuf,
}

/// Finds both binaries: the given path when there is one (it must be an executable file),
/// else beside this executable (`target/<profile>/` after a cargo build), else on PATH.
pub fn find(runner: Option<&Path>, isolate: Option<&Path>) -> Result<Binaries, LocalError> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf));
    Ok(Binaries {
        runner: find_one(RUNNER, runner, beside.as_deref())?,
        isolate: find_one(ISOLATE, isolate, beside.as_deref())?,
    })
}

/// One binary, by the rules of [`find`].
pub fn find_one(
    name: &'static str,
    given: Option<&Path>,
    beside: Option<&Path>,
) -> Result<PathBuf, LocalError> {
    if let Some(p) = given.filter(|p| !p.as_os_str().is_empty()) {
        return if is_executable(p) {
            Ok(absolute(p))
        } else {
            Err(LocalError::NotExecutable {
                name,
                path: p.to_path_buf(),
            })
        };
    }
    if let Some(dir) = beside {
        let p = dir.join(name);
        if is_executable(&p) {
            return Ok(absolute(&p));
        }
    }
    which::which(name)
        .map(|p| absolute(&p))
        .map_err(|_| LocalError::MissingBinary {
            name,
            searched: beside.map(Path::to_path_buf),
        })
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The real path (no link on the way: the sandbox binds the runner at the path it runs);
/// else the absolute one.
fn absolute(p: &Path) -> PathBuf {
    std::fs::canonicalize(p)
        .or_else(|_| std::path::absolute(p))
        .unwrap_or_else(|_| p.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_then_beside_then_path_and_a_clear_error() {
        let d = tempfile::tempdir().unwrap();
        let exe = d.path().join(RUNNER);
        std::fs::write(&exe, "#!/bin/sh\n").unwrap();
        let not_exec = d.path().join("plain");
        std::fs::write(&not_exec, "").unwrap();
        std::fs::set_permissions(&exe, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        assert_eq!(find_one(RUNNER, Some(&exe), None).unwrap(), exe);
        assert_eq!(find_one(RUNNER, None, Some(d.path())).unwrap(), exe);
        let e = find_one(RUNNER, Some(&not_exec), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not an executable file"), "{e}");
        let empty = tempfile::tempdir().unwrap();
        let e = find_one(ISOLATE, None, Some(empty.path()))
            .map(|p| p.display().to_string())
            .unwrap_or_else(|e| e.to_string());
        // Either on this machine's PATH, or the error names the build command.
        assert!(
            e.ends_with(ISOLATE) || e.contains("cargo build --release --workspace --bins"),
            "{e}"
        );
    }
}
