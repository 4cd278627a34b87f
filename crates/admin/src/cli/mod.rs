//! The node tools' command-line edges: `plan`, `doctor`, `fixture`, `setup` and `smoke`.
//! `kernelkite-isolate` composes them with the hooks' subcommands into one binary.

/// Writes to stdout, ignoring a closed pipe: `plan | head` or `setup --dry-run | head` must
/// neither panic nor, in a real run, stop half-way because the reader went away.
fn say(text: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = out.write_fmt(text).and_then(|()| out.flush());
}

/// `print!` through [`say`].
macro_rules! say {
    ($($t:tt)*) => { $crate::cli::say(format_args!($($t)*)) };
}

/// `println!` through [`say`].
macro_rules! sayln {
    () => { $crate::cli::say(format_args!("\n")) };
    ($($t:tt)*) => { $crate::cli::say(format_args!("{}\n", format_args!($($t)*))) };
}

pub mod doctor;
pub mod fixture;
pub mod plan;
pub mod setup;
