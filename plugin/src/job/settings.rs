//! Where things are on the node, and how the hooks reach the GPU driver.

use std::path::PathBuf;

use crate::gpucheck::{GpuCheckError, GpuControl};

/// Where things are on this node; every root is injectable for tests.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Leases and job state (`/run/kernelkite`).
    pub run_dir: PathBuf,
    /// Root of the sysfs/procfs tree planned when there is no plan file (`/`).
    pub sysfs_root: PathBuf,
    /// Plan written by node set-up; faster than planning in every job.
    pub plan_file: Option<PathBuf>,
    /// Root under which `proc/self/mountinfo` and the cgroup mounts are found (`/`).
    pub cgroup_root: PathBuf,
    /// procfs used to judge whether a job's process is alive (`/proc`).
    pub proc_root: PathBuf,
    /// The docker CLI.
    pub docker: PathBuf,
    /// The process standing for the job; found from the process tree when `None`.
    pub job_pid: Option<u32>,
    /// Host mode runs the command in the sandbox (as the job user, in private namespaces);
    /// off, it runs as the agent's user with the agent's view of the machine.
    pub sandbox: bool,
    /// Where the GPU device nodes the sandbox binds are found (`/dev`).
    pub dev_root: PathBuf,
    /// Further paths the sandbox hides from the job.
    pub hide: Vec<PathBuf>,
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
        }
    }
}

impl Settings {
    /// The GPU leases of this node.
    pub(crate) fn leases(&self) -> crate::lease::Leases {
        crate::lease::Leases::new(&self.run_dir, &self.proc_root)
    }
}

/// A factory for the GPU driver interface (NVML in production, a double in tests). Called only
/// when a job needs the driver, so a node without one runs every job that does not.
pub type GpuOpener<'a> = &'a mut dyn FnMut() -> Result<Box<dyn GpuControl>, GpuCheckError>;
