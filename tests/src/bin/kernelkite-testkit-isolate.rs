//! `kernelkite-isolate` for the end-to-end tests: the plugin's own entry point, built with the
//! tests (see `kernelkite-testkit-runner`).
fn main() -> std::process::ExitCode {
    kernelkite_isolate::cli::main()
}
