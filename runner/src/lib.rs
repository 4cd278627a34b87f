//! kernelkite-runner: evaluates a kernelbot submission and writes kernelbot's `result.json`.
//!
//! The payload codec, the run config and the result types here are shared with the service,
//! so nothing about kernelbot's formats is defined twice. [`eval::run_config`] is the
//! evaluation itself, callable in process.

pub mod cli;
pub mod config;
pub mod cuda;
pub mod eval;
pub mod example;
pub mod payload;
pub mod process;
pub mod profile;
pub mod pyrepr;
pub mod result;
pub mod sysinfo;
pub mod text;
pub mod workdir;
pub mod ziparchive;
