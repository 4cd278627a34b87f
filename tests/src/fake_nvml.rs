//! A stand-in for `libnvidia-ml.so.1` (`tests/nvml/fake_nvml.c`), compiled with the system's C
//! compiler into a temporary directory, for tests of the NVML paths on machines without an
//! NVIDIA GPU. A test writes what the "driver" reports ([`FakeNvml::configure`]) and reads
//! back what was asked of it ([`FakeNvml::log`]); the library is loaded through the real
//! loader (by path, or as `libnvidia-ml.so.1` on [`FakeNvml::env`]'s `LD_LIBRARY_PATH`).

use std::path::{Path, PathBuf};

/// The compiled library and its files.
pub struct FakeNvml {
    dir: tempfile::TempDir,
}

impl FakeNvml {
    /// Compiles the stand-in; `Err` says why it cannot be (no C compiler), for a skip.
    pub fn build() -> Result<FakeNvml, String> {
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("nvml/fake_nvml.c");
        let dir = tempfile::tempdir().map_err(|e| format!("no temporary directory: {e}"))?;
        let lib = dir.path().join("libnvidia-ml.so.1");
        let out = std::process::Command::new("cc")
            .args([
                "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-o",
            ])
            .arg(&lib)
            .arg(&source)
            .output()
            .map_err(|e| format!("no C compiler (cc) to build the NVML stand-in: {e}"))?;
        if !out.status.success() {
            // The source is ours: a compiler that refuses it is a failure, not a skip.
            panic!(
                "cc could not build {}: {}",
                source.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let fake = FakeNvml { dir };
        fake.configure("");
        Ok(fake)
    }

    /// [`FakeNvml::build`], with this process's environment pointing the library at its
    /// files, for loading it here by path ([`FakeNvml::library`]). The variables are the
    /// process's: a test binary loading NVML this way holds one such test.
    pub fn build_in_this_process() -> Result<FakeNvml, String> {
        let fake = FakeNvml::build()?;
        for (k, v) in fake.env() {
            if k != "LD_LIBRARY_PATH" {
                std::env::set_var(k, v);
            }
        }
        Ok(fake)
    }

    /// The library's path.
    pub fn library(&self) -> PathBuf {
        self.dir.path().join("libnvidia-ml.so.1")
    }

    /// The configuration file (`KERNELKITE_FAKE_NVML`).
    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("nvml.conf")
    }

    /// The log of calls that change something (`KERNELKITE_FAKE_NVML_LOG`).
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("nvml.log")
    }

    /// What the next `nvmlInit_v2` reads: `gpu <bus> <uuid> <minor> <max MHz> <used bytes>
    /// <name>`, `proc <bus or MIG uuid> <pid> <used bytes>`, `mig <parent bus> <gi> <ci>
    /// <uuid> <bytes> <name>`, `nvlink <bus> <bus>`, `fail <function> <code>` lines (the
    /// format is described in `tests/nvml/fake_nvml.c`).
    pub fn configure(&self, text: &str) {
        std::fs::write(self.config_path(), text).unwrap_or_else(|e| panic!("{e}"));
    }

    /// The calls logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// The environment a process needs to load the stand-in as `libnvidia-ml.so.1`.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            (
                "LD_LIBRARY_PATH".into(),
                self.dir.path().display().to_string(),
            ),
            (
                "KERNELKITE_FAKE_NVML".into(),
                self.config_path().display().to_string(),
            ),
            (
                "KERNELKITE_FAKE_NVML_LOG".into(),
                self.log_path().display().to_string(),
            ),
        ]
    }
}

/// A `gpu` line: an H100 at `bus` with UUID `GPU-<bus digits>`, device minor `minor`, a
/// 1980 MHz maximum graphics clock and `used` bytes of memory in use.
pub fn h100(bus: &str, minor: u32, used: u64) -> String {
    format!(
        "gpu {bus} {} {minor} 1980 {used} NVIDIA H100 80GB HBM3\n",
        h100_uuid(bus)
    )
}

/// The UUID [`h100`] gives the GPU at `bus`: `GPU-` and the bus's digits as 8 hex digits.
pub fn h100_uuid(bus: &str) -> String {
    let digits: String = bus.chars().filter(char::is_ascii_hexdigit).collect();
    let n = u64::from_str_radix(&digits, 16).unwrap_or(0) & 0xffff_ffff;
    format!("GPU-{n:08x}-0000-4000-8000-000000000000")
}

/// A `mig` line: a MIG device of the GPU at `parent` (GPU instance `gi`, compute instance
/// `ci`) with `gib` GiB of memory and the UUID [`mig_uuid`] gives it.
pub fn mig(parent: &str, gi: u32, ci: u32, gib: u64) -> String {
    format!(
        "mig {parent} {gi} {ci} {} {} NVIDIA H100 80GB HBM3 MIG {}g.{}gb\n",
        mig_uuid(parent, gi, ci),
        gib << 30,
        gib.div_ceil(10).max(1),
        gib
    )
}

/// The UUID [`mig`] gives a MIG device: `MIG-`, the parent's bus digits and the instance ids.
pub fn mig_uuid(parent: &str, gi: u32, ci: u32) -> String {
    let digits: String = parent.chars().filter(char::is_ascii_hexdigit).collect();
    let n = u64::from_str_radix(&digits, 16).unwrap_or(0) & 0xffff_ffff;
    format!("MIG-{n:08x}-{gi:04x}-4{ci:03x}-8000-000000000000")
}

/// An `nvlink` line: the GPUs at `a` and `b` are NVLink peers.
pub fn nvlink(a: &str, b: &str) -> String {
    format!("nvlink {a} {b}\n")
}

/// Writes the NVIDIA driver's MIG files under `root` (what `kernelkite_sys::nvidia` reads): `mig-minors` with `config` 1,
/// `monitor` 2 and the given `(gpu minor, gi, ci, gi cap, ci cap)` entries, and `nvidia-caps`
/// as major `major` in `proc/devices`.
pub fn write_mig_minors(
    root: &Path,
    major: u32,
    entries: &[(u32, u32, u32, u32, u32)],
) -> std::io::Result<()> {
    let dir = root.join("proc/driver/nvidia-caps");
    std::fs::create_dir_all(&dir)?;
    let mut text = String::from("config 1\nmonitor 2\n");
    for (gpu, gi, ci, gi_cap, ci_cap) in entries {
        text.push_str(&format!("gpu{gpu}/gi{gi}/access {gi_cap}\n"));
        text.push_str(&format!("gpu{gpu}/gi{gi}/ci{ci}/access {ci_cap}\n"));
    }
    std::fs::write(dir.join("mig-minors"), text)?;
    std::fs::write(
        root.join("proc/devices"),
        format!("Character devices:\n  1 mem\n195 nvidia\n{major} nvidia-caps\n"),
    )
}
