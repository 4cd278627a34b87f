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

/// The plugin's hook files as a node with `bin` installed runs them: copies in `dir/hooks`
/// whose first line names `bin` where the shipped files name `/opt/kernelkite/bin`, the rest
/// unchanged. Each shipped file must start with exactly that line.
pub fn plugin_hooks(bin: &Path, dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let shebang = kernelkite_sys::node::PLUGIN_HOOK_SHEBANG;
    let installed = kernelkite_sys::node::plugin_hook_binary();
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("hooks");
    let out = dir.join("hooks");
    std::fs::create_dir_all(&out).unwrap();
    for hook in ["environment", "command", "pre-exit"] {
        let text = std::fs::read_to_string(shipped.join(hook)).unwrap();
        let (first, rest) = text.split_once('\n').unwrap();
        assert_eq!(first, shebang, "hooks/{hook}");
        let copy = out.join(hook);
        let line = first.replacen(installed, bin.to_str().unwrap(), 1);
        std::fs::write(&copy, format!("{line}\n{rest}")).unwrap();
        std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    out
}
