//! An 8× AMD Instinct MI300X node as the KFD topology shows it in sysfs (the layout libhsakmt
//! reads: `kernelkite_sys::kfd`), with a `/dev/dri` holding the render nodes a test chooses;
//! whole ([`write_mi300x`]) or in a compute-partitioning mode ([`write_mi300x_partitioned`]:
//! CPX, DPX, SPX beside its `amdgpu_xcp_*` devices).

use std::path::Path;

/// The GPUs' PCI buses, in node order: those of `kernelkite_topology::fakesys::mi300x_8`, so
/// the two fixtures make one node.
pub const MI300X_BUSES: [u8; 8] = [0x05, 0x15, 0x65, 0x75, 0x85, 0x95, 0xe5, 0xf5];

/// `0000:<bus>:00.0` of GPU `i`.
pub fn mi300x_bus_id(i: usize) -> String {
    format!("0000:{:02x}:00.0", MI300X_BUSES[i])
}

/// KFD's `unique_id` of GPU `i` (0 where `with_uuids` is false: GPUs without one).
pub fn mi300x_unique_id(i: usize, with_uuids: bool) -> u64 {
    if with_uuids {
        0x1d3a_0000_0000_0000 + i as u64
    } else {
        0
    }
}

/// Writes the topology under `root` (CPU nodes 0 and 1, GPU nodes 2..=9 with render minors
/// 128..=135 and xGMI links between every pair) and `root/dev/dri/renderD<128+i>` for each
/// `i` in `present`.
pub fn write_mi300x(root: &Path, present: &[usize], with_uuids: bool) -> std::io::Result<()> {
    let nodes = root.join("sys/devices/virtual/kfd/kfd/topology/nodes");
    for n in 0..10usize {
        let d = nodes.join(n.to_string());
        std::fs::create_dir_all(d.join("io_links"))?;
        let (gpu_id, props) = if n < 2 {
            (0, "cpu_cores_count 96\nsimd_count 0\n".to_string())
        } else {
            let i = n - 2;
            (
                40000 + n,
                format!(
                    "cpu_cores_count 0\nsimd_count 1216\ndrm_render_minor {}\nlocation_id {}\ndomain 0\nunique_id {}\nnum_xgmi {}\n",
                    128 + i,
                    u64::from(MI300X_BUSES[i]) << 8,
                    mi300x_unique_id(i, with_uuids),
                    7
                ),
            )
        };
        if n >= 2 {
            // An xGMI link (type 11) to every other GPU node, as on an MI300X platform.
            for (k, to) in (2..10usize).filter(|to| *to != n).enumerate() {
                let l = d.join("io_links").join(k.to_string());
                std::fs::create_dir_all(&l)?;
                std::fs::write(
                    l.join("properties"),
                    format!("type 11\nnode_from {n}\nnode_to {to}\nweight 15\n"),
                )?;
            }
        }
        std::fs::write(d.join("gpu_id"), format!("{gpu_id}\n"))?;
        std::fs::write(d.join("properties"), props)?;
    }
    std::fs::create_dir_all(root.join("dev/dri"))?;
    for i in present {
        std::fs::write(root.join(format!("dev/dri/renderD{}", 128 + i)), "")?;
    }
    Ok(())
}

/// How `unique_id` is written for a partitioned GPU's KFD nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Uuids {
    /// Every partition prints the GPU's id (amdkfd's `node_show` printing
    /// `adev->unique_id`: kernels before "drm/amdkfd: set uuid for each partition in
    /// topology", Aug 2025).
    Shared,
    /// Each partition prints its own (its XCD's `xcp->unique_id`, kernels with that patch).
    PerPartition,
    /// No `unique_id` (0).
    None,
}

/// The compute and memory partitioning `write_mi300x_partitioned` lays out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partitioning {
    /// `current_compute_partition`: `SPX`, `DPX`, `QPX` or `CPX`.
    pub compute: &'static str,
    /// `current_memory_partition`: `NPS1` or `NPS4`.
    pub memory: &'static str,
    /// KFD nodes per GPU: 1, 2, 4 or 8.
    pub per_gpu: usize,
    /// How `unique_id` is written.
    pub uuids: Uuids,
    /// The partition number in `location_id` bits 31:28 instead of 2:0: amdkfd wrote it there
    /// for a while, and amdsmi (`rsmi_dev_partition_id_get`) still reads both places.
    pub high_bits: bool,
    /// A `(gpu, partition)` KFD does not list: amdgpu found no DRM minor for it ("Skip xcp node
    /// #%d when out of drm node resource") and amdkfd adds no node without a render node; the
    /// CPX capture in ROCm/k8s-device-plugin's `testdata/topo-mi300-cpx` lists 63 nodes so.
    pub missing: Option<(usize, usize)>,
}

impl Partitioning {
    /// CPX compute (8 partitions of one XCD each) on NPS1 memory, ids shared per GPU.
    pub fn cpx() -> Partitioning {
        Partitioning {
            compute: "CPX",
            memory: "NPS1",
            per_gpu: 8,
            uuids: Uuids::Shared,
            high_bits: false,
            missing: None,
        }
    }

    /// DPX compute (2 partitions of four XCDs) on NPS1 memory, ids shared per GPU.
    pub fn dpx() -> Partitioning {
        Partitioning {
            compute: "DPX",
            per_gpu: 2,
            ..Partitioning::cpx()
        }
    }

    /// SPX, the default: one KFD node per GPU (the `amdgpu_xcp_*` devices exist anyway).
    pub fn spx() -> Partitioning {
        Partitioning {
            compute: "SPX",
            per_gpu: 1,
            ..Partitioning::cpx()
        }
    }
}

/// The render minor of GPU `i`'s partition `p`: amdgpu gives every GPU 8 (MAX_XCP) DRM
/// slots at probe, whatever the mode, so GPU `i`'s are consecutive from `128 + 8i`, as in the
/// k8s device plugin's CPX capture.
pub fn mi300x_render_minor(i: usize, p: usize) -> u32 {
    (128 + 8 * i + p) as u32
}

/// Writes an 8× MI300X node in the given partitioning, on top of the PCI devices of
/// `kernelkite_topology::fakesys::mi300x_8` (write that first, to the same root):
/// * KFD: CPU nodes 0 and 1, then one node per `(gpu, partition)` in GPU, partition order
///   (numbered consecutively over the nodes written), each with the properties amdkfd's
///   `kfd_topology_add_device` fills per partition (ROCm/amdgpu `amdkfd/kfd_topology.c`):
///   `location_id` = the PCI device's id with the partition number or'ed in when the GPU has
///   more than one node, the partition's render minor, `simd_count` and `num_xcc` its share of
///   the GPU's 1216 SIMDs and 8 XCDs, the same `domain`, `device_id`, `hive_id` throughout;
///   xGMI links (type 11) to every other GPU node, weight 13 within a GPU and 41 across, and a
///   PCIe link (type 2) to the CPU node of the GPU's socket, as in the CPX capture.
/// * The PCI device: `current_compute_partition`, `current_memory_partition` and the
///   `available_*` lists (amdgpu's sysfs files, as ROCm/amdsmi reads them), and `drm/` with
///   partition 0's card and render nodes (the PCI device's own DRM device).
/// * `sys/devices/platform/amdgpu_xcp_<k>/drm/` for partitions 1..8 of every GPU in every
///   mode, SPX included: amdgpu allocates them at probe (`amdgpu_xcp_dev_alloc`,
///   `amdgpu/amdgpu_xcp.c`), so they say nothing about the mode.
/// * `dev/kfd`, and `dev/dri/renderD<minor>` and `dev/dri/card<n>` of each `(gpu,
///   partition)` in `present`.
pub fn write_mi300x_partitioned(
    root: &Path,
    how: &Partitioning,
    present: &[(usize, usize)],
) -> std::io::Result<()> {
    let nodes_dir = root.join("sys/devices/virtual/kfd/kfd/topology/nodes");
    let parts: Vec<(usize, usize)> = (0..8)
        .flat_map(|i| (0..how.per_gpu).map(move |p| (i, p)))
        .filter(|ip| Some(*ip) != how.missing)
        .collect();
    let node_of = |k: usize| k + 2;
    for n in 0..2usize {
        let d = nodes_dir.join(n.to_string());
        std::fs::create_dir_all(d.join("io_links"))?;
        std::fs::write(d.join("gpu_id"), "0\n")?;
        std::fs::write(d.join("properties"), "cpu_cores_count 96\nsimd_count 0\n")?;
    }
    for (k, &(i, p)) in parts.iter().enumerate() {
        let n = node_of(k);
        let d = nodes_dir.join(n.to_string());
        let bus = u64::from(MI300X_BUSES[i]) << 8;
        let location = match (how.per_gpu > 1, how.high_bits) {
            (false, _) => bus,
            (true, false) => bus | p as u64,
            (true, true) => bus | ((p as u64) << 28),
        };
        let unique = match how.uuids {
            Uuids::Shared => 0x1d3a_0000_0000_0000 + i as u64,
            Uuids::PerPartition => 0x1d3a_0000_0000_0000 + ((i as u64) << 8) + p as u64,
            Uuids::None => 0,
        };
        std::fs::create_dir_all(d.join("io_links"))?;
        std::fs::write(d.join("gpu_id"), format!("{}\n", 40000 + n))?;
        std::fs::write(
            d.join("properties"),
            format!(
                "cpu_cores_count 0\nsimd_count {}\nnum_xcc {}\ndrm_render_minor {}\nlocation_id {location}\n\
                 domain 0\nvendor_id 4098\ndevice_id 29857\ngfx_target_version 90402\n\
                 hive_id 15188982192727901047\nunique_id {unique}\n",
                1216 / how.per_gpu,
                8 / how.per_gpu,
                mi300x_render_minor(i, p),
            ),
        )?;
        let bank = d.join("mem_banks/0");
        std::fs::create_dir_all(&bank)?;
        std::fs::write(
            bank.join("properties"),
            format!(
                "heap_type 1\nsize_in_bytes {}\n",
                (192u64 << 30) / how.per_gpu as u64
            ),
        )?;
        let mut links = vec![format!(
            "type 2\nnode_from {n}\nnode_to {}\nweight 20\n",
            i / 4
        )];
        for (m, &(j, _)) in parts.iter().enumerate().filter(|(m, _)| *m != k) {
            let weight = if j == i { 13 } else { 41 };
            links.push(format!(
                "type 11\nnode_from {n}\nnode_to {}\nweight {weight}\n",
                node_of(m)
            ));
        }
        for (l, text) in links.iter().enumerate() {
            let ld = d.join("io_links").join(l.to_string());
            std::fs::create_dir_all(&ld)?;
            std::fs::write(ld.join("properties"), text)?;
        }
    }
    for (i, bus) in MI300X_BUSES.iter().enumerate() {
        let pci = root.join(format!("sys/bus/pci/devices/0000:{bus:02x}:00.0"));
        std::fs::create_dir_all(pci.join(format!("drm/card{}", 8 * i)))?;
        std::fs::create_dir_all(pci.join(format!("drm/renderD{}", mi300x_render_minor(i, 0))))?;
        std::fs::write(
            pci.join("current_compute_partition"),
            format!("{}\n", how.compute),
        )?;
        std::fs::write(
            pci.join("available_compute_partition"),
            "SPX, DPX, QPX, CPX\n",
        )?;
        std::fs::write(
            pci.join("current_memory_partition"),
            format!("{}\n", how.memory),
        )?;
        std::fs::write(pci.join("available_memory_partition"), "NPS1, NPS4\n")?;
        for p in 1..8 {
            let xcp = root.join(format!(
                "sys/devices/platform/amdgpu_xcp_{}/drm",
                7 * i + p - 1
            ));
            std::fs::create_dir_all(xcp.join(format!("card{}", 8 * i + p)))?;
            std::fs::create_dir_all(xcp.join(format!("renderD{}", mi300x_render_minor(i, p))))?;
        }
    }
    std::fs::create_dir_all(root.join("dev/dri"))?;
    std::fs::write(root.join("dev/kfd"), "")?;
    for &(i, p) in present {
        std::fs::write(
            root.join(format!("dev/dri/renderD{}", mi300x_render_minor(i, p))),
            "",
        )?;
        std::fs::write(root.join(format!("dev/dri/card{}", 8 * i + p)), "")?;
    }
    Ok(())
}
