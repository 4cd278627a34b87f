//! The node's GPUs as devices: the host numbers of the job's GPUs, and the device nodes of the
//! others, which the job's cgroup denies.

use std::collections::BTreeMap;
use std::path::Path;

use kernelkite_topology::plan::{Plan, Slice, Vendor};

use kernelkite_sys::nvidia;

use crate::cgroup::CharDevice;

/// Character devices of the node's GPUs outside `mine`, from the driver's files under
/// `sysfs_root`: NVIDIA `/dev/nvidia<minor>` (major 195, minor from
/// `/proc/driver/nvidia/gpus/<bdf>/information`) of GPUs the job has no part of, and every
/// capability the driver lists (`/dev/nvidia-caps/nvidia-cap<N>`: MIG's `config` and `monitor`,
/// other MIG devices') but its own MIG device's two; AMD
/// `/dev/dri/{card,renderD}<n>` (major 226). GPUs whose numbers cannot be read are skipped.
pub fn other_gpu_devices(sysfs_root: &Path, plan: &Plan, mine: &Slice) -> Vec<CharDevice> {
    let my_gpus = mine.gpus();
    let mine: Vec<&str> = my_gpus.iter().map(|g| g.pci_bus_id.as_str()).collect();
    let mut out = Vec::new();
    for s in &plan.slices {
        for g in s.gpus() {
            if mine.contains(&g.pci_bus_id.as_str()) {
                continue;
            }
            match g.vendor {
                Vendor::Nvidia => {
                    if let Some(minor) = nvidia::device_minor(sysfs_root, &g.pci_bus_id) {
                        out.push(CharDevice {
                            major: nvidia::GPU_MAJOR,
                            minor,
                        });
                    }
                }
                Vendor::Amd => {
                    let drm = sysfs_root
                        .join("sys/bus/pci/devices")
                        .join(&g.pci_bus_id)
                        .join("drm");
                    for e in std::fs::read_dir(drm).into_iter().flatten().flatten() {
                        let name = e.file_name().to_string_lossy().into_owned();
                        let n = name
                            .strip_prefix("renderD")
                            .or_else(|| name.strip_prefix("card"))
                            .and_then(|n| n.parse().ok());
                        if let Some(minor) = n {
                            out.push(CharDevice { major: 226, minor });
                        }
                    }
                }
            }
        }
    }
    if let Some(major) = nvidia::caps_major(sysfs_root) {
        let own: Vec<u32> = my_gpus
            .iter()
            .filter_map(|g| {
                let mig = g.mig.as_ref()?;
                nvidia::mig_device_caps(
                    sysfs_root,
                    &g.pci_bus_id,
                    mig.gpu_instance_id,
                    mig.compute_instance_id,
                )
            })
            .flatten()
            .collect();
        out.extend(
            nvidia::all_mig_cap_minors(sysfs_root)
                .into_iter()
                .filter(|m| !own.contains(m))
                .map(|minor| CharDevice { major, minor }),
        );
    }
    out.sort();
    out.dedup();
    out
}

/// Host device numbers of a slice's GPUs: each GPU's position among the plan's GPUs of its
/// vendor in PCI bus order, the numbering nvidia-smi, `docker --gpus device=N`, CUDA (with
/// `CUDA_DEVICE_ORDER=PCI_BUS_ID`) and ROCm use. Not the slice number: with several GPUs per
/// slice, or NVIDIA and AMD GPUs on one node, the two differ.
pub fn device_indices(plan: &Plan, slice: &Slice) -> Vec<u32> {
    let mut by_vendor: BTreeMap<Vendor, Vec<&str>> = BTreeMap::new();
    for g in plan.slices.iter().flat_map(Slice::gpus) {
        by_vendor
            .entry(g.vendor)
            .or_default()
            .push(g.pci_bus_id.as_str());
    }
    for ids in by_vendor.values_mut() {
        ids.sort_unstable();
        ids.dedup();
    }
    slice
        .gpus()
        .iter()
        .map(|g| {
            by_vendor
                .get(&g.vendor)
                .and_then(|ids| ids.iter().position(|id| *id == g.pci_bus_id))
                .map_or(slice.index, |i| i as u32)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::exports::exports_for;
    use crate::job::test_support::nv;
    use kernelkite_topology::plan::SliceGpu;

    #[test]
    fn device_numbers_follow_each_vendor_s_bus_order_not_slice_numbers() {
        let gpu = |vendor: Vendor, bus: &str| SliceGpu {
            vendor,
            pci_bus_id: bus.into(),
            uuid: None,
            numa_node: Some(0),
            mig: None,
        };
        let slice = |index: u32, gpus: Vec<SliceGpu>| {
            let mut g = gpus.into_iter();
            Slice {
                index,
                gpu: g.next(),
                extra_gpus: g.collect(),
                cpus: vec![index],
                mems: vec![0],
                memory_bytes: 1,
            }
        };
        // Two AMD GPUs per slice: slice 1 holds devices 2 and 3, not "1".
        let amd = |b: &str| gpu(Vendor::Amd, b);
        let plan = Plan {
            slices: vec![
                slice(0, vec![amd("0000:0c:00.0"), amd("0000:22:00.0")]),
                slice(1, vec![amd("0000:38:00.0"), amd("0000:5c:00.0")]),
            ],
            reserved_cpus: vec![],
            warnings: vec![],
        };
        assert_eq!(device_indices(&plan, &plan.slices[1]), vec![2, 3]);
        let indices = device_indices(&plan, &plan.slices[1]);
        // In the sandbox's private /dev the job's two GPUs are ROCr's 0 and 1; with the host's
        // /dev (the sandbox off) they are 2 and 3. The host's numbers for the record.
        let e = exports_for(&plan.slices[1], &indices, true);
        assert_eq!(e["ROCR_VISIBLE_DEVICES"], "0,1");
        assert_eq!(e["KERNELBOT_GPU_INDEX"], "2,3");
        let e = exports_for(&plan.slices[1], &indices, false);
        assert_eq!(e["ROCR_VISIBLE_DEVICES"], "2,3");
        // Mixed vendors: each vendor numbers its own GPUs.
        let plan = Plan {
            slices: vec![
                slice(0, vec![gpu(Vendor::Nvidia, "0000:18:00.0")]),
                slice(1, vec![amd("0000:20:00.0")]),
                slice(2, vec![gpu(Vendor::Nvidia, "0000:30:00.0")]),
            ],
            reserved_cpus: vec![],
            warnings: vec![],
        };
        assert_eq!(device_indices(&plan, &plan.slices[1]), vec![0]);
        assert_eq!(device_indices(&plan, &plan.slices[2]), vec![1]);
    }

    /// Every slice of an 8× MI300X node, one GPU and two GPUs per slice, with and without
    /// UUIDs, in host mode (exports, private /dev) and docker mode (container variables,
    /// `--device`): the GPUs a HIP program enumerates inside the job, as ROCm's own rules
    /// give them (`kernelkite_sys::kfd`), are exactly the slice's.
    #[test]
    fn an_amd_job_sees_exactly_its_gpus_whatever_their_host_index() {
        use kernelkite_topology::planner::{plan, Policy};
        use kernelkite_topology::Topology;
        for with_uuids in [true, false] {
            for gpus_per_slice in [1, 2] {
                let root = tempfile::tempdir().unwrap();
                kernelkite_topology::fakesys::mi300x_8()
                    .write_to(root.path())
                    .unwrap();
                kernelkite_testkit::kfd::write_mi300x(root.path(), &[], with_uuids).unwrap();
                let topo = Topology::discover(root.path()).unwrap();
                let policy = Policy {
                    gpus_per_slice,
                    ..Policy::default()
                };
                let p = plan(&topo, &policy).unwrap();
                assert_eq!(p.slices.len(), 8 / gpus_per_slice as usize);
                for slice in &p.slices {
                    let mine: Vec<String> =
                        slice.gpus().iter().map(|g| g.pci_bus_id.clone()).collect();
                    // The job's /dev: its own render nodes only.
                    let job = tempfile::tempdir().unwrap();
                    let own: Vec<usize> = (0..8)
                        .filter(|i| mine.contains(&kernelkite_testkit::kfd::mi300x_bus_id(*i)))
                        .collect();
                    kernelkite_testkit::kfd::write_mi300x(job.path(), &own, with_uuids).unwrap();
                    let host = exports_for(slice, &device_indices(&p, slice), true);
                    let container = crate::docker::container_device_env(slice);
                    // The sandbox off: the host's /dev, every render node.
                    let bare = tempfile::tempdir().unwrap();
                    let every: Vec<usize> = (0..8).collect();
                    kernelkite_testkit::kfd::write_mi300x(bare.path(), &every, with_uuids).unwrap();
                    let unsandboxed = exports_for(slice, &device_indices(&p, slice), false);
                    for (mode, env, view) in [
                        ("host", &host, job.path()),
                        ("docker", &container, job.path()),
                        ("host, sandbox off", &unsandboxed, bare.path()),
                    ] {
                        let seen = kernelkite_sys::kfd::visible(view, &view.join("dev"), &|k| {
                            env.get(k).cloned()
                        });
                        let seen: Vec<String> = seen.into_iter().map(|g| g.pci_bus_id).collect();
                        assert_eq!(
                            seen, mine,
                            "slice {} ({mode}, uuids {with_uuids}, {gpus_per_slice} per slice): {env:?}",
                            slice.index
                        );
                    }
                    if with_uuids {
                        assert!(host["ROCR_VISIBLE_DEVICES"].starts_with("GPU-1d3a"));
                    }
                }
            }
        }
    }

    #[test]
    fn other_gpus_devices_come_from_the_driver_files() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        for (bus, minor) in [("0000:18:00.0", 0), ("0000:2a:00.0", 1)] {
            let d = r.join("proc/driver/nvidia/gpus").join(bus);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(
                d.join("information"),
                format!("Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 123\nDevice Minor: \t {minor}\n"),
            )
            .unwrap();
        }
        for n in ["card2", "renderD130"] {
            std::fs::create_dir_all(r.join("sys/bus/pci/devices/0000:0c:00.0/drm").join(n))
                .unwrap();
        }
        let slice = |i: u32, g: SliceGpu| Slice {
            index: i,
            gpu: Some(g),
            extra_gpus: vec![],
            cpus: vec![i],
            mems: vec![0],
            memory_bytes: 1,
        };
        let mut amd = nv("0000:0c:00.0", None);
        amd.vendor = Vendor::Amd;
        let plan = Plan {
            slices: vec![
                slice(0, nv("0000:18:00.0", None)),
                slice(1, nv("0000:2a:00.0", None)),
                slice(2, amd),
                slice(3, nv("0000:ff:00.0", None)),
            ],
            reserved_cpus: vec![],
            warnings: vec![],
        };
        let devs = other_gpu_devices(r, &plan, &plan.slices[0]);
        assert_eq!(
            devs,
            vec![
                CharDevice {
                    major: 195,
                    minor: 1
                },
                CharDevice {
                    major: 226,
                    minor: 2
                },
                CharDevice {
                    major: 226,
                    minor: 130
                },
            ]
        );

        // GPU 1 in MIG mode, cut into two slices: each keeps the GPU's node and its own two
        // capabilities, and is denied the other's (and nothing of a whole GPU's slice).
        kernelkite_testkit::fake_nvml::write_mig_minors(
            r,
            508,
            &[(1, 3, 0, 30, 31), (1, 5, 0, 50, 51)],
        )
        .unwrap();
        let mig = |gi: u32| {
            let mut g = nv("0000:2a:00.0", Some(&format!("MIG-{gi}")));
            g.mig = Some(kernelkite_topology::plan::MigInstance {
                uuid: format!("MIG-{gi}"),
                gpu_instance_id: gi,
                compute_instance_id: 0,
                memory_bytes: 10 << 30,
            });
            g
        };
        let plan = Plan {
            slices: vec![
                slice(0, nv("0000:18:00.0", None)),
                slice(1, mig(3)),
                slice(2, mig(5)),
            ],
            reserved_cpus: vec![],
            warnings: vec![],
        };
        let dev = |major, minor| CharDevice { major, minor };
        assert_eq!(
            other_gpu_devices(r, &plan, &plan.slices[1]),
            [
                dev(195, 0),
                dev(508, 1),
                dev(508, 2),
                dev(508, 50),
                dev(508, 51)
            ]
        );
        assert_eq!(
            other_gpu_devices(r, &plan, &plan.slices[0]),
            [
                dev(195, 1),
                dev(508, 1),
                dev(508, 2),
                dev(508, 30),
                dev(508, 31),
                dev(508, 50),
                dev(508, 51)
            ]
        );
    }
}
