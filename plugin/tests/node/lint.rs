//! Every shell script of the repository passes shellcheck, and the Dockerfiles pass hadolint.
//! scripts/test.sh installs shellcheck (apt) and fetches hadolint's pinned static binary when
//! it can (hadolint is not packaged by Debian); without them these tests skip, saying why.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

/// Whether a file is a shell script: a `sh`/`bash`/`bats` shebang, or a `.sh`/`.bash` name.
fn is_shell_script(path: &Path) -> bool {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    if name.ends_with(".sh") || name.ends_with(".bash") || name.ends_with(".bats") {
        return true;
    }
    let Ok(bytes) = std::fs::read(path) else {
        return false;
    };
    let first = bytes.split(|b| *b == b'\n').next().unwrap_or_default();
    let first = String::from_utf8_lossy(first);
    first.starts_with("#!")
        && ["/sh", "/bash", "env sh", "env bash", "bats"]
            .iter()
            .any(|s| first.contains(s))
}

/// The repository's files, without build output and git's own.
fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        let name = e.file_name();
        if name == ".git" || name == "target" || name == "node_modules" {
            continue;
        }
        let t = e.file_type().unwrap();
        if t.is_dir() {
            files(&p, out);
        } else if t.is_file() {
            out.push(p);
        }
    }
}

/// The repository's files as git sees them (tracked, and new ones it does not ignore), so a
/// developer's ignored scratch files are not linted; the walk where git cannot say.
fn repository_files() -> Vec<PathBuf> {
    let listed = Command::new("git")
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ])
        .current_dir(repo())
        .output()
        .ok()
        .filter(|o| o.status.success());
    match listed {
        Some(o) => o
            .stdout
            .split(|b| *b == 0)
            .filter(|p| !p.is_empty())
            .map(|p| repo().join(String::from_utf8_lossy(p).as_ref()))
            .filter(|p| p.is_file())
            .collect(),
        None => {
            let mut all = Vec::new();
            files(&repo(), &mut all);
            all
        }
    }
}

fn shell_scripts() -> Vec<PathBuf> {
    let all = repository_files();
    let mut scripts: Vec<PathBuf> = all.into_iter().filter(|p| is_shell_script(p)).collect();
    scripts.sort();
    scripts
}

#[test]
fn every_shell_script_passes_shellcheck() {
    let scripts = shell_scripts();
    let rel: Vec<String> = scripts
        .iter()
        .map(|p| p.strip_prefix(repo()).unwrap().display().to_string())
        .collect();
    for must in ["plugin/tests/bats/hooks.bats", "scripts/test.sh", ".ci/run"] {
        assert!(
            rel.iter().any(|r| r == must),
            "{must} was not found as a shell script: {rel:?}"
        );
    }
    if Command::new("shellcheck")
        .arg("--version")
        .output()
        .is_err()
    {
        kernelkite_testkit::skip("shellcheck is not installed (Debian: apt-get install shellcheck; scripts/test.sh installs it)");
        return;
    }
    // .shellcheckrc at the root makes sourced files be followed relative to each script.
    let out = Command::new("shellcheck")
        .args(&scripts)
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "shellcheck:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn shellcheck_would_catch_a_bad_script() {
    if Command::new("shellcheck")
        .arg("--version")
        .output()
        .is_err()
    {
        kernelkite_testkit::skip("shellcheck is not installed");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("bad.sh");
    std::fs::write(&p, "#!/bin/sh\nrm -rf $1/*\n").unwrap();
    assert!(is_shell_script(&p));
    let out = Command::new("shellcheck").arg(&p).output().unwrap();
    assert!(
        !out.status.success(),
        "an unquoted variable passed shellcheck"
    );
}

/// hadolint: `$KERNELKITE_HADOLINT` (scripts/test.sh sets it to the binary it fetched), else
/// `hadolint` on PATH.
fn hadolint() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KERNELKITE_HADOLINT").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    Command::new("hadolint")
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|_| PathBuf::from("hadolint"))
}

#[test]
fn dockerfiles_pass_hadolint() {
    let Some(bin) = hadolint() else {
        kernelkite_testkit::skip("hadolint is not installed (Debian does not package it; scripts/test.sh fetches the pinned static binary from GitHub releases when github.com is reachable, or set KERNELKITE_HADOLINT)");
        return;
    };
    let mut all = Vec::new();
    files(&repo().join("deployment"), &mut all);
    let dockerfiles: Vec<PathBuf> = all
        .into_iter()
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n == "Dockerfile" || n.starts_with("Dockerfile."))
        })
        .collect();
    // The runner's CUDA and ROCm images and the service's.
    assert_eq!(dockerfiles.len(), 3, "{dockerfiles:?}");
    let out = Command::new(bin)
        .arg("--config")
        .arg(repo().join("deployment/.hadolint.yaml"))
        .args(&dockerfiles)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "hadolint:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
