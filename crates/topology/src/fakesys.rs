//! Fake sysfs/procfs trees of known machines, for tests, demos and benchmarks without hardware.
//!
//! [`FakeSys`] describes a machine (CPUs, SMT numbering, NUMA nodes, memory, cpuset, PCI GPUs)
//! and [`FakeSys::write_to`] lays out the files [`crate::topology::Topology::discover`] and
//! hwloc's Linux backend read, so `hwloc-calc --input ROOT` can check our reading of it.

use std::fmt::Write as _;
use std::fs;
use std::io;
use std::path::Path;

use crate::cpulist::format_cpu_list;
use crate::plan::Vendor;

const GIB: u64 = 1 << 30;

/// How SMT siblings are numbered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmtNumbering {
    /// Linux's usual x86 order: first threads of all cores, then second threads
    /// (core 0 = CPUs 0 and 0+N on an N-core machine).
    Offset,
    /// Siblings next to each other (core 0 = CPUs 0/1), as on many ARM and some BIOSes.
    Adjacent,
}

/// One logical CPU of a fake machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeCpu {
    /// Logical CPU id.
    pub id: u32,
    /// Physical package (socket).
    pub package: u32,
    /// `core_id` within the package.
    pub core_id: u32,
    /// NUMA node.
    pub node: u32,
    /// Whether it is online.
    pub online: bool,
}

/// One PCI function of a fake machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakePci {
    /// `dddd:bb:dd.f`.
    pub bus_id: String,
    /// PCI vendor id.
    pub vendor: u16,
    /// PCI device id.
    pub device: u16,
    /// PCI class (`0x030200` for a 3D controller).
    pub class: u32,
    /// As sysfs writes it: -1 when the firmware does not say.
    pub numa_node: i32,
    /// NVIDIA driver information (`GPU UUID`, `Device Minor`, `Model`), when the driver is loaded.
    pub nvidia: Option<(String, u32, String)>,
}

/// A fake machine. Build it with [`FakeSys::machine`] and the `with_*` methods, or take a
/// named one from [`fixture`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeSys {
    /// The logical CPUs.
    pub cpus: Vec<FakeCpu>,
    /// NUMA nodes and their memory in bytes.
    pub nodes: Vec<(u32, u64)>,
    /// The process's cpuset; `None` = every online CPU.
    pub allowed_cpus: Option<Vec<u32>>,
    /// The process's memory nodes; `None` = every node.
    pub allowed_mems: Option<Vec<u32>>,
    /// The PCI functions.
    pub pci: Vec<FakePci>,
}

impl FakeSys {
    /// A uniform machine: `packages` sockets of `cores` cores with `threads` SMT threads each,
    /// `nodes_per_package` NUMA nodes per socket (cores split evenly) and `memory_per_node`.
    pub fn machine(
        packages: u32,
        cores: u32,
        threads: u32,
        numbering: SmtNumbering,
        nodes_per_package: u32,
        memory_per_node: u64,
    ) -> FakeSys {
        let total_cores = packages * cores;
        let mut cpus = Vec::new();
        for pkg in 0..packages {
            for c in 0..cores {
                let global_core = pkg * cores + c;
                let node = pkg * nodes_per_package + c * nodes_per_package / cores;
                for t in 0..threads {
                    let id = match numbering {
                        SmtNumbering::Offset => t * total_cores + global_core,
                        SmtNumbering::Adjacent => global_core * threads + t,
                    };
                    cpus.push(FakeCpu {
                        id,
                        package: pkg,
                        core_id: c,
                        node,
                        online: true,
                    });
                }
            }
        }
        cpus.sort_by_key(|c| c.id);
        let nodes = (0..packages * nodes_per_package)
            .map(|n| (n, memory_per_node))
            .collect();
        FakeSys {
            cpus,
            nodes,
            allowed_cpus: None,
            allowed_mems: None,
            pci: Vec::new(),
        }
    }

    /// Adds a GPU. NVIDIA GPUs get driver information (UUID, minor = NVIDIA GPUs so far).
    pub fn with_gpu(mut self, vendor: Vendor, bus_id: &str, numa_node: i32) -> FakeSys {
        let (vendor_id, device, class) = match vendor {
            Vendor::Nvidia => (0x10de, 0x2330, 0x030200),
            Vendor::Amd => (0x1002, 0x74a1, 0x120000),
        };
        self = self.with_pci(bus_id, vendor_id, device, class, numa_node);
        if vendor == Vendor::Nvidia {
            let minor = self.pci.iter().filter(|p| p.nvidia.is_some()).count() as u32;
            let bus = bus_id.replace([':', '.'], "");
            let uuid = format!("GPU-{:0>8}-0000-4000-8000-{:0>12}", minor, bus);
            if let Some(last) = self.pci.last_mut() {
                last.nvidia = Some((uuid, minor, "NVIDIA H100 80GB HBM3".into()));
            }
        }
        self
    }

    /// Adds any PCI function (NVSwitches, BMC graphics, NICs: things that must not count).
    pub fn with_pci(
        mut self,
        bus_id: &str,
        vendor: u16,
        device: u16,
        class: u32,
        numa_node: i32,
    ) -> FakeSys {
        self.pci.push(FakePci {
            bus_id: bus_id.to_string(),
            vendor,
            device,
            class,
            numa_node,
            nvidia: None,
        });
        self
    }

    /// Sets these CPUs offline.
    pub fn with_offline(mut self, cpus: &[u32]) -> FakeSys {
        for c in &mut self.cpus {
            if cpus.contains(&c.id) {
                c.online = false;
            }
        }
        self
    }

    /// Restricts the process's cpuset.
    pub fn with_allowed(mut self, cpus: &[u32]) -> FakeSys {
        self.allowed_cpus = Some(cpus.to_vec());
        self
    }

    /// Restricts the process's memory nodes.
    pub fn with_allowed_mems(mut self, nodes: &[u32]) -> FakeSys {
        self.allowed_mems = Some(nodes.to_vec());
        self
    }

    /// Drops the NVIDIA driver's `/proc` files (a node where the driver is not loaded).
    pub fn without_nvidia_driver(mut self) -> FakeSys {
        for p in &mut self.pci {
            p.nvidia = None;
        }
        self
    }

    fn online(&self) -> Vec<u32> {
        self.cpus
            .iter()
            .filter(|c| c.online)
            .map(|c| c.id)
            .collect()
    }

    fn node_cpus(&self, node: u32) -> Vec<u32> {
        self.cpus
            .iter()
            .filter(|c| c.online && c.node == node)
            .map(|c| c.id)
            .collect()
    }

    /// Total memory: the nodes' sum.
    pub fn total_memory(&self) -> u64 {
        self.nodes.iter().map(|(_, m)| m).sum()
    }

    /// Writes the tree under `root` (created if missing).
    pub fn write_to(&self, root: &Path) -> io::Result<()> {
        let nbits = self.cpus.iter().map(|c| c.id + 1).max().unwrap_or(1);
        self.write_cpus(root, nbits)?;
        self.write_nodes(root, nbits)?;
        self.write_proc(root)?;
        self.write_doctor_traces(root)?;
        self.write_pci(root, nbits)
    }

    /// `sys/devices/system/cpu`: the CPU lists and each online CPU's topology. `nbits` is
    /// the width of the masks.
    fn write_cpus(&self, root: &Path, nbits: u32) -> io::Result<()> {
        let all: Vec<u32> = self.cpus.iter().map(|c| c.id).collect();
        let online = self.online();
        let cpu_dir = root.join("sys/devices/system/cpu");
        write(&cpu_dir.join("online"), &format_cpu_list(&online))?;
        write(&cpu_dir.join("present"), &format_cpu_list(&all))?;
        write(&cpu_dir.join("possible"), &format_cpu_list(&all))?;
        write(&cpu_dir.join("offline"), &format_cpu_list(&self.offline()))?;
        for cpu in &self.cpus {
            let dir = cpu_dir.join(format!("cpu{}", cpu.id));
            fs::create_dir_all(&dir)?;
            if cpu.id != 0 {
                write(&dir.join("online"), if cpu.online { "1" } else { "0" })?;
            }
            if !cpu.online {
                // The kernel removes `topology/` of an offline CPU.
                continue;
            }
            let siblings: Vec<u32> = self
                .cpus
                .iter()
                .filter(|c| c.online && c.package == cpu.package && c.core_id == cpu.core_id)
                .map(|c| c.id)
                .collect();
            let package: Vec<u32> = self
                .cpus
                .iter()
                .filter(|c| c.online && c.package == cpu.package)
                .map(|c| c.id)
                .collect();
            // The files our reader needs plus the masks hwloc's Linux backend needs; every file
            // costs a syscall round trip when the tree is written, so no more than that.
            let t = dir.join("topology");
            write(&t.join("physical_package_id"), &cpu.package.to_string())?;
            write(&t.join("core_id"), &cpu.core_id.to_string())?;
            write(&t.join("thread_siblings_list"), &format_cpu_list(&siblings))?;
            write(&t.join("thread_siblings"), &format_mask(&siblings, nbits))?;
            write(&t.join("core_siblings"), &format_mask(&package, nbits))?;
            write(&t.join("core_siblings_list"), &format_cpu_list(&package))?;
        }
        Ok(())
    }

    /// `sys/devices/system/node`: the node lists and each node's CPUs, memory and distances.
    fn write_nodes(&self, root: &Path, nbits: u32) -> io::Result<()> {
        let node_dir = root.join("sys/devices/system/node");
        let node_ids: Vec<u32> = self.nodes.iter().map(|(n, _)| *n).collect();
        write(&node_dir.join("online"), &format_cpu_list(&node_ids))?;
        write(&node_dir.join("possible"), &format_cpu_list(&node_ids))?;
        write(&node_dir.join("has_memory"), &format_cpu_list(&node_ids))?;
        write(&node_dir.join("has_cpu"), &format_cpu_list(&node_ids))?;
        for (id, mem) in &self.nodes {
            let d = node_dir.join(format!("node{id}"));
            let cpus = self.node_cpus(*id);
            write(&d.join("cpulist"), &format_cpu_list(&cpus))?;
            write(&d.join("cpumap"), &format_mask(&cpus, nbits))?;
            let kb = mem / 1024;
            write(
                &d.join("meminfo"),
                &format!("Node {id} MemTotal:       {kb} kB\nNode {id} MemFree:        {kb} kB\nNode {id} MemUsed:        0 kB\n"),
            )?;
            let distance: Vec<String> = self
                .nodes
                .iter()
                .map(|(o, _)| if o == id { "10".into() } else { "21".into() })
                .collect();
            write(&d.join("distance"), &distance.join(" "))?;
            fs::create_dir_all(d.join("hugepages"))?;
        }
        Ok(())
    }

    /// `proc`: the memory, this process's allowed CPUs and memory nodes, and `cpuinfo`.
    fn write_proc(&self, root: &Path) -> io::Result<()> {
        let online = self.online();
        let node_ids: Vec<u32> = self.nodes.iter().map(|(n, _)| *n).collect();
        let kb = self.total_memory() / 1024;
        write(
            &root.join("proc/meminfo"),
            &format!("MemTotal:       {kb} kB\nMemFree:        {kb} kB\nMemAvailable:   {kb} kB\n"),
        )?;
        let allowed = self.allowed_cpus.clone().unwrap_or_else(|| online.clone());
        write(
            &root.join("proc/self/status"),
            &format!(
                "Name:\tkernelkite-isolate\nCpus_allowed_list:\t{}\nMems_allowed_list:\t{}\n",
                format_cpu_list(&allowed),
                format_cpu_list(self.allowed_mems.as_deref().unwrap_or(&node_ids))
            ),
        )?;
        write(&root.join("proc/cpuinfo"), &self.cpuinfo())?;
        Ok(())
    }

    /// What `doctor` looks for: a cgroup v2 hierarchy with the controllers isolation needs,
    /// and the GPU drivers' traces.
    fn write_doctor_traces(&self, root: &Path) -> io::Result<()> {
        write(
            &root.join("proc/self/mountinfo"),
            "25 1 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw\n\
             26 25 0:24 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:8 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot",
        )?;
        write(
            &root.join("sys/fs/cgroup/cgroup.controllers"),
            "cpuset cpu io memory hugetlb pids rdma misc",
        )?;
        if self.pci.iter().any(|p| p.nvidia.is_some()) {
            write(
                &root.join("proc/driver/nvidia/version"),
                "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.90.07  Fri May 31 09:35:42 UTC 2024\nGCC version:  gcc version 12.3.0",
            )?;
        }
        if self.pci.iter().any(|p| p.vendor == 0x1002) {
            write(&root.join("dev/kfd"), "")?;
            fs::create_dir_all(root.join("sys/module/amdgpu"))?;
        }
        Ok(())
    }

    /// `sys/bus/pci/devices`, and each NVIDIA GPU's `proc/driver/nvidia` information.
    fn write_pci(&self, root: &Path, nbits: u32) -> io::Result<()> {
        let online = self.online();
        let pci_dir = root.join("sys/bus/pci/devices");
        fs::create_dir_all(&pci_dir)?;
        for p in &self.pci {
            let d = pci_dir.join(&p.bus_id);
            write(&d.join("vendor"), &format!("0x{:04x}", p.vendor))?;
            write(&d.join("device"), &format!("0x{:04x}", p.device))?;
            write(&d.join("class"), &format!("0x{:06x}", p.class))?;
            write(&d.join("numa_node"), &p.numa_node.to_string())?;
            let local = match u32::try_from(p.numa_node) {
                Ok(n) => self.node_cpus(n),
                Err(_) => online.clone(),
            };
            write(&d.join("local_cpulist"), &format_cpu_list(&local))?;
            write(&d.join("local_cpus"), &format_mask(&local, nbits))?;
            if let Some((uuid, minor, model)) = &p.nvidia {
                let info = format!(
                    "Model: \t\t {model}\nIRQ:   \t\t 0\nGPU UUID: \t {uuid}\nVideo BIOS: \t 96.00.00.00.00\nBus Type: \t PCIe\n\
                     DMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\nBus Location: \t {}\nDevice Minor: \t {minor}\nGPU Excluded:\t No\n",
                    p.bus_id
                );
                write(
                    &root.join(format!("proc/driver/nvidia/gpus/{}/information", p.bus_id)),
                    &info,
                )?;
            }
        }
        Ok(())
    }

    fn offline(&self) -> Vec<u32> {
        self.cpus
            .iter()
            .filter(|c| !c.online)
            .map(|c| c.id)
            .collect()
    }

    fn cpuinfo(&self) -> String {
        let mut s = String::new();
        for c in self.cpus.iter().filter(|c| c.online) {
            let _ = write!(
                s,
                "processor\t: {}\nvendor_id\t: GenuineIntel\nmodel name\t: Fake CPU\nphysical id\t: {}\ncore id\t\t: {}\n\n",
                c.id, c.package, c.core_id
            );
        }
        s
    }
}

/// The kernel's hex cpumask: 32-bit words, most significant first, comma-separated.
pub fn format_mask(cpus: &[u32], nbits: u32) -> String {
    let words = nbits.div_ceil(32).max(1) as usize;
    let mut w = vec![0u32; words];
    for &c in cpus {
        if let Some(word) = w.get_mut((c / 32) as usize) {
            *word |= 1 << (c % 32);
        }
    }
    w.iter()
        .rev()
        .map(|x| format!("{x:08x}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn write(path: &Path, contents: &str) -> io::Result<()> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent)?;
    }
    fs::write(path, format!("{contents}\n"))
}

/// DGX H100: 2 × 56-core Xeon 8480C, SMT 2 (siblings +112), one NUMA node per socket with
/// 1 TiB each, 8 H100s (4 per socket), plus 4 NVSwitches and the BMC's VGA that must not count.
pub fn dgx_h100() -> FakeSys {
    let mut f = FakeSys::machine(2, 56, 2, SmtNumbering::Offset, 1, 1024 * GIB);
    for (bus, node) in [
        ("0000:18:00.0", 0),
        ("0000:2a:00.0", 0),
        ("0000:3a:00.0", 0),
        ("0000:5d:00.0", 0),
        ("0000:9a:00.0", 1),
        ("0000:ab:00.0", 1),
        ("0000:ba:00.0", 1),
        ("0000:db:00.0", 1),
    ] {
        f = f.with_gpu(Vendor::Nvidia, bus, node);
    }
    for (i, bus) in [
        "0000:05:00.0",
        "0000:06:00.0",
        "0000:07:00.0",
        "0000:08:00.0",
    ]
    .iter()
    .enumerate()
    {
        f = f.with_pci(bus, 0x10de, 0x22a3, 0x068000, (i / 2) as i32);
    }
    f.with_pci("0000:03:00.0", 0x1a03, 0x2000, 0x030000, 0)
}

/// 8 × MI300X on 2 × 96-core EPYC 9654 (SMT 2, siblings +192), NPS1, 768 GiB per node.
/// Instinct GPUs report PCI class 0x1200 (processing accelerator).
pub fn mi300x_8() -> FakeSys {
    let mut f = FakeSys::machine(2, 96, 2, SmtNumbering::Offset, 1, 768 * GIB);
    for (bus, node) in [
        ("0000:05:00.0", 0),
        ("0000:15:00.0", 0),
        ("0000:65:00.0", 0),
        ("0000:75:00.0", 0),
        ("0000:85:00.0", 1),
        ("0000:95:00.0", 1),
        ("0000:e5:00.0", 1),
        ("0000:f5:00.0", 1),
    ] {
        f = f.with_gpu(Vendor::Amd, bus, node);
    }
    f
}

/// The prototype's node: 2 × L40S and 16 CPUs (8 cores, SMT 2) on one socket whose firmware
/// reports no NUMA node for the GPUs (-1), 128 GiB.
pub fn l40s_2x16cpu() -> FakeSys {
    let mut f = FakeSys::machine(1, 8, 2, SmtNumbering::Offset, 1, 128 * GIB)
        .with_gpu(Vendor::Nvidia, "0000:01:00.0", -1)
        .with_gpu(Vendor::Nvidia, "0000:02:00.0", -1);
    for p in &mut f.pci {
        p.device = 0x26b9;
        if let Some(n) = &mut p.nvidia {
            n.2 = "NVIDIA L40S".into();
        }
    }
    f
}

/// A workstation: one 16-core socket (SMT 2), 128 GiB, one GPU.
pub fn workstation_1gpu() -> FakeSys {
    let mut f = FakeSys::machine(1, 16, 2, SmtNumbering::Offset, 1, 128 * GIB).with_gpu(
        Vendor::Nvidia,
        "0000:01:00.0",
        0,
    );
    if let Some(p) = f.pci.first_mut() {
        p.device = 0x2684;
        p.class = 0x030000;
        if let Some(n) = &mut p.nvidia {
            n.2 = "NVIDIA GeForce RTX 4090".into();
        }
    }
    f
}

/// A CPU-only box: one 8-core socket (SMT 2), 32 GiB, BMC graphics only.
pub fn cpu_only() -> FakeSys {
    FakeSys::machine(1, 8, 2, SmtNumbering::Offset, 1, 32 * GIB).with_pci(
        "0000:03:00.0",
        0x1a03,
        0x2000,
        0x030000,
        0,
    )
}

/// 2 × 8 cores whose SMT siblings are numbered adjacently (0/1, 2/3, ...), 4 GPUs, 2 per node.
pub fn adjacent_smt() -> FakeSys {
    FakeSys::machine(2, 8, 2, SmtNumbering::Adjacent, 1, 128 * GIB)
        .with_gpu(Vendor::Nvidia, "0000:17:00.0", 0)
        .with_gpu(Vendor::Nvidia, "0000:31:00.0", 0)
        .with_gpu(Vendor::Nvidia, "0000:b1:00.0", 1)
        .with_gpu(Vendor::Nvidia, "0000:ca:00.0", 1)
}

/// 2 × 16 cores (SMT 2) with two NVIDIA and two AMD GPUs.
pub fn mixed_vendors() -> FakeSys {
    FakeSys::machine(2, 16, 2, SmtNumbering::Offset, 1, 256 * GIB)
        .with_gpu(Vendor::Nvidia, "0000:18:00.0", 0)
        .with_gpu(Vendor::Amd, "0000:3b:00.0", 0)
        .with_gpu(Vendor::Nvidia, "0000:86:00.0", 1)
        .with_gpu(Vendor::Amd, "0000:af:00.0", 1)
}

/// Names accepted by [`fixture`], with a one-line description each.
pub const FIXTURES: &[(&str, &str)] = &[
    (
        "dgx-h100",
        "DGX H100: 2x56 cores, SMT 2 (siblings +112), 8 GPUs, 4 per socket",
    ),
    (
        "mi300x-8",
        "8x MI300X on 2x96-core EPYC, SMT 2 (siblings +192)",
    ),
    (
        "l40s-2x16cpu",
        "the prototype's node: 2x L40S, 16 CPUs, GPU NUMA node -1",
    ),
    ("workstation-1gpu", "one 16-core socket, SMT 2, one GPU"),
    ("cpu-only", "one 8-core socket, SMT 2, no GPU"),
    (
        "adjacent-smt",
        "2x8 cores with SMT siblings numbered 0/1, 2/3; 4 GPUs",
    ),
    ("mixed-vendors", "2x16 cores, SMT 2, 2 NVIDIA + 2 AMD GPUs"),
];

/// A named fixture (see [`FIXTURES`]).
pub fn fixture(name: &str) -> Option<FakeSys> {
    Some(match name {
        "dgx-h100" => dgx_h100(),
        "mi300x-8" => mi300x_8(),
        "l40s-2x16cpu" => l40s_2x16cpu(),
        "workstation-1gpu" => workstation_1gpu(),
        "cpu-only" => cpu_only(),
        "adjacent-smt" => adjacent_smt(),
        "mixed-vendors" => mixed_vendors(),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_are_kernel_formatted() {
        assert_eq!(format_mask(&[0, 1], 8), "00000003");
        assert_eq!(format_mask(&[0, 32], 64), "00000001,00000001");
        assert_eq!(format_mask(&[], 1), "00000000");
    }

    #[test]
    fn smt_numbering_follows_the_scheme() {
        let f = FakeSys::machine(2, 4, 2, SmtNumbering::Offset, 1, GIB);
        let core0: Vec<u32> = f
            .cpus
            .iter()
            .filter(|c| c.package == 0 && c.core_id == 0)
            .map(|c| c.id)
            .collect();
        assert_eq!(core0, vec![0, 8]);
        let f = FakeSys::machine(2, 4, 2, SmtNumbering::Adjacent, 1, GIB);
        let core1: Vec<u32> = f
            .cpus
            .iter()
            .filter(|c| c.package == 0 && c.core_id == 1)
            .map(|c| c.id)
            .collect();
        assert_eq!(core1, vec![2, 3]);
        assert!(f.cpus.iter().filter(|c| c.package == 1).all(|c| c.id >= 8));
    }

    #[test]
    fn every_listed_fixture_exists() {
        for (name, _) in FIXTURES {
            assert!(fixture(name).is_some(), "{name}");
        }
        assert!(fixture("nope").is_none());
    }
}
