//! NVIDIA UUIDs and minor numbers from NVML, merged into what sysfs found.
//!
//! A thin adapter over [`kernelkite_sys::nvml`], the workspace's one NVML loader: this module
//! only puts NVML's bus ids in sysfs's spelling and fills the gaps the driver's files left.
//! When the library is absent, discovery carries on with what sysfs and `/proc/driver/nvidia`
//! said.

use super::{canonical_bus_id, Gpu};
use crate::plan::MigInstance;

pub use kernelkite_sys::nvml::{DeviceInfo as NvmlDevice, Nvml, NvmlError};

/// Every GPU NVML sees, with bus ids as sysfs writes them (`0000:18:00.0`).
pub fn devices(nvml: &Nvml) -> Result<Vec<NvmlDevice>, NvmlError> {
    nvml.devices().map(canonical)
}

fn canonical(devices: Vec<NvmlDevice>) -> Vec<NvmlDevice> {
    devices
        .into_iter()
        .map(|d| NvmlDevice {
            pci_bus_id: canonical_bus_id(&d.pci_bus_id),
            nvlink_peers: d.nvlink_peers.iter().map(|p| canonical_bus_id(p)).collect(),
            ..d
        })
        .collect()
}

/// Fills UUIDs, minors and names that sysfs lacked, matching GPUs by PCI bus id (what the
/// driver's own files said wins; NVML only fills gaps), and the MIG devices and NVLink peers
/// only NVML knows.
pub fn merge(gpus: &mut [Gpu], devices: &[NvmlDevice]) {
    for dev in devices {
        if let Some(gpu) = gpus.iter_mut().find(|g| g.pci_bus_id == dev.pci_bus_id) {
            gpu.uuid = gpu.uuid.take().or_else(|| dev.uuid.clone());
            gpu.minor = gpu.minor.or(dev.minor);
            gpu.name = gpu.name.take().or_else(|| dev.name.clone());
            gpu.mig = dev
                .mig
                .iter()
                .map(|m| MigInstance {
                    uuid: m.uuid.clone(),
                    gpu_instance_id: m.gpu_instance_id,
                    compute_instance_id: m.compute_instance_id,
                    memory_bytes: m.memory_bytes,
                })
                .collect();
            gpu.mig_enabled = dev.mig_enabled;
            gpu.links = dev.nvlink_peers.clone();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Vendor;

    #[test]
    fn nvml_bus_ids_take_sysfs_spelling() {
        let devs = canonical(vec![NvmlDevice {
            pci_bus_id: "00000000:2A:00.0".into(),
            uuid: None,
            minor: Some(3),
            name: None,
            mig: vec![],
            mig_enabled: false,
            nvlink_peers: vec!["00000000:2B:00.0".into()],
        }]);
        assert_eq!(devs[0].nvlink_peers, ["0000:2b:00.0"]);
        assert_eq!(devs[0].pci_bus_id, "0000:2a:00.0");
        assert_eq!(devs[0].minor, Some(3));
    }

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
            mig: vec![],
            mig_enabled: false,
            links: vec![],
            partitioning: None,
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
                    mig: vec![],
                    mig_enabled: false,
                    nvlink_peers: vec![],
                },
                NvmlDevice {
                    pci_bus_id: "0000:18:00.0".into(),
                    uuid: Some("GPU-aaaa".into()),
                    minor: Some(0),
                    name: Some("NVIDIA H100".into()),
                    mig: vec![],
                    mig_enabled: false,
                    nvlink_peers: vec![],
                },
            ],
        );
        assert_eq!(gpus[0].uuid.as_deref(), Some("GPU-aaaa"));
        assert_eq!(gpus[0].minor, Some(0));
        assert_eq!(gpus[1].uuid.as_deref(), Some("GPU-from-proc"));
        assert_eq!(gpus[1].minor, Some(1));
    }
}
