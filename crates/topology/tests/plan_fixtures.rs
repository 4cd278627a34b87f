//! Topology discovery and planning on the named fake machines and on built edge cases.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, OnceLock};

use kernelkite_topology::cpulist::parse_cpu_list;
use kernelkite_topology::fakesys::{self, FakeSys, SmtNumbering};
use kernelkite_topology::plan::{Plan, Vendor};
use kernelkite_topology::planner::{plan, plan_explained, PlanError, Policy};
use kernelkite_topology::topology::Topology;

use kernelkite_testkit_leaf::{assert_warns, scratch};

const GIB: u64 = 1 << 30;

fn discover(f: &FakeSys) -> Topology {
    let dir = scratch();
    f.write_to(dir.path()).unwrap();
    Topology::discover(dir.path()).unwrap()
}

/// A named fixture's topology, written and read once per test binary: writing a tree costs
/// thousands of small files.
fn named(name: &str) -> Topology {
    static CACHE: OnceLock<Mutex<BTreeMap<String, Topology>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
    map.entry(name.to_string())
        .or_insert_with(|| discover(&fakesys::fixture(name).unwrap()))
        .clone()
}

fn list(s: &str) -> Vec<u32> {
    parse_cpu_list(s).unwrap()
}

/// Asserts the plan's core invariants against the topology: disjoint slices, whole cores,
/// allowed online CPUs only, reserved CPUs in no slice.
fn assert_sound(topo: &Topology, plan: &Plan) {
    let core_of: BTreeMap<u32, u32> = topo
        .cpus
        .iter()
        .filter(|c| c.online)
        .map(|c| (c.id, c.core))
        .collect();
    let mut owner: BTreeMap<u32, u32> = BTreeMap::new();
    for s in &plan.slices {
        assert!(!s.cpus.is_empty(), "slice {} has no CPU", s.index);
        for c in &s.cpus {
            assert!(topo.allowed_cpus.contains(c), "CPU {c} not allowed");
            assert!(core_of.contains_key(c), "CPU {c} offline");
            assert!(
                !plan.reserved_cpus.contains(c),
                "CPU {c} reserved and in slice {}",
                s.index
            );
            assert_eq!(owner.insert(*c, s.index), None, "CPU {c} in two slices");
        }
    }
    let mut core_owner: BTreeMap<u32, u32> = BTreeMap::new();
    for (cpu, slice) in &owner {
        let prev = core_owner.insert(core_of[cpu], *slice);
        assert!(
            prev.is_none() || prev == Some(*slice),
            "core of CPU {cpu} split"
        );
    }
}

#[test]
fn dgx_h100_is_discovered_as_built() {
    let topo = named("dgx-h100");
    assert_eq!(topo.cpus.len(), 224);
    assert_eq!(topo.physical_cores().len(), 112);
    assert_eq!(topo.threads_per_core(), 2);
    assert_eq!(topo.packages(), vec![0, 1]);
    assert_eq!(topo.numa_nodes.len(), 2);
    assert_eq!(topo.numa_nodes[0].cpus, list("0-55,112-167"));
    assert_eq!(topo.numa_nodes[1].memory_bytes, 1024 * GIB);
    assert_eq!(topo.total_memory_bytes, 2048 * GIB);
    assert_eq!(topo.allowed_cpus, list("0-223"));
    // CPU 112 is CPU 0's sibling: the same physical core.
    let cpu = |id: u32| topo.cpus.iter().find(|c| c.id == id).unwrap();
    assert_eq!(cpu(112).core, 0);
    assert_eq!(cpu(168).core, 56);
    assert_eq!(cpu(168).package, Some(1));
    // NVSwitches (class 0x0680) and the BMC's VGA (ASPEED) are not GPUs.
    let buses: Vec<&str> = topo.gpus.iter().map(|g| g.pci_bus_id.as_str()).collect();
    assert_eq!(
        buses,
        [
            "0000:18:00.0",
            "0000:2a:00.0",
            "0000:3a:00.0",
            "0000:5d:00.0",
            "0000:9a:00.0",
            "0000:ab:00.0",
            "0000:ba:00.0",
            "0000:db:00.0"
        ]
    );
    for (i, g) in topo.gpus.iter().enumerate() {
        assert_eq!(g.vendor, Vendor::Nvidia);
        assert_eq!(g.minor, Some(i as u32), "minor from /proc/driver/nvidia");
        assert!(g.uuid.as_deref().is_some_and(|u| u.starts_with("GPU-")));
        assert_eq!(g.numa_node, Some(if i < 4 { 0 } else { 1 }));
        assert_eq!(g.local_cpus, topo.numa_nodes[i / 4].cpus);
        assert_eq!(g.name.as_deref(), Some("NVIDIA H100 80GB HBM3"));
    }
}

#[test]
fn dgx_h100_plan_is_local_whole_cores_and_equal() {
    let topo = named("dgx-h100");
    let p = plan(&topo, &Policy::default()).unwrap();
    assert_sound(&topo, &p);
    assert_eq!(p.slices.len(), 8);
    assert_eq!(p.reserved_cpus, vec![0, 56, 112, 168]);
    // 55 free cores per socket / 4 GPUs = 13 cores = 26 CPUs each.
    assert_eq!(p.slices[0].cpus, list("1-13,113-125"));
    assert_eq!(p.slices[4].cpus, list("57-69,169-181"));
    let node_mem = 1024 * GIB;
    for s in &p.slices {
        let node = if s.index < 4 { 0 } else { 1 };
        assert_eq!(
            s.gpu.as_ref().unwrap().pci_bus_id,
            topo.gpus[s.index as usize].pci_bus_id
        );
        assert_eq!(s.cpus.len(), 26);
        assert!(s
            .cpus
            .iter()
            .all(|c| topo.numa_nodes[node].cpus.contains(c)));
        assert_eq!(s.mems, vec![node as u32]);
        assert_eq!(s.memory_bytes, (node_mem - node_mem / 10) / 4);
    }
    // The 3 cores per socket that do not divide by 4 are reported, not given away.
    assert_warns(&p.warnings, &["53-55,109-111,165-167,221-223"]);
}

#[test]
fn mi300x_node_plans_amd_accelerators() {
    let topo = named("mi300x-8");
    assert_eq!(topo.gpus.len(), 8);
    assert!(topo
        .gpus
        .iter()
        .all(|g| g.vendor == Vendor::Amd && g.uuid.is_none() && g.minor.is_none()));
    let p = plan(&topo, &Policy::default()).unwrap();
    assert_sound(&topo, &p);
    // (96 - 1) / 4 = 23 cores each.
    assert!(p.slices.iter().all(|s| s.cpus.len() == 46));
    assert_eq!(p.slices[0].cpus, list("1-23,193-215"));
    assert_eq!(p.slices[7].mems, vec![1]);
    assert_eq!(p.slices[7].gpu.as_ref().unwrap().vendor, Vendor::Amd);
}

/// The 8× MI300X node with its KFD topology in the given partitioning.
fn mi300x_partitioned(how: &kernelkite_testkit_leaf::kfd::Partitioning) -> Topology {
    let dir = scratch();
    fakesys::mi300x_8().write_to(dir.path()).unwrap();
    kernelkite_testkit_leaf::kfd::write_mi300x_partitioned(dir.path(), how, &[]).unwrap();
    Topology::discover(dir.path()).unwrap()
}

#[test]
fn a_partitioned_mi300x_is_refused_with_the_fix() {
    use kernelkite_testkit_leaf::kfd::Partitioning;
    for (how, mode, count, last) in [
        (Partitioning::cpx(), "CPX", 8, 135),
        (Partitioning::dpx(), "DPX", 2, 129),
    ] {
        let err = plan(&mi300x_partitioned(&how), &Policy::default()).unwrap_err();
        assert!(
            matches!(&err, PlanError::PartitionedGpu { more: 7, partitions, .. } if *partitions == count),
            "{err:?}"
        );
        let msg = err.to_string();
        for part in [
            "GPU 0000:05:00.0 (AMD Instinct MI300X)",
            &format!("is in {mode} compute partitioning (NPS1 memory; 7 more GPU(s) likewise)"),
            &format!("as {count} GPUs (renderD128-renderD{last})"),
            &format!("1/{count} of the GPU"),
            "`sudo amd-smi set --gpu all --compute-partition SPX`",
        ] {
            assert!(msg.contains(part), "{part:?} not in {msg}");
        }
        assert!(!msg.contains("--memory-partition"), "{msg}");
    }
    // NPS4 memory allows CPX only: memory goes back to NPS1 first.
    let nps4 = Partitioning {
        memory: "NPS4",
        ..Partitioning::cpx()
    };
    let msg = plan(&mi300x_partitioned(&nps4), &Policy::default())
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("(NPS4 memory; 7 more GPU(s) likewise)")
            && msg.contains("`sudo amd-smi set --gpu all --memory-partition NPS1` (it is NPS4), then `sudo amd-smi set --gpu all --compute-partition SPX`"),
        "{msg}"
    );
    // SPX, its amdgpu_xcp_* devices present as always: planned as 8 whole GPUs.
    let topo = mi300x_partitioned(&Partitioning::spx());
    let p = plan(&topo, &Policy::default()).unwrap();
    assert_sound(&topo, &p);
    assert_eq!(p.slices.len(), 8);
    assert_eq!(
        p.slices[3].gpu.as_ref().unwrap().uuid.as_deref(),
        Some("GPU-1d3a000000000003")
    );
}

#[test]
fn prototype_l40s_node_with_unknown_gpu_numa() {
    let topo = named("l40s-2x16cpu");
    assert!(topo.gpus.iter().all(|g| g.numa_node.is_none()));
    let e = plan_explained(&topo, &Policy::default()).unwrap();
    let p = &e.plan;
    assert_sound(&topo, p);
    // 8 cores, 1 housekeeping, 7 / 2 = 3 cores each, one core left.
    assert_eq!(p.slices[0].cpus, list("1-3,9-11"));
    assert_eq!(p.slices[1].cpus, list("4-6,12-14"));
    assert_eq!(p.reserved_cpus, vec![0, 8]);
    assert!(p
        .slices
        .iter()
        .all(|s| s.mems == vec![0] && s.gpu.as_ref().unwrap().numa_node.is_none()));
    assert_warns(&p.warnings, &["0000:01:00.0", "-1"]);
    assert_warns(&p.warnings, &["7,15"]);
    assert!(
        e.notes.iter().any(|n| n.contains("slice size: 3")),
        "{:?}",
        e.notes
    );
}

#[test]
fn workstation_gets_one_slice_of_everything_but_housekeeping() {
    let topo = named("workstation-1gpu");
    let p = plan(&topo, &Policy::default()).unwrap();
    assert_eq!(p.slices.len(), 1);
    assert_eq!(p.slices[0].cpus, list("1-15,17-31"));
    assert!(p.warnings.is_empty(), "{:?}", p.warnings);
    assert_eq!(
        p.slices[0].memory_bytes,
        128 * GIB - (128 * GIB).div_ceil(10)
    );
}

#[test]
fn cpu_only_box_needs_the_flag() {
    let topo = named("cpu-only");
    assert!(topo.gpus.is_empty(), "BMC graphics is not a GPU");
    let err = plan(&topo, &Policy::default()).unwrap_err();
    assert_eq!(err, PlanError::NoGpus);
    assert!(err.to_string().contains("--cpu-only-slices"));
    let p = plan(
        &topo,
        &Policy {
            cpu_only_slices: Some(2),
            ..Policy::default()
        },
    )
    .unwrap();
    assert_sound(&topo, &p);
    assert_eq!(p.slices.len(), 2);
    assert!(p
        .slices
        .iter()
        .all(|s| s.gpu.is_none() && s.cpus.len() == 6));
    let json = serde_json::to_string(&p.slices[0]).unwrap();
    assert!(json.contains(r#""gpu":null"#), "{json}");
}

#[test]
fn adjacent_siblings_stay_together() {
    let topo = named("adjacent-smt");
    assert_eq!(topo.cpus.iter().find(|c| c.id == 1).unwrap().core, 0);
    let p = plan(&topo, &Policy::default()).unwrap();
    assert_sound(&topo, &p);
    // Node 0 = CPUs 0-15 (cores 0/1 .. 14/15); core 0/1 kept; 7 cores / 2 = 3 each.
    assert_eq!(p.reserved_cpus, list("0-1,16-17"));
    assert_eq!(p.slices[0].cpus, list("2-7"));
    assert_eq!(p.slices[1].cpus, list("8-13"));
    assert_eq!(p.slices[2].cpus, list("18-23"));
}

#[test]
fn mixed_vendors_follow_bus_order_and_warn() {
    let topo = named("mixed-vendors");
    let p = plan(&topo, &Policy::default()).unwrap();
    assert_sound(&topo, &p);
    let vendors: Vec<Vendor> = p
        .slices
        .iter()
        .map(|s| s.gpu.as_ref().unwrap().vendor)
        .collect();
    assert_eq!(
        vendors,
        [Vendor::Nvidia, Vendor::Amd, Vendor::Nvidia, Vendor::Amd]
    );
    assert_warns(&p.warnings, &["mixes NVIDIA and AMD"]);
    // Two slices per node: 15 / 2 = 7 cores.
    assert!(p.slices.iter().all(|s| s.cpus.len() == 14));
}

#[test]
fn gpus_with_numa_minus_one_spread_over_packages() {
    let f = FakeSys::machine(2, 8, 2, SmtNumbering::Offset, 1, 64 * GIB)
        .with_gpu(Vendor::Nvidia, "0000:01:00.0", -1)
        .with_gpu(Vendor::Nvidia, "0000:02:00.0", -1)
        .with_gpu(Vendor::Nvidia, "0000:81:00.0", -1)
        .with_gpu(Vendor::Nvidia, "0000:82:00.0", -1);
    let topo = discover(&f);
    let p = plan(&topo, &Policy::default()).unwrap();
    assert_sound(&topo, &p);
    let mems: Vec<Vec<u32>> = p.slices.iter().map(|s| s.mems.clone()).collect();
    assert_eq!(mems, [vec![0], vec![1], vec![0], vec![1]]);
    assert_eq!(
        p.warnings
            .iter()
            .filter(|w| w.contains("placed on NUMA node"))
            .count(),
        4
    );
    for s in &p.slices {
        let node = &topo.numa_nodes[s.mems[0] as usize];
        assert!(s.cpus.iter().all(|c| node.cpus.contains(c)));
    }
}

#[test]
fn offline_cpus_are_skipped_and_their_siblings_stay_whole() {
    // CPU 122 is CPU 10's sibling; 30 and 31 are whole cores.
    let f = fakesys::dgx_h100().with_offline(&[122, 30, 31, 142, 143]);
    let topo = discover(&f);
    assert_eq!(topo.offline_cpus(), vec![30, 31, 122, 142, 143]);
    let p = plan(&topo, &Policy::default()).unwrap();
    assert_sound(&topo, &p);
    assert_warns(&p.warnings, &["30-31,122,142-143", "offline"]);
    // Node 0 now has 54 free cores: 13 each still.
    assert_eq!(p.slices[0].cpus.len(), 25, "core 10 has one online thread");
    assert!(p
        .slices
        .iter()
        .all(|s| !s.cpus.contains(&30) && !s.cpus.contains(&122)));
}

#[test]
fn restricted_cpuset_is_respected() {
    // The agent runs in a cpuset of socket 0 only.
    let f = fakesys::dgx_h100().with_allowed(&list("0-55,112-167"));
    let topo = discover(&f);
    let p = plan(&topo, &Policy::default()).unwrap();
    assert_sound(&topo, &p);
    assert_warns(&p.warnings, &["outside this process's cpuset"]);
    // Socket 1's GPUs have no usable local CPU; they are placed on node 0 and say so.
    assert_warns(&p.warnings, &["0000:9a:00.0", "no usable CPUs"]);
    assert!(p
        .slices
        .iter()
        .all(|s| s.cpus.iter().all(|c| *c < 56 || (112..168).contains(c))));
    // 55 free cores / 8 slices = 6 each.
    assert!(p.slices.iter().all(|s| s.cpus.len() == 12));
}

#[test]
fn memory_nodes_outside_the_cpuset_are_warned_about() {
    let topo = discover(&fakesys::dgx_h100().with_allowed_mems(&[0]));
    assert_eq!(topo.allowed_mems, vec![0]);
    let p = plan(&topo, &Policy::default()).unwrap();
    let named: Vec<&String> = p
        .warnings
        .iter()
        .filter(|w| w.contains("Mems_allowed"))
        .collect();
    assert_eq!(named.len(), 4, "{named:?}");
    assert!(named[0].starts_with("slice 4:"));
}

#[test]
fn a_cpuset_of_first_threads_only_still_plans_and_warns() {
    let f = fakesys::dgx_h100().with_allowed(&list("0-111"));
    let topo = discover(&f);
    let p = plan(&topo, &Policy::default()).unwrap();
    assert_sound(&topo, &p);
    assert_eq!(p.slices[0].cpus, list("1-13"));
    assert_warns(&p.warnings, &["only some SMT threads"]);
}

#[test]
fn more_gpus_than_cores_is_an_error_unless_sharing() {
    let mut f = FakeSys::machine(1, 3, 1, SmtNumbering::Offset, 1, 16 * GIB);
    for i in 0..4 {
        f = f.with_gpu(Vendor::Nvidia, &format!("0000:0{}:00.0", i + 1), 0);
    }
    let topo = discover(&f);
    let err = plan(&topo, &Policy::default()).unwrap_err();
    assert_eq!(
        err,
        PlanError::TooFewCores {
            slices: 4,
            cores: 2
        }
    );
    assert!(err.to_string().contains("--allow-sharing"));
    let p = plan(
        &topo,
        &Policy {
            allow_sharing: true,
            ..Policy::default()
        },
    )
    .unwrap();
    assert_eq!(p.slices.len(), 4);
    let cpus: Vec<Vec<u32>> = p.slices.iter().map(|s| s.cpus.clone()).collect();
    assert_eq!(cpus, [vec![1], vec![2], vec![1], vec![2]]);
    assert_warns(&p.warnings, &["NOT isolated"]);
}

#[test]
fn two_gpus_per_slice_group_within_a_node() {
    let topo = named("dgx-h100");
    let p = plan(
        &topo,
        &Policy {
            gpus_per_slice: 2,
            ..Policy::default()
        },
    )
    .unwrap();
    assert_sound(&topo, &p);
    assert_eq!(p.slices.len(), 4);
    assert_eq!(p.slices[1].gpu.as_ref().unwrap().pci_bus_id, "0000:3a:00.0");
    assert_eq!(p.slices[1].extra_gpus[0].pci_bus_id, "0000:5d:00.0");
    assert_eq!(p.slices[0].cpus.len(), 2 * 27);
    // Multi-GPU slices carry `extra_gpus` in JSON; one-GPU slices never do.
    assert!(serde_json::to_string(&p).unwrap().contains("extra_gpus"));
    let one = plan(&topo, &Policy::default()).unwrap();
    assert!(!serde_json::to_string(&one).unwrap().contains("extra_gpus"));
    // Three GPUs per slice leave two GPUs out, named.
    let p3 = plan(
        &topo,
        &Policy {
            gpus_per_slice: 3,
            ..Policy::default()
        },
    )
    .unwrap();
    assert_sound(&topo, &p3);
    assert_eq!(p3.slices.len(), 2);
    assert_eq!(
        p3.warnings
            .iter()
            .filter(|w| w.contains("is in no slice"))
            .count(),
        2
    );
}

#[test]
fn fixed_cores_take_remote_cores_and_name_the_slices() {
    // 3 GPUs on node 0, none on node 1: 7 free local cores.
    let f = FakeSys::machine(2, 8, 1, SmtNumbering::Offset, 1, 32 * GIB)
        .with_gpu(Vendor::Nvidia, "0000:01:00.0", 0)
        .with_gpu(Vendor::Nvidia, "0000:02:00.0", 0)
        .with_gpu(Vendor::Nvidia, "0000:03:00.0", 0);
    let topo = discover(&f);
    let default = plan(&topo, &Policy::default()).unwrap();
    assert!(default
        .slices
        .iter()
        .all(|s| s.cpus.len() == 2 && s.cpus.iter().all(|c| *c < 8)));
    let p = plan(
        &topo,
        &Policy {
            cores_per_slice: Some(4),
            ..Policy::default()
        },
    )
    .unwrap();
    assert_sound(&topo, &p);
    assert_eq!(p.slices[0].cpus, list("1-4"));
    assert_eq!(p.slices[1].cpus, list("5-7,9"));
    assert_eq!(p.slices[2].cpus, list("10-13"));
    assert!(p
        .warnings
        .iter()
        .any(|w| w.starts_with("slice 1: 1 of its 4")));
    assert!(p
        .warnings
        .iter()
        .any(|w| w.starts_with("slice 2: 4 of its 4")));
    let err = plan(
        &topo,
        &Policy {
            cores_per_slice: Some(5),
            ..Policy::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            PlanError::FixedCoresDoNotFit {
                needed: 15,
                available: 14,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn fixed_memory_is_checked_against_the_node() {
    let topo = named("dgx-h100");
    let p = plan(
        &topo,
        &Policy {
            memory_per_slice: Some(200 * GIB),
            host_memory_reserve_percent: 20,
            ..Policy::default()
        },
    )
    .unwrap();
    assert!(p.slices.iter().all(|s| s.memory_bytes == 200 * GIB));
    let err = plan(
        &topo,
        &Policy {
            memory_per_slice: Some(240 * GIB),
            ..Policy::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            PlanError::MemoryDoesNotFit {
                node: 0,
                slices: 4,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn housekeeping_and_reserve_are_configurable() {
    let topo = named("dgx-h100");
    let p = plan(
        &topo,
        &Policy {
            housekeeping_cores_per_node: 0,
            host_memory_reserve_percent: 0,
            ..Policy::default()
        },
    )
    .unwrap();
    assert!(p.reserved_cpus.is_empty());
    assert_eq!(p.slices[0].cpus, list("0-13,112-125"));
    assert_eq!(p.slices[0].memory_bytes, 256 * GIB);
    let p = plan(
        &topo,
        &Policy {
            housekeeping_cores_per_node: 4,
            ..Policy::default()
        },
    )
    .unwrap();
    assert_eq!(p.reserved_cpus, list("0-3,56-59,112-115,168-171"));
    assert!(p.slices.iter().all(|s| s.cpus.len() == 26));
}

#[test]
fn plans_are_deterministic() {
    for (name, _) in fakesys::FIXTURES {
        let f = fakesys::fixture(name).unwrap();
        let a = named(name);
        let b = discover(&f);
        assert_eq!(a, b, "{name}");
        let policy = Policy {
            cpu_only_slices: Some(3),
            ..Policy::default()
        };
        let pa = plan_explained(&a, &policy).unwrap();
        let pb = plan_explained(&b, &policy).unwrap();
        assert_eq!(pa, pb, "{name}");
        assert_sound(&a, &pa.plan);
        let gpus: BTreeSet<&str> = pa
            .plan
            .slices
            .iter()
            .filter_map(|s| s.gpu.as_ref())
            .map(|g| g.pci_bus_id.as_str())
            .collect();
        assert_eq!(gpus.len(), a.gpus.len(), "{name}: every GPU in a slice");
    }
}

#[test]
fn broken_trees_give_errors_that_name_the_file() {
    let dir = scratch();
    let err = Topology::discover(dir.path()).unwrap_err().to_string();
    assert!(err.contains("sys/devices/system/cpu/online"), "{err}");
    fakesys::workstation_1gpu().write_to(dir.path()).unwrap();
    std::fs::write(
        dir.path()
            .join("sys/devices/system/cpu/cpu3/topology/core_id"),
        "three\n",
    )
    .unwrap();
    let err = Topology::discover(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("cpu3/topology/core_id") && err.contains("three"),
        "{err}"
    );
    std::fs::write(
        dir.path()
            .join("sys/devices/system/cpu/cpu3/topology/core_id"),
        "3\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("sys/bus/pci/devices/0000:01:00.0/class"),
        "VGA\n",
    )
    .unwrap();
    let err = Topology::discover(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("0000:01:00.0/class") && err.contains("hex"),
        "{err}"
    );
    std::fs::write(
        dir.path().join("sys/bus/pci/devices/0000:01:00.0/class"),
        "0x030000\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("proc/meminfo"), "nothing\n").unwrap();
    let err = Topology::discover(dir.path()).unwrap_err().to_string();
    assert!(err.contains("MemTotal"), "{err}");
}

#[test]
fn a_kernel_without_numa_is_one_node() {
    let dir = scratch();
    fakesys::workstation_1gpu().write_to(dir.path()).unwrap();
    std::fs::remove_dir_all(dir.path().join("sys/devices/system/node")).unwrap();
    let topo = Topology::discover(dir.path()).unwrap();
    assert_eq!(topo.numa_nodes.len(), 1);
    assert_eq!(topo.numa_nodes[0].memory_bytes, 128 * GIB);
    assert!(topo.cpus.iter().all(|c| c.numa_node == Some(0)));
    assert_eq!(
        plan(&topo, &Policy::default()).unwrap().slices[0]
            .cpus
            .len(),
        30
    );
}

#[test]
fn the_live_machine_is_discovered() {
    // Every Linux machine this runs on has these files; GPUs are optional.
    let topo = Topology::discover(std::path::Path::new("/")).unwrap();
    assert!(!topo.online_cpus().is_empty());
    assert!(topo.total_memory_bytes > 0);
    assert!(!topo.allowed_cpus.is_empty());
    assert!(topo
        .allowed_cpus
        .iter()
        .all(|c| topo.online_cpus().contains(c)));
}
