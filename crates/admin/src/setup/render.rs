//! What a node needs, from its plan: a pure function of the plan, the [`Facts`] and the
//! operator's [`Options`] to the directories, files (path, mode, contents) and state setup
//! brings about. Nothing here reads or writes the machine.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use kernelkite_topology::cpulist::format_cpu_list;
use kernelkite_topology::plan::{Plan, Slice};
use kernelkite_topology::planner::format_bytes;

use super::facts::Facts;
use super::paths::*;
use super::SetupError;
use kernelkite_hooks::config::parse_config;

/// How the node's slices are offered to Buildkite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AgentLayout {
    /// One agent per slice, tagged `gpu-index=N`: a job runs on the slice its agent is bound to.
    PerSlice,
    /// One agent with `spawn = N` workers: each job leases the lowest free slice of the node.
    Pool,
}

/// The operator's choices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Where the binaries go (`<prefix>/bin`).
    pub prefix: PathBuf,
    /// Where the binaries come from.
    pub binaries_from: PathBuf,
    /// Those of [`OPTIONAL_BINARIES`] that `binaries_from` holds.
    pub optional_binaries: Vec<String>,
    /// The Buildkite queue the node serves (the backend's `queue`).
    pub queue: String,
    /// The node's name in agent names and the `node` tag.
    pub node: String,
    /// One agent per slice, or one pool agent.
    pub agents: AgentLayout,
    /// The configuration of the agent-level hooks (`KERNELKITE_CONFIG`, the plugin's schema).
    pub job_config: String,
    /// The `buildkite-agent` binary the units start.
    pub buildkite_agent: PathBuf,
    /// The agent token; `None` only to show what would be written (`--dry-run`).
    pub token: Option<String>,
    /// Where pipelines take the kernelkite plugin from, as their steps name it without the
    /// version (`github.com/ORG/REPO/plugin`): the one plugin the agents run, and ORG/REPO the
    /// one repository they check out.
    pub plugin_location: String,
    /// Job environment variables the agents accept besides Buildkite's own and [`JOB_ENV`]:
    /// `NAME`, or `PREFIX*`.
    pub job_env: Vec<String>,
    /// A queue for jobs of several GPUs served beside `queue` on the same slices, if any.
    pub multi_gpu: Option<MultiGpu>,
    /// The public JWKS of the key the service's pipeline agent signs its uploads with: the
    /// agents refuse any job whose step it did not sign. `None`: jobs are not verified.
    pub verification_jwks: Option<String>,
}

/// A queue for jobs of several GPUs (kernelbot's multi-GPU tasks), served by one agent per
/// group of slices beside the one-GPU queue's agents. Both lease the same GPUs; the node's
/// lease queue ([`kernelkite_hooks::lease`]) hands each GPU out in arrival order, so neither side starves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MultiGpu {
    /// The Buildkite queue (`h100-x8`).
    pub queue: String,
    /// Each agent's slices, from `kernelkite_topology::planner::multi_gpu_groups`.
    pub groups: Vec<Vec<u32>>,
}

/// A directory setup makes sure exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dir {
    /// The path on the node.
    pub path: PathBuf,
    /// Its mode when setup creates it.
    pub mode: u32,
}

/// What a file holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Content {
    /// Text.
    Text(String),
    /// Text holding a secret; `shown` is the same with the secret replaced, for printing.
    Secret {
        /// What is written.
        text: String,
        /// What is printed.
        shown: String,
    },
    /// A copy of a file (a binary).
    Copy(PathBuf),
    /// A symbolic link to this target.
    Link(PathBuf),
}

/// A file setup writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct File {
    /// The path on the node.
    pub path: PathBuf,
    /// Its permission bits (ignored for links).
    pub mode: u32,
    /// What it holds.
    pub content: Content,
}

/// One Buildkite agent of the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Agent {
    /// The unit's instance name and the configuration's file name (`gpu0`, `slice0`, `pool`).
    pub instance: String,
    /// The agent's name in Buildkite (`dgx01-gpu0`, `dgx01-pool-%spawn`).
    pub name: String,
    /// The slice it is bound to (tag `gpu-index`); `None` for the pool agent and a multi-GPU
    /// queue's agents.
    pub slice: Option<u32>,
    /// A multi-GPU queue's agent: the slices it is bound to (tag `gpu-index=i+j+…`); empty
    /// for the others.
    pub group: Vec<u32>,
}

impl Agent {
    /// `kernelkite-agent@<instance>.service`.
    pub fn unit(&self) -> String {
        AGENT_UNIT.replace("@.", &format!("@{}.", self.instance))
    }

    /// `/etc/kernelkite/agents/<instance>.cfg`.
    pub fn config_path(&self) -> PathBuf {
        Path::new(AGENTS_DIR).join(format!("{}.cfg", self.instance))
    }
}

/// Everything a node needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Desired {
    /// One line saying what the node gets.
    pub summary: String,
    /// Directories, parents first.
    pub dirs: Vec<Dir>,
    /// Files, in the order they are written.
    pub files: Vec<File>,
    /// The agents (their units are enabled and started).
    pub agents: Vec<Agent>,
    /// Units to enable besides the agents (the favordynmods mount on cgroup v1).
    pub units: Vec<String>,
    /// Groups the job user must be a member of (those owning the AMD device nodes).
    pub job_user_groups: Vec<String>,
    /// What the operator should know.
    pub notes: Vec<String>,
}

/// What the printed configuration shows instead of the token.
pub const TOKEN_SHOWN: &str = "<redacted>";
/// What a configuration holds when no token was given (only ever printed, never written).
pub const TOKEN_MISSING: &str =
    "<missing: pass --agent-token-file FILE or set BUILDKITE_AGENT_TOKEN>";

/// Where the deployment's pipelines take the kernelkite plugin from (`deployment/pipelines/*.yml`:
/// `github.com/kernelkite/kernelkite/plugin#v0.1.0`), without the version.
pub const DEFAULT_PLUGIN_LOCATION: &str = "github.com/kernelkite/kernelkite/plugin";

/// The job environment variables the agents accept besides Buildkite's own (`BUILDKITE`,
/// `BUILDKITE_*`, `CI`, which the agent always accepts): what kernelkite-service puts in each
/// build's env (the payload, in one or in chunks, and the run's ids).
pub const JOB_ENV: &[&str] = &["KERNELBOT_*", kernelkite_sys::node::SUBMISSION_ID_ENV];

/// Job variables `--allow-job-env` may not name: the hooks' own settings (they come from
/// `agent.env`), and what makes a root process load or run something else (the dynamic
/// loader, git during the checkout, a shell's start-up file, where commands are found).
const REFUSED_JOB_ENV: &[&str] = &["KERNELKITE_", "LD_", "GIT_", "BASH_ENV", "ENV", "PATH"];

/// Names and queues go into agent names, tags and file names.
fn check_name(what: &str, flag: &str, value: &str) -> Result<(), SetupError> {
    let ok = !value.is_empty()
        && value.len() <= 64
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(SetupError::Invalid(format!(
            "{what} {value:?} must be 1-64 of A-Z a-z 0-9 . _ - (pass {flag})"
        )))
    }
}

/// A token must fit between the configuration's double quotes on one line.
pub fn check_token(token: &str) -> Result<(), SetupError> {
    if token.is_empty()
        || token
            .chars()
            .any(|c| c.is_control() || c == '"' || c == '\\')
    {
        return Err(SetupError::Invalid(
            "the agent token is empty or has quotes, backslashes or control characters; give the token from the Buildkite cluster's Agent Tokens page".into(),
        ));
    }
    Ok(())
}

/// The configuration for the agent-level hooks, checked against the plugin's schema and
/// written compactly; it goes between single quotes in `agent.env`.
pub fn check_job_config(json: &str) -> Result<String, SetupError> {
    parse_config(json).map_err(|e| SetupError::Invalid(format!("--job-config: {e}")))?;
    let value: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| SetupError::Invalid(format!("--job-config is not JSON: {e}")))?;
    let compact = value.to_string();
    if compact.contains('\'') {
        return Err(SetupError::Invalid(
            "--job-config may not contain a single quote (it is written between single quotes in agent.env)".into(),
        ));
    }
    Ok(compact)
}

/// The plugin's location: `github.com/ORG/REPO[/DIR...]`, without a version, of letters,
/// digits, `.`, `_` and `-` (what goes into the agents' patterns is then literal but for `.`).
pub fn check_plugin_location(location: &str) -> Result<(), SetupError> {
    let segments: Vec<&str> = location.split('/').collect();
    let ok = segments.len() >= 3
        && segments[0] == "github.com"
        && segments.iter().all(|s| {
            !s.is_empty()
                && *s != "."
                && *s != ".."
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        });
    if ok {
        Ok(())
    } else {
        Err(SetupError::Invalid(format!(
            "--plugin-location {location:?} must be the plugin's place on GitHub as pipelines name it, without the version: github.com/ORG/REPO/plugin (the default is {DEFAULT_PLUGIN_LOCATION})"
        )))
    }
}

/// A job variable's name for `--allow-job-env`: `NAME` or `PREFIX*`.
pub fn check_job_env(name: &str) -> Result<(), SetupError> {
    let stem = name.strip_suffix('*').unwrap_or(name);
    let well_formed = !stem.is_empty()
        && !stem.starts_with(|c: char| c.is_ascii_digit())
        && stem.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !well_formed {
        return Err(SetupError::Invalid(format!(
            "--allow-job-env {name:?} must be a variable's name, or a prefix followed by * (e.g. HF_TOKEN, POPCORN_*)"
        )));
    }
    let prefix = name.ends_with('*');
    let refused = REFUSED_JOB_ENV.iter().find(|r| {
        let family = r.ends_with('_');
        (if family {
            stem.starts_with(**r)
        } else {
            stem == **r
        }) || (prefix && r.starts_with(stem))
    });
    match refused {
        Some(r) => Err(SetupError::Invalid(format!(
            "--allow-job-env {name:?}: a job may not set {r}{}: the checkout and the hooks run as root, and it would change what they load and run (or replace the hooks' own settings from agent.env)",
            if r.ends_with('_') { "*" } else { "" }
        ))),
        None => Ok(()),
    }
}

/// `.` is the only character of a checked location that means something in a pattern.
fn literal(text: &str) -> String {
    text.replace('.', r"\.")
}

/// The agents' `allowed-plugins`: the plugin's location at a version tag (`#v1`, `#v0.1.0`,
/// `#v1.0.0-rc.1`), nothing before or after: not the bare location (the default branch), a
/// branch like `main` or a commit, which could name code no release holds. (The agent checks
/// out whatever ref has the name, so a branch someone with push access calls `v9` passes too.)
pub fn allowed_plugins(location: &str) -> String {
    format!(
        r"^{}#v[0-9]+(\.[0-9]+)*(-[0-9A-Za-z.]+)?$",
        literal(location)
    )
}

/// The agents' `allowed-repositories`: the plugin's repository (the first three segments of its
/// location, as the agent splits a GitHub location) in the forms a pipeline's repository URL
/// takes: `https://github.com/ORG/REPO[.git]`, `git@github.com:ORG/REPO[.git]`,
/// `ssh://git@github.com/ORG/REPO[.git]`.
pub fn allowed_repositories(location: &str) -> String {
    let org_repo: Vec<&str> = location.split('/').skip(1).take(2).collect();
    format!(
        r"^(https://github\.com/|git@github\.com:|ssh://git@github\.com/){}(\.git)?$",
        literal(&org_repo.join("/"))
    )
}

/// The agents' `allowed-environment-variables`: one anchored pattern per name of [`JOB_ENV`]
/// and `extra` (`PREFIX*` → `^PREFIX[A-Za-z0-9_]*$`).
pub fn allowed_environment_variables(extra: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for name in JOB_ENV
        .iter()
        .copied()
        .chain(extra.iter().map(String::as_str))
    {
        let pattern = match name.strip_suffix('*') {
            Some(prefix) => format!("^{prefix}[A-Za-z0-9_]*$"),
            None => format!("^{name}$"),
        };
        if !out.contains(&pattern) {
            out.push(pattern);
        }
    }
    out
}

/// What an agent's configuration says so that jobs run nothing but kernelkite's hooks. Each
/// option is named as `buildkite-agent start` reads it from its configuration file
/// (clicommand/agent_start.go in github.com/buildkite/agent, 3.108 to 4.0: the `cli:` names of
/// AgentStartConfig). The file is read by cliconfig/file.go: `#` starts a comment unless it is
/// inside double quotes, and a list is split at commas, so no pattern here holds a comma.
pub fn agent_lockdown(opts: &Options) -> String {
    let mut s = String::new();
    s.push_str("# Jobs run nothing but kernelkite's hooks. The agent runs as root: a step's plugin, a repository's\n# .buildkite/hooks or a job variable the checkout and the hooks read would run code as root outside\n# the hooks' confinement (a plugin's or the repository's `command` hook replaces ours). A job that\n# asks for any of these is refused (plugin/README.md, \"Node set-up\").\n");
    // internal/job/executor.go (executeLocalHook): a repository hook fails the job, "refusing
    // to run ..., local hooks are disabled"; agent/job_runner.go gives the bootstrap
    // BUILDKITE_LOCAL_HOOKS_ENABLED, which a job cannot override (env/protected.go).
    s.push_str(
        "# The repository's .buildkite/hooks: a job that has one fails.\nno-local-hooks=true\n",
    );
    // clicommand/agent_start.go: no-local-hooks and no-command-eval turn plugins off unless the
    // configuration sets no-plugins itself. allowed-plugins is checked before the job starts
    // (agent/run_job.go, validatePlugins): each plugin of BUILDKITE_PLUGINS, as go-pipeline's
    // Plugin.FullSource() writes it (a location of three or more segments as the step names
    // it; `docker#v5` becomes github.com/buildkite-plugins/docker-buildkite-plugin#v5), must
    // match one pattern, else the job ends at once with exit -1, signal reason agent_refused.
    // Go's regexp.MatchString finds a match anywhere: the pattern is anchored at both ends.
    let _ = writeln!(
        s,
        "# Plugins stay on (no-local-hooks and no-command-eval would turn them off), but only kernelkite's,\n# at a version: a job naming any other plugin (the docker plugin included) is refused.\nno-plugins=false\nallowed-plugins=\"{}\"",
        allowed_plugins(&opts.plugin_location)
    );
    // Besides choosing an error message (internal/job/plugin.go), the bootstrap heeds
    // command-eval only in internal/job/executor.go (defaultCommandPhase): the agent's own
    // command phase, which runs only when no plugin, repository or agent command hook does
    // (runCommand). Ours always does; were it ever missing, the agent would refuse to run the
    // step's command rather than run it as root unconfined. Agents 3.134 and later also lock
    // the checkout's git settings against hooks and plugins with it (env/protected.go,
    // RestrictedForCommandEval); kernelkite's hooks set none.
    s.push_str("# The step's command runs only through the hooks: were the command hook ever missing, the agent\n# would refuse to run it itself.\nno-command-eval=true\n");
    // internal/job/plugin.go (executePluginHook): with it, only the first plugin's command hook
    // runs when a step names the plugin twice.
    s.push_str("# One command hook per job, even when a step names the plugin twice.\nstrict-single-hooks=true\n");
    // agent/run_job.go (validateConfigAllowlists): BUILDKITE_REPO must match, else the job is
    // refused like a plugin; the checkout runs as root (git clone, submodules).
    let _ = writeln!(
        s,
        "# The one repository checked out (by git, as root; the step needs nothing from it): the plugin's.\nallowed-repositories=\"{}\"",
        allowed_repositories(&opts.plugin_location)
    );
    // agent/run_job.go (validateEnv) with clicommand/agent_start.go: every variable of the job
    // (pipeline, build and step env) must match a pattern, or be BUILDKITE, BUILDKITE_* or CI,
    // which the agent always allows; else the job is refused. The job's variables are added
    // after the agent's own environment (agent/job_runner.go), so without this a job could
    // replace what agent.env gives the hooks (KERNELKITE_*), or set LD_PRELOAD, BASH_ENV or
    // GIT_* for the root checkout and hooks.
    let _ = writeln!(
        s,
        "# A job's variables (its pipeline's, build's and step's env) replace the agents' own: only kernelbot's\n# (the payload, the run's ids) and Buildkite's (BUILDKITE_*, CI, always allowed) are accepted.\nenable-environment-variable-allowlist=true\nallowed-environment-variables=\"{}\"",
        allowed_environment_variables(&opts.job_env).join(",")
    );
    // internal/job/plugin.go (validatePluginCheckout, checkoutPlugin). Validation checks a
    // step's configuration against the plugin's own plugin.yml: the one plugin allowed checks
    // its configuration by the same rules in its hooks (kernelkite_hooks::config, kept in step with
    // plugin.yml by tests/hooks/hooks_config.rs), so it adds no boundary. A clone is kept per plugin version under plugins-path, which is
    // root's; cloning afresh would fetch the repository for every job.
    s.push_str("# The agent's defaults, said here: the plugin checks its configuration in its hooks, and its clone,\n# kept per version, is root's.\nno-plugin-validation=true\nplugins-always-clone-fresh=false\n");
    // clicommand/cancel_signal.go: the signal grace (how long a canceled or timed-out job's
    // bootstrap has for post-command, the artifact upload and pre-exit before the agent
    // SIGKILLs it, agent/run_job.go Cancel) is cancel-grace-period less one second by default.
    // The agent's default of 10 left 9 s, and a job can make its clean-up take seconds: the
    // kernel's teardown of what its processes mapped (plugin/README.md, "Canceled jobs";
    // tests/tests/real_agent_node.rs pins it).
    let _ = writeln!(
        s,
        "# A canceled or timed-out job's clean-up (killing what it left, removing its cgroup, releasing the\n# slice) runs inside the agent's grace: {CANCEL_GRACE_S} s, less one for the job's own hooks.\ncancel-grace-period={CANCEL_GRACE_S}"
    );
    s
}

/// The agent's `cancel-grace-period` on a node (seconds); the signal grace is one less.
pub const CANCEL_GRACE_S: u64 = 30;

/// The agents of the node: the one-GPU queue's, then the multi-GPU queue's.
pub fn agents(plan: &Plan, opts: &Options) -> Vec<Agent> {
    let mut out = one_gpu_agents(plan, opts);
    if let Some(m) = &opts.multi_gpu {
        for (k, group) in m.groups.iter().enumerate() {
            let instance = format!("x{}-{k}", group.len());
            out.push(Agent {
                name: format!("{}-{instance}", opts.node),
                instance,
                slice: None,
                group: group.clone(),
            });
        }
    }
    out
}

fn one_gpu_agents(plan: &Plan, opts: &Options) -> Vec<Agent> {
    match opts.agents {
        AgentLayout::Pool => vec![Agent {
            instance: "pool".into(),
            name: format!("{}-pool-%spawn", opts.node),
            slice: None,
            group: Vec::new(),
        }],
        AgentLayout::PerSlice => plan
            .slices
            .iter()
            .map(|s| {
                // `-gpuN` names are also how the hooks bind an agent without a tag.
                let instance = if s.gpu.is_some() {
                    format!("gpu{}", s.index)
                } else {
                    format!("slice{}", s.index)
                };
                Agent {
                    name: format!("{}-{instance}", opts.node),
                    instance,
                    slice: Some(s.index),
                    group: Vec::new(),
                }
            })
            .collect(),
    }
}

/// Slice numbers joined by `sep`: `,` for people; `+` in a `gpu-index` tag, since the agent
/// splits its `tags` at commas (cliconfig/file.go), which would leave `gpu-index=0` and bare
/// tags `1`...
fn joined(ids: &[u32], sep: &str) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(sep)
}

/// How a slice is described in comments: `GPU 0000:18:00.0, CPUs 1-13,113-125, 230.4 GiB`.
fn describe_slice(s: &Slice) -> String {
    let gpus: Vec<&str> = s.gpus().iter().map(|g| g.pci_bus_id.as_str()).collect();
    let gpu = if gpus.is_empty() {
        "no GPU".to_string()
    } else {
        format!("GPU {}", gpus.join(","))
    };
    format!(
        "{gpu}, CPUs {}, {}",
        format_cpu_list(&s.cpus),
        format_bytes(s.memory_bytes)
    )
}

fn header(what: &str, node: &str) -> String {
    format!(
        "# Written by `kernelkite-isolate setup` for node {node}: {what}.\n# Rerun setup to change it; `kernelkite-isolate setup --uninstall` removes it.\n"
    )
}

/// `/etc/kernelkite/plan.json`: the plan, as `plan --json` prints it.
pub fn plan_json(plan: &Plan) -> String {
    format!(
        "{}\n",
        serde_json::to_string(plan).unwrap_or_else(|_| "{}".into())
    )
}

fn has_gpus(plan: &Plan) -> bool {
    plan.slices.iter().any(|s| s.gpu.is_some())
}

/// `/etc/kernelkite/agent.env`: the environment of every agent, its hooks and its jobs.
pub fn agent_env(plan: &Plan, opts: &Options) -> String {
    let bin = opts.prefix.join("bin");
    let mut s = header(
        "the environment of its Buildkite agents, their hooks and jobs (systemd EnvironmentFile=)",
        &opts.node,
    );
    s.push_str("# No secrets here: the agent token is only in the root-only agents/*.cfg.\n");
    // A venv at <prefix>/venv (the deployment guide's place for host mode's Python and task
    // dependencies) comes before the system's python3; it need not exist.
    let _ = writeln!(
        s,
        "PATH={}:{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        bin.display(),
        opts.prefix.join("venv/bin").display()
    );
    let _ = writeln!(s, "HOME={STATE_DIR}");
    let _ = writeln!(s, "KERNELKITE_PLAN_FILE={PLAN_FILE}");
    let _ = writeln!(s, "KERNELKITE_RUN_DIR={RUN_DIR}");
    s.push_str("# The agent-level hooks' configuration (the plugin's keys); a step using the plugin overrides it.\n");
    let _ = writeln!(s, "KERNELKITE_CONFIG='{}'", opts.job_config);
    // The artifacts are the files the sandbox carried back (regular files, never links); were a
    // link ever in the checkout, the agent's `artifact upload` would send what it points to
    // (clicommand/artifact_upload.go: links to files are followed unless told not to).
    s.push_str(
        "# The agent uploads no artifact that is a symbolic link, and no glob walks through one.\n",
    );
    s.push_str("BUILDKITE_ARTIFACT_UPLOAD_SKIP_SYMLINKS=true\n");
    s.push_str("BUILDKITE_AGENT_ARTIFACT_GLOB_RESOLVE_FOLLOW_SYMLINKS=false\n");
    if opts.verification_jwks.is_some() {
        // kernelkite_hooks::admission: the agents verify signatures, and a signed step must
        // also be bound to its build and queue (deployment/pipelines/host.yml signs both).
        s.push_str("# The agents verify pipeline signatures: the pre-bootstrap hook also refuses a step not signed for\n# the job's build and queue.\n");
        let _ = writeln!(
            s,
            "{}=on",
            kernelkite_hooks::admission::SIGNED_STEPS_SETTING
        );
    }
    if has_gpus(plan) {
        s.push_str("# A GPU node: the runner fails as an infrastructure error (exit 3, retried elsewhere) when it sees no GPU.\n");
        s.push_str("KERNELKITE_REQUIRE_GPU=1\n");
    }
    s
}

/// `/etc/kernelkite/agents/<instance>.cfg`: one Buildkite agent's configuration, with the
/// token; the second value is what is printed (token redacted).
pub fn agent_config(plan: &Plan, opts: &Options, agent: &Agent) -> (String, String) {
    let multi = opts.multi_gpu.as_ref().filter(|_| !agent.group.is_empty());
    let mut head = match (multi, opts.agents) {
        (Some(m), _) => header(
            &format!(
                "agent {} of the multi-GPU queue {}, bound to slices {} ({} GPUs per job; the one-GPU queue's jobs lease the same GPUs, first come first served)",
                agent.instance,
                m.queue,
                joined(&agent.group, ","),
                agent.group.len()
            ),
            &opts.node,
        ),
        (None, AgentLayout::Pool) => header(
            &format!(
                "its pool agent, {} worker(s), one per slice; each job leases the lowest free slice",
                plan.slices.len()
            ),
            &opts.node,
        ),
        (None, AgentLayout::PerSlice) => {
            let about = match agent
                .slice
                .and_then(|i| plan.slices.iter().find(|s| s.index == i))
            {
                Some(s) => format!(
                    "agent {}, bound to slice {} ({})",
                    agent.instance,
                    s.index,
                    describe_slice(s)
                ),
                None => format!("agent {}", agent.instance),
            };
            header(&about, &opts.node)
        }
    };
    head.push_str("# Root-only (0600): it holds the agent token, and reaches the agent as a systemd credential.\n");
    let mut body = String::new();
    let queue = multi.map_or(&opts.queue, |m| &m.queue);
    let mut tags = format!("queue={queue},node={}", opts.node);
    if !agent.group.is_empty() {
        // The hooks lease exactly these slices, and a step without `gpus` gets them all.
        let _ = write!(tags, ",gpu-index={}", joined(&agent.group, "+"));
    } else if opts.agents == AgentLayout::Pool {
        let _ = writeln!(body, "spawn={}", plan.slices.len());
    } else if let Some(n) = agent.slice {
        // The hooks read it as BUILDKITE_AGENT_META_DATA_GPU_INDEX: the slice to lease.
        let _ = write!(tags, ",gpu-index={n}");
    }
    let _ = writeln!(body, "name=\"{}\"", agent.name);
    let _ = writeln!(body, "tags=\"{tags}\"");
    let _ = writeln!(body, "hooks-path=\"{HOOKS_DIR}\"");
    let _ = writeln!(body, "build-path=\"{BUILD_DIR}\"");
    let _ = writeln!(body, "plugins-path=\"{PLUGINS_DIR}\"");
    body.push_str(&agent_lockdown(opts));
    if opts.verification_jwks.is_some() {
        // agent/verify_job.go: after the job starts and before any hook, the agent checks the
        // accepted job's step against its signature (made by `pipeline upload` with the
        // signing key) and the job's command, env and plugins against the step; with `block`
        // a job that fails (or has no signature) ends at once, exit -1, signal reason
        // signature_rejected, nothing of it run.
        let _ = writeln!(
            body,
            "# Only steps the service's pipeline agent signed run here (Buildkite's signed pipelines): a job\n# whose step has no valid signature, or does not match it, is refused before any hook runs.\nverification-jwks-file=\"{VERIFICATION_JWKS}\"\nverification-failure-behavior=block"
        );
    }
    let token = opts.token.as_deref().unwrap_or(TOKEN_MISSING);
    let text = format!("{head}token=\"{token}\"\n{body}");
    let shown_token = if opts.token.is_some() {
        TOKEN_SHOWN
    } else {
        TOKEN_MISSING
    };
    let shown = format!("{head}token=\"{shown_token}\"\n{body}");
    (text, shown)
}

/// The memory the plan leaves outside the slices: the host's reserve.
pub fn host_reserve(plan: &Plan, total_memory_bytes: u64) -> u64 {
    let slices: u64 = plan.slices.iter().map(|s| s.memory_bytes).sum();
    total_memory_bytes.saturating_sub(slices)
}

/// `/etc/systemd/system/kernelkite.slice`: the agents' slice, on the housekeeping CPUs and
/// within the host's memory reserve.
pub fn slice_unit(plan: &Plan, facts: &Facts, node: &str) -> String {
    let mut s = header(
        "the systemd slice of its Buildkite agents and their hooks",
        node,
    );
    s.push_str("# The agents run on the host's housekeeping CPUs and within its memory reserve, so they never\n# take what the plan gives the jobs; each job's command runs in its own slice's cgroup, outside\n# this one (the hooks put it there).\n");
    let _ = write!(
        s,
        "[Unit]\nDescription=kernelkite: the Buildkite agents of node {node}, on the host's housekeeping CPUs and memory reserve\nDocumentation={DOCS_URL}\nBefore=slices.target\n\n[Slice]\n"
    );
    let reserved = format_cpu_list(&plan.reserved_cpus);
    if plan.reserved_cpus.is_empty() {
        s.push_str("# No housekeeping CPUs in the plan (--housekeeping-cores 0): the agents share the jobs' CPUs.\n");
    } else if facts.cgroup_version == 2 {
        let _ = writeln!(s, "# The plan's reserved_cpus.\nAllowedCPUs={reserved}");
    } else {
        let _ = writeln!(s, "# cgroup v1: systemd applies AllowedCPUs= only on cgroup v2, so {AGENT_UNIT} pins the agents\n# to the plan's reserved_cpus ({reserved}) with CPUAffinity= instead.");
    }
    let reserve = host_reserve(plan, facts.total_memory_bytes);
    if reserve == 0 {
        s.push_str("# The slices take all the memory: no limit is left to give the agents.\n");
    } else {
        let _ = writeln!(
            s,
            "# The host's reserve: {} of {} is outside the slices.\nMemoryMax={reserve}",
            format_bytes(reserve),
            format_bytes(facts.total_memory_bytes)
        );
    }
    s
}

/// `/etc/systemd/system/kernelkite-agent@.service`: the agents' template unit.
pub fn agent_unit(plan: &Plan, facts: &Facts, opts: &Options) -> String {
    let mut s = header("the template unit of its Buildkite agents (one instance per agent, e.g. kernelkite-agent@gpu0)", &opts.node);
    let _ = write!(
        s,
        "[Unit]\nDescription=Buildkite agent %i of kernelkite (jobs held to their GPU slices by the hooks)\nDocumentation={DOCS_URL}\nWants=network-online.target\nAfter=network-online.target\n"
    );
    // MIG devices are made anew at every boot: the plan is refreshed before the agent starts.
    let mig = plan.names_mig();
    if mig {
        // After the units that make MIG devices at boot (absent units order nothing).
        let _ = writeln!(
            s,
            "After=nvidia-persistenced.service nvidia-mig-manager.service"
        );
    }
    if facts.cgroup_version == 1 && favordynmods_supported(facts) {
        let _ = writeln!(s, "Wants={FAVORDYNMODS_UNIT}\nAfter={FAVORDYNMODS_UNIT}");
    }
    let _ = write!(s, "\n[Service]\nType=simple\n# Runs as root: the hooks create the jobs' cgroups and start each command as {JOB_USER}.\nSlice={SLICE_UNIT}\n");
    if facts.cgroup_version == 1 && !plan.reserved_cpus.is_empty() {
        let _ = writeln!(
            s,
            "# cgroup v1: the housekeeping CPUs by affinity (a job's command gets its slice's CPUs when\n# the hooks move it into its cpuset cgroup).\nCPUAffinity={}",
            format_cpu_list(&plan.reserved_cpus)
        );
    }
    if mig {
        // MIG devices are made anew at every boot (nvidia-mig-manager, or by hand), with new
        // uuids: the plan takes them before an agent takes a job; a changed layout stops the
        // agents, the journal saying what changed and to run setup again.
        let _ = write!(
            s,
            "# MIG devices get new uuids at every boot: the plan takes them (or the agent does not start,\n# saying what changed) before any job.\nExecStartPre={} plan --refresh {PLAN_FILE}\n",
            opts.prefix.join("bin").join(kernelkite_sys::node::ISOLATE_BINARY).display()
        );
    }
    let _ = write!(
        s,
        "EnvironmentFile={AGENT_ENV}\n# The configuration holds the agent token: it stays in a root-only file and reaches the agent as\n# a credential, never through the environment (which every job inherits).\nLoadCredential=agent.cfg:{AGENTS_DIR}/%i.cfg\nExecStart={} start --config %d/agent.cfg\nRestart=on-failure\nRestartSec=5\n# On SIGTERM the agent finishes its running job (at most the pipeline's 30 minutes), then exits.\nKillMode=mixed\nTimeoutStopSec=35min\n\n[Install]\nWantedBy=multi-user.target\n",
        opts.buildkite_agent.display()
    );
    s
}

/// Whether the kernel has `favordynmods` for cgroup v1 (Linux 6.0).
pub fn favordynmods_supported(facts: &Facts) -> bool {
    facts.kernel_version().is_some_and(|v| v >= (6, 0))
}

/// `/etc/systemd/system/run-kernelkite-favordynmods.mount` (cgroup v1, Linux 6.0+).
pub fn favordynmods_unit(node: &str) -> String {
    let mut s = header("fast cgroup migrations on cgroup v1 (favordynmods)", node);
    s.push_str("# On cgroup v1 every move of a process into a cgroup (the hooks move each job's command into\n# its cgroup) waits for an RCU grace period, about 10 ms, unless a cgroup hierarchy is mounted\n# with `favordynmods` (Linux 6.0+): the kernel's cgroup lock is global, so one such mount turns\n# it on for every hierarchy, at a small cost to every fork and exit. The existing hierarchies\n# cannot be remounted with a new option, so this mounts an empty named hierarchy carrying it.\n");
    let _ = write!(
        s,
        "[Unit]\nDescription=kernelkite: fast cgroup migrations on cgroup v1 (favordynmods)\nDocumentation={DOCS_URL}\n\n[Mount]\nWhat=kernelkite\nWhere={FAVORDYNMODS_DIR}\nType=cgroup\nOptions=none,name=kernelkite,favordynmods\nDirectoryMode=0755\n\n[Install]\nWantedBy=multi-user.target\n"
    );
    s
}

fn unit_path(name: &str) -> PathBuf {
    Path::new(UNIT_DIR).join(name)
}

/// Everything the node needs, from its plan.
pub fn render(plan: &Plan, facts: &Facts, opts: &Options) -> Result<Desired, SetupError> {
    let opts = &checked_options(plan, opts)?;
    let bin = opts.prefix.join("bin");
    let mut dirs = node_dirs(opts, &bin);
    let mut files = installed_files(plan, opts, &bin);
    link_plugin_hook_binary(&bin, &mut dirs, &mut files);
    files.push(File {
        path: AGENT_ENV.into(),
        mode: 0o644,
        content: Content::Text(agent_env(plan, opts)),
    });
    let agents = agents(plan, opts);
    for a in &agents {
        let (text, shown) = agent_config(plan, opts, a);
        files.push(File {
            path: a.config_path(),
            mode: 0o600,
            content: Content::Secret { text, shown },
        });
    }
    if let Some(jwks) = &opts.verification_jwks {
        files.push(File {
            path: VERIFICATION_JWKS.into(),
            mode: 0o644,
            content: Content::Text(jwks.clone()),
        });
    }
    files.push(File {
        path: unit_path(SLICE_UNIT),
        mode: 0o644,
        content: Content::Text(slice_unit(plan, facts, &opts.node)),
    });
    files.push(File {
        path: unit_path(AGENT_UNIT),
        mode: 0o644,
        content: Content::Text(agent_unit(plan, facts, opts)),
    });

    let mut units = Vec::new();
    let mut notes = Vec::new();
    if facts.cgroup_version == 1 {
        cgroup_v1_migrations(facts, opts, &mut files, &mut units, &mut notes);
    }
    if opts.verification_jwks.is_none() {
        notes.push("the agents verify no pipeline signature: any step uploaded with a token of the agents' cluster for this queue runs here; pass --verification-jwks with the public key the service's pipeline agent signs with (deployment/README.md, \"Signed pipelines\")".into());
    }
    if plan.reserved_cpus.is_empty() {
        notes.push("the plan reserves no housekeeping CPU (--housekeeping-cores 0): the agents share the jobs' CPUs".into());
    }
    if host_reserve(plan, facts.total_memory_bytes) == 0 {
        notes.push("the slices take all the memory: the agents' slice gets no MemoryMax".into());
    }
    let job_user_groups = job_user_groups(facts, &mut notes);
    for w in &plan.warnings {
        notes.push(format!("plan: {w}"));
    }

    Ok(Desired {
        summary: summary(plan, facts, opts),
        dirs,
        files,
        agents,
        units,
        job_user_groups,
        notes,
    })
}

/// Checks the options and the plan; returns the options with the job configuration as it is
/// to be written.
fn checked_options(plan: &Plan, opts: &Options) -> Result<Options, SetupError> {
    check_name("the queue", "--queue NAME", &opts.queue)?;
    if let Some(m) = &opts.multi_gpu {
        check_name("the multi-GPU queue", "--multi-gpu-queue NAME", &m.queue)?;
        if m.queue == opts.queue {
            return Err(SetupError::Invalid(format!(
                "--multi-gpu-queue {:?} is the node's one-GPU queue: give the multi-GPU jobs a queue of their own (e.g. {}-x{})",
                m.queue,
                opts.queue,
                m.groups.first().map_or(2, Vec::len)
            )));
        }
    }
    check_name("the node name", "--node NAME", &opts.node)?;
    if let Some(t) = &opts.token {
        check_token(t)?;
    }
    if plan.slices.is_empty() {
        return Err(SetupError::Invalid(
            "the plan has no slice; check `kernelkite-isolate plan`".into(),
        ));
    }
    check_plugin_location(&opts.plugin_location)?;
    for name in &opts.job_env {
        check_job_env(name)?;
    }
    let job_config = check_job_config(&opts.job_config)?;
    if let Some(jwks) = &opts.verification_jwks {
        check_verification_jwks(jwks)?;
    }
    Ok(Options {
        job_config,
        ..opts.clone()
    })
}

/// The algorithms the agent signs and verifies pipelines with (go-pipeline's
/// `jwkutil.ValidSigningAlgorithms`).
pub const SIGNING_ALGORITHMS: &[&str] = &["EdDSA", "ES512", "PS512"];

/// Checks `--verification-jwks` as the agent will read it (agent v3.137.0,
/// `clicommand/agent_start.go` `parseAndValidateJWKS`: every key has an `alg` it accepts and a
/// `kid`): a public key set, never the private one (which would let anyone who reads it sign).
pub fn check_verification_jwks(text: &str) -> Result<(), SetupError> {
    let bad = |why: String| {
        SetupError::Invalid(format!(
            "--verification-jwks: {why}; give the public JWKS of the pipeline agent's signing key (buildkite-agent tool keygen writes it; deployment/README.md, \"Signed pipelines\")"
        ))
    };
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| bad(format!("not JSON ({e})")))?;
    let keys = v["keys"]
        .as_array()
        .filter(|k| !k.is_empty())
        .ok_or_else(|| bad("no `keys` list, or an empty one".into()))?;
    for (i, k) in keys.iter().enumerate() {
        let alg = k["alg"].as_str().unwrap_or_default();
        if !SIGNING_ALGORITHMS.contains(&alg) {
            return Err(bad(format!(
                "key {i} has alg {alg:?}; the agent takes {}",
                SIGNING_ALGORITHMS.join(", ")
            )));
        }
        if k["kid"].as_str().is_none_or(str::is_empty) {
            return Err(bad(format!("key {i} has no `kid`")));
        }
        // A private key's parts (OKP/EC `d`, RSA `d`, `p`, `q`...).
        if ["d", "p", "q", "dp", "dq", "qi"]
            .iter()
            .any(|f| k.get(f).is_some())
        {
            return Err(bad(format!(
                "key {i} ({:?}) is a private key, which signs; the nodes need only the public one",
                k["kid"].as_str().unwrap_or_default()
            )));
        }
    }
    Ok(())
}

/// The node's directories, parents first.
fn node_dirs(opts: &Options, bin: &Path) -> Vec<Dir> {
    vec![
        Dir {
            path: opts.prefix.clone(),
            mode: 0o755,
        },
        Dir {
            path: bin.to_path_buf(),
            mode: 0o755,
        },
        Dir {
            path: ETC_DIR.into(),
            mode: 0o755,
        },
        Dir {
            path: HOOKS_DIR.into(),
            mode: 0o755,
        },
        // Holds the agent token.
        Dir {
            path: AGENTS_DIR.into(),
            mode: 0o700,
        },
        Dir {
            path: STATE_DIR.into(),
            mode: 0o755,
        },
        Dir {
            path: BUILD_DIR.into(),
            mode: 0o755,
        },
        Dir {
            path: PLUGINS_DIR.into(),
            mode: 0o755,
        },
        Dir {
            path: UNIT_DIR.into(),
            mode: 0o755,
        },
    ]
}

/// The binaries copied into `bin`, the plan, and the agent's hooks (links to the binary).
fn installed_files(plan: &Plan, opts: &Options, bin: &Path) -> Vec<File> {
    let mut files: Vec<File> = BINARIES
        .iter()
        .copied()
        .chain(opts.optional_binaries.iter().map(String::as_str))
        .map(|b| File {
            path: bin.join(b),
            mode: 0o755,
            content: Content::Copy(opts.binaries_from.join(b)),
        })
        .collect();
    files.push(File {
        path: PLAN_FILE.into(),
        mode: 0o644,
        content: Content::Text(plan_json(plan)),
    });
    for hook in HOOKS {
        files.push(File {
            path: Path::new(HOOKS_DIR).join(hook),
            mode: 0o777,
            content: Content::Link(bin.join("kernelkite-isolate")),
        });
    }
    files.push(File {
        path: Path::new(HOOKS_DIR).join(PRE_BOOTSTRAP_HOOK),
        mode: 0o755,
        content: Content::Text(pre_bootstrap_hook(bin)),
    });
    files
}

/// The agent's `pre-bootstrap` hook: checks a job's variables before its bootstrap starts
/// (`kernelkite_hooks::admission`).
pub const PRE_BOOTSTRAP_HOOK: &str = "pre-bootstrap";

/// The `pre-bootstrap` hook's file. Not a link to the binary, as the other hooks are: the agent
/// runs this one itself (agent/job_runner.go, executePreBootstrapHook), and a file without a
/// `#!` line goes to bash there (internal/shell/shell.go, Script); with one, the kernel runs
/// the binary it names with the file's path.
pub fn pre_bootstrap_hook(bin: &Path) -> String {
    // The second line is for an agent given a `hooks-shell`, which hands the file to that shell
    // instead (internal/shell/shell.go): the shell skips the first line as a comment, and
    // without the second it would run nothing and accept every job.
    let binary = bin.join("kernelkite-isolate");
    format!(
        "#!{binary} pre-bootstrap\nexec '{binary}' pre-bootstrap \"$0\"\n# kernelkite's pre-bootstrap hook (installed by `kernelkite-isolate setup`): refuses a job whose\n# variables steer the root bootstrap or the hooks, or whose signed step was signed for another\n# build or queue (plugin/README.md, \"Node set-up\"). Executed, the kernel runs the first line;\n# given to a shell, the second.\n",
        binary = binary.display()
    )
}

/// The plugin's hook files name the binary at the default prefix on their first line (a
/// shebang cannot search): with another prefix, that path leads to this one.
fn link_plugin_hook_binary(bin: &Path, dirs: &mut Vec<Dir>, files: &mut Vec<File>) {
    let plugin_bin = Path::new(kernelkite_sys::node::plugin_hook_binary());
    if plugin_bin != bin.join("kernelkite-isolate") {
        for path in [
            PathBuf::from(DEFAULT_PREFIX),
            PathBuf::from(DEFAULT_PREFIX).join("bin"),
        ] {
            dirs.push(Dir { path, mode: 0o755 });
        }
        files.push(File {
            path: plugin_bin.to_path_buf(),
            mode: 0o777,
            content: Content::Link(bin.join("kernelkite-isolate")),
        });
    }
}

/// cgroup v1: the favordynmods mount that makes moving a job's command into its cgroup fast,
/// where the kernel has it, and a note either way.
fn cgroup_v1_migrations(
    facts: &Facts,
    opts: &Options,
    files: &mut Vec<File>,
    units: &mut Vec<String>,
    notes: &mut Vec<String>,
) {
    let kernel = facts
        .kernel_release
        .as_deref()
        .unwrap_or("of unknown version");
    if favordynmods_supported(facts) {
        files.push(File {
            path: unit_path(FAVORDYNMODS_UNIT),
            mode: 0o644,
            content: Content::Text(favordynmods_unit(&opts.node)),
        });
        units.push(FAVORDYNMODS_UNIT.to_string());
        notes.push(format!("cgroup v1: moving each job's command into its cgroup would wait for an RCU grace period (~10 ms); {FAVORDYNMODS_UNIT} mounts an empty cgroup hierarchy with `favordynmods` (Linux {kernel} has it), which makes those moves fast for every hierarchy. cgroup v2 needs none of this: boot with systemd.unified_cgroup_hierarchy=1 to switch."));
    } else {
        notes.push(format!("cgroup v1 on Linux {kernel}, which has no `favordynmods` (Linux 6.0+): moving each job's command into its cgroup waits for an RCU grace period (~10 ms). Boot with systemd.unified_cgroup_hierarchy=1 (cgroup v2) or a 6.0+ kernel to avoid it."));
    }
}

/// The groups the job user joins to open the GPUs' device nodes, with a note for each node
/// whose group it cannot join.
fn job_user_groups(facts: &Facts, notes: &mut Vec<String>) -> Vec<String> {
    let mut job_user_groups: Vec<String> = Vec::new();
    for owner in &facts.device_owners {
        match (&owner.group, owner.gid) {
            (_, 0) => notes.push(format!("{} belongs to group root, so {JOB_USER} cannot open it: fix the udev rules (ROCm's give /dev/kfd and /dev/dri/renderD* to the render group) and rerun setup", owner.device.display())),
            (Some(g), _) => {
                if !job_user_groups.contains(g) {
                    job_user_groups.push(g.clone());
                }
            }
            (None, gid) => notes.push(format!("{} belongs to group id {gid}, which /etc/group does not name: {JOB_USER} is not added to it", owner.device.display())),
        }
    }
    job_user_groups
}

/// One line saying what the node gets.
fn summary(plan: &Plan, facts: &Facts, opts: &Options) -> String {
    let gpus: usize = plan.slices.iter().map(|s| s.gpus().len()).sum();
    let vendors: Vec<String> = {
        let mut v: Vec<String> = plan
            .slices
            .iter()
            .flat_map(Slice::gpus)
            .map(|g| g.vendor.to_string())
            .collect();
        v.sort();
        v.dedup();
        v
    };
    let what = if gpus == 0 {
        "CPU-only".to_string()
    } else {
        format!("{gpus} {} GPU(s)", vendors.join("+"))
    };
    let layout = match opts.agents {
        AgentLayout::PerSlice => format!("{} agent(s), one per slice", plan.slices.len()),
        AgentLayout::Pool => format!("1 pool agent with {} worker(s)", plan.slices.len()),
    };
    let multi = match &opts.multi_gpu {
        Some(m) => format!(
            "; {} agent(s) of {} GPUs on queue {:?}",
            m.groups.len(),
            m.groups.first().map_or(0, Vec::len),
            m.queue
        ),
        None => String::new(),
    };
    format!(
        "node {}: {} slice(s), {what}, cgroup v{}; {layout}, queue {:?}{multi}",
        opts.node,
        plan.slices.len(),
        facts.cgroup_version,
        opts.queue
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(plugin_location: &str, job_env: &[&str]) -> Options {
        Options {
            prefix: DEFAULT_PREFIX.into(),
            binaries_from: "/tmp/release".into(),
            optional_binaries: Vec::new(),
            queue: "h100".into(),
            node: "dgx01".into(),
            agents: AgentLayout::PerSlice,
            job_config: r#"{"mode":"host"}"#.into(),
            buildkite_agent: DEFAULT_BUILDKITE_AGENT.into(),
            token: None,
            plugin_location: plugin_location.into(),
            job_env: job_env.iter().map(|s| s.to_string()).collect(),
            verification_jwks: None,
            multi_gpu: None,
        }
    }

    /// The patterns as the agent's configuration holds them, for the default location.
    #[test]
    fn the_agents_patterns_are_anchored_and_literal() {
        assert_eq!(
            allowed_plugins(DEFAULT_PLUGIN_LOCATION),
            r"^github\.com/kernelkite/kernelkite/plugin#v[0-9]+(\.[0-9]+)*(-[0-9A-Za-z.]+)?$"
        );
        assert_eq!(
            allowed_repositories(DEFAULT_PLUGIN_LOCATION),
            r"^(https://github\.com/|git@github\.com:|ssh://git@github\.com/)kernelkite/kernelkite(\.git)?$"
        );
        assert_eq!(
            allowed_environment_variables(&[]),
            ["^KERNELBOT_[A-Za-z0-9_]*$", "^KERNELKITE_SUBMISSION_ID$"]
        );
        assert_eq!(
            allowed_environment_variables(&[
                "HF_TOKEN".into(),
                "POPCORN_*".into(),
                "HF_TOKEN".into()
            ]),
            [
                "^KERNELBOT_[A-Za-z0-9_]*$",
                "^KERNELKITE_SUBMISSION_ID$",
                "^HF_TOKEN$",
                "^POPCORN_[A-Za-z0-9_]*$"
            ]
        );
        // Another place: its dots escaped, its repository the first three segments.
        assert_eq!(
            allowed_plugins("github.com/acme.gpu/kk-fork/tools/plugin"),
            r"^github\.com/acme\.gpu/kk-fork/tools/plugin#v[0-9]+(\.[0-9]+)*(-[0-9A-Za-z.]+)?$"
        );
        assert_eq!(
            allowed_repositories("github.com/acme.gpu/kk-fork/tools/plugin"),
            r"^(https://github\.com/|git@github\.com:|ssh://git@github\.com/)acme\.gpu/kk-fork(\.git)?$"
        );
    }

    /// The public half of `buildkite-agent tool keygen --alg EdDSA --key-id kk` (its shape).
    const PUBLIC_JWKS: &str = r#"{"keys":[{"alg":"EdDSA","crv":"Ed25519","kid":"kk","kty":"OKP","use":"sig","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"}]}"#;

    /// Issue 36: MIG devices get new uuids at every boot; on a node whose plan has MIG slices
    /// the agents' unit refreshes the plan before the agent starts (after the units that make
    /// MIG devices), and nowhere else.
    #[test]
    fn a_mig_node_s_agents_take_the_boot_s_mig_uuids_before_any_job() {
        use kernelkite_topology::plan::{MigInstance, SliceGpu, Vendor};
        let gpu = |mig: Option<MigInstance>| SliceGpu {
            vendor: Vendor::Nvidia,
            pci_bus_id: "0000:18:00.0".into(),
            uuid: Some("GPU-0".into()),
            numa_node: Some(0),
            mig,
        };
        let mut plan = Plan {
            slices: vec![Slice {
                index: 0,
                gpu: Some(gpu(None)),
                extra_gpus: vec![],
                cpus: vec![1],
                mems: vec![0],
                memory_bytes: 1 << 30,
            }],
            reserved_cpus: vec![0],
            warnings: vec![],
        };
        let facts = Facts {
            cgroup_version: 2,
            kernel_release: Some("6.8.0".into()),
            total_memory_bytes: 4 << 30,
            job_user_exists: true,
            job_user_groups: vec![],
            device_owners: vec![],
        };
        let opts = options(DEFAULT_PLUGIN_LOCATION, &[]);
        let whole = agent_unit(&plan, &facts, &opts);
        assert!(
            !whole.contains("ExecStartPre") && !whole.contains("mig-manager"),
            "{whole}"
        );
        plan.slices[0].gpu = Some(gpu(Some(MigInstance {
            uuid: "MIG-0".into(),
            gpu_instance_id: 3,
            compute_instance_id: 0,
            memory_bytes: 20 << 30,
        })));
        let mig = agent_unit(&plan, &facts, &opts);
        assert!(
            mig.contains(&format!(
                "\nExecStartPre={}/bin/kernelkite-isolate plan --refresh {PLAN_FILE}\n",
                DEFAULT_PREFIX
            )) && mig.contains("After=nvidia-persistenced.service nvidia-mig-manager.service"),
            "{mig}"
        );
    }

    /// Issue 34, item 9: given the pipeline agent's public key, every agent verifies signed
    /// steps and refuses the rest (`block`); the key is installed readable, and only a public
    /// key set the agent accepts is taken.
    #[test]
    fn agents_verify_signed_steps_with_the_public_key_given() {
        let plan = Plan {
            slices: vec![Slice {
                index: 0,
                gpu: None,
                extra_gpus: vec![],
                cpus: vec![1],
                mems: vec![0],
                memory_bytes: 1 << 30,
            }],
            reserved_cpus: vec![0],
            warnings: vec![],
        };
        let facts = Facts {
            cgroup_version: 2,
            kernel_release: Some("6.8.0".into()),
            total_memory_bytes: 4 << 30,
            job_user_exists: true,
            job_user_groups: vec![],
            device_owners: vec![],
        };
        let mut opts = options(DEFAULT_PLUGIN_LOCATION, &[]);
        let without = render(&plan, &facts, &opts).unwrap();
        assert!(without
            .notes
            .iter()
            .any(|n| n.contains("verify no pipeline signature")));
        opts.verification_jwks = Some(PUBLIC_JWKS.into());
        let with = render(&plan, &facts, &opts).unwrap();
        let key = with
            .files
            .iter()
            .find(|f| f.path == Path::new(VERIFICATION_JWKS))
            .expect("the key is installed");
        assert_eq!(key.mode, 0o644);
        assert_eq!(key.content, Content::Text(PUBLIC_JWKS.into()));
        let agent = &with.agents[0];
        let (cfg, _) = agent_config(&plan, &opts, agent);
        assert!(
            cfg.contains(&format!(
                "\nverification-jwks-file=\"{VERIFICATION_JWKS}\"\n"
            )),
            "{cfg}"
        );
        assert!(
            cfg.contains("\nverification-failure-behavior=block\n"),
            "{cfg}"
        );
        assert!(!with
            .notes
            .iter()
            .any(|n| n.contains("verify no pipeline signature")));
        assert!(agent_env(&plan, &opts).contains("\nKERNELKITE_SIGNED_STEPS=on\n"));
        assert!(!agent_env(&plan, &options(DEFAULT_PLUGIN_LOCATION, &[])).contains("SIGNED_STEPS"));
        let hook = with
            .files
            .iter()
            .find(|f| f.path == Path::new(HOOKS_DIR).join(PRE_BOOTSTRAP_HOOK))
            .expect("the pre-bootstrap hook is installed");
        assert_eq!(hook.mode, 0o755);
        match &hook.content {
            Content::Text(t) => assert!(
                t.starts_with("#!/opt/kernelkite/bin/kernelkite-isolate pre-bootstrap\n"),
                "{t}"
            ),
            other => panic!("{other:?}"),
        }
        // What the agent would refuse at start, or a private key, is refused here.
        let private = PUBLIC_JWKS.replace(r#""use":"sig""#, r#""use":"sig","d":"secret""#);
        for (bad, says) in [
            ("not json", "not JSON"),
            (r#"{"keys":[]}"#, "empty"),
            (&PUBLIC_JWKS.replace("EdDSA", "HS256"), "HS256"),
            (&PUBLIC_JWKS.replace(r#""kid":"kk","#, ""), "no `kid`"),
            (&private, "private key"),
        ] {
            let e = check_verification_jwks(bad).unwrap_err().to_string();
            assert!(
                e.contains(says) && e.contains("--verification-jwks"),
                "{bad}: {e}"
            );
        }
    }

    /// The agent reads its configuration file (cliconfig/file.go) `key=value` a line, a value
    /// in double quotes taken as it is (a `#` in it included), a list split at commas: so no
    /// pattern may hold a comma, a double quote, or `\n` (which it turns into a newline).
    #[test]
    fn the_lockdown_reads_back_as_the_agent_reads_its_configuration() {
        let text = agent_lockdown(&options(DEFAULT_PLUGIN_LOCATION, &["HF_TOKEN"]));
        let settings: Vec<(&str, &str)> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| l.split_once('=').unwrap())
            .collect();
        assert_eq!(
            settings,
            [
                ("no-local-hooks", "true"),
                ("no-plugins", "false"),
                (
                    "allowed-plugins",
                    r#""^github\.com/kernelkite/kernelkite/plugin#v[0-9]+(\.[0-9]+)*(-[0-9A-Za-z.]+)?$""#
                ),
                ("no-command-eval", "true"),
                ("strict-single-hooks", "true"),
                (
                    "allowed-repositories",
                    r#""^(https://github\.com/|git@github\.com:|ssh://git@github\.com/)kernelkite/kernelkite(\.git)?$""#
                ),
                ("enable-environment-variable-allowlist", "true"),
                (
                    "allowed-environment-variables",
                    r#""^KERNELBOT_[A-Za-z0-9_]*$,^KERNELKITE_SUBMISSION_ID$,^HF_TOKEN$""#
                ),
                ("no-plugin-validation", "true"),
                ("plugins-always-clone-fresh", "false"),
                ("cancel-grace-period", "30"),
            ]
        );
        for pattern in [
            allowed_plugins(DEFAULT_PLUGIN_LOCATION),
            allowed_repositories(DEFAULT_PLUGIN_LOCATION),
        ]
        .into_iter()
        .chain(allowed_environment_variables(&["HF_TOKEN".into()]))
        {
            assert!(
                !pattern.contains([',', '"', '\'']) && !pattern.contains(r"\n"),
                "{pattern}"
            );
            assert!(
                pattern.starts_with('^') && pattern.ends_with('$'),
                "{pattern}"
            );
        }
    }

    /// The agent matches each plugin as go-pipeline's `Plugin.FullSource()` writes it: a
    /// location of three or more segments as the step names it, a short one expanded
    /// (`docker#v5.0.0` is github.com/buildkite-plugins/docker-buildkite-plugin#v5.0.0).
    /// Go's regexp and this crate share the syntax the pattern uses, and `is_match` finds a
    /// match anywhere as Go's `MatchString` does.
    #[test]
    fn only_the_kernelkite_plugin_at_a_version_is_allowed() {
        let allowed = regex::Regex::new(&allowed_plugins(DEFAULT_PLUGIN_LOCATION)).unwrap();
        for yes in [
            "github.com/kernelkite/kernelkite/plugin#v0.1.0",
            "github.com/kernelkite/kernelkite/plugin#v1",
            "github.com/kernelkite/kernelkite/plugin#v1.0",
            "github.com/kernelkite/kernelkite/plugin#v12.3.4-rc.1",
        ] {
            assert!(allowed.is_match(yes), "{yes} refused");
        }
        for no in [
            "github.com/evil/kernelkite-plugin#v1",
            "github.com/evil/kernelkite/plugin#v1",
            "github.com/kernelkite-evil/kernelkite/plugin#v1",
            "github.com/kernelkite/kernelkite-evil/plugin#v1",
            "github.com/kernelkite/kernelkite/plugin-evil#v1",
            "github.com/kernelkite/kernelkite/plugin/evil#v1",
            "github.com/kernelkite/kernelkite/evil/plugin#v1",
            "github.comXkernelkite/kernelkite/plugin#v1",
            "evil.example/github.com/kernelkite/kernelkite/plugin#v1",
            "https://github.com/kernelkite/kernelkite/plugin#v1",
            "ssh://git@evil.example/github.com/kernelkite/kernelkite/plugin#v1",
            // docker#v5.0.0 and buildkite-plugins/docker#v5 as the agent matches them.
            "github.com/buildkite-plugins/docker-buildkite-plugin#v5.0.0",
            "github.com/buildkite-plugins/docker-buildkite-plugin#v5",
            "docker#v5.0.0",
            // No version, a branch, a commit, anything after the version.
            "github.com/kernelkite/kernelkite/plugin",
            "github.com/kernelkite/kernelkite/plugin#main",
            "github.com/kernelkite/kernelkite/plugin#0123456789abcdef0123456789abcdef01234567",
            "github.com/kernelkite/kernelkite/plugin#v1/../../evil",
            "github.com/kernelkite/kernelkite/plugin#v1 ",
            "github.com/kernelkite/kernelkite/plugin#v1\n",
            "github.com/kernelkite/kernelkite/plugin#v1\ngithub.com/evil/x#v1",
            // A plugin vendored in the checkout.
            "./.buildkite/plugins/kernelkite",
            "/var/lib/kernelkite/plugins/x",
        ] {
            assert!(!allowed.is_match(no), "{no:?} allowed");
        }
    }

    #[test]
    fn only_the_plugins_repository_is_checked_out() {
        let allowed = regex::Regex::new(&allowed_repositories(DEFAULT_PLUGIN_LOCATION)).unwrap();
        for yes in [
            "https://github.com/kernelkite/kernelkite.git",
            "https://github.com/kernelkite/kernelkite",
            "git@github.com:kernelkite/kernelkite.git",
            "ssh://git@github.com/kernelkite/kernelkite.git",
        ] {
            assert!(allowed.is_match(yes), "{yes} refused");
        }
        for no in [
            "https://github.com/evil/kernelkite.git",
            "https://github.com/kernelkite/kernelkite-evil.git",
            "https://github.com/kernelkite/kernelkite.git/evil",
            "https://evil.example/kernelkite/kernelkite.git",
            "https://github.com.evil.example/kernelkite/kernelkite.git",
            "git@github.com:evil/kernelkite.git",
            "file:///srv/kernelkite/kernelkite.git",
            "",
        ] {
            assert!(!allowed.is_match(no), "{no:?} allowed");
        }
    }

    #[test]
    fn only_buildkites_and_kernelbots_job_variables_are_accepted() {
        let allowed: Vec<regex::Regex> = allowed_environment_variables(&["HF_TOKEN".into()])
            .iter()
            .map(|p| regex::Regex::new(p).unwrap())
            .collect();
        let accepted = |name: &str| allowed.iter().any(|r| r.is_match(name));
        for yes in [
            "KERNELBOT_PAYLOAD",
            "KERNELBOT_PAYLOAD_CHUNKS",
            "KERNELBOT_PAYLOAD_0",
            "KERNELBOT_PAYLOAD_SHA256",
            "KERNELBOT_RUN_ID",
            "KERNELBOT_QUEUE",
            "KERNELKITE_SUBMISSION_ID",
            "HF_TOKEN",
        ] {
            assert!(accepted(yes), "{yes} refused");
        }
        for no in [
            "LD_PRELOAD",
            "BASH_ENV",
            "PATH",
            "GIT_SSH_COMMAND",
            "GIT_CONFIG_COUNT",
            "KERNELKITE_CONFIG",
            "KERNELKITE_CGROUP_ROOT",
            "KERNELKITE_SYSFS_ROOT",
            "XKERNELBOT_PAYLOAD",
            "HF_TOKEN_2",
        ] {
            assert!(!accepted(no), "{no} accepted");
        }
    }

    #[test]
    fn plugin_locations_and_job_variables_are_checked() {
        for ok in [
            DEFAULT_PLUGIN_LOCATION,
            "github.com/acme/kernelkite-fork/plugin",
            "github.com/acme/kernelkite-buildkite-plugin",
        ] {
            check_plugin_location(ok).unwrap();
        }
        for bad in [
            "",
            "github.com/kernelkite",
            "github.com/kernelkite/kernelkite/plugin#v0.1.0",
            "https://github.com/kernelkite/kernelkite/plugin",
            "gitlab.com/kernelkite/kernelkite/plugin",
            "github.com/kernelkite/kernelkite/plugin/",
            "github.com/kernelkite/../plugin",
            "github.com/kernel kite/kernelkite/plugin",
            "github.com/kernelkite/kernelkite/(plugin|.*)",
            "github.com/kernelkite/kernelkite,.*/plugin",
        ] {
            let err = check_plugin_location(bad).unwrap_err().to_string();
            assert!(err.contains("--plugin-location"), "{bad}: {err}");
        }
        for ok in ["HF_TOKEN", "POPCORN_*", "_X", "MY_APP_*"] {
            check_job_env(ok).unwrap();
        }
        for bad in [
            "",
            "*",
            "1X",
            "HF-TOKEN",
            "A*B",
            "A,B",
            "^X$",
            "LD_PRELOAD",
            "LD_*",
            "L*",
            "GIT_SSH_COMMAND",
            "PATH",
            "PA*",
            "BASH_ENV",
            "ENV",
            "KERNELKITE_CGROUP_ROOT",
            "KERNELKITE_*",
            "KERNEL*",
        ] {
            let err = check_job_env(bad).unwrap_err().to_string();
            assert!(err.contains("--allow-job-env"), "{bad}: {err}");
        }
    }
}
