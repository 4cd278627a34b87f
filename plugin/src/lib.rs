//! kernelkite-isolate: the one binary of the plugin. It composes the hooks
//! (`kernelkite-hooks`: what runs per job) and the node tools (`kernelkite-admin`: setup,
//! doctor, smoke, plan, fixtures) under one command line, so one file serves as the plugin's
//! hook interpreter, the agent-level hooks and the operator's tool.
//!
//! The node's topology and the pure planner live in `kernelkite-topology`; the node's layout
//! facts in `kernelkite_sys::node`.
#![deny(missing_docs)]

pub mod cli;
