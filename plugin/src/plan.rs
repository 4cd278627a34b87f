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
    Nvidia,
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

/// The GPU a slice owns, as other tools need to name it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SliceGpu {
    pub vendor: Vendor,
    /// Canonical `dddd:bb:dd.f`, lower-case hex.
    pub pci_bus_id: String,
    /// `GPU-...` for NVIDIA when the driver or NVML told us; `None` otherwise.
    pub uuid: Option<String>,
    /// NUMA node the GPU hangs off; `None` when the firmware reports -1.
    pub numa_node: Option<u32>,
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

/// A whole node's plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub slices: Vec<Slice>,
    /// CPUs kept for the OS and the agent (housekeeping), sorted ascending.
    pub reserved_cpus: Vec<u32>,
    /// Things the operator should know (leftover cores, remote NUMA placement, ...).
    pub warnings: Vec<String>,
}

/// Formats a CPU list the way the kernel and cgroups write it: `0-13,112-125`.
pub fn format_cpu_list(cpus: &[u32]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out = String::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        // checked: a CPU id of u32::MAX (from a hand-edited plan) must not overflow.
        while i + 1 < sorted.len() && end.checked_add(1) == Some(sorted[i + 1]) {
            i += 1;
            end = sorted[i];
        }
        if !out.is_empty() {
            out.push(',');
        }
        if start == end {
            out.push_str(&start.to_string());
        } else {
            out.push_str(&format!("{start}-{end}"));
        }
        i += 1;
    }
    out
}

/// Error from [`parse_cpu_list`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid CPU list {input:?}: {reason} (expected a list like \"0-13,112-125\")")]
pub struct CpuListError {
    pub input: String,
    pub reason: String,
}

/// Parses the kernel's list format (`0-3,8,10-11`, blank = empty), as found in sysfs.
pub fn parse_cpu_list(input: &str) -> Result<Vec<u32>, CpuListError> {
    let err = |reason: &str| CpuListError {
        input: input.to_string(),
        reason: reason.to_string(),
    };
    let mut out = Vec::new();
    for part in input
        .trim()
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        match part.split_once('-') {
            Some((a, b)) => {
                let a: u32 = a.trim().parse().map_err(|_| err("not a number"))?;
                let b: u32 = b.trim().parse().map_err(|_| err("not a number"))?;
                if b < a {
                    return Err(err("range ends before it starts"));
                }
                if b - a > 1 << 20 {
                    return Err(err("range too large"));
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().map_err(|_| err("not a number"))?),
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn formats_ranges_like_the_kernel() {
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 112, 113, 5]), "0-3,5,112-113");
        assert_eq!(format_cpu_list(&[]), "");
        assert_eq!(format_cpu_list(&[7]), "7");
        assert_eq!(
            format_cpu_list(&[u32::MAX - 1, u32::MAX]),
            format!("{}-{}", u32::MAX - 1, u32::MAX)
        );
    }

    #[test]
    fn vendor_display_matches_its_json_name() {
        for v in [Vendor::Nvidia, Vendor::Amd] {
            assert_eq!(serde_json::to_value(v).unwrap(), v.to_string());
        }
    }

    #[test]
    fn rejects_garbage_lists() {
        assert!(parse_cpu_list("3-1").is_err());
        assert!(parse_cpu_list("a").is_err());
        assert_eq!(parse_cpu_list("\n").unwrap(), Vec::<u32>::new());
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

    proptest! {
        #[test]
        fn cpu_list_round_trips(mut cpus in proptest::collection::vec(0u32..4096, 0..300)) {
            cpus.sort_unstable();
            cpus.dedup();
            prop_assert_eq!(parse_cpu_list(&format_cpu_list(&cpus)).unwrap(), cpus);
        }
    }
}
