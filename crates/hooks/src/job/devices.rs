//! The node's GPUs as devices: the host numbers of the job's GPUs, and the device numbers of
//! its own GPU nodes, the only GPU devices its cgroup allows.

use std::collections::BTreeMap;
use std::path::Path;

use kernelkite_topology::plan::{Plan, Slice, SliceGpu, Vendor};

use kernelkite_sys::nvidia;

use crate::cgroup::CharDevice;

/// The DRM subsystem's major (`/dev/dri/card<n>`, `renderD<n>`; `DRM_MAJOR` in the kernel).
pub const DRM_MAJOR: u32 = 226;

/// The character devices of `slice`'s own GPU nodes, from the driver's files under
/// `sysfs_root`: NVIDIA `nvidia<minor>` (195, minor from
/// `/proc/driver/nvidia/gpus/<bdf>/information`), the driver's shared `nvidiactl` (195:255),
/// `nvidia-modeset` (195:254), `nvidia-uvm` and `nvidia-uvm-tools` (the `nvidia-uvm` major of
/// `/proc/devices`, minors 0 and 1), and a MIG device's two capabilities (the `nvidia-caps`
/// major, minors from `mig-minors`); AMD `kfd` (its major, minor 0) and each GPU's
/// `dri/card<n>` and `renderD<n>` (226). The nodes `sandbox::spec::gpu_device_nodes` binds
/// into the job's `/dev`, by number; a handful, whatever the node's size or the driver's table.
pub fn job_devices(sysfs_root: &Path, slice: &Slice) -> Vec<CharDevice> {
    let dev = |major, minor| CharDevice { major, minor };
    let gpus = slice.gpus();
    let mut out = Vec::new();
    for g in &gpus {
        match g.vendor {
            Vendor::Nvidia => {
                let minor = nvidia::device_minor(sysfs_root, &g.pci_bus_id);
                out.extend(minor.map(|m| dev(nvidia::GPU_MAJOR, m)));
                let caps = minor.zip(g.mig.as_ref()).and_then(|(m, mig)| {
                    nvidia::mig_cap_minors(
                        sysfs_root,
                        m,
                        mig.gpu_instance_id,
                        mig.compute_instance_id,
                    )
                });
                if let (Some(major), Some(caps)) = (nvidia::caps_major(sysfs_root), caps) {
                    out.extend(caps.map(|m| dev(major, m)));
                }
            }
            Vendor::Amd => out.extend(
                drm_minors(sysfs_root, g)
                    .into_iter()
                    .map(|m| dev(DRM_MAJOR, m)),
            ),
        }
    }
    if gpus.iter().any(|g| g.vendor == Vendor::Nvidia) {
        out.push(dev(nvidia::GPU_MAJOR, nvidia::CTL_MINOR));
        out.push(dev(nvidia::GPU_MAJOR, nvidia::MODESET_MINOR));
        if let Some(uvm) = nvidia::char_major(sysfs_root, nvidia::UVM_DEVICES_NAME) {
            out.push(dev(uvm, nvidia::UVM_MINOR));
            out.push(dev(uvm, nvidia::UVM_MINOR + 1));
        }
    }
    if gpus.iter().any(|g| g.vendor == Vendor::Amd) {
        out.extend(nvidia::char_major(sysfs_root, "kfd").map(|m| dev(m, 0)));
    }
    out.sort();
    out.dedup();
    out
}

/// Whether the node has GPU devices outside `mine` to keep the job from: a GPU of the plan that
/// is not the job's and whose node numbers the driver's files give, or NVIDIA's capability
/// driver (MIG's `config` and `monitor`, other MIG devices'), which every node with the
/// `nvidia` module has. Where there are none, a job on cgroup v2 gets no device rules (nor the
/// warning that it has none).
pub fn other_gpu_devices_exist(sysfs_root: &Path, plan: &Plan, mine: &Slice) -> bool {
    let my_gpus = mine.gpus();
    let mine: Vec<&str> = my_gpus.iter().map(|g| g.pci_bus_id.as_str()).collect();
    let other = |g: &SliceGpu| match g.vendor {
        Vendor::Nvidia => nvidia::device_minor(sysfs_root, &g.pci_bus_id).is_some(),
        Vendor::Amd => !drm_minors(sysfs_root, g).is_empty(),
    };
    nvidia::caps_major(sysfs_root).is_some()
        || plan
            .slices
            .iter()
            .flat_map(Slice::gpus)
            .filter(|g| !mine.contains(&g.pci_bus_id.as_str()))
            .any(other)
}

/// The DRM minors of an AMD GPU's `card<n>` and `renderD<n>`, from its sysfs `drm` directory.
fn drm_minors(sysfs_root: &Path, g: &SliceGpu) -> Vec<u32> {
    let drm = sysfs_root
        .join("sys/bus/pci/devices")
        .join(&g.pci_bus_id)
        .join("drm");
    std::fs::read_dir(drm)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_prefix("renderD")
                .or_else(|| name.strip_prefix("card"))
                .and_then(|n| n.parse().ok())
        })
        .collect()
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

    /// A node's driver files: GPUs at minors 0 and 1 (`0000:18:00.0`, `0000:2a:00.0`), an AMD
    /// GPU (`0000:0c:00.0`, card2 and renderD130) with `kfd` at 234, `nvidia-uvm` at 511, and
    /// with `mig_table` the capability driver at 508 with the driver's whole table.
    fn driver_files(r: &Path, mig_table: bool) {
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
        if mig_table {
            kernelkite_testkit::fake_nvml::write_mig_minors(r, 508).unwrap();
        } else {
            let _ = std::fs::remove_dir_all(r.join("proc/driver/nvidia-caps"));
        }
        let caps = if mig_table { "508 nvidia-caps\n" } else { "" };
        std::fs::write(
            r.join("proc/devices"),
            format!("Character devices:\n  1 mem\n195 nvidia\n234 kfd\n{caps}511 nvidia-uvm\n"),
        )
        .unwrap();
    }

    fn one(i: u32, g: SliceGpu) -> Slice {
        Slice {
            index: i,
            gpu: Some(g),
            extra_gpus: vec![],
            cpus: vec![i],
            mems: vec![0],
            memory_bytes: 1,
        }
    }

    fn mig_gpu(bus: &str, gi: u32) -> SliceGpu {
        let mut g = nv(bus, Some(&format!("MIG-{gi}")));
        g.mig = Some(kernelkite_topology::plan::MigInstance {
            uuid: format!("MIG-{gi}"),
            gpu_instance_id: gi,
            compute_instance_id: 0,
            memory_bytes: 10 << 30,
        });
        g
    }

    fn amd_gpu() -> SliceGpu {
        let mut amd = nv("0000:0c:00.0", None);
        amd.vendor = Vendor::Amd;
        amd
    }

    #[test]
    fn a_job_may_open_its_own_nodes_and_nothing_else_whatever_the_table() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let dev = |major, minor| CharDevice { major, minor };
        let shared = [dev(195, 254), dev(195, 255), dev(511, 0), dev(511, 1)];
        for mig_table in [false, true] {
            driver_files(r, mig_table);
            // A whole GPU: its node and the driver's shared ones, never the other GPU's.
            let whole = job_devices(r, &one(1, nv("0000:2a:00.0", None)));
            let mut want = vec![dev(195, 1)];
            want.extend(shared);
            assert_eq!(whole, want, "table {mig_table}");
            // AMD: its card and render node, and kfd.
            assert_eq!(
                job_devices(r, &one(2, amd_gpu())),
                [dev(226, 2), dev(226, 130), dev(234, 0)]
            );
            // CPU-only: nothing beyond the base set.
            let mut cpu = one(3, nv("0000:2a:00.0", None));
            cpu.gpu = None;
            assert!(job_devices(r, &cpu).is_empty());
        }
        // A MIG device of GPU 1 (gpu1/gi3/ci0): its two capabilities as the driver's table
        // numbers them (165, 166) and no other of the table's 4,322.
        let mig = job_devices(r, &one(1, mig_gpu("0000:2a:00.0", 3)));
        let mut want = vec![dev(195, 1)];
        want.extend(shared);
        want.extend([dev(508, 165), dev(508, 166)]);
        want.sort();
        assert_eq!(mig, want);
        assert!(mig.len() <= 8, "{mig:?}");
        // Without the table (or past it) a MIG device gets no capability at all.
        driver_files(r, false);
        assert!(!job_devices(r, &one(1, mig_gpu("0000:2a:00.0", 3)))
            .iter()
            .any(|d| d.major == 508));
    }

    #[test]
    fn device_rules_are_set_only_where_another_gpu_is_there_to_keep_out() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        driver_files(r, false);
        let plan = Plan {
            slices: vec![
                one(0, nv("0000:18:00.0", None)),
                one(1, nv("0000:2a:00.0", None)),
                one(2, amd_gpu()),
            ],
            reserved_cpus: vec![],
            warnings: vec![],
        };
        assert!(other_gpu_devices_exist(r, &plan, &plan.slices[0]));
        // Alone on the node (the others' driver files unread): nothing to keep out.
        let alone = Plan {
            slices: vec![
                one(0, nv("0000:18:00.0", None)),
                one(1, nv("0000:ff:00.0", None)),
            ],
            reserved_cpus: vec![],
            warnings: vec![],
        };
        assert!(!other_gpu_devices_exist(r, &alone, &alone.slices[0]));
        // The capability driver is there on every node with the nvidia module: MIG's
        // `config` and `monitor` are always to keep out.
        driver_files(r, true);
        assert!(other_gpu_devices_exist(r, &alone, &alone.slices[0]));
    }

    /// The sandbox's private `/dev` and the cgroup's allow list are two lists of one thing:
    /// every node the sandbox binds (a job's GPU nodes, `STANDARD_NODES`, the devpts
    /// instance's `ptmx` and terminals) must open under the job's device rules, or the job
    /// would find its own GPU refused. The GPU nodes' numbers come from the driver's naming
    /// (nvidia-modprobe: `nvidia<minor>` 195:minor, `nvidiactl` 195:255, `nvidia-modeset`
    /// 195:254, `nvidia-uvm`/`-tools` uvm:0/1, `nvidia-caps/nvidia-cap<N>` caps:N; amdgpu:
    /// `dri/card<n>`/`renderD<n>` 226:n, `kfd` kfd:0); the standard nodes' from this
    /// machine's own `/dev`.
    #[test]
    fn every_node_the_sandbox_binds_is_one_the_cgroup_allows() {
        use crate::cgroup::BASE_DEVICE_RULES;
        use crate::sandbox::mounts::STANDARD_NODES;
        use crate::sandbox::spec::gpu_device_nodes;
        use std::os::unix::fs::FileTypeExt;
        use std::os::unix::fs::MetadataExt;
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        driver_files(r, true);
        // Every node a driver could make, so that the sandbox leaves out none of its own.
        let dev = r.join("dev");
        std::fs::create_dir_all(dev.join("dri")).unwrap();
        std::fs::create_dir_all(dev.join("nvidia-caps")).unwrap();
        let mut names: Vec<String> = [
            "nvidia0",
            "nvidia1",
            "nvidiactl",
            "nvidia-modeset",
            "nvidia-uvm",
            "nvidia-uvm-tools",
            "kfd",
            "dri/card2",
            "dri/renderD130",
        ]
        .map(String::from)
        .to_vec();
        names.extend((1..=4322).map(|n| format!("nvidia-caps/nvidia-cap{n}")));
        for n in &names {
            std::fs::write(dev.join(n), "").unwrap();
        }
        let number = |target: &Path| -> (u32, u32) {
            let t = target.to_str().unwrap();
            let tail = |p: &str| t.strip_prefix(p).and_then(|n| n.parse::<u32>().ok());
            match t {
                "nvidiactl" => (195, 255),
                "nvidia-modeset" => (195, 254),
                "nvidia-uvm" => (511, 0),
                "nvidia-uvm-tools" => (511, 1),
                "kfd" => (234, 0),
                _ => {
                    if let Some(n) = tail("nvidia-caps/nvidia-cap") {
                        (508, n)
                    } else if let Some(n) = tail("dri/renderD").or_else(|| tail("dri/card")) {
                        (226, n)
                    } else if let Some(n) = tail("nvidia") {
                        (195, n)
                    } else {
                        panic!("the sandbox binds {t}, which this test cannot number: add it here and to job_devices")
                    }
                }
            }
        };
        let slices = [
            one(0, nv("0000:18:00.0", None)),
            one(1, mig_gpu("0000:2a:00.0", 3)),
            one(2, amd_gpu()),
            Slice {
                extra_gpus: vec![nv("0000:2a:00.0", None), amd_gpu()],
                ..one(3, nv("0000:18:00.0", None))
            },
        ];
        for slice in &slices {
            let bound: Vec<(u32, u32)> = gpu_device_nodes(r, &dev, slice)
                .iter()
                .map(|d| number(&d.target))
                .collect();
            let mut allowed: Vec<(u32, u32)> = job_devices(r, slice)
                .iter()
                .map(|d| (d.major, d.minor))
                .collect();
            allowed.sort_unstable();
            let mut sorted = bound.clone();
            sorted.sort_unstable();
            // Each bound node is allowed, and nothing else is: the lists are the same.
            assert_eq!(sorted, allowed, "slice {}", slice.index);
        }
        // The base rules: each standard node as this machine's /dev numbers it, and the
        // devpts instance's ptmx (5:2) and terminals (136:N).
        let allows = |major: u32, minor: u32| {
            BASE_DEVICE_RULES
                .iter()
                .any(|r| *r == format!("c {major}:{minor} rwm") || *r == format!("c {major}:* rwm"))
        };
        let host = |p: &str| {
            let m = std::fs::metadata(p).unwrap();
            assert!(m.file_type().is_char_device(), "{p}");
            let rdev = m.rdev();
            (libc::major(rdev), libc::minor(rdev))
        };
        for n in STANDARD_NODES {
            let (major, minor) = host(&format!("/dev/{n}"));
            assert!(allows(major, minor), "/dev/{n} is {major}:{minor}");
        }
        let (major, minor) = host("/dev/ptmx");
        assert!(allows(major, minor), "/dev/ptmx is {major}:{minor}");
        assert!(allows(136, 0) && allows(136, 4095));
        assert_eq!(BASE_DEVICE_RULES.len(), STANDARD_NODES.len() + 2);
    }
}
