//! The runner's own binary, built beside the plugin's tests: `tests/hooks_real/hooks_sandbox_real.rs` runs
//! it as a job's command, inside the sandbox, the way a kernelbot pipeline step does.

fn main() -> std::process::ExitCode {
    kernelkite_runner::cli::main()
}
