//! A stand-in for `libnvidia-ml.so.1` (`crates/testkit-leaf/nvml/fake_nvml.c`), compiled with the system's C
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
    /// format is described in `crates/testkit-leaf/nvml/fake_nvml.c`).
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
    mig_at(parent, gi, ci, gib, 0)
}

/// [`mig`] as the node's `boot`-th boot makes it: MIG devices do not survive a reboot, and
/// the driver gives the same instances new UUIDs ([`mig_uuid_at`]).
pub fn mig_at(parent: &str, gi: u32, ci: u32, gib: u64, boot: u32) -> String {
    format!(
        "mig {parent} {gi} {ci} {} {} NVIDIA H100 80GB HBM3 MIG {}g.{}gb\n",
        mig_uuid_at(parent, gi, ci, boot),
        gib << 30,
        gib.div_ceil(10).max(1),
        gib
    )
}

/// The UUID [`mig`] gives a MIG device: `MIG-`, the parent's bus digits and the instance ids.
pub fn mig_uuid(parent: &str, gi: u32, ci: u32) -> String {
    mig_uuid_at(parent, gi, ci, 0)
}

/// The UUID [`mig_at`] gives a MIG device in boot `boot` (its last group).
pub fn mig_uuid_at(parent: &str, gi: u32, ci: u32, boot: u32) -> String {
    let digits: String = parent.chars().filter(char::is_ascii_hexdigit).collect();
    let n = u64::from_str_radix(&digits, 16).unwrap_or(0) & 0xffff_ffff;
    format!("MIG-{n:08x}-{gi:04x}-4{ci:03x}-8000-{boot:012x}")
}

/// A `migmode` line: the GPU at `bus` reports MIG mode `current` now and `pending` after its
/// next reset, whatever MIG devices it has (MIG on with none created yet, as after enabling
/// MIG or a reboot before the instances are made again).
pub fn mig_mode(bus: &str, current: bool, pending: bool) -> String {
    format!(
        "migmode {bus} {} {}\n",
        u8::from(current),
        u8::from(pending)
    )
}

/// An `nvlink` line: the GPUs at `a` and `b` are NVLink peers.
pub fn nvlink(a: &str, b: &str) -> String {
    format!("nvlink {a} {b}\n")
}

/// Lines in the driver's `mig-minors`: `config`, `monitor`, then 32 GPUs × 15 GPU instances ×
/// (the instance's `access` and 8 compute instances'), whatever the node has.
pub const MIG_MINORS_LINES: usize = 2 + 32 * 15 * 9;

/// The minor the driver gives `gpu<gpu>/gi<gi>/access` (`ci` `None`) or
/// `gpu<gpu>/gi<gi>/ci<ci>/access`. The facts are NVIDIA's open kernel modules'
/// (`kernel-open/nvidia/nv-caps.c`: one counter numbers the nvlink table (fabric-mgmt 0), the
/// MIG table (config 1, monitor 2), then the per-GPU table, 15 GIs × (access + 8 CIs) per GPU,
/// in order).
pub fn mig_cap_minor(gpu: u32, gi: u32, ci: Option<u32>) -> u32 {
    3 + 135 * gpu + 9 * gi + ci.map_or(0, |c| 1 + c)
}

/// The driver's whole `/proc/driver/nvidia-caps/mig-minors`: its table is static (nv-caps.c
/// prints every entry of it, `"%s %d\n"` with the `…/capabilities/` prefix cut), so a node
/// without MIG, or with two MIG devices, lists the same 4,322 lines.
pub fn mig_minors_table() -> String {
    let mut text = String::from("config 1\nmonitor 2\n");
    for gpu in 0..32 {
        for gi in 0..15 {
            let minor = mig_cap_minor(gpu, gi, None);
            text.push_str(&format!("gpu{gpu}/gi{gi}/access {minor}\n"));
            for ci in 0..8 {
                let minor = mig_cap_minor(gpu, gi, Some(ci));
                text.push_str(&format!("gpu{gpu}/gi{gi}/ci{ci}/access {minor}\n"));
            }
        }
    }
    text
}

/// Writes the NVIDIA driver's capability files under `root` (what `kernelkite_sys::nvidia`
/// reads): the real `mig-minors` table ([`mig_minors_table`]), and `proc/devices` naming
/// `nvidia` (195), `nvidia-caps` as `major` and `nvidia-uvm` as 511.
pub fn write_mig_minors(root: &Path, major: u32) -> std::io::Result<()> {
    let dir = root.join("proc/driver/nvidia-caps");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("mig-minors"), mig_minors_table())?;
    std::fs::write(
        root.join("proc/devices"),
        format!("Character devices:\n  1 mem\n195 nvidia\n{major} nvidia-caps\n511 nvidia-uvm\n"),
    )
}

/// Writes the NVIDIA driver's `/proc` directories under `root` as a node shows them
/// (kernel-open/nvidia/nv-procfs.c, nv-caps.c and nvidia-uvm/uvm_procfs.c of NVIDIA's
/// open-gpu-kernel-modules): under `proc/driver/nvidia`, `version`, `params` (with
/// `ModifyDeviceFiles: 1`), `registry`, `suspend`, `suspend_depth`, `warnings/README`,
/// `patches/README`, `gpus/<bus>/{information,registry,power}` for each `(bus, minor)` of
/// `gpus` (`information` naming the GPU's model, the UUID [`h100_uuid`] gives it, its bus id and
/// minor), MIG's `capabilities/mig/{config,monitor}` and, for each `(gpu minor, gi, ci)` of
/// `mig`, its GPU instance's and compute instance's `access` files (their minors
/// [`mig_cap_minor`]'s); and under `proc/driver/nvidia-uvm`, `gpus/GPU-<uuid>/0/info` for each
/// GPU (every GPU in use by some process on the node).
pub fn write_driver_proc(
    root: &Path,
    gpus: &[(&str, u32)],
    mig: &[(u32, u32, u32)],
) -> std::io::Result<()> {
    let dir = root.join("proc/driver/nvidia");
    let write = |rel: &str, text: &str| -> std::io::Result<()> {
        let p = dir.join(rel);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(p, text)
    };
    write(
        "version",
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build\nGCC version:  gcc version 12.3.0\n",
    )?;
    write(
        "params",
        "ResmanDebugLevel: 4294967295\nRmLogonRC: 1\nModifyDeviceFiles: 1\nDeviceFileUID: 0\nDeviceFileGID: 0\nDeviceFileMode: 438\nRegistryDwords: \"\"\nRegistryDwordsPerDevice: \"\"\nRmMsg: \"\"\nGpuBlacklist: \"\"\nExcludedGpus: \"\"\n",
    )?;
    write("registry", "Binary: \"\"\n")?;
    write("suspend", "")?;
    write("suspend_depth", "default\n")?;
    write(
        "warnings/README",
        "The NVIDIA graphics driver tries to detect potential problems\n",
    )?;
    write("patches/README", "Apply the patches in this directory\n")?;
    for (bus, minor) in gpus {
        let info = format!(
            "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 0\nGPU UUID: \t {}\nVideo BIOS: \t 96.00.00.00.00\nBus Type: \t PCIe\n\
             DMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\nBus Location: \t {bus}\nDevice Minor: \t {minor}\nGPU Excluded:\t No\n",
            h100_uuid(bus)
        );
        write(&format!("gpus/{bus}/information"), &info)?;
        write(&format!("gpus/{bus}/registry"), "Binary: \"\"\n")?;
        write(
            &format!("gpus/{bus}/power"),
            "Runtime D3 status:          Not supported\nVideo Memory:               Active\n",
        )?;
        let uvm = root.join(format!("proc/driver/nvidia-uvm/gpus/{}/0", h100_uuid(bus)));
        std::fs::create_dir_all(&uvm)?;
        std::fs::write(
            uvm.join("info"),
            format!("GPU {}\nname NVIDIA H100 80GB HBM3\n", h100_uuid(bus)),
        )?;
    }
    // nv-caps.c's access files: the node's minor, mode and whether the driver may fix it.
    let access = |minor: u32| {
        format!("DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    };
    write("capabilities/mig/config", &access(1))?;
    write("capabilities/mig/monitor", &access(2))?;
    for &(gpu, gi, ci) in mig {
        write(
            &format!("capabilities/gpu{gpu}/mig/gi{gi}/access"),
            &access(mig_cap_minor(gpu, gi, None)),
        )?;
        write(
            &format!("capabilities/gpu{gpu}/mig/gi{gi}/ci{ci}/access"),
            &access(mig_cap_minor(gpu, gi, Some(ci))),
        )?;
    }
    Ok(())
}
