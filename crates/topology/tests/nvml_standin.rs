//! Plans from NVML: a node whose driver files give no UUIDs (`/proc/driver/nvidia` absent, as in
//! containers that mount only the device nodes), discovered with NVML loaded through the real
//! loader from the stand-in library (`kernelkite_testkit_leaf::fake_nvml`): the UUIDs and minors
//! come from NVML, and the plan's slices carry them (what `CUDA_VISIBLE_DEVICES` names).

use kernelkite_testkit_leaf::fake_nvml::{
    h100, h100_uuid, mig, mig_mode, mig_uuid, nvlink, FakeNvml,
};
use kernelkite_topology::fakesys;
use kernelkite_topology::planner::{plan, Policy};
use kernelkite_topology::Topology;

#[test]
fn a_plan_takes_uuids_and_minors_from_nvml() {
    let _one = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let fake = match FakeNvml::build_in_this_process() {
        Ok(f) => f,
        Err(why) => return kernelkite_testkit_leaf::skip(&why),
    };
    let root = tempfile::tempdir().unwrap();
    fakesys::dgx_h100()
        .without_nvidia_driver()
        .write_to(root.path())
        .unwrap();
    let bare = Topology::discover_with_nvml(root.path(), None).unwrap();
    assert!(bare.gpus.iter().all(|g| g.uuid.is_none()));
    // NVML numbers its GPUs in its own order; the minors differ from the bus order here.
    let config: String = bare
        .gpus
        .iter()
        .enumerate()
        .rev()
        .map(|(i, g)| h100(&g.pci_bus_id, 10 + i as u32, 0))
        .collect();
    fake.configure(&config);
    let lib = fake.library().display().to_string();
    let topo = Topology::discover_with_nvml(root.path(), Some(&lib)).unwrap();
    for (i, g) in topo.gpus.iter().enumerate() {
        assert_eq!(g.uuid.as_deref(), Some(h100_uuid(&g.pci_bus_id).as_str()));
        assert_eq!(g.minor, Some(10 + i as u32));
    }
    let p = plan(&topo, &Policy::default()).unwrap();
    assert_eq!(p.slices.len(), 8);
    for s in &p.slices {
        let gpu = s.gpu.as_ref().unwrap();
        assert_eq!(
            gpu.uuid.as_deref(),
            Some(h100_uuid(&gpu.pci_bus_id).as_str())
        );
    }
    // NVML failing leaves the plan without UUIDs, never without a plan.
    fake.configure("fail nvmlInit_v2 999\n");
    let topo = Topology::discover_with_nvml(root.path(), Some(&lib)).unwrap();
    assert!(topo.gpus.iter().all(|g| g.uuid.is_none()));
    assert!(plan(&topo, &Policy::default()).is_ok());
}

/// One test of this binary loads the stand-in at a time: its configuration is named by this
/// process's environment.
static NVML: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn a_gpu_in_mig_mode_is_one_slice_per_mig_device_and_nvlink_groups_slices() {
    let _one = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let fake = match FakeNvml::build_in_this_process() {
        Ok(f) => f,
        Err(why) => return kernelkite_testkit_leaf::skip(&why),
    };
    let root = tempfile::tempdir().unwrap();
    fakesys::dgx_h100().write_to(root.path()).unwrap();
    let lib = fake.library().display().to_string();
    let buses: Vec<String> = Topology::discover_with_nvml(root.path(), None)
        .unwrap()
        .gpus
        .iter()
        .map(|g| g.pci_bus_id.clone())
        .collect();
    let gpus: String = buses
        .iter()
        .enumerate()
        .map(|(i, b)| h100(b, i as u32, 0))
        .collect();

    // GPU 1 in MIG mode with three devices (one of them a second compute instance).
    let migs = [(1, 0, 40), (2, 0, 20), (2, 1, 20)];
    let config = gpus.clone()
        + &migs
            .iter()
            .map(|&(gi, ci, gib)| mig(&buses[1], gi, ci, gib))
            .collect::<String>();
    fake.configure(&config);
    let topo = Topology::discover_with_nvml(root.path(), Some(&lib)).unwrap();
    assert_eq!(topo.gpus[1].mig.len(), 3);
    assert!(topo
        .gpus
        .iter()
        .enumerate()
        .all(|(i, g)| i == 1 || g.mig.is_empty()));
    let p = plan(&topo, &Policy::default()).unwrap();
    assert_eq!(p.slices.len(), 7 + 3, "{:#?}", p.slices);
    assert!(
        p.warnings
            .iter()
            .any(|w| w.contains("GPU instance 2 holds 2 compute instances")),
        "{:?}",
        p.warnings
    );
    let mig_slices: Vec<_> = p
        .slices
        .iter()
        .filter(|s| s.gpu.as_ref().unwrap().mig.is_some())
        .collect();
    assert_eq!(mig_slices.len(), 3);
    for (s, &(gi, ci, gib)) in mig_slices.iter().zip(&migs) {
        let g = s.gpu.as_ref().unwrap();
        let m = g.mig.as_ref().unwrap();
        assert_eq!(
            g.pci_bus_id, buses[1],
            "a MIG slice names its parent GPU's bus"
        );
        assert_eq!(
            g.uuid.as_deref(),
            Some(mig_uuid(&buses[1], gi, ci).as_str())
        );
        assert_eq!((m.gpu_instance_id, m.compute_instance_id), (gi, ci));
        assert_eq!(m.memory_bytes, gib << 30);
        assert_eq!(s.mems, vec![0]);
    }
    // Slices stay disjoint and equal: the MIG devices share GPU 1's NUMA node like GPUs.
    let mut seen = std::collections::BTreeSet::new();
    for s in &p.slices {
        assert_eq!(s.cpus.len(), p.slices[0].cpus.len());
        for c in &s.cpus {
            assert!(seen.insert(*c), "CPU {c} in two slices");
        }
    }
    let err = plan(
        &topo,
        &Policy {
            gpus_per_slice: 2,
            ..Policy::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("MIG mode") && err.contains(&buses[1]), "{err}");
    // A multi-GPU queue beside these slices groups whole GPUs only: slices 1-3 (GPU 1's MIG
    // devices) are in no group; node 0's three whole GPUs give one pair.
    let groups =
        kernelkite_topology::planner::multi_gpu_groups(&topo, &Policy::default(), &p, 2).unwrap();
    assert_eq!(groups, [vec![0, 4], vec![6, 7], vec![8, 9]]);

    // NVLink pairs 0–3 and 1–2 on node 0: two-GPU slices follow the links, not bus order.
    let config = gpus
        + &nvlink(&buses[0], &buses[3])
        + &nvlink(&buses[1], &buses[2])
        + &nvlink(&buses[4], &buses[5])
        + &nvlink(&buses[6], &buses[7]);
    fake.configure(&config);
    let topo = Topology::discover_with_nvml(root.path(), Some(&lib)).unwrap();
    assert_eq!(topo.gpus[0].links, vec![buses[3].clone()]);
    let explained = kernelkite_topology::planner::plan_explained(
        &topo,
        &Policy {
            gpus_per_slice: 2,
            ..Policy::default()
        },
    )
    .unwrap();
    let pairs: Vec<Vec<&str>> = explained
        .plan
        .slices
        .iter()
        .map(|s| {
            std::iter::once(s.gpu.as_ref().unwrap())
                .chain(&s.extra_gpus)
                .map(|g| g.pci_bus_id.as_str())
                .collect()
        })
        .collect();
    let want: Vec<Vec<&str>> = [(0, 3), (1, 2), (4, 5), (6, 7)]
        .iter()
        .map(|&(a, b)| vec![buses[a].as_str(), buses[b].as_str()])
        .collect();
    assert_eq!(pairs, want);
    assert!(
        explained
            .notes
            .iter()
            .any(|n| n.contains("in 4 of 4 slice(s)")),
        "{:?}",
        explained.notes
    );
}

/// Issue 36: a GPU in MIG mode with no MIG device yet (MIG just enabled, or a reboot before
/// the instances are made again) is not a whole GPU CUDA can use: it is in no slice, the
/// warning says what to run, a multi-GPU queue never groups it, and a node with nothing else
/// is refused, naming it. A change only pending (until the GPU's next reset) changes nothing.
#[test]
fn a_gpu_in_mig_mode_without_mig_devices_is_in_no_slice() {
    let _one = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let fake = match FakeNvml::build_in_this_process() {
        Ok(f) => f,
        Err(why) => return kernelkite_testkit_leaf::skip(&why),
    };
    let root = tempfile::tempdir().unwrap();
    fakesys::dgx_h100().write_to(root.path()).unwrap();
    let lib = fake.library().display().to_string();
    let buses: Vec<String> = Topology::discover_with_nvml(root.path(), None)
        .unwrap()
        .gpus
        .iter()
        .map(|g| g.pci_bus_id.clone())
        .collect();
    let gpus: String = buses
        .iter()
        .enumerate()
        .map(|(i, b)| h100(b, i as u32, 0))
        .collect();
    // GPU 1 in MIG mode, empty; GPU 2 turning MIG on at its next reset.
    fake.configure(&format!(
        "{gpus}{}{}",
        mig_mode(&buses[1], true, true),
        mig_mode(&buses[2], false, true)
    ));
    let topo = Topology::discover_with_nvml(root.path(), Some(&lib)).unwrap();
    assert!(topo.gpus[1].mig_enabled && topo.gpus[1].mig.is_empty());
    assert!(!topo.gpus[2].mig_enabled);
    let p = plan(&topo, &Policy::default()).unwrap();
    assert_eq!(p.slices.len(), 7, "{:#?}", p.slices);
    assert!(p
        .slices
        .iter()
        .all(|s| s.gpus().iter().all(|g| g.pci_bus_id != buses[1])));
    let warning = p
        .warnings
        .iter()
        .find(|w| w.contains(&buses[1]))
        .unwrap_or_else(|| panic!("{:?}", p.warnings));
    assert!(
        warning.contains("no MIG device")
            && warning.contains(&format!("nvidia-smi mig -i {}", buses[1]))
            && warning.contains("-mig 0"),
        "{warning}"
    );
    let groups =
        kernelkite_topology::planner::multi_gpu_groups(&topo, &Policy::default(), &p, 2).unwrap();
    let index_of_gpu1 = p
        .slices
        .iter()
        .position(|s| s.gpu.as_ref().is_some_and(|g| g.pci_bus_id == buses[1]));
    assert_eq!(index_of_gpu1, None);
    assert!(!groups.is_empty());

    // One GPU, in MIG mode and empty: nothing to plan, and the error names it and the fix.
    let one = tempfile::tempdir().unwrap();
    fakesys::workstation_1gpu().write_to(one.path()).unwrap();
    let bus = Topology::discover_with_nvml(one.path(), None).unwrap().gpus[0]
        .pci_bus_id
        .clone();
    fake.configure(&format!(
        "{}{}",
        h100(&bus, 0, 0),
        mig_mode(&bus, true, true)
    ));
    let topo = Topology::discover_with_nvml(one.path(), Some(&lib)).unwrap();
    let err = plan(&topo, &Policy::default()).unwrap_err().to_string();
    assert!(
        err.contains(&bus) && err.contains("no MIG device") && err.contains("-mig 0"),
        "{err}"
    );
}
