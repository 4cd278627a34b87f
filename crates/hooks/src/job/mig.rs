//! A MIG slice is a device that may not be there: MIG devices do not survive a reboot (they
//! come back with new uuids when `nvidia-mig-manager` or an operator makes them again), and
//! `nvidia-smi mig` removes them at any time. A job given a plan's stale uuid in
//! `CUDA_VISIBLE_DEVICES` would see no GPU (or, worse, time on none), so before anything is
//! held the `environment` hook refuses a MIG slice whose instance the driver no longer lists,
//! or whose plan was written before this boot, saying what to run. Without NVML: the driver's
//! files say it (`/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<g>/ci<c>`, which the driver
//! makes with each instance and removes with it), and `/proc/stat`'s `btime`.

use std::path::Path;
use std::time::{Duration, SystemTime};

use kernelkite_sys::nvidia;
use kernelkite_topology::plan::Slice;

use super::error::JobError;
use super::settings::Settings;

/// Refuses `slice` when one of its MIG devices is not on the node now, or the plan file
/// (`plan_file`, when the node has one) was written before this boot.
pub fn check_current(settings: &Settings, slice: &Slice) -> Result<(), JobError> {
    let plan = settings
        .plan_file
        .as_deref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "/etc/kernelkite/plan.json".into());
    for g in slice.gpus() {
        let Some(m) = &g.mig else { continue };
        let minor = nvidia::device_minor(&settings.sysfs_root, &g.pci_bus_id);
        let present = minor.and_then(|gpu| {
            instance_present(
                &settings.sysfs_root,
                gpu,
                m.gpu_instance_id,
                m.compute_instance_id,
            )
        });
        if present == Some(false) {
            return Err(JobError::MigGone {
                slice: slice.index,
                uuid: m.uuid.clone(),
                gi: m.gpu_instance_id,
                ci: m.compute_instance_id,
                bus: g.pci_bus_id.clone(),
                plan,
            });
        }
        let stale = settings.plan_file.as_deref().is_some_and(|f| {
            written_before_boot(f, &settings.proc_root.join("stat")).unwrap_or(false)
        });
        if stale {
            return Err(JobError::PlanPredatesBoot {
                slice: slice.index,
                uuid: m.uuid.clone(),
                plan,
            });
        }
    }
    Ok(())
}

/// Whether the driver lists GPU instance `gi`, compute instance `ci` of the GPU with device
/// minor `gpu` (`<root>/proc/driver/nvidia/capabilities/gpu<gpu>/mig/gi<gi>/ci<ci>`); `None`
/// when the driver's MIG directory for that GPU is not there at all (no driver files, or a GPU
/// never in MIG mode): nothing to say.
pub fn instance_present(root: &Path, gpu: u32, gi: u32, ci: u32) -> Option<bool> {
    let mig = root.join(format!("proc/driver/nvidia/capabilities/gpu{gpu}/mig"));
    if !mig.is_dir() {
        return None;
    }
    Some(mig.join(format!("gi{gi}/ci{ci}")).is_dir())
}

/// Whether `file` was last written before the machine booted (`btime` in `stat`, `/proc/stat`);
/// `None` when either cannot be read.
pub fn written_before_boot(file: &Path, stat: &Path) -> Option<bool> {
    let written = std::fs::metadata(file).ok()?.modified().ok()?;
    let text = std::fs::read_to_string(stat).ok()?;
    let btime: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    Some(written < SystemTime::UNIX_EPOCH + Duration::from_secs(btime))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelkite_topology::plan::{MigInstance, SliceGpu, Vendor};

    fn mig_slice(index: u32, gi: u32) -> Slice {
        Slice {
            index,
            gpu: Some(SliceGpu {
                vendor: Vendor::Nvidia,
                pci_bus_id: "0000:2a:00.0".into(),
                uuid: Some(format!("MIG-{gi}")),
                numa_node: Some(0),
                mig: Some(MigInstance {
                    uuid: format!("MIG-{gi}"),
                    gpu_instance_id: gi,
                    compute_instance_id: 0,
                    memory_bytes: 20 << 30,
                }),
            }),
            extra_gpus: vec![],
            cpus: vec![index],
            mems: vec![0],
            memory_bytes: 1 << 30,
        }
    }

    /// The driver's files for GPU `0000:2a:00.0` (minor 1) with instances `gis` (ci 0 each),
    /// and `/proc/stat` saying the machine booted at `btime`.
    fn node(root: &Path, gis: &[u32], btime: u64) {
        let info = root.join("proc/driver/nvidia/gpus/0000:2a:00.0");
        std::fs::create_dir_all(&info).unwrap();
        std::fs::write(
            info.join("information"),
            "Model: NVIDIA H100\nDevice Minor: 1\n",
        )
        .unwrap();
        let mig = root.join("proc/driver/nvidia/capabilities/gpu1/mig");
        let _ = std::fs::remove_dir_all(&mig);
        std::fs::create_dir_all(&mig).unwrap();
        for gi in gis {
            std::fs::create_dir_all(mig.join(format!("gi{gi}/ci0"))).unwrap();
        }
        std::fs::write(
            root.join("proc/stat"),
            format!("cpu 1 2 3\nbtime {btime}\n"),
        )
        .unwrap();
    }

    fn settings(root: &Path, plan: Option<&Path>) -> Settings {
        Settings {
            sysfs_root: root.to_path_buf(),
            proc_root: root.join("proc"),
            plan_file: plan.map(Path::to_path_buf),
            ..Settings::default()
        }
    }

    #[test]
    fn a_mig_slice_whose_instance_is_gone_is_refused_saying_what_to_run() {
        let d = tempfile::tempdir().unwrap();
        node(d.path(), &[3, 5], 0);
        let s = settings(d.path(), None);
        assert!(check_current(&s, &mig_slice(1, 3)).is_ok());
        assert!(check_current(&s, &mig_slice(2, 5)).is_ok());
        // GPU instance 5 destroyed (or the node rebooted and only 3 was made again).
        node(d.path(), &[3], 0);
        let err = check_current(&s, &mig_slice(2, 5)).unwrap_err().to_string();
        assert!(
            err.contains("MIG-5") && err.contains("plan --refresh") && err.contains("setup"),
            "{err}"
        );
        assert!(check_current(&s, &mig_slice(1, 3)).is_ok());
        // No driver files at all (a fixture, a node without the driver's MIG directory): no
        // opinion.
        let bare = tempfile::tempdir().unwrap();
        assert!(check_current(&settings(bare.path(), None), &mig_slice(2, 5)).is_ok());
    }

    #[test]
    fn a_mig_slice_of_a_plan_older_than_the_boot_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let plan = d.path().join("plan.json");
        std::fs::write(&plan, "{}").unwrap();
        let written = std::fs::metadata(&plan)
            .unwrap()
            .modified()
            .unwrap()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        // Booted after the plan was written: stale.
        node(d.path(), &[3], written + 60);
        let s = settings(d.path(), Some(&plan));
        let err = check_current(&s, &mig_slice(1, 3)).unwrap_err().to_string();
        assert!(
            err.contains("before this boot") && err.contains("plan --refresh"),
            "{err}"
        );
        // Booted before: current. A whole-GPU or CPU slice is never refused for it.
        node(d.path(), &[3], written.saturating_sub(60));
        assert!(check_current(&s, &mig_slice(1, 3)).is_ok());
        node(d.path(), &[3], written + 60);
        let mut whole = mig_slice(0, 3);
        whole.gpu.as_mut().unwrap().mig = None;
        assert!(check_current(&s, &whole).is_ok());
    }
}
