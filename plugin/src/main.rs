//! `kernelkite-isolate`: thin entry point; everything lives in the library.
#[cfg(target_env = "musl")]
#[global_allocator]
static ALLOCATOR: dlmalloc::GlobalDlmalloc = dlmalloc::GlobalDlmalloc;

fn main() -> std::process::ExitCode {
    kernelkite_isolate::cli::main()
}
