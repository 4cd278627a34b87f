//! Hook subcommands: `environment`, `command`, `pre-exit`: the command-line edge of
//! [`crate::job`], which does the work (undoing what fails included).
//!
//! The same binary serves the plugin's hooks (files whose first line is
//! [`PLUGIN_HOOK_SHEBANG`]: the agent executes them, and the kernel runs this binary with
//! `plugin-hook <the file>`), agent-level hooks (links named `environment`, `command`,
//! `pre-exit` in the agent's hooks-path), both dispatched by [`subcommand_for_argv0`] and
//! exporting through the Job API, and callers that evaluate `environment --export shell`
//! (the local executor).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use kernelkite_topology::cpulist::format_cpu_list;

use crate::gpucheck::{GpuCheckError, GpuControl, Nvml};
use crate::job::{self, Settings};

/// Hook names the binary answers to when linked under that name.
pub const HOOK_NAMES: &[&str] = &["environment", "command", "pre-exit"];

/// The subcommand the plugin's hook files name on their first line.
pub const PLUGIN_HOOK: &str = "plugin-hook";

/// The first line of each of the plugin's `hooks/*` files: where `setup` installs the binary
/// (its default prefix), and [`PLUGIN_HOOK`]. Not a shell, so the agent executes the file
/// rather than sourcing it in its wrapper.
pub const PLUGIN_HOOK_SHEBANG: &str = "#!/opt/kernelkite/bin/kernelkite-isolate plugin-hook";

/// The binary [`PLUGIN_HOOK_SHEBANG`] names: where the plugin's hook files need it.
pub fn plugin_hook_binary() -> &'static str {
    PLUGIN_HOOK_SHEBANG
        .strip_prefix("#!")
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_default()
}

/// The hook subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum HookCommand {
    /// The `environment` hook: clean up after lost jobs, lease the job's GPU(s), check them,
    /// create the job's cgroup and export the slice (CUDA_VISIBLE_DEVICES, KERNELBOT_*, ...).
    Environment(EnvironmentArgs),
    /// The `command` hook: run $BUILDKITE_COMMAND in the job's cgroup (host mode) or in a
    /// container holding only the job's GPU(s), CPUs and memory (docker mode).
    Command(NodeArgs),
    /// The `pre-exit` hook: kill what the job left running, remove its cgroup, reset clocks,
    /// release its lease(s). Idempotent.
    PreExit(NodeArgs),
    /// Run the plugin hook file PATH: the hook it is named after (`environment`, `command` or
    /// `pre-exit`), exporting through the Job API. The plugin's `hooks/*` files name this on
    /// their first line, so the agent executes them and the kernel runs this.
    PluginHook(PluginHookArgs),
}

/// Arguments of `plugin-hook`.
#[derive(Debug, Clone, clap::Args)]
pub struct PluginHookArgs {
    /// The hook file the kernel ran this for (`.../hooks/environment`).
    pub path: PathBuf,
}

/// Where things are on the node.
#[derive(Debug, Clone, clap::Args)]
pub struct NodeArgs {
    /// Directory for GPU leases and job state, shared by every agent on the node.
    #[arg(long, env = "KERNELKITE_RUN_DIR", default_value = kernelkite_sys::node::RUN_DIR)]
    pub run_dir: PathBuf,
    /// Plan written by node set-up (`kernelkite-isolate plan --json`); without it every job
    /// plans the node from sysfs.
    #[arg(long, env = "KERNELKITE_PLAN_FILE")]
    pub plan_file: Option<PathBuf>,
    /// Root of the sysfs/procfs tree to plan from (a fake tree in tests).
    #[arg(long, env = "KERNELKITE_SYSFS_ROOT", default_value = "/")]
    pub sysfs_root: PathBuf,
    /// Root holding `proc/self/mountinfo` and the cgroup mounts (a fake tree in tests).
    #[arg(long, env = "KERNELKITE_CGROUP_ROOT", default_value = "/")]
    pub cgroup_root: PathBuf,
    /// procfs used to tell whether a lease holder is still alive.
    #[arg(long, env = "KERNELKITE_PROC_ROOT", default_value = "/proc")]
    pub proc_root: PathBuf,
    /// The docker CLI (docker mode).
    #[arg(long, env = "KERNELKITE_DOCKER", default_value = "docker")]
    pub docker: PathBuf,
    /// Process that lives as long as the job; default: the agent's bootstrap process found
    /// among the hook's ancestors, else the hook's parent.
    #[arg(long, env = "KERNELKITE_JOB_PID")]
    pub job_pid: Option<u32>,
    /// Host mode runs the step's command in the sandbox: as the job user (plugin option
    /// `user`), without capabilities, in private mount and IPC namespaces (needs root). `off`
    /// runs it as the agent's user with the agent's view of the machine (a warning says so).
    #[arg(long, env = "KERNELKITE_SANDBOX", value_enum, default_value = "on")]
    pub sandbox: OnOff,
    /// Directory holding the GPU device nodes the sandbox binds into the job's `/dev`.
    #[arg(long, env = "KERNELKITE_DEV_ROOT", default_value = "/dev")]
    pub dev_root: PathBuf,
    /// Further paths the sandbox hides from the job (`:`-separated; directories get an empty
    /// read-only tmpfs, files `/dev/null`).
    #[arg(long, env = "KERNELKITE_HIDE", value_delimiter = ':')]
    pub hide: Vec<PathBuf>,
}

/// A node switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnOff {
    /// Enabled.
    On,
    /// Disabled.
    Off,
}

impl NodeArgs {
    fn settings(&self) -> Settings {
        Settings {
            run_dir: self.run_dir.clone(),
            sysfs_root: self.sysfs_root.clone(),
            plan_file: self.plan_file.clone().filter(|p| !p.as_os_str().is_empty()),
            cgroup_root: self.cgroup_root.clone(),
            proc_root: self.proc_root.clone(),
            docker: self.docker.clone(),
            job_pid: self.job_pid,
            sandbox: self.sandbox == OnOff::On,
            dev_root: self.dev_root.clone(),
            hide: self
                .hide
                .iter()
                .filter(|p| !p.as_os_str().is_empty())
                .cloned()
                .collect(),
        }
    }
}

/// How `environment` hands the variables to the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportVia {
    /// Job API when BUILDKITE_AGENT_JOB_API_SOCKET is set, else shell.
    Auto,
    /// Print `export K='V'` lines on stdout for a sourced hook to evaluate.
    Shell,
    /// PATCH the job's environment through the agent's Job API.
    JobApi,
}

/// Arguments of `environment`.
#[derive(Debug, Clone, clap::Args)]
pub struct EnvironmentArgs {
    /// Where things are on the node.
    #[command(flatten)]
    pub node: NodeArgs,
    /// How to export the job's variables.
    #[arg(long, value_enum, default_value = "auto")]
    pub export: ExportVia,
}

/// The hook a path names by its file name, if it is one of [`HOOK_NAMES`].
fn hook_named(path: &std::ffi::OsStr) -> Option<String> {
    std::path::Path::new(path)
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| HOOK_NAMES.contains(n))
        .map(str::to_string)
}

/// When the binary is invoked as a hook, rewrite argv so clap sees the matching subcommand:
/// through a link named after the hook (agent-level hooks), or by the kernel for one of the
/// plugin's hook files (`plugin-hook .../hooks/<name>`, see [`PLUGIN_HOOK_SHEBANG`]). Either
/// way the hook is executed, not sourced, so `environment` exports through the Job API.
pub fn subcommand_for_argv0(mut args: Vec<OsString>) -> Vec<OsString> {
    if args.get(1).is_some_and(|a| a == PLUGIN_HOOK) {
        if let Some(name) = args.get(2).and_then(|p| hook_named(p)) {
            // The hook file's path stands where a link's would: argv[0].
            args.drain(0..2);
            args[0] = OsString::from(name);
        }
    }
    let name = args.first().and_then(|a| hook_named(a));
    if let Some(name) = name {
        args[0] = OsString::from("kernelkite-isolate");
        // An executed hook cannot export: its variables must go through the Job API.
        if name == "environment" {
            args.splice(
                1..1,
                ["environment", "--export", "job-api"].map(OsString::from),
            );
        } else {
            args.insert(1, OsString::from(name));
        }
    }
    args
}

fn open_nvml() -> Result<Box<dyn GpuControl>, GpuCheckError> {
    Nvml::load().map(|n| Box::new(n) as Box<dyn GpuControl>)
}

/// The hook's environment; variables that are not UTF-8 are not the agent's and are left out.
fn job_env() -> BTreeMap<String, String> {
    std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect()
}

/// Runs a hook subcommand: its lines for the job log on stderr, `export` lines (sourced shell
/// hook) or the `pre-exit` report on stdout. `argv` are the arguments after the program name,
/// for the static build to hand the hook over with ([`crate::delegate`]).
pub fn run(cmd: HookCommand, argv: &[OsString]) -> anyhow::Result<ExitCode> {
    let env = job_env();
    match cmd {
        HookCommand::Environment(args) => {
            if let Some(why) = job::env::left_to_the_plugin(&env) {
                crate::joblog::say(why);
                return Ok(ExitCode::SUCCESS);
            }
            let settings = args.node.settings();
            crate::delegate::hand_over_if_needed(&settings, &env, argv)?;
            let prepared = job::environment::run(&settings, &env, &mut open_nvml)?;
            let s = &prepared.state;
            let mut lines = prepared.notices.clone();
            lines.push(format!(
                "job {} holds GPU(s) {:?}: CPUs {}, memory nodes {}, {} bytes{}",
                s.job_id,
                s.gpus,
                format_cpu_list(&s.slice.cpus),
                format_cpu_list(&s.slice.mems),
                s.slice.memory_bytes,
                match s.cgroup_version {
                    Some(v) => format!(", cgroup v{v}"),
                    None => String::new(),
                }
            ));
            if let Some(u) = &s.job_user {
                lines.push(format!(
                    "the command will run as {} (uid {}, gid {}){}",
                    u.name,
                    u.uid,
                    u.gid,
                    match s.config.mode {
                        crate::config::Mode::Host => " in the sandbox",
                        crate::config::Mode::Docker => " in its container",
                    }
                ));
            }
            crate::joblog::say_all(&lines);
            let via = match args.export {
                ExportVia::Auto if job::env::job_api_socket(&env).is_some() => ExportVia::JobApi,
                ExportVia::Auto => ExportVia::Shell,
                other => other,
            };
            match via {
                ExportVia::JobApi => {
                    job::environment::export_through_job_api(&settings, s, &env, &mut open_nvml)?
                }
                _ => print!("{}", job::exports::export_lines(&s.exports)),
            }
            Ok(ExitCode::SUCCESS)
        }
        HookCommand::Command(args) => {
            let outcome =
                job::command::run(&args.settings(), &env, &mut |line| crate::joblog::say(line))?;
            crate::joblog::say_all(&outcome.notices);
            Ok(ExitCode::from(outcome.exit_code.clamp(0, 255) as u8))
        }
        HookCommand::PluginHook(args) => anyhow::bail!(
            "{} is not one of the plugin's hooks ({}): `{PLUGIN_HOOK}` runs the hook its file is named after",
            args.path.display(),
            HOOK_NAMES.join(", ")
        ),
        HookCommand::PreExit(args) => {
            if let Some(why) = job::env::left_to_the_plugin(&env) {
                println!("kernelkite: {why}");
                return Ok(ExitCode::SUCCESS);
            }
            let settings = args.settings();
            crate::delegate::hand_over_if_needed(&settings, &env, argv)?;
            let report = job::pre_exit::run(&settings, &env, &mut open_nvml)?;
            println!("kernelkite: {}", report.summary());
            if report.problems.is_empty() {
                Ok(ExitCode::SUCCESS)
            } else {
                Ok(ExitCode::FAILURE)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hook_links_dispatch_on_their_name() {
        let args: Vec<OsString> = vec!["/etc/buildkite-agent/hooks/pre-exit".into()];
        assert_eq!(
            subcommand_for_argv0(args),
            vec![
                OsString::from("kernelkite-isolate"),
                OsString::from("pre-exit")
            ]
        );
        let args: Vec<OsString> = vec!["environment".into()];
        assert_eq!(
            subcommand_for_argv0(args),
            ["kernelkite-isolate", "environment", "--export", "job-api"].map(OsString::from)
        );
        let args: Vec<OsString> = vec!["kernelkite-isolate".into(), "plan".into()];
        assert_eq!(subcommand_for_argv0(args.clone()), args);
    }

    #[test]
    fn plugin_hook_files_dispatch_on_their_file_name() {
        // What the kernel makes of `#!/opt/kernelkite/bin/kernelkite-isolate plugin-hook`.
        let argv = |hook: &str| -> Vec<OsString> {
            vec![
                "/opt/kernelkite/bin/kernelkite-isolate".into(),
                PLUGIN_HOOK.into(),
                format!("/var/lib/buildkite-agent/plugins/github-com-kernelkite-kernelkite-plugin-v1-0-0/plugin/hooks/{hook}").into(),
            ]
        };
        assert_eq!(
            subcommand_for_argv0(argv("environment")),
            ["kernelkite-isolate", "environment", "--export", "job-api"].map(OsString::from)
        );
        assert_eq!(
            subcommand_for_argv0(argv("command")),
            ["kernelkite-isolate", "command"].map(OsString::from)
        );
        assert_eq!(
            subcommand_for_argv0(argv("pre-exit")),
            ["kernelkite-isolate", "pre-exit"].map(OsString::from)
        );
        // Any other file is left for clap and `run` to refuse by name.
        assert_eq!(
            subcommand_for_argv0(argv("post-command")),
            argv("post-command")
        );
        assert_eq!(
            PLUGIN_HOOK_SHEBANG,
            format!("#!{} {PLUGIN_HOOK}", plugin_hook_binary())
        );
        assert_eq!(
            plugin_hook_binary(),
            format!(
                "{}/bin/kernelkite-isolate",
                crate::setup::paths::DEFAULT_PREFIX
            )
        );
    }
}
