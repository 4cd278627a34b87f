//! `kernelkite-runner` for the end-to-end tests: the runner's own entry point, built with the
//! tests (cargo builds a package's binaries for its tests, never a dependency's), so a test
//! never runs a stale or missing `target/*/kernelkite-runner`.
fn main() -> std::process::ExitCode {
    kernelkite_runner::cli::main()
}
