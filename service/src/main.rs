//! kernelkite-service: thin entry point; the command line is `kernelkite_service::cli`.
fn main() -> std::process::ExitCode {
    kernelkite_service::cli::main()
}
