//! NVML (`libnvidia-ml.so.1`), the one loader every crate uses.
//!
//! The library ships with the NVIDIA driver, not with us: linking against it would make the
//! binaries unusable on AMD and CPU-only nodes. `nvml-wrapper` opens it at run time, so a
//! machine without the driver gets an [`NvmlError::Load`] that says so, never a crash.
//!
//! Callers keep their own test seams: the topology consults NVML only for a live root, the
//! runner only when its probe asks for it, and the hooks reach it through their `GpuControl`
//! trait, so all of them are tested without a GPU.

use nvml_wrapper::bitmasks::device::ThrottleReasons;
use nvml_wrapper::enum_wrappers::device::{
    Clock, EccCounter, MemoryError, P2pCapabilitiesIndex, P2pStatus, TemperatureSensor,
};
use nvml_wrapper::enums::device::{GpuLockedClocksSetting, UsedGpuMemory};
use nvml_wrapper::Device;

/// The file name the driver installs NVML under.
pub const LIBRARY: &str = "libnvidia-ml.so.1";

/// The error `nvml-wrapper` reports: an NVML return code, or why the library did not load.
pub use nvml_wrapper::error::NvmlError as DriverError;

/// Why NVML could not be used.
#[derive(Debug, thiserror::Error)]
pub enum NvmlError {
    /// The library is not there (no NVIDIA driver) or could not be opened.
    #[error("cannot load {library}: {source} (install the NVIDIA driver, or ignore this on non-NVIDIA nodes)")]
    Load {
        /// The library name or path that was tried.
        library: String,
        /// What the dynamic loader said.
        #[source]
        source: DriverError,
    },
    /// The library opened but lacks an NVML entry point.
    #[error("{library} lacks an NVML entry point ({source}): the driver is too old (need R510 or later), or the file is not NVML")]
    Symbol {
        /// The library name or path that was opened.
        library: String,
        /// Which symbol was missing, as the loader said.
        #[source]
        source: DriverError,
    },
    /// An NVML call returned an error.
    #[error("{call} failed: {source}")]
    Call {
        /// The NVML function.
        call: &'static str,
        /// NVML's return code.
        #[source]
        source: DriverError,
    },
}

impl NvmlError {
    fn call(call: &'static str) -> impl FnOnce(DriverError) -> NvmlError {
        move |source| match source {
            DriverError::FailedToLoadSymbol(_) => NvmlError::Symbol {
                library: LIBRARY.to_string(),
                source,
            },
            source => NvmlError::Call { call, source },
        }
    }
}

/// What NVML tells about one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The PCI bus id as NVML writes it (`00000000:18:00.0`).
    pub pci_bus_id: String,
    /// `GPU-…`, when NVML could read it.
    pub uuid: Option<String>,
    /// The `N` of `/dev/nvidiaN`.
    pub minor: Option<u32>,
    /// The marketing name (`NVIDIA H100 80GB HBM3`).
    pub name: Option<String>,
    /// Its MIG devices when MIG mode is on (empty when off or unsupported), in NVML's order.
    pub mig: Vec<MigDeviceInfo>,
    /// MIG mode is on now (`nvmlDeviceGetMigMode`'s current mode): CUDA can use the GPU only
    /// through its MIG devices, which may be none yet (`mig` empty), so it is never a whole GPU.
    pub mig_enabled: bool,
    /// Bus ids (as NVML writes them) of the other GPUs it reaches over NVLink, directly or
    /// through NVSwitch (`nvmlDeviceGetP2PStatus` with the NVLink capability).
    pub nvlink_peers: Vec<String>,
}

/// One MIG device (a compute instance within a GPU instance) as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigDeviceInfo {
    /// `MIG-…`: what `CUDA_VISIBLE_DEVICES` takes to show the process this device only.
    pub uuid: String,
    /// The GPU instance id (`gi`), which names its capability in `/proc/driver/nvidia-caps`.
    pub gpu_instance_id: u32,
    /// The compute instance id (`ci`) within the GPU instance.
    pub compute_instance_id: u32,
    /// Its memory, in bytes.
    pub memory_bytes: u64,
    /// NVML's name for it (`NVIDIA H100 80GB HBM3 MIG 1g.10gb`), when it has one.
    pub name: Option<String>,
}

/// Which instance id of a MIG device.
#[derive(Debug, Clone, Copy)]
enum InstanceId {
    Gpu,
    Compute,
}

/// A GPU's state at one moment, for a run's provenance: each field is what NVML answered,
/// `None` where the GPU or driver does not say (a MIG device has no clocks of its own, a GPU
/// without ECC no error counts).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reading {
    /// The SM clock now, MHz.
    pub sm_clock_mhz: Option<u32>,
    /// The memory clock now, MHz.
    pub mem_clock_mhz: Option<u32>,
    /// The power limit the driver enforces now, milliwatts.
    pub power_limit_mw: Option<u32>,
    /// The die temperature, °C.
    pub temperature_c: Option<u32>,
    /// Uncorrected ECC errors since the driver loaded (volatile counter).
    pub ecc_uncorrected: Option<u64>,
    /// Why the clocks are held down now (nvml.h's `nvmlClocksEventReason*` bits, by name).
    pub throttle: Vec<&'static str>,
}

/// The names of the clock event (throttle) reasons, as nvml.h defines their bits; the idle
/// bit is left out: a GPU sampled between kernels is idle, which says nothing of its health.
const THROTTLE_NAMES: &[(ThrottleReasons, &str)] = &[
    (
        ThrottleReasons::APPLICATIONS_CLOCKS_SETTING,
        "applications_clocks",
    ),
    (ThrottleReasons::SW_POWER_CAP, "sw_power_cap"),
    (ThrottleReasons::HW_SLOWDOWN, "hw_slowdown"),
    (ThrottleReasons::SYNC_BOOST, "sync_boost"),
    (ThrottleReasons::SW_THERMAL_SLOWDOWN, "sw_thermal_slowdown"),
    (ThrottleReasons::HW_THERMAL_SLOWDOWN, "hw_thermal_slowdown"),
    (
        ThrottleReasons::HW_POWER_BRAKE_SLOWDOWN,
        "hw_power_brake_slowdown",
    ),
    (ThrottleReasons::DISPLAY_CLOCK_SETTING, "display_clock"),
];

/// A compute process on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComputeProcess {
    /// Its pid (in NVML's pid namespace, the host's).
    pub pid: u32,
    /// GPU memory it uses, in bytes, when the driver reports it.
    pub used_bytes: Option<u64>,
}

/// A loaded and initialised NVML; shut down when dropped.
pub struct Nvml {
    inner: nvml_wrapper::Nvml,
}

impl std::fmt::Debug for Nvml {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvml").finish_non_exhaustive()
    }
}

impl Nvml {
    /// Loads the driver's [`LIBRARY`] and initialises it.
    pub fn load() -> Result<Nvml, NvmlError> {
        Self::load_from(LIBRARY)
    }

    /// Loads NVML from a given library name or path (tests point it at one that is absent,
    /// or at a library that is not NVML).
    pub fn load_from(library: &str) -> Result<Nvml, NvmlError> {
        let inner = nvml_wrapper::Nvml::builder()
            .lib_path(std::ffi::OsStr::new(library))
            .init()
            .map_err(|source| match source {
                DriverError::LibloadingError(_) => NvmlError::Load {
                    library: library.to_string(),
                    source,
                },
                DriverError::FailedToLoadSymbol(_) => NvmlError::Symbol {
                    library: library.to_string(),
                    source,
                },
                source => NvmlError::Call {
                    call: "nvmlInit_v2",
                    source,
                },
            })?;
        Ok(Nvml { inner })
    }

    /// How many GPUs NVML sees (all of them, whatever `CUDA_VISIBLE_DEVICES` says).
    pub fn device_count(&self) -> Result<u32, NvmlError> {
        self.inner
            .device_count()
            .map_err(NvmlError::call("nvmlDeviceGetCount_v2"))
    }

    /// The name of the GPU at NVML's `index`.
    pub fn device_name(&self, index: u32) -> Result<String, NvmlError> {
        let device = self
            .inner
            .device_by_index(index)
            .map_err(NvmlError::call("nvmlDeviceGetHandleByIndex_v2"))?;
        device.name().map_err(NvmlError::call("nvmlDeviceGetName"))
    }

    /// Every GPU NVML lets this process use (those it may not, NO_PERMISSION, are left out),
    /// with its MIG devices and NVLink peers. The bus id is required; the rest is filled when
    /// NVML has it.
    pub fn devices(&self) -> Result<Vec<DeviceInfo>, NvmlError> {
        let count = self.device_count()?;
        let mut handles = Vec::with_capacity(count as usize);
        let mut out = Vec::with_capacity(count as usize);
        for index in 0..count {
            let device = match self.inner.device_by_index(index) {
                Ok(d) => d,
                // nvmlDeviceGetCount_v2 counts the GPUs this process may not use too, and NVML
                // answers NO_PERMISSION for each (nvml.h): not this process's (a job's
                // sandbox), so left out; the enumeration goes on past them.
                Err(DriverError::NoPermission) => continue,
                Err(e) => return Err(NvmlError::call("nvmlDeviceGetHandleByIndex_v2")(e)),
            };
            let pci = device
                .pci_info()
                .map_err(NvmlError::call("nvmlDeviceGetPciInfo_v3"))?;
            out.push(DeviceInfo {
                pci_bus_id: pci.bus_id,
                uuid: device.uuid().ok(),
                minor: device.minor_number().ok(),
                name: device.name().ok(),
                mig: self.mig_devices(&device)?,
                mig_enabled: mig_enabled(&device),
                nvlink_peers: Vec::new(),
            });
            handles.push(device);
        }
        for (i, a) in handles.iter().enumerate() {
            for (j, b) in handles.iter().enumerate() {
                // A GPU or driver without NVLink answers NotSupported, for the call or the pair.
                let linked = i != j
                    && matches!(
                        a.p2p_status(b, P2pCapabilitiesIndex::NvLink),
                        Ok(P2pStatus::Ok)
                    );
                if linked {
                    let peer = out[j].pci_bus_id.clone();
                    out[i].nvlink_peers.push(peer);
                }
            }
        }
        Ok(out)
    }

    /// The MIG devices of `device` when MIG mode is on now (a pending change needs a GPU
    /// reset first, so it does not count). GPUs without MIG say NotSupported: none.
    fn mig_devices(&self, device: &Device<'_>) -> Result<Vec<MigDeviceInfo>, NvmlError> {
        if !mig_enabled(device) {
            return Ok(Vec::new());
        }
        let max = device
            .mig_device_count()
            .map_err(NvmlError::call("nvmlDeviceGetMaxMigDeviceCount"))?;
        let mut out = Vec::new();
        for index in 0..max {
            // Indices without a MIG device behind them answer NotFound; they are skipped.
            let Ok(mig) = device.mig_device_by_index(index) else {
                continue;
            };
            out.push(MigDeviceInfo {
                uuid: mig.uuid().map_err(NvmlError::call("nvmlDeviceGetUUID"))?,
                gpu_instance_id: self.instance_id(&mig, InstanceId::Gpu)?,
                compute_instance_id: self.instance_id(&mig, InstanceId::Compute)?,
                memory_bytes: mig
                    .memory_info()
                    .map(|m| m.total)
                    .map_err(NvmlError::call("nvmlDeviceGetMemoryInfo_v2"))?,
                name: mig.name().ok(),
            });
        }
        Ok(out)
    }

    /// A MIG device's GPU or compute instance id: nvml-wrapper 0.13 binds these calls but does
    /// not wrap them, so they are made here through its loaded library.
    fn instance_id(&self, mig: &Device<'_>, which: InstanceId) -> Result<u32, NvmlError> {
        let lib = self.inner.lib();
        let (call, function) = match which {
            InstanceId::Gpu => (
                "nvmlDeviceGetGpuInstanceId",
                lib.nvmlDeviceGetGpuInstanceId.as_ref().ok(),
            ),
            InstanceId::Compute => (
                "nvmlDeviceGetComputeInstanceId",
                lib.nvmlDeviceGetComputeInstanceId.as_ref().ok(),
            ),
        };
        let Some(function) = function else {
            return Err(NvmlError::Symbol {
                library: LIBRARY.to_string(),
                source: DriverError::FailedToLoadSymbol(call.to_string()),
            });
        };
        let mut id: std::os::raw::c_uint = 0;
        // SAFETY: `mig` is a live handle of this NVML (it borrows `self.inner`), and `id` is a
        // valid place for the one `unsigned int` the function writes.
        let code = unsafe { function(mig.handle(), &mut id) };
        nvml_wrapper::error::nvml_try(code).map_err(NvmlError::call(call))?;
        Ok(id)
    }

    /// The device `id` names: a MIG device by its `MIG-…` uuid, else a GPU by its bus id.
    fn device(&self, id: &str) -> Result<Device<'_>, NvmlError> {
        if id.starts_with("MIG-") {
            return self
                .inner
                .device_by_uuid(id)
                .map_err(NvmlError::call("nvmlDeviceGetHandleByUUID"));
        }
        self.inner
            .device_by_pci_bus_id(id)
            .map_err(NvmlError::call("nvmlDeviceGetHandleByPciBusId_v2"))
    }

    /// The compute processes running on the GPU at `bus_id`, or on the MIG device whose uuid
    /// it is.
    pub fn compute_processes(&self, bus_id: &str) -> Result<Vec<ComputeProcess>, NvmlError> {
        let processes = self
            .device(bus_id)?
            .running_compute_processes()
            .map_err(NvmlError::call("nvmlDeviceGetComputeRunningProcesses_v3"))?;
        Ok(processes
            .into_iter()
            .map(|p| ComputeProcess {
                pid: p.pid,
                used_bytes: match p.used_gpu_memory {
                    UsedGpuMemory::Used(bytes) => Some(bytes),
                    UsedGpuMemory::Unavailable => None,
                },
            })
            .collect())
    }

    /// GPU memory in use on the GPU at `bus_id` (or the MIG device whose uuid it is), in bytes.
    pub fn memory_used_bytes(&self, bus_id: &str) -> Result<u64, NvmlError> {
        self.device(bus_id)?
            .memory_info()
            .map(|m| m.used)
            .map_err(NvmlError::call("nvmlDeviceGetMemoryInfo_v2"))
    }

    /// The highest graphics clock the GPU at `bus_id` supports, in MHz.
    pub fn max_graphics_clock_mhz(&self, bus_id: &str) -> Result<u32, NvmlError> {
        self.device(bus_id)?
            .max_clock_info(Clock::Graphics)
            .map_err(NvmlError::call("nvmlDeviceGetMaxClockInfo"))
    }

    /// The driver's version (`550.54.15`).
    pub fn driver_version(&self) -> Result<String, NvmlError> {
        self.inner
            .sys_driver_version()
            .map_err(NvmlError::call("nvmlSystemGetDriverVersion"))
    }

    /// The VBIOS version of the GPU at `bus_id`.
    pub fn vbios_version(&self, bus_id: &str) -> Result<String, NvmlError> {
        self.device(bus_id)?
            .vbios_version()
            .map_err(NvmlError::call("nvmlDeviceGetVbiosVersion"))
    }

    /// What the GPU at `bus_id` (or the MIG device whose uuid it is) says of its clocks,
    /// power limit, temperature and errors now; a field it does not report stays `None`.
    pub fn reading(&self, bus_id: &str) -> Result<Reading, NvmlError> {
        let d = self.device(bus_id)?;
        let throttle = d
            .current_throttle_reasons()
            .map(|bits| {
                THROTTLE_NAMES
                    .iter()
                    .filter(|(bit, _)| bits.contains(*bit))
                    .map(|(_, name)| *name)
                    .collect()
            })
            .unwrap_or_default();
        Ok(Reading {
            sm_clock_mhz: d.clock_info(Clock::SM).ok(),
            mem_clock_mhz: d.clock_info(Clock::Memory).ok(),
            power_limit_mw: d.enforced_power_limit().ok(),
            temperature_c: d.temperature(TemperatureSensor::Gpu).ok(),
            ecc_uncorrected: d
                .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
                .ok(),
            throttle,
        })
    }

    /// The highest SM clock the GPU at `bus_id` supports, in MHz.
    pub fn max_sm_clock_mhz(&self, bus_id: &str) -> Result<u32, NvmlError> {
        self.device(bus_id)?
            .max_clock_info(Clock::SM)
            .map_err(NvmlError::call("nvmlDeviceGetMaxClockInfo"))
    }

    /// Locks the graphics clock of the GPU at `bus_id` to `mhz` (needs root).
    pub fn lock_graphics_clock(&self, bus_id: &str, mhz: u32) -> Result<(), NvmlError> {
        self.device(bus_id)?
            .set_gpu_locked_clocks(GpuLockedClocksSetting::Numeric {
                min_clock_mhz: mhz,
                max_clock_mhz: mhz,
            })
            .map_err(NvmlError::call("nvmlDeviceSetGpuLockedClocks"))
    }

    /// Lets the GPU at `bus_id` pick its clocks again (needs root).
    pub fn reset_graphics_clock(&self, bus_id: &str) -> Result<(), NvmlError> {
        self.device(bus_id)?
            .reset_gpu_locked_clocks()
            .map_err(NvmlError::call("nvmlDeviceResetGpuLockedClocks"))
    }
}

/// Whether MIG mode is on now (`NVML_DEVICE_MIG_ENABLE`, 1 in nvml.h, as the current mode; a
/// pending change waits for a GPU reset). A GPU without MIG answers NotSupported: off.
fn mig_enabled(device: &Device<'_>) -> bool {
    device.mig_mode().is_ok_and(|mode| mode.current == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_an_error_not_a_crash() {
        let err = Nvml::load_from("libnvidia-ml-definitely-absent.so.1").err();
        assert!(matches!(err, Some(NvmlError::Load { .. })), "{err:?}");
        let text = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("install the NVIDIA driver"), "{text}");
        assert!(
            text.contains("libnvidia-ml-definitely-absent.so.1"),
            "{text}"
        );
    }

    #[test]
    fn a_library_without_nvml_symbols_is_reported() {
        // libc is always loadable and has no nvmlInit_v2.
        let err = Nvml::load_from("libc.so.6").err();
        assert!(matches!(err, Some(NvmlError::Symbol { .. })), "{err:?}");
        let text = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("nvmlInit_v2"), "{text}");
        assert!(text.contains("too old"), "{text}");
    }

    #[test]
    fn the_cause_is_kept() {
        use std::error::Error as _;
        let err = Nvml::load_from("libnvidia-ml-definitely-absent.so.1")
            .expect_err("the library is absent");
        let source = err.source().expect("the loader's error is the source");
        assert!(matches!(
            source.downcast_ref::<DriverError>(),
            Some(DriverError::LibloadingError(_))
        ));
    }

    #[test]
    fn the_driver_s_library_loads_or_says_why() {
        match Nvml::load() {
            Ok(nvml) => {
                // A machine with the driver: what it lists must be self-consistent.
                let count = nvml.device_count().expect("NVML counts its GPUs");
                let devices = nvml.devices().expect("NVML lists its GPUs");
                assert_eq!(devices.len(), count as usize);
                for d in &devices {
                    assert!(d.pci_bus_id.contains(':'), "{d:?}");
                    let used = nvml.memory_used_bytes(&d.pci_bus_id);
                    assert!(used.is_ok(), "{used:?}");
                    let procs = nvml.compute_processes(&d.pci_bus_id);
                    assert!(procs.is_ok(), "{procs:?}");
                    let max = nvml
                        .max_graphics_clock_mhz(&d.pci_bus_id)
                        .expect("NVML gives the maximum graphics clock");
                    assert!(max > 0);
                    // Locking changes a shared GPU (a running job's locked clocks, an
                    // operator's): only where asked for, and only on an idle GPU.
                    let asked = std::env::var_os("KERNELKITE_TEST_LOCK_CLOCKS").is_some();
                    if !asked || !procs.as_ref().is_ok_and(Vec::is_empty) {
                        println!("nvml: {d:?}, {max} MHz max, {procs:?} (clocks left alone)");
                        continue;
                    }
                    // Needs root and a GPU that allows it; restored at once.
                    match nvml.lock_graphics_clock(&d.pci_bus_id, max) {
                        Ok(()) => nvml
                            .reset_graphics_clock(&d.pci_bus_id)
                            .expect("a locked clock is reset"),
                        Err(NvmlError::Call {
                            source: DriverError::NoPermission | DriverError::NotSupported,
                            ..
                        }) => {}
                        Err(e) => panic!("locking {} at {max} MHz: {e}", d.pci_bus_id),
                    }
                    println!("nvml: {d:?}, {max} MHz max, {procs:?}");
                }
            }
            Err(e) => {
                assert!(
                    matches!(e, NvmlError::Load { .. } | NvmlError::Call { .. }),
                    "{e:?}"
                );
                assert!(e.to_string().contains(LIBRARY) || e.to_string().contains("nvmlInit_v2"));
                kernelkite_testkit_leaf::skip(format_args!("no NVIDIA driver here: {e}"));
            }
        }
    }
}
