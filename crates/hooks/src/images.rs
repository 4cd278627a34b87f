//! The runner images, one per GPU vendor, and the one place their names are written in code.
//!
//! Docker mode's `image: auto` runs the image of the job's slice's GPUs ([`step_image`]), and
//! `doctor` says which image a node needs ([`for_gpus`]). `tests/node/deployment.rs` checks these
//! names against the Dockerfiles that build them and the pipelines that run them, so they
//! cannot drift apart.

use kernelkite_topology::plan::{Slice, Vendor};

use crate::config::ConfigError;

/// The `image` value that picks the runner image by the job's GPUs. (An image that really is
/// called `auto` is still reachable by its full name, `docker.io/library/auto`.)
pub const AUTO: &str = "auto";

/// A runner image: what it is for and what builds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunnerImage {
    /// The GPUs it is built for.
    pub vendor: Vendor,
    /// The vendor as people write it (`NVIDIA`, `AMD`).
    pub vendor_name: &'static str,
    /// The image reference the pipelines run and the Dockerfile's header tags.
    pub reference: &'static str,
    /// The Dockerfile that builds it, relative to the repository root.
    pub dockerfile: &'static str,
    /// Its pinned Python dependencies (also what a host-mode node's venv installs).
    pub requirements: &'static str,
}

/// The CUDA image, for NVIDIA GPUs.
pub const NVIDIA: RunnerImage = RunnerImage {
    vendor: Vendor::Nvidia,
    vendor_name: "NVIDIA",
    reference: "ghcr.io/kernelkite/runner:0.1.0",
    dockerfile: "deployment/runner/Dockerfile",
    requirements: "deployment/runner/requirements.txt",
};

/// The ROCm image, for AMD GPUs.
pub const AMD: RunnerImage = RunnerImage {
    vendor: Vendor::Amd,
    vendor_name: "AMD",
    reference: "ghcr.io/kernelkite/runner-rocm:0.1.0",
    dockerfile: "deployment/runner/Dockerfile.rocm",
    requirements: "deployment/runner/requirements-rocm.txt",
};

/// Every runner image.
pub const ALL: [RunnerImage; 2] = [NVIDIA, AMD];

/// The runner image for a vendor's GPUs.
pub fn for_vendor(vendor: Vendor) -> &'static RunnerImage {
    match vendor {
        Vendor::Nvidia => &NVIDIA,
        Vendor::Amd => &AMD,
    }
}

/// Which runner image a set of GPUs (a node's, or a job's) calls for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fit {
    /// No GPU: neither image (both runners require one).
    NoGpu,
    /// GPUs of one vendor: its image.
    One(&'static RunnerImage),
    /// GPUs of several vendors: each vendor's image, in [`ALL`]'s order.
    Mixed(Vec<&'static RunnerImage>),
}

/// The runner image(s) that GPUs of these vendors need.
pub fn for_gpus(vendors: &[Vendor]) -> Fit {
    let mut found: Vec<&'static RunnerImage> =
        ALL.iter().filter(|i| vendors.contains(&i.vendor)).collect();
    match found.len() {
        0 => Fit::NoGpu,
        1 => Fit::One(found.remove(0)),
        _ => Fit::Mixed(found),
    }
}

/// The runner image for the GPUs of a job's slice (`image: auto`); an error on the `image`
/// key when the slice has no GPU or GPUs of two vendors, where no one image fits.
pub fn for_slice(slice: &Slice) -> Result<&'static RunnerImage, ConfigError> {
    let vendors: Vec<Vendor> = slice.gpus().iter().map(|g| g.vendor).collect();
    match for_gpus(&vendors) {
        Fit::One(image) => Ok(image),
        Fit::NoGpu => Err(ConfigError::new(
            "image",
            format!(
                "`{AUTO}` picks the runner image by the job's GPUs, and slice {} has none; name the image to run",
                slice.index
            ),
        )),
        Fit::Mixed(images) => Err(ConfigError::new(
            "image",
            format!(
                "`{AUTO}` picks the runner image by the job's GPUs, and the job's are of several vendors ({}), which no one image serves; name the image to run, or ask for fewer GPUs",
                images
                    .iter()
                    .map(|i| i.vendor_name)
                    .collect::<Vec<_>>()
                    .join(" and ")
            ),
        )),
    }
}

/// The image a docker-mode job runs: the step's `image` as written, or for [`AUTO`] the runner
/// image of its slice's GPUs ([`for_slice`]).
pub fn step_image(image: &str, slice: &Slice) -> Result<String, ConfigError> {
    if image == AUTO {
        for_slice(slice).map(|i| i.reference.to_string())
    } else {
        Ok(image.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slice with GPUs of these vendors (none: a CPU-only slice).
    fn slice(vendors: &[&str]) -> Slice {
        let gpus: Vec<serde_json::Value> = vendors
            .iter()
            .enumerate()
            .map(|(i, v)| {
                serde_json::json!({"vendor": v, "pci_bus_id": format!("0000:{:02x}:00.0", i + 1),
                    "uuid": null, "numa_node": 0})
            })
            .collect();
        serde_json::from_value(serde_json::json!({
            "index": 3,
            "gpu": gpus.first(),
            "extra_gpus": gpus.get(1..).unwrap_or_default(),
            "cpus": [0, 1], "mems": [0], "memory_bytes": 1u64 << 30,
        }))
        .unwrap()
    }

    #[test]
    fn auto_picks_the_image_of_the_slice_s_vendor() {
        assert_eq!(
            step_image(AUTO, &slice(&["amd"])).unwrap(),
            "ghcr.io/kernelkite/runner-rocm:0.1.0"
        );
        assert_eq!(
            step_image(AUTO, &slice(&["amd", "amd"])).unwrap(),
            "ghcr.io/kernelkite/runner-rocm:0.1.0"
        );
        assert_eq!(
            step_image(AUTO, &slice(&["nvidia"])).unwrap(),
            "ghcr.io/kernelkite/runner:0.1.0"
        );
        // Any other image is run as written, whatever the slice.
        for s in [slice(&["amd"]), slice(&[])] {
            assert_eq!(step_image("ghcr.io/x/y:1", &s).unwrap(), "ghcr.io/x/y:1");
        }
    }

    #[test]
    fn auto_refuses_a_slice_no_one_image_serves() {
        let e = step_image(AUTO, &slice(&[])).unwrap_err();
        assert_eq!(e.key, "image");
        assert!(e.message.contains("slice 3 has none"), "{e}");
        let e = step_image(AUTO, &slice(&["nvidia", "amd"])).unwrap_err();
        assert_eq!(e.key, "image");
        assert!(e.message.contains("(NVIDIA and AMD)"), "{e}");
    }

    #[test]
    fn the_images_needed_by_a_node_s_gpus() {
        assert_eq!(for_gpus(&[]), Fit::NoGpu);
        assert_eq!(for_gpus(&[Vendor::Amd; 8]), Fit::One(&AMD));
        assert_eq!(for_gpus(&[Vendor::Nvidia]), Fit::One(&NVIDIA));
        assert_eq!(
            for_gpus(&[Vendor::Amd, Vendor::Nvidia]),
            Fit::Mixed(vec![&NVIDIA, &AMD])
        );
        for image in &ALL {
            assert_eq!(for_vendor(image.vendor), image);
        }
    }
}
