//! Plans from NVML: a node whose driver files give no UUIDs (`/proc/driver/nvidia` absent, as in
//! containers that mount only the device nodes), discovered with NVML loaded through the real
//! loader from the stand-in library (`kernelkite_testkit::fake_nvml`): the UUIDs and minors
//! come from NVML, and the plan's slices carry them (what `CUDA_VISIBLE_DEVICES` names).

use kernelkite_testkit::fake_nvml::{h100, h100_uuid, FakeNvml};
use kernelkite_topology::fakesys;
use kernelkite_topology::planner::{plan, Policy};
use kernelkite_topology::Topology;

#[test]
fn a_plan_takes_uuids_and_minors_from_nvml() {
    let fake = match FakeNvml::build_in_this_process() {
        Ok(f) => f,
        Err(why) => return kernelkite_testkit::skip(&why),
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
