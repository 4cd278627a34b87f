//! A GPU node's layout facts that the hooks, node set-up and local mode all need: one home,
//! imported everywhere (the service, which does not link the plugin, included).

/// The hooks' run dir (GPU leases, the lease queue, job state), shared by every agent of a
/// node; `KERNELKITE_RUN_DIR` overrides it.
pub const RUN_DIR: &str = "/run/kernelkite";

/// The unprivileged account host mode runs a job's command as unless the step names another
/// (the plugin's `user`): a system user without a login shell or home, made by
/// `kernelkite-isolate setup` (or `useradd --system`).
pub const JOB_USER: &str = "kernelkite-job";

/// Where `kernelkite-isolate setup` installs the binaries by default
/// (`<prefix>/bin/kernelkite-isolate`, `kernelkite-runner`); the plugin's hook files name
/// [`plugin_hook_binary`], under this prefix, on their first line.
pub const DEFAULT_PREFIX: &str = "/opt/kernelkite";

/// The hooks' and node tools' binary: the plugin's hook interpreter, the agent-level hooks
/// (links named after [`HOOK_NAMES`]) and the operator's tool.
pub const ISOLATE_BINARY: &str = "kernelkite-isolate";

/// kernelbot's run config in, its `result.json` out: the command a job runs.
pub const RUNNER_BINARY: &str = "kernelkite-runner";

/// The one `KERNELKITE_*` variable a job carries: the submission's id, which the service puts
/// in each build's env. Every other `KERNELKITE_*` name is a setting of the node's hooks,
/// which only the agent's environment gives (setup's allow-list and the pre-bootstrap hook
/// refuse it from a job).
pub const SUBMISSION_ID_ENV: &str = "KERNELKITE_SUBMISSION_ID";

/// The exit status that says "this node could not do the job; another may": the runner's
/// infrastructure failure, and the `environment` hook's refusal of a job on a node whose
/// runner is not the version the job expects. The deployment's pipelines retry it
/// (`retry.automatic` with `exit_status: 3`), and Buildkite sends the retry to another agent
/// when this one paused itself.
pub const EXIT_NODE_FAULT: u8 = 3;

/// The variable of a job's step that names the runner version the node must run
/// (`deployment/pipelines/*.yml` sign it into the step from the pipeline agent's own
/// `KERNELKITE_RUNNER_VERSION`). The `environment` hook compares it with the node's runner and
/// refuses the job on another one.
pub const EXPECTED_RUNNER_ENV: &str = "KERNELBOT_SIGNED_RUNNER_VERSION";

/// The dynamically linked build of [`ISOLATE_BINARY`], installed beside the static one, that
/// a static hook hands the work to when it needs NVML (which a static binary cannot load).
pub const NVML_BUILD_BINARY: &str = "kernelkite-isolate-nvml";

/// The `environment` hook: lease, check, cgroup, export the slice.
pub const ENVIRONMENT_HOOK: &str = "environment";
/// The `command` hook: run the step's command held to the slice.
pub const COMMAND_HOOK: &str = "command";
/// The `pre-exit` hook: kill leftovers, remove the cgroup, release the lease(s).
pub const PRE_EXIT_HOOK: &str = "pre-exit";
/// The hooks, in the order the agent runs them: the names the binary answers to when linked
/// under that name, and the agent-level hooks-path's links.
pub const HOOK_NAMES: &[&str] = &[ENVIRONMENT_HOOK, COMMAND_HOOK, PRE_EXIT_HOOK];

/// The subcommand the plugin's hook files name on their first line.
pub const PLUGIN_HOOK: &str = "plugin-hook";

/// The first line of each of the plugin's `hooks/*` files: [`plugin_hook_binary`] and
/// [`PLUGIN_HOOK`]. Not a shell, so the agent executes the file rather than sourcing it in its
/// wrapper. A literal, because the plugin's files hold it verbatim (a test composes it).
pub const PLUGIN_HOOK_SHEBANG: &str = "#!/opt/kernelkite/bin/kernelkite-isolate plugin-hook";

/// The binary [`PLUGIN_HOOK_SHEBANG`] names: where the plugin's hook files need it.
pub fn plugin_hook_binary() -> &'static str {
    PLUGIN_HOOK_SHEBANG
        .strip_prefix("#!")
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_default()
}

/// Under the run dir: one state file per job in flight (`<job>.json`), read by `pre-exit`
/// and by the next job's clean-up of lost jobs.
pub const JOB_STATE_DIR: &str = "jobs";

/// Under the run dir: one lease file per GPU, and the lease queue (`queue/`, `queue.lock`).
pub const LEASE_DIR: &str = "leases";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugin_s_shebang_names_the_installed_binary_and_the_hook_subcommand() {
        assert_eq!(
            PLUGIN_HOOK_SHEBANG,
            format!("#!{} {PLUGIN_HOOK}", plugin_hook_binary())
        );
        assert_eq!(
            plugin_hook_binary(),
            format!("{DEFAULT_PREFIX}/bin/{ISOLATE_BINARY}")
        );
    }
}
