//! `kernelkite-isolate setup` and `kernelkite-isolate smoke`: the command-line edge of
//! [`crate::setup`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use kernelkite_topology::plan::Plan;
use kernelkite_topology::planner::{multi_gpu_groups, plan_explained, Policy};
use kernelkite_topology::topology::Topology;

use super::plan::PolicyArgs;
use crate::doctor::{exit_code, run_checks, DoctorOptions, LiveHost};
use crate::setup::apply::{self, Flags, Recorder, Runner};
use crate::setup::manifest::Manifest;
use crate::setup::paths::*;
use crate::setup::render::{self, AgentLayout, MultiGpu, Options};
use crate::setup::report::{self, StepNames};
use crate::setup::smoke::{self, SmokeOptions};
use crate::setup::{facts, under, SetupError};
use kernelkite_hooks::config::{parse_config, Mode};

const SETUP_AFTER_HELP: &str = "\
WHAT IT DOES (see deployment/README.md, \"Vendor path\"):
  installs kernelkite-isolate and kernelkite-runner to <prefix>/bin; writes the plan to
  /etc/kernelkite/plan.json; creates the job user kernelkite-job (system user, no login, no
  home; on AMD nodes a member of the groups owning /dev/kfd and the render nodes); writes one
  Buildkite agent configuration per slice (or one pool agent, --agents pool) holding the token
  (root-only, 0600) and the systemd units: kernelkite.slice (the agents on the housekeeping
  CPUs, within the host's memory reserve), kernelkite-agent@.service, and on cgroup v1 a mount
  that makes cgroup migrations fast (favordynmods); links the agent-level hooks
  /etc/kernelkite/hooks/{environment,command,pre-exit} to the binary; then runs `doctor` and a
  smoke job through the installed hooks, and starts the agents.

  The agents run nothing but those hooks: their configuration refuses the repository's
  .buildkite/hooks, every plugin but kernelkite's (--plugin-location, at a version tag), every
  repository but the plugin's, and job variables but Buildkite's and kernelbot's
  (--allow-job-env adds more); the agent itself evaluates no command (no-command-eval).

  Idempotent: a second run changes nothing. What it wrote is listed in
  /var/lib/kernelkite/setup-manifest.json, and --uninstall removes exactly that.

EXAMPLES:
  sudo ./kernelkite-isolate setup --from . --queue h100 --agent-token-file /root/agent-token --dry-run
  sudo ./kernelkite-isolate setup --from . --queue h100 --agent-token-file /root/agent-token
  sudo kernelkite-isolate setup --uninstall";

/// Arguments of `setup`.
#[derive(Debug, clap::Args)]
#[command(after_help = SETUP_AFTER_HELP)]
pub struct SetupArgs {
    /// The Buildkite queue this node serves (the backend's `queue`, e.g. h100).
    #[arg(
        long,
        env = "KERNELKITE_QUEUE",
        value_name = "NAME",
        required_unless_present = "uninstall"
    )]
    pub queue: Option<String>,
    /// The node's name in agent names and the `node` tag (default: the host name).
    #[arg(long, env = "KERNELKITE_NODE", value_name = "NAME")]
    pub node: Option<String>,
    /// One agent per slice (tag gpu-index=N), or one agent whose `spawn` workers lease from the
    /// node-wide pool.
    #[arg(long, value_enum, default_value = "per-slice")]
    pub agents: AgentLayout,
    /// Also serve this queue with jobs of several GPUs (kernelbot's multi-GPU tasks): one
    /// agent per group of --multi-gpu-size slices (GPUs of a NUMA node that share NVLink or
    /// xGMI), tagged gpu-index with the group, beside the one-GPU queue's agents on the same
    /// GPUs. GPUs go to jobs of either queue first come, first served.
    #[arg(long, env = "KERNELKITE_MULTI_GPU_QUEUE", value_name = "NAME")]
    pub multi_gpu_queue: Option<String>,
    /// GPUs per job of --multi-gpu-queue (default: every GPU of the node).
    #[arg(long, value_name = "N", requires = "multi_gpu_queue")]
    pub multi_gpu_size: Option<u32>,
    /// File holding the agent token (from the cluster's Agent Tokens page); else the
    /// BUILDKITE_AGENT_TOKEN environment variable, else the token an earlier run wrote.
    #[arg(long, value_name = "FILE")]
    pub agent_token_file: Option<PathBuf>,
    /// Directory holding the kernelkite-isolate and kernelkite-runner binaries to install
    /// (default: the directory of this binary).
    #[arg(long, value_name = "DIR")]
    pub from: Option<PathBuf>,
    /// Where the binaries go (PREFIX/bin).
    #[arg(long, value_name = "DIR", default_value = DEFAULT_PREFIX)]
    pub prefix: PathBuf,
    /// The buildkite-agent binary the units start (default: /usr/bin/buildkite-agent, or
    /// /usr/local/bin/buildkite-agent when only that exists).
    #[arg(long, value_name = "PATH")]
    pub buildkite_agent: Option<PathBuf>,
    /// Configuration of the agent-level hooks (the plugin's keys, as JSON), for jobs whose step
    /// does not use the plugin; a step that does overrides it.
    #[arg(
        long,
        value_name = "JSON",
        default_value = r#"{"mode":"host","network":false}"#
    )]
    pub job_config: String,
    /// Where pipelines take the kernelkite plugin from, as their steps name it without the
    /// version: the only plugin the agents run (at a version tag, LOCATION#vN...), and its
    /// github.com/ORG/REPO the only repository they check out.
    #[arg(
        long,
        env = "KERNELKITE_PLUGIN_LOCATION",
        value_name = "LOCATION",
        default_value = render::DEFAULT_PLUGIN_LOCATION
    )]
    pub plugin_location: String,
    /// Accept jobs carrying this environment variable (NAME, or PREFIX*; repeatable), besides
    /// Buildkite's own and kernelbot's (KERNELBOT_*, KERNELKITE_SUBMISSION_ID); a job carrying
    /// any other is refused, since its variables reach the root checkout and hooks.
    #[arg(long = "allow-job-env", value_name = "NAME")]
    pub allow_job_env: Vec<String>,
    /// The public JWKS of the key the service's pipeline agent signs its uploads with
    /// (Buildkite's signed pipelines; `buildkite-agent tool keygen` makes the pair): the agents
    /// then refuse any job whose step it did not sign. Without it, every step uploaded for the
    /// queue with a token of the agents' cluster runs here.
    #[arg(long, env = "KERNELKITE_VERIFICATION_JWKS", value_name = "FILE")]
    pub verification_jwks: Option<PathBuf>,
    /// Write everything under DIR instead of / and only record the commands (for trying setup
    /// out, and for tests).
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// Root of the sysfs/procfs/dev tree to plan from and check (a fake tree in tests).
    #[arg(
        long,
        env = "KERNELKITE_SYSFS_ROOT",
        default_value = "/",
        value_name = "DIR"
    )]
    pub sysfs_root: PathBuf,
    /// Print every directory, file (with its contents) and command, and change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Remove what setup wrote (from its manifest): stop and disable the units, delete the
    /// files, put back files --replace moved aside, remove the job user if setup created it.
    #[arg(long, conflicts_with_all = ["queue", "agent_token_file", "replace", "no_start"])]
    pub uninstall: bool,
    /// Overwrite files setup did not write (each is kept as NAME.kernelkite-orig).
    #[arg(long)]
    pub replace: bool,
    /// Write everything and run the checks, but do not enable or start the agents.
    #[arg(long)]
    pub no_start: bool,
    /// How to slice the node.
    #[command(flatten)]
    pub policy: PolicyArgs,
}

/// Arguments of `smoke`.
#[derive(Debug, clap::Args)]
pub struct SmokeArgs {
    /// The agent's hooks-path, holding environment, command and pre-exit.
    #[arg(long, value_name = "DIR", default_value = HOOKS_DIR)]
    pub hooks_dir: PathBuf,
    /// The agents' environment file (KERNELKITE_PLAN_FILE, KERNELKITE_CONFIG, PATH, ...).
    #[arg(long, value_name = "FILE", default_value = AGENT_ENV)]
    pub env_file: PathBuf,
    /// Set a variable for the hooks on top of the environment file (repeatable), e.g.
    /// KERNELKITE_SYSFS_ROOT=/tmp/dgx to try a fake tree.
    #[arg(long = "set", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub set: Vec<(String, String)>,
    /// The runner command each smoke job tries with --example (found on the job's PATH).
    #[arg(long, value_name = "CMD", default_value = "kernelkite-runner")]
    pub runner: String,
    /// Do not try the runner.
    #[arg(long)]
    pub no_runner: bool,
    /// Only this slice (repeatable); default every slice of the plan.
    #[arg(long = "slice", value_name = "N")]
    pub slices: Vec<u32>,
    /// Used in the smoke agent's name (default: the host name).
    #[arg(long, value_name = "NAME")]
    pub node: Option<String>,
}

fn parse_key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

/// The host name: `<root>/etc/hostname`, else the running kernel's.
fn hostname(root: &Path) -> String {
    std::fs::read_to_string(under(root, Path::new("/etc/hostname")))
        .ok()
        .and_then(|s| s.lines().next().map(|l| l.trim().to_string()))
        .filter(|s| !s.is_empty())
        .unwrap_or_else(kernelkite_sys::host::name)
}

/// The token: the file, else BUILDKITE_AGENT_TOKEN, else what an earlier run wrote.
fn agent_token(
    args: &SetupArgs,
    root: &Path,
    previous: Option<&Manifest>,
) -> anyhow::Result<Option<String>> {
    if let Some(f) = &args.agent_token_file {
        let t = std::fs::read_to_string(f)
            .with_context(|| format!("cannot read the agent token from {}", f.display()))?;
        return Ok(Some(t.trim().to_string()));
    }
    if let Some(t) = std::env::var("BUILDKITE_AGENT_TOKEN")
        .ok()
        .filter(|t| !t.trim().is_empty())
    {
        return Ok(Some(t.trim().to_string()));
    }
    for e in previous.iter().flat_map(|m| m.files.iter()) {
        if e.path().parent() != Some(Path::new(AGENTS_DIR)) {
            continue;
        }
        let text = std::fs::read_to_string(under(root, e.path())).unwrap_or_default();
        for line in text.lines() {
            if let Some(t) = line
                .strip_prefix("token=\"")
                .and_then(|l| l.strip_suffix('"'))
            {
                return Ok(Some(t.to_string()));
            }
        }
    }
    Ok(None)
}

fn step_names(prefix: &Path, job_config: &str) -> StepNames {
    let bin = prefix.join("bin/kernelkite-isolate");
    let docker = parse_config(job_config).is_ok_and(|c| c.mode == Mode::Docker);
    StepNames {
        doctor: format!(
            "{} doctor{}",
            bin.display(),
            if docker { " --docker" } else { "" }
        ),
        smoke: format!("{} smoke", bin.display()),
    }
}

/// Runs commands, `doctor` and the smoke job on the live machine.
struct Live<'a> {
    root: &'a Path,
    sysfs_root: &'a Path,
    node: String,
    docker: bool,
}

impl Runner for Live<'_> {
    fn run(&mut self, argv: &[String]) -> Result<(), SetupError> {
        let line = report::command_line(argv);
        sayln!("+ {line}");
        let status = std::process::Command::new(&argv[0])
            .args(&argv[1..])
            .status()
            .map_err(|e| SetupError::Command {
                command: line.clone(),
                reason: e.to_string(),
            })?;
        if status.success() {
            Ok(())
        } else {
            Err(SetupError::Command {
                command: line,
                reason: format!("{status}; fix what it says and run setup again (what was written so far is kept)"),
            })
        }
    }

    fn doctor(&mut self) -> Result<(), SetupError> {
        sayln!("+ kernelkite-isolate doctor");
        let checks = run_checks(
            &DoctorOptions {
                root: self.sysfs_root.to_path_buf(),
                docker: self.docker,
            },
            &LiveHost::default(),
        );
        for c in &checks {
            sayln!("{c}");
        }
        if exit_code(&checks) == 0 {
            Ok(())
        } else {
            Err(SetupError::Command {
                command: "kernelkite-isolate doctor".into(),
                reason: "a check failed (the fail lines above): fix it and run setup again; the files are written, the agents were not started".into(),
            })
        }
    }

    fn smoke(&mut self) -> Result<(), SetupError> {
        sayln!("+ kernelkite-isolate smoke");
        let env_path = under(self.root, Path::new(AGENT_ENV));
        let text = std::fs::read_to_string(&env_path).map_err(|e| SetupError::io(&env_path, e))?;
        let env = smoke::parse_env_file(&text)
            .map_err(|e| SetupError::Invalid(format!("{}: {e}", env_path.display())))?;
        let reports = smoke::run(&SmokeOptions {
            hooks_dir: under(self.root, Path::new(HOOKS_DIR)),
            env,
            node: self.node.clone(),
            runner: Some("kernelkite-runner".into()),
            slices: None,
        })?;
        for r in &reports {
            say!("{}", r.text());
        }
        if reports.iter().all(|r| r.ok()) {
            Ok(())
        } else {
            Err(SetupError::Command {
                command: "kernelkite-isolate smoke".into(),
                reason: "a smoke job failed (the fail lines above): fix it and run setup again; the files are written, the agents were not started".into(),
            })
        }
    }
}

/// The oldest systemd whose units setup's work: `LoadCredential=` with the `%d` specifier.
pub const MIN_SYSTEMD: u32 = 248;

/// `systemd 252 (252.38-1~deb12u1)` (the first line of `systemctl --version`) → 252.
pub fn parse_systemd_version(text: &str) -> Option<u32> {
    let mut words = text.lines().next()?.split_whitespace();
    (words.next()? == "systemd").then_some(())?;
    words.next()?.parse().ok()
}

/// What stops setup on this machine's systemd, if anything.
fn systemd_problem() -> Option<String> {
    let out = std::process::Command::new("systemctl")
        .arg("--version")
        .output();
    match out.ok().and_then(|o| parse_systemd_version(&String::from_utf8_lossy(&o.stdout))) {
        Some(v) if v >= MIN_SYSTEMD => None,
        Some(v) => Some(format!("this node's systemd is {v}; the agents' units need systemd {MIN_SYSTEMD} or later (LoadCredential= with %d keeps the token out of the environment): upgrade the distribution")),
        None => Some("systemctl is not available: the agents run as systemd services, so setup needs a node booted with systemd".into()),
    }
}

fn read_manifest(root: &Path) -> anyhow::Result<Option<Manifest>> {
    Ok(Manifest::read(&under(root, Path::new(MANIFEST)))?)
}

/// The multi-GPU queue's groups, when `--multi-gpu-queue` asks for one.
fn multi_gpu(
    args: &SetupArgs,
    topo: &Topology,
    policy: &Policy,
    plan: &Plan,
) -> anyhow::Result<Option<MultiGpu>> {
    let Some(queue) = &args.multi_gpu_queue else {
        return Ok(None);
    };
    // Whole GPUs: a MIG device is never part of a group.
    let gpus = plan
        .slices
        .iter()
        .filter(|s| s.gpu.as_ref().is_some_and(|g| g.mig.is_none()))
        .count() as u32;
    let size = args.multi_gpu_size.unwrap_or(gpus);
    let groups = multi_gpu_groups(topo, policy, plan, size)
        .context("cannot group the node's GPUs for --multi-gpu-queue")?;
    Ok(Some(MultiGpu {
        queue: queue.clone(),
        groups,
    }))
}

/// The directory the binaries are installed from (`--from`, else this binary's), which must
/// hold every one of them.
fn binaries_dir(args: &SetupArgs) -> anyhow::Result<PathBuf> {
    let from = match &args.from {
        Some(d) => d.clone(),
        None => std::env::current_exe()
            .context("cannot find this binary's directory; pass --from DIR")?
            .parent()
            .map(Path::to_path_buf)
            .context("cannot find this binary's directory; pass --from DIR")?,
    };
    for b in BINARIES {
        if !from.join(b).is_file() {
            anyhow::bail!(
                "{b} is not in {}: pass --from DIR naming the directory that holds kernelkite-isolate and kernelkite-runner (an unpacked release, or target/release of `cargo build --release -p kernelkite-isolate -p kernelkite-runner`)",
                from.display()
            );
        }
    }
    Ok(from)
}

/// The agent binary the units run: `--buildkite-agent`, else the first installed of the usual
/// places, else the default.
fn buildkite_agent(args: &SetupArgs, root: &Path) -> PathBuf {
    args.buildkite_agent.clone().unwrap_or_else(|| {
        ["/usr/bin/buildkite-agent", "/usr/local/bin/buildkite-agent"]
            .iter()
            .map(PathBuf::from)
            .find(|p| under(root, p).is_file())
            .unwrap_or_else(|| PathBuf::from(DEFAULT_BUILDKITE_AGENT))
    })
}

/// Carries the actions out: on the live node (`/`), running its commands; under `--root`,
/// only recording them.
fn execute(
    args: &SetupArgs,
    root: &Path,
    opts: &Options,
    actions: &apply::Actions,
    previous: Option<&Manifest>,
) -> anyhow::Result<apply::Leftovers> {
    let leftovers = if args.root.is_none() {
        let mut runner = Live {
            root,
            sysfs_root: &args.sysfs_root,
            node: opts.node.clone(),
            docker: parse_config(&opts.job_config).is_ok_and(|c| c.mode == Mode::Docker),
        };
        sayln!();
        apply::execute(root, actions, previous, &mut runner)?
    } else {
        apply::execute(root, actions, previous, &mut Recorder::default())?
    };
    Ok(leftovers)
}

/// `setup`.
// Long because a linear script (plan, render, observe, decide, report, execute) read in order.
pub fn run_setup(args: SetupArgs) -> anyhow::Result<ExitCode> {
    let live = args.root.is_none();
    let root = args.root.clone().unwrap_or_else(|| PathBuf::from("/"));
    if live && !args.dry_run && !rustix::process::geteuid().is_root() {
        anyhow::bail!("setup writes /etc, /opt and systemd units and creates a user: run it as root (sudo), or see what it would do with --dry-run");
    }
    let previous = read_manifest(&root)?;
    if args.uninstall {
        return uninstall(&args, &root, previous.as_ref());
    }

    let topo = Topology::discover(&args.sysfs_root)?;
    let policy = args.policy.to_policy();
    let plan = plan_explained(&topo, &policy)?.plan;
    let multi_gpu = multi_gpu(&args, &topo, &policy, &plan)?;
    let facts = facts::gather(&root, &args.sysfs_root, &plan, topo.total_memory_bytes)?;
    let token = agent_token(&args, &root, previous.as_ref())?;
    if token.is_none() && !args.dry_run {
        anyhow::bail!("no agent token: pass --agent-token-file FILE or set BUILDKITE_AGENT_TOKEN (create one on the Buildkite cluster's Agent Tokens page)");
    }
    let from = binaries_dir(&args)?;
    let buildkite_agent = buildkite_agent(&args, &root);
    let queue = args.queue.clone().unwrap_or_default();
    let opts =
        Options {
            prefix: args.prefix.clone(),
            optional_binaries: OPTIONAL_BINARIES
                .iter()
                .filter(|b| from.join(b).is_file())
                .map(|b| b.to_string())
                .collect(),
            binaries_from: from,
            queue: queue.clone(),
            node: args.node.clone().unwrap_or_else(|| hostname(&root)),
            agents: args.agents,
            job_config: args.job_config.clone(),
            buildkite_agent,
            token,
            plugin_location: args.plugin_location.clone(),
            job_env: args.allow_job_env.clone(),
            multi_gpu,
            verification_jwks: match &args.verification_jwks {
                Some(path) => Some(std::fs::read_to_string(path).with_context(|| {
                    format!("cannot read --verification-jwks {}", path.display())
                })?),
                None => None,
            },
        };
    let mut desired = render::render(&plan, &facts, &opts)?;
    if live {
        if let Some(problem) = systemd_problem() {
            if !args.dry_run {
                anyhow::bail!("{problem}");
            }
            desired.notes.push(problem);
        }
    }
    let mut observed = apply::observe(&root, Some(&desired), previous.as_ref())?;
    observed.job_user_exists = facts.job_user_exists;
    observed.job_user_groups = facts.job_user_groups.clone();
    let actions = apply::decide(
        &desired,
        &observed,
        previous.as_ref(),
        &opts.node,
        Flags {
            replace: args.replace,
            no_start: args.no_start,
        },
    )?;
    let names = step_names(&opts.prefix, &opts.job_config);
    let header = report::header(&desired.summary, args.root.as_deref(), args.dry_run, false);
    say!(
        "{}",
        report::actions_text(&header, &actions, &desired.notes, &names)
    );
    if args.dry_run {
        say!("\ncontents:\n{}", report::contents_text(&desired));
        return Ok(ExitCode::SUCCESS);
    }

    let leftovers = execute(&args, &root, &opts, &actions, previous.as_ref())?;
    for l in &leftovers {
        sayln!("note: {l}");
    }
    sayln!("\n{}", next_step(&args, &desired, &opts, &actions));
    Ok(ExitCode::SUCCESS)
}

fn next_step(
    args: &SetupArgs,
    desired: &render::Desired,
    opts: &Options,
    actions: &apply::Actions,
) -> String {
    let units: Vec<String> = desired.agents.iter().map(|a| a.unit()).collect();
    let first = desired.agents.first().map(|a| a.unit()).unwrap_or_default();
    if let Some(r) = &args.root {
        return format!(
            "next: nothing outside {} was touched and no command was run; on the node, run the same command as root without --root",
            r.display()
        );
    }
    if args.no_start {
        return format!(
            "next: start the agents: systemctl enable --now {}",
            units.join(" ")
        );
    }
    let changed = if actions.changes_anything() {
        "set up"
    } else {
        "already set up (nothing changed)"
    };
    format!(
        "next: node {node} is {changed} and serves queue {queue:?}: its agents ({agents}) appear on the Buildkite cluster's Agents page, tagged queue={queue}, node={node}.\n\
  watch them:            systemctl status 'kernelkite-agent@*'; journalctl -fu {first}\n\
  check the slices again: {smoke}\n\
  then point a pipeline at queue {queue} (deployment/README.md, \"Operator path\": pipelines/host.yml or docker.yml).",
        node = opts.node,
        queue = opts.queue,
        agents = desired
            .agents
            .iter()
            .map(|a| a.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        smoke = step_names(&opts.prefix, &opts.job_config).smoke,
    )
}

fn uninstall(
    args: &SetupArgs,
    root: &Path,
    manifest: Option<&Manifest>,
) -> anyhow::Result<ExitCode> {
    let Some(manifest) = manifest else {
        sayln!(
            "kernelkite-isolate setup --uninstall: nothing to uninstall: {} does not exist (setup never ran here, or was uninstalled)",
            MANIFEST
        );
        return Ok(ExitCode::SUCCESS);
    };
    let observed = apply::observe(root, None, Some(manifest))?;
    let actions = apply::decide_uninstall(manifest, &observed);
    let header = report::header(
        &format!("node {}", manifest.node),
        args.root.as_deref(),
        args.dry_run,
        true,
    );
    let names = step_names(&args.prefix, &args.job_config);
    say!("{}", report::actions_text(&header, &actions, &[], &names));
    if args.dry_run {
        return Ok(ExitCode::SUCCESS);
    }
    let leftovers = if args.root.is_none() {
        let mut runner = Live {
            root,
            sysfs_root: &args.sysfs_root,
            node: manifest.node.clone(),
            docker: false,
        };
        sayln!();
        apply::execute(root, &actions, Some(manifest), &mut runner)?
    } else {
        apply::execute(root, &actions, Some(manifest), &mut Recorder::default())?
    };
    for l in &leftovers {
        sayln!("note: {l}");
    }
    sayln!(
        "\nuninstalled: what setup wrote is gone{}",
        if leftovers.is_empty() {
            ""
        } else {
            ", except what the notes above name"
        }
    );
    Ok(ExitCode::SUCCESS)
}

/// `smoke`.
pub fn run_smoke(args: SmokeArgs) -> anyhow::Result<ExitCode> {
    let mut env: BTreeMap<String, String> = match std::fs::read_to_string(&args.env_file) {
        Ok(text) => smoke::parse_env_file(&text)
            .map_err(|e| anyhow::anyhow!("{}: {e}", args.env_file.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !args.set.is_empty() => {
            BTreeMap::new()
        }
        Err(e) => {
            return Err(anyhow::Error::new(e).context(format!(
                "cannot read {} (written by `kernelkite-isolate setup`; pass --env-file FILE)",
                args.env_file.display()
            )))
        }
    };
    env.extend(args.set.iter().cloned());
    let reports = smoke::run(&SmokeOptions {
        hooks_dir: args.hooks_dir.clone(),
        env,
        node: args
            .node
            .clone()
            .unwrap_or_else(|| hostname(Path::new("/"))),
        runner: (!args.no_runner).then(|| args.runner.clone()),
        slices: (!args.slices.is_empty()).then(|| args.slices.clone()),
    })?;
    for r in &reports {
        say!("{}", r.text());
    }
    let ok = reports.iter().filter(|r| r.ok()).count();
    sayln!("smoke: {ok} of {} slice(s) ok", reports.len());
    Ok(if ok == reports.len() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn systemd_versions_parse_from_systemctl() {
        assert_eq!(
            parse_systemd_version("systemd 252 (252.38-1~deb12u1)\n+PAM +AUDIT"),
            Some(252)
        );
        assert_eq!(
            parse_systemd_version("systemd 245 (245.4-4ubuntu3.22)"),
            Some(245)
        );
        assert_eq!(parse_systemd_version("something else 300"), None);
        assert_eq!(parse_systemd_version(""), None);
    }

    #[test]
    fn key_values_parse() {
        assert_eq!(
            parse_key_value("A=b=c"),
            Ok(("A".to_string(), "b=c".to_string()))
        );
        assert!(parse_key_value("=x").is_err());
        assert!(parse_key_value("novalue").is_err());
    }
}
