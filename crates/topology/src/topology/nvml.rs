//! NVIDIA UUIDs and minor numbers from NVML, loaded at run time.
//!
//! `libnvidia-ml.so.1` ships with the driver, not with us: linking against it would make the
//! binary unusable on AMD and CPU-only nodes. It is opened with `dlopen` when present; when it
//! is not, discovery carries on with what sysfs and `/proc/driver/nvidia` said.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use super::{canonical_bus_id, Gpu};

/// Why NVML could not be used.
#[derive(Debug, thiserror::Error)]
pub enum NvmlError {
    #[error("cannot load {name}: {source} (install the NVIDIA driver, or ignore this on non-NVIDIA nodes)")]
    Load {
        name: String,
        #[source]
        source: libloading::Error,
    },
    #[error("NVML has no symbol {0}: the driver is too old (need R450 or later)")]
    Symbol(&'static str),
    #[error("{call} failed with NVML error {code}")]
    Call { call: &'static str, code: c_int },
}

/// What NVML tells us about one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmlDevice {
    pub pci_bus_id: String,
    pub uuid: Option<String>,
    pub minor: Option<u32>,
    pub name: Option<String>,
}

type Device = *mut c_void;

/// `nvmlPciInfo_t` as of NVML's v3 PCI call.
#[repr(C)]
struct PciInfo {
    bus_id_legacy: [c_char; 16],
    domain: c_uint,
    bus: c_uint,
    device: c_uint,
    pci_device_id: c_uint,
    pci_sub_system_id: c_uint,
    bus_id: [c_char; 32],
}

/// A loaded NVML; shut down when dropped.
pub struct Nvml {
    lib: libloading::Library,
}

impl Nvml {
    /// Loads the driver's `libnvidia-ml.so.1` and initialises it.
    pub fn load() -> Result<Nvml, NvmlError> {
        Self::load_from("libnvidia-ml.so.1")
    }

    /// Loads NVML from a given library name or path (tests point it at one that is absent).
    pub fn load_from(name: &str) -> Result<Nvml, NvmlError> {
        // SAFETY: loading NVML runs its initialisers, which only set up driver state.
        let lib = unsafe { libloading::Library::new(name) }.map_err(|source| NvmlError::Load {
            name: name.to_string(),
            source,
        })?;
        let nvml = Nvml { lib };
        // SAFETY: the signature matches nvml.h: nvmlReturn_t nvmlInit_v2(void).
        let init = unsafe {
            nvml.sym::<unsafe extern "C" fn() -> c_int>(b"nvmlInit_v2\0", "nvmlInit_v2")?
        };
        check("nvmlInit_v2", unsafe { init() })?;
        Ok(nvml)
    }

    /// # Safety
    /// `T` must be the C signature of the symbol.
    unsafe fn sym<T: Copy>(&self, symbol: &[u8], name: &'static str) -> Result<T, NvmlError> {
        unsafe { self.lib.get::<T>(symbol) }
            .map(|s| *s)
            .map_err(|_| NvmlError::Symbol(name))
    }

    /// Every GPU NVML sees.
    pub fn devices(&self) -> Result<Vec<NvmlDevice>, NvmlError> {
        // SAFETY: every signature below is copied from nvml.h.
        unsafe {
            let count_fn = self.sym::<unsafe extern "C" fn(*mut c_uint) -> c_int>(
                b"nvmlDeviceGetCount_v2\0",
                "nvmlDeviceGetCount_v2",
            )?;
            let handle_fn = self.sym::<unsafe extern "C" fn(c_uint, *mut Device) -> c_int>(
                b"nvmlDeviceGetHandleByIndex_v2\0",
                "nvmlDeviceGetHandleByIndex_v2",
            )?;
            let pci_fn = self.sym::<unsafe extern "C" fn(Device, *mut PciInfo) -> c_int>(
                b"nvmlDeviceGetPciInfo_v3\0",
                "nvmlDeviceGetPciInfo_v3",
            )?;
            let uuid_fn = self.sym::<unsafe extern "C" fn(Device, *mut c_char, c_uint) -> c_int>(
                b"nvmlDeviceGetUUID\0",
                "nvmlDeviceGetUUID",
            )?;
            let name_fn = self.sym::<unsafe extern "C" fn(Device, *mut c_char, c_uint) -> c_int>(
                b"nvmlDeviceGetName\0",
                "nvmlDeviceGetName",
            )?;
            let minor_fn = self.sym::<unsafe extern "C" fn(Device, *mut c_uint) -> c_int>(
                b"nvmlDeviceGetMinorNumber\0",
                "nvmlDeviceGetMinorNumber",
            )?;

            let mut count: c_uint = 0;
            check("nvmlDeviceGetCount_v2", count_fn(&mut count))?;
            let mut out = Vec::with_capacity(count as usize);
            for i in 0..count {
                let mut dev: Device = std::ptr::null_mut();
                check("nvmlDeviceGetHandleByIndex_v2", handle_fn(i, &mut dev))?;
                let mut pci: PciInfo = std::mem::zeroed();
                check("nvmlDeviceGetPciInfo_v3", pci_fn(dev, &mut pci))?;
                pci.bus_id[31] = 0;
                let bus = CStr::from_ptr(pci.bus_id.as_ptr())
                    .to_string_lossy()
                    .into_owned();
                let mut buf = [0 as c_char; 96];
                let uuid = (uuid_fn(dev, buf.as_mut_ptr(), buf.len() as c_uint) == 0)
                    .then(|| CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned());
                let mut nbuf = [0 as c_char; 96];
                let name = (name_fn(dev, nbuf.as_mut_ptr(), nbuf.len() as c_uint) == 0)
                    .then(|| CStr::from_ptr(nbuf.as_ptr()).to_string_lossy().into_owned());
                let mut minor: c_uint = 0;
                let minor = (minor_fn(dev, &mut minor) == 0).then_some(minor);
                out.push(NvmlDevice {
                    pci_bus_id: canonical_bus_id(&bus),
                    uuid,
                    minor,
                    name,
                });
            }
            Ok(out)
        }
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        // SAFETY: nvmlReturn_t nvmlShutdown(void); balanced with the successful init in load.
        if let Ok(shutdown) = unsafe {
            self.sym::<unsafe extern "C" fn() -> c_int>(b"nvmlShutdown\0", "nvmlShutdown")
        } {
            unsafe { shutdown() };
        }
    }
}

fn check(call: &'static str, code: c_int) -> Result<(), NvmlError> {
    if code == 0 {
        Ok(())
    } else {
        Err(NvmlError::Call { call, code })
    }
}

/// Fills UUIDs, minors and names that sysfs lacked, matching GPUs by PCI bus id. What the
/// driver's own files said wins; NVML only fills gaps.
pub fn merge(gpus: &mut [Gpu], devices: &[NvmlDevice]) {
    for dev in devices {
        if let Some(gpu) = gpus.iter_mut().find(|g| g.pci_bus_id == dev.pci_bus_id) {
            gpu.uuid = gpu.uuid.take().or_else(|| dev.uuid.clone());
            gpu.minor = gpu.minor.or(dev.minor);
            gpu.name = gpu.name.take().or_else(|| dev.name.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Vendor;

    #[test]
    fn a_missing_library_is_an_error_not_a_crash() {
        let err = Nvml::load_from("libnvidia-ml-definitely-absent.so.1").err();
        assert!(matches!(err, Some(NvmlError::Load { .. })), "{err:?}");
        assert!(err
            .map(|e| e.to_string())
            .unwrap_or_default()
            .contains("install the NVIDIA driver"));
    }

    #[test]
    fn a_library_without_nvml_symbols_is_reported() {
        // libc is always loadable and has no nvmlInit_v2.
        let err = Nvml::load_from("libc.so.6").err();
        assert!(
            matches!(err, Some(NvmlError::Symbol("nvmlInit_v2"))),
            "{err:?}"
        );
    }

    #[test]
    fn merge_fills_gaps_by_bus_id_only() {
        let gpu = |bus: &str, uuid: Option<&str>| Gpu {
            vendor: Vendor::Nvidia,
            pci_bus_id: bus.into(),
            numa_node: Some(0),
            local_cpus: vec![],
            uuid: uuid.map(str::to_string),
            minor: None,
            device_id: None,
            name: None,
        };
        let mut gpus = vec![
            gpu("0000:18:00.0", None),
            gpu("0000:2a:00.0", Some("GPU-from-proc")),
        ];
        merge(
            &mut gpus,
            &[
                NvmlDevice {
                    pci_bus_id: "0000:2a:00.0".into(),
                    uuid: Some("GPU-from-nvml".into()),
                    minor: Some(1),
                    name: None,
                },
                NvmlDevice {
                    pci_bus_id: "0000:18:00.0".into(),
                    uuid: Some("GPU-aaaa".into()),
                    minor: Some(0),
                    name: Some("NVIDIA H100".into()),
                },
            ],
        );
        assert_eq!(gpus[0].uuid.as_deref(), Some("GPU-aaaa"));
        assert_eq!(gpus[0].minor, Some(0));
        assert_eq!(gpus[1].uuid.as_deref(), Some("GPU-from-proc"));
        assert_eq!(gpus[1].minor, Some(1));
    }
}
