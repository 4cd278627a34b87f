//! kernelkite-topology: what a GPU node is made of, and how to cut it into per-GPU slices.
//!
//! The [`topology`] is a plain value, filled from a sysfs/procfs tree (the live machine or a
//! fake one from [`fakesys`]), an hwloc XML export, and NVML where the driver's files say too
//! little. The [`planner`] is a pure function from a topology and a policy to a [`plan::Plan`],
//! the data contract with the hooks and node set-up. Nothing here changes the machine; every
//! path read comes from an injected root.

#![deny(missing_docs)]

pub mod cpulist;
pub mod fakesys;
pub mod plan;
pub mod planner;
pub mod refresh;
pub mod topology;

pub use plan::{Plan, Slice, SliceGpu, Vendor};
pub use topology::Topology;
