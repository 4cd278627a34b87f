//! Helpers shared by the integration tests and, through `benches/common`, the benchmarks.
//! Each includer uses a subset.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs `cmd` to completion and fails, showing its stderr, unless it succeeded.
pub fn output_ok(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `<dir>/bin` holding the stub `nvidia-smi` the prototype's hook calls; returns that directory.
pub fn stub_nvidia_smi_bin(dir: &Path) -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::copy(
        manifest.join("benches/stub-nvidia-smi"),
        bin.join("nvidia-smi"),
    )
    .unwrap();
    bin
}

/// `PATH` with `bin` in front.
pub fn path_with(bin: &Path) -> String {
    format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}
