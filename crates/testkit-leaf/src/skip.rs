//! Skipped tests, counted as skipped.
//!
//! Rust's test harness has no run-time skip: a test that returns early because the machine
//! lacks root, cgroups, a GPU or a tool shows as `ok`. [`skip`] records the test's name and
//! the reason in the file named by `KERNELKITE_SKIP_LOG` (one line each), and
//! `scripts/test.sh` subtracts those from the passed count and lists them, so nothing that
//! did not run is reported as passed.

use std::io::Write;

/// The variable naming the file skips are appended to.
pub const SKIP_LOG_ENV: &str = "KERNELKITE_SKIP_LOG";

/// Marks the running test as skipped: prints the reason and records it for the test script.
/// Call it right before the early `return` that skips the test's checks.
pub fn skip(reason: impl std::fmt::Display) {
    let name = test_name();
    // Tabs and line breaks would break the log's one-line-per-skip format.
    let reason = reason.to_string().replace(['\n', '\r', '\t'], " ");
    eprintln!("skipped: {name}: {reason}");
    let Some(path) = std::env::var_os(SKIP_LOG_ENV) else {
        return;
    };
    // One write of one short line with O_APPEND: lines from parallel tests never interleave.
    let line = format!("{name}\t{reason}\n");
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        // A skip that cannot be recorded would be counted as a pass: fail loudly instead.
        panic!("cannot record the skip in {}: {e}", path.to_string_lossy());
    }
}

/// `<test binary>::<test path>`: libtest names each test's thread after the test.
fn test_name() -> String {
    let binary = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        // Test binaries are `<name>-<hash>`; the hash only adds noise.
        .map(|s| match s.rsplit_once('-') {
            Some((name, hash)) if hash.chars().all(|c| c.is_ascii_hexdigit()) => name.to_string(),
            _ => s,
        })
        .unwrap_or_else(|| "?".into());
    let thread = std::thread::current();
    format!("{binary}::{}", thread.name().unwrap_or("?"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_is_recorded_with_the_test_name_and_reason() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("skips");
        // The variable is read per call; set it for this process (no other test here reads it).
        std::env::set_var(SKIP_LOG_ENV, &log);
        skip("no GPU\non this machine");
        skip("second");
        std::env::remove_var(SKIP_LOG_ENV);
        let text = std::fs::read_to_string(&log).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(
            lines[0].ends_with("skip::tests::a_skip_is_recorded_with_the_test_name_and_reason\tno GPU on this machine"),
            "{text}"
        );
        assert!(lines[0].starts_with("kernelkite_testkit_leaf::"), "{text}");
        assert!(lines[1].ends_with("\tsecond"), "{text}");
    }
}
