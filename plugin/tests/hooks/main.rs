//! The hooks as the agent runs them, on fake cgroup trees and fake devices: no root needed.
//! One test binary (modules named as the suites were), so the plugin's tests link a few times.

#[path = "../agent/mod.rs"]
mod agent;

mod hooks_agent;
mod hooks_cgroup_fake;
mod hooks_concurrency;
mod hooks_config;
mod hooks_docker;
