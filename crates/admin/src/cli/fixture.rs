//! `kernelkite-isolate fixture`: write a fake sysfs/procfs tree of a known machine.
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

use kernelkite_topology::cpulist::parse_cpu_list;
use kernelkite_topology::fakesys::{fixture, FIXTURES};

/// Arguments of `fixture`.
#[derive(Debug, clap::Args)]
pub struct FixtureArgs {
    /// Fixture name (see --list).
    #[arg(required_unless_present = "list")]
    pub name: Option<String>,
    /// Directory to write the tree into (created if missing); pass it to `plan --sysfs-root`.
    #[arg(long, value_name = "DIR", required_unless_present = "list")]
    pub out: Option<PathBuf>,
    /// Take these CPUs offline in the tree (kernel list format, e.g. `10-11,122`).
    #[arg(long, value_name = "CPUS")]
    pub offline: Option<String>,
    /// Restrict the tree's process cpuset (`Cpus_allowed_list`) to these CPUs.
    #[arg(long, value_name = "CPUS")]
    pub cpuset: Option<String>,
    /// List the fixtures and exit.
    #[arg(long)]
    pub list: bool,
}

/// Lists the fixtures, or writes one.
pub fn run(args: FixtureArgs) -> anyhow::Result<ExitCode> {
    if args.list {
        for (name, what) in FIXTURES {
            sayln!("{name:<18} {what}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    let (Some(name), Some(out)) = (args.name, args.out) else {
        anyhow::bail!("pass a fixture NAME and --out DIR (see `fixture --list`)");
    };
    let Some(mut fake) = fixture(&name) else {
        anyhow::bail!("no fixture named {name:?}; `kernelkite-isolate fixture --list` shows them");
    };
    if let Some(list) = &args.offline {
        fake = fake.with_offline(&parse_cpu_list(list).context("--offline")?);
    }
    if let Some(list) = &args.cpuset {
        fake = fake.with_allowed(&parse_cpu_list(list).context("--cpuset")?);
    }
    fake.write_to(&out)
        .with_context(|| format!("cannot write the {name} tree to {}", out.display()))?;
    eprintln!(
        "wrote {name} to {}; try: kernelkite-isolate plan --sysfs-root {}",
        out.display(),
        out.display()
    );
    Ok(ExitCode::SUCCESS)
}
