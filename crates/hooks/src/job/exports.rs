//! What the job sees: the variables `environment` exports for its slice, and the `export`
//! lines a sourced shell hook evaluates.

use std::collections::BTreeMap;

use kernelkite_topology::cpulist::format_cpu_list;
use kernelkite_topology::plan::{Slice, Vendor};

use crate::docker;

/// The variables exported to the job for its slice and host GPU indices; `private_dev`: the
/// job's `/dev` holds only its own devices (host mode, in the sandbox).
pub fn exports_for(slice: &Slice, indices: &[u32], private_dev: bool) -> BTreeMap<String, String> {
    let gpus = slice.gpus();
    // AMD: with a private /dev (the sandbox's: only the job's render nodes), libhsakmt skips
    // every other GPU and ROCr numbers the job's from 0; with the host's /dev (the sandbox
    // off, or containers others start) it sees every GPU in host order
    // (kernelkite_sys::kfd).
    let local: Vec<u32> = (0..gpus.len() as u32).collect();
    let amd_private = private_dev && gpus.first().is_some_and(|g| g.vendor == Vendor::Amd);
    let numbered = if amd_private { &local[..] } else { indices };
    let mut env = docker::visible_devices_env(&gpus, numbered);
    // The NVIDIA container runtime reads the same list under its own name.
    if let Some(ids) = env.get("CUDA_VISIBLE_DEVICES").cloned() {
        env.insert("NVIDIA_VISIBLE_DEVICES".into(), ids);
    }
    env.insert("KERNELBOT_GPU_INDEX".into(), docker::index_list(indices));
    env.insert("KERNELBOT_CPUSET".into(), format_cpu_list(&slice.cpus));
    env.insert("KERNELBOT_MEMORY".into(), docker_memory(slice.memory_bytes));
    env.insert(
        "KERNELKITE_SLICE".into(),
        serde_json::to_string(slice).unwrap_or_default(),
    );
    env
}

/// A memory size the way the prototype exported it and `docker run --memory` reads it:
/// `64g`, else `512m`, else bytes.
pub fn docker_memory(bytes: u64) -> String {
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    if bytes > 0 && bytes.is_multiple_of(GIB) {
        format!("{}g", bytes / GIB)
    } else if bytes > 0 && bytes.is_multiple_of(MIB) {
        format!("{}m", bytes / MIB)
    } else {
        bytes.to_string()
    }
}

/// The `export` format and its quoting: `kernelkite_sys::shell`, which local mode reads back with.
pub use kernelkite_sys::shell::{export_lines, quote as shell_quote};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::test_support::env;

    #[test]
    fn memory_is_exported_like_the_prototype() {
        assert_eq!(docker_memory(64 << 30), "64g");
        assert_eq!(docker_memory(1536 << 20), "1536m");
        assert_eq!(docker_memory(1000), "1000");
    }

    #[test]
    fn shell_quoting_survives_quotes() {
        assert_eq!(shell_quote("a'b"), r"'a'\''b'");
        let lines = export_lines(&env(&[("K", "v w"), ("J", "{\"x\":1}")]));
        assert_eq!(lines, "export J='{\"x\":1}'\nexport K='v w'\n");
    }
}
