//! Buildkite as the executor: a submission becomes a build of the configured pipeline, with
//! the payload in the build's env; Buildkite's signed webhooks report its progress; once it
//! finished, its `result.json` artifact is downloaded and checked.
//!
//! - [`client`]: the REST client (create, cancel, list artifacts, download), with retries.
//! - [`crate::webhook`] (beside this module): verifying and reading webhook deliveries.
//! - [`artifact`]: choosing, downloading and checking `result.json`.

pub mod artifact;
pub mod client;

use std::collections::BTreeMap;

pub use client::{Build, BuildkiteClient, BuildkiteError, NewBuild, MAX_RATE_LIMITED_RETRIES};

use crate::config::Config;
use crate::executor::{BoxFuture, BuildStatus, Executor, Job, Launched};
use crate::report::{report, BoxError};
use crate::submission::{BuildInfo, Outcome};
use artifact::ArtifactError;

/// Runs submissions as builds of one Buildkite pipeline.
#[derive(Debug, Clone)]
pub struct BuildkiteExecutor {
    client: BuildkiteClient,
    commit: String,
    branch: String,
}

impl BuildkiteExecutor {
    /// An executor for the configured pipeline, commit and branch.
    pub fn new(cfg: &Config) -> Result<BuildkiteExecutor, reqwest::Error> {
        Ok(BuildkiteExecutor {
            client: BuildkiteClient::new(cfg)?,
            commit: cfg.commit.clone(),
            branch: cfg.branch.clone(),
        })
    }

    /// The REST client.
    pub fn client(&self) -> &BuildkiteClient {
        &self.client
    }

    /// The create-build request for `job`: the payload (chunked when large) and the ids in
    /// the env, the ids in the meta-data.
    pub fn new_build(&self, job: &Job) -> NewBuild {
        let mut env: BTreeMap<String, String> = kernelkite_kernelbot::payload::to_env(&job.payload)
            .into_iter()
            .collect();
        env.insert("KERNELBOT_RUN_ID".into(), job.run_id.clone());
        env.insert("KERNELBOT_QUEUE".into(), job.queue.clone());
        env.insert("KERNELKITE_SUBMISSION_ID".into(), job.submission_id.clone());
        let meta_data = BTreeMap::from([
            ("run_id".to_string(), job.run_id.clone()),
            (
                "kernelkite_submission_id".to_string(),
                job.submission_id.clone(),
            ),
            ("queue".to_string(), job.queue.clone()),
        ]);
        NewBuild {
            commit: self.commit.clone(),
            branch: self.branch.clone(),
            message: format!(
                "kernelkite {} run {} on {}",
                job.mode, job.run_id, job.queue
            ),
            env,
            meta_data,
        }
    }
}

impl Executor for BuildkiteExecutor {
    fn name(&self) -> &'static str {
        "Buildkite"
    }

    fn launch<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Result<Launched, BoxError>> {
        Box::pin(async move {
            let b = self.client.create_build(&self.new_build(job)).await?;
            Ok(Launched {
                running: b.state == "running",
                build: BuildInfo {
                    id: b.id,
                    number: b.number,
                    web_url: b.web_url,
                },
            })
        })
    }

    fn cancel<'a>(&'a self, build: &'a BuildInfo) -> BoxFuture<'a, Result<bool, BoxError>> {
        Box::pin(async move {
            match self.client.cancel_build(build.number).await {
                Ok(_) => Ok(true),
                // 422: it already finished; nothing to cancel.
                Err(e) if e.status().is_some_and(|s| s.as_u16() == 422) => Ok(false),
                Err(e) => Err(e.into()),
            }
        })
    }

    fn collect<'a>(&'a self, build: &'a BuildStatus) -> BoxFuture<'a, Outcome> {
        Box::pin(async move {
            match artifact::fetch_result(&self.client, build.number).await {
                Ok(r) => Outcome::Succeeded(r),
                Err(ArtifactError::Missing { listed }) => Outcome::Failed(format!(
                    "build #{} finished with state {:?} without result.json{}; see {}",
                    build.number,
                    build.state,
                    artifact::listed_states(&listed),
                    build.web_url
                )),
                Err(e) => Outcome::Failed(format!(
                    "build #{} finished with state {:?} but its result.json could not be used: {}; see {}",
                    build.number,
                    build.state,
                    report(&e),
                    build.web_url
                )),
            }
        })
    }
}
