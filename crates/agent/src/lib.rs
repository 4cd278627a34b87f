//! The Buildkite agent as kernelkite plays it where no agent runs: local mode's jobs
//! (`kernelkite-service local`), `setup`'s smoke job and the plugin's test harness. One home for
//! what the agent gives a job: its variables ([`job_env`]), a plugin's variables
//! ([`plugins`]) and the Job API the hooks talk to ([`job_api`]); the order the agent runs the
//! hooks in is `kernelkite_sys::node::HOOK_NAMES`. Each fact is taken from the real agent's
//! source (v3.137.0, cited where it is used) and `tests/tests/real_agent.rs` checks them
//! against the real agent.

#![deny(missing_docs)]

pub mod job_api;
pub mod job_env;
pub mod plugins;
