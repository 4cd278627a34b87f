//! Topology from an hwloc XML export (`lstopo --of xml`), formats 2.0 and 3.0.
//!
//! The tree nests `object` elements: Machine → Package → (Group/Die/caches) → Core → PU, with
//! NUMANode objects as memory children and PCI devices under Bridges hanging off the object they
//! are local to. A GPU's locality is the cpuset of its nearest non-I/O ancestor, exactly what
//! `hwloc-calc --input F pci=BUS --intersect PU` prints. Parsing is tolerant: unknown object
//! types, attributes and `info` entries are ignored, and PCI ids are read from `pci_type` (2.0)
//! or from separate `class_id`/`vendor_id`/`device_id` attributes when an exporter writes those.

use std::collections::{BTreeMap, BTreeSet};

use roxmltree::{Document, Node, ParsingOptions};

use super::{canonical_bus_id, gpu_vendor, Cpu, Gpu, NumaNode, Topology, TopologyError, XmlError};

/// Largest bitmap index accepted, so a hostile `0xffff...` string cannot allocate gigabytes.
const MAX_BIT: u32 = 1 << 16;

/// An [`TopologyError::Xml`] saying what is wrong with the export.
fn bad_xml(what: impl Into<XmlError>) -> TopologyError {
    TopologyError::Xml(what.into())
}

/// Parses an hwloc bitmap string: comma-separated 32-bit hex words, most significant first,
/// an empty word meaning zero (`0xffffff00,,0x0`), and a leading `0xf...f` meaning "all bits
/// above" (dropped: only finite sets describe real CPUs).
pub fn parse_bitmap(s: &str) -> Result<Vec<u32>, TopologyError> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(Vec::new());
    }
    let words: Vec<&str> = s.split(',').collect();
    let mut bits = Vec::new();
    for (i, word) in words.iter().rev().enumerate() {
        let w = word.trim();
        if w == "0xf...f" {
            continue;
        }
        let digits = w.strip_prefix("0x").unwrap_or(w);
        if digits.is_empty() {
            continue;
        }
        let value = u64::from_str_radix(digits, 16)
            .map_err(|_| bad_xml(format!("bad bitmap word {w:?} in {s:?}")))?;
        // Words are 32 bits wide; a longer word still counts from this word's base.
        let base = (i as u64) * 32;
        for bit in 0..64u64 {
            if value & (1u64 << bit) != 0 {
                let idx = base + bit;
                if idx > u64::from(MAX_BIT) {
                    return Err(bad_xml(format!("bitmap {s:?} is implausibly large")));
                }
                bits.push(idx as u32);
            }
        }
    }
    bits.sort_unstable();
    bits.dedup();
    Ok(bits)
}

fn attr_u32(node: Node, name: &str) -> Option<u32> {
    node.attribute(name).and_then(|v| v.trim().parse().ok())
}

fn attr_bitmap(node: Node, name: &str) -> Result<Option<Vec<u32>>, TopologyError> {
    node.attribute(name).map(parse_bitmap).transpose()
}

fn object_type<'a>(node: Node<'a, '_>) -> Option<&'a str> {
    (node.is_element() && node.tag_name().name() == "object")
        .then(|| node.attribute("type"))
        .flatten()
}

fn is_io(ty: &str) -> bool {
    matches!(ty, "Bridge" | "PCIDev" | "OSDev" | "Misc")
}

/// `pci_type="0302 [10de:1094] [00de:0088] a1 00"` → (class << 8, vendor, device).
fn parse_pci_type(s: &str) -> Option<(u32, u16, u16)> {
    let mut it = s.split_whitespace();
    let class = u32::from_str_radix(it.next()?, 16).ok()?;
    let ids = it.next()?.trim_start_matches('[').trim_end_matches(']');
    let (v, d) = ids.split_once(':')?;
    Some((
        class << 8,
        u16::from_str_radix(v, 16).ok()?,
        u16::from_str_radix(d, 16).ok()?,
    ))
}

fn parse_hex_attr(node: Node, name: &str) -> Option<u32> {
    let v = node.attribute(name)?.trim();
    u32::from_str_radix(v.strip_prefix("0x").unwrap_or(v), 16).ok()
}

fn pci_ids(node: Node) -> Option<(u32, u16, u16)> {
    if let Some(t) = node.attribute("pci_type") {
        return parse_pci_type(t);
    }
    let class = parse_hex_attr(node, "class_id")?;
    // A 16-bit class id (base+sub) is shifted to the 24-bit form sysfs uses.
    let class = if class <= 0xffff { class << 8 } else { class };
    let vendor = u16::try_from(parse_hex_attr(node, "vendor_id")?).ok()?;
    let device = parse_hex_attr(node, "device_id")
        .and_then(|d| u16::try_from(d).ok())
        .unwrap_or(0);
    Some((class, vendor, device))
}

fn info<'a>(node: Node<'a, 'a>, name: &str) -> Option<&'a str> {
    node.children()
        .filter(|c| c.is_element() && c.tag_name().name() == "info")
        .find(|c| c.attribute("name") == Some(name))
        .and_then(|c| c.attribute("value"))
}

pub(crate) fn parse(xml: &str) -> Result<Topology, TopologyError> {
    let doc = Document::parse_with_options(
        xml,
        ParsingOptions {
            allow_dtd: true,
            ..ParsingOptions::default()
        },
    )
    .map_err(|e| TopologyError::Xml(e.into()))?;
    let machine = machine_object(&doc)?;

    let mut cpus: BTreeMap<u32, Cpu> = BTreeMap::new();
    let mut numa_nodes: Vec<NumaNode> = Vec::new();
    let mut gpus: Vec<Gpu> = Vec::new();
    let mut node_of: BTreeMap<u32, u32> = BTreeMap::new();

    for node in machine.descendants().filter(|n| object_type(*n).is_some()) {
        match object_type(node) {
            Some("PU") => {
                let cpu = pu_cpu(node)?;
                cpus.insert(cpu.id, cpu);
            }
            Some("NUMANode") => {
                let numa = numa_node(node, numa_nodes.len() as u32)?;
                for &c in &numa.cpus {
                    node_of.insert(c, numa.id);
                }
                numa_nodes.push(numa);
            }
            Some("PCIDev") => gpus.extend(pci_gpu(node)?),
            _ => {}
        }
    }

    if cpus.is_empty() {
        return Err(TopologyError::Xml(
            "no PU objects: the export has no CPUs".into(),
        ));
    }
    add_offline_cpus(machine, &mut cpus)?;
    let online: BTreeSet<u32> = cpus.values().filter(|c| c.online).map(|c| c.id).collect();
    if numa_nodes.is_empty() {
        numa_nodes.push(whole_machine_node(machine, &online));
        for c in &online {
            node_of.insert(*c, 0);
        }
    }
    for cpu in cpus.values_mut().filter(|c| c.online) {
        cpu.numa_node = node_of.get(&cpu.id).copied();
    }
    for n in &mut numa_nodes {
        n.cpus.retain(|c| online.contains(c));
    }
    let total_memory_bytes = numa_nodes.iter().map(|n| n.memory_bytes).sum();
    let allowed_cpus = match attr_bitmap(machine, "allowed_cpuset")? {
        Some(a) => a.into_iter().filter(|c| online.contains(c)).collect(),
        None => online.iter().copied().collect(),
    };
    let allowed_mems = attr_bitmap(machine, "allowed_nodeset")?.unwrap_or_default();

    let mut topo = Topology {
        cpus: cpus.into_values().collect(),
        numa_nodes,
        total_memory_bytes,
        allowed_cpus,
        allowed_mems,
        gpus,
    };
    topo.normalise();
    Ok(topo)
}

/// Adds the CPUs in the machine's complete cpuset but without a PU object: they are offline.
fn add_offline_cpus(machine: Node, cpus: &mut BTreeMap<u32, Cpu>) -> Result<(), TopologyError> {
    let complete = attr_bitmap(machine, "complete_cpuset")?.unwrap_or_default();
    for id in complete {
        cpus.entry(id).or_insert(Cpu {
            id,
            package: None,
            core_id: None,
            core: id,
            numa_node: None,
            online: false,
        });
    }
    Ok(())
}

/// The one NUMA node of an export that has none: node 0, all online CPUs and the machine's
/// memory.
fn whole_machine_node(machine: Node, online: &BTreeSet<u32>) -> NumaNode {
    NumaNode {
        id: 0,
        cpus: online.iter().copied().collect(),
        memory_bytes: machine
            .attribute("local_memory")
            .and_then(|m| m.parse().ok())
            .unwrap_or(0),
    }
}

/// The export's top-level object (the Machine), after checking the root element and the
/// format version.
fn machine_object<'a, 'input>(
    doc: &'a Document<'input>,
) -> Result<Node<'a, 'input>, TopologyError> {
    let root = doc.root_element();
    if root.tag_name().name() != "topology" {
        return Err(bad_xml(format!(
            "root element is <{}>, expected <topology>",
            root.tag_name().name()
        )));
    }
    if let Some(v) = root.attribute("version") {
        let major = v.split('.').next().and_then(|m| m.parse::<u32>().ok());
        if !matches!(major, Some(2) | Some(3)) {
            return Err(bad_xml(format!(
                "format version {v} is not supported (2.0 and 3.0 are); re-export with hwloc 2 or 3"
            )));
        }
    }
    root.children()
        .find(|c| object_type(*c).is_some())
        .ok_or_else(|| TopologyError::Xml("no top-level <object> (Machine)".into()))
}

/// The online CPU a PU object is, with its package and core from its ancestors (its NUMA
/// node is filled in later).
fn pu_cpu(node: Node) -> Result<Cpu, TopologyError> {
    let Some(id) = attr_u32(node, "os_index") else {
        return Err(TopologyError::Xml("a PU has no os_index".into()));
    };
    let ancestors = || node.ancestors().filter(|a| object_type(*a).is_some());
    let core_obj = ancestors().find(|a| object_type(*a) == Some("Core"));
    let package = ancestors()
        .find(|a| object_type(*a) == Some("Package"))
        .and_then(|p| attr_u32(p, "os_index"));
    let core = core_obj
        .map(|c| {
            c.descendants()
                .filter(|d| object_type(*d) == Some("PU"))
                .filter_map(|d| attr_u32(d, "os_index"))
                .min()
                .unwrap_or(id)
        })
        .unwrap_or(id);
    Ok(Cpu {
        id,
        package,
        core_id: core_obj.and_then(|c| attr_u32(c, "os_index")),
        core,
        numa_node: None,
        online: true,
    })
}

/// The NUMA node a NUMANode object is; `index` (its position) stands in for a missing
/// os_index.
fn numa_node(node: Node, index: u32) -> Result<NumaNode, TopologyError> {
    let id = attr_u32(node, "os_index").unwrap_or(index);
    let cpus = attr_bitmap(node, "cpuset")?.unwrap_or_default();
    let memory_bytes = node
        .attribute("local_memory")
        .and_then(|m| m.trim().parse().ok())
        .unwrap_or(0);
    Ok(NumaNode {
        id,
        cpus,
        memory_bytes,
    })
}

/// The GPU a PCIDev object is, or `None` when it is not a GPU (or has no ids or bus id); its
/// locality is its nearest non-I/O ancestor's.
fn pci_gpu(node: Node) -> Result<Option<Gpu>, TopologyError> {
    let Some((class, vendor_id, device_id)) = pci_ids(node) else {
        return Ok(None);
    };
    let Some(vendor) = gpu_vendor(vendor_id, class) else {
        return Ok(None);
    };
    let Some(bus) = node.attribute("pci_busid") else {
        return Ok(None);
    };
    let parent = node
        .ancestors()
        .filter(|a| object_type(*a).is_some())
        .find(|a| object_type(*a).is_some_and(|t| !is_io(t)));
    let (local_cpus, nodeset) = match parent {
        Some(p) => (
            attr_bitmap(p, "cpuset")?.unwrap_or_default(),
            attr_bitmap(p, "nodeset")?.unwrap_or_default(),
        ),
        None => (Vec::new(), Vec::new()),
    };
    let osdevs: Vec<Node> = node
        .children()
        .filter(|c| object_type(*c) == Some("OSDev"))
        .collect();
    let uuid = osdevs
        .iter()
        .find_map(|o| info(*o, "NVIDIAUUID"))
        .map(str::to_string);
    let name = osdevs
        .iter()
        .find_map(|o| info(*o, "GPUModel"))
        .or_else(|| info(node, "PCIDevice"))
        .map(str::to_string);
    Ok(Some(Gpu {
        vendor,
        pci_bus_id: canonical_bus_id(bus),
        numa_node: (nodeset.len() == 1).then(|| nodeset[0]),
        local_cpus,
        uuid,
        minor: None,
        device_id: Some(device_id),
        name,
        mig: Vec::new(),
        mig_enabled: false,
        links: Vec::new(),
        partitioning: None,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bitmaps_are_read_most_significant_word_first() {
        assert_eq!(parse_bitmap("0x00000003").unwrap(), vec![0, 1]);
        assert_eq!(parse_bitmap("0x00000001,0x00000000").unwrap(), vec![32]);
        assert_eq!(
            parse_bitmap("0xffffff00,,0x0").unwrap(),
            (72..96).collect::<Vec<_>>()
        );
        assert_eq!(parse_bitmap("0xf...f,0x00000001").unwrap(), vec![0]);
        assert_eq!(parse_bitmap("").unwrap(), Vec::<u32>::new());
        assert!(parse_bitmap("0xzz").is_err());
    }

    #[test]
    fn pci_type_gives_class_vendor_device() {
        assert_eq!(
            parse_pci_type("0302 [10de:1094] [00de:0088] a1 00"),
            Some((0x030200, 0x10de, 0x1094))
        );
        assert_eq!(parse_pci_type("junk"), None);
    }

    #[test]
    fn rejects_non_hwloc_documents() {
        assert!(matches!(parse("<foo/>"), Err(TopologyError::Xml(_))));
        assert!(matches!(parse("not xml"), Err(TopologyError::Xml(_))));
        assert!(matches!(
            parse(r#"<topology version="1.0"><object type="Machine"/></topology>"#),
            Err(TopologyError::Xml(_))
        ));
        assert!(matches!(
            parse(r#"<topology version="2.0"><object type="Machine" cpuset="0x1"/></topology>"#),
            Err(TopologyError::Xml(_))
        ));
    }
}
