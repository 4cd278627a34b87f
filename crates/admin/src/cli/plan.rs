//! `kernelkite-isolate plan`: print the node's slices as a table or as JSON.
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

use kernelkite_topology::cpulist::format_cpu_list;
use kernelkite_topology::plan::Plan;
use kernelkite_topology::planner::{format_bytes, plan_explained, Policy};
use kernelkite_topology::topology::Topology;

/// Where the topology comes from, and the slicing policy.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// Root of the sysfs/procfs tree to read (a fake tree from `fixture`, or `/`).
    #[arg(
        long,
        env = "KERNELKITE_SYSFS_ROOT",
        default_value = "/",
        value_name = "DIR"
    )]
    pub sysfs_root: PathBuf,
    /// Plan from an hwloc XML export (`lstopo --of xml FILE`, format 2.0 or 3.0) instead of sysfs.
    #[arg(
        long,
        env = "KERNELKITE_TOPOLOGY_XML",
        value_name = "FILE",
        conflicts_with = "sysfs_root"
    )]
    pub topology_xml: Option<PathBuf>,
    /// Print the plan as JSON (the stable shape documented in the README) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Check the plan in FILE against the node now and take its MIG devices' new UUIDs (they
    /// change at every boot): rewrite FILE when the layout is the same, else fail saying what
    /// changed (then run `setup` again). Reads NVML, whatever the sysfs root.
    #[arg(long, value_name = "FILE", conflicts_with = "topology_xml")]
    pub refresh: Option<PathBuf>,
    /// How to slice.
    #[command(flatten)]
    pub policy: PolicyArgs,
}

/// Slicing policy flags, shared by every command that plans.
#[derive(Debug, Clone, clap::Args)]
pub struct PolicyArgs {
    /// GPUs per slice.
    #[arg(
        long,
        env = "KERNELKITE_GPUS_PER_SLICE",
        default_value_t = 1,
        value_name = "N"
    )]
    pub gpus_per_slice: u32,
    /// Whole cores per NUMA node kept for the OS and the agent.
    #[arg(
        long,
        env = "KERNELKITE_HOUSEKEEPING_CORES",
        default_value_t = 1,
        value_name = "N"
    )]
    pub housekeeping_cores: u32,
    /// Percent of each NUMA node's memory kept for the host.
    #[arg(
        long,
        env = "KERNELKITE_HOST_MEMORY_RESERVE",
        default_value_t = 10,
        value_name = "PERCENT"
    )]
    pub host_memory_reserve: u32,
    /// Fixed whole cores per slice (default: as many as every node can give locally).
    #[arg(long, env = "KERNELKITE_CORES_PER_SLICE", value_name = "N")]
    pub cores_per_slice: Option<u32>,
    /// Fixed memory limit per slice, e.g. `64G`, `512M`, `1T` or bytes (default: the node's share).
    #[arg(long, env = "KERNELKITE_MEMORY_PER_SLICE", value_name = "SIZE", value_parser = parse_size)]
    pub memory_per_slice: Option<u64>,
    /// Let slices share cores when there are more slices than cores (they are then not isolated).
    #[arg(long, env = "KERNELKITE_ALLOW_SHARING")]
    pub allow_sharing: bool,
    /// On a node without GPUs, plan this many CPU-only slices.
    #[arg(long, env = "KERNELKITE_CPU_ONLY_SLICES", value_name = "N")]
    pub cpu_only_slices: Option<u32>,
}

impl PolicyArgs {
    /// The planner's policy.
    pub fn to_policy(&self) -> Policy {
        Policy {
            gpus_per_slice: self.gpus_per_slice,
            housekeeping_cores_per_node: self.housekeeping_cores,
            host_memory_reserve_percent: self.host_memory_reserve,
            cores_per_slice: self.cores_per_slice,
            memory_per_slice: self.memory_per_slice,
            allow_sharing: self.allow_sharing,
            cpu_only_slices: self.cpu_only_slices,
        }
    }
}

/// `64G`, `512M`, `1T`, `2Gi`, `1024` (bytes); binary units.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits_end);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size; write e.g. 64G, 512M or a number of bytes"))?;
    let shift = match unit
        .trim()
        .trim_end_matches(['i', 'B', 'b'])
        .to_ascii_uppercase()
        .as_str()
    {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(format!("{s:?} has an unknown unit; use K, M, G or T")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// Reads the topology from an XML export or a sysfs root.
pub fn load_topology(
    sysfs_root: &std::path::Path,
    xml: Option<&std::path::Path>,
) -> anyhow::Result<Topology> {
    match xml {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            Topology::from_hwloc_xml(&text).with_context(|| format!("in {}", path.display()))
        }
        None => Ok(Topology::discover(sysfs_root)?),
    }
}

/// Plans the node and prints the plan.
pub fn run(args: PlanArgs) -> anyhow::Result<ExitCode> {
    if let Some(file) = &args.refresh {
        return refresh(file, &args.sysfs_root);
    }
    let topo = load_topology(&args.sysfs_root, args.topology_xml.as_deref())?;
    let explained = plan_explained(&topo, &args.policy.to_policy())?;
    if args.json {
        sayln!("{}", serde_json::to_string(&explained.plan)?);
    } else {
        say!("{}", render_table(&explained.plan, &explained.notes));
    }
    Ok(ExitCode::SUCCESS)
}

/// `plan --refresh FILE`: the plan in FILE against the node now ([`kernelkite_topology::refresh`]).
/// The file is rewritten (atomically, through a file beside it) whenever the layout is the
/// same, changed or not, so its time says it was checked in this boot (the environment hook
/// refuses a MIG job whose plan is older than the boot); on drift it is left as it was.
fn refresh(file: &std::path::Path, sysfs_root: &std::path::Path) -> anyhow::Result<ExitCode> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("cannot read the plan {}", file.display()))?;
    let plan: Plan = serde_json::from_str(&text).with_context(|| {
        format!(
            "{} is not a plan (kernelkite-isolate plan --json)",
            file.display()
        )
    })?;
    if plan.names_mig() {
        // Without NVML every MIG device would read as gone.
        kernelkite_sys::nvml::Nvml::load().with_context(|| {
            format!(
                "plan --refresh needs NVML for the MIG devices {} names: run kernelkite-isolate-nvml plan --refresh {0} (the dynamically linked build), on a node with the NVIDIA driver",
                file.display()
            )
        })?;
    }
    let topo = Topology::discover_with_nvml(sysfs_root, Some(kernelkite_sys::nvml::LIBRARY))?;
    let fresh = kernelkite_topology::refresh::refresh(&plan, &topo.gpus)?;
    let taken = fresh
        .slices
        .iter()
        .zip(&plan.slices)
        .filter(|(a, b)| a != b)
        .count();
    write_atomically(file, serde_json::to_string(&fresh)?.as_bytes())
        .with_context(|| format!("cannot write {}", file.display()))?;
    if taken == 0 {
        sayln!("{} matches the node", file.display());
    } else {
        sayln!(
            "took the new MIG device uuid(s) of {taken} slice(s) into {}",
            file.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Replaces `file` with `bytes` (mode 0644): a temporary file of its own beside it, renamed
/// over it. Every agent of a node runs `plan --refresh` as it starts, all at once: a shared
/// temporary name would let one truncate what another is renaming, leaving the plan empty.
fn write_atomically(file: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;
    let dir = file
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.as_file()
        .set_permissions(std::fs::Permissions::from_mode(0o644))?;
    tmp.persist(file).map_err(|e| e.error)?;
    Ok(())
}

/// The human output: a table, then the reasons, then warnings.
pub fn render_table(plan: &Plan, notes: &[String]) -> String {
    let mut rows: Vec<[String; 6]> = vec![[
        "SLICE".into(),
        "GPU".into(),
        "BUS ID".into(),
        "NUMA".into(),
        "CPUS".into(),
        "MEMORY".into(),
    ]];
    for s in &plan.slices {
        let gpus = s.gpus();
        let vendor = gpus
            .first()
            .map_or_else(|| "-".to_string(), |g| g.vendor.to_string());
        let gpu = match gpus.len() {
            0 | 1 => vendor,
            n => format!("{n}x {vendor}"),
        };
        let bus = if gpus.is_empty() {
            "-".into()
        } else {
            gpus.iter()
                .map(|g| g.pci_bus_id.as_str())
                .collect::<Vec<_>>()
                .join(",")
        };
        let mems = s
            .mems
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(",");
        rows.push([
            s.index.to_string(),
            gpu,
            bus,
            mems,
            format_cpu_list(&s.cpus),
            format_bytes(s.memory_bytes),
        ]);
    }
    let widths: Vec<usize> = (0..6)
        .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in &rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out.push_str(&format!(
        "\nreserved for the host: {}\n",
        if plan.reserved_cpus.is_empty() {
            "none".to_string()
        } else {
            format_cpu_list(&plan.reserved_cpus)
        }
    ));
    if !notes.is_empty() {
        out.push_str("\nwhy:\n");
        for n in notes {
            out.push_str(&format!("  - {n}\n"));
        }
    }
    if !plan.warnings.is_empty() {
        out.push_str("\nwarnings:\n");
        for w in &plan.warnings {
            out.push_str(&format!("  ! {w}\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("64G"), Ok(64 << 30));
        assert_eq!(parse_size("512Mi"), Ok(512 << 20));
        assert_eq!(parse_size("1TB"), Ok(1 << 40));
        assert_eq!(parse_size("1024"), Ok(1024));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("5X").is_err());
        assert!(parse_size("99999999999T").is_err());
    }
}
