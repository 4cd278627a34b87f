//! kernelkite-sys: the OS layer the runner, the hooks and the topology share.
//!
//! * [`nvml`]: NVIDIA's management library, loaded at run time through `nvml-wrapper`, so a
//!   binary runs (and reports why not) on machines without the NVIDIA driver.
//! * [`procfs`]: `/proc/<pid>/stat` and the process tree, under an injected procfs root.
//! * [`identity`]: the job's two identities (the command's, the submission's) and the variable
//!   that names the second.
//! * [`error`]: an error and its causes on one line, the way every binary prints them.
//! * [`host`]: this machine's name.
//! * [`node`]: a node's layout facts (the run dir, the job user).
//! * [`passwd`]: `/etc/passwd` and `/etc/group` as glibc reads them (comments are no accounts).
//! * [`nvidia`]: the NVIDIA driver's device files (a GPU's minor, a MIG device's capability
//!   nodes).
//! * [`kfd`]: AMD GPUs as ROCm enumerates them (the KFD topology, the visibility variables).
//! * [`shell`]: the hooks' `export NAME='value'` lines, written and read back.
//! * [`provenance`]: where and on what a run ran (`provenance.json`, beside the result), and
//!   the GPU state it is read from (NVML, amdgpu's sysfs).
//! * [`fs`]: atomic file writes that survive a crash (fsync of the file and its directory).
//! * [`raw`]: the few system calls no crate covers safely (`clone3` into a cgroup, the code
//!   that runs between `fork` and `exec`, glibc's version). Every `unsafe` block of the
//!   workspace's product code lives there, each with a `// SAFETY:` comment.
//!
//! Everything else the code asks of the kernel goes through `rustix`, which is safe.

#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod error;
pub mod fs;
pub mod host;
pub mod identity;
pub mod kfd;
pub mod node;
pub mod nvidia;
pub mod nvml;
pub mod passwd;
pub mod procfs;
pub mod provenance;
pub mod raw;
pub mod shell;
