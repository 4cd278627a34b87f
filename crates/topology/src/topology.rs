//! The node's topology: CPUs, physical cores, NUMA nodes, memory, the process's cpuset and GPUs.
//!
//! A [`Topology`] is a plain value. Two sources fill it: a sysfs/procfs tree
//! ([`Topology::discover`], `/` on a live machine, a fake tree in tests) and an hwloc XML
//! export ([`Topology::from_hwloc_xml`]), so a vendor can plan a machine from `lstopo --of xml`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::plan::MigInstance;
pub use crate::plan::Vendor;

pub mod hwloc;
pub mod nvml;
pub mod sysfs;

/// One logical CPU (a hardware thread, hwloc's "PU").
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Cpu {
    /// Logical CPU id (`cpuN`).
    pub id: u32,
    /// Physical package (socket); `None` when the CPU is offline and sysfs hides its topology.
    pub package: Option<u32>,
    /// `core_id` as the kernel reports it; unique only within a package (or die).
    pub core_id: Option<u32>,
    /// Key of the physical core this thread belongs to: the lowest CPU id among its SMT
    /// siblings. Unlike `core_id` it is unique machine-wide, so grouping by it never merges two
    /// cores of different dies that share a `core_id`.
    pub core: u32,
    /// NUMA node; `None` when the kernel does not say.
    pub numa_node: Option<u32>,
    /// Whether it is online.
    pub online: bool,
}

/// A NUMA node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NumaNode {
    /// Node id (`nodeN`).
    pub id: u32,
    /// Online CPUs of the node (may be empty for memory-only nodes such as HBM or CXL).
    pub cpus: Vec<u32>,
    /// Memory of the node in bytes (0 when unknown).
    pub memory_bytes: u64,
}

/// A GPU found on the PCI bus.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Gpu {
    /// Who made it.
    pub vendor: Vendor,
    /// Canonical `dddd:bb:dd.f`, lower-case hex.
    pub pci_bus_id: String,
    /// NUMA node the GPU hangs off; `None` when the firmware reports -1 or hwloc attaches the
    /// device above several nodes.
    pub numa_node: Option<u32>,
    /// CPUs local to the GPU (`local_cpulist`); may be every CPU when the firmware knows nothing.
    pub local_cpus: Vec<u32>,
    /// `GPU-...`: NVIDIA's when the driver or NVML reports it; AMD's as ROCr names it, from
    /// the KFD topology's `unique_id`.
    pub uuid: Option<String>,
    /// Device minor number: `/dev/nvidia<minor>` for NVIDIA.
    pub minor: Option<u32>,
    /// PCI device id.
    pub device_id: Option<u16>,
    /// Marketing name when a source gives one.
    pub name: Option<String>,
    /// Its MIG devices when it is in MIG mode (from NVML); empty for a whole GPU.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mig: Vec<MigInstance>,
    /// In MIG mode now (from NVML), whether or not it has MIG devices yet: CUDA cannot use
    /// such a GPU whole, so with no MIG device it is in no slice.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mig_enabled: bool,
    /// Bus ids of the GPUs it reaches over a fast link: NVLink (directly or through NVSwitch,
    /// from NVML) or xGMI (from the KFD topology). Empty when nothing says.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub links: Vec<String>,
    /// How an AMD GPU is cut into compute partitions (an MI300X in DPX, QPX or CPX mode), from
    /// the KFD topology; `None` for a whole GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partitioning: Option<AmdPartitioning>,
}

/// An AMD GPU in a compute-partitioning mode: ROCm shows each partition as a GPU of its own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AmdPartitioning {
    /// The compute mode, `current_compute_partition` of the PCI device (`DPX`, `TPX`, `QPX`,
    /// `CPX`); derived from the partitions KFD lists when the file cannot be read (amdgpu
    /// refuses it while the GPU resets).
    pub compute: String,
    /// The memory mode, `current_memory_partition` (`NPS1`, `NPS4`, ...), when readable.
    pub memory: Option<String>,
    /// The product, from the PCI device id (`MI300X`).
    pub model: String,
    /// The partitions KFD lists, in node order.
    pub partitions: Vec<AmdPartition>,
}

/// One compute partition of an AMD GPU: one KFD node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AmdPartition {
    /// Its number within the GPU.
    pub index: u32,
    /// Its render node is `/dev/dri/renderD<render_minor>`.
    pub render_minor: u32,
    /// `GPU-…` as ROCr names it, only when its `unique_id` is its own: kernels before Aug 2025
    /// give every partition the GPU's id, which then selects no GPU where several are seen.
    pub uuid: Option<String>,
}

/// The product name of an AMD Instinct PCI device id (from the ids the ROCm k8s device
/// plugin's node labeller reads, `cmd/k8s-node-labeller/amdgpu.ids`); `AMD-<id>` otherwise.
pub fn amd_model(device_id: Option<u16>) -> String {
    match device_id {
        Some(0x74a0) => "MI300A".into(),
        Some(0x74a1) => "MI300X".into(),
        Some(0x74a2) | Some(0x74b6) => "MI308X".into(),
        Some(0x74a5) => "MI325X".into(),
        Some(0x74a9) | Some(0x74bd) => "MI300X-HF".into(),
        Some(0x74b5) => "MI300X-VF".into(),
        Some(0x75a0) => "MI350X".into(),
        Some(0x75a3) => "MI355X".into(),
        Some(id) => format!("AMD-{id:04x}"),
        None => "AMD GPU".into(),
    }
}

/// A physical core: the unit the planner hands out, so SMT siblings are never split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PhysicalCore {
    /// Lowest CPU id among the siblings (see [`Cpu::core`]).
    pub key: u32,
    /// Physical package (socket).
    pub package: Option<u32>,
    /// NUMA node.
    pub numa_node: Option<u32>,
    /// Online threads of the core, ascending.
    pub cpus: Vec<u32>,
}

/// Everything the planner needs to know about a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Topology {
    /// Every CPU the kernel knows (present), online or not, ascending by id.
    pub cpus: Vec<Cpu>,
    /// NUMA nodes, ascending by id. A machine without NUMA information has one node 0.
    pub numa_nodes: Vec<NumaNode>,
    /// Memory of the whole machine in bytes.
    pub total_memory_bytes: u64,
    /// CPUs the current process may run on (its cpuset and affinity), ascending.
    pub allowed_cpus: Vec<u32>,
    /// Memory nodes the current process may use, ascending (empty when unknown: all).
    pub allowed_mems: Vec<u32>,
    /// GPUs in PCI bus order (the order of nvidia-smi and `CUDA_DEVICE_ORDER=PCI_BUS_ID`).
    pub gpus: Vec<Gpu>,
}

/// Why a topology could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// A file could not be read.
    #[error("cannot read {path}: {source} (is the sysfs root right? pass --sysfs-root DIR or --topology-xml FILE)")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the file system said.
        #[source]
        source: std::io::Error,
    },
    /// A file's content is not what the kernel writes there.
    #[error("cannot parse {path}: {reason}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A CPU list file does not parse.
    #[error("cannot parse {path}: {source}")]
    CpuList {
        /// The file.
        path: PathBuf,
        /// What is wrong with the list.
        #[source]
        source: crate::cpulist::CpuListError,
    },
    /// An hwloc XML export is not usable.
    #[error("invalid hwloc XML: {0} (export it with `lstopo --of xml FILE`)")]
    Xml(#[source] XmlError),
    /// No online CPU under the root (not a sysfs root).
    #[error(
        "no online CPU found under {0} (is it a sysfs/procfs root with sys/devices/system/cpu?)"
    )]
    NoCpus(PathBuf),
}

/// What is wrong with an hwloc XML export.
#[derive(Debug, thiserror::Error)]
pub enum XmlError {
    /// Not well-formed XML.
    #[error(transparent)]
    Syntax(#[from] roxmltree::Error),
    /// Well-formed, but not an hwloc topology this reader understands.
    #[error("{0}")]
    Content(String),
}

impl From<String> for XmlError {
    fn from(what: String) -> XmlError {
        XmlError::Content(what)
    }
}

impl From<&str> for XmlError {
    fn from(what: &str) -> XmlError {
        XmlError::Content(what.to_string())
    }
}

/// AMD GPUs' xGMI peers from the KFD topology's io_links, by bus id.
fn amd_links(gpus: &mut [Gpu], kfd: &[kernelkite_sys::kfd::KfdGpu]) {
    for g in gpus.iter_mut().filter(|g| g.vendor == Vendor::Amd) {
        let Some(k) = kfd.iter().find(|k| k.pci_bus_id == g.pci_bus_id) else {
            continue;
        };
        let mut peers: Vec<String> = k
            .xgmi_to
            .iter()
            .filter_map(|to| kfd.iter().find(|p| p.node == *to))
            .map(|p| p.pci_bus_id.clone())
            .filter(|b| *b != g.pci_bus_id)
            .collect();
        peers.sort();
        peers.dedup();
        g.links = peers;
    }
}

/// AMD GPUs' UUIDs as ROCr names them (`GPU-` and KFD's `unique_id`), matched to the PCI
/// devices by bus id; a GPU whose KFD node has no `unique_id` keeps none, and so does a
/// partitioned GPU (each partition is a GPU to ROCr: see [`amd_partitions`]).
fn amd_uuids(gpus: &mut [Gpu], kfd: &[kernelkite_sys::kfd::KfdGpu]) {
    for g in gpus
        .iter_mut()
        .filter(|g| g.vendor == Vendor::Amd && g.uuid.is_none())
    {
        if let Some(k) = kfd
            .iter()
            .find(|k| k.pci_bus_id == g.pci_bus_id && k.unique_id != 0 && k.partition.is_none())
        {
            g.uuid = Some(k.uuid());
        }
    }
}

/// The compute mode a partitioned GPU's partitions imply, for when amdgpu's
/// `current_compute_partition` cannot be read: one XCD each is CPX, else by count.
fn mode_of(partitions: &[&kernelkite_sys::kfd::KfdGpu]) -> String {
    match (partitions.first().map(|k| k.num_xcc), partitions.len()) {
        (Some(1), _) => "CPX",
        (_, 2) => "DPX",
        (_, 3) => "TPX",
        (_, 4) => "QPX",
        _ => "CPX",
    }
    .into()
}

/// AMD GPUs' compute partitions from the KFD topology (several nodes on one PCI device), with
/// the modes amdgpu reports beside the device (`current_compute_partition`,
/// `current_memory_partition`, as ROCm/amdsmi reads them). The `amdgpu_xcp_*` platform
/// devices are not looked at: amdgpu makes them in every mode, SPX included.
fn amd_partitions(root: &Path, gpus: &mut [Gpu], kfd: &[kernelkite_sys::kfd::KfdGpu]) {
    let by_gpu = kernelkite_sys::kfd::partitioned(kfd);
    let mut ids: BTreeMap<u64, usize> = BTreeMap::new();
    for k in kfd.iter().filter(|k| k.unique_id != 0) {
        *ids.entry(k.unique_id).or_default() += 1;
    }
    for g in gpus.iter_mut().filter(|g| g.vendor == Vendor::Amd) {
        let Some(parts) = by_gpu.get(&g.pci_bus_id) else {
            continue;
        };
        let dir = root.join("sys/bus/pci/devices").join(&g.pci_bus_id);
        let mode = |file: &str| {
            std::fs::read_to_string(dir.join(file))
                .ok()
                .map(|s| s.trim().to_ascii_uppercase())
                .filter(|s| !s.is_empty())
        };
        g.partitioning = Some(AmdPartitioning {
            compute: mode("current_compute_partition").unwrap_or_else(|| mode_of(parts)),
            memory: mode("current_memory_partition"),
            model: amd_model(g.device_id),
            partitions: parts
                .iter()
                .map(|k| AmdPartition {
                    index: k.partition.unwrap_or(0),
                    render_minor: k.render_minor,
                    uuid: (ids.get(&k.unique_id) == Some(&1)).then(|| k.uuid()),
                })
                .collect(),
        });
    }
    warn_missing_partitions(gpus);
}

/// Warns about a GPU with fewer partitions than others in its mode: amdgpu skips a partition
/// it finds no DRM minor for, and amdkfd adds no node without a render node, so the probable
/// cause is a kernel whose DRM minors ran out (64 before Linux 6.12: 8 GPUs × 8 partitions
/// leave none for a BMC's display).
fn warn_missing_partitions(gpus: &[Gpu]) {
    let mut most: BTreeMap<&str, usize> = BTreeMap::new();
    for p in gpus.iter().filter_map(|g| g.partitioning.as_ref()) {
        let n = most.entry(p.compute.as_str()).or_default();
        *n = (*n).max(p.partitions.len());
    }
    for g in gpus {
        let Some(p) = &g.partitioning else { continue };
        let want = most.get(p.compute.as_str()).copied().unwrap_or(0);
        if p.partitions.len() < want {
            tracing::warn!(
                "GPU {} lists {} of its {want} {} partitions in the KFD topology: the kernel probably ran out of DRM minors (dmesg: \"Skip xcp node #N when out of drm node resource\"); Linux 6.12, or a stable kernel with \"drm: Expand max DRM device number to full MINORBITS\", has enough",
                g.pci_bus_id,
                p.partitions.len(),
                p.compute
            );
        }
    }
}

impl Topology {
    /// Reads sysfs/procfs under `root` ("/" on a live machine).
    ///
    /// NVML is consulted only on a live machine (`root` is `/`), for what only it knows
    /// (MIG devices, NVLink peers) and NVIDIA UUIDs the driver's `/proc` files did not give;
    /// its absence is normal and silently skipped.
    pub fn discover(root: &Path) -> Result<Topology, TopologyError> {
        let live = root == Path::new("/");
        Self::discover_with_nvml(root, live.then_some(kernelkite_sys::nvml::LIBRARY))
    }

    /// [`Topology::discover`], with NVML loaded from `library` (a name or a path; `None`: no
    /// NVML) on a node with NVIDIA GPUs, for their MIG devices and NVLink peers and the UUIDs
    /// and minors the driver's files did not give.
    pub fn discover_with_nvml(
        root: &Path,
        library: Option<&str>,
    ) -> Result<Topology, TopologyError> {
        let mut topo = sysfs::read(root)?;
        let kfd = kernelkite_sys::kfd::gpus(root);
        amd_uuids(&mut topo.gpus, &kfd);
        amd_partitions(root, &mut topo.gpus, &kfd);
        amd_links(&mut topo.gpus, &kfd);
        let wanted = topo.gpus.iter().any(|g| g.vendor == Vendor::Nvidia);
        if let Some(library) = library.filter(|_| wanted) {
            match nvml::Nvml::load_from(library) {
                Ok(lib) => match nvml::devices(&lib) {
                    Ok(devs) => nvml::merge(&mut topo.gpus, &devs),
                    Err(e) => tracing::warn!("NVML loaded but could not list GPUs: {e}"),
                },
                Err(e) => tracing::debug!("NVML not available: {e}"),
            }
        }
        Ok(topo)
    }

    /// Parses an hwloc XML export (format 2.0 and 3.0).
    pub fn from_hwloc_xml(xml: &str) -> Result<Topology, TopologyError> {
        hwloc::parse(xml)
    }

    /// Online CPUs, ascending.
    pub fn online_cpus(&self) -> Vec<u32> {
        self.cpus
            .iter()
            .filter(|c| c.online)
            .map(|c| c.id)
            .collect()
    }

    /// Offline CPUs, ascending.
    pub fn offline_cpus(&self) -> Vec<u32> {
        self.cpus
            .iter()
            .filter(|c| !c.online)
            .map(|c| c.id)
            .collect()
    }

    /// Online CPUs grouped into physical cores, ascending by key.
    pub fn physical_cores(&self) -> Vec<PhysicalCore> {
        let mut cores: BTreeMap<u32, PhysicalCore> = BTreeMap::new();
        for cpu in self.cpus.iter().filter(|c| c.online) {
            let core = cores.entry(cpu.core).or_insert_with(|| PhysicalCore {
                key: cpu.core,
                package: cpu.package,
                numa_node: cpu.numa_node,
                cpus: Vec::new(),
            });
            core.cpus.push(cpu.id);
        }
        cores
            .into_values()
            .map(|mut c| {
                c.cpus.sort_unstable();
                c
            })
            .collect()
    }

    /// Threads per core of the most common core shape (1 without SMT, 2 with).
    pub fn threads_per_core(&self) -> u32 {
        let mut counts: BTreeMap<usize, usize> = BTreeMap::new();
        for core in self.physical_cores() {
            *counts.entry(core.cpus.len()).or_default() += 1;
        }
        counts
            .into_iter()
            .max_by_key(|&(threads, n)| (n, threads))
            .map_or(1, |(t, _)| t as u32)
    }

    /// The NUMA node with this id.
    pub fn numa_node(&self, id: u32) -> Option<&NumaNode> {
        self.numa_nodes.iter().find(|n| n.id == id)
    }

    /// Packages (sockets) that have online CPUs, ascending.
    pub fn packages(&self) -> Vec<u32> {
        let set: BTreeSet<u32> = self
            .cpus
            .iter()
            .filter(|c| c.online)
            .filter_map(|c| c.package)
            .collect();
        set.into_iter().collect()
    }

    /// Sorts GPUs into PCI bus order and canonicalises their bus ids; every source ends here.
    pub(crate) fn normalise(&mut self) {
        for gpu in &mut self.gpus {
            gpu.pci_bus_id = canonical_bus_id(&gpu.pci_bus_id);
            gpu.local_cpus.sort_unstable();
            gpu.local_cpus.dedup();
        }
        self.gpus.sort_by(|a, b| a.pci_bus_id.cmp(&b.pci_bus_id));
        self.cpus.sort_by_key(|c| c.id);
        self.numa_nodes.sort_by_key(|n| n.id);
        self.allowed_cpus.sort_unstable();
        self.allowed_cpus.dedup();
    }
}

/// Vendor of a PCI function that is a GPU, from its vendor id and 24-bit class code.
///
/// Display controllers (class 0x03: VGA, 3D, other) of NVIDIA (0x10de) and AMD (0x1002), plus
/// AMD's processing accelerators (class 0x12): MI200/MI300 Instinct GPUs report that class,
/// so a display-only filter would miss every GPU on an MI300X node.
pub fn gpu_vendor(vendor_id: u16, class: u32) -> Option<Vendor> {
    let base = (class >> 16) & 0xff;
    match (vendor_id, base) {
        (0x10de, 0x03) => Some(Vendor::Nvidia),
        (0x1002, 0x03) | (0x1002, 0x12) => Some(Vendor::Amd),
        _ => None,
    }
}

/// `0000:18:00.0` from any of `18:00.0`, `00000000:18:00.0` (NVIDIA's 8-digit domain) or
/// upper-case forms. Unrecognised input is returned lower-cased, unchanged otherwise.
pub fn canonical_bus_id(id: &str) -> String {
    let id = id.trim().to_ascii_lowercase();
    let parts: Vec<&str> = id.split(':').collect();
    let (domain, bus, devfn) = match parts.as_slice() {
        [d, b, df] => (*d, *b, *df),
        [b, df] => ("0", *b, *df),
        _ => return id,
    };
    let Some((dev, func)) = devfn.split_once('.') else {
        return id;
    };
    let parse = |s: &str| u32::from_str_radix(s, 16).ok();
    match (parse(domain), parse(bus), parse(dev), parse(func)) {
        (Some(d), Some(b), Some(v), Some(f)) if d <= 0xffff && b <= 0xff && v <= 0x1f && f <= 7 => {
            format!("{d:04x}:{b:02x}:{v:02x}.{f:x}")
        }
        _ => id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_are_canonicalised() {
        assert_eq!(canonical_bus_id("00000000:18:00.0"), "0000:18:00.0");
        assert_eq!(canonical_bus_id("1B:00.0"), "0000:1b:00.0");
        assert_eq!(canonical_bus_id("0001:C1:00.1"), "0001:c1:00.1");
        assert_eq!(canonical_bus_id("garbage"), "garbage");
        assert_eq!(canonical_bus_id("0000:18:40.0"), "0000:18:40.0");
    }

    #[test]
    fn only_gpu_classes_of_gpu_vendors_count() {
        assert_eq!(gpu_vendor(0x10de, 0x030200), Some(Vendor::Nvidia));
        assert_eq!(gpu_vendor(0x10de, 0x030000), Some(Vendor::Nvidia));
        // NVSwitch bridges and the HDMI audio function are not GPUs.
        assert_eq!(gpu_vendor(0x10de, 0x068000), None);
        assert_eq!(gpu_vendor(0x10de, 0x040300), None);
        assert_eq!(gpu_vendor(0x1002, 0x120000), Some(Vendor::Amd));
        assert_eq!(gpu_vendor(0x1002, 0x038000), Some(Vendor::Amd));
        assert_eq!(gpu_vendor(0x8086, 0x030000), None);
        assert_eq!(gpu_vendor(0x1a03, 0x030000), None);
    }

    #[test]
    fn amd_gpus_get_rocrs_uuids_from_the_kfd_topology() {
        for with_uuids in [true, false] {
            let root = tempfile::tempdir().unwrap();
            crate::fakesys::mi300x_8().write_to(root.path()).unwrap();
            kernelkite_testkit_leaf::kfd::write_mi300x(root.path(), &[], with_uuids).unwrap();
            let topo = Topology::discover(root.path()).unwrap();
            let amd: Vec<_> = topo
                .gpus
                .iter()
                .filter(|g| g.vendor == Vendor::Amd)
                .collect();
            assert_eq!(amd.len(), 8);
            for (i, g) in amd.iter().enumerate() {
                assert_eq!(g.pci_bus_id, kernelkite_testkit_leaf::kfd::mi300x_bus_id(i));
                let want =
                    with_uuids.then(|| format!("GPU-{:016x}", 0x1d3a_0000_0000_0000u64 + i as u64));
                assert_eq!(g.uuid, want);
                // Every MI300X reaches the seven others over xGMI (KFD io_links of type 11).
                let peers: Vec<String> = (0..8)
                    .filter(|j| *j != i)
                    .map(kernelkite_testkit_leaf::kfd::mi300x_bus_id)
                    .collect();
                assert_eq!(g.links, peers);
            }
        }
    }

    /// The 8× MI300X node, its KFD topology in the given partitioning.
    fn partitioned(how: &kernelkite_testkit_leaf::kfd::Partitioning) -> Topology {
        let root = kernelkite_testkit_leaf::scratch();
        crate::fakesys::mi300x_8().write_to(root.path()).unwrap();
        kernelkite_testkit_leaf::kfd::write_mi300x_partitioned(root.path(), how, &[]).unwrap();
        Topology::discover(root.path()).unwrap()
    }

    #[test]
    fn a_partitioned_mi300x_is_one_gpu_with_its_partitions() {
        use kernelkite_testkit_leaf::kfd::{
            mi300x_bus_id, mi300x_render_minor, Partitioning, Uuids,
        };
        let topo = partitioned(&Partitioning::cpx());
        assert_eq!(topo.gpus.len(), 8);
        for (i, g) in topo.gpus.iter().enumerate() {
            assert_eq!(g.pci_bus_id, mi300x_bus_id(i));
            let p = g.partitioning.as_ref().expect("partitioned");
            assert_eq!(
                (p.compute.as_str(), p.memory.as_deref(), p.model.as_str()),
                ("CPX", Some("NPS1"), "MI300X")
            );
            let seen: Vec<(u32, u32)> = p
                .partitions
                .iter()
                .map(|q| (q.index, q.render_minor))
                .collect();
            let want: Vec<(u32, u32)> = (0..8)
                .map(|q| (q as u32, mi300x_render_minor(i, q)))
                .collect();
            assert_eq!(seen, want);
            // The shared id selects no partition: neither the GPU nor its partitions keep it.
            assert_eq!(g.uuid, None);
            assert!(p.partitions.iter().all(|q| q.uuid.is_none()));
            // xGMI peers are the 7 other GPUs, not partitions posing as PCI functions.
            let peers: Vec<String> = (0..8).filter(|j| *j != i).map(mi300x_bus_id).collect();
            assert_eq!(g.links, peers);
        }
        // Ids of their own (newer kernels) are each partition's.
        let own = partitioned(&Partitioning {
            uuids: Uuids::PerPartition,
            ..Partitioning::cpx()
        });
        let p = own.gpus[1].partitioning.as_ref().unwrap();
        assert_eq!(
            p.partitions[2].uuid.as_deref(),
            Some("GPU-1d3a000000000102")
        );
        assert_eq!(own.gpus[1].uuid, None);
        // A partition KFD lacks (no DRM minor was left for it): GPU 7 has 7.
        let short = partitioned(&Partitioning {
            missing: Some((7, 7)),
            ..Partitioning::cpx()
        });
        let counts: Vec<usize> = short
            .gpus
            .iter()
            .map(|g| g.partitioning.as_ref().map_or(0, |p| p.partitions.len()))
            .collect();
        assert_eq!(counts, [8, 8, 8, 8, 8, 8, 8, 7]);
        // Unreadable mode files (amdgpu refuses them during a reset): the mode comes from KFD.
        let root = kernelkite_testkit_leaf::scratch();
        crate::fakesys::mi300x_8().write_to(root.path()).unwrap();
        kernelkite_testkit_leaf::kfd::write_mi300x_partitioned(
            root.path(),
            &Partitioning::dpx(),
            &[],
        )
        .unwrap();
        for i in 0..8 {
            let dir = root
                .path()
                .join("sys/bus/pci/devices")
                .join(mi300x_bus_id(i));
            std::fs::remove_file(dir.join("current_compute_partition")).unwrap();
            std::fs::remove_file(dir.join("current_memory_partition")).unwrap();
        }
        let topo = Topology::discover(root.path()).unwrap();
        let p = topo.gpus[0].partitioning.as_ref().unwrap();
        assert_eq!((p.compute.as_str(), p.memory.as_deref()), ("DPX", None));
        // SPX beside the amdgpu_xcp_* devices: whole GPUs with their ids.
        let spx = partitioned(&Partitioning::spx());
        assert!(spx.gpus.iter().all(|g| g.partitioning.is_none()));
        assert_eq!(spx.gpus[3].uuid.as_deref(), Some("GPU-1d3a000000000003"));
    }

    #[test]
    fn gpus_without_a_shared_link_are_grouped_with_a_warning() {
        let root = tempfile::tempdir().unwrap();
        crate::fakesys::mi300x_8().write_to(root.path()).unwrap();
        kernelkite_testkit_leaf::kfd::write_mi300x(root.path(), &[], true).unwrap();
        let mut topo = Topology::discover(root.path()).unwrap();
        // Node 0's GPUs 0..4 keep only the links 0–2 and 1–3 (both ways).
        let bus = kernelkite_testkit_leaf::kfd::mi300x_bus_id;
        for (i, peer) in [(0, 2), (1, 3), (2, 0), (3, 1)] {
            topo.gpus[i].links = vec![bus(peer)];
        }
        let policy = |n| crate::planner::Policy {
            gpus_per_slice: n,
            ..Default::default()
        };
        let two = crate::planner::plan(&topo, &policy(2)).unwrap();
        let first: Vec<_> = two.slices[..2]
            .iter()
            .map(|s| {
                (
                    s.gpu.as_ref().unwrap().pci_bus_id.clone(),
                    s.extra_gpus[0].pci_bus_id.clone(),
                )
            })
            .collect();
        assert_eq!(first, [(bus(0), bus(2)), (bus(1), bus(3))]);
        assert!(
            two.warnings.iter().all(|w| !w.contains("fast link")),
            "{:?}",
            two.warnings
        );
        // Four GPUs of node 0 cannot all share links: the slice is made, and says so.
        let four = crate::planner::plan(&topo, &policy(4)).unwrap();
        assert_eq!(four.slices.len(), 2);
        assert!(
            four.warnings
                .iter()
                .any(|w| w.contains("share a fast link") && w.contains(&bus(0))),
            "{:?}",
            four.warnings
        );
    }
}
