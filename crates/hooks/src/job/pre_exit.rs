//! The `pre-exit` hook: kill what the job left running, remove its cgroup (and container),
//! reset clocks, release its lease(s). It is the undo of `environment`, so it runs
//! [`clean_job`] and nothing else.

use std::collections::BTreeMap;

use super::cleanup::{clean_job, CleanupReport};
use super::env::var;
use super::{GpuOpener, JobError, Settings};
use crate::cgroup::Cgroups;

/// The `pre-exit` hook: kill what is left, remove the cgroup, reset clocks, release leases.
/// Idempotent; a job without state (environment never ran or already cleaned) is fine.
pub fn run(
    settings: &Settings,
    env: &BTreeMap<String, String>,
    gpu: GpuOpener<'_>,
) -> Result<CleanupReport, JobError> {
    let job_id = var(env, "BUILDKITE_JOB_ID")?;
    crate::cgroup::job_cgroup_name(job_id)?;
    let cgroups = Cgroups::detect_with(&settings.cgroup_root, &settings.proc_root).ok();
    Ok(clean_job(settings, job_id, cgroups.as_ref(), gpu))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::gpucheck::{GpuCheckError, GpuControl};
    use crate::job::environment;
    use crate::job::test_support::{env, fake_node, FakeDriver};
    use crate::lease::{Holder, Leases, Want};
    use crate::process;

    #[test]
    fn locked_clocks_are_reset_in_pre_exit() {
        let (_dir, settings) = fake_node();
        let driver = FakeDriver::default();
        let d = driver.clone();
        let mut open = move || Ok(Box::new(d.clone()) as Box<dyn GpuControl>);
        let e = env(&[
            ("BUILDKITE_JOB_ID", "job-clocks"),
            (
                "BUILDKITE_PLUGIN_CONFIGURATION",
                r#"{"lock-clocks":1410,"require-idle-gpu":true}"#,
            ),
        ]);
        let prepared = environment::run(&settings, &e, &mut open).unwrap();
        assert!(prepared.state.clocks_locked);
        assert_eq!(*driver.log.lock().unwrap(), vec!["lock 0000:18:00.0 1410"]);
        let report = run(&settings, &e, &mut open).unwrap();
        assert!(report.clocks_reset, "{report:?}");
        assert_eq!(
            *driver.log.lock().unwrap(),
            vec!["lock 0000:18:00.0 1410", "reset 0000:18:00.0"]
        );
        assert_eq!(report.released, vec![0]);
    }

    #[test]
    fn pre_exit_releases_a_lease_taken_before_the_state_was_written() {
        // `environment` killed between taking the lease and writing the state: the lease
        // names the job but there is no state; pre-exit must still free the GPU.
        let (_dir, settings) = fake_node();
        let leases = Leases::new(&settings.run_dir, &settings.proc_root);
        let me = Holder {
            job_id: "job-half".into(),
            agent: "a".into(),
            anchor: process::identify(&settings.proc_root, std::process::id()).unwrap(),
        };
        leases
            .acquire(&Want::Exactly(vec![0]), &me, Duration::ZERO)
            .unwrap();
        let mut open = || Err(GpuCheckError::NoNvml("no driver in tests".into()));
        let report = run(
            &settings,
            &env(&[("BUILDKITE_JOB_ID", "job-half")]),
            &mut open,
        )
        .unwrap();
        assert_eq!(report.released, vec![0], "{report:?}");
        assert!(leases.holder(0).unwrap().is_none());
    }
}
