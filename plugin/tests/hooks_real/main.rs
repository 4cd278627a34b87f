//! The hooks against the real kernel: real cgroups (v1, v2, whichever the hooks pick) and the
//! real sandbox, as root. Skipped, with the reason, where cgroups are not writable. One binary
//! so they share one run dir, as every agent on a node does (`real_cgroups::shared_run_dir`).

#[path = "../agent/mod.rs"]
mod agent;
#[path = "../common/real_cgroups.rs"]
mod real_cgroups;

mod hooks_cgroup_real;
mod hooks_cgroup_real_v1;
mod hooks_cgroup_real_v2;
mod hooks_sandbox_real;
