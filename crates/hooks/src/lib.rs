//! kernelkite-hooks: what runs three times per job. The `environment`, `command` and
//! `pre-exit` hooks lease a job's GPU(s), check them, hold the job to its slice (cgroups, the
//! sandbox or a container, the Job API's exports) and undo all of it afterwards.
//!
//! This crate is the part to audit for isolation: it runs as root on every job and touches
//! the kernel. Node administration (`setup`, `doctor`, the smoke job) lives in
//! `kernelkite-admin`, which builds on this crate and never the other way round; the node's
//! layout facts (run dir, job user, hook names, binary paths) are `kernelkite_sys::node`'s.
//! The layers that touch the machine take injected roots so they can be tested on fake trees.
#![deny(missing_docs)]

pub mod admission;
pub mod cgroup;
pub mod cli;
pub mod config;
pub mod confine;
pub mod delegate;
pub mod docker;
pub mod gpucheck;
pub mod images;
pub mod job;
pub mod jobapi;
pub mod joblog;
pub mod lease;
pub mod mountinfo;
pub mod process;
pub mod sandbox;
pub mod uplink;
