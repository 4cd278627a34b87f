//! kernelkite-isolate: per-GPU slices of a node, and the Buildkite hooks that hold each job to one.
//!
//! The node's topology and the pure planner live in `kernelkite-topology`; this crate holds
//! what enforces a slice on a job (leases, cgroups, docker, the hooks) and the command line.
//! The layers that touch the machine take injected roots so they can be tested on fake trees.
#![deny(missing_docs)]

pub mod cgroup;
pub mod cli;
pub mod config;
pub mod confine;
pub mod delegate;
pub mod docker;
pub mod doctor;
pub mod gpucheck;
pub mod images;
pub mod job;
pub mod jobapi;
pub mod joblog;
pub mod lease;
pub mod mountinfo;
pub mod process;
pub mod sandbox;
pub mod setup;
