//! kernelkite-admin: a GPU node's administration. `setup` takes a bare node to serving jobs
//! (binaries, plan, job user, agents, units, hooks), `doctor` checks the machine, the smoke
//! job runs one job per slice through the installed hooks, and `plan` / `fixture` show and
//! fake a node's slices.
//!
//! It runs when an operator does, never per job: it builds on `kernelkite-hooks` (the hooks it
//! installs and checks) and must not be needed by it.
#![deny(missing_docs)]

pub mod cli;
pub mod doctor;
pub mod setup;
