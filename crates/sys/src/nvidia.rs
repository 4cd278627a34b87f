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

/// `/dev/nvidiactl`'s minor under [`GPU_MAJOR`] (nvidia-modprobe's
/// `NV_CTL_DEVICE_NUM`, `modprobe-utils/nvidia-modprobe-utils.h`).
pub const CTL_MINOR: u32 = 255;

/// `/dev/nvidia-modeset`'s minor under [`GPU_MAJOR`] (nvidia-modprobe's
/// `NV_MODESET_MINOR_DEVICE_NUM`).
pub const MODESET_MINOR: u32 = 254;

/// `/dev/nvidia-uvm`'s minor under the `nvidia-uvm` major; `nvidia-uvm-tools` is the next
/// (`nvidia-modprobe -u -c=0` makes the two at 0 and 1: the uvm module's primary and tools
/// minors).
pub const UVM_MINOR: u32 = 0;

/// The name of the uvm driver's major in `/proc/devices`.
pub const UVM_DEVICES_NAME: &str = "nvidia-uvm";

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
    // The file is the driver's whole table, 4,322 lines `<name> <minor>` on every node (it
    // prints `"%s %d\n"`), read at every job's start: the two lines are found by their text
    // rather than by taking every line apart.
    let find = |name: &str| -> Option<u32> {
        let key = format!("\n{name} ");
        let at = if text.starts_with(&key[1..]) {
            key.len() - 1
        } else {
            text.find(&key)? + key.len()
        };
        text[at..].lines().next()?.trim().parse().ok()
    };
    let gi_cap = find(&format!("gpu{gpu_minor}/gi{gi}/access"))?;
    let ci_cap = find(&format!("gpu{gpu_minor}/gi{gi}/ci{ci}/access"))?;
    Some([gi_cap, ci_cap])
}

/// The major number of the character devices `/proc/devices` under `root` names `name`
/// (`nvidia-caps`, `nvidia-uvm`, AMD's `kfd`): these drivers take a dynamic major at load.
pub fn char_major(root: &Path, name: &str) -> Option<u32> {
    let text = std::fs::read_to_string(root.join("proc/devices")).ok()?;
    // Block devices follow character devices in the same file: only the first section counts.
    let chars = text.split("Block devices:").next().unwrap_or("");
    chars.lines().find_map(|l| {
        let (n, dev) = l.trim().split_once(char::is_whitespace)?;
        (dev.trim() == name).then(|| n.parse().ok()).flatten()
    })
}

/// The major number of the capability nodes (`nvidia-caps` in `/proc/devices`).
pub fn caps_major(root: &Path) -> Option<u32> {
    char_major(root, CAPS_DIR)
}

/// The driver's proc files of a MIG device's two capabilities, its GPU instance's and its
/// compute instance's: what `nvidia-modprobe -f` takes to make their `/dev` nodes.
pub fn mig_cap_proc_files(gpu_minor: u32, gi: u32, ci: u32) -> [PathBuf; 2] {
    let gi_dir = PathBuf::from(format!(
        "/proc/driver/nvidia/capabilities/gpu{gpu_minor}/mig/gi{gi}"
    ));
    [gi_dir.join("access"), gi_dir.join(format!("ci{ci}/access"))]
}

/// Whether a capability's proc file lets `nvidia-modprobe` create its node (its
/// `DeviceFileModify:` line, the module's `NVreg_ModifyDeviceFiles`); `None` when the file
/// cannot be read or lacks the line.
pub fn cap_file_modify(root: &Path, proc_file: &Path) -> Option<bool> {
    let path = root.join(proc_file.strip_prefix("/").unwrap_or(proc_file));
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| {
        let v: u32 = l.strip_prefix("DeviceFileModify:")?.trim().parse().ok()?;
        Some(v == 1)
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
    use kernelkite_testkit_leaf::fake_nvml::{
        mig_cap_minor, mig_minors_table, write_mig_minors, MIG_MINORS_LINES,
    };

    #[test]
    fn the_driver_s_mig_minors_table_is_reproduced_exactly() {
        let table = mig_minors_table();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), MIG_MINORS_LINES);
        assert_eq!(lines.len(), 4322);
        assert_eq!(
            lines[..4],
            [
                "config 1",
                "monitor 2",
                "gpu0/gi0/access 3",
                "gpu0/gi0/ci0/access 4"
            ]
        );
        // Line N holds minor N: the table has no gaps.
        assert_eq!(lines[11], "gpu0/gi1/access 12");
        assert_eq!(lines.last(), Some(&"gpu31/gi14/ci7/access 4322"));
        let root = tempfile::tempdir().unwrap();
        write_mig_minors(root.path(), 508).unwrap();
        // The figures NVIDIA's DRA driver quotes from a real node's table.
        assert_eq!(mig_cap_minors(root.path(), 3, 3, 3), Some([435, 439]));
        assert_eq!(mig_cap_minors(root.path(), 6, 11, 7), Some([912, 920]));
        assert_eq!(mig_cap_minor(1, 3, Some(0)), 166);
        // Past the table: no such GPU instance or GPU.
        assert_eq!(mig_cap_minors(root.path(), 0, 15, 0), None);
        assert_eq!(mig_cap_minors(root.path(), 32, 0, 0), None);
        assert_eq!(mig_cap_minors(root.path(), 1, 3, 8), None, "no such CI");
        assert_eq!(caps_major(root.path()), Some(508));
        assert_eq!(char_major(root.path(), "nvidia-uvm"), Some(511));
        assert_eq!(char_major(root.path(), "nvidia-uvm-tools"), None);
        assert_eq!(cap_node(31), Path::new("nvidia-caps/nvidia-cap31"));
        let bare = tempfile::tempdir().unwrap();
        assert_eq!(mig_cap_minors(bare.path(), 1, 3, 0), None);
        assert_eq!(caps_major(bare.path()), None);
    }

    #[test]
    fn a_major_is_read_from_the_character_section_only() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("proc")).unwrap();
        std::fs::write(
            root.path().join("proc/devices"),
            "Character devices:\n  1 mem\n234 kfd\n\nBlock devices:\n  7 loop\n259 nvidia-uvm\n",
        )
        .unwrap();
        assert_eq!(char_major(root.path(), "kfd"), Some(234));
        assert_eq!(char_major(root.path(), "nvidia-uvm"), None);
    }

    #[test]
    fn a_capability_s_proc_file_says_whether_nvidia_modprobe_may_make_its_node() {
        let root = tempfile::tempdir().unwrap();
        let [gi, ci] = mig_cap_proc_files(1, 3, 0);
        assert_eq!(
            gi,
            Path::new("/proc/driver/nvidia/capabilities/gpu1/mig/gi3/access")
        );
        assert_eq!(
            ci,
            Path::new("/proc/driver/nvidia/capabilities/gpu1/mig/gi3/ci0/access")
        );
        assert_eq!(cap_file_modify(root.path(), &gi), None);
        let file = root.path().join(gi.strip_prefix("/").unwrap());
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        // nv-caps.c's format: minor, mode 0444 (292), then the modify flag.
        std::fs::write(
            &file,
            "DeviceFileMinor: 165\nDeviceFileMode: 292\nDeviceFileModify: 0\n",
        )
        .unwrap();
        assert_eq!(cap_file_modify(root.path(), &gi), Some(false));
        std::fs::write(
            &file,
            "DeviceFileMinor: 165\nDeviceFileMode: 292\nDeviceFileModify: 1\n",
        )
        .unwrap();
        assert_eq!(cap_file_modify(root.path(), &gi), Some(true));
    }
}
