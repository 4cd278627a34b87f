//! The node's GPUs as devices: the host numbers of the job's GPUs, and its own GPU nodes, one
//! list that the sandbox's `/dev` (by path) and its cgroup's device rules (by number) are made
//! from.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kernelkite_topology::plan::{Plan, Slice, SliceGpu, Vendor};

use kernelkite_sys::nvidia;

use crate::cgroup::CharDevice;
use crate::sandbox::spec::DeviceNode;

/// The DRM subsystem's major (`/dev/dri/card<n>`, `renderD<n>`; `DRM_MAJOR` in the kernel).
pub const DRM_MAJOR: u32 = 226;

/// One of a slice's GPU device nodes: its path under `/dev`, and its number where the driver's
/// files give it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuNode {
    /// Under `/dev` (`nvidia1`, `nvidia-caps/nvidia-cap165`, `dri/renderD130`).
    pub path: PathBuf,
    /// Its character device; `None` where the driver's files do not number it.
    pub device: Option<CharDevice>,
}

/// The one list of `slice`'s own GPU nodes, from the driver's files under `sysfs_root`, that
/// both the sandbox's private `/dev` ([`gpu_device_nodes`]: by path) and the job's device
/// rules ([`job_devices`]: by number) are made from: NVIDIA `nvidia<minor>` (195, minor from
/// `/proc/driver/nvidia/gpus/<bdf>/information`), the driver's shared `nvidiactl` (195:255),
/// `nvidia-modeset` (195:254), `nvidia-uvm` and `nvidia-uvm-tools` (the `nvidia-uvm` major of
/// `/proc/devices`, minors 0 and 1), and a MIG device's two capabilities under `nvidia-caps/`
/// (the `nvidia-caps` major, minors from `mig-minors`), no other; AMD `kfd` (its major, minor
/// 0) and each GPU's `dri/card<n>` and `dri/renderD<n>` (226:n). A handful, whatever the node's
/// size or the driver's table; other GPUs' nodes, other MIG devices' capabilities and MIG's
/// `config`/`monitor` never.
pub fn gpu_nodes(sysfs_root: &Path, slice: &Slice) -> Vec<GpuNode> {
    let dev = |major, minor| CharDevice { major, minor };
    let gpus = slice.gpus();
    let mut out = Vec::new();
    let mut node = |path: &Path, device: Option<CharDevice>| {
        out.push(GpuNode {
            path: path.to_path_buf(),
            device,
        })
    };
    for g in &gpus {
        match g.vendor {
            Vendor::Nvidia => {
                let minor = nvidia::device_minor(sysfs_root, &g.pci_bus_id);
                if let Some(m) = minor {
                    node(
                        Path::new(&format!("nvidia{m}")),
                        Some(dev(nvidia::GPU_MAJOR, m)),
                    );
                }
                let caps = minor.zip(g.mig.as_ref()).and_then(|(m, mig)| {
                    nvidia::mig_cap_minors(
                        sysfs_root,
                        m,
                        mig.gpu_instance_id,
                        mig.compute_instance_id,
                    )
                });
                let caps_major = nvidia::caps_major(sysfs_root);
                for cap in caps.into_iter().flatten() {
                    node(&nvidia::cap_node(cap), caps_major.map(|m| dev(m, cap)));
                }
            }
            Vendor::Amd => {
                for (name, minor) in drm_nodes(sysfs_root, g) {
                    node(&Path::new("dri").join(name), Some(dev(DRM_MAJOR, minor)));
                }
            }
        }
    }
    if gpus.iter().any(|g| g.vendor == Vendor::Nvidia) {
        node(
            Path::new("nvidiactl"),
            Some(dev(nvidia::GPU_MAJOR, nvidia::CTL_MINOR)),
        );
        node(
            Path::new("nvidia-modeset"),
            Some(dev(nvidia::GPU_MAJOR, nvidia::MODESET_MINOR)),
        );
        let uvm = nvidia::char_major(sysfs_root, nvidia::UVM_DEVICES_NAME);
        node(
            Path::new("nvidia-uvm"),
            uvm.map(|m| dev(m, nvidia::UVM_MINOR)),
        );
        node(
            Path::new("nvidia-uvm-tools"),
            uvm.map(|m| dev(m, nvidia::UVM_MINOR + 1)),
        );
    }
    if gpus.iter().any(|g| g.vendor == Vendor::Amd) {
        node(
            Path::new("kfd"),
            nvidia::char_major(sysfs_root, "kfd").map(|m| dev(m, 0)),
        );
    }
    out
}

/// The character devices of `slice`'s own GPU nodes ([`gpu_nodes`] that have a number),
/// sorted, each once: the only GPU devices its cgroup allows.
pub fn job_devices(sysfs_root: &Path, slice: &Slice) -> Vec<CharDevice> {
    let mut out: Vec<CharDevice> = gpu_nodes(sysfs_root, slice)
        .into_iter()
        .filter_map(|n| n.device)
        .collect();
    out.sort();
    out.dedup();
    out
}

/// `slice`'s own GPU nodes ([`gpu_nodes`]) that exist under `dev_root`, as the sandbox binds
/// them into the job's `/dev`, each once, by path.
pub fn gpu_device_nodes(sysfs_root: &Path, dev_root: &Path, slice: &Slice) -> Vec<DeviceNode> {
    let mut out: Vec<DeviceNode> = Vec::new();
    for n in gpu_nodes(sysfs_root, slice) {
        let source = dev_root.join(&n.path);
        if std::fs::symlink_metadata(&source).is_ok() && !out.iter().any(|d| d.target == n.path) {
            out.push(DeviceNode {
                source,
                target: n.path,
            });
        }
    }
    out.sort_by(|a, b| a.target.cmp(&b.target));
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
        Vendor::Amd => !drm_nodes(sysfs_root, g).is_empty(),
    };
    nvidia::caps_major(sysfs_root).is_some()
        || plan
            .slices
            .iter()
            .flat_map(Slice::gpus)
            .filter(|g| !mine.contains(&g.pci_bus_id.as_str()))
            .any(other)
}

/// An AMD GPU's `card<n>` and `renderD<n>` (name and DRM minor `n`), from its sysfs `drm`
/// directory, sorted by name.
fn drm_nodes(sysfs_root: &Path, g: &SliceGpu) -> Vec<(String, u32)> {
    let drm = sysfs_root
        .join("sys/bus/pci/devices")
        .join(&g.pci_bus_id)
        .join("drm");
    let mut out: Vec<(String, u32)> = std::fs::read_dir(drm)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let minor = name
                .strip_prefix("renderD")
                .or_else(|| name.strip_prefix("card"))?
                .parse()
                .ok()?;
            Some((name, minor))
        })
        .collect();
    out.sort();
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
    use crate::job::test_support::{nv, slice_of};
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
            // The node's tree, once per fixture (thousands of files), in memory.
            let root = kernelkite_testkit_leaf::scratch();
            kernelkite_topology::fakesys::mi300x_8()
                .write_to(root.path())
                .unwrap();
            kernelkite_testkit_leaf::kfd::write_mi300x(root.path(), &[], with_uuids).unwrap();
            let topo = Topology::discover(root.path()).unwrap();
            for gpus_per_slice in [1, 2] {
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
                    let job = kernelkite_testkit_leaf::scratch();
                    let own: Vec<usize> = (0..8)
                        .filter(|i| mine.contains(&kernelkite_testkit_leaf::kfd::mi300x_bus_id(*i)))
                        .collect();
                    kernelkite_testkit_leaf::kfd::write_mi300x(job.path(), &own, with_uuids)
                        .unwrap();
                    let host = exports_for(slice, &device_indices(&p, slice), true);
                    let container = crate::docker::container_device_env(slice);
                    // The sandbox off: the host's /dev, every render node.
                    let bare = kernelkite_testkit_leaf::scratch();
                    let every: Vec<usize> = (0..8).collect();
                    kernelkite_testkit_leaf::kfd::write_mi300x(bare.path(), &every, with_uuids)
                        .unwrap();
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
            kernelkite_testkit_leaf::fake_nvml::write_mig_minors(r, 508).unwrap();
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
    fn only_the_job_s_gpu_nodes_and_the_shared_ones_are_listed() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let dev = r.join("dev");
        std::fs::create_dir_all(dev.join("dri")).unwrap();
        std::fs::create_dir_all(dev.join("nvidia-caps")).unwrap();
        for n in [
            "nvidia0",
            "nvidia1",
            "nvidiactl",
            "nvidia-uvm",
            "kfd",
            "dri/card1",
            "dri/renderD129",
            "dri/card2",
            "dri/renderD130",
        ] {
            std::fs::write(dev.join(n), "").unwrap();
        }
        for (bus, minor) in [("0000:18:00.0", 0), ("0000:2a:00.0", 1)] {
            let d = r.join("proc/driver/nvidia/gpus").join(bus);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("information"), format!("Device Minor: \t {minor}\n")).unwrap();
        }
        for (bus, n) in [("0000:0c:00.0", 1), ("0000:0d:00.0", 2)] {
            let d = r.join("sys/bus/pci/devices").join(bus).join("drm");
            std::fs::create_dir_all(d.join(format!("card{n}"))).unwrap();
            std::fs::create_dir_all(d.join(format!("renderD{}", 128 + n))).unwrap();
        }
        let nv = SliceGpu {
            vendor: Vendor::Nvidia,
            pci_bus_id: "0000:2a:00.0".into(),
            uuid: None,
            numa_node: Some(0),
            mig: None,
        };
        let targets = |s: &Slice| -> Vec<String> {
            gpu_device_nodes(r, &dev, s)
                .iter()
                .map(|d| d.target.display().to_string())
                .collect()
        };
        // A whole GPU needs no capability: `nvidia-caps/` (MIG's config and monitor, other
        // jobs' MIG devices) stays out.
        assert_eq!(
            targets(&slice_of(vec![nv.clone()])),
            ["nvidia-uvm", "nvidia1", "nvidiactl"]
        );
        // A MIG device of GPU 1: its GPU's node and its own two capabilities, no other.
        kernelkite_testkit_leaf::fake_nvml::write_mig_minors(r, 508).unwrap();
        // The driver's numbers: gpu1/gi3 165 and 166, gpu1/gi5 183 and 184.
        for cap in [1, 2, 165, 166, 183, 184] {
            std::fs::write(dev.join(format!("nvidia-caps/nvidia-cap{cap}")), "").unwrap();
        }
        let mig = |gi: u32| SliceGpu {
            uuid: Some(format!("MIG-{gi}")),
            mig: Some(kernelkite_topology::plan::MigInstance {
                uuid: format!("MIG-{gi}"),
                gpu_instance_id: gi,
                compute_instance_id: 0,
                memory_bytes: 10 << 30,
            }),
            ..nv.clone()
        };
        assert_eq!(
            targets(&slice_of(vec![mig(3)])),
            [
                "nvidia-caps/nvidia-cap165",
                "nvidia-caps/nvidia-cap166",
                "nvidia-uvm",
                "nvidia1",
                "nvidiactl"
            ]
        );
        assert!(targets(&slice_of(vec![mig(5)])).contains(&"nvidia-caps/nvidia-cap184".to_string()));
        // A MIG device the driver does not list (GPU instance 15, past its table) gets no
        // capability, not someone else's.
        assert_eq!(
            targets(&slice_of(vec![mig(15)])),
            ["nvidia-uvm", "nvidia1", "nvidiactl"]
        );
        let amd = SliceGpu {
            vendor: Vendor::Amd,
            pci_bus_id: "0000:0d:00.0".into(),
            mig: None,
            ..nv
        };
        assert_eq!(
            targets(&slice_of(vec![amd])),
            ["dri/card2", "dri/renderD130", "kfd"]
        );
        let nodes = gpu_device_nodes(r, &dev, &slice_of(vec![]));
        assert!(nodes.is_empty());
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
    fn another_gpu_to_keep_out_is_found_by_its_driver_files() {
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
