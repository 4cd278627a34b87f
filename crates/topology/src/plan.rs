//! The plan: which GPU, CPUs and memory each slice of a node gets.
//!
//! This is the data contract between the planner (`kernelkite-isolate plan`), the hooks that
//! enforce a slice, and node set-up. Its JSON form is stable and documented in the README:
//! `{"slices":[{"index":0,"gpu":{"vendor":"nvidia","pci_bus_id":"0000:18:00.0","uuid":null,
//! "numa_node":0},"cpus":[0,1],"mems":[0],"memory_bytes":0}],"reserved_cpus":[],"warnings":[]}`

use serde::{Deserialize, Serialize};

/// GPU vendor, by PCI vendor id (0x10de NVIDIA, 0x1002 AMD).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Vendor {
    /// NVIDIA (0x10de).
    Nvidia,
    /// AMD (0x1002).
    Amd,
}

impl Vendor {
    /// The name used in the JSON plan and in human output.
    pub fn as_str(self) -> &'static str {
        match self {
            Vendor::Nvidia => "nvidia",
            Vendor::Amd => "amd",
        }
    }
}

impl std::fmt::Display for Vendor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A MIG device (a compute instance within a GPU instance) of an NVIDIA GPU in MIG mode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigInstance {
    /// `MIG-…`, what `CUDA_VISIBLE_DEVICES` takes.
    pub uuid: String,
    /// The GPU instance id: with the parent's minor, it names the instance's capability
    /// (`gpu<minor>/gi<id>/access` in `/proc/driver/nvidia-caps/mig-minors`).
    pub gpu_instance_id: u32,
    /// The compute instance id within the GPU instance (`…/gi<id>/ci<id>/access`).
    pub compute_instance_id: u32,
    /// Its memory, in bytes.
    pub memory_bytes: u64,
}

/// The GPU a slice owns, as other tools need to name it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SliceGpu {
    /// Who made it.
    pub vendor: Vendor,
    /// Canonical `dddd:bb:dd.f`, lower-case hex.
    pub pci_bus_id: String,
    /// `GPU-...`: NVIDIA's when the driver or NVML told us, AMD's from the KFD topology
    /// (`GPU-<unique_id as 16 hex digits>`, what `ROCR_VISIBLE_DEVICES` takes); `None` otherwise.
    pub uuid: Option<String>,
    /// NUMA node the GPU hangs off; `None` when the firmware reports -1.
    pub numa_node: Option<u32>,
    /// The MIG device of the GPU the slice owns, when the GPU is in MIG mode: then `uuid` is
    /// the MIG device's, and the slice shares the GPU (`pci_bus_id`) with the other
    /// instances' slices. Omitted from JSON for whole GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigInstance>,
}

/// One slice: a GPU (or none, for CPU-only slices), whole cores, memory nodes and a limit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slice {
    /// Slice number; equals the GPU's index in PCI bus order when slices have one GPU each.
    pub index: u32,
    /// First (or only) GPU of the slice; `None` for CPU-only slices.
    pub gpu: Option<SliceGpu>,
    /// Further GPUs when a slice has `gpus: N > 1`. Omitted from JSON when empty so the
    /// one-GPU shape stays exactly as documented.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extra_gpus: Vec<SliceGpu>,
    /// Logical CPU ids, sorted ascending.
    pub cpus: Vec<u32>,
    /// NUMA memory nodes (`cpuset.mems`), sorted ascending.
    pub mems: Vec<u32>,
    /// Memory limit in bytes.
    pub memory_bytes: u64,
}

impl Slice {
    /// The slice's GPUs: `gpu`, then `extra_gpus` (none for a CPU-only slice).
    pub fn gpus(&self) -> Vec<&SliceGpu> {
        self.gpu.iter().chain(&self.extra_gpus).collect()
    }

    /// Sets the slice's GPUs: the first becomes `gpu`, the rest `extra_gpus`.
    pub fn set_gpus(&mut self, gpus: impl IntoIterator<Item = SliceGpu>) {
        let mut gpus = gpus.into_iter();
        self.gpu = gpus.next();
        self.extra_gpus = gpus.collect();
    }
}

/// A whole node's plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// The slices, by index.
    pub slices: Vec<Slice>,
    /// CPUs kept for the OS and the agent (housekeeping), sorted ascending.
    pub reserved_cpus: Vec<u32>,
    /// Things the operator should know (leftover cores, remote NUMA placement, ...).
    pub warnings: Vec<String>,
}

impl Plan {
    /// Whether a slice holds a MIG device: such a plan is only as good as this boot's MIG
    /// layout, which a reboot or a reconfiguration changes.
    pub fn names_mig(&self) -> bool {
        self.slices
            .iter()
            .flat_map(Slice::gpus)
            .any(|g| g.mig.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vendor_display_matches_its_json_name() {
        for v in [Vendor::Nvidia, Vendor::Amd] {
            assert_eq!(serde_json::to_value(v).unwrap(), v.to_string());
        }
    }

    #[test]
    fn documented_json_shape_is_stable() {
        let plan = Plan {
            slices: vec![Slice {
                index: 0,
                gpu: Some(SliceGpu {
                    vendor: Vendor::Nvidia,
                    pci_bus_id: "0000:18:00.0".into(),
                    uuid: None,
                    numa_node: Some(0),
                    mig: None,
                }),
                extra_gpus: vec![],
                cpus: vec![0, 1],
                mems: vec![0],
                memory_bytes: 0,
            }],
            reserved_cpus: vec![],
            warnings: vec![],
        };
        assert_eq!(
            serde_json::to_string(&plan).unwrap(),
            r#"{"slices":[{"index":0,"gpu":{"vendor":"nvidia","pci_bus_id":"0000:18:00.0","uuid":null,"numa_node":0},"cpus":[0,1],"mems":[0],"memory_bytes":0}],"reserved_cpus":[],"warnings":[]}"#
        );
    }
}
