//! The run's provenance ([`kernelkite_sys::provenance`]): the job's GPUs sampled when the
//! evaluation starts and again when it ends, with the node, agent, slice and versions around
//! them, written as `provenance.json` beside `result.json`.
//!
//! The GPUs are the ones the job may use, found as [`crate::sysinfo`] finds them (those NVML
//! lets the process open, narrowed by `CUDA_VISIBLE_DEVICES`; AMD's through the KFD topology,
//! the job's `/dev` and the visibility variables), and sampled through NVML or amdgpu's sysfs. Nothing here fails
//! a run: what cannot be read stays empty.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use kernelkite_sys::nvml::{DeviceInfo, Nvml};
use kernelkite_sys::provenance::{self, AmdSysfs, Gpu, Provenance, Sample, SliceRef};

use crate::sysinfo::{visible_nvidia, Probe};

/// The variables the provenance is read from (the job's environment, as the hooks and the
/// agent set it).
pub trait Env {
    /// The variable's value, when set.
    fn var(&self, name: &str) -> Option<String>;
}

/// The process's own environment.
pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok().filter(|v| !v.is_empty())
    }
}

/// How one GPU is sampled again at the end.
#[derive(Debug, Clone)]
enum Sampler {
    /// Through NVML, by the bus id of the GPU (a MIG device's clocks are its GPU's).
    Nvidia(String),
    /// Through amdgpu's sysfs, by bus id.
    Amd(String),
}

/// A provenance whose start has been sampled.
#[derive(Debug)]
pub struct Started {
    provenance: Provenance,
    samplers: Vec<Sampler>,
    sys_root: PathBuf,
    use_nvml: bool,
}

/// Samples the job's GPUs now and fills in where the run happens.
pub fn start(probe: &Probe, env: &dyn Env) -> Started {
    let slice = env
        .var("KERNELKITE_SLICE")
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok());
    let mig = slice
        .as_ref()
        .and_then(|s| s.pointer("/gpu/mig/uuid"))
        .and_then(|u| u.as_str())
        .map(str::to_string);
    let mut p = Provenance {
        format: provenance::FORMAT,
        kernelkite_version: env!("CARGO_PKG_VERSION").to_string(),
        node: kernelkite_sys::host::name(),
        agent: env.var("BUILDKITE_AGENT_NAME"),
        queue: env.var("KERNELBOT_QUEUE"),
        slice: slice.and_then(|s| serde_json::from_value::<SliceRef>(s).ok()),
        image: env.var("KERNELKITE_IMAGE_DIGEST"),
        started_ms: now_ms(),
        ..Provenance::default()
    };
    let mut samplers = Vec::new();
    let nvml = probe.use_nvml.then(Nvml::load).and_then(Result::ok);
    if let Some(nvml) = &nvml {
        if let Ok(devices) = nvml.devices() {
            let visible = env.var("CUDA_VISIBLE_DEVICES");
            // The GPUs NVML lets this process open (in the sandbox, the job's), as the job's
            // CUDA_VISIBLE_DEVICES names them.
            for d in visible_nvidia(&devices, visible.as_deref()) {
                p.gpus.push(nvidia_gpu(nvml, d, mig.as_deref()));
                samplers.push(Sampler::Nvidia(d.pci_bus_id.clone()));
            }
            p.driver = nvml.driver_version().ok();
        }
    }
    if p.gpus.is_empty() {
        let kfd = kernelkite_sys::kfd::gpus(&probe.sys_root);
        let visible = kernelkite_sys::kfd::visible_among(kfd, &probe.dev_root, &|k| env.var(k));
        for g in &visible {
            let amd = AmdSysfs::new(&probe.sys_root, &g.pci_bus_id);
            p.gpus.push(Gpu {
                vendor: "amd".into(),
                name: None,
                uuid: amd.unique_id().or_else(|| Some(g.uuid())),
                partition: g.partition.map(|i| format!("partition {i}")),
                pci_bus_id: Some(g.pci_bus_id.clone()),
                vbios: amd.vbios(),
                max_sm_clock_mhz: amd.max_sm_clock_mhz(),
                start: Some(amd.sample()),
                end: None,
            });
            samplers.push(Sampler::Amd(g.pci_bus_id.clone()));
        }
        if !visible.is_empty() {
            p.driver = read_trimmed(&probe.sys_root.join("sys/module/amdgpu/version"));
        }
    }
    Started {
        provenance: p,
        samplers,
        sys_root: probe.sys_root.clone(),
        use_nvml: probe.use_nvml,
    }
}

impl Started {
    /// Samples the same GPUs again and closes the record.
    pub fn finish(mut self) -> Provenance {
        let nvml = self.use_nvml.then(Nvml::load).and_then(Result::ok);
        for (gpu, sampler) in self.provenance.gpus.iter_mut().zip(&self.samplers) {
            gpu.end = match sampler {
                Sampler::Nvidia(bus) => nvml
                    .as_ref()
                    .and_then(|n| n.reading(bus).ok())
                    .map(|r| provenance::sample_of(&r)),
                Sampler::Amd(bus) => Some(AmdSysfs::new(&self.sys_root, bus).sample()),
            };
        }
        self.provenance.ended_ms = now_ms();
        self.provenance
    }
}

fn nvidia_gpu(nvml: &Nvml, d: &DeviceInfo, mig: Option<&str>) -> Gpu {
    let bus = d.pci_bus_id.as_str();
    // The slice's MIG device, when it is one of this GPU's.
    let partition = mig
        .filter(|m| d.mig.iter().any(|x| x.uuid == *m))
        .map(str::to_string);
    Gpu {
        vendor: "nvidia".into(),
        name: d.name.clone(),
        uuid: d.uuid.clone(),
        partition,
        pci_bus_id: Some(bus.to_string()),
        vbios: nvml.vbios_version(bus).ok(),
        max_sm_clock_mhz: nvml.max_sm_clock_mhz(bus).ok(),
        start: nvml.reading(bus).ok().map(|r| provenance::sample_of(&r)),
        end: None::<Sample>,
    }
}

fn read_trimmed(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_string())
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Where the provenance goes when `--provenance` names no path: beside the result.
pub fn default_path(output: &Path) -> PathBuf {
    output.with_file_name(provenance::FILE)
}

/// Writes it (atomically: a reader never sees half a file).
pub fn write(path: &Path, p: &Provenance) -> std::io::Result<()> {
    let mut text = serde_json::to_vec_pretty(p).map_err(std::io::Error::other)?;
    text.push(b'\n');
    kernelkite_sys::fs::write_atomic(path, &text, 0o644)
}
