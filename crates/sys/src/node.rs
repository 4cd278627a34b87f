//! A GPU node's layout facts that the hooks, node set-up and local mode all need: one home,
//! imported everywhere (the service, which does not link the plugin, included).

/// The hooks' run dir (GPU leases, the lease queue, job state), shared by every agent of a
/// node; `KERNELKITE_RUN_DIR` overrides it.
pub const RUN_DIR: &str = "/run/kernelkite";

/// The unprivileged account host mode runs a job's command as unless the step names another
/// (the plugin's `user`): a system user without a login shell or home, made by
/// `kernelkite-isolate setup` (or `useradd --system`).
pub const JOB_USER: &str = "kernelkite-job";
