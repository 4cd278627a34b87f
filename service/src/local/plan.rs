//! The node's plan as the local executor needs it: the operator's plan file, or the node
//! planned at start by `kernelkite-isolate plan --json` (with CPU-only slices on a machine
//! without GPUs), written where the hooks read it.

use std::path::PathBuf;

use serde::Deserialize;
use tokio::process::Command;

use super::{LocalError, LocalSettings};

/// One slice of the node's plan, as far as the executor needs it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PlannedSlice {
    /// The slice's number (the GPU's, or the CPU-only slice's).
    pub index: u32,
    /// Its GPU, when it has one.
    #[serde(default)]
    pub gpu: Option<serde_json::Value>,
    /// Its CPUs.
    pub cpus: Vec<u32>,
    /// Its memory limit.
    pub memory_bytes: u64,
}

impl PlannedSlice {
    /// `slice 0 (GPU 0000:18:00.0, 13 CPUs, 230 GiB)`.
    pub fn describe(&self) -> String {
        let gpu = self
            .gpu
            .as_ref()
            .and_then(|g| g["pci_bus_id"].as_str())
            .map(|b| format!("GPU {b}, "))
            .unwrap_or_else(|| "CPU-only, ".into());
        format!(
            "slice {} ({gpu}{} CPU{}, {:.1} GiB)",
            self.index,
            self.cpus.len(),
            if self.cpus.len() == 1 { "" } else { "s" },
            self.memory_bytes as f64 / f64::from(1u32 << 30)
        )
    }
}

#[derive(Deserialize)]
struct PlanShape {
    slices: Vec<PlannedSlice>,
}

/// Plans the node (or reads the operator's plan) and writes the plan the hooks will read.
pub(super) async fn load_plan(
    settings: &LocalSettings,
) -> Result<(PathBuf, Vec<PlannedSlice>), LocalError> {
    let (path, text) = match &settings.plan_file {
        Some(p) => (
            p.clone(),
            std::fs::read_to_string(p).map_err(|e| LocalError::PlanParse {
                path: p.clone(),
                source: e.into(),
            })?,
        ),
        None => {
            let isolate = &settings.bins.isolate;
            let plan = |extra: Vec<String>| {
                let mut c = Command::new(isolate);
                c.arg("plan")
                    .arg("--json")
                    .arg("--sysfs-root")
                    .arg(&settings.sysfs_root)
                    .args(extra)
                    .stdin(std::process::Stdio::null());
                c
            };
            let run = |mut c: Command| async move {
                c.output().await.map_err(|e| LocalError::Plan {
                    isolate: isolate.clone(),
                    stderr: e.to_string(),
                })
            };
            let mut out = run(plan(vec![])).await?;
            if !out.status.success()
                && String::from_utf8_lossy(&out.stderr).contains("--cpu-only-slices")
            {
                tracing::info!(
                    slices = settings.cpu_only_slices,
                    "no GPU on this machine: planning CPU-only slices"
                );
                out = run(plan(vec![
                    "--cpu-only-slices".into(),
                    settings.cpu_only_slices.to_string(),
                ]))
                .await?;
            }
            if !out.status.success() {
                return Err(LocalError::Plan {
                    isolate: isolate.clone(),
                    stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
                });
            }
            let path = settings.local_dir.join("plan.json");
            std::fs::write(&path, &out.stdout).map_err(|source| LocalError::Dir {
                path: path.clone(),
                source,
            })?;
            (path, String::from_utf8_lossy(&out.stdout).into_owned())
        }
    };
    let plan: PlanShape = serde_json::from_str(&text).map_err(|e| LocalError::PlanParse {
        path: path.clone(),
        source: e.into(),
    })?;
    if plan.slices.is_empty() {
        return Err(LocalError::NoSlices);
    }
    Ok((path, plan.slices))
}
