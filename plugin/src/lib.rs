//! kernelkite-isolate: per-GPU slices of a node, and the Buildkite hooks that hold each job to one.
//!
//! The pure parts ([`topology`] values, the [`planner`]) never touch the machine; the thin
//! layers that do take injected roots so they can be tested on fake trees.

pub mod cgroup;
pub mod cli;
pub mod config;
pub mod confine;
pub mod docker;
pub mod doctor;
pub mod fakesys;
pub mod gpucheck;
pub mod job;
pub mod jobapi;
pub mod lease;
pub mod mountinfo;
pub mod plan;
pub mod planner;
pub mod process;
pub mod topology;
