//! CUDA submissions: finding nvcc and building kernelbot's compile command.

use std::path::{Path, PathBuf};

use crate::sysinfo::{find_on_path, is_executable};
use kernelkite_kernelbot::config::{case_value_text, Arch, RunConfig};

/// kernelbot's `CUDA_FLAGS`, used when the config gives no `flags`.
pub const CUDA_FLAGS: [&str; 11] = [
    "--std=c++20",
    "-DNDEBUG",
    "-Xcompiler=-Wno-psabi",
    "-Xcompiler=-fno-strict-aliasing",
    "--expt-extended-lambda",
    "--expt-relaxed-constexpr",
    "-forward-unknown-to-host-compiler",
    "-O3",
    "-Xnvlink=--verbose",
    "-Xptxas=--verbose",
    "-Xptxas=--warn-on-spills",
];

/// The binary nvcc writes and the runner executes.
pub const OUTPUT_BINARY: &str = "eval.out";

/// Where nvcc is: an explicit path, else `PATH` (kernelbot's `which nvcc`), else
/// `$CUDA_HOME/bin`, `$CUDA_PATH/bin` and the given fallback installs.
pub fn find_nvcc(explicit: Option<&Path>, fallbacks: &[PathBuf]) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return is_executable(p).then(|| p.to_path_buf());
    }
    if let Some(p) = find_on_path("nvcc") {
        return Some(p);
    }
    let homes = ["CUDA_HOME", "CUDA_PATH"]
        .into_iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from);
    homes
        .chain(fallbacks.iter().cloned())
        .map(|h| h.join("bin/nvcc"))
        .find(|p| is_executable(p))
}

/// `-gencode=arch=compute_90a,code=sm_90a`, or `-arch=native` without an arch.
pub fn arch_flag(arch: Option<&Arch>) -> String {
    match arch {
        Some(a) => format!("-gencode=arch=compute_{a},code=sm_{a}"),
        None => "-arch=native".into(),
    }
}

/// nvcc's arguments (after the nvcc path), in kernelbot's order: flags, `-I`, `-l`, `-D`,
/// the sources, the arch flag, `-o eval.out`.
pub fn compile_args(cfg: &RunConfig) -> Vec<String> {
    let mut args: Vec<String> = match &cfg.flags {
        Some(f) => f.clone(),
        None => CUDA_FLAGS.iter().map(|s| s.to_string()).collect(),
    };
    args.extend(cfg.include_dirs.iter().map(|d| format!("-I{d}")));
    args.extend(cfg.libraries.iter().map(|l| format!("-l{l}")));
    for (name, value) in &cfg.defines {
        if value.is_null() {
            args.push(format!("-D{name}"));
        } else {
            args.push(format!("-D{name}={}", case_value_text(value)));
        }
    }
    args.extend(cfg.sources.keys().cloned());
    args.push(arch_flag(cfg.arch.as_ref()));
    args.push("-o".into());
    args.push(OUTPUT_BINARY.into());
    args
}

/// kernelbot refuses include directories that do not exist on the machine.
pub fn check_include_dirs(dirs: &[String]) -> Result<(), String> {
    for d in dirs {
        let p = Path::new(d);
        if !p.exists() {
            return Err(format!(
                "include directory `{d}` does not exist on this runner"
            ));
        }
        if !p.is_dir() {
            return Err(format!("include path `{d}` is not a directory"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn command_follows_kernelbot_order() {
        let cfg = RunConfig::from_json(json!({
            "lang": "cu", "mode": "test", "sources": {"eval.cu": "", "sub.cu": ""},
            "headers": {"task.h": ""}, "arch": "90a", "include_dirs": ["/inc"], "libraries": ["cublas"],
            "defines": {"A": null, "B": 3, "C": "x", "D": true}, "tests": [{"n": 1}]
        }))
        .unwrap();
        let args = compile_args(&cfg);
        let tail: Vec<&str> = args[CUDA_FLAGS.len()..]
            .iter()
            .map(String::as_str)
            .collect();
        assert_eq!(
            &args[..CUDA_FLAGS.len()],
            CUDA_FLAGS.map(String::from).as_slice()
        );
        assert_eq!(
            tail,
            [
                "-I/inc",
                "-lcublas",
                "-DA",
                "-DB=3",
                "-DC=x",
                "-DD=True",
                "eval.cu",
                "sub.cu",
                "-gencode=arch=compute_90a,code=sm_90a",
                "-o",
                "eval.out"
            ]
        );
    }

    #[test]
    fn native_arch_and_custom_flags() {
        let cfg = RunConfig::from_json(json!({
            "lang": "cu", "mode": "test", "sources": {"a.cu": ""}, "flags": ["-O2"], "tests": [{"n": 1}]
        }))
        .unwrap();
        assert_eq!(
            compile_args(&cfg),
            ["-O2", "a.cu", "-arch=native", "-o", "eval.out"]
        );
        assert_eq!(
            arch_flag(Some(&Arch::Number(80))),
            "-gencode=arch=compute_80,code=sm_80"
        );
    }

    #[test]
    fn include_dirs_must_exist() {
        assert!(check_include_dirs(&["/".into()]).is_ok());
        assert!(check_include_dirs(&["/no/such/dir".into()])
            .unwrap_err()
            .contains("does not exist"));
        assert!(check_include_dirs(&["/proc/cpuinfo".into()])
            .unwrap_err()
            .contains("not a directory"));
    }

    #[test]
    fn fallback_installs_are_searched_after_path() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("bin")).unwrap();
        let nvcc = d.path().join("bin/nvcc");
        std::fs::write(&nvcc, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&nvcc, std::fs::Permissions::from_mode(0o755)).unwrap();
        let found = find_nvcc(None, &[PathBuf::from("/no/cuda"), d.path().to_path_buf()]);
        match find_on_path("nvcc") {
            Some(on_path) => assert_eq!(found, Some(on_path)),
            None => assert_eq!(found, Some(nvcc)),
        }
    }

    #[test]
    fn explicit_nvcc_must_be_executable() {
        assert!(find_nvcc(Some(Path::new("/no/nvcc")), &[]).is_none());
        assert_eq!(
            find_nvcc(Some(Path::new("/bin/sh")), &[]),
            Some(PathBuf::from("/bin/sh"))
        );
    }
}
