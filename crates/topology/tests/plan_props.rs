//! Property tests: the planner's invariants over random topologies.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use kernelkite_topology::plan::Vendor;
use kernelkite_topology::planner::{plan, PlanError, Policy};
use kernelkite_topology::topology::{Cpu, Gpu, NumaNode, Topology};

/// A random machine: shape, SMT numbering, GPUs with (maybe unknown) nodes, offline CPUs and a
/// cpuset that may leave things out.
#[derive(Debug, Clone)]
struct Shape {
    packages: u32,
    nodes_per_package: u32,
    cores_per_node: u32,
    threads: u32,
    adjacent: bool,
    gpus: Vec<Option<u32>>,
    offline: Vec<u32>,
    disallowed: Vec<u32>,
    node_memory_gib: u64,
}

fn shape() -> impl Strategy<Value = Shape> {
    (
        1u32..=2,
        1u32..=2,
        1u32..=12,
        1u32..=2,
        any::<bool>(),
        4u64..=512,
    )
        .prop_flat_map(|(packages, npp, cpn, threads, adjacent, mem)| {
            let nodes = packages * npp;
            let ncpus = nodes * cpn * threads;
            (
                proptest::collection::vec(proptest::option::weighted(0.8, 0..nodes), 0..=8),
                proptest::collection::vec(0..ncpus, 0..3),
                proptest::collection::vec(0..ncpus, 0..4),
            )
                .prop_map(move |(gpus, offline, disallowed)| Shape {
                    packages,
                    nodes_per_package: npp,
                    cores_per_node: cpn,
                    threads,
                    adjacent,
                    gpus,
                    offline,
                    disallowed,
                    node_memory_gib: mem,
                })
        })
}

fn build(s: &Shape) -> Topology {
    let nodes = s.packages * s.nodes_per_package;
    let total_cores = nodes * s.cores_per_node;
    let mut cpus = Vec::new();
    for core in 0..total_cores {
        let node = core / s.cores_per_node;
        let package = node / s.nodes_per_package;
        let ids: Vec<u32> = (0..s.threads)
            .map(|t| {
                if s.adjacent {
                    core * s.threads + t
                } else {
                    t * total_cores + core
                }
            })
            .collect();
        let online_ids: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|i| !s.offline.contains(i))
            .collect();
        for &id in &ids {
            let online = online_ids.contains(&id);
            cpus.push(Cpu {
                id,
                package: online.then_some(package),
                core_id: online.then_some(core % s.cores_per_node),
                core: if online { online_ids[0] } else { id },
                numa_node: online.then_some(node),
                online,
            });
        }
    }
    cpus.sort_by_key(|c| c.id);
    let numa_nodes: Vec<NumaNode> = (0..nodes)
        .map(|n| NumaNode {
            id: n,
            cpus: cpus
                .iter()
                .filter(|c| c.online && c.numa_node == Some(n))
                .map(|c| c.id)
                .collect(),
            memory_bytes: s.node_memory_gib << 30,
        })
        .collect();
    let online: Vec<u32> = cpus.iter().filter(|c| c.online).map(|c| c.id).collect();
    let gpus = s
        .gpus
        .iter()
        .enumerate()
        .map(|(i, n)| Gpu {
            vendor: if i % 3 == 2 {
                Vendor::Amd
            } else {
                Vendor::Nvidia
            },
            pci_bus_id: format!("0000:{:02x}:00.0", i * 16 + 1),
            numa_node: *n,
            local_cpus: match n {
                Some(n) => numa_nodes[*n as usize].cpus.clone(),
                None => online.clone(),
            },
            uuid: None,
            minor: None,
            device_id: None,
            name: None,
            mig: vec![],
            mig_enabled: false,
            links: vec![],
            partitioning: None,
        })
        .collect();
    Topology {
        allowed_cpus: online
            .iter()
            .copied()
            .filter(|c| !s.disallowed.contains(c))
            .collect(),
        allowed_mems: Vec::new(),
        total_memory_bytes: numa_nodes.iter().map(|n| n.memory_bytes).sum(),
        numa_nodes,
        cpus,
        gpus,
    }
}

fn policy() -> impl Strategy<Value = Policy> {
    (0u32..=2, 1u32..=2, 0u32..=30).prop_map(|(hk, gps, reserve)| Policy {
        housekeeping_cores_per_node: hk,
        gpus_per_slice: gps,
        host_memory_reserve_percent: reserve,
        cpu_only_slices: Some(3),
        ..Policy::default()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn plans_keep_their_invariants(s in shape(), p in policy()) {
        let topo = build(&s);
        let allowed: BTreeSet<u32> = topo.allowed_cpus.iter().copied().collect();
        let core_of: BTreeMap<u32, u32> = topo.cpus.iter().filter(|c| c.online).map(|c| (c.id, c.core)).collect();
        let node_of: BTreeMap<u32, u32> = topo.cpus.iter().filter(|c| c.online).filter_map(|c| Some((c.id, c.numa_node?))).collect();
        // Cores usable after housekeeping, per node (what "enough local cores" means).
        let mut usable: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
        for c in &topo.cpus {
            if c.online && allowed.contains(&c.id) {
                usable.entry(c.numa_node.unwrap_or(0)).or_default().insert(c.core);
            }
        }
        let free: BTreeMap<u32, usize> = usable
            .iter()
            .map(|(n, cores)| (*n, cores.len().saturating_sub(p.housekeeping_cores_per_node as usize)))
            .collect();
        let total_free: usize = free.values().sum();

        let plan = match plan(&topo, &p) {
            Ok(plan) => plan,
            Err(PlanError::TooFewCores { slices, cores }) => {
                prop_assert!(cores < slices, "refused although {cores} cores >= {slices} slices");
                prop_assert_eq!(cores, total_free);
                return Ok(());
            }
            Err(PlanError::InvalidPolicy(e)) => {
                let g = p.gpus_per_slice as usize;
                let most = [Vendor::Nvidia, Vendor::Amd].map(|v| topo.gpus.iter().filter(|x| x.vendor == v).count());
                prop_assert!(!topo.gpus.is_empty() && most.iter().all(|n| *n < g), "{}", e);
                return Ok(());
            }
            Err(PlanError::NoUsableCpus(_)) => {
                prop_assert!(allowed.is_empty());
                return Ok(());
            }
            Err(e) => return Err(TestCaseError::fail(format!("unexpected error {e}"))),
        };

        // Disjoint, allowed, online, never reserved.
        let mut owner: BTreeMap<u32, u32> = BTreeMap::new();
        for sl in &plan.slices {
            for c in &sl.cpus {
                prop_assert!(allowed.contains(c), "CPU {} not allowed", c);
                prop_assert!(!plan.reserved_cpus.contains(c));
                prop_assert!(owner.insert(*c, sl.index).is_none(), "CPU {} in two slices", c);
            }
        }
        // SMT siblings never split between slices.
        let mut core_owner: BTreeMap<u32, u32> = BTreeMap::new();
        for (cpu, slice) in &owner {
            let prev = core_owner.insert(core_of[cpu], *slice);
            prop_assert!(prev.is_none() || prev == Some(*slice), "core of CPU {} split", cpu);
        }
        // Every allowed thread of a planned core is in that slice (no sibling left for another).
        for (cpu, core) in &core_of {
            if allowed.contains(cpu) {
                if let Some(sl) = core_owner.get(core) {
                    prop_assert_eq!(owner.get(cpu), Some(sl));
                }
            }
        }
        // Sizes in cores within one of each other.
        let sizes: Vec<usize> = plan
            .slices
            .iter()
            .map(|sl| sl.cpus.iter().map(|c| core_of[c]).collect::<BTreeSet<_>>().len())
            .collect();
        if let (Some(min), Some(max)) = (sizes.iter().min(), sizes.iter().max()) {
            prop_assert!(max - min <= 1, "sizes {:?}", sizes);
            prop_assert!(*min >= 1);
        }
        // NUMA-local when every node has a free core per slice it hosts.
        let mut demand: BTreeMap<u32, usize> = BTreeMap::new();
        let mut local_possible = true;
        for sl in &plan.slices {
            let nodes: BTreeSet<Option<u32>> = sl.gpu.iter().chain(&sl.extra_gpus).map(|g| g.numa_node).collect();
            match sl.gpu.as_ref().and_then(|g| g.numa_node) {
                Some(n) if nodes.len() == 1 && free.get(&n).copied().unwrap_or(0) > 0 => {
                    *demand.entry(n).or_default() += 1
                }
                _ => local_possible = false,
            }
        }
        local_possible &= demand.iter().all(|(n, d)| free[n] >= *d);
        if local_possible {
            for sl in &plan.slices {
                let n = sl.gpu.as_ref().and_then(|g| g.numa_node).unwrap_or(0);
                prop_assert!(sl.cpus.iter().all(|c| node_of.get(c) == Some(&n)), "slice {} not local", sl.index);
                prop_assert_eq!(&sl.mems, &vec![n]);
            }
        }
        // Memory of the slices on a node fits in the node.
        let mut mem: BTreeMap<u32, u64> = BTreeMap::new();
        for sl in &plan.slices {
            prop_assert!(!sl.mems.is_empty());
            if let [only] = sl.mems.as_slice() {
                *mem.entry(*only).or_default() += sl.memory_bytes;
            }
            for n in &sl.mems {
                prop_assert!(sl.memory_bytes <= topo.numa_node(*n).map(|x| x.memory_bytes).unwrap_or(0));
            }
        }
        for (n, used) in mem {
            let node = topo.numa_node(n).map(|x| x.memory_bytes).unwrap_or(0);
            prop_assert!(used <= node, "node {} gives {} > {}", n, used, node);
            let reserve = node * u64::from(p.host_memory_reserve_percent) / 100;
            prop_assert!(used <= node - reserve);
        }
        // Every GPU is in a slice unless the grouping leaves a remainder.
        let in_slices: usize = plan.slices.iter().map(|sl| sl.gpu.iter().count() + sl.extra_gpus.len()).sum();
        let g = p.gpus_per_slice as usize;
        let per_vendor = |v: Vendor| topo.gpus.iter().filter(|x| x.vendor == v).count() / g * g;
        prop_assert_eq!(in_slices, per_vendor(Vendor::Nvidia) + per_vendor(Vendor::Amd));
        // Slice numbers follow the bus order of their first GPU.
        let firsts: Vec<&str> = plan.slices.iter().filter_map(|sl| sl.gpu.as_ref()).map(|g| g.pci_bus_id.as_str()).collect();
        let mut sorted = firsts.clone();
        sorted.sort_unstable();
        prop_assert_eq!(firsts, sorted);
        // Same input, same output.
        prop_assert_eq!(kernelkite_topology::planner::plan(&topo, &p).ok(), Some(plan));
    }
}
