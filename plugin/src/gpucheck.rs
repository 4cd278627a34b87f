//! GPU checks and clock locking before a job's command, through NVML.
//!
//! NVML (`libnvidia-ml.so.1`) is loaded at run time so the binary runs on machines without
//! the NVIDIA driver; only a job that asks for `require-idle-gpu` or `lock-clocks` needs it.
//! The policy (what counts as idle, what to lock) sits behind [`GpuControl`] so it is tested
//! without a GPU.

use kernelkite_topology::plan::{SliceGpu, Vendor};

#[derive(Debug, thiserror::Error)]
pub enum GpuCheckError {
    #[error("cannot load NVML ({0}); `require-idle-gpu` and `lock-clocks` need the NVIDIA driver's libnvidia-ml.so.1 on the agent — install the driver or drop those options")]
    NoNvml(String),
    #[error("NVML {call} failed for GPU {bus_id}: error {code}")]
    Nvml {
        call: &'static str,
        bus_id: String,
        code: u32,
    },
    #[error("GPU {bus_id} is not idle: {reason}; another job or a stray process is using it (find it with nvidia-smi) — the job was not started")]
    Busy { bus_id: String, reason: String },
    #[error(
        "GPU {bus_id} is an AMD GPU; `require-idle-gpu` and `lock-clocks` are NVIDIA-only for now"
    )]
    Unsupported { bus_id: String },
}

/// A compute process on a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuProcess {
    pub pid: u32,
    pub used_mib: u64,
}

/// What the checks need from the driver.
pub trait GpuControl {
    fn compute_processes(&mut self, gpu: &SliceGpu) -> Result<Vec<GpuProcess>, GpuCheckError>;
    fn memory_used_mib(&mut self, gpu: &SliceGpu) -> Result<u64, GpuCheckError>;
    fn max_graphics_clock_mhz(&mut self, gpu: &SliceGpu) -> Result<u32, GpuCheckError>;
    fn lock_graphics_clock(&mut self, gpu: &SliceGpu, mhz: u32) -> Result<(), GpuCheckError>;
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

pub use nvml::Nvml;

mod nvml {
    use super::{GpuCheckError, GpuControl, GpuProcess};
    use kernelkite_topology::plan::SliceGpu;
    use std::ffi::{c_char, c_uint, c_void, CString};

    type Device = *mut c_void;
    type Ret = c_uint;

    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct ProcessInfoV3 {
        pid: c_uint,
        used_gpu_memory: u64,
        gpu_instance_id: c_uint,
        compute_instance_id: c_uint,
    }

    #[repr(C)]
    #[derive(Default)]
    struct Memory {
        total: u64,
        free: u64,
        used: u64,
    }

    const SUCCESS: Ret = 0;
    const CLOCK_GRAPHICS: c_uint = 0;

    /// NVML loaded from the driver.
    pub struct Nvml {
        lib: libloading::Library,
    }

    impl Nvml {
        /// Loads and initialises NVML.
        pub fn load() -> Result<Nvml, GpuCheckError> {
            // SAFETY: loading the NVIDIA driver's library runs its initialisers, which is what
            // every NVML user does.
            let lib = unsafe { libloading::Library::new("libnvidia-ml.so.1") }
                .map_err(|e| GpuCheckError::NoNvml(e.to_string()))?;
            let nvml = Nvml { lib };
            // SAFETY: nvmlInit_v2 takes no arguments and returns a status code.
            let init: libloading::Symbol<unsafe extern "C" fn() -> Ret> =
                unsafe { nvml.lib.get(b"nvmlInit_v2\0") }
                    .map_err(|e| GpuCheckError::NoNvml(e.to_string()))?;
            let rc = unsafe { init() };
            if rc != SUCCESS {
                return Err(GpuCheckError::NoNvml(format!("nvmlInit_v2 returned {rc}")));
            }
            Ok(nvml)
        }

        fn symbol<T>(
            &self,
            name: &'static [u8],
        ) -> Result<libloading::Symbol<'_, T>, GpuCheckError> {
            // SAFETY: the caller names the symbol with its NVML signature.
            unsafe { self.lib.get(name) }.map_err(|e| GpuCheckError::NoNvml(e.to_string()))
        }

        fn check(rc: Ret, call: &'static str, gpu: &SliceGpu) -> Result<(), GpuCheckError> {
            if rc == SUCCESS {
                Ok(())
            } else {
                Err(GpuCheckError::Nvml {
                    call,
                    bus_id: gpu.pci_bus_id.clone(),
                    code: rc,
                })
            }
        }

        fn device(&self, gpu: &SliceGpu) -> Result<Device, GpuCheckError> {
            let f = self.symbol::<unsafe extern "C" fn(*const c_char, *mut Device) -> Ret>(
                b"nvmlDeviceGetHandleByPciBusId_v2\0",
            )?;
            let bus = CString::new(gpu.pci_bus_id.as_str()).map_err(|_| GpuCheckError::Nvml {
                call: "nvmlDeviceGetHandleByPciBusId_v2",
                bus_id: gpu.pci_bus_id.clone(),
                code: 2,
            })?;
            let mut dev: Device = std::ptr::null_mut();
            // SAFETY: valid C string and out-pointer.
            let rc = unsafe { f(bus.as_ptr(), &mut dev) };
            Self::check(rc, "nvmlDeviceGetHandleByPciBusId_v2", gpu)?;
            Ok(dev)
        }
    }

    impl Drop for Nvml {
        fn drop(&mut self) {
            if let Ok(f) = self.symbol::<unsafe extern "C" fn() -> Ret>(b"nvmlShutdown\0") {
                // SAFETY: pairs the successful nvmlInit_v2 in `load`.
                unsafe { f() };
            }
        }
    }

    impl GpuControl for Nvml {
        fn compute_processes(&mut self, gpu: &SliceGpu) -> Result<Vec<GpuProcess>, GpuCheckError> {
            let dev = self.device(gpu)?;
            let f = self
                .symbol::<unsafe extern "C" fn(Device, *mut c_uint, *mut ProcessInfoV3) -> Ret>(
                    b"nvmlDeviceGetComputeRunningProcesses_v3\0",
                )?;
            let mut infos = [ProcessInfoV3::default(); 128];
            let mut count: c_uint = infos.len() as c_uint;
            // SAFETY: count is the capacity of infos.
            let rc = unsafe { f(dev, &mut count, infos.as_mut_ptr()) };
            Self::check(rc, "nvmlDeviceGetComputeRunningProcesses_v3", gpu)?;
            Ok(infos[..(count as usize).min(infos.len())]
                .iter()
                .map(|p| GpuProcess {
                    pid: p.pid,
                    used_mib: p.used_gpu_memory >> 20,
                })
                .collect())
        }

        fn memory_used_mib(&mut self, gpu: &SliceGpu) -> Result<u64, GpuCheckError> {
            let dev = self.device(gpu)?;
            let f = self.symbol::<unsafe extern "C" fn(Device, *mut Memory) -> Ret>(
                b"nvmlDeviceGetMemoryInfo\0",
            )?;
            let mut m = Memory::default();
            // SAFETY: valid out-pointer.
            let rc = unsafe { f(dev, &mut m) };
            Self::check(rc, "nvmlDeviceGetMemoryInfo", gpu)?;
            Ok(m.used >> 20)
        }

        fn max_graphics_clock_mhz(&mut self, gpu: &SliceGpu) -> Result<u32, GpuCheckError> {
            let dev = self.device(gpu)?;
            let f = self.symbol::<unsafe extern "C" fn(Device, c_uint, *mut c_uint) -> Ret>(
                b"nvmlDeviceGetMaxClockInfo\0",
            )?;
            let mut mhz: c_uint = 0;
            // SAFETY: valid out-pointer.
            let rc = unsafe { f(dev, CLOCK_GRAPHICS, &mut mhz) };
            Self::check(rc, "nvmlDeviceGetMaxClockInfo", gpu)?;
            Ok(mhz)
        }

        fn lock_graphics_clock(&mut self, gpu: &SliceGpu, mhz: u32) -> Result<(), GpuCheckError> {
            let dev = self.device(gpu)?;
            let f = self.symbol::<unsafe extern "C" fn(Device, c_uint, c_uint) -> Ret>(
                b"nvmlDeviceSetGpuLockedClocks\0",
            )?;
            // SAFETY: plain values.
            let rc = unsafe { f(dev, mhz, mhz) };
            Self::check(rc, "nvmlDeviceSetGpuLockedClocks", gpu)
        }

        fn reset_graphics_clock(&mut self, gpu: &SliceGpu) -> Result<(), GpuCheckError> {
            let dev = self.device(gpu)?;
            let f = self.symbol::<unsafe extern "C" fn(Device) -> Ret>(
                b"nvmlDeviceResetGpuLockedClocks\0",
            )?;
            // SAFETY: device handle from NVML.
            let rc = unsafe { f(dev) };
            Self::check(rc, "nvmlDeviceResetGpuLockedClocks", gpu)
        }
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
                    call: "nvmlDeviceSetGpuLockedClocks",
                    bus_id: gpu.pci_bus_id.clone(),
                    code: 4,
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
            kernelkite_testkit::skip("this machine has the NVIDIA driver");
            return;
        }
        match Nvml::load() {
            Err(e) => assert!(e.to_string().contains("libnvidia-ml.so.1"), "{e}"),
            Ok(_) => kernelkite_testkit::skip("NVML loaded although no /dev/nvidiactl"),
        }
    }
}
