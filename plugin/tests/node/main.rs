//! The node tools and the files around them: `setup`, the smoke job, `plan`, `doctor`, the
//! static build, the deployment files, `plugin.yml` and the repository's lints.

#[path = "../agent/mod.rs"]
mod agent;
#[path = "../common/systemd.rs"]
mod systemd;
use agent::common;

mod deployment;
mod layout;
mod lint;
mod plan_cli;
mod plan_prototype;
mod plugin_schema;
mod setup_cli;
mod setup_smoke;
mod static_build;
