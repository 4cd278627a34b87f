//! The NVIDIA driver's device files: which `/dev` nodes a GPU or a MIG device needs, read from
//! the driver's own files under a root (`/` on a live machine, a fixture in tests).
//!
//! * A GPU is `/dev/nvidia<minor>`, major 195; the minor is `Device Minor` in
//!   `/proc/driver/nvidia/gpus/<bus id>/information`.
//! * A MIG device also needs two capability nodes, its GPU instance's and its compute
//!   instance's: `/dev/nvidia-caps/nvidia-cap<N>`, whose minors the driver lists in
//!   `/proc/driver/nvidia-caps/mig-minors` as `gpu<minor>/gi<id>/access <N>` and
//!   `gpu<minor>/gi<id>/ci<id>/access <N>`, and whose major is `nvidia-caps` in
//!   `/proc/devices` (NVIDIA's MIG user guide, "Device Nodes and Capabilities"). The same
//!   file lists `config` and `monitor`, which create and watch MIG instances: a job never
//!   gets those.

use std::path::{Path, PathBuf};

/// The major number of `/dev/nvidia<minor>` and `nvidiactl` (fixed by the driver).
pub const GPU_MAJOR: u32 = 195;

/// The directory of the capability nodes under `/dev`.
pub const CAPS_DIR: &str = "nvidia-caps";

/// A GPU's `Device Minor` from the driver's `information` file under `root`.
pub fn device_minor(root: &Path, pci_bus_id: &str) -> Option<u32> {
    let info = root
        .join("proc/driver/nvidia/gpus")
        .join(pci_bus_id)
        .join("information");
    std::fs::read_to_string(info).ok().and_then(|t| {
        t.lines()
            .find_map(|l| l.strip_prefix("Device Minor:")?.trim().parse().ok())
    })
}

/// The capability minors of a MIG device: its GPU instance's, then its compute instance's,
/// for the GPU whose device minor is `gpu_minor`. `None` when the driver lists either not.
pub fn mig_cap_minors(root: &Path, gpu_minor: u32, gi: u32, ci: u32) -> Option<[u32; 2]> {
    let text = std::fs::read_to_string(root.join("proc/driver/nvidia-caps/mig-minors")).ok()?;
    let find = |name: &str| {
        text.lines().find_map(|l| {
            let (k, v) = l.trim().split_once(char::is_whitespace)?;
            (k == name).then(|| v.trim().parse().ok()).flatten()
        })
    };
    let gi_cap = find(&format!("gpu{gpu_minor}/gi{gi}/access"))?;
    let ci_cap = find(&format!("gpu{gpu_minor}/gi{gi}/ci{ci}/access"))?;
    Some([gi_cap, ci_cap])
}

/// [`mig_cap_minors`] for the MIG device `gi`/`ci` of the GPU at `pci_bus_id`, its device
/// minor read from the driver's files ([`device_minor`]).
pub fn mig_device_caps(root: &Path, pci_bus_id: &str, gi: u32, ci: u32) -> Option<[u32; 2]> {
    mig_cap_minors(root, device_minor(root, pci_bus_id)?, gi, ci)
}

/// Every capability minor the driver lists in `mig-minors` (MIG's `config` and `monitor`, and
/// every GPU and compute instance's), for denying all but a job's own.
pub fn all_mig_cap_minors(root: &Path) -> Vec<u32> {
    let Ok(text) = std::fs::read_to_string(root.join("proc/driver/nvidia-caps/mig-minors")) else {
        return Vec::new();
    };
    let mut out: Vec<u32> = text
        .lines()
        .filter_map(|l| {
            let (_, v) = l.trim().split_once(char::is_whitespace)?;
            v.trim().parse().ok()
        })
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// The major number of the capability nodes (`nvidia-caps` in `/proc/devices`).
pub fn caps_major(root: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(root.join("proc/devices")).ok()?;
    text.lines().find_map(|l| {
        let (n, name) = l.trim().split_once(char::is_whitespace)?;
        (name.trim() == CAPS_DIR).then(|| n.parse().ok()).flatten()
    })
}

/// Whether the driver hands capabilities out through `/proc/driver/nvidia/capabilities`
/// instead of `/dev/nvidia-caps` (the `nvidia` module's `nv_cap_enable_devfs=0`, the R450
/// default): files whose permissions alone guard them, and which a job's `/proc` shows, so a
/// job could open any MIG device's capability.
pub fn caps_in_procfs(root: &Path) -> bool {
    std::fs::read_to_string(root.join("sys/module/nvidia/parameters/nv_cap_enable_devfs"))
        .is_ok_and(|v| v.trim() == "0")
}

/// A capability node's path under `/dev`: `nvidia-caps/nvidia-cap<minor>`.
pub fn cap_node(minor: u32) -> PathBuf {
    Path::new(CAPS_DIR).join(format!("nvidia-cap{minor}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelkite_testkit::fake_nvml::write_mig_minors;

    #[test]
    fn mig_devices_name_their_two_capabilities_and_nothing_else() {
        let root = tempfile::tempdir().unwrap();
        write_mig_minors(root.path(), 508, &[(1, 3, 0, 30, 31), (1, 5, 0, 50, 51)]).unwrap();
        assert_eq!(mig_cap_minors(root.path(), 1, 3, 0), Some([30, 31]));
        assert_eq!(mig_cap_minors(root.path(), 1, 5, 0), Some([50, 51]));
        assert_eq!(mig_cap_minors(root.path(), 0, 3, 0), None, "another GPU's");
        assert_eq!(mig_cap_minors(root.path(), 1, 3, 1), None, "no such CI");
        assert_eq!(all_mig_cap_minors(root.path()), [1, 2, 30, 31, 50, 51]);
        assert_eq!(caps_major(root.path()), Some(508));
        assert_eq!(cap_node(31), Path::new("nvidia-caps/nvidia-cap31"));
        let bare = tempfile::tempdir().unwrap();
        assert_eq!(mig_cap_minors(bare.path(), 1, 3, 0), None);
        assert!(all_mig_cap_minors(bare.path()).is_empty());
        assert_eq!(caps_major(bare.path()), None);
    }
}
