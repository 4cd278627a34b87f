//! The slice planner: a pure function from a [`Topology`] and a [`Policy`] to a [`Plan`].
//!
//! Rules, in the order they are applied:
//! 1. Only online CPUs the process may use (its cpuset) are planned; the unit handed out is a
//!    whole physical core (its allowed SMT threads), so siblings are never split between slices.
//! 2. Housekeeping: the lowest-numbered `housekeeping_cores_per_node` cores of every NUMA node
//!    are kept for the OS and the agent (`reserved_cpus`).
//! 3. Each slice gets `gpus_per_slice` GPUs, grouped within a NUMA node, and is numbered in PCI
//!    bus order of its first GPU (so with one GPU per slice, slice N is nvidia-smi's GPU N).
//!    A GPU without a NUMA node (firmware reports -1) is placed on the package, then node, with
//!    the fewest GPUs, so such GPUs spread over the sockets instead of piling onto node 0.
//! 4. Every slice gets the same number of cores: the most that every node can give each of its
//!    slices from its own cores. Only when some node cannot give even one core per slice (or a
//!    fixed `cores_per_slice` asks for more) are remote cores used, nearest package first, and
//!    each such slice is named in a warning. Cores left over are reported, not given away.
//! 5. Memory: `mems` is the GPU's node; the limit is that node's memory minus the host reserve,
//!    split equally between the node's slices (or a fixed amount, checked to fit).
//!
//! Same input, same output: every choice breaks ties by the lowest id.
//!
//! A node with an AMD GPU in a compute-partitioning mode (MI300X DPX, QPX, CPX) is refused,
//! with the command that makes it whole: its slices would each get one partition.

use std::collections::{BTreeMap, BTreeSet};

use crate::cpulist::format_cpu_list;
use crate::plan::{MigInstance, Plan, Slice, SliceGpu};
use crate::topology::{Gpu, Topology};

/// What the operator can decide about slicing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// GPUs in each slice (default 1).
    pub gpus_per_slice: u32,
    /// Cores of each NUMA node kept for the OS and the agent (default 1).
    pub housekeeping_cores_per_node: u32,
    /// Percent of each node's memory kept for the host (default 10).
    pub host_memory_reserve_percent: u32,
    /// Fixed number of whole cores per slice instead of "as many as fit locally".
    pub cores_per_slice: Option<u32>,
    /// Fixed memory limit per slice in bytes instead of "the node's share".
    pub memory_per_slice: Option<u64>,
    /// Let slices share cores when there are more slices than cores, instead of failing.
    pub allow_sharing: bool,
    /// Number of CPU-only slices to plan on a node without GPUs.
    pub cpu_only_slices: Option<u32>,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            gpus_per_slice: 1,
            housekeeping_cores_per_node: 1,
            host_memory_reserve_percent: 10,
            cores_per_slice: None,
            memory_per_slice: None,
            allow_sharing: false,
            cpu_only_slices: None,
        }
    }
}

/// Why no plan could be made; each message says what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The policy contradicts itself; says how.
    #[error("invalid policy: {0}")]
    InvalidPolicy(String),
    /// No GPU, and no CPU-only slices asked for.
    #[error("no GPU found (NVIDIA 0x10de or AMD 0x1002 display/3D/accelerator PCI device); pass --cpu-only-slices N to plan CPU-only slices")]
    NoGpus,
    /// Every CPU is reserved or offline; says which.
    #[error("no usable CPU: {0}")]
    NoUsableCpus(String),
    /// Fewer free cores than slices.
    #[error("{slices} slices but only {cores} free physical cores after housekeeping: pass --allow-sharing to let slices share cores, lower --housekeeping-cores, or raise --gpus-per-slice")]
    TooFewCores {
        /// Slices wanted.
        slices: usize,
        /// Free physical cores.
        cores: usize,
    },
    /// A fixed core count per slice does not fit.
    #[error("--cores-per-slice {requested} needs {needed} cores for {slices} slices but only {available} are free after housekeeping: lower it or --housekeeping-cores")]
    FixedCoresDoNotFit {
        /// Cores per slice asked for.
        requested: u32,
        /// Slices wanted.
        slices: usize,
        /// Cores needed in all.
        needed: usize,
        /// Cores free after housekeeping.
        available: usize,
    },
    /// Every GPU is in MIG mode without a MIG device: nothing CUDA can use.
    #[error("GPU(s) {} in MIG mode with no MIG device, and no other GPU to plan: CUDA cannot use a GPU in MIG mode whole; create MIG devices (`sudo nvidia-smi mig -i <bus id> -lgip` lists the profiles, `sudo nvidia-smi mig -i <bus id> -cgi <profiles> -C` makes them) or turn MIG off (`sudo nvidia-smi -i <bus id> -mig 0`, then reset the GPU or reboot), then plan again", .0.join(", "))]
    MigWithoutDevices(Vec<String>),
    /// A fixed memory per slice does not fit a NUMA node.
    #[error("--memory-per-slice {requested} bytes × {slices} slices on NUMA node {node} exceeds its {budget} bytes after the host reserve: lower it or --host-memory-reserve")]
    MemoryDoesNotFit {
        /// The NUMA node.
        node: u32,
        /// Bytes per slice asked for.
        requested: u64,
        /// Slices on that node.
        slices: usize,
        /// The node's bytes after the host reserve.
        budget: u64,
    },
    /// An AMD GPU is cut into compute partitions (MI300X DPX, QPX, CPX), which ROCm shows as
    /// GPUs of their own; the planner plans whole GPUs only.
    #[error("{}", partitioned_message(.bus_id, .model, .compute, .memory.as_deref(), *.partitions, *.first_render, *.last_render, *.more))]
    PartitionedGpu {
        /// The first partitioned GPU, by bus id.
        bus_id: String,
        /// Its product (`MI300X`).
        model: String,
        /// Its compute mode (`CPX`).
        compute: String,
        /// Its memory mode (`NPS4`), when known.
        memory: Option<String>,
        /// How many partitions KFD lists for it.
        partitions: usize,
        /// Its partitions' lowest render minor.
        first_render: u32,
        /// Its partitions' highest render minor.
        last_render: u32,
        /// How many other GPUs are partitioned.
        more: usize,
    },
}

/// The text of [`PlanError::PartitionedGpu`]: what a slice would get today, and the commands
/// that make the GPUs whole again (amd-smi's `set --compute-partition` and
/// `--memory-partition`, ROCm/amdsmi's CLI).
#[allow(clippy::too_many_arguments)] // the error's fields, one each
fn partitioned_message(
    bus_id: &str,
    model: &str,
    compute: &str,
    memory: Option<&str>,
    partitions: usize,
    first_render: u32,
    last_render: u32,
    more: usize,
) -> String {
    let mut about: Vec<String> = memory.map(|m| format!("{m} memory")).into_iter().collect();
    if more > 0 {
        about.push(format!("{more} more GPU(s) likewise"));
    }
    let about = if about.is_empty() {
        String::new()
    } else {
        format!(" ({})", about.join("; "))
    };
    // NPS2/NPS4 allow only some compute modes, so memory goes back to NPS1 first.
    let memory_first = match memory {
        Some(m) if m != "NPS1" => {
            format!("`sudo amd-smi set --gpu all --memory-partition NPS1` (it is {m}), then ")
        }
        _ => String::new(),
    };
    format!(
        "GPU {bus_id} (AMD Instinct {model}) is in {compute} compute partitioning{about}: ROCm shows it as {partitions} GPUs (renderD{first_render}-renderD{last_render}), and kernelkite plans whole AMD GPUs only, so a slice would run on one partition, 1/{partitions} of the GPU, under the {model} name. Make the GPUs whole with {memory_first}`sudo amd-smi set --gpu all --compute-partition SPX`, then plan again"
    )
}

/// Refuses a node with a partitioned AMD GPU ([`PlanError::PartitionedGpu`]), naming the first.
fn refuse_partitioned(topology: &Topology) -> Result<(), PlanError> {
    let mut parted = topology
        .gpus
        .iter()
        .filter_map(|g| Some((g, g.partitioning.as_ref()?)));
    let Some((gpu, p)) = parted.next() else {
        return Ok(());
    };
    let minors = p.partitions.iter().map(|q| q.render_minor);
    Err(PlanError::PartitionedGpu {
        bus_id: gpu.pci_bus_id.clone(),
        model: p.model.clone(),
        compute: p.compute.clone(),
        memory: p.memory.clone(),
        partitions: p.partitions.len(),
        first_render: minors.clone().min().unwrap_or(0),
        last_render: minors.max().unwrap_or(0),
        more: parted.count(),
    })
}

/// A plan and the reasons behind it, for the human output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Explained {
    /// The plan.
    pub plan: Plan,
    /// One line per decision, in the order they were made.
    pub notes: Vec<String>,
}

/// Plans the node's slices.
pub fn plan(topology: &Topology, policy: &Policy) -> Result<Plan, PlanError> {
    plan_explained(topology, policy).map(|e| e.plan)
}

/// The node's GPUs in groups of `size` for a multi-GPU queue beside `plan`'s one-GPU slices:
/// grouped as [`plan`] groups `size` GPUs per slice (a NUMA node first, GPUs sharing a fast
/// link together), each group named by the indices of its GPUs' slices in `plan`. MIG devices
/// are never grouped (CUDA shows a process one); GPUs that do not fill a group are left out.
pub fn multi_gpu_groups(
    topology: &Topology,
    policy: &Policy,
    plan: &Plan,
    size: u32,
) -> Result<Vec<Vec<u32>>, PlanError> {
    if size < 2 {
        return Err(PlanError::InvalidPolicy(
            "a multi-GPU queue's jobs take 2 GPUs or more (--multi-gpu-size)".into(),
        ));
    }
    if plan.slices.iter().any(|s| !s.extra_gpus.is_empty()) {
        return Err(PlanError::InvalidPolicy(
            "a multi-GPU queue groups one-GPU slices: plan the node with --gpus-per-slice 1".into(),
        ));
    }
    let gpus = plan
        .slices
        .iter()
        .filter(|s| s.gpu.as_ref().is_some_and(|g| g.mig.is_none()))
        .count();
    let no_group = || {
        PlanError::InvalidPolicy(format!(
            "no group of {size} GPUs: the node has {gpus} whole GPU(s); lower --multi-gpu-size"
        ))
    };
    if size as usize > gpus {
        return Err(no_group());
    }
    // Group the whole GPUs only: a MIG GPU's devices stay one-GPU slices.
    let whole = Topology {
        gpus: topology
            .gpus
            .iter()
            .filter(|g| g.mig.is_empty() && !g.mig_enabled)
            .cloned()
            .collect(),
        ..topology.clone()
    };
    let grouped = plan_explained(
        &whole,
        &Policy {
            gpus_per_slice: size,
            ..policy.clone()
        },
    )?;
    let slice_of = |bus: &str| {
        plan.slices
            .iter()
            .find(|s| {
                s.gpu
                    .as_ref()
                    .is_some_and(|g| g.pci_bus_id == bus && g.mig.is_none())
            })
            .map(|s| s.index)
    };
    let groups: Vec<Vec<u32>> = grouped
        .plan
        .slices
        .iter()
        .filter_map(|s| {
            let mut idx: Vec<u32> = s
                .gpus()
                .iter()
                .map(|g| slice_of(&g.pci_bus_id))
                .collect::<Option<_>>()?;
            idx.sort_unstable();
            Some(idx)
        })
        .collect();
    if groups.is_empty() {
        return Err(no_group());
    }
    Ok(groups)
}

/// A core as the planner sees it: allowed threads only.
#[derive(Debug, Clone)]
struct Core {
    key: u32,
    package: Option<u32>,
    node: u32,
    cpus: Vec<u32>,
}

struct Unit<'a> {
    gpus: Vec<&'a Gpu>,
    /// The MIG device the slice owns when its GPU is in MIG mode (one per slice).
    mig: Option<&'a MigInstance>,
    /// NUMA node the slice's CPUs and memory limit come from: its first GPU's.
    home: u32,
    /// Memory nodes: the homes of all its GPUs.
    mems: Vec<u32>,
}

/// Plans the node's slices and explains each choice.
pub fn plan_explained(topology: &Topology, policy: &Policy) -> Result<Explained, PlanError> {
    validate(policy)?;
    refuse_partitioned(topology)?;
    let mut notes = Vec::new();
    let mut warnings = Vec::new();

    let allowed: BTreeSet<u32> = topology.allowed_cpus.iter().copied().collect();
    warn_unplanned_cpus(topology, &allowed, &mut warnings);
    let cores = usable_cores(topology, &allowed)?;
    warn_partial_smt(topology, &cores, &mut warnings);

    // Free cores per node, lowest key first, after housekeeping.
    let mut free = cores_by_node(&cores);
    let package_of: BTreeMap<u32, Option<u32>> =
        free.iter().map(|(n, cs)| (*n, cs[0].package)).collect();
    let reserved = reserve_housekeeping(policy, &mut free, &mut notes);

    let units = make_units(
        topology,
        policy,
        &free,
        &package_of,
        &mut notes,
        &mut warnings,
    )?;
    let nslices = units.len();
    if nslices == 0 {
        return Err(PlanError::InvalidPolicy(format!(
            "--gpus-per-slice {} leaves no slice: no vendor has that many GPUs on this node ({} GPU(s) found)",
            policy.gpus_per_slice,
            topology.gpus.len()
        )));
    }

    let demand = slices_per_node(&units);
    let first_node = topology.numa_nodes.first().map_or(0, |n| n.id);
    let size = slice_size(
        policy,
        &free,
        &demand,
        nslices,
        first_node,
        &mut notes,
        &mut warnings,
    )?;

    let slice_cores = assign_cores(&units, &cores, size, &package_of, &mut free, &mut warnings);

    let budgets = memory_budgets(topology, policy, &free_nodes(&cores), &mut warnings);
    let memory = memory_per_slice(policy, &units, &budgets, &demand)?;
    note_memory(policy, &budgets, &demand, &mut notes);

    let mut slices = Vec::with_capacity(nslices);
    for (i, ((u, cores), bytes)) in units.iter().zip(slice_cores).zip(memory).enumerate() {
        let slice = make_slice(topology, i, u, &cores, bytes, &mut notes, &mut warnings);
        slices.push(slice);
    }

    Ok(Explained {
        plan: Plan {
            slices,
            reserved_cpus: reserved,
            warnings,
        },
        notes,
    })
}

/// The cores of each NUMA node, in the order given.
fn cores_by_node(cores: &[Core]) -> BTreeMap<u32, Vec<Core>> {
    let mut by_node: BTreeMap<u32, Vec<Core>> = BTreeMap::new();
    for core in cores {
        by_node.entry(core.node).or_default().push(core.clone());
    }
    by_node
}

/// How many slices each NUMA node is home to.
fn slices_per_node(units: &[Unit]) -> BTreeMap<u32, usize> {
    let mut demand: BTreeMap<u32, usize> = BTreeMap::new();
    for u in units {
        *demand.entry(u.home).or_default() += 1;
    }
    demand
}

/// Warns about online CPUs the plan leaves out: offline ones and those outside this process's
/// cpuset.
fn warn_unplanned_cpus(topology: &Topology, allowed: &BTreeSet<u32>, warnings: &mut Vec<String>) {
    let offline = topology.offline_cpus();
    if !offline.is_empty() {
        warnings.push(format!(
            "CPUs {} are offline and were not planned; re-run `plan` after bringing them online",
            format_cpu_list(&offline)
        ));
    }
    let outside: Vec<u32> = topology
        .online_cpus()
        .iter()
        .copied()
        .filter(|c| !allowed.contains(c))
        .collect();
    if !outside.is_empty() {
        warnings.push(format!(
            "CPUs {} are outside this process's cpuset and were not planned; run `plan` from the agent's cgroup or widen its cpuset",
            format_cpu_list(&outside)
        ));
    }
}

/// The physical cores with at least one allowed thread, each holding only its allowed threads;
/// an error when there are none.
fn usable_cores(topology: &Topology, allowed: &BTreeSet<u32>) -> Result<Vec<Core>, PlanError> {
    let first_node = topology.numa_nodes.first().map_or(0, |n| n.id);
    let cores: Vec<Core> = topology
        .physical_cores()
        .into_iter()
        .filter_map(|c| {
            let cpus: Vec<u32> = c.cpus.into_iter().filter(|x| allowed.contains(x)).collect();
            (!cpus.is_empty()).then_some(Core {
                key: c.key,
                package: c.package,
                node: c.numa_node.unwrap_or(first_node),
                cpus,
            })
        })
        .collect();
    if cores.is_empty() {
        return Err(PlanError::NoUsableCpus(format!(
            "online {} ∩ allowed {} is empty; run `plan` inside the agent's cgroup",
            format_cpu_list(&topology.online_cpus()),
            format_cpu_list(&topology.allowed_cpus)
        )));
    }
    Ok(cores)
}

/// Warns about cores of which the cpuset holds only some SMT threads.
fn warn_partial_smt(topology: &Topology, cores: &[Core], warnings: &mut Vec<String>) {
    let smt_partial = cores.iter().filter(|c| {
        topology
            .cpus
            .iter()
            .filter(|x| x.online && x.core == c.key)
            .count()
            > c.cpus.len()
    });
    let partial: Vec<u32> = smt_partial.flat_map(|c| c.cpus.iter().copied()).collect();
    if !partial.is_empty() {
        warnings.push(format!(
            "the cpuset holds only some SMT threads of the cores of CPUs {}; their other threads may be used by processes outside the plan",
            format_cpu_list(&partial)
        ));
    }
}

/// Takes each node's housekeeping cores (its lowest) out of `free`; returns their CPUs, sorted.
fn reserve_housekeeping(
    policy: &Policy,
    free: &mut BTreeMap<u32, Vec<Core>>,
    notes: &mut Vec<String>,
) -> Vec<u32> {
    let mut reserved: Vec<u32> = Vec::new();
    for (node, list) in free.iter_mut() {
        let n = (policy.housekeeping_cores_per_node as usize).min(list.len());
        let kept: Vec<Core> = list.drain(..n).collect();
        if !kept.is_empty() {
            let cpus: Vec<u32> = kept.iter().flat_map(|c| c.cpus.iter().copied()).collect();
            notes.push(format!(
                "housekeeping: NUMA node {node} keeps {} core(s) (CPUs {}) for the OS and the agent",
                kept.len(),
                format_cpu_list(&cpus)
            ));
            reserved.extend(cpus);
        }
    }
    reserved.sort_unstable();
    reserved
}

/// Slice size in cores: fixed by the policy, else the most the tightest node can give each of
/// its slices, else an even split of all free cores; 0 means the slices share cores.
fn slice_size(
    policy: &Policy,
    free: &BTreeMap<u32, Vec<Core>>,
    demand: &BTreeMap<u32, usize>,
    nslices: usize,
    first_node: u32,
    notes: &mut Vec<String>,
    warnings: &mut Vec<String>,
) -> Result<usize, PlanError> {
    let avail: BTreeMap<u32, usize> = free.iter().map(|(n, l)| (*n, l.len())).collect();
    let total_avail: usize = avail.values().sum();
    if let Some(c) = policy.cores_per_slice {
        let needed = c as usize * nslices;
        if needed > total_avail {
            return Err(PlanError::FixedCoresDoNotFit {
                requested: c,
                slices: nslices,
                needed,
                available: total_avail,
            });
        }
        notes.push(format!(
            "slice size: {c} core(s), fixed by --cores-per-slice"
        ));
        return Ok(c as usize);
    }
    let (local, node) = demand
        .iter()
        .map(|(n, d)| (avail.get(n).copied().unwrap_or(0) / d, *n))
        .min()
        .unwrap_or((0, first_node));
    if local >= 1 {
        notes.push(format!(
            "slice size: {local} core(s), the most NUMA node {node} can give each of its {} slice(s) from its {} free core(s)",
            demand.get(&node).copied().unwrap_or(0),
            avail.get(&node).copied().unwrap_or(0)
        ));
        Ok(local)
    } else if total_avail / nslices >= 1 {
        let s = total_avail / nslices;
        warnings.push(format!(
            "NUMA node {node} has fewer free cores than slices; every slice gets {s} core(s) and some take remote cores"
        ));
        notes.push(format!(
            "slice size: {s} core(s) = {total_avail} free cores / {nslices} slices (not enough local cores on node {node})"
        ));
        Ok(s)
    } else if policy.allow_sharing {
        Ok(0)
    } else {
        Err(PlanError::TooFewCores {
            slices: nslices,
            cores: total_avail,
        })
    }
}

/// The cores of each slice: `size` each, local first then remote, or shared when `size` is 0.
fn assign_cores(
    units: &[Unit],
    cores: &[Core],
    size: usize,
    package_of: &BTreeMap<u32, Option<u32>>,
    free: &mut BTreeMap<u32, Vec<Core>>,
    warnings: &mut Vec<String>,
) -> Vec<Vec<Core>> {
    let nslices = units.len();
    let mut slice_cores: Vec<Vec<Core>> = vec![Vec::new(); nslices];
    if size == 0 {
        share_cores(units, cores, free, &mut slice_cores);
        warnings.push(format!(
            "{nslices} slices share {} core(s): slices are NOT isolated from each other (--allow-sharing)",
            cores.len()
        ));
    } else {
        take_local_cores(units, size, free, &mut slice_cores);
        take_remote_cores(units, size, package_of, free, &mut slice_cores, warnings);
        warn_unused_cores(free, warnings);
    }
    slice_cores
}

/// Gives each slice up to `size` cores of its home node, in slice order within each node.
fn take_local_cores(
    units: &[Unit],
    size: usize,
    free: &mut BTreeMap<u32, Vec<Core>>,
    slice_cores: &mut [Vec<Core>],
) {
    for (i, u) in units.iter().enumerate() {
        if let Some(list) = free.get_mut(&u.home) {
            let take = size.min(list.len());
            slice_cores[i].extend(list.drain(..take));
        }
    }
}

/// Fills the slices that are short of `size` with remote cores, nearest package first, and
/// warns for each.
fn take_remote_cores(
    units: &[Unit],
    size: usize,
    package_of: &BTreeMap<u32, Option<u32>>,
    free: &mut BTreeMap<u32, Vec<Core>>,
    slice_cores: &mut [Vec<Core>],
    warnings: &mut Vec<String>,
) {
    for (i, u) in units.iter().enumerate() {
        let short = size - slice_cores[i].len();
        if short == 0 {
            continue;
        }
        let home_pkg = package_of.get(&u.home).copied().flatten();
        let mut order: Vec<u32> = free.keys().copied().filter(|n| *n != u.home).collect();
        order.sort_by_key(|n| (package_of.get(n).copied().flatten() != home_pkg, *n));
        let mut taken = 0;
        let mut from = BTreeSet::new();
        for n in order {
            if taken == short {
                break;
            }
            if let Some(list) = free.get_mut(&n) {
                let take = (short - taken).min(list.len());
                if take > 0 {
                    from.insert(n);
                }
                slice_cores[i].extend(list.drain(..take));
                taken += take;
            }
        }
        warnings.push(format!(
            "slice {i}: {short} of its {size} cores are on NUMA node(s) {} because node {} has too few free cores; they are remote to its GPU",
            join(&from),
            u.home
        ));
    }
}

/// Warns about the free cores no slice took.
fn warn_unused_cores(free: &BTreeMap<u32, Vec<Core>>, warnings: &mut Vec<String>) {
    let left: Vec<u32> = free
        .values()
        .flatten()
        .flat_map(|c| c.cpus.iter().copied())
        .collect();
    if !left.is_empty() {
        let ncores = free.values().map(Vec::len).sum::<usize>();
        warnings.push(format!(
            "{ncores} core(s) (CPUs {}) are in no slice, to keep slices equal; the host keeps them (use --cores-per-slice or --housekeeping-cores to change this)",
            format_cpu_list(&left)
        ));
    }
}

/// Memory per slice: the policy's fixed size where it fits its node's budget, else an equal
/// share of the home node's budget.
fn memory_per_slice(
    policy: &Policy,
    units: &[Unit],
    budgets: &BTreeMap<u32, u64>,
    demand: &BTreeMap<u32, usize>,
) -> Result<Vec<u64>, PlanError> {
    let mut memory: Vec<u64> = Vec::with_capacity(units.len());
    for u in units {
        let budget = budgets.get(&u.home).copied().unwrap_or(0);
        let share = demand.get(&u.home).copied().unwrap_or(1).max(1);
        let bytes = match policy.memory_per_slice {
            Some(m) => {
                if m.saturating_mul(share as u64) > budget {
                    return Err(PlanError::MemoryDoesNotFit {
                        node: u.home,
                        requested: m,
                        slices: share,
                        budget,
                    });
                }
                m
            }
            None => budget / share as u64,
        };
        memory.push(bytes);
    }
    Ok(memory)
}

/// Explains each node's memory budget and how its slices share it.
fn note_memory(
    policy: &Policy,
    budgets: &BTreeMap<u32, u64>,
    demand: &BTreeMap<u32, usize>,
    notes: &mut Vec<String>,
) {
    for (node, share) in demand {
        let budget = budgets.get(node).copied().unwrap_or(0);
        notes.push(match policy.memory_per_slice {
            Some(m) => format!(
                "memory: NUMA node {node}: {} per slice fixed by --memory-per-slice, {share} slice(s) within its {} after the {}% host reserve",
                format_bytes(m),
                format_bytes(budget),
                policy.host_memory_reserve_percent
            ),
            None => format!(
                "memory: NUMA node {node}: {} after the {}% host reserve, split between its {share} slice(s) = {} each",
                format_bytes(budget),
                policy.host_memory_reserve_percent,
                format_bytes(budget / *share as u64)
            ),
        });
    }
}

/// Slice `i` from its unit, cores and memory, with a note saying what it holds.
fn make_slice(
    topology: &Topology,
    i: usize,
    u: &Unit,
    cores: &[Core],
    memory_bytes: u64,
    notes: &mut Vec<String>,
    warnings: &mut Vec<String>,
) -> Slice {
    let mut cpus: Vec<u32> = cores.iter().flat_map(|c| c.cpus.iter().copied()).collect();
    cpus.sort_unstable();
    cpus.dedup();
    let mems = u.mems.clone();
    let outside: Vec<u32> = mems
        .iter()
        .copied()
        .filter(|m| !topology.allowed_mems.is_empty() && !topology.allowed_mems.contains(m))
        .collect();
    if !outside.is_empty() {
        warnings.push(format!(
            "slice {i}: memory node(s) {} are outside this process's Mems_allowed; run `plan` from the agent's cgroup or widen its cpuset.mems",
            join(&outside)
        ));
    }
    let to_slice_gpu = |g: &&Gpu| SliceGpu {
        vendor: g.vendor,
        pci_bus_id: g.pci_bus_id.clone(),
        uuid: u.mig.map(|m| m.uuid.clone()).or_else(|| g.uuid.clone()),
        numa_node: g.numa_node,
        mig: u.mig.cloned(),
    };
    let local = cores.iter().filter(|c| c.node == u.home).count();
    notes.push(format!(
        "slice {i}: {}; {} whole core(s), {local} local to node {}; CPUs {}; mems {}",
        describe_unit(u),
        cores.len(),
        u.home,
        format_cpu_list(&cpus),
        join(&mems)
    ));
    Slice {
        index: i as u32,
        gpu: u.gpus.first().map(to_slice_gpu),
        extra_gpus: u.gpus.iter().skip(1).map(to_slice_gpu).collect(),
        cpus,
        mems,
        memory_bytes,
    }
}

/// What a slice holds, for its note: its MIG device, its GPU, or no GPU.
fn describe_unit(u: &Unit) -> String {
    match (u.gpus.first(), u.mig) {
        (Some(g), Some(m)) => format!(
            "MIG device {} (GPU instance {}, compute instance {}, {}) of GPU {} on NUMA node {}",
            m.uuid,
            m.gpu_instance_id,
            m.compute_instance_id,
            format_bytes(m.memory_bytes),
            g.pci_bus_id,
            u.home
        ),
        (Some(g), None) => format!(
            "GPU {} ({}) on NUMA node {}",
            g.pci_bus_id,
            g.vendor,
            g.numa_node.map_or_else(
                || format!("{} (placed; firmware reports none)", u.home),
                |n| n.to_string()
            )
        ),
        (None, _) => format!("CPU-only, NUMA node {}", u.home),
    }
}

fn validate(policy: &Policy) -> Result<(), PlanError> {
    if policy.gpus_per_slice == 0 {
        return Err(PlanError::InvalidPolicy(
            "--gpus-per-slice must be at least 1".into(),
        ));
    }
    if policy.host_memory_reserve_percent > 100 {
        return Err(PlanError::InvalidPolicy(
            "--host-memory-reserve is a percentage, 0 to 100".into(),
        ));
    }
    if policy.cores_per_slice == Some(0) {
        return Err(PlanError::InvalidPolicy(
            "--cores-per-slice must be at least 1".into(),
        ));
    }
    if policy.cpu_only_slices == Some(0) {
        return Err(PlanError::InvalidPolicy(
            "--cpu-only-slices must be at least 1".into(),
        ));
    }
    Ok(())
}

fn join(ids: impl IntoIterator<Item = impl std::borrow::Borrow<u32>>) -> String {
    ids.into_iter()
        .map(|i| i.borrow().to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn free_nodes(cores: &[Core]) -> BTreeSet<u32> {
    cores.iter().map(|c| c.node).collect()
}

/// Decides the slices: which GPUs each gets and its home NUMA node, in final index order.
fn make_units<'a>(
    topology: &'a Topology,
    policy: &Policy,
    free: &BTreeMap<u32, Vec<Core>>,
    package_of: &BTreeMap<u32, Option<u32>>,
    notes: &mut Vec<String>,
    warnings: &mut Vec<String>,
) -> Result<Vec<Unit<'a>>, PlanError> {
    if topology.gpus.is_empty() {
        return cpu_only_units(policy, free, notes);
    }
    if policy.cpu_only_slices.is_some() {
        warnings.push("--cpu-only-slices is ignored: this node has GPUs".into());
    }
    let vendors: BTreeSet<_> = topology.gpus.iter().map(|g| g.vendor).collect();
    if vendors.len() > 1 {
        warnings.push(
            "this node mixes NVIDIA and AMD GPUs: slice indexes follow the node-wide PCI bus order, not CUDA's or ROCm's device numbering; select devices by pci_bus_id".into(),
        );
    }

    let home = place_gpus(topology, free, package_of, warnings)?;

    let g = policy.gpus_per_slice as usize;
    let mig: Vec<usize> = (0..topology.gpus.len())
        .filter(|&i| !topology.gpus[i].mig.is_empty())
        .collect();
    if g > 1 {
        if let Some(&i) = mig.first() {
            return Err(PlanError::InvalidPolicy(format!(
                "--gpus-per-slice {g}: GPU {} is in MIG mode, and CUDA shows a process one MIG device only, so a MIG slice holds one instance; plan with --gpus-per-slice 1, or turn MIG off on that GPU (nvidia-smi -i <index> -mig 0)",
                topology.gpus[i].pci_bus_id
            )));
        }
    }
    // In MIG mode with no MIG device yet: CUDA cannot use it whole (k8s-device-plugin never
    // offers such a GPU; Slurm stops on it), so it is in no slice, and the warning says what
    // to run; the node's other GPUs still serve.
    let empty_mig: Vec<usize> = (0..topology.gpus.len())
        .filter(|&i| topology.gpus[i].mig_enabled && topology.gpus[i].mig.is_empty())
        .collect();
    for &i in &empty_mig {
        warnings.push(empty_mig_warning(&topology.gpus[i].pci_bus_id));
    }
    let whole: Vec<usize> = (0..topology.gpus.len())
        .filter(|i| !mig.contains(i) && !empty_mig.contains(i))
        .collect();
    if whole.is_empty() && mig.is_empty() && !empty_mig.is_empty() {
        return Err(PlanError::MigWithoutDevices(
            empty_mig
                .iter()
                .map(|&i| topology.gpus[i].pci_bus_id.clone())
                .collect(),
        ));
    }
    let mut groups = group_gpus(topology, &whole, &home, g, notes, warnings);
    for &i in &mig {
        groups.extend(mig_groups(topology, i, notes, warnings));
    }
    groups.sort_by_key(|(grp, m)| (grp[0], *m));
    Ok(groups
        .into_iter()
        .map(|(grp, m)| {
            let mut mems: Vec<u32> = grp.iter().filter_map(|&i| home[i]).collect();
            mems.sort_unstable();
            mems.dedup();
            Unit {
                home: home[grp[0]].unwrap_or(0),
                gpus: grp.iter().map(|&i| &topology.gpus[i]).collect(),
                mig: m.map(|m| &topology.gpus[grp[0]].mig[m]),
                mems,
            }
        })
        .collect())
}

/// What to run for a GPU in MIG mode with no MIG device (the planner leaves it out).
pub fn empty_mig_warning(bus: &str) -> String {
    format!(
        "GPU {bus} is in MIG mode but has no MIG device (no GPU or compute instance): CUDA cannot use it whole, so it is in no slice; create MIG devices (`sudo nvidia-smi mig -i {bus} -lgip` lists the profiles, `sudo nvidia-smi mig -i {bus} -cgi <profiles> -C` makes them) or turn MIG off (`sudo nvidia-smi -i {bus} -mig 0`, then `sudo nvidia-smi -i {bus} -r` or reboot), then run `sudo kernelkite-isolate setup` again"
    )
}

/// The slices of a node without GPUs: the policy's count, spread evenly over the nodes with
/// free cores; an error when the policy asks for none.
fn cpu_only_units<'a>(
    policy: &Policy,
    free: &BTreeMap<u32, Vec<Core>>,
    notes: &mut Vec<String>,
) -> Result<Vec<Unit<'a>>, PlanError> {
    let nodes: Vec<u32> = free.keys().copied().collect();
    let Some(n) = policy.cpu_only_slices else {
        return Err(PlanError::NoGpus);
    };
    notes.push(format!(
        "no GPU: {n} CPU-only slice(s) spread over NUMA node(s) {}",
        join(&nodes)
    ));
    let k = nodes.len();
    Ok((0..n as usize)
        .map(|i| {
            let home = nodes[i * k / n as usize];
            Unit {
                gpus: Vec::new(),
                mig: None,
                home,
                mems: vec![home],
            }
        })
        .collect())
}

/// Home node of every GPU: its own when it has CPUs, else placed to spread over packages.
fn place_gpus(
    topology: &Topology,
    free: &BTreeMap<u32, Vec<Core>>,
    package_of: &BTreeMap<u32, Option<u32>>,
    warnings: &mut Vec<String>,
) -> Result<Vec<Option<u32>>, PlanError> {
    let nodes: Vec<u32> = free.keys().copied().collect();
    let mut home: Vec<Option<u32>> = topology
        .gpus
        .iter()
        .map(|g| g.numa_node.filter(|n| free.contains_key(n)))
        .collect();
    let mut per_node: BTreeMap<u32, usize> = BTreeMap::new();
    let mut per_pkg: BTreeMap<Option<u32>, usize> = BTreeMap::new();
    for h in home.iter().flatten() {
        *per_node.entry(*h).or_default() += 1;
        *per_pkg
            .entry(package_of.get(h).copied().flatten())
            .or_default() += 1;
    }
    let online = topology.online_cpus();
    let node_cpus: BTreeMap<u32, BTreeSet<u32>> = free
        .keys()
        .map(|n| {
            let cpus = topology
                .numa_node(*n)
                .map(|x| x.cpus.iter().copied().collect())
                .unwrap_or_default();
            (*n, cpus)
        })
        .collect();
    for (i, gpu) in topology.gpus.iter().enumerate() {
        if home[i].is_some() {
            continue;
        }
        let candidates = near_nodes(gpu, &nodes, &node_cpus, online.len());
        let Some(chosen) = candidates.iter().copied().min_by_key(|n| {
            let pkg = package_of.get(n).copied().flatten();
            (
                per_pkg.get(&pkg).copied().unwrap_or(0),
                per_node.get(n).copied().unwrap_or(0),
                *n,
            )
        }) else {
            return Err(PlanError::NoUsableCpus(
                "no NUMA node has usable CPUs".into(),
            ));
        };
        *per_node.entry(chosen).or_default() += 1;
        *per_pkg
            .entry(package_of.get(&chosen).copied().flatten())
            .or_default() += 1;
        home[i] = Some(chosen);
        let why = match gpu.numa_node {
            None => "the firmware reports no NUMA node (-1)".to_string(),
            Some(n) => format!("its NUMA node {n} has no usable CPUs"),
        };
        warnings.push(format!(
            "GPU {}: {why}; placed on NUMA node {chosen} (package {}) to spread GPUs over packages",
            gpu.pci_bus_id,
            package_of
                .get(&chosen)
                .copied()
                .flatten()
                .map_or_else(|| "?".into(), |p| p.to_string())
        ));
    }
    Ok(home)
}

/// The nodes a GPU without a usable NUMA node may be placed on: those its local CPUs are on,
/// or all of them when its local CPUs do not say.
fn near_nodes(
    gpu: &Gpu,
    nodes: &[u32],
    node_cpus: &BTreeMap<u32, BTreeSet<u32>>,
    online: usize,
) -> Vec<u32> {
    // Local CPUs that are a proper subset of the machine still say which node(s) are near.
    let informative = !gpu.local_cpus.is_empty() && gpu.local_cpus.len() < online;
    let candidates: Vec<u32> = if informative {
        nodes
            .iter()
            .copied()
            .filter(|n| {
                node_cpus
                    .get(n)
                    .is_some_and(|cs| gpu.local_cpus.iter().any(|c| cs.contains(c)))
            })
            .collect()
    } else {
        Vec::new()
    };
    if candidates.is_empty() {
        nodes.to_vec()
    } else {
        candidates
    }
}

/// A GPU in MIG mode is cut into one slice per MIG device, each sharing the GPU's node: the
/// groups of GPU `i`, one per MIG device.
fn mig_groups(
    topology: &Topology,
    i: usize,
    notes: &mut Vec<String>,
    warnings: &mut Vec<String>,
) -> Vec<(Vec<usize>, Option<usize>)> {
    let gpu = &topology.gpus[i];
    notes.push(format!(
        "GPU {} is in MIG mode: one slice per MIG device ({})",
        gpu.pci_bus_id,
        gpu.mig.len()
    ));
    // Compute instances of one GPU instance share its memory and L2 cache: their slices'
    // jobs are not isolated from each other in memory.
    let mut per_gi: BTreeMap<u32, usize> = BTreeMap::new();
    for m in &gpu.mig {
        *per_gi.entry(m.gpu_instance_id).or_default() += 1;
    }
    for (gi, n) in per_gi.into_iter().filter(|(_, n)| *n > 1) {
        warnings.push(format!(
            "GPU {}: GPU instance {gi} holds {n} compute instances, whose slices share its memory and L2 cache (each reports the whole instance's memory); for slices isolated in memory give each GPU instance one compute instance (nvidia-smi mig -cgi <profile> -C)",
            gpu.pci_bus_id
        ));
    }
    (0..gpu.mig.len()).map(|m| (vec![i], Some(m))).collect()
}

/// Whether GPUs `a` and `b` share a fast link (NVLink, xGMI), as either one reports it.
fn linked(topology: &Topology, a: usize, b: usize) -> bool {
    let (ga, gb) = (&topology.gpus[a], &topology.gpus[b]);
    ga.links.contains(&gb.pci_bus_id) || gb.links.contains(&ga.pci_bus_id)
}

/// Takes groups of `g` from `idx` (bus order): each starts at the lowest GPU left and adds, in
/// bus order, the GPUs linked to every member, so a group shares a fast link where the node
/// has one; a group the links cannot fill takes the lowest GPUs left, with a warning when the
/// node reports links at all. Returns the groups and the GPUs left over.
fn link_groups(
    topology: &Topology,
    idx: &[usize],
    g: usize,
    warnings: &mut Vec<String>,
) -> (Vec<Vec<usize>>, Vec<usize>) {
    let mut left: Vec<usize> = idx.to_vec();
    let mut groups = Vec::new();
    let any_links = idx.iter().any(|&i| !topology.gpus[i].links.is_empty());
    while left.len() >= g {
        let mut grp = vec![left[0]];
        for &c in &left[1..] {
            if grp.len() < g && grp.iter().all(|&m| linked(topology, m, c)) {
                grp.push(c);
            }
        }
        if grp.len() < g {
            if any_links {
                warnings.push(format!(
                    "no {g} GPUs of {} share a fast link (NVLink/xGMI) with each other; a slice gets GPUs that talk over PCIe",
                    grp.iter()
                        .map(|&i| topology.gpus[i].pci_bus_id.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            for &c in &left[1..] {
                if grp.len() < g && !grp.contains(&c) {
                    grp.push(c);
                }
            }
        }
        grp.sort_unstable();
        left.retain(|i| !grp.contains(i));
        groups.push(grp);
    }
    (groups, left)
}

/// Groups whole GPUs into slices of `g`: within a NUMA node and vendor first, GPUs that share
/// a fast link together ([`link_groups`]); remainders across nodes.
fn group_gpus(
    topology: &Topology,
    whole: &[usize],
    home: &[Option<u32>],
    g: usize,
    notes: &mut Vec<String>,
    warnings: &mut Vec<String>,
) -> Vec<(Vec<usize>, Option<usize>)> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut by_key: BTreeMap<(u32, crate::plan::Vendor), Vec<usize>> = BTreeMap::new();
    for &i in whole {
        by_key
            .entry((home[i].unwrap_or(0), topology.gpus[i].vendor))
            .or_default()
            .push(i);
    }
    let mut rest: BTreeMap<crate::plan::Vendor, Vec<usize>> = BTreeMap::new();
    for ((_, vendor), idx) in by_key {
        let (made, left) = link_groups(topology, &idx, g, warnings);
        groups.extend(made);
        rest.entry(vendor).or_default().extend(left);
    }
    for (_, mut idx) in rest {
        idx.sort_unstable();
        let (made, left) = link_groups(topology, &idx, g, warnings);
        for chunk in made {
            warnings.push(format!(
                "a slice's GPUs {} sit on different NUMA nodes; its CPUs are local to the first",
                chunk
                    .iter()
                    .map(|&i| topology.gpus[i].pci_bus_id.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            groups.push(chunk);
        }
        for &i in &left {
            warnings.push(format!(
                "GPU {} is in no slice: {} GPUs do not divide into slices of {g}",
                topology.gpus[i].pci_bus_id,
                whole.len()
            ));
        }
    }
    if g > 1 && whole.iter().any(|&i| !topology.gpus[i].links.is_empty()) {
        let meshed = groups
            .iter()
            .filter(|grp| {
                grp.iter()
                    .enumerate()
                    .all(|(k, &a)| grp[k + 1..].iter().all(|&b| linked(topology, a, b)))
            })
            .count();
        notes.push(format!(
            "grouping: in {meshed} of {} slice(s) every pair of GPUs shares a fast link (NVLink/xGMI)",
            groups.len()
        ));
    }
    groups.into_iter().map(|grp| (grp, None)).collect()
}

/// With more slices than cores: each slice gets one core, local when possible, round-robin.
fn share_cores(
    units: &[Unit],
    cores: &[Core],
    free: &BTreeMap<u32, Vec<Core>>,
    out: &mut [Vec<Core>],
) {
    let mut next: BTreeMap<u32, usize> = BTreeMap::new();
    let mut next_any = 0usize;
    for (i, u) in units.iter().enumerate() {
        match free.get(&u.home).filter(|l| !l.is_empty()) {
            Some(list) => {
                let k = next.entry(u.home).or_default();
                out[i].push(list[*k % list.len()].clone());
                *k += 1;
            }
            None => {
                out[i].push(cores[next_any % cores.len()].clone());
                next_any += 1;
            }
        }
    }
}

/// Memory each node can give its slices: node memory minus the host reserve.
fn memory_budgets(
    topology: &Topology,
    policy: &Policy,
    nodes: &BTreeSet<u32>,
    warnings: &mut Vec<String>,
) -> BTreeMap<u32, u64> {
    let keep = |bytes: u64| -> u64 {
        let reserve =
            (u128::from(bytes) * u128::from(policy.host_memory_reserve_percent)).div_ceil(100);
        bytes.saturating_sub(reserve as u64)
    };
    let mut out = BTreeMap::new();
    let unknown = nodes
        .iter()
        .filter(|n| !matches!(topology.numa_node(**n), Some(x) if x.memory_bytes > 0))
        .count();
    if unknown > 0 {
        warnings.push(format!(
            "{unknown} NUMA node(s) report no memory size; their slices get an equal share of the machine's total"
        ));
    }
    for n in nodes {
        let bytes = match topology.numa_node(*n).map(|x| x.memory_bytes) {
            Some(b) if b > 0 => b,
            _ => topology.total_memory_bytes / nodes.len().max(1) as u64,
        };
        out.insert(*n, keep(bytes));
    }
    out
}

/// `1.5 GiB`, for the human output.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_human() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(3 << 30), "3.0 GiB");
        assert_eq!(format_bytes(1536 << 20), "1.5 GiB");
    }

    #[test]
    fn invalid_policies_are_rejected_with_the_flag_named() {
        let bad = [
            Policy {
                gpus_per_slice: 0,
                ..Policy::default()
            },
            Policy {
                host_memory_reserve_percent: 101,
                ..Policy::default()
            },
            Policy {
                cores_per_slice: Some(0),
                ..Policy::default()
            },
        ];
        for p in bad {
            let e = validate(&p).unwrap_err().to_string();
            assert!(e.contains("--"), "{e}");
        }
        assert!(validate(&Policy::default()).is_ok());
    }
}
