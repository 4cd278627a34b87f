//! The static build hands hooks that may need NVML to the dynamically linked build.
//!
//! Nodes run the hooks from a statically linked build of this binary (musl,
//! `x86_64-unknown-linux-musl`): every job starts three hook processes, and a dynamically
//! linked one spends about a millisecond of each in the dynamic loader before `main`
//! (docs/BENCHMARKS.md, issue 10). A static binary cannot load a shared library, and NVML
//! (`libnvidia-ml.so.1`) is one. So before a hook does anything, the static build checks
//! whether it may need NVML, and if so `exec`s the dynamically linked build installed beside
//! it, [`NVML_BUILD_BINARY`]: same arguments, environment and process, so the agent sees one hook.
//!
//! A hook may need NVML when the step asks for `require-idle-gpu` or `lock-clocks`, or when a
//! job on the node has its clocks locked: `environment` resets the clocks of lost jobs and
//! `pre-exit` those of its own. Other subcommands do not hand over; in the static build NVML
//! is simply absent to them (`plan` fills GPU UUIDs from `/proc/driver/nvidia` alone, `doctor`
//! says NVML cannot be loaded).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use kernelkite_sys::node::NVML_BUILD_BINARY;

use crate::job::{env, state, Settings};

/// Names the dynamically linked build when it is not beside the static one.
pub const NVML_BUILD_ENV: &str = "KERNELKITE_ISOLATE_NVML_BIN";

/// Whether this build can load NVML itself: every build but a statically linked one.
pub const LOADS_NVML: bool = !cfg!(target_feature = "crt-static");

/// Why the hand-over failed.
#[derive(Debug, thiserror::Error)]
pub enum DelegateError {
    /// No dynamically linked build to hand the hook to.
    #[error("this hook needs NVML ({why}), which the static build of kernelkite-isolate cannot load; {NVML_BUILD_BINARY} (the dynamically linked build: `cargo build --release -p kernelkite-isolate`, renamed) is not at {} — put it there (`kernelkite-isolate setup --from DIR` installs it when DIR holds it) or name it with {NVML_BUILD_ENV}", .looked.display())]
    Missing {
        /// Why NVML is needed.
        why: String,
        /// Where it was looked for.
        looked: PathBuf,
    },
    /// `exec` failed.
    #[error("cannot run {} for this hook, which needs NVML ({why}): {source}", .path.display())]
    Exec {
        /// The build it tried.
        path: PathBuf,
        /// Why NVML is needed.
        why: String,
        /// The error `exec` returned.
        #[source]
        source: std::io::Error,
    },
}

/// Why a hook may need NVML, in words; `None` when it cannot. `locked` lists the jobs on the
/// node whose state says their clocks are locked.
pub fn why_nvml(config: &crate::config::PluginConfig, locked: &[String]) -> Option<String> {
    let mut asked = Vec::new();
    if config.require_idle_gpu {
        asked.push("require-idle-gpu");
    }
    if config.lock_clocks.is_some() {
        asked.push("lock-clocks");
    }
    if !asked.is_empty() {
        return Some(format!("the step asks for {}", asked.join(" and ")));
    }
    match locked {
        [] => None,
        [one] => Some(format!("job {one} has its GPU clocks locked")),
        [first, rest @ ..] => Some(format!(
            "jobs {first} and {} more have their GPU clocks locked",
            rest.len()
        )),
    }
}

/// The jobs on the node whose state says their clocks are locked. A state that cannot be read
/// does not count: the hook reports it as it always does, and handing every later hook to a
/// build an AMD or CPU-only node does not have would stop the node.
pub fn jobs_with_locked_clocks(settings: &Settings) -> Vec<String> {
    state::listed_jobs(settings)
        .into_iter()
        .filter(|job| matches!(state::read_state(settings, job), Ok(Some(s)) if s.clocks_locked))
        .collect()
}

/// Where the dynamically linked build is: [`NVML_BUILD_ENV`], else [`NVML_BUILD_BINARY`] beside
/// `current_exe`.
pub fn nvml_build(hook_env: &BTreeMap<String, String>, current_exe: &Path) -> PathBuf {
    match hook_env.get(NVML_BUILD_ENV).filter(|v| !v.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => current_exe.with_file_name(NVML_BUILD_BINARY),
    }
}

/// In the static build, `exec`s the dynamically linked build when the hook may need NVML
/// (it does not return then); returns `Ok` to run the hook here. `args` are the hook's
/// arguments after the program name.
pub fn hand_over_if_needed(
    settings: &Settings,
    hook_env: &BTreeMap<String, String>,
    args: &[OsString],
) -> Result<(), DelegateError> {
    if LOADS_NVML {
        return Ok(());
    }
    // A configuration that does not parse is the hook's to report, in its own words.
    let Ok(config) = env::job_config(hook_env) else {
        return Ok(());
    };
    let Some(why) = why_nvml(&config, &jobs_with_locked_clocks(settings)) else {
        return Ok(());
    };
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("kernelkite-isolate"));
    let path = nvml_build(hook_env, &exe);
    if !path.is_file() {
        return Err(DelegateError::Missing { why, looked: path });
    }
    eprintln!(
        "kernelkite: {why}: the hook runs in {} (the static build cannot load NVML)",
        path.display()
    );
    use std::os::unix::process::CommandExt;
    let source = std::process::Command::new(&path).args(args).exec();
    Err(DelegateError::Exec { path, why, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_config;

    #[test]
    fn gpu_options_and_locked_clocks_need_nvml_and_nothing_else_does() {
        let plain = parse_config("").unwrap();
        assert_eq!(why_nvml(&plain, &[]), None);
        let idle = parse_config(r#"{"require-idle-gpu":true}"#).unwrap();
        assert_eq!(
            why_nvml(&idle, &[]).as_deref(),
            Some("the step asks for require-idle-gpu")
        );
        let both = parse_config(r#"{"require-idle-gpu":true,"lock-clocks":1410}"#).unwrap();
        assert_eq!(
            why_nvml(&both, &[]).as_deref(),
            Some("the step asks for require-idle-gpu and lock-clocks")
        );
        assert_eq!(
            why_nvml(&plain, &["job-7".into()]).as_deref(),
            Some("job job-7 has its GPU clocks locked")
        );
        assert_eq!(
            why_nvml(&plain, &["a".into(), "b".into(), "c".into()]).as_deref(),
            Some("jobs a and 2 more have their GPU clocks locked")
        );
    }

    #[test]
    fn locked_clocks_are_read_from_the_jobs_states() {
        let dir = tempfile::tempdir().unwrap();
        let settings = Settings {
            run_dir: dir.path().join("run"),
            ..Settings::default()
        };
        assert!(
            jobs_with_locked_clocks(&settings).is_empty(),
            "no run dir yet"
        );
        let jobs = state::jobs_dir(&settings);
        std::fs::create_dir_all(&jobs).unwrap();
        let mut s = crate::job::test_support::state("job-1");
        state::write_state(&settings, &s).unwrap();
        assert!(jobs_with_locked_clocks(&settings).is_empty());
        s.job_id = "job-2".into();
        s.clocks_locked = true;
        state::write_state(&settings, &s).unwrap();
        std::fs::write(jobs.join("job-3.json"), "{\"job_id\":").unwrap();
        assert_eq!(jobs_with_locked_clocks(&settings), ["job-2"]);
    }

    #[test]
    fn the_nvml_build_is_beside_the_static_one_unless_named() {
        let exe = Path::new("/opt/kernelkite/bin/kernelkite-isolate");
        let mut env = BTreeMap::new();
        assert_eq!(
            nvml_build(&env, exe),
            Path::new("/opt/kernelkite/bin/kernelkite-isolate-nvml")
        );
        env.insert(NVML_BUILD_ENV.to_string(), String::new());
        assert_eq!(
            nvml_build(&env, exe),
            Path::new("/opt/kernelkite/bin/kernelkite-isolate-nvml")
        );
        env.insert(NVML_BUILD_ENV.to_string(), "/usr/lib/kk/isolate".into());
        assert_eq!(nvml_build(&env, exe), Path::new("/usr/lib/kk/isolate"));
    }
}
