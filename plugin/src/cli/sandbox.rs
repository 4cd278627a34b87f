//! `kernelkite-isolate sandbox-exec`: the hidden sub-command the `command` hook starts inside
//! the job's cgroup to build the sandbox and `exec` the step's command (see
//! [`crate::sandbox`]). Not for people: its input is the hook's JSON.

use std::ffi::OsString;
use std::io::Write;
use std::process::ExitCode;

use crate::job::error::Chain;
use crate::sandbox::{self, SandboxSpec};

/// Arguments of `sandbox-exec`.
#[derive(Debug, clap::Args)]
pub struct SandboxExecArgs {
    /// What to build, as the `command` hook planned it (JSON).
    #[arg(long)]
    pub spec: String,
    /// A pipe the hook reads: the reason the command could not be started, or end-of-file once
    /// it was.
    #[arg(long)]
    pub report_fd: Option<i32>,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub argv: Vec<OsString>,
}

/// Builds the sandbox and `exec`s the command; returns only when that failed, with exit status
/// [`sandbox::SETUP_FAILED`] after writing why to the report pipe (or stderr without one).
pub fn run(args: SandboxExecArgs) -> ExitCode {
    let mut report = match args.report_fd.map(kernelkite_sys::raw::adopt_inherited_fd) {
        Some(Ok(fd)) => Some(std::fs::File::from(fd)),
        Some(Err(e)) => {
            eprintln!("kernelkite: sandbox: cannot use the report pipe: {e}");
            return ExitCode::from(sandbox::SETUP_FAILED);
        }
        None => None,
    };
    let outcome = serde_json::from_str::<SandboxSpec>(&args.spec)
        .map_err(|e| format!("the sandbox spec is not valid: {e}"))
        .and_then(|spec| sandbox::run_helper(&spec, &args.argv).map_err(|e| Chain(&e).to_string()));
    let Err(why) = outcome;
    match report.as_mut().map(|r| r.write_all(why.as_bytes())) {
        Some(Ok(())) => {}
        _ => eprintln!("kernelkite: sandbox: {why}"),
    }
    ExitCode::from(sandbox::SETUP_FAILED)
}
