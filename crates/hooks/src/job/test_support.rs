//! Fixtures shared by the job module's unit tests: a fake node (a fake cgroup v2 tree and a
//! one-slice plan) and a GPU driver double that records what the hooks asked of it.

use std::collections::BTreeMap;

use kernelkite_topology::plan::{Plan, Slice, SliceGpu, Vendor};

use super::state::JobState;
use super::Settings;
use crate::config::PluginConfig;
use crate::gpucheck::{self, GpuCheckError, GpuControl};

pub fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub fn nv(bus: &str, uuid: Option<&str>) -> SliceGpu {
    SliceGpu {
        vendor: Vendor::Nvidia,
        pci_bus_id: bus.into(),
        uuid: uuid.map(str::to_string),
        numa_node: Some(0),
        mig: None,
    }
}

/// A GPU driver double recording what the hooks asked of it.
#[derive(Clone, Default)]
pub struct FakeDriver {
    pub log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    pub busy_pid: Option<u32>,
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

/// Slice 0 holding `gpus` (the first as its `gpu`), CPUs 1-2, memory node 0, 64 MiB.
pub fn slice_of(gpus: Vec<SliceGpu>) -> Slice {
    let mut g = gpus.into_iter();
    Slice {
        index: 0,
        gpu: g.next(),
        extra_gpus: g.collect(),
        cpus: vec![1, 2],
        mems: vec![0],
        memory_bytes: 64 << 20,
    }
}

pub fn fake_node() -> (tempfile::TempDir, Settings) {
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
        // These tests are about the hooks' bookkeeping; the sandbox has its own.
        sandbox: false,
        ..Settings::default()
    };
    (dir, settings)
}

/// A job's state as `environment` leaves it (one GPU, cgroup v2, clocks not locked).
pub fn state(job_id: &str) -> JobState {
    JobState {
        job_id: job_id.into(),
        agent: "a".into(),
        anchor: crate::process::identify(&Settings::default().proc_root, std::process::id())
            .unwrap(),
        gpus: vec![1],
        device_indices: vec![1],
        slice: Slice {
            index: 1,
            gpu: None,
            extra_gpus: vec![],
            cpus: vec![0],
            mems: vec![0],
            memory_bytes: 1 << 30,
        },
        config: PluginConfig::default(),
        cgroup_version: Some(2),
        clocks_locked: false,
        exports: [("K".to_string(), "v".to_string())].into(),
        job_user: None,
        checkout_owner: None,
    }
}
