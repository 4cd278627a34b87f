//! `kernelkite-isolate doctor`: one line per requirement, ok / warn / fail, with a fix.
use std::path::PathBuf;
use std::process::ExitCode;

use crate::doctor::{exit_code, run_checks, DoctorOptions, LiveHost};

/// Arguments of `doctor`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Exit status: 0 when no check failed (warnings allowed), 1 when any check failed."
)]
pub struct DoctorArgs {
    /// Root of the sysfs/procfs tree to check (`/` on the node).
    #[arg(
        long,
        env = "KERNELKITE_SYSFS_ROOT",
        default_value = "/",
        value_name = "DIR"
    )]
    pub sysfs_root: PathBuf,
    /// Also check Docker and the NVIDIA container toolkit (for the plugin's docker mode).
    #[arg(long, env = "KERNELKITE_DOCTOR_DOCKER")]
    pub docker: bool,
}

/// Runs every check and prints one line each; fails when any check fails.
pub fn run(args: DoctorArgs) -> anyhow::Result<ExitCode> {
    let checks = run_checks(
        &DoctorOptions {
            root: args.sysfs_root,
            docker: args.docker,
        },
        &LiveHost::default(),
    );
    for c in &checks {
        sayln!("{c}");
    }
    Ok(ExitCode::from(exit_code(&checks)))
}
