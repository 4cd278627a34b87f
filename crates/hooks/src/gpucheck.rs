//! GPU checks and clock locking before a job's command, through NVML.
//!
//! NVML (`libnvidia-ml.so.1`) is loaded at run time ([`kernelkite_sys::nvml`], the workspace's
//! one loader) so the binary runs on machines without the NVIDIA driver; only a job that asks
//! for `require-idle-gpu` or `lock-clocks` needs it. The policy (what counts as idle, what to
//! lock) sits behind [`GpuControl`] so it is tested without a GPU.

use kernelkite_sys::nvml::NvmlError;
use kernelkite_topology::plan::{SliceGpu, Vendor};

/// Why a GPU check or clock change failed.
#[derive(Debug, thiserror::Error)]
pub enum GpuCheckError {
    /// NVML could not be loaded (no NVIDIA driver); the cause is the loader's error.
    #[error("cannot load NVML ({0}); `require-idle-gpu` and `lock-clocks` need the NVIDIA driver's libnvidia-ml.so.1 on the agent — install the driver or drop those options")]
    NoNvml(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// An NVML call failed for one GPU.
    #[error("NVML failed for GPU {bus_id}: {source}")]
    Nvml {
        /// The GPU's PCI bus id.
        bus_id: String,
        /// Which call, and NVML's error.
        #[source]
        source: NvmlError,
    },
    /// The GPU runs compute processes or has too much memory in use.
    #[error("GPU {bus_id} is not idle: {reason}; another job or a stray process is using it (find it with nvidia-smi) — the job was not started")]
    Busy {
        /// The GPU's PCI bus id.
        bus_id: String,
        /// What is using it, in words.
        reason: String,
    },
    /// The checks are NVIDIA-only.
    #[error(
        "GPU {bus_id} is an AMD GPU; `require-idle-gpu` and `lock-clocks` are NVIDIA-only for now"
    )]
    Unsupported {
        /// The GPU's PCI bus id.
        bus_id: String,
    },
}

/// A compute process on a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuProcess {
    /// Its pid.
    pub pid: u32,
    /// GPU memory it uses, in MiB.
    pub used_mib: u64,
}

/// What the checks need from the driver.
pub trait GpuControl {
    /// The compute processes running on `gpu`.
    fn compute_processes(&mut self, gpu: &SliceGpu) -> Result<Vec<GpuProcess>, GpuCheckError>;
    /// GPU memory in use on `gpu`, in MiB.
    fn memory_used_mib(&mut self, gpu: &SliceGpu) -> Result<u64, GpuCheckError>;
    /// The highest graphics clock `gpu` supports.
    fn max_graphics_clock_mhz(&mut self, gpu: &SliceGpu) -> Result<u32, GpuCheckError>;
    /// Locks `gpu`'s graphics clock at `mhz`.
    fn lock_graphics_clock(&mut self, gpu: &SliceGpu, mhz: u32) -> Result<(), GpuCheckError>;
    /// Lets `gpu` pick its clocks again.
    fn reset_graphics_clock(&mut self, gpu: &SliceGpu) -> Result<(), GpuCheckError>;
}

fn nvidia_only(gpu: &SliceGpu) -> Result<(), GpuCheckError> {
    match gpu.vendor {
        Vendor::Nvidia => Ok(()),
        Vendor::Amd => Err(GpuCheckError::Unsupported {
            bus_id: gpu.pci_bus_id.clone(),
        }),
    }
}

/// The GPUs whose clocks a job may lock and reset: not a MIG device's, since its clock is its
/// GPU's and the other MIG devices' jobs share it.
pub fn clock_owned(gpus: &[&SliceGpu]) -> Vec<SliceGpu> {
    gpus.iter()
        .filter(|g| g.mig.is_none())
        .map(|g| (*g).clone())
        .collect()
}

/// Fails unless every GPU has no compute process and at most `max_used_mib` memory in use.
pub fn require_idle(
    ctl: &mut dyn GpuControl,
    gpus: &[SliceGpu],
    max_used_mib: u64,
) -> Result<(), GpuCheckError> {
    for gpu in gpus {
        nvidia_only(gpu)?;
        let procs = ctl.compute_processes(gpu)?;
        if !procs.is_empty() {
            let list: Vec<String> = procs
                .iter()
                .map(|p| format!("pid {} ({} MiB)", p.pid, p.used_mib))
                .collect();
            return Err(GpuCheckError::Busy {
                bus_id: gpu.pci_bus_id.clone(),
                reason: format!("compute processes running: {}", list.join(", ")),
            });
        }
        let used = ctl.memory_used_mib(gpu)?;
        if used > max_used_mib {
            return Err(GpuCheckError::Busy {
                bus_id: gpu.pci_bus_id.clone(),
                reason: format!("{used} MiB of memory in use, over the {max_used_mib} MiB threshold (`idle-memory-mib`)"),
            });
        }
    }
    Ok(())
}

/// Locks each GPU's graphics clock (at `mhz`, or the maximum); returns the clocks set.
/// On failure, clocks already locked are reset before the error is returned.
pub fn lock_clocks(
    ctl: &mut dyn GpuControl,
    gpus: &[SliceGpu],
    mhz: Option<u32>,
) -> Result<Vec<u32>, GpuCheckError> {
    let mut locked: Vec<(SliceGpu, u32)> = Vec::new();
    let result = (|| {
        for gpu in gpus {
            nvidia_only(gpu)?;
            let target = match mhz {
                Some(m) => m,
                None => ctl.max_graphics_clock_mhz(gpu)?,
            };
            ctl.lock_graphics_clock(gpu, target)?;
            locked.push((gpu.clone(), target));
        }
        Ok(())
    })();
    match result {
        Ok(()) => Ok(locked.into_iter().map(|(_, m)| m).collect()),
        Err(e) => {
            for (gpu, _) in &locked {
                let _ = ctl.reset_graphics_clock(gpu);
            }
            Err(e)
        }
    }
}

/// Resets clocks; every GPU is tried even when one fails.
pub fn reset_clocks(ctl: &mut dyn GpuControl, gpus: &[SliceGpu]) -> Result<(), GpuCheckError> {
    let mut first = None;
    for gpu in gpus {
        if let Err(e) = ctl.reset_graphics_clock(gpu) {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// NVML loaded from the driver, as the hooks' [`GpuControl`].
#[derive(Debug)]
pub struct Nvml(kernelkite_sys::nvml::Nvml);

impl Nvml {
    /// Loads and initialises NVML.
    pub fn load() -> Result<Nvml, GpuCheckError> {
        kernelkite_sys::nvml::Nvml::load()
            .map(Nvml)
            .map_err(|e| GpuCheckError::NoNvml(Box::new(e)))
    }
}

/// How NVML is to find `gpu`: a MIG device by its uuid (its processes and memory are its
/// own), a whole GPU by its bus id.
fn nvml_id(gpu: &SliceGpu) -> &str {
    match &gpu.mig {
        Some(mig) => &mig.uuid,
        None => &gpu.pci_bus_id,
    }
}

/// Ties an NVML error to the GPU it happened on.
fn on(gpu: &SliceGpu) -> impl FnOnce(NvmlError) -> GpuCheckError + '_ {
    move |source| GpuCheckError::Nvml {
        bus_id: gpu.pci_bus_id.clone(),
        source,
    }
}

impl GpuControl for Nvml {
    fn compute_processes(&mut self, gpu: &SliceGpu) -> Result<Vec<GpuProcess>, GpuCheckError> {
        let processes = self.0.compute_processes(nvml_id(gpu)).map_err(on(gpu))?;
        Ok(processes
            .into_iter()
            .map(|p| GpuProcess {
                pid: p.pid,
                used_mib: p.used_bytes.unwrap_or(0) >> 20,
            })
            .collect())
    }

    fn memory_used_mib(&mut self, gpu: &SliceGpu) -> Result<u64, GpuCheckError> {
        let used = self.0.memory_used_bytes(nvml_id(gpu)).map_err(on(gpu))?;
        Ok(used >> 20)
    }

    fn max_graphics_clock_mhz(&mut self, gpu: &SliceGpu) -> Result<u32, GpuCheckError> {
        self.0
            .max_graphics_clock_mhz(&gpu.pci_bus_id)
            .map_err(on(gpu))
    }

    fn lock_graphics_clock(&mut self, gpu: &SliceGpu, mhz: u32) -> Result<(), GpuCheckError> {
        self.0
            .lock_graphics_clock(&gpu.pci_bus_id, mhz)
            .map_err(on(gpu))
    }

    fn reset_graphics_clock(&mut self, gpu: &SliceGpu) -> Result<(), GpuCheckError> {
        self.0
            .reset_graphics_clock(&gpu.pci_bus_id)
            .map_err(on(gpu))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct FakeGpu {
        procs: Vec<GpuProcess>,
        used: u64,
        max: u32,
        fail_lock_on: Option<String>,
        locked: Vec<(String, u32)>,
        resets: Vec<String>,
    }

    impl GpuControl for FakeGpu {
        fn compute_processes(&mut self, _: &SliceGpu) -> Result<Vec<GpuProcess>, GpuCheckError> {
            Ok(self.procs.clone())
        }
        fn memory_used_mib(&mut self, _: &SliceGpu) -> Result<u64, GpuCheckError> {
            Ok(self.used)
        }
        fn max_graphics_clock_mhz(&mut self, _: &SliceGpu) -> Result<u32, GpuCheckError> {
            Ok(self.max)
        }
        fn lock_graphics_clock(&mut self, gpu: &SliceGpu, mhz: u32) -> Result<(), GpuCheckError> {
            if self.fail_lock_on.as_deref() == Some(gpu.pci_bus_id.as_str()) {
                return Err(GpuCheckError::Nvml {
                    bus_id: gpu.pci_bus_id.clone(),
                    source: NvmlError::Call {
                        call: "nvmlDeviceSetGpuLockedClocks",
                        source: kernelkite_sys::nvml::DriverError::NoPermission,
                    },
                });
            }
            self.locked.push((gpu.pci_bus_id.clone(), mhz));
            Ok(())
        }
        fn reset_graphics_clock(&mut self, gpu: &SliceGpu) -> Result<(), GpuCheckError> {
            self.resets.push(gpu.pci_bus_id.clone());
            Ok(())
        }
    }

    fn gpu(bus: &str, vendor: Vendor) -> SliceGpu {
        SliceGpu {
            vendor,
            pci_bus_id: bus.into(),
            uuid: None,
            numa_node: Some(0),
            mig: None,
        }
    }

    #[test]
    fn idle_gpu_passes_and_busy_gpu_names_the_processes() {
        let g = [gpu("0000:18:00.0", Vendor::Nvidia)];
        let mut idle = FakeGpu {
            used: 300,
            ..Default::default()
        };
        require_idle(&mut idle, &g, 1024).unwrap();
        let mut busy = FakeGpu {
            procs: vec![GpuProcess {
                pid: 4242,
                used_mib: 9000,
            }],
            ..Default::default()
        };
        let e = require_idle(&mut busy, &g, 1024).unwrap_err().to_string();
        assert!(e.contains("pid 4242") && e.contains("0000:18:00.0"), "{e}");
        let mut full = FakeGpu {
            used: 2048,
            ..Default::default()
        };
        let e = require_idle(&mut full, &g, 1024).unwrap_err().to_string();
        assert!(e.contains("2048 MiB"), "{e}");
        let amd = [gpu("0000:0c:00.0", Vendor::Amd)];
        assert!(matches!(
            require_idle(&mut idle, &amd, 1024),
            Err(GpuCheckError::Unsupported { .. })
        ));
    }

    #[test]
    fn clocks_lock_at_max_or_given_and_roll_back_on_failure() {
        let g = [gpu("a", Vendor::Nvidia), gpu("b", Vendor::Nvidia)];
        let mut f = FakeGpu {
            max: 1980,
            ..Default::default()
        };
        assert_eq!(lock_clocks(&mut f, &g, None).unwrap(), vec![1980, 1980]);
        assert_eq!(
            lock_clocks(&mut f, &g[..1], Some(1410)).unwrap(),
            vec![1410]
        );
        let mut failing = FakeGpu {
            max: 1980,
            fail_lock_on: Some("b".into()),
            ..Default::default()
        };
        assert!(lock_clocks(&mut failing, &g, None).is_err());
        assert_eq!(
            failing.resets,
            vec!["a"],
            "the GPU locked before the failure is reset"
        );
        reset_clocks(&mut f, &g).unwrap();
        assert_eq!(f.resets, vec!["a", "b"]);
    }

    #[test]
    fn nvml_absent_is_a_clear_error() {
        if std::path::Path::new("/dev/nvidiactl").exists() {
            kernelkite_testkit_leaf::skip("this machine has the NVIDIA driver");
            return;
        }
        match Nvml::load() {
            Err(e) => {
                assert!(e.to_string().contains("libnvidia-ml.so.1"), "{e}");
                // The loader's error is kept as the cause, not flattened into the message.
                let cause = std::error::Error::source(&e).map(|c| c.to_string());
                assert!(
                    cause.is_some_and(|c| c.contains("libnvidia-ml") || c.contains("nvmlInit")),
                    "{e:?}"
                );
            }
            Ok(_) => kernelkite_testkit_leaf::skip("NVML loaded although no /dev/nvidiactl"),
        }
    }
}
