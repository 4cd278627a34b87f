//! Test support for the leaf crates, and through `kernelkite-testkit` for every other: a test
//! that cannot run here says why and is counted as skipped ([`skip()`]), scratch directories,
//! small tmpfs mounts ([`tmpfs`]), the NVML stand-in ([`fake_nvml`]) and AMD KFD trees
//! ([`kfd`]). It depends on no kernelkite crate, so `cargo test -p kernelkite-sys` (or the
//! kernelbot, topology, hooks and runner crates) builds none of the service's dependencies.

pub mod fake_nvml;
pub mod kfd;
pub mod postgres;
pub mod skip;
pub mod sleeper;
pub mod tmpfs;

pub use skip::skip;
pub use sleeper::Sleeper;

/// A binary a script builds for the tests (`scripts/node-binaries.sh`,
/// `scripts/buildkite-agent.sh`): the one the variable `var` names, which must be there (a
/// wrong name is the caller's mistake, never a skip), else `fallback` where it is a file;
/// `None` when there is neither, for the caller to skip or leave out.
pub fn built_binary(var: &str, fallback: Option<std::path::PathBuf>) -> Option<std::path::PathBuf> {
    if let Some(p) = std::env::var_os(var) {
        let p = std::path::PathBuf::from(p);
        assert!(p.is_file(), "{var}={} is not a file", p.display());
        return Some(p);
    }
    fallback.filter(|p| p.is_file())
}

/// The static build of the hooks, what `setup` installs on a node: `KERNELKITE_STATIC_ISOLATE`
/// (the test command sets it), else what `scripts/node-binaries.sh target/node` wrote; `None`
/// when there is neither.
pub fn static_isolate() -> Option<std::path::PathBuf> {
    let built = node_dir().join("kernelkite-isolate");
    built_binary("KERNELKITE_STATIC_ISOLATE", Some(built))
}

/// Where `scripts/node-binaries.sh target/node` writes the release binaries a node installs:
/// `target/node` in the repository (the test command writes only the static hooks there, with
/// `--static-only`).
fn node_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/node")
}

/// The release build of `name` (`kernelkite-isolate-nvml`, `kernelkite-runner`) that
/// `scripts/node-binaries.sh target/node` wrote, what a node runs; `None` when it was not
/// built. Benchmarks measure it rather than their own build, whose profile differs.
pub fn node_binary(name: &str) -> Option<std::path::PathBuf> {
    Some(node_dir().join(name)).filter(|p| p.is_file())
}

/// The real interpreter behind `python3` (not a shim), or `None` when there is no Python.
pub fn python() -> Option<&'static str> {
    static PY: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    PY.get_or_init(|| {
        let out = std::process::Command::new("python3")
            .args(["-c", "import sys; print(sys.executable)"])
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    })
    .as_deref()
}

/// [`python()`], or `None` after recording that the test is skipped for want of it.
pub fn need_python() -> Option<&'static str> {
    let p = python();
    if p.is_none() {
        skip("python3 is not available");
    }
    p
}

/// A scratch directory on tmpfs when there is one: fake trees are thousands of small files, and
/// sysfs itself lives in memory, so disk-backed /tmp would only measure the disk.
pub fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("kernelkite-fake")
        .tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("a scratch directory in /dev/shm or the temp dir")
}

/// Fails, listing `warnings` (a plan's), unless one of them contains every one of `parts`.
pub fn assert_warns(warnings: &[String], parts: &[&str]) {
    assert!(
        warnings
            .iter()
            .any(|w| parts.iter().all(|part| w.contains(part))),
        "no warning with {parts:?}: {warnings:?}"
    );
}
