//! A plan against the node as it is now. MIG devices do not survive a reboot: the driver makes
//! them again (by hand or `nvidia-mig-manager`) with new UUIDs, often under the same GPU and
//! compute instance ids, and an operator may make other ones. A plan written before names
//! devices that are gone, and a job given its `CUDA_VISIBLE_DEVICES` would run on none of them.
//! [`refresh`] takes the new UUIDs where the layout is the same, and otherwise says what
//! changed: the node's agents were set up one per slice, so a changed layout needs `setup`.

use crate::plan::{Plan, SliceGpu};
use crate::topology::Gpu;

/// The node's GPUs no longer match the plan; each change in words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the node's GPUs changed since the plan was written: {}; the agents were set up for that plan, so run `sudo kernelkite-isolate setup` again (it plans anew and rewrites the agents)", .changes.join("; "))]
pub struct PlanDrift {
    /// What changed, one entry per slice or GPU.
    pub changes: Vec<String>,
}

/// `plan` with each MIG slice's UUID taken from the node's MIG device of the same GPU, GPU
/// instance, compute instance and memory (`gpus`: the node now, NVML's MIG devices
/// included); an error listing every slice whose GPU or MIG device is gone or changed, and
/// MIG devices no slice has. A whole GPU's UUID is burned in: it is compared, never replaced.
pub fn refresh(plan: &Plan, gpus: &[Gpu]) -> Result<Plan, PlanDrift> {
    let mut out = plan.clone();
    let mut changes = Vec::new();
    let mut claimed: Vec<String> = Vec::new();
    for slice in &mut out.slices {
        let index = slice.index;
        for g in slice.gpu.iter_mut().chain(slice.extra_gpus.iter_mut()) {
            match gpus.iter().find(|n| n.pci_bus_id == g.pci_bus_id) {
                None => changes.push(format!("slice {index}: GPU {} is gone", g.pci_bus_id)),
                Some(node) => match refresh_gpu(g, node) {
                    Ok(Some(uuid)) => claimed.push(uuid),
                    Ok(None) => {}
                    Err(why) => changes.push(format!("slice {index}: {why}")),
                },
            }
        }
    }
    for node in gpus {
        let unplanned: Vec<String> = node
            .mig
            .iter()
            .filter(|m| !claimed.contains(&m.uuid))
            .map(|m| {
                format!(
                    "{} (GPU instance {}, compute instance {})",
                    m.uuid, m.gpu_instance_id, m.compute_instance_id
                )
            })
            .collect();
        if !unplanned.is_empty() {
            changes.push(format!(
                "GPU {} has MIG device(s) no slice has: {}",
                node.pci_bus_id,
                unplanned.join(", ")
            ));
        }
    }
    if changes.is_empty() {
        Ok(out)
    } else {
        Err(PlanDrift { changes })
    }
}

/// One slice GPU against the node's: the MIG device's new UUID (taken into `g`), `None` for a
/// whole GPU that is still the same, or what changed.
fn refresh_gpu(g: &mut SliceGpu, node: &Gpu) -> Result<Option<String>, String> {
    let bus = &g.pci_bus_id;
    let in_mig_mode = node.mig_enabled || !node.mig.is_empty();
    let Some(m) = g.mig.as_mut() else {
        if in_mig_mode {
            return Err(format!("GPU {bus} is in MIG mode now"));
        }
        return match (&g.uuid, &node.uuid) {
            (Some(old), Some(new)) if old != new => {
                Err(format!("GPU {bus} is another GPU (uuid {old} -> {new})"))
            }
            _ => Ok(None),
        };
    };
    if !in_mig_mode {
        return Err(format!("GPU {bus} is no longer in MIG mode"));
    }
    let same = node.mig.iter().find(|n| {
        (n.gpu_instance_id, n.compute_instance_id, n.memory_bytes)
            == (m.gpu_instance_id, m.compute_instance_id, m.memory_bytes)
    });
    match same {
        Some(n) => {
            m.uuid = n.uuid.clone();
            g.uuid = Some(n.uuid.clone());
            Ok(Some(n.uuid.clone()))
        }
        None => Err(format!(
            "GPU {bus} has no MIG device with GPU instance {}, compute instance {} ({}) now",
            m.gpu_instance_id,
            m.compute_instance_id,
            crate::planner::format_bytes(m.memory_bytes)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{MigInstance, Slice, Vendor};

    const BUS0: &str = "0000:18:00.0";
    const BUS1: &str = "0000:2a:00.0";

    fn mig(gi: u32, ci: u32, gib: u64, boot: u32) -> MigInstance {
        MigInstance {
            uuid: format!("MIG-{gi}{ci}-{boot}"),
            gpu_instance_id: gi,
            compute_instance_id: ci,
            memory_bytes: gib << 30,
        }
    }

    fn node_gpu(bus: &str, uuid: &str, mig: Vec<MigInstance>) -> Gpu {
        Gpu {
            vendor: Vendor::Nvidia,
            pci_bus_id: bus.into(),
            numa_node: Some(0),
            local_cpus: vec![],
            uuid: Some(uuid.into()),
            minor: None,
            device_id: None,
            name: None,
            mig_enabled: !mig.is_empty(),
            mig,
            links: vec![],
            partitioning: None,
        }
    }

    fn slice(index: u32, bus: &str, uuid: &str, mig: Option<MigInstance>) -> Slice {
        Slice {
            index,
            gpu: Some(SliceGpu {
                vendor: Vendor::Nvidia,
                pci_bus_id: bus.into(),
                uuid: Some(mig.as_ref().map_or(uuid.to_string(), |m| m.uuid.clone())),
                numa_node: Some(0),
                mig,
            }),
            extra_gpus: vec![],
            cpus: vec![index],
            mems: vec![0],
            memory_bytes: 1 << 30,
        }
    }

    /// GPU 0 whole, GPU 1 in MIG mode with two devices, as planned in boot 0.
    fn planned() -> Plan {
        Plan {
            slices: vec![
                slice(0, BUS0, "GPU-0", None),
                slice(1, BUS1, "", Some(mig(3, 0, 20, 0))),
                slice(2, BUS1, "", Some(mig(5, 0, 20, 0))),
            ],
            reserved_cpus: vec![],
            warnings: vec![],
        }
    }

    #[test]
    fn a_reboot_changes_only_mig_uuids_and_refresh_takes_them() {
        let now = [
            node_gpu(BUS0, "GPU-0", vec![]),
            node_gpu(BUS1, "GPU-1", vec![mig(5, 0, 20, 1), mig(3, 0, 20, 1)]),
        ];
        let fresh = refresh(&planned(), &now).unwrap();
        let mut want = planned();
        for (i, gi) in [(1, 3), (2, 5)] {
            let g = want.slices[i].gpu.as_mut().unwrap();
            g.mig.as_mut().unwrap().uuid = format!("MIG-{gi}0-1");
            g.uuid = Some(format!("MIG-{gi}0-1"));
        }
        assert_eq!(fresh, want);
        // Nothing changed: the same plan.
        assert_eq!(refresh(&fresh, &now).unwrap(), fresh);
    }

    #[test]
    fn a_changed_layout_is_drift_that_names_setup() {
        let cases: [(&str, Vec<Gpu>); 6] = [
            (
                "has no MIG device with GPU instance 5",
                vec![
                    node_gpu(BUS0, "GPU-0", vec![]),
                    node_gpu(BUS1, "GPU-1", vec![mig(3, 0, 20, 1), mig(7, 0, 20, 1)]),
                ],
            ),
            (
                "no longer in MIG mode",
                vec![
                    node_gpu(BUS0, "GPU-0", vec![]),
                    node_gpu(BUS1, "GPU-1", vec![]),
                ],
            ),
            (
                "GPU 0000:18:00.0 is gone",
                vec![node_gpu(
                    BUS1,
                    "GPU-1",
                    vec![mig(3, 0, 20, 1), mig(5, 0, 20, 1)],
                )],
            ),
            (
                "no slice has: MIG-60-1",
                vec![
                    node_gpu(BUS0, "GPU-0", vec![]),
                    node_gpu(
                        BUS1,
                        "GPU-1",
                        vec![mig(3, 0, 20, 1), mig(5, 0, 20, 1), mig(6, 0, 20, 1)],
                    ),
                ],
            ),
            (
                "GPU 0000:18:00.0 is in MIG mode now",
                vec![
                    node_gpu(BUS0, "GPU-0", vec![mig(1, 0, 40, 1)]),
                    node_gpu(BUS1, "GPU-1", vec![mig(3, 0, 20, 1), mig(5, 0, 20, 1)]),
                ],
            ),
            (
                "is another GPU (uuid GPU-0 -> GPU-9)",
                vec![
                    node_gpu(BUS0, "GPU-9", vec![]),
                    node_gpu(BUS1, "GPU-1", vec![mig(3, 0, 20, 1), mig(5, 0, 20, 1)]),
                ],
            ),
        ];
        for (want, now) in cases {
            let err = refresh(&planned(), &now).unwrap_err();
            let text = err.to_string();
            assert!(
                err.changes.iter().any(|c| c.contains(want)),
                "{want}: {text}"
            );
            assert!(text.contains("kernelkite-isolate setup"), "{text}");
        }
        // MIG on, the instances not made again yet: both MIG slices are gone.
        let mut empty = node_gpu(BUS1, "GPU-1", vec![]);
        empty.mig_enabled = true;
        let err = refresh(&planned(), &[node_gpu(BUS0, "GPU-0", vec![]), empty]).unwrap_err();
        assert_eq!(err.changes.len(), 2, "{err}");
    }
}
