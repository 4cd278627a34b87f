//! Topology from a sysfs/procfs tree.
//!
//! Files read, all relative to the root:
//! - `sys/devices/system/cpu/{present,online}` and `cpuN/topology/{physical_package_id,core_id,
//!   thread_siblings_list}`
//! - `sys/devices/system/node/nodeN/{cpulist,meminfo}`
//! - `proc/meminfo` (`MemTotal`), `proc/self/status` (`Cpus_allowed_list`, `Mems_allowed_list`)
//! - `sys/bus/pci/devices/*/{vendor,device,class,numa_node,local_cpulist}`
//! - `proc/driver/nvidia/gpus/*/information` (`Device Minor`, `GPU UUID`, `Model`)

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::{canonical_bus_id, gpu_vendor, Cpu, Gpu, NumaNode, Topology, TopologyError};
use crate::cpulist::parse_cpu_list;

pub(crate) fn read(root: &Path) -> Result<Topology, TopologyError> {
    let cpu_dir = root.join("sys/devices/system/cpu");
    let online = read_list(&cpu_dir.join("online"))?;
    if online.is_empty() {
        return Err(TopologyError::NoCpus(root.to_path_buf()));
    }
    // `present` includes CPUs that are offline; fall back to `possible`, then to what is online.
    let present = match read_optional(&cpu_dir.join("present"))? {
        Some(s) => parse_list(&cpu_dir.join("present"), &s)?,
        None => match read_optional(&cpu_dir.join("possible"))? {
            Some(s) => parse_list(&cpu_dir.join("possible"), &s)?,
            None => online.clone(),
        },
    };
    let mut all: Vec<u32> = present.iter().chain(online.iter()).copied().collect();
    all.sort_unstable();
    all.dedup();

    let numa_nodes = read_numa_nodes(root)?;
    let node_of: BTreeMap<u32, u32> = numa_nodes
        .iter()
        .flat_map(|n| n.cpus.iter().map(move |&c| (c, n.id)))
        .collect();

    let mut cpus = read_cpus(&cpu_dir, all, &online, &node_of)?;

    let total_memory_bytes = read_meminfo_total(&root.join("proc/meminfo"))?;
    let numa_nodes = if numa_nodes.is_empty() {
        // No NUMA support in the kernel: the whole machine is node 0.
        for cpu in &mut cpus {
            if cpu.online {
                cpu.numa_node = Some(0);
            }
        }
        vec![NumaNode {
            id: 0,
            cpus: online.clone(),
            memory_bytes: total_memory_bytes,
        }]
    } else {
        numa_nodes
    };

    let (allowed_cpus, allowed_mems) = read_allowed(&root.join("proc/self/status"))?;
    let allowed_cpus = allowed_cpus.unwrap_or_else(|| online.clone());
    let mut gpus = read_pci_gpus(root)?;
    read_nvidia_proc(root, &mut gpus)?;

    let mut topo = Topology {
        cpus,
        numa_nodes,
        total_memory_bytes,
        allowed_cpus,
        allowed_mems: allowed_mems.unwrap_or_default(),
        gpus,
    };
    topo.normalise();
    Ok(topo)
}

/// The CPUs `all`, each online one with its package and core from its `topology/` files and
/// its NUMA node from `node_of`.
fn read_cpus(
    cpu_dir: &Path,
    all: Vec<u32>,
    online: &[u32],
    node_of: &BTreeMap<u32, u32>,
) -> Result<Vec<Cpu>, TopologyError> {
    let mut cpus = Vec::with_capacity(all.len());
    // Files are read once per core and once per package, not once per CPU: a DGX H100 has
    // 224 CPUs, and on a live node each sysfs read is a syscall round trip that `plan` pays at
    // every job start.
    let mut per_core: BTreeMap<u32, (Option<u32>, u32)> = BTreeMap::new();
    let mut package_of: BTreeMap<u32, Option<u32>> = BTreeMap::new();
    for id in all {
        let is_online = online.binary_search(&id).is_ok();
        let (package, core_id, core) = if !is_online {
            (None, None, id)
        } else if let Some((core_id, core)) = per_core.get(&id).copied() {
            (package_of.get(&id).copied().flatten(), core_id, core)
        } else {
            let topo = cpu_dir.join(format!("cpu{id}/topology"));
            let siblings = read_first_list(&[
                &topo.join("thread_siblings_list"),
                &topo.join("core_cpus_list"),
            ])?
            .unwrap_or_else(|| vec![id]);
            // Offline siblings are listed by some kernels; only online ones form the core key.
            let siblings: Vec<u32> = siblings
                .into_iter()
                .filter(|s| *s == id || online.binary_search(s).is_ok())
                .collect();
            let core = siblings.iter().copied().min().unwrap_or(id);
            let core_id = read_optional_int(&topo.join("core_id"))?.map(|c| c.max(0) as u32);
            if !package_of.contains_key(&id) {
                let package =
                    read_optional_int(&topo.join("physical_package_id"))?.map(|p| p.max(0) as u32);
                let members = read_first_list(&[
                    &topo.join("package_cpus_list"),
                    &topo.join("core_siblings_list"),
                ])?
                .unwrap_or_default();
                for m in members.into_iter().chain([id]) {
                    package_of.insert(m, package);
                }
            }
            for s in siblings {
                per_core.insert(s, (core_id, core));
            }
            (package_of.get(&id).copied().flatten(), core_id, core)
        };
        cpus.push(Cpu {
            id,
            package,
            core_id,
            core,
            numa_node: node_of.get(&id).copied(),
            online: is_online,
        });
    }
    Ok(cpus)
}

fn io_err(path: &Path, source: io::Error) -> TopologyError {
    TopologyError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn parse_err(path: &Path, reason: impl Into<String>) -> TopologyError {
    TopologyError::Parse {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn read_optional(path: &Path) -> Result<Option<String>, TopologyError> {
    match fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(path, e)),
    }
}

fn read_list(path: &Path) -> Result<Vec<u32>, TopologyError> {
    let s = fs::read_to_string(path).map_err(|e| io_err(path, e))?;
    parse_list(path, &s)
}

fn parse_list(path: &Path, s: &str) -> Result<Vec<u32>, TopologyError> {
    parse_cpu_list(s).map_err(|source| TopologyError::CpuList {
        path: path.to_path_buf(),
        source,
    })
}

/// The first of these list files that exists, parsed.
fn read_first_list(paths: &[&Path]) -> Result<Option<Vec<u32>>, TopologyError> {
    for p in paths {
        if let Some(s) = read_optional(p)? {
            return parse_list(p, &s).map(Some);
        }
    }
    Ok(None)
}

fn read_optional_int(path: &Path) -> Result<Option<i64>, TopologyError> {
    match read_optional(path)? {
        None => Ok(None),
        Some(s) => s
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| parse_err(path, format!("expected an integer, found {:?}", s.trim()))),
    }
}

fn read_hex(path: &Path) -> Result<Option<u32>, TopologyError> {
    match read_optional(path)? {
        None => Ok(None),
        Some(s) => {
            let t = s.trim();
            let digits = t.strip_prefix("0x").unwrap_or(t);
            u32::from_str_radix(digits, 16)
                .map(Some)
                .map_err(|_| parse_err(path, format!("expected a hex number, found {t:?}")))
        }
    }
}

/// `MemTotal:  123456 kB` → bytes.
fn parse_kb_line(line: &str, key: &str) -> Option<u64> {
    let pos = line.find(key)?;
    let rest = line[pos + key.len()..].trim();
    let mut it = rest.split_whitespace();
    let n: u64 = it.next()?.parse().ok()?;
    match it.next() {
        Some("kB") | Some("KB") | Some("kb") => n.checked_mul(1024),
        None => Some(n),
        Some(_) => None,
    }
}

fn read_meminfo_total(path: &Path) -> Result<u64, TopologyError> {
    let s = fs::read_to_string(path).map_err(|e| io_err(path, e))?;
    s.lines()
        .find(|l| l.contains("MemTotal:"))
        .and_then(|l| parse_kb_line(l, "MemTotal:"))
        .ok_or_else(|| parse_err(path, "no `MemTotal: N kB` line"))
}

fn read_numa_nodes(root: &Path) -> Result<Vec<NumaNode>, TopologyError> {
    let dir = root.join("sys/devices/system/node");
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(&dir, e)),
    };
    let mut nodes = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| io_err(&dir, e))?;
        let name = entry.file_name();
        let Some(id) = name
            .to_str()
            .and_then(|n| n.strip_prefix("node"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let path = entry.path();
        let cpus = match read_optional(&path.join("cpulist"))? {
            Some(s) => parse_list(&path.join("cpulist"), &s)?,
            None => Vec::new(),
        };
        let memory_bytes = match read_optional(&path.join("meminfo"))? {
            Some(s) => s
                .lines()
                .find(|l| l.contains("MemTotal:"))
                .and_then(|l| parse_kb_line(l, "MemTotal:"))
                .unwrap_or(0),
            None => 0,
        };
        nodes.push(NumaNode {
            id,
            cpus,
            memory_bytes,
        });
    }
    nodes.sort_by_key(|n| n.id);
    Ok(nodes)
}

type Allowed = (Option<Vec<u32>>, Option<Vec<u32>>);

fn read_allowed(path: &Path) -> Result<Allowed, TopologyError> {
    let Some(s) = read_optional(path)? else {
        return Ok((None, None));
    };
    let mut cpus = None;
    let mut mems = None;
    for line in s.lines() {
        if let Some(v) = line.strip_prefix("Cpus_allowed_list:") {
            cpus = Some(parse_list(path, v)?);
        } else if let Some(v) = line.strip_prefix("Mems_allowed_list:") {
            mems = Some(parse_list(path, v)?);
        }
    }
    Ok((cpus, mems))
}

fn read_pci_gpus(root: &Path) -> Result<Vec<Gpu>, TopologyError> {
    let dir = root.join("sys/bus/pci/devices");
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(&dir, e)),
    };
    let mut gpus = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| io_err(&dir, e))?;
        let Some(bus_id) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let path: PathBuf = entry.path();
        let (Some(vendor_id), Some(class)) = (
            read_hex(&path.join("vendor"))?,
            read_hex(&path.join("class"))?,
        ) else {
            continue;
        };
        let Some(vendor) = u16::try_from(vendor_id)
            .ok()
            .and_then(|v| gpu_vendor(v, class))
        else {
            continue;
        };
        let numa_node =
            read_optional_int(&path.join("numa_node"))?.and_then(|n| u32::try_from(n).ok());
        let local_cpus = match read_optional(&path.join("local_cpulist"))? {
            Some(s) => parse_list(&path.join("local_cpulist"), &s)?,
            None => Vec::new(),
        };
        let device_id = read_hex(&path.join("device"))?.and_then(|d| u16::try_from(d).ok());
        gpus.push(Gpu {
            vendor,
            pci_bus_id: canonical_bus_id(&bus_id),
            numa_node,
            local_cpus,
            uuid: None,
            minor: None,
            device_id,
            name: None,
            mig: Vec::new(),
            mig_enabled: false,
            links: Vec::new(),
            partitioning: None,
        });
    }
    Ok(gpus)
}

/// Fields of the NVIDIA driver's `/proc/driver/nvidia/gpus/<bus id>/information`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct NvidiaInformation {
    /// `Model`.
    pub model: Option<String>,
    /// `GPU UUID`.
    pub uuid: Option<String>,
    /// `Device Minor`.
    pub minor: Option<u32>,
    /// `Bus Location`.
    pub bus_location: Option<String>,
}

/// Parses the driver's `information` file (`Key:  value` lines).
pub fn parse_nvidia_information(s: &str) -> NvidiaInformation {
    let mut info = NvidiaInformation::default();
    for line in s.lines() {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        let v = v.trim();
        match k.trim() {
            "Model" => info.model = Some(v.to_string()),
            "GPU UUID" if v.starts_with("GPU-") => info.uuid = Some(v.to_string()),
            "Device Minor" => info.minor = v.parse().ok(),
            "Bus Location" => info.bus_location = Some(canonical_bus_id(v)),
            _ => {}
        }
    }
    info
}

fn read_nvidia_proc(root: &Path, gpus: &mut [Gpu]) -> Result<(), TopologyError> {
    let dir = root.join("proc/driver/nvidia/gpus");
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err(&dir, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| io_err(&dir, e))?;
        let Some(s) = read_optional(&entry.path().join("information"))? else {
            continue;
        };
        let info = parse_nvidia_information(&s);
        let bus = info
            .bus_location
            .clone()
            .unwrap_or_else(|| canonical_bus_id(&entry.file_name().to_string_lossy()));
        if let Some(gpu) = gpus.iter_mut().find(|g| g.pci_bus_id == bus) {
            gpu.uuid = gpu.uuid.take().or(info.uuid);
            gpu.minor = gpu.minor.or(info.minor);
            gpu.name = gpu.name.take().or(info.model);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_drivers_information_file() {
        let s = "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 17\nGPU UUID: \t GPU-2f1e3a4b-0000-1111-2222-333344445555\n\
                 Video BIOS: \t 96.00.74.00.0d\nBus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\n\
                 Bus Location: \t 0000:18:00.0\nDevice Minor: \t 3\nGPU Excluded:\t No\n";
        let info = parse_nvidia_information(s);
        assert_eq!(info.model.as_deref(), Some("NVIDIA H100 80GB HBM3"));
        assert_eq!(
            info.uuid.as_deref(),
            Some("GPU-2f1e3a4b-0000-1111-2222-333344445555")
        );
        assert_eq!(info.minor, Some(3));
        assert_eq!(info.bus_location.as_deref(), Some("0000:18:00.0"));
    }

    #[test]
    fn older_drivers_hide_the_uuid() {
        let info = parse_nvidia_information("GPU UUID: \t Unknown\nDevice Minor: x\n");
        assert_eq!(info.uuid, None);
        assert_eq!(info.minor, None);
    }

    #[test]
    fn meminfo_lines_are_bytes() {
        assert_eq!(
            parse_kb_line("MemTotal:       2048 kB", "MemTotal:"),
            Some(2 * 1024 * 1024)
        );
        assert_eq!(
            parse_kb_line("Node 1 MemTotal:  4 kB", "MemTotal:"),
            Some(4096)
        );
        assert_eq!(parse_kb_line("MemTotal: lots", "MemTotal:"), None);
    }
}
