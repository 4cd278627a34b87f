//! Command-line front end of `kernelkite-isolate`: the node tools of `kernelkite-admin` and
//! the hooks of `kernelkite-hooks`, in one binary.
//!
//! The binary is also installed as agent-level hooks: links named `environment`, `command`,
//! `pre-exit`, ... point at it, and it dispatches on the name it was called by
//! (see [`kernelkite_hooks::cli::subcommand_for_argv0`]).

use std::ffi::OsString;
use std::path::Path;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kernelkite_admin::cli::{doctor, fixture, plan, setup};
use kernelkite_hooks::cli as hook;

/// Give each Buildkite job one GPU, NUMA-local whole CPU cores and a memory limit, enforced by
/// the kernel, and clean up after it.
#[derive(Debug, Parser)]
#[command(name = "kernelkite-isolate", version, about, long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands: node tools, and the hooks.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Plan per-GPU slices of this node (or of a fake sysfs tree / an hwloc XML export).
    Plan(plan::PlanArgs),
    /// Check the live machine for everything isolation needs, one line each: ok / warn / fail.
    Doctor(doctor::DoctorArgs),
    /// Write a fake sysfs/procfs tree of a known machine (DGX H100, MI300X, ...) for trying
    /// `plan` and the hooks without the hardware.
    Fixture(fixture::FixtureArgs),
    /// Set this node up to serve jobs: install the binaries, the plan, the job user, the
    /// Buildkite agents and their systemd units, link the agent-level hooks, then check it
    /// (doctor and a smoke job) and start the agents. `--dry-run` shows everything first.
    Setup(setup::SetupArgs),
    /// Run one job per slice through the installed agent-level hooks, playing the agent, and
    /// check each sees its GPU, CPUs and cgroup (no Buildkite needed).
    Smoke(setup::SmokeArgs),
    /// The hooks (`environment`, `command`, `pre-exit`).
    #[command(flatten)]
    Hook(hook::HookCommand),
}

/// Whether `command` reads this machine's NVIDIA GPUs (`plan`, `doctor` and `setup` on the
/// live root, the driver loaded): their MIG devices are known only through NVML, which the
/// static build cannot load, so it would plan a GPU in MIG mode whole and doctor could not
/// see MIG at all.
fn reads_live_nvidia(command: &Command, driver_loaded: bool) -> bool {
    let live = |root: &Path| root == Path::new("/");
    driver_loaded
        && match command {
            Command::Plan(a) => a.topology_xml.is_none() && live(&a.sysfs_root),
            Command::Doctor(a) => live(&a.sysfs_root),
            Command::Setup(a) => live(&a.sysfs_root),
            _ => false,
        }
}

/// In the static build, hands a node tool that reads the live NVIDIA GPUs to the dynamically
/// linked build (`exec`: same arguments and process), as the hooks do when they need NVML;
/// without that build, says what is lost and goes on.
fn hand_over_node_tool(command: &Command, args: &[OsString]) {
    use kernelkite_hooks::delegate::{nvml_build, LOADS_NVML};
    let driver = Path::new("/proc/driver/nvidia/version").exists();
    if LOADS_NVML || !reads_live_nvidia(command, driver) {
        return;
    }
    let env: std::collections::BTreeMap<String, String> = std::env::vars().collect();
    let exe = std::env::current_exe().unwrap_or_else(|_| "kernelkite-isolate".into());
    let path = nvml_build(&env, &exe);
    if !path.is_file() {
        eprintln!(
            "kernelkite-isolate: warning: this static build cannot load NVML and {} is missing: MIG devices are not seen (a GPU in MIG mode is planned whole); install it beside this binary (`setup --from DIR` does) or run it directly",
            path.display()
        );
        return;
    }
    use std::os::unix::process::CommandExt;
    let err = std::process::Command::new(&path)
        .args(args.get(1..).unwrap_or_default())
        .exec();
    eprintln!(
        "kernelkite-isolate: warning: cannot run {} ({err}): MIG devices are not seen",
        path.display()
    );
}

/// Entry point used by `main.rs`.
pub fn main() -> ExitCode {
    let args: Vec<OsString> = hook::subcommand_for_argv0(std::env::args_os().collect());
    let cli = Cli::parse_from(&args);
    init_tracing();
    hand_over_node_tool(&cli.command, &args);
    let outcome = match cli.command {
        Command::Plan(a) => plan::run(a),
        Command::Doctor(a) => doctor::run(a),
        Command::Fixture(a) => fixture::run(a),
        Command::Setup(a) => setup::run_setup(a),
        Command::Smoke(a) => setup::run_smoke(a),
        Command::Hook(h) => hook::run(h, args.get(1..).unwrap_or_default()),
    };
    match outcome {
        Ok(code) => code,
        Err(e) => {
            let e: &(dyn std::error::Error + 'static) = e.as_ref();
            eprintln!(
                "kernelkite-isolate: error: {}",
                kernelkite_sys::error::Chain(e)
            );
            ExitCode::FAILURE
        }
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KERNELKITE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_node_tools_on_the_live_root_of_an_nvidia_node_need_nvml() {
        let cmd = |argv: &[&str]| Cli::parse_from(argv).command;
        let plan = cmd(&["kernelkite-isolate", "plan"]);
        assert!(reads_live_nvidia(&plan, true));
        assert!(!reads_live_nvidia(&plan, false), "no driver, no MIG");
        assert!(reads_live_nvidia(
            &cmd(&["kernelkite-isolate", "doctor"]),
            true
        ));
        assert!(!reads_live_nvidia(
            &cmd(&["kernelkite-isolate", "plan", "--sysfs-root", "/tmp/dgx"]),
            true
        ));
        assert!(!reads_live_nvidia(
            &cmd(&["kernelkite-isolate", "plan", "--topology-xml", "/tmp/x.xml"]),
            true
        ));
        assert!(!reads_live_nvidia(
            &cmd(&[
                "kernelkite-isolate",
                "fixture",
                "dgx-h100",
                "--out",
                "/tmp/d"
            ]),
            true
        ));
    }
}
