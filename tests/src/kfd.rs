//! An 8× AMD Instinct MI300X node as the KFD topology shows it in sysfs (the layout libhsakmt
//! reads: `kernelkite_sys::kfd`), with a `/dev/dri` holding the render nodes a test chooses.

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
