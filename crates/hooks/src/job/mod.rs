//! One Buildkite job's life on the node: what the `environment`, `command` and `pre-exit`
//! hooks do, independent of how they were invoked (the plugin's hook files, agent-level links, the local executor).
//!
//! State passes between the hooks of a job in `<run dir>/jobs/<job id>.json` ([`state`]).
//! Every step that touches the machine is undone by [`cleanup::clean_job`], which `pre-exit`
//! runs for its own job and `environment` runs for jobs whose process is gone (agent lost
//! mid-run) and for its own preparation when a later step of it fails.
//!
//! | module | what |
//! |---|---|
//! | [`environment`] | the `environment` hook and the undo of a failed one |
//! | [`command`] | the `command` hook: the step's command in the job's cgroup or container |
//! | [`pre_exit`] | the `pre-exit` hook |
//! | [`cleanup`] | undoing a job: its own, and lost jobs' |
//! | [`state`] | the state file between the hooks, written atomically |
//! | [`mod@env`] | what the agent's variables say: job id, configuration, GPU binding, Job API |
//! | [`mod@slice`] | the node's plan and the job's slice of it |
//! | [`devices`] | host GPU numbers, and the device nodes of other jobs' GPUs |
//! | [`exports`] | the variables the job sees, and the `export` lines for shell hooks |
//! | [`error`] | [`JobError`] |
//! | [`settings`] | [`Settings`]: where things are on the node |
//! | [`version`] | the runner version a job expects, and the pause of a node that runs another |

pub mod cleanup;
pub mod command;
pub mod devices;
pub mod env;
pub mod environment;
pub mod error;
pub mod exports;
pub mod mig;
pub mod pre_exit;
pub mod settings;
pub mod slice;
pub mod state;
#[cfg(test)]
pub(crate) mod test_support;
pub mod version;

pub use cleanup::CleanupReport;
pub use command::CommandOutcome;
pub use environment::Prepared;
pub use error::JobError;
pub use settings::{GpuOpener, Settings};
pub use state::JobState;
