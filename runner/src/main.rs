fn main() -> std::process::ExitCode {
    kernelkite_runner::cli::main()
}
