//! Hook subcommands: `environment`, `command`, `pre-exit`: the command-line edge of
//! [`crate::job`], which does the work (undoing what fails included).
//!
//! The same binary serves the plugin's hooks (files whose first line is
//! [`kernelkite_sys::node::PLUGIN_HOOK_SHEBANG`]: the agent executes them, and the kernel runs this binary with
//! `plugin-hook <the file>`), agent-level hooks (links named `environment`, `command`,
//! `pre-exit` in the agent's hooks-path), both dispatched by [`subcommand_for_argv0`], whose
//! `environment` leaves the job's variables in its state for kernelkite's `command` (and the
//! Job API on request), and callers that evaluate `environment --export shell` (the local
//! executor).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use kernelkite_topology::cpulist::format_cpu_list;

use crate::gpucheck::{GpuCheckError, GpuControl, Nvml};
use crate::job::{self, Settings};

use kernelkite_sys::node::{HOOK_NAMES, PLUGIN_HOOK};

/// The hook subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum HookCommand {
    /// The `environment` hook: clean up after lost jobs, lease the job's GPU(s), check them,
    /// create the job's cgroup and export the slice (CUDA_VISIBLE_DEVICES, KERNELBOT_*, ...).
    Environment(EnvironmentArgs),
    /// The `command` hook: run $BUILDKITE_COMMAND in the job's cgroup (host mode) or in a
    /// container holding only the job's GPU(s), CPUs and memory (docker mode).
    Command(Settings),
    /// The `pre-exit` hook: kill what the job left running, remove its cgroup, reset clocks,
    /// release its lease(s). Idempotent.
    PreExit(Settings),
    /// Run the plugin hook file PATH: the hook it is named after (`environment`, `command` or
    /// `pre-exit`), as `--export state`. The plugin's `hooks/*` files name this on
    /// their first line, so the agent executes them and the kernel runs this.
    PluginHook(PluginHookArgs),
    /// The agent's `pre-bootstrap` hook: refuse a job whose variables steer the root
    /// bootstrap or the hooks (a checkout path, the artifact upload's destination, patterns
    /// outside the checkout), or whose signed step was signed for another build or queue
    /// ([`crate::admission`]). Setup installs it as a file whose first line names this.
    PreBootstrap(PreBootstrapArgs),
}

/// Arguments of `pre-bootstrap`.
#[derive(Debug, Clone, clap::Args)]
pub struct PreBootstrapArgs {
    /// The hook file the kernel ran this for (its first line names this subcommand).
    pub path: Option<PathBuf>,
    /// The job's variables as the agent wrote them for this hook (a JSON object).
    #[arg(long, env = "BUILDKITE_ENV_JSON_FILE")]
    pub env_json_file: PathBuf,
    /// `on` (setup writes it where the agents verify signatures): refuse a job whose step
    /// carries no binding to its build and queue.
    #[arg(long, env = crate::admission::SIGNED_STEPS_SETTING, default_value = "off", value_parser = ["on", "off"])]
    pub signed_steps: String,
}

/// Arguments of `plugin-hook`.
#[derive(Debug, Clone, clap::Args)]
pub struct PluginHookArgs {
    /// The hook file the kernel ran this for (`.../hooks/environment`).
    pub path: PathBuf,
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
    /// Keep them in the job's state only, where kernelkite's `command` reads them for the
    /// command; through the Job API as well when the step sets `export-to-agent` (what the
    /// executed hooks do: the agent's answer costs a job 4-5 ms, for hooks that are not
    /// kernelkite's).
    State,
}

/// Arguments of `environment`.
#[derive(Debug, Clone, clap::Args)]
pub struct EnvironmentArgs {
    /// Where things are on the node.
    #[command(flatten)]
    pub node: Settings,
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
/// plugin's hook files (`plugin-hook .../hooks/<name>`, see [`kernelkite_sys::node::PLUGIN_HOOK_SHEBANG`]). Either
/// way the hook is executed, not sourced, so `environment` cannot print `export` lines: it
/// runs as `--export state`.
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
        // An executed hook cannot print `export` lines; kernelkite's `command` reads the
        // variables from the job's state.
        if name == "environment" {
            args.splice(
                1..1,
                ["environment", "--export", "state"].map(OsString::from),
            );
        } else {
            args.insert(1, OsString::from(name));
        }
    }
    args
}

/// Runs `pre-bootstrap`: silent when the job may start; else one line per reason on stdout
/// (the agent's log; the job's log says the hook refused it) and a failure. A file that cannot
/// be read refuses the job: this hook is the only look at its variables before the bootstrap.
fn pre_bootstrap(args: &PreBootstrapArgs) -> ExitCode {
    let read = std::fs::read_to_string(&args.env_json_file)
        .map_err(|e| e.to_string())
        .and_then(|t| {
            serde_json::from_str::<BTreeMap<String, String>>(&t).map_err(|e| e.to_string())
        });
    let reasons = match read {
        Ok(env) => crate::admission::refusals(&env, args.signed_steps == "on"),
        Err(e) => vec![format!(
            "cannot read the job's variables from {} ({e}); BUILDKITE_ENV_JSON_FILE is the agent's (3.27 and later)",
            args.env_json_file.display()
        )],
    };
    for r in &reasons {
        println!("kernelkite: job refused: {r}");
    }
    if reasons.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
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
            let settings = args.node.clone().without_empty();
            crate::delegate::hand_over_if_needed(&settings, &env, argv)?;
            let prepared = match job::environment::run(&settings, &env, &mut open_nvml) {
                Ok(p) => p,
                Err(
                    e @ (job::JobError::OutdatedRunner { .. } | job::JobError::RunnerVersion { .. }),
                ) => return Ok(refuse_outdated(&env, &e)),
                Err(e) => return Err(e.into()),
            };
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
                ExportVia::State if s.config.export_to_agent => ExportVia::JobApi,
                other => other,
            };
            match via {
                ExportVia::JobApi => {
                    job::environment::export_through_job_api(&settings, s, &env, &mut open_nvml)?
                }
                ExportVia::State => {}
                ExportVia::Shell | ExportVia::Auto => {
                    print!("{}", job::exports::export_lines(&s.exports))
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        HookCommand::Command(args) => {
            let outcome =
                job::command::run(&args.clone().without_empty(), &env, &mut |line| crate::joblog::say(line))?;
            crate::joblog::say_all(&outcome.notices);
            Ok(ExitCode::from(outcome.exit_code.clamp(0, 255) as u8))
        }
        HookCommand::PluginHook(args) => anyhow::bail!(
            "{} is not one of the plugin's hooks ({}): `{PLUGIN_HOOK}` runs the hook its file is named after",
            args.path.display(),
            HOOK_NAMES.join(", ")
        ),
        HookCommand::PreBootstrap(args) => Ok(pre_bootstrap(&args)),
        HookCommand::PreExit(args) => {
            if let Some(why) = job::env::left_to_the_plugin(&env) {
                println!("kernelkite: {why}");
                return Ok(ExitCode::SUCCESS);
            }
            let settings = args.clone().without_empty();
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

/// A job on a node whose runner is not the one it expects (or cannot say which it is): says
/// why and ends the hook with the status the pipelines retry elsewhere. An older or broken
/// runner also pauses the agent, so the retry does not land here again; a newer one does not
/// (the expectation will follow it).
fn refuse_outdated(env: &BTreeMap<String, String>, e: &job::JobError) -> ExitCode {
    crate::joblog::say(&format!("{e}"));
    let note = match e {
        job::JobError::OutdatedRunner { here, expected }
            if job::version::is_older(here, expected) =>
        {
            Some(job::version::pause_note(here, expected))
        }
        job::JobError::RunnerVersion { .. } => Some(format!("kernelkite: {e}")),
        _ => None,
    };
    match note {
        Some(note) => crate::joblog::say(&job::version::pause_agent(env, &note)),
        None => crate::joblog::say(
            "this agent stays unpaused: its runner is newer than the job expects",
        ),
    }
    ExitCode::from(kernelkite_sys::node::EXIT_NODE_FAULT)
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
            ["kernelkite-isolate", "environment", "--export", "state"].map(OsString::from)
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
            ["kernelkite-isolate", "environment", "--export", "state"].map(OsString::from)
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
    }
}
