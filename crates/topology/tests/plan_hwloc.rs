//! hwloc as the oracle: real machines' XML exports from hwloc's test suite, and our fake sysfs
//! trees read by hwloc's own Linux backend.

use std::path::{Path, PathBuf};
use std::process::Command;

use kernelkite_topology::cpulist::parse_cpu_list;
use kernelkite_topology::fakesys;
use kernelkite_topology::plan::{Plan, Vendor};
use kernelkite_topology::planner::{plan, Policy};
use kernelkite_topology::topology::Topology;

use kernelkite_testkit_leaf::scratch;

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hwloc")
}

fn read_fixture(name: &str) -> String {
    let path = fixtures_dir().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (the fixtures ship with the repository)",
            path.display()
        )
    })
}

/// Runs an hwloc tool, or `None` when hwloc is not installed (`apt-get install hwloc`).
fn hwloc(tool: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(tool)
        .args(args)
        // Without this hwloc mixes the CPUID of the machine running the test into fake trees.
        .env("HWLOC_COMPONENTS", "-x86")
        .output()
        .ok()?;
    assert!(
        out.status.success(),
        "{tool} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn have_hwloc() -> bool {
    let ok = Command::new("hwloc-calc").arg("--version").output().is_ok();
    if !ok {
        kernelkite_testkit_leaf::skip(
            "hwloc oracle checks not run: hwloc-calc not found (apt-get install hwloc)",
        );
    }
    ok
}

/// `hwloc-calc --input IN --po --intersect PU LOCATION`, as a sorted list.
fn oracle_pus(input: &str, location: &str) -> Option<Vec<u32>> {
    let out = hwloc(
        "hwloc-calc",
        &["--input", input, "--po", "--intersect", "PU", location],
    )?;
    let mut v = parse_cpu_list(&out).unwrap();
    v.sort_unstable();
    Some(v)
}

#[test]
fn real_two_socket_export_is_read() {
    let topo = Topology::from_hwloc_xml(&read_fixture("32em64t-2n8c2t-pci-normalio.xml")).unwrap();
    assert_eq!(topo.online_cpus().len(), 32);
    assert_eq!(topo.physical_cores().len(), 16);
    assert_eq!(topo.threads_per_core(), 2);
    assert_eq!(topo.packages(), vec![0, 1]);
    assert_eq!(topo.numa_nodes.len(), 2);
    assert_eq!(topo.numa_nodes[0].memory_bytes, 34330173440);
    // PU 0 and PU 16 share core 0.
    assert_eq!(topo.cpus.iter().find(|c| c.id == 16).unwrap().core, 0);
    let gpus: Vec<(&str, Vendor, Option<u32>)> = topo
        .gpus
        .iter()
        .map(|g| (g.pci_bus_id.as_str(), g.vendor, g.numa_node))
        .collect();
    assert_eq!(
        gpus,
        [
            ("0000:03:00.0", Vendor::Nvidia, Some(0)),
            ("0000:83:00.0", Vendor::Nvidia, Some(1)),
            ("0000:84:00.0", Vendor::Nvidia, Some(1)),
            ("0000:84:00.1", Vendor::Amd, Some(1)),
        ]
    );
    assert_eq!(topo.gpus[2].name.as_deref(), Some("Tesla K40m"));
    let p = plan(&topo, &Policy::default()).unwrap();
    assert_eq!(p.slices.len(), 4);
    // Node 1 hosts 3 GPUs: 7 free cores / 3 = 2 cores each; node 0's one GPU gets 2 as well.
    assert!(p.slices.iter().all(|s| s.cpus.len() == 4));
    let node1 = &topo.numa_nodes[1].cpus;
    assert!(p.slices[1..]
        .iter()
        .all(|s| s.cpus.iter().all(|c| node1.contains(c))));
}

#[test]
fn real_four_node_export_is_read() {
    let topo = Topology::from_hwloc_xml(&read_fixture("96em64t-4n4d3ca2co-pci.xml")).unwrap();
    assert_eq!(topo.online_cpus().len(), 96);
    assert_eq!(topo.numa_nodes.len(), 4);
    assert!(topo.numa_nodes.iter().all(|n| n.cpus.len() == 24));
    assert_eq!(topo.numa_nodes[3].cpus, parse_cpu_list("72-95").unwrap());
    assert_eq!(topo.total_memory_bytes, 51269931008 + 3 * 51271172096);
}

#[test]
fn gpu_locality_matches_hwloc_calc_on_real_exports() {
    if !have_hwloc() {
        return;
    }
    for name in [
        "32em64t-2n8c2t-pci-normalio.xml",
        "96em64t-4n4d3ca2co-pci.xml",
    ] {
        let path = fixtures_dir().join(name);
        let input = path.to_str().unwrap();
        let topo = Topology::from_hwloc_xml(&read_fixture(name)).unwrap();
        assert!(!topo.gpus.is_empty(), "{name}");
        for g in &topo.gpus {
            let bus = g.pci_bus_id.trim_start_matches("0000:");
            let want = oracle_pus(input, &format!("pci={bus}")).unwrap();
            assert_eq!(g.local_cpus, want, "{name} {bus}");
        }
    }
    // The issue's oracle, by OS device name.
    let path = fixtures_dir().join("32em64t-2n8c2t-pci-normalio.xml");
    let cuda0 = oracle_pus(path.to_str().unwrap(), "os=cuda0").unwrap();
    let topo = Topology::from_hwloc_xml(&read_fixture("32em64t-2n8c2t-pci-normalio.xml")).unwrap();
    let gpu = topo
        .gpus
        .iter()
        .find(|g| g.pci_bus_id == "0000:84:00.0")
        .unwrap();
    assert_eq!(gpu.local_cpus, cuda0);
    assert_eq!(cuda0, parse_cpu_list("8-15,24-31").unwrap());
}

/// Rewrites a 2.0 export the way newer exporters write it: version 3.0 and PCI ids in separate
/// attributes instead of `pci_type`.
fn as_format_3(xml: &str) -> String {
    let mut out = xml.replace(r#"<topology version="2.0">"#, r#"<topology version="3.0">"#);
    while let Some(start) = out.find(" pci_type=\"") {
        let rest = &out[start + 11..];
        let end = rest.find('"').unwrap();
        let value = &rest[..end];
        let class = &value[..4];
        let vendor = &value[6..10];
        let device = &value[11..15];
        let repl =
            format!(r#" class_id="0x{class}" vendor_id="0x{vendor}" device_id="0x{device}""#);
        out = format!("{}{}{}", &out[..start], repl, &rest[end + 1..]);
    }
    out
}

#[test]
fn format_3_exports_read_the_same() {
    let xml = read_fixture("32em64t-2n8c2t-pci-normalio.xml");
    let v3 = as_format_3(&xml);
    assert!(v3.contains(r#"version="3.0""#) && !v3.contains("pci_type"));
    assert_eq!(
        Topology::from_hwloc_xml(&v3).unwrap(),
        Topology::from_hwloc_xml(&xml).unwrap()
    );
}

/// What a plan allots, leaving out what only one source knows (UUIDs, the firmware's -1).
/// A GPU as both sources can describe it: bus id, vendor, node, local CPUs.
type GpuKey = (String, Vendor, Option<u32>, Vec<u32>);

type Allotment = Vec<(u32, Option<String>, Vec<u32>, Vec<u32>, u64)>;

fn allotment(p: Plan) -> Allotment {
    p.slices
        .into_iter()
        .map(|s| {
            (
                s.index,
                s.gpu.map(|g| g.pci_bus_id),
                s.cpus,
                s.mems,
                s.memory_bytes,
            )
        })
        .collect()
}

#[test]
fn hwloc_reads_our_fake_trees_as_we_do() {
    if !have_hwloc() {
        return;
    }
    for (name, _) in fakesys::FIXTURES {
        let dir = scratch();
        fakesys::fixture(name)
            .unwrap()
            .write_to(dir.path())
            .unwrap();
        let root = dir.path().to_str().unwrap();
        let ours = Topology::discover(dir.path()).unwrap();

        // GPU locality: hwloc-calc on the tree is the oracle.
        for g in &ours.gpus {
            let bus = g.pci_bus_id.trim_start_matches("0000:");
            let want = oracle_pus(root, &format!("pci={bus}")).unwrap();
            assert_eq!(g.local_cpus, want, "{name} {bus}");
        }
        let cores: usize = hwloc("hwloc-calc", &["--input", root, "-N", "core", "all"])
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(ours.physical_cores().len(), cores, "{name}");

        // hwloc's XML export of the tree, read back by our XML parser: the same machine.
        let xml = hwloc("lstopo-no-graphics", &["--input", root, "--of", "xml", "-"]).unwrap();
        let theirs = Topology::from_hwloc_xml(&xml).unwrap();
        assert_eq!(theirs.cpus, ours.cpus, "{name}");
        assert_eq!(theirs.numa_nodes, ours.numa_nodes, "{name}");
        assert_eq!(theirs.total_memory_bytes, ours.total_memory_bytes, "{name}");
        // On a one-node machine hwloc cannot tell "firmware said -1" from "node 0": it attaches
        // the GPU to the only package either way. Everywhere else the node must match.
        let single = (ours.numa_nodes.len() == 1).then(|| ours.numa_nodes[0].id);
        let key = |t: &Topology| -> Vec<GpuKey> {
            t.gpus
                .iter()
                .map(|g| {
                    (
                        g.pci_bus_id.clone(),
                        g.vendor,
                        g.numa_node.or(single),
                        g.local_cpus.clone(),
                    )
                })
                .collect()
        };
        assert_eq!(key(&theirs), key(&ours), "{name}");
        let policy = Policy {
            cpu_only_slices: Some(2),
            ..Policy::default()
        };
        let (a, b) = (
            plan(&theirs, &policy).unwrap(),
            plan(&ours, &policy).unwrap(),
        );
        assert_eq!(a.reserved_cpus, b.reserved_cpus, "{name}");
        assert_eq!(
            allotment(a),
            allotment(b),
            "{name}: same plan from either source"
        );
    }
}
