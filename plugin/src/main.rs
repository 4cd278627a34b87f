//! `kernelkite-isolate`: thin entry point; everything lives in the library.
fn main() -> std::process::ExitCode {
    kernelkite_isolate::cli::main()
}
