//! The example tasks bundled in the repository's `examples/` (kernelbot's task format), built
//! into the binary so `kernelkite-service demo` runs them from anywhere.

use std::path::Path;

/// A bundled task: its directory's files, and its submissions.
#[derive(Debug, Clone, Copy)]
pub struct Bundled {
    /// The directory under `examples/`.
    pub name: &'static str,
    /// One line about it.
    pub about: &'static str,
    /// The task directory's files (`task.yml` and what it names).
    pub files: &'static [(&'static str, &'static str)],
    /// The file name of the correct submission in `files`.
    pub submission: &'static str,
    /// The file name of a wrong submission in `files` (its tests must fail).
    pub wrong_submission: &'static str,
}

macro_rules! example {
    ($dir:literal, $($name:literal),+ $(,)?) => {
        &[$(($name, include_str!(concat!("../../../examples/", $dir, "/", $name)))),+]
    };
}

/// An inclusive prefix sum in plain Python: runs on any machine with python3.
pub const PREFIXSUM_PY: Bundled = Bundled {
    name: "prefixsum_py",
    about: "inclusive prefix sum in plain Python (CPU only)",
    files: example!(
        "prefixsum_py",
        "task.yml",
        "eval.py",
        "reference.py",
        "template.py",
        "submission.py",
        "wrong_submission.py",
    ),
    submission: "submission.py",
    wrong_submission: "wrong_submission.py",
};

/// A vector add in CUDA: needs nvcc and an NVIDIA GPU.
pub const VECTORADD_CUDA: Bundled = Bundled {
    name: "vectoradd_cuda",
    about: "float vector add in CUDA (needs nvcc and an NVIDIA GPU)",
    files: example!(
        "vectoradd_cuda",
        "task.yml",
        "eval.cu",
        "task.h",
        "reference.cuh",
        "template.cu",
        "submission.cu",
        "wrong_submission.cu",
    ),
    submission: "submission.cu",
    wrong_submission: "wrong_submission.cu",
};

impl Bundled {
    /// Writes the task directory under `dir`.
    pub fn write_to(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        for (name, text) in self.files {
            std::fs::write(dir.join(name), text)?;
        }
        Ok(())
    }

    /// A file's content.
    pub fn file(&self, name: &str) -> Option<&'static str> {
        self.files.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::{build_config, load, Mode};

    #[test]
    fn the_bundled_tasks_load_and_make_valid_configs() {
        for b in [PREFIXSUM_PY, VECTORADD_CUDA] {
            let d = tempfile::tempdir().unwrap();
            b.write_to(d.path()).unwrap();
            let task = load(d.path()).unwrap();
            assert_eq!(task.task["ranking_by"], "geom", "{}", b.name);
            for sub in [b.submission, b.wrong_submission] {
                let text = b.file(sub).unwrap();
                for mode in [
                    Mode::Test,
                    Mode::Benchmark,
                    Mode::Leaderboard,
                    Mode::Profile,
                ] {
                    let cfg = build_config(&task, text, None, mode);
                    kernelkite_kernelbot::config::RunConfig::from_json(cfg).unwrap();
                }
            }
        }
    }
}
