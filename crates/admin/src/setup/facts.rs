//! What setup reads from the machine besides the plan: the cgroup version, the kernel, local
//! users and groups, and who owns the AMD device nodes. Every path is under an injected root
//! (`sysfs_root` for the machine's `/proc`, `/sys` and `/dev`; `root` for `/etc`), so the same
//! code reads a fixture in tests.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use kernelkite_topology::plan::{Plan, Vendor};

use super::paths::JOB_USER;
use super::{under, SetupError};
use kernelkite_hooks::cgroup::Cgroups;

/// A kernel release's major and minor number (`6.1.0-18-amd64` is `6.1`).
pub type KernelVersion = (u32, u32);

/// The group owning a device node the job user must open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceOwner {
    /// The device node (`/dev/kfd`, `/dev/dri/renderD128`), as on the node.
    pub device: PathBuf,
    /// Its group id.
    pub gid: u32,
    /// The group's name from `/etc/group`; `None` when no local group has that id.
    pub group: Option<String>,
}

/// Facts about the node that shape what setup writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    /// 1 or 2: the cgroup version the hooks will use (as they choose it).
    pub cgroup_version: u8,
    /// The running kernel's release string, when known.
    pub kernel_release: Option<String>,
    /// The machine's memory in bytes.
    pub total_memory_bytes: u64,
    /// Whether the job user exists in `/etc/passwd`.
    pub job_user_exists: bool,
    /// Local groups the job user is already a member of.
    pub job_user_groups: Vec<String>,
    /// Owners of the AMD device nodes (`/dev/kfd`, `/dev/dri/renderD*`), when the plan has AMD GPUs.
    pub device_owners: Vec<DeviceOwner>,
}

impl Facts {
    /// The kernel's version, when its release string parses.
    pub fn kernel_version(&self) -> Option<KernelVersion> {
        self.kernel_release
            .as_deref()
            .and_then(parse_kernel_version)
    }
}

/// `6.1.0-18-amd64` → `(6, 1)`.
pub fn parse_kernel_version(release: &str) -> Option<KernelVersion> {
    let mut parts = release.trim().split(['.', '-', '+']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

// `/etc/passwd` and `/etc/group` are read the one way glibc reads them (comments skipped).
pub use kernelkite_sys::passwd::{groups as parse_groups, has_user as passwd_has_user};

fn read_optional(path: &Path) -> Result<String, SetupError> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(s),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
        Err(e) => Err(SetupError::io(path, e)),
    }
}

/// The kernel release from `<sysfs_root>/proc/sys/kernel/osrelease`, else, on the live
/// machine, `uname`.
fn kernel_release(sysfs_root: &Path) -> Option<String> {
    match std::fs::read_to_string(sysfs_root.join("proc/sys/kernel/osrelease")) {
        Ok(s) => Some(s.trim().to_string()),
        Err(_) if sysfs_root == Path::new("/") => Some(
            rustix::system::uname()
                .release()
                .to_string_lossy()
                .into_owned(),
        ),
        Err(_) => None,
    }
}

/// The AMD device nodes a job opens: `/dev/kfd` and the render nodes, as found.
fn amd_device_nodes(sysfs_root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if sysfs_root.join("dev/kfd").exists() {
        out.push(PathBuf::from("/dev/kfd"));
    }
    let mut render: Vec<PathBuf> = std::fs::read_dir(sysfs_root.join("dev/dri"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("renderD"))
        .map(|e| PathBuf::from("/dev/dri").join(e.file_name()))
        .collect();
    render.sort();
    out.extend(render);
    out
}

/// Reads the facts: the machine under `sysfs_root`, users and groups under `root`.
pub fn gather(
    root: &Path,
    sysfs_root: &Path,
    plan: &Plan,
    total_memory_bytes: u64,
) -> Result<Facts, SetupError> {
    let cgroup_version = Cgroups::detect(sysfs_root)
        .map_err(|e| {
            SetupError::Invalid(format!(
                "{e} (run `kernelkite-isolate doctor` for what to fix)"
            ))
        })?
        .version();
    let passwd = read_optional(&under(root, Path::new("/etc/passwd")))?;
    let group_path = under(root, Path::new("/etc/group"));
    let groups = parse_groups(&read_optional(&group_path)?);
    let job_user_groups = groups
        .iter()
        .filter(|(_, _, members)| members.iter().any(|m| m == JOB_USER))
        .map(|(name, _, _)| name.clone())
        .collect();
    let has_amd = plan
        .slices
        .iter()
        .flat_map(kernelkite_topology::plan::Slice::gpus)
        .any(|g| g.vendor == Vendor::Amd);
    let mut device_owners = Vec::new();
    if has_amd {
        for device in amd_device_nodes(sysfs_root) {
            let path = under(sysfs_root, &device);
            let meta = std::fs::metadata(&path).map_err(|e| SetupError::io(&path, e))?;
            let gid = meta.gid();
            device_owners.push(DeviceOwner {
                device,
                gid,
                group: groups
                    .iter()
                    .find(|(_, g, _)| *g == gid)
                    .map(|(n, _, _)| n.clone()),
            });
        }
    }
    Ok(Facts {
        cgroup_version,
        kernel_release: kernel_release(sysfs_root),
        total_memory_bytes,
        job_user_exists: passwd_has_user(&passwd, JOB_USER),
        job_user_groups,
        device_owners,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_parse() {
        assert_eq!(parse_kernel_version("6.1.0-18-amd64"), Some((6, 1)));
        assert_eq!(parse_kernel_version("5.15.0-91-generic\n"), Some((5, 15)));
        assert_eq!(parse_kernel_version("6.18.44-fc-v669"), Some((6, 18)));
        assert_eq!(parse_kernel_version("garbage"), None);
    }

    #[test]
    fn users_and_groups_come_from_the_files() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\n# kernelkite-job:x:1:1::/:/bin/false\n";
        assert!(passwd_has_user(passwd, "root"));
        assert!(!passwd_has_user(passwd, "kernelkite-job"));
        let g =
            parse_groups("root:x:0:\nrender:x:109:kernelkite-job,alice\nbad line\nvideo:x:44:\n");
        assert_eq!(
            g,
            vec![
                ("root".to_string(), 0, vec![]),
                (
                    "render".to_string(),
                    109,
                    vec!["kernelkite-job".to_string(), "alice".to_string()]
                ),
                ("video".to_string(), 44, vec![]),
            ]
        );
    }
}
