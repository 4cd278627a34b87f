//! `kernelkite-service` for the end-to-end tests: the service's own entry point, built with
//! the tests (see `kernelkite-testkit-runner`).
fn main() -> std::process::ExitCode {
    kernelkite_service::cli::main()
}
