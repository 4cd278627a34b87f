//! The PostgreSQL server the tests use: the one `scripts/postgres.sh start DIR` started (the
//! test command does), named by `KERNELKITE_TEST_DATABASE_URL`. Each test takes a schema of
//! its own there ([`schema`]), so tests running at once share the server and nothing else.

/// The variable naming the tests' server.
pub const URL_VAR: &str = "KERNELKITE_TEST_DATABASE_URL";

/// The tests' server's URL, or `None` after recording that the test is skipped for want of it.
pub fn url() -> Option<String> {
    match std::env::var(URL_VAR) {
        Ok(u) if !u.is_empty() => Some(u),
        _ => {
            crate::skip(format!(
                "{URL_VAR} is not set: no PostgreSQL server to test against (scripts/test.sh starts one; by hand: scripts/postgres.sh start DIR prints the URL to export)"
            ));
            None
        }
    }
}

/// The server a benchmark measures: `KERNELKITE_BENCH_DATABASE_URL` (a durable one, as
/// `scripts/postgres.sh start DIR durable` starts), else the tests' server; `None` when
/// neither is set (the benchmark says what it left out).
pub fn bench_url() -> Option<String> {
    ["KERNELKITE_BENCH_DATABASE_URL", URL_VAR]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|u| !u.is_empty()))
}

/// A schema name no other test uses: `kk_test_` and random hex.
pub fn schema() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    format!("kk_test_{:016x}", h.finish())
}
