//! kernelkite-runner: evaluates a kernelbot submission and writes kernelbot's `result.json`.
//!
//! kernelbot's formats (run config, payload codec, `FullResult`) live in `kernelkite-kernelbot`,
//! shared with the service. [`eval::run_config`] is the evaluation itself, callable in
//! process; [`cli`] is the binary's edge.

#![deny(missing_docs)]

pub mod cli;
pub mod cuda;
pub mod eval;
pub mod example;
pub mod guard;
pub mod process;
pub mod profile;
pub mod provenance;
pub mod sysinfo;
pub mod text;
pub mod workdir;
pub mod ziparchive;
