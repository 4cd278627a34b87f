//! Where setup puts things on the node. Fixed paths (except the binaries' prefix), so the
//! hooks, the deployment guide and a second run of setup all agree on them.

/// Configuration: plan, agent environment, agent configurations, agent-level hooks.
pub const ETC_DIR: &str = "/etc/kernelkite";
/// The node's plan, read by the hooks (`KERNELKITE_PLAN_FILE`).
pub const PLAN_FILE: &str = "/etc/kernelkite/plan.json";
/// The agents' `hooks-path`: `environment`, `command`, `pre-exit` linked to the binary.
pub const HOOKS_DIR: &str = "/etc/kernelkite/hooks";
/// One Buildkite agent configuration per agent (`<instance>.cfg`); they hold the token.
pub const AGENTS_DIR: &str = "/etc/kernelkite/agents";
/// The environment of every agent, its hooks and jobs (systemd `EnvironmentFile=`).
pub const AGENT_ENV: &str = "/etc/kernelkite/agent.env";
/// The public JWKS the agents verify every job's signed step with (`--verification-jwks`).
pub const VERIFICATION_JWKS: &str = "/etc/kernelkite/pipeline-verification.jwks";
/// State: the agents' checkouts and plugins, setup's manifest; the agents' `HOME`.
pub const STATE_DIR: &str = "/var/lib/kernelkite";
/// The agents' `build-path`.
pub const BUILD_DIR: &str = "/var/lib/kernelkite/builds";
/// The agents' `plugins-path`.
pub const PLUGINS_DIR: &str = "/var/lib/kernelkite/plugins";
/// What setup wrote and changed, for the next run and `--uninstall`.
pub const MANIFEST: &str = "/var/lib/kernelkite/setup-manifest.json";
/// Where the systemd units go.
pub const UNIT_DIR: &str = "/etc/systemd/system";
/// The slice every agent runs in.
pub const SLICE_UNIT: &str = "kernelkite.slice";
/// The agents' template unit; instances are named after the agents (`gpu0`, `pool`).
pub const AGENT_UNIT: &str = "kernelkite-agent@.service";
/// cgroup v1 only: the mount that turns on `favordynmods`.
pub const FAVORDYNMODS_UNIT: &str = "run-kernelkite-favordynmods.mount";
/// Where [`FAVORDYNMODS_UNIT`] mounts its (empty) hierarchy; the unit's name is this path.
pub const FAVORDYNMODS_DIR: &str = "/run/kernelkite/favordynmods";
/// The node's layout facts the hooks share (run dir, job user, binaries' prefix):
/// `kernelkite_sys::node`, their one home.
pub use kernelkite_sys::node::{DEFAULT_PREFIX, JOB_USER, RUN_DIR};
/// The package path of `buildkite-agent` (Debian/Ubuntu and RPM packages).
pub const DEFAULT_BUILDKITE_AGENT: &str = "/usr/bin/buildkite-agent";
/// The hooks the agent-level hooks-path holds, each a link to `kernelkite-isolate`.
pub const HOOKS: &[&str] = kernelkite_sys::node::HOOK_NAMES;
/// The binaries setup installs, from `--from` (or beside the running binary).
pub const BINARIES: &[&str] = &[
    kernelkite_sys::node::ISOLATE_BINARY,
    kernelkite_sys::node::RUNNER_BINARY,
];
/// Binaries setup installs when `--from` holds them: the dynamically linked build a static
/// `kernelkite-isolate` hands hooks that need NVML to ([`kernelkite_hooks::delegate`]).
pub const OPTIONAL_BINARIES: &[&str] = &[kernelkite_sys::node::NVML_BUILD_BINARY];
/// What a file replaced with `--replace` is renamed to (and restored from by `--uninstall`).
pub const BACKUP_SUFFIX: &str = ".kernelkite-orig";
/// Where the documentation of setup lives, for the units' `Documentation=`.
pub const DOCS_URL: &str =
    "https://github.com/kernelkite/kernelkite/blob/main/deployment/README.md";
