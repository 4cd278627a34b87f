//! Why a hook failed, with its cause kept for the chain the CLI prints.

use std::path::PathBuf;

use kernelkite_topology::planner::PlanError;
use kernelkite_topology::topology::TopologyError;

use crate::cgroup::CgroupError;
use crate::config::ConfigError;
use crate::gpucheck::GpuCheckError;
use crate::jobapi::JobApiError;
use crate::lease::LeaseError;
use crate::sandbox::user::UserError;

/// Why a hook could not do its part. Each message says what to change; the underlying error,
/// where there is one, is the [`source`](std::error::Error::source) (printed after a `: ` by
/// the CLI, and by [`Chain`]).
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The node's runner is not the version the job's step expects.
    #[error("this node runs kernelkite-runner {here}, and the job expects {expected}: the node is refused for this job (upgrade it with `kernelkite-isolate setup`, or set the service's KERNELKITE_RUNNER_VERSION to the fleet's runner)")]
    OutdatedRunner {
        /// The node's runner's version.
        here: String,
        /// The version the job expects.
        expected: String,
    },
    /// The node's runner cannot say its version.
    #[error("cannot tell the version of the node's runner {path} ({why}); reinstall it with `kernelkite-isolate setup`, or set KERNELKITE_RUNNER_BINARY to it")]
    RunnerVersion {
        /// The runner asked.
        path: PathBuf,
        /// What went wrong.
        why: String,
    },
    /// The step's configuration does not match the schema.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A variable the agent sets for every job is missing.
    #[error("{name} is not set; this hook must be run by the Buildkite agent for a job")]
    MissingEnv {
        /// The variable.
        name: &'static str,
    },
    /// The agent's GPU binding (tag or name) is not a list of distinct indices.
    #[error("{name}={value:?} is not a list of distinct GPU indices like \"3\" or \"2,3\"; fix the agent's tags or name")]
    BadGpuIndex {
        /// Where the binding came from.
        name: &'static str,
        /// What it said.
        value: String,
    },
    /// The plan file cannot be read.
    #[error("cannot read the plan {path} (regenerate it with `kernelkite-isolate plan --json > {path}`)")]
    PlanRead {
        /// `KERNELKITE_PLAN_FILE`.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The plan file is not a plan.
    #[error("the plan {path} is not a kernelkite plan (regenerate it with `kernelkite-isolate plan --json > {path}`)")]
    PlanParse {
        /// `KERNELKITE_PLAN_FILE`.
        path: PathBuf,
        /// Where the JSON goes wrong.
        #[source]
        source: serde_json::Error,
    },
    /// The node's topology cannot be read (no plan file).
    #[error("cannot plan this node (write a plan file with `kernelkite-isolate plan` and set KERNELKITE_PLAN_FILE)")]
    Topology(#[source] TopologyError),
    /// The planner cannot cut the node into slices (no plan file).
    #[error("cannot plan this node (write a plan file with `kernelkite-isolate plan` and set KERNELKITE_PLAN_FILE)")]
    Plan(#[source] PlanError),
    /// The plan holds none of the job's slices.
    #[error("the node's plan has no slices; regenerate it with `kernelkite-isolate plan --json` and check its warnings")]
    EmptyPlan,
    /// The agent is bound to a GPU the plan does not have.
    #[error("the agent is bound to GPU(s) {bound:?} but the node's plan has no slice for GPU {missing}; check the agent's gpu-index tag against `kernelkite-isolate plan`")]
    NoSuchSlice {
        /// The agent's GPUs.
        bound: Vec<u32>,
        /// The first one the plan lacks.
        missing: u32,
    },
    /// The agent's binding and the step's `gpus` disagree.
    #[error("the agent is bound to {bound} GPU(s) but the step asks for `gpus: {wanted}`; run it on a pool agent or tag the agent gpu-index with {wanted} indices")]
    GpuCountMismatch {
        /// GPUs the agent is bound to.
        bound: usize,
        /// `gpus` of the step.
        wanted: u32,
    },
    /// A setting asks for more than the slice has.
    #[error("`{key}: {asked}` is more than the job's slice has ({has}); it can only lower the slice's share")]
    OverSlice {
        /// The configuration key.
        key: &'static str,
        /// Its value.
        asked: String,
        /// What the slice has.
        has: String,
    },
    /// The job would get several slices of which one is a MIG device.
    #[error("the job would get {slices} slices, and slice {mig} is a MIG device: CUDA shows a process one MIG device only, so a MIG slice is a job of one GPU — bind this agent to one slice (gpu-index=N) and use `gpus: 1`")]
    MigInGroup {
        /// How many slices were leased.
        slices: usize,
        /// The MIG slice among them.
        mig: u32,
    },
    /// The job would get GPUs of more than one vendor.
    #[error("the job would get slices {slices}: a job's GPUs must all be one vendor's, since CUDA and ROCm each see only their own; tag the agent gpu-index with one vendor's slices (`kernelkite-isolate plan` lists them)")]
    MixedVendors {
        /// Each slice with its vendor and bus id.
        slices: String,
    },
    /// The pool has no vendor with as many GPU slices as the step asks for.
    #[error("the step asks for gpus: {wanted} but no vendor has {wanted} GPU slices on this node ({have}{}): a job's GPUs must all be one vendor's, since CUDA and ROCm each see only their own; lower gpus or run the step on a node with more", if *.mig > 0 { format!("; {} MIG device slice(s) are jobs of one GPU", .mig) } else { String::new() })]
    NoVendorHasEnough {
        /// `gpus` of the step.
        wanted: u32,
        /// The slices each vendor has (`nvidia 2, amd 2`).
        have: String,
        /// MIG slices left out.
        mig: usize,
    },
    /// A MIG slice whose MIG device is not on the node now (its instance is gone).
    #[error("slice {slice}'s MIG device {uuid} (GPU instance {gi}, compute instance {ci} of GPU {bus}) is not on this node now: MIG devices do not survive a reboot, and `nvidia-smi mig` may have removed it; the job was not started. Make the MIG layout the plan was made for again, then run `sudo kernelkite-isolate plan --refresh {plan}` (the agents' unit runs it when they start); if the layout changed, run `sudo kernelkite-isolate setup` again")]
    MigGone {
        /// The slice.
        slice: u32,
        /// The MIG device's uuid in the plan.
        uuid: String,
        /// Its GPU instance.
        gi: u32,
        /// Its compute instance.
        ci: u32,
        /// The parent GPU.
        bus: String,
        /// The plan file.
        plan: String,
    },
    /// The plan names MIG devices and was written before this boot: their uuids are stale.
    #[error("the plan {plan} was written before this boot, and MIG devices get new uuids at every boot, so slice {slice}'s CUDA_VISIBLE_DEVICES={uuid} would name a device that is gone; the job was not started. Run `sudo kernelkite-isolate plan --refresh {plan}` (the agents' unit runs it when they start: `sudo systemctl restart 'kernelkite-agent@*'`)")]
    PlanPredatesBoot {
        /// The slice.
        slice: u32,
        /// The MIG device's uuid in the plan.
        uuid: String,
        /// The plan file.
        plan: String,
    },
    /// No GPU could be leased.
    #[error(transparent)]
    Lease(#[from] LeaseError),
    /// The job's cgroup could not be made, found or used.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// A GPU check (idle, clocks) failed or the driver is missing.
    #[error(transparent)]
    Gpu(#[from] GpuCheckError),
    /// A later hook found no state: `environment` did not run for this job.
    #[error("no state for job {job_id} in {dir}: the plugin's `environment` hook did not run for this job (is the plugin or agent hook installed on every hook?)")]
    NoState {
        /// The job.
        job_id: String,
        /// Where its state would be.
        dir: PathBuf,
    },
    /// The job's state file exists but cannot be read.
    #[error("cannot read the job state {path}")]
    StateRead {
        /// The state file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The job's state file is not state this version writes.
    #[error("the job state {path} is not valid (written by another version?); `pre-exit` removes it with the job's cgroup and leases")]
    StateParse {
        /// The state file.
        path: PathBuf,
        /// Where the JSON goes wrong.
        #[source]
        source: serde_json::Error,
    },
    /// The job's state could not be written.
    #[error("cannot write the job state {path}; the run dir (KERNELKITE_RUN_DIR) must be writable by the hooks")]
    StateWrite {
        /// The state file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The job's state could not be removed.
    #[error("cannot remove the job state {path}")]
    StateRemove {
        /// The state file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The process standing for the job cannot be found.
    #[error("cannot find the job's process (KERNELKITE_JOB_PID or the agent's bootstrap); leases need it to know when the job is gone")]
    NoAnchor,
    /// A program could not be started.
    #[error("cannot start {what}")]
    Spawn {
        /// The program, and what to check.
        what: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The command was started but could not be waited for.
    #[error("cannot wait for the command")]
    Wait(#[source] std::io::Error),
    /// A binary `environment` hook without the agent's Job API.
    #[error("BUILDKITE_AGENT_JOB_API_SOCKET is not set: the agent's Job API is off (agent < 3.64 or --no-job-api?); use the plugin's shell hooks instead")]
    NoJobApi,
    /// The Job API socket without its token.
    #[error("BUILDKITE_AGENT_JOB_API_TOKEN is not set; the agent sets it with BUILDKITE_AGENT_JOB_API_SOCKET for each job")]
    NoJobApiToken,
    /// The Job API refused or failed the export.
    #[error("cannot export the job's slice through the Job API")]
    Export(#[source] JobApiError),
    /// The job user cannot be used.
    #[error(transparent)]
    User(#[from] UserError),
    /// The step would run its command as root without saying so.
    #[error("the command would run as root ({user}); untrusted code must not: name an unprivileged `user`, or set `allow-root: true` if this step is trusted")]
    RootRefused {
        /// The `user` option as given.
        user: String,
    },
    /// The sandbox needs root and the hooks do not have it.
    #[error("the sandbox needs root (new mount namespaces, switching to the job user) and the hooks run as uid {uid}; run the agent as root, or set KERNELKITE_SANDBOX=off on this node to run commands as the agent's user without it")]
    SandboxNeedsRoot {
        /// The hooks' uid.
        uid: u32,
    },
    /// The sandbox could not be set up for the command.
    #[error("cannot start the command in its sandbox: {0}")]
    Sandbox(String),
    /// Another kernelkite instance runs jobs on this node with another run dir.
    #[error("job cgroup(s) {} hold running processes but have no state in {}: another kernelkite instance with another run dir (KERNELKITE_RUN_DIR) is running jobs on this node, and either would take the other's jobs for lost ones and kill them; every agent and local service on a node must use one run dir (stop the other instance, or point both at the same run dir)", .jobs.iter().map(|j| format!("kernelkite/{j}")).collect::<Vec<_>>().join(", "), .run_dir.display())]
    ForeignJobs {
        /// The job cgroups.
        jobs: Vec<String>,
        /// This instance's run dir.
        run_dir: PathBuf,
    },
    /// The checkout path is not under the agent's build path: the agent computes it there,
    /// so a job (its build's env) chose it.
    #[error("the checkout path {path:?} (BUILDKITE_BUILD_CHECKOUT_PATH) is not a directory under the agent's build path {build_path:?}: the job's variables chose it, and the hooks would hand it to the job's user; refused")]
    CheckoutOutside {
        /// The checkout path the job has.
        path: String,
        /// The agent's build path.
        build_path: String,
    },
    /// The checkout could not change hands.
    #[error("cannot give the checkout {path} to uid {uid}")]
    Checkout {
        /// The checkout.
        path: PathBuf,
        /// The new owner.
        uid: u32,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// An error and its causes on one line: `kernelkite_sys::error`, shared with the service.
pub use kernelkite_sys::error::Chain;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chain_shows_the_cause_after_the_advice() {
        let e = JobError::StateRead {
            path: "/run/kernelkite/jobs/j.json".into(),
            source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        };
        assert_eq!(
            Chain(&e).to_string(),
            "cannot read the job state /run/kernelkite/jobs/j.json: permission denied"
        );
        // Transparent variants add no link of their own.
        let e = JobError::from(crate::config::parse_config("{").unwrap_err());
        let text = Chain(&e).to_string();
        assert!(
            text.starts_with("plugin configuration is invalid: (root): not valid JSON: EOF"),
            "{text}"
        );
    }
}
