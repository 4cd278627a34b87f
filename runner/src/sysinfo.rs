//! `SystemInfo`: what the job ran on.
//!
//! kernelbot asks torch; the runner must not pay a torch import (seconds) on every job, so:
//! GPUs come from NVML when `libnvidia-ml.so.1` loads and counts any (its answer stands: the
//! GPUs it lets this process use, that the variable names and whose node opens), `nvidia-smi`
//! only where it does not, else `rocm-smi`, each external tool bounded in time; never from
//! `/proc/driver/nvidia/gpus`, which lists the node's GPUs, not the job's; the CPU from
//! `/proc/cpuinfo` (kernelbot's rule); the platform string as Python's `platform.platform()`
//! writes it; and the torch version from torch's own `version.py` next to the interpreter (or,
//! on request, by importing it).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::process::{self, Spec};
use kernelkite_kernelbot::result::SystemInfo;

/// How to find the torch version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TorchProbe {
    /// Read `torch/version.py` in the interpreter's site-packages (no Python start).
    Files,
    /// `python3 -c 'import torch'` with a time limit (exact, but costs the import).
    Import,
    /// Leave `torch` empty.
    Off,
}

/// Where and how to look. Roots are injectable so the logic is testable.
#[derive(Debug, Clone)]
pub struct Probe {
    /// `/proc/cpuinfo`, where the CPU model is read.
    pub cpuinfo: PathBuf,
    /// Ask NVML first (off in tests that fake `nvidia-smi`).
    pub use_nvml: bool,
    /// The interpreter whose torch is reported.
    pub python: String,
    /// How to find the torch version.
    pub torch: TorchProbe,
    /// Limit for each external tool (`nvidia-smi`, `rocm-smi`, the torch import).
    pub tool_timeout: Duration,
    /// Where sysfs is mounted (`/`): AMD GPUs are counted from its KFD topology.
    pub sys_root: PathBuf,
    /// The job's `/dev`: an AMD GPU whose render node is not there is not the job's.
    pub dev_root: PathBuf,
}

impl Default for Probe {
    fn default() -> Probe {
        Probe {
            cpuinfo: PathBuf::from("/proc/cpuinfo"),
            use_nvml: true,
            python: "python3".into(),
            torch: TorchProbe::Files,
            tool_timeout: Duration::from_secs(10),
            sys_root: PathBuf::from("/"),
            dev_root: PathBuf::from("/dev"),
        }
    }
}

/// GPUs seen on this machine.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gpus {
    /// The first visible GPU's name.
    pub name: String,
    /// How many GPUs a program sees (after `CUDA_VISIBLE_DEVICES`).
    pub count: u32,
    /// `CUDA` or `ROCm`.
    pub runtime: String,
}

/// Gathers everything. Never fails: what cannot be found stays empty (`device_count` 0).
pub fn collect(probe: &Probe) -> SystemInfo {
    let gpus = detect_gpus(probe);
    SystemInfo {
        gpu: gpus.name,
        device_count: gpus.count,
        cpu: std::fs::read_to_string(&probe.cpuinfo)
            .map(|t| cpu_model(&t))
            .unwrap_or_default(),
        runtime: gpus.runtime,
        platform: platform_string(),
        torch: torch_version(probe),
        hostname: hostname(),
    }
}

/// The GPUs, from NVML, else `nvidia-smi`, else AMD's (the KFD topology, `rocm-smi`'s name);
/// none found is no GPU. Where NVML loads and counts a GPU its answer stands, zero included:
/// `nvidia-smi` is an NVML client itself, and in a job it would list GPUs NVML refuses.
pub fn detect_gpus(probe: &Probe) -> Gpus {
    if probe.use_nvml {
        if let Some(g) = nvml_gpus(&probe.dev_root) {
            return g;
        }
    }
    if let Some(out) = tool_output(
        "nvidia-smi",
        &["--query-gpu=name", "--format=csv,noheader"],
        probe.tool_timeout,
    ) {
        if let Some(g) = parse_nvidia_smi(&out) {
            return g;
        }
    }
    // AMD: counted as ROCm itself enumerates (the KFD topology, the render nodes this /dev
    // holds, ROCR_VISIBLE_DEVICES then HIP_VISIBLE_DEVICES: kernelkite_sys::kfd), not by
    // rocm-smi's cards, which ignores all three; rocm-smi gives the name.
    let kfd_gpus = kernelkite_sys::kfd::gpus(&probe.sys_root);
    let no_kfd = kfd_gpus.is_empty();
    let visible =
        kernelkite_sys::kfd::visible_among(kfd_gpus, &probe.dev_root, &|k| std::env::var(k).ok());
    let named = tool_output(
        "rocm-smi",
        &["--showproductname", "--json"],
        probe.tool_timeout,
    )
    .and_then(|out| parse_rocm_smi(&out));
    match (named, no_kfd) {
        // No KFD topology to read (sysfs not in the job's view): rocm-smi's count stands, as
        // before; rocm-smi itself reads the driver, so a real node has one.
        (Some(g), true) => g,
        (Some(g), false) => Gpus {
            count: visible.len() as u32,
            ..g
        },
        (None, false) => Gpus {
            name: String::new(),
            count: visible.len() as u32,
            runtime: "ROCm".into(),
        },
        (None, true) => Gpus::default(),
    }
}

/// Runs a tool with a time limit; its stdout when it exits 0.
fn tool_output(program: &str, args: &[&str], timeout: Duration) -> Option<String> {
    // Looking first saves a fork and exec per absent tool on every job.
    find_on_path(program)?;
    let spec = Spec {
        program: program.into(),
        args: args.iter().map(OsString::from).collect(),
        // Not the temporary directory: Python puts the working directory first on its path,
        // and in the sandbox another uid of the job (the submission's) may write there.
        cwd: PathBuf::from("/"),
        env: vec![],
        env_remove: vec![],
        timeout,
        popcorn: false,
        reap_orphans: false,
        proc_root: PathBuf::from("/proc"),
        guard: None,
    };
    let out = process::run(&spec).ok()?;
    if out.exit_code != 0 || out.timed_out {
        return None;
    }
    Some(out.stdout.finish())
}

/// `nvidia-smi --query-gpu=name --format=csv,noheader`: one name per line, honouring
/// `CUDA_VISIBLE_DEVICES` as torch would.
pub fn parse_nvidia_smi(out: &str) -> Option<Gpus> {
    let names: Vec<&str> = out
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let first = *names.first()?;
    let count = visible_count(
        names.len() as u32,
        std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
    );
    Some(Gpus {
        name: first.to_string(),
        count,
        runtime: "CUDA".into(),
    })
}

/// `rocm-smi --showproductname --json`: `{"card0": {"Card Series": ...}, ...}`.
pub fn parse_rocm_smi(out: &str) -> Option<Gpus> {
    let v: serde_json::Map<String, serde_json::Value> = serde_json::from_str(out).ok()?;
    let cards: Vec<&serde_json::Value> = v
        .iter()
        .filter(|(k, _)| k.starts_with("card"))
        .map(|(_, c)| c)
        .collect();
    let first = cards.first()?;
    let name = first
        .get("Card Series")
        .and_then(|s| s.as_str())
        .unwrap_or_default();
    Some(Gpus {
        name: name.to_string(),
        count: cards.len() as u32,
        runtime: "ROCm".into(),
    })
}

/// How many of `total` devices a CUDA program sees under `CUDA_VISIBLE_DEVICES`.
pub fn visible_count(total: u32, visible: Option<&str>) -> u32 {
    match visible {
        None => total,
        Some(v) => {
            let n = v
                .split(',')
                .map(str::trim)
                .take_while(|s| !s.is_empty() && !s.starts_with('-'))
                .count();
            (n as u32).min(total)
        }
    }
}

/// kernelbot's CPU rule: the (last) `model name`, or `vendor_id` when that says `unknown`.
pub fn cpu_model(cpuinfo: &str) -> String {
    let mut model = String::new();
    let mut vendor = String::new();
    for line in cpuinfo.lines() {
        let (k, v) = line.split_once(':').unwrap_or((line, ""));
        match kernelkite_kernelbot::pyrepr::strip(k) {
            "model name" => model = kernelkite_kernelbot::pyrepr::strip(v).to_string(),
            "vendor_id" => vendor = kernelkite_kernelbot::pyrepr::strip(v).to_string(),
            _ => {}
        }
    }
    if model == "unknown" {
        vendor
    } else {
        model
    }
}

/// Python's `platform.platform()` on Linux: `Linux-<release>-<machine>-with-glibc<ver>`.
pub fn platform_string() -> String {
    let u = rustix::system::uname();
    let field = |f: &std::ffi::CStr| f.to_string_lossy().into_owned();
    let (system, release, machine) = (field(u.sysname()), field(u.release()), field(u.machine()));
    let libc = kernelkite_sys::raw::glibc_version()
        .map(|v| format!("glibc{v}"))
        .unwrap_or_default();
    format_platform(&system, &release, &machine, &libc)
}

/// Joins like Python's `platform._platform`: non-empty parts with `-`, odd characters
/// replaced, no doubled dashes.
pub fn format_platform(system: &str, release: &str, machine: &str, libc: &str) -> String {
    let mut parts = vec![system, release, machine];
    if !libc.is_empty() {
        parts.push("with");
        parts.push(libc);
    }
    let mut s = parts
        .iter()
        .map(|p| p.trim())
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("-");
    for c in [' ', '/', '\\', ':', ';', '"', '(', ')'] {
        s = s.replace(c, if c == ' ' { "_" } else { "-" });
    }
    s = s.replace("unknown", "");
    while s.contains("--") {
        s = s.replace("--", "-");
    }
    s.trim_end_matches('-').to_string()
}

/// The host name, as `gethostname(2)` (and Python's `socket.gethostname()`) gives it.
pub use kernelkite_sys::host::name as hostname;

/// The torch version as the probe says to find it; empty when unknown.
pub fn torch_version(probe: &Probe) -> String {
    match probe.torch {
        TorchProbe::Off => String::new(),
        TorchProbe::Files => {
            torch_from_files(&probe.python, std::env::var_os("PYTHONPATH")).unwrap_or_default()
        }
        TorchProbe::Import => tool_output(
            &probe.python,
            // `-s`: no user site directory (the job's HOME), only the node's installs.
            &["-s", "-c", "import torch; print(torch.__version__)"],
            probe.tool_timeout,
        )
        .map(|s| s.trim().to_string())
        .unwrap_or_default(),
    }
}

/// Finds `torch/version.py` where `python` would import torch from and reads `__version__`.
pub fn torch_from_files(python: &str, pythonpath: Option<OsString>) -> Option<String> {
    let exe = find_on_path(python)?;
    let mut dirs: Vec<PathBuf> = pythonpath.iter().flat_map(std::env::split_paths).collect();
    let resolved = std::fs::canonicalize(&exe).unwrap_or_else(|_| exe.clone());
    let version_dir = resolved
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .filter(|n| n.starts_with("python3."));
    // A venv's bin/python3 links to the base interpreter: look in both prefixes.
    for prefix in [
        exe.parent().and_then(Path::parent),
        resolved.parent().and_then(Path::parent),
    ]
    .into_iter()
    .flatten()
    {
        dirs.extend(site_dirs(&prefix.join("lib"), version_dir.as_deref()));
        dirs.extend(site_dirs(&prefix.join("local/lib"), version_dir.as_deref()));
    }
    if let Some(home) = std::env::var_os("HOME") {
        dirs.extend(site_dirs(
            &PathBuf::from(home).join(".local/lib"),
            version_dir.as_deref(),
        ));
    }
    dirs.push(PathBuf::from("/usr/lib/python3/dist-packages"));
    dirs.into_iter()
        .find_map(|d| read_torch_version(&d.join("torch/version.py")))
}

fn site_dirs(lib: &Path, version_dir: Option<&str>) -> Vec<PathBuf> {
    let mut names: Vec<String> = match version_dir {
        Some(v) => vec![v.to_string()],
        None => std::fs::read_dir(lib)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with("python3"))
                    .collect()
            })
            .unwrap_or_default(),
    };
    names.sort();
    names
        .iter()
        .flat_map(|n| {
            [
                lib.join(n).join("site-packages"),
                lib.join(n).join("dist-packages"),
            ]
        })
        .collect()
}

/// `__version__ = '...'` from a torch `version.py`.
pub fn read_torch_version(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| {
        let rest = l
            .strip_prefix("__version__")?
            .trim_start()
            .strip_prefix('=')?
            .trim();
        let q = rest.chars().next().filter(|c| *c == '\'' || *c == '"')?;
        let inner = &rest[1..];
        Some(inner[..inner.find(q)?].to_string())
    })
}

/// `which`: the first executable `name` on `PATH` (or `name` itself when it has a slash).
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    which::which(name).ok()
}

/// Whether `p` is a file someone may execute. For paths taken as given (`--nvcc`, the CUDA
/// install fallbacks), which `which` would look up on `PATH` when they have no slash.
pub fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Whether NVML (`libnvidia-ml.so.1`) loads on this machine; when it does, it is the GPU source.
pub fn nvml_available() -> bool {
    kernelkite_sys::nvml::Nvml::load().is_ok()
}

/// The GPUs NVML lets this process use, honouring `CUDA_VISIBLE_DEVICES` as torch would: the
/// name is the first visible GPU's. `None` only when NVML does not load or counts no GPU at
/// all (a node without NVIDIA GPUs, where AMD's are looked for); once it counts one, its answer
/// is the answer, an error or a job allowed none of them being no usable GPU.
fn nvml_gpus(dev_root: &Path) -> Option<Gpus> {
    let nvml = kernelkite_sys::nvml::Nvml::load().ok()?;
    let none = Gpus {
        runtime: "CUDA".into(),
        ..Gpus::default()
    };
    match nvml.device_count() {
        Ok(0) => return None,
        Ok(_) => {}
        Err(e) => {
            tracing::warn!("cannot count the GPUs through NVML ({e}): reporting none");
            return Some(none);
        }
    }
    let devices = match nvml.devices() {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!("cannot list the GPUs through NVML ({e}): reporting none");
            return Some(none);
        }
    };
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let usable = usable_nvidia(&devices, visible.as_deref(), dev_root);
    let Some(first) = usable.first().copied().or_else(|| devices.first()) else {
        return Some(none);
    };
    Some(Gpus {
        name: first.name.clone().unwrap_or_default(),
        count: usable.len() as u32,
        runtime: "CUDA".into(),
    })
}

/// The GPUs a CUDA program can use: `CUDA_VISIBLE_DEVICES` resolved against NVML's GPUs
/// (indices, or UUID prefixes `GPU-…`; the list ends at the first token that names none or
/// repeats one, as CUDA reads it), each kept only when its `/dev/nvidia<minor>` under
/// `dev_root` opens: a job whose device node is missing cannot use the GPU, whatever the
/// variable says. A MIG device's uuid (`MIG-…`) stands for its GPU, and ends the list.
pub fn usable_nvidia<'a>(
    devices: &'a [kernelkite_sys::nvml::DeviceInfo],
    visible: Option<&str>,
    dev_root: &Path,
) -> Vec<&'a kernelkite_sys::nvml::DeviceInfo> {
    visible_nvidia(devices, visible)
        .into_iter()
        .filter(|d| {
            d.minor.is_none_or(|m| {
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(dev_root.join(format!("nvidia{m}")))
                    .is_ok()
            })
        })
        .collect()
}

/// NVML's GPUs that `CUDA_VISIBLE_DEVICES` names, as CUDA reads it ([`usable_nvidia`] without
/// the device-node check: NVML already leaves out what the process may not open).
pub fn visible_nvidia<'a>(
    devices: &'a [kernelkite_sys::nvml::DeviceInfo],
    visible: Option<&str>,
) -> Vec<&'a kernelkite_sys::nvml::DeviceInfo> {
    let chosen: Vec<usize> = match visible {
        None => (0..devices.len()).collect(),
        Some(v) => {
            let mut chosen = Vec::new();
            for token in v.split(',').map(str::trim) {
                let found = if token.starts_with("GPU-") || token.starts_with("MIG-") {
                    // A MIG device is named by its own uuid and stands for its GPU here; a
                    // prefix naming more than one uuid, GPU or MIG device, names none.
                    let mut m = devices.iter().enumerate().flat_map(|(i, d)| {
                        d.uuid
                            .iter()
                            .chain(d.mig.iter().map(|m| &m.uuid))
                            .filter(|u| u.starts_with(token))
                            .map(move |_| i)
                    });
                    match (m.next(), m.next()) {
                        (Some(i), None) => Some(i),
                        _ => None,
                    }
                } else {
                    token.parse::<usize>().ok().filter(|i| *i < devices.len())
                };
                match found {
                    Some(i) if !chosen.contains(&i) => chosen.push(i),
                    _ => break,
                }
                // CUDA enumerates one MIG device per process (NVIDIA's MIG user guide, "CUDA
                // Device Enumeration"): the list ends after the first.
                if token.starts_with("MIG-") {
                    break;
                }
            }
            chosen
        }
    };
    chosen.into_iter().map(|i| &devices[i]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_rule_follows_kernelbot() {
        assert_eq!(
            cpu_model("vendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654\n"),
            "AMD EPYC 9654"
        );
        assert_eq!(
            cpu_model("vendor_id : GenuineIntel\nmodel name : unknown\n"),
            "GenuineIntel"
        );
        assert_eq!(cpu_model("processor : 0\n"), "");
    }

    #[test]
    fn smi_outputs_parse() {
        let g = parse_nvidia_smi("NVIDIA H100 80GB HBM3\nNVIDIA H100 80GB HBM3\n").unwrap();
        assert_eq!(g.name, "NVIDIA H100 80GB HBM3");
        assert_eq!(g.runtime, "CUDA");
        assert!(parse_nvidia_smi("\n").is_none());
        let r = parse_rocm_smi(r#"{"card0": {"Card Series": "AMD Instinct MI300X"}, "card1": {"Card Series": "AMD Instinct MI300X"}}"#).unwrap();
        assert_eq!(
            r,
            Gpus {
                name: "AMD Instinct MI300X".into(),
                count: 2,
                runtime: "ROCm".into()
            }
        );
        assert!(parse_rocm_smi("not json").is_none());
    }

    #[test]
    fn visible_devices_limit_the_count() {
        assert_eq!(visible_count(8, None), 8);
        assert_eq!(visible_count(8, Some("3")), 1);
        assert_eq!(visible_count(8, Some("0,1")), 2);
        assert_eq!(visible_count(8, Some("")), 0);
        assert_eq!(visible_count(8, Some("0,-1,2")), 1);
        assert_eq!(visible_count(1, Some("0,1,2")), 1);
    }

    #[test]
    fn platform_matches_python_when_available() {
        let Ok(out) = std::process::Command::new("python3")
            .args(["-c", "import platform; print(platform.platform())"])
            .output()
        else {
            kernelkite_testkit_leaf::skip("python3 not available");
            return;
        };
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            platform_string()
        );
    }

    #[test]
    fn torch_version_is_read_from_site_packages() {
        let d = tempfile::tempdir().unwrap();
        let bin = d.path().join("bin");
        let site = d.path().join("lib/python3.12/site-packages/torch");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::create_dir_all(&site).unwrap();
        let py = bin.join("python3");
        std::fs::write(&py, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&py, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        std::fs::write(
            site.join("version.py"),
            "from typing import Optional\n__version__ = '2.5.1+cu124'\ncuda = '12.4'\n",
        )
        .unwrap();
        assert_eq!(
            torch_from_files(py.to_str().unwrap(), None).as_deref(),
            Some("2.5.1+cu124")
        );
        std::fs::remove_file(site.join("version.py")).unwrap();
        let pp = d.path().join("pp/torch");
        std::fs::create_dir_all(&pp).unwrap();
        std::fs::write(pp.join("version.py"), "__version__ = \"2.6.0\"\n").unwrap();
        assert_eq!(
            torch_from_files(
                py.to_str().unwrap(),
                Some(d.path().join("pp").into_os_string())
            )
            .as_deref(),
            Some("2.6.0")
        );
    }

    #[test]
    fn nvidia_gpus_are_counted_by_what_the_variable_names_and_the_job_can_open() {
        use kernelkite_sys::nvml::DeviceInfo;
        let dev = tempfile::tempdir().unwrap();
        let gpu = |minor: u32| DeviceInfo {
            pci_bus_id: format!("00000000:{:02x}:00.0", 0x18 + minor),
            uuid: Some(format!("GPU-{minor}aaaaaaa-0000")),
            minor: Some(minor),
            name: Some("NVIDIA H100".into()),
            mig: vec![],
            mig_enabled: false,
            nvlink_peers: vec![],
        };
        let devices: Vec<DeviceInfo> = (0..4).map(gpu).collect();
        // The job's /dev holds its GPU's node only (minor 2).
        std::fs::write(dev.path().join("nvidia2"), "").unwrap();
        let count = |v: Option<&str>| usable_nvidia(&devices, v, dev.path()).len();
        assert_eq!(count(Some("GPU-2aaaaaaa-0000")), 1);
        assert_eq!(count(Some("2")), 1);
        assert_eq!(count(None), 1, "only the node it can open");
        // Named, but its node is not the job's: it cannot use it.
        assert_eq!(count(Some("GPU-1")), 0);
        // The list ends at a token that names nothing, or a repeat.
        assert_eq!(count(Some("2,GPU-9,1")), 1);
        assert_eq!(count(Some("GPU-")), 0, "an ambiguous prefix names none");
        assert_eq!(count(Some("")), 0);

        // GPU 2 in MIG mode: a MIG device's uuid names it, and CUDA stops after the first MIG
        // device, so a job given two of them still sees one.
        let mut devices = devices;
        devices[2].mig = (0..2)
            .map(|gi| kernelkite_sys::nvml::MigDeviceInfo {
                uuid: format!("MIG-2{gi}bbbbbb-0000"),
                gpu_instance_id: gi,
                compute_instance_id: 0,
                memory_bytes: 10 << 30,
                name: None,
            })
            .collect();
        let count = |v: Option<&str>| usable_nvidia(&devices, v, dev.path()).len();
        assert_eq!(count(Some("MIG-20bbbbbb-0000")), 1);
        assert_eq!(count(Some("MIG-21bbbbbb-0000,MIG-20bbbbbb-0000")), 1);
        assert_eq!(count(Some("MIG-2")), 0, "an ambiguous prefix names none");
    }

    #[test]
    fn amd_gpus_are_counted_as_rocm_enumerates_them_not_by_cards() {
        if std::env::var_os("ROCR_VISIBLE_DEVICES").is_some()
            || std::env::var_os("HIP_VISIBLE_DEVICES").is_some()
        {
            kernelkite_testkit_leaf::skip("this process has ROCm's visibility variables set");
            return;
        }
        // An 8× MI300X node; the job's /dev holds two of its render nodes.
        let root = tempfile::tempdir().unwrap();
        kernelkite_testkit_leaf::kfd::write_mi300x(root.path(), &[2, 5], true).unwrap();
        let probe = Probe {
            use_nvml: false,
            torch: TorchProbe::Off,
            sys_root: root.path().to_path_buf(),
            dev_root: root.path().join("dev"),
            ..Probe::default()
        };
        if find_on_path("nvidia-smi").is_some() {
            kernelkite_testkit_leaf::skip("nvidia-smi is installed: the NVIDIA GPUs come first");
            return;
        }
        let g = detect_gpus(&probe);
        assert_eq!((g.count, g.runtime.as_str()), (2, "ROCm"));
        // No KFD: no AMD GPU.
        let empty = tempfile::tempdir().unwrap();
        let g = detect_gpus(&Probe {
            sys_root: empty.path().to_path_buf(),
            dev_root: empty.path().join("dev"),
            ..probe
        });
        if find_on_path("rocm-smi").is_none() {
            assert_eq!(g, Gpus::default());
        }
    }

    #[test]
    fn collect_fills_cpu_platform_and_hostname() {
        let dir = tempfile::tempdir().unwrap();
        let cpuinfo = dir.path().join("cpuinfo");
        std::fs::write(&cpuinfo, "model name : Test CPU 9000\n").unwrap();
        let info = collect(&Probe {
            cpuinfo,
            use_nvml: false,
            torch: TorchProbe::Off,
            ..Probe::default()
        });
        assert_eq!(info.cpu, "Test CPU 9000");
        assert!(info.platform.starts_with("Linux-"));
        assert_eq!(info.hostname, hostname());
        assert!(!info.hostname.is_empty());
    }
}
