//! The prototype's contiguous split against the planner, on the DGX H100 fixture.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use kernelkite_topology::cpulist::parse_cpu_list;
use kernelkite_topology::fakesys;
use kernelkite_topology::planner::{plan, Policy};
use kernelkite_topology::topology::Topology;

use crate::common;
use common::{output_ok, path_with, stub_nvidia_smi_bin};
use kernelkite_testkit::scratch;

/// The prototype: N = CPUs / GPUs, GPU g gets CPUs g*N .. g*N+N-1.
fn contiguous_split(cpus: u32, gpus: u32) -> Vec<Vec<u32>> {
    let n = cpus / gpus;
    (0..gpus).map(|g| (g * n..g * n + n).collect()).collect()
}

/// Pairs of slices that share a physical core, and slices with CPUs off their GPU's socket.
fn faults(topo: &Topology, slices: &[Vec<u32>]) -> (Vec<(usize, usize)>, Vec<usize>) {
    let cpu = |id: u32| topo.cpus.iter().find(|c| c.id == id).unwrap();
    let mut core_users: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, s) in slices.iter().enumerate() {
        for &c in s {
            let users = core_users.entry(cpu(c).core).or_default();
            if !users.contains(&i) {
                users.push(i);
            }
        }
    }
    let mut shared: Vec<(usize, usize)> = core_users
        .values()
        .filter(|u| u.len() > 1)
        .map(|u| (u[0], u[1]))
        .collect();
    shared.sort_unstable();
    shared.dedup();
    let remote = slices
        .iter()
        .enumerate()
        .filter(|(i, s)| {
            let node = topo.gpus[*i].numa_node;
            s.iter().any(|c| cpu(*c).numa_node != node)
        })
        .map(|(i, _)| i)
        .collect();
    (shared, remote)
}

#[test]
fn the_contiguous_split_shares_cores_and_crosses_sockets_and_the_plan_does_not() {
    let dir = scratch();
    fakesys::dgx_h100().write_to(dir.path()).unwrap();
    let topo = Topology::discover(dir.path()).unwrap();

    let proto = contiguous_split(topo.online_cpus().len() as u32, topo.gpus.len() as u32);
    assert_eq!(proto[4], parse_cpu_list("112-139").unwrap());
    let (shared, remote) = faults(&topo, &proto);
    // GPU 4's CPUs 112-139 are the hyper-threads of GPU 0's cores 0-27, and so on.
    assert_eq!(shared, [(0, 4), (1, 5), (2, 6), (3, 7)]);
    // GPUs 2, 3 (socket 0) get socket 1's CPUs 56-111; GPUs 4, 5 (socket 1) get socket 0's siblings.
    assert_eq!(remote, [2, 3, 4, 5]);

    let p = plan(&topo, &Policy::default()).unwrap();
    let planned: Vec<Vec<u32>> = p.slices.iter().map(|s| s.cpus.clone()).collect();
    let (shared, remote) = faults(&topo, &planned);
    assert!(shared.is_empty(), "{shared:?}");
    assert!(remote.is_empty(), "{remote:?}");
    // Memory: the prototype gives total/GPUs and keeps nothing for the host.
    let proto_mem = topo.total_memory_bytes / topo.gpus.len() as u64;
    let planned_mem: u64 = p.slices.iter().map(|s| s.memory_bytes).sum();
    assert_eq!(proto_mem * 8, topo.total_memory_bytes);
    assert!(planned_mem <= topo.total_memory_bytes / 10 * 9);
}

#[test]
fn the_reconstructed_prototype_hook_exports_the_contiguous_split() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = scratch();
    fakesys::dgx_h100()
        .write_to(&dir.path().join("root"))
        .unwrap();
    let bin = stub_nvidia_smi_bin(dir.path());
    std::fs::write(bin.join("nproc"), "#!/bin/sh\necho 224\n").unwrap();
    let status = Command::new("chmod")
        .arg("+x")
        .arg(bin.join("nproc"))
        .status()
        .unwrap();
    assert!(status.success());
    let out = output_ok(
        Command::new("bash")
            .arg(manifest.join("benches/prototype-environment-hook.sh"))
            .env("PATH", path_with(&bin))
            .env("KERNELKITE_PROTO_ROOT", dir.path().join("root"))
            .env("BUILDKITE_AGENT_NAME", "dgx-h100-4"),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("export KERNELBOT_GPU_INDEX=4\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("export CUDA_VISIBLE_DEVICES=4\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("export KERNELBOT_CPUSET=112-139\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("export KERNELBOT_MEMORY=256g\n"),
        "{stdout}"
    );
}
