//! Where things are on the node, and how the hooks reach the GPU driver.

use std::path::PathBuf;

use crate::gpucheck::{GpuCheckError, GpuControl};

/// Where things are on this node; every root is injectable for tests. Also the hooks'
/// command-line arguments (flags and `KERNELKITE_*` variables), so the two cannot drift.
#[derive(Debug, Clone, clap::Args)]
pub struct Settings {
    /// Directory for GPU leases and job state, shared by every agent on the node.
    #[arg(long, env = "KERNELKITE_RUN_DIR", default_value = kernelkite_sys::node::RUN_DIR)]
    pub run_dir: PathBuf,
    /// Plan written by node set-up (`kernelkite-isolate plan --json`); without it every job
    /// plans the node from sysfs.
    #[arg(long, env = "KERNELKITE_PLAN_FILE")]
    pub plan_file: Option<PathBuf>,
    /// Root of the sysfs/procfs tree to plan from (a fake tree in tests).
    #[arg(long, env = "KERNELKITE_SYSFS_ROOT", default_value = "/")]
    pub sysfs_root: PathBuf,
    /// Root holding `proc/self/mountinfo` and the cgroup mounts (a fake tree in tests).
    #[arg(long, env = "KERNELKITE_CGROUP_ROOT", default_value = "/")]
    pub cgroup_root: PathBuf,
    /// procfs used to tell whether a lease holder is still alive.
    #[arg(long, env = "KERNELKITE_PROC_ROOT", default_value = "/proc")]
    pub proc_root: PathBuf,
    /// The docker CLI (docker mode).
    #[arg(long, env = "KERNELKITE_DOCKER", default_value = "docker")]
    pub docker: PathBuf,
    /// Process that lives as long as the job; default: the agent's bootstrap process found
    /// among the hook's ancestors, else the hook's parent.
    #[arg(long, env = "KERNELKITE_JOB_PID")]
    pub job_pid: Option<u32>,
    /// Host mode runs the step's command in the sandbox: as the job user (plugin option
    /// `user`), without capabilities, in private mount and IPC namespaces (needs root). `off`
    /// runs it as the agent's user with the agent's view of the machine (a warning says so).
    #[arg(long, env = "KERNELKITE_SANDBOX", default_value = "on", value_name = "SANDBOX", action = clap::ArgAction::Set,
          value_parser = on_off())]
    pub sandbox: bool,
    /// Directory holding the GPU device nodes the sandbox binds into the job's `/dev`.
    #[arg(long, env = "KERNELKITE_DEV_ROOT", default_value = "/dev")]
    pub dev_root: PathBuf,
    /// Further paths the sandbox hides from the job (`:`-separated; directories get an empty
    /// read-only tmpfs, files `/dev/null`).
    #[arg(long, env = "KERNELKITE_HIDE", value_delimiter = ':')]
    pub hide: Vec<PathBuf>,
    /// IPv4 ranges (`ADDRESS[/PREFIX]`, `,`-separated) a job with `network: true` may reach
    /// though private or the node's own network (a package mirror on the LAN); everything
    /// else of the kind stays closed (plugin/README.md, "What `network: true` reaches").
    #[arg(long, env = "KERNELKITE_JOB_NETWORK_ALLOW", value_delimiter = ',')]
    pub job_network_allow: Vec<String>,
    /// Files the sandbox binds read-only into every job at their own path (`:`-separated):
    /// a runner binary that lies where the job user cannot reach it (under `/tmp`, `/var/tmp`
    /// or a home directory; local mode names its runner here). A directory on the way the job
    /// user may not search is covered by an empty one holding only the file.
    #[arg(long = "job-tool", env = "KERNELKITE_JOB_TOOLS", value_delimiter = ':')]
    pub job_tools: Vec<PathBuf>,
    /// The node's runner, whose version a job that names one (its step's
    /// `KERNELBOT_SIGNED_RUNNER_VERSION`) is checked against; default: `kernelkite-runner`
    /// beside this binary, where setup installs both.
    #[arg(long = "runner-binary", env = "KERNELKITE_RUNNER_BINARY")]
    pub runner: Option<PathBuf>,
}

/// `on` / `off`, as the hooks' switches are written in the agent's environment.
fn on_off() -> impl clap::builder::TypedValueParser<Value = bool> {
    use clap::builder::PossibleValue;
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new([
        PossibleValue::new("on").help("Enabled"),
        PossibleValue::new("off").help("Disabled"),
    ])
    .map(|v| v == "on")
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            run_dir: kernelkite_sys::node::RUN_DIR.into(),
            sysfs_root: "/".into(),
            plan_file: None,
            cgroup_root: "/".into(),
            proc_root: "/proc".into(),
            docker: "docker".into(),
            job_pid: None,
            sandbox: true,
            dev_root: "/dev".into(),
            hide: Vec::new(),
            job_network_allow: Vec::new(),
            job_tools: Vec::new(),
            runner: None,
        }
    }
}

impl Settings {
    /// Drops what an empty variable gave (`KERNELKITE_PLAN_FILE=`, `KERNELKITE_HIDE=a::b`):
    /// an empty path means "none", as the agent's environment files write unset values.
    pub fn without_empty(mut self) -> Self {
        self.plan_file = self.plan_file.filter(|p| !p.as_os_str().is_empty());
        self.hide.retain(|p| !p.as_os_str().is_empty());
        self.job_network_allow.retain(|r| !r.trim().is_empty());
        self.job_tools.retain(|p| !p.as_os_str().is_empty());
        self.runner = self.runner.filter(|p| !p.as_os_str().is_empty());
        self
    }

    /// The GPU leases of this node.
    pub(crate) fn leases(&self) -> crate::lease::Leases {
        crate::lease::Leases::new(&self.run_dir, &self.proc_root)
    }
}

/// A factory for the GPU driver interface (NVML in production, a double in tests). Called only
/// when a job needs the driver, so a node without one runs every job that does not.
pub type GpuOpener<'a> = &'a mut dyn FnMut() -> Result<Box<dyn GpuControl>, GpuCheckError>;

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Args {
        #[command(flatten)]
        settings: Settings,
    }

    #[test]
    fn the_hooks_arguments_parse_into_settings_and_empty_values_mean_none() {
        let mut s = Args::try_parse_from([
            "hook",
            "--sandbox",
            "off",
            "--hide",
            "/a:/b",
            "--job-network-allow",
            "10.20.0.0/16,,192.0.2.7",
        ])
        .unwrap()
        .settings;
        // What an environment file's `KERNELKITE_PLAN_FILE=` may leave.
        s.plan_file = Some(PathBuf::new());
        s.hide.insert(1, PathBuf::new());
        let s = s.without_empty();
        assert!(!s.sandbox);
        assert_eq!(s.plan_file, None);
        assert_eq!(s.hide, [PathBuf::from("/a"), PathBuf::from("/b")]);
        assert_eq!(s.job_network_allow, ["10.20.0.0/16", "192.0.2.7"]);
        let on = Args::try_parse_from(["hook", "--sandbox", "on"]).unwrap();
        assert!(on.settings.sandbox);
        let bad = Args::try_parse_from(["hook", "--sandbox", "maybe"])
            .err()
            .unwrap();
        assert!(
            bad.to_string().contains("possible values: on, off"),
            "{bad}"
        );
        // Without flags (and where the environment does not set them), the defaults are
        // `Settings::default()`'s: the two cannot drift apart.
        let plain = Args::try_parse_from(["hook"]).unwrap().settings;
        let default = Settings::default();
        for (var, parsed, expected) in [
            ("KERNELKITE_RUN_DIR", &plain.run_dir, &default.run_dir),
            (
                "KERNELKITE_SYSFS_ROOT",
                &plain.sysfs_root,
                &default.sysfs_root,
            ),
            (
                "KERNELKITE_CGROUP_ROOT",
                &plain.cgroup_root,
                &default.cgroup_root,
            ),
            ("KERNELKITE_PROC_ROOT", &plain.proc_root, &default.proc_root),
            ("KERNELKITE_DOCKER", &plain.docker, &default.docker),
            ("KERNELKITE_DEV_ROOT", &plain.dev_root, &default.dev_root),
        ] {
            if std::env::var_os(var).is_none() {
                assert_eq!(parsed, expected, "{var}");
            }
        }
        if std::env::var_os("KERNELKITE_SANDBOX").is_none() {
            assert_eq!(plain.sandbox, default.sandbox);
        }
    }
}
