//! A run's provenance: where and on what it ran (node, agent, slice, each GPU's identity,
//! driver and VBIOS, its clocks, power limit, temperature and error counts at the start and the
//! end of the evaluation, the evaluator's version and, in docker mode, the image).
//!
//! The runner writes it as [`FILE`] beside `result.json`, which stays byte for byte kernelbot's;
//! the service takes it from the same place it takes the result (the build's artifacts, the
//! local job's directory), keeps it with the submission and shows it in the API. Everything in
//! it is what the node said: the service checks its size and shape, and [`Provenance::concerns`]
//! reads it for signs of an unhealthy GPU; it is not a secret and holds none (no environment,
//! no paths of the node beyond the GPU's bus id).
//!
//! The format is kernelkite's own: fields are added, never renamed or re-typed, and a reader
//! ignores what it does not know, so a node with a newer runner and a service with an older
//! one (or the reverse) still agree. Every field a node may not know is optional.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The file the runner writes beside `result.json`, and the artifact's name.
pub const FILE: &str = "provenance.json";

/// The format's version, written in every file (1: this one).
pub const FORMAT: u32 = 1;

/// The largest provenance file a reader takes: a node with 8 GPUs writes about 4 KiB.
pub const MAX_BYTES: u64 = 64 * 1024;

/// GPUs of one run kept (a node has at most 8 or 16).
pub const MAX_GPUS: usize = 16;
/// Clock event reasons kept per sample.
pub const MAX_REASONS: usize = 16;
/// Characters kept of any text a node wrote.
pub const MAX_TEXT: usize = 128;

/// Where and on what one run ran.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Provenance {
    /// [`FORMAT`].
    pub format: u32,
    /// The runner's (kernelkite's) version.
    pub kernelkite_version: String,
    /// The node's host name.
    pub node: String,
    /// The Buildkite agent that ran the job (`BUILDKITE_AGENT_NAME`); none in local mode.
    pub agent: Option<String>,
    /// The queue the run was for (`KERNELBOT_QUEUE`).
    pub queue: Option<String>,
    /// The slice the job held.
    pub slice: Option<SliceRef>,
    /// The image the job ran in (docker mode: its digest, `sha256:…`, when the node knows it).
    pub image: Option<String>,
    /// The GPU driver's version.
    pub driver: Option<String>,
    /// The job's GPUs, in the order the job sees them.
    pub gpus: Vec<Gpu>,
    /// When the evaluation started, milliseconds since the Unix epoch.
    pub started_ms: u64,
    /// When it ended.
    pub ended_ms: u64,
    /// [`Provenance::summary`], written by the service when it takes the file (what a node
    /// wrote here is replaced).
    pub summary: Option<String>,
    /// [`Provenance::concerns`] at the service's limits, written by the service likewise.
    pub concerns: Vec<String>,
    /// [`Provenance::faults`] at the service's limits, written by the service likewise.
    pub faults: Vec<String>,
}

/// The slice a job held, as the hooks exported it (`KERNELKITE_SLICE`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SliceRef {
    /// The slice's number on its node.
    pub index: u32,
    /// Its CPUs.
    pub cpus: Vec<u32>,
    /// Its memory limit, bytes.
    pub memory_bytes: u64,
}

/// One GPU a job ran on.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Gpu {
    /// `nvidia` or `amd`.
    pub vendor: String,
    /// Its model (`NVIDIA H100 80GB HBM3`).
    pub name: Option<String>,
    /// The GPU's UUID (NVIDIA `GPU-…`; AMD's `unique_id`).
    pub uuid: Option<String>,
    /// The MIG device the job held on it (`MIG-…`), or the AMD partition.
    pub partition: Option<String>,
    /// Its PCI bus id.
    pub pci_bus_id: Option<String>,
    /// Its VBIOS version.
    pub vbios: Option<String>,
    /// The highest SM clock it supports, MHz.
    pub max_sm_clock_mhz: Option<u32>,
    /// Its state when the evaluation started.
    pub start: Option<Sample>,
    /// Its state when the evaluation ended.
    pub end: Option<Sample>,
}

/// A GPU's state at one moment; a field the GPU does not report is `None`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Sample {
    /// SM (AMD: shader) clock, MHz.
    pub sm_clock_mhz: Option<u32>,
    /// Memory clock, MHz.
    pub mem_clock_mhz: Option<u32>,
    /// The enforced power limit, watts.
    pub power_limit_w: Option<f64>,
    /// Die temperature, °C.
    pub temperature_c: Option<u32>,
    /// Uncorrected ECC errors since the driver loaded.
    pub ecc_uncorrected: Option<u64>,
    /// Why the clocks were held down (NVML's clock event reasons, idle left out).
    pub throttle: Vec<String>,
}

/// The thresholds [`Provenance::concerns`] reads a run against.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// A die at or above this is too hot to time on, °C (NVIDIA's data-centre GPUs start
    /// slowing down near 85-90 °C).
    pub max_temperature_c: u32,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_temperature_c: 85,
        }
    }
}

/// The clock event reasons that say the GPU ran slower than it should have: hardware
/// slowdowns, thermal ones and the power brake. A power cap the operator set, or applications
/// clocks, are settings, not faults.
const UNHEALTHY_THROTTLE: &[&str] = &[
    "hw_slowdown",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
];

impl Provenance {
    /// Parses a provenance file, refusing one over [`MAX_BYTES`] or not in this shape.
    pub fn parse(bytes: &[u8]) -> Result<Provenance, ParseError> {
        if bytes.len() as u64 > MAX_BYTES {
            return Err(ParseError::TooLarge(bytes.len() as u64));
        }
        // An object naming its format: serde would take a struct from an array too, and every
        // field has a default, so `{}` alone says nothing of where a run ran.
        let value: serde_json::Value = serde_json::from_slice(bytes).map_err(ParseError::Json)?;
        let format = value.get("format").and_then(serde_json::Value::as_u64);
        if format.unwrap_or(0) < 1 {
            return Err(ParseError::NoFormat);
        }
        serde_json::from_value(value).map_err(ParseError::Json)
    }

    /// The provenance as the service keeps it: [`Provenance::summary`] and
    /// [`Provenance::concerns`] (at `limits`) computed here from the readings, whatever the
    /// node wrote in those fields.
    pub fn reviewed(mut self, limits: &Limits) -> Provenance {
        self.tidy();
        self.summary = Some(self.summary());
        self.concerns = self.concerns(limits);
        self.faults = self.faults(limits);
        self
    }

    /// Keeps what the node wrote within bounds before anyone shows it: at most
    /// [`MAX_GPUS`] GPUs and [`MAX_REASONS`] clock event reasons each, every text printable and
    /// at most [`MAX_TEXT`] characters.
    fn tidy(&mut self) {
        fn text(s: &mut String) {
            *s = s
                .chars()
                .filter(|c| !c.is_control())
                .take(MAX_TEXT)
                .collect();
        }
        fn opt(s: &mut Option<String>) {
            if let Some(s) = s {
                text(s);
            }
        }
        text(&mut self.kernelkite_version);
        text(&mut self.node);
        for s in [
            &mut self.agent,
            &mut self.queue,
            &mut self.image,
            &mut self.driver,
        ] {
            opt(s);
        }
        self.gpus.truncate(MAX_GPUS);
        for g in &mut self.gpus {
            text(&mut g.vendor);
            for s in [
                &mut g.name,
                &mut g.uuid,
                &mut g.partition,
                &mut g.pci_bus_id,
                &mut g.vbios,
            ] {
                opt(s);
            }
            for s in [&mut g.start, &mut g.end].into_iter().flatten() {
                s.throttle.truncate(MAX_REASONS);
                s.throttle.iter_mut().for_each(text);
            }
        }
        if let Some(s) = &mut self.slice {
            s.cpus.truncate(4096);
        }
    }

    /// Why this run's GPUs may not have been healthy, one line each (empty: nothing seen).
    /// Reads only what the node reported; a GPU that reports nothing raises nothing.
    pub fn concerns(&self, limits: &Limits) -> Vec<String> {
        self.readings(limits).into_iter().map(|(c, _)| c).collect()
    }

    /// The [`Provenance::concerns`] a run cannot cause by itself: hardware faults
    /// (uncorrected ECC errors, the power brake) and settings changed under it (the power
    /// limit). Heat and thermal or hardware slowdowns are left out: a submission that loads
    /// its GPU hard ends hot, and that says nothing of the GPU.
    pub fn faults(&self, limits: &Limits) -> Vec<String> {
        self.readings(limits)
            .into_iter()
            .filter_map(|(c, fault)| fault.then_some(c))
            .collect()
    }

    /// Each concern, and whether it is a fault (see [`Provenance::faults`]).
    fn readings(&self, limits: &Limits) -> Vec<(String, bool)> {
        let mut out: Vec<(String, bool)> = Vec::new();
        for (i, g) in self.gpus.iter().enumerate() {
            let who = g.uuid.as_deref().or(g.pci_bus_id.as_deref()).unwrap_or("?");
            let who = format!("GPU {i} ({who})");
            for s in [&g.start, &g.end].into_iter().flatten() {
                if let Some(t) = s.temperature_c.filter(|t| *t >= limits.max_temperature_c) {
                    out.push((
                        format!("{who} at {t} °C (limit {} °C)", limits.max_temperature_c),
                        false,
                    ));
                }
                for r in s
                    .throttle
                    .iter()
                    .filter(|r| UNHEALTHY_THROTTLE.contains(&r.as_str()))
                {
                    let fault = r == "hw_power_brake_slowdown";
                    out.push((format!("{who} clocks held down: {r}"), fault));
                }
            }
            let ecc = |s: &Option<Sample>| s.as_ref().and_then(|s| s.ecc_uncorrected);
            match (ecc(&g.start), ecc(&g.end)) {
                (Some(a), Some(b)) if b > a => out.push((
                    format!("{who} uncorrected ECC errors rose from {a} to {b}"),
                    true,
                )),
                (_, Some(b)) if b > 0 => {
                    out.push((format!("{who} has {b} uncorrected ECC errors"), true))
                }
                _ => {}
            }
            let limit = |s: &Option<Sample>| s.as_ref().and_then(|s| s.power_limit_w);
            if let (Some(a), Some(b)) = (limit(&g.start), limit(&g.end)) {
                if (a - b).abs() >= 1.0 {
                    out.push((
                        format!("{who} power limit changed during the run ({a:.0} W to {b:.0} W)"),
                        true,
                    ));
                }
            }
        }
        out.dedup();
        out
    }

    /// One line for people: where, on what, in what state (the launcher adds it to
    /// kernelbot's report).
    pub fn summary(&self) -> String {
        let mut where_ = self.node.clone();
        if let Some(a) = &self.agent {
            where_ = format!("{where_}/{a}");
        }
        if let Some(s) = &self.slice {
            where_ = format!("{where_} slice {}", s.index);
        }
        let gpus: Vec<String> = self.gpus.iter().map(Gpu::summary).collect();
        let mut line = format!("ran on {where_}");
        if !gpus.is_empty() {
            line = format!("{line}: {}", gpus.join("; "));
        }
        if let Some(d) = &self.driver {
            line = format!("{line}; driver {d}");
        }
        if let Some(i) = &self.image {
            line = format!("{line}; image {i}");
        }
        format!("{line}; kernelkite {}", self.kernelkite_version)
    }
}

impl Gpu {
    fn summary(&self) -> String {
        let mut parts = vec![self.name.clone().unwrap_or_else(|| self.vendor.clone())];
        if let Some(u) = self.partition.as_ref().or(self.uuid.as_ref()) {
            parts.push(format!("({u})"));
        }
        let end = self.end.as_ref().or(self.start.as_ref());
        if let Some(c) = end.and_then(|s| s.sm_clock_mhz) {
            parts.push(format!("{c} MHz"));
        }
        let temp = |s: &Option<Sample>| s.as_ref().and_then(|s| s.temperature_c);
        match (temp(&self.start), temp(&self.end)) {
            (Some(a), Some(b)) => parts.push(format!("{a}→{b} °C")),
            (Some(t), None) | (None, Some(t)) => parts.push(format!("{t} °C")),
            _ => {}
        }
        if let Some(w) = end.and_then(|s| s.power_limit_w) {
            parts.push(format!("{w:.0} W cap"));
        }
        if let Some(e) = end.and_then(|s| s.ecc_uncorrected) {
            parts.push(format!("ECC {e}"));
        }
        parts.join(" ")
    }
}

/// Why bytes are not a provenance file.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    /// Over [`MAX_BYTES`].
    #[error("provenance.json is {0} bytes, over the {MAX_BYTES}-byte limit")]
    TooLarge(u64),
    /// Not an object with a `format` of 1 or more.
    #[error("provenance.json is not an object naming its format (\"format\": 1)")]
    NoFormat,
    /// Not JSON of this shape.
    #[error("provenance.json is not kernelkite's provenance format: {0}")]
    Json(#[source] serde_json::Error),
}

/// What an NVIDIA reading says, as a [`Sample`] (milliwatts to watts).
pub fn sample_of(r: &crate::nvml::Reading) -> Sample {
    Sample {
        sm_clock_mhz: r.sm_clock_mhz,
        mem_clock_mhz: r.mem_clock_mhz,
        power_limit_w: r.power_limit_mw.map(|mw| f64::from(mw) / 1000.0),
        temperature_c: r.temperature_c,
        ecc_uncorrected: r.ecc_uncorrected,
        throttle: r.throttle.iter().map(|s| s.to_string()).collect(),
    }
}

/// An AMD GPU as amdgpu's sysfs shows it, under an injected root (`/`), by bus id
/// (`0000:c1:00.0`). The files are the amdgpu driver's (its `unique_id`, `vbios_version`,
/// `pp_dpm_sclk`/`pp_dpm_mclk` with the current level marked `*`, and the hwmon directory's
/// `temp1_input` in millidegrees and `power1_cap` in microwatts); a file that is not there
/// leaves its field empty.
pub struct AmdSysfs {
    device: PathBuf,
}

impl AmdSysfs {
    /// The GPU at `bus_id` under `root`.
    pub fn new(root: &Path, bus_id: &str) -> AmdSysfs {
        AmdSysfs {
            device: root.join("sys/bus/pci/devices").join(bus_id.to_lowercase()),
        }
    }

    fn read(&self, name: &str) -> Option<String> {
        let text = std::fs::read_to_string(self.device.join(name)).ok()?;
        let text = text.trim();
        (!text.is_empty()).then(|| text.to_string())
    }

    fn hwmon(&self, name: &str) -> Option<u64> {
        let dir = std::fs::read_dir(self.device.join("hwmon")).ok()?;
        dir.flatten()
            .find_map(|e| std::fs::read_to_string(e.path().join(name)).ok())
            .and_then(|t| t.trim().parse().ok())
    }

    /// Its `unique_id`.
    pub fn unique_id(&self) -> Option<String> {
        self.read("unique_id")
    }

    /// Its VBIOS version.
    pub fn vbios(&self) -> Option<String> {
        self.read("vbios_version")
    }

    /// Its state now.
    pub fn sample(&self) -> Sample {
        Sample {
            sm_clock_mhz: self.read("pp_dpm_sclk").and_then(|t| current_level(&t)),
            mem_clock_mhz: self.read("pp_dpm_mclk").and_then(|t| current_level(&t)),
            power_limit_w: self.hwmon("power1_cap").map(|uw| uw as f64 / 1e6),
            temperature_c: self.hwmon("temp1_input").map(|md| (md / 1000) as u32),
            ecc_uncorrected: self
                .read("ras/umc_err_count")
                .and_then(|t| ras_uncorrected(&t)),
            throttle: Vec::new(),
        }
    }

    /// The highest shader clock its DPM table lists, MHz.
    pub fn max_sm_clock_mhz(&self) -> Option<u32> {
        let table = self.read("pp_dpm_sclk")?;
        table.lines().filter_map(level_mhz).max()
    }
}

/// A DPM level's clock: `1: 1700Mhz *` → 1700.
fn level_mhz(line: &str) -> Option<u32> {
    let value = line.split(':').nth(1)?.trim();
    let digits: String = value.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The level marked `*` in a `pp_dpm_*` table.
fn current_level(table: &str) -> Option<u32> {
    table
        .lines()
        .find(|l| l.trim_end().ends_with('*'))
        .and_then(level_mhz)
}

/// amdgpu's RAS count file: `ue: N` (uncorrected) and `ce: M` lines.
fn ras_uncorrected(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("ue:"))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(start: Sample, end: Sample) -> Provenance {
        Provenance {
            format: FORMAT,
            kernelkite_version: "1.2.3".into(),
            node: "n1".into(),
            agent: Some("n1-gpu0".into()),
            slice: Some(SliceRef {
                index: 0,
                cpus: vec![0, 1],
                memory_bytes: 1 << 30,
            }),
            gpus: vec![Gpu {
                vendor: "nvidia".into(),
                name: Some("NVIDIA H100".into()),
                uuid: Some("GPU-1".into()),
                start: Some(start),
                end: Some(end),
                ..Gpu::default()
            }],
            ..Provenance::default()
        }
    }

    fn healthy() -> Sample {
        Sample {
            sm_clock_mhz: Some(1980),
            power_limit_w: Some(700.0),
            temperature_c: Some(60),
            ecc_uncorrected: Some(0),
            throttle: vec!["sw_power_cap".into()],
            ..Sample::default()
        }
    }

    #[test]
    fn a_healthy_run_raises_nothing_and_each_fault_raises_its_own_line() {
        assert!(gpu(healthy(), healthy())
            .concerns(&Limits::default())
            .is_empty());
        let hot = Sample {
            temperature_c: Some(91),
            ..healthy()
        };
        let slowed = Sample {
            throttle: vec!["hw_thermal_slowdown".into()],
            ..healthy()
        };
        let ecc = Sample {
            ecc_uncorrected: Some(2),
            ..healthy()
        };
        let capped = Sample {
            power_limit_w: Some(400.0),
            ..healthy()
        };
        for (end, says) in [
            (hot, "91 °C"),
            (slowed, "hw_thermal_slowdown"),
            (ecc, "rose from 0 to 2"),
            (capped, "700 W to 400 W"),
        ] {
            let c = gpu(healthy(), end).concerns(&Limits::default());
            assert_eq!(c.len(), 1, "{c:?}");
            assert!(c[0].contains(says), "{c:?} lacks {says}");
            assert!(c[0].contains("GPU-1"), "{c:?}");
        }
    }

    #[test]
    fn heat_is_a_concern_but_only_hardware_faults_are_faults() {
        let hot = Sample {
            temperature_c: Some(95),
            throttle: vec!["hw_thermal_slowdown".into(), "hw_slowdown".into()],
            ..healthy()
        };
        let p = gpu(healthy(), hot);
        assert_eq!(p.concerns(&Limits::default()).len(), 3);
        assert!(
            p.faults(&Limits::default()).is_empty(),
            "a run can make its GPU hot"
        );
        let broken = Sample {
            ecc_uncorrected: Some(1),
            throttle: vec!["hw_power_brake_slowdown".into()],
            ..healthy()
        };
        assert_eq!(gpu(healthy(), broken).faults(&Limits::default()).len(), 2);
    }

    #[test]
    fn a_file_round_trips_ignores_unknown_fields_and_refuses_the_oversized() {
        let p = gpu(healthy(), healthy());
        let text = serde_json::to_string(&p).unwrap();
        assert_eq!(Provenance::parse(text.as_bytes()).unwrap(), p);
        let newer = text.replacen('{', "{\"later_field\":[1,2],", 1);
        assert_eq!(Provenance::parse(newer.as_bytes()).unwrap(), p);
        let big = vec![b' '; MAX_BYTES as usize + 1];
        assert!(matches!(
            Provenance::parse(&big),
            Err(ParseError::TooLarge(_))
        ));
        assert!(Provenance::parse(b"[1]").is_err());
        assert!(Provenance::parse(b"{}").is_err());
        assert!(Provenance::parse(b"{\"format\": 1, \"gpus\": 3}").is_err());
    }

    #[test]
    fn the_summary_names_the_node_agent_slice_gpu_and_its_state() {
        let line = gpu(
            healthy(),
            Sample {
                temperature_c: Some(71),
                ..healthy()
            },
        )
        .summary();
        assert_eq!(
            line,
            "ran on n1/n1-gpu0 slice 0: NVIDIA H100 (GPU-1) 1980 MHz 60→71 °C 700 W cap ECC 0; kernelkite 1.2.3"
        );
    }

    #[test]
    fn amd_state_comes_from_amdgpu_sysfs_files() {
        let root = tempfile::tempdir().unwrap();
        let dev = root.path().join("sys/bus/pci/devices/0000:c1:00.0");
        std::fs::create_dir_all(dev.join("hwmon/hwmon3")).unwrap();
        std::fs::create_dir_all(dev.join("ras")).unwrap();
        std::fs::write(dev.join("unique_id"), "8a1c2e3f\n").unwrap();
        std::fs::write(dev.join("vbios_version"), "113-M3000100-102\n").unwrap();
        std::fs::write(
            dev.join("pp_dpm_sclk"),
            "0: 500Mhz\n1: 1700Mhz *\n2: 2100Mhz\n",
        )
        .unwrap();
        std::fs::write(dev.join("pp_dpm_mclk"), "0: 900Mhz\n1: 1300Mhz *\n").unwrap();
        std::fs::write(dev.join("hwmon/hwmon3/temp1_input"), "47000\n").unwrap();
        std::fs::write(dev.join("hwmon/hwmon3/power1_cap"), "750000000\n").unwrap();
        std::fs::write(dev.join("ras/umc_err_count"), "ue: 3\nce: 10\n").unwrap();
        let amd = AmdSysfs::new(root.path(), "0000:C1:00.0");
        assert_eq!(amd.unique_id().as_deref(), Some("8a1c2e3f"));
        assert_eq!(amd.vbios().as_deref(), Some("113-M3000100-102"));
        assert_eq!(amd.max_sm_clock_mhz(), Some(2100));
        let s = amd.sample();
        assert_eq!(s.sm_clock_mhz, Some(1700));
        assert_eq!(s.mem_clock_mhz, Some(1300));
        assert_eq!(s.temperature_c, Some(47));
        assert_eq!(s.power_limit_w, Some(750.0));
        assert_eq!(s.ecc_uncorrected, Some(3));
        let missing = AmdSysfs::new(root.path(), "0000:c2:00.0");
        assert_eq!(missing.sample(), Sample::default());
    }
}
