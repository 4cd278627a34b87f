//! Docker mode: the `docker run` argument vector that holds a container to the job's slice.
//!
//! GPUs are handed over as device requests (`--gpus device=<uuid>`), so other GPUs are not in
//! the container at all; an environment variable inside it cannot bring them back. Variables
//! are passed by name only (`--env NAME`), so values (tokens) never appear in a process list.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kernelkite_topology::cpulist::format_cpu_list;
use kernelkite_topology::plan::{Slice, SliceGpu, Vendor};

/// Everything `docker run` needs to know about the job.
#[derive(Debug, Clone)]
pub struct DockerRun {
    /// The job (names the container).
    pub job_id: String,
    /// The step's image.
    pub image: String,
    /// The job's slice: GPUs, CPUs, memory nodes, memory limit.
    pub slice: Slice,
    /// `--pids-limit`.
    pub pids_limit: u32,
    /// Whether the container may reach the network (else `--network none`).
    pub network: bool,
    /// Host checkout mounted at `workdir`, when mounting is on.
    pub checkout: Option<PathBuf>,
    /// Where the checkout is mounted and the command runs.
    pub workdir: String,
    /// Render nodes (`/dev/dri/renderD128`) of AMD GPUs, in slice order.
    pub amd_render_nodes: Vec<PathBuf>,
    /// Groups (numeric) the container's user needs for the GPU device nodes (AMD); `video` is
    /// used when none could be read.
    pub device_groups: Vec<u32>,
    /// The container's user and group (the job user's numbers on the host, so the mounted
    /// checkout's ownership means the same inside); `None` keeps the image's user.
    pub user: Option<(u32, u32)>,
    /// `--shm-size` in bytes: within the job's memory limit.
    pub shm_size: u64,
    /// Mount the checkout's `.git` read-only over the writable checkout.
    pub git_read_only: bool,
    /// Names of the variables passed into the container, sorted.
    pub env_names: Vec<String>,
    /// Values set inside the container that differ from the host's (device numbering).
    pub env_overrides: BTreeMap<String, String>,
    /// The step's `docker-args` (already checked).
    pub extra_args: Vec<String>,
    /// The step's command (run with `/bin/sh -e -c`).
    pub command: String,
}

/// The container's name, so `pre-exit` can remove a container the agent lost track of.
pub fn container_name(job_id: &str) -> String {
    format!("kernelkite-{job_id}")
}

/// The `--gpus` value: UUIDs where every GPU has one, else host indices. Several devices are
/// quoted because the docker CLI parses the value as CSV.
pub fn gpus_flag(gpus: &[&SliceGpu], host_indices: &[u32]) -> String {
    let ids = uuids_or_indices(gpus, host_indices);
    if ids.len() == 1 {
        format!("device={}", ids[0])
    } else {
        format!("\"device={}\"", ids.join(","))
    }
}

/// Variables never passed into the container: agent credentials, and NVIDIA runtime variables,
/// which the NVIDIA container runtime reads to decide which GPUs to mount.
pub fn is_withheld(name: &str) -> bool {
    crate::sandbox::environ::withheld(name) || name.starts_with("NVIDIA_")
}

/// The names of the job's variables that go into the container: the host-mode sandbox's
/// allow-list (`sandbox::environ`: kernelbot's, the job's identity, the device variables)
/// and whatever the step lists in `environment`.
pub fn pass_through_names(job_env: &BTreeMap<String, String>, extra: &[String]) -> Vec<String> {
    // The host-mode sandbox's allow-list, less what the image sets for itself (`PATH`).
    let mut names: Vec<String> = job_env
        .keys()
        .filter(|k| *k != "PATH" && crate::sandbox::environ::passed(k, extra))
        .filter(|k| !is_withheld(k))
        .cloned()
        .collect();
    names.sort();
    names.dedup();
    names
}

/// GPU indices as the visibility variables list them: `2,3`.
pub fn index_list(indices: &[u32]) -> String {
    indices
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The GPUs' UUIDs when every one has one, else `indices`.
fn uuids_or_indices(gpus: &[&SliceGpu], indices: &[u32]) -> Vec<String> {
    if gpus.iter().all(|g| g.uuid.is_some()) {
        gpus.iter().filter_map(|g| g.uuid.clone()).collect()
    } else {
        indices.iter().map(u32::to_string).collect()
    }
}

/// The variables that say which GPUs a job sees, by the first GPU's vendor: NVIDIA's
/// `CUDA_VISIBLE_DEVICES` (UUIDs when every GPU has one, else `indices`) and
/// `CUDA_DEVICE_ORDER`, or AMD's `ROCR_VISIBLE_DEVICES` alone. Empty without GPUs.
///
/// AMD (the rules and their source: `kernelkite_sys::kfd`): `ROCR_VISIBLE_DEVICES` names the
/// GPUs by UUID (`GPU-` and KFD's `unique_id`) when every one has one, which holds whatever
/// the job's `/dev` holds, else by `indices` (the caller's: numbered as ROCr numbers them in
/// the job, see `job::exports::exports_for`). `HIP_VISIBLE_DEVICES` is not set: HIP indexes
/// what ROCr surfaced, so host indices there hid every GPU but the first.
pub fn visible_devices_env(gpus: &[&SliceGpu], indices: &[u32]) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    let Some(first) = gpus.first() else {
        return env;
    };
    match first.vendor {
        Vendor::Nvidia => {
            let ids = uuids_or_indices(gpus, indices).join(",");
            env.insert("CUDA_VISIBLE_DEVICES".into(), ids);
            env.insert("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into());
        }
        Vendor::Amd => {
            let ids = uuids_or_indices(gpus, indices).join(",");
            env.insert("ROCR_VISIBLE_DEVICES".into(), ids);
        }
    }
    env
}

/// Device variables as seen from inside the container, where the job's GPUs are numbered from
/// zero. UUIDs stay valid; indices do not.
pub fn container_device_env(slice: &Slice) -> BTreeMap<String, String> {
    let gpus = slice.gpus();
    let local: Vec<u32> = (0..gpus.len() as u32).collect();
    visible_devices_env(&gpus, &local)
}

/// The AMD render node of a GPU: `<sysfs>/sys/bus/pci/devices/<bdf>/drm/renderD*`.
pub fn amd_render_node(sysfs_root: &Path, bus_id: &str) -> Option<PathBuf> {
    let drm = sysfs_root
        .join("sys/bus/pci/devices")
        .join(bus_id)
        .join("drm");
    let mut nodes: Vec<String> = std::fs::read_dir(drm)
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with("renderD"))
        .collect();
    nodes.sort();
    nodes.first().map(|n| Path::new("/dev/dri").join(n))
}

/// The flags that give the container the slice's GPUs: `--gpus` for NVIDIA; for AMD, the
/// device nodes and the groups that may open them.
fn gpu_args(r: &DockerRun, host_indices: &[u32]) -> Vec<String> {
    let s = |x: &str| x.to_string();
    let mut a = Vec::new();
    let gpus = r.slice.gpus();
    if let Some(first) = gpus.first() {
        match first.vendor {
            Vendor::Nvidia => {
                a.push(s("--gpus"));
                a.push(gpus_flag(&gpus, host_indices));
            }
            Vendor::Amd => {
                a.push(s("--device"));
                a.push(s("/dev/kfd"));
                for node in &r.amd_render_nodes {
                    a.push(s("--device"));
                    a.push(node.display().to_string());
                }
                if r.device_groups.is_empty() {
                    a.push(s("--group-add"));
                    a.push(s("video"));
                }
                for g in &r.device_groups {
                    a.push(s("--group-add"));
                    a.push(g.to_string());
                }
            }
        }
    }
    a
}

/// The argument vector after `docker`.
pub fn run_args(r: &DockerRun, host_indices: &[u32]) -> Vec<String> {
    let s = |x: &str| x.to_string();
    let mut a = vec![
        s("run"),
        s("--rm"),
        s("--init"),
        s("--name"),
        container_name(&r.job_id),
        s("--label"),
        format!("kernelkite.job={}", r.job_id),
    ];
    a.extend(gpu_args(r, host_indices));
    let mem = r.slice.memory_bytes.to_string();
    a.extend([
        s("--cpuset-cpus"),
        format_cpu_list(&r.slice.cpus),
        s("--cpuset-mems"),
        format_cpu_list(&r.slice.mems),
        s("--memory"),
        mem.clone(),
        s("--memory-swap"),
        mem,
        s("--pids-limit"),
        r.pids_limit.to_string(),
    ]);
    if let Some((uid, gid)) = r.user {
        a.push(s("--user"));
        a.push(format!("{uid}:{gid}"));
    }
    // No capabilities and no way to gain any; SysV IPC, /dev/shm and the cgroup namespace the
    // container's own (docker mounts the cgroup file system read-only for a container that is
    // not privileged; a private cgroup namespace shows it only its own cgroup).
    a.extend([
        s("--cap-drop"),
        s("ALL"),
        s("--security-opt"),
        s("no-new-privileges"),
        s("--ipc"),
        s("private"),
        s("--shm-size"),
        r.shm_size.to_string(),
        s("--cgroupns"),
        s("private"),
    ]);
    if !r.network {
        a.push(s("--network"));
        a.push(s("none"));
    }
    if let Some(checkout) = &r.checkout {
        a.push(s("--volume"));
        a.push(format!("{}:{}", checkout.display(), r.workdir));
        if r.git_read_only {
            a.push(s("--volume"));
            a.push(format!(
                "{}:{}/.git:ro",
                checkout.join(".git").display(),
                r.workdir.trim_end_matches('/')
            ));
        }
    }
    a.push(s("--workdir"));
    a.push(r.workdir.clone());
    for name in &r.env_names {
        if !r.env_overrides.contains_key(name) {
            a.push(s("--env"));
            a.push(name.clone());
        }
    }
    for (k, v) in &r.env_overrides {
        a.push(s("--env"));
        a.push(format!("{k}={v}"));
    }
    a.extend(r.extra_args.iter().cloned());
    a.push(r.image.clone());
    a.extend([s("/bin/sh"), s("-e"), s("-c"), r.command.clone()]);
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(uuid: Option<&str>) -> SliceGpu {
        SliceGpu {
            vendor: Vendor::Nvidia,
            pci_bus_id: "0000:18:00.0".into(),
            uuid: uuid.map(str::to_string),
            numa_node: Some(0),
            mig: None,
        }
    }

    #[test]
    fn gpus_flag_prefers_uuids_and_quotes_lists() {
        let a = gpu(Some("GPU-a"));
        let b = gpu(Some("GPU-b"));
        assert_eq!(gpus_flag(&[&a], &[3]), "device=GPU-a");
        assert_eq!(gpus_flag(&[&a, &b], &[3, 4]), "\"device=GPU-a,GPU-b\"");
        let n = gpu(None);
        assert_eq!(gpus_flag(&[&a, &n], &[3, 4]), "\"device=3,4\"");
    }

    #[test]
    fn visible_devices_fall_back_to_the_given_indices() {
        let a = gpu(Some("GPU-a"));
        let n = gpu(None);
        let e = visible_devices_env(&[&a, &n], &[3, 4]);
        assert_eq!(e["CUDA_VISIBLE_DEVICES"], "3,4");
        assert_eq!(e["CUDA_DEVICE_ORDER"], "PCI_BUS_ID");
        assert_eq!(
            visible_devices_env(&[&a], &[3])["CUDA_VISIBLE_DEVICES"],
            "GPU-a"
        );
        let amd = |uuid: Option<&str>| SliceGpu {
            vendor: Vendor::Amd,
            ..gpu(uuid)
        };
        // By UUID where every GPU has one, else the indices given; HIP is left alone.
        let (x, y, none) = (amd(Some("GPU-x")), amd(Some("GPU-y")), amd(None));
        let e = visible_devices_env(&[&x, &y], &[2, 3]);
        assert_eq!(e.len(), 1);
        assert_eq!(e["ROCR_VISIBLE_DEVICES"], "GPU-x,GPU-y");
        let e = visible_devices_env(&[&x, &none], &[2, 3]);
        assert_eq!(e["ROCR_VISIBLE_DEVICES"], "2,3");
        assert!(visible_devices_env(&[], &[0]).is_empty());
    }

    #[test]
    fn credentials_and_runtime_variables_stay_out() {
        let env: BTreeMap<String, String> = [
            "BUILDKITE_JOB_ID",
            "BUILDKITE_AGENT_ACCESS_TOKEN",
            "BUILDKITE_AGENT_JOB_API_TOKEN",
            "NVIDIA_VISIBLE_DEVICES",
            "KERNELBOT_PAYLOAD",
            "HOME",
            "HF_TOKEN",
        ]
        .iter()
        .map(|k| (k.to_string(), "v".to_string()))
        .collect();
        let names = pass_through_names(&env, &["HF_TOKEN".into(), "NOT_SET".into()]);
        assert_eq!(
            names,
            vec!["BUILDKITE_JOB_ID", "HF_TOKEN", "KERNELBOT_PAYLOAD"]
        );
    }

    #[test]
    fn render_node_is_found_under_the_device() {
        let root = tempfile::tempdir().unwrap();
        let drm = root.path().join("sys/bus/pci/devices/0000:0c:00.0/drm");
        std::fs::create_dir_all(drm.join("card1")).unwrap();
        std::fs::create_dir_all(drm.join("renderD129")).unwrap();
        assert_eq!(
            amd_render_node(root.path(), "0000:0c:00.0"),
            Some(PathBuf::from("/dev/dri/renderD129"))
        );
        assert_eq!(amd_render_node(root.path(), "0000:0d:00.0"), None);
    }
}
