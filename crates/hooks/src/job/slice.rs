//! The job's slice: the node's plan, the planned slices of its leased GPUs merged, then
//! narrowed to what the step asks for (`memory`, `cpus-per-gpu`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use kernelkite_topology::plan::{Plan, Slice, SliceGpu, Vendor};
use kernelkite_topology::planner::{self, Policy};
use kernelkite_topology::topology::Topology;

use super::{JobError, Settings};
use crate::config::PluginConfig;

/// The node's plan: the plan file when configured, else planned now from sysfs with the
/// default policy (every job plans the same way, so slices never overlap).
pub fn node_plan(settings: &Settings) -> Result<Plan, JobError> {
    if let Some(path) = &settings.plan_file {
        let text = std::fs::read_to_string(path).map_err(|source| JobError::PlanRead {
            path: path.clone(),
            source,
        })?;
        return serde_json::from_str(&text).map_err(|source| JobError::PlanParse {
            path: path.clone(),
            source,
        });
    }
    let topo = Topology::discover(&settings.sysfs_root).map_err(JobError::Topology)?;
    planner::plan(&topo, &Policy::default()).map_err(JobError::Plan)
}

/// Merges the planned slices of the leased GPUs into the job's slice.
pub fn merge_slices(slices: &[&Slice]) -> Option<Slice> {
    let first = slices.first()?;
    let mut gpus: Vec<SliceGpu> = Vec::new();
    let mut cpus = Vec::new();
    let mut mems = Vec::new();
    let mut memory = 0u64;
    for s in slices {
        gpus.extend(s.gpus().into_iter().cloned());
        cpus.extend(&s.cpus);
        mems.extend(&s.mems);
        memory = memory.saturating_add(s.memory_bytes);
    }
    cpus.sort_unstable();
    cpus.dedup();
    mems.sort_unstable();
    mems.dedup();
    let mut slice = Slice {
        index: first.index,
        gpu: None,
        extra_gpus: Vec::new(),
        cpus,
        mems,
        memory_bytes: memory,
    };
    slice.set_gpus(gpus);
    Some(slice)
}

/// The NUMA node a slice's CPUs and memory come from: its first GPU's, else its first memory
/// node (the planner's home).
fn home(slice: &Slice) -> u32 {
    slice
        .gpu
        .as_ref()
        .and_then(|g| g.numa_node)
        .or_else(|| slice.mems.first().copied())
        .unwrap_or(0)
}

/// The sets a pool job's `count` slices may come from, best first (the lease's
/// [`Want::Pool`](crate::lease::Want::Pool) tiers), as the queue agents' groups are made
/// (`planner::multi_gpu_groups`): one vendor's slices on one NUMA node first, then one
/// vendor's anywhere; within each level, lowest index first. A tier never mixes vendors (CUDA
/// and ROCm each see only their own GPUs) and never holds a MIG slice (a job of one GPU).
/// Fast links are not in the plan: on the nodes that have them (NVSwitch, MI300X xGMI) every
/// GPU reaches every other, so a NUMA node is the neighbourhood that matters.
/// One slice: every slice, as before. A pool no vendor can fill is refused; on a one-vendor
/// node it is one tier of every slice, so the lease says how many there are.
pub fn pool_tiers(plan: &Plan, count: u32) -> Result<Vec<Vec<u32>>, JobError> {
    let all: Vec<u32> = plan.slices.iter().map(|s| s.index).collect();
    if count <= 1 {
        return Ok(vec![all]);
    }
    let n = count as usize;
    let mut mig = 0;
    // Vendor (None: CPU-only slices) → home node → slice indices.
    let mut by_vendor: BTreeMap<Option<Vendor>, BTreeMap<u32, Vec<u32>>> = BTreeMap::new();
    for s in &plan.slices {
        if s.gpus().iter().any(|g| g.mig.is_some()) {
            mig += 1;
            continue;
        }
        by_vendor
            .entry(s.gpu.as_ref().map(|g| g.vendor))
            .or_default()
            .entry(home(s))
            .or_default()
            .push(s.index);
    }
    let mut near: Vec<Vec<u32>> = Vec::new();
    let mut wide: Vec<Vec<u32>> = Vec::new();
    for nodes in by_vendor.values() {
        let mut every: Vec<u32> = nodes.values().flatten().copied().collect();
        every.sort_unstable();
        if nodes.len() > 1 {
            near.extend(nodes.values().filter(|idx| idx.len() >= n).cloned());
        }
        if every.len() >= n {
            wide.push(every);
        }
    }
    for tier in near.iter_mut() {
        tier.sort_unstable();
    }
    near.sort();
    wide.sort();
    near.extend(wide);
    if !near.is_empty() {
        return Ok(near);
    }
    if by_vendor.len() <= 1 && mig == 0 {
        return Ok(vec![all]);
    }
    let have = by_vendor
        .iter()
        .map(|(v, nodes)| {
            let name = v.map_or("CPU-only", Vendor::as_str);
            format!("{name} {}", nodes.values().map(Vec::len).sum::<usize>())
        })
        .collect::<Vec<_>>()
        .join(", ");
    Err(JobError::NoVendorHasEnough {
        wanted: count,
        have,
        mig,
    })
}

/// `a`, `a and b`, `a, b and c`.
fn and_list(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

/// A line for the job log when a pool job's slices sit on several NUMA nodes (no one node
/// had enough free): its CPUs and memory nodes are all of theirs, some remote to each GPU.
pub fn spread_notice(plan: &Plan, gpus: &[u32]) -> Option<String> {
    let slices: Vec<&Slice> = gpus
        .iter()
        .filter_map(|g| plan.slices.iter().find(|s| s.index == *g))
        .collect();
    let nodes: BTreeSet<u32> = slices.iter().map(|s| home(s)).collect();
    if nodes.len() < 2 {
        return None;
    }
    let indices: Vec<String> = slices.iter().map(|s| s.index.to_string()).collect();
    let nodes: Vec<String> = nodes.iter().map(u32::to_string).collect();
    Some(format!(
        "slices {} sit on NUMA nodes {}: no one node had {} free, so the job's CPUs and memory span them",
        and_list(&indices),
        and_list(&nodes),
        slices.len()
    ))
}

/// Keeps `want` CPUs of `cpus`, whole cores first (SMT siblings grouped by the sysfs
/// topology under `sysfs_root`), rounding up to a whole core.
pub fn narrow_cpus(cpus: &[u32], want: usize, sysfs_root: &Path) -> Vec<u32> {
    let core_of = |cpu: u32| -> Option<(String, String)> {
        let dir = sysfs_root.join(format!("sys/devices/system/cpu/cpu{cpu}/topology"));
        let pkg = std::fs::read_to_string(dir.join("physical_package_id")).ok()?;
        let core = std::fs::read_to_string(dir.join("core_id")).ok()?;
        Some((pkg.trim().to_string(), core.trim().to_string()))
    };
    // (package, core) → CPUs, in first-seen order.
    type CoreKey = Option<(String, String)>;
    let mut groups: Vec<(CoreKey, Vec<u32>)> = Vec::new();
    for &cpu in cpus {
        let key = core_of(cpu);
        match groups.iter_mut().find(|(k, _)| key.is_some() && *k == key) {
            Some((_, members)) => members.push(cpu),
            None => groups.push((key, vec![cpu])),
        }
    }
    let mut out = Vec::new();
    for (_, members) in groups {
        if out.len() >= want {
            break;
        }
        out.extend(members);
    }
    out.sort_unstable();
    out
}

/// The job's slice for the leased `gpus`: their planned slices merged, then lowered to the
/// step's `memory` and `cpus-per-gpu`, which may only lower the slice's share.
pub fn job_slice(
    plan: &Plan,
    gpus: &[u32],
    config: &PluginConfig,
    sysfs_root: &Path,
) -> Result<Slice, JobError> {
    let parts: Vec<&Slice> = gpus
        .iter()
        .filter_map(|g| plan.slices.iter().find(|s| s.index == *g))
        .collect();
    if parts.len() > 1 {
        let mig = parts
            .iter()
            .find(|s| s.gpu.as_ref().is_some_and(|g| g.mig.is_some()));
        if let Some(m) = mig {
            return Err(JobError::MigInGroup {
                slices: parts.len(),
                mig: m.index,
            });
        }
    }
    let vendors: BTreeSet<Vendor> = parts
        .iter()
        .flat_map(|s| s.gpus())
        .map(|g| g.vendor)
        .collect();
    if vendors.len() > 1 {
        let named: Vec<String> = parts
            .iter()
            .map(|s| match &s.gpu {
                Some(g) => format!("{} ({} {})", s.index, g.vendor, g.pci_bus_id),
                None => format!("{} (no GPU)", s.index),
            })
            .collect();
        return Err(JobError::MixedVendors {
            slices: and_list(&named),
        });
    }
    let mut slice = merge_slices(&parts).ok_or(JobError::EmptyPlan)?;
    if let Some(mem) = config.memory_bytes {
        if mem > slice.memory_bytes {
            return Err(JobError::OverSlice {
                key: "memory",
                asked: mem.to_string(),
                has: format!("{} bytes", slice.memory_bytes),
            });
        }
        slice.memory_bytes = mem;
    }
    if let Some(per) = config.cpus_per_gpu {
        let want = per as usize * gpus.len();
        if want > slice.cpus.len() {
            return Err(JobError::OverSlice {
                key: "cpus-per-gpu",
                asked: per.to_string(),
                has: format!("{} CPUs for {} GPU(s)", slice.cpus.len(), gpus.len()),
            });
        }
        slice.cpus = narrow_cpus(&slice.cpus, want, sysfs_root);
    }
    Ok(slice)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::exports::exports_for;
    use crate::job::test_support::nv;

    #[test]
    fn merged_slices_union_resources() {
        let a = Slice {
            index: 2,
            gpu: Some(nv("a", Some("GPU-a"))),
            extra_gpus: vec![],
            cpus: vec![4, 5],
            mems: vec![0],
            memory_bytes: 10,
        };
        let b = Slice {
            index: 3,
            gpu: Some(nv("b", Some("GPU-b"))),
            extra_gpus: vec![],
            cpus: vec![6, 7],
            mems: vec![1],
            memory_bytes: 20,
        };
        let m = merge_slices(&[&a, &b]).unwrap();
        assert_eq!(m.cpus, vec![4, 5, 6, 7]);
        assert_eq!(m.mems, vec![0, 1]);
        assert_eq!(m.memory_bytes, 30);
        assert_eq!(m.extra_gpus.len(), 1);
        let e = exports_for(&m, &[2, 3], true);
        assert_eq!(e["CUDA_VISIBLE_DEVICES"], "GPU-a,GPU-b");
        assert_eq!(e["KERNELBOT_GPU_INDEX"], "2,3");
        assert_eq!(e["KERNELBOT_CPUSET"], "4-7");
        let back: Slice = serde_json::from_str(&e["KERNELKITE_SLICE"]).unwrap();
        assert_eq!(back, m);
    }

    /// The default plan of a named fake machine.
    fn fixture_plan(name: &str) -> Plan {
        let root = tempfile::tempdir().unwrap();
        kernelkite_topology::fakesys::fixture(name)
            .unwrap()
            .write_to(root.path())
            .unwrap();
        let topo = Topology::discover(root.path()).unwrap();
        planner::plan(&topo, &Policy::default()).unwrap()
    }

    #[test]
    fn pool_tiers_prefer_one_numa_node_then_one_vendor() {
        // DGX H100: GPUs 0-3 on node 0, 4-7 on node 1.
        let dgx = fixture_plan("dgx-h100");
        assert_eq!(pool_tiers(&dgx, 1).unwrap(), [(0..8).collect::<Vec<u32>>()]);
        assert_eq!(
            pool_tiers(&dgx, 2).unwrap(),
            [vec![0u32, 1, 2, 3], vec![4, 5, 6, 7], (0..8).collect()]
        );
        // Five fit no one node: the whole node, one vendor.
        assert_eq!(pool_tiers(&dgx, 5).unwrap(), [(0..8).collect::<Vec<u32>>()]);
        // More than the node has: one tier of everything, for the lease to say so.
        assert_eq!(pool_tiers(&dgx, 9).unwrap(), [(0..8).collect::<Vec<u32>>()]);
        // Mixed vendors (0 NVIDIA and 1 AMD on node 0, 2 NVIDIA and 3 AMD on node 1): one
        // node has one of each vendor, so each vendor's pair spans the nodes; no tier mixes.
        let mixed = fixture_plan("mixed-vendors");
        assert_eq!(pool_tiers(&mixed, 2).unwrap(), [vec![0u32, 2], vec![1, 3]]);
        let e = pool_tiers(&mixed, 3).unwrap_err();
        assert!(
            matches!(e, JobError::NoVendorHasEnough { wanted: 3, .. }),
            "{e}"
        );
        assert!(
            e.to_string()
                .contains("no vendor has 3 GPU slices on this node (nvidia 2, amd 2)"),
            "{e}"
        );
        // A MIG slice is never in a tier, and the refusal says why it is not counted.
        let mut mig = dgx.clone();
        for s in &mut mig.slices[..6] {
            if let Some(g) = s.gpu.as_mut() {
                g.mig = Some(kernelkite_topology::plan::MigInstance {
                    uuid: format!("MIG-{}", s.index),
                    gpu_instance_id: 1,
                    compute_instance_id: 0,
                    memory_bytes: 1 << 30,
                });
            }
        }
        assert_eq!(pool_tiers(&mig, 2).unwrap(), [vec![6u32, 7]]);
        let e = pool_tiers(&mig, 3).unwrap_err().to_string();
        assert!(e.contains("(nvidia 2; 6 MIG device slice(s)"), "{e}");
    }

    #[test]
    fn a_job_of_two_vendors_slices_is_refused_and_a_spread_pool_job_is_told() {
        let mixed = fixture_plan("mixed-vendors");
        let none = Path::new("/nonexistent");
        let e = job_slice(&mixed, &[0, 1], &PluginConfig::default(), none).unwrap_err();
        assert!(matches!(e, JobError::MixedVendors { .. }), "{e}");
        assert!(
            e.to_string().contains(
                "slices 0 (nvidia 0000:18:00.0) and 1 (amd 0000:3b:00.0): a job's GPUs must all be one vendor's"
            ),
            "{e}"
        );
        let both = job_slice(&mixed, &[0, 2], &PluginConfig::default(), none).unwrap();
        assert_eq!(both.mems, [0, 1]);
        assert_eq!(
            spread_notice(&mixed, &[0, 2]).as_deref(),
            Some("slices 0 and 2 sit on NUMA nodes 0 and 1: no one node had 2 free, so the job's CPUs and memory span them")
        );
        let dgx = fixture_plan("dgx-h100");
        assert_eq!(spread_notice(&dgx, &[1, 2]), None);
    }

    #[test]
    fn narrowing_keeps_whole_cores() {
        let root = tempfile::tempdir().unwrap();
        // CPUs 0/4 and 1/5 are siblings.
        for (cpu, core) in [(0, 0), (1, 1), (4, 0), (5, 1)] {
            let d = root
                .path()
                .join(format!("sys/devices/system/cpu/cpu{cpu}/topology"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("physical_package_id"), "0\n").unwrap();
            std::fs::write(d.join("core_id"), format!("{core}\n")).unwrap();
        }
        assert_eq!(narrow_cpus(&[0, 1, 4, 5], 2, root.path()), vec![0, 4]);
        assert_eq!(narrow_cpus(&[0, 1, 4, 5], 3, root.path()), vec![0, 1, 4, 5]);
        // Without topology each CPU counts alone.
        assert_eq!(
            narrow_cpus(&[0, 1, 4, 5], 2, Path::new("/nonexistent")),
            vec![0, 1]
        );
    }

    #[test]
    fn the_step_may_lower_the_slice_but_never_raise_it() {
        let plan = Plan {
            slices: vec![Slice {
                index: 0,
                gpu: Some(nv("0000:18:00.0", None)),
                extra_gpus: vec![],
                cpus: vec![0, 1, 2, 3],
                mems: vec![0],
                memory_bytes: 1 << 30,
            }],
            reserved_cpus: vec![],
            warnings: vec![],
        };
        let none = Path::new("/nonexistent");
        let lower = PluginConfig {
            memory_bytes: Some(256 << 20),
            cpus_per_gpu: Some(2),
            ..PluginConfig::default()
        };
        let s = job_slice(&plan, &[0], &lower, none).unwrap();
        assert_eq!((s.memory_bytes, s.cpus), (256 << 20, vec![0, 1]));
        let more_memory = PluginConfig {
            memory_bytes: Some(2 << 30),
            ..PluginConfig::default()
        };
        let e = job_slice(&plan, &[0], &more_memory, none).unwrap_err();
        assert!(
            matches!(e, JobError::OverSlice { key: "memory", .. }),
            "{e}"
        );
        let more_cpus = PluginConfig {
            cpus_per_gpu: Some(5),
            ..PluginConfig::default()
        };
        let e = job_slice(&plan, &[0], &more_cpus, none).unwrap_err();
        assert!(
            matches!(
                e,
                JobError::OverSlice {
                    key: "cpus-per-gpu",
                    ..
                }
            ),
            "{e}"
        );
        assert!(matches!(
            job_slice(&plan, &[7], &PluginConfig::default(), none),
            Err(JobError::EmptyPlan)
        ));
    }

    #[test]
    fn a_missing_or_broken_plan_file_keeps_its_cause() {
        let dir = tempfile::tempdir().unwrap();
        let mut settings = Settings {
            plan_file: Some(dir.path().join("missing.json")),
            ..Settings::default()
        };
        let e = node_plan(&settings).unwrap_err();
        let JobError::PlanRead { source, .. } = &e else {
            panic!("{e}")
        };
        assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        assert!(
            e.to_string().contains("kernelkite-isolate plan --json >"),
            "{e}"
        );
        std::fs::write(dir.path().join("broken.json"), "{").unwrap();
        settings.plan_file = Some(dir.path().join("broken.json"));
        let e = node_plan(&settings).unwrap_err();
        assert!(matches!(e, JobError::PlanParse { .. }), "{e}");
        assert!(std::error::Error::source(&e).is_some());
    }
}
