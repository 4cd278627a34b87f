//! AMD GPUs as ROCm enumerates them: the KFD topology in sysfs, read the way libhsakmt reads
//! it, then `ROCR_VISIBLE_DEVICES` as ROCr applies it, then `HIP_VISIBLE_DEVICES` as HIP
//! indexes what ROCr left. Used to decide the variables a job gets (the hooks) and to count
//! what a job really sees (the runner, `smoke`), instead of comparing variables' text.
//!
//! The rules, from ROCm's own source (ROCm/ROCR-Runtime, read at c7785a6):
//! * `libhsakmt/src/topology.c`, `topology_sysfs_check_node_supported`: the nodes are
//!   `/sys/devices/virtual/kfd/kfd/topology/nodes/<n>` in node order; a node whose `gpu_id` is
//!   0 is a CPU; a GPU node is skipped when its render node `/dev/dri/renderD<drm_render_minor>`
//!   cannot be opened (`ENOENT`, `EPERM`). So a job whose `/dev` holds only its own render
//!   nodes (the sandbox's private `/dev`, or docker's `--device`) sees only its GPUs, numbered
//!   from 0.
//! * `runtime/hsa-runtime/core/runtime/amd_topology.cpp` and `amd_filter_device.cpp`
//!   (`RvdFilter`): GPUs are the nodes with SIMDs; `ROCR_VISIBLE_DEVICES` is a comma list of
//!   indices into them (`strtol` base 0) or UUID prefixes (`GPU-` and the node's `unique_id`
//!   as 16 hex digits, case-insensitive, 5 to 20 characters, matching exactly one GPU); the
//!   list ends at the first token that is not one of those, is out of range or repeats, and
//!   at most as many tokens as GPUs are read. An empty value surfaces none; unset, all.
//! * `amd_gpu_agent.cpp` (`HSA_AMD_AGENT_INFO_UUID`): a GPU whose `unique_id` is 0 has the
//!   UUID `GPU-XX`, which selects nothing.
//! * HIP numbers the GPUs ROCr surfaced; `HIP_VISIBLE_DEVICES` indexes those (so setting both
//!   to host indices, as the hooks once did, hides every GPU but the first).
//!
//! A GPU cut into compute partitions (an MI300X in DPX, QPX or CPX mode) is one KFD node per
//! partition, each its own GPU to ROCr with its own render node; [`gpus`] names each by its
//! PCI device and [`KfdGpu::partition`] (see there for how `location_id` carries it).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Where the KFD topology lives under a sysfs root.
pub const KFD_NODES: &str = "sys/devices/virtual/kfd/kfd/topology/nodes";

/// One GPU node of the KFD topology.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KfdGpu {
    /// The node's number in the topology (its directory name).
    pub node: u32,
    /// `gpu_id`: KFD's id of the GPU.
    pub gpu_id: u32,
    /// `unique_id`; 0 when the GPU has none.
    pub unique_id: u64,
    /// `drm_render_minor`: the GPU's render node is `/dev/dri/renderD<minor>`.
    pub render_minor: u32,
    /// `dddd:bb:dd.f` from `domain` and `location_id`: the PCI device's, function 0, for a
    /// partition (whose `location_id` holds the partition number where a function would be).
    pub pci_bus_id: String,
    /// The compute partition this node is, when its GPU is partitioned (several KFD nodes per
    /// PCI device); `None` for a whole GPU.
    pub partition: Option<u32>,
    /// `num_xcc`: the node's XCDs (8 for a whole MI300X, 1 for a CPX partition; 0 when the
    /// property is absent).
    pub num_xcc: u64,
    /// `simd_count`: a node without SIMDs is no GPU to ROCr.
    pub simds: u64,
    /// Nodes this one reaches over xGMI: its `io_links` of type 11 (`HSA_IOLINK_TYPE_XGMI`
    /// in ROCR-Runtime's `libhsakmt/include/hsakmt/hsakmttypes.h`), by `node_to`.
    pub xgmi_to: Vec<u32>,
}

/// `type` of an xGMI link in a node's `io_links/<n>/properties`.
pub const IOLINK_TYPE_XGMI: u64 = 11;

/// The `node_to` of every xGMI link under a node's directory, ascending.
fn xgmi_links(node_dir: &Path) -> Vec<u32> {
    let mut out: Vec<u32> = std::fs::read_dir(node_dir.join("io_links"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let props =
                parse_properties(&std::fs::read_to_string(e.path().join("properties")).ok()?);
            (props.get("type") == Some(&IOLINK_TYPE_XGMI))
                .then(|| u32::try_from(*props.get("node_to")?).ok())
                .flatten()
        })
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

impl KfdGpu {
    /// ROCr's UUID of the GPU (`GPU-XX` when it has none).
    pub fn uuid(&self) -> String {
        if self.unique_id == 0 {
            "GPU-XX".into()
        } else {
            format!("GPU-{:016x}", self.unique_id)
        }
    }

    /// The render node's path under a `/dev` root.
    pub fn render_node(&self, dev_root: &Path) -> PathBuf {
        dev_root.join(format!("dri/renderD{}", self.render_minor))
    }
}

/// `name value` lines of a node's `properties` file.
pub fn parse_properties(text: &str) -> HashMap<String, u64> {
    text.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let (k, v) = (it.next()?, it.next()?);
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// A GPU node as read, before its PCI address is settled.
struct RawNode {
    gpu: KfdGpu,
    domain: u64,
    location: u64,
}

/// The GPU nodes of the KFD topology under `sys_root` (`/` on a live machine), in node order;
/// empty when there is no KFD.
///
/// `location_id` is the PCI device's id (`bus << 8 | device << 3 | function`), and amdkfd ors
/// the partition number into it when a GPU has several nodes (`kfd_topology_add_device` in
/// ROCm/amdgpu's `amdkfd/kfd_topology.c`): into bits 2:0 on current kernels, into bits 31:28
/// on some earlier ones (ROCm/amdsmi's `rsmi_dev_partition_id_get` reads both places). So
/// nodes are grouped by domain, bus and device: a group of several nodes, or any node with bits
/// 31:28 set, is one partitioned GPU, each node getting the device's function-0 address and
/// its partition number. The exception is a group whose nodes' own addresses are distinct PCI
/// functions present under `sys/bus/pci/devices` (several functions of one slot passed to a
/// VM): those are whole GPUs, and keep their functions.
pub fn gpus(sys_root: &Path) -> Vec<KfdGpu> {
    let dir = sys_root.join(KFD_NODES);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut nodes: Vec<u32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    nodes.sort_unstable();
    let raw: Vec<RawNode> = nodes
        .into_iter()
        .filter_map(|node| {
            let path = dir.join(node.to_string());
            let gpu_id: u32 = std::fs::read_to_string(path.join("gpu_id"))
                .ok()?
                .trim()
                .parse()
                .ok()?;
            if gpu_id == 0 {
                return None; // a CPU node
            }
            let props = parse_properties(&std::fs::read_to_string(path.join("properties")).ok()?);
            let get = |k: &str| props.get(k).copied().unwrap_or(0);
            let (domain, location) = (get("domain"), get("location_id"));
            Some(RawNode {
                gpu: KfdGpu {
                    node,
                    gpu_id,
                    unique_id: get("unique_id"),
                    render_minor: u32::try_from(get("drm_render_minor")).ok()?,
                    pci_bus_id: bus_id(domain, location, location & 0x7),
                    partition: None,
                    num_xcc: get("num_xcc"),
                    simds: get("simd_count"),
                    xgmi_to: xgmi_links(&path),
                },
                domain,
                location,
            })
        })
        .collect();
    settle_partitions(sys_root, raw)
}

/// `dddd:bb:dd.f` of a `location_id`, with the function given.
fn bus_id(domain: u64, location: u64, function: u64) -> String {
    format!(
        "{domain:04x}:{:02x}:{:02x}.{function:x}",
        (location >> 8) & 0xff,
        (location >> 3) & 0x1f
    )
}

/// Groups the nodes by PCI slot and marks the partitions (see [`gpus`]); node order is kept.
fn settle_partitions(sys_root: &Path, mut raw: Vec<RawNode>) -> Vec<KfdGpu> {
    let slot = |r: &RawNode| (r.domain, (r.location >> 8) & 0xff, (r.location >> 3) & 0x1f);
    let mut by_slot: BTreeMap<(u64, u64, u64), Vec<usize>> = BTreeMap::new();
    for (k, r) in raw.iter().enumerate() {
        by_slot.entry(slot(r)).or_default().push(k);
    }
    let pci = sys_root.join("sys/bus/pci/devices");
    for members in by_slot.values() {
        let high = |k: usize| (raw[k].location >> 28) & 0xf;
        let in_high_bits = members.iter().any(|&k| high(k) != 0);
        let mut own: Vec<&str> = members
            .iter()
            .map(|&k| raw[k].gpu.pci_bus_id.as_str())
            .collect();
        let every_one_a_function = own.iter().all(|b| pci.join(b).exists());
        own.sort_unstable();
        own.dedup();
        let functions = own.len() == members.len() && every_one_a_function;
        if !in_high_bits && (members.len() == 1 || functions) {
            continue;
        }
        for &k in members {
            let r = &mut raw[k];
            let number = if in_high_bits {
                (r.location >> 28) & 0xf
            } else {
                r.location & 0x7
            };
            r.gpu.pci_bus_id = bus_id(r.domain, r.location, 0);
            // At most 15: it came from a 4-bit or 3-bit field.
            r.gpu.partition = Some(number as u32);
        }
    }
    raw.into_iter().map(|r| r.gpu).collect()
}

/// The partitioned GPUs among `gpus`: each PCI device's partitions, in node order.
pub fn partitioned(gpus: &[KfdGpu]) -> BTreeMap<String, Vec<&KfdGpu>> {
    let mut out: BTreeMap<String, Vec<&KfdGpu>> = BTreeMap::new();
    for g in gpus.iter().filter(|g| g.partition.is_some()) {
        out.entry(g.pci_bus_id.clone()).or_default().push(g);
    }
    out
}

/// What libhsakmt keeps: GPUs whose render node under `dev_root` opens read-write, and that
/// have SIMDs (ROCr's GPUs). A node whose render node is absent (`ENOENT`) or refused
/// (`EPERM`, a device cgroup) is skipped, as libhsakmt skips it; any other failure (`EACCES`,
/// no render minor) fails libhsakmt's whole topology, and then no GPU is seen.
pub fn supported(gpus: Vec<KfdGpu>, dev_root: &Path) -> Vec<KfdGpu> {
    let mut kept = Vec::new();
    for g in gpus {
        if g.render_minor == 0 {
            return Vec::new();
        }
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(g.render_node(dev_root));
        match opened {
            Ok(_) => kept.push(g),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::EPERM)) => {}
            Err(_) => return Vec::new(),
        }
    }
    kept.retain(|g| g.simds > 0);
    kept
}

/// `strtol(token, &end, 0)` with nothing left over: decimal, `0x` hex or `0` octal.
fn c_integer(token: &str) -> Option<i64> {
    let (neg, t) = match token.strip_prefix('-') {
        Some(t) => (true, t),
        None => (false, token.strip_prefix('+').unwrap_or(token)),
    };
    if t.starts_with(['+', '-']) {
        return None; // one sign at most, before any base prefix
    }
    let v = if let Some(h) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        if h.starts_with(['+', '-']) {
            return None;
        }
        i64::from_str_radix(h, 16).ok()?
    } else if t.len() > 1 && t.starts_with('0') {
        i64::from_str_radix(&t[1..], 8).ok()?
    } else {
        t.parse().ok()?
    };
    Some(if neg { -v } else { v })
}

/// `ROCR_VISIBLE_DEVICES` applied to ROCr's GPUs (`None`: unset, all of them).
pub fn rocr_visible(gpus: Vec<KfdGpu>, value: Option<&str>) -> Vec<KfdGpu> {
    let Some(value) = value else {
        return gpus;
    };
    if value.is_empty() {
        return Vec::new();
    }
    let uuids: Vec<String> = gpus
        .iter()
        .map(|g| {
            if g.unique_id == 0 {
                "Invalid-UUID".into()
            } else {
                g.uuid().to_uppercase()
            }
        })
        .collect();
    let mut chosen: Vec<usize> = Vec::new();
    for token in value.split(',').take(gpus.len()) {
        let token = token.trim().to_uppercase();
        let index = if token.starts_with('G') {
            if !(5..=20).contains(&token.len()) {
                break;
            }
            let mut matches = uuids
                .iter()
                .enumerate()
                .filter(|(_, u)| u.starts_with(&token));
            match (matches.next(), matches.next()) {
                (Some((i, _)), None) => i as i64,
                _ => break,
            }
        } else {
            match c_integer(&token) {
                Some(i) => i,
                None => break,
            }
        };
        match usize::try_from(index) {
            Ok(i) if i < gpus.len() && !chosen.contains(&i) => chosen.push(i),
            _ => break,
        }
    }
    chosen.into_iter().map(|i| gpus[i].clone()).collect()
}

/// HIP's device list applied to what ROCr surfaced, as CLR reads it (`rocdevice.cpp`): the
/// value is `HIP_VISIBLE_DEVICES`, or `CUDA_VISIBLE_DEVICES` where that is empty or unset (an
/// empty value counts as unset); plain decimal indices into ROCr's GPUs, a repeated one
/// skipped, the list ending at the first that is not an index in range (`None`: all).
pub fn hip_visible(gpus: Vec<KfdGpu>, value: Option<&str>) -> Vec<KfdGpu> {
    let Some(value) = value.filter(|v| !v.is_empty()) else {
        return gpus;
    };
    let mut chosen: Vec<usize> = Vec::new();
    for token in value.split(',') {
        let strict = !token.is_empty()
            && token.bytes().all(|b| b.is_ascii_digit())
            && (token == "0" || !token.starts_with('0'));
        match token.parse::<usize>() {
            Ok(i) if strict && i < gpus.len() => {
                if !chosen.contains(&i) {
                    chosen.push(i);
                }
            }
            _ => break,
        }
    }
    chosen.into_iter().map(|i| gpus[i].clone()).collect()
}

/// The GPUs a HIP program sees: the KFD topology under `sys_root`, the render nodes under
/// `dev_root`, then the two variables as `env` gives them.
pub fn visible(
    sys_root: &Path,
    dev_root: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> Vec<KfdGpu> {
    visible_among(gpus(sys_root), dev_root, env)
}

/// [`visible`], for a topology already read with [`gpus`].
pub fn visible_among(
    gpus: Vec<KfdGpu>,
    dev_root: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> Vec<KfdGpu> {
    let rocr = rocr_visible(
        supported(gpus, dev_root),
        env("ROCR_VISIBLE_DEVICES").as_deref(),
    );
    let hip = env("HIP_VISIBLE_DEVICES").filter(|v| !v.is_empty());
    hip_visible(rocr, hip.or_else(|| env("CUDA_VISIBLE_DEVICES")).as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 8× MI300X fixture with the render nodes `present` (by GPU).
    fn mi300x(present: &[usize]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        kernelkite_testkit_leaf::kfd::write_mi300x(root.path(), present, true).unwrap();
        root
    }

    fn buses(gpus: &[KfdGpu]) -> Vec<&str> {
        gpus.iter().map(|g| g.pci_bus_id.as_str()).collect()
    }

    #[test]
    fn the_topology_is_read_as_libhsakmt_reads_it() {
        let all: Vec<usize> = (0..8).collect();
        let r = mi300x(&all);
        let g = gpus(r.path());
        assert_eq!(g.len(), 8);
        assert_eq!(g[0].node, 2);
        assert_eq!(g[0].pci_bus_id, "0000:05:00.0");
        assert_eq!(g[7].pci_bus_id, "0000:f5:00.0");
        assert_eq!(g[1].uuid(), "GPU-1d3a000000000001");
        // Only the render nodes this /dev has.
        let r = mi300x(&[3, 5]);
        let s = supported(gpus(r.path()), &r.path().join("dev"));
        assert_eq!(buses(&s), ["0000:75:00.0", "0000:95:00.0"]);
        // A GPU node without a render minor fails libhsakmt's whole topology: none is seen.
        let props = r.path().join(KFD_NODES).join("4/properties");
        let text = std::fs::read_to_string(&props).unwrap();
        std::fs::write(&props, text.replace("drm_render_minor", "no_render_minor")).unwrap();
        assert!(supported(gpus(r.path()), &r.path().join("dev")).is_empty());
    }

    #[test]
    fn rocr_visible_devices_follows_rocrs_rules() {
        let r = mi300x(&(0..4).collect::<Vec<usize>>());
        let g = supported(gpus(r.path()), &r.path().join("dev"));
        let pick = |v: Option<&str>| buses(&rocr_visible(g.clone(), v)).join(" ");
        assert_eq!(
            pick(None),
            "0000:05:00.0 0000:15:00.0 0000:65:00.0 0000:75:00.0"
        );
        assert_eq!(pick(Some("")), "");
        assert_eq!(pick(Some("-1")), "");
        assert_eq!(pick(Some("GPU-XX")), "");
        // Reordered; a UUID prefix, any case; ends at the first bad token.
        assert_eq!(
            pick(Some("3,gpu-1d3a000000000000,9,1")),
            "0000:75:00.0 0000:05:00.0"
        );
        assert_eq!(pick(Some("1,1,2")), "0000:15:00.0");
        assert_eq!(pick(Some("0x2, 010")), "0000:65:00.0");
        // An ambiguous prefix matches two GPUs: it ends the list.
        assert_eq!(pick(Some("2,GPU-1d3a")), "0000:65:00.0");
        assert_eq!(
            pick(Some("0x+2")),
            "",
            "strtol takes no sign after the base prefix"
        );
    }

    /// An 8× MI300X in the given partitioning, with the render nodes `present` by (GPU,
    /// partition).
    fn partitioned_node(
        how: &kernelkite_testkit_leaf::kfd::Partitioning,
        present: &[(usize, usize)],
    ) -> tempfile::TempDir {
        // tmpfs: a CPX tree is some 8,000 files, which a busy disk takes seconds to write.
        let root = kernelkite_testkit_leaf::scratch();
        kernelkite_testkit_leaf::kfd::write_mi300x_partitioned(root.path(), how, present).unwrap();
        root
    }

    /// (bus id, partition, render minor) of each GPU, in node order.
    fn layout(gpus: &[KfdGpu]) -> Vec<(String, Option<u32>, u32)> {
        gpus.iter()
            .map(|g| (g.pci_bus_id.clone(), g.partition, g.render_minor))
            .collect()
    }

    /// What `write_mi300x_partitioned` lays out for `per_gpu` partitions per GPU.
    fn expected(per_gpu: usize) -> Vec<(String, Option<u32>, u32)> {
        use kernelkite_testkit_leaf::kfd::{mi300x_bus_id, mi300x_render_minor};
        (0..8)
            .flat_map(|i| {
                (0..per_gpu).map(move |p| {
                    (
                        mi300x_bus_id(i),
                        (per_gpu > 1).then_some(p as u32),
                        mi300x_render_minor(i, p),
                    )
                })
            })
            .collect()
    }

    #[test]
    fn partitions_are_read_from_location_id_in_either_encoding() {
        use kernelkite_testkit_leaf::kfd::{Partitioning, Uuids};
        let cpx = Partitioning::cpx();
        let r = partitioned_node(&cpx, &[]);
        let g = gpus(r.path());
        assert_eq!(g.len(), 64);
        assert_eq!(layout(&g), expected(8));
        assert!(g.iter().all(|g| g.num_xcc == 1 && g.simds == 152));
        assert_eq!(partitioned(&g).len(), 8);
        assert_eq!(partitioned(&g)["0000:e5:00.0"].len(), 8);
        // The earlier kernels' encoding, the partition in bits 31:28: the same GPUs.
        let high = partitioned_node(
            &Partitioning {
                high_bits: true,
                ..Partitioning::cpx()
            },
            &[],
        );
        assert_eq!(layout(&gpus(high.path())), expected(8));
        let dpx = partitioned_node(&Partitioning::dpx(), &[]);
        assert_eq!(layout(&gpus(dpx.path())), expected(2));
        // SPX: whole GPUs, although the amdgpu_xcp_* render nodes exist beside them.
        let spx = partitioned_node(&Partitioning::spx(), &[]);
        assert!(spx
            .path()
            .join("sys/devices/platform/amdgpu_xcp_0/drm/renderD129")
            .exists());
        let whole = gpus(spx.path());
        assert_eq!(layout(&whole), expected(1));
        assert!(partitioned(&whole).is_empty());

        // A job's /dev holding GPU 0's partition 3 alone: libhsakmt keeps exactly that one.
        let job = partitioned_node(&cpx, &[(0, 3)]);
        let seen = supported(gpus(job.path()), &job.path().join("dev"));
        assert_eq!(layout(&seen), [("0000:05:00.0".to_string(), Some(3), 131)]);
        // With the host's /dev, GPU 0's shared id matches its 8 partitions: ROCr's filter
        // ends the list at such a token, so the job would see no GPU.
        let every: Vec<(usize, usize)> = (0..8).flat_map(|i| (0..8).map(move |p| (i, p))).collect();
        let host = partitioned_node(&cpx, &every);
        let all = supported(gpus(host.path()), &host.path().join("dev"));
        assert_eq!(all.len(), 64);
        assert!(rocr_visible(all, Some("GPU-1d3a000000000000")).is_empty());
        // Per-partition ids (newer kernels) select the partition in any /dev.
        let own = partitioned_node(
            &Partitioning {
                uuids: Uuids::PerPartition,
                ..Partitioning::cpx()
            },
            &every,
        );
        let all = supported(gpus(own.path()), &own.path().join("dev"));
        assert_eq!(
            layout(&rocr_visible(all, Some("GPU-1d3a000000000003"))),
            [("0000:05:00.0".to_string(), Some(3), 131)]
        );
    }

    /// Two KFD nodes on one PCI slot whose addresses are two PCI functions on the bus (two
    /// GPUs passed to a VM as functions of one slot) are two whole GPUs, not partitions; the
    /// same nodes without those functions on the bus are partitions.
    #[test]
    fn functions_present_on_the_bus_are_whole_gpus() {
        let r = mi300x(&[]);
        let props = r.path().join(KFD_NODES).join("3/properties");
        let text = std::fs::read_to_string(&props).unwrap();
        // GPU node 3 moves to function 1 of node 2's slot.
        std::fs::write(
            &props,
            text.replace("location_id 5376", &format!("location_id {}", 0x501)),
        )
        .unwrap();
        let g = gpus(r.path());
        assert_eq!(
            (g[0].pci_bus_id.as_str(), g[0].partition),
            ("0000:05:00.0", Some(0))
        );
        assert_eq!(
            (g[1].pci_bus_id.as_str(), g[1].partition),
            ("0000:05:00.0", Some(1))
        );
        for f in ["0000:05:00.0", "0000:05:00.1"] {
            std::fs::create_dir_all(r.path().join("sys/bus/pci/devices").join(f)).unwrap();
        }
        let g = gpus(r.path());
        assert_eq!(
            (g[0].pci_bus_id.as_str(), g[0].partition),
            ("0000:05:00.0", None)
        );
        assert_eq!(
            (g[1].pci_bus_id.as_str(), g[1].partition),
            ("0000:05:00.1", None)
        );
        assert!(partitioned(&g).is_empty());
    }

    #[test]
    fn hip_indexes_what_rocr_left() {
        let r = mi300x(&(0..8).collect::<Vec<usize>>());
        let env = |rvd: &'static str, hvd: &'static str| {
            move |k: &str| match k {
                "ROCR_VISIBLE_DEVICES" => Some(rvd.to_string()),
                "HIP_VISIBLE_DEVICES" => Some(hvd.to_string()),
                _ => None,
            }
        };
        let dev = r.path().join("dev");
        // The old exports, host indices in both: HIP sees nothing for any slice but 0.
        assert!(visible(r.path(), &dev, &env("2,3", "2,3")).is_empty());
        // HIP's own rules: a repeat is skipped, a bad token ends the list, empty is unset.
        let g = supported(gpus(r.path()), &dev);
        let hip = |v: &str| buses(&hip_visible(g.clone(), Some(v))).len();
        assert_eq!(hip("1,1,2"), 2);
        assert_eq!(hip("1,01,2"), 1);
        assert_eq!(hip(""), 8);
        assert_eq!(
            buses(&visible(r.path(), &dev, &env("2,3", "0,1"))),
            ["0000:65:00.0", "0000:75:00.0"]
        );
    }
}
