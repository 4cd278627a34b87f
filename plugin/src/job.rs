//! One Buildkite job's life on the node: what the `environment`, `command` and `pre-exit`
//! hooks do, independent of how they were invoked (plugin shim, agent-level binary hook).
//!
//! State passes between the hooks of a job in `<run dir>/jobs/<job id>.json` ([`JobState`]).
//! Every step that touches the machine is undone by [`clean_job`], which `pre-exit` runs for
//! its own job and `environment` runs for jobs whose process is gone (agent lost mid-run).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::cgroup::{CgroupError, Cgroups, CharDevice, Limits};
use crate::config::{self, ConfigError, LockClocks, Mode, PluginConfig};
use crate::confine::{self, Confinement};
use crate::docker;
use crate::gpucheck::{self, GpuCheckError, GpuControl};
use crate::lease::{Holder, LeaseError, Leases, Want};
use crate::process::{self, ProcessId};
use kernelkite_topology::cpulist::format_cpu_list;
use kernelkite_topology::plan::{Plan, Slice, SliceGpu, Vendor};

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
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            run_dir: "/run/kernelkite".into(),
            sysfs_root: "/".into(),
            plan_file: None,
            cgroup_root: "/".into(),
            proc_root: "/proc".into(),
            docker: "docker".into(),
            job_pid: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{name} is not set; this hook must be run by the Buildkite agent for a job")]
    MissingEnv { name: &'static str },
    #[error("{name}={value:?} is not a list of distinct GPU indices like \"3\" or \"2,3\"; fix the agent's tags or name")]
    BadGpuIndex { name: &'static str, value: String },
    #[error("cannot read the plan {path}: {reason}; regenerate it with `kernelkite-isolate plan --json > {path}`")]
    PlanFile { path: PathBuf, reason: String },
    #[error("cannot plan this node: {0}; write a plan file with `kernelkite-isolate plan` and set KERNELKITE_PLAN_FILE")]
    Plan(String),
    #[error("the agent is bound to GPU(s) {bound:?} but the node's plan has no slice for GPU {missing}; check the agent's gpu-index tag against `kernelkite-isolate plan`")]
    NoSuchSlice { bound: Vec<u32>, missing: u32 },
    #[error("the agent is bound to {bound} GPU(s) but the step asks for `gpus: {wanted}`; run it on a pool agent or tag the agent gpu-index with {wanted} indices")]
    GpuCountMismatch { bound: usize, wanted: u32 },
    #[error("`{key}: {asked}` is more than the job's slice has ({has}); it can only lower the slice's share")]
    OverSlice {
        key: &'static str,
        asked: String,
        has: String,
    },
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Gpu(#[from] GpuCheckError),
    #[error("no state for job {job_id} in {dir}: the plugin's `environment` hook did not run for this job (is the plugin or agent hook installed on every hook?)")]
    NoState { job_id: String, dir: PathBuf },
    #[error("job state {path}: {reason}")]
    State { path: PathBuf, reason: String },
    #[error("cannot find the job's process (KERNELKITE_JOB_PID or the agent's bootstrap); leases need it to know when the job is gone")]
    NoAnchor,
    #[error("cannot start {what}: {error}")]
    Spawn { what: String, error: std::io::Error },
}

/// What `environment` leaves for the job's later hooks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobState {
    pub job_id: String,
    pub agent: String,
    pub anchor: ProcessId,
    /// Leased GPU indices (slice numbers), ascending.
    pub gpus: Vec<u32>,
    /// Host device numbers of the job's GPUs (see [`device_indices`]); empty in state
    /// written by an older version, where the slice numbers stand in.
    #[serde(default)]
    pub device_indices: Vec<u32>,
    /// The job's slice (several planned slices merged when `gpus > 1`).
    pub slice: Slice,
    pub config: PluginConfig,
    /// cgroup version holding the job, `None` when running unenforced (or docker mode).
    pub cgroup_version: Option<u8>,
    /// Clocks were locked and must be reset.
    pub clocks_locked: bool,
    /// Variables exported to the job.
    pub exports: BTreeMap<String, String>,
}

/// The result of the `environment` hook.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub state: JobState,
    /// Lines for the job log (orphans cleaned, unenforced warnings, ...).
    pub notices: Vec<String>,
}

/// What `pre-exit` (or orphan clean-up) did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CleanupReport {
    pub job_id: String,
    pub killed: Vec<u32>,
    pub cgroup_removed: bool,
    pub released: Vec<u32>,
    pub clocks_reset: bool,
    pub container_removed: bool,
    pub problems: Vec<String>,
}

impl CleanupReport {
    /// One line for the job log.
    pub fn summary(&self) -> String {
        let mut parts = Vec::new();
        if !self.killed.is_empty() {
            let pids: Vec<String> = self.killed.iter().map(u32::to_string).collect();
            parts.push(format!(
                "killed {} leftover process(es): {}",
                self.killed.len(),
                pids.join(", ")
            ));
        }
        if self.cgroup_removed {
            parts.push("removed the job cgroup".into());
        }
        if !self.released.is_empty() {
            parts.push(format!("released GPU lease(s) {:?}", self.released));
        }
        if self.clocks_reset {
            parts.push("reset GPU clocks".into());
        }
        if self.container_removed {
            parts.push("removed the job's container".into());
        }
        for p in &self.problems {
            parts.push(format!("PROBLEM: {p}"));
        }
        if parts.is_empty() {
            parts.push("nothing to clean up".into());
        }
        format!("job {}: {}", self.job_id, parts.join("; "))
    }
}

/// A factory for the GPU driver interface (NVML in production, a double in tests).
pub type GpuOpener<'a> = &'a mut dyn FnMut() -> Result<Box<dyn GpuControl>, GpuCheckError>;

fn var<'e>(env: &'e BTreeMap<String, String>, name: &'static str) -> Result<&'e str, JobError> {
    env.get(name)
        .map(String::as_str)
        .filter(|v| !v.is_empty())
        .ok_or(JobError::MissingEnv { name })
}

/// The configuration for this hook: the plugin's (`BUILDKITE_PLUGIN_CONFIGURATION`) when run
/// as a plugin, else `KERNELKITE_CONFIG` from the agent's environment (agent-level hooks).
pub fn job_config(env: &BTreeMap<String, String>) -> Result<PluginConfig, ConfigError> {
    let text = env
        .get("BUILDKITE_PLUGIN_CONFIGURATION")
        .or_else(|| env.get("KERNELKITE_CONFIG"))
        .map(String::as_str)
        .unwrap_or("");
    config::parse_config(text)
}

fn parse_index_list(name: &'static str, value: &str) -> Result<Vec<u32>, JobError> {
    let bad = || JobError::BadGpuIndex {
        name,
        value: value.to_string(),
    };
    let list: Vec<u32> = value
        .split(',')
        .map(|p| p.trim().parse::<u32>().map_err(|_| bad()))
        .collect::<Result<_, _>>()?;
    // "3,3" would pass the `gpus: 2` check with one GPU, and merging its slice twice would
    // double the memory limit past the node's share.
    let mut seen = list.clone();
    seen.sort_unstable();
    seen.dedup();
    if list.is_empty() || seen.len() != list.len() {
        return Err(bad());
    }
    Ok(list)
}

/// The GPU(s) the agent is bound to: tag `gpu-index=N` (or `N,M`), else a name ending in
/// `-gpu<N>` (agents started with `--name host-gpu%spawn`); `None` for pool agents.
pub fn agent_gpus(env: &BTreeMap<String, String>) -> Result<Option<Vec<u32>>, JobError> {
    if let Some(v) = env
        .get("BUILDKITE_AGENT_META_DATA_GPU_INDEX")
        .filter(|v| !v.trim().is_empty())
    {
        return parse_index_list("BUILDKITE_AGENT_META_DATA_GPU_INDEX", v).map(Some);
    }
    let name = env
        .get("BUILDKITE_AGENT_NAME")
        .map(String::as_str)
        .unwrap_or("");
    if let Some(pos) = name.rfind("-gpu") {
        let digits = &name[pos + 4..];
        if !digits.is_empty() && digits.chars().all(|c| c.is_ascii_digit()) {
            return parse_index_list("BUILDKITE_AGENT_NAME", digits).map(Some);
        }
    }
    Ok(None)
}

/// The node's plan: the plan file when configured, else planned now from sysfs with the
/// default policy (every job plans the same way, so slices never overlap).
pub fn node_plan(settings: &Settings) -> Result<Plan, JobError> {
    if let Some(path) = &settings.plan_file {
        let text = std::fs::read_to_string(path).map_err(|e| JobError::PlanFile {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        return serde_json::from_str(&text).map_err(|e| JobError::PlanFile {
            path: path.clone(),
            reason: e.to_string(),
        });
    }
    let topo = kernelkite_topology::topology::Topology::discover(&settings.sysfs_root)
        .map_err(|e| JobError::Plan(e.to_string()))?;
    kernelkite_topology::planner::plan(&topo, &kernelkite_topology::planner::Policy::default())
        .map_err(|e| JobError::Plan(e.to_string()))
}

/// Merges the planned slices of the leased GPUs into the job's slice.
pub fn merge_slices(slices: &[&Slice]) -> Option<Slice> {
    let first = slices.first()?;
    let mut gpus: Vec<SliceGpu> = Vec::new();
    let mut cpus = Vec::new();
    let mut mems = Vec::new();
    let mut memory = 0u64;
    for s in slices {
        gpus.extend(s.gpu.iter().cloned());
        gpus.extend(s.extra_gpus.iter().cloned());
        cpus.extend(&s.cpus);
        mems.extend(&s.mems);
        memory = memory.saturating_add(s.memory_bytes);
    }
    cpus.sort_unstable();
    cpus.dedup();
    mems.sort_unstable();
    mems.dedup();
    let mut gpus = gpus.into_iter();
    Some(Slice {
        index: first.index,
        gpu: gpus.next(),
        extra_gpus: gpus.collect(),
        cpus,
        mems,
        memory_bytes: memory,
    })
}

/// Keeps `want` CPUs of `cpus`, whole cores first (SMT siblings grouped by the sysfs
/// topology under `sysfs_root`), rounding up to a whole core.
pub fn narrow_cpus(cpus: &[u32], want: usize, sysfs_root: &Path) -> Vec<u32> {
    let core_of = |cpu: u32| -> Option<(String, String)> {
        let dir = sysfs_root.join(format!("sys/devices/system/cpu/cpu{cpu}/topology"));
        let pkg = std::fs::read_to_string(dir.join("physical_package_id")).ok()?;
        let core = std::fs::read_to_string(dir.join("core_id")).ok()?;
        Some((pkg.trim().to_string(), core.trim().to_string()))
    };
    // (package, core) → CPUs, in first-seen order.
    type CoreKey = Option<(String, String)>;
    let mut groups: Vec<(CoreKey, Vec<u32>)> = Vec::new();
    for &cpu in cpus {
        let key = core_of(cpu);
        match groups.iter_mut().find(|(k, _)| key.is_some() && *k == key) {
            Some((_, members)) => members.push(cpu),
            None => groups.push((key, vec![cpu])),
        }
    }
    let mut out = Vec::new();
    for (_, members) in groups {
        if out.len() >= want {
            break;
        }
        out.extend(members);
    }
    out.sort_unstable();
    out
}

/// Character devices of the node's GPUs outside `mine`, from the driver's files under
/// `sysfs_root`: NVIDIA `/dev/nvidia<minor>` (major 195, minor from
/// `/proc/driver/nvidia/gpus/<bdf>/information`), AMD `/dev/dri/{card,renderD}<n>` (major 226).
/// GPUs whose numbers cannot be read are skipped.
pub fn other_gpu_devices(sysfs_root: &Path, plan: &Plan, mine: &Slice) -> Vec<CharDevice> {
    let mine: Vec<&str> = docker::slice_gpus(mine)
        .iter()
        .map(|g| g.pci_bus_id.as_str())
        .collect();
    let mut out = Vec::new();
    for s in &plan.slices {
        for g in docker::slice_gpus(s) {
            if mine.contains(&g.pci_bus_id.as_str()) {
                continue;
            }
            match g.vendor {
                Vendor::Nvidia => {
                    let info = sysfs_root
                        .join("proc/driver/nvidia/gpus")
                        .join(&g.pci_bus_id)
                        .join("information");
                    let minor = std::fs::read_to_string(info).ok().and_then(|t| {
                        t.lines()
                            .find_map(|l| l.strip_prefix("Device Minor:")?.trim().parse().ok())
                    });
                    if let Some(minor) = minor {
                        out.push(CharDevice { major: 195, minor });
                    }
                }
                Vendor::Amd => {
                    let drm = sysfs_root
                        .join("sys/bus/pci/devices")
                        .join(&g.pci_bus_id)
                        .join("drm");
                    for e in std::fs::read_dir(drm).into_iter().flatten().flatten() {
                        let name = e.file_name().to_string_lossy().into_owned();
                        let n = name
                            .strip_prefix("renderD")
                            .or_else(|| name.strip_prefix("card"))
                            .and_then(|n| n.parse().ok());
                        if let Some(minor) = n {
                            out.push(CharDevice { major: 226, minor });
                        }
                    }
                }
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Host device numbers of a slice's GPUs: each GPU's position among the plan's GPUs of its
/// vendor in PCI bus order, the numbering nvidia-smi, `docker --gpus device=N`, CUDA (with
/// `CUDA_DEVICE_ORDER=PCI_BUS_ID`) and ROCm use. Not the slice number: with several GPUs per
/// slice, or NVIDIA and AMD GPUs on one node, the two differ.
pub fn device_indices(plan: &Plan, slice: &Slice) -> Vec<u32> {
    let mut by_vendor: BTreeMap<Vendor, Vec<&str>> = BTreeMap::new();
    for g in plan.slices.iter().flat_map(docker::slice_gpus) {
        by_vendor
            .entry(g.vendor)
            .or_default()
            .push(g.pci_bus_id.as_str());
    }
    for ids in by_vendor.values_mut() {
        ids.sort_unstable();
        ids.dedup();
    }
    docker::slice_gpus(slice)
        .iter()
        .map(|g| {
            by_vendor
                .get(&g.vendor)
                .and_then(|ids| ids.iter().position(|id| *id == g.pci_bus_id))
                .map_or(slice.index, |i| i as u32)
        })
        .collect()
}

/// The variables exported to the job for its slice and host GPU indices.
pub fn exports_for(slice: &Slice, indices: &[u32]) -> BTreeMap<String, String> {
    let mut env = docker::visible_devices_env(&docker::slice_gpus(slice), indices);
    // The NVIDIA container runtime reads the same list under its own name.
    if let Some(ids) = env.get("CUDA_VISIBLE_DEVICES").cloned() {
        env.insert("NVIDIA_VISIBLE_DEVICES".into(), ids);
    }
    env.insert("KERNELBOT_GPU_INDEX".into(), docker::index_list(indices));
    env.insert("KERNELBOT_CPUSET".into(), format_cpu_list(&slice.cpus));
    env.insert("KERNELBOT_MEMORY".into(), docker_memory(slice.memory_bytes));
    env.insert(
        "KERNELKITE_SLICE".into(),
        serde_json::to_string(slice).unwrap_or_default(),
    );
    env
}

/// A memory size the way the prototype exported it and `docker run --memory` reads it:
/// `64g`, else `512m`, else bytes.
pub fn docker_memory(bytes: u64) -> String {
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    if bytes > 0 && bytes.is_multiple_of(GIB) {
        format!("{}g", bytes / GIB)
    } else if bytes > 0 && bytes.is_multiple_of(MIB) {
        format!("{}m", bytes / MIB)
    } else {
        bytes.to_string()
    }
}

/// Single-quotes a value for `export K='v'` in bash.
pub fn shell_quote(v: &str) -> String {
    format!("'{}'", v.replace('\'', r"'\''"))
}

/// `export` lines for the sourced shell hook.
pub fn export_lines(env: &BTreeMap<String, String>) -> String {
    env.iter()
        .map(|(k, v)| format!("export {k}={}\n", shell_quote(v)))
        .collect()
}

fn jobs_dir(settings: &Settings) -> PathBuf {
    settings.run_dir.join("jobs")
}

fn state_path(settings: &Settings, job_id: &str) -> Result<PathBuf, JobError> {
    let name = crate::cgroup::job_cgroup_name(job_id)?;
    Ok(jobs_dir(settings).join(format!("{name}.json")))
}

/// Reads a job's state; `None` when there is none.
pub fn read_state(settings: &Settings, job_id: &str) -> Result<Option<JobState>, JobError> {
    let path = state_path(settings, job_id)?;
    match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| JobError::State {
                path,
                reason: e.to_string(),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(JobError::State {
            path,
            reason: e.to_string(),
        }),
    }
}

fn write_state(settings: &Settings, state: &JobState) -> Result<(), JobError> {
    let path = state_path(settings, &state.job_id)?;
    let err = |e: std::io::Error| JobError::State {
        path: path.clone(),
        reason: e.to_string(),
    };
    std::fs::create_dir_all(jobs_dir(settings)).map_err(err)?;
    let tmp = path.with_extension(format!("json.{}", std::process::id()));
    let text = serde_json::to_string(state).map_err(|e| err(std::io::Error::other(e)))?;
    std::fs::write(&tmp, text).map_err(err)?;
    std::fs::rename(&tmp, &path).map_err(err)
}

fn leases(settings: &Settings) -> Leases {
    Leases::new(&settings.run_dir, &settings.proc_root)
}

/// Undoes everything a job did to the node; idempotent, keeps going past failures and
/// reports them. Works from the state file when there is one, else from the job id alone.
pub fn clean_job(
    settings: &Settings,
    job_id: &str,
    cgroups: Option<&Cgroups>,
    gpu: GpuOpener<'_>,
) -> CleanupReport {
    let mut report = CleanupReport {
        job_id: job_id.to_string(),
        ..Default::default()
    };
    let state = match read_state(settings, job_id) {
        Ok(s) => s,
        Err(e) => {
            report.problems.push(e.to_string());
            None
        }
    };
    if state
        .as_ref()
        .is_some_and(|s| s.config.mode == Mode::Docker)
    {
        let out = Command::new(&settings.docker)
            .args(["rm", "--force", &docker::container_name(job_id)])
            .output();
        match out {
            Ok(o) if o.status.success() => report.container_removed = true,
            Ok(o) => {
                let err = String::from_utf8_lossy(&o.stderr);
                if !err.contains("No such container") {
                    report.problems.push(format!("docker rm: {}", err.trim()));
                }
            }
            Err(e) => report
                .problems
                .push(format!("cannot run {}: {e}", settings.docker.display())),
        }
    }
    if let Some(cg) = cgroups {
        match cg.clean_up(job_id) {
            Ok(c) => {
                report.killed = c.killed;
                report.cgroup_removed = c.removed;
            }
            Err(e) => report.problems.push(e.to_string()),
        }
    }
    if let Some(s) = state.as_ref().filter(|s| s.clocks_locked) {
        let gpus: Vec<SliceGpu> = docker::slice_gpus(&s.slice).into_iter().cloned().collect();
        match gpu().and_then(|mut ctl| gpucheck::reset_clocks(ctl.as_mut(), &gpus)) {
            Ok(()) => report.clocks_reset = true,
            Err(e) => report.problems.push(e.to_string()),
        }
    }
    let released = match &state {
        Some(s) => leases(settings).release(&s.gpus, job_id),
        None => leases(settings).release_all(job_id),
    };
    match released {
        Ok(r) => report.released = r,
        Err(e) => report.problems.push(e.to_string()),
    }
    if let Ok(path) = state_path(settings, job_id) {
        if let Err(e) = std::fs::remove_file(&path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                report.problems.push(format!("{}: {e}", path.display()));
            }
        }
    }
    report
}

/// Cleans up after jobs whose process is gone: state files whose anchor died, and job
/// cgroups with no state at all. `me` is never touched.
pub fn clean_orphans(
    settings: &Settings,
    me: &str,
    cgroups: Option<&Cgroups>,
    gpu: GpuOpener<'_>,
) -> Vec<CleanupReport> {
    let mut reports = Vec::new();
    let mut known = Vec::new();
    if let Ok(entries) = std::fs::read_dir(jobs_dir(settings)) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(job) = name.strip_suffix(".json") else {
                continue;
            };
            known.push(job.to_string());
            if job == me {
                continue;
            }
            let orphaned = match read_state(settings, job) {
                Ok(Some(s)) => !process::is_alive(&settings.proc_root, s.anchor),
                Ok(None) => false,
                // Unreadable state cannot belong to a job that could use it.
                Err(_) => true,
            };
            if orphaned {
                reports.push(clean_job(settings, job, cgroups, gpu));
            }
        }
    }
    if let Some(cg) = cgroups {
        for job in cg.jobs() {
            // A job writes its state before it creates its cgroup, so a state file that
            // appeared since the listing above belongs to a job starting right now.
            let has_state = state_path(settings, &job)
                .map(|p| p.exists())
                .unwrap_or(false);
            if job != me && !known.contains(&job) && !has_state {
                reports.push(clean_job(settings, &job, cgroups, gpu));
            }
        }
    }
    reports
}

/// The `environment` hook: clean orphans, lease GPU(s), check and prepare the slice, record
/// the state. Every failure after the lease releases it.
pub fn environment(
    settings: &Settings,
    env: &BTreeMap<String, String>,
    gpu: GpuOpener<'_>,
) -> Result<Prepared, JobError> {
    let config = job_config(env)?;
    let job_id = var(env, "BUILDKITE_JOB_ID")?.to_string();
    crate::cgroup::job_cgroup_name(&job_id)?;
    let agent = env.get("BUILDKITE_AGENT_NAME").cloned().unwrap_or_default();
    let mut notices = Vec::new();

    // Decided before anything is held: a broken cgroup set-up fails the job up front.
    let cgroups = match Cgroups::detect(&settings.cgroup_root) {
        Ok(c) => Some(c),
        Err(e) if config.mode == Mode::Host && !config.allow_unenforced => return Err(e.into()),
        Err(e) => {
            if config.mode == Mode::Host {
                notices.push(format!("WARNING: {e}"));
            }
            None
        }
    };

    for r in clean_orphans(settings, &job_id, cgroups.as_ref(), gpu) {
        notices.push(format!("cleaned up after a lost job: {}", r.summary()));
    }

    // Hooks may run twice for one job (agent-level hook and plugin); the last config wins.
    if let Some(prev) = read_state(settings, &job_id)? {
        if prev.config == config {
            return Ok(Prepared {
                state: prev,
                notices,
            });
        }
        let r = clean_job(settings, &job_id, cgroups.as_ref(), gpu);
        tracing::info!("replacing this job's earlier preparation: {}", r.summary());
    }

    let anchor = process::job_anchor(&settings.proc_root, std::process::id(), settings.job_pid)
        .ok_or(JobError::NoAnchor)?;
    let plan = node_plan(settings)?;
    let candidates: Vec<u32> = plan.slices.iter().map(|s| s.index).collect();
    let want = match agent_gpus(env)? {
        Some(bound) if bound.len() as u32 != config.gpus => {
            return Err(JobError::GpuCountMismatch {
                bound: bound.len(),
                wanted: config.gpus,
            })
        }
        Some(bound) => {
            if let Some(&missing) = bound.iter().find(|g| !candidates.contains(g)) {
                return Err(JobError::NoSuchSlice { bound, missing });
            }
            Want::Exactly(bound)
        }
        None => Want::Pool {
            count: config.gpus,
            candidates,
        },
    };
    let me = Holder {
        job_id: job_id.clone(),
        agent: agent.clone(),
        anchor,
    };
    let leases = leases(settings);
    let gpus = leases.acquire(&want, &me, Duration::from_secs(config.lease_wait_secs))?;

    // Clocks locked before the state that records them is on disk must still be reset if
    // writing it fails.
    let mut locked_gpus: Vec<SliceGpu> = Vec::new();
    let prepared = prepare_leased(settings, &config, &plan, &gpus, gpu, &mut notices).and_then(
        |(slice, clocks_locked)| {
            if clocks_locked {
                locked_gpus = docker::slice_gpus(&slice).into_iter().cloned().collect();
            }
            // CPU-only slices have no devices; their slice numbers stand in, as before.
            let mut devices = device_indices(&plan, &slice);
            if devices.is_empty() {
                devices = gpus.clone();
            }
            let mut state = JobState {
                job_id: job_id.clone(),
                agent,
                anchor,
                exports: exports_for(&slice, &devices),
                gpus: gpus.clone(),
                device_indices: devices,
                slice,
                config: config.clone(),
                cgroup_version: None,
                clocks_locked,
            };
            // The state goes first: a job cgroup without state is an orphan to other jobs.
            write_state(settings, &state)?;
            if config.mode == Mode::Host {
                let deny = other_gpu_devices(&settings.sysfs_root, &plan, &state.slice);
                state.cgroup_version = create_cgroup(
                    &job_id,
                    &config,
                    &state.slice,
                    deny,
                    cgroups.as_ref(),
                    &mut notices,
                )?;
                write_state(settings, &state)?;
            }
            Ok(state)
        },
    );
    match prepared {
        Ok(state) => Ok(Prepared { state, notices }),
        Err(e) => {
            let r = clean_job(settings, &job_id, cgroups.as_ref(), gpu);
            if !r.clocks_reset && !locked_gpus.is_empty() {
                if let Err(reset) =
                    gpu().and_then(|mut ctl| gpucheck::reset_clocks(ctl.as_mut(), &locked_gpus))
                {
                    notices.push(format!("PROBLEM: could not reset GPU clocks: {reset}"));
                    tracing::warn!("could not reset GPU clocks: {reset}");
                }
            }
            let _ = leases.release(&gpus, &job_id);
            tracing::info!("environment failed, undone: {}", r.summary());
            Err(e)
        }
    }
}

fn prepare_leased(
    settings: &Settings,
    config: &PluginConfig,
    plan: &Plan,
    gpus: &[u32],
    gpu: GpuOpener<'_>,
    notices: &mut Vec<String>,
) -> Result<(Slice, bool), JobError> {
    let parts: Vec<&Slice> = gpus
        .iter()
        .filter_map(|g| plan.slices.iter().find(|s| s.index == *g))
        .collect();
    let mut slice =
        merge_slices(&parts).ok_or_else(|| JobError::Plan("the plan has no slices".into()))?;
    if let Some(mem) = config.memory_bytes {
        if mem > slice.memory_bytes {
            return Err(JobError::OverSlice {
                key: "memory",
                asked: mem.to_string(),
                has: format!("{} bytes", slice.memory_bytes),
            });
        }
        slice.memory_bytes = mem;
    }
    if let Some(per) = config.cpus_per_gpu {
        let want = per as usize * gpus.len();
        if want > slice.cpus.len() {
            return Err(JobError::OverSlice {
                key: "cpus-per-gpu",
                asked: per.to_string(),
                has: format!("{} CPUs for {} GPU(s)", slice.cpus.len(), gpus.len()),
            });
        }
        slice.cpus = narrow_cpus(&slice.cpus, want, &settings.sysfs_root);
    }

    let slice_gpus: Vec<SliceGpu> = docker::slice_gpus(&slice).into_iter().cloned().collect();
    let mut clocks_locked = false;
    if config.require_idle_gpu || config.lock_clocks.is_some() {
        let mut ctl = gpu()?;
        if config.require_idle_gpu {
            gpucheck::require_idle(ctl.as_mut(), &slice_gpus, config.idle_memory_mib)?;
        }
        if let Some(lock) = config.lock_clocks {
            let mhz = match lock {
                LockClocks::Max => None,
                LockClocks::Mhz(m) => Some(m),
            };
            let set = gpucheck::lock_clocks(ctl.as_mut(), &slice_gpus, mhz)?;
            clocks_locked = true;
            notices.push(format!("locked graphics clocks at {set:?} MHz"));
        }
    }
    Ok((slice, clocks_locked))
}

/// Creates the job's cgroup; with `allow-unenforced`, a failure becomes a loud warning.
fn create_cgroup(
    job_id: &str,
    config: &PluginConfig,
    slice: &Slice,
    deny_devices: Vec<CharDevice>,
    cgroups: Option<&Cgroups>,
    notices: &mut Vec<String>,
) -> Result<Option<u8>, JobError> {
    let limits = Limits {
        cpus: slice.cpus.clone(),
        mems: slice.mems.clone(),
        memory_bytes: slice.memory_bytes,
        pids: config.pids_limit,
        deny_devices,
    };
    let created = match cgroups {
        Some(cg) => cg.create(job_id, &limits).map(|w| (cg.version(), w)),
        None => Err(CgroupError::Unavailable("cgroups were not detected".into())),
    };
    match created {
        Ok((version, warnings)) => {
            notices.extend(warnings.into_iter().map(|w| format!("warning: {w}")));
            Ok(Some(version))
        }
        Err(e) if config.allow_unenforced => {
            if let Some(cg) = cgroups {
                let _ = cg.clean_up(job_id);
            }
            notices.push(format!(
                "WARNING: RUNNING UNENFORCED (allow-unenforced: true): no CPU, memory or pids limits for this job: {e}"
            ));
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

/// Exit status of a command as the agent reports it: the code, or 128 + the signal.
fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1)
}

/// The result of the `command` hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandOutcome {
    pub exit_code: i32,
    /// Lines for the job log (OOM kills, unenforced warnings).
    pub notices: Vec<String>,
}

/// The shell the agent would run the command with (`BUILDKITE_SHELL`, default
/// `/bin/bash -e -c`).
fn shell_words(env: &BTreeMap<String, String>) -> Vec<String> {
    let shell = env
        .get("BUILDKITE_SHELL")
        .map(String::as_str)
        .filter(|s| !s.trim().is_empty())
        .unwrap_or("/bin/bash -e -c");
    shell.split_whitespace().map(str::to_string).collect()
}

/// The docker invocation for a prepared job.
pub fn docker_run_for(
    settings: &Settings,
    state: &JobState,
    env: &BTreeMap<String, String>,
    command: &str,
) -> Result<Vec<String>, JobError> {
    let c = &state.config;
    let image = c.image.clone().ok_or_else(|| ConfigError {
        key: "image".into(),
        message: "required when mode is \"docker\"".into(),
    })?;
    let checkout = if c.mount_checkout {
        Some(
            env.get("BUILDKITE_BUILD_CHECKOUT_PATH")
                .map(PathBuf::from)
                .or_else(|| std::env::current_dir().ok())
                .unwrap_or_else(|| PathBuf::from(".")),
        )
    } else {
        None
    };
    let mut job_env = env.clone();
    job_env.extend(state.exports.clone());
    let run = docker::DockerRun {
        job_id: state.job_id.clone(),
        image,
        slice: state.slice.clone(),
        pids_limit: c.pids_limit,
        network: c.network_allowed(),
        checkout,
        workdir: c.workdir.clone(),
        amd_render_nodes: docker::slice_gpus(&state.slice)
            .iter()
            .filter(|g| g.vendor == Vendor::Amd)
            .filter_map(|g| docker::amd_render_node(&settings.sysfs_root, &g.pci_bus_id))
            .collect(),
        env_names: docker::pass_through_names(&job_env, &c.environment),
        env_overrides: docker::container_device_env(&state.slice),
        extra_args: c.docker_args.clone(),
        command: command.to_string(),
    };
    let devices = if state.device_indices.is_empty() {
        &state.gpus
    } else {
        &state.device_indices
    };
    Ok(docker::run_args(&run, devices))
}

/// The `command` hook: run `BUILDKITE_COMMAND` held to the job's slice and report how it ended.
pub fn command(
    settings: &Settings,
    env: &BTreeMap<String, String>,
) -> Result<CommandOutcome, JobError> {
    let job_id = var(env, "BUILDKITE_JOB_ID")?;
    let state = read_state(settings, job_id)?.ok_or_else(|| JobError::NoState {
        job_id: job_id.to_string(),
        dir: jobs_dir(settings),
    })?;
    let mut notices = Vec::new();
    // A step made only of plugins has no command; the agent then has nothing to run either.
    let Some(command) = env
        .get("BUILDKITE_COMMAND")
        .map(String::as_str)
        .filter(|c| !c.trim().is_empty())
    else {
        notices.push("the step has no command; nothing to run".into());
        return Ok(CommandOutcome {
            exit_code: 0,
            notices,
        });
    };
    let mut child_env = env.clone();
    child_env.extend(state.exports.clone());

    if state.config.mode == Mode::Docker {
        let args = docker_run_for(settings, &state, env, command)?;
        let status = Command::new(&settings.docker)
            .args(&args)
            .env_clear()
            .envs(&child_env)
            .status()
            .map_err(|error| JobError::Spawn {
                what: format!(
                    "{} (is docker installed and on PATH?)",
                    settings.docker.display()
                ),
                error,
            })?;
        let code = exit_code(status);
        if code == 137 {
            notices.push(format!(
                "the container was killed (exit 137); if it hit its memory limit of {} bytes, lower the job's memory use",
                state.slice.memory_bytes
            ));
        }
        return Ok(CommandOutcome {
            exit_code: code,
            notices,
        });
    }

    let words = shell_words(env);
    let mut cmd = Command::new(&words[0]);
    cmd.args(&words[1..])
        .arg(command)
        .env_clear()
        .envs(&child_env);
    let mut confinement = Confinement {
        procs_files: Vec::new(),
        isolate_network: !state.config.network_allowed(),
    };
    let cgroups = match state.cgroup_version {
        Some(_) => {
            let cg = Cgroups::detect(&settings.cgroup_root)?;
            confinement.procs_files = cg.procs_files(job_id)?;
            Some(cg)
        }
        None => {
            notices.push(
                "WARNING: RUNNING UNENFORCED: the command has no CPU, memory or pids limits".into(),
            );
            None
        }
    };
    let oom_before = cgroups.as_ref().map_or(0, |c| c.oom_kills(job_id));
    let spawn_error = |error: std::io::Error| JobError::Spawn {
        what: format!(
            "the command in the job's cgroup{}",
            if confinement.isolate_network {
                " and a new network namespace (needs root or CAP_SYS_ADMIN; or set `network: true`)"
            } else {
                ""
            }
        ),
        error,
    };
    // On cgroup v2 the command is born in its cgroup (no migration to wait for).
    let born_inside = match (
        &cgroups,
        confinement.procs_files.first().and_then(|p| p.parent()),
    ) {
        (Some(Cgroups::V2(_)), Some(dir)) => {
            let args: Vec<std::ffi::OsString> = words[1..]
                .iter()
                .map(std::ffi::OsString::from)
                .chain([std::ffi::OsString::from(command)])
                .collect();
            confine::spawn_into_cgroup2(
                std::ffi::OsStr::new(&words[0]),
                &args,
                &child_env,
                dir,
                confinement.isolate_network,
            )
            .map_err(spawn_error)?
        }
        _ => None,
    };
    let mut child = match born_inside {
        Some(started) => started,
        None => confine::Started::Std(confine::spawn(&mut cmd, &confinement).map_err(spawn_error)?),
    };
    let status = child.wait().map_err(|error| JobError::Spawn {
        what: "waiting for the command".into(),
        error,
    })?;
    if let Some(cg) = &cgroups {
        let ooms = cg.oom_kills(job_id).saturating_sub(oom_before);
        if ooms > 0 {
            notices.push(format!(
                "the job hit its memory limit of {} bytes: the kernel OOM-killed {ooms} process(es)",
                state.slice.memory_bytes
            ));
        }
    }
    Ok(CommandOutcome {
        exit_code: exit_code(status),
        notices,
    })
}

/// The `pre-exit` hook: kill what is left, remove the cgroup, reset clocks, release leases.
/// Idempotent; a job without state (environment never ran or already cleaned) is fine.
pub fn pre_exit(
    settings: &Settings,
    env: &BTreeMap<String, String>,
    gpu: GpuOpener<'_>,
) -> Result<CleanupReport, JobError> {
    let job_id = var(env, "BUILDKITE_JOB_ID")?;
    crate::cgroup::job_cgroup_name(job_id)?;
    let cgroups = Cgroups::detect(&settings.cgroup_root).ok();
    Ok(clean_job(settings, job_id, cgroups.as_ref(), gpu))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn agent_binding_from_tag_or_name() {
        assert_eq!(agent_gpus(&env(&[])).unwrap(), None);
        assert_eq!(
            agent_gpus(&env(&[("BUILDKITE_AGENT_META_DATA_GPU_INDEX", "3")])).unwrap(),
            Some(vec![3])
        );
        assert_eq!(
            agent_gpus(&env(&[("BUILDKITE_AGENT_META_DATA_GPU_INDEX", "2, 3")])).unwrap(),
            Some(vec![2, 3])
        );
        assert_eq!(
            agent_gpus(&env(&[("BUILDKITE_AGENT_NAME", "dgx01-gpu7")])).unwrap(),
            Some(vec![7])
        );
        assert_eq!(
            agent_gpus(&env(&[("BUILDKITE_AGENT_NAME", "dgx01-gpux")])).unwrap(),
            None
        );
        assert!(agent_gpus(&env(&[("BUILDKITE_AGENT_META_DATA_GPU_INDEX", "one")])).is_err());
        assert!(agent_gpus(&env(&[("BUILDKITE_AGENT_META_DATA_GPU_INDEX", "3,3")])).is_err());
    }

    #[test]
    fn memory_is_exported_like_the_prototype() {
        assert_eq!(docker_memory(64 << 30), "64g");
        assert_eq!(docker_memory(1536 << 20), "1536m");
        assert_eq!(docker_memory(1000), "1000");
    }

    #[test]
    fn shell_quoting_survives_quotes() {
        assert_eq!(shell_quote("a'b"), r"'a'\''b'");
        let lines = export_lines(&env(&[("K", "v w"), ("J", "{\"x\":1}")]));
        assert_eq!(lines, "export J='{\"x\":1}'\nexport K='v w'\n");
    }

    fn nv(bus: &str, uuid: Option<&str>) -> SliceGpu {
        SliceGpu {
            vendor: Vendor::Nvidia,
            pci_bus_id: bus.into(),
            uuid: uuid.map(str::to_string),
            numa_node: Some(0),
        }
    }

    #[test]
    fn merged_slices_union_resources() {
        let a = Slice {
            index: 2,
            gpu: Some(nv("a", Some("GPU-a"))),
            extra_gpus: vec![],
            cpus: vec![4, 5],
            mems: vec![0],
            memory_bytes: 10,
        };
        let b = Slice {
            index: 3,
            gpu: Some(nv("b", Some("GPU-b"))),
            extra_gpus: vec![],
            cpus: vec![6, 7],
            mems: vec![1],
            memory_bytes: 20,
        };
        let m = merge_slices(&[&a, &b]).unwrap();
        assert_eq!(m.cpus, vec![4, 5, 6, 7]);
        assert_eq!(m.mems, vec![0, 1]);
        assert_eq!(m.memory_bytes, 30);
        assert_eq!(m.extra_gpus.len(), 1);
        let e = exports_for(&m, &[2, 3]);
        assert_eq!(e["CUDA_VISIBLE_DEVICES"], "GPU-a,GPU-b");
        assert_eq!(e["KERNELBOT_GPU_INDEX"], "2,3");
        assert_eq!(e["KERNELBOT_CPUSET"], "4-7");
        let back: Slice = serde_json::from_str(&e["KERNELKITE_SLICE"]).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn device_numbers_follow_each_vendor_s_bus_order_not_slice_numbers() {
        let gpu = |vendor: Vendor, bus: &str| SliceGpu {
            vendor,
            pci_bus_id: bus.into(),
            uuid: None,
            numa_node: Some(0),
        };
        let slice = |index: u32, gpus: Vec<SliceGpu>| {
            let mut g = gpus.into_iter();
            Slice {
                index,
                gpu: g.next(),
                extra_gpus: g.collect(),
                cpus: vec![index],
                mems: vec![0],
                memory_bytes: 1,
            }
        };
        // Two AMD GPUs per slice: slice 1 holds devices 2 and 3, not "1".
        let amd = |b: &str| gpu(Vendor::Amd, b);
        let plan = Plan {
            slices: vec![
                slice(0, vec![amd("0000:0c:00.0"), amd("0000:22:00.0")]),
                slice(1, vec![amd("0000:38:00.0"), amd("0000:5c:00.0")]),
            ],
            reserved_cpus: vec![],
            warnings: vec![],
        };
        assert_eq!(device_indices(&plan, &plan.slices[1]), vec![2, 3]);
        let e = exports_for(&plan.slices[1], &device_indices(&plan, &plan.slices[1]));
        assert_eq!(e["ROCR_VISIBLE_DEVICES"], "2,3");
        assert_eq!(e["KERNELBOT_GPU_INDEX"], "2,3");
        // Mixed vendors: each vendor numbers its own GPUs.
        let plan = Plan {
            slices: vec![
                slice(0, vec![gpu(Vendor::Nvidia, "0000:18:00.0")]),
                slice(1, vec![amd("0000:20:00.0")]),
                slice(2, vec![gpu(Vendor::Nvidia, "0000:30:00.0")]),
            ],
            reserved_cpus: vec![],
            warnings: vec![],
        };
        assert_eq!(device_indices(&plan, &plan.slices[1]), vec![0]);
        assert_eq!(device_indices(&plan, &plan.slices[2]), vec![1]);
    }

    /// A GPU driver double recording what the hooks asked of it.
    #[derive(Clone, Default)]
    struct FakeDriver {
        log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
        busy_pid: Option<u32>,
    }

    impl GpuControl for FakeDriver {
        fn compute_processes(
            &mut self,
            _: &SliceGpu,
        ) -> Result<Vec<gpucheck::GpuProcess>, GpuCheckError> {
            Ok(self
                .busy_pid
                .map(|pid| vec![gpucheck::GpuProcess { pid, used_mib: 100 }])
                .unwrap_or_default())
        }
        fn memory_used_mib(&mut self, _: &SliceGpu) -> Result<u64, GpuCheckError> {
            Ok(0)
        }
        fn max_graphics_clock_mhz(&mut self, _: &SliceGpu) -> Result<u32, GpuCheckError> {
            Ok(1980)
        }
        fn lock_graphics_clock(&mut self, g: &SliceGpu, mhz: u32) -> Result<(), GpuCheckError> {
            self.log
                .lock()
                .unwrap()
                .push(format!("lock {} {mhz}", g.pci_bus_id));
            Ok(())
        }
        fn reset_graphics_clock(&mut self, g: &SliceGpu) -> Result<(), GpuCheckError> {
            self.log
                .lock()
                .unwrap()
                .push(format!("reset {}", g.pci_bus_id));
            Ok(())
        }
    }

    fn fake_node() -> (tempfile::TempDir, Settings) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("cg/proc/self")).unwrap();
        std::fs::write(
            root.join("cg/proc/self/mountinfo"),
            "1 1 0:1 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        )
        .unwrap();
        std::fs::create_dir_all(root.join("cg/sys/fs/cgroup")).unwrap();
        std::fs::write(
            root.join("cg/sys/fs/cgroup/cgroup.controllers"),
            "cpuset memory pids",
        )
        .unwrap();
        let plan = Plan {
            slices: vec![Slice {
                index: 0,
                gpu: Some(nv("0000:18:00.0", None)),
                extra_gpus: vec![],
                cpus: vec![0],
                mems: vec![0],
                memory_bytes: 1 << 30,
            }],
            reserved_cpus: vec![],
            warnings: vec![],
        };
        std::fs::write(
            root.join("plan.json"),
            serde_json::to_string(&plan).unwrap(),
        )
        .unwrap();
        let settings = Settings {
            run_dir: root.join("run"),
            plan_file: Some(root.join("plan.json")),
            cgroup_root: root.join("cg"),
            job_pid: Some(std::process::id()),
            ..Settings::default()
        };
        (dir, settings)
    }

    #[test]
    fn locked_clocks_are_reset_in_pre_exit() {
        let (_dir, settings) = fake_node();
        let driver = FakeDriver::default();
        let d = driver.clone();
        let mut open = move || Ok(Box::new(d.clone()) as Box<dyn GpuControl>);
        let e = env(&[
            ("BUILDKITE_JOB_ID", "job-clocks"),
            (
                "BUILDKITE_PLUGIN_CONFIGURATION",
                r#"{"lock-clocks":1410,"require-idle-gpu":true}"#,
            ),
        ]);
        let prepared = environment(&settings, &e, &mut open).unwrap();
        assert!(prepared.state.clocks_locked);
        assert_eq!(*driver.log.lock().unwrap(), vec!["lock 0000:18:00.0 1410"]);
        let report = pre_exit(&settings, &e, &mut open).unwrap();
        assert!(report.clocks_reset, "{report:?}");
        assert_eq!(
            *driver.log.lock().unwrap(),
            vec!["lock 0000:18:00.0 1410", "reset 0000:18:00.0"]
        );
        assert_eq!(report.released, vec![0]);
    }

    #[test]
    fn pre_exit_releases_a_lease_taken_before_the_state_was_written() {
        // `environment` killed between taking the lease and writing the state: the lease
        // names the job but there is no state; pre-exit must still free the GPU.
        let (_dir, settings) = fake_node();
        let leases = Leases::new(&settings.run_dir, &settings.proc_root);
        let me = Holder {
            job_id: "job-half".into(),
            agent: "a".into(),
            anchor: process::identify(&settings.proc_root, std::process::id()).unwrap(),
        };
        leases
            .acquire(&Want::Exactly(vec![0]), &me, Duration::ZERO)
            .unwrap();
        let mut open = || Err(GpuCheckError::NoNvml("no driver in tests".into()));
        let report = pre_exit(
            &settings,
            &env(&[("BUILDKITE_JOB_ID", "job-half")]),
            &mut open,
        )
        .unwrap();
        assert_eq!(report.released, vec![0], "{report:?}");
        assert!(leases.holder(0).unwrap().is_none());
    }

    #[test]
    fn clocks_are_reset_when_the_state_cannot_be_written() {
        let (_dir, settings) = fake_node();
        // A directory where the state's temporary file goes: writing the state fails.
        std::fs::create_dir_all(
            jobs_dir(&settings).join(format!("job-nostate.json.{}", std::process::id())),
        )
        .unwrap();
        let driver = FakeDriver::default();
        let d = driver.clone();
        let mut open = move || Ok(Box::new(d.clone()) as Box<dyn GpuControl>);
        let e = env(&[
            ("BUILDKITE_JOB_ID", "job-nostate"),
            ("BUILDKITE_PLUGIN_CONFIGURATION", r#"{"lock-clocks":1410}"#),
        ]);
        assert!(environment(&settings, &e, &mut open).is_err());
        assert_eq!(
            *driver.log.lock().unwrap(),
            vec!["lock 0000:18:00.0 1410", "reset 0000:18:00.0"]
        );
        let leases = Leases::new(&settings.run_dir, &settings.proc_root);
        assert!(leases.holder(0).unwrap().is_none());
    }

    #[test]
    fn busy_gpu_fails_the_job_and_releases_its_lease() {
        let (_dir, settings) = fake_node();
        let busy = FakeDriver {
            busy_pid: Some(777),
            ..Default::default()
        };
        let mut open = move || Ok(Box::new(busy.clone()) as Box<dyn GpuControl>);
        let e = env(&[
            ("BUILDKITE_JOB_ID", "job-busy"),
            (
                "BUILDKITE_PLUGIN_CONFIGURATION",
                r#"{"require-idle-gpu":true}"#,
            ),
        ]);
        let err = environment(&settings, &e, &mut open)
            .unwrap_err()
            .to_string();
        assert!(err.contains("pid 777"), "{err}");
        let leases = Leases::new(&settings.run_dir, &settings.proc_root);
        assert!(
            leases.holder(0).unwrap().is_none(),
            "the lease must be released"
        );
        assert!(read_state(&settings, "job-busy").unwrap().is_none());
    }

    #[test]
    fn other_gpus_devices_come_from_the_driver_files() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        for (bus, minor) in [("0000:18:00.0", 0), ("0000:2a:00.0", 1)] {
            let d = r.join("proc/driver/nvidia/gpus").join(bus);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(
                d.join("information"),
                format!("Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 123\nDevice Minor: \t {minor}\n"),
            )
            .unwrap();
        }
        for n in ["card2", "renderD130"] {
            std::fs::create_dir_all(r.join("sys/bus/pci/devices/0000:0c:00.0/drm").join(n))
                .unwrap();
        }
        let slice = |i: u32, g: SliceGpu| Slice {
            index: i,
            gpu: Some(g),
            extra_gpus: vec![],
            cpus: vec![i],
            mems: vec![0],
            memory_bytes: 1,
        };
        let mut amd = nv("0000:0c:00.0", None);
        amd.vendor = Vendor::Amd;
        let plan = Plan {
            slices: vec![
                slice(0, nv("0000:18:00.0", None)),
                slice(1, nv("0000:2a:00.0", None)),
                slice(2, amd),
                slice(3, nv("0000:ff:00.0", None)),
            ],
            reserved_cpus: vec![],
            warnings: vec![],
        };
        let devs = other_gpu_devices(r, &plan, &plan.slices[0]);
        assert_eq!(
            devs,
            vec![
                CharDevice {
                    major: 195,
                    minor: 1
                },
                CharDevice {
                    major: 226,
                    minor: 2
                },
                CharDevice {
                    major: 226,
                    minor: 130
                },
            ]
        );
    }

    #[test]
    fn narrowing_keeps_whole_cores() {
        let root = tempfile::tempdir().unwrap();
        // CPUs 0/4 and 1/5 are siblings.
        for (cpu, core) in [(0, 0), (1, 1), (4, 0), (5, 1)] {
            let d = root
                .path()
                .join(format!("sys/devices/system/cpu/cpu{cpu}/topology"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("physical_package_id"), "0\n").unwrap();
            std::fs::write(d.join("core_id"), format!("{core}\n")).unwrap();
        }
        assert_eq!(narrow_cpus(&[0, 1, 4, 5], 2, root.path()), vec![0, 4]);
        assert_eq!(narrow_cpus(&[0, 1, 4, 5], 3, root.path()), vec![0, 1, 4, 5]);
        // Without topology each CPU counts alone.
        assert_eq!(
            narrow_cpus(&[0, 1, 4, 5], 2, Path::new("/nonexistent")),
            vec![0, 1]
        );
    }
}
